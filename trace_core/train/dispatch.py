"""Running a step: here, as a Ray job, or from the command line (``trace-rl step``).

    run_step(StepCall("iterate", 3, inputs, outputs), config)   # a KFP component's call
    iterate_on_store(config, 3, prompts, trees)   # the iterate component: state via the store
    execute_cli_step("iterate", 3, {"state": "s3://b/s", ...}, {"trees": ..., "state": ...}, cfg)

A step's folders may be local paths or s3:// prefixes: remote inputs are downloaded into a
scratch folder first, remote outputs written there and uploaded once the step has succeeded.
Open session's policy, predictor and optimizer are not: the session's actors read them where
they lie, at the URIs the load step's references name (``start_point``): a KFP pod that only
submits the step as a Ray job (``ray_jobs_url``) holds those references, never the weights.
The steps themselves are ``train.steps``; their folders and config are ``train.contract``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_core.store.uri import is_remote
from trace_core.train.contract import (
    CONFIG_FILE,
    EVAL_FILE,
    RAY_STEPS,
    PipelineConfig,
    StepCall,
    check_step_folders,
    in_ray_job,
    parse_parameters,
    read_metrics,
)
from trace_core.train.steps.finish import report_step
from trace_core.train.steps.start import load_step, prep_step, warmstart_step

if TYPE_CHECKING:
    from trace_core.train.steps.session import StartPoint


def run_step(call: StepCall, config: PipelineConfig) -> dict[str, float]:
    """Run ``call`` here, or as a Ray job when the config has a Ray dashboard address; either
    way its outputs end up in the local output folders and its metrics are returned."""
    if config.ray_jobs_url:
        from trace_core.train.rayjob import submit_step

        submit_step(call, config)
    else:
        execute_step(call, config)
    return read_metrics(Path(next(iter(call.outputs.values()))))


def iterate_on_store(
    config: PipelineConfig, iteration: int, prompts: Any, trees: Any
) -> dict[str, float]:
    """The iterate component's body: iteration ``iteration`` from the state the one before
    published, its trees into the KFP artifact ``trees`` (``.path``, ``.uri``; likewise
    ``prompts``), its state published. Its figures, as the step's metrics."""
    from trace_core.train.steps.finish import record_trees
    from trace_core.train.steps.handoff import done_before, publish, state_uri

    before, after = state_uri(config, iteration - 1), state_uri(config, iteration)
    figures = done_before(after, iteration, Path(trees.path))
    if figures is not None:
        return figures
    with tempfile.TemporaryDirectory(prefix="trace-iterate-") as scratch:
        new_state = Path(scratch, "state")
        call = StepCall(
            "iterate",
            iteration,
            {"prompts": prompts.path, "state": before},
            {"trees": trees.path, "state": str(new_state)},
            input_uris={"prompts": prompts.uri, "state": before},
        )
        figures = run_step(call, config)
        # Where this iteration's trees land, beside the earlier ones': the report shows all.
        record_trees(before, new_state, iteration, trees.uri)
        publish(new_state, after)
    return figures


def execute_step(call: StepCall, config: PipelineConfig) -> None:
    """Run ``call`` (a step on the run's session) in this process: only its small folders
    (prompts, state) are fetched; the starting policy, predictor and optimizer state are read
    where they lie, by the actors (``start_point``); the outputs are published once the step
    has succeeded."""
    from trace_core.train.steps.session import (
        close_session_step,
        iterate_step,
        open_session_step,
    )
    from trace_core.train.steps.tracked import marks_failed

    fetched = {name: uri for name, uri in call.inputs.items() if name in ("prompts", "state")}
    with (
        _staged(call.step, fetched, call.outputs) as (local, out),
        marks_failed(config, local.get("state")),  # with MLflow: the run FAILED, if this fails
    ):
        match call.step:
            case "open-session":
                open_session_step(config, local["prompts"], start_point(call), out["state"])
            case "iterate":
                where = call.input_uris.get("state") or call.inputs["state"]
                iterate_step(
                    config,
                    call.iteration,
                    local["prompts"],
                    local["state"],
                    out["state"],
                    out["trees"],
                    state_uri=where,
                )
            case "close-session":
                close_session_step(config, local["state"], out["result"])


def start_point(call: StepCall) -> StartPoint:
    """Where open-session's ``call`` starts: for each of its policy, predictor and optimizer
    inputs, the folder its ``reference.json`` names (the load step's: the base model, or a
    registry checkpoint's folders), else the input itself (the warm start's folders), at its
    object-storage URI when it has one (a KFP artifact's, which actors on any node read).
    ``file://`` becomes a path. A reference of another iteration than the call's is refused.

    Nothing is downloaded: a reference is read where the step was given the input (a KFP
    pod's local copy, else one small object)."""
    from trace_core.store.reference import REFERENCE, plain, read_reference
    from trace_core.train.steps.session import StartPoint

    where: dict[str, str] = {}
    for name in ("policy", "predictor", "optimizer"):
        given = call.inputs[name]
        reference = read_reference(given)
        if reference is None:
            where[name] = plain(call.input_uris.get(name) or given)
            continue
        if reference.iteration != call.iteration:
            raise ValueError(
                f"{given}/{REFERENCE}: a start after iteration {reference.iteration}, but "
                f"open-session starts after iteration {call.iteration} (start_iteration): "
                "run prep and load again"
            )
        where[name] = reference.uri
    return StartPoint(where["policy"], where["predictor"], where["optimizer"], call.iteration)


