"""The pipeline end to end through KFP's local runner (what `make run` does, smaller), twice
with one run name: the first run warm-starts, the second resumes from the checkpoint the first
registered. Every step runs as a subprocess; the artifacts are what a cluster run would store.

The steps run from the CPU image's package, not the checkout: KFP's runner starts each step
with ``sys.executable`` and the run's Ray head (whose workers hold the session's actors) is that
Python's ``ray``, so both are the venv ``installed_image("trace")`` (tests/support/
image_context.py: the image's build context installed as its Dockerfile does), in a working
folder outside the checkout. A module the checkout has and the image lacks fails the run."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from support import parity
from support.browser import find_chromium, headless
from support.commands import run_tree_commands
from support.image_context import ImageVenv

from pipelines.local import LocalRun, print_result, run_local
from trace_core.store.artifacts import open_store
from trace_core.store.registry import CheckpointRegistry
from trace_core.store.schema import read_trees
from trace_core.train.contract import PipelineConfig, PipelineParameters
from trace_core.train.loop import train
from trace_core.train.record import read_log

pytestmark = [
    pytest.mark.slow,
    # Expected of KFP's local runner: Kubernetes settings are no-ops, the images are not used.
    pytest.mark.filterwarnings("ignore:.*have no effect in the current local runner"),
    pytest.mark.filterwarnings("ignore:You may be attemping to run a task"),
]

TINY = {"warmstart_steps": 20, "prompts": 16, "eval_tasks": 8, "eval_k": 1, "max_tokens": 16}


def metrics_of(task_dir: Path, name: str = "metrics") -> dict[str, float]:
    """What a step logged with ``log_metric`` (the Metrics artifact's metadata)."""
    body = json.loads((task_dir / "executor_output.json").read_text())
    (artifact,) = body["artifacts"][name]["artifacts"]
    return artifact["metadata"]


@pytest.mark.long  # ≈ 3 min: every step a KFP subprocess
def test_pipeline_runs_through_kfp_local(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    s3_env: dict[str, str],
    installed_image: Callable[[str], ImageVenv],
) -> None:
    """Four iterations with a checkpoint every one and two kept (``--iterations 4
    --checkpoint-every 1 --keep-checkpoints 2``), the registry on the test S3, the trees of the
    next iteration growing while the trainers update (max_staleness 1): the run's own Ray head
    holds its trainer and engine actors from open session to close session, and the run leaves
    two checkpoints and no session state in the store. The steps and the Ray head run on the
    CPU image's package."""
    image = installed_image("trace")
    workdir = tmp_path / "workdir"  # the steps' (the image's WORKDIR): not the checkout
    workdir.mkdir()
    settings = json.dumps(TINY)
    store = "s3://trace/local-run"
    params = PipelineParameters(
        iterations=4,
        max_staleness=1,
        budget=8,
        run_name="ci",
        settings_json=settings,
        checkpoint_every=1,
        keep_checkpoints=2,
        store_uri=store,
    )
    run = LocalRun(output=tmp_path, params=params)
    terminal = io.StringIO()
    with image.runs_steps(workdir):
        result = run_local(run, say=lambda _line: None, terminal=terminal)

    # The terminal: one line per step, one per iteration; the runner's output in the log.
    shown = terminal.getvalue().splitlines()
    steps = [line.split()[1] for line in shown if line.split()[2:4][-1:] == ["s"]]
    # The exit handler's release runs last, however the run ended; this one held nothing more.
    assert steps[:3] == ["prep", "schedule", "warmstart"]
    assert steps[-2:] == ["report", "release-session"]
    cycle = ["iterate"] * 4  # one task, run once per iteration: a loop over the run parameter
    expected = ["prep", "schedule", "warmstart", "open-session", *cycle, "close-session"]
    expected.append("report")
    expected.append("release-session")
    assert sorted(steps) == sorted(expected), shown
    assert [line.split()[:2] for line in shown if " iteration " in f" {line}"] == [
        ["iteration", "1"],
        ["iteration", "2"],
        ["iteration", "3"],
        ["iteration", "4"],
    ], shown
    assert not any('"executor_input"' in line or "outputFile" in line for line in shown)
    assert any(line.split()[1:3] == ["warm", "start:"] for line in shown), shown  # progress
    log = result.log.read_text()
    assert "Executing task" in log and '"outputFile"' in log and "progress: warm start" in log

    # Warm start branch, four iterations of M=8 roots with N=2 continuations = 16 units each.
    tasks = {p.name for p in result.run_dir.iterdir() if p.is_dir()}
    assert {"prep", "warmstart", "report"} <= tasks and "load" not in tasks
    assert len(result.trees) == 4
    for i, path in enumerate(result.trees, start=1):
        trees = read_trees(path)
        assert {t.info.iteration for t in trees} == {i}
        assert {t.info.run_id for t in trees} == {"ci"}
        assert sum(t.units for t in trees) == 8 * (1 + 2 / 2)
    moved, saved = {}, {}
    for folder in result.run_dir.glob("for-loop-*-iteration-*/iterate"):
        logged = metrics_of(folder)
        for key in ("prompt_effective_ratio", "anchor_effective_ratio", "mixed_groups", "tokens"):
            assert key in logged, (folder, key)
        assert logged["units"] == 16.0
        moved[int(logged["iteration"])] = logged["s3_bytes"]
        saved[int(logged["iteration"])] = logged["checkpoint_bytes"]
    # The policy and optimizer state stay on the run's actors: S3 carries a checkpoint every
    # iteration, written in the background while the next one rolls out and committed by its
    # step (the last one's by its own); the rest is the registry's manifests. Once a newer one
    # is committed, those beyond the newest two are deleted: the store keeps iterations 3 and
    # 4, latest.json names 4, and the run's scratch (its session's states and trees, its jobs'
    # staging) went when it ended (close-session, then the exit handler's release).
    kept = open_store(store)
    registry = CheckpointRegistry(kept)
    (third, fourth) = registry.checkpoints("ci")
    assert (third.iteration, fourth.iteration) == (3, 4)
    names = [c.key.rsplit("/", 1)[-1] for c in (third, fourth)]
    assert {o.key.split("/")[2] for o in kept.list_objects("checkpoints/ci")} == {
        "latest.json",
        *names,
    }
    assert json.loads(kept.get_bytes("checkpoints/ci/latest.json"))["folder"] == names[1]
    assert kept.list_objects("sessions") == [] and kept.list_objects("staging") == []
    deleted = re.findall(rf"deleted checkpoint {store}/checkpoints/ci/(iter-\d+)-", log)
    assert deleted == ["iter-000001", "iter-000002"], deleted  # by step 4, after each commit
    assert saved[1] == 0 and saved[2] > 0 and saved[3] > 0, saved
    assert saved[4] == sum(f.bytes for c in (third, fourth) for f in c.files)
    # The trainers read each iteration's trees in the store: iteration 1's, grown in its own
    # step, put there first (written and read: the bytes of its trees artifact, twice); the
    # others in the state they came in (grown ahead by the step before, published with its
    # state: read only). Iteration 4's are those iteration 3's checkpoint kept from that state.
    ahead_4 = next(f.bytes for f in third.files if f.path == "ahead/0004/trees.parquet")
    assert moved[1] == 2 * result.trees[0].stat().st_size, moved
    assert moved[2] > 0 and moved[3] > 0 and moved[4] == ahead_4, (moved, ahead_4)
    pipeline_config = PipelineConfig.from_json(
        json.loads((result.run_dir / "prep" / "executor_output.json").read_text())[
            "parameterValues"
        ]["config_json"]
    )
    assert pipeline_config.keep_checkpoints == 2
    final = metrics_of(result.run_dir / "close-session")

    # The pipeline's log is the one `trace-rl train` writes for the same config and seed: the
    # iterations ran through the same function (``train.phases``), on the run's actors.
    config = pipeline_config.train
    loop = train(replace(config, output=tmp_path / "loop" / "ci", ray_address=None))
    # The log the last checkpoint holds: every iteration's, as the steps handed it on.
    newest = registry.download(fourth, tmp_path / "checkpoint-4")
    log_4 = read_log(newest / "policy")
    parity.same_run_but_arrival_order(log_4, loop)
    # max_staleness 1: iterations 1 and 2 updated on trees of the start's weights, 3 on
    # iteration 1's, 4 on 2's; the trees say which version grew them.
    assert [r.staleness for r in log_4] == [0, 0, 1, 1, 1]
    versions = [{t.info.policy_version for t in read_trees(path)} for path in result.trees]
    assert versions == [{0}, {0}, {1}, {2}]
    assert (newest / "ahead" / "0005" / "trees.parquet").is_file()  # grown ahead, kept
    # The logged metrics are the step's report; pass@1 is greedy on 8 tasks: a count out of 8.
    assert final["accuracy_pass1"] == result.final_eval["pass1"]["all"]  # type: ignore[index]
    assert final["accuracy_mean_at_1"] == result.final_eval["mean_k"]["all"]  # type: ignore[index]
    assert final["eval_tokens"] == result.final_eval["tokens"]
    assert (8 * final["accuracy_pass1"]).is_integer()
    assert str(result.final_eval["checkpoint"]).startswith(f"{store}/checkpoints/ci/iter-000004-")

    # The report is a file of its own with its extension, which a browser renders as a page.
    assert result.report_html.suffix == ".html" and not result.report_html.is_symlink()
    html = result.report_html.read_text()
    assert html.startswith("<!doctype html>") and '<section class="tree"' in html
    dom = headless(find_chromium(), "--dump-dom", result.report_html.as_uri(), cwd=tmp_path)
    assert dom.returncode == 0 and ">expand all</button>" in dom.stdout, dom.stderr[-2000:]
    summary = result.summary_md.read_text()
    assert "## Held-out accuracy" in summary and "| node_id |" not in summary.split("## Trees")[0]
    assert "| iteration | tree_id | prompt_id | node_id |" in summary
    # The view holds the most mixed trees of every iteration, and the summary says where each
    # iteration's trees are and how to open them: its commands run as printed.
    assert all(f"run ci · iteration {i} ·" in html for i in (1, 2, 3, 4))
    assert all(f"| {i} | `" in summary for i in (1, 2, 3, 4)), summary
    done = run_tree_commands(summary, tmp_path)
    assert (tmp_path / "trees.html").read_text().count('<section class="tree"') == 3
    assert "trace" in done.stdout, done.stdout  # the query: iteration 4, strategy trace

    # The commands the run prints to look at the trees run as printed, in a shell whose PATH
    # does not hold this environment's scripts (a fresh clone after `make run`).
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != Path(sys.executable).parent
    )
    monkeypatch.setenv("PATH", path)
    printed: list[str] = []
    print_result(result, say=printed.append)
    commands = [line.strip() for line in printed if " inspect " in line]
    assert [c.split()[1:3] for c in commands] == [
        ["inspect", "summary"],
        ["inspect", "show"],
        ["inspect", "html"],
    ]
    outputs = []
    for command in commands:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, env=os.environ)
        assert done.returncode == 0, (command, done.stdout, done.stderr[-2000:])
        outputs.append(done.stdout)
    assert "trace" in outputs[1] and "iteration 4" in outputs[1]
    # Each iteration's line says what it moved through S3: its trees, to the trainers.
    (first,) = [line for line in printed if line.startswith("  iteration 1:")]
    assert ", S3 " in first and ", S3 0 B → " not in first, first
    assert result.curves is not None and result.curves.read_bytes().startswith(b"\x89PNG")
    assert f"plot: {result.curves} " in "\n".join(printed)
    # The accuracy change, paired task by task, with its interval (8 tasks: a wide one).
    (change,) = [line for line in printed if "change (final − start" in line]
    assert "each of the 8 tasks against itself, 95% interval): pass@1 " in change
    assert "| change (95% interval) |" in summary
    assert result.trees[-1].with_suffix(".html").is_file()  # inspect html: beside its input

    # The same run name again (a recurring run): the Else branch loads the registered
    # checkpoint and goes on with iteration 5.
    with image.runs_steps(workdir):
        again = run_local(replace(run, params=replace(params, iterations=1)), say=lambda _: None)
    tasks = {p.name for p in again.run_dir.iterdir() if p.is_dir()}
    assert "load" in tasks and "warmstart" not in tasks
    assert metrics_of(again.run_dir / "load")["resumed_iteration"] == 4
    assert [read_trees(p)[0].info.iteration for p in again.trees] == [5]
    # Iteration 5 updates on the trees the first run grew ahead (on iteration 3's weights),
    # which iteration 4's checkpoint kept: as the unbroken run would have, none grown again.
    ahead = read_trees(newest / "ahead" / "0005" / "trees.parquet")
    (resumed,) = again.trees
    assert {t.info.policy_version for t in read_trees(resumed)} == {3}
    parity.same_trees_but_order(read_trees(resumed), ahead)
    assert (again.start_eval["iteration"], again.final_eval["iteration"]) == (4, 5)
    # Its checkpoint and the one it resumed from stay; its scratch went too.
    assert [c.iteration for c in registry.checkpoints("ci")] == [4, 5]
    assert kept.list_objects("sessions") == [] and kept.list_objects("staging") == []
    # The first run's iterations keep their links beside the second's.
    assert sorted(p.name for p in again.trees_dir.glob("iteration-*.parquet")) == [
        f"iteration-000{i}.parquet" for i in (1, 2, 3, 4, 5)
    ]
