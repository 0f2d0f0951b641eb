"""Retention (keep the latest k) and the sweep of drafts left by crashed writers.

Proves: ``keep_latest=k`` keeps exactly the newest k snapshots (commits and folders); a snapshot's
commit is deleted before its folder, so a crash between the two leaves an unlisted folder that the
sweep removes once it is old enough; snapshots are deleted oldest sequence first, so that with a
stale hint discovery never goes back in time (the issue's case: hint at 2, 4 committed; deleting 3
before 2 made discovery return 2), checked after every single deletion and after a crash at each
step, for any store, hint and k (property test); ``keep_latest < 1`` is refused before anything is committed
or deleted; the sweep takes old drafts but not a live writer's young one, ``touch()`` keeps a
draft young, and a commit record that cannot be read protects its folder.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.controller import LoaderPlace
from schemas.errors import InvalidRecordError, NotPublishedError
from schemas.manifest import LatestHint
from snapformat import LocalStore, SnapshotStore, discovery, layout, open_snapshot, verify_snapshot
from snapformat.draft import SnapshotDraft
from snapformat.retention import apply_retention, sweep_drafts

HOUR = 3600.0


def _tiny_draft(store: SnapshotStore, tag: int = 0) -> SnapshotDraft:
    """A draft with one small JSON part, written but not published."""
    draft = store.begin()
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=tag, seed=tag))
    return draft


def _publish_tiny(store: SnapshotStore, keep_latest: int | None = None) -> str:
    draft = _tiny_draft(store, tag=0)
    draft.publish(keep_latest=keep_latest)
    return draft.snapshot_id


def _folders(root: Path) -> set[str]:
    base = root / layout.SNAPSHOTS
    return {p.name for p in base.iterdir()} if base.exists() else set()


def _age(folder: Path, seconds: float) -> None:
    """Make every file under ``folder`` look ``seconds`` old (what an idle crashed draft looks like)."""
    then = time.time() - seconds
    for p in folder.rglob("*"):
        os.utime(p, (then, then))


def _listed(store: SnapshotStore) -> list[int]:
    return [c.sequence for c in store.list()]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_keep_latest_keeps_exactly_the_newest_k(tmp_path: Path, k: int) -> None:
    store = SnapshotStore(str(tmp_path))
    ids: dict[int, str] = {}
    for seq in range(1, 7):
        ids[seq] = _publish_tiny(store, keep_latest=k)
        kept = list(range(seq, max(0, seq - k), -1))
        assert _listed(store) == kept
        assert _folders(tmp_path) == {ids[s] for s in kept}  # deleted ones leave no folder
    for seq in range(1, 7 - k):
        with pytest.raises(NotPublishedError):
            store.open(seq)
    for seq in range(7 - k, 7):
        assert verify_snapshot(store.open(seq)).ok


def test_apply_retention_returns_what_it_deleted(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    ids = [_publish_tiny(store) for _ in range(5)]
    assert sorted(apply_retention(store.store, 2)) == sorted(ids[:3])
    assert _listed(store) == [5, 4]
    assert apply_retention(store.store, 2) == []  # idempotent
    assert apply_retention(store.store, 10) == []  # fewer than k: nothing to do
    assert _listed(store) == [5, 4]


@pytest.mark.parametrize("k", [0, -1])
def test_keep_latest_below_one_is_refused_before_any_change(tmp_path: Path, k: int) -> None:
    store = SnapshotStore(str(tmp_path))
    for _ in range(3):
        _publish_tiny(store)
    before = _folders(tmp_path)
    with pytest.raises(InvalidRecordError, match="keep_latest"):
        apply_retention(store.store, k)
    with pytest.raises(InvalidRecordError, match="keep_latest"):
        store.gc(keep_latest=k, min_age_s=0)
    draft = _tiny_draft(store)
    with pytest.raises(InvalidRecordError, match="keep_latest"):
        draft.publish(keep_latest=k)  # refused up front, not after the commit point
    assert _listed(store) == [3, 2, 1]
    assert _folders(tmp_path) == before | {draft.snapshot_id}


class _RecordingStore(LocalStore):
    """A local store that logs every deletion, in order."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deletions: list[tuple[str, str]] = []

    def delete(self, key: str) -> None:
        self.deletions.append(("delete", key))
        super().delete(key)

    def delete_tree(self, prefix: str) -> None:
        self.deletions.append(("delete_tree", prefix))
        super().delete_tree(prefix)


def test_commit_is_deleted_before_its_folder(tmp_path: Path) -> None:
    raw = _RecordingStore(tmp_path)
    store = SnapshotStore(raw)
    ids = [_publish_tiny(store) for _ in range(4)]
    raw.deletions.clear()
    apply_retention(raw, 1)
    expected = []
    for seq in (1, 2, 3):  # oldest first, each commit before its folder
        expected += [("delete", layout.commit_key(seq)), ("delete_tree", layout.snapshot_dir(ids[seq - 1]))]
    assert raw.deletions == expected


