"""What every write-once data plane does in incremental saves, written once (as
``dataplane_contract.py`` is for whole saves).

A test module subclasses :class:`IncrementalContract` and provides a ``harness`` fixture (a
:class:`~dataplane_contract.Harness` over a fresh, empty data plane whose rows are write-once, each
key put once). Each test saves the data plane as a save does (``RowsCut.write_segments`` into a
draft, listing again the segments of the parent's :class:`SegmentHistory`), publishes, and checks
what was written new, what was listed again, and that loading the snapshot gives back exactly what
the data plane held (``Harness.contents``, read through the data plane's own API).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from dataplane_contract import Harness, assert_same, fill, training_fields, training_tags

from coordinator.dataplane import TOKEN_CAPTURE, TRAINING, SegmentHistory, WrittenRows
from schemas.manifest import FileEntry
from snapformat import SnapshotStore, verify_snapshot
from snapformat.reader import Snapshot


def save(harness: Harness, store: SnapshotStore, history: SegmentHistory | None) -> tuple[Snapshot, WrittenRows]:
    """One incremental save of the data plane: its rows as segments, listing again those of
    ``history`` if it describes the draft's parent; published and verified."""
    draft = store.begin()
    parent = draft.parent.snapshot_id if draft.parent is not None else None
    reuse = history.for_parent(parent) if history is not None else None
    written = harness.plane.deferred_cut().write_segments(draft.part("tq", writer="tq"), reuse)
    draft.publish()
    snap = store.latest()
    report = verify_snapshot(snap)
    assert report.ok, report.problems
    return snap, written


def row_entries(snap: Snapshot) -> list[FileEntry]:
    return [e for e in snap.files() if e.path.startswith("tq/") and e.kind.endswith("_rows")]


def keys_of(snap: Snapshot, entries: list[FileEntry]) -> list[str]:
    """The keys the entries hold in the snapshot (each its row range), in manifest order."""
    return [k for e in entries for k in snap.read_rows(e).column("key").to_pylist()]


def new_entries(snap: Snapshot, parent: Snapshot | None) -> list[FileEntry]:
    """Row entries of ``snap`` naming an object its parent does not list."""
    old = {e.object for e in row_entries(parent)} if parent is not None else set()
    return [e for e in row_entries(snap) if e.object not in old]


def reload(harness: Harness, snap: Snapshot):
    harness.plane.clear()
    assert harness.plane.is_empty()
    return harness.plane.load(snap, "tq")


