"""The property every fuzzer checks, and the settings every fuzzer runs with.

Property: reading untrusted bytes ends in a result or in the library's typed error
(:class:`~schemas.errors.SnapshotError`), never another exception, never a hang (each module has
a timeout mark) and never memory far beyond the input: each read runs under an address-space
limit of :data:`HEADROOM` above what the process already maps, so a reader that allocates what a
header *declares* (a zstd or Arrow bomb) fails with ``MemoryError`` instead of passing quietly.

The hypothesis profile is registered here, not loaded globally, so the other suites keep their own
settings. In ``make test`` (no ``FUZZ_EXAMPLES``) examples are derandomized: a run is repeatable
and CI cannot fail on a draw nobody can replay. ``make fuzz`` sets ``FUZZ_EXAMPLES`` and draws
fresh examples each run (failures are kept in ``.hypothesis/`` and replayed first next time).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings

from schemas.errors import SnapshotError

PROFILE = "snapformat-fuzz"
DEFAULT_EXAMPLES = 150
_requested = os.environ.get("FUZZ_EXAMPLES")
EXAMPLES = int(_requested) if _requested else DEFAULT_EXAMPLES

settings.register_profile(
    PROFILE,
    max_examples=EXAMPLES,
    deadline=None,  # a slow example is not a bug; a hang is caught by the timeout mark
    derandomize=not _requested,
    # Seeds are real files of up to ~30 KB: drawing mutations of them is "large" by design.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FUZZ = settings.get_profile(PROFILE)

#: Per test: generous for the default examples, scaled for ``make fuzz``.
TIMEOUT = pytest.mark.timeout(120 + EXAMPLES // 10)

#: Address space a single read may add. Inputs are at most ~100 KB, so a read that needs more than
#: this allocates for what a header claims, not for what the bytes hold. It stays well above what a
#: legitimate read of the seeds maps (Arrow's and zstd's buffers, a thread's stack and arena).
HEADROOM = 1 << 30

T = TypeVar("T")


def _mapped_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_limit(headroom: int = HEADROOM) -> Iterator[None]:
    """Cap the process's address space at what it maps now plus ``headroom`` (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def typed_or_result(read: Callable[[], T], headroom: int = HEADROOM) -> T | SnapshotError:
    """Run ``read`` under the memory cap; return its result or the typed error it raised.

    Any other exception (``MemoryError`` included) propagates, so hypothesis reports and shrinks
    the input that caused it.
    """
    with address_space_limit(headroom):
        try:
            return read()
        except SnapshotError as exc:
            return exc
