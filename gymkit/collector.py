"""Python's cyclic garbage collector, held off while a participant commits or restores.

A commit or a restore allocates objects per rollout (records, rows, digests, file names) in a process
whose heap already holds every rollout's state. Once enough of them survive a young collection,
Python runs a full one, and a full collection walks the whole heap. The reference model server's
commit, in-process, held off against not (medians of 5, ``python -m benchmarks.scale_bench
--model-commit N``): 0.41 against 0.51 s at 10,000 rollouts, 4.55 against 5.31 s at 100,000
(``benchmarks/results/scale_collector.md``). Every participant's commit is inside the pause.

Held off, that walk waits until the step is over. Reference counting still frees every object
that is not part of a cycle as soon as it is dropped, so what waits is only the step's cyclic
garbage. The collector's counts go on growing meanwhile; the next allocation after the step runs a
young collection of what the step left alive, and the older collections follow by Python's own
rule. A commit leaves little alive (its reply). A restore leaves the whole restored state, which
those collections then walk, a few times, where without the hold the full collections walked it
again and again while it grew: at 100,000 rollouts they land in the resume that follows (1.04 s
against 0.22 s, one run each).

The collector is the process's, so the hold is too: holds nest and overlap (several servers in one
process, a commit on a worker thread), and the collector is enabled again when the last one ends,
and only if it was enabled when the first began (a server that turned it off keeps it off).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_held", "holds"]

_lock = threading.Lock()
_holds = 0
_was_enabled = False


def holds() -> int:
    """How many :func:`collector_held` blocks are open in this process now."""
    return _holds


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Run the block with Python's cyclic collector disabled (see the module docstring)."""
    global _holds, _was_enabled
    with _lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
            if _holds == 0 and _was_enabled:
                gc.enable()
