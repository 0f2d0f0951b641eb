"""Several reference Gym servers in one process, each on its own port of 127.0.0.1 (issue 22 §2).

A scale run needs 100 agent servers and as many resources servers; a uvicorn process each would be
200 interpreters on a 2-core machine. Here one process (one event loop) serves many of them: each
server is the unchanged ``refgym`` FastAPI app (its own :class:`~gymkit.fence.Fence`, admission and
state, so each speaks the full control protocol alone) behind its own ``uvicorn.Server`` on its own
listening socket. SIGKILLing the process is the crash of every server it hosts. What the servers of a
process share is read-only and derived from bytes on disk: the resources servers' restores read the
agents' dependency indexes once (:mod:`gymkit.agent_dependencies`).

    python -m devtools.gym_multihost --spec spec.json --ready ready.json

``spec.json`` (:class:`HostSpec`) names the servers: an optional policy model, and pairs of an agent
and the ``notes`` resources server it uses (both hosted here, the agent calling it over HTTP like
any other). ``model_url`` is the policy model the agents call (hosted here or elsewhere). Once every
server listens, ``ready.json`` receives ``{"pid", "servers": {name: url}}`` (written atomically).
:class:`MultiHost` is the launcher's side: start, wait until ready (bounded), SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from devtools.checkout import REPO_ROOT, child_env

HOST = "127.0.0.1"
KEEP_ALIVE_S = 30  # refgym.serve's: longer than any client keeps an idle connection


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    seed: int = 7
    slow_ms: int = 0


class PairSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An agent server and the resources server (tool ``notes``, export_restore) it calls."""

    agent: str
    resource: str


class HostSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one host process serves. ``model_url`` is needed when pairs are given and no model is."""

    token_file: str
    model: ModelSpec | None = None
    model_url: str | None = None
    pairs: list[PairSpec] = []
    resource_slow_ms: int = 0
    host: str = HOST


class Ready(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    servers: dict[str, str]  # server name -> URL


async def _serve(spec: HostSpec, ready_path: Path) -> None:
    import uvicorn

    from gymkit.agent_dependencies import AgentDependencies
    from refgym.agent_server import create_app as agent_app
    from refgym.model_server import create_app as model_app
    from refgym.resource_server import create_app as resource_app
    from refgym.serve import bind

    # Gym's kits run commits and restores in ``asyncio.to_thread``: the servers hosted here share the
    # loop's default pool, so their commits and restores run at once, as those of one server per
    # process would. (Such hosts used to die of a SIGSEGV in msgspec when two threads built the first
    # decoder of a record type at once; ``snapformat.jsonl.decoder`` now builds them under a lock.)
    token = Path(spec.token_file).read_text().strip()
    socks, apps, urls = [], [], {}

    def listen(name: str) -> Any:  # the socket, bound before any app needs the URL
        sock = bind(0, spec.host)
        urls[name] = f"http://{spec.host}:{sock.getsockname()[1]}"
        socks.append(sock)
        return sock

    model_url = spec.model_url
    if spec.model is not None:
        listen(spec.model.name)
        apps.append(model_app(spec.model.name, token, seed=spec.model.seed, slow_ms=spec.model.slow_ms))
        model_url = urls[spec.model.name]
    if spec.pairs and not model_url:
        raise SystemExit("agents need a model: give model or model_url")
    dependencies = AgentDependencies()  # the resources servers' restores read the agents' indexes once
    for p in spec.pairs:
        listen(p.resource)
        apps.append(resource_app(p.resource, token, kind="notes", slow_ms=spec.resource_slow_ms,
                                 dependencies=dependencies))
    for p in spec.pairs:
        listen(p.agent)
        apps.append(agent_app(p.agent, token, model_url=model_url, tool_urls={"notes": urls[p.resource]}))
    servers = [uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                             timeout_keep_alive=KEEP_ALIVE_S)) for app in apps]
    tasks = [asyncio.create_task(s.serve(sockets=[sock])) for s, sock in zip(servers, socks)]
    while not all(s.started for s in servers):  # bounded by the launcher's wait (it kills us)
        if any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            raise SystemExit("a server stopped while starting")
        await asyncio.sleep(0.01)
    tmp = ready_path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(Ready(pid=os.getpid(), servers=urls)))
    os.replace(tmp, ready_path)
    await asyncio.gather(*tasks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.gym_multihost", description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="a HostSpec JSON file")
    p.add_argument("--ready", required=True, help="where to write the Ready JSON once every server listens")
    args = p.parse_args(argv)
    spec = msgspec.json.decode(Path(args.spec).read_bytes(), type=HostSpec)
    try:
        import uvloop  # uvicorn's own choice when installed
    except ImportError:
        uvloop = None
    # Run outside the except clause: else every error the servers log carries the ImportError as
    # its context ("During handling of the above exception...").
    (uvloop.run if uvloop is not None else asyncio.run)(_serve(spec, Path(args.ready)))
    return 0


@dataclass
class MultiHost:
    """One host process started by :func:`launch`; its servers' URLs once :meth:`wait_ready` returns."""

    popen: subprocess.Popen
    ready_path: Path
    log_path: Path
    servers: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_ready(self, timeout: float = 120.0) -> MultiHost:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise RuntimeError(f"gym host (pid {self.pid}) exited {self.popen.returncode}:\n{self._tail()}")
            if self.ready_path.exists():
                self.servers = msgspec.json.decode(self.ready_path.read_bytes(), type=Ready).servers
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"gym host (pid {self.pid}) not ready after {timeout}s:\n{self._tail()}")

    def _tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL (a crash of every server hosted: nothing flushed) and reap."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)


def launch(spec: HostSpec, workdir: Path, stem: str) -> MultiHost:
    """Start a host process for ``spec`` (not yet ready: call :meth:`MultiHost.wait_ready`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, ready, log = (workdir / f"{stem}.spec.json", workdir / f"{stem}.ready.json", workdir / f"{stem}.log")
    spec_path.write_bytes(msgspec.json.encode(spec))
    ready.unlink(missing_ok=True)
    env = child_env()
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "devtools.gym_multihost", "--spec", str(spec_path),
                                  "--ready", str(ready)], cwd=REPO_ROOT, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return MultiHost(popen, ready, log)


if __name__ == "__main__":
    sys.exit(main())
