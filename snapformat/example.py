"""A realistic example snapshot of format 1.3: what each participant of a run writes, seeded.

Used by ``make format-demo``, the golden examples in ``spec/examples/``, the tests and the
benchmarks, so they all exercise the same shape of data as a real run:

* **Gym's files** (SPEC §12.11, CONTROL.md §6), written into ``checkpoint_dir`` as Gym's servers
  write them and adopted as parts (:func:`snapformat.adopt.adopt_part`), as the publisher of a
  real save does (CONTROL.md §9): the agent ``agent0``'s folder ``agent/instance-<sha256>/``
  (an archive of boundary records, ``agent-index.jsonl``, ``continuations.jsonl``,
  ``manifest.json``), the policy model ``policy0``'s ledger ``model-ledger/policy0/`` (one
  ``<capture_key>.lineage.jsonl`` per rooted capture key, rows ``{"entry", "token"}``: the ledger
  entry and Gym's TokenEntry; ``storage-references.jsonl``; ``manifest.json``) and the resources
  server ``tools``'s sessions ``resources/tools/``;
* the data plane's (TQ's) training rows and token-capture rows, and the Single Controller's
  loader place, replay index and recovery ledger.

:func:`write_example` writes every file into the snapshot folder (one row file per kind: a writer
with incremental saves turned off); :func:`write_incremental_example` writes the data plane's rows
as segments, shared objects the next snapshot lists again without writing them (SPEC §12.12,
§14.2), which is what the golden store ``spec/examples/store-v1.3`` holds.

Gym's files are written here from ``schemas.gym_files``, not with ``gymkit.checkpoint_dir``
(snapformat sits below gymkit), but their bytes come from the same builders gymkit's writers use
(``snapformat.gym_dir``: compact JSON lines; manifests with sorted keys; record files with indent
2; tar headers fixed). ``tests/spec/test_golden.py`` checks that gymkit reads these files back and
writes the same bytes from the same records.

Every byte is a pure function of ``count``, ``seed`` and the draft's sequence (the checkpoint id
is ``ckpt-<sequence>``); only the part manifests and the snapshot manifest carry times and ids.

:func:`write_legacy_example` writes what the format 1.0 and 1.1 example writer wrote (Gym parts
of this project's own kinds, ``gym/<component>/<name>/``), for tests of readers of those kinds.
"""

from __future__ import annotations

import base64
import json
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from schemas.control import (
    FEATURE_COMPLETED_RESULT_ACK,
    FEATURE_CONTINUATION_INDEX,
    FEATURE_RESOURCE_DEPENDENCY_INDEX,
    FEATURE_STORAGE_REFERENCE_INDEX,
    AgentCommitResponse,
    Capabilities,
    ModelCommitResponse,
    MultiProcess,
    ResourcesCommitResponse,
)
from schemas.controller import AckOwed, LoaderPlace, PromptGroup, ReplayIndexEntry, RolloutAttempt
from schemas.errors import InvalidRecordError
from schemas.gym_files import (
    AGENT_ARCHIVE_MAX_BYTES,
    AGENT_ARCHIVE_MAX_MEMBERS,
    AGENT_INDEX_NAME,
    CONTINUATIONS_NAME,
    STORAGE_REFERENCES_NAME,
    AgentArchive,
    AgentBoundaryRecord,
    AgentIndexEntry,
    AgentManifest,
    AttemptEntry,
    ExternalStorageReference,
    LedgerManifest,
    LedgerRollout,
    MutationReceipt,
    ResourcesManifest,
    ResourceSnapshot,
    agent_archive_name,
    agent_instance_dir,
    attempt_member,
    ledger_dir,
    participant_dir,
    resources_dir,
)
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.identity import capture_key
from schemas.manifest import FileEntry, GymCommit, ParticipantCommit, PartReceipt
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.token_entry import token_digest
from schemas.topology import manifest_fingerprint, topology_fingerprint
from snapformat import layout
from snapformat.adopt import adopt_part
from snapformat.draft import SnapshotDraft
from snapformat.gym_dir import (
    DurableFiles,
    continuation_roots,
    continuation_roots_sha256,
    document_bytes,
    jsonl_bytes,
    sha256_hex,
    write_jsonl,
    write_manifest,
)
from snapformat.reader import Snapshot, open_sequence
from snapformat.tar_archive import tar_bytes
from snapformat.token_rows import batch_entries

