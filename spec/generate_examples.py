"""Write the golden example store ``spec/examples/store-v1/`` with the reference writer.

    python spec/generate_examples.py            # (re)write spec/examples/store-v1
    python spec/generate_examples.py OUT_DIR    # write the same store elsewhere

The store holds two published snapshots, each written by ``snapformat.example.write_example``
(``count=12``, seeds 7 and 8) and published with the receipts, Gym's commit result and the
example topology fingerprint. The second snapshot has one more part, ``bulk/``, whose JSON-lines
file is large enough (more than 256 KiB of content) to be stored zstd-compressed as
``bulk/sessions.jsonl.zst``, so the golden store covers both JSON-lines encodings.

Every data file is a pure function of the seeds: only ``manifest.json``, ``part-manifest.json``,
the commit records and ``_latest.json`` carry times and random snapshot ids.
``tests/spec/test_golden.py`` regenerates the store into a temporary folder and compares the
checksums of the data files with the committed ones, so an accidental change of the bytes the
writer produces fails a test. Change the golden store only with a format version change.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from schemas.gym_records import SessionStateRecord
from snapformat import SnapshotStore, example
from snapformat.publish import Published

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "examples" / "store-v1"

COUNT = 12
SEEDS = (7, 8)
BULK_PREFIX = "bulk"
BULK_RECORDS = 1800  # ~300 KB of JSON lines: past the 256 KiB zstd threshold, ~10 KB stored
PRODUCER = "snapformat spec/generate_examples.py"


def bulk_sessions(n: int = BULK_RECORDS):
    """Deterministic session records, many and alike (as a resource server's export would be)."""
    for i in range(n):
        yield SessionStateRecord(
            session_id=f"bulk-{i:05d}", resource="scratch", state_revision=i % 17,
            rollout_id=f"p{i // example.GROUP_SIZE}_g{i % example.GROUP_SIZE}",
            state={"cwd": "/work", "files": {f"notes-{i % 7}.txt": f"turn {i % 5}"}, "history": i % 13},
        )


def write_store(root: str | Path) -> list[Published]:
    """Write the golden store into ``root`` (which must not hold a store yet)."""
    store = SnapshotStore(str(root))
    published = []
    for n, seed in enumerate(SEEDS):
        draft = store.begin()
        gym, receipts = example.write_example(draft, count=COUNT, seed=seed)
        if n == len(SEEDS) - 1:
            bulk = draft.part(BULK_PREFIX, writer="example:bulk")
            entry = bulk.write_records("sessions", "session_state", bulk_sessions())
            assert entry.compression == "zstd", entry
            receipts.append(bulk.close())
        published.append(draft.publish(receipts=receipts, gym_commit=gym,
                                       topology_fingerprint=example.TOPOLOGY, producer=PRODUCER))
    return published


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    if out.exists():
        shutil.rmtree(out)
    for p in write_store(out):
        print(f"published {p.url} (sequence {p.manifest.sequence}, {len(p.manifest.files)} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
