"""Shared objects (SPEC §14.2, format 1.3): immutable files named by the SHA-256 of their bytes.

A snapshot's file entry may name an object (``object: "sha256:<hex>"``) instead of a file of its
own folder, so that a snapshot lists what an earlier one wrote without writing it again.

Writing an object, and what a crash at each step leaves behind:

1. The bytes are built and hashed in memory (an object is a segment: bounded in size by its
   writer); the hash is the name. *Crash: nothing on the store.*
2. Create-only (:meth:`Store.create_exclusive`) at ``objects/<2>/<64>``. *Crash: at most a
   temporary file beside it, or the object itself, unreferenced: GC sweeps either once it is older
   than the grace period.*
3. If it already exists, the same name means the same bytes, so the writer puts them again (an
   atomic replace with identical content). That refreshes the object's age: a GC sweeping it as
   unreferenced and old (a crashed draft's leftover, a deleted snapshot's) must not take it from a
   draft that now needs it, and a sweep takes only objects older than the grace period. It also
   mends an object whose stored bytes were damaged.

Nothing here trusts a name: every reader checks size and SHA-256 of what it reads, as for any file.
"""

from __future__ import annotations

import msgspec

from schemas.errors import CommitConflictError
from snapformat import layout
from snapformat.checksum import checksum_bytes
from snapformat.store import Store

ALGORITHM = "sha256"


class WrittenObject(msgspec.Struct, frozen=True):
    """What :func:`put_object` did: the object's name and size, and whether this call created it
    (``False``: it existed already and was put again with the same bytes)."""

    name: str
    size: int
    created: bool


def object_name(data: bytes) -> str:
    """The name of an object holding ``data``: ``sha256:<hex>``."""
    return checksum_bytes(data, ALGORITHM)


def put_object(store: Store, data: bytes, name: str | None = None) -> WrittenObject:
    """Write ``data`` as a shared object (steps in the module docstring) and return its name.

    ``name``, when given, is the caller's own SHA-256 of ``data`` (computed while the bytes were
    built); it is checked, never trusted.
    """
    actual = object_name(data)
    if name is not None and name != actual:
        raise ValueError(f"object bytes hash to {actual}, not {name}")
    key = layout.object_key(actual)
    try:
        store.create_exclusive(key, data)
    except CommitConflictError:
        store.put_bytes(key, data)  # same name, same bytes: refreshes its age (and mends a damaged copy)
        return WrittenObject(actual, len(data), created=False)
    return WrittenObject(actual, len(data), created=True)


__all__ = ["ALGORITHM", "WrittenObject", "object_name", "put_object"]
