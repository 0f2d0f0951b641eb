"""The save's steps (:mod:`coordinator.checkpoint.save`) against a scripted Gym: RL's cut is taken
while Gym prepares and commits (not after), its errors abort the save with their type (an
``aborted`` outcome, not an exception), and no cut outlives a failed save."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock

import numpy as np

from coordinator.bookkeeping import Bookkeeping
from coordinator.checkpoint.save import save
from coordinator.checkpoint.seams import Seams
from coordinator.config import ControllerConfig
from coordinator.dataplane import InMemoryDataPlane
from coordinator.errors import GymCallError
from coordinator.faults import Steps
from coordinator.workload import Workload
from snapformat import SnapshotStore

WAIT_S = 10.0


class CutGate(InMemoryDataPlane):
    """An in-memory data plane whose cut says when it has begun, and may be held or fail."""

    def __init__(self, fail: bool = False, linger_s: float = 0.0) -> None:
        super().__init__()
        self.begun = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()
        self.fail = fail
        self.linger_s = linger_s  # time the cut still takes once released

    def deferred_cut(self):
        self.begun.set()
        try:
            if not self.release.wait(WAIT_S):
                raise AssertionError("the cut was never released")
            time.sleep(self.linger_s)
            if self.fail:
                raise GymCallError("data plane: listing failed")  # any typed error
            return super().deferred_cut()
        finally:
            self.ended.set()


class ScriptedGym:
    """Gym's four save calls; prepare waits for the cut to have begun, commit releases it."""

    def __init__(self, plane: CutGate, prepare_error: bool = False) -> None:
        self.plane = plane
        self.prepare_error = prepare_error
        self.calls: list[str] = []
        self.cut_begun_in_prepare = False

    def prepare_checkpoint(self, cid: str, deadline: float) -> None:
        self.calls.append("prepare")
        self.cut_begun_in_prepare = self.plane.begun.wait(WAIT_S)
        if self.prepare_error:
            raise GymCallError("prepare of agent: 500")

    def commit_checkpoint(self, cid: str, deadline: float, url: str):
        self.calls.append("commit")
        self.plane.release.set()
        return SimpleNamespace(receipts=[], gym_commit=None)

    def resume_checkpoint(self, cid: str) -> None:
        self.calls.append("resume")

    def abort_checkpoint(self, cid: str) -> list[str]:
        self.calls.append("abort")
        self.plane.release.set()
        return []


def seams(tmp_path: Path, plane: CutGate, gym: ScriptedGym) -> Seams:
    return Seams(gym=gym, store=SnapshotStore(str(tmp_path / "store")), plane=plane, config=ControllerConfig(),
                 steps=Steps(), store_and_acknowledge=Mock(), acknowledge=Mock())


def books() -> Bookkeeping:
    return Bookkeeping.fresh(Workload(prompts=1, group_size=1))


def test_the_cut_is_taken_while_gym_prepares_and_commits(tmp_path: Path) -> None:
    plane = CutGate()
    plane.put("train", ["a", "b"], {"input_lengths": np.array([1, 2], np.int32)}, [{"g": 0}, {"g": 1}])
    gym = ScriptedGym(plane)
    s = seams(tmp_path, plane, gym)
    outcome, pending = save(s, books(), "f")
    report = outcome.report
    assert gym.cut_begun_in_prepare  # sequential, the cut would begin only after the commit
    assert gym.calls == ["prepare", "commit", "resume"]
    assert {"cut", "cut_wait"} <= set(report.steps_s) and report.steps_s["cut"] > 0
    assert outcome.status == "writing" and pending is not None
    # the background write gets the cut: both rows, as they were
    assert sum(t.num_rows for t in pending.cut.rows.materialize().tables.values()) == 2
    assert s.steps.counts["save.cut"] == 1
    s.store_and_acknowledge.assert_called_once_with()  # step 1's drain, timed as flush_acks
    assert "flush_acks" in report.steps_s


def test_a_failed_cut_aborts_the_save_with_its_error(tmp_path: Path) -> None:
    plane = CutGate(fail=True)
    gym = ScriptedGym(plane)
    s = seams(tmp_path, plane, gym)
    outcome, pending = save(s, books(), "f")
    assert outcome.status == "aborted" and "listing failed" in outcome.report.error
    assert isinstance(outcome.cause, GymCallError)
    assert gym.calls == ["prepare", "commit", "abort"] and pending is None
    assert s.store.latest() is None and "save.cut" not in s.steps.counts


def test_no_cut_outlives_a_failed_prepare(tmp_path: Path) -> None:
    plane = CutGate(linger_s=0.5)  # released by the abort, it still runs a while
    gym = ScriptedGym(plane, prepare_error=True)
    s = seams(tmp_path, plane, gym)
    outcome, pending = save(s, books(), "f")
    assert outcome.status == "aborted" and "prepare of agent" in outcome.report.error and pending is None
    assert gym.calls == ["prepare", "abort"]
    assert plane.ended.is_set()  # the save waited for it before it returned
    assert s.store.latest() is None
