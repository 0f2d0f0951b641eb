"""The field model: how a data plane's rows look on their way to and from a snapshot.

A data plane holds rows in *partitions*; a row is a *key*, a *tag* (a small JSON dict) and
*fields*: tensors (dense or ragged, per-row scalars or per-row ``[n, ...]`` values) or plain Python
objects. Both directions (a cut building Arrow tables, a restore putting rows back) go through one
neutral form, numpy values plus row offsets, so neither side knows the other's types:

- :class:`FieldSpec`: one field's layout in one partition (tensor dtype and shape, dense or
  ragged; or object);
- :class:`FieldData`: one field's values for a group of rows, stacked, with each row's offset;
- :class:`RowGroup` / :class:`PartitionRows`: rows that hold the same fields, and a partition.

What producers put (:class:`Ragged`, :class:`Objects`, dense numpy arrays) becomes this form with
:func:`rows_of` and :func:`field_data`; :func:`split_rows` turns it back into one value per row.
dtypes are named as torch names them; bfloat16, which numpy lacks, travels as its exact float32.

This module needs numpy and pyarrow only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from coordinator.dataplane.jsonvalues import check_json_value, json_copy
from schemas.errors import InvalidRecordError

# dtype name (torch's spelling, without "torch.") -> (numpy dtype of the values, Arrow type of the column).
# bfloat16 travels as float32 (every bfloat16 is exactly a float32): numeric, so a trainer reading the
# column sees real values, and the layout says to narrow it back on restore.
DTYPES: dict[str, tuple[np.dtype, pa.DataType]] = {
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
            if self.dtype not in DTYPES:
                raise InvalidRecordError(f"dtype {self.dtype!r} is not supported (expected one of {sorted(DTYPES)})")
            if self.ndim < 0 or (self.ndim <= 1 and self.inner) or (self.ndim > 1 and len(self.inner) != self.ndim - 1):
                raise InvalidRecordError(f"ndim {self.ndim} does not match inner dimensions {self.inner}")
            if self.nested and self.ndim == 0:
                raise InvalidRecordError("a scalar-per-row field cannot be nested")
        elif self.type != "object":
            raise InvalidRecordError(f"field type {self.type!r} is not 'tensor' or 'object'")

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype][0]

    def arrow_type(self) -> pa.DataType:
        if self.type == "object":
            return pa.string()
        t = DTYPES[self.dtype][1]
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


# ------------------------------------------------------------------ the neutral form, by group


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


def slice_partition(part: PartitionRows, start: int, stop: int) -> PartitionRows:
    """Rows ``[start, stop)`` of a partition (values are views): the fields those rows hold, with
    the partition's layouts, in its order."""
    groups = []
    for g in part.groups:
        a, b = (int(i) for i in np.searchsorted(g.rows, [start, stop]))  # a group's rows ascend
        if a < b:
            groups.append(RowGroup(g.rows[a:b] - start, {name: slice_field(fd, part.specs[name], a, b)
                                                         for name, fd in g.fields.items()}))
    held = {name for g in groups for name in g.fields}
    return PartitionRows(part.partition_id, part.keys[start:stop], part.tags[start:stop],
                         {name: spec for name, spec in part.specs.items() if name in held}, groups, part.position)


def join_partitions(parts: Sequence[PartitionRows], where: str) -> PartitionRows:
    """One partition's pieces (its segments, in order) as one partition, without copying a value:
    keys and tags one after the other, each piece's groups kept (their rows shifted), every field's
    layout unified (:func:`unify_specs`: a field dense in one piece and ragged in another is ragged),
    fields in the order the pieces name them. A key in two pieces is refused, naming ``where``."""
    first = parts[0]
    keys = [k for p in parts for k in p.keys]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        again = next(k for k in keys if k in seen or seen.add(k))
        raise InvalidRecordError(f"{where}: key {again!r} of partition {first.partition_id!r} is in two segments")
    by_name: dict[str, list[FieldSpec]] = {}
    for name in _merged_order([list(p.specs) for p in parts]):
        by_name[name] = [p.specs[name] for p in parts if name in p.specs]
    specs = {name: unify_specs(s, f"{where} partition {first.partition_id!r} field {name!r}")
             for name, s in by_name.items()}
    groups = []
    offset = 0
    for p in parts:
        groups.extend(RowGroup(g.rows + offset, g.fields) for g in p.groups)
        offset += len(p.keys)
    return PartitionRows(first.partition_id, keys, [t for p in parts for t in p.tags], specs, groups)


