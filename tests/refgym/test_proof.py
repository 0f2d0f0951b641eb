"""The proof: snapshot rollouts mid-flight, crash every server, restore into fresh servers, and get
exactly the results of an uninterrupted run, each rollout continuing after its last committed model
call as attempt n+1 (or starting over, if it used the restart-only sandbox).

The save and the restore are NeMo-RL's (``gymkit.GymFleet``'s call orders, driven by
``devtools.gym_fleet``); the rest is what a controller does around them: store and acknowledge the
finished results before the prepare, find the continuations in the snapshot, discard the
continuations that depend on a restart-only resources server, and run every unfinished rollout again
as attempt n+1 after the resume. Gym's files in the snapshot are read as a reader would find them
(the ``snapformat`` CLI) and judged by Gym's own ``TokenEntry``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nemo_gym.token_id_capture.records import TokenEntry, compute_digest, cumulative_tokens

from devtools.gym_fleet import Fleet, Spec, restore_all, resume_all, take_snapshot, wait_until
from gymkit import GymFleet
from gymkit.checkpoint_dir import read_agent_dir
from gymkit.token_store import TokenStore
from schemas.gym_records import AgentContinuationRoot
from schemas.identity import capture_key
from snapformat import SnapshotStore, open_snapshot
from snapformat.cli import main as snapformat_cli

TURNS = 6
#: Finished before the snapshot: the controller stores and acknowledges them before it prepares.
FINISHED = [Spec(f"done{i}", seed=100 + i, turns=2) for i in range(2)]
#: In flight at the snapshot; every fourth also uses the restart-only sandbox.
IN_FLIGHT = [Spec(f"p{i // 4}_g{i % 4}", seed=i, turns=TURNS, tools=("notes", "sandbox") if i % 4 == 3 else ("notes",))
             for i in range(12)]


async def _captured(url: str, keys: set[str]) -> dict[tuple[str, str], dict[str, Any]]:
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


def without_revisions(trajectory: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A trajectory without the resources servers' state revisions (bookkeeping of the server, not
    of the rollout: a session restored as attempt n+1 keeps counting from its saved revision)."""
    return [{**turn, "tool_results": [{k: v for k, v in tr.items() if k != "revision"} for tr in turn["tool_results"]]}
            for turn in trajectory]


