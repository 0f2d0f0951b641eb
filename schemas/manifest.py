"""The manifest, the per-participant part manifest and the commit record.

Persisted records never forbid unknown fields (a newer minor version may add some); new fields
always get defaults. Limits (``Meta``) bound what a reader of untrusted bytes will accept.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Str = Annotated[str, msgspec.Meta(max_length=4096)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
RelPath = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Checksum = Annotated[str, msgspec.Meta(pattern=r"^(xxh128:[0-9a-f]{32}|sha256:[0-9a-f]{64})$")]
Fingerprint = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}$")]

#: What each file of a snapshot holds; decides how it is parsed and which struct or Arrow schema
#: it must follow. Readers ignore files of kinds they do not know (verify still checks bytes).
FileKind = Literal[
    "training_rows",
    "token_capture_rows",
    "dataplane_rows",
    "continuations",
    "agent_state",
    "model_ledger",
    "token_index",
    "session_state",
    "loader_place",
    "replay_index",
    "recovery_ledger",
    "part_manifest",
]
JSONL_KINDS = frozenset(
    {"continuations", "agent_state", "model_ledger", "token_index", "session_state",
     "replay_index", "recovery_ledger"}
)
ROW_KINDS = frozenset({"training_rows", "token_capture_rows", "dataplane_rows"})
JSON_KINDS = frozenset({"loader_place", "part_manifest"})

Compression = Literal["none", "zstd"]


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a snapshot: where it is, how big, how many records, and its checksum."""

    path: RelPath  # relative to the snapshot folder, '/'-separated, every segment a safe name
    kind: Str
    size: NonNeg  # bytes as stored
    checksum: Checksum  # over the stored bytes
    records: NonNeg  # rows (Arrow), lines (JSON lines) or 1 (JSON)
    compression: Compression = "none"  # 'zstd': one zstd frame over the whole JSON-lines file
    content_size: NonNeg | None = None  # uncompressed bytes when compression == 'zstd'
    batches: NonNeg | None = None  # record batches in an Arrow file
    writer: Str = ""  # which participant wrote it (its part prefix)


class PartManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What one writer (a Gym server, the controller, the TQ adapter) wrote under its prefix."""

    format_version: Str
    snapshot_id: Name
    prefix: RelPath
    writer: Str
    files: list[FileEntry]
    written_at: float


class PartReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """What a writer hands back after writing its part: enough for the publisher to find and check
    the part manifest. It travels over HTTP in Gym's commit result."""

    prefix: RelPath
    writer: Str
    part_manifest_checksum: Checksum


class ParticipantCommit(msgspec.Struct, frozen=True, kw_only=True):
    """One Gym participant's commit result, as the manifest keeps it."""

    component: Str  # model | agent | resource
    name: Name
    part_prefix: RelPath | None = None  # None for a stateless participant that wrote nothing
    part_manifest_checksum: Checksum | None = None
    payload: dict[str, Any] = {}


class GymCommit(msgspec.Struct, frozen=True, kw_only=True):
    """Gym's commit result: the checkpoint id and each participant's commit."""

    checkpoint_id: Str
    participants: list[ParticipantCommit] = []


class ParentRef(msgspec.Struct, frozen=True, kw_only=True):
    snapshot_id: Name
    sequence: NonNeg


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """The table of contents of one snapshot; written once by the publisher, never changed."""

    format_version: Str
    required_features: list[Str] = []
    snapshot_id: Name
    sequence: Annotated[int, msgspec.Meta(ge=1)]
    created_at: float  # unix seconds, when the draft was begun
    committed_at: float  # unix seconds, when the publisher sealed the manifest to commit it
    files: Annotated[list[FileEntry], msgspec.Meta(max_length=1_000_000)]
    gym_commit: GymCommit | None = None
    topology_fingerprint: Fingerprint | None = None
    parent: ParentRef | None = None
    timings_s: dict[Str, float] = {}
    producer: Str = ""


class CommitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The commit point: created once, create-only, under ``_commits/``; names its manifest."""

    format_version: Str
    sequence: Annotated[int, msgspec.Meta(ge=1)]
    snapshot_id: Name
    manifest_size: NonNeg
    manifest_checksum: Checksum
    committed_at: float


class LatestHint(msgspec.Struct, frozen=True, kw_only=True):
    """Advisory pointer to the newest sequence; readers verify it and never trust it alone."""

    sequence: Annotated[int, msgspec.Meta(ge=1)]
    snapshot_id: Name


class StoreMarker(msgspec.Struct, frozen=True, kw_only=True):
    """``snapformat-store.json``: says that a folder or prefix is a snapshot store."""

    format: Literal["snapformat-store"] = "snapformat-store"
    format_version: Str = "1.0"
