"""What a save or a restore came to: reports (the records a job logs and a run's outcome lists) and
outcomes (what the controller applies).

The reports are frozen msgspec structs with the fields and names they always had: ``saves.jsonl``,
the demo, the soak and the benchmarks read them. The outcomes are frozen dataclasses that live in
the controller's process only: they carry what cannot be serialised (the rebuilt bookkeeping, an
exception with its type). A save that fails before publishing is an outcome (``aborted``), not an
exception; what must stop the run (too many failures in a row) still raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from coordinator.bookkeeping import Bookkeeping


class SaveReport(msgspec.Struct, frozen=True, kw_only=True):
    """One save attempt: whether it was published, how long each step took, the pause, and what it
    wrote.

    ``steps_s`` names the steps as they always were (``flush_acks``, ``prepare``, ``gym_commit``,
    ``cut_wait``, ``cut``, ``resume``, ``write``, ``publish``), in the order they ran. ``cut_bytes``:
    Arrow memory of the data plane's rows built and written; ``rows``: rows per kind the snapshot
    holds. Bytes the snapshot's files take in the store: ``rows_new_bytes``, the data plane's row
    files this save wrote (an incremental save: its new segments; else every row);
    ``rows_shared_bytes``, the row objects it lists from its parent without writing them;
    ``parts_bytes``, every other file (Gym's parts, the controller's records, part manifests),
    written whole by every save. ``prepares``: the ``prepare_checkpoint`` calls it made (more than
    one when results completed after its flush of acknowledgements: :mod:`coordinator.checkpoint.save`)."""

    checkpoint_id: str
    mode: str
    ok: bool = False
    published: bool = False
    sequence: int | None = None
    snapshot_url: str | None = None
    error: str | None = None
    pause_s: float | None = None
    steps_s: dict[str, float] = {}
    cut_bytes: int = 0
    rows: dict[str, int] = {}
    rows_new_bytes: int = 0
    rows_shared_bytes: int = 0
    parts_bytes: int = 0
    prepares: int = 0


class Continued(msgspec.Struct, frozen=True, kw_only=True):
    """One unfinished rollout after a restore: its new run, and where it picks up."""

    rollout_id: str
    attempt_index: int
    after_call: str | None
    restart_only: list[str] = []
    discarded: bool = False


class RestoreReport(msgspec.Struct, frozen=True, kw_only=True):
    """One restore: the snapshot restored from, the newer ones skipped (with why), each step's time,
    the runs that continue (and which of them start over), the acknowledgements re-sent."""

    restore_id: str
    snapshot_url: str
    sequence: int
    skipped: list[str] = []  # snapshots found unusable, newest first, with why
    steps_s: dict[str, float] = {}
    continued: list[Continued] = []
    acks_resent: int = 0
    rows: dict[str, int] = {}


#: ``published``: the snapshot is the store's newest; ``writing``: Gym is resumed and the background
#: writer has the cut (its own outcome comes later); ``aborted``: nothing was published.
SaveStatus = Literal["published", "writing", "aborted"]


@dataclass(frozen=True)
class SaveOutcome:
    """What a save attempt came to, as far as it has gone.

    ``gym_resumed`` is False when Gym's commit and the cut were taken but the resume failed: the
    snapshot stands, and the controller must resume Gym (checkpoint ``report.checkpoint_id``)
    before it sends any rollout. ``cause`` is the error that aborted the save, with its type."""

    status: SaveStatus
    report: SaveReport
    gym_resumed: bool = True
    cause: BaseException | None = None


@dataclass(frozen=True)
class RestoreOutcome:
    """A completed restore (Gym resumed): the bookkeeping the snapshot holds, with every unfinished
    rollout on its run n + 1 and the acknowledgements re-sent, for the controller to adopt; and the
    report (the snapshot restored from, the runs continued, the discards, each step's time)."""

    books: Bookkeeping
    report: RestoreReport
