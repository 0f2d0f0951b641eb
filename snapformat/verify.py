"""``verify``: check every byte of a snapshot and every cross-reference, and report each problem.

Per file: present, size, checksum over all bytes, then parsed by kind (row schema, row rules,
batch and row counts, Gym's digest of every token-capture row whose prompt is whole; every JSON
line decoded; line counts; Gym's own files: their record counts). Across files: every token-index
entry names a token-capture part of this snapshot, a batch and a row range inside it, and those
rows belong to that model call. Problems are collected, not raised, so one run names them all.

A shared object (SPEC §14.2) is checked like any file, and its name too: bytes that do not hash to
the name are a damaged object, never trusted because of the name. :func:`verify_store` checks every
snapshot of a store and hashes (and parses) each object once, however many snapshots name it; a
damaged or missing object is reported once with every snapshot and file that names it.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable

import msgspec
import pyarrow as pa

from schemas.errors import CorruptSnapshotError, NotPublishedError, SnapshotError
from schemas.manifest import FileEntry
from schemas.rows import file_version, upgrade, validate_batch
from snapformat import discovery, layout
from snapformat.checksum import check, checksum_stream
from snapformat.gym_dir import count_records
from snapformat.kinds import RECORD_TYPES, storage_of
from snapformat.objects import ALGORITHM as OBJECT_ALGORITHM
from snapformat.reader import Snapshot, load_manifest
from snapformat.store import Store
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


class ObjectState(msgspec.Struct, frozen=True):
    """What hashing one shared object found: its size, and what is wrong with it (None: its bytes
    hash to its name)."""

    size: int | None  # None: missing
    problem: str | None


class ObjectChecks:
    """Shared objects already checked in this run, so that each is hashed (and a row object's rows
    parsed) once: filled by :func:`verify_store`, or as :func:`verify_snapshot` goes."""

    def __init__(self) -> None:
        self.states: dict[str, ObjectState] = {}
        #: (object, kind) -> (rows, record batches) of a row object whose rows passed every check
        self.rows: dict[tuple[str, str], tuple[int, int]] = {}


def hash_object(store: Store, name: str, size: int, progress: Callable[[int], None] | None = None) -> ObjectState:
    """Hash the object ``name`` (``sha256:<hex>``), which its entries say holds ``size`` bytes, and
    say what is wrong with it: missing, unreadable, or bytes that do not hash to its name (shorter or
    longer than ``size``: truncated or grown; else damaged)."""
    key = layout.object_key(name)
    try:
        held = store.info(key).size
        with store.open_read(key) as fh:
            actual = checksum_stream(fh, f"{OBJECT_ALGORITHM}:", progress)
    except FileNotFoundError:
        return ObjectState(None, "missing")
    except SnapshotError as exc:
        return ObjectState(None, f"cannot be read ({exc})")
    if actual == name:
        return ObjectState(held, None)
    what = "truncated" if held < size else "grown" if held > size else "damaged"
    return ObjectState(held, f"{what}: its {held} bytes (the manifest says {size}) hash to {actual}, not to its name")


def _check_object(snap: Snapshot, entry: FileEntry, progress: Callable[[int], None] | None,
                  objects: ObjectChecks) -> None:
    """An object entry's bytes: hashed once per run (``objects`` remembers), then its size checked."""
    name = entry.object or ""
    state = objects.states.get(name)
    if state is None:
        state = objects.states[name] = hash_object(snap.store, name, entry.size, progress)
    if state.problem is not None:
        raise CorruptSnapshotError(f"{snap.where(entry)}: {state.problem}")
    if state.size != entry.size:
        raise CorruptSnapshotError(f"{snap.where(entry)}: size is {state.size} bytes, the manifest says {entry.size}")


def _check_bytes(snap: Snapshot, entry: FileEntry, progress: Callable[[int], None] | None,
                 objects: ObjectChecks) -> None:
    if entry.object is not None:
        _check_object(snap, entry, progress, objects)
        return
    where = snap.where(entry)
    snap.check_present(entry)
    with snap.store.open_read(snap.key(entry)) as fh:
        actual = checksum_stream(fh, entry.checksum, progress)
    check(where, actual, entry.checksum)


