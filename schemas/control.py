"""Gym's checkpoint control protocol, per-component generation (control schema version 1).

The names, fields, constraints and codes are Gym's and NeMo-RL's (``spec/CONTROL.md`` names the
source versions: Gym ``9380654e`` family, NeMo-RL ``d595189f``); ``spec/CONTROL.md`` is the
normative text. Every route lives under ``/ng-control/v1``:

* ``model-admission/{pause,status,resume,abort_inflight}`` and ``model-checkpoint/{commit,restore}``
  (the policy model server);
* ``agent-checkpoint/{acknowledge,acknowledge-completed,completion-receipt,prepare,status,commit,
  restore,resume,retire,discard-restored-continuation}`` (agent servers);
* ``resources-checkpoint/{prepare,status,commit,restore,resume,retire}`` (resources servers);
* ``GET capabilities`` (every server; the only route without the bearer token).

Every request struct refuses unknown fields (Gym's ``extra="forbid"``). Response structs are
decoded leniently by our client except :class:`Capabilities`, which NeMo-RL decodes strictly.
Gym's checkpoint files (``checkpoint_dir``) are in :mod:`schemas.gym_files`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from schemas.gym_files import ArtifactRef, GymId, Sha256Hex
from schemas.manifest import NonNeg

CONTROL_PREFIX = "/ng-control/v1"
CONTROL_SCHEMA_VERSION = 1
MAX_BODY_BYTES = 1 << 20  # control calls are small; bigger bodies are refused before decoding

#: The 401 body (FastAPI's default ``{"detail": ...}``, not the error envelope).
UNAUTHORIZED_DETAIL = "missing or invalid control-plane bearer token"

Component = Literal["responses_api_models", "responses_api_agents", "resources_servers"]
COMPONENTS: tuple[str, ...] = ("responses_api_models", "responses_api_agents", "resources_servers")
Phase = Literal["idle", "preparing", "prepared", "committing", "committed_paused", "restoring",
                "restore_failed_paused", "restored_paused"]
PHASES: tuple[str, ...] = ("idle", "preparing", "prepared", "committing", "committed_paused", "restoring",
                           "restore_failed_paused", "restored_paused")
AdmissionState = Literal["accepting", "draining", "paused"]
CheckpointMode = Literal["stateless", "restart_only", "export_restore"]
ConcurrencyContract = Literal["stateless", "serialized_per_session", "transactional_parallel"]
MultiProcessMode = Literal["single_worker", "coordinator", "unmanaged"]
InstanceRole = Literal["policy", "auxiliary"]


#: Every control error code Gym's servers answer (409 ``{"error": {"code", "detail"}}``), by owner.
ERROR_CODES: dict[str, tuple[str, ...]] = {
    "control": ("control_error", "stale_checkpoint", "checkpoint_conflict", "invalid_phase"),
    "model": ("not_a_policy_instance", "ledger_mismatch", "ledger_not_checkpointable", "ledger_not_quiescent"),
    "agent": ("agent_checkpoint_error", "duplicate_execution", "agent_admission_closed", "stale_attempt",
              "agent_prepare_incomplete", "completed_execution_acknowledgement_error"),
    "resources": ("resources_checkpoint_error", "resources_admission_closed", "stale_attempt",
                  "resources_session_unbound", "unsafe_resources_restore", "resource_revision_mismatch",
                  "resource_request_receipt_error", "resource_receipt_capacity_exhausted",
                  "resource_receipt_evicted", "resource_mutation_uncertain", "execution_identity_mismatch"),
    "admission": ("checkpoint_parked", "stale_attempt", "execution_identity_mismatch"),
}
#: NeMo-RL's coordinator-only model code (never sent by a server).
COORDINATOR_ONLY_CODES = ("missing_workers",)

#: Capability features NeMo-RL requires (§5 of CONTROL.md).
FEATURE_COMPLETED_RESULT_ACK = "completed_result_acknowledgement"
FEATURE_CONTINUATION_INDEX = "agent_continuation_index_v1"
FEATURE_DISCARD_RESTORED = "discard_restored_continuation_v1"
FEATURE_RESOURCE_DEPENDENCY_INDEX = "agent_resource_dependency_index_v1"
FEATURE_STORAGE_REFERENCE_INDEX = "external_storage_reference_index_v1"

#: Data-plane headers (Gym's names).
HEADER_ROLLOUT_ID = "x-nemo-gym-rollout-id"
HEADER_ATTEMPT_INDEX = "x-nemo-gym-attempt-index"
HEADER_PLANE = "x-nemo-gym-plane"
HEADER_EXECUTION_GENERATION = "x-nemo-gym-agent-execution-generation"
HEADER_MODEL_CALL_ID = "x-nemo-gym-model-call-id"
HEADER_RESOURCE_REVISION = "x-nemo-gym-resource-state-revision"
HEADER_EXPECTED_REVISION = "x-nemo-gym-expected-resource-state-revision"
HEADER_RESOURCE_REQUEST_ID = "x-nemo-gym-resource-request-id"


def _check_finite(value: float, field: str) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number of seconds, got {value!r}")


# -- requests ------------------------------------------------------------------------------------
class ControlRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The common body: every fenced call carries its checkpoint id and an absolute deadline."""

    schema_version: Annotated[Literal[1], msgspec.Meta(description="Control schema version: 1.")] = 1
    checkpoint_id: Annotated[GymId, msgspec.Meta(
        description="The checkpoint this call belongs to (1-128 characters, `^[A-Za-z0-9][A-Za-z0-9._-]*$`).")]
    deadline_ts: Annotated[float, msgspec.Meta(
        description="Absolute deadline, Unix seconds (finite). Never refused on entry; the time left clamps "
                    "at 0 (CONTROL.md §2).")]

    def __post_init__(self) -> None:
        _check_finite(self.deadline_ts, "deadline_ts")


