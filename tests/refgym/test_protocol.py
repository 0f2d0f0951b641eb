"""Wire conformance: the reference servers against Gym's per-component control protocol, over real HTTP.

The facts come from the reference (``gym-control-protocol.md``, restated normatively in
``spec/CONTROL.md``); every request here is raw JSON and every answer is read as raw JSON, so what
is checked is what goes over the wire. One test per table of the reference:

========================  =============================================================
reference table           test
========================  =============================================================
§1 transport              :func:`test_transport_table`
§1 error codes            :func:`test_error_code_table`
§2 fencing                :func:`test_fence_rules_table`
§3 phase machine          :func:`test_phase_machine_table`
§4 routes (per component) :func:`test_routes_table`
§5 capabilities           :func:`test_capabilities_table` (and the topology fingerprint)
§6 files                  :func:`test_files_table`
§7 receipts               :func:`test_receipts_table`
§9 examples               :func:`test_examples`
========================  =============================================================

Most tests run against the session's deployment (``gym``: ``policy0``, ``agent0``, ``tools``,
``sandbox``), each with checkpoint and rollout ids of its own, leaving it idle; restores run on
fresh deployments (a resources restore needs a fresh process). Gym's own code judges where it can:
the 401 of Gym's control routes (``nemo_gym.token_id_capture.control_routes``) and Gym's
``TokenEntry`` for the rows of the model ledger.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import operator
import shutil
import tarfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI
from nemo_gym.token_id_capture.control_routes import install_rollout_control_routes
from nemo_gym.token_id_capture.records import TokenEntry, compute_digest, cumulative_tokens

from devtools.gym_fleet import (
    Fleet,
    Gym,
    RefServer,
    Spec,
    TakenSnapshot,
    listening_addresses,
    new_fleet,
    ok,
    take_snapshot,
    wait_until,
)
from devtools.gym_forkserver import ForkServer
from gymkit import GymFleet
from schemas import control
from schemas.control import CONTROL_PREFIX, ERROR_CODES, MAX_BODY_BYTES
from schemas.gym_records import AgentContinuationRoot
from schemas.identity import capture_key
from snapformat import SnapshotStore, open_snapshot

P = CONTROL_PREFIX
DEADLINE = 4102444800.0  # 2100-01-01: far enough
UNAUTHORIZED = {"detail": "missing or invalid control-plane bearer token"}

#: The long rollouts of the shared snapshot (``published``): parked mid-flight; ``q3`` also uses
#: the restart-only sandbox.
LONG = [Spec("rollout-a", seed=500, turns=8), Spec("q1", seed=501, turns=8), Spec("q2", seed=502, turns=8),
        Spec("q3", seed=503, turns=8, tools=("notes", "sandbox"))]

# -- the reference's tables, copied ------------------------------------------------------------------
#: §1 error codes, by owner.
REFERENCE_CODES = {
    "control": ["control_error", "stale_checkpoint", "checkpoint_conflict", "invalid_phase"],
    "model": ["not_a_policy_instance", "ledger_mismatch", "ledger_not_checkpointable", "ledger_not_quiescent"],
    "agent": ["agent_checkpoint_error", "duplicate_execution", "agent_admission_closed", "stale_attempt",
              "agent_prepare_incomplete", "completed_execution_acknowledgement_error"],
    "resources": ["resources_checkpoint_error", "resources_admission_closed", "stale_attempt",
                  "resources_session_unbound", "unsafe_resources_restore", "resource_revision_mismatch",
                  "resource_request_receipt_error", "resource_receipt_capacity_exhausted", "resource_receipt_evicted",
                  "resource_mutation_uncertain", "execution_identity_mismatch"],
    "admission": ["checkpoint_parked", "stale_attempt", "execution_identity_mismatch"],
}
#: Codes no reference server can be made to send, and why.
UNPRODUCIBLE = {
    "not_a_policy_instance": "every reference model server is the policy instance (refgym declares instance_role "
                             "'policy'; `refgym.serve` has no other role)",
    "ledger_not_checkpointable": "the sources give no condition for it; the reference model server never raises it",
    "ledger_not_quiescent": "the model fence reaches 'prepared' only once admission is paused with nothing in flight, "
                            "and commit requires 'prepared': in any other phase the fence answers invalid_phase first",
    "resource_mutation_uncertain": "the reference resources server answers every admitted call (refusals included) "
                                   "before it leaves the session, and decodes bodies before entering it",
    "execution_identity_mismatch": "the sources give no condition for it; neither gymkit nor refgym raises it",
    "missing_workers": "NeMo-RL's coordinator code, never sent by a server",
}
#: §4: every route, by component, with a request its validation accepts.
CTL = {"checkpoint_id": "ck-valid", "deadline_ts": DEADLINE}
ATT = {**CTL, "rollout_id": "r-valid", "attempt_index": 0}
DIR = {**CTL, "checkpoint_dir": "/nonexistent/gym"}
RECEIPT = {"rollout_id": "r-valid", "attempt_index": 0, "execution_generation": 1, "result_identity": "x",
           "result_digest": "0" * 64}
ROUTES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("model", "POST", "model-admission/pause", CTL),
    ("model", "GET", "model-admission/status", {"checkpoint_id": "ck-valid", "deadline_ts": DEADLINE}),
    ("model", "POST", "model-admission/resume", CTL),
    ("model", "POST", "model-admission/abort_inflight", ATT),
    ("model", "POST", "model-checkpoint/commit", {**DIR, "continuation_indexes": []}),
    ("model", "POST", "model-checkpoint/restore", DIR),
    ("agent", "POST", "agent-checkpoint/acknowledge", RECEIPT),
    ("agent", "POST", "agent-checkpoint/acknowledge-completed", {"executions": [RECEIPT]}),
    ("agent", "GET", "agent-checkpoint/completion-receipt", {"rollout_id": "r-valid", "attempt_index": 0}),
    ("agent", "POST", "agent-checkpoint/prepare", CTL),
    ("agent", "GET", "agent-checkpoint/status", {"checkpoint_id": "ck-valid"}),
    ("agent", "POST", "agent-checkpoint/commit", DIR),
    ("agent", "POST", "agent-checkpoint/restore", DIR),
    ("agent", "POST", "agent-checkpoint/resume", CTL),
    ("agent", "POST", "agent-checkpoint/retire", ATT),
    ("agent", "POST", "agent-checkpoint/discard-restored-continuation", ATT),
    ("resources", "POST", "resources-checkpoint/prepare", CTL),
    ("resources", "GET", "resources-checkpoint/status", {"checkpoint_id": "ck-valid", "deadline_ts": DEADLINE}),
    ("resources", "POST", "resources-checkpoint/commit", DIR),
    ("resources", "POST", "resources-checkpoint/restore", DIR),
    ("resources", "POST", "resources-checkpoint/resume", CTL),
    ("resources", "POST", "resources-checkpoint/retire", ATT),
]
#: §4 replies: the fields of each (a set: the reference lists them; extra diagnostic fields are
#: allowed only where it says so, resources status).
MODEL_PAUSE = {"state", "workers", "inflight_total", "waiters_total"}
MODEL_STATUS = {"checkpoint_id", "state", "per_worker", "inflight_total", "waiters_total", "inflight", "tombstones"}
MODEL_RESUME = {"state", "workers", "released_waiters"}
ABORT_INFLIGHT = {"state", "aborted_inflight", "inflight_total"}
MODEL_COMMIT = {"rollouts", "rows", "excluded_tombstoned", "excluded_inactive", "manifest_digest",
                "storage_reference_index"}
MODEL_RESTORE = {"rollouts", "rows", "checkpoint_id", "tombstones", "source_attempts", "storage_reference_index"}
AGENT_STATUS = {"state", "ready_to_commit", "running", "parked", "parked_with_boundary", "parked_without_boundary",
                "completed_unacknowledged", "acknowledged_completed", "active", "blocking_attempts",
                "completed_unacknowledged_attempts", "executions", "selected_boundaries"}
EXECUTION = ["rollout_id", "attempt_index", "generation", "state", "parked_boundary_state", "boundary_index",
             "turn_index", "boundary_kind", "resource_state_revisions", "age_seconds"]
SELECTED_BOUNDARY = {"rollout_id", "attempt_index", "boundary_index", "turn_index", "boundary_kind",
                     "resource_state_revisions"}
RECEIPT_FIELDS = ["rollout_id", "attempt_index", "execution_generation", "result_identity", "result_digest"]
ARTIFACT_REF = ["schema_version", "relative_path", "sha256", "records", "bytes"]
INVENTORY = {"rollout_id", "attempt_index", "revision", "mutation_receipts"}
RESOURCES_STATUS = {"checkpoint_id", "state", "admission_state", "sessions", "per_session", "prepared_inventory"}
#: §5 / §9: Gym's stateless resources server, as its test declares it.
CAPABILITIES_EXAMPLE = ('{"component":"resources_servers","name":"resources","schema_version":1,'
                        '"admission_states":["accepting"],"checkpoint_mode":"stateless","concurrency_contract":'
                        '"stateless","multi_process":{"mode":"single_worker","num_workers":1},"instance_role":null,'
                        '"features":[],"phase":"idle","active_checkpoint_id":null,"deadline_ts":null}')
PHASES = ["idle", "preparing", "prepared", "committing", "committed_paused", "restoring", "restore_failed_paused",
          "restored_paused"]


# -- helpers ------------------------------------------------------------------------------------------------
def raw(server: RefServer, method: str, route: str, body: Any = None, *, params: dict[str, Any] | None = None,
        token: str | None = None, content: bytes | None = None, headers: dict[str, str] | None = None
        ) -> httpx.Response:
    """One call of ``/ng-control/v1/<route>`` as it goes over the wire (the server's token unless given)."""
    return server.request(method, f"{P}/{route}", body, params=params, token=token, content=content, headers=headers)


def answer(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json()


def refusal(resp: httpx.Response, status: int = 409) -> str:
    """The code of a control refusal: ``status`` with exactly ``{"error": {"code", "detail"}}``."""
    assert resp.status_code == status, f"{resp.request.url}: {resp.status_code} {resp.text}"
    body = resp.json()
    assert list(body) == ["error"] and list(body["error"]) == ["code", "detail"], body
    assert isinstance(body["error"]["detail"], str) and body["error"]["detail"]
    return body["error"]["code"]


def data_plane_refusal(resp: httpx.Response) -> dict[str, Any]:
    """The resources data plane's 409: ``{"error": {"code", "message", ...}}``."""
    assert resp.status_code == 409, resp.text
    body = resp.json()
    assert list(body) == ["error"] and "detail" not in body["error"] and isinstance(body["error"]["message"], str)
    return body["error"]


def ctl(checkpoint_id: str, deadline_ts: float | None = None, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + 30 if deadline_ts is None else deadline_ts,
            **extra}


def caps(server: RefServer) -> dict[str, Any]:
    return answer(server.request("GET", f"{P}/capabilities", token=""))


def phase(server: RefServer) -> tuple[str, str | None]:
    c = caps(server)
    return c["phase"], c["active_checkpoint_id"]


def model_call(rollout_id: str, attempt_index: int = 0, call: int = 0) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt_index": attempt_index,
            "capture_key": capture_key(rollout_id, attempt_index), "model_call_id": f"call-{call}",
            "parent_call_id": f"call-{call - 1}" if call else None, "turn_index": call, "prompt_token_ids": [1, 2, 3]}


def session(server: RefServer, rollout_id: str, attempt_index: int, path: str = "/tools/notes",
            body: Any = None, request_id: str | None = "auto", expected: int | None = None) -> httpx.Response:
    """One resources data-plane call on (rid, n): ``/sessions/reset`` or a tool."""
    headers = {control.HEADER_ROLLOUT_ID: rollout_id, control.HEADER_ATTEMPT_INDEX: str(attempt_index)}
    if request_id is not None:
        headers[control.HEADER_RESOURCE_REQUEST_ID] = (
            f"{rollout_id}.{attempt_index}.{path}.{time.monotonic_ns()}" if request_id == "auto" else request_id)
    if expected is not None:
        headers[control.HEADER_EXPECTED_REVISION] = str(expected)
    return server.request("POST", path, {"args": {"value": 3}} if body is None else body, headers=headers)


def turn_started(gym: Gym, rollout_id: str) -> None:
    """Wait until ``rollout_id``'s first turn is under way: its session reset answered (the turn holds
    its slot from before the reset until after its tools), so its model call follows at once."""
    wait_until(lambda: f"{rollout_id}.a0" in gym.resource.get("/sessions"), f"{rollout_id}'s first turn")
    time.sleep(0.1)


def pause_draining(model: RefServer, pool: ThreadPoolExecutor, prefix: str, deadline_ts: float | None = None
                   ) -> tuple[str, dict[str, Any], Any]:
    """Pause the model while a call of ours is in flight, so admission is ``draining``: returns the
    checkpoint id, the pause reply and the call's future. A call not admitted yet when the pause
    comes (a loaded machine) is refused instead: then resume and try again, under a new id."""
    for attempt in range(5):
        call = pool.submit(model.post, "/v1/responses", model_call(f"{prefix}-call{attempt}"))
        time.sleep(0.15 * (attempt + 1))
        cid = f"{prefix}-{attempt}"
        reply = answer(raw(model, "POST", "model-admission/pause", ctl(cid, deadline_ts)))
        if reply["state"] == "draining":
            return cid, reply, call
        answer(raw(model, "POST", "model-admission/resume", ctl(cid)))
        call.result(timeout=30)
    raise AssertionError("no call of ours was in flight at any pause")


def resume_everything(gym: Gym, checkpoint_id: str) -> None:
    """The coordinator's resume (resources, models, agents) of what ``checkpoint_id`` holds."""
    for server, route in ((gym.resource, "resources-checkpoint/resume"), (gym.model, "model-admission/resume"),
                          (gym.agent, "agent-checkpoint/resume")):
        if phase(server) != ("idle", None):
            answer(raw(server, "POST", route, ctl(checkpoint_id)))


def rollout(gym: Gym, rollout_id: str, turns: int = 1, attempt_index: int = 0, **kw: Any) -> httpx.Response:
    return gym.agent.post("/rollouts", {"rollout_id": rollout_id, "attempt_index": attempt_index, "seed": 1,
                                        "turns": turns, **kw})


def finish(gym: Gym, *rollout_ids: str) -> dict[str, dict[str, Any]]:
    """Wait for these rollouts' results (not acknowledged)."""
    return gym.wait_results(rollout_ids)


def servers_of(gym: Gym) -> dict[str, list[RefServer]]:
    return {"model": [gym.model], "agent": [gym.agent], "resources": [gym.resource, gym.sandbox]}


@pytest.fixture(scope="module")
def published(gym: Gym, tmp_path_factory: pytest.TempPathFactory) -> TakenSnapshot:
    """A snapshot of the session deployment with the ``LONG`` rollouts parked mid-flight (taken as
    NeMo-RL's actor does it); the run then finishes and the results are acknowledged, so the
    deployment is quiet for the other tests."""
    ids = [s.rollout_id for s in LONG]
    gym.start(LONG)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts") if r["rollout_id"] in ids),
               "every long rollout's first turn")
    snap = take_snapshot(gym, SnapshotStore(str(tmp_path_factory.mktemp("store"))), "ckpt-base")
    gym.acknowledge(gym.wait_results(ids).values())
    return snap


