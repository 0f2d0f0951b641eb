"""NeMo Gym's token-capture protocols (``TokenSink``, ``TokenSource``) over a snapformat store.

Gym's model server captures one ``TokenEntry`` per model call and hands it to a ``TokenSink``; a
trajectory builder later freezes the rollout through a ``TokenSource`` and retires what it consumed.
Gym ships a file store for one machine (``nemo_gym.token_id_capture.store.TokenCaptureStore``).
:class:`TokenStore` is the same contract over any snapformat location: a local folder, or
``s3://bucket/prefix`` (every worker of every node sharing one rollout's records).

The contract (``spec/SPEC.md`` section 22 is the normative text)
-----------------------------------------------------------------

Layout, under the store's root::

    rollouts/<capture key>/log/00000000000000000001.json
    rollouts/<capture key>/log/00000000000000000002.json
    ...

One rollout (Gym's ``TokenEntry.rollout_id``, the capture key; it must be a safe name) is an
append-only log of small JSON objects. Event ``n`` lives at ``log/<n as 20 digits>.json`` and is
written once, with the store's create-only primitive (``Store.create_exclusive``: a hard link on
local disk, ``PUT`` with ``If-None-Match: *`` on S3), at ``n = head + 1``. Exactly one writer wins
each number, so the log is one total order that every process agrees on, and a writer whose
create succeeded at ``n`` knows every event before ``n`` (it read them, or lost the race for them
and read them then). Events (``kind``): ``put`` (the canonical entry bytes and their SHA-256),
``incomplete`` (``mark_incomplete`` or a conflicting re-put), ``intent`` (``begin_call``),
``freeze`` (a new ``snapshot_id``), ``retire`` (the ``snapshot_id`` and ``version`` retired).

Semantics, all derived from the log alone (the per-instance cache is only a cache):

* ``put``: the canonical bytes are the compact JSON, keys sorted, of ``model_dump(mode="json")``.
  Same call id and same bytes already in the log: no-op (even after freeze: it is not a write).
  Rollout frozen or retired: refused (:class:`RolloutFencedError`), a hard fence. Same call id,
  different bytes: an ``incomplete`` event is appended, then :class:`ConflictingEntryError`.
  Otherwise a ``put`` event; ``put`` returns once the create-only write returned, i.e. durable
  (fsync of the file and its folder; an acknowledged S3 PUT) and visible to any fresh reader.
* ``mark_incomplete``: always appends (also after freeze and after retirement), so it always
  moves the version.
* ``begin_call``: appends an ``intent`` (refused after freeze); a rollout whose log holds an
  intent for a call with no ``put`` freezes incomplete.
* ``freeze``: lists the log, appends a ``freeze`` event unless one is there, and returns
  ``version`` = the log's head. Two freezes with nothing between agree; anything appended after
  (only ``incomplete`` can be, and ``retire``) moves the version.
* ``drop(snapshot_id, version)``: creates a ``retire`` event at exactly ``version + 1`` if the log
  at ``version`` is frozen with that ``snapshot_id``. A lost race means something was appended
  after the snapshot: ``False``. The log is kept (a late writer still meets the fence);
  :meth:`TokenStore.sweep_retired` removes retired rollouts after a grace period.

A crash at any step leaves either nothing or one whole event: the create-only write is atomic
(local disk writes a ``.tmp-*`` file beside the log first, which readers ignore). An acknowledged
write is in the log; an unacknowledged one may be too, and its retry is then a no-op (the same
bytes) or a conflict (rebuilt bytes, as Gym specifies).

Guarantees hold wherever the create-only write does. On local disk an event is a temporary file,
``fsync``ed, hard-linked to its name (``EEXIST`` loses the race), then the folder ``fsync``ed:
durable when ``put`` returns, visible complete or not at all (``LocalStore.create_exclusive``: two
fsyncs per event). On S3 they rest on two properties of the server: a create-only PUT is atomic (AWS since
2024, SeaweedFS, moto; snapformat's store conformance suite checks it) and a read of a key after
its PUT or a failed conditional PUT sees the object (S3's strong read-after-write consistency). A
listing is used only to learn the head; a stale listing costs a lost race, never a wrong answer.
A store that ignores ``If-None-Match`` would let two writers take one number: not supported.

``nemo_gym`` is not imported by this module: ``put`` takes Gym's ``TokenEntry`` (anything with
``model_dump(mode="json")``) or a dict of the same JSON; :meth:`TokenStore.freeze` imports Gym on
first use to return Gym's own ``TokenCaptureSnapshot``; :meth:`TokenStore.freeze_records` is the
Gym-free read.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Union

import msgspec

from schemas.errors import (
    CommitConflictError,
    CorruptSnapshotError,
    InvalidRecordError,
    SnapshotError,
    StoreError,
    VersionError,
)
from schemas.identity import check_name
from snapformat.store import Store, open_store

if TYPE_CHECKING:  # Gym is optional: imported lazily by freeze()
    from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot

#: Version of the log's event objects this code writes and the highest it reads.
LOG_FORMAT_VERSION = 1
#: Digits of a log sequence number in an object name (zero-padded, so names sort in log order).
SEQ_DIGITS = 20
#: Largest event object written or read (an entry of several million tokens fits).
MAX_EVENT_BYTES = 256 << 20
#: Rollouts whose log state one instance keeps in memory (least recently used are forgotten).
DEFAULT_CACHED_ROLLOUTS = 10_000
#: Threads reading log objects in parallel from an object store (local disk reads in line).
DEFAULT_READ_THREADS = 16
#: ``mark_incomplete`` tries this often on a store failure: it must be more available than ``put``.
MARK_ATTEMPTS = 3
_MARK_BACKOFF_S = 0.2
#: A lost race teaches the writer at least one event; this many in one append means a runaway.
_MAX_APPEND_ROUNDS = 100_000
_ROLLOUTS = "rollouts"
_LOG_NAME = re.compile(r"[0-9]{%d}\.json" % SEQ_DIGITS)
_GYM_MISSING = (
    "TokenStore.freeze returns NeMo Gym's TokenCaptureSnapshot and needs the nemo_gym package: "
    "pip install nemo-gym (in this repository: pip install -r requirements-gym-test.txt && "
    "pip install --no-deps --ignore-requires-python nemo-gym==0.7.0); or call freeze_records(), "
    "which returns the same snapshot with entries as JSON dicts and needs no Gym"
)


# -- errors ---------------------------------------------------------------------------------------


class RolloutFencedError(SnapshotError):
    """A write the rollout's log forbids: a put or begin_call after freeze, a freeze after retirement."""


