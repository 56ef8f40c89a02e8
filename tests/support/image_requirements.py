"""Do an image's pins satisfy every requirement its packages declare? Read from the wheels'
metadata on PyPI (``Requires-Dist``), for the image's platform and Python, without a container
engine or an install.

    python tests/support/image_requirements.py gpu      # or cpu; exit 1 and one line per failure

Roots: the project's dependencies from pyproject.toml with the extras the image installs (the
GPU image: ``vllm``, at its pinned release). Every requirement reached from them, transitively,
with markers evaluated for the image (extras included), is checked against the image's
constraints:

- a pinned package: the pin must satisfy the specifier; its metadata at the pin is read on;
- a package without a pin: pip picks one of its releases with a wheel for the image. A
  release is viable when every requirement it makes of a pinned package holds at the pins. If
  none is, the image cannot resolve (as with mistral-common against numpy 2.4 under vllm
  0.33.0); else the newest viable release is read on.

Each failure names the package, the requirement and the pin. Every document fetched (PyPI's
JSON simple index and the ``.metadata`` files of PEP 658) is cached under
``build/image-requirements/``, so a second run reads no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import tomllib
import urllib.error
import urllib.parse
import zipfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "image-requirements"
INDEX = "https://pypi.org/simple"
MAX_CANDIDATES = 40
"""Releases of an unpinned package tried, newest first, before it counts as unresolvable."""
FETCHERS = 16
"""Documents read from PyPI at once: each pin's index and metadata when a check starts, then
the unpinned packages' as the check reaches them."""


@dataclass(frozen=True)
class Image:
    """What an image installs, and where."""

    name: str
    python: tuple[int, int]
    extras: tuple[str, ...]
    """The project's extras the image installs."""
    dockerfile: Path

    @property
    def environment(self) -> dict[str, str]:
        """PEP 508 marker variables of the image (Linux, x86_64, CPython)."""
        version = ".".join(map(str, self.python))
        return {
            "python_version": version,
            "python_full_version": f"{version}.0",
            "implementation_name": "cpython",
            "implementation_version": f"{version}.0",
            "platform_python_implementation": "CPython",
            "platform_system": "Linux",
            "platform_machine": "x86_64",
            "sys_platform": "linux",
            "os_name": "posix",
            "platform_release": "",
            "platform_version": "",
        }

    def tags(self) -> set[Tag]:
        """The wheel tags pip accepts there (glibc 2.35, as in both bases)."""
        platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 4, -1)]
        platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
        platforms += ["linux_x86_64"]
        return set(cpython_tags(self.python, platforms=platforms)) | set(
            compatible_tags(self.python, f"cp{self.python[0]}{self.python[1]}", platforms)
        )


IMAGES = {
    "gpu": Image("trace-gpu", (3, 12), ("vllm",), REPO / "images/trace-gpu/Dockerfile"),
    "cpu": Image("trace", (3, 11), (), REPO / "images/trace/Dockerfile"),
}


def parse_pins(text: str) -> dict[str, Version]:
    """Canonical name → version of each ``name==version`` line (comments and blanks dropped)."""
    pins = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"constraints line {n}: not name==version: {raw!r}")
        pins[canonicalize_name(name.strip())] = Version(version.strip().split(";")[0])
    return pins


def gpu_constraints() -> str:
    """The GPU image's constraints, made by its Dockerfile's own awk step on the real files."""
    run = next(
        args for op, args in _instructions(IMAGES["gpu"].dockerfile) if args.startswith("awk")
    )
    with tempfile.TemporaryDirectory() as work:
        target = Path(work) / "gpu-constraints.txt"
        command = run.replace("\n", " ").replace("/tmp/gpu-constraints.txt", str(target))
        subprocess.run(["sh", "-c", command], cwd=REPO, check=True, timeout=30)
        return target.read_text()


def image_constraints(image: str) -> str:
    return (
        gpu_constraints() if image == "gpu" else (REPO / "requirements/constraints.txt").read_text()
    )


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    lines, current = [], ""
    for raw in dockerfile.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + "\n"
            continue
        lines.append(current)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


# --- PyPI, cached ---------------------------------------------------------------------------
_AHEAD = ThreadPoolExecutor(FETCHERS)
_TLS = ssl.create_default_context()
_LOCAL = threading.local()


