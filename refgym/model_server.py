"""The reference policy model server: a deterministic model, its ledger, and its part of a snapshot.

``POST /v1/responses`` answers one model call with token ids and log probs that depend only on
(model seed, prompt token ids) and records it in the model ledger (Gym's TokenEntry, stamped with
Gym's lineage, plus a :class:`ModelLedgerEntry`). Every call passes Gym's data-plane admission
(:class:`gymkit.model_control.ModelAdmission`): while a checkpoint holds the server it is refused
with 409 ``checkpoint_parked`` (``retry-after: 1``), and a call of an attempt a restore or
``abort_inflight`` ended with 409 ``stale_attempt``. ``--slow-ms`` makes every call take that long,
so tests can catch calls in flight.

Commit (after the agents) writes Gym's ledger folder ``model-ledger/<name>/`` into
``checkpoint_dir`` for exactly the calls the agents' continuation indexes depend on: for each root,
its calls up to its last committed model call, following ``parent_call_id`` across earlier
attempts, one ``<capture_key>.lineage.jsonl`` per capture key (rows: ``{"entry", "token"}``, the
ledger entry and Gym's TokenEntry), ``storage-references.jsonl`` and ``manifest.json``. Restore
loads them back; the kit fences the roots' source attempts, so a restored rollout continues as
attempt n+1.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request, Response

from gymkit.checkpoint_dir import (
    LineageFile,
    compact_json,
    continuation_roots_sha256,
    jsonl_bytes,
    manifest_digest,
    read_jsonl,
    read_ledger_dir,
    write_ledger_dir,
)
from gymkit.control_http import error_response
from gymkit.fence import ControlError, Fence
from gymkit.model_control import ModelAdmission, ModelCommitContext, ModelParticipant, ModelRestoreContext, model_router
from gymkit.token_store import TokenStore
from refgym import rules
from refgym.api import ApiRefused, ModelCall, ModelReply, decode, health_routes, install_error_handler, reply
from schemas.control import (
    FEATURE_STORAGE_REFERENCE_INDEX,
    AttemptRef,
    Capabilities,
    ModelCommitResponse,
    ModelRestoreResponse,
    MultiProcess,
)
from schemas.errors import InvalidRecordError, SnapshotError
from schemas.gym_files import AGENT_DIR, MANIFEST_NAME, AttemptEntry, ExternalStorageReference, ledger_dir
from schemas.gym_records import AgentContinuationRoot, ModelLedgerEntry
from schemas.identity import capture_key, capture_keys_down
from schemas.token_entry import TOKEN_ENTRY_SCHEMA_VERSION, token_digest

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.arrow"
#: Gym's wire string for a parent the request named but that could not be proven (records.py).
UNRESOLVED_PARENT_REASON = "unresolved_parent"


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded model call: its ledger entry, its lineage row's bytes (``{"entry", "token"}``
    and a newline), and its token record (Gym's TokenEntry) as a view of the token object's bytes
    within that row.

    A call this server answers is encoded once, when it is recorded (:meth:`answered`); a call a
    restore loaded keeps its lineage file's line. Either way a commit copies the row instead of
    encoding the record again: a lineage holds every call of its rollout so far, so encoding at
    each commit made every commit re-encode the whole history, and in the pause (the model's
    commit at 10 x 10,000, ``py-spy``: a quarter of it). :meth:`fields` decodes when asked (a
    replayed call, the demo's views)."""

    entry: ModelLedgerEntry
    token: msgspec.Raw
    row: bytes

    @classmethod
    def answered(cls, entry: ModelLedgerEntry, token: dict[str, Any]) -> Call:
        """The call of ``entry`` whose token record is ``token``, encoded as a lineage row writes it."""
        encoded = compact_json(token)
        row = jsonl_bytes([_StoredCall(entry=entry, token=msgspec.Raw(encoded))])
        end = len(row) - 2  # the row ends with the token object, the row's "}" and "\n"
        return cls(entry=entry, token=msgspec.Raw(memoryview(row)[end - len(encoded):end]), row=row)

    def fields(self) -> dict[str, Any]:
        """The token record as a dict."""
        return _token_fields.decode(self.token)

    def reply(self, replayed: bool = False) -> ModelReply:
        return reply_of(self.fields(), replayed)


