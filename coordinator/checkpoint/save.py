"""Saving a rollout snapshot: the design note's steps 1-5, each timed, each a named boundary.

1. Stop sending rollouts (the caller holds the controller's loop, so nothing is sent) and flush the
   acknowledgements of stored results; prepare Gym within ``prepare_timeout_s``.
2. Gym commits its state into the unpublished draft.
3. RL's cut, in memory, with the loop held (:mod:`coordinator.checkpoint.cut`). It is taken on a
   thread from the end of step 1, while Gym prepares and commits (nothing reaches the data plane or
   the controller's records in that time, so it is the same cut); the save waits for it after step 2.
4. Publish once every part is durable (one commit point: SPEC §15.5).
5. Resume Gym (resources, models, agents); the loop sends rollouts again only after that.

In ``background`` mode step 5 comes right after the cut and the parts are written and published by
the :class:`~coordinator.checkpoint.writer.BackgroundWriter` (:func:`finish_write`), one save at a
time, while rollouts run: the pause is the drain, Gym's commit and the in-memory cut. In
``in_pause`` mode (and for a cut above ``max_cut_bytes``) the parts are written and published before
the resume.

What a crash leaves, by boundary: before ``save.published``, a draft no commit names (GC removes
it) and the previous snapshot still the newest; Gym servers that were paused are lost with the job
or resumed by the abort. After it, the new snapshot.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from coordinator.checkpoint.cut import Cut, CutInBackground, write_cut_parts
from coordinator.checkpoint.outcomes import SaveOutcome, SaveReport
from coordinator.checkpoint.seams import RecordsSource, Seams
from coordinator.errors import GymCallError
from snapformat import Published
from snapformat.draft import SnapshotDraft

if TYPE_CHECKING:
    from gymkit.control_client import CommitResult

log = logging.getLogger("coordinator.checkpoint.save")

T = TypeVar("T")


@dataclass
class Progress:
    """What a save attempt has done so far; its reports are copies taken from it.

    Mutable on purpose: the steps before the resume and the background write after it add to the
    same record, each report a frozen copy of it at that moment."""

    checkpoint_id: str
    mode: str
    steps: dict[str, float] = field(default_factory=dict)
    pause_s: float | None = None
    cut_bytes: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    published: Published | None = None

    def timed(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()``, its time recorded as step ``name``."""
        t0 = time.perf_counter()
        out = fn()
        self.steps[name] = round(time.perf_counter() - t0, 6)
        return out

    def report(self, *, ok: bool = False, error: str | None = None) -> SaveReport:
        p = self.published
        return SaveReport(checkpoint_id=self.checkpoint_id, mode=self.mode, ok=ok, published=p is not None,
                          sequence=None if p is None else p.manifest.sequence,
                          snapshot_url=None if p is None else p.url, error=error, pause_s=self.pause_s,
                          steps_s=dict(self.steps), cut_bytes=self.cut_bytes, rows=dict(self.rows))


@dataclass(frozen=True)
class PendingWrite:
    """What is left of a save after the resume: write the cut and publish it."""

    draft: SnapshotDraft
    cut: Cut
    commit: CommitResult
    progress: Progress
    fingerprint: str


def new_checkpoint_id() -> str:
    return f"ckpt-{int(time.time())}-{secrets.token_hex(4)}"


