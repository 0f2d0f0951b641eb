"""One Ray instance with TransferQueue on it, on 127.0.0.1, for the whole test session.

Started lazily by the first test that asks for ``tq_runtime`` (``tq.init`` takes 10-30 s on a
2-core machine, each actor importing torch), stopped at the end: ``tq.close()`` then
``ray.shutdown()``. The in-memory tests never start it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from coordinator import ray_runtime

# This conftest is an entry point that starts Ray: Ray on loopback, single-user, set before any test module here
# (or anything they import) imports ray or transfer_queue.
ray_runtime.configure()

# Ray's memory monitor kills worker processes of its own instance when the *machine* is short of memory,
# whoever uses it: on a shared machine it once killed this session's TransferQueue actors (and so every
# row) because another process was large. The tests want a clear failure, not silently lost actors.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")


@pytest.fixture(scope="session")
def tq_runtime() -> Iterator[ray_runtime.RayRuntime]:
    runtime = ray_runtime.start(num_cpus=2, object_store_memory=256 << 20, log_to_driver=False)
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.fixture
def fleet(tmp_path, forkserver):
    """Reference Gym servers for one test (forked; SIGKILLed at teardown)."""
    from devtools.gym_fleet import new_fleet

    f = new_fleet(tmp_path / "fleet", forkserver)
    yield f
    f.close()


@pytest.fixture(scope="session")
def reference_rows(tmp_path_factory, forkserver, tq_runtime):
    """The final data-plane content of an uninterrupted run of the harness workload (no snapshots)."""

    from harness import CONFIG, InRayJob

    from devtools.accounting import content
    from devtools.gym_fleet import new_fleet

    f = new_fleet(tmp_path_factory.mktemp("reference"), forkserver)
    try:
        job = InRayJob(f, str(tmp_path_factory.mktemp("reference-store")),
                       config=CONFIG.without_snapshots())
        assert job.setup() is None
        outcome = job.run()
        assert outcome.done and not outcome.saves
        tables = job.call("data_plane_tables")
        job.kill()
        return content(tables)
    finally:
        f.close()
