"""Incremental saves of TransferQueue's rows (a real TQ on Ray, loopback): the incremental contract
for rows put through the adapter (kept by its capture) and for rows another producer put straight
into TQ (read back at each save), and a field whose rows change length between puts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dataplane_contract import TOKEN_PARTITION, assert_same, training_tags
from segments_contract import IncrementalContract, keys_of, new_entries, reload, row_entries, save
from test_adapter import AdapterHarness, TQHarness

from coordinator.dataplane import TRAINING
from coordinator.dataplane.tq.adapter import TQDataPlane
from snapformat import SnapshotStore


class TestTQIncremental(IncrementalContract):
    """Rows put through the adapter: a save plans them from its capture and assembles each new segment."""

    @pytest.fixture
    def harness(self, tq_plane: TQDataPlane) -> AdapterHarness:
        return AdapterHarness(tq_plane)


class TestTQIncrementalSynchronous(IncrementalContract):
    """No capture and no background load: every save reads the rows back out of TQ, and a restore
    puts each segment of a partition with all its fields before it returns."""

    @pytest.fixture
    def harness(self, tq_runtime) -> AdapterHarness:
        plane = TQDataPlane(token_capture_partitions={TOKEN_PARTITION}, capture_max_bytes=0, background_load=False)
        plane.clear()
        yield AdapterHarness(plane)
        plane.clear()


def _rows(n: int, width: int, start: int = 0) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(start, start + n * width, dtype=np.int64).reshape(n, width),
            "input_lengths": np.full(n, width, np.int32)}


def test_rows_another_producer_put_are_read_back_once_then_listed_again(tq_plane: TQDataPlane,
                                                                         tmp_path: Path) -> None:
    """Keys the adapter did not put (read from TQ at each save) are segments like the others: the
    second save reads them, but writes only the new ones."""
    h = TQHarness(tq_plane)
    h.put("train", [f"a{i}" for i in range(6)], _rows(6, 3), training_tags(6))
    store = SnapshotStore(str(tmp_path / "store"))
    first, w1 = save(h, store, None)
    h.put("train", ["b0", "b1"], _rows(2, 3, 100), training_tags(2, 6))
    h.delete("train", ["a0"])
    before = h.contents()
    second, w2 = save(h, store, w1.segments)
    (narrowed, fresh) = row_entries(second)
    assert narrowed.object == row_entries(first)[0].object and narrowed.row_range == (1, 6)
    assert new_entries(second, first) == [fresh] and keys_of(second, [fresh]) == ["b0", "b1"]
    assert w2.rows == {TRAINING: 7, "token_capture_rows": 0}
    reload(h, second)
    assert_same(before, h.contents())


def test_a_dense_field_whose_new_rows_differ_in_length_comes_back_as_the_data_plane_holds_it(
        tq_plane: TQDataPlane, tmp_path: Path) -> None:
    """The first segment was written dense; later rows of another length make the field ragged in the
    partition: every new segment says so, the old one is listed as it was, and a restore joins them
    into what a whole save would have given TQ."""
    h = AdapterHarness(tq_plane)
    h.put("train", [f"a{i}" for i in range(4)], _rows(4, 3), training_tags(4))
    store = SnapshotStore(str(tmp_path / "store"))
    first, w1 = save(h, store, None)
    h.put("train", ["b0", "b1"], _rows(2, 5, 100), training_tags(2, 4))
    h.put("train", ["c0"], _rows(1, 3, 200), training_tags(1, 6))
    before = h.contents()
    second, w2 = save(h, store, w1.segments)
    assert w2.shared_bytes == row_entries(first)[0].size
    assert keys_of(second, new_entries(second, first)) == ["b0", "b1", "c0"]
    loaded = reload(h, second)
    assert loaded.rows == {TRAINING: 7}
    assert_same(before, h.contents())
