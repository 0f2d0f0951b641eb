"""The agent checkpoint side (gymkit.agent_control) over real HTTP: a toy whitebox agent whose
``/run`` turn loop uses :class:`AgentExecutions`, served by uvicorn on 127.0.0.1 in the test's own
event loop, so the test holds rollouts mid-turn and reads the registry directly.

Every route of CONTROL.md §4 "Agent checkpoint" is called; the §9 example (prepare timing out,
the ``blocking_attempts`` shape, retire, conflict, discard) is replayed; receipts are recomputed
here from the result with hashlib and json; the committed files are rebuilt here byte for byte.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import io
import json
import shutil
import tarfile
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gymkit import agent_control
from gymkit.agent_control import (
    AGENT_FEATURES,
    AgentExecutions,
    AgentParticipant,
    agent_router,
    result_receipt_fields,
    whitebox_agent_declaration,
)
from gymkit.control_http import error_response
from gymkit.fence import ControlError, Fence
from schemas.control import CONTROL_PREFIX, UNAUTHORIZED_DETAIL, Capabilities, CompletionReceipt
from schemas.gym_files import AgentBoundaryRecord
from tests.gymkit.asgi_serving import run_async, serving_app
from tests.gymkit.collector_probe import collector_state_at_calls

TOKEN = "secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NAME = "whitebox-agent"
INSTANCE = f"agent/instance-{hashlib.sha256(NAME.encode()).hexdigest()}"
CREATED = 1700000000.25
P = f"{CONTROL_PREFIX}/agent-checkpoint"


class ToyAgent(AgentParticipant):
    """A whitebox agent: each turn waits for a token from the test (its "model call"), then
    records a boundary; a finished run completes with an ``id``'d result."""

    def __init__(self, name: str = NAME) -> None:
        self.name = name
        self.tokens: dict[str, asyncio.Semaphore] = {}
        self.events: list[tuple[Any, ...]] = []
        self.collector_on: list[bool] = []  # gc.isenabled() at each on_restore

    def declaration(self) -> Capabilities:
        return whitebox_agent_declaration(self.name)

    def sem(self, rid: str) -> asyncio.Semaphore:
        return self.tokens.setdefault(rid, asyncio.Semaphore(0))

    def allow(self, rid: str, turns: int = 1) -> None:
        for _ in range(turns):
            self.sem(rid).release()

    async def on_restore(self, records: list[AgentBoundaryRecord]) -> None:
        self.events.append(("restore", sorted((r.rollout_id, r.attempt_index) for r in records)))
        self.collector_on.append(gc.isenabled())

    async def on_discard(self, rollout_id: str, attempt_index: int) -> None:
        self.events.append(("discard", rollout_id, attempt_index))

    async def on_retire(self, rollout_id: str, attempt_index: int) -> None:
        self.events.append(("retire", rollout_id, attempt_index))

    async def on_resume(self) -> None:
        self.events.append(("resume",))


class Server:
    def __init__(self, name: str = NAME) -> None:
        self.agent = ToyAgent(name)
        self.executions = AgentExecutions()
        self.fence = Fence()
        self.app = FastAPI()
        self.app.include_router(agent_router(self.agent, self.executions, self.fence, TOKEN))
        ex_reg, agent = self.executions, self.agent

        @self.app.post("/run")
        async def run(request: Request) -> Any:
            body = await request.json()
            rid, n, turns = body["rollout_id"], body["attempt_index"], body.get("turns", 2)
            try:
                async with ex_reg.run(rid, n) as ex:
                    if ex.state == "completed":
                        return JSONResponse({"result": ex.result, "replay": True})
                    start = ex.continuation.boundary_index + 1 if ex.continuation is not None else 0
                    for turn in range(start, turns):
                        await agent.sem(rid).acquire()
                        key = rid if n == 0 else f"{rid}-a{n}"
                        await ex_reg.at_boundary(rid, n, AgentBoundaryRecord(
                            rollout_id=rid, attempt_index=n, boundary_index=turn,
                            output_items=[{"turn": turn, "by": key}], last_committed_model_call_id=f"{key}-call-{turn}",
                            resource_state_revisions={"tools": turn + 1}, agent_state={"start": start},
                            created_at=CREATED))
                    result = {"id": f"resp-{rid}-{n}", "turns": turns, "start": start, "text": "d\u00e9j\u00e0"}
                    ex_reg.complete(rid, n, result)
                    return JSONResponse({"result": result, "replay": False})
            except ControlError as exc:
                return error_response(exc)


def serving(server: Server) -> AbstractAsyncContextManager[httpx.AsyncClient]:
    return serving_app(server.app)


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def state_of(server: Server, rid: str, n: int) -> str | None:
    ex = server.executions.get(rid, n)
    return None if ex is None else ex.state


def body(cid: str, deadline: float | None = None, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 5 if deadline is None else deadline, **extra}


def expect_error(r: httpx.Response, code: str, status: int = 409) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"code", "detail"} and err["code"] == code, r.text


def receipt_of(result: dict[str, Any], rid: str, n: int, generation: int = 1) -> dict[str, Any]:
    """Recomputed here, from the formula of CONTROL.md §7."""
    digest = hashlib.sha256(json.dumps(result, sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=True).encode("utf-8")).hexdigest()
    return {"rollout_id": rid, "attempt_index": n, "execution_generation": generation,
            "result_identity": str(result["id"]) if "id" in result else digest, "result_digest": digest}


