"""A short chaos soak (``make soak`` runs the long one): the whole job as real processes (Ray,
TransferQueue, Gym servers, the actors), SIGKILLed in one place per cycle at a random moment
(during the restore or the run, so often mid-save), restarted as an operator would, then run to the
end and checked independently: the final rows equal an uninterrupted run's, every rollout was
trained exactly once, no acknowledgement is owed, every published snapshot verifies."""

from __future__ import annotations

from pathlib import Path

import msgspec
from harness import CONFIG, WORKLOAD

from devtools.soak import run_soak
from snapformat import SnapshotStore

SLOW_MS = 400  # rollouts last a few seconds: kills land mid-run


def test_a_short_soak_loses_nothing(tmp_path: Path, reference_rows) -> None:
    store = str(tmp_path / "store")
    # TransferQueue's storage unit, the one place whose death used to hang a job: it must now fail
    # on its own (a TransferQueue call gives up after data_plane_timeout_s) and restart cleanly.
    config = msgspec.structs.replace(CONFIG.with_rollout_checkpointing(snapshot_attempt_interval_s=0.3),
                                     gym_unreachable_s=3.0, data_plane_timeout_s=5.0)
    code, soak = run_soak(store, tmp_path, minutes=5, max_cycles=1, seed=3, workload=WORKLOAD, config=config,
                          model_slow_ms=SLOW_MS, expected=reference_rows, places=("tq_storage",))
    assert soak.lost == [] and code == 0
    assert soak.cycles == 1 and soak.kills["tq_storage"] == 1
    assert soak.exits == ["failed by itself"], soak.exits
    assert SnapshotStore(store).list()  # the run saved; the final job restored from it or from an earlier one
