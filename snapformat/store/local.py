"""Local-disk backend: durable writes with fsync, commit by hard link.

``create_exclusive`` writes a temporary file, fsyncs it, then ``os.link``s it to the final name:
``link`` fails with ``EEXIST`` if the name exists, on every POSIX filesystem, so exactly one of
several racing writers wins (the same trick zarr's and Lance's local stores use). A rename would
silently replace the loser's target on Linux, so it is not used for the commit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from schemas.errors import CommitConflictError, StoreError
from snapformat.store.base import ObjectInfo, Store, WriteStream

_TMP_PREFIX = ".tmp-"

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DurableFile(WriteStream):
    """A file opened for exclusive creation whose ``close()`` flushes, fsyncs it and its folder."""

    def __init__(self, path: Path, created_dirs: list[Path]) -> None:
        self._path = path
        self._created_dirs = created_dirs
        self._fh = open(path, "xb", buffering=0)  # noqa: SIM115 - closed in close()
        self.closed = False
        self._written = 0
        self._handed_off = 0  # bytes already given to the disk (see WRITEBACK_EVERY)

    def write(self, data) -> int:
        view = memoryview(data)
        total = 0
        while total < len(view):
            total += self._fh.write(view[total:])
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
            os.fsync(self._fh.fileno())
        finally:
            self._fh.close()
        _fsync_dir(self._path.parent)
        for d in self._created_dirs:  # make each new folder's entry durable in its parent
            _fsync_dir(d.parent)

    def abort(self) -> None:
        """Close without making durable and remove the partial file."""
        if not self.closed:
            self.closed = True
            self._fh.close()
        self._path.unlink(missing_ok=True)



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

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            raise FileNotFoundError(self.display(key)) from None
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot read: {exc}") from exc

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot open: {exc}") from exc

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def open_write(self, key: str) -> _DurableFile:
        path = self._path(key)
        try:
            created = self._makedirs(path.parent)
            return _DurableFile(path, created)
        except FileExistsError:
            raise
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot create: {exc}") from exc

    def _write_tmp(self, folder: Path, data: bytes) -> tuple[Path, list[Path]]:
        created = self._makedirs(folder)
        tmp = folder / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with _DurableFile(tmp, []) as fh:
            fh.write(data)
        return tmp, created

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            tmp, created = self._write_tmp(path.parent, data)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            for d in created:
                _fsync_dir(d.parent)
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot write: {exc}") from exc

    def create_exclusive(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            tmp, created = self._write_tmp(path.parent, data)
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot write: {exc}") from exc
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise CommitConflictError(f"{self.display(key)} already exists: another writer committed first") from None
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot commit: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        try:
            _fsync_dir(path.parent)
            for d in created:
                _fsync_dir(d.parent)
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot make the commit durable: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def info(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StoreError(f"{self.display(key)}: cannot stat: {exc}") from exc
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list_names(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise StoreError(f"{self.display(prefix)}: cannot list: {exc}") from exc

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
                raise StoreError(f"{self.display(key)}: cannot delete: {exc}") from exc

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
            raise StoreError(f"{self.display(prefix)}: cannot delete: {exc}") from exc