def gym_dir(snap: TakenSnapshot) -> Path:
    """The snapshot's ``gym/`` folder (a local store): the ``checkpoint_dir`` Gym's servers wrote."""
    return Path(snap.published.url) / "gym"


# -- §1 transport -----------------------------------------------------------------------------------------------
def test_transport_table(gym: Gym) -> None:
    """§1: base path, bearer auth (exact, case-sensitive, the 401 body Gym's own routes send), the one
    unauthenticated route, 422 before auth, the 409 envelope, the data-plane refusals, 404 and 405."""
    token = gym.model.token
    # Gym's own bearer check (nemo_gym 0.7.0's token-capture control routes) is the judge of the 401.
    judge_app = FastAPI()
    install_rollout_control_routes(judge_app, None, auth_token=token)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's note about its own test client
        from fastapi.testclient import TestClient
    with TestClient(judge_app) as judge:
        gym_401 = judge.get("/training-token-capture/control/rollouts/r/manifest")
    assert gym_401.status_code == 401 and gym_401.json() == UNAUTHORIZED

    by_component = servers_of(gym)
    for component, method, route, valid in ROUTES:
        server = by_component[component][0]
        kw: dict[str, Any] = {"params": valid} if method == "GET" else {"body": valid}
        for bad in ("", "wrong", f"bearer {token}", f"Bearer {token}x", f"Bearer  {token}", token, f"Basic {token}",
                    f"Bearer {token[:-1]}"):
            headers = {"authorization": bad} if bad else None
            resp = raw(server, method, route, token="", headers=headers, **kw)
            assert resp.status_code == 401, (route, bad, resp.text)
            assert resp.content == gym_401.content  # byte for byte Gym's 401, not the error envelope
        # Validation runs before the token: a malformed call is 422 even without one.
        bad_kw: dict[str, Any] = {"params": {}} if method == "GET" else {"content": b'{"unknown_field": 1}'}
        resp = raw(server, method, route, token="", **bad_kw)
        assert resp.status_code == 422, (route, resp.text)
        detail = resp.json()["detail"]
        assert list(resp.json()) == ["detail"] and detail and all(list(d) == ["type", "loc", "msg"] for d in detail)
        assert detail[0]["loc"][0] == ("query" if method == "GET" else "body")
        # Each route lives only on its component's servers: 404 elsewhere; 405 for the other method.
        for other, servers in by_component.items():
            for s in servers if other != component else ():
                assert raw(s, method, route, **kw).status_code == 404, (route, s.url)
        wrong = raw(server, "GET" if method == "POST" else "POST", route, **kw)
        assert wrong.status_code == 405, (route, wrong.text)
    # The one unauthenticated route, on every server; an unknown path under the prefix is 404.
    for s in gym.clients:
        assert raw(s, "GET", "capabilities", token="").status_code == 200
        assert raw(s, "POST", "capabilities", token="").status_code == 405
        assert raw(s, "GET", "nothing-here").status_code == 404
        assert raw(s, "POST", "checkpoint/prepare", ctl("ck-tr")).status_code == 404  # the later generation
        assert listening_addresses(int(s.url.rsplit(":", 1)[1])) == {"0100007F"}  # 127.0.0.1 only

    # The common body: schema_version 1, checkpoint_id pattern and length, deadline_ts required and
    # finite; unknown fields refused. Each is 422 (with or without a token) and changes nothing.
    bad_bodies = [
        b"", b"{not json", b"[]", b'"text"',
        b'{"checkpoint_id":"ck-tr"}',
        b'{"deadline_ts":4e9}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":4e9,"extra":1}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":4e9,"deadline":4e9}',
        b'{"schema_version":2,"checkpoint_id":"ck-tr","deadline_ts":4e9}',
        b'{"checkpoint_id":"","deadline_ts":4e9}',
        b'{"checkpoint_id":"-ck","deadline_ts":4e9}',
        b'{"checkpoint_id":"ck/tr","deadline_ts":4e9}',
        b'{"checkpoint_id":"ck-tr\\n","deadline_ts":4e9}',
        b'{"checkpoint_id":"' + b"c" * 129 + b'","deadline_ts":4e9}',
        b'{"checkpoint_id":7,"deadline_ts":4e9}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":NaN}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":1e400}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":"inf"}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":"soon"}',
        b'{"checkpoint_id":"ck-tr","deadline_ts":null}',
    ]
    for body in bad_bodies:
        for tok in (None, ""):
            resp = raw(gym.agent, "POST", "agent-checkpoint/prepare", content=body, token=tok)
            assert resp.status_code == 422, (body, resp.text)
    assert raw(gym.model, "POST", "model-admission/pause", content=b"x" * (MAX_BODY_BYTES + 1)).status_code == 413
    for bad_attempt in ({"rollout_id": "-r"}, {"rollout_id": "r" * 129}, {"attempt_index": -1},
                        {"attempt_index": 1.5}, {"attempt_index": None}):
        resp = raw(gym.agent, "POST", "agent-checkpoint/retire", {**ATT, "checkpoint_id": "ck-tr", **bad_attempt})
        assert resp.status_code == 422, (bad_attempt, resp.text)
    for query in ({"checkpoint_id": "ck-tr"}, {"checkpoint_id": "ck-tr", "deadline_ts": "nan"},
                  {"checkpoint_id": "ck-tr", "deadline_ts": "inf"}, {"checkpoint_id": "ck-tr", "deadline_ts": "x"},
                  {"checkpoint_id": "ck-tr", "deadline_ts": "4e9", "timeout_s": "-1"},
                  {"checkpoint_id": "ck-tr", "deadline_ts": "4e9", "timeout_s": "nan"},
                  {"checkpoint_id": "ck-tr", "deadline_ts": "4e9", "wait_state": "draining"}):
        assert raw(gym.model, "GET", "model-admission/status", params=query, token="").status_code == 422, query
    for s in gym.clients:
        assert phase(s) == ("idle", None)
    # Number strings are accepted where a number is expected (Gym's models validate in lax mode).
    reply = answer(raw(gym.resource, "POST", "resources-checkpoint/resume",
                       content=b'{"checkpoint_id":"ck-tr-lax","deadline_ts":"4102444800"}'))
    assert reply == {"state": "accepting"}

    # 409: every control error is the envelope (checked by `refusal`); here, a phase refusal.
    assert refusal(raw(gym.model, "POST", "model-admission/resume", ctl("ck-tr-409"))) == "invalid_phase"

    # The data plane's refusals: the model's admission (409 + retry-after: 1), the resources' (message).
    answer(raw(gym.model, "POST", "model-admission/pause", ctl("ck-tr-dp")))
    parked = gym.model.post("/v1/responses", model_call("tr-dp"))
    assert refusal(parked) == "checkpoint_parked" and parked.headers["retry-after"] == "1"
    answer(raw(gym.model, "POST", "model-admission/resume", ctl("ck-tr-dp")))
    unbound = data_plane_refusal(session(gym.resource, "tr-dp", 0))
    assert unbound["code"] == "resources_session_unbound"
    reset = session(gym.resource, "tr-dp", 0, "/sessions/reset", body={})
    assert reset.status_code == 200 and reset.headers[control.HEADER_RESOURCE_REVISION] == "1"
    # The data-plane header names are Gym's.
    assert (control.HEADER_ROLLOUT_ID, control.HEADER_ATTEMPT_INDEX, control.HEADER_PLANE,
            control.HEADER_RESOURCE_REVISION, control.HEADER_EXPECTED_REVISION, control.HEADER_RESOURCE_REQUEST_ID) == (
        "x-nemo-gym-rollout-id", "x-nemo-gym-attempt-index", "x-nemo-gym-plane",
        "x-nemo-gym-resource-state-revision", "x-nemo-gym-expected-resource-state-revision",
        "x-nemo-gym-resource-request-id")
    # Identity: the capture key of an attempt.
    assert [capture_key("group-7_g0", n) for n in (0, 1, 12)] == ["group-7_g0", "group-7_g0-a1", "group-7_g0-a12"]
    for s in gym.clients:
        assert phase(s) == ("idle", None)


