"""The typed errors of the snapshot contracts.

They live in ``schemas`` (which has no I/O) so that every layer raises and catches the same
classes; ``snapformat`` re-exports them. Every error names what was wrong and, where there is
one, the file and field.
"""

from __future__ import annotations


class SnapshotError(Exception):
    """Base class of every error this project raises on purpose."""


class InvalidRecordError(SnapshotError, ValueError):
    """A record, a name or a row breaks the contract (wrong field, bad identifier, bad path).

    Also a ``ValueError`` so that msgspec reports it, raised in ``__post_init__``, with the field
    path of the offending value.
    """


class InvalidPathError(InvalidRecordError):
    """A file or folder name would leave the snapshot folder, or is not a safe name."""


class VersionError(SnapshotError):
    """The data was written by a newer major version, or needs a feature this reader lacks."""


class CorruptSnapshotError(SnapshotError):
    """Bytes on disk do not match what the manifest promises (size, checksum, parse)."""


class NotPublishedError(SnapshotError):
    """The snapshot (or store) does not exist or was never committed."""


class CommitConflictError(SnapshotError):
    """Another writer already committed this sequence number; this writer lost the race."""


class TopologyMismatchError(SnapshotError):
    """A snapshot was taken by a different set of participants than the running one."""


class StoreError(SnapshotError):
    """The storage backend failed (I/O error, unreachable, bad URL); not a lost race."""
