"""Finished Gym results as the rows the controller puts into the data plane.

An agent server lists a finished rollout (``GET /results``) with its whole conversation
(``input_ids``), the prompt length each model call saw, and per turn the generated tokens, their
log probs and the capture key of the run that made the call. From that the controller builds:

- one *training row* per rollout in partition :data:`TRAIN_PARTITION` (key = rollout id):
  ``input_ids``, ``input_lengths``, ``generation_logprobs`` and ``token_mask`` aligned with
  ``input_ids`` (log prob and 1 on generated tokens, 0 elsewhere), ``sample_mask``;
- one *token-capture row* per model call in partition :data:`TOKEN_PARTITION` (key =
  ``<rollout id>/<model call id>``): the call's prompt and generation, as Gym's ``TokenEntry``.

Tags carry what the row schemas require that is not a tensor (rollout id, run, capture key).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from coordinator.dataplane import DataPlane, Ragged
from schemas.control import CompletionReceipt
from schemas.identity import capture_key

TRAIN_PARTITION = "train"
TOKEN_PARTITION = "token_capture"


class TurnResult(msgspec.Struct, frozen=True):
    model_call_id: str
    generation_token_ids: list[int]
    generation_log_probs: list[float]


class RolloutResult(msgspec.Struct, frozen=True):
    """What the controller reads of one agent result (unknown fields are ignored)."""

    rollout_id: str
    attempt_index: int
    capture_key: str
    outcome: Literal["running", "finished", "failed"]
    error: str | None = None
    trajectory: list[TurnResult] = []
    turn_keys: list[str] = []
    input_ids: list[int] = []
    prompt_lens: list[int] = []
    completion_receipt: CompletionReceipt | None = None  # the agent's receipt, sent back to acknowledge
    agent_name: str = ""  # the agent that holds it (its participant name)

    def check(self) -> None:
        """Refuse a result whose parts do not line up (a Gym bug must not become training data)."""
        n = len(self.trajectory)
        if len(self.turn_keys) != n or len(self.prompt_lens) != n:
            raise ValueError(f"result {self.rollout_id}: {n} turns but {len(self.turn_keys)} capture keys and "
                             f"{len(self.prompt_lens)} prompt lengths")
        for t, plen in zip(self.trajectory, self.prompt_lens):
            end = plen + len(t.generation_token_ids)
            if end > len(self.input_ids) or self.input_ids[plen:end] != t.generation_token_ids:
                raise ValueError(f"result {self.rollout_id}: {t.model_call_id} is not at {plen} of input_ids")
            if len(t.generation_log_probs) != len(t.generation_token_ids):
                raise ValueError(f"result {self.rollout_id}: {t.model_call_id} log probs do not match its tokens")


def _attempt_of(rollout_id: str, key: str) -> int:
    if key == rollout_id:
        return 0
    n = int(key.rsplit("-a", 1)[1])
    if capture_key(rollout_id, n) != key:
        raise ValueError(f"capture key {key!r} is not one of rollout {rollout_id!r}")
    return n


def put_results(plane: DataPlane, results: Sequence[RolloutResult], group_of: dict[str, str]) -> list[str]:
    """Put the training and token-capture rows of finished ``results``; returns their training keys."""
    if not results:
        return []
    train_tags, ids, lps, masks = [], [], [], []
    tok_keys, tok_tags, prompts, gens, glps, cum = [], [], [], [], [], []
    for r in results:
        r.check()
        ids_arr = np.asarray(r.input_ids, dtype=np.int32)
        lp = np.zeros(len(ids_arr), dtype=np.float32)
        mask = np.zeros(len(ids_arr), dtype=np.int8)
        for t, plen, key in zip(r.trajectory, r.prompt_lens, r.turn_keys):
            end = plen + len(t.generation_token_ids)
            lp[plen:end] = t.generation_log_probs
            mask[plen:end] = 1
            tok_keys.append(f"{r.rollout_id}/{t.model_call_id}")
            tok_tags.append({"schema_version": 1, "rollout_id": r.rollout_id,
                             "attempt_index": _attempt_of(r.rollout_id, key), "capture_key": key,
                             "model_call_id": t.model_call_id})
            prompts.append(ids_arr[:plen])
            gens.append(np.asarray(t.generation_token_ids, dtype=np.int32))
            glps.append(np.asarray(t.generation_log_probs, dtype=np.float32))
            cum.append(end)
        train_tags.append({"rollout_id": r.rollout_id, "attempt_index": r.attempt_index,
                           "group_id": group_of[r.rollout_id]})
        ids.append(ids_arr)
        lps.append(lp)
        masks.append(mask)
    keys = [r.rollout_id for r in results]
    n = len(keys)
    plane.put(TRAIN_PARTITION, keys, {
        "input_ids": Ragged(ids), "input_lengths": np.array([len(x) for x in ids], dtype=np.int32),
        "generation_logprobs": Ragged(lps), "token_mask": Ragged(masks),
        "sample_mask": np.ones(n, dtype=np.float32)}, train_tags)
    if tok_keys:
        plane.put(TOKEN_PARTITION, tok_keys, {
            "prompt_token_ids": Ragged(prompts), "generation_token_ids": Ragged(gens),
            "generation_log_probs": Ragged(glps), "cum_len": np.array(cum, dtype=np.int64)}, tok_tags)
    return keys


def decode_results(raw: Any) -> list[RolloutResult]:
    return msgspec.convert(raw, list[RolloutResult])
