"""Retention (keep the latest k) and garbage collection: drafts left by crashed writers, and shared
objects no snapshot references (mark and sweep, SPEC §14.2; :mod:`snapformat.object_gc`).

Retention deletes published snapshots *oldest sequence first*, and each snapshot's commit record
*before* its folder:

1. Delete the commit record of the oldest sequence beyond the newest ``keep_latest``. *Crash: that
   snapshot is no longer listed; its folder is an uncommitted folder, which the draft sweep removes
   once it is ``min_age_s`` old. Every commit left is newer than every commit deleted, so no gap
   opens between a commit left and the newest, and discovery (hint, then a forward probe) still
   finds the newest: a stale hint names either a deleted commit (discovery falls back to the
   listing) or one from which the probe walks to the newest without a gap. Newest-first deletion
   broke this: with the hint at 2 and 4 committed, deleting 3 before 2 left 2, whose forward probe
   stops at the missing 3.*
2. Delete that snapshot's folder (never an object directly: an object goes only when no manifest
   names it, in the object sweep). *Crash: as 1.*
3. Next oldest. The newest snapshot is never deleted.

Drafts (folders no commit names) are swept only when nothing in them has changed for
``min_age_s``: a live writer's draft is younger (writers that pause for long call
``SnapshotDraft.touch``). :func:`gc` runs retention, the draft sweep, the upload sweep, then the
object sweep, and reports what each did.
"""

from __future__ import annotations

import logging
import time

import msgspec

from schemas.errors import InvalidRecordError, SnapshotError
from snapformat import discovery, layout
from snapformat.object_gc import ObjectsKept, sweep_objects
from snapformat.store import Store
from snapformat.store.counting import CountingStore

log = logging.getLogger("snapformat.retention")

DEFAULT_DRAFT_MIN_AGE_S = 6 * 3600.0


class GcReport(msgspec.Struct, frozen=True):
    """What :func:`gc` deleted, and what it kept and why."""

    deleted_snapshots: list[str]  # ids of the published snapshots retention deleted, oldest first
    swept_drafts: list[str]  # uncommitted folders idle for the draft min age
    swept_temp_files: list[str]  # stale temporary files (store root, ``_commits/``, ``objects/<2>/``)
    kept: list[int]  # the sequences still committed, newest first
    aborted_uploads: list[str] = []  # incomplete multipart uploads of crashed writers (object stores)
    swept_objects: list[str] = []  # shared objects no snapshot or draft names, older than the grace period
    swept_object_bytes: int = 0
    kept_objects: ObjectsKept = msgspec.field(default_factory=ObjectsKept)  # counts, by why each was kept
    objects_not_swept: str | None = None  # why no object was swept at all (e.g. a manifest cannot be read)
    grace_s: float | None = None  # the grace period the object sweep used
    #: Store calls by method, and ``walked``: objects the walks listed (an object store lists 1000 a request).
    store_calls: dict[str, int] = {}


def apply_retention(store: Store, keep_latest: int) -> list[str]:
    """Delete published snapshots beyond the newest ``keep_latest``; returns their ids."""
    if keep_latest < 1:
        raise InvalidRecordError(f"keep_latest: {keep_latest} (expected >= 1; the newest is always kept)")
    deleted = []
    # Oldest first (module docstring): however far this loop gets, no gap opens below the newest.
    for seq in sorted(discovery.committed_sequences(store)[keep_latest:]):
        try:
            snapshot_id = discovery.read_commit(store, seq).snapshot_id
        except SnapshotError as exc:
            log.warning("commit %d is unreadable (%s); deleting only the commit", seq, exc)
            snapshot_id = None
        store.delete(layout.commit_key(seq))  # first: from here on it is not published
        if snapshot_id is not None:
            store.delete_tree(layout.snapshot_dir(snapshot_id))
            deleted.append(snapshot_id)
    return deleted


def _committed_now(store: Store, sequence: int, snapshot_id: str) -> bool:
    """Re-check right before deleting: a writer may have committed since the listing."""
    try:
        return discovery.read_commit(store, sequence).snapshot_id == snapshot_id
    except SnapshotError:
        return False


