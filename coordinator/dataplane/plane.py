"""The data-plane interface: what the coordinator needs from whatever holds the training rows.

An implementation (:class:`~coordinator.dataplane.memory.InMemoryDataPlane`,
:class:`~coordinator.dataplane.tq.adapter.TQDataPlane`) provides ``put``, ``cut``, ``clear``,
``is_empty`` and ``restore_partitions``; what is shared lives here: which row kind each partition
is written as, the copied cut built from a data plane's partitions, and :meth:`DataPlane.load`,
which reads a snapshot's row files back into an empty data plane: one file per kind, or segments
(:mod:`coordinator.dataplane.segments`), which it joins partition by partition.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from coordinator.dataplane.codec import PartitionSource, RowTable, parse_table, whole_source
from coordinator.dataplane.errors import DataPlaneNotEmptyError
from coordinator.dataplane.fields import PartitionRows, join_partitions
from coordinator.dataplane.row_kinds import DATAPLANE, FILE_NAMES, TOKEN_CAPTURE, TRAINING, assign_kind
from coordinator.dataplane.rows_cut import CopiedCut, RowsCut
from coordinator.dataplane.segments import HeldSegment, SegmentHistory
from schemas.errors import InvalidRecordError, NotPublishedError
from schemas.manifest import FileEntry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What :meth:`DataPlane.load` put back. ``segments``: for a snapshot of segments, what it holds
    (the segments of one partition each, with the keys read), so that the next save references them."""

    partitions: tuple[str, ...]
    rows: Mapping[str, int]
    files: tuple[str, ...]
    seconds: float
    segments: SegmentHistory | None = None


