"""Restoring after a crash: the design note's restore steps, each a named boundary.

1. Pick the newest published snapshot. Its topology fingerprint must be the running one (a
   mismatch is refused, naming both; never an older snapshot instead). A snapshot that turns out
   corrupt (unreadable manifest, a file whose checksum or records are wrong, a Gym part a server
   refuses) is skipped, saying so, and the one before it is tried.
2. Load the data plane's rows (into an empty data plane) and read the controller's bookkeeping
   while every Gym server restores its part (the two at once: neither needs the other); everything
   stays paused. A data plane may go on putting its rows in the background (TransferQueue's does:
   :meth:`coordinator.dataplane.tq.adapter.TQDataPlane.restore_partitions`).
3. Every unfinished rollout continues as run n + 1; those that used a restart-only resource are
   discarded (they start over, same run); acknowledgements still owed are sent again.
4. Resume Gym (resources, models, agents). The loop then sends rollouts again.

If a step before the resume fails, Gym is aborted (each server drops what it loaded), the data
plane is cleared, and nothing was resumed: a later attempt starts from scratch. A crash at any
boundary leaves the store as it was (a restore publishes nothing): the next job restores again.

The restored bookkeeping is handed back in the :class:`~coordinator.checkpoint.outcomes.RestoreOutcome`;
the controller adopts it.
"""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from coordinator.bookkeeping import Bookkeeping, ControllerRecords
from coordinator.checkpoint.cut import CONTROLLER_PREFIX, TQ_PREFIX
from coordinator.checkpoint.outcomes import Continued, RestoreOutcome, RestoreReport
from coordinator.checkpoint.seams import Seams
from coordinator.errors import GymCallError, RestoreError
from coordinator.workload import Workload
from schemas.errors import CorruptSnapshotError, InvalidRecordError, NotPublishedError, StoreError
from snapformat.reader import Snapshot
from snapformat.snapshot_store import check_topology

log = logging.getLogger("coordinator.checkpoint.restore")

#: Errors that mean "this snapshot cannot be used": try the one before it.
_UNUSABLE = (CorruptSnapshotError, InvalidRecordError, NotPublishedError)


class _Unusable(Exception):
    """This snapshot cannot be restored (corrupt); the message says why."""


def restore(seams: Seams, workload: Workload, fingerprint: str) -> RestoreOutcome | None:
    """Restore from the newest usable snapshot; None when the store has none (start fresh)."""
    seams.steps.reached("restore.begin")
    store = seams.store
    commits = store.list()
    if not commits:
        log.info("store %s holds no snapshot: starting fresh", store.url)
        return None
    skipped: list[str] = []
    for commit in commits:
        try:
            snap = store.open(commit.sequence)
        except _UNUSABLE as exc:
            skipped.append(f"snapshot {commit.sequence}: {exc}")
            log.warning("snapshot %d cannot be opened (%s); trying the one before it", commit.sequence, exc)
            continue
        check_topology(snap, fingerprint)  # a mismatch is never a reason to go back in time
        try:
            outcome = _restore_from(seams, workload, fingerprint, snap)
        except _Unusable as exc:
            skipped.append(f"snapshot {commit.sequence}: {exc}")
            log.warning("snapshot %d is corrupt (%s); falling back to the one before it", commit.sequence, exc)
            continue
        if skipped:
            log.warning("restored snapshot %d after skipping %d newer one(s): %s", snap.sequence, len(skipped),
                        "; ".join(skipped))
        return RestoreOutcome(books=outcome.books, report=msgspec.structs.replace(outcome.report, skipped=skipped))
    raise RestoreError(f"{store.url}: no snapshot could be restored: {'; '.join(skipped)}")


def _read_records(snap: Snapshot) -> ControllerRecords:
    def mine(kind: str) -> list[Any]:
        entries = [e for e in snap.files(kind) if e.path.startswith(CONTROLLER_PREFIX + "/")]
        if len(entries) != 1:
            raise NotPublishedError(f"{snap.url}: expected one {kind} file under {CONTROLLER_PREFIX}/, "
                                    f"found {len(entries)}")
        return list(snap.iter_records(entries[0]))

    (loader,) = mine("loader_place")
    return ControllerRecords(loader, mine("recovery_ledger"), mine("replay_index"))


