"""The NemoGym actor: the one caller of every Gym server, over HTTP, in the protocol's orders.

The Single Controller never talks to Gym itself; it calls this actor (a Ray actor: see
:func:`remote`). Every control call goes through ``gymkit``'s client: a :class:`gymkit.GymFleet`
fans each step out to every server of a component in parallel and moves to the next component
only when all have answered (CONTROL.md §8):

- prepare: models (``/admission/pause``), then agents, then resources;
- commit: agents, then models (given every agent's continuation receipt), then resources;
- resume and abort: resources, then models, then agents (what agents call opens first);
- restore: models, then agents, then resources (all stay paused until resume).

Every control call carries the checkpoint id and an absolute deadline; the HTTP timeout of a call
is the time left before that deadline (plus ``gymkit.control_client.GRACE_S``), so a server that
hangs is given up on at the deadline, not later. Rollouts go to the agent server chosen by a
stable hash of their id over the agents sorted by name: the same agent before and after a
restore. Whatever fails reaches the controller as a :class:`~coordinator.errors.GymCallError`.

This module imports neither Ray nor the controller: :func:`remote` wraps the class for Ray.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import httpx
import msgspec

from coordinator.errors import GymCallError
from gymkit.control_client import AsyncControlClient, CommitResult, ControlCallError, GymFleet

log = logging.getLogger("coordinator.gym")

__all__ = ["CommitResult", "NemoGym", "remote"]

CALL_TIMEOUT_S = 30.0  # calls without a deadline of their own (capabilities, rollouts, results, acknowledgements)
MAX_PARALLEL_STARTS = 16
KEEPALIVE_EXPIRY_S = 2.0  # below any server's keep-alive (uvicorn's default is 5 s)


def _as_gym_call_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """The actor's errors are the coordinator's: a failed call is a :class:`GymCallError` with the
    same message, server, status and error code."""

    @functools.wraps(method)
    async def wrapper(*args: Any, **kw: Any) -> Any:
        try:
            return await method(*args, **kw)
        except ControlCallError as exc:
            raise GymCallError(str(exc), component=exc.component, name=exc.name, status=exc.status,
                               error=exc.error) from None

    return wrapper


class NemoGym:
    """Calls to a set of Gym servers (``urls``), each authenticated with the control ``token``."""

    def __init__(self, urls: Sequence[str], token: str) -> None:
        if not urls:
            raise ValueError("NemoGym needs at least one Gym server")
        self._urls = [u.rstrip("/") for u in urls]
        self._token = token
        self._http: httpx.AsyncClient | None = None
        self._fleet: GymFleet | None = None

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

    @property
    def fleet(self) -> GymFleet:
        if self._fleet is None:
            raise GymCallError("discover_checkpoint_capabilities must be called first")
        return self._fleet

    # -- discovery ---------------------------------------------------------------------------
    @_as_gym_call_errors
    async def discover_checkpoint_capabilities(self) -> dict[str, Any]:
        """Every server's capabilities and the running topology fingerprint (CONTROL.md §2)."""
        fleet = GymFleet.connect(self._urls, self._token, self.http, timeout=CALL_TIMEOUT_S)
        fingerprint = await fleet.discover()
        self._fleet = fleet
        return {"participants": [msgspec.to_builtins(s.caps) for s in fleet.servers], "fingerprint": fingerprint}

    @property
    def agents(self) -> list[AsyncControlClient]:
        return self.fleet.of("agent")

    # -- the checkpoint steps ----------------------------------------------------------------
    @_as_gym_call_errors
    async def prepare_checkpoint(self, checkpoint_id: str, deadline: float) -> dict[str, float]:
        """Pause models, park agents at turn ends, freeze resources; returns seconds per component."""
        return await self.fleet.prepare(checkpoint_id, deadline)

    @_as_gym_call_errors
    async def commit_checkpoint(self, checkpoint_id: str, deadline: float, draft_url: str) -> CommitResult:
        """Each server writes its part into the draft at ``draft_url``: agents, then models, then resources."""
        return await self.fleet.commit(checkpoint_id, deadline, draft_url)

    @_as_gym_call_errors
    async def resume_checkpoint(self, checkpoint_id: str) -> dict[str, float]:
        """Resume (resources, then models, then agents). Repeats are answered the same by each server."""
        return await self.fleet.resume(checkpoint_id, time.time() + CALL_TIMEOUT_S)

    @_as_gym_call_errors
    async def abort_checkpoint(self, checkpoint_id: str) -> list[str]:
        """Abort on every server, in the resume order, whatever each answers: a server that never began
        the checkpoint answers 409 ``wrong_phase`` (fine). Returns the failures, for the log."""
        return await self.fleet.abort(checkpoint_id, time.time() + CALL_TIMEOUT_S)

    @_as_gym_call_errors
    async def restore_checkpoint(self, restore_id: str, deadline: float, snapshot_url: str, saved_checkpoint_id: str,
                                 fingerprint: str) -> dict[str, Any]:
        """Every server loads its part of the snapshot and stays paused. Returns the agents' answers
        merged: ``continuations`` (run n + 1 of each unfinished rollout) and ``finished_unacked``."""
        answers = await self.fleet.restore(restore_id, deadline, snapshot_url, saved_checkpoint_id, fingerprint)
        merged: dict[str, Any] = {"continuations": [], "finished_unacked": []}
        for agent in self.agents:
            payload = answers[agent.prefix].payload
            merged["continuations"] += payload.get("continuations", [])
            merged["finished_unacked"] += payload.get("finished_unacked", [])
        return merged

    @_as_gym_call_errors
    async def discard(self, restore_id: str, deadline: float, refs: Sequence[tuple[str, int]]) -> list[str]:
        """Restored continuations that used a restart-only resource start over (on their own agent)."""
        out: list[str] = []
        for agent, mine in self._by_agent(refs):
            out += (await agent.discard(restore_id, deadline, mine)).get("discarded", [])
        return out

    # -- rollouts ----------------------------------------------------------------------------
    def agent_of(self, rollout_id: str) -> AsyncControlClient:
        agents = self.agents
        if not agents:
            raise GymCallError("no agent server")
        h = int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "little")
        return agents[h % len(agents)]

    def _by_agent(self, refs: Iterable[tuple[str, Any]]) -> list[tuple[AsyncControlClient, list[tuple[str, Any]]]]:
        """``refs`` grouped by the agent that holds each rollout."""
        out: dict[str, tuple[AsyncControlClient, list[tuple[str, Any]]]] = {}
        for ref in refs:
            agent = self.agent_of(ref[0])
            out.setdefault(agent.url, (agent, []))[1].append(tuple(ref))
        return list(out.values())

    @_as_gym_call_errors
    async def start_rollouts(self, specs: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
        """Send rollouts to their agents. ``accepted`` (202, or 409: the agent already has it),
        ``paused`` (503: try again later); anything else raises."""
        out: dict[str, list[str]] = {"accepted": [], "paused": []}
        sem = asyncio.Semaphore(MAX_PARALLEL_STARTS)

        async def one(spec: dict[str, Any]) -> None:
            s = self.agent_of(spec["rollout_id"])
            body = {k: spec[k] for k in ("rollout_id", "seed", "turns", "tools")}
            async with sem:  # a second start of the same rollout is a 409: sending it again is safe
                resp = await s.request("POST", "/rollouts", body, idempotent=True)
            if resp.status_code in (202, 409):
                out["accepted"].append(spec["rollout_id"])
            elif resp.status_code == 503:
                out["paused"].append(spec["rollout_id"])
            else:
                raise GymCallError(f"starting {spec['rollout_id']} on {s.label}: {resp.status_code} {resp.text[:300]}",
                                   component="agent", name=s.caps.name, status=resp.status_code)

        await asyncio.gather(*(one(sp) for sp in specs))
        return out

    @_as_gym_call_errors
    async def results(self) -> list[Any]:
        """Every finished (or failed) result the agents hold, not yet acknowledged."""
        lists = await asyncio.gather(*(s.request("GET", "/results", check=True, idempotent=True) for s in self.agents))
        return [r for resp in lists for r in resp.json()]

    @_as_gym_call_errors
    async def acknowledge(self, refs: Sequence[tuple[str, int]]) -> dict[str, list[str]]:
        """Acknowledge finished results. An agent that no longer holds one answers 404
        ``unknown_rollout``: it was acknowledged before (CONTROL.md §4); such refs come back in
        ``unknown``, one call each, so one of them cannot hold up the others."""
        out: dict[str, list[str]] = {"acknowledged": [], "unknown": []}

        async def call(s: AsyncControlClient, mine: list[tuple[str, int]]) -> bool:
            try:
                await s.acknowledge(mine)
            except ControlCallError as exc:
                if exc.error == "unknown_rollout":
                    return False
                raise
            return True

        async def per_agent(s: AsyncControlClient, mine: list[tuple[str, int]]) -> None:
            if await call(s, mine):
                out["acknowledged"] += [r for r, _ in mine]
                return
            for ref in mine:  # all-or-nothing refused: find which ones it no longer holds
                (out["acknowledged"] if await call(s, [ref]) else out["unknown"]).append(ref[0])

        await asyncio.gather(*(per_agent(s, mine) for s, mine in self._by_agent(refs)))
        return out


def remote(urls: Sequence[str], token: str, **options: Any) -> Any:
    """The NemoGym actor on Ray (no CPU reserved: it waits on HTTP). Needs ``ray`` initialised."""
    import ray

    return ray.remote(NemoGym).options(num_cpus=0, **options).remote(list(urls), token)
