"""The scale benchmark (issue 22 §2): the pause, step by step, at 10,000 parked rollouts on 10 agent
servers and 100,000 on 100, and the restore on fresh servers after a SIGKILL.

    python -m benchmarks.run --section scale          # (1, 1,000), (10, 1,000), (10, 10,000), (100, 100,000)
    python -m benchmarks.run --section scale --quick  # (1, 100), (2, 200), one repeat each

**The workload.** S agent servers, S resources servers (tool ``notes``, ``export_restore``: one per
agent) and one policy model server: the unchanged ``refgym`` apps, hosted several per process by
:mod:`devtools.gym_multihost` (each server its own port on 127.0.0.1, its own fence and state; the
model alone in a process of its own). N rollouts of :data:`TURNS` turns are spread evenly over the
agents. Each agent runs at most ``refgym.agent_server.MAX_OPEN_CALLS`` turns at once; every model
call takes :data:`MODEL_SLOW_MS`. The benchmark waits until every rollout has finished its first
turn (a real model call recorded in the model's ledger, a real session reset and tool call on its
resources server), so each parked rollout is real state on three servers.

*Light path* (documented, not timed): rollouts are started with ``POST /rollouts/batch`` (many
``/run`` calls per request, each started exactly like ``POST /rollouts``) with ``prime``: each
agent runs its new rollouts' *first* turn batched, 250 rollouts per request to each server
(``/sessions/batch`` for the session resets and the tool calls, ``/v1/responses/batch`` for the model
calls). Each call of a batch runs the same server code as its single route (model admission and
ledger, the resources kit's session lock, request ids and receipts, the agent kit's boundaries), so
the state is the one the ordinary path makes; only the HTTP requests are fewer. Without it, 100,000
first turns at three requests each took longer than the whole run may (about 25 turns/s on this
shared machine). Every later turn is ordinary, one HTTP call each; progress is polled with ``GET
/rollouts/progress`` (counts only).

**The measurement** (every step timed on the driver, HTTP round trips included). Per point: one set-up;
then R checkpoints of the live rollouts, each driven by :class:`coordinator.gym_actor.NemoGym` (in this
process, without Ray: the object the Ray actor wraps), whose steps are
:class:`gymkit.gym_fleet.GymFleet`'s fan-out (one component after the other, the servers of a
component at once), and resumed (the rollouts run on :data:`RUN_BETWEEN_S` between two). Gym's files
are adopted and the snapshot published after the resume, the controller's default order
(``write_mode`` ``background``), so the pause is prepare, commit and resume. After the pauses the
same Gym files are written once per pause with bare ``os`` calls (:func:`bare_files`): the disk's
own cost of what a commit must write, measured in the same run. Then every host process is
SIGKILLed, and R restores of the last snapshot follow, each on freshly started servers (their start
not timed). Per step the wall time is reported, and inside prepare, commit and
restore the slowest server of each component (the step waits for it). The snapshot store is a local
folder (:class:`snapformat.SnapshotStore`). A failed pause or restore (a server process that dies)
is reported, not counted; a restore is tried again on fresh servers (at most
:data:`MAX_RESTORE_FAILURES` times).

**The staging lever** (``--staging DIR``; ``benchmarks.run`` uses ``/dev/shm`` when it is RAM-backed,
:func:`ram_staging`). Each repeat pauses twice, 1 s apart: into the draft as above, then with Gym's
files staged in a folder under ``DIR`` (``ControllerConfig.gym_staging="always"``), which adoption
copies into the draft after the resume. The bare-files baseline is measured in both places, on as
many threads as Gym's writer uses there (``snapformat.gym_dir.writer_threads``). The restores take
the last snapshot, a staged one.

**The order levers.** ``--commit-alongside`` (with ``--staging``): each repeat also pauses staged
with the resources servers committing alongside the agents and the model. ``--restore-concurrent``:
each restore repeat also restores, on fresh servers of its own, with every participant at once
(``NemoGym(restore_order="concurrent")``). Either way the two orders swap places every repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from benchmarks import common
from coordinator.checkpoint import gym_parts
from coordinator.gym_actor import NemoGym
from devtools.gym_multihost import HostSpec, ModelSpec, MultiHost, PairSpec, launch
from gymkit.gym_fleet import AGENTS, MODELS, RESOURCES, RestoreOrder, StepResult
from refgym.agent_server import MAX_BATCH, MAX_OPEN_CALLS
from schemas.topology import manifest_fingerprint
from snapformat import SnapshotStore, layout, open_snapshot
from snapformat.gym_dir import writer_threads
from snapformat.kinds import GYM_FILE_KIND
from snapformat.mounts import mount_of

Log = Callable[[str], None]

#: (agent servers, rollouts) per point, in order.
FULL_POINTS: tuple[tuple[int, int], ...] = ((1, 1000), (10, 1000), (10, 10_000), (100, 100_000))
QUICK_POINTS: tuple[tuple[int, int], ...] = ((1, 100), (2, 200))
FULL_REPEATS = 5
#: Repeats at 100,000: each costs minutes of set-up (100,000 first turns through one model server
#: on 2 shared cores), so fewer fit; the report says how many ran.
LARGE_N, LARGE_REPEATS = 100_000, 2
#: Wall time a 100,000 point may take after its set-up: pauses stop repeating past half of it, restores
#: past all of it (each kind at least once), so the whole section ends in bounded time.
LARGE_BUDGET_S = 900.0
TURNS = 64  # a rollout parked after one turn has plenty left: none completes before the snapshot
MODEL_SLOW_MS = 50  # a model call's latency (as in the gym section); batched first turns wait it once per chunk
MAX_HOSTS = 4  # host processes of agent + resources pairs (2 cores: more only adds context switches)
RUN_BETWEEN_S = 1.0  # the resumed rollouts run this long between two measured pauses
SETUP_S_PER_ROLLOUT = 0.02  # the first-turn wait's bound: this per rollout, at least 120 s
DEADLINE_S = 600.0  # the protocol calls' deadline (a bound, not a target)
START_PARALLEL = 8  # batch start requests in flight at once
PROGRESS_ATTEMPTS = 5  # a progress poll of one agent, asked again on a transport error
TARGETS = {(10, 10_000): 1.0, (100, 100_000): 5.0}  # the pause targets, seconds
RESTORE_TARGET_RATIO = 2.0  # restore <= 2x the pause
MAX_RESTORE_FAILURES = 2  # restores that may fail (recorded in the report) before a point gives up
FLOOR_THREADS = 8  # the bare-files baseline's writer threads (as snapformat.gym_dir.FSYNC_WORKERS)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc/<pid>/stat counts CPU time in these

#: (key, label, what it includes), in table order. Keys are those of a cycle's ``times_s``.
PHASES: list[tuple[str, str, str]] = [
    ("prepare", "prepare (whole step)",
     "`NemoGym.prepare_checkpoint`: freeze dispatch; `GymFleet.prepare`: the policy model's `pause`, then every "
     "agent's `prepare` at once (re-sent on 409 `agent_prepare_incomplete`), then every resources server's "
     "`prepare` at once, then `status?wait_state=paused` for a model still draining"),
    ("prepare_model", "  prepare: model (pause + drain)", "the policy model's pause call, plus its drain poll if it was "
     "still draining (`ParticipantReply.seconds`)"),
    ("prepare_agent", "  prepare: agents (slowest)", "the slowest agent's prepare: parks every rollout at its next "
     f"boundary (a turn end, or a turn's model answer: `pending_model`); at most {MAX_OPEN_CALLS} turns per agent "
     "are in progress, the others park at once"),
    ("prepare_resource", "  prepare: resources (slowest)", "the slowest resources server's prepare: closes admission "
     "and exports every bound session"),
    ("begin", "begin draft", "`SnapshotStore.begin()` and the draft's `gym/` folder as `checkpoint_dir`"),
    ("commit", "commit (whole step)", "`NemoGym.commit_checkpoint`: every agent's `commit` at once, then the policy "
     "model's (given every agent's continuation index), then every resources server's at once; Gym's files are "
     "written into `checkpoint_dir`"),
    ("commit_agent", "  commit: agents (slowest)", "the slowest agent commit: its boundary archive, "
     "`agent-index.jsonl`, `continuations.jsonl`, `manifest.json`"),
    ("commit_model", "  commit: model", "the policy model's commit: reads every agent's continuation index and writes "
     "one lineage file per capture key (all N rollouts: one server), `storage-references.jsonl`, `manifest.json`"),
    ("commit_resource", "  commit: resources (slowest)", "the slowest resources commit: a session file per "
     "exported session and `manifest.json`"),
    ("resume", "resume (whole step)", "`NemoGym.resume_checkpoint`: every resources server at once, then the model, "
     "then every agent at once (releasing the parked rollouts); dispatch reopens"),
    ("pause_total", "total pause (prepare start -> resume end)", "wall time of every row above: the pause in the "
     "controller's default order (`ControllerConfig.write_mode` `background`), where Gym is resumed once its files "
     "are committed and adoption and publish follow while the rollouts run"),
    ("adopt", "after the resume: adopt Gym's files", "`gym_parts.adopt_commit`: check each participant's "
     "`manifest.json` against the bytes, hash the files in place and write a part manifest per participant"),
    ("publish", "after the resume: publish", "`draft.publish`: the snapshot manifest and the create-only commit "
     "record"),
    ("until_published", "prepare start -> snapshot published", "the pause, then adopt and publish (these two "
     "share the cores with the resumed rollouts, so each takes longer than it would inside the pause)"),
    ("bare_files", "baseline: Gym's files with bare os calls", "the last snapshot's Gym files (same folders, count "
     "and sizes) written by one process with plain `os` calls as CONTROL §6 asks (temp, write, fsync, rename on "
     f"{FLOOR_THREADS} threads, each folder fsynced once), no servers: the disk's cost of the files a commit must "
     "write, measured after the pauses in the same run (median of as many repeats as pauses)"),
    ("restore", "restore (whole step)", "`NemoGym.restore_checkpoint` on fresh servers: the model (reads its ledger "
     "folder, fences tombstones and source attempts), then every agent at once (each parked rollout becomes the "
     "continuation of attempt n+1), then every resources server at once (sessions as attempt n+1)"),
    ("restore_model", "  restore: model", "the model's restore call"),
    ("restore_agent", "  restore: agents (slowest)", "the slowest agent's restore call"),
    ("restore_resource", "  restore: resources (slowest)", "the slowest resources server's restore call"),
    ("resume_after_restore", "resume after restore", "`NemoGym.resume_checkpoint` after the restore"),
    ("restore_total", "total restore (open snapshot -> resume end)",
     "`store.open` + `gym_parts.restore_dir` + restore + resume (fresh servers already running, discovered)"),
]


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] scale: {msg}", flush=True)


def repeats_for(n: int, quick: bool) -> int:
    if quick:
        return 1
    return LARGE_REPEATS if n >= LARGE_N else FULL_REPEATS


# -- the deployment ----------------------------------------------------------------------------------
@dataclass
class Deployment:
    """One policy model host and the host processes of the agent + resources pairs."""

    hosts: list[MultiHost]
    urls: dict[str, str]  # server name -> URL (Gym's config keys = capability names)
    agents: list[str]

    def kill(self) -> None:
        for h in self.hosts:
            h.kill()


def deploy(workdir: Path, token_file: Path, servers: int, tag: str) -> Deployment:
    """Start the policy model (its own process), then ``servers`` agent + resources pairs spread over
    at most :data:`MAX_HOSTS` processes; return once every server listens."""
    model = launch(HostSpec(token_file=str(token_file), model=ModelSpec(name="policy0", slow_ms=MODEL_SLOW_MS)),
                   workdir, f"{tag}-model")
    hosts = [model]
    try:
        model.wait_ready()
        model_url = model.servers["policy0"]
        width = len(str(servers - 1))
        pairs = [PairSpec(agent=f"agent{i:0{width}d}", resource=f"tools{i:0{width}d}") for i in range(servers)]
        n_hosts = min(MAX_HOSTS, servers)
        for h in range(n_hosts):
            hosts.append(launch(HostSpec(token_file=str(token_file), model_url=model_url, pairs=pairs[h::n_hosts]),
                                workdir, f"{tag}-host{h}"))
        for h in hosts[1:]:
            h.wait_ready()
    except BaseException:
        for h in hosts:
            h.kill()
        raise
    urls = {name: url for h in hosts for name, url in h.servers.items()}
    return Deployment(hosts=hosts, urls=urls, agents=[p.agent for p in pairs])


async def start_rollouts(dep: Deployment, n: int, tag: str, http: httpx.AsyncClient) -> None:
    """Start ``n`` rollouts spread evenly over the agents (batch starts), then wait (bounded) until
    each has finished its first turn; none may end before the snapshot."""
    per_agent: dict[str, list[dict[str, Any]]] = {a: [] for a in dep.agents}
    for i in range(n):
        per_agent[dep.agents[i % len(dep.agents)]].append(
            {"rollout_id": f"{tag}r{i}", "seed": i, "turns": TURNS, "tools": ["notes"]})
    sem = asyncio.Semaphore(START_PARALLEL)

    async def send(agent: str, batch: list[dict[str, Any]]) -> None:
        async with sem:
            resp = await http.post(f"{dep.urls[agent]}/rollouts/batch", json={"rollouts": batch, "prime": True}, timeout=120)
        if resp.status_code != 202:
            raise RuntimeError(f"{agent}: batch start answered {resp.status_code}: {resp.text[:300]}")

    await asyncio.gather(*(send(a, specs[i:i + MAX_BATCH]) for a, specs in per_agent.items()
                           for i in range(0, len(specs), MAX_BATCH)))
    bound = max(120.0, SETUP_S_PER_ROLLOUT * n)
    end = time.monotonic() + bound
    async def progress(agent: str) -> dict[str, int]:
        # A busy host may drop a kept-alive connection as it is reused (ReadError): asked again, bounded.
        for attempt in range(PROGRESS_ATTEMPTS):
            try:
                return (await http.get(f"{dep.urls[agent]}/rollouts/progress", timeout=60)).json()
            except httpx.TransportError:
                if attempt + 1 == PROGRESS_ATTEMPTS:
                    raise
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    while True:
        got = await asyncio.gather(*(progress(a) for a in dep.agents))
        if any(g["running"] != g["rollouts"] for g in got):
            raise RuntimeError(f"a rollout ended before the snapshot: {got}")
        past = sum(g["running_past_first_turn"] for g in got)
        if sum(g["rollouts"] for g in got) == n and past == n:
            return
        if time.monotonic() > end:
            raise TimeoutError(f"after {bound:.0f} s only {past}/{n} rollouts are past their first turn")
        await asyncio.sleep(0.5)


def processes_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) the live processes ``pids`` have used so far, from
    ``/proc/<pid>/stat``; a process that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / CLOCK_TICKS


class Laps:
    """Step times of one pause or restore, each from the end of the step before: ``lap(key)`` records
    the step that just ended; ``slowest_of`` also records the slowest server of each component inside
    it (``<key>_model``, ``<key>_agent``, ``<key>_resource``); ``total`` also records the time since
    the first step began. ``servers_cpu`` (CPU seconds the servers used so far): each step's CPU
    seconds go into :attr:`cpu`, the servers' as ``<key>_servers`` and the driver's (this process:
    the actor's fan-out, and adoption and publish) as ``<key>_driver``."""

    def __init__(self, servers_cpu: Callable[[], float] | None = None) -> None:
        self.times: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._servers_cpu = servers_cpu
        self._start = self._last = time.perf_counter()
        self._cpu_start = self._cpu_last = self._cpu_now()

    def _cpu_now(self) -> tuple[float, float]:
        return (self._servers_cpu() if self._servers_cpu is not None else 0.0), time.process_time()

    def lap(self, key: str, *, slowest_of: StepResult | None = None, total: str | None = None) -> None:
        now = time.perf_counter()
        self.times[key] = now - self._last
        self._last = now
        if self._servers_cpu is not None:
            cpu = self._cpu_now()
            for i, whose in enumerate(("servers", "driver")):
                self.cpu[f"{key}_{whose}"] = cpu[i] - self._cpu_last[i]
                if total is not None:
                    self.cpu[f"{total}_{whose}"] = cpu[i] - self._cpu_start[i]
            self._cpu_last = cpu
        if slowest_of is not None:
            for suffix, component in (("model", MODELS), ("agent", AGENTS), ("resource", RESOURCES)):
                self.times[f"{key}_{suffix}"] = _slowest(slowest_of, component)
        if total is not None:
            self.times[total] = now - self._start


def _slowest(step: StepResult, component: str) -> float:
    return max((p.seconds for p in step.of(component)), default=0.0)


def _median_cpu(pauses: list[dict[str, float]]) -> dict[str, float]:
    """Each step's median CPU seconds over ``pauses`` (:attr:`Laps.cpu` of each)."""
    return {k: statistics.median(c[k] for c in pauses) for k in pauses[0]} if pauses else {}


def _part_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def pause_once(gym: NemoGym, store: SnapshotStore, store_root: Path, fingerprint: str, ck: str,
                     staging: Path | None = None, servers_cpu: Callable[[], float] | None = None
                     ) -> tuple[dict[str, float], dict[str, float], dict[str, int], Any, Any]:
    """One checkpoint of the running deployment through ``gym``, every step timed; returns the times,
    the CPU seconds of each step (:class:`Laps`; empty without ``servers_cpu``), the servers' counts,
    the published snapshot and Gym's parts. ``staging``: Gym commits into a staging folder there
    (``ControllerConfig.gym_staging`` ``"always"``), which adoption copies into the draft and which is
    removed after publish (not timed); None: into the draft's ``gym/``."""
    laps = Laps(servers_cpu)
    deadline = time.time() + DEADLINE_S
    prep = await gym.prepare_checkpoint(ck, deadline)
    laps.lap("prepare", slowest_of=prep)
    draft = store.begin()
    cdir = gym_parts.save_dir(draft, None if staging is None else str(staging), always_stage=staging is not None)
    laps.lap("begin")
    commit = await gym.commit_checkpoint(ck, deadline, cdir.path)
    laps.lap("commit", slowest_of=commit)
    # The controller's default order (ControllerConfig.write_mode "background"): Gym's files are
    # committed and Gym resumed; adoption and publish follow while the rollouts run again.
    await gym.resume_checkpoint(ck, deadline)
    laps.lap("resume", total="pause_total")
    parts = await asyncio.to_thread(gym_parts.adopt_commit, draft, cdir, commit)
    laps.lap("adopt")
    published = await asyncio.to_thread(draft.publish, receipts=parts.receipts, gym_commit=parts.gym_commit,
                                        topology_fingerprint=manifest_fingerprint(fingerprint))
    laps.lap("publish", total="until_published")
    cdir.cleanup()
    times = laps.times
    counts = {
        "agent_servers": len(commit.of(AGENTS)),
        "resources_servers": len(commit.of(RESOURCES)),
        "prepare_agent_parked": _total(prep, AGENTS, "parked"),
        "prepare_agent_running": _total(prep, AGENTS, "running"),
        "prepare_resource_sessions": _total(prep, RESOURCES, "sessions"),
        "agent_prepare_calls": sum(prep.agent_prepare_attempts.values()),
        "agent_commit_parked": _total(commit, AGENTS, "records"),
        "model_commit_rollouts": _total(commit, MODELS, "rollouts"),
        "model_commit_calls": _total(commit, MODELS, "rows"),
        "resource_commit_sessions": _total(commit, RESOURCES, "sessions"),
        "snapshot_bytes": _part_bytes(store_root / layout.snapshot_dir(published.manifest.snapshot_id)),
    }
    return times, laps.cpu, counts, published, parts


async def restore_once(dep: Deployment, token: str, store: SnapshotStore, published: Any, parts: Any,
                       fingerprint: str, source_ck: str, rid: str, restore_order: RestoreOrder = "nemo_rl"
                       ) -> tuple[dict[str, float], dict[str, int]]:
    """Restore ``published`` into the fresh deployment ``dep`` (in ``restore_order``) and resume it,
    every step timed."""
    gym = NemoGym(dep.urls, token, control_timeout_s=DEADLINE_S, restore_order=restore_order)
    try:
        again = await gym.discover_checkpoint_capabilities()
        if again.fingerprint != fingerprint:
            raise RuntimeError("the fresh servers' topology differs from the snapshot's")
        deadline = time.time() + DEADLINE_S
        laps = Laps()
        snap = store.open(published.manifest.sequence)
        rdir = gym_parts.restore_dir(snap, [p.part_prefix for p in parts.gym_commit.participants if p.part_prefix])
        laps.lap("open")
        restored = await gym.restore_checkpoint(rid, deadline, rdir.path, source_checkpoint_id=source_ck)
        laps.lap("restore", slowest_of=restored)
        await gym.resume_checkpoint(rid, deadline)
        laps.lap("resume_after_restore", total="restore_total")
        times = {k: v for k, v in laps.times.items() if k != "open"}  # open: inside restore_total only
    finally:
        await gym.close()
    counts = {
        "agent_restore_continuations": _total(restored, AGENTS, "records"),
        "model_restore_rollouts": _total(restored, MODELS, "rollouts"),
        "model_restore_calls": _total(restored, MODELS, "rows"),
        "resource_restore_sessions": _total(restored, RESOURCES, "sessions"),
    }
    return times, counts


def _pause_line(times: dict[str, float]) -> str:
    return (f"{times['pause_total'] * 1e3:,.0f} ms (prepare {times['prepare'] * 1e3:,.0f}, commit "
            f"{times['commit'] * 1e3:,.0f}, resume {times['resume'] * 1e3:,.0f}; then adopt "
            f"{times['adopt'] * 1e3:,.0f}, publish {times['publish'] * 1e3:,.0f})")


def gym_file_sizes(published: Any) -> dict[str, int]:
    """Each Gym file of a published snapshot (its path under ``gym/``) and its size; part manifests
    (ours, not Gym's) left out. The manifest lists Gym's parts by their part manifests (SPEC §10.4):
    the snapshot reads them."""
    return {f.path: f.size for f in open_snapshot(published.url).files(GYM_FILE_KIND)}


def bare_files(root: Path, sizes: dict[str, int], threads: int = FLOOR_THREADS) -> float:
    """The baseline of a commit's files: write ``sizes`` (relative path -> bytes) under the new folder
    ``root`` with plain ``os`` calls, as CONTROL §6 asks of every file (temp, write, fsync, rename, on
    ``threads`` threads; then each folder fsynced once), and return the seconds taken. The folders
    are created first, not timed."""
    folders = sorted({(root / rel).parent for rel in sizes})
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    payload = memoryview(os.urandom(max(sizes.values(), default=0)))

    def one(item: tuple[str, int]) -> None:
        path = root / item[0]
        tmp = path.parent / f".tmp-{path.name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = payload[:item[1]]
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    t = time.perf_counter()
    if threads == 1:  # on the calling thread, as DurableFiles does: a pool of one hands off every file
        for item in sizes.items():
            one(item)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, sizes.items()))
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def _total(step: StepResult, component: str, attr: str) -> int:
    return sum(getattr(p.reply, attr) for p in step.of(component))


