"""GymFleet: NeMo-RL's call orders, retries and participant rules (CONTROL.md §5, §8), against fake
Gym servers in process (one host name each, one shared log of what they were sent), and the
topology fingerprint recomputed here from the reference's recipe."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import pickle
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest

from gymkit.control_client import ControlCallError
from gymkit.gym_fleet import CompletedExecution, GymFleet, UnacknowledgedResults, participant_dir
from schemas.control import (
    FEATURE_COMPLETED_RESULT_ACK,
    FEATURE_CONTINUATION_INDEX,
    FEATURE_DISCARD_RESTORED,
    FEATURE_RESOURCE_DEPENDENCY_INDEX,
    FEATURE_STORAGE_REFERENCE_INDEX,
    AgentStatus,
    CompletionReceipt,
    ModelCommitResponse,
    ModelStatusResponse,
    ResourcesCommitResponse,
)
from tests.gymkit.fake_gym import AGENTS, MODELS, RESOURCES, WORKERS, FakeGym, Seen, refusal, sha

TOKEN = "fleet-token"
AGENT_FEATURES = [FEATURE_COMPLETED_RESULT_ACK, FEATURE_CONTINUATION_INDEX]


def servers(log: list[Seen] | None = None) -> dict[str, FakeGym]:
    """A policy model, an auxiliary judge, two checkpointing agents and one that is not, a
    checkpointing resources server and a stateless one."""
    log = [] if log is None else log
    return {s.name: s for s in [
        FakeGym(MODELS, "policy", instance_role="policy", features=[FEATURE_STORAGE_REFERENCE_INDEX], log=log),
        FakeGym(MODELS, "judge", instance_role="auxiliary", checkpoint_mode="stateless", log=log),
        FakeGym(AGENTS, "agent1", features=AGENT_FEATURES, concurrency_contract="serialized_per_session", log=log),
        FakeGym(AGENTS, "agent0", features=AGENT_FEATURES, concurrency_contract="serialized_per_session", log=log),
        FakeGym(AGENTS, "bystander", checkpoint_mode="restart_only", log=log),
        FakeGym(RESOURCES, "tools", log=log),
        FakeGym(RESOURCES, "web", checkpoint_mode="stateless", log=log),
    ]}


class Hosts(httpx.AsyncBaseTransport):
    """Each host name is one in-process app."""

    def __init__(self, gyms: dict[str, FakeGym]) -> None:
        self.apps = {name: httpx.ASGITransport(app=g.app) for name, g in gyms.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[request.url.host].handle_async_request(request)


def run(gyms: dict[str, FakeGym], scenario: Callable[[GymFleet], Awaitable[Any]], *, discover: bool = True,
        urls: Any = None, **fleet_kw: Any) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(transport=Hosts(gyms)) as http:
            fleet = GymFleet.connect(urls if urls is not None else {n: f"http://{n}" for n in gyms}, TOKEN, http,
                                     **fleet_kw)
            if discover:
                await fleet.discover()
            return await scenario(fleet)

    return asyncio.run(main())


def calls(log: list[Seen], since: int = 0) -> list[tuple[str, str]]:
    """(server, route) of every call after the first ``since``, capabilities left out."""
    return [(s.server, s.route) for s in log[since:] if s.route != "capabilities"]


def test_prepare_commit_and_resume_in_nemo_rls_orders() -> None:
    gyms = servers()
    log = gyms["policy"].log
    gyms["policy"].queue("model-admission/pause", (200, {"state": "draining", "workers": WORKERS,
                                                         "inflight_total": 2, "waiters_total": 0}))
    gyms["agent0"].queue("agent-checkpoint/prepare", refusal("agent_prepare_incomplete"),
                         refusal("agent_prepare_incomplete"))
    deadline = time.time() + 30

    async def scenario(fleet: GymFleet) -> None:
        prep = await fleet.prepare("c1", deadline)
        # Between re-sends the fleet reads the agent's status (is anything still running?); the
        # routes that change something come in NeMo-RL's order.
        got = [c for c in calls(log) if c[1] != "agent-checkpoint/status"]
        assert got[0] == ("policy", "model-admission/pause")
        assert sorted(got[1:5]) == [("agent0", "agent-checkpoint/prepare")] * 3 + [
            ("agent1", "agent-checkpoint/prepare")]
        assert got[5:] == [("tools", "resources-checkpoint/prepare"), ("policy", "model-admission/status")]
        assert prep.agent_prepare_attempts == {"agent0": 3, "agent1": 1}
        sent = [s.at for s in gyms["agent0"].calls("agent-checkpoint/prepare")]
        assert all(0.05 <= b - a < 0.5 for a, b in itertools.pairwise(sent))  # re-sent about every 0.1 s
        (status,) = gyms["policy"].calls("model-admission/status")
        q = status.query
        assert (q["checkpoint_id"], float(q["deadline_ts"]), q["wait_state"]) == ("c1", deadline, "paused")
        assert 0 < float(q["timeout_s"]) <= deadline - status.at + 0.01  # the time left
        assert [(p.component, p.name) for p in prep.participants] == [
            (MODELS, "policy"), (AGENTS, "agent0"), (AGENTS, "agent1"), (RESOURCES, "tools")]
        assert isinstance(prep.participants[0].reply, ModelStatusResponse)  # its last answer
        assert isinstance(prep.participants[1].reply, AgentStatus)
        assert all(p.seconds >= 0 for p in prep.participants)
        for s in ("policy", "agent0", "agent1", "tools"):
            for seen in gyms[s].calls():
                if seen.method == "POST":
                    assert seen.json == {"schema_version": 1, "checkpoint_id": "c1", "deadline_ts": deadline}

        mark = len(log)
        commit = await fleet.commit("c1", deadline, "/snap/draft/gym")
        got = calls(log, mark)
        assert sorted(got[:2]) == [("agent0", "agent-checkpoint/commit"), ("agent1", "agent-checkpoint/commit")]
        assert got[2:] == [("policy", "model-checkpoint/commit"), ("tools", "resources-checkpoint/commit")]
        (model_commit,) = gyms["policy"].calls("model-checkpoint/commit")
        refs = [msgspec.to_builtins(r) for r in commit.continuation_indexes]
        assert [r["relative_path"] for r in refs] == [f"{participant_dir(AGENTS, a)}/continuations.jsonl"
                                                      for a in ("agent0", "agent1")]
        assert model_commit.json["continuation_indexes"] == refs  # every agent's index, in agent order
        assert model_commit.json["checkpoint_dir"] == "/snap/draft/gym"
        assert [(p.component, p.name) for p in commit.participants] == [
            (AGENTS, "agent0"), (AGENTS, "agent1"), (MODELS, "policy"), (RESOURCES, "tools")]
        assert isinstance(commit.participants[2].reply, ModelCommitResponse)
        assert isinstance(commit.participants[3].reply, ResourcesCommitResponse)
        assert [(m.relative_path, m.manifest_digest) for m in commit.manifests()] == [
            (f"agent/instance-{sha('agent0')}/manifest.json", sha("agent agent0")),
            (f"agent/instance-{sha('agent1')}/manifest.json", sha("agent agent1")),
            ("model-ledger/policy/manifest.json", sha("model policy")),
            ("resources/tools/manifest.json", sha("resources tools"))]

        mark = len(log)
        resumed = await fleet.resume("c1", deadline)
        got = calls(log, mark)
        assert got[:2] == [("tools", "resources-checkpoint/resume"), ("policy", "model-admission/resume")]
        assert sorted(got[2:]) == [("agent0", "agent-checkpoint/resume"), ("agent1", "agent-checkpoint/resume")]
        assert [p.name for p in resumed.participants][:2] == ["tools", "policy"]

    run(gyms, scenario)
    for bystander in ("judge", "bystander", "web"):  # auxiliary, restart_only, stateless: never called
        assert [s.route for s in gyms[bystander].calls()] == ["capabilities"]


def _slow(gym: FakeGym, route: str, delay_s: float, answer: tuple[int, Any] | None = None) -> None:
    """``gym`` answers its next ``route`` call after ``delay_s``: with ``answer``, else its default."""
    gym.queue(route, lambda p: (*(answer or (200, gym.default(route, p))), delay_s))


def test_resources_alongside_commits_the_resources_while_the_agents_and_then_the_model_commit() -> None:
    gyms = servers()
    log = gyms["policy"].log
    _slow(gyms["agent0"], "agent-checkpoint/commit", 0.4)

    async def scenario(fleet: GymFleet) -> None:
        commit = await fleet.commit("c1", time.time() + 30, "/snap/draft/gym")
        got = calls(log)
        assert sorted(got[:3]) == [("agent0", "agent-checkpoint/commit"), ("agent1", "agent-checkpoint/commit"),
                                   ("tools", "resources-checkpoint/commit")]
        # The model is asked only once the slow agent answered, and the resources commit came before
        # it: sent while the agent was still committing (NeMo-RL's order sends it after the model's).
        assert got[3:] == [("policy", "model-checkpoint/commit")]
        (model_commit,) = gyms["policy"].calls("model-checkpoint/commit")
        assert len(model_commit.json["continuation_indexes"]) == 2
        assert [(p.component, p.name) for p in commit.participants] == [
            (AGENTS, "agent0"), (AGENTS, "agent1"), (MODELS, "policy"), (RESOURCES, "tools")]

    run(gyms, scenario, commit_order="resources_alongside")


@pytest.mark.parametrize("failing", ["agent0", "tools"])
def test_resources_alongside_raises_a_failure_only_once_both_chains_have_answered(failing: str) -> None:
    gyms = servers()
    log = gyms["policy"].log
    route = "agent-checkpoint/commit" if failing == "agent0" else "resources-checkpoint/commit"
    _slow(gyms[failing], route, 0.2, refusal("control_error", "disk gone"))
    _slow(gyms["agent1" if failing == "tools" else "tools"],
          "agent-checkpoint/commit" if failing == "tools" else "resources-checkpoint/commit", 0.4)

    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(ControlCallError) as err:
            await fleet.commit("c1", time.time() + 30, "/snap/draft/gym")
        assert (err.value.code, err.value.name) == ("control_error", failing)
        sent = set(calls(log))
        # The other chain ran to its end: resources committed although an agent failed; the model
        # committed (after both agents) although the resources server failed.
        assert ("tools", "resources-checkpoint/commit") in sent
        assert (("policy", "model-checkpoint/commit") in sent) == (failing == "tools")

    run(gyms, scenario, commit_order="resources_alongside")


def test_an_unknown_commit_order_is_refused() -> None:
    with pytest.raises(ValueError, match="commit_order is 'parallel', expected one of"):
        GymFleet([object()], commit_order="parallel")  # type: ignore[list-item, arg-type]


def test_restore_checks_the_source_and_discard_goes_to_every_agent_for_every_execution() -> None:
    gyms = servers()
    log = gyms["policy"].log

    async def scenario(fleet: GymFleet) -> None:
        restored = await fleet.restore("r1", time.time() + 30, "/staging/gym", source_checkpoint_id="ckpt-saved")
        got = calls(log)
        assert got[0] == ("policy", "model-checkpoint/restore")
        assert sorted(got[1:3]) == [("agent0", "agent-checkpoint/restore"), ("agent1", "agent-checkpoint/restore")]
        assert got[3:] == [("tools", "resources-checkpoint/restore")]
        assert [p.name for p in restored.participants] == ["policy", "agent0", "agent1", "tools"]
        assert len(restored.continuation_indexes) == 2

        mark = len(log)
        found = await fleet.discard_restored_agent_continuations(
            "r1", time.time() + 30, [{"rollout_id": "r7", "attempt_index": 1}, ("r8", 2)])
        assert sorted(calls(log, mark)) == [("agent0", "agent-checkpoint/discard-restored-continuation")] * 2 + [
            ("agent1", "agent-checkpoint/discard-restored-continuation")] * 2
        assert (found.executions, found.agent_participants, found.discarded) == (2, 2, 2)  # the fake discards odd n
        assert {(r.server_name, r.rollout_id, r.attempt_index, r.discarded) for r in found.replies} == {
            ("agent0", "r7", 1, True), ("agent0", "r8", 2, False), ("agent1", "r7", 1, True),
            ("agent1", "r8", 2, False)}
        body = gyms["agent0"].calls("agent-checkpoint/discard-restored-continuation")[0].json
        assert set(body) == {"schema_version", "checkpoint_id", "deadline_ts", "rollout_id", "attempt_index"}
        with pytest.raises(ValueError, match="unique"):
            await fleet.discard_restored_agent_continuations("r1", time.time() + 30, [("r7", 1), ("r7", 1)])

        gyms["agent1"].restored_from = "some-other-checkpoint"
        with pytest.raises(ControlCallError) as err:
            await fleet.restore("r2", time.time() + 30, "/staging/gym", source_checkpoint_id="ckpt-saved")
        assert (err.value.code, err.value.name) == ("bad_answer", "agent1")
        assert "some-other-checkpoint" in str(err.value)

    run(gyms, scenario)


@pytest.mark.parametrize("restore_order", ["nemo_rl", "concurrent"])
def test_a_concurrent_restore_asks_every_participant_while_the_model_restores(restore_order: str) -> None:
    # The model restores slowly and then refuses. In NeMo-RL's order that ends the restore before
    # any agent or resources server is asked; restoring concurrently, all were asked at once, and the
    # model's failure is raised only once every one of them has answered.
    gyms = servers()
    log = gyms["policy"].log
    _slow(gyms["policy"], "model-checkpoint/restore", 0.3, refusal("ledger_mismatch", "no ledger"))
    _slow(gyms["tools"], "resources-checkpoint/restore", 0.6)

    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(ControlCallError) as err:
            await fleet.restore("r1", time.time() + 30, "/staging/gym", source_checkpoint_id="ckpt-saved")
        assert (err.value.code, err.value.name) == ("ledger_mismatch", "policy")
        got = calls(log)
        if restore_order == "nemo_rl":
            assert got == [("policy", "model-checkpoint/restore")]
            return
        assert sorted(got) == [("agent0", "agent-checkpoint/restore"), ("agent1", "agent-checkpoint/restore"),
                               ("policy", "model-checkpoint/restore"), ("tools", "resources-checkpoint/restore")]
        (tools,) = gyms["tools"].calls("resources-checkpoint/restore")
        assert tools.answered  # raised only once the slow resources server (0.6 s; the model 0.3 s) answered

    run(gyms, scenario, restore_order=restore_order)


def test_a_concurrent_restore_replies_in_nemo_rls_order_and_checks_every_source() -> None:
    gyms = servers()
    _slow(gyms["policy"], "model-checkpoint/restore", 0.2)

    async def scenario(fleet: GymFleet) -> None:
        restored = await fleet.restore("r1", time.time() + 30, "/staging/gym", source_checkpoint_id="ckpt-saved")
        assert [(p.component, p.name) for p in restored.participants] == [
            (MODELS, "policy"), (AGENTS, "agent0"), (AGENTS, "agent1"), (RESOURCES, "tools")]
        assert len(restored.continuation_indexes) == 2
        gyms["tools"].restored_from = "some-other-checkpoint"
        with pytest.raises(ControlCallError) as err:
            await fleet.restore("r2", time.time() + 30, "/staging/gym", source_checkpoint_id="ckpt-saved")
        assert (err.value.code, err.value.name) == ("bad_answer", "tools")

    run(gyms, scenario, restore_order="concurrent")


def test_an_unknown_restore_order_is_refused() -> None:
    with pytest.raises(ValueError, match="restore_order is 'parallel', expected one of"):
        GymFleet([object()], restore_order="parallel")  # type: ignore[list-item, arg-type]


@pytest.mark.parametrize("failure", ["resources_refuse", "agent_never_ready", "model_never_pauses"])
def test_a_failed_prepare_resumes_everyone_it_called_and_raises(failure: str) -> None:
    gyms = servers()
    log = gyms["policy"].log
    deadline = time.time() + (0.5 if failure != "resources_refuse" else 30)
    if failure == "resources_refuse":
        gyms["tools"].queue("resources-checkpoint/prepare", refusal("resources_checkpoint_error", "session locked"))
        expected = ("resources_checkpoint_error", ["tools", "policy", "agent0", "agent1"])
    elif failure == "agent_never_ready":
        gyms["agent0"].queue("agent-checkpoint/prepare", *[refusal("agent_prepare_incomplete")] * 100)
        expected = ("agent_prepare_incomplete", ["policy", "agent0", "agent1"])  # resources never began
    else:
        draining = {"state": "draining", "workers": WORKERS, "inflight_total": 1, "waiters_total": 0}
        gyms["policy"].queue("model-admission/pause", (200, draining))
        gyms["policy"].queue("model-admission/status", lambda q: (200, {
            **gyms["policy"].default("model-admission/status", q), "state": "draining", "inflight_total": 1}))
        expected = ("not_ready", ["tools", "policy", "agent0", "agent1"])

    async def scenario(fleet: GymFleet) -> None:
        t0 = time.monotonic()
        with pytest.raises(ControlCallError) as err:
            await fleet.prepare("c1", deadline)
        assert err.value.code == expected[0]
        if failure == "agent_never_ready":
            assert time.monotonic() - t0 >= 0.45  # tried until the deadline
            assert len(gyms["agent0"].calls("agent-checkpoint/prepare")) >= 3
        resumes = [(s.server, s.json["deadline_ts"]) for s in log if s.route.endswith("/resume")]
        names = [name for name, _ in resumes]
        assert sorted(names) == sorted(expected[1])
        assert names.index(expected[1][-1]) > names.index("policy")  # agents after the model
        assert all(d >= deadline for _, d in resumes)

    run(gyms, scenario)


def test_when_the_resume_after_a_failed_prepare_fails_too_both_are_said() -> None:
    gyms = servers()
    gyms["tools"].queue("resources-checkpoint/prepare", refusal("resources_checkpoint_error"))
    gyms["agent1"].queue("agent-checkpoint/resume", refusal("control_error", "disk gone"))

    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(ControlCallError) as err:
            await fleet.prepare("c1", time.time() + 30)
        assert err.value.code == "resources_checkpoint_error"
        assert "resuming the participants called also failed" in str(err.value) and "disk gone" in str(err.value)

    run(gyms, scenario)


def test_abort_asks_everyone_and_reports_instead_of_raising_but_resume_raises() -> None:
    gyms = servers()
    log = gyms["policy"].log
    gyms["policy"].queue("model-admission/resume", refusal("invalid_phase", "phase 'idle'"))  # never began: fine
    gyms["tools"].queue("resources-checkpoint/resume", refusal("stale_checkpoint"))  # already ended: fine
    gyms["agent0"].queue("agent-checkpoint/resume", refusal("control_error", "boom"))

    async def scenario(fleet: GymFleet) -> None:
        aborted = await fleet.abort("c1", time.time() + 30)
        assert len(aborted.failures) == 1 and "boom" in aborted.failures[0]
        assert [p.name for p in aborted.participants] == ["agent1"]
        assert sorted(calls(log)) == sorted([("tools", "resources-checkpoint/resume"),
                                             ("policy", "model-admission/resume"),
                                             ("agent0", "agent-checkpoint/resume"),
                                             ("agent1", "agent-checkpoint/resume")])
        mark = len(log)
        gyms["tools"].queue("resources-checkpoint/resume", refusal("control_error", "first"))
        with pytest.raises(ControlCallError) as err:
            await fleet.resume("c2", time.time() + 30)
        assert (err.value.code, err.value.name) == ("control_error", "tools")
        assert len(calls(log, mark)) == 4  # every participant was still asked

    run(gyms, scenario)


def test_completed_results_are_acknowledged_in_one_batch_per_agent_and_the_echo_is_checked() -> None:
    gyms = servers()

    def receipt(rid: str, n: int = 0) -> dict[str, Any]:
        return {"rollout_id": rid, "attempt_index": n, "execution_generation": 1, "result_identity": f"res-{rid}",
                "result_digest": sha(rid)}

    async def scenario(fleet: GymFleet) -> None:
        got = await fleet.acknowledge_completed_executions([
            {"receipt": receipt("a"), "agent_name": "agent1"}, {"receipt": receipt("b"), "agent_name": "agent0"},
            CompletedExecution(receipt=CompletionReceipt(**receipt("c", 2)), agent_name="agent1")])
        assert [(e.agent_name, e.receipt.rollout_id) for e in got.acknowledged] == [
            ("agent0", "b"), ("agent1", "a"), ("agent1", "c")]
        (batch,) = gyms["agent1"].calls("agent-checkpoint/acknowledge-completed")
        assert batch.json == {"schema_version": 1, "executions": [receipt("a"), receipt("c", 2)]}
        assert len(gyms["agent0"].calls("agent-checkpoint/acknowledge-completed")) == 1
        assert isinstance(await fleet.completion_receipt("agent0", "b", 0), CompletionReceipt)

        gyms["agent0"].queue("agent-checkpoint/acknowledge-completed", (200, {"acknowledged": []}))
        with pytest.raises(ControlCallError) as err:
            await fleet.acknowledge_completed_executions([{"receipt": receipt("b"), "agent_name": "agent0"}])
        assert (err.value.code, err.value.name) == ("bad_answer", "agent0")
        other = {**receipt("b"), "result_identity": "not-what-was-sent"}
        gyms["agent0"].queue("agent-checkpoint/acknowledge-completed", (200, {"acknowledged": [other]}))
        with pytest.raises(ControlCallError, match="echo"):
            await fleet.acknowledge_completed_executions([{"receipt": receipt("b"), "agent_name": "agent0"}])
        with pytest.raises(ControlCallError) as err:  # it does not advertise the feature
            await fleet.acknowledge_completed_executions([{"receipt": receipt("z"), "agent_name": "bystander"}])
        assert err.value.code == "topology"
        with pytest.raises(ControlCallError, match="matches 0"):
            await fleet.acknowledge_completed_executions([{"receipt": receipt("z"), "agent_name": "nobody"}])
        with pytest.raises(ValueError, match="unique"):
            await fleet.acknowledge_completed_executions([{"receipt": receipt("b"), "agent_name": "agent0"}] * 2)

    run(gyms, scenario)


def _refused(gyms: dict[str, FakeGym], match: str, urls: Any = None) -> None:
    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(ControlCallError, match=match) as err:
            await fleet.discover()
        assert err.value.code == "topology"

    run(gyms, scenario, discover=False, urls=urls)


@pytest.mark.parametrize(("change", "match"), [
    (lambda g: setattr(g["tools"], "multi_process", {"mode": "unmanaged", "num_workers": 4}), "4 unmanaged workers"),
    (lambda g: setattr(g["judge"], "instance_role", None), "must declare its instance_role"),
    (lambda g: setattr(g["agent0"], "instance_role", "policy"), "must not declare an instance_role"),
    (lambda g: setattr(g["policy"], "instance_role", "auxiliary"), "no policy model"),
    (lambda g: setattr(g["agent0"], "name", "agent1"), "reports the name 'agent1'"),
    (lambda g: setattr(g["agent0"], "features", [FEATURE_CONTINUATION_INDEX]),
     f"agent0: {FEATURE_COMPLETED_RESULT_ACK}"),
    (lambda g: setattr(g["agent1"], "features", [FEATURE_COMPLETED_RESULT_ACK]),
     f"agent1: {FEATURE_CONTINUATION_INDEX}"),
    (lambda g: setattr(g["policy"], "features", []), f"policy: {FEATURE_STORAGE_REFERENCE_INDEX}"),
    (lambda g: setattr(g["web"], "checkpoint_mode", "restart_only"), f"agent0: {FEATURE_DISCARD_RESTORED}"),
], ids=["unmanaged", "model-without-role", "agent-with-role", "no-policy", "server-name-is-not-the-name",
        "agent-without-ack", "agent-without-index", "policy-without-storage-index", "restart-only-resources"])
def test_discovery_refuses_what_nemo_rl_refuses(change: Callable[[dict[str, FakeGym]], None], match: str) -> None:
    gyms = servers()
    change(gyms)
    _refused(gyms, match)


def test_discovery_accepts_the_rules_edges() -> None:
    gyms = servers()
    gyms["web"].checkpoint_mode = "restart_only"  # then agents need the discard and dependency features too
    for a in ("agent0", "agent1"):
        gyms[a].features = AGENT_FEATURES + [FEATURE_DISCARD_RESTORED, FEATURE_RESOURCE_DEPENDENCY_INDEX, "later_v9"]
    gyms["policy"].checkpoint_mode = "stateless"  # a stateless policy needs no storage index...
    gyms["policy"].features = []
    log = gyms["policy"].log

    async def scenario(fleet: GymFleet) -> None:
        topology = await fleet.discover()
        assert topology.restart_only_resources() == ["web"]
        await fleet.prepare("c1", time.time() + 30)
        assert ("policy", "model-admission/pause") in calls(log)  # ...but is paused
        mark = len(log)
        await fleet.commit("c1", time.time() + 30, "/d")
        assert "policy" not in {s for s, _ in calls(log, mark)}  # and commits nothing
        await fleet.resume("c1", time.time() + 30)
        assert ("policy", "model-admission/resume") in calls(log, mark)

    run(gyms, scenario)


def test_duplicates_are_refused_and_a_list_of_urls_names_each_server_by_its_capabilities() -> None:
    gyms = servers()
    urls = [f"http://{n}" for n in gyms]
    _refused(gyms, "share the participant", urls=urls + ["http://tools"])

    async def scenario(fleet: GymFleet) -> None:
        topology = await fleet.discover()
        assert sorted(s.server_name for s in fleet.servers) == sorted(gyms)
        assert topology.fingerprint == _recipe(gyms)
        only = await fleet.discover(["policy", "agent0"])
        assert [c["participant"]["server_name"] for c in only.participants] == ["agent0", "policy"]

    run(gyms, scenario, discover=False, urls=list(reversed(urls)))


def _recipe(gyms: dict[str, FakeGym]) -> str:
    """CONTROL.md §5's fingerprint, written here from the recipe (not with the code under test)."""
    contracts = []
    for g in gyms.values():
        c = g.capabilities()
        contracts.append({
            "participant": {"server_name": g.name, "component": c["component"], "participant_name": c["name"]},
            "schema_version": c["schema_version"], "admission_states": sorted(c["admission_states"]),
            "checkpoint_mode": c["checkpoint_mode"], "concurrency_contract": c["concurrency_contract"],
            "multi_process": {"mode": c["multi_process"]["mode"], "num_workers": c["multi_process"]["num_workers"]},
            "instance_role": c["instance_role"]})  # features: left out of the hash
    contracts.sort(key=lambda c: (c["participant"]["component"], c["participant"]["server_name"],
                                  c["participant"]["participant_name"]))
    doc = {"schema_version": 1, "participants": contracts}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def test_the_fingerprint_of_a_fixed_topology_is_the_recipes() -> None:
    gyms = servers()

    async def scenario(fleet: GymFleet) -> str:
        topology = await fleet.discover()
        assert [c["participant"]["server_name"] for c in topology.participants] == [
            "tools", "web", "agent0", "agent1", "bystander", "judge", "policy"]  # by component string, then name
        assert topology.participants[2]["features"] == sorted(gyms["agent0"].features)  # kept, not hashed
        return topology.fingerprint

    fingerprint = run(gyms, scenario)
    assert fingerprint == _recipe(gyms)
    assert len(fingerprint) == 64 and fingerprint == fingerprint.lower()
    gyms["agent0"].features = AGENT_FEATURES + ["something_new"]  # features and live state do not count
    gyms["agent0"].capabilities = lambda base=gyms["agent0"].capabilities: {
        **base(), "phase": "prepared", "active_checkpoint_id": "c9", "deadline_ts": 5e9}
    assert run(gyms, scenario) == fingerprint
    gyms["tools"].admission_states = ["paused", "accepting"]  # a contract field does count
    changed = run(gyms, scenario)
    assert changed != fingerprint and changed == _recipe(gyms)


