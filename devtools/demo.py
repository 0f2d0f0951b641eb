"""``make demo``: a training job crashes in the middle (every process SIGKILLed), restarts, restores,
and finishes with exactly what an uninterrupted run produces.

1. An uninterrupted run of the workload (no snapshots), for reference.
2. The same workload with a snapshot every few seconds; once two snapshots are published and
   rollouts are mid-flight, every process of the job (driver, Ray, TransferQueue, Gym servers) is
   SIGKILLed at once.
3. The job is started again on the same store: it restores the newest snapshot, continues each
   unfinished rollout from its last finished turn, and finishes.
4. The report: from which turn each restored rollout continued, the check against run 1 (final
   trajectories and data-plane rows equal; every rollout trained exactly once), the pause of every
   snapshot and the bytes it wrote (new rows, and the rows it shares with the snapshot before it:
   saves are incremental), and ``snapformat show`` of the newest snapshot.

``--store`` is a folder (default) or ``s3://bucket/prefix``; each demo run uses a fresh sub-prefix.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from coordinator.config import ControllerConfig, GymRolloutCheckpointing, RolloutCheckpointing
from coordinator.workload import Workload
from devtools.accounting import content, differences, trained_once
from devtools.job_process import JobProcess
from snapformat.snapshot_store import SnapshotStore

JOB_TIMEOUT_S = 600.0


def tables_of(doc: dict[str, Any]) -> dict[str, pa.Table]:
    return {k: pa.ipc.open_stream(bytes.fromhex(v)).read_all() for k, v in doc["tables"].items()}


def saves_of(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "saves.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reference_content(workdir: Path, workload: Workload, config: ControllerConfig,
                      model_slow_ms: int) -> dict[str, Any]:
    """The final rows of an uninterrupted run (no snapshots), as :func:`~devtools.accounting.content`."""
    ref = JobProcess(str(workdir / "reference-store"), workdir / "reference", workload=workload,
                     config=config.without_snapshots(),
                     model_slow_ms=model_slow_ms, outcome=workdir / "reference" / "outcome.json")
    if ref.wait(JOB_TIMEOUT_S) != 0:
        raise RuntimeError(f"the uninterrupted reference run failed:\n{ref.tail()}")
    return content(tables_of(ref.outcome()))


def written(save: dict[str, Any]) -> str:
    """What a published save wrote: new bytes (the data plane's rows, then every other file) and the
    bytes of rows it lists from the snapshot before it without writing them."""
    new_rows, shared, parts = save["rows_new_bytes"], save["rows_shared_bytes"], save["parts_bytes"]
    return (f"written {(new_rows + parts) / 1e6:.3f} MB new ({new_rows / 1e6:.3f} MB of rows, "
            f"{parts / 1e6:.3f} MB of Gym's and the controller's files), {shared / 1e6:.3f} MB of rows shared "
            "with the snapshot before")


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_demo(store: str, workdir: Path, workload: Workload, config: ControllerConfig, model_slow_ms: int) -> int:
    run_store = f"{store.rstrip('/')}/run-{time.strftime('%Y%m%d-%H%M%S')}"
    _say(f"demo: {workload.rollouts} rollouts ({workload.prompts} prompts x {workload.group_size}), "
         f"{workload.min_turns}-{workload.max_turns} turns each; store {run_store}; logs in {workdir}")

    _say("\n== 1. an uninterrupted run, for reference (no snapshots)")
    t0 = time.monotonic()
    expected = reference_content(workdir, workload, config, model_slow_ms)
    _say(f"   done in {time.monotonic() - t0:.1f}s (the job's start included)")

    _say(f"\n== 2. the same run with a snapshot every {config.rollout_checkpointing.snapshot_attempt_interval_s}s; "
         "SIGKILL every process mid-run")
    crashed = JobProcess(run_store, workdir / "run", workload=workload, config=config, model_slow_ms=model_slow_ms,
                         log_name="job-1.log")
    snapshots = SnapshotStore(run_store)

    def ready() -> bool:
        stored = [ln for ln in crashed.lines() if "rollouts stored" in ln]
        if not stored:
            return False
        n = int(stored[-1].split("job: ")[1].split("/")[0])
        return n >= workload.rollouts // 3 and len(snapshots.list()) >= 2

    crashed.wait_for(ready, "two snapshots and a third of the rollouts", JOB_TIMEOUT_S)
    killed = crashed.kill()
    newest = snapshots.list()[0]
    _say(f"   SIGKILLed {len(killed)} processes (job driver, Ray, TransferQueue, Gym servers) "
         f"with {len(snapshots.list())} snapshots published; newest is {newest.sequence}")
    for line in crashed.lines()[-3:]:
        _say(f"   | {line}")

    _say("\n== 3. start the job again: restore, continue, finish")
    again = JobProcess(run_store, workdir / "run", workload=workload, config=config, model_slow_ms=model_slow_ms,
                       outcome=workdir / "run" / "outcome.json", log_name="job-2.log")
    if again.wait(JOB_TIMEOUT_S) != 0:
        _say(again.tail())
        return 1
    actual = again.outcome()
    restored = actual["outcome"]["restored"]
    _say(f"   restored snapshot {restored['sequence']} in {sum(restored['steps_s'].values()):.2f}s "
         f"({', '.join(f'{k} {v:.2f}s' for k, v in restored['steps_s'].items())}); "
         f"finished in {actual['outcome']['seconds']:.1f}s")

    _say("\n== 4. where each unfinished rollout continued")
    for c in sorted(restored["continued"], key=lambda c: c["rollout_id"]):
        where = "starts over (it used the restart-only sandbox)" if c["discarded"] else \
            f"continues after {c['after_call']}" if c["after_call"] else "starts at its first turn"
        _say(f"   {c['rollout_id']:>10}  run {c['attempt_index']}  {where}")
    _say(f"   {len(restored['continued'])} rollouts continued, {restored['acks_resent']} acknowledgements owed from "
         "before the crash settled")

    _say("\n== 5. check against the uninterrupted run")
    ids = [s.rollout_id for i in range(workload.prompts) for s in workload.group(i)]
    problems = differences(expected, content(tables_of(actual))) + trained_once(actual["records"], ids)
    rows = {k: t.num_rows for k, t in tables_of(actual).items()}
    if problems:
        for p in problems:
            _say(f"   MISMATCH: {p}")
    else:
        _say(f"   equal: every trajectory and every data-plane row ({rows}); each of {len(ids)} rollouts trained "
             "exactly once, no acknowledgement owed")

    _say("\n== 6. each snapshot: its pause (from prepare to resume) and the bytes it wrote")
    for s in saves_of(workdir / "run"):  # both jobs append to it
        state = f"snapshot {s['sequence']}" if s["published"] else f"not published ({s['error']})"
        steps = ", ".join(f"{k} {v * 1000:.0f}" for k, v in s["steps_s"].items())
        again = s.get("prepares", 1) - 1
        retried = f" ({again} prepare(s) again: results completed after the flush)" if again > 0 else ""
        _say(f"   {state}: pause {s['pause_s'] * 1000:.0f} ms [{steps} ms], {s['cut_bytes'] / 1e6:.2f} MB cut{retried}")
        if s["published"]:
            _say(f"      {written(s)}")

    _say("\n== 7. the newest snapshot: snapformat show")
    subprocess.run([sys.executable, "-m", "snapformat", "show", run_store], check=False)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="demo-store", help="a folder or s3://bucket/prefix")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--model-slow-ms", type=int, default=150)
    ap.add_argument("--max-in-flight", type=int, default=24)
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="snapdemo-"))
    workload = Workload(prompts=args.prompts, group_size=args.group_size)
    config = ControllerConfig(rollout_checkpointing=RolloutCheckpointing(
        snapshot_attempt_interval_s=args.interval, keep_latest_k=3, gym=GymRolloutCheckpointing(
            capability_discovery_enabled=True, participant_checkpointing_enabled=True)), max_in_flight=args.max_in_flight)
    store = args.store if "://" in args.store else str(Path(args.store).resolve())
    return run_demo(store, workdir, workload, config, args.model_slow_ms)


if __name__ == "__main__":
    sys.exit(main())
