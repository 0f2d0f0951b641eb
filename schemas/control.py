"""The checkpoint control protocol between the coordinator and each Gym server (version 1).

Routes live under ``/ng-control/v1`` and need ``Authorization: Bearer <token>``. Every call that
changes state carries the ``checkpoint_id`` it belongs to and an absolute ``deadline`` (unix
seconds). Repeating a call is answered the same (idempotent); a call for another checkpoint while
one is in progress, or for one that already ended, is refused with 409 and a reason.

Phases and allowed transitions (anything else is a 409 ``wrong_phase``):

    idle             --prepare-->  preparing --(parked, 0 in flight)--> prepared
    preparing|prepared --commit--> committing --(part written)--> committed_paused
    preparing|prepared|committing|committed_paused --abort/resume--> idle
    idle             --restore-->  restoring --(state loaded)--> restored_paused
    restoring        --(load failed)--> failed_restore   (resume refused; abort returns to idle, empty)
    restored_paused  --resume-->   idle

The model server's admission (pause / status / resume / abort) is the same machine: ``pause`` is
its prepare. Prepare order is models, agents, resources; commit order agents, models (given the
agents' continuation receipts), resources; resume order resources, models, agents.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas.manifest import Name, NonNeg, PartReceipt, RelPath, Str

CONTROL_PREFIX = "/ng-control/v1"
CONTROL_SCHEMA_VERSION = 1
MAX_BODY_BYTES = 1 << 20  # control calls are small; bigger bodies are refused before decoding

Component = Literal["model", "agent", "resource"]
Phase = Literal["idle", "preparing", "prepared", "committing", "committed_paused", "restoring",
                "restored_paused", "failed_restore"]
Admission = Literal["accepting", "draining", "paused"]
CheckpointMode = Literal["stateless", "export_restore"]
CheckpointId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
Deadline = Annotated[float, msgspec.Meta(gt=0)]


class Concurrency(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """How a server may be called while a checkpoint is in progress."""

    max_in_flight: NonNeg = 0  # 0: unbounded
    multi_process: Literal["single", "shared_state"] = "single"


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /capabilities``: who the server is and what it can do."""

    schema_version: int = CONTROL_SCHEMA_VERSION
    component: Component
    name: Name
    checkpoint_mode: CheckpointMode
    admission: Admission = "accepting"
    phase: Phase = "idle"
    concurrency: Concurrency = Concurrency()
    restart_only_resources: list[Name] = []  # resource kinds whose state cannot be exported

    def contract(self) -> dict[str, Any]:
        """The part of the capabilities the topology fingerprint covers (not live state)."""
        return {"component": self.component, "name": self.name, "schema_version": self.schema_version,
                "checkpoint_mode": self.checkpoint_mode, "concurrency": msgspec.to_builtins(self.concurrency),
                "restart_only_resources": sorted(self.restart_only_resources)}


class ControlRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prepare, pause, resume, abort, status: a checkpoint id and a deadline."""

    checkpoint_id: CheckpointId
    deadline: Deadline


class CommitRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Write this server's part into the unpublished snapshot at ``draft_url`` under ``part_prefix``.

    ``continuations`` (model commit only): the agents' part receipts, so the model server writes
    the ledger for exactly the turns the agents' continuation indexes name.
    """

    checkpoint_id: CheckpointId
    deadline: Deadline
    draft_url: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    part_prefix: RelPath
    continuations: list[PartReceipt] = []


class CommitResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: CheckpointId
    phase: Phase
    part: PartReceipt | None = None  # None for a stateless server
    payload: dict[str, Any] = {}


class RestoreRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Load this server's part of a published snapshot and stay paused."""

    checkpoint_id: CheckpointId  # the restore's own id
    deadline: Deadline
    snapshot_url: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    saved_checkpoint_id: Str
    part_prefix: RelPath
    topology_fingerprint: Str


class RestoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: CheckpointId
    phase: Phase
    payload: dict[str, Any] = {}


class RolloutRef(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    attempt_index: NonNeg


class AcknowledgeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The controller stored these finished results durably; the agent may forget them."""

    results: Annotated[list[RolloutRef], msgspec.Meta(max_length=100_000)]


class DiscardRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Throw away restored continuations (they used a restart-only resource): they start over."""

    checkpoint_id: CheckpointId
    deadline: Deadline
    rollouts: Annotated[list[RolloutRef], msgspec.Meta(max_length=100_000)]


class PhaseResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str | None
    phase: Phase
    admission: Admission
    in_flight: NonNeg = 0
    detail: dict[str, Any] = {}


class ControlError(msgspec.Struct, frozen=True, kw_only=True):
    """Every 4xx/5xx body: a machine-readable ``error`` and a sentence for people."""

    error: Literal["unauthorized", "bad_request", "too_large", "wrong_phase", "conflicting_checkpoint",
                   "stale_checkpoint", "deadline_passed", "unknown_rollout", "invalid_record",
                   "topology_mismatch", "internal"]
    reason: Str
    phase: Phase | None = None
    checkpoint_id: str | None = None
