"""Fuzzing every ``/ng-control/v1`` route of the three families (CONTROL.md §1-4, §13), with
malformed and out-of-phase calls, against participants built on the kit: a policy model
(:func:`gymkit.model_control.model_router`), a whitebox agent (:func:`gymkit.agent_control.agent_router`)
and a stateful resources server (:func:`gymkit.resources_control.resources_router`), each its own
app with its own fence, served in-process (ASGI, for speed) and, in a short last pass, over real
HTTP on 127.0.0.1.

An example is a *sequence* of calls on fresh servers, after well-formed steps that take every
family to idle, prepared, committed_paused or restored_paused, so calls land in every phase: a body
built from small pools (checkpoint ids, folders, deadlines, attempts, receipts), then maybe
one field dropped, replaced by any JSON value, an unknown field added, a non-finite number written
raw, or the whole body replaced by arbitrary bytes; the token right, missing or subtly wrong; now
and then a wrong method or an unknown path. Whatever arrives, the answer is one of the reference's:

* 200 with the route's reply shape (``GET capabilities``: exactly NeMo-RL's keys);
* 401 ``{"detail": "missing or invalid control-plane bearer token"}``;
* 404 / 405 (FastAPI's own), 413 ``{"detail": str}``;
* 422 ``{"detail": [{"type", "loc", "msg"}, ...]}``, exactly when the body (or query) breaks the
  route's request struct, whatever the token (bodies are checked before it); a well-formed call
  with a wrong token is 401;
* 409 ``{"error": {"code", "detail"}}`` with a code the route's family owns
  (``schemas.control.ERROR_CODES``);

never a 500, never the token. And a refused call changes nothing committed or published: the
snapshot published from a committed ``checkpoint_dir`` (which the pools hand to commits and
restores) keeps every byte and still verifies; a refused commit leaves no manifest behind in the
folder it was given; a 401/404/405/413/422 leaves every participant exactly as it was; a 409 moves
no fence, except the one move the reference documents (a failed model restore ->
``restore_failed_paused``). ``FUZZ_EXAMPLES`` raises the example count.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymkit.agent_control import AgentExecutions, AgentParticipant, agent_router, whitebox_agent_declaration
from gymkit.checkpoint_dir import (
    manifest_digest,
    read_jsonl,
    read_ledger_dir,
    write_agent_dir,
    write_ledger_dir,
    write_resources_dir,
)
from gymkit.control_http import AttemptQuery, CheckpointQuery, DeadlineQuery, ModelStatusQuery
from gymkit.fence import ControlError, Fence
from gymkit.model_control import (
    ModelAdmission,
    ModelCommitContext,
    ModelParticipant,
    ModelRestoreContext,
    model_router,
)
from gymkit.resources_control import (
    ResourceSessions,
    ResourcesParticipant,
    resources_router,
    stateful_resources_declaration,
)
from schemas import control as c
from schemas.errors import SnapshotError
from schemas.gym_files import (
    MANIFEST_NAME,
    AgentBoundaryRecord,
    AgentManifest,
    AttemptEntry,
    ExternalStorageReference,
    ResourceSnapshot,
    agent_instance_dir,
    ledger_dir,
)
from schemas.gym_records import AgentContinuationRoot
from snapformat import SnapshotStore
from snapformat.adopt import adopt_gym_dir
from snapformat.verify import verify_snapshot

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
TOKEN = "fuzz-Tok3n-9f2"
AUTH = f"Bearer {TOKEN}"
MODEL, AGENT, RES = "fuzz_policy", "fuzz-agent", "fuzz-tools"
P = c.CONTROL_PREFIX


# -- the participants (built on the kit) -------------------------------------------------------------------------
class Ledger(ModelParticipant):
    """A policy model whose ledger is one line per continuation root; commit follows Gym's on-disk rule."""

    def declaration(self) -> c.Capabilities:
        return c.Capabilities(component="responses_api_models", name=MODEL,
                              admission_states=["accepting", "draining", "paused"], checkpoint_mode="export_restore",
                              concurrency_contract="transactional_parallel",
                              multi_process=c.MultiProcess(mode="single_worker"), instance_role="policy",
                              features=[c.FEATURE_STORAGE_REFERENCE_INDEX])

    async def commit(self, ctx: ModelCommitContext) -> c.ModelCommitResponse:
        folder = Path(ctx.checkpoint_dir) / ledger_dir(MODEL)
        try:
            if (folder / MANIFEST_NAME).exists():  # Gym: validate it, answer the same digest
                manifest, _, _ = read_ledger_dir(folder)
                if manifest.checkpoint_id != ctx.checkpoint_id:
                    raise ControlError("ledger_mismatch", f"{folder} holds checkpoint {manifest.checkpoint_id!r}")
            else:
                roots = [r for ref in ctx.continuation_indexes
                         for r in read_jsonl(ctx.checkpoint_dir, ref, AgentContinuationRoot)]
                manifest, _ = _write_ledger(ctx.checkpoint_dir, ctx.checkpoint_id, roots,
                                            [AttemptEntry(rollout_id=t.rollout_id, attempt_index=t.attempt_index)
                                             for t in self.admission.tombstones()])
        except (SnapshotError, OSError) as exc:
            raise ControlError("ledger_mismatch", f"{type(exc).__name__}: {exc}") from None
        return c.ModelCommitResponse(rollouts=len(manifest.rollouts), rows=len(manifest.rollouts),
                                     excluded_tombstoned=len(manifest.tombstones), excluded_inactive=0,
                                     manifest_digest=manifest_digest(folder) or "",
                                     storage_reference_index=manifest.storage_reference_index)

    async def restore(self, ctx: ModelRestoreContext) -> c.ModelRestoreResponse:
        try:
            manifest, _, _ = read_ledger_dir(Path(ctx.checkpoint_dir) / ledger_dir(MODEL))
        except (SnapshotError, OSError) as exc:
            raise ControlError("ledger_mismatch", f"{type(exc).__name__}: {exc}") from None
        return c.ModelRestoreResponse(
            rollouts=len(manifest.rollouts), rows=len(manifest.rollouts), checkpoint_id=manifest.checkpoint_id,
            tombstones=[c.AttemptRef(rollout_id=t.rollout_id, attempt_index=t.attempt_index)
                        for t in manifest.tombstones],
            source_attempts=[c.AttemptRef(rollout_id=t.rollout_id, attempt_index=t.attempt_index)
                             for t in manifest.source_attempts],
            storage_reference_index=manifest.storage_reference_index)


