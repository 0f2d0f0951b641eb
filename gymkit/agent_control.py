"""Gym's agent checkpoint side for a whitebox agent (``export_restore`` + ``serialized_per_session``).

Three pieces, all for one agent server process (CONTROL.md §4 "Agent checkpoint", §6, §7):

* :class:`AgentExecutions`: the registry of executions (one per rollout attempt the agent runs).
  The agent's ``/run`` handler and turn loop call it; the control routes read and change it.
* :class:`AgentParticipant`: what the agent declares and the hooks the kit calls.
* :func:`agent_router`: every ``/ng-control/v1/agent-checkpoint/*`` route.

**An execution's life.** ``/run`` calls :meth:`AgentExecutions.begin` (or the :meth:`~AgentExecutions.run`
context manager). At each turn end the loop records a boundary (:meth:`~AgentExecutions.record_boundary`),
then asks :meth:`~AgentExecutions.should_park`; when a prepare asked it to park it calls
:meth:`~AgentExecutions.park`, which returns once the checkpoint is resumed (or raises
``stale_attempt`` if the attempt was retired meanwhile). :meth:`~AgentExecutions.at_boundary` does
the three in one call. A finished run calls :meth:`~AgentExecutions.complete` with its result: the
result is retained (a repeated ``/run`` of that attempt gets it again) until the controller
acknowledges the receipt. A run that ends without a result calls :meth:`~AgentExecutions.end`.

**Restore.** Each restored record becomes the continuation of attempt n+1, handed to the first
``begin(rid, n+1)`` as ``execution.continuation``; the source attempt is tombstoned. A continuation
that no ``/run`` has taken is not part of a later commit (as in Gym): the controller re-runs the
restored rollouts right after resume.

Execution states are Gym's: ``running``, ``park_requested``, ``parked``, ``completed``,
``retired``. A ``parked`` execution is ``parked_with_boundary`` if it recorded a boundary, else
``parked_without_boundary`` (which blocks a commit: its state could not be exported).

**Identity rules (§7).** The generation of (rid, n) is 1 at its first ``/run`` and +1 at each later
``begin`` that starts a new execution of it; it is forgotten when the attempt is tombstoned or
acknowledged. Tombstoned attempts (retired, restored from, or failed) and acknowledged attempts are
refused ``stale_attempt`` forever (the process keeps them: the wire has no epoch to bound them by).
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import msgspec
from fastapi import APIRouter

from gymkit.checkpoint_dir import checkpoint_root, read_agent_folder, record_json, write_agent_dir
from gymkit.collector import collector_held
from gymkit.control_http import AttemptQuery, CheckpointQuery, ControlRoutes, capabilities_route
from gymkit.fence import ControlError, Fence
from schemas.control import (
    CONTROL_PREFIX,
    FEATURE_COMPLETED_RESULT_ACK,
    FEATURE_CONTINUATION_INDEX,
    FEATURE_DISCARD_RESTORED,
    FEATURE_RESOURCE_DEPENDENCY_INDEX,
    AcknowledgeCompletedRequest,
    AcknowledgeCompletedResponse,
    AcknowledgeResponse,
    AgentCommitResponse,
    AgentRestoreResponse,
    AgentResumeResponse,
    AgentStatus,
    AttemptRequest,
    Capabilities,
    CheckpointDirRequest,
    CompletionReceipt,
    ControlRequest,
    DiscardResponse,
    Execution,
    ExecutionState,
    MultiProcess,
    SelectedBoundary,
)
from schemas.errors import InvalidPathError, SnapshotError
from schemas.gym_files import MANIFEST_NAME, AgentBoundaryRecord, AgentManifest, agent_instance_dir
from schemas.gym_records import AgentContinuationRoot
from schemas.identity import capture_key

#: The phases each agent route allows (CONTROL.md §4).
PREPARE_PHASES = ("idle",)
COMMIT_PHASES = ("prepared",)
RESTORE_PHASES = ("idle",)
RESUME_PHASES = ("idle", "preparing", "prepared", "committed_paused", "restored_paused")
RETIRE_PHASES = ("idle", "preparing", "prepared")
DISCARD_PHASES = ("restored_paused",)

#: The features a whitebox agent advertises (NeMo-RL requires the first two of an export_restore
#: agent, and the last two when a resources server is restart_only).
AGENT_FEATURES = (FEATURE_COMPLETED_RESULT_ACK, FEATURE_CONTINUATION_INDEX, FEATURE_DISCARD_RESTORED,
                  FEATURE_RESOURCE_DEPENDENCY_INDEX)

_CURRENT: Any = object()  # begin(task=...) default: the task calling begin


def _key_text(rollout_id: str, attempt_index: int) -> str:
    return f"rollout {rollout_id!r} attempt {attempt_index}"


def result_receipt_fields(result: Any) -> tuple[str, str]:
    """``(result_identity, result_digest)`` of a completed result (CONTROL.md §7).

    The digest is the SHA-256 hex of ``json.dumps(value, sort_keys=True, separators=(",", ":"),
    ensure_ascii=True)`` in UTF-8, where ``value`` is the result as JSON (a pydantic model's
    ``model_dump(mode="json")``, a msgspec struct's builtins, else the result itself). The identity is
    ``str(value["id"])``, else ``str(value["response"]["id"])``, else (also when that string is
    empty) the digest.
    """
    if hasattr(result, "model_dump"):
        value = result.model_dump(mode="json")
    elif isinstance(result, msgspec.Struct):
        value = msgspec.to_builtins(result)
    else:
        value = result
    payload = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    digest = hashlib.sha256(payload).hexdigest()
    candidate = None
    if isinstance(value, dict):
        candidate = value.get("id")
        if candidate is None and isinstance(value.get("response"), dict):
            candidate = value["response"].get("id")
    identity = str(candidate) if candidate is not None else ""
    return identity or digest, digest


class AgentExecution:
    """One execution (a ``/run`` of one rollout attempt) as the registry holds it.

    Read-only for the agent: ``continuation`` is the restored boundary this attempt continues from
    (the record of attempt n-1, as committed; None for a fresh start), ``result`` the retained
    result once ``state`` is ``completed`` (a repeated ``/run`` answers it again).
    """

    def __init__(self, rollout_id: str, attempt_index: int, generation: int, task: asyncio.Task | None,
                 continuation: AgentBoundaryRecord | None) -> None:
        self.rollout_id = rollout_id
        self.attempt_index = attempt_index
        self.generation = generation
        self.state: ExecutionState = "running"
        self.boundary: AgentBoundaryRecord | None = None
        self.boundary_json: bytes = b""  # boundary's archive member bytes, encoded when it was recorded
        self.continuation = continuation
        self.result: Any = None
        self.receipt: CompletionReceipt | None = None
        self.started_at = time.time()
        self.task = task  # cancelled by retire
        self.parked_task: asyncio.Task | None = None
        self.parked_waiting = False  # parked by park_waiting: no task waits in park(); reopen runs it on
        self.detached = False  # its /run went away while parked with a boundary: retired at resume
        self.released = asyncio.Event()
        self.released.set()

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt_index)

    @property
    def parked_boundary_state(self) -> Literal["parked_with_boundary", "parked_without_boundary"] | None:
        if self.state != "parked":
            return None
        return "parked_with_boundary" if self.boundary is not None else "parked_without_boundary"

    def view(self) -> Execution:
        b = self.boundary
        return Execution(
            rollout_id=self.rollout_id, attempt_index=self.attempt_index, generation=self.generation,
            state=self.state, parked_boundary_state=self.parked_boundary_state,
            boundary_index=b.boundary_index if b is not None else None,
            turn_index=b.turn if b is not None else None,
            boundary_kind=b.boundary_kind if b is not None else None,
            resource_state_revisions=dict(b.resource_state_revisions) if b is not None else {},
            age_seconds=round(max(0.0, time.time() - self.started_at), 3),
            completion_receipt=self.receipt if self.state == "completed" and self.receipt is not None
            else msgspec.UNSET,
        )


class AgentExecutions:
    """The agent's executions, tombstones, acknowledgements and restored continuations.

    Everything runs on the server's event loop (no locks: no method awaits between its checks and
    its changes, except :meth:`park` and :meth:`wait_prepared`, which only wait).
    """

    def __init__(self) -> None:
        self._executions: dict[tuple[str, int], AgentExecution] = {}
        self._generations: dict[tuple[str, int], int] = {}
        self._restored: dict[tuple[str, int], AgentBoundaryRecord] = {}
        self._tombstones: set[tuple[str, int]] = set()
        self._acknowledged: dict[tuple[str, int], CompletionReceipt] = {}
        self._accepting = True
        self._changed = asyncio.Event()

    # -- inspection ------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """Agent admission: False from a prepare (even a failed one) or a restore until resume."""
        return self._accepting

    def get(self, rollout_id: str, attempt_index: int) -> AgentExecution | None:
        return self._executions.get((rollout_id, attempt_index))

    def tombstoned(self, rollout_id: str, attempt_index: int) -> bool:
        return (rollout_id, attempt_index) in self._tombstones

    def restored_continuation(self, rollout_id: str, attempt_index: int) -> AgentBoundaryRecord | None:
        """The restored boundary waiting for the first ``/run`` of replacement attempt (rid, n)."""
        return self._restored.get((rollout_id, attempt_index))

    def restored_attempts(self) -> list[tuple[str, int]]:
        """The replacement attempts whose restored continuation no ``/run`` has taken yet."""
        return sorted(self._restored)

    async def changed(self) -> None:
        """Return at the next change of any execution."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def poke(self) -> None:
        """Wake whatever waits for a change (the routes call it at every phase change)."""
        self._notify()

    def _owned(self, rollout_id: str, attempt_index: int) -> AgentExecution:
        ex = self._executions.get((rollout_id, attempt_index))
        if ex is None:
            raise ControlError("stale_attempt", f"{_key_text(rollout_id, attempt_index)} has no current execution "
                                                "(retired, acknowledged or never begun)")
        return ex

    def _tombstone(self, key: tuple[str, int]) -> None:
        self._tombstones.add(key)
        self._generations.pop(key, None)

    # -- the agent's side ------------------------------------------------------------------------
    def begin(self, rollout_id: str, attempt_index: int, *, task: asyncio.Task | None = _CURRENT) -> AgentExecution:
        """Register a ``/run`` of (rid, n). Returns the execution; if the attempt already completed
        and its result is retained, returns that execution (``state == "completed"``: answer
        ``execution.result`` again, nothing runs).

        Refused (:class:`ControlError`, 409): ``stale_attempt`` for an acknowledged or tombstoned
        attempt, ``duplicate_execution`` while the attempt has an execution that did not complete,
        ``agent_admission_closed`` while a checkpoint holds the agent. ``task`` (default: the calling
        task) is cancelled if the attempt is retired.
        """
        key = (rollout_id, attempt_index)
        if key in self._acknowledged:
            raise ControlError("stale_attempt", f"{_key_text(*key)}: its completed result was acknowledged")
        if key in self._tombstones:
            raise ControlError("stale_attempt", f"{_key_text(*key)} was retired (tombstoned)")
        existing = self._executions.get(key)
        if existing is not None:
            if existing.state == "completed":
                return existing
            raise ControlError("duplicate_execution", f"{_key_text(*key)} already has an active /run "
                                                      f"(generation {existing.generation}, {existing.state})")
        if not self._accepting:
            raise ControlError("agent_admission_closed", "agent admission is closed while a checkpoint holds the "
                                                         "agent (until its resume)")
        generation = self._generations.get(key, 0) + 1
        self._generations[key] = generation
        if task is _CURRENT:
            try:
                task = asyncio.current_task()
            except RuntimeError:
                task = None
        ex = AgentExecution(rollout_id, attempt_index, generation, task, self._restored.pop(key, None))
        self._executions[key] = ex
        self._notify()
        return ex

    def record_boundary(self, rollout_id: str, attempt_index: int, record: AgentBoundaryRecord) -> None:
        """Record the execution's latest boundary (a turn end, or a finished model call whose actions
        are pending). Boundary indices must increase; recording the same record again is a no-op.
        A record left with ``turn_index`` None gets ``boundary_index``, and ``created_at`` 0 gets the
        time it is recorded (Gym's defaults), so the committed member is what Gym writes.
        Refused: ``stale_attempt`` (no current execution), ``agent_checkpoint_error`` (another
        identity, a lower index, or the execution is not running)."""
        ex = self._owned(rollout_id, attempt_index)
        if (record.rollout_id, record.attempt_index) != ex.key:
            raise ControlError("agent_checkpoint_error",
                               f"boundary of {_key_text(record.rollout_id, record.attempt_index)} recorded for "
                               f"{_key_text(*ex.key)}")
        if ex.state not in ("running", "park_requested"):
            raise ControlError("agent_checkpoint_error", f"{_key_text(*ex.key)} is {ex.state}; only a running "
                                                         "execution records boundaries")
        fixes: dict[str, Any] = {}
        if record.turn_index is None:
            fixes["turn_index"] = record.boundary_index
        if record.created_at == 0.0:
            fixes["created_at"] = time.time()
        candidate = msgspec.structs.replace(record, **fixes) if fixes else record
        previous = ex.boundary
        if previous is not None and record.boundary_index <= previous.boundary_index:
            # the same boundary again (a defaulted created_at aside) is a no-op
            if candidate == msgspec.structs.replace(previous, created_at=candidate.created_at) and (
                    record.created_at in (0.0, previous.created_at)):
                return
            raise ControlError("agent_checkpoint_error",
                               f"boundary indices must increase for {_key_text(*ex.key)} "
                               f"({record.boundary_index} after {previous.boundary_index})")
        # Encoded now, once: a commit copies these bytes instead of encoding every parked record
        # (whose trajectory grows with each turn) inside the pause.
        ex.boundary, ex.boundary_json = candidate, record_json(candidate)
        self._notify()

    def should_park(self, rollout_id: str, attempt_index: int) -> bool:
        """True once a prepare asked this execution to park at its next boundary."""
        ex = self._executions.get((rollout_id, attempt_index))
        return ex is not None and ex.state == "park_requested"

    async def park(self, rollout_id: str, attempt_index: int) -> None:
        """Report the execution parked (at its recorded boundary, or without one) and wait until the
        checkpoint is resumed; then it is ``running`` again (``park_requested`` if another prepare has
        begun meanwhile: the caller parks again at its next boundary). Raises ``stale_attempt`` if the
        attempt is retired meanwhile (its task is also cancelled)."""
        ex = self._owned(rollout_id, attempt_index)
        if ex.state not in ("running", "park_requested"):
            raise ControlError("agent_checkpoint_error", f"{_key_text(*ex.key)} is {ex.state}; it cannot park")
        ex.state = "parked"
        me = asyncio.current_task()
        ex.parked_task = me
        ex.released.clear()
        self._notify()
        try:
            await ex.released.wait()
        finally:
            if ex.parked_task is me:
                ex.parked_task = None
        if self._executions.get(ex.key) is not ex or ex.state == "retired":
            raise ControlError("stale_attempt", f"{_key_text(*ex.key)} was retired while parked")
        # released by a resume; if a new prepare closed admission before this task woke, it was not
        # asked to park (it was parked then): it is asked now
        ex.state = "running" if self._accepting else "park_requested"
        self._notify()

    def park_waiting(self, keys: Iterable[tuple[str, int]]) -> int:
        """Park each of ``keys`` (executions asked to park) on its task's behalf, at its recorded
        boundary, without waking the task: for a task that waits outside any turn (an agent's rollout
        queued for a turn slot) and would only wake to call :meth:`park`. The state and the status are
        those :meth:`park` gives; the difference is that no task waits for the release, so
        :meth:`reopen` makes such an execution ``running`` itself. The caller must start no turn of a
        parked execution (it checks the state before each turn, as it checks :meth:`should_park`).
        Waking 1,000 waiting rollouts an agent to park, then again at the resume, was most of an
        agent's share of the pause. Returns how many were parked; a key that is not asked to park, or
        has no recorded boundary, is left as it is (its task must park itself)."""
        parked = 0
        for key in keys:
            ex = self._executions.get(key)
            if ex is None or ex.state != "park_requested" or ex.boundary is None:
                continue
            ex.state, ex.parked_waiting = "parked", True
            parked += 1
        if parked:
            self._notify()
        return parked

    async def at_boundary(self, rollout_id: str, attempt_index: int, record: AgentBoundaryRecord) -> None:
        """A turn end: :meth:`record_boundary`, then :meth:`park` if a prepare asked for it."""
        self.record_boundary(rollout_id, attempt_index, record)
        if self.should_park(rollout_id, attempt_index):
            await self.park(rollout_id, attempt_index)

    def complete(self, rollout_id: str, attempt_index: int, result: Any) -> CompletionReceipt:
        """The run finished with ``result`` (JSON-able): retained until acknowledged; returns its
        receipt. Completing again with the same result returns the same receipt."""
        ex = self._owned(rollout_id, attempt_index)
        identity, digest = result_receipt_fields(result)
        if len(identity) > 512:
            raise ControlError("agent_checkpoint_error", f"{_key_text(*ex.key)}: result identity is longer than 512 "
                                                         "characters")
        receipt = CompletionReceipt(rollout_id=rollout_id, attempt_index=attempt_index,
                                    execution_generation=ex.generation, result_identity=identity,
                                    result_digest=digest)
        if ex.state == "completed":
            if ex.receipt != receipt:
                raise ControlError("agent_checkpoint_error", f"{_key_text(*ex.key)} already completed with another "
                                                             "result")
            return receipt
        if ex.state == "parked":
            raise ControlError("agent_checkpoint_error", f"{_key_text(*ex.key)} is parked; it cannot complete")
        ex.state, ex.result, ex.receipt = "completed", result, receipt
        ex.continuation, ex.task = None, None
        self._notify()
        return receipt

    def end(self, rollout_id: str, attempt_index: int, outcome: Literal["failed", "cancelled"]) -> None:
        """The run ended without a result. ``cancelled`` while parked with a boundary: the execution
        stays (a commit still exports it) and is retired at resume. Otherwise it is retired and
        tombstoned (the controller runs attempt n+1). A completed or already retired execution is
        left as it is."""
        ex = self._executions.get((rollout_id, attempt_index))
        if ex is None or ex.state == "completed":
            return
        if outcome == "cancelled" and ex.state == "parked" and ex.boundary is not None:
            ex.detached, ex.task = True, None
        else:
            self._retire_execution(ex)
        self._notify()

    @asynccontextmanager
    async def run(self, rollout_id: str, attempt_index: int) -> AsyncIterator[AgentExecution]:
        """``begin`` ... ``end``: the body runs the attempt (nothing to run if the yielded execution is
        already ``completed``: answer its ``result``) and calls :meth:`complete`. Leaving the body
        without completing ends the run as failed (cancelled on cancellation)."""
        ex = self.begin(rollout_id, attempt_index)
        try:
            yield ex
        except asyncio.CancelledError:
            self.end(rollout_id, attempt_index, "cancelled")
            raise
        except BaseException:
            self.end(rollout_id, attempt_index, "failed")
            raise
        else:
            if self._executions.get(ex.key) is ex and ex.state != "completed":
                self.end(rollout_id, attempt_index, "failed")

    def _retire_execution(self, ex: AgentExecution) -> None:
        ex.state = "retired"
        self._tombstone(ex.key)
        if self._executions.get(ex.key) is ex:
            del self._executions[ex.key]
        ex.released.set()
        me = asyncio.current_task() if _loop_running() else None
        for task in {ex.task, ex.parked_task}:
            if task is not None and task is not me and not task.done():
                task.cancel()
        ex.task = ex.parked_task = None

    # -- completed results (CONTROL.md §7) -----------------------------------------------------------
    def completion_receipt(self, rollout_id: str, attempt_index: int) -> CompletionReceipt:
        """The receipt of a retained completed result, else 409 ``completed_execution_acknowledgement_error``."""
        ex = self._executions.get((rollout_id, attempt_index))
        if ex is None or ex.state != "completed" or ex.receipt is None:
            raise ControlError("completed_execution_acknowledgement_error",
                               f"{_key_text(rollout_id, attempt_index)} has no completed result receipt")
        return ex.receipt

    def acknowledge_completed(self, receipts: Sequence[CompletionReceipt]) -> list[CompletionReceipt]:
        """Release the retained results the receipts name, all or none: every receipt must match the
        (generation, identity, digest) of a retained completed result, or of an acknowledgement
        already made (a repeat succeeds), else 409 ``completed_execution_acknowledgement_error`` and
        nothing is released. A later ``/run`` of an acknowledged attempt gets ``stale_attempt``."""
        keys = [(r.rollout_id, r.attempt_index) for r in receipts]
        if len(set(keys)) != len(keys):
            raise ControlError("completed_execution_acknowledgement_error",
                               "completed execution acknowledgements must be unique")
        for key, receipt in zip(keys, receipts, strict=True):
            done = self._acknowledged.get(key)
            if done is not None:
                if done != receipt:
                    raise ControlError("completed_execution_acknowledgement_error",
                                       f"the receipt does not match the acknowledged result of {_key_text(*key)}")
                continue
            ex = self._executions.get(key)
            if ex is None or ex.state != "completed" or ex.receipt is None:
                raise ControlError("completed_execution_acknowledgement_error",
                                   f"{_key_text(*key)} has no retained completed result to acknowledge")
            if ex.receipt != receipt:
                raise ControlError("completed_execution_acknowledgement_error",
                                   f"the receipt does not match the completed result of {_key_text(*key)} "
                                   f"(generation {ex.generation}, identity {ex.receipt.result_identity!r})")
        for key, receipt in zip(keys, receipts, strict=True):
            if key in self._acknowledged:
                continue
            ex = self._executions.pop(key)
            ex.state, ex.result = "retired", None
            self._acknowledged[key] = receipt
            self._generations.pop(key, None)
        self._notify()
        return list(receipts)

    def acknowledge(self, receipt: CompletionReceipt) -> dict[str, bool]:
        """One receipt: ``{"acknowledged": True, "idempotent": False}``, or on a repeat (which
        succeeds, CONTROL.md §7) ``{"acknowledged": True, "idempotent": True}``."""
        idempotent = (receipt.rollout_id, receipt.attempt_index) in self._acknowledged
        self.acknowledge_completed([receipt])
        return {"acknowledged": True, "idempotent": idempotent}

    # -- the controller's side -----------------------------------------------------------------------
    def retire(self, rollout_id: str, attempt_index: int) -> dict[str, bool]:
        """Give up an attempt: tombstone it, drop its restored continuation, cancel its run.

        ``{"retired": true, "tombstoned": true}`` if an execution was retired, ``{"retired": false,
        "tombstoned": true}`` if there was none, and ``{"retired": false, "tombstoned": false,
        "completed_unacknowledged": true}`` (nothing changes) for a completed result not yet
        acknowledged."""
        key = (rollout_id, attempt_index)
        ex = self._executions.get(key)
        if ex is not None and ex.state == "completed":
            return {"retired": False, "tombstoned": False, "completed_unacknowledged": True}
        self._tombstone(key)
        self._restored.pop(key, None)
        if ex is None:
            self._notify()
            return {"retired": False, "tombstoned": True}
        self._retire_execution(ex)
        self._notify()
        return {"retired": True, "tombstoned": True}

    def discard_restored(self, rollout_id: str, attempt_index: int) -> bool:
        """Drop the restored continuation of replacement attempt (rid, n): its first ``/run`` starts
        from scratch (the attempt stays admissible). ``duplicate_execution`` if it already runs."""
        key = (rollout_id, attempt_index)
        if key in self._executions:
            raise ControlError("duplicate_execution", f"{_key_text(*key)} is already running; its restored "
                                                      "continuation was taken")
        discarded = self._restored.pop(key, None) is not None
        self._notify()
        return discarded

    def request_park(self) -> list[AgentExecution]:
        """Prepare's first step: close admission, ask every running execution to park at its next
        boundary. Returns the executions asked (for :meth:`cancel_park_requests`)."""
        self._accepting = False
        asked = [ex for ex in self._executions.values() if ex.state == "running"]
        for ex in asked:
            ex.state = "park_requested"
        self._notify()
        return asked

    def cancel_park_requests(self, asked: Sequence[AgentExecution]) -> None:
        """After a prepare that did not get ready: the executions it asked and that did not park
        run on (admission stays closed until resume)."""
        for ex in asked:
            if self._executions.get(ex.key) is ex and ex.state == "park_requested":
                ex.state = "running"
        self._notify()

    async def wait_prepared(self, deadline_ts: float, stop: Callable[[], bool] = lambda: False) -> AgentStatus:
        """Wait until nothing is running (ready or not), ``stop()`` is true, or the deadline passes;
        return the status then. Each wake-up counts (O(executions), no views); the status object,
        with a view of every execution, is built once, at the end: it used to be built at every park,
        O(N) each, which made a prepare of N parking rollouts O(N^2)."""
        while True:
            ready, running = self._readiness()
            if ready or running == 0 or stop():
                return self.status()
            remaining = deadline_ts - time.time()
            if remaining <= 0:
                return self.status()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=remaining)
            except TimeoutError:
                return self.status()

    def _readiness(self) -> tuple[bool, int]:
        """``(ready_to_commit, running)`` of :meth:`status`, counted without building it."""
        blocking = parked_without_boundary = completed = 0
        for ex in self._executions.values():
            if ex.state in ("running", "park_requested"):
                blocking += 1
            elif ex.state == "completed":
                completed += 1
            elif ex.state == "parked" and ex.boundary is None:
                parked_without_boundary += 1
        return not blocking and not parked_without_boundary and not completed, blocking

    def reopen(self) -> int:
        """Resume: open admission; executions asked to park run on; parked ones are released (their
        count is returned), except those whose run went away, which are retired and tombstoned."""
        self._accepting = True
        released = 0
        for ex in list(self._executions.values()):
            if ex.state == "park_requested":
                ex.state = "running"
            elif ex.state == "parked":
                if ex.detached:
                    self._retire_execution(ex)
                elif ex.parked_waiting:  # nobody waits in park(): it runs on from here
                    ex.state, ex.parked_waiting = "running", False
                    released += 1
                else:
                    ex.released.set()
                    released += 1
        self._notify()
        return released

    def records_for_commit(self) -> list[AgentBoundaryRecord]:
        """The boundaries of every execution parked with one, by (rid, n); ``agent_checkpoint_error``
        unless the status is ready to commit."""
        if not self._readiness()[0]:
            raise ControlError("agent_checkpoint_error", "cannot commit while agent executions still block it")
        records = [ex.boundary for ex in self._executions.values() if ex.state == "parked" and ex.boundary is not None]
        return sorted(records, key=lambda r: (r.rollout_id, r.attempt_index))  # type: ignore[union-attr]

    def member_json(self, record: AgentBoundaryRecord) -> bytes:
        """``record``'s archive member bytes (:func:`gymkit.checkpoint_dir.record_json`): those
        encoded when it was recorded if it is still its execution's boundary, else encoded now."""
        ex = self._executions.get((record.rollout_id, record.attempt_index))
        return ex.boundary_json if ex is not None and ex.boundary is record else record_json(record)

    def install_restored(self, records: Sequence[AgentBoundaryRecord]) -> None:
        """Restore: each record continues as attempt n+1 (handed to the first ``begin`` of it as
        ``continuation``), its source attempt is tombstoned, admission closes until resume."""
        for r in records:
            self._tombstone((r.rollout_id, r.attempt_index))
            self._restored[(r.rollout_id, r.attempt_index + 1)] = r
        self._accepting = False
        self._notify()

    def status(self) -> AgentStatus:
        """The status object (CONTROL.md §4): counts, blocking attempts, completed unacknowledged
        attempts with their receipts, every execution, and the selected boundaries."""
        every = list(self._executions.values())
        active = [ex for ex in every if ex.state not in ("completed", "retired")]
        with_boundary = [ex for ex in active if ex.state == "parked" and ex.boundary is not None]
        without_boundary = [ex for ex in active if ex.state == "parked" and ex.boundary is None]
        completed = [ex for ex in every if ex.state == "completed"]
        blocking = [ex for ex in active if ex.state in ("running", "park_requested")]
        ready, running = self._readiness()  # the one rule, shared with wait_prepared
        return AgentStatus(
            state="accepting" if self._accepting else "preparing",
            ready_to_commit=ready,
            running=running,
            parked=len(with_boundary) + len(without_boundary),
            parked_with_boundary=len(with_boundary),
            parked_without_boundary=len(without_boundary),
            completed_unacknowledged=len(completed),
            acknowledged_completed=len(self._acknowledged),
            active=len(active),
            blocking_attempts=[ex.view() for ex in blocking],
            completed_unacknowledged_attempts=[ex.view() for ex in completed],
            executions=[ex.view() for ex in every],
            selected_boundaries=[
                SelectedBoundary(rollout_id=ex.rollout_id, attempt_index=ex.attempt_index,
                                 boundary_index=ex.boundary.boundary_index, turn_index=ex.boundary.turn,
                                 boundary_kind=ex.boundary.boundary_kind,
                                 resource_state_revisions=dict(ex.boundary.resource_state_revisions))
                for ex in with_boundary if ex.boundary is not None],
        )


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# -- the participant ---------------------------------------------------------------------------------
def whitebox_agent_declaration(name: str, **fields: Any) -> Capabilities:
    """The declaration of a whitebox agent: ``responses_api_agents``, ``export_restore``,
    ``serialized_per_session``, one worker, and the four agent features (:data:`AGENT_FEATURES`).
    ``name`` is NeMo-RL's participant name: the agent's files go to ``agent/instance-<sha256(name)>``."""
    values: dict[str, Any] = {
        "component": "responses_api_agents", "name": name, "checkpoint_mode": "export_restore",
        "concurrency_contract": "serialized_per_session",
        "multi_process": MultiProcess(mode="single_worker", num_workers=1), "features": list(AGENT_FEATURES)}
    values.update(fields)
    return Capabilities(**values)


