"""The cluster cases of test_placement.py, each run in an interpreter of its own connected to
the test's GPU head (a process that ran an in-process Ray before cannot reliably place actors on
another cluster):

    python tests/rollout/placement_cases.py ADDRESS CASE TMP      # exit 0: the case holds
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group_table

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.placement import PlacementError, RunShape, reserve_run, run_shape
from trace_core.rollout.ray_pool import EngineStartError, RayEnginePool


@ray.remote(num_cpus=1, num_gpus=2)
class Engine:
    """An actor placed as the pool places a tensor-parallel engine of two: two GPUs of its own,
    which vLLM's ranks (processes of the actor) then take one each."""

    def where(self) -> tuple[str, list[str], str | None]:
        """Its node, its GPU ids, and CUDA_VISIBLE_DEVICES as its processes inherit it."""
        context = ray.get_runtime_context()
        gpus = [str(g) for g in ray.get_gpu_ids()]
        return context.get_node_id(), gpus, os.environ.get("CUDA_VISIBLE_DEVICES")


TP_ENGINE = EngineConfig("vllm", workers=1, gpus_per_worker=1, tensor_parallel=2)


def tensor_parallel_in_run(tmp_path: Path) -> None:
    """A run of one trainer and one engine of two ranks: one group of two bundles, the engine's
    holding both its GPUs; the actor in it gets two GPUs of one node, as its processes see
    them."""
    shape = run_shape(1, True, TP_ENGINE)
    run = reserve_run(shape, "tp-run", False, 30.0, "the run tp")
    try:
        assert run.group.bundle_specs == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 2.0}]
        assert _free() == (1.0, 0.0)  # the run holds 3 of the head's 4 GPUs, both CPUs
        engine = Engine.options(scheduling_strategy=run.engine(0)).remote()  # type: ignore[attr-defined]
        node, gpus, visible = ray.get(engine.where.remote(), timeout=60)
        assert node == run.nodes()[1] and len(gpus) == 2 and len(set(gpus)) == 2, gpus
        assert visible is not None and sorted(visible.split(",")) == sorted(gpus), visible
    finally:
        run.remove()
    _gone("tp-run")


def third_run_waits(tmp_path: Path) -> None:
    """4 GPUs: two runs of one engine of two ranks are placed; a third waits holding nothing,
    then says why in one line."""
    shape = run_shape(0, False, TP_ENGINE)
    runs = [reserve_run(shape, f"tp-{i}-run", False, 30.0, f"the run tp-{i}") for i in (1, 2)]
    try:
        assert _free()[0] == 0.0
        try:
            reserve_run(shape, "tp-3-run", False, 2.0, "the run tp-3")
        except PlacementError as err:
            assert "engines: 1 bundle of 1 CPU, 2 GPU" in str(err), str(err)
        else:
            raise AssertionError("a third engine of two GPUs placed on a 4-GPU head")
        assert "tp-3-run" not in _live_groups()
    finally:
        for run in runs:
            run.remove()
    _gone("tp-1-run")
    _gone("tp-2-run")


def pool_failure(tmp_path: Path) -> None:
    """The pool's own path: the engine actor starts in its bundle of the run's group (here it
    then fails, as vLLM is not installed in this environment), the failure comes back as one
    line naming the worker and the cause, and removing the run gives every GPU back."""
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, tmp_path)
    run = reserve_run(run_shape(1, True, TP_ENGINE), "pool-run", False, 30.0, "the run pool")
    try:
        RayEnginePool(
            tmp_path, workers=1, engine="vllm", tensor_parallel=2, num_gpus_per_worker=1,
            max_restarts=0, ready_timeout_s=120, placement=run,
        )  # fmt: skip
    except EngineStartError as failed:
        message = str(failed)
    else:
        raise AssertionError("the pool started without vLLM")
    finally:
        run.remove()
    assert message.startswith("engine worker 0 did not start: ImportError: VLLMEngine needs")
    assert "\n" not in message and "Traceback" not in message
    _gone("pool-run")


# --- a run's group: trainers and engines, all or nothing -----------------------------------
def _free() -> tuple[float, float]:
    free = ray.available_resources()
    return free.get("GPU", 0.0), free.get("CPU", 0.0)


