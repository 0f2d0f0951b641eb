"""The discovery benchmark (issue 6): finding and showing the newest snapshot against the number of
snapshots in a local store, which must not matter.

    python -m benchmarks.run --section discovery           # 1, 10, 100, 1,000 snapshots
    python -m benchmarks.run --section discovery --quick   # 1, 10, 100

One store grows from one size to the next; every snapshot is a small but complete one written with
snapformat's API (``snapformat.example.write_example`` with :data:`ROLLOUTS` rollouts: agent, model,
resource, tq and controller parts, 11 files), ``begin()`` + ``publish()`` one after the other, as a
run makes them (no retention). At each size, with the page cache warm (the store was just written):

* ``SnapshotStore(path).latest()``: a new store object each time (what a restarted job does), and
  the store operations it sends (counted by a wrapper around the store object);
* ``snapformat show <store>`` in-process (``snapformat.cli.main(["show", store])``, output to a
  buffer) and as a subprocess (``python -m snapformat show <store>``, interpreter start included);
* for contrast, what does grow: ``SnapshotStore.list()`` (reads every commit record).
"""

from __future__ import annotations

import contextlib
import io
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import Log

ROLLOUTS = 4
FULL = {"sizes": (1, 10, 100, 1000), "latest_runs": 30, "show_runs": 15, "subprocess_runs": 5, "list_runs": 5}
QUICK = {"sizes": (1, 10, 100), "latest_runs": 15, "show_runs": 8, "subprocess_runs": 3, "list_runs": 3}
SMALLEST = {"sizes": (1, 10), "latest_runs": 3, "show_runs": 2, "subprocess_runs": 1, "list_runs": 1}
FLAT_RATIO = 1.5  # the largest store's median over the smallest's, at most, to call a curve flat
COUNTED = ("read_bytes", "open_read", "exists", "info", "list_names", "walk", "local_path")