def _get(url: str, headers: Mapping[str, str], timeout: float = 60) -> http.client.HTTPResponse:
    """GET ``url`` over this thread's kept connection to its host (a lookup and a handshake
    for each of hundreds of documents cost more than the documents, and a DNS lookup can
    wait 5 s), following redirects; an HTTP error raises ``urllib.error.HTTPError``. The caller
    reads the whole body before the next request."""
    for _ in range(5):
        parts = urllib.parse.urlsplit(url)
        connections = _LOCAL.__dict__.setdefault("connections", {})
        for attempt in (0, 1):  # a kept connection the server closed: open it again, once
            connection = connections.get(parts.netloc)
            if connection is None:
                connection = http.client.HTTPSConnection(
                    parts.netloc, timeout=timeout, context=_TLS
                )
                connections[parts.netloc] = connection
            try:
                target = parts.path + (f"?{parts.query}" if parts.query else "")
                connection.request("GET", target, headers=dict(headers))
                response = connection.getresponse()
                break
            except (http.client.HTTPException, OSError):
                connection.close()
                del connections[parts.netloc]
                if attempt:
                    raise
        if response.status in (301, 302, 303, 307, 308):
            response.read()
            url = urllib.parse.urljoin(url, response.headers["Location"])
            continue
        if response.status >= 400:
            response.read()
            raise urllib.error.HTTPError(
                url, response.status, response.reason, response.headers, None
            )
        return response
    raise urllib.error.URLError(f"{url}: too many redirects")


def _fetch(url: str, accept: str | None = None) -> bytes:
    """``url``'s body, from the cache when it was fetched before (written whole, then renamed)."""
    path = CACHE / hashlib.sha256(url.encode()).hexdigest()[:32]
    if path.is_file():
        return path.read_bytes()
    body = _get(url, {"Accept": accept} if accept else {}).read()
    _store(path, body)
    return body


def _store(path: Path, body: bytes) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=CACHE)
    with os.fdopen(fd, "wb") as f:
        f.write(body)
    os.replace(temp, path)


_WHEELS: dict[tuple[str, frozenset[Tag]], dict[Version, str]] = {}


def wheels(name: str, tags: set[Tag]) -> dict[Version, str]:
    """Release → metadata URL of a wheel of ``name`` that installs on an image with ``tags``
    (read once a process: numpy's index alone lists thousands of files)."""
    key = (name, frozenset(tags))
    if key not in _WHEELS:
        _WHEELS[key] = _wheels(name, tags)
    return _WHEELS[key]


def _wheels(name: str, tags: set[Tag]) -> dict[Version, str]:
    index = json.loads(_fetch(f"{INDEX}/{name}/", "application/vnd.pypi.simple.v1+json"))
    out: dict[Version, str] = {}
    for entry in index.get("files", []):
        filename = entry["filename"]
        if not filename.endswith(".whl") or entry.get("yanked"):
            continue
        try:
            _, version, _, wheel_tags = parse_wheel_filename(filename)
        except (ValueError, InvalidVersion):
            continue
        if wheel_tags & tags and version not in out:
            out[version] = entry["url"].split("#", 1)[0] + ".metadata"
    return out


def requires(metadata_url: str) -> list[Requirement]:
    """A wheel's ``Requires-Dist``, from its metadata file (PEP 658: served beside every wheel
    PyPI holds, whether or not the index says so)."""
    try:
        text = _fetch(metadata_url)
    except urllib.error.HTTPError as err:
        if err.code != 404:
            raise
        text = _wheel_metadata(metadata_url.removesuffix(".metadata"))
    headers = HeaderParser().parsestr(text.decode("utf-8", "replace"))
    return [Requirement(value) for value in headers.get_all("Requires-Dist") or []]


def _wheel_metadata(wheel_url: str) -> bytes:
    """The METADATA file inside a wheel whose metadata is not served alone (wheels uploaded
    before PEP 658, or an index that does not serve it): read from the wheel's zip directory
    and that one member by range requests, not the whole wheel (a CUDA wheel is tens of MB),
    then cached as its metadata URL would have been."""
    path = CACHE / hashlib.sha256(f"{wheel_url}.metadata".encode()).hexdigest()[:32]
    if path.is_file():
        return path.read_bytes()
    with zipfile.ZipFile(_RemoteFile(wheel_url)) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        body = archive.read(name)
    _store(path, body)
    return body


