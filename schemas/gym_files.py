"""The files Gym's participants write into ``checkpoint_dir`` (CONTROL.md §6), field for field.

Layout (each participant keeps to its own folder)::

    agent/instance-<sha256hex(utf8 instance_name)>/
        agent-part-000000.tar ...   members <rid>.a<n>.json: AgentBoundaryRecord, indent 2
        agent-index.jsonl           AgentIndexEntry rows
        continuations.jsonl         AgentContinuationRoot rows
        manifest.json               AgentManifest (sort_keys, indent 2)
    model-ledger/<server_name>/
        <capture_key>.lineage.jsonl byte copy of the live lineage file
        storage-references.jsonl    ExternalStorageReference rows
        manifest.json               LedgerManifest (sort_keys, indent 1)
    resources/<server_name>/
        <rid>.a<n>.json             ResourceSnapshot, indent 2
        manifest.json               ResourcesManifest (sort_keys, indent 2)

JSON-lines rows are compact (declaration order, no spaces) plus ``\\n``; an :class:`ArtifactRef`
binds such a file by ``sha256`` over every byte, ``bytes`` and ``records``. ``manifest_digest``
is the SHA-256 hex of a manifest's exact bytes. No I/O here: ``gymkit.checkpoint_dir`` writes and
reads these, ``snapformat.adopt`` checks them before a snapshot is published.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec

from schemas.manifest import NonNeg

Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[a-f0-9]{64}$(?![\s\S])")]
#: Gym's id rule (checkpoint and rollout ids): 1-128 characters, whole string (`$` alone would
#: also take a trailing newline; pydantic's regex does not).
GymId = Annotated[str, msgspec.Meta(min_length=1, max_length=128,
                                    pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$(?![\s\S])")]

AGENT_DIR = "agent"
LEDGER_DIR = "model-ledger"
RESOURCES_DIR = "resources"
MANIFEST_NAME = "manifest.json"
CONTINUATIONS_NAME = "continuations.jsonl"
AGENT_INDEX_NAME = "agent-index.jsonl"
STORAGE_REFERENCES_NAME = "storage-references.jsonl"
AGENT_ARCHIVE_MAX_MEMBERS = 512
AGENT_ARCHIVE_MAX_BYTES = 64 << 20
GYM_FILES_SCHEMA_VERSION = 2  # the manifests' schema_version


def agent_instance_dir(instance_name: str | None) -> str:
    """``agent/instance-<sha256hex(utf8 name)>``, or ``agent`` when the instance has no name."""
    if instance_name is None:
        return AGENT_DIR
    return f"{AGENT_DIR}/instance-{hashlib.sha256(instance_name.encode()).hexdigest()}"


def ledger_dir(server_name: str) -> str:
    return f"{LEDGER_DIR}/{server_name}"


def resources_dir(server_name: str) -> str:
    return f"{RESOURCES_DIR}/{server_name}"


#: Gym's component names -> the folder of ``checkpoint_dir`` each participant writes.
_PARTICIPANT_DIRS = {"responses_api_agents": agent_instance_dir, "responses_api_models": ledger_dir,
                     "resources_servers": resources_dir}


def participant_dir(component: str, name: str) -> str:
    """The folder of ``checkpoint_dir`` a participant of ``component`` named ``name`` writes (CONTROL.md §6)."""
    try:
        return _PARTICIPANT_DIRS[component](name)
    except KeyError:
        raise ValueError(f"component {component!r} is not one of {sorted(_PARTICIPANT_DIRS)}") from None


def agent_archive_name(index: int) -> str:
    return f"agent-part-{index:06d}.tar"


def attempt_member(rollout_id: str, attempt_index: int) -> str:
    """``<rid>.a<n>.json``: an agent archive member, or a resources snapshot file."""
    return f"{rollout_id}.a{attempt_index}.json"


class ArtifactRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A digest-bound reference to a JSON-lines file under ``checkpoint_dir`` (extra=forbid, frozen)."""

    schema_version: Literal[1] = 1
    relative_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096, description=(
        "Relative to `checkpoint_dir`; never absolute, never `..`."))]
    sha256: Annotated[Sha256Hex, msgspec.Meta(description="SHA-256 hex over every byte, newlines included.")]
    records: Annotated[NonNeg, msgspec.Meta(description="Non-blank lines.")]
    bytes: Annotated[NonNeg, msgspec.Meta(description="The file's size.")]

    def __post_init__(self) -> None:
        parts = self.relative_path.split("/")
        if self.relative_path.startswith("/") or "\\" in self.relative_path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"relative_path {self.relative_path!r} must be relative, without '.', '..' or empty "
                             "segments")


