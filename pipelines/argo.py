"""The training pipeline as Argo Workflows objects, for clusters with Argo but without KFP.

    python -m pipelines.argo [DIR]        # or: trace-rl pipeline argo [--output-dir DIR]

writes ``manifests/argo/``: ``workflowtemplate.yaml`` (WorkflowTemplate ``trace-training``),
``cronworkflow.yaml`` (CronWorkflow ``trace-training-nightly``, which runs that template) and
``kustomization.yaml`` listing both; ``manifests/overlays/standalone`` includes the folder. Built
with hera; the committed YAML is checked against the generator and against Argo's CRD schemas
(tests/pipelines/test_argo.py).

The same steps as the KFP pipeline (``pipelines/trace_training.py``), each a container running
``trace-rl step ...`` in the project's images (``components/images.env``)::

    prep ─► warmstart | load ─► open-session ─► [ iterate ] × K ─► close-session ─► report

- Every run parameter (``trace_core.train.contract.PipelineParameters``) is a workflow
  parameter of the same name and default (store_uri's aside: without KFP there is no artifact
  store, so the S3 prefix of trace-rl-settings), K (``iterations``) and ``max_staleness``
  included; prep gets each as ``--param NAME=VALUE``. ``ArgoOptions.iterations`` only sets
  iterations' default.
- The K iterations are one DAG task, ``iterate``, looped with ``withSequence`` (start: the
  iteration the run resumes from + 1, count: ``iterations``) inside the template
  ``iterations``, which has ``parallelism: 1`` and ``failFast: true``: Argo's controller starts
  the expanded children in their order, each once the one before has ended, and none after one
  failed (argo-workflows ``executeDAGTask`` in ``workflow/controller/dag.go``,
  ``checkParallelism`` in ``workflow/controller/operator.go``). Each child runs iteration
  ``{{item}}`` from ``state-{{=asInt(item) - 1}}``; given any state but the one after the
  iteration before its own, it refuses it (``iterate_step``). The tasks after the loop depend
  on the task ``iterations``, which ends when its last child has.
- Steps share no volume: folders go through S3, under ``<store_uri>/staging/<workflow
  name>/``: prompts, start/policy, ``state-N`` (the run's state after iteration N: open-session
  writes the one it resumes from, ``state-S``, S = prep's start_iteration; iteration N
  ``state-N``), ``iter-N/trees``, eval-final, report. close-session and report read
  ``state-L`` and ``iter-L/trees``, L = S + iterations. Small values (the config JSON, where
  the policy starts) go through Argo output parameters. Between the iterations only the run's
  state travels (its log, predictor and where the newest checkpoint is): the policy and
  optimizer state stay on the session's trainer actors, on the Ray cluster at
  ``ray_address`` (``trace_core/train/steps/session.py``).
- Resuming: prep looks up ``run_name`` in the checkpoint registry below ``store_uri``
  (``trace_core/store/registry.py``) and starts from its ``latest`` checkpoint (``load``) if it
  has one; every checkpoint (each ``checkpoint_every`` iterations and the last) becomes the new
  ``latest`` once complete, and the run's older ones beyond the newest ``keep_checkpoints`` are
  deleted then. close-session deletes the session's folder under ``<store_uri>/sessions/``
  (the trees it put there for the trainers); there is no exit handler, so a workflow that fails
  before it leaves that folder, and ``staging/<workflow name>/`` is kept (the report reads
  it). The CronWorkflow passes the same ``run_name`` every time, so each
  scheduled workflow continues where the last complete one ended; ``concurrencyPolicy:
  Forbid`` keeps two from training the same run at once (KFP's ``max_concurrency=1``), and Argo
  never backfills missed schedules (KFP's ``no_catchup``).
- open-session and the iterations run in TRACE_GPU_IMAGE with ``nvidia.com/gpu`` limits on GPU
  nodes whose NVIDIA driver runs the image's CUDA 13 (``components.images.gpu_node_affinity``,
  the rule and taint of ``manifests/base/gpu-nodes.yaml``); close-session in TRACE_GPU_IMAGE
  too, without GPUs (it talks to Ray: the cluster's Python and Ray); the others in
  TRACE_IMAGE. Every step's two scratch volumes come with an ephemeral-storage request of their
  size. With a Ray cluster (``ray_address`` or ``ray_jobs_url``) the GPUs are the
  cluster's and the pods' idle: regenerate with ``ArgoOptions(gpus=0)`` for that setup.
- Credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the Secret ``trace-s3`` and
  RAY_AUTH_TOKEN from ``trace-ray-auth`` (``valueFrom.secretKeyRef``) beside RAY_AUTH_MODE=token,
  without which Ray's clients send no token; the S3 endpoint and region
  from the ConfigMap ``trace-rl-settings`` (all three made by ``manifests/base``). Nothing secret
  is written here.
- Every container: requests and limits, non-root (the images' own uid), no privilege
  escalation, all capabilities dropped, read-only root filesystem with emptyDir /tmp and HOME.

Not yet validated: no Argo controller runs on this machine, so the workflow has only been checked
against the schemas, never run; the ``when``/``depends`` expressions, the ``{{=...}}``
iteration arithmetic and the loop (its order, ``withSequence`` from parameters) follow Argo's
documentation and its controller's source (read at v3.4.0 and v4.1), untested. Each
container's command is ``trace-rl step`` with the folders of
``trace_core.train.contract.STEP_FOLDERS``, and every step runs that way here on local folders
and s3:// prefixes (tests/train/test_step_cli.py).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from hera.workflows import (
    DAG,
    ConfigMapEnv,
    Container,
    CronWorkflow,
    EmptyDirVolume,
    Env,
    Parameter,
    Resources,
    SecretEnv,
    Task,
    WorkflowTemplate,
)
from hera.workflows import models as m

from components.images import check_images, gpu_node_affinity, image
from trace_core.rollout.ray_auth import CLIENT_ENV, SECRET, SECRET_KEY, TOKEN_ENV
from trace_core.train.contract import STEP_FOLDERS, PipelineParameters

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "manifests" / "argo"
TEMPLATE_FILE = "workflowtemplate.yaml"
CRON_FILE = "cronworkflow.yaml"
KUSTOMIZATION_FILE = "kustomization.yaml"

S3_SECRET = "trace-s3"  # keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (manifests/secrets/s3)
RAY_SECRET = SECRET  # key auth_token (manifests/secrets/ray-auth)
SETTINGS = "trace-rl-settings"  # ConfigMap: AWS_ENDPOINT_URL_S3, AWS_REGION (manifests/base)
SERVICE_ACCOUNT = "trace-pipeline"  # may only report step outputs (manifests/base/rbac.yaml)
GPU_STEPS = ("open-session", "iterate")
RAY_STEPS = (*GPU_STEPS, "close-session")
"""The steps that talk to the Ray cluster: they run its image (one Python and one Ray)."""
SCRATCH = ("20Gi", "20Gi")
"""The emptyDir sizes of a step's /tmp and $HOME; its ephemeral-storage request is their sum
and 1 Gi for the container's logs and writable layer (the root filesystem is read-only)."""
OUT = "/tmp/outputs"  # where steps write the small values Argo reads as output parameters

