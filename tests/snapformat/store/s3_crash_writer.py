"""Subprocess program for ``test_s3_faults.py``: snapshot writers on S3 that get SIGKILLed or race.

It runs as a *zygote*: it imports snapformat once (1.5 s or more), then reads JSON commands on
stdin, one per line, and answers each with one JSON line on stdout. The work happens in children
forked from it, so each writer starts instantly and is a real separate process with its own S3
client (the zygote never opens a store itself, so no event loop or connection is shared). A child
sends nothing on the zygote's stdout: its fds 1 and 2 go to a log file given by the test.

Commands (``endpoint`` is the S3 server's URL; the key and secret come from the environment):

``{"op": "run", "mode": "loop"|"step", "url", "endpoint", "seed", "log", "kill": SPEC|null}``
    Forks a writer and answers ``{"pid": PID}`` at once. ``loop`` begins, writes and publishes
    snapshots (``keep_latest=2``) over and over until it is killed, logging ``writing N``,
    ``publishing N`` and ``published N``. ``step`` writes and publishes one snapshot and exits 0,
    logging the same lines and then ``done``. Each snapshot holds the data plane's
    token-capture rows (~8 MB: with ``part_size=5 MiB`` a multipart upload of 2 parts sent in
    parallel) and the controller's loader place and replay index (small single PUTs).
    ``SPEC = {"method", "n", "phase", "key"}``: the child SIGKILLs itself ``before`` or ``after``
    the ``n``-th call (1-based) of ``method`` on a key containing ``key``. Methods are the S3
    calls of a streamed upload (``create_multipart_upload``, ``upload_part`` - sent from the
    upload threads -, ``complete_multipart_upload``, ``put_object`` for small files) and the
    store methods ``create_exclusive`` (the commit), ``put_bytes`` (the hint), ``delete`` and
    ``delete_tree`` (retention). Every call is logged as ``event <phase> <method> <key>``.
``{"op": "wait", "pid", "timeout"}``
    Reaps that child: ``{"pid", "exit": code|null, "signal": sig|null}``, or ``{"timeout": true}``.
``{"op": "race", "n", "procs", "rounds", "url", "endpoint", "log", "timeout"}``
    Forks ``procs`` processes running ``n / procs`` racer threads each (one S3 client per
    process); they live for all rounds. Each round every racer begins a draft and writes the
    controller's part (its loader place); once all are ready (a pipe barrier, so each of them saw
    the same newest sequence) all publish at once. Answers ``{"rounds": [[{"outcome":
    "won"|"lost"|"error", "racer", "pid", "round", "sequence", "snapshot_id", "message"}, ...],
    ...]}``; ``lost`` means ``CommitConflictError``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

from schemas.controller import LoaderPlace, ReplayIndexEntry
from schemas.errors import CommitConflictError
from snapformat import SnapshotStore, example
from snapformat.store import s3

PART_SIZE = 5 << 20  # the S3 minimum part size: the token part really goes up in parts
BULK_ROLLOUTS = 500  # one token batch of ~0.9 MB...
BULK_REPEATS = 9  # ...written 9 times: ~8.3 MB, 2 parts
TOKENS_PATH = "tq/token_capture.arrow"  # the multipart upload, in its snapshot
LOOP_LIMIT = 1000  # bounded: the test kills the loop long before


# -- the writer -------------------------------------------------------------------------------
class _Log:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()

    def say(self, line: str) -> None:
        with self.lock:  # os.write is in the kernel once it returns: a SIGKILL cannot lose it
            os.write(self.fd, (line + "\n").encode())


def open_store(url: str, endpoint: str) -> s3.S3Store:
    return s3.S3Store(url, endpoint_url=endpoint, part_size=PART_SIZE, max_inflight_parts=2)


def write_snapshot(store: SnapshotStore, seed: int, log: _Log | None = None):
    """Begin a draft and write its parts: the data plane's token-capture rows (~8 MB, a
    multipart upload of 2 parts) and the controller's loader place and replay index."""
    draft = store.begin()
    if log is not None:
        log.say(f"writing {draft.sequence} {draft.snapshot_id}")
    rollouts = example.rollouts(BULK_ROLLOUTS, seed)
    batch, _ = next(example.token_batches(rollouts, seed))
    tq = draft.part(TOKENS_PATH.rpartition("/")[0], writer="tq")
    with tq.rows(TOKENS_PATH.rpartition("/")[2], "token_capture_rows") as w:
        for _ in range(BULK_REPEATS):
            w.write(batch)
    ctl = draft.part("controller", writer="controller")
    ctl.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=seed % 1000, seed=seed))
    ctl.write_records("replay_index", "replay_index", [
        ReplayIndexEntry(key=f"{r.key}/sample", partition_id="train", rollout_id=r.rollout_id,
                         attempt_index=r.attempt, group_id=r.group_id, status="ready") for r in rollouts[:20]])
    return draft, [tq.close(), ctl.close()]