def test_snapshot_crash_restore_equals_uninterrupted_run(fleet: Fleet, tmp_path: Path, reference,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    expected = reference(FINISHED + IN_FLIGHT)

    # -- run: a slow model, so turns take a while and the snapshot lands mid-flight --------------
    gym = fleet.gym(model_slow_ms=200)
    gym.start(FINISHED)
    gym.wait_results([s.rollout_id for s in FINISHED])
    gym.start(IN_FLIGHT)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts") if r["rollout_id"].startswith("p")),
               "every in-flight rollout to finish its first turn")

    # -- the save: acknowledge what finished, prepare, commit into the draft, adopt, publish, resume ----
    store = SnapshotStore(str(tmp_path / "store"))
    snap = take_snapshot(gym, store, "ckpt-1")
    assert set(snap.collected) == {s.rollout_id for s in FINISHED}  # stored, then acknowledged
    for rid, result in snap.collected.items():
        assert result["trajectory"] == expected[rid]["trajectory"]
    url = snap.published.url
    opened = open_snapshot(url)
    assert opened.manifest.topology_fingerprint == f"sha256:{snap.fingerprint}"

    # Gym's files verify, as every file of the snapshot does ...
    assert snapformat_cli(["verify", url]) == 0
    assert capsys.readouterr().out.startswith("OK ")
    # ... and the continuation index a reader finds is Gym's own compact file, digest-bound by the
    # reference the agent's commit answered (kept verbatim in the manifest's gym_commit).
    (agent_commit,) = [p for p in opened.manifest.gym_commit.participants if p.component == "responses_api_agents"]
    ref = agent_commit.payload["continuation_index"]
    (entry,) = opened.select(f"gym/{ref['relative_path']}")
    assert entry.kind == "gym_file" and entry.path.startswith(f"{agent_commit.part_prefix}/")
    data = opened.read_bytes(entry)
    assert (hashlib.sha256(data).hexdigest(), len(data), data.count(b"\n")) == (ref["sha256"], ref["bytes"],
                                                                               ref["records"])
    assert snapformat_cli(["cat", url, "continuations"]) == 0
    assert capsys.readouterr().out.encode() == data  # `snapformat cat SNAP continuations` prints Gym's lines
    roots = {}
    for line in data.splitlines():
        root = msgspec.json.decode(line, type=AgentContinuationRoot)
        assert msgspec.json.encode(root) == line  # compact, fields in Gym's order, no spaces
        roots[root.rollout_id] = root
    parked = {s.rollout_id for s in IN_FLIGHT}
    assert set(roots) == parked  # every rollout was parked after a committed model call
    for rid, root in roots.items():
        assert root.attempt_index == 0 and root.capture_key == rid and root.last_committed_model_call_id
        used = {"tools", "sandbox"} if rid.endswith("_g3") else {"tools"}
        assert set(root.resource_state_revisions or {}) == used

    # A rollout whose model call was in flight at the prepare parked at the answer, before its tool
    # calls (Gym's pending_model boundary, the answer in the record); its root names that call.
    _, records, _ = read_agent_dir(Path(url) / agent_commit.part_prefix)
    pending = [r for r in records if r.boundary_kind == "pending_model"]
    assert pending, "no rollout parked at a model's answer (each model call takes 200 ms, a tool call a few)"
    for r in pending:
        assert r.pending_model is not None
        assert r.pending_model.response["model_call_id"] == r.pending_model.model_call_id
        assert roots[r.rollout_id].last_committed_model_call_id == r.pending_model.model_call_id
        assert len(r.agent_state["trajectory"]) == call_index(r.pending_model.model_call_id)  # that turn is not done

    # The model's ledger holds exactly the calls the roots depend on; Gym's TokenEntry accepts each
    # row's token record unchanged, its digest is Gym's, and the token store captured the same record.
    ledger_dir = Path(url) / "gym" / "model-ledger" / "policy0"
    ledger_manifest = json.loads((ledger_dir / "manifest.json").read_bytes())
    assert set(ledger_manifest["rollouts"]) == set(roots)
    committed: list[dict[str, Any]] = []
    for key, root in roots.items():
        rows = [json.loads(line) for line in (ledger_dir / f"{key}.lineage.jsonl").read_bytes().splitlines()]
        assert [r["entry"]["model_call_id"] for r in rows] == [
            f"call-{i}" for i in range(call_index(root.last_committed_model_call_id) + 1)]
        for row in rows:
            token = TokenEntry.model_validate(row["token"])
            assert token.model_dump(mode="json") == row["token"]
            assert token.digest == compute_digest(cumulative_tokens(token))
            committed.append(row["token"])
    captured = asyncio.run(_captured(gym.token_store, set(roots)))
    for token in committed:
        assert captured[(token["rollout_id"], token["model_call_id"])] == token
    # The notes sessions were saved at the revisions the continuations depend on.
    resources_dir = Path(url) / "gym" / "resources" / "tools"
    for rid, root in roots.items():
        saved = json.loads((resources_dir / f"{rid}.a0.json").read_bytes())
        assert saved["state_revision"] == root.resource_state_revisions["tools"]

    # -- the run goes on for a bit, then every server crashes ------------------------------------
    seen = len(gym.ledger())
    wait_until(lambda: len(gym.ledger()) > seen, "progress after the snapshot")
    for p in gym.servers.all:
        p.kill()

    # -- fresh servers: restore (all stay paused), discard restart-only continuations, resume -------
    fresh = fleet.gym()
    assert fresh.fingerprint() == snap.fingerprint
    restored = restore_all(fresh, snap, "restore-1")
    replies = {p.component: p.reply for p in restored.participants}
    assert replies["responses_api_agents"].continuation_index == msgspec.convert(ref, type(
        replies["responses_api_agents"].continuation_index))
    assert {(a.rollout_id, a.attempt_index) for a in replies["responses_api_models"].source_attempts} == {
        (rid, 0) for rid in roots}
    assert replies["resources_servers"].source_checkpoint_id == snap.checkpoint_id
    # Before resume: the restored ledger is the snapshot's; the notes sessions are attempt 1's.
    assert {(e["capture_key"], e["model_call_id"]) for e in fresh.ledger()} == {
        (t["rollout_id"], t["model_call_id"]) for t in committed}
    notes = fresh.resource.get("/sessions")
    for rid, root in roots.items():
        assert notes[f"{rid}.a1"]["revision"] == root.resource_state_revisions["tools"]
    # Which continuations depend on a restart-only resources server: the topology says which those
    # are, the continuation index which rollouts used them.

    async def discard(fleet_: GymFleet) -> list[str]:
        restart_only = set(fleet_.topology.restart_only_resources())
        start_over = sorted(rid for rid, root in roots.items() if set(root.resource_state_revisions or {}) & restart_only)
        result = await fleet_.discard_restored_agent_continuations(
            "restore-1", time.time() + 30, [{"rollout_id": rid, "attempt_index": 1} for rid in start_over])
        assert result.discarded == len(start_over)
        return start_over

    start_over = fresh.fleet(discard)
    assert start_over == sorted(s.rollout_id for s in IN_FLIGHT if "sandbox" in s.tools)
    resume_all(fresh, "restore-1")
    # The controller runs every unfinished rollout again, as attempt n+1.
    fresh.rerun(IN_FLIGHT, {rid: root.attempt_index + 1 for rid, root in roots.items()})
    results = fresh.wait_results([s.rollout_id for s in IN_FLIGHT])

    # -- every result equals the uninterrupted run's -------------------------------------------------
    for rid, res in results.items():
        assert res["outcome"] == "finished", res
        if rid in start_over:  # started over: the notes session counts on from its restored revision
            assert without_revisions(res["trajectory"]) == without_revisions(expected[rid]["trajectory"])
        else:
            assert res["trajectory"] == expected[rid]["trajectory"], f"{rid} differs from the uninterrupted run"
        assert res["input_ids"] == expected[rid]["input_ids"]

    # -- and each rollout continued where it was committed (or started over) ---------------------
    ledger = fresh.ledger()
    continued = 0
    for rid, root in roots.items():
        new_key = capture_key(rid, 1)
        res = results[rid]
        assert (res["attempt_index"], res["capture_key"]) == (1, new_key) == (1, f"{rid}-a1")
        new_calls = [e for e in ledger if e["capture_key"] == new_key]
        old_calls = {e["model_call_id"] for e in ledger if e["capture_key"] == rid}
        k = call_index(root.last_committed_model_call_id)
        assert old_calls == {f"call-{i}" for i in range(k + 1)}  # attempt 0 ends at its committed call
        if rid in start_over:  # used the sandbox: thrown away, attempt 1 from the first turn
            assert [e["model_call_id"] for e in new_calls] == [f"call-{i}" for i in range(TURNS)]
            assert new_calls[0]["parent_call_id"] is None
            assert res["turn_keys"] == [new_key] * TURNS
            continue
        assert [e["model_call_id"] for e in new_calls] == [f"call-{i}" for i in range(k + 1, TURNS)]
        first = new_calls[0]
        assert first["parent_call_id"] == root.last_committed_model_call_id
        assert first["parent_resolution"] == "resolved"  # its parent is attempt 0's call, restored
        assert res["turn_keys"] == [rid] * (k + 1) + [new_key] * (TURNS - k - 1)
        continued += 1
    assert continued, "no rollout continued after a committed model call"
    # The finished results were acknowledged before the save: nothing of them came back.
    assert not {s.rollout_id for s in FINISHED} & set(fresh.results())


