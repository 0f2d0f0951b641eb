"""A real multi-node Ray cluster on this machine, and ``make cluster-demo`` on it (issue 22, §1).

**Three "machines", each its own Ray node (its own raylet), everything on 127.0.0.0/8:**

| machine | Ray node (custom resource) | what runs there | Gym host |
|---|---|---|---|
| A | ``head`` (``snap_controller``) | Ray's GCS, the job's driver, the Single Controller | (SeaweedFS, the store, at 127.0.0.1) |
| B | ``gym`` (``snap_gym``) | the NemoGym actor | 127.0.0.2: the policy model and the agent |
| C | ``tq`` (``snap_tq``) | TransferQueue's controller and storage unit | 127.0.0.3: the resources servers ``tools`` and ``sandbox`` |

Every Ray node has node IP 127.0.0.1; the Gym servers of a "host" listen on its own loopback address.
Killing a machine kills its Ray node (its ``ray start`` process, raylet, agents and every worker
the raylet forked) and the Gym servers of its host.

**Why ``ray start`` and not ``ray.cluster_utils.Cluster``.** Both give several raylets on one
machine. ``Cluster`` builds every node inside the Python process that creates it: the nodes' processes
are that process's children and share its fate, and ``remove_node`` stops a node through Ray's own
API. That suits Ray's unit tests, not a machine failure. With ``ray start`` each node is started by
the command an operator types on each machine, in a session of its own (``ray start --block``), apart
from the driver and from the other nodes: a node is killed by SIGKILL of exactly its process tree,
with no say from Ray, and restarted by typing the same command again; the job's driver is an ordinary
process that attaches with ``ray.init(address=...)``, as on a real cluster. The README's recipe
(``devtools/cluster_recipe.sh``) runs the same commands with fixed ports (a test compares them;
:meth:`LocalCluster.commands` prints this module's). Each node has its own
``--temp-dir`` (sockets, logs, session files apart, as on separate machines; Ray allows one per node)
and its own ports (Ray's fixed default agent ports would collide on one machine).
Ray keeps a node's servers on 127.0.0.1 only with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (with it at 1
it swaps ``--node-ip-address 127.0.0.1`` for the machine's routable address and listens on every
interface), and with it at 0 the ``ray start`` CLI refuses worker nodes: each node is therefore
started with ``python -m devtools.ray_cli start ...``, Ray's own CLI with that one guard lifted and
the same arguments as ``ray start`` (:mod:`devtools.ray_cli`). :func:`non_loopback_listeners` checks
that no process of the cluster listens outside 127.0.0.0/8.

**How TransferQueue is pinned.** TransferQueue 0.1.11's config pins its storage units:
``backend.SimpleStorage.required_node_resource`` (a hard node-affinity strategy to the nodes that
carry that resource). Its controller has no placement option: ``tq.init`` creates it with
``num_cpus=1`` and Ray's default strategy, which prefers the node of the caller. So the job calls
``tq.init`` inside a small actor pinned to node ``tq`` by its resource
(:func:`coordinator.ray_runtime.attach`), which owns TQ's actors from then on, and checks that the
controller and every storage unit report that node. The head and ``gym`` nodes have CPUs too, so a
controller that were not pinned would land on the driver's node (seen: ``tq.init`` called by a driver
on the head put the controller on the head), and the check would fail.

**The store and Gym's files.** The store is SeaweedFS over S3 (``s3://``); every participant reaches
it through ``AWS_*`` variables (each node and the job get them), none through a local path. Gym's
control protocol hands each server a ``checkpoint_dir`` that is a *folder* (CONTROL.md §9): with S3
the Single Controller stages Gym's files in ``--staging-dir`` and uploads them. Across real machines
that folder must be a shared file system (or the servers' host adopts its own folder); here it is
one folder of this machine, ``<cluster>/shared-staging``.

**Cleanup.** Every node is one process session, killed by process group and tree, never by name
(``ray stop`` would stop every Ray on the machine, other users' too): :meth:`LocalCluster.close`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from coordinator.config import ControllerConfig, GymRolloutCheckpointing, RolloutCheckpointing
from coordinator.workload import Workload
from devtools.accounting import content, differences, trained_once
from devtools.demo import saves_of, tables_of
from devtools.gym_procs import LOCALHOST, REPO_ROOT, free_port, free_ports
from devtools.job_process import JobProcess, process_tree

HEAD, GYM_NODE, TQ_NODE = "head", "gym", "tq"
#: The custom resource that marks each node's role (capacity 1; an actor asks for 0.01 of it).
RESOURCES = {HEAD: "snap_controller", GYM_NODE: "snap_gym", TQ_NODE: "snap_tq"}
#: ``devtools.job --placement``: which resource pins each part of the job.
PLACEMENT = {"controller": RESOURCES[HEAD], "gym": RESOURCES[GYM_NODE], "tq": RESOURCES[TQ_NODE]}
#: ``devtools.job --gym-hosts``: the address each Gym server listens on.
GYM_HOSTS = {"model": "127.0.0.2", "agent": "127.0.0.2", "resource": "127.0.0.3", "sandbox": "127.0.0.3"}
#: The Gym host on the same "machine" as each worker node: its servers die with the node.
MACHINE_HOST = {GYM_NODE: "127.0.0.2", TQ_NODE: "127.0.0.3"}
#: Logical CPUs per node. TQ's controller and its storage unit take 1 each; the Single Controller and the
#: NemoGym actor take none. Every node has some, so nothing but the pinning puts TQ on ``tq``.
NODE_CPUS = {HEAD: 1, GYM_NODE: 1, TQ_NODE: 2}
OBJECT_STORE_BYTES = 100 << 20
#: Where each part must run (by the resource of its node), as ``placement.json`` names the parts.
EXPECTED = {"controller": RESOURCES[HEAD], "gym": RESOURCES[GYM_NODE], "TQHost": RESOURCES[TQ_NODE],
            "TransferQueueController": RESOURCES[TQ_NODE], "TransferQueueStorageUnit#0": RESOURCES[TQ_NODE]}
#: How soon the GCS declares a killed node dead: a health check every 1 s, dead after 5 misses (Ray's
#: defaults take about 30 s). The GCS reads them from the head's environment.
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                    "RAY_health_check_failure_threshold": "5"}
#: ``ray start`` options naming the ports of a node's own servers (every node; the head adds its own two).
NODE_PORT_OPTIONS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                     "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
HEAD_PORT_OPTIONS = ("dashboard-port", "ray-client-server-port")
START_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 600.0
EXIT_WAIT_S = 60.0  # how long a wounded job may take to fail by itself before the operator kills it


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def kill_pids(pids: Iterable[int], timeout: float = 30.0) -> list[int]:
    """SIGKILL every pid (a crash: nothing flushed) and wait until none is alive; returns those signalled."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    end = time.monotonic() + timeout
    while any(pid_alive(p) for p in killed):
        if time.monotonic() > end:
            raise RuntimeError(f"still alive {timeout}s after SIGKILL: {[p for p in killed if pid_alive(p)]}")
        time.sleep(0.05)
    return killed


