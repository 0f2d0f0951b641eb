"""The memory benchmark (issue 6): peak resident memory of saving and loading Arrow rows through
snapformat, against the bytes saved: bounded (flat) or proportional?

    python -m benchmarks.run --section memory           # 100 MiB, 500 MiB, 1 GiB
    python -m benchmarks.run --section memory --quick   # 32 MiB, 128 MiB

Every measurement runs in a child process of its own (``python -m benchmarks.memory_bench --child
...``), so one's memory never shows in another's. The child samples its own ``/proc/self/status``
every :data:`SAMPLE_S` in a thread (VmRSS, RssAnon: memory the process owns, RssFile: pages of
mapped files, which belong to the page cache) and also reports ``getrusage`` ``ru_maxrss``.

* **save, streamed**: token-capture rows (``snapformat.example``) given to
  ``part.write_rows(...)`` as a generator of record batches (a fixed set of at most
  :data:`BASE_BYTES` of batches, yielded again and again until the size is reached), then
  ``publish()``; the rows are never all in memory, so the peak is the library's own.
* **save, rows held**: the same size of distinct rows built in memory first (as a cut holds them),
  then written and published; reported as the peak above the memory held before the save began.
* **TQ rows, cut whole** and **TQ rows, window by window**: training rows held as the TQ adapter keeps
  what it puts (:class:`coordinator.dataplane.tq.capture.RowCapture`, segments of
  :data:`CUT_SEGMENT_ROWS` rows: ragged ``input_ids`` and ``generation_logprobs``, ``input_lengths``)
  and a cut's plan of them (the listing: keys and tags), then written into a draft and published:
  *whole* materializes the cut (every row assembled, one Arrow table) and writes it, as a coordinator
  save did before; *window by window* is what a save does now (``plan_source`` + ``write_sources``:
  one window of rows built, written, dropped). Both report the peak above the capture and the
  listing, held before.
* **load, read_table**: ``SnapshotStore(path).latest().read_table("tokens", verify=True)`` (memory
  mapped), then every buffer hashed (xxh3-64) so every page is really read.
* **load, batch by batch**: ``snap.open_rows(entry, verify=True)``, then each record batch read,
  hashed and dropped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import GIB, MIB, Log

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.005
BASE_BYTES = 32 * MIB
PART = "gym/model/policy0"
NAME = "tokens.arrow"
OPS = ("save_stream", "save_held", "cut_whole", "cut_stream", "load_mmap", "load_stream")
LABELS = {"save_stream": "save, streamed (write_rows from a generator + publish)",
          "save_held": "save, rows held in memory first (peak above them)",
          "cut_whole": "TQ rows kept by the adapter: cut materialized whole, then written",
          "cut_stream": "TQ rows kept by the adapter: written window by window (a save now)",
          "load_mmap": "load, read_table(verify=True) + every buffer read",
          "load_stream": "load, batch by batch (open_rows + each batch read, dropped)"}
FULL = {"sizes": (100 * MIB, 500 * MIB, GIB)}
QUICK = {"sizes": (32 * MIB, 128 * MIB)}
SMALLEST = {"sizes": (4 * MIB, 16 * MIB)}
CUT_SEGMENT_ROWS = 4096  # the capture merges small puts into segments of this many rows
BOUNDED_SLOPE = 0.05  # at most this many bytes of memory per byte saved counts as bounded


# --------------------------------------------------------------------------------------------
# The child


class Sampler:
    """Peak VmRSS / RssAnon / RssFile of this process, sampled in a thread."""

    def __init__(self) -> None:
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(line.split()[1]) * 1024
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, v in self.now().items():
                if v > self.peak[k]:
                    self.peak[k] = v
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for k, v in self.now().items():
            self.peak[k] = max(self.peak[k], v)


def _base_batches(limit: int) -> list:
    from benchmarks.format_bench import build_rows

    return build_rows(min(limit, BASE_BYTES)).batches


def _repeat(batches: list, target: int) -> Iterator:
    """The same batches again and again until ``target`` bytes were yielded (nothing new is held)."""
    sent = 0
    while sent < target:
        for b in batches:
            yield b
            sent += b.nbytes
            if sent >= target:
                return


def _captured(size: int) -> tuple[Any, list]:
    """About ``size`` bytes of training rows as the TQ adapter keeps them, and a cut's plan of them."""
    import numpy as np

    from coordinator.dataplane import FieldData, FieldSpec
    from coordinator.dataplane.tq.capture import RowCapture

    rng = np.random.default_rng(7)
    cap = RowCapture(max_bytes=1 << 62)
    ragged_i = FieldSpec("tensor", "int32", 1, (), True)
    ragged_f = FieldSpec("tensor", "float32", 1, (), True)
    scalar = FieldSpec("tensor", "int32", 0)
    listing: dict[str, dict[str, Any]] = {}
    n = 0
    while cap.nbytes < size:
        lengths = rng.integers(128, 384, CUT_SEGMENT_ROWS)
        offsets = np.zeros(CUT_SEGMENT_ROWS + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        keys = [f"k{n + i}" for i in range(CUT_SEGMENT_ROWS)]
        cap.add("bench", keys, {"input_ids": ragged_i, "generation_logprobs": ragged_f, "input_lengths": scalar}, {
            "input_ids": FieldData(rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32), offsets),
            "generation_logprobs": FieldData(rng.random(int(offsets[-1]), dtype=np.float32), offsets.copy()),
            "input_lengths": FieldData(lengths.astype(np.int32))})
        listing.update({k: {"rollout_id": f"r{(n + i) // 8}", "attempt_index": 0} for i, k in enumerate(keys)})
        n += CUT_SEGMENT_ROWS
    return cap, cap.resolve({"bench": listing})


