"""JSON-lines parts: one msgspec-encoded record per line, plain or as one zstd frame.

Writers compress when a part grows past :data:`ZSTD_THRESHOLD` uncompressed bytes (the spec's
rule): small indexes stay readable with ``cat``, large ones shrink ~20x at ~1 GB/s. Readers decode
through prebuilt typed decoders, never trust a size they have not checked against the manifest,
and name the file, line and field of the first bad record.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import msgspec
import zstandard

from schemas.errors import CorruptSnapshotError, InvalidRecordError, SnapshotError
from schemas.version import check_record_version

ZSTD_THRESHOLD = 256 * 1024
ZSTD_LEVEL = 3
MAX_LINE = 16 << 20
#: The most any zstd frame expands, whatever its header claims: a block yields at most 128 KiB and
#: costs at least 4 bytes (a 3-byte header and the byte an RLE block repeats). A ``content_size``
#: beyond this many times the stored size is impossible and is refused before decompressing. LZ4
#: (Arrow's other codec) expands at most ~255-fold, so the bound holds for it too.
ZSTD_MAX_EXPANSION = 32768
#: The largest zstd window a reader decodes with (window log 23). A frame's header says how much
#: history its decoder must keep, and a streaming decoder allocates that much before the first byte
#: of output: zstd's own default limit, 128 MiB, would let a 20-byte frame claim 128 MiB per open
#: reader. The reference writer (level 3, streamed) uses 2 MiB; every level up to 19 uses at most
#: 8 MiB; only levels 20-22 and long-distance matching use more, and writers MUST NOT.
ZSTD_MAX_WINDOW = 8 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 8 << 20
_ENCODE_BATCH = 4096

_encoder = msgspec.json.Encoder()

#: What msgspec raises for bytes it cannot decode as JSON, besides ``DecodeError``: invalid UTF-8
#: inside a string is a ``UnicodeDecodeError``, nesting past its recursion limit (``[[[[...``) a
#: ``RecursionError``. Untrusted bytes must end in a typed error, so all three are caught.
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def _undecodable(exc: BaseException) -> str:
    """Why bytes are not a JSON document, in words that do not point at the wrong position."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not valid JSON: a string is not valid UTF-8 ({exc.reason})"
    if isinstance(exc, RecursionError):
        return "not valid JSON: values nested deeper than the decoder allows"
    return f"not valid JSON: {exc}"


_decoders: dict[Any, msgspec.json.Decoder] = {}
_decoders_lock = threading.Lock()


def decoder(record_type: Any) -> msgspec.json.Decoder:
    """The JSON decoder of ``record_type``, built once per process and shared by every thread.

    Built under one lock: msgspec 0.22.0 fills a Struct type's decoding tables the first time a
    decoder of it is built, and a thread that builds or uses one meanwhile can see them half filled
    and crash the whole process (SIGSEGV in ``json_decode_struct_map_inner``). Gym servers hosting
    several participants hit it when their restores ran on threads at once
    (``tests/snapformat/test_decoder_threads.py`` reproduces it without the lock).
    """
    found = _decoders.get(record_type)
    if found is None:
        with _decoders_lock:
            found = _decoders.get(record_type)
            if found is None:
                found = _decoders[record_type] = msgspec.json.Decoder(record_type)
    return found


def encode_lines(records: Iterable[Any]) -> Iterator[bytes]:
    """Encoded JSON lines, a few thousand records per chunk."""
    batch: list[Any] = []
    for rec in records:
        batch.append(rec)
        if len(batch) >= _ENCODE_BATCH:
            yield _encoder.encode_lines(batch)
            batch = []
    if batch:
        yield _encoder.encode_lines(batch)


class WrittenJsonLines(msgspec.Struct, frozen=True):
    compression: str
    records: int
    content_size: int


