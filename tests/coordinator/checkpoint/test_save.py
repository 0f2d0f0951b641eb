"""The save's steps (:mod:`coordinator.checkpoint.save`) against a scripted Gym: RL's cut is taken
while Gym prepares and commits (not after), its errors abort the save with their type (an
``aborted`` outcome, not an exception), no cut outlives a failed save, and a prepare refused
``agent_prepare_incomplete`` (a result completed after the flush) flushes again, with the cut taken
after that second flush: under the same checkpoint id when the actor held Gym paused for it, under a
fresh one when the refusal resumed Gym."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from unittest.mock import Mock

import numpy as np

from coordinator.bookkeeping import Bookkeeping
from coordinator.checkpoint.save import HELD_PREPARES, PREPARE_ATTEMPTS, SETTLE_S, save
from coordinator.checkpoint.seams import Seams
from coordinator.config import ControllerConfig
from coordinator.dataplane import InMemoryDataPlane
from coordinator.errors import GymCallError
from coordinator.faults import Steps
from coordinator.gym_actor import NemoGym
from coordinator.workload import Workload
from devtools.gym_fleet import wait_until
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
    resume of the participants it paused ends that attempt); with ``held`` each such refusal says
    the actor held Gym paused, if the save asked it to."""

    def __init__(self, plane: CutGate, prepare_error: bool = False, refusals: int = 0, held: bool = False) -> None:
        self.plane = plane
        self.prepare_error = prepare_error
        self.refusals = refusals
        self.held = held
        self.asked_to_hold: list[bool] = []
        self.calls: list[str] = []
        self.ids: dict[str, list[str]] = {}  # call -> the checkpoint ids it was given, in order
        self.cut_begun_in_prepare = False

    def _call(self, name: str, cid: str) -> None:
        self.calls.append(name)
        self.ids.setdefault(name, []).append(cid)

    def prepare_checkpoint(self, cid: str, deadline_ts: float, *, hold_when_unacknowledged: bool = False) -> PrepareResult:
        self._call("prepare", cid)
        self.asked_to_hold.append(hold_when_unacknowledged)
        self.cut_begun_in_prepare = self.plane.begun.wait(WAIT_S)
        if self.refusals > 0:
            self.refusals -= 1
            self.plane.release.set()
            raise GymCallError("agent-checkpoint/prepare of responses_api_agents agent0: 409 agent_prepare_incomplete: "
                               "1 completed result not acknowledged", component="responses_api_agents",
                               name="agent0", status=409, error="agent_prepare_incomplete",
                               held=self.held and hold_when_unacknowledged)
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
    assert gym.calls == ["prepare", "commit", "resume"] and report.prepares == 1
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


def _late_result_flush(plane: CutGate, flushes: list[bool]):
    """A store-and-acknowledge that records whether every cut taken so far had ended, and stores a row
    at its second call: the result that completed after the first flush."""
    def flush() -> None:
        flushes.append(plane.ended.is_set())
        if len(flushes) == 2:
            plane.put(*_row("late", 2))

    return flush


def _cut_keys(pending) -> list[str]:
    return sorted(k for t in pending.cut.rows.materialize().tables.values() for k in t.column("key").to_pylist())


def _save_sleeps(monkeypatch) -> list[float]:
    """Every ``time.sleep`` of the thread running the save (the cut's thread is left out)."""
    slept: list[float] = []
    real, caller = time.sleep, threading.current_thread()

    def sleep(seconds: float) -> None:
        if threading.current_thread() is caller:
            slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return slept


def _save_with_a_late_result(tmp_path: Path, monkeypatch, held: bool):
    """A save whose first prepare is refused for a result that completed after the first flush (held
    or not): the scripted Gym, the seams, the flushes' record, the save's sleeps, and its outcome."""
    plane = CutGate()
    plane.put(*_row("a", 1))
    gym = ScriptedGym(plane, refusals=1, held=held)
    s = seams(tmp_path, plane, gym)
    flushes: list[bool] = []
    s.store_and_acknowledge.side_effect = _late_result_flush(plane, flushes)
    slept = _save_sleeps(monkeypatch)
    outcome, pending = save(s, books(), "f")
    assert outcome.status == "writing" and pending is not None, outcome.report.error
    return gym, s, flushes, slept, outcome, pending


