"""The token-capture store benchmark: ``gymkit.token_store.TokenStore`` against released NeMo Gym's own
file store (``nemo_gym.token_id_capture.store.TokenCaptureStore``) on the same disk, in the same run.

    python -m benchmarks.run --section token_store           # 100-call rollouts, 7 repeats
    python -m benchmarks.run --section token_store --quick   # 100-call rollouts, 5 repeats

What a Gym model server does with a sink: one awaited ``put`` per model call, in order, each
returning only once durable. Every repeat captures one fresh 100-call rollout per store (a chain:
call ``i``'s prompt is the whole conversation so far, about 1k to 20k token ids, stamped with Gym's
``stamp_continuation`` and ``stamp_lineage``), from one store instance, then a *fresh* instance (what
a trajectory builder in another process has) freezes it. The two stores alternate which goes first
in each repeat; medians over the repeats. Then the same on SeaweedFS (``weed mini`` on 127.0.0.1,
started for the run): the latency of each put, the freeze of the rollout by a fresh instance (its
log objects read in parallel), and for contrast a plain unconditional PUT of the same bytes.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Log

FULL = {"calls": 100, "repeats": 7, "s3_calls": 100, "s3_repeats": 5}
QUICK = {"calls": 100, "repeats": 5, "s3_calls": 100, "s3_repeats": 3}
SMALLEST = {"calls": 8, "repeats": 1, "s3_calls": 4, "s3_repeats": 1}
SYSTEM_TOKENS = 1024  # the first prompt
GENERATION_TOKENS = 128  # per call
TURN_TOKENS = 64  # tool result or user message added between calls
TARGET_RATIO = 1.0  # our puts per second over Gym's, at least
BUCKET = "token-store-bench"


def build_rollout(rollout_id: str, calls: int, seed: int) -> list[Any]:
    """A chain of ``calls`` Gym ``TokenEntry`` objects as Gym's capture would stamp them (not timed)."""
    from nemo_gym.token_id_capture.lineage import stamp_continuation
    from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

    rng = random.Random(seed)
    context = [rng.randrange(150_000) for _ in range(SYSTEM_TOKENS)]
    request: list[dict] = [{"role": "user", "content": "Solve the task."}]
    out = []
    for i in range(calls):
        generation = [rng.randrange(150_000) for _ in range(GENERATION_TOKENS)]
        e = TokenEntry(rollout_id=rollout_id, model_call_id=f"call-{i:04d}", model="bench-model",
                       prompt_token_ids=list(context), generation_token_ids=generation,
                       generation_log_probs=[-rng.random() * 4 for _ in generation],
                       output_items=[{"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": f"step {i}"}]}],
                       token_item_index=0, response_id=f"resp-{i}", created_at=1_700_000_000.0 + i)
        stamp_continuation(e, request)
        parent = out[-1].model_call_id if out else None
        stamp_lineage(e, parent, parent_resolution=ParentResolutionStatus.RESOLVED if parent
                      else ParentResolutionStatus.ROOT)
        out.append(e)
        context = context + generation + [rng.randrange(150_000) for _ in range(TURN_TOKENS)]
        request = request + e.output_items + [{"role": "user", "content": f"result {i}"}]
    return out


async def _capture(store: Any, entries: list[Any]) -> list[float]:
    """Each put awaited in turn, as the serving path does; returns each put's seconds."""
    times = []
    for e in entries:
        t0 = time.perf_counter()
        await store.put(e)
        times.append(time.perf_counter() - t0)
    return times


async def _freeze(make: Any, rollout_id: str, calls: int) -> float:
    """A fresh instance freezes the rollout; checked complete (outside the timing)."""
    store = make()
    t0 = time.perf_counter()
    snapshot = await store.freeze(rollout_id)
    dt = time.perf_counter() - t0
    await store.close()
    if len(snapshot.entries) != calls or snapshot.incomplete:
        raise AssertionError(f"{rollout_id}: froze {len(snapshot.entries)} entries (incomplete "
                             f"{snapshot.incomplete}), expected {calls} complete")
    return dt


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3),
            "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3, 3),
            "max_ms": round(ordered[-1] * 1e3, 3)}


