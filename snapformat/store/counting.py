"""A store that counts the calls made to the store it wraps: requests per save, restore or GC."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

from snapformat.store.base import ObjectInfo, Store


class CountingStore(Store):
    """A :class:`Store` that counts the calls made to the store it wraps, by method name.

    :func:`gc` reports them (``GcReport.store_calls``); a benchmark can wrap any store the same way to
    count a save's or a restore's requests. ``walked`` counts the objects the walks listed (an object
    store lists 1000 keys per request).
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: dict[str, int] = {}
        self.walked = 0

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def display(self, key: str) -> str:
        return self.inner.display(key)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        self._count("read_bytes")
        return self.inner.read_bytes(key, limit)

    def open_read(self, key: str) -> BinaryIO:
        self._count("open_read")
        return self.inner.open_read(key)

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)

    def open_write(self, key: str) -> BinaryIO:
        self._count("open_write")
        return self.inner.open_write(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._count("put_bytes")
        self.inner.put_bytes(key, data)

    def create_exclusive(self, key: str, data: bytes) -> None:
        self._count("create_exclusive")
        self.inner.create_exclusive(key, data)

    def create_exclusive_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        for _ in items:  # one create per object, as a remote store sends them
            self._count("create_exclusive")
        return self.inner.create_exclusive_many(items)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self.inner.exists(key)

    def info(self, key: str) -> ObjectInfo:
        self._count("info")
        return self.inner.info(key)

    def list_names(self, prefix: str) -> list[str]:
        self._count("list_names")
        return self.inner.list_names(prefix)

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        self._count("walk")
        for info in self.inner.walk(prefix):
            self.walked += 1
            yield info

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)

    def delete_if_older(self, key: str, before: float) -> ObjectInfo | None:
        self._count("delete_if_older")
        return self.inner.delete_if_older(key, before)

    def delete_tree(self, prefix: str) -> None:
        self._count("delete_tree")
        self.inner.delete_tree(prefix)

    def abort_uploads(self, prefix: str, older_than: float, keep: Callable[[str], bool]) -> list[str]:
        self._count("abort_uploads")
        return self.inner.abort_uploads(prefix, older_than, keep)
