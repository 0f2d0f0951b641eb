"""Parking the reference agent takes the calls in flight, not one model round trip per rollout.

The agent runs many rollouts through a few call slots. When a prepare asks every execution to park
(:meth:`gymkit.agent_control.AgentExecutions.request_park`, what the ``agent-checkpoint/prepare``
route does first), a rollout still waiting for a slot has not started its turn (its model call is
not sent), so it must park at once rather than take a slot only to be refused by the paused model
(409 ``checkpoint_parked``). The model and resources servers are stand-ins here (httpx's mock
transport) so the test can count every model call; the real servers' parking is covered by the
protocol and proof tests.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from devtools.agent_stand_ins import (
    StandIns,
    park_with_turns_in_flight,
    stand_in_agent,
    start_rollouts,
    wait_finished,
    wait_until,
)
from gymkit.checkpoint_dir import record_json
from refgym.agent_server import MAX_OPEN_CALLS, Rollout, Turn, TurnSlots, _from_boundary
from refgym.api import ModelReply, StartRollout
from schemas.errors import InvalidRecordError
from schemas.gym_files import AgentBoundaryRecord, PendingModel

ROLLOUTS = 5 * MAX_OPEN_CALLS


async def never_parked(rollouts: int, turns: int) -> list[list[Turn]]:
    """The trajectories of rollouts ``r0`` .. of a run never parked (a fresh stand-in agent)."""
    agent, _ = stand_in_agent(StandIns())
    start_rollouts(agent, rollouts, turns)
    await wait_finished(agent)
    await agent.close()
    return [agent.rollouts[(f"r{i}", 0)].trajectory for i in range(rollouts)]


async def records_parked_at_answers() -> list[AgentBoundaryRecord]:
    """The boundary records of :data:`ROLLOUTS` rollouts of 2 turns, parked while the first
    :data:`MAX_OPEN_CALLS` had their second turn's model call in flight (so those parked at its
    answer), read back through their bytes as a snapshot holds them; the agent is closed after."""
    stand_ins = StandIns(hold=True, hold_from_turn=1)
    agent, executions = stand_in_agent(stand_ins)
    await park_with_turns_in_flight(agent, executions, stand_ins, ROLLOUTS, turns=2)
    records = [msgspec.json.decode(record_json(executions.get(f"r{i}", 0).boundary),  # type: ignore[arg-type]
                                   type=AgentBoundaryRecord) for i in range(ROLLOUTS)]
    await agent.close()
    return records


def test_parking_sends_no_model_call_for_rollouts_still_waiting_for_a_slot() -> None:
    async def scenario() -> tuple[int, int, int, bool]:
        stand_ins = StandIns(hold=True)  # model calls wait for release: every turn slot holds one in flight
        agent, executions = stand_in_agent(stand_ins)
        # The prepare: close admission, ask every execution to park; then the model refuses new calls,
        # and the held ones finish their turns (first turns: they are finished, not parked pending).
        status = await park_with_turns_in_flight(agent, executions, stand_ins, ROLLOUTS, pause_model=True)
        finished_turns = sum(len(r.trajectory) for r in agent.rollouts.values())
        await agent.close()
        return (stand_ins.model_calls, stand_ins.refused, finished_turns,
                status.ready_to_commit and status.parked == ROLLOUTS)

    calls, refused, turns, all_parked = asyncio.run(scenario())
    # The rollouts that held a turn slot finished their turn; the others parked without calling the
    # model (otherwise each of the 64 waiting rollouts would take a call slot and get a 409 first).
    assert calls == MAX_OPEN_CALLS and refused == 0 and turns == MAX_OPEN_CALLS
    assert all_parked  # every execution parked at a boundary: the agent is ready to commit


def test_a_turn_whose_model_call_answers_after_the_park_request_parks_at_the_answer_and_finishes_after_resume(
) -> None:
    """Gym's ``pending_model`` boundary: a rollout past its first turn keeps the model's answer in its
    record (the call is in the model's ledger), sends no tool call while parked, and after the resume
    finishes that turn with the answer it kept: one model call per turn, the same trajectory as a
    run never parked."""

    async def scenario() -> tuple[list, int, int, list, list]:
        stand_ins = StandIns(hold=True, hold_from_turn=1)  # the second turns' model calls are in flight
        agent, executions = stand_in_agent(stand_ins)
        await park_with_turns_in_flight(agent, executions, stand_ins, ROLLOUTS, turns=2)
        pending = [executions.get(f"r{i}", 0).boundary for i in range(MAX_OPEN_CALLS)]  # type: ignore[union-attr]
        tool_calls_parked = stand_ins.tool_calls
        executions.reopen()
        await agent.on_resume()
        await wait_finished(agent)
        trajectories = [agent.rollouts[(f"r{i}", 0)].trajectory for i in range(ROLLOUTS)]
        await agent.close()

        return pending, tool_calls_parked, stand_ins.model_calls, trajectories, await never_parked(ROLLOUTS, 2)

    pending, tool_calls_parked, model_calls, trajectories, unparked = asyncio.run(scenario())
    for i, b in enumerate(pending):
        assert b is not None and b.boundary_kind == "pending_model" and b.pending_model is not None, i
        assert (b.boundary_index, b.turn_index, b.last_committed_model_call_id) == (3, 1, "call-1")
        assert b.pending_model.model_call_id == b.pending_model.response["model_call_id"] == "call-1"
        assert len(b.agent_state["trajectory"]) == 1  # the turn is not done: its tool calls are pending
        assert b.resource_state_revisions == {"tools": 2}  # the session as the first turn's tool call left it
    assert tool_calls_parked == ROLLOUTS  # the first turns' only: none of the pending turns'
    assert model_calls == 2 * ROLLOUTS  # the pending turns called the model once, not again after the resume
    assert trajectories == unparked


def test_a_restored_pending_model_boundary_finishes_its_turn_with_the_kept_answer_in_the_next_attempt() -> None:
    """Restore: the committed records (through their bytes, as a snapshot holds them) continue as
    attempt 1 on a fresh agent. A rollout parked at a model's answer runs that turn's tool calls
    without calling the model again (the turn keeps the capture key of the attempt that called
    it); every trajectory is the one of a run never parked."""

    async def scenario() -> tuple[list, int, list, list]:
        records = await records_parked_at_answers()  # the crash: the agent is gone, its records are left

        fresh = StandIns()
        restored, kit = stand_in_agent(fresh)
        kit.install_restored(records)
        kit.reopen()
        for i in range(ROLLOUTS):
            restored.start(StartRollout(rollout_id=f"r{i}", attempt_index=1, seed=i, turns=2))
        await wait_finished(restored)
        continued = [restored.rollouts[(f"r{i}", 1)] for i in range(ROLLOUTS)]
        await restored.close()

        return records, fresh.model_calls, continued, await never_parked(ROLLOUTS, 2)

    records, model_calls, continued, unparked = asyncio.run(scenario())
    kinds = [r.boundary_kind for r in records]
    assert kinds == ["pending_model"] * MAX_OPEN_CALLS + ["turn_complete"] * (ROLLOUTS - MAX_OPEN_CALLS)
    # 16 continuations had their last turn's answer: no model call; the others call it for that turn
    assert model_calls == ROLLOUTS - MAX_OPEN_CALLS
    assert [r.outcome for r in continued] == ["finished"] * ROLLOUTS
    assert [r.trajectory for r in continued] == unparked
    assert [r.turn_keys for r in continued] == [[f"r{i}", f"r{i}"] for i in range(MAX_OPEN_CALLS)] + [
        [f"r{i}", f"r{i}-a1"] for i in range(MAX_OPEN_CALLS, ROLLOUTS)]
    assert continued[0].restored == {"from_attempt": 0, "after_call": "call-1"}
    assert continued[-1].restored == {"from_attempt": 0, "after_call": "call-0"}


def test_a_pending_turn_finishes_while_the_model_refuses_calls() -> None:
    """The rest of a pending turn calls no model, so it does not wait for the model to accept calls
    again: restored with the model refusing every call (and seen refusing), the continuations parked
    at an answer finish their (last) turn, while the others wait for the model."""

    async def scenario() -> tuple[list[str], int]:
        records = await records_parked_at_answers()
        refusing = StandIns()
        refusing.paused = True
        restored, kit = stand_in_agent(refusing)
        kit.install_restored(records)
        kit.reopen()
        for i in range(MAX_OPEN_CALLS, ROLLOUTS):  # those that need the model first: it is seen refusing
            restored.start(StartRollout(rollout_id=f"r{i}", attempt_index=1, seed=i, turns=2))
        await wait_until(lambda: refusing.refused >= 1, "a model call refused", 10)
        for i in range(MAX_OPEN_CALLS):  # then the ones parked at an answer
            restored.start(StartRollout(rollout_id=f"r{i}", attempt_index=1, seed=i, turns=2))
        finished = [f"r{i}" for i in range(MAX_OPEN_CALLS)]
        await wait_until(lambda: all(restored.rollouts[(rid, 1)].outcome == "finished" for rid in finished),
                         "the pending turns finished", 10)
        others = sum(r.outcome == "running" for r in restored.rollouts.values())
        await restored.close()
        return finished, others

    finished, still_running = asyncio.run(scenario())
    assert len(finished) == MAX_OPEN_CALLS
    assert still_running == ROLLOUTS - MAX_OPEN_CALLS  # they need the model, which refuses every call


def test_a_pending_model_record_that_does_not_fit_its_agent_state_is_refused_naming_the_field() -> None:
    """A record whose kept answer is not the next turn's call, or is not a model answer at all, is a
    clear error on restore (the rollout cannot continue from it), not a turn run twice or skipped."""
    reply = ModelReply(response_id="x", model="m", capture_key="r", model_call_id="call-0", generation_token_ids=[1],
                       generation_log_probs=[-0.1], cum_len=3, digest="0" * 64, parent_resolution="root")
    state = msgspec.to_builtins(Rollout("r", seed=0, turns=2, tools=["notes"]).state())

    def record(response: dict, call: str = "call-0") -> AgentBoundaryRecord:
        return AgentBoundaryRecord(rollout_id="r", attempt_index=0, boundary_index=1, turn_index=0,
                                   boundary_kind="pending_model", last_committed_model_call_id=call,
                                   pending_model=PendingModel(model_call_id=call, response=response),
                                   agent_state=state)

    r = _from_boundary(record(msgspec.to_builtins(reply)), 1)
    assert r.pending == reply and r.boundary_index == 1 and r.restored == {"from_attempt": 0, "after_call": "call-0"}
    with pytest.raises(InvalidRecordError, match=r"pending_model answers 'call-1'.*expected 'call-0'"):
        _from_boundary(record(msgspec.to_builtins(msgspec.structs.replace(reply, model_call_id="call-1")), "call-1"), 1)
    with pytest.raises(InvalidRecordError, match=r"pending_model\.response: .*generation_token_ids"):
        _from_boundary(record({k: v for k, v in msgspec.to_builtins(reply).items() if k != "generation_token_ids"}), 1)


def test_a_cancelled_rollout_waiting_for_a_slot_gives_its_slot_back() -> None:
    async def scenario() -> tuple[int, int]:
        slots = TurnSlots(MAX_OPEN_CALLS, lambda r: True)
        for _ in range(MAX_OPEN_CALLS):
            assert await slots.take(Rollout("held", seed=0, turns=1, tools=["notes"]))
        waiter = asyncio.ensure_future(slots.take(Rollout("r0", seed=0, turns=1, tools=["notes"])))
        await asyncio.sleep(0.01)
        slots.release()  # the slot is granted to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs again
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        queued = len(slots.queued())
        return slots.free, queued

    assert asyncio.run(scenario()) == (1, 0)  # the slot came back (the other 15 are still held here)


def test_a_cancelled_rollout_parked_where_it_queued_leaves_the_queue_with_no_slot() -> None:
    async def scenario() -> tuple[int, int]:
        parked = False
        slots = TurnSlots(1, lambda r: not parked)
        assert await slots.take(Rollout("held", seed=0, turns=1, tools=["notes"]))
        waiter = asyncio.ensure_future(slots.take(Rollout("r0", seed=0, turns=1, tools=["notes"])))
        await asyncio.sleep(0.01)
        parked = True  # a prepare parked it where it queued
        slots.set_aside(lambda r: parked)
        slots.release()  # nobody may take it: the one queued rollout is parked
        await asyncio.sleep(0.01)
        assert not waiter.done()
        waiter.cancel()
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        parked = False
        slots.requeue()  # nothing comes back: the cancelled rollout left
        return slots.free, len(slots.queued())

    assert asyncio.run(scenario()) == (1, 0)


def test_rollouts_queued_for_a_slot_are_parked_and_released_without_waking() -> None:
    """A rollout queued for a turn slot stands at its recorded boundary: the agent parks it where it
    waits (the kit's ``park_waiting``), and the resume lets it run on, without waking it either
    time. Only the rollouts that held a slot park themselves; afterwards every rollout finishes."""

    async def scenario() -> tuple[int, int, int, bool, list[int], int, int]:
        stand_ins = StandIns(hold=True)  # every turn slot holds a model call in flight
        agent, executions = stand_in_agent(stand_ins)
        self_parked = 0
        park, park_waiting = executions.park, executions.park_waiting
        parked_waiting = 0

        async def counted_park(rollout_id: str, attempt_index: int) -> None:
            nonlocal self_parked
            self_parked += 1
            await park(rollout_id, attempt_index)

        def counted_park_waiting(keys):  # type: ignore[no-untyped-def]
            nonlocal parked_waiting
            n = park_waiting(keys)
            parked_waiting += n
            return n

        executions.park = counted_park  # type: ignore[method-assign]
        executions.park_waiting = counted_park_waiting  # type: ignore[method-assign]
        status = await park_with_turns_in_flight(agent, executions, stand_ins, ROLLOUTS)
        ready = status.ready_to_commit and status.parked_with_boundary == ROLLOUTS
        calls_while_parked = stand_ins.model_calls
        released = executions.reopen()
        await agent.on_resume()
        await wait_finished(agent)
        turns = sorted({len(r.trajectory) for r in agent.rollouts.values()})
        free = agent._turn_slots.free
        await agent.close()
        return self_parked, parked_waiting, calls_while_parked, ready, turns, released, free

    self_parked, parked_waiting, calls, ready, turns, released, free = asyncio.run(scenario())
    assert calls == MAX_OPEN_CALLS  # nothing started while the agent was parked
    assert ready
    assert self_parked == MAX_OPEN_CALLS  # those whose turn was in flight parked at its model's answer
    assert parked_waiting == ROLLOUTS - MAX_OPEN_CALLS  # the queued ones were parked where they waited
    assert released == ROLLOUTS
    assert turns == [3]  # then every rollout ran on to its last turn
    assert free == MAX_OPEN_CALLS
