"""The save-and-restore drive shared by ``test_plain_participant`` and
``tests/snapformat/test_adopt_cross_host``: a Gym deployment of two real processes (the reference
model server and the plain-files agent of :mod:`tests.gymkit.plain_participant`) on one loopback
"host", driven by the NemoGym actor (called directly with asyncio, no Ray), and checks that
recompute Gym's digests from the bytes with hashlib, json and tarfile only (the reference's §5-7).

The scenario: rollouts ``r0``-``r2`` (4 turns each) wait at their boundary 1 and park when the
agent prepares; ``r3`` completes before the checkpoint and its result is acknowledged with the
receipt the agent issued. After a restore into fresh processes, ``r0#1`` and ``r1#1`` continue
from turn 2 (their first model call names the restored call as its parent: ``resolved`` by the
restored ledger), ``r2#1`` is discarded and starts over, and attempt 0 is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import socket
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from coordinator.gym_actor import NemoGym
from tests.gymkit.plain_participant import Proc, launch

REPO = Path(__file__).resolve().parents[2]
TOKEN = "plain-files-secret"
MODEL = "policy0"
AGENT = "plain-agent"
AGENT_DIR = f"agent/instance-{hashlib.sha256(AGENT.encode()).hexdigest()}"
LEDGER_DIR = f"model-ledger/{MODEL}"
HELD = ("r0", "r1", "r2")  # parked at boundary HOLD_AT of TURNS when the checkpoint is taken
DONE = "r3"  # completed before it; acknowledged so that the agent can prepare
TURNS, HOLD_AT = 4, 1


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    out = dict(os.environ) | (extra or {})
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    return out


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Gym:
    """One host's Gym servers, each its own process."""

    model: Proc
    agent: Proc

    @property
    def servers(self) -> dict[str, str]:
        """NeMo-RL's ``{server_name: url}`` (server names equal the capability names)."""
        return {MODEL: self.model.url, AGENT: self.agent.url}

    def kill(self) -> None:
        for p in (self.agent, self.model):
            p.kill()


