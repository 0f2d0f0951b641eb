"""The reference agent server: multi-turn rollouts, parked at their boundaries for a snapshot.

A rollout attempt (``POST /rollouts``, Gym's ``/run`` of (rollout id, attempt index)) runs as one
asyncio task, registered as an execution of Gym's agent checkpoint kit
(:class:`gymkit.agent_control.AgentExecutions`). Each turn is: a model call on the policy model
server (prompt = the rollout's cumulative tokens, ``call-<t>`` with parent ``call-<t-1>``), then one
call per tool of the rollout on the resources server of that tool (``notes``: exported;
``sandbox``: restart-only); the tool results' tokens join the conversation and the next turn
starts. The finished result stays retained (``GET /results``, with its completion receipt) until
the controller acknowledges the receipt.

Boundaries: the rollout records one before its first turn (no model call yet) and one after each
turn (Gym's ``turn_complete``; ``agent_state`` holds the trajectory so far, and
``resource_state_revisions`` the revision of each resources server it used). A prepare asks every
running execution to park:

* a rollout between turns parks at once;
* one inside a turn after its first parks as soon as its model call has answered, before its tool
  calls (Gym's ``pending_model`` boundary: the answer is in the record, and the turn's tool calls
  run after the resume, or in attempt n+1 after a restore). This keeps the tool calls out of the
  pause: in a profile of a prepare at 10,000 rollouts they were about half of the agents' HTTP work;
* one inside its first turn finishes that turn first (only then does its record name every
  resources server it depends on);
* one whose last turn just ended parks too rather than completing, so a prepare never waits for a
  result to be acknowledged.

A model call refused while the model is paused (409 ``checkpoint_parked``) or unreachable does not
start the turn: the rollout waits and tries again.

Restore is the kit's: each parked execution's boundary becomes the continuation of attempt n+1,
which the controller runs again (``POST /rollouts`` with ``attempt_index`` n+1) after resume; the
agent rebuilds the rollout from the boundary's ``agent_state`` and continues after its last
committed model call (a ``pending_model`` boundary's answer first gets its turn's tool calls). A
continuation the controller discarded starts over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import httpx
import msgspec
from fastapi import FastAPI, Request, Response

from gymkit.agent_control import AgentExecutions, AgentParticipant, agent_router, whitebox_agent_declaration
from gymkit.control_client import error_code
from gymkit.fence import ControlError, Fence
from refgym import rules
from refgym.api import (
    REVISION_HEADER,
    ApiRefused,
    ModelCall,
    ModelReply,
    StartRollout,
    ToolKind,
    ToolReply,
    decode,
    health_routes,
    install_error_handler,
    reply,
)
from schemas.control import (
    HEADER_ATTEMPT_INDEX,
    HEADER_EXPECTED_REVISION,
    HEADER_RESOURCE_REQUEST_ID,
    HEADER_ROLLOUT_ID,
    Capabilities,
    CompletionReceipt,
)
from schemas.errors import InvalidRecordError
from schemas.gym_files import AgentBoundaryRecord, PendingModel
from schemas.identity import capture_key, check_rollout_id

log = logging.getLogger("refgym.agent")
Outcome = Literal["running", "finished", "failed"]
#: Turns the agent runs at once, and calls it has open at once to the model and (as many again) to the
#: resources servers, one per pooled connection. Rollouts beyond it wait on semaphores: httpcore's pool
#: rescans its whole queue and every connection on each request, so 1,000 rollouts queued there stall
#: the agent's event loop. A rollout waiting for a turn slot has not started its turn, so parking waits
#: for at most this many turns (their model call, then their tool calls), whatever the number of rollouts.
MAX_OPEN_CALLS = 16
#: Data-plane codes that mean "not now, try again" (a checkpoint holds the server).
_RETRY_CODES = ("checkpoint_parked", "resources_admission_closed")
#: Back-off of a retried call: RETRY_BASE_S doubled per retry (at most 5 times), at most RETRY_MAX_S.
RETRY_BASE_S, RETRY_MAX_S = 0.02, 0.5
#: Rollouts one ``POST /rollouts/batch`` may start (its body stays well under the 1 MiB limit).
MAX_BATCH = 2000
PRIME_CHUNK = 250  # rollouts per batched first-turn request (well under the servers' 1 MiB body limit)
PRIME_TIMEOUT_S = 300.0  # one batch request (a busy 2-core machine answers 250 calls slowly)


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    tool: ToolKind
    args: dict[str, int]
    result: dict[str, int]
    revision: int


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One finished turn: the model call's output and the tool results that followed it."""

    model_call_id: str
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    tool_results: list[ToolResult]


class RolloutState(msgspec.Struct, frozen=True, kw_only=True):
    """The agent's own state of one rollout: a boundary's ``agent_state`` in a snapshot."""

    seed: int
    turns: int
    tools: list[ToolKind]
    trajectory: list[Turn]
    turn_keys: list[str]  # capture key of the attempt that ran each turn
    revisions: dict[str, int]  # tool kind -> session revision after this rollout's last call
    resources: dict[str, str] = {}  # tool kind -> the resources server's name, once a tool answered
    sessions_ended: bool = False  # every turn done and its sessions ended: it depends on no resources server


class StartBatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /rollouts/batch``: several ``/run`` calls at once."""

    rollouts: Annotated[list[StartRollout], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    #: Run every new rollout's first turn batched: its session resets, model calls and tool calls go
    #: in a few ``/sessions/batch`` and ``/v1/responses/batch`` requests instead of three requests
    #: each (the same server code records them). A rollout whose batched turn fails runs it alone.
    prime: bool = False


class RolloutFailed(Exception):
    """A server refused a rollout's call for good: the rollout ends as failed."""


class NotStarted(Exception):
    """The turn could not start (model or resources paused or unreachable); try again later."""


@dataclass
class Rollout:
    rollout_id: str
    seed: int
    turns: int
    tools: list[str]
    attempt_index: int = 0
    trajectory: list[Turn] = field(default_factory=list)
    turn_keys: list[str] = field(default_factory=list)
    revisions: dict[str, int] = field(default_factory=dict)
    resources: dict[str, str] = field(default_factory=dict)
    outcome: Outcome = "running"
    error: str | None = None
    restored: dict[str, Any] | None = None  # set when this attempt continues a restored boundary
    receipt: CompletionReceipt | None = None
    task: asyncio.Task | None = None
    sessions_ended: bool = False
    recorded: int = -1  # the boundary index last recorded with the kit
    prime: asyncio.Future | None = None  # set while a batched first turn runs for it (light path)
    #: The model's answer of the turn in progress, when the rollout parked before that turn's tool
    #: calls (a ``pending_model`` boundary); the next turn finishes it instead of calling the model.
    pending: ModelReply | None = None

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt_index)

    @property
    def last_call(self) -> str | None:
        return self.trajectory[-1].model_call_id if self.trajectory else None

    @property
    def restart_only(self) -> list[str]:
        used = {tr.tool for t in self.trajectory for tr in t.tool_results}
        return sorted(used & set(rules.RESTART_ONLY_KINDS))

    def tokens(self) -> list[int]:
        """The cumulative conversation: the task prompt, then each turn's output and tool results."""
        return self.conversation()[0]

    def conversation(self) -> tuple[list[int], list[int]]:
        """The cumulative conversation, and the length of the prompt each turn's model call saw
        (what a trainer needs to turn a finished result into training and token-capture rows)."""
        out = rules.initial_prompt(self.rollout_id, self.seed)
        prompt_lens = []
        for t in self.trajectory:
            prompt_lens.append(len(out))
            out += t.generation_token_ids
            for tr in t.tool_results:
                out += rules.tool_tokens(tr.tool, tr.result)
        return out, prompt_lens

    def state(self) -> RolloutState:
        return RolloutState(seed=self.seed, turns=self.turns, tools=list(self.tools),  # type: ignore[arg-type]
                            trajectory=list(self.trajectory), turn_keys=list(self.turn_keys),
                            revisions=dict(self.revisions), resources=dict(self.resources),
                            sessions_ended=self.sessions_ended)

    @property
    def boundary_index(self) -> int:
        """Two boundaries a turn: ``2 t`` before turn ``t`` (after turn ``t - 1``), ``2 t + 1`` when
        its model call has answered and its tool calls are pending; a finished rollout that ended
        its sessions is at ``2 T + 1`` (a boundary of its own: from there it depends on no resources
        server)."""
        return 2 * len(self.trajectory) + int(self.pending is not None or self.sessions_ended)

    def boundary(self) -> AgentBoundaryRecord:
        """Where the rollout stands: after its last finished turn (or before its first), or, with a
        pending answer, after the model call of the turn in progress (``pending_model``: the answer
        in ``pending_model.response``, no tool call sent; ``agent_state`` and the revisions are those
        before the turn)."""
        pending = None if self.pending is None else PendingModel(
            model_call_id=self.pending.model_call_id, response=msgspec.to_builtins(self.pending))
        return AgentBoundaryRecord(
            rollout_id=self.rollout_id, attempt_index=self.attempt_index, boundary_index=self.boundary_index,
            turn_index=len(self.trajectory), boundary_kind="turn_complete" if pending is None else "pending_model",
            pending_model=pending,
            last_committed_model_call_id=self.last_call if pending is None else pending.model_call_id,
            resource_state_revisions={} if self.sessions_ended else {
                self.resources[k]: rev for k, rev in sorted(self.revisions.items()) if k in self.resources},
            agent_state=msgspec.to_builtins(self.state()))

    def view(self, full: bool = True) -> dict[str, Any]:
        v = {"id": self.capture_key, "rollout_id": self.rollout_id, "attempt_index": self.attempt_index,
             "capture_key": self.capture_key, "outcome": self.outcome, "error": self.error, "turns": self.turns,
             "turns_done": len(self.trajectory), "last_committed_model_call_id": self.last_call,
             "restart_only": self.restart_only, "restored": self.restored}
        if full:
            tokens, prompt_lens = self.conversation()
            v |= {"trajectory": msgspec.to_builtins(self.trajectory), "turn_keys": list(self.turn_keys),
                  "seed": self.seed, "input_ids": tokens, "prompt_lens": prompt_lens}
        return v


