"""The Gym control client: every route of Gym's per-component generation (CONTROL.md §4), typed.

One piece per concept:

* :class:`Call` is one HTTP call (method, path, body or query, the struct its answer decodes
  into, the deadline that bounds it).
* The route groups build every call of CONTROL.md §4 from the request structs of
  :mod:`schemas.control` and name the reply struct: ``client.model`` (``model-admission/*`` and
  ``model-checkpoint/*``), ``client.agent`` (``agent-checkpoint/*``) and ``client.resources``
  (``resources-checkpoint/*``); ``client.capabilities()`` is the one unauthenticated route.
* Two transports share those groups: :class:`ControlClient` (``httpx.Client``: tests, tooling)
  answers each call; :class:`AsyncControlClient` (``httpx.AsyncClient``: the fleet and the
  NemoGym actor) returns an awaitable of the same answer.
* :meth:`request` sends anything (any bytes, any token, any headers) and answers the
  ``httpx.Response`` itself: a plain route of a server, or a conformance test's raw call.

Every fenced call carries ``schema_version``, ``checkpoint_id`` and ``deadline_ts`` (absolute Unix
seconds). NeMo-RL's actor gives each such call an HTTP timeout of ``max(0.001, deadline_ts - now)``;
ours adds :data:`GRACE_S` (a client's ``grace_s``) on top, so that an answer the server sends *at* the
deadline (agent prepare's 409 ``agent_prepare_incomplete``, a model status poll that ran out) still
arrives instead of being cut off by our own clock. Calls without a deadline (capabilities,
acknowledgements, completion receipts, agent status) use the client's ``timeout``.

A failed call raises :class:`ControlCallError`, naming the route and the server (never the token):

* a Gym refusal, 409 ``{"error": {"code", "detail"}}``: ``status`` 409, ``code`` and ``detail``;
* FastAPI's 401 ``{"detail": "missing or invalid control-plane bearer token"}`` and 422
  ``{"detail": [...]}``: ``status``, ``code`` None, ``detail`` the body's ``detail``;
* anything else non-2xx: ``status`` and the body's text as ``detail``;
* the client's own failures (``status`` None), with a code no server sends (:data:`CLIENT_CODES`):
  ``unreachable``, ``timeout`` (no answer before the deadline plus grace), ``bad_answer`` (a 2xx
  that is not the route's struct).

The ``GET`` routes and the acknowledgements (which Gym answers the same when repeated) are sent
once more if the connection drops under them; a fenced ``POST`` never is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Self

import httpx
import msgspec

from schemas.control import (
    CONTROL_PREFIX,
    AbortInflightResponse,
    AcknowledgeCompletedRequest,
    AcknowledgeCompletedResponse,
    AcknowledgeResponse,
    AgentCommitResponse,
    AgentRestoreResponse,
    AgentResumeResponse,
    AgentRetireResponse,
    AgentStatus,
    AttemptRequest,
    Capabilities,
    CheckpointDirRequest,
    CompletionReceipt,
    ControlRequest,
    DetailBody,
    DiscardResponse,
    ErrorEnvelope,
    ModelCommitRequest,
    ModelCommitResponse,
    ModelPauseResponse,
    ModelRestoreResponse,
    ModelResumeResponse,
    ModelStatusResponse,
    ResourcesCommitResponse,
    ResourcesPrepareResponse,
    ResourcesRestoreResponse,
    ResourcesResumeResponse,
    ResourcesRetireResponse,
    ResourcesStatusResponse,
)
from schemas.gym_files import ArtifactRef

log = logging.getLogger("gymkit.control_client")

GRACE_S = 1.0  # our own client's grace on top of NeMo-RL's max(0.001, deadline_ts - now)
DEFAULT_TIMEOUT_S = 60.0  # NeMo-RL's control timeout for calls without a deadline
#: A request on a pooled connection that the server closed as it was sent fails like this. Only
#: idempotent calls are sent once more.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
#: Sent with every call that must not be sent twice (``Call.idempotent`` False: prepare, commit,
#: restore, resume...): its connection is closed after the answer, and on a client that carries only
#: such calls (``AsyncControlClient(once=...)``) every one has a connection of its own, never a
#: kept-alive one. A kept-alive connection can be dropped under a call two ways, and such a call is
#: not sent again: the server closes it, idle, as the call is sent (uvicorn: after 5 s by default);
#: or httpx's pool (httpcore 1.0), closing the connections it finds expired one after another,
#: closes one it handed to the call a moment before (ReadError mid-send: every run of 100 servers'
#: restore failed so). A fresh connection is never idle, so neither can happen to it.
ONE_CONNECTION_PER_CALL: Mapping[str, str] = MappingProxyType({"connection": "close"})
#: Codes of the client's own failures (``status`` None); no Gym server sends them.
CLIENT_CODES = ("unreachable", "timeout", "bad_answer")

MODEL_ADMISSION = f"{CONTROL_PREFIX}/model-admission"
MODEL_CHECKPOINT = f"{CONTROL_PREFIX}/model-checkpoint"
AGENT_CHECKPOINT = f"{CONTROL_PREFIX}/agent-checkpoint"
RESOURCES_CHECKPOINT = f"{CONTROL_PREFIX}/resources-checkpoint"
CAPABILITIES_PATH = f"{CONTROL_PREFIX}/capabilities"


def error_code(resp: httpx.Response) -> str | None:
    """The ``code`` of a Gym refusal body, ``{"error": {"code", ...}}`` (the control routes' and the
    data planes' envelopes alike), or None when the body is not one."""
    try:
        error = msgspec.json.decode(resp.content).get("error")
    except (msgspec.DecodeError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def call_timeout(deadline_ts: float, grace_s: float = GRACE_S, now: float | None = None) -> float:
    """The HTTP timeout of a call bounded by ``deadline_ts``: NeMo-RL's ``max(0.001, deadline_ts -
    now)`` plus ``grace_s``."""
    return max(0.001, deadline_ts - (time.time() if now is None else now)) + grace_s


class ControlCallError(Exception):
    """A control call failed; ``status``, ``code`` and ``detail`` say how (module docstring).

    ``component`` and ``name`` are the server's (from its capabilities; empty before they are
    read), ``step`` the route (``agent-checkpoint/prepare``)."""

    def __init__(self, message: str, *, component: str = "", name: str = "", status: int | None = None,
                 code: str | None = None, detail: Any = None, step: str = "") -> None:
        super().__init__(message)
        self.component = component
        self.name = name
        self.status = status
        self.code = code
        self.detail = detail
        self.step = step

    def __reduce__(self):  # keeps its fields across pickling (Ray)
        return (_rebuild, (str(self), self.component, self.name, self.status, self.code, self.detail, self.step))


def _rebuild(message: str, component: str, name: str, status: int | None, code: str | None, detail: Any,
             step: str) -> ControlCallError:
    return ControlCallError(message, component=component, name=name, status=status, code=code, detail=detail,
                            step=step)


@dataclass(frozen=True, kw_only=True)
class Call:
    """One HTTP call to one server, as a route method built it."""

    step: str  # names the call in errors: "agent-checkpoint/prepare", "GET /results"
    method: str
    path: str  # from the server's root; the bearer token goes only on paths under CONTROL_PREFIX
    body: Any = None  # JSON-encoded: a request struct, or any value msgspec encodes
    content: bytes | None = None  # sent as it is, instead of ``body``
    token: str | None = None  # None: the client's own; "": none at all
    params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None  # added to (and overriding) the client's
    reply: Any = None  # the type the answer decodes into; None: the httpx.Response itself
    check: bool = True  # a non-2xx answer raises ControlCallError
    deadline_ts: float | None = None  # the HTTP timeout is call_timeout(deadline_ts)
    timeout: float | None = None  # without a deadline; None: the client's
    idempotent: bool = False  # sent once more if the connection drops under it
    authenticated: bool = True  # False: no bearer token even under CONTROL_PREFIX (capabilities)


class _Group:
    """Routes of one component family; methods return the reply (an awaitable of it on the async client)."""

    def __init__(self, client: _Routes) -> None:
        self._c = client

    def _post(self, step: str, path: str, body: Any, reply: Any, deadline_ts: float | None,
              idempotent: bool = False) -> Any:
        return self._c._send(Call(step=step, method="POST", path=path, body=body, reply=reply,
                                  deadline_ts=deadline_ts, idempotent=idempotent))

    def _get(self, step: str, path: str, params: dict[str, Any], reply: Any,
             deadline_ts: float | None = None, timeout: float | None = None) -> Any:
        return self._c._send(Call(step=step, method="GET", path=path, params=params, reply=reply,
                                  deadline_ts=deadline_ts, timeout=timeout, idempotent=True))


class ModelRoutes(_Group):
    """``model-admission/*`` and ``model-checkpoint/*`` (policy instances only, but ``status``)."""

    def pause(self, checkpoint_id: str, deadline_ts: float) -> ModelPauseResponse:
        """Close admission (non-blocking): ``paused`` at once if nothing is in flight, else ``draining``."""
        return self._post("model-admission/pause", f"{MODEL_ADMISSION}/pause",
                          ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts),
                          ModelPauseResponse, deadline_ts)

    def status(self, checkpoint_id: str, deadline_ts: float, wait_state: str | None = None,
               timeout_s: float = 0.0) -> ModelStatusResponse:
        """Admission state; with ``wait_state="paused"`` the server polls up to ``min(timeout_s, time
        left)`` for it (and marks the phase prepared once paused)."""
        params: dict[str, Any] = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "timeout_s": timeout_s}
        if wait_state is not None:
            params["wait_state"] = wait_state
        return self._get("model-admission/status", f"{MODEL_ADMISSION}/status", params, ModelStatusResponse,
                         deadline_ts=deadline_ts)

    def resume(self, checkpoint_id: str, deadline_ts: float) -> ModelResumeResponse:
        return self._post("model-admission/resume", f"{MODEL_ADMISSION}/resume",
                          ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts),
                          ModelResumeResponse, deadline_ts)

    def abort_inflight(self, checkpoint_id: str, deadline_ts: float, rollout_id: str,
                       attempt_index: int) -> AbortInflightResponse:
        """Cancel and tombstone one attempt's calls in flight (while preparing or prepared)."""
        return self._post("model-admission/abort_inflight", f"{MODEL_ADMISSION}/abort_inflight",
                          AttemptRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                         rollout_id=rollout_id, attempt_index=attempt_index),
                          AbortInflightResponse, deadline_ts)

    def commit(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str,
               continuation_indexes: Iterable[ArtifactRef]) -> ModelCommitResponse:
        """Write the ledger of exactly the calls the agents' continuations depend on."""
        return self._post("model-checkpoint/commit", f"{MODEL_CHECKPOINT}/commit",
                          ModelCommitRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                             checkpoint_dir=checkpoint_dir,
                                             continuation_indexes=list(continuation_indexes)),
                          ModelCommitResponse, deadline_ts)

    def restore(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> ModelRestoreResponse:
        return self._post("model-checkpoint/restore", f"{MODEL_CHECKPOINT}/restore",
                          CheckpointDirRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                               checkpoint_dir=checkpoint_dir),
                          ModelRestoreResponse, deadline_ts)