def start_gym(workdir: Path, host: str, tag: str) -> Gym:
    """The reference model server and the plain agent, both bound to ``host``, started at once
    (the model's port is picked first so the agent can be told where it is)."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / "token"
    token_file.write_text(TOKEN)
    port = free_port(host)
    model = launch(["-m", "refgym.serve", "--component", "model", "--name", MODEL, "--token-file", str(token_file)],
                   host, workdir, f"model-{tag}", REPO, env(), port=port)
    agent = launch(["-m", "tests.gymkit.plain_participant", "--name", AGENT, "--token-file", str(token_file),
                    "--model-url", f"http://{host}:{port}"], host, workdir, f"agent-{tag}", REPO, env())
    try:
        model.wait_ready()
        agent.wait_ready()
    except BaseException:
        agent.kill()
        model.kill()
        raise
    return Gym(model=model, agent=agent)


# -- independent recomputations (the reference's formulas) ------------------------------------------------
def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def capabilities(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/ng-control/v1/capabilities", timeout=10) as resp:
        return json.loads(resp.read())


def reference_fingerprint(servers: dict[str, str]) -> str:
    """§5: contracts (features dropped, roles kept as null) sorted by (component, server name,
    participant name), hashed as sort_keys compact ASCII JSON; bare hex."""
    contracts = []
    for server_name, url in servers.items():
        c = capabilities(url)
        contracts.append({"participant": {"server_name": server_name, "component": c["component"],
                                          "participant_name": c["name"]},
                          "schema_version": c["schema_version"], "admission_states": sorted(c["admission_states"]),
                          "checkpoint_mode": c["checkpoint_mode"], "concurrency_contract": c["concurrency_contract"],
                          "multi_process": {"mode": c["multi_process"]["mode"],
                                            "num_workers": c["multi_process"]["num_workers"]},
                          "instance_role": c["instance_role"]})
    contracts.sort(key=lambda c: (c["participant"]["component"], c["participant"]["server_name"],
                                  c["participant"]["participant_name"]))
    doc = {"schema_version": 1, "participants": contracts}
    return sha(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def receipt_formula(rid: str, n: int, generation: int, result: dict[str, Any]) -> dict[str, Any]:
    """§7, recomputed here."""
    digest = sha(json.dumps(result, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8"))
    return {"rollout_id": rid, "attempt_index": n, "execution_generation": generation,
            "result_identity": str(result["id"]), "result_digest": digest}


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (a snapshot's own ``part-manifest.json`` left out), by relative name."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "part-manifest.json"}


def _check_ref(checkpoint_dir: Path, ref: dict[str, Any], folder: str) -> list[bytes]:
    assert set(ref) == {"schema_version", "relative_path", "sha256", "records", "bytes"} and ref["schema_version"] == 1
    assert ref["relative_path"].startswith(folder + "/") and ".." not in ref["relative_path"].split("/")
    raw = (checkpoint_dir / ref["relative_path"]).read_bytes()
    lines = [line for line in raw.split(b"\n") if line.strip()]
    assert (sha(raw), len(raw), len(lines)) == (ref["sha256"], ref["bytes"], ref["records"]), ref["relative_path"]
    assert raw == b"".join(line + b"\n" for line in lines)  # each row ends in \n, no blank lines
    for line in lines:  # compact JSON, no spaces
        assert json.dumps(json.loads(line), separators=(",", ":"), ensure_ascii=False).encode() == line, line
    return lines


def _canonical(data: bytes, indent: int) -> None:
    canon = json.dumps(json.loads(data), sort_keys=True, indent=indent).encode()
    assert data in (canon, canon + b"\n"), f"manifest.json is not sort_keys with indent {indent}"


def check_agent_files(checkpoint_dir: Path, reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent folder against its commit reply and its own manifest, byte by byte; its records."""
    folder = checkpoint_dir / AGENT_DIR
    data = (folder / "manifest.json").read_bytes()
    assert sha(data) == reply["manifest_digest"]
    _canonical(data, 2)
    m = json.loads(data)
    assert set(m) == {"schema_version", "checkpoint_id", "instance_name", "archives", "record_index", "records",
                      "continuation_index"}
    assert (m["schema_version"], m["instance_name"]) == (2, AGENT)
    assert reply["continuation_index"] == m["continuation_index"] and reply["records"] == m["records"]
    index = [json.loads(line) for line in _check_ref(checkpoint_dir, m["record_index"], AGENT_DIR)]
    roots = [json.loads(line) for line in _check_ref(checkpoint_dir, m["continuation_index"], AGENT_DIR)]
    members: dict[tuple[str, str], bytes] = {}
    for a in m["archives"]:
        raw = (folder / a["name"]).read_bytes()
        assert (sha(raw), len(raw)) == (a["sha256"], a["bytes"])
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
            infos = tf.getmembers()
            assert len(infos) == a["members"] <= 512
            for info in infos:
                assert (info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname) == (0o600, 0, 0, 0, "", "")
                members[(a["name"], info.name)] = tf.extractfile(info).read()  # type: ignore[union-attr]
    records = []
    for row in index:
        assert list(row) == ["rollout_id", "attempt_index", "archive", "member", "sha256", "bytes"]
        body = members.pop((row["archive"], row["member"]))
        assert row["member"] == f"{row['rollout_id']}.a{row['attempt_index']}.json"
        assert (sha(body), len(body)) == (row["sha256"], row["bytes"])
        record = json.loads(body)
        assert json.dumps(record, indent=2).encode() == body  # indent 2
        records.append(record)
    assert not members and len(records) == m["records"]
    expected = sorted(({"schema_version": 1, "rollout_id": r["rollout_id"], "attempt_index": r["attempt_index"],
                        "capture_key": r["rollout_id"] if r["attempt_index"] == 0
                        else f"{r['rollout_id']}-a{r['attempt_index']}",
                        "last_committed_model_call_id": r["last_committed_model_call_id"],
                        "resource_state_revisions": r["resource_state_revisions"]}
                       for r in records if r["last_committed_model_call_id"]),
                      key=lambda x: (x["capture_key"], x["last_committed_model_call_id"]))
    assert roots == expected
    assert [list(r) for r in roots] == [list(expected[0])] * len(roots)  # declaration order
    return records


