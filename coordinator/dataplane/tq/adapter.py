"""The TransferQueue data plane: cut, write and load TQ's rows (PyPI ``transferqueue`` 0.1.11).

How TQ's rows map to the row tables (see :mod:`coordinator.dataplane.codec` for the table side):

- every partition (``kv_list()``), its keys in ``kv_list`` order (the order they were created),
  and each key's tag;
- every field TQ holds for a key: a ragged (jagged) tensor is a ``list<T>`` column (nested lists for
  per-row ``[n, k, ...]`` tensors), a dense per-row scalar a scalar column, a dense ``[N, L]``
  tensor a ``list<T>`` column whose layout says "dense"; a non-tensor field is a string column
  (JSON text unless every value is a string). Fields TQ's schema does not know are kept as extra
  columns, so nothing is lost. A key that lacks a field (not produced yet) has null there;
- partitions named in ``token_capture_partitions`` go to ``token_capture_rows``; the rest to
  ``training_rows`` when every row carries what a training row needs, else (NeMo-RL's token-capture
  staging rows, a partition still being filled, anything else) to ``dataplane_rows``, kept as they
  are (:mod:`coordinator.dataplane.row_kinds`).

Reading uses TQ's public KV API plus three calls of its client that 0.1.11 does not export, each
call bounded by a deadline (:mod:`coordinator.dataplane.tq.client`).

A save does not read back the rows this adapter put: with ``write_once`` it keeps each put's values
(:mod:`coordinator.dataplane.tq.capture`), because TQ's own reads move every row's every field one
tensor at a time (tens of MB/s). Only keys it did not put (another producer's, or past the capture's
bound) are read with ``kv_batch_get``; a save's cut is a :class:`PlannedCut`, a plan of those rows,
written window by window (or, in an incremental save, segment by segment: each new segment's rows
are assembled from the plan only when it is written, and a segment the parent snapshot holds is
not assembled at all). A restore likewise returns once the snapshot's rows are read and kept:
a thread registers every key in TQ in order, then puts the values (:class:`BackgroundLoad`).

What a restore does not bring back: TQ's global indexes themselves (new ones are allocated in key
order; a fresh TQ hands them out ascending, one that reuses released indexes in its own order), the
schema entries of fields no key holds any more, and per-task consumption state, which the KV API
does not expose.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensordict import TensorDict

from coordinator.dataplane.errors import DataPlaneChangedError, DataPlaneError
from coordinator.dataplane.fields import (
    FieldData,
    FieldSpec,
    PartitionRows,
    RowGroup,
    concat_fields,
    field_data,
    group_by_presence,
    rows_of,
    slice_field,
    unify_specs,
)
from coordinator.dataplane.plane import DataPlane
from coordinator.dataplane.row_kinds import training_misfit
from coordinator.dataplane.rows_cut import CopiedCut, RowsCut
from coordinator.dataplane.tq.capture import (
    DEFAULT_MAX_BYTES,
    PartitionPlan,
    RowCapture,
    assemble,
    plan_full_fields,
    plan_range,
    plan_row_bytes,
    plan_source,
    plan_specs,
)
from coordinator.dataplane.tq.client import DEFAULT_CALL_TIMEOUT_S, TQCalls, chunks
from coordinator.dataplane.tq.tensors import from_tq, to_tq
from coordinator.dataplane.writer import ListedPartition, WrittenRows, write_sources
from schemas.errors import InvalidRecordError

log = logging.getLogger(__name__)


class TQDataPlane(DataPlane):
    """TransferQueue as a :class:`~coordinator.dataplane.plane.DataPlane` (TQ must be initialised).

    ``chunk_rows`` bounds how many keys one ``kv_batch_get`` / ``kv_batch_put`` carries (0: all of
    a partition's group at once); a background load puts at most ``load_chunk_rows`` per call (TQ
    keeps each row of a dense put as a view of the put's whole tensor, so this also bounds what
    TQ's own ``save_checkpoint`` writes per row, should anyone call it).

    With ``write_once`` (every key is put once, through this adapter, with all its fields, and not
    changed while it exists), the adapter keeps what it puts (:mod:`coordinator.dataplane.tq.capture`, up to
    ``capture_max_bytes``; 0 keeps nothing), so that a save reads nothing back out of TQ but the
    keys it did not put; and ``background_load`` lets a restore return as soon as the snapshot's
    rows are read, putting them into TQ from a thread (see :meth:`restore_partitions`).
    """

    def __init__(self, token_capture_partitions: Iterable[str] | Callable[[str], bool] | None = None,
                 chunk_rows: int = 0, write_once: bool = True,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, capture_max_bytes: int = DEFAULT_MAX_BYTES,
                 background_load: bool = True, load_chunk_rows: int = 1024) -> None:
        super().__init__(token_capture_partitions)
        self.chunk_rows = chunk_rows
        self.call_timeout_s = call_timeout_s
        self.write_once = write_once
        self.background_load = background_load and write_once
        self.load_chunk_rows = load_chunk_rows
        self._written: set[tuple[str, str]] = set()  # (partition, key) put or loaded through this adapter
        self.capture = RowCapture(capture_max_bytes) if write_once and capture_max_bytes > 0 else None
        self._loading: BackgroundLoad | None = None

    def _tq(self) -> TQCalls:
        return TQCalls(self.call_timeout_s)

    @property
    def rows_write_once(self) -> bool:
        return self.write_once

    # -------------------------------------------------------------------- cut

    def deferred_cut(self) -> RowsCut:
        """With ``write_once``, the pause keeps only TQ's listing (partitions, keys, tags) and, for
        the keys this adapter put, references to the rows it kept (a :class:`PlannedCut`): its time
        grows with the number of keys, not the bytes. Writing it reads the other keys' values later
        and checks that each of those still has its tag."""
        if not self.write_once:
            return super().deferred_cut()
        started = time.perf_counter()
        self._await_registered()
        listing = self._tq().list()
        plans = self._plan(listing)
        return PlannedCut(self, listing, plans, time.time(), time.perf_counter() - started)

    def cut(self) -> CopiedCut:
        """Every row, now. Call it while TQ's producers are held at the barrier.

        When values had to be read from TQ (keys the adapter did not put), the listing (partitions,
        keys, tags) is taken again at the end; if it changed, rows were written during the cut and
        :class:`DataPlaneChangedError` is raised. A cut made only of kept rows needs no second
        listing: one listing is one moment, and the values of its keys are the adapter's own
        write-once copies, so nothing can change between them (this halves the cut's cost, which
        grows with TQ's key count).
        """
        started = time.perf_counter()
        taken_at = time.time()
        self._await_registered()
        t = self._tq()
        listing = t.list()
        plans = self._plan(listing)
        parts = self._read_planned(t, plans)
        if any(len(p.misses) for p in plans) and t.list() != listing:
            raise DataPlaneChangedError("TransferQueue's keys or tags changed while the cut was read "
                                        "(its producers were not held at the barrier)")
        return self._make_cut(parts, started, taken_at)

    def _plan(self, listing: dict[str, dict[str, Any]]) -> list[PartitionPlan]:
        if self.capture is not None:
            return self.capture.resolve(listing)
        return [PartitionPlan(pid, list(kt), [dict(kt[k]) for k in kt], (), np.arange(len(kt), dtype=np.int64), ())
                for pid, kt in listing.items()]

    def _read_planned(self, t: TQCalls, plans: Sequence[PartitionPlan]) -> list[PartitionRows]:
        """The partitions of ``plans``: captured runs as kept, misses read from TQ."""
        return [assemble(plan, missed, order) for plan, (missed, order) in zip(plans, self._read_misses(t, plans))]

    def _read_misses(self, t: TQCalls, plans: Sequence[PartitionPlan]
                     ) -> list[tuple[PartitionRows | None, list[str] | None]]:
        """For each plan, its misses' rows read from TQ and TQ's field order (``None``, ``None``: none)."""
        if any(len(p.misses) for p in plans) and self._loading is not None:
            self._loading.wait(self.call_timeout_s)  # a miss may be a restored key whose values are on their way
            self._check_loading()
        out: list[tuple[PartitionRows | None, list[str] | None]] = []
        for plan in plans:
            if not len(plan.misses):
                out.append((None, None))
                continue
            schema = t.field_schema(plan.partition_id)
            missed = self._read_partition(t, plan.partition_id,
                                          {plan.keys[i]: plan.tags[i] for i in plan.misses}, schema)
            out.append((missed, list(schema)))
        return out

    def _read_partition(self, t: TQCalls, pid: str, key_tags: dict[str, Any],
                        schema: dict[str, dict[str, Any]] | None = None) -> PartitionRows:
        keys = list(key_tags)
        if not keys:
            return PartitionRows(pid, [], [], {}, [])
        gis = np.asarray(t.global_indexes(pid, keys), dtype=np.int64)
        if len(gis) != len(keys):
            raise DataPlaneChangedError(
                f"partition {pid!r}: {len(keys) - len(gis)} listed keys vanished during the cut")
        schema = t.field_schema(pid) if schema is None else schema
        presence = {}
        for name in schema:
            gi, ok = t.produced(pid, name)
            pos = np.searchsorted(gi, gis)
            pos = np.minimum(pos, max(len(gi) - 1, 0))
            if len(gi) == 0 or not np.array_equal(gi[pos], gis):
                raise DataPlaneChangedError(f"partition {pid!r}: production status does not cover its keys")
            presence[name] = ok[pos]
        presence = {name: p for name, p in presence.items() if p.any()}
        part = PartitionRows(pid, keys, [dict(key_tags[k]) for k in keys])
        for rows, names in group_by_presence(presence, len(keys)):
            if not names:
                continue
            group_keys = [keys[i] for i in rows]
            got = [self._fields_of(t.get(pid, group_keys[s:s + step], names), names, pid, schema)
                   for s, step in chunks(len(group_keys), self.chunk_rows)]
            fields: dict[str, FieldData] = {}
            for name in names:
                spec = unify_specs([c[name][0] for c in got] + ([part.specs[name]] if name in part.specs else []),
                                   f"partition {pid!r} field {name!r}")
                part.specs[name] = spec
                fields[name] = concat_fields([c[name][1] for c in got], spec)
            part.groups.append(RowGroup(rows, fields))
        part.specs = {name: part.specs[name] for name in schema if name in part.specs}  # TQ's field order
        return part

    @staticmethod
    def _fields_of(td: TensorDict, names: list[str], pid: str, schema: dict[str, dict[str, Any]]
                   ) -> dict[str, tuple[FieldSpec, FieldData]]:
        n = td.batch_size[0]
        out = {}
        for name in names:
            where = f"partition {pid!r} field {name!r}"
            value = td.get(name)
            nested = bool(schema.get(name, {}).get("is_nested", False))
            out[name] = from_tq(value, n, nested, where)
        return out

    # ------------------------------------------------------------ put

    def put(self, partition_id: str, keys: Sequence[str], fields: Any = None, tags: Any = None) -> None:
        """``kv_batch_put``; with ``write_once``, a key put before (through this adapter) is refused.
        Waits until a background load has registered the restored keys (so TQ keeps their order)."""
        n = len(keys)
        if not n or len(set(keys)) != n:
            raise InvalidRecordError("keys must be distinct strings, at least one")
        if self.write_once:
            again = [k for k in keys if (partition_id, k) in self._written]
            if again:
                raise DataPlaneError(f"partition {partition_id!r}: keys {again[:5]} were put before; this data "
                                     "plane is write-once (a save may be reading them)")
        specs: dict[str, FieldSpec] = {}
        data: dict[str, FieldData] = {}
        for name, value in (fields or {}).items():
            spec, values = rows_of(name, value, n)
            specs[name], data[name] = spec, field_data(spec, values)
        td = None
        if data:
            td = TensorDict({name: to_tq(specs[name], data[name], n, f"partition {partition_id!r} field {name!r}")
                             for name in data}, batch_size=[n])
        self._await_registered()
        self._tq().put(partition_id, list(keys), td, None if tags is None else [dict(t) for t in tags])
        self._written.update((partition_id, k) for k in keys)
        if self.capture is not None:  # the values TQ now holds for these keys, kept for the next save
            self.capture.add(partition_id, keys, specs, data)

    # ------------------------------------------------------------ restore etc.

    def restore_partitions(self, partitions: Sequence[PartitionRows]) -> None:
        """Put ``partitions`` into the (empty) TQ: the same keys in the same order, tags and values.

        With ``background_load`` this returns at once: a thread registers every key in order (with
        its tag), then puts the values, ``load_chunk_rows`` keys per call. Until the keys are
        registered, :meth:`put` and the cuts wait (so TQ's order is the snapshot's, then new keys); a
        cut needs no restored value from TQ, the capture holds them (a partition the capture cannot
        keep makes the cut wait for the whole load). A consumer reading TQ directly sees a key's
        fields as TQ's production status reports them: not produced until its values are put.
        :meth:`wait_loaded` waits for the end; a failure is raised by the next put or cut.
        """
        self._written.update((p.partition_id, k) for p in partitions for k in p.keys)
        if self.capture is not None:
            for p in partitions:
                self.capture.adopt(p)
        if not self.background_load:
            t = self._tq()
            for p in partitions:
                self._register(t, p, with_values=True)
            return
        self._loading = BackgroundLoad(self, list(partitions))

    def _register(self, t: TQCalls, p: PartitionRows, with_values: bool) -> None:
        """Create ``p``'s keys in order with their tags (and, ``with_values``, put every value too)."""
        if not p.keys:
            t.make_empty_partition(p.partition_id)
        elif with_values and self._uniform(p):
            for g in p.groups:  # consecutive runs of rows, in order: keys are created in the saved order
                self._put_group(t, p, g, with_tags=True, step=self.chunk_rows)
        else:
            for s, step in chunks(len(p.keys), self.chunk_rows if with_values else self.load_chunk_rows):
                t.put(p.partition_id, p.keys[s:s + step], None, [dict(x) for x in p.tags[s:s + step]])
            if with_values:
                self._fill(t, p, self.chunk_rows)

    def _fill(self, t: TQCalls, p: PartitionRows, step: int, stop: threading.Event | None = None) -> None:
        """Put the values of ``p``, whose keys exist. A partition whose rows hold different fields is
        filled one field at a time, in the saved field order, so TQ registers its fields in that order."""
        if self._uniform(p):
            for g in p.groups:
                self._put_group(t, p, g, with_tags=False, step=step, stop=stop)
            return
        for name in p.specs:
            for g in p.groups:
                if name in g.fields:
                    self._put_group(t, p, g, with_tags=False, only=name, step=step, stop=stop)

    @staticmethod
    def _uniform(p: PartitionRows) -> bool:
        """Whether every row holds the same fields, its groups consecutive runs of rows in order (one
        group for a partition read whole; one per segment for a partition joined from segments), so
        that each group is put with all its fields at once."""
        names = set(p.groups[0].fields) if p.groups else set()
        at = 0
        for g in p.groups:
            n = len(g.rows)
            if not n or set(g.fields) != names or int(g.rows[0]) != at or int(g.rows[-1]) != at + n - 1:
                return False
            at += n
        return bool(names) and at == len(p.keys)

    def _put_group(self, t: TQCalls, p: PartitionRows, g: RowGroup, with_tags: bool, only: str | None = None,
                   step: int = 0, stop: threading.Event | None = None) -> None:
        n = len(g.rows)
        names = [name for name in p.specs if name in g.fields and (only is None or name == only)]
        for s, size in chunks(n, step):
            if stop is not None and stop.is_set():
                raise _Cancelled()
            rows = g.rows[s:s + size]
            fields = {name: to_tq(p.specs[name], slice_field(g.fields[name], p.specs[name], s, s + len(rows)),
                                  len(rows), f"partition {p.partition_id!r} field {name!r}")
                      for name in names}
            td = TensorDict(fields, batch_size=[len(rows)])
            keys = [p.keys[i] for i in rows]
            tags = [dict(p.tags[i]) for i in rows] if with_tags else None
            t.put(p.partition_id, keys, td, tags)

    def wait_loaded(self, timeout: float | None = None) -> LoadProgress | None:
        """Wait until a background load has put every restored value into TQ; its progress (None if
        there was none). Raises its error if it failed."""
        loading = self._loading
        if loading is None:
            return None
        loading.wait(timeout if timeout is not None else self.call_timeout_s)
        self._check_loading()
        return loading.progress()

    def _await_registered(self) -> None:
        loading = self._loading
        if loading is None:
            return
        if not loading.registered.wait(self.call_timeout_s):
            raise DataPlaneError(f"the restored keys were not registered in TransferQueue within "
                                 f"{self.call_timeout_s:.0f}s")
        self._check_loading()

    def _check_loading(self) -> None:
        loading = self._loading
        if loading is not None and loading.error is not None:
            raise DataPlaneError(f"putting the restored rows into TransferQueue failed: {loading.error}") \
                from loading.error

    def clear(self) -> None:
        if self._loading is not None:
            self._loading.cancel(self.call_timeout_s)
            self._loading = None
        t = self._tq()
        self._written.clear()
        if self.capture is not None:
            self.capture.clear()
        for pid, keys in t.list().items():
            t.drop_partition(pid, bool(keys))
        left = t.list()
        if left:
            raise DataPlaneError(f"TransferQueue still holds partitions {sorted(left)} after clear()")

    def is_empty(self) -> bool:
        return not self._tq().list()


class _Cancelled(Exception):
    """A background load was told to stop (the data plane is being cleared)."""


@dataclass(frozen=True)
class LoadProgress:
    """Where a background load is: keys registered, rows whose values are in TQ, and its times."""

    partitions: int
    keys: int
    registered_s: float | None
    loaded_s: float | None


class BackgroundLoad:
    """Puts a restore's rows into TQ from a thread: every key first (in order, with its tag), then
    the values. ``registered`` and ``done`` are set as each phase ends (``done`` also on failure)."""

    def __init__(self, plane: TQDataPlane, partitions: list[PartitionRows]) -> None:
        self._plane = plane
        self._partitions = partitions
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self.registered = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.registered_s: float | None = None
        self.loaded_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="tq-background-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        plane = self._plane
        try:
            t = plane._tq()
            for p in self._partitions:
                if self._stop.is_set():
                    raise _Cancelled()
                plane._register(t, p, with_values=False)
            self.registered_s = time.perf_counter() - self._started
            self.registered.set()
            for p in self._partitions:
                if p.keys:
                    plane._fill(t, p, plane.load_chunk_rows, self._stop)
            self.loaded_s = time.perf_counter() - self._started
            log.info("restored rows are all in TransferQueue: keys registered in %.3fs, values in %.3fs",
                     self.registered_s, self.loaded_s)
        except _Cancelled:
            pass
        except BaseException as exc:  # kept for the next put or cut to raise; nothing joins this thread for it
            self.error = exc
            log.error("putting the restored rows into TransferQueue failed: %s", exc)
        finally:
            self.registered.set()
            self.done.set()

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise DataPlaneError(f"the restored rows were not all put into TransferQueue within {timeout:.0f}s")

    def cancel(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def progress(self) -> LoadProgress:
        return LoadProgress(len(self._partitions), sum(len(p.keys) for p in self._partitions),
                            self.registered_s, self.loaded_s)


class PlannedCut(RowsCut):
    """TQ's listing at the barrier and the captured rows it names (:meth:`RowCapture.resolve`); the
    other keys' values are read when it is written or materialized, once those keys are checked to
    still have their tags."""

    def __init__(self, plane: TQDataPlane, listing: dict[str, dict[str, Any]], plans: list[PartitionPlan],
                 taken_at: float, seconds: float) -> None:
        self._plane = plane
        self._listing = listing
        self._plans = plans
        self._taken_at = taken_at
        self.seconds = seconds
        self.held_bytes = 0  # the listing (keys and small tags) and references to rows kept anyway
        self.write_once = True  # its rows are the adapter's write-once rows

    def materialize(self) -> CopiedCut:
        started = time.perf_counter()
        read = self._read_misses()
        parts = [assemble(plan, missed, order) for plan, (missed, order) in zip(self._plans, read)]
        return self._plane._make_cut(parts, started, self._taken_at)

    def write(self, part, compression: str = "none") -> WrittenRows:
        """Write the cut's rows window by window (:func:`~coordinator.dataplane.tq.capture.plan_source`):
        the kept rows are copied one window at a time as they are written; the misses, read from TQ
        first, are held whole until their partition is written."""
        read = enumerate(zip(self._plans, self._read_misses()))
        sources = self._plane.sources_by_kind(plan_source(plan, position, missed, order)
                                              for position, (plan, (missed, order)) in read)
        return write_sources(sources, part, compression)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self._plane.kinds

    def listed_partitions(self) -> list[ListedPartition]:
        """Each partition's plan (its misses read from TQ first): its kind decided over the whole
        partition, a segment's rows assembled from the plan only when that segment is written."""
        out = []
        for position, (plan, (missed, order)) in enumerate(zip(self._plans, self._read_misses())):
            specs = plan_specs(plan, missed, order)
            misfit = training_misfit(specs, plan_full_fields(plan, missed), plan.tags)
            out.append(ListedPartition(plan.partition_id, plan.keys, self._plane.kind_with(plan.partition_id, misfit),
                                       _segment_source(plan, missed, order, specs, position),
                                       plan_row_bytes(plan, missed)))
        return out

    def _read_misses(self) -> list[tuple[PartitionRows | None, list[str] | None]]:
        """The misses' rows (read from TQ), once every one of those keys is checked to still have its tag."""
        t = self._plane._tq()
        try:
            read = self._plane._read_misses(t, self._plans)
        except DataPlaneChangedError as exc:
            raise DataPlaneChangedError(f"{_BROKEN}: {exc}") from None
        missed = [(p.partition_id, [p.keys[i] for i in p.misses]) for p in self._plans if len(p.misses)]
        if missed:
            now = t.list()
            for pid, keys in missed:
                current, listed = now.get(pid), self._listing[pid]
                if current is None or any(current.get(k, _GONE) != listed[k] for k in keys):
                    raise DataPlaneChangedError(f"{_BROKEN}: partition {pid!r} no longer holds them as listed")
        return read


def _segment_source(plan: PartitionPlan, missed: PartitionRows | None, order: list[str] | None,
                    specs: dict[str, FieldSpec], position: int):
    """Listed positions ``[start, stop)`` of ``plan`` as a source of their own (one segment), with the
    whole partition's layouts."""
    def source(start: int, stop: int):
        sub, sub_missed = plan_range(plan, missed, start, stop)
        return plan_source(sub, position, sub_missed, order, specs=specs)
    return source


_GONE = object()
_BROKEN = ("rows of the cut were changed or removed before they were read (the write-once contract was "
           "broken); this save is not published")


__all__ = ["BackgroundLoad", "LoadProgress", "PlannedCut", "TQDataPlane"]
