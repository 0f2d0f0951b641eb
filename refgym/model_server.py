"""The reference policy model server: a deterministic model, its ledger, and its part of a snapshot.

``POST /v1/responses`` answers one model call with token ids and log probs that depend only on
(model seed, prompt token ids) and records it in the model ledger (a token-capture row plus a
:class:`ModelLedgerEntry`). While a checkpoint holds the server (pause, commit, restore) new calls
get 503; pause returns once no call is in flight. ``--slow-ms`` makes every call take that long, so
tests can catch calls in flight.

Commit (after the agents) writes the ledger and token rows of exactly the calls the agents'
continuation indexes depend on: for each parked rollout, its calls up to its last committed model
call, following ``parent_call_id`` across earlier attempts. Restore loads them back and closes the
old runs: a restored rollout continues as attempt n+1, so new calls of attempts <= n are refused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pyarrow as pa
from fastapi import FastAPI, Request, Response

from gymkit import ControlPlane, ControlRefused, Participant
from schemas.control import Capabilities
from schemas.gym_records import AgentContinuationRoot, ModelLedgerEntry, TokenIndexEntry
from schemas.errors import CorruptSnapshotError, InvalidRecordError
from schemas.identity import capture_key
from schemas.rows import TOKEN_CAPTURE_SCHEMA
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot
from refgym import rules
from refgym.inflight import InFlight
from refgym.api import (
    ApiRefused, ModelCall, ModelReply, decode, health_routes, install_error_handler, paused, reply,
)
from refgym.parts import draft_records, invalid_records_refused, part_files, part_records

TOKENS_FILE = "tokens.arrow"


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded model call: its ledger entry and its token-capture row (column -> value)."""

    entry: ModelLedgerEntry
    row: dict[str, Any]

    def reply(self, replayed: bool = False) -> ModelReply:
        r = self.row
        return ModelReply(response_id=r["response_id"], model=r["model"], capture_key=r["capture_key"],
                          model_call_id=r["model_call_id"], generation_token_ids=r["generation_token_ids"],
                          generation_log_probs=r["generation_log_probs"], cum_len=r["cum_len"], digest=r["digest"],
                          parent_resolution=r["parent_resolution"], replayed=replayed)