class AgentParticipant(abc.ABC):
    """An agent server's side of the agent checkpoint routes.

    The kit owns the phases, the registry (:class:`AgentExecutions`) and the files; the agent
    declares itself and is told of four events. Each hook runs on the server's event loop, inside the
    route call; an exception from it fails that call (409 is not implied: raise
    :class:`~gymkit.fence.ControlError` to choose the code, anything else is 500 ``control_error``).
    """

    @abc.abstractmethod
    def declaration(self) -> Capabilities:
        """The capability declaration (usually :func:`whitebox_agent_declaration`). Its ``name`` is
        the agent instance name of the checkpoint files."""

    async def on_restore(self, records: list[AgentBoundaryRecord]) -> None:
        """``restore`` read and verified ``records`` (the parked executions of the source checkpoint,
        attempt n each). After this hook returns, the kit tombstones each source attempt and keeps
        each record as the continuation of attempt n+1: the first ``begin(rid, n+1)`` after resume
        gets it as ``execution.continuation`` and continues from it (its new boundaries carry
        attempt n+1). Raise to refuse the restore: nothing is installed then. Default: nothing."""

    async def on_discard(self, rollout_id: str, attempt_index: int) -> None:
        """The restored continuation of replacement attempt (rid, n) was dropped
        (``discard-restored-continuation``): its ``/run`` starts from scratch. Default: nothing."""

    async def on_retire(self, rollout_id: str, attempt_index: int) -> None:
        """Attempt (rid, n) was tombstoned by ``retire`` (its execution, if any, was removed and its
        task cancelled): free what the agent holds for it. Default: nothing."""

    async def on_resume(self) -> None:
        """``resume`` reopened admission and released the parked executions. Default: nothing."""


