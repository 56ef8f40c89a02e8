"""The pipeline's iterations on a run's session (``train.steps.session``), on a loopback Ray head
and the test SeaweedFS: the steps chained by hand give the record, log, trees and weights that
``trace-rl train`` gives on the same seed, move no policy or optimizer bytes through S3 except
checkpoints, and survive a lost trainer or engine actor as the issue of each case says; a
retried iteration is not applied twice, a second run of a run_name is refused and one that does
not fit holds nothing, and a failed run's exit handler frees what it held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import ray
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from support import parity

from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.ray_worker import KEPT_NAMESPACE
from trace_core.store.artifacts import open_store
from trace_core.store.registry import CheckpointRegistry
from trace_core.store.schema import read_trees
from trace_core.train.contract import PipelineConfig, PipelineParameters, StepCall
from trace_core.train.dispatch import start_point
from trace_core.train.loop import train
from trace_core.train.record import read_log
from trace_core.train.steps.finish import report_step
from trace_core.train.steps.session import (
    STATE,
    RunState,
    SessionLostError,
    close_session,
    iterate_step,
    open_session_step,
)
from trace_core.train.steps.start import load_step, prep_step
from trace_core.train.trainer_group import TRAINER_NAMESPACE, read_written

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.long]

SETTINGS = {
    "group": 2,
    "prompts": 12,
    "max_tokens": 6,
    "eval_tasks": 4,
    "eval_k": 1,
    "eval_every": 1,
    "train_workers": 1,
    "update": {"lr": 1e-2, "minibatch": 4, "skip_flat_paths": False},
}
ENGINE = EngineConfig(workers=1, keep_alive_s=600)


@dataclass
class Chain:
    config: PipelineConfig
    root: Path
    metrics: dict[int, dict[str, float]]


@pytest.fixture(scope="module")
def head(start_ray_head, seaweed) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A loopback head whose actors reach the test S3 (as a cluster's pods hold its Secret)."""
    with start_ray_head(env=seaweed.env()) as running:
        yield running.address


@pytest.fixture(scope="module")
def store(seaweed) -> Iterator[str]:  # type: ignore[no-untyped-def]
    env = seaweed.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield "s3://trace/session"
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pipeline_config(
    init: Path, root: Path, head: str, store: str, name: str, kfp_run: str = "", **settings: object
) -> PipelineConfig:
    """prep's config of the run, on the loopback head (the address the local pipeline gives its
    steps), with its session's name: ``name``, or prep's from the KFP run's id ``kfp_run``."""
    params = PipelineParameters(
        task="calc",
        base_model_uri=str(init),
        budget=6,
        iterations=3,
        max_staleness=0,  # rollout, then update: k >= 1 is tests/pipelines/test_local_run.py's
        checkpoint_every=2,
        run_name=name,
        store_uri=store,
        rollout_workers=1,
        settings_json=json.dumps({**SETTINGS, **settings}),
    )
    prep = prep_step(params, root / "prompts", suite=parity.ParitySuite(), pipeline_run_id=kfp_run)  # type: ignore[arg-type]
    config = PipelineConfig.from_json(prep.config_json)
    engine = replace(config.train.engine, keep_alive_s=ENGINE.keep_alive_s)
    return replace(
        config,
        train=replace(config.train, engine=engine, ray_address=head),
        engine_name=config.engine_name if kfp_run else name,
    )


def chain(config: PipelineConfig, root: Path, iterations: range) -> Chain:
    """open, then the iterations, as the pipeline wires them (state i-1 → iteration i)."""
    suite = parity.ParitySuite()
    metrics: dict[int, dict[str, float]] = {}
    if iterations.start == 1:
        load_step(config, root / "policy-0", root / "predictor-0", root / "optimizer-0")
        folders = {name: str(root / f"{name}-0") for name in ("policy", "predictor", "optimizer")}
        opening = {"prompts": str(root / "prompts"), **folders}  # load's references, resolved
        start = start_point(StepCall("open-session", 0, opening, {"state": str(root / "state-0")}))
        metrics[0] = open_session_step(config, root / "prompts", start, root / "state-0", suite)  # type: ignore[arg-type]
    for i in iterations:
        metrics[i] = iterate_step(
            config, i, root / "prompts", root / f"state-{i - 1}", root / f"state-{i}",
            root / f"trees-{i}", suite,  # type: ignore[arg-type]
        )  # fmt: skip
    return Chain(config, root, metrics)


