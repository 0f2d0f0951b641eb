"""gymkit.control_http: what every ``/ng-control/v1`` route shares (CONTROL.md §1, §13).

A tiny router with one POST, one GET and the capabilities route, through FastAPI's ASGI stack
in-process: 401 body exact, 422 before the token (bodies and queries, FastAPI's ``loc``), non-finite
numbers 422 (never 500), number strings accepted, 405 and 404, the 409 envelope with its headers,
500 ``control_error`` without the token, 413 for a body over the limit, and capabilities without
a token. ``test_model_control`` runs the same layer over real HTTP.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from gymkit.control_http import (
    AttemptQuery,
    CheckpointQuery,
    ControlRoutes,
    DeadlineQuery,
    ModelStatusQuery,
    capabilities_route,
    validation_detail,
)
from gymkit.fence import ControlError, Fence
from schemas.control import (
    CONTROL_PREFIX,
    MAX_BODY_BYTES,
    AttemptRequest,
    Capabilities,
    ControlRequest,
    ModelCommitRequest,
    MultiProcess,
)

TOKEN = "tok-3f9a"
AUTH = {"authorization": f"Bearer {TOKEN}"}
UNAUTHORIZED = {"detail": "missing or invalid control-plane bearer token"}
SHA = "a" * 64


class Echo:
    """Handlers that record what they were given; ``raise_`` makes the next call raise it."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.raise_: BaseException | None = None

    async def __call__(self, arg: Any) -> Any:
        self.seen.append(arg)
        if self.raise_ is not None:
            raise self.raise_
        return {"ok": True, "type": type(arg).__name__}


@pytest.fixture
def echo() -> Echo:
    return Echo()


@pytest.fixture
def fence() -> Fence:
    return Fence()


@pytest.fixture
def client(echo: Echo, fence: Fence):
    router = APIRouter(prefix=CONTROL_PREFIX)
    routes = ControlRoutes(router, TOKEN)
    routes.post("/x/attempt", AttemptRequest, echo)
    routes.post("/x/commit", ModelCommitRequest, echo)
    routes.post("/x/plain", ControlRequest, echo)
    routes.get("/x/status", ModelStatusQuery, echo)
    routes.get("/x/agent-status", CheckpointQuery, echo)
    routes.get("/x/resources-status", DeadlineQuery, echo)
    routes.get("/x/receipt", AttemptQuery, echo)
    capabilities_route(router, lambda: Capabilities(component="resources_servers", name="resources",
                                                    multi_process=MultiProcess(mode="single_worker")), fence)
    app = FastAPI()
    app.include_router(router)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, route: str, body: Any, headers: dict[str, str] | None = AUTH):
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return client.post(CONTROL_PREFIX + route, content=content, headers=headers or {})


def ctl(**kw: Any) -> dict[str, Any]:
    return {"checkpoint_id": "ckpt-1", "deadline_ts": time.time() + 30, **kw}


def attempt(**kw: Any) -> dict[str, Any]:
    return ctl(**{"rollout_id": "rollout-a", "attempt_index": 0, **kw})


def detail(resp) -> dict[str, Any]:
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert set(body) == {"detail"} and len(body["detail"]) == 1
    (d,) = body["detail"]
    assert set(d) == {"type", "loc", "msg"} and d["msg"]
    return d


# -- 401 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [
    None,
    {"authorization": ""},
    {"authorization": TOKEN},
    {"authorization": f"bearer {TOKEN}"},         # the scheme is case-sensitive
    {"authorization": f"BEARER {TOKEN}"},
    {"authorization": f"Bearer  {TOKEN}"},        # the whole value is compared
    {"authorization": f"Bearer {TOKEN} "},
    {"authorization": f"Bearer {TOKEN[:-1]}"},
    {"authorization": f"Bearer {TOKEN}x"},
    {"authorization": f"Basic {TOKEN}"},
    {"x-authorization": f"Bearer {TOKEN}"},
])
def test_401_body_is_exact_for_every_wrong_header(client: TestClient, echo: Echo, headers) -> None:
    for resp in (post(client, "/x/attempt", attempt(), headers=headers),
                 client.get(CONTROL_PREFIX + "/x/agent-status", params={"checkpoint_id": "c"}, headers=headers or {})):
        assert resp.status_code == 401
        assert resp.content == b'{"detail":"missing or invalid control-plane bearer token"}'
    assert echo.seen == []


def test_the_right_token_is_let_through(client: TestClient, echo: Echo) -> None:
    r = post(client, "/x/attempt", attempt())
    assert r.status_code == 200 and r.json() == {"ok": True, "type": "AttemptRequest"}
    assert echo.seen[0].rollout_id == "rollout-a"


def test_an_empty_token_is_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        ControlRoutes(APIRouter(), "")


