"""``make bench``: run the benchmark sections and write their reports to ``benchmarks/results/``.

    python -m benchmarks.run                      # every section; format at 0.1, 1 and 4 GiB of rows
    python -m benchmarks.run --quick              # 128 MiB, 2 repeats -> results/<section>-quick.md
    python -m benchmarks.run --size-gib 4 --section format
    python -m benchmarks.run --quick --section pause --section restore

Sections: ``format``, ``s3``, ``gym``, and (issue 6) ``tq`` (the TQ adapter vs TransferQueue's own
checkpoint), ``pause`` (the save pause vs rollouts and bytes), ``restore`` (restore vs a raw read),
``discovery`` (``latest()`` and ``snapformat show`` vs snapshots in the store), ``memory`` (peak RSS
of saving and loading vs bytes), ``token_store`` (``gymkit.token_store`` puts/s and freeze vs Gym's
own token-capture file store, and per-put latency on SeaweedFS), ``incremental`` (issue 21: bytes, time and
requests of successive incremental vs full snapshots of a growing TQ on local disk and SeaweedFS, their
restore, and GC of a large store of shared objects). ``--size-gib`` and ``--repeats``
apply to ``format`` and ``s3``; the others have their own sizes (``--quick`` picks the small ones).

Each section writes ``results/<section>.md`` (the committed report: machine, command, table) and
``results/<section>.json`` (every measured time; git-ignored); the issue-6 sections also write PNG
plots (``results/<name>.png``, matplotlib, Agg backend). Add a section by adding a function
to ``SECTIONS`` that takes the parsed options and a log function and returns ``(markdown, data)``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SCRATCH = HERE / ".scratch"
DEFAULT_RESULTS = HERE / "results"
QUICK_SIZE_GIB = 0.125
FORMAT_SIZES_GIB = (0.1, 1.0, 4.0)  # the format section's sizes when no --size-gib is given
LARGE_GIB, LARGE_REPEATS = 4.0, 2  # from this size on, at most this many repeats (time)
QUICK_REPEATS = 2


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _format_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    """One table per size: 0.1, 1 and 4 GiB unless ``--size-gib`` or ``--quick`` names one."""
    from benchmarks import format_bench

    sizes = (opts.size_gib,) if opts.size_given or opts.quick else FORMAT_SIZES_GIB
    bodies, data = [], {}
    for size in sizes:
        repeats = min(opts.repeats, LARGE_REPEATS) if size >= LARGE_GIB else opts.repeats
        result = format_bench.run(size_gib=size, repeats=repeats, scratch=opts.scratch,
                                  cold=opts.cold, batch_rows=opts.batch_rows, log=say)
        bodies.append(result.markdown() if len(sizes) == 1 else f"## {size:g} GiB of rows\n\n{result.markdown()}")
        data[f"{size:g}"] = result.to_json()
    title = "# Format benchmark: snapformat vs raw file I/O vs pickle\n\n"
    return title + "\n\n".join(bodies), (data[f"{sizes[0]:g}"] if len(sizes) == 1 else {"by_size_gib": data})


def _s3_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import s3_bench

    result = s3_bench.run(opts.size_gib, opts.quick, log=say)
    return s3_bench.markdown(result), result


def _gym_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import gym_bench

    counts = gym_bench.QUICK_COUNTS if opts.quick else gym_bench.FULL_COUNTS
    result = gym_bench.run(counts, opts.quick, log=say, workdir=opts.scratch)
    return gym_bench.markdown(result), result


def _tq_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import tq_bench

    config = dict(tq_bench.QUICK if opts.quick else tq_bench.FULL)
    if opts.tq_rows:
        config["rows"] = tuple(sorted(set(opts.tq_rows)))
    if opts.tq_layout:
        config["layouts"] = tuple(dict.fromkeys(opts.tq_layout))
    result = tq_bench.run(config, opts.quick, opts.scratch, opts.results, say)
    return tq_bench.markdown(result), result


def _pause_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import controller_bench

    result = controller_bench.pause_results(opts.quick, opts.scratch, say)
    return controller_bench.pause_markdown(result, opts.results), result


def _restore_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import controller_bench

    result = controller_bench.restore_results(opts.quick, opts.scratch, say)
    return controller_bench.restore_markdown(result, opts.results), result


def _discovery_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import discovery_bench

    result = discovery_bench.run(discovery_bench.QUICK if opts.quick else discovery_bench.FULL, opts.quick,
                                 opts.scratch, opts.results, say)
    return discovery_bench.markdown(result), result


def _memory_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import memory_bench

    result = memory_bench.run(memory_bench.QUICK if opts.quick else memory_bench.FULL, opts.quick, opts.scratch,
                              opts.results, say)
    return memory_bench.markdown(result), result


def _incremental_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import incremental_bench

    result = incremental_bench.run(incremental_bench.QUICK if opts.quick else incremental_bench.FULL, opts.quick,
                                   opts.scratch, opts.results, say)
    return incremental_bench.markdown(result), result


def _token_store_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import token_store_bench

    result = token_store_bench.run(token_store_bench.QUICK if opts.quick else token_store_bench.FULL, opts.quick,
                                   opts.scratch, say)
    return token_store_bench.markdown(result), result


def _scale_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import scale_bench

    result = scale_bench.run(scale_bench.QUICK_POINTS if opts.quick else scale_bench.FULL_POINTS, opts.quick,
                             log=say, workdir=opts.scratch, staging=scale_bench.ram_staging())
    return scale_bench.markdown(result, scale_bench.plot(result, opts.results)), result


def _parked_section(opts: argparse.Namespace, say: Callable[[str], None]) -> tuple[str, dict]:
    from benchmarks import parked_bench

    return parked_bench.section(opts, say)


#: name -> section runner; each returns (markdown body, JSON-able data). ``restore`` restores the
#: snapshots ``pause`` published in this process (run alone, it takes the pause measurements first).
SECTIONS: dict[str, Callable[[argparse.Namespace, Callable[[str], None]], tuple[str, dict]]] = {
    "format": _format_section,
    "s3": _s3_section,
    "gym": _gym_section,
    "tq": _tq_section,
    "pause": _pause_section,
    "restore": _restore_section,
    "discovery": _discovery_section,
    "memory": _memory_section,
    "incremental": _incremental_section,
    "scale": _scale_section,
    "parked": _parked_section,
    "token_store": _token_store_section,
}


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(scratch: Path) -> dict:
    import numpy
    import pyarrow
    import xxhash

    import snapformat
    from benchmarks import common

    mem = _meminfo_total()
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1) if mem else None,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.platform(),
        "python": sys.version.split()[0],
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
        "xxhash": xxhash.VERSION,
        "snapformat": snapformat.__version__,
        "scratch_filesystem": common.filesystem(scratch.parent if not scratch.exists() else scratch),
    }


def _machine_markdown(info: dict, command: str) -> str:
    rows = [
        ("date", info["date_utc"]),
        ("command", f"`{command}`"),
        ("machine", f"{info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable), "
                    f"{info['memory_gib']} GiB memory; load average at start {info['load_average_at_start']}"),
        ("system", info["kernel"]),
        ("software", f"Python {info['python']}, pyarrow {info['pyarrow']}, numpy {info['numpy']}, "
                     f"xxhash {info['xxhash']}, snapformat {info['snapformat']}"),
        ("scratch disk", info["scratch_filesystem"]),
    ]
    return "\n".join(f"- **{k}**: {v}" for k, v in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=None,
                   help=f"rows to build, GiB in memory (default 1; format: {', '.join(map(str, FORMAT_SIZES_GIB))}; "
                        f"--quick: {QUICK_SIZE_GIB})")
    p.add_argument("--quick", action="store_true",
                   help=f"a fast run: {QUICK_SIZE_GIB} GiB, {QUICK_REPEATS} repeats, reports named <section>-quick")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"repeats per measurement (default 3; --quick: {QUICK_REPEATS})")
    p.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only this section (repeatable)")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="skip the cold-cache load rows")
    p.add_argument("--batch-rows", type=int, default=4096, help="rows per record batch (default 4096)")
    p.add_argument("--tq-rows", type=int, action="append",
                   help="tq section: rows in TQ (repeatable; default 10,000 and 100,000, --quick 1,000 and 10,000)")
    p.add_argument("--tq-layout", action="append", choices=("dense", "ragged"),
                   help="tq section: only this layout (repeatable; default both)")
    p.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, help="temporary folder (removed afterwards)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where the reports go")
    opts = p.parse_args(argv)
    opts.size_given = opts.size_gib is not None
    if opts.size_gib is None:
        opts.size_gib = QUICK_SIZE_GIB if opts.quick else 1.0
    if opts.repeats is None:
        opts.repeats = QUICK_REPEATS if opts.quick else 3
    if opts.size_gib <= 0 or opts.repeats < 1 or opts.batch_rows < 1 or any(r < 1 for r in opts.tq_rows or ()):
        p.error("--size-gib, --repeats, --batch-rows and --tq-rows must be positive")
    return opts


def main(argv: list[str] | None = None) -> int:
    from coordinator import ray_runtime

    ray_runtime.configure()  # an entry point: Ray on 127.0.0.1, single-user, before any section imports ray
    args = sys.argv[1:] if argv is None else argv
    opts = parse_args(args)
    command = " ".join(["python -m benchmarks.run", *map(shlex.quote, args)])
    opts.results.mkdir(parents=True, exist_ok=True)
    info = machine_info(opts.scratch)
    log(f"benchmarks: {command}")
    log(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"load {info['load_average_at_start']}")
    try:
        for name in opts.section or list(SECTIONS):
            t0 = time.perf_counter()
            body, data = SECTIONS[name](opts, log)
            stem = f"{name}-quick" if opts.quick else name
            md = body.split("\n\n", 1)
            report = f"{md[0]}\n\n{_machine_markdown(info, command)}\n\n{md[1] if len(md) > 1 else ''}".rstrip() + "\n"
            (opts.results / f"{stem}.md").write_text(report)
            (opts.results / f"{stem}.json").write_text(
                json.dumps({"section": name, "command": command, "machine": info, "result": data}, indent=2) + "\n")
            print()
            print(report, flush=True)
            log(f"{name}: done in {time.perf_counter() - t0:.0f} s; wrote {opts.results / (stem + '.md')} and .json")
    finally:
        if "benchmarks.common" in sys.modules:  # the Ray + TQ of the tq / pause / restore sections, if started
            sys.modules["benchmarks.common"].close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
