"""GC of shared objects as mark and sweep (SPEC §14.2; ``snapformat.object_gc``, ``retention.gc``).

Proves, on real stores (local disk, and SeaweedFS for the basic path): an object a committed
snapshot names is never swept, however old; nor one only a live draft's part manifest names; an
object nothing names is swept once older than the grace period and kept while younger (its age
read again right before the delete, so a writer that puts it again in the meantime keeps it);
stale temporary files under ``objects/<2>/`` go, fresh ones stay; a committed manifest or commit
record that cannot be read stops every object sweep and the report says which and why; a commit
deleted by a concurrent retention in the middle of the mark (its newer snapshot published meanwhile)
loses no object; ``grace_s < min_age_s`` is refused before anything is deleted; the report counts
what was kept by reason and the store calls made (each manifest read once, ``objects/`` walked
once). A property test runs random chains, retention, abandoned drafts and GCs and checks after
each GC that every committed snapshot verifies and reads back its rows, and that the objects left
are exactly those named once every draft is abandoned and every object old.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import InvalidRecordError
from schemas.manifest import FileEntry
from snapformat import LocalStore, SnapshotStore, layout
from snapformat.objects import put_object
from snapformat.retention import gc
from snapformat.verify import verify_store
from tests.snapformat.chains import ROW_KIND, Chain, referenced_objects, segment, stored_objects

HOUR = 3600.0
DAY = 24 * HOUR


def _age_objects(root: Path, seconds: float, names: set[str] | None = None) -> None:
    """Make objects (every one, or ``names``) look ``seconds`` old."""
    then = time.time() - seconds
    for p in (root / layout.OBJECTS).rglob("*"):
        if p.is_file() and (names is None or layout.object_of_key(p.relative_to(root).as_posix()) in names):
            os.utime(p, (then, then))


def _objects_of(store: SnapshotStore, sequence: int) -> set[str]:
    return {f.object for f in store.open(sequence).manifest.files if f.object is not None}


def test_retention_then_sweep_keeps_what_committed_snapshots_name(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    chain = Chain(store)
    for _ in range(4):
        chain.publish(new=2, drop=1)
    everything = stored_objects(store)
    sizes = {n: (tmp_path / layout.object_key(n)).stat().st_size for n in everything}
    _age_objects(tmp_path, 2 * DAY)  # all old: only the marks protect anything
    report = store.gc(keep_latest=2, min_age_s=HOUR)
    kept = _objects_of(store, 4) | _objects_of(store, 3)
    assert report.kept == [4, 3] and len(report.deleted_snapshots) == 2
    assert set(report.swept_objects) == everything - kept and report.swept_objects
    assert stored_objects(store) == kept == referenced_objects(store)
    assert report.swept_object_bytes == sum(sizes[n] for n in report.swept_objects)
    assert report.kept_objects.committed == len(kept) and report.kept_objects.young == 0
    assert report.kept_objects.bytes == sum(sizes[n] for n in kept)
    assert report.objects_not_swept is None and report.grace_s == HOUR
    assert report.store_calls["delete_if_older"] >= len(report.swept_objects) and report.store_calls["walk"] >= 1
    for seq in (3, 4):
        assert store.open(seq).read_table("training").equals(chain.expected(store.open(seq).manifest.snapshot_id))
    assert verify_store(store.store).ok
    again = store.gc(min_age_s=HOUR)  # nothing left to sweep
    assert again.swept_objects == [] and again.kept_objects.committed == len(kept)


def test_young_unreferenced_objects_are_kept_until_the_grace_period_ends(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    chain = Chain(store)
    chain.publish(new=2)
    chain.publish(new=1, drop=2)  # the first snapshot's objects are no longer listed by the newest
    report = store.gc(keep_latest=1, min_age_s=HOUR)
    orphans = stored_objects(store) - referenced_objects(store)
    assert len(orphans) == 2
    assert report.swept_objects == [] and report.kept_objects.young == 2  # written just now
    now = time.time()
    assert gc(store.store, min_age_s=HOUR, grace_s=2 * HOUR, now=now + 1.5 * HOUR).swept_objects == []
    late = gc(store.store, min_age_s=HOUR, grace_s=2 * HOUR, now=now + 2.5 * HOUR)
    assert set(late.swept_objects) == orphans
    assert late.swept_object_bytes > 0 and late.kept_objects.committed == 1
    assert stored_objects(store) == referenced_objects(store)


def test_objects_a_live_draft_names_are_kept(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    chain = Chain(store)
    chain.publish(new=1)
    draft = store.begin()
    part = draft.part("tq")
    for f in store.latest().manifest.files:
        if f.object is not None:
            part.reference(f)
    part.write_rows_object("seg-own.arrow", ROW_KIND, segment(99))
    part.close()  # its part manifest names the parent's object and its own
    named_by_draft = {f.object for f in part.files}
    unlisted = put_object(store.store, b"written, not yet listed by any part manifest").name
    chain.publish(new=1, drop=1)  # another writer moves on: the parent's object is left to the draft
    store.gc(keep_latest=1, min_age_s=HOUR)  # the draft is young: kept, and so are its objects
    assert not named_by_draft & referenced_objects(store)
    _age_objects(tmp_path, 2 * DAY)
    report = gc(store.store, min_age_s=HOUR, grace_s=HOUR)
    assert named_by_draft <= stored_objects(store)
    assert report.kept_objects.drafts == 2  # the parent's object and its own
    assert report.swept_objects == [unlisted]  # named by nothing, old: what a crashed writer leaves
    for p in (tmp_path / layout.snapshot_dir(draft.snapshot_id)).rglob("*"):
        os.utime(p, (time.time() - 2 * DAY,) * 2)
    swept = gc(store.store, min_age_s=HOUR)  # the draft is abandoned now: it goes, then its objects
    assert swept.swept_drafts == [draft.snapshot_id]
    assert set(swept.swept_objects) == named_by_draft
    assert stored_objects(store) == referenced_objects(store) and verify_store(store.store).ok


def test_stale_temporary_files_under_objects_go_and_fresh_ones_stay(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    Chain(store).publish(new=1)
    folder = tmp_path / layout.OBJECTS / "ab"
    folder.mkdir(parents=True, exist_ok=True)
    stale, fresh = folder / f".tmp-{'a' * 32}", folder / f".tmp-{'b' * 32}"
    foreign = folder / "notes.txt"  # not ours: never touched
    for p in (stale, fresh, foreign):
        p.write_bytes(b"partial")
    for p in (stale, foreign):
        os.utime(p, (time.time() - 2 * DAY,) * 2)
    report = store.gc(min_age_s=HOUR)
    assert [p.exists() for p in (stale, fresh, foreign)] == [False, True, True]
    assert f"{layout.OBJECTS}/ab/{stale.name}" in report.swept_temp_files


@pytest.mark.parametrize("damage", ["manifest", "commit"])
def test_an_unreadable_committed_manifest_stops_every_object_sweep(tmp_path: Path, damage: str) -> None:
    store = SnapshotStore(str(tmp_path))
    chain = Chain(store)
    chain.publish(new=1)
    chain.publish(new=1)
    put_object(store.store, b"an orphan: would be swept")
    _age_objects(tmp_path, 2 * DAY)
    before = stored_objects(store)
    first = store.open(1).manifest.snapshot_id
    if damage == "manifest":
        path = tmp_path / layout.snapshot_dir(first) / layout.MANIFEST_NAME
    else:
        path = tmp_path / layout.commit_key(1)
    path.unlink()  # a fresh inode: the commit may share one with a leftover temporary link
    path.write_bytes(b"{damaged")
    report = gc(store.store, min_age_s=HOUR)
    assert report.swept_objects == [] and stored_objects(store) == before
    assert report.objects_not_swept is not None
    assert ("sequence 1" in report.objects_not_swept
            and (first in report.objects_not_swept if damage == "manifest" else "commit record" in report.objects_not_swept))


def test_grace_shorter_than_the_draft_min_age_is_refused_before_anything_is_deleted(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    chain = Chain(store)
    for _ in range(3):
        chain.publish(new=1, drop=1)
    _age_objects(tmp_path, 2 * DAY)
    before = (stored_objects(store), [c.sequence for c in store.list()])
    with pytest.raises(InvalidRecordError, match="grace_s.*min_age_s"):
        store.gc(keep_latest=1, min_age_s=HOUR, grace_s=HOUR / 2)
    assert (stored_objects(store), [c.sequence for c in store.list()]) == before


class _PutAgainAfterWalk(LocalStore):
    """A writer puts ``victim`` again (the same bytes) while the GC walks ``objects/``."""

    def __init__(self, root: Path, victim: str, data: bytes) -> None:
        super().__init__(root)
        self.victim, self.data = victim, data

    def walk(self, prefix: str):
        yield from super().walk(prefix)
        if prefix == layout.OBJECTS:
            put_object(LocalStore(self.root), self.data, name=self.victim)


def test_an_object_put_again_during_the_sweep_is_kept(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    Chain(store).publish(new=1)
    data = b"a segment a writer is about to list again"
    name = put_object(store.store, data).name
    _age_objects(tmp_path, 2 * DAY)
    report = gc(_PutAgainAfterWalk(tmp_path, name, data), min_age_s=HOUR)
    assert name in stored_objects(store) and report.swept_objects == []
    assert report.kept_objects.young == 1  # its age was read again right before the delete


class _PublishDuringMark(LocalStore):
    """While the GC reads the first manifest, another writer publishes the next snapshot with
    ``keep_latest=1``: the commits the GC listed are deleted under it."""

    def __init__(self, root: Path, publish) -> None:
        super().__init__(root)
        self.publish = publish
        self.fired = False

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        if not self.fired and key.endswith(layout.MANIFEST_NAME):
            self.fired = True
            self.publish()
        return super().read_bytes(key, limit)


def test_commits_deleted_by_a_concurrent_retention_during_the_mark_lose_no_object(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    chain = Chain(store)
    chain.publish(new=2)
    chain.publish(new=1)
    dropped = [next(f.object for f in store.open(2).manifest.files if f.object is not None)]  # what drop=1 drops
    _age_objects(tmp_path, 2 * DAY)  # everything old: only the marks protect anything

    def publish_next() -> None:  # lists the parent's objects again but the first, and writes one of its own
        chain.publish(new=1, drop=1, keep_latest=1)
        _age_objects(tmp_path, 2 * DAY)

    report = gc(_PublishDuringMark(tmp_path, publish_next), min_age_s=HOUR, grace_s=HOUR)
    assert [c.sequence for c in store.list()] == [3]
    needed = _objects_of(store, 3)
    assert needed <= stored_objects(store)
    # the objects it lists again are counted as committed; the one it wrote came after the walk
    assert report.kept_objects.committed == len(needed) - 1 and report.objects_not_swept is None
    assert report.swept_objects == dropped  # what the new snapshot no longer lists still goes
    snap = store.open(3)
    assert snap.read_table("training").equals(chain.expected(snap.manifest.snapshot_id))
    assert verify_store(store.store).ok


def test_gc_on_seaweedfs(seaweed, new_bucket, aws_env) -> None:
    aws_env(seaweed)
    store = SnapshotStore(f"s3://{new_bucket(seaweed)}/gc")
    chain = Chain(store)
    for _ in range(3):
        chain.publish(new=1, drop=1)
    written = stored_objects(store)
    report = gc(store.store, keep_latest=1, min_age_s=HOUR)
    assert report.swept_objects == [] and report.kept_objects.young == len(written) - 1  # all young
    later = gc(store.store, min_age_s=HOUR, now=time.time() + 2 * HOUR)
    assert set(later.swept_objects) == written - _objects_of(store, 3)
    assert stored_objects(store) == _objects_of(store, 3) and later.kept_objects.committed == 1
    assert later.store_calls["delete_if_older"] == len(later.swept_objects) and later.store_calls["walked"] >= 1
    snap = store.open(3)
    assert snap.read_table("training").equals(chain.expected(snap.manifest.snapshot_id))
    assert verify_store(store.store).ok


_STEPS = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 2), st.integers(0, 2), st.booleans()),  # new, drop, narrow
    st.tuples(st.just("abandon"), st.integers(1, 2)),  # a draft that writes objects and is never published
    st.tuples(st.just("retain"), st.integers(1, 3)),
    st.tuples(st.just("gc"), st.booleans()),  # True: far in the future (everything old), False: now
), min_size=1, max_size=12)


@settings(max_examples=20, deadline=None)
@given(steps=_STEPS)
def test_random_chains_and_gcs_never_lose_a_named_object(tmp_path_factory: pytest.TempPathFactory, steps) -> None:
    root = tmp_path_factory.mktemp("gc-prop") / "store"
    store = SnapshotStore(str(root))
    chain = Chain(store)
    for step in [*steps, ("gc", True)]:
        if step[0] == "publish":
            chain.publish(new=step[1], drop=step[2], narrow=step[3])
        elif step[0] == "abandon":
            draft = store.begin()
            part = draft.part("tq")
            for j in range(step[1]):
                part.write_rows_object(f"x{j}.arrow", ROW_KIND, segment(10_000 + j))
            if step[1] == 2:
                part.close()  # one draft closed its part, the other crashed before
        elif step[0] == "retain" and store.list():
            store.gc(keep_latest=step[1], min_age_s=HOUR)
        elif step[0] == "gc":
            future = step[1]
            report = gc(store.store, min_age_s=HOUR, now=time.time() + (2 * DAY if future else 0))
            assert report.objects_not_swept is None
            named = referenced_objects(store)
            assert named <= stored_objects(store)
            if future:  # every draft abandoned and every object old: only what is named stays
                assert stored_objects(store) == named
            for c in store.list():
                snap = store.open(c.sequence)
                if chain.listed[snap.manifest.snapshot_id]:  # it lists rows: exactly the ones it was given
                    assert snap.read_table("training").equals(chain.expected(snap.manifest.snapshot_id))
            assert verify_store(store.store).ok


def test_gc_reads_each_manifest_once_and_walks_objects_once(tmp_path: Path) -> None:
    # The shape of the 1,000-snapshot, 100,000-object benchmark, scaled down: each snapshot lists a
    # window of objects (written straight to disk: only GC is measured), half of them named by none.
    store = SnapshotStore(str(tmp_path))
    names = [put_object(store.store, i.to_bytes(8, "little") * 8).name for i in range(400)]
    for k in range(40):
        draft = store.begin()
        part = draft.part("tq")
        for j in range(10):
            n = names[k * 5 + j]
            part.reference(FileEntry(path=f"tq/o{j}", kind="blob", size=64, checksum=n, records=1, object=n))
        draft.publish()
    _age_objects(tmp_path, 2 * DAY)
    report = gc(store.store, min_age_s=HOUR)
    named = {n for k in range(40) for n in names[k * 5:k * 5 + 10]}
    assert len(report.swept_objects) == 400 - len(named) and report.kept_objects.committed == len(named)
    calls = report.store_calls
    assert calls["walk"] == 1 and calls["walked"] == 400  # objects/ listed once; no draft to walk
    # each commit record read by the draft sweep and by the mark, each manifest once; one look at
    # the age and delete, as one step, per object swept
    assert calls["read_bytes"] == 40 * 3
    assert calls["delete_if_older"] == len(report.swept_objects) and "delete" not in calls
    assert calls["list_names"] <= 8
