"""The Arrow codec: a data plane's partitions as one row table per kind, and back.

How rows map to the row schemas (``schemas.rows``): the columns ``key`` and ``partition_id`` are
the data plane's key and partition; every field becomes a column of its own name (a field named
like a required column fills it, cast to the canonical type when needed; in ``dataplane_rows`` a
field whose name is reserved or taken by another type gets a column of its own, see
:func:`coordinator.dataplane.row_kinds.assign_columns`); a required column that is not a field is
taken from the row's tag of the same name (``rollout_id``, ``attempt_index``); the tag itself is
kept as JSON text in ``row_tags``. Each field's column is built by :mod:`coordinator.dataplane.columns`;
a row that lacks a field holds null there.

What Arrow cannot say by itself (the data plane's own dtype when the column was cast, bfloat16,
dense versus ragged, object fields kept as JSON, a field's column when not its name) is recorded
per partition and field in the ``dataplane.layout`` metadata of the ``row_tags`` column (SPEC
§12.2a), which every row file keeps through snapformat's conformance.

Encoding: a partition to be written is a :class:`PartitionSource`, whose layout is known up front
and whose rows come window by window; a :class:`RowTable` is the table of one kind holding some
sources, its schema (layout included) fixed before any row is built, then built one window at a
time (:meth:`RowTable.windows`), or all at once (:meth:`RowTable.built`, :meth:`RowTable.table`).
Decoding: :func:`parse_table` gives a table's partitions back in the neutral form.

This module needs numpy and pyarrow only: no Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from coordinator.dataplane.columns import field_from_column, infer_spec, object_column, spread, tensor_column
from coordinator.dataplane.errors import DataPlaneError
from coordinator.dataplane.fields import FieldSpec, PartitionRows, RowGroup, group_by_presence
from coordinator.dataplane.jsonvalues import decode_json, json_texts
from coordinator.dataplane.row_kinds import (
    COLUMN_KEY,
    DATAPLANE,
    KEY_COLUMN,
    PARTITION_COLUMN,
    RESERVED_COLUMNS,
    TAGS_COLUMN,
    assign_columns,
    fields_every_row_holds,
    training_misfit,
)
from schemas.errors import InvalidRecordError
from schemas.rows import ROW_SCHEMAS

LAYOUT_KEY = b"dataplane.layout"
LAYOUT_VERSION = 1


# ------------------------------------------------------------------ what a table is built from


@dataclass(frozen=True)
class PartitionSource:
    """One partition of a row table that is built window by window, so that building it never holds
    more than one window's copy of its values.

    What the table's schema and layout need is known up front: ``specs`` (every field's layout over
    the whole partition, in the data plane's order), ``as_json`` (object fields kept as JSON text),
    ``tag_names`` (every tag name of its rows) and ``rows``. ``windows()`` gives the rows as
    consecutive :class:`PartitionRows` of its keys, in order, whose values follow ``specs``.
    ``training_misfit`` says why its rows cannot be training rows (``None``: they can), which decides
    its row kind (:func:`coordinator.dataplane.row_kinds.assign_kind`) before any window is built;
    ``columns`` are the fields a ``dataplane_rows`` table stores under another name (set when the
    table is built).
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
    """A partition held whole, as one window."""
    as_json = {name: needs_json(v for g in part.groups if name in g.fields for v in g.fields[name].values)
               for name, spec in part.specs.items() if spec.type == "object"}
    full = fields_every_row_holds(((g.fields, len(g.rows)) for g in part.groups), len(part.keys))
    return PartitionSource(part.partition_id, int(position), len(part.keys), part.specs, as_json,
                           tag_names(part.tags), lambda: (part,), training_misfit(part.specs, full, part.tags))


