"""The run's session steps with a Ray dashboard address (``ray_jobs_url``): each step (the KFP
component, run by KFP's local runner) submits a Ray job to a real Ray head, the job runs
`trace-rl step ...` there against a real SeaweedFS S3 server, and the step's output artifacts
carry the job's results. The trainer and engine actors one job starts are found by the next.
A job that fails fails the step, with its log; a step that gets SIGTERM stops its job, and the
run's exit handler stops the run's jobs still running and kills its actors.

The head (``start_ray_head`` in tests/conftest.py) runs with the dashboard on (job submission
goes through it), token auth off (loopback only), and the SeaweedFS credentials in its
environment, as a KubeRay cluster's pods would get them from a Secret; it is stopped by its pid.
"""

# No ``from __future__ import annotations``: KFP reads the test pipeline's annotations as types.
import json
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from kfp import dsl, local
from kfp.dsl import Artifact, Dataset, Model

from components import close_session, iterate, open_session
from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.store.artifacts import open_store
from trace_core.store.schema import read_trees
from trace_core.store.server import SeaweedServer
from trace_core.store.sync import download_folder, upload_folder
from trace_core.train.contract import (
    EVAL_FILE,
    PipelineConfig,
    PipelineParameters,
    StepCall,
    read_metrics,
)
from trace_core.train.dispatch import execute_cli_step
from trace_core.train.rayjob import RayJobFailed, is_job_of, submit_step
from trace_core.train.steps.start import load_step, prep_step

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    # Expected of KFP's local runner: Kubernetes settings are no-ops, the images are not used.
    pytest.mark.filterwarnings("ignore:.*have no effect in the current local runner"),
    pytest.mark.filterwarnings("ignore:You may be attemping to run a task"),
]

BUCKET = "trace"
SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    server = SeaweedServer.start(tmp_path_factory.mktemp("seaweedfs"), buckets=(BUCKET,))
    yield server
    server.stop()
    assert not server.running()


@pytest.fixture(scope="module")
def ray_dashboard(
    seaweed: SeaweedServer, start_ray_head: Callable[..., AbstractContextManager[Any]]
) -> Iterator[str]:
    """http://127.0.0.1:PORT of a Ray head whose jobs see the S3 server and `trace-rl`."""
    with start_ray_head(dashboard=True, env=seaweed.env()) as head:
        yield head.dashboard_url