# -- §1 error codes --------------------------------------------------------------------------------------------
def test_error_code_table(gym: Gym, fleet: Fleet, tmp_path: Path) -> None:
    """§1: the codes are the reference's, and each code a reference server can send is produced by
    the input that should produce it (the others are listed in ``UNPRODUCIBLE`` with the reason)."""
    assert {k: list(v) for k, v in ERROR_CODES.items()} == REFERENCE_CODES
    assert control.COORDINATOR_ONLY_CODES == ("missing_workers",)
    every = {c for codes in REFERENCE_CODES.values() for c in codes} | {"missing_workers"}
    produced: set[str] = set()

    def got(code: str, resp: httpx.Response, status: int = 409) -> None:
        assert refusal(resp, status) == code
        produced.add(code)

    def got_data(code: str, resp: httpx.Response) -> dict[str, Any]:
        error = data_plane_refusal(resp)
        assert error["code"] == code, error
        produced.add(code)
        return error

    m, a, r = gym.model, gym.agent, gym.resource
    # -- control ----------------------------------------------------------------------------------------
    answer(raw(m, "POST", "model-admission/pause", ctl("ec-stale")))
    answer(raw(m, "POST", "model-admission/resume", ctl("ec-stale")))
    got("stale_checkpoint", raw(m, "POST", "model-admission/pause", ctl("ec-stale")))
    answer(raw(a, "POST", "agent-checkpoint/prepare", ctl("ec-a")))
    got("checkpoint_conflict", raw(a, "GET", "agent-checkpoint/status", params={"checkpoint_id": "ec-b"}))
    answer(raw(a, "POST", "agent-checkpoint/resume", ctl("ec-a")))
    got("invalid_phase", raw(a, "POST", "agent-checkpoint/commit", {**ctl("ec-ip"), "checkpoint_dir": str(tmp_path)}))
    # An unexpected failure is 500 control_error (never with the token): the model commits into a
    # checkpoint_dir below a file.
    answer(raw(m, "POST", "model-admission/pause", ctl("ec-500")))
    resp = raw(m, "POST", "model-checkpoint/commit", {**ctl("ec-500"), "checkpoint_dir": "/dev/null/gym",
                                                      "continuation_indexes": []})
    got("control_error", resp, status=500)
    assert m.token not in resp.text
    assert phase(m) == ("prepared", "ec-500")  # a failure is not recorded: the phase is back
    # -- model ------------------------------------------------------------------------------------------
    index = tmp_path / "agent" / "instance-x" / "continuations.jsonl"
    index.parent.mkdir(parents=True)
    line = (b'{"schema_version":1,"rollout_id":"never","attempt_index":0,"capture_key":"never",'
            b'"last_committed_model_call_id":"call-3","resource_state_revisions":{}}\n')
    index.write_bytes(line)
    good_ref = {"schema_version": 1, "relative_path": "agent/instance-x/continuations.jsonl",
                "sha256": hashlib.sha256(line).hexdigest(), "records": 1, "bytes": len(line)}
    for ref in (good_ref, {**good_ref, "sha256": "0" * 64}, {**good_ref, "records": 2}):
        got("ledger_mismatch", raw(m, "POST", "model-checkpoint/commit", {
            **ctl("ec-500"), "checkpoint_dir": str(tmp_path), "continuation_indexes": [ref]}))
    answer(raw(m, "POST", "model-admission/resume", ctl("ec-500")))
    # -- agent ------------------------------------------------------------------------------------------
    got("agent_checkpoint_error", raw(a, "POST", "agent-checkpoint/restore",
                                      {**ctl("ec-ace"), "checkpoint_dir": str(tmp_path / "empty")}))
    assert phase(a) == ("idle", None)
    assert rollout(gym, "ec-dup", turns=2).status_code == 202
    got("duplicate_execution", rollout(gym, "ec-dup", turns=2))
    gym.acknowledge(finish(gym, "ec-dup").values())
    got("stale_attempt", rollout(gym, "ec-dup", turns=2))  # acknowledged: never run again
    answer(raw(a, "POST", "agent-checkpoint/prepare", ctl("ec-adm")))
    got("agent_admission_closed", rollout(gym, "ec-adm"))
    answer(raw(a, "POST", "agent-checkpoint/resume", ctl("ec-adm")))
    assert rollout(gym, "ec-inc").status_code == 202
    done = finish(gym, "ec-inc")
    t0 = time.monotonic()
    got("agent_prepare_incomplete", raw(a, "POST", "agent-checkpoint/prepare", ctl("ec-inc")))  # unacknowledged
    assert time.monotonic() - t0 < 5  # at once, not at the deadline 30 s away: nothing runs to wait for
    got("agent_admission_closed", rollout(gym, "ec-inc2"))  # a failed prepare leaves admission closed
    answer(raw(a, "POST", "agent-checkpoint/resume", ctl("ec-inc")))  # a fresh id from idle reopens it
    gym.acknowledge(done.values())
    got("completed_execution_acknowledgement_error",
        raw(a, "GET", "agent-checkpoint/completion-receipt", params={"rollout_id": "never", "attempt_index": 0}))
    # -- resources --------------------------------------------------------------------------------------
    assert session(r, "ec-sess", 0, "/sessions/reset", body={}).status_code == 200
    got("resources_checkpoint_error", raw(r, "POST", "resources-checkpoint/prepare", ctl("ec-rce", time.time() - 1)))
    got_data("resources_admission_closed", session(r, "ec-sess", 0))  # a failed prepare leaves it closed
    answer(raw(r, "POST", "resources-checkpoint/resume", ctl("ec-rce")))
    assert session(r, "ec-sess", 0, expected=1).status_code == 200
    answer(raw(r, "POST", "resources-checkpoint/prepare", ctl("ec-ret")))
    assert answer(raw(r, "POST", "resources-checkpoint/retire", {**ctl("ec-ret"), "rollout_id": "ec-sess",
                                                                  "attempt_index": 0})) == {
        "retired": True, "rollout_id": "ec-sess", "attempt_index": 0}
    answer(raw(r, "POST", "resources-checkpoint/resume", ctl("ec-ret")))
    got_data("stale_attempt", session(r, "ec-sess", 0))
    got_data("resources_session_unbound", session(r, "ec-unbound", 0))
    assert session(r, "ec-rev", 0, "/sessions/reset", body={}).status_code == 200
    mismatch = got_data("resource_revision_mismatch", session(r, "ec-rev", 0, expected=5))
    assert (mismatch["expected_revision"], mismatch["actual_revision"]) == (5, 1)
    got_data("resource_request_receipt_error", session(r, "ec-rev", 0, request_id=None))
    assert session(r, "ec-rev", 0, request_id="req-1", expected=1).status_code == 200
    replay = session(r, "ec-rev", 0, request_id="req-1", expected=1)  # a retry replays its receipt
    assert replay.status_code == 200 and replay.headers[control.HEADER_RESOURCE_REVISION] == "2"
    got_data("resource_request_receipt_error", session(r, "ec-rev", 0, request_id="req-1", expected=1,
                                                       body={"args": {"value": 4}}))  # same id, other input
    # A session keeps at most 1024 receipts (the reset took one).
    headers = {control.HEADER_ROLLOUT_ID: "ec-cap", control.HEADER_ATTEMPT_INDEX: "0"}
    with httpx.Client(base_url=r.url) as http:
        assert http.post("/sessions/reset", json={}, headers={
            **headers, control.HEADER_RESOURCE_REQUEST_ID: "reset"}).status_code == 200
        for i in range(1023):
            assert http.post("/tools/notes", json={"args": {"value": i}}, headers={
                **headers, control.HEADER_RESOURCE_REQUEST_ID: f"c{i}"}).status_code == 200
        got_data("resource_receipt_capacity_exhausted", http.post("/tools/notes", json={"args": {"value": 1}}, headers={
            **headers, control.HEADER_RESOURCE_REQUEST_ID: "one-too-many"}))
    # An ended session (the rollout's terminal call) keeps its receipts, so a retried request still
    # replays; of the 1024 sessions ended last. The receipts of older ones are evicted.
    def ended(i: int) -> None:
        headers = {control.HEADER_ROLLOUT_ID: f"ec-end{i}", control.HEADER_ATTEMPT_INDEX: "0"}
        for path in ("/sessions/reset", "/sessions/end"):
            resp = http.post(path, json={}, headers={**headers, control.HEADER_RESOURCE_REQUEST_ID: path})
            assert resp.status_code == 200, resp.text

    with httpx.Client(base_url=r.url) as http, ThreadPoolExecutor(4) as pool:
        ended(0)
        again = session(r, "ec-end0", 0, "/sessions/end", body={}, request_id="/sessions/end")
        assert again.status_code == 200  # replayed from its receipt
        list(pool.map(ended, range(1, 1025)))
    got_data("resource_receipt_evicted", session(r, "ec-end0", 0, "/sessions/end", body={},
                                                 request_id="/sessions/end"))
    got("unsafe_resources_restore", raw(r, "POST", "resources-checkpoint/restore",
                                        {**ctl("ec-unsafe"), "checkpoint_dir": str(tmp_path)}))
    got_data("resources_admission_closed", session(r, "ec-rev", 0))  # the refused restore closed it
    answer(raw(r, "POST", "resources-checkpoint/resume", ctl("ec-unsafe")))
    fresh = fleet.gym()  # a fresh process: the missing folder is the error now
    got("resources_checkpoint_error", raw(fresh.resource, "POST", "resources-checkpoint/restore",
                                          {**ctl("ec-nofiles"), "checkpoint_dir": str(tmp_path / "empty")}))
    # -- admission (the model's data plane) ---------------------------------------------------------------
    answer(raw(m, "POST", "model-admission/pause", ctl("ec-park")))
    parked = m.post("/v1/responses", model_call("ec-park"))
    got("checkpoint_parked", parked)
    assert parked.headers["retry-after"] == "1"
    answer(raw(m, "POST", "model-admission/abort_inflight", ctl("ec-park", rollout_id="ec-gone", attempt_index=0)))
    answer(raw(m, "POST", "model-admission/resume", ctl("ec-park")))
    stale = m.post("/v1/responses", model_call("ec-gone"))
    got("stale_attempt", stale)
    assert stale.headers["retry-after"] == "1"

    assert produced | set(UNPRODUCIBLE) == every, sorted(every - produced - set(UNPRODUCIBLE))
    assert not produced & set(UNPRODUCIBLE)
    for s in gym.clients:
        assert phase(s) == ("idle", None)


