"""The versioned Parquet schema of rollout trees: one row per node.

Every row repeats its tree's ``TreeInfo``, so a file holding many runs and iterations can be
queried with plain SQL (``SELECT text FROM trees WHERE is_leaf AND reward = 1``). ``to_table`` and
``from_table`` convert between ``RolloutTree`` and Arrow column-wise (flat numpy arrays plus
offsets, no per-row dicts); ``write_trees`` and ``read_trees`` add Parquet on a local path.

depth, is_leaf and target_v are derived from the parent pointers and rewards. They are stored for
readers (SQL, the tree view); ``from_table`` checks their types and ignores their values.

Version history: 1 — first version. 2 — ``truncated`` (a turn cut by the token limit); files
of version 1 still read, every turn as not truncated.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trace_core.algo.tree import RolloutTree, TreeInfo, recursive_targets

SCHEMA_VERSION = 2
VERSION_KEY = b"trace.schema_version"
# zstd: token ids and logprobs compress well; 64k-row groups let a reader that wants one tree
# (``trace-rl inspect show``) skip the rest by the tree_id statistics of each group.
PARQUET_COMPRESSION = "zstd"
ROW_GROUP_ROWS = 65_536
ADDED_IN = {"truncated": 2}
"""Columns newer than the first version, by the version that added them: older files lack them."""
_INFO_COLUMNS = ("run_id", "iteration", "prompt_id", "tree_id", "strategy", "policy_version")
_Scalar = TypeVar("_Scalar", bound=np.generic)

# fmt: off
TREE_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),         # training run that grew the tree
        pa.field("iteration", pa.int32(), nullable=False),       # training iteration in the run
        pa.field("prompt_id", pa.string(), nullable=False),      # dataset id of the tree's prompt
        pa.field("tree_id", pa.int64(), nullable=False),         # tree within (run, iteration)
        pa.field("strategy", pa.string(), nullable=False),       # allocation: grpo, trace, ...
        pa.field("policy_version", pa.int64(), nullable=False),  # policy that sampled the tree
        pa.field("node_id", pa.int32(), nullable=False),         # 0 is the root (the prompt)
        pa.field("parent_id", pa.int32(), nullable=False),       # -1 at the root, else < node_id
        pa.field("depth", pa.int16(), nullable=False),           # turns from the root (derived)
        pa.field("is_leaf", pa.bool_(), nullable=False),         # last turn of an episode (derived)
        pa.field("branch", pa.bool_(), nullable=False),          # first turn of a continuation
        pa.field("truncated", pa.bool_(), nullable=False),       # turn cut by the token limit
        pa.field("gen_token_ids", pa.list_(pa.int32()), nullable=False),  # sampled; [] at the root
        pa.field("obs_token_ids", pa.list_(pa.int32()), nullable=False),  # prompt ids at the root
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),  # one per gen token
        pa.field("text", pa.string(), nullable=False),           # generated text; prompt at root
        pa.field("observation", pa.string(), nullable=False),    # environment's reply; "" at root
        pa.field("reward", pa.float64()),                        # leaf reward; null elsewhere
        pa.field("predicted_v", pa.float64()),                   # predictor's V; null if unscored
        pa.field("target_v", pa.float64()),                      # V̂ = mean leaf reward below
    ],
    metadata={VERSION_KEY: str(SCHEMA_VERSION).encode()},
)
# fmt: on


class SchemaError(ValueError):
    """A table that is not a valid set of rollout trees under ``TREE_SCHEMA``."""


# --- trees -> table -----------------------------------------------------------------------------
def to_table(trees: Sequence[RolloutTree]) -> pa.Table:
    """All nodes of ``trees``, tree after tree, each tree's nodes in id order."""
    sizes = np.fromiter((t.size for t in trees), dtype=np.int64, count=len(trees))
    starts = np.cumsum(sizes) - sizes
    tree_of_row = np.repeat(np.arange(len(trees)), sizes)

    def per_tree(column: str) -> pa.Array:
        arrow_type = TREE_SCHEMA.field(column).type
        try:
            values = pa.array([getattr(t.info, column) for t in trees], arrow_type)
        except (pa.ArrowInvalid, OverflowError) as err:
            raise ValueError(f"column {column!r}: {err}") from err
        return values.take(pa.array(tree_of_row))

    def per_node(get: str, dtype: npt.DTypeLike) -> npt.NDArray[np.generic]:
        return _concat((np.asarray(getattr(t, get)) for t in trees), dtype)

    floats = {
        "reward": per_node("reward", np.float64),
        "predicted_v": per_node("predicted_v", np.float64),
        "target_v": _concat((recursive_targets(t) for t in trees), np.float64),
    }
    columns = {
        **{c: per_tree(c) for c in _INFO_COLUMNS},
        "node_id": _narrow(np.arange(sizes.sum()) - np.repeat(starts, sizes), np.int32, "node_id"),
        "parent_id": _narrow(per_node("parent", np.int64), np.int32, "parent_id"),
        "depth": _narrow(_concat((t.depth for t in trees), np.int64), np.int16, "depth"),
        "is_leaf": _concat((t.leaf_mask for t in trees), np.bool_),
        "branch": per_node("branch", np.bool_),
        "truncated": per_node("truncated", np.bool_),
        "gen_token_ids": _list_column((a for t in trees for a in t.gen_tokens), "gen_token_ids"),
        "obs_token_ids": _list_column((a for t in trees for a in t.obs_tokens), "obs_token_ids"),
        "logprobs": _list_column((a for t in trees for a in t.logprobs), "logprobs"),
        "text": pa.array([s for t in trees for s in t.text], pa.string()),
        "observation": pa.array([s for t in trees for s in t.observation], pa.string()),
        **{c: pa.array(v, mask=np.isnan(v)) for c, v in floats.items()},
    }
    return pa.Table.from_arrays([columns[f.name] for f in TREE_SCHEMA], schema=TREE_SCHEMA)


