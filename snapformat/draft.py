"""Writing an unpublished snapshot: a draft owned by the publisher, and part writers.

A draft is the folder ``snapshots/<snapshot_id>/``. No reader looks there until a commit record
names it, so writers stream files straight to their final keys (no rename, which an object store
cannot do atomically). Each participant writes only under its own prefix through a
:class:`PartWriter`, which ends by writing ``<prefix>/part-manifest.json`` (its files, sizes,
record counts and checksums) and returns a :class:`PartReceipt`; the publisher collects receipts,
checks them, and publishes (see ``publish.py``).
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import pyarrow as pa

from schemas.errors import InvalidPathError, InvalidRecordError
from schemas.identity import check_relative_path
from schemas.manifest import FileEntry, ParentRef, PartManifest, PartReceipt
from schemas.version import FORMAT_VERSION
from snapformat import jsonl, layout
from snapformat.arrow_parts import RowsWriter
from snapformat.checksum import HashingWriter, checksum_bytes
from snapformat.kinds import RECORD_TYPES, storage_of
from snapformat.objects import ALGORITHM as OBJECT_ALGORITHM
from snapformat.objects import put_object
from snapformat.store import Store, open_store


class PartWriter:
    """Writes one participant's files under ``prefix`` of a draft. Not thread-safe.

    Every file is durable when its write call returns. ``close()`` writes the part manifest and
    returns the receipt; a writer that is never closed leaves files no manifest lists, which GC
    removes with the draft if the snapshot is never published.
    """

    def __init__(self, store: Store, snapshot_id: str, prefix: str, writer: str | None = None) -> None:
        self.store = store
        self.snapshot_id = layout.check_snapshot_id(snapshot_id)
        self.prefix = check_relative_path(prefix, where="part prefix")
        self.writer = writer or prefix
        self._files: list[FileEntry] = []
        self._receipt: PartReceipt | None = None

    def _rel(self, name: str) -> str:
        rel = check_relative_path(f"{self.prefix}/{name}", where="file name")
        if rel.rsplit("/", 1)[-1] == layout.PART_MANIFEST_NAME or any(f.path == rel for f in self._files):
            raise InvalidPathError(f"{self.where(rel)}: already written or reserved")
        if self._receipt is not None:
            raise InvalidRecordError(f"{self.where(rel)}: part {self.prefix!r} is already closed")
        return rel

    def where(self, rel: str) -> str:
        return self.store.display(layout.file_key(self.snapshot_id, rel))

    def _open(self, rel: str):
        try:
            return self.store.open_write(layout.file_key(self.snapshot_id, rel))
        except FileExistsError:
            # Another writer of this prefix (or an earlier run of this one) wrote it: one writer per file.
            raise InvalidPathError(
                f"{self.where(rel)}: already exists (each file of a snapshot has one writer)") from None

    def rows(self, name: str, kind: str, compression: str = "none") -> _RowsFile:
        """A streaming writer for an Arrow row part: ``with part.rows(...) as w: w.write(batch)``."""
        rel = self._rel(name)
        return _RowsFile(self, rel, kind, compression)

    def write_rows(self, name: str, kind: str,
                   data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch | pa.Table],
                   compression: str = "none") -> FileEntry:
        """Write a whole row part (a table, a batch or an iterable of them, streamed)."""
        with self.rows(name, kind, compression) as w:
            if isinstance(data, (pa.Table, pa.RecordBatch)):
                data = [data]
            for item in data:
                w.write(item)
                del item  # a generator's next batch is built while this name still holds the last one
        return w.entry

    def write_rows_object(self, name: str, kind: str,
                          data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch | pa.Table],
                          compression: str = "none") -> FileEntry:
        """Write a row part as a shared object (format 1.3, SPEC §14.2) and list it as ``name``.

        The file is built in memory (a segment: its writer bounds its size), checked by the same
        row rules as :meth:`write_rows`, named by its SHA-256 and written create-only under
        ``objects/`` (:func:`snapformat.objects.put_object`); a later snapshot lists it again with
        :meth:`reference` without writing it. Durable when this returns.
        """
        rel = self._rel(name)
        sink = io.BytesIO()
        writer = RowsWriter(sink, kind, self.where(rel), compression, algorithm=OBJECT_ALGORITHM)
        try:
            for item in [data] if isinstance(data, (pa.Table, pa.RecordBatch)) else data:
                writer.write(item)
                del item
            size, checksum = writer.finish()
        except BaseException:
            writer.abort()
            raise
        put_object(self.store, sink.getvalue(), name=checksum)
        entry = FileEntry(path=rel, kind=kind, size=size, checksum=checksum, records=writer.records,
                          batches=writer.batches, writer=self.writer, object=checksum)
        self._files.append(entry)
        return entry

    def reference(self, entry: FileEntry, name: str | None = None,
                  row_range: tuple[int, int] | None = None) -> FileEntry:
        """List in this part a shared object an earlier snapshot wrote, without writing it.

        ``entry`` is the object's entry in the draft's parent manifest (SPEC §14.2, writer rule 3:
        a draft references only objects its parent lists or it wrote itself). ``name`` is the file's
        name under this part's prefix (by default the name ``entry`` had under it). ``row_range``
        (row parts only) narrows the rows this snapshot holds to ``[start, stop)`` of the object's
        rows, within those ``entry`` held: rows that are gone from the data plane stop being listed
        without the object being written again.
        """
        if entry.object is None:
            raise InvalidRecordError(f"{entry.path}: names no shared object; only an object can be referenced")
        if name is None:
            if not entry.path.startswith(self.prefix + "/"):
                raise InvalidPathError(f"{entry.path}: lies outside part {self.prefix!r}; give it a name here")
            name = entry.path[len(self.prefix) + 1:]
        rel = self._rel(name)
        records = entry.records
        if row_range is not None:
            start, stop = row_range
            low, high = entry.row_range if entry.row_range is not None else (0, entry.records)
            if storage_of(entry.kind) != "rows":
                raise InvalidRecordError(f"{self.where(rel)}: a row range needs a row part, not {entry.kind!r}")
            if not low <= start <= stop <= high:
                raise InvalidRecordError(
                    f"{self.where(rel)}: row range [{start}, {stop}) is not within the rows [{low}, {high}) "
                    f"the referenced entry holds")
            records = stop - start
            if entry.row_range is None and (start, stop) == (0, entry.records):
                row_range = None
        else:
            row_range = entry.row_range
        ref = msgspec.structs.replace(entry, path=rel, records=records, row_range=row_range, writer=self.writer)
        self._files.append(ref)
        return ref

    def write_records(self, name: str, kind: str, records: Iterable[Any], compress: str = "auto") -> FileEntry:
        """Write a JSON-lines part of ``kind``; ``name`` gets ``.jsonl`` or ``.jsonl.zst``."""
        if storage_of(kind) != "jsonl":
            raise InvalidRecordError(f"{kind!r} is not a JSON-lines kind")
        record_type = RECORD_TYPES[kind]
        stem = self._rel(name)
        chosen: dict[str, str] = {}

        def checked(items: Iterable[Any]) -> Iterable[Any]:
            for i, rec in enumerate(items):
                if not _is_instance(rec, record_type):
                    raise InvalidRecordError(
                        f"{self.where(stem)}: record {i} is a {type(rec).__name__}, expected {kind} record")
                yield rec

        def open_file(compression: str):
            rel = self._rel(name + (".jsonl.zst" if compression == "zstd" else ".jsonl"))
            chosen["rel"] = rel
            chosen["raw"] = self._open(rel)
            chosen["sink"] = HashingWriter(chosen["raw"])
            return chosen["sink"]

        try:
            written = jsonl.write_lines(open_file, checked(records), compress)
        except BaseException:
            if "raw" in chosen:
                _abort(chosen["raw"])
            raise
        chosen["raw"].close()
        sink: HashingWriter = chosen["sink"]  # type: ignore[assignment]
        entry = FileEntry(
            path=chosen["rel"], kind=kind, size=sink.size, checksum=sink.checksum, records=written.records,
            compression=written.compression,  # type: ignore[arg-type]
            content_size=written.content_size if written.compression == "zstd" else None,
            writer=self.writer,
        )
        self._files.append(entry)
        return entry

    def write_json(self, name: str, kind: str, record: Any) -> FileEntry:
        """Write a single-document JSON part (``loader_place``) as ``name.json``."""
        if storage_of(kind) != "json" or kind == "part_manifest":
            raise InvalidRecordError(f"{kind!r} is not a single-document JSON kind")
        if not _is_instance(record, RECORD_TYPES[kind]):
            raise InvalidRecordError(f"{kind}: expected a {RECORD_TYPES[kind].__name__}, got {type(record).__name__}")
        rel = self._rel(name + ".json")
        entry = self._write_small(rel, kind, jsonl.encode_json(record))
        self._files.append(entry)
        return entry

    def _write_small(self, rel: str, kind: str, data: bytes) -> FileEntry:
        with self._open(rel) as fh:
            fh.write(data)
        return FileEntry(path=rel, kind=kind, size=len(data), checksum=checksum_bytes(data), records=1,
                         writer=self.writer)

    def close(self) -> PartReceipt:
        """Write ``part-manifest.json`` and return the receipt (idempotent)."""
        if self._receipt is None:
            part = PartManifest(format_version=FORMAT_VERSION, snapshot_id=self.snapshot_id, prefix=self.prefix,
                                writer=self.writer, files=list(self._files), written_at=time.time())
            data = jsonl.encode_json(part)
            rel = f"{self.prefix}/{layout.PART_MANIFEST_NAME}"
            self._write_small(rel, "part_manifest", data)
            self._receipt = PartReceipt(prefix=self.prefix, writer=self.writer,
                                        part_manifest_checksum=checksum_bytes(data))
        return self._receipt

    @property
    def files(self) -> list[FileEntry]:
        return list(self._files)


class _RowsFile:
    """Context manager around :class:`RowsWriter` that records the finished file's entry."""

    def __init__(self, part: PartWriter, rel: str, kind: str, compression: str) -> None:
        self._part = part
        self._rel = rel
        self._raw = part._open(rel)
        try:
            self._w = RowsWriter(self._raw, kind, part.where(rel), compression)
        except BaseException:
            _abort(self._raw)
            raise
        self.entry: FileEntry | None = None

    def write(self, data: pa.RecordBatch | pa.Table) -> None:
        self._w.write(data)

    def __enter__(self) -> _RowsFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._w.abort()
            _abort(self._raw)
            return
        try:
            size, checksum = self._w.finish()
            self._raw.close()
        except BaseException:
            self._w.abort()
            _abort(self._raw)
            raise
        self.entry = FileEntry(path=self._rel, kind=self._w.kind, size=size, checksum=checksum,
                               records=self._w.records, batches=self._w.batches, writer=self._part.writer)
        self._part._files.append(self.entry)


