"""Launching reference Gym servers as real processes (for tests and the demo), and killing them.

Each server is its own process running ``refgym.serve`` (uvicorn on 127.0.0.1, or on another
loopback address standing for another host: ``host``): either a fresh ``python -m refgym.serve``, or a
fork of a :class:`~devtools.gym_forkserver.ForkServer` that has already imported the code (much faster
to start; the same server code runs). A server reports the port it bound through a port file and is
ready once ``GET /healthz`` answers. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from devtools.checkout import REPO_ROOT, child_env
from devtools.gym_forkserver import ForkServer

LOCALHOST = "127.0.0.1"
#: The four servers of a deployment, as :func:`start_servers` names them (the keys of its ``hosts``).
ROLES = ("model", "agent", "resource", "sandbox")
BIND_ATTEMPTS = 3  # starts of a deployment whose pre-picked port another process took meanwhile


class ServerFailed(RuntimeError):
    """A server process exited or did not become ready in time (the message has its log tail)."""


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` of ``pid`` from /proc/<pid>/stat (fields 3 and 22), or None.

    A pid alone may be reused once its process is reaped; (pid, start time) names one process, so
    a forked server is only ever signalled while it is still the process that was started.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


@dataclass
class ServerProcess:
    component: str
    name: str
    pid: int
    port_file: Path
    log_path: Path
    popen: subprocess.Popen | None = None  # None when forked by a fork server (which reaps it)
    port: int | None = None
    started: str | None = None  # start time of a forked process (see _proc_stat)
    host: str = LOCALHOST  # the address it listens on (another loopback address stands for another host)

    def __post_init__(self) -> None:
        if self.popen is None and (stat := _proc_stat(self.pid)) is not None:
            self.started = stat[1]

    @property
    def url(self) -> str:
        assert self.port is not None, "not ready yet"
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None  # not reaped until polled: the pid is still ours
        # The fork server reaps its children: a dead server's pid goes away, or is reused later.
        stat = _proc_stat(self.pid)
        return stat is not None and stat[1] == self.started and stat[0] not in ("Z", "X")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = 30.0) -> ServerProcess:
        """Block until the port file is written and ``/healthz`` answers, or raise :class:`ServerFailed`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                raise ServerFailed(f"{self.component} {self.name} (pid {self.pid}) exited:\n{self.log_tail()}")
            if self.port is None and self.port_file.exists():
                self.port = int(self.port_file.read_text())
            if self.port is not None:
                try:
                    if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        raise ServerFailed(f"{self.component} {self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL this server (a crash: nothing is flushed or closed) and wait until it is gone."""
        if not self.alive():
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it ended between the look and the kill (a job's crash takes its servers down too)
        if self.popen is not None:
            self.popen.wait(timeout=timeout)
            return
        end = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > end:
                raise ServerFailed(f"{self.component} {self.name} (pid {self.pid}) alive {timeout}s after SIGKILL")
            time.sleep(0.01)


def launch(component: str, name: str, workdir: Path, token_file: Path, *, port: int = 0, seed: int = 0,
           slow_ms: int = 0, commit_delay_ms: int = 0, model_url: str | None = None,
           resource_url: str | None = None, sandbox_url: str | None = None, tool: str = "notes",
           forkserver: ForkServer | None = None, test_faults: bool = False,
           token_store: str | None = None, host: str = LOCALHOST) -> ServerProcess:
    """Start one server process listening on ``host`` (not yet ready: call :meth:`ServerProcess.wait_ready`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"{component}-{name}-{time.monotonic_ns()}"
    port_file, log_path = workdir / f"{stem}.port", workdir / f"{stem}.log"
    argv = ["--component", component, "--name", name, "--port", str(port), "--port-file", str(port_file),
            "--token-file", str(token_file), "--seed", str(seed), "--slow-ms", str(slow_ms),
            "--commit-delay-ms", str(commit_delay_ms), "--tool", tool]
    if host != LOCALHOST:
        argv += ["--host", host]
    if model_url:
        argv += ["--model-url", model_url]
    if resource_url:
        argv += ["--resource-url", resource_url]
    if sandbox_url:
        argv += ["--sandbox-url", sandbox_url]
    if test_faults:
        argv += ["--test-faults"]
    if token_store:
        argv += ["--token-store", token_store]
    if forkserver is not None:
        return ServerProcess(component, name, forkserver.spawn(argv, log_path), port_file, log_path, host=host)
    env = child_env()
    with open(log_path, "wb") as log:
        popen = subprocess.Popen([sys.executable, "-m", "refgym.serve", *argv], cwd=REPO_ROOT, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return ServerProcess(component, name, popen.pid, port_file, log_path, popen=popen, host=host)


@dataclass
class GymServers:
    """One policy model server, two resources servers (``notes``, exported; ``sandbox``,
    restart-only) and one agent server wired to them."""

    model: ServerProcess
    agent: ServerProcess
    resource: ServerProcess
    sandbox: ServerProcess

    @property
    def all(self) -> list[ServerProcess]:
        return [self.model, self.agent, self.resource, self.sandbox]


def bindable(host: str) -> bool:
    """Whether this machine can listen on ``host`` (another loopback address, 127.0.0.2, ..., stands
    for another host in the tests)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


def free_port(host: str = LOCALHOST) -> int:
    """A port on ``host`` that is free right now (another process may take it before it is bound).

    Two calls may return the same port: the kernel hands a closed port out again. For several ports at
    once use :func:`free_ports`."""
    (port,) = free_ports([host])
    return port


def free_ports(hosts: Sequence[str], exclude: Collection[int] = ()) -> list[int]:
    """One port free right now on each address of ``hosts``, distinct where an address repeats and
    none of ``exclude`` (ports already promised to a server not yet started): each socket stays bound
    until all are picked, so the kernel cannot hand a port out twice (it did, one pick at a time: Ray
    refused a node whose node-manager and metrics-export ports were both 51391)."""
    with contextlib.ExitStack() as held:
        ports = []
        for host in hosts:
            while True:  # an excluded port stays held, so the next bind gets another
                sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                sock.bind((host, 0))
                if sock.getsockname()[1] not in exclude:
                    break
            ports.append(sock.getsockname()[1])
        return ports


def start_servers(workdir: Path, token_file: Path, *, seed: int = 0, model_slow_ms: int = 0,
                  resource_slow_ms: int = 0, commit_delay_ms: int = 0, model_name: str = "policy0",
                  agent_name: str = "agent0", resource_name: str = "tools", sandbox_name: str = "sandbox",
                  forkserver: ForkServer | None = None, timeout: float = 30.0, test_faults: bool = False,
                  token_store: str | None = None, hosts: dict[str, str] | None = None) -> GymServers:
    """Start the four servers at once (the agent is told the others' addresses up front) and wait for all.

    ``token_store``: where the model server captures each call's TokenEntry (none when not given).
    ``hosts``: the address each server listens on, by role (:data:`ROLES`; 127.0.0.1 for a role not
    given): other loopback addresses (127.0.0.2, ...) stand for other hosts.
    """
    unknown = set(hosts or {}) - set(ROLES)
    if unknown:
        raise ValueError(f"hosts: unknown roles {sorted(unknown)} (expected some of {', '.join(ROLES)})")
    for attempt in range(1, BIND_ATTEMPTS + 1):
        try:
            return _start_servers_once(workdir, token_file, seed=seed, model_slow_ms=model_slow_ms,
                                       resource_slow_ms=resource_slow_ms, commit_delay_ms=commit_delay_ms,
                                       model_name=model_name, agent_name=agent_name, resource_name=resource_name,
                                       sandbox_name=sandbox_name, forkserver=forkserver, timeout=timeout,
                                       test_faults=test_faults, token_store=token_store, hosts=hosts or {})
        except ServerFailed as exc:
            # The ports are picked before the servers bind them (the agent is told them up front): another
            # process may take one in between. Then all four start again on fresh ports.
            if "Address already in use" not in str(exc) or attempt == BIND_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _start_servers_once(workdir: Path, token_file: Path, *, seed: int, model_slow_ms: int, resource_slow_ms: int,
                        commit_delay_ms: int, model_name: str, agent_name: str, resource_name: str,
                        sandbox_name: str, forkserver: ForkServer | None, timeout: float, test_faults: bool,
                        token_store: str | None, hosts: dict[str, str]) -> GymServers:
    host = {role: hosts.get(role, LOCALHOST) for role in ROLES}
    model_port, resource_port, sandbox_port = free_ports([host["model"], host["resource"], host["sandbox"]])
    common = {"forkserver": forkserver}
    started = [
        launch("model", model_name, workdir, token_file, port=model_port, seed=seed, slow_ms=model_slow_ms,
               commit_delay_ms=commit_delay_ms, token_store=token_store, host=host["model"], **common),
        launch("resource", resource_name, workdir, token_file, port=resource_port, slow_ms=resource_slow_ms,
               test_faults=test_faults, host=host["resource"], **common),
        launch("resource", sandbox_name, workdir, token_file, port=sandbox_port, slow_ms=resource_slow_ms,
               tool="sandbox", host=host["sandbox"], **common),
        launch("agent", agent_name, workdir, token_file, model_url=f"http://{host['model']}:{model_port}",
               resource_url=f"http://{host['resource']}:{resource_port}",
               sandbox_url=f"http://{host['sandbox']}:{sandbox_port}", host=host["agent"], **common),
    ]
    try:
        for s in started:
            s.wait_ready(timeout)
    except BaseException:
        for s in started:
            s.kill()
        raise
    model, resource, sandbox, agent = started
    return GymServers(model=model, agent=agent, resource=resource, sandbox=sandbox)
