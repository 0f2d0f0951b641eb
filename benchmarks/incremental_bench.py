"""The incremental-snapshot benchmark (issue 21): what a save writes, how long it takes and how many
store requests it sends when a growing TransferQueue is snapshotted again and again, incremental
(format 1.3 segments, shared objects) against full (one row file per kind), on local disk and on
SeaweedFS; the restore of the last snapshot of each; and the mark-and-sweep GC of a large store.

    python -m benchmarks.run --section incremental            # 100,000 rows, 20 snapshots -> results/incremental.md
    python -m benchmarks.run --section incremental --quick    # 10,000 rows, 8 snapshots -> results/incremental-quick.md

**1. Successive snapshots.** One Ray + TQ (``benchmarks.common.tq_runtime``, as the tq section) and
one SeaweedFS (``devtools.s3servers.seaweedfs``, as the s3 section). TQ is filled through the TQ
adapter's ``put`` with :data:`START_ROWS` training rows built as the tq section builds them
(``common.row_batch``: ``input_ids`` int32 + ``generation_logprobs`` float32, 256 tokens, dense;
~2 KiB per row), :data:`PUT_BATCH` rows per ``kv_batch_put``. Then, per interval: the adapter puts
``growth`` x the rows TQ holds (new keys), ``tq.kv_clear`` removes the ``consume`` oldest keys (as a
consumer would), the pause's share of a cut is taken once (``TQDataPlane.deferred_cut()``) and the
same cut is saved four times, the order rotating per interval: *incremental* into store A and *full*
into store B on local disk, the same into stores A' and B' on SeaweedFS. A save is the coordinator's
write path: ``SnapshotStore.begin()`` + ``coordinator.checkpoint.cut.write_cut_parts(draft, cut,
incremental=..., parent_segments=...)`` (the rows of ``tq/`` as segments, listing again those of the
previous snapshot through the :class:`ParentSegments` the store's "checkpointer" keeps, as
``save.write_and_publish`` does; or one file per kind; plus ``controller/``: loader place, replay
index, recovery ledger) + ``draft.publish()``. The controller's replay index holds one entry per
row TQ holds, as the coordinator's does for rows not yet trained on. Each store is wrapped in a
:class:`MeteredStore` (:class:`snapformat.store.counting.CountingStore` plus the bytes handed to
every write), and on SeaweedFS the S3 operations are counted on botocore's ``before-call`` event
(``s3_bench.RequestCounter``). The full stores keep their newest two snapshots (retention after
each save, untimed), so the disk holds two copies, not twenty.

Also, on local disk between two intervals, a *no-new-rows* incremental save of the unchanged TQ
(a probe: the part of a save that grows with the rows TQ holds, whatever is new); it is published
into store A, so the next incremental snapshot's parent is that probe (which lists the same
segments as the snapshot before it).

**2. Restore.** TQ cleared, then ``SnapshotStore.latest()`` + ``TQDataPlane.load(snap, "tq")``
(every segment's or file's checksum verified, rows parsed and kept) of the last incremental and the
last full snapshot, alternating, :data:`FULL` ``restore_repeats`` each: the time it returns, and
(local disk) the time until its background load has put every value into TQ (``wait_loaded()``).

**3. GC.** A local store of ``snapshots`` snapshots naming ``objects`` shared objects in all (each
snapshot the next ``objects / snapshots`` objects plus half as many of its parent's), built fast:
object files written straight under ``objects/<2>/<64>`` (their SHA-256 as name, 64-512 random
bytes each, no fsync), snapshots by ``begin()`` / ``part.reference(...)`` / ``publish()``; then
every object is aged two days. Per repeat, :data:`GC_GARBAGE` x ``objects`` fresh unreferenced
objects aged past the grace period (``os.utime``), then ``snapformat.retention.gc`` timed. On
SeaweedFS, stores of the same shape but smaller (objects written with ``put_object``), GC'd once
with the clock moved past the grace period (``gc(now=...)``): its S3 requests, extrapolated.
"""

from __future__ import annotations

import contextlib
import gc as _gc
import hashlib
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Self

import numpy as np

from benchmarks import common
from benchmarks.common import GIB, MIB, Log

PARTITION = "bench"
ROW_TOKENS = 256  # as the tq section: ~2 KiB of int32 + float32 values per row
LAYOUT = "dense"
#: Rows per ``kv_batch_put``: larger than the tq section's 16 (which keeps TQ's *own* checkpoint
#: small; not used here) so that filling 100,000+ rows does not dominate the run.
PUT_BATCH = 256
BUCKET = "incbench"
INC, FULL_MODE = "incremental", "full"
LOCAL, S3 = "local", "s3"
HOUR = 3600.0
GC_GARBAGE = 0.05  # unreferenced objects per referenced one, made anew before every GC repeat
GC_OBJECT_BYTES = (64, 512)
GC_KIND = "bench_object"  # the kind the GC stores' entries carry (opaque bytes; GC reads only manifests)
FILL_THREADS = 8
TQ_TIMEOUT_S = 3600

TARGET_BYTES = 1.1  # incremental bytes written <= 1.1 x (new rows' bytes + small parts)
TARGET_SLOPE = 0.2  # log-log slope of incremental save time against rows held, snapshots 2..N
TARGET_RESTORE = 1.1  # incremental restore <= 1.1 x full restore
TARGET_GC_S = 60.0  # GC of 1,000 snapshots / 100,000 objects on local disk

FULL = {"start_rows": 100_000, "snapshots": 20, "growth": 0.05, "consume": 1_000, "restore_repeats": 5,
        "s3": True, "gc_local": (1_000, 100_000), "gc_repeats": 5, "gc_s3": ((50, 5_000), (100, 10_000))}
QUICK = {"start_rows": 10_000, "snapshots": 8, "growth": 0.05, "consume": 100, "restore_repeats": 3,
         "s3": True, "gc_local": (100, 10_000), "gc_repeats": 3, "gc_s3": ((10, 1_000), (20, 2_000))}
SMALLEST = {"start_rows": 600, "snapshots": 3, "growth": 0.05, "consume": 10, "restore_repeats": 1,
            "s3": True, "gc_local": (10, 1_000), "gc_repeats": 1, "gc_s3": ((4, 400), (8, 800))}


# --------------------------------------------------------------------------------------------
# Stores that count


def _metered_class():
    from snapformat.store.counting import CountingStore

    class MeteredStore(CountingStore):
        """A :class:`CountingStore` that also adds up the bytes handed to every write (``open_write``
        streams, ``put_bytes``, ``create_exclusive``): what a save wrote, whatever the backend."""

        def __init__(self, inner) -> None:
            super().__init__(inner)
            self.bytes_written = 0

        def put_bytes(self, key: str, data: bytes) -> None:
            self.bytes_written += len(data)
            super().put_bytes(key, data)

        def create_exclusive(self, key: str, data: bytes) -> None:
            self.bytes_written += len(data)
            super().create_exclusive(key, data)

        def open_write(self, key: str) -> BinaryIO:
            return _MeteredStream(super().open_write(key), self)  # type: ignore[return-value]

        def take(self) -> tuple[dict[str, int], int]:
            """(calls by method, bytes written) since the last take, then reset."""
            calls, written = dict(sorted(self.calls.items())), self.bytes_written
            self.calls, self.bytes_written, self.walked = {}, 0, 0
            return calls, written

    return MeteredStore