@pytest.fixture(scope="module")
def unbroken(
    init: Path, head: str, store: str, mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> Chain:
    """The run's steps, logged to MLflow (the ``mlflow_tracking_uri`` parameter), its report
    step included."""
    root = tmp_path_factory.mktemp("session")
    config = replace(pipeline_config(init, root, head, store, "unbroken"), tracking_uri=mlflow_uri)
    done = chain(config, root, range(1, 4))
    log = read_log(root / "state-3")
    evals = log[0].eval, log[-1].eval
    report_step(config, root / "trees-3", root / "state-3", *evals, root / "html", root / "md")  # type: ignore[arg-type]
    close_session(config, root / "state-3")
    return done


def test_the_pipeline_run_is_one_mlflow_run_with_its_report(
    unbroken: Chain, mlflow_uri: str, tmp_path: Path
) -> None:
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("trace")  # the default experiment
    assert experiment is not None
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`trace.run` = 'unbroken'"
    )
    assert run.info.run_name == "unbroken" and run.info.status == "FINISHED"
    assert (run.data.params["run_name"], run.data.params["budget"]) == ("unbroken", "6")
    log = read_log(unbroken.root / "state-3")
    logged = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "iteration")
    )
    assert logged == [(i, float(i)) for i in range(4)]
    ratio = client.get_metric_history(run.info.run_id, "rollout/prompt_effective_ratio")
    assert sorted((m.step, m.value) for m in ratio) == [
        (r.iteration, pytest.approx(r.rollout["prompt_effective_ratio"])) for r in log[1:]
    ]
    # What each step moved through S3, as its KFP metrics say.
    saved = client.get_metric_history(run.info.run_id, "storage/checkpoint_bytes")
    assert sorted((m.step, m.value) for m in saved) == [
        (i, unbroken.metrics[i]["checkpoint_bytes"]) for i in (1, 2, 3)
    ]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"report.html", "summary.md", "curves.png"}
    summary = client.download_artifacts(run.info.run_id, "summary.md", str(tmp_path))
    assert Path(summary).read_text() == (unbroken.root / "md").read_text()


