"""One backend-conformance suite, run unchanged against local disk, SeaweedFS and moto.

Each backend class only says how to make an empty store; every test is written against the
``Store`` interface and the ``SnapshotStore`` API, so a behaviour that differs between backends
fails here (the lesson of Orbax's marker that differed between local disk and GCS).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from schemas.gym_files import agent_instance_dir
from schemas.gym_records import AgentContinuationRoot
from snapformat import CommitConflictError, SnapshotStore, Store, verify_snapshot
from snapformat.adopt import materialize_gym
from snapformat.discovery import latest_sequence
from snapformat.example import AGENT, TOPOLOGY, write_example
from snapformat.gym_dir import check_folder, read_ref_rows
from snapformat.store import LocalStore
from snapformat.store.s3 import S3Store


class StoreConformance:
    """Behaviour every backend must show. Subclasses provide the ``store`` fixture."""

    def test_write_read_info_exists(self, store: Store) -> None:
        with store.open_write("a/b/c.bin") as fh:
            fh.write(b"hello ")
            fh.write(memoryview(b"world"))
        assert store.read_bytes("a/b/c.bin") == b"hello world"
        assert store.exists("a/b/c.bin") and not store.exists("a/b/missing")
        assert store.info("a/b/c.bin").size == 11
        with store.open_read("a/b/c.bin") as fh:
            assert fh.read() == b"hello world"

    def test_missing_object_is_file_not_found(self, store: Store) -> None:
        with pytest.raises(FileNotFoundError):
            store.read_bytes("nope/x")
        with pytest.raises(FileNotFoundError):
            store.info("nope/x")

    def test_read_bytes_with_a_limit_reads_at_most_one_byte_more(self, store: Store) -> None:
        """How readers refuse an oversized commit record or manifest without reading it whole."""
        data = bytes(range(256)) * 40
        store.put_bytes("limited", data)
        for limit in (0, 9, len(data) - 1, len(data), len(data) + 5):
            assert store.read_bytes("limited", limit=limit) == data[:limit + 1]
        with pytest.raises(FileNotFoundError):
            store.read_bytes("nope/x", limit=10)

    def test_large_object_in_parts(self, store: Store) -> None:
        data = bytes(range(256)) * (48 * 1024)  # 12 MiB: several parts on object stores
        with store.open_write("big/blob") as fh:
            for i in range(0, len(data), 1 << 20):
                fh.write(data[i:i + (1 << 20)])
        assert store.info("big/blob").size == len(data)
        assert store.read_bytes("big/blob") == data

    def test_aborted_write_leaves_nothing(self, store: Store) -> None:
        fh = store.open_write("gone/blob")
        fh.write(b"x" * (11 << 20))
        fh.abort()
        assert not store.exists("gone/blob")

    def test_put_bytes_replaces(self, store: Store) -> None:
        store.put_bytes("hint.json", b"1")
        store.put_bytes("hint.json", b"22")
        assert store.read_bytes("hint.json") == b"22"

    def test_create_exclusive_once(self, store: Store) -> None:
        store.create_exclusive("_commits/x.json", b"first")
        with pytest.raises(CommitConflictError):
            store.create_exclusive("_commits/x.json", b"second")
        assert store.read_bytes("_commits/x.json") == b"first"

    def test_create_exclusive_race_has_one_winner(self, store: Store) -> None:
        for round_ in range(5):
            barrier = threading.Barrier(16)
            outcomes: list[str] = []
            lock = threading.Lock()

            def racer(i: int) -> None:
                barrier.wait(timeout=30)
                try:
                    store.create_exclusive(f"race/{round_}.json", f"writer {i}".encode())
                    result = "won"
                except CommitConflictError:
                    result = "lost"
                with lock:
                    outcomes.append(result)

            threads = [threading.Thread(target=racer, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert Counter(outcomes) == {"won": 1, "lost": 15}

    def test_create_exclusive_many_creates_the_new_keys_and_leaves_the_others(self, store: Store) -> None:
        store.create_exclusive("many/a/2.json", b"there before")
        items = [(f"many/{folder}/{i}.json", f"{folder}{i}".encode()) for folder in ("a", "b/c") for i in range(4)]
        assert store.create_exclusive_many(items) == ["many/a/2.json"]  # the one that existed, untouched
        assert store.read_bytes("many/a/2.json") == b"there before"
        for key, data in items:
            if key != "many/a/2.json":
                assert store.read_bytes(key) == data
        assert store.create_exclusive_many(items[:2]) == [k for k, _ in items[:2]]  # every one existed now
        assert store.create_exclusive_many([]) == []
        # nothing but the keys: no temporary file is left beside them
        assert sorted(o.key for o in store.walk("many")) == sorted(k for k, _ in items)

    def test_list_walk_delete(self, store: Store) -> None:
        for key in ("d/x/1", "d/x/2", "d/y", "e"):
            store.put_bytes(key, b"v")
        assert store.list_names("d") == ["x", "y"]
        assert sorted(o.key for o in store.walk("d")) == ["d/x/1", "d/x/2", "d/y"]
        assert store.list_names("nothing-here") == []
        store.delete("d/y")
        store.delete("d/y")  # idempotent
        store.delete_tree("d/x")
        store.delete_tree("d/x")
        # Objects are gone everywhere; SeaweedFS may keep an empty "folder" name in listings,
        # so the contract is about objects (walk), which is all the protocol relies on.
        assert list(store.walk("d")) == [] and store.exists("e")

    def test_snapshot_lifecycle(self, store: Store, tmp_path: Path) -> None:
        snaps = SnapshotStore(store)
        for seed in range(3):
            draft = snaps.begin()
            gym, receipts = write_example(draft, count=40, seed=seed)
            draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=TOPOLOGY, keep_latest=2)
        assert [c.sequence for c in snaps.list()] == [3, 2]
        latest = snaps.latest()
        assert latest is not None and latest.sequence == 3
        assert verify_snapshot(latest).ok
        materialize_gym(latest, str(tmp_path))  # Gym's files back as a checkpoint_dir, every digest checked
        agent = check_folder(tmp_path / agent_instance_dir(AGENT), component="agent").manifest
        roots = read_ref_rows(tmp_path, agent.continuation_index, AgentContinuationRoot)
        assert roots and roots[0].schema_version == 1
        assert latest.read_table("tokens").num_rows == latest.files("token_capture_rows")[0].records
        orphan = snaps.begin()
        write_example(orphan, count=5, seed=9)
        assert [c.sequence for c in snaps.list()] == [3, 2]
        report = snaps.gc(min_age_s=0)
        assert report.swept_drafts == [orphan.snapshot_id] and report.kept == [3, 2]
        assert verify_snapshot(snaps.latest()).ok

    def test_publish_race_for_one_sequence(self, store: Store) -> None:
        snaps = SnapshotStore(store)
        drafts = [snaps.begin() for _ in range(4)]
        for i, d in enumerate(drafts):
            d.part("controller").write_records("replay_index", "replay_index", [])
        results = []
        for d in drafts:
            try:
                d.publish()
                results.append("won")
            except CommitConflictError as exc:
                assert f"sequence {d.sequence}" in str(exc)
                results.append("lost")
        assert results == ["won", "lost", "lost", "lost"]
        assert [c.sequence for c in snaps.list()] == [1]
        assert snaps.latest().manifest.snapshot_id == drafts[0].snapshot_id

    def test_discovery_requests_constant(self, store: Store) -> None:
        snaps = SnapshotStore(store)
        counts = []
        for n in (1, 5, 25):
            while len(snaps.list()) < n:
                d = snaps.begin()
                d.part("controller").write_records("replay_index", "replay_index", [])
                d.publish()
            calls = Counter()
            original = {name: getattr(store, name) for name in ("read_bytes", "exists", "list_names", "info")}
            for name, fn in original.items():
                def counted(*a, _fn=fn, _name=name, **kw):
                    calls[_name] += 1
                    return _fn(*a, **kw)
                setattr(store, name, counted)
            try:
                assert latest_sequence(store) == n
            finally:
                for name in original:
                    delattr(store, name)
            counts.append(sum(calls.values()))
        assert counts[0] == counts[1] == counts[2]


class TestLocal(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return LocalStore(tmp_path / "store")


class TestSeaweedFS(StoreConformance):
    @pytest.fixture
    def store(self, seaweed, new_bucket, aws_env) -> Store:
        aws_env(seaweed)
        return S3Store(f"s3://{new_bucket(seaweed)}/prefix", part_size=5 << 20)


class TestMoto(StoreConformance):
    @pytest.fixture
    def store(self, moto_s3, new_bucket, aws_env) -> Store:
        aws_env(moto_s3)
        return S3Store(f"s3://{new_bucket(moto_s3)}/prefix", part_size=5 << 20)