class _MeteredStream:
    """A store's write stream whose ``write`` adds to its store's byte count."""

    def __init__(self, inner: Any, owner: Any) -> None:
        self._inner, self._owner = inner, owner

    def write(self, data: Any) -> int:
        n = self._inner.write(data)
        self._owner.bytes_written += memoryview(data).nbytes
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._inner.close()
        else:
            self._inner.abort()


class Target:
    """One store a mode saves into: its metered store, snapshot store, S3 request counter (S3 only)
    and the segments of its newest snapshot (what the next incremental save lists again)."""

    def __init__(self, name: str, where: str, mode: str, inner: Any, counter: Any = None) -> None:
        from coordinator.checkpoint.history import ParentSegments
        from snapformat import SnapshotStore

        self.name, self.where, self.mode = name, where, mode
        self.inner = inner
        self.metered = _metered_class()(inner)
        self.ss = SnapshotStore(self.metered)
        self.counter = counter
        self.segments = ParentSegments()
        self.records: list[dict[str, Any]] = []

    def take_ops(self) -> dict[str, int]:
        return self.counter.take() if self.counter is not None else {}


# --------------------------------------------------------------------------------------------
# TQ: fill, grow, consume


class Rows:
    """The rows TQ holds: keys ``r<lo>`` .. ``r<hi - 1>`` of partition :data:`PARTITION` (oldest first),
    and the values of a few of them, to check after every restore."""

    def __init__(self, plane: Any, seed: int) -> None:
        self.plane = plane
        self.rng = np.random.default_rng(seed)
        self.lo = self.hi = 0
        self.samples: dict[str, dict[str, np.ndarray]] = {}
        self.put_s = 0.0

    @property
    def count(self) -> int:
        return self.hi - self.lo

    def put(self, n: int, log: Log, what: str) -> None:
        t0 = time.perf_counter()
        last = t0
        for start in range(self.hi, self.hi + n, PUT_BATCH):
            m = min(PUT_BATCH, self.hi + n - start)
            b = common.row_batch(self.rng, start, m, LAYOUT, ROW_TOKENS)
            self.plane.put(PARTITION, b.keys, b.fields, b.tags)
            if start + m == self.hi + n:  # the last row of every put: kept to check restores
                self.samples[b.keys[-1]] = common.row_values(b, m - 1)
            if time.perf_counter() - last > 20:
                last = time.perf_counter()
                log(f"incremental: {what}: {start + m - self.hi:,} of {n:,} rows put ({last - t0:.0f} s)")
        self.hi += n
        self.put_s += time.perf_counter() - t0

    def consume(self, n: int) -> None:
        """``tq.kv_clear`` of the ``n`` oldest keys (a consumer taking them)."""
        import transfer_queue as tq

        n = min(n, self.count)
        if n:
            tq.kv_clear(keys=[_key(i) for i in range(self.lo, self.lo + n)], partition_id=PARTITION)
            for k in [k for k in self.samples if int(k[1:]) < self.lo + n]:
                del self.samples[k]
            self.lo += n

    def records(self, sequence: int):
        """The controller's records as a coordinator holding these rows has them: the loader's place
        and one replay-index entry per row TQ holds (``ready``: not trained on yet)."""
        from coordinator.bookkeeping import ControllerRecords
        from schemas.controller import LoaderPlace, ReplayIndexEntry

        replay = [ReplayIndexEntry(key=_key(i), partition_id=PARTITION, rollout_id=_key(i), attempt_index=0,
                                   group_id=f"g{i // 16:07d}", status="ready") for i in range(self.lo, self.hi)]
        return ControllerRecords(loader=LoaderPlace(epoch=0, consumed=self.hi, seed=0), ledger=[], replay=replay)

    def check(self) -> None:
        """TQ lists exactly the rows held, and the sampled rows hold what was put."""
        import transfer_queue as tq

        listed = list(tq.kv_list().get(PARTITION, {}))
        if len(listed) != self.count or listed[:1] != [_key(self.lo)] or listed[-1:] != [_key(self.hi - 1)]:
            raise AssertionError(f"TQ lists {len(listed)} keys ({listed[:1]}..{listed[-1:]}), expected "
                                 f"{self.count} ({_key(self.lo)}..{_key(self.hi - 1)})")
        keys = list(self.samples)
        got = common.tq_row_values(PARTITION, keys, list(self.samples[keys[0]]))
        if not common.same_rows([self.samples[k] for k in keys], got):
            raise AssertionError(f"TQ's values of the sampled rows {keys} differ from what was put")


def _key(i: int) -> str:
    return f"r{i:07d}"


# --------------------------------------------------------------------------------------------
# 1. Successive snapshots


def _row_bytes(manifest) -> int:
    from coordinator.dataplane.row_kinds import FILE_NAMES

    return sum(f.size for f in manifest.files if f.kind in FILE_NAMES and f.path.startswith("tq/"))


def save(target: Target, cut: Any, timer: Any, total_rows: int, new_rows: int, snapshot: int,
         probe: bool = False) -> dict[str, Any]:
    """One save of ``cut`` into ``target`` (begin + write_cut_parts + publish), timed and metered."""
    from coordinator.checkpoint.cut import write_cut_parts

    incremental = target.mode == INC
    target.metered.take()
    target.take_ops()
    timer.take()
    _gc.collect()
    t0 = time.perf_counter()
    draft = target.ss.begin()
    t1 = time.perf_counter()
    rows, _ = write_cut_parts(draft, cut, incremental=incremental, parent_segments=target.segments.get())
    t2 = time.perf_counter()
    published = draft.publish()
    t3 = time.perf_counter()
    calls, written = target.metered.take()
    ops = target.take_ops()
    inside = timer.take()
    if incremental:
        target.segments.set(rows.segments)  # what the next save lists again, now that this one is published
    manifest = published.manifest
    row_written = rows.new_bytes if incremental else _row_bytes(manifest)
    entries = [f for f in manifest.files if f.object is not None]
    rec = {
        "snapshot": snapshot, "probe": probe, "mode": target.mode, "store": target.where,
        "sequence": manifest.sequence, "total_rows": total_rows, "new_rows": new_rows,
        "rows_saved": sum(rows.rows.values()),
        "bytes_written": written, "row_bytes_written": row_written, "small_bytes": written - row_written,
        "shared_bytes": rows.shared_bytes, "row_bytes_listed": _row_bytes(manifest),
        "segments_listed": len(entries),
        "segments_new": sum(1 for f in entries if manifest.snapshot_id in f.path),  # segment_name holds the writer's id
        "save_s": round(t3 - t0, 5), "begin_s": round(t1 - t0, 5), "write_s": round(t2 - t1, 5),
        "rows_write_s": round(sum(inside.values()), 5), "publish_s": round(t3 - t2, 5),
        "store_calls": calls, "store_calls_total": sum(calls.values()),
        "s3_ops": ops, "s3_requests": sum(ops.values()) if ops else None,
    }
    if rec["rows_saved"] != total_rows:
        raise AssertionError(f"{target.name} snapshot {snapshot}: saved {rec['rows_saved']} rows, TQ holds {total_rows}")
    if incremental and snapshot > 1 and not probe and rows.shared_bytes <= 0:
        raise AssertionError(f"{target.name} snapshot {snapshot}: listed nothing of its parent (no reuse)")
    return rec


