"""Section ``parked``: Gym's checkpoint files of N parked rollouts, written, read and verified (issue 22 §2).

For N parked rollouts spread over :data:`SERVERS` agent, model and resources servers (rollouts
``[s*N/S, (s+1)*N/S)`` on servers ``agent<s>``, ``policy<s>`` and ``tools<s>``), each step runs in a
fresh child process, so its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) is its own:

* **write**: the three commits of every server, through the same calls the reference servers make
  (``gymkit.agent_control.commit_agent_checkpoint``, ``gymkit.checkpoint_dir.write_ledger_dir`` after
  reading the agent's continuation index as ``refgym.model_server`` does, and
  ``gymkit.resources_control.commit_resources_checkpoint``) into ``<draft>/gym`` (the controller's
  local-disk layout). The records are synthetic but valid: each is a frozen struct of ``schemas``,
  and lineage rows carry Gym's TokenEntry, a sample of which released Gym's own
  ``nemo_gym.token_id_capture.records.TokenEntry`` validates. The records of a server are produced
  lazily, in Gym's order, as a server holding them would hand them over.
* **adopt**: ``snapformat.adopt.adopt_gym_dir`` of the folder into its draft, then ``publish``. Since
  format 1.4 the manifest lists each Gym folder by its part manifest (a listed part, SPEC §10.4); up
  to 1.3 it listed every file, and this is where its bounds (``MAX_MANIFEST_BYTES``, 1,000,000 file
  entries) showed. A refusal is recorded as the step's result, not raised.
* **read**: what a restore parses: ``read_agent_checkpoint`` (agent), ``refgym``'s ``RefModel.restore``
  (ledger and every lineage row), ``load_resources_checkpoint`` with the agents' revisions checked
  (resources), one server after the other; each server's restored state is dropped before the next.
* **verify**: ``snapformat.gym_dir.check_folder`` of every participant folder (what adopt and a
  restoring participant check), then ``snapformat.verify.verify_snapshot`` of the published snapshot
  when ``adopt`` published one.

Times are wall-clock seconds of the step in its child; reads run on a warm page cache (the write
just happened). Slopes are least-squares log-log slopes over the sizes (time: 1.0 is linear; peak
RSS: 0 is bounded).

    python -m benchmarks.run --section parked                    # 10k, 100k (5 repeats), 1M (1 repeat)
    python -m benchmarks.parked_bench --sizes 10000 --repeats 1  # one size, report to stdout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from devtools.checkout import REPO_ROOT, child_env

Log = Callable[[str], None]

#: Servers of each kind (agent, model, resources); the issue's "10 agent servers" shape.
SERVERS = 10
FULL_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000)
#: Repeats per size: medians of 5 up to 100,000; the 1M run takes tens of minutes a repeat.
REPEATS = {10_000: 5, 100_000: 5, 1_000_000: 1}
#: The order a repeat runs them in: the slowest, read, last, so a run cut short has the others.
STEPS = ("write", "adopt", "verify", "read")
CHECKPOINT_ID = "ckpt-parked-000001"
#: Model calls per parked rollout (its lineage rows) and the tokens each call's prompt and
#: generation carry: a short multi-turn rollout.
CALLS, PROMPT_TOKENS, GEN_TOKENS = 3, 24, 12
MIB = 1 << 20
CHILD_TIMEOUT_S = 6 * 3600


# -- the records ------------------------------------------------------------------------------------------
def server_range(n: int, servers: int, s: int) -> range:
    """The rollout numbers server ``s`` of ``servers`` holds."""
    return range(s * n // servers, (s + 1) * n // servers)


def rollout_id(i: int) -> str:
    return f"r{i:08d}"


def attempt_of(i: int) -> int:
    """Every fourth rollout is on its second attempt (capture key ``<rid>-a1``)."""
    return 1 if i % 4 == 0 else 0


def _tokens(i: int, turn: int, count: int, salt: int) -> list[int]:
    return [(i * 131 + turn * 17 + j * 7 + salt) % 31_998 for j in range(count)]


def agent_record(i: int, resources_name: str) -> Any:
    """The boundary record of parked rollout ``i``: after turn ``CALLS``, its last model call named,
    its resources session at revision ``CALLS``."""
    from schemas.gym_files import AgentBoundaryRecord

    rid, n = rollout_id(i), attempt_of(i)
    trajectory = [{"turn": t, "model_call_id": f"call-{t}", "generation_token_ids": _tokens(i, t, GEN_TOKENS, 1),
                   "tool_results": [{"tool": "notes", "result": {"n": t}}]} for t in range(CALLS)]
    return AgentBoundaryRecord(
        rollout_id=rid, attempt_index=n, boundary_index=CALLS, turn_index=CALLS,
        last_committed_model_call_id=f"call-{CALLS - 1}", resource_state_revisions={resources_name: CALLS},
        agent_state={"seed": i, "turns": CALLS + 2, "tools": ["notes"], "trajectory": trajectory,
                     "turn_keys": [f"{rid}/t{t}" for t in range(CALLS)], "revisions": {"notes": CALLS},
                     "resources": {"notes": resources_name}, "sessions_ended": False},
        created_at=1_700_000_000.0 + i)


def lineage_calls(i: int, model: str) -> list[Any]:
    """The ledger rows of rollout ``i``'s capture key: ``CALLS`` calls, each the parent of the next
    (``refgym.model_server.Call``: Gym's TokenEntry and the ledger entry)."""
    from refgym.model_server import UNRESOLVED_PARENT_REASON, Call  # noqa: F401 - the reference server's row type
    from schemas.gym_records import ModelLedgerEntry
    from schemas.identity import capture_key
    from schemas.token_entry import TOKEN_ENTRY_SCHEMA_VERSION, token_digest

    rid, n = rollout_id(i), attempt_of(i)
    key = capture_key(rid, n)
    calls, prompt = [], _tokens(i, 0, PROMPT_TOKENS, 0)
    for t in range(CALLS):
        gen = _tokens(i, t, GEN_TOKENS, 1)
        cumulative = prompt + gen
        parent = f"call-{t - 1}" if t else None
        token = {
            "schema_version": TOKEN_ENTRY_SCHEMA_VERSION, "rollout_id": key, "model_call_id": f"call-{t}",
            "model": model, "prompt_token_ids": prompt, "generation_token_ids": gen,
            "generation_log_probs": [-0.5 - (j % 7) / 8 for j in range(GEN_TOKENS)], "routed_experts": None,
            "output_items": [{"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": f"<{GEN_TOKENS} tokens>"}]}],
            "token_item_index": 0, "response_id": f"resp-{key}-call-{t}", "created_at": 1_700_000_000.0 + i + t,
            "parent_call_id": parent, "cum_len": len(cumulative), "digest": token_digest(cumulative),
            "parent_resolution": "resolved" if parent else "root", "continuation_fingerprint": "",
            "continuation_context_len": 0, "continuation_context_digest": "", "parent_resolution_reason": "",
            "fingerprint_version": None, "prompt_is_delta": False, "prefix_requested": False,
            "prefix_supplied": False,
        }
        entry = ModelLedgerEntry(rollout_id=rid, attempt_index=n, capture_key=key, model_call_id=f"call-{t}",
                                 parent_call_id=parent, turn_index=t, model=model,
                                 created_at=1_700_000_000.0 + i + t)
        calls.append(Call.answered(entry, token))
        prompt = cumulative + _tokens(i, t, 4, 2)  # the next prompt: the conversation plus a tool result
    return calls