# -- capabilities, transport -----------------------------------------------------------------------------
def test_capabilities_and_transport_rules() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            r = await c.get(f"{CONTROL_PREFIX}/capabilities")  # no token
            assert r.status_code == 200
            assert r.json() == {
                "component": "responses_api_agents", "name": NAME, "schema_version": 1,
                "admission_states": ["accepting"], "checkpoint_mode": "export_restore",
                "concurrency_contract": "serialized_per_session",
                "multi_process": {"mode": "single_worker", "num_workers": 1}, "instance_role": None,
                "features": ["completed_result_acknowledgement", "agent_continuation_index_v1",
                             "discard_restored_continuation_v1", "agent_resource_dependency_index_v1"],
                "phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
            assert tuple(r.json()["features"]) == AGENT_FEATURES
            # 401 is FastAPI's body, not the envelope; the scheme is case-sensitive
            for headers in ({}, {"authorization": f"bearer {TOKEN}"}, {"authorization": f"Bearer {TOKEN}x"}, {"authorization": TOKEN}):
                r = await c.post(f"{P}/prepare", json=body("c1"), headers=headers)
                assert r.status_code == 401 and r.json() == {"detail": UNAUTHORIZED_DETAIL}
            r = await c.get(f"{P}/status", params={"checkpoint_id": "c1"})
            assert r.status_code == 401
            # 422 before auth: malformed, unknown field, bad id, non-finite deadline, missing query
            for bad in (b'{"checkpoint_id":"c1"}', b'{"checkpoint_id":"c1","deadline_ts":1e400}',
                        b'{"checkpoint_id":"-x","deadline_ts":1}', b'{"checkpoint_id":"c1","deadline_ts":1,"x":1}',
                        b'{"checkpoint_id":"c1","deadline_ts":1,"schema_version":2}', b"not json"):
                r = await c.post(f"{P}/prepare", content=bad, headers={"content-type": "application/json"})
                assert r.status_code == 422 and isinstance(r.json()["detail"], list), (bad, r.text)
            r = await c.get(f"{P}/status")
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "query"
            r = await c.get(f"{P}/completion-receipt", params={"rollout_id": "r", "attempt_index": -1})
            assert r.status_code == 422
            r = await c.post(f"{P}/retire", json=body("c1", rollout_id="r"), headers=AUTH)
            assert r.status_code == 422  # attempt_index required
            # wrong method on a known path; no 404 but for unknown paths
            assert (await c.get(f"{P}/prepare", headers=AUTH)).status_code == 405
            assert (await c.post(f"{P}/status", headers=AUTH)).status_code == 405
            assert (await c.post(f"{P}/nope", json=body("c1"), headers=AUTH)).status_code == 404
            assert s.fence.phase == "idle"
    run_async(main)


# -- the reference's example (§9, with the §13 correction) -----------------------------------------------
def test_reference_example_prepare_times_out_status_retire_conflict() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            run = asyncio.create_task(c.post("/run", json={"rollout_id": "rollout-a", "attempt_index": 0}))
            await until(lambda: state_of(s, "rollout-a", 0) == "running", "rollout-a to run")
            t0 = time.time()
            r = await c.post(f"{P}/prepare", json=body("checkpoint-1", time.time() + 0.01), headers=AUTH)
            expect_error(r, "agent_prepare_incomplete")
            assert "running=1" in r.json()["error"]["detail"]
            assert time.time() - t0 < 2
            # back to idle with no active id; agent admission stays closed
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("idle", None)
            assert not s.executions.accepting
            r = await c.post("/run", json={"rollout_id": "rollout-b", "attempt_index": 0})
            expect_error(r, "agent_admission_closed")
            r = await c.get(f"{P}/status", params={"checkpoint_id": "checkpoint-1"}, headers=AUTH)
            assert r.status_code == 200
            st = r.json()
            blocking = st["blocking_attempts"]
            assert isinstance(blocking[0].pop("age_seconds"), float)
            assert blocking == [{"rollout_id": "rollout-a", "attempt_index": 0, "generation": 1, "state": "running",
                                 "parked_boundary_state": None, "boundary_index": None, "turn_index": None,
                                 "boundary_kind": None, "resource_state_revisions": {}}]
            assert st["checkpoint_id"] == "checkpoint-1" and st["state"] == "preparing"
            assert (st["ready_to_commit"], st["running"], st["active"]) == (False, 1, 1)
            r = await c.post(f"{P}/retire", headers=AUTH, json=body(
                "checkpoint-1", time.time() + 2, rollout_id="rollout-a", attempt_index=0))
            assert r.status_code == 200 and r.json() == {"retired": True, "tombstoned": True}
            assert (await run).status_code == 500  # its /run was cancelled
            assert s.agent.events == [("retire", "rollout-a", 0)]
            # §13: the fence is idle with no active id, so another id is not a conflict yet
            r = await c.get(f"{P}/status", params={"checkpoint_id": "checkpoint-2"}, headers=AUTH)
            assert r.status_code == 200
            # a prepare with nothing running succeeds; now checkpoint-1 is active
            r = await c.post(f"{P}/prepare", json=body("checkpoint-1"), headers=AUTH)
            assert r.status_code == 200 and r.json()["ready_to_commit"] is True
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("prepared", "checkpoint-1")
            r = await c.get(f"{P}/status", params={"checkpoint_id": "checkpoint-2"}, headers=AUTH)
            expect_error(r, "checkpoint_conflict")
            # the retired attempt is stale forever
            r = await c.post(f"{P}/resume", json=body("checkpoint-1"), headers=AUTH)
            assert r.json() == {"state": "accepting", "released": 0}
            r = await c.post("/run", json={"rollout_id": "rollout-a", "attempt_index": 0})
            expect_error(r, "stale_attempt")
    run_async(main)


def test_prepare_waits_until_nothing_runs_and_not_past_deadline() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            runs = [asyncio.create_task(c.post("/run", json={"rollout_id": rid, "attempt_index": 0, "turns": 3}))
                    for rid in ("r1", "r2")]
            await until(lambda: state_of(s, "r1", 0) == state_of(s, "r2", 0) == "running", "both running")
            prep = asyncio.create_task(c.post(f"{P}/prepare", json=body("ck"), headers=AUTH))
            await until(lambda: s.fence.phase == "preparing", "preparing")
            await until(lambda: state_of(s, "r1", 0) == "park_requested", "park requested")
            # while preparing: another id conflicts; the phase is visible in capabilities
            r = await c.get(f"{P}/status", params={"checkpoint_id": "other"}, headers=AUTH)
            expect_error(r, "checkpoint_conflict")
            caps = (await c.get(f"{CONTROL_PREFIX}/capabilities")).json()
            assert (caps["phase"], caps["active_checkpoint_id"]) == ("preparing", "ck")
            s.agent.allow("r1")
            await until(lambda: state_of(s, "r1", 0) == "parked", "r1 parked")
            assert not prep.done()
            s.agent.allow("r2")
            t0 = time.monotonic()
            r = await prep
            assert time.monotonic() - t0 < 2  # answered once nothing ran, not at the 5 s deadline
            assert r.status_code == 200
            st = r.json()
            assert "checkpoint_id" not in st
            assert (st["state"], st["ready_to_commit"], st["parked"], st["parked_with_boundary"]) == (
                "preparing", True, 2, 2)
            assert st["selected_boundaries"] == [
                {"rollout_id": rid, "attempt_index": 0, "boundary_index": 0, "turn_index": 0,
                 "boundary_kind": "turn_complete", "resource_state_revisions": {"tools": 1}} for rid in ("r1", "r2")]
            # replay: the recorded answer
            assert (await c.post(f"{P}/prepare", json=body("ck"), headers=AUTH)).json() == st
            r = await c.post(f"{P}/resume", json=body("ck"), headers=AUTH)
            assert r.json() == {"state": "accepting", "released": 2}
            s.agent.allow("r1", 2)
            s.agent.allow("r2", 2)
            for t in runs:
                assert (await t).json()["result"]["turns"] == 3
    run_async(main)


def test_prepare_answers_at_once_when_only_unackable_blockers_remain() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            s.agent.allow("done", 1)
            r = await c.post("/run", json={"rollout_id": "done", "attempt_index": 0, "turns": 1})
            result = r.json()["result"]
            # a parked execution without a boundary (its loop parked before any turn end)
            s.executions.begin("pw", 0, task=None)
            s.executions.request_park()  # admission closed, pw asked to park
            parked = asyncio.create_task(s.executions.park("pw", 0))
            await until(lambda: state_of(s, "pw", 0) == "parked", "pw parked")
            t0 = time.monotonic()
            r = await c.post(f"{P}/prepare", json=body("ck", time.time() + 30), headers=AUTH)
            assert time.monotonic() - t0 < 2
            expect_error(r, "agent_prepare_incomplete")
            assert "parked_without_boundary=1" in r.json()["error"]["detail"]
            assert "completed_unacknowledged=1" in r.json()["error"]["detail"]
            st = (await c.get(f"{P}/status", params={"checkpoint_id": "ck"}, headers=AUTH)).json()
            assert (st["parked_without_boundary"], st["completed_unacknowledged"], st["running"]) == (1, 1, 0)
            pw = next(e for e in st["executions"] if e["rollout_id"] == "pw")
            assert (pw["state"], pw["parked_boundary_state"]) == ("parked", "parked_without_boundary")
            done = st["completed_unacknowledged_attempts"]
            assert [e["completion_receipt"] for e in done] == [receipt_of(result, "done", 0)]
            assert done[0]["state"] == "completed"
            # retire the parked one (its park raises stale_attempt), acknowledge the completed one
            r = await c.post(f"{P}/retire", json=body("ck", rollout_id="pw", attempt_index=0), headers=AUTH)
            assert r.json() == {"retired": True, "tombstoned": True}
            with pytest.raises(asyncio.CancelledError):  # retire cancels the task parked in it
                await parked
            r = await c.post(f"{P}/acknowledge", json=receipt_of(result, "done", 0), headers=AUTH)
            assert r.json() == {"acknowledged": True, "idempotent": False}
            r = await c.post(f"{P}/prepare", json=body("ck"), headers=AUTH)
            assert r.status_code == 200 and r.json()["ready_to_commit"] is True
            assert r.json()["acknowledged_completed"] == 1
    run_async(main)


# -- receipts and acknowledgements (§7) ----------------------------------------------------------------------
def test_completion_receipts_and_acknowledgements() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            results = {}
            for rid in ("a", "b", "c"):
                s.agent.allow(rid)
                r = await c.post("/run", json={"rollout_id": rid, "attempt_index": 0, "turns": 1})
                results[rid] = r.json()["result"]
            # the receipt, recomputed independently
            r = await c.get(f"{P}/completion-receipt", params={"rollout_id": "a", "attempt_index": "0"}, headers=AUTH)
            assert r.status_code == 200 and r.json() == receipt_of(results["a"], "a", 0)
            assert r.json()["result_identity"] == "resp-a-0"
            expect_error(await c.get(f"{P}/completion-receipt", params={"rollout_id": "zz", "attempt_index": 0},
                                     headers=AUTH), "completed_execution_acknowledgement_error")
            # a repeated /run of a completed attempt answers the retained result, nothing reruns
            r = await c.post("/run", json={"rollout_id": "a", "attempt_index": 0, "turns": 1})
            assert r.json() == {"result": results["a"], "replay": True}
            # wrong generation / identity / digest: 409, nothing released
            good = receipt_of(results["a"], "a", 0)
            for bad in ({**good, "execution_generation": 2}, {**good, "result_identity": "other"},
                        {**good, "result_digest": "0" * 64}):
                expect_error(await c.post(f"{P}/acknowledge", json=bad, headers=AUTH),
                             "completed_execution_acknowledgement_error")
            # 422: unknown field, empty batch, duplicate, extra field in a receipt; schema_version may be left out
            assert (await c.post(f"{P}/acknowledge", json={**good, "x": 1}, headers=AUTH)).status_code == 422
            for batch in ({"executions": []}, {"executions": [good, good]}, {"executions": [good], "extra": 1},
                          {"executions": [{**good, "x": 1}]}, {"schema_version": 2, "executions": [good]}):
                r = await c.post(f"{P}/acknowledge-completed", json=batch)  # 422 even without a token
                assert r.status_code == 422, (batch, r.text)
            # a batch with one bad receipt releases nothing
            rb, rc = receipt_of(results["b"], "b", 0), receipt_of(results["c"], "c", 0)
            r = await c.post(f"{P}/acknowledge-completed", headers=AUTH,
                             json={"executions": [rb, {**rc, "result_digest": "f" * 64}]})
            expect_error(r, "completed_execution_acknowledgement_error")
            assert state_of(s, "b", 0) == state_of(s, "c", 0) == "completed"
            r = await c.post(f"{P}/acknowledge-completed", headers=AUTH, json={"executions": [rb, rc]})
            assert r.status_code == 200 and r.json() == {"acknowledged": [rb, rc]}
            r = await c.post(f"{P}/acknowledge-completed", headers=AUTH,
                             json={"schema_version": 1, "executions": [rb, good]})
            assert r.json() == {"acknowledged": [rb, good]}  # b again (idempotent), a now
            r = await c.post(f"{P}/acknowledge", json=good, headers=AUTH)
            assert r.json() == {"acknowledged": True, "idempotent": True}
            # a repeat must still match what was acknowledged
            expect_error(await c.post(f"{P}/acknowledge", json={**good, "result_identity": "x"}, headers=AUTH),
                         "completed_execution_acknowledgement_error")
            expect_error(await c.get(f"{P}/completion-receipt", params={"rollout_id": "a", "attempt_index": 0},
                                     headers=AUTH), "completed_execution_acknowledgement_error")
            expect_error(await c.post("/run", json={"rollout_id": "a", "attempt_index": 0}), "stale_attempt")
            st = (await c.get(f"{P}/status", params={"checkpoint_id": "x"}, headers=AUTH)).json()
            assert (st["acknowledged_completed"], st["completed_unacknowledged"], st["executions"]) == (3, 0, [])
    run_async(main)


def test_receipt_fields_formula() -> None:
    res = {"response": {"id": 42}, "x": [1.5, "\u00e9"]}
    digest = hashlib.sha256(b'{"response":{"id":42},"x":[1.5,"\\u00e9"]}').hexdigest()
    assert result_receipt_fields(res) == ("42", digest)
    no_id = {"output": "z"}
    d2 = hashlib.sha256(b'{"output":"z"}').hexdigest()
    assert result_receipt_fields(no_id) == (d2, d2)
    assert result_receipt_fields({"id": "", "response": {"id": "r"}})[0] != "r"  # "id" present: no fallback to response
    assert result_receipt_fields([1, 2])[0] == hashlib.sha256(b"[1,2]").hexdigest()


# -- commit, files, restore, discard ------------------------------------------------------------------------
def expected_member(rid: str, n: int, turn: int, start: int = 0) -> bytes:
    key = rid if n == 0 else f"{rid}-a{n}"
    record = {"schema_version": 2, "rollout_id": rid, "attempt_index": n, "boundary_index": turn, "turn_index": turn,
              "boundary_kind": "turn_complete", "pending_model": None, "output_items": [{"turn": turn, "by": key}],
              "usage": None, "last_committed_model_call_id": f"{key}-call-{turn}",
              "resource_state_revisions": {"tools": turn + 1}, "agent_state": {"start": start}, "created_at": CREATED}
    return json.dumps(record, indent=2).encode()


def ref(rel: str, data: bytes, records: int) -> dict[str, Any]:
    return {"schema_version": 1, "relative_path": rel, "sha256": hashlib.sha256(data).hexdigest(), "records": records,
            "bytes": len(data)}


async def park_all(s: Server, c: httpx.AsyncClient, cid: str, rollouts: dict[str, int]) -> list[asyncio.Task]:
    """Start each rollout (rid -> k), let it finish k turns (boundaries 0..k-1), then prepare ``cid``
    while each is inside turn k: each parks at boundary k (its last call ``<key>-call-<k>``)."""
    tasks = [asyncio.create_task(c.post("/run", json={"rollout_id": rid, "attempt_index": 0, "turns": 4}))
             for rid in rollouts]
    for rid, k in rollouts.items():
        s.agent.allow(rid, k)

    def at_turn(rid: str, k: int) -> bool:
        ex = s.executions.get(rid, 0)
        return ex is not None and ex.state == "running" and (
            ex.boundary.boundary_index if ex.boundary is not None else -1) == k - 1
    await until(lambda: all(at_turn(rid, k) for rid, k in rollouts.items()), "rollouts inside their turn")
    prep = asyncio.create_task(c.post(f"{P}/prepare", json=body(cid), headers=AUTH))
    await until(lambda: all(state_of(s, rid, 0) == "park_requested" for rid in rollouts), "park requested")
    for rid in rollouts:
        s.agent.allow(rid)
    r = await prep
    assert r.status_code == 200 and r.json()["ready_to_commit"], r.text
    return tasks


def test_commit_writes_gym_files_byte_exact_and_replays(tmp_path: Path) -> None:
    async def main() -> None:
        s = Server()
        ckdir = tmp_path / "gym"
        async with serving(s) as c:
            runs = await park_all(s, c, "ck-1", {"p7_g2": 2, "group-7_g0": 1})
            req = body("ck-1", checkpoint_dir=str(ckdir))
            r = await c.post(f"{P}/commit", json=req, headers=AUTH)
            assert r.status_code == 200, r.text
            answer = r.json()
            folder = ckdir / INSTANCE
            assert sorted(p.name for p in folder.iterdir()) == [
                "agent-index.jsonl", "agent-part-000000.tar", "continuations.jsonl", "manifest.json"]
            # the continuation index: compact lines, no spaces, sorted by (capture_key, call id)
            cont = (b'{"schema_version":1,"rollout_id":"group-7_g0","attempt_index":0,"capture_key":"group-7_g0",'
                    b'"last_committed_model_call_id":"group-7_g0-call-1","resource_state_revisions":{"tools":2}}\n'
                    b'{"schema_version":1,"rollout_id":"p7_g2","attempt_index":0,"capture_key":"p7_g2",'
                    b'"last_committed_model_call_id":"p7_g2-call-2","resource_state_revisions":{"tools":3}}\n')
            assert (folder / "continuations.jsonl").read_bytes() == cont
            # archive members <rid>.a<n>.json, indent 2, sorted by (rid, n); fixed headers
            members = {"group-7_g0.a0.json": expected_member("group-7_g0", 0, 1),
                       "p7_g2.a0.json": expected_member("p7_g2", 0, 2)}
            tar_bytes = (folder / "agent-part-000000.tar").read_bytes()
            with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
                infos = tf.getmembers()
                assert [i.name for i in infos] == sorted(members)
                for i in infos:
                    assert (i.mode, i.mtime, i.uid, i.gid, i.uname, i.gname) == (0o600, 0, 0, 0, "", "")
                    assert tf.extractfile(i).read() == members[i.name]  # type: ignore[union-attr]
            index = b"".join(json.dumps({
                "rollout_id": name.split(".a")[0], "attempt_index": 0, "archive": "agent-part-000000.tar",
                "member": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)},
                separators=(",", ":")).encode() + b"\n" for name, data in sorted(members.items()))
            assert (folder / "agent-index.jsonl").read_bytes() == index
            manifest = {
                "schema_version": 2, "checkpoint_id": "ck-1", "instance_name": NAME,
                "archives": [{"name": "agent-part-000000.tar", "sha256": hashlib.sha256(tar_bytes).hexdigest(),
                              "members": 2, "bytes": len(tar_bytes)}],
                "record_index": ref(f"{INSTANCE}/agent-index.jsonl", index, 2), "records": 2,
                "continuation_index": ref(f"{INSTANCE}/continuations.jsonl", cont, 2)}
            manifest_bytes = json.dumps(manifest, sort_keys=True, indent=2).encode()
            assert (folder / "manifest.json").read_bytes() == manifest_bytes
            assert answer == {"records": 2, "manifest_digest": hashlib.sha256(manifest_bytes).hexdigest(),
                              "continuation_index": ref(f"{INSTANCE}/continuations.jsonl", cont, 2)}
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("committed_paused", "ck-1")
            # replay of (ck-1, commit); another id conflicts; commit is only from prepared
            assert (await c.post(f"{P}/commit", json=req, headers=AUTH)).json() == answer
            expect_error(await c.post(f"{P}/commit", json={**req, "checkpoint_id": "ck-2"}, headers=AUTH),
                         "checkpoint_conflict")
            r = await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH)
            assert r.status_code == 200 and r.json()["ready_to_commit"]  # a repeat replays its recorded answer
            expect_error(await c.post(f"{P}/retire", json=body("ck-1", rollout_id="x", attempt_index=0),
                                      headers=AUTH), "invalid_phase")
            expect_error(await c.post(f"{P}/restore", json=req, headers=AUTH), "invalid_phase")  # only from idle
            # resume retires the id: only the resume replays
            r = await c.post(f"{P}/resume", json=body("ck-1"), headers=AUTH)
            assert r.json() == {"state": "accepting", "released": 2}
            assert (await c.post(f"{P}/resume", json=body("ck-1"), headers=AUTH)).json() == r.json()
            expect_error(await c.post(f"{P}/commit", json=req, headers=AUTH), "stale_checkpoint")
            expect_error(await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH), "stale_checkpoint")
            expect_error(await c.get(f"{P}/status", params={"checkpoint_id": "ck-1"}, headers=AUTH),
                         "stale_checkpoint")
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("idle", None)
            s.agent.allow("p7_g2", 2)
            s.agent.allow("group-7_g0", 3)
            assert [(await t).status_code for t in runs] == [200, 200]
            # a resume with a fresh id from idle is allowed (and retires it)
            r = await c.post(f"{P}/resume", json=body("fresh"), headers=AUTH)
            assert r.json() == {"state": "accepting", "released": 0}
        # a new process committing the same checkpoint finds its own manifest: same answer, no write
        before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
        s2 = Server()
        async with serving(s2) as c:
            assert (await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH)).status_code == 200
            assert (await c.post(f"{P}/commit", json=req, headers=AUTH)).json() == answer
            assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()} == before
        # ... but not a manifest of another checkpoint
        s3 = Server()
        async with serving(s3) as c:
            assert (await c.post(f"{P}/prepare", json=body("ck-9"), headers=AUTH)).status_code == 200
            r = await c.post(f"{P}/commit", json={**req, "checkpoint_id": "ck-9"}, headers=AUTH)
            expect_error(r, "agent_checkpoint_error")
            assert "ck-1" in r.json()["error"]["detail"]
            assert s3.fence.phase == "prepared"  # a failed commit goes back to its entry phase
    run_async(main)


