"""The test servers' process handle: a kill that finds the server already gone is no error (a
whole job's crash can take a forked server down between the look and the SIGKILL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.gym_procs import ServerProcess


def test_a_kill_that_races_the_servers_own_end_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_such_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # never a process's
    server = ServerProcess("resource", "tools", no_such_pid, tmp_path / "port", tmp_path / "log")
    looks = iter([True])  # alive at the look (the race); the SIGKILL then finds no such process
    monkeypatch.setattr(ServerProcess, "alive", lambda self: next(looks))
    server.kill(timeout=1.0)  # returns: gone is what a kill wants (it raised ProcessLookupError)