def check_ledger_files(checkpoint_dir: Path, reply: dict[str, Any], roots: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's ledger folder against its reply, its manifest and the agent's roots."""
    folder = checkpoint_dir / LEDGER_DIR
    data = (folder / "manifest.json").read_bytes()
    assert sha(data) == reply["manifest_digest"]
    _canonical(data, 1)
    m = json.loads(data)
    assert (m["schema_version"], m["server_name"]) == (2, MODEL)
    assert m["storage_reference_index"] == reply["storage_reference_index"]
    _check_ref(checkpoint_dir, m["storage_reference_index"], LEDGER_DIR)
    for key, rollout in m["rollouts"].items():
        size = rows = 0
        for name, digest in rollout["files"].items():
            raw = (folder / name).read_bytes()
            assert sha(raw) == digest and name == f"{key}.lineage.jsonl"
            size += len(raw)
            rows += sum(1 for line in raw.split(b"\n") if line.strip())
        assert (rows, size) == (rollout["rows"], rollout["bytes"])
    ordered = sorted(roots, key=lambda r: (r["capture_key"], r["last_committed_model_call_id"]))
    assert m["continuation_roots"] == len(roots)
    assert m["continuation_roots_sha256"] == sha(json.dumps(ordered, sort_keys=True, separators=(",", ":")).encode())
    return m


# -- the drive ---------------------------------------------------------------------------------------------------
@dataclass
class Saved:
    fingerprint: str
    checkpoint_id: str
    commit: Any  # gymkit.gym_fleet.CommitResult
    files: dict[str, bytes]  # what the participants wrote, by path relative to checkpoint_dir
    records: list[dict[str, Any]]


async def _state(http: httpx.AsyncClient) -> dict[str, Any]:
    return (await http.get("/test/state")).json()


async def _until(http: httpx.AsyncClient, predicate: Any, what: str, timeout: float = 20.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        state = await _state(http)
        if predicate(state):
            return state
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}: {state}")
        await asyncio.sleep(0.02)


def _holding(state: dict[str, Any]) -> bool:
    ex = {(e["rollout_id"], e["attempt_index"]): e for e in state["executions"]}
    return all(ex.get((rid, 0), {}).get("boundary_index") == HOLD_AT for rid in HELD)


async def save(gym: Gym, checkpoint_dir: Path, checkpoint_id: str) -> Saved:
    """Discover, run the rollouts, acknowledge the completed one, prepare and commit into
    ``checkpoint_dir``; every file checked against the reference's formulas."""
    actor = NemoGym(gym.servers, TOKEN)
    try:
        topology = await actor.discover_checkpoint_capabilities()
        assert topology.fingerprint == reference_fingerprint(gym.servers)
        async with httpx.AsyncClient(base_url=gym.agent.url, timeout=60) as http:
            held = [asyncio.create_task(http.post("/run", json={"rollout_id": rid, "attempt_index": 0, "turns": TURNS,
                                                                 "hold_at": HOLD_AT})) for rid in HELD]
            try:
                done = (await http.post("/run", json={"rollout_id": DONE, "attempt_index": 0, "turns": 2})).json()
                await _until(http, _holding, "the held rollouts at their boundary")
                receipt = msgspec.to_builtins(await actor.completion_receipt(AGENT, DONE, 0))
                assert receipt == done["receipt"] == receipt_formula(DONE, 0, 1, done["result"])
                acked = await actor.acknowledge_completed_executions([{"receipt": receipt, "agent_name": AGENT}])
                assert msgspec.to_builtins(acked.acknowledged[0].receipt) == receipt

                deadline = time.time() + 30
                prepared = await actor.prepare_checkpoint(checkpoint_id, deadline)
                agent_status = prepared.of("responses_api_agents")[0].reply
                assert agent_status.ready_to_commit and agent_status.parked_with_boundary == len(HELD)
                assert agent_status.acknowledged_completed == 1
                commit = await actor.commit_checkpoint(checkpoint_id, deadline, str(checkpoint_dir))
            finally:
                for t in held:
                    t.cancel()
                await asyncio.gather(*held, return_exceptions=True)
    finally:
        await actor.close()
    assert [(p.component, p.name) for p in commit.participants] == [("responses_api_agents", AGENT),
                                                                      ("responses_api_models", MODEL)]
    agent_reply, model_reply = (msgspec.to_builtins(p.reply) for p in commit.participants)
    records = check_agent_files(checkpoint_dir, agent_reply)
    assert sorted((r["rollout_id"], r["attempt_index"], r["boundary_index"]) for r in records) == [
        (rid, 0, HOLD_AT) for rid in HELD]
    roots = [json.loads(line) for line in (checkpoint_dir / AGENT_DIR / "continuations.jsonl").read_bytes().splitlines()]
    ledger = check_ledger_files(checkpoint_dir, model_reply, roots)
    assert (model_reply["rollouts"], model_reply["rows"], model_reply["excluded_inactive"]) == (3, 6, 1)
    assert ledger["source_attempts"] == [{"rollout_id": rid, "attempt_index": 0} for rid in HELD]
    files = {rel: data for rel, data in tree(checkpoint_dir).items()
             if rel.startswith((AGENT_DIR + "/", LEDGER_DIR + "/"))}
    assert set(tree(checkpoint_dir)) == set(files)  # nothing else written into checkpoint_dir
    return Saved(fingerprint=topology.fingerprint, checkpoint_id=checkpoint_id, commit=commit, files=files,
                 records=records)


async def restore(gym: Gym, checkpoint_dir: Path, checkpoint_id: str, saved: Saved) -> None:
    """Restore fresh servers from ``checkpoint_dir``, check what they loaded, resume, and continue
    the saved rollouts as attempt 1."""
    actor = NemoGym(gym.servers, TOKEN)
    try:
        topology = await actor.discover_checkpoint_capabilities()
        assert topology.fingerprint == saved.fingerprint
        deadline = time.time() + 30
        restored = await actor.restore_checkpoint(checkpoint_id, deadline, str(checkpoint_dir),
                                                  source_checkpoint_id=saved.checkpoint_id)
        model_reply = msgspec.to_builtins(restored.of("responses_api_models")[0].reply)
        agent_reply = msgspec.to_builtins(restored.of("responses_api_agents")[0].reply)
        saved_agent = msgspec.to_builtins(saved.commit.of("responses_api_agents")[0].reply)
        assert agent_reply == {"records": len(HELD), "source_checkpoint_id": saved.checkpoint_id,
                               "continuation_index": saved_agent["continuation_index"]}
        assert (model_reply["checkpoint_id"], model_reply["rollouts"], model_reply["rows"]) == (
            saved.checkpoint_id, 3, 6)
        assert model_reply["source_attempts"] == [{"rollout_id": rid, "attempt_index": 0} for rid in HELD]
        async with httpx.AsyncClient(base_url=gym.agent.url, timeout=60) as http:
            state = await _state(http)
            assert state["restored"] == {f"{r['rollout_id']}#{r['attempt_index'] + 1}": r for r in saved.records}
            closed = await http.post("/run", json={"rollout_id": "r0", "attempt_index": 1, "turns": TURNS})
            assert closed.status_code == 409 and closed.json()["error"]["code"] == "agent_admission_closed"
            discarded = await actor.discard_restored_agent_continuations(
                checkpoint_id, deadline, [{"rollout_id": "r2", "attempt_index": 1}])
            assert (discarded.executions, discarded.discarded) == (1, 1)
            await actor.resume_checkpoint(checkpoint_id, deadline)
            runs = await asyncio.gather(*(http.post("/run", json={"rollout_id": rid, "attempt_index": 1,
                                                                  "turns": TURNS}) for rid in HELD))
            results = {rid: r.json()["result"] for rid, r in zip(HELD, runs, strict=True)}
            for rid in ("r0", "r1"):  # continued after the restored boundary; the model resolved its parent
                assert results[rid]["started_at_turn"] == HOLD_AT + 1
                assert [c["parent_resolution"] for c in results[rid]["calls"]] == ["resolved", "resolved"]
            assert results["r2"]["started_at_turn"] == 0 and results["r2"]["calls"][0]["parent_resolution"] == "root"
            stale = await http.post("/run", json={"rollout_id": "r0", "attempt_index": 0, "turns": TURNS})
            assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"
        async with httpx.AsyncClient(base_url=gym.model.url, timeout=30) as http:  # the model fenced attempt 0 too
            call = await http.post("/v1/responses", json={
                "rollout_id": "r1", "attempt_index": 0, "capture_key": "r1", "model_call_id": "call-9",
                "turn_index": 9, "prompt_token_ids": [1]})
            assert call.status_code == 409 and call.json()["error"]["code"] == "stale_attempt"
    finally:
        await actor.close()
