"""``snapformat copy``: one snapshot or a whole store, local disk <-> SeaweedFS, and S3 -> S3 (moto).

Every case goes through the command (``snapformat.cli.main``) and checks the destination with the
library: it lists the same sequences with the same commit records (so the same snapshot ids and
byte-identical manifests), every copied snapshot verifies there, a second copy reports "already
there" and changes nothing, a destination holding a different snapshot at a sequence refuses
with ``CommitConflictError`` (exit 1), and a corrupted source file fails the copy with
``CorruptSnapshotError`` and publishes nothing; once the source is repaired, the copy succeeds.

Incremental snapshots (shared objects): two stores sharing nothing, copied into each other (local,
and local <-> SeaweedFS), end with exactly the union of the objects their snapshots name, each
copied once, and every snapshot reads back its own rows; an object already at the destination is
checked (and made young again), not copied, and replaced when its bytes do not match its name; a
source object whose bytes do not match its name fails the copy and lands nowhere.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from schemas.controller import LoaderPlace
from snapformat import SnapshotStore, layout, verify_snapshot
from snapformat.cli import main
from snapformat.copy import copy_snapshot, copy_store
from snapformat.example import TOPOLOGY, write_example
from snapformat.verify import verify_store
from tests.snapformat.chains import Chain, referenced_objects, stored_objects


class Stores:
    """Opens each store once per test (an S3 client costs ~0.3 s of CPU to create)."""

    def __init__(self) -> None:
        self._open: dict[str, SnapshotStore] = {}

    def __call__(self, url: str | Path) -> SnapshotStore:
        if str(url) not in self._open:
            self._open[str(url)] = SnapshotStore(str(url))
        return self._open[str(url)]


@pytest.fixture
def stores() -> Stores:
    return Stores()


def publish_examples(store: SnapshotStore, seeds: list[int], keep_latest: int | None = None) -> None:
    for seed in seeds:
        draft = store.begin()
        gym, receipts = write_example(draft, count=6, seed=seed)
        draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=TOPOLOGY, keep_latest=keep_latest)


@pytest.fixture(scope="module")
def local_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local store holding sequences 3 and 2 (1 was pruned): a copy must not assume it starts at 1."""
    root = tmp_path_factory.mktemp("copy-src") / "store"
    publish_examples(SnapshotStore(str(root)), [1, 2, 3], keep_latest=2)
    assert [c.sequence for c in SnapshotStore(str(root)).list()] == [3, 2]
    return root


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out + err


def assert_same_and_verified(src: SnapshotStore, dst: SnapshotStore) -> None:
    """Same commits (ids, sequences, manifest checksums) at both ends; all verify at ``dst``."""
    src_commits = src.list()
    assert dst.list() == src_commits and src_commits
    for c in src_commits:
        report = verify_snapshot(dst.open(c.sequence))
        assert report.ok, report.problems
    assert dst.latest().sequence == src_commits[0].sequence


def assert_copied(out: str, copied: int, already: int) -> None:
    lines = [line.split() for line in out.splitlines() if "sequence" in line]
    assert sum(1 for w in lines if w[0] == "copied") == copied, out
    assert sum(1 for w in lines if w[:2] == ["already", "there"]) == already, out


def test_copy_store_local_to_seaweedfs_and_back(local_src: Path, seaweed, new_bucket, aws_env, stores: Stores,
                                                tmp_path: Path, capsys) -> None:
    aws_env(seaweed)
    remote = f"s3://{new_bucket(seaweed)}/copied"
    code, out = cli(capsys, "copy", local_src, remote)
    assert code == 0, out
    assert_copied(out, copied=2, already=0)
    assert_same_and_verified(stores(local_src), stores(remote))
    code, out = cli(capsys, "copy", local_src, remote)  # idempotent
    assert code == 0, out
    assert_copied(out, copied=0, already=2)
    assert stores(remote).list() == stores(local_src).list()

    back = tmp_path / "back"
    code, out = cli(capsys, "copy", remote, back)
    assert code == 0, out
    assert_copied(out, copied=2, already=0)
    assert_same_and_verified(stores(local_src), stores(back))
    code, out = cli(capsys, "copy", remote, back)
    assert code == 0, out
    assert_copied(out, copied=0, already=2)


