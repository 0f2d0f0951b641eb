"""gymkit.fence: replay, concurrent duplicates, failures, conflicts and retirement (CONTROL.md §2-3)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gymkit.collector import holds
from gymkit.fence import ControlError, Fence, time_left


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())


class Op:
    """A fenced operation's body that counts its runs; ``gate`` holds it, ``fail`` makes it raise."""

    def __init__(self, result: Any = "ok") -> None:
        self.result, self.runs = result, 0
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    async def __call__(self) -> Any:
        self.runs += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return {"result": self.result, "run": self.runs}


async def pause(fence: Fence, cid: str, op: Op, **kw: Any) -> Any:
    return await fence.run(cid, "pause", op, allowed=("idle",), entering="preparing", success="prepared", **kw)


async def resume(fence: Fence, cid: str, op: Op) -> Any:
    return await fence.run(cid, "resume", op, allowed=("preparing", "prepared", "committed_paused"),
                           entering=None, success="idle", retire=True)


async def commit(fence: Fence, cid: str, op: Op) -> Any:
    return await fence.run(cid, "commit", op, allowed=("prepared",), entering="committing",
                           success="committed_paused")


def code(exc_info: pytest.ExceptionInfo) -> str:
    assert isinstance(exc_info.value, ControlError) and exc_info.value.status == 409
    return exc_info.value.code


def test_a_repeat_returns_the_recorded_result_without_running_again() -> None:
    async def scenario() -> None:
        fence, op = Fence(), Op()
        first = await pause(fence, "c1", op, deadline_ts=123.0)
        assert fence.snapshot() == {"phase": "prepared", "active_checkpoint_id": "c1", "deadline_ts": 123.0}
        assert await pause(fence, "c1", op) is first and op.runs == 1
        c = Op("committed")
        assert (await commit(fence, "c1", c))["result"] == "committed"
        # A replay is answered whatever the phase is now (pause is only allowed from idle).
        assert fence.phase == "committed_paused" and await pause(fence, "c1", op) is first
        assert (await commit(fence, "c1", c))["run"] == 1 and c.runs == 1
    run(scenario)


def test_a_concurrent_duplicate_awaits_the_first_run() -> None:
    async def scenario() -> None:
        fence, op = Fence(), Op()
        op.gate = asyncio.Event()
        first = asyncio.create_task(pause(fence, "c1", op))
        await asyncio.sleep(0)
        assert fence.phase == "preparing" and fence.active_checkpoint_id == "c1"
        dup = asyncio.create_task(pause(fence, "c1", op))
        await asyncio.sleep(0.01)
        assert not dup.done()
        op.gate.set()
        assert await first == await dup and op.runs == 1
    run(scenario)


def test_a_concurrent_duplicate_gets_the_first_runs_error_and_a_retry_runs_again() -> None:
    async def scenario() -> None:
        fence, op = Fence(), Op()
        op.gate, op.fail = asyncio.Event(), ControlError("agent_prepare_incomplete", "not yet")
        first = asyncio.create_task(pause(fence, "c1", op))
        await asyncio.sleep(0)
        dup = asyncio.create_task(pause(fence, "c1", op))
        await asyncio.sleep(0)
        op.gate.set()
        for task in (first, dup):
            with pytest.raises(ControlError) as info:
                await task
            assert code(info) == "agent_prepare_incomplete"
        assert op.runs == 1
        op.fail = None
        assert (await pause(fence, "c1", op))["run"] == 2
    run(scenario)


