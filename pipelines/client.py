"""Submit and schedule the compiled training pipeline on a Kubeflow Pipelines server.

Thin functions over ``kfp.Client`` (the KFP v2beta1 REST API), used by ``trace-rl pipeline``:

    trace-rl pipeline upload                                  # new pipeline, or a new version
    trace-rl pipeline run --run-name nightly --param iterations=4
    trace-rl pipeline schedule --run-name nightly --cron "0 0 3 * * *"
    trace-rl pipeline runs

The server comes from ``--host`` or ``KFP_HOST`` (``KF_PIPELINES_ENDPOINT`` as kfp names it), a
bearer token from ``KFP_TOKEN`` (or ``--token``). Tokens are never printed: every error that
leaves this module has the token scrubbed from its text.

Resuming. Every run gets the pipeline parameter ``run_name``: the name under which the training
steps keep checkpoints in the checkpoint registry (``trace_core/store/registry.py``:
``checkpoints/<run_name>/latest.json``). A recurring run passes the same ``run_name`` to each run
it starts, so each scheduled run resumes from the last complete checkpoint of the one before;
``max_concurrency=1`` keeps two of them from writing the same run at once, and ``no_catchup``
starts one run after a pause instead of one per missed slot.

Parameters given as text (``--param key=value``) are checked against the compiled package's
root inputs and converted to their declared types (integer, double, boolean, list, struct);
an unknown or missing name is an error naming it, and so is a run name without ``store_uri``
(the registry's root) when the pipeline takes one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from trace_core.store.uri import check_run_name as check_registry_name

if TYPE_CHECKING:
    import kfp

DEFAULT_PACKAGE = Path(__file__).parent / "compiled" / "trace_training.yaml"
DEFAULT_EXPERIMENT = "trace-rl"
RUN_NAME_PARAM = "run_name"
STORE_PARAM = "store_uri"  # where the checkpoint registry lives, when the pipeline takes it
HOST_ENV = ("KFP_HOST", "KF_PIPELINES_ENDPOINT")
TOKEN_ENV = "KFP_TOKEN"
NAMESPACE_ENV = "KFP_NAMESPACE"


class SubmitError(Exception):
    """A submission that cannot go ahead; the message names the flag or field at fault."""


@dataclass(frozen=True)
class Server:
    """Where the KFP API is and how to authenticate. ``token`` never appears in ``repr``."""

    host: str
    token: str | None = field(default=None, repr=False)
    namespace: str | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise SubmitError(f"--host (or {HOST_ENV[0]}) is required: the KFP API endpoint")
        if not self.host.startswith(("http://", "https://")):
            raise SubmitError(f"--host must start with http:// or https://, got {self.host!r}")

    @classmethod
    def from_env(
        cls, host: str | None = None, token: str | None = None, namespace: str | None = None
    ) -> Server:
        """Flags first, then ``KFP_HOST`` (or ``KF_PIPELINES_ENDPOINT``), ``KFP_TOKEN``, ..."""
        host = host or next((os.environ[k] for k in HOST_ENV if os.environ.get(k)), "")
        return cls(
            host.rstrip("/"),
            token or os.environ.get(TOKEN_ENV) or None,
            namespace or os.environ.get(NAMESPACE_ENV) or None,
        )

    def scrub(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text


@contextlib.contextmanager
def _quiet(server: Server) -> Iterator[None]:
    """Keep the SDK's own prints and warnings out of our output; scrub the token from errors."""
    from kfp_server_api.exceptions import OpenApiException
    from urllib3.exceptions import HTTPError

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        except (OpenApiException, HTTPError, OSError, ValueError) as err:
            # The API's answer (status, reason, body), or the SDK refusing an argument.
            raise SubmitError(server.scrub(f"{type(err).__name__}: {err}")) from None


