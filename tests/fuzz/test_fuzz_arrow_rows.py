"""Fuzzing the Arrow IPC row parts (training rows, token-capture rows) through ``read_table`` and
``verify_snapshot``, from memory and memory-mapped from local disk.

Seeds are the golden store's row files, and the same tables written with Arrow's ZSTD and LZ4 buffer
compression (which readers must support, and where a buffer's declared length decides what Arrow
allocates). An example either mutates a seed's bytes (edge integers favoured: lengths and offsets)
or changes the table and writes it anew (a dropped, retyped, renamed or exotic extra column, a bad
value or null, nulls in a column the canonical schema declares not nullable, whether the file
declares it nullable or not, odd schema metadata, other batch sizes), and lists the file with a
matching size, checksum and, mostly, matching batch and row counts. Proves, for every input:
``read_table`` returns a table that passes Arrow's full validation and holds no null in a
not-nullable column, or raises a ``SnapshotError`` subclass, never another exception, within the
memory cap (a compressed buffer declaring more than its bytes can hold is refused before Arrow
allocates); ``verify_snapshot`` reports instead of raising. A file whose only change is nulls in a
not-nullable column is always refused, by ``read_table`` and by ``verify_snapshot``, naming it.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_mutations import EDGE_INTS, mutated_bytes
from fuzz_property import FUZZ, TIMEOUT, address_space_limit, typed_or_result
from fuzz_seeds import GOLDEN, entries_of_kind, file_key, golden_files, replace_file, snapshot_with, with_bytes
from schemas.errors import InvalidRecordError, SnapshotError
from schemas.manifest import FileEntry
from schemas.rows import NON_NULLABLE
from snapformat import LocalStore, verify_snapshot
from snapformat.reader import Snapshot

pytestmark = TIMEOUT

ROW_KINDS = ["token_capture_rows", "training_rows"]
CODECS = [None, "zstd", "lz4"]
_INT32_EDGES = [v for v in EDGE_INTS if -(2**31) <= v < 2**31]
_STRINGS = ["", "../x", "p7_g2-a1", "p 7", "p7_g2", "\x00", "é" * 50, "call-0", "root", "bogus"]
def _text(a: pa.Array) -> pa.Array:
    return pa.array([None if v is None else str(v) for v in a.to_pylist()], pa.string())


#: Types a writer may give an extra column (readers ignore it, but must still parse it).
_EXTRA_TYPES: dict[str, Callable[[pa.Array], pa.Array]] = {
    "null": lambda a: pa.nulls(len(a)),
    "dictionary": lambda a: _text(a).dictionary_encode(),
    "string_view": lambda a: _text(a).cast(pa.string_view()),
    "binary_view": lambda a: _text(a).cast(pa.binary_view()),
    "large_string": lambda a: _text(a).cast(pa.large_string()),
    "run_end_encoded": lambda a: pc.run_end_encode(_text(a)),
    "struct": lambda a: pa.StructArray.from_arrays([a], names=["inner"]),
    "list_view": lambda a: pa.array([[len(s or "")] for s in _text(a).to_pylist()], pa.list_view(pa.int32())),
    "float16": lambda a: pa.nulls(len(a), pa.float16()),
}
_RETYPES = [pa.int64(), pa.large_string(), pa.large_list(pa.int32()), pa.float64(), pa.string(), pa.int8(),
            pa.list_(pa.int64()), pa.null()]


@cache
def _tables(kind: str) -> tuple[pa.Table, ...]:
    return tuple(pa.ipc.open_file(pa.py_buffer(golden_files()[file_key(s, e.path)])).read_all()
                 for s, e in entries_of_kind(kind))


def _ipc(table: pa.Table, codec: str | None, chunk: int | None, schema: pa.Schema | None = None) -> tuple[bytes, int]:
    """``table`` as an IPC file and its number of batches (written straight, no writer checks)."""
    sink = io.BytesIO()
    batches = table.to_batches(max_chunksize=chunk)
    with pa.ipc.new_file(sink, schema or table.schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue(), len(batches)


@cache
def _seeds(kind: str) -> tuple[bytes, ...]:
    real = tuple(golden_files()[file_key(s, e.path)] for s, e in entries_of_kind(kind))
    return real + tuple(_ipc(t, codec, 16)[0] for t in _tables(kind) for codec in ("zstd", "lz4"))


def _replace_column(table: pa.Table, i: int, name: str, array: pa.Array) -> pa.Table:
    nullable = table.schema.field(i).nullable or array.type == pa.null()  # Arrow insists on it
    return table.set_column(i, pa.field(name, array.type, nullable), array)


@st.composite
def _changed_table(draw: st.DrawFn, kind: str) -> tuple[bytes, int, int]:
    """A golden table changed in one way and written anew: (bytes, batches, rows)."""
    table = draw(st.sampled_from(_tables(kind)))
    i = draw(st.integers(0, table.num_columns - 1))
    col, name = table.column(i).combine_chunks(), table.schema.field(i).name
    op = draw(st.sampled_from(["drop", "retype", "value", "null", "null_required", "rename", "extra", "metadata",
                               "slice"]))
    if op == "null_required" and table.num_rows:
        table = draw(_nulled_required(kind, table))
    elif op == "drop":
        table = table.remove_column(i)
    elif op == "retype":
        target = draw(st.sampled_from(_RETYPES))
        try:
            new = col.cast(target, safe=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            new = pa.nulls(len(col), target)
        table = _replace_column(table, i, name, new)
    elif op in ("value", "null") and table.num_rows:
        values = col.to_pylist()
        row = draw(st.integers(0, len(values) - 1))
        values[row] = None if op == "null" else draw(
            st.sampled_from(_STRINGS) | st.sampled_from(_INT32_EDGES) | st.lists(st.sampled_from(_INT32_EDGES), max_size=3))
        try:
            table = _replace_column(table, i, name, pa.array(values, col.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            pass  # the value does not fit the column's type; the table stays as it was
    elif op == "rename":
        table = table.rename_columns([draw(st.sampled_from(table.column_names + ["", "x"])) if j == i else n
                                      for j, n in enumerate(table.column_names)])
    elif op == "extra":
        extra = draw(st.sampled_from(sorted(_EXTRA_TYPES)))
        table = table.append_column(draw(st.sampled_from(["extra", name])), _EXTRA_TYPES[extra](col))
    elif op == "metadata":
        meta = dict(table.schema.metadata or {})
        meta[b"snapformat.schema_version"] = draw(st.sampled_from([b"0", b"2", b"1" * 5000, b"x", b"", b"01", b"\xd9\xa3"]))
        table = table.replace_schema_metadata(meta if draw(st.booleans()) else None)
    elif op == "slice":
        table = table.slice(draw(st.integers(0, table.num_rows)), draw(st.integers(0, table.num_rows)))
    data, batches = _ipc(table, draw(st.sampled_from(CODECS)), draw(st.sampled_from([None, 1, 7, 1000])))
    return data, batches, table.num_rows


@st.composite
def _nulled_required(draw: st.DrawFn, kind: str, table: pa.Table) -> pa.Table:
    """``table`` (not empty) with nulls at some rows of a column the canonical schema declares not
    nullable; the file's field declared nullable or not (readers must not trust either)."""
    name = draw(st.sampled_from([f.name for f in NON_NULLABLE[kind]]))
    i = table.schema.get_field_index(name)
    values = table.column(i).to_pylist()
    for row in draw(st.sets(st.integers(0, len(values) - 1), min_size=1, max_size=3)):
        values[row] = None
    field = table.schema.field(i).with_nullable(draw(st.booleans()))
    return table.set_column(i, field, pa.array(values, field.type))


