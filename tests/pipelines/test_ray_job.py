"""The pipeline's rollout step with a Ray dashboard address: the step (the KFP component, run
by KFP's local runner) submits a Ray job to a real Ray head, the job runs `trace-rl step
rollout` there against a real SeaweedFS S3 server, and the step's output artifact carries the
job's trees. A job that fails fails the step, with its log.

The head (``start_ray_head`` in tests/conftest.py) runs with the dashboard on (job submission
goes through it), token auth off (loopback only), and the SeaweedFS credentials in its
environment, as a KubeRay cluster's pods would get them from a Secret; it is stopped by its pid.
"""

# No ``from __future__ import annotations``: KFP reads the test pipeline's annotations as types.
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from kfp import dsl, local
from kfp.dsl import Dataset, Model

from components import rollout
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
from trace_core.train.rayjob import RayJobFailed, submit_step
from trace_core.train.steps.finish import evaluate_step
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
    """This side: the job client without auth, the store client on the S3 server."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
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
    base: Path, address: str, root: Path, rollout_workers: int = 0, **settings: object
) -> PipelineConfig:
    parameters = PipelineParameters(
        task="calc",
        base_model_uri=str(base),
        budget=6,
        continuations=2,
        iterations=1,
        ray_address=address,
        rollout_workers=rollout_workers,
        store_uri=f"s3://{BUCKET}/ray-test",
        settings_json=json.dumps({**SETTINGS, **settings}),
    )
    prep = prep_step(parameters, root / "prompts")
    config = PipelineConfig.from_json(prep.config_json)
    load_step(config, root / "policy", root / "predictor", root / "optimizer")
    return config


@pytest.mark.usefixtures("client_env")
def test_rollout_step_runs_as_a_ray_job(
    ray_dashboard: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    base, root = inputs
    config = config_for(base, ray_dashboard, root)

    @dsl.pipeline(name="one-rollout")
    def one_rollout(config_json: str) -> None:
        def imported(path: Path, kind: type) -> dsl.PipelineTask:
            return dsl.importer(artifact_uri=str(path), artifact_class=kind, reimport=False)

        rollout(
            config_json=config_json,
            iteration=1,
            start_iteration=0,
            prompts=imported(root / "prompts", Dataset).output,
            policy=imported(root / "policy", Model).output,
            predictor=imported(root / "predictor", Model).output,
        )

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp"),
        workspace_root=str(tmp_path / "workspace"),
    )
    one_rollout(config_json=config.to_json())

    (trees_path,) = (tmp_path / "kfp").glob("one-rollout-*/rollout/trees/trees.parquet")
    trees = read_trees(trees_path)
    assert sum(t.units for t in trees) == 6 * (1 + 2 / 2)
    assert {t.info.iteration for t in trees} == {1}
    # The job wrote them to S3 (staging/<job id>/out/trees); the artifact carries the same bytes.
    store = open_store(f"s3://{BUCKET}/ray-test/staging")
    (key,) = [o.key for o in store.list_objects() if o.key.endswith("out/trees/trees.parquet")]
    assert key.startswith("trace-pipeline-rollout-0001-")
    digest = hashlib.sha256(store.get_bytes(key)).hexdigest()
    assert digest == hashlib.sha256(trees_path.read_bytes()).hexdigest()
    # Its inputs went up first (the local runner's artifacts are not in object storage).
    assert any(o.key.endswith("in/policy/model.safetensors") for o in store.list_objects())


@pytest.mark.usefixtures("client_env")
def test_a_failed_job_fails_the_step_with_its_log(
    ray_dashboard: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    base, root = inputs
    config = config_for(base, ray_dashboard, root)
    broken = tmp_path / "broken-policy"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    call = StepCall(
        "rollout",
        1,
        {
            "prompts": str(root / "prompts"),
            "policy": str(broken),
            "predictor": str(root / "predictor"),
        },
        {"trees": str(tmp_path / "trees")},
    )
    lines: list[str] = []
    with pytest.raises(RayJobFailed, match="ended FAILED") as failed:
        submit_step(call, config, log=lines.append)
    assert "last log lines" in str(failed.value)
    assert "".join(lines).startswith("submitted Ray job trace-pipeline-rollout-0001-")
    assert not (tmp_path / "trees").exists()  # nothing was fetched from a failed job


@pytest.mark.usefixtures("client_env")
def test_engine_actors_of_a_ray_job_are_the_clusters(
    ray_dashboard: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """rollout_workers = 2 on a cluster: the job's driver grows the trees and its two engine
    actors run on the head's cluster with the resources asked (1 CPU, no GPU each), not in a
    private Ray the driver would start inside its own pod."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    base, root = inputs
    config = config_for(base, ray_dashboard, root, rollout_workers=2)
    call = StepCall(
        "rollout",
        1,
        {name: str(root / name) for name in ("prompts", "policy", "predictor")},
        {"trees": str(tmp_path / "trees")},
    )
    job_id = submit_step(call, config, log=lambda _text: None)
    trees = read_trees(tmp_path / "trees" / "trees.parquet")
    assert sum(t.units for t in trees) == 6 * (1 + 2 / 2)
    driver = JobSubmissionClient(ray_dashboard).get_job_info(job_id).job_id
    actors = list_actors(
        address=ray_dashboard, filters=[("class_name", "=", "EngineWorker")], detail=True
    )
    mine = [a for a in actors if a.job_id == driver]
    assert len(mine) == 2
    assert all(a.required_resources == {"CPU": 1.0} for a in mine)