def _merged_order(orders: Sequence[Sequence[str]]) -> list[str]:
    """Field orders of several pieces as one: the longest first (the newest pieces name every field,
    in the data plane's order), then any name it lacks, in the order the pieces give them."""
    if not orders:
        return []
    base = list(max(orders, key=len))
    seen = set(base)
    for order in orders:
        for name in order:
            if name not in seen:
                seen.add(name)
                base.append(name)
    return base


def rows_nbytes(part: PartitionRows) -> int:
    """About what a partition's values take in memory (objects counted roughly: 64 bytes each)."""
    total = 0
    for g in part.groups:
        for fd in g.fields.values():
            total += fd.values.nbytes if isinstance(fd.values, np.ndarray) else 64 * len(fd.values)
            if fd.offsets is not None:
                total += fd.offsets.nbytes
    return total


# ------------------------------------------------------------------ what producers put, per row


@dataclass(frozen=True)
class Ragged:
    """A ragged field for :meth:`DataPlane.put`: one array per row (first dimension may vary)."""

    rows: Sequence[np.ndarray]


@dataclass(frozen=True)
class Objects:
    """A non-tensor field for :meth:`DataPlane.put`: one Python value per row."""

    values: Sequence[Any]


def rows_of(name: str, value: Any, n: int) -> tuple[FieldSpec, list[Any]]:
    """A put's field as (layout, one value per row), copied: a numpy array ``[n, ...]`` is a dense
    field, :class:`Ragged` a ragged one, :class:`Objects` a non-tensor one."""
    where = f"field {name!r}"
    if isinstance(value, Objects):
        vals = list(value.values)
        if len(vals) != n:
            raise InvalidRecordError(f"{where}: {len(vals)} values for {n} keys")
        for v in vals:
            check_json_value(v, where)
        return FieldSpec("object"), [json_copy(v) for v in vals]
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
    if name not in DTYPES or name == "bfloat16":
        raise InvalidRecordError(f"{where}: dtype {name} is not supported")
    return name


def field_data(spec: FieldSpec, values: list[Any]) -> FieldData:
    """Per-row values (as :func:`rows_of` gives them) in the neutral stacked form."""
    if spec.type == "object":
        return FieldData([json_copy(v) for v in values])
    if spec.ndim == 0:
        return FieldData(np.array(values, dtype=spec.numpy_dtype))
    lengths = np.fromiter((v.shape[0] for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values, axis=0) if values else np.empty((0, *spec.inner), spec.numpy_dtype)
    return FieldData(flat, offsets)


def split_rows(spec: FieldSpec, fd: FieldData) -> list[Any]:
    """The neutral form back to one value per row (copies): the inverse of :func:`field_data`."""
    if spec.type == "object":
        return list(fd.values)
    values = np.asarray(fd.values, dtype=spec.numpy_dtype)
    if spec.ndim == 0:
        return [np.array(values[i], copy=True) for i in range(len(values))]
    off = fd.offsets
    return [values[off[i]:off[i + 1]].copy() for i in range(len(off) - 1)]


__all__ = [
    "DTYPES", "FieldData", "FieldSpec", "Objects", "PartitionRows", "Ragged", "RowGroup", "concat_fields",
    "field_data", "group_by_presence", "join_partitions", "rows_nbytes", "rows_of", "slice_field", "slice_partition",
    "split_rows", "unify_specs",
]
