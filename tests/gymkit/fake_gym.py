"""A scriptable fake Gym server for the client and fleet tests: it serves the per-component routes
(CONTROL.md §4) at their exact paths and methods, records every request it receives (method, path,
query, headers, body, time), and answers each with a well-formed default reply, or with what a
test queued for that route (a status and body, after an optional delay).

It checks nothing of the protocol itself (no fence, no phases): the reference servers do that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response

from schemas.control import CONTROL_PREFIX
from schemas.gym_files import agent_instance_dir, ledger_dir, resources_dir

MODELS, AGENTS, RESOURCES = "responses_api_models", "responses_api_agents", "resources_servers"

#: route (below CONTROL_PREFIX) -> (method, component family; None: every server)
ROUTES: dict[str, tuple[str, str | None]] = {
    "capabilities": ("GET", None),
    "model-admission/pause": ("POST", MODELS), "model-admission/status": ("GET", MODELS),
    "model-admission/resume": ("POST", MODELS), "model-admission/abort_inflight": ("POST", MODELS),
    "model-checkpoint/commit": ("POST", MODELS), "model-checkpoint/restore": ("POST", MODELS),
    "agent-checkpoint/acknowledge": ("POST", AGENTS), "agent-checkpoint/acknowledge-completed": ("POST", AGENTS),
    "agent-checkpoint/completion-receipt": ("GET", AGENTS), "agent-checkpoint/prepare": ("POST", AGENTS),
    "agent-checkpoint/status": ("GET", AGENTS), "agent-checkpoint/commit": ("POST", AGENTS),
    "agent-checkpoint/restore": ("POST", AGENTS), "agent-checkpoint/resume": ("POST", AGENTS),
    "agent-checkpoint/retire": ("POST", AGENTS), "agent-checkpoint/discard-restored-continuation": ("POST", AGENTS),
    "resources-checkpoint/prepare": ("POST", RESOURCES), "resources-checkpoint/status": ("GET", RESOURCES),
    "resources-checkpoint/commit": ("POST", RESOURCES), "resources-checkpoint/restore": ("POST", RESOURCES),
    "resources-checkpoint/resume": ("POST", RESOURCES), "resources-checkpoint/retire": ("POST", RESOURCES),
}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def ref(path: str, records: int = 1) -> dict[str, Any]:
    return {"schema_version": 1, "relative_path": path, "sha256": sha(path), "records": records, "bytes": 10 * records}


def refusal(code: str, detail: str = "refused", status: int = 409) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"code": code, "detail": detail}}


AGENT_STATUS = {"state": "preparing", "ready_to_commit": True, "running": 0, "parked": 0, "parked_with_boundary": 0,
                "parked_without_boundary": 0, "completed_unacknowledged": 0, "acknowledged_completed": 0, "active": 0,
                "blocking_attempts": [], "completed_unacknowledged_attempts": [], "executions": [],
                "selected_boundaries": []}
WORKERS = {"acknowledged": 1, "expected": 1}


@dataclass
class Seen:
    """One request as the server received it."""

    server: str
    route: str
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    at: float
    answered: bool = False  # set once its answer is ready to send (after any queued delay)

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeGym:
    """One Gym server; ``log`` may be shared between servers to see the order of calls across them."""

    component: str
    name: str
    checkpoint_mode: str = "export_restore"
    instance_role: str | None = None
    features: list[str] = field(default_factory=list)
    admission_states: list[str] = field(default_factory=lambda: ["accepting", "draining", "paused"])
    multi_process: dict[str, Any] = field(default_factory=lambda: {"mode": "single_worker", "num_workers": 1})
    concurrency_contract: str = "stateless"
    restored_from: str = "ckpt-saved"  # the source checkpoint id a restore reports
    all_routes: bool = False  # serve every family (the client test's one server)
    log: list[Seen] = field(default_factory=list)
    script: dict[str, list[Any]] = field(default_factory=dict)  # route -> queued answers

    def __post_init__(self) -> None:
        self.app = self._app()

    def capabilities(self) -> dict[str, Any]:
        return {"component": self.component, "name": self.name, "schema_version": 1,
                "admission_states": self.admission_states, "checkpoint_mode": self.checkpoint_mode,
                "concurrency_contract": self.concurrency_contract, "multi_process": self.multi_process,
                "instance_role": self.instance_role, "features": self.features, "phase": "idle",
                "active_checkpoint_id": None, "deadline_ts": None}

    def queue(self, route: str, *answers: Any) -> None:
        """Answer the next calls of ``route`` with ``answers``: ``(status, body)``, ``(status, body,
        delay_s)``, or a callable of the request's JSON (body or query) giving one of those."""
        self.script.setdefault(route, []).extend(answers)

    def calls(self, route: str | None = None) -> list[Seen]:
        return [s for s in self.log if s.server == self.name and (route is None or s.route == route)]

    # -- the app ---------------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI()
        for route, (method, family) in ROUTES.items():
            if family is None or family == self.component or self.all_routes:
                app.add_api_route(f"{CONTROL_PREFIX}/{route}", self._handler(route), methods=[method])
        return app

    def _handler(self, route: str) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            body = await request.body()
            seen = Seen(server=self.name, route=route, method=request.method, path=request.url.path,
                        query=dict(request.query_params), headers={k.lower(): v for k, v in request.headers.items()},
                        body=body, at=time.time())
            self.log.append(seen)
            try:
                payload = seen.query if request.method == "GET" else (json.loads(body) if body else None)
            except ValueError:
                return Response(json.dumps({"detail": [{"type": "json_invalid", "loc": ["body"],
                                                        "msg": "JSON decode error"}]}), status_code=422,
                                media_type="application/json")
            queued = self.script.get(route)
            answer = queued.pop(0) if queued else (200, self.default(route, payload))
            if callable(answer):
                answer = answer(payload)
            status, reply, *delay = answer
            if delay:
                await asyncio.sleep(delay[0])
            seen.answered = True
            return Response(json.dumps(reply) if not isinstance(reply, bytes) else reply, status_code=status,
                            media_type="application/json")

        return handle

    def default(self, route: str, p: Any) -> Any:
        """A well-formed reply of ``route`` to the request ``p`` (its JSON body, or its query)."""
        name = self.name
        agent_ref = ref(f"{agent_instance_dir(name)}/continuations.jsonl")
        model_ref = ref(f"{ledger_dir(name)}/storage-references.jsonl")
        return {
            "capabilities": lambda: self.capabilities(),
            "model-admission/pause": lambda: {"state": "paused", "workers": WORKERS, "inflight_total": 0,
                                              "waiters_total": 0},
            "model-admission/status": lambda: {"checkpoint_id": p["checkpoint_id"], "state": "paused",
                                               "per_worker": {"0": {"state": "paused", "inflight": 0}},
                                               "inflight_total": 0, "waiters_total": 0, "inflight": [],
                                               "tombstones": []},
            "model-admission/resume": lambda: {"state": "accepting", "workers": WORKERS, "released_waiters": 0},
            "model-admission/abort_inflight": lambda: {"state": "paused", "aborted_inflight": 1, "inflight_total": 0},
            "model-checkpoint/commit": lambda: {"rollouts": len(p["continuation_indexes"]), "rows": 0,
                                                "excluded_tombstoned": 0, "excluded_inactive": 0,
                                                "manifest_digest": sha(f"model {name}"),
                                                "storage_reference_index": model_ref},
            "model-checkpoint/restore": lambda: {"rollouts": 0, "rows": 0, "checkpoint_id": self.restored_from,
                                                 "tombstones": [], "source_attempts": [],
                                                 "storage_reference_index": model_ref},
            "agent-checkpoint/acknowledge": lambda: {"acknowledged": True, "idempotent": False},
            "agent-checkpoint/acknowledge-completed": lambda: {"acknowledged": p["executions"]},
            "agent-checkpoint/completion-receipt": lambda: {
                "rollout_id": p["rollout_id"], "attempt_index": int(p["attempt_index"]), "execution_generation": 1,
                "result_identity": f"res-{p['rollout_id']}", "result_digest": sha(p["rollout_id"])},
            "agent-checkpoint/prepare": lambda: AGENT_STATUS,
            "agent-checkpoint/status": lambda: {**AGENT_STATUS, "checkpoint_id": p["checkpoint_id"]},
            "agent-checkpoint/commit": lambda: {"records": 1, "manifest_digest": sha(f"agent {name}"),
                                                "continuation_index": agent_ref},
            "agent-checkpoint/restore": lambda: {"records": 1, "source_checkpoint_id": self.restored_from,
                                                 "continuation_index": agent_ref},
            "agent-checkpoint/resume": lambda: {"state": "accepting", "released": 0},
            "agent-checkpoint/retire": lambda: {"retired": True, "tombstoned": True},
            "agent-checkpoint/discard-restored-continuation": lambda: {"discarded": p["attempt_index"] % 2 == 1},
            "resources-checkpoint/prepare": lambda: {"sessions": 0, "state": "prepared", "inventory": []},
            "resources-checkpoint/status": lambda: {"checkpoint_id": p["checkpoint_id"], "state": "paused",
                                                    "admission_state": "paused", "sessions": 0, "per_session": [],
                                                    "prepared_inventory": []},
            "resources-checkpoint/commit": lambda: {"sessions": 0, "manifest_digest": sha(f"resources {name}")},
            "resources-checkpoint/restore": lambda: {"sessions": 0, "source_checkpoint_id": self.restored_from},
            "resources-checkpoint/resume": lambda: {"state": "accepting"},
            "resources-checkpoint/retire": lambda: {"retired": True, "rollout_id": p["rollout_id"],
                                                    "attempt_index": p["attempt_index"]},
        }[route]()


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """``app`` on uvicorn at 127.0.0.1 (a free port), in a thread; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > 10:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# Names the tests use for the files a participant's commit reports.
__all__ = ["AGENTS", "MODELS", "RESOURCES", "FakeGym", "Seen", "agent_instance_dir", "ledger_dir", "refusal",
           "resources_dir", "serve", "sha"]
