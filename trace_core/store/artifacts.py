"""Artifact storage: one interface over a local folder and S3 (MinIO, SeaweedFS, AWS S3).

    store = open_store("s3://mlpipeline/trace/run-1")     # or "build/artifacts", "file:///data"
    store.put_bytes("metrics.json", b"{}")                 # readers see the old or the new object
    store.put_file("policy/model.safetensors", path)       # multipart on S3
    store.get_bytes("metrics.json"); store.list_objects("trees"); store.exists("metrics.json")
    store.delete_prefix("sessions/calc-0a1b2c3d")         # every object below it; the count
    fs, path = store.arrow_path("trees/part-0.parquet")    # pyarrow reads only the columns used

Keys are relative POSIX paths below the store's root; the key "" is the root itself (a store
opened on one file). Sets of objects (tree sets, checkpoints) become visible through a manifest
written after their files: see ``treeset`` and ``registry``.

S3 settings come only from the environment, under the names AWS tools read and a Kubernetes
Secret sets (``envFrom``). They never appear in URIs, logs or error messages:

    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   credentials (required; AWS_SESSION_TOKEN optional)
    AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or S3_ENDPOINT (first set wins)
                         MinIO / SeaweedFS, e.g. http://seaweedfs.kubeflow:9000; a bare
                         host:port means https; unset means AWS S3
    AWS_REGION or AWS_DEFAULT_REGION           region (default us-east-1)

``minio://bucket/key`` (how KFP names its artifacts) is read as ``s3://bucket/key``.

A run's checkpoints may have an S3 store of their own (``TRACE_STORE_*``: ``s3_settings``).

Object calls go through the ``minio`` SDK; Parquet reads go through pyarrow's ``S3FileSystem``
(ranged reads of the column chunks a query needs). Transient failures (connection refused or
reset, timeouts, HTTP 5xx, SlowDown) are retried with exponential backoff, a whole call at a
time (a multipart upload restarts from its first part); a missing object or bucket and a refused
credential fail at once with an error naming the URI.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol, TypeVar
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from trace_core.store.errors import (
    AccessDenied,
    BucketNotFound,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
)
from trace_core.store.s3_settings import S3Settings
from trace_core.store.traffic import TRAFFIC, Traffic  # noqa: F401  (their home before)
from trace_core.store.traffic import MinioProgress as _MinioProgress

T = TypeVar("T")
log = logging.getLogger(__name__)
Progress = Callable[[int], None]  # called with the bytes sent so far
_CHUNK = 1 << 20


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``attempts`` tries, waiting first_delay, 2×, 4×, ... ≤ max_delay."""

    attempts: int = 6
    first_delay: float = 0.5
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if not 0 <= self.first_delay <= self.max_delay:
            raise ValueError("delays must satisfy 0 <= first_delay <= max_delay")

    def delays(self) -> Iterator[float]:
        """The waits between attempts (attempts - 1 of them)."""
        for i in range(self.attempts - 1):
            yield min(self.first_delay * 2**i, self.max_delay)


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's root
    size: int


class ArtifactStore(Protocol):
    """What every store offers; keys are relative POSIX paths, "" is the root itself."""

    @property
    def root_uri(self) -> str: ...

    def uri(self, key: str = "") -> str: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def put_file(
        self, key: str, path: str | os.PathLike[str], progress: Progress | None = None
    ) -> None: ...
    def get_bytes(self, key: str = "") -> bytes: ...
    def get_file(self, key: str, path: str | os.PathLike[str]) -> None: ...
    def exists(self, key: str = "") -> bool: ...
    def list_objects(self, prefix: str = "") -> list[ObjectInfo]: ...
    def delete(self, key: str) -> None: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def arrow_path(self, key: str = "") -> tuple[pafs.FileSystem, str]: ...
    def arrow_error(self, key: str, err: BaseException) -> StoreError: ...