def test_the_commit_copies_each_boundarys_bytes_encoded_when_it_was_recorded(tmp_path: Path, monkeypatch) -> None:
    """Each boundary is encoded once, when it is recorded: the commit (inside the pause) encodes no
    record, and its members are those bytes; a record no longer an execution's boundary is encoded
    afresh."""
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            runs = await park_all(s, c, "ck-1", {"a": 2, "b": 1})
            real = agent_control.record_json
            encoded: list[AgentBoundaryRecord] = []

            def counting(rec: AgentBoundaryRecord) -> bytes:
                encoded.append(rec)
                return real(rec)

            monkeypatch.setattr(agent_control, "record_json", counting)
            r = await c.post(f"{P}/commit", json=body("ck-1", checkpoint_dir=str(tmp_path / "gym")), headers=AUTH)
            assert r.status_code == 200, r.text
            assert encoded == []
            with tarfile.open(tmp_path / "gym" / INSTANCE / "agent-part-000000.tar") as tf:
                members = {i.name: tf.extractfile(i).read() for i in tf.getmembers()}  # type: ignore[union-attr]
            for rid, turn in (("a", 2), ("b", 1)):
                ex = s.executions.get(rid, 0)
                assert ex is not None and ex.boundary is not None
                assert members[f"{rid}.a0.json"] == ex.boundary_json == real(ex.boundary) == expected_member(rid, 0, turn)
                assert s.executions.member_json(ex.boundary) is ex.boundary_json
            stale = msgspec.structs.replace(s.executions.get("a", 0).boundary, boundary_index=1)  # type: ignore[arg-type]
            assert s.executions.member_json(stale) == real(stale) and encoded == [stale]
            assert (await c.post(f"{P}/resume", json=body("ck-1"), headers=AUTH)).status_code == 200
            for rid in ("a", "b"):
                s.agent.allow(rid, 4)
            assert [(await t).status_code for t in runs] == [200, 200]
    run_async(main)