# -- 422 on bodies (before the token) ---------------------------------------------------------------
@pytest.mark.parametrize("headers", [None, AUTH])
@pytest.mark.parametrize("body, loc, kind", [
    ({"deadline_ts": 1.0, "rollout_id": "r", "attempt_index": 0}, ["body", "checkpoint_id"], "missing"),
    ({**attempt(), "extra": 1}, ["body", "extra"], "extra_forbidden"),
    (attempt(checkpoint_id=""), ["body", "checkpoint_id"], "string_too_short"),
    (attempt(checkpoint_id="x" * 129), ["body", "checkpoint_id"], "string_too_long"),
    (attempt(checkpoint_id="-starts-with-dash"), ["body", "checkpoint_id"], "string_pattern_mismatch"),
    (attempt(checkpoint_id="has space"), ["body", "checkpoint_id"], "string_pattern_mismatch"),
    (attempt(checkpoint_id="trailing\n"), ["body", "checkpoint_id"], "string_pattern_mismatch"),
    (attempt(checkpoint_id=7), ["body", "checkpoint_id"], "string_type"),
    (attempt(schema_version=2), ["body", "schema_version"], "literal_error"),
    (attempt(attempt_index=-1), ["body", "attempt_index"], "greater_than_equal"),
    (attempt(attempt_index=True), ["body", "attempt_index"], "int_type"),
    (attempt(rollout_id="a/b"), ["body", "rollout_id"], "string_pattern_mismatch"),
    (attempt(deadline_ts="soon"), ["body", "deadline_ts"], "float_type"),
    ([], ["body"], "dict_type"),
])
def test_malformed_bodies_are_422_even_without_a_token(client: TestClient, echo: Echo, headers, body, loc,
                                                       kind) -> None:
    d = detail(post(client, "/x/attempt", body, headers=headers))
    assert d["loc"] == loc and d["type"] == kind
    assert echo.seen == []


@pytest.mark.parametrize("raw, kind", [(b"", "missing"), (b"  ", "missing"), (b"{", "json_invalid"),
                                       (b"not json", "json_invalid"), (b'{"checkpoint_id":"c","deadline_ts":1}x', "json_invalid")])
def test_empty_or_invalid_json_is_422(client: TestClient, raw: bytes, kind: str) -> None:
    d = detail(post(client, "/x/plain", raw, headers=None))
    assert d["type"] == kind and d["loc"][0] == "body"


def test_nested_errors_name_the_nested_field(client: TestClient) -> None:
    ref = {"relative_path": "agent/x/continuations.jsonl", "sha256": SHA, "records": 1}  # bytes missing
    d = detail(post(client, "/x/commit", ctl(checkpoint_dir="/tmp/x", continuation_indexes=[ref])))
    assert d["loc"] == ["body", "continuation_indexes", 0, "bytes"] and d["type"] == "missing"
    bad = {**ref, "bytes": 3, "relative_path": "../escape"}
    d = detail(post(client, "/x/commit", ctl(checkpoint_dir="/tmp/x", continuation_indexes=[bad])))
    assert d["loc"] == ["body", "continuation_indexes", 0] and d["type"] == "value_error"
    d = detail(post(client, "/x/commit", ctl(checkpoint_dir="/tmp/x")))
    assert d["loc"] == ["body", "continuation_indexes"] and d["type"] == "missing"


@pytest.mark.parametrize("raw", [
    b'{"checkpoint_id":"c","deadline_ts":1e400}',
    b'{"checkpoint_id":"c","deadline_ts":-1e400}',
    b'{"checkpoint_id":"c","deadline_ts":"nan"}',
    b'{"checkpoint_id":"c","deadline_ts":"inf"}',
    b'{"checkpoint_id":"c","deadline_ts":"-Infinity"}',
])
def test_a_non_finite_deadline_is_422_never_500(client: TestClient, echo: Echo, raw: bytes) -> None:
    for headers in (None, AUTH):
        d = detail(post(client, "/x/plain", raw, headers=headers))
        assert d["loc"] == ["body", "deadline_ts"] and d["type"] == "finite_number"
    assert echo.seen == []


def test_nan_literal_is_not_json(client: TestClient) -> None:
    d = detail(post(client, "/x/plain", b'{"checkpoint_id":"c","deadline_ts":NaN}'))
    assert d["type"] == "json_invalid"


def test_number_strings_are_accepted_like_pydantic_lax_mode(client: TestClient, echo: Echo) -> None:
    r = post(client, "/x/attempt", attempt(deadline_ts="4e9", attempt_index="2"))
    assert r.status_code == 200, r.text
    assert echo.seen[-1].deadline_ts == 4e9 and echo.seen[-1].attempt_index == 2


