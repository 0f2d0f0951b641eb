"""One Ray instance with TransferQueue on it, on 127.0.0.1, for the whole test session.

Started lazily by the first test that asks for ``tq_runtime`` (``tq.init`` takes 10-30 s on a
2-core machine, each actor importing torch), stopped at the end: ``tq.close()`` then
``ray.shutdown()``. The in-memory tests never start it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator import ray_runtime  # sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before anything imports ray


@pytest.fixture(scope="session")
def tq_runtime() -> Iterator[ray_runtime.RayRuntime]:
    runtime = ray_runtime.start(num_cpus=2, object_store_memory=256 << 20, log_to_driver=False)
    try:
        yield runtime
    finally:
        runtime.close()
