"""``trace-rl``: the command line. Thin: parse flags, build a config, call one function, print.
Each command group lives in its own module; this one lists every command, in one place.

    trace-rl --help
    trace-rl bench allocation --json out.json
"""

from __future__ import annotations

from typing import Annotated

import typer

from trace_core.cli import (
    bench,
    bench_ray,  # noqa: F401  (its commands join the bench group)
    bench_scale,  # noqa: F401  (its commands join the bench group)
    cluster,
    models,
    pipeline,
    retriever,
    tasks,
    training,
    trees,
)
from trace_core.cli.output import DEBUG_ENV, CommandGroup

app = typer.Typer(
    cls=CommandGroup, help="TRACE: tree rollout allocation for contrastive exploration."
)


@app.callback()
def main(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            envvar=DEBUG_ENV,
            help="Show a traceback instead of the one-line error (also TRACE_DEBUG=1).",
        ),
    ] = False,
) -> None:
    """TRACE: tree rollout allocation for contrastive exploration."""


app.add_typer(bench.app, name="bench")
app.add_typer(models.app, name="model")
app.add_typer(tasks.task_app, name="task")
app.add_typer(training.predictor_app, name="predictor")
app.add_typer(trees.app, name="inspect")
app.add_typer(pipeline.app, name="pipeline")
app.add_typer(retriever.app, name="retriever")
app.add_typer(cluster.app, name="cluster")
app.command("warmstart")(tasks.warmstart_command)
app.command("rollout-demo")(tasks.rollout_demo)
app.command("prep")(tasks.prep_command)
app.command("rollout")(tasks.rollout_command)
app.command("train")(training.train_command)
app.command("compare")(training.compare_command)
app.command("run-local")(pipeline.run_local_command)
app.command("step")(pipeline.step_command)
