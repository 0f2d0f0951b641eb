"""gymkit.model_control: the model server's admission and its ``model-admission/*`` and
``model-checkpoint/*`` routes (CONTROL.md §1-4, §13).

A tiny ledger participant writes a manifest into ``checkpoint_dir`` and answers its summary; a
test data-plane route holds each model call open until the test lets it go. Most tests drive the
app in-process over ASGI in one event loop (so a call can be held and released exactly); the last
ones serve it with uvicorn on 127.0.0.1 and speak real HTTP.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response

from gymkit.control_http import error_response, json_response
from gymkit.fence import ControlError, Fence
from gymkit.model_control import (
    ModelAdmission,
    ModelCommitContext,
    ModelParticipant,
    ModelRestoreContext,
    model_router,
)
from schemas.control import (
    CONTROL_PREFIX,
    FEATURE_STORAGE_REFERENCE_INDEX,
    HEADER_ATTEMPT_INDEX,
    HEADER_PLANE,
    HEADER_ROLLOUT_ID,
    AttemptRef,
    Capabilities,
    ModelCommitResponse,
    ModelRestoreResponse,
    MultiProcess,
)
from schemas.gym_files import ArtifactRef

TOKEN = "model-tok-1"
AUTH = {"authorization": f"Bearer {TOKEN}"}
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


class Ledger(ModelParticipant):
    """Writes ``model-ledger/<name>/manifest.json``; restore answers saved tombstones and source attempts."""

    def __init__(self, admission: ModelAdmission, role: str = "policy", name: str = "policy_model") -> None:
        super().__init__(admission)
        self.role, self.name = role, name
        self.commits: list[ModelCommitContext] = []
        self.restores: list[ModelRestoreContext] = []
        self.resumes = 0
        self.collector_on: list[bool] = []  # gc.isenabled() in each commit and restore
        self.commit_failure: BaseException | None = None
        self.restore_failure: BaseException | None = None
        self.saved_tombstones = [AttemptRef(rollout_id="gone", attempt_index=0)]
        self.saved_sources = [AttemptRef(rollout_id="rollout-a", attempt_index=0)]

    def declaration(self) -> Capabilities:
        return Capabilities(component="responses_api_models", name=self.name,
                            admission_states=["accepting", "draining", "paused"], checkpoint_mode="export_restore",
                            multi_process=MultiProcess(mode="single_worker"), instance_role=self.role,  # type: ignore[arg-type]
                            features=[FEATURE_STORAGE_REFERENCE_INDEX])

    def refs(self) -> ArtifactRef:
        return ArtifactRef(relative_path=f"model-ledger/{self.name}/storage-references.jsonl", sha256=EMPTY_SHA,
                           records=0, bytes=0)

    async def commit(self, ctx: ModelCommitContext) -> ModelCommitResponse:
        self.commits.append(ctx)
        self.collector_on.append(gc.isenabled())
        await asyncio.sleep(0)
        if self.commit_failure is not None:
            raise self.commit_failure
        folder = Path(ctx.checkpoint_dir) / "model-ledger" / self.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "storage-references.jsonl").write_bytes(b"")
        manifest = json.dumps({"schema_version": 2, "checkpoint_id": ctx.checkpoint_id, "server_name": self.name,
                               "tombstones": [[t.rollout_id, t.attempt_index] for t in self.admission.tombstones()]},
                              sort_keys=True, indent=1).encode()
        (folder / "manifest.json").write_bytes(manifest)
        return ModelCommitResponse(rollouts=len(ctx.continuation_indexes), rows=0,
                                   excluded_tombstoned=len(self.admission.tombstones()), excluded_inactive=0,
                                   manifest_digest=hashlib.sha256(manifest).hexdigest(),
                                   storage_reference_index=self.refs())

    async def restore(self, ctx: ModelRestoreContext) -> ModelRestoreResponse:
        self.restores.append(ctx)
        self.collector_on.append(gc.isenabled())
        assert self.admission.state != "accepting"  # the kit closed admission first
        await asyncio.sleep(0)
        if self.restore_failure is not None:
            raise self.restore_failure
        return ModelRestoreResponse(rollouts=1, rows=2, checkpoint_id="saved-1", tombstones=self.saved_tombstones,
                                    source_attempts=self.saved_sources, storage_reference_index=self.refs())

    async def resumed(self) -> None:
        self.resumes += 1


class Server:
    """The model server: control routes plus a data-plane route whose calls wait for :meth:`release`."""

    def __init__(self, role: str = "policy") -> None:
        self.admission = ModelAdmission()
        self.fence = Fence()
        self.ledger = Ledger(self.admission, role)
        self.app = FastAPI()
        self.app.include_router(model_router(self.ledger, self.admission, self.fence, TOKEN))
        self.gate: asyncio.Event | None = None

        @self.app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            if self.gate is None:
                self.gate = asyncio.Event()
            try:
                async with self.admission.call(request.headers[HEADER_ROLLOUT_ID],
                                               int(request.headers[HEADER_ATTEMPT_INDEX]),
                                               request.headers.get(HEADER_PLANE, "responses")):
                    await self.gate.wait()
            except ControlError as exc:
                return error_response(exc)
            return json_response({"ok": True})

        @self.app.post("/test/release")
        async def release() -> Response:
            if self.gate is not None:
                self.gate.set()
                self.gate = None
            return json_response({})


def scenario(role: str = "policy") -> Callable[[Callable[[Server, httpx.AsyncClient], Awaitable[None]]], Any]:
    """Run a test body as ``body(server, client)`` in one event loop, over ASGI in-process."""

    def wrap(body: Callable[[Server, httpx.AsyncClient], Awaitable[None]]) -> Callable[[], None]:
        def test() -> None:
            async def main() -> None:
                server = Server(role)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app),
                                             base_url="http://model") as client:
                    await body(server, client)
            asyncio.run(main())
        test.__name__ = body.__name__
        test.__doc__ = body.__doc__
        return test
    return wrap


def ctl(cid: str, **kw: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 30, **kw}


async def call(client: httpx.AsyncClient, route: str, body: Any, headers: dict[str, str] | None = AUTH
               ) -> httpx.Response:
    return await client.post(CONTROL_PREFIX + route, content=msgspec.json.encode(body), headers=headers or {})


async def ok(client: httpx.AsyncClient, route: str, body: Any) -> dict[str, Any]:
    r = await call(client, route, body)
    assert r.status_code == 200, (route, r.status_code, r.text)
    return r.json()


async def refused(client: httpx.AsyncClient, route: str, body: Any, code: str, status: int = 409) -> httpx.Response:
    r = await call(client, route, body)
    assert r.status_code == status, (route, r.status_code, r.text)
    assert set(r.json()) == {"error"} and r.json()["error"]["code"] == code and r.json()["error"]["detail"]
    return r


async def status(client: httpx.AsyncClient, cid: str, **params: Any) -> httpx.Response:
    return await client.get(CONTROL_PREFIX + "/model-admission/status",
                            params={"checkpoint_id": cid, "deadline_ts": time.time() + 30, **params}, headers=AUTH)


async def caps(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get(CONTROL_PREFIX + "/capabilities")
    assert r.status_code == 200
    msgspec.json.decode(r.content, type=Capabilities)  # strict, as NeMo-RL is
    return r.json()


def model_call(client: httpx.AsyncClient, rid: str, n: int = 0, plane: str = "responses") -> asyncio.Task:
    return asyncio.create_task(client.post("/v1/responses", headers={
        HEADER_ROLLOUT_ID: rid, HEADER_ATTEMPT_INDEX: str(n), HEADER_PLANE: plane}))


async def until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


def release(server: Server) -> None:
    if server.gate is not None:
        server.gate.set()
        server.gate = None


def commit_body(cid: str, tmp: str) -> dict[str, Any]:
    ref = {"schema_version": 1, "relative_path": "agent/instance-x/continuations.jsonl", "sha256": EMPTY_SHA,
           "records": 0, "bytes": 0}
    return ctl(cid, checkpoint_dir=tmp, continuation_indexes=[ref])


PAUSE, RESUME, ABORT = "/model-admission/pause", "/model-admission/resume", "/model-admission/abort_inflight"
COMMIT, RESTORE = "/model-checkpoint/commit", "/model-checkpoint/restore"


# -- pause, status -----------------------------------------------------------------------------------------
@scenario()
async def test_pause_with_nothing_in_flight_is_prepared_at_once(server: Server, client: httpx.AsyncClient) -> None:
    r = await call(client, PAUSE, {"checkpoint_id": "ckpt-1", "deadline_ts": 4e9})
    assert r.status_code == 200
    # CONTROL.md §9, byte for byte.
    assert r.content == b'{"state":"paused","workers":{"acknowledged":1,"expected":1},"inflight_total":0,' \
                        b'"waiters_total":0}'
    c = await caps(client)
    assert (c["phase"], c["active_checkpoint_id"], c["deadline_ts"]) == ("prepared", "ckpt-1", 4e9)
    # A repeat replays; another id conflicts; a new call is parked.
    assert (await call(client, PAUSE, {"checkpoint_id": "ckpt-1", "deadline_ts": 5e9})).content == r.content
    await refused(client, PAUSE, ctl("ckpt-2"), "checkpoint_conflict")
    data = await model_call(client, "rollout-a")
    assert data.status_code == 409 and data.headers["retry-after"] == "1"
    assert data.json() == {"error": {"code": "checkpoint_parked", "detail": data.json()["error"]["detail"]}}


@scenario()
async def test_pause_drains_and_status_marks_prepared(server: Server, client: httpx.AsyncClient) -> None:
    held = model_call(client, "rollout-a", 0, "responses")
    await until(lambda: server.admission.inflight_total == 1)
    reply = await ok(client, PAUSE, ctl("ckpt-1"))
    assert reply == {"state": "draining", "workers": {"acknowledged": 1, "expected": 1}, "inflight_total": 1,
                     "waiters_total": 0}
    assert server.fence.phase == "preparing"
    parked = await model_call(client, "rollout-b")
    assert parked.status_code == 409 and parked.json()["error"]["code"] == "checkpoint_parked"
    assert parked.headers["retry-after"] == "1"

    r = await status(client, "ckpt-1")
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"checkpoint_id", "state", "per_worker", "inflight_total", "waiters_total", "inflight",
                         "tombstones"}
    assert body["checkpoint_id"] == "ckpt-1" and body["state"] == "draining" and body["inflight_total"] == 1
    assert body["per_worker"] == {"0": {"state": "draining", "inflight": 1}} and body["waiters_total"] == 0
    (entry,) = body["inflight"]
    assert (entry["rollout_id"], entry["attempt_index"], entry["plane"]) == ("rollout-a", 0, "responses")
    assert entry["age_seconds"] >= 0 and body["tombstones"] == []

    started = time.monotonic()  # waits its timeout, then answers what it sees
    r = await status(client, "ckpt-1", wait_state="paused", timeout_s="0.2")
    assert r.json()["state"] == "draining" and time.monotonic() - started >= 0.19
    assert server.fence.phase == "preparing"

    release(server)
    assert (await held).status_code == 200
    assert server.admission.state == "paused"  # the last release paused it ...
    assert server.fence.phase == "preparing"  # ... and only a status marks the fence prepared
    r = await status(client, "ckpt-1")
    assert r.json()["state"] == "paused" and r.json()["inflight"] == [] and server.fence.phase == "prepared"
    assert (await caps(client))["phase"] == "prepared"


@scenario()
async def test_status_wait_returns_when_paused_and_is_bounded_by_the_deadline(server: Server,
                                                                            client: httpx.AsyncClient) -> None:
    held = model_call(client, "rollout-a")
    await until(lambda: server.admission.inflight_total == 1)
    await ok(client, PAUSE, ctl("ckpt-1"))
    started = time.monotonic()
    r = await client.get(CONTROL_PREFIX + "/model-admission/status", headers=AUTH, params={
        "checkpoint_id": "ckpt-1", "deadline_ts": str(time.time() + 0.2), "wait_state": "paused", "timeout_s": "30"})
    assert r.json()["state"] == "draining" and 0.15 <= time.monotonic() - started < 5
    waiting = asyncio.create_task(status(client, "ckpt-1", wait_state="paused", timeout_s=10))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    release(server)
    r = await waiting
    assert r.json()["state"] == "paused" and server.fence.phase == "prepared"
    await held


@scenario()
async def test_status_phase_and_fence_checks(server: Server, client: httpx.AsyncClient) -> None:
    r = await status(client, "ckpt-1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_phase"  # idle
    await ok(client, PAUSE, ctl("ckpt-1"))
    r = await status(client, "ckpt-2")
    assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_conflict"
    await ok(client, RESUME, ctl("ckpt-1"))
    r = await status(client, "ckpt-1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_checkpoint"
    r = await client.get(CONTROL_PREFIX + "/model-admission/status", params={"checkpoint_id": "c", "deadline_ts": "1"})
    assert r.status_code == 401
    r = await client.get(CONTROL_PREFIX + "/model-admission/status", params={"checkpoint_id": "c",
                                                                            "deadline_ts": "nan"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "deadline_ts"]


@scenario()
async def test_a_resume_during_a_status_wait_makes_it_stale(server: Server, client: httpx.AsyncClient) -> None:
    held = model_call(client, "rollout-a")
    await until(lambda: server.admission.inflight_total == 1)
    await ok(client, PAUSE, ctl("ckpt-1"))
    waiting = asyncio.create_task(status(client, "ckpt-1", wait_state="paused", timeout_s=0.3))
    await asyncio.sleep(0.05)
    await ok(client, RESUME, ctl("ckpt-1"))
    r = await waiting
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_checkpoint"
    release(server)
    assert (await held).status_code == 200


# -- commit, resume, retirement ------------------------------------------------------------------------------
@scenario()
async def test_commit_resume_replay_and_retirement(server: Server, client: httpx.AsyncClient) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        await refused(client, COMMIT, commit_body("ckpt-1", tmp), "invalid_phase")  # idle
        await ok(client, PAUSE, ctl("ckpt-1"))
        first = await call(client, COMMIT, commit_body("ckpt-1", tmp))
        assert first.status_code == 200
        reply = first.json()
        assert set(reply) == {"rollouts", "rows", "excluded_tombstoned", "excluded_inactive", "manifest_digest",
                              "storage_reference_index"}
        manifest = (Path(tmp) / "model-ledger/policy_model/manifest.json").read_bytes()
        assert reply["manifest_digest"] == hashlib.sha256(manifest).hexdigest()
        (ctx,) = server.ledger.commits
        assert ctx.checkpoint_id == "ckpt-1" and ctx.checkpoint_dir == tmp
        # The participant committed with the cyclic collector held off; the fence holds it off until
        # the resume.
        assert server.ledger.collector_on == [False] and not gc.isenabled()
        assert ctx.continuation_indexes == (ArtifactRef(relative_path="agent/instance-x/continuations.jsonl",
                                                        sha256=EMPTY_SHA, records=0, bytes=0),)
        assert server.fence.phase == "committed_paused" and server.admission.state == "paused"
        # The same (checkpoint_id, operation) replays without committing again.
        again = await call(client, COMMIT, commit_body("ckpt-1", tmp))
        assert again.content == first.content and len(server.ledger.commits) == 1
        await refused(client, COMMIT, commit_body("ckpt-2", tmp), "checkpoint_conflict")

        resumed = await call(client, RESUME, ctl("ckpt-1"))
        assert resumed.status_code == 200
        assert resumed.content == b'{"state":"accepting","workers":{"acknowledged":1,"expected":1},' \
                                  b'"released_waiters":0}'
        assert server.admission.state == "accepting" and server.ledger.resumes == 1
        assert gc.isenabled() and gc.get_freeze_count() == 0  # a commit freezes nothing
        assert (await caps(client))["phase"] == "idle" and (await caps(client))["active_checkpoint_id"] is None
        running = model_call(client, "rollout-a")  # admitted again
        await until(lambda: server.admission.inflight_total == 1)
        release(server)
        assert (await running).status_code == 200
        # Retired: only the resume replays; even the recorded commit is stale now.
        assert (await call(client, RESUME, ctl("ckpt-1"))).content == resumed.content
        assert server.ledger.resumes == 1
        await refused(client, COMMIT, commit_body("ckpt-1", tmp), "stale_checkpoint")
        await refused(client, PAUSE, ctl("ckpt-1"), "stale_checkpoint")
        await refused(client, ABORT, ctl("ckpt-1", rollout_id="r", attempt_index=0), "stale_checkpoint")
        await refused(client, RESTORE, ctl("ckpt-1", checkpoint_dir=tmp), "stale_checkpoint")
        assert len(server.ledger.commits) == 1
        # A fresh id starts a new checkpoint.
        assert (await ok(client, PAUSE, ctl("ckpt-2")))["state"] == "paused"


@scenario()
async def test_resume_is_not_allowed_from_idle(server: Server, client: httpx.AsyncClient) -> None:
    await refused(client, RESUME, ctl("ckpt-1"), "invalid_phase")
    assert not server.fence.retired("ckpt-1") and server.ledger.resumes == 0
    await ok(client, PAUSE, ctl("ckpt-1"))  # the refused id was not retired
    await ok(client, RESUME, ctl("ckpt-1"))


@scenario()
async def test_resume_from_preparing_reopens_admission(server: Server, client: httpx.AsyncClient) -> None:
    held = model_call(client, "rollout-a")
    await until(lambda: server.admission.inflight_total == 1)
    await ok(client, PAUSE, ctl("ckpt-1"))
    assert server.fence.phase == "preparing"
    assert (await ok(client, RESUME, ctl("ckpt-1")))["state"] == "accepting"
    assert server.admission.state == "accepting"
    release(server)
    assert (await held).status_code == 200
    second = model_call(client, "rollout-b")
    await until(lambda: server.admission.inflight_total == 1)
    release(server)
    assert (await second).status_code == 200


@scenario()
async def test_commit_needs_quiescent_admission(server: Server, client: httpx.AsyncClient) -> None:
    held = model_call(client, "rollout-a")
    await until(lambda: server.admission.inflight_total == 1)
    await ok(client, PAUSE, ctl("ckpt-1"))
    await refused(client, COMMIT, commit_body("ckpt-1", "/nonexistent"), "invalid_phase")  # still preparing
    server.fence.set_phase("prepared", "ckpt-1")  # as if marked while a call is still in flight
    await refused(client, COMMIT, commit_body("ckpt-1", "/nonexistent"), "ledger_not_quiescent")
    assert server.fence.phase == "prepared" and server.ledger.commits == []
    release(server)
    await held
    with tempfile.TemporaryDirectory() as tmp:  # the refusal was not recorded: now it commits
        await ok(client, COMMIT, commit_body("ckpt-1", tmp))
    assert server.fence.phase == "committed_paused"


@scenario()
async def test_a_participant_failure_is_500_control_error_and_the_commit_can_be_retried(
        server: Server, client: httpx.AsyncClient) -> None:
    await ok(client, PAUSE, ctl("ckpt-1"))
    server.ledger.commit_failure = RuntimeError(f"cannot write, token {TOKEN}")
    with tempfile.TemporaryDirectory() as tmp:
        r = await refused(client, COMMIT, commit_body("ckpt-1", tmp), "control_error", status=500)
        assert TOKEN not in r.text
        assert server.fence.phase == "prepared"
        server.ledger.commit_failure = ControlError("ledger_mismatch", "tombstones differ")
        await refused(client, COMMIT, commit_body("ckpt-1", tmp), "ledger_mismatch")
        server.ledger.commit_failure = None
        await ok(client, COMMIT, commit_body("ckpt-1", tmp))
    assert len(server.ledger.commits) == 3 and server.fence.phase == "committed_paused"


# -- abort_inflight ---------------------------------------------------------------------------------------------
@scenario()
async def test_abort_inflight_cancels_and_tombstones_the_attempt(server: Server, client: httpx.AsyncClient) -> None:
    a = model_call(client, "rollout-a", 0, "responses")
    a2 = model_call(client, "rollout-a", 0, "tokenize")
    b = model_call(client, "rollout-b", 0)
    await until(lambda: server.admission.inflight_total == 3)
    await refused(client, ABORT, ctl("ckpt-1", rollout_id="rollout-a", attempt_index=0), "invalid_phase")  # idle
    assert not server.admission.tombstoned("rollout-a", 0)
    await ok(client, PAUSE, ctl("ckpt-1"))

    body = ctl("ckpt-1", rollout_id="rollout-a", attempt_index=0)
    reply = await ok(client, ABORT, body)
    assert reply == {"state": "draining", "aborted_inflight": 2, "inflight_total": 1}
    for task in (a, a2):  # cancelled calls end as stale_attempt, without retry-after
        r = await task
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt"
        assert "retry-after" not in r.headers
    assert server.fence.phase == "preparing"  # kept
    # Replay: the recorded count, nothing aborted again.
    assert (await ok(client, ABORT, body))["aborted_inflight"] == 2
    r = await status(client, "ckpt-1")
    assert r.json()["tombstones"] == [{"rollout_id": "rollout-a", "attempt_index": 0}]
    assert [e["rollout_id"] for e in r.json()["inflight"]] == ["rollout-b"]

    reply = await ok(client, ABORT, ctl("ckpt-1", rollout_id="rollout-b", attempt_index=0))
    assert reply == {"state": "paused", "aborted_inflight": 1, "inflight_total": 0}
    assert (await b).json()["error"]["code"] == "stale_attempt"
    assert server.fence.phase == "preparing"  # still kept: status marks it
    assert (await status(client, "ckpt-1")).json()["state"] == "paused" and server.fence.phase == "prepared"
    # An attempt with nothing in flight is still tombstoned; the phase stays prepared.
    assert (await ok(client, ABORT, ctl("ckpt-1", rollout_id="rollout-c", attempt_index=2)))["aborted_inflight"] == 0
    assert server.fence.phase == "prepared"
    await refused(client, ABORT, ctl("ckpt-2", rollout_id="rollout-c", attempt_index=2), "checkpoint_conflict")

    await ok(client, RESUME, ctl("ckpt-1"))
    # After resume: tombstoned attempts are refused with retry-after; others and later attempts run.
    for rid, n in (("rollout-a", 0), ("rollout-b", 0), ("rollout-c", 2)):
        r = await model_call(client, rid, n)
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt"
        assert r.headers["retry-after"] == "1"
    fresh = model_call(client, "rollout-a", 1)
    await until(lambda: server.admission.inflight_total == 1)
    release(server)
    assert (await fresh).status_code == 200


@scenario()
async def test_abort_inflight_only_while_preparing_or_prepared(server: Server, client: httpx.AsyncClient) -> None:
    body = ctl("ckpt-1", rollout_id="rollout-a", attempt_index=0)
    await ok(client, PAUSE, ctl("ckpt-1"))
    with tempfile.TemporaryDirectory() as tmp:
        await ok(client, COMMIT, commit_body("ckpt-1", tmp))
    await refused(client, ABORT, body, "invalid_phase")  # committed_paused
    r = await call(client, ABORT, {**body, "attempt_index": -1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "attempt_index"]


# -- restore ------------------------------------------------------------------------------------------------------
@scenario()
async def test_restore_closes_admission_and_fences_saved_attempts(server: Server, client: httpx.AsyncClient) -> None:
    body = ctl("restore-1", checkpoint_dir="/ckpt/dir")
    first = await call(client, RESTORE, body)
    assert first.status_code == 200
    reply = first.json()
    assert reply["checkpoint_id"] == "saved-1" and reply["rollouts"] == 1 and reply["rows"] == 2
    assert reply["tombstones"] == [{"rollout_id": "gone", "attempt_index": 0}]
    assert reply["source_attempts"] == [{"rollout_id": "rollout-a", "attempt_index": 0}]
    assert server.ledger.restores[0].checkpoint_dir == "/ckpt/dir"
    assert server.fence.phase == "restored_paused" and server.admission.state == "paused"
    # Held off in the restore, and by the fence until the resume, which freezes what the restore left
    # alive (gymkit.collector).
    assert server.ledger.collector_on == [False] and not gc.isenabled() and gc.get_freeze_count() == 0
    assert (await call(client, RESTORE, body)).content == first.content and len(server.ledger.restores) == 1
    r = await model_call(client, "rollout-b")
    assert r.json()["error"]["code"] == "checkpoint_parked"
    await refused(client, PAUSE, ctl("restore-1"), "invalid_phase")
    await refused(client, COMMIT, commit_body("restore-1", "/x"), "invalid_phase")
    st = (await status(client, "restore-1")).json()
    assert st["tombstones"] == [{"rollout_id": "gone", "attempt_index": 0},
                                {"rollout_id": "rollout-a", "attempt_index": 0}]

    await ok(client, RESUME, ctl("restore-1"))
    assert gc.isenabled() and gc.get_freeze_count() > 0
    for rid in ("gone", "rollout-a"):  # the saved tombstones and the source attempts never run again
        r = await model_call(client, rid, 0)
        assert r.json()["error"]["code"] == "stale_attempt" and r.headers["retry-after"] == "1"
    cont = model_call(client, "rollout-a", 1)  # the continuation does
    await until(lambda: server.admission.inflight_total == 1)
    release(server)
    assert (await cont).status_code == 200


@scenario()
async def test_a_failed_restore_stays_paused_and_may_be_retried(server: Server, client: httpx.AsyncClient) -> None:
    server.ledger.restore_failure = ControlError("ledger_mismatch", "roots digest differs")
    await refused(client, RESTORE, ctl("restore-1", checkpoint_dir="/d"), "ledger_mismatch")
    c = await caps(client)
    assert c["phase"] == "restore_failed_paused" and server.admission.state == "paused"
    assert (await model_call(client, "rollout-b")).json()["error"]["code"] == "checkpoint_parked"
    assert (await status(client, "anything")).json()["state"] == "paused"  # a non-idle phase
    await refused(client, PAUSE, ctl("restore-1"), "invalid_phase")

    server.ledger.restore_failure = RuntimeError("unreadable")
    await refused(client, RESTORE, ctl("restore-1", checkpoint_dir="/d"), "control_error", status=500)
    assert server.fence.phase == "restore_failed_paused"

    server.ledger.restore_failure = None  # restore again: allowed from restore_failed_paused
    await ok(client, RESTORE, ctl("restore-2", checkpoint_dir="/d"))
    assert server.fence.phase == "restored_paused" and len(server.ledger.restores) == 3
    await ok(client, RESUME, ctl("restore-2"))
    assert server.admission.state == "accepting"


@scenario()
async def test_resume_straight_from_restore_failed_paused(server: Server, client: httpx.AsyncClient) -> None:
    server.ledger.restore_failure = ControlError("ledger_mismatch", "no")
    await refused(client, RESTORE, ctl("restore-1", checkpoint_dir="/d"), "ledger_mismatch")
    await ok(client, RESUME, ctl("restore-1"))
    assert server.fence.phase == "idle" and server.admission.state == "accepting"
    await refused(client, RESTORE, ctl("restore-1", checkpoint_dir="/d"), "stale_checkpoint")


@scenario()
async def test_restore_only_from_idle_or_restore_failed_paused(server: Server, client: httpx.AsyncClient) -> None:
    await ok(client, PAUSE, ctl("ckpt-1"))
    await refused(client, RESTORE, ctl("ckpt-1", checkpoint_dir="/d"), "invalid_phase")
    await refused(client, RESTORE, ctl("ckpt-2", checkpoint_dir="/d"), "checkpoint_conflict")
    assert server.ledger.restores == []


# -- roles, declaration -------------------------------------------------------------------------------------------
@scenario(role="auxiliary")
async def test_an_auxiliary_model_refuses_policy_routes(server: Server, client: httpx.AsyncClient) -> None:
    for route, body in ((PAUSE, ctl("c")), (RESUME, ctl("c")), (ABORT, ctl("c", rollout_id="r", attempt_index=0)),
                        (COMMIT, commit_body("c", "/d")), (RESTORE, ctl("c", checkpoint_dir="/d"))):
        await refused(client, route, body, "not_a_policy_instance")
    r = await status(client, "c")  # status is not role-gated: the fence answers
    assert r.json()["error"]["code"] == "invalid_phase"
    c = await caps(client)
    assert c["instance_role"] == "auxiliary" and c["component"] == "responses_api_models"
    assert server.admission.state == "accepting"
    r = await call(client, PAUSE, ctl("c"), headers=None)
    assert r.status_code == 401  # the token is checked before the role


def test_model_router_checks_its_inputs() -> None:
    admission = ModelAdmission()
    with pytest.raises(ValueError):
        model_router(Ledger(ModelAdmission()), admission, Fence(), TOKEN)

    class Agentish(Ledger):
        def declaration(self) -> Capabilities:
            return msgspec.structs.replace(super().declaration(), component="responses_api_agents",
                                           instance_role=None)

    with pytest.raises(ValueError):
        model_router(Agentish(admission), admission, Fence(), TOKEN)
    with pytest.raises(ValueError):
        model_router(Ledger(admission), admission, Fence(), "")


# -- admission on its own -------------------------------------------------------------------------------------------
def test_admission_states_and_refusals() -> None:
    async def main() -> None:
        adm = ModelAdmission()
        assert adm.close() == "paused" and adm.state == "paused"
        with pytest.raises(ControlError) as info:
            async with adm.call("r", 0, "responses"):
                pass
        assert info.value.code == "checkpoint_parked" and info.value.headers == {"retry-after": "1"}
        adm.open()
        release = asyncio.Event()

        async def hold() -> None:
            async with adm.call("r", 0, "responses"):
                await release.wait()

        task = asyncio.create_task(hold())
        await asyncio.sleep(0)
        assert adm.close() == "draining" and adm.inflight_total == 1
        assert adm.close() == "draining"  # closing again changes nothing
        assert not await adm.wait_paused(0.05)
        release.set()
        assert await adm.wait_paused(1) and adm.state == "paused"
        await task
        adm.tombstone("t", 1)
        adm.open()
        with pytest.raises(ControlError) as info:
            async with adm.call("t", 1, "responses"):
                pass
        assert info.value.code == "stale_attempt" and info.value.headers == {"retry-after": "1"}
        assert adm.abort_inflight("nobody", 0) == 0 and adm.tombstoned("nobody", 0)
        assert [(t.rollout_id, t.attempt_index) for t in adm.tombstones()] == [("nobody", 0), ("t", 1)]
    asyncio.run(main())


def test_an_aborted_call_that_swallows_the_cancellation_still_ends_stale() -> None:
    async def main() -> None:
        adm = ModelAdmission()
        entered = asyncio.Event()

        async def stubborn() -> str:
            async with adm.call("r", 0, "responses"):
                entered.set()
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    pass  # a body that swallows it
            return "finished"

        task = asyncio.create_task(stubborn())
        await entered.wait()
        assert adm.abort_inflight("r", 0) == 1
        with pytest.raises(ControlError) as info:
            await task
        assert info.value.code == "stale_attempt" and info.value.headers == {}
        assert task.cancelling() == 0 and adm.inflight_total == 0
        # A cancellation that is not an abort stays a cancellation.
        other = asyncio.create_task(stubborn_plain(adm))
        await asyncio.sleep(0.01)
        other.cancel()
        with pytest.raises(asyncio.CancelledError):
            await other
        assert adm.inflight_total == 0
    asyncio.run(main())


async def stubborn_plain(adm: ModelAdmission) -> None:
    async with adm.call("q", 0, "responses"):
        await asyncio.sleep(10)


# -- real HTTP --------------------------------------------------------------------------------------------------------
@pytest.fixture
def live() -> Iterator[tuple[Server, str]]:
    """The model server on uvicorn, 127.0.0.1, a free port, in a thread of its own."""
    server = Server()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(server.app, host="127.0.0.1", port=sock.getsockname()[1], log_level="warning",
                            lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < end and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(10)
    sock.close()


def test_over_real_http_a_whole_save_cycle(live: tuple[Server, str], tmp_path: Path) -> None:
    server, url = live
    with httpx.Client(base_url=url + CONTROL_PREFIX, timeout=10) as http, \
            httpx.Client(base_url=url, timeout=10) as data:
        pool = threading.Thread(target=lambda: held.append(data.post("/v1/responses", headers={
            HEADER_ROLLOUT_ID: "rollout-a", HEADER_ATTEMPT_INDEX: "0", HEADER_PLANE: "responses"})))
        held: list[httpx.Response] = []
        pool.start()
        end = time.monotonic() + 5
        while server.admission.inflight_total != 1:
            assert time.monotonic() < end
            time.sleep(0.01)

        def post(route: str, body: Any, headers: dict[str, str] | None = AUTH) -> httpx.Response:
            return http.post(route, content=msgspec.json.encode(body), headers=headers or {})

        # Transport rules first: 422 before the token, 401 exact, 405, 404, capabilities without a token.
        r = post(PAUSE, {"checkpoint_id": "ckpt-1", "deadline_ts": "nan"}, headers=None)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "deadline_ts"]
        r = http.post(PAUSE, content=b'{"checkpoint_id":"ckpt-1","deadline_ts":1e400}')
        assert r.status_code == 422
        r = post(PAUSE, ctl("ckpt-1"), headers={"authorization": f"bearer {TOKEN}"})
        assert r.status_code == 401 and r.content == b'{"detail":"missing or invalid control-plane bearer token"}'
        assert http.get(PAUSE, headers=AUTH).status_code == 405
        assert http.post("/model-admission/nope", headers=AUTH, json=ctl("c")).status_code == 404
        assert http.get("/capabilities").json()["phase"] == "idle"

        assert post(PAUSE, ctl("ckpt-1")).json()["state"] == "draining"
        parked = data.post("/v1/responses", headers={HEADER_ROLLOUT_ID: "rollout-b", HEADER_ATTEMPT_INDEX: "0"})
        assert parked.status_code == 409 and parked.headers["retry-after"] == "1"
        st = http.get("/model-admission/status", headers=AUTH, params={
            "checkpoint_id": "ckpt-1", "deadline_ts": str(time.time() + 30), "wait_state": "paused", "timeout_s": "0.1"})
        assert st.json()["state"] == "draining" and st.json()["inflight"][0]["rollout_id"] == "rollout-a"
        assert data.post("/test/release").status_code == 200
        pool.join(5)
        assert held[0].status_code == 200
        st = http.get("/model-admission/status", headers=AUTH, params={
            "checkpoint_id": "ckpt-1", "deadline_ts": str(time.time() + 30), "wait_state": "paused", "timeout_s": "5"})
        assert st.json()["state"] == "paused"
        assert http.get("/capabilities").json()["phase"] == "prepared"

        r = post(COMMIT, commit_body("ckpt-1", str(tmp_path)))
        assert r.status_code == 200, r.text
        assert r.json()["manifest_digest"] == hashlib.sha256(
            (tmp_path / "model-ledger/policy_model/manifest.json").read_bytes()).hexdigest()
        assert post(COMMIT, commit_body("ckpt-1", str(tmp_path))).content == r.content
        assert post(RESUME, ctl("ckpt-1")).json() == {"state": "accepting", "workers": {"acknowledged": 1,
                                                                                       "expected": 1},
                                                      "released_waiters": 0}
        r = post(COMMIT, commit_body("ckpt-1", str(tmp_path)))
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_checkpoint"
        caps = msgspec.json.decode(http.get("/capabilities").content, type=Capabilities)
        assert (caps.phase, caps.active_checkpoint_id, caps.deadline_ts) == ("idle", None, None)
        assert len(server.ledger.commits) == 1


def test_over_real_http_abort_inflight_cancels_a_live_call(live: tuple[Server, str]) -> None:
    server, url = live
    with httpx.Client(base_url=url, timeout=10) as http:
        held: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: held.append(http.post("/v1/responses", headers={
            HEADER_ROLLOUT_ID: "rollout-a", HEADER_ATTEMPT_INDEX: "3", HEADER_PLANE: "responses"})))
        thread.start()
        end = time.monotonic() + 5
        while server.admission.inflight_total != 1:
            assert time.monotonic() < end
            time.sleep(0.01)
        r = http.post(CONTROL_PREFIX + PAUSE, headers=AUTH, json=ctl("ckpt-1"))
        assert r.json()["state"] == "draining"
        r = http.post(CONTROL_PREFIX + ABORT, headers=AUTH, json=ctl("ckpt-1", rollout_id="rollout-a",
                                                                      attempt_index=3))
        assert r.json() == {"state": "paused", "aborted_inflight": 1, "inflight_total": 0}
        thread.join(5)
        assert held[0].status_code == 409 and held[0].json()["error"]["code"] == "stale_attempt"
        assert "retry-after" not in held[0].headers
