"""Python's cyclic garbage collector, held off while a checkpoint is under way.

Each participant's fence holds it from the moment the participant leaves ``idle`` until it is
``idle`` again (**A whole checkpoint**, below), so every commit and restore runs inside that hold;
a restore adds a kept hold of its own (``collector_held(keep=True)``) to freeze what it leaves
alive. Why, step by step:

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
rule. A commit leaves little alive (its reply).

A restore leaves the whole restored state alive, and those collections would walk all of it, a few
times, in the resume that follows (at 100,000 rollouts: 1.04 s against 0.22 s without the hold, one
run each). So a restore holds with ``keep=True``: what it leaves alive is the process's long-lived
state, and when the last hold ends after a kept block succeeded (with the fence's hold below: at the
resume), ``gc.freeze()`` moves every object then alive into Python's permanent generation, which no
collection walks again, neither in the resume nor in any full collection of the run after it. The
reference model's restore of 100,000 rollouts in a fresh process, then 300,000 objects that live on:
``python -m benchmarks.scale_bench --model-restore 100000`` (``benchmarks/results/scale_freeze.md``).
Reference counting still frees a frozen object once it is dropped. The cost: a reference cycle among
the objects alive at the freeze is never collected. A restore is rare (Gym's participants restore
when idle, the resources servers only in a fresh process), so that is bounded by the cycles alive at
a few moments of a run.

The collector is the process's, so the hold is too: holds nest and overlap (several servers in one
process, a commit on a worker thread), and the collector is enabled again when the last one ends,
and only if it was enabled when the first began (a server that turned it off keeps it off). The
freeze waits for the last hold too, so a step still running in another hold is over before anything
is frozen.

**A whole checkpoint.** A participant's fence holds the collector from the moment it leaves ``idle``
(its prepare, or a restore) until it is ``idle`` again (its resume, an abort, or a failure that
leaves no checkpoint active): :class:`HeldWhile`, which :class:`gymkit.fence.Fence` owns. Every
participant of a pause is on the pause's critical path, and a full collection there walks the
whole heap to find next to nothing: at 10 agent servers and 10,000 parked rollouts, every host
process ran one in each pause (most of them just after the commit step, the others in the prepare),
0.08-0.25 CPU-seconds each, a few thousand objects collected. Held, those collections run once the
last participant of the process has resumed, while the rollouts run again: the prepare took 0.86x
at 10,000 rollouts, and at 100,000 (50 servers per host process) the resume 5.04 -> 1.89 s
(``benchmarks/results/scale_pause_hold.md``). What waits meanwhile is the pause's cyclic garbage,
bounded by the work a pause does (the turns in flight finishing, the commit, the resume's replies).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["CollectorHold", "HeldWhile", "collector_held", "hold", "holds"]

_lock = threading.Lock()
_holds = 0
_was_enabled = False
_freeze_when_released = False


def holds() -> int:
    """How many holds (:func:`hold`, :func:`collector_held`) are open in this process now."""
    return _holds


class CollectorHold:
    """One open hold of the collector (:func:`hold`); :meth:`release` ends it, once."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self._open = True

    def release(self, *, succeeded: bool = True) -> None:
        """End this hold (a second call does nothing). If it was taken with ``keep`` and
        ``succeeded``, the last hold of the process to end freezes every object then alive."""
        global _holds, _freeze_when_released
        with _lock:
            if not self._open:
                return
            self._open = False
            _holds -= 1
            _freeze_when_released |= self.keep and succeeded
            if _holds == 0:
                if _freeze_when_released:
                    _freeze_when_released = False
                    gc.freeze()
                if _was_enabled:
                    gc.enable()


def hold(*, keep: bool = False) -> CollectorHold:
    """Hold Python's cyclic collector off until the returned hold is released (see the module
    docstring); ``keep`` as in :func:`collector_held`."""
    global _holds, _was_enabled
    with _lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holds += 1
    return CollectorHold(keep)


@contextlib.contextmanager
def collector_held(*, keep: bool = False) -> Iterator[None]:
    """Run the block with Python's cyclic collector disabled (see the module docstring). ``keep``:
    what the block leaves alive is long-lived (a restore's state); if it ends without an exception,
    the last hold to end freezes every object then alive (``gc.freeze()``)."""
    held = hold(keep=keep)
    ok = False
    try:
        yield
        ok = True
    finally:
        held.release(succeeded=ok)


class HeldWhile:
    """A hold its owner turns on and off with its own state (a fence: held while a checkpoint is
    under way). :meth:`set` takes a hold if there is none and ``held``, and releases it if there is
    one and not ``held``; so repeated calls with the same value change nothing."""

    def __init__(self) -> None:
        self._hold: CollectorHold | None = None

    def set(self, held: bool) -> None:
        if held and self._hold is None:
            self._hold = hold()
        elif not held and self._hold is not None:
            self._hold, open_hold = None, self._hold
            open_hold.release()
