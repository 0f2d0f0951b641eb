"""The data-plane adapter: what the coordinator needs from whatever holds the training rows.

A data plane (TransferQueue in production, :class:`InMemoryDataPlane` in unit tests) holds rows in
*partitions*; a row is a *key*, a *tag* (a small JSON-like dict) and *fields* (tensors, ragged or
dense, or plain Python objects). The coordinator uses it in three steps that keep the cut (what
must be consistent) apart from writing the bytes (what may happen after Gym resumes):

1. :meth:`DataPlane.cut`, called while the data plane's producers are held at the barrier: a
   consistent, immutable in-memory copy of every row, as one Arrow table per row kind
   (``training_rows``; ``token_capture_rows`` for partitions configured as such; ``dataplane_rows``
   for partitions whose rows are neither, see :mod:`coordinator.row_kinds`), plus the list of
   partitions (empty ones included). Nothing written to the data plane after ``cut()`` returns can
   reach the snapshot.
2. :func:`write_cut` (also :meth:`DataPlane.write_cut`), after the barrier is released: streams
   each table into the snapshot's part, one Arrow file per kind (``training.arrow``,
   ``token_capture.arrow``, ``dataplane.arrow``), checked by snapformat's row rules. A data plane
   whose cut is only a plan of rows it holds (TransferQueue's adapter) writes the same files with
   :func:`write_sources` instead, building the table one window of rows at a time
   (:meth:`DeferredCut.write`), so that writing never holds a copy of the whole cut.
3. :meth:`DataPlane.load`, on restore: reads those files back (checksums verified) into an empty
   data plane, so that it holds exactly what it held: the same partitions, keys (in the same
   order), tags, and field values with their dtypes, shapes and dense/ragged layout.

How rows map to the row schemas (``schemas.rows``): the columns ``key`` and ``partition_id`` are
the data plane's key and partition; every field becomes a column of its own name (a field named
like a required column fills it, cast to the canonical type when needed; in ``dataplane_rows`` a
field whose name is reserved or taken by another type gets a column of its own, see
:func:`coordinator.row_kinds.assign_columns`); a required column that is not a field is taken from
the row's tag of the same name (``rollout_id``, ``attempt_index``); the tag itself is kept as JSON
text in ``row_tags``. A per-row scalar is a scalar column, a per-row 1-D tensor a ``list<T>``
column, a per-row ``[n, k, ...]`` tensor nested lists; a row that lacks a field holds null there.
What Arrow cannot say by itself (the data plane's own dtype when the column was cast, bfloat16,
dense versus ragged, object fields kept as JSON, a field's column when not its name) is recorded
per partition and field in the ``dataplane.layout`` metadata of the ``row_tags`` column (SPEC
§12.2a), which every row file keeps (:func:`_write_rows` says how, through snapformat's conformance).

This module needs numpy and pyarrow only: no Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from coordinator.row_kinds import (
    COLUMN_KEY, DATAPLANE, FILE_NAMES, KEY_COLUMN, PARTITION_COLUMN, RESERVED_COLUMNS, TAGS_COLUMN, TOKEN_CAPTURE,
    TRAINING, assign_columns, assign_kind, fields_every_row_holds, training_misfit,
)
from schemas.errors import InvalidRecordError, NotPublishedError, SnapshotError
from schemas.manifest import FileEntry
from schemas.rows import ROW_SCHEMAS

LAYOUT_KEY = b"dataplane.layout"
LAYOUT_VERSION = 1

log = logging.getLogger("coordinator.data_plane")

# dtype name (torch's spelling, without "torch.") -> (numpy dtype of the values, Arrow type of the column).
# bfloat16 travels as float32 (every bfloat16 is exactly a float32): numeric, so a trainer reading the
# column sees real values, and the layout says to narrow it back on restore.
_DTYPES: dict[str, tuple[np.dtype, pa.DataType]] = {
    "bool": (np.dtype(np.bool_), pa.bool_()),
    "uint8": (np.dtype(np.uint8), pa.uint8()),
    "int8": (np.dtype(np.int8), pa.int8()),
    "uint16": (np.dtype(np.uint16), pa.uint16()),
    "int16": (np.dtype(np.int16), pa.int16()),
    "uint32": (np.dtype(np.uint32), pa.uint32()),
    "int32": (np.dtype(np.int32), pa.int32()),
    "uint64": (np.dtype(np.uint64), pa.uint64()),
    "int64": (np.dtype(np.int64), pa.int64()),
    "float16": (np.dtype(np.float16), pa.float16()),
    "bfloat16": (np.dtype(np.float32), pa.float32()),
    "float32": (np.dtype(np.float32), pa.float32()),
    "float64": (np.dtype(np.float64), pa.float64()),
}
_MAX_LIST_VALUES = 2**31 - 1  # list<T> has int32 offsets


class DataPlaneError(SnapshotError):
    """The data plane cannot be cut or loaded as asked (it changed, it is not empty, ...)."""


class DataPlaneChangedError(DataPlaneError):
    """Rows changed while the cut was read: the data plane's producers were not held at the barrier."""


class DataPlaneNotEmptyError(DataPlaneError):
    """``load`` was asked to restore into a data plane that still holds partitions."""


# ---------------------------------------------------------------------------------------------
# The neutral form both directions go through: numpy values + row offsets per field and group.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldSpec:
    """How the data plane holds one field of one partition.

    ``type`` is ``"tensor"`` or ``"object"`` (any Python value, e.g. a string). For tensors:
    ``dtype`` (torch's name: ``int32``, ``bfloat16``, ...), ``ndim`` (dimensions of one row's
    value: 0 for a scalar per row), ``inner`` (the row's dimensions after its first, which must be
    the same for every row) and ``nested`` (the data plane holds it as a ragged (jagged) tensor
    rather than a dense one).
    """

    type: str
    dtype: str | None = None
    ndim: int = 0
    inner: tuple[int, ...] = ()
    nested: bool = False

    def __post_init__(self) -> None:
        if self.type == "tensor":
            if self.dtype not in _DTYPES:
                raise InvalidRecordError(f"dtype {self.dtype!r} is not supported (expected one of {sorted(_DTYPES)})")
            if self.ndim < 0 or (self.ndim <= 1 and self.inner) or (self.ndim > 1 and len(self.inner) != self.ndim - 1):
                raise InvalidRecordError(f"ndim {self.ndim} does not match inner dimensions {self.inner}")
            if self.nested and self.ndim == 0:
                raise InvalidRecordError("a scalar-per-row field cannot be nested")
        elif self.type != "object":
            raise InvalidRecordError(f"field type {self.type!r} is not 'tensor' or 'object'")

    @property
    def numpy_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype][0]

    def arrow_type(self) -> pa.DataType:
        if self.type == "object":
            return pa.string()
        t = _DTYPES[self.dtype][1]
        for _ in range(self.ndim):
            t = pa.list_(t)
        return t

    def to_json(self, json_text: bool) -> dict[str, Any]:
        if self.type == "object":
            return {"type": "object", "json": json_text}
        return {"type": "tensor", "dtype": self.dtype, "ndim": self.ndim, "inner": list(self.inner),
                "nested": self.nested}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> tuple[FieldSpec, bool]:
        try:
            if d["type"] == "object":
                return cls("object"), bool(d["json"])
            inner = tuple(int(x) for x in d["inner"])
            return cls("tensor", d["dtype"], int(d["ndim"]), inner, bool(d["nested"])), False
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRecordError(f"{where}: bad field layout {dict(d)!r}: {exc}") from None


