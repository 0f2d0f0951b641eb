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
import time

from devtools.agent_stand_ins import StandIns, stand_in_agent
from gymkit.agent_control import AgentExecutions
from refgym.agent_server import MAX_OPEN_CALLS, RefAgent, Rollout
from refgym.api import StartRollout

ROLLOUTS = 5 * MAX_OPEN_CALLS


def test_parking_sends_no_model_call_for_rollouts_still_waiting_for_a_slot() -> None:
    async def scenario() -> tuple[int, int, int, bool]:
        stand_ins = StandIns(hold=True)  # model calls wait for release: every turn slot holds one in flight
        agent, executions = stand_in_agent(stand_ins)
        for i in range(ROLLOUTS):
            agent.start(StartRollout(rollout_id=f"r{i}", seed=i, turns=3))
        while stand_ins.model_calls < MAX_OPEN_CALLS:  # every turn slot holds a model call in flight
            await asyncio.sleep(0.01)
        in_flight = stand_ins.model_calls
        executions.request_park()  # the prepare: close admission, ask every execution to park
        await asyncio.sleep(0.05)
        stand_ins.paused = True  # the model refuses new calls; the held ones finish their turns
        stand_ins.release.set()
        status = await asyncio.wait_for(executions.wait_prepared(time.time() + 30), 30)
        calls_at_parked = stand_ins.model_calls
        finished_turns = sum(len(r.trajectory) for r in agent.rollouts.values())
        await agent.close()
        return in_flight, calls_at_parked, finished_turns, status.ready_to_commit and status.parked == ROLLOUTS

    in_flight, calls, turns, all_parked = asyncio.run(scenario())
    assert in_flight == MAX_OPEN_CALLS
    # The rollouts that held a turn slot finished their turn; the others parked without calling the
    # model (otherwise each of the 64 waiting rollouts would take a call slot and get a 409 first).
    assert calls == MAX_OPEN_CALLS and turns == MAX_OPEN_CALLS
    assert all_parked  # every execution parked at a boundary: the agent is ready to commit


def test_a_cancelled_rollout_waiting_for_a_slot_gives_its_slot_back() -> None:
    async def scenario() -> int:
        agent = RefAgent("agent0", "http://model.test", {"notes": "http://resources.test"}, AgentExecutions())
        sem = agent._turn_slots
        for _ in range(MAX_OPEN_CALLS):
            await sem.acquire()
        waiter = asyncio.ensure_future(agent._slot_unless_parking(Rollout("r0", seed=0, turns=1, tools=["notes"]), sem))
        await asyncio.sleep(0.01)
        sem.release()  # the slot is granted to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs again
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        return sem._value

    assert asyncio.run(scenario()) == 1  # the slot came back (the other 15 are still held here)
