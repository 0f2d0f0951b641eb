"""Saving a rollout snapshot: the design note's steps 1-5, each timed, each a named boundary.

1. Stop sending rollouts (the controller's loop is here, so nothing is sent) and flush the
   acknowledgements of stored results; prepare Gym within ``prepare_timeout_s``.
2. Gym commits its state into the unpublished draft.
3. RL's cut, in memory, with the loop held (:mod:`coordinator.cut`). It is taken on a thread from
   the end of step 1, while Gym prepares and commits (nothing reaches the data plane or the
   controller's records in that time, so it is the same cut); the save waits for it after step 2.
4. Publish once every part is durable (one commit point: SPEC §15.5).
5. Resume Gym (resources, models, agents); the loop sends rollouts again only after that.

In ``background`` mode step 5 comes right after the cut and the parts are written and published by
:class:`BackgroundWriter`, one save at a time, while rollouts run: the pause is the drain, Gym's
commit and the in-memory cut. In ``in_pause`` mode (and for a cut above ``max_cut_bytes``) the parts
are written and published before the resume.

What a crash leaves, by boundary: before ``save.published``, a draft no commit names (GC removes
it) and the previous snapshot still the newest; Gym servers that were paused are lost with the job
or resumed by the abort. After it, the new snapshot.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from coordinator.cut import Cut, CutInBackground, write_cut_parts
from coordinator.errors import GymCallError, SaveAbortedError
from coordinator.gym_actor import CommitResult
from snapformat import Published
from snapformat.draft import SnapshotDraft

if TYPE_CHECKING:
    from coordinator.controller import SingleController

log = logging.getLogger("coordinator.save")


class SaveReport(msgspec.Struct, kw_only=True):
    """One save attempt: whether it was published, how long each step took, the pause."""

    checkpoint_id: str
    mode: str
    ok: bool = False
    published: bool = False
    sequence: int | None = None
    snapshot_url: str | None = None
    error: str | None = None
    pause_s: float | None = None
    steps_s: dict[str, float] = {}
    cut_bytes: int = 0
    rows: dict[str, int] = {}


@dataclass
class PendingWrite:
    """What is left of a save after the resume: write the cut and publish it."""

    draft: SnapshotDraft
    cut: Cut
    commit: CommitResult
    report: SaveReport
    fingerprint: str
    started: float = field(default_factory=time.perf_counter)


def new_checkpoint_id() -> str:
    return f"ckpt-{int(time.time())}-{secrets.token_hex(4)}"


def save(ctl: SingleController) -> SaveReport:
    """One save attempt (the caller holds the loop). On a failure before publish, Gym is aborted,
    nothing is published, and :class:`SaveAbortedError` is raised with the report attached."""
    cfg = ctl.config
    cid = new_checkpoint_id()
    report = SaveReport(checkpoint_id=cid, mode=cfg.write_mode)
    steps = report.steps_s
    t_pause = time.perf_counter()
    prepared = False
    draft: SnapshotDraft | None = None
    cutting: CutInBackground | None = None

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        steps[name] = round(time.perf_counter() - t0, 6)
        return out

    try:
        ctl.steps.reached("save.begin")
        timed("flush_acks", ctl.collect)
        ctl.steps.reached("save.acks_flushed")
        cutting = CutInBackground(ctl.plane, ctl.books)
        prepared = True
        timed("prepare", lambda: ctl.gym.prepare_checkpoint(cid, time.time() + cfg.prepare_timeout_s))
        ctl.steps.reached("save.prepared")
        draft = ctl.store.begin()
        commit: CommitResult = timed("gym_commit", lambda: ctl.gym.commit_checkpoint(
            cid, time.time() + cfg.commit_timeout_s, draft.url))
        ctl.steps.reached("save.gym_committed")
        cut: Cut = timed("cut_wait", cutting.result)  # what the cut adds to the pause past Gym's commit
        steps["cut"] = round(cut.seconds, 6)  # the cut's own time, from the flush of ACKs on
        ctl.steps.reached("save.cut")
        pending = PendingWrite(draft, cut, commit, report, ctl.fingerprint)
        in_pause = cfg.write_mode == "in_pause" or cut.held_bytes > cfg.max_cut_bytes
        if cfg.write_mode == "background" and in_pause:
            log.warning("the cut holds %d bytes, above max_cut_bytes %d: writing it inside the pause",
                        cut.held_bytes, cfg.max_cut_bytes)
            report.mode = "in_pause (cut too large for background)"
        if in_pause:
            write_and_publish(ctl, pending, pause_started=t_pause)
    except BaseException as exc:
        if prepared:
            failures = ctl.gym.abort_checkpoint(cid)
            if failures:
                log.warning("abort of %s: %s", cid, "; ".join(failures))
        if cutting is not None:  # Gym is resumed first; no listing of the data plane outlives the save
            cutting.wait()
        if draft is not None:
            try:
                draft.abandon()
            except Exception:  # GC removes it later
                pass
        report.error = f"{type(exc).__name__}: {exc}"
        report.pause_s = round(time.perf_counter() - t_pause, 6)
        aborted = SaveAbortedError(f"save {cid} aborted, nothing published: {report.error}")
        aborted.report = report
        raise aborted from exc
    try:
        timed("resume", lambda: ctl.gym.resume_checkpoint(cid))
    except GymCallError as exc:
        # Gym's state is committed and the cut taken: the snapshot stands whatever the resume does.
        # The loop retries the resume and sends no rollout until it succeeds (SPEC §20.8).
        log.warning("resume of %s failed (%s); the loop retries it", cid, exc)
        ctl.pending_resume = cid
    report.pause_s = round(time.perf_counter() - t_pause, 6)
    ctl.steps.reached("save.resumed")
    if in_pause:
        report.ok = True
        return report
    ctl.writer.submit(pending)
    return report


def write_and_publish(ctl: SingleController, p: PendingWrite, pause_started: float | None = None) -> Published:
    """Write the cut's parts into the draft and publish it with Gym's receipts (step 4)."""
    steps = p.report.steps_s
    t0 = time.perf_counter()
    rows, _ = write_cut_parts(p.draft, p.cut, ctl.config.compression)
    p.report.cut_bytes, p.report.rows = rows.nbytes, dict(rows.rows)
    steps["write"] = round(time.perf_counter() - t0, 6)
    ctl.steps.reached("save.written")
    timings = {f"{k}_s": v for k, v in steps.items()}
    if pause_started is None:
        timings["pause_s"] = p.report.pause_s or 0.0
    else:  # in the pause: the resume is still to come, so the pause so far
        timings["pause_until_publish_s"] = round(time.perf_counter() - pause_started, 6)
    t1 = time.perf_counter()
    published = p.draft.publish(receipts=p.commit.receipts, gym_commit=p.commit.gym_commit,
                                topology_fingerprint=p.fingerprint, timings_s=timings,
                                keep_latest=ctl.config.keep_latest_k, producer="coordinator.SingleController")
    steps["publish"] = round(time.perf_counter() - t1, 6)
    p.report.published = True
    p.report.sequence = published.manifest.sequence
    p.report.snapshot_url = published.url
    ctl.steps.reached("save.published")
    log.info("published snapshot %d (%s): pause %.3fs, steps %s", published.manifest.sequence, p.report.mode,
             p.report.pause_s or 0.0, steps)
    return published


class BackgroundWriter:
    """Writes and publishes one save at a time, in a thread, while the loop runs on.

    :meth:`submit` waits for the previous save to finish first (one in flight). A failure is handed
    to ``on_done`` with the report; the draft stays unpublished and GC removes it.
    """

    def __init__(self, ctl: SingleController, on_done: Callable[[SaveReport, BaseException | None], None]) -> None:
        self._ctl = ctl
        self._on_done = on_done
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, p: PendingWrite) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(p,), name=f"snapshot-writer-{p.report.checkpoint_id}",
                                        daemon=True)
        self._thread.start()

    def _run(self, p: PendingWrite) -> None:
        try:
            write_and_publish(self._ctl, p)
        except BaseException as exc:  # reported, never raised in a thread nobody joins for errors
            p.report.error = f"{type(exc).__name__}: {exc}"
            try:
                p.draft.abandon()
            except Exception:
                pass
            self._on_done(p.report, exc)
            return
        p.report.ok = True
        self._on_done(p.report, None)
