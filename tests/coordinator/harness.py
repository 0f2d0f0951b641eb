"""A job inside the test session's Ray: real Gym server processes, the NemoGym actor, the Single
Controller actor. ``crash`` is a machine failure of the job: the controller's process and every Gym
server SIGKILLed; the next :class:`InRayJob` on the same store is the operator's restart."""

from __future__ import annotations

from typing import Any

import ray

from coordinator import controller as controller_mod
from coordinator import gym_actor
from coordinator.config import ControllerConfig, GymRolloutCheckpointing, RolloutCheckpointing
from coordinator.controller import RunOutcome
from coordinator.faults import CrashPlan
from coordinator.workload import Workload
from devtools.gym_fleet import Fleet, Gym

WORKLOAD = Workload(prompts=4, group_size=3, min_turns=2, max_turns=4, seed=77, sandbox_every=3)
CONFIG = ControllerConfig(
    rollout_checkpointing=RolloutCheckpointing(
        snapshot_attempt_interval_s=0.3, keep_latest_k=3,
        gym=GymRolloutCheckpointing(capability_discovery_enabled=True, participant_checkpointing_enabled=True,
                                    prepare_timeout_s=10.0)),
    max_in_flight=6, poll_interval_s=0.02, gym_unreachable_s=3.0, commit_timeout_s=10.0, restore_timeout_s=20.0,
    train_batch_groups=1)
MODEL_SLOW_MS = 80
RUN_S = 120.0


class InRayJob:
    def __init__(self, fleet: Fleet, store_url: str, *, config: ControllerConfig = CONFIG,
                 workload: Workload = WORKLOAD, crash_at: str | None = None, occurrence: int = 1,
                 kill_gym: bool = True, kill_self: bool = True, data_plane: str = "memory",
                 test_faults: bool = False, actor_options: dict[str, Any] | None = None,
                 gym_options: dict[str, Any] | None = None, model_slow_ms: int = MODEL_SLOW_MS,
                 staging_dir: str | None = None) -> None:
        self.gym: Gym = fleet.gym(model_slow_ms=model_slow_ms, test_faults=test_faults, **(gym_options or {}))
        plan = None
        if crash_at is not None:
            plan = CrashPlan(at=crash_at, occurrence=occurrence, kill_self=kill_self,
                             kill_pids=[p.pid for p in self.gym.servers.all] if kill_gym else [])
        self.actor = gym_actor.remote({p.name: p.url for p in self.gym.servers.all}, fleet.token)
        self.ctl = controller_mod.remote(config, store_url, self.actor, workload, data_plane=data_plane,
                                         crash_plan=plan, options=actor_options, staging_dir=staging_dir)

    def setup(self) -> Any:
        return ray.get(self.ctl.setup.remote())

    def run(self, seconds: float = RUN_S) -> RunOutcome:
        return ray.get(self.ctl.run.remote(seconds))

    def call(self, method: str, *args: Any) -> Any:
        return ray.get(getattr(self.ctl, method).remote(*args))

    def kill(self) -> None:
        """Whatever is still alive of this job dies now (SIGKILL), as in a machine failure."""
        for p in self.gym.servers.all:
            p.kill()
        for actor in (self.ctl, self.actor):
            ray.kill(actor, no_restart=True)