def write_lines(
    open_file: Callable[[str], BinaryIO],
    records: Iterable[Any],
    compress: str = "auto",
) -> WrittenJsonLines:
    """Stream ``records`` into a file made by ``open_file(compression)``.

    ``compress`` is ``"auto"`` (zstd once the content passes the threshold), ``"zstd"`` or
    ``"none"``. Memory stays bounded by the threshold plus one encoded chunk.
    """
    if compress not in ("auto", "zstd", "none"):
        raise InvalidRecordError(f"compress: {compress!r} is not auto, zstd or none")
    chunks = encode_lines(records)
    pending: list[bytes] = []
    pending_size = 0
    count = 0
    if compress == "auto":
        for chunk in chunks:
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size > ZSTD_THRESHOLD:
                compress = "zstd"
                break
        else:
            compress = "none"
    fh = open_file(compress)
    content = 0
    try:
        if compress == "zstd":
            sink = zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(fh, closefd=False)
        else:
            sink = fh
        for chunk in _chain(pending, chunks):
            sink.write(chunk)
            content += len(chunk)
            count += chunk.count(b"\n")
        if compress == "zstd":
            sink.flush(zstandard.FLUSH_FRAME)
    except BaseException:
        abort = getattr(fh, "abort", None)
        if abort:
            abort()
        raise
    return WrittenJsonLines(compress, count, content)


def _chain(first: list[bytes], rest: Iterator[bytes]) -> Iterator[bytes]:
    yield from first
    yield from rest


def _content_stream(data: bytes, compression: str, content_size: int | None, where: str) -> BinaryIO:
    if compression == "none":
        return io.BytesIO(data)
    if compression != "zstd":
        raise CorruptSnapshotError(f"{where}: unknown compression {compression!r} (expected none or zstd)")
    if content_size is None:
        raise CorruptSnapshotError(f"{where}: zstd part without content_size in the manifest")
    _check_zstd_sizes(data, content_size, where)
    return _BoundedZstd(data, content_size, where)


def _check_zstd_sizes(data: bytes, content_size: int, where: str) -> None:
    """Refuse sizes that these bytes cannot honour, before a byte is decompressed.

    The frame's own content size is never trusted to be right, but one larger than the manifest's
    ``content_size`` cannot be right either (zstd checks it once the frame ends), so it is refused
    up front instead of after decompressing up to ``content_size``. So is a window past
    :data:`ZSTD_MAX_WINDOW`, with a message that says so (the decoder would refuse it too, in
    zstd's words).
    """
    limit = ZSTD_MAX_EXPANSION * len(data)
    if content_size > limit:
        raise CorruptSnapshotError(
            f"{where}: content_size {content_size} is impossible for {len(data)} bytes of zstd data "
            f"(expected at most {limit}: zstd expands at most {ZSTD_MAX_EXPANSION}-fold)")
    if not data.startswith(_ZSTD_MAGIC):
        return  # a skippable frame first, or no zstd at all: the decoder decides
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        return  # a damaged header: the decoder names it
    declared = params.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > content_size:
        raise CorruptSnapshotError(
            f"{where}: its zstd frame declares {declared} bytes of content, the manifest says content_size "
            f"{content_size}")
    if params.window_size > ZSTD_MAX_WINDOW:
        raise CorruptSnapshotError(f"{where}: {_window_too_large(params.window_size)}")


def _window_too_large(window: int | None) -> str:
    size = "more than" if window is None else f"{window:,} bytes, more than"
    return (f"its zstd frame needs a window of {size} the {ZSTD_MAX_WINDOW:,} bytes readers allow "
            "(expected a frame compressed at zstd level 19 or below, without long-distance matching)")


