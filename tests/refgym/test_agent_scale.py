"""The reference agent with many rollouts (issue 22 §2 levers): waiting rollouts are not woken at
every other rollout's turn end, and a rollout backing off from a paused model parks at once.

The model and resources servers are stand-ins (httpx's mock transport), as in ``test_parking.py``,
so the tests count what the agent does; nothing here measures speed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from devtools.agent_stand_ins import (
    ListenCounter,
    StandIns,
    park_with_turns_in_flight,
    stand_in_agent,
    start_rollouts,
    wait_until,
)
from refgym import agent_server
from refgym.agent_server import MAX_OPEN_CALLS


def test_rollouts_waiting_for_a_turn_slot_are_not_woken_by_every_turn_end() -> None:
    """With R rollouts queued for 16 turn slots, each turn end is a change of the agent kit. A waiting
    rollout that listened to every change would be woken O(R) times per turn, O(R^2) in all; the
    agent's one watcher forwards changes only while admission is closed (a park request exists only
    then), so the kit is listened to O(R) times."""
    rollouts, turns = 12 * MAX_OPEN_CALLS, 2

    async def scenario() -> tuple[int, int, bool]:
        stand_ins = StandIns()
        agent, executions = stand_in_agent(stand_ins)
        listened = ListenCounter(executions)
        start_rollouts(agent, rollouts, turns)
        await wait_until(lambda: all(r.outcome != "running" and r.receipt is not None
                                     for r in agent.rollouts.values()), "every rollout completed", 60)
        done = all(len(r.trajectory) == turns for r in agent.rollouts.values())
        await agent.close()
        return listened.count, agent.wakeups, done

    listened, wakeups, done = asyncio.run(scenario())
    assert done
    # Per rollout: begin, a boundary per turn, the sessions' end, completion: a few changes each. The
    # watcher listens once per change; nothing else listens while admission is open.
    assert listened <= 8 * rollouts, listened
    assert wakeups == 0  # admission never closed: no rollout was woken


def test_a_rollout_backing_off_from_a_paused_model_parks_before_its_backoff_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model pauses first (NeMo-RL's prepare order), so a rollout's next model call is refused and
    the rollout backs off. A park request must end that back-off at once: the agent's prepare must not
    wait out every refused rollout's retry delay."""
    # The first back-off is 1,000 s: a prepare that waited it out could not end inside the 30 s bound
    # below, so the bound tells "ended by the park request" from "waited", not fast from slow.
    monkeypatch.setattr(agent_server, "RETRY_BASE_S", 500.0)
    monkeypatch.setattr(agent_server, "RETRY_MAX_S", 3600.0)

    async def scenario() -> tuple[int, bool]:
        stand_ins = StandIns()
        stand_ins.paused = True  # every model call is refused: the leader backs off, the others wait for it
        agent, executions = stand_in_agent(stand_ins)
        start_rollouts(agent, 4, 3)
        await wait_until(lambda: stand_ins.refused >= 1, "a model call refused", 10)
        await asyncio.sleep(0.05)  # the leader is in its 1,000 s back-off now
        executions.request_park()
        status = await asyncio.wait_for(executions.wait_prepared(time.time() + 30), 30)
        await agent.close()
        return stand_ins.refused, status.ready_to_commit and status.parked == 4

    refused, all_parked = asyncio.run(scenario())
    assert all_parked and refused == 4  # each rollout was refused once, then backed off (none asked again)


def test_rollouts_queued_behind_a_refused_model_call_send_none_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model pauses first (NeMo-RL's prepare order). The rollouts holding the 16 turn slots send
    their calls and are refused; from then on the leader alone asks the model again. Rollouts that
    were already queued for a slot must not each send a call when they get one: at 10,000 rollouts
    that was thousands of refused round trips inside the prepare."""
    monkeypatch.setattr(agent_server, "RETRY_BASE_S", 500.0)  # the leader does not ask again in the test
    monkeypatch.setattr(agent_server, "RETRY_MAX_S", 3600.0)
    rollouts = 3 * MAX_OPEN_CALLS

    async def scenario() -> tuple[int, int, bool]:
        stand_ins = StandIns()
        stand_ins.paused = True
        agent, executions = stand_in_agent(stand_ins)
        start_rollouts(agent, rollouts, 3)
        await wait_until(lambda: stand_ins.refused + agent.calls_held_back >= rollouts, "every rollout tried once")
        await asyncio.sleep(0.1)  # time for any further call to be sent
        refused = stand_ins.refused
        executions.request_park()
        status = await asyncio.wait_for(executions.wait_prepared(time.time() + 30), 30)
        await agent.close()
        return refused, agent.calls_held_back, status.ready_to_commit and status.parked == rollouts

    refused, held_back, all_parked = asyncio.run(scenario())
    assert refused == MAX_OPEN_CALLS  # one call per slot, sent before the first refusal came back
    assert held_back == rollouts - MAX_OPEN_CALLS
    assert all_parked


def test_rollouts_asked_to_park_while_queued_for_a_slot_park_without_a_back_off() -> None:
    """A rollout queued for a turn slot when the park request comes has not started its turn: it
    parks at once. Backing off first (a timer, a wake-up, a second pass through its loop) for each
    of 1,000 queued rollouts was most of an agent's prepare CPU."""
    rollouts = 5 * MAX_OPEN_CALLS

    async def scenario() -> tuple[int, bool]:
        stand_ins = StandIns(hold=True)  # every turn slot holds a model call in flight
        agent, executions = stand_in_agent(stand_ins)
        backoffs = 0
        backoff = agent._backoff

        async def counted(seconds: float) -> None:
            nonlocal backoffs
            backoffs += 1
            await backoff(seconds)

        agent._backoff = counted  # type: ignore[method-assign]
        status = await park_with_turns_in_flight(agent, executions, stand_ins, rollouts)
        await agent.close()
        return backoffs, status.ready_to_commit and status.parked == rollouts

    backoffs, all_parked = asyncio.run(scenario())
    assert all_parked
    assert backoffs == 0
