"""Gym's files in ``checkpoint_dir`` as plain files (CONTROL.md §6): write them, read them back.

A participant handed a ``checkpoint_dir`` writes only into its own folder of it::

    agent/instance-<sha256hex(utf8 name)>/   agent-part-NNNNNN.tar, agent-index.jsonl,
                                             continuations.jsonl, manifest.json
    model-ledger/<server_name>/              <capture_key>.lineage.jsonl, storage-references.jsonl,
                                             manifest.json
    resources/<server_name>/                 <rid>.a<n>.json, manifest.json

A commit writes its data files together (:class:`DurableFiles`, shared with snapformat): each goes
temp -> write -> fsync -> rename, the fsyncs in parallel on a few threads, then each folder touched
is fsynced once; only then is the manifest written (temp -> fsync -> rename -> folder fsync,
:func:`atomic_write`), so a folder with a manifest is whole and a manifest is never durable before
a file it names. JSON-lines rows are compact JSON in
declaration order with no spaces, each followed by ``\\n``; an :class:`ArtifactRef` binds such a
file by the SHA-256 of every byte, its size and its number of rows. Manifests are
``json.dumps(..., sort_keys=True, indent=N)`` (agent and resources indent 2, ledger indent 1), and
``manifest_digest`` is the SHA-256 hex of their exact bytes.

A commit streams its records instead of building the folder whole: an agent's archives are packed
and handed to the writer one at a time as they fill (records given as an iterator in Gym's order
are never all held), JSON-lines files are encoded, hashed and written a chunk of rows at a time
(``snapformat.gym_dir.JsonlChunks``), and a ledger's lineage files are asked for one after the
other. What stays in memory grows with the rollouts only as the manifest does (one small entry per
file) plus the index and continuation rows. Reading back, archives are checked and decoded one at
a time (:func:`iter_agent_dir` for readers that keep only a little of each record).

Nothing here knows about snapshots: the files are the same on local disk inside a draft and in a
staging folder that is uploaded afterwards. The bytes are built and the checks on reading made by
snapformat (``snapformat.gym_dir``): the example store's writer builds the same bytes with the same
functions, and a folder is judged the same way by its participant on restore and by the publisher
that adopts it.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec

from schemas.errors import CorruptSnapshotError, InvalidPathError, InvalidRecordError
from schemas.gym_files import (
    AGENT_ARCHIVE_MAX_BYTES,
    AGENT_ARCHIVE_MAX_MEMBERS,
    AGENT_INDEX_NAME,
    CONTINUATIONS_NAME,
    MANIFEST_NAME,
    STORAGE_REFERENCES_NAME,
    AgentArchive,
    AgentBoundaryRecord,
    AgentIndexEntry,
    AgentManifest,
    ArtifactRef,
    AttemptEntry,
    ExternalStorageReference,
    LedgerManifest,
    LedgerRollout,
    MutationReceipt,
    ResourcesManifest,
    ResourceSnapshot,
    agent_archive_name,
    agent_instance_dir,
    attempt_member,
    ledger_dir,
    resources_dir,
)
from schemas.gym_records import AgentContinuationRoot
from snapformat.gym_dir import (
    DurableFiles,
    atomic_write,
    check_folder,
    compact_json,
    continuation_root,
    continuation_roots,
    continuation_roots_sha256,
    decode_rows,
    decode_strict,
    document_bytes,
    document_bytes_spliced,
    folder_of,
    jsonl_bytes,
    load_manifest,
    manifest_bytes,
    nested_document_bytes,
    non_blank_lines,
    read_ref_rows,
    read_tar_members,
    ref_name,
    root_order,
    sha256_hex,
    write_jsonl,
    write_manifest,
)
from snapformat.tar_archive import read_members, tar_bytes

__all__ = [
    "LINEAGE_SUFFIX", "DurableFiles", "LineageFile", "atomic_write", "check_ledger_roots", "checkpoint_root", "compact_json",
    "continuation_roots",
    "continuation_roots_sha256", "in_gym_order", "iter_agent_dir", "iter_agent_records", "iter_resource_dependencies",
    "jsonl_bytes",
    "manifest_bytes", "manifest_digest", "read_agent_archives", "read_agent_dir", "read_agent_folder", "read_jsonl", "read_ledger_dir",
    "read_resources_dir", "receipt_json", "record_json", "session_json", "stream_agent_archives", "write_agent_archives", "write_agent_dir",
    "write_jsonl", "write_ledger_dir", "write_manifest", "write_resources_dir",
]

#: ``<capture_key>.lineage.jsonl``: a byte copy of a rollout's live lineage file in the ledger folder.
LINEAGE_SUFFIX = ".lineage.jsonl"
_ARCHIVE_RE = re.compile(r"^agent-part-[0-9]{6}\.tar$")


# -- JSON lines (written by snapformat.gym_dir.write_jsonl) -----------------------------------------------------
def read_jsonl(checkpoint_dir: str | os.PathLike[str], ref: ArtifactRef, row_type: Any) -> list[Any]:
    """The rows of the file ``ref`` names: the path must stay inside ``checkpoint_dir``; raw lines
    are hashed, blank lines skipped; ``sha256``, ``bytes`` and ``records`` must match; each row is
    decoded strictly as ``row_type``. Errors name the file, the field and what was expected."""
    return read_ref_rows(Path(checkpoint_dir), ref, row_type)


# -- agent archives ---------------------------------------------------------------------------------------------
def record_json(record: AgentBoundaryRecord | ResourceSnapshot) -> bytes:
    """A record file (an archive member, a resources session): ``json.dumps(record, indent=2)``,
    fields in declaration order."""
    return document_bytes(record, sort_keys=False, indent=2)


def receipt_json(receipt: MutationReceipt) -> bytes:
    """A mutation receipt as a resources session file lays it out (an item of its
    ``mutation_receipts``, two levels in): bytes a resources server may encode when the receipt is
    made, for :func:`session_json`."""
    return nested_document_bytes(receipt, 2)


def session_json(snapshot: ResourceSnapshot, receipts: Sequence[bytes]) -> bytes:
    """:func:`record_json` of ``snapshot``, its receipts given as their :func:`receipt_json` bytes (in
    its order) instead of encoded again: a session's receipts are its history, one per mutation."""
    return document_bytes_spliced(msgspec.structs.replace(snapshot, mutation_receipts=[]), "mutation_receipts",
                                  receipts)