def _check_rows(snap: Snapshot, entry: FileEntry, rows_of_calls: dict[str, pa.ipc.RecordBatchFileReader],
                objects: ObjectChecks) -> None:
    where = snap.where(entry)
    cached = (entry.object, entry.kind) if entry.object is not None else None
    known = objects.rows.get(cached) if cached is not None else None
    if known is not None and entry.kind != "token_capture_rows":  # an object whose rows passed: not read again
        total, batches = known
        if entry.batches is not None and batches != entry.batches:
            raise CorruptSnapshotError(f"{where}: has {batches} record batches, the manifest says {entry.batches}")
        _check_row_count(entry, total, where)
        return
    reader = snap.open_rows(entry, verify=False)  # bytes were just checked
    if known is None:
        total = _validate_rows(entry, reader, where)
        if cached is not None:
            objects.rows[cached] = (total, reader.num_record_batches)
    else:
        total = known[0]
    _check_row_count(entry, total, where)
    if entry.kind == "token_capture_rows":
        rows_of_calls[entry.path] = reader


def _validate_rows(entry: FileEntry, reader: pa.ipc.RecordBatchFileReader, where: str) -> int:
    """Every batch of a row file valid and following the kind's rules; returns the rows counted."""
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
    return total


def _check_row_count(entry: FileEntry, total: int, where: str) -> None:
    if entry.row_range is not None:  # a shared object of which this snapshot holds some rows
        if total < entry.row_range[1]:
            raise CorruptSnapshotError(f"{where}: has {total} rows, the manifest's row_range "
                                       f"[{entry.row_range[0]}, {entry.row_range[1]}) needs at least {entry.row_range[1]}")
    elif total != entry.records:
        raise CorruptSnapshotError(f"{where}: has {total} rows, the manifest says {entry.records}")


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


def verify_snapshot(snap: Snapshot, progress: Callable[[int], None] | None = None,
                    objects: ObjectChecks | None = None) -> VerifyReport:
    """Check every file of ``snap``; ``progress(n)`` is called with each n bytes hashed.

    ``objects`` holds the shared objects already checked in this run (:func:`verify_store`): they
    are not hashed again. An object named by several entries is hashed once either way.
    """
    objects = ObjectChecks() if objects is None else objects
    problems: list[Problem] = []
    readers: dict[str, pa.ipc.RecordBatchFileReader] = {}
    token_index: list = []
    files_checked = checked_bytes = 0

    def check_one(entry: FileEntry) -> None:
        nonlocal files_checked, checked_bytes
        files_checked += 1
        try:
            _check_bytes(snap, entry, progress, objects)
            checked_bytes += entry.size
            storage = storage_of(entry.kind)
            if storage == "rows":
                _check_rows(snap, entry, readers, objects)
            elif storage in ("jsonl", "json") and entry.kind in RECORD_TYPES:
                _check_records(snap, entry, token_index)
            elif storage == "gym":
                _check_gym_file(snap, entry)
        except SnapshotError as exc:
            problems.append(Problem(entry.path, str(exc)))

    suffix = "/" + layout.PART_MANIFEST_NAME
    for entry in snap.manifest.files:
        prefix = entry.path[: -len(suffix)] if entry.kind == "part_manifest" else ""
        if not (prefix and snap.is_listed(prefix)):
            check_one(entry)
            continue
        # A listed part (SPEC §10.4): part_files reads its part manifest once, size and checksum checked,
        # then its own rules. One that fails is one problem, named by the part manifest, and the files
        # only it would list are not checked.
        files_checked += 1
        try:
            files = snap.part_files(prefix)
        except SnapshotError as exc:
            problems.append(Problem(entry.path, str(exc)))
            continue
        checked_bytes += entry.size
        if progress is not None:
            progress(entry.size)
        for f in files:
            check_one(f)
    _check_token_index(snap, token_index, readers, problems)
    return VerifyReport(snap.url, snap.sequence, files_checked, checked_bytes, problems)


