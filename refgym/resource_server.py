"""The reference resources server: one tool kind per server, per-attempt sessions with state revisions.

A deployment runs two of them (Gym's topology for restart-only state):

* ``notes`` (``checkpoint_mode`` ``export_restore``) keeps a list of values per session; its
  sessions are exported at prepare, written at commit and loaded at restore;
* ``sandbox`` (``restart_only``) keeps an accumulator that cannot be exported (a stand-in for a
  live process). It takes no part in checkpoints: a rollout whose continuation depends on it is
  discarded after a restore and starts over.

Sessions are Gym's (:class:`gymkit.resources_control.ResourceSessions`): one per rollout attempt,
named by the ``x-nemo-gym-rollout-id`` and ``x-nemo-gym-attempt-index`` headers.
``POST /sessions/reset`` binds (starts) the attempt's session; ``POST /tools/<kind>`` is one
mutation, with a request id (``x-nemo-gym-resource-request-id``: a retry replays its receipt) and
the revision the caller last saw (``x-nemo-gym-expected-resource-state-revision``); the answer
carries the new revision in ``x-nemo-gym-resource-state-revision``. Refusals are Gym's data-plane
409 ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request, Response

from gymkit.agent_dependencies import AgentDependencies
from gymkit.fence import ControlError, Fence
from gymkit.resources_control import (
    ResourceSessions,
    ResourcesParticipant,
    data_plane_response,
    input_digest,
    resources_router,
)
from refgym import rules
from refgym.api import ApiRefused, ToolCall, ToolReply, decode, health_routes, install_error_handler, reply
from refgym.faults import Faults, InjectedFault
from schemas.control import (
    HEADER_ATTEMPT_INDEX,
    HEADER_EXPECTED_REVISION,
    HEADER_RESOURCE_REQUEST_ID,
    HEADER_ROLLOUT_ID,
    Capabilities,
    CheckpointMode,
    MultiProcess,
)
from schemas.errors import InvalidRecordError
from schemas.gym_files import ResourceSnapshot
from schemas.identity import check_rollout_id

_ARGS = {"notes": {"value"}, "sandbox": {"code"}}
MAX_SESSION_BATCH = 2000


class SessionCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One call of ``POST /sessions/batch``: what the headers and body of its own route carry.
    ``body`` is the exact request body of a mutation (``{"args": ...}``), empty for a start or an end."""

    rollout_id: str
    attempt_index: Annotated[int, msgspec.Meta(ge=0)]
    kind: Literal["start", "mutation", "terminal"]
    request_id: str | None = None
    expected_revision: Annotated[int, msgspec.Meta(ge=0)] | None = None
    body: bytes = b""


class SessionBatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    calls: Annotated[list[SessionCall], msgspec.Meta(min_length=1, max_length=MAX_SESSION_BATCH)]


class SessionAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The answer its own route would have given: status, JSON body, headers."""

    status: int
    body: msgspec.Raw
    headers: dict[str, str]


MAX_BODY_BYTES = 1 << 20


class RefResources(ResourcesParticipant):
    """One tool kind's sessions, by rollout attempt, and its side of the resources protocol."""

    def __init__(self, name: str, kind: str, sessions: ResourceSessions, slow_ms: int = 0) -> None:
        if kind not in rules.TOOL_KINDS:
            raise ValueError(f"tool kind {kind!r} is not one of {rules.TOOL_KINDS}")
        self.name = name
        self.kind = kind
        self.mode: CheckpointMode = "restart_only" if kind in rules.RESTART_ONLY_KINDS else "export_restore"
        self.sessions = sessions
        self.slow_s = slow_ms / 1000
        self.faults = Faults()
        self.states: dict[tuple[str, int], dict[str, Any]] = {}

    def declaration(self) -> Capabilities:
        return Capabilities(component="resources_servers", name=self.name, checkpoint_mode=self.mode,
                            concurrency_contract="serialized_per_session",
                            multi_process=MultiProcess(mode="single_worker"))

    async def export_state(self, rollout_id: str, attempt_index: int) -> Any:
        return self.states.get((rollout_id, attempt_index), rules.empty_state(self.kind))

    async def before_prepare(self) -> None:
        await self.faults.before_prepare()

    async def before_commit(self) -> None:
        if self.faults.commit_fails():
            raise InjectedFault("commit failed on purpose (test fault)")

    async def import_states(self, snapshots: list[ResourceSnapshot]) -> None:
        loaded: dict[tuple[str, int], dict[str, Any]] = {}
        for snap in snapshots:
            try:
                loaded[(snap.rollout_id, snap.attempt_index)] = msgspec.convert(snap.state, dict[str, list[int]])
            except msgspec.ValidationError as exc:
                raise InvalidRecordError(f"session of {snap.rollout_id!r} attempt {snap.attempt_index}: state: "
                                         f"{exc}") from None
        self.states = loaded  # swapped in whole: a failed load changes nothing

    async def retire_state(self, rollout_id: str, attempt_index: int) -> None:
        self.states.pop((rollout_id, attempt_index), None)

    # -- the data plane ------------------------------------------------------------------------
    async def call(self, request: Request, kind: str) -> Response:
        """One session call (``kind`` ``start`` for a reset, ``terminal`` for the end of the rollout's
        session, else ``mutation``), with Gym's checks."""
        rid, attempt = _identity(request)
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise ApiRefused(413, "too_large", f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
        request_id = request.headers.get(HEADER_RESOURCE_REQUEST_ID)
        expected = _int_header(request, HEADER_EXPECTED_REVISION)
        digest = input_digest(request.method, request.url.path, request.url.query, body,
                              request.headers.get("content-type"))
        # Decoded before the session is entered: a malformed body is refused (400) without touching the
        # session (raised inside it, the kit would mark the session's outcome uncertain).
        call = _decode_tool(body) if kind == "mutation" else None
        status, out, headers = await self.apply(rid, attempt, kind, request_id, expected, digest, call)
        return Response(out, status_code=status, headers=headers, media_type="application/json")

    async def apply(self, rid: str, attempt: int, kind: str, request_id: str | None, expected: int | None,
                    digest: str, call: ToolCall | None) -> tuple[int, bytes, dict[str, str]]:
        """One session call inside the kit's session lock: (status, body, headers) of the answer."""
        try:
            async with self.sessions.mutation(rid, attempt, kind=kind, request_id=request_id,  # type: ignore[arg-type]
                                              expected_revision=expected, digest=digest) as m:
                if m.replay is not None:  # a retried request id: its recorded answer, nothing runs
                    return m.replay.status, base64.b64decode(m.replay.body_base64), dict(m.replay.headers)
                if self.slow_s:
                    await asyncio.sleep(self.slow_s)
                if kind == "start":
                    self.states[(rid, attempt)] = rules.empty_state(self.kind)
                    # A start is a successful non-read call: one revision more than the session had (1 if new).
                    out = msgspec.json.encode({"rollout_id": rid, "attempt_index": attempt,
                                               "revision": (m.revision or 0) + 1})
                    return 200, out, dict(m.respond(200, out))
                if kind == "terminal":  # the rollout is done with its session: forget it (its receipts stay)
                    self.states.pop((rid, attempt), None)
                    out = msgspec.json.encode({"rollout_id": rid, "attempt_index": attempt, "ended": True})
                    return 200, out, dict(m.respond(200, out))
                assert call is not None
                if set(call.args) != _ARGS[self.kind]:
                    out = msgspec.json.encode({"error": {"code": "bad_request", "message": (
                        f"args of {self.kind} must be exactly {sorted(_ARGS[self.kind])}, got {sorted(call.args)}")}})
                    return 400, out, dict(m.respond(400, out))
                state = self.states.get((rid, attempt), rules.empty_state(self.kind))
                state, result = rules.apply_tool(self.kind, state, call.args)
                self.states[(rid, attempt)] = state
                revision = (m.revision or 0) + 1
                out = msgspec.json.encode(ToolReply(resource=self.name, tool=self.kind, session_id=rid,  # type: ignore[arg-type]
                                                    revision=revision, result=result))
                return 200, out, dict(m.respond(200, out))
        except ControlError as exc:
            resp = data_plane_response(exc)
            return resp.status_code, bytes(resp.body), {k: v for k, v in resp.headers.items()
                                                         if k not in ("content-length", "content-type")}

    async def batch(self, calls: list[SessionCall]) -> list[SessionAnswer]:
        """Several session calls in one request (a scale benchmark's light path), each exactly as its
        own route would run it (same digest, same session lock, same receipts), all at once."""
        async def one(c: SessionCall) -> SessionAnswer:
            # The path and body the agent sends to the call's own route (the receipt's digest binds them).
            path, body = {"start": ("/sessions/reset", b"{}"), "terminal": ("/sessions/end", b"{}")}.get(
                c.kind, (f"/tools/{self.kind}", c.body))
            digest = input_digest("POST", path, b"", body, "application/json")
            call = _decode_tool(body) if c.kind == "mutation" else None
            status, out, headers = await self.apply(c.rollout_id, c.attempt_index, c.kind, c.request_id,
                                                    c.expected_revision, digest, call)
            return SessionAnswer(status=status, body=msgspec.Raw(out), headers=headers)

        return list(await asyncio.gather(*(one(c) for c in calls)))

    def sessions_view(self) -> dict[str, dict[str, Any]]:
        return {f"{rid}.a{n}": {"revision": self.sessions.revision(rid, n), "state": s}
                for (rid, n), s in sorted(self.states.items()) if self.sessions.is_bound(rid, n)}


def _identity(request: Request) -> tuple[str, int]:
    rid = request.headers.get(HEADER_ROLLOUT_ID)
    attempt = _int_header(request, HEADER_ATTEMPT_INDEX)
    if rid is None or attempt is None:
        raise ApiRefused(400, "bad_request", f"session calls need the {HEADER_ROLLOUT_ID} and "
                                             f"{HEADER_ATTEMPT_INDEX} headers")
    try:
        return check_rollout_id(rid, where=HEADER_ROLLOUT_ID), attempt
    except InvalidRecordError as exc:
        raise ApiRefused(400, "bad_request", str(exc)) from None


def _int_header(request: Request, name: str) -> int | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    if not raw.isdigit():
        raise ApiRefused(400, "bad_request", f"{name}: expected a non-negative integer, got {raw[:40]!r}")
    return int(raw)


def _decode_tool(body: bytes) -> ToolCall:
    try:
        return msgspec.json.decode(body, type=ToolCall)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ApiRefused(400, "bad_request", f"ToolCall: {exc}") from None


def create_app(name: str, token: str, kind: str = "notes", slow_ms: int = 0, test_faults: bool = False,
               dependencies: AgentDependencies | None = None) -> FastAPI:
    """A resources server of one tool ``kind``: session reset, the tool, a session view, and Gym's
    ``resources-checkpoint`` control routes. ``dependencies``: the agents' indexes shared with the
    other resources servers of this process (:mod:`gymkit.agent_dependencies`); its own if None."""
    sessions = ResourceSessions()
    participant = RefResources(name, kind, sessions, slow_ms)
    app = FastAPI(title=f"refgym resources server {name} ({kind})")
    app.state.participant = participant
    app.include_router(resources_router(participant, sessions, Fence(), token, dependencies=dependencies))
    install_error_handler(app)
    health_routes(app, "resources_servers", name)
    if test_faults:
        participant.faults.install(app)

    @app.post("/sessions/reset")
    async def reset(request: Request) -> Response:
        return await participant.call(request, "start")

    @app.post("/sessions/end")
    async def end(request: Request) -> Response:
        return await participant.call(request, "terminal")

    @app.post("/tools/{tool}")
    async def tool(tool: str, request: Request) -> Response:
        if tool != kind:
            raise ApiRefused(404, "not_found", f"no tool {tool!r} (this server has {kind})")
        return await participant.call(request, "mutation")

    @app.post("/sessions/batch")
    async def batch(request: Request) -> Response:
        """Several session calls at once (see :meth:`RefResources.batch`)."""
        req = await decode(request, SessionBatch)
        for c in req.calls:
            try:
                check_rollout_id(c.rollout_id)
            except InvalidRecordError as exc:
                raise ApiRefused(400, "bad_request", str(exc)) from None
        return reply(await participant.batch(req.calls))

    @app.get("/sessions")
    async def sessions_view() -> Response:
        return reply(participant.sessions_view())

    return app