class _Crash(BaseException):
    """Stands for the process dying: nothing after it runs."""


class _CrashBeforeFolderDelete(LocalStore):
    def delete_tree(self, prefix: str) -> None:
        raise _Crash(prefix)


def test_crash_between_commit_and_folder_delete_leaves_an_unlisted_folder_swept_later(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    old_id = _publish_tiny(store)
    _publish_tiny(store)
    with pytest.raises(_Crash):
        apply_retention(_CrashBeforeFolderDelete(tmp_path), 1)

    assert (tmp_path / layout.snapshot_dir(old_id) / layout.MANIFEST_NAME).exists()  # folder whole
    assert _listed(store) == [2]
    with pytest.raises(NotPublishedError):
        store.open(1)
    with pytest.raises(NotPublishedError):
        open_snapshot(str(tmp_path / layout.snapshot_dir(old_id)))

    now = time.time()
    assert sweep_drafts(store.store, min_age_s=HOUR, now=now) == ([], [])  # young: could be a live writer
    swept, _ = sweep_drafts(store.store, min_age_s=HOUR, now=now + 2 * HOUR)
    assert swept == [old_id]
    assert _folders(tmp_path) == {store.open(2).manifest.snapshot_id}
    assert verify_snapshot(store.open(2)).ok


def test_sweep_takes_an_old_draft_but_not_a_young_one(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    published = _publish_tiny(store)
    old, young = _tiny_draft(store, 1), _tiny_draft(store, 2)
    _age(tmp_path / layout.snapshot_dir(old.snapshot_id), 2 * HOUR)
    _age(tmp_path / layout.snapshot_dir(published), 2 * HOUR)  # published: never swept, however old

    swept, _ = sweep_drafts(store.store, min_age_s=HOUR)
    assert swept == [old.snapshot_id]
    assert _folders(tmp_path) == {published, young.snapshot_id}
    young.publish()  # the live writer carries on
    assert _listed(store) == [2, 1]
    assert verify_snapshot(store.open(2)).ok and verify_snapshot(store.open(1)).ok


def test_sweep_takes_an_old_draft_of_empty_folders(tmp_path: Path) -> None:
    # A crash between mkdir and the first file, or midway through a delete_tree, leaves only
    # empty folders: they are aged by the folder itself, so a young one is kept.
    store = SnapshotStore(str(tmp_path))
    published = _publish_tiny(store)
    old, young = (tmp_path / layout.snapshot_dir(f"snap-{2:010d}-{tag}") for tag in ("0000000a", "0000000b"))
    for folder in (old, young):
        (folder / "gym" / "model").mkdir(parents=True)
    then = time.time() - 2 * HOUR
    for p in (old / "gym" / "model", old / "gym", old):
        os.utime(p, (then, then))

    swept, _ = sweep_drafts(store.store, min_age_s=HOUR)
    assert swept == [old.name]
    assert _folders(tmp_path) == {published, young.name}
    swept, _ = sweep_drafts(store.store, min_age_s=0)
    assert swept == [young.name]
    assert _folders(tmp_path) == {published}


def test_touch_keeps_a_draft_young(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    _publish_tiny(store)
    paused, abandoned = _tiny_draft(store, 1), _tiny_draft(store, 2)
    for draft in (paused, abandoned):
        _age(tmp_path / layout.snapshot_dir(draft.snapshot_id), 2 * HOUR)
    paused.touch()

    swept, _ = sweep_drafts(store.store, min_age_s=HOUR)
    assert swept == [abandoned.snapshot_id]
    assert paused.snapshot_id in _folders(tmp_path)
    paused.publish()
    assert verify_snapshot(store.open(2)).ok


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"format_version": "1.0"}', b"\xff" * 100])
def test_unreadable_commit_record_protects_its_folder(tmp_path: Path, garbage: bytes) -> None:
    store = SnapshotStore(str(tmp_path))
    damaged = _publish_tiny(store)
    healthy = _publish_tiny(store)
    commit = tmp_path / layout.commit_key(1)
    commit.unlink()  # replace, not rewrite: a commit may share its inode with a leftover temp link
    commit.write_bytes(garbage)

    swept, _ = sweep_drafts(store.store, min_age_s=0, now=time.time() + 100 * HOUR)
    assert swept == []
    assert _folders(tmp_path) == {damaged, healthy}  # left for an operator to inspect
    assert verify_snapshot(store.open(2)).ok


def test_commit_naming_another_sequence_protects_its_folder(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    first = _publish_tiny(store)
    second = _publish_tiny(store)
    (tmp_path / layout.commit_key(3)).write_bytes((tmp_path / layout.commit_key(2)).read_bytes())
    stray = tmp_path / layout.snapshot_dir(f"snap-{3:010d}-0badf00d")  # what commit 3 would guard
    stray.mkdir()
    (stray / "file").write_bytes(b"x")

    swept, _ = sweep_drafts(store.store, min_age_s=0)
    assert swept == []
    assert _folders(tmp_path) == {first, second, stray.name}


def test_sweep_removes_only_stale_temp_files(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    _publish_tiny(store)
    stale = [tmp_path / f".tmp-{'a' * 32}", tmp_path / layout.COMMITS / f".tmp-{'b' * 32}"]
    fresh = [tmp_path / f".tmp-{'c' * 32}", tmp_path / layout.COMMITS / f".tmp-{'d' * 32}"]
    for p in stale + fresh:
        p.write_bytes(b"partial")
    then = time.time() - 2 * HOUR
    for p in stale:
        os.utime(p, (then, then))

    _, temps = sweep_drafts(store.store, min_age_s=HOUR)
    assert sorted(temps) == sorted(str(p.relative_to(tmp_path)) for p in stale)
    assert [p.exists() for p in stale + fresh] == [False, False, True, True]
    assert _listed(store) == [1]


def test_gc_applies_retention_then_sweeps(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    ids = [_publish_tiny(store) for _ in range(3)]
    leftover = _tiny_draft(store)
    report = store.gc(keep_latest=1, min_age_s=0)
    assert sorted(report.deleted_snapshots) == sorted(ids[:2])
    assert report.swept_drafts == [leftover.snapshot_id]
    assert report.kept == [3]
    assert _folders(tmp_path) == {ids[2]}


# -- retention deletes oldest first: discovery never goes back in time ---------------------------------

def _store_with_stale_hint(root: Path, newest: int, hint: int) -> SnapshotStore:
    """Sequences 1..``newest`` committed, and the hint left at ``hint`` (a writer that crashed
    before updating it, or a hint put back by a copy)."""
    store = SnapshotStore(str(root))
    for _ in range(newest):
        _publish_tiny(store)
    store.store.put_bytes(layout.HINT_KEY, msgspec.json.encode(
        LatestHint(sequence=hint, snapshot_id=discovery.read_commit(store.store, hint).snapshot_id)))
    return store


class _WatchingDiscovery(LocalStore):
    """Runs discovery after every deletion (what a reader arriving right then would find), and
    crashes after ``crash_after`` deletions when given."""

    def __init__(self, root: Path, crash_after: int | None = None) -> None:
        super().__init__(root)
        self.found: list[int | None] = []
        self.crash_after = crash_after

    def _after(self) -> None:
        self.found.append(discovery.latest_sequence(LocalStore(self.root)))
        if self.crash_after is not None and len(self.found) >= self.crash_after:
            raise _Crash("killed mid-retention")

    def delete(self, key: str) -> None:
        super().delete(key)
        self._after()

    def delete_tree(self, prefix: str) -> None:
        super().delete_tree(prefix)
        self._after()


def test_newest_first_deletion_sent_discovery_back_in_time(tmp_path: Path) -> None:
    # The case, with the order retention used before: 3 deleted before 2.
    store = _store_with_stale_hint(tmp_path, newest=4, hint=2)
    assert discovery.latest_sequence(store.store) == 4  # the probe walks 2 -> 3 -> 4
    store.store.delete(layout.commit_key(3))  # newest-first retention with keep_latest=1 starts here
    assert discovery.latest_sequence(store.store) == 2  # although 4 is committed
    assert store.store.exists(layout.commit_key(4))


def test_oldest_first_deletion_keeps_discovery_on_the_newest(tmp_path: Path) -> None:
    store = _store_with_stale_hint(tmp_path, newest=4, hint=2)
    ids = [c.snapshot_id for c in reversed(store.list())]
    watching = _WatchingDiscovery(tmp_path)
    assert apply_retention(watching, 1) == ids[:3]  # oldest first
    assert watching.found == [4] * 6  # after each commit and each folder deletion
    assert discovery.committed_sequences(watching) == [4]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_retention_interrupted_anywhere_never_hides_the_newest(data: st.DataObject) -> None:
    newest = data.draw(st.integers(2, 7), label="newest")
    hint = data.draw(st.integers(1, newest), label="hint")
    keep = data.draw(st.integers(1, newest), label="keep_latest")
    deletions = 2 * (newest - keep)
    crash_after = data.draw(st.none() | st.integers(1, max(1, deletions)), label="crash_after")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _store_with_stale_hint(root, newest, hint)
        watching = _WatchingDiscovery(root, crash_after)
        try:
            apply_retention(watching, keep)
        except _Crash:
            pass
        assert all(found == newest for found in watching.found), watching.found
        assert discovery.latest_sequence(LocalStore(root)) == newest
        left = discovery.committed_sequences(LocalStore(root))
        assert left == list(range(newest, newest - len(left), -1))  # consecutive up to the newest
