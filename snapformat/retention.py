"""Retention (keep the latest k) and garbage collection of drafts left by crashed writers.

Deleting a published snapshot removes its commit record *first*, so from that instant it is no
longer listed; a crash before its folder is gone leaves an uncommitted folder, which the draft
sweep removes later. The newest snapshot is never deleted. Drafts (folders no commit names) are
swept only when nothing in them has changed for ``min_age_s``: a live writer's draft is younger
(writers that pause for long call ``SnapshotDraft.touch``).
"""

from __future__ import annotations

import logging
import time

import msgspec

from schemas.errors import InvalidRecordError, SnapshotError
from snapformat import discovery, layout
from snapformat.store import Store

log = logging.getLogger("snapformat.retention")

DEFAULT_DRAFT_MIN_AGE_S = 6 * 3600.0


class GcReport(msgspec.Struct, frozen=True):
    deleted_snapshots: list[str]
    swept_drafts: list[str]
    swept_temp_files: list[str]
    kept: list[int]
    aborted_uploads: list[str] = []  # incomplete multipart uploads of crashed writers (object stores)


def apply_retention(store: Store, keep_latest: int) -> list[str]:
    """Delete published snapshots beyond the newest ``keep_latest``; returns their ids."""
    if keep_latest < 1:
        raise InvalidRecordError(f"keep_latest: {keep_latest} (expected >= 1; the newest is always kept)")
    deleted = []
    for seq in discovery.committed_sequences(store)[keep_latest:]:
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


def gc(store: Store, keep_latest: int | None = None, min_age_s: float = DEFAULT_DRAFT_MIN_AGE_S) -> GcReport:
    """Retention (when ``keep_latest`` is given), then the draft sweep, then stale uploads."""
    deleted = apply_retention(store, keep_latest) if keep_latest is not None else []
    swept, temps = sweep_drafts(store, min_age_s)
    uploads = sweep_uploads(store, min_age_s)
    return GcReport(deleted, swept, temps, discovery.committed_sequences(store), uploads)