def write_agent_archives(folder: str | os.PathLike[str], records: Iterable[AgentBoundaryRecord],
                         out: DurableFiles | None = None) -> tuple[list[AgentArchive], list[AgentIndexEntry]]:
    """Write ``records`` into ``folder`` as ``agent-part-000000.tar``, ... and return the archives
    (for the manifest) and the index rows (for ``agent-index.jsonl``).

    Records go in (rollout_id, attempt_index) order, one member ``<rid>.a<n>.json`` each
    (:func:`record_json`); an archive takes at most 512 members and 64 MiB of member bytes (a
    larger record gets an archive of its own). A list or tuple is sorted first; any other iterable
    must already come in that order (:func:`in_gym_order`), and is then consumed as it comes. Each
    archive is built and handed to the writer as soon as it is full, so the member bytes of at most
    one archive are held at a time. Archives this call did not write (left by an earlier, larger
    commit into the same folder) are removed. The archives go into ``out`` (durable when its block
    ends), else into a :class:`DurableFiles` of their own (durable when this returns).
    """
    folder = Path(folder)
    index: list[AgentIndexEntry] = []
    if out is None:
        with DurableFiles() as own:
            return stream_agent_archives(folder, in_gym_order(records), own, index.extend), index
    return stream_agent_archives(folder, in_gym_order(records), out, index.extend), index


def in_gym_order(records: Iterable[AgentBoundaryRecord]) -> Iterator[AgentBoundaryRecord]:
    """``records`` in Gym's archive order, (rollout_id, attempt_index), one per attempt.

    A list or tuple is sorted (its records are in memory already; only references are copied) and
    a repeated attempt refused before any is yielded. Any other iterable is checked as it is
    consumed: a record out of order or repeated raises :class:`InvalidRecordError` there (archives
    already handed to a :class:`DurableFiles` then belong to no manifest)."""
    if isinstance(records, (list, tuple)):
        ordered = sorted(records, key=lambda r: (r.rollout_id, r.attempt_index))
        for prev, rec in itertools.pairwise(ordered):
            if (prev.rollout_id, prev.attempt_index) == (rec.rollout_id, rec.attempt_index):
                raise InvalidRecordError(f"agent records: ({rec.rollout_id!r}, {rec.attempt_index}) appears twice "
                                         "(expected one boundary record per attempt)")
        return iter(ordered)
    return _checked_order(records)