def open_store(uri: str | os.PathLike[str], retry: RetryPolicy | None = None) -> ArtifactStore:
    """The store rooted at ``uri``: a local path, ``file://``, ``s3://`` or ``minio://``."""
    text = os.fspath(uri)
    if "://" not in text:
        return LocalStore(Path(text))
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{text}: file:// URIs must name a local path (file:///path)")
        return LocalStore(Path(unquote(parsed.path)))
    if scheme in ("s3", "minio"):
        if parsed.username or parsed.password or "@" in parsed.netloc:
            # Never echo the URI here: it holds what looks like a credential.
            raise ValueError(
                "S3 URIs must not hold credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment instead"
            )
        if not parsed.netloc:
            raise ValueError(f"{text}: no bucket; expected s3://bucket/prefix")
        prefix = parsed.path.strip("/")
        _check_bucket(parsed.netloc, prefix)  # before the credentials: the URI's own mistake first
        settings = S3Settings.for_bucket(parsed.netloc, scheme)
        return S3Store(parsed.netloc, prefix, settings, retry or RetryPolicy())
    raise ValueError(f"{text}: unsupported URI scheme {scheme!r}; use a path, s3:// or file://")


def _check_bucket(bucket: str, prefix: str) -> None:
    if not _BUCKET_NAME.fullmatch(bucket):
        raise ValueError(
            f"s3://{bucket}/{prefix}: invalid bucket name (3-63 lowercase letters, digits, "
            "'.' and '-')"
        )


def read_uri(uri: str) -> bytes:
    """The bytes of the one object or file ``uri`` names."""
    return open_store(uri).get_bytes("")


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _check_prefix(prefix: str) -> str:
    """A prefix to delete below: a key, never the store's root."""
    if not _check_key(prefix):
        raise ValueError("delete_prefix needs a prefix below the store's root, got ''")
    return prefix


def _check_key(key: str) -> str:
    if key in ("", "."):
        return ""
    parts = PurePosixPath(key).parts
    if key.startswith("/") or ".." in parts or "\\" in key:
        raise ValueError(f"key {key!r} must be a relative POSIX path without '..'")
    return "/".join(p for p in parts if p != ".")


# --- local folder ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalStore:
    """Artifacts in a local folder (the embedded default). Writes are a temp file + rename."""

    root: Path
    root_uri: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser().absolute())
        object.__setattr__(self, "root_uri", str(self.root))

    def _path(self, key: str) -> Path:
        key = _check_key(key)
        return self.root / key if key else self.root

    def uri(self, key: str = "") -> str:
        return str(self._path(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, lambda f: f.write(data))

    def put_file(
        self, key: str, path: str | os.PathLike[str], progress: Progress | None = None
    ) -> None:
        def copy(f: io.BufferedWriter) -> None:
            sent = 0
            with open(path, "rb") as src:
                while block := src.read(_CHUNK):
                    f.write(block)
                    sent += len(block)
                    if progress:
                        progress(sent)

        self._write(key, copy)

    def _write(self, key: str, fill: Callable[[io.BufferedWriter], object]) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Hidden and unique: listings skip it, and two writers never share one.
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "xb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get_bytes(self, key: str = "") -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"{path}: no such file") from None
        except PermissionError:
            raise AccessDenied(f"{path}: permission denied") from None

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        source = self._path(key)
        if not source.is_file():
            raise ObjectNotFound(f"{source}: no such file")
        LocalStore(Path(path).parent).put_file(Path(path).name, source)

    def exists(self, key: str = "") -> bool:
        return self._path(key).is_file()

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        found = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue  # temp files of writes in progress
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                found.append(ObjectInfo(key, full.stat().st_size))
        return found

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        """Delete the folder ``prefix`` names, every object below it (``list_objects``'s, and
        the temp files of writes in progress); returns how many objects it held. Nothing there
        is no error; the store's root itself is refused."""
        base = self._path(_check_prefix(prefix))
        if not base.is_dir():
            return 0
        count = len(self.list_objects(prefix))
        shutil.rmtree(base)
        return count

    def arrow_path(self, key: str = "") -> tuple[pafs.FileSystem, str]:
        return pafs.LocalFileSystem(), str(self._path(key))

    def arrow_error(self, key: str, err: BaseException) -> StoreError:
        message = f"{self.uri(key)}: {err}"
        if isinstance(err, FileNotFoundError) or "not exist" in str(err):
            return ObjectNotFound(message)
        return StoreError(message)


# --- S3 ----------------------------------------------------------------------------------------
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "ResourceNotFound", "NoSuchUpload", "NotFound"}
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AuthorizationHeaderMalformed",
}
_TRANSIENT = {
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "OperationAborted",
    "XMinioServerNotInitialized",
}


