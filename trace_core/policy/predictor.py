"""The shared success predictor Ṽ_ψ(H_t): one small torch model scoring prompts and prefixes alike.

TRACE asks one predictor for V at the roots (stage 1, which prompts get how many rollouts) and
at the visited prefixes (stage 2, where to branch). ``SharedPredictor`` is that predictor: a
*frozen featurizer* turns a token-id prefix into a vector, and a small MLP head with a sigmoid
output maps it to V ∈ (0, 1). It is refitted after every iteration on the recursive targets
V̂(y) of the new trees (``trace_core.algo.prefix.training_rows``), plus a bounded replay of the
rows of earlier iterations, minimising the leaf-count-weighted squared error

    L = Σ_y n_y (Ṽ_ψ(y) − V̂(y))² / Σ_y n_y.

The featurizer (``trace_core.policy.featurizer``) is ``hashed`` (hashed token n-grams, no model,
any tokenizer) or ``embedding`` (frozen all-MiniLM-L6-v2 over the decoded text); both append
depth and length. Features are computed once per row and kept with the replay buffer.

Prompts get a head of their own (``root_head``): a ridge-penalised logistic model on the same
features, fitted on the root rows alone (new and replayed) by L-BFGS, from the best constant,
at every fit. Stage 1 asks it (``predict_roots``); stage 2 asks the shared MLP. A tree gives
one root row and tens of prefix rows, so in the shared fit the prompts are a few percent of
the loss and the MLP, decayed hard, barely separates them. On calc-mix's first mix (8 of 20 tasks
on a hardest level the policy learned; ``trace-rl compare --task calc-mix --strategies
grpo,trace --seeds 1 --iterations 4``, seed 0) the Brier skill on
each iteration's new prompts was 0.174 (grpo's uniform draws) and −0.005 (trace's) through the
shared MLP, 0.570 and 0.119 through the root head; docs/results.md has five seeds.

    predictor = SharedPredictor(PredictorConfig(turn_token=fmt.end_of_turn_id), generator=g)
    predictor.fit(trees, g)                  # after every iteration; earlier rows are replayed
    v = predictor.predict(prefixes)          # (N,) float64, the rollout ``Predictor`` protocol
    v0 = predictor.predict_roots(prompts)    # stage 1's V, from the prompts' own head
    predictor.save("ckpt/predictor")         # predictor.safetensors + predictor.json,
                                             # root.safetensors, replay.safetensors
    predictor = SharedPredictor.load("ckpt/predictor", tokenizer=tokenizer)

Departures from the paper:
1. Its L_value averages the squared error uniformly over the training nodes S; by default we
   weight each node by its leaf count n_y (a node averaging n_y leaves carries n_y outcomes).
   ``weighting="uniform"`` gives the paper's loss.
2. It calls its predictor lightweight and "vanilla" without saying what it reads; the
   featurizers and the head are ours.
3. The embedding featurizer truncates from the left (keeps the latest turns): on a long history
   the question itself is cut off.
4. The replay buffer (bounded in rows) is ours: the paper trains online on an unstated window.
5. The paper's one predictor scores prompts and prefixes alike; ours gives prompts their own
   head (above).

Not yet validated: the embedding featurizer on real Qwen3 histories (only on the tiny calc
policy's); the MLP on GPUs (it runs on the CPU, which is enough at these sizes).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from trace_core.algo.prefix import TrainingRows, concat_rows, training_rows
from trace_core.algo.shape import PRIOR_WORTH, continuation_worth
from trace_core.algo.tree import RolloutTree
from trace_core.policy.checkpoint import check_safetensors
from trace_core.policy.featurizer import (
    EMBEDDING_MODEL,
    EmbeddingFeaturizer,
    Featurizer,
    HashedNgramFeaturizer,
)
from trace_core.policy.predictor_scores import (
    Forecast,
    weighted_mean,
)

FloatArray = npt.NDArray[np.float64]

FEATURIZERS = ("hashed", "embedding")
WEIGHTINGS = ("leaves", "uniform")
FORMAT_VERSION = 1
WEIGHTS_FILE = "predictor.safetensors"
CONFIG_FILE = "predictor.json"
EARLIER = {WEIGHTS_FILE: "value.safetensors", CONFIG_FILE: "value.json"}
"""Those two files' names in predictors saved before they were renamed: still read."""
REPLAY_FILE = "replay.safetensors"
ROOT_FILE = "root.safetensors"