class ConflictingEntryError(InvalidRecordError):
    """A model call id was put again with different bytes; the rollout is now marked incomplete."""


# -- log events (the objects under rollouts/<key>/log/) -------------------------------------------


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Fields every event carries: the format version and the writer's clock (diagnostics only)."""

    v: int = LOG_FORMAT_VERSION
    at: float = 0.0


class PutEvent(_Event, tag="put"):
    """One captured entry: its canonical JSON bytes verbatim and their SHA-256."""

    model_call_id: str
    digest: str
    entry: msgspec.Raw


class IncompleteEvent(_Event, tag="incomplete"):
    """A call of the rollout failed to capture (or was put twice with different bytes)."""

    model_call_id: str = ""
    reason: str = ""


class IntentEvent(_Event, tag="intent"):
    """``begin_call``: the call is about to be dispatched; no entry for it by freeze masks the rollout."""

    model_call_id: str


class FreezeEvent(_Event, tag="freeze"):
    """The rollout is frozen; the first freeze event's ``snapshot_id`` names the snapshot."""

    snapshot_id: str


class RetireEvent(_Event, tag="retire"):
    """The consumer retired exactly this snapshot at exactly this version."""

    snapshot_id: str
    version: int


LogEvent = Union[PutEvent, IncompleteEvent, IntentEvent, FreezeEvent, RetireEvent]
_DECODER = msgspec.json.Decoder(LogEvent)


class _VersionProbe(msgspec.Struct, frozen=True):
    v: int = 0


# -- results --------------------------------------------------------------------------------------


