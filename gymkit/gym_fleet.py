"""Every Gym server of a deployment, driven in NeMo-RL's call orders (CONTROL.md §8), asyncio.

Servers are named by their *server name* (NeMo-RL's routing name, the top-level key of Gym's
config), which must equal the ``name`` their capabilities report: Gym's files live under that
name (``model-ledger/<name>/``, ``resources/<name>/``, ``agent/instance-<sha256(name)>/``).
Given a list of URLs instead of a mapping, each server's name is its capability name.

**Discovery** (:meth:`GymFleet.discover`) reads every server's capabilities and refuses, as
NeMo-RL does: an ``unmanaged`` multi-process server; a model without ``instance_role`` or another
component with one; two servers with one (component, name); a topology without a policy model;
and missing features: an ``export_restore`` agent needs ``completed_result_acknowledgement`` and
``agent_continuation_index_v1`` (plus ``discard_restored_continuation_v1`` and
``agent_resource_dependency_index_v1`` when any resources server is ``restart_only``), an
``export_restore`` policy model ``external_storage_reference_index_v1``. Its fingerprint is
:func:`schemas.topology.topology_fingerprint` over every server's contract.

**Who takes part.** The policy model always joins pause and resume, and commit and restore only if
it is ``export_restore``; agents and resources servers join every step only if ``export_restore``;
auxiliary models never do.

**Orders.** Servers of one component are called at once, and a component starts only when every
server of the one before has answered (a failure fails the step once its siblings have answered):

* prepare: models ``pause`` -> agents ``prepare`` (sent again every <= 0.1 s on 409
  ``agent_prepare_incomplete`` until the deadline) -> resources ``prepare`` -> ``GET status?
  wait_state=paused&timeout_s=<time left>`` for the models not yet paused. On failure every
  participant it called (or began to call) is resumed (one whose own call failed may answer
  ``invalid_phase``: not a further failure), and the error raised. An agent that refuses with
  nothing left running and only completed results not yet acknowledged is not re-sent: only the
  caller can clear that (:class:`UnacknowledgedResults`). With ``hold_when_unacknowledged`` (not
  NeMo-RL's; this repository's save) the fleet then resumes no one: every participant called stays
  paused under the id, agent admission closed, so nothing else can complete. The caller stores and
  acknowledges the results, then prepares again under the same id (each participant that already
  answered replays its answer), or aborts the id.
* commit: agents -> the policy model, given every agent's continuation index -> resources
  (``commit_order="nemo_rl"``, the default). ``commit_order="resources_alongside"`` commits the
  resources servers at the same time as agents -> model: nothing orders them (every participant is
  already prepared, so its state is frozen; the model reads only the agents' indexes; each writes
  its own folder), and the pause then waits for the longer of the two chains, not their sum. A
  failure still fails the step only once both chains have answered.
* restore: models -> agents -> resources (``restore_order="nemo_rl"``, the default); with
  ``source_checkpoint_id`` each must report it. ``restore_order="concurrent"`` restores every
  participant at once: nothing orders them (each reads only files in ``checkpoint_dir``: its own
  folder, and a resources server the agents' committed indexes; none calls another; every one stays
  paused until the resume), and the restore then waits for the slowest participant, not the sum of
  the three steps. A failure still fails the step only once every participant has answered.
* resume: resources -> models -> agents, the design note's order ("opens what agents call
  first"). NeMo-RL's actor (``nemo_gym.py``, version not pinned, at the time of ``d595189f``)
  resumes resources -> agents -> models (policy reopening last); NeMo-RL ``498dcedb`` uses the
  design note's order. Every participant is asked even if one fails; the first failure is raised
  afterwards, naming all.
* abort: the same calls as resume (Gym has no abort route), but failures are reported, not
  raised; ``invalid_phase`` and ``stale_checkpoint`` (a server that never began, or already
  ended) are not failures.

Every failure is a :class:`~gymkit.control_client.ControlCallError`; the fleet's own refusals use
the client codes :data:`FLEET_CODES` (``status`` None).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import httpx
import msgspec

from gymkit.control_client import DEFAULT_TIMEOUT_S, AsyncControlClient, ControlCallError
from schemas.control import (
    FEATURE_COMPLETED_RESULT_ACK,
    FEATURE_CONTINUATION_INDEX,
    FEATURE_DISCARD_RESTORED,
    FEATURE_RESOURCE_DEPENDENCY_INDEX,
    FEATURE_STORAGE_REFERENCE_INDEX,
    AgentStatus,
    Capabilities,
    CompletionReceipt,
    ModelRestoreResponse,
)
from schemas.gym_files import MANIFEST_NAME, ArtifactRef, participant_dir
from schemas.topology import topology_fingerprint

T = TypeVar("T")

MODELS, AGENTS, RESOURCES = "responses_api_models", "responses_api_agents", "resources_servers"
PREPARE_ORDER = (MODELS, AGENTS, RESOURCES)
COMMIT_ORDER = (AGENTS, MODELS, RESOURCES)
RESTORE_ORDER = (MODELS, AGENTS, RESOURCES)
RESUME_ORDER = (RESOURCES, MODELS, AGENTS)  # the design note's; also abort's
#: ``GymFleet(commit_order=...)``: NeMo-RL's (agents -> model -> resources), or agents -> model with
#: the resources servers committing alongside (see the module docstring).
CommitOrder = Literal["nemo_rl", "resources_alongside"]
COMMIT_ORDERS: tuple[str, ...] = get_args(CommitOrder)
#: ``GymFleet(restore_order=...)``: NeMo-RL's (models -> agents -> resources), or every participant at
#: once (see the module docstring).
RestoreOrder = Literal["nemo_rl", "concurrent"]
RESTORE_ORDERS: tuple[str, ...] = get_args(RestoreOrder)
AGENT_PREPARE_RETRY_S = 0.1  # agent prepare is sent again at most this long after an agent_prepare_incomplete
#: What an abort may be answered by a server that never began the checkpoint, or already ended it.
ALREADY_ENDED = ("invalid_phase", "stale_checkpoint")
#: The fleet's own refusals (``status`` None): a topology NeMo-RL refuses, a participant not
#: ready by the deadline.
FLEET_CODES = ("topology", "not_ready")


# -- results ----------------------------------------------------------------------------------------
class ParticipantReply(msgspec.Struct, frozen=True, kw_only=True):
    """One participant's answer to one step: who, the route's reply struct, and how long it took."""

    component: str
    name: str  # the capability name (NeMo-RL's participant_name)
    server_name: str
    reply: Any
    seconds: float


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """Every participant's reply to one step, in call order."""

    checkpoint_id: str
    participants: list[ParticipantReply]

    def of(self, component: str) -> list[ParticipantReply]:
        return [p for p in self.participants if p.component == component]