def measure_local(root: Path, calls: int, repeats: int, log: Log) -> dict[str, Any]:
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    from gymkit.token_store import TokenStore

    makers = {"ours": lambda: TokenStore(str(root / "ours")), "gym": lambda: TokenCaptureStore(root / "gym")}
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "gym": []}
    sizes = []
    for r in range(repeats):
        entries = {name: build_rollout(f"rollout-{r}", calls, seed=r) for name in makers}
        sizes.append(sum(len(e.model_dump_json()) for e in entries["ours"]))
        for name in (("ours", "gym") if r % 2 == 0 else ("gym", "ours")):  # neither always goes first
            store = makers[name]()
            put_times = asyncio.run(_capture(store, entries[name]))
            asyncio.run(store.close())
            freeze_s = asyncio.run(_freeze(makers[name], f"rollout-{r}", calls))
            total = sum(put_times)
            runs[name].append({"puts_per_s": round(calls / total, 1), "put_total_s": round(total, 4),
                               "freeze_ms": round(freeze_s * 1e3, 3), **_stats(put_times)})
        o, g = runs["ours"][-1], runs["gym"][-1]
        log(f"token_store local repeat {r + 1}/{repeats}: puts/s ours {o['puts_per_s']:.0f}, Gym "
            f"{g['puts_per_s']:.0f} (x{o['puts_per_s'] / g['puts_per_s']:.2f}); freeze ours {o['freeze_ms']:.1f} ms, "
            f"Gym {g['freeze_ms']:.1f} ms")
    summary = {}
    for name, rs in runs.items():
        summary[name] = {key: round(statistics.median(x[key] for x in rs), 3)
                         for key in ("puts_per_s", "freeze_ms", "p50_ms", "p95_ms", "max_ms")}
    ratios = [o["puts_per_s"] / g["puts_per_s"] for o, g in zip(runs["ours"], runs["gym"])]
    freeze_ratios = [o["freeze_ms"] / g["freeze_ms"] for o, g in zip(runs["ours"], runs["gym"])]
    return {"calls": calls, "repeats": repeats, "rollout_json_bytes": int(statistics.median(sizes)), "runs": runs,
            "median": summary,
            "puts_ratio": round(summary["ours"]["puts_per_s"] / summary["gym"]["puts_per_s"], 3),
            "puts_ratio_median_of_repeats": round(statistics.median(ratios), 3),
            "freeze_ratio": round(summary["ours"]["freeze_ms"] / summary["gym"]["freeze_ms"], 3),
            "freeze_ratio_median_of_repeats": round(statistics.median(freeze_ratios), 3),
            "store_bytes": {"ours": common.tree_bytes(root / "ours"), "gym": common.tree_bytes(root / "gym")}}


