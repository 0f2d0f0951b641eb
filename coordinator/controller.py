"""The Single Controller: sends rollouts to Gym, stores finished results, trains, and decides when to save.

It owns the bookkeeping and is the only producer of the data plane's rows, so its loop is the data
plane's barrier: while the loop is in a save, no row is put and no rollout is sent. Saving and
restoring are its :class:`~coordinator.checkpoint.Checkpointer`'s, which it calls and whose outcomes
it applies (the restored bookkeeping; a resume to retry before any rollout). One pass of the loop:

1. collect: read finished results from Gym, put their rows into the data plane, mark them sealed
   (each now owes an acknowledgement), then acknowledge them;
2. train: a finalized batch of prompt groups is claimed and applied (the trainer here is a step
   counter: what matters to a snapshot is which samples it used);
3. dispatch: send rollouts of the next prompts, up to ``max_in_flight`` open runs;
4. save, when ``snapshot_attempt_interval_s`` has passed (:mod:`coordinator.checkpoint.save`).

A failed save is logged and counted; the run goes on. ``max_consecutive_failures`` failures in a
row stop the run with :class:`~coordinator.errors.TooManyFailuresError`. Gym unreachable for
``gym_unreachable_s`` stops it too (an operator restarts the job, which restores).

:class:`SingleController` is a plain class; :func:`remote` makes it a Ray actor. It reaches Gym
only through the NemoGym actor (:class:`GymHandle`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from coordinator.bookkeeping import Bookkeeping
from coordinator.checkpoint import Checkpointer, RestoreReport, SaveReport, Seams, gym_parts
from coordinator.config import ControllerConfig
from coordinator.dataplane import DataPlane
from coordinator.errors import GymCallError
from coordinator.faults import CrashPlan, Steps
from coordinator.samples import TOKEN_PARTITION, TRAIN_PARTITION, decode_results, put_results
from coordinator.workload import Workload
from gymkit.gym_fleet import Topology
from schemas.topology import manifest_fingerprint
from snapformat.snapshot_store import SnapshotStore

log = logging.getLogger("coordinator.controller")


class GymHandle:
    """The NemoGym actor's methods as plain blocking calls (``ray.get`` of each)."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self._actor, name)

        def call(*args: Any, **kw: Any) -> Any:
            try:
                return ray.get(method.remote(*args, **kw))
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise cause from None

        return call


class RunOutcome(msgspec.Struct, kw_only=True):
    """What a run did: for the demo's report and the tests' checks."""

    done: bool
    restored: RestoreReport | None
    saves: list[SaveReport]
    train_steps: int
    rollouts_stored: int
    seconds: float


def make_data_plane(kind: str, timeout_s: float = 300.0, capture_max_bytes: int = 4 << 30) -> DataPlane:
    """``tq``: TransferQueue on this Ray cluster (attaches to the running one); ``memory``: in-process.
    Both are write-once (the controller puts each key once), so incremental saves list rows again."""
    parts = {TOKEN_PARTITION}
    if kind == "memory":
        from coordinator.dataplane import InMemoryDataPlane

        return InMemoryDataPlane(parts, write_once=True)
    if kind == "tq":
        import transfer_queue as tq

        from coordinator.dataplane.tq.adapter import TQDataPlane

        tq.init()  # attaches to the TransferQueue the driver started
        return TQDataPlane(parts, call_timeout_s=timeout_s, capture_max_bytes=capture_max_bytes)
    raise ValueError(f"data plane {kind!r} is not 'tq' or 'memory'")