def test_the_session_steps_give_the_loops_run_and_move_only_checkpoints(
    init: Path, head: str, store: str, tmp_path: Path, unbroken: Chain
) -> None:
    loop_config = replace(unbroken.config.train, output=tmp_path / "unbroken", engine=ENGINE)
    records = train(loop_config, suite=parity.ParitySuite())  # type: ignore[arg-type]
    log = read_log(unbroken.root / "state-3")
    # Both drive their engine actor continuously: its running batches take other shapes in
    # the two runs, and the turns come back in other orders.
    parity.same_run_but(log, records, parity.ROUNDING | parity.ARRIVAL_ORDER)
    for i in (1, 2, 3):
        mine = read_trees(unbroken.root / f"trees-{i}" / "trees.parquet")
        theirs = read_trees(tmp_path / "unbroken" / "iterations" / f"{i:04d}" / "trees.parquet")
        parity.same_trees_but_order(mine, theirs)
    registry = CheckpointRegistry(open_store(store))
    checkpoint = registry.latest("unbroken")
    assert checkpoint is not None and checkpoint.iteration == 3
    got = registry.download(checkpoint, tmp_path / "registered")
    a = load_file(str(got / "policy" / "model.safetensors"))
    b = load_file(str(tmp_path / "unbroken/iterations/0003/policy/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # the update's rounding, above
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    assert [r.iteration for r in read_log(got / "policy")] == [0, 1, 2, 3]
    # S3 carries the checkpoints: none on iteration 1; iteration 2's is written in the
    # background while iteration 3 rolls out (its step commits it), the last one at once.
    # And each iteration's trees, which its step puts in the store and the trainer reads there
    # (the store is the hand-off): written once and read once; nothing else.
    moved = {i: unbroken.metrics[i]["s3_bytes"] for i in (1, 2, 3)}
    saved = {i: unbroken.metrics[i]["checkpoint_bytes"] for i in (1, 2, 3)}
    second, third = registry.checkpoints("unbroken")[-2:]
    assert (second.iteration, third.iteration) == (2, 3) and third == checkpoint
    sessions = open_store(f"{store}/sessions/unbroken")
    stored = {i: sessions.list_objects(f"trees-{i:04d}") for i in (1, 2, 3)}
    assert all(len(files) == 1 for files in stored.values()), stored
    assert moved == {i: 2 * files[0].size for i, files in stored.items()}, moved
    assert saved == {1: 0, 2: 0, 3: sum(f.bytes for c in (second, third) for f in c.files)}
    state = RunState.from_json((unbroken.root / "state-2" / STATE).read_text(), "state-2")
    assert (state.checkpoint, state.pending) == (0, 2)  # committed by iteration 3's step


def _kill(actor_name: str, namespace: str, head: str) -> None:
    """SIGKILL the process of the named actor on the head at ``head``."""
    with ray.init(address=head, namespace=namespace, logging_level="error"):
        actor = ray.get_actor(actor_name, namespace=namespace)
        os.kill(int(ray.get(actor.pid.remote())), signal.SIGKILL)


def _kill_trainer(name: str, head: str) -> None:
    _kill(f"{name}-trainer-0", TRAINER_NAMESPACE, head)


def _written(state_dir: Path, store: str) -> None:
    """Wait until the trainers have written the checkpoint the state says they are writing in
    the background (its ``written.json`` is stored last)."""
    state = RunState.from_json((state_dir / STATE).read_text(), str(state_dir))
    assert state.pending is not None and state.pending_folder is not None
    registry = CheckpointRegistry(open_store(store))
    uri = registry.store.uri(state.pending_folder)
    for _ in range(600):
        if read_written(uri) is not None:
            return
        time.sleep(0.2)
    raise AssertionError(f"{uri}: not written in 120 s")


def test_a_lost_trainer_is_rebuilt_from_the_newest_checkpoint_or_the_step_says_how_to_resume(
    init: Path, head: str, store: str, tmp_path: Path, unbroken: Chain
) -> None:
    store = f"{store}-faults"  # the same run name as the unbroken run, a registry of its own
    config = pipeline_config(init, tmp_path, head, store, "unbroken")
    chain(config, tmp_path, range(1, 2))
    _kill_trainer("unbroken", head)  # iteration 1 holds no checkpoint: its training is lost
    with pytest.raises(SessionLostError, match="the newest checkpoint is its start") as lost:
        chain(config, tmp_path, range(2, 3))
    assert "submit the run again with run_name unbroken" in str(lost.value)
    assert not (tmp_path / "state-2").exists()  # nothing half-written
    assert close_session(config, tmp_path / "state-1") == 1  # its engine actor (the head's CPUs)

    # Resubmitted: the same steps from the start; the engine actor dies after iteration 1 (the
    # next step's engine gets the current weights by broadcast), the trainer after iteration
    # 2's checkpoint (iteration 3 rebuilds it from there); the run ends as the unbroken one.
    again = tmp_path / "again"
    config = replace(pipeline_config(init, again, head, store, "unbroken"), engine_name="again")
    chain(config, again, range(1, 2))
    _kill("again-0", KEPT_NAMESPACE, head)
    chain(config, again, range(2, 3))
    _written(again / "state-2", store)  # iteration 2's checkpoint, written in the background
    _kill_trainer("again", head)
    chain(config, again, range(3, 4))  # commits it from what the trainers wrote, rebuilds
    close_session(config, again / "state-3")
    # The restarted engine samples the same tokens; see parity.same_run_but_rounding.
    parity.same_run_but_rounding(read_log(again / "state-3"), read_log(unbroken.root / "state-3"))


def test_a_killed_ray_head_leaves_the_registry_and_the_run_goes_on_from_its_checkpoint(
    init: Path,
    start_ray_head,
    seaweed,
    store: str,
    tmp_path: Path,
    unbroken: Chain,  # type: ignore[no-untyped-def]
) -> None:
    """The Ray head dies (every process of it SIGKILLed) after iteration 2's checkpoint: the
    registry holds that checkpoint whole; on a new head, iteration 3 starts the session again
    from it and the run ends as the unbroken one."""
    from pipelines.ray_head import session_pids

    store = f"{store}-head"
    with start_ray_head(env=seaweed.env()) as first:
        config = pipeline_config(init, tmp_path, first.address, store, "unbroken")
        chain(config, tmp_path, range(1, 3))
        _written(tmp_path / "state-2", store)
        for pid in session_pids(first.pid):
            os.kill(pid, signal.SIGKILL)
    registry = CheckpointRegistry(open_store(store))
    assert registry.checkpoints("unbroken") == []  # written, not yet committed
    with start_ray_head(env=seaweed.env()) as second:
        config = replace(config, train=replace(config.train, ray_address=second.address))
        chain(config, tmp_path, range(3, 4))
        close_session(config, tmp_path / "state-3")
    assert [c.iteration for c in registry.checkpoints("unbroken")] == [2, 3]
    # New engines on the new head: the same tokens, π_old rounded apart in the last bits.
    parity.same_run_but_rounding(
        read_log(tmp_path / "state-3"), read_log(unbroken.root / "state-3")
    )


def _held(head: str, prefix: str) -> list[str]:
    """The live trainer and engine actors, and the placement groups not removed, whose names
    start with ``prefix``, looked up without calling them."""
    from ray.util.placement_group import placement_group_table

    with ray.init(address=head, logging_level="error"):
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        table = placement_group_table().values()
        groups = [f"group {g['name']}" for g in table if g["state"] != "REMOVED"]
    return sorted(n for n in actors + groups if n.startswith((prefix, f"group {prefix}")))


def test_a_failed_run_is_released_and_runs_side_by_side_are_whole_or_refused(
    init: Path, head: str, store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's session named from its KFP run's id: its retried iteration is not applied twice;
    while it holds the head's two CPUs (a trainer, an engine), a second run of its run_name is
    refused, and a run of another name cannot place its trainer and engine (one group, all or
    nothing), so it stops with the shortfall, holding nothing. The first run then fails (no
    close-session): the exit handler's release, from the run's name and KFP run id alone, frees
    all it held."""
    from trace_core.rollout.placement import PlacementError
    from trace_core.train.steps.release import release_step

    kfp_run = "0a1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
    first = pipeline_config(init, tmp_path, head, store, "freed", kfp_run)
    assert first.engine_name == "freed-0a1b2c3d"
    chain(first, tmp_path, range(1, 2))
    # Iteration 1 again (a KFP retry of a step whose first attempt reached the update): the
    # trainers are stopped and rebuilt from the start, the iteration runs as it first did.
    retried = tmp_path / "retried"
    iterate_step(
        first,
        1,
        tmp_path / "prompts",
        tmp_path / "state-0",
        retried / "state",
        retried / "trees",
        parity.ParitySuite(),
    )  # type: ignore[arg-type]
    assert "iteration 1's update already reached the run's trainers" in capsys.readouterr().out
    parity.same_run_but(
        read_log(retried / "state"),
        read_log(tmp_path / "state-1"),
        parity.ROUNDING | parity.ARRIVAL_ORDER,
    )
    assert _held(head, "freed-") == [
        "freed-0a1b2c3d-0",
        "freed-0a1b2c3d-trainer-0",
        "group freed-0a1b2c3d-run",  # the run's trainer and engine bundles, reserved as one
    ]

    second = pipeline_config(init, tmp_path / "second", head, store, "freed", "9f8e7d6c-0000")
    with pytest.raises(RuntimeError, match="run_name 'freed' is in use") as refused:
        chain(second, tmp_path / "second", range(1, 1))
    assert "trace_core.train.release freed-0a1b2c3d --ray-address" in str(refused.value)
    other = pipeline_config(
        init,
        tmp_path / "other",
        head,
        store,
        "crowded",
        "1b2c3d4e-0000",
        engine={"ready_timeout_s": 2},
    )
    with pytest.raises(PlacementError) as crowded:
        chain(other, tmp_path / "other", range(1, 1))
    assert (
        "the run crowded-1b2c3d4e: trainers: 1 bundle of 1 CPU (one node); engines: 1 bundle of "
        "1 CPU (2 CPU in all), reserved together or not at all" in str(crowded.value)
    )
    assert "the cluster has 0 CPU free of 2 CPU" in str(crowded.value)
    assert _held(head, "crowded-") == []  # never half-placed

    # The refusal's release command, run as printed (the image's python3: this venv's here).
    printed = str(refused.value).split("release it: ", 1)[1]
    assert printed == f"python3 -m trace_core.train.release freed-0a1b2c3d --ray-address {head}"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path}
    done = subprocess.run(printed, shell=True, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "released trainer actor freed-0a1b2c3d-trainer-0",
        "released engine actor freed-0a1b2c3d-0",
    ]
    for _ in range(300):  # Ray removes the group asynchronously
        if not _held(head, "freed-"):
            break
        time.sleep(0.2)
    assert _held(head, "freed-") == []
    assert release_step("freed", kfp_run, ray_address=head) == []  # nothing left: no error