# The workflow parameters: the pipeline's run parameters (``PipelineParameters``, the one list,
# in its order), with its defaults but store_uri's: without KFP there is no artifact store, so
# the S3 prefix of trace-rl-settings. iterations' default can be changed when generating
# (``ArgoOptions.iterations``).
PARAMETERS = {f.name: str(f.default) for f in dataclasses.fields(PipelineParameters)} | {
    "store_uri": "s3://trace-rl/runs"
}

# What each container runs: ``trace-rl step STEP --config-json C --iteration I`` with these
# ``--input NAME=URI`` and ``--output NAME=URI`` folders (prep: ``--param NAME=VALUE`` for each
# workflow parameter instead of the config). prep writes config.json, start and start_iteration
# into its local ``result`` folder, which Argo reads as output parameters; open-session writes
# the starting evaluation into its ``state`` (``eval.json``), close-session the final one into
# ``result``, and report reads both back.
STEPS_RUNNABLE = tuple(STEP_FOLDERS)


@dataclass(frozen=True)
class Size:
    """A container's requests and limits."""

    cpu: str
    memory: str
    cpu_limit: str
    memory_limit: str
    gpus: int = 0


@dataclass(frozen=True)
class ArgoOptions:
    """What is fixed when the manifests are generated."""

    iterations: int = PipelineParameters.iterations
    """The default of the workflow parameter ``iterations`` (K: the loop's length)."""
    gpus: int = 1
    """GPUs of the open-session and iterate pods (0: the Ray cluster holds the run's GPUs)."""
    name: str = "trace-training"
    schedule: str = "0 3 * * *"
    """Argo's cron: 5 fields, no seconds (KFP's has 6)."""
    timezone: str = "UTC"
    cron_run_name: str = "nightly"
    """The run every scheduled workflow resumes."""
    cpu_size: Size = Size("2", "8Gi", "4", "16Gi")
    gpu_size: Size = Size("8", "64Gi", "8", "64Gi")
    image: str = dataclasses.field(default_factory=lambda: image("TRACE_IMAGE"))
    """The CPU steps' image (default: TRACE_IMAGE of ``components/images.env``)."""
    gpu_image: str = dataclasses.field(default_factory=lambda: image("TRACE_GPU_IMAGE"))
    """The GPU steps' image (default: TRACE_GPU_IMAGE)."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets every step pod pulls its image with (or: the pull-secret component on the
    trace-pipeline ServiceAccount, ``manifests/pull-secret``)."""

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {self.gpus}")
        if len(self.schedule.split()) != 5:
            raise ValueError(f"schedule {self.schedule!r}: Argo's cron has 5 fields")
        check_images(self.image, self.gpu_image, self.image_pull_secrets)


