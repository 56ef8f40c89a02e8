"""Where an S3 URI's endpoint, region and credentials come from: the environment, never a URI.

Every URI uses the ``AWS_*`` settings the ``artifacts`` module lists, but for a run's own store:
a run's checkpoints may live on a second S3 service while KFP's artifacts stay on KFP's. The
``s3://`` URIs in the bucket ``TRACE_STORE_BUCKET`` then use that store's settings (a
``minio://`` URI, KFP's, never does):

    TRACE_STORE_BUCKET                              the run store's bucket (store_uri's)
    TRACE_STORE_ENDPOINT_URL                        its endpoint, http(s)://host:port (required)
    TRACE_STORE_ACCESS_KEY_ID, TRACE_STORE_SECRET_ACCESS_KEY   its credentials (required)
    TRACE_STORE_REGION                              its region (default us-east-1)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from trace_core.store.errors import AccessDenied

_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT")
RUN_STORE = "TRACE_STORE_"
"""The prefix of a run store's settings (module docstring): ``TRACE_STORE_BUCKET``, ..."""
RUN_STORE_BUCKET = RUN_STORE + "BUCKET"
RUN_STORE_SETTINGS = (RUN_STORE_BUCKET, RUN_STORE + "ENDPOINT_URL", RUN_STORE + "REGION")
"""A run store's settings that are not credentials (a Ray job inherits them)."""


def check_run_store(uri: str, env: Mapping[str, str] | None = None) -> None:
    """Where a run store is set (``TRACE_STORE_BUCKET``), ``uri`` (a run's store_uri) must be
    in its bucket: a run given another bucket would write its checkpoints to KFP's store."""
    env = os.environ if env is None else env
    bucket = env.get(RUN_STORE_BUCKET)
    if not bucket or "://" not in uri:
        return
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or parsed.netloc != bucket:
        raise ValueError(
            f"store_uri {uri}: the run store serves s3://{bucket} ({RUN_STORE_BUCKET}, set when "
            f"the pipeline was compiled with --run-store-endpoint); give an s3://{bucket}/... "
            "prefix, or compile without a run store"
        )


@dataclass(frozen=True)
class S3Settings:
    """Endpoint, region and credentials, read from the environment; never printed."""

    endpoint: str | None  # host[:port]; None: AWS S3
    secure: bool
    region: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def for_bucket(
        cls, bucket: str, scheme: str = "s3", env: Mapping[str, str] | None = None
    ) -> S3Settings:
        """The settings of ``scheme://bucket``: the run store's for its bucket (``s3://``
        only: ``minio://`` is KFP's), the ``AWS_*`` ones otherwise."""
        env = os.environ if env is None else env
        if scheme == "s3" and bucket == env.get(RUN_STORE_BUCKET):
            return cls.from_env(env, RUN_STORE)
        return cls.from_env(env)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, prefix: str = "") -> S3Settings:
        """The ``AWS_*`` settings; with ``prefix`` (``RUN_STORE``) the run store's, whose
        endpoint is ``<prefix>ENDPOINT_URL`` and required."""
        env = os.environ if env is None else env
        keys = ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY")
        names = [prefix + n for n in keys] if prefix else ["AWS_" + n for n in keys]
        access_key, secret_key = (env.get(n, "") for n in names)
        if not access_key or not secret_key:
            missing = [n for n in names if not env.get(n)]
            where = f" for s3://{env.get(RUN_STORE_BUCKET)} ({RUN_STORE_BUCKET})" if prefix else ""
            raise AccessDenied(
                f"no S3 credentials{where}: set {' and '.join(missing)} in the environment "
                "(in a cluster, from a Kubernetes Secret)"
            )
        endpoints = (prefix + "ENDPOINT_URL",) if prefix else _ENDPOINT_VARS
        raw = next((env[n] for n in endpoints if env.get(n)), "")
        if prefix and not raw:
            raise ValueError(
                f"{RUN_STORE_BUCKET}={env.get(RUN_STORE_BUCKET)} needs {endpoints[0]}: the run "
                "store's endpoint, http(s)://host:port"
            )
        endpoint, secure = None, True
        if raw:
            parsed = urlparse(raw if "://" in raw else f"https://{raw}")
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(
                    f"S3 endpoint {parsed.scheme}://{parsed.hostname or ''}: "
                    "expected http(s)://host[:port]"
                )
            if parsed.username or parsed.password:
                raise ValueError("the S3 endpoint must not hold credentials")
            endpoint, secure = parsed.netloc, parsed.scheme == "https"
        if prefix:
            region, token = env.get(prefix + "REGION") or "us-east-1", None
        else:
            region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
            token = env.get("AWS_SESSION_TOKEN") or None
        return cls(endpoint, secure, region, access_key, secret_key, token)

    def redact(self, text: str) -> str:
        """``text`` with every credential value replaced by ***."""
        for secret in (self.secret_key, self.session_token, self.access_key):
            if secret:
                text = text.replace(secret, "***")
        return text
