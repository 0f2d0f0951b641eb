"""The reference resource server: per-session tool state with state revisions.

Two tool kinds, one session of each per session id (the agent uses the rollout id):

* ``notes`` keeps a list of values; its state is exported at commit and loaded at restore.
* ``sandbox`` keeps an accumulator that cannot be exported (a stand-in for a live process). It is
  listed in ``restart_only_resources``: a rollout that used it cannot continue after a restore and
  starts over instead.

Every tool call names the revision the caller last saw (``expected_revision``); a mismatch is a 409,
so a rollout continuing after a restore finds out at its first call if the restored session is not
the state it left. Each successful call bumps the revision and returns it in the
``x-nemo-gym-resource-state-revision`` header. Prepare freezes the sessions (calls get 503) once the
calls in flight have finished.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from gymkit import CommitContext, ControlPlane, ControlRefused, Participant
from refgym import rules
from refgym.api import (
    REVISION_HEADER,
    ApiRefused,
    SessionId,
    ToolCall,
    ToolReply,
    decode,
    health_routes,
    install_error_handler,
    paused,
    reply,
)
from refgym.faults import Faults
from refgym.inflight import InFlight
from refgym.parts import invalid_records_refused, part_records
from schemas.control import Capabilities
from schemas.errors import InvalidRecordError
from schemas.gym_records import SessionStateRecord
from schemas.identity import check_rollout_id
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot

_ARGS = {"notes": {"value"}, "sandbox": {"code"}}


class Session(msgspec.Struct, kw_only=True):
    state: dict[str, Any]
    revision: int = 0


class ResourceParticipant(Participant):
    """The resource server's sessions and its side of the checkpoint protocol."""

    def __init__(self, name: str, slow_ms: int = 0) -> None:
        self.name = name
        self.slow_s = slow_ms / 1000
        self.faults = Faults()
        self.sessions: dict[tuple[str, str], Session] = {}  # (tool kind, session id) -> session
        self._calls = InFlight()

    def capabilities(self) -> Capabilities:
        return Capabilities(component="resource", name=self.name, checkpoint_mode="export_restore",
                            restart_only_resources=list(rules.RESTART_ONLY_KINDS))

    def in_flight(self) -> int:
        return self._calls.count

    async def prepare(self, deadline: float) -> None:
        """Freeze: new calls are already refused (the kit closed admission); wait for the admitted ones."""
        await self.faults.before_prepare()
        await self._calls.quiet()

    async def resume(self) -> None:
        """Nothing to undo: the kit opens admission again once the checkpoint has ended."""

    async def reset(self) -> None:
        """An aborted restore: forget the loaded sessions (restore only runs on an empty server)."""
        self.sessions = {}

    async def commit(self, part: PartWriter | None, context: CommitContext) -> dict[str, Any]:
        assert part is not None
        self.faults.before_commit()
        records = [
            SessionStateRecord(session_id=sid, resource=self.name, tool=kind, state_revision=s.revision,
                               rollout_id=_rollout_of(sid), state=s.state)
            for (kind, sid), s in sorted(self.sessions.items()) if kind not in rules.RESTART_ONLY_KINDS
        ]
        part.write_records("sessions", "session_state", records)
        lost = sum(1 for kind, _ in self.sessions if kind in rules.RESTART_ONLY_KINDS)
        return {"sessions": len(records), "restart_only_sessions_not_exported": lost}

    async def restore(self, snapshot: Snapshot, prefix: str) -> dict[str, Any]:
        if self.sessions:
            raise ControlRefused(409, "wrong_phase",
                                 f"restore needs an empty resource server; this one has {len(self.sessions)} sessions")
        loaded: dict[tuple[str, str], Session] = {}
        with invalid_records_refused():
            for rec in part_records(snapshot, prefix, "session_state"):
                kind = rec.tool if rec.tool is not None else rec.resource  # older records: the tool in resource
                if rec.tool is not None and rec.resource != self.name:
                    raise InvalidRecordError(f"{snapshot.url}: session {rec.session_id!r} belongs to resource server "
                                             f"{rec.resource!r}, not {self.name!r}")
                if kind not in rules.TOOL_KINDS or kind in rules.RESTART_ONLY_KINDS:
                    raise InvalidRecordError(f"{snapshot.url}: session {rec.session_id!r} is of kind {kind!r}, "
                                             "which this server cannot restore")
                try:
                    state = msgspec.convert(rec.state, dict[str, list[int]])
                except msgspec.ValidationError as exc:
                    raise InvalidRecordError(f"{snapshot.url}: session {rec.session_id!r}: state: {exc}") from None
                loaded[(kind, rec.session_id)] = Session(state=dict(state), revision=rec.state_revision)
        self.sessions = loaded  # swapped in whole: a failed load changes nothing
        return {"sessions": len(loaded)}

    # -- the tools -----------------------------------------------------------------------------
    def _admit(self, what: str) -> None:
        if not self.admits_work():
            raise paused(what)

    async def tool(self, kind: str, req: ToolCall) -> ToolReply:
        """One tool call on one session, checked against the revision the caller last saw."""
        if set(req.args) != _ARGS[kind]:
            raise ApiRefused(400, "bad_request",
                             f"args of {kind} must be exactly {sorted(_ARGS[kind])}, got {sorted(req.args)}")
        self._admit(f"{kind} call")
        with self._calls.one():
            if self.slow_s:
                await asyncio.sleep(self.slow_s)
            session = self.sessions.get((kind, req.session_id)) or Session(state=rules.empty_state(kind))
            if session.revision != req.expected_revision:
                lost = " (restart-only state does not survive a restore)" if kind in rules.RESTART_ONLY_KINDS else ""
                raise ApiRefused(409, "revision_mismatch",
                                 f"{kind} session {req.session_id!r} is at revision {session.revision}, "
                                 f"the caller expected {req.expected_revision}{lost}",
                                 headers={REVISION_HEADER: str(session.revision)})
            state, result = rules.apply_tool(kind, session.state, req.args)
            session = Session(state=state, revision=session.revision + 1)
            self.sessions[(kind, req.session_id)] = session
        return ToolReply(resource=self.name, tool=kind, session_id=req.session_id,  # type: ignore[arg-type]
                         revision=session.revision, result=result)

    def reset_session(self, session_id: str) -> None:
        """Start a session over (every kind back to revision 0): a rollout starting from scratch."""
        self._admit("session reset")
        for kind in rules.TOOL_KINDS:
            self.sessions.pop((kind, session_id), None)

    def sessions_view(self) -> dict[str, dict[str, Any]]:
        view: dict[str, dict[str, Any]] = {kind: {} for kind in rules.TOOL_KINDS}
        for (kind, sid), s in sorted(self.sessions.items()):
            view[kind][sid] = {"revision": s.revision, "state": s.state}
        return view


