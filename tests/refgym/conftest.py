"""Fixtures for the reference Gym tests: real server processes on 127.0.0.1, SIGKILLed at teardown.

Servers are forked from one fork server per session (it imports the code once; each server is
still its own process, and a deployment of four starts in well under a second). All model servers
use one model seed, so two runs of the same rollout spec produce the same trajectory.

* ``session_fleet``/``gym``: one deployment for the whole session (the wire-conformance suite runs
  against it); every test leaves it idle, and uses checkpoint and rollout ids of its own (the fence
  keeps retired ids for the life of the process, and acknowledged attempts stay stale).
* ``fleet``: a fleet of one test, for fresh deployments (restores need fresh processes).
* ``reference(specs)``: each spec's result from an uninterrupted run, on servers of its own (cached).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.gym_fleet import Fleet, Gym, Spec, new_fleet
from devtools.gym_forkserver import ForkServer


@pytest.fixture
def fleet(tmp_path: Path, forkserver: ForkServer) -> Iterator[Fleet]:
    f = new_fleet(tmp_path / "fleet", forkserver)
    yield f
    f.close()


@pytest.fixture(scope="session")
def session_fleet(tmp_path_factory: pytest.TempPathFactory, forkserver: ForkServer) -> Iterator[Fleet]:
    f = new_fleet(tmp_path_factory.mktemp("session-fleet"), forkserver)
    yield f
    f.close()


@pytest.fixture(scope="session")
def gym(session_fleet: Fleet) -> Gym:
    """The session's deployment: a model slow enough (100 ms a call) that a snapshot catches rollouts
    mid-flight."""
    return session_fleet.gym(model_slow_ms=100)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory,
              forkserver: ForkServer) -> Iterator[Callable[[list[Spec]], dict[str, dict[str, Any]]]]:
    """``reference(specs)``: each spec's final result from an uninterrupted run (run once, cached)."""
    f = new_fleet(tmp_path_factory.mktemp("reference"), forkserver)
    deployment: Gym | None = None
    done: dict[str, tuple[Spec, dict[str, Any]]] = {}

    def run(specs: list[Spec]) -> dict[str, dict[str, Any]]:
        nonlocal deployment
        todo = [s for s in specs if s.rollout_id not in done]
        if todo:
            deployment = deployment or f.gym()
            deployment.start(todo)
            results = deployment.wait_results([s.rollout_id for s in todo])
            deployment.acknowledge(results.values())  # the agent forgets them
            for s in todo:
                assert results[s.rollout_id]["outcome"] == "finished", results[s.rollout_id]
                done[s.rollout_id] = (s, results[s.rollout_id])
        for s in specs:
            assert done[s.rollout_id][0] == s, f"{s.rollout_id} is used with two different specs"
        return {s.rollout_id: done[s.rollout_id][1] for s in specs}

    yield run
    f.close()