def test_copy_one_snapshot_local_to_seaweedfs_and_back(local_src: Path, seaweed, new_bucket, aws_env, stores: Stores,
                                                       tmp_path: Path, capsys) -> None:
    aws_env(seaweed)
    remote = f"s3://{new_bucket(seaweed)}/one"
    src_snap = stores(local_src).open(2)
    sid = src_snap.manifest.snapshot_id
    # the destination may be given as the snapshot's location in the destination store
    code, out = cli(capsys, "copy", src_snap.url, f"{remote}/snapshots/{sid}")
    assert code == 0, out
    assert_copied(out, copied=1, already=0)
    dst = stores(remote)
    assert dst.list() == [src_snap.commit] and verify_snapshot(dst.open(2)).ok
    code, out = cli(capsys, "copy", src_snap.url, remote)
    assert code == 0, out
    assert_copied(out, copied=0, already=1)

    code, out = cli(capsys, "copy", f"{remote}/snapshots/{sid}", tmp_path / "local")  # S3 -> local
    assert code == 0, out
    local = stores(tmp_path / "local")
    assert local.list() == [src_snap.commit] and verify_snapshot(local.open(2)).ok

    other = stores(local_src).open(3).manifest.snapshot_id  # a location naming another id
    code, out = cli(capsys, "copy", src_snap.url, f"{remote}/snapshots/{other}")
    assert code == 1 and "keeps the snapshot id" in out, out


def test_copy_s3_to_s3_on_moto(moto_s3, new_bucket, aws_env, stores: Stores, capsys) -> None:
    aws_env(moto_s3)
    src = f"s3://{new_bucket(moto_s3)}/src"
    publish_examples(stores(src), [4, 5])
    dst = f"s3://{new_bucket(moto_s3)}/dst"
    code, out = cli(capsys, "copy", src, dst)
    assert code == 0, out
    assert_copied(out, copied=2, already=0)
    assert_same_and_verified(stores(src), stores(dst))
    code, out = cli(capsys, "copy", stores(src).open(1).url, dst)  # one snapshot: already there too
    assert code == 0, out
    assert_copied(out, copied=0, already=1)
    assert stores(dst).list() == stores(src).list()


@pytest.mark.parametrize("where", ["local", "seaweed"])
def test_copy_into_a_different_snapshot_at_that_sequence_conflicts(where: str, local_src: Path, request, new_bucket,
                                                                   aws_env, stores: Stores, tmp_path: Path,
                                                                   capsys) -> None:
    if where == "seaweed":
        server = request.getfixturevalue("seaweed")
        aws_env(server)
        dst = f"s3://{new_bucket(server)}/taken"
    else:
        dst = str(tmp_path / "taken")
    publish_examples(stores(dst), [7, 8])  # its own sequences 1 and 2, other snapshot ids
    before = stores(dst).list()
    code, out = cli(capsys, "copy", local_src, dst)  # sequence 2 comes first: taken
    assert code == 1 and "CommitConflictError" in out and "sequence 2" in out, out
    code, out = cli(capsys, "copy", stores(local_src).open(2).url, dst)
    assert code == 1 and "CommitConflictError" in out, out
    assert stores(dst).list() == before  # nothing replaced, nothing added
    for c in before:
        assert verify_snapshot(stores(dst).open(c.sequence)).ok


def _flip_byte(path: Path) -> bytes:
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    return data