def _uid(gpu: bool) -> int:
    """The images' own user (USER in images/trace*/Dockerfile): 10001 in both."""
    return 10001


# Checks a batch step cannot pass, each with the reason (checkov reads these annotations).
CHECKOV_SKIPS = {
    "checkov.io/skip1": "CKV_K8S_8=A batch step runs to completion; there is no server to probe",
    "checkov.io/skip2": "CKV_K8S_9=A batch step runs to completion; there is no server to probe",
    "checkov.io/skip3": (
        "CKV_K8S_43=The project's images are pinned by release tag in components/images.env; pin "
        "their digests when deploying once pushed"
    ),
    "checkov.io/skip4": (
        "CKV_K8S_35=trace_core.store reads S3 credentials from the standard AWS_* variables; "
        "their values come from the trace-s3 Secret, never from a manifest"
    ),
    "checkov.io/skip5": (
        "CKV_K8S_38=Argo's executor reports step results through the Kubernetes API with the "
        "pod's service-account token"
    ),
    "checkov.io/skip6": (
        "CKV_K8S_15=IfNotPresent on purpose, as the images are pinned by release tag in "
        "components/images.env and a tag is pushed once, so a node that holds the tag holds the "
        "right image (the Ray pods and KFP's steps pull the same way)"
    ),
}


def _env(gpu: bool, ray: bool = False) -> list[Env | SecretEnv | ConfigMapEnv]:
    env: list[Env | SecretEnv | ConfigMapEnv] = [
        SecretEnv(name=key, secret_name=S3_SECRET, secret_key=key)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    ]
    env += [
        ConfigMapEnv(name=key, config_map_name=SETTINGS, config_map_key=key)
        for key in ("AWS_ENDPOINT_URL_S3", "AWS_REGION")
    ]
    if gpu or ray:  # the steps that use Ray, on a token-auth cluster: the token and its mode
        env.append(
            SecretEnv(
                name=TOKEN_ENV,
                secret_name=RAY_SECRET,
                secret_key=SECRET_KEY,
                optional=True,
            )
        )
        env += [Env(name=name, value=value) for name, value in CLIENT_ENV.items()]
    return env


