"""Checkpoint registry: complete checkpoints per run name and a ``latest`` pointer moved last.

    registry = CheckpointRegistry(open_store("s3://mlpipeline/trace"))
    registry.save("nightly", 12, "build/policy")       # files, then their manifest, then latest
    checkpoint = registry.latest("nightly")            # None before the first complete save
    registry.download(checkpoint, "build/resume")      # sizes and sha256 checked
    registry.prune("nightly", keep=2)                  # after a commit: the newest 2 stay

Layout below the store's root (``prefix`` defaults to ``checkpoints``):

    checkpoints/<run>/iter-000012-<token>/<files>          the checkpoint directory, as saved
    checkpoints/<run>/iter-000012-<token>/manifest.json    files, sizes, sha256 (after the files)
    checkpoints/<run>/latest.json                          {"iteration": 12, "folder": ...} (last)

Every save writes a fresh folder, so the files of the checkpoint ``latest`` names are never
touched by a later save; ``latest.json`` is replaced by one PUT (or rename) only after the new
manifest is stored. A crash anywhere before that (mid-upload, server killed) leaves the previous
``latest`` in force, and a recurring run resumes from the last complete iteration. ``latest`` is
the most recent complete save, whatever its iteration number.

Old checkpoints are deleted by ``prune``, which the pipeline calls after each commit (its run
parameter ``keep_checkpoints``): the run's complete checkpoints beyond the newest ``keep`` go,
never the one ``latest.json`` names. Each goes manifest first, so a prune stopped halfway leaves
a folder that no reader takes for a checkpoint. Pruning only after the commit means a crash
between the two leaves one checkpoint too many, never one too few. A folder without a manifest
is a save still being written or one that crashed before its commit: it goes once a later
iteration than its own is committed (a run saves one checkpoint at a time, in iteration order,
so no save of an earlier iteration can still be running then); one of the committed iteration
or later stays.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from trace_core.store.artifacts import ArtifactStore, ObjectNotFound, StoreError, file_sha256
from trace_core.store.treeset import ManifestError, join_key
from trace_core.store.uri import check_run_name

MANIFEST = "manifest.json"
ITERATION = re.compile(r"iter-(\d{6})-[0-9a-f]+$")
"""A checkpoint folder's name (``reserve``): its iteration."""
LATEST = "latest.json"
KIND = "trace.checkpoint"


