"""Helpers shared by the benchmark sections added for issue 6 (tq, pause, restore, discovery, memory):
the one Ray + TransferQueue runtime of a benchmark process, TQ rows of a known size, raw reads of a
snapshot's files, plots (matplotlib, Agg backend) and small formatting helpers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from snapformat.mounts import mount_of

Log = Callable[[str], None]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

#: Object store of the benchmark's Ray: TQ's SimpleStorage keeps rows in its actor's heap and moves
#: them over ZMQ, so the object store only carries Ray's own small objects.
OBJECT_STORE_MEMORY = 512 << 20

_RUNTIME: Any = None
_CLOSERS: list[Callable[[], None]] = []


def on_close(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`close_all` (before Ray stops): state a section keeps for a later one."""
    _CLOSERS.append(fn)


def tq_runtime(log: Log) -> Any:
    """Ray and TransferQueue for this benchmark process: started once (``coordinator.ray_runtime``,
    2 CPUs, loopback) by the first section that needs it and closed by :func:`close_all`
    (``python -m benchmarks.run`` calls it at the end). If Ray is already initialised in this
    process (a test session that started it), TQ is attached to and the owner closes it."""
    global _RUNTIME
    from coordinator import ray_runtime

    ray_runtime.configure()  # before ray is imported: every socket on 127.0.0.1 (a no-op after run.main's)
    import ray

    if _RUNTIME is not None or ray.is_initialized():
        import transfer_queue as tq

        tq.init()  # attaches (a no-op when this process initialised it)
        return _RUNTIME
    t0 = time.perf_counter()
    log("starting Ray (2 CPUs, loopback) and TransferQueue (one SimpleStorage unit) ...")
    _RUNTIME = ray_runtime.start(num_cpus=2, object_store_memory=OBJECT_STORE_MEMORY, log_to_driver=False)
    log(f"Ray and TransferQueue ready in {time.perf_counter() - t0:.1f} s (not timed)")
    return _RUNTIME


def close_all() -> None:
    """Every :func:`on_close` function (newest first), then ``tq.close()`` and ``ray.shutdown()`` if
    :func:`tq_runtime` started them. ``python -m benchmarks.run`` calls it at the end."""
    global _RUNTIME
    while _CLOSERS:
        fn = _CLOSERS.pop()
        try:
            fn()
        except Exception as exc:  # cleanup must not hide the run's result
            print(f"benchmarks: cleanup failed: {type(exc).__name__}: {exc}", flush=True)
    if _RUNTIME is not None:
        try:
            _RUNTIME.close()
        finally:
            _RUNTIME = None


class MethodTimer:
    """Times calls of some methods of one object (the TQ adapter instance: its reads of TQ, its Arrow
    build, its puts) by replacing them on that instance; :meth:`take` returns the seconds so far."""

    def __init__(self, obj: Any, names: Sequence[str]) -> None:
        self.times: dict[str, float] = {}
        self._obj, self._names = obj, tuple(names)
        for name in names:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def close(self) -> None:
        """Put the methods back (the wrappers shadow them on the instance)."""
        for name in self._names:
            self._obj.__dict__.pop(name, None)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        return call

    def take(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


# --------------------------------------------------------------------------------------------
# TQ rows of a known size


@dataclass
class RowBatch:
    keys: list[str]
    fields: dict[str, Any]  # as DataPlane.put takes them (numpy dense, Ragged)
    tags: list[dict[str, Any]]
    raw_bytes: int  # bytes of the values themselves (every tensor's elements, no keys, tags or offsets)
    lengths: np.ndarray


def row_batch(rng: np.random.Generator, start: int, n: int, layout: str, mean_tokens: int,
              prefix: str = "r") -> RowBatch:
    """``n`` training rows: ``input_ids`` (int32) and ``generation_logprobs`` (float32) of
    ``mean_tokens`` tokens (dense: exactly that many; ragged: uniform in [mean/2, 3*mean/2)), and
    ``input_lengths`` (int32). Tags carry ``rollout_id`` and ``attempt_index``, as the training-row
    schema requires."""
    from coordinator.dataplane import Ragged

    keys = [f"{prefix}{i:07d}" for i in range(start, start + n)]
    tags = [{"rollout_id": k, "attempt_index": 0} for k in keys]
    if layout == "dense":
        lengths = np.full(n, mean_tokens, dtype=np.int32)
        ids: Any = rng.integers(0, 150_000, (n, mean_tokens), dtype=np.int32)
        lps: Any = -rng.random((n, mean_tokens), dtype=np.float32)
    elif layout == "ragged":
        lengths = rng.integers(mean_tokens // 2, mean_tokens * 3 // 2, n).astype(np.int32)
        flat_ids = rng.integers(0, 150_000, int(lengths.sum()), dtype=np.int32)
        flat_lps = -rng.random(int(lengths.sum()), dtype=np.float32)
        cuts = np.cumsum(lengths)[:-1]
        ids = Ragged(np.split(flat_ids, cuts))
        lps = Ragged(np.split(flat_lps, cuts))
    else:
        raise ValueError(f"layout {layout!r} is not 'dense' or 'ragged'")
    raw = int(lengths.sum()) * 8 + n * 4
    return RowBatch(keys, {"input_ids": ids, "generation_logprobs": lps, "input_lengths": lengths}, tags, raw,
                    lengths)


def row_values(batch: RowBatch, i: int) -> dict[str, np.ndarray]:
    """Row ``i`` of a batch as numpy arrays (for checking what a load gave back)."""
    out = {}
    for name, value in batch.fields.items():
        rows = getattr(value, "rows", None)
        out[name] = np.asarray(rows[i] if rows is not None else value[i])
    return out


def tq_row_values(partition: str, keys: list[str], names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """The values TransferQueue holds for ``keys`` (its own ``kv_batch_get``), per row."""
    import transfer_queue as tq

    td = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=list(names))
    out: list[dict[str, np.ndarray]] = [{} for _ in keys]
    for name in names:
        v = td.get(name)
        per_row = v.unbind() if v.is_nested else [v[i] for i in range(len(keys))]
        for row, t in zip(out, per_row):
            row[name] = t.detach().cpu().numpy()
    return out


def same_rows(expected: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]]) -> bool:
    if len(expected) != len(got):
        return False
    for e, g in zip(expected, got):
        for name, arr in e.items():
            other = g.get(name)
            if other is None or other.dtype != arr.dtype or not np.array_equal(other.reshape(arr.shape), arr):
                return False
    return True


