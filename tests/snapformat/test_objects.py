"""Shared objects (format 1.3, SPEC §14.2): written once, listed again by later snapshots, read back.

Proves, on local disk and on SeaweedFS: a chain of incremental snapshots (each lists its parent's
row objects again, drops some, narrows one by a row range, and writes new ones) reads back exactly
the rows each snapshot was given, and verifies; an object is stored once under
``objects/<2>/<64>`` however many snapshots list it; putting an object again refreshes its age and
mends a damaged copy; and an object whose bytes do not hash to its name (same size, one byte
changed; or truncated) is refused by every read and named by ``verify``, never trusted because of
its name. A property test draws row ranges and checks each reads back exactly those rows.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import CorruptSnapshotError, InvalidPathError
from schemas.version import SHARED_OBJECTS
from snapformat import SnapshotStore, layout, verify_snapshot
from snapformat.arrow_parts import RowsWriter
from snapformat.objects import ALGORITHM, object_name, put_object
from snapformat.verify import verify_store
from tests.snapformat.chains import ROW_KIND, Chain, referenced_objects, segment, stored_objects


@pytest.fixture(params=["local", "seaweed"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    server = request.getfixturevalue("seaweed")
    request.getfixturevalue("aws_env")(server)
    return f"s3://{request.getfixturevalue('new_bucket')(server)}/store"


def _damage(store: SnapshotStore, name: str, change) -> None:
    """Replace the stored bytes of object ``name`` by ``change(bytes)``, on whatever backend."""
    key = layout.object_key(name)
    data = store.store.read_bytes(key)
    store.store.put_bytes(key, change(data))


def _flip(data: bytes) -> bytes:
    """One byte of the last quarter changed (row data, not the Arrow footer): still a readable file."""
    i = len(data) * 3 // 4
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


def test_incremental_chain_reads_back_its_rows(store_url: str) -> None:
    store = SnapshotStore(store_url)
    chain = Chain(store)
    published = [chain.publish(new=2), chain.publish(new=1, drop=1, narrow=True), chain.publish(new=1, narrow=True)]
    for p in published:
        snap = store.open(p.manifest.sequence)
        assert snap.read_table("training").equals(chain.expected(p.manifest.snapshot_id))
        report = verify_snapshot(snap)
        assert report.ok, report.problems
        assert SHARED_OBJECTS in snap.manifest.required_features
        rows = [f for f in snap.manifest.files if f.kind == ROW_KIND]
        assert rows and all(f.object is not None and f.checksum == f.object for f in rows)
    third = store.open(3).manifest
    inherited = [f for f in third.files if f.object is not None and f.object in
                 {g.object for g in store.open(2).manifest.files}]
    assert len(inherited) == 2 and inherited[0].row_range is not None  # listed again, the first narrowed
    # each object once on the store, under objects/<2>/<64>, whatever lists it
    assert stored_objects(store) == referenced_objects(store) | {
        f.object for f in published[0].manifest.files if f.object is not None}
    assert verify_store(store.store).ok


def test_put_object_again_refreshes_its_age_and_mends_a_damaged_copy(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    data = b"segment bytes " * 100
    first = put_object(store.store, data)
    assert first.created and first.name == object_name(data) and first.size == len(data)
    path = tmp_path / layout.object_key(first.name)
    old = time.time() - 7 * 86400
    os.utime(path, (old, old))
    again = put_object(store.store, data, name=first.name)
    assert not again.created and again.name == first.name
    assert path.stat().st_mtime > time.time() - 60  # young again: a GC must not take it from its new user
    path.write_bytes(b"damaged")
    put_object(store.store, data)
    assert path.read_bytes() == data
    with pytest.raises(ValueError, match="hash to"):
        put_object(store.store, data, name=object_name(b"other bytes"))


@given(st.text("0123456789abcdef", min_size=64, max_size=64))
def test_object_keys_round_trip(hexdigest: str) -> None:
    name = f"sha256:{hexdigest}"
    key = layout.object_key(name)
    assert key == f"objects/{hexdigest[:2]}/{hexdigest}"
    assert layout.object_of_key(key) == name
    wrong_folder = "00" if hexdigest[:2] != "00" else "01"
    assert layout.object_of_key(f"objects/{wrong_folder}/{hexdigest}") is None
    assert layout.object_of_key(f"objects/{hexdigest[:2]}/.tmp-{hexdigest[:32]}") is None


@pytest.mark.parametrize("name", ["sha256:" + "A" * 64, "xxh128:" + "0" * 32, "sha256:../../x", ""])
def test_a_malformed_object_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidPathError, match="sha256"):
        layout.object_key(name)


@pytest.mark.parametrize("damage", ["one byte changed", "truncated"])
def test_an_object_whose_bytes_do_not_match_its_name_is_refused(store_url: str, damage: str) -> None:
    store = SnapshotStore(store_url)
    chain = Chain(store)
    chain.publish(new=1)
    chain.publish(new=1)  # lists the first snapshot's object again
    victim = next(f for f in store.open(1).manifest.files if f.object is not None)
    _damage(store, victim.object, _flip if damage == "one byte changed" else (lambda d: d[: len(d) // 2]))
    key = layout.object_key(victim.object)
    for seq in (1, 2):
        snap = store.open(seq)
        with pytest.raises(CorruptSnapshotError, match=key):
            snap.read_table("training")
        problems = verify_snapshot(snap).problems
        assert [p.file for p in problems] == [f.path for f in snap.manifest.files if f.object == victim.object]
        assert key in problems[0].message
        if damage == "one byte changed":  # a readable Arrow file of the right size, at the right key
            assert "hash to" in problems[0].message and "not to its name" in problems[0].message
    report = verify_store(store.store)
    assert not report.ok
    [bad] = report.object_problems
    assert bad.object == victim.object and bad.location.endswith(key)
    assert sorted((r.sequence, r.file) for r in bad.referenced_by) == [(1, victim.path), (2, victim.path)]
    put_object(store.store, _original(chain, victim))
    assert verify_store(store.store).ok  # mended by putting the right bytes again


def _original(chain: Chain, entry) -> bytes:
    """The bytes an object was written with, rebuilt from its seed (as the writer built them)."""
    sink = io.BytesIO()
    writer = RowsWriter(sink, ROW_KIND, "rebuild", "none", algorithm=ALGORITHM)
    writer.write(segment(chain.seed_of[entry.object]))
    writer.finish()
    assert object_name(sink.getvalue()) == entry.object
    return sink.getvalue()


@pytest.fixture(scope="module")
def ranged_store(tmp_path_factory: pytest.TempPathFactory) -> SnapshotStore:
    """A store whose first snapshot lists one row object of 40+ rows as ``tq/full.arrow``."""
    store = SnapshotStore(str(tmp_path_factory.mktemp("ranges") / "store"))
    draft = store.begin()
    rows = pa.concat_tables([pa.Table.from_batches([segment(s)]) for s in range(8)])
    assert rows.num_rows >= 40
    draft.part("tq").write_rows_object("full.arrow", ROW_KIND, rows)
    draft.publish()
    return store


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_row_range_reads_back_exactly_those_rows(ranged_store: SnapshotStore, data: st.DataObject) -> None:
    parent = ranged_store.latest()
    full = next(f for f in parent.manifest.files if f.path == "tq/full.arrow")
    start = data.draw(st.integers(0, full.records), label="start")
    stop = data.draw(st.integers(start, full.records), label="stop")
    draft = ranged_store.begin()
    part = draft.part("tq")
    part.reference(full)  # the parent lists it whole: the next draft may reference it again
    ranged = part.reference(full, name="range.arrow", row_range=(start, stop))
    assert ranged.records == stop - start and ranged.object == full.object
    draft.publish()
    snap = ranged_store.latest()
    whole = snap.read_rows(full)
    got = snap.read_rows(next(f for f in snap.manifest.files if f.path == "tq/range.arrow"))
    assert got.equals(whole.slice(start, stop - start))
    assert verify_snapshot(snap).ok