class PrepareResult(StepResult, frozen=True, kw_only=True):
    """``reply`` is the model's last answer (its status if it was polled), the agent's status, the
    resources' inventory."""

    agent_prepare_attempts: dict[str, int] = {}  # server name -> prepare calls sent


class ManifestRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a participant's manifest is in ``checkpoint_dir`` and the digest its commit reported."""

    component: str
    name: str
    relative_path: str
    manifest_digest: str


class CommitResult(StepResult, frozen=True, kw_only=True):
    """``reply``: ``AgentCommitResponse``, ``ModelCommitResponse``, ``ResourcesCommitResponse``."""

    checkpoint_dir: str

    @property
    def continuation_indexes(self) -> list[ArtifactRef]:
        return [p.reply.continuation_index for p in self.of(AGENTS)]

    def manifests(self) -> list[ManifestRef]:
        return [ManifestRef(component=p.component, name=p.name,
                            relative_path=f"{participant_dir(p.component, p.name)}/{MANIFEST_NAME}",
                            manifest_digest=p.reply.manifest_digest) for p in self.participants]


class RestoreResult(StepResult, frozen=True, kw_only=True):
    """``reply``: ``ModelRestoreResponse``, ``AgentRestoreResponse``, ``ResourcesRestoreResponse``."""

    checkpoint_dir: str

    @property
    def continuation_indexes(self) -> list[ArtifactRef]:
        return [p.reply.continuation_index for p in self.of(AGENTS)]


class AbortResult(StepResult, frozen=True, kw_only=True):
    """The resume calls' answers, and what failed (each a message), for the log."""

    failures: list[str] = []


