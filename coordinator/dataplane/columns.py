"""One field of a group of rows as one Arrow column, and back.

A per-row scalar is a scalar column, a per-row 1-D tensor a ``list<T>`` column, a per-row
``[n, k, ...]`` tensor nested lists (``list<list<T>>``...), an object field a string column (JSON
text unless every value is a string). Reading a column back casts it to the field's own dtype and
refuses any value that would not come back exactly. :func:`infer_spec` gives a layout to a column
written by something else (a part with no layout metadata); :func:`spread` places per-group
columns into one column of a whole table, null where a row lacks the field.

This module needs numpy and pyarrow only.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from coordinator.dataplane.fields import DTYPES, FieldData, FieldSpec
from coordinator.dataplane.jsonvalues import json_texts
from schemas.errors import InvalidRecordError

_MAX_LIST_VALUES = 2**31 - 1  # list<T> has int32 offsets


# ------------------------------------------------------------------ numpy -> Arrow


def _offsets_array(offsets: np.ndarray, where: str) -> pa.Array:
    if len(offsets) and int(offsets[-1]) > _MAX_LIST_VALUES:
        raise InvalidRecordError(f"{where}: {int(offsets[-1])} values exceed one list column's limit")
    return pa.array(np.asarray(offsets, dtype=np.int32))


def tensor_column(fd: FieldData, spec: FieldSpec, n: int, where: str) -> pa.Array:
    """The values of a tensor field for ``n`` rows as a column of ``spec.arrow_type()``."""
    values = np.asarray(fd.values)
    np_dtype, arrow_t = DTYPES[spec.dtype]
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


def object_column(values: list[Any], as_json: bool, where: str) -> pa.Array:
    """The values of an object field as a string column: JSON text when ``as_json``, else as they are."""
    if as_json:
        return pa.array(json_texts(values, where), type=pa.string())
    return pa.array(values, type=pa.string())


def spread(chunks: list[tuple[np.ndarray, pa.Array]], n: int, arrow_t: pa.DataType) -> pa.Array:
    """One column of ``n`` rows from per-group arrays (``(rows, array)``; rows not covered are null)."""
    if len(chunks) == 1 and len(chunks[0][0]) == n and bool(np.all(chunks[0][0] == np.arange(n))):
        return chunks[0][1]
    covered = np.concatenate([rows for rows, _ in chunks]) if chunks else np.empty(0, dtype=np.int64)
    missing = np.setdiff1d(np.arange(n, dtype=np.int64), covered, assume_unique=True)
    arrays = [a for _, a in chunks] + ([pa.nulls(len(missing), arrow_t)] if len(missing) else [])
    order = np.concatenate([covered, missing])
    joined = pa.concat_arrays(arrays) if arrays else pa.nulls(0, arrow_t)
    return joined.take(pa.array(np.argsort(order, kind="stable")))


# ------------------------------------------------------------------ Arrow -> numpy


def _offsets_of(arr: pa.Array) -> np.ndarray:
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def field_from_column(arr: pa.Array, spec: FieldSpec, as_json: bool, where: str) -> FieldData:
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


def infer_spec(arr: pa.ChunkedArray | pa.Array, where: str) -> FieldSpec:
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
    name = {v[1]: k for k, v in DTYPES.items() if k != "bfloat16"}.get(t)
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


__all__ = ["field_from_column", "infer_spec", "object_column", "spread", "tensor_column"]
