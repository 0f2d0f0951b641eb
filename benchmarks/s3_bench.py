"""The object-store benchmark: snapformat on a real S3 server (SeaweedFS on 127.0.0.1) against
plain s3fs moving the same bytes, plus request counts and discovery cost.

    python -m benchmarks.s3_bench --size-gib 1          # full run, report in benchmarks/results/s3.md
    python -m benchmarks.s3_bench --quick               # 0.02 GiB, 1 repeat, stores of 1/10/100 filled in bulk

One SeaweedFS (``weed mini``, loopback only, its own free ports and temporary folder) serves every
section of one run, and is stopped and removed at the end. The token-capture rows are built once
(``snapformat.example``), outside every timing, together with their Arrow IPC file bytes.

1. *Upload.* Library: ``SnapshotStore("s3://bucket/xfer").begin()``, ``draft.part("tq").write_rows(...)``
   (Arrow IPC serialisation, schema and row checks, xxh3-128, parallel bounded multipart upload),
   ``publish()``. Baseline: plain s3fs ``pipe_file`` of the same Arrow IPC bytes (serialised
   beforehand) with the same endpoint, credentials and ``request_checksum_calculation=
   "when_required"``, s3fs defaults otherwise (50 MiB parts, 10 in parallel).
2. *Download.* Library: ``snap.read_table("tokens", verify=True)`` (bytes fetched, size and xxh3-128
   checked, Arrow file opened). Baselines: plain s3fs ``cat_file`` of the same object, with its
   defaults (HEAD, then 50 MiB ranged GETs, 10 in parallel) and with ``max_concurrency=1`` (one GET).
3. *Requests per snapshot.* S3 operations the library sends for one ``begin`` + write + ``publish``
   (counted on the botocore ``before-call`` event of the store's client), for N parts of R and
   10R rows: the count follows the number of files, not rows (more rows only add multipart parts).
4. *Discovery.* ``SnapshotStore.latest()`` (median time and its S3 operations) with 1, 100 and
   1,000 snapshots in the store (1, 10, 100 with ``quick``); one listing of ``_commits/`` for contrast.
5. *Multipart settings.* The library upload of (1) with several ``part_size`` x ``max_inflight_parts``.

Methods alternate their order between repeats; GB/s is always the Arrow IPC object's size divided
by the median time, so every row of a phase moves the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

from benchmarks import common
from benchmarks.format_bench import build_rows
from devtools import s3servers
from schemas.controller import LoaderPlace
from schemas.manifest import CommitRecord, Manifest, ParentRef
from schemas.rows import TOKEN_CAPTURE_SCHEMA
from schemas.version import FORMAT_VERSION
from snapformat import SnapshotStore, discovery, jsonl, layout
from snapformat.checksum import checksum_bytes
from snapformat.draft import SnapshotDraft
from snapformat.retention import apply_retention
from snapformat.store import s3 as s3_store

Log = Callable[[str], None]

GIB = 1 << 30
MIB = 1 << 20
GB = 1e9
SEED = 11
BUCKET = "snapbench"
PART_PREFIX = "tq"
TOKENS_NAME = "tokens.arrow"

UPLOAD = "upload"
DOWNLOAD = "download"
LIB_UPLOAD = "snapformat: begin + write_rows + publish"
S3FS_PIPE = "s3fs: pipe_file (50 MiB parts, 10 parallel)"
LIB_DOWNLOAD = "snapformat: read_table verify=True"
S3FS_CAT = "s3fs: cat_file (HEAD + 50 MiB ranges, 10 parallel)"
S3FS_CAT_ONE = "s3fs: cat_file max_concurrency=1 (one GET)"
#: The plain-s3fs method each phase's library row is held to (>= TARGET of its throughput).
BASELINE = {UPLOAD: S3FS_PIPE, DOWNLOAD: S3FS_CAT}
LIBRARY = {UPLOAD: LIB_UPLOAD, DOWNLOAD: LIB_DOWNLOAD}
TARGET = 0.9

FULL = {"repeats": 3, "tuning_repeats": 2, "latest_runs": 15, "request_parts": (1, 4, 16), "request_rows": 4096,
        "store_sizes": (1, 100, 1000), "fill": "publish"}
QUICK = {"repeats": 1, "tuning_repeats": 1, "latest_runs": 5, "request_parts": (1, 4), "request_rows": 256,
         "store_sizes": (1, 10, 100), "fill": "bulk"}
#: (part_size, max_inflight_parts) tried for the library upload; the first is the library's default.
TUNING = [(s3_store.PART_SIZE, s3_store.MAX_INFLIGHT_PARTS), (8 * MIB, 4), (16 * MIB, 8), (32 * MIB, 4), (64 * MIB, 2)]
FILL_THREADS = 8


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] s3: {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Rows, server, clients


def arrow_file_bytes(batches: list[pa.RecordBatch]) -> bytes:
    """The batches as one Arrow IPC file (the bytes the plain-s3fs baseline uploads)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, TOKEN_CAPTURE_SCHEMA) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()


