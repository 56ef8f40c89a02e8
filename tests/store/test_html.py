"""The HTML tree view: self-contained, and rendered by a real headless Chromium (DOM + pixels).

Chromium is Debian's ``chromium`` package; ``make test`` installs it (``make browser``) when it
is missing. Without it this test fails rather than skips: the view is a deliverable.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.browser import find_chromium, headless

from trace_core.algo.tree import RolloutTree
from trace_core.store.html import render_html

WIDTH, HEIGHT = 1100, 1400


@pytest.fixture(scope="module")
def chromium() -> str:
    return find_chromium()


def test_html_is_self_contained(tree_factory: Callable[..., RolloutTree]) -> None:
    html = render_html([tree_factory(0)], title="a <b>title</b>")
    assert not re.search(r"(src|href)\s*=|https?://|@import|url\(", html)
    assert "default-src 'none'" in html  # the CSP forbids every fetch
    assert "a &lt;b&gt;title&lt;/b&gt;" in html and "answer[&lt;5&gt;]" in html  # escaped


@pytest.mark.slow  # headless Chromium
def test_chromium_renders_the_tree_view(
    chromium: str, tmp_path: Path, tree_factory: Callable[..., RolloutTree]
) -> None:
    trees = [tree_factory(0), tree_factory(1, strategy="grpo")]
    page = tmp_path / "trees.html"
    page.write_text(render_html(trees, title="iteration 0"))

    dom = headless(chromium, "--dump-dom", page.as_uri(), cwd=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # The DOM after the script ran: one section per tree, one li.node per node, each turn a
    # <details> (collapsible), rewards classed for colour, continuations marked.
    assert html.count('<section class="tree"') == 2
    assert len(re.findall(r'<li class="node[ "]', html)) == sum(t.size for t in trees) == 16
    assert len(re.findall(r"<li [^>]*>\s*<details", html)) == 16
    assert len(re.findall(r'class="badge reward r1"', html)) == 2 * 3 + 1  # + the legend
    assert len(re.findall(r'class="badge reward r0"', html)) == 2 * 1 + 1
    assert len(re.findall(r'<li class="node turn leaf r0 branch"', html)) == 2
    assert 'data-node="5" data-v="0.90" data-target="1.00"' in html
    assert ">expand all</button>" in html  # the inline script ran

    shot = headless(
        chromium,
        f"--window-size={WIDTH},{HEIGHT}",
        "--screenshot=shot.png",
        page.as_uri(),
        cwd=tmp_path,
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    image = np.asarray(Image.open(tmp_path / "shot.png").convert("RGB")).astype(int)
    assert image.shape == (HEIGHT, WIDTH, 3)
    assert image.std() > 20  # not blank
    r, g, b = image[..., 0], image[..., 1], image[..., 2]
    # The reward badges: GitHub green (#1a7f37) and red (#cf222e) pixels are both on screen.
    green = (abs(r - 0x1A) < 12) & (abs(g - 0x7F) < 12) & (abs(b - 0x37) < 12)
    red = (abs(r - 0xCF) < 12) & (abs(g - 0x22) < 12) & (abs(b - 0x2E) < 12)
    assert green.sum() > 200 and red.sum() > 200, (green.sum(), red.sum())


README_SHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "tree-view.png"
"""The README's picture of the tree view: made here, from trees the calc policy grew
(docs/scaling/trees.parquet, tree 17: continuations from two prefixes, both rewards)."""


@pytest.mark.slow  # headless Chromium
def test_the_readmes_tree_view_is_what_chromium_renders_today(
    chromium: str, tmp_path: Path
) -> None:
    """Renders the README's picture again and compares it with the committed one; where they
    differ (the view changed), the new picture is left in build/docs/ to be committed."""
    from trace_core.store.schema import read_trees

    trees = read_trees(README_SHOT.parents[1] / "scaling" / "trees.parquet")
    (tmp_path / "trees.html").write_text(render_html([trees[17]], title="calc, iteration 0"))
    shot = headless(
        chromium, "--window-size=1000,640", "--screenshot=shot.png", "trees.html", cwd=tmp_path
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    made = np.asarray(Image.open(tmp_path / "shot.png").convert("RGB")).astype(int)
    assert made.std() > 20  # not blank
    shown = (
        np.asarray(Image.open(README_SHOT).convert("RGB")).astype(int)
        if (README_SHOT.exists())
        else None
    )
    if shown is None or shown.shape != made.shape or np.abs(shown - made).mean() > 1.0:
        keep = README_SHOT.parents[2] / "build" / "docs" / README_SHOT.name
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_bytes((tmp_path / "shot.png").read_bytes())
        pytest.fail(f"the tree view renders otherwise than {README_SHOT.name}: see {keep}")
