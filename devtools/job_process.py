"""A training job (``python -m devtools.job``) as a real process tree that can be SIGKILLed whole.

The job runs in a session of its own; Ray's processes and the Gym servers it starts are its
descendants. :meth:`JobProcess.kill` SIGKILLs every process of that tree at once (found through
/proc: the job's session and every descendant, in case one started a session of its own), which
is what a machine failure does to a job: nothing is flushed, closed or resumed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from devtools.checkout import REPO_ROOT, child_env


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, session id)`` of ``pid``, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[3])


def process_tree(root: int, session: int | None = None) -> list[int]:
    """``root``, its descendants, and, when ``root`` leads a session of its own (as a job started by
    :class:`JobProcess` does), every process left in that session (reparented ones too). ``session``:
    a session id to sweep as well, known to be ours (``root``'s own, once ``root`` has exited)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            table[int(entry)] = st
    found = {root}
    if table.get(root, (0, -1))[1] == root:
        found |= {pid for pid, (_, sid) in table.items() if sid == root}
    if session is not None:
        found |= {pid for pid, (_, sid) in table.items() if sid == session}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _) in table.items():
            if ppid in found and pid not in found:
                found.add(pid)
                changed = True
    return sorted(found)


class JobProcess:
    """One ``devtools.job`` process and its output log."""

    def __init__(self, store: str, workdir: Path, *, config: Any = None, workload: Any = None,
                 crash_plan: Any = None, model_slow_ms: int = 0, outcome: Path | None = None,
                 extra: list[str] | None = None, log_name: str = "job.log") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.outcome_path = outcome
        self.log_path = workdir / log_name
        argv = [sys.executable, "-m", "devtools.job", "--store", store, "--workdir", str(workdir),
                "--model-slow-ms", str(model_slow_ms)]
        for flag, value in (("--config", config), ("--workload", workload), ("--crash-plan", crash_plan)):
            if value is not None:
                argv += [flag, msgspec.json.encode(value).decode()]
        if outcome is not None:
            argv += ["--outcome", str(outcome)]
        argv += extra or []
        env = child_env()
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float) -> Any:
        """Poll ``predicate`` until truthy; fail naming ``what`` (with the log's tail) on timeout or exit."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = predicate()
            if value:
                return value
            if self.exited():
                self.kill()  # what it left in its session, then reaped
                raise RuntimeError(f"job exited ({self.popen.returncode}) before {what}:\n{self.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}:\n{self.tail()}")

    def exited(self) -> bool:
        """Whether the job's process has exited, without reaping it (its pid, which is also its
        session's id, stays reserved for :meth:`kill` to find what it left)."""
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.lines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self) -> list[int]:
        """SIGKILL the whole job at once (what is left of it, if it has exited) and reap it; returns
        the pids signalled. Waits until they are gone. Once the job has been reaped its pid may belong
        to another process: nothing is signalled then (reaping here, or in :meth:`wait`, came after
        the sweep)."""
        if self.popen.returncode is not None:
            return []
        # The job leads a session of its own (start_new_session) and its pid stays reserved until
        # reaped below: its descendants and whatever it left in that session are found.
        pids = process_tree(self.pid, session=self.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)
        end = time.monotonic() + 30
        while any(_stat(p) is not None and not _zombie(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        if not self._log.closed:
            self._log.close()
        return pids

    def wait(self, timeout: float) -> int:
        """The job's exit code once it exits; whatever it left in its session (a server it did not
        stop) is SIGKILLed as it is reaped. Past ``timeout`` it is killed whole: TimeoutError."""
        end = time.monotonic() + timeout
        while not self.exited():
            if time.monotonic() > end:
                self.kill()
                raise TimeoutError(f"job still running after {timeout}s (killed):\n{self.tail()}")
            time.sleep(0.05)
        self.kill()
        return self.popen.returncode

    def outcome(self) -> dict[str, Any]:
        assert self.outcome_path is not None
        return json.loads(self.outcome_path.read_text())


def _zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")
