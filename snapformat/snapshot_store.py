"""``SnapshotStore``: the one object a service needs to write, find, read and prune snapshots."""

from __future__ import annotations

import time

from schemas.errors import (
    CorruptSnapshotError, InvalidRecordError, NotPublishedError, SnapshotError, TopologyMismatchError,
)
from schemas.manifest import CommitRecord, ParentRef, StoreMarker
from schemas.version import check_readable
from snapformat import discovery, jsonl, layout
from snapformat.draft import SnapshotDraft
from snapformat.reader import Snapshot, open_sequence
from snapformat.retention import DEFAULT_DRAFT_MIN_AGE_S, GcReport, gc
from snapformat.store import Store, open_store


class SnapshotStore:
    """Snapshots kept in one store (a local folder or, with a backend, an object-store prefix).

    >>> store = SnapshotStore("demo-store")
    >>> draft = store.begin()
    >>> part = draft.part("controller")
    >>> part.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=10, seed=1))
    >>> published = draft.publish(keep_latest=2)
    >>> store.latest().records("loader")
    """

    def __init__(self, store: str | Store) -> None:
        self.store = open_store(store) if isinstance(store, str) else store

    @property
    def url(self) -> str:
        return self.store.url

    def _ensure_marker(self) -> None:
        try:
            self.check_marker()  # never write v1 snapshots into a store of another major version
            return
        except NotPublishedError:
            pass  # no marker yet: a new store
        try:
            self.store.create_exclusive(layout.MARKER_KEY, jsonl.encode_json(StoreMarker()))
        except SnapshotError:
            if not self.store.exists(layout.MARKER_KEY):
                raise

    def check_marker(self) -> None:
        """Refuse a folder that is not a snapshot store (or one of a newer major version)."""
        where = self.store.display(layout.MARKER_KEY)
        try:
            data = self.store.read_bytes(layout.MARKER_KEY, limit=discovery.MAX_SMALL_DOCUMENT)
        except FileNotFoundError:
            raise NotPublishedError(f"{self.store.url}: not a snapshot store ({layout.MARKER_KEY} is missing)") from None
        if len(data) > discovery.MAX_SMALL_DOCUMENT:
            raise CorruptSnapshotError(f"{where}: too large (expected at most {discovery.MAX_SMALL_DOCUMENT} bytes)")
        marker = jsonl.decode_json(data, StoreMarker, where)
        check_readable(marker.format_version, [], where)

    def begin(self, sequence: int | None = None) -> SnapshotDraft:
        """Start a draft for the next sequence (newest + 1); its parent is the newest snapshot."""
        self._ensure_marker()
        newest = discovery.latest_commit(self.store)
        next_seq = 1 if newest is None else newest.sequence + 1
        if sequence is not None and sequence != next_seq:
            raise InvalidRecordError(f"sequence: {sequence} would leave a gap or reuse a number (next is {next_seq})")
        parent = None if newest is None else ParentRef(snapshot_id=newest.snapshot_id, sequence=newest.sequence)
        return SnapshotDraft(self.store, layout.new_snapshot_id(next_seq), next_seq, time.time(), parent)

    def list(self) -> list[CommitRecord]:
        """Commit records of every published snapshot, newest first."""
        return [discovery.read_commit(self.store, s) for s in discovery.committed_sequences(self.store)]

    def latest(self) -> Snapshot | None:
        """The newest published snapshot, found in a constant number of requests."""
        seq = discovery.latest_sequence(self.store)
        return None if seq is None else open_sequence(self.store, seq)

    def open(self, sequence: int | None = None) -> Snapshot:
        return open_sequence(self.store, sequence)

    def latest_matching(self, fingerprint: str) -> Snapshot | None:
        """The newest snapshot taken by this topology; a newer one from another topology is
        refused with both fingerprints named (a restore must not silently go back in time)."""
        snap = self.latest()
        if snap is None:
            return None
        check_topology(snap, fingerprint)
        return snap

    def gc(self, keep_latest: int | None = None, min_age_s: float = DEFAULT_DRAFT_MIN_AGE_S,
           grace_s: float | None = None) -> GcReport:
        """Retention, the draft sweep, then the mark and sweep of shared objects: see
        :func:`snapformat.retention.gc` (``grace_s`` defaults to ``min_age_s`` and may not be shorter)."""
        return gc(self.store, keep_latest, min_age_s, grace_s)


def check_topology(snap: Snapshot, fingerprint: str) -> None:
    """Raise :class:`TopologyMismatchError` naming both fingerprints unless they are equal."""
    saved = snap.manifest.topology_fingerprint
    if saved != fingerprint:
        raise TopologyMismatchError(
            f"{snap.url}: taken by topology {saved or '(none recorded)'}, the running topology is {fingerprint}"
        )


def stores_under(url: str) -> list[SnapshotStore]:
    """The snapshot stores directly inside the folder (or prefix) ``url``, by name.

    ``make demo`` fills ``demo-store/`` with one store per run (``run-<time>/``); a folder like that
    is not a store itself, and a user listing it wants its stores, not an error.
    """
    parent = open_store(url)
    found = []
    for name in parent.list_names(""):
        child = f"{url.rstrip('/')}/{name}"
        if parent.exists(f"{name}/{layout.MARKER_KEY}"):
            found.append(SnapshotStore(child))
    return found
