"""Seeds from the golden store ``spec/examples/store-v1.1``, and a store in memory that serves them.

Every fuzzer starts from real files a writer produced, so mutations land in the parsers' deep paths
instead of failing at the first byte. ``store-v1.1`` is the golden store that holds a file of every
kind this format parses itself (the record kinds of the Gym parts of the 1.0/1.1 layout, which every
reader keeps reading, the data plane's and the controller's parts, ``dataplane_rows``); the 1.2
writer's Gym parts are Gym's own files instead, fuzzed from ``store-v1.2`` by
``test_fuzz_gym_files.py``. The store in memory swaps one file per example without touching disk,
and refuses every write: a reader must never write.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import BinaryIO

import msgspec
import zstandard

from schemas.manifest import CommitRecord, FileEntry, Manifest
from snapformat import layout
from snapformat.checksum import checksum_bytes
from snapformat.reader import Snapshot
from snapformat.store.base import ObjectInfo, Store

GOLDEN = Path(__file__).resolve().parents[2] / "spec" / "examples" / "store-v1.1"
SEQUENCES = (1, 2)


@cache
def golden_files() -> Mapping[str, bytes]:
    """Every file of the golden store by key (``_commits/...``, ``snapshots/<id>/...``)."""
    return {p.relative_to(GOLDEN).as_posix(): p.read_bytes() for p in sorted(GOLDEN.rglob("*")) if p.is_file()}


@cache
def golden_commit(sequence: int) -> CommitRecord:
    return msgspec.json.decode(golden_files()[layout.commit_key(sequence)], type=CommitRecord)


@cache
def golden_manifest(sequence: int) -> Manifest:
    commit = golden_commit(sequence)
    return msgspec.json.decode(golden_files()[f"{layout.snapshot_dir(commit.snapshot_id)}/manifest.json"], type=Manifest)


def file_key(sequence: int, path: str) -> str:
    return layout.file_key(golden_commit(sequence).snapshot_id, path)


def entries_of_kind(kind: str) -> list[tuple[int, FileEntry]]:
    """(sequence, entry) of every golden file of ``kind``, both snapshots."""
    return [(seq, f) for seq in SEQUENCES for f in golden_manifest(seq).files if f.kind == kind]


def content_of(sequence: int, entry: FileEntry) -> bytes:
    """The file's content: its bytes, decompressed when the entry says zstd."""
    data = golden_files()[file_key(sequence, entry.path)]
    if entry.compression != "zstd":
        return data
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=entry.content_size or 0)


def zstd_frame(content: bytes) -> bytes:
    """One zstd frame over ``content``, as the reference writer makes it (level 3, streamed)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as w:
        w.write(content)
    return out.getvalue()


def with_bytes(entry: FileEntry, data: bytes, **changes: object) -> FileEntry:
    """``entry`` made consistent with ``data`` (size and checksum), so the parser is reached."""
    return msgspec.structs.replace(entry, size=len(data), checksum=checksum_bytes(data), **changes)


class MemoryStore(Store):
    """A read-only store over a dict of keys to bytes."""

    def __init__(self, files: Mapping[str, bytes], url: str = "mem://golden") -> None:
        self.url = url
        self.files = dict(files)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        try:
            data = self.files[key]
        except KeyError:
            raise FileNotFoundError(self.display(key)) from None
        return data if limit is None else data[:limit + 1]

    def open_read(self, key: str) -> BinaryIO:
        return io.BytesIO(self.read_bytes(key))

    def exists(self, key: str) -> bool:
        return key in self.files

    def info(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self.read_bytes(key)), 0.0)

    def list_names(self, prefix: str) -> list[str]:
        start = f"{prefix}/" if prefix else ""
        return sorted({k[len(start):].split("/", 1)[0] for k in self.files if k.startswith(start)})

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        for key, data in self.files.items():
            if key.startswith(f"{prefix}/"):
                yield ObjectInfo(key, len(data), 0.0)

    def _refuse(self, *args: object) -> None:
        raise AssertionError(f"a reader tried to write to the store: {args!r}")

    open_write = put_bytes = create_exclusive = delete = delete_tree = _refuse  # type: ignore[assignment]


def store_with(changes: Mapping[str, bytes | None]) -> MemoryStore:
    """The golden store with some keys replaced (``None`` removes the key)."""
    files = dict(golden_files())
    for key, data in changes.items():
        if data is None:
            files.pop(key, None)
        else:
            files[key] = data
    return MemoryStore(files)


def snapshot_with(sequence: int, entry: FileEntry, data: bytes, store: Store | None = None,
                  keep: set[str] | None = None) -> Snapshot:
    """Golden snapshot ``sequence`` whose file ``entry.path`` holds ``data`` and is listed as ``entry``.

    ``keep`` lists only those other files (verifying a whole snapshot per example is too slow);
    None keeps them all.
    """
    manifest = golden_manifest(sequence)
    files = [entry if f.path == entry.path else f for f in manifest.files
             if keep is None or f.path == entry.path or f.path in keep]
    if all(f.path != entry.path for f in manifest.files):
        files.append(entry)
    if store is None:
        store = store_with({file_key(sequence, entry.path): data})
    return Snapshot(store, golden_commit(sequence), msgspec.structs.replace(manifest, files=files))


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` as a new inode: a reader may still map the old one (truncating it would SIGBUS)."""
    tmp = path.with_name(f".fuzz-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
