"""A snapshot writer that ``test_crash.py`` runs as a subprocess and kills with SIGKILL.

Two modes:

``loop STORE SEED``
    Prints ``ready`` once imported, then begins, writes and publishes example snapshots
    (``keep_latest=2``) over and over with varied sizes until the test kills it. Prints (flushed)
    ``writing <seq>`` after ``begin``, ``publishing <seq>`` before ``publish`` and
    ``published <seq>`` once it returns, so the test knows where each kill landed and which
    snapshots the writer saw as durable.

``step STORE KILL_AT``
    Writes and publishes one example snapshot (``keep_latest=2``) with every store step
    instrumented: each step emits a numbered event (``before:``/``after:`` a store method, the
    ``os.link``/``os.replace``/``os.unlink``/``os.rmdir`` calls inside it, a file's ``close``).
    When event number ``KILL_AT`` (1-based) is emitted the process SIGKILLs itself right there.
    ``KILL_AT`` 0 kills nothing and prints the event list as JSON, so the test can choose its
    kill points and compute what each one must leave behind.

Events name keys relative to the store with snapshot ids replaced by ``<id>`` and temporary
names by ``<tmp>``, so that the same run yields the same list every time.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapformat import SnapshotStore, example
from snapformat.store import local

LOOP_COUNTS = (1, 2, 3, 5, 8, 40, 200)  # small ones make publish a real share of the time
STEP_COUNT, STEP_SEED = 3, 7
_ID_RE = re.compile(r"snap-[0-9]{10,20}-[0-9a-f]{8}")
_TMP_RE = re.compile(r"\.tmp-[0-9a-f]{32}")


def run_loop(store_url: str, seed: int) -> None:
    rng = random.Random(seed)
    store = SnapshotStore(store_url)
    print("ready", flush=True)
    for _ in range(10_000):  # bounded: the test kills it long before
        draft = store.begin()
        print(f"writing {draft.sequence}", flush=True)
        gym, receipts = example.write_example(draft, rng.choice(LOOP_COUNTS), rng.randrange(1 << 30))
        print(f"publishing {draft.sequence}", flush=True)
        draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY, keep_latest=2)
        print(f"published {draft.sequence}", flush=True)


class _Events:
    """Numbers every step and SIGKILLs this process at step ``kill_at``."""

    def __init__(self, root: Path, kill_at: int) -> None:
        self.root = str(root.absolute())
        self.kill_at = kill_at
        self.names: list[str] = []

    def name(self, what: str, key: Any) -> str:
        text = str(key)
        if text.startswith(self.root):
            text = text[len(self.root):].lstrip("/")
        text = _TMP_RE.sub(".tmp-<tmp>", _ID_RE.sub("<id>", text))
        return f"{what}:{text}"

    def emit(self, what: str, key: Any) -> None:
        self.names.append(self.name(what, key))
        if len(self.names) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def _wrap_method(events: _Events, name: str) -> None:
    original = getattr(local.LocalStore, name)

    def wrapper(self, key, *args, **kwargs):
        events.emit(f"before:{name}", key)
        result = original(self, key, *args, **kwargs)
        if name == "open_write":
            _wrap_close(events, result, key)
        events.emit(f"after:{name}", key)
        return result

    setattr(local.LocalStore, name, wrapper)


def _wrap_close(events: _Events, fh: Any, key: str) -> None:
    close = fh.close

    def wrapped_close() -> None:
        was_closed = fh.closed
        close()
        if not was_closed:  # the file is durable from here on
            events.emit("after:close", key)

    fh.close = wrapped_close


def _wrap_os(events: _Events, name: str, path_arg: int) -> None:
    original: Callable[..., Any] = getattr(os, name)

    def wrapper(*args, **kwargs):
        events.emit(f"before:os.{name}", args[path_arg])
        result = original(*args, **kwargs)
        events.emit(f"after:os.{name}", args[path_arg])
        return result

    setattr(os, name, wrapper)


def run_step(store_url: str, kill_at: int) -> None:
    events = _Events(Path(store_url), kill_at)
    for method in ("open_write", "put_bytes", "create_exclusive", "delete", "delete_tree"):
        _wrap_method(events, method)
    # The destination names the step: the commit link, the hint replace, each removal.
    _wrap_os(events, "link", 1)
    _wrap_os(events, "replace", 1)
    _wrap_os(events, "unlink", 0)
    _wrap_os(events, "rmdir", 0)
    store = SnapshotStore(store_url)
    events.emit("phase", "begin")
    draft = store.begin()
    events.emit("phase", "write")
    gym, receipts = example.write_example(draft, STEP_COUNT, STEP_SEED)
    events.emit("phase", "publish")
    draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY, keep_latest=2)
    events.emit("phase", "done")
    if kill_at == 0:
        print(json.dumps({"sequence": draft.sequence, "events": events.names}), flush=True)


def main(argv: list[str]) -> int:
    mode, store_url, number = argv[1], argv[2], int(argv[3])
    if mode == "loop":
        run_loop(store_url, number)
    elif mode == "step":
        run_step(store_url, number)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