def _abort(raw) -> None:
    abort = getattr(raw, "abort", None)
    if abort is not None:
        abort()
    else:
        raw.close()


def _is_instance(rec: Any, record_type: Any) -> bool:
    return isinstance(rec, _classes(record_type))


@functools.lru_cache(maxsize=64)
def _classes(record_type: Any) -> type | tuple[type, ...]:
    """The classes a record of ``record_type`` (a struct, a union, or either ``Annotated``) may be:
    resolved once per type, since a part checks every one of its records (a replay index holds one
    per row the data plane holds)."""
    args = getattr(record_type, "__metadata__", None) and getattr(record_type, "__origin__", None)
    if args is not None:  # Annotated[Union, Meta]
        record_type = record_type.__origin__
    members = getattr(record_type, "__args__", None)
    return tuple(members) if members else record_type


class SnapshotDraft:
    """An unpublished snapshot, owned by its publisher (the Single Controller or a script).

    Get one from :meth:`snapformat.SnapshotStore.begin`. Hand :attr:`url` to other processes: they
    open their own part with :func:`attach_part` and send back the :class:`PartReceipt`.
    """

    def __init__(self, store: Store, snapshot_id: str, sequence: int, created_at: float,
                 parent: ParentRef | None) -> None:
        self.store = store
        self.snapshot_id = snapshot_id
        self.sequence = sequence
        self.created_at = created_at
        self.parent = parent
        self._parts: dict[str, tuple[PartManifest, str]] = {}  # prefix -> (part, its checksum)
        self._local_parts: list[PartWriter] = []
        self._published = False

    @property
    def url(self) -> str:
        """The draft's location; the same path ``ls`` prints once it is published."""
        return self.store.display(layout.snapshot_dir(self.snapshot_id))

    def part(self, prefix: str, writer: str | None = None) -> PartWriter:
        """A writer for a part written in this process (added on publish via its receipt)."""
        self._check_prefix(prefix)
        for other in self._local_parts:
            self._check_overlap(prefix, other.prefix)
        pw = PartWriter(self.store, self.snapshot_id, prefix, writer)
        self._local_parts.append(pw)
        return pw

    def _check_prefix(self, prefix: str) -> None:
        check_relative_path(prefix, where="part prefix")
        if prefix.split("/", 1)[0] in (layout.MANIFEST_NAME, layout.HEARTBEAT_NAME):
            raise InvalidPathError(f"part prefix {prefix!r} is reserved (the draft's own files)")
        for other in self._parts:
            self._check_overlap(prefix, other)

    @staticmethod
    def _check_overlap(prefix: str, other: str) -> None:
        if prefix == other or prefix.startswith(other + "/") or other.startswith(prefix + "/"):
            raise InvalidPathError(f"part prefix {prefix!r} overlaps part {other!r} (each file has one writer)")

    def close_local_parts(self) -> None:
        """Close the parts written in this process and add them (publish does this)."""
        for pw in self._local_parts:
            receipt = pw.close()
            self.add_part(receipt)

    def add_part(self, receipt: PartReceipt) -> PartManifest:
        """Read, check and remember a participant's part manifest (by its receipt)."""
        from snapformat.publish import load_part  # one direction: publish knows drafts' parts

        if receipt.prefix in self._parts:
            part, checksum = self._parts[receipt.prefix]
            if checksum != receipt.part_manifest_checksum:
                raise InvalidPathError(f"{self.url}: part {receipt.prefix!r} was already added with part manifest "
                                       f"{checksum}; a second receipt names {receipt.part_manifest_checksum}")
            return part
        self._check_prefix(receipt.prefix)
        part = load_part(self.store, self.snapshot_id, receipt)
        self._parts[receipt.prefix] = (part, receipt.part_manifest_checksum)
        return part

    @property
    def parts(self) -> list[tuple[PartManifest, str]]:
        """Each added part with the checksum of its part manifest."""
        return list(self._parts.values())

    def touch(self) -> None:
        """Refresh the draft's age so GC never takes a long-running writer's draft for a leftover."""
        key = f"{layout.snapshot_dir(self.snapshot_id)}/{layout.HEARTBEAT_NAME}"
        self.store.put_bytes(key, msgspec.json.encode({"at": time.time()}))

    def publish(self, **kwargs: Any):
        """Publish: see :func:`snapformat.publish.publish` for the steps and arguments."""
        from snapformat.publish import publish

        if self._published:
            raise InvalidRecordError(f"{self.url}: already published")
        result = publish(self, **kwargs)
        self._published = True
        return result

    def abandon(self) -> None:
        """Delete the draft's files (best effort); nothing was ever visible to readers."""
        self.store.delete_tree(layout.snapshot_dir(self.snapshot_id))


def attach_part(draft_url: str, prefix: str, writer: str | None = None) -> PartWriter:
    """Open a part writer on a draft given its URL (as :attr:`SnapshotDraft.url`)."""
    store_url, snapshot_id = layout.split_snapshot_url(draft_url)
    return PartWriter(open_store(store_url), snapshot_id, prefix, writer)