def _counts(data: bytes) -> tuple[int, int] | None:
    """Batches and rows as Arrow reads them, or None; capped so that a bomb is not the harness's."""
    try:
        with address_space_limit():
            reader = pa.ipc.open_file(pa.py_buffer(data))
            return reader.num_record_batches, sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except Exception:  # noqa: BLE001 - the reader under test decides what this input is
        return None


@st.composite
def _row_file(draw: st.DrawFn, kind: str) -> tuple[int, FileEntry, bytes]:
    """A row part to read: (sequence, its listing, its bytes)."""
    seq, entry = draw(st.sampled_from(entries_of_kind(kind)))
    if draw(st.booleans()):
        data, batches, rows = draw(_changed_table(kind))
    else:
        data = draw(mutated_bytes(list(_seeds(kind))))
        batches, rows = _counts(data) or (entry.batches or 0, entry.records)
    batches, rows = draw(st.sampled_from([(batches, rows)] * 4 + [(entry.batches or 0, entry.records), (batches, rows + 1)]))
    return seq, with_bytes(entry, data, batches=batches, records=rows), data


def _keep(kind: str) -> set[str]:
    """Files verified with the part: the token index, which points into token-capture rows."""
    return {"gym/model/policy0/token_index.jsonl"} if kind == "token_capture_rows" else set()


