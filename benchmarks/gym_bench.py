"""The Gym protocol benchmark (issue 4, "Speed"): the time of each control phase against the number
of parked rollouts, so the growth is visible.

    python -m benchmarks.run --section gym            # N = 10, 100, 1,000 -> benchmarks/results/gym.md
    python -m benchmarks.run --section gym --quick    # N = 10, 100, one repeat each

For each N, and each repeat: the three reference servers (``refgym``: model, agent, resource, each a
real uvicorn process on 127.0.0.1, forked from one :class:`~devtools.gym_forkserver.ForkServer`) are
started fresh, N multi-turn rollouts are started on the agent and run until every one has finished
at least one turn (each has 64 turns and every model call takes ``MODEL_SLOW_MS``, so none can
finish before the snapshot). Then the protocol is driven call by call, in the documented order,
each call timed with ``time.perf_counter`` on the driver's side (the HTTP round trip included):

    prepare model, agent, resource -> begin draft -> commit agent, model (given the agent's receipt),
    resource -> publish -> resume resource, model, agent

after which every server is SIGKILLed, three fresh ones are started (not timed) and restored from the
published snapshot (model, agent, resource), then resumed (resource, model, agent). The snapshot store
is a local folder. Every phase's median over the repeats is reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coordinator.checkpoint import gym_parts
from devtools.gym_fleet import Fleet, Gym, Spec, new_fleet, wait_until
from devtools.gym_forkserver import ForkServer
from devtools.gym_procs import REPO_ROOT
from gymkit.gym_fleet import CommitResult, ParticipantReply
from refgym.agent_server import MAX_OPEN_CALLS
from schemas.topology import manifest_fingerprint
from snapformat import SnapshotStore, layout

Log = Callable[[str], None]

FULL_COUNTS = (10, 100, 1000)
QUICK_COUNTS = (10, 100)
TURNS = 64  # the most a rollout may have: a rollout parked after a few turns has plenty left
MODEL_SLOW_MS = 50  # every model call takes this long (a stand-in for generation)
WAIT_S = 180.0  # bound of the wait for every rollout's first turn
DEADLINE_S = 120.0  # the protocol calls' deadline
START_THREADS = 4  # POST /rollouts calls sent at once


def repeats_for(n: int, quick: bool) -> int:
    """Measurements per N: 5 (the median is the middle one), 1 in a quick run."""
    return 1 if quick else 5


#: (key, label, what the time includes), in table order. Keys are those of a cycle's ``times_s``.
PHASES: list[tuple[str, str, str]] = [
    ("prepare_model", "prepare: model pause",
     "`POST model-admission/pause`: the model server closes admission (new calls get 409 `checkpoint_parked`) "
     "and answers at once, `draining` while calls are in flight"),
    ("prepare_agent", "prepare: agent (park at boundaries)",
     "`POST agent-checkpoint/prepare`: closes agent admission, asks every execution to park at its next "
     "boundary and answers once nothing runs (a turn whose model call was refused never started; one past its "
     "model call parks at the answer, before its tool calls, except in a rollout's first turn, which finishes). "
     f"The agent runs at most {MAX_OPEN_CALLS} turns at once; a rollout "
     "waiting for a turn slot has not started its turn and parks at once, so this is those turns reaching their boundaries"),
    ("prepare_resource", "prepare: resources export",
     "`POST resources-checkpoint/prepare`: closes resources admission and exports every bound session under its lock"),
    ("prepare_model_drain", "prepare: model drain",
     "`GET model-admission/status?wait_state=paused`: waits for the model's last calls in flight (asked every "
     "time here; NeMo-RL asks only a model that answered `draining`)"),
    ("begin", "begin draft",
     "`SnapshotStore.begin()`: find the newest snapshot and name the draft (local store)"),
    ("commit_agent", "commit: agent",
     "`POST agent-checkpoint/commit`: writes Gym's agent files into `checkpoint_dir` (the draft's `gym/` folder): "
     "the boundary archive, `agent-index.jsonl`, `continuations.jsonl`, `manifest.json`"),
    ("commit_model", "commit: model",
     "`POST model-checkpoint/commit` with the agent's continuation index: reads and checks it, picks each root's "
     "calls up to its last committed one, writes a lineage file per capture key, `storage-references.jsonl`, "
     "`manifest.json`"),
    ("commit_resource", "commit: resources",
     "`POST resources-checkpoint/commit`: writes one session file per exported session and `manifest.json`"),
    ("adopt", "adopt Gym's files",
     "`gym_parts.adopt_commit`: checks each participant's `manifest.json` against the bytes and writes its part "
     "manifest (files hashed in place: the store is a local folder)"),
    ("publish", "publish",
     "`draft.publish(...)`: read and check the part manifests, write the snapshot manifest and the create-only "
     "commit record (the driver's side, no HTTP)"),
    ("resume_resource", "resume: resources", "`POST resources-checkpoint/resume`"),
    ("resume_model", "resume: model", "`POST model-admission/resume`"),
    ("resume_agent", "resume: agent", "`POST agent-checkpoint/resume`: releases the parked executions"),
    ("pause_total", "total pause (prepare start -> resume end)",
     "wall time from the model's pause call to the agent's resume answer: every row above"),
    ("restore_model", "restore: model",
     "`POST model-checkpoint/restore` on a fresh model server: reads and checks the ledger folder, loads the "
     "lineage rows, fences the saved tombstones and source attempts"),
    ("restore_agent", "restore: agent",
     "`POST agent-checkpoint/restore` on a fresh agent: reads and checks the archives and indexes; each parked "
     "execution becomes the continuation of attempt n+1"),
    ("restore_resource", "restore: resources",
     "`POST resources-checkpoint/restore` on a fresh resources server: loads the sessions as attempt n+1"),
    ("resume_after_restore", "resume after restore (resources, model, agent)",
     "the three resume calls after the restore, together"),
    ("restore_total", "total restore (restore start -> resume end)",
     "wall time from the first restore call to the agent's resume answer (fresh servers already running)"),
]
BYTES = [("model", "model"), ("agent", "agent"), ("resource", "resource"), ("total", "total")]


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] gym: {msg}", flush=True)


def _part_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _timed(times: dict[str, float], key: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    times[key] = time.perf_counter() - t0
    return out


def start_rollouts(gym: Gym, n: int, tag: str, log: Log) -> None:
    """Start ``n`` rollouts of :data:`TURNS` turns; return once each has finished at least one turn."""
    t0 = time.perf_counter()
    specs = [Spec(f"{tag}r{i}", seed=i, turns=TURNS) for i in range(n)]
    with ThreadPoolExecutor(START_THREADS) as pool:  # a few at once: the agent is busy running the first ones
        list(pool.map(lambda s: gym.agent.start_rollout(s.rollout_id, s.seed, s.turns, s.tools), specs))

    def progress() -> bool:
        rows = gym.agent.get("/rollouts")
        done = [r for r in rows if r["outcome"] != "running"]
        if done:
            raise RuntimeError(f"{len(done)} rollouts ended before the snapshot (first: {done[0]})")
        return len(rows) == n and all(r["turns_done"] >= 1 for r in rows)

    started = time.perf_counter() - t0
    wait_until(progress, f"every one of {n} rollouts to finish its first turn", WAIT_S, every=0.1)
    if n >= 100:
        log(f"N={n}: rollouts started in {started:.1f} s, all past their first turn after "
            f"{time.perf_counter() - t0:.1f} s (not timed)")


def cycle(fleet: Fleet, store: SnapshotStore, store_root: Path, n: int, tag: str, log: Log) -> dict[str, Any]:
    """One measured run for ``n`` rollouts: snapshot them, kill everything, restore on fresh servers."""
    setup0 = time.perf_counter()
    gym = fleet.gym(model_slow_ms=MODEL_SLOW_MS)
    start_rollouts(gym, n, tag, log)
    fingerprint = gym.fingerprint()  # also caches each client's capabilities (outside the timings)
    setup_s = time.perf_counter() - setup0

    times: dict[str, float] = {}
    ck = f"bench-{tag}"
    deadline = time.time() + DEADLINE_S
    t_pause = time.perf_counter()
    # NeMo-RL's prepare order: the model stops admitting calls, the agent parks every rollout at a
    # turn end, the resources export their sessions, then the model's last calls drain.
    _timed(times, "prepare_model", lambda: gym.model.model.pause(ck, deadline))
    agent_status = _timed(times, "prepare_agent", lambda: gym.agent.agent.prepare(ck, deadline))
    inventory = _timed(times, "prepare_resource", lambda: gym.resource.resources.prepare(ck, deadline))
    # Always asked (NeMo-RL asks only a model that was still draining), so every cycle has the row.
    model_state = _timed(times, "prepare_model_drain", lambda: gym.model.model.status(
        ck, deadline, wait_state="paused", timeout_s=max(0.0, deadline - time.time())))
    draft = _timed(times, "begin", store.begin)
    checkpoint_dir = gym_parts.save_dir(draft)
    replies: list[ParticipantReply] = []

    def commit(key: str, client: Any, call: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        reply = _timed(times, key, call)
        caps = client.capabilities()
        replies.append(ParticipantReply(component=caps.component, name=caps.name, server_name=caps.name, reply=reply,
                                        seconds=time.perf_counter() - t0))
        return reply

    agent = commit("commit_agent", gym.agent, lambda: gym.agent.agent.commit(ck, deadline, checkpoint_dir.path))
    model = commit("commit_model", gym.model, lambda: gym.model.model.commit(
        ck, deadline, checkpoint_dir.path, [agent.continuation_index]))
    resource = commit("commit_resource", gym.resource, lambda: gym.resource.resources.commit(
        ck, deadline, checkpoint_dir.path))
    result = CommitResult(checkpoint_id=ck, participants=replies, checkpoint_dir=checkpoint_dir.path)
    parts = _timed(times, "adopt", lambda: gym_parts.adopt_commit(draft, checkpoint_dir, result))
    published = _timed(times, "publish", lambda: draft.publish(
        receipts=parts.receipts, gym_commit=parts.gym_commit, topology_fingerprint=manifest_fingerprint(fingerprint)))
    for key, call in (("resume_resource", lambda: gym.resource.resources.resume(ck, deadline)),
                      ("resume_model", lambda: gym.model.model.resume(ck, deadline)),
                      ("resume_agent", lambda: gym.agent.agent.resume(ck, deadline))):
        _timed(times, key, call)
    times["pause_total"] = time.perf_counter() - t_pause

    snap_dir = store_root / layout.snapshot_dir(published.manifest.snapshot_id)
    part_bytes = {comp: _part_bytes(snap_dir / p.part_prefix) for comp, p in
                  zip(("agent", "model", "resource"), parts.gym_commit.participants) if p.part_prefix}
    part_bytes["total"] = sum(part_bytes.values())

    # -- crash: every server SIGKILLed; fresh ones (not timed) restored from the snapshot ----------
    for p in gym.servers.all:
        p.kill()
    t0 = time.perf_counter()
    fresh = fleet.gym(model_slow_ms=MODEL_SLOW_MS)
    if fresh.fingerprint() != fingerprint:
        raise RuntimeError("the fresh servers' topology differs from the snapshot's")
    restart_s = time.perf_counter() - t0
    rid = f"restore-{tag}"
    deadline = time.time() + DEADLINE_S
    t_restore = time.perf_counter()
    snap = store.open(published.manifest.sequence)
    restore_dir = gym_parts.restore_dir(snap, [p.part_prefix for p in parts.gym_commit.participants if p.part_prefix])
    restored = {
        "model": _timed(times, "restore_model", lambda: fresh.model.model.restore(rid, deadline, restore_dir.path)),
        "agent": _timed(times, "restore_agent", lambda: fresh.agent.agent.restore(rid, deadline, restore_dir.path)),
        "resource": _timed(times, "restore_resource", lambda: fresh.resource.resources.restore(
            rid, deadline, restore_dir.path)),
    }
    t0 = time.perf_counter()
    fresh.resource.resources.resume(rid, deadline)
    fresh.model.model.resume(rid, deadline)
    fresh.agent.agent.resume(rid, deadline)
    end = time.perf_counter()
    times["resume_after_restore"] = end - t0
    times["restore_total"] = end - t_restore
    for p in fresh.servers.all:
        p.kill()

    counts = {
        "requested": n,
        "in_flight_after_prepare": {"model": model_state.inflight_total, "agent": agent_status.running},
        "resource_prepare_sessions": inventory.sessions,
        "agent_commit_parked": agent.records,
        "agent_commit_completed_unacknowledged": agent_status.completed_unacknowledged,
        "model_commit_rollouts": model.rollouts,
        "model_commit_calls": model.rows,
        "resource_commit_sessions": resource.sessions,
        "agent_restore_continuations": restored["agent"].records,
        "model_restore_calls": restored["model"].rows,
        "resource_restore_sessions": restored["resource"].sessions,
    }
    return {"times_s": times, "bytes": part_bytes, "counts": counts, "files": published.manifest.file_count,
            "setup_s": round(setup_s, 3), "restart_s": round(restart_s, 3)}


def run(counts: tuple[int, ...] = FULL_COUNTS, quick: bool = False, log: Log | None = None,
        workdir: Path | None = None) -> dict:
    """Measure every phase for each N in ``counts``; returns the results (JSON-able; see ``markdown``)."""
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"counts: {counts!r} (expected positive rollout counts)")
    log = log or _say
    started = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    made_workdir = workdir is not None and not workdir.exists()
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gym-bench-", dir=workdir))
    t0 = time.perf_counter()
    forkserver = ForkServer(REPO_ROOT)
    log(f"fork server ready in {time.perf_counter() - t0:.1f} s (not timed); work folder {tmp}")
    fleet = new_fleet(tmp / "fleet", forkserver)
    per_n: list[dict[str, Any]] = []
    try:
        for n in counts:
            reps = repeats_for(n, quick)
            store_root = tmp / f"store-{n}"
            store = SnapshotStore(str(store_root))
            cycles = []
            for rep in range(reps):
                c = cycle(fleet, store, store_root, n, f"n{n}x{rep}", log)
                cycles.append(c)
                t = c["times_s"]
                log(f"N={n} repeat {rep + 1}/{reps}: pause {t['pause_total'] * 1e3:.0f} ms, restore "
                    f"{t['restore_total'] * 1e3:.0f} ms, {c['bytes']['total'] / 1e3:.0f} kB written; parked "
                    f"{c['counts']['agent_commit_parked']}/{n} (setup {c['setup_s']:.1f} s)")
            per_n.append({
                "n": n, "repeats": reps, "cycles": cycles,
                "median_s": {k: statistics.median(c["times_s"][k] for c in cycles) for k, _, _ in PHASES},
                "median_bytes": {k: statistics.median(c["bytes"][k] for c in cycles) for k, _ in BYTES},
                "counts": cycles[-1]["counts"],
            })
    finally:
        fleet.close()
        forkserver.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if made_workdir and workdir is not None and not any(workdir.iterdir()):
            workdir.rmdir()
    return {
        "counts": list(counts), "quick": quick, "turns": TURNS, "model_slow_ms": MODEL_SLOW_MS,
        "agent_open_calls": MAX_OPEN_CALLS,
        "phases": [{"key": k, "label": label, "includes": what} for k, label, what in PHASES],
        "per_n": per_n,
        "machine": {"cores": os.cpu_count(), "load_average_start": load_start,
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _kb(b: float) -> str:
    return f"{b / 1e3:.1f}"


def _growth(first: float, last: float) -> str:
    return f"{last / first:.1f}x" if first > 0 else "-"


def markdown(result: dict) -> str:
    r = result
    per_n = r["per_n"]
    ns = [p["n"] for p in per_n]
    growth = f"growth {ns[0]}->{ns[-1]}"
    head = "| phase | " + " | ".join(f"N = {n:,} (ms)" for n in ns) + f" | {growth} |"
    rule = "|---|" + "---:|" * (len(ns) + 1)
    reps = ", ".join(f"{p['repeats']} for N = {p['n']:,}" for p in per_n)
    lines = [
        "# Gym protocol benchmark: phase times vs parked rollouts",
        "",
        f"The reference Gym servers (`refgym`: model, agent, resources `tools` and `sandbox`; uvicorn on 127.0.0.1, forked from "
        f"one fork server) are started fresh for every measurement; N rollouts of {r['turns']} turns "
        f"(tool: notes) run until each has finished at least one turn (every model call takes "
        f"{r['model_slow_ms']} ms; the agent keeps at most {r['agent_open_calls']} calls open), then the "
        f"snapshot is driven call by call in NeMo-RL's order, every server is SIGKILLed, fresh "
        f"ones are started (not timed) and restored. Times are measured with "
        f"`time.perf_counter` on the driver's side, so each includes its HTTP round trip; the snapshot store is "
        f"a local folder. Median of {reps}; the machine is shared with other work, so the numbers are noisy "
        f"(load average {r['machine']['load_average_start']} at start, {r['machine']['load_average_end']} at "
        f"the end). Whole run {r['elapsed_s']:.0f} s{' (quick run)' if r['quick'] else ''}.",
        "",
        "## Phase times (median ms)",
        "",
        head,
        rule,
    ]
    for key, label, _ in PHASES:
        vals = [p["median_s"][key] for p in per_n]
        bold = "**" if key.endswith("_total") else ""
        lines.append(f"| {bold}{label}{bold} | " + " | ".join(_ms(v) for v in vals)
                     + f" | {_growth(vals[0], vals[-1])} |")
    last = per_n[-1]["median_s"]
    in_pause = PHASES[:[k for k, _, _ in PHASES].index("pause_total")]
    parts = sorted(((last[k], label) for k, label, _ in in_pause), reverse=True)[:2]
    lines += ["", f"At N = {ns[-1]:,} the pause is {_ms(last['pause_total'])} ms, most of it "
              + " and ".join(f"{label} ({_ms(v)} ms, {v / last['pause_total']:.0%})" for v, label in parts)
              + f"; the restore takes {_ms(last['restore_total'])} ms."]
    lines += ["", "## Bytes written per server (the snapshot's part of each, kB, median)", "",
              "| part | " + " | ".join(f"N = {n:,} (kB)" for n in ns) + f" | {growth} |", rule]
    for key, label in BYTES:
        vals = [p["median_bytes"][key] for p in per_n]
        lines.append(f"| {label} | " + " | ".join(_kb(v) for v in vals) + f" | {_growth(vals[0], vals[-1])} |")
    lines += ["", "## What the servers reported (last repeat of each N)", "",
              "| N | parked (agent commit) | rollouts / calls (model commit) | sessions (resource commit) | "
              "continuations (agent restore) | calls (model restore) | sessions (resource restore) |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in per_n:
        c = p["counts"]
        lines.append(f"| {p['n']:,} | {c['agent_commit_parked']} | {c['model_commit_rollouts']} / "
                     f"{c['model_commit_calls']} | {c['resource_commit_sessions']} | "
                     f"{c['agent_restore_continuations']} | {c['model_restore_calls']} | "
                     f"{c['resource_restore_sessions']} |")
    lines += ["", "## What each phase includes", ""]
    lines += [f"- **{label}**: {what}." for _, label, what in PHASES]
    lines += ["- **bytes written**: every file under the server's part prefix (`gym/agent/instance-<sha>/`, `gym/model-ledger/<name>/`, `gym/resources/<name>/`) of the "
              "published snapshot (its data files and its part manifest).",
              "- Not timed: starting the servers (fork server), starting the rollouts and waiting for their first "
              "turn, the topology fingerprint (`GET /ng-control/v1/capabilities`, fetched before the pause)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gym_bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"N = {QUICK_COUNTS}, one repeat each")
    p.add_argument("--counts", type=int, nargs="+", help="rollout counts (default 10 100 1000)")
    opts = p.parse_args(argv)
    counts = tuple(opts.counts) if opts.counts else (QUICK_COUNTS if opts.quick else FULL_COUNTS)
    print(markdown(run(counts, opts.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
