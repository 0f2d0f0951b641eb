"""One training job: Ray, TransferQueue, the reference Gym servers, the NemoGym actor and the Single
Controller, started fresh; restore from the store if it holds a snapshot, then run to the end.

``python -m devtools.job --store DIR_OR_S3_URL --workdir DIR`` is what the demo starts, kills
and starts again, as an operator would restart a crashed job. Every process it starts (Ray's, the
Gym servers) is its descendant, so killing its process group kills the whole job. Progress lines go
to stdout every ``--progress-s``; the driver appends each finished save's report to
``<workdir>/saves.jsonl`` and, at the end, writes the outcome (the run's report and the data
plane's final rows) to ``--outcome``.

With ``--address`` the job does not start Ray: it attaches to a running cluster (``ray start``;
:mod:`devtools.cluster` starts one on this machine), starts TransferQueue on the node carrying the
``tq`` resource of ``--placement`` (``coordinator.ray_runtime.attach``) and pins the Single Controller
and the NemoGym actor to the nodes carrying theirs; ``--gym-hosts`` binds each Gym server to its own
address (127.0.0.2, ... stand for other hosts). It writes where each part runs to
``<workdir>/placement.json`` and, if a node it placed a part on dies, stops at once with exit code
:data:`NODE_LOST` (the operator restarts the node and the job, which restores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pyarrow as pa

from coordinator import controller as controller_mod
from coordinator import gym_actor, ray_runtime
from coordinator.config import ControllerConfig
from coordinator.faults import CrashPlan
from coordinator.workload import Workload

log = logging.getLogger("devtools.job")

NODE_LOST = 3  # exit code: a node holding a part of the job died


def _placement(runtime: ray_runtime.RayRuntime, ctl: object, actor: object) -> dict:
    """Where each part of the job runs: node ids (with each node's name and resources), and pids."""
    import ray

    actors = {"controller": ray_runtime.node_of(ctl), "gym": ray_runtime.node_of(actor), **runtime.placement}
    nodes = {n["NodeID"]: {"name": n.get("NodeName", ""), "alive": n["Alive"],
                           "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}}
             for n in ray.nodes() if n["NodeID"] in actors.values()}
    return {"actors": actors, "nodes": nodes}


def _pid(_actor: object = None) -> int:
    return os.getpid()


def _lost_nodes(placement: dict) -> list[str]:
    """The parts whose node Ray reports dead."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return [f"{part} (node {node[:12]}, {placement['nodes'][node]['name'] or 'unnamed'})"
            for part, node in placement["actors"].items() if node not in alive]


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
    ap.add_argument("--address", default=None, help="attach to the Ray cluster whose GCS is at host:port "
                    "instead of starting Ray")
    ap.add_argument("--placement", default="{}", help='with --address: custom resources that pin the parts, as '
                    'JSON {"controller": R1, "gym": R2, "tq": R3} (each optional)')
    ap.add_argument("--gym-hosts", default="{}", help='the address each Gym server listens on, as JSON '
                    '{"model": "127.0.0.2", "agent": ..., "resource": ..., "sandbox": ...} (default 127.0.0.1)')
    ap.add_argument("--staging-dir", default=None, help="where the Single Controller stages Gym's files for a "
                    "store on S3 (Gym servers write there: on several machines, a shared file system)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    for noisy in ("httpx", "httpcore", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = msgspec.json.decode(args.config, type=ControllerConfig)
    workload = msgspec.json.decode(args.workload, type=Workload)
    plan = msgspec.json.decode(args.crash_plan, type=CrashPlan) if args.crash_plan else None
    placement = json.loads(args.placement)
    unknown = set(placement) - {"controller", "gym", "tq"}
    if unknown or (placement and not args.address):
        ap.error(f"--placement: unknown parts {sorted(unknown)}" if unknown else "--placement needs --address")
    hosts = json.loads(args.gym_hosts)
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "job.pid").write_text(str(os.getpid()))

    ray_runtime.configure()  # an entry point: Ray on 127.0.0.1, single-user (before ray is imported)
    import ray

    from devtools.gym_fleet import new_fleet

    fleet = new_fleet(args.workdir / f"gym-{os.getpid()}")
    runtime = None
    where = None
    try:
        # The Gym servers start while Ray and TransferQueue do (each side waits on its own processes).
        with ThreadPoolExecutor(1, thread_name_prefix="gym-start") as pool:
            starting = pool.submit(fleet.gym, model_slow_ms=args.model_slow_ms,
                                   resource_slow_ms=args.resource_slow_ms, hosts=hosts)
            if args.address:
                # Loopback unless the caller chose otherwise (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: separate machines).
                runtime = ray_runtime.attach(args.address, tq_resource=placement.get("tq"), log_to_driver=False,
                                             tq=args.data_plane == "tq",
                                             loopback=os.environ.get(ray_runtime.LOOPBACK_ENV) == "0")
            else:
                runtime = ray_runtime.start(num_cpus=2, object_store_memory=256 << 20, log_to_driver=False)
            log.info("Ray and TransferQueue up (%s)", ", ".join(f"{k} {v:.1f}s" for k, v in runtime.seconds.items()))
            gym = starting.result()
        servers = gym.servers
        pids = {"model": servers.model.pid, "agent": servers.agent.pid, "resource": servers.resource.pid,
                "sandbox": servers.sandbox.pid}
        (args.workdir / "gym.pids.json").write_text(json.dumps(pids))
        log.info("Gym servers up: %s", ", ".join(p.url for p in servers.all))
        (args.workdir / "gym.urls.json").write_text(json.dumps(
            {role: getattr(servers, role).url for role in pids}))
        pin = {part: {"resources": {resource: 0.01}} for part, resource in placement.items()}
        actor = gym_actor.remote({p.name: p.url for p in servers.all}, fleet.token, **pin.get("gym", {}))
        ctl = controller_mod.remote(config, args.store, actor, workload, data_plane=args.data_plane,
                                    crash_plan=plan, options=pin.get("controller"), staging_dir=args.staging_dir)
        ctl_pid = ray.get(ctl.status.remote())["pid"]
        (args.workdir / "controller.pid").write_text(str(ctl_pid))
        if args.address:
            where = _placement(runtime, ctl, actor)
            where["pids"] = {"controller": ctl_pid, "gym": ray.get(actor.__ray_call__.remote(_pid))}
            (args.workdir / "placement.json").write_text(json.dumps(where, indent=1))
        log.info("the NemoGym actor and the Single Controller are up")
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
                lost = _lost_nodes(where) if where is not None else []
                if lost:
                    print(f"job: lost {', '.join(lost)}; stopping (restart the node, then the job: it restores)",
                          flush=True)
                    return NODE_LOST
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
        if runtime is not None:
            runtime.close()


if __name__ == "__main__":
    sys.exit(main())
