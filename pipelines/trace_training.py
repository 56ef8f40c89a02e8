"""The TRACE training pipeline for Kubeflow Pipelines: the DAG, its cluster settings, compiling.

    prep ─► schedule ─► If start == warmstart: warmstart ─► open-session ─► iterations:
                        Else:                   load      ─►   [ iterate ] one per iteration,
                                                               in order ─► close-session ─► report

    python -m pipelines.trace_training pipelines/compiled/trace_training.yaml   # compile
    compile_pipeline(Path("x.yaml"), PipelineOptions(iterations=8))              # from code

The run lives in its **session** on the Ray cluster (``trace_core.train.steps.session``): open
session starts the trainer actors (they hold the policy, AdamW's state and the reference for
the whole run) and the engine actors, and evaluates the starting policy; each iteration step
finds them by name and runs one iteration (rollout → fit ∥ update → weight broadcast →
checkpoint every ``checkpoint_every`` → evaluation every ``eval_every``), and hands on only a
small state (log, predictor, where the newest checkpoint is, with ``max_staleness`` >= 1 the
trees grown ahead) through the store (``trace_core.train.steps.handoff``); close session stops
the actors. Without a Ray cluster each step starts Ray in its own process and the state goes
through a checkpoint every iteration.

The iterations are one ``iterate`` task in a ``ParallelFor`` of parallelism 1 over the list
``schedule`` makes of them, so the number of iterations is a run parameter (``iterations``),
and so is ``max_staleness``; the DAG is the same size for any number. Each iteration reads the
state the one before published and publishes its own, whole or not at all; an iteration run
again after it committed (a retried pod) hands on what it wrote. Every run parameter is set in
the KFP UI: task, dataset_uri, retriever_url (a retrieval service http://HOST:PORT that multihop
and hotpotqa search; empty: their in-process index), base_model_uri, strategy, budget (M),
continuations (N), iterations, max_staleness, seed, checkpoint_every, keep_checkpoints (how
many of the run's newest checkpoints the registry keeps), ray_address (the Ray head's GCS
address HOST:6379 the steps connect to), ray_jobs_url (a dashboard http://HEAD:8265
to submit the Ray steps to as Ray jobs instead), the rollout engine (engine: torch, hf or vllm;
rollout_workers: Ray engine actors; gpus_per_worker: the GPUs each asks for), run_name (resume
from / register under this name), store_uri, settings_json (any other ``TrainConfig`` field, as
JSON), mlflow_tracking_uri (an MLflow server the run logs its config, figures, report and plots
to), the GPU pods' request and placement (gpus, accelerator, gpu_node_selector,
gpu_node_affinity, gpu_tolerations) and the Secrets (s3_secret, ray_auth_secret).

Why both branches hold the session: KFP's local runner resolves ``dsl.OneOf`` only for
parameters, not for the policy and predictor artifacts, and the local run must be this same
pipeline; so the warm-start branch and the load branch each open, iterate, close and report
(the UI shows the one that ran).

Cluster settings:
- open session and the iterations request ``gpus`` accelerators of type ``accelerator`` and
  take the node selector, node affinity and tolerations given at run time; the affinity's
  default asks for a GPU node whose NVIDIA driver runs the GPU image's CUDA 13 (R580 or newer,
  ``components.images.gpu_node_affinity``). They use TRACE_GPU_IMAGE, the other
  steps TRACE_IMAGE (``components/images.env``). With a Ray cluster the GPUs are the cluster's: run
  with gpus=0 then. The steps that use Ray get RAY_AUTH_TOKEN from the Secret
  ``ray_auth_secret`` (key auth_token, optional), which a token-auth cluster needs, and
  RAY_AUTH_MODE=token, without which Ray's clients send no token (``rollout.ray_auth``).
- every step gets AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the Secret ``s3_secret``
  (kfp-kubernetes ``use_secret_as_env``, optional, KFP's own ``mlpipeline-minio-artifact`` by
  default) and AWS_ENDPOINT_URL_S3 from ``PipelineOptions.s3_endpoint``; with a run store
  (``PipelineOptions.run_store_endpoint``), its endpoint, bucket and the keys of its Secret as
  TRACE_STORE_* too (``trace_core.store.s3_settings``).
- caching is off for every step but warmstart, schedule and report (pure functions of their
  inputs): prep and load read the registry, the session's steps act on actors and write
  checkpoints.
"""

