"""The Single Controller's bookkeeping: loader place, recovery ledger and replay index, in memory.

Every change goes through one method that names the transition, so the states a snapshot holds are
only ever those the protocol allows:

- prompt group: ``generating`` (reserved and dispatched) -> ``finalized`` (every rollout sealed or
  failed: their rows are in the data plane, written when each rollout was sealed) ->
  ``claimed_for_training`` -> ``applied_uncheckpointed`` (a training step used it; the trainer's
  step count travels in the same snapshot, in the loader place's ``extra``);
- rollout attempt: ``reserved`` -> ``dispatched`` -> ``sealed`` | ``failed``; after a restore an
  unfinished run ``n`` becomes ``abandoned`` and run ``n + 1`` is ``reserved`` (sent again once Gym
  is resumed);
- ACK owed: added when a result is sealed (its rows are in the data plane), removed when Gym
  confirms the acknowledgement (or answers that it no longer holds the result);
- replay index: one entry per training row, ``ready`` -> ``claimed_for_training`` ->
  ``applied_uncheckpointed``.

:meth:`Bookkeeping.records` is the controller's share of the cut: an immutable copy taken while the
loop is held; :meth:`Bookkeeping.from_records` is its inverse on restore.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from coordinator.workload import Loader, RolloutSpec, Workload
from schemas.controller import AckOwed, LoaderPlace, PromptGroup, RecoveryLedgerRecord, ReplayIndexEntry, RolloutAttempt
from schemas.errors import InvalidRecordError

OPEN_STATES = ("reserved", "dispatched")
DONE_STATES = ("sealed", "failed")


@dataclass
class Group:
    group_id: str
    prompt_index: int
    state: str
    rollout_ids: list[str]


@dataclass
class Attempt:
    rollout_id: str
    group_id: str
    attempt_index: int
    state: str


class ControllerRecords(msgspec.Struct, frozen=True):
    """The controller's part of a cut: what ``controller/`` of a snapshot holds."""

    loader: LoaderPlace
    ledger: list[RecoveryLedgerRecord]
    replay: list[ReplayIndexEntry]


