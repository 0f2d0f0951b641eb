"""The contracts of the rollout snapshot: records, row schemas, identifiers, versions, errors.

No I/O lives here; ``snapformat`` reads and writes these records.
"""

from schemas.controller import (
    AckOwed, LoaderPlace, PromptGroup, RecoveryLedgerRecord, ReplayIndexEntry, RolloutAttempt,
)
from schemas.errors import (
    CommitConflictError, CorruptSnapshotError, InvalidPathError, InvalidRecordError,
    NotPublishedError, SnapshotError, StoreError, TopologyMismatchError, VersionError,
)
from schemas.gym_records import (
    AgentContinuationRoot, AgentStateRecord, ModelLedgerEntry, SessionStateRecord, TokenIndexEntry,
)
from schemas.identity import capture_key, check_capture_key, check_relative_path, check_rollout_id
from schemas.manifest import (
    CommitRecord, FileEntry, GymCommit, LatestHint, Manifest, ParentRef, PartManifest,
    ParticipantCommit,
)
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.version import FORMAT_VERSION

__all__ = [
    "AckOwed", "AgentContinuationRoot", "AgentStateRecord", "CommitConflictError", "CommitRecord",
    "CorruptSnapshotError", "FORMAT_VERSION", "FileEntry", "GymCommit", "InvalidPathError",
    "InvalidRecordError", "LatestHint", "LoaderPlace", "Manifest", "ModelLedgerEntry",
    "NotPublishedError", "ParentRef", "PartManifest", "ParticipantCommit", "PromptGroup",
    "RecoveryLedgerRecord", "ReplayIndexEntry", "RolloutAttempt", "SessionStateRecord",
    "SnapshotError", "StoreError", "TOKEN_CAPTURE_SCHEMA", "TRAINING_SCHEMA", "TokenIndexEntry",
    "TopologyMismatchError", "VersionError", "capture_key", "check_capture_key",
    "check_relative_path", "check_rollout_id",
]