async def measure_point(workdir: Path, token: str, token_file: Path, store_root: Path, servers: int, n: int,
                        repeats: int, tag: str, log: Log, budget_s: float | None = None,
                        actor_pool: int | None = None, staging: Path | None = None,
                        alongside: bool = False, restore_concurrent: bool = False) -> dict[str, Any]:
    """One (servers, rollouts) point: one set-up (not timed), ``repeats`` checkpoints of the live
    rollouts (resumed in between, each running on for :data:`RUN_BETWEEN_S`), then every host
    SIGKILLed and ``repeats`` restores of the last snapshot, each on freshly started servers.
    ``staging`` (the staging lever): each repeat pauses twice, Gym committing into the draft, then
    into a staging folder under ``staging``; both are reported, and the bare-files baseline is
    measured in both places. ``alongside`` (the commit-order lever, with ``staging``): each repeat
    also pauses staged through an actor whose fleet commits the resources servers alongside the
    agents and the model (``commit_order="resources_alongside"``); the two staged pauses swap places
    every repeat, so neither always follows the other. ``restore_concurrent`` (the restore-order
    lever): each restore repeat restores twice, each time on fresh servers, in NeMo-RL's order and
    with every participant at once (``restore_order="concurrent"``), the two swapping places every
    repeat."""
    if alongside and staging is None:
        raise ValueError("the commit-order lever (alongside) is measured on staged pauses: give staging too")
    store = SnapshotStore(str(store_root))
    t_setup = time.perf_counter()
    dep = deploy(workdir, token_file, servers, tag)
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as http:
            await start_rollouts(dep, n, tag, http)
        setup_s = time.perf_counter() - t_setup
        over = _budget(budget_s)
        log(f"S={servers} N={n:,}: {len(dep.hosts)} host processes, every rollout past its first turn after "
            f"{setup_s:.0f} s (not timed)")
        gym = NemoGym(dep.urls, token, control_timeout_s=DEADLINE_S, connections=actor_pool)
        # staged pauses: variant -> (its actor, each pause's times, counts and CPU seconds)
        variants: dict[str, tuple[NemoGym, list[tuple[dict[str, float], dict[str, int], dict[str, float]]]]] = {}
        if staging is not None:
            variants["staged"] = (gym, [])
        if alongside:
            variants["alongside"] = (NemoGym(dep.urls, token, control_timeout_s=DEADLINE_S, connections=actor_pool,
                                             commit_order="resources_alongside"), [])
        pauses: list[tuple[dict[str, float], dict[str, int]]] = []
        cpu_draft: list[dict[str, float]] = []  # CPU seconds of each pause's steps
        host_pids = [h.pid for h in dep.hosts]

        def servers_cpu() -> float:
            return processes_cpu_s(host_pids)

        pause_failures: list[str] = []
        try:
            topology = await gym.discover_checkpoint_capabilities()  # once, before the pauses (as the controller)
            if alongside:
                await variants["alongside"][0].discover_checkpoint_capabilities()
            for rep in range(repeats):
                if rep and over(0.5):
                    log(f"S={servers} N={n:,}: {rep} pause(s) used half the point's {budget_s:.0f} s budget: no more")
                    break
                if rep:
                    await asyncio.sleep(RUN_BETWEEN_S)  # the resumed rollouts run on: a live system is paused
                ck_try = f"scale-{tag}-{rep}"
                this_rep: dict[str, tuple[dict[str, float], dict[str, int], dict[str, float]]] = {}
                try:
                    times, cpu_s, counts, published, parts = await pause_once(
                        gym, store, store_root, topology.fingerprint, ck_try,
                        servers_cpu=servers_cpu)
                    ck = ck_try  # the checkpoint of the snapshot the restores take, as soon as it is published
                    ck_counts = counts  # and its pause's counts
                    for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                        await asyncio.sleep(RUN_BETWEEN_S)
                        v_times, v_cpu, v_counts, published, parts = await pause_once(
                            variants[name][0], store, store_root, topology.fingerprint, f"{ck_try}-{name}", staging,
                            servers_cpu=servers_cpu)
                        ck, ck_counts = f"{ck_try}-{name}", v_counts
                        this_rep[name] = (v_times, v_counts, v_cpu)
                except Exception as exc:  # the pauses measured so far still count
                    if not pauses:
                        raise
                    pause_failures.append(f"pause {rep + 1}: {type(exc).__name__}: {exc}"[:600])
                    log(f"S={servers} N={n:,} {pause_failures[-1]}; restoring the last published snapshot")
                    break
                pauses.append((times, counts))
                cpu_draft.append(cpu_s)
                log(f"S={servers} N={n:,} pause {rep + 1}/{repeats}: {_pause_line(times)}; servers' CPU in the "
                    f"pause {cpu_s['pause_total_servers']:.2f} s; parked {counts['agent_commit_parked']:,}/{n:,}")
                for name, (v_times, v_counts, v_cpu) in this_rep.items():
                    variants[name][1].append((v_times, v_counts, v_cpu))
                    log(f"S={servers} N={n:,} pause {rep + 1}/{repeats}, {name} in {staging}: "
                        f"{_pause_line(v_times)}; servers' CPU in the pause {v_cpu['pause_total_servers']:.2f} s")
        finally:
            await gym.close()
            if alongside:
                await variants["alongside"][0].close()
    finally:
        dep.kill()  # the crash: every server of every host, SIGKILL
    staged = [(t, c) for t, c, _ in variants["staged"][1]] if staging is not None else []
    # The disk's share: the same files with bare os calls, once per pause, into fresh folders as the
    # pauses wrote theirs (none removed in between: removals on this disk slow the creates after them).
    sizes = gym_file_sizes(published)
    floors = [bare_files(store_root.parent / f"bare-{tag}-{i}", sizes) for i in range(len(pauses))]
    for i in range(len(pauses)):
        shutil.rmtree(store_root.parent / f"bare-{tag}-{i}", ignore_errors=True)
    log(f"S={servers} N={n:,} baseline: {len(sizes):,} Gym files with bare os calls: "
        + ", ".join(f"{x * 1e3:,.0f}" for x in floors) + " ms")
    staged_floors = []
    if staging is not None:  # the same files in the staging folder's file system
        for i in range(len(staged)):
            folder = Path(tempfile.mkdtemp(prefix=f"bare-{tag}-", dir=staging))
            try:
                staged_floors.append(bare_files(folder, sizes, writer_threads(folder)))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        log(f"S={servers} N={n:,} baseline in {staging}: " + ", ".join(f"{x * 1e3:,.0f}" for x in staged_floors)
            + " ms")
    orders: list[RestoreOrder] = ["nemo_rl", "concurrent"] if restore_concurrent else ["nemo_rl"]
    by_order: dict[str, list[tuple[dict[str, float], dict[str, int]]]] = {o: [] for o in orders}
    restart_s: list[float] = []
    failures: list[str] = []
    rep = attempt = 0
    while rep < len(pauses) and attempt < len(pauses) * len(orders) + MAX_RESTORE_FAILURES:
        if rep and over(1.0):
            log(f"S={servers} N={n:,}: {rep} restore(s) used the point's {budget_s:.0f} s budget: no more")
            break
        failed = False
        for order in (orders if rep % 2 == 0 else orders[::-1]):
            if len(by_order[order]) > rep:  # restored in an earlier try of this repeat
                continue
            attempt += 1
            t = time.perf_counter()
            fresh = deploy(workdir, token_file, servers, f"{tag}-fresh{attempt}")
            restart_s.append(time.perf_counter() - t)
            try:
                times, counts = await restore_once(fresh, token, store, published, parts, topology.fingerprint, ck,
                                                   f"restore-{tag}-{attempt}", order)
            except Exception as exc:  # noqa: BLE001 - recorded, and tried again on fresh servers (bounded)
                died = [h.pid for h in fresh.hosts if h.popen.poll() is not None]
                failures.append(f"restore attempt {attempt} ({order}): {type(exc).__name__}: {exc}"[:600]
                                + (f" (host processes {died} had died)" if died else ""))
                log(f"S={servers} N={n:,} restore attempt {attempt} failed: {failures[-1]}")
                failed = True
                break
            finally:
                fresh.kill()
            by_order[order].append((times, counts))
            log(f"S={servers} N={n:,} restore {rep + 1}/{len(pauses)}"
                f"{'' if order == 'nemo_rl' else f', {order}'}: {times['restore_total'] * 1e3:,.0f} ms (restore "
                f"{times['restore'] * 1e3:,.0f}, resume {times['resume_after_restore'] * 1e3:,.0f}); continuations "
                f"{counts['agent_restore_continuations']:,}/{n:,}")
        if not failed:
            rep += 1
    restores = by_order["nemo_rl"]
    if not restores:
        raise RuntimeError(f"no restore succeeded: {'; '.join(failures)}")
    median = {k: statistics.median(t[k] for t, _ in (pauses if k in pauses[0][0] else restores))
              for k, _, _ in PHASES if k != "bare_files"} | {"bare_files": statistics.median(floors)}
    return {
        "servers": servers, "n": n, "repeats": len(pauses), "restore_repeats": len(restores), "hosts": len(dep.hosts),
        "pauses": [{"times_s": t, "counts": c, "cpu_s": u} for (t, c), u in zip(pauses, cpu_draft, strict=True)],
        "median_cpu_s": _median_cpu(cpu_draft),
        "restores": [{"times_s": t, "counts": c} for t, c in restores],
        "bare_files_s": floors, "gym_files": len(sizes), "gym_file_bytes": sum(sizes.values()),
        "median_s": median,
        "median_bytes": statistics.median(c["snapshot_bytes"] for _, c in pauses),
        # the pause's that published the snapshot the restores took (the last one)
        "counts": ck_counts | restores[-1][1] | {"requested": n},
        "setup_s": round(setup_s, 1), "restart_s": [round(x, 1) for x in restart_s], "restore_failures": failures, "pause_failures": pause_failures,
        "staged": None if staging is None else _variant(variants["staged"][1], staged_floors) | {
            "root": str(staging), "filesystem": common.filesystem(staging)},
        "alongside": _variant(variants["alongside"][1]) if alongside else None,
        "restore_concurrent": _restore_variant(by_order["nemo_rl"], by_order["concurrent"]) if restore_concurrent
        else None,
    }