@pytest.mark.usefixtures("client_env")
def test_trace_rl_step_sends_evaluate_to_the_engine_actors_of_a_ray_job(
    ray_dashboard: str,
    inputs: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`trace-rl step evaluate` on s3:// folders (an Argo container) of a run with a Ray
    dashboard address, rollout_workers = 1: sent as a Ray job, whose driver fetches the policy
    without its weights and plays the eval episodes on one engine actor of the cluster, which
    loads the policy from S3; the job writes the result where the step was told to. Greedy
    pass@1 is what the step gives in one process."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # not inside a Ray job
    base, root = inputs
    config = config_for(base, ray_dashboard, root, rollout_workers=1)
    prefix = f"s3://{BUCKET}/argo-like/{tmp_path.name}"
    for name in ("prompts", "policy"):
        upload_folder(root / name, f"{prefix}/{name}")
    folders = {name: f"{prefix}/{name}" for name in ("prompts", "policy")}
    execute_cli_step("evaluate", 0, folders, {"result": f"{prefix}/result"}, config.to_json())

    download_folder(f"{prefix}/result", tmp_path / "result")
    report = json.loads((tmp_path / "result" / EVAL_FILE).read_text())
    assert report["tasks"] == 4
    assert read_metrics(tmp_path / "result")["accuracy_pass1"] == report["pass1"]["all"]
    client = JobSubmissionClient(ray_dashboard)
    (job,) = [j for j in client.list_jobs() if (j.metadata or {}).get("trace.step") == "evaluate"]
    actors = list_actors(
        address=ray_dashboard, filters=[("class_name", "=", "EngineWorker")], detail=True
    )
    assert len([a for a in actors if a.job_id == job.job_id]) == 1
    engine = dataclasses.replace(config.train.engine, workers=0)
    here = dataclasses.replace(
        config, ray_address="", train=dataclasses.replace(config.train, engine=engine)
    )
    alone = evaluate_step(here, root / "prompts", root / "policy")
    assert alone["pass1"] == report["pass1"]


@pytest.mark.usefixtures("client_env")
def test_kept_engine_actors_serve_every_step_of_the_run_and_stop_with_it(
    ray_dashboard: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """keep_alive_s with rollout_workers = 2: the start's evaluation (one Ray job) starts two
    named engine actors; the rollout (the next job) finds the same processes and reloads its
    checkpoint into them, and says so in its metrics; the final evaluation stops them."""
    from ray.util.state import list_actors

    base, root = inputs
    config = config_for(base, ray_dashboard, root, 2, engine={"keep_alive_s": 600})
    name = config.engine_name
    assert name.startswith("pipeline-")  # prep names them, one name per pipeline run

    def engines() -> dict[str, int]:
        actors = list_actors(
            address=ray_dashboard, filters=[("class_name", "=", "EngineWorker")], detail=True
        )
        return {a.name: a.pid for a in actors if a.name.startswith(name) and a.state == "ALIVE"}

    folders = {n: str(root / n) for n in ("prompts", "policy", "predictor")}
    start = {n: folders[n] for n in ("prompts", "policy")}
    submit_step(StepCall("evaluate", 0, start, {"result": str(tmp_path / "start")}), config)
    started = engines()
    assert sorted(started) == [f"{name}-0", f"{name}-1"]

    trees = str(tmp_path / "trees")
    submit_step(StepCall("rollout", 1, folders, {"trees": trees}), config, log=lambda _t: None)
    assert engines() == started  # the same two processes
    metrics = read_metrics(Path(trees))
    assert metrics["engine_kept_workers"] == 2
    assert metrics["engine_reloads"] == 1  # each job stages the policy anew: a new checkpoint
    assert sum(t.units for t in read_trees(Path(trees) / "trees.parquet")) == 6 * (1 + 2 / 2)

    final = StepCall("evaluate", 0, folders, {"result": str(tmp_path / "final")})
    submit_step(final, config, log=lambda _t: None)
    assert engines() == {}
