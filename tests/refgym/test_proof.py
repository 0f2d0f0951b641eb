"""The proof of issue 4: snapshot rollouts mid-flight, crash every server, restore, and get exactly
the trajectories of an uninterrupted run, each rollout continuing after its last committed model
call (or starting over if it used the restart-only sandbox).

The test drives the protocol itself, call by call, in the documented order (no coordinator, no
``gymkit.GymFleet``): each server's typed control client, one call at a time.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nemo_gym.token_id_capture.records import TokenEntry, compute_digest, cumulative_tokens

from devtools.gym_fleet import Fleet, Spec, wait_until
from gymkit import gym_commit
from gymkit.token_store import TokenStore
from schemas.identity import capture_key
from snapformat import SnapshotStore, open_snapshot, verify_snapshot
from snapformat.token_rows import iter_entries

TURNS = 4
# Finished before the snapshot: two are acknowledged (gone), two are not (must survive it).
FINISHED = [Spec(f"done{i}", seed=100 + i, turns=2) for i in range(4)]
# In flight at the snapshot; every fourth also uses the restart-only sandbox.
IN_FLIGHT = [Spec(f"p{i // 4}_g{i % 4}", seed=i, turns=TURNS, tools=("notes", "sandbox") if i % 4 == 3 else ("notes",))
             for i in range(12)]


async def _captured(url: str, keys: set[str]) -> dict[tuple[str, str], dict]:
    """Every TokenEntry the store holds for ``keys``, read as a trainer would (a fresh instance)."""
    store = TokenStore(url)
    try:
        frozen = [await store.freeze_records(k) for k in sorted(keys)]
    finally:
        await store.close()
    return {(e["rollout_id"], e["model_call_id"]): e for f in frozen for e in f.entries}


def call_index(call_id: str | None) -> int:
    """``call-3`` -> 3; no call yet -> -1."""
    return -1 if call_id is None else int(call_id.removeprefix("call-"))


def test_snapshot_crash_restore_equals_uninterrupted_run(fleet: Fleet, tmp_path: Path, reference) -> None:
    expected = reference(FINISHED + IN_FLIGHT)

    # -- run: a slow model, so turns take a while and the snapshot lands mid-flight ------------
    gym = fleet.gym(model_slow_ms=200)
    gym.start(FINISHED)
    gym.wait_results([s.rollout_id for s in FINISHED])
    gym.agent.acknowledge([("done0", 0), ("done1", 0)])
    gym.start(IN_FLIGHT)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts") if r["rollout_id"].startswith("p")),
               "every in-flight rollout to finish its first turn")

    # -- snapshot, driven call by call ------------------------------------------------------------
    ck, deadline = "ckpt-1", time.time() + 30
    assert gym.model.prepare(ck, deadline).phase == "prepared"  # pause: refuse new calls, drain
    assert gym.agent.prepare(ck, deadline).phase == "prepared"  # park every rollout at a turn end
    assert gym.resource.prepare(ck, deadline).phase == "prepared"  # freeze sessions
    for c in gym.clients:
        assert c.status().in_flight == 0
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    agent = gym.agent.commit(ck, deadline, draft.url)
    model = gym.model.commit(ck, deadline, draft.url, continuations=[agent.part])
    resource = gym.resource.commit(ck, deadline, draft.url)
    commits = [(gym.agent.caps, agent), (gym.model.caps, model), (gym.resource.caps, resource)]  # commit order
    fingerprint = gym.fingerprint()
    published = draft.publish(receipts=[agent.part, model.part, resource.part],
                              gym_commit=gym_commit(ck, commits), topology_fingerprint=fingerprint)
    for c in (gym.resource, gym.model, gym.agent):  # resume order: what agents call first opens first
        assert c.resume(ck).admission == "accepting"

    snap = open_snapshot(published.url)
    assert verify_snapshot(snap).ok  # every byte, and every token-index entry points at its call's row
    continuations = {c.rollout_id: c for c in snap.records("continuations")}
    states = {s.rollout_id: s for s in snap.records("agent_state")}
    saved_ledger = {(e.capture_key, e.model_call_id) for e in snap.records("ledger")}
    saved_sessions = {s.session_id: s.state_revision for s in snap.records("sessions")}
    # Gym's own code judges the model server's token records: each validates as Gym's TokenEntry
    # unchanged, and its digest is Gym's compute_digest of its cumulative tokens.
    (tokens,) = snap.files("token_capture_rows")
    for entry in iter_entries(snap.open_rows(tokens), tokens.path):
        gym_entry = TokenEntry.model_validate(entry)
        assert gym_entry.model_dump(mode="json") == entry
        assert gym_entry.digest == compute_digest(cumulative_tokens(gym_entry))
    # The model server captured every call through its token store (Gym's TokenSink) before answering;
    # the snapshot's part is a copy of the committed ones, equal to what the store holds.
    committed = list(iter_entries(snap.open_rows(tokens), tokens.path))
    captured = asyncio.run(_captured(gym.token_store, {e["rollout_id"] for e in committed}))
    for entry in committed:
        assert captured[(entry["rollout_id"], entry["model_call_id"])] == entry
    # Sessions name their resource server as the participant and the continuations do.
    resource_name = gym.resource.caps.name
    assert {s.resource for s in snap.records("sessions")} == {resource_name}
    assert {name for c in snap.records("continuations") for name in (c.resource_state_revisions or {})} <= {resource_name}
    # Finished results: the acknowledged ones are gone, the others are kept as unacknowledged.
    assert {"done2", "done3"} <= {rid for rid, s in states.items() if s.status == "finished_unacked"}
    assert not {"done0", "done1"} & set(states)
    parked = {rid: c for rid, c in continuations.items() if rid.startswith("p")}
    assert parked, "the snapshot caught no rollout in flight"
    # Every rollout is in the snapshot: parked, or finished and not yet acknowledged.
    assert {s.rollout_id for s in IN_FLIGHT} <= set(states)
    # The model's part holds exactly the committed calls the continuations depend on, and each
    # call's token-capture row (found through the token index) holds that turn's tokens.
    assert saved_ledger == {(c.capture_key, f"call-{i}") for c in parked.values()
                            for i in range(call_index(c.last_committed_model_call_id) + 1)}
    for rid, c in parked.items():
        for i, turn in enumerate(states[rid].state["trajectory"]):
            row = snap.token_rows(c.capture_key, f"call-{i}").to_pylist()[0]
            assert (row["generation_token_ids"], row["generation_log_probs"]) == \
                (turn["generation_token_ids"], turn["generation_log_probs"])

    # -- the run goes on for a bit, then every server crashes ------------------------------------
    seen = len(gym.ledger())
    wait_until(lambda: len(gym.ledger()) > seen, "progress after the snapshot")
    for p in gym.trio.all:
        p.kill()

    # -- fresh servers: restore (all stay paused), discard restart-only rollouts, resume ---------
    fresh = fleet.gym()
    assert fresh.fingerprint() == fingerprint
    rid_, deadline = "restore-1", time.time() + 30
    answers = {c.caps.component: c.restore(rid_, deadline, published.url, ck, fingerprint) for c in fresh.clients}
    assert {a.phase for a in answers.values()} == {"restored_paused"}
    restored = {c["rollout_id"]: c for c in answers["agent"].payload["continuations"]}
    assert set(restored) == set(continuations)
    for rid, c in continuations.items():
        assert restored[rid]["attempt_index"] == c.attempt_index + 1
        assert restored[rid]["capture_key"] == capture_key(rid, c.attempt_index + 1)
        assert restored[rid]["after_call"] == c.last_committed_model_call_id
    # Before resume: the restored ledger and sessions are exactly what the snapshot holds.
    assert {(e["capture_key"], e["model_call_id"]) for e in fresh.ledger()} == saved_ledger
    notes = fresh.resource.get("/sessions")["notes"]
    assert {sid: s["revision"] for sid, s in notes.items()} == saved_sessions
    for rid, c in parked.items():
        if c.resource_state_revisions:
            assert notes[rid]["revision"] == c.resource_state_revisions["tools"]
    start_over = sorted(rid for rid, c in restored.items() if c["restart_only"])
    assert start_over, "no rollout used the restart-only sandbox before the snapshot"
    assert fresh.agent.discard(rid_, deadline, [(rid, restored[rid]["attempt_index"]) for rid in start_over])
    for c in (fresh.resource, fresh.model, fresh.agent):
        assert c.resume(rid_).admission == "accepting"

    results = fresh.wait_results([s.rollout_id for s in IN_FLIGHT] + ["done2", "done3"])
    assert "done0" not in fresh.results() and "done1" not in fresh.results()

    # -- every trajectory equals the uninterrupted run's -----------------------------------------
    for rid, res in results.items():
        assert res["outcome"] == "finished", res
        assert res["trajectory"] == expected[rid]["trajectory"], f"{rid} differs from the uninterrupted run"

    # -- and each rollout continued where it was committed (or started over) ---------------------
    ledger = fresh.ledger()
    continued = 0
    for rid, c in parked.items():
        new_key = capture_key(rid, c.attempt_index + 1)
        res = results[rid]
        assert (res["attempt_index"], res["capture_key"]) == (c.attempt_index + 1, new_key) == (1, f"{rid}-a1")
        new_calls = [e for e in ledger if e["capture_key"] == new_key]
        old_calls = {e["model_call_id"] for e in ledger if e["capture_key"] == c.capture_key}
        k = call_index(c.last_committed_model_call_id)
        if rid in start_over:  # used the sandbox: thrown away, run n+1 from the first turn
            assert states[rid].restart_only == ["sandbox"]
            assert [e["model_call_id"] for e in new_calls] == [f"call-{i}" for i in range(TURNS)]
            assert new_calls[0]["parent_call_id"] is None
            assert res["turn_keys"] == [new_key] * TURNS
            continue
        # The old run is closed: no call of attempt n beyond the restored ones.
        assert old_calls == {f"call-{i}" for i in range(k + 1)}
        assert [e["model_call_id"] for e in new_calls] == [f"call-{i}" for i in range(k + 1, TURNS)]
        first = new_calls[0]
        assert first["parent_call_id"] == c.last_committed_model_call_id
        assert first["parent_resolution"] == ("resolved" if k >= 0 else "root")
        assert res["turn_keys"] == [c.capture_key] * (k + 1) + [new_key] * (TURNS - k - 1)
        assert res["trajectory"][:k + 1] == states[rid].state["trajectory"]  # the kept turns, unchanged
        continued += k >= 0
    assert continued, "no rollout continued after a committed model call"
    for rid, state in states.items():  # unacknowledged finished results came back as they were
        if state.status == "finished_unacked":
            assert (results[rid]["attempt_index"], results[rid]["capture_key"]) == (0, rid)
            assert results[rid]["trajectory"] == state.state["trajectory"]
