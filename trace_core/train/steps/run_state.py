"""What a session step hands the next: ``state.json`` (``RunState``), the run's log, its
predictor and tokenizer in one folder (``trace_core.train.steps.session``); and where a session
starts (``StartPoint``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trace_core.train.record import LOG, IterationRecord, read_log
from trace_core.train.steps.commit import write_log
from trace_core.train.steps.handoff import STATE
from trace_core.train.tracking import write_tensorboard

KIND = "trace.run-state"


@dataclass(frozen=True)
class StartPoint:
    """Where a session starts: the warm start's or load step's folders (paths or URIs); the
    policy's ``log.jsonl``, if any, is the log a resumed run goes on from."""

    policy: str
    predictor: str
    optimizer: str | None = None
    """A folder holding ``optimizer.safetensors`` (and ``master.safetensors``), if any."""
    iteration: int = 0


@dataclass(frozen=True)
class RunState:
    """``state.json``: see the module docstring."""

    iteration: int
    checkpoint: int
    """The newest checkpoint's iteration; its files are ``policy``, ``optimizer``, ``master``."""
    policy: str
    optimizer: str | None
    master: str | None
    reference: str | None
    """The starting policy (the KL anchor), when ``kl_coef`` > 0."""
    serving: str
    """The sync label the engines hold."""
    session: str
    """The actors' name: engines ``<session>-<i>``, trainers ``<session>-trainer-<rank>``."""
    pending: int | None = None
    """A checkpoint the trainers are writing in the background (its iteration): the next step
    commits it once written."""
    pending_folder: str | None = None
    """The registry folder reserved for it."""
    mlflow_run: str | None = None
    """The run's MLflow run id, when it logs to MLflow (``steps.tracked``)."""
    last: int | None = None
    """The run's last iteration: its start's and ``iterations`` more (a resumed run's count
    goes on from its checkpoint's); it is checkpointed and evaluated whatever the schedule.
    None (a state written before it was kept): ``iterations`` itself."""

    def to_json(self) -> str:
        return json.dumps({"kind": KIND, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> RunState:
        try:
            body = json.loads(text)
            if body.pop("kind") != KIND:
                raise ValueError(f"kind is not {KIND!r}")
            return cls(**body)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: not a run state ({err})") from None


def write_state(
    folder: Path,
    state: RunState,
    records: Sequence[IterationRecord],
    predictor: Any,
    tokenizer: Any,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE).write_text(state.to_json())
    write_log(folder / LOG, records)
    write_tensorboard(folder, records)
    predictor.save(folder / "predictor")
    tokenizer.save_pretrained(folder / "tokenizer")


def read_state(folder: Path) -> tuple[RunState, list[IterationRecord]]:
    path = folder / STATE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; pass the state output of the previous step")
    return RunState.from_json(path.read_text(), str(path)), read_log(folder)
