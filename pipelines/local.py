"""The training pipeline run here through KFP's local runner: the same DAG and components as on
the cluster, each step a subprocess of this Python, artifacts in a local folder.

    trace-rl run-local                              # what `make run` does: calc, TRACE, K = 6
    trace-rl run-local --iterations 2 --budget 16 --settings-json '{"warmstart_steps": 60}'

``kfp.local`` with ``SubprocessRunner(use_venv=False)`` runs lightweight components in this
environment (trace_core installed, nothing pip-installed); the Kubernetes settings (Secrets,
node selectors) are part of the pipeline and ignored here, and the GPU requests are left out
(the runner cannot resolve their run parameters; see ``PipelineOptions.gpu_requests``).
The run gets a Ray head of its own on 127.0.0.1 (``pipelines.ray_head``; unless the parameters
name one in ``ray_address``), which every step connects to: the run's trainer and engine actors
live there from open session to close session, as on a cluster. Output under ``--output``
(``runs/``):

    runs/kfp/trace-training-<time>/<task>/<artifact>   every step's artifacts, as KFP names them
    runs/<run name>/trees/iteration-0001.parquet ...   links to each iteration's trees (a
                                                       resumed run adds its own beside them)
    runs/<run name>/report.html, summary.md            copies of the latest run's report
    runs/<run name>/curves.png                         its accuracy and effective ratio
    runs/logs/trace-training-<time>.log                all that the steps and KFP printed
    runs/store/checkpoints/<run name>/                 the checkpoint registry (resume): the
                                                       newest --keep-checkpoints (2) of them
    runs/store/sessions/, runs/store/staging/          the run's scratch, deleted as it ends

A run with the same ``--run-name`` and store resumes after the last registered checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pipelines.ray_head import loopback_head
from pipelines.steplog import StepLog
from trace_core.rollout.ray_auth import CLIENT_ENV, TOKEN_ENV
from trace_core.train.contract import PipelineParameters

# make run: the calc task's tiny policy, warm-started, then K iterations of TRACE. Chosen so
# that held-out accuracy moves within the 10 minutes a 2-core machine gives it.
MAKE_RUN_SETTINGS = {
    "prompts": 512,
    "eval_tasks": 200,
    "eval_k": 4,
    "warmstart_steps": 1000,
}


MAKE_RUN = PipelineParameters(
    iterations=6, run_name="calc-local", settings_json=json.dumps(MAKE_RUN_SETTINGS)
)
"""``make run``'s run parameters: calc, TRACE, K = 6, resumable under the name calc-local."""


@dataclass(frozen=True)
class LocalRun:
    """What ``trace-rl run-local`` takes: the pipeline's run parameters, and where things go."""

    output: Path = Path("runs")
    params: PipelineParameters = MAKE_RUN
    """The run parameters; an empty ``store_uri`` is ``output/store``."""
    s3_endpoint: str = ""
    """AWS_ENDPOINT_URL_S3 for the steps; empty: the environment's."""

    def parameters(self) -> dict[str, object]:
        """The pipeline's run parameters."""
        values = dataclasses.asdict(self.params)
        values["store_uri"] = self.params.store_uri or str((self.output / "store").resolve())
        return values


@dataclass(frozen=True)
class LocalResult:
    run_dir: Path
    """KFP's folder of this run: one sub-folder per task."""
    trees: list[Path]
    """Each iteration's trees Parquet, in iteration order (links under output/run name)."""
    trees_dir: Path
    report_html: Path
    summary_md: Path
    start_eval: dict[str, object]
    final_eval: dict[str, object]
    rollout: list[dict[str, float]]
    """Each iteration's rollout metrics (effective ratios, mixed groups, units, tokens)."""
    seconds: float
    log: Path
    """Everything the steps and KFP's runner printed."""
    curves: Path | None = None
    """Held-out accuracy (start, final) and each iteration's effective ratio, against tokens."""
    store: str = ""
    """The run's store (its registry); an ``s3://`` one: each iteration's S3 bytes are shown."""


