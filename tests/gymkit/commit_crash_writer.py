"""Gym's three commits written into one ``checkpoint_dir`` with every file-system call on it numbered:
``test_commit_crash.py`` runs this as a subprocess and kills it at each number, and reuses
:class:`OsTrace` in-process to check the order of the calls against a model of what a power loss
keeps (a file's bytes only once fsynced, a name only once its folder is fsynced).

``python commit_crash_writer.py ROOT K1 K2 ...``
    Imports once, then for each ``K`` forks a child that writes the three commits (agent, model
    ledger given the agent's continuation roots, resources; the gymkit writers, with their thread
    pools) into ``ROOT/<K>/`` and SIGKILLs itself, from whichever thread emits it, at event
    number ``K`` (1-based). The parent prints one JSON line per child: ``{"k", "killed", "events"}``
    (``events`` is the number a child that was not killed emitted). ``K`` 0 kills nothing.

Events are the calls of :data:`TRACED` whose path (or the path of the descriptor) lies under the
child's ``checkpoint_dir``, each emitted ``before`` and ``after`` the call, so a kill can land
between any two of them: before or after a temporary file's ``fsync``, a rename, a folder's
``fsync``, the manifest's rename, ...
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gymkit import checkpoint_dir as cd
from schemas.gym_files import AgentBoundaryRecord, ExternalStorageReference, MutationReceipt, ResourceSnapshot
from snapformat.gym_dir import continuation_roots

CHECKPOINT_ID = "ckpt-crash"
AGENT, MODEL, RESOURCE = "agent0", "policy0", "tools"
ROLLOUTS = 5
#: Archives of at most this many members, so the agent's commit writes several (the real bound is 512).
ARCHIVE_MEMBERS = 2
TRACED = ("open", "write", "fsync", "close", "replace", "unlink", "mkdir", "rmdir")


class OsTrace:
    """Wraps the ``os`` calls of :data:`TRACED` (every thread sees the wrappers) and records, under a
    lock, ``(number, "before"|"after", call, path, detail)`` for the calls on paths under ``root``.
    ``on_event(number)`` runs after each event is recorded (the kill)."""

    def __init__(self, root: Path, on_event: Callable[[int], None] | None = None) -> None:
        self.root = str(Path(root).absolute())
        self.on_event = on_event
        self.events: list[tuple[int, str, str, str, Any]] = []
        self._lock = threading.Lock()
        self._fds: dict[int, tuple[str, bool]] = {}  # fd -> (path, is a folder)
        self._originals: dict[str, Any] = {}

    def _ours(self, path: Any) -> str | None:
        text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        if text is None:
            return None
        text = os.path.abspath(text)
        return text if text == self.root or text.startswith(self.root + os.sep) else None

    def emit(self, when: str, call: str, path: str, detail: Any = None) -> None:
        with self._lock:
            number = len(self.events) + 1
            self.events.append((number, when, call, path, detail))
        if self.on_event is not None:
            self.on_event(number)

    def mark(self, what: str, path: Path) -> None:
        """A marker event (``returned`` when a commit's writer returns)."""
        self.emit("mark", what, os.path.abspath(path))

    def install(self) -> None:
        for name in TRACED:
            self._originals[name] = getattr(os, name)
        orig = self._originals

        def traced(name: str, path: str, call: Callable[[], Any], detail: Any = None) -> Any:
            self.emit("before", name, path, detail)
            result = call()
            self.emit("after", name, path, detail)
            return result

        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
            ours = self._ours(path)
            if ours is None:
                return orig["open"](path, flags, mode, dir_fd=dir_fd)
            is_dir = bool(flags & os.O_DIRECTORY)
            fd = traced("open", ours, lambda: orig["open"](path, flags, mode, dir_fd=dir_fd),
                        {"dir": is_dir, "create": bool(flags & os.O_CREAT)})
            with self._lock:
                self._fds[fd] = (ours, is_dir)
            return fd

        def by_fd(name: str) -> Callable[..., Any]:
            def wrapper(fd: int, *args: Any) -> Any:
                with self._lock:
                    known = self._fds.get(fd)
                if known is None:
                    return orig[name](fd, *args)
                path, is_dir = known
                if name == "close":
                    with self._lock:
                        self._fds.pop(fd, None)
                return traced(name, path, lambda: orig[name](fd, *args), {"dir": is_dir})
            return wrapper

        def by_path(name: str) -> Callable[..., Any]:
            def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
                ours = self._ours(path)
                if ours is None:
                    return orig[name](path, *args, **kwargs)
                return traced(name, ours, lambda: orig[name](path, *args, **kwargs))
            return wrapper

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            ours = self._ours(dst)
            if ours is None:
                return orig["replace"](src, dst, *args, **kwargs)
            return traced("replace", ours, lambda: orig["replace"](src, dst, *args, **kwargs),
                          os.path.abspath(os.fspath(src)))

        os.open = open_  # type: ignore[assignment]
        for name in ("write", "fsync", "close"):
            setattr(os, name, by_fd(name))
        for name in ("unlink", "mkdir", "rmdir"):
            setattr(os, name, by_path(name))
        os.replace = replace  # type: ignore[assignment]

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(os, name, fn)
        self._originals.clear()


# -- the commits -----------------------------------------------------------------------------------------------------
def records() -> list[AgentBoundaryRecord]:
    return [AgentBoundaryRecord(rollout_id=f"r{i}", attempt_index=i % 2, boundary_index=i + 1, turn_index=i,
                                output_items=[{"type": "message", "text": f"turn {i} " + "x" * 200 * i}],
                                last_committed_model_call_id=f"call-{i}",
                                resource_state_revisions={RESOURCE: i}, agent_state={"messages": 2 * i})
            for i in range(ROLLOUTS)]


def sessions() -> list[ResourceSnapshot]:
    receipt = MutationReceipt(request_id="q1", expected_revision=0, input_digest="a" * 64, status=200,
                              headers=[("content-type", "application/json")], body_base64="e30=", resulting_revision=1)
    return [ResourceSnapshot(rollout_id=f"r{i}", attempt_index=i % 2, state_revision=i,
                             state={"files": {"notes.txt": "y" * 300 * i}}, mutation_receipts=[receipt])
            for i in range(ROLLOUTS)]


def folders(checkpoint_dir: Path) -> dict[str, Path]:
    """Each commit's folder, in commit order."""
    from schemas.gym_files import agent_instance_dir, ledger_dir, resources_dir
    return {"agent": checkpoint_dir / agent_instance_dir(AGENT), "ledger": checkpoint_dir / ledger_dir(MODEL),
            "resources": checkpoint_dir / resources_dir(RESOURCE)}


def commit_all(checkpoint_dir: Path, trace: OsTrace | None = None, *, skip_committed: bool = False) -> None:
    """The three commits in Gym's order. ``skip_committed``: a folder that holds a manifest is left as
    it is (what a repeated commit does, after checking it), as a retry after a crash does. The caller
    sets ``gymkit.checkpoint_dir.AGENT_ARCHIVE_MAX_MEMBERS`` to :data:`ARCHIVE_MEMBERS`."""
    where = folders(checkpoint_dir)
    recs = records()
    roots = continuation_roots(recs)
    if not (skip_committed and (where["agent"] / "manifest.json").exists()):
        cd.write_agent_dir(checkpoint_dir, CHECKPOINT_ID, AGENT, recs)
        if trace is not None:
            trace.mark("returned", where["agent"])
    if not (skip_committed and (where["ledger"] / "manifest.json").exists()):
        lineages = {r.capture_key: b"".join(b'{"call":"%s","turn":%d}\n' % (f"c{t}".encode(), t)
                                            for t in range(r.attempt_index + 2)) for r in roots}
        refs = [ExternalStorageReference(capture_key=r.capture_key,
                                         boundary_model_call_id=r.last_committed_model_call_id,
                                         key=f"{r.capture_key}/{r.last_committed_model_call_id}") for r in roots]
        cd.write_ledger_dir(checkpoint_dir, CHECKPOINT_ID, MODEL, lineages=lineages, storage_references=refs,
                            roots=roots)
        if trace is not None:
            trace.mark("returned", where["ledger"])
    if not (skip_committed and (where["resources"] / "manifest.json").exists()):
        cd.write_resources_dir(checkpoint_dir, CHECKPOINT_ID, RESOURCE, sessions())
        if trace is not None:
            trace.mark("returned", where["resources"])


def _child(checkpoint_dir: Path, kill_at: int) -> int:
    def on_event(number: int) -> None:
        if number == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    trace = OsTrace(checkpoint_dir, on_event)
    trace.install()
    commit_all(checkpoint_dir, trace)
    trace.uninstall()
    return len(trace.events)


def main(argv: list[str]) -> int:
    root = Path(argv[1])
    cd.AGENT_ARCHIVE_MAX_MEMBERS = ARCHIVE_MEMBERS  # type: ignore[attr-defined]
    print(json.dumps({"gymkit": cd.__file__}), flush=True)  # which code runs (the test checks it is the tree's)
    for k in (int(a) for a in argv[2:]):
        target = root / str(k)
        target.mkdir(parents=True)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: write, report the number of events, exit without cleanup
            os.close(r)
            code = 0
            try:
                n = _child(target, k)
                os.write(w, str(n).encode())
            except BaseException:  # noqa: BLE001 - reported by the exit code
                code = 3
            os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as fh:
            out = fh.read()
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"k": k, "killed": killed, "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                          "events": int(out) if out else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