def _container(
    name: str,
    args: list[str],
    options: ArgoOptions,
    inputs: tuple[str, ...] = (),
    outputs: dict[str, str] | None = None,
) -> Container:
    """One step's template: ``trace-rl`` + args, hardened and sized."""
    gpu = name in GPU_STEPS
    size = options.gpu_size if gpu else options.cpu_size
    uid = _uid(gpu)
    gpus = options.gpus if gpu else 0
    return Container(
        name=name,
        image=options.gpu_image if name in RAY_STEPS else options.image,
        image_pull_policy="IfNotPresent",
        annotations=CHECKOV_SKIPS,
        command=["trace-rl"],
        args=args,
        inputs=[Parameter(name=p) for p in inputs],
        outputs=[
            Parameter(name=p, value_from=m.ValueFrom(path=f"{OUT}/{name}/{file}"))
            for p, file in (outputs or {}).items()
        ],
        env=_env(gpu, ray=name == "close-session"),
        resources=Resources(
            cpu_request=size.cpu,
            cpu_limit=size.cpu_limit,
            memory_request=size.memory,
            memory_limit=size.memory_limit,
            gpus=gpus or None,
            ephemeral_request=_ephemeral(),
            ephemeral_limit=_ephemeral(),
        ),
        security_context=m.SecurityContext(
            run_as_non_root=True,
            run_as_user=uid,
            run_as_group=uid,
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            capabilities=m.Capabilities(drop=["ALL"]),
        ),
        pod_security_context=m.PodSecurityContext(
            run_as_non_root=True,
            run_as_user=uid,
            run_as_group=uid,
            fs_group=uid,
            seccomp_profile=m.SeccompProfile(type="RuntimeDefault"),
        ),
        volumes=[
            EmptyDirVolume(name="tmp", mount_path="/tmp", size_limit=SCRATCH[0]),
            EmptyDirVolume(name="home", mount_path="/home/trace", size_limit=SCRATCH[1]),
        ],
        affinity=m.Affinity(node_affinity=m.NodeAffinity.model_validate(gpu_node_affinity()))
        if gpus
        else None,
        tolerations=(
            [m.Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]
            if gpus
            else None
        ),
    )


def _ephemeral() -> str:
    """A step's ephemeral storage: its two scratch volumes and 1 Gi, in Gi."""
    return f"{sum(int(size.removesuffix('Gi')) for size in SCRATCH) + 1}Gi"


def _folders(*names: str, flag: str) -> list[str]:
    """``--input name={{inputs.parameters.name}}`` pairs for a template's folder parameters."""
    args = []
    for name in names:
        args += [flag, f"{name}={{{{inputs.parameters.{name}}}}}"]
    return args


CONFIG = "{{inputs.parameters.config}}"


