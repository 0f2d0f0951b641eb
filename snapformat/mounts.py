"""Which mounted file system holds a path (Linux's ``/proc/mounts``).

A commit's files are written on several threads so that their fsyncs overlap (:class:`snapformat.
gym_dir.DurableFiles`). On a memory-backed file system an fsync writes nothing, and the threads
only add hand-offs and contention for the interpreter: there one thread is faster (measured in
``FSYNC_WORKERS``'s comment). This module tells the two apart, and names the disk a benchmark ran
on. Where ``/proc/mounts`` cannot be read (not Linux), nothing is known and callers keep their
default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MOUNTS_FILE = "/proc/mounts"
#: File systems that keep their files in memory: an fsync there writes nothing.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of the mount table: the device, where it is mounted and its file system type."""

    device: str
    mount_point: str
    fs_type: str

    @property
    def in_memory(self) -> bool:
        return self.fs_type in MEMORY_FILE_SYSTEMS


def _unescape(field: str) -> str:
    """The kernel writes a space, tab, newline or backslash of a mount point as three octal digits."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """The mounts of a ``/proc/mounts`` text, in order; a line of fewer than three fields is skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            mounts.append(Mount(device=_unescape(fields[0]), mount_point=_unescape(fields[1]), fs_type=fields[2]))
    return mounts


def mount_of(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> Mount | None:
    """The mount that holds ``path`` (symbolic links resolved; the longest mount point containing it,
    the later line of equals, as the kernel stacks them), from ``mounts`` or else the system's table;
    None when the table cannot be read or names none."""
    if mounts is None:
        try:
            with open(MOUNTS_FILE, encoding="utf-8", errors="replace") as fh:
                mounts = parse_mounts(fh.read())
        except OSError:
            return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts:
        point = m.mount_point
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = m
    return best
