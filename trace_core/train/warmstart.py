"""Warm start: supervised training of the tiny policy on a synthetic task's scripted demonstrations.

RL needs a policy that sometimes succeeds: a randomly initialised tiny model never does. The
suite's demonstrations solve each problem step by step, with slips whose rate grows with the
difficulty (``mistake_rate_for``); imitating them gives a policy that is right on easy
problems, wrong on hard ones, and mixed in between — the spread TRACE's allocation is for.

    trace-rl warmstart --task calc --output build/policy/calc

writes an HF checkpoint directory (config.json, model.safetensors, tokenizer) and prints the
eval success rate per difficulty, sampled with ``TorchEngine`` through the real env.

A pretrained model warm-starts the same way from ``--init`` (``WarmstartConfig.init``): its
turns rendered with its own chat template and the task's action grammar as the system prompt,
the demonstrations without slips (the task's reference solutions), a short SFT with the
update's memory controls (``PRETRAINED_SFT``), and the action parse rate and held-out success
reported before and after, so a weak model such as SmolLM2 learns the grammar before RL.

    trace-rl warmstart --init build/models/smollm2 --task calc --output build/policy/smollm2-calc
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from trace_core.envs.base import DemoSuite, Task, replay
from trace_core.envs.calc import CalcMixSuite, CalcSuite
from trace_core.envs.multihop import MultihopSuite
from trace_core.envs.suites import SYNTHETIC
from trace_core.policy.engine import SamplingParams
from trace_core.policy.format import TurnFormat, TurnStyle
from trace_core.policy.model import (
    TinyPolicyConfig,
    create_policy,
    load_for_training,
    save_checkpoint,
)
from trace_core.policy.sft import SFTConfig, sft_train
from trace_core.policy.tokenizer import build_word_tokenizer, padding_id
from trace_core.policy.torch_engine import TorchEngine
from trace_core.rollout.flat import rollout_flat
from trace_core.rollout.weights import SOURCE
from trace_core.train.config import PRETRAINED
from trace_core.train.evaluate import parse_rate


def synthetic_suite(name: str, seed: int = 0) -> DemoSuite:
    """The built-in tasks that come with scripted demonstrations."""
    match name:
        case "calc":
            return CalcSuite(seed=seed)
        case "calc-mix":
            return CalcMixSuite(seed=seed)
        case "multihop":
            return MultihopSuite(seed=seed)
    raise ValueError(f"warm start needs a synthetic task ({', '.join(SYNTHETIC)}), got {name!r}")


PRETRAINED_SFT = SFTConfig(
    steps=int(PRETRAINED["warmstart_steps"]), batch_size=8, lr=1e-4, warmup=5, micro_tokens=2048
)
"""The SFT of a pretrained ``init``: a few steps at a fine-tuning rate, enough to teach the
action grammar (not the task), in passes of 2,048 tokens. Not tuned yet."""


@dataclass(frozen=True)
class WarmstartConfig:
    task: str = "calc"
    """Synthetic task suite: calc or multihop."""
    output: Path = Path("build/policy/calc")
    """Checkpoint directory to write."""
    seed: int = 0
    demos: int = 6000
    """Demonstration episodes to imitate (drawn from the train split, with slips)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    policy: TinyPolicyConfig = field(default_factory=TinyPolicyConfig)
    eval_samples: int = 4
    """Sampled episodes per eval task for the success report."""
    eval_tasks: int = 200
    """Eval tasks to report on (at most the eval split)."""
    init: Path | None = None
    """A pretrained HF directory to fine-tune (None: a fresh tiny policy)."""
    max_tokens: int = 48
    """Generated tokens per turn in the success report."""

    def __post_init__(self) -> None:
        synthetic_suite(self.task)  # validates the name
        if self.demos < 1 or self.eval_samples < 1 or self.eval_tasks < 1:
            raise ValueError("demos, eval_samples and eval_tasks must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class WarmstartReport:
    task: str
    checkpoint: str
    steps: int
    final_loss: float
    train_seconds: float
    demo_success: dict[str, float]
    """Success rate of the demonstrations themselves, per difficulty."""
    success: dict[str, float]
    """Eval success of the trained policy (sampled at temperature 1), per difficulty."""
    success_all: float = float("nan")
    """Eval success over every sampled episode."""
    parse_rate: float = float("nan")
    """Share of the eval episodes' turns that end in a parsable action."""
    success_all_before: float | None = None
    """``success_all`` of the ``init`` model before the SFT (None for a fresh tiny policy)."""
    parse_rate_before: float | None = None


def demonstration_sequences(
    suite: DemoSuite,
    tasks: Sequence[Task],
    fmt: TurnFormat,
    rng: np.random.Generator,
    slips: bool = True,
) -> tuple[list[npt.NDArray[np.int32]], list[npt.NDArray[np.bool_]], dict[str, float]]:
    """Token sequences of demonstration episodes, their loss masks, and demo success rates.

    Each demo is played through the real env, so the observations (and the reward) are what
    the env says, slips included. Only the agent's turns are learned.
    """
    sequences, masks = [], []
    outcomes: dict[str, list[float]] = defaultdict(list)
    env = suite.make_env()
    for task in tasks:
        actions = suite.demonstration(task, rng, suite.mistake_rate_for(task) if slips else 0.0)
        observations, last = replay(env, task, actions)
        ids, learn = list(fmt.prompt_ids(task.prompt)), [False] * len(fmt.prompt_ids(task.prompt))
        played = len(observations) - 1
        for turn, action in enumerate(actions[:played]):
            action_ids = fmt.action_ids(action)
            ids += action_ids
            learn += [True] * len(action_ids)
            if turn + 1 < played:
                obs_ids = fmt.observation_ids(observations[turn + 1])
                ids += obs_ids
                learn += [False] * len(obs_ids)
        sequences.append(np.asarray(ids, dtype=np.int32))
        masks.append(np.asarray(learn, dtype=bool))
        outcomes[task.difficulty].append(last.reward if last and last.done else 0.0)
    return sequences, masks, {k: float(np.mean(v)) for k, v in sorted(outcomes.items())}


def success_by_difficulty(
    engine: TorchEngine,
    fmt: TurnFormat,
    suite: DemoSuite,
    tasks: Sequence[Task],
    samples: int,
    seed: int,
    max_tokens: int = 48,
) -> dict[str, float]:
    """Mean reward per difficulty of ``samples`` sampled episodes per task."""
    return sampled_success(engine, fmt, suite, tasks, samples, seed, max_tokens).by_difficulty


@dataclass(frozen=True)
class SampledSuccess:
    by_difficulty: dict[str, float]
    overall: float
    """Mean reward over every sampled episode."""
    parse_rate: float
    """Share of their turns that end in an action the parser reads."""


def sampled_success(
    engine: TorchEngine,
    fmt: TurnFormat,
    suite: DemoSuite,
    tasks: Sequence[Task],
    samples: int,
    seed: int,
    max_tokens: int,
) -> SampledSuccess:
    """Mean reward per difficulty of sampled episodes, and their turns' action parse rate."""
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens)
    trees = rollout_flat(engine, fmt, suite.make_env, tasks, params, seed)
    outcomes: dict[str, list[float]] = defaultdict(list)
    for task, tree in zip(tasks, trees, strict=True):
        outcomes[task.difficulty].extend(tree.reward[tree.leaf_mask].tolist())
    rewards = [r for tree in trees for r in tree.reward[tree.leaf_mask].tolist()]
    return SampledSuccess(
        {k: float(np.mean(v)) for k, v in sorted(outcomes.items())},
        float(np.mean(rewards)),
        parse_rate(trees),
    )


