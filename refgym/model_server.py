"""The reference policy model server: a deterministic model, its ledger, and its part of a snapshot.

``POST /v1/responses`` answers one model call with token ids and log probs that depend only on
(model seed, prompt token ids) and records it in the model ledger (Gym's TokenEntry, stamped with
Gym's lineage, plus a :class:`ModelLedgerEntry`). While a checkpoint holds the server (pause, commit, restore) new calls
get 503; pause returns once no call is in flight. ``--slow-ms`` makes every call take that long, so
tests can catch calls in flight.

Commit (after the agents) writes the ledger and token rows of exactly the calls the agents'
continuation indexes depend on: for each parked rollout, its calls up to its last committed model
call, following ``parent_call_id`` across earlier attempts. Restore loads them back and closes the
old runs: a restored rollout continues as attempt n+1, so new calls of attempts <= n are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pyarrow as pa
from fastapi import FastAPI, Request, Response

from gymkit import CommitContext, ControlPlane, ControlRefused, Participant, part_prefix
from gymkit.token_store import TokenStore
from refgym import rules
from refgym.api import (
    ApiRefused,
    ModelCall,
    ModelReply,
    decode,
    health_routes,
    install_error_handler,
    paused,
    reply,
)
from refgym.inflight import InFlight
from refgym.parts import invalid_records_refused, part_files, part_records
from schemas.control import Capabilities
from schemas.errors import CorruptSnapshotError, InvalidRecordError
from schemas.gym_records import AgentContinuationRoot, ModelLedgerEntry, TokenIndexEntry
from schemas.identity import capture_key
from schemas.token_entry import TOKEN_ENTRY_SCHEMA_VERSION, token_digest
from snapformat import read_part_records
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot
from snapformat.token_rows import batch_entries, entries_batch

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.arrow"
#: Gym's wire string for a parent the request named but that could not be proven (records.py).
UNRESOLVED_PARENT_REASON = "unresolved_parent"


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded model call: its ledger entry and its token record (Gym's TokenEntry JSON)."""

    entry: ModelLedgerEntry
    token: dict[str, Any]

    def reply(self, replayed: bool = False) -> ModelReply:
        t = self.token
        return ModelReply(response_id=t["response_id"], model=t["model"], capture_key=t["rollout_id"],
                          model_call_id=t["model_call_id"], generation_token_ids=t["generation_token_ids"],
                          generation_log_probs=t["generation_log_probs"], cum_len=t["cum_len"], digest=t["digest"],
                          parent_resolution=t["parent_resolution"], replayed=replayed)