def test_schema_version_may_be_left_out_or_given(client: TestClient, echo: Echo) -> None:
    assert post(client, "/x/plain", ctl()).status_code == 200
    assert post(client, "/x/plain", ctl(schema_version=1)).status_code == 200
    assert [r.schema_version for r in echo.seen] == [1, 1]


def test_a_body_over_the_limit_is_413_before_it_is_read(client: TestClient, echo: Echo) -> None:
    big = b'{"checkpoint_id":"c","deadline_ts":1,"pad":"' + b"x" * MAX_BODY_BYTES + b'"}'
    for headers in (None, AUTH):
        r = post(client, "/x/plain", big, headers=headers)
        assert r.status_code == 413 and "exceeds" in r.json()["detail"]
    assert echo.seen == []


# -- queries --------------------------------------------------------------------------------------------
def get(client: TestClient, route: str, params: dict[str, Any], headers: dict[str, str] | None = AUTH):
    return client.get(CONTROL_PREFIX + route, params=params, headers=headers or {})


def test_query_numbers_as_strings_and_defaults(client: TestClient, echo: Echo) -> None:
    r = get(client, "/x/status", {"checkpoint_id": "c", "deadline_ts": "4000000000.5", "unknown": "ignored"})
    assert r.status_code == 200, r.text
    q = echo.seen[-1]
    assert isinstance(q, ModelStatusQuery) and q.deadline_ts == 4000000000.5 and q.timeout_s == 0.0
    assert q.wait_state is None
    r = get(client, "/x/status", {"checkpoint_id": "c", "deadline_ts": "1", "wait_state": "paused",
                                  "timeout_s": "2.5"})
    assert r.status_code == 200 and echo.seen[-1].wait_state == "paused" and echo.seen[-1].timeout_s == 2.5
    r = get(client, "/x/receipt", {"rollout_id": "rollout-a", "attempt_index": "3"})
    assert r.status_code == 200 and echo.seen[-1] == AttemptQuery(rollout_id="rollout-a", attempt_index=3)
    r = get(client, "/x/resources-status", {"checkpoint_id": "c", "deadline_ts": "5"})
    assert r.status_code == 200 and echo.seen[-1] == DeadlineQuery(checkpoint_id="c", deadline_ts=5.0)


def test_a_repeated_query_parameter_counts_by_its_last_value(client: TestClient, echo: Echo) -> None:
    r = client.get(CONTROL_PREFIX + "/x/agent-status?checkpoint_id=a&checkpoint_id=b", headers=AUTH)
    assert r.status_code == 200 and echo.seen[-1].checkpoint_id == "b"


@pytest.mark.parametrize("headers", [None, AUTH])
@pytest.mark.parametrize("params, loc, kind", [
    ({"deadline_ts": "1"}, ["query", "checkpoint_id"], "missing"),
    ({"checkpoint_id": "c"}, ["query", "deadline_ts"], "missing"),
    ({"checkpoint_id": "c", "deadline_ts": "nan"}, ["query", "deadline_ts"], "finite_number"),
    ({"checkpoint_id": "c", "deadline_ts": "inf"}, ["query", "deadline_ts"], "finite_number"),
    ({"checkpoint_id": "c", "deadline_ts": "1e400"}, ["query", "deadline_ts"], "finite_number"),
    ({"checkpoint_id": "c", "deadline_ts": "soon"}, ["query", "deadline_ts"], "float_type"),
    ({"checkpoint_id": "c", "deadline_ts": "1", "timeout_s": "-1"}, ["query", "timeout_s"], "greater_than_equal"),
    ({"checkpoint_id": "c", "deadline_ts": "1", "timeout_s": "inf"}, ["query", "timeout_s"], "finite_number"),
    ({"checkpoint_id": "c", "deadline_ts": "1", "timeout_s": "nan"}, ["query", "timeout_s"], "finite_number"),
    ({"checkpoint_id": "c", "deadline_ts": "1", "wait_state": "running"}, ["query", "wait_state"],
     "literal_error"),
    ({"checkpoint_id": "", "deadline_ts": "1"}, ["query", "checkpoint_id"], "string_too_short"),
    ({"checkpoint_id": "a b", "deadline_ts": "1"}, ["query", "checkpoint_id"], "string_pattern_mismatch"),
])
def test_bad_queries_are_422_even_without_a_token(client: TestClient, echo: Echo, headers, params, loc,
                                                  kind) -> None:
    d = detail(get(client, "/x/status", params, headers=headers))
    assert d["loc"] == loc and d["type"] == kind
    assert echo.seen == []


def test_bad_attempt_queries(client: TestClient) -> None:
    d = detail(get(client, "/x/receipt", {"rollout_id": "r", "attempt_index": "-1"}))
    assert d["loc"] == ["query", "attempt_index"] and d["type"] == "greater_than_equal"
    d = detail(get(client, "/x/receipt", {"rollout_id": "r", "attempt_index": "1.5"}))
    assert d["loc"] == ["query", "attempt_index"] and d["type"] == "int_type"