# -- files (CONTROL.md §6) ----------------------------------------------------------------------------
def _refused(code: str, exc: Exception) -> ControlError:
    return ControlError(code, f"{type(exc).__name__}: {exc}")


def check_continuation_index(roots: Sequence[AgentContinuationRoot], records: Sequence[AgentBoundaryRecord]) -> None:
    """The continuation roots are exactly those of ``records``: one per record with a last call id,
    same (rid, n, exact capture key, call id), revisions equal unless the root's are null."""
    expected: dict[tuple[str, int, str, str], dict[str, int]] = {}
    for r in records:
        if r.last_committed_model_call_id:
            ident = (r.rollout_id, r.attempt_index, capture_key(r.rollout_id, r.attempt_index),
                     r.last_committed_model_call_id)
            expected[ident] = dict(r.resource_state_revisions)
    actual = [(x.rollout_id, x.attempt_index, x.capture_key, x.last_committed_model_call_id) for x in roots]
    if len(set(actual)) != len(actual) or set(actual) != set(expected):
        raise ControlError("agent_checkpoint_error", "the agent continuation index does not match the committed "
                                                     f"boundary records ({len(actual)} roots, {len(expected)} expected)")
    for root, ident in zip(roots, actual, strict=True):
        if root.resource_state_revisions is not None and root.resource_state_revisions != expected[ident]:
            raise ControlError("agent_checkpoint_error", f"continuation root {root.capture_key!r}: resource revisions "
                                                         f"{root.resource_state_revisions} differ from its record's "
                                                         f"{expected[ident]}")


