"""``trace-rl bench scale``: the request stream read off real trees, the simulation's
invariants, the calibration fit, the validation and the CLI.

The trees are grown once by ``scale_calibrate.grow_workload`` (the ``bench workers``
workload, tiny) with a random tiny policy on calc: its turns are noise that runs to the token
limit, which is all the simulation reads (token counts and tree shape). Nothing here asserts
on how long anything took.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from trace_core.algo.tree import RolloutTree
from trace_core.bench.iteration_cost import QWEN3, SHAPES, run_iteration_cost, staleness_costs
from trace_core.bench.scale import GPU_PROFILES, ScaleBenchConfig, load_stream, validate
from trace_core.bench.scale_calibrate import grow_workload, nonnegative_lstsq
from trace_core.bench.scale_sim import (
    COEFFICIENTS,
    VARIANTS,
    CostModel,
    assign,
    batch_features,
    batch_seconds,
    simulate,
)
from trace_core.bench.scale_trace import TurnStream, flat_stream, resize_stream, turn_stream
from trace_core.bench.workers import WorkersBenchConfig
from trace_core.cli import app
from trace_core.envs.calc import CalcSuite
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import TinyPolicyConfig, create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.routing import split_work
from trace_core.store.schema import write_trees

BY_NAME = {v.name: v for v in VARIANTS}
CPU = CostModel(
    call_s=1e-3, prefill_token_s=1e-5, prefill_attention_s=1e-9, prompt_token_s=1e-6,
    decode_step_s=3e-4, decode_row_s=1e-5, decode_context_s=1e-7, max_batch=256,
    transport_s=1e-3, route_token_s=5e-7, driver_turn_s=1e-4,
)  # fmt: skip
"""About what ``scale-calibrate`` fits for the tiny policy here."""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fmt = TurnFormat(build_word_tokenizer(CalcSuite(seed=0).vocabulary()))
    path = tmp_path_factory.mktemp("policy") / "calc"
    save_checkpoint(create_policy(fmt.tokenizer, TinyPolicyConfig(), seed=0), fmt.tokenizer, path)
    return path


@pytest.fixture(scope="module")
def trees(checkpoint: Path) -> list[RolloutTree]:
    from trace_core.policy.model import load_checkpoint

    model, tokenizer = load_checkpoint(checkpoint)
    workload = WorkersBenchConfig(checkpoint, prompts=16, roots=16, max_tokens=6)
    return grow_workload(TorchEngine(model), TurnFormat(tokenizer), workload)


@pytest.fixture(scope="module")
def tree_file(trees: list[RolloutTree], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trees") / "trees.parquet"
    write_trees(path, trees)
    return path


@pytest.fixture(scope="module")
def stream(tree_file: Path) -> TurnStream:
    return load_stream(ScaleBenchConfig((tree_file,), GPU_PROFILES["h100-8b-vllm"]))


# --- the request stream ------------------------------------------------------------------
def test_every_turn_is_the_request_that_grew_it(trees: list[RolloutTree]) -> None:
    """Brute force: a turn's prompt is the concatenation of its path's tokens."""
    s = turn_stream(trees)
    assert s.turns == sum(t.size - 1 for t in trees)
    for row in range(s.turns):
        tree = trees[s.tree[row]]
        path = tree.path(int(s.node[row]))[:-1]
        prompt = sum(len(tree.gen_tokens[n]) + len(tree.obs_tokens[n]) for n in path)
        assert s.prompt_tokens[row] == prompt
        assert s.generated_tokens[row] == len(tree.gen_tokens[s.node[row]])
        if s.parent[row] >= 0:  # the parent row is the parent node of the same tree
            assert s.tree[s.parent[row]] == s.tree[row]
            assert s.node[s.parent[row]] == tree.parent[s.node[row]]
        in_stage2 = any(tree.branch[n] for n in tree.path(int(s.node[row])))
        assert s.stage[row] == (2 if in_stage2 else 1)
    assert s.branch.sum() == sum(t.continuations for t in trees) > 0
    assert (s.reusable_tokens <= s.prompt_tokens).all()


def test_flat_grpo_spends_the_same_units(trees: list[RolloutTree]) -> None:
    s = turn_stream(trees)
    flat = flat_stream(s)
    firsts = np.bincount(flat.tree[flat.parent < 0], minlength=s.trees)
    for t, tree in enumerate(trees):
        assert firsts[t] == round(tree.units)  # 1 per root, 0.5 per continuation, as episodes
    assert not flat.branch.any() and (flat.stage == 1).all()


def test_resizing_keeps_prompts_consistent(stream: TurnStream) -> None:
    big = resize_stream(stream, copies=3, token_scale=2.5)
    assert big.trees == 3 * stream.trees and big.turns == 3 * stream.turns
    child = np.flatnonzero(big.parent >= 0)
    p = big.parent[child]
    assert (big.prompt_tokens[child] == big.prompt_tokens[p] + big.generated_tokens[p]
            + big.observation_tokens[p]).all()  # fmt: skip
    assert (big.tree[child] == big.tree[p]).all()


# --- the service-time model --------------------------------------------------------------
def test_batch_seconds_by_hand() -> None:
    """Two rows: prompt 10 (4 cached, 6 prefilled) making 3 tokens; prompt 5 (all new), 1."""
    cost = CostModel(
        call_s=1.0, prefill_token_s=0.1, prefill_attention_s=0.01, prompt_token_s=0.001,
        decode_step_s=2.0, decode_row_s=0.5, decode_context_s=0.02,
    )  # fmt: skip
    rows = np.array([6, 5]), np.array([4, 0]), np.array([3, 1])
    # Both: call 1 + prefill 0.1 × 11 + attention 0.01 × (6 × (4 + 3) + 5 × 2.5)
    # + prompt 0.001 × 15.
    head = 1 + 1.1 + 0.01 * 54.5 + 0.015
    # vLLM (continuous): row 1 takes 2 steps (its first token came with the prefill), row 2
    # none: steps 2 × 2.0 + row-steps 2 × 0.5 + context 0.02 × ((10 + 1) + (10 + 2)).
    vllm = replace(cost, continuous=True, max_batch=1)  # max(2 steps, 2 row-steps / 1 slot)
    assert batch_seconds(vllm, *rows) == pytest.approx(head + 4.0 + 1.0 + 0.02 * 23)
    # TorchEngine: step 0 runs both rows over 10 + 1 columns; row 2 is done (half the rows:
    # it leaves); row 1 runs steps 1 and 2 over 12 and 13 columns, done after step 2.
    # steps 3 × 2.0 + row-steps 4 × 0.5 + columns 0.02 × (2 × 11 + 12 + 13).
    assert batch_seconds(cost, *rows) == pytest.approx(head + 6.0 + 2.0 + 0.02 * 47)


def test_affinity_routing_is_split_work_from_empty_loads() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        workers, groups = int(rng.integers(1, 6)), int(rng.integers(1, 12))
        owners = [None if o < 0 else int(o) for o in rng.integers(-1, workers, size=groups)]
        home = rng.integers(1, 50, size=groups).astype(float).tolist()
        away = [h + float(rng.integers(0, 50)) for h in home]
        mine = assign(owners, home, away, np.zeros(workers), "affinity", 0.15, rng)
        assert mine == split_work(owners, home, away, list(range(workers)), 0.15)


def test_the_fit_recovers_the_model_that_made_the_timings() -> None:
    """Calls shaped as ``scale-calibrate`` times them (fresh, decode, cached, and rows that
    stop early), their seconds made by a known model: the fit gives that model back."""
    c = replace(CPU, decode_copy_s=3e-6)
    rng = np.random.default_rng(0)
    rows = []
    for b in (1, 4, 16, 64):
        for length in (32, 160):
            prompts = rng.integers(length // 4, length + 1, b)
            zeros, ones = np.zeros(b, np.int64), np.ones(b, np.int64)
            stops = rng.integers(1, 25, b)  # a rollout call: rows stop at different tokens
            for prefill, cached, gen in (
                (prompts, zeros, ones), (prompts, zeros, ones * 24), (ones, prompts - 1, ones),
                (prompts // 2, prompts - prompts // 2, stops),
            ):  # fmt: skip
                rows.append(batch_features(prefill, cached, gen, 256, continuous=False))
    x = np.array(rows)
    y = x @ np.array([getattr(c, name) for name in COEFFICIENTS])
    assert nonnegative_lstsq(x, y) == pytest.approx([getattr(c, n) for n in COEFFICIENTS])


def test_torch_engine_rows_leave_a_quarter_at_a_time() -> None:
    """Four rows of prompt 10 making 1, 5, 5, 5 tokens: the short row is done after step 0
    (1 of 4: a quarter, so it leaves), the rest run steps 1-4 (done after step 4)."""
    f = batch_features(np.full(4, 10), np.zeros(4, np.int64), np.array([1, 5, 5, 5]), 256, False)
    steps, row_steps, columns, copied = f[4:]
    assert steps == 5 and row_steps == 4 + 3 * 4
    assert columns == 4 * 11 + 3 * (12 + 13 + 14 + 15)  # the longest prompt + t + 1 columns
    assert copied == 3 * 11  # three rows kept after step 0


# --- the simulation ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BY_NAME))
def test_the_simulation_conserves_tokens(stream: TurnStream, name: str) -> None:
    workload = flat_stream(stream) if BY_NAME[name].workload == "flat" else stream
    for w in (1, 3, 16):
        r = simulate(stream, BY_NAME[name], w, CPU)
        assert r.generated_tokens == workload.generated_tokens.sum()
        assert r.prefill_tokens + r.cache_hit_tokens == workload.prompt_tokens.sum()
        assert r.cache_hit_tokens <= workload.reusable_tokens.sum()  # nothing hits unseen tokens
        assert 0 < r.utilisation <= 1 and r.imbalance >= 0


def test_one_worker_hits_every_reusable_token(stream: TurnStream) -> None:
    r = simulate(stream, BY_NAME["trace"], 1, CPU)
    assert r.cache_hit_tokens == stream.reusable_tokens.sum()
    # An async driver changes nothing with one worker: every turn waits for the last call.
    assert simulate(stream, BY_NAME["trace-async"], 1, CPU).makespan_s == pytest.approx(
        r.makespan_s
    )


def test_a_global_barrier_costs_an_async_driver_on_wide_pools(stream: TurnStream) -> None:
    """With an async driver and as many workers as prompts or more, the barrier leaves
    workers idle while the slowest prompt's roots finish. With fewer workers it can batch
    stage 2 better instead (on this 16-prompt workload: 0.4% faster at 4 workers, 3.8% at 8),
    as it may under lock-step, which already waits for the slowest turn of every call: no
    assertion there."""
    for w in (16, 64):
        local = simulate(stream, BY_NAME["trace-async"], w, CPU).makespan_s
        assert simulate(stream, BY_NAME["trace-async-barrier"], w, CPU).makespan_s >= local


def test_the_continuous_driver_sends_each_turn_alone_into_the_running_batches(
    stream: TurnStream,
) -> None:
    """Every turn is an admission of its own, and a worker holds at most ``max_batch`` rows:
    with one row a worker, turns run one after another (every decode step of each paid
    alone), slower than with rows to share the steps."""
    vllm = replace(CPU, continuous=True)
    wide = simulate(stream, BY_NAME["trace-continuous"], 2, vllm)
    assert wide.engine_calls == stream.turns
    assert wide.generated_tokens == stream.generated_tokens.sum()
    narrow = simulate(stream, BY_NAME["trace-continuous"], 2, replace(vllm, max_batch=1))
    assert narrow.makespan_s > wide.makespan_s
    steps = int(np.maximum(stream.generated_tokens - 1, 0).sum())  # one row a step
    assert narrow.makespan_s >= steps * vllm.decode_step_s / 2


def test_affinity_keeps_more_tokens_in_cache_than_random(stream: TurnStream) -> None:
    for w in (2, 8):
        affinity = simulate(stream, BY_NAME["trace"], w, CPU).cache_hit_tokens
        random = simulate(stream, BY_NAME["trace-random"], w, CPU, seed=1).cache_hit_tokens
        least = simulate(stream, BY_NAME["trace-least-loaded"], w, CPU).cache_hit_tokens
        assert affinity > random and affinity > least


def test_more_workers_never_slow_least_loaded_routing(stream: TurnStream) -> None:
    # Until W exceeds the widest call, then it stays flat: the extra workers get nothing.
    spans = [
        simulate(stream, BY_NAME["trace-least-loaded"], w, CPU).makespan_s for w in range(1, 9)
    ]
    assert all(b <= a * 1.0001 for a, b in itertools.pairwise(spans))
    assert spans[-1] < spans[0]


def test_the_simulation_is_deterministic(stream: TurnStream) -> None:
    a = simulate(stream, BY_NAME["trace-random"], 8, CPU, seed=3)
    assert a == simulate(stream, BY_NAME["trace-random"], 8, CPU, seed=3)


# --- validation and the per-iteration cost -----------------------------------------------
def test_validation_compares_with_the_measured_runs(stream: TurnStream) -> None:
    measured = {
        "runs": [
            {"engine": "in-process", "workers": 0, "tokens_per_s": 900.0, "busy_share": 1.0},
            {"engine": "torch ray×1", "workers": 1, "tokens_per_s": 800.0, "busy_share": 0.8},
            {"engine": "torch ray×2", "workers": 2, "tokens_per_s": 1200.0, "busy_share": 0.6},
            {"engine": "vllm ray×2", "workers": 2, "tokens_per_s": 50.0, "busy_share": 0.5},
        ]
    }
    rows = validate(stream, CPU, measured)
    assert [r.run for r in rows] == ["in-process", "torch ray×1", "torch ray×2"]
    two = simulate(stream, BY_NAME["trace"], 2, CPU)
    assert rows[2].predicted_tokens_per_s == two.tokens_per_s
    assert rows[2].error == pytest.approx(two.tokens_per_s / 1200.0 - 1)
    no_ray = replace(CPU, transport_s=0.0, route_token_s=0.0)
    assert (
        rows[0].predicted_tokens_per_s == simulate(stream, BY_NAME["trace"], 1, no_ray).tokens_per_s
    )
    with pytest.raises(ValueError, match="bench workers"):
        validate(stream, CPU, {"rows": []})


def test_iteration_cost_arithmetic(tree_file: Path) -> None:
    from trace_core.bench.iteration_cost import (
        CHECKPOINT_EVERY,
        NCCL_BYTES_S,
        S3_POD_BYTES_S,
        SYNC_FIXED_S,
    )

    s3, resident = run_iteration_cost([tree_file], models=("8b",))
    params = QWEN3["8b"].params
    assert (s3.design, resident.design) == ("s3", "resident")
    assert s3.policy_bytes == 2 * params and s3.optimizer_bytes == 12 * params
    state = s3.policy_bytes + s3.optimizer_bytes
    # Every copy of the S3 design: launcher (policy, reference, optimizer), driver (optimizer),
    # 16 ranks (state each), staging, driver's round trip, KFP pod, launcher, and the rollout
    # pod and 2 engine nodes (the policy each); the trees a few MB.
    copies = 2 * s3.policy_bytes + 2 * s3.optimizer_bytes + (1 + 2 + 1 + 1 + 16) * state
    assert copies + 3 * s3.policy_bytes <= s3.s3_bytes < copies + 3 * s3.policy_bytes + 1e9
    # Resident: trees every iteration and a fifth of a checkpoint; weights by NCCL.
    assert state / CHECKPOINT_EVERY <= resident.s3_bytes < state / CHECKPOINT_EVERY + 1e9
    assert resident.reload_s == pytest.approx(SYNC_FIXED_S + s3.policy_bytes / NCCL_BYTES_S)
    assert resident.rollout_s == s3.rollout_s and resident.update_s == s3.update_s
    # The checkpoint is written while the next rollout runs: only what outlasts it counts.
    outlasts = max(0.0, state / S3_POD_BYTES_S - resident.rollout_s) / CHECKPOINT_EVERY
    assert resident.update_io_s == pytest.approx(outlasts)
    for r in (s3, resident):
        assert r.total_s == pytest.approx(r.s3_s + r.reload_s + r.pods_s + r.rollout_s + r.update_s)
    assert resident.outside_share < s3.outside_share / 3
    assert set(SHAPES) == set(QWEN3)


def test_staleness_overlaps_rollout_and_update(tree_file: Path) -> None:
    """k = 0: rollout + max(fit, update); k >= 1: max(fit + rollout, update); both + sync, the
    pod, the trees and a checkpoint's share (its upload holds up the next update)."""
    from trace_core.bench.iteration_cost import CHECKPOINT_EVERY, FIT_S, S3_POD_BYTES_S

    rows = run_iteration_cost([tree_file])
    stale = staleness_costs(rows)
    resident = [r for r in rows if r.design == "resident"]
    assert [c.model for c in stale] == [r.model for r in resident] == list(SHAPES)
    for c, r in zip(stale, resident, strict=True):
        shares = r.pods_s + r.s3_s - r.update_io_s  # the pod and the trees
        upload = (r.policy_bytes + r.optimizer_bytes) / S3_POD_BYTES_S
        ahead, behind = max(FIT_S + r.rollout_s, r.update_s), max(FIT_S, r.update_s)
        held = max(FIT_S, r.update_s + max(0.0, upload - r.rollout_s))
        expect_0 = r.rollout_s + behind + r.reload_s + shares + (held - behind) / CHECKPOINT_EVERY
        later = (max(FIT_S + r.rollout_s, r.update_s + upload) - ahead) / CHECKPOINT_EVERY
        assert c.iteration_s(0) == pytest.approx(expect_0)
        assert c.iteration_s(1) == pytest.approx(ahead + r.reload_s + shares + later)
        assert c.iteration_s(2) == c.iteration_s(1) <= c.iteration_s(0)
        assert c.speedup(1) == c.iteration_s(0) / c.iteration_s(1) >= 1.0
        if r.update_s >= FIT_S:  # the fit hides behind the update: k = 0 is the table's row
            assert c.iteration_s(0) == pytest.approx(r.total_s)


