"""GC running while a writer publishes snapshots that reuse objects: no published snapshot ever loses
an object (SPEC §14.2).

Two real processes on one local store (``incremental_writer.py``): a writer that publishes the next
snapshot of an incremental chain each round (it references three of its parent's objects, one
narrowed by a row range, and writes two, one of them with the bytes of an object no snapshot names
any more: a re-put), with ``keep_latest`` 1 and 2 in turn; and a GC that runs over and over
(``keep_latest=2``, grace period and draft min age ``GRACE_S``) on a slow store, so that its mark
and sweep overlap the writer's steps. Both pause at random between their steps.

Each round:

1. every file is set an hour back (time passes; the writer is idle, so nothing is a live draft's):
   the objects the writer references are all older than the grace period, only marks protect them;
2. the writer writes its objects and waits until a whole GC run has gone by before it lists them
   in its part manifests: only their age protects them meanwhile;
3. when the GC next lists ``_commits/`` (it then pauses before reading what it listed), the writer
   publishes: the commit, and with ``keep_latest=1`` the deletion of its parent, the only committed
   snapshot naming the objects the new one references, land between the GC's listing and its reads;
4. once a GC run that began after the publish returned has ended (every run that overlapped the
   publish is over), every listed snapshot verifies and every object it names exists.

At the end a GC past the grace period leaves exactly the objects the committed manifests name.
``OBJECTS_RACE_ROUNDS`` sets the number of rounds (default 16; a soak: 500).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import incremental_writer
import pytest
from incremental_writer import ForkServer, age, gc_under_test, leftovers

from snapformat import SnapshotStore, layout, verify_snapshot

ROUNDS = int(os.environ.get("OBJECTS_RACE_ROUNDS", "16"))
WARMUP = 3  # snapshots published before the GC starts (so the first round's parent has objects to reuse)
GRACE_S = 30.0  # far longer than a round: the writer publishes well within it
OLD_S = 3600.0
WRITER_KEEP_LATESTS = "1,2"
GC_KEEP_LATEST = 2
TIMEOUT_S = 60.0  # for any one answer of either process
HARNESS = incremental_writer.__file__


class _Lines:
    """A subprocess's stdout, line by line, read by a thread (so waits have timeouts)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self.thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def next(self, timeout_s: float = TIMEOUT_S) -> str | None:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer in {timeout_s} s") from None


