"""``trace-rl bench contrast`` (``run_contrast_bench``) with a scripted engine on calc.

The bench builds a ``TorchEngine`` from the checkpoint for every (iteration, strategy); here
that name is swapped for ``ScriptedCalc``, which plays each task's reference turns and gets
the final answer right with a probability set by the task's number of operations:

    ops=1: always right     ops=2: right half the time     ops=3: never right

so a third of the prompts (ops=2) are the only ones that can give a mixed group, and where
the budget goes decides how much contrast it buys. The checkpoint is a random tiny policy:
the bench needs its tokenizer, the engine never runs it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from support import parity
from typer.testing import CliRunner

from trace_core.bench import contrast
from trace_core.bench.allocation import METRICS
from trace_core.bench.contrast import (
    REAL_STRATEGIES,
    TIMING,
    ContrastBenchConfig,
    run_contrast_bench,
)
from trace_core.cli import app
from trace_core.envs.base import Task
from trace_core.envs.calc import CalcMixSuite, CalcSuite
from trace_core.policy.engine import Completion, EngineStats, SamplingParams
from trace_core.policy.format import TurnFormat
from trace_core.policy.model import create_policy, save_checkpoint
from trace_core.policy.tokenizer import build_word_tokenizer

SEED = 0
SUITE = CalcSuite(seed=SEED)  # what make_suite("calc", None, SEED) builds inside the bench
FMT = TurnFormat(build_word_tokenizer(SUITE.vocabulary()))
RIGHT = {1: 1.0, 2: 0.5, 3: 0.0}
"""P(final answer right) by the task's ops."""
BY_HEAD = {tuple(FMT.prompt_ids(t.prompt)): t for t in SUITE.tasks("train")}


class ScriptedCalc:
    """The ``Engine`` protocol: the next reference turn of the task a prompt belongs to; the
    answer turn is right with probability ``RIGHT[ops]``, else ``answer[0]`` (never a calc
    answer). Draws are seeded by the call's seed, the prompt's place in the call and its
    tokens, so equal histories in one call (a group's episodes) still draw apart."""

    by_head: ClassVar[dict[tuple[int, ...], Task]] = BY_HEAD
    """The tasks, by their prompt's tokens up to the first turn."""

    def __init__(self, model: object = None) -> None:
        self.stats = EngineStats()

    def right(self, task: Task) -> float:
        return RIGHT[int(task.difficulty[len("ops=")])]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int | None = None
    ) -> list[list[Completion]]:
        out = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            # The prompt ends 5 tokens after its first <|im_end|>: "\n <|im_start|> assistant \n".
            task = self.by_head[tuple(ids[: ids.index(FMT.end_of_turn_id) + 5])]
            turn = ids.count(FMT.end_of_turn_id) - 1  # the prompt holds one
            rng = np.random.default_rng(
                [seed or 0, i, zlib.crc32(np.asarray(ids, np.int64).tobytes())]
            )
            samples = []
            for _ in range(params.n):
                action = task.reference[min(turn, len(task.reference) - 1)]
                if action.startswith("answer[") and rng.random() >= self.right(task):
                    action = "answer[0]"
                tokens = np.asarray(FMT.action_ids(action), np.int32)
                samples.append(Completion(tokens, np.zeros(len(tokens), np.float32), True))
            out.append(samples)
        return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("contrast") / "policy"
    save_checkpoint(create_policy(FMT.tokenizer, parity.SMALL, seed=0), FMT.tokenizer, path)
    return path


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contrast, "TorchEngine", ScriptedCalc)


def test_trace_buys_more_contrast_per_unit_than_grpo(checkpoint: Path, scripted: None) -> None:
    """128 prompts, M = 64, N = 2, 3 iterations (figures: iterations 2 and 3).

    grpo spends 64 × (1 + 2/2) = 128 units as 128 / 8 = 16 groups of 8 on random prompts; a
    group is mixed only on an ops=2 prompt (1/3 of them), then with probability
    1 − 2 · 0.5⁸ = 0.992: 16 × 1/3 × 0.992 = 5.3 mixed groups, 100 × 5.3 / 128 = 4.1 per 100
    units expected. Measured over the bench's seeds 0–7 (this engine): grpo 2.73–4.69, trace
    24.22–37.50, trace at least 6.5× grpo on every seed (prompt effective ratio grpo
    0.22–0.38, trace 0.48–0.68); seed 0, this test: grpo 3.91, trace 33.59 (8.6×).
    """
    config = ContrastBenchConfig(
        checkpoint, prompts=128, budget=64, iterations=3, seed=SEED, strategies=("grpo", "trace")
    )
    result = run_contrast_bench(config)
    grpo, trace = (result.strategies[name] for name in ("grpo", "trace"))
    for metrics in (grpo, trace):
        # Equal budget on every counted iteration: M(1 + N/2) = 128 units, std 0.
        assert (metrics["units"].mean, metrics["units"].std) == (128.0, 0.0)
        assert metrics["tokens"].mean > 0 and metrics["wall_seconds"].mean > 0
    assert 2.0 <= grpo["mixed_per_100_units"].mean <= 7.0  # 4.1 expected (above)
    assert trace["mixed_per_100_units"].mean >= 3 * grpo["mixed_per_100_units"].mean
    assert trace["prompt_effective_ratio"].mean > grpo["prompt_effective_ratio"].mean

    data = json.loads(json.dumps(result.to_json()))  # survives a JSON round trip
    assert data["config"]["checkpoint"] == str(checkpoint)
    assert data["config"]["strategies"] == ["grpo", "trace"]
    assert list(data["strategies"]) == ["grpo", "trace"]
    for metrics in data["strategies"].values():
        assert list(metrics) == [*METRICS, *TIMING]
        assert all(set(summary) == {"mean", "std"} for summary in metrics.values())


