"""The participant kit's phase machine and routes, through FastAPI's ASGI stack in-process.

A small in-memory participant stands in for a Gym server (the reference servers in ``refgym``
exercise the kit over real HTTP); here every rule of the protocol is checked one by one: phases,
fencing, idempotency, deadlines, tokens, malformed bodies, and that commit writes only under the
server's own prefix of the draft it is given.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gymkit import CommitContext, ControlPlane, Participant
from schemas.control import CONTROL_PREFIX, Capabilities, RolloutRef
from schemas.gym_records import AgentContinuationRoot
from schemas.manifest import GymCommit, PartReceipt
from snapformat import SnapshotStore
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class FakeAgent(Participant):
    """Parks when told; ``block`` makes prepare wait until released (to test deadlines/abort)."""

    def __init__(self) -> None:
        self.parked = {"r1": 2, "r2": 1}
        self.finished = {("f1", 0)}
        self.block = asyncio.Event()
        self.block.set()
        self.resumed = 0
        self.restored: list[str] = []
        self.contexts: list[CommitContext] = []
        self.admissions: list[str] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(component="agent", name="agent0", checkpoint_mode="export_restore")

    def admission_changed(self, admission: Any) -> None:
        super().admission_changed(admission)
        self.admissions.append(admission)

    async def prepare(self, deadline: float) -> None:
        await self.block.wait()

    async def commit(self, part: PartWriter | None, context: CommitContext) -> dict[str, Any]:
        assert part is not None
        self.contexts.append(context)
        part.write_records("continuations", "continuations", [
            AgentContinuationRoot(rollout_id=r, attempt_index=0, capture_key=r,
                                  last_committed_model_call_id=f"call-{n}", resource_state_revisions=None)
            for r, n in sorted(self.parked.items())])
        return {"parked": len(self.parked)}

    async def restore(self, snapshot: Snapshot, prefix: str) -> dict[str, Any]:
        self.restored = [c.rollout_id for c in snapshot.records(f"{prefix}/continuations.jsonl")]
        return {"restored": len(self.restored)}

    async def resume(self) -> None:
        self.resumed += 1

    async def reset(self) -> None:
        self.restored = []
        self.resets = getattr(self, "resets", 0) + 1

    def unknown_rollouts(self, results: list[RolloutRef]) -> list[RolloutRef]:
        return [r for r in results if (r.rollout_id, r.attempt_index) not in self.finished]

    async def acknowledge(self, results: list[RolloutRef]) -> dict[str, Any]:
        for r in results:
            self.finished.discard((r.rollout_id, r.attempt_index))
        return {"acknowledged": len(results)}


@pytest.fixture
def agent() -> FakeAgent:
    return FakeAgent()


@pytest.fixture
def client(agent: FakeAgent):
    app = FastAPI()
    app.include_router(ControlPlane(agent, TOKEN).router())
    with TestClient(app) as c:
        yield c


def post(client: TestClient, route: str, body: dict[str, Any], headers: dict[str, str] = AUTH):
    return client.post(CONTROL_PREFIX + route, content=msgspec.json.encode(body), headers=headers)


def ctl(cid: str, within: float = 30.0) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline": time.time() + within}


def test_full_cycle_commit_publish_restore(client: TestClient, agent: FakeAgent, tmp_path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    r = post(client, "/prepare", ctl("c1"))
    assert r.status_code == 200 and r.json()["phase"] == "prepared" and r.json()["admission"] == "paused"
    r = post(client, "/commit", {**ctl("c1"), "draft_url": draft.url, "part_prefix": "gym/agent/agent0"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["phase"] == "committed_paused" and body["payload"] == {"parked": 2}
    receipt = msgspec.convert(body["part"], type=__import__("schemas").manifest.PartReceipt)
    published = draft.publish(receipts=[receipt], gym_commit=GymCommit(checkpoint_id="c1"), topology_fingerprint="sha256:" + "0" * 64)
    assert post(client, "/resume", ctl("c1")).json()["phase"] == "idle"
    assert agent.resumed == 1
    r = post(client, "/restore", {**ctl("r1"), "snapshot_url": published.url, "saved_checkpoint_id": "c1",
                                  "part_prefix": "gym/agent/agent0", "topology_fingerprint": "sha256:" + "0" * 64})
    assert r.status_code == 200, r.text
    assert r.json()["phase"] == "restored_paused" and agent.restored == ["r1", "r2"]
    assert post(client, "/resume", ctl("r1")).json()["phase"] == "idle"


def test_commit_hands_the_participant_a_typed_context(client: TestClient, agent: FakeAgent, tmp_path) -> None:
    draft = SnapshotStore(str(tmp_path / "s")).begin()
    other = draft.part("gym/agent/agent9")
    receipt = other.close()
    body = {**ctl("c1"), "draft_url": draft.url, "part_prefix": "gym/agent/agent0",
            "continuations": [msgspec.to_builtins(receipt)]}
    post(client, "/prepare", ctl("c1"))
    assert post(client, "/commit", body).status_code == 200
    assert agent.contexts == [CommitContext(checkpoint_id="c1", deadline=body["deadline"], draft_url=draft.url,
                                            part_prefix="gym/agent/agent0", continuations=(receipt,))]
    assert isinstance(agent.contexts[0].continuations[0], PartReceipt)
    with pytest.raises(AttributeError):
        agent.contexts[0].draft_url = "elsewhere"  # type: ignore[misc]  # frozen


def test_the_kit_says_when_the_participant_may_admit_work(client: TestClient, agent: FakeAgent) -> None:
    assert agent.admits_work() and agent.admissions == ["accepting"]  # told once when mounted
    agent.block.clear()
    assert post(client, "/prepare", ctl("c1", within=0.3)).status_code == 409  # still draining after it
    assert (agent.admission, agent.admits_work()) == ("draining", False)
    agent.block.set()
    post(client, "/abort", ctl("c1"))
    assert agent.admits_work()
    post(client, "/prepare", ctl("c2"))
    assert (agent.admission, agent.admits_work()) == ("paused", False)
    post(client, "/resume", ctl("c2"))
    assert agent.admissions == ["accepting", "draining", "accepting", "draining", "paused", "accepting"]


def test_repeated_calls_are_idempotent(client: TestClient, agent: FakeAgent, tmp_path) -> None:
    draft = SnapshotStore(str(tmp_path / "s")).begin()
    first = post(client, "/prepare", ctl("c1"))
    assert post(client, "/prepare", ctl("c1")).json() == first.json()
    commit = {**ctl("c1"), "draft_url": draft.url, "part_prefix": "gym/agent/agent0"}
    a, b = post(client, "/commit", commit), post(client, "/commit", commit)
    assert a.status_code == b.status_code == 200 and a.json() == b.json()  # the part was written once
    r1, r2 = post(client, "/resume", ctl("c1")), post(client, "/resume", ctl("c1"))
    assert r1.json() == r2.json() and agent.resumed == 1


def test_conflicting_and_stale_ids_are_refused(client: TestClient) -> None:
    assert post(client, "/prepare", ctl("c1")).status_code == 200
    r = post(client, "/prepare", ctl("c2"))
    assert r.status_code == 409 and r.json()["error"] == "conflicting_checkpoint" and "'c1'" in r.json()["reason"]
    assert post(client, "/resume", ctl("c2")).status_code == 409
    assert post(client, "/resume", ctl("c1")).status_code == 200
    r = post(client, "/prepare", ctl("c1"))
    assert r.status_code == 409 and r.json()["error"] == "stale_checkpoint"


def test_out_of_order_calls_are_refused_without_changing_state(client: TestClient, tmp_path) -> None:
    draft = SnapshotStore(str(tmp_path / "s")).begin()
    r = post(client, "/commit", {**ctl("c1"), "draft_url": draft.url, "part_prefix": "gym/agent/agent0"})
    assert r.status_code == 409 and r.json()["error"] == "wrong_phase"
    assert post(client, "/resume", ctl("c1")).status_code == 409
    assert client.get(CONTROL_PREFIX + "/status", headers=AUTH).json()["phase"] == "idle"


def test_commit_outside_own_prefix_is_refused(client: TestClient, tmp_path) -> None:
    draft = SnapshotStore(str(tmp_path / "s")).begin()
    post(client, "/prepare", ctl("c1"))
    for prefix in ("gym/model/policy0", "../escape", "gym/agent/agent0/../../x"):
        r = post(client, "/commit", {**ctl("c1"), "draft_url": draft.url, "part_prefix": prefix})
        assert r.status_code == 400, prefix
    assert client.get(CONTROL_PREFIX + "/status", headers=AUTH).json()["phase"] == "prepared"


def test_prepare_past_deadline_then_abort_resumes(client: TestClient, agent: FakeAgent) -> None:
    agent.block.clear()  # the agent cannot reach a turn boundary
    r = post(client, "/prepare", ctl("c1", within=0.5))
    assert r.status_code == 409 and r.json()["error"] == "deadline_passed"
    r = post(client, "/abort", ctl("c1"))
    assert r.status_code == 200 and r.json()["admission"] == "accepting"
    assert agent.resumed == 1


def test_passed_deadline_refused_up_front(client: TestClient) -> None:
    r = post(client, "/prepare", {"checkpoint_id": "c1", "deadline": time.time() - 1})
    assert r.status_code == 409 and r.json()["error"] == "deadline_passed"
    assert client.get(CONTROL_PREFIX + "/status", headers=AUTH).json()["phase"] == "idle"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}])
def test_token_required(client: TestClient, headers: dict[str, str]) -> None:
    r = post(client, "/prepare", ctl("c1"), headers=headers)
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert TOKEN not in r.text
    assert client.get(CONTROL_PREFIX + "/capabilities", headers=headers).status_code == 401


@pytest.mark.parametrize("body", [b"not json", b'{"checkpoint_id": "c1"}', b'{"checkpoint_id": "../x", "deadline": 9e9}',
                                  b'{"checkpoint_id": "c1", "deadline": 9e9, "extra": 1}'])
def test_malformed_bodies_are_400(client: TestClient, body: bytes) -> None:
    r = client.post(CONTROL_PREFIX + "/prepare", content=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"] == "bad_request"
    assert client.get(CONTROL_PREFIX + "/status", headers=AUTH).json()["phase"] == "idle"


def test_oversized_body_is_413(client: TestClient) -> None:
    r = client.post(CONTROL_PREFIX + "/agent/acknowledge", content=b" " * (2 << 20), headers=AUTH)
    assert r.status_code == 413 and r.json()["error"] == "too_large"


def test_acknowledge_once_and_unknown_rollouts(client: TestClient, agent: FakeAgent) -> None:
    r = post(client, "/agent/acknowledge", {"results": [{"rollout_id": "nope", "attempt_index": 0},
                                                        {"rollout_id": "f1", "attempt_index": 0}]})
    assert r.status_code == 404 and r.json()["error"] == "unknown_rollout"
    assert agent.finished == {("f1", 0)}  # nothing acknowledged
    assert post(client, "/agent/acknowledge", {"results": [{"rollout_id": "f1", "attempt_index": 0}]}).status_code == 200
    assert agent.finished == set()
    assert post(client, "/agent/acknowledge", {"results": [{"rollout_id": "f1", "attempt_index": 0}]}).status_code == 404


def test_restore_refuses_another_topology_naming_both(client: TestClient, tmp_path) -> None:
    store = SnapshotStore(str(tmp_path / "s"))
    draft = store.begin()
    draft.part("controller").write_records("replay_index", "replay_index", [])
    saved = "sha256:" + "a" * 64
    published = draft.publish(topology_fingerprint=saved)
    running = "sha256:" + "b" * 64
    r = post(client, "/restore", {**ctl("r1"), "snapshot_url": published.url, "saved_checkpoint_id": "c1",
                                  "part_prefix": "gym/agent/agent0", "topology_fingerprint": running})
    assert r.status_code == 409 and r.json()["error"] == "topology_mismatch"
    assert saved in r.json()["reason"] and running in r.json()["reason"]
    assert client.get(CONTROL_PREFIX + "/status", headers=AUTH).json()["phase"] == "idle"


def test_abort_after_restore_drops_what_was_loaded(client: TestClient, agent: FakeAgent, tmp_path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    post(client, "/prepare", ctl("c1"))
    body = post(client, "/commit", {**ctl("c1"), "draft_url": draft.url, "part_prefix": "gym/agent/agent0"}).json()
    receipt = msgspec.convert(body["part"], type=__import__("schemas").manifest.PartReceipt)
    fp = "sha256:" + "0" * 64
    published = draft.publish(receipts=[receipt], gym_commit=GymCommit(checkpoint_id="c1"), topology_fingerprint=fp)
    post(client, "/resume", ctl("c1"))
    restore = {**ctl("r1"), "snapshot_url": published.url, "saved_checkpoint_id": "c1",
               "part_prefix": "gym/agent/agent0", "topology_fingerprint": fp}
    wrong_saved = post(client, "/restore", {**restore, "saved_checkpoint_id": "c9"})
    assert wrong_saved.status_code == 400 and "'c1'" in wrong_saved.json()["reason"]
    assert post(client, "/restore", restore).status_code == 200 and agent.restored == ["r1", "r2"]
    resumed_before = agent.resumed
    r = post(client, "/abort", ctl("r1"))
    assert r.status_code == 200 and r.json()["phase"] == "idle"
    assert agent.restored == [] and agent.resets == 1 and agent.resumed == resumed_before


def test_a_streamed_or_misdeclared_oversized_body_is_413_before_it_is_buffered(client: TestClient) -> None:
    from schemas.control import MAX_BODY_BYTES

    def chunks():  # no content-length: the limit must hold while streaming
        for _ in range(64):
            yield b" " * (MAX_BODY_BYTES // 8)

    r = client.post(CONTROL_PREFIX + "/prepare", content=chunks(), headers=AUTH)
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    r = client.post(CONTROL_PREFIX + "/prepare", content=b"{}", headers=AUTH | {"content-length": str(1 << 40)})
    assert r.status_code in (400, 413)  # the declared size alone is refused (or the transport rejects the lie)
