"""The reference agent with many rollouts (issue 22 §2 levers): waiting rollouts are not woken at
every other rollout's turn end, and a rollout backing off from a paused model parks at once.

The model and resources servers are stand-ins (httpx's mock transport), as in ``test_parking.py``,
so the tests count what the agent does; nothing here measures speed.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import pytest

from gymkit.agent_control import AgentExecutions
from refgym import agent_server
from refgym.agent_server import MAX_OPEN_CALLS, RefAgent
from refgym.api import REVISION_HEADER, ModelReply, StartRollout, ToolReply
from schemas.control import HEADER_EXPECTED_REVISION, HEADER_ROLLOUT_ID


class StandIns:
    """An instant model (or a paused one: 409 ``checkpoint_parked``) and an instant ``notes`` tool."""

    def __init__(self) -> None:
        self.paused = False
        self.model_calls = 0
        self.refused = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        await asyncio.sleep(0)  # a real round trip yields to the loop
        if path == "/v1/responses":
            self.model_calls += 1
            if self.paused:
                self.refused += 1
                return httpx.Response(409, json={"error": {"code": "checkpoint_parked", "detail": "paused"}},
                                      headers={"retry-after": "1"})
            call = json.loads(request.content)
            reply = ModelReply(response_id="r", model="m", capture_key=call["capture_key"],
                               model_call_id=call["model_call_id"], generation_token_ids=[1, 2],
                               generation_log_probs=[-0.1, -0.2], cum_len=len(call["prompt_token_ids"]) + 2,
                               digest="0" * 64, parent_resolution="root")
            return httpx.Response(200, content=msgspec.json.encode(reply))
        if path.startswith("/tools/"):
            revision = int(request.headers[HEADER_EXPECTED_REVISION]) + 1
            tool = ToolReply(resource="tools", tool="notes", session_id=request.headers[HEADER_ROLLOUT_ID],
                             revision=revision, result={"count": 1})
            return httpx.Response(200, content=msgspec.json.encode(tool), headers={REVISION_HEADER: str(revision)})
        return httpx.Response(200, json={}, headers={REVISION_HEADER: "1"})  # session reset / end


def _agent(stand_ins: StandIns) -> tuple[RefAgent, AgentExecutions]:
    executions = AgentExecutions()
    agent = RefAgent("agent0", "http://model.test", {"notes": "http://resources.test"}, executions)
    agent.http = httpx.AsyncClient(transport=httpx.MockTransport(stand_ins))
    return agent, executions


def test_rollouts_waiting_for_a_turn_slot_are_not_woken_by_every_turn_end() -> None:
    """With R rollouts queued for 16 turn slots, each turn end is a change of the agent kit. A waiting
    rollout that listened to every change would be woken O(R) times per turn, O(R^2) in all; the
    agent's one watcher forwards changes only while admission is closed (a park request exists only
    then), so the kit is listened to O(R) times."""
    rollouts, turns = 12 * MAX_OPEN_CALLS, 2

    async def scenario() -> tuple[int, int, bool]:
        stand_ins = StandIns()
        agent, executions = _agent(stand_ins)
        listened = 0
        changed = executions.changed

        async def counting() -> None:
            nonlocal listened
            listened += 1
            await changed()

        executions.changed = counting  # type: ignore[method-assign]
        for i in range(rollouts):
            agent.start(StartRollout(rollout_id=f"r{i}", seed=i, turns=turns))
        end = time.monotonic() + 60
        while any(r.outcome == "running" or r.receipt is None for r in agent.rollouts.values()):
            assert time.monotonic() < end, "the rollouts did not finish"
            await asyncio.sleep(0.01)
        done = all(len(r.trajectory) == turns for r in agent.rollouts.values())
        await agent.close()
        return listened, agent.wakeups, done

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
    monkeypatch.setattr(agent_server, "RETRY_BASE_S", 10.0)  # the first back-off is 20 s
    monkeypatch.setattr(agent_server, "RETRY_MAX_S", 60.0)

    async def scenario() -> tuple[float, int, bool]:
        stand_ins = StandIns()
        stand_ins.paused = True  # every model call is refused: the leader backs off, the others wait for it
        agent, executions = _agent(stand_ins)
        for i in range(4):
            agent.start(StartRollout(rollout_id=f"r{i}", seed=i, turns=3))
        end = time.monotonic() + 10
        while stand_ins.refused < 1:
            assert time.monotonic() < end
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the leader is in its 20 s back-off now
        t0 = time.monotonic()
        executions.request_park()
        status = await asyncio.wait_for(executions.wait_prepared(time.time() + 15), 15)
        waited = time.monotonic() - t0
        await agent.close()
        return waited, stand_ins.refused, status.ready_to_commit and status.parked == 4

    waited, refused, all_parked = asyncio.run(scenario())
    assert all_parked and refused == 4  # each rollout was refused once, then backed off (none asked again)
    assert waited < 10.0, waited  # well inside the 20 s back-off (without the lever: 20 s, past the 15 s bound)
