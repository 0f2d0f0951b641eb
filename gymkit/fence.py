"""The checkpoint fence: one per server process, shared by all of its control routes (CONTROL.md §2-3).

A fenced operation is keyed by ``(checkpoint_id, operation)``:

* a repeat of a recorded operation returns the recorded result; a concurrent duplicate awaits
  the first run and gets its result (or its error);
* a failure is not recorded: the phase goes back to where it was (or ``phase_on_failure``), the
  active id is cleared if the operation started from ``idle``, and a retry runs again;
* another id while one is active is 409 ``checkpoint_conflict``; a phase the operation does not
  allow is 409 ``invalid_phase``;
* resume *retires* its id (phase ``idle``, no active id). A retired id is kept forever: only its
  resume result still replays, any other operation with it is 409 ``stale_checkpoint``.

Deadlines are never refused on entry; :func:`time_left` clamps at 0.

While the phase is not ``idle`` the fence holds Python's cyclic collector off
(:class:`gymkit.collector.HeldWhile`): a full collection in a pause walks the whole heap on the
pause's critical path. The hold ends when the phase is ``idle`` again, or when the fence itself is
dropped.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gymkit.collector import HeldWhile

T = TypeVar("T")


class ControlError(Exception):
    """A refused control call: 409 ``{"error": {"code", "detail"}}`` (``status`` only differs for the
    data-plane refusals that share the envelope)."""

    def __init__(self, code: str, detail: str, status: int = 409, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.status = status
        self.headers = headers or {}


def time_left(deadline_ts: float) -> float:
    """Seconds until ``deadline_ts`` (absolute Unix seconds), never below 0."""
    return max(0.0, deadline_ts - time.time())


class Fence:
    """The phase machine of one process and the record of what each (id, operation) answered."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.active_checkpoint_id: str | None = None
        self.deadline_ts: float | None = None
        self._retired: set[str] = set()
        self._retired_by: dict[str, str] = {}  # the resume operation whose result still replays
        self._results: dict[tuple[str, str], Any] = {}
        self._running: dict[tuple[str, str], asyncio.Future] = {}
        self._lock = asyncio.Lock()
        self._changed: asyncio.Event = asyncio.Event()
        self.listeners: list[Callable[[str], None]] = []  # told of every phase change (admission follows it)
        self.collector = HeldWhile()  # held while the phase is not idle (module docstring)
        # A fence dropped in mid-checkpoint (its server gone) must not hold the process's collector
        # forever; the finalizer refers to the hold, not to the fence.
        weakref.finalize(self, self.collector.set, False)

    # -- inspection ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The live fields capabilities merge in: ``phase``, ``active_checkpoint_id``, ``deadline_ts``."""
        return {"phase": self.phase, "active_checkpoint_id": self.active_checkpoint_id,
                "deadline_ts": self.deadline_ts}

    def retired(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._retired

    def check(self, checkpoint_id: str, allowed: tuple[str, ...] | None = None) -> None:
        """The checks of an unfenced route: stale id, conflicting id, and (if given) the phase."""
        if checkpoint_id in self._retired:
            raise ControlError("stale_checkpoint", f"checkpoint {checkpoint_id!r} was retired by its resume")
        if self.active_checkpoint_id not in (None, checkpoint_id):
            raise ControlError("checkpoint_conflict", f"checkpoint {self.active_checkpoint_id!r} is active; "
                                                      f"{checkpoint_id!r} refused")
        if allowed is not None and self.phase not in allowed:
            raise ControlError("invalid_phase", f"phase {self.phase!r} does not allow this (allowed: "
                                                f"{', '.join(allowed)})")

    # -- transitions ------------------------------------------------------------------------------
    def set_phase(self, phase: str, checkpoint_id: str | None, deadline_ts: float | None = None) -> None:
        """Move the machine (used by the route families for transitions outside :meth:`run`, such as
        the model's ``preparing -> prepared`` once admission is paused)."""
        self.phase, self.active_checkpoint_id = phase, checkpoint_id
        self.collector.set(phase != "idle")
        if checkpoint_id is None:
            self.deadline_ts = None
        elif deadline_ts is not None:
            self.deadline_ts = deadline_ts
        for listener in self.listeners:
            listener(phase)
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        """Return at the next phase change."""
        await self._changed.wait()

    def _still_mine(self, checkpoint_id: str) -> bool:
        return checkpoint_id not in self._retired and self.active_checkpoint_id in (None, checkpoint_id)

    async def run(self, checkpoint_id: str, operation: str, fn: Callable[[], Awaitable[T]], *,
                  allowed: tuple[str, ...], entering: str | None, success: str | None,
                  deadline_ts: float | None = None, phase_on_failure: str | None = None,
                  retire: bool = False) -> T:
        """Run one fenced operation (see the module docstring). ``entering`` is the phase while ``fn``
        runs (None: unchanged); ``success`` the phase after it (None: unchanged); ``retire`` retires the id
        on success. An operation whose id was retired (or displaced) while it ran leaves the phase alone."""
        key = (checkpoint_id, operation)
        async with self._lock:
            if checkpoint_id in self._retired and self._retired_by.get(checkpoint_id) != operation:
                raise ControlError("stale_checkpoint", f"checkpoint {checkpoint_id!r} was retired by its resume")
            if key in self._results:
                return self._results[key]
            if (running := self._running.get(key)) is None:
                self.check(checkpoint_id, allowed)
                entry_phase, entry_id = self.phase, self.active_checkpoint_id
                running = asyncio.get_running_loop().create_future()
                self._running[key] = running
                if entering is not None:
                    self.set_phase(entering, checkpoint_id, deadline_ts)
                elif self.active_checkpoint_id is None:
                    self.set_phase(self.phase, checkpoint_id, deadline_ts)
                first = True
            else:
                first = False
        if not first:
            return await asyncio.shield(running)
        try:
            result = await fn()
        except BaseException as exc:
            async with self._lock:
                del self._running[key]
                # The phase goes back to where it was (or phase_on_failure); the id stays active only
                # if it was before (an operation from idle leaves no active id behind). A resume that
                # retired the id meanwhile (or another id now active) owns the phase: leave it.
                if self._still_mine(checkpoint_id):
                    self.set_phase(phase_on_failure or entry_phase, None if entry_phase == "idle" else entry_id)
            if not running.done():
                running.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
                running.exception()  # retrieved: a duplicate that never came must not warn
            raise
        async with self._lock:
            del self._running[key]
            self._results[key] = result
            if retire:
                self._retired.add(checkpoint_id)
                self._retired_by[checkpoint_id] = operation
                self.set_phase("idle", None)
            elif self._still_mine(checkpoint_id):
                self.set_phase(self.phase if success is None else success, checkpoint_id, deadline_ts)
        running.set_result(result)
        return result
