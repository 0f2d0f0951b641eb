"""coordinator: the Single Controller's side of a rollout snapshot (GitHub issue 5).

Dependencies point one way: ``schemas`` <- ``snapformat`` <- ``coordinator``. Importing this package
loads neither Ray nor torch: the TransferQueue adapter lives in :mod:`coordinator.tq_adapter` and the
Ray/TransferQueue start-up in :mod:`coordinator.ray_runtime`, imported only by who needs them.
"""

from coordinator.data_plane import (
    DATAPLANE, FILE_NAMES, TOKEN_CAPTURE, TRAINING, DataPlane, DataPlaneChangedError, DataPlaneCut, DataPlaneError,
    DataPlaneNotEmptyError, FieldSpec, InMemoryDataPlane, LoadReport, Objects, Ragged, write_cut,
)

__all__ = [
    "DATAPLANE", "FILE_NAMES", "TOKEN_CAPTURE", "TRAINING", "DataPlane", "DataPlaneChangedError", "DataPlaneCut",
    "DataPlaneError", "DataPlaneNotEmptyError", "FieldSpec", "InMemoryDataPlane", "LoadReport", "Objects",
    "Ragged", "write_cut",
]
