"""Gym's resources checkpoint side for a stateful resources server (CONTROL.md §4 "Resources
checkpoint", §2, §6).

Three pieces, for one resources server process:

* :class:`ResourceSessions`: the sessions the server holds, each bound to one rollout attempt
  (rid, n) with its state revision and the receipts of its mutations, plus the server's resources
  admission. Its :meth:`~ResourceSessions.mutation` context runs one data-plane call with Gym's
  checks, in Gym's order; the server answers a refusal (:class:`~gymkit.fence.ControlError`) with
  :func:`data_plane_response` (409 ``{"error": {"code", "message"}}``).
* :class:`ResourcesParticipant`: the declaration and the export/import of a session's state.
* :func:`resources_router`: every ``/ng-control/v1/resources-checkpoint/*`` route.

**A session's life.** A ``start`` call (seed/reset) binds (rid, n) at revision 0. Every successful
non-read call bumps the revision by one and answers it in ``x-nemo-gym-resource-state-revision``;
a call may name the revision it expects (``x-nemo-gym-expected-resource-state-revision``) and is
refused ``resource_revision_mismatch`` otherwise. A call with a request id
(``x-nemo-gym-resource-request-id``, required for every non-read call) leaves a receipt: repeating
the id with the same input replays the stored answer instead of running again. A ``terminal`` call
(verify) ends the session; its receipts stay (bounded) so a retry still replays.

**Checkpoints.** ``prepare`` closes admission and exports every bound session under its lock;
``commit`` writes ``resources/<server_name>/<rid>.a<n>.json`` (one ResourceSnapshot each) and the
manifest; ``restore`` (only in a fresh process: ``unsafe_resources_restore``) loads them as attempt
n+1, keeping their receipts, and tombstones attempt n; ``resume`` reopens admission. A failed
prepare or restore leaves admission closed and the phase idle (CONTROL.md §2).

**Agent revisions on restore.** Gym ``020d836e`` checks the snapshots against the revisions the
agents' committed boundaries saw, but reads them from an agent manifest ``files`` map that the
``9380654e`` archive format does not have. Here the check reads the agents' dependency index (for
every ``agent/**/manifest.json`` in the same ``checkpoint_dir``: the continuation roots'
``resource_state_revisions``, and the archive member of a record without a root, each checked
against its reference or index row; :func:`gymkit.checkpoint_dir.iter_resource_dependencies`), not
every record, so that S resources servers restoring N rollouts read N small rows each rather than
N records each. It goes one way: every session an agent boundary depends on must be in the
checkpoint at exactly that revision (``resource_revision_mismatch``); a session no boundary names is
restored as it is.
``resources_router(check_agent_revisions=False)`` turns it off. Gym has no index per resources
server, so each server still reads every agent's rows (S x N in all); the resources servers hosted
in one process share one read (:mod:`gymkit.agent_dependencies`).
"""

from __future__ import annotations

import abc
import asyncio
import base64
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Response

from gymkit.agent_dependencies import AgentDependencies
from gymkit.checkpoint_dir import (
    checkpoint_root,
    manifest_digest,
    read_resources_dir,
    receipt_json,
    record_json,
    session_json,
    write_resources_dir,
)
from gymkit.collector import collector_held
from gymkit.control_http import ControlRoutes, DeadlineQuery, capabilities_route, json_response
from gymkit.fence import ControlError, Fence
from schemas.control import (
    CONTROL_PREFIX,
    HEADER_RESOURCE_REVISION,
    AttemptRequest,
    Capabilities,
    CheckpointDirRequest,
    ControlRequest,
    InventoryEntry,
    MultiProcess,
    ResourcesCommitResponse,
    ResourcesPrepareResponse,
    ResourcesRestoreResponse,
    ResourcesResumeResponse,
    ResourcesRetireResponse,
)
from schemas.errors import InvalidPathError, SnapshotError
from schemas.gym_files import MANIFEST_NAME, MutationReceipt, ResourceSnapshot, resources_dir

#: The phases each resources route allows (CONTROL.md §4).
PREPARE_PHASES = ("idle",)
COMMIT_PHASES = ("prepared",)
RESTORE_PHASES = ("idle",)
RESUME_PHASES = ("idle", "prepared", "committed_paused", "restored_paused")
RETIRE_PHASES = ("preparing", "prepared")
STATUS_PHASES = ("preparing", "prepared", "committing", "committed_paused", "restoring", "restored_paused")

RouteKind = Literal["read", "start", "mutation", "terminal"]
Key = tuple[str, int]


def _key_text(key: Key) -> str:
    return f"rollout {key[0]!r} attempt {key[1]}"


