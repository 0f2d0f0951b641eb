"""Fill the generated blocks of ``spec/SPEC.md`` and ``spec/CONTROL.md`` from the code, so the
structs stay the one source.

A generated block sits between two HTML comments and is replaced whole::

    <!-- BEGIN GENERATED record:FileEntry -->
    ...
    <!-- END GENERATED record:FileEntry -->

Block names in SPEC.md: ``record:<Struct>`` (field table from ``msgspec.inspect`` plus a JSON
example built from the struct, so it always decodes), ``columns:<row kind>`` (from the Arrow
schemas and ``COLUMN_DESCRIPTIONS`` of ``schemas/rows.py``), ``kinds`` (every ``FileKind``),
``constants`` and ``vectors`` (values computed by the code), ``example:object_entry`` (a file entry
naming a shared object with a row range, read from the golden store ``spec/examples/store-v1.4``). Block names in CONTROL.md (Gym's
checkpoint control protocol): ``message:<Struct>`` (the same as ``record:``, for every struct of
``schemas/control.py`` and ``schemas/gym_files.py``) and ``control:<what>`` (the routes of each
component, phases, error codes, constants and the topology fingerprint vector).

Every field's meaning is its ``msgspec.Meta(description=...)`` in ``schemas/``, or for the control
and Gym-file structs ``schemas.jsonschema.FIELD_MEANINGS`` (so the exported JSON Schemas carry it
too), every column's its entry in ``COLUMN_DESCRIPTIONS``; only the meanings of phases, error codes,
routes and file kinds are written here. A field, a column, a phase, an error code or a route without
a meaning fails the run, so none of them can reach the spec undocumented. The routes documented are
checked against the ones ``gymkit`` registers by ``tests/spec/test_spec_in_sync.py``.

    python spec/render_spec_schemas.py          # rewrite spec/SPEC.md and spec/CONTROL.md in place
    python spec/render_spec_schemas.py --check  # exit 1 if either is out of date

``tests/spec/test_spec_in_sync.py`` runs the check.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pyarrow as pa

from schemas import control, gym_files, identity, topology, version
from schemas.control import (
    AbortInflightResponse,
    AcknowledgeCompletedRequest,
    AcknowledgeCompletedResponse,
    AcknowledgeResponse,
    AgentCommitResponse,
    AgentRestoreResponse,
    AgentResumeResponse,
    AgentRetireResponse,
    AgentStatus,
    AttemptRef,
    AttemptRequest,
    Capabilities,
    CheckpointDirRequest,
    CompletionReceipt,
    ControlRequest,
    DetailBody,
    DiscardResponse,
    ErrorBody,
    ErrorEnvelope,
    Execution,
    InflightCall,
    InventoryEntry,
    ModelCommitRequest,
    ModelCommitResponse,
    ModelPauseResponse,
    ModelRestoreResponse,
    ModelResumeResponse,
    ModelStatusResponse,
    MultiProcess,
    ResourcesCommitResponse,
    ResourcesPrepareResponse,
    ResourcesRestoreResponse,
    ResourcesResumeResponse,
    ResourcesRetireResponse,
    ResourcesStatusResponse,
    SelectedBoundary,
    Workers,
    WorkerState,
)
from schemas.controller import AckOwed, LoaderPlace, PromptGroup, ReplayIndexEntry, RolloutAttempt
from schemas.gym_files import (
    AgentArchive,
    AgentBoundaryRecord,
    AgentIndexEntry,
    AgentManifest,
    ArtifactRef,
    AttemptEntry,
    ExternalStorageReference,
    LedgerManifest,
    LedgerRollout,
    MutationReceipt,
    PendingModel,
    ResourcesManifest,
    ResourceSnapshot,
)
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.jsonschema import CONTROL_MESSAGES, GYM_FILES, field_meaning
from schemas.manifest import (
    MAX_LISTED_PARTS,
    CommitRecord,
    FileEntry,
    FileKind,
    GymCommit,
    LatestHint,
    ListedPart,
    Manifest,
    ParentRef,
    ParticipantCommit,
    PartManifest,
    PartReceipt,
    StoreMarker,
)
from schemas.rows import COLUMN_DESCRIPTIONS, ROW_SCHEMAS
from schemas.topology import canonical_json, manifest_fingerprint, topology_fingerprint
from snapformat import jsonl, layout, reader, retention
from snapformat.checksum import checksum_bytes
from snapformat.kinds import GYM_KINDS, RECORD_TYPES, storage_of
from snapformat.objects import object_name

SPEC_DIR = Path(__file__).resolve().parent
_BLOCK_RE = re.compile(
    r"(<!-- BEGIN GENERATED (?P<name>[A-Za-z0-9_:]+) -->\n)(?P<body>.*?)(<!-- END GENERATED (?P=name) -->)",
    re.DOTALL,
)

# --------------------------------------------------------------------------------------------
# Meanings of what is not a struct field or a row column
# --------------------------------------------------------------------------------------------

#: What each phase of the fence means, and which routes enter it (checked against ``schemas.control.PHASES``).
PHASE_MEANINGS: dict[str, tuple[str, str]] = {
    "idle": ("start; every `resume`", "No checkpoint is active (`active_checkpoint_id` is null). The data plane admits work, unless a failed prepare or restore left it closed (CONTROL §2)."),
    "preparing": ("model `pause`, agent and resources `prepare`", "A prepare is running, or the model's admission is still draining its calls in flight."),
    "prepared": ("the end of a prepare (model: once admission is `paused`)", "The participant is quiet (model admission `paused`, agent `ready_to_commit`, resources sessions exported) and waits for commit or resume."),
    "committing": ("every `commit`", "The commit is writing the participant's files into `checkpoint_dir`."),
    "committed_paused": ("the end of a commit", "Its files are written, manifest last; still paused until resume."),
    "restoring": ("every `restore`", "The restore is reading the participant's files."),
    "restore_failed_paused": ("a failed model `restore`", "Model only: its restore failed; admission stays paused. Another model `restore`, or `resume`, leaves it."),
    "restored_paused": ("the end of a restore", "The files are loaded and admission stays closed until resume (agents: `discard-restored-continuation` is allowed here)."),
}

#: Each error code: the HTTP status it comes with and what it means (checked against ``ERROR_CODES``).
#: "(condition not in the sources)" marks a code the reference lists without saying when it is sent.
ERROR_MEANINGS: dict[str, tuple[str, str]] = {
    "control_error": ("409, 500", "A control failure no other code names; our servers answer an unexpected failure 500 with it (never with the token in `detail`)."),
    "stale_checkpoint": ("409", "The id was retired by its resume: any operation with it except that resume's replay."),
    "checkpoint_conflict": ("409", "Another checkpoint id is active in this process."),
    "invalid_phase": ("409", "The operation is not allowed in the process's phase."),
    "not_a_policy_instance": ("409", "A model admission or model checkpoint route other than `status` on a model whose `instance_role` is not `policy`."),
    "ledger_mismatch": ("409", "A model commit found its own `manifest.json` with other tombstones, source attempts or roots digest; or a continuation root's capture key is tombstoned or has no lineage. Ours also for a `checkpoint_dir` the model cannot use (files it cannot write or read; a path with a NUL byte, which no file system can hold, refused before any file is touched)."),
    "ledger_not_checkpointable": ("409", "The ledger cannot be checkpointed (condition not in the sources)."),
    "ledger_not_quiescent": ("409", "A model commit while admission is not `paused` or calls are in flight."),
    "missing_workers": ("none (coordinator only)", "NeMo-RL's coordinator code for model workers that did not answer; no server sends it."),
    "agent_checkpoint_error": ("409", "An agent checkpoint operation failed (its files could not be written or read, also for a `checkpoint_dir` with a NUL byte, which no file system can hold; condition not otherwise in the sources)."),
    "duplicate_execution": ("409", "`discard-restored-continuation` named a replacement attempt that is running."),
    "agent_admission_closed": ("409", "A `/run` while agent admission is closed: from a prepare (also one that failed) or a restore, until resume."),
    "stale_attempt": ("409", "An attempt that may not run any more: a `/run` of an acknowledged, retired or tombstoned attempt (agent); a call of a session's old attempt (resources); a model call of a tombstoned attempt (admission; with `retry-after: 1` only at admission)."),
    "agent_prepare_incomplete": ("409", "Agent prepare could not reach `ready_to_commit` by the deadline, or at once when the only blockers are unacknowledged completed results or executions parked without a boundary. Agent admission stays closed."),
    "completed_execution_acknowledgement_error": ("409", "An acknowledgement or `completion-receipt` for an attempt that is not retained and completed, or whose generation, identity or digest do not match."),
    "resources_checkpoint_error": ("409", "A resources checkpoint operation failed: a prepare past its deadline with sessions left, or files that could not be written or read (also for a `checkpoint_dir` with a NUL byte, which no file system can hold)."),
    "resources_admission_closed": ("409", "A data-plane call while resources admission is closed (after a prepare, also a failed one, or a failed restore, until resume)."),
    "resources_session_unbound": ("409", "The call names no bound session (condition not in the sources)."),
    "unsafe_resources_restore": ("409", "A resources restore into a process that is not fresh."),
    "resource_revision_mismatch": ("409", "Data plane: the expected revision header does not match the session's revision; the body adds `expected_revision` and `actual_revision` (null for a malformed header)."),
    "resource_request_receipt_error": ("409", "A request id's receipt cannot be used for this request (condition not in the sources)."),
    "resource_receipt_capacity_exhausted": ("409", "The session keeps no more mutation receipts (condition not in the sources)."),
    "resource_receipt_evicted": ("409", "The receipt of that request id is no longer kept (condition not in the sources)."),
    "resource_mutation_uncertain": ("409", "Whether the mutation took effect is unknown (condition not in the sources)."),
    "execution_identity_mismatch": ("409", "The request's execution identity headers do not match what the server holds (condition not in the sources); never with `retry-after`."),
    "checkpoint_parked": ("409", "Model admission is `draining` or `paused`: the call is refused with `retry-after: 1`."),
}

#: Every control route: (method, path under the base path, request, reply, phases, what it does),
#: by route family. Documented and registered routes must agree (``tests/spec/test_spec_in_sync.py``).
ROUTES: dict[str, list[tuple[str, str, str, str, str, str]]] = {
    "capabilities": [
        ("GET", "/capabilities", "none; no token", "Capabilities", "any", "The server's declaration merged with its live fence state (CONTROL §5)."),
    ],
    "model": [
        ("POST", "/model-admission/pause", "ControlRequest", "ModelPauseResponse", "`idle` → `preparing`, or `prepared` at once when nothing is in flight", "Close model admission; non-blocking: answers the admission state at once."),
        ("GET", "/model-admission/status", "query `checkpoint_id`, `deadline_ts` (required), `wait_state=paused`, `timeout_s` >= 0 (default 0)", "ModelStatusResponse", "any but `idle`; marks `prepared` once paused", "Admission state and calls in flight; with `wait_state=paused` it waits up to min(`timeout_s`, time left) for `paused`. Not role-gated."),
        ("POST", "/model-admission/resume", "ControlRequest", "ModelResumeResponse", "`preparing`, `prepared`, `committed_paused`, `restore_failed_paused`, `restored_paused` → `idle` (not from `idle`)", "Reopen admission; retire the id."),
        ("POST", "/model-admission/abort_inflight", "AttemptRequest", "AbortInflightResponse", "`preparing`, `prepared` (kept)", "Cancel the attempt's calls in flight and tombstone it; operation key `model-admission/abort_inflight:<rid>:<n>`."),
        ("POST", "/model-checkpoint/commit", "ModelCommitRequest", "ModelCommitResponse", "`prepared` → `committing` → `committed_paused`", "Write the ledger of the calls the agents' continuation roots depend on (CONTROL §6.5); needs `paused` admission and no call in flight."),
        ("POST", "/model-checkpoint/restore", "CheckpointDirRequest", "ModelRestoreResponse", "`idle` or `restore_failed_paused` → `restoring` → `restored_paused` (failure: `restore_failed_paused`)", "Read the ledger back; close admission; fence the saved tombstones and the source attempts."),
    ],
    "agent": [
        ("POST", "/agent-checkpoint/acknowledge", "CompletionReceipt", "AcknowledgeResponse", "any (unfenced)", "Release one completed result (CONTROL §7)."),
        ("POST", "/agent-checkpoint/acknowledge-completed", "AcknowledgeCompletedRequest", "AcknowledgeCompletedResponse", "any (unfenced)", "Release a batch of completed results; the whole batch is validated before any is released."),
        ("GET", "/agent-checkpoint/completion-receipt", "query `rollout_id`, `attempt_index`", "CompletionReceipt", "any (unfenced)", "The receipt of a completed attempt."),
        ("POST", "/agent-checkpoint/prepare", "ControlRequest", "AgentStatus", "`idle` → `preparing` → `prepared`", "Close agent admission and wait, up to the deadline, until `ready_to_commit`."),
        ("GET", "/agent-checkpoint/status", "query `checkpoint_id`", "AgentStatus", "any (stale and conflict checks apply)", "The status object, with `checkpoint_id`."),
        ("POST", "/agent-checkpoint/commit", "CheckpointDirRequest", "AgentCommitResponse", "`prepared` → `committing` → `committed_paused`", "Write the agent's files (CONTROL §6.4)."),
        ("POST", "/agent-checkpoint/restore", "CheckpointDirRequest", "AgentRestoreResponse", "`idle` → `restoring` → `restored_paused`", "Read them back: each record continues as attempt + 1, its source attempt tombstoned; admission closed until resume."),
        ("POST", "/agent-checkpoint/resume", "ControlRequest", "AgentResumeResponse", "`idle`, `preparing`, `prepared`, `committed_paused`, `restored_paused` → `idle`", "Reopen admission; retire the id."),
        ("POST", "/agent-checkpoint/retire", "AttemptRequest", "AgentRetireResponse", "`idle`, `preparing`, `prepared` (unfenced)", "Give an attempt up: retire and tombstone it, unless it completed with its result unacknowledged."),
        ("POST", "/agent-checkpoint/discard-restored-continuation", "AttemptRequest", "DiscardResponse", "`restored_paused` (unfenced)", "Drop a restored continuation: the replacement attempt (source + 1) starts from the beginning."),
    ],
    "resources": [
        ("POST", "/resources-checkpoint/prepare", "ControlRequest", "ResourcesPrepareResponse", "`idle` → `preparing` → `prepared`", "Close resources admission and export every bound session under its lock."),
        ("GET", "/resources-checkpoint/status", "query `checkpoint_id`, `deadline_ts`", "ResourcesStatusResponse", "any but `idle` and `restore_failed_paused`", "Admission state, sessions and the prepared inventory."),
        ("POST", "/resources-checkpoint/commit", "CheckpointDirRequest", "ResourcesCommitResponse", "`prepared` → `committing` → `committed_paused`", "Write one file per session, then the manifest (CONTROL §6.6)."),
        ("POST", "/resources-checkpoint/restore", "CheckpointDirRequest", "ResourcesRestoreResponse", "`idle` → `restoring` → `restored_paused`", "Fresh process only; each session comes back as attempt + 1 with its mutation receipts."),
        ("POST", "/resources-checkpoint/resume", "ControlRequest", "ResourcesResumeResponse", "`idle`, `prepared`, `committed_paused`, `restored_paused` → `idle`", "Reopen admission; retire the id."),
        ("POST", "/resources-checkpoint/retire", "AttemptRequest", "ResourcesRetireResponse", "`preparing`, `prepared` (unfenced)", "Drop the attempt's session."),
    ],
}

KIND_NOTES: dict[str, tuple[str, str, str]] = {
    # kind: (written by, conventional file name, section)
    "training_rows": ("TQ adapter", "`tq/training.arrow`", "Training rows"),
    "token_capture_rows": ("TQ adapter (format 1.0, 1.1: also the policy model server, `gym/model/<name>/tokens.arrow`)", "`tq/token_capture.arrow`", "Token-capture rows"),
    "dataplane_rows": ("TQ adapter", "`tq/dataplane.arrow`", "Data-plane rows"),
    "continuations": ("agent server (format 1.0, 1.1)", "`gym/agent/<name>/continuations.jsonl[.zst]`", "Continuations"),
    "agent_state": ("agent server (format 1.0, 1.1)", "`gym/agent/<name>/agent_state.jsonl[.zst]`", "Agent state"),
    "model_ledger": ("policy model server (format 1.0, 1.1)", "`gym/model/<name>/ledger.jsonl[.zst]`", "Model ledger"),
    "token_index": ("policy model server (format 1.0, 1.1)", "`gym/model/<name>/token_index.jsonl[.zst]`", "Token-storage index"),
    "session_state": ("resource server (format 1.0, 1.1)", "`gym/resource/<name>/sessions.jsonl[.zst]`", "Session state"),
    "loader_place": ("Single Controller", "`controller/loader.json`", "Loader place"),
    "replay_index": ("Single Controller", "`controller/replay_index.jsonl[.zst]`", "Replay index"),
    "recovery_ledger": ("Single Controller", "`controller/recovery_ledger.jsonl[.zst]`", "Recovery ledger"),
    "part_manifest": ("every participant (for Gym's files: the publisher, adopting them)", "`<prefix>/part-manifest.json`", "Part manifest"),
    "gym_file": ("a Gym server (adopted by the publisher)", "`gym/agent/instance-<sha>/…`, `gym/model-ledger/<name>/…`, `gym/resources/<name>/…`", "Gym's files"),
}
# --------------------------------------------------------------------------------------------
# Examples: built from the structs, so they always decode
# --------------------------------------------------------------------------------------------

_X1 = "xxh128:" + "0" * 31 + "1"


def _ck(text: str) -> str:
    return checksum_bytes(text.encode())


def examples() -> dict[str, Any]:
    return {**record_examples(), **message_examples()}


def record_examples() -> dict[str, Any]:
    sid = "snap-0000000002-4f1c9a7e"
    # The policy model's Gym part (CONTROL §9): Gym's files, adopted as kind gym_file.
    gym_files_ = gym_file_examples()
    ledger = gym_files_["LedgerManifest"]
    prefix, writer = f"gym/{gym_files.ledger_dir(_MODEL)}", f"responses_api_models:{_MODEL}"
    lineage = b'{"model_call_id":"call-0"}\n{"model_call_id":"call-1"}\n'
    refs = _line(gym_files_["ExternalStorageReference"])
    manifest_bytes = gym_document(ledger)
    files = [
        FileEntry(path=f"{prefix}/group-7_g0.lineage.jsonl", kind="gym_file", size=len(lineage),
                  checksum=checksum_bytes(lineage), records=2, writer=writer),
        FileEntry(path=f"{prefix}/{gym_files.MANIFEST_NAME}", kind="gym_file", size=len(manifest_bytes),
                  checksum=checksum_bytes(manifest_bytes), records=1, writer=writer),
        FileEntry(path=f"{prefix}/{gym_files.STORAGE_REFERENCES_NAME}", kind="gym_file", size=len(refs),
                  checksum=checksum_bytes(refs), records=1, writer=writer),
        FileEntry(path=f"{prefix}/part-manifest.json", kind="part_manifest", size=1013,
                  checksum=_ck("part"), records=1, writer=writer),
    ]
    commit_reply = message_examples()["ModelCommitResponse"]
    gym = GymCommit(checkpoint_id="ckpt-2", participants=[
        ParticipantCommit(component="responses_api_models", name=_MODEL, part_prefix=prefix,
                          part_manifest_checksum=_ck("part"), payload=msgspec.to_builtins(commit_reply)),
    ])
    compressed = FileEntry(path="controller/replay_index.jsonl.zst", kind="replay_index", size=18233,
                           checksum=_ck("replay"), records=4096, compression="zstd", content_size=801234,
                           writer="controller")
    return {
        "StoreMarker": StoreMarker(),
        "CommitRecord": CommitRecord(format_version=version.FORMAT_VERSION, sequence=2, snapshot_id=sid, manifest_size=5209,
                                     manifest_checksum=_ck("manifest"), committed_at=1796000123.25),
        "LatestHint": LatestHint(sequence=2, snapshot_id=sid),
        # Format 1.4: the Gym part is listed by its part manifest and totals (SPEC §10.4).
        "Manifest": Manifest(format_version=version.FORMAT_VERSION, required_features=[version.PART_LISTINGS],
                             snapshot_id=sid, sequence=2, created_at=1796000120.5,
                             committed_at=1796000123.25, files=files[3:],
                             listed_parts=[ListedPart(prefix=prefix, files=3, bytes=sum(f.size for f in files[:3]))],
                             gym_commit=gym,
                             topology_fingerprint=manifest_fingerprint(topology_fingerprint(topology_contracts())),
                             parent=ParentRef(snapshot_id="snap-0000000001-0b3d2e11", sequence=1),
                             timings_s={"pause": 2.41, "publish": 0.02}, producer="snapformat 0.1.0"),
        "FileEntry": compressed,
        "ParentRef": ParentRef(snapshot_id="snap-0000000001-0b3d2e11", sequence=1),
        "ListedPart": ListedPart(prefix=prefix, files=3, bytes=sum(f.size for f in files[:3])),
        "GymCommit": gym,
        "ParticipantCommit": gym.participants[0],
        "PartManifest": PartManifest(format_version=version.FORMAT_VERSION, snapshot_id=sid, prefix=prefix,
                                     writer=writer, files=files[:3], written_at=1796000122.0),
        "PartReceipt": PartReceipt(prefix=prefix, writer=writer, part_manifest_checksum=_ck("part")),
        "AgentContinuationRoot": AgentContinuationRoot(
            rollout_id="p7_g2", attempt_index=0, capture_key="p7_g2", last_committed_model_call_id="call-2",
            resource_state_revisions={"tools": 3}),
        "AgentStateRecord": AgentStateRecord(
            rollout_id="p7_g2", attempt_index=0, capture_key="p7_g2", status="parked", turn_index=3,
            state={"messages": 6}, restart_only=[]),
        "ModelLedgerEntry": ModelLedgerEntry(
            rollout_id="p7_g2", attempt_index=0, capture_key="p7_g2", model_call_id="call-2",
            parent_call_id="call-1", turn_index=2, model="policy", created_at=1796000002.0),
        "TokenIndexEntry": TokenIndexEntry(
            capture_key="p7_g2", model_call_id="call-2", file="gym/model/policy0/tokens.arrow", batch=0,
            row_start=17, row_count=1),
        "SessionStateRecord": SessionStateRecord(
            session_id="s-p7_g2", resource="tools", tool="notes", state_revision=3, rollout_id="p7_g2",
            state={"files": {"notes.txt": "turn 3"}}),
        "LoaderPlace": LoaderPlace(epoch=0, consumed=128, seed=7, dataset_size=1280),
        "ReplayIndexEntry": ReplayIndexEntry(
            key="p7_g1/sample", partition_id="train", rollout_id="p7_g1", attempt_index=0, group_id="p7",
            status="ready"),
        "PromptGroup": PromptGroup(group_id="p7", prompt_index=7, state="generating",
                                   rollout_ids=["p7_g0", "p7_g1", "p7_g2", "p7_g3"]),
        "RolloutAttempt": RolloutAttempt(rollout_id="p7_g2", group_id="p7", attempt_index=0, state="dispatched"),
        "AckOwed": AckOwed(rollout_id="p7_g1", attempt_index=0, result_key="p7_g1/sample"),
    }


# --------------------------------------------------------------------------------------------
# Examples of CONTROL.md: values from the reference's examples (Gym's and NeMo-RL's tests) where it
# gives them; every digest, size and count is computed from the bytes it describes
# --------------------------------------------------------------------------------------------

_DEADLINE = 1796000420.0
_CKPT = "ckpt-2"
_AGENT, _MODEL, _TOOLS = "simple_agent", "policy_model", "durable-tools"
_AGENT_DIR = gym_files.agent_instance_dir(_AGENT)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _line(value: Any) -> bytes:
    """One JSON-lines row as Gym writes it: compact, declaration order, then ``\\n``."""
    return msgspec.json.encode(value) + b"\n"


def _ref(relative_path: str, rows: list[Any]) -> ArtifactRef:
    data = b"".join(_line(r) for r in rows)
    return ArtifactRef(relative_path=relative_path, sha256=_sha(data), records=len(rows), bytes=len(data))


#: How Gym serializes each JSON document it writes: (sort_keys, indent).
DOCUMENT_STYLES: dict[str, tuple[bool, int]] = {
    "AgentManifest": (True, 2), "LedgerManifest": (True, 1), "ResourcesManifest": (True, 2),
    "AgentBoundaryRecord": (False, 2), "ResourceSnapshot": (False, 2),
}


def gym_document(value: Any) -> bytes:
    """A Gym JSON document's bytes (CONTROL.md §6.2): ``json.dumps`` with Gym's indent, manifests
    with sorted keys, records in declaration order; no final newline."""
    sort_keys, indent = DOCUMENT_STYLES[type(value).__name__]
    return json.dumps(msgspec.to_builtins(value), sort_keys=sort_keys, indent=indent).encode()


def result_digest(result: Any) -> str:
    """The completion receipt's ``result_digest`` (CONTROL.md §7)."""
    return _sha(json.dumps(result, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def gym_file_examples() -> dict[str, Any]:
    root = AgentContinuationRoot(rollout_id="group-7_g0", attempt_index=0, capture_key="group-7_g0",
                                 last_committed_model_call_id="call-1",
                                 resource_state_revisions={_TOOLS: 2})
    continuation_index = _ref(f"{_AGENT_DIR}/{gym_files.CONTINUATIONS_NAME}", [root])
    record = AgentBoundaryRecord(
        rollout_id="group-7_g0", attempt_index=0, boundary_index=1, turn_index=1, boundary_kind="turn_complete",
        output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}],
        usage={"input_tokens": 57, "output_tokens": 12}, last_committed_model_call_id="call-1",
        resource_state_revisions={_TOOLS: 2}, agent_state={"turns": 2}, created_at=1796000100.0)
    member = gym_document(record)
    index_entry = AgentIndexEntry(rollout_id="group-7_g0", attempt_index=0, archive=gym_files.agent_archive_name(0),
                                  member=gym_files.attempt_member("group-7_g0", 0), sha256=_sha(member),
                                  bytes=len(member))
    archive = AgentArchive(name=gym_files.agent_archive_name(0), sha256=_sha(b"the archive's bytes"), members=1,
                           bytes=10240)
    agent_manifest = AgentManifest(
        checkpoint_id=_CKPT, instance_name=_AGENT, archives=[archive],
        record_index=_ref(f"{_AGENT_DIR}/{gym_files.AGENT_INDEX_NAME}", [index_entry]), records=1,
        continuation_index=continuation_index)
    storage_ref = ExternalStorageReference(capture_key="group-7_g0", boundary_model_call_id="call-1",
                                           key="token-capture/group-7_g0/call-1")
    roots = [msgspec.to_builtins(root)]
    lineage = b'{"model_call_id":"call-0"}\n{"model_call_id":"call-1"}\n'  # Gym's lineage rows, abridged
    ledger = LedgerManifest(
        checkpoint_id=_CKPT, server_name=_MODEL,
        rollouts={"group-7_g0": LedgerRollout(files={"group-7_g0.lineage.jsonl": _sha(lineage)}, rows=2,
                                              bytes=len(lineage))},
        continuation_roots_sha256=_sha(json.dumps(roots, sort_keys=True, separators=(",", ":")).encode()),
        continuation_roots=1, excluded_inactive=0,
        storage_reference_index=_ref(f"{gym_files.ledger_dir(_MODEL)}/{gym_files.STORAGE_REFERENCES_NAME}",
                                     [storage_ref]),
        tombstones=[], source_attempts=[AttemptEntry(rollout_id="group-7_g0", attempt_index=0)])
    body = b'{"ok":true,"revision":2}'
    receipt = MutationReceipt(request_id="req-7", expected_revision=1, input_digest=_sha(b'{"write":"notes.txt"}'),
                              status=200, headers=[("content-type", "application/json")],
                              body_base64=base64.b64encode(body).decode(), resulting_revision=2)
    snapshot = ResourceSnapshot(rollout_id="group-7_g0", attempt_index=0, state_revision=2,
                                state={"files": {"notes.txt": "turn 2"}}, mutation_receipts=[receipt],
                                created_at=1796000100.0)
    resources = ResourcesManifest(checkpoint_id=_CKPT, server_name=_TOOLS,
                                  files={gym_files.attempt_member("group-7_g0", 0): _sha(gym_document(snapshot))})
    return {
        "ArtifactRef": continuation_index, "AgentArchive": archive, "AgentManifest": agent_manifest,
        "AgentIndexEntry": index_entry,
        "PendingModel": PendingModel(model_call_id="call-2", response={"id": "resp_2", "output": []},
                                     usage={"input_tokens": 80, "output_tokens": 9}),
        "AgentBoundaryRecord": record,
        "LedgerRollout": ledger.rollouts["group-7_g0"], "AttemptEntry": ledger.source_attempts[0],
        "LedgerManifest": ledger, "ExternalStorageReference": storage_ref,
        "MutationReceipt": receipt, "ResourceSnapshot": snapshot, "ResourcesManifest": resources,
    }