class AgentRoutes(_Group):
    """``agent-checkpoint/*``."""

    def acknowledge(self, receipt: CompletionReceipt) -> AcknowledgeResponse:
        """Release one completed result (its receipt, sent back unchanged)."""
        return self._post("agent-checkpoint/acknowledge", f"{AGENT_CHECKPOINT}/acknowledge", receipt,
                          AcknowledgeResponse, None, idempotent=True)

    def acknowledge_completed(self, receipts: Iterable[CompletionReceipt]) -> AcknowledgeCompletedResponse:
        """Release a batch (validated whole by the server before anything is released)."""
        return self._post("agent-checkpoint/acknowledge-completed", f"{AGENT_CHECKPOINT}/acknowledge-completed",
                          AcknowledgeCompletedRequest(executions=list(receipts)), AcknowledgeCompletedResponse,
                          None, idempotent=True)

    def completion_receipt(self, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        return self._get("agent-checkpoint/completion-receipt", f"{AGENT_CHECKPOINT}/completion-receipt",
                         {"rollout_id": rollout_id, "attempt_index": attempt_index}, CompletionReceipt)

    def prepare(self, checkpoint_id: str, deadline_ts: float) -> AgentStatus:
        """Park every execution at a boundary, waiting up to the deadline; not ready: 409
        ``agent_prepare_incomplete`` (the fleet sends it again)."""
        return self._post("agent-checkpoint/prepare", f"{AGENT_CHECKPOINT}/prepare",
                          ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts), AgentStatus,
                          deadline_ts)

    def status(self, checkpoint_id: str) -> AgentStatus:
        return self._get("agent-checkpoint/status", f"{AGENT_CHECKPOINT}/status", {"checkpoint_id": checkpoint_id},
                         AgentStatus)

    def commit(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> AgentCommitResponse:
        return self._post("agent-checkpoint/commit", f"{AGENT_CHECKPOINT}/commit",
                          CheckpointDirRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                               checkpoint_dir=checkpoint_dir),
                          AgentCommitResponse, deadline_ts)

    def restore(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> AgentRestoreResponse:
        return self._post("agent-checkpoint/restore", f"{AGENT_CHECKPOINT}/restore",
                          CheckpointDirRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                               checkpoint_dir=checkpoint_dir),
                          AgentRestoreResponse, deadline_ts)

    def resume(self, checkpoint_id: str, deadline_ts: float) -> AgentResumeResponse:
        return self._post("agent-checkpoint/resume", f"{AGENT_CHECKPOINT}/resume",
                          ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts),
                          AgentResumeResponse, deadline_ts)

    def retire(self, checkpoint_id: str, deadline_ts: float, rollout_id: str,
               attempt_index: int) -> AgentRetireResponse:
        return self._post("agent-checkpoint/retire", f"{AGENT_CHECKPOINT}/retire",
                          AttemptRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                         rollout_id=rollout_id, attempt_index=attempt_index),
                          AgentRetireResponse, deadline_ts)

    def discard_restored_continuation(self, checkpoint_id: str, deadline_ts: float, rollout_id: str,
                                      attempt_index: int) -> DiscardResponse:
        """After a restore: the replacement attempt (source + 1) starts over instead of continuing."""
        return self._post("agent-checkpoint/discard-restored-continuation",
                          f"{AGENT_CHECKPOINT}/discard-restored-continuation",
                          AttemptRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                         rollout_id=rollout_id, attempt_index=attempt_index),
                          DiscardResponse, deadline_ts)