def test_restore_continues_as_next_attempt_and_discard(tmp_path: Path, monkeypatch) -> None:
    commits_collector_on = collector_state_at_calls(monkeypatch, agent_control, "commit_agent_checkpoint")

    async def main() -> None:
        ckdir = tmp_path / "gym"
        s = Server()
        async with serving(s) as c:
            runs = await park_all(s, c, "save-1", {"rollout-a": 1, "rollout-b": 2})
            r = await c.post(f"{P}/commit", json=body("save-1", checkpoint_dir=str(ckdir)), headers=AUTH)
            committed = r.json()
            # The commit (on a worker thread) ran with the cyclic collector held off; the fence holds it
            # off until the resume, and a commit freezes nothing.
            assert commits_collector_on == [False] and not gc.isenabled()
            assert (await c.post(f"{P}/resume", json=body("save-1"), headers=AUTH)).status_code == 200
            assert gc.isenabled() and gc.get_freeze_count() == 0
            for t in runs:
                t.cancel()
        # a fresh process restores
        s = Server()
        async with serving(s) as c:
            s.executions.begin("rollout-c", 1, task=None)  # an execution that already runs attempt 1 of c
            req = body("restore-1", checkpoint_dir=str(ckdir))
            r = await c.post(f"{P}/restore", json=req, headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json() == {"records": 2, "source_checkpoint_id": "save-1",
                                "continuation_index": committed["continuation_index"]}
            assert s.agent.events == [("restore", [("rollout-a", 0), ("rollout-b", 0)])]
            # The restore ran with the collector held off, and the fence holds it off until the resume,
            # which freezes what the restore left alive (gymkit.collector).
            assert s.agent.collector_on == [False] and not gc.isenabled() and gc.get_freeze_count() == 0
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("restored_paused", "restore-1")
            assert (await c.post(f"{P}/restore", json=req, headers=AUTH)).json() == r.json()  # replay
            expect_error(await c.post(f"{P}/restore", json={**req, "checkpoint_id": "restore-2"}, headers=AUTH),
                         "checkpoint_conflict")
            expect_error(await c.post(f"{P}/prepare", json=body("restore-1"), headers=AUTH), "invalid_phase")
            # admission closed until resume; the source attempts are tombstoned
            expect_error(await c.post("/run", json={"rollout_id": "rollout-a", "attempt_index": 1}),
                         "agent_admission_closed")
            # discard names the replacement attempt (source + 1)
            r = await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "restore-1", time.time() + 2, rollout_id="rollout-b", attempt_index=1))
            assert r.status_code == 200 and r.json() == {"discarded": True}
            r = await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "restore-1", rollout_id="rollout-b", attempt_index=1))
            assert r.json() == {"discarded": False}
            r = await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "restore-1", rollout_id="rollout-a", attempt_index=0))
            assert r.json() == {"discarded": False}  # the source attempt is not a continuation
            expect_error(await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "restore-1", rollout_id="rollout-c", attempt_index=1)), "duplicate_execution")
            expect_error(await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "other", rollout_id="rollout-b", attempt_index=1)), "checkpoint_conflict")
            expect_error(await c.post(f"{P}/retire", headers=AUTH, json=body(
                "restore-1", rollout_id="rollout-a", attempt_index=1)), "invalid_phase")
            assert s.agent.events[-1] == ("discard", "rollout-b", 1)
            r = await c.post(f"{P}/resume", json=body("restore-1"), headers=AUTH)
            assert r.json() == {"state": "accepting", "released": 0}
            assert gc.isenabled() and gc.get_freeze_count() > 0
            expect_error(await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "restore-1", rollout_id="rollout-b", attempt_index=1)), "stale_checkpoint")
            expect_error(await c.post("/run", json={"rollout_id": "rollout-a", "attempt_index": 0}), "stale_attempt")
            # rollout-a continues after its boundary (turn 0) as attempt 1; rollout-b starts over
            s.agent.allow("rollout-a", 3)
            s.agent.allow("rollout-b", 4)
            ra = await c.post("/run", json={"rollout_id": "rollout-a", "attempt_index": 1, "turns": 4})
            rb = await c.post("/run", json={"rollout_id": "rollout-b", "attempt_index": 1, "turns": 4})
            assert ra.json()["result"]["start"] == 2 and rb.json()["result"]["start"] == 0
            assert s.executions.get("rollout-a", 1).generation == 1  # type: ignore[union-attr]
    run_async(main)


