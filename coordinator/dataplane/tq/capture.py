"""Rows put through the TQ adapter, kept as they were put, so that a save never reads them back.

Why: TransferQueue's KV read (``kv_batch_get``) moves every row's every field as its own tensor,
msgpack-encoded in its storage unit and decoded in the client; on this machine that is tens of MB/s,
90% of a save that reads rows back (benchmarks/results/tq.md). The adapter's rows are write-once
(a key is put once, with all its fields, and never changed while it exists), so the values the
adapter put are exactly what TransferQueue holds for those keys for as long as it holds them.

What is kept, per partition: *segments*, one per put (or one per partition a restore loaded), each
with its keys, their field layouts and values in the neutral form (numpy values and row offsets),
owned and never changed afterwards; and an index from each key to its row. Tags are not kept:
a cut takes them from TransferQueue's listing.

A cut (:meth:`RowCapture.resolve`, at the barrier) finds each listed key's row; a listed key the
capture does not hold (put by another producer, or past the memory bound) is a *miss*, which the
adapter reads from TransferQueue. The result (:class:`PartitionPlan`) holds references to the
segments it needs, so nothing done to the capture afterwards changes it. Resolving is also the
only moment anything is dropped: the keys TransferQueue no longer lists (cleared by a consumer),
and every segment none of whose keys is listed any more.

Memory: the values of every captured row, once (a segment whose keys are partly cleared is kept
whole until all of them are). Past ``max_bytes`` new puts are not captured (logged once); their
keys are read from TransferQueue at save time, as without a capture. A save adds one window's copy
(:func:`plan_source`: the plan's rows assembled a window at a time as they are written), not a copy
of the cut.

This module needs numpy and pyarrow only: no Ray, no torch.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from coordinator.dataplane.codec import PartitionSource, needs_json, tag_names
from coordinator.dataplane.fields import (
    FieldData,
    FieldSpec,
    PartitionRows,
    RowGroup,
    concat_fields,
    slice_field,
    unify_specs,
)
from coordinator.dataplane.row_kinds import fields_every_row_holds, training_misfit

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 30


@dataclass(frozen=True, eq=False)
class Segment:
    """Rows put together: every row holds every field of ``specs`` (values cover all rows)."""

    keys: tuple[str, ...]
    specs: Mapping[str, FieldSpec]
    fields: Mapping[str, FieldData]
    nbytes: int


@dataclass(frozen=True)
class Run:
    """Listed positions ``[start, start + length)`` are rows ``[row, row + length)`` of ``segment``."""

    start: int
    segment: Segment
    row: int
    length: int


@dataclass(frozen=True)
class PartitionPlan:
    """A partition as a cut saw it: listed keys and tags, runs of captured rows, and the misses."""

    partition_id: str
    keys: list[str]
    tags: list[dict[str, Any]]
    runs: tuple[Run, ...]
    misses: np.ndarray  # int64 listed positions the capture does not hold
    field_order: tuple[str, ...]  # the order fields first appeared in this partition's puts


#: Consecutive small puts with the same fields are merged into one segment once they hold this many
#: rows (each row copied once, at put time), so that a cut assembles a few large runs, not thousands.
COALESCE_ROWS = 4096


@dataclass
class _Partition:
    segments: list[Segment] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first row id of each segment (ids never reused)
    index: dict[str, int] = field(default_factory=dict)  # key -> row id
    next_id: int = 0
    field_order: dict[str, None] = field(default_factory=dict)
    tail: int = 0  # trailing small segments with the same fields as the last one
    tail_rows: int = 0

    def add(self, seg: Segment) -> None:
        start = self.next_id
        n = len(seg.keys)
        small = n < COALESCE_ROWS
        if small and self.tail and self.segments[-1].specs == seg.specs:
            self.tail, self.tail_rows = self.tail + 1, self.tail_rows + n
        else:
            self.tail, self.tail_rows = (1, n) if small else (0, 0)
        self.segments.append(seg)
        self.starts.append(start)
        self.index.update(zip(seg.keys, range(start, start + n)))
        self.next_id += n
        self.field_order.update(dict.fromkeys(seg.specs))
        if self.tail > 1 and self.tail_rows >= COALESCE_ROWS:
            self._merge_tail()

    def _merge_tail(self) -> None:
        parts = self.segments[-self.tail:]
        specs = parts[0].specs
        merged = Segment(tuple(k for p in parts for k in p.keys), specs,
                         {name: concat_fields([p.fields[name] for p in parts], spec) for name, spec in specs.items()},
                         sum(p.nbytes for p in parts))
        first = self.starts[-self.tail]
        del self.segments[-self.tail:], self.starts[-self.tail:]
        self.segments.append(merged)
        self.starts.append(first)
        self.tail, self.tail_rows = 0, 0


def segment_bytes(fields: Mapping[str, FieldData]) -> int:
    """What a segment's values take in memory (objects counted roughly: they are small, per row)."""
    total = 0
    for fd in fields.values():
        if isinstance(fd.values, np.ndarray):
            total += fd.values.nbytes
        else:
            total += 64 * len(fd.values)
        if fd.offsets is not None:
            total += fd.offsets.nbytes
    return total


