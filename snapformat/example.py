"""A realistic example snapshot: what each participant of a run writes, with seeded content.

Used by ``make demo``, the golden examples in ``spec/examples/``, the tests and the benchmarks,
so they all exercise the same shape of data as a real run: an agent server's continuations and
state, a policy model server's ledger, token-capture rows and token-storage index, a resource
server's sessions, TQ's training rows and the controller's bookkeeping.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from schemas.controller import AckOwed, LoaderPlace, PromptGroup, ReplayIndexEntry, RolloutAttempt
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.identity import capture_key
from schemas.manifest import GymCommit, ParticipantCommit
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.token_entry import token_digest
from schemas.topology import topology_fingerprint
from snapformat.draft import PartReceipt, SnapshotDraft
from snapformat.layout import gym_part_prefix

AGENT, MODEL, RESOURCE = "agent0", "policy0", "tools"
GROUP_SIZE = 4

#: The participants' contracts of the example topology (as their capabilities would report).
CONTRACTS = [
    {"component": "agent", "name": AGENT, "schema_version": 1, "checkpoint_mode": "export_restore"},
    {"component": "model", "name": MODEL, "schema_version": 1, "checkpoint_mode": "export_restore"},
    {"component": "resource", "name": RESOURCE, "schema_version": 1, "checkpoint_mode": "export_restore"},
]
TOPOLOGY = topology_fingerprint(CONTRACTS)


class Rollout:
    """One example rollout: its id, run number, and the model calls of its finished turns."""

    def __init__(self, rng: random.Random, index: int, attempt: int) -> None:
        self.rollout_id = f"p{index // GROUP_SIZE}_g{index % GROUP_SIZE}"
        self.group_id = f"p{index // GROUP_SIZE}"
        self.attempt = attempt
        self.key = capture_key(self.rollout_id, attempt)
        self.turns = rng.randint(1, 4)
        self.finished = rng.random() < 0.25
        self.calls = [f"call-{t}" for t in range(self.turns)]


def rollouts(count: int, seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    return [Rollout(rng, i, attempt=1 if rng.random() < 0.1 else 0) for i in range(count)]


def token_batches(rs: list[Rollout], seed: int, prompt_len: int = 64, gen_len: int = 32,
                  batch_rows: int = 4096) -> Iterator[tuple[pa.RecordBatch, list[tuple[Rollout, str, int]]]]:
    """Token-capture rows, one per model call, in batches; also yields where each call landed.

    Lineage is stamped as Gym stamps it: a rollout's first call is a root with its full prompt,
    each later call a resolved child of the previous one whose prompt is a delta (only the tokens
    after its parent's); ``cum_len`` and ``digest`` describe the whole cumulative sequence.
    """
    rng = np.random.default_rng(seed)
    calls = [(r, c) for r in rs for c in r.calls]
    cumulative: dict[str, np.ndarray] = {}  # capture key -> tokens so far (dropped after its last call)
    for start in range(0, len(calls), batch_rows):
        chunk = calls[start:start + batch_rows]
        n = len(chunk)
        p_off = np.arange(n + 1, dtype=np.int32) * prompt_len
        g_off = np.arange(n + 1, dtype=np.int32) * gen_len
        prompt_ids = rng.integers(0, 150_000, n * prompt_len, dtype=np.int64)
        gen_ids = rng.integers(0, 150_000, n * gen_len, dtype=np.int64)
        prompt = pa.ListArray.from_arrays(pa.array(p_off), pa.array(prompt_ids))
        gen = pa.ListArray.from_arrays(pa.array(g_off), pa.array(gen_ids))
        lps = pa.ListArray.from_arrays(pa.array(g_off), pa.array(-rng.random(n * gen_len)))
        parent = [None if c == "call-0" else f"call-{int(c.split('-')[1]) - 1}" for _, c in chunk]
        cum_len, digest = [], []
        for i, (r, c) in enumerate(chunk):
            seq = np.concatenate([cumulative.pop(r.key, np.empty(0, np.int64)),
                                  prompt_ids[i * prompt_len:(i + 1) * prompt_len], gen_ids[i * gen_len:(i + 1) * gen_len]])
            if c != r.calls[-1]:
                cumulative[r.key] = seq
            cum_len.append(len(seq))
            digest.append(token_digest(seq))
        cols = {
            "schema_version": pa.array([1] * n, pa.int32()),
            "rollout_id": pa.array([r.rollout_id for r, _ in chunk]),
            "attempt_index": pa.array([r.attempt for r, _ in chunk], pa.int32()),
            "capture_key": pa.array([r.key for r, _ in chunk]),
            "model_call_id": pa.array([c for _, c in chunk]),
            "model": pa.array(["policy"] * n),
            "prompt_token_ids": prompt,
            "generation_token_ids": gen,
            "generation_log_probs": lps,
            "routed_experts": pa.nulls(n, pa.string()),
            "output_items": pa.array(['[{"type":"message"}]'] * n),
            "token_item_index": pa.array([0] * n, pa.int64()),
            "response_id": pa.array([f"resp-{r.key}-{c}" for r, c in chunk]),
            "created_at": pa.array([1_796_000_000.0 + start + i for i in range(n)], pa.float64()),
            "parent_call_id": pa.array(parent, pa.string()),
            "cum_len": pa.array(cum_len, pa.int64()),
            "digest": pa.array(digest),
            "parent_resolution": pa.array(["root" if p is None else "resolved" for p in parent]),
            "continuation_fingerprint": pa.array([""] * n),
            "continuation_context_len": pa.array([0] * n, pa.int64()),
            "continuation_context_digest": pa.array([""] * n),
            "parent_resolution_reason": pa.array([""] * n),
            "fingerprint_version": pa.nulls(n, pa.int64()),
            "prompt_is_delta": pa.array([p is not None for p in parent]),
            "prefix_requested": pa.array([False] * n),
            "prefix_supplied": pa.array([False] * n),
            "extra_fields": pa.nulls(n, pa.string()),
        }
        batch = pa.RecordBatch.from_arrays(list(cols.values()), schema=TOKEN_CAPTURE_SCHEMA)
        yield batch, [(r, c, i) for i, (r, c) in enumerate(chunk)]


def training_batch(rs: list[Rollout], seed: int, seq_len: int = 96) -> pa.RecordBatch:
    """Training rows for the finished rollouts (one sample each)."""
    done = [r for r in rs if r.finished]
    rng = np.random.default_rng(seed)
    n = len(done)
    off = pa.array(np.arange(n + 1, dtype=np.int32) * seq_len)

    def floats() -> pa.Array:
        return pa.ListArray.from_arrays(off, pa.array(rng.standard_normal(n * seq_len, dtype=np.float32)))

    cols = [
        pa.array([f"{r.key}/sample" for r in done]),
        pa.array(["train"] * n),
        pa.array([r.rollout_id for r in done]),
        pa.array([r.attempt for r in done], pa.int32()),
        pa.ListArray.from_arrays(off, pa.array(rng.integers(0, 150_000, n * seq_len, dtype=np.int32))),
        pa.array([seq_len] * n, pa.int32()),
        floats(), floats(), floats(), floats(),
        pa.ListArray.from_arrays(off, pa.array(rng.integers(0, 2, n * seq_len, dtype=np.int8))),
        pa.array([1.0] * n, pa.float32()),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=TRAINING_SCHEMA)


def write_example(draft: SnapshotDraft, count: int = 200, seed: int = 0) -> tuple[GymCommit, list[PartReceipt]]:
    """Write every part of an example snapshot with ``count`` rollouts into ``draft``.

    Returns Gym's commit result and the receipts; pass both to ``draft.publish``.
    """
    rs = rollouts(count, seed)
    parked = [r for r in rs if not r.finished]

    agent = draft.part(gym_part_prefix("agent", AGENT), writer=f"agent:{AGENT}")
    agent.write_records("continuations", "continuations", (
        AgentContinuationRoot(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key,
                              last_committed_model_call_id=r.calls[-1], resource_state_revisions={RESOURCE: r.turns})
        for r in parked))
    agent.write_records("agent_state", "agent_state", (
        AgentStateRecord(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key,
                         status="finished_unacked" if r.finished else "parked", turn_index=r.turns,
                         state={"messages": r.turns * 2}, restart_only=["sandbox"] if r.turns == 4 else [])
        for r in rs))

    model = draft.part(gym_part_prefix("model", MODEL), writer=f"model:{MODEL}")
    index: list[TokenIndexEntry] = []
    tokens_path = f"{gym_part_prefix('model', MODEL)}/tokens.arrow"
    with model.rows("tokens.arrow", "token_capture_rows") as w:
        for b, (batch, placed) in enumerate(token_batches(rs, seed)):
            w.write(batch)
            index.extend(TokenIndexEntry(capture_key=r.key, model_call_id=c, file=tokens_path, batch=b,
                                         row_start=i, row_count=1) for r, c, i in placed)
    model.write_records("ledger", "model_ledger", (
        ModelLedgerEntry(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key, model_call_id=c,
                         parent_call_id=None if t == 0 else r.calls[t - 1], turn_index=t, model="policy",
                         created_at=1_796_000_000.0 + t)
        for r in rs for t, c in enumerate(r.calls)))
    model.write_records("token_index", "token_index", index)

    res = draft.part(gym_part_prefix("resource", RESOURCE), writer=f"resource:{RESOURCE}")
    res.write_records("sessions", "session_state", (
        SessionStateRecord(session_id=f"s-{r.key}", resource=RESOURCE, state_revision=r.turns, rollout_id=r.rollout_id,
                           state={"files": {"notes.txt": f"turn {r.turns}"}})
        for r in parked))

    tq = draft.part("tq", writer="tq")
    tq.write_rows("training.arrow", "training_rows", training_batch(rs, seed))

    ctl = draft.part("controller", writer="controller")
    groups = sorted({r.group_id for r in rs})
    ctl.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=len(groups), seed=seed, dataset_size=10 * len(groups)))
    ctl.write_records("replay_index", "replay_index", (
        ReplayIndexEntry(key=f"{r.key}/sample", partition_id="train", rollout_id=r.rollout_id, attempt_index=r.attempt,
                         group_id=r.group_id, status="ready") for r in rs if r.finished))
    ledger: list = [PromptGroup(group_id=g, prompt_index=int(g[1:]), state="generating",
                                rollout_ids=[r.rollout_id for r in rs if r.group_id == g]) for g in groups]
    ledger += [RolloutAttempt(rollout_id=r.rollout_id, group_id=r.group_id, attempt_index=r.attempt,
                              state="sealed" if r.finished else "dispatched") for r in rs]
    ledger += [AckOwed(rollout_id=r.rollout_id, attempt_index=r.attempt, result_key=f"{r.key}/sample") for r in rs if r.finished]
    ctl.write_records("recovery_ledger", "recovery_ledger", ledger)

    receipts = {p.prefix: p.close() for p in (agent, model, res)}
    gym = GymCommit(checkpoint_id=f"ckpt-{draft.sequence}", participants=[
        ParticipantCommit(component=c["component"], name=c["name"], part_prefix=gym_part_prefix(c["component"], c["name"]),
                          part_manifest_checksum=receipts[gym_part_prefix(c["component"], c["name"])].part_manifest_checksum,
                          payload={"rollouts": len(parked)})
        for c in CONTRACTS])
    return gym, [tq.close(), ctl.close()]
