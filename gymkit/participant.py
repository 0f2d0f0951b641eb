"""What a Gym server implements to take part in snapshots: its own export and import, nothing else."""

from __future__ import annotations

import abc
from typing import Any

import msgspec

from schemas.control import Admission, Capabilities, RolloutRef
from schemas.manifest import PartReceipt
from snapformat.draft import PartWriter
from snapformat.layout import gym_part_prefix
from snapformat.reader import Snapshot

#: The part prefix of a Gym server (``gym/<component>/<name>``), defined once in snapformat.layout.
part_prefix = gym_part_prefix


class CommitContext(msgspec.Struct, frozen=True, kw_only=True):
    """What the kit hands :meth:`Participant.commit` besides the part writer.

    ``continuations`` (a model's commit only; empty otherwise) are the receipts of every agent's
    part of this checkpoint: read their records with :func:`snapformat.read_part_records`
    (``draft_url``, receipt, kind), never through the draft's folder directly. ``deadline`` is the
    commit's absolute deadline (unix seconds); the kit already cuts the commit short at it.
    """

    checkpoint_id: str
    deadline: float
    draft_url: str
    part_prefix: str  # this server's own prefix, which ``part`` writes under
    continuations: tuple[PartReceipt, ...] = ()


class Participant(abc.ABC):
    """A Gym server's side of the protocol. The kit calls these one at a time, in phase order.

    ``prepare`` returns once the server is quiet (model: 0 calls in flight and new calls refused;
    agent: every rollout parked at a turn end; resource: sessions frozen); the kit bounds it by
    the call's deadline. ``resume`` undoes prepare (it is also the abort). ``commit`` writes the
    server's state through ``part`` (None for a stateless server), given a :class:`CommitContext`,
    and returns a small payload for the manifest; ``restore`` loads it back and leaves the server
    paused until ``resume``.

    **Admission.** Whether the server may admit new work on its plain routes (model calls, tool
    calls, rollouts, turns) is the kit's to say, from its phase: it calls :meth:`admission_changed`
    whenever that changes (``draining`` before ``prepare`` runs, ``paused`` while a checkpoint
    holds the server, ``accepting`` again once it is back in ``idle``, after ``resume``). A server
    asks :meth:`admits_work` before it admits a call, and refuses it otherwise (the reference
    servers answer 503 with ``retry-after``). A participant no kit drives admits work.
    """

    _admission: Admission = "accepting"

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    async def prepare(self, deadline: float) -> None: ...

    def in_flight(self) -> int:
        """Calls (or turns) still running; the status route reports it."""
        return 0

    def admission_changed(self, admission: Admission) -> None:
        """Called by the kit, on its event loop, each time the server's admission changes. A server
        that must react (wake waiters, say) overrides it and calls this one too."""
        self._admission = admission

    @property
    def admission(self) -> Admission:
        """``accepting``, ``draining`` or ``paused``: the last value the kit gave."""
        return self._admission

    def admits_work(self) -> bool:
        """True while new work may be admitted (no checkpoint holds the server)."""
        return self._admission == "accepting"

    @abc.abstractmethod
    async def commit(self, part: PartWriter | None, context: CommitContext) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def restore(self, snapshot: Snapshot, prefix: str) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    async def reset(self) -> None:
        """After a failed or aborted restore: drop whatever was loaded and start empty.

        The default resumes, which is right only for a server that loads nothing it keeps (or whose
        restore changes nothing until it succeeds and which is never aborted after that).
        """
        await self.resume()

    async def acknowledge(self, results: list[RolloutRef]) -> dict[str, Any]:
        """Agents: forget finished results the controller has stored (others: refuse)."""
        raise NotImplementedError

    def unknown_rollouts(self, results: list[RolloutRef]) -> list[RolloutRef]:
        """Which of ``results`` this server does not know (checked before anything changes)."""
        return []

    async def discard(self, rollouts: list[RolloutRef]) -> dict[str, Any]:
        """Agents: drop restored continuations so those rollouts start over."""
        raise NotImplementedError
