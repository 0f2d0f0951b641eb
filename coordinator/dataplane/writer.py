"""Writing a data plane's rows into a snapshot part: the one write path.

Every row file a save writes is a :class:`~coordinator.dataplane.codec.RowTable` whose schema
(layout included) fixes the file's, and whose windows are taken one at a time, checked (a row
missing a required column is refused, naming its row in the file, its partition and key), cut into
batches and streamed to snapformat's writer, which checks the row rules and drops each batch before
the next is built. Two layouts:

- whole (:func:`write_tables`): one file per kind (``training.arrow``, ``token_capture.arrow``,
  ``dataplane.arrow``), every row written by every save;
- incremental (:func:`write_segments`): each partition as segments, shared objects of at most
  :data:`~coordinator.dataplane.segments.SEGMENT_ROWS` rows, of which those the parent snapshot
  holds are listed again rather than written (:mod:`coordinator.dataplane.segments` plans which).

Saves differ only in when the windows are built, never in how they are written:
:func:`write_sources` builds each window of some partitions as it is written (TransferQueue's
adapter writes its plan of kept rows this way, holding one window's copy at a time); a cut whose
rows were copied in the pause (:class:`~coordinator.dataplane.rows_cut.CopiedCut`) hands over the
tables of the same partitions, one window per partition, built then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import pyarrow as pa
import pyarrow.compute as pc

from coordinator.dataplane.codec import PartitionSource, RowTable
from coordinator.dataplane.row_kinds import FILE_NAMES, KEY_COLUMN, PARTITION_COLUMN, TRAINING
from coordinator.dataplane.segments import (
    HeldSegment,
    Reuse,
    SegmentHistory,
    plan_segments,
    reference_name,
    segment_name,
    segment_rows_for,
)
from schemas.errors import InvalidRecordError
from schemas.manifest import FileEntry
from schemas.rows import ROW_SCHEMAS

BATCH_ROWS = 65536


@dataclass(frozen=True)
class WrittenRows:
    """What writing a cut's rows came to: rows per kind the snapshot holds, the Arrow memory of the
    rows built and written (``nbytes``), the files listed, the bytes this write put into the store
    (``new_bytes``) and those of objects it listed from the parent without writing them
    (``shared_bytes``; whole objects, even where a narrower row range is listed). ``segments``
    (incremental writes only) is what the snapshot holds, for the next save once it is published."""

    rows: Mapping[str, int]
    nbytes: int
    entries: tuple[FileEntry, ...]
    new_bytes: int = 0
    shared_bytes: int = 0
    segments: SegmentHistory | None = None


@dataclass(frozen=True)
class ListedPartition:
    """One partition of a cut as an incremental write takes it: its ``keys`` in the data plane's
    order, the row ``kind`` it is written as, about how many bytes of Arrow memory a row takes
    (``row_bytes``, which sizes new segments) and ``source(start, stop)``, listed positions
    ``[start, stop)`` as a :class:`PartitionSource` (built when it is written)."""

    partition_id: str
    keys: Sequence[str]
    kind: str
    source: Callable[[int, int], PartitionSource]
    row_bytes: float = 0.0


def write_tables(tables: Iterable[RowTable], part, compression: str = "none",
                 batch_rows: int = BATCH_ROWS) -> WrittenRows:
    """Stream each table into ``part`` (a :class:`snapformat.PartWriter`), one file per kind, one
    window at a time (see the module docstring). A kind with no row keeps its layout (partitions,
    even empty ones) in the file's schema."""
    rows: dict[str, int] = {}
    entries = []
    tally = _Tally()
    for table in tables:
        tally.rows = 0
        batches = _batches(table, batch_rows, tally)
        entries.append(part.write_rows(FILE_NAMES[table.kind], table.kind, batches, compression=compression))
        rows[table.kind] = tally.rows
    return WrittenRows(MappingProxyType(rows), tally.nbytes, tuple(entries), new_bytes=sum(e.size for e in entries))


def write_sources(sources: Mapping[str, Sequence[PartitionSource]], part, compression: str = "none",
                  batch_rows: int = BATCH_ROWS) -> WrittenRows:
    """Stream the partitions of each kind into ``part``, building each window as it is written."""
    return write_tables((RowTable.of(kind, srcs) for kind, srcs in sources.items()), part, compression, batch_rows)