def _concat(parts: Iterable[npt.ArrayLike], dtype: npt.DTypeLike) -> npt.NDArray[np.generic]:
    arrays = [np.asarray(p) for p in parts]
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _narrow(
    values: npt.NDArray[np.generic], dtype: type[np.integer], column: str
) -> npt.NDArray[np.generic]:
    """Cast to a narrower integer type, refusing values it cannot hold (numpy would wrap)."""
    bounds = np.iinfo(dtype)
    if values.size and (values.min() < bounds.min or values.max() > bounds.max):
        raise ValueError(f"column {column!r}: values outside [{bounds.min}, {bounds.max}]")
    return values.astype(dtype)


def _list_column(parts: Iterable[npt.ArrayLike], column: str) -> pa.ListArray:
    arrays = [np.asarray(p) for p in parts]
    value_type = TREE_SCHEMA.field(column).type.value_type
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if offsets[-1] > np.iinfo(np.int32).max:
        # list<> has int32 offsets; a table this large should be split into several writes.
        raise ValueError(f"column {column!r}: {offsets[-1]} values overflow int32 list offsets")
    if pa.types.is_int32(value_type):
        values = _narrow(_concat(arrays, np.int64), np.int32, column)
    else:
        values = _concat(arrays, value_type.to_pandas_dtype())
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


