"""A run's checkpoints in the registry, from the pipeline's session steps
(``train.steps.session``): what is committed beside the trainers' files, and what a run resumed
from one takes back.

    commit_checkpoint(config, run_registry(config), folder, written, records, predictor, state)
    carry_ahead(config, policy, done, state_out)     # open-session of a resumed run

A checkpoint holds the policy (its log beside it), the optimizer state and master weights (the
trainers'), the predictor, and with max_staleness k >= 1 the trees grown ahead of it
(``ahead/NNNN/trees.parquet``): a run resumed from it updates on the trees the unbroken run did.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trace_core.store.artifacts import open_store
from trace_core.train.ahead import AHEAD
from trace_core.train.contract import OPTIMIZER, PipelineConfig
from trace_core.train.record import LOG, IterationRecord

MASTER = "master.safetensors"


def carry_ahead(config: PipelineConfig, policy: str, done: int, state_out: Path) -> None:
    """A run resumed from a registry checkpoint (its ``policy`` folder, after iteration
    ``done``) at max_staleness k >= 1: the trees grown ahead of it, which the checkpoint keeps
    (``commit_checkpoint``), into the session's first state, so its next iterations update on
    the trees the unbroken run did. Those it lacks (a checkpoint of a run at a smaller k) are
    grown again, on its policy, said."""
    k = config.train.max_staleness
    if not k or not done:
        return
    folder = policy.rsplit("/policy", 1)[0]
    store = open_store(folder)
    kept = {int(o.key.split("/")[1]): o.key for o in store.list_objects(AHEAD)}
    missing = [j for j in range(done + 1, done + k + 1) if j not in kept]
    for j in range(done + 1, done + k + 1):
        if j in kept:
            store.get_file(kept[j], state_out / kept[j])
    if missing:
        print(
            f"iterations {missing}: their trees grown ahead are not in {folder}; they are "
            f"grown again on the policy of iteration {done}",
            flush=True,
        )


def run_registry(config: PipelineConfig) -> Any:
    from trace_core.store.registry import CheckpointRegistry

    return CheckpointRegistry(open_store(config.store))


def registry_run(config: PipelineConfig) -> str:
    """The registry name the run's checkpoints go under: its run_name, else its session's."""
    return config.run_name or config.engine_name


def commit_checkpoint(
    config: PipelineConfig,
    registry: Any,
    folder: str,
    written: Mapping[str, tuple[int, str]],
    records: Sequence[IterationRecord],
    predictor: Any,
    ahead: Path | None = None,
    protect: Iterable[str | None] = (),
) -> int:
    """The predictor (an object, or a folder it was saved to) and the log beside the trainers'
    files, with the trees grown ahead that a state folder ``ahead`` holds (max_staleness >= 1:
    a run resumed from the checkpoint updates on them, as the unbroken run did), then the
    manifest and ``latest``; its transfers count as checkpoint bytes. Then, the commit done,
    the run's checkpoints beyond the newest ``keep_checkpoints`` are deleted (``prune``), but
    never one holding a URI of ``protect`` (what the step's session could start again from: a
    retried step, lost trainers). Returns the checkpoint's bytes (every file's, as committed)."""
    from trace_core.store.artifacts import TRAFFIC, file_sha256
    from trace_core.train.steps.start import BASE_MODEL

    files = dict(written)
    with tempfile.TemporaryDirectory(prefix="trace-checkpoint-") as scratch, TRAFFIC.checkpoint():
        root = Path(scratch)
        if isinstance(predictor, Path):
            shutil.copytree(predictor, root / "predictor")
        else:
            predictor.save(root / "predictor")
        (root / "policy").mkdir()
        write_log(root / "policy" / LOG, records)  # the log travels with the policy
        if ahead is not None and (ahead / AHEAD).is_dir():
            shutil.copytree(ahead / AHEAD, root / AHEAD)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            relative = path.relative_to(root).as_posix()
            registry.store.put_file(f"{folder}/{relative}", path)
            files[relative] = (path.stat().st_size, file_sha256(path))
        registry.commit(
            registry_run(config),
            records[-1].iteration,
            folder,
            files,
            metadata={"strategy": config.train.strategy, BASE_MODEL: str(config.train.init or "")},
        )
        prune(config, registry, protect)  # its reads count as checkpoint traffic too
    return sum(size for size, _ in files.values())


def prune(config: PipelineConfig, registry: Any, protect: Iterable[str | None] = ()) -> None:
    """The run's checkpoints beyond the newest ``keep_checkpoints`` deleted, each said. A
    store that refuses (a key that may not delete) costs no training: said, and the next
    commit tries again."""
    from trace_core.store.artifacts import StoreError

    run = registry_run(config)
    try:
        deleted = registry.prune(run, config.keep_checkpoints, protect)
    except StoreError as err:
        print(
            f"old checkpoints of run {run!r} not deleted ({err}); the next commit tries again",
            flush=True,
        )
        return
    for key in deleted:
        print(
            f"deleted checkpoint {registry.store.uri(key)} (keep_checkpoints "
            f"{config.keep_checkpoints})",
            flush=True,
        )


def optimizer_files(folder: str) -> tuple[str | None, str | None]:
    """The optimizer state and master weights a start folder holds (None: none)."""
    from trace_core.store.uri import is_remote

    if is_remote(folder):
        keys = {o.key.rsplit("/", 1)[-1] for o in open_store(folder).list_objects("")}
        has = keys.__contains__
    else:
        has = lambda name: Path(folder, name).is_file()  # noqa: E731
    optimizer = f"{folder}/{OPTIMIZER}" if has(OPTIMIZER) else None
    return optimizer, (folder if has(MASTER) else None)


def write_log(path: Path, records: Sequence[IterationRecord]) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
