"""Incremental saves through the Checkpointer (scripted Gym, in-memory write-once data plane, a store
in a temporary folder): on by default, each save writing only the rows stored since the one before
and reporting new and shared bytes; off, one file per row kind; a restore makes the next save
incremental; a save that is not published leaves the next one descending from the last that was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import Mock

from test_checkpointer import FINGERPRINT, TOPOLOGY, WL, FakeGym, make, open_runs, parked, running_books

from coordinator.bookkeeping import Bookkeeping
from coordinator.dataplane import InMemoryDataPlane
from coordinator.samples import TOKEN_PARTITION, RolloutResult, TurnResult, put_results
from snapformat import SnapshotStore, verify_snapshot
from snapformat.reader import Snapshot


def write_once_plane() -> InMemoryDataPlane:
    return InMemoryDataPlane({TOKEN_PARTITION}, write_once=True)


def store_result(plane: InMemoryDataPlane, rollout_id: str) -> None:
    """A finished rollout's rows (one training row, one token-capture row per turn)."""
    result = RolloutResult(rollout_id=rollout_id, attempt_index=0, capture_key=rollout_id, outcome="finished",
                           trajectory=[TurnResult("call-0", [100, 101], [-0.5, -0.25])], turn_keys=[rollout_id],
                           input_ids=[5, 6, 7, 100, 101], prompt_lens=[3])
    put_results(plane, [result], {rollout_id: rollout_id.split("_")[0]})


def rows_of(snap: Snapshot) -> list[Any]:
    return [e for e in snap.files() if e.path.startswith("tq/") and e.kind.endswith("_rows")]


def keys_written(snap: Snapshot, parent: Snapshot) -> list[str]:
    """Keys of the rows ``snap`` holds in objects its parent does not list."""
    old = {e.object for e in rows_of(parent)}
    return [k for e in rows_of(snap) if e.object not in old for k in snap.read_rows(e).column("key").to_pylist()]


def test_saves_are_incremental_by_default_and_report_new_and_shared_bytes(tmp_path: Path) -> None:
    plane = write_once_plane()
    books = running_books(plane)
    ckpt = make(tmp_path, FakeGym(), plane)  # the default mode: written after the resume
    assert ckpt.seams.config.incremental
    assert ckpt.save(books, FINGERPRINT).status == "writing"
    first = ckpt.wait_for_write().report
    snap1 = ckpt.seams.store.latest()
    assert all(e.object is not None and e.path.startswith("tq/segments/") for e in rows_of(snap1))
    assert first.rows_shared_bytes == 0 and first.rows_new_bytes == sum(e.size for e in rows_of(snap1))
    other = [f for f in snap1.files() if f not in rows_of(snap1)]  # Gym's listed parts too
    assert first.parts_bytes == sum(f.size for f in other) > 0

    store_result(plane, "p1_g0")
    assert ckpt.save(books, FINGERPRINT).status == "writing"
    second = ckpt.wait_for_write().report
    assert second.published and second.rows == {"training_rows": 2, "token_capture_rows": 2}
    snap2 = ckpt.seams.store.latest()
    assert verify_snapshot(snap2).ok
    assert keys_written(snap2, snap1) == ["p1_g0", "p1_g0/call-0"]
    assert second.rows_shared_bytes == first.rows_new_bytes
    new = [e for e in rows_of(snap2) if e.object not in {o.object for o in rows_of(snap1)}]
    assert second.rows_new_bytes == sum(e.size for e in new)


def test_incremental_off_writes_one_file_per_kind(tmp_path: Path) -> None:
    plane = write_once_plane()
    books = running_books(plane)
    ckpt = make(tmp_path, FakeGym(), plane, write_mode="in_pause", incremental=False)
    ckpt.save(books, FINGERPRINT)
    store_result(plane, "p1_g0")
    report = ckpt.save(books, FINGERPRINT).report
    snap = ckpt.seams.store.latest()
    assert [(e.path, e.object) for e in rows_of(snap)] == [("tq/training.arrow", None),
                                                           ("tq/token_capture.arrow", None)]
    assert "shared_objects" not in snap.manifest.required_features
    assert report.rows_shared_bytes == 0 and report.rows_new_bytes == sum(e.size for e in rows_of(snap))
    assert ckpt.segments.get() is None


def test_the_first_save_after_a_restore_is_incremental(tmp_path: Path) -> None:
    plane = write_once_plane()
    books = running_books(plane)
    gym = FakeGym(parked=[parked(r) for r in open_runs(books)])  # every open run parked, as Gym commits them
    first = make(tmp_path, gym, plane, write_mode="in_pause").save(books, FINGERPRINT)
    snap1 = SnapshotStore(str(tmp_path / "store")).latest()

    fresh = write_once_plane()
    ckpt = make(tmp_path, FakeGym(), fresh, write_mode="in_pause")
    outcome = ckpt.restore(WL, TOPOLOGY)
    assert outcome is not None
    segments = ckpt.segments.get()
    assert segments is not None and segments.snapshot_id == snap1.manifest.snapshot_id and segments.rows == 2
    store_result(fresh, "p1_g0")
    report = ckpt.save(outcome.books, FINGERPRINT).report
    snap2 = ckpt.seams.store.latest()
    assert report.rows_shared_bytes == first.report.rows_new_bytes
    assert keys_written(snap2, snap1) == ["p1_g0", "p1_g0/call-0"]


def test_a_save_that_is_not_published_leaves_the_next_one_incremental(tmp_path: Path) -> None:
    real = SnapshotStore(str(tmp_path / "store"))
    failing = [False]

    def begin() -> Any:
        draft = real.begin()
        if failing[0]:
            def publish(**_: Any) -> None:
                raise OSError(28, "No space left on device")
            draft.publish = publish
        return draft

    store = Mock(wraps=real)
    store.begin.side_effect = begin
    plane = write_once_plane()
    books = running_books(plane)
    ckpt = make(tmp_path, FakeGym(), plane, store=store, write_mode="in_pause")
    first = ckpt.save(books, FINGERPRINT).report
    kept = ckpt.segments.get()
    store_result(plane, "p1_g0")
    failing[0] = True
    assert ckpt.save(books, FINGERPRINT).status == "aborted"
    assert ckpt.segments.get() is kept  # still the newest published snapshot's
    failing[0] = False
    store_result(plane, "p1_g1")
    third = ckpt.save(books, FINGERPRINT).report
    assert third.sequence == 2 and third.rows_shared_bytes == first.rows_new_bytes
    assert keys_written(real.latest(), real.open(1)) == ["p1_g0", "p1_g1", "p1_g0/call-0", "p1_g1/call-0"]


def test_a_save_of_a_plane_that_is_not_write_once_writes_every_row(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    books = running_books(plane)
    ckpt = make(tmp_path, FakeGym(), plane, write_mode="in_pause")
    ckpt.save(books, FINGERPRINT)
    store_result(plane, "p1_g0")
    report = ckpt.save(Bookkeeping.fresh(WL), FINGERPRINT).report
    assert report.published and report.rows_shared_bytes == 0
