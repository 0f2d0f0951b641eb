"""The Checkpointer on its seams alone: a scripted Gym, an in-memory data plane, a store in a temporary
folder, mocks for the controller's two acknowledgement calls. No Ray, no Gym server, no controller.

What the real parts do together (real Gym servers, TransferQueue, SIGKILL at each boundary) is
tested in tests/coordinator/test_controller.py and test_kill_points.py; here, what the Checkpointer
promises: the steps in order, each timed; outcomes instead of exceptions for a failed save; the
failure rule; a restore that hands the bookkeeping back instead of setting it anywhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import msgspec
import pytest

from coordinator.bookkeeping import Bookkeeping
from coordinator.checkpoint import Checkpointer, RestoreOutcome, SaveOutcome, Seams
from coordinator.config import ControllerConfig
from coordinator.dataplane import InMemoryDataPlane
from coordinator.errors import GymCallError, RestoreError, TooManyFailuresError
from coordinator.faults import RESTORE_STEPS, SAVE_STEPS, Steps
from coordinator.samples import TOKEN_PARTITION, TRAIN_PARTITION, RolloutResult, TurnResult, put_results
from coordinator.workload import Workload
from gymkit.control_client import CommitResult
from schemas.errors import TopologyMismatchError
from schemas.manifest import GymCommit
from snapformat import SnapshotStore, verify_snapshot

WL = Workload(prompts=2, group_size=2, min_turns=1, max_turns=3, seed=9, sandbox_every=2)
FINGERPRINT = "sha256:" + "ab" * 32


class FakeGym:
    """Gym's checkpoint calls (the :class:`~coordinator.checkpoint.GymControl` seam), scripted: each
    call is recorded; those named in ``fail`` answer a 500."""

    def __init__(self, *, fail: tuple[str, ...] = (), restore_answer: dict[str, Any] | None = None) -> None:
        self.calls: list[str] = []
        self.fail = set(fail)
        self.restore_answer = restore_answer or {"continuations": [], "finished_unacked": []}
        self.restored_checkpoint: str | None = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise GymCallError(f"{name} of agent a0: 500", component="agent", name="a0", status=500)

    def prepare_checkpoint(self, checkpoint_id: str, deadline: float) -> None:
        self._call("prepare")

    def commit_checkpoint(self, checkpoint_id: str, deadline: float, draft_url: str) -> CommitResult:
        self._call("commit")
        return CommitResult(gym_commit=GymCommit(checkpoint_id=checkpoint_id), receipts=[], seconds={})

    def resume_checkpoint(self, checkpoint_id: str) -> None:
        self._call("resume")

    def abort_checkpoint(self, checkpoint_id: str) -> list[str]:
        self._call("abort")
        return []

    def restore_checkpoint(self, restore_id: str, deadline: float, snapshot_url: str, saved_checkpoint_id: str,
                           fingerprint: str) -> dict[str, Any]:
        self._call("restore")
        self.restored_checkpoint = saved_checkpoint_id
        return self.restore_answer

    def discard(self, restore_id: str, deadline: float, refs: list[tuple[str, int]]) -> list[str]:
        self._call("discard")
        return [rid for rid, _ in refs]


class Recorder(Steps):
    """The kill-point hooks, recording the order the boundaries are reached in."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def reached(self, step: str) -> None:
        self.order.append(step)
        super().reached(step)


