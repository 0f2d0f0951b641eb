"""The Checkpointer on its seams alone: a scripted Gym, an in-memory data plane, a store in a temporary
folder, mocks for the controller's two acknowledgement calls. No Ray, no Gym server, no controller.

What the real parts do together (real Gym servers, TransferQueue, SIGKILL at each boundary) is
tested in tests/coordinator/test_controller.py and test_kill_points.py; here, what the Checkpointer
promises: the steps in order, each timed; Gym's files adopted as the snapshot's Gym parts (and
checked against Gym's own manifests first); outcomes instead of exceptions for a failed save; the
failure rule; a restore that hands the bookkeeping back instead of setting it anywhere, with every
unfinished run as its run n + 1 and exactly the continuations on a restart-only server discarded.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import msgspec
import pytest

from coordinator.bookkeeping import Bookkeeping
from coordinator.checkpoint import Checkpointer, RestoreOutcome, SaveOutcome, Seams
from coordinator.checkpoint.outcomes import Continued
from coordinator.config import ControllerConfig
from coordinator.dataplane import InMemoryDataPlane
from coordinator.errors import GymCallError, RestoreError, TooManyFailuresError
from coordinator.faults import RESTORE_STEPS, SAVE_STEPS, Steps
from coordinator.samples import TOKEN_PARTITION, TRAIN_PARTITION, RolloutResult, TurnResult, put_results
from coordinator.workload import Workload
from gymkit.checkpoint_dir import (
    continuation_roots,
    read_agent_dir,
    read_ledger_dir,
    write_agent_dir,
    write_ledger_dir,
    write_resources_dir,
)
from gymkit.gym_fleet import (
    AbortResult,
    CommitResult,
    DiscardReply,
    DiscardResult,
    ParticipantReply,
    PrepareResult,
    RestoreResult,
    StepResult,
    Topology,
)
from schemas.control import (
    AgentCommitResponse,
    AgentRestoreResponse,
    Capabilities,
    ModelCommitResponse,
    ModelRestoreResponse,
    MultiProcess,
    ResourcesCommitResponse,
    ResourcesRestoreResponse,
)
from schemas.errors import TopologyMismatchError
from schemas.gym_files import AgentBoundaryRecord, ResourceSnapshot, agent_instance_dir
from schemas.gym_records import AgentContinuationRoot
from schemas.topology import manifest_fingerprint, topology_fingerprint
from snapformat import SnapshotStore, verify_snapshot

WL = Workload(prompts=2, group_size=2, min_turns=1, max_turns=3, seed=9, sandbox_every=2)
MODELS, AGENTS, RESOURCES = "responses_api_models", "responses_api_agents", "resources_servers"
SINGLE = MultiProcess(mode="single_worker")
#: The reference deployment's four servers: the policy model, one agent, the exported resources
#: server ``tools`` and the restart-only ``sandbox``.
CAPABILITIES = [
    Capabilities(component=MODELS, name="policy0", instance_role="policy", checkpoint_mode="export_restore",
                 admission_states=["accepting", "draining", "paused"], multi_process=SINGLE),
    Capabilities(component=AGENTS, name="agent0", checkpoint_mode="export_restore", multi_process=SINGLE),
    Capabilities(component=RESOURCES, name="tools", checkpoint_mode="export_restore", multi_process=SINGLE),
    Capabilities(component=RESOURCES, name="sandbox", checkpoint_mode="restart_only", multi_process=SINGLE),
]
_CONTRACTS = [c.contract() for c in CAPABILITIES]
TOPOLOGY = Topology(participants=_CONTRACTS, fingerprint=topology_fingerprint(_CONTRACTS))
FINGERPRINT = manifest_fingerprint(TOPOLOGY.fingerprint)
AGENT_PREFIX = f"gym/{agent_instance_dir('agent0')}"
GYM_PREFIXES = [AGENT_PREFIX, "gym/model-ledger/policy0", "gym/resources/tools"]


def parked(rollout_id: str, *, after_call: str | None = "call-0", sandbox: bool = False) -> AgentBoundaryRecord:
    """An execution parked at a boundary (run 0), after ``after_call``, depending on ``tools`` (and
    on the restart-only ``sandbox`` if asked)."""
    revisions = {"tools": 1, **({"sandbox": 1} if sandbox else {})}
    return AgentBoundaryRecord(rollout_id=rollout_id, attempt_index=0, boundary_index=int(after_call is not None),
                               last_committed_model_call_id=after_call, resource_state_revisions=revisions,
                               agent_state={"turns_done": int(after_call is not None)})


def _reply(component: str, name: str, reply: Any) -> ParticipantReply:
    return ParticipantReply(component=component, name=name, server_name=name, reply=reply, seconds=0.0)


class FakeGym:
    """Gym's checkpoint calls (the :class:`~coordinator.checkpoint.GymControl` seam: the NemoGym
    actor's names, arguments and typed results), scripted. Each call is recorded; those named in
    ``fail`` answer a 500. Its commit writes Gym's own files into ``checkpoint_dir`` as the
    reference participants do (the agent's archives, index and continuation index for the
    executions ``parked``, the policy model's ledger, the ``tools`` sessions), since the publisher
    adopts and checks them; its restore reads the agent's files back from the ``checkpoint_dir``
    it is handed, every digest checked."""

    def __init__(self, *, fail: tuple[str, ...] = (), parked: list[AgentBoundaryRecord] | None = None,
                 roots: list[AgentContinuationRoot] | None = None, tamper: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = set(fail)
        self.parked = sorted(parked or [], key=lambda r: (r.rollout_id, r.attempt_index))
        self.roots = roots  # the agent's continuation index, if not the records' own
        self.tamper = tamper  # a file of the agent's folder changed after its commit wrote the manifest
        self.commit: CommitResult | None = None
        self.restored: dict[str, Any] = {}  # what the restore was given and found
        self.discarded: list[dict[str, Any]] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise GymCallError(f"{name} of agent a0: 500", component=AGENTS, name="a0", status=500)

    def prepare_checkpoint(self, checkpoint_id: str, deadline_ts: float, *,
                           hold_when_unacknowledged: bool = False) -> PrepareResult:
        self._call("prepare")
        return PrepareResult(checkpoint_id=checkpoint_id, participants=[])

    def commit_checkpoint(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str) -> CommitResult:
        self._call("commit")
        agent, agent_digest = write_agent_dir(checkpoint_dir, checkpoint_id, "agent0", self.parked, self.roots)
        roots = continuation_roots(self.parked) if self.roots is None else self.roots
        if self.tamper is not None:
            victim = Path(checkpoint_dir) / agent_instance_dir("agent0") / self.tamper
            victim.write_bytes(victim.read_bytes() + b"\n")
        ledger, ledger_digest = write_ledger_dir(checkpoint_dir, checkpoint_id, "policy0", lineages={},
                                                 storage_references=[], roots=roots)
        sessions = [ResourceSnapshot(rollout_id=r.rollout_id, attempt_index=r.attempt_index, state_revision=1,
                                     state={"values": [1]}) for r in self.parked]
        _, tools_digest = write_resources_dir(checkpoint_dir, checkpoint_id, "tools", sessions)
        self.commit = CommitResult(checkpoint_id=checkpoint_id, checkpoint_dir=checkpoint_dir, participants=[
            _reply(AGENTS, "agent0", AgentCommitResponse(records=agent.records, manifest_digest=agent_digest,
                                                          continuation_index=agent.continuation_index)),
            _reply(MODELS, "policy0", ModelCommitResponse(rollouts=0, rows=0, excluded_tombstoned=0,
                                                          excluded_inactive=0, manifest_digest=ledger_digest,
                                                          storage_reference_index=ledger.storage_reference_index)),
            _reply(RESOURCES, "tools", ResourcesCommitResponse(sessions=len(sessions), manifest_digest=tools_digest)),
        ])
        return self.commit

    def resume_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> StepResult:
        self._call("resume")
        return StepResult(checkpoint_id=checkpoint_id, participants=[])

    def abort_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> AbortResult:
        self._call("abort")
        return AbortResult(checkpoint_id=checkpoint_id, participants=[])

    def restore_checkpoint(self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str,
                           source_checkpoint_id: str | None = None) -> RestoreResult:
        self._call("restore")
        manifest, records, _ = read_agent_dir(Path(checkpoint_dir) / agent_instance_dir("agent0"))
        self.restored = {"checkpoint_id": checkpoint_id, "checkpoint_dir": checkpoint_dir,
                         "source_checkpoint_id": source_checkpoint_id, "records": records}
        ledger, _, _ = read_ledger_dir(Path(checkpoint_dir) / "model-ledger" / "policy0")
        source = manifest.checkpoint_id
        return RestoreResult(checkpoint_id=checkpoint_id, checkpoint_dir=checkpoint_dir, participants=[
            _reply(MODELS, "policy0", ModelRestoreResponse(rollouts=0, rows=0, checkpoint_id=source, tombstones=[],
                                                           source_attempts=[],
                                                           storage_reference_index=ledger.storage_reference_index)),
            _reply(AGENTS, "agent0", AgentRestoreResponse(records=len(records), source_checkpoint_id=source,
                                                          continuation_index=manifest.continuation_index)),
            _reply(RESOURCES, "tools", ResourcesRestoreResponse(sessions=len(records), source_checkpoint_id=source)),
        ])

    def discard_restored_agent_continuations(self, checkpoint_id: str, deadline_ts: float,
                                             executions: list[dict[str, Any]]) -> DiscardResult:
        self._call("discard")
        self.discarded = list(executions)
        replies = [DiscardReply(name="agent0", server_name="agent0", rollout_id=e["rollout_id"],
                                attempt_index=e["attempt_index"], discarded=True) for e in executions]
        return DiscardResult(checkpoint_id=checkpoint_id, executions=len(executions), agent_participants=1,
                             discarded=len(replies), replies=replies)


class Recorder(Steps):
    """The kill-point hooks, recording the order the boundaries are reached in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def reached(self, step: str) -> None:
        self.order.append(step)
        super().reached(step)


def make(tmp_path: Path, gym: FakeGym, plane: InMemoryDataPlane | None = None, store: Any = None,
         max_consecutive_failures: int = 3, **config: Any) -> Checkpointer:
    """A Checkpointer on fakes; the controller's acknowledgement calls are mocks."""
    cfg = ControllerConfig(**config).with_rollout_checkpointing(max_consecutive_failures=max_consecutive_failures)
    return Checkpointer(Seams(
        gym=gym, store=store or SnapshotStore(str(tmp_path / "store")),
        plane=plane or InMemoryDataPlane({TOKEN_PARTITION}), config=cfg, steps=Recorder(),
        store_and_acknowledge=Mock(), acknowledge=Mock()))


def running_books(plane: InMemoryDataPlane) -> Bookkeeping:
    """Both groups dispatched; rollout p0_g0 finished and stored (its rows in ``plane``), its ACK owed."""
    books = Bookkeeping.fresh(WL)
    while specs := books.reserve_next():
        books.dispatched([s.rollout_id for s in specs])
    result = RolloutResult(rollout_id="p0_g0", attempt_index=0, capture_key="p0_g0", outcome="finished",
                           trajectory=[TurnResult("call-0", [100, 101], [-0.5, -0.25])], turn_keys=["p0_g0"],
                           input_ids=[5, 6, 7, 100, 101], prompt_lens=[3])
    (key,) = put_results(plane, [result], {"p0_g0": "p0"})
    books.sealed("p0_g0", 0, key, TRAIN_PARTITION)
    return books


STEPS_TIMED = {"flush_acks", "prepare", "gym_commit", "gym_adopt", "cut_wait", "cut", "resume", "write", "publish"}


def open_runs(books: Bookkeeping) -> list[str]:
    return sorted(a.rollout_id for a in books.open_attempts())


def check_gym_parts(snap: Any, gym: FakeGym) -> None:
    """Gym's files are the snapshot's Gym parts: one per participant that wrote a folder, in commit
    order, each reply kept verbatim, every file in the part manifest with its checksum."""
    commit = snap.manifest.gym_commit
    assert gym.commit is not None and commit.checkpoint_id == gym.commit.checkpoint_id
    assert [(p.component, p.name, p.part_prefix) for p in commit.participants] == [
        (AGENTS, "agent0", GYM_PREFIXES[0]), (MODELS, "policy0", GYM_PREFIXES[1]), (RESOURCES, "tools", GYM_PREFIXES[2])]
    assert [p.payload for p in commit.participants] == [msgspec.to_builtins(p.reply) for p in gym.commit.participants]
    for p in commit.participants:
        listed = {e.path: e.kind for e in snap.files() if e.path.startswith(p.part_prefix + "/")}
        on_disk = {f"{p.part_prefix}/{f.name}" for f in (Path(snap.url) / p.part_prefix).iterdir()}
        assert listed == {path: "part_manifest" if path.endswith("/part-manifest.json") else "gym_file"
                          for path in on_disk}  # every file Gym wrote, listed as a gym_file
        assert f"{p.part_prefix}/manifest.json" in listed
        manifest = Path(snap.url) / p.part_prefix / "manifest.json"
        assert hashlib.sha256(manifest.read_bytes()).hexdigest() == p.payload["manifest_digest"]


def test_an_in_pause_save_publishes_before_the_resume(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    gym = FakeGym()
    ckpt = make(tmp_path, gym, plane, write_mode="in_pause")
    outcome = ckpt.save(running_books(plane), FINGERPRINT)
    assert outcome.status == "published" and outcome.gym_resumed and outcome.cause is None
    report = outcome.report
    assert report.ok and report.published and report.error is None and report.mode == "in_pause"
    assert set(report.steps_s) == STEPS_TIMED and report.pause_s > 0
    assert report.rows == {"training_rows": 1, "token_capture_rows": 1} and report.cut_bytes > 0
    assert gym.calls == ["prepare", "commit", "resume"]
    assert ckpt.seams.steps.order == [*SAVE_STEPS[:5], "save.gym_adopted", "save.written", "save.published",
                                      "save.resumed"]
    ckpt.seams.store_and_acknowledge.assert_called_once_with()
    snap = ckpt.seams.store.latest()
    assert snap.sequence == report.sequence and snap.url == report.snapshot_url and verify_snapshot(snap).ok
    assert snap.manifest.topology_fingerprint == FINGERPRINT
    assert set(snap.manifest.timings_s) == {"flush_acks_s", "prepare_s", "gym_commit_s", "gym_adopt_s", "cut_wait_s",
                                            "cut_s", "write_s", "pause_until_publish_s"}
    check_gym_parts(snap, gym)
    assert ckpt.reports() == [report] and ckpt.wait_for_write() is None


def test_a_background_save_resumes_first_and_its_write_reports_later(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    ckpt = make(tmp_path, FakeGym(), plane)
    outcome = ckpt.save(running_books(plane), FINGERPRINT)
    assert outcome.status == "writing" and not outcome.report.ok and not outcome.report.published
    assert "write" not in outcome.report.steps_s and "resume" in outcome.report.steps_s
    written = ckpt.wait_for_write()
    assert written is not None and written.status == "published"
    report = written.report
    assert report.checkpoint_id == outcome.report.checkpoint_id and report.ok and report.published
    assert set(report.steps_s) == STEPS_TIMED and report.pause_s == outcome.report.pause_s
    assert report.pause_s < sum(report.steps_s.values())  # the write came after the pause
    assert ckpt.seams.steps.order == list(SAVE_STEPS)
    timings = ckpt.seams.store.latest().manifest.timings_s
    assert "pause_s" in timings and "pause_until_publish_s" not in timings
    assert ckpt.reports() == [report]
    assert outcome.report.steps_s != report.steps_s  # the first report is a copy: the write did not change it


def test_a_failed_save_is_an_outcome_and_too_many_in_a_row_stop_the_run(tmp_path: Path) -> None:
    gym = FakeGym(fail=("commit",))
    ckpt = make(tmp_path, gym, max_consecutive_failures=2)
    books = Bookkeeping.fresh(WL)
    first = ckpt.save(books, FINGERPRINT)
    assert first.status == "aborted" and not first.report.published
    assert isinstance(first.cause, GymCallError) and first.report.error == "GymCallError: commit of agent a0: 500"
    assert gym.calls == ["prepare", "commit", "abort"] and ckpt.seams.store.list() == []
    assert {"flush_acks", "prepare"} <= set(first.report.steps_s) and first.report.pause_s > 0
    ckpt.raise_if_failing()  # one failure: the run goes on
    second = ckpt.save(books, FINGERPRINT)
    assert second.status == "aborted" and ckpt.reports() == [first.report, second.report]
    with pytest.raises(TooManyFailuresError, match=r"2 consecutive save attempts failed .*commit of agent a0"):
        ckpt.raise_if_failing()
    with pytest.raises(TooManyFailuresError):
        ckpt.save(books, FINGERPRINT)
    assert gym.calls.count("prepare") == 2  # the third attempt never began


def test_a_published_save_resets_the_failure_count(tmp_path: Path) -> None:
    gym = FakeGym(fail=("prepare",))
    ckpt = make(tmp_path, gym, max_consecutive_failures=2, write_mode="in_pause")
    books = Bookkeeping.fresh(WL)
    assert ckpt.save(books, FINGERPRINT).status == "aborted"
    gym.fail.clear()
    assert ckpt.save(books, FINGERPRINT).status == "published"
    gym.fail.add("prepare")
    assert ckpt.save(books, FINGERPRINT).status == "aborted"
    ckpt.raise_if_failing()  # not two in a row


def test_a_failed_resume_after_the_commit_keeps_the_snapshot_and_says_gym_is_not_resumed(tmp_path: Path) -> None:
    ckpt = make(tmp_path, FakeGym(fail=("resume",)), write_mode="in_pause")
    outcome = ckpt.save(Bookkeeping.fresh(WL), FINGERPRINT)
    assert outcome.status == "published" and outcome.report.published and not outcome.gym_resumed
    assert "save.resumed" in ckpt.seams.steps.order  # the boundary is reached: the snapshot stands


def test_a_failed_background_write_publishes_nothing_and_counts_as_a_failure(tmp_path: Path) -> None:
    real = SnapshotStore(str(tmp_path / "store"))
    drafts: list[Any] = []

    def begin() -> Any:  # a draft whose parts are written and whose publish fails
        draft = real.begin()

        def publish(**_: Any) -> None:
            assert Path(draft.url).exists()  # the parts were written
            raise OSError(28, "No space left on device")

        draft.publish = publish
        drafts.append(draft)
        return draft

    store = Mock(wraps=real)
    store.begin.side_effect = begin
    ckpt = make(tmp_path, FakeGym(), store=store, max_consecutive_failures=1)
    outcome = ckpt.save(Bookkeeping.fresh(WL), FINGERPRINT)
    assert outcome.status == "writing"
    written = ckpt.wait_for_write()
    assert written.status == "aborted" and isinstance(written.cause, OSError)
    assert "No space left" in written.report.error and not written.report.published
    assert "write" in written.report.steps_s and "publish" not in written.report.steps_s
    assert real.list() == [] and "save.published" not in ckpt.seams.steps.order
    (draft,) = drafts
    assert not Path(draft.url).exists()  # abandoned
    with pytest.raises(TooManyFailuresError):
        ckpt.raise_if_failing()


def saved_snapshot(tmp_path: Path, records: list[AgentBoundaryRecord] | None = None, **gym: Any
                   ) -> tuple[Bookkeeping, SaveOutcome, FakeGym]:
    """Books of :func:`running_books`, saved (in the pause) by a Gym whose agent parked ``records``
    (default: every open run after ``call-0``, the first of them depending on ``sandbox``)."""
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    books = running_books(plane)
    runs = open_runs(books)
    if records is None:
        records = [parked(r, sandbox=r == runs[0]) for r in runs]
    saving = FakeGym(parked=records, **gym)
    saved = make(tmp_path, saving, plane, write_mode="in_pause").save(books, FINGERPRINT)
    assert saved.status == "published", saved.report.error
    return books, saved, saving


def test_a_restore_hands_back_the_bookkeeping_and_sets_nothing(tmp_path: Path) -> None:
    books, saved, saving = saved_snapshot(tmp_path)
    runs = open_runs(books)
    gym = FakeGym()
    fresh_plane = InMemoryDataPlane({TOKEN_PARTITION})
    ckpt = make(tmp_path, gym, fresh_plane)
    outcome = ckpt.restore(WL, TOPOLOGY)
    assert isinstance(outcome, RestoreOutcome)
    report = outcome.report
    assert report.sequence == saved.report.sequence and report.snapshot_url == saved.report.snapshot_url
    assert report.skipped == [] and report.rows == {"training_rows": 1, "token_capture_rows": 1}
    assert set(report.steps_s) == {"gym_files", "load_data_plane", "gym_restore", "discard", "resume"}
    assert [(c.rollout_id, c.attempt_index, c.after_call, c.discarded) for c in report.continued] == \
        [(r, 1, "call-0", r == runs[0]) for r in runs]
    assert gym.calls == ["restore", "discard", "resume"]
    # Gym restores from the snapshot's own gym/ folder (a local store), told which checkpoint it holds,
    # and finds there exactly what it committed.
    assert gym.restored["source_checkpoint_id"] == saved.report.checkpoint_id
    assert gym.restored["checkpoint_dir"] == str(Path(saved.report.snapshot_url) / "gym")
    assert gym.restored["records"] == saving.parked
    assert ckpt.seams.steps.order == list(RESTORE_STEPS)
    restored = outcome.books
    assert restored is not books and {r: (restored.attempts[r].attempt_index, restored.attempts[r].state)
                                      for r in runs} == dict.fromkeys(runs, (1, "reserved"))  # sent again by the loop
    assert restored.attempts["p0_g0"].state == "sealed" and report.acks_resent == 1
    ckpt.seams.acknowledge.assert_called_once_with(restored)  # the ACK owed, re-sent from the restored books
    assert fresh_plane.get(TRAIN_PARTITION, "p0_g0")["input_lengths"] == 5
    assert {a.attempt_index for a in books.open_attempts()} == {0}  # the saved books are untouched


@pytest.mark.parametrize("unknown_dependencies", [False, True])
def test_a_restore_discards_exactly_the_continuations_that_depend_on_a_restart_only_server(
        tmp_path: Path, unknown_dependencies: bool) -> None:
    """NeMo-RL's rule: a continuation (an execution parked after a model call) that depends on a
    restart-only resources server, or whose dependencies the agent's index does not say (an index
    written before dependency tracking), is discarded and starts over as run n + 1; the others
    continue after their boundary. One parked before its first model call has no continuation to
    discard (it starts over anyway)."""
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    runs = open_runs(running_books(plane))
    records = [parked(runs[0], sandbox=True), parked(runs[1]), parked(runs[2], after_call=None, sandbox=True)]
    roots = continuation_roots(records)
    if unknown_dependencies:  # the index does not say what runs[1] depends on
        roots = [msgspec.structs.replace(r, resource_state_revisions=None) if r.rollout_id == runs[1] else r
                 for r in roots]
    saved_snapshot(tmp_path, records, roots=roots)
    gym = FakeGym()
    outcome = make(tmp_path, gym).restore(WL, TOPOLOGY)
    assert outcome is not None
    assert sorted(outcome.report.continued, key=lambda c: c.rollout_id) == [
        Continued(rollout_id=runs[0], attempt_index=1, after_call="call-0", restart_only=["sandbox"], discarded=True),
        Continued(rollout_id=runs[1], attempt_index=1, after_call="call-0",
                  restart_only=["sandbox"] if unknown_dependencies else [], discarded=unknown_dependencies),
        Continued(rollout_id=runs[2], attempt_index=1, after_call=None, restart_only=[], discarded=False),
    ]
    assert gym.discarded == [{"rollout_id": r, "attempt_index": 1}
                             for r in runs[:1 + unknown_dependencies]]  # the replacement runs, nothing else
    assert gym.calls == ["restore", "discard", "resume"]
    books = outcome.books
    assert {r: (books.attempts[r].attempt_index, books.attempts[r].state) for r in runs} == \
        dict.fromkeys(runs, (1, "reserved"))  # every one, discarded or not, is sent again as run 1
    assert sorted((a.rollout_id, a.attempt_index, a.state) for a in books.abandoned) == \
        [(r, 0, "abandoned") for r in runs]


def test_a_restore_without_continuations_to_discard_calls_no_discard(tmp_path: Path) -> None:
    saved_snapshot(tmp_path, [parked(r) for r in open_runs(running_books(InMemoryDataPlane()))])
    gym = FakeGym()
    outcome = make(tmp_path, gym).restore(WL, TOPOLOGY)
    assert outcome is not None and not any(c.discarded or c.restart_only for c in outcome.report.continued)
    assert gym.calls == ["restore", "resume"] and gym.discarded == []


def test_an_empty_store_restores_nothing(tmp_path: Path) -> None:
    gym = FakeGym()
    ckpt = make(tmp_path, gym)
    assert ckpt.restore(WL, TOPOLOGY) is None
    assert gym.calls == [] and ckpt.seams.steps.order == ["restore.begin"]


def test_a_restore_that_fails_before_the_resume_aborts_gym_and_clears_the_data_plane(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    runs = open_runs(running_books(plane))
    saved_snapshot(tmp_path, [parked(r, sandbox=True) for r in runs])
    fresh_plane = InMemoryDataPlane({TOKEN_PARTITION})
    gym = FakeGym(fail=("discard",))
    ckpt = make(tmp_path, gym, fresh_plane)
    with pytest.raises(RestoreError, match="failed before resume"):
        ckpt.restore(WL, TOPOLOGY)
    assert gym.calls == ["restore", "discard", "abort"] and fresh_plane.is_empty()
    ckpt.seams.acknowledge.assert_not_called()


def test_another_topology_is_refused(tmp_path: Path) -> None:
    make(tmp_path, FakeGym(), write_mode="in_pause").save(Bookkeeping.fresh(WL), FINGERPRINT)
    gym = FakeGym()
    with pytest.raises(TopologyMismatchError):
        make(tmp_path, gym).restore(WL, Topology(participants=_CONTRACTS, fingerprint="cd" * 32))
    assert gym.calls == []


@pytest.mark.parametrize("mode", ["in_pause", "background"])
def test_gym_files_that_do_not_match_their_manifest_are_never_published(tmp_path: Path, mode: str) -> None:
    """The publisher adopts Gym's files only after checking them against Gym's own manifest: a
    continuation index changed after the agent's commit fails the save, nothing is published and the
    draft is abandoned. In the pause, Gym is aborted; in the background writer (Gym already resumed),
    the write fails and counts as a failed save."""
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    books = running_books(plane)
    gym = FakeGym(parked=[parked(r) for r in open_runs(books)], tamper="continuations.jsonl")
    ckpt = make(tmp_path, gym, plane, write_mode=mode, max_consecutive_failures=1)
    outcome = ckpt.save(books, FINGERPRINT)
    if mode == "background":
        assert outcome.status == "writing" and gym.calls == ["prepare", "commit", "resume"]
        outcome = ckpt.wait_for_write()
    else:
        assert gym.calls == ["prepare", "commit", "abort"]
    assert outcome.status == "aborted" and not outcome.report.published
    error = outcome.report.error
    assert "CorruptSnapshotError" in error and "continuations.jsonl" in error and "continuation_index" in error, error
    assert "save.gym_adopted" not in ckpt.seams.steps.order and ckpt.seams.store.list() == []
    assert list((tmp_path / "store" / "snapshots").iterdir()) == []  # the draft is abandoned
    with pytest.raises(TooManyFailuresError):
        ckpt.raise_if_failing()


def test_outcomes_and_reports_are_frozen(tmp_path: Path) -> None:
    outcome = make(tmp_path, FakeGym(), write_mode="in_pause").save(Bookkeeping.fresh(WL), FINGERPRINT)
    assert isinstance(outcome, SaveOutcome)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.status = "aborted"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        outcome.report.published = False  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(outcome.report)) == msgspec.to_builtins(outcome.report)