def test_corrupt_local_source_publishes_nothing_on_seaweedfs(local_src: Path, seaweed, new_bucket, aws_env,
                                                             stores: Stores, tmp_path: Path, capsys) -> None:
    aws_env(seaweed)
    src = tmp_path / "src"
    shutil.copytree(local_src, src)
    snap = stores(src).open(3)
    rel = snap.files("token_capture_rows")[0].path
    tokens = src / "snapshots" / snap.manifest.snapshot_id / rel
    good = _flip_byte(tokens)  # same size, different bytes: only the checksum can tell

    dst = f"s3://{new_bucket(seaweed)}/corrupt"
    code, out = cli(capsys, "copy", snap.url, dst)
    assert code == 1 and "CorruptSnapshotError" in out and rel in out, out
    assert stores(dst).list() == []  # nothing published
    code, out = cli(capsys, "copy", src, dst)  # the whole store: sequence 2 is fine, 3 is not
    assert code == 1 and "CorruptSnapshotError" in out, out
    assert [c.sequence for c in stores(dst).list()] == [2]

    tokens.write_bytes(good)  # repaired: the copy goes through over the failed attempt's leftovers
    code, out = cli(capsys, "copy", src, dst)
    assert code == 0, out
    assert_copied(out, copied=1, already=1)
    assert_same_and_verified(stores(src), stores(dst))


def test_corrupt_seaweedfs_source_publishes_nothing_locally(local_src: Path, seaweed, new_bucket, aws_env,
                                                            stores: Stores, tmp_path: Path, capsys) -> None:
    aws_env(seaweed)
    bucket = new_bucket(seaweed)
    src = f"s3://{bucket}/src"
    code, out = cli(capsys, "copy", local_src, src)
    assert code == 0, out
    snap = stores(src).open(3)
    key = f"src/snapshots/{snap.manifest.snapshot_id}/{snap.files('training_rows')[0].path}"
    client = seaweed.client()
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=good[: len(good) // 2])  # truncated

    dst = tmp_path / "dst"
    code, out = cli(capsys, "copy", snap.url, dst)
    assert code == 1 and "CorruptSnapshotError" in out and "training.arrow" in out, out
    assert stores(dst).list() == []
    body = bytearray(good)
    body[len(body) // 2] ^= 0xFF  # right size, wrong bytes
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    code, out = cli(capsys, "copy", snap.url, dst)
    assert code == 1 and "CorruptSnapshotError" in out, out
    assert stores(dst).list() == []

    client.put_object(Bucket=bucket, Key=key, Body=good)  # repaired
    # A copy killed mid-file leaves a partial file on local disk: named, not trusted, not deleted.
    folder = dst / "snapshots" / snap.manifest.snapshot_id
    first = next(f for f in snap.files() if f.object is None)  # the first file a copy writes
    leftover = folder / first.path
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(snap.read_bytes(first)[:10])
    code, out = cli(capsys, "copy", src, dst)
    assert code == 1 and "interrupted copy" in out and str(folder) in out, out
    assert [c.sequence for c in stores(dst).list()] == [2]  # 2 went through, 3 did not
    shutil.rmtree(folder)  # what the message says to do
    code, out = cli(capsys, "copy", src, dst)
    assert code == 0, out
    assert_copied(out, copied=1, already=1)
    assert_same_and_verified(stores(local_src), stores(dst))


# -- incremental snapshots: copies carry exactly the objects referenced, each once --------------------

def _tiny(store: SnapshotStore, keep_latest: int | None = None) -> None:
    draft = store.begin()
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=0, seed=0))
    draft.publish(keep_latest=keep_latest)


