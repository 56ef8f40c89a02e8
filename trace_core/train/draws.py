"""What a training iteration draws at random, from a generator seeded by (seed, iteration), in
one fixed order: the prompt pool, then the rollout, predictor and update seeds. A step that runs
on its own, in another process or on another machine, draws what the local loop would have.

    draws = draw_iteration(seed=0, iteration=3, tasks=5000, pool_size=512)

Importable without torch: the pipeline's folder contract reads and writes them (``draws.json``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class IterationDraws:
    """What iteration i draws at random, in the order it draws it."""

    pool: tuple[int, ...]
    """Indices into the train tasks of this iteration's candidate prompts."""
    grow_seed: int
    fit_seed: int
    update_seed: int


def draw_iteration(seed: int, iteration: int, tasks: int, pool_size: int) -> IterationDraws:
    """The draws of ``iteration`` over ``tasks`` train tasks (module docstring)."""
    if tasks < 1:
        raise ValueError("no train tasks to draw a prompt pool from")
    rng = np.random.default_rng([seed, iteration])
    pool = tuple(int(j) for j in rng.permutation(tasks)[:pool_size])
    grow_seed, fit_seed, update_seed = (int(rng.integers(2**31)) for _ in range(3))
    return IterationDraws(pool, grow_seed, fit_seed, update_seed)