# -- §2 fencing -------------------------------------------------------------------------------------------------
def test_fence_rules_table(gym: Gym, fleet: Fleet, published: TakenSnapshot, tmp_path: Path) -> None:
    """§2: replay, concurrent duplicates, failure, conflict, retirement, unfenced routes, files already
    on disk, deadlines."""
    m, a, r = gym.model, gym.agent, gym.resource
    # replay: a repeat of (checkpoint_id, operation) answers the recorded result, byte for byte.
    cid, folder = "fr-rep", str(tmp_path / "rep" / "gym")

    def twice(server: RefServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
        first = raw(server, "POST", route, body)
        again = raw(server, "POST", route, body)
        assert first.status_code == 200 and again.content == first.content, (route, first.text, again.text)
        return first.json()

    twice(m, "model-admission/pause", ctl(cid))
    twice(a, "agent-checkpoint/prepare", ctl(cid))
    twice(r, "resources-checkpoint/prepare", ctl(cid))
    aborted = twice(m, "model-admission/abort_inflight", ctl(cid, rollout_id="fr-x", attempt_index=0))
    assert aborted["aborted_inflight"] == 0
    twice(m, "model-admission/abort_inflight", ctl(cid, rollout_id="fr-x", attempt_index=1))  # its own operation
    agent = twice(a, "agent-checkpoint/commit", ctl(cid, checkpoint_dir=folder))
    twice(m, "model-checkpoint/commit", ctl(cid, checkpoint_dir=folder, continuation_indexes=[agent["continuation_index"]]))
    twice(r, "resources-checkpoint/commit", ctl(cid, checkpoint_dir=folder))
    # conflict: another id while one is active, on fenced and unfenced routes alike.
    other = ctl("fr-other")
    assert refusal(raw(m, "POST", "model-admission/pause", other)) == "checkpoint_conflict"
    assert refusal(raw(m, "GET", "model-admission/status", params=other)) == "checkpoint_conflict"
    assert refusal(raw(a, "POST", "agent-checkpoint/resume", other)) == "checkpoint_conflict"
    assert refusal(raw(a, "GET", "agent-checkpoint/status", params={"checkpoint_id": "fr-other"})) == \
        "checkpoint_conflict"
    assert refusal(raw(a, "POST", "agent-checkpoint/retire", {**other, "rollout_id": "x", "attempt_index": 0})) == \
        "checkpoint_conflict"
    assert refusal(raw(r, "POST", "resources-checkpoint/restore", {**other, "checkpoint_dir": folder})) == \
        "checkpoint_conflict"
    # retirement: resume retires the id; only the resume still replays; anything else is stale.
    twice(r, "resources-checkpoint/resume", ctl(cid))
    twice(m, "model-admission/resume", ctl(cid))
    twice(a, "agent-checkpoint/resume", ctl(cid))
    for server, route, body in ((m, "model-admission/pause", ctl(cid)), (a, "agent-checkpoint/prepare", ctl(cid)),
                                (r, "resources-checkpoint/prepare", ctl(cid)),
                                (a, "agent-checkpoint/commit", ctl(cid, checkpoint_dir=folder)),
                                (m, "model-checkpoint/commit", ctl(cid, checkpoint_dir=folder,
                                                                  continuation_indexes=[agent["continuation_index"]])),
                                (r, "resources-checkpoint/commit", ctl(cid, checkpoint_dir=folder)),
                                (a, "agent-checkpoint/retire", ctl(cid, rollout_id="x", attempt_index=0))):
        assert refusal(raw(server, "POST", route, body)) == "stale_checkpoint", route
    assert refusal(raw(a, "GET", "agent-checkpoint/status", params={"checkpoint_id": cid})) == "stale_checkpoint"
    assert refusal(raw(m, "GET", "model-admission/status", params=ctl(cid))) == "stale_checkpoint"
    # unfenced routes record nothing: an agent status in idle leaves no active id behind.
    assert answer(raw(a, "GET", "agent-checkpoint/status", params={"checkpoint_id": "fr-unfenced"}))[
        "checkpoint_id"] == "fr-unfenced"
    for s in gym.clients:
        assert phase(s) == ("idle", None)
    assert refusal(raw(m, "GET", "model-admission/status", params=ctl("fr-unfenced"))) == "invalid_phase"
    assert refusal(raw(r, "GET", "resources-checkpoint/status", params=ctl("fr-unfenced"))) == "invalid_phase"

    # failure, concurrent duplicates and deadlines, on a deployment whose model takes 1.2 s a call.
    slow = fleet.gym(model_slow_ms=1200)
    mine = ThreadPoolExecutor(4)
    assert rollout(slow, "fr-slow", turns=3).status_code == 202
    turn_started(slow, "fr-slow")  # its first model call is in flight
    # failure: not recorded, the phase back to idle with no active id, agent admission left closed.
    assert refusal(raw(slow.agent, "POST", "agent-checkpoint/prepare", ctl("fr-fail", time.time() + 0.05))) == \
        "agent_prepare_incomplete"
    assert phase(slow.agent) == ("idle", None)
    assert refusal(rollout(slow, "fr-late")) == "agent_admission_closed"
    # ... so a retry runs again; a concurrent duplicate waits for the first run and gets its answer.
    t0 = time.monotonic()
    both = [mine.submit(raw, slow.agent, "POST", "agent-checkpoint/prepare", ctl("fr-fail")) for _ in range(2)]
    first, second = (f.result(timeout=30) for f in both)
    assert first.status_code == 200 and second.content == first.content
    assert first.json()["ready_to_commit"] and time.monotonic() - t0 > 0.1  # it waited for the turn to end
    # deadlines: never refused on entry (a pause long past its deadline runs), the model status waits
    # at most min(timeout_s, time left), the resources prepare fails past it with sessions left,
    # commit and resume ignore it.
    mcid, pause, in_flight = pause_draining(slow.model, mine, "fr-model", time.time() - 100)
    assert pause["inflight_total"] == 1  # our own call is still in flight
    for timeout_s, deadline_in in ((0.15, 30), (30, 0.15)):  # the call in flight ends ~0.9 s later
        t0 = time.monotonic()
        status = answer(raw(slow.model, "GET", "model-admission/status", params={
            **ctl(mcid, time.time() + deadline_in), "wait_state": "paused", "timeout_s": timeout_s}))
        assert status["state"] == "draining" and 0.1 < time.monotonic() - t0 < 0.45
    status = answer(raw(slow.model, "GET", "model-admission/status", params={
        **ctl(mcid), "wait_state": "paused", "timeout_s": 10}))
    assert status["state"] == "paused" and phase(slow.model) == ("prepared", mcid)
    assert ok(in_flight.result(timeout=10))["model_call_id"] == "call-0"
    mine.shutdown()
    assert refusal(raw(slow.resource, "POST", "resources-checkpoint/prepare", ctl("fr-fail", time.time() - 1))) == \
        "resources_checkpoint_error"
    answer(raw(slow.resource, "POST", "resources-checkpoint/prepare", ctl("fr-fail")))
    past = time.time() - 100
    agent = answer(raw(slow.agent, "POST", "agent-checkpoint/commit", ctl("fr-fail", past, checkpoint_dir=folder + "2")))
    answer(raw(slow.model, "POST", "model-checkpoint/commit", ctl(mcid, past, checkpoint_dir=folder + "2",
                                                                  continuation_indexes=[agent["continuation_index"]])))
    answer(raw(slow.resource, "POST", "resources-checkpoint/commit", ctl("fr-fail", past, checkpoint_dir=folder + "2")))
    for server, route, which in ((slow.resource, "resources-checkpoint/resume", "fr-fail"),
                                 (slow.model, "model-admission/resume", mcid),
                                 (slow.agent, "agent-checkpoint/resume", "fr-fail")):
        answer(raw(server, "POST", route, ctl(which, past)))

    # files already there: a commit that finds its own manifest checks it and answers its digest; the
    # ledger's must also have the tombstones, source attempts and roots this commit would write.
    copy = tmp_path / "on-disk" / "gym"
    shutil.copytree(gym_dir(published), copy)
    again = fleet.gym()
    for server, route in ((again.model, "model-checkpoint/restore"), (again.agent, "agent-checkpoint/restore"),
                          (again.resource, "resources-checkpoint/restore")):
        answer(raw(server, "POST", route, ctl("od-restore", checkpoint_dir=str(copy))))
    resume_everything(again, "od-restore")
    saved = {p.component: msgspec.to_builtins(p.reply) for p in published.commit.participants}
    for server, route in ((again.model, "model-admission/pause"), (again.agent, "agent-checkpoint/prepare"),
                          (again.resource, "resources-checkpoint/prepare")):
        answer(raw(server, "POST", route, ctl(published.checkpoint_id)))
    assert answer(raw(again.agent, "POST", "agent-checkpoint/commit",
                      ctl(published.checkpoint_id, checkpoint_dir=str(copy)))) == saved["responses_api_agents"]
    assert answer(raw(again.resource, "POST", "resources-checkpoint/commit",
                      ctl(published.checkpoint_id, checkpoint_dir=str(copy)))) == saved["resources_servers"]
    mismatch = raw(again.model, "POST", "model-checkpoint/commit", ctl(
        published.checkpoint_id, checkpoint_dir=str(copy),
        continuation_indexes=[saved["responses_api_agents"]["continuation_index"]]))
    assert refusal(mismatch) == "ledger_mismatch"  # this process tombstoned the roots' source attempts
    assert "tombstones" in mismatch.json()["error"]["detail"]
    resume_everything(again, published.checkpoint_id)
    for s in gym.clients + again.clients:
        assert phase(s) == ("idle", None)


# -- §3 phase machine --------------------------------------------------------------------------------------------
def test_phase_machine_table(fleet: Fleet, tmp_path: Path) -> None:
    """§3: every transition of the table, as ``GET capabilities`` reports the phase, and admission
    (accepting -> draining -> paused; the last call in flight turns draining into paused)."""
    g = fleet.gym(model_slow_ms=800, commit_delay_ms=400)
    folder = str(tmp_path / "gym")
    assert set(PHASES) == set(control.PHASES)
    for s in g.clients:
        c = caps(s)
        assert (c["phase"], c["active_checkpoint_id"], c["deadline_ts"]) == ("idle", None, None)
    pool = ThreadPoolExecutor(4)
    # idle -> preparing -> prepared: agent prepare (waiting for the turn in flight to end).
    assert rollout(g, "pm-r", turns=3).status_code == 202
    turn_started(g, "pm-r")  # its first model call is in flight
    deadline = time.time() + 30
    agent_prepare = pool.submit(raw, g.agent, "POST", "agent-checkpoint/prepare", ctl("pm-1", deadline))
    wait_until(lambda: phase(g.agent) == ("preparing", "pm-1"), "the agent preparing")
    # model pause: preparing while admission drains, prepared once paused (marked by status).
    mcid, pause, ours = pause_draining(g.model, pool, "pm-model", deadline)
    assert pause["inflight_total"] >= 1
    c = caps(g.model)
    assert (c["phase"], c["active_checkpoint_id"], c["deadline_ts"]) == ("preparing", mcid, deadline)
    assert refusal(raw(g.model, "POST", "model-checkpoint/commit",
                       ctl(mcid, checkpoint_dir=folder, continuation_indexes=[]))) == "invalid_phase"
    status = answer(raw(g.model, "GET", "model-admission/status", params={**ctl(mcid), "wait_state": "paused",
                                                                           "timeout_s": 10}))
    assert (status["state"], status["inflight_total"]) == ("paused", 0)  # the last release paused it
    assert phase(g.model) == ("prepared", mcid)
    assert ours.result(timeout=10).status_code == 200
    assert answer(agent_prepare.result(timeout=30))["ready_to_commit"]
    assert phase(g.agent) == ("prepared", "pm-1")
    assert answer(raw(g.resource, "POST", "resources-checkpoint/prepare", ctl("pm-1")))["state"] == "prepared"
    assert phase(g.resource) == ("prepared", "pm-1")
    assert phase(g.sandbox) == ("idle", None)  # restart_only: no part in a checkpoint
    # prepared -> committing -> committed_paused, every commit (the model's held open 0.4 s).
    agent = answer(raw(g.agent, "POST", "agent-checkpoint/commit", ctl("pm-1", checkpoint_dir=folder)))
    model_commit = pool.submit(raw, g.model, "POST", "model-checkpoint/commit", ctl(
        mcid, checkpoint_dir=folder, continuation_indexes=[agent["continuation_index"]]))
    wait_until(lambda: phase(g.model) == ("committing", mcid), "the model committing")
    answer(model_commit.result(timeout=30))
    answer(raw(g.resource, "POST", "resources-checkpoint/commit", ctl("pm-1", checkpoint_dir=folder)))
    assert phase(g.model) == ("committed_paused", mcid)
    for s in (g.agent, g.resource):
        assert phase(s) == ("committed_paused", "pm-1")
    # -> idle, the id retired, every resume.
    answer(raw(g.model, "POST", "model-admission/resume", ctl(mcid)))
    resume_everything(g, "pm-1")
    for s in g.clients:
        assert phase(s) == ("idle", None)
    # resume's source phases: agents and resources also from idle (a fresh id), the model not.
    assert refusal(raw(g.model, "POST", "model-admission/resume", ctl("pm-2"))) == "invalid_phase"
    assert answer(raw(g.agent, "POST", "agent-checkpoint/resume", ctl("pm-2")))["state"] == "accepting"
    assert answer(raw(g.resource, "POST", "resources-checkpoint/resume", ctl("pm-2"))) == {"state": "accepting"}
    # routes allowed only in some phases
    assert refusal(raw(g.agent, "POST", "agent-checkpoint/discard-restored-continuation",
                       ctl("pm-3", rollout_id="pm-r", attempt_index=1))) == "invalid_phase"  # restored_paused only
    assert refusal(raw(g.resource, "POST", "resources-checkpoint/retire",
                       ctl("pm-3", rollout_id="pm-r", attempt_index=0))) == "invalid_phase"  # preparing/prepared
    assert refusal(raw(g.resource, "GET", "resources-checkpoint/status", params=ctl("pm-3"))) == "invalid_phase"

    # restore: model idle or restore_failed_paused -> restoring -> restored_paused (failure:
    # restore_failed_paused, admission left paused); agents and resources idle -> restored_paused.
    fresh = fleet.gym()
    empty = ctl("pm-r1", checkpoint_dir=str(tmp_path / "nothing"))
    assert refusal(raw(fresh.model, "POST", "model-checkpoint/restore", empty)) == "ledger_mismatch"
    assert phase(fresh.model) == ("restore_failed_paused", None)
    assert refusal(fresh.model.post("/v1/responses", model_call("pm-x"))) == "checkpoint_parked"
    answer(raw(fresh.model, "POST", "model-admission/resume", ctl("pm-r1")))  # allowed from restore_failed_paused
    assert phase(fresh.model) == ("idle", None)
    assert refusal(raw(fresh.model, "POST", "model-checkpoint/restore", {**empty, "checkpoint_id": "pm-r2"})) == \
        "ledger_mismatch"
    good = ctl("pm-r2", checkpoint_dir=folder)
    assert answer(raw(fresh.model, "POST", "model-checkpoint/restore", good))["checkpoint_id"] == mcid
    answer(raw(fresh.agent, "POST", "agent-checkpoint/restore", good))
    answer(raw(fresh.resource, "POST", "resources-checkpoint/restore", good))
    for s in (fresh.model, fresh.agent, fresh.resource):
        assert phase(s) == ("restored_paused", "pm-r2")
    assert refusal(raw(fresh.agent, "POST", "agent-checkpoint/retire",
                       ctl("pm-r2", rollout_id="pm-r", attempt_index=1))) == "invalid_phase"
    assert answer(raw(fresh.agent, "POST", "agent-checkpoint/discard-restored-continuation",
                      ctl("pm-r2", rollout_id="pm-r", attempt_index=1))) == {"discarded": True}
    resume_everything(fresh, "pm-r2")
    for s in fresh.clients + g.clients:
        assert phase(s) == ("idle", None)
    pool.shutdown()


# -- §4 routes -----------------------------------------------------------------------------------------------------
def test_routes_table(fleet: Fleet, tmp_path: Path) -> None:
    """§4: every route answers 200 on its component's server with the reply the table gives, through a
    whole save (deployment A) and restore (deployment B). (404 elsewhere and 405: the transport test.)"""
    g = fleet.gym(model_slow_ms=50)
    folder = str(tmp_path / "gym")
    for rid in ("rt-done0", "rt-done1", "rt-done2"):
        assert rollout(g, rid).status_code == 202
    done = finish(g, "rt-done0", "rt-done1", "rt-done2")
    assert rollout(g, "rt-long", turns=40, tools=["notes", "sandbox"]).status_code == 202
    wait_until(lambda: any(r["turns_done"] >= 1 for r in g.agent.get("/rollouts") if r["rollout_id"] == "rt-long"),
               "rt-long's first turn")
    receipt = answer(raw(g.agent, "GET", "agent-checkpoint/completion-receipt",
                         params={"rollout_id": "rt-done0", "attempt_index": 0}))
    assert list(receipt) == RECEIPT_FIELDS
    assert answer(raw(g.agent, "POST", "agent-checkpoint/acknowledge", receipt)) == {"acknowledged": True,
                                                                                     "idempotent": False}
    r1 = done["rt-done1"]["completion_receipt"]
    assert answer(raw(g.agent, "POST", "agent-checkpoint/acknowledge-completed", {"schema_version": 1,
                                                                                  "executions": [r1]})) == {
        "acknowledged": [r1]}
    assert answer(raw(g.agent, "POST", "agent-checkpoint/retire", ctl("rt-0", rollout_id="rt-done2",
                                                                       attempt_index=0))) == {
        "retired": False, "tombstoned": False, "completed_unacknowledged": True}
    g.acknowledge([done["rt-done2"]])
    assert session(g.resource, "rt-spare", 0, "/sessions/reset", body={}).status_code == 200
    bound = sorted(g.resource.get("/sessions"))  # rt-long's and rt-spare's (finished rollouts end theirs)
    assert bound == ["rt-long.a0", "rt-spare.a0"]

    cid = "rt-1"
    pause = answer(raw(g.model, "POST", "model-admission/pause", ctl(cid)))
    assert set(pause) == MODEL_PAUSE and pause["workers"] == {"acknowledged": 1, "expected": 1}
    status = answer(raw(g.model, "GET", "model-admission/status",
                        params={**ctl(cid), "wait_state": "paused", "timeout_s": 10}))
    assert set(status) == MODEL_STATUS and status["checkpoint_id"] == cid and status["state"] == "paused"
    assert status["per_worker"] == {"0": {"state": "paused", "inflight": 0}}
    assert status["inflight"] == [] and status["tombstones"] == []
    aborted = answer(raw(g.model, "POST", "model-admission/abort_inflight", ctl(cid, rollout_id="rt-gone",
                                                                                 attempt_index=0)))
    assert set(aborted) == ABORT_INFLIGHT and aborted["aborted_inflight"] == 0
    status = answer(raw(g.model, "GET", "model-admission/status", params=ctl(cid)))
    assert status["tombstones"] == [{"rollout_id": "rt-gone", "attempt_index": 0}]
    prepared = answer(raw(g.agent, "POST", "agent-checkpoint/prepare", ctl(cid)))
    assert set(prepared) == AGENT_STATUS and prepared["state"] == "preparing" and prepared["ready_to_commit"]
    (ex,) = [e for e in prepared["executions"] if e["rollout_id"] == "rt-long"]
    assert list(ex) == EXECUTION and (ex["state"], ex["parked_boundary_state"]) == ("parked", "parked_with_boundary")
    (sb,) = prepared["selected_boundaries"]
    assert set(sb) == SELECTED_BOUNDARY and sb["resource_state_revisions"].keys() == {"tools", "sandbox"}
    status = answer(raw(g.agent, "GET", "agent-checkpoint/status", params={"checkpoint_id": cid}))
    assert set(status) == AGENT_STATUS | {"checkpoint_id"} and status["checkpoint_id"] == cid
    inventory = answer(raw(g.resource, "POST", "resources-checkpoint/prepare", ctl(cid)))
    assert set(inventory) == {"sessions", "state", "inventory"} and inventory["state"] == "prepared"
    assert all(set(e) == INVENTORY for e in inventory["inventory"]) and inventory["sessions"] == len(bound)
    status = answer(raw(g.resource, "GET", "resources-checkpoint/status", params=ctl(cid)))
    # Gym answers its admission state in `state` too (the phase is in capabilities).
    assert set(status) >= RESOURCES_STATUS and (status["state"], status["admission_state"]) == ("paused", "paused")
    assert status["prepared_inventory"] == inventory["inventory"]
    assert answer(raw(g.resource, "POST", "resources-checkpoint/retire", ctl(cid, rollout_id="rt-spare",
                                                                              attempt_index=0))) == {
        "retired": True, "rollout_id": "rt-spare", "attempt_index": 0}
    agent = answer(raw(g.agent, "POST", "agent-checkpoint/commit", ctl(cid, checkpoint_dir=folder)))
    assert set(agent) == {"records", "manifest_digest", "continuation_index"} and agent["records"] == 1
    assert list(agent["continuation_index"]) == ARTIFACT_REF
    model = answer(raw(g.model, "POST", "model-checkpoint/commit", ctl(
        cid, checkpoint_dir=folder, continuation_indexes=[agent["continuation_index"]])))
    assert set(model) == MODEL_COMMIT and list(model["storage_reference_index"]) == ARTIFACT_REF
    resources = answer(raw(g.resource, "POST", "resources-checkpoint/commit", ctl(cid, checkpoint_dir=folder)))
    assert set(resources) == {"sessions", "manifest_digest"} and resources["sessions"] == 1  # rt-spare retired
    assert answer(raw(g.resource, "POST", "resources-checkpoint/resume", ctl(cid))) == {"state": "accepting"}
    resume = answer(raw(g.model, "POST", "model-admission/resume", ctl(cid)))
    assert resume == {"state": "accepting", "workers": {"acknowledged": 1, "expected": 1}, "released_waiters": 0}
    assert answer(raw(g.agent, "POST", "agent-checkpoint/resume", ctl(cid))) == {"state": "accepting", "released": 1}
    assert answer(raw(g.agent, "POST", "agent-checkpoint/retire", ctl("rt-2", rollout_id="rt-nobody",
                                                                       attempt_index=0))) == {
        "retired": False, "tombstoned": True}
    assert answer(raw(g.agent, "POST", "agent-checkpoint/retire", ctl("rt-2", rollout_id="rt-long",
                                                                       attempt_index=0))) == {
        "retired": True, "tombstoned": True}

    b = fleet.gym()
    rid = "rt-restore"
    restored = answer(raw(b.model, "POST", "model-checkpoint/restore", ctl(rid, checkpoint_dir=folder)))
    assert set(restored) == MODEL_RESTORE and restored["checkpoint_id"] == cid
    assert restored["source_attempts"] == [{"rollout_id": "rt-long", "attempt_index": 0}]
    assert restored["tombstones"] == [{"rollout_id": "rt-gone", "attempt_index": 0}]
    assert restored["storage_reference_index"] == model["storage_reference_index"]
    back = answer(raw(b.agent, "POST", "agent-checkpoint/restore", ctl(rid, checkpoint_dir=folder)))
    assert back == {"records": 1, "source_checkpoint_id": cid, "continuation_index": agent["continuation_index"]}
    assert answer(raw(b.resource, "POST", "resources-checkpoint/restore", ctl(rid, checkpoint_dir=folder))) == {
        "sessions": 1, "source_checkpoint_id": cid}
    assert answer(raw(b.agent, "POST", "agent-checkpoint/discard-restored-continuation",
                      ctl(rid, rollout_id="rt-long", attempt_index=1))) == {"discarded": True}
    assert answer(raw(b.agent, "POST", "agent-checkpoint/discard-restored-continuation",
                      ctl(rid, rollout_id="rt-long", attempt_index=1))) == {"discarded": False}
    resume_everything(b, rid)
    # The restored session keeps its receipts under attempt + 1: a request id of attempt 0 replays
    # its recorded answer (here: rt-long's session reset, revision 1) and changes nothing.
    revision = b.resource.get("/sessions")["rt-long.a1"]["revision"]
    replay = session(b.resource, "rt-long", 1, "/sessions/reset", body={}, request_id="rt-long/reset/notes")
    assert replay.status_code == 200 and replay.headers[control.HEADER_RESOURCE_REVISION] == "1"
    assert replay.json() == {"rollout_id": "rt-long", "attempt_index": 0, "revision": 1}
    assert b.resource.get("/sessions")["rt-long.a1"]["revision"] == revision > 1
    for s in g.clients + b.clients:
        assert phase(s) == ("idle", None)


# -- §5 capabilities and the topology fingerprint ------------------------------------------------------------------
def reference_fingerprint(answers: dict[str, dict[str, Any]]) -> str:
    """§5's recipe, from raw capability answers by server name, written from the reference alone."""
    contracts = [{"participant": {"server_name": server_name, "component": c["component"], "participant_name": c["name"]},
                  "schema_version": c["schema_version"], "admission_states": sorted(c["admission_states"]),
                  "checkpoint_mode": c["checkpoint_mode"], "concurrency_contract": c["concurrency_contract"],
                  "multi_process": {"mode": c["multi_process"]["mode"],
                                    "num_workers": c["multi_process"]["num_workers"]},
                  "instance_role": c["instance_role"], "features": sorted(c["features"])}
                 for server_name, c in answers.items()]
    contracts.sort(key=lambda c: (c["participant"]["component"], c["participant"]["server_name"],
                                  c["participant"]["participant_name"]))
    doc = {"schema_version": 1, "participants": [{k: v for k, v in c.items() if k != "features"} for c in contracts]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def test_capabilities_table(gym: Gym, published: TakenSnapshot) -> None:
    """§5: each server's declaration field by field (keys as Gym's example, in its order), the live
    fence state, NeMo-RL's participant rules, and the topology fingerprint recomputed from the recipe."""
    example = json.loads(CAPABILITIES_EXAMPLE)
    stateless = control.Capabilities(component="resources_servers", name="resources",
                                     multi_process=control.MultiProcess(mode="single_worker"))
    assert msgspec.json.encode(stateless).decode() == CAPABILITIES_EXAMPLE  # the defaults are Gym's
    expected = {
        "policy0": ("responses_api_models", ["accepting", "draining", "paused"], "export_restore",
                    "transactional_parallel", "policy", {control.FEATURE_STORAGE_REFERENCE_INDEX}),
        "agent0": ("responses_api_agents", ["accepting"], "export_restore", "serialized_per_session", None,
                   {control.FEATURE_COMPLETED_RESULT_ACK, control.FEATURE_CONTINUATION_INDEX,
                    control.FEATURE_DISCARD_RESTORED, control.FEATURE_RESOURCE_DEPENDENCY_INDEX}),
        "tools": ("resources_servers", ["accepting"], "export_restore", "serialized_per_session", None, set()),
        "sandbox": ("resources_servers", ["accepting"], "restart_only", "serialized_per_session", None, set()),
    }
    answers: dict[str, dict[str, Any]] = {}
    for s in gym.clients:
        resp = s.request("GET", f"{P}/capabilities", token="")
        c = answer(resp)
        answers[c["name"]] = c
        assert list(c) == list(example) and list(c["multi_process"]) == ["mode", "num_workers"]
        msgspec.json.decode(resp.content, type=control.Capabilities)  # strict: NeMo-RL refuses any other key
        component, admission, mode, contract, role, features = expected[c["name"]]
        assert (c["component"], c["admission_states"], c["checkpoint_mode"], c["concurrency_contract"],
                c["instance_role"]) == (component, admission, mode, contract, role)
        assert c["schema_version"] == 1 and c["multi_process"] == {"mode": "single_worker", "num_workers": 1}
        assert features <= set(c["features"])
        assert (c["phase"], c["active_checkpoint_id"], c["deadline_ts"]) == ("idle", None, None)
    assert set(answers) == set(expected) == {p.name for p in gym.servers.all}  # server name = capability name

    hexdigest = reference_fingerprint(answers)
    assert len(hexdigest) == 64 and hexdigest == gym.fingerprint() == published.fingerprint
    assert open_snapshot(published.published.url).manifest.topology_fingerprint == f"sha256:{hexdigest}"
    no_features = {name: {**c, "features": []} for name, c in answers.items()}
    assert reference_fingerprint(no_features) == hexdigest  # features do not change it
    # ... nor does the live state: the agent prepared under an active id, with its deadline.
    deadline = time.time() + 30
    answer(raw(gym.agent, "POST", "agent-checkpoint/prepare", ctl("cap-live", deadline)))
    live = caps(gym.agent)
    assert (live["phase"], live["active_checkpoint_id"], live["deadline_ts"]) == ("prepared", "cap-live", deadline)
    assert reference_fingerprint({**answers, "agent0": live}) == hexdigest
    answer(raw(gym.agent, "POST", "agent-checkpoint/resume", ctl("cap-live")))

    # NeMo-RL's participant rules: this topology is accepted; one without its policy model is not.
    async def discover(servers: dict[str, str]) -> str:
        async with httpx.AsyncClient() as http:
            return (await GymFleet.connect(servers, gym.model.token, http).discover()).fingerprint

    assert asyncio.run(discover(gym.urls)) == hexdigest
    without_policy = {k: v for k, v in gym.urls.items() if k != "policy0"}
    with pytest.raises(Exception, match="no policy model"):
        asyncio.run(discover(without_policy))


# -- §6 files ----------------------------------------------------------------------------------------------------------
def jsonl_rows(data: bytes) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file, each checked to be compact JSON (no spaces) ending in a newline."""
    assert data.endswith(b"\n")
    rows = []
    for line in data.split(b"\n")[:-1]:
        row = json.loads(line)
        assert json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode() == line  # compact, as written
        rows.append(row)
    return rows


def check_ref(root: Path, ref: dict[str, Any], relative_path: str) -> bytes:
    """An artifact reference against the bytes of the file it names."""
    assert sorted(ref) == sorted(ARTIFACT_REF) and ref["schema_version"] == 1 and ref["relative_path"] == relative_path
    data = (root / relative_path).read_bytes()
    assert (ref["sha256"], ref["bytes"], ref["records"]) == (
        hashlib.sha256(data).hexdigest(), len(data), sum(1 for line in data.split(b"\n") if line.strip()))
    return data


def test_files_table(gym: Gym, published: TakenSnapshot) -> None:
    """§6: the layout of ``checkpoint_dir`` (each folder under its server's capability name), every
    serialization (manifests, JSON lines, archive members, session files), the digests and artifact
    references, and the ledger's rows judged by Gym's own ``TokenEntry``."""
    root = gym_dir(published)
    snap = open_snapshot(published.published.url)
    agent_dir = f"agent/instance-{hashlib.sha256(b'agent0').hexdigest()}"
    ledger, resources = "model-ledger/policy0", "resources/tools"
    assert sorted(str(p.parent.relative_to(root)) for p in root.rglob("manifest.json")) == sorted(
        [agent_dir, ledger, resources])  # the restart-only sandbox writes nothing
    payloads = {p.component: (p.name, p.part_prefix, p.payload) for p in snap.manifest.gym_commit.participants}
    assert [p.component for p in snap.manifest.gym_commit.participants] == [
        "responses_api_agents", "responses_api_models", "resources_servers"]  # commit order
    assert {c: (n, pre) for c, (n, pre, _) in payloads.items()} == {
        "responses_api_agents": ("agent0", f"gym/{agent_dir}"), "responses_api_models": ("policy0", f"gym/{ledger}"),
        "resources_servers": ("tools", f"gym/{resources}")}

    def manifest(folder: str, indent: int, fields: list[str]) -> dict[str, Any]:
        data = (root / folder / "manifest.json").read_bytes()
        doc = json.loads(data)
        assert data == json.dumps(doc, sort_keys=True, indent=indent).encode()
        assert sorted(doc) == sorted(fields) and doc["schema_version"] == 2 and doc["checkpoint_id"] == published.checkpoint_id
        component = {"agent": "responses_api_agents", "model-ledger": "responses_api_models",
                     "resources": "resources_servers"}[folder.split("/")[0]]
        assert payloads[component][2]["manifest_digest"] == hashlib.sha256(data).hexdigest()
        return doc

    # -- agent ----------------------------------------------------------------------------------------------
    am = manifest(agent_dir, 2, ["schema_version", "checkpoint_id", "instance_name", "archives", "record_index",
                                 "records", "continuation_index"])
    assert am["instance_name"] == "agent0"
    assert sorted(p.name for p in (root / agent_dir).iterdir()) == sorted(
        ["agent-part-000000.tar", "agent-index.jsonl", "continuations.jsonl", "manifest.json", "part-manifest.json"])
    (archive,) = am["archives"]
    tar_bytes = (root / agent_dir / "agent-part-000000.tar").read_bytes()
    assert archive == {"name": "agent-part-000000.tar", "sha256": hashlib.sha256(tar_bytes).hexdigest(),
                       "members": am["records"], "bytes": len(tar_bytes)}
    members: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
        for info in tf.getmembers():
            assert (info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname) == (0o600, 0, 0, 0, "", "")
            members[info.name] = tf.extractfile(info).read()  # type: ignore[union-attr]
    assert len(members) == am["records"] <= 512
    index = jsonl_rows(check_ref(root, am["record_index"], f"{agent_dir}/agent-index.jsonl"))
    records = {}
    for row in index:
        assert list(row) == ["rollout_id", "attempt_index", "archive", "member", "sha256", "bytes"]
        member = members[row["member"]]
        assert row["member"] == f"{row['rollout_id']}.a{row['attempt_index']}.json"
        assert (row["archive"], row["sha256"], row["bytes"]) == (
            "agent-part-000000.tar", hashlib.sha256(member).hexdigest(), len(member))
        record = json.loads(member)
        assert member == json.dumps(record, indent=2).encode()
        assert list(record) == ["schema_version", "rollout_id", "attempt_index", "boundary_index", "turn_index",
                                "boundary_kind", "pending_model", "output_items", "usage",
                                "last_committed_model_call_id", "resource_state_revisions", "agent_state",
                                "created_at"]
        records[(record["rollout_id"], record["attempt_index"])] = record
    assert {rid for rid, _ in records} == {s.rollout_id for s in LONG}  # every rollout parked mid-flight
    roots = jsonl_rows(check_ref(root, am["continuation_index"], f"{agent_dir}/continuations.jsonl"))
    assert am["continuation_index"] == payloads["responses_api_agents"][2]["continuation_index"]
    for root_row in roots:
        assert list(root_row) == ["schema_version", "rollout_id", "attempt_index", "capture_key",
                                  "last_committed_model_call_id", "resource_state_revisions"]
        rid, n = root_row["rollout_id"], root_row["attempt_index"]
        record = records[(rid, n)]
        assert root_row["capture_key"] == capture_key(rid, n)  # exactly the attempt's capture key
        assert root_row["last_committed_model_call_id"] == record["last_committed_model_call_id"] is not None
        assert root_row["resource_state_revisions"] == record["resource_state_revisions"]
        assert set(root_row["resource_state_revisions"]) == ({"tools", "sandbox"} if rid == "q3" else {"tools"})
    assert [(x["capture_key"], x["last_committed_model_call_id"]) for x in roots] == sorted(
        (x["capture_key"], x["last_committed_model_call_id"]) for x in roots)
    assert len(roots) == sum(1 for r in records.values() if r["last_committed_model_call_id"])
    # -- model ledger -----------------------------------------------------------------------------------------
    lm = manifest(ledger, 1, ["schema_version", "checkpoint_id", "server_name", "rollouts", "continuation_roots_sha256",
                              "continuation_roots", "excluded_inactive", "storage_reference_index", "tombstones",
                              "source_attempts"])
    assert lm["server_name"] == "policy0" and lm["continuation_roots"] == len(roots)
    assert lm["continuation_roots_sha256"] == hashlib.sha256(json.dumps(
        sorted(roots, key=lambda x: (x["capture_key"], x["last_committed_model_call_id"])),
        sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    attempt_key = operator.itemgetter("rollout_id", "attempt_index")
    assert lm["source_attempts"] == sorted(
        ({"rollout_id": x["rollout_id"], "attempt_index": x["attempt_index"]} for x in roots), key=attempt_key)
    # Tombstones: the model's (earlier tests' aborted attempts), sorted, none of them a root's.
    assert lm["tombstones"] == sorted(lm["tombstones"], key=attempt_key)
    assert not {attempt_key(t) for t in lm["tombstones"]} & {attempt_key(a) for a in lm["source_attempts"]}
    assert set(lm["rollouts"]) == {x["capture_key"] for x in roots}  # only rooted capture keys are copied
    last_call = {x["capture_key"]: x["last_committed_model_call_id"] for x in roots}
    for key, rollout_entry in lm["rollouts"].items():
        name = f"{key}.lineage.jsonl"
        data = (root / ledger / name).read_bytes()
        assert rollout_entry == {"files": {name: hashlib.sha256(data).hexdigest()},
                                 "rows": data.count(b"\n"), "bytes": len(data)}
        rows = jsonl_rows(data)
        assert [row["entry"]["model_call_id"] for row in rows] == [
            f"call-{i}" for i in range(int(last_call[key].removeprefix("call-")) + 1)]
        for row in rows:
            assert list(row) == ["entry", "token"] and row["entry"]["capture_key"] == key
            token = TokenEntry.model_validate(row["token"])  # Gym's own record type is the judge
            assert token.model_dump(mode="json") == row["token"]
            assert token.rollout_id == key and token.digest == compute_digest(cumulative_tokens(token))
    refs = jsonl_rows(check_ref(root, lm["storage_reference_index"], f"{ledger}/storage-references.jsonl"))
    assert lm["storage_reference_index"] == payloads["responses_api_models"][2]["storage_reference_index"]
    assert [r["key"] for r in refs] == sorted(r["key"] for r in refs)
    for ref in refs:
        assert list(ref) == ["schema_version", "capture_key", "boundary_model_call_id", "kind", "key"]
        assert ref["kind"] == "token_capture_staging" and last_call[ref["capture_key"]] == ref["boundary_model_call_id"]
    assert {r["capture_key"] for r in refs} == set(last_call)
    # -- resources ----------------------------------------------------------------------------------------------
    rm = manifest(resources, 2, ["schema_version", "checkpoint_id", "server_name", "files"])
    assert rm["server_name"] == "tools"
    assert sorted(p.name for p in (root / resources).iterdir()) == sorted(
        [*rm["files"], "manifest.json", "part-manifest.json"])
    for name, digest in rm["files"].items():
        data = (root / resources / name).read_bytes()
        doc = json.loads(data)
        assert digest == hashlib.sha256(data).hexdigest() and data == json.dumps(doc, indent=2).encode()
        assert name == f"{doc['rollout_id']}.a{doc['attempt_index']}.json"
        assert list(doc) == ["schema_version", "rollout_id", "attempt_index", "state_revision", "state",
                             "mutation_receipts", "created_at"]
        for receipt in doc["mutation_receipts"]:
            assert list(receipt) == ["request_id", "expected_revision", "input_digest", "status", "headers",
                                     "body_base64", "resulting_revision"]
    for rid, rev in ((x["rollout_id"], x["resource_state_revisions"]["tools"]) for x in roots):
        assert json.loads((root / resources / f"{rid}.a0.json").read_bytes())["state_revision"] == rev
    # -- each folder is one part of the snapshot; its part manifest lists every one of Gym's files --------------
    for folder in (agent_dir, ledger, resources):
        part = json.loads((root / folder / "part-manifest.json").read_bytes())
        files = sorted(p.name for p in (root / folder).iterdir() if p.name != "part-manifest.json")
        assert sorted(f["path"].rsplit("/", 1)[1] for f in part["files"]) == files
        for f in part["files"]:
            assert f["kind"] == "gym_file" and f["size"] == (root / folder / f["path"].rsplit("/", 1)[1]).stat().st_size


# -- §7 completion receipts ----------------------------------------------------------------------------------------
def test_receipts_table(gym: Gym) -> None:
    """§7: the receipt's fields, generation, digest and identity; where it comes from; the rules of
    acknowledging it (match or 409, all or nothing, repeats succeed, 422 for a malformed batch, a
    later /run is stale)."""
    a = gym.agent
    ids = ("rc-0", "rc-1", "rc-2")
    for rid in ids:
        assert rollout(gym, rid).status_code == 202
    results = finish(gym, *ids)
    receipts = {}
    for rid, res in results.items():
        receipt = answer(raw(a, "GET", "agent-checkpoint/completion-receipt",
                             params={"rollout_id": rid, "attempt_index": "0"}))  # a number string is fine
        assert list(receipt) == RECEIPT_FIELDS and receipt == res["completion_receipt"]
        result = {k: v for k, v in res.items() if k != "completion_receipt"}
        digest = hashlib.sha256(json.dumps(result, sort_keys=True, separators=(",", ":"),
                                           ensure_ascii=True).encode("utf-8")).hexdigest()
        assert (receipt["execution_generation"], receipt["result_digest"], receipt["result_identity"]) == (
            1, digest, str(result["id"]))
        receipts[rid] = receipt
    status = answer(raw(a, "GET", "agent-checkpoint/status", params={"checkpoint_id": "rc-st"}))
    listed = {e["rollout_id"]: e for e in status["completed_unacknowledged_attempts"]}
    for rid in ids:
        assert list(listed[rid]) == [*EXECUTION, "completion_receipt"] and listed[rid]["state"] == "completed"
        assert listed[rid]["completion_receipt"] == receipts[rid]
    assert not status["ready_to_commit"] and status["completed_unacknowledged"] >= 3
    # A receipt that does not match is refused, and one bad receipt refuses the whole batch.
    r0, r1, r2 = (receipts[rid] for rid in ids)
    for field, value in (("execution_generation", 2), ("result_identity", "other"), ("result_digest", "f" * 64),
                         ("attempt_index", 1), ("rollout_id", "rc-none")):
        bad = {**r0, field: value}
        assert refusal(raw(a, "POST", "agent-checkpoint/acknowledge", bad)) == \
            "completed_execution_acknowledgement_error"
        assert refusal(raw(a, "POST", "agent-checkpoint/acknowledge-completed", {"executions": [r1, bad]})) == \
            "completed_execution_acknowledgement_error"
    assert answer(raw(a, "GET", "agent-checkpoint/completion-receipt", params={"rollout_id": "rc-1",
                                                                                "attempt_index": 0})) == r1
    # Malformed batches are 422: duplicates, empty, an unknown field (in the batch or a receipt).
    for body in ({"executions": [r0, r0]}, {"executions": []}, {"executions": [r0], "extra": 1},
                 {"executions": [{**r0, "extra": 1}]}, {"schema_version": 2, "executions": [r0]},
                 {"executions": [{**r0, "result_digest": "F" * 64}]}, {"executions": [{**r0, "result_identity": ""}]},
                 {"executions": [{**r0, "execution_generation": 0}]}):
        assert raw(a, "POST", "agent-checkpoint/acknowledge-completed", body).status_code == 422, body
    assert raw(a, "POST", "agent-checkpoint/acknowledge", {**r0, "extra": 1}).status_code == 422
    # schema_version may be left out; the reply echoes the receipts; a repeat succeeds.
    assert answer(raw(a, "POST", "agent-checkpoint/acknowledge-completed", {"executions": [r0, r1]})) == {
        "acknowledged": [r0, r1]}
    assert answer(raw(a, "POST", "agent-checkpoint/acknowledge-completed", {"schema_version": 1,
                                                                            "executions": [r1, r0]})) == {
        "acknowledged": [r1, r0]}
    assert answer(raw(a, "POST", "agent-checkpoint/acknowledge", r2)) == {"acknowledged": True, "idempotent": False}
    again = answer(raw(a, "POST", "agent-checkpoint/acknowledge", r2))
    assert again == {"acknowledged": True, "idempotent": True}  # a repeat succeeds (CONTROL.md §7)
    # Acknowledged: released, and never run again.
    for rid in ids:
        assert refusal(raw(a, "GET", "agent-checkpoint/completion-receipt",
                           params={"rollout_id": rid, "attempt_index": 0})) == "completed_execution_acknowledgement_error"
        assert refusal(rollout(gym, rid)) == "stale_attempt"
    assert not set(ids) & set(gym.results())


# -- §9 examples ---------------------------------------------------------------------------------------------------
def test_examples(gym: Gym, fleet: Fleet, published: TakenSnapshot, forkserver: ForkServer, tmp_path: Path) -> None:
    """§9: each example request of the reference with its status and reply (shape, and every value
    that is not the test's own)."""
    # The capabilities of a stateless resources server: the example itself is what the struct's defaults
    # give (capabilities test); each server's answer has its keys in its order.
    assert list(caps(gym.sandbox)) == list(json.loads(CAPABILITIES_EXAMPLE))
    # Model pause, nothing in flight.
    resp = gym.model.request("POST", f"{P}/model-admission/pause", content=b'{"checkpoint_id":"ckpt-1","deadline_ts":4e9}')
    assert resp.status_code == 200 and resp.json() == {
        "state": "paused", "workers": {"acknowledged": 1, "expected": 1}, "inflight_total": 0, "waiters_total": 0}
    answer(raw(gym.model, "POST", "model-admission/resume", ctl("ckpt-1")))

    # The agent example (token "secret"): a prepare that times out while rollout-a runs, status, retire,
    # the conflict once checkpoint-1 is active, and a discard after a restore.
    secret = new_fleet(tmp_path / "secret", forkserver, token="secret")
    try:
        agent_example(secret.gym(model_slow_ms=1000))
    finally:
        secret.close()
    restored = fleet.gym()
    folder = str(gym_dir(published))
    for server, route in ((restored.model, "model-checkpoint/restore"), (restored.agent, "agent-checkpoint/restore"),
                          (restored.resource, "resources-checkpoint/restore")):
        answer(raw(server, "POST", route, ctl("restore-1", checkpoint_dir=folder)))
    resp = restored.agent.request("POST", f"{P}/agent-checkpoint/discard-restored-continuation", body={
        "checkpoint_id": "restore-1", "deadline_ts": time.time() + 2, "rollout_id": "rollout-a", "attempt_index": 1})
    assert resp.status_code == 200 and resp.json() == {"discarded": True}
    resume_everything(restored, "restore-1")

    # The continuation line and its reference: compact JSON and a newline, bound by its bytes.
    line = (b'{"schema_version":1,"rollout_id":"group-7_g0","attempt_index":0,"capture_key":"group-7_g0",'
            b'"last_committed_model_call_id":"call-1","resource_state_revisions":{"durable-tools":2}}')
    root = msgspec.json.decode(line, type=AgentContinuationRoot)
    assert msgspec.json.encode(root) == line  # what our writers write for it, byte for byte
    ref = {"schema_version": 1, "relative_path": "agent/instance-test/continuations.jsonl",
           "sha256": hashlib.sha256(line + b"\n").hexdigest(), "records": 1, "bytes": len(line) + 1}
    assert msgspec.to_builtins(msgspec.convert(ref, control.ArtifactRef)) == ref
    spaced = json.dumps(json.loads(line)).encode()  # as the design note prints it, with spaces
    assert hashlib.sha256(spaced + b"\n").hexdigest() != ref["sha256"]  # digests cover the exact bytes
    for s in gym.clients:
        assert phase(s) == ("idle", None)


def agent_example(e: Gym) -> None:
    """Gym's agent test, in its order, on a deployment whose token is ``secret``."""
    assert e.agent.token == "secret"
    assert rollout(e, "rollout-a", turns=2).status_code == 202
    turn_started(e, "rollout-a")  # its first model call takes a second
    headers = {"authorization": "Bearer secret"}
    resp = e.agent.request("POST", f"{P}/agent-checkpoint/prepare", token="", headers=headers, content=json.dumps(
        {"checkpoint_id": "checkpoint-1", "deadline_ts": time.time() + 0.01}).encode())
    assert refusal(resp) == "agent_prepare_incomplete"
    status = answer(e.agent.request("GET", f"{P}/agent-checkpoint/status", token="", headers=headers,
                                    params={"checkpoint_id": "checkpoint-1"}))
    (blocking,) = status["blocking_attempts"]
    assert list(blocking) == EXECUTION and isinstance(blocking.pop("age_seconds"), float)
    # Gym's test agent had recorded no boundary (nulls); ours records one before its first turn.
    assert blocking == {"rollout_id": "rollout-a", "attempt_index": 0, "generation": 1, "state": "running",
                        "parked_boundary_state": None, "boundary_index": 0, "turn_index": 0,
                        "boundary_kind": "turn_complete", "resource_state_revisions": {}}
    resp = e.agent.request("POST", f"{P}/agent-checkpoint/retire", token="", headers=headers, body={
        "checkpoint_id": "checkpoint-1", "deadline_ts": time.time() + 2, "rollout_id": "rollout-a",
        "attempt_index": 0})
    assert answer(resp) == {"retired": True, "tombstoned": True}
    # Run in this order the status for checkpoint-2 is 200: the timed-out prepare left no active id.
    assert answer(raw(e.agent, "GET", "agent-checkpoint/status", params={"checkpoint_id": "checkpoint-2"}))[
        "checkpoint_id"] == "checkpoint-2"
    answer(raw(e.agent, "POST", "agent-checkpoint/prepare", ctl("checkpoint-1")))  # nothing runs now: ready
    assert refusal(raw(e.agent, "GET", "agent-checkpoint/status", params={"checkpoint_id": "checkpoint-2"})) == \
        "checkpoint_conflict"
    resume_everything(e, "checkpoint-1")
