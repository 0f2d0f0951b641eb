"""One training job: Ray, TransferQueue, the reference Gym servers, the NemoGym actor and the Single
Controller, started fresh; restore from the store if it holds a snapshot, then run to the end.

``python -m devtools.job --store DIR_OR_S3_URL --workdir DIR`` is what the demo starts, kills
and starts again, as an operator would restart a crashed job. Every process it starts (Ray's, the
Gym servers) is its descendant, so killing its process group kills the whole job. Progress lines go
to stdout every ``--progress-s``; the driver appends each finished save's report to
``<workdir>/saves.jsonl`` and, at the end, writes the outcome (the run's report and the data
plane's final rows) to ``--outcome``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import msgspec
import pyarrow as pa

from coordinator import controller as controller_mod
from coordinator import gym_actor, ray_runtime
from coordinator.config import ControllerConfig
from coordinator.faults import CrashPlan
from coordinator.workload import Workload

log = logging.getLogger("devtools.job")


def _arrow_to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="snapshot store: a folder or s3://bucket/prefix")
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--config", default="{}", help="ControllerConfig fields as JSON")
    ap.add_argument("--workload", default="{}", help="Workload fields as JSON")
    ap.add_argument("--model-slow-ms", type=int, default=0)
    ap.add_argument("--resource-slow-ms", type=int, default=0)
    ap.add_argument("--crash-plan", default=None, help="CrashPlan as JSON (tests and the demo)")
    ap.add_argument("--outcome", type=Path, default=None)
    ap.add_argument("--progress-s", type=float, default=2.0)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--data-plane", choices=("tq", "memory"), default="tq")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    for noisy in ("httpx", "httpcore", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = msgspec.json.decode(args.config, type=ControllerConfig)
    workload = msgspec.json.decode(args.workload, type=Workload)
    plan = msgspec.json.decode(args.crash_plan, type=CrashPlan) if args.crash_plan else None
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "job.pid").write_text(str(os.getpid()))

    ray_runtime.configure()  # an entry point: Ray on 127.0.0.1, single-user (before ray is imported)
    import ray

    from devtools.gym_fleet import new_fleet

    runtime = ray_runtime.start(num_cpus=2, object_store_memory=256 << 20, log_to_driver=False)
    fleet = new_fleet(args.workdir / f"gym-{os.getpid()}")
    try:
        gym = fleet.gym(model_slow_ms=args.model_slow_ms, resource_slow_ms=args.resource_slow_ms)
        servers = gym.servers
        pids = {"model": servers.model.pid, "agent": servers.agent.pid, "resource": servers.resource.pid,
                "sandbox": servers.sandbox.pid}
        (args.workdir / "gym.pids.json").write_text(json.dumps(pids))
        actor = gym_actor.remote({p.name: p.url for p in servers.all}, fleet.token)
        ctl = controller_mod.remote(config, args.store, actor, workload, data_plane=args.data_plane,
                                    crash_plan=plan)
        (args.workdir / "controller.pid").write_text(str(ray.get(ctl.status.remote())["pid"]))
        restored = ray.get(ctl.setup.remote())
        if restored is None:
            print("job: the store holds no snapshot; starting fresh", flush=True)
        else:
            print(f"job: restored snapshot {restored.sequence} ({len(restored.continued)} rollouts continue, "
                  f"{sum(c.discarded for c in restored.continued)} start over)", flush=True)
        run = ctl.run.remote(args.max_seconds)
        seen = 0
        with open(args.workdir / "saves.jsonl", "ab") as saves_log:
            while True:
                ready, _ = ray.wait([run], timeout=args.progress_s)
                status = ray.get(ctl.status.remote())
                for s in ray.get(ctl.saves_since.remote(seen)):
                    saves_log.write(msgspec.json.encode(s) + b"\n")
                    saves_log.flush()
                    seen += 1
                print(f"job: {status['stored']}/{workload.rollouts} rollouts stored, {status['open']} in flight, "
                      f"{status['train_steps']} training steps, {status['published']} snapshots published",
                      flush=True)
                if ready:
                    break
        outcome = ray.get(run)
        if args.outcome is not None:
            tables = ray.get(ctl.data_plane_tables.remote())
            doc = {"outcome": msgspec.to_builtins(outcome),
                   "records": msgspec.to_builtins(ray.get(ctl.records.remote())),
                   "tables": {k: _arrow_to_ipc(t).hex() for k, t in tables.items()}}
            tmp = args.outcome.with_suffix(".tmp")
            tmp.write_bytes(json.dumps(doc).encode())
            os.replace(tmp, args.outcome)
        print(f"job: done={outcome.done} in {outcome.seconds:.1f}s, {len(outcome.saves)} save attempts", flush=True)
        return 0 if outcome.done else 1
    finally:
        fleet.close()
        runtime.close()


if __name__ == "__main__":
    sys.exit(main())