class DiscardReply(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    server_name: str
    rollout_id: str
    attempt_index: int
    discarded: bool


class DiscardResult(msgspec.Struct, frozen=True, kw_only=True):
    """NeMo-RL's counts (``executions``, ``agent_participants``, ``discarded``) and every reply."""

    checkpoint_id: str
    executions: int
    agent_participants: int
    discarded: int
    replies: list[DiscardReply]


class CompletedExecution(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A completion receipt and the agent (participant name) that holds the result."""

    receipt: CompletionReceipt
    agent_name: str


class AcknowledgeResult(msgspec.Struct, frozen=True, kw_only=True):
    acknowledged: list[CompletedExecution]


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    """What discovery found: NeMo-RL's topology (``schema_version``, the contracts sorted by
    (component, server_name, participant_name), features included) and its fingerprint (bare hex)."""

    schema_version: int = 1
    participants: list[dict[str, Any]]
    fingerprint: str

    def restart_only_resources(self) -> list[str]:
        return sorted(c["participant"]["server_name"] for c in self.participants
                      if c["participant"]["component"] == RESOURCES and c["checkpoint_mode"] == "restart_only")


@dataclass
class Server:
    """One Gym server: its routing name, its client, and its capabilities once read."""

    server_name: str | None  # None until discovery when only the URL was given
    client: AsyncControlClient

    @property
    def caps(self) -> Capabilities:
        if self.client.caps is None:
            raise _fleet_error("topology", f"capabilities of {self.client.url} not read: call discover() first")
        return self.client.caps

    @property
    def name(self) -> str:
        return self.caps.name

    @property
    def component(self) -> str:
        return self.caps.component

    @property
    def policy(self) -> bool:
        return self.component == MODELS and self.caps.instance_role == "policy"

    @property
    def exports(self) -> bool:
        return self.caps.checkpoint_mode == "export_restore"

    def error(self, step: str, what: str, code: str) -> ControlCallError:
        return ControlCallError(f"{step} of {self.client.label}: {what}", component=self.component, name=self.name,
                                code=code, step=step)


def _fleet_error(code: str, message: str, **kw: Any) -> ControlCallError:
    return ControlCallError(message, code=code, **kw)


def checked_commit_order(order: str) -> CommitOrder:
    """``order`` if it is one of :data:`COMMIT_ORDERS`, else a ``ValueError`` naming them."""
    return _one_of("commit_order", order, COMMIT_ORDERS)  # type: ignore[return-value]


def checked_restore_order(order: str) -> RestoreOrder:
    """``order`` if it is one of :data:`RESTORE_ORDERS`, else a ``ValueError`` naming them."""
    return _one_of("restore_order", order, RESTORE_ORDERS)  # type: ignore[return-value]


def _one_of(knob: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{knob} is {value!r}, expected one of {choices}")
    return value


class UnacknowledgedResults(ControlCallError):
    """An agent refused prepare (409 ``agent_prepare_incomplete``) with nothing left running and only
    completed results not yet acknowledged: ``attempts`` lists them, each with its completion receipt.
    Only the caller clears this, by storing and acknowledging them."""

    def __init__(self, exc: ControlCallError, attempts: Sequence[Any]) -> None:
        super().__init__(str(exc), component=exc.component, name=exc.name, status=exc.status, code=exc.code,
                         detail=exc.detail, step=exc.step)
        self.attempts = list(attempts)

    def __reduce__(self):  # keeps its type and fields across pickling (Ray)
        return (_rebuild_unacknowledged, (ControlCallError(str(self), component=self.component, name=self.name,
                                                           status=self.status, code=self.code, detail=self.detail,
                                                           step=self.step), self.attempts))


def _rebuild_unacknowledged(exc: ControlCallError, attempts: list[Any]) -> UnacknowledgedResults:
    return UnacknowledgedResults(exc, attempts)


async def _all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Await all; then raise the first failure, if any (no sibling is left running behind it). An
    :class:`UnacknowledgedResults` is raised only when every failure is one: any other failure
    needs the participants resumed."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise next((f for f in failures if not isinstance(f, UnacknowledgedResults)), failures[0])
    return results  # type: ignore[return-value]


class GymFleet:
    """Every Gym server of a deployment (see the module docstring). :meth:`discover` comes first."""

    def __init__(self, servers: Sequence[Server], *, control_timeout_s: float = DEFAULT_TIMEOUT_S,
                 commit_order: CommitOrder = "nemo_rl", restore_order: RestoreOrder = "nemo_rl") -> None:
        if not servers:
            raise ValueError("a Gym fleet needs at least one server")
        self.commit_order = checked_commit_order(commit_order)
        self.restore_order = checked_restore_order(restore_order)
        self._configured = list(servers)
        self.servers: list[Server] = []  # the discovered participants, sorted by (component, server name)
        self.topology: Topology | None = None
        self.control_timeout_s = control_timeout_s
        # Participants a failed prepare could not resume (its call timed out, or it was still
        # preparing when resumed): server name -> that checkpoint id. A server may finish such a
        # prepare later and hold the id active; the next prepare resumes it first.
        self._dangling: dict[str, str] = {}

    @classmethod
    def connect(cls, servers: Mapping[str, str] | Sequence[str], token: str, http: httpx.AsyncClient, *,
                control_timeout_s: float = DEFAULT_TIMEOUT_S, commit_order: CommitOrder = "nemo_rl",
                restore_order: RestoreOrder = "nemo_rl", **client_kw: Any) -> GymFleet:
        """``servers``: server name -> URL (Gym's top-level config keys), or a list of URLs."""
        if isinstance(servers, Mapping):
            entries = [(name, url) for name, url in sorted(servers.items())]
        else:
            entries = [(None, url) for url in servers]
        return cls([Server(name, AsyncControlClient(url, token, http, timeout=control_timeout_s, **client_kw))
                    for name, url in entries], control_timeout_s=control_timeout_s, commit_order=commit_order,
                   restore_order=restore_order)

    # -- discovery ------------------------------------------------------------------------------------
    async def discover(self, server_names: Iterable[str] | None = None) -> Topology:
        """Read every server's capabilities (or only ``server_names``'), check them against NeMo-RL's
        rules and return the topology with its fingerprint."""
        self.topology, self.servers = None, []
        wanted = None if server_names is None else set(server_names)
        candidates = [s for s in self._configured if wanted is None or s.server_name is None or s.server_name in wanted]
        await _all(s.client.capabilities() for s in candidates)
        found: list[Server] = []
        for s in candidates:
            if s.server_name is None:
                s.server_name = s.caps.name
            if wanted is None or s.server_name in wanted:
                found.append(s)
        if wanted is not None and (missing := wanted - {s.server_name for s in found}):
            raise _fleet_error("topology", f"no Gym server is named {sorted(missing)}")
        if not found:
            raise _fleet_error("topology", "NeMo-Gym exposes no checkpoint participants")
        ordered = sorted(found, key=lambda s: (s.component, s.server_name, s.name))
        _check_topology(ordered)
        self.servers = ordered
        contracts = [s.caps.contract(s.server_name) for s in ordered]
        self.topology = Topology(participants=sorted(contracts, key=_contract_key),
                                 fingerprint=topology_fingerprint(contracts))
        return self.topology

    @property
    def fingerprint(self) -> str:
        return self._discovered().fingerprint

    def _discovered(self) -> Topology:
        if self.topology is None:
            raise _fleet_error("topology", "discover_checkpoint_capabilities must succeed before Gym checkpoint "
                                           "control calls")
        return self.topology

    def of(self, component: str) -> list[Server]:
        """Every discovered server of ``component``, sorted by server name."""
        self._discovered()
        return [s for s in self.servers if s.component == component]

    @property
    def agents(self) -> list[Server]:
        return self.of(AGENTS)

    def agent(self, agent_name: str) -> Server:
        """The agent whose participant name is ``agent_name``."""
        matches = [s for s in self.agents if s.name == agent_name]
        if len(matches) != 1:
            raise _fleet_error("topology", f"agent {agent_name!r} matches {len(matches)} Gym agent participants")
        return matches[0]

    def pausing(self, component: str) -> list[Server]:
        """Who joins prepare and resume: the policy model always, agents and resources if export_restore."""
        if component == MODELS:
            return [s for s in self.of(MODELS) if s.policy]
        return [s for s in self.of(component) if s.exports]

    def exporting(self, component: str) -> list[Server]:
        """Who joins commit and restore: export_restore participants (models: the policy only)."""
        return [s for s in self.pausing(component) if s.exports]

    # -- completed results ----------------------------------------------------------------------------
    async def completion_receipt(self, agent_name: str, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        """The receipt of a completed result, from the agent that holds it."""
        return await self._acknowledging(agent_name).client.agent.completion_receipt(rollout_id, attempt_index)

    async def acknowledge_completed_executions(
            self, executions: Iterable[CompletedExecution | Mapping[str, Any]]) -> AcknowledgeResult:
        """One ``acknowledge-completed`` batch per agent (agents by name); each reply must echo the
        receipts it was sent, exactly. Malformed or repeated input raises ``ValueError``."""
        items = [e if isinstance(e, CompletedExecution) else msgspec.convert(e, CompletedExecution)
                 for e in executions]
        keys = [(e.agent_name, e.receipt.rollout_id, e.receipt.attempt_index) for e in items]
        if len(keys) != len(set(keys)):
            raise ValueError("completed Gym execution acknowledgements must be unique")
        by_agent: dict[str, list[CompletionReceipt]] = {}
        for e in items:
            by_agent.setdefault(e.agent_name, []).append(e.receipt)
        servers = {name: self._acknowledging(name) for name in by_agent}

        async def one(name: str) -> list[CompletedExecution]:
            sent = by_agent[name]
            reply = await servers[name].client.agent.acknowledge_completed(sent)
            want = {(r.rollout_id, r.attempt_index): r for r in sent}
            got = {(r.rollout_id, r.attempt_index): r for r in reply.acknowledged}
            if got != want or len(got) != len(reply.acknowledged):
                echoed = [(r.rollout_id, r.attempt_index) for r in reply.acknowledged]
                raise servers[name].error("agent-checkpoint/acknowledge-completed",
                                          f"the reply does not echo the receipts sent: sent {sorted(want)}, "
                                          f"acknowledged {echoed}", "bad_answer")
            return [CompletedExecution(receipt=r, agent_name=name) for r in reply.acknowledged]

        done = await _all(one(name) for name in sorted(by_agent))
        return AcknowledgeResult(acknowledged=[e for batch in done for e in batch])

    def _acknowledging(self, agent_name: str) -> Server:
        s = self.agent(agent_name)
        if FEATURE_COMPLETED_RESULT_ACK not in s.caps.features:
            raise s.error("acknowledge", f"agent does not advertise {FEATURE_COMPLETED_RESULT_ACK}", "topology")
        return s

    # -- the checkpoint steps -----------------------------------------------------------------------------
    async def prepare(self, checkpoint_id: str, deadline_ts: float, *,
                      hold_when_unacknowledged: bool = False) -> PrepareResult:
        """Pause the policy model, park every agent at a boundary, freeze resources, then wait for the
        models still draining; on failure resume everyone called and raise. With
        ``hold_when_unacknowledged``, an :class:`UnacknowledgedResults` is raised with everyone called
        left paused under ``checkpoint_id`` (module docstring)."""
        models = self.pausing(MODELS)
        for s in models:
            if "paused" not in s.caps.admission_states:
                raise s.error("model-admission/pause", "the policy model cannot pause (no 'paused' in its "
                                                       "admission_states)", "topology")
        attempted: list[Server] = []
        replies: dict[str, ParticipantReply] = {}
        attempts: dict[str, int] = {}
        await self._release_dangling(deadline_ts)
        try:
            attempted += models
            await self._step(models, replies, lambda s: s.client.model.pause(checkpoint_id, deadline_ts))
            agents = self.pausing(AGENTS)
            attempted += agents
            await self._step(agents, replies, lambda s: self._agent_prepare(s, checkpoint_id, deadline_ts, attempts))
            resources = self.pausing(RESOURCES)
            attempted += resources
            await self._step(resources, replies, lambda s: s.client.resources.prepare(checkpoint_id, deadline_ts))
            draining = [s for s in models if not _model_ready(replies[s.server_name].reply)]
            await self._step(draining, replies, lambda s: self._wait_paused(s, checkpoint_id, deadline_ts),
                             add_seconds=True)
        except BaseException as exc:
            if hold_when_unacknowledged and isinstance(exc, UnacknowledgedResults):
                raise  # everyone called stays paused under checkpoint_id: the caller acknowledges, or aborts
            resume_deadline = max(deadline_ts, time.time() + self.control_timeout_s)
            resumed, failures = await self._resume(attempted, checkpoint_id, resume_deadline, tolerate=ALREADY_ENDED)
            done = {r.server_name for r in resumed}
            self._dangling.update({s.server_name: checkpoint_id for s in attempted if s.server_name not in done})
            if failures and isinstance(exc, ControlCallError):
                raise _with_note(exc, f"; resuming the participants called also failed: {'; '.join(failures)}") \
                    from exc
            raise
        order = [s for c in PREPARE_ORDER for s in self.pausing(c)]
        return PrepareResult(checkpoint_id=checkpoint_id, participants=[replies[s.server_name] for s in order],
                             agent_prepare_attempts=attempts)

    async def _agent_prepare(self, s: Server, checkpoint_id: str, deadline_ts: float,
                             attempts: dict[str, int]) -> AgentStatus:
        while True:
            attempts[s.server_name] = attempts.get(s.server_name, 0) + 1
            try:
                status = await s.client.agent.prepare(checkpoint_id, deadline_ts)
            except ControlCallError as exc:
                if exc.status != 409 or exc.code != "agent_prepare_incomplete":
                    raise
                left = deadline_ts - time.time()
                if left <= 0:
                    raise _with_note(exc, f" (not ready by the deadline after {attempts[s.server_name]} "
                                          f"prepare calls)") from None
                # NeMo-RL re-sends until the deadline. When nothing is running any more, only the
                # caller can clear what blocks (acknowledge the completed results, retire what parked
                # without a boundary): waiting would only spend the deadline, so fail now and say why.
                blocked = await s.client.agent.status(checkpoint_id)
                if blocked.running == 0 and (blocked.completed_unacknowledged or blocked.parked_without_boundary):
                    noted = _with_note(exc, f" ({blocked.completed_unacknowledged} completed result(s) not yet "
                                            f"acknowledged, {blocked.parked_without_boundary} parked without a "
                                            "boundary; nothing left running)")
                    if blocked.parked_without_boundary:
                        raise noted from None
                    raise UnacknowledgedResults(noted, blocked.completed_unacknowledged_attempts) from None
                await asyncio.sleep(min(AGENT_PREPARE_RETRY_S, left))
                continue
            if not status.ready_to_commit:
                raise s.error("agent-checkpoint/prepare", "answered 200 without ready_to_commit", "bad_answer")
            return status

    async def _wait_paused(self, s: Server, checkpoint_id: str, deadline_ts: float) -> Any:
        left = deadline_ts - time.time()
        if left <= 0:
            raise s.error("model-admission/status", "still draining at the prepare deadline", "not_ready")
        status = await s.client.model.status(checkpoint_id, deadline_ts, wait_state="paused", timeout_s=left)
        if not _model_ready(status):
            raise s.error("model-admission/status", f"still {status.state!r} with {status.inflight_total} call(s) in "
                                                    f"flight at the prepare deadline", "not_ready")
        return status

    async def commit(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> CommitResult:
        """Agents, then the policy model (given every agent's continuation index), then resources
        (or resources alongside: :attr:`commit_order`), each writing its files into ``checkpoint_dir``."""
        replies: dict[str, ParticipantReply] = {}
        agents = self.exporting(AGENTS)

        async def agents_then_model() -> None:
            await self._step(agents, replies,
                             lambda s: s.client.agent.commit(checkpoint_id, deadline_ts, checkpoint_dir))
            indexes = [replies[s.server_name].reply.continuation_index for s in agents]
            await self._step(self.exporting(MODELS), replies,
                             lambda s: s.client.model.commit(checkpoint_id, deadline_ts, checkpoint_dir, indexes))

        def resources() -> Awaitable[None]:
            return self._step(self.exporting(RESOURCES), replies,
                              lambda s: s.client.resources.commit(checkpoint_id, deadline_ts, checkpoint_dir))

        if self.commit_order == "resources_alongside":
            await _all([agents_then_model(), resources()])
        else:
            await agents_then_model()
            await resources()
        order = [s for c in COMMIT_ORDER for s in self.exporting(c)]
        return CommitResult(checkpoint_id=checkpoint_id, checkpoint_dir=checkpoint_dir,
                            participants=[replies[s.server_name] for s in order])

    async def restore(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str,
                      source_checkpoint_id: str | None = None) -> RestoreResult:
        """Models, then agents, then resources (or all at once: :attr:`restore_order`) load their files
        from ``checkpoint_dir`` and stay paused. With ``source_checkpoint_id`` each must report that it
        restored that checkpoint."""
        replies: dict[str, ParticipantReply] = {}

        def checked(s: Server, step: str, call: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
            async def run() -> Any:
                reply = await call()
                source = reply.checkpoint_id if isinstance(reply, ModelRestoreResponse) else reply.source_checkpoint_id
                if source_checkpoint_id is not None and source != source_checkpoint_id:
                    raise s.error(step, f"restored checkpoint {source!r}, expected {source_checkpoint_id!r}",
                                  "bad_answer")
                return reply
            return run()

        steps = [
            lambda: self._step(self.exporting(MODELS), replies, lambda s: checked(
                s, "model-checkpoint/restore",
                lambda: s.client.model.restore(checkpoint_id, deadline_ts, checkpoint_dir))),
            lambda: self._step(self.exporting(AGENTS), replies, lambda s: checked(
                s, "agent-checkpoint/restore",
                lambda: s.client.agent.restore(checkpoint_id, deadline_ts, checkpoint_dir))),
            lambda: self._step(self.exporting(RESOURCES), replies, lambda s: checked(
                s, "resources-checkpoint/restore",
                lambda: s.client.resources.restore(checkpoint_id, deadline_ts, checkpoint_dir))),
        ]
        if self.restore_order == "concurrent":
            await _all(step() for step in steps)
        else:
            for step in steps:
                await step()
        order = [s for c in RESTORE_ORDER for s in self.exporting(c)]
        return RestoreResult(checkpoint_id=checkpoint_id, checkpoint_dir=checkpoint_dir,
                             participants=[replies[s.server_name] for s in order])

    async def discard_restored_agent_continuations(self, checkpoint_id: str, deadline_ts: float,
                                                   executions: Iterable[Any]) -> DiscardResult:
        """``discard-restored-continuation`` on every export_restore agent for every execution
        (``{rollout_id, attempt_index}`` of the replacement attempt, or such a pair)."""
        pairs = [_attempt(e) for e in executions]
        if len(pairs) != len(set(pairs)):
            raise ValueError("restored Gym continuations to discard must be unique")
        agents = self.exporting(AGENTS)

        async def per_agent(s: Server) -> list[DiscardReply]:
            out = []
            for rid, n in pairs:
                r = await s.client.agent.discard_restored_continuation(checkpoint_id, deadline_ts, rid, n)
                out.append(DiscardReply(name=s.name, server_name=s.server_name, rollout_id=rid, attempt_index=n,
                                        discarded=r.discarded))
            return out

        replies = [r for batch in await _all(per_agent(s) for s in agents) for r in batch]
        return DiscardResult(checkpoint_id=checkpoint_id, executions=len(pairs), agent_participants=len(agents),
                             discarded=sum(r.discarded for r in replies), replies=replies)

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> StepResult:
        """Resources, then models, then agents; every participant is asked, then the first failure raised."""
        replies, failures = await self._resume(self._pausing_all(), checkpoint_id, deadline_ts, tolerate=(),
                                               keep_errors=True)
        if failures:
            first = failures[0]
            raise _with_note(first, f" (resume failures: {len(failures)}: "
                                    f"{'; '.join(str(f) for f in failures)})") from None
        return StepResult(checkpoint_id=checkpoint_id, participants=replies)

    async def abort(self, checkpoint_id: str, deadline_ts: float) -> AbortResult:
        """The resume calls, whatever each answers; returns the answers and the failures (a server that
        never began or already ended, ``invalid_phase``/``stale_checkpoint``, is not one)."""
        replies, failures = await self._resume(self._pausing_all(), checkpoint_id, deadline_ts, tolerate=ALREADY_ENDED)
        return AbortResult(checkpoint_id=checkpoint_id, participants=replies, failures=failures)

    def _pausing_all(self) -> list[Server]:
        return [s for c in PREPARE_ORDER for s in self.pausing(c)]

    async def _release_dangling(self, deadline_ts: float) -> None:
        """Resume, under its own id, every participant a failed prepare left behind (it may have
        finished preparing since, and would refuse every new id with ``checkpoint_conflict``). It is
        released once it answers, or once that id is no longer the one it holds active."""
        for name, old_id in list(self._dangling.items()):
            server = next((s for s in self.servers if s.server_name == name), None)
            if server is None:
                del self._dangling[name]
                continue
            resumed, _ = await self._resume([server], old_id, max(deadline_ts, time.time() + 1.0), tolerate=(),
                                            keep_errors=True)
            if resumed:
                del self._dangling[name]
                continue
            try:
                caps = await server.client.capabilities()
            except ControlCallError:
                continue  # unreachable: still listed
            if caps.active_checkpoint_id != old_id:
                del self._dangling[name]

    async def _resume(self, servers: Sequence[Server], checkpoint_id: str, deadline_ts: float,
                      tolerate: tuple[str, ...], keep_errors: bool = False) -> tuple[list[ParticipantReply], list[Any]]:
        """Resume ``servers`` in the resume order, every one asked; the replies, and the failures
        (messages, or the errors themselves with ``keep_errors``)."""
        replies: list[ParticipantReply] = []
        failures: list[Any] = []
        calls = {MODELS: lambda s: s.client.model.resume(checkpoint_id, deadline_ts),
                 AGENTS: lambda s: s.client.agent.resume(checkpoint_id, deadline_ts),
                 RESOURCES: lambda s: s.client.resources.resume(checkpoint_id, deadline_ts)}
        async def one(s: Server) -> None:
            t0 = time.perf_counter()
            try:
                reply = await calls[s.component](s)
            except ControlCallError as exc:
                if exc.code not in tolerate:
                    failures.append(exc if keep_errors else str(exc))
                return
            replies.append(_reply(s, reply, time.perf_counter() - t0))

        for component in RESUME_ORDER:
            await asyncio.gather(*(one(s) for s in servers if s.component == component))
        return replies, failures

    async def _step(self, servers: Sequence[Server], replies: dict[str, ParticipantReply],
                    call: Callable[[Server], Awaitable[Any]], add_seconds: bool = False) -> None:
        """Call every server of one step at once, recording each reply under its server name."""
        async def one(s: Server) -> None:
            t0 = time.perf_counter()
            reply = await call(s)
            seconds = time.perf_counter() - t0
            if add_seconds and s.server_name in replies:
                seconds += replies[s.server_name].seconds
            replies[s.server_name] = _reply(s, reply, seconds)

        await _all(one(s) for s in servers)


# -- helpers -------------------------------------------------------------------------------------------------
def _reply(s: Server, reply: Any, seconds: float) -> ParticipantReply:
    return ParticipantReply(component=s.component, name=s.name, server_name=s.server_name, reply=reply,
                            seconds=round(seconds, 6))


def _model_ready(reply: Any) -> bool:
    workers = getattr(reply, "workers", None)
    return (reply.state == "paused" and reply.inflight_total == 0
            and (workers is None or workers.acknowledged == workers.expected))


def _attempt(e: Any) -> tuple[str, int]:
    if isinstance(e, Mapping):
        return str(e["rollout_id"]), int(e["attempt_index"])
    if isinstance(e, tuple | list):
        return str(e[0]), int(e[1])
    return str(e.rollout_id), int(e.attempt_index)


def _with_note(exc: ControlCallError, note: str) -> ControlCallError:
    """The same failure (status, code, detail, server) with ``note`` added to its message."""
    return ControlCallError(f"{exc}{note}", component=exc.component, name=exc.name, status=exc.status, code=exc.code,
                            detail=exc.detail, step=exc.step)


def _contract_key(c: Mapping[str, Any]) -> tuple[str, str, str]:
    p = c["participant"]
    return p["component"], p["server_name"], p["participant_name"]


def _check_topology(servers: Sequence[Server]) -> None:
    """NeMo-RL's refusals (module docstring)."""
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    for s in servers:
        caps, where = s.caps, f"Gym server {s.server_name!r} ({s.client.url})"
        if s.server_name != caps.name:
            raise _fleet_error("topology", f"{where} reports the name {caps.name!r}: its server name must be its "
                                           "capability name (Gym's files live under it)")
        if caps.component == MODELS and caps.instance_role is None:
            raise _fleet_error("topology", f"{where}: a model must declare its instance_role (policy or auxiliary)")
        if caps.component != MODELS and caps.instance_role is not None:
            raise _fleet_error("topology", f"{where}: a {caps.component} server must not declare an instance_role "
                                           f"(it declares {caps.instance_role!r})")
        if caps.multi_process.mode == "unmanaged":
            raise _fleet_error("topology", f"{where} runs {caps.multi_process.num_workers} unmanaged workers")
        key = (caps.component, caps.name)
        if key in seen or s.server_name in names:
            raise _fleet_error("topology", f"two Gym servers share the participant {key} or the server name "
                                           f"{s.server_name!r}")
        seen.add(key)
        names.add(s.server_name)
    if not any(s.policy for s in servers):
        raise _fleet_error("topology", "the Gym topology has no policy model")
    restart_only = any(s.component == RESOURCES and s.caps.checkpoint_mode == "restart_only" for s in servers)
    missing: list[str] = []
    for s in servers:
        if not s.exports:
            continue
        need: tuple[str, ...] = ()
        if s.component == AGENTS:
            need = (FEATURE_COMPLETED_RESULT_ACK, FEATURE_CONTINUATION_INDEX)
            if restart_only:
                need += (FEATURE_DISCARD_RESTORED, FEATURE_RESOURCE_DEPENDENCY_INDEX)
        elif s.policy:
            need = (FEATURE_STORAGE_REFERENCE_INDEX,)
        missing += [f"{s.server_name}: {f}" for f in need if f not in s.caps.features]
    if missing:
        raise _fleet_error("topology", f"export_restore participants lack required features: {', '.join(missing)}")


__all__ = [
    "AbortResult", "AcknowledgeResult", "CommitResult", "CompletedExecution", "DiscardReply", "DiscardResult",
    "GymFleet", "ManifestRef", "ParticipantReply", "PrepareResult", "RestoreResult", "Server", "StepResult",
    "Topology", "participant_dir",
]
