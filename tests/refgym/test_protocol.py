"""The control protocol as the reference servers answer it over real HTTP: tokens, bad bodies,
out-of-order and repeated calls, stale and conflicting ids, unknown rollouts, records that break
Gym's rules, and restores that must be refused. Every refusal is a clear 4xx and changes nothing.

One trio (module-scoped) serves most tests; each test leaves it idle. A fresh trio restores.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.gym_fleet import (
    Fleet,
    Gym,
    Spec,
    TakenSnapshot,
    listening_addresses,
    ok,
    refused,
    restore_all,
    take_snapshot,
    wait_until,
)
from schemas.control import CONTROL_PREFIX, MAX_BODY_BYTES
from schemas.gym_records import AgentContinuationRoot, AgentStateRecord
from schemas.topology import topology_fingerprint
from snapformat import SnapshotStore

BEFORE = [Spec(f"pre{i}", seed=400 + i, turns=1) for i in range(2)]  # finished before the snapshot
LONG = [Spec(f"q{i}", seed=500 + i, turns=8, tools=("notes", "sandbox") if i == 3 else ("notes",)) for i in range(4)]


class UncheckedContinuation(AgentContinuationRoot):
    """A continuation line as a broken writer would produce it: Gym's capture-key check skipped."""

    def __post_init__(self) -> None:
        pass


def error(resp: Any) -> tuple[int, str]:
    """Status and error code of a raw answer (a plain route's, or a control route's sent raw)."""
    return resp.status_code, resp.json()["error"]


@pytest.fixture(scope="module")
def gym(module_fleet: Fleet) -> Gym:
    return module_fleet.gym(model_slow_ms=100)


@pytest.fixture(scope="module")
def published(gym: Gym, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TakenSnapshot]:
    """A snapshot of ``gym`` with two finished results and four rollouts parked mid-flight; the run
    then finishes, so the trio is quiet for the other tests."""
    gym.start(BEFORE)
    gym.wait_results([s.rollout_id for s in BEFORE])
    gym.start(LONG)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts")), "every rollout's first turn")
    snap = take_snapshot(gym, SnapshotStore(str(tmp_path_factory.mktemp("store"))), "ckpt-base")
    gym.wait_results([s.rollout_id for s in LONG])
    yield snap


def test_control_routes_need_the_bearer_token(gym: Gym) -> None:
    for c in gym.clients:
        for token in ("", "wrong-token"):
            assert error(c.request("GET", f"{CONTROL_PREFIX}/capabilities", token=token)) == (401, "unauthorized")
            body = {"checkpoint_id": "ck-tok", "deadline": time.time() + 30}
            assert error(c.request("POST", f"{CONTROL_PREFIX}/prepare", body, token=token)) == (401, "unauthorized")
        assert c.status().phase == "idle"
        assert c.http.get("/healthz").status_code == 200  # plain routes carry no token
    for server in gym.trio.all:
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1 only
    caps = {c.caps.component: c.caps for c in gym.clients}
    assert (caps["model"].name, caps["agent"].name, caps["resource"].name) == ("policy0", "agent0", "tools")
    assert caps["resource"].restart_only_resources == ["sandbox"]
    assert {c.checkpoint_mode for c in caps.values()} == {"export_restore"}


@pytest.mark.parametrize("body", [
    b"{not json",
    b"[]",
    b'{"checkpoint_id": "ck-x"}',  # no deadline
    b'{"checkpoint_id": "ck-x", "deadline": 4102444800, "extra": 1}',  # unknown field
    b'{"checkpoint_id": "../etc", "deadline": 4102444800}',  # not a checkpoint id
    b'{"checkpoint_id": "ck-x", "deadline": -1}',
    b'{"checkpoint_id": 7, "deadline": 4102444800}',
])
def test_malformed_control_calls_are_400_and_change_nothing(gym: Gym, body: bytes) -> None:
    for c in gym.clients:
        assert error(c.request("POST", f"{CONTROL_PREFIX}/prepare", content=body)) == (400, "bad_request")
        assert (c.status().phase, c.status().checkpoint_id) == ("idle", None)