def plain_s3fs(server: s3servers.S3Server):
    """A plain s3fs filesystem with the library's endpoint and checksum settings, s3fs defaults otherwise."""
    import s3fs

    return s3fs.S3FileSystem(
        key=s3servers.ACCESS_KEY, secret=s3servers.SECRET_KEY, skip_instance_cache=True,
        client_kwargs={"endpoint_url": server.endpoint, "region_name": "us-east-1"},
        config_kwargs={"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"},
    )


class RequestCounter:
    """Counts the S3 operations one s3fs filesystem sends (botocore ``before-call`` of its client),
    and the HTTP requests including retries (``before-send``)."""

    def __init__(self, fs) -> None:
        fs.connect()  # creates the client (s3fs makes it lazily); every call_s3 uses this one
        self._events = fs.s3.meta.events
        self.ops: Counter[str] = Counter()
        self.http = 0
        self._events.register("before-call.s3", self._on_call, unique_id=f"s3bench-call-{id(self)}")
        self._events.register("before-send.s3", self._on_send, unique_id=f"s3bench-send-{id(self)}")

    def _on_call(self, model, **_: Any) -> None:
        self.ops[model.name] += 1

    def _on_send(self, **_: Any) -> None:
        self.http += 1

    def reset(self) -> None:
        self.ops.clear()
        self.http = 0

    def take(self) -> dict[str, int]:
        """The operations counted since the last reset (sorted by name), then reset."""
        out = dict(sorted(self.ops.items()))
        self.reset()
        return out

    def close(self) -> None:
        self._events.unregister("before-call.s3", unique_id=f"s3bench-call-{id(self)}")
        self._events.unregister("before-send.s3", unique_id=f"s3bench-send-{id(self)}")


def _s3_store(url: str, **options: Any) -> s3_store.S3Store:
    return s3_store.S3Store(url, **options)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _fresh() -> None:
    gc.collect()


# --------------------------------------------------------------------------------------------
# 1 + 2 + 5. Transfers