@dataclass(frozen=True)
class CheckpointFile:
    path: str  # relative POSIX path inside the checkpoint directory
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: where it is and what it holds."""

    run: str
    iteration: int
    key: str  # folder key below the store's root
    files: tuple[CheckpointFile, ...]
    created: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "kind": KIND,
            "run": self.run,
            "iteration": self.iteration,
            "created": self.created,
            "files": [vars(f) for f in self.files],
            "metadata": dict(self.metadata),
        }
        return (json.dumps(body, indent=2) + "\n").encode()


class CheckpointRegistry:
    """Checkpoints of named runs in one store (module docstring)."""

    def __init__(self, store: ArtifactStore, prefix: str = "checkpoints") -> None:
        self.store = store
        self.prefix = prefix

    def _run_key(self, run: str, *rest: str) -> str:
        return join_key(self.prefix, check_run_name(run), *rest)

    def save(
        self,
        run: str,
        iteration: int,
        directory: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Checkpoint:
        """Upload every file under ``directory``, then the manifest, then move ``latest``.

        ``progress`` is called with the bytes sent so far, over all files.
        """
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        root = Path(directory)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such checkpoint directory")
        paths = sorted(p for p in root.rglob("*") if p.is_file())
        if not paths:
            raise ValueError(f"{root}: the checkpoint directory holds no files")
        folder = self._run_key(run, f"iter-{iteration:06d}-{uuid.uuid4().hex[:8]}")
        files, sent = [], 0
        for path in paths:
            relative = path.relative_to(root).as_posix()

            def report(n: int, before: int = sent) -> None:
                if progress:
                    progress(before + n)

            self.store.put_file(join_key(folder, relative), path, progress=report)
            size = path.stat().st_size
            sent += size
            files.append(CheckpointFile(relative, size, file_sha256(path)))
        checkpoint = Checkpoint(
            run,
            iteration,
            folder,
            tuple(files),
            datetime.now(UTC).isoformat(timespec="seconds"),
            dict(metadata or {}),
        )
        self.store.put_bytes(join_key(folder, MANIFEST), checkpoint.to_json())
        # Only now is the checkpoint complete: point latest at it.
        pointer = {"iteration": iteration, "folder": folder.rsplit("/", 1)[-1]}
        self.store.put_bytes(self._run_key(run, LATEST), (json.dumps(pointer) + "\n").encode())
        return checkpoint

    def reserve(self, run: str, iteration: int) -> str:
        """A fresh checkpoint folder's key, for writers that upload its files themselves
        (trainer ranks, straight from their nodes); ``commit`` then makes it a checkpoint."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        return self._run_key(run, f"iter-{iteration:06d}-{uuid.uuid4().hex[:8]}")

    def commit(
        self,
        run: str,
        iteration: int,
        folder: str,
        files: Mapping[str, tuple[int, str]],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> Checkpoint:
        """Make the reserved ``folder`` the run's latest checkpoint, once its files (relative
        path → size, sha256, as their writers hashed them) are all stored at those sizes: the
        manifest, then ``latest``. A missing or short file raises, and ``latest`` stays."""
        if not folder.startswith(self._run_key(run) + "/"):
            raise ValueError(f"{folder}: not a folder of run {run!r} (reserve it first)")
        checkpoint = Checkpoint(
            run,
            iteration,
            folder,
            tuple(CheckpointFile(path, size, sha) for path, (size, sha) in sorted(files.items())),
            datetime.now(UTC).isoformat(timespec="seconds"),
            dict(metadata or {}),
        )
        if not checkpoint.files:
            raise ValueError(f"{self.store.uri(folder)}: a checkpoint of no files")
        stored = {o.key: o.size for o in self.store.list_objects(folder)}
        for f in checkpoint.files:
            size = stored.get(join_key(folder, f.path))
            if size != f.bytes:
                found = "is missing" if size is None else f"has {size} bytes, not {f.bytes}"
                raise StoreError(f"{self.store.uri(join_key(folder, f.path))} {found}")
        self.store.put_bytes(join_key(folder, MANIFEST), checkpoint.to_json())
        pointer = {"iteration": iteration, "folder": folder.rsplit("/", 1)[-1]}
        self.store.put_bytes(self._run_key(run, LATEST), (json.dumps(pointer) + "\n").encode())
        return checkpoint

    def prune(self, run: str, keep: int, protect: Iterable[str | None] = ()) -> list[str]:
        """Delete ``run``'s complete checkpoints but the newest ``keep`` (by iteration, then
        creation), the one ``latest.json`` names, and those holding a URI of ``protect`` (a
        folder or a file in it: what a running session may still read); and folders without a
        manifest from iterations before the one ``latest.json`` names (saves that crashed).
        Nothing is deleted while ``latest.json`` is missing or unreadable. Returns the deleted
        folders' keys, oldest first."""
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        try:
            pointer = json.loads(self.store.get_bytes(self._run_key(run, LATEST)))
            current = pointer["folder"]
        except (ObjectNotFound, ValueError, TypeError, KeyError):
            return []  # no commit to prune after: ``latest`` says what to do
        names, with_manifest = self._listing(run)
        complete = []
        for name in sorted(with_manifest):
            try:
                complete.append(self._read(run, self._run_key(run, name)))
            except (ObjectNotFound, ManifestError):
                continue  # a damaged manifest: not ours to judge here
        complete.sort(key=lambda c: (c.iteration, c.created))
        kept = {c.key for c in complete[-keep:]} | {self._run_key(run, str(current))}
        crashed = _crashed(names - with_manifest, pointer.get("iteration"))
        held = [uri.rstrip("/") for uri in protect if uri]
        deleted: list[tuple[int, str]] = []
        for checkpoint in complete:
            where = self.store.uri(checkpoint.key)
            if checkpoint.key in kept or any(
                uri == where or uri.startswith(where + "/") for uri in held
            ):
                continue
            self.store.delete(join_key(checkpoint.key, MANIFEST))  # no longer a checkpoint
            self.store.delete_prefix(checkpoint.key)
            deleted.append((checkpoint.iteration, checkpoint.key))
        for iteration, name in crashed:
            folder = self._run_key(run, name)
            self.store.delete_prefix(folder)
            deleted.append((iteration, folder))
        return [key for _, key in sorted(deleted, key=lambda found: found[0])]

    def latest(self, run: str, say: Callable[[str], None] | None = None) -> Checkpoint | None:
        """The last complete checkpoint of ``run``; None if it has none.

        A ``latest.json`` that names a checkpoint whose manifest is gone or damaged, or whose
        files are missing or of the wrong size, falls back to the newest complete checkpoint
        (``say`` is told). A run that holds checkpoints but no readable ``latest.json`` is
        refused: a new run under its name would register over it.
        """
        key = self._run_key(run, LATEST)
        try:
            pointer = json.loads(self.store.get_bytes(key))
            folder = pointer.get("folder") if isinstance(pointer, dict) else None
            if not isinstance(folder, str) or not folder.startswith("iter-") or "/" in folder:
                raise ManifestError(f"{self.store.uri(key)}: field 'folder' is missing or invalid")
        except ObjectNotFound:
            folder = None
        except (json.JSONDecodeError, UnicodeDecodeError, ManifestError) as err:
            reason = err if isinstance(err, ManifestError) else f"not valid JSON ({err})"
            raise ManifestError(
                f"{self.store.uri(key)}: {reason}; the run's checkpoints are kept: rewrite "
                "latest.json, or use another run name"
            ) from None
        if folder is None:
            if stored := self._folders(run):  # listed only when there is no pointer
                raise ManifestError(
                    f"{self.store.uri(key)} is missing, but run {run!r} holds {len(stored)} "
                    "saved checkpoint(s); a new run under its name would register over them: "
                    "restore latest.json or use another run name"
                )
            return None
        problem = self._check(run, self._run_key(run, folder))
        if problem is None:
            return self._read(run, self._run_key(run, folder))
        complete = [c for c in self.checkpoints(run) if self._check(run, c.key) is None]
        if not complete:
            raise ManifestError(
                f"{self.store.uri(key)} names {folder}, which is incomplete ({problem}), and "
                f"run {run!r} has no complete checkpoint"
            )
        fallback = max(complete, key=lambda c: c.created)
        if say:
            say(
                f"{self.store.uri(self._run_key(run, folder))} is incomplete ({problem}); "
                f"using {fallback.key.rsplit('/', 1)[-1]}, the newest complete checkpoint"
            )
        return fallback

    def _folders(self, run: str) -> set[str]:
        """Checkpoint folders with a manifest (a save that crashed mid-upload has none)."""
        return self._listing(run)[1]

    def _listing(self, run: str) -> tuple[set[str], set[str]]:
        """The names below ``run``'s key (folders and ``latest.json``), and of those the
        checkpoint folders with a manifest: one listing."""
        base = self._run_key(run)
        parts = [o.key[len(base) + 1 :].split("/") for o in self.store.list_objects(base)]
        names = {p[0] for p in parts}
        with_manifest = {
            p[0] for p in parts if len(p) == 2 and p[0].startswith("iter-") and p[1] == MANIFEST
        }
        return names, with_manifest

    def _check(self, run: str, folder: str) -> str | None:
        """None if the checkpoint in ``folder`` is complete (manifest, every file, sizes);
        else what is wrong. Contents are checked against sha256 on download."""
        try:
            checkpoint = self._read(run, folder)
        except (ObjectNotFound, ManifestError) as err:
            return str(err)
        sizes = {o.key: o.size for o in self.store.list_objects(folder)}
        for f in checkpoint.files:
            size = sizes.get(join_key(folder, f.path))
            if size is None:
                return f"{self.store.uri(join_key(folder, f.path))} is missing"
            if size != f.bytes:
                return f"{self.store.uri(join_key(folder, f.path))} has {size} bytes, not {f.bytes}"
        return None

    def checkpoints(self, run: str) -> list[Checkpoint]:
        """Every complete checkpoint of ``run`` (a folder with a manifest), oldest first."""
        base = self._run_key(run)
        found = []
        for obj in self.store.list_objects(base):
            relative = obj.key[len(base) + 1 :]
            parts = relative.split("/")
            if len(parts) == 2 and parts[1] == MANIFEST and parts[0].startswith("iter-"):
                found.append(self._read(run, join_key(base, parts[0])))
        return sorted(found, key=lambda c: (c.iteration, c.created))

    def _read(self, run: str, folder: str) -> Checkpoint:
        key = join_key(folder, MANIFEST)
        uri = self.store.uri(key)
        try:
            body = json.loads(self.store.get_bytes(key))
        except ObjectNotFound:
            raise ObjectNotFound(f"{uri}: checkpoint manifest missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ManifestError(f"{uri}: not valid JSON ({err})") from None
        if not isinstance(body, dict) or body.get("kind") != KIND:
            raise ManifestError(f"{uri}: not a checkpoint manifest (kind must be {KIND!r})")
        try:
            files = tuple(
                CheckpointFile(str(f["path"]), int(f["bytes"]), str(f["sha256"]))
                for f in body["files"]
            )
            iteration = int(body["iteration"])
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(f"{uri}: field {err} is missing or invalid") from None
        for f in files:
            if f.path.startswith("/") or ".." in f.path.split("/"):
                raise ManifestError(f"{uri}: file path {f.path!r} leaves the checkpoint")
        metadata = body.get("metadata") or {}
        return Checkpoint(
            run, iteration, folder, files, str(body.get("created", "")), dict(metadata)
        )

    def download(self, checkpoint: Checkpoint, directory: str | os.PathLike[str]) -> Path:
        """Fetch ``checkpoint`` into ``directory`` (created; must not exist or be empty).

        Files land in a hidden sibling folder first, are checked against the manifest, and the
        folder is renamed into place: ``directory`` never holds half a checkpoint.
        """
        target = Path(directory)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target}: exists and is not an empty directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
        try:
            for f in checkpoint.files:
                local = staging / f.path
                local.parent.mkdir(parents=True, exist_ok=True)
                key = join_key(checkpoint.key, f.path)
                self.store.get_file(key, local)
                if local.stat().st_size != f.bytes or file_sha256(local) != f.sha256:
                    raise StoreError(
                        f"{self.store.uri(key)}: content differs from its manifest "
                        f"({local.stat().st_size} bytes, expected {f.bytes})"
                    )
            if target.exists():
                target.rmdir()
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def load_latest(self, run: str, directory: str | os.PathLike[str]) -> Checkpoint:
        """Download the latest complete checkpoint of ``run``; ObjectNotFound if there is none."""
        checkpoint = self.latest(run)
        if checkpoint is None:
            raise ObjectNotFound(
                f"{self.store.uri(self._run_key(run, LATEST))}: run {run!r} has no checkpoint"
            )
        self.download(checkpoint, directory)
        return checkpoint


def _crashed(names: Iterable[str], committed: object) -> list[tuple[int, str]]:
    """Of folder ``names`` without a manifest, those of iterations before ``committed`` (the
    iteration ``latest.json`` names; none when it names none), with their iterations."""
    if not isinstance(committed, int):
        return []
    found = ((ITERATION.match(name), name) for name in sorted(names))
    return [(int(m.group(1)), name) for m, name in found if m and int(m.group(1)) < committed]
