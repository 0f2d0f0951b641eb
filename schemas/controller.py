"""The Single Controller's bookkeeping: loader place, replay index and recovery ledger."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas.gym_records import SCHEMA_VERSION_META, RolloutId, SchemaVersion
from schemas.identity import check_rollout_id
from schemas.manifest import NonNeg, Str


class LoaderPlace(msgspec.Struct, frozen=True, kw_only=True):
    """Where the prompt loader stands: the next prompt it hands out is ``order[consumed]``.

    ``consumed`` counts prompts whose groups were *dispatched* (not merely read), so the cursor
    never runs ahead of what the recovery ledger accounts for (NeMo-RL's skipped-prompt bug).
    """

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    epoch: Annotated[NonNeg, msgspec.Meta(description="Current epoch of the prompt loader (0-based).")]
    consumed: Annotated[NonNeg, msgspec.Meta(
        description="Prompts of this epoch whose groups were dispatched; the next prompt handed out is "
                    "`order[consumed]` of this epoch's order.")]
    seed: Annotated[int, msgspec.Meta(description="Seed from which the loader derives each epoch's order.")]
    dataset_size: Annotated[NonNeg | None, msgspec.Meta(
        description="Number of prompts in the dataset when known; a restore with another size is a "
                    "different dataset.")] = None
    extra: Annotated[dict[str, Any], msgspec.Meta(
        description="Loader-specific values (opaque JSON object).")] = {}


class ReplayIndexEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One training sample held in the data plane: its TQ key and where it came from."""

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    key: Annotated[Str, msgspec.Meta(
        description="The sample's key in the data plane (TQ); the `key` column of a training row.")]
    partition_id: Annotated[Str, msgspec.Meta(description="The data-plane partition holding the sample.")]
    rollout_id: Annotated[RolloutId, msgspec.Meta(description="The rollout the sample came from.")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(description="The run of that rollout that produced it.")]
    group_id: Annotated[Str, msgspec.Meta(description="The prompt group of that rollout.")]
    status: Annotated[Literal["ready", "claimed_for_training", "applied_uncheckpointed"], msgspec.Meta(
        description="`ready` (not yet used), `claimed_for_training` (taken by a training step not yet "
                    "applied) or `applied_uncheckpointed` (applied by a step whose weights are not yet "
                    "checkpointed).")]

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)


PromptGroupState = Literal[
    "generating", "ready_to_finalize", "finalizing", "finalization_unknown", "finalized",
    "claimed_for_training", "applied_uncheckpointed",
]
AttemptState = Literal["reserved", "dispatched", "sealed", "failed", "abandoned"]


class PromptGroup(msgspec.Struct, frozen=True, kw_only=True, tag_field="record", tag="prompt_group"):
    """A prompt group (one prompt, several rollouts) and its state in the recovery ledger."""

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    group_id: Annotated[Str, msgspec.Meta(description="The prompt group (one prompt, several rollouts).")]
    prompt_index: Annotated[NonNeg, msgspec.Meta(description="Index of the prompt in the loader's order.")]
    state: Annotated[PromptGroupState, msgspec.Meta(description="The group's state in the recovery ledger.")]
    rollout_ids: Annotated[list[RolloutId], msgspec.Meta(description="The group's rollouts.")] = []


class RolloutAttempt(msgspec.Struct, frozen=True, kw_only=True, tag_field="record", tag="rollout_attempt"):
    """One run (attempt) of a rollout: its run number and state."""

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    rollout_id: Annotated[RolloutId, msgspec.Meta(description="The rollout.")]
    group_id: Annotated[Str, msgspec.Meta(description="Its prompt group.")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(description="The run number.")]
    state: Annotated[AttemptState, msgspec.Meta(description="The run's state.")]

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)


class AckOwed(msgspec.Struct, frozen=True, kw_only=True, tag_field="record", tag="ack_owed"):
    """A finished result stored in TQ whose acknowledgement to Gym has not been confirmed yet."""

    schema_version: Annotated[SchemaVersion, SCHEMA_VERSION_META] = 1
    rollout_id: Annotated[RolloutId, msgspec.Meta(description="The rollout whose finished result is stored.")]
    attempt_index: Annotated[NonNeg, msgspec.Meta(description="The run that produced it.")]
    result_key: Annotated[Str, msgspec.Meta(
        description="The result's key in the data plane. Its acknowledgement to Gym is not confirmed yet, "
                    "so the controller sends it again after a restore, in a call of its own; an agent that "
                    "no longer holds the result answers 404 `unknown_rollout`, which means it was "
                    "acknowledged already (CONTROL §4).")]

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)


RecoveryLedgerRecord = Annotated[PromptGroup | RolloutAttempt | AckOwed, msgspec.Meta(title="RecoveryLedgerRecord")]
