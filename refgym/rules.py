"""The deterministic rules of the reference Gym: model output, tools, and a rollout's tokens.

Every function here is pure. That is what lets an interrupted-and-restored run be compared with an
uninterrupted one token for token: a model call's output depends only on (model seed, prompt token
ids), a tool's result only on (session state, call), and so a rollout's trajectory only on its
rollout id, its seed and the model seed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

VOCAB = 32_000
MAX_PROMPT_TOKENS = 100_000
TOOL_KINDS = ("notes", "sandbox")  # notes: exportable state; sandbox: restart-only
RESTART_ONLY_KINDS = ("sandbox",)
_MOD = 1_000_003
_TOOL_MARK = {"notes": VOCAB - 2, "sandbox": VOCAB - 1}  # token that opens a tool result


def _rng(*parts: bytes) -> np.random.Generator:
    """A generator seeded from the SHA-256 of ``parts`` (stable across processes and runs)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return np.random.default_rng(int.from_bytes(h.digest()[:16], "little"))


def tokens_bytes(tokens: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes: the canonical form hashed by digests and seeds."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def initial_prompt(rollout_id: str, seed: int) -> list[int]:
    """The prompt a rollout starts from (its 'task'), 8 to 15 tokens."""
    rng = _rng(b"prompt", rollout_id.encode(), int(seed).to_bytes(8, "little", signed=True))
    n = int(rng.integers(8, 16))
    return [int(t) for t in rng.integers(0, VOCAB - 2, n)]


def generate(model_seed: int, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The model: 3 to 6 generated tokens and their log probs, a function of seed and prompt only.

    Log probs are float32 values (as vLLM reports them) returned as Python floats, which JSON and
    Arrow float32 carry exactly, so a trajectory compares equal after any round trip.
    """
    rng = _rng(b"model", int(model_seed).to_bytes(8, "little", signed=True), tokens_bytes(prompt))
    n = int(rng.integers(3, 7))
    tokens = [int(t) for t in rng.integers(0, VOCAB - 2, n)]
    log_probs = np.log(rng.uniform(0.05, 1.0, n)).astype(np.float32)
    return tokens, [float(x) for x in log_probs]


def tool_args(kind: str, generation: list[int]) -> dict[str, int]:
    """What the model 'asked' the tool to do, read off its generated tokens."""
    if kind == "notes":
        return {"value": sum(generation) % 1000}
    if kind == "sandbox":
        return {"code": generation[-1] % 997}
    raise ValueError(f"unknown tool kind {kind!r} (expected one of {TOOL_KINDS})")


def empty_state(kind: str) -> dict[str, Any]:
    return {"values": []} if kind == "notes" else {"acc": 0}


def apply_tool(kind: str, state: dict[str, Any], args: dict[str, int]) -> tuple[dict[str, Any], dict[str, int]]:
    """One tool call: the session's new state and the result, from (state, call) only."""
    if kind == "notes":
        values = [*state["values"], int(args["value"])]
        return {"values": values}, {"count": len(values), "total": sum(values) % _MOD}
    if kind == "sandbox":
        acc = (int(state["acc"]) * 31 + int(args["code"])) % _MOD
        return {"acc": acc}, {"acc": acc}
    raise ValueError(f"unknown tool kind {kind!r} (expected one of {TOOL_KINDS})")


def tool_tokens(kind: str, result: dict[str, int]) -> list[int]:
    """How a tool result enters the conversation: a marker token, then its values as tokens."""
    return [_TOOL_MARK[kind]] + [int(v) % (VOCAB - 2) for _, v in sorted(result.items())]