@dataclass
class RayNode:
    """One Ray node: one ``ray start --block`` process in a session of its own, and its log."""

    name: str
    head: bool
    temp_dir: Path
    resources: dict[str, float]
    num_cpus: int
    env: dict[str, str]
    gcs_port: int
    log_path: Path
    popen: subprocess.Popen | None = None
    argv: list[str] = field(default_factory=list)
    starts: int = 0

    def command(self) -> list[str]:
        """The ``ray start`` command of this node (fresh ports for the node's own servers)."""
        argv = [sys.executable, "-m", "devtools.ray_cli", "start", "--block", "--node-ip-address=127.0.0.1",
                f"--node-name={self.name}", f"--temp-dir={self.temp_dir}", f"--num-cpus={self.num_cpus}",
                "--num-gpus=0",
                f"--resources={json.dumps(self.resources, separators=(',', ':'))}",
                f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
                "--min-worker-port=0", "--max-worker-port=0"]
        # Ray refuses a node with one port given to two of its servers: the ports are picked together,
        # and never the GCS port (picked earlier, unbound until the head starts).
        options = NODE_PORT_OPTIONS + (HEAD_PORT_OPTIONS if self.head else ())
        ports = free_ports([LOCALHOST] * len(options), exclude={self.gcs_port})
        argv += [f"--{option}={port}" for option, port in zip(options, ports, strict=True)]
        if self.head:
            argv += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false"]
        else:
            argv += [f"--address=127.0.0.1:{self.gcs_port}", "--include-log-monitor=false"]
        return argv

    def start(self) -> RayNode:
        if self.alive():
            raise RuntimeError(f"node {self.name} is already running (pid {self.popen.pid})")
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.argv = self.command()
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n== start {self.starts}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> RayNode:
        """Until ``ray start`` says the runtime started (this start's part of the log), or fail with its log."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.log_path.read_text(errors="replace").rsplit(f"== start {self.starts}:", 1)[-1]
            if "Ray runtime started" in text:
                return self
            if not self.alive():
                raise RuntimeError(f"ray node {self.name} exited while starting:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"ray node {self.name} not started after {timeout}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        """Whether its ``ray start`` process still runs (checked without reaping it: until :meth:`kill`
        reaps it, its pid, also its session's and process group's id, stays ours)."""
        if self.popen is None or self.popen.returncode is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def pids(self) -> list[int]:
        """Every live process of this node: the ``ray start`` session and all its descendants (none once
        it is reaped: its pid may then be another process's)."""
        if self.popen is None or self.popen.returncode is not None:
            return []
        return [p for p in process_tree(self.popen.pid, session=self.popen.pid) if pid_alive(p)]

    def kill(self) -> list[int]:
        """SIGKILL every process of the node at once (a machine failure), then reap its ``ray start``;
        returns the pids killed."""
        if self.popen is None or self.popen.returncode is not None:
            return []
        killed = kill_pids(self.pids())
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # anything of its group started meanwhile (pid not yet reaped)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(timeout=30)
        return killed

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass(frozen=True)
class NodeState:
    node_id: str
    name: str
    alive: bool
    resources: dict[str, float]


class LocalCluster:
    """A head and two worker nodes (:data:`RESOURCES`), started with ``ray start``; see the module doc.

    ``env``: extra environment for every node (the store's ``AWS_*`` variables). Use as a context
    manager, or call :meth:`close`: it kills every node's processes and removes the temp dirs.
    """

    def __init__(self, env: dict[str, str] | None = None, cpus: dict[str, int] | None = None) -> None:
        # Short: Ray's socket paths (<temp>/session_<date>_<pid>/sockets/...) must fit in 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
        self.port = free_port()
        self.staging = self.root / "shared-staging"
        self.staging.mkdir()
        node_env = dict(os.environ)
        for k in list(node_env):
            if k.startswith("RAY_") or k == "PYTHONPATH":
                del node_env[k]  # nothing of the caller's own Ray settings
        node_env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                         "RAY_USAGE_STATS_ENABLED": "0",
                         # Ray's memory monitor kills workers when the *machine* is short of memory, whoever
                         # uses it: on a shared machine that would be TQ's rows. Off, as in the tests.
                         "RAY_memory_monitor_refresh_ms": "0",
                         "PYTHONPATH": str(REPO_ROOT), **HEALTH_CHECK_ENV, **(env or {})})
        cpus = {**NODE_CPUS, **(cpus or {})}
        self.nodes = {name: RayNode(name, name == HEAD, self.root / name, {RESOURCES[name]: 1}, cpus[name], node_env,
                                    self.port, self.root / f"{name}.log")
                      for name in (HEAD, GYM_NODE, TQ_NODE)}
        self._gcs = None
        self.jobs: list[JobProcess] = []  # every job started here: close() kills what is left of them

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = START_TIMEOUT_S) -> LocalCluster:
        """The head, then both workers (at once); returns once the GCS lists all three alive."""
        try:
            self.nodes[HEAD].start().wait_started(timeout)
            workers = [self.nodes[n].start() for n in (GYM_NODE, TQ_NODE)]
            for w in workers:
                w.wait_started(timeout)
            self.wait_alive([HEAD, GYM_NODE, TQ_NODE], timeout)
        except BaseException:
            self.close()
            raise
        return self

    # -- the GCS's view -------------------------------------------------------------------------
    def gcs_nodes(self) -> list[NodeState]:
        """Every node the GCS knows (dead ones too), by asking the GCS directly (Ray's own GCS client, as
        its CLI does): this process does not become a Ray driver."""
        if self._gcs is None:
            from ray._raylet import GcsClient

            self._gcs = GcsClient(address=self.address)
        out = []
        for node_id, info in self._gcs.get_all_node_info(timeout=10).items():
            out.append(NodeState(node_id=node_id.hex(), name=info.node_name, alive=info.state == 0,
                                 resources=dict(info.resources_total)))
        return out

    def node_ids(self, name: str, alive: bool = True) -> set[str]:
        return {n.node_id for n in self.gcs_nodes() if n.name == name and n.alive == alive}

    def wait_alive(self, names: Iterable[str], timeout: float = START_TIMEOUT_S) -> dict[str, str]:
        """Until the GCS lists one alive node of each name; returns their node ids."""
        names = list(names)
        end = time.monotonic() + timeout
        while True:
            alive = {n.name: n.node_id for n in self.gcs_nodes() if n.alive}
            if all(name in alive for name in names):
                return {name: alive[name] for name in names}
            if time.monotonic() > end:
                raise TimeoutError(f"nodes {[n for n in names if n not in alive]} not alive after {timeout}s")
            time.sleep(0.25)

    def wait_dead(self, node_ids: Iterable[str], timeout: float = 60.0) -> None:
        """Until the GCS reports each of ``node_ids`` dead (its health check noticed)."""
        ids = set(node_ids)
        end = time.monotonic() + timeout
        while True:
            alive = {n.node_id for n in self.gcs_nodes() if n.alive} & ids
            if not alive:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"the GCS still reports {sorted(alive)} alive {timeout}s after they were killed")
            time.sleep(0.25)

    # -- failures and the operator --------------------------------------------------------------
    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of node ``name`` (its raylet, agents, workers, ``ray start``)."""
        return self.nodes[name].kill()

    def restart_node(self, name: str, timeout: float = START_TIMEOUT_S) -> str:
        """As an operator would: once the GCS has declared the old incarnation dead, the same
        ``ray start`` command again; returns the new node id."""
        node = self.nodes[name]
        old = self.node_ids(name)
        if node.alive():
            raise RuntimeError(f"node {name} is still running")
        self.wait_dead(old)
        node.start().wait_started(timeout)
        end = time.monotonic() + timeout
        while not (new := self.node_ids(name) - old):
            if time.monotonic() > end:
                raise TimeoutError(f"node {name} restarted but not alive in the GCS after {timeout}s")
            time.sleep(0.25)
        return new.pop()

    def pids(self) -> list[int]:
        return sorted(p for n in self.nodes.values() for p in n.pids())

    def close(self) -> None:
        """Kill what is left of every job started here, then every node (workers first), then remove the
        temp dirs. Idempotent."""
        errors = []
        for job in self.jobs:
            try:
                job.kill()
            except Exception as exc:  # noqa: BLE001 - go on with the others, then report
                errors.append(f"job {job.pid}: {exc}")
        for name in (TQ_NODE, GYM_NODE, HEAD):
            try:
                self.nodes[name].kill()
            except Exception as exc:  # noqa: BLE001 - go on with the others, then report
                errors.append(f"{name}: {exc}")
        self._gcs = None
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise RuntimeError(f"could not stop every node: {errors}")

    # -- what runs on it ------------------------------------------------------------------------
    def job_args(self) -> list[str]:
        """``devtools.job`` arguments that run a job on this cluster, each part where it belongs."""
        return ["--address", self.address, "--placement", json.dumps(PLACEMENT), "--gym-hosts", json.dumps(GYM_HOSTS),
                "--staging-dir", str(self.staging)]

    def job(self, store: str, workdir: Path, **kw: Any) -> JobProcess:
        """A ``devtools.job`` process (its own session) on this cluster; ``kw`` as :class:`JobProcess`."""
        extra = self.job_args() + ["--progress-s", "0.5"] + kw.pop("extra", [])
        job = JobProcess(store, workdir, extra=extra, **kw)
        self.jobs.append(job)
        return job

    def commands(self) -> list[str]:
        """The commands that start this cluster and run a job on it (the README's recipe)."""
        env = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled"
        out = [f"{env} {' '.join(n.argv or n.command())}".replace(sys.executable, "python")
               for n in self.nodes.values()]
        return out + [f"python -m devtools.job --store s3://BUCKET/PREFIX --workdir DIR {' '.join(self.job_args())}"]


# -- checks -------------------------------------------------------------------------------------------
def placement_problems(workdir: Path) -> list[str]:
    """What is wrong with where the job in ``workdir`` placed its parts (``placement.json``): each part on a
    node carrying its resource, and the Single Controller, the NemoGym actor and TransferQueue on three
    different nodes."""
    doc = json.loads((workdir / "placement.json").read_text())
    actors, nodes = doc["actors"], doc["nodes"]
    problems = [f"{part} is missing from placement.json" for part in EXPECTED if part not in actors]
    problems += [f"{part} runs on node {nodes[actors[part]]['name']!r} ({actors[part][:12]}), which lacks {res}"
                 for part, res in EXPECTED.items() if part in actors and res not in nodes[actors[part]]["resources"]]
    distinct = {actors.get("controller"), actors.get("gym"), actors.get("TransferQueueController")}
    if len(distinct) != 3:
        problems.append(f"the Single Controller, the NemoGym actor and TQ do not run on three nodes: {actors}")
    return problems


def placement_summary(workdir: Path) -> str:
    doc = json.loads((workdir / "placement.json").read_text())
    return ", ".join(f"{part} on {doc['nodes'][node]['name']} ({node[:8]})" for part, node in doc["actors"].items())


def non_loopback_listeners(pids: Iterable[int]) -> tuple[int, list[str]]:
    """TCP sockets listening outside 127.0.0.0/8 (and ::1) among ``pids``: ``(sockets seen, offenders)``."""
    ours = set(pids)
    out = subprocess.run(["ss", "-H", "-tlnp"], capture_output=True, text=True, check=True).stdout
    seen, bad = 0, []
    for line in out.splitlines():
        if not {int(x) for x in re.findall(r"pid=(\d+)", line)} & ours:
            continue
        seen += 1
        host = line.split()[3].rsplit(":", 1)[0].strip("[]")
        host = host.removeprefix("::ffff:")
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
        if not ok:
            bad.append(line)
    return seen, bad


def gym_pids_on(workdir: Path, host: str) -> list[int]:
    """The job's Gym servers listening on ``host``."""
    pids = json.loads((workdir / "gym.pids.json").read_text())
    return [pid for role, pid in pids.items() if GYM_HOSTS.get(role) == host]


# -- the demo -------------------------------------------------------------------------------------------
def _say(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Scenario:
    """One run on the cluster with a failure in the middle, restarted, checked."""

    name: str
    store: str
    workdir: Path
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def wait_for_progress(job: JobProcess, snapshots: Callable[[], int], rollouts: int, min_snapshots: int,
                      fraction: float = 1 / 3, timeout: float = JOB_TIMEOUT_S) -> None:
    """Until ``min_snapshots`` are published and ``fraction`` of the rollouts stored, with some still to go."""
    def ready() -> bool:
        stored = [ln for ln in job.lines() if ln.startswith("job: ") and "rollouts stored" in ln]
        if not stored:
            return False
        n = int(stored[-1].split("job: ")[1].split("/")[0])
        if n >= rollouts:
            raise RuntimeError(f"the run stored all {rollouts} rollouts before {min_snapshots} snapshots were "
                               f"published: no moment mid-run to kill it (a slower model or more rollouts)")
        return n >= rollouts * fraction and snapshots() >= min_snapshots

    job.wait_for(ready, f"{min_snapshots} snapshots and {fraction:.0%} of the rollouts", timeout)


def _check_running(cluster: LocalCluster, job: JobProcess, sc: Scenario) -> None:
    """While the job runs: where each part is (kept as ``placement-before.json``), and that nothing of
    the cluster or the job (Ray, TQ's sockets, the Gym servers) listens outside 127.0.0.0/8."""
    sc.problems += placement_problems(sc.workdir)
    sc.lines.append(f"placement: {placement_summary(sc.workdir)}")
    shutil.copyfile(sc.workdir / "placement.json", sc.workdir / "placement-before.json")
    seen, bad = non_loopback_listeners(cluster.pids() + process_tree(job.pid))
    sc.problems += [f"listening outside 127.0.0.0/8: {line}" for line in bad]
    sc.lines.append(f"{seen} listening sockets of the cluster and the job, {len(bad)} outside 127.0.0.0/8")


def _let_it_fail(job: JobProcess, timeout: float = EXIT_WAIT_S) -> str:
    """Wait for a wounded job to exit by itself; kill it whole (the operator) if it does not."""
    try:
        code = job.wait(timeout)
        return f"failed by itself (exit {code})"
    except TimeoutError:
        return f"killed by the operator after {timeout:.0f}s"


def _gone(pid: int, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _finish_and_check(cluster: LocalCluster, sc: Scenario, workload: Workload, config: ControllerConfig,
                      model_slow_ms: int, expected: dict[str, Any], log_name: str) -> dict[str, Any] | None:
    """The operator's restart of the job: it restores, finishes, and is checked against ``expected``."""
    from snapformat import SnapshotStore, verify_snapshot

    t0 = time.monotonic()
    again = cluster.job(sc.store, sc.workdir, workload=workload, config=config, model_slow_ms=model_slow_ms,
                        outcome=sc.workdir / "outcome.json", log_name=log_name)
    if again.wait(JOB_TIMEOUT_S) != 0:
        sc.problems.append(f"the restarted job failed:\n{again.tail()}")
        return None
    sc.seconds["restarted job"] = time.monotonic() - t0
    sc.problems += placement_problems(sc.workdir)
    actual = again.outcome()
    restored = actual["outcome"]["restored"]
    if restored is None:
        sc.problems.append("the restarted job found no snapshot to restore")
        return actual
    sc.lines.append(f"restored snapshot {restored['sequence']} in {sum(restored['steps_s'].values()):.2f}s: "
                    f"{len(restored['continued'])} rollouts continued "
                    f"({sum(c['discarded'] for c in restored['continued'])} start over), "
                    f"{restored['acks_resent']} acknowledgements settled; "
                    f"finished in {actual['outcome']['seconds']:.1f}s")
    sc.lines.append(f"placement after the restart: {placement_summary(sc.workdir)}")
    ids = [s.rollout_id for i in range(workload.prompts) for s in workload.group(i)]
    sc.problems += differences(expected, content(tables_of(actual))) + trained_once(actual["records"], ids)
    store = SnapshotStore(sc.store)
    seqs = [c.sequence for c in store.list()]
    sc.problems += [f"snapshot {s} does not verify" for s in seqs if not verify_snapshot(store.open(s)).ok]
    saves = saves_of(sc.workdir)  # both jobs append to it
    pauses = [f"{s['pause_s'] * 1000:.0f}" for s in saves if s["published"]]
    sc.lines.append(f"{len(saves)} saves, {len(pauses)} published; pause of each (prepare to resume): "
                    f"{', '.join(pauses)} ms")
    if not sc.problems:
        rows = {k: t.num_rows for k, t in tables_of(actual).items()}
        sc.lines.append(f"equal to the uninterrupted run: every trajectory and data-plane row ({rows}); each of "
                        f"{len(ids)} rollouts trained exactly once; snapshots {seqs} verify")
    return actual


def _start_and_progress(cluster: LocalCluster, sc: Scenario, snapshots: Any, workload: Workload,
                        config: ControllerConfig, model_slow_ms: int) -> JobProcess:
    """The scenario's first job, once two snapshots are published and a third of the rollouts stored
    (a moment mid-run), with its placement and sockets checked."""
    job = cluster.job(sc.store, sc.workdir, workload=workload, config=config, model_slow_ms=model_slow_ms,
                      log_name="job-1.log")
    wait_for_progress(job, lambda: len(snapshots.list()), workload.rollouts, 2)
    _check_running(cluster, job, sc)
    return job


def crash_and_continue(cluster: LocalCluster, store: str, workdir: Path, workload: Workload, config: ControllerConfig,
                       model_slow_ms: int, expected: dict[str, Any]) -> Scenario:
    """SIGKILL the whole job (driver and Gym servers) mid-run; the cluster stays; restart the job."""
    from snapformat import SnapshotStore

    sc = Scenario("crash and continue", store, workdir)
    snapshots = SnapshotStore(store)
    t0 = time.monotonic()
    job = _start_and_progress(cluster, sc, snapshots, workload, config, model_slow_ms)
    ctl_pid = json.loads((workdir / "placement.json").read_text())["pids"]["controller"]
    killed = job.kill()
    sc.seconds["until the crash"] = time.monotonic() - t0
    sc.lines.append(f"SIGKILLed the job's {len(killed)} processes (driver, Gym servers) with "
                    f"{len(snapshots.list())} snapshots published; the cluster stays up")
    if not _gone(ctl_pid):  # Ray ends a dead driver's actors: no second controller may write the store
        sc.problems.append(f"the crashed job's Single Controller (pid {ctl_pid}) outlived its driver")
    else:
        sc.lines.append(f"Ray ended the dead driver's actors (the Single Controller, pid {ctl_pid}, is gone)")
    _finish_and_check(cluster, sc, workload, config, model_slow_ms, expected, "job-2.log")
    return sc


def node_failure(cluster: LocalCluster, store: str, workdir: Path, workload: Workload, config: ControllerConfig,
                 model_slow_ms: int, expected: dict[str, Any], node: str = TQ_NODE) -> Scenario:
    """Kill a whole worker node mid-run (every process of it) and the Gym servers of its host; the job
    fails; the operator restarts the node, then the job, which restores."""
    from snapformat import SnapshotStore

    sc = Scenario(f"machine {node} lost", store, workdir)
    snapshots = SnapshotStore(store)
    t0 = time.monotonic()
    job = _start_and_progress(cluster, sc, snapshots, workload, config, model_slow_ms)
    before = json.loads((workdir / "placement.json").read_text())
    old_ids = cluster.node_ids(node)
    host = MACHINE_HOST[node]
    gym = gym_pids_on(workdir, host)
    t_kill = time.monotonic()
    node_pids = cluster.kill_node(node)
    kill_pids(gym)
    sc.seconds["until the kill"] = t_kill - t0
    published = len(snapshots.list())
    sc.lines.append(f"SIGKILLed node {node} ({len(node_pids)} processes: raylet, agents, workers) and the {len(gym)} "
                    f"Gym servers of host {host}, with {published} snapshots published")
    lost_parts = [p for p, n in before["actors"].items() if n in old_ids]
    sc.lines.append(f"lost with it: {', '.join(lost_parts)}")
    how = _let_it_fail(job)
    sc.seconds["until the job failed"] = time.monotonic() - t_kill
    tail = [ln for ln in job.lines() if ln.startswith("job: lost")]
    sc.lines.append(f"the job {how}" + (f": {tail[-1][5:]}" if tail else ""))
    if not _gone(before["pids"]["controller"]):  # no second Single Controller may write the store
        sc.problems.append(f"the failed job's Single Controller (pid {before['pids']['controller']}) outlived it")
    t1 = time.monotonic()
    new_id = cluster.restart_node(node)
    sc.seconds["node restart"] = time.monotonic() - t1
    sc.lines.append(f"the operator restarted node {node} with the same command: node {new_id[:8]} "
                    f"(was {', '.join(i[:8] for i in old_ids)})")
    if _finish_and_check(cluster, sc, workload, config, model_slow_ms, expected, "job-2.log") is not None:
        after = json.loads((workdir / "placement.json").read_text())["actors"]
        moved = {p: after[p] for p in lost_parts}
        if any(n != new_id for n in moved.values()):
            sc.problems.append(f"the parts lost with node {node} did not come back on its new incarnation "
                               f"{new_id[:12]}: {moved}")
    return sc


def reference_run(cluster: LocalCluster, store: str, workdir: Path, workload: Workload, config: ControllerConfig,
                  model_slow_ms: int, data_plane: str = "tq") -> dict[str, Any]:
    """An uninterrupted run (no snapshots) on the cluster: the rows every other run must end with."""
    job = cluster.job(store, workdir, workload=workload, config=config.without_snapshots(),
                      model_slow_ms=model_slow_ms, outcome=workdir / "outcome.json",
                      extra=["--data-plane", data_plane])
    if job.wait(JOB_TIMEOUT_S) != 0:
        raise RuntimeError(f"the uninterrupted reference run failed:\n{job.tail()}")
    return content(tables_of(job.outcome()))


def cluster_config(interval_s: float = 1.0, max_in_flight: int = 24) -> ControllerConfig:
    """The controller's settings on the cluster: a TransferQueue call to a dead node fails within 15 s;
    up to 10 failed saves in a row (a save attempt is aborted when results keep completing between
    its flush of acknowledgements and the agent's prepare: seen twice in a row on a loaded machine)."""
    return ControllerConfig(
        rollout_checkpointing=RolloutCheckpointing(
            snapshot_attempt_interval_s=interval_s, keep_latest_k=3, max_consecutive_failures=10,
            gym=GymRolloutCheckpointing(capability_discovery_enabled=True, participant_checkpointing_enabled=True,
                                        prepare_timeout_s=20.0)),
        max_in_flight=max_in_flight, gym_unreachable_s=5.0, commit_timeout_s=20.0, restore_timeout_s=60.0,
        data_plane_timeout_s=15.0)


def report(scenarios: list[Scenario]) -> int:
    bad = 0
    for sc in scenarios:
        _say(f"   ({sc.store})")
        for line in sc.lines:
            _say(f"   {line}")
        if sc.seconds:
            _say("   seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in sc.seconds.items()))
        for p in sc.problems:
            _say(f"   MISMATCH: {p}")
        bad += bool(sc.problems)
    return 1 if bad else 0


def run_cluster_demo(store: str, workdir: Path, workload: Workload, config: ControllerConfig, model_slow_ms: int,
                     cluster: LocalCluster, kill_nodes: tuple[str, ...] = (TQ_NODE,), crash: bool = True) -> int:
    run = f"{store.rstrip('/')}/run-{time.strftime('%Y%m%d-%H%M%S')}"
    _say(f"cluster-demo: {workload.rollouts} rollouts ({workload.prompts} prompts x {workload.group_size}); "
         f"store {run}; logs in {workdir}")
    _say("\n== the cluster: three Ray nodes on 127.0.0.1, Gym hosts 127.0.0.2 and 127.0.0.3")
    for cmd in cluster.commands()[:3]:
        _say(f"   $ {cmd}")
    for n in cluster.gcs_nodes():
        _say(f"   node {n.name:5} {n.node_id[:8]} alive={n.alive} resources={n.resources}")

    _say("\n== 1. an uninterrupted run on the cluster, for reference (no snapshots)")
    t0 = time.monotonic()
    expected = reference_run(cluster, f"{run}/reference", workdir / "reference", workload, config, model_slow_ms)
    _say(f"   done in {time.monotonic() - t0:.1f}s; placement: {placement_summary(workdir / 'reference')}")
    code = 0
    if crash:
        _say("\n== 2. crash and continue: SIGKILL the whole job (driver, Gym servers) mid-run, restart it")
        code |= report([crash_and_continue(cluster, f"{run}/crash", workdir / "crash", workload, config,
                                           model_slow_ms, expected)])
    for i, node in enumerate(kill_nodes, start=3):
        _say(f"\n== {i}. kill machine {node} mid-run (Ray node {node} and Gym host {MACHINE_HOST[node]}), "
             "restart the node, then the job")
        code |= report([node_failure(cluster, f"{run}/lost-{node}", workdir / f"lost-{node}", workload, config,
                                     model_slow_ms, expected, node)])
    _say(f"\n== {'every run equals the uninterrupted one' if code == 0 else 'MISMATCHES above'}")
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--model-slow-ms", type=int, default=250)
    ap.add_argument("--kill", default="tq", help="worker nodes to kill, one scenario each: tq, gym or tq,gym")
    ap.add_argument("--no-crash", action="store_true", help="skip the whole-job crash scenario")
    args = ap.parse_args(argv)
    kill = tuple(n for n in args.kill.split(",") if n)
    if set(kill) - set(MACHINE_HOST):
        ap.error(f"--kill: worker nodes are {', '.join(MACHINE_HOST)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="snapcluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    workload = Workload(prompts=args.prompts, group_size=args.group_size)
    config = cluster_config(args.interval)
    from devtools import s3servers

    s3 = s3servers.seaweedfs(str(workdir / "seaweed"))
    try:
        os.environ.update(s3.env_vars())  # this process reads the store; the jobs inherit them
        store = f"s3://{s3.make_bucket('cluster-demo')}"
        with LocalCluster(env=s3.env_vars()) as cluster:
            return run_cluster_demo(store, workdir, workload, config, args.model_slow_ms, cluster, kill,
                                    crash=not args.no_crash)
    finally:
        s3.cleanup()


if __name__ == "__main__":
    sys.exit(main())