@dataclass
class FieldData:
    """The values of one field for a group of rows.

    Tensors: ``values`` is a numpy array; for ``ndim == 0`` it has one value per row, otherwise it
    is every row's value stacked along the first axis (shape ``[total, *inner]``) and ``offsets``
    (``n + 1`` int64) says where each row starts. bfloat16 values are given as float32. Objects:
    ``values`` is a list with one Python value per row.
    """

    values: Any
    offsets: np.ndarray | None = None


@dataclass
class RowGroup:
    """Rows of a partition that hold the same set of fields: their positions, and those fields."""

    rows: np.ndarray  # int64 positions into PartitionRows.keys
    fields: dict[str, FieldData]


@dataclass
class PartitionRows:
    """Everything one partition holds: keys in the data plane's order, their tags, field layouts (in
    the order the data plane registered the fields), and values by group."""

    partition_id: str
    keys: list[str]
    tags: list[dict[str, Any]]
    specs: dict[str, FieldSpec] = field(default_factory=dict)
    groups: list[RowGroup] = field(default_factory=list)
    position: int | None = None  # place among all the data plane's partitions, when a layout recorded it


def unify_specs(specs: list[FieldSpec], where: str) -> FieldSpec:
    """One layout for a field read in several gets: they must agree, except that a field TQ calls
    dense but whose rows differ in length somewhere is ragged everywhere."""
    distinct = set(specs)
    if len(distinct) == 1:
        return specs[0]
    if len({dataclasses.replace(s, nested=False) for s in distinct}) == 1:
        return dataclasses.replace(specs[0], nested=True)
    raise InvalidRecordError(f"{where}: layouts differ between rows: {sorted(map(str, distinct))}")


def concat_fields(parts: list[FieldData], spec: FieldSpec) -> FieldData:
    """One field's values of several row groups, one after the other (no copy for a single part)."""
    if len(parts) == 1:
        return parts[0]
    if spec.type == "object":
        return FieldData([v for p in parts for v in p.values])
    values = np.concatenate([p.values for p in parts], axis=0)
    if spec.ndim == 0:
        return FieldData(values)
    # Every part's offsets start at 0: shift each by the values of the parts before it, in one go.
    counts = np.fromiter((len(p.offsets) - 1 for p in parts), dtype=np.int64, count=len(parts))
    totals = np.fromiter((int(p.offsets[-1]) for p in parts), dtype=np.int64, count=len(parts))
    bases = np.repeat(np.concatenate([[0], np.cumsum(totals)[:-1]]), counts)
    tails = np.concatenate([p.offsets[1:] for p in parts]) + bases
    return FieldData(values, np.concatenate([np.zeros(1, dtype=np.int64), tails]))


def slice_field(fd: FieldData, spec: FieldSpec, start: int, stop: int) -> FieldData:
    """Rows ``[start, stop)`` of one field's values (views, not copies)."""
    if spec.type == "object":
        return FieldData(list(fd.values[start:stop]))
    if spec.ndim == 0:
        return FieldData(fd.values[start:stop])
    off = fd.offsets[start:stop + 1]
    return FieldData(fd.values[int(off[0]):int(off[-1])], off - off[0])


