"""The save's steps (:mod:`coordinator.checkpoint.save`) against a scripted Gym: RL's cut is taken
while Gym prepares and commits (not after), its errors abort the save with their type (an
``aborted`` outcome, not an exception), no cut outlives a failed save, and a prepare refused
``agent_prepare_incomplete`` (a result completed after the flush) flushes again and prepares under a
fresh checkpoint id, with the cut taken after that second flush."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from unittest.mock import Mock

import numpy as np

from coordinator.bookkeeping import Bookkeeping
from coordinator.checkpoint.save import PREPARE_ATTEMPTS, save
from coordinator.checkpoint.seams import Seams
from coordinator.config import ControllerConfig
from coordinator.dataplane import InMemoryDataPlane
from coordinator.errors import GymCallError
from coordinator.faults import Steps
from coordinator.workload import Workload
from gymkit.gym_fleet import AbortResult, CommitResult, PrepareResult, StepResult
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
    """Gym's save calls (the NemoGym actor's names and arguments, its typed results); prepare waits
    for the cut to have begun, commit releases it. ``refusals`` prepares are refused 409
    ``agent_prepare_incomplete`` first (each releasing the cut it waited for, as the actor's own
    resume of the participants it paused ends that attempt)."""

    def __init__(self, plane: CutGate, prepare_error: bool = False, refusals: int = 0) -> None:
        self.plane = plane
        self.prepare_error = prepare_error
        self.refusals = refusals
        self.calls: list[str] = []
        self.ids: dict[str, list[str]] = {}  # call -> the checkpoint ids it was given, in order
        self.cut_begun_in_prepare = False

    def _call(self, name: str, cid: str) -> None:
        self.calls.append(name)
        self.ids.setdefault(name, []).append(cid)

    def prepare_checkpoint(self, cid: str, deadline_ts: float) -> PrepareResult:
        self._call("prepare", cid)
        self.cut_begun_in_prepare = self.plane.begun.wait(WAIT_S)
        if self.refusals > 0:
            self.refusals -= 1
            self.plane.release.set()
            raise GymCallError("agent-checkpoint/prepare of responses_api_agents agent0: 409 agent_prepare_incomplete: "
                               "1 completed result not acknowledged", component="responses_api_agents",
                               name="agent0", status=409, error="agent_prepare_incomplete")
        if self.prepare_error:
            raise GymCallError("prepare of agent: 500")
        return PrepareResult(checkpoint_id=cid, participants=[])

    def commit_checkpoint(self, cid: str, deadline_ts: float, checkpoint_dir: str) -> CommitResult:
        self._call("commit", cid)
        self.plane.release.set()
        return CommitResult(checkpoint_id=cid, checkpoint_dir=checkpoint_dir, participants=[])

    def resume_checkpoint(self, cid: str, deadline_ts: float) -> StepResult:
        self._call("resume", cid)
        return StepResult(checkpoint_id=cid, participants=[])

    def abort_checkpoint(self, cid: str, deadline_ts: float) -> AbortResult:
        self._call("abort", cid)
        self.plane.release.set()
        return AbortResult(checkpoint_id=cid, participants=[])


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


def _row(key: str, value: int) -> tuple:
    return ("train", [key], {"input_lengths": np.array([value], np.int32)}, [{"g": value}])


def test_a_prepare_refused_agent_prepare_incomplete_flushes_again_under_a_fresh_id(tmp_path: Path) -> None:
    """A result completed after the first flush: the agents refuse the prepare. The save stores and
    acknowledges again, prepares under a fresh checkpoint id, and its cut is the one taken after the
    second flush (it holds the row that flush stored); the first id is never committed."""
    plane = CutGate()
    plane.put(*_row("a", 1))
    gym = ScriptedGym(plane, refusals=1)
    s = seams(tmp_path, plane, gym)
    flushes: list[bool] = []  # whether every cut taken so far had ended, at each flush

    def flush() -> None:
        flushes.append(plane.ended.is_set())
        if len(flushes) == 2:
            plane.put(*_row("late", 2))  # the result that completed after the first flush

    s.store_and_acknowledge.side_effect = flush
    outcome, pending = save(s, books(), "f")
    assert outcome.status == "writing" and pending is not None, outcome.report.error
    assert gym.calls == ["prepare", "prepare", "commit", "resume"]
    first, second = gym.ids["prepare"]
    assert first != second and first.startswith("ckpt-") and second.startswith("ckpt-")
    assert gym.ids["commit"] == gym.ids["resume"] == [second]
    assert outcome.report.checkpoint_id == second
    assert s.store_and_acknowledge.call_count == 2
    assert flushes == [False, True]  # the first cut ended before the second flush stored anything
    keys = sorted(k for t in pending.cut.rows.materialize().tables.values() for k in t.column("key").to_pylist())
    assert keys == ["a", "late"]  # the cut follows the second flush
    assert s.steps.counts["save.prepared"] == 1 and "abort" not in gym.calls


def test_a_prepare_refused_every_time_aborts_the_save_after_the_last_attempt(tmp_path: Path) -> None:
    plane = CutGate()
    gym = ScriptedGym(plane, refusals=PREPARE_ATTEMPTS)
    s = seams(tmp_path, plane, gym)
    outcome, pending = save(s, books(), "f")
    assert outcome.status == "aborted" and pending is None
    assert "agent_prepare_incomplete" in outcome.report.error
    assert isinstance(outcome.cause, GymCallError) and outcome.cause.error == "agent_prepare_incomplete"
    assert gym.calls == ["prepare"] * PREPARE_ATTEMPTS + ["abort"]
    assert len(set(gym.ids["prepare"])) == PREPARE_ATTEMPTS  # a fresh id for every attempt
    assert s.store_and_acknowledge.call_count == PREPARE_ATTEMPTS
    assert plane.ended.is_set() and s.store.latest() is None and "save.prepared" not in s.steps.counts