def test_oversized_bodies_are_413(gym: Gym) -> None:
    huge = b'{"checkpoint_id": "ck-x", "deadline": 4102444800, "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
    for c in gym.clients:
        assert error(c.request("POST", f"{CONTROL_PREFIX}/prepare", content=huge)) == (413, "too_large")
        assert c.status().phase == "idle"
    assert error(gym.model.post("/v1/responses", content=huge)) == (413, "too_large")
    assert error(gym.agent.post("/rollouts", content=huge)) == (413, "too_large")


def test_plain_routes_refuse_bad_input_clearly(gym: Gym, published: TakenSnapshot) -> None:
    before = gym.ledger()
    call = {"rollout_id": "z1", "attempt_index": 0, "capture_key": "z1", "model_call_id": "call-0", "turn_index": 0,
            "prompt_token_ids": [1, 2, 3]}
    for bad in ({"capture_key": "z1-a1"}, {"attempt_index": 2, "capture_key": "z1-a3"}, {"rollout_id": "z1-a2"},
                {"attempt_index": 1, "capture_key": "z1-a01"}):
        assert error(gym.model.post("/v1/responses", {**call, **bad})) == (400, "invalid_record")
    assert error(gym.model.post("/v1/responses", {**call, "prompt_token_ids": [10**9]})) == (400, "bad_request")
    assert error(gym.model.post("/v1/responses", {**call, "temperature": 1})) == (400, "bad_request")
    assert gym.ledger() == before
    assert error(gym.agent.post("/rollouts", {"rollout_id": "r-a1", "seed": 1, "turns": 2})) == (400, "invalid_record")
    shell = {"rollout_id": "r1", "seed": 1, "turns": 2, "tools": ["shell"]}
    assert error(gym.agent.post("/rollouts", shell)) == (400, "bad_request")
    assert error(gym.agent.post("/rollouts", {"rollout_id": "q0", "seed": 1, "turns": 2})) == (409, "conflict")
    tool = {"session_id": "s1", "expected_revision": 0, "args": {"value": 3}}
    assert error(gym.resource.post("/tools/shell", tool)) == (404, "not_found")
    assert error(gym.resource.post("/tools/notes", {**tool, "args": {"code": 3}})) == (400, "bad_request")
    assert error(gym.resource.post("/tools/notes", {**tool, "expected_revision": 5})) == (409, "revision_mismatch")
    assert "s1" not in gym.resource.get("/sessions")["notes"]


def test_paused_servers_refuse_new_work_with_503_until_resumed(gym: Gym) -> None:
    ck = "ck-503"
    for c in gym.clients:
        c.prepare(ck, time.time() + 30)
    call = {"rollout_id": "direct0", "attempt_index": 0, "capture_key": "direct0", "model_call_id": "call-0",
            "turn_index": 0, "prompt_token_ids": [1, 2, 3]}
    tool = {"session_id": "direct0", "expected_revision": 0, "args": {"value": 1}}
    refused = [gym.model.post("/v1/responses", call), gym.resource.post("/tools/notes", tool),
               gym.resource.post("/sessions/direct0/reset"),
               gym.agent.post("/rollouts", {"rollout_id": "direct0", "seed": 1, "turns": 1})]
    for resp in refused:
        assert error(resp) == (503, "paused") and resp.headers["retry-after"] == "1"
    assert not any(e["rollout_id"] == "direct0" for e in gym.ledger())
    for c in (gym.resource, gym.model, gym.agent):
        c.abort(ck)
    assert ok(gym.model.post("/v1/responses", call))["model_call_id"] == "call-0"
    assert ok(gym.model.post("/v1/responses", call))["replayed"] is True  # a retried call gets the recorded answer
    assert error(gym.model.post("/v1/responses", {**call, "prompt_token_ids": [4]})) == (409, "conflict")


def test_out_of_order_calls_are_409(gym: Gym) -> None:
    deadline, nowhere = time.time() + 30, "/nowhere/snapshots/snap-0000000001-00000000"
    for c in gym.clients:
        assert refused(c.commit, "ck-ooo", deadline, nowhere).code == (409, "wrong_phase")
        assert refused(c.resume, "ck-ooo").code == (409, "wrong_phase")
    assert refused(gym.agent.discard, "ck-ooo", deadline, [("q0", 1)]).code == (409, "wrong_phase")
    gym.agent.prepare("ck-ooo", deadline)
    assert refused(gym.agent.restore, "ck-ooo", deadline, nowhere, "a", "b").code == (409, "wrong_phase")
    assert refused(gym.agent.restore, "ck-new", deadline, nowhere, "a", "b").code == (409, "conflicting_checkpoint")
    assert refused(gym.agent.prepare, "ck-past", time.time() - 1).code == (409, "conflicting_checkpoint")
    assert gym.agent.abort("ck-ooo").phase == "idle"
    assert refused(gym.agent.prepare, "ck-past", time.time() - 1).code == (409, "deadline_passed")
    assert gym.agent.status().phase == "idle"


