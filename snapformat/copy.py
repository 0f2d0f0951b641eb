"""Copying snapshots between stores (local disk <-> S3, either direction).

A copy keeps the snapshot's id, sequence and every byte (so every checksum, the manifest's and
the part manifests' too, stays valid) and publishes it at the destination by the destination's
own commit rule, a writer's steps:

1. Each shared object the manifest names, once (however many entries or snapshots of the copy
   name it): if the destination holds it with the right size and bytes that hash to its name, it
   is not copied but its age is refreshed (a concurrent GC at the destination then keeps it until
   the copy publishes, as :func:`~snapformat.objects.put_object` does for a writer); otherwise the
   source's bytes, checked against the name, are written there (an object whose bytes do not hash
   to its name is never trusted for its name: a damaged one is replaced). *Crash: objects no
   manifest names, swept by GC after the grace period.*
2. The snapshot folder's own files, each checked against the source manifest as it streams.
   *Crash: an unlisted draft at the destination, swept by GC.*
3. ``manifest.json``, the hint (when the copy is the newest), then the create-only commit record.
   *Crash before the commit: as 2.*

A copy publishes within the grace period of its first object write (the writer rule of SPEC
§14.2): an object checked more than :data:`RECHECK_AFTER_S` ago in the same run is checked (and
refreshed) again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import msgspec

from schemas.errors import CommitConflictError, CorruptSnapshotError, InvalidPathError
from schemas.manifest import FileEntry, LatestHint
from snapformat import discovery, jsonl, layout
from snapformat.checksum import checksum_stream, new_hasher
from snapformat.objects import object_name, put_object
from snapformat.reader import Snapshot, open_sequence
from snapformat.snapshot_store import SnapshotStore
from snapformat.store import Store

_CHUNK = 8 << 20
#: An object a run of copies checked (or wrote) this long ago is checked and refreshed again before
#: another snapshot that names it is published: far below any sensible grace period (hours).
RECHECK_AFTER_S = 600.0


class CopyResult(msgspec.Struct, frozen=True):
    snapshot_id: str
    sequence: int
    url: str
    bytes: int  # bytes written at the destination (files, manifest and objects copied)
    skipped: bool  # already at the destination (same id at the same sequence)
    objects_copied: int = 0  # shared objects written at the destination
    objects_present: int = 0  # already there with bytes that hash to their name: checked, not copied
    objects_replaced: int = 0  # there, but not what their name says: replaced by the source's bytes
    objects_reused: int = 0  # handled already by this run of copies (for an earlier snapshot): not looked at again
    object_bytes: int = 0  # bytes of the objects copied or replaced


class ObjectsDone:
    """The objects a run of copies into one destination has checked or written, and when: each is
    handled once per run (see :data:`RECHECK_AFTER_S`)."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def fresh(self, name: str) -> bool:
        at = self._at.get(name)
        return at is not None and time.monotonic() - at < RECHECK_AFTER_S

    def add(self, name: str) -> None:
        self._at[name] = time.monotonic()


def _refresh(dst: Store, key: str, data: bytes) -> None:
    """Make an object that is already at the destination young again, so that a GC running there
    keeps it until this copy publishes: the same bytes put again, as a writer does
    (:func:`~snapformat.objects.put_object`); on local disk that put and GC's look-and-delete exclude
    each other (:meth:`~snapformat.store.Store.delete_if_older`), which a bare ``utime`` would not."""
    dst.put_bytes(key, data)


def _copy_object(src: Snapshot, entry: FileEntry, dst: Store,
                 progress: Callable[[int], None] | None) -> tuple[Literal["copied", "present", "replaced"], int]:
    """Step 1 of the module docstring for the object ``entry`` names; returns what was done and the
    bytes written."""
    name = entry.object or ""
    key = layout.object_key(name)
    try:
        held = dst.info(key).size
    except FileNotFoundError:
        held = None
    if held == entry.size:
        data = dst.read_bytes(key, limit=entry.size)
        if len(data) == entry.size and object_name(data) == name:
            _refresh(dst, key, data)
            if progress:
                progress(entry.size)
            return "present", 0
    where = src.where(entry)
    try:
        data = src.store.read_bytes(key, limit=entry.size)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{where}: missing at the source; nothing was published at {dst.url}") from None
    actual = object_name(data)
    if len(data) != entry.size or actual != name:
        raise CorruptSnapshotError(
            f"{where}: source object is {len(data)} bytes hashing to {actual}, not {entry.size} bytes hashing to "
            f"its name; nothing was published at {dst.url}")
    put_object(dst, data, name=name)
    if progress:
        progress(entry.size)
    return ("copied" if held is None else "replaced"), entry.size


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


def copy_snapshot(src: Snapshot, dst_url: str | Store, progress: Callable[[int], None] | None = None,
                  objects_done: ObjectsDone | None = None) -> CopyResult:
    """Copy one published snapshot into the store ``dst_url`` and publish it there (steps in the
    module docstring). ``objects_done`` carries what earlier copies of the same run into the same
    destination already handled (:func:`copy_store` passes one)."""
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
    done = ObjectsDone() if objects_done is None else objects_done
    counts = {"copied": 0, "present": 0, "replaced": 0, "reused": 0}
    object_bytes = 0
    seen: set[str] = set()
    for f in src.manifest.files:
        if f.object is None or f.object in seen:
            continue
        seen.add(f.object)
        if done.fresh(f.object):
            counts["reused"] += 1
            continue
        what, written = _copy_object(src, f, dst.store, progress)
        done.add(f.object)
        counts[what] += 1
        object_bytes += written
    total = object_bytes
    for f in src.iter_files():  # a listed part's files too (SPEC §10.4; they name no object)
        if f.object is None:
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
    return CopyResult(sid, seq, url, total + src.commit.manifest_size, skipped=False,
                      objects_copied=counts["copied"], objects_present=counts["present"],
                      objects_replaced=counts["replaced"], objects_reused=counts["reused"], object_bytes=object_bytes)


def copy_store(src_url: str, dst_url: str, progress: Callable[[int], None] | None = None) -> list[CopyResult]:
    """Copy every published snapshot of a store, oldest first (skipping those already there); each
    shared object is checked or copied once however many snapshots name it."""
    src = SnapshotStore(src_url)
    src.check_marker()
    dst = SnapshotStore(dst_url).store  # opened once: an S3 client costs ~0.3 s of CPU to create
    done = ObjectsDone()
    return [copy_snapshot(open_sequence(src.store, c.sequence), dst, progress, done) for c in reversed(src.list())]


def destination_store(dst: str, snapshot_id: str | None) -> str:
    """``dst`` may be a store or, for one snapshot, that snapshot's location in the destination."""
    try:
        store_url, dst_id = layout.split_snapshot_url(dst)
    except InvalidPathError:
        return dst
    if snapshot_id is not None and dst_id != snapshot_id:
        raise InvalidPathError(f"{dst}: a copy keeps the snapshot id; expected .../snapshots/{snapshot_id}")
    return store_url
