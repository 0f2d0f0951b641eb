"""Saving a rollout snapshot: the design note's steps 1-5, each timed, each a named boundary.

1. Stop sending rollouts (the caller holds the controller's loop, so nothing is sent) and flush the
   acknowledgements of stored results; prepare Gym within ``rollout_checkpointing.gym.prepare_timeout_s``.
   A result that completed after the flush makes the agent's prepare refuse
   (``agent_prepare_incomplete``: Gym commits no unacknowledged result). The save asks the actor to
   hold Gym paused then (``hold_when_unacknowledged``): agent admission stays closed, so nothing else
   can complete; the save stores and acknowledges those results and prepares the same id again, at
   most :data:`HELD_PREPARES` times. Any other early refusal resumes Gym: the save waits
   :data:`SETTLE_S`, flushes again and prepares under a fresh checkpoint id, at most
   :data:`PREPARE_ATTEMPTS` times.
2. Gym writes its files into ``checkpoint_dir`` (the draft's ``gym/`` folder, or a staging folder
   for a store that is not local disk). The publisher adopts each participant's folder as a part
   (``coordinator.checkpoint.gym_parts``: Gym's digests checked, uploaded to an object store) with
   the rest of step 4: nothing writes that folder once Gym's commit has answered, so the adoption
   need not hold the pause.
3. RL's cut, in memory, with the loop held (:mod:`coordinator.checkpoint.cut`). It is taken on a
   thread from the end of step 1, while Gym prepares and commits (nothing reaches the data plane or
   the controller's records in that time, so it is the same cut); the save waits for it after step 2.
4. Publish once every part is durable (one commit point: SPEC §15.5).
5. Resume Gym (resources, models, agents); the loop sends rollouts again only after that.

With ``incremental`` on (the default) step 4 writes the data plane's rows as segments and lists
again those the parent snapshot holds (:mod:`coordinator.dataplane.segments`), using the segments
of the newest snapshot this checkpointer published or restored
(:class:`~coordinator.checkpoint.history.ParentSegments`), which it updates only once the snapshot
is published.

In ``background`` mode step 5 comes right after the cut and the parts are written and published by
the :class:`~coordinator.checkpoint.writer.BackgroundWriter` (:func:`finish_write`), one save at a
time, while rollouts run: the pause is the drain, Gym's commit and the in-memory cut. In
``in_pause`` mode (and for a cut above ``max_cut_bytes``) the parts are written and published before
the resume.

What a crash leaves, by boundary: before ``save.published``, a draft no commit names (GC removes
it; a staging folder is swept by a later save), and the previous snapshot still the newest; Gym
servers that were paused are lost with the job or resumed by the abort. After it, the new snapshot.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from coordinator.checkpoint import gym_parts
from coordinator.checkpoint.cut import TQ_PREFIX, Cut, CutInBackground, write_cut_parts
from coordinator.checkpoint.history import ParentSegments
from coordinator.checkpoint.outcomes import SaveOutcome, SaveReport
from coordinator.checkpoint.seams import RecordsSource, Seams
from coordinator.dataplane import FILE_NAMES
from coordinator.errors import GymCallError
from gymkit.gym_fleet import CommitResult
from snapformat import Published
from snapformat.draft import SnapshotDraft

log = logging.getLogger("coordinator.checkpoint.save")

T = TypeVar("T")
#: Prepares of one id that Gym refused while held for results not yet acknowledged. Gym is paused,
#: so the results it lists are the only ones: the first flush stores them unless their answers have
#: not reached the actor yet, which the next ones wait for (HELD_WAIT_S more each time).
HELD_PREPARES = 10
HELD_WAIT_S = 0.02
#: Prepare attempts of one save, each under a fresh id, after refusals that resumed Gym (executions
#: parked without a boundary, or a Gym control that does not hold): more means something else blocks.
PREPARE_ATTEMPTS = 3
SETTLE_S = 0.1  # after a failed prepare that resumed Gym, before flushing again (see save)


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
    rows_new_bytes: int = 0
    rows_shared_bytes: int = 0
    parts_bytes: int = 0
    prepares: int = 0
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
                          steps_s=dict(self.steps), cut_bytes=self.cut_bytes, rows=dict(self.rows),
                          rows_new_bytes=self.rows_new_bytes, rows_shared_bytes=self.rows_shared_bytes,
                          parts_bytes=self.parts_bytes, prepares=self.prepares)


@dataclass(frozen=True)
class PendingWrite:
    """What is left of a save after the resume: write the cut and publish it."""

    draft: SnapshotDraft
    cut: Cut
    commit: CommitResult
    checkpoint_dir: gym_parts.CheckpointDir  # Gym's files, adopted as parts by the write
    progress: Progress
    fingerprint: str
    segments: ParentSegments | None = None  # what an incremental write lists again; updated once published


def new_checkpoint_id() -> str:
    return f"ckpt-{int(time.time())}-{secrets.token_hex(4)}"


def save(seams: Seams, source: RecordsSource, fingerprint: str,
         segments: ParentSegments | None = None) -> tuple[SaveOutcome, PendingWrite | None]:
    """One save attempt (the caller holds the loop). Returns its outcome and, when the outcome is
    ``writing``, what the background writer must write and publish. On a failure before publish Gym
    is aborted, nothing is published and the outcome is ``aborted``. ``segments``: the parent's
    segments an incremental save lists again (None: it writes every row)."""
    cfg = seams.config
    cid = new_checkpoint_id()
    progress = Progress(checkpoint_id=cid, mode=cfg.write_mode)
    t_pause = time.perf_counter()
    prepared = False
    draft: SnapshotDraft | None = None
    checkpoint_dir: gym_parts.CheckpointDir | None = None
    cutting: CutInBackground | None = None
    try:
        seams.steps.reached("save.begin")
        progress.timed("flush_acks", seams.store_and_acknowledge)
        seams.steps.reached("save.acks_flushed")
        cutting = CutInBackground(seams.plane, source)
        prepared = True

        def flush_again(settle_s: float) -> None:  # the cut must follow the last flush: take it again after one
            nonlocal cutting
            assert cutting is not None
            cutting.wait()
            time.sleep(settle_s)
            seams.store_and_acknowledge()
            cutting = CutInBackground(seams.plane, source)

        cid = progress.timed("prepare", lambda: _prepare(seams, progress, flush_again))
        seams.steps.reached("save.prepared")
        draft = seams.store.begin()
        checkpoint_dir = gym_parts.save_dir(draft, seams.staging_dir, always_stage=cfg.gym_staging == "always")
        commit = progress.timed("gym_commit", lambda: seams.gym.commit_checkpoint(
            cid, time.time() + cfg.commit_timeout_s, checkpoint_dir.path))
        seams.steps.reached("save.gym_committed")
        cut = progress.timed("cut_wait", cutting.result)  # what the cut adds to the pause past Gym's commit
        progress.steps["cut"] = round(cut.seconds, 6)  # the cut's own time, from the flush of ACKs on
        seams.steps.reached("save.cut")
        pending = PendingWrite(draft, cut, commit, checkpoint_dir, progress, fingerprint, segments)
        in_pause = cfg.write_mode == "in_pause" or cut.held_bytes > cfg.max_cut_bytes
        if cfg.write_mode == "background" and in_pause:
            log.warning("the cut holds %d bytes, above max_cut_bytes %d: writing it inside the pause",
                        cut.held_bytes, cfg.max_cut_bytes)
            progress.mode = "in_pause (cut too large for background)"
        if in_pause:
            write_and_publish(seams, pending, pause_started=t_pause)
    except BaseException as exc:  # any failure before publish aborts this save; the run goes on
        _abort(seams, progress.checkpoint_id, prepared, cutting, draft)
        if checkpoint_dir is not None:
            checkpoint_dir.cleanup()
        progress.pause_s = round(time.perf_counter() - t_pause, 6)
        report = progress.report(error=f"{type(exc).__name__}: {exc}")
        log.warning("save %s aborted, nothing published: %s", progress.checkpoint_id, report.error)
        return SaveOutcome(status="aborted", report=report, cause=exc), None
    resumed = True
    try:
        progress.timed("resume", lambda: seams.gym.resume_checkpoint(cid, time.time() + cfg.resume_timeout_s))
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


def _prepare(seams: Seams, progress: Progress, flush_again: Callable[[float], None]) -> str:
    """Prepare Gym; returns the checkpoint id that prepared (also kept in ``progress``).

    An ``agent_prepare_incomplete`` before the deadline blocks on what only the caller can clear:
    results completed after the flush (or executions parked without a boundary). When the actor held
    Gym paused for it (``GymCallError.held``), the results are stored and acknowledged and the same id
    prepares again, at most :data:`HELD_PREPARES` times. Otherwise the actor has resumed everyone:
    after :data:`SETTLE_S` (rollouts resumed at their end complete, so this flush takes them too) the
    results are stored and acknowledged again and a fresh id prepares, at most
    :data:`PREPARE_ATTEMPTS` ids. A refusal at the deadline (executions still running) is not retried:
    each id's prepare is bounded by one ``prepare_timeout_s``. A failure leaves the id in ``progress``
    paused or resumed; the caller's abort resumes it either way."""
    timeout = seams.config.rollout_checkpointing.gym.prepare_timeout_s
    ids, held = 1, 0
    deadline = time.time() + timeout
    while True:
        progress.prepares += 1
        try:
            seams.gym.prepare_checkpoint(progress.checkpoint_id, deadline, hold_when_unacknowledged=True)
            return progress.checkpoint_id
        except GymCallError as exc:
            if exc.error != "agent_prepare_incomplete" or time.time() >= deadline:
                raise
            if exc.held:
                held += 1
                if held > HELD_PREPARES:
                    raise
                # Gym stays paused under this id with agent admission closed: nothing else completes.
                log.info("prepare of %s: %s; Gym held: storing and acknowledging, then preparing it again",
                         progress.checkpoint_id, exc)
                flush_again(HELD_WAIT_S * (held - 1))
                continue
            if ids == PREPARE_ATTEMPTS:
                raise
            log.info("prepare of %s: %s; flushing acknowledgements and preparing again", progress.checkpoint_id, exc)
            # The failed prepare's rollback resumed the agents: rollouts it had parked at their end
            # complete a moment later. Let them, so this flush acknowledges them too.
            flush_again(SETTLE_S)
            ids += 1
            progress.checkpoint_id = new_checkpoint_id()
            deadline = time.time() + timeout