def test_repeated_calls_get_the_same_answer_and_old_or_other_ids_are_fenced(gym: Gym, tmp_path: Path) -> None:
    ck, deadline = "ck-rep", time.time() + 30
    for c in gym.clients:
        first = c.prepare(ck, deadline)
        assert c.prepare(ck, deadline) == first
        assert refused(c.prepare, "ck-other", deadline).code == (409, "conflicting_checkpoint")
    draft = SnapshotStore(str(tmp_path / "store")).begin()
    agent = gym.agent.commit(ck, deadline, draft.url)
    assert gym.agent.commit(ck, deadline, draft.url) == agent
    receipt = agent.part
    model = gym.model.commit(ck, deadline, draft.url, [receipt])
    assert gym.model.commit(ck, deadline, draft.url, [receipt]) == model
    resource = gym.resource.commit(ck, deadline, draft.url)
    assert gym.resource.commit(ck, deadline, draft.url) == resource
    assert refused(gym.model.commit, "ck-other", deadline, draft.url).code == (409, "conflicting_checkpoint")
    for c in (gym.resource, gym.model, gym.agent):
        first = c.resume(ck)
        assert c.resume(ck) == first
        assert refused(c.prepare, ck, deadline).code == (409, "stale_checkpoint")
        assert c.status().admission == "accepting"


def test_acknowledge_once_and_unknown_rollouts_change_nothing(gym: Gym, published: TakenSnapshot) -> None:
    before = gym.results()
    assert {"pre0", "pre1"} <= set(before)
    for refs in ([("nope", 0)], [("pre0", 0), ("nope", 0)], [("pre0", 3)]):
        assert refused(gym.agent.acknowledge, refs).code == (404, "unknown_rollout")
        assert gym.results() == before
    assert refused(gym.model.acknowledge, [("pre0", 0)]).status == 404  # not an agent
    assert gym.agent.acknowledge([("pre0", 0)]) == {"acknowledged": ["pre0"]}
    assert refused(gym.agent.acknowledge, [("pre0", 0)]).code == (404, "unknown_rollout")  # acknowledged once
    assert set(gym.results()) == set(before) - {"pre0"}

    gym.agent.start_rollout("hold0", seed=1, turns=30)
    gym.agent.prepare("ck-ack", time.time() + 30)  # parked, so certainly not finished
    assert refused(gym.agent.acknowledge, [("hold0", 0)]).code == (404, "unknown_rollout")
    assert gym.agent.abort("ck-ack").admission == "accepting"
    assert gym.agent.get("/rollouts/hold0")["outcome"] == "running"


def test_model_commit_refuses_continuations_that_break_the_contract(
        gym: Gym, published: TakenSnapshot, tmp_path: Path) -> None:
    ck, deadline = "ck-bad", time.time() + 30
    for c in gym.clients:
        c.prepare(ck, deadline)
    draft = SnapshotStore(str(tmp_path / "store")).begin()
    bad_key = draft.part("gym/agent/fake1")
    bad_key.write_records("continuations", "continuations", [UncheckedContinuation(
        rollout_id="q0", attempt_index=0, capture_key="q0-a7", last_committed_model_call_id="call-0",
        resource_state_revisions=None)])
    unknown_call = draft.part("gym/agent/fake2")
    unknown_call.write_records("continuations", "continuations", [AgentContinuationRoot(
        rollout_id="never", attempt_index=0, capture_key="never", last_committed_model_call_id="call-3",
        resource_state_revisions=None)])
    ledger = gym.ledger()

    bad = refused(gym.model.commit, ck, deadline, draft.url, [bad_key.close()])
    assert bad.code == (400, "invalid_record")
    assert "'q0-a7'" in bad.reason
    bad = refused(gym.model.commit, ck, deadline, draft.url, [unknown_call.close()])
    assert bad.code == (409, "invalid_record")
    assert "never served" in bad.reason
    assert gym.model.status().phase == "prepared"  # still prepared: the commit can be retried
    assert gym.ledger() == ledger
    assert gym.model.commit(ck, deadline, draft.url).payload == {"calls": 0, "rollouts": 0}
    for c in (gym.resource, gym.model, gym.agent):  # the coordinator gives up on this one
        assert c.abort(ck).phase == "idle"