UNACKNOWLEDGED = [{"rollout_id": "r1", "attempt_index": 0, "state": "completed", "generation": 1}]


def _blocked_by_unacknowledged(gym: FakeGym, parked_without_boundary: int = 0) -> None:
    gym.queue("agent-checkpoint/prepare", *[refusal("agent_prepare_incomplete")] * 100)
    gym.queue("agent-checkpoint/status", lambda q: (200, {
        **gym.default("agent-checkpoint/status", q), "ready_to_commit": False, "running": 0,
        "completed_unacknowledged": 2, "parked_without_boundary": parked_without_boundary,
        "completed_unacknowledged_attempts": UNACKNOWLEDGED}))


def _resumed(log: list[Seen]) -> list[str]:
    return sorted(s.server for s in log if s.route.endswith("/resume"))


def test_an_agent_blocked_only_by_unacknowledged_results_fails_the_prepare_at_once() -> None:
    """Nothing left running: only the caller can clear the blockers, so the fleet stops re-sending,
    raises them typed (with the attempts the agent listed) and, as NeMo-RL does, resumes everyone
    it called."""
    gyms = servers()
    _blocked_by_unacknowledged(gyms["agent0"])

    async def scenario(fleet: GymFleet) -> None:
        t0 = time.monotonic()
        with pytest.raises(UnacknowledgedResults) as err:
            await fleet.prepare("c1", time.time() + 30)
        assert err.value.code == "agent_prepare_incomplete" and err.value.status == 409
        assert "2 completed result(s) not yet acknowledged" in str(err.value)
        assert [(a.rollout_id, a.attempt_index) for a in err.value.attempts] == [("r1", 0)]
        assert time.monotonic() - t0 < 5  # not the 30 s deadline
        assert len(gyms["agent0"].calls("agent-checkpoint/prepare")) == 1
        assert _resumed(gyms["policy"].log) == ["agent0", "agent1", "policy"]

    run(gyms, scenario)


