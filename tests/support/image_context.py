"""An image's package as its Dockerfile installs it, without a container engine: the build
context laid out as docker sends it, the Dockerfile's ``COPY`` steps replayed into the folder
its ``pip install ... .`` runs in, and that tree built into a wheel and installed into a venv of
its own, where the checkout cannot be seen.

    venv = image_venv(REPO / "images/trace/Dockerfile")
    venv.run(import_check(dockerfile), cwd=tmp_path)     # the Dockerfile's own RUN python -c
    with venv.runs_steps(tmp_path): run_local(...)       # KFP's steps and Ray's workers there

- ``DockerIgnore``: ``.dockerignore`` with Docker's rules (moby's ``ignorefile`` and
  ``patternmatcher``): patterns relative to the context root (a leading ``/`` or ``./`` is
  dropped, each is cleaned as Go's ``filepath.Clean`` does), Go's ``filepath.Match`` syntax
  plus ``**`` (any number of folders, none included), ``!`` exceptions, the last pattern that
  matches a path decides, and a path is excluded when it or one of its parent folders is
  (unless a later exception matches the path or a parent).
- ``install_tree``: the files the install step sees: the Dockerfile's stage that installs the
  package, its ``COPY`` instructions from the build context (``COPY --from`` skipped) with
  ``src... dest`` relative to the ``WORKDIR`` in force, a folder's contents copied into
  ``dest``, up to that ``RUN``; a source the context lacks fails as the build would.
- ``image_venv``: that tree built into a wheel (non-editable) and installed ``--no-deps`` into
  a fresh venv. The requirements come from this environment: its ``site-packages`` is on the
  venv's path through a plain folder line of a ``.pth`` file, which does not run that folder's
  own ``.pth`` files, so the editable install's hook (``__editable__...pth``) never puts the
  checkout on the path; every use checks that ``trace_core`` imports from the venv. The
  requirements' commands (``ray``, ...) are written into the venv's ``bin`` for its Python.

The venv is cached per image under ``build/image-context/<image>/<key>/``, the key a digest of
the install tree's files and of this environment, built under a file lock (``pytest -n``
workers share it) and marked ready only once whole (a venv cannot be moved once made, so it is
built in place and its ``ready`` file written last, by rename). Another key's venv is removed
once unused for an hour (a session started before an edit may still be running on it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from packaging.requirements import Requirement

from support.image_requirements import _instructions as instructions

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "image-context"
FORMAT = "1"
"""Part of the cache key: bump it when the way a venv is built changes."""
UNUSED_S = 3600
"""Another key's venv unused this long is removed."""
SUITE_BIN = Path(sys.executable).parent
SUITE_SITE = Path(sysconfig.get_paths()["purelib"])


# --- .dockerignore --------------------------------------------------------------------------
def _clean(path: str) -> str:
    """Go's ``filepath.Clean`` on a slash path (``posixpath.normpath`` keeps a leading ``//``)."""
    return posixpath.normpath(re.sub("/+", "/", path))