def _write_cut(op: str, plans: list, draft) -> Any:
    from coordinator.dataplane import TRAINING, RowTable, whole_source, write_sources
    from coordinator.dataplane.tq.capture import assemble, plan_source
    from coordinator.dataplane.writer import write_tables

    part = draft.part("tq", writer="tq")
    if op == "cut_stream":
        return write_sources({TRAINING: [plan_source(p, i) for i, p in enumerate(plans)]}, part).entries[0]
    table = RowTable.of(TRAINING, [whole_source(assemble(p), i) for i, p in enumerate(plans)]).built()
    return write_tables([table], part).entries[0]


def child(op: str, size: int, store: str) -> dict[str, Any]:
    import pyarrow as pa  # noqa: F401  (imported before the baseline, like the library)
    import xxhash

    from snapformat import SnapshotStore

    held: Any = None
    if op == "save_held":
        from benchmarks.format_bench import build_rows

        held = build_rows(size).batches
    elif op == "save_stream":
        held = _base_batches(size)
    elif op in ("cut_whole", "cut_stream"):
        capture, plans = _captured(size)
    gc.collect()
    before = Sampler.now()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with Sampler() as s:
        if op in ("save_stream", "save_held"):
            ss = SnapshotStore(store)
            draft = ss.begin()
            data = _repeat(held, size) if op == "save_stream" else held
            entry = draft.part(PART, writer="model:policy0").write_rows(NAME, "token_capture_rows", data)
            draft.publish()
            out["file_bytes"] = entry.size
            out["rows"] = entry.records
        elif op in ("cut_whole", "cut_stream"):
            draft = SnapshotStore(store).begin()
            entry = _write_cut(op, plans, draft)
            draft.publish()
            out["file_bytes"] = entry.size
            out["rows"] = entry.records
        elif op == "load_mmap":
            snap = SnapshotStore(store).latest()
            table = snap.read_table("tokens", verify=True)
            from benchmarks.format_bench import touch_table

            out["touched_bytes"] = touch_table(table)
            out["rows"] = table.num_rows
            del table
        elif op == "load_stream":
            snap = SnapshotStore(store).latest()
            entry = snap.select("tokens")[0]
            reader = snap.open_rows(entry, verify=True)
            rows = touched = 0
            h = xxhash.xxh3_64()
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                for col in batch.columns:
                    for buf in col.buffers():
                        if buf is not None:
                            h.update(buf)
                            touched += buf.size
                rows += batch.num_rows
                del batch
            out["touched_bytes"] = touched
            out["rows"] = rows
        elif op != "baseline":
            raise ValueError(f"unknown op {op!r}")
    out.update({"op": op, "size": size, "seconds": round(time.perf_counter() - t0, 3), "before": before,
                "peak": s.peak, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "held_bytes": (sum(b.nbytes for b in held) if held is not None
                               else capture.nbytes if op in ("cut_whole", "cut_stream") else 0)})
    return out


# --------------------------------------------------------------------------------------------
# The parent