def _instrument(log: _Log, kill: dict[str, Any] | None) -> None:
    """Log every S3 step and SIGKILL this process at the one ``kill`` names."""
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def step(phase: str, method: str, key: str) -> None:
        log.say(f"event {phase} {method} {key}")
        if kill is None or method != kill["method"] or kill.get("key", "") not in key:
            return
        if phase == "before":
            with lock:
                counts[method] = counts.get(method, 0) + 1
                hit = counts[method] == kill["n"]
            if hit and kill["phase"] == "before":
                log.say(f"killed before {method} {key}")
                os.kill(os.getpid(), signal.SIGKILL)
            if hit and kill["phase"] == "after":
                threading.current_thread().kill_after = True  # type: ignore[attr-defined]
        elif getattr(threading.current_thread(), "kill_after", False):
            log.say(f"killed after {method} {key}")
            os.kill(os.getpid(), signal.SIGKILL)

    call = s3._MultipartWriter._call

    def traced_call(self, method: str, **kw: Any) -> Any:
        step("before", method, self._display_key)
        out = call(self, method, **kw)
        step("after", method, self._display_key)
        return out

    s3._MultipartWriter._call = traced_call  # type: ignore[method-assign]

    for name in ("create_exclusive", "put_bytes", "delete", "delete_tree"):
        original = getattr(s3.S3Store, name)

        def traced(self, key, *args, _original=original, _name=name, **kwargs):
            step("before", _name, key)
            out = _original(self, key, *args, **kwargs)
            step("after", _name, key)
            return out

        setattr(s3.S3Store, name, traced)


def run_writer(cmd: dict[str, Any], log: _Log) -> None:
    _instrument(log, cmd.get("kill"))
    store = SnapshotStore(open_store(cmd["url"], cmd["endpoint"]))
    seed = int(cmd["seed"])
    for i in range(LOOP_LIMIT if cmd["mode"] == "loop" else 1):
        draft, receipts = write_snapshot(store, seed + i, log)
        log.say(f"publishing {draft.sequence}")
        draft.publish(receipts=receipts, keep_latest=2)
        log.say(f"published {draft.sequence}")
    log.say("done")


# -- the publish race -------------------------------------------------------------------------
def racer_snapshot(store: SnapshotStore, racer: int, round_: int):
    """A small real snapshot (the controller's part) that says who wrote it."""
    draft = store.begin()
    part = draft.part("controller", writer=f"racer-{racer}")
    part.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=round_, seed=racer, dataset_size=100))
    return draft