def sweep_drafts(store: Store, min_age_s: float = DEFAULT_DRAFT_MIN_AGE_S, now: float | None = None) -> tuple[list[str], list[str]]:
    """Delete uncommitted snapshot folders idle for ``min_age_s``, and stale temporary files."""
    now = time.time() if now is None else now
    committed, unreadable = set(), set()
    for seq in discovery.committed_sequences(store):
        try:
            committed.add(discovery.read_commit(store, seq).snapshot_id)
        except SnapshotError:
            unreadable.add(seq)  # keep its folder: an operator may want to inspect it
    swept = []
    for name in store.list_names(layout.SNAPSHOTS):
        m = layout.SNAPSHOT_ID_RE.match(name)
        if name in committed or (m and int(m.group(1)) in unreadable):
            continue
        prefix = f"{layout.SNAPSHOTS}/{name}"
        mtimes = [o.mtime for o in store.walk(prefix)]
        if not mtimes:
            # No files: on local disk, empty folders a crash left (between mkdir and the first
            # file, or midway through a delete_tree), aged by the folder itself; on an object
            # store, an emptied prefix some stores keep listing (no object: nothing to sweep).
            try:
                mtimes = [store.info(prefix).mtime]
            except FileNotFoundError:
                continue
        if now - max(mtimes) >= min_age_s and not (m and _committed_now(store, int(m.group(1)), name)):
            store.delete_tree(prefix)
            swept.append(name)
    temps = []
    for folder in ("", layout.COMMITS):
        for name in store.list_names(folder):
            if name.startswith(".tmp-"):
                key = f"{folder}/{name}" if folder else name
                try:
                    if now - store.info(key).mtime >= min_age_s:
                        store.delete(key)
                        temps.append(key)
                except FileNotFoundError:
                    continue
    return swept, temps


def sweep_uploads(store: Store, min_age_s: float = DEFAULT_DRAFT_MIN_AGE_S,
                  now: float | None = None) -> list[str]:
    """Abort the multipart uploads crashed writers left in drafts: no listing shows them, but an
    object store keeps (and bills) their parts. Only uploads begun ``min_age_s`` ago or more, in a
    snapshot folder no commit names and where nothing changed for ``min_age_s`` (a live writer's
    draft is younger), are aborted. Returns their keys."""
    now = time.time() if now is None else now
    verdicts: dict[str, bool] = {}

    def keep(key: str) -> bool:
        name = key.split("/")[1] if key.count("/") >= 2 else ""
        if name not in verdicts:
            m = layout.SNAPSHOT_ID_RE.match(name)
            if not m or _committed_now(store, int(m.group(1)), name):
                verdicts[name] = True  # not a draft of ours, or published: leave it alone
            else:
                verdicts[name] = any(now - o.mtime < min_age_s for o in store.walk(f"{layout.SNAPSHOTS}/{name}"))
        return verdicts[name]

    return store.abort_uploads(layout.SNAPSHOTS, now - min_age_s, keep)


def gc(store: Store, keep_latest: int | None = None, min_age_s: float = DEFAULT_DRAFT_MIN_AGE_S,
       grace_s: float | None = None, now: float | None = None) -> GcReport:
    """Retention (when ``keep_latest`` is given), the draft sweep, stale uploads, then the mark and
    sweep of shared objects (:mod:`snapformat.object_gc`), in that order: what retention and the draft
    sweep delete stops marking its objects in the same run.

    ``grace_s`` (default ``min_age_s``) is how old an unreferenced object must be to be swept. It
    MUST be at least ``min_age_s``: a draft younger than ``min_age_s`` is taken for a live writer's,
    and the objects that writer wrote but has not listed yet must outlive it. ``now`` (Unix
    seconds) replaces the clock, for tests.
    """
    grace = min_age_s if grace_s is None else grace_s
    if grace < min_age_s:
        raise InvalidRecordError(
            f"grace_s: {grace_s} s is shorter than min_age_s {min_age_s} s (expected grace_s >= min_age_s: "
            f"objects a live draft wrote must outlive the draft)")
    if keep_latest is not None and keep_latest < 1:
        raise InvalidRecordError(f"keep_latest: {keep_latest} (expected >= 1; the newest is always kept)")
    counted = CountingStore(store)
    deleted = apply_retention(counted, keep_latest) if keep_latest is not None else []
    swept, temps = sweep_drafts(counted, min_age_s, now)
    uploads = sweep_uploads(counted, min_age_s, now)
    objects = sweep_objects(counted, grace, now)
    kept = discovery.committed_sequences(counted)
    return GcReport(deleted, swept, temps + objects.swept_temp_files, kept, uploads,
                    swept_objects=objects.swept, swept_object_bytes=objects.swept_bytes, kept_objects=objects.kept,
                    objects_not_swept=objects.not_swept, grace_s=grace,
                    store_calls=dict(sorted({**counted.calls, "walked": counted.walked}.items())))