def save(seams: Seams, source: RecordsSource, fingerprint: str) -> tuple[SaveOutcome, PendingWrite | None]:
    """One save attempt (the caller holds the loop). Returns its outcome and, when the outcome is
    ``writing``, what the background writer must write and publish. On a failure before publish Gym
    is aborted, nothing is published and the outcome is ``aborted``."""
    cfg = seams.config
    cid = new_checkpoint_id()
    progress = Progress(checkpoint_id=cid, mode=cfg.write_mode)
    t_pause = time.perf_counter()
    prepared = False
    draft: SnapshotDraft | None = None
    cutting: CutInBackground | None = None
    try:
        seams.steps.reached("save.begin")
        progress.timed("flush_acks", seams.store_and_acknowledge)
        seams.steps.reached("save.acks_flushed")
        cutting = CutInBackground(seams.plane, source)
        prepared = True
        progress.timed("prepare", lambda: seams.gym.prepare_checkpoint(cid, time.time() + cfg.prepare_timeout_s))
        seams.steps.reached("save.prepared")
        draft = seams.store.begin()
        url = draft.url
        commit = progress.timed("gym_commit", lambda: seams.gym.commit_checkpoint(
            cid, time.time() + cfg.commit_timeout_s, url))
        seams.steps.reached("save.gym_committed")
        cut = progress.timed("cut_wait", cutting.result)  # what the cut adds to the pause past Gym's commit
        progress.steps["cut"] = round(cut.seconds, 6)  # the cut's own time, from the flush of ACKs on
        seams.steps.reached("save.cut")
        pending = PendingWrite(draft, cut, commit, progress, fingerprint)
        in_pause = cfg.write_mode == "in_pause" or cut.held_bytes > cfg.max_cut_bytes
        if cfg.write_mode == "background" and in_pause:
            log.warning("the cut holds %d bytes, above max_cut_bytes %d: writing it inside the pause",
                        cut.held_bytes, cfg.max_cut_bytes)
            progress.mode = "in_pause (cut too large for background)"
        if in_pause:
            write_and_publish(seams, pending, pause_started=t_pause)
    except BaseException as exc:  # any failure before publish aborts this save; the run goes on
        _abort(seams, cid, prepared, cutting, draft)
        progress.pause_s = round(time.perf_counter() - t_pause, 6)
        report = progress.report(error=f"{type(exc).__name__}: {exc}")
        log.warning("save %s aborted, nothing published: %s", cid, report.error)
        return SaveOutcome(status="aborted", report=report, cause=exc), None
    resumed = True
    try:
        progress.timed("resume", lambda: seams.gym.resume_checkpoint(cid))
    except GymCallError as exc:
        # Gym's state is committed and the cut taken: the snapshot stands whatever the resume does.
        # The loop retries the resume and sends no rollout until it succeeds (CONTROL.md §8).
        log.warning("resume of %s failed (%s); the loop retries it", cid, exc)
        resumed = False
    progress.pause_s = round(time.perf_counter() - t_pause, 6)
    seams.steps.reached("save.resumed")
    if in_pause:
        return SaveOutcome(status="published", report=progress.report(ok=True), gym_resumed=resumed), None
    return SaveOutcome(status="writing", report=progress.report(), gym_resumed=resumed), pending


def _abort(seams: Seams, cid: str, prepared: bool, cutting: CutInBackground | None,
           draft: SnapshotDraft | None) -> None:
    """Undo a failed save: Gym resumed without a commit, the cut ended, the draft abandoned."""
    if prepared:
        failures = seams.gym.abort_checkpoint(cid)
        if failures:
            log.warning("abort of %s: %s", cid, "; ".join(failures))
    if cutting is not None:  # Gym is resumed first; no listing of the data plane outlives the save
        cutting.wait()
    if draft is not None:
        _abandon(draft)


def _abandon(draft: SnapshotDraft) -> None:
    try:
        draft.abandon()
    except Exception:  # GC removes it later
        pass


def write_and_publish(seams: Seams, p: PendingWrite, pause_started: float | None = None) -> Published:
    """Write the cut's parts into the draft and publish it with Gym's receipts (step 4)."""
    progress = p.progress
    steps = progress.steps
    t0 = time.perf_counter()
    rows, _ = write_cut_parts(p.draft, p.cut, seams.config.compression)
    progress.cut_bytes, progress.rows = rows.nbytes, dict(rows.rows)
    steps["write"] = round(time.perf_counter() - t0, 6)
    seams.steps.reached("save.written")
    timings = {f"{k}_s": v for k, v in steps.items()}
    if pause_started is None:
        timings["pause_s"] = progress.pause_s or 0.0
    else:  # in the pause: the resume is still to come, so the pause so far
        timings["pause_until_publish_s"] = round(time.perf_counter() - pause_started, 6)
    t1 = time.perf_counter()
    published = p.draft.publish(receipts=p.commit.receipts, gym_commit=p.commit.gym_commit,
                                topology_fingerprint=p.fingerprint, timings_s=timings,
                                keep_latest=seams.config.keep_latest_k, producer="coordinator.SingleController")
    steps["publish"] = round(time.perf_counter() - t1, 6)
    progress.published = published
    seams.steps.reached("save.published")
    log.info("published snapshot %d (%s): pause %.3fs, steps %s", published.manifest.sequence, progress.mode,
             progress.pause_s or 0.0, steps)
    return published


def finish_write(seams: Seams, p: PendingWrite) -> SaveOutcome:
    """Step 4 after the resume (the background writer's job). A failure leaves the draft unpublished
    (abandoned; GC removes what remains) and is the outcome, never raised."""
    try:
        write_and_publish(seams, p)
    except BaseException as exc:  # reported, never raised in a thread nobody joins for errors
        report = p.progress.report(error=f"{type(exc).__name__}: {exc}")
        _abandon(p.draft)
        log.warning("background write of %s failed, nothing published: %s", report.checkpoint_id, exc)
        return SaveOutcome(status="aborted", report=report, cause=exc)
    return SaveOutcome(status="published", report=p.progress.report(ok=True))