def _write_ledger(checkpoint_dir: str | Path, cid: str, roots: list[AgentContinuationRoot],
                  tombstones: list[AttemptEntry]) -> Any:
    return write_ledger_dir(
        checkpoint_dir, cid, MODEL,
        lineages={r.capture_key: json.dumps({"call": r.last_committed_model_call_id}).encode() + b"\n" for r in roots},
        storage_references=[ExternalStorageReference(capture_key=r.capture_key,
                                                     boundary_model_call_id=r.last_committed_model_call_id,
                                                     key=f"staging/{r.capture_key}") for r in roots],
        roots=roots, tombstones=tombstones,
        source_attempts=[AttemptEntry(rollout_id=r.rollout_id, attempt_index=r.attempt_index) for r in roots])


class Agent(AgentParticipant):
    def declaration(self) -> c.Capabilities:
        return whitebox_agent_declaration(AGENT)


class Tools(ResourcesParticipant):
    def __init__(self) -> None:
        self.states: dict[tuple[str, int], Any] = {}

    def declaration(self) -> c.Capabilities:
        return stateful_resources_declaration(RES)

    async def export_state(self, rollout_id: str, attempt_index: int) -> Any:
        return {"notes": [rollout_id, attempt_index]}

    async def import_states(self, snapshots: list[ResourceSnapshot]) -> None:
        self.states = {(s.rollout_id, s.attempt_index): s.state for s in snapshots}


RESULT = {"id": "res-done", "text": "d\u00e9j\u00e0"}


