"""Reading a published snapshot: the manifest checked against its commit, then any part.

Every read checks the file's size; reads check the checksum too unless ``verify=False``
(memory-mapped row parts are hashed in place on a second thread while their batches are checked
behind it: :func:`snapformat.arrow_parts.open_buffer`). Errors are typed and name the file.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

import pyarrow as pa

from schemas.errors import CorruptSnapshotError, InvalidPathError, InvalidRecordError, NotPublishedError
from schemas.gym_records import TokenIndexEntry
from schemas.identity import check_relative_path
from schemas.manifest import CommitRecord, FileEntry, ListedPart, Manifest, PartManifest
from schemas.version import PART_LISTINGS, SHARED_OBJECTS, check_readable
from snapformat import discovery, jsonl, layout
from snapformat.arrow_parts import open_buffer
from snapformat.checksum import check, checksum_bytes
from snapformat.kinds import ALIASES, GYM_FILE_KIND, RECORD_TYPES, storage_of
from snapformat.store import Store, open_store

MAX_MANIFEST_BYTES = 256 << 20
MAX_JSON_PART_BYTES = 64 << 20


def load_manifest(store: Store, commit: CommitRecord) -> Manifest:
    """Read ``manifest.json`` of a committed snapshot and check it against the commit record."""
    key = f"{layout.snapshot_dir(commit.snapshot_id)}/{layout.MANIFEST_NAME}"
    where = store.display(key)
    # A mismatch may be the commit record's fault (it has no checksum of its own): name it too.
    commit_where = store.display(layout.commit_key(commit.sequence))
    if commit.manifest_size > MAX_MANIFEST_BYTES:
        raise CorruptSnapshotError(f"{where}: manifest of {commit.manifest_size} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        data = store.read_bytes(key, limit=commit.manifest_size)
    except FileNotFoundError:
        raise CorruptSnapshotError(
            f"{where}: missing, but {commit_where} commits it as sequence {commit.sequence}") from None
    if len(data) != commit.manifest_size:
        size = f"more than {commit.manifest_size}" if len(data) > commit.manifest_size else f"{len(data)}"
        raise CorruptSnapshotError(
            f"{where}: size is {size} bytes, the commit record {commit_where} says {commit.manifest_size}")
    actual = checksum_bytes(data, commit.manifest_checksum.partition(":")[0])
    if actual != commit.manifest_checksum:
        raise CorruptSnapshotError(
            f"{where}: checksum mismatch (the commit record {commit_where} says {commit.manifest_checksum}, "
            f"file has {actual})")
    manifest = jsonl.decode_json(data, Manifest, where)
    check_readable(manifest.format_version, manifest.required_features, where)
    if manifest.snapshot_id != commit.snapshot_id or manifest.sequence != commit.sequence:
        raise CorruptSnapshotError(
            f"{where}: is snapshot {manifest.snapshot_id!r} sequence {manifest.sequence}, the commit record "
            f"{commit_where} names {commit.snapshot_id!r} sequence {commit.sequence}")
    seen: set[str] = set()
    for i, f in enumerate(manifest.files):
        check_entry(f, f"{where}: files[{i}]")
        if f.path in seen:
            raise CorruptSnapshotError(f"{where}: files[{i}].path {f.path!r} is listed twice")
        seen.add(f.path)
    if any(f.object is not None for f in manifest.files) and SHARED_OBJECTS not in manifest.required_features:
        raise CorruptSnapshotError(
            f"{where}: names shared objects but does not list {SHARED_OBJECTS!r} in required_features")
    check_listed_parts(manifest, where)
    return manifest


def check_listed_parts(manifest: Manifest, where: str) -> None:
    """The manifest's ``listed_parts`` against its ``files`` (SPEC §10.4): the feature listed when
    there are any; each prefix a safe path, once, under no other listed prefix; its part manifest
    listed with kind ``part_manifest``, and no other file under it."""
    if not manifest.listed_parts:
        return
    if PART_LISTINGS not in manifest.required_features:
        raise CorruptSnapshotError(
            f"{where}: lists parts by their part manifests but does not list {PART_LISTINGS!r} in required_features")
    prefixes: set[str] = set()
    for i, part in enumerate(manifest.listed_parts):
        check_relative_path(part.prefix, where=f"{where}: listed_parts[{i}].prefix")
        if part.prefix in prefixes:
            raise CorruptSnapshotError(f"{where}: listed_parts[{i}].prefix {part.prefix!r} is listed twice")
        prefixes.add(part.prefix)
    for i, part in enumerate(manifest.listed_parts):
        outer = enclosing_prefix(part.prefix, prefixes)
        if outer is not None:
            raise CorruptSnapshotError(
                f"{where}: listed_parts[{i}].prefix {part.prefix!r} lies under the listed part {outer!r}")
    part_manifests = {f"{p}/{layout.PART_MANIFEST_NAME}" for p in prefixes}
    for i, f in enumerate(manifest.files):
        if f.path in part_manifests:
            if f.kind != "part_manifest":
                raise CorruptSnapshotError(
                    f"{where}: files[{i}] {f.path!r} is the part manifest of a listed part, of kind {f.kind!r} "
                    f"(expected 'part_manifest')")
            part_manifests.discard(f.path)
            continue
        outer = enclosing_prefix(f.path, prefixes)
        if outer is not None:
            raise CorruptSnapshotError(
                f"{where}: files[{i}] {f.path!r} lies under the listed part {outer!r}, whose files only its part "
                f"manifest lists")
    if part_manifests:
        raise CorruptSnapshotError(
            f"{where}: listed_parts name {min(part_manifests)!r}, which files does not list")


def enclosing_prefix(path: str, prefixes: Container[str]) -> str | None:
    """The nearest of ``prefixes`` that ``path`` lies under (not ``path`` itself), if any; one set
    lookup per level of the path."""
    cut = path.rfind("/")
    while cut > 0:
        if path[:cut] in prefixes:
            return path[:cut]
        cut = path.rfind("/", 0, cut)
    return None


def check_part_manifest(part: PartManifest, snapshot_id: str, prefix: str, where: str) -> None:
    """A part manifest's own rules (SPEC §11): a readable version, written for this snapshot and
    ``prefix``; each entry follows §10.1 and lies under the prefix, other than the part manifest."""
    check_readable(part.format_version, [], where)
    if part.snapshot_id != snapshot_id or part.prefix != prefix:
        raise CorruptSnapshotError(
            f"{where}: written for snapshot {part.snapshot_id!r} prefix {part.prefix!r} (expected {snapshot_id!r} "
            f"prefix {prefix!r})")
    own = f"{prefix}/{layout.PART_MANIFEST_NAME}"
    for i, f in enumerate(part.files):
        check_entry(f, f"{where}: files[{i}]")
        if not f.path.startswith(prefix + "/") or f.path == own:
            raise InvalidPathError(f"{where}: files[{i}].path {f.path!r} (expected a file under {prefix!r} other "
                                   f"than {layout.PART_MANIFEST_NAME})")


def check_listed_part(part: PartManifest, listed: ListedPart, snapshot_id: str, where: str) -> list[FileEntry]:
    """A listed part's part manifest against the manifest's account of it (SPEC §10.4): the rules of
    every part manifest (:func:`check_part_manifest`); each entry listed once, of kind ``gym_file``,
    naming no shared object; as many files and bytes as ``listed`` says."""
    check_part_manifest(part, snapshot_id, listed.prefix, where)
    seen: set[str] = set()
    total = 0
    for i, f in enumerate(part.files):
        at = f"{where}: files[{i}]"
        if f.kind != GYM_FILE_KIND or f.object is not None:
            raise CorruptSnapshotError(
                f"{at}: kind {f.kind!r}{' naming object ' + f.object if f.object else ''} (expected {GYM_FILE_KIND!r} "
                f"in a file of the snapshot folder: a listed part holds only those)")
        if f.path in seen:
            raise CorruptSnapshotError(f"{at}.path {f.path!r} is listed twice")
        seen.add(f.path)
        total += f.size
    if (len(part.files), total) != (listed.files, listed.bytes):
        raise CorruptSnapshotError(
            f"{where}: lists {len(part.files)} files of {total} bytes, the snapshot's manifest says {listed.files} "
            f"files of {listed.bytes} bytes")
    return part.files


def check_entry(f: FileEntry, where: str) -> None:
    """One file entry's own rules: a safe path; an entry naming a shared object has that object's
    name as its checksum; a row range only on a row part naming an object, with ``start <= stop``
    and ``records == stop - start`` (SPEC §10.1, §14.2)."""
    check_relative_path(f.path, where=f"{where}.path")
    if f.object is not None and f.checksum != f.object:
        raise CorruptSnapshotError(f"{where}: checksum {f.checksum} differs from the object it names ({f.object})")
    if f.row_range is not None:
        start, stop = f.row_range
        if f.object is None or storage_of(f.kind) != "rows":
            raise CorruptSnapshotError(f"{where}: a row_range needs a row part that names a shared object")
        if start > stop or f.records != stop - start:
            raise CorruptSnapshotError(
                f"{where}: row_range [{start}, {stop}) with {f.records} records (expected start <= stop and "
                f"records == stop - start)")


def resolve_kind(part: str) -> str:
    """A kind from a user's word (``ledger``, ``tokens``...) or raise naming the choices."""
    kind = ALIASES.get(part)
    if kind is None:
        raise InvalidRecordError(f"unknown part {part!r} (expected a file path or one of {', '.join(sorted(ALIASES))})")
    return kind