class FrozenRecords(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen rollout without Gym: what ``TokenCaptureSnapshot`` holds, entries as JSON dicts.

    ``entries`` are in log order, one per model call id; ``incomplete_reasons`` says why
    ``incomplete`` is true (a marked call, conflicting payloads, an intent without an entry).
    """

    rollout_id: str
    entries: tuple[dict[str, Any], ...]
    incomplete: bool
    snapshot_id: str
    version: int
    incomplete_reasons: tuple[str, ...] = ()


class _FrozenRaw(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen rollout with each entry still as its canonical bytes (decoded by the caller)."""

    rollout_id: str
    entries: tuple[bytes, ...]
    incomplete_reasons: tuple[str, ...]
    snapshot_id: str
    version: int


# -- the cached view of one rollout's log ---------------------------------------------------------


class _RolloutView:
    """What one instance knows of one rollout's log: events ``1..head``, summarised.

    Only digests are kept (not entry bytes), so a long-lived model server's memory does not grow
    with token arrays. Guarded by ``lock`` (one blocking operation per rollout at a time).
    """

    __slots__ = ("lock", "loaded", "head", "puts", "conflicts", "marks", "intents", "snapshot_id", "retired")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded = False  # the log has been listed once by this instance
        self.head = 0
        self.puts: dict[str, tuple[int, str]] = {}  # call id -> (sequence, digest) of its first put
        self.conflicts: dict[str, int] = {}  # call id -> sequence of a put with other bytes
        self.marks: list[str] = []  # why the log says incomplete (incomplete events, late puts)
        self.intents: dict[str, int] = {}  # call id -> sequence of its first intent
        self.snapshot_id = ""  # of the first freeze event; empty while not frozen
        self.retired: tuple[str, int] | None = None  # (snapshot_id, version) of the retire event

    @property
    def frozen(self) -> bool:
        return bool(self.snapshot_id)

    def apply(self, seq: int, event: LogEvent) -> None:
        """Fold event ``seq`` (which must be ``head + 1``) into the view."""
        if seq != self.head + 1:
            raise AssertionError(f"log event {seq} applied after {self.head}")
        self.head = seq
        if isinstance(event, PutEvent):
            known = self.puts.get(event.model_call_id)
            if known is None:
                self.puts[event.model_call_id] = (seq, event.digest)
                if self.frozen:  # a writer that broke the fence: the consumed snapshot lacks it
                    self.marks.append(f"call {event.model_call_id!r} was put after the freeze (event {seq})")
            elif known[1] != event.digest:
                self.conflicts.setdefault(event.model_call_id, seq)
        elif isinstance(event, IncompleteEvent):
            why = f": {event.reason}" if event.reason else ""
            self.marks.append(f"call {event.model_call_id!r} marked incomplete (event {seq}){why}")
        elif isinstance(event, IntentEvent):
            self.intents.setdefault(event.model_call_id, seq)
        elif isinstance(event, FreezeEvent):
            if not self.snapshot_id:
                self.snapshot_id = event.snapshot_id
        elif isinstance(event, RetireEvent) and self.retired is None:
            self.retired = (event.snapshot_id, event.version)

    def incomplete_reasons(self) -> tuple[str, ...]:
        reasons = list(self.marks)
        reasons += [f"call {c!r} has conflicting payloads (event {s})" for c, s in self.conflicts.items()]
        reasons += [f"call {c!r} began (intent, event {s}) but has no entry"
                    for c, s in self.intents.items() if c not in self.puts]
        return tuple(reasons)


# -- small pure helpers ---------------------------------------------------------------------------


def _seq_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}.json"


def _log_prefix(rollout_id: str) -> str:
    return f"{_ROLLOUTS}/{rollout_id}/log"


def _check_rollout_id(rollout_id: Any, where: str = "rollout_id") -> str:
    """A capture key that is a safe single path segment, else :class:`InvalidRecordError`."""
    return check_name(rollout_id, where=where)


def entry_payload(entry: Any) -> dict[str, Any]:
    """The JSON object of ``entry``: Gym's ``TokenEntry`` (``model_dump(mode="json")``) or a dict."""
    if isinstance(entry, dict):
        payload = entry
    else:
        dump = getattr(entry, "model_dump", None)
        if not callable(dump):
            raise InvalidRecordError(
                f"token entry: expected Gym's TokenEntry (with model_dump) or a dict, got {type(entry).__name__}")
        payload = dump(mode="json")
    if not isinstance(payload, dict):
        raise InvalidRecordError(f"token entry: model_dump(mode='json') gave {type(payload).__name__}, not a dict")
    for field in ("rollout_id", "model_call_id"):
        if not isinstance(payload.get(field), str):
            raise InvalidRecordError(f"token entry: {field} is {payload.get(field)!r} (expected a string)")
    _check_finite(payload)
    return payload


