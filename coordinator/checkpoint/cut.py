"""RL's own cut and the writing of it: kept apart, so the bytes can be written after Gym resumes.

:func:`take_cut` runs while the controller's loop is held (no rollout is sent, no row is put: the
data plane's producers are at the barrier) and returns what makes the cut: an immutable copy of the
controller's records and the data plane's :class:`~coordinator.dataplane.RowsCut` (for
TransferQueue, whose rows are write-once, only the listing of keys and tags; for others, a copy of
the rows as Arrow tables). :func:`write_cut_parts` writes it into a draft (``tq/`` and
``controller/``) at any later time, from any thread; nothing it reads can change under it. For
TransferQueue the rows are built and written one window at a time, so writing holds one window's
copy of the values, not the cut's. An incremental save writes the rows as segments and lists again
those the parent snapshot holds (:mod:`coordinator.dataplane.segments`); the controller's records
are small and change every save, so they are always written whole.

:class:`CutInBackground` takes it on a thread of its own, so that a save can take it while Gym
prepares and commits: from the flush of acknowledgements to the resume, the controller's loop is held
and nothing reaches the data plane or its records, so the cut is the same whenever it is taken in
that time. Its cost grows with TQ's key count, Gym's with the rollouts; run together, the pause
holds the larger of the two instead of their sum.

What a crash leaves: the cut lives in memory only and dies with the process; parts written from it
are in a draft no commit names until ``save.published`` (GC removes it), so the previous snapshot
stays the newest.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from coordinator.bookkeeping import ControllerRecords
from coordinator.checkpoint.seams import RecordsSource
from coordinator.dataplane import DataPlane, RowsCut, SegmentHistory, WrittenRows
from schemas.manifest import FileEntry
from snapformat.draft import SnapshotDraft

TQ_PREFIX = "tq"
CONTROLLER_PREFIX = "controller"


@dataclass(frozen=True)
class Cut:
    """A consistent cut of the data plane (see :class:`RowsCut`) and the controller's records."""

    rows: RowsCut
    records: ControllerRecords
    seconds: float

    @property
    def held_bytes(self) -> int:
        """Memory the cut holds until it is written (the data plane's copy, if it took one)."""
        return self.rows.held_bytes


def take_cut(plane: DataPlane, source: RecordsSource) -> Cut:
    """Call with the loop held. Nothing done to ``plane`` or ``source`` afterwards reaches the cut."""
    t0 = time.perf_counter()
    rows = plane.deferred_cut()
    records = source.records()
    return Cut(rows, records, time.perf_counter() - t0)


class CutInBackground:
    """:func:`take_cut` on its own thread, started at construction; :meth:`result` waits for it."""

    def __init__(self, plane: DataPlane, source: RecordsSource) -> None:
        self._cut: Cut | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(plane, source), name="rl-cut", daemon=True)
        self._thread.start()

    def _run(self, plane: DataPlane, source: RecordsSource) -> None:
        try:
            self._cut = take_cut(plane, source)
        except BaseException as exc:  # noqa: BLE001 - raised by result(), in the save's own thread
            self._error = exc

    def result(self) -> Cut:
        """The cut, once taken; its error, with its type, if taking it failed."""
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._cut is not None
        return self._cut

    def wait(self) -> None:
        """Wait until the cut is taken or has failed (a failed save calls this before it returns, so
        no listing of the data plane outlives it). The data plane's own call timeouts bound it."""
        self._thread.join()


def write_cut_parts(draft: SnapshotDraft, cut: Cut, compression: str = "none", *, incremental: bool = False,
                    parent_segments: SegmentHistory | None = None) -> tuple[WrittenRows, list[FileEntry]]:
    """Write the cut's parts into ``draft`` (each file durable on return); publish closes them.
    Returns what the data plane's rows came to (rows and bytes per kind) and the files written.

    ``incremental``: the data plane's rows as segments (:meth:`RowsCut.write_segments`), listing
    again those of ``parent_segments`` (used only when they describe the draft's parent); else one
    file per kind. The controller's records are small and change every save: always whole files."""
    tq = draft.part(TQ_PREFIX, writer="tq")
    if incremental:
        parent = draft.parent.snapshot_id if draft.parent is not None else None
        reuse = parent_segments.for_parent(parent) if parent_segments is not None else None
        rows = cut.rows.write_segments(tq, reuse, compression)
    else:
        rows = cut.rows.write(tq, compression)
    entries = list(rows.entries)
    ctl = draft.part(CONTROLLER_PREFIX, writer="controller")
    entries.append(ctl.write_json("loader", "loader_place", cut.records.loader))
    entries.append(ctl.write_records("replay_index", "replay_index", cut.records.replay))
    entries.append(ctl.write_records("recovery_ledger", "recovery_ledger", cut.records.ledger))
    return rows, entries