@dataclass(frozen=True)
class Pattern:
    """One cleaned line of a ``.dockerignore``, compiled as moby's ``patternmatcher`` does."""

    text: str
    exception: bool
    """A ``!`` line: what it matches is put back."""

    def matches(self, path: str) -> bool:
        kind, regex = self._compiled
        if kind == "exact":
            return path == self.text
        if kind == "prefix":  # "dir/**": everything below dir
            return path.startswith(self.text[:-2])
        if kind == "suffix":  # "**/name" (or "**name"): anything ending so, or "name" itself
            suffix = self.text[2:]
            return path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
        return re.match(regex, path) is not None

    @cached_property
    def _compiled(self) -> tuple[str, str]:
        """(match kind, regex), by moby's ``Pattern.compile`` rune by rune: ``*`` and ``?``
        stop at ``/``, ``**`` (and ``**/``) crosses folders, ``\\`` escapes the next rune."""
        regex, kind, text, i, n = "^", "exact", self.text, 0, len(self.text)
        token = 0
        while i < n:
            ch, i = text[i], i + 1
            if ch == "*" and i < n and text[i] == "*":
                i += 1
                if i < n and text[i] == "/":  # "**/" is "**"
                    i += 1
                if i == n:  # "**" at the end: everything (below what precedes it)
                    if kind == "exact":
                        kind = "prefix"
                    else:
                        regex, kind = regex + ".*", "regex"
                else:  # any number of folders, none included
                    regex, kind = regex + "(.*/)?", "regex"
                if token == 0:
                    kind = "suffix"
            elif ch == "*":
                regex, kind = regex + "[^/]*", "regex"
            elif ch == "?":
                regex, kind = regex + "[^/]", "regex"
            elif ch in ".+()|{}$":
                regex += "\\" + ch
            elif ch == "\\":
                if i < n:
                    regex, kind, i = regex + "\\" + text[i], "regex", i + 1
                else:
                    regex += "\\\\"
            elif ch in "[]":
                regex, kind = regex + ch, "regex"
            else:
                regex += ch
            token += 1
        return kind, regex + "$"


@dataclass(frozen=True)
class DockerIgnore:
    """A ``.dockerignore``'s patterns, in order."""

    patterns: tuple[Pattern, ...]

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        """The lines as moby's ``ignorefile.ReadAll`` reads them: a line starting with ``#``
        is a comment, the rest are trimmed, cleaned and made relative to the context root."""
        patterns = []
        for n, raw in enumerate(text.splitlines()):
            line = raw.removeprefix("\ufeff") if n == 0 else raw
            if line.startswith("#"):
                continue
            line = line.strip()
            if not line:
                continue
            exception = line.startswith("!")
            if exception:
                line = line[1:].strip()
                if not line:
                    raise ValueError('.dockerignore: illegal exclusion pattern: "!"')
            line = _clean(line)
            if len(line) > 1 and line.startswith("/"):
                line = line[1:]
            patterns.append(Pattern(line, exception))
        return cls(tuple(patterns))

    @classmethod
    def read(cls, context: Path) -> DockerIgnore:
        path = context / ".dockerignore"
        return cls.parse(path.read_text() if path.is_file() else "")

    def excluded(self, path: str) -> bool:
        """Whether ``path`` (relative to the context root, with ``/``) is left out of the
        context: the last pattern matching it or one of its parent folders decides."""
        path = _clean(path)
        parent = posixpath.dirname(path) or "."
        parents = [] if parent == "." else parent.split("/")
        parent_paths = ["/".join(parents[: i + 1]) for i in range(len(parents))]
        excluded = False
        for pattern in self.patterns:
            if pattern.exception != excluded:  # it could not change the outcome
                continue
            if pattern.matches(path) or any(pattern.matches(p) for p in parent_paths):
                excluded = not pattern.exception
        return excluded

    def may_include_below(self, folder: str) -> bool:
        """Whether an exception could put back something below the excluded ``folder`` (the
        walk then goes on into it, as docker's does; else the folder is skipped whole)."""
        parts = _clean(folder).split("/")
        for pattern in self.patterns:
            if not pattern.exception:
                continue
            steps = pattern.text.split("/")
            for part, step in zip(parts, steps, strict=False):
                if "**" in step:
                    return True
                if not Pattern(step, False).matches(part):
                    break
            else:
                if len(steps) > len(parts):
                    return True
        return False

    def context_files(self, context: Path) -> tuple[list[str], list[str]]:
        """(folders, files) of ``context`` that are sent, relative, with ``/``: a folder is sent
        when it is not excluded, or when something below it is put back."""
        folders: set[str] = set()
        files: list[str] = []
        for top, dirs, names in os.walk(context):
            here = Path(top).relative_to(context).as_posix()
            keep = []
            for name in sorted(dirs):
                rel = name if here == "." else f"{here}/{name}"
                if not self.excluded(rel):
                    folders.add(rel)
                    keep.append(name)
                elif self.may_include_below(rel):
                    keep.append(name)
            dirs[:] = keep
            for name in sorted(names):
                rel = name if here == "." else f"{here}/{name}"
                if not self.excluded(rel):
                    files.append(rel)
                    parts = rel.split("/")[:-1]
                    folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return sorted(folders), files