class Servers:
    """One process of each family: its participant, its registry, its fence, its app."""

    def __init__(self, seeded: bool) -> None:
        self.admission = ModelAdmission()
        self.model_fence, self.agent_fence, self.res_fence = Fence(), Fence(), Fence()
        self.executions = AgentExecutions()
        self.sessions = ResourceSessions()
        if seeded:  # something to acknowledge, retire, export, refuse
            self.admission.tombstone("gone", 0)
            self.executions.begin("done", 0, task=None)
            self.executions.complete("done", 0, RESULT)
            self.sessions.bind("sess", 0)
        self.apps = {
            "model": _app(model_router(Ledger(self.admission), self.admission, self.model_fence, TOKEN)),
            "agent": _app(agent_router(Agent(), self.executions, self.agent_fence, TOKEN)),
            "resources": _app(resources_router(Tools(), self.sessions, self.res_fence, TOKEN)),
        }

    def state(self) -> tuple[Any, ...]:
        """Everything a refused call must leave as it was."""
        report = self.executions.status()
        return (self.fences(), self.admission.state, tuple(self.admission.tombstones()), self.executions.accepting,
                msgspec.json.encode(msgspec.structs.replace(report, executions=[], blocking_attempts=[],
                                                            completed_unacknowledged_attempts=[])),
                tuple(self.executions.restored_attempts()), self.sessions.accepting, tuple(self.sessions.bound()))

    def fences(self) -> dict[str, tuple[str, str | None]]:
        return {k: (f.phase, f.active_checkpoint_id) for k, f in
                (("model", self.model_fence), ("agent", self.agent_fence), ("resources", self.res_fence))}


def _app(router: Any) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    return app


# -- what was committed and published before the fuzzing ------------------------------------------------------------
class Committed:
    """A ``checkpoint_dir`` committed by the three participants (checkpoint ``c0``), published as a
    snapshot on local disk: the pools hand its folder to commits and restores."""

    def __init__(self, root: Path) -> None:
        store = SnapshotStore(str(root / "store"))
        draft = store.begin()
        gym = Path(draft.url) / "gym"
        records = [AgentBoundaryRecord(rollout_id=f"saved{i}", attempt_index=0, boundary_index=1,
                                       last_committed_model_call_id=f"call-{i}", resource_state_revisions={RES: 2},
                                       created_at=1.5) for i in range(2)]
        write_agent_dir(gym, "c0", AGENT, records)
        roots = read_jsonl(gym, _ref(gym), AgentContinuationRoot)
        _write_ledger(gym, "c0", roots, [AttemptEntry(rollout_id="old", attempt_index=0)])
        write_resources_dir(gym, "c0", RES, [ResourceSnapshot(rollout_id=f"saved{i}", attempt_index=0, state_revision=2,
                                                              state={"i": i}) for i in range(2)])
        draft.publish(receipts=adopt_gym_dir(draft.url, str(gym)))
        self.store = store
        self.dir = str(gym)
        self.agent_ref = msgspec.to_builtins(_ref(gym))
        self.files = _tree(gym)  # every byte of the published snapshot's Gym folder, part manifests included
        assert verify_snapshot(store.latest()).ok