def _abort(seams: Seams, cid: str, prepared: bool, cutting: CutInBackground | None,
           draft: SnapshotDraft | None) -> None:
    """Undo a failed save: Gym resumed without a commit, the cut ended, the draft abandoned."""
    if prepared:
        try:
            failures = seams.gym.abort_checkpoint(cid, time.time() + seams.config.resume_timeout_s).failures
        except GymCallError as exc:
            failures = [str(exc)]
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
    """Adopt Gym's files as parts, write the cut's parts into the draft and publish it (step 4)."""
    progress = p.progress
    steps = progress.steps
    try:
        gym = progress.timed("gym_adopt", lambda: gym_parts.adopt_commit(p.draft, p.checkpoint_dir, p.commit))
    finally:
        p.checkpoint_dir.cleanup()
    seams.steps.reached("save.gym_adopted")
    t0 = time.perf_counter()
    incremental = seams.config.incremental
    rows, _ = write_cut_parts(p.draft, p.cut, seams.config.compression, incremental=incremental,
                              parent_segments=p.segments.get() if p.segments is not None else None)
    progress.cut_bytes, progress.rows = rows.nbytes, dict(rows.rows)
    progress.rows_new_bytes, progress.rows_shared_bytes = rows.new_bytes, rows.shared_bytes
    steps["write"] = round(time.perf_counter() - t0, 6)
    seams.steps.reached("save.written")
    timings = {f"{k}_s": v for k, v in steps.items()}
    if pause_started is None:
        timings["pause_s"] = progress.pause_s or 0.0
    else:  # in the pause: the resume is still to come, so the pause so far
        timings["pause_until_publish_s"] = round(time.perf_counter() - pause_started, 6)
    t1 = time.perf_counter()
    published = p.draft.publish(receipts=gym.receipts, gym_commit=gym.gym_commit,
                                topology_fingerprint=p.fingerprint, timings_s=timings,
                                keep_latest=seams.config.rollout_checkpointing.keep_latest_k,
                                producer="coordinator.SingleController")
    steps["publish"] = round(time.perf_counter() - t1, 6)
    progress.published = published
    # Every other file (Gym's parts, the controller's records, part manifests) is written whole by every save.
    progress.parts_bytes = sum(f.size for f in published.manifest.files
                               if not (f.path.startswith(TQ_PREFIX + "/") and f.kind in FILE_NAMES)) \
        + sum(part.bytes for part in published.manifest.listed_parts)
    if p.segments is not None:  # what the next save lists again: this snapshot's segments, now that it is published
        p.segments.set(rows.segments if incremental else None)
    seams.steps.reached("save.published")
    log.info("published snapshot %d (%s): pause %.3fs, rows %d bytes new, %d shared, other parts %d bytes, "
             "steps %s", published.manifest.sequence, progress.mode, progress.pause_s or 0.0, rows.new_bytes,
             rows.shared_bytes, progress.parts_bytes, steps)
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
