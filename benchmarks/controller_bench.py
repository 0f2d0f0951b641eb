"""The pause and restore benchmarks (issue 6): the Single Controller's save pause, step by step,
against the number of in-flight rollouts and against TQ's bytes, in both write modes; and the
restore of the snapshots it published against a raw read of the same files.

    python -m benchmarks.run --section pause --section restore           # full sizes (one measurement run)
    python -m benchmarks.run --quick --section pause --section restore   # small sizes

``pause`` takes the saves (:func:`pause_results`, once per process) and keeps the stores it
published; ``restore`` (:func:`restore_results`) restores those snapshots. When ``restore`` runs
without ``pause`` in the same process, it takes the pause measurements first.

How one point (N rollouts, S bytes of TQ rows) is measured, in this process:

1. TQ (``coordinator.ray_runtime.start``: Ray on 2 CPUs, one SimpleStorage unit, loopback; started
   once) holds S bytes of training rows in partition ``bench`` (ragged ``input_ids`` int32 and
   ``generation_logprobs`` float32 of about :data:`ROW_TOKENS` tokens, ``input_lengths``; tags
   ``rollout_id``, ``attempt_index``), put through the adapter :data:`PUT_BATCH` rows per call; the
   rows only grow from one point to the next (not timed). The filler's adapter is the one each
   point's controller then uses, as if the controller had put the rows itself (in a run it is the
   data plane's only producer), so a save takes them from the adapter's capture, not from TQ.
2. Three fresh reference Gym servers (``devtools.gym_fleet.new_fleet(...).gym(model_slow_ms=50)``), a
   NemoGym actor (``coordinator.gym_actor.remote``) and a :class:`~coordinator.controller.SingleController`
   (a plain object here, data plane ``tq``) on a fresh store folder; ``ctl.setup()`` (discovery;
   the store is empty, so no restore). Its workload is N rollouts of :data:`TURNS` turns; they are
   sent to Gym the way the controller's ``dispatch`` sends them (the ledger marks each dispatched)
   and run until every one has finished its first turn (not timed): each model call takes 50 ms
   and the agent keeps 16 calls open, so all N are mid-flight.
3. ``ctl.save_now(wait=True)`` with ``in_pause`` writing, then (same controller, same rollouts, a
   fresh store folder) with ``background`` writing: the first save's pause keeps the rollouts
   parked while it writes, so the second finds the same rollouts in flight. Each returns the
   :class:`~coordinator.checkpoint.SaveReport`: ``pause_s`` and ``steps_s`` (flush_acks, prepare,
   gym_commit, cut, resume, write, publish), as the controller records them.
4. Restore: every Gym server is SIGKILLed, TQ is cleared; three fresh servers, a new NemoGym actor
   and a new controller (same workload) on the background save's store; discovery, then
   ``ctl.restore()`` (its Checkpointer's restore) is timed (its report has load_data_plane, gym_restore,
   discard, resume). Every file of that snapshot is read once before (untimed: page cache warm), and
   after the restore with plain ``open().readinto``, warm and then evicted from the page cache.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks import common
from benchmarks.common import GIB, MIB, Log
from benchmarks.memory_bench import Sampler

MODEL_SLOW_MS = 50
TURNS = 64
ROW_TOKENS = 4096  # ragged rows of ~32 KiB of values
PUT_BATCH = 64
PARTITION = "bench"
MODES = ("background", "in_pause")
STEPS = ("flush_acks", "prepare", "gym_commit", "cut", "cut_wait", "resume", "write", "publish")
RESTORE_STEPS = ("load_data_plane", "gym_restore", "discard", "resume")
TIMEOUT_S = 900.0
WAIT_S = 600.0
START_CHUNK = 500  # rollouts per start_rollouts call (a progress line between calls)
RAW_READS = 3

FULL = {"rollouts": (10, 100, 1000, 10_000), "fixed_bytes": 10 * MIB, "bytes": (10 * MIB, 100 * MIB, GIB, 2 * GIB),
        "fixed_rollouts": 100, "target": (1000, GIB)}
QUICK = {"rollouts": (10, 100), "fixed_bytes": 10 * MIB, "bytes": (10 * MIB, 100 * MIB), "fixed_rollouts": 10,
         "target": (100, 100 * MIB)}
SMALLEST = {"rollouts": (4,), "fixed_bytes": MIB, "bytes": (MIB,), "fixed_rollouts": 4, "target": None}

TARGET_PAUSE_SHARE = 0.10  # background pause / in_pause pause, at the largest bytes
TARGET_RESTORE_RATIO = 2.0  # restore / raw read at the target point
SLOPE_FLAT = 0.2  # log-log slope of the background pause against bytes below which it does not "grow"

# --------------------------------------------------------------------------------------------
# TQ rows


class Filler:
    """Grows TQ's ``bench`` partition to a number of bytes of values (never shrinks it)."""

    def __init__(self) -> None:
        from coordinator.controller import make_data_plane

        # The controller's own kind of adapter: each point's controller takes it over (see save_point),
        # so the rows are ones the controller put, as in a run (it is the data plane's only producer).
        self.plane = make_data_plane("tq", TIMEOUT_S)
        self.rng = np.random.default_rng(2026)
        self.raw = 0
        self.rows = 0
        self.put_s = 0.0

    def grow_to(self, target: int, log: Log) -> None:
        if self.raw >= target:
            return
        t0 = time.perf_counter()
        last = t0
        while self.raw < target:
            need = -(-(target - self.raw) // (ROW_TOKENS * 8 + 4))  # rows of average size still missing
            b = common.row_batch(self.rng, self.rows, max(1, min(PUT_BATCH, need)), "ragged", ROW_TOKENS, prefix="b")
            self.plane.put(PARTITION, b.keys, b.fields, b.tags)
            self.raw += b.raw_bytes
            self.rows += len(b.keys)
            if time.perf_counter() - last > 15:
                last = time.perf_counter()
                log(f"pause: filling TQ: {self.raw / MIB:,.0f} of {target / MIB:,.0f} MiB")
        dt = time.perf_counter() - t0
        self.put_s += dt
        log(f"pause: TQ holds {self.rows:,} rows, {self.raw / MIB:,.1f} MiB of values (grown in {dt:.1f} s, "
            f"{self.raw / MIB / max(self.put_s, 1e-9):.0f} MiB/s through kv_batch_put; not timed)")


# --------------------------------------------------------------------------------------------
# One controller with N rollouts in flight


def _workload(n: int):
    from coordinator.workload import Workload

    size = 2 if n % 2 == 0 else 1
    return Workload(prompts=n // size, group_size=size, min_turns=TURNS, max_turns=TURNS, seed=606,
                    sandbox_every=0)


def _config(mode: str, n: int):
    from coordinator.config import ControllerConfig, GymRolloutCheckpointing, RolloutCheckpointing

    # The benchmark saves by calling save_now; the interval only has to be set (NeMo-RL's rule for Gym's share).
    return ControllerConfig(
        rollout_checkpointing=RolloutCheckpointing(
            snapshot_attempt_interval_s=3600.0, keep_latest_k=2,
            gym=GymRolloutCheckpointing(capability_discovery_enabled=True, participant_checkpointing_enabled=True,
                                        prepare_timeout_s=TIMEOUT_S)),
        write_mode=mode, commit_timeout_s=TIMEOUT_S, restore_timeout_s=TIMEOUT_S, max_in_flight=max(n, 1))


class Job:
    """Fresh Gym servers, a NemoGym actor and a SingleController in this process."""

    def __init__(self, fleet, store_root: Path, n: int, mode: str, plane: Any = "tq") -> None:
        from coordinator import gym_actor
        from coordinator.controller import SingleController

        self.gym = fleet.gym(model_slow_ms=MODEL_SLOW_MS)
        self.actor = gym_actor.remote({p.name: p.url for p in self.gym.servers.all}, fleet.token)
        self.ctl = SingleController(_config(mode, n), str(store_root), self.actor, _workload(n), data_plane=plane)

    def dispatch(self, n: int, log: Log) -> tuple[float, float]:
        """Send every rollout of the workload as the controller's ``dispatch`` would (the ledger marks
        each group dispatched), then wait until each has finished its first turn."""
        ctl = self.ctl
        t0 = time.perf_counter()
        specs = []
        while group := ctl.books.reserve_next():
            ctl.books.dispatched([s.rollout_id for s in group])
            specs += group
        if len(specs) != n:
            raise RuntimeError(f"the workload has {len(specs)} rollouts, expected {n}")
        accepted = 0
        for s in range(0, n, START_CHUNK):
            answer = ctl.gym.start_rollouts([msgspec.to_builtins(x) for x in specs[s:s + START_CHUNK]])
            if answer["paused"]:
                raise RuntimeError(f"Gym refused {len(answer['paused'])} rollouts (paused)")
            accepted += len(answer["accepted"])
            if n >= 2000:
                log(f"pause: N={n:,}: {accepted:,} rollouts sent ({time.perf_counter() - t0:.0f} s)")
        sent = time.perf_counter() - t0

        def progress() -> bool:
            rows = self.gym.agent.get("/rollouts")
            done = [r for r in rows if r["outcome"] != "running"]
            if done:
                raise RuntimeError(f"{len(done)} rollouts ended before the snapshot (first: {done[0]})")
            return len(rows) == n and all(r["turns_done"] >= 1 for r in rows)

        from devtools.gym_fleet import wait_until

        # listing 10,000 rollouts takes the agent ~1 s: poll less often the more there are
        wait_until(progress, f"every one of {n} rollouts to finish its first turn", WAIT_S, every=max(0.25, n / 2000))
        total = time.perf_counter() - t0
        if n >= 100:
            log(f"pause: N={n:,}: rollouts sent in {sent:.1f} s, all past their first turn after {total:.1f} s "
                "(not timed)")
        return sent, total

    def kill(self) -> None:
        import ray

        for p in self.gym.servers.all:
            p.kill()
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass


def _parked(store_root: Path) -> tuple[int | None, dict[str, Any]]:
    from snapformat import SnapshotStore

    snap = SnapshotStore(str(store_root)).latest()
    if snap is None or snap.manifest.gym_commit is None:
        return None, {}
    payloads = {p.component: dict(p.payload or {}) for p in snap.manifest.gym_commit.participants}
    return payloads.get("responses_api_agents", {}).get("records"), {
        "snapshot_id": snap.manifest.snapshot_id, "sequence": snap.sequence,
        "bytes": snap.manifest.total_bytes,
        "tq_bytes": sum(f.size for f in snap.manifest.files if f.path.startswith("tq/")),
        "gym_bytes": sum(f.size for f in snap.manifest.files if f.path.startswith("gym/"))
        + sum(p.bytes for p in snap.manifest.listed_parts)}


def save_point(fleet, work: Path, n: int, target: int, modes: tuple[str, ...], filler: Filler,
               log: Log) -> dict[str, Any]:
    """Both saves of one point (same controller and rollouts, a fresh store each). ``in_pause``
    goes first: its pause keeps the rollouts parked while it writes, so the ``background`` save
    right after it finds the same rollouts in flight (after a background save they would run on
    during its write, and short ones would finish before the next save)."""
    tag = f"n{n}-b{target >> 20}m"
    stores = {m: work / f"store-{tag}-{m}" for m in modes}
    first = sorted(modes, key=lambda m: m != "in_pause")
    t0 = time.perf_counter()
    # the rows in TQ are the controller's own: its adapter put (and kept) them
    job = Job(fleet, stores[first[0]], n, first[0], plane=filler.plane)
    probe = common.MethodTimer(job.ctl.plane, ("_read_partition", "_make_cut"))  # the write's TQ reads
    saves: dict[str, Any] = {}
    try:
        job.ctl.setup()
        if job.ctl.restored is not None:
            raise RuntimeError("a fresh store must not restore anything")
        setup_s = time.perf_counter() - t0
        send_s, wait_s = job.dispatch(n, log)
        for i, mode in enumerate(first):
            from coordinator.checkpoint import Checkpointer
            from snapformat import SnapshotStore

            if i:  # the next save: same controller and rollouts, another write mode, a fresh store folder
                seams = job.ctl.checkpointer.seams
                job.ctl.checkpointer = Checkpointer(dataclasses.replace(
                    seams, config=msgspec.structs.replace(seams.config, write_mode=mode),
                    store=SnapshotStore(str(stores[mode]))))
            probe.take()
            with Sampler() as mem:  # the whole save, its background write included (wait=True)
                before = mem.now()
                report = job.ctl.save_now(wait=True)
            inside = probe.take()
            if not report.published or report.error:
                raise RuntimeError(f"save ({mode}, N={n}, {target >> 20} MiB) failed: {report.error}")
            parked, snap = _parked(stores[mode])
            s = {"mode": mode, "report_mode": report.mode, "pause_s": report.pause_s,
                 "steps_s": dict(report.steps_s), "cut_bytes": report.cut_bytes, "rows": dict(report.rows),
                 "parked": parked, "snapshot": snap, "store": str(stores[mode]), "order": i,
                 "write_tq_reads_s": round(inside.get("_read_partition", 0.0), 6),
                 "write_arrow_build_s": round(inside.get("_make_cut", 0.0), 6),
                 "anon_before": before["RssAnon"], "peak_anon_above": mem.peak["RssAnon"] - before["RssAnon"],
                 "capture_bytes": job.ctl.plane.capture.nbytes if job.ctl.plane.capture is not None else 0}
            saves[mode] = s
            st = report.steps_s
            log(f"pause: N={n:,}, TQ {common.size_label(target)}, {mode}: pause {common.ms(report.pause_s)} ms "
                f"(prepare {common.ms(st.get('prepare'))}, commit {common.ms(st.get('gym_commit'))}, cut "
                f"{common.ms(st.get('cut'))} (wait {common.ms(st.get('cut_wait'))}), write {common.ms(st.get('write'))}, publish "
                f"{common.ms(st.get('publish'))}); parked {parked}; snapshot {snap.get('bytes', 0) / MIB:,.1f} MiB")
    finally:
        probe.close()
        job.kill()
    for mode, root in stores.items():  # only the background snapshot is restored later
        if mode != "background" and "background" in stores:
            shutil.rmtree(root, ignore_errors=True)
    return {"n": n, "bytes_target": target, "tq_raw_bytes": filler.raw, "tq_rows": filler.rows,
            "setup_s": round(setup_s, 3), "send_s": round(send_s, 3), "dispatch_wait_s": round(wait_s, 3),
            "saves": saves,
            "workload": msgspec.to_builtins(job.ctl.workload)}


def restore_point(fleet, point: dict[str, Any], log: Log) -> dict[str, Any]:
    """Restore the background save of ``point`` on fresh servers, an empty TQ and a new controller."""
    from coordinator.dataplane.tq.adapter import TQDataPlane

    save = point["saves"].get("background") or next(iter(point["saves"].values()))
    store_root = Path(save["store"])
    n = point["n"]
    TQDataPlane().clear()  # an empty TQ (not timed)
    job = Job(fleet, store_root, n, save["mode"])
    files = common.snapshot_files(store_root, save["snapshot"]["snapshot_id"], save["snapshot"]["sequence"])
    common.raw_read(files)  # untimed: the snapshot in the page cache, as for the raw read below
    from coordinator.dataplane import plane as data_plane

    parse = data_plane.parse_table
    parses: list[float] = []

    def timed_parse(table, where):  # DataPlane.load looks parse_table up in its module at each call
        t = time.perf_counter()
        try:
            return parse(table, where)
        finally:
            parses.append(time.perf_counter() - t)

    data_plane.parse_table = timed_parse
    try:
        job.ctl.discover()
        t0 = time.perf_counter()
        rep = job.ctl.restore()
        total = time.perf_counter() - t0
        progress = job.ctl.plane.wait_loaded()  # the background load putting the rows into TQ itself
        loaded = time.perf_counter() - t0
    finally:
        data_plane.parse_table = parse
        job.kill()
    if rep is None:
        raise RuntimeError(f"{store_root}: nothing to restore")
    checks = {"continued": len(rep.continued), "parked": save["parked"], "rows": dict(rep.rows),
              "saved_rows": save["rows"], "skipped": list(rep.skipped)}
    def nonzero(rows):  # a kind with no row: a whole file of none, or no segment at all
        return {k: v for k, v in dict(rows).items() if v}

    if rep.skipped or len(rep.continued) != save["parked"] or nonzero(rep.rows) != nonzero(save["rows"]):
        raise RuntimeError(f"restore of {store_root} does not match its save: {checks}")
    reads = [common.raw_read(files) for _ in range(RAW_READS)]
    raw_s = statistics.median(t for t, _ in reads)
    raw_bytes = reads[0][1]
    cold = []
    for _ in range(RAW_READS):
        common.evict(files)
        cold.append(common.raw_read(files)[0])
    cold_s = statistics.median(cold)
    out = {"n": n, "bytes_target": point["bytes_target"], "restore_s": round(total, 6),
           "steps_s": dict(rep.steps_s), "tq_loaded_s": round(loaded, 6),
           "tq_registered_s": round(progress.registered_s, 6) if progress else None, "parse_s": round(sum(parses), 6),
           "raw_read_s": round(raw_s, 6),
           "raw_read_times_s": [round(t, 6) for t, _ in reads], "raw_read_cold_s": round(cold_s, 6),
           "raw_read_cold_times_s": [round(t, 6) for t in cold], "files": len(files), "file_bytes": raw_bytes,
           "ratio": round(total / raw_s, 3) if raw_s > 0 else None,
           "ratio_until_tq_loaded": round(loaded / raw_s, 3) if raw_s > 0 else None,
           "ratio_cold": round(total / cold_s, 3) if cold_s > 0 else None,
           "checks": checks, "mode": save["mode"]}
    log(f"restore: N={n:,}, TQ {common.size_label(point['bytes_target'])}: restore {common.ms(total)} ms "
        f"(load data plane {common.ms(rep.steps_s.get('load_data_plane'))}, of which parse_table "
        f"{common.ms(sum(parses))}; Gym {common.ms(rep.steps_s.get('gym_restore'))}; TQ holds every row after "
        f"{common.ms(loaded)}); raw read of "
        f"{raw_bytes / MIB:,.1f} MiB {common.ms(raw_s)} ms warm ({out['ratio']}x), {common.ms(cold_s)} ms evicted "
        f"({out['ratio_cold']}x); {len(rep.continued)} continued")
    return out


# --------------------------------------------------------------------------------------------
# The run


def plan(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The points to measure, in an order where TQ's bytes only grow: (n, bytes, axes, modes)."""
    pts: dict[tuple[int, int], set[str]] = {}
    for n in config["rollouts"]:
        pts.setdefault((n, config["fixed_bytes"]), set()).add("rollouts")
    for b in config["bytes"]:
        pts.setdefault((config["fixed_rollouts"], b), set()).add("bytes")
    if config.get("target"):
        pts.setdefault(tuple(config["target"]), set()).add("target")
    out = []
    for (n, b), axes in sorted(pts.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        modes = MODES if axes & {"rollouts", "bytes"} else ("background",)
        out.append({"n": n, "bytes": b, "axes": sorted(axes), "modes": modes})
    return out


class Bench:
    """What lives from the saves to the restores: Ray + TQ, the fork server and fleet, the work
    folder (the published stores), the TQ filler."""

    def __init__(self, scratch: Path, log: Log) -> None:
        from devtools.gym_fleet import new_fleet
        from devtools.gym_forkserver import ForkServer
        from devtools.gym_procs import REPO_ROOT

        common.tq_runtime(log)
        from coordinator.dataplane.tq.adapter import TQDataPlane

        TQDataPlane().clear()
        self.work, self._cleanup = common.work_folder(scratch, "pause")
        t0 = time.perf_counter()
        self.forkserver = ForkServer(REPO_ROOT)
        log(f"pause: fork server ready in {time.perf_counter() - t0:.1f} s (not timed); work folder {self.work}")
        self.fleet = new_fleet(self.work / "fleet", self.forkserver)
        self.filler = Filler()
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        from coordinator.dataplane.tq.adapter import TQDataPlane

        try:
            self.fleet.close()
            self.forkserver.close()
            TQDataPlane().clear()
        finally:
            self._cleanup()


def run_saves(bench: Bench, config: dict[str, Any], quick: bool, log: Log) -> dict[str, Any]:
    """Both saves of every point of ``config`` (the pause section's measurements)."""
    started = time.perf_counter()
    load_start = common.load_average()
    points = []
    todo = plan(config)
    for i, p in enumerate(todo):
        bench.filler.grow_to(p["bytes"], log)
        point = save_point(bench.fleet, bench.work, p["n"], p["bytes"], p["modes"], filler=bench.filler, log=log)
        point["axes"] = p["axes"]
        points.append(point)
        log(f"pause: point {i + 1}/{len(todo)} done ({time.perf_counter() - started:.0f} s so far)")
    return {
        "quick": quick, "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "model_slow_ms": MODEL_SLOW_MS, "turns": TURNS, "row_tokens": ROW_TOKENS, "put_batch": PUT_BATCH,
        "points": points, "fill_rate_mib_s": round(bench.filler.raw / MIB / max(bench.filler.put_s, 1e-9), 1),
        "load_average": {"start": load_start, "end": common.load_average()},
        "elapsed_s": round(time.perf_counter() - started, 1),
        "targets": {"pause_share": TARGET_PAUSE_SHARE, "restore_ratio": TARGET_RESTORE_RATIO},
    }


def run_restores(bench: Bench, result: dict[str, Any], log: Log) -> dict[str, Any]:
    """Restore every point's background snapshot (adds ``restore`` to each point)."""
    started = time.perf_counter()
    load_start = common.load_average()
    for i, point in enumerate(result["points"]):
        point["restore"] = restore_point(bench.fleet, point, log)
        log(f"restore: point {i + 1}/{len(result['points'])} done ({time.perf_counter() - started:.0f} s so far)")
    result["restore_elapsed_s"] = round(time.perf_counter() - started, 1)
    result["restore_load_average"] = {"start": load_start, "end": common.load_average()}
    return result


def run(config: dict[str, Any], quick: bool, scratch: Path, log: Log) -> dict[str, Any]:
    """Saves then restores of every point of ``config`` (what both sections report), cleaned up after."""
    bench = Bench(scratch, log)
    try:
        return run_restores(bench, run_saves(bench, config, quick, log), log)
    finally:
        bench.close()


_STATE: dict[bool, dict[str, Any]] = {}


def pause_results(quick: bool, scratch: Path, log: Log) -> dict[str, Any]:
    """The pause section's measurements, taken once per process; their stores are kept (until the
    restore section or the end of the run) for the restore section."""
    state = _STATE.get(quick)
    if state is None:
        bench = Bench(scratch, log)
        common.on_close(bench.close)
        try:
            result = run_saves(bench, QUICK if quick else FULL, quick, log)
        except BaseException:
            bench.close()
            raise
        state = _STATE[quick] = {"bench": bench, "result": result}
    return state["result"]


def restore_results(quick: bool, scratch: Path, log: Log) -> dict[str, Any]:
    """Restores of the snapshots :func:`pause_results` published in this process (taking those first
    when the pause section did not run)."""
    if quick not in _STATE:
        log("restore: the pause section did not run in this process: taking its measurements first")
    result = pause_results(quick, scratch, log)
    state = _STATE[quick]
    if "restored" not in state:
        try:
            state["restored"] = run_restores(state["bench"], result, log)
        finally:
            state["bench"].close()
    return state["restored"]


# --------------------------------------------------------------------------------------------
# Reports


def _axis(result: dict[str, Any], axis: str) -> list[dict[str, Any]]:
    pts = [p for p in result["points"] if axis in p["axes"]]
    return sorted(pts, key=lambda p: p["n"] if axis == "rollouts" else p["bytes_target"])


def _step(s: dict[str, Any], name: str) -> str:
    v = s["steps_s"].get(name)
    if v is None:
        return "-"
    after = s["mode"] == "background" and name in ("write", "publish") and not s["report_mode"].startswith("in_pause")
    return f"({common.ms(v)})" if after else common.ms(v)


def _pause_table(points: list[dict[str, Any]], first_col: str) -> list[str]:
    lines = [f"| {first_col} | mode | **pause** | flush ACKs | prepare | Gym commit | cut | cut wait | write | "
             "of which TQ reads (`kv_batch_get`) | publish | resume | parked | TQ rows in the cut | snapshot | "
             "rows the adapter keeps | peak memory above the save's start |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        key = f"{p['n']:,}" if first_col == "rollouts" else common.size_label(p["bytes_target"])
        for mode in MODES:
            s = p["saves"].get(mode)
            if s is None:
                continue
            rows = sum(s["rows"].values())
            reads = common.ms(s.get("write_tq_reads_s"))
            if s["mode"] == "background" and not s["report_mode"].startswith("in_pause"):
                reads = f"({reads})"
            lines.append(f"| {key} | {s['report_mode']} | **{common.ms(s['pause_s'])}** | "
                         + " | ".join(_step(s, k) for k in ("flush_acks", "prepare", "gym_commit", "cut", "cut_wait", "write"))
                         + f" | {reads} | "
                         + " | ".join(_step(s, k) for k in ("publish", "resume"))
                         + f" | {s['parked']} | {rows:,} | {s['snapshot']['bytes'] / MIB:,.1f} MiB | "
                         f"{s.get('capture_bytes', 0) / MIB:,.0f} MiB | {s.get('peak_anon_above', 0) / MIB:,.0f} MiB |")
    return lines


_TEN_THOUSAND = (
    "**10,000 rollouts: not measured** (it does not fit the section's ~10-minute bound). At 1,000 rollouts the "
    "controller took {send:.0f} s to send them and {wait:.0f} s until each had finished its first turn, and "
    "prepare (parking) took {prepare:.1f} s per save; scaled linearly, one 10,000-rollout point would take about "
    "{minutes:.0f} minutes (sending them and their first turns about {wait10:.0f} s, then two saves with about "
    "{prepare10:.0f} s of parking each), and its pause would be about {pause10:.0f} s, nearly all of it parking.")


def _ten_thousand_estimate(r: dict[str, Any]) -> dict[str, float]:
    p = max((p for p in r["points"] if "rollouts" in p["axes"]), key=lambda p: p["n"])
    k = 10_000 / p["n"]
    prep = statistics.mean(s["steps_s"]["prepare"] for s in p["saves"].values())
    pause = statistics.mean(s["pause_s"] for s in p["saves"].values())
    send = p.get("send_s", p["dispatch_wait_s"])
    wait = p["dispatch_wait_s"]
    return {"send": send, "wait": wait, "prepare": prep, "send10": send * k, "wait10": wait * k,
            "prepare10": prep * k, "pause10": pause * k,
            "minutes": (wait * k + 2 * pause * k + 60) / 60}


def pause_summary(result: dict[str, Any]) -> list[str]:
    out = []
    by_bytes = _axis(result, "bytes")
    if by_bytes:
        big = by_bytes[-1]
        bg, ip = big["saves"].get("background"), big["saves"].get("in_pause")
        if bg and ip:
            share = bg["pause_s"] / ip["pause_s"]
            out.append(f"At {common.size_label(big['bytes_target'])} of TQ rows ({big['n']:,} rollouts) the background "
                       f"pause is {common.ms(bg['pause_s'])} ms against {common.ms(ip['pause_s'])} ms in the pause: "
                       f"{share:.1%} ({'meets' if share <= TARGET_PAUSE_SHARE else 'MISSES'} the <= "
                       f"{TARGET_PAUSE_SHARE:.0%} target).")
            w_bg, w_ip = bg["steps_s"].get("write"), ip["steps_s"].get("write")
            if w_bg and w_ip:
                reads = bg.get("write_tq_reads_s") or 0.0
                out.append(f"The price is paid after the resume: the background write of the same snapshot took "
                           f"{common.secs(w_bg)} s against {common.secs(w_ip)} s inside the pause (x{w_bg / w_ip:.1f}: "
                           f"the rollouts run again on the same 2 cores while it writes), {reads / w_bg:.0%} of it "
                           "reading values back out of TQ with `kv_batch_get` (only for keys the controller's "
                           "adapter did not put itself, none here: it keeps what it puts).")
    by_n = _axis(result, "rollouts")
    if len(by_n) > 1 and len(by_bytes) > 1:
        g_n = by_n[-1]["saves"]["background"]["pause_s"] / by_n[0]["saves"]["background"]["pause_s"]
        g_b = by_bytes[-1]["saves"]["background"]["pause_s"] / by_bytes[0]["saves"]["background"]["pause_s"]
        gi_b = by_bytes[-1]["saves"]["in_pause"]["pause_s"] / by_bytes[0]["saves"]["in_pause"]["pause_s"]
        k_n = math.log(g_n) / math.log(by_n[-1]["n"] / by_n[0]["n"])
        k_b = math.log(g_b) / math.log(by_bytes[-1]["tq_raw_bytes"] / by_bytes[0]["tq_raw_bytes"])
        grows = k_b < SLOPE_FLAT and k_n > 2 * k_b
        cut = [by_bytes[i]["saves"]["background"]["steps_s"]["cut"] for i in (0, -1)]
        keys = [by_bytes[i]["tq_rows"] for i in (0, -1)]
        out.append(f"Background pause: x{g_n:.1f} from {by_n[0]['n']:,} to {by_n[-1]['n']:,} rollouts (TQ "
                   f"{common.size_label(by_n[0]['bytes_target'])}; log-log slope {k_n:.2f}), x{g_b:.2f} from "
                   f"{common.size_label(by_bytes[0]['bytes_target'])} to {common.size_label(by_bytes[-1]['bytes_target'])}"
                   f" ({by_bytes[0]['n']:,} rollouts; slope {k_b:.2f}); in the pause, x{gi_b:.1f} over the same bytes. "
                   + ("It grows with the rollouts, not the bytes (meets the target; a slope below "
                      f"{SLOPE_FLAT} counts as not growing). " if grows else
                      f"MISSES: the background pause's slope in bytes is {k_b:.2f} (at most {SLOPE_FLAT} wanted). ")
                   + f"What does grow with TQ's size is the cut (TQ's listing of keys and tags): {common.ms(cut[0])} -> "
                   f"{common.ms(cut[1])} ms from {keys[0]:,} to {keys[1]:,} keys.")
    return out


def pause_markdown(result: dict[str, Any], results: Path | None) -> str:
    r = result
    c = r["config"]
    plots = []
    if results is not None:
        plots = [p.name for p in pause_plots(r, results)]
    reps = f"the saves took {r['elapsed_s']:.0f} s{' (quick run)' if r['quick'] else ''}"
    lines = [
        "# Pause benchmark: the Single Controller's save pause against rollouts and bytes",
        "",
        f"The Single Controller runs in the benchmark process (a plain object; data plane TransferQueue on a local "
        f"Ray, 2 CPUs, loopback) with three fresh reference Gym servers (model calls take {r['model_slow_ms']} ms, "
        f"the agent keeps 16 open) behind a NemoGym actor, for every point. N rollouts of {r['turns']} turns are "
        f"dispatched and run until each has finished its first turn; TQ holds the given bytes of ragged training "
        f"rows (~{r['row_tokens']} int32 + float32 tokens a row, put {r['put_batch']} rows per `kv_batch_put`). "
        f"Then `ctl.save_now(wait=True)` once per write mode, `in_pause` first, then `background` (same controller "
        f"and rollouts, a fresh store folder each: the first save keeps the rollouts parked while it writes, so the "
        f"second finds the same rollouts in flight). Times are the controller's own `SaveReport`: `pause_s` "
        f"(prepare start to resume end) and `steps_s`; one save per point and mode. {reps}; load average "
        f"{r['load_average']['start']} at start, {r['load_average']['end']} at the end (the machine is shared: "
        f"read ratios as +-2x).",
        "",
        f"## Against in-flight rollouts (TQ {common.size_label(c['fixed_bytes'])}; ms)",
        "",
        *_pause_table(_axis(r, "rollouts"), "rollouts"),
        "",
        f"## Against TQ bytes ({c['fixed_rollouts']:,} rollouts; ms)",
        "",
        *_pause_table(_axis(r, "bytes"), "TQ rows"),
    ]
    target = [p for p in r["points"] if p["axes"] == ["target"]]
    if target:
        lines += ["", "## The restore section's target point (background save only; ms)", "",
                  *_pause_table(target, "rollouts")]
    if not r["quick"] and max(c["rollouts"], default=0) < 10_000:
        lines += ["", _TEN_THOUSAND.format(**_ten_thousand_estimate(r))]
    lines += [""] + [f"**{s}**  " for s in pause_summary(r)]
    lines += [
        "",
        "Notes:",
        "- **pause** = the controller's `pause_s`: from the save's start (flush of ACKs owed, then Gym's prepare) to "
        "the end of Gym's resume. Columns are `steps_s`: **flush ACKs** (`collect`: finished results stored, "
        "acknowledgements sent), **prepare** (NemoGym: model admission paused, agents park every rollout at a turn "
        "end, resources freeze), **Gym commit** (each server writes its part into the draft), **cut** (TQ's listing "
        "of keys and tags, the plan of which kept rows the cut takes, and the controller's records, in memory; taken "
        "on a thread from the end of the flush, while Gym prepares and commits), **cut wait** (what the cut adds to "
        "the pause: the wait for it after Gym's commit), "
        "**write** (the rows the controller's adapter kept as it put them, built into Arrow, written with checks, "
        "xxh3-128 and fsync; **of which TQ reads**: the adapter's `_read_partition` calls for keys it did not put, "
        "with `kv_batch_get`, timed by wrapping them on the controller's adapter instance), **publish** (manifest, "
        "commit record), **resume**.",
        "- **rows the adapter keeps**: the values the adapter holds for the next save (its capture; held before the "
        "save began, so not in the next column). **peak memory above the save's start**: the benchmark process's "
        "(the controller's) peak `RssAnon` during the save, background write included, above its value when the save "
        "began, sampled every 5 ms: what the save itself allocates (the Arrow tables it builds and writes).",
        "- With `background`, write and publish run after the resume in the writer thread while the rollouts run "
        "again: shown in parentheses, not part of the pause. With `in_pause`, they are inside it. "
        "`save_now(wait=True)` waits for the background write, so every snapshot in the tables was published.",
        "- **parked**: rollouts the agent committed as parked at a turn end (from the published manifest's Gym "
        "commit). **TQ rows in the cut**: rows written to the snapshot's `tq/` part. **snapshot**: every file "
        "of the published snapshot (TQ rows, Gym parts, controller records).",
        "- Not timed: starting Ray and TQ, the servers and the NemoGym actor, filling TQ, sending the rollouts and "
        "waiting for their first turn. TQ's rows only grow from one point to the next (each restore puts them back).",
        f"- Plots: {', '.join(plots) if plots else '(not written)'}.",
    ]
    return "\n".join(lines) + "\n"


def pause_plots(r: dict[str, Any], results: Path) -> list[Path]:
    out = []
    by_n = _axis(r, "rollouts")
    if by_n:
        xs = [p["n"] for p in by_n]
        series = [(f"pause, {m}", xs, [p["saves"].get(m, {}).get("pause_s") for p in by_n], st)
                  for m, st in (("background", "o-"), ("in_pause", "s--"))]
        series.append(("prepare step (background)", xs,
                       [p["saves"]["background"]["steps_s"].get("prepare") for p in by_n], "^:"))
        out.append(common.plot(results / common.png_name("pause_vs_rollouts", r["quick"]),
                               f"Save pause vs in-flight rollouts (TQ {common.size_label(r['config']['fixed_bytes'])})",
                               "in-flight rollouts parked at the snapshot", "seconds", series, xticks=xs,
                               xticklabels=[f"{x:,}" for x in xs]))
    by_b = _axis(r, "bytes")
    if by_b:
        xs = [p["bytes_target"] / MIB for p in by_b]
        series = [(f"pause, {m}", xs, [p["saves"].get(m, {}).get("pause_s") for p in by_b], st)
                  for m, st in (("background", "o-"), ("in_pause", "s--"))]
        series.append(("write + publish after the resume (background)", xs,
                       [sum(p["saves"]["background"]["steps_s"].get(k, 0) for k in ("write", "publish"))
                        for p in by_b], "^:"))
        share = pause_summary(r)
        out.append(common.plot(results / common.png_name("pause_vs_bytes", r["quick"]),
                               f"Save pause vs TQ bytes ({r['config']['fixed_rollouts']:,} rollouts)",
                               "TQ rows (MiB of values)", "seconds", series, xticks=xs,
                               xticklabels=[common.size_label(p["bytes_target"]) for p in by_b],
                               note=share[0] if share else None))
    return out


def restore_summary(r: dict[str, Any]) -> list[str]:
    out = []
    target = r["config"].get("target")
    if target:
        p = next((p for p in r["points"] if p["n"] == target[0] and p["bytes_target"] == target[1]), None)
        if p is not None:
            x = p["restore"]
            out.append(f"Restore of {target[0]:,} rollouts and {common.size_label(target[1])} of TQ rows: "
                       f"{common.secs(x['restore_s'])} s against a raw read of the same {x['file_bytes'] / MIB:,.0f} MiB "
                       f"in {common.secs(x['raw_read_s'])} s: {x['ratio']:.2f}x "
                       f"({'meets' if x['ratio'] <= TARGET_RESTORE_RATIO else 'MISSES'} the <= "
                       f"{TARGET_RESTORE_RATIO:.0f}x target); against a raw read of the files evicted from the "
                       f"page cache ({common.secs(x['raw_read_cold_s'])} s) it is {x['ratio_cold']:.2f}x. TransferQueue "
                       f"itself held every restored value {common.secs(x['tq_loaded_s'])} s after the restore began "
                       f"({x['ratio_until_tq_loaded']:.1f}x the raw read), put in the background by its own "
                       "`kv_batch_put` while rollouts ran.")
    by_b = _axis(r, "bytes")
    if len(by_b) > 1:
        a, b = by_b[0]["restore"], by_b[-1]["restore"]
        out.append(f"From {common.size_label(by_b[0]['bytes_target'])} to {common.size_label(by_b[-1]['bytes_target'])} "
                   f"the restore grows x{b['restore_s'] / a['restore_s']:.1f}, the raw read "
                   f"x{b['raw_read_s'] / a['raw_read_s']:.1f}; at the largest, TQ held every value "
                   f"{common.secs(b['tq_loaded_s'])} s after the restore began (its background `kv_batch_put`).")
    by_n = _axis(r, "rollouts")
    if len(by_n) > 1:
        a, b = by_n[0]["restore"], by_n[-1]["restore"]
        out.append(f"From {by_n[0]['n']:,} to {by_n[-1]['n']:,} rollouts the restore grows "
                   f"x{b['restore_s'] / a['restore_s']:.1f} (Gym restore {common.ms(a['steps_s'].get('gym_restore'))} -> "
                   f"{common.ms(b['steps_s'].get('gym_restore'))} ms).")
    return out


def _restore_table(points: list[dict[str, Any]], first_col: str) -> list[str]:
    lines = [f"| {first_col} | snapshot files | **restore** | load data plane | of which `parse_table` | "
             "Gym restore | "
             "discard | resume | raw read | **restore / raw read** | TQ holds every value (background) | "
             "that / raw read | "
             "raw read, evicted | restore / raw read, evicted | continued |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        x = p["restore"]
        key = (f"{p['n']:,}" if first_col == "rollouts" else common.size_label(p["bytes_target"])
               if first_col == "TQ rows" else f"{p['n']:,} + {common.size_label(p['bytes_target'])}")
        st = x["steps_s"]
        lines.append(f"| {key} | {x['file_bytes'] / MIB:,.1f} MiB ({x['files']}) | **{common.ms(x['restore_s'])}** | "
                     f"{common.ms(st.get('load_data_plane'))} | {common.ms(x.get('parse_s'))} | "
                     f"{common.ms(st.get('gym_restore'))} | {common.ms(st.get('discard'))} | {common.ms(st.get('resume'))} | "
                     f"{common.ms(x['raw_read_s'])} | **{x['ratio']:.2f}x** | {common.ms(x['tq_loaded_s'])} | "
                     f"{x['ratio_until_tq_loaded']:.1f}x | "
                     f"{common.ms(x['raw_read_cold_s'])} | {x['ratio_cold']:.2f}x | {x['checks']['continued']:,} |")
    return lines


def restore_markdown(result: dict[str, Any], results: Path | None) -> str:
    r = result
    c = r["config"]
    plots = [p.name for p in restore_plots(r, results)] if results is not None else []
    lines = [
        "# Restore benchmark: restoring the pause benchmark's snapshots against a raw read of their files",
        "",
        f"Each snapshot the pause benchmark published with `background` writing is restored by "
        f"`ctl.restore()` on a new SingleController (same workload) with three fresh reference "
        f"Gym servers, a new NemoGym actor and an empty TransferQueue (cleared, not timed); the clock covers the "
        f"whole call (newest snapshot found, TQ rows read, checked and kept by the adapter, controller records "
        f"read, Gym restored paused, discards, ACKs re-sent, resume); the adapter puts the rows into TQ itself in "
        f"the background (timed to its end as **TQ holds every value**). The baseline reads every file of the same snapshot (its folder "
        f"and commit record) with plain `open().readinto` into a buffer allocated beforehand, median of "
        f"{RAW_READS}. **Page cache not dropped** for the restore and the main raw read (warm: the snapshot's files are read once, "
        f"untimed, before the restore); a second raw read evicts the files first "
        f"(`posix_fadvise(DONTNEED)` per file; on a virtual disk the host may still cache them). The restores took {r['restore_elapsed_s']:.0f} s"
        f"{' (quick run)' if r['quick'] else ''}; load average {r['restore_load_average']['start']} at start, "
        f"{r['restore_load_average']['end']} at the end. Times in ms.",
        "",
        f"## Against in-flight rollouts (TQ {common.size_label(c['fixed_bytes'])})",
        "",
        *_restore_table(_axis(r, "rollouts"), "rollouts"),
        "",
        f"## Against TQ bytes ({c['fixed_rollouts']:,} rollouts)",
        "",
        *_restore_table(_axis(r, "bytes"), "TQ rows"),
    ]
    target = c.get("target")
    if target:
        pts = [p for p in r["points"] if p["n"] == target[0] and p["bytes_target"] == target[1]]
        lines += ["", f"## Target point: {target[0]:,} rollouts and {common.size_label(target[1])}", "",
                  *_restore_table(pts, "rollouts + TQ rows")]
    lines += [""] + [f"**{s}**  " for s in restore_summary(r)]
    lines += [
        "",
        "Notes:",
        "- **restore** = wall time of `ctl.restore()`; its steps as the controller's `RestoreReport.steps_s`: "
        "**load data plane** (snapshot found and opened, the `tq/` rows read with their checksum verified, parsed, "
        "and handed to the adapter, which keeps them and starts putting them into TQ from a thread; **of which "
        "`parse_table`**: `coordinator.dataplane.codec.parse_table`, the rows turned back into per-partition numpy "
        "arrays, timed by wrapping that function in this process), **Gym restore** (each server loads its part; "
        "paused), **discard**, "
        "**resume**. The rest of the total is finding the snapshot and reading the controller's records. **TQ holds "
        "every value**: from the restore's start until the adapter's background load has registered every key (in "
        "order) and put every value with `kv_batch_put` (`wait_loaded()`); until the keys are registered the "
        "adapter's puts and cuts wait, and a save meanwhile takes the rows from the adapter, not from TQ.",
        f"- TransferQueue's `kv_batch_put` moved the rows at about {r['fill_rate_mib_s']:.0f} MiB/s when the benchmark "
        "filled TQ: a floor for any restore that puts the rows back through TQ's API, whatever the file format.",
        "- **continued**: rollouts Gym restored as run n + 1 (checked equal to the rollouts parked at the save; the "
        "rows restored are checked equal to the rows saved).",
        f"- Plots: {', '.join(plots) if plots else '(not written)'}.",
    ]
    return "\n".join(lines) + "\n"


def restore_plots(r: dict[str, Any], results: Path) -> list[Path]:
    out = []
    for axis, stem, label in (("rollouts", "restore_vs_rollouts", "in-flight rollouts in the snapshot"),
                              ("bytes", "restore_vs_bytes", "TQ rows (MiB of values)")):
        pts = _axis(r, axis)
        if not pts:
            continue
        xs = [p["n"] if axis == "rollouts" else p["bytes_target"] / MIB for p in pts]
        series = [("restore (whole)", xs, [p["restore"]["restore_s"] for p in pts], "o-"),
                  ("TQ holds every value (background)", xs, [p["restore"]["tq_loaded_s"] for p in pts], "^:"),
                  ("Gym restore", xs, [p["restore"]["steps_s"].get("gym_restore") for p in pts], "v:"),
                  ("raw read of the snapshot's files (warm)", xs, [p["restore"]["raw_read_s"] for p in pts], "s--"),
                  ("raw read, files evicted", xs, [p["restore"]["raw_read_cold_s"] for p in pts], "d--")]
        ticks = [f"{x:,}" for x in xs] if axis == "rollouts" else [common.size_label(p["bytes_target"]) for p in pts]
        fixed = (f"TQ {common.size_label(r['config']['fixed_bytes'])}" if axis == "rollouts"
                 else f"{r['config']['fixed_rollouts']:,} rollouts")
        out.append(common.plot(results / common.png_name(stem, r["quick"]), f"Restore vs {axis} ({fixed})", label,
                               "seconds", series, xticks=xs, xticklabels=ticks))
    return out


__all__ = ["FULL", "QUICK", "SMALLEST", "pause_markdown", "pause_results", "restore_markdown", "restore_results", "run"]