@contextlib.contextmanager
def _staged(
    step: str,
    inputs: Mapping[str, str],
    outputs: Mapping[str, str],
) -> Iterator[tuple[dict[str, Path], dict[str, Path]]]:
    """Local folders for a step's folders. s3:// inputs are downloaded into a scratch folder.
    Outputs are written to fresh folders and published once the step has succeeded: uploaded
    (s3://), or renamed into place (a local folder). A step that fails leaves no output
    behind, and never writes into a folder or prefix that already holds something."""
    from trace_core.store.sync import download_folder, upload_folder

    for name, uri in outputs.items():
        if _holds_files(uri):
            raise FileExistsError(
                f"step {step}: output {name}={uri} already holds files; a step writes a "
                "fresh folder: remove it or choose another"
            )
    with tempfile.TemporaryDirectory(prefix=f"trace-{step}-") as scratch:
        local: dict[str, Path] = {}
        for name, uri in inputs.items():
            local[name] = Path(scratch, "in", name) if is_remote(uri) else Path(uri)
            if is_remote(uri):
                download_folder(uri, local[name])
            elif not local[name].is_dir():
                raise FileNotFoundError(f"step {step}: input {name}={uri}: no such folder")
        out, fresh = {}, []
        for name, uri in outputs.items():
            if is_remote(uri):
                out[name] = Path(scratch, "out", name)
            else:  # beside the target, so that publishing it is one rename
                Path(uri).parent.mkdir(parents=True, exist_ok=True)
                out[name] = Path(
                    tempfile.mkdtemp(prefix=f".{Path(uri).name}.", dir=Path(uri).parent)
                )
                fresh.append(out[name])
            out[name].mkdir(parents=True, exist_ok=True)
        try:
            yield local, out
            for name, uri in outputs.items():
                if is_remote(uri):
                    upload_folder(out[name], uri)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        Path(uri).rmdir()  # empty (checked above)
                    out[name].rename(uri)
        finally:
            for folder in fresh:  # gone once published; a failed step's half output
                shutil.rmtree(folder, ignore_errors=True)


def _holds_files(uri: str) -> bool:
    """Whether an output folder or prefix is taken (a missing bucket is an error here)."""
    if is_remote(uri):
        from trace_core.store.artifacts import open_store

        return bool(open_store(uri).list_objects(""))
    target = Path(uri)
    return target.exists() and (not target.is_dir() or any(target.iterdir()))


def execute_cli_step(
    step: str,
    iteration: int,
    inputs: Mapping[str, str],
    outputs: Mapping[str, str],
    config_json: str = "",
    params: Mapping[str, str] | None = None,
) -> None:
    """Run any step on folders or s3:// prefixes. ``prep`` takes the run parameters
    (``params``, as the UI gives them: strings) and writes ``config.json``, ``start`` and
    ``start_iteration`` into its ``result`` folder; every other step takes the config JSON."""
    check_step_folders(step, inputs, outputs)
    # Everything is validated before a folder is made or a file fetched.
    parameters = parse_parameters(params or {}) if step == "prep" else None
    config = None if step == "prep" else PipelineConfig.from_json(config_json)
    if config is not None and step in RAY_STEPS:
        call = StepCall(step, iteration, inputs, outputs)
        if config.ray_jobs_url and not in_ray_job(config):
            # A step of a run with a Ray dashboard address, outside a Ray job (an Argo
            # container): sent to the cluster, as the KFP components send theirs.
            from trace_core.train.rayjob import submit_step

            remote = {name: uri for name, uri in inputs.items() if is_remote(uri)}
            submit_step(replace(call, input_uris=remote), config)
        else:
            execute_step(call, config)
        return
    with _staged(step, inputs, outputs) as (local, out):
        if parameters is not None:
            result = prep_step(parameters, out["prompts"])
            (out["result"] / CONFIG_FILE).write_text(result.config_json)
            (out["result"] / "start").write_text(result.start)
            (out["result"] / "start_iteration").write_text(str(result.start_iteration))
        else:
            assert config is not None
            match step:
                case "warmstart":
                    warmstart_step(config, out["policy"], out["predictor"], out["optimizer"])
                case "load":
                    load_step(config, out["policy"], out["predictor"], out["optimizer"])
                case "report":
                    start, final = (
                        json.loads((local[name] / EVAL_FILE).read_text())
                        for name in ("start_eval", "final_eval")
                    )
                    report_step(
                        config, local["trees"], local["state"], start, final,
                        out["report"] / "report.html", out["report"] / "summary.md",
                    )  # fmt: skip
