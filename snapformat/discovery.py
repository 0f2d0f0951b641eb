"""Finding published snapshots: listing commits, and the newest one in constant requests.

``latest`` reads the advisory hint ``_latest.json`` (sequence N), checks that commit N exists,
then probes N+1, N+2, ... until one is missing. Writers publish sequences without gaps (each
draft takes newest + 1), so the first missing one ends the search. The cost is 2 requests plus
one per commit newer than the hint (normally none): it does not grow with the number of snapshots
kept. A missing or unreadable hint, or one naming a deleted commit, falls back to one listing.
A commit record is the only proof of publication; nothing else is trusted.
"""

from __future__ import annotations

from schemas.errors import CorruptSnapshotError, InvalidRecordError, NotPublishedError
from schemas.manifest import CommitRecord, LatestHint
from schemas.version import check_readable
from snapformat import jsonl, layout
from snapformat.store import Store

_MAX_PROBES = 10_000
#: Largest commit record, store marker or hint: far above what one holds (~250 bytes), and read
#: with this limit so a huge file is refused without being read whole.
MAX_SMALL_DOCUMENT = 64 * 1024


def committed_sequences(store: Store) -> list[int]:
    """Every committed sequence, newest first (one listing of ``_commits/``)."""
    seqs = (layout.sequence_of_commit(n) for n in store.list_names(layout.COMMITS))
    return sorted((s for s in seqs if s is not None), reverse=True)


def read_commit(store: Store, sequence: int) -> CommitRecord:
    key = layout.commit_key(sequence)
    try:
        data = store.read_bytes(key, limit=MAX_SMALL_DOCUMENT)
    except FileNotFoundError:
        raise NotPublishedError(f"{store.display(key)}: sequence {sequence} is not committed") from None
    if len(data) > MAX_SMALL_DOCUMENT:
        raise CorruptSnapshotError(
            f"{store.display(key)}: commit record is too large (expected at most {MAX_SMALL_DOCUMENT} bytes)")
    rec = jsonl.decode_json(data, CommitRecord, store.display(key))
    check_readable(rec.format_version, [], store.display(key))
    layout.check_snapshot_id(rec.snapshot_id, where=f"{store.display(key)}: snapshot_id")
    if rec.sequence != sequence:
        raise CorruptSnapshotError(f"{store.display(key)}: names sequence {rec.sequence}, expected {sequence}")
    return rec


def _hinted_sequence(store: Store) -> int | None:
    """The hint's sequence, or None when it is missing or unreadable (it is advisory: never fatal)."""
    try:
        data = store.read_bytes(layout.HINT_KEY, limit=MAX_SMALL_DOCUMENT)
        if len(data) > MAX_SMALL_DOCUMENT:
            return None
        return jsonl.decode_json(data, LatestHint, store.display(layout.HINT_KEY)).sequence
    except (FileNotFoundError, CorruptSnapshotError, InvalidRecordError):
        return None


def latest_sequence(store: Store) -> int | None:
    """The newest committed sequence, or None when nothing is published."""
    hint = _hinted_sequence(store)
    if hint is not None and store.exists(layout.commit_key(hint)):
        seq = hint
        for _ in range(_MAX_PROBES):
            if not store.exists(layout.commit_key(seq + 1)):
                return seq
            seq += 1
    seqs = committed_sequences(store)
    return seqs[0] if seqs else None


def latest_commit(store: Store) -> CommitRecord | None:
    seq = latest_sequence(store)
    return None if seq is None else read_commit(store, seq)