def _restore_variant(nemo_rl: list[tuple[dict[str, float], dict[str, int]]],
                     concurrent: list[tuple[dict[str, float], dict[str, int]]]) -> dict[str, Any]:
    """The restore-order lever's results: each concurrent restore's times and counts, their medians,
    and the paired ratio (concurrent / NeMo-RL's order, within each repeat) of the whole restore."""
    pairs = list(zip(nemo_rl, concurrent, strict=False))
    return {"restores": [{"times_s": t, "counts": c} for t, c in concurrent],
            "median_s": {k: statistics.median(t[k] for t, _ in concurrent) for k in concurrent[0][0]} if concurrent
            else {},
            "paired_ratio_restore_total": statistics.median(
                c["restore_total"] / a["restore_total"] for (a, _), (c, _) in pairs) if pairs else None}


def _variant(measured: list[tuple[dict[str, float], dict[str, int], dict[str, float]]],
             floors: list[float] | None = None) -> dict[str, Any]:
    """One kind of staged pause's results: each pause's times, counts and CPU seconds, and the medians
    (with the bare-files baseline's, given its ``floors``)."""
    median = {k: statistics.median(t[k] for t, _, _ in measured) for k in measured[0][0]}
    return {"pauses": [{"times_s": t, "counts": c, "cpu_s": u} for t, c, u in measured],
            "median_cpu_s": _median_cpu([u for _, _, u in measured]),
            "median_s": median | ({"bare_files": statistics.median(floors)} if floors else {})}


