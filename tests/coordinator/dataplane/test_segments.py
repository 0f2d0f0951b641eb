"""Incremental saves without Ray: the segment planner on its own (a property test over any sequence
of appends and removals of keys), and the incremental contract on the in-memory data plane
(write-once), plus what only a unit test reaches: segment sizes, a history for another parent, a
data plane whose rows are not write-once, layouts that differ between segments.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
from dataplane_contract import TOKEN_PARTITION, Harness, fill, training_fields, training_tags
from hypothesis import given, settings
from hypothesis import strategies as st
from segments_contract import IncrementalContract, keys_of, new_entries, row_entries, save
from test_memory import MemoryHarness

from coordinator.dataplane import (
    DATAPLANE,
    SEGMENT_ROWS,
    TRAINING,
    FieldData,
    FieldSpec,
    HeldSegment,
    InMemoryDataPlane,
    PartitionRows,
    RowGroup,
    SegmentHistory,
)
from coordinator.dataplane.errors import DataPlaneError
from coordinator.dataplane.fields import join_partitions
from coordinator.dataplane.segments import Fresh, Reuse, plan_segments, segment_rows_for
from schemas.errors import InvalidRecordError
from schemas.manifest import FileEntry
from snapformat import SnapshotStore

# ------------------------------------------------------------------ the planner alone


def _entry(number: int, rows: int, kind: str = TRAINING) -> FileEntry:
    digest = hashlib.sha256(str(number).encode()).hexdigest()
    return FileEntry(path=f"tq/segments/s-{number}.arrow", kind=kind, size=100 + rows, checksum=f"sha256:{digest}",
                     records=rows, object=f"sha256:{digest}")


def _after(pieces: Sequence[Reuse | Fresh], keys: Sequence[str], numbers: Iterator[int]) -> list[HeldSegment]:
    """What a snapshot written by ``pieces`` holds, as the writer records it (a reference narrows its
    entry as ``PartWriter.reference`` does; a new segment is a new object)."""
    out = []
    for piece in pieces:
        if isinstance(piece, Reuse):
            whole = piece.row_range == (0, piece.segment.object_rows)
            entry = msgspec.structs.replace(piece.segment.entry, records=piece.length,
                                            row_range=None if whole else piece.row_range)
            out.append(HeldSegment(entry, piece.keys, piece.segment.object_rows))
        elif piece.stop > piece.start:
            rows = piece.stop - piece.start
            out.append(HeldSegment(_entry(next(numbers), rows), tuple(keys[piece.start:piece.stop]), rows))
    return out


def _check(pieces: Sequence[Reuse | Fresh], keys: Sequence[str], held: Sequence[HeldSegment], max_rows: int) -> None:
    """The plan covers every listed key once, in order; it references exactly the held segments the
    rules keep; new segments are bounded."""
    if not keys:
        assert pieces == [Fresh(0, 0)]
        return
    pos = 0
    for piece in pieces:
        if isinstance(piece, Reuse):
            assert piece.at == pos and piece.keys == tuple(keys[pos:pos + piece.length]) and piece.length > 0
            low = piece.segment.first_row
            assert low <= piece.row and piece.row + piece.length <= low + len(piece.segment.keys)
            pos += piece.length
        else:
            assert piece.start == pos and 0 < piece.stop - piece.start <= max_rows
            pos = piece.stop
    assert pos == len(keys)
    listed = {k: i for i, k in enumerate(keys)}
    referenced = {id(p.segment) for p in pieces if isinstance(p, Reuse)}
    for seg in held:
        rows = [j for j, k in enumerate(seg.keys) if k in listed]
        positions = [listed[seg.keys[j]] for j in rows]
        keep = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows))) \
            and positions == list(range(positions[0], positions[0] + len(rows))) \
            and (64 if seg.first_row + rows[-1] + 1 == seg.object_rows else 4) * len(rows) >= seg.object_rows
        assert (id(seg) in referenced) == keep, (seg.keys, keys)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 25)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 10_000), max_size=12)),
    st.tuples(st.just("remove_front"), st.integers(0, 6)),  # consumed oldest first: segments narrow
    st.tuples(st.just("remove_back"), st.integers(0, 4)),
    st.tuples(st.just("readd"), st.integers(0, 3)),  # a cleared key listed again comes last (creation order)
    st.tuples(st.just("save"), st.none()),
), max_size=20)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, max_rows=st.sampled_from([1, 3, 8]))
def test_any_appends_and_removals_are_planned_exactly(ops: list[tuple], max_rows: int) -> None:
    keys: list[str] = []
    removed: list[str] = []
    fresh_keys = (f"k{i}" for i in itertools.count())
    numbers = itertools.count()
    held: list[HeldSegment] = []
    for op, arg in [*ops, ("save", None)]:
        if op == "append":
            keys += [next(fresh_keys) for _ in range(arg)]
        elif op == "remove" and keys:
            gone = {keys[i % len(keys)] for i in arg}
            removed += [k for k in keys if k in gone]
            keys = [k for k in keys if k not in gone]
        elif op == "remove_front":
            removed += keys[:arg]
            keys = keys[arg:]
        elif op == "remove_back" and arg:
            removed += keys[-arg:]
            keys = keys[:-arg]
        elif op == "readd" and removed:
            back = removed[:arg]
            removed = removed[arg:]
            keys += back
        if op != "save":
            continue
        held_keys = {k for s in held for k in s.keys}
        pieces = plan_segments(keys, held, TRAINING, max_rows)
        _check(pieces, keys, held, max_rows)
        # Rows no held segment holds (new keys) are always written new.
        assert all(k in held_keys for p in pieces if isinstance(p, Reuse) for k in p.keys)
        held = _after(pieces, keys, numbers)


def test_appends_alone_write_only_the_new_keys() -> None:
    keys = [f"k{i}" for i in range(20)]
    numbers = itertools.count()
    held = _after(plan_segments(keys, [], TRAINING, 8), keys, numbers)
    assert [len(s.keys) for s in held] == [8, 8, 4]
    keys += [f"n{i}" for i in range(11)]
    pieces = plan_segments(keys, held, TRAINING, 8)
    assert [type(p).__name__ for p in pieces] == ["Reuse", "Reuse", "Reuse", "Fresh", "Fresh"]
    assert [(p.start, p.stop) for p in pieces if isinstance(p, Fresh)] == [(20, 28), (28, 31)]


def test_small_segments_side_by_side_are_written_again_as_one() -> None:
    """A partition that gains 3 rows per save gains a small segment each time (small: fewer than
    64 // 8 rows); the save that would leave 8 of them in a row writes them again as one."""
    keys: list[str] = []
    numbers = itertools.count()
    held: list[HeldSegment] = []
    counts = []
    for save_no in range(9):
        keys += [f"s{save_no}-{i}" for i in range(3)]
        pieces = plan_segments(keys, held, TRAINING, 64)
        _check_cover(pieces, keys)
        held = _after(pieces, keys, numbers)
        counts.append(len(held))
    assert counts == [1, 2, 3, 4, 5, 6, 7, 1, 2]  # the 8th save rewrote 7 small segments and its new rows
    assert [len(s.keys) for s in held] == [24, 3]
    # Large segments are never merged, however many: only small ones are.
    big = [f"b{i}" for i in range(64 * 9)]
    held = _after(plan_segments(big, [], TRAINING, 64), big, numbers)
    assert all(isinstance(p, Reuse) for p in plan_segments(big, held, TRAINING, 64))


def _check_cover(pieces: Sequence[Reuse | Fresh], keys: Sequence[str]) -> None:
    """The pieces cover every listed position once, in order."""
    pos = 0
    for piece in pieces:
        start, stop = (piece.at, piece.at + piece.length) if isinstance(piece, Reuse) else (piece.start, piece.stop)
        assert start == pos
        pos = stop
    assert pos == len(keys)


def test_keys_cleared_at_either_end_narrow_the_reference() -> None:
    keys = [f"k{i}" for i in range(8)]
    (seg,) = _after(plan_segments(keys, [], TRAINING), keys, itertools.count())
    (piece,) = plan_segments(keys[3:7], [seg], TRAINING)
    assert isinstance(piece, Reuse) and piece.row_range == (3, 7) and piece.keys == tuple(keys[3:7])
    # Narrowed again from what the parent held: rows are counted in the object, not in the parent's range.
    (narrowed,) = _after([piece], keys[3:7], itertools.count())
    assert narrowed.first_row == 3 and narrowed.object_rows == 8
    (again,) = plan_segments(keys[4:6], [narrowed], TRAINING)
    assert isinstance(again, Reuse) and again.row_range == (4, 6)
    assert plan_segments(keys[5:6], [narrowed], TRAINING) == [Fresh(0, 1)]  # 1 of 8 rows, not its last: below a quarter
    (tail,) = plan_segments(keys[7:8], [seg], TRAINING)  # its last row alone: only the oldest were consumed
    assert isinstance(tail, Reuse) and tail.row_range == (7, 8)


def test_a_segment_of_another_kind_is_written_again() -> None:
    keys = [f"k{i}" for i in range(5)]
    held = [HeldSegment(_entry(0, 5, DATAPLANE), tuple(keys), 5)]
    assert plan_segments(keys, held, TRAINING) == [Fresh(0, 5)]
    assert isinstance(plan_segments(keys, held, DATAPLANE)[0], Reuse)


def test_segment_size_follows_the_row_size() -> None:
    assert segment_rows_for(0) == SEGMENT_ROWS == 8192
    assert segment_rows_for(1024) == 8192 and segment_rows_for(16 << 10) == 4096 and segment_rows_for(1 << 30) == 1


def test_a_history_serves_only_a_draft_of_its_snapshot() -> None:
    history = SegmentHistory("snap-1", {})
    assert history.for_parent("snap-1") is history
    assert history.for_parent("snap-2") is None and history.for_parent(None) is None


# ------------------------------------------------------------------ the in-memory data plane


class WriteOnceHarness(MemoryHarness):
    def __init__(self) -> None:
        self.plane = InMemoryDataPlane(token_capture_partitions={TOKEN_PARTITION}, write_once=True)


class TestInMemoryIncremental(IncrementalContract):
    @pytest.fixture
    def harness(self) -> WriteOnceHarness:
        return WriteOnceHarness()


def test_a_write_once_plane_refuses_a_second_put_of_a_key() -> None:
    plane = InMemoryDataPlane(write_once=True)
    plane.put("p", ["a"], tags=[{"x": 1}])
    plane.delete("p", ["a"])
    with pytest.raises(DataPlaneError, match="write-once"):
        plane.put("p", ["a"], tags=[{"x": 2}])


def test_a_large_partition_is_cut_into_segments_of_at_most_segment_rows(tmp_path: Path) -> None:
    h = WriteOnceHarness()
    n = SEGMENT_ROWS + 808
    tags = [{"rollout_id": f"r{i}", "attempt_index": 0} for i in range(n)]
    h.put("train", [f"k{i:05d}" for i in range(n)], {"input_ids": np.ones((n, 2), np.int32),
                                                     "input_lengths": np.full(n, 2, np.int32)}, tags)
    store = SnapshotStore(str(tmp_path / "store"))
    first, w1 = save(h, store, None)
    assert [e.records for e in row_entries(first)] == [SEGMENT_ROWS, 808]
    h.put("train", ["z"], {"input_ids": np.ones((1, 2), np.int32), "input_lengths": np.full(1, 2, np.int32)},
          [{"rollout_id": "z", "attempt_index": 0}])
    second, _ = save(h, store, w1.segments)
    assert [e.records for e in row_entries(second)] == [SEGMENT_ROWS, 808, 1]
    assert keys_of(second, new_entries(second, first)) == ["z"]


def test_a_history_of_another_snapshot_writes_every_row(tmp_path: Path) -> None:
    h = WriteOnceHarness()
    fill(h)
    store = SnapshotStore(str(tmp_path / "store"))
    first, w1 = save(h, store, None)
    stale = SegmentHistory("snap-elsewhere", w1.segments.partitions)
    second, w2 = save(h, store, stale)
    entries = row_entries(second)
    assert w2.shared_bytes == 0 and w2.new_bytes == sum(e.size for e in entries)
    # Written again (the same bytes, so the same objects), each under a name of the second snapshot.
    assert all(second.manifest.snapshot_id in e.path for e in entries)
    assert [e.object for e in entries] == [e.object for e in row_entries(first)]


def test_rows_that_are_not_write_once_are_written_every_time(tmp_path: Path) -> None:
    """A key alone does not say that its row is unchanged: the in-memory plane lets a put change it."""
    h: Harness = MemoryHarness()
    rng = np.random.default_rng(3)
    h.put("train", ["a", "b"], training_fields(rng, 2), training_tags(2))
    store = SnapshotStore(str(tmp_path / "store"))
    first, w1 = save(h, store, None)
    h.put("train", ["a"], training_fields(rng, 1), [{"rollout_id": "changed", "attempt_index": 1}])
    second, w2 = save(h, store, w1.segments)
    assert w2.shared_bytes == 0 and new_entries(second, first) == row_entries(second)
    assert second.read_table("training").column("rollout_id").to_pylist() == ["changed", "p0_g1"]


def test_segments_of_one_partition_join_into_one_layout() -> None:
    """A field dense in one segment and ragged in another is ragged; fields keep the newest order;
    a key in two segments is refused."""
    dense = FieldSpec("tensor", "int32", 1)
    ragged = FieldSpec("tensor", "int32", 1, nested=True)

    def piece(keys: list[str], specs: dict[str, FieldSpec], lengths: list[int]) -> PartitionRows:
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        fields = {name: FieldData(np.arange(off[-1], dtype=np.int32), off) for name in specs}
        return PartitionRows("p", keys, [{} for _ in keys], specs, [RowGroup(np.arange(len(keys)), fields)])

    joined = join_partitions([piece(["a", "b"], {"x": dense}, [2, 2]),
                              piece(["c"], {"y": dense, "x": ragged}, [3])], "t")
    assert joined.keys == ["a", "b", "c"] and list(joined.specs) == ["y", "x"]
    assert joined.specs["x"] == ragged and joined.specs["y"] == dense
    assert [g.rows.tolist() for g in joined.groups] == [[0, 1], [2]]
    with pytest.raises(InvalidRecordError, match="'b' of partition 'p' is in two segments"):
        join_partitions([piece(["a", "b"], {"x": dense}, [1, 1]), piece(["b"], {"x": dense}, [1])], "t")
