"""A verified row read hashes on a second thread and checks each batch behind the hash.

Proves that:
- ``BackgroundHash`` gives the same checksum as hashing in one go, whatever the chunking, and
  ``wait_until(n)`` returns only once ``n`` bytes are hashed;
- every batch of a verified read is checked (declared sizes, full validation, nulls) only after
  the hash has passed the batch's last byte, and the reader is returned only after the whole
  checksum matched;
- a flip of any byte of a row file is refused as a checksum mismatch naming the file, never as
  the parse error the flip may also cause (the mismatch is checked first when anything fails);
- a file with a matching checksum but a null where the schema forbids one is still refused by
  the row check, and a row file with dictionary batches (an extra dictionary column) is hashed in
  full before Arrow opens it, and reads.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_null_columns import NULL_ROWS, _published_table, plant, with_nulls

from schemas.errors import CorruptSnapshotError, InvalidRecordError
from snapformat import SnapshotStore, arrow_parts, checksum
from snapformat.checksum import BackgroundHash, checksum_bytes

pytestmark = pytest.mark.timeout(60)

TOKENS = "tq/token_capture.arrow"


@given(data=st.binary(max_size=4096), chunk=st.integers(1, 600))
def test_the_background_hash_is_the_hash_of_the_bytes(data: bytes, chunk: int) -> None:
    old = checksum._CHUNK
    checksum._CHUNK = chunk
    try:
        h = BackgroundHash(memoryview(data))
        h.wait_until(len(data) // 2)
        assert h._done >= len(data) // 2
        assert h.result() == checksum_bytes(data)
    finally:
        checksum._CHUNK = old


class Recorded(BackgroundHash):
    """A background hash that remembers, for each block checked while it exists, how far it had got."""

    made: ClassVar[list[Recorded]] = []

    def __init__(self, view: memoryview, algorithm: str = "xxh128") -> None:
        super().__init__(view, algorithm)
        self.checked_behind: list[tuple[int, int]] = []  # (block end, bytes hashed when it was checked)
        Recorded.made.append(self)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Recorded]:
    Recorded.made = []
    monkeypatch.setattr(checksum, "_CHUNK", 512)  # many steps over a small file, each a little slow
    real_new_hasher = checksum.new_hasher

    class Slow:
        def __init__(self, algorithm: str) -> None:
            self._h = real_new_hasher(algorithm)

        def update(self, data) -> None:
            time.sleep(0.001)
            self._h.update(data)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    monkeypatch.setattr(checksum, "new_hasher", Slow)
    monkeypatch.setattr(arrow_parts, "BackgroundHash", Recorded)
    real_check_block = arrow_parts.check_block

    def check_block(view, block, where):
        h = Recorded.made[-1]
        h.checked_behind.append((block.end, h._done))
        return real_check_block(view, block, where)

    monkeypatch.setattr(arrow_parts, "check_block", check_block)
    return Recorded.made


def test_each_batch_is_checked_behind_the_hash(example_store: Path, rewrite_manifest,
                                              recorded: list[Recorded]) -> None:
    path = "tq/training.arrow"
    plant(example_store, path, _published_table(example_store, path), rewrite_manifest)  # batches of 4 rows
    snap = SnapshotStore(str(example_store)).open(1)
    (entry,) = snap.select(path)
    recorded.clear()
    reader = snap.open_rows(entry)
    (h,) = recorded
    assert len(h.checked_behind) == entry.batches == reader.num_record_batches > 1
    assert all(end <= done for end, done in h.checked_behind)
    assert any(done < entry.size for _, done in h.checked_behind)  # checked while the hash still ran
    assert h._done == entry.size and not h._thread.is_alive()  # the whole file hashed before the return


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_byte_is_a_checksum_mismatch(example_store: Path, where: float, bit: int) -> None:
    snap = SnapshotStore(str(example_store)).open(1)
    (entry,) = snap.select(TOKENS)
    path = Path(snap.url) / TOKENS
    original = path.read_bytes()
    i = int(where * len(original))
    path.write_bytes(original[:i] + bytes([original[i] ^ (1 << bit)]) + original[i + 1:])
    try:
        for read in (lambda: snap.read_table(TOKENS), lambda: snap.open_rows(entry)):
            with pytest.raises(CorruptSnapshotError, match=f"{TOKENS}: checksum mismatch"):
                read()
    finally:
        path.write_bytes(original)


def test_a_null_with_a_matching_checksum_is_refused_by_the_row_check(example_store: Path, rewrite_manifest) -> None:
    path = "tq/training.arrow"
    table = with_nulls(_published_table(example_store, path), "rollout_id", NULL_ROWS, declared_nullable=True)
    plant(example_store, path, table, rewrite_manifest)
    with pytest.raises(InvalidRecordError, match="record batch 1: .*rollout_id"):
        SnapshotStore(str(example_store)).open(1).read_table(path)


def test_a_row_file_with_dictionary_batches_is_hashed_first_and_reads(example_store: Path, rewrite_manifest,
                                                                       recorded: list[Recorded]) -> None:
    path = "tq/training.arrow"
    table = _published_table(example_store, path)
    labels = pa.array([f"label-{i % 3}" for i in range(table.num_rows)]).dictionary_encode()
    data = plant(example_store, path, table.append_column("label", labels), rewrite_manifest)
    blocks = arrow_parts.footer_blocks(memoryview(data), path)
    assert any(b.label == "dictionary batch" for b in blocks)
    snap = SnapshotStore(str(example_store)).open(1)
    recorded.clear()  # planting read the file too
    assert snap.read_table(path).column("label").to_pylist() == labels.to_pylist()
    (h,) = recorded
    assert len(h.checked_behind) == len(blocks) and all(done == len(data) for _, done in h.checked_behind)
    file = Path(snap.url) / path
    i = len(data) // 2
    file.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        snap.read_table(path)
    assert os.path.getsize(file) == len(data)