# --- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PredictorConfig:
    """The predictor's featurizer, head and training; saved as ``predictor.json``."""

    turn_token: int
    """Id that ends every action (``TurnFormat.end_of_turn_id``): its count measures depth."""
    featurizer: str = "hashed"
    """``hashed`` (token n-grams, no model) or ``embedding`` (frozen all-MiniLM-L6-v2)."""
    buckets: int = 1024
    """Hashed: buckets per n-gram block (two blocks: whole history, recent tokens)."""
    ngram: int = 3
    """Hashed: longest n-gram (1 = unigrams only)."""
    recent: int = 32
    """Hashed: the last this many tokens get their own n-gram block (0: no such block)."""
    max_length: int = 256
    """Embedding: encoder tokens kept, counted from the end of the history (MiniLM allows 512)."""
    depth_scale: float = 16.0
    """Turn-token count divided by this is the depth feature."""
    hidden: int = 64
    """Width of the MLP's hidden layer; 0 makes the head logistic regression."""
    epochs: int = 10
    """Passes over new + replayed rows per fit. More overfits a little: on calc trees the
    held-out Brier of unseen prefixes is slightly worse at 20 epochs than at 10."""
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1.0
    """AdamW's decoupled weight decay (shrinks weights by lr·weight_decay per step)."""
    replay_rows: int = 8192
    """Rows of earlier fits kept and trained on again (oldest dropped first); 0: no replay."""
    weighting: str = "leaves"
    """``leaves``: each row weighs its leaf count n_y; ``uniform``: the paper's 1/|S|."""
    root_head: bool = True
    """Prompts (stage 1) get their own logistic head, fitted on root rows alone; off: the
    shared MLP scores them like any prefix, as in the paper."""
    root_l2: float = 1e-4
    """The root head's ridge penalty λ·‖w‖² beside its weighted squared error (rows' weights
    scaled to mean 1). On calc-mix's first mix (``trace-rl compare --task calc-mix --strategies
    grpo,trace --seeds 1 --iterations 4``), grpo's uniformly drawn prompts were forecast with
    root skill 0.46–0.66 at 1e-4 and 0.32–0.47 at 1e-3, and trace's effective ratio was 0.51
    and 0.49."""

    def __post_init__(self) -> None:
        if self.featurizer not in FEATURIZERS:
            raise ValueError(
                f"featurizer must be one of {', '.join(FEATURIZERS)}, got {self.featurizer!r}"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}"
            )
        if self.turn_token < 0:
            raise ValueError(f"turn_token must be a token id >= 0, got {self.turn_token}")
        positive = ("buckets", "ngram", "epochs", "batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("recent", "hidden", "replay_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ngram > 4:
            raise ValueError(f"ngram must be <= 4 (longer n-grams rarely repeat), got {self.ngram}")
        if not 8 <= self.max_length <= 512:
            raise ValueError(
                f"max_length must be in [8, 512] (MiniLM's position limit), got {self.max_length}"
            )
        for name in ("depth_scale", "lr", "root_l2"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay must be >= 0 and finite, got {self.weight_decay}")


def make_featurizer(
    config: PredictorConfig, tokenizer: PreTrainedTokenizerBase | None = None
) -> Featurizer:
    """The one place a featurizer is picked from its name."""
    match config.featurizer:
        case "hashed":
            return HashedNgramFeaturizer(
                config.turn_token, config.buckets, config.ngram, config.recent, config.depth_scale
            )
        case "embedding":
            if tokenizer is None:
                raise ValueError(
                    "featurizer 'embedding' decodes token ids to text: pass the policy's tokenizer"
                )
            return EmbeddingFeaturizer(
                tokenizer,
                config.turn_token,
                max_length=config.max_length,
                depth_scale=config.depth_scale,
            )
    raise ValueError(
        f"featurizer must be one of {', '.join(FEATURIZERS)}, got {config.featurizer!r}"
    )


# --- the predictor -------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitReport:
    """What one ``fit`` trained on and how far the weighted squared error fell."""

    rows: int
    """New rows (this call's trees)."""
    replayed_rows: int
    """Rows of earlier fits trained on again."""
    loss_before: float
    loss_after: float
    """Weighted MSE on all rows trained on, before and after this fit."""
    seconds: float
    root_skill: float = math.nan
    prefix_skill: float = math.nan
    root_auc: float = math.nan
    """Before training on them: Brier skill (1 − Brier ÷ the best constant's) and AUC of the
    predictor as earlier fits left it, on this call's roots (prompts) and deeper prefixes
    that no replayed row holds — what stage 1 and stage 2 ranked this iteration's budget
    with. The constant is the replayed rows' leaf-weighted mean target of the same kind.
    NaN on the first fit (nothing before it) and where a set holds one outcome only."""
    continuation_worth: float = math.nan
    """ω after this fit (``algo.shape``): how often the trees' continuations flipped against a
    fresh root of the predicted prompt V, averaged with the earlier fits'."""


@dataclass
class _Replay:
    rows: TrainingRows
    features: torch.Tensor  # (R, dim): the featurizer is frozen, so these never go stale


def _head(dim: int, hidden: int, generator: torch.Generator) -> nn.Sequential:
    """Linear → GELU → Linear (or one Linear when hidden = 0), initialised from ``generator``.

    The output layer starts at zero, so an unfitted predictor answers σ(0) = 0.5 everywhere,
    exactly as the ``ConstantPredictor`` a strategy sees before any training.
    """
    layers: list[nn.Module] = []
    width = dim
    if hidden:
        # Built on the meta device: nn.Linear's own init would draw from torch's global RNG.
        first = nn.Linear(dim, hidden, device="meta").to_empty(device="cpu")
        nn.init.kaiming_uniform_(first.weight, a=math.sqrt(5), generator=generator)
        bound = 1 / math.sqrt(dim)
        nn.init.uniform_(first.bias, -bound, bound, generator=generator)
        layers += [first, nn.GELU()]
        width = hidden
    last = nn.Linear(width, 1, device="meta").to_empty(device="cpu")
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return nn.Sequential(*layers, last)


def _probabilities(head: nn.Module, x: torch.Tensor) -> FloatArray:
    """σ(head(x)) as float64: (N,) success probabilities of the feature rows ``x``."""
    return torch.sigmoid(head(x).squeeze(-1)).double().numpy()


def _fit_root_head(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, l2: float) -> nn.Linear:
    """σ(w·x + b) on prompts: L-BFGS on the weighted squared error (weights scaled to mean 1)
    plus ``l2``·‖w‖², from w = 0 and σ(b) = the weighted mean target. Deterministic: the same
    rows give the same head."""
    x64, y64 = x.double(), y.double()
    w64 = w.double() / w.double().mean()
    mean = min(max(float((w64 * y64).sum() / w64.sum()), 1e-3), 1 - 1e-3)
    weight = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(math.log(mean / (1 - mean)), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        pred = torch.sigmoid(x64 @ weight + bias)
        loss = (w64 * (pred - y64) ** 2).mean() + l2 * (weight**2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    head = nn.Linear(x.shape[1], 1)
    with torch.no_grad():
        head.weight.copy_(weight.detach()[None].float())
        head.bias.copy_(bias.detach()[None].float())
    return head.eval().requires_grad_(False)


def _weighted_mse(
    pred: torch.Tensor,  # (R,)
    target: torch.Tensor,  # (R,)
    weight: torch.Tensor,  # (R,)
) -> torch.Tensor:
    return (weight * (pred - target) ** 2).sum() / weight.sum()


class SharedPredictor:
    """Ṽ_ψ(prefix) = σ(MLP(φ(prefix))); the rollout layer's ``Predictor`` protocol."""

    def __init__(
        self,
        config: PredictorConfig,
        *,
        generator: torch.Generator,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.config = config
        self.featurizer = make_featurizer(config, tokenizer)
        self.head = _head(self.featurizer.dim, config.hidden, generator)
        self.root: nn.Linear | None = None
        """The prompts' own head (``root_head``); None until a fit has seen a root row."""
        self.fits = 0
        self.continuation_worth = PRIOR_WORTH
        """ω of ``algo.shape`` (``trace-auto`` weighs its shapes with it): the mean of the prior
        and every fit's trees' measured worth, the newest weighing half."""
        self._replay: list[_Replay] = []

    # --- Predictor protocol --------------------------------------------------------------------
    def predict(self, prefixes: Sequence[Sequence[int]]) -> FloatArray:
        """(N,) success probabilities, float64, from the shared head."""
        return self._predict(prefixes, self.head)

    def predict_roots(self, prompts: Sequence[Sequence[int]]) -> FloatArray:
        """(N,) success probabilities of prompts: the root head's once fitted, else ``predict``."""
        return self._predict(prompts, self.root or self.head)

    @torch.no_grad()
    def _predict(self, prefixes: Sequence[Sequence[int]], head: nn.Module) -> FloatArray:
        if not len(prefixes):
            return np.zeros(0)
        out = []
        for start in range(0, len(prefixes), 1024):  # bounds the (chunk, dim) feature matrix
            x = self.featurizer.features(prefixes[start : start + 1024])  # (n, dim)
            out.append(_probabilities(head, x))
        return np.concatenate(out)

    # --- training ------------------------------------------------------------------------------
    @property
    def replay_rows(self) -> int:
        return sum(len(r.rows) for r in self._replay)

    def fit(
        self,
        data: Sequence[RolloutTree] | TrainingRows,
        generator: torch.Generator,
        *,
        epochs: int | None = None,
        lr: float | None = None,
        weight_decay: float | None = None,
    ) -> FitReport:
        """AdamW on the weighted squared error of ``data``'s rows plus the replayed ones.

        ``epochs``, ``lr`` and ``weight_decay`` default to the config's. The head keeps its
        weights from the previous fit (a warm start); the optimiser starts fresh. Afterwards
        ``data``'s rows join the replay buffer and the oldest rows beyond ``replay_rows`` go.
        """
        start = time.perf_counter()
        c = self.config
        epochs = c.epochs if epochs is None else epochs
        lr = c.lr if lr is None else lr
        weight_decay = c.weight_decay if weight_decay is None else weight_decay
        if epochs < 1 or not lr > 0 or weight_decay < 0:
            raise ValueError(
                f"need epochs >= 1, lr > 0, weight_decay >= 0; got {epochs}, {lr}, {weight_decay}"
            )
        rows = data if isinstance(data, TrainingRows) else training_rows(data)
        new = _Replay(rows, self.featurizer.features(rows.prefixes))
        parts = [*self._replay, new]
        x = torch.cat([p.features for p in parts])  # (R, dim)
        y = torch.from_numpy(np.concatenate([p.rows.target for p in parts])).float()  # (R,)
        n = np.concatenate([p.rows.weight for p in parts])
        w = torch.from_numpy(n if c.weighting == "leaves" else np.ones_like(n)).float()  # (R,)
        report_rows, replayed = len(rows), len(x) - len(rows)
        if not len(x):
            return FitReport(0, 0, math.nan, math.nan, time.perf_counter() - start)
        forecast = self._forecast(new) if self.fits else {}

        last = self.head[-1]
        assert isinstance(last, nn.Linear)
        if self.fits == 0:
            # Start from the best constant: σ(bias) = the weighted mean target.
            mean = min(max(float((w * y).sum() / w.sum()), 1e-3), 1 - 1e-3)
            with torch.no_grad():
                last.bias.fill_(math.log(mean / (1 - mean)))
        loss_before = self._loss(x, y, w)
        optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=weight_decay)
        self.head.train()
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=generator)
            for batch in order.split(c.batch_size):
                pred = torch.sigmoid(self.head(x[batch]).squeeze(-1))  # (b,)
                loss = _weighted_mse(pred, y[batch], w[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        self.head.eval()
        loss_after = self._loss(x, y, w)
        if c.root_head:
            roots = torch.from_numpy(np.concatenate([p.rows.depth for p in parts]) == 0)
            if roots.any():
                self.root = _fit_root_head(x[roots], y[roots], w[roots], c.root_l2)
        self.fits += 1
        self._push_replay(new)
        measured = None if isinstance(data, TrainingRows) else continuation_worth(data)
        if measured is not None:
            self.continuation_worth = 0.5 * (self.continuation_worth + measured)
        return FitReport(
            report_rows, replayed, loss_before, loss_after, time.perf_counter() - start,
            **forecast, continuation_worth=self.continuation_worth,
        )  # fmt: skip

    @torch.no_grad()
    def unseen_forecasts(
        self, rows: TrainingRows, features: torch.Tensor | None = None
    ) -> dict[str, Forecast]:
        """This predictor's forecasts of ``rows`` that no replayed row holds, by kind: ``root``
        (prompts) and ``prefix`` (deeper), each with the replayed rows' leaf-weighted mean
        target of that kind as the constant to beat. ``features``: ``rows``' own, if known."""
        old = concat_rows([r.rows for r in self._replay])
        seen = {tuple(p) for p in old.prefixes}
        unseen = np.asarray([tuple(p) not in seen for p in rows.prefixes], dtype=bool)
        x = self.featurizer.features(rows.prefixes) if features is None else features
        p = _probabilities(self.head, x) if len(rows) else np.zeros(0)
        if self.root is not None and len(rows):
            at = rows.depth == 0
            p[at] = _probabilities(self.root, x[torch.from_numpy(at)])
        out = {}
        for kind, mask, old_mask in (
            ("root", rows.depth == 0, old.depth == 0),
            ("prefix", rows.depth > 0, old.depth > 0),
        ):
            keep = unseen & mask
            kept = rows.select(keep)
            out[kind] = Forecast(
                p[keep], kept.successes, kept.weight - kept.successes,
                weighted_mean(old.select(old_mask)),
            )  # fmt: skip
        return out

    def _forecast(self, new: _Replay) -> dict[str, float]:
        """``FitReport``'s root_skill, prefix_skill and root_auc for rows not yet trained on."""
        forecasts = self.unseen_forecasts(new.rows, new.features)
        return {
            "root_skill": forecasts["root"].brier_skill,
            "prefix_skill": forecasts["prefix"].brier_skill,
            "root_auc": forecasts["root"].auc,
        }

    @torch.no_grad()
    def _loss(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
        return float(_weighted_mse(torch.sigmoid(self.head(x).squeeze(-1)), y, w))

    def _push_replay(self, new: _Replay) -> None:
        self._replay.append(new)
        excess = self.replay_rows - self.config.replay_rows
        while excess > 0:
            oldest = self._replay[0]
            if len(oldest.rows) <= excess:
                self._replay.pop(0)
                excess -= len(oldest.rows)
            else:
                keep = np.arange(excess, len(oldest.rows))
                self._replay[0] = _Replay(oldest.rows.select(keep), oldest.features[excess:])
                excess = 0

    # --- checkpoints ---------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """``predictor.safetensors`` (head), ``predictor.json`` (config), ``root.safetensors``
        (the root head, once fitted), ``replay.safetensors`` (rows)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.head.state_dict().items()}, out / WEIGHTS_FILE
        )
        if self.root is not None:
            root = {k: v.contiguous() for k, v in self.root.state_dict().items()}
            save_file(root, out / ROOT_FILE)
        meta = {
            "format_version": FORMAT_VERSION,
            "config": asdict(self.config),
            "featurizer": {
                "kind": self.config.featurizer,
                "dim": self.featurizer.dim,
                **({"model": EMBEDDING_MODEL} if self.config.featurizer == "embedding" else {}),
            },
            "fits": self.fits,
            "continuation_worth": self.continuation_worth,
        }
        (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        replay = concat_rows([r.rows for r in self._replay])
        lengths = np.asarray([len(p) for p in replay.prefixes], dtype=np.int64)
        # Token ids, not features: a few bytes a token instead of 4·dim bytes a row.
        save_file(
            {
                "tokens": torch.from_numpy(
                    np.asarray([t for p in replay.prefixes for t in p], dtype=np.int64)
                ),
                "lengths": torch.from_numpy(lengths),
                "target": torch.from_numpy(replay.target),
                "weight": torch.from_numpy(replay.weight),
                "depth": torch.from_numpy(replay.depth),
            },
            out / REPLAY_FILE,
        )
        return out

    @classmethod
    def load(
        cls, directory: str | Path, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> SharedPredictor:
        """A saved predictor; ``tokenizer`` (the policy's) is needed by the embedding featurizer."""
        src = Path(directory)
        if saved_config(src) is None:
            raise FileNotFoundError(f"no {CONFIG_FILE} in {src}: not a saved predictor")
        check_safetensors(_file(src, WEIGHTS_FILE))
        for optional in (ROOT_FILE, REPLAY_FILE):
            if (src / optional).exists():
                check_safetensors(src / optional)
        try:
            return cls._load(src, tokenizer)
        except (KeyError, TypeError, RuntimeError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{src}: a damaged or foreign predictor ({type(err).__name__}: {err}); "
                "refit it with `trace-rl predictor fit`"
            ) from None

    @classmethod
    def _load(cls, src: Path, tokenizer: PreTrainedTokenizerBase | None) -> SharedPredictor:
        meta = json.loads(_file(src, CONFIG_FILE).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{_file(src, CONFIG_FILE)}: format_version {meta.get('format_version')!r}, "
                f"this code reads {FORMAT_VERSION}"
            )
        predictor = cls(
            PredictorConfig(**meta["config"]),
            generator=torch.Generator().manual_seed(0),  # overwritten by the saved weights
            tokenizer=tokenizer,
        )
        if predictor.featurizer.dim != meta["featurizer"]["dim"]:
            raise ValueError(
                f"{src}: saved feature dim {meta['featurizer']['dim']}, the featurizer now "
                f"gives {predictor.featurizer.dim}"
            )
        predictor.head.load_state_dict(load_file(_file(src, WEIGHTS_FILE)), strict=True)
        predictor.head.eval()
        if predictor.config.root_head and (src / ROOT_FILE).exists():
            predictor.root = nn.Linear(predictor.featurizer.dim, 1)
            predictor.root.load_state_dict(load_file(src / ROOT_FILE), strict=True)
        predictor.fits = int(meta["fits"])
        predictor.continuation_worth = float(meta.get("continuation_worth", PRIOR_WORTH))
        if (src / REPLAY_FILE).exists():
            saved = {k: v.numpy() for k, v in load_file(src / REPLAY_FILE).items()}
            bounds = np.cumsum(saved["lengths"])[:-1]
            prefixes = [p.tolist() for p in np.split(saved["tokens"], bounds)]
            if not len(saved["lengths"]):
                prefixes = []
            rows = TrainingRows(prefixes, saved["target"], saved["weight"], saved["depth"])
            if len(rows):
                predictor._replay = [_Replay(rows, predictor.featurizer.features(rows.prefixes))]
        return predictor


def saved_config(folder: Path) -> Path | None:
    """``folder``'s predictor config file (by its name now or its earlier one), if any."""
    path = _file(folder, CONFIG_FILE)
    return path if path.is_file() else None


def _file(folder: Path, name: str) -> Path:
    """``folder / name``, or the file's earlier name (``EARLIER``) where only that exists."""
    now, before = folder / name, folder / EARLIER.get(name, name)
    return before if not now.exists() and before.exists() else now
