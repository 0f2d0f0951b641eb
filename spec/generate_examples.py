"""Write the golden example store ``spec/examples/store-v1.4/`` with the reference writer.

    python spec/generate_examples.py            # (re)write spec/examples/store-v1.4
    python spec/generate_examples.py OUT_DIR    # write the same store elsewhere

The store holds two published snapshots, each written by
``snapformat.example.write_incremental_example`` (``count=12``, seeds 7 and 8; the second's
rollouts numbered on from the first's, and its data plane's oldest training row consumed) and
published with the receipts, Gym's commit result (each Gym server's commit reply verbatim) and the
example topology fingerprint (NeMo-RL's). The data plane's rows are segments, shared objects under
``objects/`` (format 1.3, feature ``shared_objects``, SPEC §12.12, §14.2): the first snapshot
writes one training and one token-capture segment; the second lists the first's token-capture
segment again whole, its training segment again narrowed by ``row_range`` to the rows still held,
and writes one new segment of each kind. Its Gym parts are Gym's own files, written into
``checkpoint_dir`` (the draft's ``gym/`` folder) as Gym's servers write them and adopted as parts
of kind ``gym_file`` (SPEC §12.11, CONTROL.md §9), which the manifest lists by their part
manifests and totals (format 1.4, feature ``part_listings``, SPEC §10.4). The second snapshot has two more parts, whole
files in its folder: ``bulk/``, whose JSON-lines file is large enough (more than 256 KiB of
content) to be stored zstd-compressed as ``bulk/replay_index.jsonl.zst``, so the golden store
covers both JSON-lines encodings; and ``nemo-rl/``, NeMo-RL's token-capture staging rows as a data
plane holds them, written as ``dataplane_rows`` (so that snapshot also requires the format 1.1
feature ``dataplane_rows``).

``spec/examples/store-v1/``, ``store-v1.1/``, ``store-v1.2/`` and ``store-v1.3/`` are the stores
format 1.0 to 1.3 writers produced; they are kept as they are, and every reader must keep reading
them. The 1.2 store's data files are what ``write_example`` (incremental saves off) still writes,
and the 1.3 store's data files and objects are this store's (1.4 changed only how the manifest lists
Gym's parts).

Every data file and object is a pure function of the seeds: only ``manifest.json``,
``part-manifest.json``, the commit records and ``_latest.json`` carry times and random snapshot
ids. ``tests/spec/test_golden.py`` regenerates the store into a temporary folder and compares the
checksums of the data files and objects with the committed ones, so an accidental change of the
bytes the writer produces fails a test. Change the golden store only with a format version change.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from coordinator.dataplane import DATAPLANE, InMemoryDataPlane, Ragged
from schemas.controller import ReplayIndexEntry
from snapformat import SnapshotStore, example
from snapformat.publish import Published

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "examples" / "store-v1.4"

COUNT = 12
SEEDS = (7, 8)
#: Training rows of the first snapshot the data plane has consumed by the second.
CONSUMED = 1
BULK_PREFIX = "bulk"
STAGING_PREFIX = "nemo-rl"
BULK_RECORDS = 2400  # ~330 KB of JSON lines: past the 256 KiB zstd threshold, a few KB stored
BULK_STATUSES = ("ready", "claimed_for_training", "applied_uncheckpointed")
PRODUCER = "snapformat spec/generate_examples.py"


def bulk_replay_index(n: int = BULK_RECORDS):
    """Deterministic replay-index entries, many and alike (as a long run's data plane would hold)."""
    for i in range(n):
        rollout_id = f"p{i // example.GROUP_SIZE}_g{i % example.GROUP_SIZE}"
        yield ReplayIndexEntry(key=f"bulk-{i:05d}/sample", partition_id="bulk", rollout_id=rollout_id,
                               attempt_index=i % 3 // 2, group_id=f"p{i // example.GROUP_SIZE}",
                               status=BULK_STATUSES[i % len(BULK_STATUSES)])


def staging_rows(seed: int, rollouts: int = 6) -> pa.Table:
    """NeMo-RL's token-capture staging rows (two deltas per rollout) as a data plane holds them, as
    the TQ adapter writes a partition of that shape: ``dataplane_rows`` with its layout."""
    rng = np.random.default_rng(seed)
    keys, tags, deltas = [], [], []
    for r in range(rollouts):
        rid = f"p{r // example.GROUP_SIZE}_g{r % example.GROUP_SIZE}"
        prev = 0
        for d in range(2):
            n = int(rng.integers(2, 6))
            keys.append(f"{rid}/delta-{d}")
            tags.append({"rollout_id": rid, "attempt_index": 0})
            deltas.append((prev, n))
            prev += n
    lens = [n for _, n in deltas]
    plane = InMemoryDataPlane()
    plane.put("token_capture_staging", keys, {
        "token_ids_delta": Ragged([rng.integers(0, 150_000, n, dtype=np.int64) for n in lens]),
        "token_mask_delta": Ragged([np.ones(n, dtype=np.bool_) for n in lens]),
        "generation_logprobs_delta": Ragged([-rng.random(n, dtype=np.float32) for n in lens]),
        "prev_len": np.array([p for p, _ in deltas], dtype=np.int64),
        "delta_len": np.array(lens, dtype=np.int64),
        "cum_len": np.array([p + n for p, n in deltas], dtype=np.int64),
        "weight_version": np.array([1] * len(keys), dtype=np.int64),
    }, tags=tags)
    return plane.cut().tables[DATAPLANE]


def write_store(root: str | Path) -> list[Published]:
    """Write the golden store into ``root`` (which must not hold a store yet)."""
    store = SnapshotStore(str(root))
    published = []
    for n, seed in enumerate(SEEDS):
        draft = store.begin()
        gym, receipts = example.write_incremental_example(draft, count=COUNT, seed=seed, first=n * COUNT,
                                                          consumed=CONSUMED if n else 0)
        if n == len(SEEDS) - 1:
            bulk = draft.part(BULK_PREFIX, writer="example:bulk")
            entry = bulk.write_records("replay_index", "replay_index", bulk_replay_index())
            assert entry.compression == "zstd", entry
            receipts.append(bulk.close())
            staging = draft.part(STAGING_PREFIX, writer="example:staging")
            staging.write_rows("dataplane.arrow", "dataplane_rows", staging_rows(seed))
            receipts.append(staging.close())
        published.append(draft.publish(receipts=receipts, gym_commit=gym,
                                       topology_fingerprint=example.TOPOLOGY, producer=PRODUCER))
    return published


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    if out.exists():
        shutil.rmtree(out)
    for p in write_store(out):
        print(f"published {p.url} (sequence {p.manifest.sequence}, {p.manifest.file_count} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
