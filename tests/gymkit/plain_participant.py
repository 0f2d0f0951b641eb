"""A minimal Gym agent participant written from the reference alone (issue 20, "Tests").

It knows nothing of snapformat, gymkit or our schemas: FastAPI, uvicorn and the standard library
only (``test_plain_participant`` checks its imports). Everything it does comes from
``gym-control-protocol.md`` (Gym ``9380654e`` family, NeMo-RL ``d595189f``):

* capabilities: ``responses_api_agents``, ``export_restore``, ``serialized_per_session``, one
  worker, the agent features NeMo-RL requires (§5);
* the ``/ng-control/v1/agent-checkpoint/*`` routes (§4) on one fence (§2): replay of
  (checkpoint_id, operation), ``checkpoint_conflict``, ``invalid_phase``, retirement on resume and
  ``stale_checkpoint`` afterwards; bodies validated before the bearer check (422), the 401 body,
  409 ``{"error": {"code", "detail"}}``;
* completion receipts (§7): generation, ``result_identity``, ``result_digest``;
* Gym's files in ``checkpoint_dir`` (§6), written by hand: ``agent/instance-<sha256(name)>/``
  with ``agent-part-000000.tar`` (members ``<rid>.a<n>.json``, indent 2; headers mode 0o600,
  mtime 0, uid/gid 0, empty names), ``agent-index.jsonl``, ``continuations.jsonl`` (compact JSON
  lines), ``manifest.json`` (sort_keys, indent 2) last; every file temp -> fsync -> rename ->
  folder fsync; restore checks every digest and reference against the bytes.

Its data plane is a toy: ``POST /run {rollout_id, attempt_index, turns, hold_at}`` runs one
rollout attempt, one policy-model call per turn (``POST <model>/v1/responses``, the reference
model server's body), a boundary after each; ``hold_at`` makes the run wait at that boundary until
a prepare asks it to park. A continued attempt (n+1 after a restore) starts after the restored
boundary, its first call naming the restored last call as parent. ``GET /test/state`` shows the
registry to the test.

Run: ``python -m tests.gymkit.plain_participant --name NAME --token-file F --model-url URL
[--host 127.0.0.1] [--port 0] [--port-file F]``; :func:`launch` does it and waits for readiness.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

PREFIX = "/ng-control/v1"
AGENT = f"{PREFIX}/agent-checkpoint"
MAX_BODY = 1 << 20
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HEX64 = re.compile(r"[a-f0-9]{64}")
UNAUTHORIZED = "missing or invalid control-plane bearer token"
FEATURES = ["completed_result_acknowledgement", "agent_continuation_index_v1", "discard_restored_continuation_v1",
            "agent_resource_dependency_index_v1"]
MAX_MEMBERS, MAX_ARCHIVE_BYTES = 512, 64 << 20

RESUME_PHASES = ("idle", "preparing", "prepared", "committed_paused", "restored_paused")
RETIRE_PHASES = ("idle", "preparing", "prepared")


class Refused(Exception):
    """409 ``{"error": {"code", "detail"}}``."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


class TooLarge(Exception):
    """413 ``{"detail": ...}``: the body is larger than :data:`MAX_BODY`."""


class Invalid(Exception):
    """422 ``{"detail": [{"type", "loc", "msg"}]}``."""

    def __init__(self, kind: str, loc: list[Any], msg: str) -> None:
        super().__init__(msg)
        self.errors = [{"type": kind, "loc": loc, "msg": msg}]


# -- validation (pydantic's rules as the reference gives them) -----------------------------------------
def _gym_id(v: Any, loc: list[Any]) -> str:
    if not isinstance(v, str):
        raise Invalid("string_type", loc, "Input should be a valid string")
    if not 1 <= len(v) <= 128 or not ID_RE.fullmatch(v):
        raise Invalid("string_pattern_mismatch", loc, "String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]*$' "
                                                      "(1-128 characters)")
    return v


