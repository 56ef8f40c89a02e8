"""One training iteration in pieces, shared by the local loop (``train.loop``) and the pipeline's
steps (``train.steps``): both draw, roll out, fit and update through these functions, so a
pipeline run and ``trace-rl train`` with the same config sample and learn the same thing.

    draws = draw_iteration(config.seed, i, len(train_tasks), config.prompts)   # train.draws
    trees = roll_out(policy_dir, train_tasks, suite, predictor, config, i, draws,
                     run_id="nightly").trees
    fit = fit_predictor(predictor, trees, draws)
    stats = update(model, optimizer, trees, config, draws, padding_id(tokenizer), reference)

Every random draw of iteration i comes from a generator seeded by (seed, i), in one fixed order
(pool, rollout seed, predictor seed, update seed): a step that runs on its own, in another
process or on another machine, draws what the loop would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trace_core.algo.forecast import brier_score
from trace_core.algo.plan import Budget
from trace_core.algo.tree import RolloutTree
from trace_core.envs.base import Env, Task, TaskSuite
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat, TurnStyle
from trace_core.policy.predictor import FitReport, PredictorConfig, SharedPredictor
from trace_core.policy.update import UpdateStats, update_policy
from trace_core.rollout.engines import EngineSession, open_engine
from trace_core.rollout.grow import GrowConfig
from trace_core.rollout.phase import RolloutResult, run_rollout
from trace_core.train.config import TrainConfig, warmstart_steps
from trace_core.train.draws import IterationDraws
from trace_core.train.evaluate import EvalReport, evaluate_policy
from trace_core.train.warmstart import PRETRAINED_SFT, WarmstartConfig


def warmstart_config(
    config: TrainConfig, output: Path, init: Path | None = None
) -> WarmstartConfig:
    """The run's warm start: of the tiny policy, or (``init``: the local folder of
    ``config.init``, with ``warmstart_init``) the short SFT of a pretrained model on reference
    solutions (``PRETRAINED_SFT``) in the run's turn length. Its steps come from the run's
    config, and it plays no more demonstrations than its steps can see (steps × batch)."""
    base = PRETRAINED_SFT if init else WarmstartConfig().sft
    sft = replace(base, steps=warmstart_steps(config), seed=config.seed if init else base.seed)
    return WarmstartConfig(
        task=config.task,
        output=output,
        seed=config.seed,
        demos=min(WarmstartConfig().demos, sft.steps * sft.batch_size),
        sft=sft,
        eval_tasks=16 if init else 50,
        eval_samples=1,
        init=init,
        max_tokens=config.max_tokens if init else WarmstartConfig().max_tokens,
    )


def turn_format(
    config: TrainConfig, suite: TaskSuite, tokenizer: PreTrainedTokenizerBase
) -> TurnFormat:
    """The run's turn layout: the policy's chat template, the suite's action grammar as the
    system prompt, thinking as the config says."""
    return TurnFormat(tokenizer, turn_style(config, suite))


def turn_style(config: TrainConfig, suite: TaskSuite) -> TurnStyle:
    return TurnStyle(suite.instructions, config.thinking)


def new_predictor(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> SharedPredictor:
    """The run's success predictor before its first fit."""
    return SharedPredictor(
        PredictorConfig(
            turn_token=TurnFormat(tokenizer).end_of_turn_id, featurizer=config.predictor
        ),
        generator=torch.Generator().manual_seed(config.seed),
        tokenizer=tokenizer,
    )


