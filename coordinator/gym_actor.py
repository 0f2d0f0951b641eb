"""The NemoGym actor: the one caller of every Gym server, over HTTP, with NeMo-RL's method names.

The Single Controller never talks to Gym itself; it calls this actor (a Ray actor: see
:func:`remote`). The checkpoint methods are NeMo-RL's (``nemo_rl/environments/nemo_gym.py`` of the
``d595189f`` era; CONTROL.md §8), with the same names and arguments:

- ``discover_checkpoint_capabilities(server_names=None)``: every server's capabilities, checked
  against NeMo-RL's participant rules; the topology and its fingerprint;
- ``acknowledge_completed_executions(executions=[{receipt, agent_name}])``: one batch per agent;
- ``prepare_checkpoint(checkpoint_id, deadline_ts)``: freezes this actor's dispatch, then models
  pause -> agents prepare (again on ``agent_prepare_incomplete``) -> resources prepare -> models
  polled until paused; on failure everyone called is resumed and dispatch reopens. One argument is
  this repository's own, keyword only and off by default: with ``hold_when_unacknowledged=True`` an
  agent blocked only by completed results not yet acknowledged fails the call with a
  ``GymCallError`` whose ``held`` is True, and nothing is resumed: dispatch stays frozen and every
  participant called stays paused under the id until the caller prepares it again or aborts it;
- ``commit_checkpoint(checkpoint_id, deadline_ts, checkpoint_dir)``: agents -> policy model (given
  the agents' continuation indexes) -> resources, each writing its files into ``checkpoint_dir``
  (with ``commit_order="resources_alongside"``, resources at the same time as agents -> model);
- ``restore_checkpoint(checkpoint_id, deadline_ts, checkpoint_dir, source_checkpoint_id=None)``:
  models -> agents -> resources (with ``restore_order="concurrent"``, all at once), all staying
  paused (dispatch frozen until the resume);
- ``discard_restored_agent_continuations(checkpoint_id, deadline_ts, executions)``;
- ``resume_checkpoint(checkpoint_id, deadline_ts)``: resources -> models -> agents (the design
  note's order; :mod:`gymkit.gym_fleet` says where NeMo-RL's versions differ), then dispatch reopens;
- ``abort_checkpoint(checkpoint_id, deadline_ts)``: the same calls as resume (Gym has no abort
  route); what failed is returned, not raised, and dispatch reopens.

The call orders, retries and rules are :class:`gymkit.gym_fleet.GymFleet`'s; every control call's
HTTP timeout is ``max(0.001, deadline_ts - now)`` plus the client's grace
(:data:`gymkit.control_client.GRACE_S`). The rollout side keeps its routes: ``start_rollouts``
sends each rollout to the agent chosen by a stable hash of its id over the agents sorted by name
(the same agent before and after a restore); ``results`` lists what every agent holds, each result
tagged with ``agent_name`` (the agent's participant name, what acknowledging it needs).

Servers are given as ``{server_name: url}`` (Gym's top-level config keys; each must equal the
server's capability name) or as a list of URLs (each named by its capability name). Whatever fails
reaches the controller as a :class:`~coordinator.errors.GymCallError` whose ``error`` is the Gym
code (or the client's own: ``unreachable``, ``timeout``, ``bad_answer``, ``topology``,
``not_ready``). This module imports neither Ray nor the controller: :func:`remote` wraps the class.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from coordinator.errors import GymCallError
from gymkit.control_client import ControlCallError, error_code
from gymkit.gym_fleet import (
    AbortResult,
    AcknowledgeResult,
    CommitOrder,
    CommitResult,
    DiscardResult,
    GymFleet,
    PrepareResult,
    RestoreOrder,
    RestoreResult,
    Server,
    StepResult,
    Topology,
    UnacknowledgedResults,
    checked_commit_order,
    checked_restore_order,
)
from schemas.control import CompletionReceipt

log = logging.getLogger("coordinator.gym")

__all__ = ["NemoGym", "remote"]

CONTROL_TIMEOUT_S = 60.0  # calls without a deadline of their own (capabilities, acknowledgements, rollouts)
MAX_PARALLEL_STARTS = 16
#: Below any server's keep-alive (uvicorn's default is 5 s): the pool drops a connection before the
#: server would. Only idempotent calls ride kept-alive connections (starts, results, status,
#: acknowledgements; sent once more if one drops under them); every other control call has a
#: connection of its own (``gymkit.control_client.ONE_CONNECTION_PER_CALL`` says why).
KEEPALIVE_EXPIRY_S = 2.0
#: Connections of the actor's HTTP pool: one per server plus the rollout starts in flight, so a step's
#: fan-out (every server of a component called at once) is never queued behind the pool. A fixed 32
#: made the 33rd agent's prepare wait for an earlier agent to finish parking: with 100 agents the
#: prepare took about 4 agents' parking times one after the other. Bounded: at most MAX_CONNECTIONS.
MIN_CONNECTIONS, MAX_CONNECTIONS = 32, 1024


def pool_size(servers: int) -> int:
    """The HTTP pool's connections for ``servers`` Gym servers (see :data:`MAX_CONNECTIONS`)."""
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, servers + MAX_PARALLEL_STARTS))