def resource_snapshot(i: int) -> Any:
    """The exported session of rollout ``i`` on its resources server: revision ``CALLS``, one
    mutation receipt per revision."""
    import hashlib

    from schemas.gym_files import MutationReceipt, ResourceSnapshot

    rid, n = rollout_id(i), attempt_of(i)
    receipts = [MutationReceipt(request_id=f"{rid}-req-{r}", expected_revision=r,
                                input_digest=hashlib.sha256(f"{rid}/{n}/{r}".encode()).hexdigest(), status=200,
                                headers=[("content-type", "application/json")],
                                body_base64="eyJvayI6IHRydWV9", resulting_revision=r + 1) for r in range(CALLS)]
    return ResourceSnapshot(rollout_id=rid, attempt_index=n, state_revision=CALLS,
                            state={"notes": [j * i % 997 for j in range(8)]}, mutation_receipts=receipts,
                            created_at=1_700_000_000.0 + i)


class LazyLineages(Mapping[str, bytes]):
    """A model server's lineages as ``write_ledger_dir`` takes them (capture key -> the lineage
    file's bytes), each built when asked for: the calls live in the server; their bytes need not
    all exist at once."""

    def __init__(self, roots: list[Any], model: str) -> None:
        self._by_key = {r.capture_key: r for r in roots}
        self._model = model

    def __getitem__(self, key: str) -> bytes:
        root = self._by_key[key]
        return b"".join(call.row for call in lineage_calls(int(root.rollout_id[1:]), self._model))

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)


