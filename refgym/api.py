"""What the reference servers say to each other over their plain (non-control) routes.

The plain routes carry the work itself (model calls, tool calls, starting rollouts). They need no
bearer token (only ``/ng-control/v1`` does), but they decode bodies as strictly as the control
routes: typed msgspec decoding, a size limit, and every refusal as ``{"error", "reason"}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request, Response

from gymkit.bodies import BodyTooLarge, read_body
from gymkit.control_http import error_response
from gymkit.fence import ControlError
from refgym.rules import MAX_PROMPT_TOKENS
from schemas.control import HEADER_RESOURCE_REVISION
from schemas.gym_records import CallId, RolloutId
from schemas.manifest import NonNeg

MAX_BODY_BYTES = 1 << 20
REVISION_HEADER = HEADER_RESOURCE_REVISION
SessionId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")]
ToolKind = Literal["notes", "sandbox"]


class ModelCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/responses``: one model call of one turn of one rollout attempt."""

    rollout_id: RolloutId
    attempt_index: NonNeg
    capture_key: Annotated[str, msgspec.Meta(min_length=1, max_length=220)]
    model_call_id: CallId
    parent_call_id: CallId | None = None
    turn_index: NonNeg
    prompt_token_ids: Annotated[list[int], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class ModelReply(msgspec.Struct, frozen=True, kw_only=True):
    response_id: str
    model: str
    capture_key: str
    model_call_id: str
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    cum_len: int
    digest: str
    parent_resolution: Literal["root", "resolved", "unresolved"]
    replayed: bool = False  # True when the call was already recorded and is answered again


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /tools/<kind>``: the tool's arguments. The session (rollout attempt), the request id and
    the revision the caller last saw travel in Gym's ``x-nemo-gym-*`` headers."""

    args: Annotated[dict[str, int], msgspec.Meta(max_length=16)]


class ToolReply(msgspec.Struct, frozen=True, kw_only=True):
    resource: str  # the resource server's name (the key of resource_state_revisions)
    tool: ToolKind
    session_id: str
    revision: int
    result: dict[str, int]


class StartRollout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /rollouts`` on the agent server: Gym's ``/run`` of one rollout attempt (0 for a new
    rollout, n+1 for the continuation of a restored attempt n)."""

    rollout_id: RolloutId
    attempt_index: NonNeg = 0
    seed: int
    turns: Annotated[int, msgspec.Meta(ge=1, le=64)]
    tools: Annotated[list[ToolKind], msgspec.Meta(min_length=1, max_length=2)] = msgspec.field(
        default_factory=lambda: ["notes"])


class ApiError(msgspec.Struct, frozen=True, kw_only=True):
    error: str
    reason: str


class ApiRefused(Exception):
    """A refused plain call: its HTTP status and an :class:`ApiError` body."""

    def __init__(self, status: int, error: str, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.body = ApiError(error=error, reason=reason)
        self.headers = headers or {}


def reply(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


async def decode(request: Request, typ: Any) -> Any:
    """The request body decoded as ``typ``: 413 past the size limit, 400 on anything malformed."""
    try:
        raw = await read_body(request, MAX_BODY_BYTES)
    except BodyTooLarge as exc:
        raise ApiRefused(413, "too_large", str(exc)) from None
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as exc:
        raise ApiRefused(400, "bad_request", f"{typ.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiRefused(400, "bad_request", f"not valid JSON: {exc}") from None


def paused(what: str) -> ApiRefused:
    """503 while a checkpoint holds the server: the caller retries after resume."""
    return ApiRefused(503, "paused", f"{what} refused: a checkpoint holds this server; retry after resume",
                      headers={"retry-after": "1"})


def install_error_handler(app: FastAPI) -> None:
    async def on_refused(request: Request, exc: ApiRefused) -> Response:
        return reply(exc.body, exc.status, exc.headers)

    async def on_control_error(request: Request, exc: ControlError) -> Response:
        return error_response(exc)  # Gym's data-plane refusals: 409 {"error": {"code", "detail"}}

    app.add_exception_handler(ApiRefused, on_refused)  # type: ignore[arg-type]
    app.add_exception_handler(ControlError, on_control_error)  # type: ignore[arg-type]


def health_routes(app: FastAPI, component: str, name: str) -> None:
    @app.get("/healthz")
    async def healthz() -> Response:
        return reply({"component": component, "name": name})