def _restore_from(seams: Seams, workload: Workload, fingerprint: str, snap: Snapshot) -> RestoreOutcome:
    gym, plane, cfg, steps = seams.gym, seams.plane, seams.config, seams.steps
    rid = f"restore-{int(time.time())}-{secrets.token_hex(4)}"
    steps_s: dict[str, float] = {}
    steps.reached("restore.picked")
    if snap.manifest.gym_commit is None:
        raise _Unusable(f"{snap.url}: the manifest has no gym_commit")
    t0 = time.perf_counter()
    # Gym restores its parts (paused) while the data plane reads the rows: neither needs the other,
    # and each server's restore is an HTTP wait here, so the two overlap.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gym-restore")
    answer_f = pool.submit(gym.restore_checkpoint, rid, time.time() + cfg.restore_timeout_s, snap.url,
                           snap.manifest.gym_commit.checkpoint_id, fingerprint)
    pool.shutdown(wait=False)
    try:
        if not plane.is_empty():
            log.warning("the data plane is not empty at restore: clearing it (the snapshot's rows replace it)")
            plane.clear()
        try:
            loaded = plane.load(snap, TQ_PREFIX)
            books = Bookkeeping.from_records(workload, _read_records(snap), snap.url)
        except (*_UNUSABLE, StoreError) as exc:
            plane.clear()
            if isinstance(exc, StoreError):
                raise
            raise _Unusable(str(exc)) from exc
        steps_s["load_data_plane"] = round(time.perf_counter() - t0, 6)
        steps.reached("restore.dataplane_loaded")
        answer = answer_f.result()
        steps_s["gym_restore"] = round(time.perf_counter() - t0, 6)
        steps.reached("restore.gym_restored")
        continued = _apply(books, answer, snap.url)
        steps.reached("restore.bookkeeping_loaded")
        t = time.perf_counter()
        to_discard = [(c.rollout_id, c.attempt_index) for c in continued if c.restart_only]
        discarded = set(gym.discard(rid, time.time() + cfg.restore_timeout_s, to_discard)) if to_discard else set()
        continued = [msgspec.structs.replace(c, discarded=c.rollout_id in discarded) for c in continued]
        steps_s["discard"] = round(time.perf_counter() - t, 6)
        steps.reached("restore.discarded")
        acks_resent = len(books.acks_owed)
        seams.acknowledge(books)
        steps.reached("restore.acks_resent")
    except BaseException as exc:
        try:
            answer_f.result()  # let Gym's restore end (it is bounded by its deadline) before aborting it
        except BaseException:
            pass
        failures = gym.abort_checkpoint(rid)
        if failures:
            log.warning("abort of restore %s: %s", rid, "; ".join(failures))
        plane.clear()
        if isinstance(exc, GymCallError) and exc.error == "invalid_record":
            raise _Unusable(str(exc)) from exc
        if isinstance(exc, (_Unusable, RestoreError, StoreError)):
            raise
        raise RestoreError(f"restore {rid} from {snap.url} failed before resume (Gym aborted): "
                           f"{type(exc).__name__}: {exc}") from exc
    t = time.perf_counter()
    gym.resume_checkpoint(rid)
    steps_s["resume"] = round(time.perf_counter() - t, 6)
    steps.reached("restore.resumed")
    report = RestoreReport(restore_id=rid, snapshot_url=snap.url, sequence=snap.sequence, steps_s=steps_s,
                           continued=continued, finished_unacked=len(answer["finished_unacked"]),
                           acks_resent=acks_resent, rows=dict(loaded.rows))
    log.info("restored snapshot %d: %d rollouts continue (%d start over), %d finished results to collect",
             snap.sequence, len(report.continued), sum(c.discarded for c in report.continued), report.finished_unacked)
    return RestoreOutcome(books=books, report=report)


def _apply(books: Bookkeeping, answer: dict[str, Any], where: str) -> list[Continued]:
    """Give each unfinished rollout its run n + 1; check that Gym and the ledger tell one story."""
    continued = []
    for c in answer["continuations"]:
        books.next_run(c["rollout_id"], c["attempt_index"] - 1, c["attempt_index"])
        continued.append(Continued(rollout_id=c["rollout_id"], attempt_index=c["attempt_index"],
                                   after_call=c.get("after_call"), restart_only=list(c.get("restart_only", []))))
    held = {c["rollout_id"] for c in answer["continuations"]}
    for f in answer["finished_unacked"]:
        a = books.attempts.get(f["rollout_id"])
        if a is None or a.attempt_index != f["attempt_index"]:
            raise InvalidRecordError(f"{where}: Gym holds a finished result of {f['rollout_id']} run "
                                     f"{f['attempt_index']} that the recovery ledger does not know")
        held.add(f["rollout_id"])
    lost = [a.rollout_id for a in books.open_attempts() if a.state == "dispatched" and a.rollout_id not in held]
    if lost:
        raise InvalidRecordError(f"{where}: the recovery ledger has dispatched rollouts Gym did not save: {lost[:5]}")
    return continued