def test_a_failure_is_not_recorded_and_resets_the_fence() -> None:
    async def scenario() -> None:
        fence, op = Fence(), Op()
        op.fail = ControlError("agent_prepare_incomplete", "blocked")
        with pytest.raises(ControlError):
            await pause(fence, "c1", op, deadline_ts=5.0)
        # From idle: back to idle with no active id, so another id may start.
        assert fence.snapshot() == {"phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
        await pause(fence, "c2", Op())
        # From a non-idle phase: back to it, the id stays active.
        c = Op()
        c.fail = RuntimeError("disk full")
        with pytest.raises(RuntimeError):
            await commit(fence, "c2", c)
        assert (fence.phase, fence.active_checkpoint_id) == ("prepared", "c2")
        c.fail = None
        assert (await commit(fence, "c2", c))["run"] == 2 and fence.phase == "committed_paused"
    run(scenario)


def test_phase_on_failure() -> None:
    async def scenario() -> None:
        fence, op = Fence(), Op()
        op.fail = ControlError("ledger_mismatch", "bad")
        async def restore(cid: str) -> Any:
            return await fence.run(cid, "restore", op, allowed=("idle", "restore_failed_paused"), entering="restoring",
                                   success="restored_paused", phase_on_failure="restore_failed_paused")

        with pytest.raises(ControlError):
            await restore("r1")
        assert (fence.phase, fence.active_checkpoint_id) == ("restore_failed_paused", None)
        op.fail = None
        await restore("r2")  # restore again is allowed, with any id
        assert (fence.phase, fence.active_checkpoint_id) == ("restored_paused", "r2")
    run(scenario)


def test_another_id_conflicts_and_a_wrong_phase_is_invalid() -> None:
    async def scenario() -> None:
        fence = Fence()
        with pytest.raises(ControlError) as info:
            await commit(fence, "c1", Op())
        assert code(info) == "invalid_phase" and fence.active_checkpoint_id is None
        await pause(fence, "c1", Op())
        for attempt in (pause(fence, "c2", Op()), commit(fence, "c2", Op()), resume(fence, "c2", Op())):
            with pytest.raises(ControlError) as info:
                await attempt
            assert code(info) == "checkpoint_conflict"
        with pytest.raises(ControlError) as info:
            fence.check("c2")
        assert code(info) == "checkpoint_conflict"
        with pytest.raises(ControlError) as info:
            fence.check("c1", ("idle",))
        assert code(info) == "invalid_phase"
        fence.check("c1", ("prepared",))
        fence.check("c1")
    run(scenario)


def test_resume_retires_the_id_and_only_its_resume_replays() -> None:
    async def scenario() -> None:
        fence = Fence()
        await pause(fence, "c1", Op())
        await commit(fence, "c1", Op())  # recorded, and still refused after retirement
        r = Op("resumed")
        answer = await resume(fence, "c1", r)
        assert fence.snapshot() == {"phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
        assert fence.retired("c1")
        assert await resume(fence, "c1", r) is answer and r.runs == 1
        for attempt in (commit(fence, "c1", Op()), pause(fence, "c1", Op()),
                        fence.run("c1", "status", Op(), allowed=("idle",), entering=None, success="idle")):
            with pytest.raises(ControlError) as info:
                await attempt
            assert code(info) == "stale_checkpoint"
        with pytest.raises(ControlError) as info:
            fence.check("c1")
        assert code(info) == "stale_checkpoint"
        # Kept for good: later checkpoints do not bring it back.
        for cid in ("c2", "c3"):
            await pause(fence, cid, Op())
            await resume(fence, cid, Op())
        with pytest.raises(ControlError) as info:
            await pause(fence, "c1", Op())
        assert code(info) == "stale_checkpoint"
        assert await resume(fence, "c1", r) is answer
    run(scenario)


def test_a_failed_resume_retires_nothing() -> None:
    async def scenario() -> None:
        fence = Fence()
        await pause(fence, "c1", Op())
        r = Op()
        r.fail = RuntimeError("hook failed")
        with pytest.raises(RuntimeError):
            await resume(fence, "c1", r)
        assert not fence.retired("c1") and (fence.phase, fence.active_checkpoint_id) == ("prepared", "c1")
        r.fail = None
        await resume(fence, "c1", r)
        assert fence.retired("c1")
    run(scenario)


def test_listeners_and_changed_follow_every_transition() -> None:
    async def scenario() -> None:
        fence, seen = Fence(), []
        fence.listeners.append(seen.append)
        waiter = asyncio.create_task(fence.changed())
        await asyncio.sleep(0)
        await pause(fence, "c1", Op())
        await asyncio.wait_for(waiter, 1)
        await resume(fence, "c1", Op())
        assert seen == ["preparing", "prepared", "idle"]
    run(scenario)


def test_time_left_clamps_at_zero() -> None:
    assert time_left(time.time() - 100) == 0.0
    assert 9 < time_left(time.time() + 10) <= 10


# An operation whose id a concurrent resume retired leaves the phase to the resume.
def test_an_operation_that_keeps_the_phase_does_not_revive_a_retired_id() -> None:
    async def scenario() -> None:
        fence = Fence()
        await pause(fence, "c1", Op())
        slow = Op()
        slow.gate = asyncio.Event()
        keep = asyncio.create_task(fence.run("c1", "abort:r:0", slow, allowed=("preparing", "prepared"),
                                             entering=None, success="prepared"))
        await asyncio.sleep(0)
        await resume(fence, "c1", Op())  # allowed: the phase is still prepared
        slow.gate.set()
        await keep
        assert fence.snapshot() == {"phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
        await pause(fence, "c2", Op())  # else every new id is a checkpoint_conflict from now on
    run(scenario)


def test_the_collector_is_held_off_while_a_checkpoint_is_under_way() -> None:
    async def scenario() -> None:
        fence = Fence()
        assert gc.isenabled() and holds() == 0
        await pause(fence, "c1", Op())
        assert not gc.isenabled() and holds() == 1  # prepared
        await commit(fence, "c1", Op())
        assert not gc.isenabled() and holds() == 1  # one hold for the whole checkpoint
        await resume(fence, "c1", Op())
        assert gc.isenabled() and holds() == 0
        # A prepare that fails from idle leaves nothing held.
        failing = Op()
        failing.fail = ControlError("agent_prepare_incomplete", "blocked")
        with pytest.raises(ControlError):
            await pause(fence, "c2", failing)
        assert gc.isenabled() and holds() == 0
    run(scenario)


def test_two_fences_of_one_process_hold_until_both_are_idle() -> None:
    async def scenario() -> None:
        a, b = Fence(), Fence()  # two servers hosted in one process
        await pause(a, "c1", Op())
        await pause(b, "c1", Op())
        await resume(a, "c1", Op())
        assert not gc.isenabled() and holds() == 1  # b still paused
        await resume(b, "c1", Op())
        assert gc.isenabled() and holds() == 0
    run(scenario)


def test_a_fence_dropped_mid_checkpoint_ends_its_hold() -> None:
    async def scenario() -> None:
        fence = Fence()
        await pause(fence, "c1", Op())
        assert holds() == 1
        ref = weakref.ref(fence)
        del fence
        gc.collect()  # a collection asked for runs while the collector is held off
        assert ref() is None and holds() == 0 and gc.isenabled()
    run(scenario)
