"""gymkit's control client: the fleet's call orders (CONTROL.md §8), the Gym commit it builds, typed
refusals, the retry of idempotent calls on a dropped connection, and the read of another
participant's part of a draft that a model's commit makes.

The servers are in-process fakes behind the real kit (``ControlPlane``'s routes over ASGI), one
host name each, sharing a log of the calls their participants see.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gymkit import (
    AsyncControlClient,
    CommitContext,
    ControlCallError,
    ControlClient,
    ControlPlane,
    GymFleet,
    Participant,
)
from schemas.control import CONTROL_PREFIX, Capabilities
from schemas.errors import CorruptSnapshotError
from schemas.gym_records import AgentContinuationRoot
from schemas.manifest import PartReceipt
from snapformat import SnapshotStore, open_snapshot, read_part_records
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot

TOKEN = "fleet-token"
SERVERS = [("model", "policy0"), ("agent", "agent1"), ("resource", "tools"), ("agent", "agent0")]


class Fake(Participant):
    """Logs every call; agents write one continuation each, the model reads them through the receipts
    its commit context carries (as a real model server must)."""

    def __init__(self, component: str, name: str, log: list[tuple[str, str]]) -> None:
        self.component, self.name, self.log = component, name, log
        self.seen: list[str] = []  # the model: the rollouts of the agents' continuations
        self.admissions: list[str] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(component=self.component, name=self.name, checkpoint_mode="export_restore")  # type: ignore[arg-type]

    def admission_changed(self, admission: Any) -> None:
        super().admission_changed(admission)
        self.admissions.append(admission)

    async def prepare(self, deadline: float) -> None:
        self.log.append(("prepare", f"{self.component}/{self.name}"))

    async def commit(self, part: PartWriter | None, context: CommitContext) -> dict[str, Any]:
        assert part is not None and isinstance(context, CommitContext)
        assert context.part_prefix == part.prefix == f"gym/{self.component}/{self.name}"
        self.log.append(("commit", f"{self.component}/{self.name}"))
        if self.component == "agent":
            part.write_records("continuations", "continuations", [AgentContinuationRoot(
                rollout_id=f"r-{self.name}", attempt_index=0, capture_key=f"r-{self.name}",
                last_committed_model_call_id="call-0", resource_state_revisions=None)])
        else:
            assert (self.component == "model") == bool(context.continuations)  # only models are given receipts
            for receipt in context.continuations:
                self.seen += [c.rollout_id for c in read_part_records(context.draft_url, receipt, "continuations")]
            part.write_records("state", "session_state" if self.component == "resource" else "model_ledger", [])
        return {"who": self.name}

    async def restore(self, snapshot: Snapshot, prefix: str) -> dict[str, Any]:
        self.log.append(("restore", f"{self.component}/{self.name}"))
        return {"continuations": [{"rollout_id": f"r-{self.name}"}]} if self.component == "agent" else {}

    async def resume(self) -> None:
        self.log.append(("resume", f"{self.component}/{self.name}"))

    async def reset(self) -> None:
        self.log.append(("reset", f"{self.component}/{self.name}"))


class Hosts(httpx.AsyncBaseTransport):
    """Each host name is one in-process app."""

    def __init__(self, apps: dict[str, FastAPI]) -> None:
        self.apps = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[request.url.host].handle_async_request(request)


@pytest.fixture
def gym() -> tuple[dict[str, Fake], list[tuple[str, str]], Hosts]:
    log: list[tuple[str, str]] = []
    fakes, apps = {}, {}
    for component, name in SERVERS:
        fakes[name] = Fake(component, name, log)
        app = FastAPI()
        app.include_router(ControlPlane(fakes[name], TOKEN).router())
        apps[name] = app
    return fakes, log, Hosts(apps)


def _steps(log: list[tuple[str, str]], step: str) -> list[str]:
    """The servers ``step`` reached, by component (servers of one component run in any order)."""
    return [who.split("/")[0] for s, who in log if s == step]


def test_a_save_and_a_restore_in_the_protocols_orders(gym, tmp_path) -> None:
    fakes, log, hosts = gym
    store = SnapshotStore(str(tmp_path / "store"))

    async def scenario() -> str:
        async with httpx.AsyncClient(transport=hosts) as http:
            fleet = GymFleet.connect([f"http://{name}" for _, name in SERVERS], TOKEN, http)
            fingerprint = await fleet.discover()
            assert [s.prefix for s in fleet.servers] == [
                "gym/agent/agent0", "gym/agent/agent1", "gym/model/policy0", "gym/resource/tools"]
            seconds = await fleet.prepare("c1", deadline())
            assert list(seconds) == ["model", "agent", "resource"]
            assert _steps(log, "prepare") == ["model", "agent", "agent", "resource"]
            assert {f.admission for f in fakes.values()} == {"paused"}
            draft = store.begin()
            commit = await fleet.commit("c1", deadline(), draft.url)
            assert _steps(log, "commit") == ["agent", "agent", "model", "resource"]
            assert sorted(fakes["policy0"].seen) == ["r-agent0", "r-agent1"]  # every agent's receipt, read back
            gym_commit = commit.gym_commit
            assert gym_commit.checkpoint_id == "c1"
            assert [(p.component, p.name, p.payload) for p in gym_commit.participants] == [
                ("agent", "agent0", {"who": "agent0"}), ("agent", "agent1", {"who": "agent1"}),
                ("model", "policy0", {"who": "policy0"}), ("resource", "tools", {"who": "tools"})]
            assert [r.prefix for r in commit.receipts] == [p.part_prefix for p in gym_commit.participants]
            assert [p.part_manifest_checksum for p in gym_commit.participants] == \
                [r.part_manifest_checksum for r in commit.receipts]
            published = draft.publish(receipts=commit.receipts, gym_commit=gym_commit, topology_fingerprint=fingerprint)
            assert list(await fleet.resume("c1")) == ["resource", "model", "agent"]
            assert _steps(log, "resume") == ["resource", "model", "agent", "agent"]
            assert {f.admission for f in fakes.values()} == {"accepting"}
            assert fakes["tools"].admissions == ["accepting", "draining", "paused", "accepting"]

            answers = await fleet.restore("r1", deadline(), published.url, "c1")
            assert _steps(log, "restore") == ["model", "agent", "agent", "resource"]
            assert list(answers) == ["gym/model/policy0", "gym/agent/agent0", "gym/agent/agent1", "gym/resource/tools"]
            assert answers["gym/agent/agent1"].payload == {"continuations": [{"rollout_id": "r-agent1"}]}
            assert {a.phase for a in answers.values()} == {"restored_paused"}
            assert await fleet.abort("r1") == []  # an aborted restore drops what it loaded
            assert _steps(log, "reset") == ["resource", "model", "agent", "agent"]
            assert await fleet.abort("never-began") == []  # 409 wrong_phase from each: fine for abort
            return published.url

    assert open_snapshot(asyncio.run(scenario())).manifest.gym_commit.checkpoint_id == "c1"


def deadline() -> float:
    return time.time() + 30


def test_refusals_are_typed_name_the_server_and_never_the_token(gym) -> None:
    _, log, hosts = gym

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=hosts) as http:
            wrong = GymFleet.connect([f"http://{name}" for _, name in SERVERS], "not-the-token", http)
            with pytest.raises(ControlCallError) as err:
                await wrong.discover()
            assert err.value.code == (401, "unauthorized") and "not-the-token" not in str(err.value)
            fleet = GymFleet.connect([f"http://{name}" for _, name in SERVERS], TOKEN, http)
            with pytest.raises(ControlCallError, match="discover"):
                await fleet.prepare("c1", deadline())
            await fleet.discover()
            with pytest.raises(ControlCallError) as err:
                await fleet.resume("never-prepared")
            assert err.value.code == (409, "wrong_phase") and err.value.reason
            assert str(err.value).startswith("resume of resource tools (http://tools): 409")
            assert (err.value.component, err.value.name) == ("resource", "tools")
            assert log == []  # nothing reached a participant
            one = AsyncControlClient("http://agent0", TOKEN, http)
            with pytest.raises(ControlCallError, match="capabilities"):
                await one.prepare("c1", deadline())  # its identity (and so its route) is not known yet
            assert (await one.capabilities()).name == "agent0"
            raw = await one.request("POST", f"{CONTROL_PREFIX}/prepare", content=b"{not json")
            assert (raw.status_code, raw.json()["error"]) == (400, "bad_request")

    asyncio.run(scenario())


def test_two_servers_with_one_name_are_refused(gym) -> None:
    _, _, hosts = gym

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=hosts) as http:
            with pytest.raises(ControlCallError, match="share a component and name"):
                await GymFleet.connect(["http://tools", "http://tools"], TOKEN, http).discover()

    asyncio.run(scenario())


class _DropsFirstRequests:
    """A loopback HTTP server that closes the connection under the first ``drops`` requests (as a
    server closing an idle keep-alive connection the moment a request arrives on it) and answers
    202 after that."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.requests = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        self.requests += 1
        if self.requests > self.drops:
            writer.write(b"HTTP/1.1 202 Accepted\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
            await writer.drain()
        writer.close()


@pytest.mark.parametrize("transport", ["async", "sync"])
def test_a_dropped_connection_is_sent_again_once_for_idempotent_calls_only(transport: str) -> None:
    async def send(url: str, path: str, idempotent: bool) -> httpx.Response:
        if transport == "sync":
            client = ControlClient(url, "t")
            try:
                return await asyncio.to_thread(client.request, "POST", path, {"a": 1}, idempotent=idempotent)
            finally:
                client.close()
        async with httpx.AsyncClient() as http:
            return await AsyncControlClient(url, "t", http).request("POST", path, {"a": 1}, idempotent=idempotent)

    async def scenario() -> None:
        async with _DropsFirstRequests(drops=1) as once, _DropsFirstRequests(drops=2) as twice, \
                _DropsFirstRequests(drops=1) as control:
            assert (await send(once, "/rollouts", idempotent=True)).status_code == 202
            with pytest.raises(ControlCallError, match=r"POST /rollouts of .*: unreachable") as err:
                await send(twice, "/rollouts", idempotent=True)
            assert err.value.error == "unreachable"
            with pytest.raises(ControlCallError, match=r"unreachable") as err:  # a control call: never again
                await send(control, f"{CONTROL_PREFIX}/prepare", idempotent=False)
            assert err.value.error == "unreachable"

    asyncio.run(scenario())


def test_read_part_records_checks_the_part_against_its_receipt(tmp_path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    part = draft.part("gym/agent/agent0")
    part.write_records("continuations", "continuations", [AgentContinuationRoot(
        rollout_id="r1", attempt_index=0, capture_key="r1", last_committed_model_call_id="call-0",
        resource_state_revisions=None)])
    receipt = part.close()
    assert [c.rollout_id for c in read_part_records(draft.url, receipt, "continuations")] == ["r1"]
    assert list(read_part_records(draft.url, receipt, "agent_state")) == []  # the part has none
    with pytest.raises(ValueError):
        list(read_part_records(draft.url, receipt, "token_capture_rows"))  # not records
    forged = PartReceipt(prefix=receipt.prefix, writer=receipt.writer, part_manifest_checksum="xxh128:" + "0" * 32)
    with pytest.raises(CorruptSnapshotError, match="receipt"):
        list(read_part_records(draft.url, forged, "continuations"))
    (file,) = (tmp_path / "store").rglob("continuations.jsonl")
    data = bytearray(file.read_bytes())
    data[-3] ^= 1  # same size, other bytes
    file.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError):
        list(read_part_records(draft.url, receipt, "continuations"))