import ast
import contextlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kfp import compiler, dsl, kubernetes
from kfp.dsl import PipelineTask

from components import (
    close_session,
    iterate,
    load,
    open_session,
    prep,
    release_session,
    report,
    schedule,
    warmstart,
)
from components.cluster import DEFAULT_S3_ENDPOINT, DEFAULT_STORE_URI
from components.images import check_images, gpu_node_affinity
from components.images import image as image_of
from trace_core.rollout.ray_auth import CLIENT_ENV, SECRET_KEY, TOKEN_ENV
from trace_core.store.s3_settings import RUN_STORE, RUN_STORE_BUCKET

PIPELINE_NAME = "trace-training"
COMPILED = Path(__file__).resolve().parent / "compiled" / "trace_training.yaml"
GPU_NODE_AFFINITY = gpu_node_affinity()
"""The run parameter gpu_node_affinity's default without a Ray cluster: GPU nodes whose driver
runs the GPU image."""
RAY_JOBS_URL = "http://trace-rl-head-svc.trace-rl.svc.cluster.local:8265"
"""The dashboard of the RayCluster ``trace-rl`` in namespace ``trace-rl`` (manifests/base):
KubeRay names the head's Service ``<cluster>-head-svc``; 8265 is Ray's job API."""


@dataclass(frozen=True)
class StepResources:
    """A step pod's CPU and memory (Kubernetes quantities): requests, then limits."""

    cpu: str
    memory: str
    cpu_limit: str
    memory_limit: str


STEP_RESOURCES: Mapping[str, StepResources] = {
    # The run parameters → config and prompts: BFCL's 799 tasks and their ground truth in memory.
    "prep": StepResources("500m", "1Gi", "1", "2Gi"),
    # The list of the run's iterations, from the config.
    "schedule": StepResources("100m", "256Mi", "500m", "512Mi"),
    # SFT of the tiny calc policy (0.37 M parameters, ≈ 2.5 min on 2 cores); a base model's warm
    # start (warmstart_init) runs here too: up to SmolLM2-360M in fp32 with AdamW (16 bytes a
    # parameter: 5.8 GB) and activations → 16 Gi. Larger base models warm-start elsewhere.
    "warmstart": StepResources("2", "4Gi", "4", "16Gi"),
    # References, not weights: the base model's tokenizer and config, the predictor (a few MB).
    "load": StepResources("500m", "1Gi", "1", "2Gi"),
    # The session's steps: with a Ray cluster they submit a Ray job and follow its log (an HTTP
    # client: requests); without one, the run's actors live in the pod: the tiny policy's
    # session (2 CPUs, 8 Gi, docs/deploy.md's sizing table) fits the limits.
    "session": StepResources("500m", "1Gi", "2", "8Gi"),
    # The HTML tree view and the summary from the last iteration's trees (one Parquet file).
    "report": StepResources("500m", "1Gi", "1", "4Gi"),
}
"""Every step pod's requests and limits, by step (the session's steps share one entry)."""


