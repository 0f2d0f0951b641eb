"""The row capture on its own (no Ray, no TQ): what a cut plans and assembles is what was put.

A property test puts random batches (fields present in some puts and not others, dense and ragged
rows, objects), removes random keys, then resolves a listing (TransferQueue's ``kv_list``: the live
keys in order, some of them never captured) and checks every assembled row against a plain dict,
and that the table built window by window (as a save writes it) is the table built whole.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.dataplane import TRAINING, FieldData, FieldSpec, Objects, PartitionRows, Ragged, RowGroup, build_table
from coordinator.dataplane.codec import table_schema, whole_source, window_table
from coordinator.dataplane.fields import field_data, rows_of, unify_specs
from coordinator.dataplane.row_kinds import fields_every_row_holds
from coordinator.dataplane.tq import capture
from coordinator.dataplane.tq.capture import RowCapture, assemble, plan_full_fields, plan_source

FIELDS = ("ids", "score", "note", "dense", "word")


def _batch(rng: np.random.Generator, keys: list[str], names: list[str]) -> tuple[dict, dict, dict]:
    """specs, neutral values and the per-key model values of one put."""
    n = len(keys)
    raw: dict[str, Any] = {}
    if "ids" in names:
        raw["ids"] = Ragged([rng.integers(0, 99, rng.integers(0, 4)).astype(np.int32) for _ in range(n)])
    if "score" in names:
        raw["score"] = rng.random(n).astype(np.float32)
    if "note" in names:
        raw["note"] = Objects([{"i": int(rng.integers(0, 9))} for _ in range(n)])
    if "dense" in names:  # a dense put: one length per put, so rows of different puts may differ
        raw["dense"] = rng.integers(0, 9, (n, int(rng.integers(1, 3)))).astype(np.int64)
    if "word" in names:  # objects kept as plain strings unless some put holds a non-string
        raw["word"] = Objects([f"w{j}" for j in range(n)] if rng.random() < 0.7 else list(range(n)))
    specs, data, model = {}, {}, {k: {} for k in keys}
    for name, value in raw.items():
        spec, values = rows_of(name, value, n)
        specs[name], data[name] = spec, field_data(spec, values)
        for k, v in zip(keys, values):
            model[k][name] = v.tolist() if isinstance(v, np.ndarray) else v
    return specs, data, model


def _rows(part: PartitionRows) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {k: {} for k in part.keys}
    for g in part.groups:
        for name, fd in g.fields.items():
            spec = part.specs[name]
            for j, pos in enumerate(g.rows):
                if spec.type == "object":
                    v = fd.values[j]
                elif spec.ndim == 0:
                    v = fd.values[j].item()
                else:
                    v = fd.values[fd.offsets[j]:fd.offsets[j + 1]].tolist()
                out[part.keys[pos]][name] = v
    return out


@settings(max_examples=60, deadline=None)
@given(puts=st.lists(st.tuples(st.integers(1, 5), st.sets(st.sampled_from(FIELDS))), min_size=1, max_size=8),
       removed=st.sets(st.integers(0, 39)), uncaptured=st.sets(st.integers(0, 39)), seed=st.integers(0, 2**16),
       coalesce=st.sampled_from([2, 3, 4096]), window=st.integers(1, 7))
def test_a_planned_cut_assembles_exactly_the_rows_listed(puts, removed, uncaptured, seed, coalesce, window) -> None:
    with mock.patch.object(capture, "COALESCE_ROWS", coalesce):  # small: consecutive puts get merged
        _check_planned_cut(puts, removed, uncaptured, seed, window)


def _check_planned_cut(puts, removed, uncaptured, seed, window) -> None:
    rng = np.random.default_rng(seed)
    cap = RowCapture()
    model: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    i = 0
    for size, names in puts:
        keys = [f"k{i + j}" for j in range(size)]
        i += size
        specs, data, rows = _batch(rng, keys, sorted(names))
        model.update(rows)
        order += keys
        if not (set(range(i - size, i)) & uncaptured):  # another producer's put: TQ has it, the capture not
            assert cap.add("p", keys, specs, data)
    listed = [k for j, k in enumerate(order) if j not in removed]
    (plan,) = cap.resolve({"p": {k: {"n": k} for k in listed}})
    missed_keys = [plan.keys[j] for j in plan.misses]
    assert all(k in listed for k in missed_keys)
    # The misses, as the adapter would read them from TQ: one group per field set.
    missed = PartitionRows("p", missed_keys, [{} for _ in missed_keys])
    for names in {tuple(sorted(model[k])) for k in missed_keys}:
        sel = np.array([j for j, k in enumerate(missed_keys) if tuple(sorted(model[k])) == names], dtype=np.int64)
        if not names:
            continue
        fields = {}
        for name in names:
            spec, values = rows_of(name, _model_value(name, [model[missed_keys[j]][name] for j in sel]), len(sel))
            missed.specs[name] = unify_specs([spec, missed.specs.get(name, spec)], name)  # as the adapter reads them
            fields[name] = field_data(spec, values)
        missed.groups.append(RowGroup(sel, fields))
    part = assemble(plan, missed if missed_keys else None)
    assert part.keys == listed and [t["n"] for t in part.tags] == listed
    assert _rows(part) == {k: model[k] for k in listed}
    for g in part.groups:  # a group's rows hold exactly its fields, in listing order
        assert list(g.rows) == sorted(g.rows)
        for name, fd in g.fields.items():  # a dense field whose rows differ in length is ragged
            if fd.offsets is not None and len(set(np.diff(fd.offsets).tolist())) > 1:
                assert part.specs[name].nested, name
    _check_windows(plan, missed if missed_keys else None, part, window)


def _check_windows(plan, missed, part: PartitionRows, window: int) -> None:
    """The plan built ``window`` rows at a time is the table built whole: same schema, layout
    (dense become ragged, objects kept as JSON, decided over the whole partition) and values."""
    whole = build_table(TRAINING, [part], [3])
    src = plan_source(plan, 3, missed, window_rows=window)
    # Which table the partition goes to is decided from the plan alone, as from the assembled rows.
    held = fields_every_row_holds(((g.fields, len(g.rows)) for g in part.groups), len(part.keys))
    assert plan_full_fields(plan, missed) == held
    assert src.training_misfit == whole_source(part, 3).training_misfit
    schema = table_schema(TRAINING, [src])
    assert schema.equals(whole.schema, check_metadata=True)
    windows = list(src.windows())
    assert all(len(w.keys) <= window for w in windows)
    assert [k for w in windows for k in w.keys] == part.keys
    built = [window_table(src, w, schema) for w in windows]
    streamed = pa.concat_tables(built) if built else schema.empty_table()
    assert streamed.equals(whole, check_metadata=True)


def _model_value(name: str, values: list[Any]) -> Any:
    if name == "ids":
        return Ragged([np.asarray(v, dtype=np.int32) for v in values])
    if name == "score":
        return np.asarray(values, dtype=np.float32)
    if name == "dense":
        rows = [np.asarray(v, dtype=np.int64) for v in values]
        return np.stack(rows) if len({len(r) for r in rows}) == 1 else Ragged(rows)
    return Objects(values)


def test_keys_gone_from_the_listing_are_forgotten_and_whole_segments_freed() -> None:
    cap = RowCapture()
    spec = FieldSpec("tensor", "int32", 0)
    for keys in (["a", "b"], ["c"], ["d"]):
        cap.add("p", keys, {"x": spec}, {"x": FieldData(np.zeros(len(keys), np.int32))})
    cap.add("q", ["z"], {"x": spec}, {"x": FieldData(np.zeros(1, np.int32))})
    full = cap.nbytes
    (plan,) = cap.resolve({"p": {"b": {}, "d": {}}})  # a and c cleared; partition q dropped
    assert [r.segment.keys for r in plan.runs] == [("a", "b"), ("d",)] and not len(plan.misses)
    assert cap.nbytes == full - 8  # c's and z's segments freed; a+b's kept for b
    (again,) = cap.resolve({"p": {"a": {}}})  # a listed again (re-put by someone else): not ours any more
    assert list(again.misses) == [0]


def test_consecutive_small_puts_with_the_same_fields_become_one_segment(monkeypatch) -> None:
    monkeypatch.setattr(capture, "COALESCE_ROWS", 4)
    cap = RowCapture()
    spec = FieldSpec("tensor", "int32", 0)
    for i in range(5):
        cap.add("p", [f"k{i}"], {"x": spec}, {"x": FieldData(np.array([i], np.int32))})
    cap.add("p", ["other"], {"y": spec}, {"y": FieldData(np.array([9], np.int32))})  # other fields: not merged
    (plan,) = cap.resolve({"p": {k: {} for k in ["k0", "k1", "k2", "k3", "k4", "other"]}})
    assert [r.segment.keys for r in plan.runs] == [("k0", "k1", "k2", "k3"), ("k4",), ("other",)]
    assert list(plan.runs[0].segment.fields["x"].values) == [0, 1, 2, 3]


def test_the_bound_stops_keeping_puts_and_says_so(caplog) -> None:
    cap = RowCapture(max_bytes=10)
    spec = FieldSpec("tensor", "int32", 0)
    assert cap.add("p", ["a", "b"], {"x": spec}, {"x": FieldData(np.zeros(2, np.int32))})
    assert not cap.add("p", ["c", "d"], {"x": spec}, {"x": FieldData(np.zeros(2, np.int32))})
    assert "later puts are not kept" in caplog.text
    (plan,) = cap.resolve({"p": {"a": {}, "b": {}, "c": {}, "d": {}}})
    assert list(plan.misses) == [2, 3]


def test_a_restored_partition_is_kept_as_runs_of_rows_with_the_same_fields() -> None:
    spec_x, spec_y = FieldSpec("tensor", "int32", 0), FieldSpec("object")
    part = PartitionRows("p", ["a", "b", "c", "d", "e"], [{}] * 5, {"x": spec_x, "y": spec_y}, [
        RowGroup(np.array([0, 1, 4]), {"x": FieldData(np.array([1, 2, 5], np.int32))}),
        RowGroup(np.array([2]), {"x": FieldData(np.array([3], np.int32)), "y": FieldData(["c"])}),
    ])  # d holds no field
    cap = RowCapture()
    assert cap.adopt(part)
    (plan,) = cap.resolve({"p": {k: {} for k in part.keys}})
    assert [r.segment.keys for r in plan.runs] == [("a", "b"), ("c",), ("d",), ("e",)]
    back = assemble(plan)
    assert _rows(back) == {"a": {"x": 1}, "b": {"x": 2}, "c": {"x": 3, "y": "c"}, "d": {}, "e": {"x": 5}}
    assert list(back.specs) == ["x", "y"]


def test_a_save_holds_one_window_of_rows_at_a_time_and_writes_them_all(tmp_path, monkeypatch) -> None:
    import gc
    import weakref

    from coordinator.dataplane import codec, write_sources
    from snapformat import SnapshotStore

    rng = np.random.default_rng(5)
    cap = RowCapture()
    listing = {}
    for start in range(0, 40, 10):
        keys = [f"k{start + j}" for j in range(10)]
        specs, data, _ = _batch(rng, keys, ["ids", "score"])
        specs["score"], data["score"] = FieldSpec("tensor", "int32", 0), FieldData(np.arange(10, dtype=np.int32))
        rename = {"ids": "input_ids", "score": "input_lengths"}  # the columns a training row needs
        cap.add("p", keys, {rename[n]: v for n, v in specs.items()}, {rename[n]: v for n, v in data.items()})
        listing.update({k: {"rollout_id": k, "attempt_index": 0} for k in keys})
    (plan,) = cap.resolve({"p": listing})
    built = codec.window_table
    alive: list[weakref.ref] = []

    def watched(src, window, schema):
        gc.collect()
        assert not [r for r in alive if r() is not None], "an earlier window is still held"
        alive.append(weakref.ref(window.groups[0].fields["input_ids"].values))  # the window's own copy
        return built(src, window, schema)

    monkeypatch.setattr(codec, "window_table", watched)
    store = SnapshotStore(str(tmp_path / "s"))
    draft = store.begin()
    written = write_sources({TRAINING: [plan_source(plan, 0, window_rows=6)]}, draft.part("tq", writer="tq"))
    draft.publish()
    assert len(alive) == 7 and dict(written.rows) == {TRAINING: 40}
    (entry,) = [e for e in store.latest().files() if e.kind == TRAINING]
    table = store.latest().open_rows(entry).read_all()
    assert table.column("key").to_pylist() == list(listing) and entry.batches == 7