def run_local(
    run: LocalRun, say: Callable[[str], None] = print, terminal: TextIO | None = None
) -> LocalResult:
    """Run the pipeline through ``kfp.local``; raises if a step fails. ``terminal`` (default:
    ``sys.stdout``) gets one line per step and iteration (``steplog``); ``say`` the rest."""
    from kfp import local

    from pipelines.trace_training import PIPELINE_NAME, PipelineOptions, build_pipeline

    # Bad run parameters are refused here, as prep would refuse them, before anything starts.
    PipelineParameters(**run.parameters()).config()  # type: ignore[arg-type]
    root = (run.output / "kfp").resolve()
    root.mkdir(parents=True, exist_ok=True)
    workspace = (run.output / ".kfp-workspace").resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(root),
        workspace_root=str(workspace),
    )
    logging.getLogger("kfp").setLevel(logging.WARNING)  # the steps' own output still streams
    before = set(root.iterdir())
    options = PipelineOptions(
        gpu_requests=False,
        s3_endpoint=run.s3_endpoint,
        ray_jobs_url="",  # the run names its own Ray head (ray_address), or none
    )
    pipeline = build_pipeline(options)
    p = run.params
    log_path = (
        run.output / "logs" / time.strftime("trace-training-%Y-%m-%d-%H-%M-%S.log", time.gmtime())
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"running {PIPELINE_NAME} with kfp.local: {p.task}, {p.strategy}, K={p.iterations}")
    say(f"every step's output: {log_path}")
    start = time.perf_counter()
    terminal = terminal or sys.stdout
    parameters = run.parameters()
    with contextlib.ExitStack() as head:
        if not parameters["ray_address"]:  # the run's own head, for its session's actors
            # with token auth, as on a cluster: the steps get the token and the mode
            token = os.environ.get(TOKEN_ENV) or secrets.token_hex(32)
            head.enter_context(_environment(**CLIENT_ENV, **{TOKEN_ENV: token}))
            parameters["ray_address"] = head.enter_context(loopback_head(token))
            say(f"Ray head for this run: {parameters['ray_address']} (stopped when it ends)")
        elif os.environ.get(TOKEN_ENV):  # the user's head and its token: the mode that sends it
            head.enter_context(_environment(**CLIENT_ENV))
        _run(pipeline, parameters, log_path, terminal, root, p.iterations)
    seconds = time.perf_counter() - start
    (run_dir,) = [p for p in root.iterdir() if p not in before and p.is_dir()]
    return _collect(run, run_dir, seconds, log_path)


def _run(
    pipeline: Callable[..., object],
    parameters: dict[str, object],
    log_path: Path,
    terminal: TextIO,
    root: Path,
    iterations: int,
) -> None:
    with (
        log_path.open("w") as log,
        contextlib.redirect_stdout(StepLog(log, terminal, root, iterations, log_path)),
        warnings.catch_warnings(),
    ):
        # Expected here: the Kubernetes settings are no-ops and the images are not used.
        warnings.filterwarnings("ignore", ".*have no effect in the current local runner")
        warnings.filterwarnings("ignore", "You may be attemping to run a task")
        pipeline(**parameters)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``values`` in this process's environment (which the steps inherit) for the block."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _collect(run: LocalRun, run_dir: Path, seconds: float, log: Path) -> LocalResult:
    """Find the artifacts of the run in KFP's folder and link the useful ones by name."""
    rollouts = []
    for metrics in run_dir.glob("*/iterate*/trees/metrics.json"):  # one loop folder each
        rollouts.append((json.loads(metrics.read_text()), metrics.parent / "trees.parquet"))
    rollouts.sort(key=lambda pair: pair[0]["iteration"])
    if not rollouts:
        raise FileNotFoundError(f"{run_dir}: no rollout step wrote trees")
    mine = run.output / (run.params.run_name or "pipeline")
    trees_dir = mine / "trees"
    trees_dir.mkdir(parents=True, exist_ok=True)
    links = []
    for metrics, path in rollouts:  # earlier runs' iterations keep their links
        link = trees_dir / f"iteration-{int(metrics['iteration']):04d}.parquet"
        links.append(_link(link, path))
    # Copies, with their extensions, so that a browser renders them (KFP's files have none).
    html = _copy(_only(run_dir.glob("*/tree_view")), mine / "report.html")
    summary = _copy(_only(run_dir.glob("*/summary")), mine / "summary.md")
    # The start policy's evaluation is at the iteration the run started from, the final one K later.
    evals = [_task_output(task) for name in ("open-session", "close-session")
             for task in run_dir.glob(f"{name}*")]  # fmt: skip
    if len(evals) != 2:
        raise FileNotFoundError(f"{run_dir}: expected the open and close session steps' output")
    start_eval, final_eval = evals
    metrics = [m for m, _ in rollouts]
    curves = plot_curves(run.params.strategy, start_eval, final_eval, metrics, mine / "curves.png")
    return LocalResult(
        run_dir, links, trees_dir, html, summary, start_eval, final_eval, metrics, seconds, log,
        curves, str(run.parameters()["store_uri"]),
    )  # fmt: skip


