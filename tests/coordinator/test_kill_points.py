"""Crash safety of save and restore, proven by SIGKILL at every step boundary.

Each case kills the job (the Single Controller's process and every Gym server) when the controller
reaches one named boundary, then starts a fresh job on the same store, as an operator would. The
restarted run must restore from the newest published snapshot and end with exactly the rows of an
uninterrupted run: no rollout lost, none trained twice. The data plane here is the in-memory one,
so it dies with the controller (a fresh data plane at each restart); the TransferQueue path is
covered by test_job.py and the demo.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import ray
from harness import CONFIG, WORKLOAD, InRayJob

from coordinator.errors import GymCallError
from coordinator.faults import RESTORE_STEPS, SAVE_STEPS
from devtools.accounting import content, trained_once
from snapformat import SnapshotStore, verify_snapshot

pytestmark = pytest.mark.usefixtures("tq_runtime")
IDS = [s.rollout_id for i in range(WORKLOAD.prompts) for s in WORKLOAD.group(i)]
FAST_SAVES = CONFIG.with_rollout_checkpointing(snapshot_attempt_interval_s=0.05)


def finish_and_check(fleet, store: SnapshotStore, reference_rows, newest_before: int | None) -> None:
    """A fresh job restores from the newest snapshot (the one before the crash, or a newer one the
    crash did not stop from being published) and must end exactly like the uninterrupted run."""
    job = InRayJob(fleet, store.url)
    restored = job.setup()
    newest = store.list()[0].sequence if store.list() else None
    if newest is None:
        assert restored is None
    else:
        assert restored is not None and restored.sequence == newest and not restored.skipped
        assert newest_before is None or newest >= newest_before
    outcome = job.run()
    assert outcome.done
    assert content(job.call("data_plane_tables")) == reference_rows
    assert trained_once(msgspec.to_builtins(job.call("records")), IDS) == []
    for c in store.list():
        assert verify_snapshot(store.open(c.sequence)).ok
    job.kill()


def _newest(store: SnapshotStore) -> int | None:
    commits = store.list()
    return commits[0].sequence if commits else None


@pytest.mark.parametrize("step", SAVE_STEPS)
def test_crash_of_the_whole_job_during_a_save(step: str, fleet, tmp_path: Path, reference_rows) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, config=FAST_SAVES, crash_at=step, occurrence=2)
    job.setup()
    with pytest.raises(ray.exceptions.RayActorError):
        job.run()
    job.kill()
    before = _newest(store)
    assert before is not None  # the first save published
    # Nothing partial is ever listed: every listed snapshot verifies.
    for c in store.list():
        assert verify_snapshot(store.open(c.sequence)).ok
    finish_and_check(fleet, store, reference_rows, before)


@pytest.mark.parametrize(("step", "published"), [("save.prepared", False), ("save.gym_committed", True)])
def test_gym_servers_killed_during_a_save(step: str, published: bool, fleet, tmp_path: Path, reference_rows) -> None:
    """Only Gym dies. Before Gym's commit the save aborts (nothing published); after it the snapshot
    is complete without Gym and is published, only the resume fails. Gym then stays unreachable and
    the controller stops with a clear error after ``gym_unreachable_s``; the restarted job restores."""
    store = SnapshotStore(str(tmp_path / "store"))
    job = InRayJob(fleet, store.url, config=FAST_SAVES, crash_at=step, occurrence=2, kill_self=False)
    job.setup()
    with pytest.raises(GymCallError, match="Gym has failed every call for"):
        job.run()
    saves = job.call("saves_since", 0)
    assert saves[-1].published == published
    assert published or "unreachable" in saves[-1].error
    job.kill()
    finish_and_check(fleet, store, reference_rows, _newest(store))


@pytest.fixture(scope="module")
def crashed_store(tmp_path_factory: pytest.TempPathFactory, forkserver, tq_runtime) -> Path:
    """A store left by a job killed mid-run after two snapshots (each restore case restores a copy)."""
    from devtools.gym_fleet import new_fleet

    path = tmp_path_factory.mktemp("crashed") / "store"
    f = new_fleet(path.parent / "fleet", forkserver)
    try:
        first = InRayJob(f, str(path), config=FAST_SAVES, crash_at="save.begin", occurrence=3)
        first.setup()
        with pytest.raises(ray.exceptions.RayActorError):
            first.run()
        first.kill()
    finally:
        f.close()
    return path


@pytest.mark.parametrize("step", RESTORE_STEPS)
def test_crash_during_a_restore(step: str, fleet, tmp_path: Path, reference_rows, crashed_store: Path) -> None:
    shutil.copytree(crashed_store, tmp_path / "store")
    store = SnapshotStore(str(tmp_path / "store"))
    before = _newest(store)
    assert before is not None and before >= 2
    second = InRayJob(fleet, store.url, crash_at=step)
    with pytest.raises(ray.exceptions.RayActorError):
        second.setup()
        second.run()  # restore.resumed is reached in setup; a later step would be in the run
    second.kill()
    assert _newest(store) == before  # a restore publishes nothing
    finish_and_check(fleet, store, reference_rows, before)
