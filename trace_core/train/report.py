"""The Markdown summary of a training run: what the pipeline's report step shows in the KFP UI.

    text = summary_markdown("TRACE run nightly", {"task": "calc"}, read_log(policy_dir),
                            start_eval, final_eval, Path("trees/trees.parquet"))

Sections: the settings, held-out accuracy before and after (pass@1 greedy, mean@k sampled, the
share of turns whose action parses), one line per iteration (prompt and anchor effective
ratios, mixed groups, units, generated tokens, update loss), and the head of the last
iteration's trees Parquet. The KFP UI renders Markdown but not Parquet, so the head is turned
into a table here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow.parquet as pq

from trace_core.train.record import IterationRecord

HEAD_COLUMNS = (
    "iteration",
    "tree_id",
    "prompt_id",
    "node_id",
    "parent_id",
    "depth",
    "branch",
    "reward",
    "predicted_v",
    "target_v",
    "text",
    "observation",
)
TEXT_CHARS = 48


def summary_markdown(
    title: str,
    settings: Mapping[str, object],
    records: Sequence[IterationRecord],
    start_eval: Mapping[str, object],
    final_eval: Mapping[str, object],
    trees_path: Path,
    head_rows: int = 12,
    tree_uris: Mapping[int, str] | None = None,
    unread: Mapping[int, str] | None = None,
    shown: Sequence[int] = (),
) -> str:
    """The run's summary in Markdown; ``tree_uris``: where each iteration's trees are (the
    last one's first in the commands that open them, with the trees ``shown``), ``unread``:
    the iterations whose trees could not be read back, and why."""
    lines = [f"# {title}", ""]
    lines += [" · ".join(f"**{k}** {v}" for k, v in settings.items()), ""]
    lines += ["## Held-out accuracy", ""]
    k = final_eval.get("k", start_eval.get("k", 0))
    lines += _table(
        ["policy", "pass@1", f"mean@{k}", "action parse rate", "eval tasks"],
        [
            [
                label,
                _all(report, "pass1"),
                _all(report, "mean_k"),
                _rate(report.get("parse_rate")),
                str(report.get("tasks", "-")),
            ]
            for label, report in (("start", start_eval), ("final", final_eval))
        ]
        + _change_row(start_eval, final_eval),
    )
    lines += [
        "",
        f"pass@1: share of the held-out tasks solved by one greedy episode. mean@{k}: mean "
        f"success of {k} sampled episodes per task (what the policy's sampling does, which the "
        "update trains). action parse rate: share of turns whose action parsed. change: final − "
        "start on the same tasks, with its 95% interval [low, high] (paired: each task against "
        "itself); an interval that holds 0 is no evidence of a change either way.",
    ]
    lines += ["", "## Iterations", ""]
    lines += _table(
        [
            "iteration",
            "prompt eff. ratio",
            "anchor eff. ratio",
            "mixed groups",
            "mixed / 100 units",
            "units",
            "tokens",
            "update loss",
        ],
        [
            [
                str(r.iteration),
                f"{r.rollout.get('prompt_effective_ratio', 0):.3f}",
                f"{r.rollout.get('anchor_effective_ratio', 0):.3f}",
                f"{r.rollout.get('mixed_groups', 0):.0f}",
                f"{r.rollout.get('mixed_per_100_units', 0):.2f}",
                f"{r.rollout.get('units', 0):g}",
                f"{r.tokens:,}",
                f"{r.update.get('loss', 0):.4f}",
            ]
            for r in records
        ],
    )
    lines += [
        "",
        "prompt eff. ratio: share of prompts whose rollouts hold both a success and a failure "
        "(the paper's effective ratio). An anchor is a group of sibling rollouts (a prompt's "
        "roots, or the continuations of one prefix); anchor eff. ratio: the same share over "
        "anchors; mixed groups: how many anchors are mixed. units: the rollout budget spent, 1 "
        "per root rollout and 0.5 per continuation. update loss: the policy update's mean loss.",
    ]
    lines += open_trees_markdown(tree_uris or {}, unread or {}, shown)
    lines += ["", f"## Trees (first {head_rows} rows of `{trees_path.name}`)", ""]
    lines += parquet_head(trees_path, head_rows)
    return "\n".join(lines) + "\n"


LEAVES_QUERY = (
    "SELECT iteration, strategy, count(*) AS leaves, avg(reward) AS success "
    "FROM nodes WHERE is_leaf GROUP BY 1, 2"
)


def open_trees_markdown(
    tree_uris: Mapping[int, str], unread: Mapping[int, str], shown: Sequence[int]
) -> list[str]:
    """Where every iteration's trees are, and the commands that open the last ones."""
    known = {i: uri for i, uri in sorted(tree_uris.items()) if uri}
    if not known:
        return []
    last = known[max(known)]
    ids = [str(i) for i in shown]
    lines = ["", "## Where the trees are", ""]
    rows = [[str(i), f"`{uri}`"] for i, uri in known.items()]
    lines += _table(["iteration", "trees (Parquet)"], rows)
    lines += [""]
    for i, why in unread.items():
        lines += [f"Iteration {i}'s trees could not be read: {why}", ""]
    lines += [
        "The tree view of the last iteration's most mixed trees, and its leaves' success by "
        "strategy in SQL (`trace-rl inspect` reads any URI above; `s3://` and `minio://` with "
        "the store's `AWS_*` credentials in the environment):",
        "",
        "```bash",
        " ".join(["trace-rl inspect html", shlex.quote(last), *ids, "-o trees.html"]),
        f"trace-rl inspect query {shlex.quote(last)} {shlex.quote(LEAVES_QUERY)}",
        "```",
    ]
    return lines


def parquet_head(path: Path, rows: int) -> list[str]:
    """The first ``rows`` rows of the trees file as a Markdown table (long text clipped)."""
    file = pq.ParquetFile(path)
    columns = [c for c in HEAD_COLUMNS if c in file.schema_arrow.names]
    table = next(file.iter_batches(batch_size=rows, columns=columns), None)
    if table is None:
        return ["(no rows)"]
    body = [[_cell(v) for v in row.values()] for row in table.to_pylist()]
    return [*_table(columns, body), "", f"{file.metadata.num_rows:,} rows in all."]


def _change_row(start: Mapping[str, object], final: Mapping[str, object]) -> list[list[str]]:
    """The paired change row, when both reports have per-task results on the same tasks."""
    from trace_core.train.evaluate import paired_change

    changes = [paired_change(start, final, metric) for metric in ("pass1", "mean_k")]
    if changes[0] is None:
        return []
    cells = [c.text() if c is not None else "-" for c in changes]
    return [["change (95% interval)", *cells, "", str(changes[0].tasks)]]


def _all(report: Mapping[str, object], key: str) -> str:
    values = report.get(key)
    if isinstance(values, Mapping) and "all" in values:
        return f"{float(values['all']):.3f}"
    return "-"


def _rate(value: object) -> str:
    """A share, or "-" for a report written before it was recorded."""
    return f"{value:.3f}" if isinstance(value, float) else "-"


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value).replace("\n", " ").replace("|", "\\|")
    return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out
