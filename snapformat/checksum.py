"""File checksums: ``xxh128:<hex>`` (xxHash XXH3-128) over the stored bytes.

XXH3 runs at ~9 GB/s here against ~1.3 GB/s for SHA-256, so verifying what is read costs almost
nothing next to the read; it guards against corruption, not against a malicious writer (the spec's
Security section says so). ``sha256:`` is accepted too, reserved for content-addressed files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import BinaryIO

import xxhash

from schemas.errors import CorruptSnapshotError
from snapformat.store.base import WriteStream

ALGORITHM = "xxh128"
_CHUNK = 8 << 20


def new_hasher(algorithm: str = ALGORITHM):
    if algorithm == "xxh128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CorruptSnapshotError(f"unknown checksum algorithm {algorithm!r} (expected xxh128 or sha256)")


def checksum_bytes(data, algorithm: str = ALGORITHM) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return f"{algorithm}:{h.hexdigest()}"


def checksum_stream(fh: BinaryIO, expected: str, progress: Callable[[int], None] | None = None) -> str:
    """Checksum of everything ``fh`` yields, with the algorithm that ``expected`` names."""
    algorithm = expected.partition(":")[0]
    h = new_hasher(algorithm)
    while chunk := fh.read(_CHUNK):
        h.update(chunk)
        if progress:
            progress(len(chunk))
    return f"{algorithm}:{h.hexdigest()}"


def check(where: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise CorruptSnapshotError(f"{where}: checksum mismatch (manifest says {expected}, file has {actual})")


class HashingWriter(WriteStream):
    """Wraps a binary writer: counts bytes and checksums them on the way to disk."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.size = 0
        self._hasher = new_hasher()
        self.closed = False

    def write(self, data) -> int:
        self._hasher.update(data)
        n = self.raw.write(data)
        self.size += len(memoryview(data).cast("B")) if not isinstance(data, bytes) else len(data)
        return n

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        # pyarrow closes the sink it was given; the part writer finishes the raw file itself.
        self.closed = True

    @property
    def checksum(self) -> str:
        return f"{ALGORITHM}:{self._hasher.hexdigest()}"