def upload_library(ss: SnapshotStore, batches: list[pa.RecordBatch]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    draft = ss.begin()
    draft.part(PART_PREFIX, writer="tq").write_rows(TOKENS_NAME, "token_capture_rows", batches)
    published = draft.publish()
    return time.perf_counter() - t0, published


def upload_s3fs(fs, path: str, data: bytes) -> float:
    t0 = time.perf_counter()
    fs.pipe_file(path, data)
    return time.perf_counter() - t0


def download_library(snap) -> tuple[float, int]:
    t0 = time.perf_counter()
    table = snap.read_table("tokens", verify=True)
    dt = time.perf_counter() - t0
    return dt, table.num_rows


def download_s3fs(fs, path: str, **kw: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    data = fs.cat_file(path, **kw)
    dt = time.perf_counter() - t0
    return dt, len(data)


def _row(phase: str, method: str, nbytes: int, times: list[float], requests: dict[str, int]) -> dict:
    return {"phase": phase, "method": method, "object_bytes": nbytes, "times_s": [round(t, 4) for t in times],
            "median_s": round(_median(times), 4), "best_s": round(min(times), 4),
            "gb_per_s": round(nbytes / _median(times) / GB, 4), "requests": requests,
            "request_count": sum(requests.values())}


def measure_transfers(server, data: bytes, batches: list[pa.RecordBatch], rows: int, repeats: int,
                      log: Log) -> tuple[list[dict], dict]:
    ss = SnapshotStore(f"s3://{BUCKET}/xfer")
    store = ss.store
    assert isinstance(store, s3_store.S3Store)
    fs = plain_s3fs(server)
    lib_count, raw_count = RequestCounter(store.fs), RequestCounter(fs)
    raw_path = f"{BUCKET}/plain/{TOKENS_NAME}"
    times: dict[str, list[float]] = {m: [] for m in (LIB_UPLOAD, S3FS_PIPE, LIB_DOWNLOAD, S3FS_CAT, S3FS_CAT_ONE)}
    requests: dict[str, dict[str, int]] = {}
    checks: dict[str, Any] = {}
    data_checksum = checksum_bytes(data)
    try:
        for rep in range(repeats):
            order = [LIB_UPLOAD, S3FS_PIPE] if rep % 2 == 0 else [S3FS_PIPE, LIB_UPLOAD]
            for method in order:
                _fresh()
                if method == LIB_UPLOAD:
                    lib_count.reset()
                    dt, published = upload_library(ss, batches)
                    requests[method] = lib_count.take()
                    entry = next(f for f in published.manifest.files if f.kind == "token_capture_rows")
                    checks["library_object_bytes"] = entry.size
                    checks["library_bytes_identical"] = entry.size == len(data) and entry.checksum == data_checksum
                    apply_retention(store, 1)  # untimed: keep one snapshot on the server's disk
                else:
                    with contextlib.suppress(FileNotFoundError):
                        fs.rm_file(raw_path)  # untimed: the put below creates a new object
                    raw_count.reset()
                    dt = upload_s3fs(fs, raw_path, data)
                    requests[method] = raw_count.take()
                times[method].append(dt)
                log(f"upload {rep + 1}/{repeats} {method}: {dt:.2f} s ({len(data) / dt / GB:.3f} GB/s)")
        rot = [LIB_DOWNLOAD, S3FS_CAT, S3FS_CAT_ONE]
        for rep in range(repeats):
            order = rot[rep % 3:] + rot[:rep % 3]
            for method in order:
                _fresh()
                counter = lib_count if method == LIB_DOWNLOAD else raw_count
                if method == LIB_DOWNLOAD:
                    snap = ss.latest()  # opened untimed and uncounted: discovery is section 4
                    assert snap is not None
                    counter.reset()
                    dt, n = download_library(snap)
                    del snap
                    assert n == rows, f"read {n} rows, wrote {rows}"
                else:
                    counter.reset()
                    dt, n = download_s3fs(fs, raw_path, **({"max_concurrency": 1} if method == S3FS_CAT_ONE else {}))
                    assert n == len(data), f"read {n} bytes, wrote {len(data)}"
                requests[method] = counter.take()
                times[method].append(dt)
                log(f"download {rep + 1}/{repeats} {method}: {dt:.2f} s ({len(data) / dt / GB:.3f} GB/s)")
        # Untimed checks: what came back equals what went up.
        _fresh()
        checks["s3fs_bytes_identical"] = fs.cat_file(raw_path) == data
        snap = ss.latest()
        assert snap is not None
        checks["library_rows_read"] = snap.read_table("tokens", verify=True).num_rows
    finally:
        lib_count.close()
        raw_count.close()
    measured = [_row(UPLOAD, m, len(data), times[m], requests.get(m, {})) for m in (LIB_UPLOAD, S3FS_PIPE)]
    measured += [_row(DOWNLOAD, m, len(data), times[m], requests.get(m, {})) for m in (LIB_DOWNLOAD, S3FS_CAT, S3FS_CAT_ONE)]
    return measured, checks


def measure_tuning(data_bytes: int, batches: list[pa.RecordBatch], repeats: int, log: Log) -> list[dict]:
    """The library upload with each (part_size, max_inflight_parts); config order rotates per repeat."""
    times: dict[tuple[int, int], list[float]] = {cfg: [] for cfg in TUNING}
    stores = {cfg: SnapshotStore(_s3_store(f"s3://{BUCKET}/tuning-{cfg[0] >> 20}x{cfg[1]}", part_size=cfg[0],
                                           max_inflight_parts=cfg[1])) for cfg in TUNING}
    for rep in range(repeats):
        order = TUNING[rep % len(TUNING):] + TUNING[:rep % len(TUNING)]
        for cfg in order:
            _fresh()
            dt, _ = upload_library(stores[cfg], batches)
            apply_retention(stores[cfg].store, 1)
            times[cfg].append(dt)
            log(f"tuning {rep + 1}/{repeats} part_size {cfg[0] >> 20} MiB x {cfg[1]} in flight: {dt:.2f} s "
                f"({data_bytes / dt / GB:.3f} GB/s)")
    default = _median(times[TUNING[0]])
    out = []
    for (part_size, inflight), ts in times.items():
        out.append({"part_size": part_size, "max_inflight_parts": inflight,
                    "memory_bound_bytes": part_size * (inflight + 1), "default": (part_size, inflight) == TUNING[0],
                    "times_s": [round(t, 4) for t in ts], "median_s": round(_median(ts), 4), "best_s": round(min(ts), 4),
                    "gb_per_s": round(data_bytes / _median(ts) / GB, 4),
                    "speed_vs_default": round(default / _median(ts), 3)})
    return out


# --------------------------------------------------------------------------------------------
# 3. Requests per snapshot


def measure_requests(batches: list[pa.RecordBatch], part_counts: tuple[int, ...], base_rows: int, log: Log) -> list[dict]:
    """S3 operations of one begin + write + publish, by phase and by operation, on a warm store."""
    table = pa.Table.from_batches(batches)
    base_rows = min(base_rows, table.num_rows // 10)
    ss = SnapshotStore(f"s3://{BUCKET}/requests")
    store = ss.store
    assert isinstance(store, s3_store.S3Store)
    draft = ss.begin()  # untimed warm-up: the bucket check, the store marker, the first commit and hint
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=0, seed=SEED))
    draft.publish()
    counter = RequestCounter(store.fs)
    out = []
    try:
        for parts in part_counts:
            for rows in (base_rows, 10 * base_rows):
                data = table.slice(0, rows)
                counter.reset()
                draft = ss.begin()
                begin_ops = counter.take()
                sizes = []
                for i in range(parts):
                    sizes.append(draft.part(f"{PART_PREFIX}/p{i:03d}", writer=f"tq{i}").write_rows(
                        TOKENS_NAME, "token_capture_rows", data).size)
                write_ops = counter.take()
                published = draft.publish()
                publish_ops = counter.take()
                total = Counter(begin_ops) + Counter(write_ops) + Counter(publish_ops)
                n_total = sum(total.values())
                row = {"parts": parts, "files": len(published.manifest.files), "rows_per_part": rows,
                       "bytes_per_part": sizes[0], "total_bytes": sum(sizes), "part_size": store.part_size,
                       "requests": n_total, "begin": sum(begin_ops.values()), "write": sum(write_ops.values()),
                       "publish": sum(publish_ops.values()), "by_operation": dict(sorted(total.items())),
                       "without_upload_parts": n_total - total.get("UploadPart", 0)}
                out.append(row)
                log(f"requests: {parts} part(s) x {rows} rows ({sizes[0] / MIB:.1f} MiB each): {n_total} "
                    f"({row['by_operation']})")
                apply_retention(store, 1)
    finally:
        counter.close()
    return out


# --------------------------------------------------------------------------------------------
# 4. Discovery


def _publish_at(store, sequence: int, snapshot_id: str, parent: ParentRef | None) -> None:
    """A tiny real snapshot published through the library at an explicit sequence (one JSON part)."""
    draft = SnapshotDraft(store, snapshot_id, sequence, time.time(), parent)
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=sequence, seed=SEED))
    draft.publish()


