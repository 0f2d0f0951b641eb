"""The TransferQueue data plane: cut, write and load TQ's rows (PyPI ``transferqueue`` 0.1.11).

How TQ's rows map to the row tables (see :mod:`coordinator.data_plane` for the table side):

- every partition (``kv_list()``), its keys in ``kv_list`` order (the order they were created),
  and each key's tag;
- every field TQ holds for a key: a ragged (jagged) tensor is a ``list<T>`` column (nested lists for
  per-row ``[n, k, ...]`` tensors), a dense per-row scalar a scalar column, a dense ``[N, L]``
  tensor a ``list<T>`` column whose layout says "dense"; a non-tensor field is a string column
  (JSON text unless every value is a string). Fields TQ's schema does not know are kept as extra
  columns, so nothing is lost. A key that lacks a field (not produced yet) has null there;
- partitions named in ``token_capture_partitions`` go to ``token_capture_rows``, the rest to
  ``training_rows``.

Reading uses TQ's public KV API plus three calls of its client that 0.1.11 does not export
(``_get_partition_meta`` for the field schema and ``_clear_partition_in_controller`` to remove an
empty partition; ``_run_coroutine`` to call them): they are confined to :class:`_TQ`.

What a restore does not bring back: TQ's global indexes themselves (new ones are allocated in key
order; a fresh TQ hands them out ascending, one that reuses released indexes in its own order), the
schema entries of fields no key holds any more, and per-task consumption state, which the KV API
does not expose.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from coordinator import ray_runtime  # noqa: F401  (sets the loopback variable before ray is imported)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.tensorclass import NonTensorData, NonTensorStack  # noqa: E402

from coordinator.data_plane import (  # noqa: E402
    DataPlane, DataPlaneChangedError, DataPlaneCut, DataPlaneError, DeferredCut, FieldData, FieldSpec, InvalidRecordError,
    PartitionRows, RowGroup, field_data, group_by_presence, rows_of,
)

_EMPTY_PARTITION_PROBE = "__dataplane_empty_partition_probe__"


DEFAULT_CALL_TIMEOUT_S = 300.0
# TransferQueue's client waits forever for a storage unit that died; every call goes through these
# threads so that the caller gives up at a deadline with a clear error (a hung thread stays behind).
_CALLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tq-call")


def _bounded(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: _TQ, *args: Any) -> Any:
        future = _CALLS.submit(method, self, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FuturesTimeout:
            raise DataPlaneError(f"TransferQueue did not answer {method.__name__} within {self.timeout_s:.0f}s "
                                 "(is its controller or a storage unit dead?)") from None
    call.__name__ = method.__name__
    return call


class _TQ:
    """The few TransferQueue calls the adapter makes, in one place, each bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        self.client = tq.get_client()
        self.timeout_s = timeout_s

    @_bounded
    def list(self) -> dict[str, dict[str, Any]]:
        return tq.kv_list()

    @_bounded
    def global_indexes(self, pid: str, keys: list[str]) -> list[int]:
        meta = self.client.kv_retrieve_meta(keys=keys, partition_id=pid, create=False)
        return list(meta.global_indexes)

    @_bounded
    def field_schema(self, pid: str) -> dict[str, dict[str, Any]]:
        meta = self.client._run_coroutine(self.client._get_partition_meta(pid))
        return {} if meta is None else dict(meta.field_schema)

    @_bounded
    def produced(self, pid: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        gi, status = self.client.get_production_status(data_fields=[name], partition_id=pid)
        if gi is None:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
        return gi.numpy().astype(np.int64), status[:, 0].numpy() == 1

    @_bounded
    def get(self, pid: str, keys: list[str], fields: list[str]) -> TensorDict:
        return tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=fields)

    @_bounded
    def put(self, pid: str, keys: list[str], fields: TensorDict | None, tags: list[dict] | None) -> None:
        tq.kv_batch_put(keys=keys, partition_id=pid, fields=fields, tags=tags)

    @_bounded
    def make_empty_partition(self, pid: str) -> None:
        self.client.kv_retrieve_meta(keys=[_EMPTY_PARTITION_PROBE], partition_id=pid, create=True)
        tq.kv_clear(keys=[_EMPTY_PARTITION_PROBE], partition_id=pid)

    @_bounded
    def drop_partition(self, pid: str, has_keys: bool) -> None:
        if has_keys:
            self.client.clear_partition(pid)
        else:  # clear_partition skips a partition with no samples; remove it from the controller directly
            self.client._run_coroutine(self.client._clear_partition_in_controller(pid))


