"""ControllerConfig takes NeMo-RL's ``rollout_checkpointing`` block (CONTROL.md §8): its names,
nesting and defaults, unknown keys refused at every level; our own keys stay outside it."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.config import ControllerConfig, GymRolloutCheckpointing, RolloutCheckpointing

#: NeMo-RL's block with every key at its default (CONTROL.md §8, the per-component generation's gym keys).
NEMO_RL_DEFAULTS = {
    "snapshot_attempt_interval_s": None,
    "telemetry_interval_s": None,
    "max_consecutive_failures": 3,
    "keep_latest_k": 2,
    "restore_mode": "latest",
    "extra_fingerprint_excluded_paths": [],
    "gym": {"capability_discovery_enabled": False, "participant_checkpointing_enabled": False,
            "generation_prefix_cuts_enabled": False, "prepare_timeout_s": 300.0},
}


def test_the_block_has_nemo_rls_names_nesting_and_defaults() -> None:
    cfg = ControllerConfig()
    assert msgspec.to_builtins(cfg.rollout_checkpointing) == NEMO_RL_DEFAULTS
    ours = set(msgspec.structs.asdict(cfg)) - {"rollout_checkpointing"}
    assert not ours & (set(NEMO_RL_DEFAULTS) | set(NEMO_RL_DEFAULTS["gym"]))  # nothing of theirs outside it
    assert {"write_mode", "max_cut_bytes", "commit_timeout_s", "restore_timeout_s"} <= ours


def test_a_nemo_rl_block_decodes_as_written() -> None:
    block = {"snapshot_attempt_interval_s": 30, "telemetry_interval_s": 5.0, "max_consecutive_failures": 4,
             "keep_latest_k": 8, "restore_mode": "trainer_checkpoint",
             "extra_fingerprint_excluded_paths": ["logger.**", "cluster.*.host"],
             "gym": {"capability_discovery_enabled": True, "participant_checkpointing_enabled": True,
                     "prepare_timeout_s": 180}}
    cfg = msgspec.convert({"rollout_checkpointing": block, "write_mode": "in_pause"}, ControllerConfig)
    rc = cfg.rollout_checkpointing
    assert (rc.snapshot_attempt_interval_s, rc.keep_latest_k, rc.restore_mode, rc.gym.prepare_timeout_s) == (
        30, 8, "trainer_checkpoint", 180)
    assert rc.gym.participant_checkpointing_enabled and not rc.gym.generation_prefix_cuts_enabled
    assert cfg.write_mode == "in_pause"
    built = ControllerConfig(write_mode="in_pause", rollout_checkpointing=RolloutCheckpointing(
        snapshot_attempt_interval_s=30, telemetry_interval_s=5.0, max_consecutive_failures=4, keep_latest_k=8,
        restore_mode="trainer_checkpoint", extra_fingerprint_excluded_paths=["logger.**", "cluster.*.host"],
        gym=GymRolloutCheckpointing(capability_discovery_enabled=True, participant_checkpointing_enabled=True,
                                    prepare_timeout_s=180)))
    assert built == cfg
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=ControllerConfig) == cfg


@pytest.mark.parametrize("doc", [
    {"snapshot_attempt_interval_s": 1.0},  # NeMo-RL's key, outside its block
    {"prepare_timeout_s": 1.0},
    {"rollout_checkpointing": {"prepare_timeout_s": 1.0}},  # gym's key, one level too high
    {"rollout_checkpointing": {"write_mode": "in_pause"}},  # ours, inside theirs
    {"rollout_checkpointing": {"gym": {"mode": "turn_recovery"}}},  # NeMo-RL 498dcedb's later key
    {"rollout_checkpointing": {"gym": {"typo_enabled": True}}},
])
def test_unknown_keys_are_refused_at_every_level(doc: dict) -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert(doc, ControllerConfig)


@pytest.mark.parametrize(("doc", "match"), [
    ({"snapshot_attempt_interval_s": 0}, "> 0"),
    ({"telemetry_interval_s": -1.0}, "> 0"),
    ({"max_consecutive_failures": 0}, ">= 1"),
    ({"keep_latest_k": 0}, ">= 1"),
    ({"restore_mode": "newest"}, "restore_mode"),
    ({"gym": {"prepare_timeout_s": 0}}, "> 0"),
    ({"gym": {"participant_checkpointing_enabled": True}}, "requires capability_discovery_enabled"),
    ({"gym": {"capability_discovery_enabled": True, "generation_prefix_cuts_enabled": True}},
     "requires participant_checkpointing_enabled"),
    ({"extra_fingerprint_excluded_paths": ["**"]}, "whole config"),
    ({"extra_fingerprint_excluded_paths": ["a..b"]}, "dotpaths"),
    ({"extra_fingerprint_excluded_paths": [" a.b"]}, "dotpaths"),
])
def test_values_are_checked_when_decoded_and_when_built(doc: dict, match: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.convert({"rollout_checkpointing": doc}, ControllerConfig)
    gym = doc.get("gym")
    with pytest.raises(ValueError, match=match):
        if gym is not None:
            GymRolloutCheckpointing(**gym)
        else:
            RolloutCheckpointing(**doc)


def test_our_keys_are_checked_too() -> None:
    with pytest.raises(ValueError, match="write_mode"):
        ControllerConfig(write_mode="later")
    with pytest.raises(ValueError, match="gym_staging"):
        ControllerConfig(gym_staging="never")
    with pytest.raises(ValueError, match="commit_timeout_s"):
        ControllerConfig(commit_timeout_s=0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_in_flight": 0}, ControllerConfig)


def test_with_rollout_checkpointing_changes_a_copy() -> None:
    cfg = ControllerConfig(max_in_flight=6)
    fast = cfg.with_rollout_checkpointing(snapshot_attempt_interval_s=0.05, gym={"prepare_timeout_s": 10.0})
    assert fast.rollout_checkpointing.snapshot_attempt_interval_s == 0.05
    assert fast.rollout_checkpointing.gym.prepare_timeout_s == 10.0
    assert fast.max_in_flight == 6 and cfg.rollout_checkpointing.snapshot_attempt_interval_s is None
    with pytest.raises(ValueError, match="keep_latest_k"):
        cfg.with_rollout_checkpointing(keep_latest_k=0)


def test_nemo_rls_setup_refusals() -> None:
    ControllerConfig().check_setup()
    discovery = GymRolloutCheckpointing(capability_discovery_enabled=True)
    with pytest.raises(ValueError, match="snapshot_attempt_interval_s"):
        ControllerConfig(rollout_checkpointing=RolloutCheckpointing(gym=discovery)).check_setup()
    both = GymRolloutCheckpointing(capability_discovery_enabled=True, participant_checkpointing_enabled=True)
    with pytest.raises(ValueError, match="restore_mode"):
        ControllerConfig(rollout_checkpointing=RolloutCheckpointing(
            snapshot_attempt_interval_s=1.0, restore_mode="trainer_checkpoint", gym=both)).check_setup()
