"""RL's own cut and the writing of it: kept apart, so the bytes can be written after Gym resumes.

:func:`take_cut` runs while the controller's loop is held (no rollout is sent, no row is put: the
data plane's producers are at the barrier) and returns an immutable in-memory copy: the data
plane's rows as Arrow tables and the controller's records. :func:`write_cut_parts` writes that copy
into a draft (``tq/`` and ``controller/``) at any later time, from any thread; nothing it reads can
change under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from coordinator.bookkeeping import Bookkeeping, ControllerRecords
from coordinator.data_plane import DataPlane, DataPlaneCut, write_cut
from schemas.manifest import FileEntry
from snapformat.draft import SnapshotDraft

TQ_PREFIX = "tq"
CONTROLLER_PREFIX = "controller"


@dataclass(frozen=True)
class Cut:
    """A consistent copy of the data plane and the controller's bookkeeping."""

    rows: DataPlaneCut
    records: ControllerRecords
    seconds: float

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


def take_cut(plane: DataPlane, books: Bookkeeping) -> Cut:
    """Call with the loop held. Nothing done to ``plane`` or ``books`` afterwards reaches the cut."""
    t0 = time.perf_counter()
    rows = plane.cut()
    records = books.records()
    return Cut(rows, records, time.perf_counter() - t0)


def write_cut_parts(draft: SnapshotDraft, cut: Cut, compression: str = "none") -> list[FileEntry]:
    """Write the cut's parts into ``draft`` (each file durable on return); publish closes them."""
    tq = draft.part(TQ_PREFIX, writer="tq")
    entries = write_cut(cut.rows, tq, compression)
    ctl = draft.part(CONTROLLER_PREFIX, writer="controller")
    entries.append(ctl.write_json("loader", "loader_place", cut.records.loader))
    entries.append(ctl.write_records("replay_index", "replay_index", cut.records.replay))
    entries.append(ctl.write_records("recovery_ledger", "recovery_ledger", cut.records.ledger))
    return entries
