"""The NemoGym actor: the one caller of every Gym server, over HTTP, in the protocol's orders.

The Single Controller never talks to Gym itself; it calls this actor (a Ray actor: see
:func:`remote`), which fans each step out to every server of a component in parallel and moves to
the next component only when all have answered (SPEC §20.8):

- prepare: models (``/admission/pause``), then agents, then resources;
- commit: agents, then models (given every agent's continuation receipt), then resources;
- resume and abort: resources, then models, then agents (what agents call opens first);
- restore: models, then agents, then resources (all stay paused until resume).

Every control call carries the checkpoint id and an absolute deadline; the HTTP timeout of a call
is the time left before that deadline (plus :data:`GRACE_S`), so a server that hangs is given up on
at the deadline, not later. Rollouts go to the agent server chosen by a stable hash of their id
over the agents sorted by name: the same agent before and after a restore.

This module imports neither Ray nor the controller: :func:`remote` wraps the class for Ray.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpx
import msgspec

from coordinator.errors import GymCallError
from schemas.control import CONTROL_PREFIX, Capabilities, CommitResponse
from schemas.manifest import GymCommit, ParticipantCommit, PartReceipt
from schemas.topology import topology_fingerprint

log = logging.getLogger("coordinator.gym")

GRACE_S = 5.0  # on top of the time left before a deadline: the server's own answer may take a moment
CALL_TIMEOUT_S = 30.0  # plain calls (rollouts, results, acknowledgements)
MAX_PARALLEL_STARTS = 16
KEEPALIVE_EXPIRY_S = 2.0  # below any server's keep-alive (uvicorn's default is 5 s)
#: A request on a pooled connection that the server closed as it was sent fails like this. Only
#: idempotent calls are sent once more: for a control call the drop fails the step.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
PREPARE_ORDER = ("model", "agent", "resource")
COMMIT_ORDER = ("agent", "model", "resource")
RESUME_ORDER = ("resource", "model", "agent")
RESTORE_ORDER = ("model", "agent", "resource")


class Server(msgspec.Struct, frozen=True):
    url: str
    caps: Capabilities

    @property
    def prefix(self) -> str:
        return f"gym/{self.caps.component}/{self.caps.name}"

    @property
    def label(self) -> str:
        return f"{self.caps.component} {self.caps.name} ({self.url})"


class CommitResult(msgspec.Struct, frozen=True):
    """What Gym's commit gives the publisher: the manifest's ``gym_commit`` and every part receipt."""

    gym_commit: GymCommit
    receipts: list[PartReceipt]
    seconds: dict[str, float]


class NemoGym:
    """Calls to a set of Gym servers (``urls``), each authenticated with the control ``token``."""

    def __init__(self, urls: Sequence[str], token: str) -> None:
        if not urls:
            raise ValueError("NemoGym needs at least one Gym server")
        self._urls = [u.rstrip("/") for u in urls]
        self._token = token
        self._http: httpx.AsyncClient | None = None
        self._servers: list[Server] = []

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=CALL_TIMEOUT_S, limits=httpx.Limits(
                max_connections=32, keepalive_expiry=KEEPALIVE_EXPIRY_S))
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- discovery ---------------------------------------------------------------------------
    async def discover_checkpoint_capabilities(self) -> dict[str, Any]:
        """Every server's capabilities and the running topology fingerprint (SPEC §20.2)."""
        caps = await asyncio.gather(*(self._capabilities(u) for u in self._urls))
        servers = [Server(u, c) for u, c in zip(self._urls, caps)]
        names = [(s.caps.component, s.caps.name) for s in servers]
        if len(set(names)) != len(names):
            raise GymCallError(f"two Gym servers share a component and name: {sorted(names)}")
        self._servers = sorted(servers, key=lambda s: (s.caps.component, s.caps.name))
        return {"participants": [msgspec.to_builtins(s.caps) for s in self._servers],
                "fingerprint": topology_fingerprint([s.caps.contract() for s in self._servers])}

    async def _capabilities(self, url: str) -> Capabilities:
        resp = await self._send("GET", url, f"{CONTROL_PREFIX}/capabilities", None, CALL_TIMEOUT_S, url,
                                idempotent=True)
        try:
            return msgspec.json.decode(resp.content, type=Capabilities)
        except msgspec.ValidationError as exc:
            raise GymCallError(f"capabilities of {url}: {exc}") from None

    def _of(self, component: str) -> list[Server]:
        if not self._servers:
            raise GymCallError("discover_checkpoint_capabilities must be called first")
        return [s for s in self._servers if s.caps.component == component]

    @property
    def agents(self) -> list[Server]:
        return self._of("agent")

    # -- the checkpoint steps ----------------------------------------------------------------
    async def prepare_checkpoint(self, checkpoint_id: str, deadline: float) -> dict[str, float]:
        """Pause models, park agents at turn ends, freeze resources; returns seconds per component."""
        body = {"checkpoint_id": checkpoint_id, "deadline": deadline}

        def path(s: Server) -> str:
            return "/admission/pause" if s.caps.component == "model" else "/prepare"

        return await self._in_order(PREPARE_ORDER, lambda s: self._control(s, "prepare", path(s), body, deadline))

    async def commit_checkpoint(self, checkpoint_id: str, deadline: float, draft_url: str) -> CommitResult:
        """Each server writes its part into the draft at ``draft_url``: agents, then models, then resources."""
        answers: dict[tuple[str, str], CommitResponse] = {}
        seconds: dict[str, float] = {}
        for component in COMMIT_ORDER:
            t0 = time.perf_counter()
            continuations = [a.part for (c, _), a in answers.items() if c == "agent" and a.part is not None]

            async def one(s: Server) -> None:
                body = {"checkpoint_id": checkpoint_id, "deadline": deadline, "draft_url": draft_url,
                        "part_prefix": s.prefix,
                        "continuations": msgspec.to_builtins(continuations) if component == "model" else []}
                resp = await self._control(s, "commit", "/commit", body, deadline)
                try:
                    answers[(component, s.caps.name)] = msgspec.json.decode(resp.content, type=CommitResponse)
                except msgspec.ValidationError as exc:
                    raise GymCallError(f"commit of {s.label}: bad answer: {exc}", component=component,
                                       name=s.caps.name) from None

            await asyncio.gather(*(one(s) for s in self._of(component)))
            seconds[component] = time.perf_counter() - t0
        parts = []
        receipts = []
        for component in COMMIT_ORDER:
            for s in self._of(component):
                a = answers[(component, s.caps.name)]
                if a.part is not None:
                    if a.part.prefix != s.prefix:
                        raise GymCallError(f"commit of {s.label}: wrote part {a.part.prefix!r}, asked for {s.prefix!r}",
                                           component=component, name=s.caps.name)
                    receipts.append(a.part)
                parts.append(ParticipantCommit(
                    component=component, name=s.caps.name, part_prefix=a.part.prefix if a.part else None,
                    part_manifest_checksum=a.part.part_manifest_checksum if a.part else None, payload=a.payload))
        return CommitResult(GymCommit(checkpoint_id=checkpoint_id, participants=parts), receipts, seconds)

    async def resume_checkpoint(self, checkpoint_id: str) -> dict[str, float]:
        """Resume (resources, then models, then agents). Repeats are answered the same by each server."""
        body = {"checkpoint_id": checkpoint_id, "deadline": time.time() + CALL_TIMEOUT_S}
        return await self._in_order(RESUME_ORDER, lambda s: self._control(s, "resume", "/resume", body,
                                                                           body["deadline"]))

    async def abort_checkpoint(self, checkpoint_id: str) -> list[str]:
        """Abort on every server, in the resume order, whatever each answers: a server that never began
        the checkpoint answers 409 ``wrong_phase`` (fine). Returns the failures, for the log."""
        body = {"checkpoint_id": checkpoint_id, "deadline": time.time() + CALL_TIMEOUT_S}
        failures: list[str] = []
        for component in RESUME_ORDER:
            async def one(s: Server) -> None:
                try:
                    await self._control(s, "abort", "/abort", body, body["deadline"])
                except GymCallError as exc:
                    if exc.error not in ("wrong_phase", "stale_checkpoint"):
                        failures.append(str(exc))
            await asyncio.gather(*(one(s) for s in self._of(component)))
        return failures

    async def restore_checkpoint(self, restore_id: str, deadline: float, snapshot_url: str, saved_checkpoint_id: str,
                                 fingerprint: str) -> dict[str, Any]:
        """Every server loads its part of the snapshot and stays paused. Returns the agents' answers
        merged: ``continuations`` (run n + 1 of each unfinished rollout) and ``finished_unacked``."""
        merged: dict[str, Any] = {"continuations": [], "finished_unacked": []}

        async def one(s: Server) -> None:
            body = {"checkpoint_id": restore_id, "deadline": deadline, "snapshot_url": snapshot_url,
                    "saved_checkpoint_id": saved_checkpoint_id, "part_prefix": s.prefix,
                    "topology_fingerprint": fingerprint}
            resp = await self._control(s, "restore", "/restore", body, deadline)
            if s.caps.component == "agent":
                payload = resp.json().get("payload", {})
                merged["continuations"] += payload.get("continuations", [])
                merged["finished_unacked"] += payload.get("finished_unacked", [])

        await self._in_order(RESTORE_ORDER, one)
        return merged

    async def discard(self, restore_id: str, deadline: float, refs: Sequence[tuple[str, int]]) -> list[str]:
        """Restored continuations that used a restart-only resource start over (on their own agent)."""
        out: list[str] = []
        for agent, mine in self._by_agent(refs):
            body = {"checkpoint_id": restore_id, "deadline": deadline,
                    "rollouts": [{"rollout_id": r, "attempt_index": a} for r, a in mine]}
            resp = await self._control(agent, "discard", "/agent/discard", body, deadline)
            out += resp.json().get("discarded", [])
        return out

    # -- rollouts ----------------------------------------------------------------------------
    def agent_of(self, rollout_id: str) -> Server:
        agents = self.agents
        if not agents:
            raise GymCallError("no agent server")
        h = int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "little")
        return agents[h % len(agents)]

    def _by_agent(self, refs: Iterable[tuple[str, Any]]) -> list[tuple[Server, list[tuple[str, Any]]]]:
        """``refs`` grouped by the agent that holds each rollout."""
        out: dict[str, tuple[Server, list[tuple[str, Any]]]] = {}
        for ref in refs:
            agent = self.agent_of(ref[0])
            out.setdefault(agent.url, (agent, []))[1].append(tuple(ref))
        return list(out.values())

    async def start_rollouts(self, specs: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
        """Send rollouts to their agents. ``accepted`` (202, or 409: the agent already has it),
        ``paused`` (503: try again later); anything else raises."""
        out: dict[str, list[str]] = {"accepted": [], "paused": []}
        sem = asyncio.Semaphore(MAX_PARALLEL_STARTS)

        async def one(spec: dict[str, Any]) -> None:
            s = self.agent_of(spec["rollout_id"])
            body = {k: spec[k] for k in ("rollout_id", "seed", "turns", "tools")}
            async with sem:
                resp = await self._send("POST", s.url, "/rollouts", body, CALL_TIMEOUT_S, s.label, check=False,
                                        idempotent=True)  # a second start of the same rollout is a 409
            if resp.status_code in (202, 409):
                out["accepted"].append(spec["rollout_id"])
            elif resp.status_code == 503:
                out["paused"].append(spec["rollout_id"])
            else:
                raise GymCallError(f"starting {spec['rollout_id']} on {s.label}: {resp.status_code} {resp.text[:300]}",
                                   component="agent", name=s.caps.name, status=resp.status_code)

        await asyncio.gather(*(one(sp) for sp in specs))
        return out

    async def results(self) -> list[Any]:
        """Every finished (or failed) result the agents hold, not yet acknowledged."""
        lists = await asyncio.gather(*(self._send("GET", s.url, "/results", None, CALL_TIMEOUT_S, s.label,
                                                  idempotent=True)
                                       for s in self.agents))
        return [r for resp in lists for r in resp.json()]

    async def acknowledge(self, refs: Sequence[tuple[str, int]]) -> dict[str, list[str]]:
        """Acknowledge finished results. An agent that no longer holds one answers 404
        ``unknown_rollout``: it was acknowledged before (SPEC §20.4); such refs come back in
        ``unknown``, one call each, so one of them cannot hold up the others."""
        out: dict[str, list[str]] = {"acknowledged": [], "unknown": []}

        async def call(s: Server, mine: list[tuple[str, int]]) -> bool:
            body = {"results": [{"rollout_id": r, "attempt_index": a} for r, a in mine]}
            try:
                await self._control(s, "acknowledge", "/agent/acknowledge", body, time.time() + CALL_TIMEOUT_S)
            except GymCallError as exc:
                if exc.error == "unknown_rollout":
                    return False
                raise
            return True

        async def per_agent(s: Server, mine: list[tuple[str, int]]) -> None:
            if await call(s, mine):
                out["acknowledged"] += [r for r, _ in mine]
                return
            for ref in mine:  # all-or-nothing refused: find which ones it no longer holds
                (out["acknowledged"] if await call(s, [ref]) else out["unknown"]).append(ref[0])

        await asyncio.gather(*(per_agent(s, mine) for s, mine in self._by_agent(refs)))
        return out

    async def health(self) -> dict[str, bool]:
        async def one(url: str) -> bool:
            try:
                return (await self.http.get(f"{url}/healthz", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False
        states = await asyncio.gather(*(one(u) for u in self._urls))
        return dict(zip(self._urls, states))

    # -- HTTP --------------------------------------------------------------------------------
    async def _in_order(self, order: Sequence[str], call: Callable[[Server], Awaitable[Any]]) -> dict[str, float]:
        seconds = {}
        for component in order:
            t0 = time.perf_counter()
            await asyncio.gather(*(call(s) for s in self._of(component)))
            seconds[component] = time.perf_counter() - t0
        return seconds

    async def _control(self, s: Server, step: str, path: str, body: Any, deadline: float) -> httpx.Response:
        timeout = max(0.5, deadline - time.time()) + GRACE_S
        return await self._send("POST", s.url, f"{CONTROL_PREFIX}{path}", body, timeout, s.label, step=step,
                                component=s.caps.component, name=s.caps.name)

    async def _send(self, method: str, url: str, path: str, body: Any, timeout: float, label: str, *,
                    step: str = "", component: str = "", name: str = "", check: bool = True,
                    idempotent: bool = False) -> httpx.Response:
        """One call. ``idempotent`` calls are sent a second time if the connection drops under the
        first (:data:`DROPPED`); control calls are not: a drop there fails the step."""
        what = f"{step or method + ' ' + path} of {label}"
        headers = {"content-type": "application/json"}
        if path.startswith(CONTROL_PREFIX):
            headers["authorization"] = f"Bearer {self._token}"
        content = None if body is None else msgspec.json.encode(body)
        try:
            try:
                resp = await self.http.request(method, f"{url}{path}", headers=headers, timeout=timeout,
                                               content=content)
            except DROPPED as exc:
                if not idempotent:
                    raise
                log.info("%s: connection dropped (%s), sending it once more", what, type(exc).__name__)
                resp = await self.http.request(method, f"{url}{path}", headers=headers, timeout=timeout,
                                               content=content)
        except httpx.TimeoutException:
            raise GymCallError(f"{what}: no answer within {timeout:.1f}s (deadline passed)", component=component,
                               name=name, error="timeout") from None
        except httpx.TransportError as exc:
            raise GymCallError(f"{what}: unreachable ({type(exc).__name__}: {exc})", component=component, name=name,
                               error="unreachable") from None
        if check and not 200 <= resp.status_code < 300:
            try:
                error = resp.json().get("error")
            except ValueError:
                error = None
            raise GymCallError(f"{what}: {resp.status_code} {resp.text[:500]}", component=component, name=name,
                               status=resp.status_code, error=error)
        return resp


def remote(urls: Sequence[str], token: str, **options: Any) -> Any:
    """The NemoGym actor on Ray (no CPU reserved: it waits on HTTP). Needs ``ray`` initialised."""
    import ray

    return ray.remote(NemoGym).options(num_cpus=0, **options).remote(list(urls), token)
