"""The phase machine behind ``/ng-control/v1`` and the FastAPI routes that expose it.

Every state-changing call is fenced by its ``checkpoint_id``: while one checkpoint is in progress
another id is refused (409 ``conflicting_checkpoint``), an id that already ended is refused (409
``stale_checkpoint``), and a repeated call gets the recorded answer (idempotent). Calls are
serialised by one lock, so the participant never sees two control operations at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from gymkit.bodies import BodyTooLarge, read_body
from gymkit.participant import CommitContext, Participant, part_prefix
from schemas.control import (
    CONTROL_PREFIX,
    MAX_BODY_BYTES,
    AcknowledgeRequest,
    Capabilities,
    CommitRequest,
    CommitResponse,
    ControlError,
    ControlRequest,
    DiscardRequest,
    PhaseResponse,
    RestoreRequest,
    RestoreResponse,
)
from schemas.errors import (
    InvalidPathError,
    InvalidRecordError,
    NotPublishedError,
    SnapshotError,
    TopologyMismatchError,
)
from schemas.identity import check_relative_path
from snapformat.draft import attach_part
from snapformat.reader import open_snapshot
from snapformat.snapshot_store import check_topology

log = logging.getLogger("gymkit")

_PAUSED_PHASES = ("prepared", "committing", "committed_paused", "restoring", "restored_paused")
_MAX_REMEMBERED = 256


class ControlRefused(Exception):
    """A refused control call: an HTTP status and a :class:`ControlError` body."""

    def __init__(self, status: int, error: str, reason: str, phase: str | None = None, checkpoint_id: str | None = None):
        super().__init__(reason)
        self.status = status
        self.body = ControlError(error=error, reason=reason, phase=phase, checkpoint_id=checkpoint_id)  # type: ignore[arg-type]


class ControlPlane:
    """Owns a participant's phase and answers the control calls for it."""

    def __init__(self, participant: Participant, token: str) -> None:
        if not token:
            raise ValueError("a control token is required")
        self.participant = participant
        self._token = token.encode()
        self.phase = "idle"
        self.checkpoint_id: str | None = None
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._answers: OrderedDict[tuple[str, str], tuple[int, bytes]] = OrderedDict()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._draining: asyncio.Future | None = None  # the participant's prepare, while it runs
        participant.admission_changed(self.admission())

    # -- helpers -----------------------------------------------------------------------------
    @property
    def caps(self) -> Capabilities:
        return self.participant.capabilities()

    @property
    def prefix(self) -> str:
        c = self.caps
        return part_prefix(c.component, c.name)

    def admission(self) -> str:
        if self.phase == "idle":
            return "accepting"
        return "draining" if self.phase == "preparing" else "paused"

    def _refuse(self, status: int, error: str, reason: str, cid: str | None = None) -> ControlRefused:
        return ControlRefused(status, error, reason, self.phase, cid or self.checkpoint_id)

    def _remember(self, op: str, cid: str, status: int, body: bytes) -> None:
        self._answers[(op, cid)] = (status, body)
        while len(self._answers) > _MAX_REMEMBERED:
            self._answers.popitem(last=False)

    def _end(self, cid: str) -> None:
        self._ended[cid] = None
        while len(self._ended) > _MAX_REMEMBERED:
            self._ended.popitem(last=False)

    async def _set_phase(self, phase: str, cid: str | None) -> None:
        async with self._changed:
            before = self.admission()
            self.phase, self.checkpoint_id = phase, cid
            if self.admission() != before:  # the participant admits work by this, not by the phase
                self.participant.admission_changed(self.admission())
            self._changed.notify_all()

    def _fence(self, cid: str, deadline: float | None, allowed: tuple[str, ...]) -> None:
        if cid in self._ended:
            raise self._refuse(409, "stale_checkpoint", f"checkpoint {cid!r} already ended", cid)
        if self.checkpoint_id not in (None, cid):
            raise self._refuse(409, "conflicting_checkpoint",
                               f"checkpoint {self.checkpoint_id!r} is in progress; {cid!r} refused", cid)
        if self.phase not in allowed:
            raise self._refuse(409, "wrong_phase", f"not allowed in phase {self.phase!r} (allowed: {', '.join(allowed)})", cid)
        if deadline is not None and time.time() >= deadline:
            raise self._refuse(409, "deadline_passed", f"deadline {deadline:.3f} has passed", cid)

    def status(self) -> PhaseResponse:
        return PhaseResponse(checkpoint_id=self.checkpoint_id, phase=self.phase, admission=self.admission(),  # type: ignore[arg-type]
                             in_flight=self.participant.in_flight())

    # -- operations --------------------------------------------------------------------------
    async def prepare(self, req: ControlRequest) -> tuple[int, bytes]:
        """Drain to a quiet point. The lock is not held while draining, so abort can interrupt."""
        async with self._lock:
            if (cached := self._answers.get(("prepare", req.checkpoint_id))) and self.checkpoint_id == req.checkpoint_id:
                return cached
            self._fence(req.checkpoint_id, req.deadline, ("idle", "preparing"))
            if self._draining is None or self._draining.done():
                await self._set_phase("preparing", req.checkpoint_id)
                self._draining = asyncio.ensure_future(self.participant.prepare(req.deadline))
            draining = self._draining
        try:
            await asyncio.wait_for(asyncio.shield(draining), timeout=max(0.0, req.deadline - time.time()))
        except TimeoutError:
            raise self._refuse(409, "deadline_passed",
                               f"could not reach a turn boundary before the deadline ({self.participant.in_flight()} "
                               "still in flight); call abort to resume", req.checkpoint_id) from None
        except asyncio.CancelledError:
            if not draining.cancelled():
                raise  # the HTTP request itself was cancelled
            raise self._refuse(409, "stale_checkpoint", f"checkpoint {req.checkpoint_id!r} was aborted while draining",
                               req.checkpoint_id) from None
        async with self._lock:
            if self.checkpoint_id != req.checkpoint_id or self.phase not in ("preparing", "prepared"):
                raise self._refuse(409, "stale_checkpoint", f"checkpoint {req.checkpoint_id!r} ended while draining",
                                   req.checkpoint_id)
            await self._set_phase("prepared", req.checkpoint_id)
            answer = (200, msgspec.json.encode(self.status()))
            self._remember("prepare", req.checkpoint_id, *answer)
            return answer

    async def wait_prepared(self, cid: str, wait_s: float) -> PhaseResponse:
        """Long poll: return when ``cid`` is prepared (or later), or after ``wait_s``."""
        end = time.monotonic() + max(0.0, min(wait_s, 60.0))
        async with self._changed:
            while not (self.checkpoint_id == cid and self.phase in _PAUSED_PHASES):
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except TimeoutError:
                    break
        return self.status()

    async def commit(self, req: CommitRequest) -> tuple[int, bytes]:
        async with self._lock:
            if (cached := self._answers.get(("commit", req.checkpoint_id))) and self.checkpoint_id == req.checkpoint_id:
                return cached
            self._fence(req.checkpoint_id, req.deadline, ("prepared",))
            if req.part_prefix != self.prefix:  # first: an unsafe prefix is a bad request too, not a bad record
                raise self._refuse(400, "bad_request", f"part_prefix must be {self.prefix!r}, got {req.part_prefix!r}")
            check_relative_path(req.part_prefix, where="part_prefix")
            try:  # a draft_url that names no draft is the caller's mistake (400), not this server's failure
                part = attach_part(req.draft_url, self.prefix, writer=f"{self.caps.component}:{self.caps.name}") \
                    if self.caps.checkpoint_mode == "export_restore" else None
            except (InvalidPathError, InvalidRecordError, NotPublishedError) as exc:
                raise self._refuse(400, "bad_request", f"draft_url {req.draft_url[:200]!r}: {exc}") from None
            await self._set_phase("committing", req.checkpoint_id)
            try:
                context = CommitContext(checkpoint_id=req.checkpoint_id, deadline=req.deadline, draft_url=req.draft_url,
                                        part_prefix=self.prefix, continuations=tuple(req.continuations))
                payload = await asyncio.wait_for(self.participant.commit(part, context),
                                                 timeout=max(0.0, req.deadline - time.time()))
                receipt = part.close() if part is not None else None
            except BaseException as exc:
                await self._set_phase("prepared", req.checkpoint_id)
                if isinstance(exc, ControlRefused):  # the participant refused: say the phase it is back in
                    raise ControlRefused(exc.status, exc.body.error, exc.body.reason, "prepared", req.checkpoint_id) from None
                if isinstance(exc, TimeoutError):
                    raise self._refuse(409, "deadline_passed", "commit did not finish before the deadline") from None
                if isinstance(exc, SnapshotError):
                    raise self._refuse(500, "internal", f"commit failed: {type(exc).__name__}: {exc}") from None
                raise
            await self._set_phase("committed_paused", req.checkpoint_id)
            answer = (200, msgspec.json.encode(CommitResponse(checkpoint_id=req.checkpoint_id, phase="committed_paused",
                                                              part=receipt, payload=payload)))
            self._remember("commit", req.checkpoint_id, *answer)
            return answer

    async def resume(self, req: ControlRequest, op: str = "resume") -> tuple[int, bytes]:
        """Resume (or abort): back to accepting. Repeating it for an ended checkpoint is a no-op."""
        async with self._lock:
            if req.checkpoint_id in self._ended and (cached := self._answers.get(("resume", req.checkpoint_id))):
                return cached
            allowed = ("preparing", "prepared", "committing", "committed_paused", "restored_paused")
            if op == "abort":
                allowed += ("failed_restore",)
            self._fence(req.checkpoint_id, None, allowed)  # no deadline check: resuming late is still right
            if self._draining is not None and not self._draining.done():
                self._draining.cancel()  # a prepare still draining is abandoned
            if self.phase == "failed_restore" or (op == "abort" and self.phase == "restored_paused"):
                await self.participant.reset()  # an aborted restore keeps nothing it loaded
            else:
                await self.participant.resume()
            self._end(req.checkpoint_id)
            await self._set_phase("idle", None)
            answer = (200, msgspec.json.encode(self.status()))
            self._remember("resume", req.checkpoint_id, *answer)
            return answer

    async def restore(self, req: RestoreRequest) -> tuple[int, bytes]:
        async with self._lock:
            if (cached := self._answers.get(("restore", req.checkpoint_id))) and self.checkpoint_id == req.checkpoint_id:
                return cached
            self._fence(req.checkpoint_id, req.deadline, ("idle",))
            if req.part_prefix != self.prefix:
                raise self._refuse(400, "bad_request", f"part_prefix must be {self.prefix!r}, got {req.part_prefix!r}")
            try:
                snapshot = open_snapshot(req.snapshot_url)
                check_topology(snapshot, req.topology_fingerprint)
                saved = snapshot.manifest.gym_commit.checkpoint_id if snapshot.manifest.gym_commit else None
                if saved is not None and saved != req.saved_checkpoint_id:
                    raise self._refuse(400, "bad_request", f"{req.snapshot_url} holds checkpoint {saved!r}, "
                                       f"not {req.saved_checkpoint_id!r}", req.checkpoint_id)
            except TopologyMismatchError as exc:
                raise self._refuse(409, "topology_mismatch", str(exc), req.checkpoint_id) from None
            except SnapshotError as exc:
                raise self._refuse(400, "bad_request", f"cannot open {req.snapshot_url}: {exc}", req.checkpoint_id) from None
            await self._set_phase("restoring", req.checkpoint_id)
            try:
                payload = await asyncio.wait_for(self.participant.restore(snapshot, self.prefix),
                                                 timeout=max(0.0, req.deadline - time.time()))
            except (SnapshotError, ControlRefused) as exc:
                if isinstance(exc, ControlRefused) and exc.status >= 500:
                    await self._set_phase("failed_restore", req.checkpoint_id)
                    raise ControlRefused(exc.status, exc.body.error, exc.body.reason, "failed_restore",
                                         req.checkpoint_id) from None
                # A refusal (4xx) is the participant's promise that it changed nothing: stay idle
                # without touching its state (it may hold live rollouts). A library error while
                # reading may have left something half-loaded: drop it, then stay idle. Either way
                # the caller needs no abort to try another snapshot.
                if isinstance(exc, ControlRefused):
                    await self._set_phase("idle", None)
                    raise ControlRefused(exc.status, exc.body.error, exc.body.reason, "idle", req.checkpoint_id) from None
                await self.participant.reset()
                await self._set_phase("idle", None)
                raise self._refuse(400, "invalid_record", f"restore refused: {type(exc).__name__}: {exc}",
                                   req.checkpoint_id) from None
            except BaseException as exc:
                await self._set_phase("failed_restore", req.checkpoint_id)
                if isinstance(exc, TimeoutError):
                    raise self._refuse(500, "internal", "restore did not finish before the deadline; call abort") from None
                raise
            await self._set_phase("restored_paused", req.checkpoint_id)
            answer = (200, msgspec.json.encode(RestoreResponse(checkpoint_id=req.checkpoint_id, phase="restored_paused",
                                                               payload=payload)))
            self._remember("restore", req.checkpoint_id, *answer)
            return answer

    async def acknowledge(self, req: AcknowledgeRequest) -> tuple[int, bytes]:
        async with self._lock:
            if self.caps.component != "agent":
                raise self._refuse(404, "bad_request", "acknowledge is an agent route")
            unknown = self.participant.unknown_rollouts(req.results)
            if unknown:
                names = ", ".join(f"{r.rollout_id}#{r.attempt_index}" for r in unknown[:5])
                raise self._refuse(404, "unknown_rollout", f"no finished result for {names}; nothing acknowledged")
            result = await self.participant.acknowledge(req.results)
            return 200, msgspec.json.encode(result)

    async def discard(self, req: DiscardRequest) -> tuple[int, bytes]:
        async with self._lock:
            if self.caps.component != "agent":
                raise self._refuse(404, "bad_request", "discard is an agent route")
            if (cached := self._answers.get((f"discard:{msgspec.json.encode(req.rollouts).decode()}", req.checkpoint_id))) \
                    and self.checkpoint_id == req.checkpoint_id:
                return cached
            self._fence(req.checkpoint_id, req.deadline, ("restored_paused",))
            unknown = self.participant.unknown_rollouts(req.rollouts)
            if unknown:
                names = ", ".join(f"{r.rollout_id}#{r.attempt_index}" for r in unknown[:5])
                raise self._refuse(404, "unknown_rollout", f"no restored continuation for {names}; nothing discarded")
            answer = (200, msgspec.json.encode(await self.participant.discard(req.rollouts)))
            self._remember(f"discard:{msgspec.json.encode(req.rollouts).decode()}", req.checkpoint_id, *answer)
            return answer

    # -- HTTP --------------------------------------------------------------------------------
    def check_token(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise ControlRefused(401, "unauthorized", "missing or wrong bearer token")

    def router(self) -> APIRouter:
        """The ``/ng-control/v1`` routes, to ``app.include_router(...)``."""
        r = APIRouter(prefix=CONTROL_PREFIX)

        async def body(request: Request, typ: Any) -> Any:
            self.check_token(request)
            try:
                raw = await read_body(request, MAX_BODY_BYTES)
            except BodyTooLarge as exc:
                raise ControlRefused(413, "too_large", str(exc)) from None
            try:
                return msgspec.json.decode(raw, type=typ)
            except msgspec.ValidationError as exc:
                raise ControlRefused(400, "bad_request", f"{typ.__name__}: {exc}") from None
            except msgspec.DecodeError as exc:
                raise ControlRefused(400, "bad_request", f"not valid JSON: {exc}") from None

        async def answer(coro) -> Response:
            try:
                status, payload = await coro
            except ControlRefused as exc:
                return Response(msgspec.json.encode(exc.body), status_code=exc.status, media_type="application/json")
            except SnapshotError as exc:
                err = ControlError(error="invalid_record", reason=str(exc), phase=self.phase, checkpoint_id=self.checkpoint_id)  # type: ignore[arg-type]
                return Response(msgspec.json.encode(err), status_code=400, media_type="application/json")
            except Exception as exc:  # a participant's bug: still a ControlError body, never a bare 500
                log.exception("control call failed")
                err = ControlError(error="internal", reason=f"{type(exc).__name__}: {exc}", phase=self.phase,  # type: ignore[arg-type]
                                   checkpoint_id=self.checkpoint_id)
                return Response(msgspec.json.encode(err), status_code=500, media_type="application/json")
            return Response(payload, status_code=status, media_type="application/json")

        async def run(request: Request, typ: Any, op) -> Response:
            async def go():
                return await op(await body(request, typ))
            return await answer(go())

        @r.get("/capabilities")
        async def capabilities(request: Request) -> Response:
            async def go():
                self.check_token(request)
                caps = msgspec.structs.replace(self.caps, phase=self.phase, admission=self.admission())
                return 200, msgspec.json.encode(caps)
            return await answer(go())

        @r.get("/status")
        async def status(request: Request) -> Response:
            async def go():
                self.check_token(request)  # before the query is parsed: a bad query needs the token too
                checkpoint_id = request.query_params.get("checkpoint_id")
                try:
                    wait_s = float(request.query_params.get("wait_s", "0"))
                except ValueError:
                    raise ControlRefused(400, "bad_request", "wait_s must be a number of seconds") from None
                if checkpoint_id and wait_s > 0:
                    return 200, msgspec.json.encode(await self.wait_prepared(checkpoint_id, wait_s))
                return 200, msgspec.json.encode(self.status())
            return await answer(go())

        for path, typ, op in (
            ("/prepare", ControlRequest, self.prepare),
            ("/commit", CommitRequest, self.commit),
            ("/restore", RestoreRequest, self.restore),
            ("/resume", ControlRequest, self.resume),
            ("/abort", ControlRequest, lambda req: self.resume(req, op="abort")),
            ("/agent/acknowledge", AcknowledgeRequest, self.acknowledge),
            ("/agent/discard", DiscardRequest, self.discard),
            # The model server's admission names for the same machine.
            ("/admission/pause", ControlRequest, self.prepare),
            ("/admission/resume", ControlRequest, self.resume),
            ("/admission/abort", ControlRequest, lambda req: self.resume(req, op="abort")),
        ):
            def make(typ=typ, op=op):
                async def endpoint(request: Request) -> Response:
                    return await run(request, typ, op)
                return endpoint
            r.add_api_route(path, make(), methods=["POST"])
        return r