def _bulk_commit(store, sequence: int, snapshot_id: str, parent: ParentRef | None) -> None:
    """A minimal committed snapshot straight from the store primitives and the library's layout:
    a manifest with no files, then its create-only commit record (publish steps 2 and 3)."""
    now = time.time()
    manifest = Manifest(format_version=FORMAT_VERSION, snapshot_id=snapshot_id, sequence=sequence, created_at=now,
                        committed_at=now, files=[], parent=parent, producer="s3_bench bulk fill")
    data = jsonl.encode_json(manifest)
    with store.open_write(f"{layout.snapshot_dir(snapshot_id)}/{layout.MANIFEST_NAME}") as fh:
        fh.write(data)
    commit = CommitRecord(format_version=FORMAT_VERSION, sequence=sequence, snapshot_id=snapshot_id,
                          manifest_size=len(data), manifest_checksum=checksum_bytes(data), committed_at=now)
    store.create_exclusive(layout.commit_key(sequence), jsonl.encode_json(commit))


def measure_discovery(sizes: tuple[int, ...], fill: str, runs: int, log: Log) -> list[dict]:
    """``latest()`` with ``sizes`` snapshots in one store (grown between measurements).

    Snapshots up to n-1 are made in parallel at explicit sequences (``fill="publish"``: the library's
    draft + publish; ``"bulk"``: manifest + commit record only); the n-th is a normal sequential
    ``begin()`` + ``publish()``, which leaves ``_latest.json`` exact as in normal operation.
    """
    make = {"publish": _publish_at, "bulk": _bulk_commit}[fill]
    ss = SnapshotStore(f"s3://{BUCKET}/discovery")
    store = ss.store
    assert isinstance(store, s3_store.S3Store)
    ids: dict[int, str] = {}
    have = 0
    out = []
    counter = RequestCounter(store.fs)
    try:
        with ThreadPoolExecutor(FILL_THREADS) as pool:
            for n in sizes:
                t0 = time.perf_counter()
                seqs = list(range(have + 1, n))
                for s in seqs:
                    ids[s] = layout.new_snapshot_id(s)
                futures = [pool.submit(make, store, s, ids[s],
                                       ParentRef(snapshot_id=ids[s - 1], sequence=s - 1) if s > 1 else None)
                           for s in seqs]
                for f in futures:
                    f.result()
                draft = ss.begin()
                assert draft.sequence == n, (draft.sequence, n)
                draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=n, seed=SEED))
                draft.publish()
                ids[n] = draft.snapshot_id
                have = n
                fill_s = time.perf_counter() - t0
                snap = ss.latest()  # warm-up (untimed)
                assert snap is not None and snap.sequence == n
                times, per_call = [], []
                for _ in range(runs):
                    counter.reset()
                    t1 = time.perf_counter()
                    snap = ss.latest()
                    times.append(time.perf_counter() - t1)
                    per_call.append(counter.take())
                    assert snap is not None and snap.sequence == n
                counter.reset()
                t1 = time.perf_counter()
                listed = discovery.committed_sequences(store)
                list_s = time.perf_counter() - t1
                list_ops = counter.take()
                assert len(listed) == n, (len(listed), n)
                counts = [sum(c.values()) for c in per_call]
                row = {"snapshots": n, "fill": fill, "fill_s": round(fill_s, 3), "filled": len(seqs),
                       "times_s": [round(t, 5) for t in times], "median_s": round(_median(times), 5),
                       "best_s": round(min(times), 5), "requests": counts[0], "requests_min": min(counts),
                       "requests_max": max(counts), "by_operation": per_call[0],
                       "listing_s": round(list_s, 5), "listing_requests": sum(list_ops.values())}
                out.append(row)
                log(f"discovery: {n} snapshots (filled {len(seqs)} in {fill_s:.1f} s): latest() median "
                    f"{row['median_s'] * 1e3:.1f} ms, {row['requests']} requests {row['by_operation']}; "
                    f"listing {list_s * 1e3:.1f} ms, {row['listing_requests']} requests")
    finally:
        counter.close()
    return out