class ModelParticipant(Participant):
    """The model server's state (its ledger) and its side of the checkpoint protocol."""

    def __init__(self, name: str, seed: int, slow_ms: int = 0, commit_delay_ms: int = 0) -> None:
        self.name = name
        self.seed = seed
        self.model = f"refgym-policy-seed{seed}"
        self.slow_s = slow_ms / 1000
        self.commit_delay_s = commit_delay_ms / 1000  # test knob: hold a commit open to kill it there
        self.plane: ControlPlane | None = None
        self.calls: dict[tuple[str, str], Call] = {}  # (capture_key, model_call_id) -> call
        self.closed_attempts: dict[str, int] = {}  # rollout_id -> highest attempt closed by restore
        self._calls = InFlight()

    # -- the protocol ------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(component="model", name=self.name, checkpoint_mode="export_restore")

    def in_flight(self) -> int:
        return self._calls.count

    async def prepare(self, deadline: float) -> None:
        """Pause: the kit already refuses new calls (phase is not idle); wait for 0 in flight."""
        await self._calls.quiet()

    async def resume(self) -> None:
        """Nothing to undo: admission opens when the kit's phase returns to idle."""

    async def reset(self) -> None:
        """An aborted restore: forget the loaded ledger (restore only runs on an empty server)."""
        self.calls, self.closed_attempts = {}, {}

    async def commit(self, part: PartWriter | None, context: dict[str, Any]) -> dict[str, Any]:
        assert part is not None
        continuations = self._continuations(context)
        calls = self._committed_calls(continuations)
        rows = [c.row for c in calls]
        tokens_path = f"{part.prefix}/{TOKENS_FILE}"
        if rows:
            part.write_rows(TOKENS_FILE, "token_capture_rows",
                            pa.RecordBatch.from_pylist(rows, schema=TOKEN_CAPTURE_SCHEMA))
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
    def _continuations(self, context: dict[str, Any]) -> list[AgentContinuationRoot]:
        """The continuation lines of every agent part whose receipt the commit was given."""
        out: list[AgentContinuationRoot] = []
        with invalid_records_refused():
            for receipt in context["continuations"]:
                if not receipt.prefix.startswith("gym/agent/"):
                    raise ControlRefused(400, "bad_request", f"continuations: {receipt.prefix!r} is not an agent part")
                out.extend(draft_records(context["draft_url"], receipt, "continuations"))
        return out

    def _committed_calls(self, continuations: list[AgentContinuationRoot]) -> list[Call]:
        """Each parked rollout's lineage up to its last committed call, in a stable order."""
        chosen: dict[tuple[str, str], Call] = {}
        for c in continuations:
            if c.last_committed_model_call_id is None:
                continue  # parked before its first model call: nothing to keep
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
            try:
                rows = reader.get_batch(ix.batch).slice(ix.row_start, ix.row_count).to_pylist()
            except (IndexError, pa.ArrowInvalid) as exc:
                raise CorruptSnapshotError(
                    f"{snapshot.url}: token index entry for {key} is out of range: {exc}") from None
            if len(rows) != 1 or (rows[0]["capture_key"], rows[0]["model_call_id"]) != key:
                raise InvalidRecordError(
                    f"{snapshot.url}: token rows at {ix.file}#{ix.batch}:{ix.row_start} are not call {key}")
            calls[key] = Call(entry=e, row=rows[0])
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
        assert self.plane is not None
        if self.plane.phase != "idle":
            raise paused("model call")
        digest = rules.token_digest(req.prompt_token_ids)
        if (known := self.calls.get((key, req.model_call_id))) is not None:
            return self._replay(known, req, digest)
        closed = self.closed_attempts.get(req.rollout_id)
        if closed is not None and req.attempt_index <= closed:
            raise ApiRefused(409, "run_closed", f"run {key!r} was closed by a restore; {req.rollout_id!r} continues "
                             f"as attempt {closed + 1} or later")
        with self._calls.one():
            if self.slow_s:
                await asyncio.sleep(self.slow_s)
            if (known := self.calls.get((key, req.model_call_id))) is not None:
                return self._replay(known, req, digest)  # an identical call finished meanwhile
            call = self._record(req, key)
        return call.reply()

    def _replay(self, known: Call, req: ModelCall, digest: str) -> ModelReply:
        """A retried call gets the recorded answer; a different prompt under the same id is refused."""
        if rules.token_digest(known.row["prompt_token_ids"]) != digest:
            raise ApiRefused(409, "conflict", f"{req.model_call_id!r} of {known.entry.capture_key!r} was already "
                             "recorded with a different prompt")
        return known.reply(replayed=True)

    def _record(self, req: ModelCall, key: str) -> Call:
        gen, log_probs = rules.generate(self.seed, req.prompt_token_ids)
        if req.parent_call_id is None:
            resolution = "root"
        else:
            found = self._find(req.rollout_id, req.parent_call_id, req.attempt_index)
            resolution = "resolved" if found is not None else "unresolved"
        now = time.time()
        cumulative = req.prompt_token_ids + gen
        items = msgspec.json.encode([{"type": "message", "role": "assistant", "tokens": len(gen)}]).decode()
        row = {
            "schema_version": 1, "rollout_id": req.rollout_id, "attempt_index": req.attempt_index, "capture_key": key,
            "model_call_id": req.model_call_id, "model": self.model, "prompt_token_ids": req.prompt_token_ids,
            "generation_token_ids": gen, "generation_log_probs": log_probs, "routed_experts": None,
            "output_items": items,
            "token_item_index": 0, "response_id": f"resp-{key}-{req.model_call_id}", "created_at": now,
            "parent_call_id": req.parent_call_id, "cum_len": len(cumulative), "digest": rules.token_digest(cumulative),
            "parent_resolution": resolution, "prompt_is_delta": False,
        }
        entry = ModelLedgerEntry(rollout_id=req.rollout_id, attempt_index=req.attempt_index, capture_key=key,
                                 model_call_id=req.model_call_id, parent_call_id=req.parent_call_id,
                                 turn_index=req.turn_index, model=self.model, created_at=now)
        call = Call(entry=entry, row=row)
        self.calls[(key, req.model_call_id)] = call
        return call

    def ledger_view(self) -> list[dict[str, Any]]:
        """The ledger as plain rows (for tests and the demo), in call order per capture key."""
        calls = sorted(self.calls.values(),
                       key=lambda c: (c.entry.rollout_id, c.entry.attempt_index, c.entry.turn_index))
        return [{"rollout_id": c.entry.rollout_id, "attempt_index": c.entry.attempt_index,
                 "capture_key": c.entry.capture_key, "model_call_id": c.entry.model_call_id,
                 "parent_call_id": c.entry.parent_call_id, "turn_index": c.entry.turn_index,
                 "parent_resolution": c.row["parent_resolution"]} for c in calls]


def create_app(name: str, token: str, seed: int = 0, slow_ms: int = 0, commit_delay_ms: int = 0) -> FastAPI:
    """The model server's FastAPI app: ``/v1/responses``, ``/ledger`` and the control routes."""
    participant = ModelParticipant(name, seed, slow_ms, commit_delay_ms)
    plane = ControlPlane(participant, token)
    participant.plane = plane
    app = FastAPI(title=f"refgym model server {name}")
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