def probe(server: Server, timeout: float = 10.0) -> None:
    """One ``GET /apis/v2beta1/healthz``: fail in seconds, naming ``--host``, if it is wrong.

    ``kfp.Client`` asks the same path on construction, but retries 5 times 5 s apart and logs each
    failure with the response body; this check says what is wrong once, without the body.
    """
    request = urllib.request.Request(f"{server.host}/apis/v2beta1/healthz")
    if server.token:
        request.add_header("Authorization", f"Bearer {server.token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            pass
    except urllib.error.HTTPError as err:
        hint = " (check --token / KFP_TOKEN)" if err.code in (401, 403) else ""
        raise SubmitError(
            f"--host {server.host}: the KFP API answered HTTP {err.code} {err.reason}{hint}"
        ) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise SubmitError(
            server.scrub(f"--host {server.host}: cannot reach the KFP API ({reason})")
        ) from None


def connect(server: Server) -> kfp.Client:
    """A ``kfp.Client`` for ``server``, after :func:`probe` found the API there."""
    import kfp

    probe(server)
    with _quiet(server):
        if server.namespace:
            return kfp.Client(
                host=server.host, existing_token=server.token, namespace=server.namespace
            )
        return kfp.Client(host=server.host, existing_token=server.token)


# --- the compiled package --------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    name: str
    type: str  # KFP IR parameterType: STRING, NUMBER_INTEGER, NUMBER_DOUBLE, BOOLEAN, LIST, STRUCT
    required: bool
    default: object = None


@dataclass(frozen=True)
class Package:
    """What submission needs to know about a compiled pipeline YAML."""

    path: Path
    name: str
    parameters: Mapping[str, Parameter]
    sha256: str


def read_package(path: Path) -> Package:
    """The pipeline name and root parameters of a compiled KFP IR YAML."""
    if not path.is_file():
        raise SubmitError(
            f"--package {path}: no such file (compile it with `trace-rl pipeline compile`)"
        )
    text = path.read_bytes()
    # kfp-kubernetes appends a second document (the platform spec); the first is the pipeline.
    docs = [d for d in yaml.safe_load_all(text) if d]
    spec = docs[0] if docs else {}
    try:
        name = spec["pipelineInfo"]["name"]
        inputs = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    except (KeyError, TypeError, AttributeError):
        raise SubmitError(
            f"--package {path}: not a compiled KFP pipeline (no pipelineInfo)"
        ) from None
    parameters = {
        key: Parameter(
            key,
            value.get("parameterType", "STRING"),
            not value.get("isOptional", False) and "defaultValue" not in value,
            value.get("defaultValue"),
        )
        for key, value in inputs.items()
    }
    return Package(path, name, parameters, hashlib.sha256(text).hexdigest())


def _convert(parameter: Parameter, text: str) -> object:
    try:
        match parameter.type:
            case "NUMBER_INTEGER":
                return int(text)
            case "NUMBER_DOUBLE":
                return float(text)
            case "BOOLEAN":
                if text.lower() not in ("true", "false"):
                    raise ValueError("expected true or false")
                return text.lower() == "true"
            case "LIST" | "STRUCT":
                value = json.loads(text)
                expected = list if parameter.type == "LIST" else dict
                if not isinstance(value, expected):
                    raise ValueError(f"expected a JSON {expected.__name__}")
                return value
            case _:
                return text
    except ValueError as err:
        raise SubmitError(
            f"--param {parameter.name}={text!r}: not a {parameter.type} ({err})"
        ) from None


def check_run_name(run_name: str) -> str:
    """The registry's rule for run names, checked before a run is submitted, not an hour into
    it (the name becomes an object-key segment of the run's checkpoints)."""
    try:
        return check_registry_name(run_name, "--run-name")
    except ValueError as err:
        raise SubmitError(str(err)) from None


def build_params(package: Package, assignments: list[str], run_name: str) -> dict[str, object]:
    """``key=value`` texts plus ``run_name``, checked against and typed by ``package``."""
    if RUN_NAME_PARAM not in package.parameters:
        raise SubmitError(
            f"--package {package.path}: the pipeline has no {RUN_NAME_PARAM!r} parameter, "
            "so runs could not resume from their checkpoints"
        )
    params: dict[str, object] = {RUN_NAME_PARAM: check_run_name(run_name)}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SubmitError(f"--param {assignment!r}: expected KEY=VALUE")
        if key == RUN_NAME_PARAM:
            raise SubmitError(f"--param {RUN_NAME_PARAM}: give it as --run-name")
        if key not in package.parameters:
            known = ", ".join(sorted(package.parameters))
            raise SubmitError(f"--param {key}: the pipeline has no such parameter (has: {known})")
        params[key] = _convert(package.parameters[key], text)
    missing = sorted(p.name for p in package.parameters.values() if p.required)
    missing = [name for name in missing if name not in params]
    if missing:
        raise SubmitError(f"--param {missing[0]}: required by the pipeline and not given")
    store = package.parameters.get(STORE_PARAM)
    if store is not None and not params.get(STORE_PARAM, store.default):
        raise SubmitError(
            f"--param {STORE_PARAM}: needed with a run name, it is where the run's checkpoints "
            f"are kept (e.g. {STORE_PARAM}=s3://mlpipeline/trace)"
        )
    return params


def check_cron(cron: str) -> str:
    """KFP's scheduler reads 6 fields, seconds first (robfig/cron): ``0 0 3 * * *`` is 03:00."""
    fields = cron.split()
    if len(fields) != 6:
        raise SubmitError(
            f"--cron {cron!r}: KFP needs 6 fields, seconds first (e.g. '0 0 3 * * *' for "
            f"03:00 daily); got {len(fields)}"
        )
    return " ".join(fields)


# --- server calls ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    pipeline_id: str
    version_id: str
    version_name: str
    new_pipeline: bool


@dataclass(frozen=True)
class Submitted:
    id: str
    display_name: str
    experiment_id: str
    url: str


@dataclass(frozen=True)
class RunRow:
    run_id: str
    display_name: str
    state: str
    created_at: str
    run_name: str  # the checkpoint run it trains (the run_name parameter)
    recurring_run_id: str


def default_version_name(package: Package) -> str:
    """Time of upload plus the package's content hash, so equal packages are recognisable."""
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{package.sha256[:8]}"


def upload(
    client: kfp.Client,
    server: Server,
    package: Package,
    name: str | None = None,
    version: str | None = None,
    description: str | None = None,
) -> Version:
    """Upload ``package`` as pipeline ``name``; if that name exists, as a new version of it."""
    name = name or package.name
    version = version or default_version_name(package)
    with _quiet(server):
        pipeline_id = client.get_pipeline_id(name)
        if pipeline_id is None:
            created = client.upload_pipeline(
                str(package.path), pipeline_name=name, description=description
            )
            # The server stores the first version with the pipeline; ask for its id.
            first = _newest_version(client, created.pipeline_id)
            return Version(created.pipeline_id, first[0], first[1], new_pipeline=True)
        made = client.upload_pipeline_version(
            str(package.path), version, pipeline_id=pipeline_id, description=description
        )
        return Version(pipeline_id, made.pipeline_version_id, made.display_name or version, False)


def _newest_version(client: kfp.Client, pipeline_id: str) -> tuple[str, str]:
    listed = client.list_pipeline_versions(pipeline_id, page_size=1, sort_by="created_at desc")
    if not listed.pipeline_versions:
        raise SubmitError(f"pipeline {pipeline_id} has no versions on the server")
    newest = listed.pipeline_versions[0]
    return newest.pipeline_version_id, newest.display_name or ""


def resolve(client: kfp.Client, server: Server, name: str, version: str | None = None) -> Version:
    """Pipeline ``name`` and its version ``version`` (display name), or its newest version."""
    with _quiet(server):
        pipeline_id = client.get_pipeline_id(name)
        if pipeline_id is None:
            raise SubmitError(
                f"--pipeline {name!r}: no such pipeline on the server "
                "(upload it with `trace-rl pipeline upload`)"
            )
        if version is None:
            version_id, version_name = _newest_version(client, pipeline_id)
            return Version(pipeline_id, version_id, version_name, False)
        # Operation 1 is EQUALS, written as kfp.Client writes its own name filters.
        wanted = json.dumps(
            {"predicates": [{"operation": 1, "key": "display_name", "stringValue": version}]}
        )
        listed = client.list_pipeline_versions(pipeline_id, filter=wanted)
        if not listed.pipeline_versions:
            raise SubmitError(f"--version {version!r}: pipeline {name!r} has no such version")
        return Version(pipeline_id, listed.pipeline_versions[0].pipeline_version_id, version, False)


def _url(server: Server, fragment: str) -> str:
    return f"{server.host}/#/{fragment}"


def run(
    client: kfp.Client,
    server: Server,
    version: Version,
    params: Mapping[str, object],
    experiment: str = DEFAULT_EXPERIMENT,
    display_name: str | None = None,
) -> Submitted:
    """Start one run of ``version`` with ``params`` in ``experiment`` (created if missing)."""
    display_name = display_name or f"{params[RUN_NAME_PARAM]}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    with _quiet(server):
        experiment_id = client.create_experiment(experiment).experiment_id
        made = client.run_pipeline(
            experiment_id,
            display_name,
            params=dict(params),
            pipeline_id=version.pipeline_id,
            version_id=version.version_id,
        )
    return Submitted(
        made.run_id, display_name, experiment_id, _url(server, f"runs/details/{made.run_id}")
    )


def schedule(
    client: kfp.Client,
    server: Server,
    version: Version,
    cron: str,
    params: Mapping[str, object],
    name: str,
    experiment: str = DEFAULT_EXPERIMENT,
    max_concurrency: int = 1,
    no_catchup: bool = True,
) -> Submitted:
    """A recurring run of ``version`` on ``cron``; each run resumes ``params['run_name']``."""
    if max_concurrency < 1:
        raise SubmitError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    cron = check_cron(cron)
    with _quiet(server):
        experiment_id = client.create_experiment(experiment).experiment_id
        made = client.create_recurring_run(
            experiment_id,
            name,
            description=f"trace-rl: resumes run {params[RUN_NAME_PARAM]!r} from its latest "
            "checkpoint",
            cron_expression=cron,
            max_concurrency=max_concurrency,
            no_catchup=no_catchup,
            params=dict(params),
            pipeline_id=version.pipeline_id,
            version_id=version.version_id,
        )
    return Submitted(
        made.recurring_run_id,
        name,
        experiment_id,
        _url(server, f"recurringrun/details/{made.recurring_run_id}"),
    )


def runs(
    client: kfp.Client, server: Server, experiment: str | None = None, limit: int = 20
) -> list[RunRow]:
    """The newest ``limit`` runs (of ``experiment`` if given), newest first."""
    if limit < 1:
        raise SubmitError(f"--limit must be >= 1, got {limit}")
    with _quiet(server):
        experiment_id = None
        if experiment:
            try:
                experiment_id = client.get_experiment(experiment_name=experiment).experiment_id
            except ValueError:
                raise SubmitError(f"--experiment {experiment!r}: no such experiment") from None
        listed = client.list_runs(
            page_size=limit, sort_by="created_at desc", experiment_id=experiment_id
        )
    rows = []
    for r in listed.runs or []:
        parameters = (r.runtime_config.parameters if r.runtime_config else None) or {}
        rows.append(
            RunRow(
                r.run_id,
                r.display_name or "",
                str(r.state or ""),
                str(r.created_at or ""),
                str(parameters.get(RUN_NAME_PARAM, "")),
                r.recurring_run_id or "",
            )
        )
    return rows