class CheckpointDirRequest(ControlRequest, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Commit and restore of agents and resources: the folder the participant writes or reads."""

    checkpoint_dir: Annotated[str, msgspec.Meta(min_length=1, max_length=4096, description=(
        "The folder the participant writes its files into (commit) or reads them from (restore); each "
        "participant keeps to its own subfolder (CONTROL.md §6)."))]


class ModelCommitRequest(CheckpointDirRequest, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The model's commit: given every agent's continuation index, it writes the ledger of exactly
    the calls those continuations depend on."""

    continuation_indexes: Annotated[list[ArtifactRef], msgspec.Meta(
        description="The agents' continuation-index references, as their commits answered them (required).")]


class AttemptRequest(ControlRequest, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``abort_inflight``, ``retire`` and ``discard-restored-continuation``: one rollout attempt."""

    rollout_id: Annotated[GymId, msgspec.Meta(description="The rollout.")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(
        description="The attempt (for discard: the replacement attempt, source + 1).")]


class CompletionReceipt(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A server-issued receipt of a completed result; the controller sends it back unchanged."""

    rollout_id: GymId
    attempt_index: NonNeg
    execution_generation: Annotated[int, msgspec.Meta(ge=1, description=(
        "1 at the attempt's first `/run`, +1 at each re-begin."))]
    result_identity: Annotated[str, msgspec.Meta(min_length=1, max_length=512, description=(
        "`str(result['id'])`, else `str(result['response']['id'])`, else the digest."))]
    result_digest: Annotated[Sha256Hex, msgspec.Meta(description=(
        "SHA-256 hex of the result's JSON, sort_keys, separators (',', ':'), ASCII escapes, UTF-8."))]


class AcknowledgeCompletedRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``acknowledge-completed``: a batch of receipts, validated whole before anything is released."""

    schema_version: Literal[1] = 1
    executions: Annotated[list[CompletionReceipt], msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        seen: set[tuple[str, int]] = set()
        for r in self.executions:
            key = (r.rollout_id, r.attempt_index)
            if key in seen:
                raise ValueError(f"executions: ({r.rollout_id!r}, {r.attempt_index}) is listed twice")
            seen.add(key)


# -- capabilities --------------------------------------------------------------------------------
class MultiProcess(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: MultiProcessMode
    num_workers: Annotated[int, msgspec.Meta(ge=1)] = 1


class Capabilities(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``GET /ng-control/v1/capabilities``: the server's declaration merged with its live fence state.

    NeMo-RL refuses any other key, so this struct does too.
    """

    component: Component
    name: Annotated[str, msgspec.Meta(min_length=1, description="Becomes NeMo-RL's participant_name.")]
    schema_version: int = CONTROL_SCHEMA_VERSION
    admission_states: list[AdmissionState] = msgspec.field(default_factory=lambda: ["accepting"])
    checkpoint_mode: CheckpointMode = "stateless"
    concurrency_contract: ConcurrencyContract = "stateless"
    multi_process: MultiProcess
    instance_role: InstanceRole | None = None
    features: list[str] = []
    phase: Phase = "idle"
    active_checkpoint_id: str | None = None
    deadline_ts: float | None = None

    def declaration(self) -> Capabilities:
        """The same declaration without live state (phase idle, no active id or deadline)."""
        return msgspec.structs.replace(self, phase="idle", active_checkpoint_id=None, deadline_ts=None)

    def contract(self, server_name: str | None = None) -> dict[str, Any]:
        """The participant contract the topology fingerprint covers (NeMo-RL's shape, features
        included; :func:`schemas.topology.topology_fingerprint` drops them before hashing)."""
        return {
            "participant": {"server_name": server_name if server_name is not None else self.name,
                            "component": self.component, "participant_name": self.name},
            "schema_version": self.schema_version,
            "admission_states": sorted(self.admission_states),
            "checkpoint_mode": self.checkpoint_mode,
            "concurrency_contract": self.concurrency_contract,
            "multi_process": {"mode": self.multi_process.mode, "num_workers": self.multi_process.num_workers},
            "instance_role": self.instance_role,
            "features": sorted(self.features),
        }


# -- shared reply pieces ---------------------------------------------------------------------------
class AttemptRef(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    attempt_index: int


class Workers(msgspec.Struct, frozen=True, kw_only=True):
    acknowledged: int = 1
    expected: int = 1


class WorkerState(msgspec.Struct, frozen=True, kw_only=True):
    state: AdmissionState
    inflight: int


class InflightCall(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    attempt_index: int
    plane: str
    age_seconds: float


# -- model replies -----------------------------------------------------------------------------------
class ModelPauseResponse(msgspec.Struct, frozen=True, kw_only=True):
    state: AdmissionState
    workers: Workers
    inflight_total: int
    waiters_total: int


class ModelStatusResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    state: AdmissionState
    per_worker: dict[str, WorkerState]
    inflight_total: int
    waiters_total: int
    inflight: list[InflightCall]
    tombstones: list[AttemptRef]


class ModelResumeResponse(msgspec.Struct, frozen=True, kw_only=True):
    state: Literal["accepting"]
    workers: Workers
    released_waiters: int = 0


class AbortInflightResponse(msgspec.Struct, frozen=True, kw_only=True):
    state: AdmissionState
    aborted_inflight: int
    inflight_total: int


class ModelCommitResponse(msgspec.Struct, frozen=True, kw_only=True):
    rollouts: int
    rows: int
    excluded_tombstoned: int
    excluded_inactive: int
    manifest_digest: Sha256Hex
    storage_reference_index: ArtifactRef


class ModelRestoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    rollouts: int
    rows: int
    checkpoint_id: str
    tombstones: list[AttemptRef]
    source_attempts: list[AttemptRef]
    storage_reference_index: ArtifactRef


# -- agent replies -----------------------------------------------------------------------------------
ExecutionState = Literal["running", "park_requested", "parked", "completed", "retired"]
ParkedBoundaryState = Literal["parked_with_boundary", "parked_without_boundary"]
BoundaryKind = Literal["pending_model", "turn_complete"]


class Execution(msgspec.Struct, frozen=True, kw_only=True):
    """One execution (rollout attempt) in an agent's status; ``completion_receipt`` only when completed."""

    rollout_id: str
    attempt_index: int
    generation: int
    state: ExecutionState
    parked_boundary_state: ParkedBoundaryState | None = None
    boundary_index: int | None = None
    turn_index: int | None = None
    boundary_kind: BoundaryKind | None = None
    resource_state_revisions: dict[str, int] = {}
    age_seconds: float = 0.0
    completion_receipt: CompletionReceipt | msgspec.UnsetType = msgspec.UNSET


class SelectedBoundary(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    attempt_index: int
    boundary_index: int
    turn_index: int
    boundary_kind: BoundaryKind
    resource_state_revisions: dict[str, int] = {}


class AgentStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The agent status object (prepare's reply; ``status`` adds ``checkpoint_id``)."""

    checkpoint_id: str | None | msgspec.UnsetType = msgspec.UNSET
    state: Literal["accepting", "preparing"]
    ready_to_commit: bool
    running: int = 0
    parked: int = 0
    parked_with_boundary: int = 0
    parked_without_boundary: int = 0
    completed_unacknowledged: int = 0
    acknowledged_completed: int = 0
    active: int = 0
    blocking_attempts: list[Execution] = []
    completed_unacknowledged_attempts: list[Execution] = []
    executions: list[Execution] = []
    selected_boundaries: list[SelectedBoundary] = []


class AcknowledgeResponse(msgspec.Struct, frozen=True, kw_only=True):
    acknowledged: bool
    idempotent: bool


class AcknowledgeCompletedResponse(msgspec.Struct, frozen=True, kw_only=True):
    acknowledged: list[CompletionReceipt]


class AgentCommitResponse(msgspec.Struct, frozen=True, kw_only=True):
    records: int
    manifest_digest: Sha256Hex
    continuation_index: ArtifactRef


class AgentRestoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    records: int
    source_checkpoint_id: str
    continuation_index: ArtifactRef


class AgentResumeResponse(msgspec.Struct, frozen=True, kw_only=True):
    state: Literal["accepting"]
    released: int


class AgentRetireResponse(msgspec.Struct, frozen=True, kw_only=True):
    retired: bool
    tombstoned: bool
    completed_unacknowledged: bool | msgspec.UnsetType = msgspec.UNSET


class DiscardResponse(msgspec.Struct, frozen=True, kw_only=True):
    discarded: bool


# -- resources replies ---------------------------------------------------------------------------------
class InventoryEntry(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    attempt_index: int
    revision: int
    mutation_receipts: int


class ResourcesPrepareResponse(msgspec.Struct, frozen=True, kw_only=True):
    sessions: int
    state: Literal["prepared"]
    inventory: list[InventoryEntry]


class ResourcesCommitResponse(msgspec.Struct, frozen=True, kw_only=True):
    sessions: int
    manifest_digest: Sha256Hex


class ResourcesRestoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    sessions: int
    source_checkpoint_id: str


class ResourcesResumeResponse(msgspec.Struct, frozen=True, kw_only=True):
    state: Literal["accepting"]


class ResourcesRetireResponse(msgspec.Struct, frozen=True, kw_only=True):
    retired: bool
    rollout_id: str
    attempt_index: int


class ResourcesStatusResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Gym answers its admission state in ``state`` (as ``admission_state``), plus diagnostics."""

    checkpoint_id: str
    state: AdmissionState
    admission_state: AdmissionState
    sessions: int
    per_session: list[dict[str, Any]] = []
    prepared_inventory: list[InventoryEntry] = []


# -- errors ------------------------------------------------------------------------------------------------
class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    detail: str


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    """Every 409 (and the model admission middleware's refusals): ``{"error": {"code", "detail"}}``."""

    error: ErrorBody


class DetailBody(msgspec.Struct, frozen=True, kw_only=True):
    """FastAPI's bodies: 401 (a string) and 422 (a list of validation errors)."""

    detail: Any
