"""coordinator: the Single Controller's side of a rollout snapshot (GitHub issue 5).

Dependencies point one way: ``schemas`` <- ``snapformat`` <- ``coordinator``. Importing this package
loads neither Ray nor torch: the data plane's interface is :mod:`coordinator.dataplane`, its
TransferQueue adapter lives in :mod:`coordinator.dataplane.tq.adapter` and the Ray/TransferQueue
start-up in :mod:`coordinator.ray_runtime`, imported only by who needs them. Saving and restoring
are :mod:`coordinator.checkpoint`'s (:class:`Checkpointer` and the outcomes it returns).
"""

from coordinator.checkpoint import Checkpointer, RestoreOutcome, RestoreReport, SaveOutcome, SaveReport, Seams
from coordinator.dataplane import (
    DATAPLANE,
    FILE_NAMES,
    TOKEN_CAPTURE,
    TRAINING,
    CopiedCut,
    DataPlane,
    DataPlaneChangedError,
    DataPlaneError,
    DataPlaneNotEmptyError,
    FieldSpec,
    InMemoryDataPlane,
    LoadReport,
    Objects,
    Ragged,
    RowsCut,
)

__all__ = [
    "DATAPLANE", "FILE_NAMES", "TOKEN_CAPTURE", "TRAINING", "CopiedCut", "DataPlane", "DataPlaneChangedError",
    "DataPlaneError", "DataPlaneNotEmptyError", "FieldSpec", "InMemoryDataPlane", "LoadReport", "Objects",
    "Ragged", "RowsCut",
    "Checkpointer", "RestoreOutcome", "RestoreReport", "SaveOutcome", "SaveReport", "Seams",
]
