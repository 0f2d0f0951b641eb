"""The NemoGym actor's calls against the four real reference servers over HTTP (run here without
Ray: the class is plain asyncio; Ray only hosts it). Its control calls are gymkit's client and
GymFleet, whose transport (deadlines, the retry of idempotent calls on a dropped connection) and
rules tests/gymkit covers; here, what a coordinator sees of a real deployment through the actor."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from coordinator.checkpoint.gym_parts import adopt_commit, restore_dir, save_dir
from coordinator.errors import GymCallError
from coordinator.gym_actor import NemoGym
from devtools.gym_fleet import Spec, take_snapshot, wait_until
from schemas.gym_files import MANIFEST_NAME, agent_instance_dir
from snapformat import SnapshotStore, open_snapshot

MODELS, AGENTS, RESOURCES = "responses_api_models", "responses_api_agents", "resources_servers"
DEADLINE_S = 30.0


def _nemo(gym, token: str, **kw) -> NemoGym:
    return NemoGym(gym.urls, token, **kw)


def _phases(gym) -> dict[str, str]:
    return {c.capabilities().name: c.capabilities().phase for c in gym.clients}


def _deadline() -> float:
    return time.time() + DEADLINE_S


@pytest.mark.parametrize("commit_order", ["nemo_rl", "resources_alongside"])
def test_discovery_and_a_whole_checkpoint_in_order(fleet, tmp_path: Path, commit_order: str) -> None:
    """In either commit order, every participant commits its folder and the reply lists them in
    NeMo-RL's order (the resources server's commit, alongside, is adopted like any other)."""
    gym = fleet.gym(model_slow_ms=30)
    nemo = _nemo(gym, fleet.token, commit_order=commit_order)

    async def scenario():
        found = await nemo.discover_checkpoint_capabilities()
        assert found.fingerprint == gym.fingerprint()
        assert [(c["participant"]["component"], c["participant"]["server_name"]) for c in found.participants] == [
            (RESOURCES, "sandbox"), (RESOURCES, "tools"), (AGENTS, "agent0"), (MODELS, "policy0")]
        assert found.restart_only_resources() == ["sandbox"]
        started = await nemo.start_rollouts([{"rollout_id": f"r{i}", "attempt_index": 0, "seed": i, "turns": 3,
                                              "tools": ["notes"]} for i in range(4)])
        assert sorted(started["accepted"]) == ["r0", "r1", "r2", "r3"]
        prepare = await nemo.prepare_checkpoint("c1", _deadline())
        # the policy model, the agent, the exported resources server; never the restart-only one
        assert [(p.component, p.name) for p in prepare.participants] == [
            (MODELS, "policy0"), (AGENTS, "agent0"), (RESOURCES, "tools")]
        assert _phases(gym) == {"policy0": "prepared", "agent0": "prepared", "tools": "prepared", "sandbox": "idle"}
        draft = SnapshotStore(str(tmp_path / "store")).begin()
        cdir = save_dir(draft)
        commit = await nemo.commit_checkpoint("c1", _deadline(), cdir.path)
        assert [(p.component, p.name) for p in commit.participants] == [
            (AGENTS, "agent0"), (MODELS, "policy0"), (RESOURCES, "tools")]
        for ref in commit.manifests():  # each wrote its folder, manifest last, with the digest it answered
            data = (Path(cdir.path) / ref.relative_path).read_bytes()
            assert hashlib.sha256(data).hexdigest() == ref.manifest_digest
        assert commit.manifests()[0].relative_path == f"{agent_instance_dir('agent0')}/{MANIFEST_NAME}"
        parts = adopt_commit(draft, cdir, commit)
        assert [p.part_prefix for p in parts.gym_commit.participants] == [
            f"gym/{agent_instance_dir('agent0')}", "gym/model-ledger/policy0", "gym/resources/tools"]
        assert {r.prefix for r in parts.receipts} == {p.part_prefix for p in parts.gym_commit.participants}
        assert _phases(gym) == {"policy0": "committed_paused", "agent0": "committed_paused",
                                "tools": "committed_paused", "sandbox": "idle"}
        resume = await nemo.resume_checkpoint("c1", _deadline())
        assert [(p.component, p.name) for p in resume.participants] == [
            (RESOURCES, "tools"), (MODELS, "policy0"), (AGENTS, "agent0")]
        assert set(_phases(gym).values()) == {"idle"}
        draft.abandon()
        await nemo.close()

    asyncio.run(scenario())


def test_an_unknown_commit_order_is_refused_when_the_actor_is_made() -> None:
    with pytest.raises(ValueError, match="commit_order is 'racing', expected one of"):
        NemoGym(["http://127.0.0.1:1"], "token", commit_order="racing")  # type: ignore[arg-type]


@pytest.mark.parametrize("restore_order", ["nemo_rl", "concurrent"])
def test_a_snapshot_restores_into_fresh_servers_in_either_restore_order(fleet, tmp_path: Path,
                                                                         restore_order: str) -> None:
    """In either restore order every participant restores the snapshot's Gym checkpoint and stays
    paused until the resume; the reply lists them in NeMo-RL's order; resumed, each parked rollout
    finishes as attempt 1 after its last committed turn."""
    gym = fleet.gym(model_slow_ms=100)
    specs = [Spec(f"r{i}", seed=i, turns=4) for i in range(4)]
    gym.start(specs)
    wait_until(lambda: all(r["turns_done"] >= 1 for r in gym.agent.get("/rollouts")), "a first turn each")
    snap = take_snapshot(gym, SnapshotStore(str(tmp_path / "store")), "ck-1", resume=False)
    for p in gym.servers.all:
        p.kill()
    fresh = fleet.gym()
    opened = open_snapshot(snap.published.url)
    rdir = restore_dir(opened, [p.part_prefix for p in opened.manifest.gym_commit.participants if p.part_prefix])
    nemo = _nemo(fresh, fleet.token, restore_order=restore_order)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        restored = await nemo.restore_checkpoint("rs-1", _deadline(), rdir.path, source_checkpoint_id=snap.checkpoint_id)
        assert [(p.component, p.name) for p in restored.participants] == [
            (MODELS, "policy0"), (AGENTS, "agent0"), (RESOURCES, "tools")]
        replies = {p.component: p.reply for p in restored.participants}
        assert replies[AGENTS].records == len(specs)
        assert {(a.rollout_id, a.attempt_index) for a in replies[MODELS].source_attempts} == {
            (s.rollout_id, 0) for s in specs}
        assert replies[RESOURCES].sessions == len(specs)
        assert _phases(fresh)["sandbox"] == "idle" and "idle" not in {
            _phases(fresh)[n] for n in ("policy0", "agent0", "tools")}  # restored, paused until the resume
        await nemo.resume_checkpoint("rs-1", _deadline())
        await nemo.close()

    asyncio.run(scenario())
    fresh.rerun(specs, {s.rollout_id: 1 for s in specs})
    results = fresh.wait_results([s.rollout_id for s in specs])
    assert {rid: (r["attempt_index"], len(r["trajectory"])) for rid, r in results.items()} == {
        s.rollout_id: (1, s.turns) for s in specs}


def test_an_unknown_restore_order_is_refused_when_the_actor_is_made() -> None:
    with pytest.raises(ValueError, match="restore_order is 'racing', expected one of"):
        NemoGym(["http://127.0.0.1:1"], "token", restore_order="racing")  # type: ignore[arg-type]


def test_acknowledgements_send_the_receipts_back_and_a_repeat_is_idempotent(fleet) -> None:
    """Gym's acknowledgements are the completion receipts the agent issued, sent back unchanged
    (CONTROL.md §7). Under the old protocol a repeat was reported ``unknown``; Gym acknowledges a
    repeat again (idempotent), so one repeat in a batch holds up nothing. A receipt that does not
    match is refused, typed."""
    gym = fleet.gym()
    nemo = _nemo(gym, fleet.token)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        await nemo.start_rollouts([{"rollout_id": "a", "attempt_index": 0, "seed": 1, "turns": 1, "tools": ["notes"]},
                                   {"rollout_id": "b", "attempt_index": 0, "seed": 2, "turns": 1, "tools": ["notes"]}])
        await asyncio.to_thread(wait_until, lambda: len(gym.results()) == 2, "two results")
        results = {r["rollout_id"]: r for r in await nemo.results()}
        assert {r["agent_name"] for r in results.values()} == {"agent0"}
        owed = {rid: {"receipt": r["completion_receipt"], "agent_name": r["agent_name"]} for rid, r in results.items()}
        forged = dict(owed["b"]["receipt"], result_digest="0" * 64)
        with pytest.raises(GymCallError) as err:
            await nemo.acknowledge_completed_executions([{"receipt": forged, "agent_name": "agent0"}])
        assert (err.value.status, err.value.error) == (409, "completed_execution_acknowledgement_error")
        first = await nemo.acknowledge_completed_executions([owed["a"]])
        assert [msgspec.to_builtins(e.receipt) for e in first.acknowledged] == [owed["a"]["receipt"]]
        again = await nemo.acknowledge_completed_executions([owed["a"], owed["b"]])
        assert sorted(e.receipt.rollout_id for e in again.acknowledged) == ["a", "b"]
        assert gym.results() == {}  # the agent holds neither any more
        await nemo.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("hold", [True, False])
def test_a_prepare_blocked_by_an_unacknowledged_result_holds_gym_paused_only_when_asked(fleet, hold: bool) -> None:
    """A result completed and not yet acknowledged: the agent refuses prepare at once. Asked to hold,
    the actor resumes no one: the model stays paused, the agent admits no new rollout, dispatch stays
    frozen; once the result is acknowledged the same id prepares, commits nothing new and resumes.
    Not asked (NeMo-RL's way), everyone called is resumed and dispatch reopens."""
    gym = fleet.gym()
    nemo = _nemo(gym, fleet.token)
    spec = {"attempt_index": 0, "seed": 1, "turns": 1, "tools": ["notes"]}

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        await nemo.start_rollouts([{"rollout_id": "done", **spec}])
        await asyncio.to_thread(wait_until, lambda: len(gym.results()) == 1, "a result")
        with pytest.raises(GymCallError) as err:
            await nemo.prepare_checkpoint("c1", _deadline(), hold_when_unacknowledged=hold)
        assert (err.value.status, err.value.error, err.value.held) == (409, "agent_prepare_incomplete", hold)
        assert "1 completed result(s) not yet acknowledged" in str(err.value)
        if not hold:
            assert set(_phases(gym).values()) == {"idle"} and nemo.active_checkpoint_id is None
            await nemo.close()
            return
        assert _phases(gym)["policy0"] == "prepared" and _phases(gym)["tools"] == "idle"  # paused; never reached
        assert nemo.active_checkpoint_id == "c1"
        with pytest.raises(GymCallError, match="frozen"):
            await nemo.start_rollouts([{"rollout_id": "new", **spec}])
        direct = await asyncio.to_thread(httpx.post, f"{gym.agent.url}/rollouts", json={"rollout_id": "new", **spec},
                                         timeout=10)
        assert direct.status_code == 409 and direct.json()["error"]["code"] == "agent_admission_closed"
        (result,) = await nemo.results()
        await nemo.acknowledge_completed_executions([{"receipt": result["completion_receipt"],
                                                      "agent_name": result["agent_name"]}])
        prepared = await nemo.prepare_checkpoint("c1", _deadline(), hold_when_unacknowledged=True)
        assert [(p.component, p.name) for p in prepared.participants] == [
            (MODELS, "policy0"), (AGENTS, "agent0"), (RESOURCES, "tools")]
        assert _phases(gym) == {"policy0": "prepared", "agent0": "prepared", "tools": "prepared", "sandbox": "idle"}
        await nemo.resume_checkpoint("c1", _deadline())
        assert set(_phases(gym).values()) == {"idle"} and nemo.active_checkpoint_id is None
        await nemo.close()

    asyncio.run(scenario())


def test_refusals_are_typed_and_name_the_server(fleet) -> None:
    gym = fleet.gym()

    async def scenario():
        wrong = NemoGym(gym.urls, "not-the-token")
        await wrong.discover_checkpoint_capabilities()  # capabilities are unauthenticated
        with pytest.raises(GymCallError, match=r"401") as err:
            await wrong.prepare_checkpoint("c0", _deadline())
        assert err.value.status == 401 and "not-the-token" not in str(err.value)  # the token is never in an error
        assert set(_phases(gym).values()) == {"idle"}  # nothing was paused by a refused caller
        nemo = _nemo(gym, fleet.token)
        await nemo.discover_checkpoint_capabilities()
        with pytest.raises(GymCallError) as err:  # the model's resume is not allowed from idle
            await nemo.resume_checkpoint("never-prepared", _deadline())
        assert (err.value.status, err.value.error) == (409, "invalid_phase")
        assert "model-admission/resume of responses_api_models policy0" in str(err.value)
        aborted = await nemo.abort_checkpoint("never-prepared", _deadline())
        assert aborted.failures == []  # invalid_phase / stale_checkpoint: never began or already ended
        assert set(_phases(gym).values()) == {"idle"}
        for c in (wrong, nemo):
            await c.close()

    asyncio.run(scenario())


def test_a_dead_server_fails_fast_and_is_named(fleet) -> None:
    gym = fleet.gym()
    nemo = _nemo(gym, fleet.token)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        gym.servers.resource.kill()
        t0 = time.monotonic()
        with pytest.raises(GymCallError, match=r"resources-checkpoint/prepare of resources_servers tools .*unreachable") \
                as err:
            await nemo.prepare_checkpoint("c2", _deadline())
        assert err.value.error == "unreachable" and time.monotonic() - t0 < DEADLINE_S / 2
        assert nemo.active_checkpoint_id is None  # dispatch reopened
        aborted = await nemo.abort_checkpoint("c2", _deadline())
        assert len(aborted.failures) == 1 and "resources_servers tools" in aborted.failures[0]
        # the others were resumed by the failed prepare itself
        assert {c.capabilities().phase for c in (gym.model, gym.agent, gym.sandbox)} == {"idle"}
        await nemo.close()

    asyncio.run(scenario())


def test_rollouts_go_to_a_stable_agent(fleet) -> None:
    gym = fleet.gym()
    s = gym.servers
    extra = fleet.server("agent", "agent1", model_url=s.model.url, resource_url=s.resource.url,
                         sandbox_url=s.sandbox.url)
    nemo = NemoGym({**gym.urls, "agent1": extra.url}, fleet.token)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        homes = {f"r{i}": nemo.agent_of(f"r{i}").name for i in range(40)}
        assert set(homes.values()) == {"agent0", "agent1"}
        other = NemoGym(list(reversed([*gym.urls.values(), extra.url])), fleet.token)  # named by capabilities
        await other.discover_checkpoint_capabilities()
        assert {r: other.agent_of(r).name for r in homes} == homes  # not the order of the urls
        for c in (nemo, other):
            await c.close()
        async with httpx.AsyncClient() as h:
            assert (await h.get(f"{extra.url}/healthz")).status_code == 200

    asyncio.run(scenario())