class ResourcesRoutes(_Group):
    """``resources-checkpoint/*``."""

    def prepare(self, checkpoint_id: str, deadline_ts: float) -> ResourcesPrepareResponse:
        return self._post("resources-checkpoint/prepare", f"{RESOURCES_CHECKPOINT}/prepare",
                          ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts),
                          ResourcesPrepareResponse, deadline_ts)

    def status(self, checkpoint_id: str, deadline_ts: float) -> ResourcesStatusResponse:
        return self._get("resources-checkpoint/status", f"{RESOURCES_CHECKPOINT}/status",
                         {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}, ResourcesStatusResponse,
                         deadline_ts=deadline_ts)

    def commit(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> ResourcesCommitResponse:
        return self._post("resources-checkpoint/commit", f"{RESOURCES_CHECKPOINT}/commit",
                          CheckpointDirRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                               checkpoint_dir=checkpoint_dir),
                          ResourcesCommitResponse, deadline_ts)

    def restore(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> ResourcesRestoreResponse:
        return self._post("resources-checkpoint/restore", f"{RESOURCES_CHECKPOINT}/restore",
                          CheckpointDirRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                               checkpoint_dir=checkpoint_dir),
                          ResourcesRestoreResponse, deadline_ts)

    def resume(self, checkpoint_id: str, deadline_ts: float) -> ResourcesResumeResponse:
        return self._post("resources-checkpoint/resume", f"{RESOURCES_CHECKPOINT}/resume",
                          ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts),
                          ResourcesResumeResponse, deadline_ts)

    def retire(self, checkpoint_id: str, deadline_ts: float, rollout_id: str,
               attempt_index: int) -> ResourcesRetireResponse:
        return self._post("resources-checkpoint/retire", f"{RESOURCES_CHECKPOINT}/retire",
                          AttemptRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts,
                                         rollout_id=rollout_id, attempt_index=attempt_index),
                          ResourcesRetireResponse, deadline_ts)


