"""The Checkpointer: save, restore, the cut and the background writer behind one object, built from
explicit collaborators (:class:`~coordinator.checkpoint.seams.Seams`).

It never changes the controller: a save reads the controller's records through the
:class:`~coordinator.checkpoint.seams.RecordsSource` it is handed and returns a
:class:`~coordinator.checkpoint.outcomes.SaveOutcome`; a restore returns a
:class:`~coordinator.checkpoint.outcomes.RestoreOutcome` with the bookkeeping to adopt. The
controller applies what they say (adopt the books, retry a failed resume before sending rollouts).

What a crash leaves at each boundary is said where the steps are: :mod:`.save`, :mod:`.writer`,
:mod:`.restore`, :mod:`.cut`.
"""

from __future__ import annotations

from functools import partial

from coordinator.checkpoint import restore as restore_steps
from coordinator.checkpoint import save as save_steps
from coordinator.checkpoint.history import ParentSegments, SaveHistory
from coordinator.checkpoint.outcomes import RestoreOutcome, SaveOutcome, SaveReport
from coordinator.checkpoint.seams import RecordsSource, Seams
from coordinator.checkpoint.writer import BackgroundWriter
from coordinator.workload import Workload
from gymkit.gym_fleet import Topology


class Checkpointer:
    """Saves and restores one run's state through ``seams``; one background write in flight at a time.

    It keeps the segments of the newest snapshot it published or restored (:attr:`segments`), so
    that an incremental save (``config.incremental``) lists the rows that snapshot holds again
    instead of writing them."""

    def __init__(self, seams: Seams) -> None:
        self.seams = seams
        self.segments = ParentSegments()
        self._history = SaveHistory(seams.config.rollout_checkpointing.max_consecutive_failures)
        self._writer = BackgroundWriter(partial(save_steps.finish_write, seams), self._history.record)

    def restore(self, workload: Workload, topology: Topology) -> RestoreOutcome | None:
        """Restore from the newest usable snapshot of the running ``topology`` (Gym is resumed when
        this returns); None when the store holds none (start fresh). Raises
        :class:`~schemas.errors.TopologyMismatchError` for another topology and
        :class:`~coordinator.errors.RestoreError` when no snapshot could be restored."""
        self._writer.wait()  # a write in flight would set the segments after the restore
        return restore_steps.restore(self.seams, workload, topology, self.segments)

    def save(self, source: RecordsSource, fingerprint: str) -> SaveOutcome:
        """One save attempt now; the caller holds its loop (no rollout sent, no row put) until this returns.

        Waits first for the previous save's background write. Raises
        :class:`~coordinator.errors.TooManyFailuresError` when ``max_consecutive_failures`` attempts in
        a row have failed; a failure of this attempt is its outcome (``aborted``). A ``writing``
        outcome's final one comes from :meth:`wait_for_write`."""
        self._writer.wait()
        self.raise_if_failing()
        outcome, pending = save_steps.save(self.seams, source, fingerprint, self.segments)
        if pending is None:
            self._history.record(outcome)
        else:
            self._writer.submit(pending)
        return outcome

    def wait_for_write(self) -> SaveOutcome | None:
        """Wait for the background write in flight, if any; the outcome of the newest finished one."""
        return self._writer.wait()

    def reports(self, start: int = 0) -> list[SaveReport]:
        """Reports of finished save attempts (published or aborted), oldest first, after the first ``start``."""
        return self._history.reports(start)

    def raise_if_failing(self) -> None:
        """Raise :class:`~coordinator.errors.TooManyFailuresError` once too many saves in a row failed."""
        self._history.raise_if_failing()
