"""A ``trace-rl train`` run folder: which iterations are complete, and the only ways it changes.

    point = resume_point(out)                  # the newest complete iteration (0: a new run)
    commit_iteration(out, 3, write=save_all)   # files, manifest, rename, then ``latest``
    discard_run(out)                           # what --restart does, and only then

An iteration folder is complete when its ``manifest.json`` lists every file it holds, with
sizes and sha256, and the files match. Every ``checkpoint_every``-th iteration and the last also
hold the policy and its optimizer state: a run resumes after the newest of those, growing and
training the iterations after it again (their seeds make them what they were). ``latest``
names the last complete iteration and is written last, so a crash leaves it on a complete one.
Resuming verifies that iteration; if it was damaged since (a file deleted or truncated), the
run resumes after the newest iteration that is still complete and says so. A folder that holds
iterations but no valid ``latest`` is never taken for a new run: that would rewrite the
iterations in place. It is refused, naming the folder, until the user passes ``--restart``
(which discards the run's files first) or picks another output.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trace_core.store.artifacts import file_sha256
from trace_core.train.record import LOG
from trace_core.train.tracking import MLFLOW_FILE, TENSORBOARD

LATEST = "latest"
MANIFEST = "manifest.json"
CONFIG = "config.json"
KIND = "trace.iteration"
RUN_FILES = (
    *(CONFIG, LOG, LATEST, "curves.png", "summary.md", TENSORBOARD, MLFLOW_FILE, "init"),
    *("warmstart", "iterations"),
)
"""What a run writes in its folder, and what ``--restart`` discards (nothing else is touched)."""


class RunFolderError(ValueError):
    """A run folder that cannot be resumed or started as asked; the message names it."""


@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    """The newest complete iteration: the run goes on after it (0: a new run)."""
    notes: tuple[str, ...] = ()
    """What the check found and did (a damaged iteration passed over), for the user to read."""


def iteration_dir(out: Path, i: int) -> Path:
    return out / "iterations" / f"{i:04d}"


def stored_iterations(out: Path) -> list[int]:
    """Numbers of the iteration folders present (complete or not), oldest first."""
    folder = out / "iterations"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def read_latest(out: Path) -> int | None:
    """The iteration ``latest`` names; None when it is missing or not a number."""
    path = out / LATEST
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def check_iteration(folder: Path) -> str | None:
    """None if ``folder`` is complete; else what is wrong with it, in a few words."""
    path = folder / MANIFEST
    try:
        body = json.loads(path.read_text())
        files = {str(f["path"]): (int(f["bytes"]), str(f["sha256"])) for f in body["files"]}
        if body.get("kind") != KIND:
            raise ValueError
    except FileNotFoundError:
        return f"{path} is missing"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{path} is damaged"
    for relative, (size, digest) in files.items():
        file = folder / relative
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, its manifest says {size}"
        if file_sha256(file) != digest:
            return f"{file} differs from its manifest (sha256)"
    return None


def resume_point(out: Path) -> ResumePoint:
    """Where a run in ``out`` goes on (module docstring); RunFolderError when it cannot."""
    stored = stored_iterations(out)
    latest = read_latest(out)
    if latest is None:
        if stored:
            raise RunFolderError(
                f"{out} holds iterations {stored[0]}..{stored[-1]} but no valid {LATEST} "
                "pointer; a new run would overwrite them: pass --restart to discard them, "
                "or choose another --output"
            )
        return ResumePoint(0)
    notes: list[str] = []
    later: list[int] = []  # complete iterations after the newest checkpoint
    for i in sorted((i for i in stored if i <= latest), reverse=True):
        problem = check_iteration(iteration_dir(out, i))
        if problem is None and holds_checkpoint(iteration_dir(out, i)):
            if later:
                notes.append(
                    f"{_span(later)} no checkpoint (checkpoint_every): grown and trained again "
                    f"from iteration {i}'s"
                )
            return ResumePoint(i, tuple(notes))
        if problem is None:
            later.append(i)
        else:
            notes.append(f"iteration {i} is incomplete ({problem})")
    if later:  # complete iterations, none a checkpoint: the run starts again from its start
        notes.append(f"{_span(later)} no checkpoint (checkpoint_every): run again from the start")
        return ResumePoint(0, tuple(notes))
    raise RunFolderError(
        f"{out}: {LATEST} names iteration {latest}, but no iteration up to it is complete"
        + (f" ({'; '.join(notes)})" if notes else "")
        + ": pass --restart to discard the run, or choose another --output"
    )


def _span(newest_first: list[int]) -> str:
    """``iteration 3 holds`` or ``iterations 3..5 hold``."""
    if len(newest_first) == 1:
        return f"iteration {newest_first[0]} holds"
    return f"iterations {newest_first[-1]}..{newest_first[0]} hold"


def holds_checkpoint(folder: Path) -> bool:
    """Whether an iteration's folder holds the policy and optimizer state (a checkpoint
    iteration: ``TrainConfig.checkpoint_every``)."""
    return (folder / "policy" / "config.json").is_file() and (
        folder / "optimizer.safetensors"
    ).is_file()


def commit_iteration(out: Path, i: int, write: Callable[[Path], None]) -> None:
    """Iteration ``i``'s folder in full: ``write`` fills a staging folder, the manifest is
    written after its files, the folder is renamed into place, ``latest`` moves last."""
    final = iteration_dir(out, i)
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write(staging)
    write_manifest(staging)
    shutil.rmtree(final, ignore_errors=True)  # an uncommitted one (after latest): a crash's
    staging.rename(final)


def move_latest(out: Path, i: int) -> None:
    write_atomic(out / LATEST, f"{i}\n")


def write_manifest(folder: Path) -> None:
    files = [
        {
            "path": p.relative_to(folder).as_posix(),
            "bytes": p.stat().st_size,
            "sha256": file_sha256(p),
        }
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    ]
    write_atomic(folder / MANIFEST, json.dumps({"kind": KIND, "files": files}, indent=2) + "\n")


def discard_run(out: Path) -> list[str]:
    """Remove what a run wrote in ``out`` (``RUN_FILES``); the names removed."""
    removed = []
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
