"""The Single Controller's bookkeeping: loader place, replay index and recovery ledger."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas.gym_records import RolloutId, SchemaVersion
from schemas.identity import check_rollout_id
from schemas.manifest import NonNeg, Str


class LoaderPlace(msgspec.Struct, frozen=True, kw_only=True):
    """Where the prompt loader stands: the next prompt it hands out is ``order[consumed]``.

    ``consumed`` counts prompts whose groups were *dispatched* (not merely read), so the cursor
    never runs ahead of what the recovery ledger accounts for (NeMo-RL's skipped-prompt bug).
    """

    schema_version: SchemaVersion = 1
    epoch: NonNeg
    consumed: NonNeg
    seed: int
    dataset_size: NonNeg | None = None
    extra: dict[str, Any] = {}


class ReplayIndexEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One training sample held in the data plane: its TQ key and where it came from."""

    schema_version: SchemaVersion = 1
    key: Str
    partition_id: Str
    rollout_id: RolloutId
    attempt_index: NonNeg
    group_id: Str
    status: Literal["ready", "claimed_for_training", "applied_uncheckpointed"]

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)


PromptGroupState = Literal[
    "generating", "ready_to_finalize", "finalizing", "finalization_unknown", "finalized",
    "claimed_for_training", "applied_uncheckpointed",
]
AttemptState = Literal["reserved", "dispatched", "sealed", "failed", "abandoned"]


class PromptGroup(msgspec.Struct, frozen=True, kw_only=True, tag_field="record", tag="prompt_group"):
    """A prompt group (one prompt, several rollouts) and its state in the recovery ledger."""

    schema_version: SchemaVersion = 1
    group_id: Str
    prompt_index: NonNeg
    state: PromptGroupState
    rollout_ids: list[RolloutId] = []


class RolloutAttempt(msgspec.Struct, frozen=True, kw_only=True, tag_field="record", tag="rollout_attempt"):
    """One run (attempt) of a rollout: its run number and state."""

    schema_version: SchemaVersion = 1
    rollout_id: RolloutId
    group_id: Str
    attempt_index: NonNeg
    state: AttemptState

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)


class AckOwed(msgspec.Struct, frozen=True, kw_only=True, tag_field="record", tag="ack_owed"):
    """A finished result stored in TQ whose acknowledgement to Gym has not been confirmed yet."""

    schema_version: SchemaVersion = 1
    rollout_id: RolloutId
    attempt_index: NonNeg
    result_key: Str

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)


RecoveryLedgerRecord = Annotated[PromptGroup | RolloutAttempt | AckOwed, msgspec.Meta(title="RecoveryLedgerRecord")]
