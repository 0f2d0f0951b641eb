"""Decompression bombs are refused before anything is allocated for what they claim.

Each read runs under an address-space cap (``fuzz_property.address_space_limit``) far below what
the bomb claims, so a reader that allocates first fails with ``MemoryError`` (or reports the
allocation failure instead of the real fault) rather than passing on a machine with memory to
spare. Proves that:
- an Arrow row part written with ZSTD buffer compression whose buffer declares 4 GiB (or 2^62
  bytes) of uncompressed data is refused, naming the batch and buffer, before Arrow allocates it,
  by ``read_table`` and ``verify_snapshot`` alike, from memory and memory-mapped;
- an uncompressed row part whose batch header declares 2^40 rows is refused without allocating;
- a zstd JSON-lines part is refused before decompressing when the manifest's ``content_size`` is
  more than its bytes can hold, or when its frame header declares more than ``content_size`` (a
  single-segment frame declaring 100 MiB would make zstd allocate a 100 MiB window);
- a 32 KB zstd frame of RLE blocks that really decompresses to 1 GiB is cut off after
  ``content_size`` bytes when the manifest says less, and, when the manifest says 1 GiB, is refused
  once one unterminated line passes 16 MiB, never buffered whole;
- a real zstd frame compressed with a window past ``ZSTD_MAX_WINDOW`` (16 MiB, or zstd's default
  limit of 128 MiB) is refused naming the file, its window and the limit, by ``records`` and
  ``verify_snapshot``, as is a second frame with such a window after a sound first one (refused by
  the decoder's own bound, before it allocates); frames at the limit, and the reference writer's
  (whose window is within it), read back.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pyarrow as pa
import pytest
import zstandard

from fuzz_property import address_space_limit
from fuzz_seeds import content_of, entries_of_kind, file_key, golden_files, snapshot_with, with_bytes
from schemas.errors import CorruptSnapshotError
from schemas.gym_records import SessionStateRecord
from schemas.manifest import FileEntry
from snapformat import LocalStore, SnapshotStore, verify_snapshot
from snapformat.jsonl import ZSTD_LEVEL, ZSTD_MAX_WINDOW, ZSTD_THRESHOLD
from snapformat.reader import Snapshot

pytestmark = pytest.mark.timeout(60)

CAP = 256 << 20  # address space a read may add: a bomb claims far more, a sound read needs far less
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _training() -> tuple[int, FileEntry, pa.Table]:
    seq, entry = entries_of_kind("training_rows")[-1]
    return seq, entry, pa.ipc.open_file(pa.py_buffer(golden_files()[file_key(seq, entry.path)])).read_all()


def _ipc(table: pa.Table, compression: str | None) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.getvalue()


def _declaring(data: bytes, uncompressed: int) -> bytes:
    """``data`` whose first zstd-compressed buffer declares ``uncompressed`` bytes.

    Each compressed buffer is an int64 length followed by one zstd frame, so the first frame's
    magic finds it without parsing the metadata.
    """
    at = data.index(_ZSTD_MAGIC) - 8
    return data[:at] + struct.pack("<q", uncompressed) + data[at + 8:]


def _bomb_snapshot(data: bytes, entry: FileEntry, seq: int, rows: int, store_root: Path | None = None) -> Snapshot:
    listed = with_bytes(entry, data, batches=1, records=rows)
    if store_root is None:
        return snapshot_with(seq, listed, data, keep=set())
    path = store_root / file_key(seq, entry.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return snapshot_with(seq, listed, data, store=LocalStore(store_root), keep=set())


@pytest.mark.parametrize("declared", [1 << 32, 1 << 62])
@pytest.mark.parametrize("mapped", [False, True], ids=["in-memory", "memory-mapped"])
def test_arrow_buffer_declaring_gigabytes_is_refused_before_allocating(
        declared: int, mapped: bool, tmp_path: Path) -> None:
    seq, entry, table = _training()
    data = _declaring(_ipc(table, "zstd"), declared)
    snap = _bomb_snapshot(data, entry, seq, table.num_rows, tmp_path if mapped else None)
    with address_space_limit(CAP):
        with pytest.raises(CorruptSnapshotError, match=rf"record batch 0: buffer \d+ declares {declared} uncompressed"):
            snap.read_table(entry.path)
        report = verify_snapshot(snap)
    assert [p.file for p in report.problems] == [entry.path]
    assert f"declares {declared} uncompressed bytes" in report.problems[0].message


def test_arrow_batch_declaring_a_huge_length_is_refused() -> None:
    seq, entry, table = _training()
    data = _ipc(table, None)
    # The batch's length is the int64 right after the message's flatbuffer table header; find it
    # as the only int64 equal to the row count inside the batch message's metadata.
    marker = struct.pack("<q", table.num_rows)
    starts = [i for i in range(8, len(data) - 8) if data[i:i + 8] == marker]
    bombs = [data[:i] + struct.pack("<q", 1 << 40) + data[i + 8:] for i in starts]
    assert bombs
    for bomb in bombs:
        snap = _bomb_snapshot(bomb, entry, seq, 1 << 40)
        with address_space_limit(CAP), pytest.raises(CorruptSnapshotError):
            snap.read_table(entry.path)


def _session_part() -> tuple[int, FileEntry]:
    return entries_of_kind("session_state")[0]


def _rle_frame(total: int, byte: bytes, declared_window_log: int = 17) -> bytes:
    """A zstd frame of RLE blocks (128 KiB of ``byte`` per 4-byte block): 32 KB -> 1 GiB."""
    header = _ZSTD_MAGIC + bytes([0x00, (declared_window_log - 10) << 3])  # no content size, a window
    block, blocks = 128 << 10, []
    for start in range(0, total, block):
        size = min(block, total - start)
        last = start + size >= total
        blocks.append(struct.pack("<I", (size << 3) | (1 << 1) | int(last))[:3] + byte)
    return header + b"".join(blocks)


def test_zstd_content_size_beyond_what_the_bytes_can_hold_is_refused_before_decompressing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seq, entry = _session_part()
    frame = _rle_frame(1 << 20, b"a")
    monkeypatch.setattr("zstandard.ZstdDecompressor", None)  # decompressing at all would fail here
    snap = snapshot_with(seq, with_bytes(entry, frame, compression="zstd", content_size=1 << 40), frame)
    with pytest.raises(CorruptSnapshotError, match=rf"content_size {1 << 40} is impossible for {len(frame)} bytes"):
        snap.records(entry.path)


def test_zstd_frame_declaring_more_than_content_size_is_refused_before_decompressing() -> None:
    seq, entry = _session_part()
    content = b"x\n"
    # Single segment: no window descriptor, so the window is the declared 100 MiB.
    frame = _ZSTD_MAGIC + bytes([0xA0]) + struct.pack("<I", 100 << 20) \
        + struct.pack("<I", (len(content) << 3) | 1)[:3] + content
    snap = snapshot_with(seq, with_bytes(entry, frame, compression="zstd", content_size=len(content)), frame)
    with address_space_limit(32 << 20), pytest.raises(
            CorruptSnapshotError, match=rf"frame declares {100 << 20} bytes of content, the manifest says content_size 2"):
        snap.records(entry.path)


def test_zstd_bomb_is_cut_off_at_content_size() -> None:
    seq, entry = _session_part()
    frame = _rle_frame(1 << 30, b"\n")
    assert len(frame) < 40_000
    snap = snapshot_with(seq, with_bytes(entry, frame, compression="zstd", content_size=1000), frame)
    with address_space_limit(CAP), pytest.raises(CorruptSnapshotError, match="decompresses to more than"):
        snap.records(entry.path)


def test_zstd_bomb_of_one_endless_line_is_refused_at_the_line_limit() -> None:
    """A consistent manifest (content_size 1 GiB) still cannot make the reader hold 1 GiB."""
    seq, entry = _session_part()
    frame = _rle_frame(1 << 30, b"a")
    snap = snapshot_with(seq, with_bytes(entry, frame, compression="zstd", content_size=1 << 30), frame)
    with address_space_limit(CAP), pytest.raises(CorruptSnapshotError, match="line 1 is longer than 16777216 bytes"):
        snap.records(entry.path)


def _windowed_frame(content: bytes, window_log: int) -> bytes:
    """One real zstd frame over ``content``, streamed (no content size) with a window of 2^window_log."""
    params = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVEL, window_log=window_log)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as w:
        w.write(content)
    frame = out.getvalue()
    assert zstandard.get_frame_parameters(frame).window_size == 1 << window_log  # the header declares it
    return frame


def _session_snapshot(stored: bytes, content: bytes) -> tuple[Snapshot, FileEntry]:
    seq, entry = _session_part()
    listed = with_bytes(entry, stored, compression="zstd", content_size=len(content))
    return snapshot_with(seq, listed, stored, keep=set()), listed


def _window_refusal(window: int | None) -> str:
    size = "more than" if window is None else f"{window:,} bytes, more than"
    return f"its zstd frame needs a window of {size} the {ZSTD_MAX_WINDOW:,} bytes readers allow"


@pytest.mark.parametrize("window_log", [24, 27])  # the first past the limit; zstd's default decoder limit
def test_zstd_frame_with_a_window_past_the_limit_is_refused(window_log: int) -> None:
    content = content_of(*_session_part())
    snap, entry = _session_snapshot(_windowed_frame(content, window_log), content)
    expected = f"{snap.where(entry)}: {_window_refusal(1 << window_log)}"
    with address_space_limit(CAP), pytest.raises(CorruptSnapshotError) as err:
        snap.records(entry.path)
    assert str(err.value).startswith(expected), str(err.value)
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [entry.path] and problems[0].message.startswith(expected)


def test_a_later_zstd_frame_with_a_large_window_is_refused_by_the_decoder() -> None:
    """Only the first frame's header is checked up front; the decoder's bound stops the next one
    before it allocates its 128 MiB window (the cap is below that, and the message says why)."""
    content = content_of(*_session_part())
    cut = content.index(b"\n") + 1
    stored = _windowed_frame(content[:cut], 21) + _windowed_frame(content[cut:], 27)
    snap, entry = _session_snapshot(stored, content)
    with address_space_limit(64 << 20), pytest.raises(CorruptSnapshotError) as err:
        snap.records(entry.path)
    assert str(err.value).startswith(f"{snap.where(entry)}: {_window_refusal(None)}"), str(err.value)


def test_zstd_frames_within_the_window_limit_read(tmp_path: Path) -> None:
    seq, golden = _session_part()
    content = content_of(seq, golden)
    expected = snapshot_with(seq, golden, golden_files()[file_key(seq, golden.path)], keep=set()).records(golden.path)
    assert expected
    for window_log in (10, 21, 23):  # 23: exactly ZSTD_MAX_WINDOW
        snap, entry = _session_snapshot(_windowed_frame(content, window_log), content)
        with address_space_limit(CAP):
            assert snap.records(entry.path) == expected
    # The reference writer's frames are within the limit: a part past the zstd threshold.
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    records = [SessionStateRecord(session_id=f"s{i}", resource="tools", state_revision=i, rollout_id=f"p{i}",
                                  state={"pad": "x" * 200}) for i in range(ZSTD_THRESHOLD // 100)]
    written = draft.part("gym/resource/tools").write_records("sessions", "session_state", records)
    draft.publish()
    assert written.compression == "zstd"
    stored = (tmp_path / "store" / "snapshots" / draft.snapshot_id / written.path).read_bytes()
    assert zstandard.get_frame_parameters(stored).window_size <= ZSTD_MAX_WINDOW
    assert store.open(1).records(written.path) == records