def _check_finite(payload: dict[str, Any]) -> None:
    """Refuse numbers JSON cannot hold: ``-inf`` would be stored as ``null`` and fail at freeze.

    Checked: every top-level number and every log prob (where ``-inf`` really occurs). For the
    log probs ``sum`` runs in C and is finite when every term is (barring an overflow, which the
    exact scan then clears), so the common case costs no Python-level work per token.
    """
    for field, value in payload.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRecordError(f"token entry {payload['model_call_id']!r} of rollout {payload['rollout_id']!r}: "
                                     f"{field} is {value} (expected a finite number: JSON has no infinities or NaN)")
    probs = payload.get("generation_log_probs")
    if not isinstance(probs, list) or not probs:
        return
    try:
        if math.isfinite(sum(probs)):
            return
    except TypeError:
        return  # not numbers: Gym's own validation reports that, not this check
    for i, p in enumerate(probs):
        if isinstance(p, float) and not math.isfinite(p):
            raise InvalidRecordError(
                f"token entry {payload['model_call_id']!r} of rollout {payload['rollout_id']!r}: "
                f"generation_log_probs[{i}] is {p} (expected a finite number: JSON has no infinities or NaN)")


def canonical_bytes(payload: dict[str, Any]) -> bytes:
    """The stored form of an entry: compact JSON, keys sorted (byte-identical for an identical entry)."""
    return msgspec.json.encode(payload, order="sorted")


def _gym_types() -> tuple[Any, Any]:
    """Gym's ``TokenCaptureSnapshot`` and ``TokenEntry``, or an ImportError naming the pip command."""
    try:
        from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot
        from nemo_gym.token_id_capture.records import TokenEntry
    except ImportError as exc:
        raise ModuleNotFoundError(_GYM_MISSING, name="nemo_gym") from exc
    return TokenCaptureSnapshot, TokenEntry


# -- the store ------------------------------------------------------------------------------------


