"""Publishing a draft: one commit point, and what a crash at each step leaves behind.

1. Check every part: its manifest's checksum equals the receipt's, every path lies under the
   part's prefix, and every listed file (and every shared object an entry names) exists with its
   listed size. *Crash: the draft stays unlisted; GC sweeps it by age, and the objects only it
   wrote once they are older than the grace period (SPEC §14.2).*
2. Write ``snapshots/<id>/manifest.json`` (create-only, durable), each part of Gym's files listed by
   its part manifest and totals (SPEC §10.4), every other file by its own entry. *Crash: as 1.*
3. Commit: create ``_commits/<inverted sequence>.json`` only if absent (the commit point). If it
   exists, another writer won: raise :class:`CommitConflictError` and delete this draft.
   *Crash before the create completes: as 1. After: the snapshot is published.*
4. Replace ``_latest.json`` with the new sequence (advisory; failure is logged, not raised).
   *Crash: the hint is stale; readers probe forward past it.*
5. Optionally apply retention (keep the latest k), only now that the new snapshot is durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from schemas.errors import CommitConflictError, CorruptSnapshotError, InvalidPathError, InvalidRecordError, StoreError
from schemas.identity import check_relative_path
from schemas.manifest import (
    MAX_LISTED_PARTS,
    MAX_MANIFEST_FILES,
    CommitRecord,
    FileEntry,
    GymCommit,
    LatestHint,
    ListedPart,
    Manifest,
    PartManifest,
)
from schemas.version import FORMAT_VERSION, features_of_kinds
from snapformat import jsonl, layout
from snapformat.checksum import check, checksum_bytes
from snapformat.draft import PartReceipt, SnapshotDraft
from snapformat.kinds import GYM_FILE_KIND, RECORD_TYPES, storage_of
from snapformat.reader import MAX_JSON_PART_BYTES, MAX_MANIFEST_BYTES, check_part_manifest
from snapformat.store import Store, open_store

log = logging.getLogger("snapformat.publish")


class Published(msgspec.Struct, frozen=True):
    """What :func:`publish` returns: the manifest and where the snapshot now lives."""

    url: str
    manifest: Manifest
    commit: CommitRecord


def load_part(store: Store, snapshot_id: str, receipt: PartReceipt) -> PartManifest:
    """Read a part manifest and check it against its receipt and its own prefix."""
    rel = f"{check_relative_path(receipt.prefix, where='part prefix')}/{layout.PART_MANIFEST_NAME}"
    key = layout.file_key(snapshot_id, rel)
    where = store.display(key)
    try:
        data = store.read_bytes(key, limit=MAX_JSON_PART_BYTES)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{where}: part manifest missing (writer {receipt.writer!r} did not close its part)") from None
    if len(data) > MAX_JSON_PART_BYTES:  # a participant's file: bounded before it is read whole
        raise CorruptSnapshotError(f"{where}: part manifest is too large (expected at most {MAX_JSON_PART_BYTES} bytes)")
    actual = checksum_bytes(data)
    if actual != receipt.part_manifest_checksum:
        raise CorruptSnapshotError(f"{where}: checksum {actual} differs from the receipt's {receipt.part_manifest_checksum}")
    part = jsonl.decode_json(data, PartManifest, where)
    check_part_manifest(part, snapshot_id, receipt.prefix, where)
    return part


def read_part_records(draft_url: str, receipt: PartReceipt, kind: str) -> Iterator[Any]:
    """The decoded records of ``kind`` in another participant's closed part of an unpublished draft.

    For a participant that needs what another one committed to the same draft before it (a Gym
    model server reads the continuation indexes of the agents' parts, CONTROL.md §6). The part is
    found through ``receipt`` only: its part manifest must have the receipt's checksum and lie
    under its prefix (as :func:`publish` checks it), and each file of ``kind`` it lists must exist
    with its listed size and checksum, else :class:`CorruptSnapshotError`. A record that breaks its
    type is an :class:`InvalidRecordError` naming the file and line. ``kind`` is a JSON-lines kind
    (``continuations``, ``agent_state``, ...); nothing is read outside the part.
    """
    if storage_of(kind) != "jsonl" or kind not in RECORD_TYPES:
        raise ValueError(f"{kind!r} is not a kind of JSON-lines records")
    store_url, snapshot_id = layout.split_snapshot_url(draft_url)
    store = open_store(store_url)
    part = load_part(store, snapshot_id, receipt)
    for f in part.files:
        if f.kind != kind:
            continue
        key = layout.object_key(f.object) if f.object is not None else layout.file_key(snapshot_id, f.path)
        where = store.display(key)
        try:
            data = store.read_bytes(key)
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{where}: listed by {receipt.writer!r} but missing") from None
        if len(data) != f.size:
            raise CorruptSnapshotError(f"{where}: size is {len(data)} bytes, the part manifest says {f.size}")
        check(where, checksum_bytes(data, f.checksum.partition(":")[0]), f.checksum)
        yield from jsonl.iter_records(data, RECORD_TYPES[kind], where, f.compression, f.content_size)


def _part_manifest_entry(store: Store, snapshot_id: str, part: PartManifest, receipt_checksum: str) -> FileEntry:
    rel = f"{part.prefix}/{layout.PART_MANIFEST_NAME}"
    size = store.info(layout.file_key(snapshot_id, rel)).size
    return FileEntry(path=rel, kind="part_manifest", size=size, checksum=receipt_checksum, records=1, writer=part.writer)


def _check_files_present(store: Store, snapshot_id: str, files: list[FileEntry]) -> None:
    checked: set[str] = set()
    for f in files:
        if f.object is not None:
            if f.object in checked:  # one object may back several entries (row ranges)
                continue
            checked.add(f.object)
            key = layout.object_key(f.object)
        else:
            key = layout.file_key(snapshot_id, f.path)
        try:
            size = store.info(key).size
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{store.display(key)}: listed by writer {f.writer!r} but missing") from None
        if size != f.size:
            raise CorruptSnapshotError(f"{store.display(key)}: size is {size}, writer {f.writer!r} listed {f.size}")


def is_listable(part: PartManifest) -> bool:
    """Whether the publisher lists ``part`` by its part manifest only (SPEC §10.4): a part of Gym's
    own files (every file of kind ``gym_file``, none naming a shared object), the parts that grow with
    the rollouts. Other parts keep every file in the manifest, readable by older readers."""
    return bool(part.files) and all(f.kind == GYM_FILE_KIND and f.object is None for f in part.files)


def _check_gym_parts(draft: SnapshotDraft, gym_commit: GymCommit | None) -> None:
    """Every part Gym's commit result names must be one of the parts being published."""
    if gym_commit is None:
        return
    added = {part.prefix: checksum for part, checksum in draft.parts}
    for p in gym_commit.participants:
        if p.part_prefix is None:
            continue
        if added.get(p.part_prefix) != p.part_manifest_checksum:
            raise CorruptSnapshotError(
                f"{draft.url}: Gym's commit names part {p.part_prefix!r} with part manifest {p.part_manifest_checksum}, "
                f"but the parts being published have {added.get(p.part_prefix, 'no such part')}")


def _check_within_reader_bounds(draft: SnapshotDraft, manifest: Manifest, data: bytes) -> None:
    """Refuse, before the commit point, a manifest no reader would open (SPEC §15.5 step 2, §21): a
    committed snapshot every reader refuses would become the newest and make ``latest()`` fail."""
    files = manifest.files
    if len(manifest.listed_parts) > MAX_LISTED_PARTS:
        raise InvalidRecordError(f"{draft.url}: manifest field 'listed_parts' would list {len(manifest.listed_parts):,} "
                                 f"parts (expected at most {MAX_LISTED_PARTS:,}, SPEC §21); nothing was published")
    if len(files) > MAX_MANIFEST_FILES:
        raise InvalidRecordError(f"{draft.url}: manifest field 'files' would list {len(files):,} entries (expected at "
                                 f"most {MAX_MANIFEST_FILES:,}, SPEC §21); nothing was published")
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidRecordError(f"{draft.url}: manifest.json would be {len(data):,} bytes for {len(files):,} file "
                                 f"entries (expected at most {MAX_MANIFEST_BYTES:,}, SPEC §21); nothing was published")


def publish(
    draft: SnapshotDraft,
    *,
    receipts: list[PartReceipt] = (),  # type: ignore[assignment]
    gym_commit: GymCommit | None = None,
    topology_fingerprint: str | None = None,
    timings_s: dict[str, float] | None = None,
    keep_latest: int | None = None,
    producer: str = "",
) -> Published:
    """Publish ``draft`` atomically (steps in the module docstring) and return where it lives.

    ``receipts`` are parts written by other processes (parts written through
    :meth:`SnapshotDraft.part` must be closed and added too). Raises
    :class:`CommitConflictError` if another writer committed the same sequence first.
    """
    store = draft.store
    t0 = time.perf_counter()
    if keep_latest is not None and keep_latest < 1:  # refuse before the commit, not after it
        raise InvalidRecordError(f"keep_latest: {keep_latest} (expected >= 1; the newest is always kept)")
    draft.close_local_parts()
    for r in receipts:
        draft.add_part(r)
    files: list[FileEntry] = []
    listed: list[ListedPart] = []
    seen: set[str] = set()
    for part, _ in draft.parts:
        for f in part.files:
            if f.path in seen:
                raise InvalidPathError(f"{draft.url}: file {f.path!r} listed twice")
            seen.add(f.path)
        _check_files_present(store, draft.snapshot_id, part.files)
        if is_listable(part):  # Gym's files: the manifest names the part manifest, not each file (SPEC §10.4)
            listed.append(ListedPart(prefix=part.prefix, files=len(part.files), bytes=sum(f.size for f in part.files)))
        else:
            files.extend(part.files)
    _check_gym_parts(draft, gym_commit)
    files.extend(_part_manifest_entry(store, draft.snapshot_id, p, checksum) for p, checksum in draft.parts)
    timings = dict(timings_s or {})
    committed_at = time.time()
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        # What a reader must implement to read these files (SPEC §14): a kind it would skip is announced.
        required_features=features_of_kinds((f.kind for f in files), objects=any(f.object for f in files),
                                            listed_parts=bool(listed)),
        snapshot_id=draft.snapshot_id,
        sequence=draft.sequence,
        created_at=draft.created_at,
        committed_at=committed_at,
        files=files,
        listed_parts=listed,
        gym_commit=gym_commit,
        topology_fingerprint=topology_fingerprint,
        parent=draft.parent,
        timings_s=timings,
        producer=producer,
    )
    data = jsonl.encode_json(manifest)
    _check_within_reader_bounds(draft, manifest, data)
    manifest_key = f"{layout.snapshot_dir(draft.snapshot_id)}/{layout.MANIFEST_NAME}"
    with store.open_write(manifest_key) as fh:
        fh.write(data)
    commit = CommitRecord(format_version=FORMAT_VERSION, sequence=draft.sequence, snapshot_id=draft.snapshot_id,
                          manifest_size=len(data), manifest_checksum=checksum_bytes(data), committed_at=committed_at)
    try:
        store.create_exclusive(layout.commit_key(draft.sequence), jsonl.encode_json(commit))
    except CommitConflictError as exc:
        try:
            draft.abandon()
        except StoreError:
            log.warning("could not remove the losing draft %s; GC will", draft.url)
        raise CommitConflictError(
            f"sequence {draft.sequence} of {store.url} was committed by another writer first; "
            f"draft {draft.snapshot_id} was not published ({exc})"
        ) from None
    try:
        store.put_bytes(layout.HINT_KEY, msgspec.json.encode(LatestHint(sequence=draft.sequence, snapshot_id=draft.snapshot_id)))
    except StoreError as exc:  # advisory only: discovery probes past a stale hint
        log.warning("published %s but could not update %s: %s", draft.url, layout.HINT_KEY, exc)
    log.info("published %s (sequence %d, %d files) in %.3fs", draft.url, draft.sequence, manifest.file_count,
             time.perf_counter() - t0)
    if keep_latest is not None:
        from snapformat.retention import apply_retention

        apply_retention(store, keep_latest)
    return Published(url=draft.url, manifest=manifest, commit=commit)
