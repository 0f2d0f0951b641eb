"""Restoring after a crash: the design note's restore steps, each a named boundary.

1. Pick the newest published snapshot. Its topology fingerprint must be the running one (a
   mismatch is refused, naming both; never an older snapshot instead). A snapshot that turns out
   corrupt (unreadable manifest, a file whose checksum or records are wrong, a Gym part a server
   refuses) is skipped, saying so, and the one before it is tried.
2. Load the data plane's rows (into an empty data plane), read the controller's bookkeeping and
   the agents' continuation indexes; then every Gym server restores its part (only then: a Gym
   server restores into a fresh process only, so a snapshot found corrupt after Gym restored could
   not fall back to an older one). Everything stays paused. A data plane may go on putting its rows
   in the background (TransferQueue's does:
   :meth:`coordinator.dataplane.tq.adapter.TQDataPlane.restore_partitions`).
3. Every unfinished rollout continues as run n + 1, which the loop sends again after the resume
   (the agent continues it from its restored boundary); those whose continuation depends on a
   restart-only resources server are discarded first (they start over, as run n + 1).
   Acknowledgements still owed are settled (Gym's commit holds no unacknowledged result).
4. Resume Gym (resources, models, agents). The loop then sends rollouts again.

If a step before the resume fails, Gym is aborted (each server drops what it loaded), the data
plane is cleared, and nothing was resumed: a later attempt starts from scratch. A crash at any
boundary leaves the store as it was (a restore publishes nothing): the next job restores again.

The restored bookkeeping is handed back in the :class:`~coordinator.checkpoint.outcomes.RestoreOutcome`;
the controller adopts it. The segments the restored snapshot holds (with the keys read) become the
checkpointer's :class:`~coordinator.checkpoint.history.ParentSegments` once the restore has finished,
so the first save after it lists them again rather than writing every row.
"""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from coordinator.bookkeeping import Bookkeeping, ControllerRecords
from coordinator.checkpoint import gym_parts
from coordinator.checkpoint.cut import CONTROLLER_PREFIX, TQ_PREFIX
from coordinator.checkpoint.history import ParentSegments
from coordinator.checkpoint.outcomes import Continued, RestoreOutcome, RestoreReport
from coordinator.checkpoint.seams import Seams
from coordinator.errors import GymCallError, RestoreError
from coordinator.workload import Workload
from gymkit.checkpoint_dir import read_agent_dir
from gymkit.gym_fleet import Topology
from schemas.errors import CorruptSnapshotError, InvalidRecordError, NotPublishedError, StoreError
from schemas.gym_files import participant_dir
from schemas.manifest import GymCommit
from schemas.topology import manifest_fingerprint
from snapformat.reader import Snapshot
from snapformat.snapshot_store import check_topology

log = logging.getLogger("coordinator.checkpoint.restore")

#: Errors that mean "this snapshot cannot be used": try the one before it.
_UNUSABLE = (CorruptSnapshotError, InvalidRecordError, NotPublishedError)
#: Gym's refusals of the files a restore was handed: the snapshot is unusable, try the one before it.
_REFUSED_FILES = ("agent_checkpoint_error", "ledger_mismatch", "resources_checkpoint_error")


class _Unusable(Exception):
    """This snapshot cannot be restored (corrupt); the message says why."""


def restore(seams: Seams, workload: Workload, topology: Topology,
            segments: ParentSegments | None = None) -> RestoreOutcome | None:
    """Restore from the newest usable snapshot of the running ``topology``; None when the store has
    none (start fresh). ``segments`` is forgotten first (the data plane is replaced) and, once the
    restore has finished, describes the restored snapshot."""
    if segments is not None:
        segments.set(None)
    fingerprint = manifest_fingerprint(topology.fingerprint)
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
            outcome = _restore_from(seams, workload, topology, snap, segments)
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


