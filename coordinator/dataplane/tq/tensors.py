"""TransferQueue's tensors and the data plane's neutral form (numpy values and row offsets), both ways.

A ``kv_batch_get`` field is a dense tensor (one value or one ``[L, ...]`` row per key), a jagged
nested tensor (ragged rows; a dense ``[N, L]`` put also comes back jagged when the rows were put in
several batches), a ``NonTensorStack``/``NonTensorData`` (any Python value) or a list. bfloat16,
which numpy lacks, travels as its exact float32 value and the layout says to narrow it back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict.tensorclass import NonTensorData, NonTensorStack

from coordinator.dataplane.fields import FieldData, FieldSpec
from schemas.errors import InvalidRecordError


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numpy(t: torch.Tensor) -> np.ndarray:
    """An owned numpy copy of ``t`` (bfloat16 widened to float32, exactly)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return np.array(t.contiguous().numpy(), copy=True)


def from_tq(value: Any, n: int, nested: bool, where: str) -> tuple[FieldSpec, FieldData]:
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


_TORCH_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64")}


def to_tq(spec: FieldSpec, fd: FieldData, n: int, where: str) -> Any:
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


__all__ = ["from_tq", "to_tq"]