def _read(snap: Snapshot, entry: FileEntry) -> None:
    table = typed_or_result(lambda: snap.read_table(entry.path))
    if isinstance(table, pa.Table):
        table.validate(full=True)  # a table handed out must be sound, not just returned
        nulls = {f.name: table.column(f.name).null_count for f in NON_NULLABLE[entry.kind]}
        assert not any(nulls.values()), f"read_table handed out nulls in not-nullable columns: {nulls}"
    report = typed_or_result(lambda: verify_snapshot(snap))
    assert not isinstance(report, SnapshotError), report


@pytest.mark.parametrize("kind", ROW_KINDS)
@FUZZ
@given(data=st.data())
def test_row_part_in_memory(kind: str, data: st.DataObject) -> None:
    seq, entry, content = data.draw(_row_file(kind))
    _read(snapshot_with(seq, entry, content, keep=_keep(kind)), entry)


@pytest.fixture(scope="module")
def local_golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-rows") / "store"
    shutil.copytree(GOLDEN, root)
    return root


@pytest.mark.parametrize("kind", ROW_KINDS)
@FUZZ
@given(data=st.data())
def test_row_part_memory_mapped(kind: str, local_golden: Path, data: st.DataObject) -> None:
    seq, entry, content = data.draw(_row_file(kind))
    replace_file(local_golden / file_key(seq, entry.path), content)
    snap = snapshot_with(seq, entry, content, store=LocalStore(local_golden), keep=_keep(kind))
    _read(snap, entry)


@pytest.mark.parametrize("kind", ROW_KINDS)
@FUZZ
@given(data=st.data())
def test_nulls_in_a_not_nullable_column_are_refused(kind: str, data: st.DataObject) -> None:
    seq, entry = data.draw(st.sampled_from(entries_of_kind(kind)))
    table = data.draw(_nulled_required(kind, data.draw(st.sampled_from(_tables(kind)))))
    content, batches = _ipc(table, data.draw(st.sampled_from(CODECS)), data.draw(st.sampled_from([None, 1, 7, 1000])))
    listed = with_bytes(entry, content, batches=batches, records=table.num_rows)
    snap = snapshot_with(seq, listed, content, keep=set())
    refused = typed_or_result(lambda: snap.read_table(listed.path))
    assert isinstance(refused, InvalidRecordError), refused
    message = str(refused)
    assert message.startswith(snap.where(listed)) and " is null (expected a " in message, message
    assert any(f"column {f.name!r} is null" in message for f in NON_NULLABLE[kind]), message
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [listed.path] and problems[0].message == message, problems
