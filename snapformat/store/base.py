"""The storage interface every backend implements, and nothing more.

Keys are ``/``-separated paths relative to the store's root. The snapshot protocol (``layout``,
``publish``, ``discovery``...) is written once against this interface; a backend only has to
provide durable writes and one atomic primitive, :meth:`Store.create_exclusive`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

import msgspec

from schemas.errors import CommitConflictError


class ObjectInfo(msgspec.Struct, frozen=True):
    key: str
    size: int
    mtime: float


class WriteStream:
    """The file-object surface pyarrow and our writers need from a write-only, unseekable stream.

    Subclasses implement ``write``, ``tell``, ``close`` and ``abort`` (drop what was written);
    leaving a ``with`` block by an exception aborts instead of closing.
    """

    closed = False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass  # durability is close()'s job

    def abort(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Store(abc.ABC):
    """A place that holds snapshots: a local folder or an object-store prefix."""

    #: The store's root as the user wrote it (a path or a URL); used in messages and listings.
    url: str

    def display(self, key: str) -> str:
        """The user-facing path or URL of ``key``."""
        return self.url.rstrip("/") + "/" + key if key else self.url

    @abc.abstractmethod
    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """The whole object, or with ``limit`` at most its first ``limit + 1`` bytes.

        With a limit, a result longer than ``limit`` tells the caller the object is too large
        without the whole of it being read into memory: documents with a size bound (commit
        record, marker, hint, manifest) are refused before an untrusted size is allocated.
        Raises ``FileNotFoundError`` when it does not exist.
        """

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A seekable binary reader. Raises ``FileNotFoundError`` when it does not exist."""

    def local_path(self, key: str) -> str | None:
        """A filesystem path for ``key`` when the backend has one (for memory mapping)."""
        return None

    @abc.abstractmethod
    def open_write(self, key: str) -> BinaryIO:
        """A writer for a new object; it is durable once ``close()`` returns without error.

        Each file of a snapshot has exactly one writer, so the object does not exist yet; a
        backend that can check it cheaply (local disk) raises ``FileExistsError``. A writer
        abandoned by a crash may leave a partial object (or an incomplete multipart upload)
        behind, which is harmless because no reader looks at an uncommitted snapshot.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write (or replace) a small object durably and atomically (old or new, never a mix)."""

    @abc.abstractmethod
    def create_exclusive(self, key: str, data: bytes) -> None:
        """The commit primitive: create ``key`` with ``data`` only if it does not exist.

        Atomic against every other writer of the same key: exactly one caller succeeds; the others
        raise :class:`~schemas.errors.CommitConflictError`. Any other failure raises
        :class:`~schemas.errors.StoreError` (never a conflict). Durable when it returns.
        """

    def create_exclusive_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        """:meth:`create_exclusive` of each ``(key, data)``; returns the keys that already existed
        (each left as it was, where :meth:`create_exclusive` would raise
        :class:`~schemas.errors.CommitConflictError`), in the order given. Every key it created is
        durable when it returns; a failure raises :class:`~schemas.errors.StoreError` and may leave
        some of the keys created (each whole: a key is only ever created with all its bytes).

        For many small objects at once (a Gym folder adopted into a draft): a backend may make
        them durable together (local disk: each folder fsynced once, not once per file). This
        default creates them one by one.
        """
        conflicts = []
        for key, data in items:
            try:
                self.create_exclusive(key, data)
            except CommitConflictError:
                conflicts.append(key)
        return conflicts

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def info(self, key: str) -> ObjectInfo:
        """Size and modification time. Raises ``FileNotFoundError`` when it does not exist."""

    @abc.abstractmethod
    def list_names(self, prefix: str) -> list[str]:
        """Names directly under the folder ``prefix`` (files and sub-folders), sorted. A folder
        whose objects were all deleted may still be listed on some stores (SeaweedFS)."""

    @abc.abstractmethod
    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under the folder ``prefix``, recursively."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object durably; a missing object is not an error."""

    def delete_if_older(self, key: str, before: float) -> ObjectInfo | None:
        """Delete ``key`` only if its modification time is before ``before`` (a ``time.time()``
        value); returns what was deleted, or None when it was younger or absent.

        GC's sweep of shared objects (SPEC §14.2): a writer that needs an old object puts it again
        (:meth:`put_bytes`, same bytes), which makes it young. A backend that can make the look and
        the delete one step against :meth:`put_bytes` overrides this (local disk: both hold the
        folder's lock); here the time is read right before the delete, which leaves the window of
        one request between the two.
        """
        try:
            info = self.info(key)
        except FileNotFoundError:
            return None
        if info.mtime >= before:
            return None
        self.delete(key)
        return info

    @abc.abstractmethod
    def delete_tree(self, prefix: str) -> None:
        """Delete every object under the folder ``prefix``; a missing folder is not an error."""

    def abort_uploads(self, prefix: str, older_than: float, keep: Callable[[str], bool]) -> list[str]:
        """Abort the incomplete uploads under the folder ``prefix`` begun before ``older_than``
        (a ``time.time()`` value) unless ``keep(key)``; returns their keys.

        A writer killed in the middle of a multipart upload leaves no object (no listing shows
        it), but the server keeps, and bills, its parts until the upload is aborted. Backends
        without such uploads have none to abort.
        """
        return []