def _with_columns(kind: str, sources: Sequence[PartitionSource]) -> list[PartitionSource]:
    """``sources`` as a table of ``kind`` stores them: in ``dataplane_rows``, with the columns of the
    fields that cannot keep their own name (:func:`coordinator.dataplane.row_kinds.assign_columns`)."""
    if kind != DATAPLANE:
        return list(sources)
    moved = assign_columns([(s.partition_id, s.specs) for s in sources])
    return [dataclasses.replace(s, columns=m) for s, m in zip(sources, moved)]


# ------------------------------------------------------------------ sources -> one table per kind


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
                column = object_column(list(fd.values), src.as_json.get(name, False), fwhere)
            else:
                column = tensor_column(fd, spec, len(group.rows), fwhere)
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
            arrays.append(spread(chunks[field_of[f.name]], n, f.type))
        elif f.name in src.tag_names:  # a row-schema column that is not a field: the tag of that name
            try:
                arrays.append(pa.array([t.get(f.name) for t in window.tags], type=f.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
                raise InvalidRecordError(
                    f"{where}: tag {f.name!r} cannot fill column of type {f.type}: {exc}") from None
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


@dataclass(frozen=True)
class RowTable:
    """The row table of one ``kind``: its ``schema`` (layout included), fixed before any row is
    built, and ``windows()``, its rows as consecutive tables of that schema.

    :meth:`of` builds each window as it is asked for, so that whoever consumes them one at a time
    (the writer) holds one window's copy of the values; :meth:`built` is the same table with every
    window built now (a copy of the rows as of that call).
    """

    kind: str
    schema: pa.Schema
    windows: Callable[[], Iterable[pa.Table]]

    @classmethod
    def of(cls, kind: str, sources: Sequence[PartitionSource]) -> RowTable:
        """The table of ``kind`` holding ``sources``, window by window (:func:`window_table`)."""
        placed = tuple(_with_columns(kind, sources))
        schema = table_schema(kind, placed)
        return cls(kind, schema, lambda: _windows(placed, schema))

    def built(self) -> RowTable:
        """This table with every window built now."""
        windows = tuple(self.windows())
        return RowTable(self.kind, self.schema, lambda: windows)

    def table(self) -> pa.Table:
        """Every window as one table (its chunks)."""
        windows = list(self.windows())
        return pa.concat_tables(windows) if windows else self.schema.empty_table()


def _windows(sources: Sequence[PartitionSource], schema: pa.Schema) -> Iterator[pa.Table]:
    """Each source's windows as tables of ``schema``, in order, each built when it is asked for."""
    for src in sources:
        seen = 0
        for window in src.windows():
            table = window_table(src, window, schema)
            del window  # before the next window is built: one window's copy at a time
            seen += table.num_rows
            yield table
            del table
        if seen != src.rows:
            raise DataPlaneError(f"partition {src.partition_id!r}: its windows gave {seen} rows, expected {src.rows}")


def build_table(kind: str, partitions: Sequence[PartitionRows], positions: Sequence[int] | None = None) -> pa.Table:
    """One table of ``kind`` holding every row of ``partitions``, with the layout in its metadata.

    ``positions`` are the partitions' places among all of the data plane's partitions (every kind),
    so that a restore recreates them in the same order.
    """
    if positions is None:
        positions = range(len(partitions))
    return RowTable.of(kind, [whole_source(p, pos) for p, pos in zip(partitions, positions)]).table()


# ------------------------------------------------------------------ a table -> partitions


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
        return [decode_json(t) if t is not None else {} for t in texts]
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
        inferred = {c: (infer_spec(table.column(c), f"{where} column {c!r}"), False) for c in fields}
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
                    name: field_from_column(taken[name] if whole else taken[name].take(sel), specs[name][0],
                                            specs[name][1], f"{where} partition {pid!r} field {name!r}")
                    for name in names}))
        out.append(part)
    return out


__all__ = [
    "LAYOUT_KEY", "LAYOUT_VERSION", "PartitionSource", "RowTable", "build_table", "layout_of", "needs_json",
    "parse_table", "table_schema", "tag_names", "whole_source", "window_table",
]