def write_segments(partitions: Iterable[ListedPartition], part, history: SegmentHistory | None = None,
                   compression: str = "none", kinds: Sequence[str] = (),
                   batch_rows: int = BATCH_ROWS) -> WrittenRows:
    """Write each partition as segments into ``part`` (a :class:`snapformat.PartWriter`), in the
    order given (the data plane's): the segments of ``history`` that
    :func:`~coordinator.dataplane.segments.plan_segments` keeps are listed again
    (``part.reference``), every other run of rows is written as a new shared object
    (``part.write_rows_object``), one segment's window at a time. ``history`` must describe the
    draft's parent (:meth:`SegmentHistory.for_parent`); None writes every row. ``kinds`` are
    reported with their rows even when no partition is of that kind.

    With no partition at all, one empty ``training_rows`` segment keeps the part a row part."""
    rows: dict[str, int] = dict.fromkeys(kinds, 0)
    entries: list[FileEntry] = []
    held: dict[str, tuple[HeldSegment, ...]] = {}
    tally = _Tally()
    new_bytes = shared_bytes = written = 0

    def write_new(kind: str, table: RowTable) -> FileEntry:
        nonlocal new_bytes, written
        tally.rows = 0  # rows are counted per file, for the errors that name one
        name = segment_name(kind, part.snapshot_id, written)
        entry = part.write_rows_object(name, kind, _batches(table, batch_rows, tally), compression=compression)
        new_bytes += entry.size
        written += 1
        return entry

    for lp in partitions:
        parent = history.partitions.get(lp.partition_id, ()) if history is not None else ()
        kept: list[HeldSegment] = []
        for piece in plan_segments(lp.keys, parent, lp.kind, segment_rows_for(lp.row_bytes)):
            if isinstance(piece, Reuse):
                entry = part.reference(piece.segment.entry, reference_name(piece, part.prefix), piece.row_range)
                shared_bytes += entry.size
                kept.append(HeldSegment(entry, piece.keys, piece.segment.object_rows))
            else:  # a Fresh run of listed positions
                entry = write_new(lp.kind, RowTable.of(lp.kind, [lp.source(piece.start, piece.stop)]))
                if entry.records:
                    kept.append(HeldSegment(entry, tuple(lp.keys[piece.start:piece.stop]), entry.records))
            entries.append(entry)
            rows[lp.kind] = rows.get(lp.kind, 0) + entry.records
        held[lp.partition_id] = tuple(kept)
    if not entries:
        entries.append(write_new(TRAINING, RowTable.of(TRAINING, [])))
        rows.setdefault(TRAINING, 0)
    return WrittenRows(MappingProxyType(rows), tally.nbytes, tuple(entries), new_bytes, shared_bytes,
                       SegmentHistory(part.snapshot_id, MappingProxyType(held)))


@dataclass
class _Tally:
    rows: int = 0  # of the file being written
    nbytes: int = 0  # of every file


def _batches(table: RowTable, batch_rows: int, tally: _Tally) -> Iterator[pa.RecordBatch]:
    for window in table.windows():
        _check_required(table.kind, window, tally.rows)
        tally.rows += window.num_rows
        tally.nbytes += window.nbytes
        yield from window.to_batches(max_chunksize=batch_rows)
        del window  # before the next window is built: one window's copy at a time
    if not tally.rows:  # keep the layout (partitions, even empty ones) in the file's schema
        yield pa.RecordBatch.from_pylist([], schema=table.schema)


def _check_required(kind: str, table: pa.Table, first_row: int) -> None:
    """Every required column of ``kind`` is present and has no null: say which row (counted from
    ``first_row``, where ``table`` starts in the file) lacks what."""
    for f in ROW_SCHEMAS[kind]:
        if f.nullable:
            continue
        if f.name not in table.column_names:
            if table.num_rows == 0:
                continue  # an empty part is written with the full schema
            raise InvalidRecordError(
                f"{kind}: no row has a field or tag {f.name!r}, which the row schema requires")
        col = table.column(f.name)
        if col.null_count:
            i = pc.index(col.is_null(), True).as_py()
            raise InvalidRecordError(
                f"{kind}: row {first_row + i} (partition {table.column(PARTITION_COLUMN)[i].as_py()!r}, key "
                f"{table.column(KEY_COLUMN)[i].as_py()!r}) has no field or tag {f.name!r}, "
                "which the row schema requires")


__all__ = ["BATCH_ROWS", "ListedPartition", "WrittenRows", "write_segments", "write_sources", "write_tables"]
