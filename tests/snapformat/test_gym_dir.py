"""Gym's bytes built in chunks (``snapformat.gym_dir``): streamed JSON lines, the streamed
``continuation_roots_sha256`` and ``DurableFiles.add_chunks`` give exactly the bytes and digests of
the whole builds, and a failing stream leaves no file behind."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import CorruptSnapshotError, InvalidPathError, InvalidRecordError, StoreError
from schemas.gym_files import ArtifactRef, ExternalStorageReference
from snapformat import gym_dir
from snapformat.gym_dir import DurableFiles, JsonlChunks, continuation_roots_sha256, jsonl_bytes, write_jsonl
from snapformat.tar_archive import tar_bytes
from tests.gym_record_strategies import continuation_roots

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

@SETTINGS
@given(rows=st.lists(continuation_roots(max_attempt=3), max_size=40), chunk_rows=st.integers(1, 7))
def test_streamed_jsonl_is_the_whole_build_byte_for_byte(tmp_path_factory, rows, chunk_rows: int) -> None:
    """Chunk boundaries anywhere (``JSONL_CHUNK_ROWS`` from 1 to 7): the file, its digest, size and
    row count are those of ``jsonl_bytes`` of every row, in ``DurableFiles`` and on its own."""
    folder = tmp_path_factory.mktemp("jsonl")
    whole = jsonl_bytes(rows)
    original = gym_dir.JSONL_CHUNK_ROWS
    gym_dir.JSONL_CHUNK_ROWS = chunk_rows
    try:
        chunks = JsonlChunks(iter(rows))
        pieces = list(chunks)
        assert all(p.count(b"\n") <= chunk_rows for p in pieces)
        alone = write_jsonl(folder, "agent/x/alone.jsonl", iter(rows))
        with DurableFiles() as out:
            together = write_jsonl(folder, "agent/x/together.jsonl", iter(rows), out)
    finally:
        gym_dir.JSONL_CHUNK_ROWS = original
    assert b"".join(pieces) == whole
    for ref in (alone, together, chunks.ref("agent/x/alone.jsonl")):
        assert (ref.sha256, ref.bytes, ref.records) == (hashlib.sha256(whole).hexdigest(), len(whole), len(rows))
    assert (folder / "agent/x/alone.jsonl").read_bytes() == (folder / "agent/x/together.jsonl").read_bytes() == whole


@SETTINGS
@given(rows=st.lists(continuation_roots(max_attempt=3), max_size=30))
def test_the_streamed_roots_digest_is_json_dumps_of_the_sorted_list(rows) -> None:
    ordered = sorted(rows, key=lambda r: (r.capture_key, r.last_committed_model_call_id))
    text = json.dumps([msgspec.to_builtins(r) for r in ordered], sort_keys=True, separators=(",", ":"))
    assert continuation_roots_sha256(iter(rows)) == hashlib.sha256(text.encode()).hexdigest()


def test_a_failing_stream_leaves_no_file_and_a_bad_path_writes_nothing(tmp_path: Path) -> None:
    def rows():
        yield ExternalStorageReference(capture_key="a", boundary_model_call_id="c", key="k")
        raise RuntimeError("the server's state went away")

    with pytest.raises(RuntimeError, match="went away"), DurableFiles() as out:
        out.add(tmp_path / "f" / "one.json", b"{}")
        write_jsonl(tmp_path, "f/refs.jsonl", rows(), out)
    assert sorted(os.listdir(tmp_path / "f")) in (["one.json"], [])  # no temp file, no refs.jsonl
    with pytest.raises(RuntimeError, match="went away"):
        write_jsonl(tmp_path, "g/refs.jsonl", rows())
    assert os.listdir(tmp_path / "g") == []
    with pytest.raises(InvalidPathError):
        write_jsonl(tmp_path, "../outside.jsonl", [])
    assert not (tmp_path.parent / "outside.jsonl").exists()


@pytest.mark.parametrize("workers", [1, 4])
def test_a_write_the_file_system_refuses_is_a_store_error_naming_the_file_and_leaves_no_temp(
        tmp_path: Path, workers: int) -> None:
    (tmp_path / "taken").mkdir()  # renaming a file over a folder fails (an OSError)
    with pytest.raises(StoreError, match=r"taken: cannot write"), DurableFiles(workers=workers) as out:
        out.add(tmp_path / "fine.json", b"{}")
        out.add(tmp_path / "taken", b"{}")
    with pytest.raises(StoreError, match=r"taken: cannot write"), DurableFiles(workers=workers) as out:
        out.add_chunks(tmp_path / "taken", [b"{", b"}"])
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(gym_dir.TEMP_PREFIX)) == []
    assert (tmp_path / "taken").is_dir()


def test_add_chunks_counts_files_and_bytes_and_is_durable_with_the_block(tmp_path: Path) -> None:
    with DurableFiles() as out:
        size = out.add_chunks(tmp_path / "a" / "big.jsonl", (b"x" * 1000 for _ in range(50)))
        out.add(tmp_path / "a" / "small.json", b"{}")
    assert size == 50_000 and (out.files, out.bytes) == (2, 50_002)
    assert (tmp_path / "a" / "big.jsonl").read_bytes() == b"x" * 50_000
    with pytest.raises(RuntimeError, match="after the files were synced"):
        out.add_chunks(tmp_path / "a" / "late", [b""])


@pytest.mark.parametrize("workers", [1, 4])
def test_durable_files_take_str_paths_bare_names_and_removals(tmp_path: Path, monkeypatch, workers: int) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.json").write_bytes(b"old")
    fsynced: list[str] = []
    real = gym_dir._fsync_dir
    monkeypatch.setattr(gym_dir, "_fsync_dir", lambda p: (fsynced.append(os.fspath(p)), real(p)))
    with DurableFiles(workers=workers) as out:
        out.add("bare.json", b"{}")  # a bare name: its folder is the working one, "."
        out.add(str(tmp_path / "deep" / "er" / "x.json"), b"[]")  # a str path, two folders created
        out.remove("old.json")
        out.remove("never-was.json")  # nothing to remove is no error
    assert (tmp_path / "bare.json").read_bytes() == b"{}" and (tmp_path / "deep/er/x.json").read_bytes() == b"[]"
    assert not (tmp_path / "old.json").exists()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(gym_dir.TEMP_PREFIX)) == []
    # each folder a name changed in is fsynced once: ".", the created folders' parents and the deepest folder
    assert sorted(fsynced) == sorted([".", str(tmp_path), str(tmp_path / "deep"), str(tmp_path / "deep" / "er")])


@SETTINGS
@given(data=st.binary(max_size=300) | st.lists(st.sampled_from([b"\n", b" ", b"\t", b"\r", b"\x0b", b"x", b"{}"]),
                                               max_size=60).map(b"".join),
       chunk=st.integers(1, 9), name=st.sampled_from(["rows.jsonl", "doc.json"]))
def test_scan_file_counts_a_jsonl_files_non_blank_lines_across_any_chunks(tmp_path_factory, monkeypatch, data: bytes,
                                                                          chunk: int, name: str) -> None:
    # Read in chunks of any size (the lines cross them), the file's non-blank lines are what Gym's readers count:
    # the b"\n"-split pieces with a byte bytes.strip() keeps; a JSON document's lines are not counted.
    path = tmp_path_factory.mktemp("scan") / name
    path.write_bytes(data)
    monkeypatch.setattr(gym_dir, "_CHUNK", chunk)
    facts = gym_dir.scan_file(path)
    expected = sum(1 for line in data.split(b"\n") if line.strip())
    assert facts.lines == (expected if name.endswith(".jsonl") else None)
    assert facts.records == (expected if name.endswith(".jsonl") else 1)
    assert gym_dir.non_blank_lines(data) == expected  # the writers' count (a ledger's rows) is the same
    assert (facts.size, facts.sha256) == (len(data), hashlib.sha256(data).hexdigest())


ROW_LINES = st.sampled_from([b'{"schema_version":1,"capture_key":"k","boundary_model_call_id":"c","key":"s"}',
                             b'{"capture_key":"k2","boundary_model_call_id":"c","key":"s"}', b"", b" ", b"\r", b"\x0b",
                             b'{"capture_key":"k","key":"s"}', b'{"capture_key":1}', b"{", b"[]", b"{} {}", b"\xff"])


def rows_a_line_at_a_time(path: Path, where: str) -> list[object]:
    """The reading of a JSON-lines file that chunked reading must equal: each b"\\n"-ended line (and a
    last one without it), blank ones skipped, decoded strictly; the first failure raised."""
    rows = []
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                rows.append(gym_dir.decode_strict(line, ExternalStorageReference, f"{where}: line {n}"))
    return rows


@SETTINGS
@given(lines=st.lists(ROW_LINES, max_size=12), ends=st.booleans(), chunk=st.integers(1, 40))
def test_rows_read_in_chunks_are_the_rows_read_a_line_at_a_time(tmp_path_factory, monkeypatch, lines: list[bytes],
                                                                 ends: bool, chunk: int) -> None:
    # Lines cross chunks of any size; the same rows, or the same first error with its line number.
    data = b"\n".join(lines) + (b"\n" if ends and lines else b"")
    path = tmp_path_factory.mktemp("rows") / "refs.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(gym_dir, "_CHUNK", chunk)
    try:
        expected: object = rows_a_line_at_a_time(path, str(path))
    except (InvalidRecordError, CorruptSnapshotError) as exc:
        expected = (type(exc), str(exc))
    try:
        got: object = gym_dir.read_rows(path, ExternalStorageReference)
    except (InvalidRecordError, CorruptSnapshotError) as exc:
        got = (type(exc), str(exc))
    assert got == expected
    try:  # the checked bytes a reader kept decode the same way, errors named by line alike
        kept: object = gym_dir.decode_rows(data, ExternalStorageReference, str(path))
    except (InvalidRecordError, CorruptSnapshotError) as exc:
        kept = (type(exc), str(exc))
    assert kept == expected
    ref = ArtifactRef(relative_path="refs.jsonl", sha256=hashlib.sha256(data).hexdigest(),
                      records=sum(1 for line in data.split(b"\n") if line.strip()), bytes=len(data))
    if not isinstance(expected, tuple):  # a reference that holds reads the same rows; one record more does not
        assert gym_dir.read_ref_rows(path.parent, ref, ExternalStorageReference) == expected
        with pytest.raises(CorruptSnapshotError, match=r"non-blank lines, the reference's records expects"):
            gym_dir.read_ref_rows(path.parent, msgspec.structs.replace(ref, records=ref.records + 1),
                                  ExternalStorageReference)


MEMBER_NAMES = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}\.json", fullmatch=True)


@SETTINGS
@given(members=st.dictionaries(MEMBER_NAMES, st.binary(max_size=1500), max_size=6), chunk=st.integers(1, 2000),
       keep=st.booleans())
def test_scanning_an_archive_hashes_each_member_from_the_same_read(tmp_path_factory, monkeypatch, members, chunk: int,
                                                                  keep: bool) -> None:
    # The agent check compares these with its index rows instead of reading the archive again: each member's
    # size and SHA-256 (and, kept, its bytes) as tarfile's reading of the whole file gives them.
    path = tmp_path_factory.mktemp("scan") / "agent-part-000000.tar"
    whole = tar_bytes(sorted(members.items()))
    path.write_bytes(whole)
    monkeypatch.setattr(gym_dir, "_CHUNK", chunk)
    facts = gym_dir.scan_file(path, keep=keep)
    with tarfile.open(fileobj=io.BytesIO(whole)) as tf:
        judged = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}  # type: ignore[union-attr]
    assert facts.archive == {name: gym_dir.MemberFacts(size=len(body), sha256=hashlib.sha256(body).hexdigest(),
                                                       data=body if keep else None) for name, body in judged.items()}
    assert (facts.members, facts.records, facts.data) == (len(judged), len(judged), None)
    assert (facts.size, facts.sha256) == (len(whole), hashlib.sha256(whole).hexdigest())
    other = path.with_name("doc.json")
    other.write_bytes(whole)  # the same bytes under another name are no archive
    assert gym_dir.scan_file(other, keep=keep).archive is None


def test_list_folder_lists_plain_files_by_relative_name_and_refuses_links(tmp_path: Path) -> None:
    root = tmp_path / "part"
    (root / "a" / "b").mkdir(parents=True)
    for rel in ("manifest.json", "a/x.jsonl", "a/b/y.json", f"a/{gym_dir.TEMP_PREFIX}0123", "a/skipped.json"):
        (root / rel).write_bytes(b"{}")
    assert gym_dir.list_folder(root, skip=["a/skipped.json"]) == ["a/b/y.json", "a/x.jsonl", "manifest.json"]
    (root / "a" / "to-b").symlink_to(root / "a" / "b", target_is_directory=True)
    with pytest.raises(InvalidPathError, match=r"a/to-b: a symbolic link"):
        gym_dir.list_folder(root)
    (root / "a" / "to-b").unlink()
    (root / "a" / "b" / "to-x").symlink_to(root / "a" / "x.jsonl")
    with pytest.raises(InvalidPathError, match=r"b/to-x: not a regular file"):
        gym_dir.list_folder(root)
    with pytest.raises(InvalidPathError, match="not a folder"):
        gym_dir.list_folder(root / "manifest.json")


def test_a_reference_to_a_json_document_is_refused_even_with_its_line_count(tmp_path: Path) -> None:
    from schemas.errors import CorruptSnapshotError
    from schemas.gym_files import ArtifactRef

    data = b"{\n  \"a\": 1\n}"  # three non-blank lines, but a JSON document, not JSON lines
    for name in ("doc.json", "rows.jsonl"):
        (tmp_path / name).write_bytes(data)
    facts = {name: gym_dir.scan_file(tmp_path / name) for name in ("doc.json", "rows.jsonl")}
    for name in facts:
        ref = ArtifactRef(relative_path=name, sha256=hashlib.sha256(data).hexdigest(), records=3, bytes=len(data))
        if name.endswith(".jsonl"):
            gym_dir.check_ref(ref, name, facts, tmp_path, "manifest")  # the same bytes as JSON lines pass
        else:
            with pytest.raises(CorruptSnapshotError, match="doc.json: it is not a JSON-lines file"):
                gym_dir.check_ref(ref, name, facts, tmp_path, "manifest")


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), _JSON_VALUES, max_size=5))
def test_compact_json_is_what_a_row_holds_so_it_embeds_as_raw(value: dict) -> None:
    """A value encoded ahead (``compact_json``) and embedded as ``msgspec.Raw`` gives the very row
    ``jsonl_bytes`` writes for the value itself: how the reference model records a call once."""
    assert gym_dir.compact_json(value) + b"\n" == jsonl_bytes([value])
    assert jsonl_bytes([{"token": msgspec.Raw(gym_dir.compact_json(value))}]) == jsonl_bytes([{"token": value}])


_TRICKY_TEXT = st.sampled_from(["\n", '\n  "items": []', "é", "\u2028", '"', "\\"]) | st.text(max_size=8)
_SPLICED_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_infinity=False) | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(before=_SPLICED_VALUES, items=st.lists(_SPLICED_VALUES, max_size=4), after=_SPLICED_VALUES)
def test_items_encoded_ahead_and_spliced_give_the_record_files_bytes(before: Any, items: list[Any], after: Any) -> None:
    """A record whose top-level list's items were encoded ahead, two levels in, and spliced into
    the record with that list empty: the bytes ``document_bytes`` gives for the whole record,
    whatever the items and the fields around them hold (newlines and the list's own line inside
    strings, non-ASCII, NaN)."""
    whole = {"before": before, "items": items, "after": after}
    spliced = gym_dir.document_bytes_spliced({"before": before, "items": [], "after": after}, "items",
                                             [gym_dir.nested_document_bytes(i, 2) for i in items])
    assert spliced == gym_dir.document_bytes(whole, sort_keys=False, indent=2)


def test_a_splice_needs_the_list_empty_at_the_top_level() -> None:
    with pytest.raises(ValueError, match="'items' is not an empty top-level list"):
        gym_dir.document_bytes_spliced({"items": [1]}, "items", [b"    2"])
    with pytest.raises(ValueError, match="'items' is not an empty top-level list"):
        gym_dir.document_bytes_spliced({"inner": {"items": []}}, "items", [b"    2"])