def _ref(gym: Path) -> Any:
    return msgspec.json.decode((gym / agent_instance_dir(AGENT) / MANIFEST_NAME).read_bytes(),
                               type=AgentManifest).continuation_index


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _manifests(folder: Path) -> dict[str, str]:
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob(MANIFEST_NAME)}


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Committed]:
    done = Committed(tmp_path_factory.mktemp("committed"))
    yield done
    assert _tree(Path(done.dir)) == done.files  # still every byte after all the fuzzing
    assert verify_snapshot(done.store.latest()).ok


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The working directory while fuzzing: a relative ``checkpoint_dir`` lands here, not in the repo."""
    root = tmp_path_factory.mktemp("sandbox")
    old = os.getcwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(old)


# -- the routes and their well-formed bodies -------------------------------------------------------------------------
MODEL_CODES = set(c.ERROR_CODES["control"]) | set(c.ERROR_CODES["model"])
AGENT_CODES = set(c.ERROR_CODES["control"]) | set(c.ERROR_CODES["agent"])
RES_CODES = set(c.ERROR_CODES["control"]) | set(c.ERROR_CODES["resources"])

#: (family, method, route below the prefix, body kind, reply type)
ROUTES: list[tuple[str, str, str, str, Any]] = [
    ("model", "POST", "model-admission/pause", "common", c.ModelPauseResponse),
    ("model", "GET", "model-admission/status", "q_model", c.ModelStatusResponse),
    ("model", "POST", "model-admission/resume", "common", c.ModelResumeResponse),
    ("model", "POST", "model-admission/abort_inflight", "attempt", c.AbortInflightResponse),
    ("model", "POST", "model-checkpoint/commit", "model_commit", c.ModelCommitResponse),
    ("model", "POST", "model-checkpoint/restore", "dir", c.ModelRestoreResponse),
    ("agent", "POST", "agent-checkpoint/acknowledge", "receipt", c.AcknowledgeResponse),
    ("agent", "POST", "agent-checkpoint/acknowledge-completed", "receipts", c.AcknowledgeCompletedResponse),
    ("agent", "GET", "agent-checkpoint/completion-receipt", "q_attempt", c.CompletionReceipt),
    ("agent", "POST", "agent-checkpoint/prepare", "common", c.AgentStatus),
    ("agent", "GET", "agent-checkpoint/status", "q_cid", c.AgentStatus),
    ("agent", "POST", "agent-checkpoint/commit", "dir", c.AgentCommitResponse),
    ("agent", "POST", "agent-checkpoint/restore", "dir", c.AgentRestoreResponse),
    ("agent", "POST", "agent-checkpoint/resume", "common", c.AgentResumeResponse),
    ("agent", "POST", "agent-checkpoint/retire", "attempt", c.AgentRetireResponse),
    ("agent", "POST", "agent-checkpoint/discard-restored-continuation", "attempt", c.DiscardResponse),
    ("resources", "POST", "resources-checkpoint/prepare", "common", c.ResourcesPrepareResponse),
    ("resources", "GET", "resources-checkpoint/status", "q_deadline", c.ResourcesStatusResponse),
    ("resources", "POST", "resources-checkpoint/commit", "dir", c.ResourcesCommitResponse),
    ("resources", "POST", "resources-checkpoint/restore", "dir", c.ResourcesRestoreResponse),
    ("resources", "POST", "resources-checkpoint/resume", "common", c.ResourcesResumeResponse),
    ("resources", "POST", "resources-checkpoint/retire", "attempt", c.ResourcesRetireResponse),
    ("model", "GET", "capabilities", "none", c.Capabilities),
    ("agent", "GET", "capabilities", "none", c.Capabilities),
    ("resources", "GET", "capabilities", "none", c.Capabilities),
]
CODES = {"model": MODEL_CODES, "agent": AGENT_CODES, "resources": RES_CODES}

CIDS = ["c1", "c1", "c1", "c2", "c0"]  # mostly one id, so that a sequence walks its phases
RIDS = ["done", "sess", "gone", "saved0", "r-x"]
DIRS = ["committed", "committed", "fresh", "fresh", "/proc/no-such-dir/x", "relative-dir", "a-file", "../escape"]
DEADLINES = ["soon", "soon", "past", 0, 1e15, -1e6, "12.5"]
NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999"]
BAD_AUTHS = [None, "", f"bearer {TOKEN}", f"Bearer {TOKEN}x", f"Bearer  {TOKEN}", f"Bearer\t{TOKEN}", TOKEN,
             "Bearer wrong", f"Basic {TOKEN}"]
MUTATIONS = ["drop", "replace", "extra", "raw", "non_finite", "json"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=30) | st.sampled_from(["c1", "../x", "/etc", "", "x" * 300, "a\x00b", "ab\n"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8)


class Ctx:
    """What a body can refer to in one example: the committed folder, a fresh one, a file."""

    counter = itertools.count()

    def __init__(self, committed: Committed, root: Path) -> None:
        self.committed = committed
        self.fresh = root / f"fresh-{next(self.counter)}"
        self.a_file = root / "a-file.txt"
        self.a_file.write_text("not a folder")

    def dir(self, which: str) -> str:
        return {"committed": self.committed.dir, "fresh": str(self.fresh), "a-file": str(self.a_file)}.get(which, which)

    def receipt(self, which: int) -> dict[str, Any]:
        digest = hashlib.sha256(json.dumps(RESULT, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        good = {"rollout_id": "done", "attempt_index": 0, "execution_generation": 1, "result_identity": "res-done",
                "result_digest": digest}
        return [good, good | {"result_digest": "0" * 64}, good | {"execution_generation": 2},
                good | {"rollout_id": "sess"}][which % 4]


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    family, method, route, kind, reply = draw(st.sampled_from(ROUTES))
    fields: dict[str, Any] = {}
    deadline = draw(st.sampled_from(DEADLINES))
    if kind in ("common", "attempt", "dir", "model_commit", "q_model", "q_deadline"):
        fields |= {"checkpoint_id": draw(st.sampled_from(CIDS)), "deadline_ts": deadline}
    if kind == "q_cid":
        fields["checkpoint_id"] = draw(st.sampled_from(CIDS))
    if kind in ("attempt", "q_attempt"):
        fields |= {"rollout_id": draw(st.sampled_from(RIDS)), "attempt_index": draw(st.sampled_from([0, 1, 2]))}
    if kind in ("dir", "model_commit"):
        fields["checkpoint_dir"] = ("dir", draw(st.sampled_from(DIRS)))
    if kind == "model_commit":
        fields["continuation_indexes"] = draw(st.sampled_from([[], ["agent_ref"], ["agent_ref", "agent_ref"],
                                                               ["bogus_ref"]]))
    if kind == "q_model":
        if draw(st.booleans()):
            fields["wait_state"] = "paused"
        if draw(st.booleans()):
            fields["timeout_s"] = draw(st.sampled_from([0, 0.01, "0.02", -1]))
    if kind == "receipt":
        fields = {"receipt": draw(st.integers(0, 3))}
    if kind == "receipts":
        fields = {"receipts": draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))}
        if draw(st.booleans()):
            fields["schema_version"] = 1
    if kind in ("common", "attempt", "dir", "model_commit") and draw(st.booleans()):
        fields["schema_version"] = 1
    mutation = "none" if draw(st.integers(0, 9)) < 6 else draw(st.sampled_from(MUTATIONS))
    auth = AUTH if draw(st.integers(0, 9)) < 8 else draw(st.sampled_from(BAD_AUTHS))
    call = {"family": family, "method": method, "route": route, "kind": kind, "reply": reply, "fields": fields,
            "mutation": mutation, "auth": auth}
    if mutation in ("drop", "replace") and fields:
        call["target"] = draw(st.sampled_from(sorted(fields)))
    if mutation in ("replace", "extra", "json"):
        call["value"] = draw(json_values)
        call["extra_key"] = draw(st.text(min_size=1, max_size=8))
    if mutation == "raw":
        call["raw"] = draw(st.binary(max_size=120))
    if mutation == "non_finite":
        call["raw_number"] = draw(st.sampled_from(NON_FINITE))
    odd = draw(st.integers(0, 19))
    if odd == 0:  # a wrong method on a known path
        call["method"] = draw(st.sampled_from([m for m in ("GET", "POST", "PUT", "DELETE") if m != method]))
    elif odd == 1:  # an unknown path
        call["route"] = route + draw(st.sampled_from(["/x", "s", "-extra"]))
    return call


def _step(family: str, route: str, kind: str, **fields: Any) -> dict[str, Any]:
    reply = next(r[4] for r in ROUTES if r[0] == family and r[2] == route)
    return {"family": family, "method": "POST", "route": route, "kind": kind, "reply": reply, "mutation": "none",
            "auth": AUTH, "fields": {"checkpoint_id": "c1", "deadline_ts": "soon", **fields}}


#: Well-formed steps that take every family to a phase before the fuzzed calls begin (so that
#: those land in prepared, committed_paused and restored_paused too, not only idle).
PRELUDES: dict[str, list[dict[str, Any]]] = {"idle": []}
PRELUDES["prepared"] = [_step("model", "model-admission/pause", "common"),
                        _step("agent", "agent-checkpoint/prepare", "common"),
                        _step("resources", "resources-checkpoint/prepare", "common")]
PRELUDES["committed"] = [*PRELUDES["prepared"],
                         _step("agent", "agent-checkpoint/commit", "dir", checkpoint_dir=("dir", "fresh")),
                         _step("model", "model-checkpoint/commit", "model_commit", checkpoint_dir=("dir", "fresh"),
                               continuation_indexes=[]),
                         _step("resources", "resources-checkpoint/commit", "dir", checkpoint_dir=("dir", "fresh"))]
PRELUDES["restored"] = [_step(f, f"{r}/restore", "model_commit" if f == "model" else "dir",
                              checkpoint_dir=("dir", "committed"))
                        for f, r in (("model", "model-checkpoint"), ("agent", "agent-checkpoint"),
                                     ("resources", "resources-checkpoint"))]
PRELUDES["restored"][0]["kind"] = "dir"


def _deadline(v: Any) -> Any:
    return {"soon": time.time() + 30, "past": time.time() - 5}.get(v, v) if isinstance(v, str) else v


def materialize(call: dict[str, Any], ctx: Ctx) -> tuple[dict[str, Any] | None, bytes | None]:
    """(query params, body bytes) of a call."""
    values: dict[str, Any] = {}
    for k, v in call["fields"].items():
        if k == "deadline_ts":
            v = _deadline(v)
        elif k == "checkpoint_dir":
            v = ctx.dir(v[1])
        elif k == "continuation_indexes":
            v = [ctx.committed.agent_ref if r == "agent_ref" else
                 ctx.committed.agent_ref | {"sha256": "f" * 64} for r in v]
        elif k == "receipt":
            values |= ctx.receipt(v)
            continue
        elif k == "receipts":
            values["executions"] = [ctx.receipt(i) for i in v]
            continue
        values[k] = v
    m = call["mutation"]
    if m == "drop" and call.get("target") in values:
        del values[call["target"]]
    elif m == "replace" and call.get("target") in values:
        values[call["target"]] = call["value"]
    elif m == "extra":
        values[call["extra_key"]] = call["value"]
    if call["kind"] == "none":
        return None, None
    if call["kind"].startswith("q_"):
        query = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in values.items()}
        if m == "non_finite" and "deadline_ts" in query:
            query["deadline_ts"] = call["raw_number"].decode()
        return query, None
    if m == "raw":
        return None, call["raw"]
    if m == "json":
        return None, msgspec.json.encode(call["value"])
    body = msgspec.json.encode(values)
    if m == "non_finite" and "deadline_ts" in values:
        body = body.replace(msgspec.json.encode(values["deadline_ts"]), call["raw_number"], 1)
    return None, body


# -- the checks ---------------------------------------------------------------------------------------------------
KNOWN = {f"{P}/{route}": method for _, method, route, _, _ in ROUTES}


#: The request struct of each body kind (GET: the query), to tell a malformed call from a valid one.
REQUESTS: dict[str, Any] = {
    "common": c.ControlRequest, "attempt": c.AttemptRequest, "dir": c.CheckpointDirRequest,
    "model_commit": c.ModelCommitRequest, "receipt": c.CompletionReceipt, "receipts": c.AcknowledgeCompletedRequest,
    "q_model": ModelStatusQuery, "q_deadline": DeadlineQuery, "q_cid": CheckpointQuery, "q_attempt": AttemptQuery}


def well_formed(kind: str, query: dict[str, str] | None, content: bytes | None) -> bool:
    if kind == "none":
        return True
    try:
        if kind.startswith("q_"):
            msgspec.convert(query or {}, REQUESTS[kind], strict=False)
        else:
            msgspec.json.decode(content or b"", type=REQUESTS[kind], strict=False)
    except (msgspec.MsgspecError, ValueError):
        return False
    return True


def check_answer(call: dict[str, Any], resp: httpx.Response, path: str, query: dict[str, str] | None = None,
                 content: bytes | None = None) -> None:
    """The answer is one of the reference's (module docstring); a malformed call is 422 whatever
    its token (the body is checked first), a well-formed one with a wrong token 401."""
    status, text = resp.status_code, resp.text
    assert status != 500 and status in (200, 401, 404, 405, 409, 413, 422), (status, text, call)
    assert TOKEN not in text
    body = resp.json()
    if path not in KNOWN:
        assert (status, body) == (404, {"detail": "Not Found"}), (status, text)
        return
    if call["method"] != KNOWN[path]:
        assert (status, body) == (405, {"detail": "Method Not Allowed"}), (status, text)
        return
    valid = well_formed(call["kind"], query, content)
    assert (status == 422) == (not valid), (status, text, query, content)
    if valid and call["kind"] != "none" and call["auth"] != AUTH:
        assert status == 401, (status, text)
    if status == 200:
        if call["reply"] is c.Capabilities:
            caps = msgspec.json.decode(resp.content, type=c.Capabilities)  # NeMo-RL's strict decode
            assert caps.component == {"model": "responses_api_models", "agent": "responses_api_agents",
                                      "resources": "resources_servers"}[call["family"]]
        else:
            msgspec.convert(body, call["reply"], strict=False)
    elif status == 401:
        assert body == {"detail": c.UNAUTHORIZED_DETAIL}
    elif status == 413:
        assert set(body) == {"detail"} and isinstance(body["detail"], str)
    elif status == 422:
        assert set(body) == {"detail"} and isinstance(body["detail"], list) and body["detail"]
        for e in body["detail"]:
            assert {"type", "loc", "msg"} <= set(e) and isinstance(e["loc"], list)
            assert e["loc"][0] in ("body", "query") and isinstance(e["msg"], str) and isinstance(e["type"], str)
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}, text
        assert body["error"]["code"] in CODES[call["family"]], (body, call)
        assert isinstance(body["error"]["detail"], str)


def send(client: Any, call: dict[str, Any], ctx: Ctx) -> httpx.Response:
    """Send the call and check its answer."""
    query, content = materialize(call, ctx)
    headers = {} if call["auth"] is None else {"authorization": call["auth"]}
    if content is not None:
        headers["content-type"] = "application/json"
    path = f"{P}/{call['route']}"
    resp = client.request(call["method"], path, params=query, content=content, headers=headers)
    check_answer(call, resp, path, query, content)
    return resp


def run_sequence(servers: Servers, clients: dict[str, Any], sequence: list[dict[str, Any]], ctx: Ctx) -> None:
    committed = ctx.committed
    for call in sequence:
        before = servers.state()
        fresh_before = _manifests(ctx.fresh)
        resp = send(clients[call["family"]], call, ctx)
        assert _tree(Path(committed.dir)) == committed.files, call  # nothing committed or published changes
        if resp.status_code == 200:
            continue
        assert _manifests(ctx.fresh) == fresh_before, call  # a refused commit leaves no manifest
        after = servers.state()
        if resp.status_code != 409:
            assert after == before, (call, resp.text)  # refused before the handler: nothing moved
            continue
        moved = {k: (before[0][k], after[0][k]) for k in before[0] if before[0][k] != after[0][k]}
        if call["route"] == "model-checkpoint/restore" and set(moved) == {"model"}:
            assert after[0]["model"][0] == "restore_failed_paused", moved  # the one documented move
            continue
        assert not moved, (call, resp.text, moved)


# -- the fuzzers ----------------------------------------------------------------------------------------------------
#: Bounded in examples and in time: an example (a whole sequence) that takes 10 s is a failure.
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=10), suppress_health_check=list(HealthCheck))


@FUZZ
@given(prelude=st.sampled_from(sorted(PRELUDES)), sequence=st.lists(calls(), min_size=1, max_size=10),
       seeded=st.booleans())
def test_every_route_in_every_phase_answers_as_the_reference_says(committed: Committed, sandbox: Path, prelude: str,
                                                                  sequence: list[dict[str, Any]], seeded: bool) -> None:
    servers = Servers(seeded)
    ctx = Ctx(committed, sandbox)
    with ExitStack() as stack:
        clients = {k: stack.enter_context(TestClient(app, raise_server_exceptions=False, base_url="http://gym"))
                   for k, app in servers.apps.items()}
        run_sequence(servers, clients, PRELUDES[prelude] + sequence, ctx)


NUL_DIR = ("dir", "a\x00b")  # a path no file system can hold (a NUL byte; the fuzzers draw it rarely)


@pytest.mark.parametrize("prelude,step", [
    ("prepared", _step("agent", "agent-checkpoint/commit", "dir", checkpoint_dir=NUL_DIR)),
    ("prepared", _step("model", "model-checkpoint/commit", "model_commit", checkpoint_dir=NUL_DIR,
                       continuation_indexes=[])),
    ("prepared", _step("resources", "resources-checkpoint/commit", "dir", checkpoint_dir=NUL_DIR)),
    ("idle", {**_step("model", "model-checkpoint/restore", "model_commit", checkpoint_dir=NUL_DIR), "kind": "dir"}),
    ("idle", _step("agent", "agent-checkpoint/restore", "dir", checkpoint_dir=NUL_DIR)),
    ("idle", _step("resources", "resources-checkpoint/restore", "dir", checkpoint_dir=NUL_DIR)),
], ids=lambda v: v["route"] if isinstance(v, dict) else v)
def test_a_checkpoint_dir_with_a_nul_byte_is_the_familys_refusal(committed: Committed, sandbox: Path, prelude: str,
                                                                  step: dict[str, Any]) -> None:
    # Well-formed by the schema, so not a 422: the family's checkpoint error (409), never a 500.
    servers = Servers(False)
    ctx = Ctx(committed, sandbox)
    with ExitStack() as stack:
        clients = {k: stack.enter_context(TestClient(app, raise_server_exceptions=False, base_url="http://gym"))
                   for k, app in servers.apps.items()}
        run_sequence(servers, clients, PRELUDES[prelude], ctx)
        resp = send(clients[step["family"]], step, ctx)
    assert resp.status_code == 409, resp.text
    assert "NUL" in resp.json()["error"]["detail"], resp.text


@settings(FUZZ, max_examples=max(10, EXAMPLES // 2))
@given(route=st.sampled_from([r for r in ROUTES if r[1] == "POST"]), raw=st.binary(max_size=200) | json_values.map(
    msgspec.json.encode), auth=st.sampled_from([AUTH, *BAD_AUTHS]))
def test_arbitrary_bodies(committed: Committed, sandbox: Path, route: tuple[Any, ...], raw: bytes, auth: str | None
                          ) -> None:
    family, method, path, kind, reply = route
    servers = Servers(True)
    with TestClient(servers.apps[family], raise_server_exceptions=False) as client:
        call = {"family": family, "method": method, "route": path, "kind": kind, "reply": reply, "fields": {},
                "mutation": "raw", "raw": raw, "auth": auth}
        before = servers.state()
        resp = send(client, call, Ctx(committed, sandbox))
        if resp.status_code != 200:
            assert servers.state() == before or resp.status_code == 409


@pytest.mark.parametrize("family,route", [(f, r) for f, m, r, _, _ in ROUTES if m == "POST"])
def test_a_body_over_the_limit_is_413_before_anything_else(family: str, route: str) -> None:
    servers = Servers(False)
    before = servers.state()
    with TestClient(servers.apps[family], raise_server_exceptions=False) as client:
        big = b'{"checkpoint_id":"c1","deadline_ts":1,"pad":"' + b"x" * c.MAX_BODY_BYTES + b'"}'
        for headers in ({}, {"authorization": AUTH}):
            resp = client.post(f"{P}/{route}", content=big, headers=headers)
            assert resp.status_code == 413 and set(resp.json()) == {"detail"}, resp.text

            def chunks() -> Iterator[bytes]:  # no content-length: the stream is cut at the limit
                for i in range(0, len(big), 65536):
                    yield big[i:i + 65536]

            resp = client.post(f"{P}/{route}", content=chunks(), headers=headers)
            assert resp.status_code == 413, resp.text
    assert servers.state() == before


# -- a short pass over real HTTP -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(committed: Committed) -> Iterator[tuple[Servers, dict[str, httpx.Client]]]:
    """The three apps served by uvicorn on 127.0.0.1 (one event loop in a thread), kept across examples."""
    servers = Servers(True)
    socks = []
    for _ in servers.apps:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
    uvs = [uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1))
           for app in servers.apps.values()]

    async def serve() -> None:
        await asyncio.gather(*(u.serve(sockets=[sock]) for u, sock in zip(uvs, socks, strict=True)))

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    end = time.monotonic() + 20
    while not all(u.started for u in uvs):
        assert time.monotonic() < end and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    ports = [sock.getsockname()[1] for sock in socks]
    clients = {k: httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
               for k, port in zip(servers.apps, ports, strict=True)}
    try:
        yield servers, clients
    finally:
        for client in clients.values():
            client.close()
        for u in uvs:
            u.should_exit = True
        thread.join(10)
        for sock in socks:
            sock.close()


@settings(FUZZ, max_examples=max(10, EXAMPLES // 5))
@given(sequence=st.lists(calls(), min_size=1, max_size=6))
def test_over_real_http(live: tuple[Servers, dict[str, httpx.Client]], committed: Committed, sandbox: Path,
                        sequence: list[dict[str, Any]]) -> None:
    servers, clients = live
    run_sequence(servers, clients, sequence, Ctx(committed, sandbox))
