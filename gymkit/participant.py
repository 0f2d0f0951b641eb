"""What a Gym server implements to take part in snapshots: its own export and import, nothing else."""

from __future__ import annotations

import abc
from typing import Any

from schemas.control import Capabilities, RolloutRef
from snapformat.draft import PartWriter
from snapformat.reader import Snapshot


class Participant(abc.ABC):
    """A Gym server's side of the protocol. The kit calls these one at a time, in phase order.

    ``prepare`` returns once the server is quiet (model: 0 calls in flight and new calls refused;
    agent: every rollout parked at a turn end; resource: sessions frozen); the kit bounds it by
    the call's deadline. ``resume`` undoes prepare (it is also the abort). ``commit`` writes the
    server's state through ``part`` (None for a stateless server) and returns a small payload for
    the manifest; ``restore`` loads it back and leaves the server paused until ``resume``.
    """

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    async def prepare(self, deadline: float) -> None: ...

    def in_flight(self) -> int:
        """Calls (or turns) still running; the status route reports it."""
        return 0

    @abc.abstractmethod
    async def commit(self, part: PartWriter | None, context: dict[str, Any]) -> dict[str, Any]: ...

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