MIX = CalcMixSuite(seed=SEED)
MIX_RIGHT = {"ops=1,digits=1": 0.98, "ops=3,digits=3": 0.01}
"""P(final answer right) on calc-mix, about as the warm-started policy has it: nearly always on
the easiest level, nearly never on the hardest, half the time on the levels between."""


class ScriptedMix(ScriptedCalc):
    by_head: ClassVar[dict[tuple[int, ...], Task]] = {
        tuple(FMT.prompt_ids(t.prompt)): t for t in MIX.tasks("train")
    }

    def right(self, task: Task) -> float:
        return MIX_RIGHT.get(task.difficulty, 0.5)


def test_in_the_saturated_regime_trace_finds_the_prompts_that_disagree(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """calc-mix, seeded: the paper's regime, where most prompts are all-success or all-failure.

    grpo's groups of 8 are mixed with probability 1 − 0.98⁸ − 0.02⁸ = 0.149 on the easiest
    level (10 of 20 prompts), 1 − 0.99⁸ − 0.01⁸ = 0.077 on the hardest (5 of 20) and
    1 − 2 · 0.5⁸ = 0.992 between (5 of 20): a prompt effective ratio of 0.5 × 0.149 +
    0.25 × 0.077 + 0.25 × 0.992 = 0.34 expected, in the paper's 20–35% (it measures 26.8%).
    trace's predictor learns from its first iteration's trees which prompts disagree and
    spends its roots there. Measured (iterations 2–3), seeds 0–3: grpo 0.27–0.38, trace
    0.85–0.91, at least 2.3× grpo; seed 0, this test: 0.34 and 0.86."""
    monkeypatch.setattr(contrast, "TorchEngine", ScriptedMix)
    config = ContrastBenchConfig(
        checkpoint,
        task="calc-mix",
        prompts=256,
        budget=128,
        iterations=3,
        seed=SEED,
        strategies=("grpo", "trace"),
    )
    result = run_contrast_bench(config)
    grpo, trace = (result.strategies[name]["prompt_effective_ratio"] for name in ("grpo", "trace"))
    assert 0.15 <= grpo.mean <= 0.45  # 0.34 expected (above)
    assert trace.mean >= 1.5 * grpo.mean


def test_cli_table_says_what_the_json_holds(
    checkpoint: Path, scripted: None, tmp_path: Path
) -> None:
    """Every strategy's row (mixed/100u, ÷ grpo, tokens) against the JSON the same run wrote."""
    out = tmp_path / "contrast.json"
    run = CliRunner().invoke(
        app,
        [
            "bench", "contrast", "--checkpoint", str(checkpoint), "--prompts", "64",
            "--budget", "16", "--iterations", "2", "--threads", "1", "--json", str(out),
        ],
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    assert "M=16 roots × N=2 → 32 units" in run.output
    data = json.loads(out.read_text())
    assert data["config"]["prompts"] == 64 and data["config"]["iterations"] == 2
    assert list(data["strategies"]) == list(REAL_STRATEGIES)
    rows = {
        cells[0]: cells
        for line in run.output.splitlines()
        if (cells := [c.strip() for c in line.strip("│ ").split("│")])[0] in REAL_STRATEGIES
    }
    assert list(rows) == list(REAL_STRATEGIES)
    base = data["strategies"]["grpo"]["mixed_per_100_units"]["mean"]
    assert base > 0  # else every ratio below would be nan
    for name, m in data["strategies"].items():
        assert m["units"] == {"mean": 32.0, "std": 0.0}, name  # 16 × (1 + 2/2)
        mixed = m["mixed_per_100_units"]
        _, _, _, shown_mixed, ratio, tokens, _ = rows[name]
        assert shown_mixed == f"{mixed['mean']:.2f} ± {mixed['std']:.2f}", name
        assert ratio == f"{mixed['mean'] / base:.2f}×", name
        assert tokens == f"{m['tokens']['mean']:,.0f}", name


def test_cli_without_a_policy_says_how_to_make_one(tmp_path: Path) -> None:
    run = CliRunner().invoke(app, ["bench", "contrast", "--checkpoint", str(tmp_path / "none")])
    assert run.exit_code == 2
    said = " ".join(run.output.split())
    assert f"no policy at {tmp_path / 'none'}: run `trace-rl warmstart" in said
