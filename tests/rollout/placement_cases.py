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

from trace_core.envs.calc import CalcSuite
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout.ray_pool import (
    EngineStartError,
    RayEnginePool,
    in_group,
    tensor_parallel_group,
)


@ray.remote(num_gpus=1, num_cpus=0)
def device_ids() -> tuple[str, list[str]]:
    """What one of vLLM's Ray workers gets from its bundle: its node and GPU ids."""
    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


@ray.remote(num_cpus=1, num_gpus=0)
class Driver:
    """An actor placed as the pool places an engine actor (bundle 0, no GPU of its own), which
    starts one GPU task per bundle as vLLM's executor does."""

    def spread(self, workers: int) -> list[tuple[str, list[str]]]:
        group = ray.util.get_current_placement_group()
        assert group is not None
        return ray.get([device_ids.remote() for _ in range(workers)])

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def visible(self) -> str | None:
        """CUDA_VISIBLE_DEVICES as this actor sees it (None: unset)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES")


def reserve(tmp_path: Path) -> None:
    group = tensor_parallel_group(2, threads=1, detached=False)
    try:
        assert group.wait(timeout_seconds=60)
        # vLLM's rule for a group it runs in: no bundle of more than one GPU, and as many
        # GPU bundles as its tensor-parallel size.
        assert [b.get("GPU") for b in group.bundle_specs] == [1.0, 1.0]
        driver = Driver.options(scheduling_strategy=in_group(group)).remote()  # type: ignore[attr-defined]
        assert ray.get(driver.visible.remote(), timeout=60) is None  # Ray's default: untouched
        placed = ray.get(driver.spread.remote(2), timeout=60)
        assert len({node for node, _ in placed}) == 1  # one node
        assert sorted(len(ids) for _, ids in placed) == [1, 1]
        assert len({ids[0] for _, ids in placed}) == 2  # two different GPUs
        assert ray.available_resources().get("GPU", 0) == 2  # the group holds two of four
        ray.kill(driver)
    finally:
        ray.util.remove_placement_group(group)


def wait_third(tmp_path: Path) -> None:
    groups = [tensor_parallel_group(2, threads=1, detached=False) for _ in range(3)]
    try:
        ready = [g.wait(timeout_seconds=20) for g in groups]
        assert ready == [True, True, False]  # 4 GPUs: two engines of two, the third waits
    finally:
        for group in groups:
            ray.util.remove_placement_group(group)


def zero_override(tmp_path: Path) -> None:
    """Under ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1`` (this job's runtime env, see ``__main__``):
    the engine actor's slot (bundle 0, no GPU of its own) sees no GPU at all, which is why the
    pool names vLLM's Ray executor (``ray_worker.executor_backend``) rather than letting vLLM
    count the GPUs it sees; the executor's workers still get one GPU each from the bundles, and
    the pool's own path holds as without the override."""
    group = tensor_parallel_group(2, threads=1, detached=False)
    try:
        assert group.wait(timeout_seconds=60)
        driver = Driver.options(scheduling_strategy=in_group(group)).remote()  # type: ignore[attr-defined]
        assert ray.get(driver.visible.remote(), timeout=60) == ""
        placed = ray.get(driver.spread.remote(2), timeout=60)
        assert sorted(len(ids) for _, ids in placed) == [1, 1]
        assert len({ids[0] for _, ids in placed}) == 2
        ray.kill(driver)
    finally:
        ray.util.remove_placement_group(group)
    pool_failure(tmp_path)


def pool_failure(tmp_path: Path) -> None:
    """The pool's own path: the engine actor lands in its group (here it then fails, as vLLM is
    not installed in this environment), the failure comes back as one line naming the worker and
    the cause, and the group's GPUs are given back."""
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    save_checkpoint(create_policy(tokenizer, TinyPolicyConfig(), seed=0), tokenizer, tmp_path)
    try:
        RayEnginePool(
            tmp_path, workers=1, engine="vllm", tensor_parallel=2, num_gpus_per_worker=1,
            max_restarts=0, ready_timeout_s=120,
        )  # fmt: skip
    except EngineStartError as failed:
        message = str(failed)
    else:
        raise AssertionError("the pool started without vLLM")
    assert message.startswith("engine worker 0 did not start: ImportError: VLLMEngine needs")
    assert "\n" not in message and "Traceback" not in message
    deadline = time.monotonic() + 60  # the group's removal is asynchronous
    while ray.available_resources().get("GPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("GPU", 0) == 4  # the group is gone


CASES = {
    "reserve": reserve,
    "wait_third": wait_third,
    "pool_failure": pool_failure,
    "zero_override": zero_override,
}
OVERRIDE_ON_ZERO = {"zero_override"}
"""Cases whose job runs with RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1: Ray then empties
CUDA_VISIBLE_DEVICES in every task and actor that holds no GPU."""

if __name__ == "__main__":
    address, case, tmp = sys.argv[1:]
    override = {"env_vars": {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}}
    ray.init(
        address=address,
        logging_level="WARNING",
        runtime_env=override if case in OVERRIDE_ON_ZERO else None,
    )
    try:
        CASES[case](Path(tmp))
    finally:
        ray.shutdown()
