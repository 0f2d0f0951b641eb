"""The test harness's save (``devtools.gym_fleet.take_snapshot``) on real reference servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.gym_fleet import Spec, new_fleet, take_snapshot
from snapformat import SnapshotStore, open_snapshot


def test_a_result_completed_after_the_acknowledgement_is_acknowledged_and_a_fresh_id_prepares(
        tmp_path: Path, forkserver, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the controller's save does: the agent refuses to prepare while a completed result is not
    # acknowledged (agent_prepare_incomplete, nothing running), which only the caller can clear. Under load
    # a rollout completed between the harness's acknowledgement and its prepare, and the save failed.
    fleet = new_fleet(tmp_path / "fleet", forkserver)
    try:
        gym = fleet.gym()
        specs = [Spec(f"r{i}", seed=i, turns=2) for i in range(2)]
        gym.start(specs)
        done = gym.wait_results([s.rollout_id for s in specs])
        real = gym.acknowledge
        calls: list[int] = []

        def late(results):  # the first acknowledgement misses them, as if they completed just after it
            calls.append(len(list(results)))
            return [] if len(calls) == 1 else real(done.values())

        monkeypatch.setattr(gym, "acknowledge", late)
        snap = take_snapshot(gym, SnapshotStore(str(tmp_path / "store")), "ck-1")
        assert calls == [2, 2] and snap.checkpoint_id == "ck-1-2"
        assert sorted(snap.collected) == ["r0", "r1"] and gym.results() == {}
        assert open_snapshot(snap.published.url).manifest.gym_commit.checkpoint_id == "ck-1-2"
    finally:
        fleet.close()
