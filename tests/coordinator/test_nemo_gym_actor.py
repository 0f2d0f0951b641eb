"""The NemoGym actor's own duties over real HTTP (fake Gym servers on uvicorn; the call orders and
participant rules are GymFleet's, tested in tests/gymkit): NeMo-RL's method names and arguments,
servers given by name or by URL, dispatch frozen from prepare (or restore) to resume (or abort),
failures as GymCallError with Gym's code, and results tagged with their agent's name."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Iterator

import pytest
from fastapi import Request

from coordinator.errors import GymCallError
from coordinator.gym_actor import NemoGym
from schemas.control import (
    FEATURE_COMPLETED_RESULT_ACK,
    FEATURE_CONTINUATION_INDEX,
    FEATURE_STORAGE_REFERENCE_INDEX,
)
from tests.gymkit.fake_gym import AGENTS, MODELS, RESOURCES, FakeGym, refusal, serve, sha

TOKEN = "actor-token"


@pytest.fixture(scope="module")
def gym() -> Iterator[tuple[dict[str, FakeGym], dict[str, str]]]:
    log: list = []
    gyms = {g.name: g for g in [
        FakeGym(MODELS, "policy", instance_role="policy", features=[FEATURE_STORAGE_REFERENCE_INDEX], log=log),
        FakeGym(AGENTS, "agent0", features=[FEATURE_COMPLETED_RESULT_ACK, FEATURE_CONTINUATION_INDEX], log=log),
        FakeGym(RESOURCES, "tools", log=log)]}
    async def rollouts(request: Request) -> dict:
        assert set(await request.json()) == {"rollout_id", "seed", "turns", "tools"}
        return {}

    async def results() -> list[dict]:
        return [{"rollout_id": "r1", "attempt_index": 0, "outcome": "finished"}]

    gyms["agent0"].app.add_api_route("/rollouts", rollouts, methods=["POST"], status_code=202)
    gyms["agent0"].app.add_api_route("/results", results, methods=["GET"])
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve(g.app)) for name, g in gyms.items()}
        yield gyms, urls


def test_the_checkpoint_methods_have_nemo_rls_names_and_arguments() -> None:
    expected = {
        "discover_checkpoint_capabilities": ["server_names"],
        "acknowledge_completed_executions": ["executions"],
        "prepare_checkpoint": ["checkpoint_id", "deadline_ts"],
        "commit_checkpoint": ["checkpoint_id", "deadline_ts", "checkpoint_dir"],
        "restore_checkpoint": ["checkpoint_id", "deadline_ts", "checkpoint_dir", "source_checkpoint_id"],
        "discard_restored_agent_continuations": ["checkpoint_id", "deadline_ts", "executions"],
        "resume_checkpoint": ["checkpoint_id", "deadline_ts"],
        "abort_checkpoint": ["checkpoint_id", "deadline_ts"],
    }
    ours = {"prepare_checkpoint": {"hold_when_unacknowledged": False}}  # keyword-only extensions, off by default
    for method, args in expected.items():
        # Once Ray has made an actor of the class (another test may have), it appends its own tracing
        # keyword ``_ray_trace_ctx`` to every method: not one of NeMo-RL's arguments.
        params = {n: p for n, p in inspect.signature(getattr(NemoGym, method)).parameters.items()
                  if n != "_ray_trace_ctx"}
        positional = [n for n, p in params.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert positional[1:] == args, method
        extra = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert extra == ours.get(method, {}), method  # a NeMo-RL caller's call means the same
    assert inspect.signature(NemoGym.discover_checkpoint_capabilities).parameters["server_names"].default is None
    assert inspect.signature(NemoGym.restore_checkpoint).parameters["source_checkpoint_id"].default is None


def test_a_save_freezes_dispatch_until_the_resume(gym) -> None:
    gyms, urls = gym
    nemo = NemoGym(urls, TOKEN)
    spec = {"rollout_id": "r9", "seed": 1, "turns": 1, "tools": ["notes"]}

    async def scenario() -> None:
        with pytest.raises(GymCallError, match="discover_checkpoint_capabilities"):
            await nemo.prepare_checkpoint("c1", time.time() + 10)
        topology = await nemo.discover_checkpoint_capabilities()
        assert len(topology.fingerprint) == 64 and len(topology.participants) == 3
        assert (await nemo.start_rollouts([spec]))["accepted"] == ["r9"]
        assert [r["agent_name"] for r in await nemo.results()] == ["agent0"]
        await nemo.prepare_checkpoint("c1", time.time() + 10)
        with pytest.raises(GymCallError, match="frozen for checkpoint 'c1'"):
            await nemo.start_rollouts([spec])
        with pytest.raises(GymCallError, match="already active"):
            await nemo.prepare_checkpoint("c2", time.time() + 10)
        commit = await nemo.commit_checkpoint("c1", time.time() + 10, "/d/gym")
        assert [p.name for p in commit.participants] == ["agent0", "policy", "tools"]
        gyms["tools"].queue("resources-checkpoint/resume", refusal("control_error", "flaky"))
        with pytest.raises(GymCallError) as err:
            await nemo.resume_checkpoint("c1", time.time() + 10)
        assert (err.value.status, err.value.error, err.value.name) == (409, "control_error", "tools")
        assert nemo.active_checkpoint_id == "c1"  # still frozen: the resume is retried
        await nemo.resume_checkpoint("c1", time.time() + 10)
        assert nemo.active_checkpoint_id is None
        assert (await nemo.start_rollouts([spec]))["accepted"] == ["r9"]
        await nemo.close()

    asyncio.run(scenario())


def test_a_failed_prepare_or_an_abort_reopens_dispatch_and_a_restore_holds_it(gym) -> None:
    gyms, urls = gym
    nemo = NemoGym(list(urls.values()), TOKEN)  # named by their capabilities

    async def scenario() -> None:
        await nemo.discover_checkpoint_capabilities()
        gyms["tools"].queue("resources-checkpoint/prepare", refusal("resources_checkpoint_error", "locked"))
        with pytest.raises(GymCallError) as err:
            await nemo.prepare_checkpoint("c1", time.time() + 10)
        assert (err.value.error, err.value.component) == ("resources_checkpoint_error", RESOURCES)
        assert nemo.active_checkpoint_id is None

        restored = await nemo.restore_checkpoint("r1", time.time() + 10, "/staging/gym", "ckpt-saved")
        assert [p.name for p in restored.participants] == ["policy", "agent0", "tools"]
        with pytest.raises(GymCallError, match="not the active checkpoint"):
            await nemo.discard_restored_agent_continuations("r0", time.time() + 10, [])
        found = await nemo.discard_restored_agent_continuations(
            "r1", time.time() + 10, [{"rollout_id": "r1", "attempt_index": 1}])
        assert (found.executions, found.discarded) == (1, 1)
        with pytest.raises(GymCallError, match="frozen"):
            await nemo.start_rollouts([{"rollout_id": "x", "seed": 1, "turns": 1, "tools": ["notes"]}])
        gyms["agent0"].queue("agent-checkpoint/resume", refusal("control_error", "boom"))
        aborted = await nemo.abort_checkpoint("r1", time.time() + 10)
        assert len(aborted.failures) == 1 and "boom" in aborted.failures[0]
        assert nemo.active_checkpoint_id is None

        receipt = {"rollout_id": "r1", "attempt_index": 0, "execution_generation": 1, "result_identity": "res",
                   "result_digest": sha("r1")}
        acked = await nemo.acknowledge_completed_executions([{"receipt": receipt, "agent_name": "agent0"}])
        assert [e.receipt.rollout_id for e in acked.acknowledged] == ["r1"]
        assert (await nemo.acknowledge_completed_executions([])).acknowledged == []
        await nemo.close()

    asyncio.run(scenario())


def test_a_server_name_must_be_its_capability_name(gym) -> None:
    _, urls = gym
    nemo = NemoGym({"the-policy": urls["policy"], "agent0": urls["agent0"], "tools": urls["tools"]}, TOKEN)

    async def scenario() -> None:
        with pytest.raises(GymCallError) as err:
            await nemo.discover_checkpoint_capabilities()
        assert err.value.error == "topology" and "'the-policy'" in str(err.value)
        await nemo.close()

    asyncio.run(scenario())
