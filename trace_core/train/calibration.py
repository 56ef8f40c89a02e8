"""How well a run's shared predictor ranked what it was about to see, iteration by iteration.

    trace-rl predictor score build/train/calc-mix-trace --plot build/calibration.png

Iteration i's roots and prefixes were allocated with the predictor as iteration i − 1 left
it, and that predictor had not trained on iteration i's trees: they are held out from it. For
each stored iteration i ≥ 2 this loads iteration i − 1's predictor and scores it on iteration
i's trees (``SharedPredictor.unseen_forecasts``: rows its replay holds are left out): Brier
skill against the best constant, AUC, and the points of a reliability diagram — per bin of
forecast V, the observed share of successful leaves. The same figures the loop logs as
``root_skill`` and ``prefix_skill``, recomputed from what the run stored, with the diagram.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trace_core.algo.prefix import training_rows
from trace_core.policy.checkpoint import load_tokenizer
from trace_core.policy.predictor import SharedPredictor
from trace_core.store.schema import read_trees
from trace_core.train.run_folder import iteration_dir, stored_iterations

KINDS = {"root": "roots", "prefix": "prefixes"}
"""Node kinds, and their plural."""


@dataclass(frozen=True)
class Scored:
    """One iteration's trees, forecast by the previous iteration's predictor."""

    iteration: int
    kind: str
    nodes: int
    outcomes: int
    skill: float
    auc: float
    reliability: list[tuple[float, float, float]]
    """(mean forecast, observed success rate, outcomes) per forecast bin."""


def score_run(run: Path, bins: int = 10) -> list[Scored]:
    """Every scoreable iteration of the run folder ``run``, oldest first, roots then prefixes."""
    stored = stored_iterations(run)
    if not stored:
        raise FileNotFoundError(f"{run}: no iterations/ here: not a `trace-rl train` run folder")
    out = []
    for i in stored:
        before, now = iteration_dir(run, i - 1), iteration_dir(run, i)
        if not (before / "predictor").is_dir() or not (now / "trees.parquet").is_file():
            continue
        predictor = SharedPredictor.load(before / "predictor", load_tokenizer(before / "policy"))
        rows = training_rows(read_trees(now / "trees.parquet"))
        for kind, forecast in predictor.unseen_forecasts(rows).items():
            out.append(
                Scored(
                    iteration=i,
                    kind=kind,
                    nodes=len(forecast.p),
                    outcomes=int(forecast.successes.sum() + forecast.failures.sum()),
                    skill=forecast.brier_skill,
                    auc=forecast.auc,
                    reliability=forecast.reliability(bins),
                )
            )
    if not out:
        raise ValueError(f"{run}: needs two stored iterations in a row to score one")
    return out


def plot_calibration(scored: list[Scored], path: Path) -> None:
    """Reliability diagrams (roots, prefixes; one line per iteration) and skill per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    iterations = sorted({s.iteration for s in scored})
    colors = plt.get_cmap("viridis")
    for ax, kind in zip(axes[:2], KINDS, strict=True):
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfectly calibrated")
        for s in (s for s in scored if s.kind == kind):
            shade = colors(iterations.index(s.iteration) / max(1, len(iterations) - 1))
            x, y = [r[0] for r in s.reliability], [r[1] for r in s.reliability]
            ax.plot(x, y, marker="o", color=shade, label=f"iteration {s.iteration}")
        ax.set(xlabel="forecast V (bin mean)", ylabel="observed success rate", xlim=(0, 1))
        ax.set(ylim=(0, 1), title=f"{KINDS[kind]}: reliability on the next iteration's trees")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for kind in KINDS:
        points = [(s.iteration, s.skill) for s in scored if s.kind == kind]
        axes[2].plot(*zip(*points, strict=True), marker="o", label=kind)
    axes[2].axhline(0, color="grey", linewidth=0.8)
    axes[2].set(xlabel="iteration", ylabel="Brier skill vs constant")
    axes[2].set_title("Brier skill (above 0: better than a constant)")
    axes[2].grid(alpha=0.3)
    axes[2].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