def message_examples() -> dict[str, Any]:
    files = gym_file_examples()
    continuation_index = files["ArtifactRef"]
    storage_index = files["LedgerManifest"].storage_reference_index
    result = {"id": "resp_0f3a", "reward": 1.0}
    receipt = CompletionReceipt(rollout_id="group-7_g1", attempt_index=0, execution_generation=1,
                                result_identity=str(result["id"]), result_digest=result_digest(result))
    running = Execution(rollout_id="rollout-a", attempt_index=0, generation=1, state="running",
                        resource_state_revisions={}, age_seconds=0.01)
    status = AgentStatus(checkpoint_id="checkpoint-1", state="preparing", ready_to_commit=False, running=1,
                         active=1, blocking_attempts=[running], executions=[running])
    inventory = InventoryEntry(rollout_id="group-7_g0", attempt_index=0, revision=2, mutation_receipts=1)
    error = ErrorBody(code="checkpoint_conflict", detail="checkpoint 'checkpoint-1' is active; 'checkpoint-2' refused")
    draft_gym = "/data/rl-snapshots/snapshots/snap-0000000002-4f1c9a7e/gym"
    return {
        "ControlRequest": ControlRequest(checkpoint_id=_CKPT, deadline_ts=_DEADLINE),
        "CheckpointDirRequest": CheckpointDirRequest(checkpoint_id=_CKPT, deadline_ts=_DEADLINE,
                                                     checkpoint_dir=draft_gym),
        "ModelCommitRequest": ModelCommitRequest(checkpoint_id=_CKPT, deadline_ts=_DEADLINE, checkpoint_dir=draft_gym,
                                                 continuation_indexes=[continuation_index]),
        "AttemptRequest": AttemptRequest(checkpoint_id="checkpoint-1", deadline_ts=_DEADLINE, rollout_id="rollout-a",
                                         attempt_index=0),
        "CompletionReceipt": receipt,
        "AcknowledgeCompletedRequest": AcknowledgeCompletedRequest(executions=[receipt]),
        "MultiProcess": MultiProcess(mode="single_worker", num_workers=1),
        # the stateless resources server of Gym's test_checkpoint_control.py (the reference's examples)
        "Capabilities": Capabilities(component="resources_servers", name="resources",
                                     multi_process=MultiProcess(mode="single_worker", num_workers=1)),
        "AttemptRef": AttemptRef(rollout_id="group-7_g0", attempt_index=0),
        "Workers": Workers(acknowledged=1, expected=1),
        "WorkerState": WorkerState(state="draining", inflight=1),
        "InflightCall": InflightCall(rollout_id="group-7_g2", attempt_index=0, plane="model", age_seconds=0.42),
        "ModelPauseResponse": ModelPauseResponse(state="paused", workers=Workers(acknowledged=1, expected=1),
                                                 inflight_total=0, waiters_total=0),
        "ModelStatusResponse": ModelStatusResponse(
            checkpoint_id=_CKPT, state="draining", per_worker={"0": WorkerState(state="draining", inflight=1)},
            inflight_total=1, waiters_total=0,
            inflight=[InflightCall(rollout_id="group-7_g2", attempt_index=0, plane="model", age_seconds=0.42)],
            tombstones=[]),
        "ModelResumeResponse": ModelResumeResponse(state="accepting", workers=Workers(), released_waiters=0),
        "AbortInflightResponse": AbortInflightResponse(state="draining", aborted_inflight=1, inflight_total=0),
        "ModelCommitResponse": ModelCommitResponse(
            rollouts=1, rows=2, excluded_tombstoned=0, excluded_inactive=0,
            manifest_digest=_sha(gym_document(files["LedgerManifest"])), storage_reference_index=storage_index),
        "ModelRestoreResponse": ModelRestoreResponse(
            rollouts=1, rows=2, checkpoint_id=_CKPT, tombstones=[],
            source_attempts=[AttemptRef(rollout_id="group-7_g0", attempt_index=0)],
            storage_reference_index=storage_index),
        "Execution": running,
        "SelectedBoundary": SelectedBoundary(rollout_id="group-7_g0", attempt_index=0, boundary_index=1,
                                             turn_index=1, boundary_kind="turn_complete",
                                             resource_state_revisions={_TOOLS: 2}),
        "AgentStatus": status,
        "AcknowledgeResponse": AcknowledgeResponse(acknowledged=True, idempotent=False),
        "AcknowledgeCompletedResponse": AcknowledgeCompletedResponse(acknowledged=[receipt]),
        "AgentCommitResponse": AgentCommitResponse(records=1, manifest_digest=_sha(gym_document(files["AgentManifest"])),
                                                   continuation_index=continuation_index),
        "AgentRestoreResponse": AgentRestoreResponse(records=1, source_checkpoint_id=_CKPT,
                                                     continuation_index=continuation_index),
        "AgentResumeResponse": AgentResumeResponse(state="accepting", released=1),
        "AgentRetireResponse": AgentRetireResponse(retired=True, tombstoned=True),
        "DiscardResponse": DiscardResponse(discarded=True),
        "InventoryEntry": inventory,
        "ResourcesPrepareResponse": ResourcesPrepareResponse(sessions=1, state="prepared", inventory=[inventory]),
        "ResourcesCommitResponse": ResourcesCommitResponse(
            sessions=1, manifest_digest=_sha(gym_document(files["ResourcesManifest"]))),
        "ResourcesRestoreResponse": ResourcesRestoreResponse(sessions=1, source_checkpoint_id=_CKPT),
        "ResourcesResumeResponse": ResourcesResumeResponse(state="accepting"),
        "ResourcesRetireResponse": ResourcesRetireResponse(retired=True, rollout_id="group-7_g3", attempt_index=0),
        "ResourcesStatusResponse": ResourcesStatusResponse(
            checkpoint_id=_CKPT, state="paused", admission_state="paused", sessions=1, per_session=[],
            prepared_inventory=[inventory]),
        "ErrorBody": error,
        "ErrorEnvelope": ErrorEnvelope(error=error),
        "DetailBody": DetailBody(detail=control.UNAUTHORIZED_DETAIL),
        **files,
    }


