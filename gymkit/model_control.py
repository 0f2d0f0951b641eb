"""The model server's part of Gym's checkpoint protocol (CONTROL.md §3-4): data-plane admission and
the ``model-admission/*`` and ``model-checkpoint/*`` routes.

:class:`ModelAdmission` is the admission of the server's data plane (its model calls):

* ``accepting``: calls are admitted and registered in flight (rollout attempt, plane, start time,
  and the asyncio task serving the call);
* closing moves to ``draining`` if calls are in flight, else ``paused``; the last release turns
  ``draining`` into ``paused``;
* a call is refused while admission is not accepting (``checkpoint_parked``) or when its attempt is
  tombstoned (``stale_attempt``), both 409 with ``retry-after: 1``; a call that
  :meth:`ModelAdmission.abort_inflight` cancels ends as ``stale_attempt`` without ``retry-after``.

:class:`ModelParticipant` is what the server writes itself: its declaration, the ledger's commit
and restore. :func:`model_router` serves the routes around it, on the process's
:class:`~gymkit.fence.Fence`:

========================================  ===========================================================
route                                     phases
========================================  ===========================================================
POST ``model-admission/pause``            idle -> preparing, or prepared at once if already drained
GET  ``model-admission/status``           any non-idle phase; marks prepared once admission is paused
POST ``model-admission/resume``           preparing, prepared, committed_paused, restore_failed_paused,
                                          restored_paused -> idle (retires the id; not from idle)
POST ``model-admission/abort_inflight``   preparing or prepared (kept); op ``...:<rid>:<n>``
POST ``model-checkpoint/commit``          prepared -> committing -> committed_paused
POST ``model-checkpoint/restore``         idle or restore_failed_paused -> restoring -> restored_paused
                                          (failure: restore_failed_paused, admission left paused)
========================================  ===========================================================

Every route but ``status`` is for the policy instance only (else 409 ``not_a_policy_instance``).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import APIRouter

from gymkit.checkpoint_dir import checkpoint_root
from gymkit.collector import collector_held
from gymkit.control_http import ControlRoutes, ModelStatusQuery, capabilities_route
from gymkit.fence import ControlError, Fence, time_left
from schemas.control import (
    CONTROL_PREFIX,
    AbortInflightResponse,
    AdmissionState,
    AttemptRef,
    AttemptRequest,
    Capabilities,
    CheckpointDirRequest,
    ControlRequest,
    InflightCall,
    ModelCommitRequest,
    ModelCommitResponse,
    ModelPauseResponse,
    ModelRestoreResponse,
    ModelResumeResponse,
    ModelStatusResponse,
    Workers,
    WorkerState,
)
from schemas.errors import InvalidPathError
from schemas.gym_files import ArtifactRef

RETRY_AFTER = {"retry-after": "1"}
#: How long abort_inflight waits (at most; never past its deadline) for the calls it cancelled to
#: unwind before it answers, so its ``inflight_total`` and ``state`` count them out.
ABORT_UNWIND_S = 5.0

PAUSE = "model-admission/pause"
RESUME = "model-admission/resume"
ABORT_INFLIGHT = "model-admission/abort_inflight"
COMMIT = "model-checkpoint/commit"
RESTORE = "model-checkpoint/restore"

RESUMABLE = ("preparing", "prepared", "committed_paused", "restore_failed_paused", "restored_paused")
NOT_IDLE = ("preparing", "prepared", "committing", "committed_paused", "restoring", "restore_failed_paused",
            "restored_paused")


# -- data-plane admission -------------------------------------------------------------------------------
@dataclass(eq=False)
class InflightEntry:
    """One admitted call: who, on which plane, since when, and the task serving it."""

    rollout_id: str
    attempt_index: int
    plane: str
    started: float = field(default_factory=time.monotonic)
    task: asyncio.Task[Any] | None = None
    aborted: bool = False


class ModelAdmission:
    """Admission of the model server's data plane (one per process, shared with :func:`model_router`)."""

    def __init__(self) -> None:
        self._state: AdmissionState = "accepting"
        self._inflight: list[InflightEntry] = []
        self._tombstones: set[tuple[str, int]] = set()
        self._changed = asyncio.Event()

    # -- inspection ---------------------------------------------------------------------------
    @property
    def state(self) -> AdmissionState:
        return self._state

    @property
    def inflight_total(self) -> int:
        return len(self._inflight)

    @property
    def waiters_total(self) -> int:
        """Calls waiting to be admitted. This admission refuses (``checkpoint_parked``, retry after
        1 s) instead of queueing, so there are none: Gym's replies carry the count, always 0 here."""
        return 0

    def inflight(self) -> list[InflightCall]:
        now = time.monotonic()
        return [InflightCall(rollout_id=e.rollout_id, attempt_index=e.attempt_index, plane=e.plane,
                             age_seconds=round(now - e.started, 6)) for e in self._inflight]

    def tombstones(self) -> list[AttemptRef]:
        """The attempts that are never admitted again, sorted."""
        return [AttemptRef(rollout_id=r, attempt_index=n) for r, n in sorted(self._tombstones)]

    def tombstoned(self, rollout_id: str, attempt_index: int) -> bool:
        return (rollout_id, attempt_index) in self._tombstones

    # -- transitions --------------------------------------------------------------------------
    def close(self) -> AdmissionState:
        """Stop admitting: ``draining`` while calls are in flight, else ``paused``."""
        if self._state == "accepting":
            self._set("draining" if self._inflight else "paused")
        return self._state

    def open(self) -> None:
        """Admit calls again (resume)."""
        self._set("accepting")

    def tombstone(self, rollout_id: str, attempt_index: int) -> None:
        """Never admit this attempt again (its calls in flight are not touched: see abort_inflight)."""
        self._tombstones.add((rollout_id, attempt_index))

    def abort_inflight(self, rollout_id: str, attempt_index: int) -> int:
        """Tombstone the attempt and cancel its calls in flight; returns how many were cancelled.
        Each cancelled call leaves the registry when its task unwinds (:meth:`wait_unwound`)."""
        self.tombstone(rollout_id, attempt_index)
        count = 0
        for e in self._inflight:
            if (e.rollout_id, e.attempt_index) == (rollout_id, attempt_index) and not e.aborted:
                e.aborted = True
                count += 1
                if e.task is not None and e.task is not asyncio.current_task():
                    e.task.cancel()
        return count

    async def wait_paused(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``paused``; True if it is."""
        return await self._wait(lambda: self._state == "paused", timeout)

    async def wait_unwound(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no aborted call is still in flight."""
        return await self._wait(lambda: not any(e.aborted for e in self._inflight), timeout)

    @asynccontextmanager
    async def call(self, rollout_id: str, attempt_index: int, plane: str) -> AsyncIterator[InflightEntry]:
        """Admit one data-plane call for its whole duration::

            async with admission.call(rid, n, "responses"):
                ...  # the model call

        Refused with :class:`ControlError` 409 ``stale_attempt`` (tombstoned attempt) or
        ``checkpoint_parked`` (not accepting), both with ``retry-after: 1``. If
        :meth:`abort_inflight` cancels it, the call ends as ``stale_attempt`` without ``retry-after``
        (even if its body had caught the cancellation)."""
        if (rollout_id, attempt_index) in self._tombstones:
            raise ControlError("stale_attempt", f"attempt {rollout_id!r}#{attempt_index} is tombstoned",
                               headers=dict(RETRY_AFTER))
        if self._state != "accepting":
            raise ControlError("checkpoint_parked", f"model admission is {self._state} for a checkpoint; retry",
                               headers=dict(RETRY_AFTER))
        entry = InflightEntry(rollout_id, attempt_index, plane, task=asyncio.current_task())
        self._inflight.append(entry)
        try:
            yield entry
        except asyncio.CancelledError:
            if not entry.aborted:
                raise
        finally:
            self._release(entry)
        if entry.aborted:
            if entry.task is not None and entry.task.cancelling():
                entry.task.uncancel()
            raise ControlError("stale_attempt", f"attempt {rollout_id!r}#{attempt_index} was aborted in flight")

    # -- internals ------------------------------------------------------------------------------
    def _release(self, entry: InflightEntry) -> None:
        self._inflight.remove(entry)
        if self._state == "draining" and not self._inflight:
            self._set("paused")
        else:
            self._notify()

    def _set(self, state: AdmissionState) -> None:
        self._state = state
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, timeout)
        while not done():
            left = end - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return done()
        return True


