"""Gym's files in ``checkpoint_dir`` as plain files (CONTROL.md §6): write them, read them back.

A participant handed a ``checkpoint_dir`` writes only into its own folder of it::

    agent/instance-<sha256hex(utf8 name)>/   agent-part-NNNNNN.tar, agent-index.jsonl,
                                             continuations.jsonl, manifest.json
    model-ledger/<server_name>/              <capture_key>.lineage.jsonl, storage-references.jsonl,
                                             manifest.json
    resources/<server_name>/                 <rid>.a<n>.json, manifest.json

Every file goes temp -> write -> fsync -> rename -> folder fsync (:func:`atomic_write`, shared with
snapformat, which writes a part it downloads the same way), and the
manifest is written last, so a folder with a manifest is whole. JSON-lines rows are compact JSON in
declaration order with no spaces, each followed by ``\\n``; an :class:`ArtifactRef` binds such a
file by the SHA-256 of every byte, its size and its number of rows. Manifests are
``json.dumps(..., sort_keys=True, indent=N)`` (agent and resources indent 2, ledger indent 1), and
``manifest_digest`` is the SHA-256 hex of their exact bytes.

Nothing here knows about snapshots: the files are the same on local disk inside a draft and in a
staging folder that is uploaded afterwards. The bytes are built and the checks on reading made by
snapformat (``snapformat.gym_dir``): the example store's writer builds the same bytes with the same
functions, and a folder is judged the same way by its participant on restore and by the publisher
that adopts it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from schemas.errors import CorruptSnapshotError, InvalidPathError, InvalidRecordError, StoreError
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
    atomic_write,
    check_folder,
    continuation_roots,
    continuation_roots_sha256,
    decode_strict,
    document_bytes,
    jsonl_bytes,
    manifest_bytes,
    read_ref_rows,
    read_tar_members,
    sha256_hex,
    tar_bytes,
    write_jsonl,
    write_manifest,
)

__all__ = [
    "LINEAGE_SUFFIX", "atomic_write", "check_ledger_roots", "continuation_roots", "continuation_roots_sha256",
    "jsonl_bytes", "manifest_bytes", "manifest_digest", "read_agent_archives", "read_agent_dir", "read_jsonl",
    "read_ledger_dir", "read_resources_dir", "record_json", "write_agent_archives", "write_agent_dir", "write_jsonl",
    "write_ledger_dir", "write_manifest", "write_resources_dir",
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


def write_agent_archives(folder: str | os.PathLike[str], records: Iterable[AgentBoundaryRecord]
                         ) -> tuple[list[AgentArchive], list[AgentIndexEntry]]:
    """Write ``records`` into ``folder`` as ``agent-part-000000.tar``, ... and return the archives
    (for the manifest) and the index rows (for ``agent-index.jsonl``).

    Records go in (rollout_id, attempt_index) order, one member ``<rid>.a<n>.json`` each
    (:func:`record_json`); an archive takes at most 512 members and 64 MiB of member bytes (a
    larger record gets an archive of its own). Archives this call did not write (left by an
    earlier, larger commit into the same folder) are removed.
    """
    folder = Path(folder)
    ordered = sorted(records, key=lambda r: (r.rollout_id, r.attempt_index))
    shards: list[list[tuple[AgentBoundaryRecord, str, bytes]]] = []
    current: list[tuple[AgentBoundaryRecord, str, bytes]] = []
    payload = 0
    seen: set[tuple[str, int]] = set()
    for rec in ordered:
        if (rec.rollout_id, rec.attempt_index) in seen:
            raise InvalidRecordError(f"agent records: ({rec.rollout_id!r}, {rec.attempt_index}) appears twice "
                                     "(expected one boundary record per attempt)")
        seen.add((rec.rollout_id, rec.attempt_index))
        data = record_json(rec)
        if current and (len(current) >= AGENT_ARCHIVE_MAX_MEMBERS or payload + len(data) > AGENT_ARCHIVE_MAX_BYTES):
            shards.append(current)
            current, payload = [], 0
        current.append((rec, attempt_member(rec.rollout_id, rec.attempt_index), data))
        payload += len(data)
    if current:
        shards.append(current)
    archives: list[AgentArchive] = []
    index: list[AgentIndexEntry] = []
    for i, shard in enumerate(shards):
        name = agent_archive_name(i)
        tar = tar_bytes([(member, data) for _, member, data in shard])
        atomic_write(folder / name, tar)
        archives.append(AgentArchive(name=name, sha256=sha256_hex(tar), members=len(shard), bytes=len(tar)))
        index.extend(AgentIndexEntry(rollout_id=rec.rollout_id, attempt_index=rec.attempt_index, archive=name,
                                     member=member, sha256=sha256_hex(data), bytes=len(data))
                     for rec, member, data in shard)
    written = {a.name for a in archives}
    if folder.is_dir():
        for stale in sorted(p for p in folder.iterdir() if _ARCHIVE_RE.match(p.name) and p.name not in written):
            try:
                stale.unlink()
            except OSError as exc:
                raise StoreError(f"{stale}: cannot remove an archive of an earlier commit: {exc}") from exc
    return archives, index


def read_agent_archives(folder: str | os.PathLike[str], archives: list[AgentArchive],
                        index: list[AgentIndexEntry]) -> list[AgentBoundaryRecord]:
    """The boundary records ``index`` names, in index order: each archive's ``sha256`` and
    ``bytes``, each member's ``sha256`` and ``bytes`` against its row, and each record decoded
    strictly with the row's rollout id and attempt."""
    folder = Path(folder)
    known = {a.name: a for a in archives}
    members: dict[str, dict[str, bytes]] = {}
    for name, archive in known.items():
        path = folder / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{path}: missing, but the manifest lists archive {name!r}") from None
        if len(data) != archive.bytes:
            raise CorruptSnapshotError(f"{path}: bytes is {len(data)}, the manifest's archive expects {archive.bytes}")
        if sha256_hex(data) != archive.sha256:
            raise CorruptSnapshotError(f"{path}: sha256 is {sha256_hex(data)}, the manifest's archive expects "
                                       f"{archive.sha256}")
        members[name] = read_tar_members(path)
        if len(members[name]) != archive.members:
            raise CorruptSnapshotError(f"{path}: has {len(members[name])} members, the manifest's archive expects "
                                       f"{archive.members}")
    records = []
    for n, row in enumerate(index, 1):
        at = f"{folder / AGENT_INDEX_NAME}: row {n}"
        if row.archive not in members:
            raise CorruptSnapshotError(f"{at}: archive {row.archive!r} is not among the manifest's archives")
        data = members[row.archive].get(row.member)
        where = f"{folder / row.archive}: member {row.member!r}"
        if data is None:
            raise CorruptSnapshotError(f"{where}: missing, but {at} indexes it")
        if len(data) != row.bytes or sha256_hex(data) != row.sha256:
            raise CorruptSnapshotError(f"{where}: {len(data)} bytes with sha256 {sha256_hex(data)}, {at} expects "
                                       f"{row.bytes} bytes with sha256 {row.sha256}")
        rec = decode_strict(data, AgentBoundaryRecord, where)
        if (rec.rollout_id, rec.attempt_index) != (row.rollout_id, row.attempt_index):
            raise CorruptSnapshotError(f"{where}: holds ({rec.rollout_id!r}, {rec.attempt_index}), {at} expects "
                                       f"({row.rollout_id!r}, {row.attempt_index})")
        records.append(rec)
    return records


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
                    roots: Iterable[AgentContinuationRoot] | None = None) -> tuple[AgentManifest, str]:
    """An agent instance's folder: archives, ``agent-index.jsonl``, ``continuations.jsonl`` (the
    given ``roots``, else :func:`continuation_roots` of the records), then ``manifest.json``.
    Returns the manifest and its ``manifest_digest``; the commit reply is
    ``{records, manifest_digest, continuation_index}``."""
    base = agent_instance_dir(instance_name)
    folder = Path(checkpoint_dir) / base
    records = list(records)
    archives, index = write_agent_archives(folder, records)
    record_index = write_jsonl(checkpoint_dir, f"{base}/{AGENT_INDEX_NAME}", index)
    roots = continuation_roots(records) if roots is None else list(roots)
    continuation_index = write_jsonl(checkpoint_dir, f"{base}/{CONTINUATIONS_NAME}", roots)
    manifest = AgentManifest(checkpoint_id=checkpoint_id, instance_name=instance_name, archives=archives,
                             record_index=record_index, records=len(index), continuation_index=continuation_index)
    return manifest, write_manifest(folder, manifest)


