"""Gym's bytes built in chunks (``snapformat.gym_dir``): streamed JSON lines, the streamed
``continuation_roots_sha256`` and ``DurableFiles.add_chunks`` give exactly the bytes and digests of
the whole builds, and a failing stream leaves no file behind."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import InvalidPathError
from schemas.gym_files import ExternalStorageReference
from snapformat import gym_dir
from snapformat.gym_dir import DurableFiles, JsonlChunks, continuation_roots_sha256, jsonl_bytes, write_jsonl
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


def test_add_chunks_counts_files_and_bytes_and_is_durable_with_the_block(tmp_path: Path) -> None:
    with DurableFiles() as out:
        size = out.add_chunks(tmp_path / "a" / "big.jsonl", (b"x" * 1000 for _ in range(50)))
        out.add(tmp_path / "a" / "small.json", b"{}")
    assert size == 50_000 and (out.files, out.bytes) == (2, 50_002)
    assert (tmp_path / "a" / "big.jsonl").read_bytes() == b"x" * 50_000
    with pytest.raises(RuntimeError, match="after the files were synced"):
        out.add_chunks(tmp_path / "a" / "late", [b""])
