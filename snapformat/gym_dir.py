"""Gym's own files in ``checkpoint_dir`` (CONTROL.md §6), checked against their bytes.

A Gym participant writes plain files into a folder of ``checkpoint_dir`` and binds them in its
``manifest.json`` by SHA-256 (schemas/gym_files.py has the structs). Before such a folder becomes a
part of a snapshot (``snapformat.adopt``), and after it is brought back from a store, every
promise of that manifest is checked against the bytes:

* **agent** (``agent/instance-<sha256(name)>/``): both artifact references (``record_index``,
  ``continuation_index``: ``sha256``, ``bytes``, non-blank ``records``), every archive's
  ``sha256``, ``bytes`` and ``members``, ``records`` against the index, and each
  ``agent-index.jsonl`` row against its archive member (``<rid>.a<n>.json``, ``sha256``,
  ``bytes``); no member without a row.
* **ledger** (``model-ledger/<server_name>/``): the ``storage_reference_index`` reference, and each
  rollout's ``files`` (name -> sha256) with its ``rows`` (non-blank lines) and ``bytes``.
* **resources** (``resources/<server_name>/``): every ``files`` entry (name -> sha256).

Artifact references name paths relative to ``checkpoint_dir``; a folder's own references must lie
inside the folder that its manifest names (``agent_instance_dir(instance_name)``,
``ledger_dir(server_name)``, ``resources_dir(server_name)``), so a folder can be checked wherever it
lies (a staging folder, a draft). Nothing here imports gymkit: ``gymkit.checkpoint_dir`` writes
these files and reuses these checks to read them.

The bytes themselves are built here too, once (:func:`jsonl_bytes`, :func:`document_bytes`,
:func:`manifest_bytes`, :func:`continuation_roots`; an agent's archives by
:func:`snapformat.tar_archive.tar_bytes`), and written so too: a commit's data files together
through :class:`DurableFiles` (each temp, fsync, rename, on a few threads; then each folder
fsynced once), then the manifest (:func:`write_manifest`, one
:func:`atomic_write`), CONTROL §6.2. gymkit's writers and the example store's writer
(``snapformat.example``, which may not import gymkit) both use them, so the same records give the
same bytes whoever writes them.

Errors are typed: a byte, size or count that differs is a :class:`CorruptSnapshotError`, a
manifest or row that breaks its struct an :class:`InvalidRecordError`, a path that would leave the
folder an :class:`InvalidPathError`; each names the file, the field and what was expected.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import msgspec

from schemas.errors import CorruptSnapshotError, InvalidPathError, InvalidRecordError, StoreError
from schemas.gym_files import (
    AGENT_DIR,
    LEDGER_DIR,
    MANIFEST_NAME,
    RESOURCES_DIR,
    AgentBoundaryRecord,
    AgentIndexEntry,
    AgentManifest,
    ArtifactRef,
    LedgerManifest,
    ResourcesManifest,
    agent_instance_dir,
    attempt_member,
    ledger_dir,
    resources_dir,
)
from schemas.gym_records import AgentContinuationRoot
from schemas.identity import capture_key, check_name, check_relative_path
from snapformat.checksum import new_hasher
from snapformat.jsonl import decoder
from snapformat.layout import GYM_PREFIX
from snapformat.mounts import mount_of
from snapformat.tar_archive import read_members

GymComponent = Literal["agent", "ledger", "resources"]
GymManifest = AgentManifest | LedgerManifest | ResourcesManifest
MANIFEST_TYPES: dict[str, Any] = {"agent": AgentManifest, "ledger": LedgerManifest, "resources": ResourcesManifest}
#: The first segment of each component's folder under ``checkpoint_dir``.
COMPONENT_DIRS: dict[str, str] = {"agent": AGENT_DIR, "ledger": LEDGER_DIR, "resources": RESOURCES_DIR}
#: Temporary files of an atomic write (temp -> fsync -> rename) start so; a crash may leave one
#: behind. They are never part of a folder's files.
TEMP_PREFIX = ".tmp-"
MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 8 << 20
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class MemberFacts(msgspec.Struct, frozen=True, kw_only=True):
    """One member of a ``.tar`` archive, as the scan of the archive found it."""

    size: int
    sha256: str
    #: The member's bytes, if the scan was asked to keep them.
    data: bytes | None = None


class FileFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What one pass over a file's bytes found."""

    size: int
    sha256: str
    #: The store's checksum (``xxh128:<hex>``), for the part manifest.
    checksum: str
    #: Non-blank lines of a ``.jsonl`` file (what an artifact reference's ``records`` counts); None
    #: for any other file (a JSON document's lines are no records, and counting them cost a restore
    #: of 10,000 rollouts 0.4 s: a resources session is ~180 lines).
    lines: int | None
    #: Members of a ``.tar`` archive; None for other files.
    members: int | None
    #: A part manifest's ``records`` for the file (:func:`count_records`).
    records: int
    #: The bytes read, if the scan was asked to keep them (a reader that decodes the file next). Not
    #: for a ``.tar`` archive: its members' bytes are kept instead (:attr:`archive`).
    data: bytes | None = None
    #: Each member of a ``.tar`` archive by name, from the bytes this scan hashed: the agent check
    #: compares them with its index rows without reading the archive again. None for other files.
    archive: dict[str, MemberFacts] | None = None


JSONL_SUFFIX = ".jsonl"


def count_records(name: str, lines: int | None, members: int | None) -> int:
    """``records`` of a ``gym_file`` entry named ``name``: members of a ``.tar``, non-blank lines of
    a ``.jsonl``, else 1 (a JSON document)."""
    if name.endswith(".tar"):
        return members or 0
    if name.endswith(JSONL_SUFFIX):
        return lines or 0
    return 1


