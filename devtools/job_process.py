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

REPO_ROOT = Path(__file__).resolve().parents[1]


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, session id)`` of ``pid``, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[3])


def process_tree(root: int) -> list[int]:
    """``root``, its descendants, and, when ``root`` leads a session of its own (as a job started by
    :class:`JobProcess` does), every process left in that session (reparented ones too)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            table[int(entry)] = st
    found = {root}
    if table.get(root, (0, -1))[1] == root:
        found |= {pid for pid, (_, sid) in table.items() if sid == root}
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
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
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
            if self.popen.poll() is not None:
                raise RuntimeError(f"job exited ({self.popen.returncode}) before {what}:\n{self.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.lines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self) -> list[int]:
        """SIGKILL the whole job at once; returns the pids killed. Waits until they are gone."""
        pids = process_tree(self.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)
        end = time.monotonic() + 30
        while any(_stat(p) is not None and not _zombie(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        self._log.close()
        return pids

    def wait(self, timeout: float) -> int:
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"job still running after {timeout}s (killed):\n{self.tail()}") from None
        self._log.close()
        return rc

    def outcome(self) -> dict[str, Any]:
        assert self.outcome_path is not None
        return json.loads(self.outcome_path.read_text())


def _zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")
