"""``make demo``: write a realistic example store, then inspect it with the ``snapformat`` command.

Writes several snapshots of a run with thousands of rollouts each (every part kind, as the
participants of a real run would write them), keeps the newest three, leaves one draft as a
crashed writer would, and shows ``snapformat ls``, ``show`` and ``verify`` on the result.
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
    ap.add_argument("--rollouts", type=int, default=4000)
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
        size = sum(f.size for f in published.manifest.files)
        print(f"  [{i + 1}/{args.snapshots}] published sequence {published.manifest.sequence}: "
              f"{len(published.manifest.files)} files, {size / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f}s")

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