# --- table -> trees -----------------------------------------------------------------------------
def from_table(table: pa.Table) -> list[RolloutTree]:
    """Trees in order of first appearance of (run_id, iteration, tree_id); rows may be shuffled."""
    check_schema(table.schema)
    if "truncated" not in table.column_names:  # version 1: no turn was marked
        table = table.append_column("truncated", pa.array(np.zeros(table.num_rows, np.bool_)))
    else:  # a version-1 file read with newer ones has nulls here
        index = table.schema.get_field_index("truncated")
        table = table.set_column(index, "truncated", pc.fill_null(table["truncated"], False))
    col = {f.name: table.column(f.name).combine_chunks() for f in TREE_SCHEMA}
    for f in TREE_SCHEMA:
        if not f.nullable:
            _check_no_nulls(col[f.name], f.name)
    if table.num_rows == 0:
        return []

    # Group rows by tree (first appearance order), then sort by node id inside each tree.
    run_codes = pc.dictionary_encode(col["run_id"]).indices.to_numpy()
    keys = np.stack([run_codes, col["iteration"].to_numpy(), col["tree_id"].to_numpy()], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first)] = np.arange(first.size)
    group = rank[inverse.reshape(-1)]
    order = np.lexsort((col["node_id"].to_numpy(), group))
    starts = np.searchsorted(group[order], np.arange(first.size))
    sizes = np.diff(np.append(starts, table.num_rows))
    head = np.repeat(order[starts], sizes)  # for each sorted row: the first row of its tree

    def tree_name(row: int) -> str:
        return (
            f"tree (run_id={col['run_id'][row].as_py()!r}, "
            f"iteration={col['iteration'][row].as_py()}, tree_id={col['tree_id'][row].as_py()})"
        )

    node = col["node_id"].to_numpy()[order]
    bad = np.flatnonzero(node != np.arange(table.num_rows) - np.repeat(starts, sizes))
    if bad.size:
        i = int(bad[0])
        row, expected = int(order[i]), i - int(starts[np.searchsorted(starts, i, "right") - 1])
        raise SchemaError(
            f"{tree_name(row)}: row {row} has node_id {node[i]} where node {expected} was "
            f"expected; node ids must be 0..n-1, each once"
        )
    for name in ("prompt_id", "strategy", "policy_version"):
        values = col[name]
        if pa.types.is_string(values.type):
            values = pc.dictionary_encode(values).indices
        codes = values.to_numpy()
        mismatch = np.flatnonzero(codes[order] != codes[head])
        if mismatch.size:
            row = int(order[mismatch[0]])
            raise SchemaError(f"{tree_name(row)}: row {row} has another {name} than node 0")

    take = pa.array(order)
    parent = col["parent_id"].to_numpy()[order].astype(np.int64)
    floats = {c: pc.fill_null(col[c], np.nan).to_numpy()[order] for c in ("reward", "predicted_v")}
    branch = col["branch"].to_numpy(zero_copy_only=False)[order]
    truncated = col["truncated"].to_numpy(zero_copy_only=False)[order]
    gen = _split_list(col["gen_token_ids"].take(take), np.int32)
    obs = _split_list(col["obs_token_ids"].take(take), np.int32)
    logprobs = _split_list(col["logprobs"].take(take), np.float32)
    text = col["text"].take(take).to_pylist()
    observation = col["observation"].take(take).to_pylist()

    trees = []
    for lo, n in zip(starts.tolist(), sizes.tolist(), strict=True):
        hi, row = lo + n, int(order[lo])
        info = TreeInfo(**{c: col[c][row].as_py() for c in _INFO_COLUMNS})
        try:
            tree = RolloutTree(
                info=info,
                parent=parent[lo:hi],
                gen_tokens=tuple(gen[lo:hi]),
                obs_tokens=tuple(obs[lo:hi]),
                logprobs=tuple(logprobs[lo:hi]),
                text=tuple(text[lo:hi]),
                observation=tuple(observation[lo:hi]),
                reward=floats["reward"][lo:hi],
                predicted_v=floats["predicted_v"][lo:hi],
                branch=branch[lo:hi],
                truncated=truncated[lo:hi],
            )
        except ValueError as err:
            raise SchemaError(f"{tree_name(row)}: {err}") from err
        trees.append(tree)
    return trees


def schema_version(schema: pa.Schema) -> int:
    """The version a checked schema was written with."""
    return int((schema.metadata or {})[VERSION_KEY])