def read_agent_checkpoint(checkpoint_dir: str, instance_name: str | None
                          ) -> tuple[AgentManifest, list[AgentBoundaryRecord], str]:
    """The committed agent folder of ``instance_name`` in ``checkpoint_dir``, every digest checked:
    its manifest, its boundary records, and the manifest digest. ``agent_checkpoint_error`` if it is
    missing, corrupt, of another instance, or its continuation index disagrees with its records."""
    try:
        folder = checkpoint_root(checkpoint_dir) / agent_instance_dir(instance_name)
    except InvalidPathError as exc:
        raise _refused("agent_checkpoint_error", exc) from None
    if not (folder / MANIFEST_NAME).is_file():
        raise ControlError("agent_checkpoint_error", f"no committed agent manifest at {folder / MANIFEST_NAME}")
    try:
        manifest, records, roots, digest = read_agent_folder(folder)  # the digest of the bytes it checked
    except (SnapshotError, OSError) as exc:
        raise _refused("agent_checkpoint_error", exc) from None
    if manifest.instance_name != instance_name:
        raise ControlError("agent_checkpoint_error", f"{folder / MANIFEST_NAME} belongs to agent instance "
                                                     f"{manifest.instance_name!r}, not {instance_name!r}")
    check_continuation_index(roots, records)
    return manifest, records, digest