def test_on_an_object_store_gym_files_go_through_staging_folders(fleet: Fleet, seaweed, aws_env, new_bucket,
                                                                  reference) -> None:
    """Store on SeaweedFS: the servers write into a local staging folder, which is adopted (uploaded)
    into the draft; the restore downloads the Gym parts (checked) into a staging folder of its own.
    Both folders are gone afterwards; the restored rollouts finish as an uninterrupted run does."""
    specs = [Spec(f"s3r{i}", seed=40 + i, turns=6) for i in range(3)]
    expected = reference(specs)
    aws_env(seaweed)
    store = SnapshotStore(f"s3://{new_bucket(seaweed)}/run")
    gym = fleet.gym(model_slow_ms=100)
    gym.start(specs)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts")), "every first turn")
    snap = take_snapshot(gym, store, "ckpt-s3")
    staged = Path(snap.commit.checkpoint_dir)
    assert not staged.exists()  # the staging folder was removed once the draft held the parts
    opened = open_snapshot(snap.published.url)
    assert snap.published.url.startswith("s3://") and {p.part_prefix for p in opened.manifest.gym_commit.participants} == {
        f"gym/agent/instance-{hashlib.sha256(b'agent0').hexdigest()}", "gym/model-ledger/policy0", "gym/resources/tools"}
    for p in gym.servers.all:
        p.kill()
    fresh = fleet.gym()
    restored = restore_all(fresh, snap, "restore-s3")
    assert not Path(restored.checkpoint_dir).exists()  # the download was removed after the restore
    (agent,) = [p.reply for p in restored.participants if p.component == "responses_api_agents"]
    resume_all(fresh, "restore-s3")
    fresh.rerun(specs, {s.rollout_id: 1 for s in specs})
    results = fresh.wait_results([s.rollout_id for s in specs])
    assert agent.records == len(specs)
    for s in specs:
        assert results[s.rollout_id]["trajectory"] == expected[s.rollout_id]["trajectory"]
