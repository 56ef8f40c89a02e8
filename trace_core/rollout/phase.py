"""One rollout phase, the single path every caller takes: ``trace-rl rollout``, the training
loop and the pipeline's iteration step (both through ``train.phases``).

    result = run_rollout(
        "build/policy/calc", pool, suite.make_env, predictor=Path("predictor/"),
        grow=GrowConfig("trace", Budget(64, 2), SamplingParams(max_tokens=48)),
        engine=EngineConfig(workers=2),
    )
    result.trees, result.metrics.prompt_effective_ratio, result.seconds

Prompts, a policy checkpoint, a predictor and engine settings in; budgeted rollout trees
(``rollout.grow``) and their metrics out. The engine comes from ``rollout.engines``, so an
in-process ``TorchEngine`` and a Ray pool of vLLM actors are one config value apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trace_core.algo.metrics import BatchMetrics, measure
from trace_core.algo.prefix import Predictor
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Env, Task
from trace_core.policy.checkpoint import load_tokenizer
from trace_core.policy.format import TurnFormat, TurnStyle
from trace_core.rollout.engine_config import EngineConfig
from trace_core.rollout.engines import EngineSession, open_engine
from trace_core.rollout.grow import GrowConfig, grow_trees
from trace_core.rollout.predictor import ConstantPredictor


@dataclass(frozen=True)
class RolloutResult:
    trees: list[RolloutTree]
    metrics: BatchMetrics
    seconds: float
    """Wall time of the phase, engine start-up included."""
    engine: dict[str, float] = field(default_factory=dict)
    """How the engine was had: ``kept_workers`` (kept actors found running), ``reloads`` and
    ``reload_seconds`` (new weights put into running engines); only what applies."""
    dropped: list[tuple[str, str]] = field(default_factory=list)
    """(task id, error) of each prompt whose env failed: its tree is not in ``trees``."""


def run_rollout(
    checkpoint: str | Path,
    pool: Sequence[Task],
    make_env: Callable[[], Env],
    predictor: Predictor | Path | None,
    grow: GrowConfig,
    engine: EngineConfig,
    address: str | None = None,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: Callable[[float], None] | None = None,
    style: TurnStyle | None = None,
    session: EngineSession | None = None,
    engine_name: str = "",
) -> RolloutResult:
    """Grow one tree per rolled-out prompt of ``pool`` with the policy at ``checkpoint``.

    ``predictor``: a predictor, a saved ``SharedPredictor`` folder, or None for a constant 0.5.
    ``model``/``tokenizer``: the same policy already in memory (the loop's), so an in-process
    engine need not read it back. ``address``: the Ray head of an engine pool.
    ``progress`` is called with the rollout units spent so far; ``style``: the system prompt
    and thinking switch the chat template gets (``policy.format``). ``session``: a run's kept
    engine (its config and address replace ``engine`` and ``address``), which takes this
    checkpoint in place instead of starting again. ``engine_name``: the run's kept engine actors
    (``EngineConfig.keep_alive_s``), found running or started and left running.
    """
    start = time.perf_counter()
    tokenizer = tokenizer or load_tokenizer(checkpoint)
    scorer = load_predictor(predictor, tokenizer)
    if session is not None:
        opened = session.engine(checkpoint, model)
    else:
        opened = open_engine(engine, checkpoint, model, address, engine_name)
    dropped: list[tuple[str, str]] = []
    with opened as sampler:
        trees = grow_trees(
            sampler,
            TurnFormat(tokenizer, style or TurnStyle()),
            make_env,
            pool,
            scorer,
            grow,
            progress=progress,
            dropped=dropped,
        )
        extra = sampler.stats.extra
        had = {k: extra[k] for k in ("kept_workers", "reloads", "reload_seconds") if k in extra}
    metrics = replace(measure(trees), dropped_prompts=len(dropped))
    return RolloutResult(trees, metrics, time.perf_counter() - start, had, dropped)


def load_predictor(
    predictor: Predictor | Path | None, tokenizer: PreTrainedTokenizerBase
) -> Predictor:
    """A saved ``SharedPredictor`` folder loaded with the policy's tokenizer; None: 0.5."""
    if predictor is None:
        return ConstantPredictor()
    if isinstance(predictor, Path):
        from trace_core.policy.predictor import SharedPredictor

        return SharedPredictor.load(predictor, tokenizer)
    return predictor
