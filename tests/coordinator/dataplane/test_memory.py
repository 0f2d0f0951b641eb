"""The in-memory data plane: the shared contract, and what it does as TransferQueue's KV store does.

No Ray, no torch: this module must run where only the snapshot format is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from dataplane_contract import TOKEN_PARTITION, DataPlaneContract, Harness, norm_object, norm_tensor

from coordinator.dataplane import InMemoryDataPlane


class MemoryHarness(Harness):
    def __init__(self) -> None:
        self.plane = InMemoryDataPlane(token_capture_partitions={TOKEN_PARTITION})

    def put(self, partition_id, keys, fields=None, tags=None) -> None:
        self.plane.put(partition_id, keys, fields, tags)

    def delete(self, partition_id, keys) -> None:
        self.plane.delete(partition_id, keys)

    def contents(self) -> dict[str, Any]:
        out = {}
        for pid, key_tags in self.plane.list().items():
            specs = self.plane.specs(pid)
            rows = {}
            for key in key_tags:
                rows[key] = {name: (norm_tensor(specs[name].dtype, v.shape, v.tobytes()) if isinstance(v, np.ndarray)
                                    else norm_object(v)) for name, v in self.plane.get(pid, key).items()}
            held = {name for r in rows.values() for name in r}
            out[pid] = {"keys": list(key_tags), "tags": key_tags, "rows": rows,
                        "layout": {n: (s.dtype, s.nested) for n, s in specs.items() if n in held}}
        return out


class TestInMemoryContract(DataPlaneContract):
    @pytest.fixture
    def harness(self) -> MemoryHarness:
        return MemoryHarness()


def test_in_memory_plane_copies_in_and_out() -> None:
    plane = InMemoryDataPlane()
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    plane.put("p", ["a", "b"], {"ids": ids}, [{"rollout_id": "r0", "attempt_index": 0}] * 2)
    ids[:] = -1  # the caller's array changes: the plane's copy does not
    got = plane.get("p", "a")["ids"]
    assert got.tolist() == [0, 1, 2]
    got[:] = 7
    assert plane.get("p", "a")["ids"].tolist() == [0, 1, 2]


def test_tags_merge_like_transferqueue() -> None:
    plane = InMemoryDataPlane()
    plane.put("p", ["a"], tags=[{"x": 1}])
    plane.put("p", ["a"], tags=[{"y": 2}])
    assert plane.list() == {"p": {"a": {"x": 1, "y": 2}}}
