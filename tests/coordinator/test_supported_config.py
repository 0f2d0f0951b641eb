"""What this Single Controller implements of NeMo-RL's ``rollout_checkpointing`` block
(:meth:`ControllerConfig.check_supported`): a key it does not implement is refused by name when the
controller is built, never silently ignored. No Ray, no Gym: the refusal comes first."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import CONFIG, WORKLOAD

from coordinator.config import ControllerConfig
from coordinator.controller import SingleController

SAVES = {"snapshot_attempt_interval_s": 1.0}
GYM_ON = {"capability_discovery_enabled": True, "participant_checkpointing_enabled": True}


def _config(gym: dict | None = None, **block) -> ControllerConfig:
    return ControllerConfig().with_rollout_checkpointing(gym=gym, **block)


@pytest.mark.parametrize(("config", "match"), [
    # saving needs Gym's share on: every snapshot holds the Gym participants' state
    (_config(**SAVES), r"snapshot_attempt_interval_s is set.*capability_discovery_enabled.*participant_checkpo"),
    (_config(gym={"capability_discovery_enabled": True}, **SAVES), r"participant_checkpointing_enabled to true"),
    # NeMo-RL's own set-up refusal (check_setup) comes first
    (_config(gym={"capability_discovery_enabled": True}), r"requires rollout_checkpointing.snapshot_attempt_interval_s"),
    # keys of the block this controller does not implement: refused by name rather than ignored
    (_config(gym={**GYM_ON, "generation_prefix_cuts_enabled": True}, **SAVES),
     r"not implemented .*rollout_checkpointing\.gym\.generation_prefix_cuts_enabled"),
    (_config(gym=GYM_ON, telemetry_interval_s=5.0, **SAVES), r"not implemented .*rollout_checkpointing\.telemetry_interval_s"),
    (_config(restore_mode="trainer_checkpoint"), r"not implemented .*rollout_checkpointing\.restore_mode"),
    (_config(gym=GYM_ON, extra_fingerprint_excluded_paths=["logger.**"], **SAVES),
     r"not implemented .*rollout_checkpointing\.extra_fingerprint_excluded_paths"),
])
def test_what_the_controller_does_not_implement_is_refused_by_name(config: ControllerConfig, match: str,
                                                                   tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        config.check_supported()
    with pytest.raises(ValueError, match=match):  # the controller refuses it before it touches anything
        SingleController(config, str(tmp_path / "store"), None, WORKLOAD, data_plane="memory")
    assert not (tmp_path / "store").exists()


def test_every_unimplemented_key_is_named_at_once() -> None:
    config = _config(gym={**GYM_ON, "generation_prefix_cuts_enabled": True}, telemetry_interval_s=5.0,
                     extra_fingerprint_excluded_paths=["logger.**"], **SAVES)
    with pytest.raises(ValueError) as err:
        config.check_supported()
    for key in ("gym.generation_prefix_cuts_enabled", "telemetry_interval_s", "extra_fingerprint_excluded_paths"):
        assert f"rollout_checkpointing.{key}" in str(err.value)


@pytest.mark.parametrize("config", [ControllerConfig(), CONFIG, CONFIG.without_snapshots(),
                                    CONFIG.with_rollout_checkpointing(keep_latest_k=5, max_consecutive_failures=1)],
                         ids=["defaults", "saving", "never-saving", "nemo-rl-keys-it-implements"])
def test_what_the_controller_implements_is_accepted(config: ControllerConfig, tmp_path: Path) -> None:
    config.check_supported()
    ctl = SingleController(config, str(tmp_path / "store"), None, WORKLOAD, data_plane="memory")
    assert ctl.config is config
