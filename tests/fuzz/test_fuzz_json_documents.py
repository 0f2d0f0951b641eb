"""Fuzzing the JSON documents a reader decodes: commit record, store marker, latest hint, manifest,
part manifest and the JSON parts (loader place, part manifest as a part).

Each seed is the golden store's own file; each example mutates it (bytes or one JSON value) and, for
documents guarded by a checksum, usually fixes that checksum up so the decoder and the checks
behind it are reached. Proves, for every input: the reader returns a result or raises a
``SnapshotError`` subclass, never another exception, within the memory cap of
``fuzz_property``; a reader never writes to the store; the advisory hint, whatever its bytes, never
changes which snapshot is newest; and a manifest that opens can be verified and read without an
untyped error.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_mutations import mutated_bytes, mutated_json_document
from fuzz_property import FUZZ, TIMEOUT, typed_or_result
from fuzz_seeds import (
    SEQUENCES, entries_of_kind, file_key, golden_commit, golden_files, snapshot_with,
    store_with, with_bytes,
)
from schemas.errors import SnapshotError
from schemas.manifest import FileEntry, PartReceipt
from snapformat import SnapshotStore, discovery, layout, verify_snapshot
from snapformat.checksum import checksum_bytes
from snapformat.publish import load_part
from snapformat.reader import Snapshot, open_sequence

pytestmark = TIMEOUT

#: Mostly fix the checksum up (reach the decoder), sometimes not (the checksum must refuse).
CONSISTENT = st.sampled_from([True, True, True, False])


def _mutations(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated_bytes(seeds), mutated_json_document(seeds))


COMMIT_SEEDS = [golden_files()[layout.commit_key(s)] for s in SEQUENCES]
MANIFEST_SEEDS = [golden_files()[f"{layout.snapshot_dir(golden_commit(s).snapshot_id)}/manifest.json"]
                  for s in SEQUENCES]
MARKER_SEEDS = [golden_files()[layout.MARKER_KEY]]
HINT_SEEDS = [golden_files()[layout.HINT_KEY]]
PART_MANIFESTS = entries_of_kind("part_manifest")


def _read_everything(snap: Snapshot) -> None:
    """What a restore does with a snapshot that opened: verify it, then read each row kind."""
    report = verify_snapshot(snap)
    assert report.sequence == snap.sequence
    for kind in ("training_rows", "token_capture_rows"):
        if snap.files(kind):
            typed_or_result(lambda kind=kind: snap.read_table(kind))


@FUZZ
@given(seq=st.sampled_from(SEQUENCES), data=_mutations(COMMIT_SEEDS))
def test_commit_record(seq: int, data: bytes) -> None:
    store = store_with({layout.commit_key(seq): data})
    commit = typed_or_result(lambda: discovery.read_commit(store, seq))
    if not isinstance(commit, SnapshotError):
        assert commit.sequence == seq
        typed_or_result(lambda: open_sequence(store, seq))


@FUZZ
@given(data=_mutations(MARKER_SEEDS))
def test_store_marker(data: bytes) -> None:
    store = store_with({layout.MARKER_KEY: data})
    typed_or_result(lambda: SnapshotStore(store).check_marker())


@FUZZ
@given(data=_mutations(HINT_SEEDS + COMMIT_SEEDS))
def test_latest_hint_never_changes_the_newest(data: bytes) -> None:
    store = store_with({layout.HINT_KEY: data})
    assert typed_or_result(lambda: discovery.latest_sequence(store)) == 2
    latest = typed_or_result(lambda: SnapshotStore(store).latest())
    assert not isinstance(latest, SnapshotError) and latest.sequence == 2


@FUZZ
@given(seq=st.sampled_from(SEQUENCES), data=_mutations(MANIFEST_SEEDS), consistent=CONSISTENT)
def test_manifest(seq: int, data: bytes, consistent: bool) -> None:
    commit = golden_commit(seq)
    changes: dict[str, bytes | None] = {f"{layout.snapshot_dir(commit.snapshot_id)}/manifest.json": data}
    if consistent:
        fixed = msgspec.structs.replace(commit, manifest_size=len(data), manifest_checksum=checksum_bytes(data))
        changes[layout.commit_key(seq)] = msgspec.json.encode(fixed)
    store = store_with(changes)
    snap = typed_or_result(lambda: open_sequence(store, seq))
    if not isinstance(snap, SnapshotError):
        typed_or_result(lambda: _read_everything(snap))


@FUZZ
@given(which=st.sampled_from(PART_MANIFESTS), data=_mutations([golden_files()[file_key(s, e.path)]
                                                                for s, e in PART_MANIFESTS]),
       consistent=CONSISTENT)
def test_part_manifest_by_receipt(which: tuple[int, FileEntry], data: bytes, consistent: bool) -> None:
    seq, entry = which
    prefix = entry.path.rsplit("/", 1)[0]
    store = store_with({file_key(seq, entry.path): data})
    receipt = PartReceipt(prefix=prefix, writer="fuzz",
                          part_manifest_checksum=checksum_bytes(data) if consistent else entry.checksum)
    part = typed_or_result(lambda: load_part(store, golden_commit(seq).snapshot_id, receipt))
    if not isinstance(part, SnapshotError):
        assert part.prefix == prefix and all(f.path.startswith(prefix + "/") for f in part.files)


@pytest.mark.parametrize("kind", ["loader_place", "part_manifest"])
@FUZZ
@given(data=st.data(), consistent=CONSISTENT)
def test_json_part(kind: str, data: st.DataObject, consistent: bool) -> None:
    entries = entries_of_kind(kind)
    seq, entry = data.draw(st.sampled_from(entries))
    content = data.draw(_mutations([golden_files()[file_key(s, e.path)] for s, e in entries]))
    listed = with_bytes(entry, content) if consistent else entry
    snap = snapshot_with(seq, listed, content)
    typed_or_result(lambda: snap.records(entry.path))
