"""Which row table a data-plane partition is written to, and the columns of the generic one.

A data plane holds partitions of any shape; a snapshot keeps them in three row tables (SPEC §12.1,
§12.2, §12.2a). Each partition goes whole to exactly one, decided per snapshot, in this order:

1. ``token_capture_rows``: the partitions the data plane is configured to hold token-capture rows
   in (a configuration, not a guess: their rows MUST fit, and a row that does not is an error);
2. ``training_rows``: a partition every row of which carries every column ``training_rows``
   requires, and none of whose fields would have to change type family or name to be a column of
   it (see :func:`training_misfit`). An empty partition fits (it has no row that does not);
3. ``dataplane_rows``: every other partition. Its rows are kept as they are: key, partition, tags
   and each field with its own type, whatever the fields are named or shaped.

Why decide from what the rows carry rather than from configuration: NeMo-RL keeps partitions of
its own in TransferQueue (token-capture *staging* rows with ``token_ids_delta``, ``prev_len``, ...)
that are neither training rows nor Gym token entries, and a snapshot must keep them too; the two
typed tables stay exactly what they were for the rows that are training rows or token entries.
The decision reads names, layouts and types, never values: a training row whose *value* breaks a
rule (a rollout id outside Gym's rule, a negative attempt, an id past int32) is still refused when
written, not hidden in the generic table.

A partition's rows can change kind between two snapshots (a row whose ``input_ids`` is not put
yet sends its partition to ``dataplane_rows`` until it is): a restore puts every partition back
whatever table it came from, and a reader looking for a partition looks in all three.

This module needs pyarrow only (layouts are duck-typed :class:`~coordinator.dataplane.fields.FieldSpec`).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from operator import methodcaller
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from schemas.rows import TRAINING_SCHEMA

if TYPE_CHECKING:
    from coordinator.dataplane.fields import FieldSpec

TRAINING = "training_rows"
TOKEN_CAPTURE = "token_capture_rows"
DATAPLANE = "dataplane_rows"

#: The file each row kind is written to, under the part's prefix.
FILE_NAMES: dict[str, str] = {TRAINING: "training.arrow", TOKEN_CAPTURE: "token_capture.arrow",
                              DATAPLANE: "dataplane.arrow"}

KEY_COLUMN = "key"
PARTITION_COLUMN = "partition_id"
TAGS_COLUMN = "row_tags"
RESERVED_COLUMNS = frozenset({KEY_COLUMN, PARTITION_COLUMN, TAGS_COLUMN})

#: The layout entry of a field that is not stored under its own name (``dataplane_rows`` only).
COLUMN_KEY = "column"


def assign_kind(is_token: bool, training_misfit: str | None) -> str:
    """The row kind of a partition: configured token capture first, then training rows when they fit."""
    if is_token:
        return TOKEN_CAPTURE
    return TRAINING if training_misfit is None else DATAPLANE


def fields_every_row_holds(held: Iterable[tuple[Iterable[str], int]], rows: int) -> frozenset[str]:
    """The field names every one of ``rows`` rows holds, given ``(field names, row count)`` per group of
    rows that hold the same fields (groups are disjoint)."""
    count: Counter[str] = Counter()
    for names, n in held:
        for name in names:
            count[name] += n
    return frozenset(name for name, n in count.items() if n == rows)


def training_misfit(specs: Mapping[str, FieldSpec], full_fields: AbstractSet[str],
                    tags: Sequence[Mapping[str, Any]]) -> str | None:
    """Why a partition's rows cannot be ``training_rows`` (``None``: they can).

    ``specs`` are its fields' layouts, ``full_fields`` the fields every row holds, ``tags`` every row's
    tag. A column of the training schema is filled from the field of its name when the partition has
    one (then every row must hold it, if the column is required), else from the tag of its name (then
    every row's tag must hold a value of the column's type, if required). A field named like a
    training column must have a layout that casts to that column's type (same nesting, same family:
    numbers stay numbers, text stays text); a typed table has no room for a field named like a
    reserved column.
    """
    clash = sorted(RESERVED_COLUMNS & set(specs))
    if clash:
        return f"field {clash[0]!r} is named like a reserved column"
    from_tags: list[pa.Field] = []
    for col in TRAINING_SCHEMA:
        if col.name in RESERVED_COLUMNS:
            continue
        spec = specs.get(col.name)
        if spec is not None:
            got = spec.arrow_type()
            if not fits_column(got, col.type):
                return f"field {col.name!r} is {got}, which is not a {col.type} column"
            if not col.nullable and col.name not in full_fields:
                return f"not every row holds field {col.name!r}"
        elif not col.nullable:
            from_tags.append(col)
    gap = _first_tag_gap(tags, from_tags)
    if gap is not None:
        row, col = gap
        return f"row {row} has neither a field nor a tag {col.name!r} of type {col.type}"
    return None


@functools.lru_cache(maxsize=256)
def fits_column(got: pa.DataType, want: pa.DataType) -> bool:
    """Whether a field stored as ``got`` may fill a column of type ``want``: the same list nesting,
    text for text and numbers (or booleans) for numbers, with a cast Arrow supports. Whether each
    value fits (an int64 id in int32) is checked when the rows are written."""
    while pa.types.is_list(want):
        if not pa.types.is_list(got):
            return False
        got, want = got.value_type, want.value_type
    if pa.types.is_list(got):
        return False
    if pa.types.is_string(want):
        return pa.types.is_string(got)
    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
    if not any(f(got) for f in numeric) or not any(f(want) for f in numeric):
        return False
    try:
        pa.array([], type=got).cast(want)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def _tag_types(t: pa.DataType) -> frozenset[type]:
    """The Python types of a JSON tag value that fill a column of type ``t`` (none for lists)."""
    if pa.types.is_string(t):
        return frozenset({str})
    if pa.types.is_integer(t):
        return frozenset({int})  # not bool: True is no attempt index
    if pa.types.is_floating(t):
        return frozenset({int, float})
    if pa.types.is_boolean(t):
        return frozenset({bool})
    return frozenset()


def _first_tag_gap(tags: Sequence[Mapping[str, Any]], columns: Sequence[pa.Field]) -> tuple[int, pa.Field] | None:
    """The first row whose tag lacks a value of one of ``columns`` (of its type), and that column;
    ``None`` when every row's tag has them all. The common case (no gap) is one C-level pass per
    column over the tags' value types; the row is searched for only when there is a gap."""
    missing = object()
    for col in columns:
        accepted = _tag_types(col.type)
        get = methodcaller("get", col.name, missing)
        if set(map(type, map(get, tags))) <= accepted:
            continue
        row = next(i for i, tag in enumerate(tags) if type(get(tag)) not in accepted)
        return row, col
    return None


