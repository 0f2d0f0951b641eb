"""The resources checkpoint side (gymkit.resources_control) over real HTTP: a toy stateful resources
server (a list of notes per session) whose data-plane routes run through
:meth:`ResourceSessions.mutation`, served by uvicorn on 127.0.0.1 in the test's event loop.

Every route of CONTROL.md §4 "Resources checkpoint" is called with its phases, replay and
retirement; the data plane's codes are produced; the committed files are rebuilt here byte for
byte; restore keeps receipts under attempt n+1 (§13) and is refused outside a fresh process.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request, Response

from gymkit import resources_control
from gymkit.agent_dependencies import AgentDependencies
from gymkit.checkpoint_dir import record_json, write_agent_dir
from gymkit.fence import ControlError, Fence
from gymkit.resources_control import (
    ResourceSessions,
    ResourcesParticipant,
    data_plane_response,
    input_digest,
    resources_router,
    stateful_resources_declaration,
)
from schemas.control import (
    CONTROL_PREFIX,
    HEADER_ATTEMPT_INDEX,
    HEADER_EXPECTED_REVISION,
    HEADER_RESOURCE_REQUEST_ID,
    HEADER_RESOURCE_REVISION,
    HEADER_ROLLOUT_ID,
    UNAUTHORIZED_DETAIL,
    Capabilities,
    ResourcesStatusResponse,
)
from schemas.gym_files import CONTINUATIONS_NAME, AgentBoundaryRecord, ResourceSnapshot, agent_instance_dir
from tests.gymkit.asgi_serving import run_async, serving_app
from tests.gymkit.collector_probe import collector_state_at_calls

TOKEN = "tok-en"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NAME = "durable-tools"
P = f"{CONTROL_PREFIX}/resources-checkpoint"
Key = tuple[str, int]


class ToyResources(ResourcesParticipant):
    def __init__(self) -> None:
        self.notes: dict[Key, list[int]] = {}
        self.events: list[tuple[Any, ...]] = []
        self.refuse_import = False
        self.collector_on: list[bool] = []  # gc.isenabled() at each import_states
        self.hold: asyncio.Event | None = None  # set: /note waits on it while holding the session lock

    def declaration(self) -> Capabilities:
        return stateful_resources_declaration(NAME)

    async def export_state(self, rollout_id: str, attempt_index: int) -> Any:
        return {"notes": list(self.notes[(rollout_id, attempt_index)])}

    async def import_states(self, snapshots: list[ResourceSnapshot]) -> None:
        self.events.append(("import", sorted((s.rollout_id, s.attempt_index) for s in snapshots)))
        self.collector_on.append(gc.isenabled())
        if self.refuse_import:
            raise ControlError("resources_checkpoint_error", "refused by the toy")
        self.notes = {(s.rollout_id, s.attempt_index): list(s.state["notes"]) for s in snapshots}

    async def retire_state(self, rollout_id: str, attempt_index: int) -> None:
        self.events.append(("retire", rollout_id, attempt_index))
        self.notes.pop((rollout_id, attempt_index), None)

    async def on_resume(self) -> None:
        self.events.append(("resume",))


class Server:
    def __init__(self, dependencies: AgentDependencies | None = None, **limits: Any) -> None:
        self.toy = ToyResources()
        self.sessions = ResourceSessions(**limits)
        self.fence = Fence()
        self.app = FastAPI()
        self.app.include_router(resources_router(self.toy, self.sessions, self.fence, TOKEN, dependencies=dependencies))
        toy, sessions = self.toy, self.sessions

        async def call(request: Request, kind: Any, work: Callable[[Key, dict[str, Any]], Awaitable[Any]]
                       ) -> Response:
            h = request.headers
            if HEADER_ROLLOUT_ID not in h:
                sessions.record_untracked_traffic()
                return Response(b"{}", media_type="application/json")
            key = (h[HEADER_ROLLOUT_ID], int(h[HEADER_ATTEMPT_INDEX]))
            expected = int(h[HEADER_EXPECTED_REVISION]) if HEADER_EXPECTED_REVISION in h else None
            raw = await request.body()
            digest = input_digest(request.method, request.url.path, request.url.query, raw, h.get("content-type"))
            try:
                async with sessions.mutation(*key, kind=kind, request_id=h.get(HEADER_RESOURCE_REQUEST_ID),
                                             expected_revision=expected, digest=digest) as m:
                    if m.replay is not None:
                        return Response(base64.b64decode(m.replay.body_base64), status_code=m.replay.status,
                                        headers=dict(m.replay.headers))
                    status, payload = await work(key, json.loads(raw) if raw else {})
                    data = json.dumps(payload).encode()
                    headers = m.respond(status, data, [("content-type", "application/json")])
                    return Response(data, status_code=status, headers=dict(headers))
            except ControlError as exc:
                return data_plane_response(exc)

        async def seed(key: Key, body: dict[str, Any]) -> tuple[int, Any]:
            toy.notes[key] = []
            return 200, {"seeded": True}

        async def note(key: Key, body: dict[str, Any]) -> tuple[int, Any]:
            if toy.hold is not None:
                await toy.hold.wait()
            if not isinstance(body.get("value"), int):
                return 400, {"detail": "value must be an int"}
            toy.notes[key].append(body["value"])
            return 200, {"notes": toy.notes[key]}

        async def verify(key: Key, body: dict[str, Any]) -> tuple[int, Any]:
            return 200, {"reward": sum(toy.notes.pop(key))}

        async def peek(key: Key, body: dict[str, Any]) -> tuple[int, Any]:
            return 200, {"notes": toy.notes.get(key)}

        async def boom(key: Key, body: dict[str, Any]) -> tuple[int, Any]:
            raise RuntimeError("the tool crashed")

        for path, kind, work in (("/seed", "start", seed), ("/note", "mutation", note), ("/verify", "terminal", verify),
                                 ("/peek", "read", peek), ("/boom", "mutation", boom)):
            def make(kind: Any = kind, work: Any = work) -> Any:
                async def endpoint(request: Request) -> Response:
                    return await call(request, kind, work)
                return endpoint
            self.app.add_api_route(path, make(), methods=["POST"])


def serving(server: Server) -> AbstractAsyncContextManager[httpx.AsyncClient]:
    return serving_app(server.app)


def body(cid: str, deadline: float | None = None, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 5 if deadline is None else deadline, **extra}


def ident(rid: str, n: int = 0, request_id: str | None = None, expected: int | None = None) -> dict[str, str]:
    h = {HEADER_ROLLOUT_ID: rid, HEADER_ATTEMPT_INDEX: str(n)}
    if request_id is not None:
        h[HEADER_RESOURCE_REQUEST_ID] = request_id
    if expected is not None:
        h[HEADER_EXPECTED_REVISION] = str(expected)
    return h


def expect_error(r: httpx.Response, code: str, status: int = 409) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]


def expect_data_error(r: httpx.Response, code: str) -> dict[str, Any]:
    assert r.status_code == 409, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == code and "message" in err and "detail" not in err, r.text
    return err


def digest_of(path: str, body: bytes) -> str:
    """Recomputed here from the documented formula: NUL-separated method, path, query, content type, body."""
    return hashlib.sha256(b"POST\0" + path.encode() + b"\0\0application/json\0" + body + b"\0").hexdigest()


async def note(c: httpx.AsyncClient, rid: str, value: Any, request_id: str, expected: int | None = None,
               n: int = 0) -> httpx.Response:
    return await c.post("/note", content=json.dumps({"value": value}).encode(),
                        headers={"content-type": "application/json", **ident(rid, n, request_id, expected)})


async def seed(c: httpx.AsyncClient, rid: str, n: int = 0) -> httpx.Response:
    r = await c.post("/seed", headers=ident(rid, n, f"seed-{rid}-{n}"))
    assert r.status_code == 200 and r.headers[HEADER_RESOURCE_REVISION] == "1", r.text
    return r


# -- capabilities, transport -----------------------------------------------------------------------------------
def test_capabilities_and_transport_rules() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            r = await c.get(f"{CONTROL_PREFIX}/capabilities")
            assert r.json() == {
                "component": "resources_servers", "name": NAME, "schema_version": 1,
                "admission_states": ["accepting"], "checkpoint_mode": "export_restore",
                "concurrency_contract": "serialized_per_session",
                "multi_process": {"mode": "single_worker", "num_workers": 1}, "instance_role": None,
                "features": [], "phase": "idle", "active_checkpoint_id": None, "deadline_ts": None}
            r = await c.post(f"{P}/prepare", json=body("c1"))
            assert r.status_code == 401 and r.json() == {"detail": UNAUTHORIZED_DETAIL}
            # status: checkpoint_id and a finite deadline_ts, checked before the token
            for params in ({"checkpoint_id": "c1"}, {"deadline_ts": "1"}, {"checkpoint_id": "c1", "deadline_ts": "nan"},
                           {"checkpoint_id": "c1", "deadline_ts": "inf"}, {"checkpoint_id": "c1", "deadline_ts": "x"},
                           {"checkpoint_id": "-c", "deadline_ts": "1"}):
                r = await c.get(f"{P}/status", params=params)
                assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "query", (params, r.text)
            r = await c.get(f"{P}/status", params={"checkpoint_id": "c1", "deadline_ts": "12.5"})
            assert r.status_code == 401
            # a number string is a deadline; status is refused in idle
            r = await c.get(f"{P}/status", params={"checkpoint_id": "c1", "deadline_ts": "12.5"}, headers=AUTH)
            expect_error(r, "invalid_phase")
            for route in ("prepare", "commit", "restore", "resume", "retire"):
                r = await c.post(f"{P}/{route}", content=b'{"checkpoint_id":"c1","deadline_ts":1e400}', headers=AUTH)
                assert r.status_code == 422, route
            assert (await c.post(f"{P}/commit", json=body("c1"), headers=AUTH)).status_code == 422  # checkpoint_dir
            assert (await c.get(f"{P}/prepare", headers=AUTH)).status_code == 405
            expect_error(await c.post(f"{P}/retire", json=body("c1", rollout_id="r", attempt_index=0), headers=AUTH),
                         "invalid_phase")  # retire needs preparing or prepared
            expect_error(await c.post(f"{P}/commit", json=body("c1", checkpoint_dir="/tmp/x"), headers=AUTH),
                         "invalid_phase")
    run_async(main)


# -- the data plane -----------------------------------------------------------------------------------------------
def test_data_plane_checks_and_receipts() -> None:
    async def main() -> None:
        s = Server(max_receipts_per_session=3, max_retired_receipt_sessions=1)
        async with serving(s) as c:
            expect_data_error(await note(c, "r1", 1, "n0"), "resources_session_unbound")
            r = await c.post("/note", json={"value": 1}, headers=ident("r1"))
            expect_data_error(r, "resource_request_receipt_error")  # a mutation needs a request id
            await seed(c, "r1")
            err = expect_data_error(await note(c, "r1", 1, "n1", expected=5), "resource_revision_mismatch")
            assert (err["expected_revision"], err["actual_revision"]) == (5, 1)
            r1 = await note(c, "r1", 7, "n1", expected=1)
            assert r1.status_code == 200 and r1.headers[HEADER_RESOURCE_REVISION] == "2"
            assert r1.json() == {"notes": [7]}
            # the same request id and input replays the stored answer; nothing runs again
            again = await note(c, "r1", 7, "n1", expected=1)
            assert (again.status_code, again.content, again.headers[HEADER_RESOURCE_REVISION]) == (
                200, r1.content, "2")
            assert s.toy.notes[("r1", 0)] == [7] and s.sessions.revision("r1", 0) == 2
            expect_data_error(await note(c, "r1", 8, "n1", expected=1), "resource_request_receipt_error")
            expect_data_error(await note(c, "r1", 7, "n1", expected=None), "resource_request_receipt_error")
            receipt = s.sessions.receipt("r1", 0, "n1")
            assert receipt is not None and receipt.input_digest == digest_of("/note", b'{"value": 7}')
            assert receipt.headers == [("content-type", "application/json"), (HEADER_RESOURCE_REVISION, "2")]
            # a read needs no request id and leaves the revision
            r = await c.post("/peek", headers=ident("r1"))
            assert r.json() == {"notes": [7]} and HEADER_RESOURCE_REVISION not in r.headers
            # receipt capacity: seed, n1 and one more
            assert (await note(c, "r1", 9, "n2")).status_code == 200
            expect_data_error(await note(c, "r1", 10, "n3"), "resource_receipt_capacity_exhausted")
            # a crashing handler leaves the outcome uncertain
            await seed(c, "r2")
            assert (await c.post("/boom", headers=ident("r2", 0, "b1"))).status_code == 500
            expect_data_error(await note(c, "r2", 1, "x"), "resource_mutation_uncertain")
            # a terminal call ends the session; its receipts still replay
            await seed(c, "r3")
            v = await c.post("/verify", headers=ident("r3", 0, "v1"))
            assert v.status_code == 200 and v.json() == {"reward": 0}
            assert not s.sessions.is_bound("r3", 0)
            assert (await c.post("/verify", headers=ident("r3", 0, "v1"))).content == v.content
            expect_data_error(await note(c, "r3", 1, "z"), "resources_session_unbound")
            # ending another session evicts r3's receipts (one ended session is kept)
            await seed(c, "r4")
            assert (await c.post("/verify", headers=ident("r4", 0, "v1"))).status_code == 200
            expect_data_error(await c.post("/verify", headers=ident("r3", 0, "v1")), "resource_receipt_evicted")
            # untracked stateful traffic makes a prepare impossible
            assert (await c.post("/note", json={"value": 1})).status_code == 200
            r = await c.post(f"{P}/prepare", json=body("ck"), headers=AUTH)
            expect_error(r, "resources_checkpoint_error")
            # the failed prepare: phase idle, admission closed
            assert (s.fence.phase, s.fence.active_checkpoint_id, s.sessions.accepting) == ("idle", None, False)
            expect_data_error(await note(c, "r1", 1, "q"), "resources_admission_closed")
            # a resume with a fresh id from idle reopens
            assert (await c.post(f"{P}/resume", json=body("other"), headers=AUTH)).json() == {"state": "accepting"}
            assert (await note(c, "r1", 5, "q")).status_code == 409  # capacity, not admission
    run_async(main)


def test_uncertain_outcome_refuses_prepare() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            await seed(c, "r")
            assert (await c.post("/boom", headers=ident("r", 0, "b"))).status_code == 500
            r = await c.post(f"{P}/prepare", json=body("ck"), headers=AUTH)
            err = expect_error(r, "resource_mutation_uncertain")
            assert "RuntimeError" in err["detail"]
    run_async(main)


# -- prepare, commit, files, retire, resume ---------------------------------------------------------------------------
def snapshot_bytes(rid: str, n: int, revision: int, notes: list[int], receipts: list[dict[str, Any]],
                   created_at: float) -> bytes:
    return json.dumps({"schema_version": 2, "rollout_id": rid, "attempt_index": n, "state_revision": revision,
                       "state": {"notes": notes}, "mutation_receipts": receipts, "created_at": created_at},
                      indent=2).encode()


def receipt_dict(request_id: str, expected: int | None, path: str, req_body: bytes, status: int, resp_body: bytes,
                 revision: int | None) -> dict[str, Any]:
    headers = [["content-type", "application/json"]]
    if revision is not None:
        headers.append([HEADER_RESOURCE_REVISION, str(revision)])
    return {"request_id": request_id, "expected_revision": expected, "input_digest": digest_of(path, req_body),
            "status": status, "headers": headers, "body_base64": base64.b64encode(resp_body).decode(),
            "resulting_revision": revision}


def test_prepare_commit_files_retire_resume(tmp_path: Path) -> None:
    async def main() -> None:
        s = Server()
        ckdir = tmp_path / "gym"
        folder = ckdir / "resources" / NAME
        async with serving(s) as c:
            for rid in ("a", "b"):
                await seed(c, rid)
                assert (await note(c, rid, 3, f"{rid}-1", expected=1)).status_code == 200
            assert (await note(c, "a", 4, "a-2", expected=2)).status_code == 200
            r = await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH)
            assert r.status_code == 200
            assert r.json() == {"sessions": 2, "state": "prepared", "inventory": [
                {"rollout_id": "a", "attempt_index": 0, "revision": 3, "mutation_receipts": 3},
                {"rollout_id": "b", "attempt_index": 0, "revision": 2, "mutation_receipts": 2}]}
            assert (await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH)).json() == r.json()  # replay
            expect_data_error(await note(c, "a", 5, "a-3"), "resources_admission_closed")
            st = await c.get(f"{P}/status", params={"checkpoint_id": "ck-1", "deadline_ts": time.time()}, headers=AUTH)
            st = st.json()
            assert (st["checkpoint_id"], st["state"], st["admission_state"], st["sessions"]) == (
                "ck-1", "paused", "paused", 2)  # Gym: state is the admission
            assert st["per_session"] == [{"rollout_id": "a", "attempt_index": 0, "revision": 3, "locked": False},
                                         {"rollout_id": "b", "attempt_index": 0, "revision": 2, "locked": False}]
            assert [e["rollout_id"] for e in st["prepared_inventory"]] == ["a", "b"]
            expect_error(await c.get(f"{P}/status", params={"checkpoint_id": "zz", "deadline_ts": 1}, headers=AUTH),
                         "checkpoint_conflict")
            # retire b while prepared: tombstoned, state dropped, not committed
            r = await c.post(f"{P}/retire", json=body("ck-1", rollout_id="b", attempt_index=0), headers=AUTH)
            assert r.json() == {"retired": True, "rollout_id": "b", "attempt_index": 0}
            assert s.toy.events == [("retire", "b", 0)]
            expect_data_error(await note(c, "b", 1, "b-9"), "stale_attempt")
            req = body("ck-1", checkpoint_dir=str(ckdir))
            r = await c.post(f"{P}/commit", json=req, headers=AUTH)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert sorted(p.name for p in folder.iterdir()) == ["a.a0.json", "manifest.json"]
            created = json.loads((folder / "a.a0.json").read_bytes())["created_at"]
            seed_body = json.dumps({"seeded": True}).encode()
            expected = snapshot_bytes("a", 0, 3, [3, 4], [
                {"request_id": "seed-a-0", "expected_revision": None,
                 "input_digest": hashlib.sha256(b"POST\0/seed\0\0\0\0").hexdigest(), "status": 200,
                 "headers": [["content-type", "application/json"], [HEADER_RESOURCE_REVISION, "1"]],
                 "body_base64": base64.b64encode(seed_body).decode(), "resulting_revision": 1},
                receipt_dict("a-1", 1, "/note", b'{"value": 3}', 200, b'{"notes": [3]}', 2),
                receipt_dict("a-2", 2, "/note", b'{"value": 4}', 200, b'{"notes": [3, 4]}', 3)], created)
            assert (folder / "a.a0.json").read_bytes() == expected
            manifest = json.dumps({"schema_version": 2, "checkpoint_id": "ck-1", "server_name": NAME,
                                   "files": {"a.a0.json": hashlib.sha256(expected).hexdigest()}},
                                  sort_keys=True, indent=2).encode()
            assert (folder / "manifest.json").read_bytes() == manifest
            assert answer == {"sessions": 1, "manifest_digest": hashlib.sha256(manifest).hexdigest()}
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("committed_paused", "ck-1")
            assert (await c.post(f"{P}/commit", json=req, headers=AUTH)).json() == answer  # replay
            expect_error(await c.post(f"{P}/retire", json=body("ck-1", rollout_id="a", attempt_index=0),
                                      headers=AUTH), "invalid_phase")
            r = await c.post(f"{P}/resume", json=body("ck-1"), headers=AUTH)
            assert r.json() == {"state": "accepting"}
            assert (await c.post(f"{P}/resume", json=body("ck-1"), headers=AUTH)).json() == {"state": "accepting"}
            expect_error(await c.post(f"{P}/commit", json=req, headers=AUTH), "stale_checkpoint")
            expect_error(await c.get(f"{P}/status", params={"checkpoint_id": "ck-1", "deadline_ts": 1},
                                     headers=AUTH), "stale_checkpoint")
            assert s.toy.events[-1] == ("resume",) and s.sessions.accepting
            assert (await note(c, "a", 5, "a-3", expected=3)).headers[HEADER_RESOURCE_REVISION] == "4"
        # another process committing the same checkpoint finds its manifest: same answer, nothing written
        before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
        s2 = Server()
        async with serving(s2) as c:
            assert (await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH)).status_code == 200
            assert (await c.post(f"{P}/commit", json=req, headers=AUTH)).json() == answer
            assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()} == before
            # but not into a folder of another checkpoint
            assert (await c.post(f"{P}/resume", json=body("ck-1"), headers=AUTH)).status_code == 200
            assert (await c.post(f"{P}/prepare", json=body("ck-2"), headers=AUTH)).status_code == 200
            r = await c.post(f"{P}/commit", json={**req, "checkpoint_id": "ck-2"}, headers=AUTH)
            expect_error(r, "resources_checkpoint_error")
            assert s2.fence.phase == "prepared"
    run_async(main)


def test_the_commit_copies_each_receipts_bytes_encoded_when_it_was_made(tmp_path: Path, monkeypatch) -> None:
    """A receipt is encoded once, when its mutation completes: the commit (inside the pause) encodes
    none again, and the session file is the bytes of the whole snapshot encoded at once."""
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            await seed(c, "a")
            assert (await note(c, "a", 3, "a-1", expected=1)).status_code == 200
            assert (await c.post(f"{P}/prepare", json=body("ck-1"), headers=AUTH)).status_code == 200
            real = resources_control.receipt_json
            encoded: list[str] = []

            def counting(receipt: Any) -> bytes:
                encoded.append(receipt.request_id)
                return real(receipt)

            spliced: list[str] = []
            splice = resources_control.session_json

            def counting_splice(snapshot: Any, receipts: Any) -> bytes:
                spliced.append(snapshot.rollout_id)
                return splice(snapshot, receipts)

            monkeypatch.setattr(resources_control, "receipt_json", counting)
            monkeypatch.setattr(resources_control, "session_json", counting_splice)
            r = await c.post(f"{P}/commit", json=body("ck-1", checkpoint_dir=str(tmp_path / "gym")), headers=AUTH)
            assert r.status_code == 200, r.text
            assert encoded == [] and spliced == ["a"]
            (snapshot,) = s.sessions.prepared_snapshots()
            assert [x.request_id for x in snapshot.mutation_receipts] == ["seed-a-0", "a-1"]
            assert (tmp_path / "gym" / "resources" / NAME / "a.a0.json").read_bytes() == record_json(snapshot)
            # a receipt not made here (a restored one, an equal copy) is encoded when committed
            copy = msgspec.structs.replace(snapshot, mutation_receipts=[
                msgspec.structs.replace(x) for x in snapshot.mutation_receipts])
            assert s.sessions.session_json(copy) == record_json(snapshot) and encoded == ["seed-a-0", "a-1"]
    run_async(main)


def test_prepare_deadline_rules() -> None:
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            # no sessions: a past deadline is not refused
            r = await c.post(f"{P}/prepare", json=body("c0", time.time() - 10), headers=AUTH)
            assert r.json() == {"sessions": 0, "state": "prepared", "inventory": []}
            assert (await c.post(f"{P}/resume", json=body("c0"), headers=AUTH)).status_code == 200
            await seed(c, "r")
            expect_error(await c.post(f"{P}/prepare", json=body("c1", time.time() - 10), headers=AUTH),
                         "resources_checkpoint_error")
            assert (s.fence.phase, s.sessions.accepting) == ("idle", False)
            assert (await c.post(f"{P}/resume", json=body("c1"), headers=AUTH)).status_code == 200
            # a call holding the session's lock past the deadline
            s.toy.hold = asyncio.Event()
            held = asyncio.create_task(note(c, "r", 1, "h1", expected=1))
            while not s.sessions.status()["locked_sessions"]:
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            r = await c.post(f"{P}/prepare", json=body("c2", time.time() + 0.2), headers=AUTH)
            expect_error(r, "resources_checkpoint_error")
            assert "timed out" in r.json()["error"]["detail"] and time.monotonic() - t0 < 3
            s.toy.hold.set()
            assert (await held).status_code == 200  # admitted before the prepare closed admission
    run_async(main)


def test_a_prepare_exports_free_sessions_without_a_loop_turn_each() -> None:
    """A prepare exports every session under its lock, with the deadline as the lock's timeout. A
    free lock is taken at once: waiting for it through ``asyncio.wait_for`` ran each acquire as a
    task, three turns of the server's event loop for each of the thousands of sessions (issue 22's
    pause at 10,000 rollouts). A held lock still times out at the deadline (test above)."""
    count = 500

    async def main() -> tuple[int, int]:
        sessions = ResourceSessions()
        for i in range(count):
            sessions.bind(f"r{i}", 0)
        turns, stop = 0, False

        async def ticker() -> None:  # counts the loop's turns while the prepare runs
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        async def export(rid: str, n: int) -> Any:
            return {"rollout_id": rid}

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        turns = 0
        reply = await sessions.prepare(time.time() + 30, export)
        stop = True
        await task
        return reply.sessions, turns

    exported, turns = asyncio.run(main())
    assert exported == count
    assert turns <= 2, turns  # not one per session


# -- restore -------------------------------------------------------------------------------------------------------------
async def committed(ckdir: Path, cid: str = "save-1") -> Server:
    """A server with sessions a (revision 3) and b (revision 2) committed under ``cid``."""
    s = Server()
    async with serving(s) as c:
        for rid in ("a", "b"):
            await seed(c, rid)
            assert (await note(c, rid, 3, f"{rid}-1", expected=1)).status_code == 200
        assert (await note(c, "a", 4, "a-2", expected=2)).status_code == 200
        assert (await c.post(f"{P}/prepare", json=body(cid), headers=AUTH)).status_code == 200
        r = await c.post(f"{P}/commit", json=body(cid, checkpoint_dir=str(ckdir)), headers=AUTH)
        assert r.status_code == 200, r.text
        # restore in this process (it served traffic) is unsafe, even after resume
        assert (await c.post(f"{P}/resume", json=body(cid), headers=AUTH)).status_code == 200
        r = await c.post(f"{P}/restore", json=body("restore-x", checkpoint_dir=str(ckdir)), headers=AUTH)
        expect_error(r, "unsafe_resources_restore")
        assert (s.fence.phase, s.fence.active_checkpoint_id, s.sessions.accepting) == ("idle", None, False)
        expect_data_error(await note(c, "a", 5, "a-3"), "resources_admission_closed")
    return s


def test_restore_in_a_fresh_process_continues_as_next_attempt(tmp_path: Path, monkeypatch) -> None:
    commits_collector_on = collector_state_at_calls(monkeypatch, resources_control, "commit_resources_checkpoint")

    async def main() -> None:
        ckdir = tmp_path / "gym"
        await committed(ckdir)
        # The commit (on a worker thread) and the import below ran with the cyclic collector held off.
        assert commits_collector_on == [False] and gc.isenabled() and gc.get_freeze_count() == 0  # froze nothing
        s = Server()
        async with serving(s) as c:
            req = body("restore-1", checkpoint_dir=str(ckdir))
            r = await c.post(f"{P}/restore", json=req, headers=AUTH)
            assert r.status_code == 200 and r.json() == {"sessions": 2, "source_checkpoint_id": "save-1"}
            assert (await c.post(f"{P}/restore", json=req, headers=AUTH)).json() == r.json()  # replay
            assert s.toy.events == [("import", [("a", 1), ("b", 1)])]
            # Held off in the restore, and by the fence until the resume, which freezes what the restore
            # left alive (gymkit.collector).
            assert s.toy.collector_on == [False] and not gc.isenabled() and gc.get_freeze_count() == 0
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("restored_paused", "restore-1")
            assert s.sessions.bound() == [("a", 1), ("b", 1)]
            assert (s.sessions.revision("a", 1), s.sessions.revision("b", 1)) == (3, 2)
            st = await c.get(f"{P}/status", params={"checkpoint_id": "restore-1", "deadline_ts": "1"}, headers=AUTH)
            assert st.json()["sessions"] == 2 and st.json()["mutation_receipts"] == 5
            expect_data_error(await note(c, "a", 5, "a-3", n=1), "resources_admission_closed")
            expect_error(await c.post(f"{P}/retire", json=body("restore-1", rollout_id="a", attempt_index=1),
                                      headers=AUTH), "invalid_phase")
            assert (await c.post(f"{P}/resume", json=body("restore-1"), headers=AUTH)).json() == {"state": "accepting"}
            assert gc.isenabled() and gc.get_freeze_count() > 0
            # the source attempt is stale; a request id from before replays its old answer on attempt 1 (§13)
            expect_data_error(await note(c, "a", 4, "a-2", expected=2), "stale_attempt")
            old = await note(c, "a", 4, "a-2", expected=2, n=1)
            assert (old.status_code, old.json(), old.headers[HEADER_RESOURCE_REVISION]) == (200, {"notes": [3, 4]}, "3")
            assert s.toy.notes[("a", 1)] == [3, 4]
            new = await note(c, "a", 6, "a-4", expected=3, n=1)
            assert (new.json(), new.headers[HEADER_RESOURCE_REVISION]) == ({"notes": [3, 4, 6]}, "4")
    run_async(main)


def test_restore_refusals(tmp_path: Path) -> None:
    async def main() -> None:
        ckdir = tmp_path / "gym"
        await committed(ckdir)
        # the participant refuses the set: nothing bound, admission closed, phase idle
        s = Server()
        s.toy.refuse_import = True
        async with serving(s) as c:
            r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
            expect_error(r, "resources_checkpoint_error")
            assert s.sessions.bound() == [] and not s.sessions.accepting and s.fence.phase == "idle"
            s.toy.refuse_import = False
            r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
            assert r.status_code == 200  # a retry reruns (still a fresh process)
        # a corrupt snapshot file
        (ckdir / "resources" / NAME / "b.a0.json").write_bytes(b"{}")
        s = Server()
        async with serving(s) as c:
            r = await c.post(f"{P}/restore", json=body("r2", checkpoint_dir=str(ckdir)), headers=AUTH)
            assert "b.a0.json" in expect_error(r, "resources_checkpoint_error")["detail"]
            r = await c.post(f"{P}/restore", json=body("r3", checkpoint_dir=str(tmp_path / "none")), headers=AUTH)
            expect_error(r, "resources_checkpoint_error")
    run_async(main)


def test_restore_checks_the_agents_revisions(tmp_path: Path) -> None:
    async def main() -> None:
        ckdir = tmp_path / "gym"
        await committed(ckdir)

        def agent_saw(revision: int, call: str | None) -> None:
            rec = AgentBoundaryRecord(rollout_id="a", attempt_index=0, boundary_index=1, turn_index=1,
                                      last_committed_model_call_id=call,
                                      resource_state_revisions={NAME: revision, "other-server": 9})
            write_agent_dir(ckdir, "save-1", "agent-x", [rec])
        # with a committed model call the revisions come from the continuation root; without one, from the record
        for call in ("a-call-1", None):
            agent_saw(2, call)
            s = Server()
            async with serving(s) as c:
                r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
                err = expect_error(r, "resource_revision_mismatch")
                assert "revision 2" in err["detail"] and s.sessions.bound() == []
            agent_saw(3, call)
            s = Server()
            async with serving(s) as c:
                r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
                assert r.status_code == 200, r.text
    run_async(main)


def test_the_resources_servers_of_a_process_share_one_read_of_the_agents(tmp_path: Path) -> None:
    async def main() -> None:
        ckdir = tmp_path / "gym"
        await committed(ckdir)
        rec = AgentBoundaryRecord(rollout_id="a", attempt_index=0, boundary_index=1, turn_index=1,
                                  last_committed_model_call_id="a-call-1", resource_state_revisions={NAME: 3})
        write_agent_dir(ckdir, "save-1", "agent-x", [rec])
        shared = AgentDependencies()
        first = Server(dependencies=shared)
        async with serving(first) as c:
            r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
            assert r.status_code == 200, r.text
        # The agents' index changed under its manifest: a server reading for itself refuses the folder;
        # one sharing the first server's read is answered from that read (what the manifest binds).
        index = ckdir / agent_instance_dir("agent-x") / CONTINUATIONS_NAME
        index.write_bytes(index.read_bytes().replace(f'"{NAME}":3'.encode(), f'"{NAME}":2'.encode()))
        alone = Server()
        async with serving(alone) as c:
            r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
            assert CONTINUATIONS_NAME in expect_error(r, "resources_checkpoint_error")["detail"]
        second = Server(dependencies=shared)
        async with serving(second) as c:
            r = await c.post(f"{P}/restore", json=body("r1", checkpoint_dir=str(ckdir)), headers=AUTH)
            assert r.status_code == 200 and second.sessions.bound() == [("a", 1), ("b", 1)]
    run_async(main)


def test_restore_expected_server_waits_for_its_restore(tmp_path: Path) -> None:
    async def main() -> None:
        ckdir = tmp_path / "gym"
        await committed(ckdir)
        s = Server(restore_expected=True)
        async with serving(s) as c:
            expect_data_error(await c.post("/seed", headers=ident("z", 0, "s")), "resources_admission_closed")
            expect_error(await c.post(f"{P}/resume", json=body("early"), headers=AUTH), "resources_checkpoint_error")
            assert (s.fence.phase, s.fence.active_checkpoint_id) == ("idle", None)
            assert (await c.post(f"{P}/restore", json=body("r", checkpoint_dir=str(ckdir)), headers=AUTH)).status_code == 200
            assert (await c.post(f"{P}/resume", json=body("r"), headers=AUTH)).json() == {"state": "accepting"}
    run_async(main)


def test_refused_call_receipt_survives_a_checkpoint(tmp_path: Path) -> None:
    async def main() -> None:
        ckdir = tmp_path / "gym"
        s = Server()
        async with serving(s) as c:
            await seed(c, "a")
            r = await note(c, "a", "not-an-int", "bad-1", expected=1)
            assert r.status_code == 400 and HEADER_RESOURCE_REVISION not in r.headers
            assert s.sessions.revision("a", 0) == 1
            assert (await c.post(f"{P}/prepare", json=body("c"), headers=AUTH)).status_code == 200
            assert (await c.post(f"{P}/commit", json=body("c", checkpoint_dir=str(ckdir)), headers=AUTH)).status_code == 200
        s = Server()
        async with serving(s) as c:
            r = await c.post(f"{P}/restore", json=body("r", checkpoint_dir=str(ckdir)), headers=AUTH)
            assert r.status_code == 200, r.text
            assert s.sessions.receipt("a", 1, "bad-1").resulting_revision is None  # type: ignore[union-attr]
    run_async(main)


def test_status_body_decodes_as_the_clients_struct() -> None:
    """``state`` is the admission state, as Gym's own code answers it (``admission_state`` too)."""
    async def main() -> None:
        s = Server()
        async with serving(s) as c:
            assert (await c.post(f"{P}/prepare", json=body("ck"), headers=AUTH)).status_code == 200
            r = await c.get(f"{P}/status", params={"checkpoint_id": "ck", "deadline_ts": "1"}, headers=AUTH)
            decoded = msgspec.json.decode(r.content, type=ResourcesStatusResponse)
            assert (decoded.state, decoded.admission_state, decoded.sessions) == ("paused", "paused", 0)
    run_async(main)