def _rollout_of(session_id: str) -> str | None:
    """The agent names sessions after rollouts; anything else is recorded without a rollout id."""
    try:
        return check_rollout_id(session_id)
    except InvalidRecordError:
        return None


def create_app(name: str, token: str, slow_ms: int = 0, test_faults: bool = False) -> FastAPI:
    """The resource server's FastAPI app: tools, session reset, a session view and the control routes."""
    participant = ResourceParticipant(name, slow_ms)
    plane = ControlPlane(participant, token)
    app = FastAPI(title=f"refgym resource server {name}")
    app.state.participant = participant
    app.include_router(plane.router())
    install_error_handler(app)
    health_routes(app, "resource", name)
    if test_faults:
        participant.faults.install(app)

    @app.post("/tools/{kind}")
    async def tool(kind: str, request: Request) -> Response:
        if kind not in rules.TOOL_KINDS:
            raise ApiRefused(404, "not_found", f"no tool {kind!r} (this server has {', '.join(rules.TOOL_KINDS)})")
        result = await participant.tool(kind, await decode(request, ToolCall))
        return reply(result, headers={REVISION_HEADER: str(result.revision)})

    @app.post("/sessions/{session_id}/reset")
    async def reset(session_id: str) -> Response:
        try:
            sid = msgspec.convert(session_id, SessionId)
        except msgspec.ValidationError as exc:
            raise ApiRefused(400, "bad_request", f"session id {session_id!r}: {exc}") from None
        participant.reset_session(sid)
        return reply({"session_id": sid, "revision": 0})

    @app.get("/sessions")
    async def sessions() -> Response:
        return reply(participant.sessions_view())

    return app
