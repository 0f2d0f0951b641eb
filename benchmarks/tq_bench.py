"""The TQ benchmark (issue 6): TransferQueue's rows saved and loaded through the coordinator's TQ
adapter (``coordinator.tq_adapter.TQDataPlane``) against TransferQueue's own
``tq.save_checkpoint(dir)`` / ``tq.load_checkpoint(dir)`` of the same rows, on the same TQ.

    python -m benchmarks.run --section tq            # 10,000 and 100,000 rows -> benchmarks/results/tq.md
    python -m benchmarks.run --section tq --quick    # 1,000 and 10,000 rows, one repeat

One Ray + TQ (``coordinator.ray_runtime.start``: 2 CPUs, one SimpleStorage unit, loopback) serves
the whole section. For each row count and layout TQ is cleared and filled (not timed) with training
rows through the adapter's ``put`` (TQ's ``kv_batch_put``), :data:`PUT_BATCH` rows per call:
``input_ids`` int32 and ``generation_logprobs`` float32 of :data:`ROW_TOKENS` tokens per row
(*dense*: one ``[n, L]`` tensor per put; *ragged*: jagged tensors, lengths uniform in [L/2, 3L/2)),
and ``input_lengths`` int32. Then, per repeat (the two methods' order alternating):

* *ours, save*: ``deferred_cut()`` (the pause's share: TQ's listing) + ``materialize()`` (every
  value read with ``kv_batch_get``, built into one Arrow table) + ``SnapshotStore.begin()`` +
  ``write_cut`` into the draft's ``tq`` part (row checks, xxh3-128, fsync) + ``publish()``.
* *TQ, save*: ``tq.save_checkpoint(dir)`` (TQ pickles its controller state and each storage unit's
  per-row values; no fsync).
* *ours, load*: TQ cleared, then ``SnapshotStore(path).latest()`` + ``TQDataPlane.load(snap, "tq")``
  (checksums verified, rows put back with ``kv_batch_put``).
* *TQ, load*: TQ cleared, then ``tq.load_checkpoint(dir)``.

After every load the row count and the values of a sample of rows are checked against what was put.
Loads read files just written (page cache warm, not dropped).
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.common import GIB, MIB, Log

PARTITION = "bench"
ROW_TOKENS = 256  # mean tokens per row: 2 KiB of int32 + float32 values per row
#: Rows per ``kv_batch_put``. TransferQueue keeps each row of a dense put as a view of the put's
#: whole tensor and its checkpoint pickles that whole storage once per row, so its checkpoint of a
#: dense column is PUT_BATCH x the values (it grows with the square of the batch); the batch is
#: capped so that 100,000 rows stay a few GB on disk.
PUT_BATCH = 16
SAMPLE_ROWS = 8  # rows whose values are compared after every load
LAYOUTS = ("dense", "ragged")
SAVE, LOAD = "save", "load"
OURS, THEIRS = "ours", "tq"

FULL = {"rows": (10_000, 100_000), "repeats": {10_000: 2, 100_000: 1}, "sweep_rows": 2_000,
        "sweep_batches": (16, 64, 256)}
QUICK = {"rows": (1_000, 10_000), "repeats": {}, "sweep_rows": 1_000, "sweep_batches": (16, 64)}
SMALLEST = {"rows": (64,), "repeats": {}, "sweep_rows": 32, "sweep_batches": (16,)}
#: Not run: extrapolated from the 100,000-row run (each phase is linear in rows; see the report).
SKIPPED_ROWS = 1_000_000
TARGET_SPEEDUP = 20.0
TARGET_SIZE = 1.1


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _fill(plane, rows: int, layout: str, seed: int, log: Log, batch: int = PUT_BATCH) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    raw = 0
    sample: list[dict[str, np.ndarray]] = []
    sample_keys: list[str] = []
    t0 = time.perf_counter()
    last = t0
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        b = common.row_batch(rng, start, n, layout, ROW_TOKENS)
        plane.put(PARTITION, b.keys, b.fields, b.tags)
        raw += b.raw_bytes
        if len(sample) < SAMPLE_ROWS:
            take = min(n, SAMPLE_ROWS - len(sample))
            sample += [common.row_values(b, i) for i in range(take)]
            sample_keys += b.keys[:take]
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            log(f"tq: filling {layout} {rows:,} rows: {start + n:,} put ({last - t0:.0f} s)")
    fill_s = time.perf_counter() - t0
    return {"raw_bytes": raw, "fill_s": fill_s, "sample": sample, "sample_keys": sample_keys}


def _check(rows: int, fill: dict[str, Any]) -> bool:
    import transfer_queue as tq

    listed = tq.kv_list().get(PARTITION, {})
    if len(listed) != rows:
        return False
    got = common.tq_row_values(PARTITION, fill["sample_keys"], list(fill["sample"][0]))
    return common.same_rows(fill["sample"], got)


def measure(rows: int, layout: str, repeats: int, work: Path, log: Log, batch: int = PUT_BATCH) -> dict[str, Any]:
    """One (rows, layout): TQ cleared and filled, then every repeat of the four operations."""
    import transfer_queue as tq

    from coordinator.data_plane import write_cut
    from coordinator.tq_adapter import TQDataPlane
    from snapformat import SnapshotStore

    plane = TQDataPlane()  # a fresh adapter (its write-once record empty) for each measurement
    plane.clear()
    gc.collect()
    fill = _fill(plane, rows, layout, seed=rows + len(layout), log=log, batch=batch)
    log(f"tq: {layout} {rows:,} rows in TQ: {fill['raw_bytes'] / MIB:.1f} MiB of values, put in "
        f"{fill['fill_s']:.1f} s ({fill['raw_bytes'] / MIB / fill['fill_s']:.1f} MiB/s, {batch} rows per put, "
        "not timed)")
    probe = common.MethodTimer(plane, ("_read_partition", "_make_cut", "restore_partitions"))
    times: dict[str, list[float]] = {f"{m} {p}": [] for m in (OURS, THEIRS) for p in (SAVE, LOAD)}
    parts: dict[str, list[float]] = {k: [] for k in ("listing", "tq_reads", "arrow_build", "write", "publish",
                                                      "snapshot_read", "tq_puts")}
    sizes: dict[str, int] = {}
    checks: list[str] = []
    for rep in range(repeats):
        store_root = work / f"store-{layout}-{rows}-{rep}"
        ck = work / f"tqck-{layout}-{rows}-{rep}"
        store = SnapshotStore(str(store_root))
        store.begin().abandon()  # creates the store's marker (untimed)

        def ours_save() -> None:
            probe.take()
            gc.collect()
            t0 = time.perf_counter()
            deferred = plane.deferred_cut()
            t1 = time.perf_counter()
            cut = deferred.materialize()
            t2 = time.perf_counter()
            draft = store.begin()
            write_cut(cut, draft.part("tq", writer="tq"))
            t3 = time.perf_counter()
            published = draft.publish()
            t4 = time.perf_counter()
            inside = probe.take()
            times[f"{OURS} {SAVE}"].append(t4 - t0)
            parts["listing"].append(t1 - t0)
            parts["tq_reads"].append(inside.get("_read_partition", 0.0))
            parts["arrow_build"].append(inside.get("_make_cut", 0.0))
            parts["write"].append(t3 - t2)
            parts["publish"].append(t4 - t3)
            files = common.snapshot_files(store_root, published.manifest.snapshot_id, published.manifest.sequence)
            sizes["ours"] = sum(p.stat().st_size for p in files)
            sizes["ours_rows_file"] = sum(f.size for f in published.manifest.files if f.kind == "training_rows")
            del cut
            log(f"tq: {layout} {rows:,} rows, repeat {rep + 1}/{repeats}: ours save {t4 - t0:.2f} s "
                f"(listing {t1 - t0:.3f}, TQ reads {inside.get('_read_partition', 0):.2f}, Arrow "
                f"{inside.get('_make_cut', 0):.2f}, write {t3 - t2:.2f}, publish {t4 - t3:.3f}); "
                f"{sizes['ours'] / MIB:.1f} MiB")

        def theirs_save() -> None:
            gc.collect()
            dt, _ = _timed(lambda: tq.save_checkpoint(str(ck)))
            times[f"{THEIRS} {SAVE}"].append(dt)
            sizes["tq"] = common.tree_bytes(ck)
            log(f"tq: {layout} {rows:,} rows, repeat {rep + 1}/{repeats}: tq.save_checkpoint {dt:.2f} s; "
                f"{sizes['tq'] / MIB:.1f} MiB")

        def ours_load() -> None:
            plane.clear()
            gc.collect()
            probe.take()
            t0 = time.perf_counter()
            snap = SnapshotStore(str(store_root)).latest()
            assert snap is not None
            plane.load(snap, "tq")
            dt = time.perf_counter() - t0
            inside = probe.take()
            times[f"{OURS} {LOAD}"].append(dt)
            parts["tq_puts"].append(inside.get("restore_partitions", 0.0))
            parts["snapshot_read"].append(dt - inside.get("restore_partitions", 0.0))
            ok = _check(rows, fill)
            if not ok:
                raise AssertionError(f"{layout} {rows} rows: TQ does not hold the rows after the adapter's load")
            log(f"tq: {layout} {rows:,} rows, repeat {rep + 1}/{repeats}: ours load {dt:.2f} s "
                f"(of which TQ puts {inside.get('restore_partitions', 0):.2f})")

        def theirs_load() -> None:
            plane.clear()
            gc.collect()
            dt, _ = _timed(lambda: tq.load_checkpoint(str(ck)))
            times[f"{THEIRS} {LOAD}"].append(dt)
            if not _check(rows, fill):
                raise AssertionError(f"{layout} {rows} rows: TQ does not hold the rows after tq.load_checkpoint")
            log(f"tq: {layout} {rows:,} rows, repeat {rep + 1}/{repeats}: tq.load_checkpoint {dt:.2f} s")

        order = [(ours_save, theirs_save), (ours_load, theirs_load)]
        for a, b in order:
            for fn in ((a, b) if rep % 2 == 0 else (b, a)):
                fn()
        shutil.rmtree(store_root, ignore_errors=True)
        shutil.rmtree(ck, ignore_errors=True)
    checks.append(f"after every load TQ listed {rows:,} keys and the values of {len(fill['sample'])} sampled rows "
                  "equal what was put")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rows": rows, "layout": layout, "repeats": repeats, "put_batch": batch, "raw_bytes": fill["raw_bytes"],
        "fill_s": round(fill["fill_s"], 3), "times_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "parts_median_s": {k: round(statistics.median(v), 4) for k, v in parts.items() if v},
        "bytes": {"ours": sizes["ours"], "ours_rows_file": sizes["ours_rows_file"], "tq": sizes["tq"],
                  "raw": fill["raw_bytes"]},
        "speedup": {SAVE: round(med[f"{THEIRS} {SAVE}"] / med[f"{OURS} {SAVE}"], 3),
                    LOAD: round(med[f"{THEIRS} {LOAD}"] / med[f"{OURS} {LOAD}"], 3)},
        "size_vs_raw": {"ours": round(sizes["ours"] / fill["raw_bytes"], 4),
                        "tq": round(sizes["tq"] / fill["raw_bytes"], 4)},
        "checks": checks,
    }


def run(config: dict[str, Any], quick: bool, scratch: Path, results: Path | None, log: Log) -> dict[str, Any]:
    """Every (rows, layout) of ``config``; writes the plot into ``results`` (when given)."""
    from benchmarks.common import tq_runtime

    started = time.perf_counter()
    load_start = common.load_average()
    tq_runtime(log)
    from coordinator.tq_adapter import TQDataPlane

    plane = TQDataPlane()
    work, cleanup = common.work_folder(scratch, "tq")
    out = []
    sweep = []
    try:
        for rows in config["rows"]:
            for layout in LAYOUTS:
                reps = config["repeats"].get(rows, 1)
                out.append(measure(rows, layout, reps, work, log))
        for batch in config["sweep_batches"]:
            m = measure(config["sweep_rows"], "dense", 1, work, lambda _msg: None, batch=batch)
            sweep.append(m)
            log(f"tq: batch sweep, dense {config['sweep_rows']:,} rows put {batch} per call: TQ checkpoint "
                f"{m['bytes']['tq'] / MIB:.0f} MiB ({m['size_vs_raw']['tq']:.1f}x the values), save tq/ours "
                f"{m['speedup'][SAVE]:.2f}x, load tq/ours {m['speedup'][LOAD]:.2f}x")
    finally:
        try:
            plane.clear()
        finally:
            cleanup()
    result = {
        "quick": quick, "rows": list(config["rows"]), "layouts": list(LAYOUTS), "row_tokens": ROW_TOKENS,
        "put_batch": PUT_BATCH, "partition": PARTITION, "measured": out, "sweep": sweep,
        "sweep_rows": config["sweep_rows"],
        "skipped": None if quick or SKIPPED_ROWS in config["rows"] else SKIPPED_ROWS,
        "targets": {"speedup": TARGET_SPEEDUP, "size_vs_raw": TARGET_SIZE},
        "transferqueue": _tq_version(),
        "load_average": {"start": load_start, "end": common.load_average()},
        "elapsed_s": round(time.perf_counter() - started, 1), "plots": [],
    }
    result["summary"] = summary(result)
    if results is not None:
        result["plots"].append(str(plot(result, results)))
    return result


def _tq_version() -> str:
    try:
        from importlib.metadata import version

        return version("transferqueue")
    except Exception:
        return "unknown"


def plot(result: dict[str, Any], results: Path) -> Path:
    series = []
    rows = result["rows"]
    styles = {("dense", SAVE): "o-", ("dense", LOAD): "s-", ("ragged", SAVE): "o--", ("ragged", LOAD): "s--"}
    for layout in LAYOUTS:
        for phase in (SAVE, LOAD):
            ys = [next((m["speedup"][phase] for m in result["measured"] if m["rows"] == r and m["layout"] == layout),
                       None) for r in rows]
            series.append((f"{layout}, {phase}: tq time / ours", rows, ys, styles[(layout, phase)]))
    return common.plot(results / common.png_name("tq_vs_checkpoint", result["quick"]),
                       "TQ adapter vs tq.save_checkpoint / load_checkpoint (higher: ours faster)",
                       "rows in TQ", "TQ's time / ours (x)", series, xticks=rows,
                       xticklabels=[f"{r:,}" for r in rows],
                       hlines=[(TARGET_SPEEDUP, f"target {TARGET_SPEEDUP:.0f}x"), (1.0, "equal")],
                       note=f"{ROW_TOKENS} tokens/row (int32 + float32), {PUT_BATCH} rows per kv_batch_put")


def summary(r: dict[str, Any]) -> list[str]:
    out = []
    ms = r["measured"]
    for phase in (SAVE, LOAD):
        vals = [(m["speedup"][phase], m) for m in ms]
        lo = min(vals, key=lambda v: v[0])
        hi = max(vals, key=lambda v: v[0])
        met = all(v >= TARGET_SPEEDUP for v, _ in vals)
        out.append(f"{phase.capitalize()}: the adapter is {lo[0]:.2f}x ({lo[1]['layout']}, {lo[1]['rows']:,} rows) to "
                   f"{hi[0]:.2f}x ({hi[1]['layout']}, {hi[1]['rows']:,} rows) as fast as TransferQueue's own "
                   f"checkpoint ({'meets' if met else 'MISSES'} the >= {TARGET_SPEEDUP:.0f}x target"
                   f"{'' if met else ' in ' + str(sum(v < TARGET_SPEEDUP for v, _ in vals)) + ' of ' + str(len(vals)) + ' rows'}).")
    own = []
    for m in ms:
        p = m["parts_median_s"]
        snap_save = sum(p.get(k, 0.0) for k in ("listing", "arrow_build", "write", "publish"))
        own.append((m["median_s"][f"{THEIRS} {SAVE}"] / snap_save if snap_save else None, m,
                    m["median_s"][f"{OURS} {SAVE}"] and p.get("tq_reads", 0.0) / m["median_s"][f"{OURS} {SAVE}"]))
    big = [o for o in own if o[1]["rows"] == max(r["rows"]) and o[0] is not None]
    if big:
        out.append("Without TransferQueue's own reads (`kv_batch_get`: " + ", ".join(
            f"{share:.0%} of the adapter's save, {m['layout']}" for _, m, share in big) + f", {max(r['rows']):,} rows), the "
            "snapshot's side of the save (listing, Arrow build, write, publish) is " + ", ".join(
            f"{x:.0f}x ({m['layout']})" for x, m, _ in big) + " as fast as TransferQueue's checkpoint.")
    sizes = [m["size_vs_raw"]["ours"] for m in ms]
    met = all(s <= TARGET_SIZE for s in sizes)
    theirs = [m["size_vs_raw"]["tq"] for m in ms]
    out.append(f"Bytes on disk: the snapshot is {min(sizes):.3f}x-{max(sizes):.3f}x the raw values "
               f"({'meets' if met else 'MISSES'} the <= {TARGET_SIZE}x target); TransferQueue's checkpoint "
               f"{min(theirs):.2f}x-{max(theirs):.2f}x.")
    return out


def markdown(r: dict[str, Any]) -> str:
    head = ("| rows | layout | values (raw) | ours: save s | tq: save s | save: tq / ours | ours: load s | tq: load s | "
            "load: tq / ours | ours on disk | tq on disk | ours / raw | tq / raw |")
    lines = [
        "# TQ benchmark: the coordinator's TQ adapter vs TransferQueue's own checkpoint",
        "",
        f"TransferQueue {r['transferqueue']} (SimpleStorage, one storage unit) on a local Ray (2 CPUs, loopback), "
        f"started once for the section. Training rows in partition `{r['partition']}`: `input_ids` int32 and "
        f"`generation_logprobs` float32 of {r['row_tokens']} tokens per row (dense: `[n, {r['row_tokens']}]` "
        f"tensors; ragged: jagged, {r['row_tokens'] // 2}-{r['row_tokens'] * 3 // 2 - 1} tokens), plus "
        f"`input_lengths` int32; tags `rollout_id`, `attempt_index`. TQ is filled through the adapter's `put` "
        f"(`kv_batch_put`), **{r['put_batch']} rows per call** (see the notes: TQ's checkpoint of a dense column "
        f"grows with the square of that batch). Median of the repeats; whole run {r['elapsed_s']:.0f} s"
        f"{' (quick run)' if r['quick'] else ''}; load average {r['load_average']['start']} at start, "
        f"{r['load_average']['end']} at the end.",
        "",
        "## Time and bytes (same rows, same TQ)",
        "",
        head,
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in r["measured"]:
        med, b = m["median_s"], m["bytes"]
        lines.append(
            f"| {m['rows']:,} | {m['layout']} | {b['raw'] / MIB:.1f} MiB | {common.secs(med['ours save'])} | "
            f"{common.secs(med['tq save'])} | **{m['speedup'][SAVE]:.2f}x** | {common.secs(med['ours load'])} | "
            f"{common.secs(med['tq load'])} | **{m['speedup'][LOAD]:.2f}x** | {b['ours'] / MIB:.1f} MiB | "
            f"{_big(b['tq'])} | **{m['size_vs_raw']['ours']:.3f}x** | {m['size_vs_raw']['tq']:.2f}x |")
    lines += ["", "## Where the adapter's time goes (median s)", "",
              "| rows | layout | repeats | save: listing (the pause's share) | save: TQ reads (`kv_batch_get`) | "
              "save: Arrow build | save: write (checks, xxh3, fsync) | save: publish | load: read snapshot + parse | "
              "load: TQ puts (`kv_batch_put`) | fill: `kv_batch_put` (not timed) |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in r["measured"]:
        p = m["parts_median_s"]
        lines.append(f"| {m['rows']:,} | {m['layout']} | {m['repeats']} | {common.secs(p.get('listing'))} | "
                     f"{common.secs(p.get('tq_reads'))} | {common.secs(p.get('arrow_build'))} | "
                     f"{common.secs(p.get('write'))} | {common.secs(p.get('publish'))} | "
                     f"{common.secs(p.get('snapshot_read'))} | {common.secs(p.get('tq_puts'))} | "
                     f"{common.secs(m['fill_s'])} |")
    if r["sweep"]:
        lines += ["", f"## TQ's checkpoint against its put batch (dense, {r['sweep_rows']:,} rows, one run each)", "",
                  "| rows per `kv_batch_put` | tq on disk | tq / raw | tq: save s | ours: save s | save: tq / ours | "
                  "tq: load s | ours: load s | load: tq / ours |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in r["sweep"]:
            med = m["median_s"]
            lines.append(f"| {m['put_batch']} | {_big(m['bytes']['tq'])} | {m['size_vs_raw']['tq']:.1f}x | "
                         f"{common.secs(med['tq save'])} | {common.secs(med['ours save'])} | {m['speedup'][SAVE]:.2f}x | "
                         f"{common.secs(med['tq load'])} | {common.secs(med['ours load'])} | {m['speedup'][LOAD]:.2f}x |")
        lines += ["", "TransferQueue's checkpoint of a dense column grows linearly with the put batch (so with its square "
                  "when the batch is the whole data); the adapter's snapshot does not depend on it."]
    lines += [""] + [f"**{s}**  " for s in r["summary"]]
    if r["skipped"]:
        big = [m for m in r["measured"] if m["rows"] == max(r["rows"])]
        est = sum(m["fill_s"] + sum(m["median_s"].values()) for m in big) * r["skipped"] / max(r["rows"])
        tq_disk = sum(m["bytes"]["tq"] for m in big) * r["skipped"] / max(r["rows"])
        lines += ["", f"**{r['skipped']:,} rows: not run.** Every phase above is linear in the number of rows (TQ's "
                  f"per-row work dominates both methods), so one pass over both layouts would take about "
                  f"{est / 60:.0f} min (fill + one save and load of each method, extrapolated from "
                  f"{max(r['rows']):,} rows) and TQ's checkpoints would need about {tq_disk / GIB:.0f} GiB of disk: "
                  f"well beyond the section's 10-minute bound on this 2-core machine."]
    lines += [
        "",
        "Notes:",
        "- **tq / ours** = TransferQueue's median time / the adapter's: above 1.00x the adapter is faster. "
        "**on disk**: every file of the snapshot (rows file, part manifest, manifest, commit record) / every file "
        "of TQ's checkpoint folder. **raw** = the values' own bytes (int32 and float32 elements: 8 bytes per token "
        "+ 4 for `input_lengths`), no keys, tags or offsets.",
        "- Ours, save = `deferred_cut()` (TQ's listing: what the pause holds) + `materialize()` (`kv_batch_get` of "
        "every key, values built into one Arrow table) + `SnapshotStore.begin()` + `write_cut(...)` into the draft's "
        "`tq` part (row checks, xxh3-128, fsync) + `publish()` (part manifest, manifest, commit record, fsyncs). "
        "TQ, save = `tq.save_checkpoint(dir)`: pickles the controller's state and the storage unit's per-row values "
        "(`su_*.pkl`), renames the folder into place; it does not fsync.",
        "- Ours, load = TQ cleared, then `SnapshotStore(path).latest()` + `TQDataPlane.load(snap, \"tq\")` "
        "(checksum verified, rows parsed, put back with `kv_batch_put`). TQ, load = TQ cleared, then "
        "`tq.load_checkpoint(dir)` (the storage unit unpickles its file, the controller its state). Both read "
        "files just written: page cache warm.",
        f"- TQ's checkpoint of a **dense** column is about {r['put_batch']}x the values: each row TQ holds is a view "
        "of the whole tensor of the put it came with, and pickling a row pickles that whole storage. With N rows "
        "put in batches of B it writes about N x B rows' worth of values (the square of the batch when N = B): "
        f"the benchmark caps B at {r['put_batch']} so the 100,000-row run stays a few GB; a larger batch makes TQ's "
        "checkpoint (and its time) proportionally larger, the adapter's unchanged. Ragged (jagged) rows are copied "
        "per row and weigh about the values plus pickle's per-tensor overhead.",
        "- Both methods spend most of their time in TransferQueue's own per-row data path: the adapter's save is "
        "mostly `kv_batch_get` and its load mostly `kv_batch_put` (table above), each a few tens of MB/s here "
        "(ZMQ round trips and per-row dictionaries in the storage unit), against which the snapshot's own write "
        "and read are small.",
    ]
    for m in r["measured"]:
        for c in m["checks"]:
            lines.append(f"- Check ({m['layout']}, {m['rows']:,} rows): {c}.")
            break
    return "\n".join(lines) + "\n"


def _big(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def config_for(quick: bool) -> dict[str, Any]:
    return QUICK if quick else FULL

