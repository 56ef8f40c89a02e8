"""A simulated multi-turn task whose true success probability is known at every prefix.

Each prompt has a difficulty p ~ Beta(a, b), its true V at the root. A rollout runs T turns,
T uniform in [lo, hi]; after every turn the true value moves as a martingale,

    V_{t+1} ~ Beta(κ V_t, κ (1 − V_t)),    E[V_{t+1} | V_t] = V_t,

and the episode's reward is Bernoulli(V_T). So V_t = E[r | H_t] exactly, as in the paper's
definition, and a continuation from a prefix simply restarts the walk from that prefix's V.
κ sets how much one turn decides: E[V(1−V)] shrinks by κ/(κ+1) per turn.

Nobody but ``oracle`` may read V. Predictors read a *feature* of every node, the true logit plus
Gaussian noise, drawn once per node (the text of a prompt or turn does not change when it is
looked at again). Tokens are simulated too: lengths uniform in a range, ids uniform over a small
vocabulary, logprobs those of a uniform sampler, so token counts in reports mean something.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

VOCAB = 512
_LOGIT_CLIP = 1e-6


def parse_beta(text: str) -> tuple[float, float]:
    """``"beta:0.4,0.4"`` -> (0.4, 0.4)."""
    number = r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    match = re.fullmatch(rf"\s*beta:\s*{number}\s*,\s*{number}\s*", text, flags=re.ASCII)
    if not match:
        raise ValueError(f"difficulty must look like 'beta:a,b' (e.g. beta:0.4,0.4), got {text!r}")
    a, b = float(match.group(1)), float(match.group(2))
    if not (0 < a < math.inf and 0 < b < math.inf):
        raise ValueError(f"difficulty beta:{a},{b}: both parameters must be > 0 and finite")
    return a, b


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"2,6"`` -> (2, 6)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*,\s*([0-9]+)\s*", text, flags=re.ASCII)
    if not match:
        raise ValueError(f"{name} must look like 'lo,hi' with integers, got {text!r}")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class SimConfig:
    difficulty: tuple[float, float] = (0.4, 0.4)
    """Beta(a, b) of the prompts' true success probability."""
    turns: tuple[int, int] = (2, 6)
    """Turns per episode, uniform in [lo, hi]."""
    concentration: float = 4.0
    """κ of the martingale step; smaller means each turn moves V more."""
    feature_noise: float = 1.0
    """Std of the Gaussian noise on the logit feature predictors see."""
    gen_tokens: tuple[int, int] = (16, 128)
    """Generated tokens per turn, uniform in [lo, hi]."""
    obs_tokens: tuple[int, int] = (8, 64)
    """Observation tokens per turn, uniform in [lo, hi]."""

    def __post_init__(self) -> None:
        if not all(0 < x < math.inf for x in self.difficulty):
            raise ValueError(f"difficulty parameters must be > 0 and finite, got {self.difficulty}")
        lo, hi = self.turns
        if not 1 <= lo <= hi:
            raise ValueError(f"turns must satisfy 1 <= lo <= hi, got {lo},{hi}")
        if hi < 2:
            raise ValueError("turns hi must be >= 2 so that rollouts have prefixes to branch from")
        if not 0 < self.concentration < math.inf:
            raise ValueError(f"concentration must be > 0 and finite, got {self.concentration}")
        if not 0 <= self.feature_noise < math.inf:
            raise ValueError(f"feature_noise must be >= 0 and finite, got {self.feature_noise}")
        for name in ("gen_tokens", "obs_tokens"):
            a, b = getattr(self, name)
            if not 0 <= a <= b:
                raise ValueError(f"{name} must satisfy 0 <= lo <= hi, got {a},{b}")


@dataclass(frozen=True)
class Pool:
    """A batch of candidate prompts."""

    value: FloatArray  # (B,) true V at the root, hidden from predictors
    feature: FloatArray  # (B,) noisy logit of value


def logit(p: npt.ArrayLike) -> FloatArray:
    q = np.clip(np.asarray(p, dtype=np.float64), _LOGIT_CLIP, 1.0 - _LOGIT_CLIP)
    return np.asarray(np.log(q) - np.log1p(-q))


def draw_pool(config: SimConfig, size: int, rng: np.random.Generator) -> Pool:
    value = rng.beta(*config.difficulty, size=size)
    return Pool(value, logit(value) + config.feature_noise * rng.standard_normal(size))


@dataclass
class SimTree:
    """A tree being grown, with the simulator's hidden per-node state beside it."""

    config: SimConfig
    builder: TreeBuilder
    true_v: list[float]
    feature: list[float]
    depth: list[int]
    prefixes: list[int] = field(default_factory=list)  # non-terminal nodes of root rollouts
    prefix_reward: list[float] = field(default_factory=list)  # their rollout's reward

    @classmethod
    def start(
        cls,
        config: SimConfig,
        info: TreeInfo,
        value: float,
        feature: float,
        rng: np.random.Generator,
    ) -> SimTree:
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(16, 65)), dtype=np.int32)
        builder = TreeBuilder(info, prompt_tokens=prompt, prompt_text=f"{info.prompt_id}")
        return cls(config, builder, [value], [feature], [0])

    def rollout(self, parent: int, rng: np.random.Generator, *, branch: bool = False) -> float:
        """Sample turns from ``parent`` to the end of an episode; return the reward."""
        lo, hi = self.config.turns
        start = self.depth[parent]
        end = int(rng.integers(max(lo, start + 1), hi + 1))
        kappa = self.config.concentration
        v = self.true_v[parent]
        node = parent
        visited = []
        for t in range(start + 1, end + 1):
            if 0.0 < v < 1.0:
                v = float(rng.beta(kappa * v, kappa * (1.0 - v)))
            n_gen = int(rng.integers(self.config.gen_tokens[0], self.config.gen_tokens[1] + 1))
            n_obs = int(rng.integers(self.config.obs_tokens[0], self.config.obs_tokens[1] + 1))
            node = self.builder.add_turn(
                node,
                gen_tokens=rng.integers(0, VOCAB, size=n_gen, dtype=np.int32),
                obs_tokens=rng.integers(0, VOCAB, size=n_obs, dtype=np.int32),
                logprobs=np.full(n_gen, -np.log(VOCAB), dtype=np.float32),
                text=f"turn {t}",
                observation=f"observation {t}",
                branch=branch and t == start + 1,
            )
            self.true_v.append(v)
            noise = self.config.feature_noise * float(rng.standard_normal())
            self.feature.append(float(logit(v)) + noise)
            self.depth.append(t)
            visited.append(node)
        reward = float(rng.random() < v)
        self.builder.set_reward(node, reward)
        if parent == 0:
            self.prefixes.extend(visited[:-1])
            self.prefix_reward.extend([reward] * (len(visited) - 1))
        return reward

    def build(self) -> RolloutTree:
        return self.builder.build()
