"""A run's figures as TensorBoard reads them: event files beside the run's log.

    write_tensorboard(folder, records)    # folder/tensorboard/, from the whole log

``trace-rl train`` writes them into its run folder after every iteration, the pipeline's steps
into each state folder beside its ``log.jsonl``; ``tensorboard --logdir FOLDER`` shows them, side
by side with a team's other runs. The files are written from the log each time, so a resumed
run's curves continue its earlier iterations', and they are replaced whole (a new folder, then a
rename), never left half-written.

Each iteration is one step (``global_step`` = iteration; 0 is the starting policy's
evaluation). The tags (``figures``): ``eval/`` held-out accuracy and parse rate, ``rollout/``
effective ratios, mixed groups, units and tokens, ``update/`` loss, KL, logprob gap, gradient
norm and clip fraction, ``predictor/`` its skills and fit, ``seconds/`` each phase's wall time.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from trace_core.train.record import IterationRecord

TENSORBOARD = "tensorboard"
"""The event files' folder, inside the folder that holds ``log.jsonl``."""

ROLLOUT = (
    "prompt_effective_ratio",
    "anchor_effective_ratio",
    "mixed_groups",
    "mixed_per_100_units",
    "units",
    "contrast_pairs",
)
UPDATE = ("loss", "kl", "logprob_gap", "logprob_gap_max", "grad_norm", "clip_fraction", "paths")
PREDICTOR = ("root_skill", "prefix_skill", "eval_root_skill", "loss_after", "rows")


def figures(record: IterationRecord) -> dict[str, float]:
    """The iteration's figures by TensorBoard tag (absent or non-finite ones left out)."""
    out: dict[str, float] = {}
    if record.eval:
        report = record.eval
        out["eval/pass1"] = _all(report.get("pass1"))
        out[f"eval/mean_at_{report.get('k', 'k')}"] = _all(report.get("mean_k"))
        out["eval/parse_rate"] = _number(report.get("parse_rate"))
    if record.iteration > 0:
        out["rollout/tokens"] = float(record.tokens)
        out["rollout/total_tokens"] = float(record.total_tokens)
    out |= _picked("rollout", record.rollout, ROLLOUT)
    out |= _picked("update", record.update, UPDATE)
    out |= _picked("predictor", record.predictor, PREDICTOR)
    out |= {f"seconds/{phase}": float(s) for phase, s in record.seconds.items()}
    return {tag: value for tag, value in out.items() if math.isfinite(value)}


def write_tensorboard(folder: Path, records: Sequence[IterationRecord]) -> Path:
    """Write ``records`` as ``folder/tensorboard/``'s one event file; returns that folder."""
    from tensorboardX import SummaryWriter

    target = folder / TENSORBOARD
    fresh = Path(tempfile.mkdtemp(prefix=f".{TENSORBOARD}.", dir=folder))
    try:
        with SummaryWriter(logdir=str(fresh)) as writer:
            for record in records:
                for tag, value in figures(record).items():
                    writer.add_scalar(tag, value, global_step=record.iteration)
        if target.exists():
            shutil.rmtree(target)
        fresh.rename(target)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return target


def _picked(prefix: str, values: Mapping[str, object], keys: Sequence[str]) -> dict[str, float]:
    return {f"{prefix}/{k}": _number(values[k]) for k in keys if k in values}


def _all(values: object) -> float:
    return _number(values.get("all")) if isinstance(values, Mapping) else math.nan


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
