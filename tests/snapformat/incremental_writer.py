"""Incremental snapshots (shared objects, format 1.3) written and collected by real processes that
``test_objects_crash.py`` and ``test_objects_race.py`` SIGKILL.

The writer (:func:`write_next`) publishes the next snapshot of a chain: its ``tq`` part lists the
parent's last ``KEEP`` row objects again (:meth:`PartWriter.reference`; the rows of the others
consumed), narrows the first one it keeps by a row range (one row consumed), and writes ``NEW`` row
objects of its own (:meth:`PartWriter.write_rows_object`), one of them with the bytes of an object
written four sequences earlier (an object that is gone, or unreferenced but still on the store: a
re-put). A ``controller`` part is a whole file of the snapshot's folder. Every byte of every object
is a function of the sequence only, so runs against copies of one store repeat the same steps.

Modes:

``serve``
    A fork server: imports everything once and stays single-threaded, then reads one JSON request
    per line on stdin, ``{"role": "write"|"gc", "store": PATH, "kill_at": K, ...}``, forks a child
    that runs the role with every store step numbered (the events of ``crash_writer.py``:
    ``before:``/``after:`` a store method, the ``os.link``/``os.replace``/``os.unlink``/``os.rmdir``
    inside it, a written file's ``close``) and SIGKILLs itself at event ``K`` (1-based), waits for
    it and answers one JSON line: ``{"signal": 9}`` when it was killed, ``{"exit": 0, "events":
    [...], "result": ...}`` when it ran to the end (``K`` 0: nothing killed, the event list is the
    dry run the tests choose kill points from), ``{"exit": 1, "error": traceback}`` when it failed.
    Forking costs milliseconds where a new interpreter costs a third of a second, so a test can
    kill at every event. Each child is its own process, killed with SIGKILL, sharing nothing with
    the next but the store on disk.

    ``write`` takes ``keep_latest`` (default 2). ``gc`` takes ``keep_latest``, ``min_age_s`` and
    ``grace_s`` (passed to the GC under test).

``race-writer STORE SEED KEEP_LATESTS``
    Prints ``ready``; then, for each ``go`` it reads on stdin, writes the next snapshot's objects,
    prints ``written <seq>`` and waits for ``close`` (its objects are listed by no part manifest
    meanwhile), closes every part, prints ``prepared <seq>``, waits for ``publish``, publishes with the next
    ``keep_latest`` of the comma-separated list (cycled) and prints ``published <seq> <t0> <t1>``
    (when it began and when publish returned, Unix seconds). It pauses at random between the
    draft's steps (up to ``WRITER_STEP_PAUSE_S``: objects stay listed by no part manifest that
    long) and before each store write and delete (so a concurrent GC's steps fall between them).
    Ends at ``stop`` or end of input.

``race-gc STORE SEED KEEP_LATEST GRACE_S STOP_FILE``
    Runs the GC under test over and over (``min_age_s = grace_s = GRACE_S``) until ``STOP_FILE``
    exists (bounded in count and time) on a slow store: each read, listing and stat pauses at
    random, and after each listing of ``_commits/`` it prints ``listed <i> <its callers>`` (the
    ``i``-th listing of this run, from 0) and pauses
    for tens of milliseconds (only after the mark's listings, once a caller named ``mark`` shows
    up): a test tells the writer to publish then, so the commit, and the deletion of the parent by
    ``keep_latest=1``, land between the GC's listing and its reads. Prints ``gc
    <n> <t0> <t1> <objects swept>`` after each run, ``error <n> <message>`` for a run that raised.

``gc-stepped STORE GRACE_S``
    One GC run that prints ``delete <key>`` before each object it deletes and waits for a line on
    stdin (a GC descheduled between its last look at an object and the delete), then ``done
    <report as JSON>``.

The GC under test is ``snapformat.retention.gc`` (``gc(store, keep_latest, min_age_s, grace_s)``);
the environment variable ``SNAPFORMAT_TEST_GC=module:function`` names another one (to check that
the tests catch a broken GC).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # keep the fork server single-threaded, so forking it is safe (devtools/gym_forkserver.py)
    for _name, _value in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                          "JE_ARROW_MALLOC_CONF": "background_thread:false"}.items():
        os.environ.setdefault(_name, _value)

import importlib
import json
import random
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from schemas.controller import LoaderPlace
from snapformat import SnapshotStore, example, layout
from snapformat.store import local

sys.path.insert(0, str(Path(__file__).parent))
from crash_writer import _Events, _wrap_method, _wrap_os

ROW_KIND = "training_rows"
TQ, CONTROLLER = "tq", "controller"
KEEP = 3  # the parent's objects listed again (its last ones; the rows of the others are consumed)
NEW = 2  # objects written per snapshot
ROLLOUTS = 24  # rollouts per object (about a quarter are finished: one row each)
REPEAT_EVERY = 4  # a snapshot's first new object has the bytes of the one written this many sequences earlier
MAX_GC_RUNS, MAX_GC_S = 5000, 300.0  # bounds of race-gc
MAX_ROUNDS = 1000  # bound of race-writer
CHILD_TIMEOUT_S = 60  # bound of one forked writer or GC
WRITER_PAUSE_S = 0.003  # the longest random pause of race-writer before each store write and delete
WRITER_STEP_PAUSE_S = 0.03  # ... between the steps of a draft (objects written but listed by no part manifest yet)
GC_READ_PAUSE_S = 0.01  # the longest random pause of race-gc before each read (a commit, a manifest)
GC_LIST_PAUSE_S = 0.003  # ... before each listing and stat
GC_LISTED_PAUSE_S = (0.01, 0.05)  # ... after each listing of _commits/ (announced: the writer commits then)


def object_seeds(sequence: int) -> list[int]:
    """The seeds of the rows of the objects snapshot ``sequence`` writes."""
    return [sequence % REPEAT_EVERY, 1000 + sequence][:NEW]


def object_rows(seed: int) -> pa.RecordBatch:
    """At least two rows (so that a row range can drop one), a function of ``seed`` only."""
    batch = example.training_batch(example.rollouts(ROLLOUTS, seed), seed)
    count = ROLLOUTS
    while batch.num_rows < 2:  # a seed whose rollouts rarely finished: take more of them
        count *= 2
        batch = example.training_batch(example.rollouts(count, seed), seed)
    return batch


def gc_under_test():
    spec = os.environ.get("SNAPFORMAT_TEST_GC", "snapformat.retention:gc")
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def write_next(store_url: str, keep_latest: int | None = 2, pause=lambda: None,
               after_objects=lambda sequence: None, before_publish=lambda sequence: None) -> dict[str, Any]:
    """Publish the next snapshot of the chain (module docstring); returns what it listed.

    ``pause()`` is called between the draft's steps, ``after_objects(sequence)`` once its objects
    are written (no part manifest lists them yet), ``before_publish(sequence)`` once every part is
    closed (its part manifests written), right before the publish."""
    store = SnapshotStore(store_url)
    parent = store.latest()  # the draft's parent is the newest committed snapshot (begin says so too)
    draft = store.begin()
    if parent is not None and draft.parent is not None:
        assert parent.manifest.snapshot_id == draft.parent.snapshot_id, "a snapshot was committed between"
    pause()
    tq = draft.part(TQ, writer="tq")
    inherited = [] if parent is None else [f for f in parent.manifest.files if f.object is not None]
    referenced = []
    for i, entry in enumerate(inherited[-KEEP:]):
        low, high = entry.row_range if entry.row_range is not None else (0, entry.records)
        narrowed = (low + 1, high) if i == 0 and high - low >= 2 else None
        referenced.append(tq.reference(entry, row_range=narrowed).object)
    pause()
    written = []
    for j, seed in enumerate(object_seeds(draft.sequence)):
        entry = tq.write_rows_object(f"seg-{draft.sequence:04d}-{j}.arrow", ROW_KIND, object_rows(seed))
        written.append(entry.object)
        pause()
    after_objects(draft.sequence)
    ctl = draft.part(CONTROLLER, writer="controller")
    ctl.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=draft.sequence, seed=0))
    pause()
    draft.close_local_parts()
    before_publish(draft.sequence)
    draft.publish(keep_latest=keep_latest)
    return {"sequence": draft.sequence, "referenced": referenced, "written": written}


def run_gc(store_url: str, keep_latest: int | None, min_age_s: float, grace_s: float | None) -> Any:
    store = SnapshotStore(store_url).store
    report = gc_under_test()(store, keep_latest=keep_latest, min_age_s=min_age_s, grace_s=grace_s)
    try:
        return msgspec.to_builtins(report)
    except TypeError:
        return repr(report)


# --- the fork server -----------------------------------------------------------------------------

def _instrument(store_url: str, kill_at: int) -> _Events:
    """Number every store step of this process (as ``crash_writer.py step``); kill at ``kill_at``."""
    events = _Events(Path(store_url), kill_at)
    for method in ("open_write", "put_bytes", "create_exclusive", "delete", "delete_if_older", "delete_tree"):
        _wrap_method(events, method)
    _wrap_os(events, "link", 1)
    _wrap_os(events, "replace", 1)
    _wrap_os(events, "unlink", 0)
    _wrap_os(events, "rmdir", 0)
    return events


def _run_role(request: dict[str, Any]) -> dict[str, Any]:
    events = _instrument(request["store"], int(request["kill_at"]))
    events.emit("phase", request["role"])
    if request["role"] == "write":
        result = write_next(request["store"], request.get("keep_latest", 2))
    elif request["role"] == "gc":
        result = run_gc(request["store"], request.get("keep_latest"), float(request.get("min_age_s", 0.0)),
                        request.get("grace_s"))
    else:
        raise ValueError(f"unknown role {request['role']!r}")
    events.emit("phase", "done")
    return {"exit": 0, "events": events.names, "result": result}


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _serve_one(request: dict[str, Any]) -> dict[str, Any]:
    if _threads() != 1:
        return {"exit": 1, "error": f"the fork server runs {_threads()} threads; forking it is unsafe"}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report on the pipe, never return
        os.close(read_end)
        os.dup2(2, 1)  # stdout carries the server's answers: whatever the child prints goes to stderr
        signal.alarm(CHILD_TIMEOUT_S)  # a hung child ends (SIGALRM), whatever becomes of its parent
        code = 1
        try:
            try:
                reply = _run_role(request)
                code = 0
            except BaseException:  # noqa: BLE001 - reported to the test, which names it
                reply = {"exit": 1, "error": traceback.format_exc()}
            with os.fdopen(write_end, "w") as out:
                json.dump(reply, out)
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as inp:
        text = inp.read()  # until the child exits (or is killed): the pipe closes with it
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    reply = json.loads(text) if text else {"error": "no reply"}
    reply["exit"] = os.WEXITSTATUS(status)
    return reply


def serve() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(_serve_one(json.loads(line))), flush=True)


# --- race modes ----------------------------------------------------------------------------------

def _pausing(rng: random.Random, methods: tuple[str, ...], longest_s: float) -> None:
    """Pause at random before each of ``methods`` of the local store (a slow, busy store)."""
    for name in methods:
        original = getattr(local.LocalStore, name)

        def wrapper(self, *args, _original=original, **kwargs):
            time.sleep(rng.uniform(0.0, longest_s))
            return _original(self, *args, **kwargs)

        setattr(local.LocalStore, name, wrapper)


def race_writer(store_url: str, seed: int, keep_latests: list[int]) -> None:
    rng = random.Random(seed)
    _pausing(rng, ("create_exclusive", "put_bytes", "delete", "delete_tree"), WRITER_PAUSE_S)

    def wait_for(word: str, then: str):
        def wait(sequence: int) -> None:
            print(f"{word} {sequence}", flush=True)
            if sys.stdin.readline().strip() != then:
                sys.exit(0)
        return wait

    print("ready", flush=True)
    for rnd in range(MAX_ROUNDS):
        line = sys.stdin.readline()
        if not line or line.strip() == "stop":
            return
        t0 = time.time()
        result = write_next(store_url, keep_latests[rnd % len(keep_latests)],
                            pause=lambda: time.sleep(rng.uniform(0.0, WRITER_STEP_PAUSE_S)),
                            after_objects=wait_for("written", "close"),
                            before_publish=wait_for("prepared", "publish"))
        print(f"published {result['sequence']} {t0:.6f} {time.time():.6f}", flush=True)


_listings_in_run = [0]


def _announcing_commit_listings(rng: random.Random) -> None:
    """After each listing of ``_commits/``, print ``listed <callers>`` and pause (race-gc): a writer
    told at that moment commits, and deletes its parent, while this GC has not read them yet."""
    original = local.LocalStore.list_names
    seen_mark = []

    def wrapper(self, prefix, *args, **kwargs):
        names = original(self, prefix, *args, **kwargs)
        if prefix == layout.COMMITS:
            frame, callers = sys._getframe(1), []
            while frame is not None and len(callers) < 6:
                callers.append(frame.f_code.co_name)
                frame = frame.f_back
            chain = "<".join(callers)
            print(f"listed {_listings_in_run[0]} {chain}", flush=True)
            _listings_in_run[0] += 1
            if "mark" in chain:
                seen_mark.append(chain)
            if "mark" in chain or not seen_mark:  # once the GC shows a mark (object_gc.mark), only its listings
                time.sleep(rng.uniform(*GC_LISTED_PAUSE_S))
        return names

    local.LocalStore.list_names = wrapper


def race_gc(store_url: str, seed: int, keep_latest: int | None, grace_s: float, stop_file: str) -> None:
    rng = random.Random(seed)
    _pausing(rng, ("read_bytes", "open_read"), GC_READ_PAUSE_S)
    _pausing(rng, ("list_names", "info", "walk", "delete_if_older"), GC_LIST_PAUSE_S)
    _announcing_commit_listings(rng)
    gc = gc_under_test()
    store = SnapshotStore(store_url).store
    deadline = time.monotonic() + MAX_GC_S
    for n in range(MAX_GC_RUNS):
        if os.path.exists(stop_file) or time.monotonic() > deadline:
            return
        t0 = time.time()
        _listings_in_run[0] = 0
        try:
            report = gc(store, keep_latest=keep_latest, min_age_s=grace_s, grace_s=grace_s)
        except Exception as exc:  # noqa: BLE001 - reported: the test decides (a GC must not fail on a busy store)
            print(f"error {n} {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
            continue
        swept = _swept_objects(report)
        print(f"gc {n} {t0:.6f} {time.time():.6f} {swept}", flush=True)


def gc_stepped(store_url: str, grace_s: float) -> None:
    """One GC run that stops before each object delete: prints ``delete <key>`` and goes on when it
    reads a line on stdin (a GC descheduled between its walk of ``objects/`` and its delete, which
    looks at the object's age again, as one step against a writer's put)."""
    original = local.LocalStore.delete_if_older

    def delete_if_older(self, key, *args, **kwargs):
        if layout.object_of_key(key) is not None:
            print(f"delete {key}", flush=True)
            sys.stdin.readline()
        return original(self, key, *args, **kwargs)

    local.LocalStore.delete_if_older = delete_if_older
    print(f"done {json.dumps(run_gc(store_url, None, grace_s, grace_s))}", flush=True)


def _swept_objects(report: Any) -> int:
    """How many objects a GC report says were swept (``GcReport.swept_objects``; -1: it does not say)."""
    swept = getattr(report, "swept_objects", None)
    return -1 if swept is None else len(swept)


# --- for the tests: the fork server's client, and what a store holds -------------------------------

class ForkServer:
    """The ``serve`` mode as a subprocess: :meth:`run` sends one request and returns the answer."""

    def __init__(self, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self._read() == {"ready": True}

    def _read(self) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:  # its child ends by itself (CHILD_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(f"the fork server gave no answer in {self.timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, role: str, store: str | Path, kill_at: int = 0, **args: Any) -> dict[str, Any]:
        """Run ``role`` against ``store`` in a forked child killed at event ``kill_at`` (0: none)."""
        self.proc.stdin.write(json.dumps({"role": role, "store": str(store), "kill_at": kill_at, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def age(root: Path, seconds: float) -> None:
    """Set every file and folder of the store ``seconds`` into the past (time passes: only when no
    writer is alive, or for files only finished writers wrote)."""
    then = time.time() - seconds
    for path in [*root.rglob("*"), root]:
        try:
            os.utime(path, (then, then), follow_symlinks=False)
        except FileNotFoundError:
            continue


def objects_on_disk(root: Path) -> set[str]:
    """The objects the store holds (names ``sha256:<hex>``), temporary files left out."""
    found = set()
    for path in (root / layout.OBJECTS).glob("*/*"):
        name = layout.object_of_key(path.relative_to(root).as_posix())
        if name is not None:
            found.add(name)
    return found


def committed_objects(root: Path) -> dict[str, list[int]]:
    """Each object a committed manifest names, with the sequences naming it."""
    store = SnapshotStore(str(root))
    named: dict[str, list[int]] = {}
    for commit in store.list():
        for f in store.open(commit.sequence).manifest.files:
            if f.object is not None:
                named.setdefault(f.object, []).append(commit.sequence)
    return named


def leftovers(root: Path) -> dict[str, list[str]]:
    """What no committed snapshot holds: draft folders, temporary files, objects nothing names."""
    committed = {c.snapshot_id for c in SnapshotStore(str(root)).list()}
    folders = sorted(p.name for p in (root / layout.SNAPSHOTS).iterdir()) if (root / layout.SNAPSHOTS).exists() else []
    return {"drafts": [f for f in folders if f not in committed],
            "temps": sorted(str(p.relative_to(root)) for p in root.rglob(".tmp-*")),
            "objects": sorted(objects_on_disk(root) - set(committed_objects(root)))}


def main(argv: list[str]) -> int:
    mode = argv[1]
    if mode == "serve":
        serve()
    elif mode == "race-writer":
        race_writer(argv[2], int(argv[3]), [int(k) for k in argv[4].split(",")])
    elif mode == "gc-stepped":
        gc_stepped(argv[2], float(argv[3]))
    elif mode == "race-gc":
        keep = None if argv[4] == "none" else int(argv[4])
        race_gc(argv[2], int(argv[3]), keep, float(argv[5]), argv[6])
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
