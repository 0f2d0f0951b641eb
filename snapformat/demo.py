"""``make format-demo``: write a realistic example store, then inspect it with the ``snapformat`` command.

Writes several snapshots of a run (every part the participants of a real run write: Gym's own
files adopted as parts, the data plane's rows, the controller's part), keeps the newest three,
leaves one draft as a crashed writer would, and shows ``snapformat ls``, ``show``, ``verify``,
``cat`` and ``gc`` on the result.

Why 200 rollouts a snapshot by default: since format 1.2 the Gym parts are Gym's own files, and
Gym writes about two files per parked rollout (its ``<capture_key>.lineage.jsonl`` and its
session's ``<rollout_id>.a<n>.json``), each one durably (temporary file, fsync, rename, folder
fsync), as a real save does. A 4,000-rollout snapshot is about 6,000 files and takes 5 to 15 s,
almost all of it those fsyncs, and ``show`` would list every file; 200 rollouts keep a snapshot to
a fraction of a second and its listing readable. ``--rollouts 4000`` writes the larger size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from snapformat.example import TOPOLOGY, write_example
from snapformat.snapshot_store import SnapshotStore


def _command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapformat")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "snapformat"]


def _run(*args: str) -> None:
    cmd = _command() + list(args)
    print(f"\n$ snapformat {' '.join(args)}", flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", default="demo-store")
    ap.add_argument("--snapshots", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=200, help="rollouts a snapshot (see above for why so few)")
    ap.add_argument("--keep", type=int, default=3)
    args = ap.parse_args(argv)

    store = SnapshotStore(args.store)
    print(f"writing {args.snapshots} snapshots of {args.rollouts} rollouts each into {args.store} (keep {args.keep})")
    for i in range(args.snapshots):
        t0 = time.perf_counter()
        draft = store.begin()
        gym, receipts = write_example(draft, count=args.rollouts, seed=draft.sequence)
        wrote = time.perf_counter() - t0
        published = draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=TOPOLOGY,
                                  timings_s={"write_parts": wrote}, keep_latest=args.keep, producer="snapformat demo")
        size = published.manifest.total_bytes
        print(f"  [{i + 1}/{args.snapshots}] published sequence {published.manifest.sequence}: "
              f"{published.manifest.file_count} files, {size / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f}s")

    crashed = store.begin()  # a writer that dies before publishing: its draft is never listed
    write_example(crashed, count=50, seed=999)
    print(f"  left an unpublished draft at {crashed.url} (as a crashed writer would); ls does not list it")

    latest = store.latest()
    assert latest is not None
    _run("ls", args.store)
    _run("show", latest.url)
    _run("verify", latest.url)
    _run("cat", latest.url, "continuations", "--limit", "3")
    _run("gc", args.store, "--min-age", "0")
    if shutil.which("duckdb") is None:
        print("\n(export a part for DuckDB or Polars with: snapformat export SNAPSHOT training training.parquet)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
