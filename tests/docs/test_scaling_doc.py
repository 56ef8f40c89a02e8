"""docs/scaling.md: its tables are what the stored results beside it (docs/scaling/*.json,
each the --json of a command the page names) hold, and every command of the page is
accounted for.

- ``trace-rl bench scale --trees docs/scaling/trees.parquet ...`` and ``trace-rl bench
  iteration-cost ...`` run here as printed, in a copy of ``docs/`` (seconds each), and write
  JSON of the stored results' shape;
- the measuring commands (``bench scale-calibrate``, ``bench workers``: Ray, ≈ 30 s each) are
  not run as printed: their smaller forms are ``bench/test_scale.py``'s calibration and
  ``rollout/test_ray_pool.py``'s tiny ``bench workers``.

The tables of the page are rendered here from the JSON (``render_*``) and must appear in it
verbatim: a figure copied by hand that drifts from its result fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.commands import commands, run_in_docs_copy

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "scaling.md"
RESULTS = REPO / "docs" / "scaling"
PRINTING = re.compile(r"trace-rl bench (scale --trees docs/scaling/|iteration-cost ).*")
MEASURING = {
    r"trace-rl bench scale-calibrate --checkpoint build/policy/calc .*": "bench/test_scale.py",
    r"trace-rl bench workers --checkpoint build/policy/calc .*": "rollout/test_ray_pool.py",
    r"trace-rl warmstart --task calc --output build/policy/calc.*": "test_cli_commands.py",
    r"trace-rl model import smollm2 --output build/models/smollm2": "support/models.py",
    r"trace-rl bench handoff --checkpoint build/(policy/calc|models/smollm2) .*": (
        "bench/test_handoff.py"
    ),
}


def render_pivot(data: dict[str, object], key: str, fmt: str) -> str:
    """Variants × W of one figure of a ``bench scale --json`` result."""
    runs: list[dict[str, object]] = data["runs"]  # type: ignore[assignment]
    ws = list(dict.fromkeys(int(r["workers"]) for r in runs))  # type: ignore[call-overload]
    lines = ["| variant | " + " | ".join(f"W={w}" for w in ws) + " |"]
    lines.append("|---|" + "--:|" * len(ws))
    for name in dict.fromkeys(str(r["variant"]) for r in runs):
        mine = {r["workers"]: r for r in runs if r["variant"] == name}
        cells = [format(mine[w][key], fmt) for w in ws]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_validation(data: dict[str, object]) -> str:
    rows: list[dict[str, float]] = data["validation"]  # type: ignore[assignment]
    lines = [
        "| run | measured tokens/s | predicted tokens/s | error | busy, measured "
        "| busy, predicted |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for v in rows:
        lines.append(
            f"| {v['run']} | {v['measured_tokens_per_s']:,.0f} | {v['predicted_tokens_per_s']:,.0f}"
            f" | {v['error']:+.1%} | {v['measured_busy']:.2f} | {v['predicted_busy']:.2f} |"
        )
    return "\n".join(lines)


def render_iteration_cost(data: dict[str, object]) -> str:
    rows: list[dict[str, object]] = data["rows"]  # type: ignore[assignment]
    lines = [
        "| model | design | workers × GPUs | M × N | update GPUs | policy GB | optimizer GB "
        "| S3 GB moved | S3 s (update's) | weights s | pods s | rollout s (use) | update s "
        "| iteration s | outside | first pull s |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        s: dict[str, int] = r["shape"]  # type: ignore[assignment]
        v: dict[str, float] = r  # type: ignore[assignment]
        lines.append(
            f"| Qwen3-{str(r['model']).upper()} | {r['design']} "
            f"| {s['workers']} × {s['gpus_per_worker']} "
            f"| {v['roots']} × {v['continuations']:.0f} | {s['update_gpus']} "
            f"| {v['policy_bytes'] / 1e9:.1f} | {v['optimizer_bytes'] / 1e9:.1f} "
            f"| {v['s3_bytes'] / 1e9:.1f} | {v['s3_s']:.0f} ({v['update_io_s']:.0f}) "
            f"| {v['reload_s']:.1f} | {v['pods_s']:.0f} "
            f"| {v['rollout_s']:.0f} ({v['rollout_utilisation']:.2f}) | {v['update_s']:.0f} "
            f"| {v['total_s']:.0f} | {v['outside_share']:.0%} | {v['image_pull_s']:.0f} |"
        )
    return "\n".join(lines)


def render_staleness(data: dict[str, object]) -> str:
    """The resident iteration at k = 0, 1, 2 of a ``bench iteration-cost --json`` result."""
    rows: list[dict[str, object]] = data["staleness"]  # type: ignore[assignment]
    lines = [
        "| model | rollout s | fit s | update s | sync s | pod + trees s "
        "| checkpoint s, k=0 / k≥1 | k=0 s | k=1 s | k=2 s | k≥1 bound | k=1 ÷ k=0 | k=2 ÷ k=0 |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|",
    ]
    for r in rows:
        v: dict[str, float] = r  # type: ignore[assignment]
        times: dict[str, float] = r["iteration_s"]  # type: ignore[assignment]
        checkpoint: dict[str, float] = r["checkpoint_s"]  # type: ignore[assignment]
        speedup: dict[str, float] = r["speedup"]  # type: ignore[assignment]
        lines.append(
            f"| Qwen3-{str(r['model']).upper()} | {v['rollout_s']:.1f} | {v['fit_s']:.1f} "
            f"| {v['update_s']:.1f} | {v['sync_s']:.1f} | {v['fixed_s']:.1f} "
            f"| {checkpoint['0']:.1f} / {checkpoint['1']:.1f} "
            + "".join(f"| {times[k]:.1f} " for k in "012")
            + f"| {r['bound']} "
            + "".join(f"| {speedup[k]:.2f}× " for k in "12")
            + "|"
        )
    return "\n".join(lines)


def render_handoff(data: dict[str, object]) -> str:
    """One ``bench handoff --json`` result: each mode's iterations, then the ratios."""
    policy = float(data["policy_bytes"])  # type: ignore[arg-type]
    lines = [
        "| mode | iteration | S3 MB | S3 / policy | weights into engines s | iteration s "
        "| checkpoint |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    modes: dict[str, list[dict[str, float]]] = data["modes"]  # type: ignore[assignment]
    for mode, rows in modes.items():
        for r in rows:
            lines.append(
                f"| {mode} | {r['iteration']:.0f} | {r['s3_bytes'] / 1e6:,.2f} "
                f"| {r['s3_bytes'] / policy:.4f} | {r['sync_seconds']:.2f} "
                f"| {r['iteration_seconds']:.1f} | {'yes' if r['checkpoint'] else ''} |"
            )
    ratios: dict[str, float] = data["ratios"]  # type: ignore[assignment]
    lines.append("")
    lines.append(
        f"Resident iterations without a checkpoint: S3 bytes {ratios['s3_share']:.4f} of the "
        f"policy's {policy / 1e6:,.1f} MB; weights into the engines "
        f"{ratios['sync_speedup']:.1f}× faster than the S3 mode's download and reload; "
        f"iterations {ratios['iteration_speedup']:.2f}× faster."
    )
    return "\n".join(lines)


def render_continuous(data: dict[str, object]) -> str:
    """The async and continuous drivers of one ``bench scale --json`` result, W by W."""
    runs: list[dict[str, float]] = data["runs"]  # type: ignore[assignment]
    by = {(r["variant"], int(r["workers"])): r for r in runs}
    lines = [
        "| W | async makespan s | continuous makespan s | gain | utilisation async → continuous |",
        "|--:|--:|--:|--:|--:|",
    ]
    for w in sorted({int(r["workers"]) for r in runs}):
        a, c = by[("trace-async", w)], by[("trace-continuous", w)]
        lines.append(
            f"| {w} | {a['makespan_s']:.3g} | {c['makespan_s']:.3g} "
            f"| {a['makespan_s'] / c['makespan_s']:.2f}× "
            f"| {a['utilisation']:.2f} → {c['utilisation']:.2f} |"
        )
    return "\n".join(lines)


def stored(name: str) -> dict[str, object]:
    return json.loads((RESULTS / name).read_text())  # type: ignore[no-any-return]


def test_the_readme_links_the_page() -> None:
    assert "(docs/scaling.md)" in (REPO / "README.md").read_text()


def test_every_command_is_accounted_for() -> None:
    lines = commands(PAGE.read_text())
    assert any(PRINTING.fullmatch(c) for c in lines)
    for command in lines:
        smaller = [where for pattern, where in MEASURING.items() if re.fullmatch(pattern, command)]
        assert PRINTING.fullmatch(command) or smaller, command
        for where in smaller:
            words = command.split()
            name = words[2] if words[1] == "bench" else words[1]
            assert name in (REPO / "tests" / where).read_text(), (command, where)
    for command in lines:  # every stored result and figure is made by a command of the page
        for written in re.findall(
            r"(?:--json|--plot|--output|--trees) (docs/scaling/\S+)", command
        ):
            assert (REPO / written).is_file(), written
            if written.endswith(".png"):
                assert f"(scaling/{Path(written).name})" in PAGE.read_text(), written


@pytest.mark.parametrize(
    ("name", "key", "fmt"),
    [
        ("cpu.json", "makespan_s", ".3g"),
        ("cpu.json", "utilisation", ".2f"),
        ("h100-8b.json", "makespan_s", ".3g"),
        ("h100-8b.json", "utilisation", ".2f"),
        ("h100-8b.json", "cache_hit_tokens", ",d"),
    ],
)
def test_each_table_is_the_stored_result(name: str, key: str, fmt: str) -> None:
    assert render_pivot(stored(name), key, fmt) in PAGE.read_text(), (name, key)


def test_the_validation_and_cost_tables_are_the_stored_results() -> None:
    page = PAGE.read_text()
    assert render_validation(stored("cpu.json")) in page
    assert render_iteration_cost(stored("iteration-cost.json")) in page
    assert render_staleness(stored("iteration-cost.json")) in page
    for name in ("handoff-tiny.json", "handoff-smollm2.json"):
        assert render_handoff(stored(name)) in page, name
    assert render_continuous(stored("h100-8b.json")) in page
    measured = stored("workers.json")["runs"]
    validation = stored("cpu.json")["validation"]
    # The measured side of the validation is the stored bench workers run, run for run.
    assert [v["measured_tokens_per_s"] for v in validation] == [  # type: ignore[index, union-attr]
        r["tokens_per_s"]
        for r in measured  # type: ignore[index, union-attr]
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [c for c in commands(PAGE.read_text()) if PRINTING.fullmatch(c)]
)
def test_runs_as_printed(command: str, tmp_path: Path) -> None:
    run_in_docs_copy(command, REPO, tmp_path)
    written = re.search(r"--json (\S+)", command)
    assert written, command
    fresh = json.loads((tmp_path / written.group(1)).read_text())
    old = json.loads((REPO / written.group(1)).read_text())
    if "runs" in old:  # the same simulations (their env steps are timed afresh)
        assert [(r["variant"], r["workers"]) for r in fresh["runs"]] == [
            (r["variant"], r["workers"]) for r in old["runs"]
        ]
        assert fresh["config"]["workers"] == [1, 2, 8, 64, 256]
    else:
        assert [r["model"] for r in fresh["rows"]] == [r["model"] for r in old["rows"]]
