"""Writing a data plane's rows into a snapshot part: the one write path.

Every row file a save writes goes through :func:`write_tables`: for each row kind, a
:class:`~coordinator.dataplane.codec.RowTable` whose schema (layout included) fixes the file's, and
whose windows are taken one at a time, checked (a row missing a required column is refused, naming
its row in the file, its partition and key), cut into batches and streamed to snapformat's writer,
which checks the row rules and drops each batch before the next is built. One file per kind
(``training.arrow``, ``token_capture.arrow``, ``dataplane.arrow``).

Saves differ only in when the windows are built, never in how they are written:
:func:`write_sources` builds each window of some partitions as it is written (TransferQueue's
adapter writes its plan of kept rows this way, holding one window's copy at a time); a cut whose
rows were copied in the pause (:class:`~coordinator.dataplane.rows_cut.CopiedCut`) hands over the
tables of the same partitions, one window per partition, built then.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import pyarrow as pa
import pyarrow.compute as pc

from coordinator.dataplane.codec import PartitionSource, RowTable
from coordinator.dataplane.row_kinds import FILE_NAMES, KEY_COLUMN, PARTITION_COLUMN
from schemas.errors import InvalidRecordError
from schemas.manifest import FileEntry
from schemas.rows import ROW_SCHEMAS

BATCH_ROWS = 65536


@dataclass(frozen=True)
class WrittenRows:
    """What writing a cut's rows wrote: rows per kind, their size in memory (Arrow), the files."""

    rows: Mapping[str, int]
    nbytes: int
    entries: tuple[FileEntry, ...]


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
    return WrittenRows(MappingProxyType(rows), tally.nbytes, tuple(entries))


def write_sources(sources: Mapping[str, Sequence[PartitionSource]], part, compression: str = "none",
                  batch_rows: int = BATCH_ROWS) -> WrittenRows:
    """Stream the partitions of each kind into ``part``, building each window as it is written."""
    return write_tables((RowTable.of(kind, srcs) for kind, srcs in sources.items()), part, compression, batch_rows)


@dataclass
class _Tally:
    rows: int = 0  # of the kind being written
    nbytes: int = 0  # of every kind


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


__all__ = ["BATCH_ROWS", "WrittenRows", "write_sources", "write_tables"]
