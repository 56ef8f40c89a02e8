"""When a run's session cannot go on from the trainers it finds: they are gone with training
state no checkpoint holds, or (a retried iterate step) they already applied this iteration's
update, which the step's input state does not have yet.

    retried = stop_if_updated(trainers, config, iteration, len(train_tasks))  # or None
    raise SessionLostError(lost_line(config, checkpoint, iteration, policy, retried))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trace_core.train.contract import PipelineConfig
from trace_core.train.draws import draw_iteration


class SessionLostError(RuntimeError):
    """The run's trainers are gone with state no checkpoint holds; the message says how the run
    resumes."""


def already_updated(
    update_seed: int | None, config: PipelineConfig, iteration: int, tasks: int
) -> bool:
    """Whether the trainers' last update (its seed, ``TrainerGroup.update_seed``) is that of
    iteration ``iteration`` (each iteration draws its own from (seed, iteration)): the step
    that runs it is a retry whose first attempt reached the update."""
    if update_seed is None:
        return False
    train = config.train
    return update_seed == draw_iteration(train.seed, iteration, tasks, train.prompts).update_seed


def stop_if_updated(
    trainers: Any,
    config: PipelineConfig,
    iteration: int | None,
    tasks: int,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int | None:
    """``iteration`` when the trainers found (a ``TrainerGroup``, or None) already applied its
    update (``already_updated``): they are stopped, so the update is never applied twice, and
    the step starts them again from the newest checkpoint or stops (``lost_line``); else None."""
    if trainers is None or not iteration:
        return None
    if not already_updated(trainers.update_seed, config, iteration, tasks):
        return None
    say(
        f"iteration {iteration}'s update already reached the run's trainers (this step is a "
        "retry): they are stopped so that it is not applied twice, and the iteration runs again "
        "from the newest checkpoint if that holds the weights before it"
    )
    trainers.close()
    return iteration


def lost_line(
    config: PipelineConfig,
    checkpoint: int,
    iteration: int,
    policy: str,
    retried: int | None = None,
) -> str:
    """Why the session cannot go on, in one line: the state after ``iteration`` whose newest
    checkpoint is ``checkpoint``'s (its policy at ``policy``), and how the run resumes;
    ``retried``: the iteration whose update the trainers applied before this retry."""
    where = f"iteration {checkpoint}'s checkpoint ({policy.rsplit('/policy', 1)[0]})"
    if checkpoint == 0:
        where = f"its start ({policy})"
    how = (
        f"submit the run again with run_name {config.run_name}: it resumes from there"
        if config.run_name
        else "the run has no run_name, so it cannot resume: submit it again with one"
    )
    if retried is not None:
        what = (
            f"iteration {retried}'s update already reached the run's trainers (this step is a "
            f"retry; its first attempt failed after the update), and applying it again would "
            f"train twice on it; the weights before it are not in a checkpoint either (the "
            f"training of iterations {checkpoint + 1}-{iteration} is only on the trainers)"
        )
    else:
        what = (
            f"the run's trainers are gone (the Ray cluster restarted or a trainer actor died) "
            f"with the training state of iterations {checkpoint + 1}-{iteration}"
        )
    return f"{what}; the newest checkpoint is {where}; {how}"
