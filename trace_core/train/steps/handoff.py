"""How the pipeline's session steps hand the run's state on: through the store.

    <store>/sessions/<session>/state-0000/   after open-session (the iteration it starts from)
    <store>/sessions/<session>/state-0003/   after iteration 3: state.json, log.jsonl,
                                             predictor/, tokenizer/, tree_uris.json and, with
                                             max_staleness k >= 1, ahead/NNNN/trees.parquet
    <store>/sessions/<session>/trees-0003/   iteration 3's trees, grown in its own step, put
                                             there for the trainer actors to read (trees grown
                                             ahead they read in the state they came in)

The iterations are one step run once per iteration (a KFP ``ParallelFor`` of parallelism 1,
an Argo ``withSequence``), so no step's output can be the next one's input: each reads the
state after the iteration before it from here and publishes its own. A state is published
whole or not at all: every file, then ``state.json`` (what ``committed`` looks for) last; what
a step that died while publishing left is removed before the step publishes again. A state is
never replaced once committed: a retried iteration whose first attempt committed hands on
what that attempt wrote (``train.dispatch.iterate_on_store``).

The session's folder is scratch: when the run ends it is deleted with the staging folders of
the session's Ray jobs (``remove_scratch``): by close-session, all but the last state (which
the report reads after it), and by the exit handler's release, however the run ended, the rest.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from trace_core.store.artifacts import open_store
from trace_core.store.sync import download_folder
from trace_core.train.contract import PipelineConfig

STATE = "state.json"
"""The run state's file (``steps.session.RunState``): published last, it marks a state whole."""


def session_uri(config: PipelineConfig) -> str:
    """The run's session's folder in the store (a path or ``s3://`` prefix)."""
    if not config.store or not config.engine_name:
        raise ValueError("a run's session needs store_uri and its name (set by prep)")
    return f"{config.store.rstrip('/')}/sessions/{config.engine_name}"


def state_folder(iteration: int) -> str:
    """The name of the state after ``iteration`` in the session's folder."""
    return f"state-{iteration:04d}"


def state_uri(config: PipelineConfig, iteration: int) -> str:
    """Where the run's session keeps its state after ``iteration``."""
    return f"{session_uri(config)}/{state_folder(iteration)}"


def remove_scratch(
    store_uri: str, session: str, keep: str = "", say: Callable[[str], None] = print
) -> list[str]:
    """Delete what the run's session left in the store at ``store_uri``: its folder
    ``sessions/<session>/`` (all of it, or all but the folder ``keep`` in it, e.g. the last
    state, which the report still reads) and the staging folders of its steps' Ray jobs
    (``staging/trace-<session>-<step>-...``, ``rayjob.new_job_id``; never another run's).
    Returns (and ``say``s) one line per folder deleted; nothing left is no error. A store that
    refuses costs the run nothing: one line says so (a later call tries again)."""
    from trace_core.store.artifacts import StoreError

    try:
        lines = _remove_scratch(store_uri, session, keep)
    except (StoreError, ValueError) as err:
        lines = [f"the scratch of session {session} in {store_uri} is not deleted: {err}"]
    for line in lines:
        say(line)
    return lines


def _remove_scratch(store_uri: str, session: str, keep: str) -> list[str]:
    from trace_core.train.rayjob import STAGING, is_job_of

    if not re.fullmatch(r"[\w][\w.-]{0,99}", session, re.A):
        raise ValueError(f"session {session!r}: expected the run's session name <run_id>-<8 hex>")
    store = open_store(store_uri)
    base = f"sessions/{session}"
    folders: set[str] = set() if keep else {base}
    for obj in store.list_objects(base) if keep else ():
        top = obj.key[len(base) + 1 :].split("/", 1)
        if top[0] == keep:
            continue
        if len(top) == 1:
            store.delete(obj.key)  # a file of its own in the session's folder
        else:
            folders.add(f"{base}/{top[0]}")
    for obj in store.list_objects(STAGING):
        job = obj.key[len(STAGING) + 1 :].split("/", 1)[0]
        if is_job_of(session, job):
            folders.add(f"{STAGING}/{job}")
    lines = []
    for folder in sorted(folders):
        if count := store.delete_prefix(folder):
            lines.append(f"deleted {store.uri(folder)} ({count} objects)")
    return lines


def last_iteration(config: PipelineConfig, start_iteration: int) -> int:
    """The iteration a run that starts after ``start_iteration`` ends with."""
    return start_iteration + config.train.iterations


def iterations(config: PipelineConfig, start_iteration: int) -> list[int]:
    """The iterations the run's iteration step runs, in order."""
    return list(range(start_iteration + 1, last_iteration(config, start_iteration) + 1))


def committed(uri: str) -> bool:
    """Whether a whole state is published at ``uri``."""
    return open_store(uri).exists(STATE)


def publish(folder: Path, uri: str, replace: bool = False) -> None:
    """``folder`` (a state, with ``state.json``) to ``uri``: every other file, then
    ``state.json``. A committed state there is refused, unless ``replace`` (open-session's own
    retry: the same session's start); a partial one (a step that died publishing) is removed
    first."""
    if not (folder / STATE).is_file():
        raise FileNotFoundError(f"{folder / STATE}: missing; not a run state")
    store = open_store(uri)
    if store.exists(STATE) and not replace:
        raise FileExistsError(f"{uri}: a state is committed there already; it is not replaced")
    if store.exists(STATE):
        store.delete(STATE)  # uncommitted from here on, until the new one is whole
    for obj in store.list_objects(""):
        store.delete(obj.key)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != STATE)
    for path in files:
        store.put_file(path.relative_to(folder).as_posix(), path)
    store.put_file(STATE, folder / STATE)


def fetch(uri: str, folder: Path) -> Path:
    """The state committed at ``uri``, copied into ``folder``; a missing or partial one is
    refused in one line."""
    if not committed(uri):
        raise FileNotFoundError(
            f"{uri}: no state there (the step before did not finish); run the pipeline again"
        )
    download_folder(uri, folder)
    return folder


def done_before(uri: str, iteration: int, trees_out: Path) -> dict[str, float] | None:
    """When iteration ``iteration``'s state is committed at ``uri`` already (its step ran and
    is run again): its trees, as that run wrote them, into ``trees_out``, and its figures.
    ``None``: it is still to run."""
    from trace_core.train.contract import read_metrics
    from trace_core.train.steps.finish import read_tree_uris

    if not committed(uri):
        return None
    where = read_tree_uris(uri).get(iteration)
    if where is None:
        raise ValueError(f"{uri}: a committed state that lists no trees of iteration {iteration}")
    print(f"iteration {iteration} ran already (its state: {uri}); handing on what it wrote")
    download_folder(where, trees_out)
    return read_metrics(trees_out)
