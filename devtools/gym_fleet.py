"""Driving reference Gym servers from tests (and the demo): specs, fleets, snapshots, bounded waits.

``Fleet`` starts real server processes and SIGKILLs every one it started (by pid) on ``close``.
Each server is reached through a :class:`RefServer`: gymkit's typed control client plus the plain
routes of the reference servers. ``take_snapshot`` / ``restore_all`` drive every server through
:class:`gymkit.GymFleet`, in the protocol's call orders.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from devtools.gym_forkserver import ForkServer
from devtools.gym_procs import ServerProcess, Trio, launch, start_trio
from gymkit import CommitResult, ControlCallError, ControlClient, GymFleet
from schemas.control import RestoreResponse
from schemas.topology import topology_fingerprint
from snapformat import Published, SnapshotStore

T = TypeVar("T")

MODEL_SEED = 7
WAIT_S = 60.0  # upper bound of every wait for rollouts to get somewhere


@dataclass(frozen=True)
class Spec:
    """What a rollout is: its trajectory is a function of these (and the model seed) only."""

    rollout_id: str
    seed: int
    turns: int
    tools: tuple[str, ...] = ("notes",)


class CallFailed(RuntimeError):
    def __init__(self, resp: httpx.Response) -> None:
        super().__init__(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
        self.response = resp


def ok(resp: httpx.Response) -> Any:
    """The JSON body of a 2xx answer of a plain route, else :class:`CallFailed` naming the call."""
    if not 200 <= resp.status_code < 300:
        raise CallFailed(resp)
    return resp.json()


def refused(call: Callable[..., Any], *args: Any, **kw: Any) -> ControlCallError:
    """The :class:`ControlCallError` that ``call(*args, **kw)`` raises; it must raise one."""
    try:
        answer = call(*args, **kw)
    except ControlCallError as exc:
        return exc
    raise AssertionError(f"expected a refusal, got {answer!r}")


class RefServer(ControlClient):
    """One reference server: its control calls (gymkit's typed client) and its plain routes."""

    def get(self, path: str) -> Any:
        return self.request("GET", path, check=True).json()

    def post(self, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
        return self.request("POST", path, body, content=content)

    def start_rollout(self, rollout_id: str, seed: int, turns: int,
                      tools: list[str] | tuple[str, ...] = ("notes",)) -> Any:
        body = {"rollout_id": rollout_id, "seed": seed, "turns": turns, "tools": list(tools)}
        return ok(self.post("/rollouts", body))


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S, every: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@dataclass
class Gym:
    """Clients of one running trio, and the processes behind them."""

    trio: Trio
    model: RefServer
    agent: RefServer
    resource: RefServer
    token_store: str | None = None  # where the model server captures its calls' TokenEntries

    @property
    def clients(self) -> list[RefServer]:
        return [self.model, self.agent, self.resource]

    def fingerprint(self) -> str:
        return topology_fingerprint([c.capabilities().contract() for c in self.clients])

    def fleet(self, op: Callable[[GymFleet], Awaitable[T]]) -> T:
        """``op`` run on a discovered :class:`gymkit.GymFleet` of these three servers (blocking)."""
        async def run() -> T:
            async with httpx.AsyncClient() as http:
                fleet = GymFleet.connect([c.url for c in self.clients], self.model.token, http)
                await fleet.discover()
                return await op(fleet)

        return asyncio.run(run())

    def start(self, specs: list[Spec]) -> None:
        for s in specs:
            self.agent.start_rollout(s.rollout_id, s.seed, s.turns, s.tools)

    def results(self) -> dict[str, dict[str, Any]]:
        return {r["rollout_id"]: r for r in self.agent.get("/results")}

    def wait_results(self, ids: list[str], timeout: float = WAIT_S) -> dict[str, dict[str, Any]]:
        def all_done() -> bool:  # polls the light summary, not every trajectory
            outcome = {r["rollout_id"]: r["outcome"] for r in self.agent.get("/rollouts")}
            return all(outcome.get(rid, "running") != "running" for rid in ids)

        wait_until(all_done, f"results of {len(ids)} rollouts", timeout, every=0.1)
        found = self.results()
        return {rid: found[rid] for rid in ids}

    def ledger(self) -> list[dict[str, Any]]:
        return self.model.get("/ledger")


class Fleet:
    """Starts servers for one scope and kills every one of them at the end."""

    def __init__(self, workdir: Path, token: str, token_file: Path, forkserver: ForkServer | None = None) -> None:
        self.workdir = workdir
        self.token = token
        self.token_file = token_file
        self.forkserver = forkserver  # fork servers from it (fast) instead of fresh interpreters
        self.procs: list[ServerProcess] = []
        self.clients: list[RefServer] = []

    def gym(self, **kw: Any) -> Gym:
        """A trio (model seed :data:`MODEL_SEED` unless given) with a client for each server.

        Its model server captures tokens into a token store of its own under the fleet's folder
        unless ``token_store`` names one (pass the same one to a replacement trio to share it).
        """
        kw.setdefault("seed", MODEL_SEED)
        kw.setdefault("token_store", str(self.workdir / f"token-store-{secrets.token_hex(4)}"))
        trio = start_trio(self.workdir, self.token_file, forkserver=self.forkserver, **kw)
        self.procs += trio.all
        clients = [self.client(p.url) for p in (trio.model, trio.agent, trio.resource)]
        return Gym(trio, *clients, token_store=kw["token_store"])

    def server(self, component: str, name: str, **kw: Any) -> ServerProcess:
        kw.setdefault("seed", MODEL_SEED)
        proc = launch(component, name, self.workdir, self.token_file, forkserver=self.forkserver, **kw)
        self.procs.append(proc)
        return proc.wait_ready()

    def client(self, url: str) -> RefServer:
        c = RefServer(url, self.token)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for c in self.clients:
            c.close()


@dataclass
class TakenSnapshot:
    """What a driven checkpoint produced: the published snapshot and Gym's commit."""

    published: Published
    checkpoint_id: str
    fingerprint: str
    commit: CommitResult


def take_snapshot(gym: Gym, store: SnapshotStore, checkpoint_id: str, resume: bool = True) -> TakenSnapshot:
    """A save of every server of ``gym`` (:class:`gymkit.GymFleet`'s orders): prepare, commit into a
    draft of ``store``, publish, then (unless ``resume`` is false) resume."""
    async def save(fleet: GymFleet) -> TakenSnapshot:
        deadline = time.time() + 30
        await fleet.prepare(checkpoint_id, deadline)
        draft = store.begin()
        commit = await fleet.commit(checkpoint_id, deadline, draft.url)
        published = draft.publish(receipts=commit.receipts, gym_commit=commit.gym_commit,
                                  topology_fingerprint=fleet.fingerprint)
        if resume:
            await fleet.resume(checkpoint_id)
        return TakenSnapshot(published, checkpoint_id, fleet.fingerprint, commit)

    return gym.fleet(save)


def restore_all(gym: Gym, snap: TakenSnapshot, restore_id: str) -> dict[str, RestoreResponse]:
    """Restore every server of ``gym`` from ``snap`` (they stay paused); each answer by component."""
    async def restore(fleet: GymFleet) -> dict[str, RestoreResponse]:
        return await fleet.restore(restore_id, time.time() + 30, snap.published.url, snap.checkpoint_id)

    answers = gym.fleet(restore)
    return {c.caps.component: answers[c.prefix] for c in gym.clients}


def new_fleet(workdir: Path, forkserver: ForkServer | None = None) -> Fleet:
    """A fleet with a fresh random control token (written to ``workdir/token``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    token_file = workdir / "token"
    token_file.write_text(token)
    return Fleet(workdir / "servers", token, token_file, forkserver)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) with a socket listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found
