"""Local-disk backend: durable writes with fsync, commit by hard link.

``create_exclusive`` writes a temporary file, fsyncs it, then ``os.link``s it to the final name:
``link`` fails with ``EEXIST`` if the name exists, on every POSIX filesystem, so exactly one of
several racing writers wins (the same trick zarr's and Lance's local stores use). A rename would
silently replace the loser's target on Linux, so it is not used for the commit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from schemas.errors import CommitConflictError, StoreError
from snapformat.store.base import ObjectInfo, Store, WriteStream

_TMP_PREFIX = ".tmp-"
#: ``create_exclusive_many`` writes this many files of a folder before it fsyncs them (and holds as
#: many open): their writes reach the disk together, and each fsync then waits far less.
BATCH_FSYNC = 64

#: A large file's dirty pages are handed to the disk every this many bytes while it is written
#: (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, asynchronous): the disk then writes while the
#: writer checks, hashes and serialises the next batches, instead of all at the final fsync.
#: Durability still comes from the fsync in ``close()``; this only starts the writeback earlier.
WRITEBACK_EVERY = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: writeback simply starts at fsync
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


#: Faults an operator must fix by hand, said in words (the errno name stays in the message).
_FAULTS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


@contextlib.contextmanager
def _folder_lock(folder: Path, how: int) -> Iterator[None]:
    """``flock`` on the folder itself (no lock file to leave behind); released on close."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def _io_error(where: str, action: str, exc: OSError) -> StoreError:
    """A :class:`StoreError` naming the file, what failed and, for a full or read-only disk, why.

    Raise it ``from exc`` so the ``OSError`` stays the cause.
    """
    fault = _FAULTS.get(exc.errno)
    detail = f"{fault} ({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror})" if fault else str(exc)
    return StoreError(f"{where}: cannot {action}: {detail}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DurableFile(WriteStream):
    """A file opened for exclusive creation whose ``close()`` flushes, fsyncs it and its folder.

    I/O failures (a full or read-only disk above all) surface as :class:`StoreError` naming
    ``where``, never as a bare ``OSError``: callers up to ``publish`` handle one error type.
    """

    def __init__(self, path: Path, created_dirs: list[Path], where: str, sync_folder: bool = True) -> None:
        self._path = path
        self._created_dirs = created_dirs
        self._sync_folder = sync_folder
        self._where = where
        self._fh = open(path, "xb", buffering=0)  # noqa: SIM115 - closed in close()
        self.closed = False
        self._written = 0
        self._handed_off = 0  # bytes already given to the disk (see WRITEBACK_EVERY)

    def write(self, data) -> int:
        view = memoryview(data)
        total = 0
        try:
            while total < len(view):
                total += self._fh.write(view[total:])
        except OSError as exc:
            raise _io_error(self._where, "write", exc) from exc
        self._written += total
        if _sync_file_range is not None and self._written - self._handed_off >= WRITEBACK_EVERY:
            # A failure is ignored: this is only a hint, the fsync in close() decides.
            _sync_file_range(self._fh.fileno(), self._handed_off, self._written - self._handed_off,
                             _SYNC_FILE_RANGE_WRITE)
            self._handed_off = self._written
        return total

    def tell(self) -> int:
        return self._fh.tell()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            try:
                os.fsync(self._fh.fileno())  # where a disk that allocates late reports it is full
            finally:
                self._fh.close()
            if self._sync_folder:
                _fsync_dir(self._path.parent)
            for d in self._created_dirs:  # make each new folder's entry durable in its parent
                _fsync_dir(d.parent)
        except OSError as exc:
            raise _io_error(self._where, "make it durable", exc) from exc

    def abort(self) -> None:
        """Close without making durable and remove the partial file, as far as the disk lets.

        Best effort: it runs while another error propagates, which it must not replace (on a
        read-only file system the unlink fails too). A file left behind lies in an unpublished
        draft, which GC sweeps.
        """
        try:
            if not self.closed:
                self.closed = True
                self._fh.close()
            self._path.unlink(missing_ok=True)
        except OSError:
            pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quietly(path: Path) -> None:
    """Remove a temporary file while another outcome is being reported; GC sweeps what remains."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class LocalStore(Store):
    """A snapshot store in a local folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.url = str(root)
        self.root = Path(root).absolute()

    def _path(self, key: str) -> Path:
        # Keys are built by this library from validated names; this is a last line of defence.
        if key.startswith("/") or "\x00" in key or ".." in key.split("/"):
            raise StoreError(f"{self.display(key)}: refusing a key that leaves the store")
        return self.root / key if key else self.root

    def _makedirs(self, folder: Path) -> list[Path]:
        """Create ``folder`` and missing parents; return the ones created, outermost first."""
        missing = []
        p = folder
        while not p.exists():
            missing.append(p)
            p = p.parent
        missing.reverse()
        created = []
        for d in missing:
            try:
                d.mkdir()
                created.append(d)
            except FileExistsError:
                pass
        return created

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        try:
            if limit is None:
                return self._path(key).read_bytes()
            with open(self._path(key), "rb") as fh:
                return fh.read(limit + 1)
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            raise FileNotFoundError(self.display(key)) from None
        except OSError as exc:
            raise _io_error(self.display(key), "read", exc) from exc

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _io_error(self.display(key), "open", exc) from exc

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def open_write(self, key: str) -> _DurableFile:
        path = self._path(key)
        try:
            created = self._makedirs(path.parent)
            return _DurableFile(path, created, self.display(key))
        except FileExistsError:
            raise
        except OSError as exc:
            raise _io_error(self.display(key), "create", exc) from exc

    def _write_tmp(self, key: str, folder: Path, data: bytes) -> tuple[Path, list[Path]]:
        """Write ``data`` durably to a temporary file beside ``key``'s final name.

        Only the bytes are made durable: the temporary name is renamed or linked away next, and the
        caller fsyncs the folder after that (one folder fsync per write, not two).
        """
        created = self._makedirs(folder)
        tmp = folder / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with _DurableFile(tmp, [], self.display(key), sync_folder=False) as fh:  # the key is what the caller knows
            fh.write(data)
        return tmp, created

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            tmp, created = self._write_tmp(key, path.parent, data)
        except OSError as exc:
            raise _io_error(self.display(key), "write", exc) from exc
        try:
            with _folder_lock(path.parent, fcntl.LOCK_SH):  # never between delete_if_older's look and its delete
                os.replace(tmp, path)
            _fsync_dir(path.parent)
            for d in created:
                _fsync_dir(d.parent)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise _io_error(self.display(key), "write", exc) from exc

    def create_exclusive(self, key: str, data: bytes) -> None:
        if self.create_exclusive_many([(key, data)]):
            raise CommitConflictError(f"{self.display(key)} already exists: another writer committed first")

    def create_exclusive_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        """Per folder, :data:`BATCH_FSYNC` keys at a time: each key's bytes written to a temporary
        file beside it; then each temporary fsynced (the writes were all handed to the disk first,
        so the fsyncs wait on one flush rather than one each) and ``os.link``ed to its key
        (``EEXIST``: a conflict, nothing written), the temporary removed; once the folder's keys
        are done, the folder fsynced once, and each folder it created in its parent.

        *Crash:* a key already linked holds all its bytes (linked only once fsynced), but its name
        may not survive a power loss until the folder's fsync; temporary ``.tmp-*`` files may be
        left beside the keys. A caller that lists the keys somewhere (a part manifest) does so only
        after this returns."""
        conflicts: list[str] = []
        by_folder: dict[Path, list[tuple[str, Path, bytes]]] = {}
        for key, data in items:
            path = self._path(key)
            by_folder.setdefault(path.parent, []).append((key, path, data))
        for folder, entries in by_folder.items():
            try:
                created = self._makedirs(folder)
            except OSError as exc:
                raise _io_error(self.display(entries[0][0]), "create", exc) from exc
            for i in range(0, len(entries), BATCH_FSYNC):
                conflicts += self._link_durably(folder, entries[i:i + BATCH_FSYNC])
            try:
                _fsync_dir(folder)
                for d in created:
                    _fsync_dir(d.parent)
            except OSError as exc:
                raise _io_error(self.display(entries[-1][0]), "make the commit durable", exc) from exc
        return conflicts

    def _link_durably(self, folder: Path, entries: list[tuple[str, Path, bytes]]) -> list[str]:
        """Write, fsync and link ``entries`` (keys of one folder) as :meth:`create_exclusive_many`
        says; returns the keys that existed. The temporaries are removed whatever happens."""
        temps: list[Path] = []
        fds: list[int] = []
        conflicts = []
        try:
            for key, _, data in entries:
                tmp = folder / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
                try:
                    fds.append(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # as open(..., "xb")
                    temps.append(tmp)
                    _write_all(fds[-1], data)
                except OSError as exc:
                    raise _io_error(self.display(key), "write", exc) from exc
            for (key, _, _), fd in zip(entries, fds, strict=True):
                try:
                    os.fsync(fd)  # where a disk that allocates late reports it is full
                except OSError as exc:
                    raise _io_error(self.display(key), "make it durable", exc) from exc
            for (key, path, _), tmp in zip(entries, temps, strict=True):
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    conflicts.append(key)
                except OSError as exc:
                    raise _io_error(self.display(key), "commit", exc) from exc
        finally:
            for fd in fds:
                _close_quietly(fd)
            for tmp in temps:
                _unlink_quietly(tmp)
        return conflicts

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def info(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _io_error(self.display(key), "stat", exc) from exc
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list_names(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise _io_error(self.display(prefix), "list", exc) from exc

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix)
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                yield ObjectInfo(p.relative_to(self.root).as_posix(), st.st_size, st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
            _fsync_dir(path.parent)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise _io_error(self.display(key), "delete", exc) from exc

    def delete_if_older(self, key: str, before: float) -> ObjectInfo | None:
        """Look and delete under the folder's exclusive lock, which :meth:`put_bytes` holds shared
        while it replaces a file there: a put of the same key lands before the look (the file is
        young and kept) or after the delete (a new file), never between."""
        path = self._path(key)
        try:
            with _folder_lock(path.parent, fcntl.LOCK_EX):
                st = path.stat()
                if st.st_mtime >= before:
                    return None
                path.unlink()
            _fsync_dir(path.parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _io_error(self.display(key), "delete", exc) from exc
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def delete_tree(self, prefix: str) -> None:
        base = self._path(prefix)
        if not base.exists():
            return
        try:
            for dirpath, dirs, files in os.walk(base, topdown=False):
                for name in files:
                    (Path(dirpath) / name).unlink(missing_ok=True)
                for name in dirs:
                    (Path(dirpath) / name).rmdir()
            base.rmdir()
            _fsync_dir(base.parent)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _io_error(self.display(prefix), "delete", exc) from exc
