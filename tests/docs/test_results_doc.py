"""docs/results.md: every figure in its tables is what the repository prints from the stored
results beside it (docs/results/*.json, each the --json of the measuring command the page
names), and every command of the page is accounted for.

- ``trace-rl compare --from-json docs/results/NAME.json ...`` runs here as printed, in a copy of
  ``docs/``, and its whole Markdown output (header line included) must appear in the page; the
  plot it writes is the page's ``docs/results/NAME.png`` byte for byte (the README shows
  ``default.png``);
- ``trace-rl predictor score RUN --plot`` (a run of the comparison) is not run either: the page
  shows its plot; ``train/test_loop.py`` scores a smaller run;
- the measuring commands (``trace-rl compare --task calc-mix ... --json build/results/NAME.json``,
  10–30 min each on 2 cores, the JSON then copied to docs/results/) are not run: their smaller
  form is ``test_cli_commands.py``'s compare and ``train/test_tables.py``'s tables; each must
  name a JSON the page reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.commands import commands, run_in_docs_copy

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "results.md"
FROM_JSON = re.compile(r"trace-rl compare --from-json docs/results/(\w+)\.json( .*)?")
MEASURE = re.compile(r"trace-rl compare --task calc-mix .*--json build/results/(\w+)\.json( .*)?")
SCORE = re.compile(r"trace-rl predictor score build/results/\S+ --plot build/results/(\S+\.png)")
PRINTING = [c for c in commands(PAGE.read_text()) if FROM_JSON.fullmatch(c)]


def test_the_readme_links_the_page() -> None:
    assert "(docs/results.md)" in (REPO / "README.md").read_text()


def test_every_command_is_accounted_for() -> None:
    lines = commands(PAGE.read_text())
    measured = {m.group(1) for c in lines if (m := MEASURE.fullmatch(c))}
    printed = {m.group(1) for c in lines if (m := FROM_JSON.fullmatch(c))}
    for command in lines:
        assert (
            FROM_JSON.fullmatch(command) or MEASURE.fullmatch(command) or SCORE.fullmatch(command)
        ), command
    for plot in {m.group(1) for c in lines if (m := SCORE.fullmatch(c))}:
        assert f"(results/{plot})" in PAGE.read_text(), plot  # the page shows what it made
    assert printed and printed == measured  # each stored result: how it was made, how it prints
    for name in printed:
        assert (REPO / "docs" / "results" / f"{name}.json").is_file(), name


@pytest.mark.parametrize("command", PRINTING)
def test_each_table_is_what_the_stored_result_prints(command: str, tmp_path: Path) -> None:
    run_in_docs_copy(command, REPO, tmp_path)
    written = re.search(r"--markdown (\S+)", command)
    assert written, f"{command}: the page's tables come from --markdown"
    text = (tmp_path / written.group(1)).read_text()
    assert text.strip() in PAGE.read_text(), f"docs/results.md does not hold what {command} wrote"
    plot = re.search(r"--plot (\S+)", command)
    shown = REPO / "docs" / "results" / Path(plot.group(1)).name if plot else None
    if plot and shown and shown.exists():
        made = (tmp_path / plot.group(1)).read_bytes()
        assert made == shown.read_bytes(), f"{command} plots other pixels than {shown.name}"


def test_the_retrieval_tables_are_the_stored_bench() -> None:
    """The retrieval section's two tables and its build time are docs/results/retriever.json,
    the --json of the `trace-rl bench retriever` the section names, as the command prints it."""
    import json

    data = json.loads((REPO / "docs" / "results" / "retriever.json").read_text())
    text = PAGE.read_text()
    section = text[text.index("## The retrieval service") :]
    section = section[: section.index("\n## ")]
    assert "`trace-rl bench retriever --json build/bench/retriever.json`" in section
    assert f"took {data['build_seconds']:.0f} s" in section
    for level in data["levels"]:
        row = (
            f"| {level['clients']} | {level['qps']:.1f} | {level['vs_serial']:.2f}× | "
            f"{level['p50_ms']:.1f} | {level['p99_ms']:.1f} | {level['mean_batch']:.1f} |"
        )
        assert row in section, row
    recall = data["recall"]
    for kind, name in (("dense", "dense"), ("bm25", "BM25")):
        got = recall[kind]
        keys = ("recall@1", "recall@3", "recall@10", "first_hop@10", "hop@1", "hop@3")
        row = f"| {name} | " + " | ".join(f"{got[k]:.3f}" for k in keys) + " |"
        assert row in section, row
    assert f"{recall['questions']} eval questions" in section