def _checked_order(records: Iterable[AgentBoundaryRecord]) -> Iterator[AgentBoundaryRecord]:
    last: tuple[str, int] | None = None
    for rec in records:
        key = (rec.rollout_id, rec.attempt_index)
        if last is not None and key <= last:
            what = "appears twice (expected one boundary record per attempt)" if key == last else \
                f"comes after {last} (records given as an iterator must be in (rollout_id, attempt_index) order)"
            raise InvalidRecordError(f"agent records: ({rec.rollout_id!r}, {rec.attempt_index}) {what}")
        last = key
        yield rec


def stream_agent_archives(folder: Path, ordered: Iterable[AgentBoundaryRecord], out: DurableFiles,
                          on_index: Callable[[list[AgentIndexEntry]], None],
                          on_record: Callable[[AgentBoundaryRecord], None] | None = None,
                          encode: Callable[[AgentBoundaryRecord], bytes] = record_json) -> list[AgentArchive]:
    """The archives of ``ordered`` (already in Gym's order, :func:`in_gym_order`), each written into
    ``out`` once full; ``on_index`` gets each archive's index rows when it is written, ``on_record``
    each record as it is packed. ``encode`` gives a record's member bytes: :func:`record_json`'s,
    or the same bytes encoded earlier (an agent kit encodes each boundary once, when it is recorded).
    Returns the archives (for the manifest); stale archives of an earlier commit into ``folder``
    are removed."""
    archives: list[AgentArchive] = []
    current: list[tuple[AgentBoundaryRecord, str, bytes]] = []
    payload = 0
    for rec in ordered:
        data = encode(rec)
        if current and (len(current) >= AGENT_ARCHIVE_MAX_MEMBERS or payload + len(data) > AGENT_ARCHIVE_MAX_BYTES):
            on_index(_write_shard(folder, len(archives), current, out, archives))
            current, payload = [], 0
        current.append((rec, attempt_member(rec.rollout_id, rec.attempt_index), data))
        payload += len(data)
        if on_record is not None:
            on_record(rec)
    if current:
        on_index(_write_shard(folder, len(archives), current, out, archives))
    written = {a.name for a in archives}
    if folder.is_dir():
        for stale in sorted(p for p in folder.iterdir() if _ARCHIVE_RE.match(p.name) and p.name not in written):
            out.remove(stale)
    return archives


def _write_shard(folder: Path, i: int, shard: list[tuple[AgentBoundaryRecord, str, bytes]], out: DurableFiles,
                 archives: list[AgentArchive]) -> list[AgentIndexEntry]:
    name = agent_archive_name(i)
    tar = tar_bytes([(member, data) for _, member, data in shard])
    out.add(folder / name, tar)
    archives.append(AgentArchive(name=name, sha256=sha256_hex(tar), members=len(shard), bytes=len(tar)))
    return [AgentIndexEntry(rollout_id=rec.rollout_id, attempt_index=rec.attempt_index, archive=name, member=member,
                            sha256=sha256_hex(data), bytes=len(data)) for rec, member, data in shard]


def read_agent_archives(folder: str | os.PathLike[str], archives: list[AgentArchive],
                        index: list[AgentIndexEntry]) -> list[AgentBoundaryRecord]:
    """The boundary records ``index`` names, in index order: each archive's ``sha256`` and
    ``bytes``, each member's ``sha256`` and ``bytes`` against its row, and each record decoded
    strictly with the row's rollout id and attempt. The archives are read one at a time: the
    bytes of one archive are held at once, not those of every archive."""
    folder = Path(folder)
    records: list[AgentBoundaryRecord | None] = [None] * len(index)
    for positions, rec in _archive_records(folder, archives, index):
        records[positions] = rec
    return records  # type: ignore[return-value]


def iter_agent_records(folder: str | os.PathLike[str], archives: list[AgentArchive],
                       index: list[AgentIndexEntry]) -> Iterator[AgentBoundaryRecord]:
    """The records of :func:`read_agent_archives`, checked the same way, but yielded archive by
    archive (in each archive, in index order) and never all held: for a reader that keeps only
    what it needs of each record."""
    for _, rec in _archive_records(Path(folder), archives, index):
        yield rec