def run_snapshots(cfg: dict[str, Any], targets: list[Target], plane: Any, rows: Rows, log: Log
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The intervals: grow, consume, one cut, one save per target (order rotating), and the probe."""
    from coordinator.checkpoint.cut import Cut
    from snapformat.retention import apply_retention

    intervals, probes = [], []
    probe_target = next(t for t in targets if t.where == LOCAL and t.mode == INC)
    for i in range(1, cfg["snapshots"] + 1):
        grew = consumed = 0
        t_grow = 0.0
        if i > 1:
            grew = max(1, round(cfg["growth"] * rows.count))
            t0 = time.perf_counter()
            rows.put(grew, log, f"interval {i}")
            t_grow = time.perf_counter() - t0
            before = rows.count
            rows.consume(cfg["consume"])
            consumed = before - rows.count
        new_rows = rows.count if i == 1 else grew  # the first snapshot has no parent: every row is new
        records = rows.records(i)
        t0 = time.perf_counter()
        deferred = plane.deferred_cut()
        pause_s = time.perf_counter() - t0
        cut = Cut(deferred, records, pause_s)
        timer = common.MethodTimer(deferred, ("write_segments", "write"))
        k = (i - 1) % len(targets)
        out: dict[str, dict[str, Any]] = {}
        for target in targets[k:] + targets[:k]:
            rec = save(target, cut, timer, rows.count, new_rows, i)
            target.records.append(rec)
            out[target.name] = rec
            if target.mode == FULL_MODE:
                apply_retention(target.inner, 2)  # untimed, uncounted: the disk holds two full copies
        iv = {"snapshot": i, "total_rows": rows.count, "new_rows": new_rows, "grew": grew, "consumed": consumed,
              "pause_s": round(pause_s, 5), "grow_put_s": round(t_grow, 3), "order": [t.name for t in
                                                                                       targets[k:] + targets[:k]]}
        intervals.append(iv)
        log(f"incremental: snapshot {i}/{cfg['snapshots']}: {rows.count:,} rows ({new_rows:,} new, {consumed:,} "
            f"consumed; put in {t_grow:.1f} s), pause {pause_s:.3f} s; " + "; ".join(
                f"{n} {r['save_s']:.3f} s {r['bytes_written'] / MIB:.1f} MiB {r['store_calls_total']} calls"
                + (f" {r['s3_requests']} S3 req" if r["s3_requests"] is not None else "")
                for n, r in out.items()))
        if i < cfg["snapshots"]:
            rec = save(probe_target, cut, timer, rows.count, 0, i, probe=True)
            probes.append(rec)
        timer.close()
        del cut, deferred, records
    return intervals, probes


# --------------------------------------------------------------------------------------------
# 2. Restore


def measure_restore(targets: list[Target], plane: Any, rows: Rows, repeats: int, until_loaded: bool,
                    log: Log) -> dict[str, Any]:
    """The last snapshot of each target (one incremental, one full, same place) loaded into an empty
    TQ, alternating, ``repeats`` each: when load returns, and (``until_loaded``) when TQ holds all."""
    from snapformat import SnapshotStore

    times: dict[str, dict[str, list[float]]] = {t.mode: {"returns": [], "loaded": []} for t in targets}
    parts: dict[str, dict[str, list[float]]] = {t.mode: {"read": [], "put_back": []} for t in targets}
    probe = common.MethodTimer(plane, ("_read_segments", "_read_files", "restore_partitions"))
    calls: dict[str, dict[str, int]] = {}
    ops: dict[str, dict[str, int]] = {}
    files: dict[str, int] = {}
    for rep in range(repeats):
        for target in (targets if rep % 2 == 0 else targets[::-1]):
            plane.clear()
            _gc.collect()
            target.metered.take()
            target.take_ops()
            probe.take()
            t0 = time.perf_counter()
            snap = SnapshotStore(target.metered).latest()
            assert snap is not None
            report = plane.load(snap, "tq")
            returns = time.perf_counter() - t0
            calls[target.mode], _ = target.metered.take()
            ops[target.mode] = target.take_ops()
            files[target.mode] = len(report.files)
            if sum(report.rows.values()) != rows.count:
                raise AssertionError(f"{target.name}: load gave {sum(report.rows.values())} rows, expected {rows.count}")
            times[target.mode]["returns"].append(returns)
            inside = probe.take()
            parts[target.mode]["read"].append(inside.get("_read_segments", 0.0) + inside.get("_read_files", 0.0))
            parts[target.mode]["put_back"].append(inside.get("restore_partitions", 0.0))
            msg = (f"incremental: restore {rep + 1}/{repeats} {target.name}: returns in {returns:.3f} s (read, verify, "
                   f"parse {parts[target.mode]['read'][-1]:.3f} s)")
            if until_loaded:
                plane.wait_loaded(TQ_TIMEOUT_S)
                loaded = time.perf_counter() - t0
                times[target.mode]["loaded"].append(loaded)
                rows.check()
                msg += f", TQ holds every value after {loaded:.2f} s (rows checked)"
            log(msg)
    plane.clear()
    probe.close()
    med = {m: {k: round(statistics.median(v), 4) for k, v in d.items() if v} for m, d in times.items()}
    ratio = {k: round(med[INC][k] / med[FULL_MODE][k], 3) for k in med[INC]}
    return {"repeats": repeats, "times_s": {m: {k: [round(x, 4) for x in v] for k, v in d.items()}
                                            for m, d in times.items()},
            "median_s": med, "inc_over_full": ratio, "store_calls": calls,
            "parts_median_s": {m: {k: round(statistics.median(v), 4) for k, v in d.items()} for m, d in parts.items()},
            "store_calls_total": {m: sum(c.values()) for m, c in calls.items()},
            "s3_ops": ops, "s3_requests": {m: sum(o.values()) for m, o in ops.items()} if any(ops.values()) else None,
            "files_read": files, "until_loaded": until_loaded}


def checksum_speed(nbytes: int = 128 * MIB) -> dict[str, float]:
    """GB/s of SHA-256 (shared objects' checksum) and xxh3-128 (a snapshot folder's files) over one
    buffer: a restore verifies every byte it reads with one or the other."""
    import xxhash

    data = np.random.default_rng(0).bytes(nbytes)
    out = {}
    for name, fn in (("sha256", lambda: hashlib.sha256(data).digest()), ("xxh3_128", lambda: xxhash.xxh3_128(data).digest())):
        best = min(_timed(fn) for _ in range(3))
        out[name] = round(nbytes / best / 1e9, 2)
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# 3. GC


def _object_bytes(rng: np.random.Generator) -> bytes:
    return rng.bytes(int(rng.integers(GC_OBJECT_BYTES[0], GC_OBJECT_BYTES[1] + 1)))


def _write_object_file(root: Path, data: bytes) -> str:
    """``data`` as the object file ``objects/<2>/<64>`` of a local store (no fsync); its name."""
    from snapformat import layout

    name = "sha256:" + hashlib.sha256(data).hexdigest()
    path = root / layout.object_key(name)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return name


def _entry(j: int, name: str, size: int):
    from schemas.manifest import FileEntry

    return FileEntry(path=f"bench/o{j:07d}.bin", kind=GC_KIND, size=size, checksum=name, records=1,
                     writer="bench", object=name)


def _windows(snapshots: int, objects: int) -> list[tuple[int, int]]:
    """Objects ``[lo, hi)`` snapshot ``s`` names: the next ``objects / snapshots`` new ones, and half as
    many of its parent's (the union is every object)."""
    per = objects // snapshots
    out = []
    for s in range(snapshots):
        lo = max(0, s * per - per // 2)
        hi = objects if s == snapshots - 1 else (s + 1) * per
        out.append((lo, hi))
    return out


def _publish_windows(ss: Any, entries: list[Any], windows: list[tuple[int, int]], log: Log, what: str) -> float:
    t0 = time.perf_counter()
    last = t0
    for s, (lo, hi) in enumerate(windows):
        draft = ss.begin()
        part = draft.part("bench", writer="bench")
        for j in range(lo, hi):
            part.reference(entries[j])
        draft.publish()
        if time.perf_counter() - last > 20:
            last = time.perf_counter()
            log(f"incremental: {what}: {s + 1:,} of {len(windows):,} snapshots published ({last - t0:.0f} s)")
    return time.perf_counter() - t0


def measure_gc_local(work: Path, snapshots: int, objects: int, repeats: int, log: Log) -> dict[str, Any]:
    from snapformat import SnapshotStore
    from snapformat.retention import gc

    root = work / "gc-store"
    ss = SnapshotStore(str(root))
    ss.begin().abandon()  # the store's marker
    rng = np.random.default_rng(21)
    t0 = time.perf_counter()
    entries = []
    for j in range(objects):
        data = _object_bytes(rng)
        entries.append(_entry(j, _write_object_file(root, data), len(data)))
    objects_s = time.perf_counter() - t0
    publish_s = _publish_windows(ss, entries, _windows(snapshots, objects), log, f"GC store ({snapshots:,} snapshots)")
    old = time.time() - 2 * 24 * HOUR
    for p in (root / "objects").rglob("*"):
        if p.is_file():
            os.utime(p, (old, old))
    log(f"incremental: GC store built: {objects:,} object files in {objects_s:.1f} s, {snapshots:,} snapshots "
        f"published in {publish_s:.1f} s (not timed)")
    garbage = max(1, round(GC_GARBAGE * objects))
    times, reports = [], []
    for rep in range(repeats):
        aged = time.time() - 2 * HOUR
        for _ in range(garbage):
            p = root / _layout_key(_write_object_file(root, _object_bytes(rng)))
            os.utime(p, (aged, aged))
        _gc.collect()
        t1 = time.perf_counter()
        report = gc(ss.store, min_age_s=HOUR, grace_s=HOUR)
        dt = time.perf_counter() - t1
        if len(report.swept_objects) != garbage or report.kept_objects.committed != objects or report.objects_not_swept:
            raise AssertionError(f"GC swept {len(report.swept_objects)} (expected {garbage}), kept "
                                 f"{report.kept_objects.committed} committed (expected {objects}): "
                                 f"{report.objects_not_swept}")
        times.append(dt)
        reports.append(report)
        log(f"incremental: GC {rep + 1}/{repeats} of {snapshots:,} snapshots / {objects + garbage:,} objects: "
            f"{dt:.2f} s, swept {len(report.swept_objects):,}, kept {report.kept_objects.committed:,}; "
            f"store calls {report.store_calls}")
    last = reports[-1]
    return {"snapshots": snapshots, "objects": objects, "garbage": garbage, "repeats": repeats,
            "object_files_s": round(objects_s, 2), "publish_s": round(publish_s, 2),
            "times_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3),
            "swept": len(last.swept_objects), "swept_bytes": last.swept_object_bytes,
            "kept": {"committed": last.kept_objects.committed, "drafts": last.kept_objects.drafts,
                     "young": last.kept_objects.young, "bytes": last.kept_objects.bytes},
            "store_calls": last.store_calls,
            "store_calls_total": sum(v for k, v in last.store_calls.items() if k != "walked")}


def _layout_key(name: str) -> str:
    from snapformat import layout

    return layout.object_key(name)


def measure_gc_s3(sizes: tuple[tuple[int, int], ...], log: Log) -> dict[str, Any]:
    from benchmarks.s3_bench import RequestCounter
    from snapformat import SnapshotStore
    from snapformat.objects import put_object
    from snapformat.retention import gc
    from snapformat.store import s3 as s3_store

    out = []
    rng = np.random.default_rng(2121)
    for snapshots, objects in sizes:
        inner = s3_store.S3Store(f"s3://{BUCKET}/gc-{snapshots}")
        ss = SnapshotStore(inner)
        datas = [_object_bytes(rng) for _ in range(objects)]
        garbage = max(1, round(GC_GARBAGE * objects))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(FILL_THREADS) as pool:
            written = list(pool.map(put_object, [inner] * objects, datas))
            list(pool.map(put_object, [inner] * garbage, [_object_bytes(rng) for _ in range(garbage)]))
        objects_s = time.perf_counter() - t0
        entries = [_entry(j, w.name, w.size) for j, w in enumerate(written)]
        publish_s = _publish_windows(ss, entries, _windows(snapshots, objects), log,
                                     f"SeaweedFS GC store ({snapshots} snapshots)")
        counter = RequestCounter(inner.fs)
        try:
            counter.reset()
            t1 = time.perf_counter()
            report = gc(inner, min_age_s=HOUR, grace_s=HOUR, now=time.time() + 2 * HOUR)
            dt = time.perf_counter() - t1
            ops = counter.take()
        finally:
            counter.close()
        if len(report.swept_objects) != garbage or report.kept_objects.committed != objects:
            raise AssertionError(f"SeaweedFS GC swept {len(report.swept_objects)} (expected {garbage}), kept "
                                 f"{report.kept_objects.committed} (expected {objects}): {report.objects_not_swept}")
        row = {"snapshots": snapshots, "objects": objects, "garbage": garbage, "seconds": round(dt, 3),
               "objects_s": round(objects_s, 2), "publish_s": round(publish_s, 2),
               "s3_ops": ops, "s3_requests": sum(ops.values()), "store_calls": report.store_calls,
               "store_calls_total": sum(v for k, v in report.store_calls.items() if k != "walked"),
               "swept": len(report.swept_objects), "kept": report.kept_objects.committed}
        out.append(row)
        log(f"incremental: SeaweedFS GC of {snapshots} snapshots / {objects + garbage:,} objects: {dt:.2f} s, "
            f"{row['s3_requests']} S3 requests {ops}")
    return {"sizes": out, "extrapolated": _extrapolate(out, FULL["gc_local"])}


def _extrapolate(rows: list[dict[str, Any]], to: tuple[int, int]) -> dict[str, Any] | None:
    """S3 requests of a GC of ``to`` = (snapshots, objects), from a line through the measured sizes
    (same shape: requests = a + b x scale, scale = snapshots) per operation."""
    if len(rows) < 2:
        return None
    a, b = rows[-2], rows[-1]
    scale = to[0]
    per_op = {}
    for op in sorted(set(a["s3_ops"]) | set(b["s3_ops"])):
        ya, yb = a["s3_ops"].get(op, 0), b["s3_ops"].get(op, 0)
        slope = (yb - ya) / (b["snapshots"] - a["snapshots"])
        per_op[op] = max(0, round(yb + slope * (scale - b["snapshots"])))
    slope = (b["s3_requests"] - a["s3_requests"]) / (b["snapshots"] - a["snapshots"])
    return {"snapshots": to[0], "objects": to[1], "garbage": round(GC_GARBAGE * to[1]),
            "per_snapshot": round(slope, 2), "per_object": round(slope * b["snapshots"] / b["objects"], 4),
            "fixed": round(b["s3_requests"] - slope * b["snapshots"], 1),
            "s3_requests": round(b["s3_requests"] + slope * (scale - b["snapshots"])), "by_operation": per_op}


# --------------------------------------------------------------------------------------------
# The run


def _slope(xs: list[float], ys: list[float]) -> float | None:
    pts = [(x, y) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    return round(float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0]), 3)


def analyse(r: dict[str, Any]) -> dict[str, Any]:
    """Targets and fits, from the measured records."""
    out: dict[str, Any] = {"bytes": {}, "slope": {}}
    full_of = {(x["store"], x["snapshot"]): x for x in r["saves"] if x["mode"] == FULL_MODE}
    for where in r["stores"]:
        inc = [x for x in r["saves"] if x["mode"] == INC and x["store"] == where]
        full = [x for x in r["saves"] if x["mode"] == FULL_MODE and x["store"] == where]
        ratios = []
        for x in inc:
            f = full_of[(where, x["snapshot"])]
            new_row_bytes = f["row_bytes_written"] * x["new_rows"] / x["total_rows"]
            x["new_row_bytes_est"] = round(new_row_bytes)
            x["allowance_bytes"] = round(new_row_bytes + x["small_bytes"])
            x["bytes_ratio"] = round(x["bytes_written"] / x["allowance_bytes"], 4)
            x["bytes_vs_full"] = round(x["bytes_written"] / f["bytes_written"], 4)
            if x["snapshot"] > 1:
                ratios.append(x)
        steady = ratios
        worst = max(steady, key=lambda x: x["bytes_ratio"]) if steady else None
        agg = (sum(x["bytes_written"] for x in steady) / sum(x["allowance_bytes"] for x in steady)) if steady else None
        out["bytes"][where] = {
            "worst": worst["bytes_ratio"] if worst else None, "worst_snapshot": worst["snapshot"] if worst else None,
            "over_target": [x["snapshot"] for x in steady if x["bytes_ratio"] > TARGET_BYTES],
            "aggregate": round(agg, 4) if agg else None,
            "median": round(statistics.median(x["bytes_ratio"] for x in steady), 4) if steady else None,
            "pass": bool(steady) and all(x["bytes_ratio"] <= TARGET_BYTES for x in steady)}
        fit = {}
        for mode, recs in ((INC, inc), (FULL_MODE, full)):
            later = [x for x in recs if x["snapshot"] > 1]
            xs = [x["total_rows"] for x in later]
            fit[mode] = {"save_s": _slope(xs, [x["save_s"] for x in later]),
                         "rows_write_s": _slope(xs, [x["rows_write_s"] for x in later]),
                         "bytes_written": _slope(xs, [x["bytes_written"] for x in later])}
            if mode == INC:
                fit[mode]["save_s_per_new_row"] = _slope(xs, [x["save_s"] / x["new_rows"] for x in later])
                fit[mode]["save_s_vs_new_rows"] = _slope([x["new_rows"] for x in later], [x["save_s"] for x in later])
        out["slope"][where] = fit
    probes = r["probes"]
    later = [x for x in probes if x["snapshot"] > 1] or probes
    out["probe_slope"] = _slope([x["total_rows"] for x in later], [x["save_s"] for x in later])
    newr = [x["new_rows"] for x in r["intervals"][1:]]
    tot = [x["total_rows"] for x in r["intervals"][1:]]
    out["new_vs_total_slope"] = _slope(tot, newr)
    # New rows per interval are a share of the rows held, so they grow with them: a save that grows
    # with new rows, not total rows, is one whose time per new row stays flat against total rows.
    s = out["slope"][LOCAL][INC]["save_s_per_new_row"]
    out["slope_pass"] = s is not None and s < TARGET_SLOPE
    rest = r["restore"][LOCAL]
    out["restore_pass"] = {k: v <= TARGET_RESTORE for k, v in rest["inc_over_full"].items()}
    out["gc_pass"] = r["gc_local"]["median_s"] < TARGET_GC_S
    return out


def run(cfg: dict[str, Any], quick: bool, scratch: Path, results: Path | None, log: Log) -> dict[str, Any]:
    from benchmarks import s3_bench
    from benchmarks.tq_bench import _raise_tq_storage_timeout, _tq_version
    from coordinator.dataplane.segments import MIN_HELD_FRACTION, SEGMENT_BYTES, SEGMENT_ROWS, SUFFIX_MIN_FRACTION
    from coordinator.dataplane.tq.adapter import TQDataPlane
    from devtools import s3servers
    from snapformat import LocalStore
    from snapformat.store import s3 as s3_store

    started = time.perf_counter()
    load_start = common.load_average()
    _raise_tq_storage_timeout(log)
    common.tq_runtime(log)
    work, cleanup = common.work_folder(scratch, "incremental")
    plane = TQDataPlane()  # the coordinator's defaults (a restore puts 1,024 rows per kv_batch_put)
    server = None
    counters: list[Any] = []
    result: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            targets = [Target(f"{LOCAL} {INC}", LOCAL, INC, LocalStore(str(work / "inc"))),
                       Target(f"{LOCAL} {FULL_MODE}", LOCAL, FULL_MODE, LocalStore(str(work / "full")))]
            if cfg["s3"]:
                server = s3servers.seaweedfs()
                server.make_bucket(BUCKET)
                log(f"incremental: SeaweedFS at {server.endpoint}")
                stack.enter_context(common.aws_env(server.env_vars()))
                for mode in (INC, FULL_MODE):
                    inner = s3_store.S3Store(f"s3://{BUCKET}/{mode}")
                    counter = s3_bench.RequestCounter(inner.fs)
                    counters.append(counter)
                    targets.append(Target(f"{S3} {mode}", S3, mode, inner, counter))
            plane.clear()
            rows = Rows(plane, seed=cfg["start_rows"])
            rows.put(cfg["start_rows"], log, "fill")
            fill_s = rows.put_s
            log(f"incremental: TQ filled with {rows.count:,} rows in {fill_s:.1f} s ({PUT_BATCH} per put, not timed)")
            intervals, probes = run_snapshots(cfg, targets, plane, rows, log)
            restore = {LOCAL: measure_restore([t for t in targets if t.where == LOCAL], plane, rows,
                                              cfg["restore_repeats"], True, log)}
            if cfg["s3"]:
                restore[S3] = measure_restore([t for t in targets if t.where == S3], plane, rows,
                                              cfg["restore_repeats"], False, log)
            hashes = checksum_speed()
            gc_local = measure_gc_local(work, *cfg["gc_local"], cfg["gc_repeats"], log)
            gc_s3 = measure_gc_s3(cfg["gc_s3"], log) if cfg["s3"] else None
            weed = s3_bench._versions()["seaweedfs"] if cfg["s3"] else None
    finally:
        for c in counters:
            c.close()
        try:
            plane.clear()
        finally:
            if server is not None:
                server.cleanup()
            cleanup()
    result = {
        "quick": quick, "config": dict(cfg), "row_tokens": ROW_TOKENS, "layout": LAYOUT, "put_batch": PUT_BATCH,
        "partition": PARTITION, "fill_s": round(fill_s, 1),
        "segment": {"rows": SEGMENT_ROWS, "bytes": SEGMENT_BYTES, "min_held_fraction": MIN_HELD_FRACTION,
                    "suffix_min_fraction": SUFFIX_MIN_FRACTION},
        "stores": [LOCAL, S3] if cfg["s3"] else [LOCAL],
        "intervals": intervals, "saves": [rec for t in targets for rec in t.records], "probes": probes,
        "restore": restore, "checksum_gb_per_s": hashes, "gc_local": gc_local, "gc_s3": gc_s3,
        "versions": {"transferqueue": _tq_version(), "seaweedfs": weed},
        "load_average": {"start": load_start, "end": common.load_average()},
        "elapsed_s": round(time.perf_counter() - started, 1), "plots": [],
    }
    result["analysis"] = analyse(result)
    if results is not None:
        result["plots"].append(str(plot(result, results)))
    return result


# --------------------------------------------------------------------------------------------
# Plot and report


def plot(r: dict[str, Any], results: Path) -> Path:
    series = []
    for where, style in ((LOCAL, "-"), (S3, "--")):
        if where not in r["stores"]:
            continue
        label = "local disk" if where == LOCAL else "SeaweedFS"
        for mode, marker in ((FULL_MODE, "s"), (INC, "o")):
            recs = [x for x in r["saves"] if x["store"] == where and x["mode"] == mode]
            name = "full (one row file per kind)" if mode == FULL_MODE else "incremental (segments)"
            series.append((f"{name}, {label}", [x["snapshot"] for x in recs],
                           [x["bytes_written"] / MIB for x in recs], marker + style))
    inc = [x for x in r["saves"] if x["store"] == LOCAL and x["mode"] == INC]
    series.append(("new rows' bytes + small parts (the target's basis)", [x["snapshot"] for x in inc],
                   [x["allowance_bytes"] / MIB for x in inc], "k:"))
    series.append((f"{TARGET_BYTES}x that (the target, snapshots 2 on)", [x["snapshot"] for x in inc[1:]],
                   [TARGET_BYTES * x["allowance_bytes"] / MIB for x in inc[1:]], ":"))
    n = len(r["intervals"])
    ticks = list(range(1, n + 1)) if n <= 20 else list(range(1, n + 1, max(1, n // 10)))
    first, last = r["intervals"][0], r["intervals"][-1]
    return common.plot(results / common.png_name("incremental_bytes", r["quick"]),
                       "Bytes written per snapshot of a growing TQ: full vs incremental",
                       "snapshot", "MiB written (log)", series, logx=False, xticks=ticks,
                       note=f"TQ {first['total_rows']:,} -> {last['total_rows']:,} rows (~2 KiB each); each interval "
                            f"+{r['config']['growth']:.0%} rows, -{r['config']['consume']:,} consumed; local disk and "
                            "SeaweedFS get the same bytes (their lines overlap)")


def _mib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else (f"{n / MIB:.1f} MiB" if n >= MIB / 10 else f"{n / 1024:.1f} KiB")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def _pf(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _by(r: dict[str, Any], where: str, mode: str) -> list[dict[str, Any]]:
    return [x for x in r["saves"] if x["store"] == where and x["mode"] == mode]


def headline(r: dict[str, Any]) -> list[str]:
    """The table to paste into README."""
    n = r["intervals"][-1]["snapshot"]
    lines = [f"| at snapshot {n} ({r['intervals'][-1]['total_rows']:,} TQ rows, "
             f"{r['intervals'][-1]['new_rows']:,} new) | full | incremental | incremental / full |",
             "|---|---:|---:|---:|"]
    for where in r["stores"]:
        name = "local disk" if where == LOCAL else "SeaweedFS"
        f, i = _by(r, where, FULL_MODE)[-1], _by(r, where, INC)[-1]
        lines.append(f"| bytes written, {name} | {_mib(f['bytes_written'])} | {_mib(i['bytes_written'])} | "
                     f"{i['bytes_written'] / f['bytes_written']:.3f}x |")
        lines.append(f"| save time (write + publish), {name} | {f['save_s']:.3f} s | {i['save_s']:.3f} s | "
                     f"{i['save_s'] / f['save_s']:.3f}x |")
        if where == S3:
            lines.append(f"| S3 requests per save | {f['s3_requests']} | {i['s3_requests']} | "
                         f"{i['s3_requests'] / f['s3_requests']:.2f}x |")
        else:
            lines.append(f"| store calls per save, {name} | {f['store_calls_total']} | {i['store_calls_total']} | "
                         f"{i['store_calls_total'] / f['store_calls_total']:.2f}x |")
    rest = r["restore"][LOCAL]
    med = rest["median_s"]
    lines.append(f"| restore, local disk: load returns (median of {rest['repeats']}) | {med[FULL_MODE]['returns']:.3f} s | "
                 f"{med[INC]['returns']:.3f} s | {rest['inc_over_full']['returns']:.3f}x |")
    lines.append(f"| restore, local disk: TQ holds every value | {med[FULL_MODE]['loaded']:.2f} s | "
                 f"{med[INC]['loaded']:.2f} s | {rest['inc_over_full']['loaded']:.3f}x |")
    g = r["gc_local"]
    lines.append(f"| GC, {g['snapshots']:,} snapshots / {g['objects']:,} objects (+{g['garbage']:,} garbage), "
                 f"local disk (median of {g['repeats']}) | | {g['median_s']:.2f} s | |")
    if r["gc_s3"] and r["gc_s3"]["extrapolated"]:
        e = r["gc_s3"]["extrapolated"]
        lines.append(f"| GC S3 requests, {e['snapshots']:,} snapshots / {e['objects']:,} objects (extrapolated "
                     f"from SeaweedFS) | | ~{e['s3_requests']:,} | |")
    return lines


def summary(r: dict[str, Any]) -> list[str]:
    a = r["analysis"]
    n = r["intervals"][-1]["snapshot"]
    out = []
    for where in r["stores"]:
        b = a["bytes"][where]
        name = "local disk" if where == LOCAL else "SeaweedFS"
        over = ""
        if b["over_target"]:
            recs = {x["snapshot"]: x for x in _by(r, where, INC)}
            again = ", ".join(f"{k} (+{_mib(recs[k]['row_bytes_written'] - recs[k]['new_row_bytes_est'])} of rows "
                              f"written again)" for k in b["over_target"])
            over = (f"; over the target at snapshot(s) {again}: a parent's segment narrowed by consumption to under "
                    f"1/{r['segment']['min_held_fraction']} of its object's rows is written again")
        out.append(f"{_pf(b['pass'])}: bytes written per incremental snapshot <= {TARGET_BYTES}x (new rows' bytes + "
                   f"small parts), {name}: worst {b['worst']:.3f}x (snapshot {b['worst_snapshot']}), median "
                   f"{b['median']:.3f}x, all of snapshots 2-{n} together {b['aggregate']:.3f}x{over}.")
    sl = a["slope"][LOCAL]
    out.append(f"{_pf(a['slope_pass'])}: save time grows with new rows, not total rows: log-log slope of incremental "
               f"save time per new row against TQ rows (snapshots 2-{n}, local disk) {sl[INC]['save_s_per_new_row']} "
               f"(target < {TARGET_SLOPE}). New rows per interval are {r['config']['growth']:.0%} of the rows held, so "
               f"they grow with them (slope of new rows against rows {a['new_vs_total_slope']}) and the save time "
               f"itself has slope {sl[INC]['save_s']} (full saves {sl[FULL_MODE]['save_s']}). What grows with the "
               f"rows held whatever is new: an incremental save of the same TQ with no new row (the probe) has slope "
               f"{a['probe_slope']}"
               + (f" ({common.secs(r['probes'][-1]['save_s'])} s of {common.secs(_by(r, LOCAL, INC)[-2]['save_s'])} s "
                  f"at {r['probes'][-1]['total_rows']:,} rows)" if r["probes"] and len(_by(r, LOCAL, INC)) > 1 else "")
               + ": listing and planning every held key and writing the controller's replay index (one entry per "
               "row) grow with the rows held, whatever is new.")
    if S3 in r["stores"]:
        s3 = a["slope"][S3]
        out.append(f"SeaweedFS: slope of incremental save time {s3[INC]['save_s']}, full {s3[FULL_MODE]['save_s']}.")
    rest = r["restore"][LOCAL]
    ok = a["restore_pass"]
    out.append(f"{_pf(ok['returns'])}: restore of the last incremental snapshot, until load returns, "
               f"{rest['inc_over_full']['returns']:.3f}x the last full snapshot's (target <= {TARGET_RESTORE}x; "
               f"median of {rest['repeats']}, alternating).")
    out.append(f"{_pf(ok['loaded'])}: restore until TQ holds every value (`wait_loaded()`): "
               f"{rest['inc_over_full']['loaded']:.3f}x the full snapshot's (target <= {TARGET_RESTORE}x).")
    g = r["gc_local"]
    out.append(f"{_pf(a['gc_pass'])}: GC of {g['snapshots']:,} snapshots and {g['objects']:,} objects (+{g['garbage']:,} "
               f"unreferenced) on local disk: median {g['median_s']:.2f} s of {g['repeats']} (target < "
               f"{TARGET_GC_S:.0f} s); {g['store_calls_total']:,} store calls.")
    if r["gc_s3"] and r["gc_s3"]["extrapolated"]:
        e = r["gc_s3"]["extrapolated"]
        m = r["gc_s3"]["sizes"][-1]
        out.append(f"GC on SeaweedFS: {m['s3_requests']:,} S3 requests for {m['snapshots']} snapshots / "
                   f"{m['objects']:,} objects (+{m['garbage']:,}); extrapolated to {e['snapshots']:,} / "
                   f"{e['objects']:,}: ~{e['s3_requests']:,} requests (~{e['per_snapshot']} per snapshot of "
                   f"{e['objects'] // e['snapshots']} new objects), of which "
                   f"{e['by_operation'].get('HeadObject', 0) + e['by_operation'].get('DeleteObject', 0):,} are the "
                   f"{e['garbage']:,} swept objects' HEAD + DELETE; the mark is "
                   f"{e['by_operation'].get('GetObject', 0):,} GETs (3 per snapshot) and "
                   f"{e['by_operation'].get('ListObjectsV2', 0):,} listings.")
    return out


def _save_table(r: dict[str, Any], where: str) -> list[str]:
    s3 = where == S3
    head = ("| # | TQ rows | new rows | full: written | full: save s | incr.: written | of which rows | small parts "
            "| shared (listed) | new rows' bytes + small | incr. / that | incr. / full bytes | incr.: save s | "
            "of which rows write s | controller files s | publish s | segments (new) | "
            + ("S3 requests full / incr." if s3 else "store calls full / incr.") + " |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    full = {x["snapshot"]: x for x in _by(r, where, FULL_MODE)}
    for x in _by(r, where, INC):
        f = full[x["snapshot"]]
        req = (f"{f['s3_requests']} / {x['s3_requests']}" if s3 else f"{f['store_calls_total']} / {x['store_calls_total']}")
        lines.append(
            f"| {x['snapshot']} | {x['total_rows']:,} | {x['new_rows']:,} | {_mib(f['bytes_written'])} | "
            f"{common.secs(f['save_s'])} | {_mib(x['bytes_written'])} | {_mib(x['row_bytes_written'])} | "
            f"{_mib(x['small_bytes'])} | {_mib(x['shared_bytes'])} | {_mib(x['allowance_bytes'])} | "
            f"{x['bytes_ratio']:.3f}x | {x['bytes_vs_full']:.3f}x | {common.secs(x['save_s'])} | "
            f"{common.secs(x['rows_write_s'])} | {common.secs(x['write_s'] - x['rows_write_s'])} | "
            f"{common.secs(x['publish_s'])} | {x['segments_listed']} "
            f"({x['segments_new']}) | {req} |")
    return lines


def _ops(ops: dict[str, int] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (ops or {}).items()) or "-"


def markdown(r: dict[str, Any]) -> str:
    a = r["analysis"]
    cfg = r["config"]
    n = r["intervals"][-1]["snapshot"]
    first, last = r["intervals"][0], r["intervals"][-1]
    lines = [
        "# Incremental snapshots benchmark: segments (format 1.3 shared objects) vs full snapshots of a growing TQ",
        "",
        f"TransferQueue {r['versions']['transferqueue']} (SimpleStorage, one storage unit) on a local Ray (2 CPUs, "
        f"loopback){', SeaweedFS `weed mini` on 127.0.0.1 (' + str(r['versions']['seaweedfs']) + ')' if r['versions']['seaweedfs'] else ''}"
        f", both started for the section. TQ starts with {first['total_rows']:,} training rows (partition "
        f"`{r['partition']}`, {r['layout']}: `input_ids` int32 + `generation_logprobs` float32 of {r['row_tokens']} "
        f"tokens, `input_lengths`; ~2 KiB per row, as the tq section builds them), put through the TQ adapter "
        f"{r['put_batch']} rows per `kv_batch_put` (filled in {r['fill_s']:.0f} s, not timed). {n} snapshots; "
        f"before each after the first, the adapter puts {cfg['growth']:.0%} of the rows TQ holds and "
        f"`tq.kv_clear` removes the {cfg['consume']:,} oldest; TQ ends with {last['total_rows']:,} rows. Each "
        "interval's cut (`deferred_cut()`, once) is saved by the coordinator's write path (`begin()` + "
        "`write_cut_parts(...)` + `publish()`) incrementally and fully, on local disk and on SeaweedFS, the order of "
        f"the four rotating. Segments: at most {r['segment']['rows']:,} rows / {r['segment']['bytes'] >> 20} MiB; a "
        f"parent's segment is listed again while it holds >= 1/{r['segment']['min_held_fraction']} of its rows "
        f"(1/{r['segment']['suffix_min_fraction']} when they are its last rows: only its oldest consumed). "
        f"Whole run {r['elapsed_s']:.0f} s{' (quick run)' if r['quick'] else ''}; load average "
        f"{r['load_average']['start']} at start, {r['load_average']['end']} at the end.",
        "",
        "## Headline (for README)",
        "",
        *headline(r),
        "",
        "## Targets",
        "",
        *[f"- **{s}**" for s in summary(r)],
        "",
        "## Every snapshot, local disk",
        "",
        *_save_table(r, LOCAL),
    ]
    if S3 in r["stores"]:
        lines += ["", "## Every snapshot, SeaweedFS", "", *_save_table(r, S3)]
    sl = a["slope"]
    lines += ["", f"## Save time against TQ rows (log-log slopes, snapshots 2-{n})", "",
              "| store | mode | save time | rows write only | bytes written | save time per new row | save time "
              "against new rows |", "|---|---|---:|---:|---:|---:|---:|"]
    for where in r["stores"]:
        for mode in (INC, FULL_MODE):
            f = sl[where][mode]
            lines.append(f"| {where} | {mode} | {f['save_s']} | {f['rows_write_s']} | {f['bytes_written']} | "
                         f"{f.get('save_s_per_new_row', '-')} | {f.get('save_s_vs_new_rows', '-')} |")
    pr = r["probes"]
    if pr:
        lines += ["", "No-new-rows incremental saves (local disk, between two intervals, same cut: what a save costs "
                  f"that grows with the rows held; log-log slope {a['probe_slope']} against TQ rows):", "",
                  "| TQ rows | save s | of which rows write (list, plan, reference) s | controller files s | publish s "
                  "| written |", "|---:|---:|---:|---:|---:|---:|"]
        for x in sorted({id(p): p for p in (pr[0], pr[len(pr) // 2], pr[-1])}.values(), key=lambda p: p["snapshot"]):
            lines.append(f"| {x['total_rows']:,} | {common.secs(x['save_s'])} | {common.secs(x['rows_write_s'])} | "
                         f"{common.secs(x['write_s'] - x['rows_write_s'])} | {common.secs(x['publish_s'])} | "
                         f"{_mib(x['bytes_written'])} |")
    lines += ["", "## Restore of the last snapshot (median s)", "",
              "| store | mode | load returns | of which read, verify, parse | TQ holds every value | inc / full "
              "(returns) | inc / full (all) | files read | store calls | S3 requests |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for where, rest in r["restore"].items():
        for mode in (INC, FULL_MODE):
            med = rest["median_s"][mode]
            ratio = rest["inc_over_full"]
            lines.append(f"| {where} | {mode} | {common.secs(med['returns'])} | "
                         f"{common.secs(rest['parts_median_s'][mode]['read'])} | {common.secs(med.get('loaded'))} | "
                         f"{ratio['returns']:.3f}x | {_x(ratio.get('loaded'))} | "
                         f"{rest['files_read'][mode]} | {rest['store_calls_total'][mode]} | "
                         f"{(rest['s3_requests'] or {}).get(mode, '-')} |")
    h = r["checksum_gb_per_s"]
    lines += ["", f"A restore verifies every byte it reads: a segment (shared object) by its SHA-256 name, a snapshot "
              f"folder's file by xxh3-128. On this machine SHA-256 runs at {h['sha256']} GB/s and xxh3-128 at "
              f"{h['xxh3_128']} GB/s (one 128 MiB buffer, best of 3)."]
    g = r["gc_local"]
    lines += ["", "## GC (mark and sweep)", "",
              "| store | snapshots | objects referenced | unreferenced (swept) | median s | runs s | store calls | "
              "S3 requests |", "|---|---:|---:|---:|---:|---|---|---:|",
              f"| local disk | {g['snapshots']:,} | {g['objects']:,} | {g['swept']:,} | {g['median_s']:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in g['times_s'])} | {_ops(g['store_calls'])} | - |"]
    if r["gc_s3"]:
        for m in r["gc_s3"]["sizes"]:
            lines.append(f"| SeaweedFS | {m['snapshots']:,} | {m['objects']:,} | {m['swept']:,} | {m['seconds']:.2f} "
                         f"(one run) | - | {_ops(m['store_calls'])} | {m['s3_requests']:,} ({_ops(m['s3_ops'])}) |")
        e = r["gc_s3"]["extrapolated"]
        if e:
            lines.append(f"| SeaweedFS, **extrapolated** | {e['snapshots']:,} | {e['objects']:,} | {e['garbage']:,} | - "
                         f"| - | - | ~{e['s3_requests']:,} ({_ops(e['by_operation'])}) |")
    lines += [
        "",
        "Notes:",
        "- **written** = every byte the save handed to the store (row files or segment objects, controller files, "
        "part manifests, manifest, commit record, `_latest.json`), counted by a wrapper of the store "
        "(`CountingStore` plus bytes); **of which rows** = the new segment objects (`WrittenRows.new_bytes`); "
        "**small parts** = the rest (the snapshot's non-row files: `controller/` loader place, replay index "
        "(one entry per row TQ holds, zstd JSON lines), recovery ledger; part manifests, manifest, commit, hint); "
        "**shared** = the whole objects of the parent listed again without being written "
        "(`WrittenRows.shared_bytes`).",
        "- **new rows' bytes** = the full snapshot's row-file bytes x new rows / TQ rows (the Arrow bytes those rows "
        "take in the full snapshot's file, same interval); the target compares the incremental bytes written with "
        "that plus the incremental snapshot's own small parts. Snapshot 1 has no parent (every row is new) and is "
        "left out of the target; rows consumed oldest first leave a parent's segment listed with a narrower row "
        f"range until it holds less than 1/{r['segment']['suffix_min_fraction']} of its rows (1/"
        f"{r['segment']['min_held_fraction']} when rows go from elsewhere in it), when its survivors are written "
        "again.",
        "- **save s** = `begin()` + `write_cut_parts` + `publish()`; the pause (`deferred_cut()`, TQ's listing and "
        f"the plan of kept rows) is not in it: {statistics.median(x['pause_s'] for x in r['intervals']):.3f} s median "
        "per interval, shared by the four saves. **rows write** = `write_segments` / `write` of the cut (building "
        "Arrow from the adapter's kept rows, xxh3 / SHA-256, writes); the controller's files are the rest of the "
        "write. The cut is written four times per interval (order rotating), so later saves of an interval find "
        "the kept rows' pages warm.",
        "- **store calls** = calls of the `Store` interface (`CountingStore`); **S3 requests** = S3 operations "
        "counted on the store's botocore client (`before-call`): a large file is one `open_write` call but a "
        "multipart upload of several requests.",
        "- The full stores keep their newest two snapshots (retention after each save, untimed); the incremental "
        "stores keep every snapshot (and the probes).",
        "- Restore: TQ cleared, then `SnapshotStore(...).latest()` + `TQDataPlane.load(snap, \"tq\")` (checksums "
        "verified, rows parsed and kept: it **returns**), then `wait_loaded()` (a thread has registered every key "
        "and put every value with `kv_batch_put`: **TQ holds every value**); after each, TQ's listing and the "
        "values of sampled rows are checked. On SeaweedFS only the return is timed (the rest is TQ's puts, the "
        "same whatever the store).",
        f"- GC store: object files written straight as `objects/<2>/<64>` (SHA-256 names, "
        f"{GC_OBJECT_BYTES[0]}-{GC_OBJECT_BYTES[1]} random bytes, no fsync; SeaweedFS: `put_object`), listed by "
        f"snapshots published with `begin()` / `part.reference(...)` / `publish()` (kind `{GC_KIND}`: opaque bytes; "
        "GC reads manifests, never objects), each naming the next objects/snapshots objects and half as many of its "
        "parent's; every object aged two days, so only the mark keeps them. Before each local repeat "
        f"{GC_GARBAGE:.0%} more unreferenced objects are written and aged two hours (`os.utime`) past the one-hour "
        "grace period; `gc(store, min_age_s=3600, grace_s=3600)` is timed. On SeaweedFS one GC per size with "
        "`now` two hours ahead (objects cannot be back-dated there); the extrapolation is a line through the two "
        "sizes, per S3 operation (listing pages grow with objects / 1000, reads with snapshots, deletes with garbage).",
        "- The machine's 2 cores serve the benchmark, Ray + TQ and SeaweedFS (and other work): compare rows of one "
        "run, not runs.",
    ]
    return "\n".join(lines) + "\n"
