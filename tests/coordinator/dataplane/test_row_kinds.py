"""The generic row kind (``dataplane_rows``) on the in-memory data plane: which partitions go to it,
the columns it gives fields it cannot store under their own name, and a property test that rows of
any shape (any dtype, dense or ragged, 0 to 3 dimensions, objects, tags, reserved or clashing field
names) come back exactly through a published snapshot.

No Ray, no torch.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from dataplane_contract import assert_same, norm_object, norm_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.dataplane import FieldSpec, InMemoryDataPlane, Objects, Ragged, build_table, layout_of, parse_table
from coordinator.dataplane.row_kinds import (
    DATAPLANE,
    TOKEN_CAPTURE,
    TRAINING,
    assign_columns,
    assign_kind,
    fields_every_row_holds,
    fits_column,
    training_misfit,
)
from schemas.errors import InvalidRecordError
from snapformat import SnapshotStore, verify_snapshot

INT32 = FieldSpec("tensor", "int32", 0)
IDS = FieldSpec("tensor", "int64", 1, (), True)
TAGS = [{"rollout_id": "r0", "attempt_index": 0}, {"rollout_id": "r1", "attempt_index": 2}]


def contents(plane: InMemoryDataPlane) -> dict[str, Any]:
    """Everything the plane holds, through its own API: keys in order, tags, values, layouts (in the
    partition's field order; a row's own fields have no order, TransferQueue keeps none)."""
    out = {}
    for pid, key_tags in plane.list().items():
        specs = plane.specs(pid)
        rows = {key: {name: (norm_tensor(specs[name].dtype, v.shape, v.tobytes()) if isinstance(v, np.ndarray)
                             else norm_object(v)) for name, v in sorted(plane.get(pid, key).items())}
                for key in key_tags}
        held = {name for r in rows.values() for name in r}
        out[pid] = {"keys": list(key_tags), "tags": key_tags, "rows": rows,
                    "layout": {n: (s.type, s.dtype, s.ndim, s.inner, s.nested) for n, s in specs.items() if n in held}}
    return out


# ------------------------------------------------------------------ which kind a partition is


def test_a_partition_fits_training_rows_only_when_every_row_carries_every_required_column() -> None:
    specs = {"input_ids": IDS, "input_lengths": INT32}
    full = frozenset(specs)
    assert training_misfit(specs, full, TAGS) is None
    assert training_misfit({}, frozenset(), []) is None  # an empty partition: no row lacks anything
    assert training_misfit(specs, frozenset({"input_ids"}), TAGS) == "not every row holds field 'input_lengths'"
    assert "row 1 has neither a field nor a tag 'attempt_index'" in training_misfit(
        specs, full, [TAGS[0], {"rollout_id": "r1"}])
    assert "row 0 has neither a field nor a tag 'attempt_index'" in training_misfit(  # "0" is text, True a bool
        specs, full, [{"rollout_id": "r0", "attempt_index": "0"}, TAGS[1]])
    assert training_misfit(specs, full, [{"rollout_id": "r0", "attempt_index": True}, TAGS[1]]) is not None
    assert "'rollout_id'" in training_misfit(specs, full, [{"attempt_index": 0}] * 2)
    # a field named like a training column must fit the column's type; a reserved name never fits
    two_d = {**specs, "input_ids": FieldSpec("tensor", "int64", 2, (3,), True)}
    assert "field 'input_ids' is list<item: list<item: int64>>" in training_misfit(two_d, full, TAGS)
    assert "field 'sample_mask'" in training_misfit({**specs, "sample_mask": FieldSpec("object")}, full, TAGS)
    assert "'row_tags' is named like a reserved column" in training_misfit({**specs, "row_tags": INT32}, full, TAGS)
    # fields the schema does not name, and nullable ones held by some rows only, are fine
    assert training_misfit({**specs, "advantages": FieldSpec("tensor", "float16", 1, (), True),
                            "note": FieldSpec("object")}, full, TAGS) is None


def test_kinds_are_assigned_token_capture_first_then_training_then_generic() -> None:
    assert assign_kind(True, "anything") == TOKEN_CAPTURE
    assert assign_kind(True, None) == TOKEN_CAPTURE
    assert assign_kind(False, None) == TRAINING
    assert assign_kind(False, "row 0 lacks input_ids") == DATAPLANE
    assert fields_every_row_holds([({"a", "b"}, 2), ({"a"}, 3), ((), 1)], 6) == frozenset()
    assert fields_every_row_holds([({"a", "b"}, 2), ({"a"}, 3)], 5) == frozenset({"a"})


@pytest.mark.parametrize(("got", "want", "ok"), [
    (pa.list_(pa.int64()), pa.list_(pa.int32()), True),  # whether the values fit is checked when written
    (pa.list_(pa.bool_()), pa.list_(pa.int8()), True),
    (pa.list_(pa.float16()), pa.list_(pa.float32()), True),
    (pa.int64(), pa.list_(pa.int32()), False),
    (pa.list_(pa.list_(pa.int32())), pa.list_(pa.int32()), False),
    (pa.string(), pa.int32(), False),
    (pa.int64(), pa.string(), False),  # numbers never become text in a typed table
    (pa.string(), pa.string(), True),
])
def test_a_field_fits_a_typed_column_of_the_same_nesting_and_family(got, want, ok) -> None:
    assert fits_column(got, want) is ok


def test_fields_that_cannot_keep_their_name_get_a_column_of_their_own() -> None:
    f64, i32 = FieldSpec("tensor", "float64", 0), FieldSpec("tensor", "int32", 0)
    moved = assign_columns([
        ("a", {"x": i32, "key": i32}),
        ("b", {"x": f64, "key": i32, "key@b": i32, "y": f64}),
        ("c", {"x": i32, "x@b": i32}),  # x shares a's column; x@b (int32) cannot share b's float64 one
    ])
    assert moved == [{"key": "key@a"}, {"x": "x@b", "key": "key@b", "key@b": "key@b@b"}, {"x@b": "x@b@c"}]


def test_a_layout_that_puts_a_field_in_a_reserved_column_is_refused() -> None:
    plane = InMemoryDataPlane()
    plane.put("p", ["a"], {"key": np.array([1], np.int32)})
    table = plane.cut().tables[DATAPLANE]
    layout = layout_of(table.schema)
    assert layout["partitions"][0]["fields"]["key"]["column"] == "key@p"
    layout["partitions"][0]["fields"]["key"]["column"] = "partition_id"
    i = table.schema.get_field_index("row_tags")
    table = table.set_column(i, table.schema.field(i).with_metadata({b"dataplane.layout": json.dumps(layout)}),
                             table.column(i))
    with pytest.raises(InvalidRecordError, match="partition 'p': a field cannot be stored in column 'partition_id'"):
        parse_table(table, "t")


def test_training_rows_are_unchanged_and_need_no_feature(tmp_path) -> None:
    """A data plane of training rows only writes what it wrote before dataplane_rows existed."""
    plane = InMemoryDataPlane()
    plane.put("train", ["a", "b"], {"input_ids": Ragged([np.arange(3), np.arange(2)]),
                                    "input_lengths": np.array([3, 2], np.int32)}, TAGS)
    cut = plane.cut()
    assert set(cut.tables) == {TRAINING}
    assert cut.tables[TRAINING].equals(build_table(TRAINING, parse_table(cut.tables[TRAINING], "t")),
                                       check_metadata=True)
    store = SnapshotStore(str(tmp_path))
    draft = store.begin()
    cut.write(draft.part("tq", writer="tq"))
    draft.publish()
    assert store.latest().manifest.required_features == []
    assert [e.path for e in store.latest().files() if e.kind.endswith("_rows")] == ["tq/training.arrow"]


# ------------------------------------------------------------------ any rows round-trip (property)

DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32",
          "float64"]
NAMES = ["token_ids_delta", "prev_len", "w", "key", "row_tags", "w@p0"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)


@st.composite
def layouts(draw) -> FieldSpec:
    if draw(st.integers(0, 5)) == 0:
        return FieldSpec("object")
    ndim = draw(st.integers(0, 3))
    inner = tuple(draw(st.lists(st.integers(0, 3), min_size=max(ndim - 1, 0), max_size=max(ndim - 1, 0))))
    return FieldSpec("tensor", draw(st.sampled_from(DTYPES)), ndim, inner, ndim > 0 and draw(st.booleans()))


def _values(rng: np.random.Generator, spec: FieldSpec, n: int, draw) -> Any:
    """One put's values of a field with layout ``spec`` (``Objects``, ``Ragged`` or a dense array)."""
    if spec.type == "object":
        return Objects([draw(JSON) for _ in range(n)])

    def arr(shape: tuple[int, ...]) -> np.ndarray:
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "b":
            return rng.random(shape) < 0.5
        if dtype.kind in "iu":  # the whole range: extremes must survive too
            info = np.iinfo(dtype)
            return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        out = (rng.standard_normal(shape) * 100).astype(dtype)
        if out.size and rng.random() < 0.3:
            out.reshape(-1)[0] = np.nan  # kept bit for bit
        return out

    if spec.ndim == 0:
        return arr((n,))
    if spec.nested:
        return Ragged([arr((int(rng.integers(0, 4)), *spec.inner)) for _ in range(n)])
    return arr((n, int(rng.integers(0, 4)), *spec.inner))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_rows_of_any_shape_come_back_exactly(data, seed: int) -> None:
    rng = np.random.default_rng(seed)
    plane = InMemoryDataPlane()
    for p in range(data.draw(st.integers(1, 3), "partitions")):
        pid = f"p{p}"
        if data.draw(st.booleans(), f"{pid} is training rows"):  # a typed partition in the same save
            n = data.draw(st.integers(1, 3))
            plane.put(pid, [f"k{i}" for i in range(n)],
                      {"input_ids": Ragged([np.arange(i + 1, dtype=np.int64) for i in range(n)]),
                       "input_lengths": np.arange(1, n + 1, dtype=np.int32)},
                      [{"rollout_id": f"r{i}", "attempt_index": i} for i in range(n)])
            continue
        specs = {name: data.draw(layouts(), f"{pid}.{name}")
                 for name in data.draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4))}
        key = 0
        for _ in range(data.draw(st.integers(1, 3), f"{pid} puts")):
            n = data.draw(st.integers(1, 4))
            names = data.draw(st.lists(st.sampled_from(sorted(specs) or ["-"]), unique=True)) if specs else []
            fields = {name: _values(rng, specs[name], n, data.draw) for name in names if name in specs}
            tags = [data.draw(st.dictionaries(st.sampled_from(["rollout_id", "turn", "x"]), JSON, max_size=2))
                    for _ in range(n)]
            plane.put(pid, [f"k{key + i}" for i in range(n)], fields, tags)
            key += n
    before = contents(plane)
    cut = plane.cut()
    with tempfile.TemporaryDirectory() as root:
        store = SnapshotStore(root)
        draft = store.begin()
        cut.write(draft.part("tq", writer="tq"))
        draft.publish()
        snap = store.latest()
        assert snap.manifest.required_features == ([DATAPLANE] if DATAPLANE in cut.tables else [])
        report = verify_snapshot(snap)
        assert report.ok, report.problems
        plane.clear()
        plane.load(snap, "tq")
    assert_same(before, contents(plane))
    again = plane.cut()  # the same tables (values are compared above, bit for bit: NaN != NaN here)
    assert set(again.tables) == set(cut.tables)
    for kind, table in cut.tables.items():
        assert again.tables[kind].schema.equals(table.schema, check_metadata=True), kind
        assert again.tables[kind].column("key").equals(table.column("key")), kind