def test_a_prepare_asked_to_hold_leaves_everyone_called_paused_and_prepares_the_same_id_again() -> None:
    """With ``hold_when_unacknowledged`` the same refusal resumes no one; the caller acknowledges, and
    the same id prepares again through every step."""
    gyms = servers()
    log = gyms["policy"].log
    _blocked_by_unacknowledged(gyms["agent0"])

    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(UnacknowledgedResults):
            await fleet.prepare("c1", time.time() + 30, hold_when_unacknowledged=True)
        assert _resumed(log) == [] and not gyms["tools"].calls("resources-checkpoint/prepare")
        gyms["agent0"].script.clear()  # acknowledged: the agent is ready now
        mark = len(log)
        prep = await fleet.prepare("c1", time.time() + 30, hold_when_unacknowledged=True)
        assert prep.checkpoint_id == "c1" and _resumed(log) == []
        assert next(c for c in calls(log, mark) if c[1] != "model-admission/status") == ("policy", "model-admission/pause")
        assert ("tools", "resources-checkpoint/prepare") in calls(log, mark)
        assert {s.json["checkpoint_id"] for s in log[mark:] if s.method == "POST"} == {"c1"}

    run(gyms, scenario)


@pytest.mark.parametrize("other", ["a_failure", "parked_without_boundary"])
def test_a_prepare_asked_to_hold_still_resumes_everyone_when_something_else_blocks(other: str) -> None:
    """Holding is only for what acknowledging clears: another agent's failure, or executions parked
    without a boundary, resume everyone called as before."""
    gyms = servers()
    if other == "a_failure":
        _blocked_by_unacknowledged(gyms["agent0"])
        gyms["agent1"].queue("agent-checkpoint/prepare", refusal("agent_checkpoint_error", "disk full", 500))
    else:
        _blocked_by_unacknowledged(gyms["agent0"], parked_without_boundary=1)

    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(ControlCallError) as err:
            await fleet.prepare("c1", time.time() + 30, hold_when_unacknowledged=True)
        assert not isinstance(err.value, UnacknowledgedResults)
        assert err.value.code == ("agent_checkpoint_error" if other == "a_failure" else "agent_prepare_incomplete")
        assert _resumed(gyms["policy"].log) == ["agent0", "agent1", "policy"]

    run(gyms, scenario)