def _live_groups() -> list[str]:
    return sorted(g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED")


def _gone(name: str) -> None:
    """Wait until no group ``name`` is left and the head's 4 GPUs and 2 CPUs are free again."""
    deadline = time.monotonic() + 60  # removal is asynchronous
    while (name in _live_groups() or _free() != (4.0, 2.0)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert name not in _live_groups() and _free() == (4.0, 2.0), (_live_groups(), _free())


def run_too_big(tmp_path: Path) -> None:
    """A run asking for 5 GPUs of a 4-GPU head holds nothing while it waits (its progress lines
    say what is pending), then is removed and says why in one line."""
    shape = RunShape(trainers=1, trainer_gpus=True, engines=1, engine_gpus=4)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        assert _free() == (4.0, 2.0)  # no partial hold while it waits
        assert "big-run" in _live_groups()  # it exists, pending

    try:
        reserve_run(shape, "big-run", False, 3.0, "the run big", say=say, every_s=1.0)
    except PlacementError as err:
        message = str(err)
    else:
        raise AssertionError("5 GPUs reserved on a 4-GPU head")
    assert len(lines) >= 2, lines
    assert (
        "the run big: waiting" in lines[0]
        and "for 2 of 2 bundle(s) (trainers 0, engines 1): 5 GPU" in lines[0]
    )
    assert "the cluster has 4 GPU, 2 CPU free" in lines[0] and "PENDING" in lines[0]
    assert message.startswith(
        "the run big: trainers: 1 bundle of 1 CPU, 1 GPU (one node); engines: 1 bundle of 1 "
        "CPU, 4 GPU (2 CPU, 5 GPU in all), reserved together or not at all, did not fit"
    ), message
    assert "the cluster has 2 CPU, 4 GPU free of 2 CPU, 4 GPU" in message
    _gone("big-run")


def second_run_waits(tmp_path: Path) -> None:
    """The first run holds the head's 4 GPUs (trainers and engines in one group); a second run
    asking for the same waits without taking any, then fails in one line; once the first is
    released, the second fits."""
    shape = RunShape(trainers=1, trainer_gpus=True, engines=1, engine_gpus=3)
    first = reserve_run(shape, "first-run", False, 30.0, "the run first")
    assert first.group.bundle_specs == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 3.0}]
    assert _free() == (0.0, 0.0)
    lines: list[str] = []
    try:
        reserve_run(
            shape, "second-run", False, 2.5, "the run second", say=lines.append, every_s=1.0
        )
    except PlacementError as err:
        assert "the cluster has 0 CPU, 0 GPU free of 2 CPU, 4 GPU" in str(err), str(err)
    else:
        raise AssertionError("the second run took GPUs the first holds")
    assert lines and all("the cluster has 0 GPU, 0 CPU free" in line for line in lines), lines
    assert _free() == (0.0, 0.0) and "second-run" not in _live_groups()  # the first's, whole
    first.remove()
    _gone("first-run")
    second = reserve_run(shape, "second-run", False, 30.0, "the run second")
    assert set(second.nodes()) == {0, 1}
    second.remove()
    _gone("second-run")


@ray.remote(num_cpus=1, num_gpus=1)
class Rank:
    """A trainer rank's placement: one CPU and one GPU in the run's trainers' bundle."""

    def where(self) -> tuple[str, list[str]]:
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


@ray.remote(num_cpus=0, num_gpus=3)
class Filler:
    """Another run's hold on 3 of the head's 4 GPUs."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def trainers_on_one_node(tmp_path: Path) -> None:
    """Two nodes of 4 GPUs, 3 of the head's taken: the run's 3 trainer ranks land together on
    the other node (their one bundle cannot be split), each on a GPU of its own, and its two
    engines take the head's last GPU and one beside the trainers."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2 and all(r.get("GPU") == 4 for r in nodes.values()), nodes
    head = next(node for node, r in nodes.items() if r.get("CPU") == 2)
    worker = next(node for node in nodes if node != head)
    filler = Filler.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)
    ).remote()
    assert ray.get(filler.node.remote(), timeout=60) == head
    shape = RunShape(trainers=3, trainer_gpus=True, engines=2, engine_gpus=1)
    run = reserve_run(shape, "spread-run", False, 60.0, "the run spread")
    try:
        placed = run.nodes()
        assert placed[0] == worker, placed  # the trainers' bundle: 3 GPUs on one node
        assert sorted(placed[i] for i in (1, 2)) == sorted([head, worker]), placed
        ranks = [Rank.options(scheduling_strategy=run.trainer()).remote() for _ in range(3)]  # type: ignore[attr-defined]
        where = ray.get([r.where.remote() for r in ranks], timeout=60)
        assert {node for node, _ in where} == {worker}
        gpus = [ids for _, ids in where]
        assert all(len(ids) == 1 for ids in gpus) and len({ids[0] for ids in gpus}) == 3, gpus
        engines = [Rank.options(scheduling_strategy=run.engine(i)).remote() for i in range(2)]  # type: ignore[attr-defined]
        assert {n for n, _ in ray.get([e.where.remote() for e in engines], timeout=60)} == {
            head,
            worker,
        }
    finally:
        run.remove()
        ray.kill(filler)


CASES = {
    "run_too_big": run_too_big,
    "second_run_waits": second_run_waits,
    "trainers_on_one_node": trainers_on_one_node,
    "tensor_parallel_in_run": tensor_parallel_in_run,
    "third_run_waits": third_run_waits,
    "pool_failure": pool_failure,
}

if __name__ == "__main__":
    address, case, tmp = sys.argv[1:]
    ray.init(address=address, logging_level="WARNING")
    try:
        CASES[case](Path(tmp))
    finally:
        ray.shutdown()
