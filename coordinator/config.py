"""The Single Controller's settings (NeMo-RL's ``rollout_checkpointing`` names where they exist)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Positive = Annotated[float, msgspec.Meta(gt=0)]


class ControllerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the Single Controller runs rollouts and when and how it saves.

    ``snapshot_attempt_interval_s``: seconds between save attempts; ``None`` (the default) never
    saves. ``write_mode``: ``"background"`` writes the data plane and controller parts and publishes
    after Gym resumes (the pause holds only the drain, Gym's commit and the in-memory cut), one save
    in flight at a time; ``"in_pause"`` does everything before resuming, in the design note's order.
    A cut larger than ``max_cut_bytes`` is written in the pause whatever the mode (logged).
    ``capture_max_bytes``: how much of the rows it puts the TransferQueue adapter keeps, so a save
    need not read them back out of TQ (0 keeps none; past it, later rows are read back at save time).
    """

    snapshot_attempt_interval_s: Positive | None = None
    prepare_timeout_s: Positive = 300.0
    commit_timeout_s: Positive = 300.0
    restore_timeout_s: Positive = 300.0
    keep_latest_k: Annotated[int, msgspec.Meta(ge=1)] = 2
    max_consecutive_failures: Annotated[int, msgspec.Meta(ge=1)] = 3
    write_mode: Literal["background", "in_pause"] = "background"
    max_cut_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4 << 30
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 64
    train_batch_groups: Annotated[int, msgspec.Meta(ge=1)] = 2
    poll_interval_s: Positive = 0.05
    gym_unreachable_s: Positive = 20.0
    compression: Literal["none", "zstd", "lz4"] = "none"
    data_plane_timeout_s: Positive = 300.0  # a TransferQueue call that takes longer fails the step (a dead storage unit)
    capture_max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4 << 30