class RevisionMismatch(ControlError):
    """``resource_revision_mismatch``; the data-plane body also carries both revisions (CONTROL.md §1)."""

    def __init__(self, expected: int | None, actual: int | None, detail: str) -> None:
        super().__init__("resource_revision_mismatch", detail)
        self.expected = expected
        self.actual = actual


def data_plane_body(exc: ControlError) -> dict[str, Any]:
    """A data-plane refusal's body: ``{"error": {"code", "message"}}`` (the control routes say
    ``detail``; the resources data plane says ``message``), plus ``expected_revision`` and
    ``actual_revision`` for a revision mismatch."""
    error: dict[str, Any] = {"code": exc.code, "message": exc.detail}
    if isinstance(exc, RevisionMismatch):
        error |= {"expected_revision": exc.expected, "actual_revision": exc.actual}
    return {"error": error}


def data_plane_response(exc: ControlError) -> Response:
    """:func:`data_plane_body` as its status (409)."""
    return json_response(data_plane_body(exc), exc.status)


def input_digest(method: str, path: str, query: bytes | str, body: bytes, content_type: str | None = None) -> str:
    """The digest a mutation receipt binds its request by: SHA-256 hex of method, path, query, the
    content type (lower-cased, parameters sorted) and the body, NUL-separated. A request id reused
    with another digest is refused ``resource_request_receipt_error``."""
    if isinstance(query, str):
        query = query.encode()
    ctype = ""
    if content_type:
        media, *params = content_type.split(";")
        ctype = ";".join([media.strip().lower(), *sorted(p.strip().lower() for p in params if p.strip())])
    h = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), query, ctype.encode(), body):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()


