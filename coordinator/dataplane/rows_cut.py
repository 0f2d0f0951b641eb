"""What the pause keeps of a data plane's rows: a :class:`RowsCut`, written later.

A save holds the data plane's producers at a barrier only while it takes the cut; the bytes may be
written after Gym resumes, from any thread, so nothing done to the data plane after the cut may
reach them. A :class:`RowsCut` is that promise, in one of two forms:

- :class:`CopiedCut`: every row copied in the pause, as the tables of the snapshot's row files
  (what :meth:`DataPlane.cut <coordinator.dataplane.plane.DataPlane.cut>` returns; the default of
  any data plane);
- a plan of rows the data plane already holds unchanged and reads later
  (:class:`coordinator.dataplane.tq.adapter.PlannedCut`, TransferQueue's write-once rows).

Either way :meth:`RowsCut.write` writes one file per kind through
:func:`coordinator.dataplane.writer.write_tables`, :meth:`RowsCut.write_segments` writes segments
through :func:`coordinator.dataplane.writer.write_segments` (an incremental save), and
:meth:`RowsCut.materialize` gives the :class:`CopiedCut` as of the pause.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import pyarrow as pa

from coordinator.dataplane.codec import RowTable, parse_table, whole_source
from coordinator.dataplane.fields import rows_nbytes, slice_partition
from coordinator.dataplane.segments import SegmentHistory
from coordinator.dataplane.writer import ListedPartition, WrittenRows, write_segments, write_tables


class RowsCut(ABC):
    """A data plane's rows as of a pause, to be written later, unchanged.

    ``held_bytes`` is what it holds in memory until it is written (the bound that decides whether
    the bytes may be written after Gym resumes); ``seconds`` its time in the pause. ``write_once``:
    the data plane promised that a listed key's row (tag and values) never changes while it is
    listed, which is what lets an incremental write list its parent's rows again.
    """

    held_bytes: int
    seconds: float
    write_once: bool = False

    @abstractmethod
    def materialize(self) -> CopiedCut:
        """Every row of the cut, copied (raises :class:`DataPlaneChangedError` if that is no longer possible)."""

    @abstractmethod
    def write(self, part, compression: str = "none") -> WrittenRows:
        """Write the cut's rows into ``part`` (a :class:`snapformat.PartWriter`), one file per kind."""

    @abstractmethod
    def listed_partitions(self) -> list[ListedPartition]:
        """Every partition of the cut, in the data plane's order, as an incremental write takes it."""

    @property
    @abstractmethod
    def kinds(self) -> tuple[str, ...]:
        """The row kinds the cut's writes report (every kind of the data plane, even without a row)."""

    def write_segments(self, part, history: SegmentHistory | None = None, compression: str = "none") -> WrittenRows:
        """Write the cut's rows into ``part`` as segments (:func:`~coordinator.dataplane.writer.write_segments`),
        listing again the segments of ``history`` (the draft's parent's) that still hold listed rows.
        A cut of rows that are not write-once writes every row: a key alone does not say its row is
        unchanged."""
        return write_segments(self.listed_partitions(), part, history if self.write_once else None,
                              compression, self.kinds)


@dataclass(frozen=True, eq=False)
class CopiedCut(RowsCut):
    """A consistent, immutable copy of every row of a data plane, taken under its barrier.

    ``row_tables`` holds, for each row kind the data plane keeps, the table of its row file with
    every window (one per partition) built at the cut: Arrow data never changes, and building it
    copied every value. ``partitions`` lists every partition in the data plane's order, empty ones
    included (their ids are also in each table's layout metadata).
    """

    row_tables: tuple[RowTable, ...]
    partitions: tuple[str, ...]
    taken_at: float
    seconds: float
    write_once: bool = False

    @cached_property
    def tables(self) -> Mapping[str, pa.Table]:
        """Each kind's rows as one Arrow table (its windows as chunks), read-only."""
        return MappingProxyType({t.kind: t.table() for t in self.row_tables})

    @property
    def rows(self) -> dict[str, int]:
        return {kind: t.num_rows for kind, t in self.tables.items()}

    @property
    def held_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def materialize(self) -> CopiedCut:
        return self

    def write(self, part, compression: str = "none") -> WrittenRows:
        return write_tables(self.row_tables, part, compression)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(t.kind for t in self.row_tables)

    def listed_partitions(self) -> list[ListedPartition]:
        """Each partition read back out of the tables built at the cut (views of their columns), so
        that holding the cut never costs a second copy of its rows."""
        found = {}
        for t in self.row_tables:
            for p in parse_table(t.table(), f"the cut's {t.kind} rows"):
                found[p.partition_id] = (t.kind, p)
        out = []
        for position, pid in enumerate(self.partitions):
            kind, p = found[pid]
            out.append(ListedPartition(pid, p.keys, kind, _slicer(p, position),
                                       rows_nbytes(p) / len(p.keys) if p.keys else 0.0))
        return out


def _slicer(part, position: int):
    """Listed positions ``[start, stop)`` of ``part`` as a source (a partition's own closure)."""
    return lambda start, stop: whole_source(slice_partition(part, start, stop), position)


__all__ = ["CopiedCut", "RowsCut"]