class SingleController:
    """Drives one run of ``workload`` through Gym, saving to the snapshot store at ``store_url``.

    ``data_plane`` is ``"tq"`` or ``"memory"`` (:func:`make_data_plane`), or a data plane to use as is.
    ``staging_dir``: where Gym's files are staged when the store is not local disk, or always with
    ``config.gym_staging="always"`` (default: the system's temporary folder)."""

    def __init__(self, config: ControllerConfig, store_url: str, gym_actor: Any, workload: Workload, *,
                 data_plane: str | DataPlane = "tq", crash_plan: CrashPlan | None = None,
                 staging_dir: str | None = None) -> None:
        config.check_supported()
        if config.gym_staging == "always" and not gym_parts.staged_in_memory(staging_dir):
            log.warning("gym_staging='always' stages Gym's files in %s, which is not memory-backed: the pause "
                        "still waits for its disk, and adoption copies every file again",
                        gym_parts.staging_base(staging_dir))
        self.config = config
        self.gym = GymHandle(gym_actor)
        self.workload = workload
        self.plane = make_data_plane(data_plane, config.data_plane_timeout_s, config.capture_max_bytes) \
            if isinstance(data_plane, str) else data_plane
        self.books = Bookkeeping.fresh(workload)
        self.steps = Steps(crash_plan)
        self.checkpointer = Checkpointer(Seams(
            gym=self.gym, store=SnapshotStore(store_url), plane=self.plane, config=config, steps=self.steps,
            store_and_acknowledge=self.collect, acknowledge=self._acknowledge_restored, staging_dir=staging_dir))
        # The completion receipt of every stored result whose acknowledgement is owed, with its agent.
        self._receipts: dict[str, dict[str, Any]] = {}
        self.topology: Topology | None = None
        self.fingerprint = ""
        self.restored: RestoreReport | None = None
        self._gym_down_since: float | None = None
        self.pending_resume: str | None = None  # a checkpoint whose resume failed: retried before any rollout

    # -- set-up -----------------------------------------------------------------------------
    def setup(self) -> RestoreReport | None:
        """Discover Gym's topology, then restore from the newest usable snapshot (or start fresh)."""
        self.discover()
        return self.restore()

    def discover(self) -> str:
        """Ask Gym for its servers' capabilities; returns the running topology's fingerprint as a
        manifest spells it (``sha256:<NeMo-RL's hex>``)."""
        self.topology = self.gym.discover_checkpoint_capabilities()
        self.fingerprint = manifest_fingerprint(self.topology.fingerprint)
        return self.fingerprint

    def restore(self) -> RestoreReport | None:
        """Restore from the newest usable snapshot of this topology and adopt its bookkeeping (Gym is
        resumed on return); None when the store holds no snapshot (the run starts fresh)."""
        if self.topology is None:
            self.discover()
        assert self.topology is not None
        outcome = self.checkpointer.restore(self.workload, self.topology)
        if outcome is not None:
            self.books = outcome.books
        self.restored = None if outcome is None else outcome.report
        return self.restored

    # -- the loop ---------------------------------------------------------------------------
    def run(self, max_seconds: float = 600.0) -> RunOutcome:
        """Run until every prompt is trained (or ``max_seconds``); returns what happened."""
        t0 = time.monotonic()
        last_save = time.monotonic()
        interval = self.config.rollout_checkpointing.snapshot_attempt_interval_s
        while not self.books.done():
            if time.monotonic() - t0 > max_seconds:
                break
            self.checkpointer.raise_if_failing()
            try:
                if self.pending_resume is not None:
                    self.gym.resume_checkpoint(self.pending_resume, time.time() + self.config.resume_timeout_s)
                    self.pending_resume = None
                self.collect()
                self.train()
                self.dispatch()
                self._gym_down_since = None
            except GymCallError as exc:
                self._gym_unreachable(exc)
            gym_up = self._gym_down_since is None  # no save while Gym fails every call: it would only abort
            if gym_up and interval is not None and time.monotonic() - last_save >= interval:
                self.save_now()
                last_save = time.monotonic()
            time.sleep(self.config.poll_interval_s)
        self.checkpointer.wait_for_write()
        self.checkpointer.raise_if_failing()
        return self.outcome(time.monotonic() - t0)

    def outcome(self, seconds: float = 0.0) -> RunOutcome:
        stored = sum(a.state == "sealed" for a in self.books.attempts.values())
        return RunOutcome(done=self.books.done(), restored=self.restored, saves=self.checkpointer.reports(),
                          train_steps=self.books.train_steps, rollouts_stored=stored, seconds=round(seconds, 3))

    def _gym_unreachable(self, exc: GymCallError) -> None:
        now = time.monotonic()
        if self._gym_down_since is None:
            self._gym_down_since = now
        log.warning("Gym call failed (%s); retrying", exc)
        if now - self._gym_down_since > self.config.gym_unreachable_s:
            raise GymCallError(f"Gym has failed every call for {self.config.gym_unreachable_s}s; last: {exc}",
                               component=exc.component, name=exc.name, status=exc.status, error=exc.error) from exc
        time.sleep(0.2)

    # -- the loop's steps -------------------------------------------------------------------
    def collect(self) -> int:
        """Store finished results in the data plane (sealed, ACK owed), then acknowledge them."""
        results = decode_results(self.gym.results())
        fresh = [r for r in results if r.outcome == "finished" and not self.books.is_stored(r.rollout_id, r.attempt_index)]
        for r in results:
            if r.outcome == "failed" and not self.books.is_stored(r.rollout_id, r.attempt_index):
                log.warning("rollout %s run %d failed in Gym: %s", r.rollout_id, r.attempt_index, r.error)
                self.books.failed(r.rollout_id, r.attempt_index)
        if fresh:
            group_of = {r.rollout_id: self.books.attempts[r.rollout_id].group_id for r in fresh}
            keys = put_results(self.plane, fresh, group_of)
            for r, key in zip(fresh, keys):
                self.books.sealed(r.rollout_id, r.attempt_index, key, TRAIN_PARTITION)
        for r in results:  # every result listed is stored now (or failed): its receipt goes back
            owed = self.books.acks_owed.get(r.rollout_id)
            if r.completion_receipt is not None and owed is not None and owed.attempt_index == r.attempt_index:
                self._receipts[r.rollout_id] = {"receipt": msgspec.to_builtins(r.completion_receipt),
                                                "agent_name": r.agent_name}
        self.acknowledge_owed(self.books)
        return len(fresh)

    def acknowledge_owed(self, books: Bookkeeping, *, restored: bool = False) -> None:
        """Send the acknowledgement of every result ``books`` owes, as the receipts the agents issued,
        and mark each sent. A result listed without a receipt stays owed (a later listing may carry
        it). With ``restored`` (the bookkeeping a restore rebuilt), an acknowledgement without a
        receipt here is settled as it is: Gym commits no unacknowledged result (CONTROL.md §7), so
        the restored agents hold none of them."""
        owed = list(books.acks_owed.values())
        if not owed:
            return
        sendable = [self._receipts[a.rollout_id] for a in owed if a.rollout_id in self._receipts]
        if sendable:
            self.gym.acknowledge_completed_executions(sendable)
        for a in owed:
            if a.rollout_id in self._receipts:
                del self._receipts[a.rollout_id]
            elif restored:
                log.info("acknowledgement of %s run %d owed from before the restore: settled (Gym holds no "
                         "unacknowledged result across a checkpoint)", a.rollout_id, a.attempt_index)
            else:
                log.warning("result of %s run %d was listed without a completion receipt; its acknowledgement "
                            "stays owed", a.rollout_id, a.attempt_index)
                continue
            books.acknowledged(a.rollout_id)

    def _acknowledge_restored(self, books: Bookkeeping) -> None:
        self.acknowledge_owed(books, restored=True)

    def train(self) -> None:
        while batch := self.books.claim_batch(self.config.train_batch_groups):
            self.books.applied(batch)
        if self.books.loader.peek() is None and self.books.finalized_order:  # the last, smaller batch
            self.books.applied(self.books.claim_batch(len(self.books.finalized_order)))

    def dispatch(self) -> None:
        room = self.config.max_in_flight - len(self.books.open_attempts())
        reserved = [a.rollout_id for a in self.books.attempts.values() if a.state == "reserved"]
        specs = [self.books.spec(r) for r in reserved]
        while room - len(specs) > 0:
            group = self.books.reserve_next()
            if not group:
                break
            specs += group
        if not specs:
            return
        runs = {rid: a.attempt_index for rid, a in self.books.attempts.items()}
        answer = self.gym.start_rollouts([msgspec.to_builtins(s) | {"attempt_index": runs.get(s.rollout_id, 0)}
                                          for s in specs])
        self.books.dispatched(answer["accepted"])

    # -- saving -----------------------------------------------------------------------------
    def save_now(self, wait: bool = False) -> SaveReport:
        """One save attempt now (after a background write still in flight). With ``wait``, also wait
        for this save's own background write, so the report says whether it was published."""
        outcome = self.checkpointer.save(self.books, self.fingerprint)
        if not outcome.gym_resumed:  # the snapshot stands; Gym must be resumed before any rollout
            self.pending_resume = outcome.report.checkpoint_id
        if wait and outcome.status == "writing":
            outcome = self.checkpointer.wait_for_write() or outcome
        return outcome.report

    # -- inspection -------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        b = self.books
        reports = self.checkpointer.reports()
        saves, published = len(reports), sum(s.published for s in reports)
        return {"groups": len(b.groups), "open": len(b.open_attempts()), "train_steps": b.train_steps,
                "stored": sum(a.state == "sealed" for a in b.attempts.values()), "saves": saves,
                "published": published, "steps": dict(self.steps.counts), "pid": _pid()}

    def saves_since(self, n: int) -> list[SaveReport]:
        """Reports of finished save attempts after the first ``n`` (for a driver's log)."""
        return self.checkpointer.reports(n)

    def data_plane_tables(self) -> dict[str, Any]:
        """The data plane's rows now, as Arrow tables (for checks after a run)."""
        return dict(self.plane.cut().tables)

    def records(self) -> Any:
        return self.books.records()


def _pid() -> int:
    import os

    return os.getpid()


def remote(config: ControllerConfig, store_url: str, gym_actor: Any, workload: Workload, *,
           options: dict[str, Any] | None = None, **kw: Any) -> Any:
    """The Single Controller as a Ray actor (no CPU reserved; threads so ``status`` answers during
    ``run``). ``options`` are Ray actor options (e.g. ``runtime_env`` with the S3 credentials)."""
    import ray

    return ray.remote(SingleController).options(num_cpus=0, max_concurrency=4, **(options or {})).remote(
        config, store_url, gym_actor, workload, **kw)
