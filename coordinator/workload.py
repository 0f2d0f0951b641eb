"""The prompt dataset the Single Controller draws rollouts from, and the loader's order over it.

A prompt ``i`` is one *prompt group* ``p<i>`` of ``group_size`` rollouts ``p<i>_g<j>``; what each
rollout is (its seed, number of turns, tools) is a pure function of the workload's seed and
``(i, j)``, so a restored run and an uninterrupted one send Gym exactly the same rollouts. The
loader hands prompts out in a per-epoch order derived from the seed; its place is the
:class:`~schemas.controller.LoaderPlace` a snapshot keeps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec


class RolloutSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout as Gym is asked to run it (the agent server's ``POST /rollouts`` body)."""

    rollout_id: str
    group_id: str
    seed: int
    turns: int
    tools: tuple[str, ...]


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """``prompts`` prompt groups of ``group_size`` rollouts, each of ``min_turns..max_turns`` turns.

    Every ``sandbox_every``-th prompt (0: none) also uses the restart-only ``sandbox`` tool, so a
    restore has continuations to discard.
    """

    prompts: int = 50
    group_size: int = 4
    min_turns: int = 2
    max_turns: int = 5
    seed: int = 1234
    sandbox_every: int = 5

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.group_size < 1 or not 1 <= self.min_turns <= self.max_turns <= 64:
            raise ValueError(f"workload: bad sizes {self}")

    @property
    def rollouts(self) -> int:
        return self.prompts * self.group_size

    def order(self, epoch: int) -> list[int]:
        """The loader's order of prompt indexes in ``epoch`` (a seeded permutation)."""
        return sorted(range(self.prompts), key=lambda i: _h(self.seed, "order", epoch, i))

    def group(self, prompt_index: int) -> list[RolloutSpec]:
        """The rollouts of prompt ``prompt_index``."""
        if not 0 <= prompt_index < self.prompts:
            raise IndexError(f"prompt {prompt_index} is not in a dataset of {self.prompts}")
        tools = ("notes", "sandbox") if self.sandbox_every and prompt_index % self.sandbox_every == 0 else ("notes",)
        span = self.max_turns - self.min_turns + 1
        out = []
        for j in range(self.group_size):
            h = _h(self.seed, "rollout", prompt_index, j)
            out.append(RolloutSpec(rollout_id=f"p{prompt_index}_g{j}", group_id=f"p{prompt_index}",
                                   seed=h % 1_000_000, turns=self.min_turns + (h >> 20) % span, tools=tools))
        return out


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


@dataclass
class Loader:
    """The loader's place in the workload: the next prompt is ``order(epoch)[consumed]``.

    ``consumed`` moves only when a group has been dispatched (see :meth:`advance`), never when a
    prompt is merely read, so the place a snapshot keeps never runs ahead of the recovery ledger.
    """

    workload: Workload
    epoch: int = 0
    consumed: int = 0
    epochs: int = 1

    def __post_init__(self) -> None:
        self._order = self.workload.order(self.epoch)

    def peek(self) -> int | None:
        """The next prompt index, or None when every epoch is handed out."""
        if self.epoch >= self.epochs:
            return None
        return self._order[self.consumed]

    def advance(self) -> None:
        self.consumed += 1
        if self.consumed == self.workload.prompts:
            self.epoch, self.consumed = self.epoch + 1, 0
            self._order = self.workload.order(self.epoch)