def plot_curves(
    strategy: str,
    start_eval: dict[str, object],
    final_eval: dict[str, object],
    rollouts: list[dict[str, float]],
    path: Path,
) -> Path:
    """The loop's plot (``train.loop.plot_run``) for this run: held-out accuracy before and
    after, each iteration's prompt effective ratio, against generated rollout tokens."""
    from trace_core.train.loop import plot_run
    from trace_core.train.record import IterationRecord

    start_iteration = int(start_eval["iteration"])  # type: ignore[call-overload]
    records = [IterationRecord(start_iteration, strategy, 0, 0, {}, {}, start_eval, {})]
    for metrics in rollouts:
        tokens = int(metrics["tokens"])
        final = final_eval if metrics is rollouts[-1] else None
        total = records[-1].total_tokens + tokens
        iteration = int(metrics["iteration"])
        records.append(IterationRecord(iteration, strategy, tokens, total, metrics, {}, final, {}))
    plot_run(records, path)
    return path


def _only(paths: object) -> Path:
    found = list(paths)  # type: ignore[call-overload]
    if len(found) != 1:
        raise FileNotFoundError(f"expected one report artifact, found {found}")
    return Path(found[0])


def _link(link: Path, target: Path) -> Path:
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))
    return link


def _copy(source: Path, target: Path) -> Path:
    """``source`` copied to ``target`` whole (written beside it, then renamed)."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.copyfile(source, partial)
    partial.replace(target)
    return target


def _size(n: float) -> str:
    """Bytes a person reads: "0 B", "912 kB", "1.4 MB", "16.4 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def cli_command() -> str:
    """How to call this environment's ``trace-rl`` from the current folder: by name when it is
    the one on PATH, else by its path (``.venv/bin/trace-rl`` after ``make run``)."""
    script = Path(sys.executable).parent / "trace-rl"
    found = shutil.which("trace-rl")
    if found and Path(found).resolve() == script.resolve():
        return "trace-rl"
    absolute = script.absolute()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def _first_tree_id(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.read_table(path, columns=["tree_id"]).column(0)[0].as_py())


def _task_output(task_dir: Path) -> dict[str, object]:
    """The string a step returned (its ``Output`` parameter), read from KFP's executor output."""
    body = json.loads((task_dir / "executor_output.json").read_text())
    value = body["parameterValues"]["Output"]
    return dict(json.loads(value))


def print_result(result: LocalResult, say: Callable[[str], None] = print) -> None:
    """Where things are, what the run learnt, and how to look at the trees."""
    from trace_core.train.evaluate import paired_change

    k = result.final_eval.get("k", 0)
    say(f"\npipeline finished in {result.seconds:.0f} s; its artifacts: {result.run_dir}")
    say(f"log: {result.log} (every step's output)")
    for metrics, path in zip(result.rollout, result.trees, strict=True):
        remote = "s3_bytes" in metrics and result.store.startswith("s3://")
        moved = f", S3 {_size(metrics['s3_bytes'])}" if remote else ""
        if remote and metrics.get("checkpoint_bytes"):  # the checkpoints this step committed
            moved += f" and checkpoints {_size(metrics['checkpoint_bytes'])}"
        say(
            f"  iteration {int(metrics['iteration'])}: prompt effective ratio "
            f"{metrics['prompt_effective_ratio']:.2f}, mixed groups {metrics['mixed_groups']:.0f}, "
            f"{metrics['tokens']:,.0f} tokens{moved} → {path}"
        )
    for label, report in (("start", result.start_eval), ("final", result.final_eval)):
        pass1, mean_k = report["pass1"], report["mean_k"]
        assert isinstance(pass1, dict) and isinstance(mean_k, dict)
        sampled = f", mean@{k} {mean_k['all']:.3f}" if mean_k else ""
        parsed = report.get("parse_rate")
        parsed_text = f", action parse rate {parsed:.3f}" if isinstance(parsed, float) else ""
        say(f"  held-out accuracy ({label}): pass@1 {pass1['all']:.3f}{sampled}{parsed_text}")
    pass1 = paired_change(result.start_eval, result.final_eval, "pass1")
    if pass1 is not None:
        mean_k = paired_change(result.start_eval, result.final_eval, "mean_k")
        sampled = f", mean@{k} {mean_k.text()}" if mean_k is not None else ""
        say(
            f"  change (final − start, each of the {pass1.tasks} tasks against itself, 95% "
            f"interval): pass@1 {pass1.text()}{sampled}; an interval holding 0 shows no change"
        )
    if "checkpoint" in result.final_eval:
        say(f"  checkpoint: {result.final_eval['checkpoint']}")
    say(f"trees: {result.trees_dir}")
    say(f"report: {result.report_html} (tree view), {result.summary_md} (summary)")
    if result.curves is not None:
        say(f"plot: {result.curves} (held-out accuracy and prompt effective ratio vs tokens)")
    cli = cli_command()
    say("inspect them with:")
    say(f"  {cli} inspect summary {result.trees_dir}")
    say(f"  {cli} inspect show {result.trees[-1]} {_first_tree_id(result.trees[-1])}")
    say(f"  {cli} inspect html {result.trees[-1]}")
