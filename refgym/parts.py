"""Reading one participant's records from its part of a published snapshot.

A published snapshot may hold the parts of several servers of one kind (two agent servers both
write ``continuations``), so every read here is limited to one part prefix. Another participant's
part of a draft (the model server reads the agents' continuation indexes during commit) is read
with :func:`snapformat.read_part_records`, through the receipt the commit was given.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gymkit import ControlRefused
from schemas.errors import InvalidRecordError
from schemas.manifest import FileEntry
from snapformat.reader import Snapshot


def part_files(snapshot: Snapshot, prefix: str, kind: str) -> list[FileEntry]:
    """Files of ``kind`` under ``prefix/`` (in manifest order)."""
    return [f for f in snapshot.files(kind) if f.path.startswith(prefix + "/")]


def part_records(snapshot: Snapshot, prefix: str, kind: str) -> Iterator[Any]:
    """Decoded records of ``kind`` written under ``prefix/`` (checksums verified)."""
    for entry in part_files(snapshot, prefix, kind):
        yield from snapshot.iter_records(entry)


@contextmanager
def invalid_records_refused() -> Iterator[None]:
    """A record that breaks the contract (a bad capture key, a wrong field) is the caller's
    mistake, not the server's: answer 400 ``invalid_record`` naming it, instead of a 500."""
    try:
        yield
    except InvalidRecordError as exc:
        raise ControlRefused(400, "invalid_record", str(exc)) from None
