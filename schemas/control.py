"""The checkpoint control protocol between the coordinator and each Gym server (version 1);
``spec/CONTROL.md`` is the normative text.

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
# Whole string (``$`` alone would also take a trailing newline): see ``schemas.manifest.Checksum``.
CheckpointId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$(?![\s\S])")]
Deadline = Annotated[float, msgspec.Meta(gt=0)]


#: Descriptions shared by the fields of several messages. Section numbers (§) are those of
#: ``spec/CONTROL.md``; "SPEC §" those of ``spec/SPEC.md``.
_CHECKPOINT_ID = ("The checkpoint this call belongs to (fencing, §5): one id per save, a fresh one per "
                  "restore.")
_DEADLINE = ("Absolute deadline, unix seconds (> 0). A call received at or after it is refused with 409 "
             "`deadline_passed`; work that outlasts it is cut short (§5).")


class Concurrency(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """How a server may be called while a checkpoint is in progress."""

    max_in_flight: Annotated[NonNeg, msgspec.Meta(
        description="Most work calls (model calls, tool calls, turns) the server runs at once; 0 means "
                    "unbounded. Informative for the coordinator's deadlines.")] = 0
    multi_process: Annotated[Literal["single", "shared_state"], msgspec.Meta(
        description="`single`: one process holds all of the server's state. `shared_state`: several "
                    "processes serve one state behind one address; the server still answers every control "
                    "call as one server, pausing all of them, and writes one part.")] = "single"


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /capabilities``: who the server is and what it can do."""

    schema_version: Annotated[int, msgspec.Meta(
        description="Version of the control protocol the server speaks; 1 here. A coordinator refuses a "
                    "server with a version it does not know.")] = CONTROL_SCHEMA_VERSION
    component: Annotated[Component, msgspec.Meta(
        description="What kind of Gym server this is: `model` (policy model server), `agent` or "
                    "`resource`.")]
    name: Annotated[Name, msgspec.Meta(
        description="The server's name, a safe name unique among the servers of its component; its part "
                    "prefix is `gym/<component>/<name>`.")]
    checkpoint_mode: Annotated[CheckpointMode, msgspec.Meta(
        description="`export_restore`: the server writes a part at commit and loads it at restore. "
                    "`stateless`: it only pauses and resumes; its commit answers `part: null` and its "
                    "restore loads nothing.")]
    admission: Annotated[Admission, msgspec.Meta(
        description="Live: whether the server admits new work now (`accepting` in `idle`, `draining` in "
                    "`preparing`, `paused` in every other phase). Not part of the contract.")] = "accepting"
    phase: Annotated[Phase, msgspec.Meta(
        description="Live: the server's phase (§3). Not part of the contract.")] = "idle"
    concurrency: Annotated[Concurrency, msgspec.Meta(
        description="How the server runs its work (see `Concurrency`); part of the contract.")] = Concurrency()
    restart_only_resources: Annotated[list[Name], msgspec.Meta(
        description="Resource kinds whose state the server cannot export (e.g. a live sandbox process): "
                    "their sessions are not saved, and a rollout that used one starts over after a restore. "
                    "Empty for models and agents.")] = []

    def contract(self) -> dict[str, Any]:
        """The part of the capabilities the topology fingerprint covers (not live state)."""
        return {"component": self.component, "name": self.name, "schema_version": self.schema_version,
                "checkpoint_mode": self.checkpoint_mode, "concurrency": msgspec.to_builtins(self.concurrency),
                "restart_only_resources": sorted(self.restart_only_resources)}


class ControlRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prepare, pause, resume, abort, status: a checkpoint id and a deadline."""

    checkpoint_id: Annotated[CheckpointId, msgspec.Meta(description=_CHECKPOINT_ID)]
    deadline: Annotated[Deadline, msgspec.Meta(description=_DEADLINE + " Not checked by resume and abort.")]


class CommitRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Write this server's part into the unpublished snapshot at ``draft_url`` under ``part_prefix``.

    ``continuations`` (model commit only): the agents' part receipts, so the model server writes
    the ledger for exactly the turns the agents' continuation indexes name.
    """

    checkpoint_id: Annotated[CheckpointId, msgspec.Meta(description=_CHECKPOINT_ID)]
    deadline: Annotated[Deadline, msgspec.Meta(description=_DEADLINE)]
    draft_url: Annotated[str, msgspec.Meta(min_length=1, max_length=4096), msgspec.Meta(
        description="Location of the unpublished snapshot (the draft), `<store>/snapshots/<snapshot_id>` "
                    "(a local path or `s3://bucket/prefix/snapshots/<snapshot_id>`). The server writes its "
                    "part into it and nowhere else.")]
    part_prefix: Annotated[RelPath, msgspec.Meta(
        description="The prefix to write under; MUST be exactly `gym/<component>/<name>` of this server, "
                    "or the call is refused (400 `bad_request`).")]
    continuations: Annotated[list[PartReceipt], msgspec.Meta(
        description="Model commits only: the part receipts of every agent's commit of this checkpoint, so "
                    "the model writes the ledger of exactly the turns the agents' continuation indexes "
                    "name. Empty for agents and resources, which ignore it.")] = []


class CommitResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: Annotated[CheckpointId, msgspec.Meta(description="The checkpoint committed.")]
    phase: Annotated[Phase, msgspec.Meta(description="`committed_paused`.")]
    part: Annotated[PartReceipt | None, msgspec.Meta(
        description="The receipt of the part the server wrote and closed (its prefix, writer label "
                    "`<component>:<name>` and part manifest checksum); null for a stateless server.")] = None
    payload: Annotated[dict[str, Any], msgspec.Meta(
        description="The server's commit payload (a small JSON object); the coordinator copies it verbatim "
                    "into the manifest's `ParticipantCommit.payload`.")] = {}


class RestoreRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Load this server's part of a published snapshot and stay paused."""

    checkpoint_id: Annotated[CheckpointId, msgspec.Meta(
        description="The restore's own id (fresh, never used before); resume and discard after the "
                    "restore carry it.")]
    deadline: Annotated[Deadline, msgspec.Meta(description=_DEADLINE)]
    snapshot_url: Annotated[str, msgspec.Meta(min_length=1, max_length=4096), msgspec.Meta(
        description="Location of a published snapshot, `<store>/snapshots/<snapshot_id>`; it is opened "
                    "through its commit record (SPEC §15.3, SPEC §15.4).")]
    saved_checkpoint_id: Annotated[Str, msgspec.Meta(
        description="The checkpoint id the snapshot was saved under (its manifest's "
                    "`gym_commit.checkpoint_id`); a snapshot whose Gym commit names another id is refused "
                    "(400 `bad_request`).")]
    part_prefix: Annotated[RelPath, msgspec.Meta(
        description="The prefix to read; MUST be exactly `gym/<component>/<name>` of this server.")]
    topology_fingerprint: Annotated[Str, msgspec.Meta(
        description="The running topology's fingerprint (§2), computed by the coordinator; the server "
                    "refuses a snapshot with another fingerprint (409 `topology_mismatch`).")]


class RestoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: Annotated[CheckpointId, msgspec.Meta(description="The restore's id.")]
    phase: Annotated[Phase, msgspec.Meta(description="`restored_paused`.")]
    payload: Annotated[dict[str, Any], msgspec.Meta(
        description="What the server loaded (a JSON object). The agent lists the restored continuations "
                    "and the finished results not yet acknowledged (§6); informative for the others.")] = {}


class RolloutRef(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200), msgspec.Meta(
        description="The rollout (Gym's rollout id rule).")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(
        description="The run of the rollout meant: for acknowledge the run that finished, for discard the "
                    "new run n+1 the restore set up.")]


class AcknowledgeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The controller stored these finished results durably; the agent may forget them."""

    results: Annotated[list[RolloutRef], msgspec.Meta(max_length=100_000), msgspec.Meta(
        description="Finished results the controller has stored durably, which the agent may now forget "
                    "(at most 100,000 per call).")]


class DiscardRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Throw away restored continuations (they used a restart-only resource): they start over."""

    checkpoint_id: Annotated[CheckpointId, msgspec.Meta(description="The restore's id.")]
    deadline: Annotated[Deadline, msgspec.Meta(description=_DEADLINE)]
    rollouts: Annotated[list[RolloutRef], msgspec.Meta(max_length=100_000), msgspec.Meta(
        description="Restored continuations to throw away (at most 100,000): each of these rollouts starts "
                    "over from its first turn.")]


class PhaseResponse(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: Annotated[str | None, msgspec.Meta(
        description="The checkpoint in progress, or null in `idle`.")]
    phase: Annotated[Phase, msgspec.Meta(description="The server's phase after the call.")]
    admission: Annotated[Admission, msgspec.Meta(
        description="`accepting`, `draining` or `paused` (as in `Capabilities`).")]
    in_flight: Annotated[NonNeg, msgspec.Meta(
        description="Work still running (model calls, turns inside an agent, tool calls); 0 once "
                    "prepared.")] = 0
    detail: Annotated[dict[str, Any], msgspec.Meta(
        description="Server-specific information (informative).")] = {}


class ControlError(msgspec.Struct, frozen=True, kw_only=True):
    """Every 4xx/5xx body: a machine-readable ``error`` and a sentence for people."""

    error: Annotated[Literal["unauthorized", "bad_request", "too_large", "wrong_phase", "conflicting_checkpoint",
                             "stale_checkpoint", "deadline_passed", "unknown_rollout", "invalid_record",
                             "topology_mismatch", "internal"], msgspec.Meta(
        description="The machine-readable reason (§7).")]
    reason: Annotated[Str, msgspec.Meta(
        description="A sentence for people; it names what was wrong (both fingerprints for a topology "
                    "mismatch, the checkpoint in progress for a conflict). It never contains the token.")]
    phase: Annotated[Phase | None, msgspec.Meta(
        description="The server's phase after the refusal; null when the call was refused before its body "
                    "was decoded (401, 413, malformed body).")] = None
    checkpoint_id: Annotated[str | None, msgspec.Meta(
        description="The checkpoint id the refused call named, else the one in progress; null when neither "
                    "is known.")] = None