def _store_at(where: str, name: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if where == "local":
        return str(tmp_path / name)
    server = request.getfixturevalue("seaweed")
    request.getfixturevalue("aws_env")(server)
    return f"s3://{request.getfixturevalue('new_bucket')(server)}/{name}"


@pytest.mark.parametrize("b_where", ["local", "seaweed"])
def test_two_stores_sharing_nothing_copied_into_each_other(b_where: str, tmp_path: Path, request, stores: Stores,
                                                           capsys) -> None:
    a = stores(tmp_path / "a")
    b = stores(_store_at(b_where, "b", tmp_path, request))
    chain_a, chain_b = Chain(a, salt=1), Chain(b, salt=2)
    chain_a.publish(new=2)
    chain_a.publish(new=1, drop=1, narrow=True)
    chain_a.publish(new=2, narrow=True)  # A: sequences 1..3
    for _ in range(3):
        _tiny(b)  # B's own 1..3, pruned below: B's chain holds 4..6
    chain_b.publish(new=2, keep_latest=3)
    chain_b.publish(new=1, narrow=True, keep_latest=3)
    chain_b.publish(new=1, drop=2, keep_latest=3)
    assert [c.sequence for c in b.list()] == [6, 5, 4]
    own_a, own_b = referenced_objects(a), referenced_objects(b)
    assert own_a and own_b and not own_a & own_b

    into_b = copy_store(str(a.url), b.url)
    into_a = copy_store(b.url, str(a.url))
    # each object once, however many snapshots list it; nothing already there copied again
    assert sum(r.objects_copied for r in into_b) == len(own_a)
    assert sum(r.objects_reused for r in into_b) > 0 and all(r.objects_replaced == 0 for r in into_b)
    assert [(r.sequence, r.skipped) for r in into_a] == [(1, True), (2, True), (3, True), (4, False), (5, False),
                                                         (6, False)]
    assert sum(r.objects_copied for r in into_a) == len(own_b)
    for store in (a, b):
        assert [c.sequence for c in store.list()] == [6, 5, 4, 3, 2, 1]
        assert store.latest().sequence == 6
        assert stored_objects(store) == referenced_objects(store) == own_a | own_b  # exactly, no cross-talk
        assert verify_store(store.store).ok
        for c in store.list():
            snap = store.open(c.sequence)
            chain = chain_a if c.sequence <= 3 else chain_b
            assert snap.read_table("training").equals(chain.expected(snap.manifest.snapshot_id))
    code, out = cli(capsys, "copy", a.url, b.url)  # again: everything already there
    assert code == 0 and "copied" not in out.replace("already there", ""), out


def test_copy_checks_objects_already_there_and_replaces_a_damaged_one(tmp_path: Path, stores: Stores) -> None:
    src, dst = stores(tmp_path / "src"), stores(tmp_path / "dst")
    chain = Chain(src)
    chain.publish(new=2)
    chain.publish(new=1)  # lists the first snapshot's two objects again
    first = copy_snapshot(src.open(1), dst.store)
    assert (first.objects_copied, first.objects_present) == (2, 0)
    victim, healthy = sorted(f.object for f in src.open(1).manifest.files if f.object is not None)
    damaged = tmp_path / "dst" / layout.object_key(victim)
    damaged.write_bytes(damaged.read_bytes()[::-1])  # same size, not what its name says
    old = time.time() - 7 * 86400
    os.utime(tmp_path / "dst" / layout.object_key(healthy), (old, old))

    second = copy_snapshot(src.open(2), dst.store)
    assert (second.objects_copied, second.objects_present, second.objects_replaced) == (1, 1, 1)
    # the object already there was checked, not copied, and made young again: a GC at the
    # destination keeps it until this copy has published
    assert (tmp_path / "dst" / layout.object_key(healthy)).stat().st_mtime > time.time() - 60
    assert verify_store(dst.store).ok  # snapshot 1 at the destination is whole again too
    for seq in (1, 2):
        snap = dst.open(seq)
        assert snap.read_table("training").equals(chain.expected(snap.manifest.snapshot_id))


@pytest.mark.parametrize("where", ["local", "seaweed"])
def test_a_source_object_that_does_not_match_its_name_publishes_nothing(where: str, tmp_path: Path, request,
                                                                        stores: Stores, capsys) -> None:
    src = stores(tmp_path / "src")
    Chain(src).publish(new=1)
    entry = next(f for f in src.open(1).manifest.files if f.object is not None)
    path = tmp_path / "src" / layout.object_key(entry.object)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # right size, right key, wrong bytes
    dst = stores(_store_at(where, "dst", tmp_path, request))
    code, out = cli(capsys, "copy", src.url, dst.url)
    assert code == 1 and "CorruptSnapshotError" in out and layout.object_key(entry.object) in out, out
    assert "hashing to" in out
    assert dst.list() == [] and entry.object not in stored_objects(dst)  # never trusted for its name
    path.write_bytes(good)
    code, out = cli(capsys, "copy", src.url, dst.url)
    assert code == 0, out
    assert_same_and_verified(src, dst)
