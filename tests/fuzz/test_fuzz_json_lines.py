"""Fuzzing the JSON-lines parts, plain and zstd, of every record kind of ``snapformat.kinds``.

Seeds are the golden store's parts of each kind (and its real zstd part); zstd seeds are the same
content in one frame, as the reference writer makes it. An example mutates the content (bytes or one
line's JSON) and then compresses it, or mutates the compressed bytes themselves, and lists the file
with a matching size and checksum and a ``content_size`` that is exact, off by one, or an edge value.
Proves, for every input: ``Snapshot.records`` returns records or raises a ``SnapshotError`` subclass,
never another exception, within the memory cap (a ``content_size`` far beyond what the frame can
hold is refused before decompressing); for the token index, ``verify_snapshot`` reports instead of
raising and ``token_rows`` resolves an entry or raises typed.
"""

from __future__ import annotations

from functools import cache

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from fuzz_mutations import EDGE_INTS, mutated_bytes, mutated_json_lines
from fuzz_property import FUZZ, TIMEOUT, typed_or_result
from fuzz_seeds import content_of, entries_of_kind, golden_files, file_key, snapshot_with, with_bytes, zstd_frame
from schemas.errors import SnapshotError
from schemas.manifest import JSONL_KINDS
from snapformat import verify_snapshot
from snapformat.reader import Snapshot

pytestmark = TIMEOUT

KINDS = sorted(JSONL_KINDS)
#: Enough to tell the real content size of a mutated frame, far below the memory cap.
_SIZING_LIMIT = 64 << 20


@cache
def _contents(kind: str) -> tuple[bytes, ...]:
    return tuple(content_of(seq, entry) for seq, entry in entries_of_kind(kind))


@cache
def _frames(kind: str) -> tuple[bytes, ...]:
    """The kind's content as zstd frames, plus every zstd file of the golden store (real writer)."""
    real = [golden_files()[file_key(seq, e.path)] for kind_ in KINDS for seq, e in entries_of_kind(kind_)
            if e.compression == "zstd"]
    return tuple(zstd_frame(c) for c in _contents(kind)) + tuple(real)


def _content_size(frame: bytes) -> int | None:
    """What ``frame`` really decompresses to (bounded), or None when it does not decompress."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=True)
        return len(reader.read(_SIZING_LIMIT))
    except zstandard.ZstdError:
        return None


def _read(snap: Snapshot, path: str, kind: str) -> None:
    records = typed_or_result(lambda: snap.records(path))
    if kind != "token_index" or isinstance(records, SnapshotError):
        return
    report = verify_snapshot(snap)  # collects problems; raising anything would fail here
    assert report.files_checked == snap.manifest.file_count
    if records:
        typed_or_result(lambda: snap.token_rows(records[0].capture_key, records[0].model_call_id))


@pytest.mark.parametrize("kind", KINDS)
@FUZZ
@given(data=st.data())
def test_plain_part(kind: str, data: st.DataObject) -> None:
    seq, entry = data.draw(st.sampled_from(entries_of_kind(kind)))
    seeds = list(_contents(kind))
    content = data.draw(st.one_of(mutated_bytes(seeds), mutated_json_lines(seeds)))
    listed = with_bytes(entry, content, compression="none", content_size=None)
    _read(snapshot_with(seq, listed, content), entry.path, kind)


@pytest.mark.parametrize("kind", KINDS)
@FUZZ
@given(data=st.data())
def test_zstd_part(kind: str, data: st.DataObject) -> None:
    seq, entry = data.draw(st.sampled_from(entries_of_kind(kind)))
    if data.draw(st.booleans()):  # damaged lines inside a sound frame
        seeds = list(_contents(kind))
        content = data.draw(st.one_of(mutated_bytes(seeds), mutated_json_lines(seeds)))
        stored, size = zstd_frame(content), len(content)
    else:  # a damaged frame
        stored = data.draw(mutated_bytes(list(_frames(kind))))
        size = _content_size(stored)
    content_size = data.draw(st.sampled_from(
        ([size, size, size, size + 1, max(size - 1, 0)] if size is not None else []) + EDGE_INTS[:1] + EDGE_INTS[9:]))
    listed = with_bytes(entry, stored, compression="zstd", content_size=content_size if content_size >= 0 else 0)
    _read(snapshot_with(seq, listed, stored), entry.path, kind)
