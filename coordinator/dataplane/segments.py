"""Row segments: how an incremental save cuts a data plane's rows into shared objects, and which of
its parent's it lists again instead of writing them.

In incremental mode (:attr:`coordinator.config.ControllerConfig.incremental`) the rows of a cut are
written as *segments*: each a run of consecutive listed keys of one partition, at most
:data:`SEGMENT_ROWS` rows and about :data:`SEGMENT_BYTES` of Arrow memory, written as a row table of
that one partition into a shared object (format 1.3, SPEC §14.2). The snapshot's manifest lists them
in the data plane's order: partition by partition, each partition's segments in key order. A
partition without a row is one segment of no row, so that it still comes back on restore.

The data plane's rows are write-once (TransferQueue's adapter refuses a second put of a key), so a
row the parent snapshot holds is the row the data plane lists now under the same key. A save
therefore keeps, per partition, the segments of the snapshot it descends from
(:class:`SegmentHistory`) and :func:`plan_segments` decides, against the listing, for each of them:

- *referenced* (:class:`Reuse`): its keys still listed are one contiguous run of its rows, they are
  listed consecutively, and they are still at least ``1 /`` :data:`MIN_HELD_FRACTION` of its
  object's rows (``1 /`` :data:`SUFFIX_MIN_FRACTION` when they are the object's last rows: a
  consumer that takes the oldest rows first narrows one segment per partition at a time, and
  writing its rows again at a quarter would cost a quarter segment every few saves). The snapshot lists the object again with a narrowed ``row_range`` and writes
  nothing: rows a consumer cleared simply stop being listed.
- otherwise its surviving rows are written again (:class:`Fresh`), together with their neighbours
  that are written too.
- small segments (a partition that gains a few rows per save gains one each time) are written
  again as one once :data:`MERGE_SMALL` of them lie side by side (:func:`_merge_small`). The fraction bounds what an object may hold that no snapshot lists any more
  (at most three quarters of it), at the price of writing a quarter of it again once.

Keys no referenced segment covers (new keys: TransferQueue lists keys in the order they were
created, so these come at the end of their partition) become new segments. A segment is referenced
only when its row kind is the partition's kind now (a partition whose rows start to fit
``training_rows`` is written again whole as such).

This module only plans (numpy and the manifest's records): writing is
:func:`coordinator.dataplane.writer.write_segments`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from coordinator.dataplane.row_kinds import FILE_NAMES
from schemas.manifest import FileEntry

#: Rows of one segment at most: large enough that a save of a million rows lists about a hundred
#: objects, small enough that a segment a consumer mostly cleared is cheap to write again.
SEGMENT_ROWS = 8192
#: Arrow memory of one segment at most (about): a segment is built in memory before it is written.
SEGMENT_BYTES = 64 << 20
#: A parent's segment is referenced only while its listed rows are at least 1/4 of its object's rows,
#: or 1/64 when they are the object's last rows (only its oldest were consumed).
MIN_HELD_FRACTION = 4
SUFFIX_MIN_FRACTION = 64
#: Where segments lie under the data plane's part prefix.
SEGMENTS_DIR = "segments"
#: A partition that gains a few rows at every save gains a small segment each time (fewer than
#: ``max_rows //`` :data:`SMALL_FRACTION` rows); once :data:`MERGE_SMALL` of them lie side by side
#: they are written again as one, so that a long run does not leave a partition in thousands of
#: tiny objects (a restore reads each one). Large segments are never merged.
MERGE_SMALL = 8
SMALL_FRACTION = 8


@dataclass(frozen=True)
class HeldSegment:
    """One segment a published snapshot holds: its ``entry`` in that snapshot's manifest, the
    ``keys`` of the rows it holds there (rows ``entry.row_range`` of the object, in order) and the
    object's row count (``object_rows``; after a restore, the stop of the range the snapshot held:
    rows past it are never read)."""

    entry: FileEntry
    keys: tuple[str, ...]
    object_rows: int

    @property
    def first_row(self) -> int:
        """The object's row that holds ``keys[0]``."""
        return self.entry.row_range[0] if self.entry.row_range is not None else 0

    @property
    def kind(self) -> str:
        return self.entry.kind