def test_restore_refuses_corrupt_or_missing_files(tmp_path: Path) -> None:
    async def main() -> None:
        ckdir = tmp_path / "gym"
        s = Server()
        async with serving(s) as c:
            runs = await park_all(s, c, "save-1", {"r": 1})
            assert (await c.post(f"{P}/commit", json=body("save-1", checkpoint_dir=str(ckdir)),
                                 headers=AUTH)).status_code == 200
            runs[0].cancel()
        for mangle, words in (
                (lambda f: (f / "continuations.jsonl").write_bytes(b'{"schema_version": 1}\n'), "continuations"),
                (lambda f: (f / "agent-part-000000.tar").write_bytes(b"x" * 10), "agent-part-000000.tar"),
                (lambda f: (f / "manifest.json").unlink(), "manifest")):
            work = tmp_path / f"copy-{words}"
            shutil.copytree(ckdir, work)
            mangle(work / INSTANCE)
            s = Server()
            async with serving(s) as c:
                r = await c.post(f"{P}/restore", json=body("restore-1", checkpoint_dir=str(work)), headers=AUTH)
                expect_error(r, "agent_checkpoint_error")
                assert words in r.json()["error"]["detail"], r.text
                assert (s.fence.phase, s.fence.active_checkpoint_id) == ("idle", None)
                assert s.executions.accepting and s.agent.events == []
        # another agent instance's name does not find this folder
        s = Server("other-agent")
        async with serving(s) as c:
            expect_error(await c.post(f"{P}/restore", json=body("r", checkpoint_dir=str(ckdir)), headers=AUTH),
                         "agent_checkpoint_error")
    run_async(main)