def test_iteration_cost_command_prints_the_staleness(tree_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    args = ["bench", "iteration-cost", "--trees", str(tree_file), "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["rows"]] == [m for m in SHAPES for _ in ("s3", "resident")]
    for c in data["staleness"]:
        times, speedup = c["iteration_s"], c["speedup"]
        assert list(times) == ["0", "1", "2"] and list(speedup) == ["1", "2"]
        assert speedup["1"] == times["0"] / times["1"] and speedup["2"] == speedup["1"]
        name = f"Qwen3-{c['model'].upper()} "
        line = [x for x in result.output.splitlines() if name in x][-1]  # the second table's
        cells = [f"{times[k]:.1f}" for k in "012"] + [f"{speedup[k]:.2f}×" for k in "12"]
        assert all(cell in line for cell in cells), (line, cells)


def test_iteration_cost_says_which_transport_each_transfer_takes(
    tree_file: Path, tmp_path: Path
) -> None:
    """Every row lists its transfers with their transports, from where the run's devices land
    (``tests/bench/test_transports.py``); the S3 ones add up to the row's S3 bytes; the command
    prints them and writes them in its JSON."""
    from trace_core.bench.iteration_cost import NETWORK, NVLINK, S3, RunLayout

    rows = run_iteration_cost([tree_file])
    for r in rows:
        assert r.layout == RunLayout.of(SHAPES[r.model])
        by_name = {t.name: t for t in r.transfers}
        s3_bytes = sum(t.bytes for t in r.transfers if t.transport == S3)
        assert s3_bytes == pytest.approx(r.s3_bytes), r.model
        assert by_name["fsdp all-gather"].bytes == r.policy_bytes
        if r.design == "resident":
            assert by_name["weight broadcast"].transport == r.layout.sync_transport == NETWORK
    small = {t.name: t.transport for t in rows[1].transfers}  # 1.7B resident: 8 + 8 GPUs
    assert (small["fsdp all-gather"], small["weight broadcast"]) == (NVLINK, NETWORK)
    out = tmp_path / "cost.json"
    args = ["bench", "iteration-cost", "--trees", str(tree_file), "--json", str(out)]
    result = CliRunner().invoke(app, args, terminal_width=240)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    first = data["rows"][1]["transfers"]
    assert [t["transport"] for t in first] == [NVLINK, NETWORK, S3, S3]
    assert data["rows"][1]["layout"] == {
        "trainer_nodes": 1,
        "engines_beside_trainers": 0,
        "engine_nodes": 1,
    }
    line = next(x for x in result.output.splitlines() if "weight broadcast" in x)
    assert "Qwen3-1.7B" in line and NETWORK in line and "trainer rank 0" in line


# --- the command line --------------------------------------------------------------------
def test_bench_scale_command(tree_file: Path, tmp_path: Path) -> None:
    out, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    measured = tmp_path / "workers.json"
    measured.write_text(json.dumps({"runs": [
        {"engine": "torch ray×1", "workers": 1, "tokens_per_s": 100.0, "busy_share": 0.8},
    ]}))  # fmt: skip
    args = ["bench", "scale", "--trees", str(tree_file), "--profile", "h100-8b-vllm"]
    result = CliRunner().invoke(
        app, [*args, "--measured", str(measured), "--json", str(out), "--plot", str(plot)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["config"]["workers"] == [1, 2, 8, 64, 256]
    runs = {(r["variant"], r["workers"]) for r in data["runs"]}
    assert runs == {(v, w) for v in BY_NAME for w in (1, 2, 8, 64, 256)}
    assert data["ratios"]["trace W=64"]["vs_trace"] == 1.0
    assert data["validation"][0]["measured_tokens_per_s"] == 100.0
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert "÷ grpo" in result.output and "speed-up" in result.output


def test_bench_scale_names_a_missing_profile(tree_file: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    args = ["bench", "scale", "--trees", str(tree_file), "--profile", str(missing)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--profile" in result.output and "scale-calibrate" in result.output


@pytest.mark.slow
def test_calibrate_command_feeds_bench_scale(checkpoint: Path, tmp_path: Path) -> None:
    """The real fit on the tiny policy, without Ray; the profile it writes then runs."""
    trees, profile, out = tmp_path / "trees.parquet", tmp_path / "cpu.json", tmp_path / "s.json"
    result = CliRunner().invoke(app, [
        "bench", "scale-calibrate", "--checkpoint", str(checkpoint), "--trees", str(trees),
        "--output", str(profile), "--prompts", "8", "--budget", "8", "--max-tokens", "6",
        "--no-transport",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(profile.read_text())
    cost = data["cost"]
    assert cost["transport_s"] == 0.0 and cost["decode_step_s"] + cost["decode_row_s"] > 0
    kinds = [m["kind"] for m in data["measurements"]]
    # 4 batch sizes × 2 prompt lengths × (equal, mixed) × (fresh, decode, cached), then one
    # per engine call of the practice rollout.
    assert kinds[:48] == ["fresh", "decode", "cached"] * 16 and set(kinds[48:]) == {"rollout"}
    args = ["bench", "scale", "--trees", str(trees), "--profile", str(profile)]
    result = CliRunner().invoke(app, [*args, "--workers", "1,2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["profile"]["name"] == "cpu-calc"
