"""Round trips and refusals of the rollout-tree Parquet schema (trace_core.store.schema)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from trace_core.algo.tree import RolloutTree, TreeBuilder, TreeInfo
from trace_core.store.schema import (
    SCHEMA_VERSION,
    TREE_SCHEMA,
    VERSION_KEY,
    SchemaError,
    from_table,
    read_trees,
    to_table,
    write_trees,
)

# --- random trees ---------------------------------------------------------------------------------
tokens = arrays(np.int32, st.integers(0, 5), elements=st.integers(0, 2**31 - 1))
infos = st.builds(
    TreeInfo,
    run_id=st.text(max_size=6),
    iteration=st.integers(0, 2**31 - 1),
    prompt_id=st.text(max_size=6),
    tree_id=st.integers(-(2**63), 2**63 - 1),
    strategy=st.sampled_from(["grpo", "pcl", "treepo", "trace", ""]),
    policy_version=st.integers(0, 2**63 - 1),
)


@st.composite
def rollout_trees(draw: st.DrawFn) -> RolloutTree:
    builder = TreeBuilder(draw(infos), prompt_tokens=draw(tokens), prompt_text=draw(st.text()))
    parents = [-1]
    for node in range(1, draw(st.integers(0, 10)) + 1):
        parent = draw(st.integers(0, node - 1))
        gen = draw(tokens)
        logprobs = draw(arrays(np.float32, gen.size, elements=st.floats(-30, 0, width=32)))
        builder.add_turn(
            parent,
            gen,
            draw(tokens),
            logprobs,
            text=draw(st.text(max_size=8)),
            observation=draw(st.text(max_size=8)),
            branch=parent != 0 and draw(st.booleans()),  # never directly under the root
        )
        parents.append(parent)
    for node in range(builder.size):
        if node > 0 and node not in parents:
            builder.set_reward(node, draw(st.sampled_from([0.0, 1.0])))
        if draw(st.booleans()):  # the other half stays NaN: not scored
            builder.set_predicted_v(node, draw(st.floats(0, 1)))
    return builder.build()


# Trees in one table must differ in (run_id, iteration, tree_id): that key groups the rows.
forests = st.lists(
    rollout_trees(),
    max_size=4,
    unique_by=lambda t: (t.info.run_id, t.info.iteration, t.info.tree_id),
)


def assert_same(got: list[RolloutTree], want: list[RolloutTree]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.equals(b)


def small_tree(run_id: str = "r", tree_id: int = 0) -> RolloutTree:
    # root ─┬─ a ─┬─ b    reward 1
    #       │     └─ c    reward 0, a continuation branched from a
    #       └─ d          reward 1
    builder = TreeBuilder(
        TreeInfo(run_id, 3, "p7", tree_id, "trace", 2), np.array([5, 6], np.int32)
    )
    a = builder.add_turn(0, [1, 2], [3], [-0.5, -0.25], "think", "obs a")
    b = builder.add_turn(a, [4], [], [-1.0], "answer", "")
    c = builder.add_turn(a, [7, 8, 9], [], None, "other", "", branch=True)
    d = builder.add_turn(0, [], [], None, "", "")
    for node, r in ((b, 1.0), (c, 0.0), (d, 1.0)):
        builder.set_reward(node, r)
    builder.set_predicted_v(a, 0.4)
    return builder.build()


# --- round trips ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(forests)
def test_table_round_trip_is_lossless(trees: list[RolloutTree]) -> None:
    table = to_table(trees)
    assert table.schema.equals(TREE_SCHEMA, check_metadata=True)
    assert table.num_rows == sum(t.size for t in trees)
    assert_same(from_table(table), trees)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(forests)
def test_parquet_round_trip_is_lossless(tmp_path: Path, trees: list[RolloutTree]) -> None:
    path = tmp_path / "trees.parquet"
    write_trees(path, trees)
    assert_same(read_trees(path), trees)


@settings(max_examples=40, deadline=None)
@given(forests, st.randoms(use_true_random=False))
def test_shuffled_rows_round_trip(trees: list[RolloutTree], rng: random.Random) -> None:
    table = to_table(trees)
    order = list(range(table.num_rows))
    rng.shuffle(order)
    # Trees come back in order of first appearance in the shuffled table.
    got = from_table(table.take(pa.array(order, pa.int64())))
    by_key = {(t.info.run_id, t.info.iteration, t.info.tree_id): t for t in trees}
    assert_same(got, [by_key[(t.info.run_id, t.info.iteration, t.info.tree_id)] for t in got])
    assert len(got) == len(trees)


def test_empty_forest_round_trips() -> None:
    table = to_table([])
    assert table.num_rows == 0
    assert table.schema.equals(TREE_SCHEMA, check_metadata=True)
    assert from_table(table) == []


def test_columns_hold_the_tree_and_its_derived_values() -> None:
    tree = small_tree()
    rows = to_table([tree]).to_pylist()
    assert [r["node_id"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["parent_id"] for r in rows] == [-1, 0, 1, 1, 0]
    assert [r["depth"] for r in rows] == [0, 1, 2, 2, 1]
    assert [r["is_leaf"] for r in rows] == [False, False, True, True, True]
    assert [r["branch"] for r in rows] == [False, False, False, True, False]
    assert rows[0]["obs_token_ids"] == [5, 6]  # the prompt
    assert rows[0]["gen_token_ids"] == []
    assert rows[3]["logprobs"] == [0.0, 0.0, 0.0]  # TreeBuilder's default
    assert [r["reward"] for r in rows] == [None, None, 1.0, 0.0, 1.0]
    assert [r["predicted_v"] for r in rows] == [None, 0.4, None, None, None]
    # V̂: leaves keep their reward; a = (1 + 0) / 2; root = (1 + 0 + 1) / 3.
    target = [r["target_v"] for r in rows]
    assert target[1:] == [0.5, 1.0, 0.0, 1.0]
    assert math.isclose(target[0], 2 / 3)
    assert {(r["run_id"], r["iteration"], r["prompt_id"], r["tree_id"]) for r in rows} == {
        ("r", 3, "p7", 0)
    }


def test_lone_root_has_null_target() -> None:
    tree = TreeBuilder(TreeInfo()).build()
    row = to_table([tree]).to_pylist()[0]
    assert row["target_v"] is None and row["is_leaf"] is False
    assert from_table(to_table([tree]))[0].equals(tree)


def test_extra_columns_and_another_order_are_accepted() -> None:
    trees = [small_tree(tree_id=0), small_tree(tree_id=1)]
    table = to_table(trees)
    names = list(reversed(table.column_names))
    table = table.select(names).append_column("note", pa.array(["x"] * table.num_rows))
    assert_same(from_table(table), trees)


def test_list_element_field_name_and_nullability_are_ignored() -> None:
    # Parquet renames list<item> to list<element>; other writers mark elements nullable or not.
    trees = [small_tree()]
    table = to_table(trees)
    i = table.schema.get_field_index("gen_token_ids")
    renamed = table.column(i).cast(pa.list_(pa.field("element", pa.int32(), nullable=False)))
    assert_same(from_table(table.set_column(i, "gen_token_ids", renamed)), trees)


def test_written_file_carries_the_version(tmp_path: Path) -> None:
    path = tmp_path / "trees.parquet"
    write_trees(path, [small_tree()])
    metadata = pq.read_schema(path).metadata
    assert metadata[VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert [p.name for p in tmp_path.iterdir()] == ["trees.parquet"]  # no temp file left


# --- refusals -------------------------------------------------------------------------------------
def test_schema_error_is_a_value_error() -> None:
    assert issubclass(SchemaError, ValueError)


@pytest.mark.parametrize("column", ["tree_id", "parent_id", "gen_token_ids", "reward", "target_v"])
def test_missing_column_is_named(column: str) -> None:
    table = to_table([small_tree()])
    with pytest.raises(SchemaError, match=f"column '{column}' is missing"):
        from_table(table.drop_columns([column]))


@pytest.mark.parametrize(
    ("column", "arrow_type", "found"),
    [
        ("reward", pa.string(), "string"),
        ("gen_token_ids", pa.list_(pa.int64()), "list<item: int64>"),
        ("node_id", pa.int64(), "int64"),
        ("logprobs", pa.list_(pa.float64()), "list<item: double>"),
    ],
)
def test_wrong_type_names_column_and_types(
    column: str, arrow_type: pa.DataType, found: str
) -> None:
    table = to_table([small_tree()])
    i = table.schema.get_field_index(column)
    table = table.set_column(i, column, table.column(i).cast(arrow_type))
    with pytest.raises(SchemaError) as err:
        from_table(table)
    message = str(err.value)
    assert f"column '{column}'" in message
    assert found in message and str(TREE_SCHEMA.field(column).type) in message


def test_newer_version_is_refused() -> None:
    table = to_table([small_tree()])
    table = table.replace_schema_metadata({VERSION_KEY: str(SCHEMA_VERSION + 1).encode()})
    with pytest.raises(SchemaError, match=f"version {SCHEMA_VERSION + 1} is newer"):
        from_table(table)


def test_missing_version_is_refused() -> None:
    table = to_table([small_tree()]).replace_schema_metadata(None)
    with pytest.raises(SchemaError, match=r"trace\.schema_version"):
        from_table(table)


def test_broken_parent_names_the_tree() -> None:
    table = to_table([small_tree("good", 0), small_tree("bad", 9)])
    parents = table.column("parent_id").to_numpy().copy()
    parents[5 + 2] = 2  # node 2 of the second tree points at itself
    table = table.set_column(table.schema.get_field_index("parent_id"), "parent_id", [parents])
    with pytest.raises(SchemaError, match=r"run_id='bad', iteration=3, tree_id=9.*node 2"):
        from_table(table)


@pytest.mark.parametrize(("row", "node_id"), [(3, 2), (4, 7)])
def test_node_ids_must_be_dense(row: int, node_id: int) -> None:
    # (3, 2): node 2 twice, node 3 missing; (4, 7): a gap where node 4 should be.
    table = to_table([small_tree()])
    ids = table.column("node_id").to_numpy().copy()
    ids[row] = node_id
    table = table.set_column(table.schema.get_field_index("node_id"), "node_id", [ids])
    with pytest.raises(SchemaError, match=r"tree \(run_id='r'.*node_id .* node \d was expected"):
        from_table(table)


def test_null_in_required_column_names_row() -> None:
    table = to_table([small_tree()])
    i = table.schema.get_field_index("text")
    text = pa.array(["a", "b", None, "d", "e"])
    with pytest.raises(SchemaError, match="column 'text' is null at row 2"):
        from_table(table.set_column(i, pa.field("text", pa.string()), text))


def test_tree_info_must_agree_across_rows() -> None:
    table = to_table([small_tree()])
    i = table.schema.get_field_index("prompt_id")
    prompts = pa.array(["p7", "p7", "p7", "other", "p7"])
    with pytest.raises(SchemaError, match="row 3 has another prompt_id"):
        from_table(table.set_column(i, "prompt_id", prompts))


def test_failed_conversion_leaves_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "trees.parquet"
    write_trees(path, [small_tree()])
    before = path.read_bytes()
    with pytest.raises(AttributeError):
        write_trees(path, [object()])  # type: ignore[list-item]
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["trees.parquet"]


def test_failed_write_leaves_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trees.parquet"
    write_trees(path, [small_tree()])
    before = path.read_bytes()

    def half_write(table: pa.Table, where: BinaryIO, **options: object) -> None:
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(OSError, match="disk full"):
        write_trees(path, [small_tree(tree_id=1)])
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["trees.parquet"]
    assert_same(read_trees(path), [small_tree()])


def test_written_file_is_readable_by_others(tmp_path: Path) -> None:
    # The temp file is created like any open(): the umask decides, not a private 0600.
    path = tmp_path / "trees.parquet"
    write_trees(path, [small_tree()])
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