class _BoundedZstd(io.RawIOBase):
    """Decompresses at most ``limit`` bytes (the manifest's content_size) with a window of at most
    :data:`ZSTD_MAX_WINDOW`: no zstd bombs, neither of output nor of decoder memory."""

    def __init__(self, data: bytes, limit: int, where: str) -> None:
        # The window bound also covers frames after the first, whose headers were not checked up front.
        decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        self._reader = decompressor.stream_reader(io.BytesIO(data), read_across_frames=True)
        self._left = limit
        self._where = where

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        want = _CHUNK if n is None or n < 0 else n
        try:
            out = self._reader.read(min(want, self._left + 1))
        except zstandard.ZstdError as exc:
            if "too much memory" in str(exc):  # zstd's words for a window past max_window_size
                raise CorruptSnapshotError(f"{self._where}: {_window_too_large(None)}") from None
            raise CorruptSnapshotError(f"{self._where}: zstd data is corrupt: {exc}") from None
        self._left -= len(out)
        if self._left < 0:
            raise CorruptSnapshotError(f"{self._where}: decompresses to more than the manifest's content_size")
        return out


def iter_records(
    data: bytes,
    record_type: Any,
    where: str,
    compression: str = "none",
    content_size: int | None = None,
    check_version: bool = True,
) -> Iterator[Any]:
    """Decode every line of a JSON-lines part, raising a typed error naming file and line."""
    stream = _content_stream(data, compression, content_size, where)
    dec = decoder(record_type)
    tail = b""
    line_no = 0
    total = 0
    while True:
        chunk = stream.read(_CHUNK)
        total += len(chunk)
        if not chunk:
            break
        buf = tail + chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) > MAX_LINE:
                raise CorruptSnapshotError(f"{where}: line {line_no + 1} is longer than {MAX_LINE} bytes")
            tail = buf
            continue
        complete, tail = buf[: cut + 1], buf[cut + 1 :]
        recs = _decode_block(dec, complete, where, line_no)
        for i, rec in enumerate(recs):
            if check_version:
                check_record_version(rec.schema_version, f"{where}: line {line_no + i + 1}")
        line_no += len(recs)
        yield from recs
    if compression == "zstd" and content_size is not None and total != content_size:
        raise CorruptSnapshotError(
            f"{where}: decompressed {total} bytes, the manifest says content_size {content_size}"
        )
    if tail.strip():
        raise CorruptSnapshotError(f"{where}: line {line_no + 1} is not terminated by a newline (truncated?)")


def _decode_block(dec: msgspec.json.Decoder, block: bytes, where: str, first_line: int) -> list[Any]:
    try:
        return dec.decode_lines(block)
    except (*_UNDECODABLE, SnapshotError, ValueError):
        pass
    # Find the first bad line to name it (slow path, only on error).
    for i, line in enumerate(block.split(b"\n")):
        if not line.strip():
            continue
        try:
            dec.decode(line)
        except msgspec.ValidationError as exc:
            _refuse_newer_version(line, f"{where}: line {first_line + i + 1}")
            raise InvalidRecordError(f"{where}: line {first_line + i + 1}: {exc}") from None
        except _UNDECODABLE as exc:
            raise CorruptSnapshotError(f"{where}: line {first_line + i + 1}: {_undecodable(exc)}") from None
    raise CorruptSnapshotError(f"{where}: lines {first_line + 1}.. could not be decoded")


class _Versioned(msgspec.Struct):
    schema_version: Any = None


def _refuse_newer_version(line: bytes, where: str) -> None:
    """A line that does not fit its record type but says it is of a newer version is refused as
    that (naming both versions), not by the field that the newer version changed."""
    try:
        version = msgspec.json.decode(line, type=_Versioned).schema_version
    except (*_UNDECODABLE, msgspec.ValidationError):
        return  # not even JSON of an object: the caller reports the line as it is
    if isinstance(version, int) and not isinstance(version, bool):
        check_record_version(version, where)


def decode_json(data: bytes, record_type: Any, where: str) -> Any:
    """Decode one JSON document (manifest, commit record, loader place) with a typed error."""
    try:
        return decoder(record_type).decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidRecordError(f"{where}: {exc}") from None
    except _UNDECODABLE as exc:
        raise CorruptSnapshotError(f"{where}: {_undecodable(exc)}") from None


def encode_json(record: Any) -> bytes:
    return msgspec.json.format(_encoder.encode(record), indent=1) + b"\n"