def test_retire_answers_and_phase_rules() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            s.agent.allow("done")
            await c.post("/run", json={"rollout_id": "done", "attempt_index": 0, "turns": 1})
            r = await c.post(f"{P}/retire", json=body("c", rollout_id="done", attempt_index=0), headers=AUTH)
            assert r.json() == {"retired": False, "tombstoned": False, "completed_unacknowledged": True}
            assert state_of(s, "done", 0) == "completed"
            r = await c.post(f"{P}/retire", json=body("c", rollout_id="never", attempt_index=3), headers=AUTH)
            assert r.json() == {"retired": False, "tombstoned": True}
            expect_error(await c.post("/run", json={"rollout_id": "never", "attempt_index": 3}), "stale_attempt")
            # discard is only in restored_paused; status any phase
            expect_error(await c.post(f"{P}/discard-restored-continuation", headers=AUTH, json=body(
                "c", rollout_id="x", attempt_index=1)), "invalid_phase")
            # a running /run of the same attempt is a duplicate
            run = asyncio.create_task(c.post("/run", json={"rollout_id": "dup", "attempt_index": 0}))
            await until(lambda: state_of(s, "dup", 0) == "running", "dup running")
            expect_error(await c.post("/run", json={"rollout_id": "dup", "attempt_index": 0}), "duplicate_execution")
            s.agent.allow("dup", 2)
            assert (await run).status_code == 200
            assert s.fence.phase == "idle" and s.fence.active_checkpoint_id is None
    run_async(main)