# --------------------------------------------------------------------------------------------
# Files


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def snapshot_files(store_root: Path, snapshot_id: str, sequence: int) -> list[Path]:
    """Every file a reader of this snapshot needs: the snapshot folder and its commit record."""
    from snapformat import layout

    folder = store_root / layout.snapshot_dir(snapshot_id)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = store_root / layout.commit_key(sequence)
    if commit.is_file():
        files.append(commit)
    return files


def raw_read(files: Iterable[Path]) -> tuple[float, int]:
    """Every byte of ``files`` with plain ``open().readinto`` into one buffer allocated (and touched)
    beforehand; returns (seconds, bytes). Reads whatever the page cache holds."""
    files = list(files)
    biggest = max((p.stat().st_size for p in files), default=0)
    buf = bytearray(max(biggest, 1))
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            got = 0
            while got < size:
                n = fh.readinto(view[got:size])
                if not n:
                    raise OSError(f"{p}: short read at {got} of {size} bytes")
                got += n
            total += got
    dt = time.perf_counter() - t0
    view.release()
    return dt, total


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' clean pages from the page cache (posix_fadvise DONTNEED, no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def work_folder(scratch: Path, name: str) -> tuple[Path, Callable[[], None]]:
    """A fresh folder under ``scratch`` and the function that removes it (and ``scratch`` if empty)."""
    made = not scratch.exists()
    scratch.mkdir(parents=True, exist_ok=True)
    work = scratch / f"{name}-{os.getpid()}-{time.time_ns()}"
    work.mkdir()

    def cleanup() -> None:
        shutil.rmtree(work, ignore_errors=True)
        if made:
            try:
                scratch.rmdir()
            except OSError:
                pass

    return work, cleanup


# --------------------------------------------------------------------------------------------
# Plots


def plot(path: Path, title: str, xlabel: str, ylabel: str,
         series: Sequence[tuple[str, Sequence[float], Sequence[float | None], str]],
         *, logx: bool = True, logy: bool = True, xticks: Sequence[float] | None = None,
         xticklabels: Sequence[str] | None = None, note: str | None = None,
         hlines: Sequence[tuple[float, str]] = ()) -> Path:
    """One line chart (matplotlib, Agg backend) saved as a PNG; each series is (label, xs, ys, style).
    A ``None`` y value is left out of its line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    for label, xs, ys, style in series:
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, markersize=5)
    for y, label in hlines:
        ax.axhline(y, color="grey", linestyle=":", linewidth=1)
        ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=7, color="grey",
                    va="bottom")
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if xticks is not None:
        ax.set_xticks(list(xticks))
        ax.set_xticklabels(list(xticklabels) if xticklabels is not None else [str(x) for x in xticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    # Below the axes, so it never hides a point.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    if note:
        ax.annotate(note, (0, 0), xycoords="figure fraction", xytext=(4, 4), textcoords="offset points",
                    fontsize=7, color="dimgrey")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def png_name(stem: str, quick: bool) -> str:
    return f"{stem}-quick.png" if quick else f"{stem}.png"


# --------------------------------------------------------------------------------------------
# Formatting


def size_label(n: float) -> str:
    """10 MiB, 1 GiB, 1.5 GiB..."""
    if n >= GIB:
        v = n / GIB
        return f"{v:.0f} GiB" if v == int(v) else f"{v:.2g} GiB"
    if n >= MIB:
        v = n / MIB
        return f"{v:.0f} MiB" if v == int(v) else f"{v:.1f} MiB"
    return f"{n / KIB:.0f} KiB"


def ms(s: float | None) -> str:
    if s is None:
        return "-"
    v = s * 1e3
    return f"{v:.1f}" if v < 100 else f"{v:,.0f}"


def secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f}" if s < 10 else f"{s:.1f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def x(r: float | None, digits: int = 2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def filesystem(path: Path) -> str:
    """``<device> (<fstype>, mounted on <mount point>)`` of the mount holding ``path``."""
    mount = mount_of(path)
    if mount is None:
        return "unknown (unknown, mounted on ?)"
    return f"{mount.device} ({mount.fs_type}, mounted on {mount.mount_point})"


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


@contextlib.contextmanager
def aws_env(env: Mapping[str, str]) -> Iterator[None]:
    """The AWS variables ``env`` (a test S3 server's ``env_vars()``: what ``s3://`` stores read) set
    for the block, and the previous values restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