AGENT, MODEL, RESOURCE = "agent0", "policy0", "tools"
GROUP_SIZE = 4
#: When the example's model calls, boundaries and sessions happened (Unix seconds).
EPOCH = 1_796_000_000.0

#: The example topology: each Gym server's capabilities, as it would declare them (CONTROL.md §5),
#: in Gym's commit order (agents, then models, then resources).
CAPABILITIES: list[Capabilities] = [
    Capabilities(component="responses_api_agents", name=AGENT, checkpoint_mode="export_restore",
                 concurrency_contract="serialized_per_session", multi_process=MultiProcess(mode="single_worker"),
                 features=[FEATURE_COMPLETED_RESULT_ACK, FEATURE_CONTINUATION_INDEX,
                           FEATURE_RESOURCE_DEPENDENCY_INDEX]),
    Capabilities(component="responses_api_models", name=MODEL, admission_states=["accepting", "draining", "paused"],
                 checkpoint_mode="export_restore", concurrency_contract="transactional_parallel",
                 multi_process=MultiProcess(mode="single_worker"), instance_role="policy",
                 features=[FEATURE_STORAGE_REFERENCE_INDEX]),
    Capabilities(component="resources_servers", name=RESOURCE, checkpoint_mode="export_restore",
                 concurrency_contract="serialized_per_session", multi_process=MultiProcess(mode="single_worker")),
]
#: Their participant contracts (NeMo-RL's shape, :meth:`Capabilities.contract`).
CONTRACTS: list[dict[str, Any]] = [c.contract() for c in CAPABILITIES]
#: The example topology's fingerprint as a manifest keeps it: ``sha256:`` + NeMo-RL's hex (SPEC §6).
TOPOLOGY = manifest_fingerprint(topology_fingerprint(CONTRACTS))



def gym_prefix(component: str, name: str) -> str:
    """Its part prefix in a snapshot: ``gym/<its folder>`` (SPEC §3)."""
    return f"{layout.GYM_PREFIX}/{participant_dir(component, name)}"


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


def rollouts(count: int, seed: int, first: int = 0) -> list[Rollout]:
    """``count`` rollouts drawn from ``seed``, numbered from ``first`` (their ids, ``p<group>_g<i>``,
    follow the number; the draws do not depend on it)."""
    rng = random.Random(seed)
    return [Rollout(rng, first + i, attempt=1 if rng.random() < 0.1 else 0) for i in range(count)]


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
            "created_at": pa.array([EPOCH + start + i for i in range(n)], pa.float64()),
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


# -- Gym's files, as Gym's servers write them (CONTROL.md §6.2) ------------------------------------------
class LineageRow(msgspec.Struct, frozen=True, kw_only=True):
    """One row of a ``<capture_key>.lineage.jsonl``: a committed model call, as the reference model
    server records it (its ledger entry and Gym's TokenEntry JSON)."""

    entry: ModelLedgerEntry
    token: dict[str, Any]


def boundary_records(rs: list[Rollout]) -> list[AgentBoundaryRecord]:
    """The agent's parked executions, each at the end of its last finished turn (finished rollouts
    were acknowledged before the save, so the agent holds none of them)."""
    return [AgentBoundaryRecord(
        rollout_id=r.rollout_id, attempt_index=r.attempt, boundary_index=r.turns, turn_index=r.turns,
        output_items=[{"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": f"turn {r.turns}"}]}],
        usage={"input_tokens": 64 * r.turns, "output_tokens": 32 * r.turns},
        last_committed_model_call_id=r.calls[-1], resource_state_revisions={RESOURCE: r.turns},
        agent_state={"messages": 2 * r.turns}, created_at=EPOCH + r.turns)
        for r in rs if not r.finished]