def assign_columns(partitions: Sequence[tuple[str, Mapping[str, FieldSpec]]]) -> list[dict[str, str]]:
    """For a ``dataplane_rows`` table holding ``partitions`` (``(partition id, field layouts)`` in the
    table's order): the column of each field that is not stored under its own name.

    A field is stored under its name unless that name is reserved (``key``, ``partition_id``,
    ``row_tags``) or an earlier partition's field of the same name is stored there with another
    Arrow type; then it goes to ``<name>@<partition id>`` (``#2``, ``#3``... appended while that is
    taken by another type or by another field of the same partition). The table's layout records
    every such column, so a restore finds each field wherever it is; the typed tables never rename
    (a clash there is an error).
    """
    taken: dict[str, pa.DataType] = {}  # every column so far, with its type
    out: list[dict[str, str]] = []
    for pid, specs in partitions:
        moved: dict[str, str] = {}
        mine: set[str] = set()  # columns this partition's fields use: one field each
        for name, spec in specs.items():
            t = spec.arrow_type()
            column = _column_for(name, pid, t, taken, mine)
            if column != name:
                moved[name] = column
            taken[column] = t
            mine.add(column)
        out.append(moved)
    return out


def _column_for(name: str, pid: str, t: pa.DataType, taken: Mapping[str, pa.DataType], mine: set[str]) -> str:
    """The first free column of ``name``, ``name@pid``, ``name@pid#2``...: not reserved, not used by
    another field of the partition, and not holding another type."""
    def free(column: str) -> bool:
        return column not in RESERVED_COLUMNS and column not in mine and taken.get(column, t) == t

    if free(name):
        return name
    column, n = f"{name}@{pid}", 1
    while not free(column):
        n += 1
        column = f"{name}@{pid}#{n}"
    return column


__all__ = [
    "COLUMN_KEY", "DATAPLANE", "FILE_NAMES", "KEY_COLUMN", "PARTITION_COLUMN", "RESERVED_COLUMNS", "TAGS_COLUMN",
    "TOKEN_CAPTURE", "TRAINING", "assign_columns", "assign_kind", "fields_every_row_holds", "fits_column",
    "training_misfit",
]