def test_resume_during_prepare_releases_and_fails_the_prepare() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            run = asyncio.create_task(c.post("/run", json={"rollout_id": "r", "attempt_index": 0, "turns": 1}))
            await until(lambda: state_of(s, "r", 0) == "running", "running")
            prep = asyncio.create_task(c.post(f"{P}/prepare", json=body("ck", time.time() + 30), headers=AUTH))
            await until(lambda: state_of(s, "r", 0) == "park_requested", "park requested")
            r = await c.post(f"{P}/resume", json=body("ck"), headers=AUTH)
            assert r.json() == {"state": "accepting", "released": 0}
            t0 = time.monotonic()
            r = await prep
            assert time.monotonic() - t0 < 5
            assert r.status_code == 409 and r.json()["error"]["code"] in ("stale_checkpoint", "agent_prepare_incomplete")
            assert state_of(s, "r", 0) == "running" and s.executions.accepting
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("idle", None)
            s.agent.allow("r")
            assert (await run).status_code == 200
    run_async(main)


# -- the registry alone ----------------------------------------------------------------------------------------
def test_registry_rules() -> None:
    async def main() -> None:
        ex = AgentExecutions()
        e = ex.begin("r", 0, task=None)
        assert (e.generation, e.state, e.continuation) == (1, "running", None)
        rec = AgentBoundaryRecord(rollout_id="r", attempt_index=0, boundary_index=1)
        ex.record_boundary("r", 0, rec)
        assert e.boundary is not None and e.boundary.turn_index == 1 and e.boundary.created_at > 0
        first = e.boundary
        ex.record_boundary("r", 0, e.boundary)  # the same again: nothing
        ex.record_boundary("r", 0, rec)  # the same with a defaulted created_at: nothing either
        assert e.boundary is first
        with pytest.raises(ControlError, match="must increase"):
            ex.record_boundary("r", 0, msgspec.structs.replace(rec, output_items=[{"other": 1}]))
        with pytest.raises(ControlError, match="must increase"):
            ex.record_boundary("r", 0, msgspec.structs.replace(first, created_at=first.created_at + 1))
        with pytest.raises(ControlError, match="must increase") as err:
            ex.record_boundary("r", 0, AgentBoundaryRecord(rollout_id="r", attempt_index=0, boundary_index=0))
        assert err.value.code == "agent_checkpoint_error"
        with pytest.raises(ControlError) as err:
            ex.record_boundary("r", 0, AgentBoundaryRecord(rollout_id="q", attempt_index=0, boundary_index=5))
        assert err.value.code == "agent_checkpoint_error"
        with pytest.raises(ControlError) as err:
            ex.record_boundary("nobody", 0, rec)
        assert err.value.code == "stale_attempt"
        receipt = ex.complete("r", 0, {"id": 7})
        assert receipt == CompletionReceipt(rollout_id="r", attempt_index=0, execution_generation=1,
                                            result_identity="7",
                                            result_digest=hashlib.sha256(b'{"id":7}').hexdigest())
        assert ex.complete("r", 0, {"id": 7}) == receipt
        with pytest.raises(ControlError):
            ex.complete("r", 0, {"id": 8})
        ex.end("r", 0, "failed")  # a completed execution stays
        assert ex.begin("r", 0).state == "completed"
        # a failed run is tombstoned; a cancelled one parked with a boundary waits for resume
        ex.begin("f", 0, task=None)
        ex.end("f", 0, "failed")
        assert ex.tombstoned("f", 0) and ex.get("f", 0) is None
        ex.begin("k", 0, task=None)
        ex.record_boundary("k", 0, AgentBoundaryRecord(rollout_id="k", attempt_index=0, boundary_index=0,
                                                        last_committed_model_call_id="c0"))
        asked = ex.request_park()
        assert [a.key for a in asked] == [("k", 0)] and not ex.accepting
        with pytest.raises(ControlError) as err:
            ex.begin("new", 0)
        assert err.value.code == "agent_admission_closed"
        parked = asyncio.create_task(ex.park("k", 0))
        await asyncio.sleep(0)
        ex.end("k", 0, "cancelled")
        parked.cancel()
        st = ex.status()
        assert (st.parked_with_boundary, st.completed_unacknowledged, st.ready_to_commit) == (1, 1, False)
        with pytest.raises(ControlError):
            ex.records_for_commit()
        ex.acknowledge(receipt)
        assert [r.rollout_id for r in ex.records_for_commit()] == ["k"]
        assert ex.reopen() == 0  # the detached one is retired, not released
        assert ex.tombstoned("k", 0) and ex.accepting
        # restore: source tombstoned, continuation handed to the first begin of n+1
        ex.install_restored([AgentBoundaryRecord(rollout_id="s", attempt_index=2, boundary_index=4)])
        assert ex.tombstoned("s", 2) and not ex.accepting and ex.restored_attempts() == [("s", 3)]
        ex.reopen()
        cont = ex.begin("s", 3, task=None).continuation
        assert cont is not None and (cont.attempt_index, cont.boundary_index) == (2, 4)
        # retire cancels the run's task
        async def victim() -> None:
            ex.begin("v", 0)
            await asyncio.sleep(30)
        t = asyncio.create_task(victim())
        await asyncio.sleep(0.01)
        assert ex.retire("v", 0) == {"retired": True, "tombstoned": True}
        with pytest.raises(asyncio.CancelledError):
            await t
    run_async(main)


