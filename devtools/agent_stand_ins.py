"""A reference agent alone, its policy model and ``notes`` resources server replaced by stand-ins
(httpx's mock transport), so a test or a benchmark can count what the agent does: model calls sent
and refused, the kit's change events listened to. The agent's own code runs unchanged.

    stand_ins = StandIns()
    agent, executions = stand_in_agent(stand_ins)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from devtools.gym_fleet import WAIT_S
from gymkit.agent_control import AgentExecutions
from refgym.agent_server import MAX_OPEN_CALLS, RefAgent
from refgym.api import REVISION_HEADER, ModelReply, StartRollout, ToolReply
from schemas.control import HEADER_EXPECTED_REVISION, HEADER_ROLLOUT_ID, AgentStatus


class StandIns:
    """The model and the ``notes`` tool, each answering after ``delay_s`` (0: one loop turn, as a real
    round trip yields). ``paused``: the model refuses new calls as Gym's paused admission does (409
    ``checkpoint_parked``, retry after a second). With ``hold``, accepted model calls of turn
    ``hold_from_turn`` and later wait until ``release`` is set (``held``: how many wait now). Counts
    every model call (``model_calls``), every refusal (``refused``) and every tool call (``tool_calls``)."""

    def __init__(self, delay_s: float = 0.0, hold: bool = False, hold_from_turn: int = 0) -> None:
        self.delay_s = delay_s
        self.hold_from_turn = hold_from_turn
        self.held = 0
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.paused = False
        self.model_calls = 0
        self.refused = 0
        self.tool_calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        await asyncio.sleep(self.delay_s)
        if path == "/v1/responses":
            self.model_calls += 1
            if self.paused:
                self.refused += 1
                return httpx.Response(409, json={"error": {"code": "checkpoint_parked", "detail": "paused"}},
                                      headers={"retry-after": "1"})
            call = json.loads(request.content)
            if call["turn_index"] >= self.hold_from_turn and not self.release.is_set():
                self.held += 1
                await self.release.wait()
                self.held -= 1
            reply = ModelReply(response_id="r", model="m", capture_key=call["capture_key"],
                               model_call_id=call["model_call_id"], generation_token_ids=[1, 2],
                               generation_log_probs=[-0.1, -0.2], cum_len=len(call["prompt_token_ids"]) + 2,
                               digest="0" * 64, parent_resolution="root")
            return httpx.Response(200, content=msgspec.json.encode(reply))
        if path.startswith("/tools/"):
            self.tool_calls += 1
            revision = int(request.headers[HEADER_EXPECTED_REVISION]) + 1
            tool = ToolReply(resource="tools", tool="notes", session_id=request.headers[HEADER_ROLLOUT_ID],
                             revision=revision, result={"count": 1})
            return httpx.Response(200, content=msgspec.json.encode(tool), headers={REVISION_HEADER: str(revision)})
        return httpx.Response(200, json={}, headers={REVISION_HEADER: "1"})  # session reset / end


async def wait_until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S, every: float = 0.01) -> Any:
    """:func:`devtools.gym_fleet.wait_until` for code on the event loop (the stand-ins answer on the
    same loop, so a blocking poll would stall them): poll ``predicate`` until it returns something
    truthy and return it; fail naming ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)
    return value


async def wait_finished(agent: RefAgent, timeout: float = WAIT_S) -> None:
    """Wait until every rollout of ``agent`` has ended (finished or failed); bounded."""
    await wait_until(lambda: all(r.outcome != "running" for r in agent.rollouts.values()), "every rollout finished",
                     timeout)


def start_rollouts(agent: RefAgent, rollouts: int, turns: int) -> None:
    """Start rollouts ``r0`` .. ``r<rollouts - 1>`` of ``turns`` turns each (seed = index)."""
    for i in range(rollouts):
        agent.start(StartRollout(rollout_id=f"r{i}", seed=i, turns=turns))


def stand_in_agent(stand_ins: StandIns) -> tuple[RefAgent, AgentExecutions]:
    """A reference agent ``agent0`` (tool ``notes``) whose calls go to ``stand_ins``, and its kit."""
    executions = AgentExecutions()
    agent = RefAgent("agent0", "http://model.test", {"notes": "http://tools.test"}, executions)
    agent.http = httpx.AsyncClient(transport=httpx.MockTransport(stand_ins))
    return agent, executions


class ListenCounter:
    """Counts how often the agent kit's change event is listened to: wraps ``executions.changed``
    (every listener awaits it) and leaves its behaviour as it was."""

    def __init__(self, executions: AgentExecutions) -> None:
        self.count = 0
        changed = executions.changed

        async def counting() -> None:
            self.count += 1
            await changed()

        executions.changed = counting  # type: ignore[method-assign]


async def park_with_turns_in_flight(agent: RefAgent, executions: AgentExecutions, stand_ins: StandIns,
                                    rollouts: int, turns: int = 3, *, pause_model: bool = False) -> AgentStatus:
    """Start ``rollouts`` on ``agent`` (``stand_ins`` built with ``hold``), wait until every turn slot
    holds a model call (the other rollouts queue for a slot; with ``hold_from_turn`` 1, every rollout
    has finished its first turn by then: the slots are granted in turn), ask every execution to park as a
    prepare does (``pause_model``: then the model refuses new calls, as when it pauses first), then
    answer the held calls (the rollouts that sent them park at those answers, before their tool
    calls); returns the status once nothing runs (bounded: 30 s)."""
    start_rollouts(agent, rollouts, turns)
    await wait_until(lambda: stand_ins.held >= MAX_OPEN_CALLS, f"{MAX_OPEN_CALLS} model calls held")
    executions.request_park()
    await asyncio.sleep(0.05)
    stand_ins.paused = pause_model
    stand_ins.release.set()  # the calls in flight finish their turns, then those rollouts park
    return await asyncio.wait_for(executions.wait_prepared(time.time() + 30), 30)