def measure_s3(calls: int, repeats: int, log: Log) -> dict[str, Any]:
    """Per-put latency, the fresh-instance freeze and a plain PUT of the same bytes, on SeaweedFS."""
    from devtools import s3servers
    from gymkit.token_store import TokenStore, canonical_bytes
    from snapformat.store import open_store

    server = s3servers.seaweedfs()
    try:
        server.make_bucket(BUCKET)
        with common.aws_env(server.env_vars()):
            url = f"s3://{BUCKET}/tokens"
            put_times: list[float] = []
            first_put: list[float] = []
            freeze_ms: list[float] = []
            plain_times: list[float] = []
            raw = open_store(f"s3://{BUCKET}/plain")
            raw.put_bytes("warm-up", b"x")  # the bucket check and the connection, not timed
            asyncio.run(TokenStore(url).freeze("warm-up"))
            for r in range(repeats):
                entries = build_rollout(f"s3-rollout-{r}", calls, seed=1000 + r)
                store = TokenStore(url)
                times = asyncio.run(_capture(store, entries))
                asyncio.run(store.close())
                first_put.append(times[0])  # a fresh instance's first put also lists the (empty) log
                put_times += times[1:]
                freeze_ms.append(asyncio.run(_freeze(lambda: TokenStore(url), f"s3-rollout-{r}", calls)) * 1e3)
                for i, e in enumerate(entries):  # contrast: the same bytes as one plain unconditional PUT
                    data = canonical_bytes(e.model_dump(mode="json"))
                    t0 = time.perf_counter()
                    raw.put_bytes(f"r{r}/{i}.json", data)
                    plain_times.append(time.perf_counter() - t0)
                log(f"token_store SeaweedFS repeat {r + 1}/{repeats}: put p50 "
                    f"{statistics.median(times) * 1e3:.1f} ms, freeze {freeze_ms[-1]:.0f} ms, plain PUT p50 "
                    f"{statistics.median(plain_times[-calls:]) * 1e3:.1f} ms")
    finally:
        server.cleanup()
    stats = _stats(put_times)
    return {"calls": calls, "repeats": repeats, "put": stats,
            "puts_per_s": round(1e3 / stats["p50_ms"], 1), "first_put": _stats(first_put),
            "freeze_ms": {"median": round(statistics.median(freeze_ms), 2), "runs": [round(x, 2) for x in freeze_ms]},
            "plain_put": _stats(plain_times),
            "overhead_p50_ms": round(stats["p50_ms"] - _stats(plain_times)["p50_ms"], 3)}


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("nemo-gym", "pydantic", "orjson", "msgspec", "s3fs"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def run(config: dict[str, Any], quick: bool, scratch: Path, log: Log) -> dict[str, Any]:
    started = time.perf_counter()
    load_start = common.load_average()
    work, cleanup = common.work_folder(scratch, "token_store")
    try:
        local = measure_local(work, config["calls"], config["repeats"], log)
    finally:
        cleanup()
    s3 = measure_s3(config["s3_calls"], config["s3_repeats"], log)
    return {"quick": quick, "config": dict(config), "local": local, "seaweedfs": s3, "versions": _versions(),
            "target_ratio": TARGET_RATIO, "load_average": {"start": load_start, "end": common.load_average()},
            "elapsed_s": round(time.perf_counter() - started, 1)}


def markdown(r: dict[str, Any]) -> str:
    loc, s3, v = r["local"], r["seaweedfs"], r["versions"]
    o, g = loc["median"]["ours"], loc["median"]["gym"]
    last_prompt = SYSTEM_TOKENS + (loc["calls"] - 1) * (GENERATION_TOKENS + TURN_TOKENS)
    put, first, plain = s3["put"], s3["first_put"], s3["plain_put"]
    met = loc["puts_ratio"] >= r["target_ratio"]
    lines = [
        "# Token-capture store benchmark: gymkit.token_store.TokenStore vs NeMo Gym's TokenCaptureStore",
        "",
        f"One rollout of {loc['calls']} model calls per repeat and store (a chain whose prompts grow from "
        f"{SYSTEM_TOKENS:,} to about {last_prompt:,} token ids, {GENERATION_TOKENS} generated per call; "
        f"{common.size_label(loc['rollout_json_bytes'])} of entry JSON per rollout), stamped with Gym's "
        "`stamp_continuation` and `stamp_lineage`. One store instance awaits each `put` in turn (as "
        "Gym's serving path does: durable before it returns); then a fresh instance freezes the rollout. Both "
        f"stores on the same disk in the same run, alternating which goes first; medians of {loc['repeats']} repeats. "
        f"NeMo Gym {v['nemo-gym']}, pydantic {v['pydantic']}, orjson {v['orjson']}, msgspec {v['msgspec']}, "
        f"s3fs {v['s3fs']}. "
        f"Whole run {r['elapsed_s']:.0f} s{' (quick run)' if r['quick'] else ''}; load average "
        f"{r['load_average']['start']} at start, {r['load_average']['end']} at the end.",
        "",
        "## Local disk",
        "",
        "| store | puts/s | put p50 ms | put p95 ms | put max ms | freeze of the rollout ms | on disk |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| `TokenStore` (ours, snapformat log) | **{o['puts_per_s']:.0f}** | {o['p50_ms']:.2f} | {o['p95_ms']:.2f} | "
        f"{o['max_ms']:.2f} | {o['freeze_ms']:.1f} | {common.size_label(loc['store_bytes']['ours'])} |",
        f"| Gym `TokenCaptureStore` (JSONL + state file) | {g['puts_per_s']:.0f} | {g['p50_ms']:.2f} | "
        f"{g['p95_ms']:.2f} | {g['max_ms']:.2f} | {g['freeze_ms']:.1f} | "
        f"{common.size_label(loc['store_bytes']['gym'])} |",
        f"| **ours / Gym** | **x{loc['puts_ratio']:.2f}** | | | | x{loc['freeze_ratio']:.2f} (time) | |",
        "",
        f"**Puts per second: x{loc['puts_ratio']:.2f} Gym's (median of the per-repeat ratios "
        f"x{loc['puts_ratio_median_of_repeats']:.2f}); target at least x{r['target_ratio']:.1f}: "
        f"{'met' if met else 'NOT met'}.**  ",
        f"**Freeze of a {loc['calls']}-call rollout by a fresh instance: {o['freeze_ms']:.1f} ms against Gym's "
        f"{g['freeze_ms']:.1f} ms (x{loc['freeze_ratio']:.2f} the time).**",
        "",
        "Per repeat (puts/s ours / Gym; freeze ms ours / Gym): " + "; ".join(
            f"{a['puts_per_s']:.0f} / {b['puts_per_s']:.0f}, {a['freeze_ms']:.1f} / {b['freeze_ms']:.1f}"
            for a, b in zip(loc["runs"]["ours"], loc["runs"]["gym"])) + ".",
        "",
        "## SeaweedFS",
        "",
        f"`weed mini` on 127.0.0.1 started for this run; {s3['repeats']} rollouts of {s3['calls']} calls, each "
        "captured by one `TokenStore(\"s3://...\")` instance (a warm put is one create-only PUT, `If-None-Match: *`).",
        "",
        "| operation | p50 ms | p95 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| `put` (warm instance) | **{put['p50_ms']:.2f}** | {put['p95_ms']:.2f} | {put['max_ms']:.2f} |",
        "| first `put` of a fresh instance (its S3 client's first requests: bucket check, listing of the log) | "
        f"{first['p50_ms']:.2f} | {first['p95_ms']:.2f} | {first['max_ms']:.2f} |",
        "| contrast: plain unconditional PUT of the same bytes (`S3Store.put_bytes`) | "
        f"{plain['p50_ms']:.2f} | {plain['p95_ms']:.2f} | {plain['max_ms']:.2f} |",
        "",
        f"**Per-put latency on SeaweedFS: p50 {put['p50_ms']:.2f} ms ({s3['overhead_p50_ms']:+.2f} ms over a "
        f"plain PUT of the same bytes), about {s3['puts_per_s']:.0f} sequential puts/s per rollout. Freeze of a "
        f"{s3['calls']}-call rollout by a fresh instance: {s3['freeze_ms']['median']:.0f} ms (median).**",
        "",
        "Notes:",
        "- A put of ours is one create-only write of one small object: on local disk a temporary file, its fsync, "
        "a hard link to the event's name and the folder's fsync (two fsyncs; snapformat's `LocalStore."
        "create_exclusive` adds a third, of the folder after creating the temporary file, which `TokenStore` skips). "
        "Gym's is an `fsync`ed append to the rollout's JSONL under a lock file, plus a rewrite (not fsynced) of a "
        "state file that holds every digest of the rollout.",
        "- A freeze of ours lists the log and reads one object per event (on S3 in parallel, 16 threads); Gym's "
        "reads one JSONL file. Both parse each entry with pydantic into Gym's `TokenEntry`, most of the time.",
        "- On SeaweedFS here, a freeze is bound by CPU, not by round trips: the server and the client share the "
        "2 cores, and each small GET costs a few ms of CPU between them (s3fs, botocore, SeaweedFS), so reading "
        "with 1 or 16 threads took about the same time. Against a remote store the parallel reads overlap the "
        "round trips.",
        "- Puts/s is the rollout's calls over the sum of its put times (each put includes the hop to a worker "
        "thread both stores make). The machine has 2 cores shared with other work: see the load average.",
    ]
    return "\n".join(lines) + "\n"