def _templates(options: ArgoOptions) -> dict[str, Container]:
    """One container template per step; folders and iteration come in as input parameters."""
    prep_args = ["step", "prep", "--iteration", "0"]
    for k in PARAMETERS:
        prep_args += ["--param", f"{k}={{{{workflow.parameters.{k}}}}}"]
    prep_args += ["--output", "prompts={{inputs.parameters.prompts}}"]
    prep_args += ["--output", f"result={OUT}/prep"]

    def step(name: str, *, iteration: bool = False) -> list[str]:
        return [
            "step",
            name,
            "--config-json",
            CONFIG,
            "--iteration",
            "{{inputs.parameters.iteration}}" if iteration else "0",
        ]

    start_outputs = _folders("policy", "predictor", "optimizer", flag="--output")
    return {
        "prep": _container(
            "prep",
            prep_args,
            options,
            inputs=("prompts",),
            outputs={
                "config": "config.json",
                "start": "start",
                "start_iteration": "start_iteration",
            },
        ),
        "warmstart": _container(
            "warmstart",
            step("warmstart") + start_outputs,
            options,
            inputs=("config", "policy", "predictor", "optimizer"),
        ),
        "load": _container(
            "load",
            step("load") + start_outputs,
            options,
            inputs=("config", "policy", "predictor", "optimizer"),
        ),
        "open-session": _container(
            "open-session",
            step("open-session", iteration=True)
            + _folders("prompts", "policy", "predictor", "optimizer", flag="--input")
            + _folders("state", flag="--output"),
            options,
            inputs=("config", "iteration", "prompts", "policy", "predictor", "optimizer", "state"),
        ),
        "iterate": _container(
            "iterate",
            step("iterate", iteration=True)
            + _folders("prompts", "state", flag="--input")
            + _folders("trees", flag="--output")
            + ["--output", "state={{inputs.parameters.new_state}}"],
            options,
            inputs=("config", "iteration", "prompts", "state", "trees", "new_state"),
        ),
        "close-session": _container(
            "close-session",
            step("close-session")
            + _folders("state", flag="--input")
            + _folders("result", flag="--output"),
            options,
            inputs=("config", "state", "result"),
        ),
        "report": _container(
            "report",
            step("report")
            + _folders("trees", "state", "start_eval", "final_eval", flag="--input")
            + _folders("report", flag="--output"),
            options,
            inputs=("config", "trees", "state", "start_eval", "final_eval", "report"),
        ),
    }


def _folder(path: str) -> str:
    """A folder of this workflow's staging area in the store."""
    return f"{{{{workflow.parameters.store_uri}}}}/staging/{{{{workflow.name}}}}/{path}"


def _loop(container: Container) -> DAG:
    """The template ``iterations``: the task ``iterate`` once per iteration, one at a time, in
    order (``parallelism: 1``), none after one failed (``failFast``). Its inputs: the config,
    ``first`` (the first iteration's number) and ``count`` (how many)."""
    with DAG(
        name="iterations",
        inputs=[Parameter(name=p) for p in ("config", "first", "count")],
        parallelism=1,
        fail_fast=True,
    ) as loop:
        Task(
            name="iterate",
            template=container,
            with_sequence=m.Sequence(
                start="{{inputs.parameters.first}}", count="{{inputs.parameters.count}}"
            ),
            arguments={
                "config": "{{inputs.parameters.config}}",
                "iteration": "{{item}}",
                "prompts": _folder("prompts"),
                "state": _folder("state-{{=asInt(item) - 1}}"),
                "trees": _folder("iter-{{item}}/trees"),
                "new_state": _folder("state-{{item}}"),
            },
        )
    return loop