# --- the Dockerfile's COPY steps ------------------------------------------------------------
_INSTALL = re.compile(r"pip install\b[^&|;]*?\s['\"]?\.(\[[\w,.-]+\])?['\"]?(?=\s|$)")
"""A ``pip install`` of the build folder itself (``.`` or ``'.[extra]'``)."""


@dataclass(frozen=True)
class Copy:
    """A ``COPY`` from the build context: its sources and where they go in the image."""

    sources: tuple[str, ...]
    dest: str
    """Absolute: a relative ``dest`` joined to the ``WORKDIR`` in force."""


def parse_copy(args: str, workdir: str) -> Copy | None:
    """A ``COPY`` instruction's arguments (shell or JSON form); None for ``COPY --from=...``."""
    words = json.loads(args) if args.lstrip().startswith("[") else shlex.split(args)
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--from"):
            return None
        if flag.split("=")[0] in ("--parents", "--exclude"):
            raise NotImplementedError(f"COPY {flag}: not replayed here")
    if len(words) < 2 or any("$" in word for word in words):
        raise ValueError(f"COPY {args}: expected literal src... dest")
    *sources, dest = words
    absolute = posixpath.join(workdir, dest)
    return Copy(tuple(sources), absolute + "/" if dest.endswith("/") else absolute)


@dataclass(frozen=True)
class InstallStep:
    """What a Dockerfile's ``pip install ... .`` sees: the copies before it, in its stage,
    and the folder it runs in."""

    copies: tuple[Copy, ...]
    workdir: str
    run: str


def install_step(dockerfile: Path) -> InstallStep:
    """The stage that installs the package from the build folder, up to that ``RUN``."""
    copies: list[Copy] = []
    workdir = "/"
    for op, args in instructions(dockerfile):
        if op == "FROM":
            copies, workdir = [], "/"
        elif op == "WORKDIR":
            workdir = posixpath.join(workdir, args.strip())
        elif op == "COPY":
            copy = parse_copy(args, workdir)
            if copy is not None:
                copies.append(copy)
        elif op == "RUN" and _INSTALL.search(args):
            return InstallStep(tuple(copies), workdir, args)
    raise ValueError(f"{dockerfile}: no RUN pip install of the build folder (.)")


class NotInContext(FileNotFoundError):
    """A ``COPY`` source the build context lacks (missing, or left out by .dockerignore)."""


def install_tree(dockerfile: Path, target: Path, context: Path = REPO) -> Path:
    """Lay out under ``target`` (as the image's ``/``) what the install step's ``COPY``
    instructions put there from ``context`` filtered by its ``.dockerignore``; return the
    folder the install runs in (``target`` + its ``WORKDIR``)."""
    step = install_step(dockerfile)
    folders, files = DockerIgnore.read(context).context_files(context)
    sent = set(folders) | set(files)
    for copy in step.copies:
        destination = target / copy.dest.lstrip("/")
        for source in copy.sources:
            pattern = Pattern(_clean(source).lstrip("/") or ".", False)
            found = ["."] if pattern.text == "." else sorted(filter(pattern.matches, sent))
            if not found:
                raise NotInContext(
                    f"{dockerfile}: COPY {source}: not in the build context "
                    "(missing, or excluded by .dockerignore)"
                )
            for match in found:
                if match == "." or match in folders:  # a folder: its contents into dest
                    below = "" if match == "." else match + "/"
                    for name in files:
                        if name.startswith(below):
                            _copy_file(context / name, destination / name[len(below) :])
                    for name in folders:
                        if name.startswith(below):
                            (destination / name[len(below) :]).mkdir(parents=True, exist_ok=True)
                    destination.mkdir(parents=True, exist_ok=True)
                elif copy.dest.endswith("/") or len(copy.sources) > 1 or destination.is_dir():
                    _copy_file(context / match, destination / posixpath.basename(match))
                else:
                    _copy_file(context / match, destination)
    return target / step.workdir.lstrip("/")