@dataclass(frozen=True)
class PipelineOptions:
    """What is fixed when the pipeline is built (everything else is a run parameter)."""

    iterations: int = 4
    """The run parameter iterations' default: rollout → fit/update iterations per run."""
    ray_jobs_url: str = RAY_JOBS_URL
    """The run parameter ray_jobs_url's default: the Ray head the kfp overlay deploys, so a run
    submitted without it trains on the cluster. Empty: runs start without a Ray cluster (each
    step starts Ray in its own pod) unless a run names one. It also sets the GPU defaults: with
    a cluster the GPUs are its workers', so the steps' run parameter ``gpus`` defaults to 0 and
    ``gpu_node_affinity`` to none; without one, to 1 and a GPU node whose driver runs the GPU
    image."""
    store_uri: str = DEFAULT_STORE_URI
    """The run parameter store_uri's default: where runs keep their checkpoints and trees."""
    gpu_requests: bool = True
    """Give open-session and the iterate steps the GPU request of the run parameters ``gpus``
    and ``accelerator``. KFP's local runner cannot resolve run parameters in a resource request
    (and ignores GPU requests anyway): ``run_local`` builds with False, nothing else differs."""
    s3_endpoint: str = DEFAULT_S3_ENDPOINT
    """AWS_ENDPOINT_URL_S3 of every step: KFP's SeaweedFS, at the address every supported KFP
    release serves it on (``components.cluster``); empty: leave the variable alone."""
    s3_secret_keys: Mapping[str, str] = field(
        default_factory=lambda: {
            "accesskey": "AWS_ACCESS_KEY_ID",
            "secretkey": "AWS_SECRET_ACCESS_KEY",
        }
    )
    """Secret key → environment variable (the keys of KFP's mlpipeline-minio-artifact)."""
    run_store_endpoint: str = ""
    """A store of the runs' own for ``store_uri``'s bucket (checkpoints, the session's scratch),
    while KFP's artifacts stay on KFP's store: every step gets ``TRACE_STORE_ENDPOINT_URL``, the
    bucket as ``TRACE_STORE_BUCKET`` and the keys of the Secret ``run_store_secret``
    (``trace_core.store.s3_settings``). Empty: everything on the ``s3_endpoint`` store."""
    run_store_secret: str = "trace-store"
    """The Secret (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, as ``manifests/secrets/s3``)
    with the run store's credentials, in the namespace the steps run in."""
    image: str = field(default_factory=lambda: image_of("TRACE_IMAGE"))
    """The CPU steps' image (default: TRACE_IMAGE of ``components/images.env``)."""
    gpu_image: str = field(default_factory=lambda: image_of("TRACE_GPU_IMAGE"))
    """open-session's and the iterate steps' image (default: TRACE_GPU_IMAGE)."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (type kubernetes.io/dockerconfigjson, in the namespace the steps run in) every
    step pod pulls its image with: for a private registry."""

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.ray_jobs_url and not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", self.ray_jobs_url):
            raise ValueError(
                f"ray_jobs_url {self.ray_jobs_url!r}: expected http(s)://host:port (the Ray "
                "head's dashboard), or empty for no cluster"
            )
        check_images(self.image, self.gpu_image, self.image_pull_secrets)
        if self.store_uri and not self.store_uri.startswith("s3://"):
            raise ValueError(f"store_uri {self.store_uri!r}: expected s3://bucket/prefix")
        for name in ("s3_endpoint", "run_store_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("http://", "https://")):
                raise ValueError(f"{name} {value!r}: expected http(s)://host:port")
        if self.run_store_endpoint and not self.store_uri:
            raise ValueError("run_store_endpoint needs store_uri: its bucket is the run store's")

    def run_store_env(self) -> dict[str, str]:
        """What every step is told of the run store (nothing without one)."""
        if not self.run_store_endpoint:
            return {}
        bucket = self.store_uri.removeprefix("s3://").split("/")[0]
        return {RUN_STORE_BUCKET: bucket, RUN_STORE + "ENDPOINT_URL": self.run_store_endpoint}


# No ``from __future__ import annotations`` here: KFP reads the pipeline function's annotations
# as types, not strings.
def build_pipeline(options: PipelineOptions | None = None) -> Callable[..., object]:
    """The pipeline function (a KFP ``GraphComponent``) for ``options``."""
    opts = options or PipelineOptions()

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description=(
            "TRACE tree-rollout RL: prep, warm start or load, iterations × (rollout → "
            "fit predictor ∥ update policy), evaluate, report."
        ),
    )
    def trace_training(
        task: str = "calc",
        dataset_uri: str = "",
        retriever_url: str = "",
        base_model_uri: str = "",
        strategy: str = "trace",
        budget: int = 128,
        continuations: int = 2,
        iterations: int = opts.iterations,
        max_staleness: int = 1,
        seed: int = 0,
        checkpoint_every: int = 5,
        keep_checkpoints: int = 2,
        ray_address: str = "",
        ray_jobs_url: str = opts.ray_jobs_url,
        engine: str = "torch",
        rollout_workers: int = 0,
        gpus_per_worker: float = 0.0,
        run_name: str = "",
        store_uri: str = opts.store_uri,
        settings_json: str = "{}",
        mlflow_tracking_uri: str = "",
        gpu_node_selector: dict = {},  # noqa: B006 (KFP reads the default; it is never mutated)
        gpu_node_affinity: dict = {} if opts.ray_jobs_url else GPU_NODE_AFFINITY,
        gpu_tolerations: list = [],  # noqa: B006
        gpus: int = 0 if opts.ray_jobs_url else 1,
        accelerator: str = "nvidia.com/gpu",
        s3_secret: str = "mlpipeline-minio-artifact",
        ray_auth_secret: str = "trace-ray-auth",
    ) -> None:
        def place(
            task: PipelineTask, name: str, gpu: bool = False, uses_ray: bool = False
        ) -> PipelineTask:
            task.set_display_name(name)
            # The steps that talk to Ray run the cluster's image: one Python and one Ray.
            task.set_container_image(opts.gpu_image if gpu or uses_ray else opts.image)
            sizes = STEP_RESOURCES["session" if gpu or uses_ray else name]
            task.set_cpu_request(sizes.cpu).set_memory_request(sizes.memory)
            task.set_cpu_limit(sizes.cpu_limit).set_memory_limit(sizes.memory_limit)
            if opts.image_pull_secrets:
                kubernetes.set_image_pull_secrets(task, list(opts.image_pull_secrets))
            kubernetes.use_secret_as_env(task, s3_secret, dict(opts.s3_secret_keys), True)
            if opts.s3_endpoint:
                task.set_env_variable("AWS_ENDPOINT_URL_S3", opts.s3_endpoint)
            if opts.run_store_endpoint:  # the run's checkpoints on a store of their own
                for name, value in opts.run_store_env().items():
                    task.set_env_variable(name, value)
                keys = {f"AWS_{k}": RUN_STORE + k for k in ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY")}
                kubernetes.use_secret_as_env(task, opts.run_store_secret, keys)
            if gpu and opts.gpu_requests:
                task.set_accelerator_type(accelerator).set_accelerator_limit(gpus)
            if gpu:
                kubernetes.add_node_selector_json(task, gpu_node_selector)
                kubernetes.add_node_affinity_json(task, gpu_node_affinity)
                kubernetes.add_toleration_json(task, gpu_tolerations)
            if gpu or uses_ray:  # the Ray token, and the mode without which Ray sends none
                kubernetes.use_secret_as_env(task, ray_auth_secret, {SECRET_KEY: TOKEN_ENV}, True)
                for name, value in CLIENT_ENV.items():
                    task.set_env_variable(name, value)
            return task

        # The exit handler's task runs however the run ends: after report, after a failed
        # step, on a cancel. It can take no task's output, so it finds the session by the name
        # prep gives it (run_name and the KFP run's id) and frees what the run still holds: its
        # Ray jobs, its trainer and engine actors and their GPUs, and its scratch in the store
        # (the session's folder, its Ray jobs' staging).
        released = place(
            release_session(
                run_name=run_name,
                ray_address=ray_address,
                ray_jobs_url=ray_jobs_url,
                store_uri=store_uri,
                pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            ),
            "release-session",
            uses_ray=True,
        ).set_caching_options(False)
        with dsl.ExitHandler(released, name="run"):
            prepped = place(
                prep(
                    task=task,
                    dataset_uri=dataset_uri,
                    retriever_url=retriever_url,
                    base_model_uri=base_model_uri,
                    strategy=strategy,
                    budget=budget,
                    continuations=continuations,
                    iterations=iterations,
                    max_staleness=max_staleness,
                    seed=seed,
                    checkpoint_every=checkpoint_every,
                    keep_checkpoints=keep_checkpoints,
                    ray_address=ray_address,
                    ray_jobs_url=ray_jobs_url,
                    engine=engine,
                    rollout_workers=rollout_workers,
                    gpus_per_worker=gpus_per_worker,
                    run_name=run_name,
                    store_uri=store_uri,
                    settings_json=settings_json,
                    mlflow_tracking_uri=mlflow_tracking_uri,
                    pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                ),
                "prep",
            ).set_caching_options(False)
            config = prepped.outputs["config_json"]
            first = prepped.outputs["start_iteration"]
            prompts = prepped.outputs["prompts"]
            planned = place(schedule(config_json=config, start_iteration=first), "schedule")

            def session(start: PipelineTask) -> None:
                """The session from ``start``'s policy, the iterations one after another (each
                reads the state the one before published: ``steps.handoff``), its close, the
                report."""
                opened = place(
                    open_session(
                        config_json=config,
                        start_iteration=first,
                        prompts=prompts,
                        policy=start.outputs["policy"],
                        predictor=start.outputs["predictor"],
                        optimizer=start.outputs["optimizer"],
                    ),
                    "open-session",
                    gpu=True,
                ).set_caching_options(False)
                with dsl.ParallelFor(planned.output, parallelism=1, name="iterations") as i:
                    step = place(
                        iterate(config_json=config, iteration=i, prompts=prompts),
                        "iterate",
                        gpu=True,
                    )
                    step.set_caching_options(False).after(opened)
                closed = place(
                    close_session(config_json=config, start_iteration=first),
                    "close-session",
                    uses_ray=True,
                )
                closed.set_caching_options(False).after(step)
                place(
                    report(
                        config_json=config,
                        start_iteration=first,
                        start_eval=opened.outputs["Output"],
                        final_eval=closed.outputs["Output"],
                    ),
                    "report",
                )

            with dsl.If(prepped.outputs["start"] == "warmstart", name="warmstart"):
                session(place(warmstart(config_json=config), "warmstart"))
            with dsl.Else(name="load"):
                loaded = place(load(config_json=config), "load")
                session(loaded.set_caching_options(False))

    return trace_training


def compile_pipeline(path: Path, options: PipelineOptions | None = None) -> Path:
    """Write the pipeline's IR YAML (the pipeline spec, then the Kubernetes platform spec)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _pyyaml_default_strings():
        compiler.Compiler().compile(build_pipeline(options), str(path))
    path.write_text(_sorted_header_defaults(path.read_text()))
    return path


_HEADER_DICT = re.compile(r"(#    \w+: dict \[Default: )(\{.*\})(\])")


def _sorted_header_defaults(text: str) -> str:
    """The compiled file's header comment with each dict default's keys sorted. KFP prints a
    dict default in protobuf's map order, which changes from one process to the next; sorted,
    the same pipeline compiles to the same bytes. The defaults themselves (in the spec) are
    YAML with sorted keys already; the header is parsed as a literal, never evaluated."""

    def ordered(value: object) -> object:
        if isinstance(value, dict):
            return {key: ordered(value[key]) for key in sorted(value)}
        if isinstance(value, list):
            return [ordered(item) for item in value]
        return value

    def line(match: re.Match[str]) -> str:
        return match[1] + repr(ordered(ast.literal_eval(match[2]))) + match[3]

    return _HEADER_DICT.sub(line, text)


@contextlib.contextmanager
def _pyyaml_default_strings() -> Iterator[None]:
    """PyYAML's own string style for the duration of a compile. hera (which writes the Argo
    workflows) switches PyYAML to block scalars for every multi-line string, process-wide, on
    import; the compiled YAML must not depend on whether hera was imported first."""
    import yaml
    from yaml.representer import SafeRepresenter

    classes = (yaml.Dumper, yaml.SafeDumper, yaml.representer.Representer, SafeRepresenter)
    saved = {cls: cls.__dict__.get("yaml_representers") for cls in classes}
    for cls in classes:
        cls.yaml_representers = {**cls.yaml_representers, str: SafeRepresenter.represent_str}
    try:
        yield
    finally:
        for cls, representers in saved.items():
            if representers is None:
                del cls.yaml_representers
            else:
                cls.yaml_representers = representers


if __name__ == "__main__":
    print(compile_pipeline(Path(sys.argv[1]) if len(sys.argv) > 1 else COMPILED))