def commit_agent_checkpoint(checkpoint_dir: str, checkpoint_id: str, instance_name: str | None,
                            records: Sequence[AgentBoundaryRecord], *,
                            encode: Callable[[AgentBoundaryRecord], bytes] = record_json) -> AgentCommitResponse:
    """Write the agent folder (archives, ``agent-index.jsonl``, ``continuations.jsonl``, then
    ``manifest.json``) and answer ``{records, manifest_digest, continuation_index}``. A folder that
    already holds a manifest is validated instead (same checkpoint id and instance) and answered
    with its digest: a repeated commit writes nothing. ``encode``: each record's member bytes
    (:meth:`AgentExecutions.member_json` gives those encoded when the boundary was recorded)."""
    try:
        folder = checkpoint_root(checkpoint_dir) / agent_instance_dir(instance_name)
    except InvalidPathError as exc:
        raise _refused("agent_checkpoint_error", exc) from None
    if (folder / MANIFEST_NAME).exists():
        manifest, found, digest = read_agent_checkpoint(checkpoint_dir, instance_name)
        if manifest.checkpoint_id != checkpoint_id:
            raise ControlError("agent_checkpoint_error", f"{folder / MANIFEST_NAME} belongs to checkpoint "
                                                         f"{manifest.checkpoint_id!r}, not {checkpoint_id!r}")
        return AgentCommitResponse(records=len(found), manifest_digest=digest,
                                   continuation_index=manifest.continuation_index)
    try:
        manifest, digest = write_agent_dir(checkpoint_dir, checkpoint_id, instance_name, records, encode=encode)
    except (SnapshotError, OSError) as exc:
        raise _refused("agent_checkpoint_error", exc) from None
    return AgentCommitResponse(records=manifest.records, manifest_digest=digest,
                               continuation_index=manifest.continuation_index)