def _from_boundary(record: AgentBoundaryRecord, attempt_index: int) -> Rollout:
    """The rollout a restored boundary holds, as attempt ``attempt_index`` (n+1)."""
    where = f"restored boundary of {record.rollout_id!r} attempt {record.attempt_index}"
    try:
        st = msgspec.convert(record.agent_state, RolloutState)
    except msgspec.ValidationError as exc:
        raise InvalidRecordError(f"{where}: agent_state: {exc}") from None
    r = Rollout(rollout_id=record.rollout_id, seed=st.seed, turns=st.turns, tools=list(st.tools),
                attempt_index=attempt_index, trajectory=list(st.trajectory), turn_keys=list(st.turn_keys),
                revisions=dict(st.revisions), resources=dict(st.resources), sessions_ended=st.sessions_ended)
    if record.pending_model is not None:
        try:
            r.pending = msgspec.convert(record.pending_model.response, ModelReply)
        except msgspec.ValidationError as exc:
            raise InvalidRecordError(f"{where}: pending_model.response: {exc}") from None
        expected = f"call-{len(r.trajectory)}"
        if record.pending_model.model_call_id != expected or r.pending.model_call_id != expected:
            raise InvalidRecordError(f"{where}: pending_model answers {record.pending_model.model_call_id!r} "
                                     f"(response: {r.pending.model_call_id!r}), but agent_state has "
                                     f"{len(r.trajectory)} turns: expected {expected!r}")
    last = r.last_call if r.pending is None else r.pending.model_call_id
    if len(r.trajectory) != record.turn or last != record.last_committed_model_call_id:
        raise InvalidRecordError(f"{where}: turn {record.turn} after call {record.last_committed_model_call_id!r}, "
                                 f"but agent_state has {len(r.trajectory)} turns ending at {last!r}")
    r.restored = {"from_attempt": record.attempt_index, "after_call": last}
    return r


class TurnSlots:
    """The agent's turn slots: a freed slot goes to the first queued rollout that ``may_start``.

    A rollout queued here has not started its turn: it stands at its recorded boundary with nothing
    in flight. So a prepare parks it where it waits (:meth:`RefAgent._park_queued`, through the
    kit's ``park_waiting``) instead of waking it to park, and sets it aside (:meth:`set_aside`); the
    resume makes it ``running`` again and puts it back at the head of the queue (:meth:`requeue`),
    again without waking it. With 1,000 rollouts an agent, waking each to park and again at the
    resume was most of the agents' share of the pause.
    """

    def __init__(self, slots: int, may_start: Callable[[Rollout], bool]) -> None:
        self._free = slots
        self._may_start = may_start
        self._queue: dict[asyncio.Future[bool], Rollout] = {}  # insertion order: first come, first served
        self._aside: dict[asyncio.Future[bool], Rollout] = {}  # parked where they queued, in queue order

    @property
    def free(self) -> int:
        return self._free

    def queued(self) -> list[Rollout]:
        """The rollouts waiting for a slot, in queue order (not those set aside)."""
        return [r for fut, r in self._queue.items() if not fut.done()]

    async def take(self, r: Rollout) -> bool:
        """Wait for a slot (True; :meth:`release` it after the turn), or False once :meth:`evict`
        sends the rollout away without one (to park itself)."""
        if self._free and not self._queue and self._may_start(r):
            self._free -= 1
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue[fut] = r
        self.grant()  # a slot may be free that the rollouts ahead may not take
        try:
            return await fut
        except asyncio.CancelledError:
            # Never keep a slot nobody will release: one granted just before the cancellation goes back.
            queued = self._queue.pop(fut, None) is not None or self._aside.pop(fut, None) is not None
            if not queued and not fut.cancelled() and fut.result():
                self.release()
            raise

    def release(self) -> None:
        """Give back a slot :meth:`take` granted."""
        self._free += 1
        self.grant()

    def grant(self) -> None:
        """Hand the free slots to the first queued rollouts that may start, in queue order."""
        if not self._free or not self._queue:
            return
        granted = []
        for fut, r in self._queue.items():
            if len(granted) == self._free:
                break
            if not fut.done() and self._may_start(r):
                granted.append(fut)
        for fut in granted:
            del self._queue[fut]
            fut.set_result(True)
        self._free -= len(granted)

    def set_aside(self, parked: Callable[[Rollout], bool]) -> None:
        """Move the queued rollouts that are ``parked`` out of the queue, keeping their order."""
        for fut, r in list(self._queue.items()):
            if not fut.done() and parked(r):
                self._aside[fut] = self._queue.pop(fut)

    def requeue(self) -> None:
        """Put the rollouts set aside back at the head of the queue (they queued first), then grant."""
        if self._aside:
            self._queue = {**self._aside, **self._queue}
            self._aside = {}
        self.grant()

    def evict(self, leaves: Callable[[Rollout], bool]) -> None:
        """Send every queued rollout that ``leaves`` away without a slot (its :meth:`take` returns False)."""
        for fut, r in list(self._queue.items()):
            if not fut.done() and leaves(r):
                del self._queue[fut]
                fut.set_result(False)


