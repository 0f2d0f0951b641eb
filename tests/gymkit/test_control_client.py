"""gymkit's control client against a recording server on 127.0.0.1 (uvicorn): every route's method,
path, body or query and bearer header (CONTROL.md §4), the reply struct it decodes into, the HTTP
timeout a deadline gives a call, the 409 / 401 / 422 bodies read into ``ControlCallError``, and the
single resend of idempotent calls on a dropped connection."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gymkit.control_client import (
    GRACE_S,
    AsyncControlClient,
    ControlCallError,
    ControlClient,
    call_timeout,
)
from schemas.control import (
    CONTROL_PREFIX,
    AbortInflightResponse,
    AcknowledgeCompletedResponse,
    AcknowledgeResponse,
    AgentCommitResponse,
    AgentRestoreResponse,
    AgentResumeResponse,
    AgentRetireResponse,
    AgentStatus,
    Capabilities,
    CompletionReceipt,
    DiscardResponse,
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
from tests.gymkit.fake_gym import ROUTES, FakeGym, refusal, serve
from tests.loopback_http import read_request, write_response

TOKEN = "s3cret-token"
CID = "ckpt-1"
DL = 4e9  # far in the future: the reply comes long before
DIR = "/tmp/draft/gym"
REF = ArtifactRef(relative_path="agent/instance-x/continuations.jsonl", sha256="a" * 64, records=1, bytes=10)
RECEIPT = CompletionReceipt(rollout_id="r1", attempt_index=0, execution_generation=1, result_identity="res-1",
                            result_digest="b" * 64)
COMMON = {"schema_version": 1, "checkpoint_id": CID, "deadline_ts": DL}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeGym, str]]:
    fake = FakeGym("responses_api_agents", "everything", all_routes=True)
    with serve(fake.app) as url:
        yield fake, url


@pytest.fixture
def gym(server) -> tuple[FakeGym, str]:
    fake, url = server
    fake.log.clear()
    fake.script.clear()
    return fake, url


#: (route, how the client calls it, the body or query the server must see, the reply type)
CASES: list[tuple[str, Any, dict[str, Any], type]] = [
    ("capabilities", lambda c: c.capabilities(), {}, Capabilities),
    ("model-admission/pause", lambda c: c.model.pause(CID, DL), COMMON, ModelPauseResponse),
    ("model-admission/status", lambda c: c.model.status(CID, DL, wait_state="paused", timeout_s=2.5),
     {"checkpoint_id": CID, "deadline_ts": "4000000000.0", "wait_state": "paused", "timeout_s": "2.5"},
     ModelStatusResponse),
    ("model-admission/resume", lambda c: c.model.resume(CID, DL), COMMON, ModelResumeResponse),
    ("model-admission/abort_inflight", lambda c: c.model.abort_inflight(CID, DL, "r1", 2),
     {**COMMON, "rollout_id": "r1", "attempt_index": 2}, AbortInflightResponse),
    ("model-checkpoint/commit", lambda c: c.model.commit(CID, DL, DIR, [REF]),
     {**COMMON, "checkpoint_dir": DIR, "continuation_indexes": [
         {"schema_version": 1, "relative_path": REF.relative_path, "sha256": REF.sha256, "records": 1, "bytes": 10}]},
     ModelCommitResponse),
    ("model-checkpoint/restore", lambda c: c.model.restore(CID, DL, DIR), {**COMMON, "checkpoint_dir": DIR},
     ModelRestoreResponse),
    ("agent-checkpoint/acknowledge", lambda c: c.agent.acknowledge(RECEIPT),
     {"rollout_id": "r1", "attempt_index": 0, "execution_generation": 1, "result_identity": "res-1",
      "result_digest": "b" * 64}, AcknowledgeResponse),
    ("agent-checkpoint/acknowledge-completed", lambda c: c.agent.acknowledge_completed([RECEIPT]),
     {"schema_version": 1, "executions": [{"rollout_id": "r1", "attempt_index": 0, "execution_generation": 1,
                                           "result_identity": "res-1", "result_digest": "b" * 64}]},
     AcknowledgeCompletedResponse),
    ("agent-checkpoint/completion-receipt", lambda c: c.agent.completion_receipt("r1", 3),
     {"rollout_id": "r1", "attempt_index": "3"}, CompletionReceipt),
    ("agent-checkpoint/prepare", lambda c: c.agent.prepare(CID, DL), COMMON, AgentStatus),
    ("agent-checkpoint/status", lambda c: c.agent.status(CID), {"checkpoint_id": CID}, AgentStatus),
    ("agent-checkpoint/commit", lambda c: c.agent.commit(CID, DL, DIR), {**COMMON, "checkpoint_dir": DIR},
     AgentCommitResponse),
    ("agent-checkpoint/restore", lambda c: c.agent.restore(CID, DL, DIR), {**COMMON, "checkpoint_dir": DIR},
     AgentRestoreResponse),
    ("agent-checkpoint/resume", lambda c: c.agent.resume(CID, DL), COMMON, AgentResumeResponse),
    ("agent-checkpoint/retire", lambda c: c.agent.retire(CID, DL, "r1", 0),
     {**COMMON, "rollout_id": "r1", "attempt_index": 0}, AgentRetireResponse),
    ("agent-checkpoint/discard-restored-continuation",
     lambda c: c.agent.discard_restored_continuation(CID, DL, "r1", 1),
     {**COMMON, "rollout_id": "r1", "attempt_index": 1}, DiscardResponse),
    ("resources-checkpoint/prepare", lambda c: c.resources.prepare(CID, DL), COMMON, ResourcesPrepareResponse),
    ("resources-checkpoint/status", lambda c: c.resources.status(CID, DL),
     {"checkpoint_id": CID, "deadline_ts": "4000000000.0"}, ResourcesStatusResponse),
    ("resources-checkpoint/commit", lambda c: c.resources.commit(CID, DL, DIR), {**COMMON, "checkpoint_dir": DIR},
     ResourcesCommitResponse),
    ("resources-checkpoint/restore", lambda c: c.resources.restore(CID, DL, DIR),
     {**COMMON, "checkpoint_dir": DIR}, ResourcesRestoreResponse),
    ("resources-checkpoint/resume", lambda c: c.resources.resume(CID, DL), COMMON, ResourcesResumeResponse),
    ("resources-checkpoint/retire", lambda c: c.resources.retire(CID, DL, "r1", 4),
     {**COMMON, "rollout_id": "r1", "attempt_index": 4}, ResourcesRetireResponse),
]


def test_the_cases_cover_every_route_of_the_reference() -> None:
    assert sorted(route for route, *_ in CASES) == sorted(ROUTES)


def _call(transport: str, url: str, fn: Any, **kw: Any) -> Any:
    """``fn(client)`` on a fresh client of ``transport`` (``sync`` or ``async``)."""
    if transport == "sync":
        with ControlClient(url, TOKEN, **kw) as client:
            return fn(client)

    async def run() -> Any:
        async with httpx.AsyncClient() as http:
            return await fn(AsyncControlClient(url, TOKEN, http, **kw))

    return asyncio.run(run())


@pytest.mark.parametrize("transport", ["sync", "async"])
@pytest.mark.parametrize(("route", "fn", "sent", "reply"), CASES, ids=[c[0] for c in CASES])
def test_each_route_sends_its_method_path_body_and_token_and_decodes_its_reply(
        gym, transport: str, route: str, fn: Any, sent: dict[str, Any], reply: type) -> None:
    fake, url = gym
    answer = _call(transport, url, fn)
    assert isinstance(answer, reply)
    (seen,) = fake.log
    method = ROUTES[route][0]
    assert (seen.method, seen.path) == (method, f"{CONTROL_PREFIX}/{route}")
    if method == "GET":
        assert seen.query == sent and seen.body == b""
    else:
        assert seen.json == sent  # exactly these fields: schema_version, checkpoint_id, deadline_ts, ...
        assert seen.headers["content-type"] == "application/json"
    if route == "capabilities":
        assert "authorization" not in seen.headers  # the one unauthenticated route
    else:
        assert seen.headers["authorization"] == f"Bearer {TOKEN}"


def test_capabilities_are_decoded_strictly_and_name_the_server_in_errors(gym) -> None:
    fake, url = gym
    with ControlClient(url, TOKEN) as client:
        assert client.label == url
        caps = client.capabilities()
        assert (caps.component, caps.name, client.caps) == ("responses_api_agents", "everything", caps)
        fake.queue("agent-checkpoint/prepare", refusal("agent_prepare_incomplete", "2 executions still running"))
        with pytest.raises(ControlCallError) as err:
            client.agent.prepare(CID, DL)
        assert str(err.value).startswith(f"agent-checkpoint/prepare of responses_api_agents everything ({url}): 409")
        assert (err.value.component, err.value.name, err.value.step) == (
            "responses_api_agents", "everything", "agent-checkpoint/prepare")
        fake.queue("capabilities", (200, {**fake.capabilities(), "surprise": 1}))  # NeMo-RL refuses other keys
        with pytest.raises(ControlCallError) as err:
            client.capabilities()
        assert (err.value.status, err.value.code) == (200, "bad_answer")


@pytest.mark.parametrize("transport", ["sync", "async"])
def test_refusals_are_read_from_gyms_bodies(gym, transport: str) -> None:
    fake, url = gym
    fake.queue("model-admission/resume", refusal("invalid_phase", "phase 'idle' does not allow this"))
    fake.queue("model-admission/resume", (401, {"detail": "missing or invalid control-plane bearer token"}))
    validation = [{"type": "missing", "loc": ["body", "deadline_ts"], "msg": "Field required"}]
    fake.queue("model-admission/resume", (422, {"detail": validation}))
    fake.queue("model-admission/resume", (500, b"Internal Server Error"))
    fake.queue("model-admission/resume", (200, {"state": "accepting"}))  # no workers: not the route's struct
    got = []
    for _ in range(5):
        with pytest.raises(ControlCallError) as err:
            _call(transport, url, lambda c: c.model.resume(CID, DL))
        e = err.value
        got.append((e.status, e.code, e.detail))
        assert TOKEN not in str(e) and e.step == "model-admission/resume"
    assert got == [
        (409, "invalid_phase", "phase 'idle' does not allow this"),
        (401, None, "missing or invalid control-plane bearer token"),
        (422, None, validation),
        (500, None, "Internal Server Error"),
        (200, "bad_answer", '{"state": "accepting"}'),
    ]


def test_a_control_call_is_given_the_time_left_before_its_deadline_plus_grace(gym) -> None:
    _, url = gym
    assert call_timeout(100.0, grace_s=0.5, now=90.0) == 10.5
    assert call_timeout(100.0, grace_s=0.0, now=200.0) == 0.001  # NeMo-RL's floor once the deadline passed
    assert call_timeout(100.0, now=99.0) == 1.0 + GRACE_S
    timeouts: list[dict[str, float]] = []
    hooks = {"request": [lambda request: timeouts.append(request.extensions["timeout"])]}
    with ControlClient(url, TOKEN, timeout=7.0, grace_s=0.25, http=httpx.Client(event_hooks=hooks)) as client:
        now = time.time()
        client.model.pause(CID, now + 30)
        client.model.pause(CID, now - 30)  # past: never refused here, the server decides
        client.agent.status(CID)  # no deadline: the client's timeout
        client.capabilities()
    assert 30.0 < timeouts[0]["read"] <= 30.25 + 0.1
    assert timeouts[1]["read"] == pytest.approx(0.251)
    assert timeouts[2]["read"] == timeouts[3]["read"] == 7.0
    assert all(t["connect"] == t["read"] == t["write"] for t in timeouts)


@pytest.mark.parametrize("transport", ["sync", "async"])
def test_a_server_slower_than_the_deadline_is_given_up_on_then(gym, transport: str) -> None:
    fake, url = gym
    fake.queue("agent-checkpoint/commit", (200, {}, 3.0))
    t0 = time.monotonic()
    with pytest.raises(ControlCallError) as err:
        _call(transport, url, lambda c: c.agent.commit(CID, time.time() + 0.3, DIR), grace_s=0.1)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert (err.value.status, err.value.code) == (None, "timeout")
    fake.queue("agent-checkpoint/commit", lambda body: (200, fake.default("agent-checkpoint/commit", body), 0.3))
    reply = _call(transport, url, lambda c: c.agent.commit(CID, time.time() + 2.0, DIR), grace_s=0.1)
    assert isinstance(reply, AgentCommitResponse)  # slow, but within its deadline


def test_request_sends_anything_raw(gym) -> None:
    fake, url = gym
    with ControlClient(url, TOKEN) as client:
        resp = client.request("POST", f"{CONTROL_PREFIX}/agent-checkpoint/prepare", content=b"{not json", token="",
                              headers={"x-nemo-gym-plane": "control"})
        assert resp.status_code == 422  # request never raises without check=True
        resp = client.request("POST", f"{CONTROL_PREFIX}/agent-checkpoint/resume", {"any": "thing"}, token="other")
        missing = client.request("GET", "/not-a-route")
    first, second = fake.log[:2]
    assert first.body == b"{not json" and "authorization" not in first.headers
    assert first.headers["x-nemo-gym-plane"] == "control"
    assert second.json == {"any": "thing"} and second.headers["authorization"] == "Bearer other"
    assert missing.status_code == 404
    with pytest.raises(ControlCallError) as err, ControlClient(url, TOKEN) as client:
        client.request("GET", "/not-a-route", check=True)
    assert err.value.status == 404


def test_an_unreachable_server_is_named_without_the_token() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it closes
    with pytest.raises(ControlCallError) as err, ControlClient(f"http://127.0.0.1:{port}", TOKEN) as client:
        client.agent.resume(CID, time.time() + 5)
    assert err.value.code == "unreachable" and err.value.status is None
    assert f"127.0.0.1:{port}" in str(err.value) and TOKEN not in str(err.value)


class _DropsFirstRequests:
    """A loopback HTTP server that closes the connection under the first ``drops`` requests (as a
    server closing an idle keep-alive connection the moment a request arrives on it), then answers
    the route's reply."""

    def __init__(self, drops: int, reply: dict[str, Any]) -> None:
        self.drops, self.reply = drops, json.dumps(reply).encode()
        self.requests = 0

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        self.requests += 1
        if self.requests > self.drops:
            await write_response(writer, self.reply, close=True)
        writer.close()


