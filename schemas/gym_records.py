"""Records that Gym servers write into a snapshot: continuations, agent state, model ledger,
token-storage index and session state. One JSON object per line; every record carries
``schema_version``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas.identity import check_capture_key, check_relative_path, check_rollout_id
from schemas.manifest import Name, NonNeg, RelPath, Str

SchemaVersion = Annotated[int, msgspec.Meta(ge=1)]
RolloutId = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
CallId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]

#: The description of every record's ``schema_version`` field (the same in each record).
SCHEMA_VERSION_META = msgspec.Meta(
    description="Version of this record's schema; 1 in format 1.0. Readers refuse a value above the one "
                "they understand.")


class AgentContinuationRoot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of ``continuations.jsonl``: a rollout parked at a boundary (a turn end, or a model
    answer whose actions are pending: Gym's ``pending_model``), as Gym's
    ``AgentContinuationRoot`` defines it (same fields, defaults, nullability; unknown fields refused).

    ``last_committed_model_call_id`` is the call after which the rollout continues on restore; a
    rollout parked before its first model call has no line (it starts its next run from the
    beginning). ``resource_state_revisions`` maps each resource server it depends on to the state
    revision it saw; null (the default) means an index written before dependency tracking.
    """

    # Gym: literal 1; a reader refuses a newer one naming both versions
    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    rollout_id: Annotated[RolloutId, msgspec.Meta(description="The rollout (Gym's rollout id rule).")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(
        description="The run of the rollout that was parked (0 for the first run).")]
    capture_key: Annotated[Str, msgspec.Meta(
        description="Gym's capture key of that run: `rollout_id`, or `<rollout_id>-a<N>` with "
                    "1 <= N <= `attempt_index`.")]
    last_committed_model_call_id: Annotated[CallId, msgspec.Meta(
        description="The rollout's last model call its boundary holds (non-empty): the one that ended its "
                    "last finished turn, or, at a `pending_model` boundary, the one whose answer awaits its "
                    "actions; on restore the rollout continues after it. A rollout parked before its first "
                    "call has no line.")]
    resource_state_revisions: Annotated[dict[str, int] | None, msgspec.Meta(
        description="For each resource server the rollout depends on (by its participant name), the state "
                    "revision it saw; `{}` when it depends on none; null (the default) in an index written "
                    "before dependency tracking.")] = None

    def __post_init__(self) -> None:
        check_capture_key(self.rollout_id, self.capture_key, self.attempt_index)


class AgentStateRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The agent server's own state of one rollout: parked mid-run, or finished and not yet ACKed.

    ``state`` is the agent's opaque JSON (conversation so far, turn counter...). ``restart_only``
    names restart-only resources the rollout used: such a rollout is discarded on restore.
    """

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    rollout_id: Annotated[RolloutId, msgspec.Meta(description="The rollout.")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(description="The run this state belongs to.")]
    capture_key: Annotated[Str, msgspec.Meta(
        description="Gym's capture key of that run (same rule as in continuations).")]
    status: Annotated[Literal["parked", "finished_unacked"], msgspec.Meta(
        description="`parked` (stopped at a turn end, to be continued) or `finished_unacked` (finished, its "
                    "result not yet acknowledged).")]
    turn_index: Annotated[NonNeg, msgspec.Meta(
        description="Number of turns finished, i.e. the 0-based index of the turn to run next.")]
    state: Annotated[Any, msgspec.Meta(
        description="The agent's own state of the rollout (conversation so far, counters...): opaque "
                    "JSON.")] = None
    restart_only: Annotated[list[Name], msgspec.Meta(
        description="Restart-only resources the rollout used; such a rollout is discarded on restore and "
                    "starts over.")] = []

    def __post_init__(self) -> None:
        check_capture_key(self.rollout_id, self.capture_key, self.attempt_index)


class ModelLedgerEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One committed model call (the policy model server's ledger)."""

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    rollout_id: Annotated[RolloutId, msgspec.Meta(description="The rollout that made the call.")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(description="The run that made the call.")]
    capture_key: Annotated[Str, msgspec.Meta(description="Gym's capture key of that run.")]
    model_call_id: Annotated[CallId, msgspec.Meta(description="The call's id, unique within its capture key.")]
    parent_call_id: Annotated[CallId | None, msgspec.Meta(
        description="The previous committed call of the same capture key; null for the first.")]
    turn_index: Annotated[NonNeg, msgspec.Meta(description="0-based turn in which the call was made.")]
    model: Annotated[Str, msgspec.Meta(description="Name of the model that answered (empty when unknown).")] = ""
    created_at: Annotated[float, msgspec.Meta(description="Unix seconds of the call (0.0 when unknown).")] = 0.0

    def __post_init__(self) -> None:
        check_capture_key(self.rollout_id, self.capture_key, self.attempt_index)


class TokenIndexEntry(msgspec.Struct, frozen=True, kw_only=True):
    """Where one model call's tokens live among the token-capture rows of this snapshot.

    ``file`` is relative to the snapshot folder; the rows are ``row_start`` ..
    ``row_start + row_count - 1`` of record batch ``batch`` of that Arrow file.
    """

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    capture_key: Annotated[Str, msgspec.Meta(description="Capture key of the call whose tokens are indexed.")]
    model_call_id: Annotated[CallId, msgspec.Meta(description="The model call.")]
    file: Annotated[RelPath, msgspec.Meta(
        description="Path, relative to the snapshot folder, of a `token_capture_rows` file of this "
                    "snapshot.")]
    batch: Annotated[NonNeg, msgspec.Meta(description="0-based record batch of that Arrow file.")]
    row_start: Annotated[NonNeg, msgspec.Meta(description="First row, 0-based within the batch.")]
    row_count: Annotated[int, msgspec.Meta(ge=1), msgspec.Meta(
        description="Number of rows (>= 1); every one of them MUST carry this `capture_key` and "
                    "`model_call_id`.")]

    def __post_init__(self) -> None:
        check_relative_path(self.file, where="file")


class SessionStateRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One resource session's exported state at a state revision.

    ``resource`` names the resource server as the participant does (its capability ``name``, the
    key of every continuation's ``resource_state_revisions``); ``tool`` is the kind of session
    within that server. Records written before ``tool`` existed held the tool in ``resource``.
    """

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    session_id: Annotated[Str, msgspec.Meta(
        description="The resource session's id, unique within its resource server.")]
    resource: Annotated[Name, msgspec.Meta(
        description="Name of the resource server that owns the session, as the participant names itself "
                    "(its capability `name`); the keys of `resource_state_revisions` name it the same way.")]
    state_revision: Annotated[NonNeg, msgspec.Meta(description="State revision the exported state is at.")]
    rollout_id: Annotated[RolloutId | None, msgspec.Meta(
        description="The rollout that owns the session, or null for a session not tied to one "
                    "rollout.")] = None
    state: Annotated[Any, msgspec.Meta(description="The session's exported state: opaque JSON.")] = None
    tool: Annotated[Name | None, msgspec.Meta(
        description="The kind of session within the resource server (a tool name), or null. Records "
                    "written before this field existed held the tool in `resource`; a reader MAY take "
                    "`resource` as the tool when `tool` is null.")] = None

    def __post_init__(self) -> None:
        if self.rollout_id is not None:
            check_rollout_id(self.rollout_id)