RECORD = "warmstart.json"
"""What made a warm start (``warmstart_record``) and its report, written into its folder last:
a folder with it holds a complete warm start."""

RECORD_FORMAT = "trace.warmstart/1"


class WarmstartMismatch(ValueError):
    """A folder that holds something other than the warm start asked for; the message names the
    folder and the difference."""


def warmstart_record(config: WarmstartConfig) -> dict[str, object]:
    """Everything that decides a warm start's weights: task, seed, demonstrations, the SFT, the
    tiny policy's shape (a fresh one) or the model it starts from (``init``: its folder, or the
    URI it was downloaded from). The evaluation's settings change only the report."""
    return {
        "format": RECORD_FORMAT,
        "task": config.task,
        "seed": config.seed,
        "demos": config.demos,
        "sft": asdict(config.sft),
        "policy": asdict(config.policy) if config.init is None else None,
        "init": _init_identity(config.init),
    }


def _init_identity(init: Path | None) -> str | None:
    if init is None:
        return None
    downloaded = init / SOURCE  # fetch_model's note of the URI the folder holds
    return downloaded.read_text().strip() if downloaded.is_file() else str(init.resolve())


def stored_warmstart(folder: Path, config: WarmstartConfig, purpose: str) -> WarmstartReport | None:
    """The report of the warm start stored in ``folder`` when it is the one ``config`` would
    make (reuse it); None when ``folder`` holds nothing yet (make it). Anything else raises
    ``WarmstartMismatch`` naming the difference, ``purpose`` (what needs it) and the way out:
    a stored warm start is never rebuilt over, nor reused for another task or recipe."""
    record = folder / RECORD
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return None
    if not record.is_file():
        raise WarmstartMismatch(
            f"{folder} holds files but no {RECORD} saying what made them (a warm start written "
            f"before warm starts recorded it, or an unfinished one): {purpose} cannot tell "
            f"whether it fits; remove {folder}, or use another output folder"
        )
    try:
        stored = json.loads(record.read_text())
        wanted = warmstart_record(config)
        made, report = {k: stored[k] for k in wanted}, WarmstartReport(**stored["report"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise WarmstartMismatch(f"{record}: not a warm start record ({err})") from None
    differences = _differences(made, wanted)
    if differences:
        held = ", ".join(f"{key} {old}" for key, old, _ in differences)
        needed = ", ".join(f"{key} {new}" for key, _, new in differences)
        raise WarmstartMismatch(
            f"{folder} holds the warm start made with {held}; {purpose} needs {needed}: "
            f"use another output folder, or remove {folder}"
        )
    return report


def _differences(
    stored: Mapping[str, object], wanted: Mapping[str, object], prefix: str = ""
) -> list[tuple[str, object, object]]:
    """(dotted key, stored, wanted) for every leaf that differs."""
    found = []
    for key in wanted:
        old, new = stored.get(key), wanted[key]
        if isinstance(old, dict) and isinstance(new, dict):
            found += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append((f"{prefix}{key}", old, new))
    return found


def warmstart(
    config: WarmstartConfig,
    progress: Callable[[int, float], None] | None = None,
    stage: Callable[[str], None] | None = None,
) -> WarmstartReport:
    """SFT on the task's demonstrations (``progress(step, loss)`` after each step), then the
    held-out evaluation (``stage(what)`` before each evaluation). ``config.output`` must not
    hold anything yet (``stored_warmstart`` says whether what it holds can be reused); the
    record that says what made it (``RECORD``) is written last."""
    target = config.output
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise WarmstartMismatch(
            f"{target} is not empty: a warm start is written into a folder of its own"
        )
    # Built beside the target and renamed into place whole: an interrupted warm start leaves
    # only its scratch folder, which the next one into the same target starts over.
    scratch = target.with_name(f".{target.name}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    say = stage or (lambda _what: None)
    suite = synthetic_suite(config.task, config.seed)
    eval_tasks = suite.tasks("eval")[: config.eval_tasks]
    before: SampledSuccess | None = None
    if config.init is None:
        tokenizer = build_word_tokenizer(suite.vocabulary())
        fmt = TurnFormat(tokenizer)
    else:
        model, tokenizer, serving = load_for_training(config.init)  # fp32 master weights
        fmt = TurnFormat(tokenizer, TurnStyle(suite.instructions))
        say(f"evaluating the base model on {len(eval_tasks)} held-out tasks")
        before = sampled_success(
            TorchEngine(model), fmt, suite, eval_tasks,
            config.eval_samples, config.seed, config.max_tokens,
        )  # fmt: skip
    rng = np.random.default_rng(config.seed)
    train = suite.tasks("train")
    picked = [train[i] for i in rng.integers(0, len(train), size=config.demos)]
    sequences, masks, demo_success = demonstration_sequences(
        suite, picked, fmt, rng, slips=config.init is None
    )
    if config.init is None:
        model = create_policy(tokenizer, config.policy, seed=config.seed)
        serving = torch.float32
    start = time.perf_counter()
    losses = sft_train(model, sequences, masks, config.sft, padding_id(tokenizer), progress)
    seconds = time.perf_counter() - start
    save_checkpoint(model, tokenizer, scratch, dtype=serving)
    engine = TorchEngine(model)
    say(f"evaluating the warm-started policy on {len(eval_tasks)} held-out tasks")
    after = sampled_success(
        engine, fmt, suite, eval_tasks, config.eval_samples, config.seed, config.max_tokens
    )
    report = WarmstartReport(
        task=config.task,
        checkpoint=str(config.output),
        steps=len(losses),
        final_loss=float(np.mean(losses[-20:])),
        train_seconds=seconds,
        demo_success=demo_success,
        success=after.by_difficulty,
        success_all=after.overall,
        parse_rate=after.parse_rate,
        success_all_before=before.overall if before else None,
        parse_rate_before=before.parse_rate if before else None,
    )
    record = {**warmstart_record(config), "report": asdict(report)}
    (scratch / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    os.replace(scratch, target)  # over an empty folder, or none
    return report


def set_threads(threads: int | None) -> None:
    """Torch intra-op threads (None or 0: leave torch's default)."""
    if threads is not None and threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)
