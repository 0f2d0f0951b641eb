"""The reference agent server: multi-turn rollouts, parked at turn ends for a snapshot.

A rollout (``POST /rollouts``) runs as one asyncio task. Each turn is: a model call on the policy
model server (prompt = the rollout's cumulative tokens, ``call-<t>`` with parent ``call-<t-1>``),
then one call per tool of the rollout on the resource server; the tool results' tokens join the
conversation and the next turn starts. A finished result stays listed (``GET /results``) until the
controller acknowledges it.

Prepare closes the turn gate: a rollout between turns stops there, one inside a turn finishes that
turn first (never half a turn), and prepare returns when none is inside a turn. A model call
refused while the model is paused (503) or unreachable does not start the turn: the rollout waits
and tries again, so a paused or restarted model server loses no rollout.

Commit writes ``continuations.jsonl`` (one :class:`AgentContinuationRoot` per unfinished rollout)
and ``agent_state.jsonl`` (every unfinished or finished-but-unacknowledged rollout, with its
trajectory so far). Restore sets each unfinished rollout up as attempt n+1 (capture key
``<rollout_id>-a<n+1>``) continuing after its last committed model call; ``discard`` makes a
restored rollout start over (it used a restart-only resource); resume lets them all run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import msgspec
from fastapi import FastAPI, Request, Response

from gymkit import CommitContext, ControlPlane, ControlRefused, Participant
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
    paused,
    reply,
)
from refgym.parts import invalid_records_refused, part_records
from schemas.control import Capabilities, RolloutRef
from schemas.errors import InvalidRecordError
from schemas.gym_records import AgentContinuationRoot, AgentStateRecord
from schemas.identity import capture_key, check_rollout_id
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot

log = logging.getLogger("refgym.agent")
Outcome = Literal["running", "finished", "failed"]
#: Turns the agent runs at once, and calls it has open at once to the model and (as many again) to the
#: resource server, one per pooled connection. Rollouts beyond it wait on semaphores: httpcore's pool
#: rescans its whole queue and every connection on each request, so 1,000 rollouts queued there stall
#: the agent's event loop. A rollout waiting for a turn slot has not started its turn, so parking waits
#: for at most this many turns (their model call, then their tool calls), whatever the number of rollouts.
MAX_OPEN_CALLS = 16


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
    """The agent's own state of one rollout: ``AgentStateRecord.state`` in a snapshot."""

    seed: int
    turns: int
    tools: list[ToolKind]
    trajectory: list[Turn]
    turn_keys: list[str]  # capture key of the attempt that ran each turn
    revisions: dict[str, int]  # tool kind -> session revision after this rollout's last call
    resource: str | None = None  # the resource server's name, once a tool answered
    outcome: Outcome = "running"
    error: str | None = None


class RolloutFailed(Exception):
    """A server refused a rollout's call for good (4xx): the rollout ends as failed."""


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
    resource: str | None = None
    outcome: Outcome = "running"
    error: str | None = None
    restored: dict[str, Any] | None = None  # set by restore: where this attempt picks up
    task: asyncio.Task | None = None

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
                            revisions=dict(self.revisions), resource=self.resource, outcome=self.outcome,
                            error=self.error)

    def view(self, full: bool = True) -> dict[str, Any]:
        v = {"rollout_id": self.rollout_id, "attempt_index": self.attempt_index, "capture_key": self.capture_key,
             "outcome": self.outcome, "error": self.error, "turns": self.turns, "turns_done": len(self.trajectory),
             "last_committed_model_call_id": self.last_call, "restart_only": self.restart_only,
             "restored": self.restored}
        if full:
            tokens, prompt_lens = self.conversation()
            v |= {"trajectory": msgspec.to_builtins(self.trajectory), "turn_keys": list(self.turn_keys),
                  "seed": self.seed, "input_ids": tokens, "prompt_lens": prompt_lens}
        return v


