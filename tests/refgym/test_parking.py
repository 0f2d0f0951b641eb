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

from devtools.agent_stand_ins import StandIns, park_with_turns_in_flight, stand_in_agent, wait_until
from refgym.agent_server import MAX_OPEN_CALLS, Rollout, TurnSlots

ROLLOUTS = 5 * MAX_OPEN_CALLS


def test_parking_sends_no_model_call_for_rollouts_still_waiting_for_a_slot() -> None:
    async def scenario() -> tuple[int, int, int, bool]:
        stand_ins = StandIns(hold=True)  # model calls wait for release: every turn slot holds one in flight
        agent, executions = stand_in_agent(stand_ins)
        # The prepare: close admission, ask every execution to park; then the model refuses new calls,
        # and the held ones finish their turns.
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
        await wait_until(lambda: all(r.outcome != "running" for r in agent.rollouts.values()), 30,
                         "every rollout finished")
        turns = sorted({len(r.trajectory) for r in agent.rollouts.values()})
        free = agent._turn_slots.free
        await agent.close()
        return self_parked, parked_waiting, calls_while_parked, ready, turns, released, free

    self_parked, parked_waiting, calls, ready, turns, released, free = asyncio.run(scenario())
    assert calls == MAX_OPEN_CALLS  # nothing started while the agent was parked
    assert ready
    assert self_parked == MAX_OPEN_CALLS  # those whose turn was in flight parked at its end
    assert parked_waiting == ROLLOUTS - MAX_OPEN_CALLS  # the queued ones were parked where they waited
    assert released == ROLLOUTS
    assert turns == [3]  # then every rollout ran on to its last turn
    assert free == MAX_OPEN_CALLS