def build_template(options: ArgoOptions | None = None) -> WorkflowTemplate:
    """The WorkflowTemplate: the DAG of module docstring, the iterations one looped task."""
    opts = options or ArgoOptions()
    config = "{{tasks.prep.outputs.parameters.config}}"
    parameters = PARAMETERS | {"iterations": str(opts.iterations)}
    with WorkflowTemplate(
        name=opts.name,
        entrypoint="train",
        labels={
            "app.kubernetes.io/name": "trace-training",
            "app.kubernetes.io/part-of": "trace-rl",
        },
        annotations={
            "workflows.argoproj.io/description": (
                "TRACE tree-rollout RL: prep, warm start or resume, open the run's session, "
                f"`iterations` iterations on it (default {opts.iterations}), one after another, "
                "close it, report. Generated by pipelines/argo.py."
            )
        },
        arguments=[Parameter(name=k, value=v) for k, v in parameters.items()],
        service_account_name=SERVICE_ACCOUNT,
        image_pull_secrets=[m.LocalObjectReference(name=n) for n in opts.image_pull_secrets]
        or None,
        security_context=m.PodSecurityContext(
            run_as_non_root=True, seccomp_profile=m.SeccompProfile(type="RuntimeDefault")
        ),
        pod_gc=m.PodGC(strategy="OnPodSuccess"),
        ttl_strategy=m.TTLStrategy(seconds_after_completion=7 * 24 * 3600),
    ) as template:
        t = _templates(opts)
        loop = _loop(t["iterate"])
        with DAG(name="train"):
            Task(name="prep", template=t["prep"], arguments={"prompts": _folder("prompts")})
            started = "warmstart.Succeeded || load.Succeeded"
            start = {
                "config": config,
                "policy": _folder("start/policy"),
                "predictor": _folder("start/predictor"),
                "optimizer": _folder("start/optimizer"),
            }
            chosen = "{{tasks.prep.outputs.parameters.start}}"
            Task(
                name="warmstart",
                template=t["warmstart"],
                arguments=start,
                depends="prep",
                when=f"{chosen} == warmstart",
            )
            Task(
                name="load",
                template=t["load"],
                arguments=start,
                depends="prep",
                when=f"{chosen} == load",
            )
            # The registry's iteration count goes on: a resumed run's first is S + 1, its
            # last L = S + iterations; state-N is the run's state after iteration N.
            start_iteration = "{{tasks.prep.outputs.parameters.start_iteration}}"
            s = "asInt(tasks.prep.outputs.parameters.start_iteration)"
            last = f"{{{{={s} + asInt(workflow.parameters.iterations)}}}}"
            Task(
                name="open-session",
                template=t["open-session"],
                arguments={
                    "config": config,
                    "iteration": start_iteration,
                    "prompts": _folder("prompts"),
                    "policy": _folder("start/policy"),
                    "predictor": _folder("start/predictor"),
                    "optimizer": _folder("start/optimizer"),
                    "state": _folder(f"state-{start_iteration}"),
                },
                depends=started,
            )
            Task(
                name="iterations",
                template=loop,
                arguments={
                    "config": config,
                    "first": f"{{{{={s} + 1}}}}",
                    "count": "{{workflow.parameters.iterations}}",
                },
                depends="open-session",
            )
            Task(
                name="close-session",
                template=t["close-session"],
                arguments={
                    "config": config,
                    "state": _folder(f"state-{last}"),
                    "result": _folder("eval-final"),
                },
                depends="iterations",
            )
            Task(
                name="report",
                template=t["report"],
                arguments={
                    "config": config,
                    "trees": _folder(f"iter-{last}/trees"),
                    "state": _folder(f"state-{last}"),
                    "start_eval": _folder(f"state-{start_iteration}"),
                    "final_eval": _folder("eval-final"),
                    "report": _folder("report"),
                },
                depends="close-session",
            )
    return template


def build_cron(options: ArgoOptions | None = None) -> CronWorkflow:
    """The CronWorkflow: the template on a schedule, always resuming the same run."""
    opts = options or ArgoOptions()
    return CronWorkflow(
        name=f"{opts.name}-{opts.cron_run_name}",
        labels={
            "app.kubernetes.io/name": "trace-training",
            "app.kubernetes.io/part-of": "trace-rl",
        },
        schedules=[opts.schedule],
        timezone=opts.timezone,
        concurrency_policy="Forbid",
        starting_deadline_seconds=3600,
        successful_jobs_history_limit=3,
        failed_jobs_history_limit=3,
        workflow_template_ref=m.WorkflowTemplateRef(name=opts.name),
        arguments=[Parameter(name="run_name", value=opts.cron_run_name)],
    )


HEADER = "# Generated by pipelines/argo.py (`trace-rl pipeline argo`); do not edit by hand.\n"


def _dump(obj: WorkflowTemplate | CronWorkflow) -> str:
    body = yaml.safe_dump(obj.to_dict(), sort_keys=False, allow_unicode=True, width=100)
    return HEADER + body


def write_manifests(
    directory: Path = DEFAULT_DIR, options: ArgoOptions | None = None
) -> list[Path]:
    """Write the WorkflowTemplate, the CronWorkflow and their kustomization into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        TEMPLATE_FILE: _dump(build_template(options)),
        CRON_FILE: _dump(build_cron(options)),
        KUSTOMIZATION_FILE: HEADER
        + yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [TEMPLATE_FILE, CRON_FILE],
            },
            sort_keys=False,
        ),
    }
    written = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_manifests(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR):
        print(path)
