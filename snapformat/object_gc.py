"""Mark and sweep of shared objects (SPEC §14.2): an object goes once nothing can need it.

An object (``objects/<2>/<64>``, :mod:`snapformat.objects`) is needed by every committed manifest
that names it, by every draft whose part manifests name it, and by a writer that wrote (or put
again) it and has not published yet. The first two are *marked*; the third is protected by age: a
writer publishes within the grace period of its first object write (writer rule), and
:func:`~snapformat.objects.put_object` puts an existing object again, which makes it young.

The sweep, and what a crash (or a concurrent writer) at each step leaves behind:

1. ``t0`` = now. Objects are swept only if their modification time is before ``t0 - grace_s``.
2. Walk ``objects/`` once. An object written after the walk is not a candidate (and is young). A
   store with no object (nor temporary file) there stops here: no manifest is read.
3. Mark: list ``_commits/``; read each commit record and its manifest once; mark every object it
   names. A commit that vanished between the listing and the read was deleted by a retention, which
   means a newer commit exists: step 5 lists again. A commit record or manifest that cannot be read
   (while its commit still exists) stops the sweep: no object is swept, and the report says which
   one and why (its objects are unknown, so none can be called unreferenced).
4. Mark: every snapshot folder no listed commit names is a draft (or was published since the
   listing): mark the objects named by each of its part manifests. A part manifest that cannot be
   read is being written (its objects are younger than the grace period, by the writer rule) or was
   left by a crashed writer (whose draft the draft sweep removes): it is skipped, and logged.
5. List ``_commits/`` again and read the commits not read yet, until a listing brings nothing new
   and no commit vanished (bounded; a store whose commits keep changing is not swept this time).
   Why this is enough: a snapshot committed after the last listing was published by a writer that
   wrote (or put again) each object it did not take from its parent after ``t0 - grace_s`` (it
   publishes within the grace period of its first object write, and it published after ``t0``); its
   parent is committed until it publishes (its sequence would be taken otherwise), so the parent's
   objects are marked.
6. Delete each object of the walk neither marked nor younger than ``t0 - grace_s``; right before
   deleting it, its modification time is read again (a writer may have put it again since the
   walk) and a young one is kept. Temporary files (``.tmp-*``, left by a create-only write that
   was killed) older than the grace period are deleted too. *Crash anywhere: the objects left are
   either marked or swept by a later run; only unmarked, old objects are ever deleted.*

The second look and the delete are one step against a writer's put on local disk
(:meth:`~snapformat.store.Store.delete_if_older`: both hold the folder's lock). An object store has
no conditional delete on age (S3's ``If-Match`` compares ETags, and a put of the same bytes keeps
the ETag), so there a writer that puts an object again *between* the look and the delete, and
publishes before the delete lands, can lose it: a window of one request of a GC that stalls there,
which SPEC §14.2 states.

Cost: one walk of ``objects/``, one listing of ``_commits/`` per round (normally two), one read of
each commit record and manifest, one walk of each draft folder, and one ``info`` plus one
``delete`` per swept object.
"""

from __future__ import annotations

import logging
import time

import msgspec

from schemas.errors import CorruptSnapshotError, NotPublishedError, SnapshotError
from schemas.manifest import PartManifest
from snapformat import discovery, jsonl, layout
from snapformat.reader import MAX_JSON_PART_BYTES, load_manifest
from snapformat.store import ObjectInfo, Store

log = logging.getLogger("snapformat.object_gc")

#: Listings of ``_commits/`` after the first before a store whose commits keep changing is left alone.
MAX_RELISTS = 50
TMP_PREFIX = ".tmp-"


class ObjectsKept(msgspec.Struct, frozen=True, kw_only=True):
    """The objects a sweep found and kept, by the first reason that keeps each."""

    committed: int = 0  # named by a committed manifest
    drafts: int = 0  # named only by a part manifest of an uncommitted draft
    young: int = 0  # named by nothing, but modified within the grace period (a writer may still publish it)
    bytes: int = 0  # their total size


