"""The resident trainer group on an in-process Ray (gloo on CPU): two trainer actors reproduce
the in-process update, their weights reach every engine actor by broadcast, an engine actor
replaced between syncs receives the current weights, and a checkpoint holds what they hold;
idle detached trainers stop themselves and free their devices; a call past its limit ends in one
line naming what it waited for."""

from __future__ import annotations

import signal
import time
from dataclasses import replace

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

from trace_core.envs.calc import CalcSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.policy.update import make_optimizer, update_policy
from trace_core.policy.update_config import UpdateConfig
from trace_core.rollout.flat import rollout_flat
from trace_core.rollout.ray_pool import RayEnginePool, ray_session
from trace_core.rollout.ray_worker import StaleWeightsError
from trace_core.rollout.waits import WaitTimeoutError
from trace_core.train.trainer_group import StartState, TrainerGroup, TrainerSpec

pytestmark = pytest.mark.slow

SMALL = TinyPolicyConfig(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
CONFIG = UpdateConfig(lr=3e-2, minibatch=16)
PARAMS = SamplingParams(n=4, max_tokens=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny policy, trees with mixed rewards, and the in-process update's model."""
    root = tmp_path_factory.mktemp("trainer-group")
    suite = CalcSuite(seed=2, train_size=24, eval_size=4)
    tokenizer = build_word_tokenizer(suite.vocabulary())
    model = create_policy(tokenizer, SMALL, seed=0)
    save_checkpoint(model, tokenizer, root / "policy")
    trees = rollout_flat(
        TorchEngine(model),
        TurnFormat(tokenizer),
        suite.make_env,
        suite.tasks("train")[:10],
        SamplingParams(n=4, max_tokens=10),
        seed=0,
    )
    for tree in trees:  # the untrained policy never wins: give each group a mixed outcome
        tree.reward[np.flatnonzero(tree.leaf_mask)[::2]] = 1.0
    optimizer = make_optimizer(model, CONFIG)
    update_policy(model, optimizer, trees, CONFIG, np.random.default_rng(7), 0)
    prompt = tokenizer.encode("12 + 30 =")
    with ray_session(num_cpus=4):
        yield root / "policy", trees, model, prompt


def _answers(pool: RayEnginePool, worker: int, prompt: list[int], label: str) -> list[list[int]]:
    """Worker ``worker``'s samples of ``prompt`` (seed 5) on the weights labelled ``label``."""
    result = ray.get(pool._actors[worker].generate.remote([prompt], PARAMS, 5, label))
    return [c.token_ids.tolist() for c in result.completions[0]]


def test_trainers_update_sync_every_engine_and_checkpoint_what_they_hold(setup, tmp_path):  # type: ignore[no-untyped-def]
    policy, trees, expected, prompt = setup
    want = [c.token_ids.tolist() for c in TorchEngine(expected).generate([prompt], PARAMS, 5)[0]]
    spec = TrainerSpec(CONFIG, workers=2, bucket_bytes=4096)
    with (
        TrainerGroup(spec, StartState(str(policy))) as trainers,
        RayEnginePool(policy, workers=2) as pool,
    ):
        before = [_answers(pool, w, prompt, str(policy)) for w in range(2)]
        assert before[0] != want  # the engines can tell the weights apart
        trainers.update(trees, seed=7)
        assert len(trainers.plan.buckets) > 3  # many broadcasts, none the whole model
        engines, pids = pool.sync_members()
        seconds = trainers.sync(engines, pids, "sync:test:1")
        pool.synced("sync:test:1", seconds)
        assert [_answers(pool, w, prompt, "sync:test:1") for w in range(2)] == [want, want]
        assert {p["checkpoint"] for p in pool.placement()} == {"sync:test:1"}

        # An engine actor replaced between syncs: it refuses to serve the synced label with
        # the weights it booted with, and the next sync (a new group) brings it the current ones.
        old = pool.kill_worker_process(1, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            try:
                new = pool.worker_pids()[1]
                break
            except ray.exceptions.RayActorError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert new != old
        with pytest.raises(StaleWeightsError, match="restarted since the last weight sync"):
            try:
                _answers(pool, 1, prompt, "sync:test:1")
            except ray.exceptions.RayTaskError as err:
                raise err.as_instanceof_cause() from None
        engines, pids = pool.sync_members()
        trainers.sync(engines, pids, "sync:test:2")
        assert [_answers(pool, w, prompt, "sync:test:2") for w in range(2)] == [want, want]

        sizes = trainers.save(tmp_path / "ckpt")
    assert {"policy/model.safetensors", "optimizer.safetensors"} <= set(sizes)
    saved = load_file(str(tmp_path / "ckpt" / "policy" / "model.safetensors"))
    start = load_file(str(policy / "model.safetensors"))
    for name, value in expected.state_dict().items():
        if name in saved:  # two ranks' gradient sums round apart; where a gradient is ~0,
            # Adam's step (g/sqrt(v)) magnifies that: 99% within 1% of a step, all within one
            off = (saved[name] - value).abs()
            assert off.max() <= CONFIG.lr and (off <= 0.01 * CONFIG.lr).float().mean() > 0.99
    moved = [(saved[k] - start[k]).abs().max().item() for k in saved]
    assert min(moved) > 0.5 * CONFIG.lr


def test_a_bf16_policy_is_synced_in_bf16_from_fp32_master_weights(setup, tmp_path):  # type: ignore[no-untyped-def]
    policy, _, _, _ = setup
    tokenizer = build_word_tokenizer(CalcSuite(seed=2).vocabulary())
    model = create_policy(tokenizer, SMALL, seed=0)
    save_checkpoint(model, tokenizer, tmp_path / "bf16", dtype=torch.bfloat16)
    with TrainerGroup(TrainerSpec(CONFIG), StartState(str(tmp_path / "bf16"))) as trainers:
        assert trainers.serving == "bfloat16"
        assert {b.dtype for b in trainers.plan.buckets} == {"bfloat16"}
        assert trainers.plan.nbytes == sum(p.numel() for p in model.parameters()) * 2
    del policy


def test_idle_trainers_stop_themselves_and_free_their_devices(setup):  # type: ignore[no-untyped-def]
    """A run's detached trainers hold a lease: found again, they tell which update they applied
    last (its seed); with no call for ``idle_exit_s`` they stop themselves, and the placement
    group that reserved their devices goes with them."""
    from trace_core.rollout.placement import named_groups
    from trace_core.train.trainer_group import TRAINER_NAMESPACE

    policy, trees, _, _ = setup
    spec = TrainerSpec(CONFIG, workers=2, idle_exit_s=1.0)
    started = TrainerGroup(spec, StartState(str(policy)), name="idle-trainer", detached=True)
    assert len(named_groups("idle-trainer")) == 1  # both ranks' devices, reserved as one
    started.update(trees, seed=7)
    found = TrainerGroup.find(spec, "idle-trainer")
    assert found is not None and found.update_seed == 7

    def held() -> list[str]:  # looked up without calling them (a call renews the lease)
        names = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"] for a in names if a["namespace"] == TRAINER_NAMESPACE]

    assert sorted(held()) == ["idle-trainer-0", "idle-trainer-1"]
    for _ in range(600):  # until they are gone and every CPU is free again
        free = ray.available_resources().get("CPU")
        if not held() and not named_groups("idle-trainer") and free == 4.0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"still held: {held()}, {ray.available_resources()}")


def test_a_call_past_its_limit_ends_in_one_line_naming_it(setup):  # type: ignore[no-untyped-def]
    """An actor alive but stuck would hang the run: every wait on the trainers and the engines
    is bounded (``rollout.waits``), and past its limit one line names who did not answer, the
    call, the limit and its setting, which the CLI prints as its error. The call goes on where
    it runs: the next call, within its limit, gets its answer."""
    from trace_core.cli.output import describe, is_expected

    policy, trees, _, prompt = setup
    with (
        TrainerGroup(TrainerSpec(CONFIG), StartState(str(policy))) as trainers,
        RayEnginePool(policy, workers=1, call_timeout_s=0.001) as pool,
    ):
        patient = trainers.spec
        trainers.spec = replace(patient, wait_timeout_s=0.001)  # an update takes ~0.1 s
        with pytest.raises(WaitTimeoutError) as late:
            trainers.update(trees, seed=7)
        assert str(late.value) == (
            "trainer ranks [0] did not answer within 0.001 s (wait_timeout_s) for update (seed "
            "7): alive but stuck (a hung collective or engine, a frozen node), or the call needs "
            "longer: look at their logs, or raise wait_timeout_s"
        )
        assert is_expected(late.value) and describe(late.value) == str(late.value)
        trainers.spec = patient
        assert len(trainers.pids()) == 1  # answered once the update behind it is done

        with pytest.raises(WaitTimeoutError) as late:
            pool.generate([prompt], PARAMS, seed=5)
        assert str(late.value).startswith(
            "engine workers [0] did not answer within 0.001 s (call_timeout_s) for generate "
            "(call 1): "
        )
        pool.call_timeout_s = 600.0
        assert len(pool.generate([prompt], PARAMS, seed=5)[0]) == PARAMS.n
