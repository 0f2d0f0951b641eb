"""What goes wrong between a data plane and a snapshot, as errors of their own.

Each is a :class:`~schemas.errors.SnapshotError`, so a save or restore that meets one fails the way
it fails on any other snapshot error. Rows that break the row rules raise
:class:`~schemas.errors.InvalidRecordError` instead, as everywhere else.
"""

from __future__ import annotations

from schemas.errors import SnapshotError


class DataPlaneError(SnapshotError):
    """The data plane cannot be cut or loaded as asked (it changed, it is not empty, ...)."""


class DataPlaneChangedError(DataPlaneError):
    """Rows changed while the cut was read: the data plane's producers were not held at the barrier."""


class DataPlaneNotEmptyError(DataPlaneError):
    """``load`` was asked to restore into a data plane that still holds partitions."""


__all__ = ["DataPlaneChangedError", "DataPlaneError", "DataPlaneNotEmptyError"]
