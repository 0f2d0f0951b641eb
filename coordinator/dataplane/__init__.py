"""The data plane: what the coordinator needs from whatever holds the training rows, and how those
rows go into a snapshot and come back.

A data plane (TransferQueue in production, :class:`InMemoryDataPlane` in unit tests) holds rows in
*partitions*; a row is a *key*, a *tag* (a small JSON-like dict) and *fields* (tensors, ragged or
dense, or plain Python objects). The coordinator uses it in three steps that keep the cut (what
must be consistent) apart from writing the bytes (what may happen after Gym resumes):

1. :meth:`DataPlane.deferred_cut`, called while the data plane's producers are held at the
   barrier: a :class:`RowsCut`, the rows as of that moment (a copy, :class:`CopiedCut`, which is
   what :meth:`DataPlane.cut` returns; or, for TransferQueue's write-once rows, only a plan of
   them). Nothing written to the data plane afterwards can reach the snapshot.
2. :meth:`RowsCut.write`, after the barrier is released: each row kind's table into the
   snapshot's part, one Arrow file per kind (``training_rows``; ``token_capture_rows`` for
   partitions configured as such; ``dataplane_rows`` for partitions whose rows are neither), one
   window of rows at a time, checked by snapformat's row rules (:mod:`.writer`, the one write path).
   Or :meth:`RowsCut.write_segments` (an incremental save): each partition as segments, shared
   objects of consecutive keys, of which those the parent snapshot holds are listed again, not
   written (:mod:`.segments` plans which).
3. :meth:`DataPlane.load`, on restore: reads those files back (checksums verified) into an empty
   data plane, so that it holds exactly what it held: the same partitions, keys (in the same
   order), tags, and field values with their dtypes, shapes and dense/ragged layout.

Modules, each one concept: :mod:`.fields` (the neutral form rows take both ways),
:mod:`.jsonvalues` (JSON kept exactly), :mod:`.row_kinds` (which table a partition goes to),
:mod:`.columns` (one field as one Arrow column), :mod:`.codec` (partitions as tables, with their
layout metadata), :mod:`.segments` (which rows an incremental save writes, which it lists again),
:mod:`.writer`, :mod:`.rows_cut`, :mod:`.plane` (the interface and ``load``),
:mod:`.memory` (the in-memory data plane), :mod:`.errors`; :mod:`.tq` (TransferQueue's adapter).

Importing this package loads neither Ray nor torch: only the TransferQueue modules that need them
do (:mod:`coordinator.dataplane.tq.adapter`, ``.client``, ``.tensors``).
"""

from coordinator.dataplane.codec import PartitionSource, RowTable, build_table, layout_of, parse_table, whole_source
from coordinator.dataplane.errors import DataPlaneChangedError, DataPlaneError, DataPlaneNotEmptyError
from coordinator.dataplane.fields import FieldData, FieldSpec, Objects, PartitionRows, Ragged, RowGroup
from coordinator.dataplane.memory import InMemoryDataPlane
from coordinator.dataplane.plane import DataPlane, LoadReport
from coordinator.dataplane.row_kinds import DATAPLANE, FILE_NAMES, TAGS_COLUMN, TOKEN_CAPTURE, TRAINING
from coordinator.dataplane.rows_cut import CopiedCut, RowsCut
from coordinator.dataplane.segments import SEGMENT_BYTES, SEGMENT_ROWS, HeldSegment, SegmentHistory
from coordinator.dataplane.writer import ListedPartition, WrittenRows, write_segments, write_sources

__all__ = [
    "DATAPLANE", "FILE_NAMES", "SEGMENT_BYTES", "SEGMENT_ROWS", "TAGS_COLUMN", "TOKEN_CAPTURE", "TRAINING",
    "CopiedCut", "DataPlane", "DataPlaneChangedError", "DataPlaneError", "DataPlaneNotEmptyError", "FieldData",
    "FieldSpec", "HeldSegment", "InMemoryDataPlane", "ListedPartition", "LoadReport", "Objects", "PartitionRows",
    "PartitionSource", "Ragged", "RowGroup", "RowTable", "RowsCut", "SegmentHistory", "WrittenRows", "build_table",
    "layout_of", "parse_table", "whole_source", "write_segments", "write_sources",
]
