"""The DataPlane interface: the shared contract on the in-memory reference, and the table mapping.

No Ray, no torch: this module must run where only the snapshot format is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from dataplane_contract import (
    TOKEN_PARTITION, DataPlaneContract, Harness, norm_object, norm_tensor, publish_cut, training_fields,
    training_tags,
)

from coordinator import InMemoryDataPlane, Objects, Ragged
from coordinator.data_plane import (
    DATAPLANE, TAGS_COLUMN, TRAINING, FieldData, FieldSpec, PartitionRows, RowGroup, build_table, check_json_value,
    group_by_presence, layout_of, parse_table,
)
from schemas.errors import InvalidRecordError
from snapformat import SnapshotStore, example


class MemoryHarness(Harness):
    def __init__(self) -> None:
        self.plane = InMemoryDataPlane(token_capture_partitions={TOKEN_PARTITION})

    def put(self, partition_id, keys, fields=None, tags=None) -> None:
        self.plane.put(partition_id, keys, fields, tags)

    def delete(self, partition_id, keys) -> None:
        self.plane.delete(partition_id, keys)

    def contents(self) -> dict[str, Any]:
        out = {}
        for pid, key_tags in self.plane.list().items():
            specs = self.plane.specs(pid)
            rows = {}
            for key in key_tags:
                rows[key] = {name: (norm_tensor(specs[name].dtype, v.shape, v.tobytes()) if isinstance(v, np.ndarray)
                                    else norm_object(v)) for name, v in self.plane.get(pid, key).items()}
            held = {name for r in rows.values() for name in r}
            out[pid] = {"keys": list(key_tags), "tags": key_tags, "rows": rows,
                        "layout": {n: (s.dtype, s.nested) for n, s in specs.items() if n in held}}
        return out


class TestInMemoryContract(DataPlaneContract):
    @pytest.fixture
    def harness(self) -> MemoryHarness:
        return MemoryHarness()


def test_importing_the_interface_loads_neither_ray_nor_torch() -> None:
    import subprocess

    code = "import coordinator, coordinator.data_plane, sys; print('ray' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["False", "False"]


def test_in_memory_plane_copies_in_and_out() -> None:
    plane = InMemoryDataPlane()
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    plane.put("p", ["a", "b"], {"ids": ids}, [{"rollout_id": "r0", "attempt_index": 0}] * 2)
    ids[:] = -1  # the caller's array changes: the plane's copy does not
    got = plane.get("p", "a")["ids"]
    assert got.tolist() == [0, 1, 2]
    got[:] = 7
    assert plane.get("p", "a")["ids"].tolist() == [0, 1, 2]


def test_tags_merge_like_transferqueue() -> None:
    plane = InMemoryDataPlane()
    plane.put("p", ["a"], tags=[{"x": 1}])
    plane.put("p", ["a"], tags=[{"y": 2}])
    assert plane.list() == {"p": {"a": {"x": 1, "y": 2}}}


@pytest.mark.parametrize("bad", [(1, 2), {1: "a"}, np.int64(3), {"a": {"b": (1,)}}, b"x"])
def test_values_json_would_change_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidRecordError):
        check_json_value(bad, "here")
    plane = InMemoryDataPlane()
    with pytest.raises(InvalidRecordError):
        plane.put("p", ["a"], tags=[{"t": bad}])


def test_json_values_that_survive_are_kept_as_is() -> None:
    plane = InMemoryDataPlane()
    value = {"nan": float("nan"), "big": 2**70, "s": "é\n", "l": [None, True, 1.5]}
    plane.put("p", ["a"], {"obj": Objects([value])}, [{"nested": value}])
    cut = plane.cut()
    parts = parse_table(cut.tables[DATAPLANE], "t")  # not training rows: no input_ids
    got = parts[0].groups[0].fields["obj"].values[0]
    assert json.dumps(got, sort_keys=True) == json.dumps(value, sort_keys=True)
    assert parts[0].tags[0]["nested"]["big"] == 2**70


def test_group_by_presence_keeps_row_order() -> None:
    groups = group_by_presence({"a": np.array([1, 1, 0, 1], bool), "b": np.array([1, 0, 0, 1], bool)}, 4)
    assert [(g.tolist(), names) for g, names in groups] == [([0, 3], ["a", "b"]), ([1], ["a"]), ([2], [])]
    assert [(g.tolist(), n) for g, n in group_by_presence({}, 2)] == [([0, 1], [])]


def test_field_spec_rejects_nonsense() -> None:
    with pytest.raises(InvalidRecordError):
        FieldSpec("tensor", "complex64")
    with pytest.raises(InvalidRecordError):
        FieldSpec("tensor", "int32", 2, ())
    with pytest.raises(InvalidRecordError):
        FieldSpec("tensor", "int32", 0, (), nested=True)


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
    snap, _ = publish_cut(plane, cut, tmp_path / "s")
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


def test_column_cast_back_must_be_exact() -> None:
    """A layout claiming a narrower dtype than the stored values is refused, not silently wrapped."""
    plane = InMemoryDataPlane()
    plane.put("p", ["a"], {"x": np.array([300], np.int32)}, [{"rollout_id": "r", "attempt_index": 0}])
    table = plane.cut().tables[DATAPLANE]
    layout = layout_of(table.schema)
    layout["partitions"][0]["fields"]["x"]["dtype"] = "int8"
    i = table.schema.get_field_index(TAGS_COLUMN)
    table = table.set_column(i, table.schema.field(i).with_metadata({b"dataplane.layout": json.dumps(layout)}),
                             table.column(i))
    with pytest.raises(InvalidRecordError, match="do not fit int8"):
        parse_table(table, "t")


def test_dense_field_keeps_its_layout_in_memory() -> None:
    plane = InMemoryDataPlane()
    plane.put("p", ["a", "b"], {"d": np.zeros((2, 3), np.float32), "r": Ragged([np.zeros(1), np.zeros(2)])})
    parts = parse_table(plane.cut().tables[DATAPLANE], "t")
    assert parts[0].specs["d"] == FieldSpec("tensor", "float32", 1, (), False)
    assert parts[0].specs["r"] == FieldSpec("tensor", "float64", 1, (), True)
    assert pa.types.is_list(plane.cut().tables[DATAPLANE].schema.field("d").type)


def test_a_column_that_is_a_field_in_one_partition_and_a_tag_in_another_must_agree_on_its_type() -> None:
    ids = FieldData(np.zeros(2, dtype=np.int32), np.array([0, 1, 2]))
    as_field = PartitionRows("a", ["k0"], [{}], {"rollout_id": FieldSpec("tensor", "int64", 0),
                                                 "input_ids": FieldSpec("tensor", "int32", 1)},
                             [RowGroup(np.array([0]), {"rollout_id": FieldData(np.array([7])),
                                                       "input_ids": FieldData(np.zeros(1, np.int32), np.array([0, 1]))})])
    as_tag = PartitionRows("b", ["k0", "k1"], [{"rollout_id": "r0"}, {"rollout_id": "r1"}],
                           {"input_ids": FieldSpec("tensor", "int32", 1)},
                           [RowGroup(np.array([0, 1]), {"input_ids": ids})])
    with pytest.raises(InvalidRecordError, match=r"partition 'a': field 'rollout_id' is int64, but partition 'b' "
                                                 r"fills that column from its tag as string"):
        build_table(TRAINING, [as_field, as_tag])
    assert build_table(TRAINING, [as_tag]).column("rollout_id").to_pylist() == ["r0", "r1"]