def _restore_from(seams: Seams, workload: Workload, topology: Topology, snap: Snapshot,
                  segments: ParentSegments | None = None) -> RestoreOutcome:
    gym, plane, cfg, steps = seams.gym, seams.plane, seams.config, seams.steps
    rid = f"restore-{int(time.time())}-{secrets.token_hex(4)}"
    steps_s: dict[str, float] = {}
    steps.reached("restore.picked")
    commit = snap.manifest.gym_commit
    if commit is None:
        raise _Unusable(f"{snap.url}: the manifest has no gym_commit")
    t0 = time.perf_counter()
    try:  # Gym's files, checked against the part manifests (downloaded first from a remote store)
        checkpoint_dir = gym_parts.restore_dir(snap, [p.part_prefix for p in commit.participants if p.part_prefix],
                                               seams.staging_dir)
    except _UNUSABLE as exc:
        raise _Unusable(str(exc)) from exc
    steps_s["gym_files"] = round(time.perf_counter() - t0, 6)
    # Gym restores only once the snapshot has proved usable (rows, records and continuations read):
    # a Gym server restores into a fresh process only, so after a Gym restore there is no falling
    # back to an older snapshot.
    answer_f = None
    try:
        if not plane.is_empty():
            log.warning("the data plane is not empty at restore: clearing it (the snapshot's rows replace it)")
            plane.clear()
        try:
            loaded = plane.load(snap, TQ_PREFIX)
            books = Bookkeeping.from_records(workload, _read_records(snap), snap.url)
            continued = _continuations(checkpoint_dir.path, commit, topology)
        except (*_UNUSABLE, StoreError) as exc:
            plane.clear()
            if isinstance(exc, StoreError):
                raise
            raise _Unusable(str(exc)) from exc
        steps_s["load_data_plane"] = round(time.perf_counter() - t0, 6)
        steps.reached("restore.dataplane_loaded")
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gym-restore")
        answer_f = pool.submit(gym.restore_checkpoint, rid, time.time() + cfg.restore_timeout_s, checkpoint_dir.path,
                               commit.checkpoint_id)
        pool.shutdown(wait=False)
        answer_f.result()
        steps_s["gym_restore"] = round(time.perf_counter() - t0, 6)
        steps.reached("restore.gym_restored")
        _apply(books, continued, snap.url)
        steps.reached("restore.bookkeeping_loaded")
        t = time.perf_counter()
        to_discard = [{"rollout_id": c.rollout_id, "attempt_index": c.attempt_index} for c in continued
                      if c.restart_only]
        discarded: set[str] = set()
        if to_discard:
            answer = gym.discard_restored_agent_continuations(rid, time.time() + cfg.restore_timeout_s, to_discard)
            discarded = {d.rollout_id for d in answer.replies if d.discarded}
        continued = [msgspec.structs.replace(c, discarded=c.rollout_id in discarded) for c in continued]
        steps_s["discard"] = round(time.perf_counter() - t, 6)
        steps.reached("restore.discarded")
        acks_resent = len(books.acks_owed)
        seams.acknowledge(books)
        steps.reached("restore.acks_resent")
    except BaseException as exc:
        if answer_f is not None:  # Gym was asked to restore: let it end, then abort it
            try:
                answer_f.result()
            except BaseException:
                pass
            try:
                failures = gym.abort_checkpoint(rid, time.time() + cfg.resume_timeout_s).failures
            except GymCallError as again:
                failures = [str(again)]
            if failures:
                log.warning("abort of restore %s: %s", rid, "; ".join(failures))
        plane.clear()
        checkpoint_dir.cleanup()
        if isinstance(exc, GymCallError) and exc.error in _REFUSED_FILES:
            raise _Unusable(str(exc)) from exc
        if isinstance(exc, (_Unusable, RestoreError, StoreError)):
            raise
        raise RestoreError(f"restore {rid} from {snap.url} failed before resume (Gym aborted): "
                           f"{type(exc).__name__}: {exc}") from exc
    t = time.perf_counter()
    gym.resume_checkpoint(rid, time.time() + cfg.resume_timeout_s)
    checkpoint_dir.cleanup()
    steps_s["resume"] = round(time.perf_counter() - t, 6)
    if segments is not None:
        segments.set(loaded.segments)
    steps.reached("restore.resumed")
    report = RestoreReport(restore_id=rid, snapshot_url=snap.url, sequence=snap.sequence, steps_s=steps_s,
                           continued=continued, acks_resent=acks_resent, rows=dict(loaded.rows))
    log.info("restored snapshot %d: %d rollouts continue (%d start over)", snap.sequence, len(report.continued),
             sum(c.discarded for c in report.continued))
    return RestoreOutcome(books=books, report=report)


def _continuations(checkpoint_dir: str, commit: GymCommit, topology: Topology) -> list[Continued]:
    """Every parked execution the agents committed, as its run n + 1. One whose continuation
    depends on a restart-only resources server (or whose dependencies are unknown) starts over:
    NeMo-RL's rule for ``agent_resource_dependency_index_v1``."""
    restart_only = set(topology.restart_only_resources())
    out: list[Continued] = []
    for p in commit.participants:
        if p.component != "responses_api_agents" or p.part_prefix is None:
            continue
        _, records, roots = read_agent_dir(Path(checkpoint_dir) / participant_dir(p.component, p.name))
        revisions = {(r.rollout_id, r.attempt_index): r.resource_state_revisions for r in roots}
        for rec in records:
            key = (rec.rollout_id, rec.attempt_index)
            deps = revisions.get(key, rec.resource_state_revisions)
            uses = sorted(set(deps) & restart_only) if deps is not None else sorted(restart_only)
            out.append(Continued(rollout_id=rec.rollout_id, attempt_index=rec.attempt_index + 1,
                                 after_call=rec.last_committed_model_call_id,
                                 restart_only=uses if rec.last_committed_model_call_id is not None else []))
    return out


def _apply(books: Bookkeeping, continued: list[Continued], where: str) -> None:
    """Give each unfinished rollout its run n + 1 (sent again after resume); check that Gym and the
    ledger tell one story: every run the ledger dispatched is one Gym saved."""
    for c in continued:
        books.next_run(c.rollout_id, c.attempt_index - 1, c.attempt_index)
    held = {c.rollout_id for c in continued}
    lost = [a.rollout_id for a in books.open_attempts() if a.state == "dispatched" and a.rollout_id not in held]
    if lost:
        raise InvalidRecordError(f"{where}: the recovery ledger has dispatched rollouts Gym did not save: {lost[:5]}")