def check_schema(schema: pa.Schema) -> None:
    """Raise ``SchemaError`` unless ``schema`` holds every column of ``TREE_SCHEMA``.

    Extra columns and another column order are fine; nullability flags are not compared
    (other writers mark everything nullable), nulls are checked on the data instead.
    """
    metadata = schema.metadata or {}
    if VERSION_KEY not in metadata:
        raise SchemaError(f"schema metadata has no {VERSION_KEY.decode()!r} key")
    raw = metadata[VERSION_KEY]
    if not raw.isdigit():
        raise SchemaError(f"schema version {raw.decode(errors='replace')!r} is not an integer")
    if int(raw) > SCHEMA_VERSION:
        raise SchemaError(
            f"schema version {int(raw)} is newer than this reader's {SCHEMA_VERSION}; "
            f"upgrade trace-rl to read it"
        )
    if int(raw) < 1:
        raise SchemaError(f"schema version {int(raw)} does not exist (the first is 1)")
    for expected in TREE_SCHEMA:
        found = schema.get_all_field_indices(expected.name)
        if not found and int(raw) < ADDED_IN.get(expected.name, 1):
            continue
        if not found:
            raise SchemaError(f"column {expected.name!r} is missing (expected {expected.type})")
        if len(found) > 1:
            raise SchemaError(f"column {expected.name!r} appears {len(found)} times")
        found_type = schema.field(found[0]).type
        # list<> types compare by element type: Parquet renames the element field and other
        # writers mark it nullable or not at will.
        same = (
            found_type.value_type.equals(expected.type.value_type)
            if pa.types.is_list(found_type) and pa.types.is_list(expected.type)
            else found_type.equals(expected.type)
        )
        if not same:
            raise SchemaError(
                f"column {expected.name!r} has type {found_type}, expected {expected.type}"
            )


def _check_no_nulls(values: pa.Array, column: str) -> None:
    if values.null_count:
        row = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise SchemaError(f"column {column!r} is null at row {row}")
    if pa.types.is_list(values.type) and values.flatten().null_count:
        nulls = values.flatten().is_null().to_numpy(zero_copy_only=False)
        row = int(pc.list_parent_indices(values).to_numpy()[np.flatnonzero(nulls)[0]])
        raise SchemaError(f"column {column!r} holds a null element at row {row}")


def _split_list(values: pa.ListArray, dtype: type[_Scalar]) -> list[npt.NDArray[_Scalar]]:
    offsets = values.offsets.to_numpy()
    # A copy: writable arrays, like TreeBuilder's, rather than read-only views of Arrow memory.
    flat = np.array(values.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return np.split(flat, offsets[1:-1] - offsets[0])


# --- Parquet files ------------------------------------------------------------------------------
def write_trees(path: str | os.PathLike[str], trees: Sequence[RolloutTree]) -> None:
    """Write ``trees`` to a Parquet file at ``path``, replacing it atomically.

    The file is written next to ``path`` and renamed over it, so a failure at any point leaves
    whatever was at ``path`` before untouched.
    """
    table = to_table(trees)
    target = Path(path)
    # Not tempfile.mkstemp: its 0600 mode would survive the rename, and other readers of the
    # artifact folder (the tree view, a KFP step under another user) could not open the file.
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            write_parquet(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_parquet(table: pa.Table, where: str | os.PathLike[str] | BinaryIO) -> None:
    """``table`` as Parquet with this schema's compression and row groups."""
    pq.write_table(table, where, compression=PARQUET_COMPRESSION, row_group_size=ROW_GROUP_ROWS)


def read_trees(path: str | os.PathLike[str]) -> list[RolloutTree]:
    """Trees from a Parquet file written by ``write_trees`` (or any table under this schema);
    a file that is not Parquet, or not trees, is named in the error."""
    try:
        table = pq.read_table(path)
    except pa.ArrowException as err:
        raise SchemaError(f"{path}: not a readable Parquet file ({err})") from None
    try:
        return from_table(table)
    except SchemaError as err:
        raise SchemaError(f"{path}: {err}") from None