class _Gc:
    """The GC process's reports: runs (start, end, objects swept), errors, listings of commits."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines = _Lines(proc)
        self.runs: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.listings: list[str] = []
        self.ended = False

    def _take(self, line: str | None) -> str:
        if line is None:
            self.ended = True
            raise AssertionError(f"the GC process ended: {self.errors}")
        words = line.split()
        if words[0] == "gc":
            self.runs.append((float(words[2]), float(words[3]), int(words[4])))
        elif words[0] == "listed":
            self.listings.append((int(words[1]), words[2]))
        else:
            self.errors.append(line)
        return line

    def drain(self) -> None:
        """Take every line printed so far."""
        while True:
            try:
                line = self.lines.queue.get_nowait()
            except queue.Empty:
                return
            self._take(line)

    def next_listing(self, rnd: int) -> None:
        """Wait for the GC's next listing of ``_commits/`` in its mark: one whose callers name
        ``mark`` when the GC has such a function (snapformat.object_gc.mark), else each listing of
        a run in turn, two rounds each (the writer's ``keep_latest`` alternates between 1 and 2)."""
        self.drain()
        marks = any("mark" in chain for _, chain in self.listings)
        per_run = 1 + max(i for i, _ in self.listings)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            line = self._take(self.lines.next(max(0.1, deadline - time.monotonic())))
            if line.startswith("listed "):
                i, chain = self.listings[-1]
                if ("mark" in chain) if marks else i == (rnd // 2) % per_run:
                    return

    def run_after(self, t: float) -> None:
        """Wait until a GC run that began after ``t`` has ended."""
        deadline = time.monotonic() + TIMEOUT_S
        while not any(start > t for start, _, _ in self.runs):
            self._take(self.lines.next(max(0.1, deadline - time.monotonic())))

    def finish(self) -> None:
        while not self.ended:
            line = self.lines.next()
            if line is None:
                self.ended = True
            else:
                self._take(line)


def _check_published(path: Path, where: str) -> list[int]:
    store = SnapshotStore(str(path))
    commits = store.list()
    assert commits, f"{where}: nothing is listed"
    for commit in commits:
        snap = store.open(commit.sequence)
        for f in snap.manifest.files:
            if f.object is not None:
                assert (path / layout.object_key(f.object)).is_file(), (
                    f"{where}: published sequence {commit.sequence} lost object {f.object} ({f.path})")
        report = verify_snapshot(snap)
        assert report.ok, f"{where}: sequence {commit.sequence} does not verify: {report.problems}"
    return [c.sequence for c in commits]


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, HARNESS, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _ok(reply: dict, what: str = "writer") -> dict:
    assert reply.get("exit") == 0, f"{what} failed: {reply.get('error', reply)}"
    return reply


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.slow
def test_gc_never_takes_an_object_a_published_snapshot_names(tmp_path: Path) -> None:
    path = tmp_path / "store"
    stop_file = tmp_path / "stop-gc"
    writer = _spawn("race-writer", str(path), "21", WRITER_KEEP_LATESTS)
    gc_proc = None
    try:
        out = _Lines(writer)
        assert out.next() == "ready"

        def expect(word: str) -> list[str]:
            line = out.next()
            assert line is not None and line.startswith(word + " "), f"the writer failed (its stderr says why): {line}"
            return line.split()

        for _ in range(WARMUP):
            for word, then in (("go", "written"), ("close", "prepared"), ("publish", "published")):
                _tell(writer, word)
                expect(then)
        age(path, OLD_S)
        gc_proc = _spawn("race-gc", str(path), "12", str(GC_KEEP_LATEST), str(GRACE_S), str(stop_file))
        gc = _Gc(gc_proc)
        gc.run_after(time.time())

        publishes = []
        previous = _check_published(path, "before the race")
        for rnd in range(ROUNDS):
            age(path, OLD_S)  # the writer is idle: every object it may reference is past the grace period
            _tell(writer, "go")
            seq = int(expect("written")[1])
            gc.run_after(time.time())  # a whole GC run while no part manifest lists the new objects
            _tell(writer, "close")
            assert int(expect("prepared")[1]) == seq
            gc.next_listing(rnd)
            _tell(writer, "publish")
            _, published, t0, t1 = expect("published")
            assert int(published) == seq == previous[0] + 1, (rnd, previous, published)
            publishes.append((float(t0), float(t1)))
            gc.run_after(float(t1))
            previous = _check_published(path, f"round {rnd} (sequence {seq})")
            assert previous[0] == seq, (rnd, previous)

        stop_file.touch()
        _tell(writer, "stop")
        assert writer.wait(timeout=TIMEOUT_S) == 0
        assert gc_proc.wait(timeout=TIMEOUT_S) == 0
        gc.finish()
        assert not gc.errors, f"the GC raised on a busy store: {gc.errors}"

        # The race happened: GC runs overlapped every publish, and the GCs swept objects.
        overlapping = sum(any(g0 < t1 and g1 > t0 for g0, g1, _ in gc.runs) for t0, t1 in publishes)
        assert overlapping == ROUNDS, f"only {overlapping} of {ROUNDS} publishes overlapped a GC run"
        swept = [n for _, _, n in gc.runs]
        assert all(n < 0 for n in swept) or sum(swept) >= ROUNDS, f"the GCs swept only {sum(swept)} objects"

        seqs = _check_published(path, "after the race")
        age(path, OLD_S)
        gc_under_test()(SnapshotStore(str(path)).store, min_age_s=GRACE_S, grace_s=GRACE_S)
        assert leftovers(path) == {"drafts": [], "temps": [], "objects": []}
        assert _check_published(path, "after the last GC") == seqs
    finally:
        stop_file.touch()
        for proc in (writer, gc_proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_gc_paused_before_a_delete_never_takes_an_object_a_writer_put_again(tmp_path: Path) -> None:
    """A GC stopped between its last look at an unreferenced old object and its delete (a
    descheduled process; on an object store, the time between two requests) while a writer puts
    that object again (its bytes are new rows that happen to equal an old segment's) and
    publishes a snapshot naming it: the GC must not then delete it."""
    path = tmp_path / "store"
    server = ForkServer()
    try:
        for _ in range(4):
            _ok(server.run("write", path))
        age(path, OLD_S)
        unreferenced = leftovers(path)["objects"]
        gc_proc = _spawn("gc-stepped", str(path), str(GRACE_S))
        try:
            lines = _Lines(gc_proc)
            line = lines.next()
            assert line is not None and line.startswith("delete "), line
            key = line.split()[1]
            assert layout.object_of_key(key) in unreferenced, (key, unreferenced)
            written = _ok(server.run("write", path))["result"]["written"]  # re-puts it, publishes sequence 5
            assert layout.object_of_key(key) in written, (key, written)
            while line is not None and line.startswith("delete "):
                _tell(gc_proc, "go")
                line = lines.next()
            assert line is not None and line.startswith("done "), line
            assert gc_proc.wait(timeout=TIMEOUT_S) == 0
        finally:
            if gc_proc.poll() is None:
                gc_proc.kill()
                gc_proc.wait()
    finally:
        server.close()
    _check_published(path, "after a GC paused before its delete")
