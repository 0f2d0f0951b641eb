"""Driving reference Gym servers from tests (and the demo): specs, fleets, snapshots, bounded waits.

``Fleet`` starts real server processes and SIGKILLs every one it started (by pid) on ``close``.
A deployment (:class:`Gym`) is four servers (``devtools.gym_procs.GymServers``): the policy model
``policy0``, the agent ``agent0``, the resources server ``tools`` (tool ``notes``,
``export_restore``) and the resources server ``sandbox`` (tool ``sandbox``, ``restart_only``).
Each is reached through a :class:`RefServer`: gymkit's typed control client (``.model``,
``.agent``, ``.resources`` route groups, ``capabilities()``) plus the plain routes of the
reference servers.

:func:`take_snapshot` / :func:`restore_all` drive every server through :class:`gymkit.GymFleet`
(NeMo-RL's call orders, CONTROL.md §8) and turn Gym's plain files into a snapshot the way the
coordinator does (CONTROL.md §9, ``coordinator.checkpoint.gym_parts``): ``checkpoint_dir`` is the
draft's ``gym/`` folder on a local store (a staging folder otherwise), each participant's folder is
adopted as a part, and the snapshot is published with Gym's commit and the topology fingerprint.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from coordinator.checkpoint.gym_parts import adopt_commit, restore_dir, save_dir
from coordinator.checkpoint.save import PREPARE_ATTEMPTS, SETTLE_S
from devtools.gym_forkserver import ForkServer
from devtools.gym_procs import GymServers, ServerProcess, launch, start_servers
from gymkit import ControlCallError, ControlClient, GymFleet
from gymkit.gym_fleet import CommitResult, RestoreResult
from schemas.control import CompletionReceipt
from schemas.topology import manifest_fingerprint, topology_fingerprint
from snapformat import Published, SnapshotStore, open_snapshot

T = TypeVar("T")

MODEL_SEED = 7
WAIT_S = 60.0  # upper bound of every wait for rollouts to get somewhere
CONTROL_S = 30.0  # the deadline of the control calls driven here


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

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return self.request("GET", path, params=params, check=True).json()

    def post(self, path: str, body: Any = None, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        return self.request("POST", path, body, content=content, headers=headers)

    def start_rollout(self, rollout_id: str, seed: int, turns: int, tools: Iterable[str] = ("notes",),
                      attempt_index: int = 0) -> Any:
        """``POST /rollouts`` (Gym's ``/run`` of one attempt): 0 for a new rollout, n+1 for the
        controller's re-run of a restored attempt n."""
        body = {"rollout_id": rollout_id, "attempt_index": attempt_index, "seed": seed, "turns": turns,
                "tools": list(tools)}
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


def receipt_of(result: dict[str, Any]) -> CompletionReceipt:
    """The completion receipt a result of ``GET /results`` carries."""
    return msgspec.convert(result["completion_receipt"], CompletionReceipt)


@dataclass
class Gym:
    """Clients of one running deployment (four servers), and the processes behind them."""

    servers: GymServers
    model: RefServer
    agent: RefServer
    resource: RefServer
    sandbox: RefServer
    token_store: str | None = None  # where the model server captures its calls' TokenEntries

    @property
    def trio(self) -> GymServers:
        """The processes (the name of the three-server days; :attr:`servers`)."""
        return self.servers

    @property
    def clients(self) -> list[RefServer]:
        return [self.model, self.agent, self.resource, self.sandbox]

    @property
    def urls(self) -> dict[str, str]:
        """Server name (Gym's top-level config key, each server's capability name) -> URL."""
        return {p.name: p.url for p in self.servers.all}

    def fingerprint(self) -> str:
        """The running topology's fingerprint (NeMo-RL's bare hex)."""
        return topology_fingerprint([c.capabilities().contract() for c in self.clients])

    def fleet(self, op: Callable[[GymFleet], Awaitable[T]]) -> T:
        """``op`` run on a discovered :class:`gymkit.GymFleet` of these servers (blocking)."""
        async def run() -> T:
            async with httpx.AsyncClient() as http:
                fleet = GymFleet.connect(self.urls, self.model.token, http)
                await fleet.discover()
                return await op(fleet)

        return asyncio.run(run())

    # -- rollouts (the plain routes) ---------------------------------------------------------------
    def start(self, specs: Iterable[Spec], attempt_index: int = 0) -> None:
        for s in specs:
            self.agent.start_rollout(s.rollout_id, s.seed, s.turns, s.tools, attempt_index=attempt_index)

    def rerun(self, specs: Iterable[Spec], attempts: dict[str, int]) -> None:
        """The controller's re-run after a restore: each rollout of ``attempts`` as that attempt."""
        for s in specs:
            if s.rollout_id in attempts:
                self.agent.start_rollout(s.rollout_id, s.seed, s.turns, s.tools, attempt_index=attempts[s.rollout_id])

    def results(self) -> dict[str, dict[str, Any]]:
        """Results the agent retains (each with its ``completion_receipt``), by rollout id (the
        latest attempt when several are retained)."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.agent.get("/results"):
            if r["rollout_id"] not in out or r["attempt_index"] > out[r["rollout_id"]]["attempt_index"]:
                out[r["rollout_id"]] = r
        return out

    def wait_results(self, ids: Iterable[str], timeout: float = WAIT_S) -> dict[str, dict[str, Any]]:
        """Each rollout's retained result, once every one of ``ids`` has one (of its latest attempt)."""
        ids = list(ids)

        def all_done() -> bool:  # polls the light summary first, not every trajectory
            latest: dict[str, tuple[int, str]] = {}
            for r in self.agent.get("/rollouts"):
                if r["rollout_id"] not in latest or r["attempt_index"] >= latest[r["rollout_id"]][0]:
                    latest[r["rollout_id"]] = (r["attempt_index"], r["outcome"])
            return all(latest.get(rid, (0, "running"))[1] != "running" for rid in ids)

        def all_retained() -> dict[str, dict[str, Any]] | None:  # a result is retained once its receipt is issued
            found = self.results()
            return found if all(rid in found for rid in ids) else None

        end = time.monotonic() + timeout
        wait_until(all_done, f"results of {len(ids)} rollouts", timeout, every=0.05)
        found = wait_until(all_retained, f"the receipts of {len(ids)} results", max(1.0, end - time.monotonic()))
        return {rid: found[rid] for rid in ids}

    def acknowledge(self, results: Iterable[dict[str, Any]]) -> list[CompletionReceipt]:
        """Acknowledge ``results`` (of :meth:`results`) in one ``acknowledge-completed`` batch, each
        by the receipt it carries, unchanged; the agent then forgets them."""
        receipts = [receipt_of(r) for r in results]
        if not receipts:
            return []
        return self.agent.agent.acknowledge_completed(receipts).acknowledged

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
        """A deployment (model seed :data:`MODEL_SEED` unless given) with a client for each server;
        ``kw`` goes to :func:`devtools.gym_procs.start_servers`.

        Its model server captures tokens into a token store of its own under the fleet's folder
        unless ``token_store`` names one (pass the same one to a replacement deployment to share it).
        """
        kw.setdefault("seed", MODEL_SEED)
        kw.setdefault("token_store", str(self.workdir / f"token-store-{secrets.token_hex(4)}"))
        servers = start_servers(self.workdir, self.token_file, forkserver=self.forkserver, **kw)
        self.procs += servers.all
        clients = [self.client(p.url) for p in (servers.model, servers.agent, servers.resource, servers.sandbox)]
        for c in clients:
            c.capabilities()  # every client knows its server's component and name (errors name it)
        return Gym(servers, *clients, token_store=kw["token_store"])

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
    """What a driven checkpoint produced: the published snapshot, Gym's commit, and the running
    topology's fingerprint (bare hex; the manifest keeps it as ``sha256:<hex>``)."""

    published: Published
    checkpoint_id: str
    fingerprint: str
    commit: CommitResult
    collected: dict[str, dict[str, Any]]  # the results acknowledged before the prepare, by rollout id


def take_snapshot(gym: Gym, store: SnapshotStore, checkpoint_id: str, resume: bool = True) -> TakenSnapshot:
    """A save of every server of ``gym`` (:class:`gymkit.GymFleet`'s orders, CONTROL.md §8.1 "A
    save"): acknowledge every result the agent retains (a controller stores them first: they are
    returned as ``collected``); prepare; commit into the ``checkpoint_dir`` of a draft of ``store``
    (its ``gym/`` folder on a local store, a staging folder otherwise); adopt each participant's
    folder as a part; publish with Gym's commit (each reply verbatim) and ``sha256:<fingerprint>``;
    then (unless ``resume`` is false) resume. Any failure before publishing aborts the checkpoint
    (the resume calls) and abandons the draft.

    A rollout that completes between the acknowledgement and the prepare makes the agent refuse
    (``agent_prepare_incomplete``): as the controller does, the new results are acknowledged and a
    fresh id (``<checkpoint_id>-<attempt>``) prepares, at most the controller's ``PREPARE_ATTEMPTS``
    times. The id that prepared is :attr:`TakenSnapshot.checkpoint_id`."""
    retained: dict[str, dict[str, Any]] = {}

    def acknowledge() -> None:
        rows = gym.agent.get("/results")
        gym.acknowledge(rows)
        retained.update({r["rollout_id"]: r for r in sorted(rows, key=lambda r: r["attempt_index"])})

    async def prepare(fleet: GymFleet) -> str:
        for attempt in range(1, PREPARE_ATTEMPTS + 1):
            cid = checkpoint_id if attempt == 1 else f"{checkpoint_id}-{attempt}"
            try:
                await fleet.prepare(cid, time.time() + CONTROL_S)
                return cid
            except ControlCallError as exc:
                if exc.code != "agent_prepare_incomplete" or attempt == PREPARE_ATTEMPTS:
                    raise
                # The fleet resumed everyone it had paused: rollouts parked at their end complete a
                # moment later. Let them, so this acknowledgement takes them too (as the save does).
                await asyncio.sleep(SETTLE_S)
                await asyncio.to_thread(acknowledge)
        raise AssertionError("unreachable")

    acknowledge()

    async def save(fleet: GymFleet) -> TakenSnapshot:
        cid = await prepare(fleet)
        deadline = time.time() + CONTROL_S
        draft = store.begin()
        cdir = save_dir(draft)
        try:
            commit = await fleet.commit(cid, deadline, cdir.path)
            parts = await asyncio.to_thread(adopt_commit, draft, cdir, commit)
            published = await asyncio.to_thread(
                draft.publish, receipts=parts.receipts, gym_commit=parts.gym_commit,
                topology_fingerprint=manifest_fingerprint(fleet.fingerprint))
        except BaseException:
            await fleet.abort(cid, time.time() + CONTROL_S)
            draft.abandon()
            raise
        finally:
            cdir.cleanup()
        if resume:
            await fleet.resume(cid, time.time() + CONTROL_S)
        return TakenSnapshot(published, cid, fleet.fingerprint, commit, retained)

    return gym.fleet(save)


def restore_all(gym: Gym, snap: TakenSnapshot | Published | str, restore_id: str) -> RestoreResult:
    """Restore every server of ``gym`` from a published snapshot (they stay paused until resumed):
    the running topology must have the snapshot's fingerprint; ``checkpoint_dir`` is the snapshot's
    own ``gym/`` folder on a local store (else its Gym parts downloaded and verified into a staging
    folder); each server must report the snapshot's Gym checkpoint id."""
    url = snap.published.url if isinstance(snap, TakenSnapshot) else snap if isinstance(snap, str) else snap.url
    opened = open_snapshot(url)
    commit = opened.manifest.gym_commit
    assert commit is not None, f"{url}: no Gym commit"

    async def restore(fleet: GymFleet) -> RestoreResult:
        running = manifest_fingerprint(fleet.fingerprint)
        if opened.manifest.topology_fingerprint != running:
            raise ValueError(f"{url} was taken by topology {opened.manifest.topology_fingerprint}; the running one "
                             f"is {running}")
        prefixes = [p.part_prefix for p in commit.participants if p.part_prefix is not None]
        cdir = await asyncio.to_thread(restore_dir, opened, prefixes)
        try:
            return await fleet.restore(restore_id, time.time() + CONTROL_S, cdir.path,
                                       source_checkpoint_id=commit.checkpoint_id)
        finally:
            cdir.cleanup()

    return gym.fleet(restore)


def resume_all(gym: Gym, checkpoint_id: str) -> None:
    """``resume_checkpoint``: resources, then models, then agents."""
    async def resume(fleet: GymFleet) -> None:
        await fleet.resume(checkpoint_id, time.time() + CONTROL_S)

    gym.fleet(resume)


def new_fleet(workdir: Path, forkserver: ForkServer | None = None, token: str | None = None) -> Fleet:
    """A fleet with a fresh random control token (or ``token``), written to ``workdir/token``."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = token or secrets.token_urlsafe(24)
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
