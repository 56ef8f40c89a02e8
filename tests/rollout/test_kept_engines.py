"""Kept engine actors on a real Ray head (``ray start --head`` on 127.0.0.1, tests/conftest.py):
a named pool with ``keep_alive_s`` leaves its actors running when it closes, the next pool of
that name (another driver, as the pipeline's next step is another Ray job) finds them and loads
its checkpoint into them, ``release_engines`` stops them, and an idle one stops itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import ray

from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.rollout.ray_pool import RayEnginePool, release_engines
from trace_core.rollout.ray_worker import KEPT_NAMESPACE

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


@pytest.fixture(scope="module")
def head(
    start_ray_head: Callable[..., AbstractContextManager[Any]],
) -> Iterator[str]:
    with start_ray_head() as started:
        yield started.address


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one tokenizer: iteration i's policy and iteration i+1's."""
    tokenizer = build_word_tokenizer(CalcSuite(seed=0).vocabulary())
    root = tmp_path_factory.mktemp("kept")
    for seed in (0, 1):
        save_checkpoint(create_policy(tokenizer, SMALL, seed=seed), tokenizer, root / f"p{seed}")
    return root / "p0", root / "p1"


@pytest.fixture
def clear_ray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def named(address: str, name: str) -> list[str]:
    """The kept actors of ``name`` alive on the cluster."""
    ray.init(address=address)
    try:
        return sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == KEPT_NAMESPACE and a["name"].startswith(f"{name}-")
        )
    finally:
        ray.shutdown()


PARAMS = SamplingParams(max_tokens=4)


@pytest.mark.usefixtures("clear_ray_env")
def test_a_named_pool_keeps_its_actors_for_the_next_one(
    head: str, policies: tuple[Path, Path]
) -> None:
    first, second = policies
    with RayEnginePool(first, workers=2, address=head, name="run-a", keep_alive_s=600) as pool:
        assert pool.kept
        pids = pool.worker_pids()
        assert pool.stats.extra["kept_workers"] == 0  # this pool started them
        pool.generate([[1, 2, 3]], PARAMS, seed=0)
    assert named(head, "run-a") == ["run-a-0", "run-a-1"]  # closing left them running

    with RayEnginePool(second, workers=2, address=head, name="run-a", keep_alive_s=600) as pool:
        assert pool.worker_pids() == pids  # the same processes: no engine was started
        assert pool.stats.extra["kept_workers"] == 2
        assert pool.stats.extra["reloads"] == 1  # the new checkpoint went into them
        assert {p["checkpoint"] for p in pool.placement()} == {str(second)}
        assert len(pool.generate([[1, 2, 3], [4, 5]], PARAMS, seed=0)) == 2

    assert release_engines("run-a", head) == 2
    assert named(head, "run-a") == []
    assert release_engines("run-a", head) == 0


@pytest.mark.usefixtures("clear_ray_env")
def test_a_pool_without_a_name_stops_its_actors(head: str, policies: tuple[Path, Path]) -> None:
    with RayEnginePool(policies[0], workers=1, address=head, keep_alive_s=600) as pool:
        assert not pool.kept
    ray.init(address=head)
    try:
        assert not [
            a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == KEPT_NAMESPACE
        ]  # fmt: skip
    finally:
        ray.shutdown()


@pytest.mark.usefixtures("clear_ray_env")
def test_kept_actors_of_other_settings_are_refused(head: str, policies: tuple[Path, Path]) -> None:
    with RayEnginePool(policies[0], workers=1, address=head, name="run-b", keep_alive_s=600):
        pass
    with pytest.raises(RuntimeError, match=r"run-b-0 .* release_engines\('run-b'\)"):
        RayEnginePool(
            policies[0], workers=1, address=head, name="run-b", keep_alive_s=600, max_rows=8
        )
    assert release_engines("run-b", head) == 1


@pytest.mark.usefixtures("clear_ray_env")
def test_an_idle_kept_actor_stops_itself(head: str, policies: tuple[Path, Path]) -> None:
    """A run that failed before releasing its engines does not hold them for ever."""
    with RayEnginePool(policies[0], workers=1, address=head, name="run-c", keep_alive_s=1):
        pass
    deadline = time.monotonic() + 120  # it checks every second; the head may be slow here
    while named(head, "run-c") and time.monotonic() < deadline:
        time.sleep(1)
    assert named(head, "run-c") == []