@dataclass
class Bookkeeping:
    workload: Workload
    loader: Loader
    groups: dict[str, Group] = field(default_factory=dict)
    attempts: dict[str, Attempt] = field(default_factory=dict)  # the current run of each rollout
    abandoned: list[Attempt] = field(default_factory=list)  # earlier runs, kept for the record
    acks_owed: dict[str, AckOwed] = field(default_factory=dict)
    replay: dict[str, ReplayIndexEntry] = field(default_factory=dict)
    train_steps: int = 0
    finalized_order: list[str] = field(default_factory=list)  # finalized groups, oldest first

    @classmethod
    def fresh(cls, workload: Workload, epochs: int = 1) -> Bookkeeping:
        return cls(workload, Loader(workload, epochs=epochs))

    # -- dispatching -------------------------------------------------------------------------
    def open_attempts(self) -> list[Attempt]:
        return [a for a in self.attempts.values() if a.state in OPEN_STATES]

    def reserve_next(self) -> list[RolloutSpec] | None:
        """Reserve the next prompt's group (run 0 of each rollout); None when the loader is done,
        ``[]`` while that group is still partly reserved. The loader moves on only in :meth:`dispatched`."""
        prompt = self.loader.peek()
        if prompt is None:
            return None
        specs = self.workload.group(prompt)
        gid = specs[0].group_id
        if gid in self.groups:  # reserved before, part of it not dispatched yet: nothing new
            return []
        self.groups[gid] = Group(gid, prompt, "generating", [s.rollout_id for s in specs])
        for s in specs:
            self.attempts[s.rollout_id] = Attempt(s.rollout_id, gid, 0, "reserved")
        return specs

    def spec(self, rollout_id: str) -> RolloutSpec:
        prompt = self.groups[self.attempts[rollout_id].group_id].prompt_index
        return next(s for s in self.workload.group(prompt) if s.rollout_id == rollout_id)

    def dispatched(self, rollout_ids: list[str]) -> None:
        """The rollouts were accepted by Gym; when a whole group is, the loader moves on."""
        for rid in rollout_ids:
            a = self.attempts[rid]
            if a.state == "reserved":
                a.state = "dispatched"
        prompt = self.loader.peek()
        if prompt is not None:
            gid = f"p{prompt}"
            g = self.groups.get(gid)
            if g is not None and all(self.attempts[r].state != "reserved" for r in g.rollout_ids):
                self.loader.advance()

    # -- results -----------------------------------------------------------------------------
    def is_stored(self, rollout_id: str, attempt_index: int) -> bool:
        a = self.attempts.get(rollout_id)
        return a is not None and a.attempt_index == attempt_index and a.state in DONE_STATES

    def sealed(self, rollout_id: str, attempt_index: int, key: str, partition_id: str) -> None:
        a = self._current(rollout_id, attempt_index, OPEN_STATES)
        a.state = "sealed"
        self.replay[key] = ReplayIndexEntry(key=key, partition_id=partition_id, rollout_id=rollout_id,
                                            attempt_index=attempt_index, group_id=a.group_id, status="ready")
        self.acks_owed[rollout_id] = AckOwed(rollout_id=rollout_id, attempt_index=attempt_index, result_key=key)
        self._maybe_finalize(a.group_id)

    def failed(self, rollout_id: str, attempt_index: int) -> None:
        a = self._current(rollout_id, attempt_index, OPEN_STATES)
        a.state = "failed"
        self.acks_owed[rollout_id] = AckOwed(rollout_id=rollout_id, attempt_index=attempt_index, result_key="")
        self._maybe_finalize(a.group_id)

    def acknowledged(self, rollout_id: str) -> None:
        self.acks_owed.pop(rollout_id, None)

    def _current(self, rollout_id: str, attempt_index: int, states: tuple[str, ...]) -> Attempt:
        a = self.attempts.get(rollout_id)
        if a is None or a.attempt_index != attempt_index or a.state not in states:
            raise InvalidRecordError(f"rollout {rollout_id!r} run {attempt_index}: the ledger has "
                                     f"{'nothing' if a is None else f'run {a.attempt_index} {a.state}'}")
        return a

    def _maybe_finalize(self, group_id: str) -> None:
        g = self.groups[group_id]
        if g.state == "generating" and all(self.attempts[r].state in DONE_STATES for r in g.rollout_ids):
            g.state = "finalized"
            self.finalized_order.append(group_id)

    # -- training ----------------------------------------------------------------------------
    def claim_batch(self, groups: int) -> list[Group]:
        """Claim the oldest ``groups`` finalized groups for one training step (empty if fewer)."""
        if len(self.finalized_order) < groups:
            return []
        batch = [self.groups[g] for g in self.finalized_order[:groups]]
        del self.finalized_order[:groups]
        for g in batch:
            g.state = "claimed_for_training"
            self._set_replay(g, "claimed_for_training")
        return batch

    def applied(self, batch: list[Group]) -> None:
        for g in batch:
            g.state = "applied_uncheckpointed"
            self._set_replay(g, "applied_uncheckpointed")
        self.train_steps += 1

    def _set_replay(self, g: Group, status: str) -> None:
        for k, e in self.replay.items():
            if e.group_id == g.group_id:
                self.replay[k] = msgspec.structs.replace(e, status=status)

    def done(self) -> bool:
        """Every prompt handed out and every group used by training."""
        return self.loader.peek() is None and all(g.state == "applied_uncheckpointed" for g in self.groups.values())

    # -- restore -----------------------------------------------------------------------------
    def next_run(self, rollout_id: str, from_attempt: int, new_attempt: int) -> None:
        """An unfinished run ``from_attempt`` continues as ``new_attempt`` (= n + 1) after a restore:
        reserved, so the loop sends it (Gym's ``/run`` of n + 1, which picks up the restored
        continuation) once Gym is resumed."""
        a = self._current(rollout_id, from_attempt, OPEN_STATES)
        if new_attempt != from_attempt + 1:
            raise InvalidRecordError(f"rollout {rollout_id!r}: Gym restored run {new_attempt}, expected {from_attempt + 1}")
        self.abandoned.append(Attempt(a.rollout_id, a.group_id, a.attempt_index, "abandoned"))
        self.attempts[rollout_id] = Attempt(rollout_id, a.group_id, new_attempt, "reserved")

    # -- records -----------------------------------------------------------------------------
    def records(self) -> ControllerRecords:
        """An immutable copy of everything (the controller's part of the cut)."""
        loader = LoaderPlace(epoch=self.loader.epoch, consumed=self.loader.consumed, seed=self.workload.seed,
                             dataset_size=self.workload.prompts,
                             extra={"train_steps": self.train_steps, "epochs": self.loader.epochs,
                                    "workload": msgspec.to_builtins(self.workload),
                                    "finalized_order": list(self.finalized_order)})
        ledger: list[RecoveryLedgerRecord] = [
            PromptGroup(group_id=g.group_id, prompt_index=g.prompt_index, state=g.state,  # type: ignore[arg-type]
                        rollout_ids=list(g.rollout_ids)) for g in self.groups.values()]
        ledger += [RolloutAttempt(rollout_id=a.rollout_id, group_id=a.group_id, attempt_index=a.attempt_index,
                                  state=a.state)  # type: ignore[arg-type]
                   for a in [*self.abandoned, *self.attempts.values()]]
        ledger += list(self.acks_owed.values())
        return ControllerRecords(loader, ledger, list(self.replay.values()))

    @classmethod
    def from_records(cls, workload: Workload, recs: ControllerRecords, where: str) -> Bookkeeping:
        """The bookkeeping a snapshot saved; refuses one taken with another workload."""
        saved = recs.loader.extra.get("workload")
        if saved != msgspec.to_builtins(workload):
            raise InvalidRecordError(f"{where}: loader_place.extra.workload is {saved}, the running workload is "
                                     f"{msgspec.to_builtins(workload)} (another dataset)")
        epochs = int(recs.loader.extra.get("epochs", 1))
        bk = cls(workload, Loader(workload, epoch=recs.loader.epoch, consumed=recs.loader.consumed, epochs=epochs))
        bk.train_steps = int(recs.loader.extra.get("train_steps", 0))
        bk.finalized_order = list(recs.loader.extra.get("finalized_order", []))
        for rec in recs.ledger:
            if isinstance(rec, PromptGroup):
                bk.groups[rec.group_id] = Group(rec.group_id, rec.prompt_index, rec.state, list(rec.rollout_ids))
            elif isinstance(rec, RolloutAttempt):
                a = Attempt(rec.rollout_id, rec.group_id, rec.attempt_index, rec.state)
                if rec.state == "abandoned":
                    bk.abandoned.append(a)
                elif rec.rollout_id in bk.attempts:
                    raise InvalidRecordError(f"{where}: rollout {rec.rollout_id!r} has two current runs")
                else:
                    bk.attempts[rec.rollout_id] = a
            else:
                bk.acks_owed[rec.rollout_id] = rec
        for e in recs.replay:
            bk.replay[e.key] = e
        for g in bk.groups.values():
            missing = [r for r in g.rollout_ids if r not in bk.attempts]
            if missing:
                raise InvalidRecordError(f"{where}: group {g.group_id!r} names rollouts without a run: {missing[:5]}")
        return bk