# --------------------------------------------------------------------------------------------
# The run


def _versions() -> dict[str, str]:
    import aiobotocore
    import botocore
    import s3fs

    weed = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        exe = s3servers._bin("weed")
        weed = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    return {"seaweedfs": weed, "s3fs": s3fs.__version__, "botocore": botocore.__version__,
            "aiobotocore": aiobotocore.__version__, "pyarrow": pa.__version__, "python": sys.version.split()[0]}


def run(size_gib: float, quick: bool, log: Log | None = None) -> dict:
    """Every section on one fresh SeaweedFS; returns the results (JSON-able; see ``markdown``)."""
    if size_gib <= 0:
        raise ValueError(f"size_gib: {size_gib} (expected > 0)")
    log = log or _say
    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]

    t0 = time.perf_counter()
    batches = build_rows(int(size_gib * GIB)).batches  # the same rows as the format section
    data = arrow_file_bytes(batches)
    rows = sum(b.num_rows for b in batches)
    build_s = time.perf_counter() - t0
    log(f"built {rows:,} rows in {len(batches)} batches: {sum(b.nbytes for b in batches) / GIB:.3f} GiB in memory, "
        f"{len(data) / GB:.3f} GB as Arrow IPC ({build_s:.1f} s, not timed)")

    server = s3servers.seaweedfs()
    try:
        server.make_bucket(BUCKET)
        log(f"SeaweedFS at {server.endpoint}")
        with common.aws_env(server.env_vars()):
            measured, checks = measure_transfers(server, data, batches, rows, cfg["repeats"], log)
            requests = measure_requests(batches, cfg["request_parts"], cfg["request_rows"], log)
            disc = measure_discovery(cfg["store_sizes"], cfg["fill"], cfg["latest_runs"], log)
            tuning = measure_tuning(len(data), batches, cfg["tuning_repeats"], log)
    finally:
        server.cleanup()

    by = {(m["phase"], m["method"]): m for m in measured}
    ratios = {}
    for phase in (UPLOAD, DOWNLOAD):
        lib = by[(phase, LIBRARY[phase])]["median_s"]
        for m in measured:
            if m["phase"] == phase:
                m["library_speed_vs_this"] = round(m["median_s"] / lib, 3)
        ratios[phase] = by[(phase, BASELINE[phase])]["library_speed_vs_this"]
    result = {
        "size_gib": size_gib, "quick": quick, "repeats": cfg["repeats"], "tuning_repeats": cfg["tuning_repeats"],
        "latest_runs": cfg["latest_runs"], "rows": rows, "batches": len(batches),
        "in_memory_bytes": sum(b.nbytes for b in batches), "arrow_file_bytes": len(data), "build_s": round(build_s, 1),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "load_average_start": load_start,
                    "load_average_end": [round(x, 2) for x in os.getloadavg()], "system": platform.platform()},
        "versions": _versions(),
        "library_defaults": {"part_size": s3_store.PART_SIZE, "max_inflight_parts": s3_store.MAX_INFLIGHT_PARTS},
        "measured": measured, "ratios": ratios, "target": TARGET, "checks": checks,
        "requests": requests, "discovery": disc, "tuning": tuning,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    result["summary"] = _summary(result)
    return result


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _summary(r: dict) -> list[str]:
    out = []
    for phase in (UPLOAD, DOWNLOAD):
        ratio = r["ratios"][phase]
        verdict = "meets" if ratio >= r["target"] else "MISSES"
        out.append(f"{phase.capitalize()}: the library moves the bytes at {ratio:.2f}x plain s3fs "
                   f"({BASELINE[phase].split(':')[1].strip()}) ({verdict} the >= {r['target']}x target).")
    req = r["requests"]
    if req:
        small = [x for x in req if x["rows_per_part"] == req[0]["rows_per_part"]]
        big = [x for x in req if x["rows_per_part"] != req[0]["rows_per_part"]]
        pairs = ", ".join(f"{a['parts']} part(s): {a['requests']} -> {b['requests']} ({b['without_upload_parts']} "
                          f"without UploadPart)" for a, b in zip(small, big))
        out.append(f"Requests per snapshot follow files, not rows: with 10x the rows {pairs}.")
    d = r["discovery"]
    counts = sorted({x["requests"] for x in d} | {x["requests_max"] for x in d})
    flat = "flat" if len(counts) == 1 else "NOT flat"
    reqs = "/".join(str(x["requests"]) for x in d)
    sizes = "/".join(f"{x['snapshots']:,}" for x in d)
    ms = "/".join(f"{x['median_s'] * 1e3:.0f}" for x in d)
    out.append(f"Discovery: latest() sends {reqs} requests with {sizes} snapshots ({flat}); median {ms} ms.")
    best = max(r["tuning"], key=lambda x: x["gb_per_s"])
    default = f"{r['library_defaults']['part_size'] >> 20} MiB x {r['library_defaults']['max_inflight_parts']}"
    if best["default"]:
        out.append(f"Multipart settings: the default {default} was the fastest of {len(r['tuning'])} settings here.")
    else:
        out.append(f"Multipart settings: fastest here {best['part_size'] >> 20} MiB x {best['max_inflight_parts']} "
                   f"({best['speed_vs_default']:.2f}x the default {default}; median of {r['tuning_repeats']}).")
    return out