@pytest.fixture
def client_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """This side: the job client with the session's token (conftest), the store client on the
    S3 server."""
    for name in ("AWS_ENDPOINT_URL_S3", "S3_ENDPOINT", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    """(base policy, folder): a tiny random policy; `config_for` preps and loads from it."""
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    base = tmp_path / "base"
    save_checkpoint(create_policy(tokenizer, SMALL, seed=0), tokenizer, base)
    return base, tmp_path


SETTINGS = {"prompts": 12, "max_tokens": 8, "eval_tasks": 4, "group": 2}


def config_for(
    base: Path, address: str, root: Path, rollout_workers: int = 1, **settings: object
) -> PipelineConfig:
    parameters = PipelineParameters(
        task="calc",
        base_model_uri=str(base),
        budget=6,
        continuations=2,
        iterations=2,
        max_staleness=0,
        checkpoint_every=2,
        ray_jobs_url=address,
        rollout_workers=rollout_workers,
        store_uri=f"s3://{BUCKET}/ray-test",
        settings_json=json.dumps({**SETTINGS, **settings}),
    )
    prep = prep_step(parameters, root / "prompts")
    config = PipelineConfig.from_json(prep.config_json)
    load_step(config, root / "policy", root / "predictor", root / "optimizer")
    return config


@pytest.mark.usefixtures("client_env")
def test_the_session_steps_run_as_ray_jobs_and_find_the_runs_actors(
    ray_dashboard: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """open session, two iterations and close session, each a Ray job: the first job starts the
    run's trainer and engine actor (1 CPU each, on the head's cluster), the iteration jobs find
    the same two processes, close session stops them; the trees come back as the artifacts."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    base, root = inputs
    config = config_for(base, ray_dashboard, root)

    @dsl.pipeline(name="session-jobs")
    def session_jobs(config_json: str) -> None:
        def imported(path: Path, kind: type) -> dsl.PipelineTask:
            return dsl.importer(artifact_uri=str(path), artifact_class=kind, reimport=False)

        prompts = imported(root / "prompts", Dataset).output
        opened = open_session(
            config_json=config_json,
            start_iteration=0,
            prompts=prompts,
            policy=imported(root / "policy", Model).output,
            predictor=imported(root / "predictor", Model).output,
            optimizer=imported(root / "optimizer", Artifact).output,
        )
        step = opened
        for i in (1, 2):  # each reads the state the one before published in the store
            step = iterate(config_json=config_json, iteration=i, prompts=prompts).after(step)
        close_session(config_json=config_json, start_iteration=0).after(step)

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp"),
        workspace_root=str(tmp_path / "workspace"),
    )
    session_jobs(config_json=config.to_json())

    (run,) = (tmp_path / "kfp").glob("session-jobs-*")
    for i, task in ((1, "iterate"), (2, "iterate-2")):
        trees = read_trees(run / task / "trees" / "trees.parquet")
        assert sum(t.units for t in trees) == 6 * (1 + 2 / 2)
        assert {t.info.iteration for t in trees} == {i}
    moved, saved = (
        [read_metrics(run / task / "trees")[key] for task in ("iterate", "iterate-2")]
        for key in ("s3_bytes", "checkpoint_bytes")
    )
    assert saved[0] == 0 and saved[1] > 0, saved  # the last: 2
    # Each iteration's trees went through the store to the trainer (sessions/<session>/
    # trees-NNNN, the bytes of the step's artifact, which the job wrote to staging/<job id>/
    # out/trees): written once, read once.
    sizes = [
        (run / task / "trees" / "trees.parquet").stat().st_size for task in ("iterate", "iterate-2")
    ]
    assert moved == [2 * size for size in sizes], (moved, sizes)
    # close-session deleted the session's scratch, all but the last state (the report reads
    # it), and its jobs' staging; what is left of staging is its own job's output, written after.
    session = config.engine_name
    sessions = open_store(f"s3://{BUCKET}/ray-test/sessions/{session}")
    assert {o.key.split("/")[0] for o in sessions.list_objects()} == {"state-0002"}
    staging = open_store(f"s3://{BUCKET}/ray-test/staging").list_objects()
    jobs = {o.key.split("/")[0] for o in staging if is_job_of(session, o.key.split("/")[0])}
    assert [job.startswith(f"trace-{session}-close-session-0000-") for job in jobs] == [True]

    client = JobSubmissionClient(ray_dashboard)
    steps = [(j.metadata or {}).get("trace.step") for j in client.list_jobs()]
    assert steps.count("iterate") == 2 and steps.count("close-session") == 1
    for kind, name in (("TrainerRank", f"{session}-trainer-0"), ("EngineWorker", f"{session}-0")):
        actors = [
            a for a in list_actors(address=ray_dashboard, filters=[("class_name", "=", kind)],
                                   detail=True, limit=1000)
            if a.name == name
        ]  # fmt: skip
        assert len(actors) == 1, actors  # one process for the whole run, found by every job
        assert actors[0].state == "DEAD"  # close session stopped it
        asked = {  # a trainer's CPU is its placement group's: CPU_group_<id> (and bundle_...)
            k.split("_group_")[0]: v for k, v in actors[0].required_resources.items()
        }
        assert {k: v for k, v in asked.items() if k != "bundle"} == {"CPU": 1.0}


@pytest.mark.usefixtures("client_env")
def test_a_failed_job_fails_the_step_with_its_log(
    ray_dashboard: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    base, root = inputs
    config = config_for(base, ray_dashboard, root)
    broken = tmp_path / "broken-state"
    broken.mkdir()
    (broken / "state.json").write_text("{not json")
    call = StepCall(
        "iterate",
        1,
        {"prompts": str(root / "prompts"), "state": str(broken)},
        {"trees": str(tmp_path / "trees"), "state": str(tmp_path / "state")},
    )
    lines: list[str] = []
    with pytest.raises(RayJobFailed, match="ended FAILED") as failed:
        submit_step(call, config, log=lines.append)
    assert "not a run state" in str(failed.value)
    assert "".join(lines).startswith(f"submitted Ray job trace-{config.engine_name}-iterate-0001-")
    assert not (tmp_path / "trees").exists()  # nothing was fetched from a failed job


@pytest.mark.usefixtures("client_env")
def test_trace_rl_step_sends_a_session_step_on_s3_folders_as_a_ray_job(
    ray_dashboard: str,
    inputs: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`trace-rl step open-session` on s3:// folders (an Argo container) of a run with a Ray
    dashboard address: sent as a Ray job, whose trainer and engine actors read the starting
    policy from S3 themselves; the job writes the state where the step was told to, with the
    starting policy's evaluation. close-session, sent the same way, stops them."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # not inside a Ray job
    base, root = inputs
    config = config_for(base, ray_dashboard, root)
    prefix = f"s3://{BUCKET}/argo-like/{tmp_path.name}"
    for name in ("prompts", "policy", "predictor", "optimizer"):
        upload_folder(root / name, f"{prefix}/{name}")
    folders = {n: f"{prefix}/{n}" for n in ("prompts", "policy", "predictor", "optimizer")}
    execute_cli_step("open-session", 0, folders, {"state": f"{prefix}/state"}, config.to_json())
    download_folder(f"{prefix}/state", tmp_path / "state")
    report = json.loads((tmp_path / "state" / EVAL_FILE).read_text())
    assert report["tasks"] == 4 and report["iteration"] == 0
    assert read_metrics(tmp_path / "state")["accuracy_pass1"] == report["pass1"]["all"]
    state = {"state": f"{prefix}/state"}
    execute_cli_step("close-session", 0, state, {"result": f"{prefix}/result"}, config.to_json())
    download_folder(f"{prefix}/result", tmp_path / "result")
    assert json.loads((tmp_path / "result" / EVAL_FILE).read_text())["iteration"] == 0


HOLDER = """
import sys, time, ray
from ray.util.placement_group import placement_group
session = sys.argv[1]
ray.init()
@ray.remote(num_cpus=0)
class Held:
    def ready(self): return None
    def shutdown(self): pass
group = placement_group([{"CPU": 0.1}], name=f"{session}-trainer", lifetime="detached")
ray.get(group.ready())
held = [Held.options(name=name, namespace=namespace, lifetime="detached").remote()
        for name, namespace in ((f"{session}-trainer-0", "trace-trainers"),
                                (f"{session}-0", "trace-engines"))]
ray.get([h.ready.remote() for h in held])
print("holding", flush=True)
time.sleep(600)
"""
"""A step's Ray job as the run's actors see it: it starts a trainer and an engine actor (detached,
named after the session, one in a placement group of its own) and runs on."""


def _until(done: Callable[[], bool], what: str) -> None:
    for _ in range(600):
        if done():
            return
        time.sleep(0.2)
    raise AssertionError(f"not {what} in 120 s")


@pytest.mark.usefixtures("client_env")
def test_a_cancelled_step_stops_its_job_and_the_exit_handler_frees_the_runs_jobs_and_actors(
    ray_dashboard: str,
) -> None:
    """SIGTERM to a step that follows its Ray job (what Kubernetes sends when the run is
    cancelled) stops the job before the step exits. The run's exit handler, given only the
    jobs URL and the session's name, stops the run's job still running and kills the actors it
    started, with their placement group; released again, there is nothing left."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors, list_placement_groups

    from trace_core.train.release import release_session

    client = JobSubmissionClient(ray_dashboard)
    tag = uuid.uuid4().hex[:8]

    def status(job: str) -> str:
        return str(client.get_job_status(job).value)

    def submitted(job: str) -> bool:
        return any(j.submission_id == job for j in client.list_jobs())

    step = f"trace-cancelled-{tag}"
    follow = (
        "import sys\nfrom ray.job_submission import JobSubmissionClient\n"
        "from trace_core.train.rayjob import run_job\n"
        "run_job(JobSubmissionClient(sys.argv[1]), sys.argv[2], 'sleep 600', None, {}, print, 0.2)"
    )
    cancelled = subprocess.Popen(
        [sys.executable, "-c", follow, ray_dashboard, step], stdout=subprocess.PIPE, text=True
    )
    _until(lambda: submitted(step) and status(step) == "RUNNING", f"{step} running")
    cancelled.send_signal(signal.SIGTERM)
    out, _ = cancelled.communicate(timeout=120)
    assert cancelled.returncode == 128 + signal.SIGTERM, out
    assert f"SIGTERM: stopped Ray job {step}" in out
    _until(lambda: status(step) in ("STOPPED", "SUCCEEDED", "FAILED"), f"{step} ended")
    assert status(step) == "STOPPED"

    session = f"held-{tag}"
    job = f"trace-held-{tag}-open-session-0000-{tag}"
    client.submit_job(
        entrypoint=shlex.join(["python3", "-c", HOLDER, session]),
        submission_id=job,
        metadata={"trace.session": session},
    )
    holding = lambda: "holding" in client.get_job_logs(job).splitlines()  # noqa: E731
    _until(holding, f"{job} holding its actors")  # (the log's first line is the command)
    assert release_session(session, ray_jobs_url=ray_dashboard) == [
        f"released Ray job {job} (stopped)",
        f"released trainer actor {session}-trainer-0",
        f"released engine actor {session}-0",
    ]
    assert status(job) == "STOPPED"
    named = [("name", "=", f"{session}-trainer-0")], [("name", "=", f"{session}-0")]
    for filters in named:
        (actor,) = list_actors(address=ray_dashboard, filters=filters)  # type: ignore[arg-type]
        assert actor.state == "DEAD"
    group = [("name", "=", f"{session}-trainer")]

    def removed() -> bool:
        states = {g.state for g in list_placement_groups(address=ray_dashboard, filters=group)}
        return states == {"REMOVED"}

    _until(removed, "the placement group removed")
    assert release_session(session, ray_jobs_url=ray_dashboard) == []


STREAMED = """
import pathlib, sys, time
print("part", 1, flush=True)
seen = pathlib.Path(sys.argv[1])
for _ in range(3000):
    if seen.exists():
        break
    time.sleep(0.1)
else:
    print("gave", "up", flush=True)
    sys.exit(1)
print("part", 2, flush=True)
"""
"""A job that prints part 1, waits (up to 300 s) for the file the follower makes once it has
shown part 1, then prints part 2."""


@pytest.mark.usefixtures("client_env")
def test_a_jobs_log_is_written_while_the_job_runs(ray_dashboard: str, tmp_path: Path) -> None:
    """``run_job`` writes the job's output as the driver prints it, not once the job has ended:
    the job goes on to part 2 only after the step's writer has shown part 1. A follower that
    wrote the log at the end would leave the job waiting until it gives up and fails."""
    from ray.job_submission import JobSubmissionClient

    from trace_core.train.rayjob import run_job

    seen = tmp_path / "seen"
    written: list[str] = []

    def write(text: str) -> None:
        written.append(text)
        if "part 1\n" in "".join(written):
            seen.touch()

    job = f"trace-streamed-{uuid.uuid4().hex[:8]}"
    entrypoint = shlex.join(["python3", "-c", STREAMED, str(seen)])
    client = JobSubmissionClient(ray_dashboard)
    status, tail = run_job(client, job, entrypoint, None, {}, write, 0.2)
    out = "".join(written)
    assert status == "SUCCEEDED", out
    assert out.startswith(f"submitted Ray job {job}")
    assert out.index("part 1\n") < out.index("part 2\n") and "gave up" not in out
    assert "part 2" in tail.splitlines()
    assert out.count("part 2\n") == 1  # each part of the log written once
