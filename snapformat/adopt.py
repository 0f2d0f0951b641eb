"""Gym's plain files as parts of a snapshot: adopt a folder into a draft, bring a part back as files.

A Gym participant knows nothing of snapshots: it writes Gym's files into the ``checkpoint_dir`` it
is handed (CONTROL.md §6). :func:`adopt_part` makes one such folder one part of a draft:

1. List the folder's files (temporary ``.tmp-*`` files of an interrupted atomic write left out;
   every other name a safe relative path), and read each once: size, SHA-256, the store's checksum,
   non-blank lines or archive members.
2. Check Gym's own ``manifest.json`` against those bytes (``snapformat.gym_dir.check_folder``):
   every artifact reference, every archive, ledger and resources digest. A part prefix of Gym's
   layout (``gym/agent[/instance-<sha>]``, ``gym/model-ledger/<name>``, ``gym/resources/<name>``)
   must hold a manifest, and that manifest must name the same folder; under any other prefix a
   ``manifest.json`` with a Gym manifest's fields is checked too. *Refused: nothing is written.*
3. Put the files in place. On local disk, when the folder already *is* ``<draft>/<prefix>`` (the
   participant was handed ``<draft>/gym`` as its ``checkpoint_dir``), nothing is copied. Otherwise
   each file is created under ``<draft>/<prefix>/`` with the store's create-only write: files of up
   to :data:`WHOLE_UPLOAD_MAX` bytes in batches (:meth:`~snapformat.store.base.Store.create_exclusive_many`,
   at most :data:`BATCH_FILES` files and :data:`BATCH_BYTES` bytes each: on local disk a batch's
   folder is fsynced once, not once per file), a larger file streamed after a look that the key is
   free; :data:`UPLOAD_THREADS` batches or files at a time (:data:`LOCAL_THREADS` on local disk,
   where more threads only contend). A key that already holds the same bytes (an earlier,
   interrupted adoption) is kept, one with other bytes refused, and the temporary files it left
   are removed first. Bytes that changed since step 1 are refused. *Crash: files no part manifest
   lists; GC sweeps them with the draft if it is never published, and adopting the folder again
   keeps those already whole.*
4. Create ``<prefix>/part-manifest.json`` (create-only) listing every file as kind ``gym_file``
   with its size, checksum and records, and return the :class:`PartReceipt` for the publisher. A
   part manifest already there with the same files (a repeated adoption) gives the same receipt.

:func:`materialize_part` is the way back: a published snapshot's part is downloaded into a local
folder, each file checked against the part manifest (size and checksum) and written atomically,
then Gym's manifest checked again, so a Gym server restoring from an object store is handed a
plain ``checkpoint_dir`` (:func:`materialize_gym` does every Gym part at once). :func:`check_part`
does the same checks on a part of a snapshot on local disk, where it lies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from schemas.errors import CommitConflictError, CorruptSnapshotError, InvalidPathError, NotPublishedError
from schemas.gym_files import AGENT_DIR, LEDGER_DIR, MANIFEST_NAME, RESOURCES_DIR
from schemas.identity import check_relative_path
from schemas.manifest import FileEntry, PartManifest, PartReceipt
from schemas.version import FORMAT_VERSION
from snapformat import jsonl, layout
from snapformat.checksum import checksum_bytes, checksum_stream, new_hasher
from snapformat.gym_dir import (
    MAX_MANIFEST_BYTES,
    TEMP_PREFIX,
    FileFacts,
    GymFolder,
    atomic_write_chunks,
    check_folder,
    component_of_fields,
    component_of_prefix,
    list_folder,
    scan_file,
    scan_folder,
)
from snapformat.kinds import GYM_FILE_KIND
from snapformat.reader import MAX_JSON_PART_BYTES, Snapshot, open_snapshot
from snapformat.store import Store, open_store

#: Files up to this size are read whole and created with one create-only write; larger ones are
#: streamed.
WHOLE_UPLOAD_MAX = 16 << 20
_CHUNK = 8 << 20
UPLOAD_THREADS = 16  # files of one part uploaded at once (an S3 client pools as many connections)
#: Threads adopting into a local store: each write is a short system call, and more threads
#: than this only wait for one another (4 adopted 10,000 small files faster than 1 or 16 did).
LOCAL_THREADS = 4
BATCH_FILES = 256  # small files created together on local disk (one create_exclusive_many)
BATCH_BYTES = 32 << 20  # ...and at most this many of their bytes held at once per batch


def adopt_part(draft_url: str, local_dir: str, prefix: str, writer: str | None = None) -> PartReceipt:
    """Make the plain files of ``local_dir`` the part ``prefix`` of the draft at ``draft_url``
    (steps in the module docstring) and return its receipt. ``writer`` labels the part (default:
    the prefix)."""
    store_url, snapshot_id = layout.split_snapshot_url(draft_url)
    store = open_store(store_url)
    prefix = check_relative_path(prefix, where="part prefix")
    if prefix.split("/", 1)[0] in (layout.MANIFEST_NAME, layout.HEARTBEAT_NAME):
        raise InvalidPathError(f"part prefix {prefix!r} is reserved (the draft's own files)")
    writer = writer or prefix
    folder = Path(local_dir)
    manifest_key = f"{layout.snapshot_dir(snapshot_id)}/{layout.MANIFEST_NAME}"
    if store.exists(manifest_key):
        raise InvalidPathError(f"{draft_url}: already sealed for publishing (it has its manifest.json); "
                               "a part must be adopted before the draft is published")
    facts = scan_folder(folder, skip=[layout.PART_MANIFEST_NAME])
    for name in facts:
        if name.rsplit("/", 1)[-1] == layout.PART_MANIFEST_NAME:
            raise InvalidPathError(f"{folder / name}: {layout.PART_MANIFEST_NAME} is reserved for the part's own "
                                   "manifest")
    check_gym_part(folder, prefix, facts)
    if not _is_in_place(store, snapshot_id, prefix, folder):
        _copy_in(store, snapshot_id, prefix, folder, facts)
    files = [FileEntry(path=f"{prefix}/{name}", kind=GYM_FILE_KIND, size=f.size, checksum=f.checksum,
                       records=f.records, writer=writer) for name, f in facts.items()]
    part = PartManifest(format_version=FORMAT_VERSION, snapshot_id=snapshot_id, prefix=prefix, writer=writer,
                        files=files, written_at=time.time())
    data = jsonl.encode_json(part)
    part_key = layout.file_key(snapshot_id, f"{prefix}/{layout.PART_MANIFEST_NAME}")
    try:
        store.create_exclusive(part_key, data)
    except CommitConflictError:
        data = _same_part(store, part_key, part)
    return PartReceipt(prefix=prefix, writer=writer, part_manifest_checksum=checksum_bytes(data))


def check_gym_part(folder: Path, prefix: str, facts: dict[str, FileFacts]) -> GymFolder | None:
    """Step 2: Gym's manifest of ``folder`` against its bytes, when the folder is Gym's (by its
    prefix, or by its manifest's fields); None for a folder of other plain files."""
    component = component_of_prefix(prefix)
    if MANIFEST_NAME not in facts:
        if component is not None:
            raise CorruptSnapshotError(f"{folder / MANIFEST_NAME}: missing, but part {prefix!r} is Gym's {component} "
                                       "folder (a Gym participant writes its manifest.json last)")
        return None
    if component is not None:
        return check_folder(folder, component=component, base=prefix.split("/", 1)[1], facts=facts)
    if facts[MANIFEST_NAME].size > MAX_MANIFEST_BYTES:
        return None  # too large for any Gym manifest: a file like any other
    try:
        fields = msgspec.json.decode((folder / MANIFEST_NAME).read_bytes())
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # not JSON: not Gym's manifest, only a file like any other
    if component_of_fields(fields) is None:
        return None
    return check_folder(folder, facts=facts)


def _is_in_place(store: Store, snapshot_id: str, prefix: str, folder: Path) -> bool:
    path = store.local_path(layout.file_key(snapshot_id, prefix))
    return path is not None and Path(path).resolve() == folder.resolve()


def _changed(path: Path) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{path}: changed while it was being adopted (its bytes differ from those checked)")


def _copy_in(store: Store, snapshot_id: str, prefix: str, folder: Path, facts: dict[str, FileFacts]) -> None:
    """Step 3: every file of ``folder`` created under the part's prefix in the draft. A Gym folder is
    many small files: on local disk they go in batches; remotely each is its own request anyway, so
    each is its own job, to keep as many in flight as there are threads."""
    local = store.local_path(layout.file_key(snapshot_id, prefix)) is not None
    if local:  # an object store's create-only write leaves no temporary file (and a look costs a request)
        _sweep_temporaries(store, layout.file_key(snapshot_id, prefix))
    files = [(layout.file_key(snapshot_id, f"{prefix}/{name}"), folder / name, f) for name, f in facts.items()]
    small = [item for item in files if 0 < item[2].size <= WHOLE_UPLOAD_MAX]
    large = [item for item in files if not 0 < item[2].size <= WHOLE_UPLOAD_MAX]
    with ThreadPoolExecutor(max_workers=LOCAL_THREADS if local else UPLOAD_THREADS, thread_name_prefix="adopt") as pool:
        futures = [pool.submit(_create, store, *item) for item in large]
        futures += [pool.submit(_create_batch, store, batch) for batch in _batches(small, BATCH_FILES if local else 1)]
        for future in futures:
            future.result()


def _sweep_temporaries(store: Store, part_key: str) -> None:
    """Remove the temporary files an interrupted adoption of this part left in a local draft (a
    local store's create-only writes go through ``.tmp-*`` files beside the keys). Each part has
    one writer, so nothing else writes there."""
    for info in store.walk(part_key):
        if info.key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
            store.delete(info.key)


def _batches(files: list[tuple[str, Path, FileFacts]], most: int) -> Iterator[list[tuple[str, Path, FileFacts]]]:
    """``files`` in runs of at most ``most`` files and :data:`BATCH_BYTES` bytes (a file alone may be
    larger), in order."""
    batch: list[tuple[str, Path, FileFacts]] = []
    size = 0
    for item in files:
        if batch and (len(batch) == most or size + item[2].size > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[2].size
    if batch:
        yield batch


def _checked_bytes(path: Path, facts: FileFacts) -> bytes:
    """The bytes of ``path``, which must still be those of ``facts``."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptSnapshotError(f"{path}: cannot read: {exc}") from None
    if len(data) != facts.size or checksum_bytes(data) != facts.checksum:
        raise _changed(path)
    return data


def _create_batch(store: Store, files: list[tuple[str, Path, FileFacts]]) -> None:
    """Step 3 for a batch of small files: each ``(key, path, facts)`` created at once; a key that
    already existed must already hold the bytes."""
    conflicts = set(store.create_exclusive_many([(key, _checked_bytes(path, facts)) for key, path, facts in files]))
    for key, _, facts in files:
        if key in conflicts:
            _check_existing(store, key, facts)


def _create(store: Store, key: str, path: Path, facts: FileFacts) -> None:
    """Step 3 for one empty or large file: create ``key`` with the bytes of ``path``, which must
    still be those of ``facts``; an existing key must already hold them."""
    if store.exists(key):  # an empty object cannot be created conditionally on S3, a large one is streamed
        _check_existing(store, key, facts)
        return
    hasher = new_hasher()
    try:
        with open(path, "rb") as src, store.open_write(key) as dst:
            size = 0
            while chunk := src.read(_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
                dst.write(chunk)
            if size != facts.size or f"xxh128:{hasher.hexdigest()}" != facts.checksum:
                raise _changed(path)  # inside the with: the upload is aborted, not completed
    except FileExistsError:
        _check_existing(store, key, facts)
    except OSError as exc:
        raise CorruptSnapshotError(f"{path}: cannot read: {exc}") from None


def _check_existing(store: Store, key: str, facts: FileFacts) -> None:
    where = store.display(key)
    size = store.info(key).size
    if size == facts.size:
        with store.open_read(key) as fh:
            if checksum_stream(fh, facts.checksum) == facts.checksum:
                return
    raise InvalidPathError(f"{where}: already exists with other bytes (each file of a snapshot has one writer)")


def _same_part(store: Store, key: str, part: PartManifest) -> bytes:
    """The bytes of an existing part manifest that lists the same files, prefix and writer."""
    where = store.display(key)
    data = store.read_bytes(key, limit=MAX_JSON_PART_BYTES)
    existing = jsonl.decode_json(data, PartManifest, where)
    if (existing.snapshot_id, existing.prefix, existing.writer, existing.files) != (
            part.snapshot_id, part.prefix, part.writer, part.files):
        raise InvalidPathError(f"{where}: the part was already adopted with other files (each part has one writer)")
    return data


# -- the way back ----------------------------------------------------------------------------------------------
def materialize_part(snapshot: Snapshot | str, prefix: str, local_dir: str) -> list[str]:
    """Download the part ``prefix`` of a published snapshot into ``local_dir`` as plain files.

    The part manifest is read (checksum checked against the snapshot's manifest) and every file it
    lists must be the snapshot's own entry. Each file is streamed into a temporary file, its size
    and checksum checked, then renamed in place (a file already there with the right bytes is
    kept); ``local_dir`` must hold no other file. A Gym folder's ``manifest.json`` is then checked
    against the bytes as on adoption. Returns the names written or kept, relative to ``local_dir``.
    """
    snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot)
    names = _part_files(snap, prefix)
    folder = Path(local_dir)
    folder.mkdir(parents=True, exist_ok=True)
    extra = sorted(set(list_folder(folder)) - set(names))
    if extra:
        raise InvalidPathError(f"{folder}: holds files the part {prefix!r} does not list: {extra} "
                               "(expected an empty folder or an earlier download of the same part)")
    for name, f in sorted(names.items()):
        target = folder / name
        if target.is_file() and target.stat().st_size == f.size:
            with open(target, "rb") as fh:
                if checksum_stream(fh, f.checksum) == f.checksum:
                    continue
        atomic_write_chunks(target, _verified(snap, f))
    _check_gym_manifest(folder, prefix, names)
    return sorted(names)


def check_part(snap: Snapshot, prefix: str) -> str:
    """Check a published part of a snapshot on local disk where it lies, and return its folder: every
    file its part manifest lists is the snapshot's own entry and has that size and checksum, and a
    Gym folder's ``manifest.json`` agrees with the bytes (as on adoption). A restore hands Gym this
    folder only after the check, so a participant never reads bytes the snapshot does not vouch
    for. Raises :class:`~schemas.errors.CorruptSnapshotError` naming the file; ``InvalidPathError``
    for a store that is not local disk (use :func:`materialize_part` there)."""
    names = _part_files(snap, prefix)
    local = snap.store.local_path(layout.file_key(snap.manifest.snapshot_id, prefix))
    if local is None:
        raise InvalidPathError(f"{snap.url}: part {prefix!r} is not on local disk; download it with materialize_part")
    folder = Path(local)
    # A Gym part: one read per file, whose scan gives both the store's checksum and what Gym's
    # manifest check needs (at 10,000 rollouts a restore reads 20,000 such files).
    gym = component_of_prefix(prefix) is not None or MANIFEST_NAME in names
    facts: dict[str, FileFacts] = {}
    for name, f in sorted(names.items()):
        path = os.path.join(local, name)  # a str, not a Path: pathlib's joins were a tenth of the check
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{snap.where(f)}: listed by part {prefix!r} but missing") from None
        checksum = None
        if size == f.size and gym:
            facts[name] = scan_file(path)
            checksum = facts[name].checksum
        if size == f.size and (checksum or "").partition(":")[0] != f.checksum.partition(":")[0]:
            with open(path, "rb") as fh:  # not a Gym part, or another algorithm than the scan's
                checksum = checksum_stream(fh, f.checksum)
        if size != f.size or checksum != f.checksum:
            raise CorruptSnapshotError(f"{snap.where(f)}: size {size}, checksum {checksum}; the part manifest lists "
                                       f"size {f.size}, checksum {f.checksum}")
    if gym:
        for name in list_folder(folder):  # files the part does not list: Gym's check sees them, as on adoption
            if name not in facts:
                facts[name] = scan_file(folder / name)
        _check_gym_manifest(folder, prefix, names, facts)
    return str(folder)


def _part_files(snap: Snapshot, prefix: str) -> dict[str, FileEntry]:
    """The files of part ``prefix`` by name under it: its part manifest (checksum checked against the
    snapshot's manifest) must list only the snapshot's own entries; a listed part's are its part
    manifest's (checked against the manifest's totals, SPEC §10.4)."""
    prefix = check_relative_path(prefix, where="part prefix")
    if snap.is_listed(prefix):
        return {f.path[len(prefix) + 1:]: f for f in snap.part_files(prefix)}
    entries = {f.path: f for f in snap.manifest.files}
    pm = entries.get(f"{prefix}/{layout.PART_MANIFEST_NAME}")
    if pm is None:
        raise NotPublishedError(f"{snap.url}: has no part {prefix!r}")
    part = jsonl.decode_json(snap.read_bytes(pm), PartManifest, snap.where(pm))
    if part.prefix != prefix:
        raise CorruptSnapshotError(f"{snap.where(pm)}: is the part manifest of {part.prefix!r}, expected {prefix!r}")
    names: dict[str, FileEntry] = {}
    for f in part.files:
        listed = entries.get(f.path)
        if listed is None or (listed.size, listed.checksum) != (f.size, f.checksum):
            raise CorruptSnapshotError(f"{snap.where(pm)}: lists {f.path!r}, which the snapshot's manifest "
                                       f"{'does not list' if listed is None else 'lists with another size or checksum'}")
        names[f.path[len(prefix) + 1:]] = f
    return names


def _check_gym_manifest(folder: Path, prefix: str, names: dict[str, FileEntry],
                        facts: dict[str, FileFacts] | None = None) -> None:
    """Gym's ``manifest.json`` of a part's ``folder`` against the bytes (``facts``: :func:`scan_folder`'s
    when already computed)."""
    component = component_of_prefix(prefix)
    if component is not None:
        check_folder(folder, component=component, base=prefix.split("/", 1)[1], facts=facts)
    elif MANIFEST_NAME in names:
        check_gym_part(folder, prefix, scan_folder(folder) if facts is None else facts)


def _verified(snap: Snapshot, entry: FileEntry) -> Iterator[bytes]:
    """The file's bytes in chunks; raises (so the temporary file is dropped) unless they have the
    entry's size and checksum."""
    where = snap.where(entry)
    snap.check_present(entry)
    hasher = new_hasher(entry.checksum.partition(":")[0])
    size = 0
    with snap.store.open_read(snap.key(entry)) as fh:
        while chunk := fh.read(_CHUNK):
            size += len(chunk)
            if size > entry.size:
                break
            hasher.update(chunk)
            yield chunk
    if size != entry.size:
        raise CorruptSnapshotError(f"{where}: read {size if size <= entry.size else 'more than ' + str(entry.size)} "
                                   f"bytes, the manifest says {entry.size}")
    actual = f"{entry.checksum.partition(':')[0]}:{hasher.hexdigest()}"
    if actual != entry.checksum:
        raise CorruptSnapshotError(f"{where}: checksum mismatch (manifest says {entry.checksum}, file has {actual})")


def gym_prefixes(snap: Snapshot) -> list[str]:
    """The prefixes of the snapshot's parts that lie in Gym's layout, in manifest order."""
    suffix = "/" + layout.PART_MANIFEST_NAME
    return [f.path[: -len(suffix)] for f in snap.manifest.files
            if f.kind == "part_manifest" and component_of_prefix(f.path[: -len(suffix)]) is not None]


def materialize_gym(snapshot: Snapshot | str, checkpoint_dir: str) -> list[str]:
    """Download every Gym part of a published snapshot (:func:`gym_prefixes`) into a local
    ``checkpoint_dir``, part ``gym/<folder>`` at ``checkpoint_dir/<folder>``, for Gym servers to
    restore from. Returns the prefixes."""
    snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot)
    prefixes = gym_prefixes(snap)
    for prefix in prefixes:
        materialize_part(snap, prefix, str(Path(checkpoint_dir) / prefix.split("/", 1)[1]))
    return prefixes


def gym_folders(checkpoint_dir: str) -> list[str]:
    """The participant folders of a local ``checkpoint_dir`` (each holding a ``manifest.json``),
    relative to it: ``agent`` or ``agent/instance-*``, ``model-ledger/*``, ``resources/*``. A
    participant folder without its manifest (a commit that did not finish), or an unnamed agent
    folder beside named ones, is refused."""
    root = Path(checkpoint_dir)
    found = []
    agent = root / AGENT_DIR
    if agent.is_dir():
        subs = sorted(p for p in agent.iterdir() if p.is_dir() and p.name.startswith("instance-"))
        if (agent / MANIFEST_NAME).exists():
            if subs:
                raise InvalidPathError(f"{agent}: holds an unnamed agent's manifest.json and named instances "
                                       f"{[p.name for p in subs]} (their parts would overlap)")
            found.append(AGENT_DIR)
        found.extend(f"{AGENT_DIR}/{p.name}" for p in subs)
    for top in (LEDGER_DIR, RESOURCES_DIR):
        if (root / top).is_dir():
            found.extend(f"{top}/{p.name}" for p in sorted((root / top).iterdir()) if p.is_dir())
    for rel in found:
        if not (root / rel / MANIFEST_NAME).is_file():
            raise CorruptSnapshotError(f"{root / rel / MANIFEST_NAME}: missing (the participant's commit did not "
                                       "finish: a Gym participant writes its manifest.json last)")
    return found


def adopt_gym_dir(draft_url: str, checkpoint_dir: str, writer: str | None = None) -> list[PartReceipt]:
    """:func:`adopt_part` of every participant folder of ``checkpoint_dir`` (:func:`gym_folders`),
    folder ``<f>`` as part ``gym/<f>``; on local disk with ``checkpoint_dir`` = ``<draft>/gym`` the
    files stay where they are."""
    return [adopt_part(draft_url, str(Path(checkpoint_dir) / rel), f"{layout.GYM_PREFIX}/{rel}", writer)
            for rel in gym_folders(checkpoint_dir)]


__all__ = ["WHOLE_UPLOAD_MAX", "adopt_gym_dir", "adopt_part", "check_gym_part", "gym_folders",
           "gym_prefixes", "materialize_gym", "materialize_part"]