class CountingStore:
    """A store object that counts the calls made to it (everything else passes through)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in COUNTED and callable(attr):
            def call(*a: Any, **kw: Any) -> Any:
                self.ops[name] += 1
                return attr(*a, **kw)
            return call
        return attr


def _publish(store, seq_seed: int) -> None:
    from snapformat.example import TOPOLOGY, write_example

    draft = store.begin()
    gym, receipts = write_example(draft, count=ROLLOUTS, seed=seq_seed)
    draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=TOPOLOGY)


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 4)


def measure(root: Path, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from snapformat import SnapshotStore, cli
    from snapformat.store import open_store

    # latest(): a new store object per call, counted
    times, ops = [], []
    SnapshotStore(str(root)).latest()  # warm-up (untimed)
    for _ in range(cfg["latest_runs"]):
        counting = CountingStore(open_store(str(root)))
        t0 = time.perf_counter()
        snap = SnapshotStore(counting).latest()
        times.append(time.perf_counter() - t0)
        ops.append(dict(sorted(counting.ops.items())))
        if snap is None or snap.sequence != n:
            raise AssertionError(f"latest() found {snap and snap.sequence}, expected {n}")
    latest = {"median_ms": _median_ms(times), "best_ms": round(min(times) * 1e3, 4),
              "times_ms": [round(t * 1e3, 4) for t in times], "ops": ops[0], "op_count": sum(ops[0].values()),
              "ops_same_every_call": all(o == ops[0] for o in ops)}
    # show, in-process
    show_times = []
    text = ""
    for _ in range(cfg["show_runs"]):
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            code = cli.main(["show", str(root)])
        show_times.append(time.perf_counter() - t0)
        text = buf.getvalue()
        if code != 0 or f"sequence {n}," not in text:
            raise AssertionError(f"snapformat show exited {code}: {text[:300]}")
    # show, subprocess
    sub_times = []
    for _ in range(cfg["subprocess_runs"]):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "snapformat", "show", str(root)], capture_output=True,
                              text=True, timeout=120)
        sub_times.append(time.perf_counter() - t0)
        if proc.returncode != 0 or f"sequence {n}," not in proc.stdout:
            raise AssertionError(f"python -m snapformat show exited {proc.returncode}: {proc.stderr[:300]}")
    # contrast: every commit record
    list_times = []
    for _ in range(cfg["list_runs"]):
        t0 = time.perf_counter()
        commits = SnapshotStore(str(root)).list()
        list_times.append(time.perf_counter() - t0)
        if len(commits) != n:
            raise AssertionError(f"list() gave {len(commits)} commits, expected {n}")
    return {"snapshots": n, "latest": latest,
            "show_inprocess": {"median_ms": _median_ms(show_times), "times_ms": [round(t * 1e3, 3) for t in show_times],
                               "output_lines": text.count("\n")},
            "show_subprocess": {"median_ms": _median_ms(sub_times), "times_ms": [round(t * 1e3, 2) for t in sub_times]},
            "list_all": {"median_ms": _median_ms(list_times)}}


def _startup_ms(runs: int) -> float:
    """``python -m snapformat --help``: the interpreter, imports and argument parsing, no store."""
    times = []
    for _ in range(max(runs, 1)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "snapformat", "--help"], capture_output=True, timeout=120, check=True)
        times.append(time.perf_counter() - t0)
    return _median_ms(times)


def run(config: dict[str, Any], quick: bool, scratch: Path, results: Path | None, log: Log) -> dict[str, Any]:
    from snapformat import SnapshotStore

    started = time.perf_counter()
    load_start = common.load_average()
    work, cleanup = common.work_folder(scratch, "discovery")
    out = []
    try:
        root = work / "store"
        store = SnapshotStore(str(root))
        have = 0
        for n in config["sizes"]:
            t0 = time.perf_counter()
            while have < n:
                have += 1
                _publish(store, have)
            fill_s = time.perf_counter() - t0
            m = measure(root, n, config)
            m["fill_s"] = round(fill_s, 2)
            m["store_bytes"] = common.tree_bytes(root)
            out.append(m)
            log(f"discovery: {n:,} snapshots (published in {fill_s:.1f} s, not timed): latest() "
                f"{m['latest']['median_ms']:.2f} ms, {m['latest']['op_count']} store calls {m['latest']['ops']}; show "
                f"{m['show_inprocess']['median_ms']:.1f} ms in-process, {m['show_subprocess']['median_ms']:.0f} ms as a "
                f"subprocess; list() {m['list_all']['median_ms']:.1f} ms")
        startup = _startup_ms(config["subprocess_runs"])
    finally:
        cleanup()
    result = {"quick": quick, "sizes": list(config["sizes"]), "rollouts_per_snapshot": ROLLOUTS,
              "runs": {k: v for k, v in config.items() if k.endswith("_runs")}, "measured": out,
              "subprocess_startup_ms": startup, "flat_ratio": FLAT_RATIO,
              "load_average": {"start": load_start, "end": common.load_average()},
              "elapsed_s": round(time.perf_counter() - started, 1), "plots": []}
    result["summary"] = summary(result)
    if results is not None:
        result["plots"].append(str(plot(result, results)))
    return result


def _growth(r: dict[str, Any], key: str) -> float:
    first, last = r["measured"][0][key]["median_ms"], r["measured"][-1][key]["median_ms"]
    return last / first if first > 0 else float("inf")


def summary(r: dict[str, Any]) -> list[str]:
    m = r["measured"]
    sizes = "/".join(f"{x['snapshots']:,}" for x in m)
    ops = [x["latest"]["op_count"] for x in m]
    same_ops = len(set(ops)) == 1 and len({tuple(sorted(x["latest"]["ops"].items())) for x in m}) == 1
    medians = "/".join(f"{x['latest']['median_ms']:.2f}" for x in m)
    out = [f"latest(): {'/'.join(str(o) for o in ops)} store calls with {sizes} snapshots "
           f"({'the same calls at every size: flat' if same_ops else 'NOT the same calls: not flat'}); median "
           f"{medians} ms."]
    for key, label in (("latest", "latest()"), ("show_inprocess", "snapformat show (in-process)"),
                       ("show_subprocess", "python -m snapformat show (subprocess)")):
        g = _growth(r, key)
        out.append(f"{label}: x{g:.2f} from {m[0]['snapshots']:,} to {m[-1]['snapshots']:,} snapshots "
                   f"({'flat' if g <= r['flat_ratio'] else 'NOT flat'}: at most x{r['flat_ratio']} counts as flat, "
                   "machine noise included).")
    out.append(f"For contrast, SnapshotStore.list() (every commit record) grows x{_growth(r, 'list_all'):.0f}.")
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Discovery benchmark: latest() and snapformat show against the number of snapshots",
        "",
        f"One local store grows to {', '.join(f'{n:,}' for n in r['sizes'])} published snapshots, each a small complete "
        f"one (`snapformat.example.write_example`, {r['rollouts_per_snapshot']} rollouts: agent, model, resource, tq and "
        f"controller parts), published one after the other with `begin()` + `publish()` and no retention. Page cache "
        f"warm. Medians of {r['runs']['latest_runs']} (`latest()`), {r['runs']['show_runs']} (show in-process), "
        f"{r['runs']['subprocess_runs']} (show as a subprocess) and {r['runs']['list_runs']} (`list()`) runs. Whole run "
        f"{r['elapsed_s']:.0f} s{' (quick run)' if r['quick'] else ''}; load average {r['load_average']['start']} at "
        f"start, {r['load_average']['end']} at the end.",
        "",
        "| snapshots in store | `latest()` ms | store calls per `latest()` | `snapformat show` in-process ms | "
        "`python -m snapformat show` ms | contrast: `list()` ms | store on disk |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for x in r["measured"]:
        ops = ", ".join(f"{k} {v}" for k, v in x["latest"]["ops"].items())
        lines.append(f"| {x['snapshots']:,} | {x['latest']['median_ms']:.2f} | {x['latest']['op_count']} ({ops}) | "
                     f"{x['show_inprocess']['median_ms']:.1f} | {x['show_subprocess']['median_ms']:.0f} | "
                     f"{x['list_all']['median_ms']:.1f} | {common.size_label(x['store_bytes'])} |")
    m = r["measured"]
    lines.append(f"| **largest / smallest** | **x{_growth(r, 'latest'):.2f}** | | **x{_growth(r, 'show_inprocess'):.2f}** | "
                 f"**x{_growth(r, 'show_subprocess'):.2f}** | x{_growth(r, 'list_all'):.0f} | "
                 f"x{m[-1]['store_bytes'] / m[0]['store_bytes']:.0f} |")
    lines += [""] + [f"**{s}**  " for s in r["summary"]]
    lines += [
        "",
        "Notes:",
        "- `latest()` = `SnapshotStore(path).latest()` on a new store object each call (a restarted job's first "
        "step): read the advisory hint `_latest.json`, check its commit record exists, probe the next sequence, read "
        "the commit record and the manifest. Store calls are counted on the store object (a wrapper counting "
        f"{', '.join(COUNTED)}).",
        "- `snapformat show` = `snapformat.cli.main([\"show\", store])` with its output captured (in-process), and "
        "`python -m snapformat show <store>` as a subprocess; the subprocess time includes starting Python and "
        f"importing the library: `python -m snapformat --help` alone takes {r['subprocess_startup_ms']:.0f} ms here.",
        "- `list()` reads every commit record (one listing, then one read per snapshot): it grows with the store by "
        "design and is shown only for contrast; neither `latest()` nor `show` calls it.",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], results: Path) -> Path:
    xs = [x["snapshots"] for x in r["measured"]]
    series = [("latest()", xs, [x["latest"]["median_ms"] for x in r["measured"]], "o-"),
              ("snapformat show, in-process", xs, [x["show_inprocess"]["median_ms"] for x in r["measured"]], "s-"),
              ("python -m snapformat show, subprocess", xs, [x["show_subprocess"]["median_ms"] for x in r["measured"]],
               "^-"),
              ("contrast: list() (every commit)", xs, [x["list_all"]["median_ms"] for x in r["measured"]], "x:")]
    return common.plot(results / common.png_name("discovery_vs_snapshots", r["quick"]),
                       "Discovery vs snapshots in the store (local disk, page cache warm)", "published snapshots",
                       "milliseconds (median)", series, xticks=xs, xticklabels=[f"{x:,}" for x in xs])