class DataPlane(ABC):
    """A store of rows the coordinator snapshots and restores.

    ``token_capture_partitions`` says which partitions hold token-capture rows (a set of ids or a
    predicate); their rows go to ``token_capture_rows``. Every other partition's go to
    ``training_rows`` when they fit it, else to ``dataplane_rows`` (:mod:`coordinator.dataplane.row_kinds`).
    """

    def __init__(self, token_capture_partitions: Iterable[str] | Callable[[str], bool] | None = None) -> None:
        if token_capture_partitions is None:
            self._is_token: Callable[[str], bool] | None = None
        elif callable(token_capture_partitions):
            self._is_token = token_capture_partitions
        else:
            ids = frozenset(token_capture_partitions)
            self._is_token = ids.__contains__

    # ------------------------------------------------------------------ which table a partition goes to

    @property
    def kinds(self) -> tuple[str, ...]:
        """The row kinds every cut of this data plane has a table for (``dataplane_rows`` is added
        only to a cut that has a partition of that kind, so that other snapshots stay 1.0-readable)."""
        return (TRAINING,) if self._is_token is None else (TRAINING, TOKEN_CAPTURE)

    def is_token(self, partition_id: str) -> bool:
        """Whether ``partition_id`` is configured to hold token-capture rows."""
        return self._is_token is not None and bool(self._is_token(partition_id))

    def kind_of(self, partition_id: str) -> str:
        """The configured kind: ``token_capture_rows`` or not (``training_rows``, which a partition
        whose rows do not fit it trades for ``dataplane_rows``: see :meth:`kind_for`)."""
        return TOKEN_CAPTURE if self.is_token(partition_id) else TRAINING

    def kind_for(self, source: PartitionSource) -> str:
        """The row kind ``source``'s partition is written as (:func:`coordinator.dataplane.row_kinds.assign_kind`)."""
        return self.kind_with(source.partition_id, source.training_misfit)

    def kind_with(self, partition_id: str, training_misfit: str | None) -> str:
        """The row kind of a partition whose rows cannot be training rows for ``training_misfit`` (None: they can)."""
        kind = assign_kind(self.is_token(partition_id), training_misfit)
        if kind == DATAPLANE:
            log.debug("partition %r is kept as %s: %s", partition_id, DATAPLANE, training_misfit)
        return kind

    @property
    def rows_write_once(self) -> bool:
        """Whether a listed key's row (tag and values) never changes while it is listed, so that an
        incremental save may list rows an earlier snapshot wrote instead of writing them again."""
        return False

    def sources_by_kind(self, sources: Iterable[PartitionSource]) -> dict[str, list[PartitionSource]]:
        """``sources`` grouped by the row kind each is written as: every kind of :attr:`kinds` (even
        with none), then ``dataplane_rows`` if any partition is of that kind."""
        by_kind: dict[str, list[PartitionSource]] = {kind: [] for kind in self.kinds}
        for src in sources:
            by_kind.setdefault(self.kind_for(src), []).append(src)
        return by_kind

    # ------------------------------------------------------------------ what implementations provide

    @abstractmethod
    def put(self, partition_id: str, keys: Sequence[str], fields: Mapping[str, Any] | None = None,
            tags: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Create missing keys (in order) and set their fields and tags, as TransferQueue's
        ``kv_batch_put`` does: a numpy array ``[n, ...]`` is a dense field, :class:`Ragged` a ragged
        one, :class:`Objects` a non-tensor one."""

    @abstractmethod
    def cut(self) -> CopiedCut:
        """Copy every row out, consistently. Call it while producers are held at the barrier."""

    def deferred_cut(self) -> RowsCut:
        """The pause's share of a cut (call it at the barrier). By default the whole copy, taken now;
        a data plane whose rows are write-once may keep only their listing and read values later."""
        return self.cut()

    @abstractmethod
    def clear(self) -> None:
        """Remove every partition (and so every row)."""

    @abstractmethod
    def is_empty(self) -> bool:
        """True when the data plane holds no partition at all."""

    @abstractmethod
    def restore_partitions(self, partitions: Sequence[PartitionRows]) -> None:
        """Put ``partitions`` back (the data plane is empty): same keys in the same order, tags, values."""

    # ------------------------------------------------------------------ shared

    def _make_cut(self, partitions: Sequence[PartitionRows], started: float, taken_at: float) -> CopiedCut:
        """The copied cut of ``partitions`` (every partition of the data plane, in its order): each
        kind's row table with every partition built now, as one window."""
        by_kind = self.sources_by_kind(whole_source(p, i) for i, p in enumerate(partitions))
        tables = tuple(RowTable.of(kind, sources).built() for kind, sources in by_kind.items())
        return CopiedCut(tables, tuple(p.partition_id for p in partitions), taken_at, time.perf_counter() - started,
                         write_once=self.rows_write_once)

    def load(self, snapshot, prefix: str, verify: bool = True) -> LoadReport:
        """Restore the rows a cut wrote under ``prefix`` of ``snapshot`` (a :class:`snapformat.Snapshot`).

        The data plane must be empty (call :meth:`clear` first): what it holds afterwards is exactly
        what the cut held. Every file is read and checked before anything is put; if putting fails
        part-way, what was put is cleared again and the error is raised.

        A snapshot of segments (its row files name shared objects) is read segment by segment
        (each its ``row_range`` of its object), the segments of a partition joined in manifest order,
        partitions in the order they first appear there; a snapshot of one file per kind (every
        snapshot before format 1.3, and incremental saves turned off) keeps each partition in one file.
        """
        started = time.perf_counter()
        if not self.is_empty():
            raise DataPlaneNotEmptyError("load needs an empty data plane (call clear() first)")
        prefix = prefix.rstrip("/")
        entries = [e for e in snapshot.manifest.files if e.kind in FILE_NAMES and e.path.startswith(prefix + "/")]
        if not entries:
            raise NotPublishedError(f"{snapshot.url}: no row part under {prefix!r}")
        rows: dict[str, int] = {}
        segments = None
        if any(e.object is not None for e in entries):
            partitions, segments = self._read_segments(snapshot, entries, verify, rows, prefix)
        else:
            partitions = self._read_files(snapshot, entries, verify, rows)
        try:
            self.restore_partitions(partitions)
        except BaseException:
            try:
                self.clear()
            except Exception:  # pragma: no cover - the first error is the one to report
                pass
            raise
        return LoadReport(tuple(p.partition_id for p in partitions), MappingProxyType(rows),
                          tuple(e.path for e in entries), time.perf_counter() - started, segments)

    def _check_kind(self, p: PartitionRows, entry: FileEntry, where: str) -> None:
        if self.is_token(p.partition_id) != (entry.kind == TOKEN_CAPTURE):
            kept = TOKEN_CAPTURE if self.is_token(p.partition_id) else f"{TRAINING} or {DATAPLANE}"
            raise InvalidRecordError(
                f"{where}: partition {p.partition_id!r} was saved as {entry.kind}, but this data plane "
                f"keeps it as {kept}")

    def _read_files(self, snapshot, entries: list[FileEntry], verify: bool,
                    rows: dict[str, int]) -> list[PartitionRows]:
        """One file per kind: each partition in exactly one of them, in the data plane's order where
        the layouts recorded it."""
        partitions: list[PartitionRows] = []
        seen: set[str] = set()
        for entry in entries:
            where = snapshot.where(entry)
            table = snapshot.read_rows(entry, verify=verify)
            for p in parse_table(table, where):
                if p.partition_id in seen:
                    raise InvalidRecordError(f"{where}: partition {p.partition_id!r} is also in another row file")
                self._check_kind(p, entry, where)
                seen.add(p.partition_id)
                partitions.append(p)
            rows[entry.kind] = rows.get(entry.kind, 0) + table.num_rows
        # The data plane's own partition order (across kinds) where the layouts recorded it.
        if all(p.position is not None for p in partitions):
            partitions.sort(key=lambda p: p.position)
        return partitions

    def _read_segments(self, snapshot, entries: list[FileEntry], verify: bool, rows: dict[str, int],
                       prefix: str) -> tuple[list[PartitionRows], SegmentHistory]:
        """Segments: each partition's joined in manifest order (no value copied), partitions in the
        order they first appear; and what the snapshot holds, per partition (its segments of one
        partition each, with their keys), for the next save."""
        pieces: dict[str, list[PartitionRows]] = {}
        held: dict[str, list[HeldSegment]] = {}
        for entry in entries:
            where = snapshot.where(entry)
            table = snapshot.read_rows(entry, verify=verify)
            parsed = parse_table(table, where)
            for p in parsed:
                self._check_kind(p, entry, where)
                pieces.setdefault(p.partition_id, []).append(p)
            if entry.object is not None and len(parsed) == 1 and parsed[0].keys:
                stop = entry.row_range[1] if entry.row_range is not None else entry.records
                held.setdefault(parsed[0].partition_id, []).append(
                    HeldSegment(entry, tuple(parsed[0].keys), stop))
            rows[entry.kind] = rows.get(entry.kind, 0) + table.num_rows
        where = f"{snapshot.url} (part {prefix!r})"
        partitions = [ps[0] if len(ps) == 1 else join_partitions(ps, where) for ps in pieces.values()]
        for p in partitions:  # a segment recorded its partition's place when it was written: the manifest's order rules
            p.position = None
        history = SegmentHistory(snapshot.manifest.snapshot_id,
                                 MappingProxyType({pid: tuple(segs) for pid, segs in held.items()}))
        return partitions, history


__all__ = ["DataPlane", "LoadReport"]