class _RemoteFile(io.RawIOBase):
    """A file on the index, read by HTTP range requests where ``zipfile`` seeks: its last
    ``TAIL`` bytes first (the zip's directory), then what the member asked for spans. A
    server that ignores ranges sends the whole file, which is then read from memory."""

    TAIL = 1 << 16

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url, self.at = url, 0
        self.size, start, data = self._range(f"bytes=-{self.TAIL}")
        self.chunks = [(start, data)]

    def _range(self, ranged: str) -> tuple[int, int, bytes]:
        """(file size, offset of the bytes sent, the bytes)."""
        response = _get(self.url, {"Range": ranged}, timeout=300)
        data = response.read()
        sent = response.headers.get("Content-Range")  # bytes START-END/SIZE
        if response.status != 206 or not sent:
            return len(data), 0, data
        span, size = sent.split()[1].split("/")
        return int(size), int(span.split("-")[0]), data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.size}[whence]
        self.at = base + offset
        return self.at

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self.size - self.at))
        if not n:
            return 0
        for start, data in self.chunks:
            if start <= self.at and self.at + n <= start + len(data):
                break
        else:
            want = max(n, self.TAIL)
            _, start, data = self._range(f"bytes={self.at}-{min(self.size, self.at + want) - 1}")
            self.chunks.append((start, data))
        piece = data[self.at - start : self.at - start + n]
        buffer[: len(piece)] = piece
        self.at += len(piece)
        return len(piece)


def prefetch(pins: Mapping[str, Version], tags: set[Tag]) -> None:
    """Read every pin's index and its pinned wheel's metadata into the cache, ``FETCHERS`` at
    a time: the check then walks the requirements reading the cache, not the network one
    document after another."""
    list(_AHEAD.map(lambda name: _read_ahead(name, tags, pins[name]), sorted(pins)))


def _read_ahead(name: str, tags: set[Tag], version: Version | None = None) -> None:
    """Cache ``name``'s index and the metadata of ``version`` (default: its newest release,
    which the check most likely reads next for an unpinned package). A document that cannot
    be read here is left to the check, which reads it again where it needs it and says what
    failed."""
    with contextlib.suppress(OSError, ValueError, zipfile.BadZipFile):
        releases = wheels(name, tags)
        if version is None and releases:
            version = max(releases)
        if version in releases:
            requires(releases[version])


# --- the check --------------------------------------------------------------------------------
@dataclass
class Report:
    image: str
    packages: dict[str, Version] = field(default_factory=dict)
    """Every package reached, with the version read (pinned or chosen)."""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def applies(requirement: Requirement, env: Mapping[str, str], extras: Iterable[str]) -> bool:
    """Whether ``requirement`` holds on the image, for a package installed with ``extras``."""
    marker: Marker | None = requirement.marker
    if marker is None:
        return True
    return any(marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))


def check(image_name: str, constraints: str | None = None) -> Report:
    """Check the image ``image_name`` (gpu or cpu) against ``constraints`` (default: its own)."""
    image = IMAGES[image_name]
    pins = parse_pins(constraints if constraints is not None else image_constraints(image_name))
    env, tags = image.environment, image.tags()
    prefetch(pins, tags)
    read_ahead: set[str] = set()  # unpinned packages whose documents were asked for ahead
    report = Report(image.name)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    roots = [Requirement(r) for r in project["dependencies"]]
    for extra in image.extras:
        roots += [Requirement(r) for r in project["optional-dependencies"][extra]]
    work: list[tuple[Requirement, str]] = [(r, "trace-rl") for r in roots]
    seen_extras: dict[str, set[str]] = {}
    # What each requirer asks of a package, by the requirer's name: a requirer read again at
    # another version replaces its own entry.
    wanted: dict[str, dict[str, SpecifierSet]] = {}
    # Failures by (package, requirer): a requirer read again at another version drops its own,
    # so what is reported is what the final choice of every package asks.
    problems: dict[tuple[str, str], str] = {}
    while work:
        requirement, by = work.pop()
        name = canonicalize_name(requirement.name)
        if name == "trace-rl":
            continue
        requirer = by.split()[0]
        problems.pop((name, requirer), None)
        wanted.setdefault(name, {})[requirer] = requirement.specifier
        asked = SpecifierSet()
        for specifier in wanted[name].values():
            asked &= specifier
        if name in pins:
            pin = pins[name]
            if not requirement.specifier.contains(pin, prereleases=True):
                problems[name, requirer] = (
                    f"{name}: {by} requires {requirement}; the pin is {name}=={pin}"
                )
                continue
            version: Version | None = pin
            url = wheels(name, tags).get(pin)
        else:
            chosen = report.packages.get(name)
            if chosen is not None and asked.contains(chosen, prereleases=True):
                version, url = chosen, None  # still the one chosen before
            else:
                version, url, problem = _choose(name, asked, pins, env, tags, by, report.image)
                if problem:
                    problems[name, requirer] = problem
        if version is None:
            continue
        extras = set(requirement.extras)
        new_extras = extras - seen_extras.get(name, set())
        first = name not in report.packages or report.packages[name] != version
        report.packages[name] = version
        if not (first or new_extras):
            continue
        seen_extras.setdefault(name, set()).update(extras)
        if first:  # what an earlier version of it asked no longer counts
            for asks in wanted.values():
                asks.pop(name, None)
            for key in [key for key in problems if key[1] == name]:
                del problems[key]
        if url is None:
            url = wheels(name, tags).get(version)
        if url is None:  # no wheel for the image: pip would build it; its needs are unknown here
            continue
        for child in requires(url):
            if applies(child, env, seen_extras[name]):
                work.append((child, f"{name} {version}"))
                wanted_next = canonicalize_name(child.name)
                if wanted_next not in pins and wanted_next not in read_ahead:
                    read_ahead.add(wanted_next)
                    _AHEAD.submit(_read_ahead, wanted_next, tags)
    report.failures = _verify(report, roots, pins, seen_extras, problems, env, tags)
    return report


