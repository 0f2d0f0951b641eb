"""A fork server: import the servers' code once, then fork each server process from it.

Starting a server as ``python -m refgym.serve`` pays for a fresh interpreter and its imports
(FastAPI, pyarrow, numpy): seconds each on a busy 2-core machine, and the tests start dozens.
Forking a process that has already imported them costs milliseconds. Each forked server is still
its own process running ``refgym.serve.main`` (uvicorn on 127.0.0.1), killed alone by SIGKILL.

The fork server stays single-threaded so that forking it is safe: OpenBLAS gets one thread and
Arrow's jemalloc no background thread (both through the environment, before any import). It reads
one JSON request per line on stdin (``{"argv": [...], "log": path}``), answers ``{"pid": N}`` on
stdout, and reaps its children as they exit, so a killed server's pid disappears promptly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from devtools.checkout import child_env

#: Settings that keep the fork server single-threaded (checked at start-up).
SINGLE_THREADED_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                       "JE_ARROW_MALLOC_CONF": "background_thread:false"}


def _reap(signum: int, frame: object) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _child(argv: list[str], log: str) -> None:
    """In the forked child: point stdio at the log, run the server, never return."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        from refgym import serve

        code = serve.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    import refgym.agent_server  # noqa: F401  (the expensive imports, done once)
    import refgym.model_server  # noqa: F401
    import refgym.resource_server  # noqa: F401
    import refgym.serve  # noqa: F401

    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads != 1:
        sys.exit(f"fork server: {threads} threads after imports; forking would not be safe")
    signal.signal(signal.SIGCHLD, _reap)
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req["argv"], req["log"])
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


class ForkServer:
    """The launcher's side: start the fork server, ask it for server processes."""

    def __init__(self, repo_root: Path, timeout: float = 120.0) -> None:
        env = child_env(dict(os.environ) | SINGLE_THREADED_ENV, repo_root)
        self.proc = subprocess.Popen([sys.executable, "-m", "devtools.gym_forkserver"], cwd=repo_root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()
        self._read(timeout)  # the imports are done once it says ready

    def _read(self, timeout: float) -> dict:
        """One answer line, bounded by ``timeout`` (a reader thread, so a hung server cannot hang us)."""
        box: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"fork server did not answer within {timeout}s (exit code {self.proc.poll()})")
        return json.loads(box[0])

    def spawn(self, argv: list[str], log: Path, timeout: float = 30.0) -> int:
        """Fork a server running ``refgym.serve.main(argv)`` with stdout and stderr in ``log``; its pid."""
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
            self.proc.stdin.flush()
            return int(self._read(timeout)["pid"])

    def close(self) -> None:
        """Kill the fork server itself (its children are killed by whoever started them)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


if __name__ == "__main__":
    main()