# -- the server's own part ----------------------------------------------------------------------------
class ModelCommitContext(msgspec.Struct, frozen=True, kw_only=True):
    """What a commit is given: write the ledger under ``checkpoint_dir`` (in ``model-ledger/<name>/``)
    for exactly the calls the agents' ``continuation_indexes`` depend on."""

    checkpoint_id: str
    deadline_ts: float
    checkpoint_dir: str
    continuation_indexes: tuple[ArtifactRef, ...]


class ModelRestoreContext(msgspec.Struct, frozen=True, kw_only=True):
    """What a restore is given: the folder a commit wrote."""

    checkpoint_id: str
    deadline_ts: float
    checkpoint_dir: str


class ModelParticipant(ABC):
    """The model server's own part of save and restore.

    ``admission`` is the server's :class:`ModelAdmission`, given to the constructor; the server's
    data plane and :func:`model_router` use the same object, so :meth:`commit` can read its
    tombstones and :meth:`restore` sees it already closed. The kit runs :meth:`commit` only with
    admission paused and nothing in flight, and applies what :meth:`restore` answers (its
    ``tombstones`` and ``source_attempts`` are tombstoned in admission before the reply). A
    :class:`ControlError` raised here is answered as is (for instance ``ledger_mismatch``); any
    other exception is a 500 ``control_error``.
    """

    def __init__(self, admission: ModelAdmission) -> None:
        self.admission = admission

    @abstractmethod
    def declaration(self) -> Capabilities:
        """``component`` ``responses_api_models``, ``instance_role`` ``policy`` or ``auxiliary``
        (admission_states should include ``paused``: NeMo-RL pauses only such models)."""

    @abstractmethod
    async def commit(self, ctx: ModelCommitContext) -> ModelCommitResponse:
        """Write the ledger files and manifest into ``ctx.checkpoint_dir``; answer their summary."""

    @abstractmethod
    async def restore(self, ctx: ModelRestoreContext) -> ModelRestoreResponse:
        """Load the ledger from ``ctx.checkpoint_dir``; answer the saved tombstones and source attempts."""

    async def resumed(self) -> None:
        """Called by resume after admission reopens."""


