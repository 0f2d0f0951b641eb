"""Chains of incremental snapshots (shared objects, format 1.3) for the object, GC and copy tests.

:class:`Chain` publishes the next snapshot of a store the way an incremental writer does: its
``tq`` part lists the parent's row objects again (:meth:`PartWriter.reference`), except the first
``drop`` of them (rows consumed), optionally narrowing the first one it keeps by a row range (one
row consumed), and writes ``new`` row objects of its own (:meth:`PartWriter.write_rows_object`); a
``controller`` part is a whole file of the snapshot's folder. Every object's rows are a function of
a seed, and the chain remembers, per snapshot, which seeds and row ranges it listed, so a test can
rebuild what a snapshot must read back without trusting its manifest.
"""

from __future__ import annotations

import itertools

import pyarrow as pa

from schemas.controller import LoaderPlace
from snapformat import SnapshotStore, example, layout
from snapformat.publish import Published

ROW_KIND = "training_rows"
TQ, CONTROLLER = "tq", "controller"
ROLLOUTS = 24


def segment(seed: int) -> pa.RecordBatch:
    """Training rows (at least two, so that a row range can drop one), a function of ``seed`` only."""
    count = ROLLOUTS
    batch = example.training_batch(example.rollouts(count, seed), seed)
    while batch.num_rows < 2:  # a seed whose rollouts rarely finished: take more of them
        count *= 2
        batch = example.training_batch(example.rollouts(count, seed), seed)
    return batch


class Chain:
    """Publishes incremental snapshots into ``store``; seeds start at ``salt * 1_000_000`` so that two
    chains with different salts share no object."""

    def __init__(self, store: SnapshotStore, salt: int = 0) -> None:
        self.store = store
        self._seeds = itertools.count(salt * 1_000_000)
        self.seed_of: dict[str, int] = {}  # object name -> seed of its rows
        #: snapshot id -> [(seed, start, stop)] of each row entry it lists, in manifest order
        self.listed: dict[str, list[tuple[int, int, int]]] = {}

    def publish(self, new: int = 1, drop: int = 0, narrow: bool = False, keep_latest: int | None = None) -> Published:
        parent = self.store.latest()
        draft = self.store.begin()
        tq = draft.part(TQ, writer="tq")
        listed: list[tuple[int, int, int]] = []
        inherited = [] if parent is None else [f for f in parent.manifest.files if f.object is not None]
        for i, entry in enumerate(inherited[drop:]):
            low, high = entry.row_range if entry.row_range is not None else (0, entry.records)
            narrowed = (low + 1, high) if narrow and i == 0 and high - low >= 2 else None
            ref = tq.reference(entry, row_range=narrowed)
            start, stop = ref.row_range if ref.row_range is not None else (0, ref.records)
            listed.append((self.seed_of[entry.object], start, stop))
        for j in range(new):
            seed = next(self._seeds)
            rows = segment(seed)
            entry = tq.write_rows_object(f"seg-{draft.sequence:04d}-{j}.arrow", ROW_KIND, rows)
            self.seed_of[entry.object] = seed
            listed.append((seed, 0, rows.num_rows))
        draft.part(CONTROLLER, writer="controller").write_json(
            "loader", "loader_place", LoaderPlace(epoch=0, consumed=draft.sequence, seed=0))
        published = draft.publish(keep_latest=keep_latest)
        self.listed[draft.snapshot_id] = listed
        return published

    def expected(self, snapshot_id: str) -> pa.Table:
        """The training rows snapshot ``snapshot_id`` must read back, rebuilt from the seeds."""
        parts = [pa.Table.from_batches([segment(seed)]).slice(start, stop - start)
                 for seed, start, stop in self.listed[snapshot_id]]
        return pa.concat_tables(parts)


def referenced_objects(store: SnapshotStore) -> set[str]:
    """Every object a committed manifest of ``store`` names."""
    return {f.object for c in store.list() for f in store.open(c.sequence).manifest.files if f.object is not None}


def stored_objects(store: SnapshotStore) -> set[str]:
    """Every object present under ``objects/`` (temporary files aside)."""
    names = (layout.object_of_key(o.key) for o in store.store.walk(layout.OBJECTS))
    return {n for n in names if n is not None}
