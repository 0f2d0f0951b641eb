"""What every ``/ng-control/v1`` route family shares: decoding, the bearer check and the answers
(CONTROL.md §1).

The order of a call is Gym's: the body (or, for a GET, the query) is decoded and validated first,
so a malformed call is 422 ``{"detail": [{"type", "loc", "msg"}]}`` even without a token; then the
``Authorization`` header must equal ``Bearer <token>`` exactly (constant time over the whole
value, so the scheme is case-sensitive), else 401 ``{"detail": "missing or invalid control-plane
bearer token"}``; then the handler runs. A :class:`~gymkit.fence.ControlError` is its status (409)
with the envelope ``{"error": {"code", "detail"}}`` and its headers; anything else is logged and
answered 500 ``control_error`` (the token never appears in an answer).

Numbers are decoded leniently, as Gym's pydantic models do in lax mode: ``"12.5"`` is accepted for
a float and ``"3"`` for an int (query strings need this anyway). A non-finite ``deadline_ts`` or
``timeout_s`` is 422, never 500 (Gym answers 500 there; CONTROL.md §1). A body larger than
:data:`~schemas.control.MAX_BODY_BYTES` is 413 ``{"detail": ...}`` before it is read whole. A wrong
method on a known path is FastAPI's own 405; an unknown path its 404.

Usage::

    router = APIRouter(prefix=CONTROL_PREFIX)
    routes = ControlRoutes(router, token)
    routes.post("/model-admission/pause", ControlRequest, pause)   # async def pause(req) -> Struct
    routes.get("/model-admission/status", ModelStatusQuery, status)
    capabilities_route(router, participant.declaration, fence)
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import msgspec
from fastapi import APIRouter, Request, Response

from gymkit.bodies import BodyTooLarge, read_body
from gymkit.fence import ControlError, Fence
from schemas.control import (
    MAX_BODY_BYTES,
    UNAUTHORIZED_DETAIL,
    Capabilities,
    ErrorBody,
    ErrorEnvelope,
)
from schemas.gym_files import GymId
from schemas.manifest import NonNeg

log = logging.getLogger("gymkit.control")

B = TypeVar("B")

JSON = "application/json"


# -- queries of the GET routes -------------------------------------------------------------------
def _finite(value: float, field: str) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")


class CheckpointQuery(msgspec.Struct, frozen=True, kw_only=True):
    """``?checkpoint_id=`` (agent ``status``). Unknown query parameters are ignored, as FastAPI does."""

    checkpoint_id: GymId


class DeadlineQuery(CheckpointQuery, frozen=True, kw_only=True):
    """``?checkpoint_id=&deadline_ts=`` (resources ``status``); ``deadline_ts`` finite."""

    deadline_ts: float

    def __post_init__(self) -> None:
        _finite(self.deadline_ts, "deadline_ts")


class ModelStatusQuery(DeadlineQuery, frozen=True, kw_only=True):
    """Model ``status``: ``wait_state=paused`` waits (up to ``timeout_s``, ≥ 0, finite) for admission
    to be paused."""

    wait_state: Literal["paused"] | None = None
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _finite(self.timeout_s, "timeout_s")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s!r}")


class AttemptQuery(msgspec.Struct, frozen=True, kw_only=True):
    """``?rollout_id=&attempt_index=`` (agent ``completion-receipt``)."""

    rollout_id: GymId
    attempt_index: NonNeg


# -- answers -------------------------------------------------------------------------------------------
def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``value`` (a msgspec struct, dict, ...) as JSON."""
    return Response(msgspec.json.encode(value), status_code=status, media_type=JSON, headers=headers)


def error_response(exc: ControlError) -> Response:
    """A refusal: its status with ``{"error": {"code", "detail"}}`` and its headers (``retry-after``
    for admission refusals). The model data plane answers its refusals with this too."""
    return json_response(ErrorEnvelope(error=ErrorBody(code=exc.code, detail=exc.detail)), exc.status,
                         exc.headers or None)


def unauthorized_response() -> Response:
    return json_response({"detail": UNAUTHORIZED_DETAIL}, 401)


# msgspec's messages, by what they start with or contain, as the closest pydantic error type.
_ERROR_TYPES: tuple[tuple[str, str], ...] = (
    ("Object missing required field", "missing"),
    ("Object contains unknown field", "extra_forbidden"),
    ("Number out of range", "finite_number"),
    ("must be a finite number", "finite_number"),
    ("Invalid enum value", "literal_error"),
    ("matching regex", "string_pattern_mismatch"),
    ("`str` of length >=", "string_too_short"),
    ("`str` of length <=", "string_too_long"),
    ("of length >=", "too_short"),
    ("of length <=", "too_long"),
    (">=", "greater_than_equal"),
    ("<=", "less_than_equal"),
    ("Expected `str`", "string_type"),
    ("Expected `int`", "int_type"),
    ("Expected `float`", "float_type"),
    ("Expected `bool`", "bool_type"),
    ("Expected `object`", "dict_type"),
    ("Expected `array`", "list_type"),
)
_AT = re.compile(r" - at `(\$[^`]*)`$")
_STEP = re.compile(r'\.([^.\[]+)|\[(\d+)\]|\["((?:[^"\\]|\\.)*)"\]|\[([^\]]*)\]')
_FIELD_NAME = re.compile(r"^(?:Object (?:missing required|contains unknown) field `([^`]+)`|([A-Za-z_]\w*) )")


def _path(path: str) -> list[str | int]:
    """``$.continuation_indexes[0].sha256`` -> ``["continuation_indexes", 0, "sha256"]``."""
    out: list[str | int] = []
    for name, index, key, other in _STEP.findall(path[1:]):
        out.append(name or (int(index) if index else key or other))
    return out