def test_a_good_query_without_the_token_is_401(client: TestClient, echo: Echo) -> None:
    r = get(client, "/x/status", {"checkpoint_id": "c", "deadline_ts": "1"}, headers=None)
    assert r.status_code == 401 and r.json() == UNAUTHORIZED and echo.seen == []


# -- 405, 404 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, route", [("GET", "/x/plain"), ("PUT", "/x/plain"), ("DELETE", "/x/attempt"),
                                           ("POST", "/x/status"), ("POST", "/capabilities")])
def test_a_wrong_method_on_a_known_path_is_405(client: TestClient, method: str, route: str) -> None:
    for headers in ({}, AUTH):
        r = client.request(method, CONTROL_PREFIX + route, headers=headers, content=msgspec.json.encode(ctl()))
        assert r.status_code == 405


@pytest.mark.parametrize("route", ["/x/nope", "/checkpoint/prepare", "/model-admission/pause", ""])
def test_an_unknown_path_is_404(client: TestClient, route: str) -> None:
    for headers in ({}, AUTH):
        assert client.post(CONTROL_PREFIX + route, headers=headers, json=ctl()).status_code == 404
    assert client.get("/ng-control/v2/capabilities").status_code == 404


# -- answers ----------------------------------------------------------------------------------------------
def test_a_control_error_is_its_envelope_with_its_headers(client: TestClient, echo: Echo) -> None:
    echo.raise_ = ControlError("invalid_phase", "phase 'idle' does not allow this")
    r = post(client, "/x/plain", ctl())
    assert r.status_code == 409
    assert r.content == b'{"error":{"code":"invalid_phase","detail":"phase \'idle\' does not allow this"}}'
    assert "retry-after" not in r.headers
    echo.raise_ = ControlError("checkpoint_parked", "parked", headers={"retry-after": "1"})
    r = post(client, "/x/plain", ctl())
    assert r.status_code == 409 and r.headers["retry-after"] == "1"
    assert r.json() == {"error": {"code": "checkpoint_parked", "detail": "parked"}}


def test_an_unexpected_exception_is_500_control_error_without_the_token(client: TestClient, echo: Echo,
                                                                       caplog) -> None:
    echo.raise_ = RuntimeError(f"disk on fire near {TOKEN}")
    r = post(client, "/x/plain", ctl())
    assert r.status_code == 500
    body = r.json()
    assert body["error"]["code"] == "control_error" and "RuntimeError" in body["error"]["detail"]
    assert TOKEN not in r.text
    assert "control call failed" in caplog.text


def test_capabilities_need_no_token_and_carry_the_fence(client: TestClient, fence: Fence) -> None:
    r = client.get(CONTROL_PREFIX + "/capabilities")
    assert r.status_code == 200
    # CONTROL.md §9's stateless resources server, key for key.
    assert r.json() == {"component": "resources_servers", "name": "resources", "schema_version": 1,
                        "admission_states": ["accepting"], "checkpoint_mode": "stateless",
                        "concurrency_contract": "stateless",
                        "multi_process": {"mode": "single_worker", "num_workers": 1}, "instance_role": None,
                        "features": [], "phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
    fence.set_phase("prepared", "ckpt-9", 123.5)
    caps = msgspec.json.decode(client.get(CONTROL_PREFIX + "/capabilities", headers=AUTH).content, type=Capabilities)
    assert (caps.phase, caps.active_checkpoint_id, caps.deadline_ts) == ("prepared", "ckpt-9", 123.5)


# -- validation_detail ---------------------------------------------------------------------------------------
class Inner(msgspec.Struct, forbid_unknown_fields=True):
    n: int


class Outer(msgspec.Struct, forbid_unknown_fields=True):
    items: list[Inner]
    by_name: dict[str, Inner] = {}


def test_validation_detail_maps_msgspec_paths() -> None:
    def err(raw: bytes) -> dict[str, Any]:
        with pytest.raises(msgspec.MsgspecError) as info:
            msgspec.json.decode(raw, type=Outer)
        (d,) = validation_detail(info.value, "body", ("items", "by_name"))
        return d

    assert err(b'{"items":[{"n":1},{"n":"x"}]}')["loc"] == ["body", "items", 1, "n"]
    assert err(b'{"items":[{"n":1,"m":2}]}')["loc"] == ["body", "items", 0, "m"]
    assert err(b'{"items":[],"by_name":{"k":{}}}')["loc"] == ["body", "by_name", "...", "n"]  # msgspec hides keys
    assert err(b'{"items":[],"by_name":{"k":{"n":"x"}}}')["loc"] == ["body", "by_name", "...", "n"]
    assert err(b'{"items":[')["type"] == "json_invalid"