def write_ledger_dir(checkpoint_dir: str | os.PathLike[str], checkpoint_id: str, server_name: str, *,
                     lineages: Mapping[str, bytes], storage_references: Iterable[ExternalStorageReference],
                     roots: Iterable[AgentContinuationRoot], excluded_inactive: int = 0,
                     tombstones: Iterable[AttemptEntry] = (),
                     source_attempts: Iterable[AttemptEntry] = ()) -> tuple[LedgerManifest, str]:
    """A model server's ledger folder: ``<capture_key>.lineage.jsonl`` for each of ``lineages``
    (capture key -> the live file's bytes, copied as they are), ``storage-references.jsonl`` (rows
    in the given order), then ``manifest.json``. ``rollouts[key]`` lists its file by name with its
    SHA-256, non-blank ``rows`` and ``bytes``; ``roots`` (the agents' continuation indexes) give
    ``continuation_roots`` and ``continuation_roots_sha256``."""
    base = ledger_dir(server_name)
    folder = Path(checkpoint_dir) / base
    rollouts = {}
    for key, data in sorted(lineages.items()):
        name = f"{key}{LINEAGE_SUFFIX}"
        atomic_write(folder / name, data)
        rows = sum(1 for line in data.split(b"\n") if line.strip())
        rollouts[key] = LedgerRollout(files={name: sha256_hex(data)}, rows=rows, bytes=len(data))
    refs = write_jsonl(checkpoint_dir, f"{base}/{STORAGE_REFERENCES_NAME}", storage_references)
    roots = list(roots)
    manifest = LedgerManifest(
        checkpoint_id=checkpoint_id, server_name=server_name, rollouts=rollouts,
        continuation_roots_sha256=continuation_roots_sha256(roots), continuation_roots=len(roots),
        excluded_inactive=excluded_inactive, storage_reference_index=refs, tombstones=list(tombstones),
        source_attempts=list(source_attempts))
    return manifest, write_manifest(folder, manifest)


