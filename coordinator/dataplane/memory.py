"""The in-memory data plane: the reference implementation, with TransferQueue's KV semantics.

Unit tests, the golden example store and ``--data-plane memory`` runs use it where TransferQueue
would need Ray. It holds every row in this process, copied in and out, so that no caller can change
what it holds, and its cut is taken under its own lock (its barrier).

This module needs numpy and pyarrow only: no Ray, no torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.dataplane.errors import DataPlaneError
from coordinator.dataplane.fields import (
    FieldSpec,
    PartitionRows,
    RowGroup,
    field_data,
    group_by_presence,
    rows_of,
    split_rows,
)
from coordinator.dataplane.jsonvalues import check_json_value, json_copy
from coordinator.dataplane.plane import DataPlane
from coordinator.dataplane.rows_cut import CopiedCut
from schemas.errors import InvalidRecordError


class InMemoryDataPlane(DataPlane):
    """A data plane held in this process, with TransferQueue's KV semantics.

    ``put(partition_id, keys, fields, tags)`` creates missing keys (in order), merges tags into the
    existing ones and sets fields: a numpy array ``[n, ...]`` is a dense field, :class:`Ragged` a
    ragged one, :class:`Objects` a non-tensor one. A field keeps the layout of its first put in a
    partition. Values are copied in and out, so no caller can change what it holds. Thread-safe.

    ``write_once`` makes it keep TransferQueue's adapter's promise: a key put (or restored) once is
    refused a second put, even after it was deleted, so that an incremental save may list rows an
    earlier snapshot holds instead of writing them again (:attr:`DataPlane.rows_write_once`).
    """

    def __init__(self, token_capture_partitions: Iterable[str] | Callable[[str], bool] | None = None,
                 write_once: bool = False) -> None:
        super().__init__(token_capture_partitions)
        self.write_once = write_once
        self._written: set[tuple[str, str]] = set()  # (partition, key) ever put or restored, with write_once
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
            if self.write_once:
                again = [k for k in keys if (partition_id, k) in self._written]
                if again:
                    raise DataPlaneError(f"partition {partition_id!r}: keys {again[:5]} were put before; this data "
                                         "plane is write-once")
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
                    row[0].update(json_copy(dict(tags[i])))
                for name, (_, values) in converted.items():
                    row[1][name] = values[i]
            if self.write_once:
                self._written.update((partition_id, k) for k in keys)

    def delete(self, partition_id: str, keys: Sequence[str]) -> None:
        """Remove keys (the partition stays, possibly empty), like TransferQueue's ``kv_clear``."""
        with self._lock:
            part = self._rows.get(partition_id, {})
            for key in keys:
                part.pop(key, None)

    def list(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{partition: {key: tag}}``, like TransferQueue's ``kv_list``."""
        with self._lock:
            return {p: {k: json_copy(r[0]) for k, r in rows.items()} for p, rows in self._rows.items()}

    def get(self, partition_id: str, key: str) -> dict[str, Any]:
        """The fields of one row (copies): numpy arrays for tensors, Python values for objects."""
        with self._lock:
            row = self._rows[partition_id][key]
            return {n: (v.copy() if isinstance(v, np.ndarray) else json_copy(v)) for n, v in row[1].items()}

    def specs(self, partition_id: str) -> dict[str, FieldSpec]:
        with self._lock:
            return dict(self._specs[partition_id])

    # -- the DataPlane side --

    @property
    def rows_write_once(self) -> bool:
        return self.write_once

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._specs.clear()
            self._written.clear()

    def is_empty(self) -> bool:
        with self._lock:
            return not self._rows

    def cut(self) -> CopiedCut:
        started = time.perf_counter()
        with self._lock:  # the barrier of this data plane
            taken_at = time.time()
            parts = [self._partition(pid, rows) for pid, rows in self._rows.items()]
            # Building Arrow copies every value: the cut shares no buffer with the live rows.
            return self._make_cut(parts, started, taken_at)

    def _partition(self, pid: str, rows: dict[str, list[Any]]) -> PartitionRows:
        """One partition's rows in the neutral form (copies), grouped by the fields they hold."""
        keys = list(rows)
        used = {name for r in rows.values() for name in r[1]}
        specs = {n: s for n, s in self._specs.get(pid, {}).items() if n in used}
        presence = {name: np.fromiter((name in rows[k][1] for k in keys), dtype=bool, count=len(keys))
                    for name in specs}
        part = PartitionRows(pid, keys, [json_copy(rows[k][0]) for k in keys], specs)
        for idx, names in group_by_presence(presence, len(keys)):
            part.groups.append(RowGroup(idx, {
                name: field_data(specs[name], [rows[keys[i]][1][name] for i in idx]) for name in names}))
        return part

    def restore_partitions(self, partitions: Sequence[PartitionRows]) -> None:
        with self._lock:
            if self.write_once:
                self._written.update((p.partition_id, k) for p in partitions for k in p.keys)
            for p in partitions:
                rows = self._rows.setdefault(p.partition_id, {})
                self._specs[p.partition_id] = dict(p.specs)
                for key, tag in zip(p.keys, p.tags):
                    rows[key] = [dict(tag), {}]
                for name in p.specs:  # in the saved field order
                    for group in p.groups:
                        if name in group.fields:
                            values = split_rows(p.specs[name], group.fields[name])
                            for key, value in zip((p.keys[i] for i in group.rows), values):
                                rows[key][1][name] = value


__all__ = ["InMemoryDataPlane"]
