"""snapformat: the versioned rollout-snapshot format, its stores and its readers.

Write: ``SnapshotStore(url).begin()`` gives a draft; each participant writes its part (in this
process with ``draft.part(prefix)``, elsewhere with ``attach_part(draft.url, prefix)``);
``draft.publish(receipts=...)`` commits it atomically; ``read_part_records(draft.url, receipt, kind)``
reads another participant's closed part before then. Read: ``SnapshotStore(url).latest()`` or
``open_snapshot(url)``, then ``records(...)``, ``read_table(...)``, ``iter_batches(...)``. Check:
``verify_snapshot(snap)``, or ``verify_store(store)`` (every snapshot, each shared object once).
Prune: ``SnapshotStore(url).gc(...)`` (retention, drafts, and shared objects by mark and sweep).
"""

from schemas.errors import (
    CommitConflictError,
    CorruptSnapshotError,
    InvalidPathError,
    InvalidRecordError,
    NotPublishedError,
    SnapshotError,
    StoreError,
    TopologyMismatchError,
    VersionError,
)
from schemas.topology import topology_fingerprint
from snapformat.draft import PartReceipt, PartWriter, SnapshotDraft, attach_part
from snapformat.publish import Published, read_part_records
from snapformat.reader import Snapshot, open_snapshot
from snapformat.snapshot_store import SnapshotStore, check_topology
from snapformat.store import LocalStore, Store, open_store
from snapformat.verify import StoreVerifyReport, VerifyReport, verify_snapshot, verify_store

__version__ = "0.1.0"

__all__ = [
    "CommitConflictError", "CorruptSnapshotError", "InvalidPathError", "InvalidRecordError",
    "LocalStore", "NotPublishedError", "PartReceipt", "PartWriter", "Published", "Snapshot",
    "SnapshotDraft", "SnapshotError", "SnapshotStore", "Store", "StoreError", "StoreVerifyReport",
    "TopologyMismatchError", "VerifyReport", "VersionError", "attach_part", "check_topology",
    "open_snapshot", "open_store", "read_part_records", "topology_fingerprint", "verify_snapshot", "verify_store",
]