def write_resources_dir(checkpoint_dir: str | os.PathLike[str], checkpoint_id: str, server_name: str,
                        snapshots: Iterable[ResourceSnapshot]) -> tuple[ResourcesManifest, str]:
    """A resources server's folder: ``<rid>.a<n>.json`` per session (``json.dumps(indent=2)``, fields
    in declaration order), then ``manifest.json`` mapping each name to its SHA-256."""
    folder = Path(checkpoint_dir) / resources_dir(server_name)
    files: dict[str, str] = {}
    for snap in snapshots:
        name = attempt_member(snap.rollout_id, snap.attempt_index)
        if name in files:
            raise InvalidRecordError(f"resources snapshots: {name!r} appears twice (expected one per attempt)")
        data = record_json(snap)
        atomic_write(folder / name, data)
        files[name] = sha256_hex(data)
    manifest = ResourcesManifest(checkpoint_id=checkpoint_id, server_name=server_name, files=files)
    return manifest, write_manifest(folder, manifest)


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
    folder = Path(instance_dir)
    checked = check_folder(folder, component="agent")
    checkpoint_dir = _checkpoint_dir_of(folder, checked.base)
    manifest: AgentManifest = checked.manifest
    records = read_agent_archives(folder, manifest.archives, checked.index)
    roots = read_jsonl(checkpoint_dir, manifest.continuation_index, AgentContinuationRoot)
    return manifest, records, roots


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
    checked = check_folder(folder, component="resources")
    _checkpoint_dir_of(folder, checked.base)
    manifest: ResourcesManifest = checked.manifest
    snapshots = {}
    for name in sorted(manifest.files):
        where = str(folder / name)
        snap = decode_strict((folder / name).read_bytes(), ResourceSnapshot, where)
        expected = attempt_member(snap.rollout_id, snap.attempt_index)
        if name != expected:
            raise CorruptSnapshotError(f"{where}: holds the session of ({snap.rollout_id!r}, {snap.attempt_index}), "
                                       f"expected the file name {expected!r}")
        snapshots[name] = snap
    return manifest, snapshots