def test_a_dropped_connection_is_sent_again_once_for_idempotent_calls_only() -> None:
    status = FakeGym("responses_api_agents", "a").default("agent-checkpoint/status", {"checkpoint_id": CID})
    ack = {"acknowledged": [json.loads(json.dumps({"rollout_id": "r1", "attempt_index": 0, "execution_generation": 1,
                                                   "result_identity": "res-1", "result_digest": "b" * 64}))]}
    resumed = {"state": "accepting", "released": 0}

    async def scenario() -> None:
        async with httpx.AsyncClient() as http:
            once = _DropsFirstRequests(1, status)
            async with once as url:  # a GET: sent once more
                assert isinstance(await AsyncControlClient(url, TOKEN, http).agent.status(CID), AgentStatus)
            acked = _DropsFirstRequests(1, ack)
            async with acked as url:  # acknowledgements are answered the same when repeated
                await AsyncControlClient(url, TOKEN, http).agent.acknowledge_completed([RECEIPT])
            twice = _DropsFirstRequests(2, status)
            async with twice as url:  # but only once more
                with pytest.raises(ControlCallError) as err:
                    await AsyncControlClient(url, TOKEN, http).agent.status(CID)
                assert err.value.code == "unreachable"
            fenced = _DropsFirstRequests(1, resumed)
            async with fenced as url:  # a fenced POST: never sent again
                with pytest.raises(ControlCallError) as err:
                    await AsyncControlClient(url, TOKEN, http).agent.resume(CID, time.time() + 5)
                assert err.value.code == "unreachable"
        assert (once.requests, acked.requests, twice.requests, fenced.requests) == (2, 2, 2, 1)

    asyncio.run(scenario())


def test_errors_keep_their_fields_across_pickling() -> None:
    import pickle

    e = ControlCallError("agent-checkpoint/prepare of x: 409", component="responses_api_agents", name="x",
                         status=409, code="agent_prepare_incomplete", detail="not parked",
                         step="agent-checkpoint/prepare")
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.component, back.name, back.status, back.code, back.detail, back.step) == (
        str(e), e.component, e.name, e.status, e.code, e.detail, e.step)