# -- agent ---------------------------------------------------------------------------------------------
class AgentArchive(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    sha256: Sha256Hex
    members: NonNeg
    bytes: NonNeg


class AgentManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: Literal[2] = 2
    checkpoint_id: GymId
    instance_name: str | None
    archives: list[AgentArchive]
    record_index: ArtifactRef
    records: NonNeg
    continuation_index: ArtifactRef


class AgentIndexEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of ``agent-index.jsonl``: where a boundary record lies among the archives."""

    rollout_id: GymId
    attempt_index: NonNeg
    archive: str
    member: str
    sha256: Sha256Hex
    bytes: NonNeg


class PendingModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_call_id: str
    response: dict[str, Any]
    model_server_cookies: dict[str, Any] = {}
    usage: dict[str, Any] | None = None
    pending_action_cursor: NonNeg = 0
    resource_request_id: str | None = None


class AgentBoundaryRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An archive member: one parked execution at its selected boundary (extra=forbid)."""

    schema_version: Literal[1, 2] = 2
    rollout_id: GymId
    attempt_index: NonNeg
    boundary_index: NonNeg
    turn_index: NonNeg | None = None  # Gym: defaults to boundary_index
    boundary_kind: Literal["pending_model", "turn_complete"] = "turn_complete"
    pending_model: PendingModel | None = None
    output_items: list[dict[str, Any]] = []
    usage: dict[str, Any] | None = None
    last_committed_model_call_id: str | None = None
    resource_state_revisions: dict[str, int] = {}
    agent_state: dict[str, Any] = {}
    created_at: float = 0.0

    def __post_init__(self) -> None:
        if (self.boundary_kind == "pending_model") != (self.pending_model is not None):
            raise ValueError("pending_model is required exactly when boundary_kind is 'pending_model'")

    @property
    def turn(self) -> int:
        return self.boundary_index if self.turn_index is None else self.turn_index


# -- model ledger ----------------------------------------------------------------------------------------
class LedgerRollout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    files: dict[str, Sha256Hex]
    rows: NonNeg
    bytes: NonNeg


class AttemptEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    rollout_id: GymId
    attempt_index: NonNeg


class LedgerManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: Literal[2] = 2
    checkpoint_id: GymId
    server_name: str
    rollouts: dict[str, LedgerRollout]
    continuation_roots_sha256: Sha256Hex
    continuation_roots: NonNeg
    excluded_inactive: NonNeg
    storage_reference_index: ArtifactRef
    tombstones: list[AttemptEntry] = []
    source_attempts: list[AttemptEntry] = []


class ExternalStorageReference(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of ``storage-references.jsonl``: a token-capture staging key a root depends on."""

    schema_version: Literal[1] = 1
    capture_key: str
    boundary_model_call_id: str
    kind: Literal["token_capture_staging", "generation_prefix_cut"] = "token_capture_staging"
    key: str


# -- resources ------------------------------------------------------------------------------------------------
class MutationReceipt(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    expected_revision: int | None
    input_digest: Sha256Hex
    status: int
    headers: list[tuple[str, str]]
    body_base64: str
    resulting_revision: int | None  # Gym: null for a refused call


class ResourceSnapshot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: Literal[1, 2] = 2
    rollout_id: GymId
    attempt_index: NonNeg
    state_revision: NonNeg
    state: Any = None
    mutation_receipts: list[MutationReceipt] = []
    created_at: float = 0.0


class ResourcesManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: Literal[2] = 2
    checkpoint_id: GymId
    server_name: str
    files: dict[str, Sha256Hex]
