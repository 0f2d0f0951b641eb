"""Faults during a checkpoint, over real HTTP: a drain that misses its deadline, and a server killed
while it commits. In both, no rollout is lost and every trajectory still equals an uninterrupted run.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devtools.gym_fleet import Fleet, Spec, refused, wait_until
from gymkit import ControlCallError
from snapformat import SnapshotStore

SLOW = [Spec(f"slow{i}", seed=200 + i, turns=2) for i in range(3)]
KILLED = [Spec(f"k{i}", seed=300 + i, turns=4) for i in range(4)]


def test_prepare_that_misses_its_deadline_fails_cleanly_and_abort_loses_no_rollout(fleet: Fleet, reference) -> None:
    expected = reference(SLOW)
    gym = fleet.gym(resource_slow_ms=2500)  # every tool call takes 2.5 s: a turn cannot end sooner
    gym.start(SLOW)
    wait_until(lambda: gym.resource.status().in_flight > 0, "a tool call in flight")

    ck = "ckpt-late"
    assert gym.model.prepare(ck, time.time() + 30).phase == "prepared"  # no model call is slow
    late = refused(gym.agent.prepare, ck, time.time() + 0.5)  # a tool call is in flight for longer than that
    assert late.code == (409, "deadline_passed")
    assert "turn boundary" in late.reason
    status = gym.agent.status()
    assert (status.phase, status.admission) == ("preparing", "draining")

    # Abort (the resume route) every server the checkpoint touched; the resource server never was.
    first = [gym.agent.abort(ck), gym.model.abort(ck)]
    assert [gym.agent.abort(ck), gym.model.abort(ck)] == first  # repeating it is a no-op
    for c in gym.clients:
        status = c.status()
        assert (status.phase, status.admission, status.checkpoint_id) == ("idle", "accepting", None)
    again = refused(gym.agent.prepare, ck, time.time() + 5)
    assert again.code == (409, "stale_checkpoint")  # that checkpoint is over

    results = gym.wait_results([s.rollout_id for s in SLOW])
    for s in SLOW:
        assert results[s.rollout_id]["outcome"] == "finished"
        assert results[s.rollout_id]["trajectory"] == expected[s.rollout_id]["trajectory"]


def test_server_killed_during_commit_publishes_nothing_and_the_others_resume(
        fleet: Fleet, reference, tmp_path: Path) -> None:
    expected = reference(KILLED)
    gym = fleet.gym(model_slow_ms=100, commit_delay_ms=60_000)  # the model's commit stalls after its first file
    gym.start(KILLED)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts")), "every rollout's first turn")

    ck, deadline = "ckpt-doomed", time.time() + 60
    for c in gym.clients:
        c.prepare(ck, deadline)
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    agent = gym.agent.commit(ck, deadline, draft.url)
    model_part = tmp_path / "store" / "snapshots" / draft.snapshot_id / "gym" / "model" / "policy0"
    with ThreadPoolExecutor(1) as pool:
        commit = pool.submit(gym.model.commit, ck, deadline, draft.url, [agent.part])
        wait_until(lambda: (model_part / "tokens.arrow").exists(), "the model's commit to start writing")
        gym.trio.model.kill()
        with pytest.raises(ControlCallError) as died:
            commit.result(timeout=30)
        assert died.value.error == "unreachable"

    # The model's part was never closed, so no receipt exists and nothing can be published.
    assert not (model_part / "part-manifest.json").exists()
    assert store.list() == [] and store.latest() is None
    assert draft.snapshot_id in store.gc(min_age_s=0).swept_drafts  # the half-written draft is garbage

    # The others are aborted back to accepting, in resume order.
    for c in (gym.resource, gym.agent):
        assert c.abort(ck).admission == "accepting"
    # A fresh model server on the same port (same seed, empty ledger): the rollouts carry on.
    fleet.server("model", "policy0", port=gym.trio.model.port)
    results = gym.wait_results([s.rollout_id for s in KILLED])
    for s in KILLED:
        assert results[s.rollout_id]["outcome"] == "finished", results[s.rollout_id]
        assert results[s.rollout_id]["trajectory"] == expected[s.rollout_id]["trajectory"]
