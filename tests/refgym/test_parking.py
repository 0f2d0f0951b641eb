"""Parking the reference agent takes the calls in flight, not one model round trip per rollout.

The agent runs many rollouts through a few call slots. When prepare closes the gate, a rollout
still waiting for a slot has not started its turn (its model call is not sent), so it must stop at
once rather than take a slot only to be refused by the paused model. The model and resource
servers are stand-ins here (httpx's mock transport) so the test can count every model call; the
real servers' parking is covered by the protocol and coordinator tests.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec

from refgym.agent_server import MAX_OPEN_CALLS, AgentParticipant
from refgym.api import REVISION_HEADER, ModelReply, StartRollout, ToolReply

ROLLOUTS = 5 * MAX_OPEN_CALLS


class StandIns:
    """Model calls are held until ``release`` is set; each one is counted, paused or not."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.model_calls = 0
        self.paused = False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/responses":
            self.model_calls += 1
            if self.paused:
                return httpx.Response(503, json={"error": "paused", "reason": "checkpoint"})
            await self.release.wait()
            call = json.loads(request.content)
            reply = ModelReply(response_id="r", model="m", capture_key=call["capture_key"],
                               model_call_id=call["model_call_id"], generation_token_ids=[1, 2],
                               generation_log_probs=[-0.1, -0.2], cum_len=len(call["prompt_token_ids"]) + 2,
                               digest="0" * 64, parent_resolution="root")
            return httpx.Response(200, content=msgspec.json.encode(reply))
        if path.startswith("/tools/"):
            body = json.loads(request.content)
            tool = ToolReply(resource="tools", tool=path.rsplit("/", 1)[1], session_id=body["session_id"],
                             revision=body["expected_revision"] + 1, result={"value": 1})
            return httpx.Response(200, content=msgspec.json.encode(tool), headers={REVISION_HEADER: str(tool.revision)})
        return httpx.Response(200, json={})  # session reset


def test_parking_sends_no_model_call_for_rollouts_still_waiting_for_a_slot() -> None:
    async def scenario() -> tuple[int, int, int]:
        stand_ins = StandIns()
        agent = AgentParticipant("agent0", "http://model.test", "http://resources.test")
        assert agent.admits_work()  # no kit drives it: rollouts may start
        agent.http = httpx.AsyncClient(transport=httpx.MockTransport(stand_ins))
        for i in range(ROLLOUTS):
            agent.start(StartRollout(rollout_id=f"r{i}", seed=i, turns=3))
        while stand_ins.model_calls < MAX_OPEN_CALLS:  # every turn slot holds a model call in flight
            await asyncio.sleep(0.01)
        in_flight = stand_ins.model_calls
        prepared = asyncio.ensure_future(agent.prepare(deadline=0))
        await asyncio.sleep(0.05)
        stand_ins.paused = True  # the model refuses new calls; the held ones finish their turns
        stand_ins.release.set()
        await asyncio.wait_for(prepared, 30)
        calls_at_parked = stand_ins.model_calls
        finished_turns = sum(len(r.trajectory) for r in agent.rollouts.values())
        await agent.close()
        return in_flight, calls_at_parked, finished_turns

    in_flight, calls, turns = asyncio.run(scenario())
    assert in_flight == MAX_OPEN_CALLS
    # The rollouts that held a turn slot finished their turn; the others parked without calling the
    # model (before, each of the 64 waiting rollouts took a call slot and got a 503 first).
    assert calls == MAX_OPEN_CALLS and turns == MAX_OPEN_CALLS


def test_a_cancelled_rollout_waiting_for_a_slot_gives_its_slot_back() -> None:
    async def scenario() -> int:
        agent = AgentParticipant("agent0", "http://model.test", "http://resources.test")
        sem = agent._turn_slots
        for _ in range(MAX_OPEN_CALLS):
            await sem.acquire()
        waiter = asyncio.ensure_future(agent._slot_unless_parking(sem))
        await asyncio.sleep(0.01)
        sem.release()  # the slot is granted to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs again
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        return sem._value

    assert asyncio.run(scenario()) == 1  # the slot came back (the other 15 are still held here)