def racer(cmd: dict[str, Any], store: SnapshotStore, index: int, ready_w: int, go_r: int, results_w: int) -> None:
    """One racer: each round, write a draft, wait for the go, publish, report."""
    for round_ in range(int(cmd["rounds"])):
        result: dict[str, Any] = {"outcome": "error", "racer": index, "pid": os.getpid(), "round": round_}
        draft = None
        try:
            draft = racer_snapshot(store, index, round_)
            result.update(sequence=draft.sequence, snapshot_id=draft.snapshot_id)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            result["message"] = f"{type(exc).__name__}: {exc}"
        os.write(ready_w, b"r")
        if os.read(go_r, 1) != b"g":  # one byte per racer: each read takes exactly one
            return
        if draft is not None:
            try:
                draft.publish()
                result["outcome"] = "won"
            except CommitConflictError as exc:
                result.update(outcome="lost", message=str(exc))
            except BaseException as exc:  # noqa: BLE001
                result["message"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        line = json.dumps(result)[:3000] + "\n"  # under PIPE_BUF: one atomic write per report
        os.write(results_w, line.encode())


def race_child(cmd: dict[str, Any], first: int, count: int, ready_w: int, go_r: int, results_w: int) -> None:
    """A racing process: ``count`` racer threads sharing one store object (one S3 client)."""
    store = SnapshotStore(open_store(cmd["url"], cmd["endpoint"]))
    threads = [threading.Thread(target=racer, args=(cmd, store, first + t, ready_w, go_r, results_w))
               for t in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _read_lines(fd: int, n: int, deadline: float) -> list[str]:
    buf = b""
    while buf.count(b"\n") < n:
        more = _read_exactly(fd, 1, deadline)
        if not more:
            break
        buf += more
    return buf.decode().splitlines()


def run_race(cmd: dict[str, Any]) -> dict[str, Any]:
    """Fork ``n`` racers; per round: wait until all are ready, let all publish at once, collect."""
    n, rounds, procs = int(cmd["n"]), int(cmd["rounds"]), int(cmd["procs"])
    per_proc = n // procs
    assert per_proc * procs == n, "n must be a multiple of procs"
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    results_r, results_w = os.pipe()
    pids = []
    for i in range(procs):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child_stdio(cmd["log"])
                for fd in (ready_r, go_w, results_r):
                    os.close(fd)
                race_child(cmd, i * per_proc, per_proc, ready_w, go_r, results_w)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 3
            finally:
                os._exit(code)
        pids.append(pid)
    for fd in (ready_w, go_r, results_w):
        os.close(fd)
    out: dict[str, Any] = {"rounds": []}
    for _ in range(rounds):
        # Each round gets the whole time limit: a loaded CI machine may make one round slow, and a
        # limit shared by all rounds would then fail a later round that is merely late.
        deadline = time.monotonic() + float(cmd.get("timeout", 120))
        ready = _read_exactly(ready_r, n, deadline)
        if len(ready) != n:
            os.write(go_w, b"x" * n)  # not all ready: nobody publishes
            out["error"] = f"only {len(ready)} of {n} racers got ready"
            break
        os.write(go_w, b"g" * n)  # every racer has its draft: all publish together
        out["rounds"].append([json.loads(x) for x in _read_lines(results_r, n, deadline)])
    deadline = time.monotonic() + float(cmd.get("timeout", 120))
    for pid in pids:
        if _reap(pid, max(0.0, deadline - time.monotonic())) is None:
            os.kill(pid, signal.SIGKILL)
            _reap(pid, 10)
    for fd in (ready_r, go_w, results_r):
        os.close(fd)
    return out


# -- the zygote -------------------------------------------------------------------------------
def _child_stdio(log_path: str) -> int:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    return fd


def _reap(pid: int, timeout: float) -> tuple[int | None, int | None] | None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return None, os.WTERMSIG(status)
            return os.WEXITSTATUS(status), None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def spawn_writer(cmd: dict[str, Any]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            log = _Log(_child_stdio(cmd["log"]))
            run_writer(cmd, log)
        except BaseException:  # noqa: BLE001 - the test reads the log
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    return pid


def main() -> int:
    reply = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "run":
            out: dict[str, Any] = {"pid": spawn_writer(cmd)}
        elif cmd["op"] == "wait":
            got = _reap(int(cmd["pid"]), float(cmd["timeout"]))
            out = {"timeout": True} if got is None else {"pid": cmd["pid"], "exit": got[0], "signal": got[1]}
        elif cmd["op"] == "race":
            out = run_race(cmd)
        else:
            out = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(out), file=reply, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