#: The fixed three-server topology of the fingerprint vector (CONTROL.md §5): a policy model, a
#: whitebox agent and a resources server, each a single worker, named by their Gym config keys.
TOPOLOGY_CAPABILITIES: list[Capabilities] = [
    Capabilities(component="responses_api_models", name=_MODEL, admission_states=["accepting", "draining", "paused"],
                 checkpoint_mode="export_restore", concurrency_contract="transactional_parallel",
                 multi_process=MultiProcess(mode="single_worker", num_workers=1), instance_role="policy",
                 features=[control.FEATURE_STORAGE_REFERENCE_INDEX]),
    Capabilities(component="responses_api_agents", name=_AGENT, checkpoint_mode="export_restore",
                 concurrency_contract="serialized_per_session",
                 multi_process=MultiProcess(mode="single_worker", num_workers=1),
                 features=[control.FEATURE_COMPLETED_RESULT_ACK, control.FEATURE_CONTINUATION_INDEX]),
    Capabilities(component="resources_servers", name=_TOOLS, checkpoint_mode="export_restore",
                 concurrency_contract="serialized_per_session",
                 multi_process=MultiProcess(mode="single_worker", num_workers=1)),
]


def topology_contracts() -> list[dict[str, Any]]:
    return [c.contract(c.name) for c in TOPOLOGY_CAPABILITIES]