def write_agent_folder(checkpoint_dir: Path, checkpoint_id: str, records: list[AgentBoundaryRecord]
                       ) -> AgentCommitResponse:
    """``agent/instance-<sha256(AGENT)>/``: archives of ``<rid>.a<n>.json`` members (at most 512
    members and 64 MiB each), ``agent-index.jsonl``, ``continuations.jsonl``, ``manifest.json``."""
    base = agent_instance_dir(AGENT)
    folder = checkpoint_dir / base
    shards: list[list[tuple[AgentBoundaryRecord, bytes]]] = [[]]
    for rec in sorted(records, key=lambda r: (r.rollout_id, r.attempt_index)):
        data = document_bytes(rec, sort_keys=False, indent=2)
        shard = shards[-1]
        if shard and (len(shard) >= AGENT_ARCHIVE_MAX_MEMBERS
                      or sum(len(d) for _, d in shard) + len(data) > AGENT_ARCHIVE_MAX_BYTES):
            shards.append(shard := [])
        shard.append((rec, data))
    archives, index = [], []
    with DurableFiles() as out:  # Gym's commit: every file durable, the folder fsynced once, then the manifest
        for i, shard in enumerate(s for s in shards if s):
            name = agent_archive_name(i)
            tar = tar_bytes([(attempt_member(rec.rollout_id, rec.attempt_index), data) for rec, data in shard])
            out.add(folder / name, tar)
            archives.append(AgentArchive(name=name, sha256=sha256_hex(tar), members=len(shard), bytes=len(tar)))
            index += [AgentIndexEntry(rollout_id=rec.rollout_id, attempt_index=rec.attempt_index, archive=name,
                                      member=attempt_member(rec.rollout_id, rec.attempt_index),
                                      sha256=sha256_hex(data), bytes=len(data)) for rec, data in shard]
        record_index = write_jsonl(checkpoint_dir, f"{base}/{AGENT_INDEX_NAME}", index, out)
        continuation_index = write_jsonl(checkpoint_dir, f"{base}/{CONTINUATIONS_NAME}", continuation_roots(records),
                                         out)
    manifest = AgentManifest(checkpoint_id=checkpoint_id, instance_name=AGENT, archives=archives,
                             record_index=record_index, records=len(index), continuation_index=continuation_index)
    return AgentCommitResponse(records=len(index), manifest_digest=write_manifest(folder, manifest),
                               continuation_index=continuation_index)


def write_ledger_folder(checkpoint_dir: Path, checkpoint_id: str, rs: list[Rollout],
                        roots: list[AgentContinuationRoot], tokens: dict[tuple[str, str], dict[str, Any]]
                        ) -> ModelCommitResponse:
    """``model-ledger/<MODEL>/``: for each root, the lineage of its capture key up to its last
    committed call (rows ``{"entry", "token"}``), one storage reference per root, ``manifest.json``.
    The attempts the model saw without a root (the finished rollouts) are ``excluded_inactive``."""
    base = ledger_dir(MODEL)
    folder = checkpoint_dir / base
    by_key = {r.key: r for r in rs}
    rollouts, rows = {}, 0
    with DurableFiles() as out:  # Gym's commit: every file durable, the folder fsynced once, then the manifest
        for root in roots:
            r = by_key[root.capture_key]
            last = r.calls.index(root.last_committed_model_call_id)
            lineage = jsonl_bytes(LineageRow(
                entry=ModelLedgerEntry(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key,
                                       model_call_id=c, parent_call_id=None if t == 0 else r.calls[t - 1],
                                       turn_index=t, model=tokens[(r.key, c)]["model"],
                                       created_at=tokens[(r.key, c)]["created_at"]),
                token=tokens[(r.key, c)]) for t, c in enumerate(r.calls[:last + 1]))
            name = f"{r.key}.lineage.jsonl"
            out.add(folder / name, lineage)
            rollouts[r.key] = LedgerRollout(files={name: sha256_hex(lineage)}, rows=last + 1, bytes=len(lineage))
            rows += last + 1
        references = sorted((ExternalStorageReference(
            capture_key=c.capture_key, boundary_model_call_id=c.last_committed_model_call_id,
            key=f"{c.capture_key}/{c.last_committed_model_call_id}") for c in roots), key=lambda e: e.key)
        storage_index = write_jsonl(checkpoint_dir, f"{base}/{STORAGE_REFERENCES_NAME}", references, out)
    inactive = sum(1 for r in rs if r.finished)
    manifest = LedgerManifest(
        checkpoint_id=checkpoint_id, server_name=MODEL, rollouts=rollouts,
        continuation_roots_sha256=continuation_roots_sha256(roots), continuation_roots=len(roots),
        excluded_inactive=inactive, storage_reference_index=storage_index,
        source_attempts=sorted((AttemptEntry(rollout_id=c.rollout_id, attempt_index=c.attempt_index) for c in roots),
                               key=lambda a: (a.rollout_id, a.attempt_index)))
    return ModelCommitResponse(rollouts=len(rollouts), rows=rows, excluded_tombstoned=0, excluded_inactive=inactive,
                               manifest_digest=write_manifest(folder, manifest),
                               storage_reference_index=storage_index)


