"""Checkpointing the Single Controller's run: save, restore, RL's cut and the background writer.

- :mod:`.checkpointer`: :class:`Checkpointer`, the one entry point, built from :class:`Seams`;
- :mod:`.seams`: its collaborators (Gym's control calls, the store, the data plane, the kill-point
  hooks, the config, the controller's acknowledgement calls) and :class:`RecordsSource`;
- :mod:`.outcomes`: :class:`SaveOutcome` and :class:`RestoreOutcome`, and the reports they carry;
- :mod:`.save`, :mod:`.restore`: the steps, each a named boundary (:mod:`coordinator.faults`);
- :mod:`.cut`: RL's in-memory cut, kept apart from the writing of its bytes;
- :mod:`.writer`: the background writer; :mod:`.history`: finished attempts and the failure rule,
  and the segments of the newest snapshot, which an incremental save lists again.
"""

from coordinator.checkpoint.checkpointer import Checkpointer
from coordinator.checkpoint.outcomes import (
    Continued,
    RestoreOutcome,
    RestoreReport,
    SaveOutcome,
    SaveReport,
    SaveStatus,
)
from coordinator.checkpoint.seams import GymControl, RecordsSource, Seams

__all__ = ["Checkpointer", "Continued", "GymControl", "RecordsSource", "RestoreOutcome", "RestoreReport",
           "SaveOutcome", "SaveReport", "SaveStatus", "Seams"]