#: Records stored one per line: their example is shown as the exact line.
LINE_RECORDS = {
    "AgentContinuationRoot", "AgentStateRecord", "ModelLedgerEntry", "TokenIndexEntry", "SessionStateRecord",
    "ReplayIndexEntry", "PromptGroup", "RolloutAttempt", "AckOwed", "LatestHint", "PartReceipt",
    "AgentIndexEntry", "ExternalStorageReference", "ListedPart",
}

STRUCTS: dict[str, type] = {
    "StoreMarker": StoreMarker, "CommitRecord": CommitRecord, "LatestHint": LatestHint, "Manifest": Manifest,
    "FileEntry": FileEntry, "ParentRef": ParentRef, "ListedPart": ListedPart, "GymCommit": GymCommit, "ParticipantCommit": ParticipantCommit,
    "PartManifest": PartManifest, "PartReceipt": PartReceipt, "AgentContinuationRoot": AgentContinuationRoot,
    "AgentStateRecord": AgentStateRecord, "ModelLedgerEntry": ModelLedgerEntry, "TokenIndexEntry": TokenIndexEntry,
    "SessionStateRecord": SessionStateRecord, "LoaderPlace": LoaderPlace, "ReplayIndexEntry": ReplayIndexEntry,
    "PromptGroup": PromptGroup, "RolloutAttempt": RolloutAttempt, "AckOwed": AckOwed,
}