def check_json_value(value: Any, where: str) -> None:
    """Refuse what JSON would not give back unchanged (tuples, non-string keys, numpy scalars...)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or isinstance(v, (bool, str)):
            continue
        if type(v) is int or type(v) is float:
            continue
        if type(v) is list:
            stack.extend(v)
        elif type(v) is dict:
            for k, item in v.items():
                if type(k) is not str:
                    raise InvalidRecordError(f"{where}: dict key {k!r} is not a string (JSON would change it)")
                stack.append(item)
        else:
            raise InvalidRecordError(
                f"{where}: a {type(v).__name__} value cannot be kept exactly (expected JSON types: "
                "None, bool, int, float, str, list, dict with string keys)")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_JSON_ENCODE = msgspec.json.Encoder().encode
_JSON_DECODE = msgspec.json.Decoder().decode


def json_texts(values: Sequence[Any], where: str) -> list[bytes]:
    """Each value as compact JSON text (UTF-8), refusing any that JSON would not give back equal.

    The common case (plain dicts, lists, strings and numbers) is one msgspec encode per value and
    one decode of them all, compared with the originals; anything else (tuples, non-string keys,
    numpy scalars, NaN) takes :func:`check_json_value`, which names what is wrong.
    """
    try:
        texts = [_JSON_ENCODE(v) for v in values]
        if _JSON_DECODE(b"[" + b",".join(texts) + b"]") == list(values):
            return texts
    except (TypeError, ValueError, msgspec.MsgspecError):
        pass
    for i, v in enumerate(values):
        check_json_value(v, f"{where} (value {i})")
    return [_dumps(v).encode() for v in values]


# ------------------------------- numpy <-> Arrow, one field --------------------------------------


def _offsets_array(offsets: np.ndarray, where: str) -> pa.Array:
    if len(offsets) and int(offsets[-1]) > _MAX_LIST_VALUES:
        raise InvalidRecordError(f"{where}: {int(offsets[-1])} values exceed one list column's limit")
    return pa.array(np.asarray(offsets, dtype=np.int32))


def _tensor_column(fd: FieldData, spec: FieldSpec, n: int, where: str) -> pa.Array:
    values = np.asarray(fd.values)
    np_dtype, arrow_t = _DTYPES[spec.dtype]
    if values.dtype != np_dtype:
        values = values.astype(np_dtype)
    if spec.ndim == 0:
        if values.shape != (n,):
            raise InvalidRecordError(f"{where}: expected {n} scalar values, got shape {values.shape}")
        return pa.array(values, type=arrow_t)
    if fd.offsets is None or len(fd.offsets) != n + 1:
        raise InvalidRecordError(f"{where}: expected {n + 1} row offsets")
    if tuple(values.shape[1:]) != spec.inner:
        raise InvalidRecordError(f"{where}: values have shape {values.shape}, expected [total, *{spec.inner}]")
    arr = pa.array(np.ascontiguousarray(values).reshape(-1), type=arrow_t)
    count = values.shape[0]
    lists = [count]  # number of lists at each inner level, outermost first
    for d in spec.inner[:-1]:
        lists.append(lists[-1] * d)
    for d, how_many in zip(reversed(spec.inner), reversed(lists)):
        arr = pa.ListArray.from_arrays(_offsets_array(np.arange(how_many + 1, dtype=np.int64) * d, where), arr)
    return pa.ListArray.from_arrays(_offsets_array(fd.offsets, where), arr)


def _object_column(values: list[Any], as_json: bool, where: str) -> pa.Array:
    if as_json:
        return pa.array(json_texts(values, where), type=pa.string())
    return pa.array(values, type=pa.string())


def _offsets_of(arr: pa.Array) -> np.ndarray:
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _field_from_column(arr: pa.Array, spec: FieldSpec, as_json: bool, where: str) -> FieldData:
    """The inverse of the column builders, for rows that all hold the field (no nulls)."""
    if spec.type == "object":
        if not pa.types.is_string(arr.type) and not pa.types.is_large_string(arr.type):
            raise InvalidRecordError(f"{where}: object field stored as {arr.type}, expected string")
        texts = arr.to_pylist()
        if as_json:
            try:
                return FieldData([json.loads(t) for t in texts])
            except json.JSONDecodeError as exc:
                raise InvalidRecordError(f"{where}: not JSON text: {exc}") from None
        return FieldData(texts)
    if spec.ndim == 0:
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            raise InvalidRecordError(f"{where}: column of type {arr.type} for a scalar-per-row field")
        return FieldData(_to_numpy(arr, spec, where))
    offsets = None
    values = arr
    for level in range(spec.ndim):
        if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
                or pa.types.is_fixed_size_list(values.type)):
            raise InvalidRecordError(f"{where}: column of type {arr.type} has fewer than {spec.ndim} list levels")
        if level == 0:
            offsets = _offsets_of(values)
        else:
            lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
            if len(lengths) and not np.all(lengths == spec.inner[level - 1]):
                raise InvalidRecordError(
                    f"{where}: inner lists must all have {spec.inner[level - 1]} values (a tensor is rectangular)")
        values = values.flatten()
    flat = _to_numpy(values, spec, where)
    # The row count, not -1: an inner dimension of 0 leaves nothing to infer it from.
    total = int(offsets[-1]) if len(offsets) else 0
    return FieldData(flat.reshape(total, *spec.inner) if spec.ndim > 1 else flat, offsets)


def _to_numpy(arr: pa.Array, spec: FieldSpec, where: str) -> np.ndarray:
    if arr.null_count:
        raise InvalidRecordError(f"{where}: null inside a tensor value")
    try:
        out = arr.to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidRecordError(f"{where}: cannot read {arr.type} as {spec.dtype}: {exc}") from None
    want = spec.numpy_dtype
    if out.dtype != want:
        # The column was cast to the schema's canonical type (int64 ids -> int32): cast back, and
        # refuse anything that does not come back exactly.
        back = out.astype(want)
        if not np.array_equal(back.astype(out.dtype), out, equal_nan=out.dtype.kind == "f"):
            raise InvalidRecordError(f"{where}: values of type {out.dtype} do not fit {spec.dtype}")
        out = back
    return out


def _infer_spec(arr: pa.ChunkedArray | pa.Array, where: str) -> FieldSpec:
    """The layout of a column that carries none (a part written by something else)."""
    t = arr.type
    ndim = 0
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        ndim += 1
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if ndim:
            raise InvalidRecordError(f"{where}: lists of strings cannot be restored into a data plane")
        return FieldSpec("object")
    name = {v[1]: k for k, v in _DTYPES.items() if k != "bfloat16"}.get(t)
    if name is None:
        raise InvalidRecordError(f"{where}: column type {arr.type} has no data-plane layout")
    inner: list[int] = []
    if ndim > 1:
        values = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        values = values.drop_null().flatten()
        for _ in range(ndim - 1):
            lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
            d = int(lengths[0]) if len(lengths) else 0
            inner.append(d)
            values = values.flatten()
    return FieldSpec("tensor", name, ndim, tuple(inner), nested=ndim > 0)


# ------------------------------- partitions <-> one table per kind -------------------------------


def group_by_presence(presence: Mapping[str, np.ndarray], n: int) -> list[tuple[np.ndarray, list[str]]]:
    """Rows grouped by the set of fields they hold (``presence``: field -> bool per row), in row order
    of each group's first row. A data plane usually has one group per partition."""
    names = sorted(presence)
    if not names:
        return [(np.arange(n, dtype=np.int64), [])] if n else []
    if all(bool(np.all(presence[f])) for f in names):
        return [(np.arange(n, dtype=np.int64), names)]
    bits = np.stack([np.asarray(presence[f], dtype=bool) for f in names], axis=1)
    sigs, inverse = np.unique(bits, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    groups = []
    for g in range(len(sigs)):
        rows = np.flatnonzero(inverse == g).astype(np.int64)
        groups.append((rows, [f for f, on in zip(names, sigs[g]) if on]))
    groups.sort(key=lambda item: int(item[0][0]))
    return groups


def _spread(chunks: list[tuple[np.ndarray, pa.Array]], n: int, arrow_t: pa.DataType) -> pa.Array:
    """One column of ``n`` rows from per-group arrays (rows not covered are null)."""
    if len(chunks) == 1 and len(chunks[0][0]) == n and bool(np.all(chunks[0][0] == np.arange(n))):
        return chunks[0][1]
    covered = np.concatenate([rows for rows, _ in chunks]) if chunks else np.empty(0, dtype=np.int64)
    missing = np.setdiff1d(np.arange(n, dtype=np.int64), covered, assume_unique=True)
    arrays = [a for _, a in chunks] + ([pa.nulls(len(missing), arrow_t)] if len(missing) else [])
    order = np.concatenate([covered, missing])
    joined = pa.concat_arrays(arrays) if arrays else pa.nulls(0, arrow_t)
    return joined.take(pa.array(np.argsort(order, kind="stable")))


@dataclass(frozen=True)
class PartitionSource:
    """One partition of a row table that is built window by window, so that building it never holds
    more than one window's copy of its values.

    What the table's schema and layout need is known up front: ``specs`` (every field's layout over
    the whole partition, in the data plane's order), ``as_json`` (object fields kept as JSON text),
    ``tag_names`` (every tag name of its rows) and ``rows``. ``windows()`` gives the rows as
    consecutive :class:`PartitionRows` of its keys, in order, whose values follow ``specs``.
    ``training_misfit`` says why its rows cannot be training rows (``None``: they can), which decides
    its row kind (:func:`coordinator.row_kinds.assign_kind`) before any window is built; ``columns``
    are the fields a ``dataplane_rows`` table stores under another name (set when the table is built).
    """

    partition_id: str
    position: int
    rows: int
    specs: Mapping[str, FieldSpec]
    as_json: Mapping[str, bool]
    tag_names: frozenset[str]
    windows: Callable[[], Iterable[PartitionRows]]
    training_misfit: str | None
    columns: Mapping[str, str] = field(default_factory=dict)

    def column(self, name: str) -> str:
        """The column that holds field ``name``."""
        return self.columns.get(name, name)


def needs_json(values: Iterable[Any]) -> bool:
    """Whether an object field's values are kept as JSON text: unless every one is a ``str``."""
    return not all(type(v) is str for v in values)


def tag_names(tags: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """Every name any of ``tags`` holds (a row-schema column of that name is filled from them)."""
    return frozenset().union(*tags) if tags else frozenset()


def whole_source(part: PartitionRows, position: int) -> PartitionSource:
    """A partition held whole as one window."""
    as_json = {name: needs_json(v for g in part.groups if name in g.fields for v in g.fields[name].values)
               for name, spec in part.specs.items() if spec.type == "object"}
    full = fields_every_row_holds(((g.fields, len(g.rows)) for g in part.groups), len(part.keys))
    return PartitionSource(part.partition_id, int(position), len(part.keys), part.specs, as_json,
                           tag_names(part.tags), lambda: (part,), training_misfit(part.specs, full, part.tags))


def with_columns(kind: str, sources: Sequence[PartitionSource]) -> list[PartitionSource]:
    """``sources`` as a table of ``kind`` stores them: in ``dataplane_rows``, with the columns of the
    fields that cannot keep their own name (:func:`coordinator.row_kinds.assign_columns`)."""
    if kind != DATAPLANE:
        return list(sources)
    moved = assign_columns([(s.partition_id, s.specs) for s in sources])
    return [dataclasses.replace(s, columns=m) for s, m in zip(sources, moved)]


def table_schema(kind: str, sources: Sequence[PartitionSource]) -> pa.Schema:
    """The schema of a row table of ``kind`` holding ``sources``, with the layout in its metadata.

    Columns: ``key``, ``partition_id``, the row schema's other columns, every other field (sorted),
    ``row_tags`` (which carries the layout). A column's type is the field's own where a partition has
    it as a field, else the row schema's; partitions that disagree are refused, naming both.
    """
    schema = ROW_SCHEMAS[kind]
    types: dict[str, tuple[pa.DataType, str]] = {}
    layout_parts = []
    for src in sources:
        where = f"partition {src.partition_id!r}"
        clash = RESERVED_COLUMNS & {src.column(name) for name in src.specs}
        if clash:
            raise InvalidRecordError(f"{where}: field name {sorted(clash)[0]!r} is reserved for the row table")
        for name, spec in src.specs.items():
            arrow_t = spec.arrow_type()
            prev = types.setdefault(src.column(name), (arrow_t, src.partition_id))
            if prev[0] != arrow_t:
                raise InvalidRecordError(
                    f"{where}: field {name!r} is {arrow_t} here but {prev[0]} in partition {prev[1]!r}; "
                    "one column of a row table cannot hold both")
        layout_parts.append({"id": src.partition_id, "position": src.position, "fields": {
            name: _field_layout(src, name, spec) for name, spec in src.specs.items()}})
    for f in schema:
        if f.name in RESERVED_COLUMNS or f.name not in types:
            continue
        arrow_t, pid = types[f.name]
        by_tag = next((s.partition_id for s in sources if f.name not in s.specs and f.name in s.tag_names), None)
        if by_tag is not None and arrow_t != f.type:
            raise InvalidRecordError(
                f"partition {pid!r}: field {f.name!r} is {arrow_t}, but partition {by_tag!r} fills that column "
                f"from its tag as {f.type}; one column of a row table cannot hold both")
    # Not sorted: partitions and fields keep the data plane's order, which a restore reproduces.
    layout = json.dumps({"version": LAYOUT_VERSION, "kind": kind, "partitions": layout_parts})
    names = [KEY_COLUMN, PARTITION_COLUMN] + [f.name for f in schema if f.name not in RESERVED_COLUMNS]
    names += sorted(n for n in types if n not in names)
    fields = [pa.field(n, pa.string() if n in RESERVED_COLUMNS else types[n][0] if n in types
                       else schema.field(n).type) for n in names]
    tags = pa.field(TAGS_COLUMN, pa.string(), metadata={LAYOUT_KEY: layout.encode()})
    # Where the row schema places row_tags (dataplane_rows: third), else last (an extra column).
    at = schema.get_field_index(TAGS_COLUMN)
    fields.insert(at if at >= 0 else len(fields), tags)
    return pa.schema(fields, metadata=schema.metadata)


def _field_layout(src: PartitionSource, name: str, spec: FieldSpec) -> dict[str, Any]:
    """A field's layout entry: its spec, and its column when that is not its name."""
    entry = spec.to_json(src.as_json.get(name, False))
    if src.column(name) != name:
        entry[COLUMN_KEY] = src.column(name)
    return entry


def window_table(src: PartitionSource, window: PartitionRows, schema: pa.Schema) -> pa.Table:
    """One window of ``src``'s rows as a table of ``schema`` (:func:`table_schema`): a column the
    window has no value for is null."""
    where = f"partition {src.partition_id!r}"
    n = len(window.keys)
    if len(window.tags) != n:
        raise InvalidRecordError(f"{where}: {len(window.tags)} tags for {n} keys")
    chunks: dict[str, list[tuple[np.ndarray, pa.Array]]] = {name: [] for name in src.specs}
    for group in window.groups:
        for name, fd in group.fields.items():
            spec = src.specs.get(name)
            if spec is None:
                raise InvalidRecordError(f"{where}: field {name!r} has values but no layout")
            fwhere = f"{where} field {name!r}"
            if spec.type == "object":
                if len(fd.values) != len(group.rows):
                    raise InvalidRecordError(f"{fwhere}: {len(fd.values)} values for {len(group.rows)} rows")
                column = _object_column(list(fd.values), src.as_json.get(name, False), fwhere)
            else:
                column = _tensor_column(fd, spec, len(group.rows), fwhere)
            chunks[name].append((group.rows, column))
    arrays = []
    field_of = {src.column(name): name for name in src.specs}
    for f in schema:
        if f.name == KEY_COLUMN:
            arrays.append(pa.array(window.keys, type=pa.string()))
        elif f.name == PARTITION_COLUMN:
            arrays.append(pa.array([src.partition_id] * n, type=pa.string()))
        elif f.name == TAGS_COLUMN:
            arrays.append(pa.array(json_texts(window.tags, f"{where} tags"), type=pa.string()))
        elif f.name in field_of:
            arrays.append(_spread(chunks[field_of[f.name]], n, f.type))
        elif f.name in src.tag_names:  # a row-schema column that is not a field: the tag of that name
            try:
                arrays.append(pa.array([t.get(f.name) for t in window.tags], type=f.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
                raise InvalidRecordError(
                    f"{where}: tag {f.name!r} cannot fill column of type {f.type}: {exc}") from None
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def build_table(kind: str, partitions: Sequence[PartitionRows], positions: Sequence[int] | None = None) -> pa.Table:
    """One table of ``kind`` holding every row of ``partitions``, with the layout in its metadata.

    ``positions`` are the partitions' places among all of the data plane's partitions (every kind),
    so that a restore recreates them in the same order.
    """
    if positions is None:
        positions = range(len(partitions))
    return sources_table(kind, [whole_source(p, pos) for p, pos in zip(partitions, positions)])


def sources_table(kind: str, sources: Sequence[PartitionSource]) -> pa.Table:
    """One table of ``kind`` holding every row of ``sources``, built whole."""
    sources = with_columns(kind, sources)
    schema = table_schema(kind, sources)
    tables = [window_table(s, w, schema) for s in sources for w in s.windows()]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def layout_of(schema: pa.Schema) -> dict[str, Any] | None:
    """The data-plane layout recorded in a row table's schema, or ``None`` when it has none."""
    i = schema.get_field_index(TAGS_COLUMN)
    if i < 0:
        return None
    raw = (schema.field(i).metadata or {}).get(LAYOUT_KEY)
    return json.loads(raw) if raw is not None else None


def _tags_of(texts: list[str | None], where: str) -> list[Any]:
    """The ``row_tags`` texts as values (a null is an empty tag): msgspec first, which is ten times
    faster; Python's ``json`` for what msgspec refuses (NaN, very deep nesting), naming the row."""
    try:
        return [_JSON_DECODE(t) if t is not None else {} for t in texts]
    except (msgspec.MsgspecError, RecursionError):
        pass
    out = []
    for i, t in enumerate(texts):
        try:
            out.append(json.loads(t) if t is not None else {})
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRecordError(f"{where}: row_tags of row {i} is not JSON: {exc}") from None
    return out


def _one_array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """``col`` as one array: its only chunk as it is (``combine_chunks`` would copy even that one)."""
    if not isinstance(col, pa.ChunkedArray):
        return col
    if col.num_chunks == 1:
        return col.chunk(0)
    return col.combine_chunks()


def parse_table(table: pa.Table, where: str) -> list[PartitionRows]:
    """The partitions a row table holds, in the neutral form (inverse of :func:`build_table`)."""
    try:
        layout = layout_of(table.schema)
    except json.JSONDecodeError as exc:
        raise InvalidRecordError(f"{where}: bad dataplane.layout metadata: {exc}") from None
    for col in (KEY_COLUMN, PARTITION_COLUMN):
        if col not in table.column_names:
            raise InvalidRecordError(f"{where}: has no {col!r} column, so its rows cannot go back into a data plane")
    keys = table.column(KEY_COLUMN).to_pylist()
    pids = table.column(PARTITION_COLUMN).to_pylist()
    if any(k is None for k in keys) or any(p is None for p in pids):
        raise InvalidRecordError(f"{where}: null key or partition_id")
    if TAGS_COLUMN in table.column_names:
        tags = _tags_of(table.column(TAGS_COLUMN).to_pylist(), where)
    else:
        tags = [{} for _ in keys]
    order: list[str] = []
    rows_of: dict[str, list[int]] = {}
    for i, p in enumerate(pids):
        if p not in rows_of:
            rows_of[p] = []
            order.append(p)
        rows_of[p].append(i)
    specs_of: dict[str, dict[str, tuple[FieldSpec, bool]]] = {}
    columns_of: dict[str, dict[str, str]] = {}  # partition -> field -> its column, where not its name
    positions: dict[str, int] = {}
    if layout is not None:
        if layout.get("version") != LAYOUT_VERSION:
            raise InvalidRecordError(f"{where}: dataplane.layout version {layout.get('version')!r} is not supported")
        listed = []
        for entry in layout["partitions"]:
            pid = entry["id"]
            listed.append(pid)
            if entry.get("position") is not None:
                positions[pid] = int(entry["position"])
            specs_of[pid] = {name: FieldSpec.from_json(d, f"{where} partition {pid!r} field {name!r}")
                             for name, d in entry["fields"].items()}
            columns_of[pid] = {name: str(d[COLUMN_KEY]) for name, d in entry["fields"].items()
                               if isinstance(d, Mapping) and COLUMN_KEY in d}
            reserved = sorted(RESERVED_COLUMNS & set(columns_of[pid].values()))
            if reserved:
                raise InvalidRecordError(
                    f"{where}: partition {pid!r}: a field cannot be stored in column {reserved[0]!r}")
        extra = [p for p in order if p not in specs_of]
        if extra:
            raise InvalidRecordError(f"{where}: rows of partition {extra[0]!r}, which the layout does not list")
        order = listed
    else:  # a part written by something else: every other column is a field
        fields = [c for c in table.column_names if c not in RESERVED_COLUMNS]
        inferred = {c: (_infer_spec(table.column(c), f"{where} column {c!r}"), False) for c in fields}
        specs_of = {p: inferred for p in order}
    seen_keys: set[tuple[str, str]] = set()
    out = []
    for pid in order:
        idx = np.asarray(rows_of.get(pid, []), dtype=np.int64)
        pkeys = [keys[i] for i in idx]
        for k in pkeys:
            if (pid, k) in seen_keys:
                raise InvalidRecordError(f"{where}: key {k!r} appears twice in partition {pid!r}")
            seen_keys.add((pid, k))
        specs = specs_of[pid]
        part = PartitionRows(pid, pkeys, [tags[i] for i in idx], {n: s for n, (s, _) in specs.items()},
                             position=positions.get(pid))
        if len(idx):
            contiguous = bool(idx[-1] - idx[0] + 1 == len(idx))
            taken = {}
            presence = {}
            for name in specs:
                column = columns_of.get(pid, {}).get(name, name)
                if column not in table.column_names:
                    raise InvalidRecordError(
                        f"{where}: layout names field {name!r} of partition {pid!r} in column {column!r}, "
                        "but the table has no such column")
                col = table.column(column)
                # A partition written by build_table is one run of rows: a slice shares the buffers,
                # where take would copy every value (most of a large restore's time).
                col = col.slice(int(idx[0]), len(idx)) if contiguous else col.take(pa.array(idx))
                col = _one_array(col)
                taken[name] = col
                presence[name] = col.is_valid().to_numpy(zero_copy_only=False)
            for rows, names in group_by_presence(presence, len(idx)):
                whole = len(rows) == len(idx)  # one group holds every row: no selection to copy
                sel = None if whole else pa.array(rows)
                part.groups.append(RowGroup(rows, {
                    name: _field_from_column(taken[name] if whole else taken[name].take(sel), specs[name][0],
                                             specs[name][1], f"{where} partition {pid!r} field {name!r}")
                    for name in names}))
        out.append(part)
    return out


# ------------------------------------- the cut and writing ---------------------------------------


@dataclass(frozen=True)
class DataPlaneCut:
    """A consistent, immutable copy of every row of a data plane, taken under its barrier.

    ``tables`` maps each row kind the data plane keeps to one Arrow table (Arrow data never
    changes; the copy owns its buffers). ``partitions`` lists every partition in the data plane's
    order, empty ones included (their ids are also in each table's layout metadata).
    """

    tables: Mapping[str, pa.Table]
    partitions: tuple[str, ...]
    taken_at: float
    seconds: float

    @property
    def rows(self) -> dict[str, int]:
        return {kind: t.num_rows for kind, t in self.tables.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())


class DeferredCut(ABC):
    """What the pause keeps of a data plane: enough to produce the cut later, unchanged.

    ``held_bytes`` is what it holds in memory between the pause and :meth:`materialize` (the bound
    that decides whether the bytes may be written after Gym resumes); ``seconds`` its time in the pause.
    """

    held_bytes: int
    seconds: float

    @abstractmethod
    def materialize(self) -> DataPlaneCut:
        """The cut as of the pause (raises :class:`DataPlaneChangedError` if that is no longer possible)."""

    def write(self, part, compression: str = "none") -> WrittenRows:
        """Write the cut's rows into ``part`` (a :class:`snapformat.PartWriter`), one file per kind.

        This default materializes the whole cut, then writes it; a data plane that can build its
        rows a window at a time overrides it, so that writing holds one window's copy, not the cut's.
        """
        cut = self.materialize()
        entries = write_cut(cut, part, compression)
        return WrittenRows(MappingProxyType(dict(cut.rows)), cut.nbytes, tuple(entries))


class ReadyCut(DeferredCut):
    """A cut already copied out in the pause (the default for any data plane)."""

    def __init__(self, cut: DataPlaneCut) -> None:
        self.cut = cut
        self.held_bytes = cut.nbytes
        self.seconds = cut.seconds

    def materialize(self) -> DataPlaneCut:
        return self.cut


def _check_required(kind: str, table: pa.Table, first_row: int = 0) -> None:
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


def write_cut(cut: DataPlaneCut, part, compression: str = "none", batch_rows: int = 65536) -> list[FileEntry]:
    """Stream every table of ``cut`` into ``part`` (a :class:`snapformat.PartWriter`), one file per kind.

    Runs outside the barrier. Each file is checked by snapformat's row rules as it is written;
    a row missing a required column is refused here, naming its partition and key.
    """
    entries = []
    for kind, table in cut.tables.items():
        _check_required(kind, table)
        if table.num_rows:
            batches: Iterable[pa.RecordBatch] = table.to_batches(max_chunksize=batch_rows)
        else:  # keep the layout (partitions, even empty ones) in the file's schema
            batches = [pa.RecordBatch.from_pylist([], schema=table.schema)]
        entries.append(part.write_rows(FILE_NAMES[kind], kind, batches, compression=compression))
    return entries


@dataclass(frozen=True)
class WrittenRows:
    """What writing a cut's rows wrote: rows per kind, their size in memory (Arrow), the files."""

    rows: Mapping[str, int]
    nbytes: int
    entries: tuple[FileEntry, ...]


def write_sources(sources: Mapping[str, Sequence[PartitionSource]], part, compression: str = "none",
                  batch_rows: int = 65536) -> WrittenRows:
    """Stream the partitions of each kind into ``part`` (a :class:`snapformat.PartWriter`), one file
    per kind, building one window of rows at a time: the file's schema (layout included) is fixed
    from the sources first, then each window is built, checked (a row missing a required column is
    refused, naming its row in the file, partition and key) and written before the next is built.
    A file holds the same table as :func:`write_cut` writes for the same rows."""
    rows: dict[str, int] = {}
    entries = []
    tally = _Tally()
    for kind, srcs in sources.items():
        tally.rows = 0
        srcs = with_columns(kind, srcs)
        batches = _window_batches(kind, srcs, table_schema(kind, srcs), batch_rows, tally)
        entries.append(part.write_rows(FILE_NAMES[kind], kind, batches, compression=compression))
        rows[kind] = tally.rows
    return WrittenRows(MappingProxyType(rows), tally.nbytes, tuple(entries))


@dataclass
class _Tally:
    rows: int = 0  # of the kind being written
    nbytes: int = 0  # of every kind


def _window_batches(kind: str, sources: Sequence[PartitionSource], schema: pa.Schema, batch_rows: int,
                    tally: _Tally) -> Iterator[pa.RecordBatch]:
    for src in sources:
        seen = 0
        for window in src.windows():
            table = window_table(src, window, schema)
            _check_required(kind, table, tally.rows)
            seen += table.num_rows
            tally.rows += table.num_rows
            tally.nbytes += table.nbytes
            yield from table.to_batches(max_chunksize=batch_rows)
            del window, table  # before the next window is built: one window's copy at a time
        if seen != src.rows:
            raise DataPlaneError(f"partition {src.partition_id!r}: its windows gave {seen} rows, expected {src.rows}")
    if not tally.rows:  # keep the layout (partitions, even empty ones) in the file's schema
        yield pa.RecordBatch.from_pylist([], schema=schema)


@dataclass(frozen=True)
class LoadReport:
    """What :meth:`DataPlane.load` put back."""

    partitions: tuple[str, ...]
    rows: Mapping[str, int]
    files: tuple[str, ...]
    seconds: float


# ---------------------------------------- the interface -----------------------------------------


class DataPlane(ABC):
    """A store of rows the coordinator snapshots and restores (see the module docstring).

    ``token_capture_partitions`` says which partitions hold token-capture rows (a set of ids or a
    predicate); their rows go to ``token_capture_rows``. Every other partition's go to
    ``training_rows`` when they fit it, else to ``dataplane_rows`` (:mod:`coordinator.row_kinds`).
    Implementations provide :meth:`cut`, :meth:`clear`, :meth:`is_empty` and
    :meth:`restore_partitions`; writing and loading are shared.
    """

    def __init__(self, token_capture_partitions: Iterable[str] | Callable[[str], bool] | None = None) -> None:
        if token_capture_partitions is None:
            self._is_token: Callable[[str], bool] | None = None
        elif callable(token_capture_partitions):
            self._is_token = token_capture_partitions
        else:
            ids = frozenset(token_capture_partitions)
            self._is_token = ids.__contains__

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
        """The row kind ``source``'s partition is written as (:func:`coordinator.row_kinds.assign_kind`)."""
        kind = assign_kind(self.is_token(source.partition_id), source.training_misfit)
        if kind == DATAPLANE:
            log.debug("partition %r is kept as %s: %s", source.partition_id, DATAPLANE, source.training_misfit)
        return kind

    def sources_by_kind(self, sources: Iterable[PartitionSource]) -> dict[str, list[PartitionSource]]:
        """``sources`` grouped by the row kind each is written as: every kind of :attr:`kinds` (even
        with none), then ``dataplane_rows`` if any partition is of that kind."""
        by_kind: dict[str, list[PartitionSource]] = {kind: [] for kind in self.kinds}
        for src in sources:
            by_kind.setdefault(self.kind_for(src), []).append(src)
        return by_kind

    @abstractmethod
    def put(self, partition_id: str, keys: Sequence[str], fields: Mapping[str, Any] | None = None,
            tags: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Create missing keys (in order) and set their fields and tags, as TransferQueue's
        ``kv_batch_put`` does: a numpy array ``[n, ...]`` is a dense field, :class:`Ragged` a ragged
        one, :class:`Objects` a non-tensor one."""

    @abstractmethod
    def cut(self) -> DataPlaneCut:
        """Copy every row out, consistently. Call it while producers are held at the barrier."""

    def deferred_cut(self) -> DeferredCut:
        """The pause's share of a cut (call it at the barrier). By default the whole copy, taken now;
        a data plane whose rows are write-once may keep only their listing and read values later."""
        return ReadyCut(self.cut())

    @abstractmethod
    def clear(self) -> None:
        """Remove every partition (and so every row)."""

    @abstractmethod
    def is_empty(self) -> bool:
        """True when the data plane holds no partition at all."""

    @abstractmethod
    def restore_partitions(self, partitions: Sequence[PartitionRows]) -> None:
        """Put ``partitions`` back (the data plane is empty): same keys in the same order, tags, values."""

    def write_cut(self, cut: DataPlaneCut, part, compression: str = "none") -> list[FileEntry]:
        return write_cut(cut, part, compression)

    def _make_cut(self, partitions: Sequence[PartitionRows], started: float, taken_at: float) -> DataPlaneCut:
        by_kind = self.sources_by_kind(whole_source(p, i) for i, p in enumerate(partitions))
        tables = {kind: sources_table(kind, sources) for kind, sources in by_kind.items()}
        return DataPlaneCut(MappingProxyType(tables), tuple(p.partition_id for p in partitions), taken_at,
                            time.perf_counter() - started)

    def load(self, snapshot, prefix: str, verify: bool = True) -> LoadReport:
        """Restore the rows a cut wrote under ``prefix`` of ``snapshot`` (a :class:`snapformat.Snapshot`).

        The data plane must be empty (call :meth:`clear` first): what it holds afterwards is exactly
        what the cut held. Every file is read and checked before anything is put; if putting fails
        part-way, what was put is cleared again and the error is raised.
        """
        started = time.perf_counter()
        if not self.is_empty():
            raise DataPlaneNotEmptyError("load needs an empty data plane (call clear() first)")
        prefix = prefix.rstrip("/")
        entries = [e for e in snapshot.files() if e.kind in FILE_NAMES and e.path.startswith(prefix + "/")]
        if not entries:
            raise NotPublishedError(f"{snapshot.url}: no row part under {prefix!r}")
        partitions: list[PartitionRows] = []
        rows: dict[str, int] = {}
        seen: set[str] = set()
        for entry in entries:
            where = snapshot.where(entry)
            table = snapshot.open_rows(entry, verify=verify).read_all()
            for p in parse_table(table, where):
                if p.partition_id in seen:
                    raise InvalidRecordError(f"{where}: partition {p.partition_id!r} is also in another row file")
                if self.is_token(p.partition_id) != (entry.kind == TOKEN_CAPTURE):
                    kept = TOKEN_CAPTURE if self.is_token(p.partition_id) else f"{TRAINING} or {DATAPLANE}"
                    raise InvalidRecordError(
                        f"{where}: partition {p.partition_id!r} was saved as {entry.kind}, but this data plane "
                        f"keeps it as {kept}")
                seen.add(p.partition_id)
                partitions.append(p)
            rows[entry.kind] = rows.get(entry.kind, 0) + table.num_rows
        # The data plane's own partition order (across kinds) where the layouts recorded it.
        if all(p.position is not None for p in partitions):
            partitions.sort(key=lambda p: p.position)
        try:
            self.restore_partitions(partitions)
        except BaseException:
            try:
                self.clear()
            except Exception:  # pragma: no cover - the first error is the one to report
                pass
            raise
        return LoadReport(tuple(p.partition_id for p in partitions), MappingProxyType(rows),
                          tuple(e.path for e in entries), time.perf_counter() - started)


# ---------------------------------- the in-memory reference -------------------------------------


@dataclass(frozen=True)
class Ragged:
    """A ragged field for :meth:`InMemoryDataPlane.put`: one array per row (first dimension may vary)."""

    rows: Sequence[np.ndarray]


@dataclass(frozen=True)
class Objects:
    """A non-tensor field for :meth:`InMemoryDataPlane.put`: one Python value per row."""

    values: Sequence[Any]


class InMemoryDataPlane(DataPlane):
    """A data plane held in this process, with TransferQueue's KV semantics.

    ``put(partition_id, keys, fields, tags)`` creates missing keys (in order), merges tags into the
    existing ones and sets fields: a numpy array ``[n, ...]`` is a dense field, :class:`Ragged` a
    ragged one, :class:`Objects` a non-tensor one. A field keeps the layout of its first put in a
    partition. Values are copied in and out, so no caller can change what it holds. Thread-safe.
    """

    def __init__(self, token_capture_partitions: Iterable[str] | Callable[[str], bool] | None = None) -> None:
        super().__init__(token_capture_partitions)
        self._lock = threading.Lock()
        # partition -> key -> [tag, {field: value}] (insertion order is key order); specs per partition
        self._rows: dict[str, dict[str, list[Any]]] = {}
        self._specs: dict[str, dict[str, FieldSpec]] = {}

    # -- the KV side (what producers and consumers do) --

    def put(self, partition_id: str, keys: Sequence[str], fields: Mapping[str, Any] | None = None,
            tags: Sequence[Mapping[str, Any]] | None = None) -> None:
        n = len(keys)
        if not n or not all(isinstance(k, str) for k in keys) or len(set(keys)) != n:
            raise InvalidRecordError("keys must be distinct strings, at least one")
        if tags is not None and len(tags) != n:
            raise InvalidRecordError(f"{len(tags)} tags for {n} keys")
        for i, tag in enumerate(tags or ()):
            check_json_value(dict(tag), f"partition {partition_id!r} key {keys[i]!r} tag")
        converted: dict[str, tuple[FieldSpec, list[Any]]] = {}
        for name, value in (fields or {}).items():
            converted[name] = rows_of(name, value, n)
        with self._lock:
            part = self._rows.setdefault(partition_id, {})
            specs = self._specs.setdefault(partition_id, {})
            for name, (spec, _) in converted.items():
                if name in specs and specs[name] != spec:
                    raise InvalidRecordError(
                        f"partition {partition_id!r} field {name!r}: layout {spec} differs from {specs[name]}")
            for name, (spec, _) in converted.items():
                specs[name] = spec
            for i, key in enumerate(keys):
                row = part.setdefault(key, [{}, {}])
                if tags is not None:
                    row[0].update(json.loads(_dumps(dict(tags[i]))))
                for name, (_, values) in converted.items():
                    row[1][name] = values[i]

    def delete(self, partition_id: str, keys: Sequence[str]) -> None:
        """Remove keys (the partition stays, possibly empty), like TransferQueue's ``kv_clear``."""
        with self._lock:
            part = self._rows.get(partition_id, {})
            for key in keys:
                part.pop(key, None)

    def list(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{partition: {key: tag}}``, like TransferQueue's ``kv_list``."""
        with self._lock:
            return {p: {k: json.loads(_dumps(r[0])) for k, r in rows.items()} for p, rows in self._rows.items()}

    def get(self, partition_id: str, key: str) -> dict[str, Any]:
        """The fields of one row (copies): numpy arrays for tensors, Python values for objects."""
        with self._lock:
            row = self._rows[partition_id][key]
            return {n: (v.copy() if isinstance(v, np.ndarray) else json.loads(_dumps(v))) for n, v in row[1].items()}

    def specs(self, partition_id: str) -> dict[str, FieldSpec]:
        with self._lock:
            return dict(self._specs[partition_id])

    # -- the DataPlane side --

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._specs.clear()

    def is_empty(self) -> bool:
        with self._lock:
            return not self._rows

    def cut(self) -> DataPlaneCut:
        started = time.perf_counter()
        with self._lock:  # the barrier of this data plane
            taken_at = time.time()
            parts = []
            for pid, rows in self._rows.items():
                keys = list(rows)
                specs = self._specs.get(pid, {})
                used = {name for r in rows.values() for name in r[1]}
                specs = {n: s for n, s in specs.items() if n in used}
                presence = {name: np.fromiter((name in rows[k][1] for k in keys), dtype=bool, count=len(keys))
                            for name in specs}
                part = PartitionRows(pid, keys, [json.loads(_dumps(rows[k][0])) for k in keys], specs)
                for idx, names in group_by_presence(presence, len(keys)):
                    part.groups.append(RowGroup(idx, {
                        name: field_data(specs[name], [rows[keys[i]][1][name] for i in idx]) for name in names}))
                parts.append(part)
            # Building Arrow copies every value: the cut shares no buffer with the live rows.
            return self._make_cut(parts, started, taken_at)

    def restore_partitions(self, partitions: Sequence[PartitionRows]) -> None:
        with self._lock:
            for p in partitions:
                rows = self._rows.setdefault(p.partition_id, {})
                self._specs[p.partition_id] = dict(p.specs)
                for key, tag in zip(p.keys, p.tags):
                    rows[key] = [dict(tag), {}]
                for name in p.specs:  # in the saved field order
                    for group in p.groups:
                        if name in group.fields:
                            values = _split(p.specs[name], group.fields[name])
                            for key, value in zip((p.keys[i] for i in group.rows), values):
                                rows[key][1][name] = value


def rows_of(name: str, value: Any, n: int) -> tuple[FieldSpec, list[Any]]:
    """A put's field as (layout, one value per row), copied."""
    where = f"field {name!r}"
    if isinstance(value, Objects):
        vals = list(value.values)
        if len(vals) != n:
            raise InvalidRecordError(f"{where}: {len(vals)} values for {n} keys")
        for v in vals:
            check_json_value(v, where)
        return FieldSpec("object"), [json.loads(_dumps(v)) for v in vals]
    if isinstance(value, Ragged):
        rows = [np.array(r, copy=True) for r in value.rows]
        if len(rows) != n:
            raise InvalidRecordError(f"{where}: {len(rows)} rows for {n} keys")
        first = rows[0]
        for r in rows:
            if r.ndim == 0 or r.dtype != first.dtype or r.shape[1:] != first.shape[1:]:
                raise InvalidRecordError(f"{where}: ragged rows must share dtype and all but their first dimension")
        return FieldSpec("tensor", _dtype_name(first.dtype, where), first.ndim, tuple(first.shape[1:]), True), rows
    arr = np.array(value, copy=True)
    if arr.ndim == 0 or arr.shape[0] != n:
        raise InvalidRecordError(f"{where}: expected an array with {n} rows, got shape {arr.shape}")
    spec = FieldSpec("tensor", _dtype_name(arr.dtype, where), arr.ndim - 1, tuple(arr.shape[2:]), False)
    return spec, [np.array(arr[i], copy=True) for i in range(n)]


def _dtype_name(dtype: np.dtype, where: str) -> str:
    name = np.dtype(dtype).name
    if name not in _DTYPES or name == "bfloat16":
        raise InvalidRecordError(f"{where}: dtype {name} is not supported")
    return name


def field_data(spec: FieldSpec, values: list[Any]) -> FieldData:
    """Per-row values (as :func:`rows_of` gives them) in the neutral stacked form."""
    if spec.type == "object":
        return FieldData([json.loads(_dumps(v)) for v in values])
    if spec.ndim == 0:
        return FieldData(np.array(values, dtype=spec.numpy_dtype))
    lengths = np.fromiter((v.shape[0] for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values, axis=0) if values else np.empty((0, *spec.inner), spec.numpy_dtype)
    return FieldData(flat, offsets)


def _split(spec: FieldSpec, fd: FieldData) -> list[Any]:
    if spec.type == "object":
        return list(fd.values)
    values = np.asarray(fd.values, dtype=spec.numpy_dtype)
    if spec.ndim == 0:
        return [np.array(values[i], copy=True) for i in range(len(values))]
    off = fd.offsets
    return [values[off[i]:off[i + 1]].copy() for i in range(len(off) - 1)]


__all__ = [
    "DATAPLANE", "DataPlane", "DataPlaneChangedError", "DataPlaneCut", "DataPlaneError", "DataPlaneNotEmptyError",
    "DeferredCut", "ReadyCut", "sources_table", "with_columns",
    "FieldData", "FieldSpec", "FILE_NAMES", "InMemoryDataPlane", "LoadReport", "Objects", "PartitionRows",
    "Ragged", "RowGroup", "TOKEN_CAPTURE", "TRAINING", "build_table", "check_json_value", "group_by_presence",
    "concat_fields", "field_data", "layout_of", "slice_field", "unify_specs", "parse_table", "rows_of", "write_cut",
    "PartitionSource", "WrittenRows", "needs_json", "table_schema", "tag_names", "whole_source", "window_table",
    "write_sources",
]

