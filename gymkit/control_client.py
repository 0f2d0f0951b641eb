"""The Gym control client: the checkpoint control protocol (CONTROL.md) from the coordinator's side.

Each piece is written once:

* :class:`Call` is one HTTP call (method, path, body, the type its answer decodes into, deadline).
  The route methods of :class:`_Routes` build every call of CONTROL.md §4 from the typed request
  structs of ``schemas.control`` and name the struct its answer decodes into.
* Two transports send them, sharing those route methods: :class:`ControlClient` (``httpx.Client``:
  tests, tooling, benchmarks) answers each call, :class:`AsyncControlClient` (``httpx.AsyncClient``:
  the NemoGym actor) returns an awaitable of the same answer.
* :class:`GymFleet` drives every server of a deployment in the call orders of CONTROL.md §8, each step
  fanned out to all servers of a component at once, and builds the manifest's ``GymCommit``
  (:func:`gym_commit`) from the commit answers.

A refusal (4xx/5xx with its ``ControlError``), an unreachable server, a call that outlives its
deadline and an answer that is not the route's struct all raise :class:`ControlCallError`, which
names the step and the server (never the token). A call that carries a deadline is given up at
that deadline plus :data:`GRACE_S`; an idempotent call (the ``GET`` routes, and what a caller marks
so) is sent once more if the connection drops under it, a state-changing control call never is.
``request`` sends anything, answering the ``httpx.Response`` itself: a plain route of a server, or
(for conformance tests) raw bytes and any token to a control route.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from gymkit.participant import part_prefix
from schemas.control import (
    CONTROL_PREFIX,
    AcknowledgeRequest,
    Capabilities,
    CommitRequest,
    CommitResponse,
    ControlRequest,
    DiscardRequest,
    PhaseResponse,
    RestoreRequest,
    RestoreResponse,
    RolloutRef,
)
from schemas.manifest import GymCommit, ParticipantCommit, PartReceipt
from schemas.topology import topology_fingerprint

log = logging.getLogger("gymkit.control_client")

GRACE_S = 5.0  # on top of the time left before a deadline: the server's own answer may take a moment
#: A request on a pooled connection that the server closed as it was sent fails like this. Only
#: idempotent calls are sent once more: for a control call the drop fails the step.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
PREPARE_ORDER = ("model", "agent", "resource")
COMMIT_ORDER = ("agent", "model", "resource")
RESUME_ORDER = ("resource", "model", "agent")  # also abort's
RESTORE_ORDER = ("model", "agent", "resource")
#: What an abort may be answered by a server that never began the checkpoint, or already ended it.
ALREADY_ENDED = ("wrong_phase", "stale_checkpoint")

Refs = Iterable[tuple[str, int]]  # (rollout id, attempt index)


class ControlCallError(Exception):
    """A call to a Gym server failed: refused (``status`` and the ``ControlError``'s ``error`` and
    ``reason``), unreachable (``error`` ``unreachable``), unanswered before its deadline
    (``timeout``), or answered with something that is not the route's struct."""

    def __init__(self, message: str, *, component: str = "", name: str = "", status: int | None = None,
                 error: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.component = component
        self.name = name
        self.status = status
        self.error = error
        self.reason = reason

    @property
    def code(self) -> tuple[int | None, str | None]:
        """``(status, error)``, e.g. ``(409, "wrong_phase")``."""
        return self.status, self.error


class _ErrorBody(msgspec.Struct):
    """A refusal's body, read leniently: a ``ControlError``, or a plain route's ``{error, reason}``."""

    error: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Call:
    """One HTTP call to one server, as a route method built it."""

    step: str  # names the call in errors: "prepare", "commit", "GET /results"
    method: str
    path: str  # from the server's root; the bearer token goes only on paths under CONTROL_PREFIX
    body: Any = None  # JSON-encoded: a request struct, or any value msgspec encodes
    content: bytes | None = None  # sent as it is, instead of ``body``
    token: str | None = None  # None: the client's own; "": none at all
    params: dict[str, Any] | None = None
    reply: Any = None  # the type the answer decodes into; None: the httpx.Response itself
    check: bool = True  # a non-2xx answer raises ControlCallError
    deadline: float | None = None  # the HTTP timeout is the time left before it, plus GRACE_S
    timeout: float | None = None  # without a deadline; None: the client's
    idempotent: bool = False  # sent once more if the connection drops under it


class _Routes:
    """The routes of CONTROL.md §4 as methods taking typed values, for one server at ``url``.

    A transport (:class:`ControlClient`, :class:`AsyncControlClient`) supplies ``_send``; on the
    async one every method here returns an awaitable of what it documents.
    """

    def __init__(self, url: str, token: str, timeout: float, caps: Capabilities | None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._caps = caps

    def _send(self, call: Call) -> Any:
        raise NotImplementedError

    # -- who the server is ---------------------------------------------------------------------
    @property
    def caps(self) -> Capabilities:
        """The capabilities last read (the sync client reads them on first use)."""
        if self._caps is None:
            self._caps = self._first_caps()
        return self._caps

    def _first_caps(self) -> Capabilities:
        raise ControlCallError(f"capabilities of {self.url} not read yet: call capabilities() first")

    @property
    def prefix(self) -> str:
        return part_prefix(self.caps.component, self.caps.name)

    @property
    def label(self) -> str:
        c = self._caps
        return f"{c.component} {c.name} ({self.url})" if c is not None else self.url

    # -- the routes ------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """``GET /capabilities`` (kept as :attr:`caps`)."""
        return self._send(Call(step="capabilities", method="GET", path=f"{CONTROL_PREFIX}/capabilities",
                               reply=Capabilities, idempotent=True))

    def status(self, checkpoint_id: str | None = None, wait_s: float = 0.0) -> PhaseResponse:
        """``GET /status``; with ``checkpoint_id`` and ``wait_s``, the long poll."""
        params = {"checkpoint_id": checkpoint_id, "wait_s": wait_s} if checkpoint_id else None
        return self._send(Call(step="status", method="GET", path=f"{CONTROL_PREFIX}/status", params=params,
                               reply=PhaseResponse, timeout=self.timeout + max(0.0, wait_s), idempotent=True))

    def prepare(self, checkpoint_id: str, deadline: float) -> PhaseResponse:
        """Prepare: ``/prepare``, or for a model server ``/admission/pause`` (its name for it)."""
        path = "/admission/pause" if self.caps.component == "model" else "/prepare"
        return self._control("prepare", path, ControlRequest(checkpoint_id=checkpoint_id, deadline=deadline),
                             PhaseResponse)

    def commit(self, checkpoint_id: str, deadline: float, draft_url: str,
               continuations: Iterable[PartReceipt] = ()) -> CommitResponse:
        """Write this server's part into the draft (a model: given every agent's receipt)."""
        return self._control("commit", "/commit", CommitRequest(
            checkpoint_id=checkpoint_id, deadline=deadline, draft_url=draft_url, part_prefix=self.prefix,
            continuations=list(continuations)), CommitResponse)

    def restore(self, checkpoint_id: str, deadline: float, snapshot_url: str, saved_checkpoint_id: str,
                topology_fingerprint: str) -> RestoreResponse:
        """Load this server's part of a published snapshot (it stays paused)."""
        return self._control("restore", "/restore", RestoreRequest(
            checkpoint_id=checkpoint_id, deadline=deadline, snapshot_url=snapshot_url,
            saved_checkpoint_id=saved_checkpoint_id, part_prefix=self.prefix,
            topology_fingerprint=topology_fingerprint), RestoreResponse)

    def resume(self, checkpoint_id: str, deadline: float | None = None) -> PhaseResponse:
        """End the checkpoint. The server does not check the deadline; it bounds the call (default:
        the client's timeout from now)."""
        return self._control("resume", "/resume", self._ending(checkpoint_id, deadline), PhaseResponse)

    def abort(self, checkpoint_id: str, deadline: float | None = None) -> PhaseResponse:
        """End the checkpoint without keeping what it was for (an aborted restore drops what it loaded)."""
        return self._control("abort", "/abort", self._ending(checkpoint_id, deadline), PhaseResponse)

    def acknowledge(self, refs: Refs) -> dict[str, Any]:
        """Agents: forget these finished results (all or nothing; 404 ``unknown_rollout`` otherwise)."""
        body = AcknowledgeRequest(results=[RolloutRef(rollout_id=r, attempt_index=a) for r, a in refs])
        return self._send(Call(step="acknowledge", method="POST", path=f"{CONTROL_PREFIX}/agent/acknowledge",
                               body=body, reply=dict[str, Any]))

    def discard(self, checkpoint_id: str, deadline: float, refs: Refs) -> dict[str, Any]:
        """Agents, after a restore: these restored continuations start over."""
        return self._control("discard", "/agent/discard", DiscardRequest(
            checkpoint_id=checkpoint_id, deadline=deadline,
            rollouts=[RolloutRef(rollout_id=r, attempt_index=a) for r, a in refs]), dict[str, Any])

    def request(self, method: str, path: str, body: Any = None, *, content: bytes | None = None,
                token: str | None = None, params: dict[str, Any] | None = None, check: bool = False,
                idempotent: bool = False, timeout: float | None = None) -> httpx.Response:
        """Any call, answered with the ``httpx.Response`` itself (raising only with ``check``): a
        plain route, or raw ``content`` and any ``token`` ("" sends none) to a control route."""
        return self._send(Call(step=f"{method} {path}", method=method, path=path, body=body, content=content,
                               token=token, params=params, check=check, idempotent=idempotent, timeout=timeout))

    def _control(self, step: str, path: str, body: Any, reply: Any) -> Any:
        return self._send(Call(step=step, method="POST", path=f"{CONTROL_PREFIX}{path}", body=body, reply=reply,
                               deadline=body.deadline))

    def _ending(self, checkpoint_id: str, deadline: float | None) -> ControlRequest:
        return ControlRequest(checkpoint_id=checkpoint_id,
                              deadline=deadline if deadline is not None else time.time() + self.timeout)

    # -- what both transports share ----------------------------------------------------------------
    def _http_args(self, call: Call) -> dict[str, Any]:
        headers = {"content-type": "application/json"}
        token = self.token if call.token is None else call.token
        if token and call.path.startswith(CONTROL_PREFIX):
            headers["authorization"] = f"Bearer {token}"
        content = call.content if call.content is not None else (
            None if call.body is None else msgspec.json.encode(call.body))
        if call.deadline is not None:
            timeout = max(0.5, call.deadline - time.time()) + GRACE_S
        else:
            timeout = call.timeout if call.timeout is not None else self.timeout
        return {"method": call.method, "url": f"{self.url}{call.path}", "headers": headers, "content": content,
                "params": call.params, "timeout": timeout}

    def _again(self, call: Call, exc: httpx.TransportError, attempt: int) -> bool:
        """Whether to send ``call`` once more after ``exc``: an idempotent call whose connection dropped."""
        if attempt or not call.idempotent or not isinstance(exc, DROPPED):
            return False
        log.info("%s of %s: connection dropped (%s), sending it once more", call.step, self.label, type(exc).__name__)
        return True

    def _error(self, call: Call, what: str, **kw: Any) -> ControlCallError:
        c = self._caps
        return ControlCallError(f"{call.step} of {self.label}: {what}", component=c.component if c else "",
                                name=c.name if c else "", **kw)

    def _unreachable(self, call: Call, exc: httpx.TransportError, timeout: float) -> ControlCallError:
        if isinstance(exc, httpx.TimeoutException):
            return self._error(call, f"no answer within {timeout:.1f}s (deadline passed)", error="timeout")
        return self._error(call, f"unreachable ({type(exc).__name__}: {exc})", error="unreachable")

    def _answer(self, call: Call, resp: httpx.Response) -> Any:
        if call.check and not 200 <= resp.status_code < 300:
            try:
                body = msgspec.json.decode(resp.content, type=_ErrorBody)
            except msgspec.DecodeError:
                body = _ErrorBody()
            raise self._error(call, f"{resp.status_code} {resp.text[:500]}", status=resp.status_code,
                              error=body.error, reason=body.reason)
        if call.reply is None:
            return resp
        try:
            answer = msgspec.json.decode(resp.content, type=call.reply)
        except msgspec.DecodeError as exc:
            raise self._error(call, f"bad answer: {exc}", status=resp.status_code) from None
        if isinstance(answer, Capabilities):
            self._caps = answer
        return answer


class ControlClient(_Routes):
    """One Gym server's control calls, blocking (``httpx.Client``; any ``httpx.Client`` may be
    given, e.g. FastAPI's ``TestClient``, and is then not closed here)."""

    def __init__(self, url: str, token: str, *, timeout: float = 60.0, http: httpx.Client | None = None,
                 caps: Capabilities | None = None) -> None:
        super().__init__(url, token, timeout, caps)
        self._owns_http = http is None
        self.http = http if http is not None else httpx.Client(base_url=self.url, timeout=timeout)

    def _first_caps(self) -> Capabilities:
        return self.capabilities()

    def _send(self, call: Call) -> Any:
        args = self._http_args(call)
        for attempt in (0, 1):
            try:
                resp = self.http.send(self.http.build_request(**args))
                break
            except httpx.TransportError as exc:
                if not self._again(call, exc, attempt):
                    raise self._unreachable(call, exc, args["timeout"]) from None
        return self._answer(call, resp)

    def close(self) -> None:
        if self._owns_http:
            self.http.close()


class AsyncControlClient(_Routes):
    """One Gym server's control calls over a shared ``httpx.AsyncClient`` (the caller closes it).
    Every route method returns an awaitable; :meth:`capabilities` must be awaited before the calls
    that need the server's identity (prepare, commit, restore)."""

    def __init__(self, url: str, token: str, http: httpx.AsyncClient, *, timeout: float = 30.0,
                 caps: Capabilities | None = None) -> None:
        super().__init__(url, token, timeout, caps)
        self.http = http

    async def _send(self, call: Call) -> Any:
        args = self._http_args(call)
        for attempt in (0, 1):
            try:
                resp = await self.http.send(self.http.build_request(**args))
                break
            except httpx.TransportError as exc:
                if not self._again(call, exc, attempt):
                    raise self._unreachable(call, exc, args["timeout"]) from None
        return self._answer(call, resp)


# -- the fleet ---------------------------------------------------------------------------------------
class CommitResult(msgspec.Struct, frozen=True):
    """What Gym's commit gives the publisher: the manifest's ``gym_commit``, every part receipt (in
    commit order) and the seconds each component took."""

    gym_commit: GymCommit
    receipts: list[PartReceipt]
    seconds: dict[str, float]


def gym_commit(checkpoint_id: str, answers: Iterable[tuple[Capabilities, CommitResponse]]) -> GymCommit:
    """The manifest's record of Gym's commit (CONTROL.md §8 step 5): per server, in the order given
    (commit order), its part prefix, part manifest checksum and payload; nulls for a stateless one."""
    return GymCommit(checkpoint_id=checkpoint_id, participants=[
        ParticipantCommit(component=caps.component, name=caps.name,
                          part_prefix=a.part.prefix if a.part is not None else None,
                          part_manifest_checksum=a.part.part_manifest_checksum if a.part is not None else None,
                          payload=a.payload)
        for caps, a in answers])


class GymFleet:
    """Every Gym server of a deployment, driven in the call orders of CONTROL.md §8 (asyncio).

    Servers of one component are called at once; a component starts only when every server of the
    one before has answered, and the first failure fails the step (abort excepted: it calls every
    server and reports what failed). :meth:`discover` comes first.
    """

    def __init__(self, clients: Sequence[AsyncControlClient]) -> None:
        if not clients:
            raise ValueError("a Gym fleet needs at least one server")
        self.clients = list(clients)
        self.servers: list[AsyncControlClient] = []  # sorted by (component, name), once discovered
        self.fingerprint = ""

    @classmethod
    def connect(cls, urls: Iterable[str], token: str, http: httpx.AsyncClient, **kw: Any) -> GymFleet:
        return cls([AsyncControlClient(u, token, http, **kw) for u in urls])

    async def discover(self) -> str:
        """Every server's capabilities; returns the running topology fingerprint (CONTROL.md §2)."""
        await asyncio.gather(*(c.capabilities() for c in self.clients))
        names = [(c.caps.component, c.caps.name) for c in self.clients]
        if len(set(names)) != len(names):
            raise ControlCallError(f"two Gym servers share a component and name: {sorted(names)}")
        self.servers = sorted(self.clients, key=lambda c: (c.caps.component, c.caps.name))
        self.fingerprint = topology_fingerprint([c.caps.contract() for c in self.servers])
        return self.fingerprint

    def of(self, component: str) -> list[AsyncControlClient]:
        if not self.servers:
            raise ControlCallError("the fleet's capabilities are not read yet: call discover() first")
        return [s for s in self.servers if s.caps.component == component]

    async def prepare(self, checkpoint_id: str, deadline: float) -> dict[str, float]:
        """Models pause, agents park every rollout at a turn end, resources freeze; seconds per component."""
        return await self._in_order(PREPARE_ORDER, lambda s: s.prepare(checkpoint_id, deadline))

    async def commit(self, checkpoint_id: str, deadline: float, draft_url: str) -> CommitResult:
        """Each server writes its part into the draft: agents, then models (given every agent's
        receipt), then resources."""
        answers: list[tuple[AsyncControlClient, CommitResponse]] = []
        seconds: dict[str, float] = {}
        for component in COMMIT_ORDER:
            receipts = [a.part for s, a in answers if s.caps.component == "agent" and a.part is not None]
            servers = self.of(component)
            t0 = time.perf_counter()
            got = await asyncio.gather(*(s.commit(checkpoint_id, deadline, draft_url,
                                                  receipts if component == "model" else ()) for s in servers))
            seconds[component] = time.perf_counter() - t0
            answers += zip(servers, got)
        for s, a in answers:
            if a.part is not None and a.part.prefix != s.prefix:
                raise ControlCallError(f"commit of {s.label}: wrote part {a.part.prefix!r}, asked for {s.prefix!r}",
                                       component=s.caps.component, name=s.caps.name)
        return CommitResult(gym_commit(checkpoint_id, [(s.caps, a) for s, a in answers]),
                            [a.part for _, a in answers if a.part is not None], seconds)

    async def resume(self, checkpoint_id: str, deadline: float | None = None) -> dict[str, float]:
        """Resources, then models, then agents (what agents call opens first). Repeats are answered the same."""
        return await self._in_order(RESUME_ORDER, lambda s: s.resume(checkpoint_id, deadline))

    async def abort(self, checkpoint_id: str, deadline: float | None = None) -> list[str]:
        """Abort on every server, in the resume order, whatever each answers; a server that never
        began the checkpoint answers 409 ``wrong_phase`` (fine). Returns the failures, for the log."""
        failures: list[str] = []

        async def one(s: AsyncControlClient) -> None:
            try:
                await s.abort(checkpoint_id, deadline)
            except ControlCallError as exc:
                if exc.error not in ALREADY_ENDED:
                    failures.append(str(exc))

        await self._in_order(RESUME_ORDER, one)
        return failures

    async def restore(self, restore_id: str, deadline: float, snapshot_url: str, saved_checkpoint_id: str,
                      fingerprint: str | None = None) -> dict[str, RestoreResponse]:
        """Every server loads its part of the snapshot and stays paused (models, agents, resources).
        ``fingerprint`` defaults to the one :meth:`discover` computed. Answers by part prefix."""
        answers: dict[str, RestoreResponse] = {}

        async def one(s: AsyncControlClient) -> None:
            answers[s.prefix] = await s.restore(restore_id, deadline, snapshot_url, saved_checkpoint_id,
                                                fingerprint or self.fingerprint)

        await self._in_order(RESTORE_ORDER, one)
        return {s.prefix: answers[s.prefix] for c in RESTORE_ORDER for s in self.of(c)}

    async def _in_order(self, order: Sequence[str],
                        call: Callable[[AsyncControlClient], Awaitable[Any]]) -> dict[str, float]:
        seconds = {}
        for component in order:
            t0 = time.perf_counter()
            await asyncio.gather(*(call(s) for s in self.of(component)))
            seconds[component] = time.perf_counter() - t0
        return seconds