def scan_file(path: str | os.PathLike[str], *, keep: bool = False) -> FileFacts:
    """Size, SHA-256, the store's checksum, non-blank lines (a ``.jsonl``) and archive members (a
    ``.tar``: each member's size and SHA-256) of ``path``, in one read; with ``keep``, the bytes
    read too (an archive's as its members' bytes)."""
    sha, xxh = hashlib.sha256(), new_hasher()
    size, lines = 0, 0
    name = os.path.basename(path)
    archive = name.endswith(".tar")
    counted = name.endswith(JSONL_SUFFIX)  # only a JSON-lines file's lines are records
    unfinished = False  # the last line of the chunks so far has a non-blank byte and no b"\n" yet
    kept: list[bytes] = []  # an archive's chunks, whose members are counted from the same read
    try:
        with open(path, "rb") as fh:
            # Whole chunks hashed at once: hashing line by line cost a restore of 10,000 rollouts most
            # of its check (a resources session is a JSON document of ~180 lines; cProfile).
            while chunk := fh.read(_CHUNK):
                sha.update(chunk)
                xxh.update(chunk)
                size += len(chunk)
                if counted:
                    done, unfinished = _non_blank_lines(chunk, unfinished)
                    lines += done
                if archive or keep:
                    kept.append(chunk)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{path}: missing") from None
    except OSError as exc:
        raise CorruptSnapshotError(f"{path}: cannot read: {exc}") from None
    lines += unfinished  # a last line without b"\n" counts too
    data = b"".join(kept) if archive or keep else None
    del kept
    found: dict[str, MemberFacts] | None = None
    if archive:
        assert data is not None
        # Each member hashed here, from the bytes just read: the agent check used to read and parse
        # every archive again for its members' digests (and the agent's restore a third time).
        found = {member: MemberFacts(size=len(body), sha256=sha256_hex(body), data=body if keep else None)
                 for member, body in read_members(data, str(path)).items()}
        data = None
    members = len(found) if found is not None else None
    return FileFacts(size=size, sha256=sha.hexdigest(), checksum=f"xxh128:{xxh.hexdigest()}",
                     lines=lines if counted else None, members=members,
                     records=count_records(name, lines if counted else None, members),
                     data=data if keep else None, archive=found)


def non_blank_lines(data: bytes) -> int:
    """The non-blank lines of ``data`` (b"\\n"-split pieces with a byte ``bytes.strip`` keeps): a
    JSON-lines file's ``records``, as :func:`scan_file` counts them."""
    done, unfinished = _non_blank_lines(data, False)
    return done + unfinished


def _non_blank_lines(chunk: bytes, unfinished: bool) -> tuple[int, bool]:
    """Lines of ``chunk`` ended by its b"\\n"s that hold a non-blank byte (``bytes.strip``, as Gym's
    readers skip blank lines), the first one joined to the line the chunks before left
    ``unfinished`` (non-blank); and whether the line after its last b"\\n" is non-blank so far."""
    pieces = chunk.split(b"\n")
    if len(pieces) == 1:
        return 0, unfinished or bool(pieces[0].strip())
    done = int(unfinished or bool(pieces[0].strip())) + sum(1 for line in pieces[1:-1] if line.strip())
    return done, bool(pieces[-1].strip())


def list_folder(folder: Path, skip: Iterable[str] = ()) -> list[str]:
    """Every regular file under ``folder``, as sorted ``/``-separated names relative to it.

    Temporary files of an interrupted atomic write (:data:`TEMP_PREFIX`) and the names in ``skip``
    (relative names) are left out; every other name must be a safe relative path (SPEC §5) and a
    regular file, else :class:`InvalidPathError`.
    """
    skipped = set(skip)
    names = []
    if not folder.is_dir():
        raise InvalidPathError(f"{folder}: not a folder")
    # os.scandir, not os.walk and pathlib: each entry's type comes with its name (no stat per file),
    # which made listing a restore's 20,000 files 2.3 s of cProfile'd time.
    pending = [(os.fspath(folder), "")]
    while pending:
        dirpath, under = pending.pop()
        try:
            with os.scandir(dirpath) as entries:
                for entry in entries:
                    rel = f"{under}{entry.name}"
                    if entry.is_dir():  # a link to a folder is one too, as os.walk lists it
                        if entry.is_symlink():
                            raise InvalidPathError(f"{entry.path}: a symbolic link (expected plain files and folders)")
                        pending.append((entry.path, f"{rel}/"))
                        continue
                    if entry.name.startswith(TEMP_PREFIX) or rel in skipped:
                        continue
                    if entry.is_symlink() or not entry.is_file():
                        raise InvalidPathError(f"{entry.path}: not a regular file (expected plain files)")
                    check_relative_path(rel, where=f"{folder}: file name")
                    names.append(rel)
        except OSError as exc:
            raise InvalidPathError(f"{dirpath}: cannot list the folder: {exc}") from exc
    return sorted(names)


def scan_folder(folder: Path, skip: Iterable[str] = (), *, keep: bool = False) -> dict[str, FileFacts]:
    """:func:`scan_file` of every file :func:`list_folder` lists, by relative name."""
    return {name: scan_file(folder / name, keep=keep) for name in list_folder(folder, skip)}


def read_tar_members(path: Path) -> dict[str, bytes]:
    """Every member's bytes of the archive at ``path``, by name (:func:`snapformat.tar_archive.read_members`)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptSnapshotError(f"{path}: cannot read the archive: {exc}") from None
    return read_members(data, str(path))


# -- durable plain files --------------------------------------------------------------------------------------
def _fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, outermost first."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
            created.append(d)
        except FileExistsError:
            pass
    return created


def _write_all(fd: int, chunks: Iterable[bytes]) -> None:
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]


def _temp_beside(path: str) -> str:
    """A fresh temporary name in ``path``'s folder: :data:`TEMP_PREFIX` and 32 random hex digits.
    Built from strings, not :class:`~pathlib.Path`: a commit names one per file, and at 10,000 files
    pathlib's parsing was a fifth of a model ledger's commit in memory (``cProfile``)."""
    return os.path.join(_folder_of(path), TEMP_PREFIX + os.urandom(16).hex())


def _folder_of(path: str) -> str:
    """The folder of ``path`` as a string (``"."`` for a bare name, as ``Path.parent`` gives)."""
    return os.path.dirname(path) or "."


@contextlib.contextmanager
def _temp_removed_on_failure(tmp: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """Around the writing of ``tmp`` (to be renamed to ``path``): on any failure, remove ``tmp`` and
    raise again, an :class:`OSError` as :class:`StoreError` naming ``path``."""
    try:
        yield
    except BaseException as exc:
        error = _failed_write(tmp, path, exc)
        if error is None:
            raise
        raise error from exc


def _failed_write(tmp: str, path: str | os.PathLike[str], exc: BaseException) -> StoreError | None:
    """After a write of ``path`` through ``tmp`` failed with ``exc``: remove ``tmp``; the error to
    raise instead, a :class:`StoreError` naming ``path`` for an :class:`OSError` (None: raise ``exc``)."""
    try:
        os.unlink(tmp)
    except OSError:
        pass
    return StoreError(f"{path}: cannot write: {exc}") if isinstance(exc, OSError) else None


def atomic_write_chunks(path: str | os.PathLike[str], chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` so that a reader sees the old file or the new one, never a mix:
    a temporary file in the same folder (``.tmp-*``), written, fsynced, renamed over ``path``, then
    the folder fsynced (and each folder it had to create, in its parent). A crash leaves at most
    the temporary file, which readers and the publisher ignore. An exception from ``chunks``
    removes the temporary file and leaves ``path`` as it was. (Many files of one commit:
    :class:`DurableFiles`, one folder fsync for all of them.)"""
    path = Path(path)
    folder = path.parent
    tmp = _temp_beside(str(path))
    with _temp_removed_on_failure(tmp, path):
        created = _makedirs(folder)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_all(fd, chunks)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(folder)
        for d in created:
            _fsync_dir(d.parent)


