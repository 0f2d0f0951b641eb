"""The exact inputs the fuzzers found that made a reader raise something other than a typed error.

Each test feeds one such input (built from a golden file) to the reader that failed on it and
checks the typed error names the file, the field or line, and what was expected. Proves that:
- a JSON document or line with invalid UTF-8 inside a string (msgspec raises
  ``UnicodeDecodeError``) or nested 5000 levels deep (``RecursionError``), in a known or an
  unknown field, is a ``CorruptSnapshotError`` for the commit record, the store marker, the
  manifest, a part manifest, the loader place and every JSON-lines kind (naming the line);
- such a latest hint is ignored like any unreadable hint: ``latest()`` and ``begin()`` still work;
- a row part whose ``snapformat.schema_version`` has 5000 digits is a ``VersionError``, not
  ``int()``'s ``ValueError``;
- a token-capture batch with a null ``generation_token_ids`` list is refused by ``validate_batch``
  and ``read_table`` and reported by ``verify`` as a null in that column, not a ``TypeError`` from
  building the message;
- a row part whose string offsets point past their data, with a matching checksum, is refused by
  ``read_table`` instead of handing out a table that fails Arrow's full validation;
- two row files of one kind whose extra column has two types make ``read_table`` raise
  ``InvalidRecordError`` naming both files, not Arrow's ``ArrowTypeError``;
- a commit record, store marker, hint or part manifest of 1 GiB, or a manifest larger than its
  commit record says, is refused (the hint ignored) under a 64 MiB memory cap: read only up to
  its bound, never whole;
- a token-index entry naming a batch that does not exist (5, or 2^63) or rows past the batch's
  end makes ``token_rows`` raise ``CorruptSnapshotError``, not ``ValueError``/``OverflowError`` or a
  silently short table.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest

from fuzz_property import address_space_limit
from fuzz_seeds import (
    GOLDEN, MemoryStore, entries_of_kind, file_key, golden_commit, golden_files, golden_manifest, snapshot_with,
    store_with, with_bytes, zstd_frame,
)
from schemas.errors import CorruptSnapshotError, InvalidRecordError, VersionError
from schemas.manifest import FileEntry, PartReceipt
from schemas.rows import validate_batch
from snapformat import LocalStore, SnapshotStore, discovery, layout, verify_snapshot
from snapformat.checksum import checksum_bytes
from snapformat.publish import load_part
from snapformat.reader import Snapshot, open_sequence

pytestmark = pytest.mark.timeout(60)

DEEP = b"[" * 5000 + b"]" * 5000


def _bad_utf8(data: bytes) -> bytes:
    """The first string value of ``data`` starting with a byte that is never valid UTF-8 (an
    unknown key is skipped undecoded, so it has to be a value; the loader place has none but
    ``extra``)."""
    if b'{}' in data and not re.search(rb':\s*"', data):
        return data.replace(b"{}", b'{"k": "\xff"}', 1)
    return re.sub(rb'(:\s*")', lambda m: m.group(1) + b"\xff", data, count=1)


def _deep(data: bytes) -> bytes:
    """``data`` with an unknown field nested 5000 levels deep in front of its first field."""
    return data.replace(b"{", b'{"unknown":' + DEEP + b",", 1)


MUTATIONS = {"invalid UTF-8": (_bad_utf8, "not valid UTF-8"), "nested too deep": (_deep, "nested deeper")}


def _read_commit(data: bytes) -> tuple[Callable[[], Any], str]:
    store = store_with({layout.commit_key(2): data})
    return lambda: discovery.read_commit(store, 2), store.display(layout.commit_key(2))


def _read_marker(data: bytes) -> tuple[Callable[[], Any], str]:
    store = store_with({layout.MARKER_KEY: data})
    return lambda: SnapshotStore(store).check_marker(), store.display(layout.MARKER_KEY)


def _read_manifest(data: bytes) -> tuple[Callable[[], Any], str]:
    commit = golden_commit(2)
    key = f"{layout.snapshot_dir(commit.snapshot_id)}/{layout.MANIFEST_NAME}"
    fixed = msgspec.structs.replace(commit, manifest_size=len(data), manifest_checksum=checksum_bytes(data))
    store = store_with({key: data, layout.commit_key(2): msgspec.json.encode(fixed)})
    return lambda: open_sequence(store, 2), store.display(key)


def _read_part_manifest(data: bytes) -> tuple[Callable[[], Any], str]:
    key = file_key(2, "tq/part-manifest.json")
    store = store_with({key: data})
    receipt = PartReceipt(prefix="tq", writer="tq", part_manifest_checksum=checksum_bytes(data))
    return lambda: load_part(store, golden_commit(2).snapshot_id, receipt), store.display(key)


def _read_loader(data: bytes) -> tuple[Callable[[], Any], str]:
    seq, entry = entries_of_kind("loader_place")[-1]
    snap = snapshot_with(seq, with_bytes(entry, data), data)
    return lambda: snap.records("loader"), snap.where(entry)


DOCUMENTS: dict[str, tuple[str, Callable[[bytes], tuple[Callable[[], Any], str]]]] = {
    "commit record": (layout.commit_key(2), _read_commit),
    "store marker": (layout.MARKER_KEY, _read_marker),
    "manifest": (f"{layout.snapshot_dir(golden_commit(2).snapshot_id)}/{layout.MANIFEST_NAME}", _read_manifest),
    "part manifest": (file_key(2, "tq/part-manifest.json"), _read_part_manifest),
    "loader place": (file_key(2, "controller/loader.json"), _read_loader),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("document", sorted(DOCUMENTS))
def test_undecodable_json_document_is_a_typed_error(document: str, mutation: str) -> None:
    key, reader = DOCUMENTS[document]
    mutate, words = MUTATIONS[mutation]
    read, where = reader(mutate(golden_files()[key]))
    with pytest.raises(CorruptSnapshotError) as err:
        read()
    assert str(err.value).startswith(f"{where}: ") and words in str(err.value)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_undecodable_hint_is_ignored(mutation: str) -> None:
    """The hint is advisory: an unreadable one must never stop ``latest()`` or ``begin()``."""
    mutate, _ = MUTATIONS[mutation]
    store = store_with({layout.HINT_KEY: mutate(golden_files()[layout.HINT_KEY])})
    assert discovery.latest_sequence(store) == 2
    assert SnapshotStore(store).latest().sequence == 2


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("kind", ["agent_state", "continuations", "model_ledger", "recovery_ledger",
                                  "replay_index", "session_state", "token_index"])
def test_undecodable_json_line_is_a_typed_error_naming_the_line(kind: str, mutation: str, compression: str) -> None:
    seq, entry = entries_of_kind(kind)[0]
    lines = golden_files()[file_key(seq, entry.path)].split(b"\n")
    mutate, words = MUTATIONS[mutation]
    lines[2] = mutate(lines[2])
    content = b"\n".join(lines)
    stored = zstd_frame(content) if compression == "zstd" else content
    listed = with_bytes(entry, stored, compression=compression,
                        content_size=len(content) if compression == "zstd" else None)
    snap = snapshot_with(seq, listed, stored)
    if kind == "continuations" and mutation == "nested too deep":
        # Gym's continuation line refuses unknown fields: the deep value is refused by its key,
        # before the decoder descends into it.
        error, words = InvalidRecordError, "unknown field `unknown`"
    else:
        error = CorruptSnapshotError
    with pytest.raises(error) as err:
        snap.records(entry.path)
    assert str(err.value).startswith(f"{snap.where(entry)}: line 3: ") and words in str(err.value)


# ---- documents far larger than their bound -------------------------------------------------------

HUGE = 1 << 30  # a sparse file: costs no disk, but reading it whole would cost 1 GiB of memory


@pytest.fixture
def golden_copy(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    return root


def _grown(root: Path, key: str) -> LocalStore:
    os.truncate(root / key, HUGE)
    return LocalStore(root)


def test_huge_commit_record_is_refused_without_reading_it(golden_copy: Path) -> None:
    store = _grown(golden_copy, layout.commit_key(2))
    with address_space_limit(64 << 20), pytest.raises(CorruptSnapshotError, match="commit record is too large"):
        discovery.read_commit(store, 2)


def test_huge_store_marker_is_refused_without_reading_it(golden_copy: Path) -> None:
    store = _grown(golden_copy, layout.MARKER_KEY)
    with address_space_limit(64 << 20), pytest.raises(CorruptSnapshotError, match="too large"):
        SnapshotStore(store).check_marker()


def test_huge_hint_is_ignored_without_reading_it(golden_copy: Path) -> None:
    store = _grown(golden_copy, layout.HINT_KEY)
    with address_space_limit(64 << 20):
        assert discovery.latest_sequence(store) == 2


def test_manifest_larger_than_its_commit_says_is_refused_without_reading_it(golden_copy: Path) -> None:
    commit = golden_commit(2)
    store = _grown(golden_copy, f"{layout.snapshot_dir(commit.snapshot_id)}/{layout.MANIFEST_NAME}")
    with address_space_limit(64 << 20), pytest.raises(
            CorruptSnapshotError, match=f"size is more than {commit.manifest_size} bytes, the commit record"):
        open_sequence(store, 2)


def test_huge_part_manifest_is_refused_without_reading_it(golden_copy: Path) -> None:
    store = _grown(golden_copy, file_key(2, "tq/part-manifest.json"))
    receipt = PartReceipt(prefix="tq", writer="tq", part_manifest_checksum="xxh128:" + "0" * 32)
    with address_space_limit(128 << 20), pytest.raises(CorruptSnapshotError, match="part manifest is too large"):
        load_part(store, golden_commit(2).snapshot_id, receipt)


# ---- row parts -----------------------------------------------------------------------------------

def _golden_table(kind: str) -> tuple[int, FileEntry, pa.Table]:
    seq, entry = entries_of_kind(kind)[-1]
    return seq, entry, pa.ipc.open_file(pa.py_buffer(golden_files()[file_key(seq, entry.path)])).read_all()


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _rows_snapshot(kind: str, table: pa.Table, data: bytes | None = None, keep: set[str] | None = None) -> tuple[Snapshot, FileEntry]:
    seq, entry, _ = _golden_table(kind)
    data = _ipc(table) if data is None else data
    listed = with_bytes(entry, data, batches=len(table.to_batches()), records=table.num_rows)
    return snapshot_with(seq, listed, data, keep=set() if keep is None else keep), listed


def test_schema_version_of_5000_digits_is_a_version_error() -> None:
    _, _, table = _golden_table("training_rows")
    table = table.replace_schema_metadata({**table.schema.metadata, b"snapformat.schema_version": b"1" * 5000})
    snap, entry = _rows_snapshot("training_rows", table)
    with pytest.raises(VersionError, match=r"snapformat.schema_version '1{40}\.\.\.' is not supported") as err:
        snap.read_table(entry.path)
    assert str(err.value).startswith(snap.where(entry))


def test_null_generation_list_is_reported_not_a_type_error() -> None:
    _, _, table = _golden_table("token_capture_rows")
    i = table.schema.get_field_index("generation_token_ids")
    values = table.column(i).to_pylist()
    values[0] = None
    table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
    # A version-1 file, checked against the current canonical type (int64 ids)
    null_column = r"row 0: column 'generation_token_ids' is null \(expected a list<item: int64> value"
    with pytest.raises(InvalidRecordError, match=null_column):
        validate_batch("token_capture_rows", table.combine_chunks().to_batches()[0], "batch")
    snap, entry = _rows_snapshot("token_capture_rows", table)
    with pytest.raises(InvalidRecordError, match=null_column):
        snap.read_table(entry.path)
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [entry.path] and re.search(null_column, problems[0].message)


def test_string_offsets_past_their_data_are_refused_even_with_a_matching_checksum() -> None:
    _, _, table = _golden_table("training_rows")
    data = bytearray(_ipc(table))
    lengths = [len(k) for k in table.column("key").to_pylist()]
    offsets = struct.pack(f"<{len(lengths) + 1}i", *[sum(lengths[:i]) for i in range(len(lengths) + 1)])
    at = data.index(offsets)
    struct.pack_into("<i", data, at + 8, 1_000_000)  # the third offset of the key column
    snap, entry = _rows_snapshot("training_rows", table, bytes(data))
    with pytest.raises(CorruptSnapshotError, match=r"record batch 0 is unreadable: .*offset"):
        snap.read_table(entry.path)


def test_row_files_whose_extra_column_types_differ_are_refused_naming_both() -> None:
    seq, entry, table = _golden_table("training_rows")
    files, entries = {}, []
    for name, extra in (("tq/a.arrow", pa.array([1] * table.num_rows, pa.int32())),
                        ("tq/b.arrow", pa.array(["x"] * table.num_rows))):
        data = _ipc(table.append_column("note", extra))
        files[file_key(seq, name)] = data
        entries.append(with_bytes(entry, data, path=name))
    manifest = msgspec.structs.replace(golden_manifest(seq), files=entries)
    snap = Snapshot(MemoryStore({**golden_files(), **files}), golden_commit(seq), manifest)
    with pytest.raises(InvalidRecordError, match=r"'training_rows' files tq/a.arrow, tq/b.arrow cannot be read as one"):
        snap.read_table("training_rows")


@pytest.mark.parametrize(("field", "value", "words"), [
    ("batch", 5, "batch 5 does not exist"),
    ("batch", 2**63, f"batch {2**63} does not exist"),
    ("row_start", 1000, "exceed batch 0"),
])
def test_token_index_entry_outside_its_rows_is_refused(field: str, value: int, words: str) -> None:
    seq, entry = entries_of_kind("token_index")[0]
    lines = golden_files()[file_key(seq, entry.path)].split(b"\n")
    first = json.loads(lines[0])
    first[field] = value
    lines[0] = json.dumps(first, separators=(",", ":")).encode()
    data = b"\n".join(lines)
    snap = snapshot_with(seq, with_bytes(entry, data), data)
    with pytest.raises(CorruptSnapshotError, match=words):
        snap.token_rows(first["capture_key"], first["model_call_id"])