def resource_snapshots(rs: list[Rollout]) -> list[ResourceSnapshot]:
    """The resources server's sessions of the parked rollouts, each at the revision its rollout's
    continuation depends on, with the receipt of the mutation that made it."""
    out = []
    for r in rs:
        if r.finished:
            continue
        body = json.dumps({"ok": True, "revision": r.turns}, separators=(",", ":")).encode()
        receipt = MutationReceipt(
            request_id=f"req-{r.key}-{r.turns}", expected_revision=r.turns - 1,
            input_digest=sha256_hex(f'{{"write":"notes.txt","turn":{r.turns}}}'.encode()), status=200,
            headers=[("content-type", "application/json")], body_base64=base64.b64encode(body).decode(),
            resulting_revision=r.turns)
        out.append(ResourceSnapshot(rollout_id=r.rollout_id, attempt_index=r.attempt, state_revision=r.turns,
                                    state={"files": {"notes.txt": f"turn {r.turns}"}}, mutation_receipts=[receipt],
                                    created_at=EPOCH + r.turns))
    return out


def write_resources_folder(checkpoint_dir: Path, checkpoint_id: str, snapshots: list[ResourceSnapshot]
                           ) -> ResourcesCommitResponse:
    """``resources/<RESOURCE>/``: ``<rid>.a<n>.json`` per session (indent 2), then ``manifest.json``."""
    folder = checkpoint_dir / resources_dir(RESOURCE)
    files = {}
    with DurableFiles() as out:  # Gym's commit: every file durable, the folder fsynced once, then the manifest
        for snap in snapshots:
            data = document_bytes(snap, sort_keys=False, indent=2)
            name = attempt_member(snap.rollout_id, snap.attempt_index)
            out.add(folder / name, data)
            files[name] = sha256_hex(data)
    manifest = ResourcesManifest(checkpoint_id=checkpoint_id, server_name=RESOURCE, files=files)
    return ResourcesCommitResponse(sessions=len(files), manifest_digest=write_manifest(folder, manifest))