class IncrementalContract:
    """Subclass and provide a ``harness`` fixture (a fresh, empty, write-once data plane per test)."""

    def test_a_second_save_writes_only_the_new_rows(self, harness: Harness, tmp_path: Path) -> None:
        fill(harness)
        store = SnapshotStore(str(tmp_path / "store"))
        first, w1 = save(harness, store, None)
        entries = row_entries(first)
        assert entries and all(e.object is not None and e.path.startswith("tq/segments/") for e in entries)
        assert first.manifest.required_features == ["shared_objects"]
        assert w1.shared_bytes == 0 and w1.new_bytes == sum(e.size for e in entries)
        assert w1.rows == {TRAINING: 37, TOKEN_CAPTURE: 6}
        # Manifest order is the data plane's: partition by partition, keys in order.
        listed = harness.contents()
        assert keys_of(first, entries) == [k for p in listed.values() for k in p["keys"]]

        rng = np.random.default_rng(7)
        harness.put("train", [f"n{i}" for i in range(5)], training_fields(rng, 5), training_tags(5, 40))
        harness.put("val", ["v7", "v8"], training_fields(rng, 2), training_tags(2, 7, "q"))
        before = harness.contents()
        second, w2 = save(harness, store, w1.segments)
        fresh = new_entries(second, first)
        # Every row segment of the first save is listed again, as it was; only the new rows are written.
        kept = [e for e in entries if e.records]
        assert [(e.object, e.row_range) for e in row_entries(second) if e.records and e not in fresh] == \
            [(e.object, e.row_range) for e in kept]
        assert keys_of(second, fresh) == [f"n{i}" for i in range(5)] + ["v7", "v8"]
        # The empty partition's segment is written again (no row to list); its bytes are those of the
        # first save's, so it is the same object.
        empty = [e for e in row_entries(second) if not e.records]
        assert w2.shared_bytes == sum(e.size for e in kept)
        assert w2.new_bytes == sum(e.size for e in fresh) + sum(e.size for e in empty if e not in fresh)
        assert w2.new_bytes < w2.shared_bytes
        assert w2.rows == {TRAINING: 44, TOKEN_CAPTURE: 6}
        assert keys_of(second, row_entries(second)) == [k for p in before.values() for k in p["keys"]]

        loaded = reload(harness, second)
        assert loaded.rows == {TRAINING: 44, TOKEN_CAPTURE: 6}
        assert list(loaded.partitions) == list(before)
        assert_same(before, harness.contents())

    def test_cleared_keys_narrow_a_segment_then_stop_its_reference(self, harness: Harness, tmp_path: Path) -> None:
        rng = np.random.default_rng(8)
        keys = [f"t{i:02d}" for i in range(40)]
        harness.put("train", keys, training_fields(rng, 40), training_tags(40))
        store = SnapshotStore(str(tmp_path / "store"))
        first, w1 = save(harness, store, None)
        (segment,) = row_entries(first)

        harness.delete("train", keys[:12])  # consumed from the front: the rest is one run of the segment
        second, w2 = save(harness, store, w1.segments)
        (narrowed,) = row_entries(second)
        assert narrowed.object == segment.object and narrowed.row_range == (12, 40) and narrowed.records == 28
        assert w2.new_bytes == 0 and w2.shared_bytes == segment.size
        assert keys_of(second, [narrowed]) == keys[12:]

        harness.delete("train", [keys[20]])  # a hole: the survivors are no longer one run
        third, w3 = save(harness, store, w2.segments)
        assert segment.object not in {e.object for e in row_entries(third)} and w3.shared_bytes == 0
        assert keys_of(third, row_entries(third)) == keys[12:20] + keys[21:]

        # 6 of the 27 rows left, not the object's last ones: below a quarter of the object, written again
        harness.delete("train", keys[12:20] + keys[21:33] + keys[39:])
        before = harness.contents()
        fourth, w4 = save(harness, store, w3.segments)
        assert w4.shared_bytes == 0 and keys_of(fourth, row_entries(fourth)) == keys[33:39]
        reload(harness, fourth)
        assert_same(before, harness.contents())

        # Only the oldest rows consumed: the object's last rows stay listed down to 1/64 of it
        harness.put("train", [f"u{i:03d}" for i in range(128)], training_fields(rng, 128), training_tags(128))
        fifth, w5 = save(harness, store, w4.segments)
        grown = [e for e in row_entries(fifth) if e.records == 128]
        assert len(grown) == 1 and w5.new_bytes == grown[0].size
        harness.delete("train", keys[33:39] + [f"u{i:03d}" for i in range(126)])  # 2 of its 128 rows left
        sixth, w6 = save(harness, store, w5.segments)
        (tail,) = [e for e in row_entries(sixth) if e.object == grown[0].object]
        assert tail.row_range == (126, 128) and w6.new_bytes == 0

    def test_a_restore_then_a_save_is_incremental(self, harness: Harness, tmp_path: Path) -> None:
        fill(harness)
        store = SnapshotStore(str(tmp_path / "store"))
        first, _ = save(harness, store, None)
        loaded = reload(harness, first)
        assert loaded.segments is not None and loaded.segments.snapshot_id == first.manifest.snapshot_id
        assert loaded.segments.rows == 43  # every row, with its key
        rng = np.random.default_rng(9)
        harness.put("train", ["after"], training_fields(rng, 1), training_tags(1, 50))
        before = harness.contents()
        second, written = save(harness, store, loaded.segments)
        assert keys_of(second, new_entries(second, first)) == ["after"]
        assert written.shared_bytes == sum(e.size for e in row_entries(first) if e.records)
        reload(harness, second)
        assert_same(before, harness.contents())

    def test_an_empty_data_plane_and_an_empty_partition_come_back(self, harness: Harness, tmp_path: Path) -> None:
        store = SnapshotStore(str(tmp_path / "store"))
        empty, written = save(harness, store, None)
        (only,) = row_entries(empty)
        assert only.records == 0 and only.object is not None and written.segments.partitions == {}
        reload(harness, empty)
        assert harness.contents() == {}
        harness.put("drained", ["k"], {"input_lengths": np.array([3], np.int32)},
                    [{"rollout_id": "r", "attempt_index": 0}])
        harness.delete("drained", ["k"])
        before = harness.contents()
        snap, _ = save(harness, store, written.segments)
        assert [e.records for e in row_entries(snap)] == [0]
        reload(harness, snap)
        assert_same(before, harness.contents())
