"""TorchEngine's compiled decode step (``decode_step.cpp``): built once for the torch a process
imports, loaded on first use.

    python -m trace_core.policy.native      # build it now (make setup and the images do)

A decode step of a small policy is ≈100 torch operations on small tensors, and on a CPU each
costs more in Python (argument parsing, tensor wrapping, the interpreter) than in arithmetic.
``decode_step.cpp`` makes the same ATen calls from C++ as ``decode._decode_step_python`` (the
layers) and ``decode._sample_step_python`` (the head and the draw), so its results are the
Python ones' bit for bit, for two calls' Python cost a step instead of a hundred.

**Build.** One C++ file compiled with the system's C++ compiler (``$CXX``, else ``c++``/``g++``)
against the headers and libraries of the imported torch, into
``<sys.prefix>/share/trace-rl/native`` (the venv's own folder; the images build it there), or
``~/.cache/trace-rl/native`` where that is not writable, or ``$TRACE_NATIVE_DIR`` when set. The
file's name holds a hash of the source, the torch version and the compile command, so a new
torch or a changed source builds anew and never loads a stale library. Builds are serialised by
a lock file and written under a temporary name first.

**Fallback.** Without a compiler, or on a GPU, or with ``TRACE_NATIVE=0``, the engine decodes in
Python (the same tokens, ≈1.1–1.3× slower on the tiny bench policy); the first engine to find
the library missing logs why once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.cpp")
DISABLE = "TRACE_NATIVE"
"""Set to 0 to decode in Python."""
DIRECTORY = "TRACE_NATIVE_DIR"
"""Where to build and look for the library, instead of the defaults (module docstring)."""
BUILD_TIMEOUT_S = 600

UPSTREAM = (
    "torch.ops.load_library(path)",
    "torch.__version__",
    # The ATen functions decode_step.cpp calls are C++ (ATen/ATen.h of the imported torch): the
    # compiler checks them against that torch's own headers when it builds the library, and
    # tests/policy/test_upstream_source.py against the GPU image's torch.
)
"""What this module calls in torch (``policy.upstream``: entry syntax there)."""


class NativeUnavailable(RuntimeError):
    """The compiled step cannot be built or loaded here; the message says why."""


_ops: Any = None  # torch.ops.trace_native, once loaded
_reason: str | None = None  # why it is not loaded, once looked for
_looked = False
_off = 0  # open ``off()`` blocks


def decode_step() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.trace_native.decode_step`` (``decode.decode_step``'s arguments), built if
    needed, or None (then ``reason()`` says why). None inside ``off()``."""
    ops = _library()
    return None if ops is None else ops.decode_step  # type: ignore[no-any-return]


def sample_step() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.trace_native.sample_step`` (``decode.sample_step``'s), or None: as
    ``decode_step``."""
    ops = _library()
    return None if ops is None else ops.sample_step  # type: ignore[no-any-return]


def _library() -> Any:
    """The library's ops, looked for once per process; None when it is not loaded or off."""
    global _ops, _reason, _looked
    if _off:
        return None
    if not _looked:
        _looked = True
        try:
            _ops = load()
        except NativeUnavailable as e:
            _reason = str(e)
            log.warning(
                "TorchEngine decodes in Python (%s); `python -m trace_core.policy.native` builds "
                "its compiled step",
                _reason,
            )
    return _ops


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Decode in Python in this process for the block (``bench engine`` pairs the two steps)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def reason() -> str | None:
    """Why the ops are None (None while they have not been asked for, or when they loaded)."""
    return _reason


def load() -> Any:
    """Build the library unless it is built, load it, and return its ops
    (``torch.ops.trace_native``)."""
    if os.environ.get(DISABLE, "1") == "0":
        raise NativeUnavailable(f"{DISABLE}=0")
    if not hasattr(torch.ops.trace_native, "decode_step"):  # not loaded in this process yet
        path = built() or build()
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise NativeUnavailable(f"{path} does not load: {e}") from None
    return torch.ops.trace_native


def library_name() -> str:
    """The library's file name: a hash of the source, the torch version and the command."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([torch.__version__, *command(Path("out.so"))]).encode())
    return f"trace_native-{digest.hexdigest()[:16]}.so"


def directories() -> list[Path]:
    """Where the library is looked for, in order (the first writable one is built into)."""
    if os.environ.get(DIRECTORY):
        return [Path(os.environ[DIRECTORY])]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(sys.prefix) / "share" / "trace-rl" / "native", cache / "trace-rl" / "native"]


def built() -> Path | None:
    """The library built for this torch and source, if one is."""
    name = library_name()
    return next((d / name for d in directories() if (d / name).is_file()), None)


def build() -> Path:
    """Compile the library into the first writable folder of ``directories()`` (at once if
    another process built it meanwhile); its path."""
    cxx = compiler()
    if cxx is None:
        raise NativeUnavailable("no C++ compiler: set CXX or install g++")
    problems = []
    for folder in directories():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _locked(folder):
                out = folder / library_name()
                if not out.is_file():
                    _compile(cxx, out)
                return out
        except OSError as e:
            problems.append(f"{folder}: {e.strerror or e}")
    raise NativeUnavailable("no writable folder for the library: " + "; ".join(problems))


def compiler() -> str | None:
    """``$CXX``, else ``c++`` or ``g++`` on PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def command(out: Path, compiler: str = "c++", root: Path | None = None) -> list[str]:
    """The compile command: ``compiler`` building ``out`` against the torch installed at
    ``root`` (default: the imported one's folder)."""
    root = root or Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        compiler,
        "-O2",
        "-std=c++20",  # as torch's own extensions build
        "-shared",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        str(SOURCE),
        f"-L{root / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{root / 'lib'}",
        "-o",
        str(out),
    ]


def _compile(compiler: str, out: Path) -> None:
    log.info("building TorchEngine's compiled decode step into %s (once, ≈15 s)", out)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        try:
            done = subprocess.run(
                command(part, compiler), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeUnavailable(f"{compiler} did not run: {e}") from None
        if done.returncode:
            tail = "\n".join(done.stderr.strip().splitlines()[-20:])
            raise NativeUnavailable(f"{compiler} failed ({done.returncode}):\n{tail}")
        part.replace(out)  # whole or not at all: a reader never sees a half-written library


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main() -> int:
    """Build (unless built) and load the library; print its path, or why it cannot be."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        load()
    except NativeUnavailable as e:
        print(f"TorchEngine's compiled decode step is not available: {e}", file=sys.stderr)
        return 1
    print(f"TorchEngine's compiled decode step: {built()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
