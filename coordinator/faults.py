"""Named step boundaries of save and restore, and the crash plan tests and the demo use to SIGKILL
real processes at one of them.

The controller's Checkpointer (:mod:`coordinator.checkpoint`) calls :meth:`Steps.reached` at every
boundary. With no plan this only counts; with a :class:`CrashPlan` whose step is reached (its
``occurrence``-th time), the listed processes are SIGKILLed and then, if ``kill_self``, the
controller's own process: a crash, with nothing flushed, exactly as a machine failure would leave
things.
"""

from __future__ import annotations

import logging
import os
import signal

import msgspec

log = logging.getLogger("coordinator.faults")

#: Save boundaries, in the order a save reaches them. ``background`` mode reaches ``resumed``
#: before ``gym_adopted``/``written``/``published``; ``in_pause`` mode after them.
SAVE_STEPS = ("save.begin", "save.acks_flushed", "save.prepared", "save.gym_committed", "save.cut", "save.resumed",
              "save.gym_adopted", "save.written", "save.published")
RESTORE_STEPS = ("restore.begin", "restore.picked", "restore.dataplane_loaded", "restore.gym_restored",
                 "restore.bookkeeping_loaded", "restore.discarded", "restore.acks_resent", "restore.resumed")
ALL_STEPS = SAVE_STEPS + RESTORE_STEPS


class CrashPlan(msgspec.Struct, frozen=True, kw_only=True):
    """SIGKILL ``kill_pids`` (then this process, if ``kill_self``) the ``occurrence``-th time ``at`` is reached."""

    at: str
    occurrence: int = 1
    kill_pids: list[int] = []
    kill_self: bool = True

    def __post_init__(self) -> None:
        if self.at not in ALL_STEPS:
            raise ValueError(f"crash plan: unknown step {self.at!r} (expected one of {', '.join(ALL_STEPS)})")


class Steps:
    """Counts the boundaries reached; carries out a crash plan."""

    def __init__(self, plan: CrashPlan | None = None) -> None:
        self.plan = plan
        self.counts: dict[str, int] = {}

    def reached(self, step: str) -> None:
        self.counts[step] = self.counts.get(step, 0) + 1
        plan = self.plan
        if plan is None or plan.at != step or self.counts[step] != plan.occurrence:
            return
        log.warning("crash plan: SIGKILL %s at %s", [*plan.kill_pids, *(["self"] if plan.kill_self else [])], step)
        for pid in plan.kill_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if plan.kill_self:
            os.kill(os.getpid(), signal.SIGKILL)