class AgentParticipant(Participant):
    """The agent server's rollouts and its side of the checkpoint protocol."""

    def __init__(self, name: str, model_url: str, resource_url: str) -> None:
        self.name = name
        self.model_url = model_url.rstrip("/")
        self.resource_url = resource_url.rstrip("/")
        self.http: httpx.AsyncClient | None = None
        self.rollouts: dict[str, Rollout] = {}
        self._gate = asyncio.Event()  # open: rollouts may start turns
        self._gate.set()
        self._parking = asyncio.Event()  # set while the gate is closed: a turn not yet started gives up
        # Cleared when the model refuses a call (paused, restarting): then one rollout, the leader, retries
        # with backoff while the others wait for it to succeed, so 1,000 rollouts do not poll a paused model.
        self._model_ok = asyncio.Event()
        self._model_ok.set()
        self._leader: Rollout | None = None
        self._busy = 0  # rollouts inside a turn
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._turn_slots = asyncio.Semaphore(MAX_OPEN_CALLS)  # turns started and not yet finished
        self._open_calls = asyncio.Semaphore(MAX_OPEN_CALLS)  # model calls wait here, not in httpx's pool
        self._tool_calls = asyncio.Semaphore(MAX_OPEN_CALLS)  # resource calls (session reset, tools)

    # -- the protocol ------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(component="agent", name=self.name, checkpoint_mode="export_restore")

    def in_flight(self) -> int:
        return self._busy

    async def prepare(self, deadline: float) -> None:
        """Park: close the gate, then wait until no rollout is inside a turn. A rollout still waiting
        for a call slot has not started its turn (its model call is not sent): it stops at once, so
        parking takes the time of the calls in flight, not of every rollout's turn in the queue."""
        self._close_gate()
        while self._busy:
            await self._quiet.wait()

    async def resume(self) -> None:
        self._open_gate()

    def _close_gate(self) -> None:
        self._gate.clear()
        self._parking.set()

    def _open_gate(self) -> None:
        self._parking.clear()
        self._model_ok.set()  # resume comes after the model's own (resources, models, agents): try again
        self._leader = None
        self._gate.set()

    async def reset(self) -> None:
        """An aborted restore: cancel the restored rollouts (still waiting at the gate) and forget
        them (restore only runs on a server without rollouts)."""
        for r in self.rollouts.values():
            if r.task is not None:
                r.task.cancel()
        self.rollouts = {}
        self._open_gate()

    async def commit(self, part: PartWriter | None, context: CommitContext) -> dict[str, Any]:
        assert part is not None and self._busy == 0, "commit runs only while every rollout is parked"
        rollouts = sorted(self.rollouts.values(), key=lambda r: r.rollout_id)
        parked = [r for r in rollouts if r.outcome == "running"]
        part.write_records("continuations", "continuations", [
            AgentContinuationRoot(rollout_id=r.rollout_id, attempt_index=r.attempt_index, capture_key=r.capture_key,
                                  last_committed_model_call_id=r.last_call,
                                  resource_state_revisions=({r.resource: r.revisions["notes"]}
                                                            if r.resource and "notes" in r.revisions else None))
            for r in parked if r.last_call is not None])  # Gym writes a line only after a first call
        part.write_records("agent_state", "agent_state", [
            AgentStateRecord(rollout_id=r.rollout_id, attempt_index=r.attempt_index, capture_key=r.capture_key,
                             status="parked" if r.outcome == "running" else "finished_unacked",
                             turn_index=len(r.trajectory), state=msgspec.to_builtins(r.state()),
                             restart_only=r.restart_only)
            for r in rollouts])
        return {"parked": len(parked), "finished_unacked": len(rollouts) - len(parked),
                "restart_only": [r.rollout_id for r in parked if r.restart_only]}

    async def restore(self, snapshot: Snapshot, prefix: str) -> dict[str, Any]:
        if self.rollouts:
            raise ControlRefused(409, "wrong_phase",
                                 f"restore needs an agent server without rollouts; this one has {len(self.rollouts)}")
        with invalid_records_refused():
            loaded = _load_rollouts(snapshot, prefix)
        self._close_gate()  # restored rollouts wait for resume
        self.rollouts = loaded  # swapped in whole: a failed load changes nothing
        for r in loaded.values():
            if r.outcome == "running":
                r.task = asyncio.get_running_loop().create_task(self._run(r))
        return {
            "continuations": [{"rollout_id": r.rollout_id, "attempt_index": r.attempt_index,
                               "capture_key": r.capture_key, "after_call": r.last_call,
                               "restart_only": r.restart_only}
                              for r in loaded.values() if r.outcome == "running"],
            "finished_unacked": [{"rollout_id": r.rollout_id, "attempt_index": r.attempt_index}
                                 for r in loaded.values() if r.outcome != "running"],
        }

    def unknown_rollouts(self, results: list[RolloutRef]) -> list[RolloutRef]:
        """Refs naming no rollout attempt this server holds (acknowledge and discard check more)."""
        return [ref for ref in results
                if (r := self.rollouts.get(ref.rollout_id)) is None or r.attempt_index != ref.attempt_index]

    async def acknowledge(self, results: list[RolloutRef]) -> dict[str, Any]:
        """Forget finished results; all or nothing, and each result only once."""
        unfinished = [ref for ref in results if self.rollouts[ref.rollout_id].outcome == "running"]
        if unfinished:
            names = ", ".join(f"{r.rollout_id}#{r.attempt_index}" for r in unfinished[:5])
            raise ControlRefused(404, "unknown_rollout",
                                 f"no finished result for {names} (still running); nothing acknowledged")
        ids = sorted({ref.rollout_id for ref in results})
        for rid in ids:
            del self.rollouts[rid]
        return {"acknowledged": ids}

    async def discard(self, rollouts: list[RolloutRef]) -> dict[str, Any]:
        """Restored continuations that used a restart-only resource start over (same attempt, turn 0)."""
        bad = [ref for ref in rollouts if self.rollouts[ref.rollout_id].restored is None
               or self.rollouts[ref.rollout_id].outcome != "running"]
        if bad:
            names = ", ".join(f"{r.rollout_id}#{r.attempt_index}" for r in bad[:5])
            raise ControlRefused(404, "unknown_rollout", f"no restored continuation for {names}; nothing discarded")
        for ref in rollouts:
            r = self.rollouts[ref.rollout_id]
            r.trajectory, r.turn_keys, r.revisions = [], [], {}
            assert r.restored is not None
            r.restored = {**r.restored, "discarded": True}
        return {"discarded": sorted({ref.rollout_id for ref in rollouts})}

    # -- rollouts ------------------------------------------------------------------------------
    def start(self, req: StartRollout) -> Rollout:
        try:
            check_rollout_id(req.rollout_id)
        except InvalidRecordError as exc:
            raise ApiRefused(400, "invalid_record", str(exc)) from None
        if not self.admits_work():
            raise paused("new rollout")
        if req.rollout_id in self.rollouts:
            raise ApiRefused(409, "conflict",
                             f"rollout {req.rollout_id!r} is already here (running or not yet acknowledged)")
        r = Rollout(rollout_id=req.rollout_id, seed=req.seed, turns=req.turns, tools=list(dict.fromkeys(req.tools)))
        self.rollouts[r.rollout_id] = r
        r.task = asyncio.get_running_loop().create_task(self._run(r))
        return r

    async def _run(self, r: Rollout) -> None:
        """Turn after turn until done; waits at the gate between turns, and while the model refuses
        calls lets one rollout (the leader) find out when it accepts them again."""
        waits = 0
        try:
            while len(r.trajectory) < r.turns:
                await self._gate.wait()
                if not self._gate.is_set():  # closed again before this task ran
                    continue
                if not self._model_ok.is_set() and self._leader is not r:
                    await _first(self._model_ok, self._parking)
                    continue
                self._busy += 1  # no await between the gate check and this line
                self._quiet.clear()
                try:
                    outcome = await self._turn(r)
                finally:
                    self._busy -= 1
                    if not self._busy:
                        self._quiet.set()
                if outcome == "done" and self._leader is r:  # the model answers again: everyone may call it
                    self._leader = None
                    self._model_ok.set()
                if outcome == "model_refused" and self._model_ok.is_set():
                    self._model_ok.clear()
                    self._leader = r
                waits = 0 if outcome == "done" else waits + 1
                if outcome != "done":
                    await asyncio.sleep(min(0.02 * 2 ** min(waits, 5), 0.5))
            r.outcome = "finished"
        except RolloutFailed as exc:
            r.outcome, r.error = "failed", str(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must end the rollout visibly, not hang it
            log.exception("rollout %s crashed", r.rollout_id)
            r.outcome, r.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            if self._leader is r:  # a leader that ends hands the retrying back to everyone
                self._leader = None
                self._model_ok.set()

    async def _turn(self, r: Rollout) -> Literal["done", "not_started", "model_refused"]:
        """One whole turn, or nothing changed: the model refused the call, or it could not start (no
        turn slot before the gate closed, or the resource server refused the session reset)."""
        if not await self._slot_unless_parking(self._turn_slots):
            return "not_started"
        try:
            return await self._turn_in_slot(r)
        finally:
            self._turn_slots.release()

    async def _turn_in_slot(self, r: Rollout) -> Literal["done", "not_started", "model_refused"]:
        t = len(r.trajectory)
        key = r.capture_key
        if t == 0:
            try:
                await self._post(f"{self.resource_url}/sessions/{r.rollout_id}/reset", {}, self._tool_calls)
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
        # The model call is recorded: from here the turn is finished, whatever it takes.
        results = []
        for kind in r.tools:
            args = rules.tool_args(kind, answer.generation_token_ids)
            tool = await self._tool(r, kind, args)
            results.append(ToolResult(tool=kind, args=args,  # type: ignore[arg-type]
                                      result=tool.result, revision=tool.revision))
        r.trajectory.append(Turn(model_call_id=call.model_call_id, generation_token_ids=answer.generation_token_ids,
                                 generation_log_probs=answer.generation_log_probs, tool_results=results))
        r.turn_keys.append(key)
        return "done"

    async def _tool(self, r: Rollout, kind: str, args: dict[str, int]) -> ToolReply:
        """A tool call inside a turn: retried while the resource server is paused or unreachable."""
        waits = 0
        while True:
            body = {"session_id": r.rollout_id, "expected_revision": r.revisions.get(kind, 0), "args": args}
            try:
                resp = await self._post(f"{self.resource_url}/tools/{kind}", body, self._tool_calls)
            except NotStarted:
                waits += 1
                await asyncio.sleep(min(0.02 * 2 ** min(waits, 5), 0.5))
                continue
            tool = msgspec.json.decode(resp.content, type=ToolReply)
            if resp.headers.get(REVISION_HEADER) != str(tool.revision):
                raise RolloutFailed(f"{kind}: revision header {resp.headers.get(REVISION_HEADER)!r} "
                                    f"!= body {tool.revision}")
            r.revisions[kind] = tool.revision
            r.resource = tool.resource
            return tool

    async def _post(self, url: str, body: Any, slots: asyncio.Semaphore) -> httpx.Response:
        """POST, holding one of ``slots``; NotStarted on 503, 5xx or a transport error, RolloutFailed on
        any other refusal."""
        assert self.http is not None
        await slots.acquire()
        try:
            resp = await self.http.post(url, content=msgspec.json.encode(body),
                                        headers={"content-type": "application/json"})
        except httpx.TransportError as exc:
            log.info("%s unreachable (%s); will retry", url, type(exc).__name__)
            raise NotStarted() from None
        finally:
            slots.release()
        if resp.status_code >= 500:
            raise NotStarted()
        if resp.status_code >= 400:
            raise RolloutFailed(f"{url} refused ({resp.status_code}): {resp.text}")
        return resp

    async def _slot_unless_parking(self, slots: asyncio.Semaphore) -> bool:
        """Take a call slot; False (holding none) if the gate is, or gets, closed first."""
        if self._parking.is_set():
            return False
        slot = asyncio.ensure_future(slots.acquire())
        parking = asyncio.ensure_future(self._parking.wait())
        try:
            await asyncio.wait({slot, parking}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # never keep a slot nobody will release
            parking.cancel()
            slot.cancel()
            if slot.done() and not slot.cancelled():
                slots.release()
            raise
        parking.cancel()
        if not slot.done():
            slot.cancel()
            return False
        if self._parking.is_set():  # got a slot as the gate closed: the turn has still not started
            slots.release()
            return False
        return True

    async def close(self) -> None:
        tasks = [r.task for r in self.rollouts.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()


async def _first(*events: asyncio.Event) -> None:
    """Return as soon as one of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _load_rollouts(snapshot: Snapshot, prefix: str) -> dict[str, Rollout]:
    """Rollouts from an agent part: unfinished ones as attempt n+1, finished ones as results.

    Every unfinished rollout's state must agree with its continuation line (same attempt and
    capture key, and the continuation's last committed call is the last call of the trajectory); a
    rollout parked before its first model call has no line, as Gym writes none for it.
    """
    continuations: dict[str, AgentContinuationRoot] = {}
    for c in part_records(snapshot, prefix, "continuations"):
        if c.rollout_id in continuations:
            raise InvalidRecordError(f"{snapshot.url}: two continuations for rollout {c.rollout_id!r}")
        continuations[c.rollout_id] = c
    out: dict[str, Rollout] = {}
    for rec in part_records(snapshot, prefix, "agent_state"):
        where = f"{snapshot.url}: agent state of {rec.capture_key!r}"
        if rec.rollout_id in out:
            raise InvalidRecordError(f"{where}: rollout listed twice")
        try:
            st = msgspec.convert(rec.state, RolloutState)
        except msgspec.ValidationError as exc:
            raise InvalidRecordError(f"{where}: state: {exc}") from None
        if len(st.trajectory) != rec.turn_index or len(st.turn_keys) != rec.turn_index:
            raise InvalidRecordError(f"{where}: turn_index {rec.turn_index} but {len(st.trajectory)} turns recorded")
        r = Rollout(rollout_id=rec.rollout_id, seed=st.seed, turns=st.turns, tools=list(st.tools),
                    attempt_index=rec.attempt_index, trajectory=list(st.trajectory), turn_keys=list(st.turn_keys),
                    revisions=dict(st.revisions), resource=st.resource, outcome=st.outcome, error=st.error)
        if rec.status == "parked":
            c = continuations.pop(rec.rollout_id, None)
            if c is None and r.last_call is not None:
                raise InvalidRecordError(
                    f"{where}: parked after call {r.last_call!r}, but no continuation of attempt "
                    f"{rec.attempt_index} names it")
            if c is not None and (c.attempt_index, c.capture_key) != (rec.attempt_index, rec.capture_key):
                raise InvalidRecordError(
                    f"{where}: parked, but its continuation is of {c.capture_key!r} (attempt {c.attempt_index})")
            if c is not None and c.last_committed_model_call_id != r.last_call:
                raise InvalidRecordError(f"{where}: continuation says last committed call "
                                         f"{c.last_committed_model_call_id!r}, the trajectory ends at {r.last_call!r}")
            r.outcome = "running"
            r.restored = {"from_attempt": rec.attempt_index, "after_call": r.last_call, "restart_only": r.restart_only}
            r.attempt_index = rec.attempt_index + 1  # run n+1: a new capture key, same trajectory so far
        elif st.outcome == "running":
            raise InvalidRecordError(f"{where}: finished_unacked, but its state says it is still running")
        out[r.rollout_id] = r
    if continuations:
        raise InvalidRecordError(f"{snapshot.url}: continuation(s) without agent state: {sorted(continuations)[:5]}")
    return out


def create_app(name: str, token: str, model_url: str, resource_url: str) -> FastAPI:
    """The agent server's FastAPI app: rollouts, results and the control routes."""
    participant = AgentParticipant(name, model_url, resource_url)
    plane = ControlPlane(participant, token)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        participant.http = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=2.0),
            limits=httpx.Limits(max_connections=2 * MAX_OPEN_CALLS, max_keepalive_connections=2 * MAX_OPEN_CALLS))
        yield
        await participant.close()

    app = FastAPI(title=f"refgym agent server {name}", lifespan=lifespan)
    app.state.participant = participant
    app.include_router(plane.router())
    install_error_handler(app)
    health_routes(app, "agent", name)

    @app.post("/rollouts", status_code=202)
    async def start(request: Request) -> Response:
        r = participant.start(await decode(request, StartRollout))
        return reply({"rollout_id": r.rollout_id, "attempt_index": r.attempt_index, "capture_key": r.capture_key}, 202)

    @app.get("/rollouts")
    async def rollouts() -> Response:
        return reply([r.view(full=False) for r in sorted(participant.rollouts.values(), key=lambda r: r.rollout_id)])

    @app.get("/rollouts/{rollout_id}")
    async def rollout(rollout_id: str) -> Response:
        r = participant.rollouts.get(rollout_id)
        if r is None:
            raise ApiRefused(404, "unknown_rollout", f"no rollout {rollout_id!r} here")
        return reply(r.view())

    @app.get("/results")
    async def results() -> Response:
        done = [r for r in participant.rollouts.values() if r.outcome != "running"]
        return reply([r.view() for r in sorted(done, key=lambda r: r.rollout_id)])

    return app