def roll_out(
    checkpoint: str | Path,
    tasks: Sequence[Task],
    suite: TaskSuite,
    predictor: SharedPredictor,
    config: TrainConfig,
    iteration: int,
    draws: IterationDraws,
    run_id: str,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    address: str | None = None,
    session: EngineSession | None = None,
    progress: Callable[[float], None] | None = None,
    engine_name: str = "",
    policy_version: int | None = None,
) -> RolloutResult:
    """Iteration ``iteration``'s budgeted trees over the pool ``draws`` picks from ``tasks``,
    with the policy at ``checkpoint`` (or already in memory) on ``config.engine``, or on the
    run's kept engine (``session``, or the kept actors of ``engine_name``); ``progress(units
    spent)`` after every engine call. ``policy_version``: the iteration whose update made the
    policy (0: the start), stamped on the trees; default the iteration before (synchronous)."""
    grow = GrowConfig(
        config.strategy,
        Budget(config.budget, config.continuations, config.group),
        SamplingParams(max_tokens=config.max_tokens),  # temperature 1, no top-p
        seed=draws.grow_seed,
        run_id=run_id,
        iteration=iteration,
        policy_version=iteration - 1 if policy_version is None else policy_version,
    )
    pool = [tasks[j] for j in draws.pool]
    return run_rollout(
        checkpoint, pool, suite.make_env, predictor, grow, config.engine, address, model,
        tokenizer, progress, style=turn_style(config, suite), session=session,
        engine_name=engine_name,
    )  # fmt: skip


def fit_predictor(
    predictor: SharedPredictor, trees: Sequence[RolloutTree], draws: IterationDraws
) -> FitReport:
    return predictor.fit(trees, torch.Generator().manual_seed(draws.fit_seed))


def update(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    trees: Sequence[RolloutTree],
    config: TrainConfig,
    draws: IterationDraws,
    pad_id: int,
    reference: PreTrainedModel | None,
    serving: torch.dtype | None = None,
) -> UpdateStats:
    """One policy update on this iteration's trees, in this process (``serving``: the dtype
    the engines hold the policy in, ``update_policy``'s)."""
    return update_policy(
        model,
        optimizer,
        trees,
        config.objective(),
        np.random.default_rng(draws.update_seed),
        pad_id,
        reference,
        serving=serving,
    )


def evaluate(
    checkpoint: str | Path,
    fmt: TurnFormat,
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    config: TrainConfig,
    model: PreTrainedModel | None = None,
    session: EngineSession | None = None,
    address: str | None = None,
    stage: Callable[[str], None] | None = None,
    engine_name: str = "",
) -> EvalReport:
    """Held-out pass@1 and mean@k of the policy at ``checkpoint`` (or already in memory:
    ``model``) on ``tasks``, on the run's engine: its kept one (``session``: the rollout's actors
    or vLLM, which then need not reload for the next rollout), else one opened for it as
    ``config.engine`` says (in this process, or actors at ``address``: the run's kept ones with
    ``engine_name``)."""
    engine = (
        session.engine(checkpoint, model)
        if session is not None
        else open_engine(config.engine, checkpoint, model, address, engine_name)
    )
    with engine as played:
        return evaluate_policy(
            played,
            fmt,
            make_env,
            tasks,
            k=config.eval_k,
            seed=config.seed,
            max_tokens=config.max_tokens,
            stage=stage,
        )


def eval_tasks(suite: TaskSuite, config: TrainConfig) -> list[Task]:
    return list(suite.tasks("eval")[: config.eval_tasks])


def held_out_root_skill(
    predictor: SharedPredictor, fmt: TurnFormat, tasks: Sequence[Task], report: EvalReport
) -> float:
    """The predictor's Brier skill at ranking the held-out prompts ``tasks`` (which no tree
    holds) against their sampled outcomes in ``report`` (k per task): 1 − its Brier score over
    the best constant's (the outcomes' own mean). NaN without sampled outcomes of both kinds."""
    sampled = (report.per_task or {}).get("mean_k")
    if not sampled or report.task_ids != tuple(t.id for t in tasks):
        return float("nan")
    successes = np.asarray(sampled) * report.k
    failures = report.k - successes
    p = predictor.predict_roots([fmt.prompt_ids(task.prompt) for task in tasks])
    rate = float(successes.sum() / (successes.sum() + failures.sum()))
    constant = brier_score(np.full(len(p), rate), successes, failures)
    if not constant > 0:
        return float("nan")
    return 1.0 - brier_score(p, successes, failures) / constant