def _copy_file(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target, follow_symlinks=False)


def import_check(dockerfile: Path, program: Sequence[str] = ("python", "python3")) -> list[str]:
    """The last ``RUN python -c "..."`` of the Dockerfile, as argv (the image's own check)."""
    for op, args in reversed(instructions(dockerfile)):
        words = shlex.split(args) if op == "RUN" else []
        if len(words) == 3 and words[0] in program and words[1] == "-c":
            return words
    raise ValueError(f"{dockerfile}: no RUN python -c ...")


def command(dockerfile: Path) -> list[str]:
    """The image's ``CMD`` (JSON form), as argv."""
    cmd = [args for op, args in instructions(dockerfile) if op == "CMD"]
    if not cmd:
        raise ValueError(f"{dockerfile}: no CMD")
    return list(json.loads(cmd[-1]))


# --- the venv -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageVenv:
    """A venv holding an image's package as the image installs it."""

    image: str
    prefix: Path

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) as in the image: the venv's ``bin``
        first on PATH and this environment's off it, no PYTHONPATH."""
        env = dict(os.environ if base is None else base)
        for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH"):
            env.pop(name, None)
        rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != SUITE_BIN]
        env["PATH"] = os.pathsep.join([str(self.prefix / "bin"), *rest])
        env["VIRTUAL_ENV"] = str(self.prefix)
        return env

    def run(
        self,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` in the venv (its first word looked up in the venv's ``bin``), in ``cwd``
        (never the checkout: a step's working folder is not the source tree)."""
        if Path(cwd).resolve().is_relative_to(REPO):
            raise ValueError(f"{cwd}: run outside the checkout, or it is on the path")
        program = self.prefix / "bin" / argv[0]
        full = [str(program) if program.exists() else argv[0], *argv[1:]]
        return subprocess.run(
            full, cwd=cwd, env=self.environ(env), capture_output=True, text=True, timeout=timeout
        )

    @contextlib.contextmanager
    def runs_steps(self, workdir: Path) -> Iterator[None]:
        """For the block, this process starts Python programs as in the image: ``sys.executable``
        is the venv's Python (what KFP's ``SubprocessRunner(use_venv=False)`` runs each step
        with, and where ``pipelines.ray_head`` finds ``ray``: the Ray head, and so its workers,
        run on it too), the environment is ``environ()`` and the working folder ``workdir``
        (a step started in the checkout would import the checkout: ``python -m`` puts the
        working folder first on ``sys.path``)."""
        saved = sys.executable, dict(os.environ), Path.cwd()
        sys.executable = str(self.python)
        os.environ.clear()
        os.environ.update(self.environ(saved[1]))
        os.chdir(workdir)
        try:
            yield
        finally:
            sys.executable = saved[0]
            os.environ.clear()
            os.environ.update(saved[1])
            os.chdir(saved[2])

    def check_isolated(self, workdir: Path) -> None:
        """Raise unless ``trace_core`` imports from the venv, and nothing of the checkout is
        on its path."""
        probe = "import json, sys, trace_core; print(json.dumps([trace_core.__file__, sys.path]))"
        done = self.run(["python", "-c", probe], cwd=workdir)
        if done.returncode != 0:
            raise RuntimeError(f"{self.python}: import trace_core failed:\n{done.stderr}")
        origin, path = json.loads(done.stdout)
        if not Path(origin).resolve().is_relative_to(self.prefix.resolve()):
            raise RuntimeError(f"{self.python}: trace_core imports from {origin}, not the venv")
        seen = [p for p in path if p and Path(p).resolve().is_relative_to(REPO.resolve())]
        allowed = [self.prefix.resolve(), SUITE_SITE.resolve()]
        if any(not any(Path(p).resolve().is_relative_to(a) for a in allowed) for p in seen):
            raise RuntimeError(f"{self.python}: the checkout is on its path: {seen}")


def user_env(tmp_path: Path) -> dict[str, str]:
    """This environment with a home of its own under ``tmp_path``, as the image's user has
    (nothing mounted over it)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home)}


def image_venv(dockerfile: Path) -> ImageVenv:
    """The venv of ``dockerfile``'s package: from the cache when its install tree is the
    same, else built (under a lock) and checked."""
    image = dockerfile.parent.name
    with tempfile.TemporaryDirectory(prefix="image-context-") as work:
        tree = install_tree(dockerfile, Path(work) / "root")
        key = _digest(tree)
        home = CACHE / image / key
        venv = ImageVenv(image, home / "venv")
        CACHE.mkdir(parents=True, exist_ok=True)
        with (CACHE / f"{image}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ready = home / "ready"
            if not ready.is_file():
                shutil.rmtree(home, ignore_errors=True)
                _build(tree, venv, Path(work))
            venv.check_isolated(Path(work))
            partial = home / "ready.partial"
            partial.write_text(f"{dockerfile.relative_to(REPO)}\n")
            partial.replace(ready)  # also: when it was last used
            for other in (CACHE / image).iterdir():
                used = other / "ready"
                last = used.stat().st_mtime if used.is_file() else 0.0
                if other != home and time.time() - last > UNUSED_S:
                    shutil.rmtree(other, ignore_errors=True)
    return venv


def _digest(tree: Path) -> str:
    """The install tree's files (names and bytes) and what the venv is built from."""
    digest = hashlib.sha256(f"{FORMAT}\n{sys.version}\n{SUITE_SITE}\n".encode())
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(tree).as_posix()}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:20]


def _build(tree: Path, venv: ImageVenv, work: Path) -> None:
    """Wheel from ``tree``; a fresh venv; the wheel installed alone; then the requirements'
    folder on its path and their commands in its ``bin``."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    wheels = work / "wheels"
    isolation = ["--no-build-isolation"] if _build_requirements_met(tree) else []
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", wheels, tree],
        work,
        env,
    )
    (wheel,) = wheels.glob("*.whl")
    _run([sys.executable, "-m", "venv", venv.prefix], work, env)
    install = [venv.python, "-m", "pip", "install", "--no-deps", "--no-index", wheel]
    _run(install, work, env)  # before the .pth: pip must not see this environment's trace-rl
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([venv.python, "-c", purelib], work, env).stdout.strip())
    (site / "_image_requirements.pth").write_text(f"{SUITE_SITE}\n")
    _copy_scripts(venv)


def _build_requirements_met(tree: Path) -> bool:
    """Whether this environment has what ``[build-system] requires`` asks (then the wheel is
    built without isolation, offline)."""
    requires = tomllib.loads((tree / "pyproject.toml").read_text())["build-system"]["requires"]
    for text in requires:
        requirement = Requirement(text)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            return False
        if not requirement.specifier.contains(version, prereleases=True):
            return False
    return True


def _copy_scripts(venv: ImageVenv) -> None:
    """This environment's console scripts (``ray``, ``kfp``, ...) that the venv lacks, with
    the venv's Python in their ``#!`` line, as ``pip install`` writes them in the image."""
    bin_dir = venv.prefix / "bin"
    for script in sorted(SUITE_BIN.iterdir()):
        target = bin_dir / script.name
        if target.exists() or not script.is_file():
            continue
        with script.open("rb") as f:
            first = f.readline()
        interpreter = (
            Path(first[2:].decode(errors="replace").strip()) if first[:2] == b"#!" else None
        )
        if interpreter is None or interpreter.parent != SUITE_BIN:
            continue
        body = script.read_bytes()[len(first) :]
        target.write_bytes(f"#!{venv.python}\n".encode() + body)
        target.chmod(0o755)


def _run(
    argv: Sequence[object], cwd: Path, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    command = [str(a) for a in argv]
    done = subprocess.run(
        command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed:\n{done.stdout}\n{done.stderr}")
    return done
