"""A TransferQueue data plane on the session's real TQ (``tq_runtime``), emptied before and after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dataplane_contract import TOKEN_PARTITION

from coordinator.dataplane.tq.adapter import TQDataPlane


@pytest.fixture
def tq_plane(tq_runtime) -> Iterator[TQDataPlane]:
    plane = TQDataPlane(token_capture_partitions={TOKEN_PARTITION})
    plane.clear()
    yield plane
    plane.clear()