def test_a_prepare_gym_held_for_unacknowledged_results_prepares_the_same_id_again(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """A result completed after the first flush, and the actor held Gym paused (agent admission
    closed) instead of resuming it. The save stores and acknowledges again, prepares the same id at
    once (no settling: nothing else can complete), and its cut follows the second flush."""
    gym, _, flushes, slept, outcome, pending = _save_with_a_late_result(tmp_path, monkeypatch, held=True)
    assert gym.calls == ["prepare", "prepare", "commit", "resume"] and gym.asked_to_hold == [True, True]
    (cid,) = set(gym.ids["prepare"])
    assert gym.ids["commit"] == gym.ids["resume"] == [cid] and outcome.report.checkpoint_id == cid
    assert flushes == [False, True] and _cut_keys(pending) == ["a", "late"]
    assert slept == [0.0]  # SETTLE_S is for a resumed Gym; the first flush of a held one waits for nothing
    assert outcome.report.prepares == 2
    assert "abort" not in gym.calls


def test_a_prepare_held_every_time_aborts_its_id_after_the_last_one(tmp_path: Path) -> None:
    """Results that never get acknowledged (their answers never reach the caller): the save gives up
    after HELD_PREPARES flushes, and its abort resumes the id Gym was held under."""
    plane = CutGate()
    gym = ScriptedGym(plane, refusals=HELD_PREPARES + 5, held=True)
    s = seams(tmp_path, plane, gym)
    outcome, pending = save(s, books(), "f")
    assert outcome.status == "aborted" and pending is None
    assert isinstance(outcome.cause, GymCallError) and outcome.cause.held
    assert gym.calls == ["prepare"] * (HELD_PREPARES + 1) + ["abort"]
    assert set(gym.ids["prepare"]) == set(gym.ids["abort"])  # one id, held then aborted
    assert s.store_and_acknowledge.call_count == HELD_PREPARES + 1 and outcome.report.prepares == HELD_PREPARES + 1
    assert plane.ended.is_set() and s.store.latest() is None


def test_a_prepare_refused_agent_prepare_incomplete_flushes_again_under_a_fresh_id(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """A result completed after the first flush: the agents refuse the prepare, and the actor resumed
    Gym (it did not hold it). The save stores and acknowledges again, prepares under a fresh
    checkpoint id, and its cut is the one taken after the second flush (it holds the row that flush
    stored); the first id is never committed."""
    gym, s, flushes, slept, outcome, pending = _save_with_a_late_result(tmp_path, monkeypatch, held=False)
    assert gym.calls == ["prepare", "prepare", "commit", "resume"]
    assert slept == [SETTLE_S]  # the resumed rollouts are given time to complete before the flush
    first, second = gym.ids["prepare"]
    assert first != second and first.startswith("ckpt-") and second.startswith("ckpt-")
    assert gym.ids["commit"] == gym.ids["resume"] == [second]
    assert outcome.report.checkpoint_id == second
    assert s.store_and_acknowledge.call_count == 2
    assert flushes == [False, True]  # the first cut ended before the second flush stored anything
    assert _cut_keys(pending) == ["a", "late"]  # the cut follows the second flush
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


class ActorOnALoop:
    """The NemoGym actor's methods as blocking calls, its coroutines run on an event loop thread of
    their own (what the controller's Ray handle gives the save)."""

    def __init__(self, nemo: NemoGym) -> None:
        self.nemo = nemo
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __getattr__(self, name: str):
        method = getattr(self.nemo, name)
        return lambda *args, **kw: asyncio.run_coroutine_threadsafe(method(*args, **kw), self.loop).result(WAIT_S)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.nemo.close(), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)


def test_a_result_completed_after_the_flush_is_stored_while_real_gym_servers_stay_paused(fleet, tmp_path: Path) -> None:
    """The race of step 1 against the reference servers: a rollout completes after the first flush, so
    the agent refuses the prepare. The actor holds Gym paused (the second flush finds the model still
    prepared), the second flush stores and acknowledges the result, and the same id prepares, commits
    and resumes."""
    gym = fleet.gym()
    nemo = ActorOnALoop(NemoGym(gym.urls, fleet.token))
    nemo.discover_checkpoint_capabilities()
    nemo.start_rollouts([{"rollout_id": "late", "attempt_index": 0, "seed": 1, "turns": 1, "tools": ["notes"]}])
    plane = InMemoryDataPlane()
    phases_at_flush: list[dict[str, str]] = []

    def flush() -> None:
        phases_at_flush.append({c.capabilities().name: c.capabilities().phase for c in gym.clients})
        if len(phases_at_flush) == 1:  # nothing to store yet: the rollout completes right after
            wait_until(lambda: len(gym.results()) == 1, "the rollout to complete")
            return
        for r in nemo.results():
            plane.put(*_row(r["rollout_id"], 1))
            nemo.acknowledge_completed_executions([{"receipt": r["completion_receipt"], "agent_name": r["agent_name"]}])

    s = Seams(gym=nemo, store=SnapshotStore(str(tmp_path / "store")), plane=plane, config=ControllerConfig(),
              steps=Steps(), store_and_acknowledge=flush, acknowledge=Mock())
    try:
        outcome, pending = save(s, books(), "f")
        assert outcome.status == "writing" and pending is not None, outcome.report.error
        assert len(phases_at_flush) == 2
        assert phases_at_flush[1]["policy0"] == "prepared"  # held: not resumed between the prepares
        assert pending.commit.checkpoint_id == outcome.report.checkpoint_id
        assert _cut_keys(pending) == ["late"]  # stored by the second flush, in the cut
        assert gym.results() == {}  # acknowledged: the agent committed no unacknowledged result
        assert {c.capabilities().phase for c in gym.clients} == {"idle"}  # resumed after the commit
        pending.draft.abandon()
    finally:
        nemo.close()