def _archive_records(folder: Path, archives: list[AgentArchive], index: list[AgentIndexEntry]
                     ) -> Iterator[tuple[int, AgentBoundaryRecord]]:
    """(index position, record) for every index row, archive after archive, each archive checked
    (bytes, sha256, members) before its rows are decoded."""
    known = {a.name: a for a in archives}
    rows_of: dict[str, list[int]] = {name: [] for name in known}
    for n, row in enumerate(index):
        if row.archive not in rows_of:
            raise CorruptSnapshotError(f"{folder / AGENT_INDEX_NAME}: row {n + 1}: archive {row.archive!r} is not "
                                       "among the manifest's archives")
        rows_of[row.archive].append(n)
    for name, archive in known.items():
        members = _checked_archive(folder / name, archive)
        for n in rows_of[name]:
            yield n, _indexed_record(folder, members, index[n], n)
        del members


def _checked_archive(path: Path, archive: AgentArchive) -> dict[str, bytes]:
    """The members of one archive the manifest lists, after its ``bytes``, ``sha256`` and ``members``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{path}: missing, but the manifest lists archive {archive.name!r}") from None
    if len(data) != archive.bytes:
        raise CorruptSnapshotError(f"{path}: bytes is {len(data)}, the manifest's archive expects {archive.bytes}")
    if sha256_hex(data) != archive.sha256:
        raise CorruptSnapshotError(f"{path}: sha256 is {sha256_hex(data)}, the manifest's archive expects "
                                   f"{archive.sha256}")
    members = read_members(data, str(path))
    del data
    if len(members) != archive.members:
        raise CorruptSnapshotError(f"{path}: has {len(members)} members, the manifest's archive expects "
                                   f"{archive.members}")
    return members


# -- manifests (built and written by snapformat.gym_dir.manifest_bytes, write_manifest) ------------------------
def manifest_digest(folder: str | os.PathLike[str]) -> str | None:
    """SHA-256 hex of ``folder/manifest.json`` as it is on disk, or None when there is none."""
    try:
        return sha256_hex((Path(folder) / MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return None


# -- whole folders --------------------------------------------------------------------------------------------------
def write_agent_dir(checkpoint_dir: str | os.PathLike[str], checkpoint_id: str, instance_name: str | None,
                    records: Iterable[AgentBoundaryRecord],
                    roots: Iterable[AgentContinuationRoot] | None = None, *,
                    encode: Callable[[AgentBoundaryRecord], bytes] = record_json) -> tuple[AgentManifest, str]:
    """An agent instance's folder: archives, ``agent-index.jsonl``, ``continuations.jsonl`` (the
    given ``roots``, else :func:`continuation_roots` of the records), then ``manifest.json``.
    ``encode``: each record's member bytes (see :func:`stream_agent_archives`).
    Returns the manifest and its ``manifest_digest``; the commit reply is
    ``{records, manifest_digest, continuation_index}``."""
    base = agent_instance_dir(instance_name)
    folder = Path(checkpoint_dir) / base
    derived: list[AgentContinuationRoot] = []

    def root_of(rec: AgentBoundaryRecord) -> None:
        if roots is None and (root := continuation_root(rec)) is not None:
            derived.append(root)

    # Streamed: each archive is written when full and its index rows kept as small structs, so the
    # member bytes of one archive are held at a time (``records`` given as an ordered iterator are
    # never all held). agent-index.jsonl is written after the archives: its rows name them.
    index: list[AgentIndexEntry] = []
    with DurableFiles() as out:  # every file durable, each folder fsynced once, before the manifest
        archives = stream_agent_archives(folder, in_gym_order(records), out, index.extend, root_of, encode)
        record_index = write_jsonl(checkpoint_dir, f"{base}/{AGENT_INDEX_NAME}", index, out)
        del index
        continuation_index = write_jsonl(checkpoint_dir, f"{base}/{CONTINUATIONS_NAME}",
                                         sorted(derived, key=root_order) if roots is None else roots, out)
    manifest = AgentManifest(checkpoint_id=checkpoint_id, instance_name=instance_name, archives=archives,
                             record_index=record_index, records=record_index.records,
                             continuation_index=continuation_index)
    return manifest, write_manifest(folder, manifest)


class LineageFile(msgspec.Struct, frozen=True):
    """A lineage file whose SHA-256 and row count its writer already knows: a model server that
    keeps a running digest of each lineage hashes each row once, at the first commit that writes it,
    instead of the whole history at every commit. :func:`write_ledger_dir` puts them in the manifest as given;
    every reader still checks them against the bytes (a restore, and the publisher's adoption:
    ``snapformat.gym_dir``), so a wrong one fails there, naming the file and the field."""

    key: str
    data: bytes
    sha256: str  #: SHA-256 hex of ``data``
    rows: int  #: non-blank lines of ``data``


def write_ledger_dir(checkpoint_dir: str | os.PathLike[str], checkpoint_id: str, server_name: str, *,
                     lineages: Mapping[str, bytes] | Iterable[tuple[str, bytes] | LineageFile],
                     storage_references: Iterable[ExternalStorageReference],
                     roots: Iterable[AgentContinuationRoot], excluded_inactive: int = 0,
                     tombstones: Iterable[AttemptEntry] = (),
                     source_attempts: Iterable[AttemptEntry] = ()) -> tuple[LedgerManifest, str]:
    """A model server's ledger folder: ``<capture_key>.lineage.jsonl`` for each of ``lineages``
    (capture key -> the live file's bytes, copied as they are; a mapping, or ``(key, bytes)`` pairs
    and :class:`LineageFile` items, each written as it comes), ``storage-references.jsonl`` (rows in
    the given order, streamed), then ``manifest.json``. ``rollouts[key]`` lists its file by name with
    its SHA-256, non-blank ``rows`` and ``bytes`` (a :class:`LineageFile`'s as given); ``roots`` (the
    agents' continuation indexes) give ``continuation_roots`` and ``continuation_roots_sha256``."""
    base = ledger_dir(server_name)
    folder = Path(checkpoint_dir) / base
    rollouts: dict[str, LedgerRollout] = {}
    # Each lineage's bytes are asked for, written and dropped in turn (a Mapping that builds them on
    # access, or (key, bytes) pairs from a generator, is never held whole); the order of writing does
    # not matter: the manifest sorts its keys.
    items = lineages.items() if isinstance(lineages, Mapping) else lineages
    into = f"{folder}{os.sep}"  # one file per rollout: names joined as strings, not parsed as paths
    with DurableFiles() as out:  # every file durable, each folder fsynced once, before the manifest
        for item in items:
            if isinstance(item, LineageFile):
                key, data, digest, rows = item.key, item.data, item.sha256, item.rows
            else:
                key, data = item
                digest, rows = sha256_hex(data), non_blank_lines(data)
            if key in rollouts:
                raise InvalidRecordError(f"ledger lineages: capture key {key!r} appears twice")
            name = f"{key}{LINEAGE_SUFFIX}"
            out.add(into + name, data)
            rollouts[key] = LedgerRollout(files={name: digest}, rows=rows, bytes=len(data))
        refs = write_jsonl(checkpoint_dir, f"{base}/{STORAGE_REFERENCES_NAME}", storage_references, out)
    roots = list(roots)
    manifest = LedgerManifest(
        checkpoint_id=checkpoint_id, server_name=server_name, rollouts=rollouts,
        continuation_roots_sha256=continuation_roots_sha256(roots), continuation_roots=len(roots),
        excluded_inactive=excluded_inactive, storage_reference_index=refs, tombstones=list(tombstones),
        source_attempts=list(source_attempts))
    return manifest, write_manifest(folder, manifest)


def write_resources_dir(checkpoint_dir: str | os.PathLike[str], checkpoint_id: str, server_name: str,
                        snapshots: Iterable[ResourceSnapshot], *,
                        encode: Callable[[ResourceSnapshot], bytes] = record_json) -> tuple[ResourcesManifest, str]:
    """A resources server's folder: ``<rid>.a<n>.json`` per session (``json.dumps(indent=2)``, fields
    in declaration order: :func:`record_json`, or ``encode`` giving the same bytes from parts encoded
    earlier), then ``manifest.json`` mapping each name to its SHA-256."""
    folder = Path(checkpoint_dir) / resources_dir(server_name)
    files: dict[str, str] = {}
    into = f"{folder}{os.sep}"  # one file per session: names joined as strings, not parsed as paths
    with DurableFiles() as out:  # every file durable, the folder fsynced once, before the manifest
        for snap in snapshots:
            name = attempt_member(snap.rollout_id, snap.attempt_index)
            if name in files:
                raise InvalidRecordError(f"resources snapshots: {name!r} appears twice (expected one per attempt)")
            data = encode(snap)
            out.add(into + name, data)
            files[name] = sha256_hex(data)
    manifest = ResourcesManifest(checkpoint_id=checkpoint_id, server_name=server_name, files=files)
    return manifest, write_manifest(folder, manifest)


def checkpoint_root(checkpoint_dir: str) -> Path:
    """``checkpoint_dir`` as a path, if a file system can hold it: a NUL byte ends a path in every
    OS call (Python raises ``ValueError`` there, which a route would answer as a 500), so such a
    folder is an :class:`InvalidPathError` that the participant answers as its checkpoint error."""
    if "\x00" in checkpoint_dir:
        raise InvalidPathError(f"checkpoint_dir {checkpoint_dir!r} holds a NUL byte (no file system path can)")
    return Path(checkpoint_dir)


def _checkpoint_dir_of(folder: Path, base: str) -> Path:
    """``checkpoint_dir`` of a participant folder that its manifest places at ``base``."""
    parts = base.split("/")
    if list(folder.parts[-len(parts):]) != parts:
        raise InvalidPathError(f"{folder / MANIFEST_NAME}: the manifest belongs in {base!r} of checkpoint_dir, "
                               f"but the folder is {folder}")
    return folder.parents[len(parts) - 1]


def read_agent_dir(instance_dir: str | os.PathLike[str]
                   ) -> tuple[AgentManifest, list[AgentBoundaryRecord], list[AgentContinuationRoot]]:
    """An agent instance's folder, every digest and reference checked against the bytes: the
    manifest, the boundary records (index order) and the continuation roots."""
    manifest, records, roots, _ = read_agent_folder(instance_dir)
    return manifest, records, roots


def read_agent_folder(instance_dir: str | os.PathLike[str]
                      ) -> tuple[AgentManifest, list[AgentBoundaryRecord], list[AgentContinuationRoot], str]:
    """:func:`read_agent_dir`, and the ``manifest_digest`` of the very manifest bytes it checked."""
    folder = Path(instance_dir)
    # Each file read once: the check hashes every archive member against its index row and keeps the
    # bytes it hashed, which are decoded here (the restore used to read each archive three times).
    checked = check_folder(folder, component="agent", keep=True)
    _checkpoint_dir_of(folder, checked.base)
    manifest: AgentManifest = checked.manifest
    records = _kept_records(folder, checked.archives, checked.index)
    roots_name = ref_name(manifest.continuation_index, checked.base, f"{folder / MANIFEST_NAME}: continuation_index")
    roots = decode_rows(checked.files[roots_name], AgentContinuationRoot, str(folder / roots_name))
    return manifest, records, roots, checked.manifest_digest


def _kept_records(folder: Path, archives: dict[str, dict[str, bytes]], index: list[AgentIndexEntry]
                  ) -> list[AgentBoundaryRecord]:
    """The records of ``index``, in its order, decoded from the member bytes the check held to each row.
    Consumes ``archives``: an archive's bytes are let go after its last row, so the records and the
    bytes not yet decoded are held at once, never the records and every byte."""
    last_row = {row.archive: n for n, row in enumerate(index)}
    records = []
    for n, row in enumerate(index):
        records.append(_row_record(folder, archives[row.archive][row.member], row, n))
        if last_row[row.archive] == n:
            del archives[row.archive]
    return records


def iter_agent_dir(instance_dir: str | os.PathLike[str]) -> tuple[AgentManifest, Iterator[AgentBoundaryRecord]]:
    """An agent instance's folder, checked as :func:`read_agent_dir` checks it (the manifest against
    every file's bytes first), and its boundary records yielded archive by archive
    (:func:`iter_agent_records`): for a reader that needs a little of every record, in the memory
    of one archive."""
    folder = Path(instance_dir)
    checked = check_folder(folder, component="agent")
    _checkpoint_dir_of(folder, checked.base)
    manifest: AgentManifest = checked.manifest
    return manifest, iter_agent_records(folder, manifest.archives, checked.index)


class _IndexRow(msgspec.Struct, frozen=True):
    """An ``agent-index.jsonl`` row as :func:`iter_resource_dependencies` reads it: the fields of
    :class:`AgentIndexEntry` with their types, without Gym's rules on their values (the id's
    pattern, the digest's form). A record read by its row is held to the row's digest and size, so
    a row that breaks those rules cannot pass for a good one there."""

    rollout_id: str
    attempt_index: int
    archive: str
    member: str
    sha256: str
    bytes: int


class _RootRevisions(msgspec.Struct, frozen=True):
    """What :func:`iter_resource_dependencies` needs of a ``continuations.jsonl`` row (other fields
    read past, not checked)."""

    rollout_id: str
    attempt_index: int
    resource_state_revisions: dict[str, int] | None = None


def iter_resource_dependencies(instance_dir: str | os.PathLike[str]
                               ) -> Iterator[tuple[tuple[str, int], dict[str, int]]]:
    """What each boundary record of an agent instance's folder says it saw of the resources servers:
    ``((rollout_id, attempt_index), resource_state_revisions)``, one per record, read from the agent's
    dependency index rather than from every record.

    A record with a continuation root (its attempt in ``continuations.jsonl``, whose
    ``resource_state_revisions`` the writer copies from the record, CONTROL §6) is answered by the
    root; only a record without one (no committed model call yet, or a root from before dependency
    tracking, ``null``) is read from its archive member. Checked: the manifest, both artifact
    references (inside the folder; ``sha256``, ``bytes``, ``records``), ``records`` against the index,
    and each member read against its index row (``bytes``, ``sha256``, rollout id and attempt), which
    the manifest binds through the index's reference. Archives are not hashed whole: a resources
    server restoring reads the agents' small index files, not their records (the agent's own restore
    checks every byte of its folder).

    The index rows and the roots are decoded only as far as this read needs (:class:`_IndexRow`,
    :class:`_RootRevisions`): Gym's rules on the ids, capture keys and digests are left to the
    agent's own restore and the coordinator's check, which decode every row whole. Every one of S
    resources servers reads all N rows, so a row's cost counts S x N times: decoded whole, the rows
    were most of a resources server's restore at 100,000 rollouts.
    """
    folder = Path(instance_dir)
    manifest = cast(AgentManifest, load_manifest(folder, "agent")[1])  # decoded as the agent's struct
    base = folder_of("agent", manifest)
    checkpoint_dir = _checkpoint_dir_of(folder, base)
    where = str(folder / MANIFEST_NAME)
    for field, ref in (("record_index", manifest.record_index), ("continuation_index", manifest.continuation_index)):
        ref_name(ref, base, f"{where}: {field}")  # the reference must name a file of this folder
    index: list[_IndexRow] = read_ref_rows(checkpoint_dir, manifest.record_index, _IndexRow)
    if len(index) != manifest.records:
        raise CorruptSnapshotError(f"{where}: records is {manifest.records}, the record index has {len(index)} rows")
    roots = {(r.rollout_id, r.attempt_index): r.resource_state_revisions
             for r in read_ref_rows(checkpoint_dir, manifest.continuation_index, _RootRevisions)}
    unrooted: dict[str, list[int]] = {}
    for n, row in enumerate(index):
        revisions = roots.get((row.rollout_id, row.attempt_index))
        if revisions is not None:
            yield (row.rollout_id, row.attempt_index), revisions
        else:
            unrooted.setdefault(row.archive, []).append(n)
    archives = {a.name for a in manifest.archives}
    for name, positions in unrooted.items():
        if name not in archives:
            raise CorruptSnapshotError(f"{folder / AGENT_INDEX_NAME}: row {positions[0] + 1}: archive {name!r} is not "
                                       "among the manifest's archives")
        members = read_tar_members(folder / name)
        for n in positions:
            rec = _indexed_record(folder, members, index[n], n)
            yield (rec.rollout_id, rec.attempt_index), rec.resource_state_revisions


def _indexed_record(folder: Path, members: dict[str, bytes], row: AgentIndexEntry | _IndexRow,
                    n: int) -> AgentBoundaryRecord:
    """The record of index row ``n`` (0-based) from its archive's ``members``, checked against the row."""
    # The two names below are built only for an error: paths joined per record were a fifth of an
    # agent's restore of 1,000 records (py-spy).
    def at() -> str:
        return f"{folder / AGENT_INDEX_NAME}: row {n + 1}"

    def where() -> str:
        return f"{folder / row.archive}: member {row.member!r}"

    data = members.get(row.member)
    if data is None:
        raise CorruptSnapshotError(f"{where()}: missing, but {at()} indexes it")
    if len(data) != row.bytes or sha256_hex(data) != row.sha256:
        raise CorruptSnapshotError(f"{where()}: {len(data)} bytes with sha256 {sha256_hex(data)}, {at()} expects "
                                   f"{row.bytes} bytes with sha256 {row.sha256}")
    return _row_record(folder, data, row, n)


def _row_record(folder: Path, data: bytes, row: AgentIndexEntry | _IndexRow, n: int) -> AgentBoundaryRecord:
    """The record in member bytes ``data`` already held to index row ``n`` (0-based; its ``bytes`` and
    ``sha256``), decoded strictly and checked to be the row's rollout attempt."""
    def where() -> str:  # built only for an error, as in _indexed_record
        return f"{folder / row.archive}: member {row.member!r}"

    rec: AgentBoundaryRecord = decode_strict(data, AgentBoundaryRecord, where)
    if (rec.rollout_id, rec.attempt_index) != (row.rollout_id, row.attempt_index):
        raise CorruptSnapshotError(f"{where()}: holds ({rec.rollout_id!r}, {rec.attempt_index}), "
                                   f"{folder / AGENT_INDEX_NAME}: row {n + 1} expects "
                                   f"({row.rollout_id!r}, {row.attempt_index})")
    return rec


def read_ledger_dir(ledger_folder: str | os.PathLike[str]
                    ) -> tuple[LedgerManifest, list[ExternalStorageReference], dict[str, Path]]:
    """A model server's ledger folder, checked: the manifest, the storage references, and each
    rollout's lineage file by capture key (the copy to put back)."""
    folder = Path(ledger_folder)
    checked = check_folder(folder, component="ledger")
    checkpoint_dir = _checkpoint_dir_of(folder, checked.base)
    manifest: LedgerManifest = checked.manifest
    refs = read_jsonl(checkpoint_dir, manifest.storage_reference_index, ExternalStorageReference)
    lineage = {}
    for key, rollout in manifest.rollouts.items():
        for name in rollout.files:
            lineage[key] = folder / name
    return manifest, refs, lineage


def check_ledger_roots(manifest: LedgerManifest, roots: Iterable[AgentContinuationRoot]) -> None:
    """The ledger was committed for these continuation roots (count and ``continuation_roots_sha256``)."""
    roots = list(roots)
    digest = continuation_roots_sha256(roots)
    if len(roots) != manifest.continuation_roots or digest != manifest.continuation_roots_sha256:
        raise CorruptSnapshotError(
            f"ledger {manifest.server_name!r}: continuation_roots {manifest.continuation_roots} with sha256 "
            f"{manifest.continuation_roots_sha256}, the agents' indexes give {len(roots)} with {digest}")


def read_resources_dir(resources_folder: str | os.PathLike[str]
                       ) -> tuple[ResourcesManifest, dict[str, ResourceSnapshot]]:
    """A resources server's folder, checked: the manifest and each session snapshot by file name
    (decoded strictly; the name must be ``<rid>.a<n>.json`` of the snapshot it holds)."""
    folder = Path(resources_folder)
    checked = check_folder(folder, component="resources", keep=True)  # each file read once: checked, then decoded
    _checkpoint_dir_of(folder, checked.base)
    manifest: ResourcesManifest = checked.manifest
    snapshots = {}
    for name in sorted(manifest.files):
        snap = decode_strict(checked.files[name], ResourceSnapshot, lambda name=name: str(folder / name))
        expected = attempt_member(snap.rollout_id, snap.attempt_index)
        if name != expected:
            raise CorruptSnapshotError(f"{folder / name}: holds the session of ({snap.rollout_id!r}, "
                                       f"{snap.attempt_index}), expected the file name {expected!r}")
        snapshots[name] = snap
    return manifest, snapshots