def validate_sample(n: int, servers: int, sample: int = 64) -> int:
    """Released Gym judges a sample: every lineage row's token as ``nemo_gym``'s TokenEntry (digest
    recomputed as Gym does). Returns the rows checked."""
    from nemo_gym.token_id_capture.records import TokenEntry, compute_digest, cumulative_tokens

    checked = 0
    for i in list(server_range(n, servers, 0))[:sample]:
        for call in lineage_calls(i, "policy0"):
            token = TokenEntry.model_validate(call.fields())
            if token.digest != compute_digest(cumulative_tokens(token)):
                raise AssertionError(f"rollout {i}: Gym computes another digest for {call.entry.model_call_id}")
            checked += 1
    return checked


# -- the steps (one per child process) -----------------------------------------------------------------------
def _names(s: int) -> tuple[str, str, str]:
    return f"agent{s}", f"policy{s}", f"tools{s}"


def step_write(gym: Path, n: int, servers: int) -> dict[str, Any]:
    from gymkit.agent_control import commit_agent_checkpoint
    from gymkit.checkpoint_dir import read_jsonl, write_ledger_dir
    from gymkit.resources_control import commit_resources_checkpoint
    from schemas.gym_files import AttemptEntry, ExternalStorageReference
    from schemas.gym_records import AgentContinuationRoot

    out: dict[str, Any] = {"agent_s": 0.0, "ledger_s": 0.0, "resources_s": 0.0}
    for s in range(servers):
        agent, model, tools = _names(s)
        ids = server_range(n, servers, s)
        t0 = time.perf_counter()
        # rollout ids are zero-padded, so range order is Gym's (rollout_id, attempt_index) order
        reply = commit_agent_checkpoint(str(gym), CHECKPOINT_ID, agent, (agent_record(i, tools) for i in ids))
        t1 = time.perf_counter()
        # the model server's commit, as refgym.model_server does it: the agent's roots, then its ledger
        roots = read_jsonl(gym, reply.continuation_index, AgentContinuationRoot)
        write_ledger_dir(
            gym, CHECKPOINT_ID, model, lineages=LazyLineages(roots, model),
            storage_references=(ExternalStorageReference(
                capture_key=r.capture_key, boundary_model_call_id=r.last_committed_model_call_id,
                key=f"{r.capture_key}/{r.last_committed_model_call_id}") for r in roots),
            roots=roots, source_attempts=[AttemptEntry(rollout_id=r.rollout_id, attempt_index=r.attempt_index)
                                          for r in roots])
        del roots
        t2 = time.perf_counter()
        commit_resources_checkpoint(str(gym), CHECKPOINT_ID, tools, (resource_snapshot(i) for i in ids))
        t3 = time.perf_counter()
        out["agent_s"] += t1 - t0
        out["ledger_s"] += t2 - t1
        out["resources_s"] += t3 - t2
    return out