def _verify(
    report: Report,
    roots: list[Requirement],
    pins: Mapping[str, Version],
    extras: Mapping[str, set[str]],
    problems: Mapping[tuple[str, str], str],
    env: Mapping[str, str],
    tags: set[Tag],
) -> list[str]:
    """Every requirement of the final set of packages (the pins and the releases chosen)
    checked once more against that set: the search above may have read a package at a release
    it later left, and only what the final set asks counts."""
    failures: set[str] = set()

    def holds(requirement: Requirement, by: str) -> None:
        name = canonicalize_name(requirement.name)
        if name == "trace-rl":
            return
        if name in pins:
            if not requirement.specifier.contains(pins[name], prereleases=True):
                failures.add(
                    f"{name}: {by} requires {requirement}; the pin is {name}=={pins[name]}"
                )
        elif name in report.packages:
            chosen = report.packages[name]
            if not requirement.specifier.contains(chosen, prereleases=True):
                failures.add(
                    f"{name}: {by} requires {requirement}; {name} {chosen} is the one chosen"
                )
        else:
            found = [text for (target, _), text in problems.items() if target == name]
            failures.update(found or [f"{name}: {by} requires {requirement}; no release fits"])

    for requirement in roots:
        if applies(requirement, env, ()):
            holds(requirement, "trace-rl")
    for name, version in report.packages.items():
        url = wheels(name, tags).get(version)
        for child in requires(url) if url else []:
            if applies(child, env, extras.get(name, set())):
                holds(child, f"{name} {version}")
    return sorted(failures)


def _choose(
    name: str,
    specifier: SpecifierSet,
    pins: Mapping[str, Version],
    env: Mapping[str, str],
    tags: set[Tag],
    by: str,
    image: str,
) -> tuple[Version | None, str | None, str]:
    """The newest release of unpinned ``name`` within ``specifier`` whose own requirements on
    pinned packages hold; None (and a failure naming what blocks each) when none does."""
    releases = wheels(name, tags)
    candidates = sorted((v for v in releases if specifier.contains(v)), reverse=True)
    if not candidates:
        candidates = sorted((v for v in releases if specifier.contains(v, True)), reverse=True)
    if not candidates:
        return (
            None,
            None,
            (
                f"{name}{specifier}: {by} requires it, and no release has a wheel for "
                f"{image}'s platform and Python"
            ),
        )
    blocked: dict[str, list[Version]] = {}
    for version in candidates[:MAX_CANDIDATES]:
        conflicts = [
            f"{child} (the pin is {canonicalize_name(child.name)}=="
            f"{pins[canonicalize_name(child.name)]})"
            for child in requires(releases[version])
            if canonicalize_name(child.name) in pins
            and applies(child, env, ())
            and not child.specifier.contains(pins[canonicalize_name(child.name)], True)
        ]
        if not conflicts:
            return version, releases[version], ""
        for conflict in conflicts:
            blocked.setdefault(conflict, []).append(version)
    tried = candidates[:MAX_CANDIDATES]
    reasons = "; ".join(
        f"{'every candidate' if len(vs) == len(tried) else ', '.join(map(str, sorted(vs)))}"
        f" requires {conflict}"
        for conflict, vs in blocked.items()
    )
    return (
        None,
        None,
        (
            f"{name}{specifier} (required by {by}): no release {min(tried)}..{max(tried)} fits the "
            f"pins: {reasons}"
        ),
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in IMAGES:
        print(f"usage: python {Path(__file__).name} {'|'.join(IMAGES)}", file=sys.stderr)
        return 2
    report = check(argv[0])
    for failure in report.failures:
        print(f"FAIL {failure}")
    word = "resolves" if report.ok else f"does not resolve ({len(report.failures)} failures)"
    print(f"{report.image}: {len(report.packages)} packages checked; {word}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