# -- the routes -----------------------------------------------------------------------------------------
def agent_router(participant: AgentParticipant, executions: AgentExecutions, fence: Fence, token: str, *,
                 capabilities: bool = True) -> APIRouter:
    """Every ``/ng-control/v1/agent-checkpoint/*`` route (CONTROL.md §4), plus ``GET capabilities``
    unless ``capabilities`` is False (when the server mounts it itself). ``app.include_router(...)``.

    Fenced (replayed per (checkpoint_id, operation), §2): ``prepare`` (idle -> prepared; closes
    admission and asks every running execution to park; answers as soon as nothing runs, 409
    ``agent_prepare_incomplete`` if it is not ready then or at the deadline: fence back to idle,
    admission stays closed), ``commit`` (prepared -> committed_paused), ``restore`` (idle ->
    restored_paused), ``resume`` (retires the id; reopens admission). Unfenced, with the phase check
    only: ``status`` (any phase), ``retire`` (idle, preparing, prepared),
    ``discard-restored-continuation`` (restored_paused). No phase: ``acknowledge``,
    ``acknowledge-completed``, ``completion-receipt``.
    """
    router = APIRouter(prefix=CONTROL_PREFIX)
    routes = ControlRoutes(router, token)
    if capabilities:
        capabilities_route(router, participant.declaration, fence)
    fence.listeners.append(lambda _phase: executions.poke())  # a resume or failure wakes a waiting prepare

    def instance_name() -> str:
        return participant.declaration().name

    async def acknowledge(receipt: CompletionReceipt) -> AcknowledgeResponse:
        return AcknowledgeResponse(**executions.acknowledge(receipt))

    async def acknowledge_completed(req: AcknowledgeCompletedRequest) -> AcknowledgeCompletedResponse:
        return AcknowledgeCompletedResponse(acknowledged=executions.acknowledge_completed(req.executions))

    async def completion_receipt(q: AttemptQuery) -> CompletionReceipt:
        return executions.completion_receipt(q.rollout_id, q.attempt_index)

    async def prepare(req: ControlRequest) -> AgentStatus:
        cid = req.checkpoint_id

        async def run() -> AgentStatus:
            asked = executions.request_park()
            ready = False
            try:
                report = await executions.wait_prepared(req.deadline_ts, stop=lambda: fence.retired(cid))
                if fence.retired(cid):
                    raise ControlError("stale_checkpoint", f"checkpoint {cid!r} was resumed while its prepare waited")
                if not report.ready_to_commit:
                    raise ControlError("agent_prepare_incomplete",
                                       f"agent prepare is incomplete: running={report.running}, "
                                       f"parked_without_boundary={report.parked_without_boundary}, "
                                       f"completed_unacknowledged={report.completed_unacknowledged}")
                ready = True
                return report
            finally:
                if not ready:
                    executions.cancel_park_requests(asked)

        return await fence.run(cid, "agent-checkpoint/prepare", run, allowed=PREPARE_PHASES, entering="preparing",
                               success="prepared", deadline_ts=req.deadline_ts)

    async def status(q: CheckpointQuery) -> AgentStatus:
        fence.check(q.checkpoint_id, None)
        return msgspec.structs.replace(executions.status(), checkpoint_id=q.checkpoint_id)

    async def commit(req: CheckpointDirRequest) -> AgentCommitResponse:
        async def run() -> AgentCommitResponse:
            records = executions.records_for_commit()
            # The fence holds the collector off while the phase is "committing" (gymkit.collector).
            return await asyncio.to_thread(commit_agent_checkpoint, req.checkpoint_dir, req.checkpoint_id,
                                           instance_name(), records, encode=executions.member_json)

        return await fence.run(req.checkpoint_id, "agent-checkpoint/commit", run, allowed=COMMIT_PHASES,
                               entering="committing", success="committed_paused")

    async def restore(req: CheckpointDirRequest) -> AgentRestoreResponse:
        async def run() -> AgentRestoreResponse:
            with collector_held(keep=True):
                manifest, records, _ = await asyncio.to_thread(read_agent_checkpoint, req.checkpoint_dir,
                                                               instance_name())
                await participant.on_restore(list(records))
                executions.install_restored(records)
            return AgentRestoreResponse(records=len(records), source_checkpoint_id=manifest.checkpoint_id,
                                        continuation_index=manifest.continuation_index)

        return await fence.run(req.checkpoint_id, "agent-checkpoint/restore", run, allowed=RESTORE_PHASES,
                               entering="restoring", success="restored_paused")

    async def resume(req: ControlRequest) -> AgentResumeResponse:
        async def run() -> AgentResumeResponse:
            released = executions.reopen()
            await participant.on_resume()
            return AgentResumeResponse(state="accepting", released=released)

        return await fence.run(req.checkpoint_id, "agent-checkpoint/resume", run, allowed=RESUME_PHASES,
                               entering=None, success="idle", retire=True)

    async def retire(req: AttemptRequest) -> dict[str, bool]:
        fence.check(req.checkpoint_id, RETIRE_PHASES)
        answer = executions.retire(req.rollout_id, req.attempt_index)
        if answer["tombstoned"]:
            await participant.on_retire(req.rollout_id, req.attempt_index)
        return answer

    async def discard(req: AttemptRequest) -> DiscardResponse:
        fence.check(req.checkpoint_id, DISCARD_PHASES)
        discarded = executions.discard_restored(req.rollout_id, req.attempt_index)
        if discarded:
            await participant.on_discard(req.rollout_id, req.attempt_index)
        return DiscardResponse(discarded=discarded)

    p = "/agent-checkpoint"
    routes.post(f"{p}/acknowledge", CompletionReceipt, acknowledge)
    routes.post(f"{p}/acknowledge-completed", AcknowledgeCompletedRequest, acknowledge_completed)
    routes.get(f"{p}/completion-receipt", AttemptQuery, completion_receipt)
    routes.post(f"{p}/prepare", ControlRequest, prepare)
    routes.get(f"{p}/status", CheckpointQuery, status)
    routes.post(f"{p}/commit", CheckpointDirRequest, commit)
    routes.post(f"{p}/restore", CheckpointDirRequest, restore)
    routes.post(f"{p}/resume", ControlRequest, resume)
    routes.post(f"{p}/retire", AttemptRequest, retire)
    routes.post(f"{p}/discard-restored-continuation", AttemptRequest, discard)
    return router