class Snapshot:
    """A published snapshot. Open one with :func:`open_snapshot` or ``SnapshotStore.open``."""

    def __init__(self, store: Store, commit: CommitRecord, manifest: Manifest) -> None:
        self.store = store
        self.commit = commit
        self.manifest = manifest
        self._listed = {p.prefix: p for p in manifest.listed_parts}

    @property
    def url(self) -> str:
        return self.store.display(layout.snapshot_dir(self.manifest.snapshot_id))

    @property
    def sequence(self) -> int:
        return self.manifest.sequence

    def files(self, kind: str | None = None) -> list[FileEntry]:
        """Every file of the snapshot (of ``kind``), in manifest order: see :meth:`iter_files`."""
        return list(self.iter_files(kind))

    def iter_files(self, kind: str | None = None) -> Iterator[FileEntry]:
        """Every file of the snapshot (of ``kind``), in manifest order, a listed part's files right after
        its part manifest. A listed part's part manifest is read (size and checksum checked) only when
        its files are asked for: they are all ``gym_file`` (SPEC §10.4), so one part at a time is in
        memory however many rollouts the snapshot holds."""
        suffix = "/" + layout.PART_MANIFEST_NAME
        for f in self.manifest.files:
            if kind is None or f.kind == kind:
                yield f
            if (self._listed and f.kind == "part_manifest" and (kind is None or kind == GYM_FILE_KIND)
                    and f.path[: -len(suffix)] in self._listed):
                yield from self.part_files(f.path[: -len(suffix)])

    def is_listed(self, prefix: str) -> bool:
        """Whether the manifest lists part ``prefix`` by its part manifest only (SPEC §10.4)."""
        return prefix in self._listed

    def part_files(self, prefix: str) -> list[FileEntry]:
        """The files of part ``prefix`` except its part manifest, in its order: for a listed part its
        part manifest's entries (read and checked against the manifest: :func:`check_listed_part`),
        else the manifest's entries under the prefix. Raises :class:`NotPublishedError` for no such part."""
        listed = self._listed.get(prefix)
        own = f"{prefix}/{layout.PART_MANIFEST_NAME}"
        if listed is None:
            if not any(f.path == own for f in self.manifest.files):
                raise NotPublishedError(f"{self.url}: has no part {prefix!r}")
            return [f for f in self.manifest.files if f.path.startswith(prefix + "/") and f.path != own]
        entry = next(f for f in self.manifest.files if f.path == own)  # load_manifest checked it is there
        where = self.where(entry)
        if entry.size > MAX_JSON_PART_BYTES:
            raise CorruptSnapshotError(f"{where}: {entry.size} bytes exceeds {MAX_JSON_PART_BYTES}")
        part = jsonl.decode_json(self.read_bytes(entry), PartManifest, where)
        return check_listed_part(part, listed, self.manifest.snapshot_id, where)

    def select(self, part: str) -> list[FileEntry]:
        """Files named by ``part``: a file path of the snapshot, or a kind / alias (all of its files)."""
        for f in self.manifest.files:
            if f.path == part:
                return [f]
        listed = enclosing_prefix(part, self._listed)
        if listed is not None:
            found = [f for f in self.part_files(listed) if f.path == part]
            if found:
                return found
        return self.files(resolve_kind(part))

    def key(self, entry: FileEntry) -> str:
        """Where the file's bytes are: the shared object it names, else its path in the snapshot folder."""
        if entry.object is not None:
            return layout.object_key(entry.object)
        return layout.file_key(self.manifest.snapshot_id, entry.path)

    def where(self, entry: FileEntry) -> str:
        """The file as a user finds it: its location, and for a shared object which file it is."""
        if entry.object is not None:
            return f"{self.store.display(self.key(entry))} ({entry.path} of {self.manifest.snapshot_id})"
        return self.store.display(self.key(entry))

    def check_present(self, entry: FileEntry) -> None:
        """The file exists with the manifest's size (checked before anything is allocated for it)."""
        where = self.where(entry)
        try:
            info = self.store.info(self.key(entry))
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{where}: missing") from None
        if info.size != entry.size:
            raise CorruptSnapshotError(f"{where}: size is {info.size} bytes, the manifest says {entry.size}")

    def read_bytes(self, entry: FileEntry, verify: bool = True) -> bytes:
        """The stored bytes of one file, size (and checksum) checked."""
        where = self.where(entry)
        self.check_present(entry)
        data = self.store.read_bytes(self.key(entry), limit=entry.size)  # the file may grow after the check
        if len(data) != entry.size:
            raise CorruptSnapshotError(f"{where}: read {len(data)} bytes, the manifest says {entry.size}")
        if verify:
            check(where, checksum_bytes(data, entry.checksum.partition(":")[0]), entry.checksum)
        return data

    def open_rows(self, entry: FileEntry, verify: bool = True) -> pa.ipc.RecordBatchFileReader:
        """An Arrow file reader over a row part; memory-mapped when the store is on local disk."""
        if storage_of(entry.kind) != "rows":
            raise InvalidRecordError(f"{self.where(entry)}: kind {entry.kind!r} is not a row part")
        where = self.where(entry)
        path = self.store.local_path(self.key(entry))
        if path is not None:
            try:
                buf = pa.memory_map(path, "r")
            except FileNotFoundError:
                raise CorruptSnapshotError(f"{where}: missing") from None
            except OSError as exc:
                raise CorruptSnapshotError(f"{where}: cannot map: {exc}") from None
            buffer = buf.read_buffer()
        else:
            buffer = pa.py_buffer(self.read_bytes(entry, verify=False))
        # A row range's rows must exist: the file holds at least up to its stop (SPEC §14.2).
        ranged = entry.row_range is not None
        return open_buffer(buffer, entry.kind, where, entry.size, entry.checksum if verify else None,
                           batches=entry.batches, records=entry.row_range[1] if ranged else entry.records,
                           rows_at_least=ranged)

    def read_rows(self, entry: FileEntry, verify: bool = True) -> pa.Table:
        """The rows of one row part this snapshot holds, as one zero-copy table: every row of the
        file, or the entry's ``row_range`` of them."""
        reader = self.open_rows(entry, verify)
        try:
            table = reader.read_all()
        except (pa.ArrowException, OSError) as exc:
            raise CorruptSnapshotError(f"{self.where(entry)}: unreadable: {exc}") from None
        if entry.row_range is None:
            return table
        start, stop = entry.row_range
        if stop > table.num_rows:
            raise CorruptSnapshotError(
                f"{self.where(entry)}: row_range [{start}, {stop}) exceeds the file's {table.num_rows} rows")
        return table.slice(start, stop - start)

    def iter_batches(self, entry: FileEntry, verify: bool = True) -> Iterator[pa.RecordBatch]:
        """The record batches of the rows this snapshot holds of one row part, in order: every batch
        of the file, or the entry's ``row_range`` cut out of them (zero-copy slices). For a reader
        that streams a part batch by batch (``cat``, ``export``); :meth:`open_rows` is the whole file."""
        reader = self.open_rows(entry, verify)
        start, stop = entry.row_range if entry.row_range is not None else (0, entry.records)
        at = 0
        for i in range(reader.num_record_batches):
            if at >= stop:
                return
            try:
                batch = reader.get_batch(i)
            except (pa.ArrowException, OSError) as exc:
                raise CorruptSnapshotError(f"{self.where(entry)}: record batch {i} is unreadable: {exc}") from None
            low, high = max(start - at, 0), min(stop - at, batch.num_rows)
            at += batch.num_rows
            if high <= low:
                continue
            yield batch if (low, high) == (0, batch.num_rows) else batch.slice(low, high - low)
        if at < stop:
            raise CorruptSnapshotError(f"{self.where(entry)}: has {at} rows, the manifest needs {stop}")

    def read_table(self, part: str, verify: bool = True) -> pa.Table:
        """Every row of a row kind (all files, in manifest order) as one zero-copy table."""
        entries = self.select(part)
        tables = [self.read_rows(entry, verify) for entry in entries]
        if not tables:
            raise NotPublishedError(f"{self.url}: has no {part!r} part")
        if len(tables) == 1:
            return tables[0]
        try:
            return pa.concat_tables(tables, promote_options="default")
        except (pa.ArrowException, OSError) as exc:
            # Each file is valid alone: extra columns are free, so two files may give one name two types.
            raise InvalidRecordError(
                f"{self.url}: the {part!r} files {', '.join(e.path for e in entries)} cannot be read as one table "
                f"(expected the same type for every column they share): {exc}") from None

    def iter_records(self, part: str | FileEntry, verify: bool = True) -> Iterator[Any]:
        """Decoded records of a JSON-lines or JSON part (every file of a kind, in manifest order)."""
        entries = [part] if isinstance(part, FileEntry) else self.select(part)
        for entry in entries:
            kind = storage_of(entry.kind)
            where = self.where(entry)
            if kind == "jsonl":
                data = self.read_bytes(entry, verify)
                yield from jsonl.iter_records(data, RECORD_TYPES[entry.kind], where, entry.compression, entry.content_size)
            elif kind == "json":
                if entry.size > MAX_JSON_PART_BYTES:
                    raise CorruptSnapshotError(f"{where}: {entry.size} bytes exceeds {MAX_JSON_PART_BYTES}")
                rec = jsonl.decode_json(self.read_bytes(entry, verify), RECORD_TYPES[entry.kind], where)
                if hasattr(rec, "schema_version"):
                    from schemas.version import check_record_version

                    check_record_version(rec.schema_version, where)
                yield rec
            else:
                raise InvalidRecordError(f"{where}: kind {entry.kind!r} holds no records")

    def records(self, part: str) -> list[Any]:
        return list(self.iter_records(part))

    def token_rows(self, capture_key: str, model_call_id: str, verify: bool = True) -> pa.Table:
        """The token-capture rows of one model call, found through the token-storage index."""
        for entry in self.iter_records("token_index", verify):
            if entry.capture_key == capture_key and entry.model_call_id == model_call_id:
                target = self.select(entry.file)
                if not target or target[0].kind != "token_capture_rows":
                    raise CorruptSnapshotError(f"{self.url}: token index names {entry.file!r}, not a token-capture part")
                return self._indexed_rows(target[0], entry, verify)
        raise NotPublishedError(f"{self.url}: no token rows indexed for {capture_key!r} call {model_call_id!r}")

    def _indexed_rows(self, target: FileEntry, entry: TokenIndexEntry, verify: bool) -> pa.Table:
        """The rows a token-index entry names, refused when its batch or range lies outside the file
        (Arrow would raise an untyped error for the batch, and slice a short range silently)."""
        reader = self.open_rows(target, verify)
        where = f"{self.url}: token index entry for {entry.capture_key!r} call {entry.model_call_id!r}"
        if entry.batch >= reader.num_record_batches:
            raise CorruptSnapshotError(
                f"{where}: batch {entry.batch} does not exist in {entry.file} "
                f"(expected < {reader.num_record_batches})")
        batch = reader.get_batch(entry.batch)
        if entry.row_start + entry.row_count > batch.num_rows:
            raise CorruptSnapshotError(
                f"{where}: rows {entry.row_start}..{entry.row_start + entry.row_count - 1} exceed batch "
                f"{entry.batch} of {entry.file} (expected row_start + row_count <= {batch.num_rows})")
        return pa.Table.from_batches([batch.slice(entry.row_start, entry.row_count)])


def open_snapshot(url: str) -> Snapshot:
    """Open a published snapshot by its location (``<store>/snapshots/<snapshot_id>``)."""
    store_url, snapshot_id = layout.split_snapshot_url(url)
    store = open_store(store_url)
    m = layout.SNAPSHOT_ID_RE.match(snapshot_id)
    sequence = int(m.group(1)) if m else None
    commit = None
    if sequence is not None and sequence >= 1:
        try:
            commit = discovery.read_commit(store, sequence)
        except NotPublishedError:
            commit = None
    if commit is None or commit.snapshot_id != snapshot_id:
        raise NotPublishedError(f"{url}: not published (no commit record names this snapshot)")
    return Snapshot(store, commit, load_manifest(store, commit))


def open_sequence(store: Store, sequence: int | None = None) -> Snapshot:
    """Open the snapshot committed at ``sequence``, or the newest when ``None``."""
    if sequence is None:
        sequence = discovery.latest_sequence(store)
        if sequence is None:
            raise NotPublishedError(f"{store.url}: no published snapshot")
    commit = discovery.read_commit(store, sequence)
    return Snapshot(store, commit, load_manifest(store, commit))
