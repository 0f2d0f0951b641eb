"""The Arrow codec: partitions as one table per row kind, their layout in the ``row_tags`` column's
metadata, and tables (with a layout or without) back into partitions.

No Ray, no torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dataplane_contract import publish_cut, training_fields, training_tags

from coordinator.dataplane import (
    DATAPLANE,
    TAGS_COLUMN,
    TRAINING,
    FieldData,
    FieldSpec,
    InMemoryDataPlane,
    Objects,
    PartitionRows,
    RowGroup,
    build_table,
    layout_of,
    parse_table,
)
from schemas.errors import InvalidRecordError
from snapformat import SnapshotStore, example


def test_reserved_field_names_and_conflicting_types_are_refused_in_a_typed_table() -> None:
    spec = FieldSpec("tensor", "int32", 0)
    with pytest.raises(InvalidRecordError, match="reserved"):
        build_table("training_rows", [PartitionRows("p", [], [], {TAGS_COLUMN: spec})])
    plane = InMemoryDataPlane()
    plane.put("a", ["k"], {"x": np.array([1], np.int32)})
    plane.put("b", ["k"], {"x": np.array([[1]], np.int32)})
    parts = parse_table(plane.cut().tables[DATAPLANE], "t")
    with pytest.raises(InvalidRecordError, match="one column"):
        build_table(TRAINING, parts)


def test_the_generic_table_keeps_reserved_names_and_conflicting_types_in_columns_of_their_own() -> None:
    plane = InMemoryDataPlane()
    plane.put("a", ["k"], {"x": np.array([1], np.int32), "key": Objects(["mine"])})
    plane.put("b", ["k"], {"x": np.array([[1]], np.int32), "row_tags": np.array([2.5])})
    table = plane.cut().tables[DATAPLANE]
    assert table.column_names == ["key", "partition_id", "row_tags", "key@a", "row_tags@b", "x", "x@b"]
    fields = {p["id"]: p["fields"] for p in layout_of(table.schema)["partitions"]}
    assert fields["a"]["key"]["column"] == "key@a" and "column" not in fields["a"]["x"]
    assert fields["b"]["x"]["column"] == "x@b" and fields["b"]["row_tags"]["column"] == "row_tags@b"
    parts = parse_table(table, "t")
    assert parts[0].groups[0].fields["key"].values == ["mine"]
    assert parts[1].groups[0].fields["x"].values.tolist() == [1] and parts[1].specs["x"].ndim == 1


def test_layout_rides_on_the_tags_column_through_snapformat(tmp_path: Path) -> None:
    """snapformat's conform() rebuilds required fields and the schema metadata: the layout survives."""
    plane = InMemoryDataPlane()
    rng = np.random.default_rng(5)
    plane.put("train", ["a", "b"], training_fields(rng, 2), training_tags(2))
    cut = plane.cut()
    snap, _ = publish_cut(cut, tmp_path / "s")
    table = snap.read_table("training")
    layout = layout_of(table.schema)
    assert layout is not None and layout["partitions"][0]["fields"]["input_ids"]["dtype"] == "int64"
    assert layout["partitions"][0]["fields"]["position_bucket"]["nested"] is False
    assert layout["partitions"][0]["fields"]["extra_info"] == {"type": "object", "json": True}
    assert layout["partitions"][0]["fields"]["env_name"] == {"type": "object", "json": False}


def test_a_part_written_without_a_layout_loads_with_inferred_fields(tmp_path: Path) -> None:
    """Training rows written by something else (snapformat's example) still go back into a data plane."""
    store = SnapshotStore(str(tmp_path / "s"))
    draft = store.begin()
    batch = example.training_batch(example.rollouts(80, 3), 3)
    assert batch.num_rows > 0
    draft.part("tq", writer="tq").write_rows("training.arrow", "training_rows", batch)
    draft.publish()
    plane = InMemoryDataPlane()
    plane.load(store.latest(), "tq")
    keys = batch.column("key").to_pylist()
    assert list(plane.list()["train"]) == keys
    row = plane.get("train", keys[0])
    assert row["input_ids"].dtype == np.int32 and row["input_ids"].tolist() == batch.column("input_ids")[0].as_py()
    assert row["rollout_id"] == batch.column("rollout_id")[0].as_py()
    assert plane.specs("train")["input_ids"].nested and not plane.specs("train")["sample_mask"].nested


def test_a_column_that_is_a_field_in_one_partition_and_a_tag_in_another_must_agree_on_its_type() -> None:
    ids = FieldData(np.zeros(2, dtype=np.int32), np.array([0, 1, 2]))
    one_id = FieldData(np.zeros(1, np.int32), np.array([0, 1]))
    as_field = PartitionRows("a", ["k0"], [{}], {"rollout_id": FieldSpec("tensor", "int64", 0),
                                                 "input_ids": FieldSpec("tensor", "int32", 1)},
                             [RowGroup(np.array([0]), {"rollout_id": FieldData(np.array([7])), "input_ids": one_id})])
    as_tag = PartitionRows("b", ["k0", "k1"], [{"rollout_id": "r0"}, {"rollout_id": "r1"}],
                           {"input_ids": FieldSpec("tensor", "int32", 1)},
                           [RowGroup(np.array([0, 1]), {"input_ids": ids})])
    with pytest.raises(InvalidRecordError, match=r"partition 'a': field 'rollout_id' is int64, but partition 'b' "
                                                 r"fills that column from its tag as string"):
        build_table(TRAINING, [as_field, as_tag])
    assert build_table(TRAINING, [as_tag]).column("rollout_id").to_pylist() == ["r0", "r1"]
