"""What the agents' committed boundaries say they saw of each resources server, read once for every
resources server of a process.

A resources server's restore checks its sessions against the agents' dependency index ("Agent
revisions on restore" in :mod:`gymkit.resources_control`). Gym has no index per resources server, so
each of S resources servers reads every agent's index: N rows each, S x N in all. Servers hosted
several to a process (as the scale benchmark's hosts do, 25 resources servers each) need not each
read them: :class:`AgentDependencies`, passed to each of their routers, reads one ``checkpoint_dir``'s
indexes once and answers each server its own revisions. A server hosted alone gets one of its own,
which reads as it always did.

**Why a shared answer is the answer a read of its own would give.** An entry is keyed by the
checkpoint dir and the SHA-256 of the bytes of every agent manifest under it. A manifest binds its
two index files through their references' SHA-256, and the read checks each reference (and each
archive member it reads against its index row), so the same manifest bytes name the same rows. The
key is taken again after a read; an entry is kept only if no manifest changed meanwhile.

**Threads.** Gym's kit restores in ``asyncio.to_thread``, so the servers of a process ask at once:
one reads while the others wait for its answer. A read that fails keeps nothing: each waiting server
then reads for itself and reports its own error. Only the last dir read is kept: a resources server
restores once per process, and a retry reads the same dir.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from gymkit.checkpoint_dir import iter_resource_dependencies
from gymkit.fence import ControlError
from schemas.gym_files import AGENT_DIR, MANIFEST_NAME

Key = tuple[str, int]  # (rollout id, attempt index)
#: One checkpoint dir's manifests: (dir, ((manifest path, its SHA-256), ...)).
_Manifests = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class _Answers:
    """Every server's revisions in one checkpoint dir, and the servers the agents disagree about."""

    by_server: dict[str, dict[Key, int]]
    disagreements: dict[str, str]  # server name -> what the agents' records disagree on


@dataclass
class _Entry:
    key: _Manifests
    lock: threading.Lock = field(default_factory=threading.Lock)
    answers: _Answers | None = None


class AgentDependencies:
    """The agents' dependency indexes of a checkpoint dir, read once and shared by the resources
    servers given the same instance (see the module's docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _last; the entry's own lock guards its read
        self._last: _Entry | None = None

    def revisions(self, checkpoint_dir: str, server_name: str) -> dict[Key, int]:
        """What the agents' committed boundary records in ``checkpoint_dir/agent`` say they saw of
        ``server_name``: (rid, n) -> revision. ``resource_revision_mismatch`` if two records of one
        attempt name two revisions of it. Raises what the read raises (``SnapshotError``,
        ``OSError``) on an agent folder that does not check."""
        key = _manifests(checkpoint_dir)
        entry = self._entry(key)
        with entry.lock:
            if entry.answers is None:
                answers = _read(key)
                if _manifests(checkpoint_dir) != key:  # a manifest changed under the read: not for others
                    return _answer(answers, server_name)
                entry.answers = answers
        return _answer(entry.answers, server_name)

    def _entry(self, key: _Manifests) -> _Entry:
        """The entry of ``key``: the last one if it is that dir with those manifests, else a new last."""
        with self._lock:
            if self._last is None or self._last.key != key:
                self._last = _Entry(key)
            return self._last


def _manifests(checkpoint_dir: str) -> _Manifests:
    """The key of ``checkpoint_dir``'s agent folders: every agent manifest and its bytes' SHA-256."""
    root = Path(checkpoint_dir) / AGENT_DIR
    paths = sorted(root.rglob(MANIFEST_NAME)) if root.is_dir() else []
    return str(Path(checkpoint_dir).resolve()), tuple((str(p), hashlib.sha256(p.read_bytes()).hexdigest())
                                                      for p in paths)


def _read(manifests: _Manifests) -> _Answers:
    """The dependency index of every agent folder ``manifests`` names, turned round: server ->
    (rid, n) -> revision."""
    by_server: dict[str, dict[Key, int]] = {}
    disagreements: dict[str, str] = {}
    for manifest_path, _ in manifests[1]:
        for key, revisions in iter_resource_dependencies(Path(manifest_path).parent):
            for server, rev in revisions.items():
                seen = by_server.setdefault(server, {})
                if seen.setdefault(key, rev) != rev and server not in disagreements:
                    disagreements[server] = (f"agent records of rollout {key[0]!r} attempt {key[1]} name revisions "
                                             f"{seen[key]} and {rev} of {server!r}")
    return _Answers(by_server, disagreements)


def _answer(answers: _Answers, server_name: str) -> dict[Key, int]:
    if server_name in answers.disagreements:
        raise ControlError("resource_revision_mismatch", answers.disagreements[server_name])
    return dict(answers.by_server.get(server_name, {}))