# --------------------------------------------------------------------------------------------
# The report


def _mb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.5 * GB else f"{n / 1e6:.1f} MB"


def _ops(ops: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in ops.items()) or "-"


def markdown(results: dict) -> str:
    r = results
    v = r["versions"]
    lines = [
        "# Object-store benchmark: snapformat on S3 (SeaweedFS) vs plain s3fs",
        "",
        f"SeaweedFS `weed mini` on 127.0.0.1 ({v['seaweedfs']}), started for this run; s3fs {v['s3fs']}, "
        f"botocore {v['botocore']}, aiobotocore {v['aiobotocore']}, pyarrow {v['pyarrow']}. Machine: {r['machine']['cpu']}, "
        f"{r['machine']['cores']} cores (shared with the server), load average {r['machine']['load_average_start']} at "
        f"start, {r['machine']['load_average_end']} at the end. {r['rows']:,} token-capture rows in {r['batches']} "
        f"record batches: {r['in_memory_bytes'] / GIB:.2f} GiB in memory, {r['arrow_file_bytes'] / GB:.3f} GB as "
        f"an Arrow IPC object; building them took {r['build_s']} s (not timed). Transfers repeated "
        f"{r['repeats']}x with the method order rotated; whole run {r['elapsed_s']:.0f} s"
        f"{' (quick run)' if r['quick'] else ''}.",
        "",
        "## Transfers (same server, same bytes)",
        "",
        "| phase | method | object | median s | best s | GB/s | S3 requests | library speed vs this |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in r["measured"]:
        vs = "reference" if m["method"] == LIBRARY[m["phase"]] else f"{m['library_speed_vs_this']:.2f}x"
        lines.append(f"| {m['phase']} | {m['method']} | {_mb(m['object_bytes'])} | {m['median_s']:.3f} | "
                     f"{m['best_s']:.3f} | {m['gb_per_s']:.3f} | {m['request_count']} | {vs} |")
    lines += ["", "## Requests per snapshot (one `begin` + `write_rows` per part + `publish`, warm store)", "",
              "| parts | files | rows per part | data per part | requests | begin / write / publish | by operation | without UploadPart |",
              "|---:|---:|---:|---:|---:|---|---|---:|"]
    for x in r["requests"]:
        lines.append(f"| {x['parts']} | {x['files']} | {x['rows_per_part']:,} | {x['bytes_per_part'] / MIB:.1f} MiB | "
                     f"{x['requests']} | {x['begin']} / {x['write']} / {x['publish']} | {_ops(x['by_operation'])} | "
                     f"{x['without_upload_parts']} |")
    lines += ["", "## Discovery: `SnapshotStore.latest()`", "",
              "| snapshots in store | made by | latest() median ms | best ms | requests per call | by operation | "
              "one listing of `_commits/`: ms / requests |",
              "|---:|---|---:|---:|---:|---|---:|"]
    for x in r["discovery"]:
        made = "1 publish"
        if x["filled"]:
            kind = "parallel library publishes" if x["fill"] == "publish" else "bulk manifest + commit"
            made = f"{kind} ({x['filled']:,} in {x['fill_s']:.0f} s) + 1 publish"
        req = str(x["requests"]) if x["requests_min"] == x["requests_max"] else f"{x['requests_min']}-{x['requests_max']}"
        lines.append(f"| {x['snapshots']:,} | {made} | {x['median_s'] * 1e3:.1f} | {x['best_s'] * 1e3:.1f} | {req} | "
                     f"{_ops(x['by_operation'])} | {x['listing_s'] * 1e3:.1f} / {x['listing_requests']} |")
    lines += ["", f"## Multipart upload settings (library upload of the same rows, {r['tuning_repeats']}x each)", "",
              "| part size | parts in flight | memory bound | median s | best s | GB/s | speed vs default |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["tuning"]:
        name = f"{x['part_size'] >> 20} MiB" + (" (default)" if x["default"] else "")
        lines.append(f"| {name} | {x['max_inflight_parts']} | {x['memory_bound_bytes'] >> 20} MiB | {x['median_s']:.3f} | "
                     f"{x['best_s']:.3f} | {x['gb_per_s']:.3f} | {x['speed_vs_default']:.2f}x |")
    lines += [""] + [f"**{s}**  " for s in r["summary"]]
    c = r["checks"]
    fill_note = ("each made through the library (`SnapshotDraft` at an explicit sequence, one JSON part, `publish`), "
                 f"{FILL_THREADS} in parallel" if r["discovery"] and r["discovery"][0]["fill"] == "publish" else
                 "made in bulk from the store primitives and the library's layout functions (a manifest listing no "
                 f"files, then its create-only commit record under `layout.commit_key`), {FILL_THREADS} in parallel")
    lines += [
        "",
        "Notes:",
        "- **GB/s** = the Arrow IPC object's size divided by the median time. **library speed vs this** = this method's "
        "median time / the library's: above 1.00x the library is faster. The target is >= "
        f"{r['target']}x against plain s3fs's defaults (`pipe_file`, `cat_file`).",
        "- Upload, library: `begin()`, `draft.part(\"tq\").write_rows(...)` from the in-memory record batches (Arrow IPC "
        "serialisation, schema and row checks, xxh3-128 while writing, parallel bounded multipart upload), `publish()` "
        "(part manifest, manifest, create-only commit record, `_latest.json`). Plain s3fs: `pipe_file` of the same "
        "Arrow IPC bytes, serialised beforehand. Both use the same endpoint, credentials and "
        "`request_checksum_calculation=\"when_required\"`.",
        "- Download, library: `snap.read_table(\"tokens\", verify=True)` on a snapshot opened before the clock starts "
        "(discovery is measured below): a HEAD for the size, then `S3Store.read_bytes` (one ranged GET of the first "
        "part; for a larger object a HEAD and the remaining part-sized ranges, 10 in parallel), the xxh3-128 check, "
        "the Arrow file opened zero-copy. Plain s3fs: `cat_file` of the same bytes.",
        "- Requests are S3 operations counted on the botocore `before-call` event of each client; the store object had "
        "already checked its bucket (one `HeadBucket` per store object) and held one snapshot, so each row is a "
        "steady-state publish. Library multipart part size: "
        f"{r['library_defaults']['part_size'] >> 20} MiB.",
        f"- Discovery: the store grows from one size to the next; snapshots before the last were {fill_note}; the last "
        "is a normal `begin()` + `publish()`, which writes `_latest.json` as in normal operation. latest() is timed "
        f"{r['latest_runs']}x on a warm store object after one untimed call.",
        "- Memory bound of the multipart writer = part size x (parts in flight + 1).",
        f"- Checks (untimed): the library's object is {c.get('library_object_bytes', 0):,} bytes, "
        f"{'identical to' if c.get('library_bytes_identical') else 'DIFFERENT from'} the baseline's bytes (xxh3-128); "
        f"the snapshot reads back {c.get('library_rows_read', 0):,} rows of {r['rows']:,}; plain s3fs reads back "
        f"{'the same' if c.get('s3fs_bytes_identical') else 'DIFFERENT'} bytes.",
        "- The server shares the 2 cores with the client (and, on a busy machine, with other work): treat the numbers "
        "as +-2x and compare rows of one run, not runs.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_bench", description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=None, help="rows to build, GiB in memory (default 1; --quick: 0.02)")
    p.add_argument("--quick", action="store_true", help="one repeat, small sizes, discovery stores filled in bulk")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="where s3.md and s3.json go (s3-quick.* with --quick)")
    opts = p.parse_args(argv)
    size = opts.size_gib if opts.size_gib is not None else (0.02 if opts.quick else 1.0)
    results = run(size, opts.quick)
    report = markdown(results)
    command = " ".join(["python -m benchmarks.s3_bench", *(argv if argv is not None else sys.argv[1:])])
    report = report.replace("\n\n", f"\n\n- **command**: `{command}`\n\n", 1)
    opts.results.mkdir(parents=True, exist_ok=True)
    stem = "s3-quick" if opts.quick else "s3"
    (opts.results / f"{stem}.md").write_text(report)
    (opts.results / f"{stem}.json").write_text(json.dumps({"command": command, "result": results}, indent=2) + "\n")
    print()
    print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
