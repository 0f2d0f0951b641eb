"""The data-plane interface: importing it loads neither Ray nor torch, and a cut copied in the pause
is written by the one write path, exactly as the same partitions given as sources are.

No Ray, no torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from dataplane_contract import STAGING_PARTITION, TOKEN_PARTITION, fill, staging_fields, staging_tags

from coordinator.dataplane import InMemoryDataPlane, parse_table, whole_source, write_sources
from snapformat import SnapshotStore


def test_importing_the_interface_loads_neither_ray_nor_torch() -> None:
    code = ("import coordinator, coordinator.dataplane, coordinator.dataplane.tq, coordinator.dataplane.tq.capture, "
            "sys; print('ray' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.split() == ["False", "False"]


def test_a_copied_cut_writes_the_files_its_partitions_write_as_sources(tmp_path: Path) -> None:
    """Every kind (an empty partition first among them), through both: the same bytes, file by file."""
    plane = InMemoryDataPlane(token_capture_partitions={TOKEN_PARTITION})
    plane.put("empty-first", ["k"], {"input_lengths": np.array([1], np.int32)},
              [{"rollout_id": "r", "attempt_index": 0}])
    plane.delete("empty-first", ["k"])
    fill(plane)
    rng = np.random.default_rng(4)
    plane.put(STAGING_PARTITION, [f"s{i}" for i in range(3)], staging_fields(rng, 3), staging_tags(3))
    cut = plane.cut()
    parts = sorted((p for t in cut.tables.values() for p in parse_table(t, "cut")), key=lambda p: p.position)
    assert [p.partition_id for p in parts] == list(cut.partitions)
    sources = plane.sources_by_kind(whole_source(p, p.position) for p in parts)
    assert list(sources) == list(cut.tables)
    written = {}
    for name, write in (("copied", cut.write), ("sources", lambda part: write_sources(sources, part))):
        store = SnapshotStore(str(tmp_path / name))
        draft = store.begin()
        written[name] = write(draft.part("tq", writer="tq"))
        draft.publish()
    assert written["copied"].rows == written["sources"].rows == cut.rows
    assert written["copied"].nbytes == written["sources"].nbytes == cut.held_bytes
    for a, b in zip(written["copied"].entries, written["sources"].entries, strict=True):
        assert (a.path, a.size, a.checksum, a.records, a.batches) == (b.path, b.size, b.checksum, b.records, b.batches)