def validation_detail(exc: msgspec.MsgspecError, where: Literal["body", "query"], fields: tuple[str, ...] = ()
                      ) -> list[dict[str, Any]]:
    """One FastAPI-style error ``{"type", "loc", "msg"}`` for a msgspec decoding error. ``loc``
    starts with ``where`` and follows msgspec's ``$.a[0].b`` path; a field that a message names
    (missing, unknown, or a ``__post_init__`` check such as ``deadline_ts must be finite``) ends it."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):  # (a ValidationError is a DecodeError too)
        pos = re.search(r"\(byte (\d+)\)", text)
        loc: list[str | int] = [where] + ([int(pos.group(1))] if pos else [])
        return [{"type": "json_invalid", "loc": loc, "msg": f"JSON decode error: {text}"}]
    m = _AT.search(text)
    msg = text[: m.start()] if m else text
    loc = [where, *_path(m.group(1) if m else "$")]
    named = _FIELD_NAME.match(msg)
    if named is not None:
        name = named.group(1) or named.group(2)
        if named.group(1) or (len(loc) == 1 and name in fields):
            loc.append(name)
    kind = next((t for probe, t in _ERROR_TYPES if probe in msg), "value_error")
    return [{"type": kind, "loc": loc, "msg": msg}]


def validation_response(detail: list[dict[str, Any]]) -> Response:
    return json_response({"detail": detail}, 422)


# -- routes ----------------------------------------------------------------------------------------------
class ControlRoutes:
    """Adds bearer-protected routes to ``router`` (which carries the ``/ng-control/v1`` prefix)."""

    def __init__(self, router: APIRouter, token: str) -> None:
        if not token:
            raise ValueError("a control-plane bearer token is required")
        self.router = router
        self._expected = f"Bearer {token}".encode()
        self._token = token

    def authorized(self, request: Request) -> bool:
        """``Authorization`` equals ``Bearer <token>``, compared in constant time over the whole value."""
        given = request.headers.get("authorization")
        if given is None:
            return False
        return hmac.compare_digest(given.encode("latin-1"), self._expected)

    def post(self, path: str, body_type: type[B], handler: Callable[[B], Awaitable[Any]]) -> None:
        """``POST path``: the JSON body decoded as ``body_type`` (unknown fields refused if the struct
        refuses them), then the token, then ``handler(body)``, whose return value is the 200 body."""
        decoder = msgspec.json.Decoder(body_type, strict=False)
        fields = _fields(body_type)

        async def endpoint(request: Request) -> Response:
            try:
                raw = await read_body(request, MAX_BODY_BYTES)
            except BodyTooLarge as exc:
                return json_response({"detail": f"request body of {exc.size} bytes exceeds the limit of "
                                                f"{MAX_BODY_BYTES} bytes"}, 413)
            if not raw.strip():
                return validation_response([{"type": "missing", "loc": ["body"], "msg": "Field required"}])
            try:
                body = decoder.decode(raw)
            except msgspec.MsgspecError as exc:
                return validation_response(validation_detail(exc, "body", fields))
            if not self.authorized(request):
                return unauthorized_response()
            return await self.answer(handler, body)

        endpoint.__name__ = _route_name("post", path)
        self.router.add_api_route(path, endpoint, methods=["POST"], include_in_schema=False)

    def get(self, path: str, query_type: type[B], handler: Callable[[B], Awaitable[Any]]) -> None:
        """``GET path``: the query decoded as ``query_type`` (number strings converted), then the
        token, then ``handler(query)``. A repeated parameter counts by its last value."""
        fields = _fields(query_type)

        async def endpoint(request: Request) -> Response:
            try:
                query = msgspec.convert(dict(request.query_params), query_type, strict=False)
            except msgspec.MsgspecError as exc:
                return validation_response(validation_detail(exc, "query", fields))
            if not self.authorized(request):
                return unauthorized_response()
            return await self.answer(handler, query)

        endpoint.__name__ = _route_name("get", path)
        self.router.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False)

    async def answer(self, handler: Callable[[B], Awaitable[Any]], arg: B) -> Response:
        """Run ``handler(arg)``: its value as 200, a :class:`ControlError` as its envelope, anything
        else as 500 ``control_error``."""
        try:
            return json_response(await handler(arg))
        except ControlError as exc:
            return error_response(exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request itself is being cancelled
            # The first run of a fenced operation this call was waiting on was cancelled.
            return self._internal("the operation was cancelled before it finished")
        except Exception as exc:
            log.exception("control call failed")
            return self._internal(f"{type(exc).__name__}: {exc}")

    def _internal(self, detail: str) -> Response:
        return error_response(ControlError("control_error", detail.replace(self._token, "<token>"), status=500))


def capabilities_route(router: APIRouter, declaration: Callable[[], Capabilities], fence: Fence) -> None:
    """``GET capabilities`` (no token): the declaration merged with the fence's live phase, active
    id and deadline."""

    async def capabilities() -> Response:
        try:
            return json_response(msgspec.structs.replace(declaration(), **fence.snapshot()))
        except Exception as exc:
            log.exception("capabilities failed")
            return error_response(ControlError("control_error", f"{type(exc).__name__}: {exc}", status=500))

    router.add_api_route("/capabilities", capabilities, methods=["GET"], include_in_schema=False)


def _fields(struct_type: type) -> tuple[str, ...]:
    return tuple(getattr(struct_type, "__struct_fields__", ()))


def _route_name(method: str, path: str) -> str:
    return f"{method}_{re.sub(r'[^0-9A-Za-z]+', '_', path).strip('_')}"