def test_refused_restores_change_nothing_then_a_good_one_continues_every_rollout(
        fleet: Fleet, gym: Gym, published: TakenSnapshot, reference, tmp_path: Path) -> None:
    expected = reference(BEFORE + LONG)
    fresh = fleet.gym()
    snap_url, saved, deadline = published.published.url, published.checkpoint_id, time.time() + 30

    def untouched() -> None:
        assert fresh.agent.get("/rollouts") == [] and fresh.ledger() == []
        assert fresh.resource.get("/sessions") == {"notes": {}, "sandbox": {}}

    # Not a published snapshot.
    nowhere = str(tmp_path / "nowhere" / "snapshots" / "snap-0000000001-00000000")
    not_published = refused(fresh.agent.restore, "r-0", deadline, nowhere, saved, fresh.fingerprint())
    assert not_published.code == (400, "bad_request")

    # The running topology has another resource server than the one that took the snapshot.
    other = fleet.client(fleet.server("resource", "tools2").url)
    running = topology_fingerprint([c.capabilities().contract() for c in (fresh.model, fresh.agent, other)])
    for c in (fresh.model, fresh.agent):
        mismatch = refused(c.restore, "r-1", deadline, snap_url, saved, running)
        assert mismatch.code == (409, "topology_mismatch")
        assert running in mismatch.reason and published.fingerprint in mismatch.reason
        assert c.status().phase == "idle"
    untouched()

    # A snapshot whose continuation line breaks Gym's capture-key rule.
    bad = SnapshotStore(str(tmp_path / "bad")).begin()
    part = bad.part("gym/agent/agent0")
    part.write_records("continuations", "continuations", [UncheckedContinuation(
        rollout_id="q9", attempt_index=0, capture_key="q9-a1", last_committed_model_call_id="call-0",
        resource_state_revisions=None)])
    part.write_records("agent_state", "agent_state", [AgentStateRecord(
        rollout_id="q9", attempt_index=0, capture_key="q9", status="parked", turn_index=0, state={})])
    bad_url = bad.publish(topology_fingerprint=fresh.fingerprint()).url
    invalid = refused(fresh.agent.restore, "r-2", deadline, bad_url, "ckpt-bad", fresh.fingerprint())
    assert invalid.code == (400, "invalid_record") and "'q9-a1'" in invalid.reason
    untouched()
    assert fresh.agent.status().phase == "idle"  # a refused load drops what it read: no abort needed
    untouched()

    # The real restore; repeats are answered the same, other ids are refused.
    answers = restore_all(fresh, published, "r-3")
    again = fresh.agent.restore("r-3", deadline, snap_url, saved, fresh.fingerprint())
    assert again == answers["agent"]
    other_id = refused(fresh.agent.restore, "r-4", deadline, snap_url, saved, fresh.fingerprint())
    assert other_id.code == (409, "conflicting_checkpoint")
    restored = {c["rollout_id"]: c for c in answers["agent"].payload["continuations"]}
    assert set(restored) == {s.rollout_id for s in LONG}
    rollouts = fresh.agent.get("/rollouts")
    for refs in ([("nope", 1)], [("q0", 0)], [("pre1", 0)]):  # unknown, the saved attempt (not n+1), finished
        assert refused(fresh.agent.discard, "r-3", deadline, refs).code == (404, "unknown_rollout")
    assert fresh.agent.get("/rollouts") == rollouts
    start_over = [(rid, c["attempt_index"]) for rid, c in restored.items() if c["restart_only"]]
    assert [rid for rid, _ in start_over] == ["q3"]
    first = fresh.agent.discard("r-3", deadline, start_over)
    assert fresh.agent.discard("r-3", deadline, start_over) == first
    for c in (fresh.resource, fresh.model, fresh.agent):
        c.resume("r-3")

    results = fresh.wait_results([s.rollout_id for s in BEFORE + LONG])
    for rid, res in results.items():
        assert res["outcome"] == "finished", res
        assert res["trajectory"] == expected[rid]["trajectory"]
        assert res["attempt_index"] == (1 if rid in restored else 0)
