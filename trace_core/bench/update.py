"""``trace-rl bench update``: peak memory of one policy update against its micro-batch budget.

    trace-rl bench update --checkpoint models/smollm2 --budgets 0,2048,1024,512 --json update.json

One minibatch of ``paths`` synthetic paths (a ``prompt_tokens`` prompt and a
``generated_tokens`` turn each, random ids and mixed rewards: memory does not depend on what
the tokens say) goes through ``update_policy`` once per budget, each in a fresh process, so
that each peak is its own. The peak is the update's own (``UpdateStats.peak_gib``: the
process's peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA); the update's part is
that peak minus what the process held when the update began, the model loaded
(``UpdateStats.held_gib``). Budget 0 is the unbatched update, the baseline every other row is
a ratio of. Each row also carries ``policy.memory``'s estimate for
the same pass size, so the estimate printed for 1.7B, 8B and 14B models can be judged
against a measurement.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context

import numpy as np

from trace_core.policy.memory import GIB, QWEN3, ModelShape, estimate_update

SIZES = (2048, 8192)
"""Tokens per pass of the printed estimates for the paper's model sizes."""


@dataclass(frozen=True)
class UpdateBenchConfig:
    checkpoint: str
    budgets: tuple[int, ...] = (0, 2048, 1024, 512)
    """Micro-batch token budgets; 0 (the unbatched update) is the baseline."""
    paths: int = 8
    prompt_tokens: int = 128
    generated_tokens: int = 128
    checkpointing: bool = False
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.budgets or min(self.budgets) < 0:
            raise ValueError(f"budgets must be >= 0 and not empty, got {self.budgets}")
        if min(self.paths, self.prompt_tokens, self.generated_tokens) < 1:
            raise ValueError("paths, prompt_tokens and generated_tokens must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


@dataclass(frozen=True)
class UpdateRow:
    budget: int
    passes: int
    loaded_gib: float
    """What the process held after loading the model (RSS; allocated on CUDA)."""
    peak_gib: float
    update_gib: float
    """peak − loaded: what the update itself took."""
    estimate_gib: float
    """``policy.memory``'s estimate of the whole update at this pass size."""
    seconds: float
    logprob_gap: float


def run_update_bench(config: UpdateBenchConfig) -> list[UpdateRow]:
    rows = []
    for budget in config.budgets:
        # A fresh process per budget: a process's peak only ever grows.
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            rows.append(pool.submit(measure_update, config, budget).result())
    return rows


def measure_update(config: UpdateBenchConfig, budget: int) -> UpdateRow:
    """One update at ``budget`` in this (fresh) process."""
    from trace_core.policy.model import load_for_training
    from trace_core.policy.tokenizer import padding_id
    from trace_core.policy.update import UpdateConfig, make_optimizer, update_policy

    model, tokenizer, _ = load_for_training(
        config.checkpoint, config.device
    )  # bf16 autocast on CUDA
    trees = synthetic_trees(config, model.config.vocab_size)
    update = UpdateConfig(
        lr=1e-6, minibatch=config.paths, micro_tokens=budget, checkpointing=config.checkpointing
    )
    start = time.perf_counter()
    stats = update_policy(
        model, make_optimizer(model, update), trees, update, np.random.default_rng(config.seed),
        padding_id(tokenizer),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    tokens = config.prompt_tokens + config.generated_tokens
    pass_tokens = budget or config.paths * tokens
    estimate = estimate_update(
        ModelShape.from_config(model.config), pass_tokens, config.checkpointing, config.device
    )
    return UpdateRow(
        budget=budget,
        passes=stats.passes,
        loaded_gib=stats.held_gib,
        peak_gib=stats.peak_gib,
        update_gib=stats.peak_gib - stats.held_gib,
        estimate_gib=estimate.total / GIB,
        seconds=seconds,
        logprob_gap=stats.logprob_gap,
    )


def synthetic_trees(config: UpdateBenchConfig, vocab: int) -> list:  # type: ignore[type-arg]
    """Trees of four paths each (two rewarded), random ids below ``vocab``."""
    from trace_core.algo.tree import ROOT, TreeBuilder, TreeInfo

    rng = np.random.default_rng(config.seed)
    trees = []
    for t in range(0, config.paths, 4):
        builder = TreeBuilder(
            TreeInfo(prompt_id=f"bench-{t}", tree_id=t),
            prompt_tokens=rng.integers(0, vocab, config.prompt_tokens, dtype=np.int32),
        )
        for k in range(min(4, config.paths - t)):
            gen = rng.integers(0, vocab, config.generated_tokens, dtype=np.int32)
            node = builder.add_turn(ROOT, gen_tokens=gen, logprobs=np.full(len(gen), -10.0))
            builder.set_reward(node, float(k % 2))
        trees.append(builder.build())
    return trees


def estimates(checkpointing: bool = True) -> dict[str, dict[int, float]]:
    """GiB of one update on CUDA for the paper's model sizes at each of ``SIZES``."""
    return {
        name: {t: estimate_update(shape, t, checkpointing).total / GIB for t in SIZES}
        for name, shape in QWEN3.items()
    }


def rows_to_json(config: UpdateBenchConfig, rows: list[UpdateRow]) -> dict[str, object]:
    base = rows[0] if rows[0].budget == 0 else None
    return {
        "config": {**asdict(config), "budgets": list(config.budgets)},
        "rows": [
            {
                **asdict(r),
                "update_ratio": r.update_gib / base.update_gib
                if base and base.update_gib
                else None,
            }
            for r in rows
        ],
        "estimates_gib": {
            "checkpointing": {k: dict(v) for k, v in estimates(True).items()},
            "no_checkpointing": {k: dict(v) for k, v in estimates(False).items()},
        },
    }
