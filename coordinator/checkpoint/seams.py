"""What the Checkpointer works with, each passed in: Gym's control calls, the store, the data plane,
the kill-point hooks, the config, and the controller's two acknowledgement calls.

None of them is the controller: a save reads the controller's records through a
:class:`RecordsSource` handed to it per save, and a restore hands back the bookkeeping it rebuilt
(:class:`~coordinator.checkpoint.outcomes.RestoreOutcome`) for the controller to adopt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.bookkeeping import Bookkeeping, ControllerRecords
from coordinator.config import ControllerConfig
from coordinator.dataplane import DataPlane
from coordinator.faults import Steps
from snapformat.snapshot_store import SnapshotStore

if TYPE_CHECKING:
    from gymkit.gym_fleet import AbortResult, CommitResult, DiscardResult, PrepareResult, RestoreResult


class GymControl(Protocol):
    """Gym's checkpoint calls, blocking: the NemoGym actor's methods (NeMo-RL's names and arguments),
    through the controller's handle. Each raises :class:`~coordinator.errors.GymCallError` when a
    server fails."""

    def prepare_checkpoint(self, checkpoint_id: str, deadline_ts: float, *,
                           hold_when_unacknowledged: bool = False) -> PrepareResult: ...

    def commit_checkpoint(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> CommitResult: ...

    def resume_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> object: ...

    def abort_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> AbortResult: ...

    def restore_checkpoint(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str,
                           source_checkpoint_id: str | None = None) -> RestoreResult: ...

    def discard_restored_agent_continuations(self, checkpoint_id: str, deadline_ts: float,
                                             executions: Sequence[dict[str, Any]]) -> DiscardResult: ...


class RecordsSource(Protocol):
    """The controller's records, as an immutable copy taken now (the controller's share of the cut).
    :class:`~coordinator.bookkeeping.Bookkeeping` is one."""

    def records(self) -> ControllerRecords: ...


@dataclass(frozen=True)
class Seams:
    """The Checkpointer's collaborators.

    ``store_and_acknowledge`` is save step 1's drain: store every finished result Gym holds in the
    data plane, then send every acknowledgement owed (the step is timed as ``flush_acks``, its name in
    reports and manifests). ``acknowledge`` sends the acknowledgements a restored bookkeeping owes
    and marks them sent in it (restore step 3)."""

    gym: GymControl
    store: SnapshotStore
    plane: DataPlane
    config: ControllerConfig
    steps: Steps
    store_and_acknowledge: Callable[[], object]
    acknowledge: Callable[[Bookkeeping], object]
    staging_dir: str | None = None  # where Gym's files are staged (ControllerConfig.gym_staging)