class Mutation:
    """One admitted data-plane call, inside its session's lock (see :meth:`ResourceSessions.mutation`).

    ``replay`` set: the request id was seen with the same input; answer the stored response
    (``status``, ``headers``, ``body_base64``) and change nothing. Otherwise run the call and answer
    through :meth:`respond`, refusals included.
    """

    def __init__(self, sessions: ResourceSessions, key: Key, kind: RouteKind, request_id: str | None,
                 expected_revision: int | None, digest: str | None, revision: int | None,
                 replay: MutationReceipt | None = None) -> None:
        self._sessions = sessions
        self.rollout_id, self.attempt_index = key
        self.kind = kind
        self.request_id = request_id
        self.expected_revision = expected_revision
        self.input_digest = digest
        self.revision = revision  # the session's revision before this call (None: not bound yet)
        self.replay = replay
        self.terminal = kind == "terminal"  # a handler may end the session on another kind too
        self.resulting_revision: int | None = None
        self.receipt: MutationReceipt | None = None
        self.answered = replay is not None

    def respond(self, status: int, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """The call's answer: returns the headers to send (with the new revision after a successful
        non-read call). Binds the session on a successful ``start``, bumps its revision, records the
        receipt when the call had a request id, and ends the session after a successful terminal call."""
        if self.answered:
            raise RuntimeError("this call was already answered")
        self.answered = True
        successful = status < 400
        out = [(k, v) for k, v in headers if k.lower() != HEADER_RESOURCE_REVISION]
        if successful and self.kind != "read":
            self.resulting_revision = (self.revision or 0) + 1
            out.append((HEADER_RESOURCE_REVISION, str(self.resulting_revision)))
        if self.request_id is not None:
            assert self.input_digest is not None
            self.receipt = MutationReceipt(
                request_id=self.request_id, expected_revision=self.expected_revision, input_digest=self.input_digest,
                status=status, headers=[(k, v) for k, v in out], body_base64=base64.b64encode(body).decode("ascii"),
                resulting_revision=self.resulting_revision)  # Gym: null when refused
        self._sessions._complete(self, successful)
        return out


class _Lock:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class ResourceSessions:
    """The sessions of one resources server, their revisions and receipts, and its admission.

    ``max_receipts_per_session`` bounds one session's receipts (``resource_receipt_capacity_exhausted``);
    ended sessions keep their receipts, up to ``max_retired_receipt_sessions`` sessions (older ones
    are evicted: their attempts are refused ``resource_receipt_evicted``, up to
    ``max_evicted_receipt_tombstones`` remembered, beyond which every attempt is). A server started
    to restore (``restore_expected``) refuses calls and a resume until it has restored.
    """

    def __init__(self, *, max_receipts_per_session: int = 1024, max_retired_receipt_sessions: int = 1024,
                 max_evicted_receipt_tombstones: int = 4096, restore_expected: bool = False) -> None:
        if max_receipts_per_session < 1 or max_retired_receipt_sessions < 0 or max_evicted_receipt_tombstones < 0:
            raise ValueError("receipt limits must be >= 0 and max_receipts_per_session >= 1")
        self.max_receipts_per_session = max_receipts_per_session
        self.max_retired_receipt_sessions = max_retired_receipt_sessions
        self.max_evicted_receipt_tombstones = max_evicted_receipt_tombstones
        self._revisions: dict[Key, int] = {}
        # Each session's receipts by request id, each with its bytes as a session file holds it
        # (receipt_json), encoded once when the receipt is made: a commit splices them (session_json)
        # instead of encoding every session's receipts (its history, one per mutation) again in the
        # pause. A restored receipt has no bytes here (None: a commit encodes it).
        self._receipts: dict[Key, dict[str, tuple[MutationReceipt, bytes | None]]] = {}
        self._retired_receipts: deque[Key] = deque()
        self._evicted: set[Key] = set()
        self._evicted_saturated = False
        self._tombstones: set[Key] = set()
        self._uncertain: dict[Key, str] = {}
        self._locks: dict[Key, _Lock] = {}
        self._prepared: list[ResourceSnapshot] = []
        self._prepare_lock = asyncio.Lock()
        self._served = False  # stateful traffic was served: restore is no longer safe
        self._untracked = False  # stateful traffic without an execution identity: a checkpoint would miss it
        self._restore_expected = restore_expected
        self._accepting = not restore_expected

    # -- inspection ------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """Resources admission (``accepting``); False from prepare or restore (even failed) to resume."""
        return self._accepting

    def is_bound(self, rollout_id: str, attempt_index: int) -> bool:
        return (rollout_id, attempt_index) in self._revisions

    def revision(self, rollout_id: str, attempt_index: int) -> int | None:
        return self._revisions.get((rollout_id, attempt_index))

    def receipt(self, rollout_id: str, attempt_index: int, request_id: str) -> MutationReceipt | None:
        kept = self._receipts.get((rollout_id, attempt_index), {}).get(request_id)
        return None if kept is None else kept[0]

    def tombstoned(self, rollout_id: str, attempt_index: int) -> bool:
        return (rollout_id, attempt_index) in self._tombstones

    def bound(self) -> list[Key]:
        return sorted(self._revisions)

    def fresh(self) -> bool:
        """No stateful traffic served and nothing held: the only state a restore may replace."""
        return not (self._served or self._revisions or self._receipts or self._uncertain)

    # -- the data plane -----------------------------------------------------------------------------
    def bind(self, rollout_id: str, attempt_index: int) -> None:
        """Bind a session created for (rid, n) (revision 0 unless bound already)."""
        self._served = True
        self._revisions.setdefault((rollout_id, attempt_index), 0)

    def record_untracked_traffic(self) -> None:
        """A stateful call without an execution identity was served: a later prepare is refused
        (``resources_checkpoint_error``), since it could not export that state."""
        self._served = self._untracked = True

    def mark_uncertain(self, rollout_id: str, attempt_index: int, reason: str) -> None:
        """The outcome of a call on (rid, n) is unknown: its calls and a prepare are refused
        ``resource_mutation_uncertain`` until it is retired."""
        self._uncertain[(rollout_id, attempt_index)] = reason

    def _evicted_key(self, key: Key) -> bool:
        return self._evicted_saturated or key in self._evicted

    def _admit(self, key: Key) -> None:
        if key in self._tombstones:
            raise ControlError("stale_attempt", f"{_key_text(key)} was retired (tombstoned)")
        if not self._accepting:
            raise ControlError("resources_admission_closed", "resources admission is closed while a checkpoint holds "
                                                             "the server (until its resume)")
        self._recheck(key)

    def _recheck(self, key: Key) -> None:
        if self._evicted_key(key):
            raise ControlError("resource_receipt_evicted", f"the receipts of {_key_text(key)} were evicted; the "
                                                           "execution cannot be replayed")
        if (reason := self._uncertain.get(key)) is not None:
            raise ControlError("resource_mutation_uncertain", f"the outcome of a call on {_key_text(key)} is "
                                                              f"uncertain: {reason}")

    @asynccontextmanager
    async def lock(self, rollout_id: str, attempt_index: int, timeout: float | None = None) -> AsyncIterator[None]:
        """Hold the session's lock (calls on one session run one at a time: ``serialized_per_session``)."""
        key = (rollout_id, attempt_index)
        entry = self._locks.setdefault(key, _Lock())
        entry.users += 1
        acquired = False
        try:
            if timeout is None or entry.users == 1:
                # users == 1: nobody else holds or waits for it, so acquire() returns without waiting.
                # wait_for would run it as a task: three loop turns for each of the thousands of
                # sessions a prepare exports.
                await entry.lock.acquire()
            else:
                await asyncio.wait_for(entry.lock.acquire(), timeout=timeout)
            acquired = True
            yield
        finally:
            if acquired:
                entry.lock.release()
            entry.users -= 1
            if entry.users == 0 and not entry.lock.locked() and self._locks.get(key) is entry:
                del self._locks[key]

    @asynccontextmanager
    async def mutation(self, rollout_id: str, attempt_index: int, *, kind: RouteKind = "mutation",
                       request_id: str | None = None, expected_revision: int | None = None,
                       digest: str | None = None) -> AsyncIterator[Mutation]:
        """Admit one data-plane call on (rid, n) and hold its session's lock while it runs.

        Refusals (:class:`ControlError`, in this order): ``stale_attempt`` (tombstoned),
        ``resources_admission_closed``, ``resource_receipt_evicted``, ``resource_mutation_uncertain``,
        ``resource_request_receipt_error`` (a non-read call without a request id); then, under the
        lock: the same again, ``resource_request_receipt_error`` (a request id reused with another
        expected revision or input), ``resources_session_unbound`` (a non-start call before a
        successful start), :class:`RevisionMismatch`, ``resource_receipt_capacity_exhausted``.
        An exception from the body, or a non-read call leaving it unanswered, makes the session's
        outcome uncertain (:meth:`mark_uncertain`). ``digest`` is the request's
        :func:`input_digest` (required with a request id).
        """
        key = (rollout_id, attempt_index)
        self._admit(key)
        if kind != "read" and request_id is None:
            raise ControlError("resource_request_receipt_error",
                               "checkpoint-managed resource mutations require a resource request id")
        if request_id is not None and digest is None:
            raise ValueError("a request with a request id needs its input digest")
        async with self.lock(rollout_id, attempt_index):
            self._admit(key)
            if request_id is not None and (old := self.receipt(rollout_id, attempt_index, request_id)) is not None:
                if old.expected_revision != expected_revision or old.input_digest != digest:
                    raise ControlError("resource_request_receipt_error", f"request id {request_id!r} was reused with "
                                                                         "another expected revision or input")
                yield Mutation(self, key, kind, request_id, expected_revision, digest, self.revision(*key), old)
                return
            if kind != "start" and key not in self._revisions:
                raise ControlError("resources_session_unbound", f"{_key_text(key)} has no successful start "
                                                                "(seed/reset) binding")
            actual = self._revisions.get(key)
            if expected_revision is not None and actual != expected_revision:
                raise RevisionMismatch(expected_revision, actual, f"expected resource revision {expected_revision}, "
                                                                  f"but the current revision is {actual}")
            if request_id is not None and len(self._receipts.get(key, {})) >= self.max_receipts_per_session:
                raise ControlError("resource_receipt_capacity_exhausted",
                                   f"resource receipt capacity is exhausted for {_key_text(key)}")
            m = Mutation(self, key, kind, request_id, expected_revision, digest, actual)
            try:
                yield m
            except BaseException as exc:
                if not m.answered:
                    self.mark_uncertain(*key, f"the handler raised {type(exc).__name__} before it answered")
                raise
            if not m.answered and kind != "read":
                self.mark_uncertain(*key, "the handler finished without an answer")

    def _complete(self, m: Mutation, successful: bool) -> None:
        key = (m.rollout_id, m.attempt_index)
        if successful and m.kind == "start":
            self.bind(*key)
        terminal = successful and m.terminal
        if m.resulting_revision is not None:
            if terminal:
                self._revisions.pop(key, None)
            else:
                self._revisions[key] = m.resulting_revision
        if m.receipt is not None:
            self._receipts.setdefault(key, {})[m.receipt.request_id] = (m.receipt, receipt_json(m.receipt))
        if terminal:
            self.end_session(*key, keep_receipts=True)

    def end_session(self, rollout_id: str, attempt_index: int, *, keep_receipts: bool = False) -> None:
        """Forget the session of (rid, n). ``keep_receipts``: its receipts stay so a retried request
        still replays (bounded: the oldest ended sessions' receipts are evicted)."""
        key = (rollout_id, attempt_index)
        self._revisions.pop(key, None)
        self._uncertain.pop(key, None)
        if keep_receipts and key in self._receipts:
            if key not in self._retired_receipts:
                self._retired_receipts.append(key)
            while len(self._retired_receipts) > self.max_retired_receipt_sessions:
                old = self._retired_receipts.popleft()
                self._receipts.pop(old, None)
                if not self._evicted_saturated:
                    self._evicted.add(old)
                    if len(self._evicted) > self.max_evicted_receipt_tombstones:
                        self._evicted.clear()
                        self._evicted_saturated = True
        else:
            self._receipts.pop(key, None)
            if key in self._retired_receipts:
                self._retired_receipts.remove(key)

    # -- the checkpoint side -----------------------------------------------------------------------
    def close_admission(self) -> None:
        self._accepting = False

    async def prepare(self, deadline_ts: float, export: Callable[[str, int], Awaitable[Any]]
                      ) -> ResourcesPrepareResponse:
        """Close admission, then export every bound session (sorted) under its lock with ``export``.
        ``resources_checkpoint_error`` if untracked stateful traffic was served, or the deadline
        passes with sessions left; ``resource_mutation_uncertain`` while any outcome is uncertain."""
        async with self._prepare_lock:
            self._accepting = False
            if self._untracked:
                raise ControlError("resources_checkpoint_error", "stateful traffic without an execution identity was "
                                                                 "served; its state cannot be exported")
            if self._uncertain:
                listed = ", ".join(f"{_key_text(k)}: {r}" for k, r in sorted(self._uncertain.items()))
                raise ControlError("resource_mutation_uncertain", "resource calls have uncertain outcomes and must be "
                                                                  f"retired before prepare ({listed})")
            snapshots = []
            for key in sorted(self._revisions):
                remaining = deadline_ts - time.time()
                if remaining <= 0:
                    raise ControlError("resources_checkpoint_error", "the deadline passed before every resources "
                                                                     "session was exported")
                try:
                    async with self.lock(*key, timeout=remaining):
                        revision = self._revisions.get(key)
                        if revision is None:  # ended while prepare waited for its lock
                            continue
                        state = await export(*key)
                except TimeoutError:
                    raise ControlError("resources_checkpoint_error", f"timed out exporting the session of "
                                                                     f"{_key_text(key)}") from None
                snapshots.append(ResourceSnapshot(
                    rollout_id=key[0], attempt_index=key[1], state_revision=revision, state=state,
                    mutation_receipts=[r for r, _ in self._receipts.get(key, {}).values()], created_at=time.time()))
            self._prepared = snapshots
            return ResourcesPrepareResponse(sessions=len(snapshots), state="prepared",
                                            inventory=_inventory(snapshots))

    def prepared_snapshots(self) -> list[ResourceSnapshot]:
        """What the last prepare exported (``resources_checkpoint_error`` while admission is open)."""
        if self._accepting:
            raise ControlError("resources_checkpoint_error", "resources state must be prepared before commit")
        return list(self._prepared)

    def session_json(self, snapshot: ResourceSnapshot) -> bytes:
        """``snapshot``'s session file (:func:`gymkit.checkpoint_dir.record_json`), each receipt's
        bytes those encoded when it was made here (any other, encoded now)."""
        if not snapshot.mutation_receipts:
            return record_json(snapshot)
        held = self._receipts.get((snapshot.rollout_id, snapshot.attempt_index), {})
        parts = []
        for r in snapshot.mutation_receipts:
            kept = held.get(r.request_id)
            encoded = kept[1] if kept is not None and kept[0] is r else None
            parts.append(receipt_json(r) if encoded is None else encoded)
        return session_json(snapshot, parts)

    async def retire_execution(self, rollout_id: str, attempt_index: int, deadline_ts: float | None = None,
                               retire_state: Callable[[str, int], Awaitable[None]] | None = None
                               ) -> ResourcesRetireResponse:
        """Tombstone (rid, n), then under its lock (waiting at most until ``deadline_ts``) drop its
        state (``retire_state``), its session, receipts and prepared snapshot."""
        key = (rollout_id, attempt_index)
        self._tombstones.add(key)
        timeout = None if deadline_ts is None else max(0.0, deadline_ts - time.time())
        try:
            async with self.lock(rollout_id, attempt_index, timeout=timeout):
                if retire_state is not None:
                    await retire_state(rollout_id, attempt_index)
                self.end_session(rollout_id, attempt_index)
                self._prepared = [s for s in self._prepared if (s.rollout_id, s.attempt_index) != key]
        except TimeoutError:
            raise ControlError("resources_checkpoint_error", f"timed out retiring the session of "
                                                             f"{_key_text(key)}") from None
        return ResourcesRetireResponse(retired=True, rollout_id=rollout_id, attempt_index=attempt_index)

    def check_restorable(self, snapshots: Sequence[ResourceSnapshot]) -> list[ResourceSnapshot]:
        """Close admission; ``unsafe_resources_restore`` unless the process is fresh; the
        replacement set (each snapshot as attempt n+1, receipts kept) after checking its receipts."""
        self._accepting = False
        if not self.fresh():
            raise ControlError("unsafe_resources_restore", "resources restore requires a fresh process that has not "
                                                           "served stateful traffic")
        out = []
        for snap in snapshots:
            ids = {r.request_id for r in snap.mutation_receipts}
            if len(ids) != len(snap.mutation_receipts) or len(ids) > self.max_receipts_per_session:
                raise ControlError("resources_checkpoint_error", "the receipts of "
                                                                 f"{_key_text((snap.rollout_id, snap.attempt_index))} "
                                                                 "are duplicated or exceed the per-session capacity")
            out.append(msgspec.structs.replace(snap, attempt_index=snap.attempt_index + 1))
        return out

    def install_restored(self, sources: Sequence[ResourceSnapshot], replacements: Sequence[ResourceSnapshot]) -> None:
        """Tombstone every source attempt and bind each replacement at its revision with its receipts."""
        self._tombstones.update((s.rollout_id, s.attempt_index) for s in sources)
        for snap in replacements:
            key = (snap.rollout_id, snap.attempt_index)
            self._revisions[key] = snap.state_revision
            if snap.mutation_receipts:
                self._receipts[key] = {r.request_id: (r, None) for r in snap.mutation_receipts}
        self._restore_expected = False

    def reopen(self) -> None:
        """Resume: admission opens and the prepared export is dropped (``resources_checkpoint_error``
        if the server was started to restore and has not)."""
        if self._restore_expected:
            raise ControlError("resources_checkpoint_error", "this resources server was started to restore and has "
                                                             "not restored yet")
        self._accepting = True
        self._prepared = []

    def status(self) -> dict[str, Any]:
        """Gym's status fields (``state`` is the admission state, as Gym answers it)."""
        admission = "accepting" if self._accepting else "paused"
        return {
            "state": admission,
            "admission_state": admission,
            "sessions": len(self._revisions),
            "per_session": [
                {"rollout_id": rid, "attempt_index": n, "revision": rev,
                 "locked": bool((e := self._locks.get((rid, n))) and e.lock.locked())}
                for (rid, n), rev in sorted(self._revisions.items())],
            "lock_entries": len(self._locks),
            "locked_sessions": sum(e.lock.locked() for e in self._locks.values()),
            "tombstones": len(self._tombstones),
            "evicted_receipt_tombstones": len(self._evicted),
            "receipt_history_saturated": self._evicted_saturated,
            "uncertain_sessions": [{"rollout_id": k[0], "attempt_index": k[1], "reason": r}
                                   for k, r in sorted(self._uncertain.items())],
            "mutation_receipts": sum(len(r) for r in self._receipts.values()),
            "retired_receipt_sessions": len(self._retired_receipts),
            "prepared_inventory": msgspec.to_builtins(_inventory(self._prepared)),
        }


def _inventory(snapshots: Sequence[ResourceSnapshot]) -> list[InventoryEntry]:
    return [InventoryEntry(rollout_id=s.rollout_id, attempt_index=s.attempt_index, revision=s.state_revision,
                           mutation_receipts=len(s.mutation_receipts)) for s in snapshots]


# -- the participant ----------------------------------------------------------------------------------
def stateful_resources_declaration(name: str, **fields: Any) -> Capabilities:
    """A resources server whose sessions are exported: ``resources_servers``, ``export_restore``,
    ``serialized_per_session``, one worker. ``name`` must be the server's NeMo-RL participant name
    (its files go to ``resources/<name>/``)."""
    values: dict[str, Any] = {
        "component": "resources_servers", "name": name, "checkpoint_mode": "export_restore",
        "concurrency_contract": "serialized_per_session",
        "multi_process": MultiProcess(mode="single_worker", num_workers=1)}
    values.update(fields)
    return Capabilities(**values)


class ResourcesParticipant(abc.ABC):
    """A resources server's side of the resources checkpoint routes: what it declares, and how one
    session's state leaves and comes back. The kit calls these on the server's event loop."""

    @abc.abstractmethod
    def declaration(self) -> Capabilities:
        """The capability declaration (usually :func:`stateful_resources_declaration`); its ``name``
        is the server name of the checkpoint files."""

    @abc.abstractmethod
    async def export_state(self, rollout_id: str, attempt_index: int) -> Any:
        """The JSON-able state of the session bound to (rid, n), called by prepare under that
        session's lock (no call on it runs meanwhile)."""

    @abc.abstractmethod
    async def import_states(self, snapshots: list[ResourceSnapshot]) -> None:
        """Restore: make ``snapshots`` the server's sessions, all at once (a half-loaded set must
        never serve). Each is already the replacement attempt (attempt n+1 of the saved attempt n)
        with its saved revision and receipts. Raise to refuse: the kit then binds nothing."""

    async def retire_state(self, rollout_id: str, attempt_index: int) -> None:
        """``retire`` gave up (rid, n): drop its state (called under the session's lock). Default:
        nothing."""

    async def before_prepare(self) -> None:
        """``prepare`` closed admission and is about to export every bound session (under each one's
        lock). Default: nothing."""

    async def before_commit(self) -> None:
        """``commit`` is about to write the prepared sessions' files; raising fails the commit (nothing is
        written, the phase stays ``prepared``). Default: nothing."""

    async def on_resume(self) -> None:
        """``resume`` reopened admission. Default: nothing."""


# -- files (CONTROL.md §6) ------------------------------------------------------------------------------
def _refused(code: str, exc: Exception) -> ControlError:
    return ControlError(code, f"{type(exc).__name__}: {exc}")


def commit_resources_checkpoint(checkpoint_dir: str, checkpoint_id: str, server_name: str,
                                snapshots: Sequence[ResourceSnapshot], *,
                                encode: Callable[[ResourceSnapshot], bytes] = record_json) -> ResourcesCommitResponse:
    """Write ``resources/<server_name>/<rid>.a<n>.json`` for each snapshot, then ``manifest.json``;
    answer ``{sessions, manifest_digest}``. A folder that already holds a manifest is validated
    instead (same checkpoint id and server, every file's digest) and answered with its digest.
    ``encode``: each session file's bytes (:meth:`ResourceSessions.session_json` builds them from
    receipts encoded when they were made)."""
    try:
        folder = checkpoint_root(checkpoint_dir) / resources_dir(server_name)
        if (folder / MANIFEST_NAME).exists():
            manifest, _ = read_resources_dir(folder)
            if manifest.checkpoint_id != checkpoint_id or manifest.server_name != server_name:
                raise ControlError("resources_checkpoint_error",
                                   f"{folder / MANIFEST_NAME} belongs to checkpoint {manifest.checkpoint_id!r} of "
                                   f"server {manifest.server_name!r}, not {checkpoint_id!r} of {server_name!r}")
            digest = manifest_digest(folder)
        else:
            manifest, digest = write_resources_dir(checkpoint_dir, checkpoint_id, server_name, snapshots,
                                                   encode=encode)
    except (SnapshotError, OSError) as exc:
        raise _refused("resources_checkpoint_error", exc) from None
    assert digest is not None
    return ResourcesCommitResponse(sessions=len(manifest.files), manifest_digest=digest)


def load_resources_checkpoint(checkpoint_dir: str, server_name: str, *, check_agents: bool = True,
                              dependencies: AgentDependencies | None = None) -> tuple[str, list[ResourceSnapshot]]:
    """The committed folder of ``server_name``, every digest checked: (its checkpoint id, its
    snapshots). With ``check_agents``, every session an agent's committed boundary depends on
    (its ``resource_state_revisions`` names this server) must be there at that exact revision, else
    ``resource_revision_mismatch`` (see "Agent revisions on restore" in the module's docstring).
    ``dependencies``: the agents' indexes as read for the other resources servers of this process
    (:class:`gymkit.agent_dependencies.AgentDependencies`); a read of its own if None."""
    try:
        folder = checkpoint_root(checkpoint_dir) / resources_dir(server_name)
    except InvalidPathError as exc:
        raise _refused("resources_checkpoint_error", exc) from None
    if not (folder / MANIFEST_NAME).is_file():
        raise ControlError("resources_checkpoint_error", f"no committed resources manifest at {folder / MANIFEST_NAME}")
    try:
        manifest, by_name = read_resources_dir(folder)
        expected = ((dependencies or AgentDependencies()).revisions(checkpoint_dir, server_name)
                    if check_agents else {})
    except (SnapshotError, OSError) as exc:
        raise _refused("resources_checkpoint_error", exc) from None
    if manifest.server_name != server_name:
        raise ControlError("resources_checkpoint_error", f"{folder / MANIFEST_NAME} belongs to server "
                                                         f"{manifest.server_name!r}, not {server_name!r}")
    snapshots = [by_name[name] for name in sorted(by_name)]
    actual = {(s.rollout_id, s.attempt_index): s.state_revision for s in snapshots}
    for key, rev in sorted(expected.items()):
        if actual.get(key) != rev:
            raise RevisionMismatch(rev, actual.get(key), f"the agents' boundary of {_key_text(key)} saw revision {rev} "
                                                         f"of {server_name!r}; the checkpoint holds {actual.get(key)}")
    return manifest.checkpoint_id, snapshots


# -- the routes ---------------------------------------------------------------------------------------------
def resources_router(participant: ResourcesParticipant, sessions: ResourceSessions, fence: Fence, token: str, *,
                     capabilities: bool = True, check_agent_revisions: bool = True,
                     dependencies: AgentDependencies | None = None) -> APIRouter:
    """Every ``/ng-control/v1/resources-checkpoint/*`` route (CONTROL.md §4), plus ``GET
    capabilities`` unless ``capabilities`` is False.

    Fenced: ``prepare`` (idle -> prepared), ``commit`` (prepared -> committed_paused), ``restore``
    (idle -> restored_paused), ``resume`` (idle, prepared, committed_paused, restored_paused; retires
    the id). Unfenced: ``retire`` (preparing or prepared), ``status`` (any phase but idle and
    restore_failed_paused; ``checkpoint_id`` and ``deadline_ts`` in the query).
    ``check_agent_revisions``: restore checks the sessions against the agents' committed boundaries
    in the same ``checkpoint_dir`` (:func:`load_resources_checkpoint`). ``dependencies``: give the
    resources servers of one process the same :class:`~gymkit.agent_dependencies.AgentDependencies`
    so that their restores read the agents' indexes once; a router of its own reads them itself.
    """
    dependencies = dependencies or AgentDependencies()
    router = APIRouter(prefix=CONTROL_PREFIX)
    routes = ControlRoutes(router, token)
    if capabilities:
        capabilities_route(router, participant.declaration, fence)

    def server_name() -> str:
        return participant.declaration().name

    async def prepare(req: ControlRequest) -> ResourcesPrepareResponse:
        async def run() -> ResourcesPrepareResponse:
            sessions.close_admission()  # before the participant's hook: no call is admitted meanwhile
            await participant.before_prepare()
            return await sessions.prepare(req.deadline_ts, participant.export_state)

        return await fence.run(req.checkpoint_id, "resources-checkpoint/prepare", run, allowed=PREPARE_PHASES,
                               entering="preparing", success="prepared", deadline_ts=req.deadline_ts)

    async def commit(req: CheckpointDirRequest) -> ResourcesCommitResponse:
        async def run() -> ResourcesCommitResponse:
            snapshots = sessions.prepared_snapshots()
            await participant.before_commit()
            # The fence holds the collector off while the phase is "committing" (gymkit.collector).
            return await asyncio.to_thread(commit_resources_checkpoint, req.checkpoint_dir, req.checkpoint_id,
                                           server_name(), snapshots, encode=sessions.session_json)

        return await fence.run(req.checkpoint_id, "resources-checkpoint/commit", run, allowed=COMMIT_PHASES,
                               entering="committing", success="committed_paused")

    async def restore(req: CheckpointDirRequest) -> ResourcesRestoreResponse:
        async def run() -> ResourcesRestoreResponse:
            sessions.check_restorable([])  # closes admission; unsafe_resources_restore before any file is read
            with collector_held(keep=True):
                source_id, snapshots = await asyncio.to_thread(load_resources_checkpoint, req.checkpoint_dir,
                                                               server_name(), check_agents=check_agent_revisions,
                                                               dependencies=dependencies)
                replacements = sessions.check_restorable(snapshots)
                await participant.import_states(replacements)
                sessions.install_restored(snapshots, replacements)
            return ResourcesRestoreResponse(sessions=len(snapshots), source_checkpoint_id=source_id)

        return await fence.run(req.checkpoint_id, "resources-checkpoint/restore", run, allowed=RESTORE_PHASES,
                               entering="restoring", success="restored_paused")

    async def resume(req: ControlRequest) -> ResourcesResumeResponse:
        async def run() -> ResourcesResumeResponse:
            sessions.reopen()
            await participant.on_resume()
            return ResourcesResumeResponse(state="accepting")

        return await fence.run(req.checkpoint_id, "resources-checkpoint/resume", run, allowed=RESUME_PHASES,
                               entering=None, success="idle", retire=True)

    async def retire(req: AttemptRequest) -> ResourcesRetireResponse:
        fence.check(req.checkpoint_id, RETIRE_PHASES)
        return await sessions.retire_execution(req.rollout_id, req.attempt_index, req.deadline_ts,
                                               participant.retire_state)

    async def status(q: DeadlineQuery) -> dict[str, Any]:
        fence.check(q.checkpoint_id, STATUS_PHASES)
        return {"checkpoint_id": q.checkpoint_id, **sessions.status()}  # Gym's `state` is the admission state

    p = "/resources-checkpoint"
    routes.post(f"{p}/prepare", ControlRequest, prepare)
    routes.get(f"{p}/status", DeadlineQuery, status)
    routes.post(f"{p}/commit", CheckpointDirRequest, commit)
    routes.post(f"{p}/restore", CheckpointDirRequest, restore)
    routes.post(f"{p}/resume", ControlRequest, resume)
    routes.post(f"{p}/retire", AttemptRequest, retire)
    return router