#: Threads of a :class:`DurableFiles` that write and fsync a commit's files at once. On this
#: project's ext4 VM disk 4 to 32 threads came out alike, 2.1-2.5x faster per file than one file
#: after the other with a folder fsync each (``benchmarks/results/README.md``, "Gym protocol").
#: On a memory-backed file system (:mod:`snapformat.mounts`) an fsync writes nothing and the
#: threads only contend: 10,000 files of 3.7 KB on ``/dev/shm`` took 0.34 s on the calling thread
#: and 1.19 s on 8 (3.3 s on 8 and 5.1 s on one on the ext4 disk; medians of 3), so there a
#: :class:`DurableFiles` writes on the calling thread (:func:`writer_threads`).
FSYNC_WORKERS = 8
#: Bytes handed to the threads and not yet written; :meth:`DurableFiles.add` waits above this.
MAX_PENDING_BYTES = 64 << 20


def writer_threads(folder: str | os.PathLike[str]) -> int:
    """The threads a :class:`DurableFiles` writes into ``folder`` on: one on a memory-backed file
    system, else :data:`FSYNC_WORKERS` (also where the file system is unknown)."""
    mount = mount_of(folder)
    return 1 if mount is not None and mount.in_memory else FSYNC_WORKERS


def _write_renamed(path: str, chunks: Iterable[bytes], tmp: str) -> int:
    """One file of a :class:`DurableFiles`: temp ``tmp`` (a fresh name beside ``path``) -> write
    ``chunks`` (one after the other, never joined) -> fsync -> close -> rename (no folder fsync);
    the bytes written. A failure, of the write or of ``chunks``, removes the temporary file; an
    :class:`OSError` is raised as :class:`StoreError`. (The failure handling is written out, not
    :func:`_temp_removed_on_failure`: a commit writes one file per rollout, and at 10,000 files in
    memory the context manager's frames were a tenth of this function's time.)"""
    size = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            for chunk in chunks:
                _write_all(fd, (chunk,))
                size += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        error = _failed_write(tmp, path, exc)
        if error is None:
            raise
        raise error from exc
    return size


