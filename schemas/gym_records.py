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


class AgentContinuationRoot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of ``continuations.jsonl``: a rollout parked at a turn end, as Gym's
    ``AgentContinuationRoot`` defines it (same fields, defaults, nullability; unknown fields refused).

    ``last_committed_model_call_id`` is the call after which the rollout continues on restore; a
    rollout parked before its first model call has no line (it starts its next run from the
    beginning). ``resource_state_revisions`` maps each resource server it depends on to the state
    revision it saw; null (the default) means an index written before dependency tracking.
    """

    schema_version: SchemaVersion = 1  # Gym: literal 1; a reader refuses a newer one naming both versions
    rollout_id: RolloutId
    attempt_index: NonNeg
    capture_key: Str
    last_committed_model_call_id: CallId
    resource_state_revisions: dict[str, int] | None = None

    def __post_init__(self) -> None:
        check_capture_key(self.rollout_id, self.capture_key, self.attempt_index)


class AgentStateRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The agent server's own state of one rollout: parked mid-run, or finished and not yet ACKed.

    ``state`` is the agent's opaque JSON (conversation so far, turn counter...). ``restart_only``
    names restart-only resources the rollout used: such a rollout is discarded on restore.
    """

    schema_version: SchemaVersion = 1
    rollout_id: RolloutId
    attempt_index: NonNeg
    capture_key: Str
    status: Literal["parked", "finished_unacked"]
    turn_index: NonNeg
    state: Any = None
    restart_only: list[Name] = []

    def __post_init__(self) -> None:
        check_capture_key(self.rollout_id, self.capture_key, self.attempt_index)


class ModelLedgerEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One committed model call (the policy model server's ledger)."""

    schema_version: SchemaVersion = 1
    rollout_id: RolloutId
    attempt_index: NonNeg
    capture_key: Str
    model_call_id: CallId
    parent_call_id: CallId | None
    turn_index: NonNeg
    model: Str = ""
    created_at: float = 0.0

    def __post_init__(self) -> None:
        check_capture_key(self.rollout_id, self.capture_key, self.attempt_index)


class TokenIndexEntry(msgspec.Struct, frozen=True, kw_only=True):
    """Where one model call's tokens live among the token-capture rows of this snapshot.

    ``file`` is relative to the snapshot folder; the rows are ``row_start`` ..
    ``row_start + row_count - 1`` of record batch ``batch`` of that Arrow file.
    """

    schema_version: SchemaVersion = 1
    capture_key: Str
    model_call_id: CallId
    file: RelPath
    batch: NonNeg
    row_start: NonNeg
    row_count: Annotated[int, msgspec.Meta(ge=1)]

    def __post_init__(self) -> None:
        check_relative_path(self.file, where="file")


class SessionStateRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One resource session's exported state at a state revision.

    ``resource`` names the resource server as the participant does (its capability ``name``, the
    key of every continuation's ``resource_state_revisions``); ``tool`` is the kind of session
    within that server. Records written before ``tool`` existed held the tool in ``resource``.
    """

    schema_version: SchemaVersion = 1
    session_id: Str
    resource: Name
    state_revision: NonNeg
    rollout_id: RolloutId | None = None
    state: Any = None
    tool: Name | None = None

    def __post_init__(self) -> None:
        if self.rollout_id is not None:
            check_rollout_id(self.rollout_id)
