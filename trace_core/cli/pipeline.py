"""The pipeline: compile, upload, run and schedule it on KFP (``trace-rl pipeline ...``), write
its Argo manifests, run it here through KFP's local runner (``trace-rl run-local``), and run one
of its steps (``trace-rl step``, what an Argo container or a Ray job runs).

    trace-rl pipeline compile && trace-rl pipeline upload --host http://localhost:8080
    trace-rl run-local --iterations 2 --budget 16
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from pipelines.local import MAKE_RUN, MAKE_RUN_SETTINGS
from trace_core.cli.options import config_options
from trace_core.cli.output import console, expected_errors, fail
from trace_core.train.contract import PipelineParameters

app = typer.Typer(
    help="The KFP training pipeline: compile, upload, run, schedule, runs; `argo` writes the "
    "Argo WorkflowTemplate and CronWorkflow. The server comes from --host or KFP_HOST, a token "
    "from KFP_TOKEN (never printed)."
)

KfpHost = Annotated[
    str | None,
    typer.Option(
        envvar=["KFP_HOST", "KF_PIPELINES_ENDPOINT"],
        help="KFP API endpoint, e.g. http://localhost:8080 (env KFP_HOST).",
    ),
]
KfpToken = Annotated[
    str | None,
    typer.Option(
        envvar="KFP_TOKEN",
        help="Bearer token; prefer the KFP_TOKEN variable (flags show in `ps`). Never printed.",
    ),
]
KfpNamespace = Annotated[
    str | None,
    typer.Option(envvar="KFP_NAMESPACE", help="Profile namespace (multi-user KFP only)."),
]
PackagePath = Annotated[
    Path | None,
    typer.Option(
        "--package", help="Compiled pipeline YAML; default: pipelines/compiled/trace_training.yaml."
    ),
]
PipelineName = Annotated[
    str | None, typer.Option(help="Pipeline name on the server; default: the package's name.")
]
RunName = Annotated[
    str,
    typer.Option(
        help="The run_name parameter: the checkpoint run to start or resume from `latest`."
    ),
]
Params = Annotated[
    list[str] | None,
    typer.Option("--param", help="KEY=VALUE pipeline parameter (repeat), typed by the package."),
]
Experiment = Annotated[str, typer.Option(help="KFP experiment (created if missing).")]
StepImage = Annotated[
    str | None,
    typer.Option(
        "--image", help="The CPU steps' image; default: TRACE_IMAGE of components/images.env."
    ),
]
GpuStepImage = Annotated[
    str | None,
    typer.Option(
        "--gpu-image",
        help="rollout's, update's and evaluate's image; default: TRACE_GPU_IMAGE of "
        "components/images.env.",
    ),
]
PullSecrets = Annotated[
    list[str] | None,
    typer.Option(
        "--image-pull-secret",
        help="Secret the step pods pull their images with (private registry; repeat), in the "
        "namespace the steps run in.",
    ),
]


if TYPE_CHECKING:
    from pipelines.client import Package, Server


def _submission(
    host: str | None, token: str | None, namespace: str | None, package: Path | None
) -> tuple[Server, Package]:
    from pipelines.client import DEFAULT_PACKAGE, Server, read_package

    return Server.from_env(host, token, namespace), read_package(package or DEFAULT_PACKAGE)


@app.command("compile")
def pipeline_compile(
    output: Annotated[
        Path | None,
        typer.Option(help="Where to write the IR YAML; default: pipelines/compiled/."),
    ] = None,
    iterations: Annotated[
        int,
        typer.Option(help="The run parameter iterations' default.", min=1),
    ] = 4,
    s3_endpoint: Annotated[
        str,
        typer.Option(
            help="AWS_ENDPOINT_URL_S3 of every step: your cluster's S3 or MinIO service "
            "(empty: leave the variable to the cluster)."
        ),
    ] = "http://seaweedfs.kubeflow.svc.cluster.local:8333",
    ray_jobs_url: Annotated[
        str,
        typer.Option(
            help="The run parameter ray_jobs_url's default: the Ray head's dashboard the steps "
            "submit to (the kfp overlay's RayCluster); empty: no cluster unless a run names one."
        ),
    ] = "http://trace-rl-head-svc.trace-rl.svc.cluster.local:8265",
    store_uri: Annotated[
        str,
        typer.Option(
            help="The run parameter store_uri's default: the s3:// prefix runs keep their "
            "checkpoints and trees under (KFP's bucket, a prefix a profile may write)."
        ),
    ] = "s3://mlpipeline/shared/trace-rl",
    run_store_endpoint: Annotated[
        str,
        typer.Option(
            help="An S3 endpoint of the runs' own for --store-uri's bucket (checkpoints, "
            "scratch), KFP's artifacts staying on KFP's store; its keys come from "
            "--run-store-secret. Empty: the runs use --s3-endpoint too."
        ),
    ] = "",
    run_store_secret: Annotated[
        str,
        typer.Option(
            help="The Secret with the run store's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."
        ),
    ] = "trace-store",
    image: StepImage = None,
    gpu_image: GpuStepImage = None,
    image_pull_secrets: PullSecrets = None,
) -> None:
    """Compile the training pipeline to KFP IR YAML (what `upload` and the KFP UI take). The
    iteration count, the steps' S3 endpoint, their images and pull secrets are fixed here; the
    Ray cluster and the store are the defaults of run parameters of the same names."""
    from pipelines.client import DEFAULT_PACKAGE, read_package
    from pipelines.trace_training import PipelineOptions, compile_pipeline

    try:
        options = PipelineOptions(
            iterations=iterations,
            s3_endpoint=s3_endpoint,
            ray_jobs_url=ray_jobs_url,
            store_uri=store_uri,
            run_store_endpoint=run_store_endpoint,
            run_store_secret=run_store_secret,
            **_images(image, gpu_image, image_pull_secrets),
        )
    except ValueError as err:
        raise fail(f"pipeline compile: {err}") from None
    output = output or DEFAULT_PACKAGE
    output.parent.mkdir(parents=True, exist_ok=True)
    compile_pipeline(output, options)
    package = read_package(output)
    console.print(
        f"compiled {package.name} ({len(package.parameters)} parameters: "
        f"{', '.join(sorted(package.parameters))}) to {output}"
    )


@app.command("upload")
def pipeline_upload(
    package_path: PackagePath = None,
    name: PipelineName = None,
    version: Annotated[
        str | None, typer.Option(help="Version name; default: UTC time + the package's hash.")
    ] = None,
    description: Annotated[str | None, typer.Option(help="Shown in the KFP UI.")] = None,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """Upload the compiled pipeline; if its name exists on the server, as a new version."""
    from pipelines.client import SubmitError, connect, upload

    with expected_errors(SubmitError):
        server, package = _submission(host, token, namespace, package_path)
        made = upload(connect(server), server, package, name, version, description)
    what = "new pipeline" if made.new_pipeline else "new version"
    console.print(f"{what} {name or package.name!r}: version {made.version_name!r}")
    console.print(f"  pipeline id {made.pipeline_id}, version id {made.version_id}")
    console.print(f"  {server.host}/#/pipelines/details/{made.pipeline_id}")


@app.command("run")
def pipeline_run(
    run_name: RunName,
    param: Params = None,
    pipeline: PipelineName = None,
    version: Annotated[
        str | None, typer.Option(help="Version name to run; default: the newest.")
    ] = None,
    experiment: Experiment = "trace-rl",
    display_name: Annotated[
        str | None, typer.Option(help="Run name in the UI; default: RUN_NAME-<UTC time>.")
    ] = None,
    package_path: PackagePath = None,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """Start one run of an uploaded pipeline version with parameters."""
    from pipelines.client import SubmitError, build_params, connect, resolve, run

    with expected_errors(SubmitError):
        server, package = _submission(host, token, namespace, package_path)
        params = build_params(package, param or [], run_name)
        client = connect(server)
        target = resolve(client, server, pipeline or package.name, version)
        made = run(client, server, target, params, experiment, display_name)
    console.print(
        f"started run {made.display_name!r} (id {made.id}) of version {target.version_name!r}"
    )
    console.print(f"  parameters: {json.dumps(params, sort_keys=True)}")
    console.print(f"  {made.url}")


@app.command("schedule")
def pipeline_schedule(
    run_name: RunName,
    cron: Annotated[
        str, typer.Option(help="6-field cron, seconds first: '0 0 3 * * *' is 03:00 daily.")
    ],
    param: Params = None,
    name: Annotated[
        str | None, typer.Option(help="Recurring run name; default: RUN_NAME-schedule.")
    ] = None,
    max_concurrency: Annotated[
        int, typer.Option(help="Runs at once (1: a run never overlaps the one resuming it).")
    ] = 1,
    catchup: Annotated[
        bool, typer.Option(help="Backfill every missed slot after a pause (default: only one).")
    ] = False,
    pipeline: PipelineName = None,
    version: Annotated[
        str | None, typer.Option(help="Version name to schedule; default: the newest.")
    ] = None,
    experiment: Experiment = "trace-rl",
    package_path: PackagePath = None,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """A recurring run: each run resumes RUN_NAME from its latest checkpoint."""
    from pipelines.client import SubmitError, build_params, check_cron, connect, resolve, schedule

    with expected_errors(SubmitError):
        cron = check_cron(cron)
        server, package = _submission(host, token, namespace, package_path)
        params = build_params(package, param or [], run_name)
        client = connect(server)
        target = resolve(client, server, pipeline or package.name, version)
        made = schedule(
            client,
            server,
            target,
            cron,
            params,
            name or f"{run_name}-schedule",
            experiment,
            max_concurrency=max_concurrency,
            no_catchup=not catchup,
        )
    console.print(
        f"scheduled {made.display_name!r} (id {made.id}): cron {cron!r}, "
        f"max concurrency {max_concurrency}, catch-up {'on' if catchup else 'off'}; "
        f"each run resumes {run_name!r} from its latest checkpoint"
    )
    console.print(
        f"  version {target.version_name!r}; parameters: {json.dumps(params, sort_keys=True)}"
    )
    console.print(f"  {made.url}")


@app.command("runs")
def pipeline_runs(
    experiment: Annotated[
        str | None, typer.Option(help="Only this experiment's runs; default: all.")
    ] = None,
    limit: Annotated[int, typer.Option(help="How many of the newest runs.")] = 20,
    host: KfpHost = None,
    token: KfpToken = None,
    namespace: KfpNamespace = None,
) -> None:
    """The newest runs: id, name, state, created, the run_name they train, schedule."""
    from pipelines.client import Server, SubmitError, connect, runs

    with expected_errors(SubmitError):
        server = Server.from_env(host, token, namespace)
        rows = runs(connect(server), server, experiment, limit)
    table = Table(title=f"runs on {server.host}" + (f" · {experiment}" if experiment else ""))
    for head in ("run id", "name", "state", "created", "run_name", "recurring run"):
        table.add_column(head)
    for r in rows:
        table.add_row(
            r.run_id, r.display_name, r.state, r.created_at, r.run_name, r.recurring_run_id
        )
    console.print(table)


@app.command("argo")
def pipeline_argo(
    output_dir: Annotated[
        Path | None, typer.Option(help="Folder to write; default: manifests/argo/.")
    ] = None,
    iterations: Annotated[
        int, typer.Option(help="The workflow parameter iterations' default.", min=1)
    ] = 4,
    gpus: Annotated[
        int,
        typer.Option(
            help="GPUs of each rollout, update and evaluate pod (0 with a Ray cluster: the "
            "steps only submit Ray jobs).",
            min=0,
        ),
    ] = 1,
    image: StepImage = None,
    gpu_image: GpuStepImage = None,
    image_pull_secrets: PullSecrets = None,
) -> None:
    """Write the Argo WorkflowTemplate and CronWorkflow (same steps, no KFP) and kustomization."""
    from pipelines.argo import DEFAULT_DIR, ArgoOptions, write_manifests

    try:
        options = ArgoOptions(
            iterations=iterations, gpus=gpus, **_images(image, gpu_image, image_pull_secrets)
        )
    except ValueError as err:
        raise fail(f"pipeline argo: {err}") from None
    for path in write_manifests(output_dir or DEFAULT_DIR, options):
        console.print(f"wrote {path}")


@config_options(PipelineParameters, defaults=dataclasses.asdict(MAKE_RUN))
def run_local_command(
    params: PipelineParameters,
    output: Annotated[Path, typer.Option(help="Artifacts, links and the registry go here.")] = Path(
        "runs"
    ),
    s3_endpoint: Annotated[
        str, typer.Option(help="AWS_ENDPOINT_URL_S3 for the steps; default: the environment's.")
    ] = "",
) -> None:
    """The training pipeline through KFP's local runner: the same components as on a cluster.
    ``--settings-json`` fields go over make run's (prompts, eval_tasks, eval_k, warmstart_steps;
    with --base-model-uri, the warm start's steps are the pretrained default)."""
    from pipelines.local import LocalRun, print_result, run_local
    from trace_core.train.config import PRETRAINED

    with expected_errors(RuntimeError):  # a bad setting, or a step that failed
        settings = json.loads(params.settings_json or "{}")
        if not isinstance(settings, dict):
            raise ValueError("--settings-json must be a JSON object")
        defaults = dict(MAKE_RUN_SETTINGS)
        if params.base_model_uri:  # a base model's warm start is PRETRAINED's, not make run's
            defaults = {k: v for k, v in defaults.items() if k not in PRETRAINED}
        merged = {**defaults, **settings}
        run = LocalRun(output, replace(params, settings_json=json.dumps(merged)), s3_endpoint)
        result = run_local(run, say=console.print)
    print_result(result, say=lambda line: console.print(line, highlight=False, soft_wrap=True))


