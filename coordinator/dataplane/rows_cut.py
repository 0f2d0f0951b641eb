"""What the pause keeps of a data plane's rows: a :class:`RowsCut`, written later.

A save holds the data plane's producers at a barrier only while it takes the cut; the bytes may be
written after Gym resumes, from any thread, so nothing done to the data plane after the cut may
reach them. A :class:`RowsCut` is that promise, in one of two forms:

- :class:`CopiedCut`: every row copied in the pause, as the tables of the snapshot's row files
  (what :meth:`DataPlane.cut <coordinator.dataplane.plane.DataPlane.cut>` returns; the default of
  any data plane);
- a plan of rows the data plane already holds unchanged and reads later
  (:class:`coordinator.dataplane.tq.adapter.PlannedCut`, TransferQueue's write-once rows).

Either way :meth:`RowsCut.write` writes through :func:`coordinator.dataplane.writer.write_tables`,
and :meth:`RowsCut.materialize` gives the :class:`CopiedCut` as of the pause.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import pyarrow as pa

from coordinator.dataplane.codec import RowTable
from coordinator.dataplane.writer import WrittenRows, write_tables


class RowsCut(ABC):
    """A data plane's rows as of a pause, to be written later, unchanged.

    ``held_bytes`` is what it holds in memory until it is written (the bound that decides whether
    the bytes may be written after Gym resumes); ``seconds`` its time in the pause.
    """

    held_bytes: int
    seconds: float

    @abstractmethod
    def materialize(self) -> CopiedCut:
        """Every row of the cut, copied (raises :class:`DataPlaneChangedError` if that is no longer possible)."""

    @abstractmethod
    def write(self, part, compression: str = "none") -> WrittenRows:
        """Write the cut's rows into ``part`` (a :class:`snapformat.PartWriter`), one file per kind."""


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


__all__ = ["CopiedCut", "RowsCut"]