class DurableFiles:
    """The data files of one commit, written together; every one durable when the block ends::

        with DurableFiles() as out:
            out.add(folder / name, data)        # any number of files, in any folders
        write_manifest(folder, manifest)        # only now: temp, fsync, rename, folder fsync

    Each file goes temp (``.tmp-*`` beside it) -> write -> fsync -> rename, on one of ``workers``
    threads, so the fsyncs of a commit run in parallel (the file system commits them together)
    while the caller builds the next file's bytes. When the block ends without an exception, it
    waits for every file, then fsyncs each folder a file went into, and the parent of each folder
    it created, **once**: every file and every name is durable from then on (one folder fsync per
    commit instead of one per file). Only then may the caller write the manifest that names the
    files, so a manifest never becomes durable before a file it names.

    A crash before the end leaves some files renamed, maybe some temporary files (readers and the
    publisher ignore ``.tmp-*``) and no manifest: a folder readers refuse. An exception in the
    block or from a write waits for the writes already running, cancels the rest (their temporary
    files are removed) and is raised, a write's :class:`OSError` as :class:`StoreError`; files
    already renamed stay, named by no manifest. ``workers=1`` writes each file on the calling
    thread as it is added, in order. ``workers=None`` (the default) picks the number from the first
    added file's folder (:func:`writer_threads`: one on a memory-backed file system).
    """

    def __init__(self, workers: int | None = None, max_pending_bytes: int | None = None) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers is {workers}, expected at least 1")
        self.workers = workers  # None until the first add() looks at its folder
        # looked up here, not at import: the bound on bytes in flight is the module's current one
        self._max_pending_bytes = MAX_PENDING_BYTES if max_pending_bytes is None else max_pending_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future[None], int]] = deque()
        self._pending_bytes = 0
        #: Folders to fsync at the end (dict: insertion order, no repeats). Paths are kept as
        #: strings (``os.fspath``): see :func:`_temp_beside`.
        self._folders: dict[str, None] = {}
        self._ready: set[str] = set()
        # Temporary names: a random stem per instance and a count (one random draw per commit, not
        # one per file); O_EXCL still refuses a name that exists.
        self._temp_stem = f"{TEMP_PREFIX}{os.urandom(8).hex()}-"
        self._temps = itertools.count()
        self._done = False
        #: Files added and their bytes (for the caller's report).
        self.files = 0
        self.bytes = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.sync()
        else:
            self._abandon()

    def _folder(self, folder: str) -> None:
        if folder in self._ready:
            return
        try:
            created = _makedirs(Path(folder))
        except OSError as exc:
            raise StoreError(f"{folder}: cannot create the folder: {exc}") from exc
        for d in created:  # each created folder's name lives in its parent
            self._folders.setdefault(str(d.parent))
        self._folders.setdefault(folder)
        self._ready.add(folder)

    def add(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Write ``data`` to ``path`` (replacing a file there), durable when the block ends."""
        if self._done:
            raise RuntimeError("DurableFiles: add() after the files were synced")
        path = os.fspath(path)
        folder = _folder_of(path)
        self._folder(folder)
        self.files += 1
        self.bytes += len(data)
        workers = self.workers
        if workers is None:
            workers = self.workers = writer_threads(folder)
        tmp = self._temp_in(folder)
        if workers == 1:
            _write_renamed(path, (data,), tmp)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="snapformat-fsync")
        while self._pending and (self._pending[0][0].done() or len(self._pending) >= 4 * workers
                                 or self._pending_bytes + len(data) > self._max_pending_bytes):
            self._settle_one()
        self._pending.append((self._pool.submit(_write_renamed, path, (data,), tmp), len(data)))
        self._pending_bytes += len(data)

    def add_chunks(self, path: str | os.PathLike[str], chunks: Iterable[bytes]) -> int:
        """Write the concatenation of ``chunks`` to ``path`` (replacing a file there), durable when
        the block ends, and return its size. The chunks are written as they come, on the calling
        thread (temp -> write -> fsync -> rename), so a large file is never held whole: memory is
        one chunk. An exception from ``chunks`` removes the temporary file and is raised."""
        if self._done:
            raise RuntimeError("DurableFiles: add_chunks() after the files were synced")
        path = os.fspath(path)
        folder = _folder_of(path)
        self._folder(folder)
        size = _write_renamed(path, chunks, self._temp_in(folder))
        self.files += 1
        self.bytes += size
        return size

    def jsonl(self, checkpoint_dir: str | os.PathLike[str], relative_path: str, rows: Iterable[Any]) -> ArtifactRef:
        """Gym's JSON lines of ``rows`` (:func:`jsonl_bytes`, byte for byte) streamed to
        ``checkpoint_dir/relative_path`` (:meth:`add_chunks`), and the reference that binds them;
        ``relative_path`` is checked before a byte is written."""
        _check_jsonl_path(relative_path)
        chunks = JsonlChunks(rows)
        self.add_chunks(Path(checkpoint_dir) / relative_path, chunks)
        return chunks.ref(relative_path)

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` (a file of an earlier commit into the same folder); the removal is
        durable when the block ends, like the files added."""
        path = os.fspath(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"{path}: cannot remove a file of an earlier commit: {exc}") from exc
        folder = _folder_of(path)
        self._folders.setdefault(folder)
        self._ready.add(folder)

    def _temp_in(self, folder: str) -> str:
        """A fresh temporary name in ``folder`` (:data:`TEMP_PREFIX`, this instance's stem, a count)."""
        return f"{folder}{os.sep}{self._temp_stem}{next(self._temps):x}"

    def _settle_one(self) -> None:
        future, size = self._pending.popleft()
        self._pending_bytes -= size
        future.result()

    def sync(self) -> None:
        """Wait for every file, then fsync each folder touched once. Called by the block's end."""
        if self._done:
            return
        try:
            while self._pending:
                self._settle_one()
        except BaseException:
            self._abandon()
            raise
        self._done = True
        folders = list(self._folders)
        try:
            if self._pool is not None and len(folders) > 1:
                for future in [self._pool.submit(_fsync_dir, f) for f in folders]:
                    future.result()
            else:
                for f in folders:
                    _fsync_dir(f)
        except OSError as exc:
            raise StoreError(f"cannot fsync the folders of a commit ({', '.join(map(str, folders))}): {exc}") from exc
        finally:
            self._shutdown()

    def _abandon(self) -> None:
        """Cancel the writes not started, wait for the running ones (their errors dropped)."""
        self._done = True
        for future, _ in self._pending:
            future.cancel()
        for future, _ in self._pending:
            if not future.cancelled():
                with contextlib.suppress(BaseException):  # the block's own exception is the one raised
                    future.result()
        self._pending.clear()
        self._pending_bytes = 0
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`atomic_write_chunks` of one piece: temp -> write -> fsync -> rename -> folder fsync."""
    atomic_write_chunks(path, (data,))


# -- Gym's serialization: the one builder of each kind of bytes --------------------------------------------
# gymkit's writers (``gymkit.checkpoint_dir``) and the example store's writer (``snapformat.example``)
# both build Gym's bytes here, so a file of the same records is the same bytes whoever writes it.
_encoder = msgspec.json.Encoder()
#: ``indent`` of each component's ``manifest.json`` (keys always sorted).
MANIFEST_INDENT: dict[str, int] = {"agent": 2, "ledger": 1, "resources": 2}


def jsonl_bytes(rows: Iterable[Any]) -> bytes:
    """Gym's JSON lines: each row as compact JSON (fields in declaration order, no spaces), then ``\\n``."""
    return _encoder.encode_lines(rows)


def compact_json(value: Any) -> bytes:
    """One value as a JSON line of :func:`jsonl_bytes` holds it (compact, fields in declaration order,
    no newline): the bytes a writer may encode ahead and embed in a row as ``msgspec.Raw``."""
    return _encoder.encode(value)


def document_bytes(value: Any, *, sort_keys: bool, indent: int) -> bytes:
    """A Gym JSON document: ``json.dumps`` of the value with Gym's ``sort_keys`` and ``indent``, no final
    newline. Manifests sort their keys (:func:`manifest_bytes`); a record file (an archive member, a
    resources session) keeps declaration order with indent 2.

    The same bytes, built faster: ``json.dumps`` with an ``indent`` runs Python's pure-Python encoder
    (its C encoder serves only compact output), 5-7x slower than its compact C encoding re-indented
    by ``msgspec.json.format``, which copies every string and number token as it is (so
    ``ensure_ascii`` escapes and Python's float repr stay) and lays out ``": "``, ``",\n"`` and
    empty containers as ``json.dumps`` does (``tests/gymkit/test_checkpoint_dir.py`` compares the
    two on random documents). What ``msgspec`` cannot parse (``NaN``, ``Infinity``, which
    ``json.dumps`` writes) takes ``json.dumps`` itself."""
    builtins = msgspec.to_builtins(value)
    if indent > 0:
        compact = json.dumps(builtins, sort_keys=sort_keys, separators=(",", ":")).encode()
        try:
            return msgspec.json.format(compact, indent=indent)
        except msgspec.DecodeError:
            pass
    return json.dumps(builtins, sort_keys=sort_keys, indent=indent).encode()


def nested_document_bytes(value: Any, depth: int) -> bytes:
    """``value`` as a record file (:func:`document_bytes`: declaration order, indent 2) lays it out
    ``depth`` levels in: the bytes a writer may encode ahead and splice into one
    (:func:`document_bytes_spliced`). Every line is indented by ``depth`` more levels (a raw newline
    is only ever layout: JSON escapes the ones in strings)."""
    pad = b"  " * depth
    return pad + document_bytes(value, sort_keys=False, indent=2).replace(b"\n", b"\n" + pad)


def document_bytes_spliced(value: Any, field: str, items: Sequence[bytes]) -> bytes:
    """The record file of ``value`` (declaration order, indent 2) with its top-level list ``field``
    holding ``items``, each already laid out two levels in (:func:`nested_document_bytes` of
    depth 2): the bytes :func:`document_bytes` gives for ``value`` holding those items, built
    without encoding them again. ``value``'s own ``field`` must be empty.

    Found by its line ``\n  "<field>": []``: only a top-level key's line starts with a newline and
    exactly two spaces, and a record's keys are unique."""
    base = document_bytes(value, sort_keys=False, indent=2)
    empty = b'\n  "' + field.encode() + b'": []'
    at = base.find(empty)
    if at < 0:
        raise ValueError(f"{field!r} is not an empty top-level list of the record")
    if not items:
        return base
    return b"".join((base[:at], empty[:-1], b"\n", b",\n".join(items), b"\n  ]", base[at + len(empty):]))


def manifest_bytes(manifest: GymManifest) -> tuple[bytes, str]:
    """A Gym manifest's bytes (sorted keys, its component's :data:`MANIFEST_INDENT`) and its
    ``manifest_digest`` (their SHA-256 hex)."""
    for component, manifest_type in MANIFEST_TYPES.items():
        if isinstance(manifest, manifest_type):
            data = document_bytes(manifest, sort_keys=True, indent=MANIFEST_INDENT[component])
            return data, sha256_hex(data)
    raise InvalidRecordError(f"{type(manifest).__name__} is not a Gym manifest")


def write_manifest(folder: str | os.PathLike[str], manifest: GymManifest) -> str:
    """Write ``folder/manifest.json`` (last, atomically: temp, fsync, rename, folder fsync) and return
    its ``manifest_digest``. Call it only once every file it names is durable (the end of the
    :class:`DurableFiles` block that wrote them)."""
    data, digest = manifest_bytes(manifest)
    atomic_write(Path(folder) / MANIFEST_NAME, data)
    return digest


#: Rows encoded and written at a time by :class:`JsonlChunks` (a chunk is ~100-300 KiB of Gym's rows).
JSONL_CHUNK_ROWS = 1024


class JsonlChunks:
    """Gym's JSON lines of ``rows`` (:func:`jsonl_bytes`, byte for byte) as chunks of at most
    :data:`JSONL_CHUNK_ROWS` rows, hashed and counted as they are produced, so a file of any
    number of rows is written in bounded memory. Iterate once; then :meth:`ref` binds the bytes."""

    def __init__(self, rows: Iterable[Any]) -> None:
        self._rows = rows
        self._sha = hashlib.sha256()
        self.bytes = 0
        self.records = 0
        self._done = False

    def __iter__(self) -> Iterator[bytes]:
        if self._done:
            raise RuntimeError("JsonlChunks: iterated twice")
        self._done = True
        batch: list[Any] = []
        for row in self._rows:
            batch.append(row)
            if len(batch) >= JSONL_CHUNK_ROWS:
                yield self._emit(batch)
                batch = []
        if batch:
            yield self._emit(batch)

    def _emit(self, batch: list[Any]) -> bytes:
        data = _encoder.encode_lines(batch)  # each row's compact JSON and b"\n", in one call
        self._sha.update(data)
        self.bytes += len(data)
        self.records += len(batch)  # a row's compact JSON is never blank: one row, one non-blank line
        return data

    def ref(self, relative_path: str) -> ArtifactRef:
        """The reference binding the bytes produced (after the iteration)."""
        if not self._done:
            raise RuntimeError("JsonlChunks: ref() before the rows were written")
        try:
            return ArtifactRef(relative_path=relative_path, sha256=self._sha.hexdigest(), records=self.records,
                               bytes=self.bytes)
        except ValueError as exc:
            raise InvalidPathError(str(exc)) from None


def _check_jsonl_path(relative_path: str) -> None:
    """An artifact reference's ``relative_path`` rule, checked before a file is written there."""
    try:
        ArtifactRef(relative_path=relative_path, sha256="0" * 64, records=0, bytes=0)
    except ValueError as exc:
        raise InvalidPathError(str(exc)) from None


def jsonl_file(relative_path: str, rows: Iterable[Any]) -> tuple[ArtifactRef, bytes]:
    """The bytes of ``rows`` (:func:`jsonl_bytes`) and the reference that binds them at
    ``relative_path``: SHA-256 over every byte, ``bytes``, ``records`` (rows). Nothing is written."""
    rows = list(rows)
    data = jsonl_bytes(rows)
    try:
        ref = ArtifactRef(relative_path=relative_path, sha256=sha256_hex(data), records=len(rows), bytes=len(data))
    except ValueError as exc:
        raise InvalidPathError(str(exc)) from None
    return ref, data


def write_jsonl(checkpoint_dir: str | os.PathLike[str], relative_path: str, rows: Iterable[Any],
                out: DurableFiles | None = None) -> ArtifactRef:
    """Write ``rows`` (the bytes of :func:`jsonl_file`) to ``checkpoint_dir/relative_path`` and return
    the reference that binds them: into ``out`` (durable when its block ends), else on its own
    (temp, fsync, rename, folder fsync: durable when this returns). The rows are encoded, hashed
    and written a chunk at a time (:class:`JsonlChunks`), never joined into one bytes object."""
    if out is not None:
        return out.jsonl(checkpoint_dir, relative_path, rows)
    _check_jsonl_path(relative_path)
    chunks = JsonlChunks(rows)
    atomic_write_chunks(Path(checkpoint_dir) / relative_path, chunks)
    return chunks.ref(relative_path)


def continuation_roots(records: Iterable[AgentBoundaryRecord]) -> list[AgentContinuationRoot]:
    """Gym's continuation index of a set of boundary records: one root per record with a last
    committed model call (its exact capture key and its resource revisions, maybe ``{}``), sorted
    by (capture_key, last_committed_model_call_id)."""
    roots = [root for r in records if (root := continuation_root(r)) is not None]
    return sorted(roots, key=root_order)


def continuation_root(record: AgentBoundaryRecord) -> AgentContinuationRoot | None:
    """The continuation root of one boundary record (None when it names no last model call)."""
    if not record.last_committed_model_call_id:
        return None
    return AgentContinuationRoot(rollout_id=record.rollout_id, attempt_index=record.attempt_index,
                                 capture_key=capture_key(record.rollout_id, record.attempt_index),
                                 last_committed_model_call_id=record.last_committed_model_call_id,
                                 resource_state_revisions=dict(record.resource_state_revisions))


def root_order(root: AgentContinuationRoot) -> tuple[str, str]:
    """Gym's order of continuation roots: (capture_key, last_committed_model_call_id)."""
    return root.capture_key, root.last_committed_model_call_id


def continuation_roots_sha256(roots: Iterable[AgentContinuationRoot]) -> str:
    """The ledger's ``continuation_roots_sha256``: SHA-256 hex of the JSON list of the roots sorted
    by (capture_key, last_committed_model_call_id), keys sorted, separators ``(",", ":")``."""
    # json.dumps of a list with separators (",", ":") is "[" + ",".join(json.dumps(item)) + "]", so the
    # digest is fed a slice of roots at a time instead of from one string of every root.
    ordered = sorted(roots, key=root_order)
    sha = hashlib.sha256(b"[")
    for start in range(0, len(ordered), JSONL_CHUNK_ROWS):
        if start:
            sha.update(b",")
        sha.update(_sorted_compact_json(ordered[start:start + JSONL_CHUNK_ROWS])[1:-1])
    sha.update(b"]")
    return sha.hexdigest()


_sorted_encoder = msgspec.json.Encoder(order="sorted")


def _sorted_compact_json(value: Any) -> bytes:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"))`` of msgspec values made of strings,
    integers, None, lists, maps and structs. msgspec's sorted encoding gives the same bytes (one call
    in C; json.dumps of each root took 42 ms of a 0.5 s model commit at 10,000 roots) as long as they
    are ASCII below 0x7f; json.dumps escapes 0x7f and every non-ASCII character, so anything else
    takes json.dumps itself."""
    data = _sorted_encoder.encode(value)
    if data.isascii() and b"\x7f" not in data:
        return data
    return json.dumps(msgspec.to_builtins(value), sort_keys=True, separators=(",", ":")).encode()


# -- where a folder belongs -------------------------------------------------------------------------------
def component_of_prefix(prefix: str) -> GymComponent | None:
    """The component a part prefix of Gym's layout names: ``gym/agent`` and ``gym/agent/<x>`` an
    agent, ``gym/model-ledger/<name>`` a model ledger, ``gym/resources/<name>`` a resources server;
    None for any other prefix."""
    parts = prefix.split("/")
    if len(parts) < 2 or parts[0] != GYM_PREFIX:
        return None
    if parts[1] == AGENT_DIR and len(parts) in (2, 3):
        return "agent"
    if parts[1] == LEDGER_DIR and len(parts) == 3:
        return "ledger"
    if parts[1] == RESOURCES_DIR and len(parts) == 3:
        return "resources"
    return None


def component_of_fields(document: Any) -> GymComponent | None:
    """The component whose manifest has these fields (an agent's ``archives``, a ledger's
    ``rollouts``, a resources server's ``files``), or None."""
    if not isinstance(document, dict):
        return None
    if "archives" in document or "instance_name" in document:
        return "agent"
    if "rollouts" in document:
        return "ledger"
    if "files" in document and "server_name" in document:
        return "resources"
    return None


def folder_of(component: str, manifest: GymManifest) -> str:
    """The folder, relative to ``checkpoint_dir``, where the manifest's participant writes."""
    if component == "agent":
        return agent_instance_dir(manifest.instance_name)  # type: ignore[union-attr]
    if component == "ledger":
        return ledger_dir(manifest.server_name)  # type: ignore[union-attr]
    return resources_dir(manifest.server_name)  # type: ignore[union-attr]


def decode_strict(data: bytes, record_type: Any, where: str | Callable[[], str]) -> Any:
    """One JSON document or line as ``record_type`` (unknown fields refused), typed errors naming
    ``where`` (or what it returns: a name built only for an error, where building it for every
    record of a restore costs more than decoding it)."""
    try:
        return decoder(record_type).decode(data)  # one per type and process, built under a lock
    except msgspec.ValidationError as exc:
        raise InvalidRecordError(f"{_named(where)}: {exc} (expected a {getattr(record_type, '__name__', record_type)})"
                                 ) from None
    except _UNDECODABLE as exc:
        raise CorruptSnapshotError(f"{_named(where)}: not valid JSON: {exc}") from None


def _named(where: str | Callable[[], str]) -> str:
    return where if isinstance(where, str) else where()


def load_manifest(folder: Path, component: str | None = None) -> tuple[GymComponent, GymManifest, bytes]:
    """``folder/manifest.json``: its component (given, or recognised by its fields), the decoded
    manifest (unknown fields refused) and its exact bytes (``manifest_digest`` is their SHA-256)."""
    path = folder / MANIFEST_NAME
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{path}: missing (every Gym participant folder ends with its manifest.json)") from None
    except OSError as exc:
        raise CorruptSnapshotError(f"{path}: cannot read: {exc}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptSnapshotError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes (expected a manifest)")
    if component is None:
        component = component_of_fields(decode_strict(data, Any, str(path)))
        if component is None:
            raise InvalidRecordError(f"{path}: not a Gym manifest (expected the fields of an agent, ledger or "
                                     "resources manifest: archives, rollouts or files)")
    if component not in MANIFEST_TYPES:
        raise InvalidRecordError(f"{path}: unknown Gym component {component!r} (expected agent, ledger or resources)")
    manifest = decode_strict(data, MANIFEST_TYPES[component], str(path))
    return component, manifest, data  # type: ignore[return-value]


# -- the checks ---------------------------------------------------------------------------------------------
def ref_name(ref: ArtifactRef, base: str, where: str) -> str:
    """The name, inside the folder ``base`` (relative to ``checkpoint_dir``), of the file ``ref``
    names; a reference to a file outside that folder is refused."""
    rel = ref.relative_path
    if not base:
        return check_relative_path(rel, where=f"{where}.relative_path")
    if not rel.startswith(base + "/"):
        raise InvalidPathError(f"{where}.relative_path: {rel!r} lies outside the participant's folder "
                               f"(expected {base}/<name>)")
    return check_relative_path(rel[len(base) + 1:], where=f"{where}.relative_path")


def check_ref(ref: ArtifactRef, name: str, facts: dict[str, FileFacts], folder: Path, where: str) -> None:
    """The file ``name`` exists with the reference's ``bytes``, ``sha256`` and ``records``."""
    path = folder / name
    got = facts.get(name)
    if got is None:
        raise CorruptSnapshotError(f"{path}: missing, but {where} names it ({ref.relative_path})")
    if got.size != ref.bytes:
        raise CorruptSnapshotError(f"{path}: bytes is {got.size}, {where}.bytes expects {ref.bytes}")
    if got.sha256 != ref.sha256:
        raise CorruptSnapshotError(f"{path}: sha256 is {got.sha256}, {where}.sha256 expects {ref.sha256}")
    if got.lines != ref.records:
        what = "it is not a JSON-lines file" if got.lines is None else f"it has {got.lines} non-blank lines"
        raise CorruptSnapshotError(f"{path}: {what}, {where}.records expects {ref.records}")


def _check_digest(name: str, expected: str, facts: dict[str, FileFacts], folder: Path, where: str,
                  field: str = "") -> FileFacts:
    """``name`` exists and has the SHA-256 ``expected`` that ``where`` (+ ``field``) promises."""
    check_relative_path(name, where=f"{where} name")
    got = facts.get(name)
    if got is None:
        raise CorruptSnapshotError(f"{folder / name}: missing, but {where} lists it")
    if got.sha256 != expected:
        raise CorruptSnapshotError(f"{folder / name}: sha256 is {got.sha256}, {where}{field} expects {expected}")
    return got


class GymFolder(msgspec.Struct, frozen=True, kw_only=True):
    """A participant folder whose manifest held against its bytes."""

    component: str
    #: The folder relative to ``checkpoint_dir``, as the manifest names it.
    base: str
    manifest: Any
    #: ``manifest_digest``: SHA-256 hex of the exact bytes of ``manifest.json``.
    manifest_digest: str
    #: Rows of ``agent-index.jsonl`` (agents only).
    index: list[AgentIndexEntry] = []
    #: The checked bytes of every file of the folder, by name, if :func:`check_folder` was asked to
    #: keep them: a reader decodes these instead of reading each file a second time. An archive is
    #: not among them: its members are (:attr:`archives`).
    files: dict[str, bytes] = {}
    #: The checked bytes of every member of each ``.tar`` archive, by archive and member name, if
    #: :func:`check_folder` was asked to keep them.
    archives: dict[str, dict[str, bytes]] = {}


def check_folder(folder: Path, *, component: str | None = None, base: str | None = None,
                 facts: dict[str, FileFacts] | None = None, keep: bool = False) -> GymFolder:
    """Check every promise of ``folder/manifest.json`` against the bytes of the folder's files.

    ``component`` (else recognised by the manifest's fields) and ``base``, the folder's place
    under ``checkpoint_dir`` when it is known (a part prefix ``gym/<base>``): it must equal the
    folder the manifest names. ``facts`` are :func:`scan_folder`'s, when already computed; else the
    folder is scanned, and with ``keep`` the checked bytes come back in :attr:`GymFolder.files`.
    """
    folder = Path(folder)
    component, manifest, data = load_manifest(folder, component)
    where = str(folder / MANIFEST_NAME)
    named = folder_of(component, manifest)
    if base is not None and base != named:
        raise InvalidPathError(f"{where}: the manifest belongs in {named!r} of checkpoint_dir, but the folder is "
                               f"adopted as {base!r}")
    if facts is None:
        facts = scan_folder(folder, keep=keep)
    index: list[AgentIndexEntry] = []
    if component == "agent":
        index = _check_agent(folder, named, manifest, facts, where)  # type: ignore[arg-type]
    elif component == "ledger":
        _check_ledger(folder, named, manifest, facts, where)  # type: ignore[arg-type]
    else:
        for name, digest in sorted(manifest.files.items()):  # type: ignore[union-attr]
            _check_digest(name, digest, facts, folder, f"{where}: files[{name!r}]")
    return GymFolder(component=component, base=named, manifest=manifest, manifest_digest=sha256_hex(data),
                     index=index, files={name: f.data for name, f in facts.items() if f.data is not None},
                     archives={name: {member: m.data for member, m in f.archive.items() if m.data is not None}
                               for name, f in facts.items() if keep and f.archive is not None})


def _check_agent(folder: Path, base: str, manifest: AgentManifest, facts: dict[str, FileFacts],
                 where: str) -> list[AgentIndexEntry]:
    index_name = ref_name(manifest.record_index, base, f"{where}: record_index")
    check_ref(manifest.record_index, index_name, facts, folder, f"{where}: record_index")
    cont_name = ref_name(manifest.continuation_index, base, f"{where}: continuation_index")
    check_ref(manifest.continuation_index, cont_name, facts, folder, f"{where}: continuation_index")
    if manifest.records != manifest.record_index.records:
        raise CorruptSnapshotError(f"{where}: records is {manifest.records}, expected record_index.records "
                                   f"{manifest.record_index.records}")
    archives = {}
    for i, archive in enumerate(manifest.archives):
        at = f"{where}: archives[{i}]"
        check_name(archive.name, where=f"{at}.name")
        if archive.name in archives:
            raise CorruptSnapshotError(f"{at}.name: {archive.name!r} is listed twice")
        got = _check_digest(archive.name, archive.sha256, facts, folder, at, ".sha256")
        if got.size != archive.bytes:
            raise CorruptSnapshotError(f"{folder / archive.name}: bytes is {got.size}, {at}.bytes expects {archive.bytes}")
        if got.members != archive.members:
            raise CorruptSnapshotError(f"{folder / archive.name}: has {got.members} members, {at}.members expects "
                                       f"{archive.members}")
        archives[archive.name] = archive
    total = sum(a.members for a in manifest.archives)
    if total != manifest.records:
        raise CorruptSnapshotError(f"{where}: the archives hold {total} members, records expects {manifest.records}")
    index_where = str(folder / index_name)
    kept = facts[index_name].data
    index = (decode_rows(kept, AgentIndexEntry, index_where) if kept is not None
             else read_rows(folder / index_name, AgentIndexEntry))
    by_archive: dict[str, dict[str, AgentIndexEntry]] = {name: {} for name in archives}
    seen: set[tuple[str, int]] = set()
    for n, row in enumerate(index, 1):
        if (row.rollout_id, row.attempt_index) in seen:
            raise CorruptSnapshotError(f"{index_where}: row {n}: ({row.rollout_id!r}, {row.attempt_index}) is "
                                       "indexed twice")
        seen.add((row.rollout_id, row.attempt_index))
        expected = attempt_member(row.rollout_id, row.attempt_index)
        if row.member != expected:
            raise CorruptSnapshotError(f"{index_where}: row {n}: member is {row.member!r}, expected {expected!r}")
        if row.archive not in by_archive:
            raise CorruptSnapshotError(f"{index_where}: row {n}: archive {row.archive!r} is not among the manifest's "
                                       f"archives ({', '.join(sorted(archives)) or 'none'})")
        by_archive[row.archive][row.member] = row
    for name, rows in by_archive.items():
        # The scan's members: its count matched the manifest's above, so the archive was read as one.
        members = facts[name].archive
        assert members is not None
        for member, row in rows.items():
            got = members.get(member)
            if got is None:
                raise CorruptSnapshotError(f"{folder / name}: member {member!r}: missing, but {index_where} indexes it")
            if got.size != row.bytes:
                raise CorruptSnapshotError(f"{folder / name}: member {member!r}: bytes is {got.size}, {index_where} "
                                           f"expects {row.bytes}")
            if got.sha256 != row.sha256:
                raise CorruptSnapshotError(f"{folder / name}: member {member!r}: sha256 is {got.sha256}, {index_where} "
                                           f"expects {row.sha256}")
        extra = sorted(set(members) - set(rows))
        if extra:
            raise CorruptSnapshotError(f"{folder / name}: members {extra} have no row in {index_where}")
    return index


def _check_ledger(folder: Path, base: str, manifest: LedgerManifest, facts: dict[str, FileFacts], where: str) -> None:
    refs_name = ref_name(manifest.storage_reference_index, base, f"{where}: storage_reference_index")
    check_ref(manifest.storage_reference_index, refs_name, facts, folder, f"{where}: storage_reference_index")
    for key, rollout in sorted(manifest.rollouts.items()):
        at = f"{where}: rollouts[{key!r}]"
        rows, size = 0, 0
        for name, digest in sorted(rollout.files.items()):
            got = _check_digest(name, digest, facts, folder, f"{at}.files[{name!r}]")
            rows += got.lines or 0
            size += got.size
        if size != rollout.bytes:
            raise CorruptSnapshotError(f"{at}.bytes: its files hold {size} bytes, expected {rollout.bytes}")
        if rows != rollout.rows:
            raise CorruptSnapshotError(f"{at}.rows: its files hold {rows} non-blank lines, expected {rollout.rows}")


# -- JSON lines -----------------------------------------------------------------------------------------------
def resolve_ref(checkpoint_dir: Path, ref: ArtifactRef) -> Path:
    """The file ``ref`` names under ``checkpoint_dir``; an absolute path, ``..``, or a link that
    leads outside ``checkpoint_dir`` is refused (:class:`InvalidPathError`)."""
    rel = ref.relative_path
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise InvalidPathError(f"artifact reference relative_path {rel!r}: expected a relative path without "
                               "'.', '..' or empty segments")
    root = Path(checkpoint_dir).resolve()
    path = (root / rel).resolve()
    if root not in path.parents:
        raise InvalidPathError(f"{root / rel}: leads outside checkpoint_dir {root} (relative_path {rel!r})")
    return root / rel


def read_ref_rows(checkpoint_dir: Path, ref: ArtifactRef, row_type: Any) -> list[Any]:
    """The rows of the JSON-lines file ``ref`` names, checked as Gym's readers check them.

    Raw lines are hashed (every byte, newlines included); blank lines are skipped; ``bytes``,
    ``sha256`` and ``records`` (non-blank lines) must all match before any row is trusted; each
    row is decoded strictly as ``row_type`` (unknown fields refused).
    """
    path = resolve_ref(checkpoint_dir, ref)
    where = f"{path} (artifact reference {ref.relative_path})"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{where}: missing") from None
    if size != ref.bytes:  # before reading a byte of a file of the wrong size
        raise CorruptSnapshotError(f"{where}: bytes is {size}, the reference expects {ref.bytes}")
    return _read_rows(path, row_type, where, ref)


def read_rows(path: Path, row_type: Any, where: str | None = None) -> list[Any]:
    """Every non-blank line of ``path`` decoded strictly as ``row_type``."""
    return _read_rows(path, row_type, where or str(path), None)


def decode_rows(data: bytes, row_type: Any, where: str) -> list[Any]:
    """Every non-blank line of ``data`` (a file's bytes, already checked) decoded strictly as
    ``row_type``, errors naming ``where`` and the line, as :func:`read_rows` reads a file."""
    return _chunk_rows((data,), row_type, where, None)


def _read_rows(path: Path, row_type: Any, where: str, ref: ArtifactRef | None) -> list[Any]:
    try:
        with open(path, "rb") as fh:
            # Whole chunks hashed and split at once: a line at a time (file iteration, a hash update and
            # a size per line) was about half of a resources server's read of the agents' indexes on
            # restore (py-spy), the other half decoding.
            return _chunk_rows(iter(lambda: fh.read(_CHUNK), b""), row_type, where, ref)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{where}: missing") from None
    except OSError as exc:
        raise CorruptSnapshotError(f"{where}: cannot read: {exc}") from None


def _chunk_rows(chunks: Iterable[bytes], row_type: Any, where: str, ref: ArtifactRef | None) -> list[Any]:
    """The rows of a file read as ``chunks``; with ``ref``, its ``bytes``, ``sha256`` and ``records``
    checked before a decoding error is raised (bytes first, then meaning)."""
    sha = hashlib.sha256()
    size, records, n = 0, 0, 0
    rows: list[Any] = []
    failure: Exception | None = None
    carry = b""  # the last line of the chunks so far, not ended by b"\n" yet

    decode = decoder(row_type).decode

    def take(lines: list[bytes]) -> None:
        nonlocal n, records, failure
        # Rows are decoded by the bare decoder, and a row it refuses is decoded again by decode_strict
        # for the typed error naming the line: wrapping every row (a call, a closure for its name) was a
        # quarter of a resources server's read of the agents' indexes on restore (cProfile).
        for line in lines:
            n += 1
            if not line or line.isspace():  # blank as bytes.strip() has it, without a copy of each line
                continue
            records += 1
            if failure is None:
                try:
                    rows.append(decode(line))
                except (msgspec.ValidationError, *_UNDECODABLE):
                    try:
                        rows.append(decode_strict(line, row_type, f"{where}: line {n}"))
                    except (InvalidRecordError, CorruptSnapshotError) as exc:
                        failure = exc  # reported after the digest: bytes first, then meaning

    for chunk in chunks:
        if ref is not None:
            sha.update(chunk)
        size += len(chunk)
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        take(lines)
    if carry:
        take([carry])  # a last line without b"\n"
    if ref is not None:
        if size != ref.bytes:
            raise CorruptSnapshotError(f"{where}: bytes is {size}, the reference expects {ref.bytes}")
        if sha.hexdigest() != ref.sha256:
            raise CorruptSnapshotError(f"{where}: sha256 is {sha.hexdigest()}, the reference expects {ref.sha256}")
        if records != ref.records:
            raise CorruptSnapshotError(f"{where}: has {records} non-blank lines, the reference's records expects "
                                       f"{ref.records}")
    if failure is not None:
        raise failure
    return rows


# -- what a snapshot's Gym parts hold ---------------------------------------------------------------------
def gym_part_summary(prefix: str, files: Iterable[Any]) -> dict[str, Any]:
    """What ``show`` prints of a Gym part: its component, files, bytes and record counts by role
    (from the part's file entries: ``records`` of each ``gym_file``)."""
    entries = [f for f in files if f.path.startswith(prefix + "/") and f.kind != "part_manifest"]
    component = component_of_prefix(prefix) or "other"
    counts: dict[str, int] = {}
    for f in entries:
        name = f.path[len(prefix) + 1:]
        if component == "agent" and name.endswith(".tar"):
            counts["records"] = counts.get("records", 0) + f.records
            counts["archives"] = counts.get("archives", 0) + 1
        elif component == "agent" and name.endswith("continuations.jsonl"):
            counts["continuations"] = counts.get("continuations", 0) + f.records
        elif component == "ledger" and name.endswith(".lineage.jsonl"):
            counts["rollouts"] = counts.get("rollouts", 0) + 1
            counts["lineage_rows"] = counts.get("lineage_rows", 0) + f.records
        elif component == "ledger" and name.endswith("storage-references.jsonl"):
            counts["storage_references"] = counts.get("storage_references", 0) + f.records
        elif component == "resources" and name.endswith(".json") and name != MANIFEST_NAME:
            counts["sessions"] = counts.get("sessions", 0) + 1
    return {"prefix": prefix, "component": component, "files": len(entries),
            "bytes": sum(f.size for f in entries), "records": counts}
