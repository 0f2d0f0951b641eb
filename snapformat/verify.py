"""``verify``: check every byte of a snapshot and every cross-reference, and report each problem.

Per file: present, size, checksum over all bytes, then parsed by kind (row schema, row rules,
batch and row counts, Gym's digest of every token-capture row whose prompt is whole; every JSON
line decoded; line counts; Gym's own files: their record counts). Across files: every token-index
entry names a token-capture part of this snapshot, a batch and a row range inside it, and those
rows belong to that model call. Problems are collected, not raised, so one run names them all.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable

import msgspec
import pyarrow as pa

from schemas.errors import CorruptSnapshotError, SnapshotError
from schemas.manifest import FileEntry
from schemas.rows import file_version, upgrade, validate_batch
from snapformat.checksum import check, checksum_stream
from snapformat.gym_dir import count_records
from snapformat.kinds import RECORD_TYPES, storage_of
from snapformat.reader import Snapshot
from snapformat.token_rows import check_digests


class Problem(msgspec.Struct, frozen=True):
    file: str
    message: str


class VerifyReport(msgspec.Struct, frozen=True):
    snapshot: str
    sequence: int
    files_checked: int
    bytes_checked: int
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_bytes(snap: Snapshot, entry: FileEntry, progress: Callable[[int], None] | None) -> None:
    where = snap.where(entry)
    snap.check_present(entry)
    with snap.store.open_read(snap.key(entry)) as fh:
        actual = checksum_stream(fh, entry.checksum, progress)
    check(where, actual, entry.checksum)


def _check_rows(snap: Snapshot, entry: FileEntry, rows_of_calls: dict[str, pa.ipc.RecordBatchFileReader]) -> None:
    where = snap.where(entry)
    reader = snap.open_rows(entry, verify=False)  # bytes were just checked
    # Gym's digest is the rule from token-row file version 2 on; version 1 files held this
    # project's own earlier hash in that column, which no reader can check against Gym's.
    gym_digests = entry.kind == "token_capture_rows" and file_version(entry.kind, reader.schema, where) >= 2
    total = 0
    for i in range(reader.num_record_batches):
        try:
            batch = reader.get_batch(i)
            batch.validate(full=True)
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptSnapshotError(f"{where}: record batch {i} is invalid: {exc}") from None
        batch = upgrade(entry.kind, batch, f"{where}: batch {i}")
        validate_batch(entry.kind, batch, f"{where}: batch {i}")
        if gym_digests:
            check_digests(batch, f"{where}: batch {i}")
        total += batch.num_rows
    if total != entry.records:
        raise CorruptSnapshotError(f"{where}: has {total} rows, the manifest says {entry.records}")
    if entry.kind == "token_capture_rows":
        rows_of_calls[entry.path] = reader


def _check_records(snap: Snapshot, entry: FileEntry, token_index: list) -> None:
    where = snap.where(entry)
    n = 0
    for rec in snap.iter_records(entry, verify=False):
        n += 1
        if entry.kind == "token_index":
            token_index.append((entry, n, rec))
    if n != entry.records:
        raise CorruptSnapshotError(f"{where}: has {n} records, the manifest says {entry.records}")


def _check_gym_file(snap: Snapshot, entry: FileEntry) -> None:
    """A file Gym wrote (``gym_file``): its records, counted as the adopter counted them (members of
    a ``.tar``, non-blank lines of a ``.jsonl``, else 1). Gym's own digests were checked when the
    part was adopted; the checksum just checked binds these same bytes."""
    where = snap.where(entry)
    name = entry.path.rsplit("/", 1)[-1]
    members = lines = None
    with snap.store.open_read(snap.key(entry)) as fh:
        if name.endswith(".tar"):
            try:
                with tarfile.open(fileobj=fh, mode="r:") as tf:
                    members = len(tf.getmembers())
            except (tarfile.TarError, OSError, EOFError) as exc:
                raise CorruptSnapshotError(f"{where}: not a readable tar archive ({exc})") from None
        elif name.endswith(".jsonl"):
            lines = sum(1 for line in fh if line.strip())
    counted = count_records(name, lines, members)
    if counted != entry.records:
        raise CorruptSnapshotError(f"{where}: has {counted} records, the manifest says {entry.records}")


def _check_token_index(snap: Snapshot, token_index: list, readers: dict, problems: list[Problem]) -> None:
    kinds = {f.path: f.kind for f in snap.manifest.files}
    broken = {p.file for p in problems}
    skipped: dict[tuple[str, str], int] = {}
    for entry, line, rec in token_index:
        where = f"{snap.where(entry)}: line {line}"
        reader = readers.get(rec.file)
        if reader is None and rec.file in broken:  # already reported; one line, not one per entry
            skipped[(entry.path, rec.file)] = skipped.get((entry.path, rec.file), 0) + 1
            continue
        if reader is None:
            what = "is not in the manifest" if rec.file not in kinds else f"is a {kinds[rec.file]} part, not a valid token-capture part"
            problems.append(Problem(entry.path, f"{where}: file {rec.file!r} {what}"))
            continue
        if rec.batch >= reader.num_record_batches:
            problems.append(Problem(entry.path, f"{where}: batch {rec.batch} does not exist in {rec.file} ({reader.num_record_batches} batches)"))
            continue
        batch = reader.get_batch(rec.batch)
        if rec.row_start + rec.row_count > batch.num_rows:
            problems.append(Problem(entry.path, f"{where}: rows {rec.row_start}..{rec.row_start + rec.row_count - 1} exceed batch {rec.batch} of {rec.file} ({batch.num_rows} rows)"))
            continue
        rows = batch.slice(rec.row_start, rec.row_count)
        calls = set(rows.column("model_call_id").to_pylist())
        keys = set(rows.column("capture_key").to_pylist())
        if calls != {rec.model_call_id} or keys != {rec.capture_key}:
            problems.append(Problem(entry.path, f"{where}: rows hold calls {sorted(calls)} of {sorted(keys)}, the index says {rec.model_call_id!r} of {rec.capture_key!r}"))
    for (index_path, target), n in skipped.items():
        problems.append(Problem(index_path, f"{snap.store.display(snap.key(next(f for f in snap.manifest.files if f.path == index_path)))}: "
                                            f"{n} entries point into {target!r}, which failed verification"))


def verify_snapshot(snap: Snapshot, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every file of ``snap``; ``progress(n)`` is called with each n bytes hashed."""
    problems: list[Problem] = []
    readers: dict[str, pa.ipc.RecordBatchFileReader] = {}
    token_index: list = []
    checked_bytes = 0
    for entry in snap.manifest.files:
        try:
            _check_bytes(snap, entry, progress)
            checked_bytes += entry.size
            storage = storage_of(entry.kind)
            if storage == "rows":
                _check_rows(snap, entry, readers)
            elif storage in ("jsonl", "json") and entry.kind in RECORD_TYPES:
                _check_records(snap, entry, token_index)
            elif storage == "gym":
                _check_gym_file(snap, entry)
        except SnapshotError as exc:
            problems.append(Problem(entry.path, str(exc)))
    _check_token_index(snap, token_index, readers, problems)
    return VerifyReport(snap.url, snap.sequence, len(snap.manifest.files), checked_bytes, problems)


__all__ = ["Problem", "VerifyReport", "verify_snapshot"]