class RowCapture:
    """The rows an adapter put, by partition and key (see the module docstring). Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._parts: dict[str, _Partition] = {}
        self._lock = threading.Lock()
        self._warned = False

    def add(self, partition_id: str, keys: Sequence[str], specs: Mapping[str, FieldSpec],
            fields: Mapping[str, FieldData]) -> bool:
        """Keep a put's rows (``fields`` owned by the capture from now on). False when past the bound."""
        nbytes = segment_bytes(fields)
        with self._lock:
            if self.nbytes + nbytes > self.max_bytes:
                if not self._warned:
                    self._warned = True
                    log.warning("the row capture holds %d bytes (max %d): later puts are not kept and a save "
                                "reads them back from TransferQueue", self.nbytes, self.max_bytes)
                return False
            self._parts.setdefault(partition_id, _Partition()).add(
                Segment(tuple(keys), dict(specs), dict(fields), nbytes))
            self.nbytes += nbytes
            return True

    def adopt(self, part: PartitionRows) -> bool:
        """Keep a partition a restore is loading: one segment per run of consecutive rows that hold
        the same fields (views of the loaded values, no copy). False if the bound stopped it."""
        n = len(part.keys)
        owner = np.full(n, -1, dtype=np.int64)  # the group holding each row (-1: none, no field at all)
        at = np.zeros(n, dtype=np.int64)  # the row's place within its group
        for gi, g in enumerate(part.groups):
            owner[g.rows] = gi
            at[g.rows] = np.arange(len(g.rows))
        starts = np.flatnonzero(np.diff(owner, prepend=-2) != 0) if n else np.empty(0, dtype=np.int64)
        for a, b in zip(starts, [*starts[1:], n]):
            a, b = int(a), int(b)
            g = part.groups[int(owner[a])] if owner[a] >= 0 else None
            names = [name for name in part.specs if g is not None and name in g.fields]  # the saved field order
            i = int(at[a])
            fields = {name: slice_field(g.fields[name], part.specs[name], i, i + b - a) for name in names}
            if not self.add(part.partition_id, part.keys[a:b], {name: part.specs[name] for name in names}, fields):
                return False
        return True

    def clear(self) -> None:
        with self._lock:
            self._parts.clear()
            self.nbytes = 0
            self._warned = False

    def resolve(self, listing: Mapping[str, Mapping[str, Any]]) -> list[PartitionPlan]:
        """Plan a cut of ``listing`` (TransferQueue's ``kv_list``: partition -> key -> tag), and drop
        what it no longer lists. Call it at the barrier."""
        with self._lock:
            plans = [self._resolve_one(pid, key_tags) for pid, key_tags in listing.items()]
            for pid in [p for p in self._parts if p not in listing]:
                self._drop(pid, self._parts[pid].segments)
                del self._parts[pid]
            return plans

    def _resolve_one(self, pid: str, key_tags: Mapping[str, Any]) -> PartitionPlan:
        keys = list(key_tags)
        tags = list(key_tags.values())  # the listing's own tags: the cut owns that listing, nothing changes them
        p = self._parts.get(pid)
        if p is None or not keys:
            if p is not None:
                self._drop(pid, p.segments)
                del self._parts[pid]
            return PartitionPlan(pid, keys, tags, (), np.arange(len(keys), dtype=np.int64), ())
        ids = np.fromiter(map(p.index.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        hit = ids >= 0
        starts = np.asarray(p.starts, dtype=np.int64)
        seg_of = np.searchsorted(starts, ids, side="right") - 1
        # A run breaks wherever the row is not the previous one's successor in the same segment.
        brk = np.ones(len(keys), dtype=bool)
        if len(keys) > 1:
            brk[1:] = (ids[1:] != ids[:-1] + 1) | (seg_of[1:] != seg_of[:-1]) | ~hit[:-1]
        firsts = np.flatnonzero(brk & hit)
        ends = np.empty(len(firsts), dtype=np.int64)
        if len(firsts):
            # each run ends at the next break (or a miss) after its first position
            stop = np.flatnonzero(brk | ~hit)
            nxt = np.searchsorted(stop, firsts, side="right")
            ends = np.where(nxt < len(stop), stop[np.minimum(nxt, len(stop) - 1)], len(keys))
        runs = tuple(Run(int(s), p.segments[int(seg_of[s])], int(ids[s] - starts[seg_of[s]]), int(e - s))
                     for s, e in zip(firsts, ends))
        if int(hit.sum()) != len(p.index):  # keys TransferQueue no longer holds: forget them
            self._forget(pid, p, set(keys))
        return PartitionPlan(pid, keys, tags, runs, np.flatnonzero(~hit).astype(np.int64),
                             tuple(p.field_order))

    def _forget(self, pid: str, p: _Partition, listed: set[str]) -> None:
        gone = [k for k in p.index if k not in listed]
        for k in gone:
            del p.index[k]
        live = set(np.searchsorted(np.asarray(p.starts, dtype=np.int64),
                                   np.fromiter(p.index.values(), dtype=np.int64, count=len(p.index)),
                                   side="right") - 1) if p.index else set()
        keep = [i for i in range(len(p.segments)) if i in live]
        self._drop(pid, [s for i, s in enumerate(p.segments) if i not in live])
        p.segments = [p.segments[i] for i in keep]
        p.starts = [p.starts[i] for i in keep]

    def _drop(self, pid: str, segments: Sequence[Segment]) -> None:
        freed = sum(s.nbytes for s in segments)
        self.nbytes -= freed
        if freed:
            log.debug("capture: dropped %d segment(s) of partition %r (%d bytes)", len(segments), pid, freed)


def _runs_by_fields(plan: PartitionPlan) -> dict[tuple[str, ...], list[Run]]:
    """The plan's runs by the set of fields their rows hold (rows that hold the same fields form one
    group, as TransferQueue's production status gives them)."""
    by_names: dict[tuple[str, ...], list[Run]] = {}
    for run in plan.runs:
        by_names.setdefault(tuple(sorted(run.segment.specs)), []).append(run)
    return by_names


def _same_lengths(runs: Sequence[Run], name: str) -> bool:
    """Whether every row of ``runs`` holds a value of ``name`` of the same length (offsets only)."""
    first = None
    for r in runs:
        off = r.segment.fields[name].offsets[r.row:r.row + r.length + 1]
        lengths = np.diff(off)
        if not len(lengths):
            continue
        if first is None:
            first = lengths[0]
        if not bool(np.all(lengths == first)):
            return False
    return True


def plan_specs(plan: PartitionPlan, missed: PartitionRows | None = None,
               field_order: Sequence[str] | None = None) -> dict[str, FieldSpec]:
    """Every field's layout over the whole partition a plan describes (reads offsets, no values).

    Fields are ordered as ``field_order`` says (TransferQueue's own order, needed only when there are
    misses), else in the order they first appeared in the partition's puts. As when reading from
    TransferQueue, a field put dense whose rows (of one group) turn out to differ in length is ragged.
    """
    where = f"partition {plan.partition_id!r}"
    specs: dict[str, list[FieldSpec]] = {}
    for names, runs in _runs_by_fields(plan).items():
        for name in names:
            spec = unify_specs([r.segment.specs[name] for r in runs], f"{where} field {name!r}")
            if spec.type == "tensor" and spec.ndim and not spec.nested and not _same_lengths(runs, name):
                spec = FieldSpec(spec.type, spec.dtype, spec.ndim, spec.inner, True)
            specs.setdefault(name, []).append(spec)
    if missed is not None:
        for name, spec in missed.specs.items():
            specs.setdefault(name, []).append(spec)
    order = list(field_order if field_order is not None else plan.field_order)
    order += [n for n in plan.field_order if n not in order] + [n for n in specs if n not in order]
    return {n: unify_specs(specs[n], f"{where} field {n!r}") for n in order if n in specs}


def assemble(plan: PartitionPlan, missed: PartitionRows | None = None,
             field_order: Sequence[str] | None = None,
             specs: Mapping[str, FieldSpec] | None = None) -> PartitionRows:
    """The partition a plan describes, in the neutral form: captured runs (copied into one array per
    field and group), plus ``missed`` (the rows at ``plan.misses``, read from TransferQueue, with
    positions relative to those misses). ``specs``: the layouts to give it (default
    :func:`plan_specs`; a window of a larger plan takes the whole plan's)."""
    if specs is None:
        specs = plan_specs(plan, missed, field_order)
    groups: list[RowGroup] = []
    for names, runs in _runs_by_fields(plan).items():
        if not names:  # rows that hold no field are in no group, as TransferQueue's presence gives them
            continue
        rows = np.concatenate([np.arange(r.start, r.start + r.length, dtype=np.int64) for r in runs])
        groups.append(RowGroup(rows, {
            name: concat_fields([slice_field(r.segment.fields[name], r.segment.specs[name], r.row, r.row + r.length)
                                 for r in runs], specs[name])
            for name in names}))
    if missed is not None:
        groups.extend(RowGroup(plan.misses[g.rows], g.fields) for g in missed.groups)
    groups.sort(key=lambda g: int(g.rows[0]))
    return PartitionRows(plan.partition_id, plan.keys, plan.tags, dict(specs), groups)


def plan_as_json(plan: PartitionPlan, missed: PartitionRows | None, specs: Mapping[str, FieldSpec]) -> dict[str, bool]:
    """For each object field of ``specs``: whether its values are kept as JSON text (:func:`needs_json`)."""
    out = {}
    for name, spec in specs.items():
        if spec.type != "object":
            continue
        values = [r.segment.fields[name].values[r.row:r.row + r.length] for r in plan.runs if name in r.segment.fields]
        if missed is not None:
            values += [g.fields[name].values for g in missed.groups if name in g.fields]
        out[name] = needs_json(v for vs in values for v in vs)
    return out


def plan_source(plan: PartitionPlan, position: int, missed: PartitionRows | None = None,
                field_order: Sequence[str] | None = None, window_rows: int = 65536,
                window_bytes: int = 64 << 20, specs: Mapping[str, FieldSpec] | None = None) -> PartitionSource:
    """The partition a plan describes as a :class:`PartitionSource`: its rows assembled window by window
    (at most ``window_rows`` rows and about ``window_bytes`` of captured values each), so that writing
    it holds one window's copy of the values, not the partition's. ``missed`` is held whole.

    ``specs``: the layouts to give its fields (those its rows hold), when the plan is part of a
    larger one (a segment of a partition: :func:`plan_range`), so that every segment says what the
    whole partition is (a field ragged anywhere in it is ragged in each); default :func:`plan_specs`."""
    if specs is None:
        specs = plan_specs(plan, missed, field_order)
    else:
        held = {name for r in plan.runs for name in r.segment.specs}
        if missed is not None:
            held.update(name for g in missed.groups for name in g.fields)
        specs = {name: spec for name, spec in specs.items() if name in held}
    n = len(plan.keys)
    covered = sum(r.length for r in plan.runs)
    captured = sum(r.segment.nbytes * r.length / max(len(r.segment.keys), 1) for r in plan.runs)
    per_row = captured / covered if covered else 0.0
    step = max(1, min(window_rows, int(window_bytes // per_row) if per_row else window_rows))

    run_starts = [r.start for r in plan.runs]

    def windows() -> Iterator[PartitionRows]:
        for start in range(0, n, step):
            sub, sub_missed = _window(plan, run_starts, missed, start, min(n, start + step))
            yield assemble(sub, sub_missed, field_order, specs)

    misfit = training_misfit(specs, plan_full_fields(plan, missed), plan.tags)
    return PartitionSource(plan.partition_id, int(position), n, specs, plan_as_json(plan, missed, specs),
                           tag_names(plan.tags), windows, misfit)


def plan_range(plan: PartitionPlan, missed: PartitionRows | None, start: int, stop: int
               ) -> tuple[PartitionPlan, PartitionRows | None]:
    """Listed positions ``[start, stop)`` of a plan as a plan of their own (and its misses' rows),
    renumbered from 0: one segment of an incremental save (values are views)."""
    return _window(plan, [r.start for r in plan.runs], missed, start, stop)


def plan_row_bytes(plan: PartitionPlan, missed: PartitionRows | None = None) -> float:
    """About what one listed row of a plan takes in memory (its captured runs' and its misses' values)."""
    n = len(plan.keys)
    if not n:
        return 0.0
    total = sum(r.segment.nbytes * r.length / max(len(r.segment.keys), 1) for r in plan.runs)
    if missed is not None:
        total += sum(segment_bytes(g.fields) for g in missed.groups)
    return total / n


def plan_full_fields(plan: PartitionPlan, missed: PartitionRows | None = None) -> frozenset[str]:
    """The fields every listed row of a plan holds (its runs' and its misses'), from the runs alone:
    which table the partition goes to is known before any value is copied."""
    held = [(r.segment.specs, r.length) for r in plan.runs]
    if missed is not None:
        held += [(g.fields, len(g.rows)) for g in missed.groups]
    return fields_every_row_holds(held, len(plan.keys))


def _window(plan: PartitionPlan, run_starts: Sequence[int], missed: PartitionRows | None, start: int,
            stop: int) -> tuple[PartitionPlan, PartitionRows | None]:
    """Listed positions ``[start, stop)`` of a plan (and of its misses' rows), renumbered from 0.
    ``run_starts``: each run's first listed position (ascending)."""
    first = max(bisect.bisect_right(run_starts, start) - 1, 0)
    runs = []
    for r in plan.runs[first:]:
        if r.start >= stop:
            break
        a, b = max(r.start, start), min(r.start + r.length, stop)
        if a < b:
            runs.append(Run(a - start, r.segment, r.row + (a - r.start), b - a))
    m0, m1 = (int(i) for i in np.searchsorted(plan.misses, [start, stop]))
    sub = PartitionPlan(plan.partition_id, plan.keys[start:stop], plan.tags[start:stop], tuple(runs),
                        plan.misses[m0:m1] - start, plan.field_order)
    if missed is None:
        return sub, None
    groups = []
    for g in missed.groups:  # a group's rows are ascending positions among the misses
        a, b = (int(i) for i in np.searchsorted(g.rows, [m0, m1]))
        if a < b:
            groups.append(RowGroup(g.rows[a:b] - m0, {name: slice_field(fd, missed.specs[name], a, b)
                                                      for name, fd in g.fields.items()}))
    return sub, PartitionRows(missed.partition_id, [], [], missed.specs, groups)


__all__ = ["COALESCE_ROWS", "DEFAULT_MAX_BYTES", "PartitionPlan", "RowCapture", "Run", "Segment", "assemble",
           "plan_as_json", "plan_full_fields", "plan_range", "plan_row_bytes", "plan_source", "plan_specs",
           "segment_bytes"]