def _int(v: Any, loc: list[Any], minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise Invalid("int_type", loc, "Input should be a valid integer")
    if v < minimum:
        raise Invalid("greater_than_equal", loc, f"Input should be greater than or equal to {minimum}")
    return v


def _finite(v: Any, loc: list[Any]) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Invalid("float_type", loc, "Input should be a valid number")
    if not math.isfinite(v):
        raise Invalid("finite_number", loc, "Input should be a finite number")
    return float(v)


def _text(v: Any, loc: list[Any], lo: int = 1, hi: int = 4096) -> str:
    if not isinstance(v, str):
        raise Invalid("string_type", loc, "Input should be a valid string")
    if not lo <= len(v) <= hi:
        raise Invalid("string_too_short" if len(v) < lo else "string_too_long", loc, f"length must be {lo}..{hi}")
    return v


def _sha(v: Any, loc: list[Any]) -> str:
    if not isinstance(v, str) or not HEX64.fullmatch(v):
        raise Invalid("string_pattern_mismatch", loc, "String should match pattern '^[a-f0-9]{64}$'")
    return v


def _version(v: Any, loc: list[Any]) -> int:
    if isinstance(v, bool) or v != 1:
        raise Invalid("literal_error", loc, "Input should be 1")
    return 1


Field = tuple[Callable[[Any, list[Any]], Any], bool]  # (check, required)
COMMON: dict[str, Field] = {"schema_version": (_version, False), "checkpoint_id": (_gym_id, True),
                            "deadline_ts": (_finite, True)}
DIR = COMMON | {"checkpoint_dir": (_text, True)}
ATTEMPT = COMMON | {"rollout_id": (_gym_id, True), "attempt_index": (lambda v, loc: _int(v, loc, 0), True)}
RECEIPT: dict[str, Field] = {
    "rollout_id": (_gym_id, True), "attempt_index": (lambda v, loc: _int(v, loc, 0), True),
    "execution_generation": (lambda v, loc: _int(v, loc, 1), True),
    "result_identity": (lambda v, loc: _text(v, loc, 1, 512), True), "result_digest": (_sha, True)}


def validate(doc: Any, fields: dict[str, Field], loc: list[Any]) -> dict[str, Any]:
    """``doc`` as an object with exactly ``fields`` (extra forbidden, required present, each checked)."""
    if not isinstance(doc, dict):
        raise Invalid("model_attributes_type", loc, "Input should be a valid dictionary or object")
    for key in doc:
        if key not in fields:
            raise Invalid("extra_forbidden", [*loc, key], "Extra inputs are not permitted")
    out = {}
    for key, (check, required) in fields.items():
        if key not in doc:
            if required:
                raise Invalid("missing", [*loc, key], "Field required")
            continue
        out[key] = check(doc[key], [*loc, key])
    if "schema_version" in fields:
        out.setdefault("schema_version", 1)
    return out


def validate_ack_batch(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise Invalid("model_attributes_type", ["body"], "Input should be a valid dictionary or object")
    for key in doc:
        if key not in ("schema_version", "executions"):
            raise Invalid("extra_forbidden", ["body", key], "Extra inputs are not permitted")
    if "schema_version" in doc:
        _version(doc["schema_version"], ["body", "schema_version"])
    items = doc.get("executions")
    if not isinstance(items, list) or not items:
        raise Invalid("too_short" if isinstance(items, list) else "list_type", ["body", "executions"],
                      "executions must be a list of at least one receipt")
    receipts = [validate(r, RECEIPT, ["body", "executions", i]) for i, r in enumerate(items)]
    keys = [(r["rollout_id"], r["attempt_index"]) for r in receipts]
    if len(set(keys)) != len(keys):
        raise Invalid("value_error", ["body", "executions"], "completed execution acknowledgements must be unique")
    return {"executions": receipts}


# -- files -----------------------------------------------------------------------------------------------------
def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def compact(row: dict[str, Any]) -> bytes:
    """A JSON-lines row: compact, fields in the order given, then ``\\n``."""
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def instance_dir(name: str) -> str:
    return f"agent/instance-{sha256_hex(name.encode())}"


def capture_key(rollout_id: str, attempt_index: int) -> str:
    return rollout_id if attempt_index == 0 else f"{rollout_id}-a{attempt_index}"


def atomic_write(path: Path, data: bytes) -> None:
    """temp -> write -> fsync -> rename -> folder fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def artifact_ref(relative_path: str, data: bytes) -> dict[str, Any]:
    return {"schema_version": 1, "relative_path": relative_path, "sha256": sha256_hex(data),
            "records": sum(1 for line in data.split(b"\n") if line.strip()), "bytes": len(data)}


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def write_checkpoint(checkpoint_dir: str, checkpoint_id: str, name: str, records: list[dict[str, Any]]
                     ) -> dict[str, Any]:
    """The agent folder (archives, index, continuations, then the manifest); the commit reply."""
    base = instance_dir(name)
    folder = Path(checkpoint_dir) / base
    records = sorted(records, key=lambda r: (r["rollout_id"], r["attempt_index"]))
    shards: list[list[tuple[dict[str, Any], str, bytes]]] = [[]]
    size = 0
    for r in records:
        data = json.dumps(r, indent=2).encode()
        if shards[-1] and (len(shards[-1]) >= MAX_MEMBERS or size + len(data) > MAX_ARCHIVE_BYTES):
            shards.append([])
            size = 0
        shards[-1].append((r, f"{r['rollout_id']}.a{r['attempt_index']}.json", data))
        size += len(data)
    archives, index = [], []
    for i, shard in enumerate(s for s in shards if s):
        archive = f"agent-part-{i:06d}.tar"
        tar = tar_bytes([(member, data) for _, member, data in shard])
        atomic_write(folder / archive, tar)
        archives.append({"name": archive, "sha256": sha256_hex(tar), "members": len(shard), "bytes": len(tar)})
        index += [{"rollout_id": r["rollout_id"], "attempt_index": r["attempt_index"], "archive": archive,
                   "member": member, "sha256": sha256_hex(data), "bytes": len(data)} for r, member, data in shard]
    index_data = b"".join(compact(row) for row in index)
    atomic_write(folder / "agent-index.jsonl", index_data)
    roots = sorted(({"schema_version": 1, "rollout_id": r["rollout_id"], "attempt_index": r["attempt_index"],
                     "capture_key": capture_key(r["rollout_id"], r["attempt_index"]),
                     "last_committed_model_call_id": r["last_committed_model_call_id"],
                     "resource_state_revisions": dict(r["resource_state_revisions"])}
                    for r in records if r["last_committed_model_call_id"]),
                   key=lambda x: (x["capture_key"], x["last_committed_model_call_id"]))
    roots_data = b"".join(compact(row) for row in roots)
    atomic_write(folder / "continuations.jsonl", roots_data)
    manifest = {"schema_version": 2, "checkpoint_id": checkpoint_id, "instance_name": name, "archives": archives,
                "record_index": artifact_ref(f"{base}/agent-index.jsonl", index_data), "records": len(records),
                "continuation_index": artifact_ref(f"{base}/continuations.jsonl", roots_data)}
    data = json.dumps(manifest, sort_keys=True, indent=2).encode()
    atomic_write(folder / "manifest.json", data)
    return {"records": len(records), "manifest_digest": sha256_hex(data),
            "continuation_index": manifest["continuation_index"]}


def read_checkpoint(checkpoint_dir: str, name: str) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """(manifest, manifest_digest, boundary records): every digest, size and count checked."""
    base = instance_dir(name)
    folder = Path(checkpoint_dir) / base

    def bad(what: str) -> Refused:
        return Refused("agent_checkpoint_error", f"{folder}: {what}")

    try:
        data = (folder / "manifest.json").read_bytes()
        manifest = json.loads(data)
        if manifest.get("schema_version") != 2 or manifest.get("instance_name") != name:
            raise bad("manifest.json is not this instance's schema-2 manifest")

        def referenced(ref: dict[str, Any]) -> bytes:
            rel = ref["relative_path"]
            if not rel.startswith(base + "/") or ".." in rel.split("/"):
                raise bad(f"reference {rel!r} leaves the instance folder")
            raw = (Path(checkpoint_dir) / rel).read_bytes()
            lines = sum(1 for line in raw.split(b"\n") if line.strip())
            if (sha256_hex(raw), len(raw), lines) != (ref["sha256"], ref["bytes"], ref["records"]):
                raise bad(f"{rel}: sha256/bytes/records differ from its reference")
            return raw

        index = [json.loads(line) for line in referenced(manifest["record_index"]).split(b"\n") if line.strip()]
        referenced(manifest["continuation_index"])
        members: dict[tuple[str, str], bytes] = {}
        for a in manifest["archives"]:
            raw = (folder / a["name"]).read_bytes()
            if (sha256_hex(raw), len(raw)) != (a["sha256"], a["bytes"]):
                raise bad(f"{a['name']}: sha256/bytes differ from the manifest")
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
                got = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isreg()}  # type: ignore[union-attr]
            if len(got) != a["members"]:
                raise bad(f"{a['name']}: {len(got)} members, the manifest says {a['members']}")
            members |= {(a["name"], k): v for k, v in got.items()}
        records = []
        for row in index:
            raw = members.pop((row["archive"], row["member"]), None)
            if raw is None or (sha256_hex(raw), len(raw)) != (row["sha256"], row["bytes"]):
                raise bad(f"{row['archive']}/{row['member']}: missing or differs from agent-index.jsonl")
            records.append(json.loads(raw))
        if members or len(records) != manifest["records"]:
            raise bad("archive members and index rows disagree")
    except (OSError, ValueError, KeyError, TypeError, tarfile.TarError) as exc:
        raise bad(f"{type(exc).__name__}: {exc}") from None
    return manifest, sha256_hex(data), records


# -- receipts (§7) -----------------------------------------------------------------------------------------------
def receipt_of(rollout_id: str, attempt_index: int, generation: int, result: dict[str, Any]) -> dict[str, Any]:
    digest = sha256_hex(json.dumps(result, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    if result.get("id") is not None:
        identity = str(result["id"])
    elif isinstance(result.get("response"), dict) and result["response"].get("id") is not None:
        identity = str(result["response"]["id"])
    else:
        identity = digest
    return {"rollout_id": rollout_id, "attempt_index": attempt_index, "execution_generation": generation,
            "result_identity": identity, "result_digest": digest}


# -- the fence (§2) ----------------------------------------------------------------------------------------------
class Fence:
    def __init__(self) -> None:
        self.phase, self.active, self.deadline = "idle", None, None
        self.results: dict[tuple[str, str], Any] = {}
        self.running: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self.retired: dict[str, str] = {}  # id -> the resume operation whose result still replays

    def check(self, cid: str, allowed: tuple[str, ...] | None) -> None:
        if cid in self.retired:
            raise Refused("stale_checkpoint", f"checkpoint {cid!r} was retired by its resume")
        if self.active not in (None, cid):
            raise Refused("checkpoint_conflict", f"checkpoint {self.active!r} is active")
        if allowed is not None and self.phase not in allowed:
            raise Refused("invalid_phase", f"phase {self.phase!r} does not allow this")

    async def run(self, cid: str, op: str, fn: Callable[[], Awaitable[Any]], *, allowed: tuple[str, ...],
                  entering: str | None, success: str, deadline: float | None, retire: bool = False) -> Any:
        key = (cid, op)
        if cid in self.retired and self.retired[cid] != op:
            raise Refused("stale_checkpoint", f"checkpoint {cid!r} was retired by its resume")
        if key in self.results:
            return self.results[key]
        if key in self.running:
            return await asyncio.shield(self.running[key])
        self.check(cid, allowed)
        entry_phase, entry_active = self.phase, self.active
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.running[key] = future
        self.phase, self.active, self.deadline = entering or self.phase, cid, deadline
        try:
            result = await fn()
        except BaseException as exc:
            del self.running[key]
            if cid not in self.retired and self.active in (None, cid):
                self.phase = entry_phase
                self.active = None if entry_phase == "idle" else entry_active
                if self.active is None:
                    self.deadline = None
            future.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            future.exception()
            raise
        del self.running[key]
        self.results[key] = result
        if retire:
            self.retired[cid] = op
            self.phase, self.active, self.deadline = "idle", None, None
        else:
            self.phase = success
        future.set_result(result)
        return result


# -- executions ------------------------------------------------------------------------------------------------
class Execution:
    def __init__(self, rollout_id: str, attempt_index: int, generation: int) -> None:
        self.rollout_id, self.attempt_index, self.generation = rollout_id, attempt_index, generation
        self.state = "running"  # running | park_requested | parked | completed | retired
        self.boundary: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self.receipt: dict[str, Any] | None = None
        self.started = time.time()
        self.released = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    def view(self) -> dict[str, Any]:
        b = self.boundary
        out = {"rollout_id": self.rollout_id, "attempt_index": self.attempt_index, "generation": self.generation,
               "state": self.state,
               "parked_boundary_state": None if self.state != "parked" else
               ("parked_with_boundary" if b is not None else "parked_without_boundary"),
               "boundary_index": b["boundary_index"] if b else None, "turn_index": b["turn_index"] if b else None,
               "boundary_kind": b["boundary_kind"] if b else None,
               "resource_state_revisions": dict(b["resource_state_revisions"]) if b else {},
               "age_seconds": round(time.time() - self.started, 3)}
        if self.state == "completed":
            out["completion_receipt"] = self.receipt
        return out


class PlainAgent:
    """The agent's registry, its fence and its checkpoint files."""

    def __init__(self, name: str, model_url: str) -> None:
        self.name, self.model_url = name, model_url.rstrip("/")
        self.fence = Fence()
        self.executions: dict[tuple[str, int], Execution] = {}
        self.generations: dict[tuple[str, int], int] = {}
        self.tombstones: set[tuple[str, int]] = set()
        self.acknowledged: dict[tuple[str, int], dict[str, Any]] = {}
        self.restored: dict[tuple[str, int], dict[str, Any]] = {}  # replacement attempt -> record of attempt n
        self.accepting = True
        self.changed = asyncio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def capabilities(self) -> dict[str, Any]:
        return {"component": "responses_api_agents", "name": self.name, "schema_version": 1,
                "admission_states": ["accepting"], "checkpoint_mode": "export_restore",
                "concurrency_contract": "serialized_per_session",
                "multi_process": {"mode": "single_worker", "num_workers": 1}, "instance_role": None,
                "features": list(FEATURES), "phase": self.fence.phase, "active_checkpoint_id": self.fence.active,
                "deadline_ts": self.fence.deadline}

    def status(self) -> dict[str, Any]:
        every = list(self.executions.values())
        active = [e for e in every if e.state not in ("completed", "retired")]
        with_b = [e for e in active if e.state == "parked" and e.boundary is not None]
        without_b = [e for e in active if e.state == "parked" and e.boundary is None]
        completed = [e for e in every if e.state == "completed"]
        blocking = [e for e in active if e.state in ("running", "park_requested")]
        return {
            "state": "accepting" if self.accepting else "preparing",
            "ready_to_commit": not blocking and not without_b and not completed,
            "running": len(blocking), "parked": len(with_b) + len(without_b), "parked_with_boundary": len(with_b),
            "parked_without_boundary": len(without_b), "completed_unacknowledged": len(completed),
            "acknowledged_completed": len(self.acknowledged), "active": len(active),
            "blocking_attempts": [e.view() for e in blocking],
            "completed_unacknowledged_attempts": [e.view() for e in completed],
            "executions": [e.view() for e in every],
            "selected_boundaries": [
                {"rollout_id": e.rollout_id, "attempt_index": e.attempt_index,
                 "boundary_index": e.boundary["boundary_index"], "turn_index": e.boundary["turn_index"],
                 "boundary_kind": e.boundary["boundary_kind"],
                 "resource_state_revisions": dict(e.boundary["resource_state_revisions"])}
                for e in with_b if e.boundary is not None]}

    # -- the data plane ------------------------------------------------------------------------------------
    async def run(self, rid: str, n: int, turns: int, hold_at: int | None) -> dict[str, Any]:
        key = (rid, n)
        if key in self.acknowledged or key in self.tombstones:
            raise Refused("stale_attempt", f"attempt {rid!r}#{n} was acknowledged or tombstoned")
        ex = self.executions.get(key)
        if ex is not None:
            if ex.state == "completed":
                return {"result": ex.result, "receipt": ex.receipt, "replayed": True}
            raise Refused("duplicate_execution", f"attempt {rid!r}#{n} is already running")
        if not self.accepting:
            raise Refused("agent_admission_closed", "agent admission is closed while a checkpoint holds the agent")
        self.generations[key] = self.generations.get(key, 0) + 1
        ex = Execution(rid, n, self.generations[key])
        ex.task = asyncio.current_task()
        self.executions[key] = ex
        continuation = self.restored.pop(key, None)
        self.notify()
        try:
            result = await self._turns(ex, continuation, turns, hold_at)
        except BaseException:
            if self.executions.get(key) is ex:
                self._retire(ex)
            raise
        ex.state, ex.result = "completed", result
        ex.receipt = receipt_of(rid, n, ex.generation, result)
        self.notify()
        return {"result": result, "receipt": ex.receipt, "replayed": False}

    async def _turns(self, ex: Execution, continuation: dict[str, Any] | None, turns: int,
                     hold_at: int | None) -> dict[str, Any]:
        start = 0 if continuation is None else continuation["boundary_index"] + 1
        parent = None if continuation is None else continuation["last_committed_model_call_id"]
        key = capture_key(ex.rollout_id, ex.attempt_index)
        calls = []
        for turn in range(start, turns):
            call_id = f"call-{turn}"
            reply = await self._model_call(ex, key, call_id, parent, turn)
            calls.append({"model_call_id": call_id, "parent_resolution": reply["parent_resolution"],
                          "tokens": reply["generation_token_ids"]})
            ex.boundary = {
                "schema_version": 2, "rollout_id": ex.rollout_id, "attempt_index": ex.attempt_index,
                "boundary_index": turn, "turn_index": turn, "boundary_kind": "turn_complete", "pending_model": None,
                "output_items": [{"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": f"turn {turn} of {key}"}]}],
                "usage": None, "last_committed_model_call_id": call_id, "resource_state_revisions": {},
                "agent_state": {"start": start, "tokens": reply["generation_token_ids"]}, "created_at": time.time()}
            parent = call_id
            self.notify()
            while True:
                if ex.state == "park_requested":
                    await self._park(ex)
                    continue
                if hold_at == turn and ex.state == "running":
                    await self.changed.wait()
                    continue
                break
        return {"id": f"result-{key}", "rollout_id": ex.rollout_id, "attempt_index": ex.attempt_index,
                "started_at_turn": start, "calls": calls, "text": "fin\u00e9"}

    async def _park(self, ex: Execution) -> None:
        ex.state = "parked"
        ex.released.clear()
        self.notify()
        await ex.released.wait()
        if ex.state == "retired":
            raise Refused("stale_attempt", "retired while parked")
        ex.state = "running"
        self.notify()

    async def _model_call(self, ex: Execution, key: str, call_id: str, parent: str | None,
                          turn: int) -> dict[str, Any]:
        body = json.dumps({"rollout_id": ex.rollout_id, "attempt_index": ex.attempt_index, "capture_key": key,
                           "model_call_id": call_id, "parent_call_id": parent, "turn_index": turn,
                           "prompt_token_ids": [7, turn + 1, len(key)]}).encode()
        headers = {"content-type": "application/json", "x-nemo-gym-rollout-id": ex.rollout_id,
                   "x-nemo-gym-attempt-index": str(ex.attempt_index), "x-nemo-gym-plane": "responses"}

        def post() -> tuple[int, dict[str, Any]]:
            req = urllib.request.Request(f"{self.model_url}/v1/responses", data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read() or b"{}")

        while True:
            status, answer = await asyncio.to_thread(post)
            if status == 200:
                return answer
            code = (answer.get("error") or {}).get("code") if isinstance(answer.get("error"), dict) else None
            if status == 409 and code == "checkpoint_parked":  # the model is held: park here if asked, retry
                if ex.state == "park_requested":
                    await self._park(ex)
                else:
                    await asyncio.sleep(0.05)
                continue
            raise Refused("agent_checkpoint_error", f"model call {call_id} of {key}: {status} {answer}")

    def _retire(self, ex: Execution) -> None:
        ex.state = "retired"
        self.tombstones.add((ex.rollout_id, ex.attempt_index))
        self.generations.pop((ex.rollout_id, ex.attempt_index), None)
        self.executions.pop((ex.rollout_id, ex.attempt_index), None)
        ex.released.set()
        if ex.task is not None and ex.task is not asyncio.current_task() and not ex.task.done():
            ex.task.cancel()
        self.notify()

    # -- the control routes ---------------------------------------------------------------------------------
    async def prepare(self, b: dict[str, Any]) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            self.accepting = False
            asked = [e for e in self.executions.values() if e.state == "running"]
            for e in asked:
                e.state = "park_requested"
            self.notify()
            try:
                while True:
                    report = self.status()
                    if report["ready_to_commit"] or report["running"] == 0:
                        break
                    left = b["deadline_ts"] - time.time()
                    if left <= 0:
                        break
                    try:
                        await asyncio.wait_for(self.changed.wait(), left)
                    except TimeoutError:
                        pass
                report = self.status()
                if not report["ready_to_commit"]:
                    raise Refused("agent_prepare_incomplete", f"running={report['running']}, parked_without_boundary="
                                                              f"{report['parked_without_boundary']}, completed_"
                                                              f"unacknowledged={report['completed_unacknowledged']}")
                return report
            except BaseException:
                for e in asked:
                    if e.state == "park_requested":
                        e.state = "running"
                self.notify()
                raise

        return await self.fence.run(b["checkpoint_id"], "prepare", run, allowed=("idle",), entering="preparing",
                                    success="prepared", deadline=b["deadline_ts"])

    async def commit(self, b: dict[str, Any]) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            if not self.status()["ready_to_commit"]:
                raise Refused("agent_checkpoint_error", "executions still block the commit")
            if (Path(b["checkpoint_dir"]) / instance_dir(self.name) / "manifest.json").exists():
                manifest, digest, records = read_checkpoint(b["checkpoint_dir"], self.name)
                if manifest["checkpoint_id"] != b["checkpoint_id"]:
                    raise Refused("agent_checkpoint_error", "checkpoint_dir holds another checkpoint's manifest")
                return {"records": len(records), "manifest_digest": digest,
                        "continuation_index": manifest["continuation_index"]}
            records = [e.boundary for e in self.executions.values() if e.state == "parked" and e.boundary]
            try:
                return await asyncio.to_thread(write_checkpoint, b["checkpoint_dir"], b["checkpoint_id"], self.name,
                                               records)  # type: ignore[arg-type]
            except OSError as exc:
                raise Refused("agent_checkpoint_error", f"{type(exc).__name__}: {exc}") from None

        return await self.fence.run(b["checkpoint_id"], "commit", run, allowed=("prepared",), entering="committing",
                                    success="committed_paused", deadline=b["deadline_ts"])

    async def restore(self, b: dict[str, Any]) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            manifest, _, records = await asyncio.to_thread(read_checkpoint, b["checkpoint_dir"], self.name)
            for r in records:
                key = (r["rollout_id"], r["attempt_index"])
                self.tombstones.add(key)
                self.generations.pop(key, None)
                self.restored[(r["rollout_id"], r["attempt_index"] + 1)] = r
            self.accepting = False
            self.notify()
            return {"records": len(records), "source_checkpoint_id": manifest["checkpoint_id"],
                    "continuation_index": manifest["continuation_index"]}

        return await self.fence.run(b["checkpoint_id"], "restore", run, allowed=("idle",), entering="restoring",
                                    success="restored_paused", deadline=b["deadline_ts"])

    async def resume(self, b: dict[str, Any]) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            self.accepting = True
            released = 0
            for e in list(self.executions.values()):
                if e.state == "park_requested":
                    e.state = "running"
                elif e.state == "parked":
                    e.released.set()
                    released += 1
            self.notify()
            return {"state": "accepting", "released": released}

        return await self.fence.run(b["checkpoint_id"], "resume", run, allowed=RESUME_PHASES, entering=None,
                                    success="idle", deadline=b["deadline_ts"], retire=True)

    async def retire(self, b: dict[str, Any]) -> dict[str, Any]:
        self.fence.check(b["checkpoint_id"], RETIRE_PHASES)
        key = (b["rollout_id"], b["attempt_index"])
        ex = self.executions.get(key)
        if ex is not None and ex.state == "completed":
            return {"retired": False, "tombstoned": False, "completed_unacknowledged": True}
        self.tombstones.add(key)
        self.generations.pop(key, None)
        self.restored.pop(key, None)
        if ex is None:
            self.notify()
            return {"retired": False, "tombstoned": True}
        self._retire(ex)
        return {"retired": True, "tombstoned": True}

    async def discard(self, b: dict[str, Any]) -> dict[str, Any]:
        self.fence.check(b["checkpoint_id"], ("restored_paused",))
        key = (b["rollout_id"], b["attempt_index"])
        if key in self.executions:
            raise Refused("duplicate_execution", f"attempt {key} already runs")
        return {"discarded": self.restored.pop(key, None) is not None}

    def acknowledge_all(self, receipts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in receipts:  # the whole batch is checked before anything is released
            key = (r["rollout_id"], r["attempt_index"])
            if key in self.acknowledged:
                if self.acknowledged[key] != r:
                    raise Refused("completed_execution_acknowledgement_error", f"{key}: another receipt was acknowledged")
                continue
            ex = self.executions.get(key)
            if ex is None or ex.state != "completed" or ex.receipt != r:
                raise Refused("completed_execution_acknowledgement_error", f"{key}: no retained result with this receipt")
        for r in receipts:
            key = (r["rollout_id"], r["attempt_index"])
            if key not in self.acknowledged:
                self.executions.pop(key)
                self.generations.pop(key, None)
                self.acknowledged[key] = r
        self.notify()
        return receipts

    async def acknowledge(self, r: dict[str, Any]) -> dict[str, Any]:
        again = (r["rollout_id"], r["attempt_index"]) in self.acknowledged
        self.acknowledge_all([r])
        return {"acknowledged": not again, "idempotent": again}

    async def acknowledge_completed(self, b: dict[str, Any]) -> dict[str, Any]:
        return {"acknowledged": self.acknowledge_all(b["executions"])}

    async def completion_receipt(self, q: dict[str, Any]) -> dict[str, Any]:
        ex = self.executions.get((q["rollout_id"], q["attempt_index"]))
        if ex is None or ex.state != "completed":
            raise Refused("completed_execution_acknowledgement_error", "no completed result for this attempt")
        return ex.receipt  # type: ignore[return-value]

    async def status_route(self, q: dict[str, Any]) -> dict[str, Any]:
        self.fence.check(q["checkpoint_id"], None)
        return {"checkpoint_id": q["checkpoint_id"], **self.status()}


# -- the app -----------------------------------------------------------------------------------------------------
def create_app(name: str, token: str, model_url: str) -> FastAPI:
    agent = PlainAgent(name, model_url)
    expected = f"Bearer {token}".encode()
    app = FastAPI()
    app.state.agent = agent

    def answer(status: int, body: Any) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    def authorized(request: Request) -> bool:
        given = request.headers.get("authorization")
        return given is not None and hmac.compare_digest(given.encode("latin-1"), expected)

    async def respond(request: Request, parsed: Callable[[], dict[str, Any]],
                      handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Response:
        try:
            args = parsed()
        except Invalid as exc:
            return answer(422, {"detail": exc.errors})
        if not authorized(request):
            return answer(401, {"detail": UNAUTHORIZED})
        try:
            return answer(200, await handler(args))
        except Refused as exc:
            return answer(409, {"error": {"code": exc.code, "detail": exc.detail}})
        except Exception as exc:  # noqa: BLE001 - Gym's catch-all
            return answer(500, {"error": {"code": "control_error", "detail": type(exc).__name__}})

    async def body_of(request: Request) -> Any:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise TooLarge()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise Invalid("json_invalid", ["body"], f"JSON decode error: {exc}") from None

    def post(path: str, fields: dict[str, Field] | None,
             handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                doc = await body_of(request)
            except TooLarge:
                return answer(413, {"detail": f"request body exceeds {MAX_BODY} bytes"})
            except Invalid as exc:
                return answer(422, {"detail": exc.errors})
            return await respond(request, lambda: validate_ack_batch(doc) if fields is None
                                 else validate(doc, fields, ["body"]), handler)

        app.add_api_route(path, endpoint, methods=["POST"], name=path)

    def get(path: str, fields: dict[str, Field], handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
            ) -> None:
        async def endpoint(request: Request) -> Response:
            def parsed() -> dict[str, Any]:
                q: dict[str, Any] = {}
                for k, v in request.query_params.items():
                    if k in fields:
                        q[k] = int(v) if k == "attempt_index" and v.isdigit() else v
                return validate(q, fields, ["query"])
            return await respond(request, parsed, handler)

        app.add_api_route(path, endpoint, methods=["GET"], name=path)

    post(f"{AGENT}/acknowledge", RECEIPT, agent.acknowledge)
    post(f"{AGENT}/acknowledge-completed", None, agent.acknowledge_completed)
    get(f"{AGENT}/completion-receipt", {k: RECEIPT[k] for k in ("rollout_id", "attempt_index")},
        agent.completion_receipt)
    post(f"{AGENT}/prepare", COMMON, agent.prepare)
    get(f"{AGENT}/status", {"checkpoint_id": (_gym_id, True)}, agent.status_route)
    post(f"{AGENT}/commit", DIR, agent.commit)
    post(f"{AGENT}/restore", DIR, agent.restore)
    post(f"{AGENT}/resume", COMMON, agent.resume)
    post(f"{AGENT}/retire", ATTEMPT, agent.retire)
    post(f"{AGENT}/discard-restored-continuation", ATTEMPT, agent.discard)

    @app.get(f"{PREFIX}/capabilities")
    async def capabilities() -> JSONResponse:
        return answer(200, agent.capabilities())

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return answer(200, {"name": name})

    @app.post("/run")
    async def run(request: Request) -> JSONResponse:
        b = await request.json()
        try:
            return answer(200, await agent.run(b["rollout_id"], int(b.get("attempt_index", 0)), int(b["turns"]),
                                               b.get("hold_at")))
        except Refused as exc:
            return answer(409, {"error": {"code": exc.code, "detail": exc.detail}})

    @app.get("/test/state")
    async def state() -> JSONResponse:
        return answer(200, {"phase": agent.fence.phase, "accepting": agent.accepting,
                            "executions": [e.view() for e in agent.executions.values()],
                            "boundaries": {f"{e.rollout_id}#{e.attempt_index}": e.boundary
                                           for e in agent.executions.values()},
                            "restored": {f"{r}#{n}": rec for (r, n), rec in sorted(agent.restored.items())},
                            "tombstones": sorted(agent.tombstones)})

    return app


# -- running it as a process -------------------------------------------------------------------------------------
class Proc:
    """A server process that reported its port in a port file."""

    def __init__(self, popen: subprocess.Popen[bytes], host: str, port_file: Path, log: Path) -> None:
        self.popen, self.host, self.port_file, self.log = popen, host, port_file, log
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 30.0, health: str = "/healthz") -> Proc:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise RuntimeError(f"server exited ({self.popen.returncode}):\n{self.log.read_text()[-3000:]}")
            if self.port is None and self.port_file.exists() and self.port_file.read_text().strip():
                self.port = int(self.port_file.read_text())
            if self.port is not None:
                try:
                    with urllib.request.urlopen(self.url + health, timeout=1) as resp:
                        if resp.status == 200:
                            return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)


def launch(argv: list[str], host: str, workdir: Path, stem: str, cwd: Path, env: dict[str, str] | None = None,
           port: int = 0) -> Proc:
    """Start ``python <argv> ... --host <host> --port <port> --port-file <f>`` (not yet ready)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file, log = workdir / f"{stem}.port", workdir / f"{stem}.log"
    port_file.unlink(missing_ok=True)
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, *argv, "--host", host, "--port", str(port), "--port-file",
                                  str(port_file)],
                                 cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Proc(popen, host, port_file, log)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description="a plain-files Gym agent participant (tests)")
    p.add_argument("--name", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--model-url", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file")
    args = p.parse_args(argv)
    app = create_app(args.name, Path(args.token_file).read_text().strip(), args.model_url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        os.replace(tmp, args.port_file)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