def test_declaration_is_strict_capabilities() -> None:
    caps = whitebox_agent_declaration("a")
    data = msgspec.json.encode(caps)
    assert msgspec.json.decode(data, type=Capabilities) == caps
    assert caps.contract()["participant"] == {"server_name": "a", "component": "responses_api_agents",
                                              "participant_name": "a"}


def test_released_execution_woken_after_a_new_prepare_is_asked_to_park() -> None:
    async def main() -> None:
        ex = AgentExecutions()
        ex.begin("w", 0, task=None)
        ex.record_boundary("w", 0, AgentBoundaryRecord(rollout_id="w", attempt_index=0, boundary_index=0))
        ex.request_park()
        parked = asyncio.create_task(ex.park("w", 0))
        await until(lambda: ex.get("w", 0).state == "parked", "parked")  # type: ignore[union-attr]
        assert ex.reopen() == 1
        assert ex.request_park() == []  # still parked (its task has not woken): not asked
        await parked
        assert ex.get("w", 0).state == "park_requested"  # type: ignore[union-attr]
        assert ex.should_park("w", 0) and ex.status().running == 1
    run_async(main)


def test_park_waiting_parks_asked_executions_with_a_boundary_without_their_tasks() -> None:
    async def main() -> None:
        ex = AgentExecutions()
        woken = 0

        async def waits_for_a_slot() -> None:  # a rollout queued outside any turn: it never calls park()
            nonlocal woken
            await asyncio.sleep(30)
            woken += 1

        tasks = {}
        for rid in ("a", "b", "c", "d"):
            tasks[rid] = asyncio.create_task(waits_for_a_slot())
            ex.begin(rid, 0, task=tasks[rid])
        for rid in ("a", "b", "d"):
            ex.record_boundary(rid, 0, AgentBoundaryRecord(rollout_id=rid, attempt_index=0, boundary_index=1))
        assert ex.park_waiting([("a", 0)]) == 0  # not asked to park: left running
        assert ex.get("a", 0).state == "running"  # type: ignore[union-attr]
        ex.request_park()
        # "c" has no recorded boundary and "nobody" no execution: both left as they are
        assert ex.park_waiting([("a", 0), ("b", 0), ("c", 0), ("nobody", 0)]) == 2
        st = ex.status()
        assert (st.parked_with_boundary, st.running, st.ready_to_commit) == (2, 2, False)
        assert ex.park_waiting([("a", 0)]) == 0  # already parked
        ex.retire("d", 0)  # an asked execution that never parked goes; a retired one is ready either way
        assert ex.park_waiting([("c", 0)]) == 0 and ex.should_park("c", 0)
        ex.record_boundary("c", 0, AgentBoundaryRecord(rollout_id="c", attempt_index=0, boundary_index=1))
        assert ex.park_waiting([("c", 0)]) == 1 and ex.status().ready_to_commit
        assert [r.rollout_id for r in ex.records_for_commit()] == ["a", "b", "c"]
        # a task cancelled while parked this way leaves its execution for the commit; resume retires it
        tasks["b"].cancel()
        ex.end("b", 0, "cancelled")
        assert ex.get("b", 0).state == "parked"  # type: ignore[union-attr]
        assert ex.reopen() == 2  # "a" and "c" released: running again, although no task woke to say so
        assert [ex.get(r, 0).state for r in ("a", "c")] == ["running", "running"]  # type: ignore[union-attr]
        assert ex.tombstoned("b", 0) and ex.get("b", 0) is None
        assert woken == 0 and not tasks["a"].done()
        # parked again by the next prepare, and retired while parked: its task is cancelled
        ex.request_park()
        assert ex.park_waiting([("a", 0)]) == 1
        assert ex.retire("a", 0) == {"retired": True, "tombstoned": True}
        with pytest.raises(asyncio.CancelledError):
            await tasks["a"]
        tasks["c"].cancel()
    run_async(main)