class TQDataPlane(DataPlane):
    """TransferQueue as a :class:`~coordinator.data_plane.DataPlane` (TQ must be initialised).

    ``chunk_rows`` bounds how many keys one ``kv_batch_get`` / ``kv_batch_put`` carries (0: all of
    a partition's group at once).
    """

    def __init__(self, token_capture_partitions: Iterable[str] | Callable[[str], bool] | None = None,
                 chunk_rows: int = 0, write_once: bool = True,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        super().__init__(token_capture_partitions)
        self.chunk_rows = chunk_rows
        self.call_timeout_s = call_timeout_s
        self.write_once = write_once
        self._written: set[tuple[str, str]] = set()  # (partition, key) put or loaded through this adapter

    def _tq(self) -> _TQ:
        return _TQ(self.call_timeout_s)

    def deferred_cut(self) -> DeferredCut:
        """With ``write_once`` (every key is put once, never changed or removed while a save is in
        flight), the pause keeps only TQ's listing (partitions, keys, tags): its time grows with the
        number of keys, not the bytes. The values are read later by :meth:`DeferredCut.materialize`,
        which checks that every listed key still has its tag."""
        if not self.write_once:
            return super().deferred_cut()
        started = time.perf_counter()
        listing = self._tq().list()
        return _ListingCut(self, listing, time.time(), time.perf_counter() - started)

    # -------------------------------------------------------------------- cut

    def cut(self) -> DataPlaneCut:
        """Read every row out of TQ. Call it while TQ's producers are held at the barrier.

        The listing (partitions, keys, tags) is taken again at the end; if it changed, rows were
        written during the cut and :class:`DataPlaneChangedError` is raised.
        """
        started = time.perf_counter()
        taken_at = time.time()
        t = self._tq()
        listing = t.list()
        parts = [self._read_partition(t, pid, key_tags) for pid, key_tags in listing.items()]
        if t.list() != listing:
            raise DataPlaneChangedError("TransferQueue's keys or tags changed while the cut was read "
                                        "(its producers were not held at the barrier)")
        return self._make_cut(parts, started, taken_at)

    def _read_partition(self, t: _TQ, pid: str, key_tags: dict[str, Any]) -> PartitionRows:
        keys = list(key_tags)
        if not keys:
            return PartitionRows(pid, [], [], {}, [])
        gis = np.asarray(t.global_indexes(pid, keys), dtype=np.int64)
        if len(gis) != len(keys):
            raise DataPlaneChangedError(
                f"partition {pid!r}: {len(keys) - len(gis)} listed keys vanished during the cut")
        schema = t.field_schema(pid)
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
            chunks = [self._fields_of(t.get(pid, group_keys[s:s + step], names), names, pid, schema)
                      for s, step in _chunks(len(group_keys), self.chunk_rows)]
            fields: dict[str, FieldData] = {}
            for name in names:
                spec = _unify([c[name][0] for c in chunks] + ([part.specs[name]] if name in part.specs else []),
                              f"partition {pid!r} field {name!r}")
                part.specs[name] = spec
                fields[name] = _merge([c[name][1] for c in chunks], spec)
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
            out[name] = _from_tq(value, n, nested, where)
        return out

    # ------------------------------------------------------------ put

    def put(self, partition_id: str, keys: Sequence[str], fields: Any = None, tags: Any = None) -> None:
        """``kv_batch_put``; with ``write_once``, a key put before (through this adapter) is refused."""
        n = len(keys)
        if not n or len(set(keys)) != n:
            raise InvalidRecordError("keys must be distinct strings, at least one")
        if self.write_once:
            again = [k for k in keys if (partition_id, k) in self._written]
            if again:
                raise DataPlaneError(f"partition {partition_id!r}: keys {again[:5]} were put before; this data "
                                     "plane is write-once (a save may be reading them)")
        td = None
        if fields:
            converted = {}
            for name, value in fields.items():
                spec, values = rows_of(name, value, n)
                converted[name] = _to_tq(spec, field_data(spec, values), n,
                                         f"partition {partition_id!r} field {name!r}")
            td = TensorDict(converted, batch_size=[n])
        self._tq().put(partition_id, list(keys), td, None if tags is None else [dict(t) for t in tags])
        self._written.update((partition_id, k) for k in keys)

    # ------------------------------------------------------------ restore etc.

    def restore_partitions(self, partitions: Sequence[PartitionRows]) -> None:
        t = self._tq()
        self._written.update((p.partition_id, k) for p in partitions for k in p.keys)
        for p in partitions:
            if not p.keys:
                t.make_empty_partition(p.partition_id)
                continue
            whole = (len(p.groups) == 1 and len(p.groups[0].rows) == len(p.keys)
                     and bool(np.all(p.groups[0].rows == np.arange(len(p.keys)))) and p.groups[0].fields)
            if whole:
                self._put_group(t, p, p.groups[0], with_tags=True)
                continue
            # Rows hold different fields. Register every key first, in order, with its tag; then put
            # one field at a time, in the saved field order, into the groups that hold it.
            for s, step in _chunks(len(p.keys), self.chunk_rows):
                t.put(p.partition_id, p.keys[s:s + step], None, [dict(x) for x in p.tags[s:s + step]])
            for name in p.specs:
                for g in p.groups:
                    if name in g.fields:
                        self._put_group(t, p, g, with_tags=False, only=name)

    def _put_group(self, t: _TQ, p: PartitionRows, g: RowGroup, with_tags: bool, only: str | None = None) -> None:
        n = len(g.rows)
        names = [name for name in p.specs if name in g.fields and (only is None or name == only)]
        for s, step in _chunks(n, self.chunk_rows):
            rows = g.rows[s:s + step]
            fields = {name: _to_tq(p.specs[name], _slice(g.fields[name], p.specs[name], s, s + len(rows)), len(rows),
                                   f"partition {p.partition_id!r} field {name!r}")
                      for name in names}
            td = TensorDict(fields, batch_size=[len(rows)])
            keys = [p.keys[i] for i in rows]
            tags = [dict(p.tags[i]) for i in rows] if with_tags else None
            t.put(p.partition_id, keys, td, tags)

    def clear(self) -> None:
        t = self._tq()
        self._written.clear()
        for pid, keys in t.list().items():
            t.drop_partition(pid, bool(keys))
        left = t.list()
        if left:
            raise DataPlaneError(f"TransferQueue still holds partitions {sorted(left)} after clear()")

    def is_empty(self) -> bool:
        return not self._tq().list()


class _ListingCut(DeferredCut):
    """TQ's listing at the barrier; the values of exactly those keys are read on :meth:`materialize`."""

    def __init__(self, plane: TQDataPlane, listing: dict[str, dict[str, Any]], taken_at: float,
                 seconds: float) -> None:
        self._plane = plane
        self._listing = listing
        self._taken_at = taken_at
        self.seconds = seconds
        self.held_bytes = 0  # the listing only (keys and small tags)

    def materialize(self) -> DataPlaneCut:
        started = time.perf_counter()
        t = self._plane._tq()
        try:
            parts = [self._plane._read_partition(t, pid, key_tags) for pid, key_tags in self._listing.items()]
        except DataPlaneChangedError as exc:
            raise DataPlaneChangedError(f"{_BROKEN}: {exc}") from None
        now = t.list()
        for pid, key_tags in self._listing.items():
            current = now.get(pid)
            if current is None or any(current.get(k, _GONE) != tag for k, tag in key_tags.items()):
                raise DataPlaneChangedError(f"{_BROKEN}: partition {pid!r} no longer holds them as listed")
        return self._plane._make_cut(parts, started, self._taken_at)


_GONE = object()
_BROKEN = ("rows of the cut were changed or removed before they were read (the write-once contract was "
           "broken); this save is not published")


# ------------------------------------------------------------------------ conversions


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    step = size if size and size > 0 else max(n, 1)
    return [(s, step) for s in range(0, n, step)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numpy(t: torch.Tensor) -> np.ndarray:
    """An owned numpy copy of ``t`` (bfloat16 widened to float32, exactly)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return np.array(t.contiguous().numpy(), copy=True)


def _from_tq(value: Any, n: int, nested: bool, where: str) -> tuple[FieldSpec, FieldData]:
    """One field of a ``kv_batch_get`` result as (layout, values)."""
    if isinstance(value, torch.Tensor):
        dtype = _dtype_name(value.dtype)
        if value.is_nested:
            if value.layout != torch.jagged:
                raise InvalidRecordError(f"{where}: nested tensors of layout {value.layout} are not supported")
            if value.lengths() is not None:  # a jagged view with holes: take the rows one by one
                rows = list(value.unbind())
                values = torch.cat(rows) if rows else value.values()[:0]
                offsets = np.concatenate([[0], np.cumsum([r.shape[0] for r in rows])]).astype(np.int64)
            else:
                values = value.values()
                offsets = value.offsets().cpu().numpy().astype(np.int64)
                values = values[int(offsets[0]):int(offsets[-1])]
                offsets = offsets - offsets[0]
            lengths = np.diff(offsets)
            # Keep TQ's own dense/ragged flag (a dense [N, L] put comes back jagged too).
            ragged = nested or (len(lengths) > 0 and not bool(np.all(lengths == lengths[0])))
            spec = FieldSpec("tensor", dtype, value.dim() - 1, tuple(values.shape[1:]), ragged)
            return spec, FieldData(_numpy(values), offsets)
        if value.dim() == 0 or value.shape[0] != n:
            raise InvalidRecordError(f"{where}: tensor of shape {tuple(value.shape)} for {n} rows")
        if value.dim() == 1:
            return FieldSpec("tensor", dtype, 0, (), False), FieldData(_numpy(value))
        length = value.shape[1]
        values = value.reshape(n * length, *value.shape[2:])
        offsets = np.arange(n + 1, dtype=np.int64) * length
        spec = FieldSpec("tensor", dtype, value.dim() - 1, tuple(value.shape[2:]), nested)
        return spec, FieldData(_numpy(values), offsets)
    if isinstance(value, NonTensorData):
        values = [value.data] * n
    elif isinstance(value, NonTensorStack):
        values = value.tolist()
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        raise InvalidRecordError(f"{where}: a {type(value).__name__} field is not supported")
    if len(values) != n:
        raise InvalidRecordError(f"{where}: {len(values)} values for {n} rows")
    return FieldSpec("object"), FieldData(values)


def _unify(specs: list[FieldSpec], where: str) -> FieldSpec:
    """One layout for a field read in several gets: they must agree, except that a field TQ calls
    dense but whose rows differ in length somewhere is ragged everywhere."""
    distinct = set(specs)
    if len(distinct) == 1:
        return specs[0]
    if len({dataclasses.replace(s, nested=False) for s in distinct}) == 1:
        return dataclasses.replace(specs[0], nested=True)
    raise InvalidRecordError(f"{where}: layouts differ between rows: {sorted(map(str, distinct))}")


def _merge(parts: list[FieldData], spec: FieldSpec) -> FieldData:
    if len(parts) == 1:
        return parts[0]
    if spec.type == "object":
        return FieldData([v for p in parts for v in p.values])
    values = np.concatenate([p.values for p in parts], axis=0)
    if spec.ndim == 0:
        return FieldData(values)
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for p in parts:
        offsets.append(p.offsets[1:] + base)
        base += int(p.offsets[-1])
    return FieldData(values, np.concatenate(offsets))


def _slice(fd: FieldData, spec: FieldSpec, start: int, stop: int) -> FieldData:
    if spec.type == "object":
        return FieldData(list(fd.values[start:stop]))
    if spec.ndim == 0:
        return FieldData(fd.values[start:stop])
    off = fd.offsets[start:stop + 1]
    return FieldData(fd.values[int(off[0]):int(off[-1])], off - off[0])


_TORCH_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64")}


def _to_tq(spec: FieldSpec, fd: FieldData, n: int, where: str) -> Any:
    """One field as TQ takes it: a tensor (dense or jagged) or a NonTensorStack."""
    if spec.type == "object":
        return NonTensorStack(*fd.values)
    arr = np.ascontiguousarray(fd.values)
    if not arr.flags.writeable:  # read straight from a memory-mapped part: give torch its own copy
        arr = arr.copy()
    values = torch.from_numpy(arr).to(_TORCH_DTYPES[spec.dtype])
    if spec.ndim == 0:
        return values
    offsets = np.asarray(fd.offsets, dtype=np.int64)
    if spec.nested:
        return torch.nested.nested_tensor_from_jagged(values, torch.from_numpy(offsets))
    lengths = np.diff(offsets)
    if len(lengths) and not np.all(lengths == lengths[0]):
        raise InvalidRecordError(
            f"{where}: a dense field needs rows of one length, got {sorted(set(lengths.tolist()))[:5]}")
    return values.reshape(n, int(lengths[0]) if len(lengths) else 0, *spec.inner)


__all__ = ["TQDataPlane"]
