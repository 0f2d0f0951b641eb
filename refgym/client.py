"""A thin synchronous client of one reference Gym server: each control call is one method.

It does not coordinate anything (no ordering, no fan-out, no retries): whoever drives a snapshot
(a test, a coordinator) makes each call itself and looks at each answer. Methods return the raw
``httpx.Response`` so callers can check refusals; :func:`ok` decodes a success or raises.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx
import msgspec

from schemas.control import CONTROL_PREFIX, Capabilities
from schemas.manifest import PartReceipt


class CallFailed(RuntimeError):
    def __init__(self, resp: httpx.Response) -> None:
        super().__init__(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
        self.response = resp


def ok(resp: httpx.Response) -> Any:
    """The JSON body of a 2xx answer, else :class:`CallFailed` naming the call and the answer."""
    if not 200 <= resp.status_code < 300:
        raise CallFailed(resp)
    return resp.json()


class GymClient:
    """Calls to one server at ``url``; the bearer token goes only on ``/ng-control/v1`` routes."""

    def __init__(self, url: str, token: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self._caps: Capabilities | None = None

    def close(self) -> None:
        self.http.close()

    # -- control routes ------------------------------------------------------------------------
    def control(self, path: str, body: Any = None, *, token: str | None = None, content: bytes | None = None,
                method: str = "POST", params: dict[str, Any] | None = None) -> httpx.Response:
        """One control call; ``token=""`` sends none, ``content`` sends raw bytes as the body."""
        tok = self.token if token is None else token
        headers = {"content-type": "application/json"}
        if tok:
            headers["authorization"] = f"Bearer {tok}"
        data = content if content is not None else (None if body is None else msgspec.json.encode(body))
        return self.http.request(method, f"{CONTROL_PREFIX}{path}", content=data, headers=headers, params=params)

    def capabilities(self) -> Capabilities:
        resp = self.control("/capabilities", method="GET")
        if resp.status_code != 200:
            raise CallFailed(resp)
        self._caps = msgspec.json.decode(resp.content, type=Capabilities)
        return self._caps

    @property
    def caps(self) -> Capabilities:
        return self._caps or self.capabilities()

    @property
    def prefix(self) -> str:
        return f"gym/{self.caps.component}/{self.caps.name}"

    def status(self, checkpoint_id: str | None = None, wait_s: float = 0.0) -> dict[str, Any]:
        params = {"checkpoint_id": checkpoint_id, "wait_s": wait_s} if checkpoint_id else None
        return ok(self.control("/status", method="GET", params=params))

    def prepare(self, checkpoint_id: str, deadline: float) -> httpx.Response:
        """Prepare (for a model server: pause admission, the same step under its own name)."""
        path = "/admission/pause" if self.caps.component == "model" else "/prepare"
        return self.control(path, {"checkpoint_id": checkpoint_id, "deadline": deadline})

    def commit(self, checkpoint_id: str, deadline: float, draft_url: str,
               continuations: Iterable[PartReceipt] = ()) -> httpx.Response:
        return self.control("/commit", {"checkpoint_id": checkpoint_id, "deadline": deadline, "draft_url": draft_url,
                                        "part_prefix": self.prefix, "continuations": list(continuations)})

    def restore(self, checkpoint_id: str, deadline: float, snapshot_url: str, saved_checkpoint_id: str,
                topology_fingerprint: str) -> httpx.Response:
        return self.control("/restore", {"checkpoint_id": checkpoint_id, "deadline": deadline,
                                         "snapshot_url": snapshot_url, "saved_checkpoint_id": saved_checkpoint_id,
                                         "part_prefix": self.prefix, "topology_fingerprint": topology_fingerprint})

    def resume(self, checkpoint_id: str) -> httpx.Response:
        return self.control("/resume", {"checkpoint_id": checkpoint_id, "deadline": time.time() + 60})

    def abort(self, checkpoint_id: str) -> httpx.Response:
        return self.control("/abort", {"checkpoint_id": checkpoint_id, "deadline": time.time() + 60})

    def acknowledge(self, refs: Iterable[tuple[str, int]]) -> httpx.Response:
        return self.control("/agent/acknowledge", {"results": [{"rollout_id": r, "attempt_index": a} for r, a in refs]})

    def discard(self, checkpoint_id: str, deadline: float, refs: Iterable[tuple[str, int]]) -> httpx.Response:
        return self.control("/agent/discard", {"checkpoint_id": checkpoint_id, "deadline": deadline,
                                               "rollouts": [{"rollout_id": r, "attempt_index": a} for r, a in refs]})

    # -- plain routes --------------------------------------------------------------------------
    def get(self, path: str) -> Any:
        return ok(self.http.get(path))

    def post(self, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
        data = content if content is not None else msgspec.json.encode(body)
        return self.http.post(path, content=data, headers={"content-type": "application/json"})

    def start_rollout(self, rollout_id: str, seed: int, turns: int,
                      tools: list[str] | tuple[str, ...] = ("notes",)) -> Any:
        body = {"rollout_id": rollout_id, "seed": seed, "turns": turns, "tools": list(tools)}
        return ok(self.post("/rollouts", body))
