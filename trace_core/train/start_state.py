"""Where resident trainers load their state from (``train.trainer_group``, ``train.weights``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StartState:
    """Where the trainers load from: a policy folder (or ``s3://`` prefix), and the files of
    the checkpoint it came with, if any (None: a fresh optimizer, no reference)."""

    policy: str
    optimizer: str | None = None
    master: str | None = None
    """The folder holding ``master.safetensors`` (None: the policy's weights are the master)."""
    reference: str | None = None
