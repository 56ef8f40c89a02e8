"""``trace-rl cluster check``: whether a cluster's nodes hold a run, before the run.

    trace-rl cluster check                               # kubectl get nodes -o json, kfp overlay
    trace-rl cluster check --nodes nodes.json --overlay standalone
    kubectl get nodes -o json | trace-rl cluster check --nodes - --param rollout_workers=16

One line per check (``ok``, ``FAIL`` with the shortfall, ``skip`` when it could not be read);
exit 0 when the run fits, 1 when it does not, 2 on bad input. The checks are
``pipelines.cluster_check``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from trace_core.cli.output import console, fail

app = typer.Typer(help="Check a cluster against what the pipeline's pods and a run ask of it.")


def _read_json(path: str, flag: str) -> object:
    """The JSON in ``path`` (``-``: stdin); an unreadable file fails naming ``flag``."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except FileNotFoundError:
        raise fail(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise fail(f"{flag} {path}: cannot read it ({err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise fail(f"{flag} {path}: not JSON ({err})") from None


@app.command("check")
def check_command(
    nodes: Annotated[
        str | None,
        typer.Option(
            help="The JSON of `kubectl get nodes -o json` (- for stdin); without it, that command "
            "runs here."
        ),
    ] = None,
    overlay: Annotated[
        str, typer.Option(help="The manifests/overlays/ folder whose Ray pods are checked.")
    ] = "kfp",
    param: Annotated[
        list[str] | None,
        typer.Option(
            help="A run parameter KEY=VALUE over docs/deploy.md's Qwen3-8B run (repeatable), "
            "e.g. rollout_workers=16."
        ),
    ] = None,
    store_pvc: Annotated[
        str | None,
        typer.Option(
            help="The store's PersistentVolumeClaim as JSON (`kubectl -n kubeflow get pvc "
            "seaweedfs-pvc -o json`); without it, the overlay's own store if it deploys one."
        ),
    ] = None,
    parameters: Annotated[
        float | None,
        typer.Option(
            help="The model's parameters in billions, for the store's checkpoints (default: "
            "Qwen3-8B's 8.19)."
        ),
    ] = None,
) -> None:
    """Check the nodes against the RayCluster's pods and a run's GPUs and store."""
    from pipelines import cluster_check as check
    from pipelines.node_fit import read_nodes

    overrides = {}
    for assignment in param or []:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip():
            raise fail(f"--param {assignment!r}: expected KEY=VALUE")
        overrides[key.strip()] = value
    run = check.RunShape.of(check.run_parameters(overrides))
    if parameters is not None and not parameters > 0:
        raise fail(f"--parameters {parameters:g}: expected a positive number of billions")
    count = check.QWEN3_8B_PARAMETERS if parameters is None else parameters * 1e9
    data = check.get_nodes() if nodes is None else _read_json(nodes, "--nodes")
    found = read_nodes(data, f"--nodes {nodes}" if nodes else "kubectl get nodes")
    volume = None
    if store_pvc is not None:
        volume = check.read_store_volume(_read_json(store_pvc, "--store-pvc"), "--store-pvc")
    pods = check.read_pods(check.render_overlay(overlay), overlay)
    report = check.check_cluster(found, pods, run, count, volume)
    for text in report.lines:
        console.print(text, highlight=False, soft_wrap=True, markup=False)
    if not report.fits:
        raise typer.Exit(1)