class ObjectReference(msgspec.Struct, frozen=True):
    """One file of one snapshot that names a shared object."""

    snapshot: str  # the snapshot's location
    sequence: int
    file: str  # the entry's path in that snapshot


class ObjectProblem(msgspec.Struct, frozen=True):
    """A shared object that is missing, damaged or unreadable, with every file that names it."""

    object: str  # sha256:<hex>
    location: str  # where it is (or should be) in the store
    message: str
    referenced_by: list[ObjectReference]


class StoreVerifyReport(msgspec.Struct, frozen=True):
    """:func:`verify_store`'s findings: each snapshot's report, and each bad object once."""

    store: str
    snapshots: list[VerifyReport]  # newest first
    objects_checked: int
    object_bytes_checked: int
    object_problems: list[ObjectProblem]
    problems: list[Problem]  # commits or manifests that cannot be read (``file`` names the commit record)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.object_problems and all(r.ok for r in self.snapshots)


def verify_store(store: Store, progress: Callable[[int], None] | None = None,
                 opened: tuple[list[Snapshot], list[Problem]] | None = None) -> StoreVerifyReport:
    """Check every published snapshot of ``store``, hashing each shared object once, and name every
    snapshot and file that references a bad object. ``opened`` is what :func:`open_all` returned,
    when the caller opened the snapshots already (to size a progress bar).

    ``progress(n)`` is called with each n bytes hashed. A commit record or manifest that cannot be
    read is a problem of its own (the snapshot is skipped); a bad object is reported once in
    ``object_problems`` and in the report of each snapshot that names it.
    """
    snapshots, problems = open_all(store) if opened is None else opened
    users: dict[str, list[ObjectReference]] = {}
    sizes: dict[str, int] = {}
    for snap in snapshots:
        for f in snap.manifest.files:
            if f.object is not None:
                users.setdefault(f.object, []).append(ObjectReference(snap.url, snap.sequence, f.path))
                sizes.setdefault(f.object, f.size)
    objects = ObjectChecks()
    for name in users:  # each once, before any snapshot is checked
        objects.states[name] = hash_object(store, name, sizes[name], progress)
    reports = [verify_snapshot(snap, progress, objects) for snap in snapshots]
    object_problems = [
        ObjectProblem(name, store.display(layout.object_key(name)), state.problem, users[name])
        for name, state in objects.states.items() if state.problem is not None
    ]
    object_bytes = sum(s.size or 0 for s in objects.states.values())
    return StoreVerifyReport(store.url, reports, len(objects.states), object_bytes, object_problems, problems)


def open_all(store: Store) -> tuple[list[Snapshot], list[Problem]]:
    """Every published snapshot of ``store``, newest first, and a problem for each whose commit
    record or manifest cannot be read."""
    snapshots: list[Snapshot] = []
    problems: list[Problem] = []
    for seq in discovery.committed_sequences(store):
        where = store.display(layout.commit_key(seq))
        try:
            commit = discovery.read_commit(store, seq)
            snapshots.append(Snapshot(store, commit, load_manifest(store, commit)))
        except NotPublishedError:
            continue  # deleted since the listing (retention)
        except SnapshotError as exc:
            problems.append(Problem(where, str(exc)))
    return snapshots, problems


def describe(problem: ObjectProblem) -> str:
    """One line naming a bad object and every snapshot and file that references it."""
    names = "; ".join(f"{r.snapshot} (sequence {r.sequence}) as {r.file}" for r in problem.referenced_by)
    return f"{problem.location}: {problem.message}; referenced by {names}"


__all__ = ["ObjectChecks", "ObjectProblem", "ObjectReference", "ObjectState", "Problem", "StoreVerifyReport",
           "VerifyReport", "describe", "hash_object", "open_all", "verify_snapshot", "verify_store"]
