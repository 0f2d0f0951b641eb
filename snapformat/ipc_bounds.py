"""What an Arrow IPC row part makes Arrow allocate, bounded before Arrow reads a batch.

An uncompressed row part costs nothing to open: every buffer Arrow hands out is a bounds-checked
slice of the (memory-mapped) file. A part written with Arrow's buffer compression (``ZSTD`` or
``LZ4_FRAME``, which readers must support) is different: for each buffer Arrow allocates the
uncompressed length written in the buffer's first 8 bytes, *then* decompresses into it. That length
is untrusted, so a 2 KB file whose buffers each claim 4 GiB makes Arrow allocate gigabytes before
it finds the data short (an Arrow bomb). Arrow has no option to cap it, so this module reads the
file's footer and the metadata of every batch it lists (flatbuffers, decoded here with a bounds
check on every read) and refuses a buffer whose declared length no codec could produce from its
compressed bytes, naming the batch and the buffer.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from schemas.errors import CorruptSnapshotError
from snapformat.jsonl import ZSTD_MAX_EXPANSION

_MAGIC = b"ARROW1"
_CONTINUATION = 0xFFFFFFFF
_HEADER_DICTIONARY_BATCH = 2
_HEADER_RECORD_BATCH = 3
_BLOCK_SIZE = 24  # struct Block { offset: long; metaDataLength: int; (pad) ; bodyLength: long }
_BUFFER_SIZE = 16  # struct Buffer { offset: long; length: long }
_PREFIX = 8  # int64 uncompressed length in front of each compressed buffer; -1: stored as is


class _Flatbuffer:
    """Tables of one flatbuffer that lies in ``view[start:end]``; every read is bounds-checked."""

    def __init__(self, view: memoryview, start: int, end: int, where: str) -> None:
        self.view, self.start, self.end, self.where = view, start, end, where

    def read(self, fmt: str, pos: int) -> int:
        if pos < self.start or pos + struct.calcsize(fmt) > self.end:
            raise CorruptSnapshotError(f"{self.where}: Arrow metadata points outside itself (at byte {pos})")
        return struct.unpack_from(fmt, self.view, pos)[0]

    def root(self) -> int:
        return self.start + self.read("<I", self.start)

    def field(self, table: int, index: int) -> int | None:
        """Position of field ``index`` of the table at ``table``, or None when it is absent."""
        vtable = table - self.read("<i", table)
        slot = 4 + 2 * index
        if slot + 2 > self.read("<H", vtable):
            return None
        offset = self.read("<H", vtable + slot)
        return table + offset if offset else None

    def target(self, table: int, index: int) -> int | None:
        """Where the table or vector that field ``index`` refers to begins, or None."""
        pos = self.field(table, index)
        return None if pos is None else pos + self.read("<I", pos)

    def vector(self, table: int, index: int, item_size: int) -> tuple[int, int]:
        """``(first item position, item count)`` of a vector of structs; ``(0, 0)`` when absent."""
        pos = self.target(table, index)
        if pos is None:
            return 0, 0
        count = self.read("<I", pos)
        if pos + 4 + count * item_size > self.end:
            raise CorruptSnapshotError(f"{self.where}: Arrow metadata lists {count} items past its end")
        return pos + 4, count


class Block(NamedTuple):
    """One block of an IPC file's footer: a message and its body (``offset`` from the file's start)."""

    label: str  # "dictionary batch" or "record batch"
    index: int
    offset: int
    meta_len: int
    body_len: int

    @property
    def end(self) -> int:
        return self.offset + self.meta_len + self.body_len


def footer_blocks(view: memoryview, where: str) -> list[Block] | None:
    """Every block the footer lists (dictionary batches first, then record batches, each in footer
    order), read with a bounds check on every read; None when ``view`` is not an IPC file at all or
    its footer length is impossible (Arrow itself then refuses it)."""
    size = len(view)
    if size < 2 * len(_MAGIC) + 6 or bytes(view[:6]) != _MAGIC or bytes(view[-6:]) != _MAGIC:
        return None
    footer_len = struct.unpack_from("<i", view, size - 10)[0]
    footer_start = size - 10 - footer_len
    if footer_len <= 0 or footer_start < 8:
        return None
    footer = _Flatbuffer(view, footer_start, size - 10, f"{where}: footer")
    root = footer.root()
    blocks = []
    for field, label in ((2, "dictionary batch"), (3, "record batch")):
        first, count = footer.vector(root, field, _BLOCK_SIZE)
        for i in range(count):
            block = first + i * _BLOCK_SIZE
            blocks.append(Block(label, i, footer.read("<q", block), footer.read("<i", block + 8),
                                footer.read("<q", block + 16)))
    return blocks


def check_block(view: memoryview, block: Block, where: str) -> None:
    """Refuse ``block`` if it lies outside the file or one of its compressed buffers declares an
    impossible length (reads only the block's own metadata)."""
    offset, meta_len, body_len = block.offset, block.meta_len, block.body_len
    where = f"{where}: {block.label} {block.index}"
    if offset < 0 or meta_len < 8 or body_len < 0 or block.end > len(view):
        raise CorruptSnapshotError(
            f"{where}: lies outside the file (offset {offset}, metadata {meta_len} and body {body_len} bytes, "
            f"file {len(view)} bytes)")
    first = struct.unpack_from("<I", view, offset)[0]
    fb_start, fb_len = (offset + 8, struct.unpack_from("<i", view, offset + 4)[0]) if first == _CONTINUATION \
        else (offset + 4, first)
    if fb_len <= 0 or fb_start + fb_len > offset + meta_len:
        raise CorruptSnapshotError(f"{where}: metadata of {fb_len} bytes does not fit its block of {meta_len}")
    message = _Flatbuffer(view, fb_start, fb_start + fb_len, where)
    root = message.root()
    kind_pos = message.field(root, 1)
    kind = 0 if kind_pos is None else message.read("<B", kind_pos)
    header = message.target(root, 2)
    if header is not None and kind == _HEADER_DICTIONARY_BATCH:
        header = message.target(header, 1)  # the dictionary's own record batch
    elif kind != _HEADER_RECORD_BATCH:
        return  # a schema or tensor where a batch should be: Arrow refuses it itself
    if header is None or message.target(header, 3) is None:
        return  # no body compression: every buffer is a slice of the file
    _check_buffers(view, message, header, offset + meta_len, body_len, where)


def _check_buffers(view: memoryview, message: _Flatbuffer, batch: int, body: int, body_len: int,
                   where: str) -> None:
    first, count = message.vector(batch, 2, _BUFFER_SIZE)
    for j in range(count):
        start = message.read("<q", first + j * _BUFFER_SIZE)
        length = message.read("<q", first + j * _BUFFER_SIZE + 8)
        if length == 0:
            continue  # an absent buffer (no nulls, say) carries no prefix
        if start < 0 or length < _PREFIX or start + length > body_len:
            raise CorruptSnapshotError(
                f"{where}: buffer {j} (offset {start}, {length} bytes) does not lie in the batch body of "
                f"{body_len} bytes")
        declared = struct.unpack_from("<q", view, body + start)[0]
        limit = ZSTD_MAX_EXPANSION * (length - _PREFIX)
        if declared > limit:
            raise CorruptSnapshotError(
                f"{where}: buffer {j} declares {declared} uncompressed bytes from {length - _PREFIX} compressed "
                f"bytes (expected at most {limit}: no codec expands more than {ZSTD_MAX_EXPANSION}-fold)")
