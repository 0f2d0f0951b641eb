"""Finding snapshots: the newest in a constant number of store calls, whatever the hint says.

Proves: ``latest_sequence`` (and ``latest()`` and ``begin()``) make the same number of store calls
with 1, 100 and 1000 snapshots, and never list the store when the hint is right; a stale, missing,
corrupt or dangling hint still gives the true newest; ``begin()`` takes newest + 1 and refuses an
explicit sequence that would leave a gap or reuse one; ``list()`` is newest first.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import pytest

from schemas.controller import LoaderPlace
from schemas.errors import InvalidRecordError
from snapformat import LocalStore, SnapshotStore, layout
from snapformat.discovery import latest_sequence

SIZES = (1, 100, 1000)


class _CountingStore(LocalStore):
    """A local store that counts every call of the storage interface."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self.calls: collections.Counter[str] = collections.Counter()

    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        self._count("read_bytes")
        return super().read_bytes(key, limit)

    def open_read(self, key: str):
        self._count("open_read")
        return super().open_read(key)

    def local_path(self, key: str) -> str | None:
        self._count("local_path")
        return super().local_path(key)

    def open_write(self, key: str):
        self._count("open_write")
        return super().open_write(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._count("put_bytes")
        super().put_bytes(key, data)

    def create_exclusive(self, key: str, data: bytes) -> None:
        self._count("create_exclusive")
        super().create_exclusive(key, data)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return super().exists(key)

    def info(self, key: str):
        self._count("info")
        return super().info(key)

    def list_names(self, prefix: str) -> list[str]:
        self._count("list_names")
        return super().list_names(prefix)

    def walk(self, prefix: str):
        self._count("walk")
        return super().walk(prefix)

    def delete(self, key: str) -> None:
        self._count("delete")
        super().delete(key)

    def delete_tree(self, prefix: str) -> None:
        self._count("delete_tree")
        super().delete_tree(prefix)


def _publish_tiny(store: SnapshotStore, tag: int = 0) -> str:
    """Publish a snapshot of one small JSON part (cheap enough to make a thousand)."""
    draft = store.begin()
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=tag, seed=tag))
    draft.publish()
    return draft.snapshot_id


def _measure(path: Path, operation: Any) -> tuple[Any, dict[str, int]]:
    """Run ``operation(counting_store)`` and return its result and the calls it made."""
    store = _CountingStore(path)
    result = operation(store)
    return result, dict(store.calls)


@pytest.fixture(scope="module")
def call_counts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, tuple[Any, dict[str, int]]]]:
    """One store grown to 1, 100 then 1000 snapshots; the calls of each lookup at each size."""
    path = tmp_path_factory.mktemp("discovery") / "store"
    store = SnapshotStore(str(path))
    counts = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)  # durability is not under test here; speed is needed
        for size in SIZES:
            while len(os.listdir(path / layout.COMMITS) if path.exists() else []) < size:
                _publish_tiny(store)
            counts[size] = {
                "latest_sequence": _measure(path, latest_sequence),
                "latest": _measure(path, lambda s: SnapshotStore(s).latest().sequence),
                "begin": _measure(path, lambda s: SnapshotStore(s).begin().sequence),
            }
    return counts


@pytest.mark.parametrize("lookup", ["latest_sequence", "latest", "begin"])
def test_lookup_cost_does_not_grow_with_the_number_of_snapshots(call_counts, lookup: str) -> None:
    for size in SIZES:
        result, _ = call_counts[size][lookup]
        assert result == (size + 1 if lookup == "begin" else size)
    calls = [call_counts[size][lookup][1] for size in SIZES]
    assert calls[0] == calls[1] == calls[2], calls
    assert "list_names" not in calls[0] and "walk" not in calls[0]  # the hint was right: no listing
    assert sum(calls[0].values()) <= 8, calls[0]


def test_latest_sequence_reads_the_hint_and_probes_once(call_counts) -> None:
    _, calls = call_counts[1000]["latest_sequence"]
    assert calls == {"read_bytes": 1, "exists": 2}  # hint, its commit, the next (missing) one


@pytest.fixture
def five(tmp_path: Path) -> tuple[Path, list[str]]:
    """A store with sequences 1..5 published."""
    store = SnapshotStore(str(tmp_path))
    return tmp_path, [_publish_tiny(store, tag) for tag in range(5)]