def reply_of(t: dict[str, Any], replayed: bool = False) -> ModelReply:
    """The answer to a model call whose token record is ``t``."""
    return ModelReply(response_id=t["response_id"], model=t["model"], capture_key=t["rollout_id"],
                      model_call_id=t["model_call_id"], generation_token_ids=t["generation_token_ids"],
                      generation_log_probs=t["generation_log_probs"], cum_len=t["cum_len"], digest=t["digest"],
                      parent_resolution=t["parent_resolution"], replayed=replayed)


class _StoredCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A lineage row as a restore reads it: the ledger entry decoded (and checked), the token record
    kept as its bytes. Decoding 10,000 rollouts' token records into dicts (prompt and generation
    ids, log probs) was most of the model's restore; a replayed call decodes its own."""

    entry: ModelLedgerEntry
    token: msgspec.Raw


_stored_call = msgspec.json.Decoder(_StoredCall)
_token_fields = msgspec.json.Decoder(dict[str, Any])


def _stored_calls(path: Path) -> list[Call]:
    """The calls of a lineage file's rows (blank lines skipped), each entry checked, each token a JSON
    object; each call's row is its line as it is (a commit writes it again byte for byte)."""
    data = path.read_bytes()
    calls: list[Call] = []
    start, n = 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end + 1
        line, start = data[start:end], end
        if not line.strip():
            continue
        if not line.endswith(b"\n"):  # a last line without its newline: a row always ends with one
            line += b"\n"
        n += 1
        try:
            stored = _stored_call.decode(line)  # the token is a view of ``line``: nothing copied
        except msgspec.ValidationError as exc:  # the entry's own checks say which field
            raise InvalidRecordError(f"{path}: row {n}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InvalidRecordError(f"{path}: row {n}: not JSON lines: {exc}") from None
        if memoryview(stored.token)[:1] != b"{":
            raise InvalidRecordError(f"{path}: row {n}: token is not a JSON object")
        calls.append(Call(entry=stored.entry, token=stored.token, row=line))
    return calls


class _KeyCalls:
    """The calls of one capture key in the order they were recorded (or restored), and whether they
    form one chain: each call's parent the call before it, turn indexes rising, call ids unique.

    Then the lineage of its k-th call, within this key, is the first k + 1 calls, which a commit
    takes by position instead of walking ``parent_call_id`` call by call (:meth:`RefModel._prefixes`),
    and whose SHA-256 a running digest gives (:meth:`file`)."""

    __slots__ = ("_hashed", "_sha", "calls", "chain", "position")

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.position: dict[str, int] = {}  # model_call_id -> its place in calls
        self.chain = True
        # The running SHA-256 of the first _hashed calls' rows. Calls are only ever appended, so a
        # commit hashes only the rows recorded since the one before: a lineage holds its rollout's
        # whole history, and hashing it whole at every commit grew each pause with the history.
        self._sha = hashlib.sha256()
        self._hashed = 0

    def add(self, call: Call) -> None:
        e = call.entry
        if self.calls:
            before = self.calls[-1].entry
            if e.parent_call_id != before.model_call_id or e.turn_index <= before.turn_index:
                self.chain = False
        if e.model_call_id in self.position:
            self.chain = False
        self.position[e.model_call_id] = len(self.calls)
        self.calls.append(call)

    def file(self, key: str, n: int) -> LineageFile:
        """The lineage file of the first ``n`` calls (a chain's prefix, ``n`` >= 1): their rows, each
        one non-blank line (:class:`Call`), and their SHA-256, from the running digest when ``n``
        is at or past what it covers (a shorter prefix is hashed whole)."""
        data = b"".join([c.row for c in self.calls[:n]])
        if n < self._hashed:
            return LineageFile(key, data, hashlib.sha256(data).hexdigest(), n)
        for c in self.calls[self._hashed:n]:
            self._sha.update(c.row)
        self._hashed = n
        return LineageFile(key, data, self._sha.hexdigest(), n)

    def get(self, call_id: str) -> Call | None:
        """The call ``call_id`` (the latest recorded under that id)."""
        at = self.position.get(call_id)
        return None if at is None else self.calls[at]


class RefModel(ModelParticipant):
    """The model server's state (its ledger) and its side of Gym's checkpoint protocol."""

    def __init__(self, name: str, seed: int, admission: ModelAdmission, slow_ms: int = 0, commit_delay_ms: int = 0,
                 token_store: TokenStore | None = None) -> None:
        super().__init__(admission)
        self.name = name
        self.seed = seed
        self.model = f"refgym-policy-seed{seed}"
        self.slow_s = slow_ms / 1000
        self.commit_delay_s = commit_delay_ms / 1000  # test knob: hold a commit open to kill it there
        self._by_key: dict[str, _KeyCalls] = {}  # capture_key -> its calls in order: the ledger
        self.token_store = token_store  # where each call's TokenEntry is captured, as Gym's TokenSink

    # -- the protocol ------------------------------------------------------------------------
    def declaration(self) -> Capabilities:
        return Capabilities(component="responses_api_models", name=self.name,
                            admission_states=["accepting", "draining", "paused"], checkpoint_mode="export_restore",
                            concurrency_contract="transactional_parallel",
                            multi_process=MultiProcess(mode="single_worker"), instance_role="policy",
                            features=[FEATURE_STORAGE_REFERENCE_INDEX])

    async def commit(self, ctx: ModelCommitContext) -> ModelCommitResponse:
        """The ledger of exactly the calls the agents' continuation roots depend on: per root, its
        lineage up to its last committed call (across earlier attempts), one lineage file per
        capture key, and one storage reference per root (its last call's token-capture record)."""
        roots = self._roots(ctx)
        tombstoned = {(t.rollout_id, t.attempt_index) for t in self.admission.tombstones()}
        rooted = {(r.rollout_id, r.attempt_index) for r in roots}
        seen = {(kc.calls[0].entry.rollout_id, kc.calls[0].entry.attempt_index) for kc in self._by_key.values()}
        folder = Path(ctx.checkpoint_dir) / ledger_dir(self.name)
        if (folder / MANIFEST_NAME).exists():  # a commit that finds its own manifest writes nothing
            return self._committed(folder, ctx.checkpoint_id, roots, tombstoned, rooted, len(seen & tombstoned))
        chains, walked = self._lineage_parts(roots)
        if self.commit_delay_s:
            await asyncio.sleep(self.commit_delay_s)
        files = itertools.chain((kc.file(key, n) for key, (kc, n) in chains.items()),
                                ((key, b"".join([c.row for c in calls])) for key, calls in walked.items()))
        manifest, digest = write_ledger_dir(
            ctx.checkpoint_dir, ctx.checkpoint_id, self.name, lineages=files,
            storage_references=sorted((ExternalStorageReference(
                capture_key=r.capture_key, boundary_model_call_id=r.last_committed_model_call_id,
                key=f"{r.capture_key}/{r.last_committed_model_call_id}") for r in roots), key=lambda e: e.key),
            roots=roots, excluded_inactive=len(seen - rooted - tombstoned),
            tombstones=[AttemptEntry(rollout_id=r, attempt_index=n) for r, n in sorted(tombstoned)],
            source_attempts=[AttemptEntry(rollout_id=r, attempt_index=n) for r, n in sorted(rooted)])
        rows = sum(r.rows for r in manifest.rollouts.values())
        return ModelCommitResponse(rollouts=len(manifest.rollouts), rows=rows,
                                   excluded_tombstoned=len(seen & tombstoned), excluded_inactive=manifest.excluded_inactive,
                                   manifest_digest=digest, storage_reference_index=manifest.storage_reference_index)

    def _committed(self, folder: Path, checkpoint_id: str, roots: list[AgentContinuationRoot],
                   tombstoned: set[tuple[str, int]], rooted: set[tuple[str, int]],
                   excluded_tombstoned: int) -> ModelCommitResponse:
        """The ledger folder a commit found already written: validated against its bytes, and its
        checkpoint id, tombstones, source attempts and ``continuation_roots_sha256`` must be what this
        commit would write (else ``ledger_mismatch``); answered with the digest on disk."""
        try:
            manifest, _refs, _lineage = read_ledger_dir(folder)
            digest = manifest_digest(folder)
        except (SnapshotError, OSError) as exc:
            raise ControlError("ledger_mismatch", f"{folder / MANIFEST_NAME}: {type(exc).__name__}: {exc}") from None
        differs = [what for what, on_disk, now in (
            ("checkpoint_id", manifest.checkpoint_id, checkpoint_id),
            ("tombstones", [(t.rollout_id, t.attempt_index) for t in manifest.tombstones], sorted(tombstoned)),
            ("source_attempts", [(t.rollout_id, t.attempt_index) for t in manifest.source_attempts], sorted(rooted)),
            ("continuation_roots_sha256", manifest.continuation_roots_sha256, continuation_roots_sha256(roots)),
        ) if on_disk != now]
        if differs:
            raise ControlError("ledger_mismatch", f"{folder / MANIFEST_NAME} was committed with other "
                                                  f"{', '.join(differs)} than this commit would write")
        assert digest is not None
        rows = sum(r.rows for r in manifest.rollouts.values())
        return ModelCommitResponse(rollouts=len(manifest.rollouts), rows=rows,
                                   excluded_tombstoned=excluded_tombstoned, excluded_inactive=manifest.excluded_inactive,
                                   manifest_digest=digest, storage_reference_index=manifest.storage_reference_index)

    async def restore(self, ctx: ModelRestoreContext) -> ModelRestoreResponse:
        """Load the ledger back; the saved tombstones and the roots' source attempts are fenced by
        the kit (a restored rollout continues as attempt n+1)."""
        if self._by_key:
            raise ControlError("ledger_mismatch",
                               f"restore needs an empty model ledger; this one holds {len(self.calls)} calls")
        try:
            manifest, _refs, lineage = read_ledger_dir(Path(ctx.checkpoint_dir) / ledger_dir(self.name))
            by_key: dict[str, _KeyCalls] = {}
            for key, path in lineage.items():
                for n, call in enumerate(_stored_calls(path), 1):
                    if call.entry.capture_key != key:
                        raise InvalidRecordError(f"{path}: row {n}: a call of {call.entry.capture_key!r} in the "
                                                 f"lineage of {key!r}")
                    by_key.setdefault(key, _KeyCalls()).add(call)
        except (SnapshotError, OSError, msgspec.DecodeError) as exc:
            raise ControlError("ledger_mismatch", f"{ctx.checkpoint_dir}: {type(exc).__name__}: {exc}") from None
        self._by_key = by_key  # swapped in whole: a failed load changes nothing
        return ModelRestoreResponse(
            rollouts=len(manifest.rollouts), rows=sum(len(kc.position) for kc in by_key.values()),
            checkpoint_id=manifest.checkpoint_id,
            tombstones=[AttemptRef(rollout_id=t.rollout_id, attempt_index=t.attempt_index) for t in manifest.tombstones],
            source_attempts=[AttemptRef(rollout_id=t.rollout_id, attempt_index=t.attempt_index)
                             for t in manifest.source_attempts],
            storage_reference_index=manifest.storage_reference_index)

    # -- commit helpers ---------------------------------------------------------------------------
    def _roots(self, ctx: ModelCommitContext) -> list[AgentContinuationRoot]:
        """The continuation roots of every agent index the commit was given (digests checked)."""
        roots: list[AgentContinuationRoot] = []
        for ref in ctx.continuation_indexes:
            if not ref.relative_path.startswith(f"{AGENT_DIR}/"):
                raise ControlError("ledger_mismatch", f"continuation index {ref.relative_path!r} is not an agent's")
            try:
                roots += read_jsonl(ctx.checkpoint_dir, ref, AgentContinuationRoot)
            except (SnapshotError, OSError) as exc:
                raise ControlError("ledger_mismatch", f"continuation index {ref.relative_path!r}: {exc}") from None
        return roots

    def lineages(self, roots: list[AgentContinuationRoot], *, walk: bool = False) -> dict[str, list[Call]]:
        """Per capture key, the calls a commit for ``roots`` writes into its lineage file, in file
        order: every call some root's lineage passes through, by turn index (ties: the order the
        roots, each from its earliest call, first reach them). A root the ledger cannot back (never
        served, or its attempt tombstoned) is Gym's ``ledger_mismatch``.

        A root whose lineage runs through keys whose calls each form one chain (:class:`_KeyCalls`)
        takes a prefix of each key's calls, found by position; only the others are walked call by
        call (:meth:`_lineage`), and a key a walked lineage reaches is built from every root's calls
        in it, as the walk alone builds it. ``walk=True`` walks every root: the same result, slower
        (the tests' oracle)."""
        chains, walked = self._lineage_parts(roots, walk=walk)
        return {key: kc.calls[:n] for key, (kc, n) in chains.items()} | walked

    def _lineage_parts(self, roots: list[AgentContinuationRoot], *, walk: bool = False
                       ) -> tuple[dict[str, tuple[_KeyCalls, int]], dict[str, list[Call]]]:
        """:meth:`lineages` in two parts: the keys taken as a prefix of one chain (key -> its calls
        and how many of them) and the keys a walk reaches (key -> their calls, in file order)."""
        taken: list[list[tuple[_KeyCalls, int]] | list[Call]] = []
        walked_keys: set[str] = set()
        for root in roots:
            last = self._last(root)
            prefixes = None if walk else self._prefixes(last)
            if prefixes is None:
                chain = self._lineage(last)
                walked_keys.update(c.entry.capture_key for c in chain)
                taken.append(chain)
            else:
                taken.append(prefixes)
        longest: dict[str, tuple[_KeyCalls, int]] = {}  # key -> its calls and how many some root takes
        mixed: dict[str, dict[str, Call]] = {key: {} for key in walked_keys}  # key -> calls, first reached first
        for lineage in taken:  # each from its earliest call, in the roots' order
            for item in lineage:
                if isinstance(item, tuple):
                    kc, n = item
                    key = kc.calls[0].entry.capture_key
                    if key in mixed:
                        for call in kc.calls[:n]:
                            mixed[key].setdefault(call.entry.model_call_id, call)
                    elif n > longest.get(key, (kc, 0))[1]:
                        longest[key] = (kc, n)
                else:
                    mixed[item.entry.capture_key].setdefault(item.entry.model_call_id, item)
        # a chain's calls rise in turn index; a walked key's are sorted by it
        return longest, {key: sorted(calls.values(), key=lambda c: c.entry.turn_index) for key, calls in mixed.items()}

    def _last(self, root: AgentContinuationRoot) -> Call:
        """The root's last committed call; ``ledger_mismatch`` if its attempt is tombstoned or this
        server never served that call."""
        if self.admission.tombstoned(root.rollout_id, root.attempt_index):
            raise ControlError("ledger_mismatch", f"continuation root {root.capture_key!r} is tombstoned")
        last = self._find(root.rollout_id, root.last_committed_model_call_id, root.attempt_index)
        if last is None:
            raise ControlError("ledger_mismatch", f"continuation of {root.capture_key!r} names model call "
                               f"{root.last_committed_model_call_id!r}, which this model server never served")
        return last

    def _prefixes(self, last: Call) -> list[tuple[_KeyCalls, int]] | None:
        """:meth:`_lineage` of ``last`` as (a key's calls, how many of them), earliest attempt first,
        when every key the walk passes through holds one chain; None when one does not (then only
        walking finds the lineage)."""
        keys: list[str] | None = None  # the earlier attempts' keys, once the walk leaves its own
        prefixes: list[tuple[_KeyCalls, int]] = []
        call = last
        while True:
            kc = self._by_key.get(call.entry.capture_key)
            at = kc.position.get(call.entry.model_call_id) if kc is not None else None
            if kc is None or at is None or not kc.chain or kc.calls[at] is not call:
                return None
            prefixes.append((kc, at + 1))
            parent = kc.calls[0].entry.parent_call_id
            if parent is None:
                return prefixes[::-1]
            if parent in kc.position:  # the walk looks for a parent in its call's own key first
                return None
            # then in the earlier attempts' keys, latest first, as _lineage does
            if keys is None:
                keys = capture_keys_down(last.entry.rollout_id, last.entry.attempt_index)
            found = self._find_in(keys[last.entry.attempt_index - call.entry.attempt_index + 1:], parent)
            if found is None:
                return prefixes[::-1]
            call = found

    def _lineage(self, last: Call) -> list[Call]:
        """``last`` and its ancestors through ``parent_call_id`` (an unknown parent ends the walk)."""
        # Seen by (capture key, call id): a call id is unique within its capture key only, and a
        # next attempt's calls may reuse its earlier attempt's ids (a walk by id alone stopped there).
        chain, seen = [last], {(last.entry.capture_key, last.entry.model_call_id)}
        keys = capture_keys_down(last.entry.rollout_id, last.entry.attempt_index)  # a parent's attempt is <= its child's
        while (parent := chain[-1].entry.parent_call_id) is not None:
            found = self._find_in(keys[last.entry.attempt_index - chain[-1].entry.attempt_index:], parent)
            if found is None or (found.entry.capture_key, parent) in seen:
                break
            chain.append(found)
            seen.add((found.entry.capture_key, parent))
        return chain[::-1]

    @property
    def calls(self) -> dict[tuple[str, str], Call]:
        """Every recorded call by (capture key, call id), built when asked (tests, reports); the
        ledger itself is kept per capture key."""
        return {(key, call_id): kc.calls[at] for key, kc in self._by_key.items() for call_id, at in kc.position.items()}

    def _known(self, key: str, call_id: str) -> Call | None:
        """The call ``call_id`` of capture key ``key``, if this server recorded one."""
        kc = self._by_key.get(key)
        return None if kc is None else kc.get(call_id)

    def _find(self, rollout_id: str, call_id: str, attempt: int) -> Call | None:
        """The call ``call_id`` of the latest attempt <= ``attempt`` that made it."""
        return self._find_in(capture_keys_down(rollout_id, attempt), call_id)

    def _find_in(self, keys: list[str], call_id: str) -> Call | None:
        """The call ``call_id`` of the first of ``keys`` (capture keys, latest attempt first) that made it."""
        for key in keys:
            if (found := self._known(key, call_id)) is not None:
                return found
        return None

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
        if (known := self._known(key, req.model_call_id)) is not None:
            return self._replay(known, req)
        # Admission refuses while a checkpoint holds the server (409 checkpoint_parked) and for an
        # attempt a restore or abort_inflight ended (409 stale_attempt): Gym's data-plane answers.
        async with self.admission.call(req.rollout_id, req.attempt_index, "responses"):
            if self.slow_s:
                await asyncio.sleep(self.slow_s)
            if (known := self._known(key, req.model_call_id)) is not None:
                return self._replay(known, req)  # an identical call finished meanwhile
            token = self._record(req, key)
            await self._capture(token)  # durable before the answer (Gym's TokenSink contract)
        return reply_of(token)

    async def _capture(self, token: dict[str, Any]) -> None:
        """Put a call's TokenEntry into the token store. As in Gym, a capture error never fails the
        model call: the rollout is marked incomplete instead (so a trainer masks it)."""
        if self.token_store is None:
            return
        key, call_id = token["rollout_id"], token["model_call_id"]
        try:
            await self.token_store.put(token)
        except Exception as exc:  # noqa: BLE001 - any capture failure is reported the same way
            log.warning("token capture of %s call %s failed: %s", key, call_id, exc)
            try:
                await self.token_store.mark_incomplete(key, call_id)
            except Exception as again:  # noqa: BLE001
                log.error("could not mark %s incomplete after a failed capture: %s", key, again)

    def _replay(self, known: Call, req: ModelCall) -> ModelReply:
        """A retried call gets the recorded answer; a different prompt under the same id is refused."""
        if known.fields()["prompt_token_ids"] != list(req.prompt_token_ids):
            raise ApiRefused(409, "conflict", f"{req.model_call_id!r} of {known.entry.capture_key!r} was already "
                             "recorded with a different prompt")
        return known.reply(replayed=True)

    def _record(self, req: ModelCall, key: str) -> dict[str, Any]:
        """Generate, then stamp the call's lineage as Gym does: a root names no parent; a parent the
        ledger holds is resolved; one it does not hold is unresolved and, by Gym's rule, not named.
        Records the call in the ledger and returns its token record."""
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
        self._by_key.setdefault(key, _KeyCalls()).add(Call.answered(entry, token))
        return token

    def ledger_view(self) -> list[dict[str, Any]]:
        """The ledger as plain rows (for tests and the demo), in call order per capture key."""
        calls = sorted(self.calls.values(),
                       key=lambda c: (c.entry.rollout_id, c.entry.attempt_index, c.entry.turn_index))
        return [{"rollout_id": c.entry.rollout_id, "attempt_index": c.entry.attempt_index,
                 "capture_key": c.entry.capture_key, "model_call_id": c.entry.model_call_id,
                 "parent_call_id": c.entry.parent_call_id, "turn_index": c.entry.turn_index,
                 "parent_resolution": c.fields()["parent_resolution"]} for c in calls]


MAX_CALL_BATCH = 2000


class ModelCallBatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    calls: Annotated[list[ModelCall], msgspec.Meta(min_length=1, max_length=MAX_CALL_BATCH)]


async def _answer(participant: RefModel, call: ModelCall) -> dict[str, Any]:
    """One call of a batch: the status and body ``POST /v1/responses`` would answer."""
    try:
        return {"status": 200, "body": await participant.call(call)}
    except ApiRefused as exc:
        return {"status": exc.status, "body": exc.body}
    except ControlError as exc:  # Gym's data-plane refusals (checkpoint_parked, stale_attempt)
        resp = error_response(exc)
        return {"status": resp.status_code, "body": msgspec.Raw(bytes(resp.body))}


def create_app(name: str, token: str, seed: int = 0, slow_ms: int = 0, commit_delay_ms: int = 0,
               token_store: str | None = None) -> FastAPI:
    """The model server's FastAPI app: ``/v1/responses``, ``/ledger`` and the control routes.

    With ``token_store`` (a folder or ``s3://`` location), every call's TokenEntry is captured
    there through :class:`gymkit.TokenStore` before the call is answered.
    """
    store = TokenStore(token_store) if token_store else None
    admission = ModelAdmission()
    participant = RefModel(name, seed, admission, slow_ms, commit_delay_ms, token_store=store)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if store is not None:
            await store.close()

    app = FastAPI(title=f"refgym model server {name}", lifespan=lifespan)
    app.state.participant = participant
    app.include_router(model_router(participant, admission, Fence(), token))
    install_error_handler(app)
    health_routes(app, "model", name)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return reply(await participant.call(await decode(request, ModelCall)))

    @app.post("/v1/responses/batch")
    async def responses_batch(request: Request) -> Response:
        """Several model calls in one request (a scale benchmark's light path), each answered exactly
        as ``POST /v1/responses`` would (same admission, ledger and capture), all at once; each answer
        is ``{"status", "body"}``."""
        batch = await decode(request, ModelCallBatch)
        return reply(await asyncio.gather(*(_answer(participant, c) for c in batch.calls)))

    @app.get("/ledger")
    async def ledger() -> Response:
        return reply(participant.ledger_view())

    return app