class _Routes:
    """What both transports share: the route groups, the request, and reading answers.

    A transport supplies ``_send``; on the async one every route method returns an awaitable of
    what it documents."""

    def __init__(self, url: str, token: str, timeout: float, grace_s: float, caps: Capabilities | None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.grace_s = grace_s
        self.caps: Capabilities | None = caps  # the capabilities last read
        self.model = ModelRoutes(self)
        self.agent = AgentRoutes(self)
        self.resources = ResourcesRoutes(self)

    def _send(self, call: Call) -> Any:
        raise NotImplementedError

    @property
    def label(self) -> str:
        c = self.caps
        return f"{c.component} {c.name} ({self.url})" if c is not None else self.url

    def capabilities(self) -> Capabilities:
        """``GET capabilities`` (no token): the declaration merged with the live fence state."""
        return self._send(Call(step="capabilities", method="GET", path=CAPABILITIES_PATH, reply=Capabilities,
                               idempotent=True, authenticated=False))

    def request(self, method: str, path: str, body: Any = None, *, content: bytes | None = None,
                token: str | None = None, params: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None, check: bool = False, idempotent: bool = False,
                timeout: float | None = None, deadline_ts: float | None = None) -> httpx.Response:
        """Any call, answered with the ``httpx.Response`` itself (raising only with ``check``): a plain
        route, or raw ``content``, any ``token`` ("" sends none) and ``headers`` to a control route."""
        return self._send(Call(step=f"{method} {path}", method=method, path=path, body=body, content=content,
                               token=token, params=params, headers=headers, check=check, idempotent=idempotent,
                               timeout=timeout, deadline_ts=deadline_ts))

    # -- what both transports share ----------------------------------------------------------------
    def _timeout(self, call: Call) -> float:
        if call.deadline_ts is not None:
            return call_timeout(call.deadline_ts, self.grace_s)
        return call.timeout if call.timeout is not None else self.timeout

    def _http_args(self, call: Call) -> dict[str, Any]:
        headers = {"content-type": "application/json"}
        if not call.idempotent:
            headers.update(ONE_CONNECTION_PER_CALL)
        token = self.token if call.token is None else call.token
        if token and call.authenticated and call.path.startswith(CONTROL_PREFIX):
            headers["authorization"] = f"Bearer {token}"
        headers.update(call.headers or {})
        content = call.content if call.content is not None else (
            None if call.body is None else msgspec.json.encode(call.body))
        return {"method": call.method, "url": f"{self.url}{call.path}", "headers": headers, "content": content,
                "params": call.params, "timeout": self._timeout(call)}

    def _again(self, call: Call, exc: httpx.TransportError, attempt: int) -> bool:
        """Whether to send ``call`` once more after ``exc``: an idempotent call whose connection dropped."""
        if attempt or not call.idempotent or not isinstance(exc, DROPPED):
            return False
        log.info("%s of %s: connection dropped (%s), sending it once more", call.step, self.label, type(exc).__name__)
        return True

    def _error(self, call: Call, what: str, **kw: Any) -> ControlCallError:
        c = self.caps
        return ControlCallError(f"{call.step} of {self.label}: {what}", component=c.component if c else "",
                                name=c.name if c else "", step=call.step, **kw)

    def _unreachable(self, call: Call, exc: httpx.TransportError, timeout: float) -> ControlCallError:
        if isinstance(exc, httpx.TimeoutException):
            return self._error(call, f"no answer within {timeout:.3f}s (deadline passed)", code="timeout")
        return self._error(call, f"unreachable ({type(exc).__name__}: {exc})", code="unreachable")

    def _refusal(self, call: Call, resp: httpx.Response) -> ControlCallError:
        status = resp.status_code
        try:
            env = msgspec.json.decode(resp.content, type=ErrorEnvelope)
            return self._error(call, f"{status} {env.error.code}: {env.error.detail}", status=status,
                               code=env.error.code, detail=env.error.detail)
        except msgspec.DecodeError:
            pass
        try:
            detail = msgspec.json.decode(resp.content, type=DetailBody).detail
        except msgspec.DecodeError:
            detail = resp.text[:500]
        shown = detail if isinstance(detail, str) else msgspec.json.encode(detail).decode()[:500]
        return self._error(call, f"{status} {shown}", status=status, detail=detail)

    def _answer(self, call: Call, resp: httpx.Response) -> Any:
        if call.check and not 200 <= resp.status_code < 300:
            raise self._refusal(call, resp)
        if call.reply is None:
            return resp
        try:
            answer = msgspec.json.decode(resp.content, type=call.reply)
        except msgspec.DecodeError as exc:
            raise self._error(call, f"bad answer ({resp.status_code}): {exc}", status=resp.status_code,
                              code="bad_answer", detail=resp.text[:500]) from None
        if isinstance(answer, Capabilities):
            self.caps = answer
        return answer


class ControlClient(_Routes):
    """One Gym server's control calls, blocking (``httpx.Client``; any ``httpx.Client`` may be given,
    e.g. FastAPI's ``TestClient``, and is then not closed here)."""

    def __init__(self, url: str, token: str, *, timeout: float = DEFAULT_TIMEOUT_S, grace_s: float = GRACE_S,
                 http: httpx.Client | None = None, caps: Capabilities | None = None) -> None:
        super().__init__(url, token, timeout, grace_s, caps)
        self._owns_http = http is None
        self.http = http if http is not None else httpx.Client(timeout=timeout)

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncControlClient(_Routes):
    """One Gym server's control calls over a shared ``httpx.AsyncClient`` (the caller closes it).
    Every route method returns an awaitable.

    ``once``: the client for the calls that must not be sent twice (default ``http``). Give one that
    no idempotent call uses: its connections, each closed after its answer
    (:data:`ONE_CONNECTION_PER_CALL`), are then never idle, so such a call never rides a kept-alive
    connection that ``http``'s idempotent calls left behind."""

    def __init__(self, url: str, token: str, http: httpx.AsyncClient, *, once: httpx.AsyncClient | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, grace_s: float = GRACE_S, caps: Capabilities | None = None) -> None:
        super().__init__(url, token, timeout, grace_s, caps)
        self.http = http
        self.once = once if once is not None else http

    async def _send(self, call: Call) -> Any:
        args = self._http_args(call)
        http = self.http if call.idempotent else self.once
        for attempt in (0, 1):
            try:
                resp = await http.send(http.build_request(**args))
                break
            except httpx.TransportError as exc:
                if not self._again(call, exc, attempt):
                    raise self._unreachable(call, exc, args["timeout"]) from None
        return self._answer(call, resp)
