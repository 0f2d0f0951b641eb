"""Reading one participant's records: from its part of a published snapshot, or of a draft.

A published snapshot may hold the parts of several servers of one kind (two agent servers both
write ``continuations``), so every read here is limited to one part prefix. Reading from a draft
(the model server reads the agents' continuation indexes during commit) goes through the part
manifest the agent's receipt names, and checks each file's size and checksum like a published read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gymkit import ControlRefused
from schemas.errors import CorruptSnapshotError, InvalidRecordError
from schemas.manifest import FileEntry, PartReceipt
from snapformat import jsonl, layout
from snapformat.checksum import check, checksum_bytes
from snapformat.kinds import RECORD_TYPES
from snapformat.publish import load_part
from snapformat.reader import Snapshot
from snapformat.store import open_store


def part_files(snapshot: Snapshot, prefix: str, kind: str) -> list[FileEntry]:
    """Files of ``kind`` under ``prefix/`` (in manifest order)."""
    return [f for f in snapshot.files(kind) if f.path.startswith(prefix + "/")]


def part_records(snapshot: Snapshot, prefix: str, kind: str) -> Iterator[Any]:
    """Decoded records of ``kind`` written under ``prefix/`` (checksums verified)."""
    for entry in part_files(snapshot, prefix, kind):
        yield from snapshot.iter_records(entry)


def draft_records(draft_url: str, receipt: PartReceipt, kind: str) -> Iterator[Any]:
    """Decoded records of ``kind`` from another participant's closed part of an unpublished draft."""
    store_url, snapshot_id = layout.split_snapshot_url(draft_url)
    store = open_store(store_url)
    part = load_part(store, snapshot_id, receipt)  # checks the part manifest against the receipt
    for f in part.files:
        if f.kind != kind:
            continue
        key = layout.file_key(snapshot_id, f.path)
        where = store.display(key)
        try:
            data = store.read_bytes(key)
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{where}: listed by {receipt.writer!r} but missing") from None
        if len(data) != f.size:
            raise CorruptSnapshotError(f"{where}: size is {len(data)} bytes, the part manifest says {f.size}")
        check(where, checksum_bytes(data, f.checksum.partition(":")[0]), f.checksum)
        yield from jsonl.iter_records(data, RECORD_TYPES[kind], where, f.compression, f.content_size)


@contextmanager
def invalid_records_refused() -> Iterator[None]:
    """A record that breaks the contract (a bad capture key, a wrong field) is the caller's
    mistake, not the server's: answer 400 ``invalid_record`` naming it, instead of a 500."""
    try:
        yield
    except InvalidRecordError as exc:
        raise ControlRefused(400, "invalid_record", str(exc)) from None