class S3Store:
    """Artifacts under ``s3://bucket/prefix`` through the ``minio`` SDK and pyarrow."""

    def __init__(
        self, bucket: str, prefix: str, settings: S3Settings, retry: RetryPolicy | None = None
    ) -> None:
        from minio import Minio
        from urllib3 import PoolManager, Timeout

        _check_bucket(bucket, prefix)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.settings = settings
        self.retry = retry or RetryPolicy()
        self.root_uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        # Retries are ours (whole calls, with backoff and clear errors), not urllib3's.
        http = PoolManager(timeout=Timeout(connect=5.0, read=60.0), retries=False, maxsize=10)
        self.client = Minio(
            settings.endpoint or "s3.amazonaws.com",
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            session_token=settings.session_token,
            secure=settings.secure,
            region=settings.region,
            http_client=http,
        )
        self._arrow: pafs.S3FileSystem | None = None
        self._bucket_seen = False

    def __repr__(self) -> str:
        return f"S3Store({self.root_uri!r}, endpoint={self.settings.endpoint!r})"

    def _name(self, key: str) -> str:
        key = _check_key(key)
        return "/".join(p for p in (self.prefix, key) if p)

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._name(key)}"

    def _call(self, key: str, what: str, fn: Callable[[], T]) -> T:
        from minio.error import InvalidResponseError, S3Error, ServerError
        from urllib3.exceptions import HTTPError

        uri = self.uri(key)
        delays = self.retry.delays()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except S3Error as err:
                if err.code == "NoSuchBucket":
                    raise BucketNotFound(f"{uri}: bucket {self.bucket!r} does not exist") from None
                if err.code in _NOT_FOUND:
                    raise ObjectNotFound(f"{uri}: no such object") from None
                if err.code in _DENIED:
                    raise AccessDenied(
                        f"{uri}: access denied ({err.code}) to {what}; check AWS_ACCESS_KEY_ID "
                        "and AWS_SECRET_ACCESS_KEY and the bucket's policy"
                    ) from None
                if err.code not in _TRANSIENT:
                    detail = self.settings.redact(err.message or "")
                    raise StoreError(f"{uri}: {what} failed: {err.code}: {detail}") from None
                reason = f"{err.code}: {err.message}"
            except (ServerError, InvalidResponseError) as err:
                reason = f"HTTP {getattr(err, '_code', '')} {type(err).__name__}"
            except (HTTPError, ConnectionError, TimeoutError) as err:
                reason = f"{type(err).__name__}: {err}"
            reason = self.settings.redact(reason)
            delay = next(delays, None)
            if delay is None:
                raise StoreUnavailable(
                    f"{uri}: {what} failed after {attempt} attempts: {reason}"
                ) from None
            log.warning("%s: %s failed (%s); retry %d in %.1f s", uri, what, reason, attempt, delay)
            time.sleep(delay)

    def _check_writable(self, key: str) -> None:
        """Before the first write: the bucket must exist (some servers, SeaweedFS among them,
        would create it on the first PUT, and a typo in the URI would become a new bucket)."""
        if self._bucket_seen:
            return
        if not self._call(key, "stat", lambda: self.client.bucket_exists(self.bucket)):
            raise BucketNotFound(
                f"{self.uri(key)}: bucket {self.bucket!r} does not exist; create it first "
                "(mc mb, aws s3 mb) or fix the URI"
            )
        self._bucket_seen = True

    def put_bytes(self, key: str, data: bytes) -> None:
        name = self._name(key)
        self._check_writable(key)
        self._call(
            key,
            "upload",
            lambda: self.client.put_object(self.bucket, name, io.BytesIO(data), len(data)),
        )
        TRAFFIC.add(written=len(data))

    def put_file(
        self, key: str, path: str | os.PathLike[str], progress: Progress | None = None
    ) -> None:
        name = self._name(key)
        self._check_writable(key)
        hook = _MinioProgress(progress) if progress else None
        # An S3 object appears whole when its single PUT or its multipart upload completes.
        self._call(
            key,
            "upload",
            lambda: self.client.fput_object(self.bucket, name, os.fspath(path), progress=hook),
        )
        TRAFFIC.add(written=os.path.getsize(path))

    def get_bytes(self, key: str = "") -> bytes:
        name = self._name(key)

        def get() -> bytes:
            response = self.client.get_object(self.bucket, name)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        data = self._call(key, "download", get)
        TRAFFIC.add(read=len(data))
        return data

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        name = self._name(key)
        # minio writes PATH.part.minio and renames it over PATH when complete.
        self._call(key, "download", lambda: self.client.fget_object(self.bucket, name, str(path)))
        TRAFFIC.add(read=os.path.getsize(path))

    def exists(self, key: str = "") -> bool:
        name = self._name(key)
        if not name:
            return False  # the bucket itself is not an object
        try:
            self._call(key, "stat", lambda: self.client.stat_object(self.bucket, name))
        except BucketNotFound:
            raise
        except ObjectNotFound:
            return False
        return True

    def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._name(prefix)
        start = f"{base}/" if base else ""
        root = f"{self.prefix}/" if self.prefix else ""

        def listing() -> list[ObjectInfo]:
            objects = self.client.list_objects(self.bucket, prefix=start, recursive=True)
            return [
                ObjectInfo(o.object_name[len(root) :], o.size or 0)
                for o in objects
                if o.object_name and not o.is_dir
            ]

        return sorted(self._call(prefix, "list", listing), key=lambda o: o.key)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call(key, "delete", lambda: self.client.remove_object(self.bucket, name))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object below ``prefix`` (as ``list_objects`` lists them), in batches
        of S3's multi-object delete; returns how many. Nothing there is no error; the store's
        root itself is refused."""
        from minio.deleteobjects import DeleteObject

        objects = self.list_objects(_check_prefix(prefix))
        names = [self._name(o.key) for o in objects]

        def remove() -> None:
            # minio sends up to 1,000 keys a request; the errors come back as it is iterated.
            for failed in self.client.remove_objects(
                self.bucket, (DeleteObject(name) for name in names)
            ):
                kind = AccessDenied if failed.code in _DENIED else StoreError
                raise kind(
                    f"s3://{self.bucket}/{failed.name}: delete failed: {failed.code}: "
                    f"{self.settings.redact(failed.message or '')}"
                )

        if names:
            self._call(prefix, "delete", remove)
        return len(names)

    def arrow_path(self, key: str = "") -> tuple[pafs.FileSystem, str]:
        if self._arrow is None:
            s = self.settings
            self._arrow = pafs.S3FileSystem(
                access_key=s.access_key,
                secret_key=s.secret_key,
                session_token=s.session_token,
                region=s.region,
                endpoint_override=s.endpoint,
                scheme="https" if s.secure else "http",
                connect_timeout=5.0,
                request_timeout=60.0,
                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=self.retry.attempts),
                allow_bucket_creation=False,
                allow_bucket_deletion=False,
            )
        return self._arrow, f"{self.bucket}/{self._name(key)}"

    def arrow_error(self, key: str, err: BaseException) -> StoreError:
        """A pyarrow S3 error as a ``StoreError`` naming the URI (credentials redacted)."""
        text = self.settings.redact(str(err))
        uri = self.uri(key)
        if re.search(r"NoSuchBucket|bucket does not exist", text, re.IGNORECASE):
            return BucketNotFound(f"{uri}: bucket {self.bucket!r} does not exist")
        if re.search(r"NoSuchKey|Path does not exist|RESOURCE_NOT_FOUND|404", text):
            return ObjectNotFound(f"{uri}: no such object")
        if re.search(r"ACCESS_DENIED|AccessDenied|InvalidAccessKey|SignatureDoesNot|403", text):
            return AccessDenied(
                f"{uri}: access denied; check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        if re.search(r"NETWORK_CONNECTION|connect|Couldn't|timed out|UNKNOWN", text, re.I):
            return StoreUnavailable(f"{uri}: {text}")
        return StoreError(f"{uri}: {text}")
