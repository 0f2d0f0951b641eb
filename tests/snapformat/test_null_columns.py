"""Nulls in the columns the row schemas declare not nullable are refused by every reader and writer.

Arrow enforces a field's ``nullable`` flag neither when it writes nor when it reads, and a file's
schema may declare a required column nullable; the canonical schemas of ``schemas/rows.py`` decide.
For every not-nullable column of both row kinds, proves that:
- ``validate_batch`` refuses a batch with nulls there with ``InvalidRecordError`` naming the column,
  the first offending row and the expected type; nulls in nullable columns pass;
- ``write_rows`` refuses it, whether the caller's schema declares the column nullable or not, and
  leaves no file behind (the name is free for a good write);
- a published row file holding such nulls, its schema declaring the column not nullable or
  nullable, with a matching size and checksum, is refused by ``read_table`` (memory-mapped from
  local disk, with and without the checksum) naming the file, the record batch, the row and the
  column, and reported by ``verify_snapshot`` against that file only; ``token_rows`` (through the
  token index of the format 1.0/1.1 layout, which readers keep reading) refuses it too. A file with
  nulls only in nullable columns reads.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from schemas.errors import InvalidRecordError
from schemas.rows import NON_NULLABLE, ROW_SCHEMAS, validate_batch
from snapformat import SnapshotStore, verify_snapshot
from snapformat.checksum import checksum_bytes

pytestmark = pytest.mark.timeout(60)

#: Every column the spec's tables (§12.1-§12.3) mark not nullable, written out so that an empty or
#: shrunken ``NON_NULLABLE`` fails here instead of parametrizing nothing.
NOT_NULLABLE = [
    ("token_capture_rows", "schema_version"), ("token_capture_rows", "rollout_id"),
    ("token_capture_rows", "attempt_index"), ("token_capture_rows", "capture_key"),
    ("token_capture_rows", "model_call_id"), ("token_capture_rows", "prompt_token_ids"),
    ("token_capture_rows", "generation_token_ids"), ("token_capture_rows", "generation_log_probs"),
    ("training_rows", "key"), ("training_rows", "partition_id"), ("training_rows", "rollout_id"),
    ("training_rows", "attempt_index"), ("training_rows", "input_ids"), ("training_rows", "input_lengths"),
    ("dataplane_rows", "key"), ("dataplane_rows", "partition_id"),
]
FILES = {"token_capture_rows": "tq/token_capture.arrow", "training_rows": "tq/training.arrow"}
#: The token-capture rows of the 1.0/1.1 layout, which its token index leads into.
LEGACY_TOKENS = "gym/model/policy0/tokens.arrow"
#: The not-nullable columns of the kinds the example snapshot writes (data-plane rows: see tests/coordinator).
IN_EXAMPLE = [(kind, column) for kind, column in NOT_NULLABLE if kind in FILES]
CHUNK = 4  # rows per record batch of a crafted file: rows 5 and 6 are rows 1 and 2 of batch 1
NULL_ROWS = (5, 6)


def test_the_not_nullable_columns_are_the_spec_s() -> None:
    assert sorted((k, f.name) for k, fields in NON_NULLABLE.items() for f in fields) == sorted(NOT_NULLABLE)


def _expected(kind: str, column: str, row: int) -> str:
    """What the refusal says after its ``where`` (a regex): the row, the column and the expected type."""
    field = ROW_SCHEMAS[kind].field(column)
    said = f"row {row}: column {column!r} is null (expected a {field.type} value: the column is not nullable)"
    return re.escape(said)


def with_nulls(table: pa.Table, column: str, rows: tuple[int, ...], declared_nullable: bool) -> pa.Table:
    """``table`` with ``column`` null at ``rows``; its field declared nullable or not, as asked."""
    i = table.schema.get_field_index(column)
    values = table.column(i).to_pylist()
    for row in rows:
        values[row] = None
    field = table.schema.field(i).with_nullable(declared_nullable)
    return table.set_column(i, field, pa.array(values, field.type))


def _published_table(root: Path, path: str) -> pa.Table:
    snap = SnapshotStore(str(root)).open(1)
    return snap.read_table(path)


# ---- validate_batch --------------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "column"), IN_EXAMPLE)
def test_validate_batch_refuses_a_null_naming_column_and_first_row(example_store: Path, kind: str, column: str) -> None:
    table = with_nulls(_published_table(example_store, FILES[kind]), column, (2, 4), declared_nullable=False)
    batch = table.combine_chunks().to_batches()[0]
    with pytest.raises(InvalidRecordError, match=r"^rows\.arrow: batch 0: " + _expected(kind, column, 2)):
        validate_batch(kind, batch, "rows.arrow: batch 0")


def test_nulls_in_nullable_columns_pass(example_store: Path) -> None:
    for kind, path in FILES.items():
        table = _published_table(example_store, path)
        for field in ROW_SCHEMAS[kind]:
            if field.nullable:
                table = with_nulls(table, field.name, (0, 1), declared_nullable=True)
        validate_batch(kind, table.combine_chunks().to_batches()[0], path)


# ---- writers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("declared_nullable", [False, True], ids=["declared-not-nullable", "declared-nullable"])
@pytest.mark.parametrize(("kind", "column"), IN_EXAMPLE)
def test_write_rows_refuses_a_null_and_leaves_no_file(example_store: Path, tmp_path: Path, kind: str, column: str,
                                                      declared_nullable: bool) -> None:
    good = _published_table(example_store, FILES[kind])
    bad = with_nulls(good, column, NULL_ROWS, declared_nullable)
    store = SnapshotStore(str(tmp_path / "out"))
    draft = store.begin()
    part = draft.part("p")
    with pytest.raises(InvalidRecordError) as err:
        part.write_rows("rows.arrow", kind, [good.slice(0, 3), bad.combine_chunks()])
    assert re.search(re.escape(part.where("p/rows.arrow") + ": batch 1: ") + _expected(kind, column, 5),
                     str(err.value)), str(err.value)
    assert not (Path(draft.url) / "p" / "rows.arrow").exists()
    part.write_rows("rows.arrow", kind, good)  # the name is free again
    draft.publish()
    assert verify_snapshot(store.open(1)).ok


# ---- readers ---------------------------------------------------------------------------------------

def _ipc(table: pa.Table, rows_per_batch: list[int]) -> bytes:
    """``table`` as an Arrow IPC file in batches of the given sizes, written without any check."""
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as w:
        start = 0
        for n in rows_per_batch:
            w.write_batch(table.slice(start, n).combine_chunks().to_batches()[0])
            start += n
    return sink.getvalue()


def plant(root: Path, path: str, table: pa.Table, rewrite_manifest: Any, same_batches: bool = False) -> bytes:
    """Replace the published file ``path`` by ``table`` and list it consistently (size, checksum, counts).

    Batches of :data:`CHUNK` rows, or the published file's own batch sizes (so that the token index,
    which names batches, still holds)."""
    snap = SnapshotStore(str(root)).open(1)
    if same_batches:
        reader = snap.open_rows(snap.select(path)[0])
        sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    else:
        sizes = [min(CHUNK, table.num_rows - start) for start in range(0, table.num_rows, CHUNK)]
    data = _ipc(table, sizes)
    (Path(snap.url) / path).write_bytes(data)

    def change(manifest: dict[str, Any]) -> None:
        entry = next(f for f in manifest["files"] if f["path"] == path)
        entry.update(size=len(data), checksum=checksum_bytes(data), batches=len(sizes), records=table.num_rows)

    rewrite_manifest(root, 1, change)
    return data


@pytest.mark.parametrize("declared_nullable", [False, True], ids=["declared-not-nullable", "declared-nullable"])
@pytest.mark.parametrize(("kind", "column"), IN_EXAMPLE)
def test_readers_refuse_a_published_file_with_nulls(example_store: Path, rewrite_manifest, kind: str, column: str,
                                                    declared_nullable: bool) -> None:
    path = FILES[kind]
    table = with_nulls(_published_table(example_store, path), column, NULL_ROWS, declared_nullable)
    data = plant(example_store, path, table, rewrite_manifest)
    snap = SnapshotStore(str(example_store)).open(1)
    entry = snap.select(path)[0]
    message = re.escape(f"{snap.where(entry)}: record batch 1: ") + _expected(kind, column, 1)
    for verify in (True, False):  # skipping the checksum skips no row check
        with pytest.raises(InvalidRecordError, match=f"^{message}"):
            snap.read_table(path, verify=verify)
    problems = verify_snapshot(snap).problems
    assert problems and {p.file for p in problems} == {path}
    assert any(p.file == path and re.match(message, p.message) for p in problems), problems
    assert (Path(snap.url) / path).read_bytes() == data  # reading changed nothing


def test_token_rows_refuse_a_token_file_with_nulls(legacy_example_store: Path, rewrite_manifest) -> None:
    path = LEGACY_TOKENS
    original = _published_table(legacy_example_store, path)
    key, call = original.column("capture_key")[0].as_py(), original.column("model_call_id")[0].as_py()
    plant(legacy_example_store, path, with_nulls(original, "prompt_token_ids", NULL_ROWS, True), rewrite_manifest)
    snap = SnapshotStore(str(legacy_example_store)).open(1)
    with pytest.raises(InvalidRecordError,
                       match=r"tokens\.arrow: record batch 1: row 1: column 'prompt_token_ids' is null"):
        snap.token_rows(key, call)


def test_a_file_with_nulls_only_in_nullable_columns_reads(example_store: Path, rewrite_manifest) -> None:
    for kind, path in FILES.items():
        table = _published_table(example_store, path)
        for field in ROW_SCHEMAS[kind]:
            if field.nullable:
                table = with_nulls(table, field.name, NULL_ROWS, declared_nullable=True)
        plant(example_store, path, table, rewrite_manifest, same_batches=True)
    snap = SnapshotStore(str(example_store)).open(1)
    for kind, path in FILES.items():
        read = snap.read_table(path)
        for field in ROW_SCHEMAS[kind]:
            nulls = read.column(field.name).null_count
            assert nulls >= len(NULL_ROWS) if field.nullable else nulls == 0, (path, field.name, nulls)
    report = verify_snapshot(snap)
    assert report.ok, report.problems