def _write_hint(path: Path, data: bytes) -> None:
    (path / layout.HINT_KEY).unlink(missing_ok=True)
    (path / layout.HINT_KEY).write_bytes(data)


def _newest(path: Path) -> tuple[int | None, int | None, int]:
    """What discovery says: ``latest_sequence``, ``latest()`` and ``begin()``."""
    store = SnapshotStore(str(path))
    latest = store.latest()
    return latest_sequence(store.store), latest and latest.sequence, store.begin().sequence


def test_right_hint(five) -> None:
    path, _ = five
    assert json.loads((path / layout.HINT_KEY).read_bytes())["sequence"] == 5
    assert _newest(path) == (5, 5, 6)


@pytest.mark.parametrize("stale", [1, 2, 4])
def test_stale_hint_is_probed_past(five, stale: int) -> None:
    path, ids = five
    _write_hint(path, json.dumps({"sequence": stale, "snapshot_id": ids[stale - 1]}).encode())
    assert _newest(path) == (5, 5, 6)
    counted, calls = _measure(path, latest_sequence)
    assert counted == 5 and "list_names" not in calls  # forward probe, not a listing


def test_missing_hint_falls_back_to_listing(five) -> None:
    path, _ = five
    (path / layout.HINT_KEY).unlink()
    assert _newest(path) == (5, 5, 6)
    _, calls = _measure(path, latest_sequence)
    assert calls.get("list_names") == 1


@pytest.mark.parametrize("data", [
    b"",
    b"not json",
    b"\x00\xff\xfe",
    b"[5]",
    b'{"sequence": "5", "snapshot_id": "x"}',
    b'{"sequence": 0, "snapshot_id": "x"}',
    b'{"sequence": -3, "snapshot_id": "x"}',
    b'{"sequence": 5.5, "snapshot_id": "x"}',
    b'{"snapshot_id": "x"}',
    json.dumps({"sequence": 2**70, "snapshot_id": "x"}).encode(),
    b'{"sequence": 5, "snapshot_id": "x"',
])
def test_corrupt_hint_is_ignored(five, data: bytes) -> None:
    path, _ = five
    _write_hint(path, data)
    assert _newest(path) == (5, 5, 6)


def test_hint_naming_a_deleted_commit(five) -> None:
    path, ids = five
    # An operator removed the newest snapshot by hand; the hint still names it.
    (path / layout.commit_key(5)).unlink()
    assert json.loads((path / layout.HINT_KEY).read_bytes())["sequence"] == 5
    assert _newest(path) == (4, 4, 5)


def test_hint_naming_a_sequence_never_committed(five) -> None:
    path, _ = five
    _write_hint(path, json.dumps({"sequence": 99, "snapshot_id": "snap-0000000099-00000000"}).encode())
    assert _newest(path) == (5, 5, 6)


def test_empty_store(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    assert latest_sequence(store.store) is None
    assert store.latest() is None
    assert store.list() == []
    assert store.begin().sequence == 1


def test_begin_takes_newest_plus_one_and_refuses_gaps(five) -> None:
    path, ids = five
    store = SnapshotStore(str(path))
    draft = store.begin()
    assert draft.sequence == 6
    assert draft.parent is not None and (draft.parent.sequence, draft.parent.snapshot_id) == (5, ids[4])
    assert store.begin(6).sequence == 6
    for bad in (7, 100, 5, 1):
        with pytest.raises(InvalidRecordError, match=f"sequence: {bad} would leave a gap or reuse"):
            store.begin(bad)


def test_begin_on_an_empty_store_refuses_anything_but_one(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    with pytest.raises(InvalidRecordError, match="next is 1"):
        store.begin(2)
    draft = store.begin(1)
    assert draft.sequence == 1 and draft.parent is None


def test_list_is_newest_first(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    ids = [_publish_tiny(store, tag) for tag in range(12)]  # crosses 9 -> 10: not a text sort
    commits = store.list()
    assert [c.sequence for c in commits] == list(range(12, 0, -1))
    assert [c.snapshot_id for c in commits] == ids[::-1]
    # Names in _commits/ that are not commits are ignored.
    (tmp_path / layout.COMMITS / f".tmp-{'e' * 32}").write_bytes(b"partial")
    (tmp_path / layout.COMMITS / "notes.txt").write_bytes(b"hello")
    assert [c.sequence for c in store.list()] == list(range(12, 0, -1))
    _write_hint(tmp_path, b"")  # through the listing fallback too
    assert latest_sequence(store.store) == 12
