"""The background writer: step 4 of a ``background`` save (write the cut's parts, publish), on a
thread of its own while rollouts run, one save at a time.

What a crash leaves: the write goes into a draft no commit names until ``save.published``, so a
crash before it leaves that draft (GC removes it) and the previous snapshot still the newest; Gym
was resumed before the write began and holds nothing for it. A crash after it leaves the new
snapshot. A write that fails (rather than crashes) abandons its draft and is reported as an
``aborted`` outcome: nothing is published.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from coordinator.checkpoint.outcomes import SaveOutcome
from coordinator.checkpoint.save import PendingWrite


class BackgroundWriter:
    """Runs ``finish`` (write and publish; it reports failures as outcomes, never raises) for one
    pending write at a time, in a thread, and hands each outcome to ``on_done`` from that thread.

    :meth:`submit` waits for the previous write to finish first (one in flight)."""

    def __init__(self, finish: Callable[[PendingWrite], SaveOutcome], on_done: Callable[[SaveOutcome], None]) -> None:
        self._finish = finish
        self._on_done = on_done
        self._thread: threading.Thread | None = None
        self._last: SaveOutcome | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SaveOutcome | None:
        """Wait for the write in flight (if any); the outcome of the newest finished write."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._last

    def submit(self, p: PendingWrite) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(p,),
                                        name=f"snapshot-writer-{p.progress.checkpoint_id}", daemon=True)
        self._thread.start()

    def _run(self, p: PendingWrite) -> None:
        outcome = self._finish(p)
        self._last = outcome
        self._on_done(outcome)
