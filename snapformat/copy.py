"""Copying snapshots between stores (local disk <-> S3, either direction).

A copy keeps the snapshot's id, sequence and every byte (so every checksum, the manifest's and
the part manifests' too, stays valid) and publishes it at the destination by the destination's
own commit rule: all files first, each checked against the source manifest as it streams, then
the create-only commit record. A crash mid-copy leaves an unlisted draft at the destination.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from schemas.errors import CommitConflictError, CorruptSnapshotError, InvalidPathError
from schemas.manifest import LatestHint
from snapformat import discovery, jsonl, layout
from snapformat.checksum import checksum_stream, new_hasher
from snapformat.reader import Snapshot, open_sequence
from snapformat.snapshot_store import SnapshotStore
from snapformat.store import Store

_CHUNK = 8 << 20


class CopyResult(msgspec.Struct, frozen=True):
    snapshot_id: str
    sequence: int
    url: str
    bytes: int
    skipped: bool  # already at the destination (same id at the same sequence)


def _stream(src: Snapshot, key: str, dst: Store, expected_size: int, expected_checksum: str,
            progress: Callable[[int], None] | None) -> None:
    where = src.store.display(key)
    hasher = new_hasher(expected_checksum.partition(":")[0])
    size = 0
    try:
        sink = dst.open_write(key)
    except FileExistsError:  # local disk: an earlier, interrupted copy of this snapshot left it
        _check_leftover(dst, key, expected_size, expected_checksum)
        if progress:
            progress(expected_size)
        return
    with src.store.open_read(key) as fin, sink as fout:
        while chunk := fin.read(_CHUNK):
            hasher.update(chunk)
            fout.write(chunk)
            size += len(chunk)
            if progress:
                progress(len(chunk))
        actual = f"{expected_checksum.partition(':')[0]}:{hasher.hexdigest()}"
        if size != expected_size or actual != expected_checksum:
            fout.abort()
            raise CorruptSnapshotError(f"{where}: source is {size} bytes / {actual}, its manifest says "
                                       f"{expected_size} / {expected_checksum}; nothing was published at {dst.url}")


def _check_leftover(dst: Store, key: str, expected_size: int, expected_checksum: str) -> None:
    """Keep a file of the unpublished destination folder that is byte for byte what the manifest
    promises (a retry after a failed copy); name anything else rather than delete it (another copy
    of the same snapshot may be writing it right now)."""
    size = dst.info(key).size
    actual = ""
    if size == expected_size:
        with dst.open_read(key) as fh:
            actual = checksum_stream(fh, expected_checksum)
    if actual != expected_checksum:
        folder = dst.display("/".join(key.split("/")[:2]))  # snapshots/<snapshot_id>
        raise CorruptSnapshotError(
            f"{dst.display(key)}: left by an interrupted copy and not what the manifest says ({size} bytes, "
            f"expected {expected_size} / {expected_checksum}); nothing was published: delete the unpublished "
            f"folder {folder} (or run gc on {dst.url}) and copy again")


def copy_snapshot(src: Snapshot, dst_url: str | Store, progress: Callable[[int], None] | None = None) -> CopyResult:
    """Copy one published snapshot into the store ``dst_url`` and publish it there."""
    dst = SnapshotStore(dst_url)
    seq, sid = src.sequence, src.manifest.snapshot_id
    url = dst.store.display(layout.snapshot_dir(sid))
    try:
        existing = discovery.read_commit(dst.store, seq)
    except Exception:  # noqa: BLE001 - absent (or unreadable, which the create below settles)
        existing = None
    if existing is not None:
        if existing.snapshot_id == sid:
            return CopyResult(sid, seq, url, 0, skipped=True)
        raise CommitConflictError(f"{dst.url}: sequence {seq} already holds {existing.snapshot_id}, not {sid}")
    dst._ensure_marker()
    total = 0
    for f in src.manifest.files:
        _stream(src, src.key(f), dst.store, f.size, f.checksum, progress)
        total += f.size
    manifest_key = f"{layout.snapshot_dir(sid)}/{layout.MANIFEST_NAME}"
    _stream(src, manifest_key, dst.store, src.commit.manifest_size, src.commit.manifest_checksum, progress)
    newest = discovery.latest_sequence(dst.store)
    if newest is None or newest < seq:
        # Hint first: a copy may leave a gap below ``seq``, which the forward probe cannot cross.
        # A hint naming a not-yet-created commit only sends readers to the listing fallback.
        dst.store.put_bytes(layout.HINT_KEY, msgspec.json.encode(LatestHint(sequence=seq, snapshot_id=sid)))
    dst.store.create_exclusive(layout.commit_key(seq), jsonl.encode_json(src.commit))
    return CopyResult(sid, seq, url, total + src.commit.manifest_size, skipped=False)


def copy_store(src_url: str, dst_url: str, progress: Callable[[int], None] | None = None) -> list[CopyResult]:
    """Copy every published snapshot of a store, oldest first (skipping those already there)."""
    src = SnapshotStore(src_url)
    src.check_marker()
    dst = SnapshotStore(dst_url).store  # opened once: an S3 client costs ~0.3 s of CPU to create
    return [copy_snapshot(open_sequence(src.store, c.sequence), dst, progress) for c in reversed(src.list())]


def destination_store(dst: str, snapshot_id: str | None) -> str:
    """``dst`` may be a store or, for one snapshot, that snapshot's location in the destination."""
    try:
        store_url, dst_id = layout.split_snapshot_url(dst)
    except InvalidPathError:
        return dst
    if snapshot_id is not None and dst_id != snapshot_id:
        raise InvalidPathError(f"{dst}: a copy keeps the snapshot id; expected .../snapshots/{snapshot_id}")
    return store_url
