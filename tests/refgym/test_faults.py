"""Faults during a checkpoint, over real HTTP: an agent prepare that misses its deadline, and a model
server killed while it commits. In both the checkpoint is given up (NeMo-RL's abort: the resume
calls), nothing is published, no rollout is lost, and every result still equals an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from coordinator.checkpoint.gym_parts import save_dir
from devtools.gym_fleet import Fleet, Spec, refused, wait_until
from gymkit import ControlCallError, GymFleet
from snapformat import SnapshotStore

SLOW = [Spec(f"slow{i}", seed=200 + i, turns=1) for i in range(3)]
KILLED = [Spec(f"k{i}", seed=300 + i, turns=4) for i in range(4)]


def test_prepare_that_misses_its_deadline_fails_cleanly_and_abort_loses_no_rollout(fleet: Fleet, reference) -> None:
    expected = reference(SLOW)
    gym = fleet.gym(resource_slow_ms=800)  # every resources call takes 0.8 s: a turn cannot end sooner
    gym.start(SLOW)
    wait_until(lambda: len(gym.ledger()) == len(SLOW), "the rollouts' model calls")  # then each calls its tool

    ck = "ckpt-late"
    gym.model.model.pause(ck, time.time() + 30)
    late = refused(gym.agent.agent.prepare, ck, time.time() + 0.3)  # a tool call is in flight for longer
    assert (late.status, late.code) == (409, "agent_prepare_incomplete")
    status = gym.agent.agent.status(ck)
    assert (status.state, status.ready_to_commit) == ("preparing", False) and status.running >= 1
    assert {e.state for e in status.blocking_attempts} == {"running"}
    assert gym.agent.capabilities().phase == "idle"  # the fence is back; admission stays closed

    # Give it up: the resume calls of every participant (resources, models, agents), twice.
    async def abort(fleet_: GymFleet) -> list[list[str]]:
        deadline = time.time() + 30
        return [(await fleet_.abort(ck, deadline)).failures for _ in range(2)]

    first, again = gym.fleet(abort)
    assert first == [] and again == []  # the second finds every id retired or never begun: not failures
    for c in gym.clients:
        caps = c.capabilities()
        assert (caps.phase, caps.active_checkpoint_id) == ("idle", None)
    assert refused(gym.agent.agent.prepare, ck, time.time() + 5).code == "stale_checkpoint"  # it is over

    results = gym.wait_results([s.rollout_id for s in SLOW])
    for s in SLOW:
        assert results[s.rollout_id]["outcome"] == "finished"
        assert results[s.rollout_id]["trajectory"] == expected[s.rollout_id]["trajectory"]


def test_server_killed_during_commit_publishes_nothing_and_the_others_resume(
        fleet: Fleet, reference, tmp_path: Path) -> None:
    expected = reference(KILLED)
    gym = fleet.gym(model_slow_ms=100, commit_delay_ms=60_000)  # the model's commit stalls before writing
    gym.start(KILLED)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts")), "every rollout's first turn")

    ck, deadline = "ckpt-doomed", time.time() + 60
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    checkpoint_dir = save_dir(draft).path  # the draft's gym/ folder

    async def doomed(fleet_: GymFleet) -> list[str]:
        """NeMo-RL's save until the model dies in its commit, then its abort (the resume calls)."""
        await fleet_.prepare(ck, deadline)
        commit = asyncio.ensure_future(fleet_.commit(ck, deadline, checkpoint_dir))  # agents, then the model
        await asyncio.to_thread(wait_until, lambda: gym.model.capabilities().phase == "committing",
                                "the model's commit to start")
        gym.servers.model.kill()
        with pytest.raises(ControlCallError) as died:
            await commit
        assert (died.value.code, died.value.name, died.value.step) == ("unreachable", "policy0",
                                                                        "model-checkpoint/commit")
        return (await fleet_.abort(ck, time.time() + 5)).failures

    failures = gym.fleet(doomed)
    # The agent committed its files; the model wrote nothing (no manifest: its commit did not finish),
    # so nothing can be published, and the draft is garbage.
    gym_dir = Path(checkpoint_dir)
    assert [p.parent.parent.name for p in gym_dir.rglob("manifest.json")] == ["agent"]
    assert not (gym_dir / "model-ledger" / "policy0" / "manifest.json").exists()
    assert store.list() == [] and store.latest() is None
    assert draft.snapshot_id in store.gc(min_age_s=0).swept_drafts
    # The others were given back (resume order); the dead model is the one failure.
    assert len(failures) == 1 and "policy0" in failures[0] and "unreachable" in failures[0]
    for c in (gym.agent, gym.resource):
        assert c.capabilities().phase == "idle"
    # A fresh model server on the same port (same seed, empty ledger): the rollouts carry on.
    fleet.server("model", "policy0", port=gym.servers.model.port)
    results = gym.wait_results([s.rollout_id for s in KILLED])
    for s in KILLED:
        assert results[s.rollout_id]["outcome"] == "finished", results[s.rollout_id]
        assert results[s.rollout_id]["trajectory"] == expected[s.rollout_id]["trajectory"]


def test_the_fault_knobs_of_a_resources_server(fleet: Fleet, tmp_path: Path) -> None:
    """``--test-faults``: the next commit fails with 500 ``control_error`` (writing nothing, the phase
    left ``prepared``), then commits work again; a server without the flag has no such route."""
    tools = fleet.client(fleet.server("resource", "tools", test_faults=True).url)
    plain = fleet.client(fleet.server("resource", "other").url)
    assert plain.post("/test/faults", {"commit_errors": 1}).status_code == 404
    assert tools.post("/test/faults", {"commit_errors": 1}).status_code == 200
    deadline, folder = time.time() + 30, str(tmp_path / "gym")
    tools.resources.prepare("ck-fault", deadline)
    failed = refused(tools.resources.commit, "ck-fault", deadline, folder)
    assert (failed.status, failed.code) == (500, "control_error") and not (tmp_path / "gym").exists()
    assert tools.capabilities().phase == "prepared"
    assert tools.resources.commit("ck-fault", deadline, folder).sessions == 0
    assert tools.resources.resume("ck-fault", deadline).state == "accepting"