def _module_structs(module: Any) -> dict[str, type]:
    """Every struct a module defines, in definition order."""
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__}


#: CONTROL.md's tables: every struct of ``schemas/control.py`` and ``schemas/gym_files.py``.
MESSAGES: dict[str, type] = {**_module_structs(control), **_module_structs(gym_files)}


def _struct(name: str) -> type:
    return STRUCTS[name] if name in STRUCTS else MESSAGES[name]
# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _own(text: str) -> str:
    """Text written in the code as "CONTROL §N" (so the code's references resolve), as CONTROL.md
    itself says it: "§N"."""
    return text.replace("CONTROL §", "§")


def render_type(t: Any) -> str:
    if isinstance(t, mi.Metadata):
        return render_type(t.type)
    if isinstance(t, mi.StrType):
        bits = []
        if t.min_length is not None and t.max_length is not None:
            bits.append(f"{t.min_length}..{t.max_length} chars")
        elif t.max_length is not None:
            bits.append(f"<= {t.max_length} chars")
        elif t.min_length is not None:
            bits.append(f">= {t.min_length} chars")
        if t.pattern is not None:
            bits.append(f"matching `{spec_pattern(t.pattern)}`")
        return "string" + (f" ({', '.join(bits)})" if bits else "")
    if isinstance(t, mi.IntType):
        bits = [f"{op} {v}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
        return "integer" + (f" {' '.join(bits)}" if bits else "")
    if isinstance(t, mi.FloatType):
        bits = [f"{op} {v:g}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
        return "number" + (f" {' '.join(bits)}" if bits else "")
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, mi.AnyType):
        return "any JSON value"
    if isinstance(t, mi.LiteralType):
        values = ", ".join(f"`{msgspec.json.encode(v).decode()}`" for v in t.values)
        return values if len(t.values) == 1 else f"one of {values}"
    if isinstance(t, mi.UnionType):
        return " or ".join(render_type(m) for m in t.types)
    if isinstance(t, mi.ListType):
        limit = f" (at most {t.max_length:,} items)" if t.max_length is not None else ""
        return f"array of {render_type(t.item_type)}{limit}"
    if isinstance(t, mi.DictType):
        key = "name" if isinstance(t.key_type, mi.StrType) and t.key_type.min_length == 1 else "string"
        return f"object ({key} -> {render_type(t.value_type)})"
    if isinstance(t, mi.TupleType):
        return "array [" + ", ".join(render_type(m) for m in t.item_types) + "]"
    if isinstance(t, mi.StructType):
        return f"`{t.cls.__name__}` object"
    raise TypeError(f"no rendering for {t!r}")


def _required(field: mi.Field) -> str:
    if field.required:
        return "yes"
    if field.default is mi.NODEFAULT and field.default_factory is mi.NODEFAULT:
        return "no (absent unless it applies)"
    return f"no (default `{_default(field)}`)"


def _default(field: mi.Field) -> str:
    if field.default is not mi.NODEFAULT:
        return msgspec.json.encode(field.default).decode()
    if field.default_factory is not mi.NODEFAULT:
        return msgspec.json.encode(field.default_factory()).decode()
    return ""


def _unwrap(t: Any) -> Any:
    """A field's type without the ``Metadata`` wrapper its description puts around it."""
    return t.type if isinstance(t, mi.Metadata) else t


def record_table(name: str) -> str:
    cls = _struct(name)
    info = mi.type_info(cls)
    rows = []
    if info.tag_field is not None:
        rows.append((info.tag_field, f'`"{info.tag}"`', "yes", f"Record type tag: `{info.tag}`."))
    for f in info.fields:
        rows.append((f.encode_name, render_type(f.type), _required(f), field_meaning(cls, f)))
    missing = [r[0] for r in rows if not r[3]]
    if missing:
        raise SystemExit(f"render_spec_schemas: {name}: fields without a meaning (msgspec.Meta or "
                         f"FIELD_MEANINGS) {missing}")
    out = ["| field | type | required | meaning |", "|---|---|---|---|"]
    out += [f"| `{f}` | {_cell(t)} | {_cell(r)} | {_cell(m)} |" for f, t, r, m in rows]
    return "\n".join(out)


def record_example(name: str) -> str:
    value = examples()[name]
    assert type(value) is _struct(name)
    raw = msgspec.json.encode(value)
    msgspec.json.decode(raw, type=_struct(name))  # the example is valid by construction; keep it so
    if name in LINE_RECORDS:
        text = raw.decode()
    elif name in DOCUMENT_STYLES:
        text = gym_document(value).decode()
    else:
        text = msgspec.json.format(raw, indent=2).decode()
    return f"```json\n{text}\n```"


def record_block(name: str) -> str:
    return f"{record_table(name)}\n\nExample:\n\n{record_example(name)}"


def _arrow_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return f"list<{_arrow_type(t.value_type)}>"
    return {"string": "utf8", "float": "float32", "double": "float64"}.get(str(t), str(t))


def columns_block(kind: str) -> str:
    schema = ROW_SCHEMAS[kind]
    meanings = COLUMN_DESCRIPTIONS[kind]
    missing = [f.name for f in schema if f.name not in meanings]
    extra = sorted(set(meanings) - set(schema.names))
    if missing or extra:
        raise SystemExit(f"render_spec_schemas: {kind}: columns without a meaning {missing}, meanings without a column {extra}")
    out = ["| # | column | Arrow type | nullable | meaning |", "|---|---|---|---|---|"]
    for i, f in enumerate(schema):
        out.append(f"| {i} | `{f.name}` | `{_arrow_type(f.type)}` | {'yes' if f.nullable else 'no'} | {_cell(meanings[f.name])} |")
    meta = ", ".join(f"`{k.decode()}` = `{v.decode()}`" for k, v in schema.metadata.items())
    out.append("")
    out.append(f"Schema metadata: {meta}.")
    return "\n".join(out)


def kinds_block() -> str:
    out = ["| kind | storage | record / schema | written by | conventional path |", "|---|---|---|---|---|"]
    for kind in (*typing.get_args(FileKind), *sorted(GYM_KINDS)):
        storage = storage_of(kind)
        if storage == "gym":
            what = "a file of Gym's own layout, bound by Gym's `manifest.json`"
            how = "Gym's bytes, as written"
        elif storage == "rows":
            what = "the columns of its table"
            how = "Arrow IPC file"
        elif storage == "jsonl":
            members = typing.get_args(typing.get_args(RECORD_TYPES[kind])[0]) if kind == "recovery_ledger" else ()
            if members:
                what = "one of " + ", ".join(f"`{m.__name__}`" for m in members) + " per line"
            else:
                what = f"`{RECORD_TYPES[kind].__name__}` per line"
            how = "JSON lines (`none` or `zstd`)"
        else:
            what = f"one `{RECORD_TYPES[kind].__name__}`"
            how = "JSON document"
        by, path, section = KIND_NOTES[kind]
        out.append(f"| `{kind}` | {how} | {what} ({section}) | {by} | {path} |")
    return "\n".join(out)


def _max_files() -> int:
    field = next(f for f in mi.type_info(Manifest).fields if f.name == "files")
    return _unwrap(field.type).max_length


def constants_block() -> str:
    rows = [
        ("format version written", f"`{version.FORMAT_VERSION}`", "`schemas/version.py` `FORMAT_VERSION`"),
        ("highest record `schema_version` read", str(version.RECORD_SCHEMA_VERSION), "`RECORD_SCHEMA_VERSION`"),
        ("features known to this version", ", ".join(sorted(version.KNOWN_FEATURES)) or "none", "`KNOWN_FEATURES`"),
        ("features reserved", ", ".join(f"`{f}`" for f in sorted(version.RESERVED_FEATURES)) or "none",
         "`RESERVED_FEATURES`"),
        ("JSON-lines zstd threshold", f"{jsonl.ZSTD_THRESHOLD:,} bytes of content (256 KiB)", "`ZSTD_THRESHOLD`"),
        ("zstd level used by the reference writer", str(jsonl.ZSTD_LEVEL), "`ZSTD_LEVEL`"),
        ("largest zstd window a reader decodes with",
         f"{jsonl.ZSTD_MAX_WINDOW:,} bytes ({jsonl.ZSTD_MAX_WINDOW >> 20} MiB, "
         f"window log {jsonl.ZSTD_MAX_WINDOW.bit_length() - 1})", "`ZSTD_MAX_WINDOW`"),
        ("longest JSON line", f"{jsonl.MAX_LINE:,} bytes", "`MAX_LINE`"),
        ("largest manifest", f"{reader.MAX_MANIFEST_BYTES:,} bytes", "`MAX_MANIFEST_BYTES`"),
        ("most file entries in a manifest", f"{_max_files():,}", "`Manifest.files`"),
        ("most listed parts in a manifest (format 1.4)", f"{MAX_LISTED_PARTS:,}", "`MAX_LISTED_PARTS`"),
        ("largest JSON part (loader place, part manifest)", f"{reader.MAX_JSON_PART_BYTES:,} bytes",
         "`MAX_JSON_PART_BYTES`"),
        ("largest commit record, store marker", f"{64 * 1024:,} bytes", "`discovery.read_commit`"),
        ("longest safe name, rollout id", f"{identity.MAX_NAME_LEN} characters", "`MAX_NAME_LEN`"),
        ("longest relative path", f"{identity.MAX_PATH_LEN} characters", "`MAX_PATH_LEN`"),
        ("deepest relative path", f"{identity.MAX_PATH_DEPTH} segments", "`MAX_PATH_DEPTH`"),
        ("default draft age before GC sweeps a draft", f"{retention.DEFAULT_DRAFT_MIN_AGE_S:,.0f} s (6 h)", "`DEFAULT_DRAFT_MIN_AGE_S`"),
    ]
    out = ["| constant | value | in the code |", "|---|---|---|"]
    out += [f"| {a} | {_cell(b)} | {c} |" for a, b, c in rows]
    return "\n".join(out)


#: The golden store the example of an entry naming a shared object is read from, and that entry.
OBJECT_ENTRY_STORE = SPEC_DIR / "examples" / "store-v1.4"
OBJECT_ENTRY = (2, "tq/training-000000.arrow")


def object_entry_block() -> str:
    """A file entry naming a shared object with a row range, as the golden store holds it."""
    from snapformat import SnapshotStore

    sequence, path = OBJECT_ENTRY
    snap = SnapshotStore(str(OBJECT_ENTRY_STORE)).open(sequence)
    (entry,) = [f for f in snap.manifest.files if f.path == path]
    if entry.object is None or entry.row_range is None:
        raise SystemExit(f"render_spec_schemas: {OBJECT_ENTRY_STORE} sequence {sequence}: {path} names no object "
                         f"with a row range")
    text = msgspec.json.format(msgspec.json.encode(entry), indent=2).decode()
    return f"```json\n{text}\n```"


def vectors_block() -> str:
    from schemas.token_entry import token_digest

    hex_digest = topology_fingerprint(topology_contracts())
    rows = [
        ("capture key of (`p7_g2`, 0)", f"`{identity.capture_key('p7_g2', 0)}`"),
        ("capture key of (`p7_g2`, 1)", f"`{identity.capture_key('p7_g2', 1)}`"),
        ("(rollout id, attempt) of the capture key `x-a01-a2`", f"`{identity.split_capture_key('x-a01-a2')}`"),
        ("Gym's token digest of the empty sequence", f"`{token_digest([])}`"),
        ("Gym's token digest of `[1, 2, 3]`", f"`{token_digest([1, 2, 3])}`"),
        ("commit file of sequence 1", f"`{layout.commit_key(1)}`"),
        ("commit file of sequence 2", f"`{layout.commit_key(2)}`"),
        ("commit file of sequence 10000000000", f"`{layout.commit_key(10_000_000_000)}`"),
        ("snapshot id of sequence 2 (random part `4f1c9a7e`)", f"`{layout.new_snapshot_id(2)[:-8]}4f1c9a7e`"),
        ("checksum of the empty file", f"`{checksum_bytes(b'')}`"),
        ("checksum of the 11 bytes `snapformat\\n`", f"`{checksum_bytes(b'snapformat' + bytes([10]))}`"),
        ("`sha256` checksum of the same 11 bytes", f"`{checksum_bytes(b'snapformat' + bytes([10]), 'sha256')}`"),
        ("key of the shared object holding those 11 bytes (its name is that `sha256` checksum)",
         f"`{layout.object_key(object_name(b'snapformat' + bytes([10])))}`"),
        ("topology fingerprint of the three-server topology of CONTROL §5, as a manifest keeps it",
         f"`{manifest_fingerprint(hex_digest)}`"),
    ]
    out = ["| input | value |", "|---|---|"]
    out += [f"| {a} | {_cell(b)} |" for a, b in rows]
    out += ["", "The document hashed for that fingerprint, in canonical form (these exact bytes are hashed):", "",
            "```json", fingerprint_document().decode(), "```"]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Gym's checkpoint control protocol
# --------------------------------------------------------------------------------------------


def _nested_structs(t: Any, seen: set[type]) -> None:
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return
        seen.add(t.cls)
        for f in t.fields:
            _nested_structs(f.type, seen)
    elif isinstance(t, mi.Metadata):
        _nested_structs(t.type, seen)
    elif isinstance(t, mi.UnionType):
        for m in t.types:
            _nested_structs(m, seen)
    elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        _nested_structs(t.item_type, seen)
    elif isinstance(t, mi.DictType):
        _nested_structs(t.value_type, seen)


def check_messages_documented() -> None:
    """Every struct a control message or Gym file contains has a table in the spec (as a message or a record)."""
    seen: set[type] = set()
    for typ in (*CONTROL_MESSAGES.values(), *GYM_FILES.values()):
        _nested_structs(mi.type_info(typ), seen)
    missing = sorted(c.__name__ for c in seen if c.__name__ not in MESSAGES and c.__name__ not in STRUCTS)
    if missing:
        raise SystemExit(f"render_spec_schemas: control structs without a table: {missing}")


def documented_routes() -> set[tuple[str, str]]:
    """(method, full path) of every route the spec documents."""
    return {(m, control.CONTROL_PREFIX + p) for family in ROUTES.values() for m, p, *_ in family}


def control_routes_block(family: str) -> str:
    out = ["| method and path | request | reply (200) | phases | what it does |", "|---|---|---|---|---|"]
    for method, path, req, resp, phases, what in ROUTES[family]:
        for name in (req, resp):
            if name and name[0].isupper() and name not in MESSAGES:
                raise SystemExit(f"render_spec_schemas: route {path}: unknown message {name!r}")
        req_cell = f"`{req}`" if req in MESSAGES else req
        resp_cell = f"`{resp}`" if resp in MESSAGES else resp
        out.append(f"| `{method} {control.CONTROL_PREFIX}{path}` | {_cell(req_cell)} | {_cell(resp_cell)} | "
                   f"{_cell(phases)} | {_cell(_own(what))} |")
    return "\n".join(out)


def control_phases_block() -> str:
    if tuple(PHASE_MEANINGS) != control.PHASES or control.PHASES != typing.get_args(control.Phase):
        raise SystemExit(f"render_spec_schemas: PHASE_MEANINGS must cover exactly {control.PHASES} in order")
    out = ["| phase | entered by | meaning |", "|---|---|---|"]
    out += [f"| `{p}` | {_cell(by)} | {_cell(_own(m))} |" for p, (by, m) in PHASE_MEANINGS.items()]
    return "\n".join(out)


def _codes() -> dict[str, list[str]]:
    """Every error code, in first-seen order, with the owners that send it."""
    owners: dict[str, list[str]] = {}
    for owner, codes in control.ERROR_CODES.items():
        for code in codes:
            owners.setdefault(code, []).append(owner)
    for code in control.COORDINATOR_ONLY_CODES:
        owners.setdefault(code, []).append("model (NeMo-RL's coordinator)")
    return owners


def control_errors_block() -> str:
    owners = _codes()
    if set(ERROR_MEANINGS) != set(owners):
        raise SystemExit(f"render_spec_schemas: ERROR_MEANINGS must cover exactly {sorted(owners)}; "
                         f"missing {sorted(set(owners) - set(ERROR_MEANINGS))}, "
                         f"unknown {sorted(set(ERROR_MEANINGS) - set(owners))}")
    out = ["| `code` | sent by | HTTP status | meaning |", "|---|---|---|---|"]
    for code, who in owners.items():
        status, meaning = ERROR_MEANINGS[code]
        out.append(f"| `{code}` | {', '.join(who)} | {status} | {_cell(meaning)} |")
    return "\n".join(out)


def spec_pattern(pattern: str) -> str:
    """A code pattern as the spec writes it: the code ends some with ``$(?![\\s\\S])`` (Python's
    ``$`` also matches before a final newline), which the spec's whole-string convention says."""
    return pattern.removesuffix(r"(?![\s\S])")


def _field_type(struct: type, name: str) -> Any:
    return _unwrap(next(f.type for f in mi.type_info(struct).fields if f.name == name))


def control_constants_block() -> str:
    gym_id = _field_type(ControlRequest, "checkpoint_id")
    headers = [(n, getattr(control, n)) for n in dir(control) if n.startswith("HEADER_")]
    features = [(n, getattr(control, n)) for n in dir(control) if n.startswith("FEATURE_")]
    rows = [
        ("base path", f"`{control.CONTROL_PREFIX}`", "`CONTROL_PREFIX`"),
        ("control schema version", str(control.CONTROL_SCHEMA_VERSION), "`CONTROL_SCHEMA_VERSION`"),
        ("401 body's `detail`", f"`{control.UNAUTHORIZED_DETAIL}`", "`UNAUTHORIZED_DETAIL`"),
        ("checkpoint id, rollout id",
         f"{gym_id.min_length}..{gym_id.max_length} characters matching `{spec_pattern(gym_id.pattern)}`",
         "`GymId`"),
        ("largest request body our servers accept (not Gym's)", f"{control.MAX_BODY_BYTES:,} bytes (1 MiB)",
         "`MAX_BODY_BYTES`"),
        ("fingerprint document's `schema_version`", str(topology.FINGERPRINT_SCHEMA_VERSION),
         "`FINGERPRINT_SCHEMA_VERSION`"),
        ("Gym manifests' `schema_version`", str(gym_files.GYM_FILES_SCHEMA_VERSION), "`GYM_FILES_SCHEMA_VERSION`"),
        ("most members of an agent archive", f"{gym_files.AGENT_ARCHIVE_MAX_MEMBERS}", "`AGENT_ARCHIVE_MAX_MEMBERS`"),
        ("largest payload of an agent archive", f"{gym_files.AGENT_ARCHIVE_MAX_BYTES:,} bytes (64 MiB)",
         "`AGENT_ARCHIVE_MAX_BYTES`"),
        ("folders in `checkpoint_dir`", ", ".join(f"`{d}/`" for d in (gym_files.AGENT_DIR, gym_files.LEDGER_DIR,
                                                                      gym_files.RESOURCES_DIR)),
         "`AGENT_DIR`, `LEDGER_DIR`, `RESOURCES_DIR`"),
        ("file names", ", ".join(f"`{n}`" for n in (gym_files.MANIFEST_NAME, gym_files.CONTINUATIONS_NAME,
                                                    gym_files.AGENT_INDEX_NAME, gym_files.STORAGE_REFERENCES_NAME)),
         "`MANIFEST_NAME`, `CONTINUATIONS_NAME`, `AGENT_INDEX_NAME`, `STORAGE_REFERENCES_NAME`"),
        ("agent folder of the instance `simple_agent`", f"`{gym_files.agent_instance_dir('simple_agent')}`",
         "`agent_instance_dir`"),
    ]
    rows += [(f"header ({n.removeprefix('HEADER_').lower().replace('_', ' ')})", f"`{v}`", f"`{n}`")
             for n, v in headers]
    rows += [(f"feature ({n.removeprefix('FEATURE_').lower().replace('_', ' ')})", f"`{v}`", f"`{n}`")
             for n, v in features]
    out = ["| constant | value | in the code |", "|---|---|---|"]
    out += [f"| {a} | {_cell(b)} | {c} |" for a, b, c in rows]
    return "\n".join(out)


def fingerprint_document() -> bytes:
    """The canonical bytes NeMo-RL hashes for the topology of :data:`TOPOLOGY_CAPABILITIES`."""
    contracts = sorted(topology_contracts(), key=lambda c: (c["participant"]["component"],
                                                            c["participant"]["server_name"],
                                                            c["participant"]["participant_name"]))
    return canonical_json({"schema_version": topology.FINGERPRINT_SCHEMA_VERSION,
                           "participants": [{k: v for k, v in c.items() if k != "features"} for c in contracts]})


def control_topology_block() -> str:
    contracts = topology_contracts()
    hex_digest = topology_fingerprint(contracts)
    live = [msgspec.structs.replace(c, phase="prepared", active_checkpoint_id=_CKPT, deadline_ts=_DEADLINE,
                                    features=[])
            for c in TOPOLOGY_CAPABILITIES]
    same = topology_fingerprint([c.contract(c.name) for c in live])
    if same != hex_digest:
        raise SystemExit("render_spec_schemas: live state or features changed the topology fingerprint")
    names = ", ".join(f"`{c.component}/{c.name}`" for c in TOPOLOGY_CAPABILITIES)
    out = ["| input | value |", "|---|---|",
           f"| topology fingerprint of {names} (NeMo-RL's bare hex) | `{hex_digest}` |",
           f"| the same in a snapshot manifest's `topology_fingerprint` | `{manifest_fingerprint(hex_digest)}` |",
           "| the same with every server `prepared` under an active id, and no features | the same hex |",
           "", "Their contracts (step 1, as `Capabilities.contract()` builds them, features included):", "",
           "```json", msgspec.json.format(msgspec.json.encode(contracts), indent=2).decode(), "```",
           "", "The document hashed (steps 2 to 4; these exact bytes):", "",
           "```json", fingerprint_document().decode(), "```"]
    return "\n".join(out)


def spec_blocks() -> dict[str, str]:
    """The generated blocks of SPEC.md (the format)."""
    out = {f"record:{name}": record_block(name) for name in STRUCTS}
    out["columns:training_rows"] = columns_block("training_rows")
    out["columns:token_capture_rows"] = columns_block("token_capture_rows")
    out["columns:dataplane_rows"] = columns_block("dataplane_rows")
    out["kinds"] = kinds_block()
    out["constants"] = constants_block()
    out["vectors"] = vectors_block()
    out["example:object_entry"] = object_entry_block()
    return out


def control_blocks() -> dict[str, str]:
    """The generated blocks of CONTROL.md (Gym's checkpoint control protocol)."""
    check_messages_documented()
    out = {f"message:{name}": record_block(name) for name in MESSAGES}
    for family in ROUTES:
        out[f"control:routes:{family}"] = control_routes_block(family)
    out["control:phases"] = control_phases_block()
    out["control:errors"] = control_errors_block()
    out["control:constants"] = control_constants_block()
    out["control:topology"] = control_topology_block()
    return out


#: Each document under ``spec/`` with generated blocks, and what fills them.
DOCUMENTS: dict[str, Callable[[], dict[str, str]]] = {"SPEC.md": spec_blocks, "CONTROL.md": control_blocks}


def render(text: str, document: str = "SPEC.md") -> str:
    """``text`` (the content of ``document``) with every generated block refreshed; unknown or
    missing blocks are errors."""
    generated = DOCUMENTS[document]()
    seen: set[str] = set()

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in generated:
            raise SystemExit(f"render_spec_schemas: {document} has an unknown generated block {name!r}")
        seen.add(name)
        return f"{m.group(1)}{generated[name]}\n{m.group(4)}"

    result = _BLOCK_RE.sub(fill, text)
    missing = sorted(set(generated) - seen)
    if missing:
        raise SystemExit(f"render_spec_schemas: {document} lacks the generated blocks {missing}")
    return result


def main(argv: list[str]) -> int:
    stale = []
    for document in DOCUMENTS:
        path = SPEC_DIR / document
        text = path.read_text()
        new = render(text, document)
        if new == text:
            continue
        if "--check" in argv:
            print(f"{path} is out of date: run python spec/render_spec_schemas.py", file=sys.stderr)
            stale.append(path)
        else:
            path.write_text(new)
            print(f"updated {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