def test_unacknowledged_results_keep_their_type_and_fields_across_pickling() -> None:
    exc = UnacknowledgedResults(ControlCallError("agent0: 409", component=AGENTS, name="agent0", status=409,
                                                 code="agent_prepare_incomplete", step="agent-checkpoint/prepare"),
                                UNACKNOWLEDGED)
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, UnacknowledgedResults) and str(back) == "agent0: 409"
    assert (back.component, back.name, back.status, back.code, back.step, back.attempts) == (
        AGENTS, "agent0", 409, "agent_prepare_incomplete", "agent-checkpoint/prepare", UNACKNOWLEDGED)


def test_a_participant_a_failed_prepare_left_behind_is_resumed_before_the_next_prepare() -> None:
    """``agent1`` is still preparing ``c1`` when the failed prepare resumes it (409 ``invalid_phase``),
    then finishes preparing and holds ``c1``: the next prepare first resumes ``c1`` on it, and only on it
    (``tools`` was never called)."""
    gyms = servers()
    log = gyms["policy"].log
    gyms["agent0"].queue("agent-checkpoint/prepare", refusal("agent_checkpoint_error"))
    gyms["agent1"].queue("agent-checkpoint/resume", refusal("invalid_phase"))

    async def scenario(fleet: GymFleet) -> None:
        with pytest.raises(ControlCallError):
            await fleet.prepare("c1", time.time() + 30)
        start = len(log)
        await fleet.prepare("c2", time.time() + 30)
        released = [(s.server, json.loads(s.body)["checkpoint_id"]) for s in log[start:] if s.route.endswith("/resume")]
        assert released == [("agent1", "c1")], released
        first_new = next(i for i, s in enumerate(log[start:]) if s.route == "model-admission/pause")
        assert all(s.route.endswith("/resume") or s.route == "capabilities" for s in log[start:start + first_new])

    run(gyms, scenario)