def step_adopt(gym: Path, store_url: str, draft_id: str) -> dict[str, Any]:
    """Adopt ``gym`` (``<draft>/gym``, written in place) into its draft, then publish; a refusal
    of the publish is recorded, not raised."""
    from snapformat.adopt import adopt_gym_dir
    from snapformat.draft import SnapshotDraft
    from snapformat.store import open_store

    # The draft the parent began (sequence 1 of a fresh store), taken up in this process.
    draft = SnapshotDraft(open_store(store_url), draft_id, 1, time.time(), None)
    t0 = time.perf_counter()
    receipts = adopt_gym_dir(draft.url, str(gym))
    out: dict[str, Any] = {"parts": len(receipts), "adopt_s": time.perf_counter() - t0}
    t1 = time.perf_counter()
    try:
        published = draft.publish(receipts=receipts)
    except Exception as exc:  # noqa: BLE001 - the refusal is the measurement
        out |= {"published": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    else:
        out |= {"published": True, "url": published.url,
                "manifest_bytes": (Path(published.url) / "manifest.json").stat().st_size,
                "manifest_files": len(published.manifest.files),
                "listed_parts": len(published.manifest.listed_parts),
                # what the snapshot says it holds of Gym's files (the write step's files and bytes)
                "gym_files": sum(1 for f in published.manifest.files if f.kind == "gym_file")
                + sum(p.files for p in published.manifest.listed_parts),
                "gym_file_bytes": sum(f.size for f in published.manifest.files if f.kind == "gym_file")
                + sum(p.bytes for p in published.manifest.listed_parts)}
    out["publish_s"] = time.perf_counter() - t1
    if out["published"]:
        # Published is not the end: a reader must open it within its own bounds (MAX_MANIFEST_BYTES,
        # 1,000,000 file entries; publish refuses past them since issue 22, as it did not before).
        from snapformat.reader import open_snapshot

        try:
            open_snapshot(published.url)
        except Exception as exc:  # noqa: BLE001 - the refusal is the measurement
            out |= {"readable": False, "read_error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        else:
            out["readable"] = True
    return out


def step_read(gym: Path, n: int, servers: int) -> dict[str, Any]:
    from gymkit.agent_control import read_agent_checkpoint
    from gymkit.model_control import ModelAdmission, ModelRestoreContext
    from gymkit.resources_control import load_resources_checkpoint
    from refgym.model_server import RefModel

    counts = {"agent_records": 0, "ledger_rows": 0, "sessions": 0}
    out: dict[str, Any] = {"agent_s": 0.0, "ledger_s": 0.0, "resources_s": 0.0}
    for s in range(servers):
        agent, model, tools = _names(s)
        t0 = time.perf_counter()
        _, records, _ = read_agent_checkpoint(str(gym), agent)
        counts["agent_records"] += len(records)
        del records
        t1 = time.perf_counter()
        ref = RefModel(model, 0, ModelAdmission())
        reply = asyncio.run(ref.restore(ModelRestoreContext(checkpoint_id=CHECKPOINT_ID, deadline_ts=time.time() + 3600,
                                                            checkpoint_dir=str(gym))))
        counts["ledger_rows"] += reply.rows
        del ref, reply
        t2 = time.perf_counter()
        _, snapshots = load_resources_checkpoint(str(gym), tools, check_agents=True)
        counts["sessions"] += len(snapshots)
        del snapshots
        t3 = time.perf_counter()
        out["agent_s"] += t1 - t0
        out["ledger_s"] += t2 - t1
        out["resources_s"] += t3 - t2
    return out | counts


def step_verify(gym: Path, url: str | None) -> dict[str, Any]:
    from snapformat.adopt import gym_folders
    from snapformat.gym_dir import check_folder

    t0 = time.perf_counter()
    folders = gym_folders(str(gym))
    for rel in folders:
        check_folder(gym / rel)
    out: dict[str, Any] = {"gym_folders": len(folders), "gym_check_s": time.perf_counter() - t0}
    if url:
        from snapformat.reader import open_snapshot
        from snapformat.verify import verify_snapshot

        t1 = time.perf_counter()
        try:
            report = verify_snapshot(open_snapshot(url))
        except Exception as exc:  # noqa: BLE001 - a snapshot its reader refuses is the measurement
            out |= {"snapshot_ok": False, "problems": [f"{type(exc).__name__}: {str(exc)[:300]}"]}
        else:
            out |= {"snapshot_ok": report.ok, "problems": [str(p)[:300] for p in report.problems][:5]}
        out["snapshot_verify_s"] = time.perf_counter() - t1
    return out


def _tree_size(folder: Path) -> tuple[int, int]:
    files, size = 0, 0
    stack = [folder]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    files += 1
                    size += e.stat(follow_symlinks=False).st_size
    return files, size


def child(step: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one step in this process; its seconds and its peak RSS."""
    gym = Path(args["gym"])
    t0 = time.perf_counter()
    if step == "write":
        detail = step_write(gym, args["n"], args["servers"])
    elif step == "adopt":
        detail = step_adopt(gym, args["store"], args["draft"])
    elif step == "read":
        detail = step_read(gym, args["n"], args["servers"])
    elif step == "verify":
        detail = step_verify(gym, args.get("url"))
    else:
        raise ValueError(f"unknown step {step!r}")
    seconds = time.perf_counter() - t0
    out = {"step": step, "n": args["n"], "seconds": seconds,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **detail}
    if step == "write":
        out["files"], out["bytes"] = _tree_size(gym)
    return out


def _spawn(step: str, args: dict[str, Any]) -> dict[str, Any]:
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.parked_bench", "--child", step, json.dumps(args)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"parked child {step} N={args['n']} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measured(step: str, args: dict[str, Any]) -> dict[str, Any]:
    """:func:`_spawn`, with the 1-minute load average before and after the step (the machine is shared)."""
    before = round(os.getloadavg()[0], 2)
    m = _spawn(step, args)
    return m | {"load_before": before, "load_after": round(os.getloadavg()[0], 2)}


def _baseline_rss() -> int:
    """Peak RSS of a child that imported what the steps import and did nothing else."""
    return _spawn("noop", {"n": 0, "gym": "/nonexistent"})["peak_rss"]


# -- the run --------------------------------------------------------------------------------------------------
def run_size(n: int, repeats: int, servers: int, work: Path, log: Log,
             rows_log: Path | None = None) -> list[dict[str, Any]]:
    """``repeats`` x (write, adopt, verify, read) of N parked rollouts; each repeat in a fresh store.
    Each step's row is also appended to ``rows_log`` (JSON lines) as soon as it is measured."""
    from snapformat.snapshot_store import SnapshotStore

    rows: list[dict[str, Any]] = []
    for rep in range(repeats):
        store_dir = work / f"store-{n}-{rep}"
        store = SnapshotStore(str(store_dir))
        draft = store.begin()
        gym = Path(draft.url) / "gym"
        args = {"n": n, "servers": servers, "gym": str(gym), "store": str(store_dir), "draft": draft.snapshot_id}
        try:
            for step in STEPS:
                m = _measured(step, args)
                if step == "adopt" and m.get("published"):
                    args["url"] = m["url"]
                m["repeat"] = rep
                rows.append(m)
                if rows_log is not None:
                    with open(rows_log, "a") as fh:
                        fh.write(json.dumps(m) + "\n")
                extra = (f", {m['files']:,} files, {m['bytes'] / MIB:,.0f} MiB" if step == "write" else
                         f", published={m.get('published')} {m.get('error', '')}" if step == "adopt" else "")
                log(f"parked N={n:,} repeat {rep + 1}/{repeats}: {step} {m['seconds']:.1f} s, peak RSS "
                    f"{m['peak_rss'] / MIB:,.0f} MiB{extra}")
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)
    return rows


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) against log(x); None with fewer than two points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def summarize(rows: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Medians per (step, N), and the log-log slopes of time and peak RSS against N per step."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for step in STEPS:
        for n in sizes:
            ms = [r for r in rows if r["step"] == step and r["n"] == n]
            if not ms:
                continue
            med = {"repeats": len(ms), "seconds": statistics.median(r["seconds"] for r in ms),
                   "peak_rss": statistics.median(r["peak_rss"] for r in ms)}
            for k in ("files", "bytes", "published", "error", "manifest_bytes", "manifest_files", "listed_parts", "gym_files",
                      "gym_file_bytes", "readable",
                      "read_error", "problems", "snapshot_ok", "agent_records",
                      "ledger_rows", "sessions", "gym_folders"):
                if k in ms[-1]:
                    med[k] = ms[-1][k]
            for k in ("agent_s", "ledger_s", "resources_s", "gym_check_s", "snapshot_verify_s", "adopt_s", "publish_s"):
                if k in ms[0]:
                    med[k] = statistics.median(r[k] for r in ms if k in r)
            table.setdefault(step, {})[str(n)] = med
    slopes = {}
    for step, by_n in table.items():
        ns = [int(k) for k in by_n]
        slopes[step] = {"time": loglog_slope(ns, [by_n[str(n)]["seconds"] for n in ns]),
                        "peak_rss": loglog_slope(ns, [by_n[str(n)]["peak_rss"] for n in ns])}
    return {"table": table, "slopes": slopes}


def run(sizes: list[int], repeats: dict[int, int] | int, servers: int, scratch: Path, results: Path | None,
        quick: bool, log: Log, rows_log: Path | None = None) -> dict[str, Any]:
    """Every size; returns the rows, the medians and the slopes (and writes the plot under ``results``)."""
    from benchmarks import common

    started = time.perf_counter()
    load_start = common.load_average()
    work, cleanup = common.work_folder(scratch, "parked")
    rows: list[dict[str, Any]] = []
    try:
        base = _baseline_rss()
        log(f"parked: a child with the library imported peaks at {base / MIB:.0f} MiB")
        log(f"parked: released Gym's TokenEntry accepted {validate_sample(sizes[0], servers)} sampled lineage rows")
        for n in sizes:
            reps = repeats if isinstance(repeats, int) else repeats.get(n, 1)
            rows += run_size(n, reps, servers, work, log, rows_log)
    finally:
        cleanup()
    result = {"quick": quick, "sizes": sizes, "servers": servers, "calls_per_rollout": CALLS,
              "baseline_rss": base, "rows": rows, **summarize(rows, sizes),
              "load_average": {"start": load_start, "end": common.load_average()},
              "elapsed_s": round(time.perf_counter() - started, 1), "plots": []}
    if results is not None:
        result["plots"].append(str(plot(result, results)))
    return result


def from_rows(paths: list[Path], servers: int, quick: bool, results: Path | None) -> dict[str, Any]:
    """The result of rows logged by earlier runs (``--rows-log``), e.g. of sizes run apart: the
    medians, the slopes, and the load average range the steps saw."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    sizes = sorted({r["n"] for r in rows})
    loads = [v for r in rows for v in (r.get("load_before"), r.get("load_after")) if v is not None]
    result = {"quick": quick, "sizes": sizes, "servers": servers, "calls_per_rollout": CALLS,
              "baseline_rss": _baseline_rss(), "rows": rows, **summarize(rows, sizes),
              "load_average": {"start": loads[0] if loads else None, "end": loads[-1] if loads else None,
                               "min": min(loads, default=None), "max": max(loads, default=None)},
              "elapsed_s": sum(r["seconds"] for r in rows), "plots": []}
    if results is not None:
        result["plots"].append(str(plot(result, results)))
    return result


def compare_markdown(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Before/after rows of the same size (one run of each at a time, alternating): per step the
    median seconds and peak RSS of each, and after/before."""
    lines = [("| step | N | repeats before / after | seconds before | after | after/before | peak RSS before (MiB) "
              "| after | after/before |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for step in STEPS:
        for n in sorted({r["n"] for r in before if r["step"] == step}):
            b = [r for r in before if r["step"] == step and r["n"] == n]
            a = [r for r in after if r["step"] == step and r["n"] == n]
            if not a:
                continue
            bs, as_ = statistics.median(r["seconds"] for r in b), statistics.median(r["seconds"] for r in a)
            bm, am = statistics.median(r["peak_rss"] for r in b), statistics.median(r["peak_rss"] for r in a)
            lines.append(f"| {step} | {n:,} | {len(b)} / {len(a)} | {bs:,.1f} | {as_:,.1f} | {as_ / bs:.2f} | "
                         f"{bm / MIB:,.0f} | {am / MIB:,.0f} | {am / bm:.2f} |")
    return "\n".join(lines)


def _fmt_slope(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def markdown(r: dict[str, Any]) -> str:
    """The report body: one table per step, then the slopes."""
    lines = [
        "# Parked rollouts: Gym's checkpoint files at 10k, 100k and 1M rollouts (issue 22 §2)",
        "",
        (f"N parked rollouts on {r['servers']} agent, {r['servers']} model and {r['servers']} resources servers "
        f"({r['calls_per_rollout']} model calls each: one lineage file of {r['calls_per_rollout']} rows, one "
        "boundary record, one continuation root, one storage reference and one resources session per rollout). "
        "Each step runs in a child process of its own; times are medians over the repeats, peak RSS is "
        f"`ru_maxrss` of that child (a child that only imports the library peaks at {r['baseline_rss'] / MIB:.0f} "
        f"MiB). Load average at start {r['load_average']['start']}, at end {r['load_average']['end']}"
        + (f" (1-minute load seen by the steps: {r['load_average']['min']} to {r['load_average']['max']}; the "
           "machine is shared)" if r["load_average"].get("min") is not None else "")
        + f"; the steps took {r['elapsed_s']:,.0f} s in all."),
        "",
        "| step | N | repeats | time (s) | s per 1k rollouts | peak RSS (MiB) | detail |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for step in STEPS:
        for n_text, m in r["table"].get(step, {}).items():
            n = int(n_text)
            if step == "write":
                detail = (f"{m['files']:,} files, {m['bytes'] / MIB:,.1f} MiB; agent {m['agent_s']:.1f} s, ledger "
                          f"{m['ledger_s']:.1f} s, resources {m['resources_s']:.1f} s")
            elif step == "adopt":
                detail = (f"published, manifest {m['manifest_bytes']:,} bytes, {m['manifest_files']:,} entries"
                          + (f" and {m['listed_parts']} listed parts" if m.get("listed_parts") else "")
                          if m.get("published") else f"**refused**: {m.get('error', '')[:200]}")
                if m.get("readable") is False:
                    detail += f"; **no reader opens it**: {m.get('read_error', '')[-120:]}"
            elif step == "read":
                detail = (f"{m['agent_records']:,} records, {m['ledger_rows']:,} ledger rows, {m['sessions']:,} "
                          f"sessions; agent {m['agent_s']:.1f} s, ledger {m['ledger_s']:.1f} s, resources "
                          f"{m['resources_s']:.1f} s")
            else:
                detail = f"{m['gym_folders']} Gym folders checked in {m['gym_check_s']:.1f} s"
                if m.get("snapshot_ok") is False and m.get("problems"):
                    detail += f"; snapshot verify refused: {m['problems'][0][-90:]}"
                elif "snapshot_ok" in m:
                    detail += f"; snapshot verify ok={m['snapshot_ok']} in {m['snapshot_verify_s']:.1f} s"
                else:
                    detail += "; no snapshot to verify (adopt was refused)"
            lines.append(f"| {step} | {n:,} | {m['repeats']} | {m['seconds']:,.2f} | {m['seconds'] / n * 1e3:.3f} | "
                         f"{m['peak_rss'] / MIB:,.0f} | {detail} |")
    lines += ["", "| step | log-log slope of time vs N (1.0 = linear) | of peak RSS vs N (0 = bounded) |",
              "|---|---:|---:|"]
    for step, s in r["slopes"].items():
        lines.append(f"| {step} | {_fmt_slope(s['time'])} | {_fmt_slope(s['peak_rss'])} |")
    return "\n".join(lines)


def plot(r: dict[str, Any], results: Path) -> Path:
    from benchmarks import common

    series = []
    styles = {"write": "o-", "adopt": "s-", "read": "^-", "verify": "d-"}
    for step in STEPS:
        by_n = r["table"].get(step, {})
        ns = [int(k) for k in by_n]
        series.append((f"{step}: seconds", ns, [by_n[str(n)]["seconds"] for n in ns], styles[step]))
        series.append((f"{step}: peak RSS (GiB)", ns, [by_n[str(n)]["peak_rss"] / (1 << 30) for n in ns],
                       styles[step].replace("-", ":")))
    return common.plot(results / common.png_name("parked", r["quick"]),
                       "Parked rollouts: time and peak RSS per step vs rollouts", "parked rollouts", "s / GiB",
                       series)


#: The parked section's scratch folder: the 1M run writes ~9 GiB in ~2M files, kept off the repository's disk
#: folder and removed afterwards.
SCRATCH = Path("/tmp/parked-bench")


def section(opts: argparse.Namespace, log: Log) -> tuple[str, dict[str, Any]]:
    """``python -m benchmarks.run --section parked``: 10k and 100k (medians of 5), 1M (1 repeat); with
    ``--quick``, 1k and 10k with ``--repeats`` each. Scratch under :data:`SCRATCH`."""
    sizes = list(QUICK_SIZES if opts.quick else FULL_SIZES)
    repeats: dict[int, int] | int = opts.repeats if opts.quick else REPEATS
    result = run(sizes, repeats, SERVERS, SCRATCH, opts.results, opts.quick, log)
    return markdown(result), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parked_bench")
    p.add_argument("--child", nargs=2, metavar=("STEP", "ARGS_JSON"), help="run one step here, print JSON")
    p.add_argument("--sizes", type=int, nargs="+", default=list(FULL_SIZES))
    p.add_argument("--repeats", type=int, default=None, help="repeats per size (default: 5, 5, 1)")
    p.add_argument("--servers", type=int, default=SERVERS)
    p.add_argument("--scratch", type=Path, default=Path("/tmp/parked-bench"))
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--rows-log", type=Path, default=None, help="append each step's row here as it is measured")
    p.add_argument("--from-rows", type=Path, nargs="+", default=None,
                   help="no run: report the rows these --rows-log files hold")
    p.add_argument("--results", type=Path, default=None, help="with --from-rows: write parked.md and the plot here")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="no run: the before/after table of two --rows-log files")
    opts = p.parse_args(argv)
    if opts.child:
        step, args = opts.child[0], json.loads(opts.child[1])
        if step == "noop":
            import gymkit.agent_control  # noqa: F401 - what every step imports
            import refgym.model_server  # noqa: F401
            import snapformat.adopt  # noqa: F401

            print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
            return 0
        print(json.dumps(child(step, args)), flush=True)
        return 0

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if opts.compare:
        before, after = ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                         for path in opts.compare)
        print(compare_markdown(before, after))
        return 0
    if opts.from_rows:
        from benchmarks.run import _machine_markdown, machine_info

        result = from_rows(opts.from_rows, opts.servers, False, opts.results)
        result["machine"] = machine_info(SCRATCH)
        head, _, rest = markdown(result).partition("\n\n")
        command = "python -m benchmarks.parked_bench " + " ".join(argv if argv is not None else sys.argv[1:])
        text = f"{head}\n\n{_machine_markdown(result['machine'], command)}\n\n{rest}"
        if opts.results is not None:
            (opts.results / "parked.md").write_text(text + "\n")
            (opts.results / "parked.json").write_text(json.dumps(result, indent=2) + "\n")
        print(text)
        return 0
    repeats: dict[int, int] | int = REPEATS if opts.repeats is None else opts.repeats
    result = run(opts.sizes, repeats, opts.servers, opts.scratch, None, False, say, opts.rows_log)
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
