"""Fixtures for the reference Gym tests: real server processes on 127.0.0.1, SIGKILLed at teardown.

Servers are forked from one fork server per session (it imports the code once; each server is
still its own process). All model servers use one model seed, so two runs of the same rollout spec
must produce the same trajectory; ``reference`` runs each spec once, uninterrupted, on servers of
its own.
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


@pytest.fixture(scope="module")
def module_fleet(tmp_path_factory: pytest.TempPathFactory, forkserver: ForkServer) -> Iterator[Fleet]:
    f = new_fleet(tmp_path_factory.mktemp("fleet"), forkserver)
    yield f
    f.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory,
              forkserver: ForkServer) -> Iterator[Callable[[list[Spec]], dict[str, dict[str, Any]]]]:
    """``reference(specs)``: each spec's final result from an uninterrupted run (run once, cached)."""
    f = new_fleet(tmp_path_factory.mktemp("reference"), forkserver)
    gym: Gym | None = None
    done: dict[str, tuple[Spec, dict[str, Any]]] = {}

    def run(specs: list[Spec]) -> dict[str, dict[str, Any]]:
        nonlocal gym
        todo = [s for s in specs if s.rollout_id not in done]
        if todo:
            gym = gym or f.gym()
            gym.start(todo)
            results = gym.wait_results([s.rollout_id for s in todo])
            gym.agent.acknowledge([(rid, 0) for rid in results])  # forget them: ids stay reusable
            for s in todo:
                assert results[s.rollout_id]["outcome"] == "finished", results[s.rollout_id]
                done[s.rollout_id] = (s, results[s.rollout_id])
        for s in specs:
            assert done[s.rollout_id][0] == s, f"{s.rollout_id} is used with two different specs"
        return {s.rollout_id: done[s.rollout_id][1] for s in specs}

    yield run
    f.close()