def ram_staging() -> Path | None:
    """The staging lever's folder: ``/dev/shm`` when it is a writable RAM-backed (tmpfs) mount, else
    None (the lever is then not measured)."""
    shm = Path("/dev/shm")
    mount = mount_of(shm)
    return shm if shm.is_dir() and os.access(shm, os.W_OK) and mount is not None and mount.in_memory else None


def _budget(budget_s: float | None) -> Callable[[float], bool]:
    """``over(fraction)``: whether ``fraction`` of ``budget_s`` has passed since this call."""
    start = time.monotonic()
    return lambda fraction: budget_s is not None and time.monotonic() - start > fraction * budget_s


def run(points: tuple[tuple[int, int], ...] = FULL_POINTS, quick: bool = False, log: Log | None = None,
        workdir: Path | None = None, repeats: int | None = None, actor_pool: int | None = None,
        staging: Path | None = None, budget_s: float = LARGE_BUDGET_S, alongside: bool = False,
        restore_concurrent: bool = False) -> dict[str, Any]:
    """Measure every (agent servers, rollouts) point; returns the results (JSON-able; see ``markdown``).
    ``actor_pool``: the NemoGym actor's HTTP pool size (default: sized to the servers). ``staging``:
    also pause with Gym's files staged there (see :func:`measure_point`; :func:`ram_staging` is the
    RAM-backed default); ``alongside``: also pause staged with the resources servers committing
    alongside (the commit-order lever; needs ``staging``); ``restore_concurrent``: also restore with
    every participant at once (the restore-order lever). ``budget_s``: a point of :data:`LARGE_N` rollouts or more stops repeating
    once its pauses used half of it (its restores, all of it)."""
    if not points or any(s < 1 or n < s for s, n in points):
        raise ValueError(f"points: {points!r} (expected (servers >= 1, rollouts >= servers))")
    log = log or _say
    started = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="scale-bench-", dir=workdir))
    token = secrets.token_urlsafe(24)
    token_file = tmp / "token"
    token_file.write_text(token)
    per_point: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    try:
        for servers, n in points:
            reps = repeats if repeats is not None else repeats_for(n, quick)
            budget = budget_s if n >= LARGE_N and not quick else None
            try:
                per_point.append(asyncio.run(measure_point(tmp / "hosts", token, token_file,
                                                           tmp / f"store-{servers}-{n}", servers, n, reps,
                                                           f"s{servers}n{n}", log, budget, actor_pool, staging,
                                                           alongside, restore_concurrent)))
            except Exception as exc:  # noqa: BLE001 - reported; the other points still count
                # What the host processes said (a host that died leaves its traceback there).
                said = [f"{log_path.name}: {' | '.join(tail)}" for log_path in sorted((tmp / "hosts").glob("*.log"))
                        if (tail := log_path.read_text(errors="replace").strip().splitlines()[-6:])]
                log(f"S={servers} N={n:,} failed: {type(exc).__name__}: {exc}; host logs: {said}")
                failed.append({"servers": servers, "n": n, "error": f"{type(exc).__name__}: {exc}"[:2000],
                               "host_logs": [x[:1500] for x in said[:10]]})
            shutil.rmtree(tmp / f"store-{servers}-{n}", ignore_errors=True)
            if workdir is not None:  # what is measured so far survives a crash of a later point
                (workdir / "scale-partial.json").write_bytes(msgspec.json.encode(
                    {"per_point": per_point, "failed": failed}))
        if workdir is not None:  # every point ended: the report has it all
            (workdir / "scale-partial.json").unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "points": [list(p) for p in points], "quick": quick, "turns": TURNS, "model_slow_ms": MODEL_SLOW_MS,
        "agent_open_calls": MAX_OPEN_CALLS, "max_hosts": MAX_HOSTS, "run_between_s": RUN_BETWEEN_S,
        "staging": None if staging is None else str(staging), "alongside": alongside,
        "restore_concurrent": restore_concurrent,
        "phases": [{"key": k, "label": label, "includes": what} for k, label, what in PHASES],
        "per_point": per_point, "failed": failed,
        "machine": {"cores": os.cpu_count(), "load_average_start": load_start,
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


# -- the report --------------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    if s is None:  # a step a result of an older benchmark did not measure
        return "–"
    ms = s * 1e3
    return f"{ms:.1f}" if ms < 100 else f"{ms:,.0f}"


def verdicts(result: dict[str, Any]) -> list[str]:
    """One line per target of the issue that a measured point covers."""
    out = []
    for p in result["per_point"]:
        key = (p["servers"], p["n"])
        m = p["median_s"]
        if key in TARGETS:
            target = TARGETS[key]
            ok = m["pause_total"] <= target
            out.append(f"- {p['n']:,} rollouts on {p['servers']} agent servers: pause {m['pause_total']:.2f} s against "
                       f"<= {target:g} s: **{'met' if ok else 'NOT met'}**.")
        ratio = m["restore_total"] / m["pause_total"] if m["pause_total"] else float("inf")
        if key in TARGETS or result["quick"]:
            out.append(f"- {p['n']:,} rollouts on {p['servers']} agent servers: restore {m['restore_total']:.2f} s = "
                       f"{ratio:.2f}x the pause, against <= {RESTORE_TARGET_RATIO:g}x: "
                       f"**{'met' if ratio <= RESTORE_TARGET_RATIO else 'NOT met'}**.")
        if (key in TARGETS or result["quick"]) and m.get("bare_files"):
            out.append(f"- {p['n']:,} rollouts on {p['servers']} agent servers: the commit took {m['commit']:.2f} s = "
                       f"{m['commit'] / m['bare_files']:.2f}x the same {p['gym_files']:,} Gym files "
                       f"({p['gym_file_bytes'] / 1e6:.1f} MB) written with bare os calls ({m['bare_files']:.2f} s); "
                       f"the pause is {m['pause_total'] / m['bare_files']:.2f}x them.")
    return out


#: The rows of the staging lever's table (keys of PHASES), in order.
STAGED_ROWS = ("prepare", "commit", "commit_agent", "commit_model", "commit_resource", "resume", "pause_total",
               "adopt", "publish", "until_published", "bare_files")


def staged_lines(result: dict[str, Any]) -> list[str]:
    """The staging lever's section: each point's pause with Gym's files committed into the draft
    against the same repeats' pause with them staged (``ControllerConfig.gym_staging`` ``"always"``);
    empty when the run did not measure it."""
    pts = sorted((p for p in result["per_point"] if p.get("staged")), key=lambda p: (p["n"], p["servers"]))
    if not pts:
        return []
    labels = {k: label for k, label, _ in PHASES}
    where = pts[0]["staged"]
    lines = [
        "## Lever: Gym's files staged in RAM (`ControllerConfig.gym_staging`)",
        "",
        f"Each repeat paused twice, 1 s apart, on the same live rollouts: Gym committing into the draft's `gym/` "
        f"folder on the store's disk (the default for a local store), then into a staging folder under "
        f"`{where['root']}` (device and file system: {where['filesystem']}), which adoption copies into the draft after the resume "
        f"(`gym_staging=\"always\"`). Gym writes and fsyncs every file either way (CONTROL §6); in RAM the "
        f"fsync costs nothing, and the store's own writes (fsynced) make the copy durable before publish. "
        f"The baseline rows write the same files with bare os calls in each place, on as many threads as "
        f"Gym's writer uses there (`snapformat.gym_dir.writer_threads`: {FLOOR_THREADS} on disk, one in RAM, "
        f"where an fsync writes nothing and more threads only contend). Medians (ms) of the same repeats.",
        "",
        "| step | " + " | ".join(f"{p['servers']} srv, {p['n']:,}: draft | staged" for p in pts) + " |",
        "|---|" + "---:|---:|" * len(pts),
    ]
    for key in STAGED_ROWS:
        label = labels[key].strip()
        bold = "**" if key.endswith("_total") else ""
        cells = " | ".join(f"{_ms(p['median_s'].get(key))} | {_ms(p['staged']['median_s'].get(key))}" for p in pts)
        lines.append(f"| {bold}{'↳ ' if labels[key].startswith('  ') else ''}{label}{bold} | {cells} |")
    lines.append("")
    for p in pts:
        d, st = p["median_s"], p["staged"]["median_s"]
        target = TARGETS.get((p["servers"], p["n"]))
        verdict = "" if target is None else (f" Against the target of <= {target:g} s: "
                                             f"**{'met' if st['pause_total'] <= target else 'NOT met'}**.")
        ratio = d["restore_total"] / st["pause_total"]  # the restores took the last, staged, snapshot
        lines.append(f"- ({p['servers']}, {p['n']:,}): staged, the pause is {st['pause_total']:.2f} s = "
                     f"{st['pause_total'] / d['pause_total']:.2f}x the pause into the draft ({d['pause_total']:.2f} s); "
                     f"the commit {st['commit']:.2f} s = {st['commit'] / st['bare_files']:.2f}x the same files "
                     f"with bare os calls there ({st['bare_files']:.2f} s).{verdict} The restore "
                     f"({d['restore_total']:.2f} s) is {ratio:.2f}x this pause, against <= {RESTORE_TARGET_RATIO:g}x: "
                     f"**{'met' if ratio <= RESTORE_TARGET_RATIO else 'NOT met'}**.")
    return lines + [""]


def _order_table(pts: list[dict[str, Any]], rows: tuple[str, ...], lever: str,
                 nemo_rl: Callable[[dict[str, Any]], dict[str, float]],
                 other: Callable[[dict[str, Any]], dict[str, float]]) -> list[str]:
    """An order lever's table: per point, the medians (ms) in NeMo-RL's order (``nemo_rl(point)``)
    beside those with the ``lever`` (``other(point)``), one row per key of ``rows``."""
    labels = {k: label for k, label, _ in PHASES}
    lines = ["| step | " + " | ".join(f"{p['servers']} srv, {p['n']:,}: NeMo-RL's order | {lever}" for p in pts) + " |",
             "|---|" + "---:|---:|" * len(pts)]
    for key in rows:
        bold = "**" if key.endswith("_total") else ""
        cells = " | ".join(f"{_ms(nemo_rl(p).get(key))} | {_ms(other(p).get(key))}" for p in pts)
        lines.append(f"| {bold}{'↳ ' if labels[key].startswith('  ') else ''}{labels[key].strip()}{bold} | {cells} |")
    return lines


#: The rows of the commit-order lever's table (keys of PHASES), in order.
ALONGSIDE_ROWS = ("prepare", "commit", "commit_agent", "commit_model", "commit_resource", "resume", "pause_total")


def alongside_lines(result: dict[str, Any]) -> list[str]:
    """The commit-order lever's section: each point's staged pause in NeMo-RL's commit order against
    the same repeats' staged pause with the resources servers committing alongside; empty when the
    run did not measure it."""
    pts = sorted((p for p in result["per_point"] if p.get("alongside")), key=lambda p: (p["n"], p["servers"]))
    if not pts:
        return []
    lines = [
        "## Lever: the resources servers commit alongside (`NemoGym(commit_order=\"resources_alongside\")`)",
        "",
        "Each repeat paused staged twice more, 1 s apart, on the same live rollouts, the two swapping places "
        "every repeat: once in NeMo-RL's commit order (agents, then the model, then the resources servers), once "
        "with the resources servers committing at the same time as the agents and then the model "
        "(`gymkit.gym_fleet.GymFleet`, `commit_order=\"resources_alongside\"`). CPU seconds are the servers'. "
        "Medians (ms) of the same repeats.",
        "",
        *_order_table(pts, ALONGSIDE_ROWS, "alongside", lambda p: p["staged"]["median_s"],
                      lambda p: p["alongside"]["median_s"]),
    ]
    cpu = " | ".join(f"{p['staged']['median_cpu_s'].get('commit_servers', 0.0) * 1e3:,.0f} | "
                     f"{p['alongside']['median_cpu_s'].get('commit_servers', 0.0) * 1e3:,.0f}" for p in pts)
    lines += [f"| commit: servers' CPU | {cpu} |", ""]
    for p in pts:
        st, al = p["staged"]["median_s"], p["alongside"]["median_s"]
        target = TARGETS.get((p["servers"], p["n"]))
        verdict = "" if target is None else (f" Against the target of <= {target:g} s: "
                                             f"**{'met' if al['pause_total'] <= target else 'NOT met'}**.")
        lines.append(f"- ({p['servers']}, {p['n']:,}): alongside, the commit is {al['commit']:.2f} s = "
                     f"{al['commit'] / st['commit']:.2f}x NeMo-RL's order ({st['commit']:.2f} s), and the pause "
                     f"{al['pause_total']:.2f} s = {al['pause_total'] / st['pause_total']:.2f}x "
                     f"({st['pause_total']:.2f} s).{verdict}")
    return lines + [""]


#: The steps of the CPU table, in order.
CPU_ROWS = ("prepare", "commit", "resume", "pause_total")


def cpu_lines(result: dict[str, Any]) -> list[str]:
    """Where the pause's CPU goes: each step's median wall time against the CPU seconds the servers'
    host processes and the driver used in it, and the cores that kept busy (CPU / wall, of the
    machine's). The staged pauses when the run measured them, else the pauses into the draft;
    empty for results from before the CPU was counted."""
    pts = sorted((p for p in result["per_point"] if p.get("median_cpu_s")), key=lambda p: (p["n"], p["servers"]))
    if not pts:
        return []
    cores = result["machine"]["cores"]
    labels = {k: label for k, label, _ in PHASES}

    def chosen(p: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
        st = p.get("staged")
        return (st["median_s"], st["median_cpu_s"]) if st and st.get("median_cpu_s") else (p["median_s"], p["median_cpu_s"])

    which = "staged" if any(p.get("staged") for p in pts) else "into the draft"
    lines = [
        "## Where the pause's CPU goes",
        "",
        f"Each step's median wall time against the CPU seconds (user + system, every thread, from "
        f"`/proc/<pid>/stat`) that the servers' host processes and the driver (the actor's fan-out, in this "
        f"process) used in it, medians of the same pauses ({which}). "
        f"Busy cores = (servers + driver) CPU / wall, of the machine's {cores}: a step that keeps every core busy "
        f"can only get shorter by doing less work, or by running on more cores.",
        "",
        "| step | " + " | ".join(f"{p['servers']} srv, {p['n']:,}: wall s | servers CPU s | driver CPU s | busy cores"
                                for p in pts) + " |",
        "|---|" + "---:|---:|---:|---:|" * len(pts),
    ]
    for key in CPU_ROWS:
        cells = []
        for p in pts:
            wall, cpu = chosen(p)
            servers, driver = cpu.get(f"{key}_servers", 0.0), cpu.get(f"{key}_driver", 0.0)
            busy = (servers + driver) / wall[key] if wall.get(key) else 0.0
            cells.append(f"{wall.get(key, 0.0):.2f} | {servers:.2f} | {driver:.2f} | {busy:.2f}")
        bold = "**" if key.endswith("_total") else ""
        lines.append(f"| {bold}{labels[key].strip()}{bold} | {' | '.join(cells)} |")
    return lines + [""]


def _counts_note(pts: list[dict[str, Any]]) -> str:
    """Which pause the table's commit columns come from."""
    staged = [p["staged"] for p in pts if p.get("staged")]
    if staged and not all(isinstance(st["pauses"][0], dict) and "counts" in st["pauses"][0] for st in staged):
        # runs before the staged pauses kept their counts
        return ("The commit columns are the last pause into the draft's; the restore columns are the restores of "
                "the staged snapshot published 1 s of rollouts later, so the model's calls differ.")
    return ("The commit columns are the last pause's (a staged one, with the staging lever); the restore columns "
            "are the restores of the snapshot that pause published.")


def markdown(result: dict[str, Any], plots: list[Path] | None = None) -> str:
    r = result
    pts = sorted(r["per_point"], key=lambda p: (p["n"], p["servers"]))
    reps = ", ".join(f"{p['repeats']} pauses / {p['restore_repeats']} restores at ({p['servers']}, {p['n']:,})"
                     for p in pts)
    head = "| step | " + " | ".join(f"{p['servers']} srv, {p['n']:,} (ms)" for p in pts) + " |"
    rule = "|---|" + "---:|" * len(pts)
    lines = [
        "# Scale benchmark: the pause and the restore at 10,000 and 100,000 parked rollouts",
        "",
        f"S agent servers, S resources servers (`notes`, export_restore, one per agent) and one policy model: the "
        f"unchanged `refgym` apps, hosted several per process by `devtools.gym_multihost` (the agent + resources "
        f"pairs spread over min(S, {r['max_hosts']}) processes, the model alone in one; every server its own port on "
        f"127.0.0.1). N rollouts of {r['turns']} turns, spread evenly over the agents, each run past its first turn "
        f"(model calls take {r['model_slow_ms']} ms; an agent runs at most {r['agent_open_calls']} turns at once). "
        f"Per point, one set-up (not timed), then R checkpoints of the live rollouts, each driven by "
        f"`coordinator.gym_actor.NemoGym` (in the benchmark's process, no Ray) through `gymkit.gym_fleet`'s fan-out and "
        f"resumed (the rollouts run on {r['run_between_s']:g} s between two; Gym's files are adopted and the snapshot "
        f"published after the resume, the controller's default `write_mode`), then the same Gym files written with "
        f"bare os calls (the baseline), then every host SIGKILLed, and R restores "
        f"of the last snapshot, each on freshly started servers (start not timed). Times on the driver with "
        f"`time.perf_counter`, HTTP included; local snapshot store. Medians of {reps}. Load average "
        f"{r['machine']['load_average_start']} at start, {r['machine']['load_average_end']} at the end (2 cores "
        f"shared with other work: noisy). Whole run {r['elapsed_s']:.0f} s{' (quick run)' if r['quick'] else ''}.",
        "",
        "Set-up (not timed): " + "; ".join(f"({p['servers']}, {p['n']:,}) {p['setup_s']:.0f} s on {p['hosts']} host "
                                           f"processes" for p in pts) + ".",
        "",
        "## Targets (issue 22 §2)",
        "",
        *(verdicts(r) or ["- (no point of the targets was measured in this run)"]),
        *[f"- ({f['servers']}, {f['n']:,}) **failed**: {f['error']}" for f in r.get("failed", [])],
        *[f"- ({p['servers']}, {p['n']:,}): {what}, not counted in the medians: {msg}" for p in pts
          for what, key in (("a pause failed", "pause_failures"), ("a restore failed", "restore_failures"))
          for msg in p.get(key, [])],
        "",
        "## The pause and the restore, step by step (median ms)",
        "",
        "Indented rows are the slowest server of a component inside the step above them (the step waits for it).",
        "",
        head,
        rule,
    ]
    for key, label, _ in PHASES:
        bold = "**" if key.endswith("_total") else ""
        cells = " | ".join(_ms(p["median_s"].get(key)) for p in pts)
        shown = f"↳ {label.strip()}" if label.startswith("  ") else label
        lines.append(f"| {bold}{shown}{bold} | {cells} |")
    lines += ["", *staged_lines(r), *alongside_lines(r), *restore_concurrent_lines(r), *cpu_lines(r), "## What the servers reported (last repeat of each point)", "",
              _counts_note(pts), "",
              "| servers | rollouts | parked at prepare | sessions exported | agent commit records | model commit "
              "rollouts / calls | resources commit sessions | agent restore continuations | model restore calls | "
              "resources restore sessions | snapshot MB |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in pts:
        c = p["counts"]
        lines.append(f"| {p['servers']} | {p['n']:,} | {c['prepare_agent_parked']:,} | "
                     f"{c['prepare_resource_sessions']:,} | {c['agent_commit_parked']:,} | "
                     f"{c['model_commit_rollouts']:,} / {c['model_commit_calls']:,} | "
                     f"{c['resource_commit_sessions']:,} | {c['agent_restore_continuations']:,} | "
                     f"{c['model_restore_calls']:,} | {c['resource_restore_sessions']:,} | "
                     f"{p['median_bytes'] / 1e6:.1f} |")
    lines += ["", "## What each step includes", ""]
    lines += [f"- **{label.strip()}**: {what}." for _, label, what in PHASES]
    lines += ["- Not timed: starting the host processes, starting the rollouts (`POST /rollouts/batch`) and waiting "
              "for every first turn (`GET /rollouts/progress`), discovery (`GET capabilities`, before the pause, as "
              "the controller does it once)."]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], results: Path) -> list[Path]:
    """``scale_pause.png``: pause and restore (and the largest steps) against parked rollouts."""
    pts = sorted(result["per_point"], key=lambda p: (p["n"], p["servers"]))
    if len(pts) < 2:
        return []
    xs = list(range(len(pts)))  # one tick per point: (1, 1,000) and (10, 1,000) share a rollout count
    series = [(label, xs, [p["median_s"].get(key) for p in pts], style) for key, label, style in (
        ("pause_total", "total pause", "o-"), ("restore_total", "total restore", "s--"),
        ("prepare", "prepare", "^:"), ("commit", "commit", "v:"), ("adopt", "adopt (after the resume)", "d:"),
        ("bare_files", "baseline: Gym's files, bare os calls", "x-."))]
    if any(p.get("staged") for p in pts):
        series.insert(1, ("total pause, Gym's files staged in RAM", xs,
                          [p["staged"]["median_s"]["pause_total"] if p.get("staged") else None for p in pts], "o--"))
    labels = [f"{p['n']:,} / {p['servers']} srv" for p in pts]
    path = common.plot(results / common.png_name("scale_pause", result["quick"]),
                       "Pause and restore vs parked rollouts (agent servers under each)",
                       "point (parked rollouts, agent servers)", "seconds", series, logx=False, xticks=xs,
                       xticklabels=labels)
    return [path]


async def agent_wave(rollouts: int) -> dict[str, Any]:
    """The reference agent alone (stand-in model and resources over httpx's mock transport, each answer
    after 5 ms): ``rollouts`` of 64 turns on one agent's turn slots. Returns how long until every one
    finished its first turn, the turns run meanwhile, how often the agent kit's change event was
    listened to, and how long parking every rollout took once the model refused calls (lever 1's
    measurement; run it on the old and the new ``refgym/agent_server.py``)."""
    from devtools.agent_stand_ins import ListenCounter, StandIns, stand_in_agent
    from refgym.api import StartRollout

    stand_ins = StandIns(delay_s=0.005)
    agent, executions = stand_in_agent(stand_ins)
    listens = ListenCounter(executions)
    t0 = time.perf_counter()
    for i in range(rollouts):
        agent.start(StartRollout(rollout_id=f"r{i}", seed=i, turns=TURNS))
    end = time.monotonic() + 600
    while not all(r.trajectory for r in agent.rollouts.values()) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    wave = time.perf_counter() - t0
    turns = sum(len(r.trajectory) for r in agent.rollouts.values())
    stand_ins.paused = True  # the model pauses first (NeMo-RL's order), then the agent is asked to park
    await asyncio.sleep(0.3)
    t1 = time.perf_counter()
    executions.request_park()
    status = await executions.wait_prepared(time.time() + 60)
    park = time.perf_counter() - t1
    await agent.close()
    return {"rollouts": rollouts, "first_turn_wave_s": round(wave, 2), "turns_in_wave": turns,
            "kit_listens": listens.count, "park_s": round(park, 3), "parked": status.parked}


async def agent_park_rounds(rollouts: int, rounds: int = 5) -> dict[str, Any]:
    """The reference agent alone (stand-in model and resources over httpx's mock transport), its
    ``rollouts`` parked and released ``rounds`` times, as a prepare and a resume do. Each round
    starts with every turn slot holding a model call and the other rollouts queued for a slot; the
    park (``request_park`` until ``wait_prepared``: the held calls answered, their turns end and
    park) is timed in wall and CPU seconds; the release (``reopen``, the agent's ``on_resume``, then
    0.3 s in which only the released rollouts run: their next model calls are held) in CPU seconds.
    Medians of the rounds (the parking lever's measurement; run it on the old and the new code)."""
    from devtools.agent_stand_ins import StandIns, stand_in_agent, start_rollouts, wait_until

    stand_ins = StandIns(hold=True)
    agent, executions = stand_in_agent(stand_ins)
    start_rollouts(agent, rollouts, TURNS)
    park_s: list[float] = []
    park_cpu_s: list[float] = []
    release_cpu_s: list[float] = []
    parked: list[int] = []
    for _ in range(rounds):
        # every slot holds a call; the other rollouts queue
        await wait_until(lambda: stand_ins.held >= MAX_OPEN_CALLS, f"{MAX_OPEN_CALLS} model calls held", 120)
        await asyncio.sleep(0.1)
        t, c = time.perf_counter(), time.process_time()
        executions.request_park()
        stand_ins.release.set()  # the calls in flight are answered; their turns end and park
        status = await executions.wait_prepared(time.time() + 60)
        park_s.append(time.perf_counter() - t)
        park_cpu_s.append(time.process_time() - c)
        parked.append(status.parked)
        stand_ins.release.clear()  # the released rollouts' next calls wait: the window below is the release
        c = time.process_time()
        executions.reopen()
        await agent.on_resume()
        await asyncio.sleep(0.3)
        release_cpu_s.append(time.process_time() - c)
    stand_ins.release.set()
    await agent.close()
    return {"rollouts": rollouts, "rounds": rounds, "park_s": round(statistics.median(park_s), 4),
            "park_cpu_s": round(statistics.median(park_cpu_s), 4),
            "release_cpu_s": round(statistics.median(release_cpu_s), 4),
            "park_s_each": [round(x, 4) for x in park_s], "park_cpu_s_each": [round(x, 4) for x in park_cpu_s],
            "release_cpu_s_each": [round(x, 4) for x in release_cpu_s], "parked": parked}


async def _served_model(rollouts: int, calls: int) -> Any:
    """The reference model server in-process (a :class:`refgym.model_server.RefModel`), having
    answered ``calls`` chained model calls of each of ``rollouts`` rollouts (no HTTP)."""
    from gymkit.model_control import ModelAdmission
    from refgym.api import ModelCall
    from refgym.model_server import RefModel

    model = RefModel("policy", 0, ModelAdmission())
    for i in range(rollouts):
        parent = None
        for turn in range(calls):
            await model.call(ModelCall(rollout_id=f"r{i:07d}", attempt_index=0, capture_key=f"r{i:07d}",
                                       model_call_id=f"call-{turn}", parent_call_id=parent, turn_index=turn,
                                       prompt_token_ids=list(range(1, 40))))
            parent = f"call-{turn}"
    return model


def _continuation_indexes(checkpoint_dir: str, rollouts: int, calls: int) -> tuple[Any, ...]:
    """Ten agents' continuation indexes in ``checkpoint_dir``, every rollout of :func:`_served_model`
    rooted at its last call; the references a model commit is given."""
    from schemas.gym_records import AgentContinuationRoot
    from snapformat.gym_dir import root_order, write_jsonl

    return tuple(write_jsonl(checkpoint_dir, f"agent/agent-{a}/continuations.jsonl", sorted(
        (AgentContinuationRoot(rollout_id=f"r{i:07d}", attempt_index=0, capture_key=f"r{i:07d}",
                               last_committed_model_call_id=f"call-{calls - 1}",
                               resource_state_revisions={"notes": 1}) for i in range(a, rollouts, 10)),
        key=root_order)) for a in range(10))


async def model_commit_lever(rollouts: int, calls: int = 2, repeats: int = 5) -> dict[str, Any]:
    """The reference model server alone, in-process: ``rollouts`` rollouts of ``calls`` model calls
    each (answered by :meth:`RefModel.call`, no HTTP), then ``2 * repeats`` commits of every rollout
    into RAM (:func:`ram_staging`, when there is one), every other one inside :func:`gymkit.collector.collector_held`
    as the kit's commit route runs it. Returns each kind's times and medians (the collector lever's
    in-process measurement)."""
    from gymkit.collector import collector_held
    from gymkit.model_control import ModelCommitContext

    model = await _served_model(rollouts, calls)
    times: dict[str, list[float]] = {"collector_on": [], "collector_held": []}
    for rep in range(2 * repeats):
        held = rep % 2 == 1
        with tempfile.TemporaryDirectory(dir=ram_staging()) as tmp:
            ctx = ModelCommitContext(checkpoint_id=f"lever-{rep}", deadline_ts=time.time() + DEADLINE_S,
                                     checkpoint_dir=tmp, continuation_indexes=_continuation_indexes(tmp, rollouts, calls))
            t = time.perf_counter()
            if held:
                with collector_held():
                    await model.commit(ctx)
            else:
                await model.commit(ctx)
            times["collector_held" if held else "collector_on"].append(round(time.perf_counter() - t, 4))
    return {"rollouts": rollouts, "calls": len(model.calls), "times_s": times,
            "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()}}


#: The model-restore lever's kinds: the collector on throughout, held off in the restore (as before
#: the freeze), held off and what the restore left alive frozen (``collector_held(keep=True)``, the
#: kits' restore routes).
RESTORE_COLLECTOR_KINDS = ("collector_on", "collector_held", "held_and_frozen")
#: Objects the restore lever allocates after each restore, kept alive: the resume's first work.
WORK_AFTER_RESTORE = 300_000


def _restore_in_this_process(checkpoint_dir: str, kind: str) -> dict[str, float]:
    """One restore of the model-restore lever, in a fresh process: a fresh reference model restores
    the ledger in ``checkpoint_dir`` with the collector as ``kind`` says, then allocates
    :data:`WORK_AFTER_RESTORE` objects that live on (what the collections after the restore walk).
    Also returns how many objects the restore left frozen."""
    import gc

    from gymkit.collector import collector_held
    from gymkit.model_control import ModelAdmission, ModelRestoreContext
    from refgym.model_server import RefModel

    async def restore() -> tuple[float, float]:
        fresh = RefModel("policy", 0, ModelAdmission())
        ctx = ModelRestoreContext(checkpoint_id="lever-restore", deadline_ts=time.time() + DEADLINE_S,
                                  checkpoint_dir=checkpoint_dir)
        gc.collect()
        t0 = time.perf_counter()
        if kind == "collector_on":
            await fresh.restore(ctx)
        else:
            with collector_held(keep=kind == "held_and_frozen"):
                await fresh.restore(ctx)
        t1 = time.perf_counter()
        kept = [{"i": i, "pair": [i, i + 1]} for i in range(WORK_AFTER_RESTORE)]
        t2 = time.perf_counter()
        assert len(kept) == WORK_AFTER_RESTORE and len(fresh.calls) > 0
        return t1 - t0, t2 - t1

    restore_s, work_s = asyncio.run(restore())
    return {"restore_s": round(restore_s, 4), "work_after_s": round(work_s, 4), "total_s": round(restore_s + work_s, 4),
            "frozen_objects": gc.get_freeze_count()}


async def model_restore_lever(rollouts: int, calls: int = 3, repeats: int = 5) -> dict[str, Any]:
    """The freeze lever, in-process: the reference model's ledger of ``rollouts`` rollouts of
    ``calls`` calls each is committed into RAM (:func:`ram_staging`) once, then restored ``repeats`` times for each of
    :data:`RESTORE_COLLECTOR_KINDS`, in turn, each restore in a fresh process (the collector and its
    permanent generation are the process's). Returns each kind's times and medians."""
    import concurrent.futures
    import multiprocessing

    from gymkit.model_control import ModelCommitContext

    model = await _served_model(rollouts, calls)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in RESTORE_COLLECTOR_KINDS}
    with tempfile.TemporaryDirectory(dir=ram_staging()) as tmp:
        await model.commit(ModelCommitContext(checkpoint_id="lever-saved", deadline_ts=time.time() + DEADLINE_S,
                                              checkpoint_dir=tmp,
                                              continuation_indexes=_continuation_indexes(tmp, rollouts, calls)))
        del model
        spawn = multiprocessing.get_context("spawn")
        for rep in range(repeats):
            for kind in RESTORE_COLLECTOR_KINDS[rep % 3:] + RESTORE_COLLECTOR_KINDS[:rep % 3]:  # rotate the order
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    runs[kind].append(pool.submit(_restore_in_this_process, tmp, kind).result())
                _say(f"model restore of {rollouts:,}, {kind}: {runs[kind][-1]}")
    return {"rollouts": rollouts, "calls_per_rollout": calls, "work_after_restore_objects": WORK_AFTER_RESTORE,
            "runs": runs, "median_s": {k: {m: round(statistics.median(r[m] for r in v), 4) for m in v[0]}
                                       for k, v in runs.items()}}


#: The rows of the restore-order lever's table (keys of PHASES), in order.
RESTORE_ROWS = ("restore", "restore_model", "restore_agent", "restore_resource", "resume_after_restore",
                "restore_total")


def restore_concurrent_lines(result: dict[str, Any]) -> list[str]:
    """The restore-order lever's section: each point's restores in NeMo-RL's order against the same
    repeats' restores with every participant at once; empty when the run did not measure it."""
    pts = sorted((p for p in result["per_point"] if (p.get("restore_concurrent") or {}).get("restores")),
                 key=lambda p: (p["n"], p["servers"]))
    if not pts:
        return []
    lines = [
        "## Lever: every participant restores at once (`NemoGym(restore_order=\"concurrent\")`)",
        "",
        ("Each restore repeat restored the same snapshot twice, each time on freshly started servers, the two "
         "swapping places every repeat: once in NeMo-RL's order (the model, then the agents, then the resources "
         "servers), once with every participant at once (`gymkit.gym_fleet.GymFleet`, "
         "`restore_order=\"concurrent\"`). Medians (ms) of the same repeats."),
        "",
        *_order_table(pts, RESTORE_ROWS, "concurrent", lambda p: p["median_s"],
                      lambda p: p["restore_concurrent"]["median_s"]),
        "",
    ]
    for p in pts:
        seq, con = p["median_s"]["restore_total"], p["restore_concurrent"]["median_s"]["restore_total"]
        pause = (p.get("staged") or {}).get("median_s", {}).get("pause_total", p["median_s"]["pause_total"])
        lines.append(f"- ({p['servers']}, {p['n']:,}): concurrent, the restore is {con:.2f} s = "
                     f"{p['restore_concurrent']['paired_ratio_restore_total']:.2f}x NeMo-RL's order within each "
                     f"repeat (medians {seq:.2f} s); against the pause ({pause:.2f} s, target <= 2x): "
                     f"{con / pause:.2f}x and {seq / pause:.2f}x.")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"points {QUICK_POINTS}, one repeat each")
    p.add_argument("--point", type=int, nargs=2, action="append", metavar=("SERVERS", "ROLLOUTS"))
    p.add_argument("--repeats", type=int)
    p.add_argument("--json", type=Path, help="also write the result JSON here")
    p.add_argument("--actor-pool", type=int, help="lever check: the NemoGym actor's HTTP pool of this many "
                   "connections (the size before issue 22 was 32, whatever the servers)")
    p.add_argument("--staging", type=Path, help="the staging lever: each repeat also pauses with Gym's files "
                   "staged in a folder under this directory (ControllerConfig.gym_staging 'always'; /dev/shm is RAM)")
    p.add_argument("--commit-alongside", action="store_true", help="the commit-order lever (with --staging): each "
                   "repeat also pauses staged with the resources servers committing alongside the agents and the "
                   "model (NemoGym commit_order 'resources_alongside')")
    p.add_argument("--restore-concurrent", action="store_true", help="the restore-order lever: each restore "
                   "repeat also restores (on fresh servers) with every participant at once (NemoGym restore_order "
                   "'concurrent'), the two orders swapping places every repeat")
    p.add_argument("--budget-s", type=float, default=LARGE_BUDGET_S, help=f"a point of {LARGE_N:,} rollouts or "
                   "more stops repeating once its pauses used half of this many seconds (default %(default)s)")
    p.add_argument("--render", type=Path, help="print the report of a saved result JSON (run.py's or a partial one)")
    p.add_argument("--agent-wave", type=int, metavar="ROLLOUTS", help="lever 1's measurement: one agent in-process "
                   "(see agent_wave), print its JSON and exit")
    p.add_argument("--agent-park", type=int, metavar="ROLLOUTS", help="the parking lever's measurement: one "
                   "agent in-process, its rollouts parked and released 5 times (see agent_park_rounds), print its "
                   "JSON and exit")
    p.add_argument("--model-commit", type=int, metavar="ROLLOUTS", help="the collector lever's measurement: "
                   "the model server in-process, its commit with the cyclic collector on and held off "
                   "(see model_commit_lever), print its JSON and exit")
    p.add_argument("--model-calls", type=int, default=2, metavar="CALLS", help="with --model-commit: model calls "
                   "per rollout, each the parent of the next (default %(default)s)")
    p.add_argument("--model-restore", type=int, metavar="ROLLOUTS", help="the freeze lever's measurement: "
                   "the model's ledger restored in fresh processes with the collector on, held off, and held off "
                   "then frozen (see model_restore_lever), print its JSON and exit")
    opts = p.parse_args(argv)
    if opts.model_restore:
        print(msgspec.json.encode(asyncio.run(model_restore_lever(opts.model_restore))).decode())
        return 0
    if opts.agent_wave:
        print(msgspec.json.encode(asyncio.run(agent_wave(opts.agent_wave))).decode())
        return 0
    if opts.agent_park:
        print(msgspec.json.encode(asyncio.run(agent_park_rounds(opts.agent_park))).decode())
        return 0
    if opts.model_commit:
        print(msgspec.json.encode(asyncio.run(model_commit_lever(opts.model_commit, opts.model_calls))).decode())
        return 0
    if opts.render:
        data = msgspec.json.decode(opts.render.read_bytes())
        print(markdown(data.get("result", data)))
        return 0
    points = tuple(tuple(x) for x in opts.point) if opts.point else (QUICK_POINTS if opts.quick else FULL_POINTS)
    result = run(points, opts.quick, repeats=opts.repeats, actor_pool=opts.actor_pool,  # type: ignore[arg-type]
                 staging=opts.staging, budget_s=opts.budget_s, alongside=opts.commit_alongside,
                 restore_concurrent=opts.restore_concurrent)
    if opts.json:
        opts.json.write_bytes(msgspec.json.encode(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