def _spawn(op: str, size: int, store: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_bench", "--child", op, str(size), str(store)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {op} {size} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(config: dict[str, Any], quick: bool, scratch: Path, results: Path | None, log: Log) -> dict[str, Any]:
    import shutil

    started = time.perf_counter()
    load_start = common.load_average()
    work, cleanup = common.work_folder(scratch, "memory")
    out: list[dict[str, Any]] = []
    try:
        base = _spawn("baseline", 0, work / "none")
        log(f"memory: a child with the library imported: {base['peak']['VmRSS'] / MIB:.0f} MiB resident")
        for size in config["sizes"]:
            store = work / f"store-{size >> 20}m"
            for op in OPS:
                target = work / f"{op}-{size >> 20}m" if op in ("save_held", "cut_whole", "cut_stream") else store
                m = _spawn(op, size, target)
                if target != store:
                    shutil.rmtree(target, ignore_errors=True)
                m["added"] = {k: max(0, m["peak"][k] - m["before"][k]) for k in m["peak"]}
                out.append(m)
                log(f"memory: {op} {common.size_label(size)}: peak RSS {m['peak']['VmRSS'] / MIB:,.0f} MiB (anon "
                    f"{m['peak']['RssAnon'] / MIB:,.0f}, file-backed {m['peak']['RssFile'] / MIB:,.0f}); above the "
                    f"start {m['added']['VmRSS'] / MIB:,.0f} MiB; held before {m['held_bytes'] / MIB:,.0f} MiB; "
                    f"{m['seconds']:.1f} s")
            shutil.rmtree(store, ignore_errors=True)
    finally:
        cleanup()
    result = {"quick": quick, "sizes": list(config["sizes"]), "baseline": base, "measured": out,
              "sample_s": SAMPLE_S, "base_bytes": BASE_BYTES, "bounded_slope": BOUNDED_SLOPE,
              "load_average": {"start": load_start, "end": common.load_average()},
              "elapsed_s": round(time.perf_counter() - started, 1), "plots": []}
    result["verdicts"] = verdicts(result)
    result["summary"] = summary(result)
    if results is not None:
        result["plots"].append(str(plot(result, results)))
    return result


def _series(r: dict[str, Any], op: str, key: str, added: bool) -> list[float]:
    ms = sorted((m for m in r["measured"] if m["op"] == op), key=lambda m: m["size"])
    return [(m["added"] if added else m["peak"])[key] for m in ms]


def _slope(r: dict[str, Any], op: str, key: str) -> float:
    ys = _series(r, op, key, added=True)
    xs = r["sizes"]
    if len(xs) < 2:
        return 0.0
    return (ys[-1] - ys[0]) / (xs[-1] - xs[0])


def verdicts(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for op in OPS:
        anon = _slope(r, op, "RssAnon")
        total = _slope(r, op, "VmRSS")
        filed = _slope(r, op, "RssFile")
        out[op] = {"slope_rss": round(total, 4), "slope_anon": round(anon, 4), "slope_file": round(filed, 4),
                   "rss_bounded": abs(total) <= BOUNDED_SLOPE, "anon_bounded": abs(anon) <= BOUNDED_SLOPE}
    return out


def summary(r: dict[str, Any]) -> list[str]:
    out = []
    lo, hi = common.size_label(r["sizes"][0]), common.size_label(r["sizes"][-1])
    for op in OPS:
        v = r["verdicts"][op]
        add = _series(r, op, "VmRSS", added=True)
        anon = _series(r, op, "RssAnon", added=True)
        if v["rss_bounded"]:
            what = "bounded (flat)"
        elif v["anon_bounded"]:
            what = (f"proportional in mapped file pages only (x{v['slope_file']:.2f} of the bytes: page cache, "
                    "reclaimable), bounded in the process's own (anonymous) memory")
        else:
            what = f"PROPORTIONAL: {v['slope_anon']:.2f} bytes of the process's own memory per byte saved"
        out.append(f"{LABELS[op]}: {add[0] / MIB:,.0f} MiB above the start at {lo}, {add[-1] / MIB:,.0f} MiB at {hi} "
                   f"(anonymous {anon[0] / MIB:,.0f} -> {anon[-1] / MIB:,.0f} MiB): {what}.")
    return out


def markdown(r: dict[str, Any]) -> str:
    b = r["baseline"]["peak"]
    lines = [
        "# Memory benchmark: peak resident memory of saving and loading, against the bytes saved",
        "",
        f"Token-capture rows (`snapformat.example`) saved to and loaded from a local store; each measurement in a child "
        f"process of its own, sampling `/proc/self/status` every {r['sample_s'] * 1e3:.0f} ms (and `ru_maxrss`). A "
        f"child with the library imported holds {b['VmRSS'] / MIB:.0f} MiB. Whole run {r['elapsed_s']:.0f} s"
        f"{' (quick run)' if r['quick'] else ''}; load average {r['load_average']['start']} at start, "
        f"{r['load_average']['end']} at the end.",
        "",
        "| operation | bytes saved | held before | peak RSS | peak anonymous | peak file-backed | **above the start** "
        "| of which anonymous | `ru_maxrss` | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for op in OPS:
        for m in sorted((m for m in r["measured"] if m["op"] == op), key=lambda m: m["size"]):
            p, a = m["peak"], m["added"]
            lines.append(f"| {LABELS[op]} | {common.size_label(m['size'])} | {m['held_bytes'] / MIB:,.0f} MiB | "
                         f"{p['VmRSS'] / MIB:,.0f} MiB | {p['RssAnon'] / MIB:,.0f} MiB | {p['RssFile'] / MIB:,.0f} MiB | "
                         f"**{a['VmRSS'] / MIB:,.0f} MiB** | {a['RssAnon'] / MIB:,.0f} MiB | "
                         f"{m['ru_maxrss'] / MIB:,.0f} MiB | {m['seconds']:.1f} |")
    lines += ["", "| operation | memory above the start per byte saved: all / anonymous / file-backed | verdict |",
              "|---|---:|---|"]
    for op in OPS:
        v = r["verdicts"][op]
        verdict = ("bounded" if v["rss_bounded"] else "bounded anonymous, proportional mapped pages"
                   if v["anon_bounded"] else "proportional")
        slopes = " / ".join(f"{v[k]:.3f}".replace("-0.000", "0.000") for k in ("slope_rss", "slope_anon", "slope_file"))
        lines.append(f"| {LABELS[op]} | {slopes} | {verdict} |")
    lines += [""] + [f"**{s}**  " for s in r["summary"]]
    lines += [
        "",
        "Notes:",
        "- **above the start** = the peak during the operation minus the process's resident memory just before it "
        "(after building or loading the input): what the operation itself costs. **per byte saved** = the slope of "
        f"that between the smallest and the largest size; at most {r['bounded_slope']} counts as bounded.",
        "- **anonymous** (RssAnon) is memory the process owns (heap, Arrow buffers). **file-backed** (RssFile) are "
        "pages of memory-mapped files: the page cache's own pages, counted in RSS while mapped and touched, but "
        "shared and reclaimable, not a copy.",
        f"- The streamed save yields a fixed set of batches (at most {r['base_bytes'] // MIB} MiB, built before the "
        "measurement starts) again and again: nothing it writes stays in memory unless the library keeps it. The "
        "held save builds all the rows first (what a cut of the data plane holds) and reports the peak above them.",
        f"- The TQ rows are held as the adapter's capture holds them (segments of {CUT_SEGMENT_ROWS:,} rows, 128-383 "
        "tokens each, int32 ids and float32 log-probs) with a cut's listing of them (keys and tags), built before the "
        "measurement starts: **held before** is the capture's values. *Whole* is the coordinator's save before it "
        "wrote window by window (every row copied into one table, then written); *window by window* builds at most "
        "65,536 rows or about 64 MiB of values at a time (`coordinator.dataplane.tq.capture.plan_source`).",
        "- Not covered here: a restore into TransferQueue (`DataPlane.load`) necessarily holds the rows it puts "
        "(TQ keeps them in memory), so it is proportional by nature; see the tq and restore reports.",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], results: Path) -> Path:
    xs = [s / MIB for s in r["sizes"]]
    series = []
    styles = {"save_stream": "o-", "save_held": "s-", "cut_whole": "x--", "cut_stream": "d-", "load_mmap": "^-",
              "load_stream": "v-"}
    for op in OPS:
        series.append((f"{op}: above start (all)", xs, [v / MIB for v in _series(r, op, "VmRSS", True)], styles[op]))
    for op in ("load_mmap",):
        series.append((f"{op}: above start (anonymous only)", xs, [v / MIB for v in _series(r, op, "RssAnon", True)],
                       "^:"))
    series.append(("bytes saved (y = x)", xs, xs, "k:"))
    return common.plot(results / common.png_name("memory_vs_bytes", r["quick"]),
                       "Peak memory above the start vs bytes saved (one child process each)", "bytes saved (MiB)",
                       "MiB", series, xticks=xs, xticklabels=[common.size_label(s) for s in r["sizes"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_bench")
    p.add_argument("--child", nargs=3, metavar=("OP", "SIZE", "STORE"), required=True,
                   help="run one measurement in this process and print it as JSON")
    opts = p.parse_args(argv)
    op, size, store = opts.child
    print(json.dumps(child(op, int(size), store)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