def write_gym_files(checkpoint_dir: str | Path, checkpoint_id: str, rs: list[Rollout],
                    tokens: dict[tuple[str, str], dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """Every Gym server's commit into ``checkpoint_dir``, in Gym's commit order (agents, then the
    model, given the agents' continuation index, then resources): ``(component, name, reply)``."""
    root = Path(checkpoint_dir)
    records = boundary_records(rs)
    agent = write_agent_folder(root, checkpoint_id, records)
    model = write_ledger_folder(root, checkpoint_id, rs, continuation_roots(records), tokens)
    resources = write_resources_folder(root, checkpoint_id, resource_snapshots(rs))
    return [("responses_api_agents", AGENT, agent), ("responses_api_models", MODEL, model),
            ("resources_servers", RESOURCE, resources)]


def _adopt_gym(draft: SnapshotDraft, checkpoint_dir: Path, checkpoint_id: str, rs: list[Rollout],
               tokens: dict[tuple[str, str], dict[str, Any]]) -> tuple[GymCommit, list[PartReceipt]]:
    commits = write_gym_files(checkpoint_dir, checkpoint_id, rs, tokens)
    participants, receipts = [], []
    for component, name, reply in commits:
        receipt = adopt_part(draft.url, str(checkpoint_dir / participant_dir(component, name)), gym_prefix(component, name),
                             writer=f"{component}:{name}")
        draft.add_part(receipt)  # first in the manifest, in commit order
        receipts.append(receipt)
        participants.append(ParticipantCommit(component=component, name=name, part_prefix=receipt.prefix,
                                              part_manifest_checksum=receipt.part_manifest_checksum,
                                              payload=msgspec.to_builtins(reply)))
    return GymCommit(checkpoint_id=checkpoint_id, participants=participants), receipts


def write_example(draft: SnapshotDraft, count: int = 200, seed: int = 0) -> tuple[GymCommit, list[PartReceipt]]:
    """Write every part of an example snapshot with ``count`` rollouts into ``draft``.

    Gym's servers' files go to the draft's ``gym/`` folder on a local store (adopted in place),
    else to a temporary staging folder that adoption uploads, as a real save does (CONTROL.md §9).
    Returns Gym's commit result and the receipts; pass both to ``draft.publish``.

    Every file lies in the snapshot folder: the data plane's rows are one whole file per kind, what
    a writer with incremental saves turned off writes (:func:`write_incremental_example` is the
    other way).
    """
    rs = rollouts(count, seed)
    batches = list(token_batches(rs, seed))
    gym, receipts = _write_gym(draft, rs, batches)

    tq = draft.part("tq", writer="tq")
    tq.write_rows("training.arrow", "training_rows", training_batch(rs, seed))
    with tq.rows("token_capture.arrow", "token_capture_rows") as w:
        for batch, _ in batches:
            w.write(batch)
    return gym, [*receipts, tq.close(), _write_controller(draft, rs, seed)]


def replay_entries(rs: list[Rollout]) -> list[ReplayIndexEntry]:
    """The replay index of the finished rollouts' training rows (each owed to training)."""
    return [ReplayIndexEntry(key=f"{r.key}/sample", partition_id="train", rollout_id=r.rollout_id, attempt_index=r.attempt,
                             group_id=r.group_id, status="ready") for r in rs if r.finished]


def _write_gym(draft: SnapshotDraft, rs: list[Rollout], batches: list[tuple[pa.RecordBatch, list[tuple[Rollout, str, int]]]]
               ) -> tuple[GymCommit, list[PartReceipt]]:
    """Gym's servers' files for the rollouts ``rs`` (whose token rows are ``batches``), adopted as parts."""
    tokens = {}
    for b, (batch, placed) in enumerate(batches):
        for (r, c, _), entry in zip(placed, batch_entries(batch, f"example tokens: batch {b}"), strict=True):
            tokens[(r.key, c)] = entry
    checkpoint_id = f"ckpt-{draft.sequence}"
    local = draft.store.local_path(layout.file_key(draft.snapshot_id, layout.GYM_PREFIX))
    if local is not None:
        return _adopt_gym(draft, Path(local), checkpoint_id, rs, tokens)
    with tempfile.TemporaryDirectory(prefix="example-gym-") as staging:
        return _adopt_gym(draft, Path(staging), checkpoint_id, rs, tokens)


# -- incremental saves (format 1.3, SPEC §12.12, §14.2) ------------------------------------------------------
#: Most rows in one segment of the data plane's rows (SPEC §12.12).
SEGMENT_ROWS = 8192
#: The data plane's row kinds saved as segments, and the stem of their segments' names
#: (``tq/<stem>-<6 digits>.arrow``: the segment's number, counted on from the parent's).
SEGMENT_STEMS = {"training_rows": "training", "token_capture_rows": "token_capture"}
#: A parent's segment is listed again only while it still holds at least this share of its rows;
#: below it, its surviving rows are written again as a new segment (SPEC §12.12).
MIN_REUSE = 0.25


def _segment_number(path: str, stem: str) -> int | None:
    name = path.rsplit("/", 1)[-1]
    if name.startswith(f"{stem}-") and name.endswith(".arrow") and name[len(stem) + 1:-6].isdigit():
        return int(name[len(stem) + 1:-6])
    return None


def _chunks(table: pa.Table, rows: int) -> Iterator[pa.Table]:
    for start in range(0, table.num_rows, rows):
        yield table.slice(start, rows)


def write_incremental_example(draft: SnapshotDraft, count: int = 200, seed: int = 0, first: int = 0,
                              consumed: int = 0) -> tuple[GymCommit, list[PartReceipt]]:
    """Write an example snapshot as an incremental writer does (format 1.3, SPEC §12.12, §14.2):
    the data plane's rows as immutable segments (shared objects), the parent's segments listed again
    instead of written.

    The data plane holds, in this order, what it held at the parent snapshot less the ``consumed``
    oldest training rows, then the rows of ``count`` new rollouts drawn from ``seed`` (numbered from
    ``first``, so their ids differ from the parent's). So the TQ part lists:

    * each of the parent's training segments whose surviving rows are still one run holding at
      least a quarter of the segment: listed again, narrowed by ``row_range`` when rows are gone
      (otherwise its surviving rows are written again as a new segment);
    * each of the parent's token-capture segments, listed again whole;
    * the new rows as new segments of at most :data:`SEGMENT_ROWS` rows each, numbered on from
      the parent's (``tq/training-000001.arrow``...).

    Gym's files and the Single Controller's part are whole files, as :func:`write_example` writes
    them for the new rollouts; the replay index lists every training row the data plane still holds
    and the loader place counts every prompt group so far. Every byte is a pure function of the
    arguments and of the parent's bytes. Returns Gym's commit result and the receipts.
    """
    rs = rollouts(count, seed, first)
    batches = list(token_batches(rs, seed))
    gym, receipts = _write_gym(draft, rs, batches)
    parent = None
    if draft.parent is not None:
        parent = open_sequence(draft.store, draft.parent.sequence)
        if parent.manifest.snapshot_id != draft.parent.snapshot_id:
            raise InvalidRecordError(f"{draft.url}: its parent {draft.parent.snapshot_id} is gone")

    tq = draft.part("tq", writer="tq")
    survivors: list[pa.Table] = []  # the parent's training rows the data plane still holds
    new = {"training_rows": pa.Table.from_batches([training_batch(rs, seed)]),
           "token_capture_rows": pa.Table.from_batches([b for b, _ in batches])}
    for kind, stem in SEGMENT_STEMS.items():
        entries = [] if parent is None else [f for f in parent.files(kind) if f.object is not None]
        numbers = [n for f in entries if (n := _segment_number(f.path, stem)) is not None]
        next_number = max(numbers, default=-1) + 1
        drop = consumed if kind == "training_rows" else 0
        for entry in entries:
            low, high = entry.row_range or (0, entry.records)
            skip = min(drop, high - low)  # the oldest rows are consumed first
            drop -= skip
            start = low + skip
            if start == high:
                continue  # every row of it is gone: it is simply not listed any more
            if kind == "training_rows":
                survivors.append(parent.read_rows(entry).slice(skip))
            if high - start >= MIN_REUSE * _object_rows(parent, entry):
                tq.reference(entry, row_range=(start, high) if skip else None)
                continue
            for chunk in _chunks(parent.read_rows(entry).slice(skip), SEGMENT_ROWS):  # in place: data-plane order
                tq.write_rows_object(f"{stem}-{next_number:06d}.arrow", kind, chunk)
                next_number += 1
        for chunk in _chunks(new[kind], SEGMENT_ROWS):
            tq.write_rows_object(f"{stem}-{next_number:06d}.arrow", kind, chunk)
            next_number += 1

    columns = ["key", "partition_id", "rollout_id", "attempt_index"]
    replay = [ReplayIndexEntry(key=row["key"], partition_id=row["partition_id"], rollout_id=row["rollout_id"],
                               attempt_index=row["attempt_index"], group_id=row["rollout_id"].split("_")[0],
                               status="ready")
              for table in survivors for row in table.select(columns).to_pylist()]
    replay += replay_entries(rs)
    controller = _write_controller(draft, rs, seed, replay=replay,
                                   consumed=(first + count + GROUP_SIZE - 1) // GROUP_SIZE)
    return gym, [*receipts, tq.close(), controller]


def _object_rows(snap: Snapshot, entry: FileEntry) -> int:
    """Rows of the whole object an entry names (its row range may list fewer)."""
    if entry.row_range is None:
        return entry.records
    reader = snap.open_rows(entry)
    return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def _write_controller(draft: SnapshotDraft, rs: list[Rollout], seed: int, replay: list[ReplayIndexEntry] | None = None,
                      consumed: int | None = None) -> PartReceipt:
    """The Single Controller's part: loader place, replay index, recovery ledger (of the rollouts
    ``rs``; the replay index and the loader's ``consumed`` default to theirs alone)."""
    ctl = draft.part("controller", writer="controller")
    groups = sorted({r.group_id for r in rs})
    ctl.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=len(groups) if consumed is None else consumed,
                                                         seed=seed, dataset_size=10 * len(groups)))
    ctl.write_records("replay_index", "replay_index", replay_entries(rs) if replay is None else replay)
    ledger: list = [PromptGroup(group_id=g, prompt_index=int(g[1:]), state="generating",
                                rollout_ids=[r.rollout_id for r in rs if r.group_id == g]) for g in groups]
    ledger += [RolloutAttempt(rollout_id=r.rollout_id, group_id=r.group_id, attempt_index=r.attempt,
                              state="sealed" if r.finished else "dispatched") for r in rs]
    ledger += [AckOwed(rollout_id=r.rollout_id, attempt_index=r.attempt, result_key=f"{r.key}/sample") for r in rs if r.finished]
    ctl.write_records("recovery_ledger", "recovery_ledger", ledger)
    return ctl.close()


# -- the layout of format 1.0 and 1.1 writers ---------------------------------------------------------------
#: The participant names and components of the 1.0 and 1.1 example writer (this project's own Gym
#: parts, ``gym/<component>/<name>/``).
LEGACY_PARTICIPANTS = [("agent", AGENT), ("model", MODEL), ("resource", RESOURCE)]


def write_legacy_example(draft: SnapshotDraft, count: int = 200, seed: int = 0) -> tuple[GymCommit, list[PartReceipt]]:
    """What the format 1.0 and 1.1 example writer wrote (SPEC §12.3 to §12.7): the Gym parts of this
    project's own kinds (continuations, agent state, model ledger, token-capture rows and the
    token-storage index, session state) under ``gym/<component>/<name>/``, and the same TQ
    (training rows only) and controller parts. Its data files are byte for byte those of
    ``spec/examples/store-v1.1``. A 1.2 writer writes Gym's files instead (:func:`write_example`);
    this exists for tests of readers of the older kinds, which every reader still reads."""
    rs = rollouts(count, seed)
    parked = [r for r in rs if not r.finished]
    prefixes = {component: f"{layout.GYM_PREFIX}/{component}/{name}" for component, name in LEGACY_PARTICIPANTS}

    agent = draft.part(prefixes["agent"], writer=f"agent:{AGENT}")
    agent.write_records("continuations", "continuations", (
        AgentContinuationRoot(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key,
                              last_committed_model_call_id=r.calls[-1], resource_state_revisions={RESOURCE: r.turns})
        for r in parked))
    agent.write_records("agent_state", "agent_state", (
        AgentStateRecord(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key,
                         status="finished_unacked" if r.finished else "parked", turn_index=r.turns,
                         state={"messages": r.turns * 2}, restart_only=["sandbox"] if r.turns == 4 else [])
        for r in rs))

    model = draft.part(prefixes["model"], writer=f"model:{MODEL}")
    index: list[TokenIndexEntry] = []
    tokens_path = f"{prefixes['model']}/tokens.arrow"
    with model.rows("tokens.arrow", "token_capture_rows") as w:
        for b, (batch, placed) in enumerate(token_batches(rs, seed)):
            w.write(batch)
            index.extend(TokenIndexEntry(capture_key=r.key, model_call_id=c, file=tokens_path, batch=b,
                                         row_start=i, row_count=1) for r, c, i in placed)
    model.write_records("ledger", "model_ledger", (
        ModelLedgerEntry(rollout_id=r.rollout_id, attempt_index=r.attempt, capture_key=r.key, model_call_id=c,
                         parent_call_id=None if t == 0 else r.calls[t - 1], turn_index=t, model="policy",
                         created_at=EPOCH + t)
        for r in rs for t, c in enumerate(r.calls)))
    model.write_records("token_index", "token_index", index)

    res = draft.part(prefixes["resource"], writer=f"resource:{RESOURCE}")
    res.write_records("sessions", "session_state", (
        SessionStateRecord(session_id=f"s-{r.key}", resource=RESOURCE, state_revision=r.turns, rollout_id=r.rollout_id,
                           state={"files": {"notes.txt": f"turn {r.turns}"}})
        for r in parked))

    tq = draft.part("tq", writer="tq")
    tq.write_rows("training.arrow", "training_rows", training_batch(rs, seed))
    controller = _write_controller(draft, rs, seed)

    receipts = {p.prefix: p.close() for p in (agent, model, res)}
    gym = GymCommit(checkpoint_id=f"ckpt-{draft.sequence}", participants=[
        ParticipantCommit(component=component, name=name, part_prefix=prefixes[component],
                          part_manifest_checksum=receipts[prefixes[component]].part_manifest_checksum,
                          payload={"rollouts": len(parked)})
        for component, name in LEGACY_PARTICIPANTS])
    return gym, [tq.close(), controller]