class RefAgent(AgentParticipant):
    """The agent server's rollouts, run as executions of Gym's agent checkpoint kit."""

    def __init__(self, name: str, model_url: str, tool_urls: dict[str, str], executions: AgentExecutions) -> None:
        self.name = name
        self.model_url = model_url.rstrip("/")
        self.tool_urls = {k: u.rstrip("/") for k, u in tool_urls.items()}
        self.executions = executions
        self.http: httpx.AsyncClient | None = None
        self.rollouts: dict[tuple[str, int], Rollout] = {}
        # Cleared when the model refuses a call (paused, restarting): then one rollout, the leader, retries
        # with backoff while the others wait for it to succeed, so 1,000 rollouts do not poll a paused model.
        self._model_ok = asyncio.Event()
        self._model_ok.set()
        self._leader: Rollout | None = None
        # The kit wakes every waiter of ``executions.changed()`` at every change (each boundary
        # recorded, each begin). Rollouts waiting for a turn slot must notice a park request, but with
        # 1,000 of them on one agent, waking each at every other rollout's turn end costs O(N^2) wake-ups
        # (and, re-queued each time, they lost their place on the slot semaphore, starving first turns).
        # One watcher waits on the kit instead and wakes the rollouts only while admission is closed:
        # a park request exists only then (a prepare closes admission before asking).
        self._wake = asyncio.Event()
        self._watcher: asyncio.Task | None = None
        self.wakeups = 0  # rollout wake-ups by the watcher (a test counts them)
        self.calls_held_back = 0  # model calls not sent: the model was refusing them (a test counts them)
        self._primers: set[asyncio.Task] = set()  # batched first turns in progress
        self._turn_slots = TurnSlots(MAX_OPEN_CALLS, self._may_start)  # turns started and not yet finished
        self._open_calls = asyncio.Semaphore(MAX_OPEN_CALLS)  # model calls wait here, not in httpx's pool
        self._tool_calls = asyncio.Semaphore(MAX_OPEN_CALLS)  # resources calls (session reset, tools)

    # -- the protocol ------------------------------------------------------------------------
    def declaration(self) -> Capabilities:
        return whitebox_agent_declaration(self.name)

    async def on_resume(self) -> None:
        self._model_ok.set()  # resume comes after the model's own (resources, models, agents): try again
        self._leader = None
        self._turn_slots.requeue()  # the rollouts parked where they queued run on (reopen made them running)

    async def on_retire(self, rollout_id: str, attempt_index: int) -> None:
        self.rollouts.pop((rollout_id, attempt_index), None)

    def forget_acknowledged(self) -> None:
        """Drop finished rollouts whose result the controller acknowledged (the kit released them)."""
        for key, r in list(self.rollouts.items()):
            if r.outcome != "running" and self.executions.get(*key) is None:
                del self.rollouts[key]

    # -- rollouts ------------------------------------------------------------------------------
    def _watch_parking(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Forward the kit's changes to the waiting rollouts while admission is closed (see ``_wake``):
        those queued for a turn slot are parked where they wait, the others woken."""
        while True:
            await self.executions.changed()
            if not self.executions.accepting:
                self._park_queued()
                self._wake_all()

    def _park_queued(self) -> None:
        """Park the rollouts asked to park while queued for a turn slot, without waking them
        (:class:`TurnSlots`); one whose boundary is not recorded yet leaves the queue to park itself."""
        asked = [r for r in self._turn_slots.queued() if self._parking(r)]
        if not asked:
            return
        at_boundary = [r for r in asked if r.recorded == r.boundary_index]
        self.executions.park_waiting((r.rollout_id, r.attempt_index) for r in at_boundary)
        self._turn_slots.set_aside(self._parked)
        self._turn_slots.evict(self._parking)  # still asked (not parked by the kit): it parks itself

    def _may_start(self, r: Rollout) -> bool:
        ex = self.executions.get(r.rollout_id, r.attempt_index)
        return ex is not None and ex.state == "running"

    def _parked(self, r: Rollout) -> bool:
        ex = self.executions.get(r.rollout_id, r.attempt_index)
        return ex is not None and ex.state == "parked"

    def _wake_all(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()
        self.wakeups += 1

    async def _woken(self) -> None:
        """Return when a change may have asked a waiting rollout to park."""
        self._watch_parking()
        await self._wake.wait()

    def start(self, req: StartRollout) -> Rollout:
        """``/run`` of (rollout id, attempt index): a new execution, or the retained result again."""
        self._watch_parking()
        try:
            check_rollout_id(req.rollout_id)
        except InvalidRecordError as exc:
            raise ApiRefused(400, "invalid_record", str(exc)) from None
        key = (req.rollout_id, req.attempt_index)
        if (known := self.rollouts.get(key)) is not None and known.outcome != "running":
            self.executions.begin(*key, task=None)  # a retained result answers again; refusals raise
            return known
        task = asyncio.get_running_loop().create_task(self._run_attempt(req))
        try:
            ex = self.executions.begin(*key, task=task)
        except ControlError:
            task.cancel()
            raise
        tools = list(dict.fromkeys(req.tools))
        r = _from_boundary(ex.continuation, req.attempt_index) if ex.continuation is not None else Rollout(
            rollout_id=req.rollout_id, seed=req.seed, turns=req.turns, tools=tools, attempt_index=req.attempt_index,
            revisions=dict.fromkeys(tools, 0))
        r.task = task
        self.rollouts[key] = r
        return r

    async def _run_attempt(self, req: StartRollout) -> None:
        await asyncio.sleep(0)  # start() registers the execution and the rollout first
        key = (req.rollout_id, req.attempt_index)
        r = self.rollouts.get(key)
        if r is None or r.task is not asyncio.current_task():
            return
        try:
            await self._run(r)
        except asyncio.CancelledError:
            self.executions.end(*key, "cancelled")
            raise
        except Exception as exc:
            if not isinstance(exc, RolloutFailed):
                log.exception("rollout %s crashed", r.capture_key)
            r.outcome, r.error = "failed", f"{type(exc).__name__}: {exc}" if not isinstance(exc, RolloutFailed) \
                else str(exc)
        else:
            r.outcome = "finished"
        finally:
            if self._leader is r:  # a leader that ends hands the retrying back to everyone
                self._leader = None
                self._model_ok.set()
        if self.executions.get(*key) is None:
            return
        try:
            if r.outcome == "finished" and not r.sessions_ended:
                await self._end_sessions(r)
                r.sessions_ended = True
                # A prepare that came while the sessions ended parks the rollout at a boundary of its
                # own (no resources dependency left) rather than let it complete: Gym commits no
                # result the controller has not acknowledged.
                await self._boundary(r)
        except asyncio.CancelledError:
            self.executions.end(*key, "cancelled")
            raise
        except ControlError as exc:  # retired while parked: the controller runs the next attempt
            log.info("%s ended before completing: %s", r.capture_key, exc)
            return
        r.receipt = self.executions.complete(*key, r.view())

    async def _end_sessions(self, r: Rollout) -> None:
        """A finished rollout ends its sessions (Gym's terminal call), so no later checkpoint exports
        them; retried while a resources server is paused or unreachable."""
        waits = 0
        for kind in r.tools:
            while True:
                try:
                    await self._post(f"{self.tool_urls[kind]}/sessions/end", {}, self._tool_calls,
                                     headers=self._session_headers(r, f"{r.capture_key}/end/{kind}"))
                    break
                except NotStarted:
                    waits += 1
                    await asyncio.sleep(_retry_delay(waits))
                except RolloutFailed as exc:  # the result stands; a session left bound is only exported again
                    log.warning("ending the %s session of %s: %s", kind, r.capture_key, exc)
                    break

    async def _boundary(self, r: Rollout) -> None:
        """Record where the rollout stands (once per boundary); park there if a prepare asked (until
        resume)."""
        if r.recorded != r.boundary_index:
            self.executions.record_boundary(r.rollout_id, r.attempt_index, r.boundary())
            r.recorded = r.boundary_index
        if self.executions.should_park(r.rollout_id, r.attempt_index):
            await self.executions.park(r.rollout_id, r.attempt_index)

    async def _run(self, r: Rollout) -> None:
        """Turn after turn until done, parking at turn ends when asked; while the model refuses calls
        one rollout (the leader) finds out when it accepts them again."""
        waits = 0
        await self._boundary(r)
        if r.prime is not None:
            if await r.prime:  # the batched first turn is done: its turn end is a boundary
                await self._boundary(r)
            r.prime = None
        while len(r.trajectory) < r.turns:
            if self._parking(r):
                await self._boundary(r)
                continue
            if self._waits_for_leader(r):
                await self._wait_model_or_park(r)
                continue
            outcome = await self._turn(r)
            if outcome == "model_waits":  # no call made: wait for the leader (or a park request) above
                continue
            if outcome == "pending":  # asked to park once the model answered: park before the tool calls
                await self._boundary(r)
                continue
            if outcome == "done" and self._leader is r:  # the model answers again: everyone may call it
                self._leader = None
                self._model_ok.set()
            if outcome == "model_refused" and self._model_ok.is_set():
                self._model_ok.clear()
                self._leader = r
            if outcome == "done":
                waits = 0
                await self._boundary(r)
            elif not self._parking(r):
                waits += 1
                await self._backoff(_retry_delay(waits))
            # else: asked to park while its turn could not start (most often, while it queued for a
            # slot): it parks at once above, without a back-off's timer and a second wake-up

    async def _backoff(self, seconds: float) -> None:
        """Wait before trying a turn again, but no longer than until a park request: a rollout
        whose model call was refused (the model paused first) parks at once, not after its backoff."""
        woken = asyncio.ensure_future(self._woken())
        try:
            await asyncio.wait({woken}, timeout=seconds)
        finally:
            woken.cancel()

    def _parking(self, r: Rollout) -> bool:
        return self.executions.should_park(r.rollout_id, r.attempt_index)

    async def _wait_model_or_park(self, r: Rollout) -> None:
        model_ok = asyncio.ensure_future(self._model_ok.wait())
        changed = asyncio.ensure_future(self._woken())
        try:
            await asyncio.wait({model_ok, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            model_ok.cancel()
            changed.cancel()

    async def _turn(self, r: Rollout) -> Literal["done", "not_started", "model_refused", "model_waits", "pending"]:
        """One whole turn (or the rest of a pending one), or nothing changed: the model refused the call,
        it refused another rollout's call while this one waited for a turn slot (``model_waits``: nothing
        was sent), or the turn could not start (no turn slot before a park request, or a resources server
        refused the session reset); or ``pending``: a park request came while the model call ran, and
        the rollout keeps the answer (:attr:`Rollout.pending`) to park before the tool calls."""
        if self._parking(r) or not await self._turn_slots.take(r):
            return "not_started"
        if self._parking(r):  # granted as the park request came: the turn has not started
            self._turn_slots.release()
            return "not_started"
        try:
            if self._waits_for_leader(r):
                # Up to 1,000 rollouts queue for 16 slots. Once the model refused one call (it pauses
                # for a checkpoint), each of them would otherwise send a call only to see it refused:
                # thousands of round trips that hold the CPU the prepare needs.
                self.calls_held_back += 1
                return "model_waits"
            return await self._turn_in_slot(r)
        finally:
            self._turn_slots.release()

    def _waits_for_leader(self, r: Rollout) -> bool:
        """True while the model refuses calls and another rollout (the leader) finds out when it is back;
        never for a rollout with a pending answer (the rest of its turn calls no model)."""
        return not self._model_ok.is_set() and self._leader is not r and r.pending is None

    async def _turn_in_slot(self, r: Rollout) -> Literal["done", "not_started", "model_refused", "pending"]:
        t = len(r.trajectory)
        key = r.capture_key
        if r.pending is not None:  # the model answered before the rollout parked: only the tools are left
            answer, r.pending = r.pending, None
            await self._finish_turn(r, answer)
            return "done"
        if t == 0:
            try:
                for kind in r.tools:
                    reset = await self._post(f"{self.tool_urls[kind]}/sessions/reset", {}, self._tool_calls,
                                             headers=self._session_headers(r, f"{key}/reset/{kind}"))
                    r.revisions[kind] = _revision(reset)  # the revision the reset made
            except NotStarted:
                return "not_started"
        call = ModelCall(rollout_id=r.rollout_id, attempt_index=r.attempt_index, capture_key=key,
                         model_call_id=f"call-{t}", parent_call_id=f"call-{t - 1}" if t else None, turn_index=t,
                         prompt_token_ids=r.tokens())
        try:
            resp = await self._post(f"{self.model_url}/v1/responses", call, self._open_calls)
        except NotStarted:
            return "model_refused"
        answer = msgspec.json.decode(resp.content, type=ModelReply)
        # The model call is recorded: from here the turn is finished, whatever it takes. A park request
        # that came meanwhile parks it first, at this answer (no tool call sent yet), after the first
        # turn: only from then does the record name every resources server the tool calls depend on
        # (a server is named by its first tool answer), which restarts and restores need to know.
        if t and self._parking(r):
            r.pending = answer
            return "pending"
        await self._finish_turn(r, answer)
        return "done"

    async def _finish_turn(self, r: Rollout, answer: ModelReply) -> None:
        """Turn ``len(r.trajectory)`` after its model call answered ``answer``: one call per tool, then the
        turn joins the trajectory, under the capture key of the attempt that made the model call."""
        t = len(r.trajectory)
        results = []
        for kind in r.tools:
            args = rules.tool_args(kind, answer.generation_token_ids)
            tool = await self._tool(r, kind, args, t)
            results.append(ToolResult(tool=kind, args=args,  # type: ignore[arg-type]
                                      result=tool.result, revision=tool.revision))
        r.trajectory.append(Turn(model_call_id=answer.model_call_id, generation_token_ids=answer.generation_token_ids,
                                 generation_log_probs=answer.generation_log_probs, tool_results=results))
        r.turn_keys.append(answer.capture_key)

    def _session_headers(self, r: Rollout, request_id: str, expected: int | None = None) -> dict[str, str]:
        h = {HEADER_ROLLOUT_ID: r.rollout_id, HEADER_ATTEMPT_INDEX: str(r.attempt_index),
             HEADER_RESOURCE_REQUEST_ID: request_id}
        if expected is not None:
            h[HEADER_EXPECTED_REVISION] = str(expected)
        return h

    async def _tool(self, r: Rollout, kind: str, args: dict[str, int], turn: int) -> ToolReply:
        """A tool call inside a turn: retried (same request id: a retry replays) while the resources
        server is paused or unreachable."""
        waits = 0
        request_id = f"{r.capture_key}/t{turn}/{kind}"
        while True:
            headers = self._session_headers(r, request_id, r.revisions.get(kind, 0))
            try:
                resp = await self._post(f"{self.tool_urls[kind]}/tools/{kind}", {"args": args}, self._tool_calls,
                                        headers=headers)
            except NotStarted:
                waits += 1
                await asyncio.sleep(_retry_delay(waits))
                continue
            tool = msgspec.json.decode(resp.content, type=ToolReply)
            if _revision(resp) != tool.revision:
                raise RolloutFailed(f"{kind}: revision header {resp.headers.get(REVISION_HEADER)!r} "
                                    f"!= body {tool.revision}")
            r.revisions[kind] = tool.revision
            r.resources[kind] = tool.resource
            return tool

    async def _post(self, url: str, body: Any, slots: asyncio.Semaphore,
                    headers: dict[str, str] | None = None) -> httpx.Response:
        """POST, holding one of ``slots``; NotStarted on a 'not now' refusal, 5xx or a transport
        error, RolloutFailed on any other refusal."""
        assert self.http is not None
        await slots.acquire()
        try:
            resp = await self.http.post(url, content=msgspec.json.encode(body),
                                        headers={"content-type": "application/json", **(headers or {})})
        except httpx.TransportError as exc:
            log.info("%s unreachable (%s); will retry", url, type(exc).__name__)
            raise NotStarted() from None
        finally:
            slots.release()
        if resp.status_code >= 500 or (resp.status_code == 409 and error_code(resp) in _RETRY_CODES):
            raise NotStarted()
        if resp.status_code >= 400:
            raise RolloutFailed(f"{url} refused ({resp.status_code}): {resp.text}")
        return resp

    def start_primed(self, reqs: list[StartRollout]) -> list[Rollout]:
        """Start rollouts whose first turn runs batched (``StartBatch.prime``); the others as usual."""
        loop = asyncio.get_running_loop()
        started: list[Rollout] = []
        fresh: list[Rollout] = []
        for req in reqs:
            r = self.start(req)
            started.append(r)
            if r.outcome == "running" and not r.trajectory and r.restored is None:
                r.prime = loop.create_future()
                fresh.append(r)
        if fresh:
            self._primers.add(task := loop.create_task(self._prime(fresh)))
            task.add_done_callback(self._primers.discard)
        return started

    async def _prime(self, rollouts: list[Rollout]) -> None:
        """The first turn of each of ``rollouts``, batched by PRIME_CHUNK: session resets, then model
        calls, then tool calls, each a batch request answered by the same server code as the single
        routes (same request ids, so a later retry of one replays). Each rollout's future gets True
        once its turn is in its trajectory, False if it must run its first turn the ordinary way."""
        try:
            for i in range(0, len(rollouts), PRIME_CHUNK):
                await self._prime_chunk(rollouts[i:i + PRIME_CHUNK])
        except Exception as exc:  # noqa: BLE001 - any failure: the rollouts run their first turn alone
            log.info("batched first turns failed (%s: %s); the rollouts run them one by one", type(exc).__name__, exc)
        finally:
            for r in rollouts:
                if r.prime is not None and not r.prime.done():
                    r.prime.set_result(False)

    async def _prime_chunk(self, chunk: list[Rollout]) -> None:
        assert self.http is not None
        live = [r for r in chunk if self.executions.get(r.rollout_id, r.attempt_index) is not None]
        for kind in dict.fromkeys(k for r in live for k in r.tools):
            users = [r for r in live if kind in r.tools]
            answers = await self._batch(f"{self.tool_urls[kind]}/sessions/batch", {"calls": [
                {"rollout_id": r.rollout_id, "attempt_index": r.attempt_index, "kind": "start",
                 "request_id": f"{r.capture_key}/reset/{kind}"} for r in users]})
            for r, a in zip(users, answers):
                if a["status"] == 200 and str(a["headers"].get(REVISION_HEADER, "")).isdigit():
                    r.revisions[kind] = int(a["headers"][REVISION_HEADER])
                else:
                    live = [x for x in live if x is not r]
        calls = [ModelCall(rollout_id=r.rollout_id, attempt_index=r.attempt_index, capture_key=r.capture_key,
                           model_call_id="call-0", parent_call_id=None, turn_index=0, prompt_token_ids=r.tokens())
                 for r in live]
        if not calls:
            return
        answers = await self._batch(f"{self.model_url}/v1/responses/batch", {"calls": calls})
        done = [(r, msgspec.convert(a["body"], ModelReply)) for r, a in zip(live, answers) if a["status"] == 200]
        # The model calls are recorded: from here each turn is finished, whatever it takes.
        results: dict[tuple[str, int], dict[str, ToolResult]] = {(r.rollout_id, r.attempt_index): {} for r, _ in done}
        for kind in dict.fromkeys(k for r, _ in done for k in r.tools):
            users = [(r, m) for r, m in done if kind in r.tools]
            args = [rules.tool_args(kind, m.generation_token_ids) for _, m in users]
            answers = await self._batch(f"{self.tool_urls[kind]}/sessions/batch", {"calls": [
                {"rollout_id": r.rollout_id, "attempt_index": r.attempt_index, "kind": "mutation",
                 "request_id": f"{r.capture_key}/t0/{kind}", "expected_revision": r.revisions.get(kind, 0),
                 "body": msgspec.json.encode({"args": a})} for (r, _), a in zip(users, args)]})
            for (r, _), a, answer in zip(users, args, answers):
                if answer["status"] == 200:
                    tool = msgspec.convert(answer["body"], ToolReply)
                    r.revisions[kind] = tool.revision
                    r.resources[kind] = tool.resource
                else:  # finished the ordinary way (the same request id replays if it did run)
                    tool = await self._tool(r, kind, a, 0)
                results[(r.rollout_id, r.attempt_index)][kind] = ToolResult(
                    tool=kind, args=a, result=tool.result, revision=tool.revision)  # type: ignore[arg-type]
        for r, m in done:
            tools = [results[(r.rollout_id, r.attempt_index)][k] for k in r.tools]
            r.trajectory.append(Turn(model_call_id="call-0", generation_token_ids=m.generation_token_ids,
                                     generation_log_probs=m.generation_log_probs, tool_results=tools))
            r.turn_keys.append(r.capture_key)
            if r.prime is not None and not r.prime.done():
                r.prime.set_result(True)

    async def _batch(self, url: str, body: Any) -> list[dict[str, Any]]:
        assert self.http is not None
        resp = await self.http.post(url, content=msgspec.json.encode(body), timeout=PRIME_TIMEOUT_S,
                                    headers={"content-type": "application/json"})
        if resp.status_code != 200:
            raise RolloutFailed(f"{url} refused the batch ({resp.status_code}): {resp.text[:300]}")
        return msgspec.json.decode(resp.content)

    async def close(self) -> None:
        for task in list(self._primers):
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        tasks = [r.task for r in self.rollouts.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()


def _retry_delay(waits: int) -> float:
    """The wait before the ``waits``-th retry of a refused or failed call: doubling, capped."""
    return min(RETRY_BASE_S * 2 ** min(waits, 5), RETRY_MAX_S)


def _revision(resp: httpx.Response) -> int:
    """The session revision a resources server answered (``x-nemo-gym-resource-state-revision``)."""
    raw = resp.headers.get(REVISION_HEADER, "")
    if not raw.isdigit():
        raise RolloutFailed(f"{resp.request.url}: no valid {REVISION_HEADER} header ({raw[:40]!r})")
    return int(raw)


def create_app(name: str, token: str, model_url: str, tool_urls: dict[str, str]) -> FastAPI:
    """The agent server's FastAPI app: rollouts, results and Gym's agent-checkpoint routes.
    ``tool_urls`` maps each tool kind to the resources server that serves it."""
    executions = AgentExecutions()
    participant = RefAgent(name, model_url, tool_urls, executions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        participant.http = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=2.0),
            limits=httpx.Limits(max_connections=2 * MAX_OPEN_CALLS, max_keepalive_connections=2 * MAX_OPEN_CALLS))
        yield
        await participant.close()

    app = FastAPI(title=f"refgym agent server {name}", lifespan=lifespan)
    app.state.participant = participant
    app.include_router(agent_router(participant, executions, Fence(), token))
    install_error_handler(app)
    health_routes(app, "responses_api_agents", name)

    @app.post("/rollouts", status_code=202)
    async def start(request: Request) -> Response:
        r = participant.start(await decode(request, StartRollout))
        return reply({"rollout_id": r.rollout_id, "attempt_index": r.attempt_index, "capture_key": r.capture_key}, 202)

    @app.post("/rollouts/batch", status_code=202)
    async def start_batch(request: Request) -> Response:
        """Many ``/run`` calls in one request (a scale benchmark's light path: 100,000 rollouts are
        started by a few hundred requests instead of 100,000). Each is started exactly as ``POST
        /rollouts`` starts it; the first refusal stops the batch (those before it run)."""
        batch = await decode(request, StartBatch)
        started = participant.start_primed(batch.rollouts) if batch.prime else [
            participant.start(req) for req in batch.rollouts]
        return reply({"started": len(started)}, 202)

    @app.get("/rollouts/progress")
    async def progress() -> Response:
        """Counts only (a poll of 100,000 rollouts must not list them): rollouts held, still running,
        and running ones past their first turn."""
        rows = participant.rollouts.values()
        running = [r for r in rows if r.outcome == "running"]
        return reply({"rollouts": len(participant.rollouts), "running": len(running),
                      "running_past_first_turn": sum(1 for r in running if r.trajectory)})

    @app.get("/rollouts")
    async def rollouts() -> Response:
        return reply([r.view(full=False) for _, r in sorted(participant.rollouts.items())])

    @app.get("/rollouts/{rollout_id}")
    async def rollout(rollout_id: str) -> Response:
        found = [r for (rid, _), r in sorted(participant.rollouts.items()) if rid == rollout_id]
        if not found:
            raise ApiRefused(404, "unknown_rollout", f"no rollout {rollout_id!r} here")
        return reply(found[-1].view())

    @app.get("/results")
    async def results() -> Response:
        """Finished (or failed) results not yet acknowledged, each with its completion receipt."""
        participant.forget_acknowledged()
        done = [r for _, r in sorted(participant.rollouts.items()) if r.outcome != "running" and r.receipt is not None]
        return reply([r.view() | {"completion_receipt": msgspec.to_builtins(r.receipt)} for r in done])

    return app
