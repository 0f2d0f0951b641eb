"""``make soak``: the whole system under repeated SIGKILLs, then an independent account of what was lost.

Each cycle starts the job (``devtools.job``: Ray, TransferQueue, the Gym servers, the actors; it
restores from the store when it holds a snapshot), waits a random moment (``start``: within 1.5 s of
the controller's start, so often during the restore; ``run``: a while into the run, often during a
save, since snapshots are taken every second) and SIGKILLs one place:

- ``controller``: the Single Controller's Ray worker process;
- ``model``, ``agent``, ``resource``: one Gym server;
- ``tq_storage``: TransferQueue's storage unit (a Ray actor process holding every row);
- ``s3``: the SeaweedFS server holding the store (when the store is on S3; it is restarted at once,
  on the same data, as an operator would);
- ``job``: every process of the job at once.

The job then fails on its own (a dead actor, Gym unreachable past ``gym_unreachable_s``, too many
failed saves) or, after a bound, is killed whole by the operator; the next cycle starts it again.
After the cycles the job runs to the end without kills, and the accounting checks, independently of
the controller's own view: every rollout's final rows equal an uninterrupted run's (run first),
every rollout was trained exactly once and no acknowledgement is owed, and every published snapshot
verifies. The report lists cycles, kills per place, snapshots published and aborted, and what was lost.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from coordinator.config import ControllerConfig, GymRolloutCheckpointing, RolloutCheckpointing
from coordinator.workload import Workload
from devtools.accounting import content, differences, trained_once
from devtools.demo import reference_content, saves_of, tables_of
from devtools.job_process import JobProcess, process_tree
from snapformat import SnapshotStore, verify_snapshot

PLACES = ("controller", "model", "agent", "resource", "sandbox", "tq_storage", "job")
EXIT_WAIT_S = 40.0  # how long the operator lets a wounded job fail by itself before killing it whole
JOB_TIMEOUT_S = 900.0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_of(job: JobProcess, place: str) -> list[int]:
    """The processes that make up ``place`` in ``job`` (empty if it is not running yet)."""
    if place == "job":
        return process_tree(job.pid)
    if place in ("model", "agent", "resource", "sandbox"):
        path = job.workdir / "gym.pids.json"
        return [json.loads(path.read_text())[place]] if path.exists() else []
    if place == "controller":
        path = job.workdir / "controller.pid"
        return [int(path.read_text())] if path.exists() else []
    if place == "tq_storage":
        return [p for p in process_tree(job.pid) if _cmdline(p).startswith("ray::SimpleStorageUnit")]
    raise ValueError(place)


class Soak:
    def __init__(self, store: str, workdir: Path, workload: Workload, config: ControllerConfig, model_slow_ms: int,
                 seed: int, s3: Any = None, places: tuple[str, ...] | None = None) -> None:
        self.store, self.workdir, self.workload, self.config = store, workdir, workload, config
        self.model_slow_ms, self.rng, self.s3 = model_slow_ms, random.Random(seed), s3
        self.kills: Counter[str] = Counter()
        self.moments: Counter[str] = Counter()
        self.cycles = 0
        self.lost: list[str] = []
        self.exits: list[str] = []  # how each wounded job ended
        self.places = places or PLACES + (("s3",) if s3 is not None else ())

    def _job(self, name: str, outcome: Path | None = None) -> JobProcess:
        return JobProcess(self.store, self.workdir / "run", workload=self.workload, config=self.config,
                          model_slow_ms=self.model_slow_ms, outcome=outcome, log_name=f"{name}.log")

    def cycle(self) -> bool:
        """One start, wait, kill; False when the job finished before the kill."""
        self.cycles += 1
        for stale in ("gym.pids.json", "controller.pid"):
            (self.workdir / "run" / stale).unlink(missing_ok=True)
        job = self._job(f"cycle-{self.cycles:03d}")
        moment = self.rng.choice(["start", "run", "run"])
        place = self.rng.choice(self.places)
        try:
            if moment == "start":  # Gym is up and the controller exists: setup (the restore, if any) is running
                job.wait_for(lambda: pids_of(job, "controller"), "the controller", JOB_TIMEOUT_S)
                time.sleep(self.rng.uniform(0.0, 1.5))
            else:
                job.wait_for(lambda: any(ln.startswith("job: ") and "rollouts stored" in ln for ln in job.lines()),
                             "the run", JOB_TIMEOUT_S)
                time.sleep(self.rng.uniform(0.2, 5.0))
        except RuntimeError:  # the job ended by itself before the moment came
            job.kill()
            return not self._finished(job)
        if job.popen.poll() is not None:
            job.kill()
            return not self._finished(job)
        self.moments[moment] += 1
        self._kill(job, place)
        try:
            job.wait(EXIT_WAIT_S)
            self.exits.append("failed by itself")
        except TimeoutError:  # wait() killed the whole job: the operator's move
            self.exits.append(f"killed by the operator after {EXIT_WAIT_S:.0f}s")
        job.kill()  # whatever is left of it
        if place == "s3":
            self.s3.start()
        print(f"soak: cycle {self.cycles}: killed {place} at the {moment}; snapshots now "
              f"{len(SnapshotStore(self.store).list())}", flush=True)
        return True

    @staticmethod
    def _finished(job: JobProcess) -> bool:
        return any(ln.startswith("job: done=True") for ln in job.lines())

    def _kill(self, job: JobProcess, place: str) -> None:
        import os
        import signal

        self.kills[place] += 1
        if place == "s3":
            self.s3.stop(signal.SIGKILL)
            return
        for pid in pids_of(job, place):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self) -> dict[str, Any]:
        job = self._job("final", outcome=self.workdir / "run" / "outcome.json")
        if job.wait(JOB_TIMEOUT_S) != 0:
            raise RuntimeError(f"the final job failed:\n{job.tail()}")
        return job.outcome()


def run_soak(store: str, workdir: Path, minutes: float, max_cycles: int, seed: int, workload: Workload,
             config: ControllerConfig, model_slow_ms: int, s3: Any = None, expected: dict[str, Any] | None = None,
             places: tuple[str, ...] | None = None) -> tuple[int, Soak]:
    """Cycles of start-wait-kill, the final run, the account; returns (exit code, the soak's tallies)."""
    print(f"soak: {workload.rollouts} rollouts; up to {max_cycles} cycles or {minutes} min; store {store}; "
          f"logs in {workdir}", flush=True)
    if expected is None:
        expected = reference_content(workdir, workload, config, model_slow_ms)
    soak = Soak(store, workdir, workload, config, model_slow_ms, seed, s3, places)
    end = time.monotonic() + minutes * 60
    while soak.cycles < max_cycles and time.monotonic() < end:
        if not soak.cycle():
            break
    actual = soak.finish()
    ids = [s.rollout_id for i in range(workload.prompts) for s in workload.group(i)]
    lost = differences(expected, content(tables_of(actual))) + trained_once(actual["records"], ids)
    snaps = SnapshotStore(store)
    bad = [c.sequence for c in snaps.list() if not verify_snapshot(snaps.open(c.sequence)).ok]
    lost += [f"snapshot {s} does not verify" for s in bad]
    saves = saves_of(workdir / "run")
    print("\n| measure | value |\n|---|---|")
    print(f"| cycles | {soak.cycles} |")
    print(f"| kills per place | {', '.join(f'{p} {soak.kills[p]}' for p in soak.places)} |")
    print(f"| kill moments | {', '.join(f'{m} {n}' for m, n in sorted(soak.moments.items()))} |")
    print(f"| wounded jobs | {', '.join(f'{e} {n}' for e, n in sorted(Counter(soak.exits).items()))} |")
    print(f"| saves logged: published / aborted | {sum(s['published'] for s in saves)} / "
          f"{sum(not s['published'] for s in saves)} |")
    print(f"| snapshots kept (keep_latest_k={config.rollout_checkpointing.keep_latest_k}), all verify | {len(snaps.list())}, "
          f"{'yes' if not bad else 'NO'} |")
    print(f"| rollouts | {len(ids)}, final rows equal an uninterrupted run's: {'yes' if not lost else 'NO'} |")
    print(f"| lost or trained twice | {len(lost)} |")
    for p in lost:
        print(f"LOST: {p}")
    soak.lost = lost
    return (1 if lost else 0), soak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=None, help="a folder (default: a new one under --workdir) or 's3' for a "
                    "SeaweedFS started here (then also killed and restarted)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--model-slow-ms", type=int, default=200)
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="snapsoak-"))
    workload = Workload(prompts=args.prompts, group_size=4)
    config = ControllerConfig(
        rollout_checkpointing=RolloutCheckpointing(snapshot_attempt_interval_s=1.0, keep_latest_k=3,
                                                   gym=GymRolloutCheckpointing(
            capability_discovery_enabled=True, participant_checkpointing_enabled=True, prepare_timeout_s=20.0)),
        max_in_flight=16, gym_unreachable_s=5.0, commit_timeout_s=20.0, restore_timeout_s=60.0)
    s3 = None
    store = args.store or str(workdir / "store")
    if args.store == "s3":
        import os

        from devtools import s3servers

        s3 = s3servers.seaweedfs(str(workdir / "seaweed"))
        os.environ.update(s3.env_vars())
        store = f"s3://{s3.make_bucket('soak')}/run"
    try:
        return run_soak(store, workdir, args.minutes, args.cycles, args.seed, workload, config,
                        args.model_slow_ms, s3)[0]
    finally:
        if s3 is not None:
            s3.cleanup()


if __name__ == "__main__":
    sys.exit(main())
