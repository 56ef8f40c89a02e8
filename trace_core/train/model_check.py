"""``trace-rl model check``: what to know about a model before paying for a GPU cluster.

    trace-rl model check models/smollm2 --task calc --json check.json

* ``template_exact``: the turn layout built piece by piece (``policy.format``) equals the chat
  template's own encoding of the task's reference conversations at every generation point;
* the stop ids (the template's end-of-turn token, then EOS);
* ``action_parse_rate``: the share of sampled first turns (temperature 1) that end in an
  action the task's parser reads (``envs.base.parse_action``);
* ``logprob_gap``: the largest |engine sampling logprob − trainer recomputation| over the
  tokens of the first 16 samples (``TorchEngine`` against the update's ``TokenScorer``): it
  must be ~0 for the update's importance ratios to mean anything;
* parameter count, dtype, and the update memory estimate (``policy.memory``) at the micro-batch
  size asked for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from trace_core.envs.base import TaskSuite, parse_action, replay
from trace_core.policy.decoder import ARCHITECTURES
from trace_core.policy.engine import Engine, SamplingParams
from trace_core.policy.format import TurnFormat, TurnStyle, is_word_tokenizer
from trace_core.policy.memory import ModelShape, estimate_update
from trace_core.policy.model import load_checkpoint
from trace_core.policy.update import TokenScorer

CONVERSATIONS = 16
"""Reference conversations the template check renders."""
GAP_SAMPLES = 16
"""Samples whose logprobs the trainer recomputes (each is a full forward pass of its prompt)."""


@dataclass(frozen=True)
class ModelCheck:
    model: str
    architecture: str
    parameters: int
    dtype: str
    template: str
    """``model`` (the tokenizer's own chat template) or ``word`` (the project's)."""
    template_exact: bool
    template_mismatch: str | None
    """Where the first inexact conversation departs (None when exact)."""
    conversations: int
    stop_ids: list[int]
    stop_tokens: list[str]
    observation_role: str
    engine: str
    samples: int
    action_parse_rate: float
    truncated_rate: float
    """Share of samples cut by ``max_tokens`` before their end-of-turn token."""
    logprob_gap: float
    """Largest |engine − trainer| logprob over the tokens of the first ``GAP_SAMPLES``."""
    memory_gib: dict[str, float]
    """``policy.memory`` estimate of one update at ``micro_tokens`` on ``memory_device``."""
    micro_tokens: int
    memory_device: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def check_model(
    path: str | Path,
    suite: TaskSuite,
    samples: int = 64,
    max_tokens: int = 256,
    seed: int = 0,
    micro_tokens: int = 8192,
    thinking: bool = False,
) -> ModelCheck:
    if samples < 1 or max_tokens < 1:
        raise ValueError(f"samples and max_tokens must be >= 1, got {samples} and {max_tokens}")
    model, tokenizer = load_checkpoint(path)
    fmt = TurnFormat(tokenizer, TurnStyle(suite.instructions, thinking))
    mismatch, conversations = _template_mismatch(fmt, suite)

    engine, engine_name = _engine(model)
    pool = suite.tasks("train")
    rng = np.random.default_rng(seed)
    picked = [pool[i] for i in rng.integers(0, len(pool), size=samples)]
    prompts = [fmt.prompt_ids(task.prompt) for task in picked]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=fmt.stop_ids)
    completions = [group[0] for group in engine.generate(prompts, params, seed=seed)]
    parsed = [parse_action(fmt.decode_action(c.token_ids)) is not None for c in completions]
    gap = _logprob_gap(model, prompts[:GAP_SAMPLES], completions[:GAP_SAMPLES])

    shape = ModelShape.from_config(model.config)
    return ModelCheck(
        model=str(path),
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        template="word" if is_word_tokenizer(tokenizer) else "model",
        template_exact=mismatch is None,
        template_mismatch=mismatch,
        conversations=conversations,
        stop_ids=list(fmt.stop_ids),
        stop_tokens=[str(tokenizer.convert_ids_to_tokens(i)) for i in fmt.stop_ids],
        observation_role=fmt.observation_role,
        engine=engine_name,
        samples=samples,
        action_parse_rate=float(np.mean(parsed)),
        truncated_rate=float(np.mean([not c.finished for c in completions])),
        logprob_gap=gap,
        memory_gib=estimate_update(shape, micro_tokens, checkpointing=True).to_json(),
        micro_tokens=micro_tokens,
        memory_device="cuda",
    )


def _template_mismatch(fmt: TurnFormat, suite: TaskSuite) -> tuple[str | None, int]:
    env, count = suite.make_env(), 0
    for task in suite.tasks("train"):
        if not task.reference:
            continue
        observations, _ = replay(env, task, task.reference)
        turns = list(task.reference[: len(observations) - 1])
        mismatch = fmt.template_mismatch(task.prompt, turns, observations[1:-1])
        count += 1
        if mismatch is not None:
            return f"task {task.id}: {mismatch}", count
        if count == CONVERSATIONS:
            break
    return None, count


def _engine(model: torch.nn.Module) -> tuple[Engine, str]:
    """The torch engine for the architectures it runs, HF generate for the rest."""
    if model.config.model_type in ARCHITECTURES:
        from trace_core.policy.torch_engine import TorchEngine

        return TorchEngine(model, cache_tokens=16_384), "torch"  # type: ignore[arg-type]
    from trace_core.policy.hf_engine import HFGenerateEngine

    return HFGenerateEngine(model), "hf"  # type: ignore[arg-type]


def _logprob_gap(model, prompts, completions) -> float:  # type: ignore[no-untyped-def]
    scorer = TokenScorer(model)
    worst = 0.0
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([[*prompt, *completion.token_ids.tolist()]])
            mask = torch.zeros((1, ids.shape[1] - 1), dtype=torch.bool)
            mask[0, len(prompt) - 1 :] = True
            recomputed = scorer(ids, torch.ones_like(ids), mask)
            sampled = torch.from_numpy(completion.logprobs)
            worst = max(worst, float((recomputed - sampled).abs().max()))
    return worst