# -- routes -----------------------------------------------------------------------------------------------
def _usable_dir(checkpoint_dir: str) -> None:
    """Refuse, as ``ledger_mismatch`` (what the model answers for a folder it cannot use), a
    ``checkpoint_dir`` no file system can hold (:func:`gymkit.checkpoint_dir.checkpoint_root`),
    before the participant is called with it."""
    try:
        checkpoint_root(checkpoint_dir)
    except InvalidPathError as exc:
        raise ControlError("ledger_mismatch", f"{type(exc).__name__}: {exc}") from None


def model_router(participant: ModelParticipant, admission: ModelAdmission, fence: Fence, token: str) -> APIRouter:
    """The model server's ``/ng-control/v1`` routes (and ``GET capabilities``), to ``include_router``."""
    declared = participant.declaration()
    if declared.component != "responses_api_models" or declared.instance_role is None:
        raise ValueError("a model server declares component 'responses_api_models' and an instance_role")
    if participant.admission is not admission:
        raise ValueError("the participant must hold the same ModelAdmission as the router")
    router = APIRouter(prefix=CONTROL_PREFIX)
    routes = ControlRoutes(router, token)
    capabilities_route(router, participant.declaration, fence)

    def policy_only() -> None:
        if participant.declaration().instance_role != "policy":
            raise ControlError("not_a_policy_instance", f"model server {declared.name!r} is not the policy instance")

    def workers() -> Workers:
        return Workers(acknowledged=1, expected=1)

    async def pause(req: ControlRequest) -> ModelPauseResponse:
        policy_only()

        async def close() -> ModelPauseResponse:
            admission.close()
            return ModelPauseResponse(state=admission.state, workers=workers(),
                                      inflight_total=admission.inflight_total, waiters_total=admission.waiters_total)

        reply = await fence.run(req.checkpoint_id, PAUSE, close, allowed=("idle",), entering="preparing",
                                success="preparing", deadline_ts=req.deadline_ts)
        mark_prepared(req.checkpoint_id)
        return reply

    def mark_prepared(checkpoint_id: str) -> None:
        if (admission.state == "paused" and fence.phase == "preparing"
                and fence.active_checkpoint_id == checkpoint_id):
            fence.set_phase("prepared", checkpoint_id)

    async def status(q: ModelStatusQuery) -> ModelStatusResponse:
        fence.check(q.checkpoint_id, NOT_IDLE)
        if q.wait_state == "paused" and admission.state != "paused":
            await admission.wait_paused(min(q.timeout_s, time_left(q.deadline_ts)))
            fence.check(q.checkpoint_id, NOT_IDLE)  # a resume may have retired it meanwhile
        mark_prepared(q.checkpoint_id)
        return ModelStatusResponse(
            checkpoint_id=q.checkpoint_id, state=admission.state,
            per_worker={"0": WorkerState(state=admission.state, inflight=admission.inflight_total)},
            inflight_total=admission.inflight_total, waiters_total=admission.waiters_total,
            inflight=admission.inflight(), tombstones=admission.tombstones())

    async def resume(req: ControlRequest) -> ModelResumeResponse:
        policy_only()

        async def reopen() -> ModelResumeResponse:
            admission.open()
            await participant.resumed()
            return ModelResumeResponse(state="accepting", workers=workers(), released_waiters=0)

        return await fence.run(req.checkpoint_id, RESUME, reopen, allowed=RESUMABLE, entering=None,
                               success="idle", retire=True)

    async def abort_inflight(req: AttemptRequest) -> AbortInflightResponse:
        policy_only()

        async def abort() -> int:  # no await: the phase cannot move while it runs, so it is kept
            return admission.abort_inflight(req.rollout_id, req.attempt_index)

        aborted = await fence.run(req.checkpoint_id, f"{ABORT_INFLIGHT}:{req.rollout_id}:{req.attempt_index}", abort,
                                  allowed=("preparing", "prepared"), entering=None, success=fence.phase)
        await admission.wait_unwound(min(ABORT_UNWIND_S, time_left(req.deadline_ts)))
        return AbortInflightResponse(state=admission.state, aborted_inflight=aborted,
                                     inflight_total=admission.inflight_total)

    async def commit(req: ModelCommitRequest) -> ModelCommitResponse:
        policy_only()

        async def write() -> ModelCommitResponse:
            if admission.state != "paused" or admission.inflight_total:
                raise ControlError("ledger_not_quiescent", f"model admission is {admission.state} with "
                                                           f"{admission.inflight_total} call(s) in flight")
            _usable_dir(req.checkpoint_dir)
            # The fence holds the collector off while the phase is "committing" (gymkit.collector).
            return await participant.commit(ModelCommitContext(
                checkpoint_id=req.checkpoint_id, deadline_ts=req.deadline_ts, checkpoint_dir=req.checkpoint_dir,
                continuation_indexes=tuple(req.continuation_indexes)))

        return await fence.run(req.checkpoint_id, COMMIT, write, allowed=("prepared",), entering="committing",
                               success="committed_paused", deadline_ts=req.deadline_ts)

    async def restore(req: CheckpointDirRequest) -> ModelRestoreResponse:
        policy_only()

        async def load() -> ModelRestoreResponse:
            admission.close()  # stays closed if the restore fails (restore_failed_paused)
            _usable_dir(req.checkpoint_dir)
            with collector_held(keep=True):
                reply = await participant.restore(ModelRestoreContext(
                    checkpoint_id=req.checkpoint_id, deadline_ts=req.deadline_ts, checkpoint_dir=req.checkpoint_dir))
            for attempt in (*reply.tombstones, *reply.source_attempts):
                admission.tombstone(attempt.rollout_id, attempt.attempt_index)
            return reply

        return await fence.run(req.checkpoint_id, RESTORE, load, allowed=("idle", "restore_failed_paused"),
                               entering="restoring", success="restored_paused", deadline_ts=req.deadline_ts,
                               phase_on_failure="restore_failed_paused")

    routes.post(f"/{PAUSE}", ControlRequest, pause)
    routes.get("/model-admission/status", ModelStatusQuery, status)
    routes.post(f"/{RESUME}", ControlRequest, resume)
    routes.post(f"/{ABORT_INFLIGHT}", AttemptRequest, abort_inflight)
    routes.post(f"/{COMMIT}", ModelCommitRequest, commit)
    routes.post(f"/{RESTORE}", CheckpointDirRequest, restore)
    return router
