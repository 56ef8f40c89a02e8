"""A self-contained HTML view of rollout trees: the KFP HTML artifact of the report step.

    Path("trees.html").write_text(render_html(trees, title="iteration 12"))
    # or: trace-rl inspect html build/rollout 3 7 -o trees.html

One file, no network: inline CSS, a few lines of inline script (expand/collapse all; the view
works without it, e.g. in a sandboxed iframe), and a Content-Security-Policy that forbids every
fetch. Each turn is a ``<details>`` element: its summary line shows the node id, whether it
starts a continuation, the generated text and observation (clipped), the reward (leaves; green
1, red 0), the predicted V and the recursive target V̂ (a badge shaded from red at 0 to green at
1) and the leaves below it; opening it shows its children and a folded "full text" line. Trees
of up to ``OPEN_ALL`` nodes start fully open, larger ones open to depth 2.

Elements carry what a test (or a script) needs: ``li.node[data-node]`` per node,
``.reward.r1``/``.reward.r0`` per leaf, ``.branch`` per continuation, ``section.tree`` per tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

import numpy as np

from trace_core.algo.metrics import measure
from trace_core.algo.tree import ROOT, RolloutTree, leaf_counts, recursive_targets

OPEN_ALL = 200
SUMMARY_CHARS = 120

_CSS = """
:root { color-scheme: light; --ok: #1a7f37; --bad: #cf222e; --muted: #57606a; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px 24px;
       color: #1f2328; background: #ffffff; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 24px 0 2px; }
.meta, .legend { color: var(--muted); margin: 2px 0; }
.controls button { margin: 8px 8px 0 0; }
ul.nodes, ul.nodes ul { list-style: none; margin: 0; padding-left: 18px;
                         border-left: 1px solid #d0d7de; }
ul.nodes { border-left: none; padding-left: 0; }
li.node { margin: 2px 0; }
summary { cursor: pointer; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.id { color: var(--muted); font-family: ui-monospace, monospace; }
.text { color: #0550ae; }
.obs { color: #8250df; }
.badge { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 12px;
         margin-left: 4px; font-family: ui-monospace, monospace; }
.reward.r1 { background: var(--ok); color: #fff; }
.reward.r0 { background: var(--bad); color: #fff; }
.v { background: #ddf4ff; color: #0a3069; }
.n { color: var(--muted); }
.branch-mark { background: #fff8c5; color: #7d4e00; font-weight: 600; }
li.leaf.r1 > details > summary { background: #dafbe1; }
li.leaf.r0 > details > summary { background: #ffebe9; }
details.full > summary { color: var(--muted); font-size: 12px; margin-left: 18px; }
.body { margin: 2px 0 4px 18px; padding: 4px 8px; background: #f6f8fa; border-radius: 4px; }
.body pre { margin: 0; white-space: pre-wrap; font: 12px/1.4 ui-monospace, monospace; }
.body .label { color: var(--muted); font-size: 12px; }
"""

_SCRIPT = """
for (const [label, open] of [["expand all", true], ["collapse all", false]]) {
  const b = document.createElement("button");
  b.textContent = label;
  b.onclick = () => document.querySelectorAll("li.node > details").forEach(d => d.open = open);
  document.querySelector(".controls").append(b);
}
"""

_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def _fmt(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}"


def _clip(text: str, limit: int = SUMMARY_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _shade(v: float) -> str:
    """A background from red (0) through yellow to green (1); grey when unknown."""
    if math.isnan(v):
        return "background:#eaeef2;color:#1f2328"
    return f"background:hsl({round(120 * min(max(v, 0.0), 1.0))},70%,82%);color:#1f2328"


def _node(
    tree: RolloutTree,
    node: int,
    children: list[np.ndarray],
    targets: np.ndarray,
    leaves: np.ndarray,
    open_depth: int,
    depth: int,
) -> str:
    reward = float(tree.reward[node])
    leaf = not math.isnan(reward)
    classes = ["node", "root" if node == ROOT else "turn"]
    if leaf:
        classes += ["leaf", f"r{reward:g}"]
    if tree.branch[node]:
        classes.append("branch")
    summary = [f'<span class="id">#{node}</span>']
    if node == ROOT:
        summary.append(f'<b>prompt</b> <span class="text">{escape(_clip(tree.text[node]))}</span>')
    else:
        if tree.branch[node]:
            summary.append('<span class="badge branch-mark">↳ continuation</span>')
        summary.append(f'<span class="text">{escape(_clip(tree.text[node]))}</span>')
        if tree.observation[node]:
            summary.append(f'→ <span class="obs">{escape(_clip(tree.observation[node]))}</span>')
    if leaf:
        summary.append(f'<span class="badge reward r{reward:g}">r={reward:g}</span>')
    v, target = float(tree.predicted_v[node]), float(targets[node])
    summary.append(f'<span class="badge v" title="predicted V">V {_fmt(v)}</span>')
    summary.append(
        f'<span class="badge target" style="{_shade(target)}" title="target V̂: mean leaf '
        f'reward below">V̂ {_fmt(target)}</span>'
    )
    if leaves[node] > 1:
        summary.append(f'<span class="n">n={leaves[node]}</span>')
    tokens = (
        f"{len(tree.gen_tokens[node])} generated, {len(tree.obs_tokens[node])} "
        f"{'prompt' if node == ROOT else 'observation'} tokens"
    )
    body = [f'<span class="label">{"prompt" if node == ROOT else "generated"}</span>']
    body.append(f"<pre>{escape(tree.text[node])}</pre>")
    if tree.observation[node]:
        body.append(
            f'<span class="label">observation</span><pre>{escape(tree.observation[node])}</pre>'
        )
    kids = "".join(
        _node(tree, int(c), children, targets, leaves, open_depth, depth + 1)
        for c in children[node]
    )
    attrs = (
        f'class="{" ".join(classes)}" data-node="{node}" data-v="{_fmt(v)}" '
        f'data-target="{_fmt(target)}"' + (f' data-reward="{reward:g}"' if leaf else "")
    )
    is_open = " open" if depth < open_depth and not leaf else ""
    return (
        f"<li {attrs}><details{is_open}><summary>{' '.join(summary)}</summary>"
        f'<details class="full"><summary>full text · {tokens}</summary>'
        f'<div class="body">{"".join(body)}</div></details>'
        + (f"<ul>{kids}</ul>" if kids else "")
        + "</details></li>"
    )


def render_tree_html(tree: RolloutTree) -> str:
    """One ``<section class="tree">``: a heading, the tree's cost and contrast, its nodes."""
    info = tree.info
    m = measure([tree])
    targets, leaves = recursive_targets(tree), leaf_counts(tree)
    open_depth = 1_000_000 if tree.size <= OPEN_ALL else 2
    nodes = _node(tree, ROOT, tree.children(), targets, leaves, open_depth, 0)
    successes = int(np.count_nonzero(tree.reward == 1.0))
    return (
        f'<section class="tree" data-tree-id="{info.tree_id}" data-run="{escape(info.run_id)}" '
        f'data-iteration="{info.iteration}" data-nodes="{tree.size}">'
        f"<h2>tree {info.tree_id} · prompt {escape(info.prompt_id)} · "
        f"{escape(info.strategy or '(no strategy)')}</h2>"
        f'<p class="meta">run {escape(info.run_id)} · iteration {info.iteration} · policy '
        f"v{info.policy_version} · {tree.size} nodes · {tree.root_rollouts} rollouts + "
        f"{tree.continuations} continuations = {tree.units:g} units · "
        f"{tree.generated_tokens:,} tokens · leaves {successes}/{int(leaves[ROOT])} with "
        f"reward 1 · {m.mixed_groups}/{m.anchors} anchors mixed</p>"
        f'<ul class="nodes">{nodes}</ul></section>'
    )


def render_html(trees: Sequence[RolloutTree], title: str = "Rollout trees") -> str:
    """A complete HTML page showing ``trees`` (module docstring)."""
    sections = "\n".join(render_tree_html(t) for t in trees)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{escape(title)}</h1>
<p class="legend">Each line is one turn: generated text → observation. Leaves show their reward
(<span class="badge reward r1">r=1</span> <span class="badge reward r0">r=0</span>),
every node the predictor's <span class="badge v">V</span> when it was scored and the target
<span class="badge target" style="{_shade(0.5)}">V̂</span> (mean leaf reward below);
<span class="badge branch-mark">↳ continuation</span> marks the first turn of a continuation
sampled from a prefix. n = leaves below. Click a line to fold it. Units are the rollout
budget a tree spent: 1 per root rollout, ½ per continuation (a partial rollout). An anchor is a
group of sibling rollouts (a prompt's roots, or the continuations of one prefix); it is mixed when
its leaves hold both a success and a failure, the contrast the update learns from.</p>
<div class="controls"></div>
{sections}
<script>{_SCRIPT}</script>
</body>
</html>
"""