@dataclass(frozen=True)
class SegmentHistory:
    """The segments one published snapshot (``snapshot_id``) holds, per partition in its order.

    Only a draft whose parent is that snapshot may use it (SPEC §14.2: a draft references only
    objects its parent lists or it wrote itself): :meth:`for_parent`.
    """

    snapshot_id: str
    partitions: Mapping[str, tuple[HeldSegment, ...]]

    def for_parent(self, parent_snapshot_id: str | None) -> SegmentHistory | None:
        """This history if it describes ``parent_snapshot_id`` (a draft's parent), else None."""
        return self if parent_snapshot_id == self.snapshot_id else None

    @property
    def rows(self) -> int:
        return sum(len(s.keys) for segs in self.partitions.values() for s in segs)


@dataclass(frozen=True)
class Reuse:
    """Listed positions ``[at, at + length)`` are rows ``[row, row + length)`` of ``segment``'s object."""

    at: int
    segment: HeldSegment
    row: int
    length: int

    @property
    def row_range(self) -> tuple[int, int]:
        return self.row, self.row + self.length

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of the rows this reference holds."""
        first = self.row - self.segment.first_row
        return self.segment.keys[first:first + self.length]


@dataclass(frozen=True)
class Fresh:
    """Listed positions ``[start, stop)`` written as one new segment (``start == stop``: a partition
    with no row, written as a segment of no row)."""

    start: int
    stop: int


Piece = Reuse | Fresh


def segment_rows_for(row_bytes: float, max_rows: int = SEGMENT_ROWS, max_bytes: int = SEGMENT_BYTES) -> int:
    """Rows of a new segment whose rows take about ``row_bytes`` each: at most ``max_rows``, and
    about ``max_bytes`` in all (at least one row)."""
    if row_bytes <= 0:
        return max_rows
    return max(1, min(max_rows, int(max_bytes // row_bytes)))


def plan_segments(keys: Sequence[str], held: Sequence[HeldSegment], kind: str,
                  max_rows: int = SEGMENT_ROWS) -> list[Piece]:
    """One partition's segments in this save: which of ``held`` (the parent's segments of the
    partition, in its order) are referenced and which listed positions are written new (rules in
    the module docstring), in listing order; together they cover every position of ``keys`` (the
    partition's listed keys, in the data plane's order) exactly once. New segments hold at most
    ``max_rows`` rows each."""
    n = len(keys)
    if n == 0:
        return [Fresh(0, 0)]
    usable = [s for s in held if s.kind == kind and s.keys]
    reuse_at = _reusable(keys, usable)
    pieces: list[Piece] = []
    pos = 0
    for at in sorted(reuse_at):
        pieces.extend(_fresh(pos, at, max_rows))
        piece = reuse_at[at]
        pieces.append(piece)
        pos = at + piece.length
    pieces.extend(_fresh(pos, n, max_rows))
    return _merge_small(pieces, max_rows)


def _span(piece: Piece) -> tuple[int, int]:
    """The listed positions ``[start, stop)`` a piece covers."""
    if isinstance(piece, Reuse):
        return piece.at, piece.at + piece.length
    return piece.start, piece.stop


def _merge_small(pieces: list[Piece], max_rows: int) -> list[Piece]:
    """``pieces`` with every run of at least :data:`MERGE_SMALL` adjacent small ones (referenced or
    new) written again as new segments of at most ``max_rows`` rows."""
    small = max(1, max_rows // SMALL_FRACTION)
    out: list[Piece] = []
    run: list[Piece] = []

    def close_run() -> None:
        if len(run) >= MERGE_SMALL:
            out.extend(_fresh(_span(run[0])[0], _span(run[-1])[1], max_rows))
        else:
            out.extend(run)
        run.clear()

    for piece in pieces:
        start, stop = _span(piece)
        if stop - start < small:
            run.append(piece)
        else:
            close_run()
            out.append(piece)
    close_run()
    return out


def _reusable(keys: Sequence[str], held: Sequence[HeldSegment]) -> dict[int, Reuse]:
    """The segments of ``held`` that can be referenced, by the listed position of their first row.

    Every held row gets an id (consecutive within a segment, segments one after the other); a
    segment is referenced when its listed rows form exactly one run (positions consecutive, ids
    consecutive: one contiguous run of its rows, listed in its order) that holds enough of its object.
    """
    if not held:
        return {}
    starts = np.zeros(len(held), dtype=np.int64)
    index: dict[str, int] = {}
    next_id = 0
    for j, seg in enumerate(held):
        starts[j] = next_id
        index.update(zip(seg.keys, range(next_id, next_id + len(seg.keys))))
        next_id += len(seg.keys)
    n = len(keys)
    ids = np.fromiter(map(index.get, keys, repeat(-1)), dtype=np.int64, count=n)
    hit = ids >= 0
    seg_of = np.where(hit, np.searchsorted(starts, ids, side="right") - 1, -1)
    follows = np.zeros(n, dtype=bool)  # this position's row is the previous position's next row
    follows[1:] = hit[1:] & (ids[1:] == ids[:-1] + 1) & (seg_of[1:] == seg_of[:-1])
    firsts = np.flatnonzero(hit & ~follows)
    runs = np.bincount(seg_of[firsts], minlength=len(held))
    listed = np.bincount(seg_of[hit], minlength=len(held))
    out: dict[int, Reuse] = {}
    for at in firsts.tolist():
        j = int(seg_of[at])
        seg = held[j]
        row = seg.first_row + int(ids[at] - starts[j])
        count = int(listed[j])
        # Only its oldest rows gone (a consumer taking the oldest first): still listed down to a
        # far smaller share, since writing its rows again would cost every save that consumes.
        suffix = row + count == seg.object_rows
        floor = SUFFIX_MIN_FRACTION if suffix else MIN_HELD_FRACTION
        if runs[j] != 1 or count * floor < seg.object_rows:
            continue
        out[at] = Reuse(at, seg, row, count)
    return out


def _fresh(start: int, stop: int, max_rows: int) -> list[Fresh]:
    """Positions ``[start, stop)`` as new segments of at most ``max_rows`` rows, cut from ``start``."""
    return [Fresh(a, min(a + max_rows, stop)) for a in range(start, stop, max_rows)]


# ------------------------------------------------------------------ names in the part


def _stem(kind: str) -> str:
    return FILE_NAMES[kind].removesuffix(".arrow")


def segment_name(kind: str, snapshot_id: str, number: int) -> str:
    """The name (under the part's prefix) of the ``number``-th segment a draft writes: unique in every
    snapshot that lists it later, since it names the snapshot that wrote it."""
    return f"{SEGMENTS_DIR}/{_stem(kind)}-{snapshot_id}-{number:05d}.arrow"


def reference_name(piece: Reuse, prefix: str) -> str:
    """The name (under the part's ``prefix``) a referenced segment gets: its name in the parent when
    it holds the same rows, else one naming its object and first row (an object is listed once per
    snapshot, so that name is unique there)."""
    entry = piece.segment.entry
    held = entry.row_range if entry.row_range is not None else (0, entry.records)
    if tuple(held) == piece.row_range and entry.path.startswith(prefix + "/"):
        return entry.path[len(prefix) + 1:]
    digest = (entry.object or entry.checksum).partition(":")[2]
    return f"{SEGMENTS_DIR}/{_stem(entry.kind)}-{digest[:16]}-{piece.row}.arrow"


__all__ = [
    "MERGE_SMALL", "MIN_HELD_FRACTION", "SEGMENTS_DIR", "SMALL_FRACTION", "SUFFIX_MIN_FRACTION", "SEGMENT_BYTES", "SEGMENT_ROWS", "Fresh", "HeldSegment", "Piece", "Reuse",
    "SegmentHistory", "plan_segments", "reference_name", "segment_name", "segment_rows_for",
]