def step_command(
    step: Annotated[
        str,
        typer.Argument(
            help="prep, warmstart, load, open-session, iterate, close-session or report.",
            show_default=False,
        ),
    ],
    iteration: Annotated[int, typer.Option(help="Training iteration (from 1; 0 outside).")] = 0,
    config_json: Annotated[
        str, typer.Option(help="The pipeline's config JSON (prep's output; not for prep).")
    ] = "",
    inputs: Annotated[
        list[str] | None,
        typer.Option("--input", help="NAME=PATH_OR_URI of an input folder (repeat)."),
    ] = None,
    outputs: Annotated[
        list[str] | None,
        typer.Option("--output", help="NAME=PATH_OR_URI of an output folder (repeat)."),
    ] = None,
    params: Annotated[
        list[str] | None,
        typer.Option("--param", help="prep only: NAME=VALUE of a run parameter (repeat)."),
    ] = None,
) -> None:
    """One pipeline step on folders or s3:// prefixes: what an Argo container or a Ray job runs."""
    from trace_core.train.dispatch import execute_cli_step

    def pairs(items: list[str], flag: str, empty: bool = False) -> dict[str, str]:
        """NAME=VALUE items; a run parameter may be empty (``dataset_uri=``), a folder not."""
        found = {}
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or not name or not (value or empty):
                raise ValueError(f"{flag} {item!r}: expected NAME=VALUE")
            found[name] = value
        return found

    if step != "prep" and not config_json:
        raise ValueError(f"step {step} needs --config-json (prep's config.json)")
    written = pairs(outputs or [], "--output")
    execute_cli_step(
        step,
        iteration,
        pairs(inputs or [], "--input"),
        written,
        config_json,
        pairs(params or [], "--param", empty=True),
    )
    console.print(f"{step} {iteration}: wrote {', '.join(written.values())}")


def _images(
    image: str | None, gpu_image: str | None, pull_secrets: list[str] | None
) -> dict[str, object]:
    """The image options ``pipeline compile`` and ``pipeline argo`` share: a flag, else the
    setting in ``components/images.env``."""
    from components.images import image as image_of

    return {
        "image": image or image_of("TRACE_IMAGE"),
        "gpu_image": gpu_image or image_of("TRACE_GPU_IMAGE"),
        "image_pull_secrets": tuple(pull_secrets or ()),
    }