class TokenStore:
    """Gym's ``TokenSink`` and ``TokenSource`` (with ``begin_call``) over a snapformat location.

    ``TokenStore("/data/tokens")`` or ``TokenStore("s3://bucket/tokens")`` (or a ``Store``). Any
    number of instances in any number of processes may share one location; each caches what it
    has read of each rollout's log, so a put from a warm instance costs one create-only write.
    Every method is a coroutine that runs its blocking I/O in a worker thread.
    """

    def __init__(self, url: str | Store, *, cached_rollouts: int = DEFAULT_CACHED_ROLLOUTS,
                 read_threads: int = DEFAULT_READ_THREADS) -> None:
        self.store: Store = open_store(url) if isinstance(url, str) else url
        self.url = self.store.url
        self._cached_rollouts = max(1, cached_rollouts)
        self._read_threads = max(1, read_threads)
        self._views: OrderedDict[str, _RolloutView] = OrderedDict()
        self._views_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Object stores answer in milliseconds, so many reads go out at once; local reads do not gain.
        self._remote = self.store.local_path("x") is None
        self._closed = False

    def __repr__(self) -> str:
        return f"TokenStore({self.url!r})"

    # -- TokenSink ----------------------------------------------------------------------------

    async def put(self, entry: Any) -> None:
        """Durably store one entry (Gym's ``TokenEntry`` or a dict of its JSON) before returning.

        A byte-identical re-put is a no-op. After freeze (or retirement) a new entry is refused
        with :class:`RolloutFencedError`. A different payload for a stored call id appends an
        ``incomplete`` event and raises :class:`ConflictingEntryError`. A rollout id that is not a
        safe name raises :class:`InvalidRecordError`; a store failure :class:`StoreError`.
        """
        await asyncio.to_thread(self._put_sync, entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably record that a call of this rollout failed to capture; always moves the version.

        Succeeds after freeze and after retirement; a failing store is tried again
        (:data:`MARK_ATTEMPTS` times) before :class:`StoreError` is raised.
        """
        await asyncio.to_thread(self._mark_sync, rollout_id, model_call_id, "")

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record that ``model_call_id`` is about to be dispatched (Gym's optional extension).

        A freeze that finds this intent without an entry for the call reports the rollout
        incomplete. Refused after freeze with :class:`RolloutFencedError`.
        """
        await asyncio.to_thread(self._begin_sync, rollout_id, model_call_id)

    # -- TokenSource --------------------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze the rollout and return Gym's ``TokenCaptureSnapshot`` of Gym ``TokenEntry`` objects.

        Idempotent: the same ``snapshot_id``; the same ``version`` unless something was appended
        in between. Needs ``nemo_gym`` (a ``ModuleNotFoundError`` naming the pip command
        otherwise); :meth:`freeze_records` is the same without Gym.
        """
        snapshot_cls, entry_cls = _gym_types()
        frozen = await asyncio.to_thread(self._freeze_sync, rollout_id)
        entries = []
        for raw in frozen.entries:
            try:
                entries.append(entry_cls.model_validate_json(raw))
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                raise CorruptSnapshotError(
                    f"{self.store.display(_log_prefix(rollout_id))}: a stored entry is not a valid Gym "
                    f"TokenEntry: {exc}") from exc
        return snapshot_cls(rollout_id=frozen.rollout_id, entries=tuple(entries),
                            incomplete=bool(frozen.incomplete_reasons), snapshot_id=frozen.snapshot_id,
                            version=frozen.version)

    async def freeze_records(self, rollout_id: str) -> FrozenRecords:
        """Freeze the rollout like :meth:`freeze`, without Gym: entries as JSON dicts."""
        frozen = await asyncio.to_thread(self._freeze_sync, rollout_id)
        entries = tuple(msgspec.json.decode(raw) for raw in frozen.entries)
        return FrozenRecords(rollout_id=frozen.rollout_id, entries=entries,
                             incomplete=bool(frozen.incomplete_reasons), snapshot_id=frozen.snapshot_id,
                             version=frozen.version, incomplete_reasons=frozen.incomplete_reasons)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly the frozen snapshot ``(snapshot_id, version)``; ``False`` if the log moved on.

        Retiring the same snapshot again returns ``True``. The log stays (a late writer still meets
        the fence); :meth:`sweep_retired` deletes retired rollouts after a grace period.
        """
        return await asyncio.to_thread(self._drop_sync, rollout_id, snapshot_id, version)

    async def close(self) -> None:
        """Release the read threads and the cache. Idempotent; nothing is ever left unwritten."""
        self._closed = True
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._views_lock:
            self._views.clear()

    # -- retention ----------------------------------------------------------------------------

    async def sweep_retired(self, older_than_s: float) -> list[str]:
        """Delete every rollout retired more than ``older_than_s`` seconds ago; return their ids.

        The age is the retire object's modification time on the store. A writer of that rollout
        still running afterwards would start a new log nobody freezes: attempt-scoped capture keys
        make that harmless, and the grace period should outlast any attempt.
        """
        return await asyncio.to_thread(self._sweep_sync, older_than_s)

    # -- blocking implementations -------------------------------------------------------------

    def _put_sync(self, entry: Any) -> None:
        self._check_open()
        payload = entry_payload(entry)
        rollout_id = _check_rollout_id(payload["rollout_id"], where="TokenEntry.rollout_id")
        call_id = payload["model_call_id"]
        data = canonical_bytes(payload)
        if len(data) > MAX_EVENT_BYTES - 4096:  # the event's own fields need a little room
            raise InvalidRecordError(f"token entry {call_id!r} of rollout {rollout_id!r}: {len(data):,} bytes "
                                     f"of JSON (at most {MAX_EVENT_BYTES - 4096:,})")
        digest = hashlib.sha256(data).hexdigest()

        def decide(view: _RolloutView) -> _Event | None:
            known = view.puts.get(call_id)
            if known is not None and known[1] == digest:
                return None  # the identical bytes are already durable: a retry, not a write
            if view.retired is not None or view.frozen:
                raise RolloutFencedError(
                    f"{self._where(rollout_id)}: rollout {rollout_id!r} is "
                    f"{'retired' if view.retired else 'frozen'} (snapshot {view.snapshot_id}); "
                    f"refusing the entry of call {call_id!r}")
            if known is not None:
                raise ConflictingEntryError(
                    f"{self._where(rollout_id)}: call {call_id!r} of rollout {rollout_id!r} was already put "
                    f"(event {known[0]}, sha256 {known[1][:16]}...) with other bytes (sha256 {digest[:16]}...); "
                    "a retry must resend the identical entry")
            return PutEvent(model_call_id=call_id, digest=digest, entry=msgspec.Raw(data), at=time.time())

        view = self._view(rollout_id)
        with view.lock:
            try:
                self._append(rollout_id, view, decide)
            except ConflictingEntryError as conflict:
                reason = f"conflicting re-put (sha256 {digest[:16]}...)"
                try:
                    self._append(rollout_id, view, lambda _v: IncompleteEvent(
                        model_call_id=call_id, reason=reason, at=time.time()))
                except SnapshotError as exc:  # the conflict is the news; say the marker failed too
                    raise ConflictingEntryError(
                        f"{conflict}; marking the rollout incomplete failed too: {exc}") from exc
                raise

    def _mark_sync(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        self._check_open()
        _check_rollout_id(rollout_id)
        view = self._view(rollout_id)
        for attempt in range(MARK_ATTEMPTS):
            try:
                with view.lock:
                    self._append(rollout_id, view, lambda _v: IncompleteEvent(
                        model_call_id=model_call_id, reason=reason, at=time.time()))
                return
            except StoreError:
                if attempt + 1 == MARK_ATTEMPTS:
                    raise
                time.sleep(_MARK_BACKOFF_S * 2**attempt)

    def _begin_sync(self, rollout_id: str, model_call_id: str) -> None:
        self._check_open()
        _check_rollout_id(rollout_id)

        def decide(view: _RolloutView) -> _Event | None:
            if model_call_id in view.intents or model_call_id in view.puts:
                return None  # already in custody
            if view.retired is not None or view.frozen:
                raise RolloutFencedError(f"{self._where(rollout_id)}: rollout {rollout_id!r} is frozen "
                                         f"(snapshot {view.snapshot_id}); refusing to begin call {model_call_id!r}")
            return IntentEvent(model_call_id=model_call_id, at=time.time())

        view = self._view(rollout_id)
        with view.lock:
            self._append(rollout_id, view, decide)

    def _freeze_sync(self, rollout_id: str) -> _FrozenRaw:
        self._check_open()
        _check_rollout_id(rollout_id)
        view = self._view(rollout_id)
        with view.lock:
            # A listing, even for a warm view: version is the head *now*, whoever appended since.
            fresh = self._catch_up(rollout_id, view)
            if view.retired is not None:
                raise RolloutFencedError(f"{self._where(rollout_id)}: rollout {rollout_id!r} was retired "
                                         f"(snapshot {view.retired[0]}, version {view.retired[1]})")
            if not view.frozen:
                new_id = uuid.uuid4().hex
                self._append(rollout_id, view,
                             lambda v: None if v.frozen else FreezeEvent(snapshot_id=new_id, at=time.time()))
            seqs = sorted(seq for seq, _ in view.puts.values())
            snapshot_id, version, reasons = view.snapshot_id, view.head, view.incomplete_reasons()
        # Entries this call did not just read (a warm view knows only their digests) are read now,
        # outside the lock: log events never change once written.
        missing = [s for s in seqs if not isinstance(fresh.get(s), PutEvent)]
        fresh.update(zip(missing, self._read_events(rollout_id, missing)))
        entries = []
        for seq in seqs:
            event = fresh[seq]
            if not isinstance(event, PutEvent):
                raise CorruptSnapshotError(f"{self._key_display(rollout_id, seq)}: expected a put event, found "
                                           f"a {type(event).__name__} (the log changed under this reader)")
            entries.append(bytes(event.entry))
        return _FrozenRaw(rollout_id=rollout_id, entries=tuple(entries), incomplete_reasons=reasons,
                          snapshot_id=snapshot_id, version=version)

    def _drop_sync(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        self._check_open()
        _check_rollout_id(rollout_id)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            return False  # no log position: nothing that was frozen
        view = self._view(rollout_id)
        with view.lock:
            self._catch_up(rollout_id, view)
            if view.retired is not None:
                return view.retired == (snapshot_id, version)
            if view.head != version or view.snapshot_id != snapshot_id:
                return False
            event = RetireEvent(snapshot_id=snapshot_id, version=version, at=time.time())
            try:
                self.store.create_exclusive(self._key(rollout_id, version + 1), msgspec.json.encode(event))
            except CommitConflictError:
                # Something was appended after the snapshot (or another consumer retired it first).
                self._catch_up(rollout_id, view, at_least=version + 1)
                return view.retired == (snapshot_id, version)
            view.apply(version + 1, event)
            return True

    def _sweep_sync(self, older_than_s: float) -> list[str]:
        self._check_open()
        cutoff = time.time() - older_than_s
        swept = []
        for rollout_id in self.store.list_names(_ROLLOUTS):
            try:
                _check_rollout_id(rollout_id)
            except InvalidRecordError:
                continue  # not ours
            if self._sweep_one(rollout_id, cutoff):
                with self._views_lock:
                    self._views.pop(rollout_id, None)
                swept.append(rollout_id)
        return swept

    def _sweep_one(self, rollout_id: str, cutoff: float) -> bool:
        """Delete one rollout if its log's tail shows a retirement older than ``cutoff``.

        Only the tail is read: after a ``retire`` event only ``incomplete`` events can follow, so
        anything else on the way down means the rollout is live. Events go oldest first and the
        ``retire`` event last, so a sweep cut short by a crash leaves a log that still ends in its
        retirement (with a hole, which readers report) and the next sweep finishes it.
        """
        seqs = sorted(int(n[:SEQ_DIGITS]) for n in self.store.list_names(_log_prefix(rollout_id))
                      if _LOG_NAME.fullmatch(n))
        retire_seq = None
        for seq in reversed(seqs):
            try:
                event = self._read_event(rollout_id, seq)
            except CorruptSnapshotError:
                return False  # deleted meanwhile (another sweeper) or damaged: leave it to an operator
            if isinstance(event, RetireEvent):
                retire_seq = seq
                break
            if not isinstance(event, IncompleteEvent):
                return False
        if retire_seq is None or self.store.info(self._key(rollout_id, retire_seq)).mtime > cutoff:
            return False
        for seq in seqs:
            if seq != retire_seq:
                self.store.delete(self._key(rollout_id, seq))
        self.store.delete(self._key(rollout_id, retire_seq))
        self.store.delete_tree(f"{_ROLLOUTS}/{rollout_id}")  # the markers after it, .tmp-* files, folders
        return True

    # -- the log ------------------------------------------------------------------------------

    def _append(self, rollout_id: str, view: _RolloutView,
                decide: Callable[[_RolloutView], _Event | None]) -> int | None:
        """Append ``decide(view)`` at ``head + 1`` with a create-only write; ``None`` appends nothing.

        The caller holds ``view.lock``. A lost race means another writer took that number: read
        what is there and decide again. A successful create at ``n`` proves the view held every
        event before ``n`` when ``decide`` ran, which is what makes the fence strict.
        """
        if not view.loaded:
            self._catch_up(rollout_id, view)
        for _ in range(_MAX_APPEND_ROUNDS):
            event = decide(view)
            if event is None:
                return None
            seq = view.head + 1
            try:
                self.store.create_exclusive(self._key(rollout_id, seq), msgspec.json.encode(event))
            except CommitConflictError:
                self._catch_up(rollout_id, view, at_least=seq)
                continue
            view.apply(seq, event)
            return seq
        raise StoreError(f"{self._where(rollout_id)}: lost {_MAX_APPEND_ROUNDS:,} races in a row appending to the log")

    def _catch_up(self, rollout_id: str, view: _RolloutView, at_least: int = 0) -> dict[int, LogEvent]:
        """List the log and fold in every event after ``view.head`` (at least up to ``at_least``).

        Events are read by key in order, so a listing that lags behind the store only shortens
        what is read, and a missing number below the head is a hole: the log is damaged.
        """
        listed = [int(name[:SEQ_DIGITS]) for name in self.store.list_names(_log_prefix(rollout_id))
                  if _LOG_NAME.fullmatch(name)]
        top = max([view.head, at_least, *listed])
        seqs = list(range(view.head + 1, top + 1))
        events = dict(zip(seqs, self._read_events(rollout_id, seqs)))
        for seq in seqs:
            view.apply(seq, events[seq])
        view.loaded = True
        return events

    def _read_events(self, rollout_id: str, seqs: list[int]) -> list[LogEvent]:
        if len(seqs) > 1 and self._remote:
            return list(self._reader_pool().map(lambda s: self._read_event(rollout_id, s), seqs))
        return [self._read_event(rollout_id, s) for s in seqs]

    def _read_event(self, rollout_id: str, seq: int) -> LogEvent:
        key = self._key(rollout_id, seq)
        try:
            data = self.store.read_bytes(key, limit=MAX_EVENT_BYTES)
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{self.store.display(key)}: missing, but a later event of the log exists "
                                       "(a hole in the log: deleted by hand, or swept while in use)") from None
        if len(data) > MAX_EVENT_BYTES:
            raise CorruptSnapshotError(f"{self.store.display(key)}: larger than {MAX_EVENT_BYTES:,} bytes")
        return _decode_event(data, self.store.display(key))

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._read_threads, thread_name_prefix="token-store-read")
            return self._pool

    # -- bookkeeping --------------------------------------------------------------------------

    def _view(self, rollout_id: str) -> _RolloutView:
        """This instance's view of the rollout's log (created empty; least recently used forgotten)."""
        with self._views_lock:
            view = self._views.get(rollout_id)
            if view is None:
                view = self._views[rollout_id] = _RolloutView()
                while len(self._views) > self._cached_rollouts:
                    self._views.popitem(last=False)  # a holder keeps its object; the log is the truth
            else:
                self._views.move_to_end(rollout_id)
            return view

    def _key(self, rollout_id: str, seq: int) -> str:
        return f"{_log_prefix(rollout_id)}/{_seq_name(seq)}"

    def _key_display(self, rollout_id: str, seq: int) -> str:
        return self.store.display(self._key(rollout_id, seq))

    def _where(self, rollout_id: str) -> str:
        return self.store.display(_log_prefix(rollout_id))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")


def _decode_event(data: bytes, where: str) -> LogEvent:
    """One log object, or a typed error naming it (a newer format is a :class:`VersionError`)."""
    try:
        event = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        try:
            version = msgspec.json.decode(data, type=_VersionProbe).v
        except msgspec.DecodeError:
            version = 0
        if version > LOG_FORMAT_VERSION:
            raise VersionError(f"{where}: log event of format version {version}; this reader understands up to "
                               f"{LOG_FORMAT_VERSION}: upgrade it") from None
        raise CorruptSnapshotError(f"{where}: not a token-capture log event ({exc})") from None
    if event.v > LOG_FORMAT_VERSION:
        raise VersionError(f"{where}: log event of format version {event.v}; this reader understands up to "
                           f"{LOG_FORMAT_VERSION}: upgrade it")
    return event


def read_log(store: Store | str, rollout_id: str) -> list[LogEvent]:
    """Every event of one rollout's log in order (for inspection and tests; no caching, no writes)."""
    s = open_store(store) if isinstance(store, str) else store
    _check_rollout_id(rollout_id)
    listed = sorted(int(n[:SEQ_DIGITS]) for n in s.list_names(_log_prefix(rollout_id)) if _LOG_NAME.fullmatch(n))
    out = []
    for seq in range(1, (listed[-1] if listed else 0) + 1):
        key = f"{_log_prefix(rollout_id)}/{_seq_name(seq)}"
        out.append(_decode_event(s.read_bytes(key, limit=MAX_EVENT_BYTES), s.display(key)))
    return out


__all__ = [
    "ConflictingEntryError", "FreezeEvent", "FrozenRecords", "IncompleteEvent", "IntentEvent", "LogEvent",
    "PutEvent", "RetireEvent", "RolloutFencedError", "TokenStore", "canonical_bytes", "entry_payload", "read_log",
]
