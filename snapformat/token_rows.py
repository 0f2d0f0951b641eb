"""Token-capture rows as Gym's TokenEntry JSON, both ways, and the check of their digests.

A token-capture part is an Arrow file (``token_capture_rows``); Gym's model server and trainers
think in ``TokenEntry`` objects. These functions are the one bridge: a batch of any file version
becomes TokenEntry JSON objects that Gym's ``TokenEntry.model_validate`` accepts unchanged, and
TokenEntry JSON objects become a batch a part writer accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa

from schemas.errors import CorruptSnapshotError
from schemas.rows import TOKEN_CAPTURE_SCHEMA, upgrade
from schemas.token_entry import entry_to_row, row_to_entry, token_digest

KIND = "token_capture_rows"


def entries_batch(entries: Iterable[Mapping[str, Any]], where: str = "token entries") -> pa.RecordBatch:
    """One record batch of token-capture rows from TokenEntry JSON objects (in order)."""
    rows = [entry_to_row(e, f"{where}[{i}]") for i, e in enumerate(entries)]
    return pa.RecordBatch.from_pylist(rows, schema=TOKEN_CAPTURE_SCHEMA)


def batch_entries(batch: pa.RecordBatch, where: str) -> list[dict[str, Any]]:
    """The TokenEntry JSON of every row of a batch (any file version this reader accepts)."""
    batch = upgrade(KIND, batch, where)
    return [row_to_entry(row, f"{where}: row {i}") for i, row in enumerate(batch.to_pylist())]


def iter_entries(batches: Iterable[pa.RecordBatch], where: str) -> Iterator[dict[str, Any]]:
    """The TokenEntry JSON of every row of a token-capture part's batches (``Snapshot.iter_batches``)."""
    for b, batch in enumerate(batches):
        yield from batch_entries(batch, f"{where}: batch {b}")


def check_digests(batch: pa.RecordBatch, where: str) -> int:
    """Recompute Gym's digest of every row whose prompt is whole (not a delta) and that has one;
    returns how many were checked. A mismatch raises :class:`CorruptSnapshotError` naming the row.

    A delta row holds only the prompt after its parent's tokens, so its digest covers tokens the
    row does not hold; it is checked only through its chain, which this function does not walk.
    ``batch`` is in the current version's columns (``schemas.rows.upgrade`` gives that).
    """
    cols = batch.select(["model_call_id", "prompt_token_ids", "generation_token_ids", "digest", "cum_len",
                         "prompt_is_delta"]).to_pydict()
    checked = 0
    for i, digest in enumerate(cols["digest"]):
        if digest is None or cols["prompt_is_delta"][i]:
            continue
        tokens = cols["prompt_token_ids"][i] + cols["generation_token_ids"][i]
        if token_digest(tokens) != digest:
            raise CorruptSnapshotError(
                f"{where}: row {i} (model call {cols['model_call_id'][i]!r}): digest {digest} is not Gym's digest "
                f"of its {len(tokens)} prompt and generation tokens (expected {token_digest(tokens)})")
        cum_len = cols["cum_len"][i]
        if cum_len is not None and cum_len != len(tokens):
            raise CorruptSnapshotError(
                f"{where}: row {i} (model call {cols['model_call_id'][i]!r}): cum_len {cum_len}, but its prompt "
                f"and generation hold {len(tokens)} tokens")
        checked += 1
    return checked
