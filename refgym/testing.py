"""Driving reference Gym servers from tests (and the demo): specs, fleets, snapshots, bounded waits.

``Fleet`` starts real server processes and SIGKILLs every one it started (by pid) on ``close``.
``take_snapshot`` / ``restore_all`` make the protocol's calls one by one in the documented order;
they coordinate nothing beyond that order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from refgym.client import GymClient, ok
from refgym.forkserver import ForkServer
from refgym.procs import ServerProcess, Trio, launch, start_trio
from schemas.control import CommitResponse
from schemas.manifest import GymCommit, ParticipantCommit, PartReceipt
from schemas.topology import topology_fingerprint
from snapformat import Published, SnapshotStore

MODEL_SEED = 7
WAIT_S = 60.0  # upper bound of every wait for rollouts to get somewhere


@dataclass(frozen=True)
class Spec:
    """What a rollout is: its trajectory is a function of these (and the model seed) only."""

    rollout_id: str
    seed: int
    turns: int
    tools: tuple[str, ...] = ("notes",)


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
    model: GymClient
    agent: GymClient
    resource: GymClient
    token_store: str | None = None  # where the model server captures its calls' TokenEntries

    @property
    def clients(self) -> list[GymClient]:
        return [self.model, self.agent, self.resource]

    def fingerprint(self) -> str:
        return topology_fingerprint([c.capabilities().contract() for c in self.clients])

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
        self.clients: list[GymClient] = []

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

    def client(self, url: str) -> GymClient:
        c = GymClient(url, self.token)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for c in self.clients:
            c.close()


@dataclass
class TakenSnapshot:
    """What a driven checkpoint produced: the published snapshot and each server's commit answer."""

    published: Published
    checkpoint_id: str
    fingerprint: str
    commits: dict[str, CommitResponse]


def commit_answer(resp: Any) -> CommitResponse:
    return msgspec.json.decode(msgspec.json.encode(ok(resp)), type=CommitResponse)


def take_snapshot(gym: Gym, store: SnapshotStore, checkpoint_id: str, resume: bool = True) -> TakenSnapshot:
    """The protocol in order: prepare (model, agent, resource), commit (agent, model with the agent's
    receipt, resource), publish, then resume (resource, model, agent)."""
    deadline = time.time() + 30
    for c in gym.clients:
        ok(c.prepare(checkpoint_id, deadline))
    draft = store.begin()
    agent = commit_answer(gym.agent.commit(checkpoint_id, deadline, draft.url))
    assert agent.part is not None
    model = commit_answer(gym.model.commit(checkpoint_id, deadline, draft.url, [agent.part]))
    resource = commit_answer(gym.resource.commit(checkpoint_id, deadline, draft.url))
    commits = {"agent": agent, "model": model, "resource": resource}
    fingerprint = gym.fingerprint()
    published = draft.publish(receipts=[c.part for c in commits.values() if c.part is not None],
                              gym_commit=gym_commit(gym, checkpoint_id, commits), topology_fingerprint=fingerprint)
    if resume:
        for c in (gym.resource, gym.model, gym.agent):
            ok(c.resume(checkpoint_id))
    return TakenSnapshot(published, checkpoint_id, fingerprint, commits)


def gym_commit(gym: Gym, checkpoint_id: str, commits: dict[str, CommitResponse]) -> GymCommit:
    """The manifest's record of Gym's commit: one entry per participant with its part's checksum."""
    parts: list[ParticipantCommit] = []
    for c in gym.clients:
        answer = commits[c.caps.component]
        receipt: PartReceipt | None = answer.part
        parts.append(ParticipantCommit(component=c.caps.component, name=c.caps.name,
                                       part_prefix=receipt.prefix if receipt else None,
                                       part_manifest_checksum=receipt.part_manifest_checksum if receipt else None,
                                       payload=answer.payload))
    return GymCommit(checkpoint_id=checkpoint_id, participants=parts)


def restore_all(gym: Gym, snap: TakenSnapshot, restore_id: str) -> dict[str, dict[str, Any]]:
    """Restore every server of ``gym`` from ``snap`` (they stay paused); returns each answer."""
    deadline = time.time() + 30
    fingerprint = gym.fingerprint()
    return {c.caps.component: ok(c.restore(restore_id, deadline, snap.published.url, snap.checkpoint_id, fingerprint))
            for c in gym.clients}


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