class ObjectSweep(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`sweep_objects` did."""

    swept: list[str]  # names (``sha256:<hex>``) of the objects deleted
    swept_bytes: int
    swept_temp_files: list[str]  # keys of stale ``objects/<2>/.tmp-*`` files deleted
    kept: ObjectsKept
    not_swept: str | None = None  # why no object was swept at all (None: the sweep ran)


class MarkIncomplete(Exception):
    """The mark cannot be trusted (a committed manifest cannot be read, or the commits kept
    changing): sweep nothing, and say why."""


class Marks(msgspec.Struct, kw_only=True):
    """Objects named by committed manifests and by drafts' part manifests."""

    committed: set[str] = msgspec.field(default_factory=set)
    drafts: set[str] = msgspec.field(default_factory=set)
    snapshots: set[str] = msgspec.field(default_factory=set)  # ids of the committed snapshots read
    manifests_read: int = 0
    part_manifests_read: int = 0


def _mark_commits(store: Store, sequences: list[int], marks: Marks) -> bool:
    """Mark what the manifests of ``sequences`` name; True if a commit vanished meanwhile."""
    vanished = False
    for seq in sequences:
        try:
            commit = discovery.read_commit(store, seq)
        except NotPublishedError:
            vanished = True  # deleted by a retention since the listing
            continue
        except SnapshotError as exc:
            raise MarkIncomplete(f"the commit record of sequence {seq} cannot be read ({exc})") from None
        try:
            manifest = load_manifest(store, commit)
        except SnapshotError as exc:
            if not store.exists(layout.commit_key(seq)):
                vanished = True  # its commit, then its folder, went while it was read
                continue
            raise MarkIncomplete(f"the manifest of committed snapshot {commit.snapshot_id} (sequence {seq}) "
                           f"cannot be read ({exc})") from None
        marks.manifests_read += 1
        marks.snapshots.add(commit.snapshot_id)
        # A listed part's files name no object (SPEC §10.4): the manifest's own entries are every mark.
        marks.committed.update(f.object for f in manifest.files if f.object is not None)
    return vanished


def _mark_drafts(store: Store, marks: Marks) -> None:
    """Mark what the part manifests of every folder no read commit names list."""
    suffix = "/" + layout.PART_MANIFEST_NAME
    for name in store.list_names(layout.SNAPSHOTS):
        if name in marks.snapshots:
            continue
        for info in store.walk(f"{layout.SNAPSHOTS}/{name}"):
            if not info.key.endswith(suffix):
                continue
            where = store.display(info.key)
            try:
                data = store.read_bytes(info.key, limit=MAX_JSON_PART_BYTES)
                if len(data) > MAX_JSON_PART_BYTES:
                    raise CorruptSnapshotError(f"{where}: larger than {MAX_JSON_PART_BYTES} bytes")
                part = jsonl.decode_json(data, PartManifest, where)
            except FileNotFoundError:
                continue  # its draft was swept or abandoned meanwhile
            except SnapshotError as exc:
                log.warning("%s: part manifest of a draft cannot be read (%s); its objects are protected only "
                            "by their age", where, exc)
                continue
            marks.part_manifests_read += 1
            marks.drafts.update(f.object for f in part.files if f.object is not None)


def mark(store: Store) -> Marks:
    """Steps 3 to 5 of the module docstring; :class:`MarkIncomplete` when the mark cannot be trusted."""
    marks = Marks()
    read: set[int] = set()
    first = discovery.committed_sequences(store)
    read.update(first)
    vanished = _mark_commits(store, first, marks)
    _mark_drafts(store, marks)
    for _ in range(MAX_RELISTS):
        new = [s for s in discovery.committed_sequences(store) if s not in read]
        if not new and not vanished:
            return marks
        read.update(new)
        vanished = _mark_commits(store, new, marks)
    raise MarkIncomplete(f"the store's commits kept changing over {MAX_RELISTS + 1} listings; run gc again later")


def sweep_objects(store: Store, grace_s: float, now: float | None = None) -> ObjectSweep:
    """Delete the objects nothing references and nobody wrote within ``grace_s`` (module docstring).

    ``now`` (Unix seconds) is the sweep's clock, ``time.time()`` when the sweep begins by default.
    """
    t0 = time.time() if now is None else now
    horizon = t0 - grace_s
    found: list[tuple[str, ObjectInfo]] = []
    temps: list[str] = []
    for info in store.walk(layout.OBJECTS):
        name = layout.object_of_key(info.key)
        if name is not None:
            found.append((name, info))
        elif info.key.rsplit("/", 1)[-1].startswith(TMP_PREFIX) and info.mtime < horizon:
            temps.append(info.key)
        # anything else under objects/ is not ours: left alone
    swept_temps = _sweep_temps(store, temps, horizon)
    if not found:
        return ObjectSweep(swept=[], swept_bytes=0, swept_temp_files=swept_temps, kept=ObjectsKept())
    try:
        marks = mark(store)
    except MarkIncomplete as exc:
        log.warning("%s: no object swept: %s", store.url, exc)
        return ObjectSweep(swept=[], swept_bytes=0, swept_temp_files=swept_temps, kept=ObjectsKept(),
                           not_swept=str(exc))
    committed = drafts = young = kept_bytes = 0
    candidates: list[tuple[str, str]] = []
    for name, info in found:
        if name in marks.committed:
            committed += 1
        elif name in marks.drafts:
            drafts += 1
        elif info.mtime >= horizon:
            young += 1
        else:
            candidates.append((name, info.key))
            continue
        kept_bytes += info.size
    swept: list[str] = []
    swept_bytes = 0
    for name, key in candidates:
        # Looked at again as it is deleted: a writer may have put it again since the walk (one step
        # on local disk; a window of one request elsewhere, see the module docstring).
        deleted = store.delete_if_older(key, horizon)
        if deleted is None:
            young += 1  # put again since the walk (or taken by another GC)
            continue
        swept.append(name)
        swept_bytes += deleted.size
    log.info("%s: swept %d object(s) (%d bytes); kept %d committed, %d draft, %d young", store.url, len(swept),
             swept_bytes, committed, drafts, young)
    return ObjectSweep(swept=swept, swept_bytes=swept_bytes, swept_temp_files=swept_temps,
                       kept=ObjectsKept(committed=committed, drafts=drafts, young=young, bytes=kept_bytes))


def _sweep_temps(store: Store, keys: list[str], horizon: float) -> list[str]:
    """Delete the temporary files ``keys`` still older than ``horizon``; returns those deleted."""
    swept = []
    for key in keys:
        try:
            if store.info(key).mtime < horizon:
                store.delete(key)
                swept.append(key)
        except FileNotFoundError:
            continue  # linked away or removed by its writer meanwhile
    return swept


__all__ = ["MAX_RELISTS", "MarkIncomplete", "Marks", "ObjectSweep", "ObjectsKept", "mark", "sweep_objects"]
