"""RL's own cut and the writing of it: kept apart, so the bytes can be written after Gym resumes.

:func:`take_cut` runs while the controller's loop is held (no rollout is sent, no row is put: the
data plane's producers are at the barrier) and returns what makes the cut: an immutable copy of the
controller's records and the data plane's :class:`~coordinator.data_plane.DeferredCut` (for
TransferQueue, whose rows are write-once, only the listing of keys and tags; for others, a copy of
the rows as Arrow tables). :func:`write_cut_parts` materializes and writes it into a draft
(``tq/`` and ``controller/``) at any later time, from any thread; nothing it reads can change under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from coordinator.bookkeeping import Bookkeeping, ControllerRecords
from coordinator.data_plane import DataPlane, DataPlaneCut, DeferredCut, write_cut
from schemas.manifest import FileEntry
from snapformat.draft import SnapshotDraft

TQ_PREFIX = "tq"
CONTROLLER_PREFIX = "controller"


@dataclass(frozen=True)
class Cut:
    """A consistent cut of the data plane (deferred: see :class:`DeferredCut`) and the controller's records."""

    rows: DeferredCut
    records: ControllerRecords
    seconds: float

    @property
    def held_bytes(self) -> int:
        """Memory the cut holds until it is written (the data plane's copy, if it took one)."""
        return self.rows.held_bytes


def take_cut(plane: DataPlane, books: Bookkeeping) -> Cut:
    """Call with the loop held. Nothing done to ``plane`` or ``books`` afterwards reaches the cut."""
    t0 = time.perf_counter()
    rows = plane.deferred_cut()
    records = books.records()
    return Cut(rows, records, time.perf_counter() - t0)


def write_cut_parts(draft: SnapshotDraft, cut: Cut, compression: str = "none") -> tuple[DataPlaneCut, list[FileEntry]]:
    """Write the cut's parts into ``draft`` (each file durable on return); publish closes them.
    Returns the data plane's materialized cut (for its sizes) and the files written."""
    rows = cut.rows.materialize()
    tq = draft.part(TQ_PREFIX, writer="tq")
    entries = write_cut(rows, tq, compression)
    ctl = draft.part(CONTROLLER_PREFIX, writer="controller")
    entries.append(ctl.write_json("loader", "loader_place", cut.records.loader))
    entries.append(ctl.write_records("replay_index", "replay_index", cut.records.replay))
    entries.append(ctl.write_records("recovery_ledger", "recovery_ledger", cut.records.ledger))
    return rows, entries
