"""The NemoGym actor's calls against real reference servers over HTTP (run here without Ray: the
class is plain asyncio; Ray only hosts it). Its control calls are gymkit's client, whose transport
(deadlines, the retry of idempotent calls on a dropped connection) tests/gymkit covers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from coordinator.errors import GymCallError
from coordinator.gym_actor import NemoGym
from devtools.gym_fleet import wait_until
from snapformat import SnapshotStore


def _nemo(gym, token: str) -> NemoGym:
    return NemoGym([p.url for p in gym.trio.all], token)


def test_discovery_and_a_whole_checkpoint_in_order(fleet, tmp_path) -> None:
    gym = fleet.gym(model_slow_ms=30)
    nemo = _nemo(gym, fleet.token)

    async def scenario():
        found = await nemo.discover_checkpoint_capabilities()
        assert found["fingerprint"] == gym.fingerprint()
        assert sorted(p["component"] for p in found["participants"]) == ["agent", "model", "resource"]
        started = await nemo.start_rollouts([{"rollout_id": f"r{i}", "seed": i, "turns": 3, "tools": ["notes"]}
                                            for i in range(4)])
        assert sorted(started["accepted"]) == ["r0", "r1", "r2", "r3"]
        prepare = await nemo.prepare_checkpoint("c1", time.time() + 30)
        assert list(prepare) == ["model", "agent", "resource"]
        assert {c.status().phase for c in gym.clients} == {"prepared"}
        draft = SnapshotStore(str(tmp_path / "store")).begin()
        commit = await nemo.commit_checkpoint("c1", time.time() + 30, draft.url)
        assert list(commit.seconds) == ["agent", "model", "resource"]
        assert [p.component for p in commit.gym_commit.participants] == ["agent", "model", "resource"]
        assert {r.prefix for r in commit.receipts} == {"gym/agent/agent0", "gym/model/policy0", "gym/resource/tools"}
        resume = await nemo.resume_checkpoint("c1")
        assert list(resume) == ["resource", "model", "agent"]
        assert {c.status().phase for c in gym.clients} == {"idle"}
        await nemo.close()

    asyncio.run(scenario())


def test_acknowledge_twice_reports_the_repeat_as_already_acknowledged(fleet) -> None:
    gym = fleet.gym()
    nemo = _nemo(gym, fleet.token)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        await nemo.start_rollouts([{"rollout_id": "a", "seed": 1, "turns": 1, "tools": ["notes"]},
                                   {"rollout_id": "b", "seed": 2, "turns": 1, "tools": ["notes"]}])
        await asyncio.to_thread(wait_until, lambda: len(gym.results()) == 2, "two results")
        first = await nemo.acknowledge([("a", 0)])
        assert first == {"acknowledged": ["a"], "unknown": []}
        again = await nemo.acknowledge([("a", 0), ("b", 0)])  # one repeat must not hold up the other
        assert again == {"acknowledged": ["b"], "unknown": ["a"]}
        assert gym.results() == {}
        await nemo.close()

    asyncio.run(scenario())


def test_refusals_are_typed_and_name_the_server(fleet) -> None:
    gym = fleet.gym()

    async def scenario():
        wrong = NemoGym([p.url for p in gym.trio.all], "not-the-token")
        with pytest.raises(GymCallError, match=r"401") as err:
            await wrong.discover_checkpoint_capabilities()
        assert "not-the-token" not in str(err.value)  # the token is never in an error
        nemo = _nemo(gym, fleet.token)
        await nemo.discover_checkpoint_capabilities()
        with pytest.raises(GymCallError) as err:
            await nemo.resume_checkpoint("never-prepared")
        assert err.value.status == 409 and "resume of resource tools" in str(err.value)
        assert await nemo.abort_checkpoint("never-prepared") == []  # 409 wrong_phase is fine for abort
        for c in (wrong, nemo):
            await c.close()

    asyncio.run(scenario())


def test_a_dead_server_fails_fast_and_is_named(fleet) -> None:
    gym = fleet.gym()
    nemo = _nemo(gym, fleet.token)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        gym.trio.resource.kill()
        with pytest.raises(GymCallError, match=r"prepare of resource tools .*unreachable") as err:
            await nemo.prepare_checkpoint("c2", time.time() + 30)
        assert err.value.error == "unreachable"
        failures = await nemo.abort_checkpoint("c2")
        assert len(failures) == 1 and "resource tools" in failures[0]
        assert {c.status().phase for c in (gym.model, gym.agent)} == {"idle"}  # the others resumed
        await nemo.close()

    asyncio.run(scenario())


def test_rollouts_go_to_a_stable_agent(fleet) -> None:
    gym = fleet.gym()
    extra = fleet.server("agent", "agent1", model_url=gym.trio.model.url, resource_url=gym.trio.resource.url)
    nemo = NemoGym([p.url for p in gym.trio.all] + [extra.url], fleet.token)

    async def scenario():
        await nemo.discover_checkpoint_capabilities()
        homes = {f"r{i}": nemo.agent_of(f"r{i}").caps.name for i in range(40)}
        assert set(homes.values()) == {"agent0", "agent1"}
        other = NemoGym(list(reversed([p.url for p in gym.trio.all] + [extra.url])), fleet.token)
        await other.discover_checkpoint_capabilities()
        assert {r: other.agent_of(r).caps.name for r in homes} == homes  # not the order of the urls
        for c in (nemo, other):
            await c.close()
        async with httpx.AsyncClient() as h:
            assert (await h.get(f"{extra.url}/healthz")).status_code == 200

    asyncio.run(scenario())