def _as_gym_call_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """The actor's errors are the coordinator's: a failed call is a :class:`GymCallError` with the
    same message, server, status, and the code as ``error``."""

    @functools.wraps(method)
    async def wrapper(*args: Any, **kw: Any) -> Any:
        try:
            return await method(*args, **kw)
        except ControlCallError as exc:
            raise GymCallError(str(exc), component=exc.component, name=exc.name, status=exc.status,
                               error=exc.code) from None

    return wrapper


class NemoGym:
    """Calls to a set of Gym servers, each control call authenticated with ``token``. ``connections``:
    the HTTP pool's size (default :func:`pool_size` of the servers). ``commit_order``: NeMo-RL's
    (default), or ``"resources_alongside"``; ``restore_order``: NeMo-RL's (default), or
    ``"concurrent"`` (:class:`gymkit.gym_fleet.GymFleet`)."""

    def __init__(self, servers: Mapping[str, str] | Sequence[str], token: str, *,
                 control_timeout_s: float = CONTROL_TIMEOUT_S, connections: int | None = None,
                 commit_order: CommitOrder = "nemo_rl", restore_order: RestoreOrder = "nemo_rl") -> None:
        if not servers:
            raise ValueError("NemoGym needs at least one Gym server")
        if connections is not None and connections < 1:
            raise ValueError(f"connections is {connections}, expected at least 1")
        self._connections = pool_size(len(servers)) if connections is None else connections
        self._servers: Mapping[str, str] | list[str] = (
            {k: v.rstrip("/") for k, v in servers.items()} if isinstance(servers, Mapping)
            else [u.rstrip("/") for u in servers])
        self._token = token
        self._control_timeout_s = control_timeout_s
        self._commit_order = checked_commit_order(commit_order)
        self._restore_order = checked_restore_order(restore_order)
        self._http: httpx.AsyncClient | None = None
        self._http_once: httpx.AsyncClient | None = None
        self._fleet: GymFleet | None = None
        self._active_checkpoint_id: str | None = None  # dispatch is frozen while one is active

    def _pool(self) -> httpx.AsyncClient:
        # room for a connection per server (httpx keeps 20 by default); the fenced calls' pool closes
        # each after its answer (Connection: close), so only the idempotent pool keeps any alive
        return httpx.AsyncClient(timeout=self._control_timeout_s, limits=httpx.Limits(
            max_connections=self._connections, max_keepalive_connections=self._connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S))

    @property
    def http(self) -> httpx.AsyncClient:
        """The pool of the idempotent calls: connections kept alive, every server's."""
        if self._http is None:
            self._http = self._pool()
        return self._http

    @property
    def http_once(self) -> httpx.AsyncClient:
        """The pool of the calls that must not be sent twice: each on a connection of its own, closed
        after its answer (``gymkit.control_client.ONE_CONNECTION_PER_CALL``), so none is ever idle."""
        if self._http_once is None:
            self._http_once = self._pool()
        return self._http_once

    async def close(self) -> None:
        for http in (self._http, self._http_once):
            if http is not None:
                await http.aclose()
        self._http = self._http_once = None

    @property
    def fleet(self) -> GymFleet:
        if self._fleet is None:
            raise GymCallError("discover_checkpoint_capabilities must succeed before Gym checkpoint control calls")
        return self._fleet

    @property
    def active_checkpoint_id(self) -> str | None:
        return self._active_checkpoint_id

    # -- discovery ---------------------------------------------------------------------------------
    @_as_gym_call_errors
    async def discover_checkpoint_capabilities(self, server_names: list[str] | None = None) -> Topology:
        """Every server's capabilities (or only ``server_names``'), checked; the topology (NeMo-RL's
        contracts) and its fingerprint (bare hex)."""
        fleet = GymFleet.connect(self._servers, self._token, self.http, once=self.http_once,
                                 control_timeout_s=self._control_timeout_s, commit_order=self._commit_order,
                                 restore_order=self._restore_order)
        topology = await fleet.discover(server_names)
        self._fleet = fleet
        return topology

    # -- completed results -----------------------------------------------------------------------
    @_as_gym_call_errors
    async def acknowledge_completed_executions(self, executions: list[dict[str, Any]]) -> AcknowledgeResult:
        """Release completed results RL now owns durably: ``[{"receipt": {...}, "agent_name": ...}]``,
        one ``acknowledge-completed`` batch per agent; every reply echoes its receipts."""
        if not executions:
            return AcknowledgeResult(acknowledged=[])
        return await self.fleet.acknowledge_completed_executions(executions)

    @_as_gym_call_errors
    async def completion_receipt(self, agent_name: str, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        """The receipt of one completed result (``GET completion-receipt`` on its agent)."""
        return await self.fleet.completion_receipt(agent_name, rollout_id, attempt_index)

    # -- the checkpoint steps ----------------------------------------------------------------------
    def _freeze(self, checkpoint_id: str) -> None:
        if self._active_checkpoint_id not in (None, checkpoint_id):
            raise GymCallError(f"Gym checkpoint {self._active_checkpoint_id!r} is already active; "
                               f"{checkpoint_id!r} refused")
        self._active_checkpoint_id = checkpoint_id

    def _unfreeze(self, checkpoint_id: str) -> None:
        if self._active_checkpoint_id == checkpoint_id:
            self._active_checkpoint_id = None

    @_as_gym_call_errors
    async def prepare_checkpoint(self, checkpoint_id: str, deadline_ts: float, *,
                                 hold_when_unacknowledged: bool = False) -> PrepareResult:
        """Freeze dispatch and prepare every participant, or resume those called, reopen and raise.
        With ``hold_when_unacknowledged``, a prepare blocked only by completed results not yet
        acknowledged raises a ``GymCallError`` with ``held`` True and leaves dispatch frozen and
        every participant called paused under ``checkpoint_id`` (the module docstring)."""
        fleet = self.fleet
        self._freeze(checkpoint_id)
        try:
            return await fleet.prepare(checkpoint_id, deadline_ts, hold_when_unacknowledged=hold_when_unacknowledged)
        except BaseException as exc:
            if hold_when_unacknowledged and isinstance(exc, UnacknowledgedResults):  # the fleet resumed no one
                raise GymCallError(str(exc), component=exc.component, name=exc.name, status=exc.status,
                                   error=exc.code, held=True) from None
            self._unfreeze(checkpoint_id)
            raise

    @_as_gym_call_errors
    async def commit_checkpoint(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> CommitResult:
        """Every export_restore participant writes its files into ``checkpoint_dir``."""
        self._require_active(checkpoint_id, "commit")
        return await self.fleet.commit(checkpoint_id, deadline_ts, checkpoint_dir)

    @_as_gym_call_errors
    async def restore_checkpoint(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str,
                                 source_checkpoint_id: str | None = None) -> RestoreResult:
        """Every export_restore participant loads its files from ``checkpoint_dir`` and stays paused;
        dispatch stays frozen until the resume (or abort)."""
        fleet = self.fleet
        self._freeze(checkpoint_id)
        return await fleet.restore(checkpoint_id, deadline_ts, checkpoint_dir, source_checkpoint_id)

    @_as_gym_call_errors
    async def discard_restored_agent_continuations(self, checkpoint_id: str, deadline_ts: float,
                                                   executions: list[dict[str, Any]]) -> DiscardResult:
        """The replacement attempts ``[{rollout_id, attempt_index}]`` start over instead of continuing."""
        self._require_active(checkpoint_id, "discard")
        return await self.fleet.discard_restored_agent_continuations(checkpoint_id, deadline_ts, executions)

    @_as_gym_call_errors
    async def resume_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> StepResult:
        """Resume every participant (resources, models, agents); dispatch reopens once all answered.
        A repeat is answered the same by each server (its resume replays)."""
        result = await self.fleet.resume(checkpoint_id, deadline_ts)
        self._unfreeze(checkpoint_id)
        return result

    @_as_gym_call_errors
    async def abort_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> AbortResult:
        """The resume calls, whatever each answers; ``failures`` lists what failed (a server that never
        began answers ``invalid_phase``: not a failure). Dispatch reopens."""
        try:
            result = await self.fleet.abort(checkpoint_id, deadline_ts)
        finally:
            self._unfreeze(checkpoint_id)
        for failure in result.failures:
            log.warning("abort of %s: %s", checkpoint_id, failure)
        return result

    def _require_active(self, checkpoint_id: str, what: str) -> None:
        if self._active_checkpoint_id != checkpoint_id:
            raise GymCallError(f"{what} of Gym checkpoint {checkpoint_id!r}: it is not the active checkpoint "
                               f"({self._active_checkpoint_id!r})")

    # -- rollouts ----------------------------------------------------------------------------------
    @property
    def agents(self) -> list[Server]:
        return self.fleet.agents

    def agent_of(self, rollout_id: str) -> Server:
        agents = self.agents
        if not agents:
            raise GymCallError("no agent server")
        h = int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "little")
        return agents[h % len(agents)]

    @_as_gym_call_errors
    async def start_rollouts(self, specs: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
        """Send rollout attempts (Gym's ``/run`` of (rollout id, attempt index)) to their agents.
        ``accepted``: 202, or 409 ``duplicate_execution`` (the agent already runs it); ``paused``:
        409 ``agent_admission_closed`` or 503 (try again later); anything else raises. Refused while
        a checkpoint is active."""
        if self._active_checkpoint_id is not None:
            raise GymCallError(f"Gym dispatch is frozen for checkpoint {self._active_checkpoint_id!r}")
        out: dict[str, list[str]] = {"accepted": [], "paused": []}
        sem = asyncio.Semaphore(MAX_PARALLEL_STARTS)

        async def one(spec: dict[str, Any]) -> None:
            s = self.agent_of(spec["rollout_id"])
            body = {k: spec[k] for k in ("rollout_id", "attempt_index", "seed", "turns", "tools") if k in spec}
            async with sem:  # a second start of the same attempt is refused as a duplicate: sending it again is safe
                resp = await s.client.request("POST", "/rollouts", body, idempotent=True)
            code = error_code(resp) if resp.status_code == 409 else None
            if resp.status_code == 202 or code == "duplicate_execution":
                out["accepted"].append(spec["rollout_id"])
            elif resp.status_code == 503 or code == "agent_admission_closed":
                out["paused"].append(spec["rollout_id"])
            else:
                raise GymCallError(f"starting {spec['rollout_id']} on {s.client.label}: {resp.status_code} "
                                   f"{resp.text[:300]}", component=s.component, name=s.name, status=resp.status_code,
                                   error=code)

        await asyncio.gather(*(one(sp) for sp in specs))
        return out

    @_as_gym_call_errors
    async def results(self) -> list[dict[str, Any]]:
        """Every finished (or failed) result the agents hold, not yet acknowledged; each carries
        ``agent_name``, the participant name of the agent that listed it."""
        agents = self.agents
        lists = await asyncio.gather(*(s.client.request("GET", "/results", check=True, idempotent=True)
                                       for s in agents))
        out: list[dict[str, Any]] = []
        for s, resp in zip(agents, lists):
            for r in resp.json():
                r.setdefault("agent_name", s.name)
                out.append(r)
        return out


def remote(servers: Mapping[str, str] | Sequence[str], token: str, *, commit_order: CommitOrder = "nemo_rl",
           restore_order: RestoreOrder = "nemo_rl", **options: Any) -> Any:
    """The NemoGym actor on Ray (no CPU reserved: it waits on HTTP), with Ray's actor ``options``.
    Needs ``ray`` initialised."""
    import ray

    servers = dict(servers) if isinstance(servers, Mapping) else list(servers)
    return ray.remote(NemoGym).options(num_cpus=0, **options).remote(servers, token, commit_order=commit_order,
                                                                     restore_order=restore_order)
