"""The Single Controller's settings.

``rollout_checkpointing`` is NeMo-RL's block of that name (``RolloutCheckpointConfig`` and its
``gym`` block, CONTROL.md §8): the same keys, nesting and defaults, unknown keys refused. The
``gym`` keys are those of NeMo-RL's per-component generation (``capability_discovery_enabled``,
``participant_checkpointing_enabled``, ``generation_prefix_cuts_enabled``, each needing the one
before, and ``prepare_timeout_s``); NeMo-RL ``498dcedb`` replaced the three flags with ``mode:
disabled|turn_recovery``, which this generation does not take. Our own keys (how a snapshot is
written, timeouts of our steps, the loop's pace) stay outside that block.

Build it as ``ControllerConfig(rollout_checkpointing=RolloutCheckpointing(snapshot_attempt_interval_s=1.0,
gym=GymRolloutCheckpointing(prepare_timeout_s=60.0)), write_mode="in_pause")``, decode it from
JSON or YAML-loaded dicts (``msgspec.convert(d, ControllerConfig)``), or change a copy with
:meth:`ControllerConfig.with_rollout_checkpointing`. Bounds and literals are checked both when
decoding and when constructing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi

Positive = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]


def _check_fields(obj: msgspec.Struct) -> None:
    """Check the ``Meta`` bounds and ``Literal`` values of ``obj``'s fields (msgspec checks them only
    when decoding; a config built in code must be refused the same)."""
    for f in mi.type_info(type(obj)).fields:
        value = getattr(obj, f.name)
        kinds = f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)
        if value is None and any(isinstance(k, mi.NoneType) for k in kinds):
            continue
        for k in kinds:
            if isinstance(k, mi.LiteralType) and value not in k.values:
                raise ValueError(f"{f.name} must be one of {', '.join(map(repr, k.values))}, got {value!r}")
            if isinstance(k, mi.IntType | mi.FloatType) and isinstance(value, int | float) \
                    and not isinstance(value, bool):
                if k.gt is not None and not value > k.gt:
                    raise ValueError(f"{f.name} must be > {k.gt}, got {value!r}")
                if k.ge is not None and not value >= k.ge:
                    raise ValueError(f"{f.name} must be >= {k.ge}, got {value!r}")


class GymRolloutCheckpointing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """NeMo-RL's ``rollout_checkpointing.gym``: Gym's share of a rollout snapshot (opt-in).

    ``capability_discovery_enabled``: discover and fingerprint every Gym participant before the run.
    ``participant_checkpointing_enabled``: each snapshot includes the Gym participants' state (and
    completed results are acknowledged by receipt); needs discovery. ``generation_prefix_cuts_enabled``:
    freeze model calls in flight at their current prefix instead of draining them; needs participant
    checkpointing. ``prepare_timeout_s``: how long Gym's prepare may take (the deadline it is given).
    """

    capability_discovery_enabled: bool = False
    participant_checkpointing_enabled: bool = False
    generation_prefix_cuts_enabled: bool = False
    prepare_timeout_s: Positive = 300.0

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.participant_checkpointing_enabled and not self.capability_discovery_enabled:
            raise ValueError("participant_checkpointing_enabled=true requires capability_discovery_enabled=true")
        if self.generation_prefix_cuts_enabled and not self.participant_checkpointing_enabled:
            raise ValueError("generation_prefix_cuts_enabled=true requires participant_checkpointing_enabled=true")


class RolloutCheckpointing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """NeMo-RL's ``rollout_checkpointing`` block.

    ``snapshot_attempt_interval_s``: seconds between save attempts; None (the default) never saves.
    ``telemetry_interval_s``: seconds between samples of rollout and checkpoint metrics; None: none.
    ``max_consecutive_failures``: that many failed saves in a row stop the run. ``keep_latest_k``:
    snapshots kept. ``restore_mode``: ``latest`` restores the newest usable snapshot,
    ``trainer_checkpoint`` the one bundled with the trainer's checkpoint.
    ``extra_fingerprint_excluded_paths``: more config dotpaths (``*`` one level, ``**`` any) left
    out of the configuration fingerprint.
    """

    snapshot_attempt_interval_s: Positive | None = None
    telemetry_interval_s: Positive | None = None
    max_consecutive_failures: AtLeastOne = 3
    keep_latest_k: AtLeastOne = 2
    restore_mode: Literal["latest", "trainer_checkpoint"] = "latest"
    extra_fingerprint_excluded_paths: list[str] = []
    gym: GymRolloutCheckpointing = msgspec.field(default_factory=GymRolloutCheckpointing)

    def __post_init__(self) -> None:
        _check_fields(self)
        bad = [p for p in self.extra_fingerprint_excluded_paths
               if not p or p != p.strip() or "" in p.split(".") or p in ("*", "**")]
        if bad:
            raise ValueError(f"extra_fingerprint_excluded_paths must be non-empty dotpaths that do not exclude the "
                             f"whole config, got {bad!r}")


class ControllerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the Single Controller runs rollouts and when and how it saves.

    ``rollout_checkpointing``: NeMo-RL's block (above). The rest is ours. ``write_mode``:
    ``"background"`` writes the data plane and controller parts and publishes after Gym resumes
    (the pause holds only the drain, Gym's commit and the in-memory cut), one save in flight at a
    time; ``"in_pause"`` does everything before resuming, in the design note's order. A cut larger
    than ``max_cut_bytes`` is written in the pause whatever the mode (logged). ``commit_timeout_s``
    and ``restore_timeout_s``: the deadlines Gym's commit and restore (and a restore's discard) are
    given; ``resume_timeout_s`` Gym's resume and abort. ``capture_max_bytes``: how much of the rows
    it puts the TransferQueue adapter keeps, so a save need not read them back out of TQ (0 keeps
    none; past it, later rows are read back at save time).

    ``incremental`` (default true): each snapshot writes only the data plane's rows that are new
    since the one before. The rows go into segments (shared objects of at most 8,192 consecutive
    keys of one partition, format 1.3), and a segment the parent snapshot holds is listed again,
    narrowed to the rows still listed, rather than written (:mod:`coordinator.dataplane.segments`);
    this needs a data plane whose rows are write-once, as TransferQueue's adapter's are (another
    writes every row as new segments). Gym's parts and the controller's records are written whole
    either way. False: one file per row kind, every row written by every save (snapshots that do
    not need the ``shared_objects`` feature, so readers without it read them).

    ``gym_staging``: where Gym's participants write their commit (the ``checkpoint_dir``).
    ``"remote_store"`` (default): into the draft's own ``gym/`` folder when the store is local disk,
    so adoption hashes the files where they lie; into the controller's ``staging_dir`` for any other
    store. ``"always"``: into ``staging_dir`` whatever the store. Put ``staging_dir`` on a RAM-backed
    file system (``/dev/shm``) and the pause no longer waits for the disk: Gym writes and fsyncs every
    file (CONTROL.md §6), but a staged file is scratch. Its durability is the store's, given when
    adoption copies it into the draft (each file fsynced there) after the resume, and a crash before
    publish loses only a snapshot that was never published. The cost is memory: Gym's files of one
    snapshot (75-136 MB at 10,000 parked rollouts in the scale benchmark) until adoption has copied them.
    """

    rollout_checkpointing: RolloutCheckpointing = msgspec.field(default_factory=RolloutCheckpointing)
    commit_timeout_s: Positive = 300.0
    restore_timeout_s: Positive = 300.0
    resume_timeout_s: Positive = 60.0
    write_mode: Literal["background", "in_pause"] = "background"
    max_cut_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4 << 30
    max_in_flight: AtLeastOne = 64
    train_batch_groups: AtLeastOne = 2
    poll_interval_s: Positive = 0.05
    gym_unreachable_s: Positive = 20.0
    compression: Literal["none", "zstd", "lz4"] = "none"
    data_plane_timeout_s: Positive = 300.0  # a TransferQueue call that takes longer fails the step (dead storage)
    capture_max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4 << 30
    incremental: bool = True
    gym_staging: Literal["remote_store", "always"] = "remote_store"

    def __post_init__(self) -> None:
        _check_fields(self)

    def with_rollout_checkpointing(self, *, gym: Mapping[str, Any] | None = None, **changes: Any) -> ControllerConfig:
        """A copy with ``rollout_checkpointing`` fields changed (``gym`` fields given as a mapping)."""
        rc = self.rollout_checkpointing
        if gym:
            changes["gym"] = msgspec.structs.replace(rc.gym, **gym)
        return msgspec.structs.replace(self, rollout_checkpointing=msgspec.structs.replace(rc, **changes))

    def without_snapshots(self) -> ControllerConfig:
        """A copy that never saves (no interval, Gym's share off): an uninterrupted reference run."""
        return self.with_rollout_checkpointing(snapshot_attempt_interval_s=None, gym={
            "generation_prefix_cuts_enabled": False, "participant_checkpointing_enabled": False,
            "capability_discovery_enabled": False})

    def check_setup(self) -> None:
        """NeMo-RL's set-up refusals of this block (``ValueError``): discovery needs
        ``snapshot_attempt_interval_s``; participant checkpointing needs ``restore_mode="latest"``."""
        rc = self.rollout_checkpointing
        if rc.gym.capability_discovery_enabled and rc.snapshot_attempt_interval_s is None:
            raise ValueError("rollout_checkpointing.gym.capability_discovery_enabled=true requires "
                             "rollout_checkpointing.snapshot_attempt_interval_s")
        if rc.gym.participant_checkpointing_enabled and rc.restore_mode != "latest":
            raise ValueError("Gym participant checkpointing requires rollout_checkpointing.restore_mode='latest'")

    def check_supported(self) -> None:
        """What this Single Controller implements of NeMo-RL's block (``ValueError`` naming the key
        otherwise): saving needs Gym's share on (``gym.capability_discovery_enabled`` and
        ``gym.participant_checkpointing_enabled``: every snapshot holds the Gym participants' state);
        ``generation_prefix_cuts_enabled``, ``telemetry_interval_s``, ``restore_mode`` other than
        ``latest`` and ``extra_fingerprint_excluded_paths`` are not implemented here and are refused
        rather than ignored. Discovery itself always runs at set-up: picking a snapshot needs the
        running topology's fingerprint."""
        self.check_setup()
        rc = self.rollout_checkpointing
        if rc.snapshot_attempt_interval_s is not None and not (
                rc.gym.capability_discovery_enabled and rc.gym.participant_checkpointing_enabled):
            raise ValueError("rollout_checkpointing.snapshot_attempt_interval_s is set: this controller saves Gym's "
                             "state in every snapshot, so set rollout_checkpointing.gym.capability_discovery_enabled "
                             "and rollout_checkpointing.gym.participant_checkpointing_enabled to true")
        unsupported = {
            "rollout_checkpointing.gym.generation_prefix_cuts_enabled": rc.gym.generation_prefix_cuts_enabled,
            "rollout_checkpointing.telemetry_interval_s": rc.telemetry_interval_s is not None,
            "rollout_checkpointing.restore_mode": rc.restore_mode != "latest",
            "rollout_checkpointing.extra_fingerprint_excluded_paths": bool(rc.extra_fingerprint_excluded_paths),
        }
        named = [k for k, v in unsupported.items() if v]
        if named:
            raise ValueError(f"not implemented by this Single Controller (leave at NeMo-RL's default): {', '.join(named)}")