class ModelParticipant(Participant):
    """The model server's state (its ledger) and its side of the checkpoint protocol."""

    def __init__(self, name: str, seed: int, slow_ms: int = 0, commit_delay_ms: int = 0,
                 token_store: TokenStore | None = None) -> None:
        self.name = name
        self.seed = seed
        self.model = f"refgym-policy-seed{seed}"
        self.slow_s = slow_ms / 1000
        self.commit_delay_s = commit_delay_ms / 1000  # test knob: hold a commit open to kill it there
        self.calls: dict[tuple[str, str], Call] = {}  # (capture_key, model_call_id) -> call
        self.closed_attempts: dict[str, int] = {}  # rollout_id -> highest attempt closed by restore
        self._calls = InFlight()
        self.token_store = token_store  # where each call's TokenEntry is captured, as Gym's TokenSink

    # -- the protocol ------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(component="model", name=self.name, checkpoint_mode="export_restore")

    def in_flight(self) -> int:
        return self._calls.count

    async def prepare(self, deadline: float) -> None:
        """Pause: new calls are already refused (the kit closed admission); wait for 0 in flight."""
        await self._calls.quiet()

    async def resume(self) -> None:
        """Nothing to undo: the kit opens admission again once the checkpoint has ended."""

    async def reset(self) -> None:
        """An aborted restore: forget the loaded ledger (restore only runs on an empty server)."""
        self.calls, self.closed_attempts = {}, {}

    async def commit(self, part: PartWriter | None, context: CommitContext) -> dict[str, Any]:
        assert part is not None
        continuations = self._continuations(context)
        calls = self._committed_calls(continuations)
        tokens_path = f"{part.prefix}/{TOKENS_FILE}"
        if calls:
            part.write_rows(TOKENS_FILE, "token_capture_rows", entries_batch([c.token for c in calls], tokens_path))
        else:
            part.write_rows(TOKENS_FILE, "token_capture_rows", [])
        if self.commit_delay_s:
            await asyncio.sleep(self.commit_delay_s)
        part.write_records("ledger", "model_ledger", [c.entry for c in calls])
        part.write_records("token_index", "token_index", [
            TokenIndexEntry(capture_key=c.entry.capture_key, model_call_id=c.entry.model_call_id, file=tokens_path,
                            batch=0, row_start=i, row_count=1) for i, c in enumerate(calls)])
        return {"calls": len(calls), "rollouts": len({c.entry.rollout_id for c in calls})}

    async def restore(self, snapshot: Snapshot, prefix: str) -> dict[str, Any]:
        if self.calls:
            raise ControlRefused(409, "wrong_phase",
                                 f"restore needs an empty model ledger; this one holds {len(self.calls)} calls")
        with invalid_records_refused():
            calls = self._load(snapshot, prefix)
        closed: dict[str, int] = {}
        for c in calls.values():
            closed[c.entry.rollout_id] = max(closed.get(c.entry.rollout_id, 0), c.entry.attempt_index)
        self.calls, self.closed_attempts = calls, closed  # swapped in whole: a failed load changes nothing
        return {"calls": len(calls), "closed_runs": sorted(capture_key(r, a) for r, a in closed.items())}

    # -- commit and restore helpers -----------------------------------------------------------
    def _continuations(self, context: CommitContext) -> list[AgentContinuationRoot]:
        """The continuation lines of every agent part whose receipt the commit was given."""
        out: list[AgentContinuationRoot] = []
        with invalid_records_refused():
            for receipt in context.continuations:
                if not receipt.prefix.startswith(part_prefix("agent", "")):
                    raise ControlRefused(400, "bad_request", f"continuations: {receipt.prefix!r} is not an agent part")
                out.extend(read_part_records(context.draft_url, receipt, "continuations"))
        return out

    def _committed_calls(self, continuations: list[AgentContinuationRoot]) -> list[Call]:
        """Each parked rollout's lineage up to its last committed call, in a stable order."""
        chosen: dict[tuple[str, str], Call] = {}
        for c in continuations:
            last = self._find(c.rollout_id, c.last_committed_model_call_id, c.attempt_index)
            if last is None:
                raise ControlRefused(409, "invalid_record",
                                     f"continuation of {c.capture_key!r} names model call "
                                     f"{c.last_committed_model_call_id!r}, which this model server never served")
            for call in self._lineage(last):
                chosen[(call.entry.capture_key, call.entry.model_call_id)] = call
        return sorted(chosen.values(), key=lambda c: (c.entry.rollout_id, c.entry.turn_index, c.entry.attempt_index))

    def _lineage(self, last: Call) -> list[Call]:
        """``last`` and its ancestors through ``parent_call_id`` (an unknown parent ends the walk)."""
        chain, seen = [last], {last.entry.model_call_id}
        while (parent := chain[-1].entry.parent_call_id) is not None and parent not in seen:
            found = self._find(last.entry.rollout_id, parent, chain[-1].entry.attempt_index)
            if found is None:
                break
            chain.append(found)
            seen.add(parent)
        return chain[::-1]

    def _find(self, rollout_id: str, call_id: str, attempt: int) -> Call | None:
        """The call ``call_id`` of the latest attempt <= ``attempt`` that made it."""
        for a in range(attempt, -1, -1):
            if (found := self.calls.get((capture_key(rollout_id, a), call_id))) is not None:
                return found
        return None

    def _load(self, snapshot: Snapshot, prefix: str) -> dict[tuple[str, str], Call]:
        """Ledger entries joined with their token rows through the token index (all checked)."""
        index = {(e.capture_key, e.model_call_id): e for e in part_records(snapshot, prefix, "token_index")}
        readers = {f.path: snapshot.open_rows(f) for f in part_files(snapshot, prefix, "token_capture_rows")}
        calls: dict[tuple[str, str], Call] = {}
        for e in part_records(snapshot, prefix, "model_ledger"):
            key = (e.capture_key, e.model_call_id)
            ix = index.get(key)
            if ix is None:
                raise InvalidRecordError(
                    f"{snapshot.url}: ledger call {e.model_call_id!r} of {e.capture_key!r} has no token index entry")
            reader = readers.get(ix.file)
            if reader is None:
                raise InvalidRecordError(f"{snapshot.url}: token index names {ix.file!r}, not a token part of {prefix}")
            where = f"{snapshot.url}: {ix.file}#{ix.batch}:{ix.row_start}"
            try:
                tokens = batch_entries(reader.get_batch(ix.batch).slice(ix.row_start, ix.row_count), where)
            except (IndexError, pa.ArrowInvalid) as exc:
                raise CorruptSnapshotError(
                    f"{snapshot.url}: token index entry for {key} is out of range: {exc}") from None
            if len(tokens) != 1 or (tokens[0]["rollout_id"], tokens[0]["model_call_id"]) != key:
                raise InvalidRecordError(f"{where}: token rows are not call {key}")
            calls[key] = Call(entry=e, token=tokens[0])
        return calls

    # -- the model ------------------------------------------------------------------------------
    async def call(self, req: ModelCall) -> ModelReply:
        """Answer one model call (or replay its recorded answer) and record it in the ledger."""
        try:
            key = capture_key(req.rollout_id, req.attempt_index)
        except InvalidRecordError as exc:
            raise ApiRefused(400, "invalid_record", str(exc)) from None
        if req.capture_key != key:
            raise ApiRefused(400, "invalid_record", f"capture_key {req.capture_key!r} breaks Gym's rule: attempt "
                             f"{req.attempt_index} of {req.rollout_id!r} has key {key!r}")
        if any(t < 0 or t >= rules.VOCAB for t in req.prompt_token_ids):
            raise ApiRefused(400, "bad_request", f"prompt_token_ids: every id must be in [0, {rules.VOCAB})")
        if not self.admits_work():
            raise paused("model call")
        if (known := self.calls.get((key, req.model_call_id))) is not None:
            return self._replay(known, req)
        closed = self.closed_attempts.get(req.rollout_id)
        if closed is not None and req.attempt_index <= closed:
            raise ApiRefused(409, "run_closed", f"run {key!r} was closed by a restore; {req.rollout_id!r} continues "
                             f"as attempt {closed + 1} or later")
        with self._calls.one():
            if self.slow_s:
                await asyncio.sleep(self.slow_s)
            if (known := self.calls.get((key, req.model_call_id))) is not None:
                return self._replay(known, req)  # an identical call finished meanwhile
            call = self._record(req, key)
            await self._capture(call)  # durable before the answer (Gym's TokenSink contract)
        return call.reply()

    async def _capture(self, call: Call) -> None:
        """Put the call's TokenEntry into the token store. As in Gym, a capture error never fails the
        model call: the rollout is marked incomplete instead (so a trainer masks it)."""
        if self.token_store is None:
            return
        key, call_id = call.token["rollout_id"], call.token["model_call_id"]
        try:
            await self.token_store.put(call.token)
        except Exception as exc:  # noqa: BLE001 - any capture failure is reported the same way
            log.warning("token capture of %s call %s failed: %s", key, call_id, exc)
            try:
                await self.token_store.mark_incomplete(key, call_id)
            except Exception as again:  # noqa: BLE001
                log.error("could not mark %s incomplete after a failed capture: %s", key, again)

    def _replay(self, known: Call, req: ModelCall) -> ModelReply:
        """A retried call gets the recorded answer; a different prompt under the same id is refused."""
        if known.token["prompt_token_ids"] != list(req.prompt_token_ids):
            raise ApiRefused(409, "conflict", f"{req.model_call_id!r} of {known.entry.capture_key!r} was already "
                             "recorded with a different prompt")
        return known.reply(replayed=True)

    def _record(self, req: ModelCall, key: str) -> Call:
        """Generate, then stamp the call's lineage as Gym does: a root names no parent; a parent the
        ledger holds is resolved; one it does not hold is unresolved and, by Gym's rule, not named."""
        gen, log_probs = rules.generate(self.seed, req.prompt_token_ids)
        parent: str | None = None
        reason = ""
        if req.parent_call_id is None:
            resolution = "root"
        elif self._find(req.rollout_id, req.parent_call_id, req.attempt_index) is not None:
            resolution, parent = "resolved", req.parent_call_id
        else:
            resolution, reason = "unresolved", UNRESOLVED_PARENT_REASON
        now = time.time()
        cumulative = list(req.prompt_token_ids) + gen
        token = {
            "schema_version": TOKEN_ENTRY_SCHEMA_VERSION, "rollout_id": key, "model_call_id": req.model_call_id,
            "model": self.model, "prompt_token_ids": list(req.prompt_token_ids), "generation_token_ids": gen,
            "generation_log_probs": log_probs, "routed_experts": None,
            "output_items": [{"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": f"<{len(gen)} tokens>"}]}],
            "token_item_index": 0, "response_id": f"resp-{key}-{req.model_call_id}", "created_at": now,
            "parent_call_id": parent, "cum_len": len(cumulative), "digest": token_digest(cumulative),
            "parent_resolution": resolution, "continuation_fingerprint": "", "continuation_context_len": 0,
            "continuation_context_digest": "", "parent_resolution_reason": reason, "fingerprint_version": None,
            "prompt_is_delta": False, "prefix_requested": False, "prefix_supplied": False,
        }
        entry = ModelLedgerEntry(rollout_id=req.rollout_id, attempt_index=req.attempt_index, capture_key=key,
                                 model_call_id=req.model_call_id, parent_call_id=req.parent_call_id,
                                 turn_index=req.turn_index, model=self.model, created_at=now)
        call = Call(entry=entry, token=token)
        self.calls[(key, req.model_call_id)] = call
        return call

    def ledger_view(self) -> list[dict[str, Any]]:
        """The ledger as plain rows (for tests and the demo), in call order per capture key."""
        calls = sorted(self.calls.values(),
                       key=lambda c: (c.entry.rollout_id, c.entry.attempt_index, c.entry.turn_index))
        return [{"rollout_id": c.entry.rollout_id, "attempt_index": c.entry.attempt_index,
                 "capture_key": c.entry.capture_key, "model_call_id": c.entry.model_call_id,
                 "parent_call_id": c.entry.parent_call_id, "turn_index": c.entry.turn_index,
                 "parent_resolution": c.token["parent_resolution"]} for c in calls]


def create_app(name: str, token: str, seed: int = 0, slow_ms: int = 0, commit_delay_ms: int = 0,
               token_store: str | None = None) -> FastAPI:
    """The model server's FastAPI app: ``/v1/responses``, ``/ledger`` and the control routes.

    With ``token_store`` (a folder or ``s3://`` location), every call's TokenEntry is captured
    there through :class:`gymkit.TokenStore` before the call is answered.
    """
    store = TokenStore(token_store) if token_store else None
    participant = ModelParticipant(name, seed, slow_ms, commit_delay_ms, token_store=store)
    plane = ControlPlane(participant, token)
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if store is not None:
            await store.close()

    app = FastAPI(title=f"refgym model server {name}", lifespan=lifespan)
    app.state.participant = participant
    app.include_router(plane.router())
    install_error_handler(app)
    health_routes(app, "model", name)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return reply(await participant.call(await decode(request, ModelCall)))

    @app.get("/ledger")
    async def ledger() -> Response:
        return reply(participant.ledger_view())

    return app
