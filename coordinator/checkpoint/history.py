"""What a checkpointer remembers between saves: finished save attempts and the rule that stops a
run whose saves keep failing (:class:`SaveHistory`), and the segments of the newest snapshot it
published or restored (:class:`ParentSegments`), which the next incremental save lists again.

A failed save is logged and counted and the run goes on; ``max_consecutive_failures`` failures in a
row make :meth:`SaveHistory.raise_if_failing` raise :class:`~coordinator.errors.TooManyFailuresError`
(at the controller's next check, in its own thread: a background write's failure arrives from the
writer's thread).
"""

from __future__ import annotations

import threading

from coordinator.checkpoint.outcomes import SaveOutcome, SaveReport
from coordinator.dataplane.segments import SegmentHistory
from coordinator.errors import TooManyFailuresError
from schemas.manifest import ParentRef


class SaveHistory:
    """Finished save attempts (published or aborted), oldest first; thread-safe."""

    def __init__(self, max_consecutive_failures: int) -> None:
        self._max = max_consecutive_failures
        self._lock = threading.Lock()
        self._reports: list[SaveReport] = []
        self._failures = 0
        self._fatal: TooManyFailuresError | None = None

    def record(self, outcome: SaveOutcome) -> None:
        """Add a finished attempt; an ``aborted`` one counts as a failure, a ``published`` one resets the count."""
        if outcome.status == "writing":
            raise ValueError(f"save {outcome.report.checkpoint_id} has not finished: its write is in flight")
        failed = outcome.status == "aborted"
        with self._lock:
            self._reports.append(outcome.report)
            self._failures = self._failures + 1 if failed else 0
            if failed and self._failures >= self._max:
                self._fatal = TooManyFailuresError(
                    f"{self._failures} consecutive save attempts failed (max_consecutive_failures="
                    f"{self._max}); last: {outcome.report.error}")

    def reports(self, start: int = 0) -> list[SaveReport]:
        """Reports of finished attempts after the first ``start``."""
        with self._lock:
            return self._reports[start:]

    def raise_if_failing(self) -> None:
        """Raise :class:`TooManyFailuresError` once ``max_consecutive_failures`` saves in a row failed."""
        with self._lock:
            fatal = self._fatal
        if fatal is not None:
            raise fatal


class ParentSegments:
    """The segments of the newest snapshot this process published or restored, with their keys:
    what the next incremental save may list again (:mod:`coordinator.dataplane.segments`). In this
    process only, thread-safe (the background writer sets it).

    Set only once a snapshot is published (or a restore has finished), so that it never describes
    a draft; a draft uses it only when its parent is the snapshot it describes (:meth:`for_parent`):
    after another writer's snapshot, a failed publish or a full save, the next save writes every row.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: SegmentHistory | None = None

    def set(self, segments: SegmentHistory | None) -> None:
        with self._lock:
            self._segments = segments

    def get(self) -> SegmentHistory | None:
        with self._lock:
            return self._segments

    def for_parent(self, parent: ParentRef | None) -> SegmentHistory | None:
        """The segments if they describe ``parent`` (a draft's parent), else None."""
        segments = self.get()
        if segments is None or parent is None:
            return None
        return segments.for_parent(parent.snapshot_id)