def make(tmp_path: Path, gym: FakeGym, plane: InMemoryDataPlane | None = None, store: Any = None,
         **config: Any) -> Checkpointer:
    """A Checkpointer on fakes; the controller's acknowledgement calls are mocks."""
    return Checkpointer(Seams(
        gym=gym, store=store or SnapshotStore(str(tmp_path / "store")),
        plane=plane or InMemoryDataPlane({TOKEN_PARTITION}), config=ControllerConfig(**config), steps=Recorder(),
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


STEPS_TIMED = {"flush_acks", "prepare", "gym_commit", "cut_wait", "cut", "resume", "write", "publish"}


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
    assert ckpt.seams.steps.order == [*SAVE_STEPS[:5], "save.written", "save.published", "save.resumed"]
    ckpt.seams.store_and_acknowledge.assert_called_once_with()
    snap = ckpt.seams.store.latest()
    assert snap.sequence == report.sequence and snap.url == report.snapshot_url and verify_snapshot(snap).ok
    assert snap.manifest.topology_fingerprint == FINGERPRINT
    assert set(snap.manifest.timings_s) == {"flush_acks_s", "prepare_s", "gym_commit_s", "cut_wait_s", "cut_s",
                                            "write_s", "pause_until_publish_s"}
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


def test_a_restore_hands_back_the_bookkeeping_and_sets_nothing(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    books = running_books(plane)
    saved = make(tmp_path, FakeGym(), plane, write_mode="in_pause").save(books, FINGERPRINT)
    assert saved.status == "published"
    open_runs = sorted(a.rollout_id for a in books.open_attempts())
    answer = {"continuations": [{"rollout_id": r, "attempt_index": 1, "after_call": "call-0",
                                 "restart_only": ["sandbox"] if r == open_runs[0] else []} for r in open_runs],
              "finished_unacked": []}
    gym = FakeGym(restore_answer=answer)
    fresh_plane = InMemoryDataPlane({TOKEN_PARTITION})
    ckpt = make(tmp_path, gym, fresh_plane)
    outcome = ckpt.restore(WL, FINGERPRINT)
    assert isinstance(outcome, RestoreOutcome)
    report = outcome.report
    assert report.sequence == saved.report.sequence and report.snapshot_url == saved.report.snapshot_url
    assert report.skipped == [] and report.rows == {"training_rows": 1, "token_capture_rows": 1}
    assert set(report.steps_s) == {"load_data_plane", "gym_restore", "discard", "resume"}
    assert [(c.rollout_id, c.attempt_index, c.discarded) for c in report.continued] == \
        [(r, 1, r == open_runs[0]) for r in open_runs]
    assert gym.calls == ["restore", "discard", "resume"] and gym.restored_checkpoint == saved.report.checkpoint_id
    assert ckpt.seams.steps.order == list(RESTORE_STEPS)
    restored = outcome.books
    assert restored is not books and {r: restored.attempts[r].attempt_index for r in open_runs} == dict.fromkeys(
        open_runs, 1)
    assert restored.attempts["p0_g0"].state == "sealed" and report.acks_resent == 1
    ckpt.seams.acknowledge.assert_called_once_with(restored)  # the ACK owed, re-sent from the restored books
    assert fresh_plane.get(TRAIN_PARTITION, "p0_g0")["input_lengths"] == 5
    assert {a.attempt_index for a in books.open_attempts()} == {0}  # the saved books are untouched


def test_an_empty_store_restores_nothing(tmp_path: Path) -> None:
    gym = FakeGym()
    ckpt = make(tmp_path, gym)
    assert ckpt.restore(WL, FINGERPRINT) is None
    assert gym.calls == [] and ckpt.seams.steps.order == ["restore.begin"]


def test_a_restore_that_fails_before_the_resume_aborts_gym_and_clears_the_data_plane(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    books = running_books(plane)
    make(tmp_path, FakeGym(), plane, write_mode="in_pause").save(books, FINGERPRINT)
    fresh_plane = InMemoryDataPlane({TOKEN_PARTITION})
    gym = FakeGym(fail=("discard",), restore_answer={"continuations": [
        {"rollout_id": a.rollout_id, "attempt_index": 1, "restart_only": ["sandbox"]} for a in books.open_attempts()],
        "finished_unacked": []})
    ckpt = make(tmp_path, gym, fresh_plane)
    with pytest.raises(RestoreError, match="failed before resume"):
        ckpt.restore(WL, FINGERPRINT)
    assert gym.calls == ["restore", "discard", "abort"] and fresh_plane.is_empty()
    ckpt.seams.acknowledge.assert_not_called()


def test_another_topology_is_refused(tmp_path: Path) -> None:
    make(tmp_path, FakeGym(), write_mode="in_pause").save(Bookkeeping.fresh(WL), FINGERPRINT)
    gym = FakeGym()
    with pytest.raises(TopologyMismatchError):
        make(tmp_path, gym).restore(WL, "sha256:" + "cd" * 32)
    assert gym.calls == []


def test_outcomes_and_reports_are_frozen(tmp_path: Path) -> None:
    outcome = make(tmp_path, FakeGym(), write_mode="in_pause").save(Bookkeeping.fresh(WL), FINGERPRINT)
    assert isinstance(outcome, SaveOutcome)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.status = "aborted"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        outcome.report.published = False  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(outcome.report)) == msgspec.to_builtins(outcome.report)
