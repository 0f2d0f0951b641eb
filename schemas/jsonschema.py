"""JSON Schema for every persisted record, every control message and every Gym checkpoint file, so
that a service in another language can write its part or speak the control protocol.

``python -m schemas DIR`` writes one ``<Record>.schema.json`` per snapshot record into ``DIR``, one
per control message into ``DIR/control`` and one per Gym checkpoint file into ``DIR/gym``; the
files in ``spec/jsonschema/`` are generated this way (``make schemas``) and a test keeps them equal
to the structs. Every property carries its field's meaning: the field's ``msgspec.Meta``
description, or, for the structs of ``schemas/control.py`` and ``schemas/gym_files.py`` that carry
none, its entry in :data:`FIELD_MEANINGS` (the same text as the tables of ``spec/CONTROL.md``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from schemas import control, gym_files
from schemas.controller import LoaderPlace, RecoveryLedgerRecord, ReplayIndexEntry
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.manifest import CommitRecord, LatestHint, Manifest, PartManifest, PartReceipt, StoreMarker

#: Every persisted record of a snapshot, by the name its schema file carries.
RECORDS: dict[str, Any] = {
    "Manifest": Manifest,
    "PartManifest": PartManifest,
    "CommitRecord": CommitRecord,
    "LatestHint": LatestHint,
    "StoreMarker": StoreMarker,
    "AgentContinuationRoot": AgentContinuationRoot,
    "AgentStateRecord": AgentStateRecord,
    "ModelLedgerEntry": ModelLedgerEntry,
    "TokenIndexEntry": TokenIndexEntry,
    "SessionStateRecord": SessionStateRecord,
    "LoaderPlace": LoaderPlace,
    "ReplayIndexEntry": ReplayIndexEntry,
    "RecoveryLedgerRecord": RecoveryLedgerRecord,
    "PartReceipt": PartReceipt,
}

#: The control protocol's messages (HTTP bodies, not files): every request and reply of
#: CONTROL.md §4 and §10, and the refusal bodies of §1.
CONTROL_MESSAGES: dict[str, Any] = {
    "Capabilities": control.Capabilities,
    "ControlRequest": control.ControlRequest,
    "CheckpointDirRequest": control.CheckpointDirRequest,
    "ModelCommitRequest": control.ModelCommitRequest,
    "AttemptRequest": control.AttemptRequest,
    "CompletionReceipt": control.CompletionReceipt,
    "AcknowledgeCompletedRequest": control.AcknowledgeCompletedRequest,
    "ModelPauseResponse": control.ModelPauseResponse,
    "ModelStatusResponse": control.ModelStatusResponse,
    "ModelResumeResponse": control.ModelResumeResponse,
    "AbortInflightResponse": control.AbortInflightResponse,
    "ModelCommitResponse": control.ModelCommitResponse,
    "ModelRestoreResponse": control.ModelRestoreResponse,
    "AgentStatus": control.AgentStatus,
    "AcknowledgeResponse": control.AcknowledgeResponse,
    "AcknowledgeCompletedResponse": control.AcknowledgeCompletedResponse,
    "AgentCommitResponse": control.AgentCommitResponse,
    "AgentRestoreResponse": control.AgentRestoreResponse,
    "AgentResumeResponse": control.AgentResumeResponse,
    "AgentRetireResponse": control.AgentRetireResponse,
    "DiscardResponse": control.DiscardResponse,
    "ResourcesPrepareResponse": control.ResourcesPrepareResponse,
    "ResourcesCommitResponse": control.ResourcesCommitResponse,
    "ResourcesRestoreResponse": control.ResourcesRestoreResponse,
    "ResourcesResumeResponse": control.ResourcesResumeResponse,
    "ResourcesRetireResponse": control.ResourcesRetireResponse,
    "ResourcesStatusResponse": control.ResourcesStatusResponse,
    "ErrorEnvelope": control.ErrorEnvelope,
    "DetailBody": control.DetailBody,
}

#: The files Gym's participants write into ``checkpoint_dir`` (CONTROL.md §6): manifests, JSON-lines
#: rows and JSON documents. (``continuations.jsonl`` rows are ``AgentContinuationRoot``, a record.)
GYM_FILES: dict[str, Any] = {
    "ArtifactRef": gym_files.ArtifactRef,
    "AgentManifest": gym_files.AgentManifest,
    "AgentIndexEntry": gym_files.AgentIndexEntry,
    "AgentBoundaryRecord": gym_files.AgentBoundaryRecord,
    "LedgerManifest": gym_files.LedgerManifest,
    "ExternalStorageReference": gym_files.ExternalStorageReference,
    "ResourcesManifest": gym_files.ResourcesManifest,
    "ResourceSnapshot": gym_files.ResourceSnapshot,
}

_ROLLOUT = "The rollout."
_ATTEMPT = "The attempt (run) of the rollout: 0 for the first, +1 for each restore."
_DIGEST = "SHA-256 hex of the exact bytes of the participant's `manifest.json`."

#: The meaning of each field of the control and Gym-file structs that has no ``msgspec.Meta``
#: description of its own, by struct name (a description in the struct wins). The renderer and the
#: JSON Schema export both read it; a field with neither fails them (``field_meaning``).
FIELD_MEANINGS: dict[str, dict[str, str]] = {
    "CompletionReceipt": {"rollout_id": "The rollout whose attempt completed.",
                          "attempt_index": "The attempt that completed."},
    "AcknowledgeCompletedRequest": {
        "schema_version": "Control schema version: 1 (may be left out).",
        "executions": "The receipts to acknowledge, each exactly as the server issued it: at least one, no "
                      "(`rollout_id`, `attempt_index`) twice (else 422)."},
    "MultiProcess": {
        "mode": "`single_worker` (one process), `coordinator` (workers behind one coordinating process) or "
                "`unmanaged` (several workers without one, which NeMo-RL refuses).",
        "num_workers": "Number of worker processes; one or none gives `single_worker`."},
    "Capabilities": {
        "component": "Gym's component: `responses_api_models`, `responses_api_agents` or `resources_servers`.",
        "schema_version": "Control schema version the server speaks: 1.",
        "admission_states": "The data-plane admission states the server has; a policy model lists `paused` "
                            "(NeMo-RL's prepare needs it).",
        "checkpoint_mode": "`stateless` (nothing to export), `restart_only` (state it cannot export: its "
                           "unfinished rollouts restart) or `export_restore`.",
        "concurrency_contract": "`stateless`, `serialized_per_session` or `transactional_parallel`.",
        "multi_process": "How the server's processes are organised (required; only `num_workers` has a "
                         "default).",
        "instance_role": "`policy` or `auxiliary` for a model server, which must set it; null for agents and "
                         "resources servers, which must not.",
        "features": "Protocol features the server offers (CONTROL.md §5); they do not enter the fingerprint.",
        "phase": "Live: the fence's phase (CONTROL.md §3).",
        "active_checkpoint_id": "Live: the active checkpoint id, or null.",
        "deadline_ts": "Live: the deadline the active checkpoint's calls carried, or null."},
    "AttemptRef": {"rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT},
    "Workers": {"acknowledged": "Workers that acknowledged (1 for a single worker).",
                "expected": "Workers expected to acknowledge (1 for a single worker)."},
    "WorkerState": {"state": "That worker's admission state.", "inflight": "Model calls in flight on it."},
    "InflightCall": {"rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
                     "plane": "The plane the call came through (header `x-nemo-gym-plane`).",
                     "age_seconds": "Seconds since the call was admitted."},
    "ModelPauseResponse": {
        "state": "Admission state after the call: `paused` when nothing was in flight, else `draining`.",
        "workers": "Worker acknowledgements.",
        "inflight_total": "Model calls in flight.",
        "waiters_total": "Model calls waiting for admission to reopen."},
    "ModelStatusResponse": {
        "checkpoint_id": "The checkpoint id of the query.",
        "state": "Admission state.",
        "per_worker": "Per worker index (`\"0\"` for a single worker): its state and calls in flight.",
        "inflight_total": "Model calls in flight.",
        "waiters_total": "Model calls waiting for admission to reopen.",
        "inflight": "Every call in flight.",
        "tombstones": "Tombstoned attempts: aborted by `abort_inflight`, or fenced by a restore."},
    "ModelResumeResponse": {"state": "`accepting`.", "workers": "Worker acknowledgements.",
                            "released_waiters": "Waiting calls released (Gym answers 0)."},
    "AbortInflightResponse": {"state": "Admission state (the call does not change it).",
                              "aborted_inflight": "Calls of the attempt that were cancelled.",
                              "inflight_total": "Model calls still in flight."},
    "ModelCommitResponse": {
        "rollouts": "Capture keys whose lineage the ledger holds.",
        "rows": "Lineage rows copied.",
        "excluded_tombstoned": "Tombstoned attempts left out.",
        "excluded_inactive": "Attempts the server saw with neither a continuation root nor a tombstone, left "
                             "out.",
        "manifest_digest": _DIGEST,
        "storage_reference_index": "Reference to `storage-references.jsonl`."},
    "ModelRestoreResponse": {
        "rollouts": "Capture keys restored.",
        "rows": "Lineage rows restored.",
        "checkpoint_id": "The checkpoint id the ledger was committed under (the source checkpoint).",
        "tombstones": "The saved tombstones, fenced again.",
        "source_attempts": "The attempts of the saved roots, fenced too: they continue as attempt + 1.",
        "storage_reference_index": "Reference to the `storage-references.jsonl` read."},
    "Execution": {
        "rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
        "generation": "Execution generation: 1 at the attempt's first `/run`, +1 at each re-begin.",
        "state": "`running`, `park_requested`, `parked`, `completed` or `retired`.",
        "parked_boundary_state": "For a parked execution `parked_with_boundary` or `parked_without_boundary`; "
                                 "else null.",
        "boundary_index": "Index of its selected boundary, or null.",
        "turn_index": "Turn of its selected boundary, or null.",
        "boundary_kind": "`pending_model` or `turn_complete`, or null.",
        "resource_state_revisions": "State revisions it depends on, by resources server name.",
        "age_seconds": "Seconds since the execution began.",
        "completion_receipt": "Present only when completed: its receipt (CONTROL.md §7)."},
    "SelectedBoundary": {
        "rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
        "boundary_index": "The boundary's index within the execution.",
        "turn_index": "The boundary's turn.",
        "boundary_kind": "`pending_model` or `turn_complete`.",
        "resource_state_revisions": "State revisions it depends on, by resources server name."},
    "AgentStatus": {
        "checkpoint_id": "Only in a `status` reply: the checkpoint id queried.",
        "state": "`accepting`, or `preparing` once a prepare closed agent admission.",
        "ready_to_commit": "True only if nothing is running or `park_requested`, nothing is parked without a "
                           "boundary, and no completed result is unacknowledged.",
        "running": "Executions running.",
        "parked": "Executions parked.",
        "parked_with_boundary": "Parked executions with a selected boundary.",
        "parked_without_boundary": "Parked executions without one (they block the commit).",
        "completed_unacknowledged": "Completed executions whose result is not acknowledged.",
        "acknowledged_completed": "Completed executions whose result was acknowledged.",
        "active": "Executions the agent tracks (Gym's count).",
        "blocking_attempts": "The executions that keep `ready_to_commit` false.",
        "completed_unacknowledged_attempts": "Completed, unacknowledged executions, each with its "
                                             "`completion_receipt`.",
        "executions": "Every execution the agent tracks.",
        "selected_boundaries": "The boundary selected for each parked execution: what a commit writes."},
    "AcknowledgeResponse": {"acknowledged": "True: the receipt matched and the result is released.",
                            "idempotent": "True when the result had been acknowledged before (a repeat)."},
    "AcknowledgeCompletedResponse": {"acknowledged": "The receipts acknowledged, echoed; NeMo-RL checks the "
                                                     "echo."},
    "AgentCommitResponse": {
        "records": "Boundary records written.",
        "manifest_digest": _DIGEST,
        "continuation_index": "Reference to `continuations.jsonl`, which the model commit is given."},
    "AgentRestoreResponse": {
        "records": "Boundary records restored, each as attempt + 1.",
        "source_checkpoint_id": "The checkpoint id the files were committed under.",
        "continuation_index": "Reference to the `continuations.jsonl` read."},
    "AgentResumeResponse": {"state": "`accepting`.", "released": "Executions released to run again."},
    "AgentRetireResponse": {
        "retired": "True when the execution was retired.",
        "tombstoned": "True when the attempt is tombstoned (a later `/run` of it gets `stale_attempt`).",
        "completed_unacknowledged": "Present, true, when the attempt completed with its result "
                                    "unacknowledged: then it is neither retired nor tombstoned."},
    "DiscardResponse": {"discarded": "True when a restored continuation was dropped (the replacement attempt "
                                     "starts from the beginning)."},
    "InventoryEntry": {"rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
                       "revision": "The session's state revision.",
                       "mutation_receipts": "Mutation receipts the session keeps."},
    "ResourcesPrepareResponse": {"sessions": "Sessions exported.", "state": "`prepared`.",
                                 "inventory": "Each exported session: attempt, revision, receipt count."},
    "ResourcesCommitResponse": {"sessions": "Session files written.", "manifest_digest": _DIGEST},
    "ResourcesRestoreResponse": {"sessions": "Sessions restored, each as attempt + 1.",
                                 "source_checkpoint_id": "The checkpoint id the files were committed under."},
    "ResourcesResumeResponse": {"state": "`accepting`."},
    "ResourcesRetireResponse": {"retired": "True.", "rollout_id": _ROLLOUT,
                                "attempt_index": "The attempt whose session was dropped."},
    "ResourcesStatusResponse": {
        "checkpoint_id": "The checkpoint id of the query.",
        "state": "The fence's phase.",
        "admission_state": "The resources data plane's admission state.",
        "sessions": "Bound sessions.",
        "per_session": "One object per session (Gym's diagnostic shape; informative).",
        "prepared_inventory": "The inventory the prepare exported."},
    "ErrorBody": {"code": "The error code (CONTROL.md §1).",
                  "detail": "A sentence for people; never the token."},
    "ErrorEnvelope": {"error": "The refusal."},
    "DetailBody": {"detail": "401: the string `missing or invalid control-plane bearer token`; 422: a list of "
                             "`{type, loc, msg}` validation errors."},
    # -- Gym's checkpoint files ------------------------------------------------------------------
    "ArtifactRef": {"schema_version": "Artifact reference schema version: 1 (NeMo-RL `498dcedb`'s reference "
                                      "has no such field)."},
    "AgentArchive": {"name": "The archive's file name, `agent-part-NNNNNN.tar`.",
                     "sha256": "SHA-256 hex of the archive's bytes.",
                     "members": "Boundary records in it (at most 512).",
                     "bytes": "The archive's size in bytes."},
    "AgentManifest": {
        "schema_version": "Agent manifest schema version: 2.",
        "checkpoint_id": "The checkpoint the files were committed under.",
        "instance_name": "The agent instance's name (its capability `name`), or null (files directly in "
                         "`agent/`).",
        "archives": "The archives, in order.",
        "record_index": "Reference to `agent-index.jsonl`.",
        "records": "Boundary records across the archives.",
        "continuation_index": "Reference to `continuations.jsonl`."},
    "AgentIndexEntry": {
        "rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
        "archive": "The archive holding the record.",
        "member": "The member's name, `<rollout_id>.a<attempt_index>.json`.",
        "sha256": "SHA-256 hex of the member's bytes.",
        "bytes": "The member's size in bytes."},
    "PendingModel": {
        "model_call_id": "The model call whose answer the boundary holds.",
        "response": "That answer.",
        "model_server_cookies": "Cookies the model server set.",
        "usage": "The call's token usage, or null.",
        "pending_action_cursor": "Actions of the answer already carried out.",
        "resource_request_id": "The resources request id of the action in progress, or null."},
    "AgentBoundaryRecord": {
        "schema_version": "Record schema version: 1 or 2 (default 2).",
        "rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
        "boundary_index": "Index of the boundary within the execution.",
        "turn_index": "The boundary's turn; null reads as `boundary_index`.",
        "boundary_kind": "`turn_complete` (a turn ended) or `pending_model` (a model answer awaits its "
                         "actions).",
        "pending_model": "Required exactly when `boundary_kind` is `pending_model`.",
        "output_items": "The execution's output items so far.",
        "usage": "Accumulated token usage, or null.",
        "last_committed_model_call_id": "The last model call the boundary includes, or null.",
        "resource_state_revisions": "State revisions it depends on, by resources server name.",
        "agent_state": "The agent's own state at the boundary (opaque JSON).",
        "created_at": "Unix seconds at which the record was made (Gym's default: when it is built)."},
    "LedgerRollout": {"files": "Each lineage file's name and SHA-256 hex.", "rows": "Lineage rows.",
                      "bytes": "Bytes of the lineage files."},
    "AttemptEntry": {"rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT},
    "LedgerManifest": {
        "schema_version": "Ledger manifest schema version: 2.",
        "checkpoint_id": "The checkpoint the files were committed under.",
        "server_name": "The model server's name (its capability `name`).",
        "rollouts": "Per capture key: its lineage files, rows and bytes.",
        "continuation_roots_sha256": "SHA-256 hex of the continuation roots sorted by (`capture_key`, "
                                     "`last_committed_model_call_id`), as a JSON list with sorted keys and "
                                     "compact separators.",
        "continuation_roots": "How many roots.",
        "excluded_inactive": "Attempts the server saw with neither a root nor a tombstone.",
        "storage_reference_index": "Reference to `storage-references.jsonl`.",
        "tombstones": "Tombstoned attempts.",
        "source_attempts": "The attempts of the roots."},
    "ExternalStorageReference": {
        "schema_version": "Row schema version: 1.",
        "capture_key": "The root's capture key.",
        "boundary_model_call_id": "The root's last committed model call.",
        "kind": "`token_capture_staging` (default) or `generation_prefix_cut`.",
        "key": "A staging key of that call's lineage row (`staging_chain` and `staging_key`)."},
    "MutationReceipt": {
        "request_id": "The request id (header `x-nemo-gym-resource-request-id`), 1-512 characters.",
        "expected_revision": "The revision the request expected, or null.",
        "input_digest": "SHA-256 hex of the request's input.",
        "status": "The HTTP status answered.",
        "headers": "The answer's headers, as `[name, value]` pairs.",
        "body_base64": "The answer's body, base64.",
        "resulting_revision": "The session's revision after the mutation."},
    "ResourceSnapshot": {
        "schema_version": "Snapshot schema version: 1 or 2 (default 2).",
        "rollout_id": _ROLLOUT, "attempt_index": _ATTEMPT,
        "state_revision": "The session's state revision.",
        "state": "The session's exported state (opaque JSON).",
        "mutation_receipts": "Receipts of its mutations: a repeated request id gets its recorded answer, "
                             "after a restore too.",
        "created_at": "Unix seconds at which it was exported."},
    "ResourcesManifest": {
        "schema_version": "Resources manifest schema version: 2.",
        "checkpoint_id": "The checkpoint the files were committed under.",
        "server_name": "The resources server's name (its capability `name`).",
        "files": "Each session file's name and SHA-256 hex."},
}


def _meta_description(t: Any) -> str | None:
    return (t.extra_json_schema or {}).get("description") if isinstance(t, mi.Metadata) else None


def field_meaning(struct: type, field: mi.Field) -> str | None:
    """A field's meaning: its ``msgspec.Meta`` description, else its :data:`FIELD_MEANINGS` entry."""
    return _meta_description(field.type) or FIELD_MEANINGS.get(struct.__name__, {}).get(field.name)


def _all_structs(typ: Any) -> dict[str, type]:
    """Every struct ``typ`` contains (itself included), by name."""
    out: dict[str, type] = {}

    def walk(t: Any) -> None:
        if isinstance(t, mi.StructType):
            if t.cls.__name__ in out:
                return
            out[t.cls.__name__] = t.cls
            for f in t.fields:
                walk(f.type)
        elif isinstance(t, mi.Metadata):
            walk(t.type)
        elif isinstance(t, mi.UnionType):
            for m in t.types:
                walk(m)
        elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            walk(t.item_type)
        elif isinstance(t, mi.TupleType):
            for m in t.item_types:
                walk(m)
        elif isinstance(t, mi.DictType):
            walk(t.value_type)

    walk(mi.type_info(typ))
    return out


def _describe(schema: dict[str, Any], typ: Any) -> None:
    """Give every property of every struct in ``schema`` its meaning (descriptions already there stay)."""
    structs = _all_structs(typ)
    for name, definition in schema.get("$defs", {}).items():
        cls = structs.get(name)
        if cls is None:
            continue
        fields = {f.encode_name: f for f in mi.type_info(cls).fields}
        for prop_name, prop in definition.get("properties", {}).items():
            if "description" not in prop and prop_name in fields:
                meaning = field_meaning(cls, fields[prop_name])
                if meaning:
                    prop["description"] = meaning


def _source(name: str) -> tuple[Any, str, str]:
    if name in RECORDS:
        return (RECORDS[name], f"snapformat/1/{name}.schema.json",
                "Specified in spec/SPEC.md; section numbers (§) are SPEC's, 'CONTROL §' are spec/CONTROL.md's.")
    if name in CONTROL_MESSAGES:
        return (CONTROL_MESSAGES[name], f"snapformat/1/control/{name}.schema.json",
                "Specified in spec/CONTROL.md; section numbers (§) are CONTROL's, 'SPEC §' are spec/SPEC.md's.")
    return (GYM_FILES[name], f"snapformat/1/gym/{name}.schema.json",
            "Specified in spec/CONTROL.md §6 (Gym's checkpoint files); section numbers (§) are CONTROL's.")


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one record, control message or Gym checkpoint file."""
    typ, sid, comment = _source(name)
    schema = msgspec.json.schema(typ)
    _describe(schema, typ)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = sid
    schema["$comment"] = comment
    return schema


def render(name: str) -> str:
    return json.dumps(json_schema(name), indent=2, sort_keys=True) + "\n"


#: Each exported folder (relative to the export directory) and the schemas it holds.
FOLDERS: dict[str, dict[str, Any]] = {".": RECORDS, "control": CONTROL_MESSAGES, "gym": GYM_FILES}


def export(directory: str | Path) -> list[Path]:
    """Write every schema into ``directory`` (and its ``control/`` and ``gym/`` folders), removing
    schema files there that no longer name a struct; returns the files written."""
    out = Path(directory)
    written = []
    for sub, names in FOLDERS.items():
        folder = out / sub
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.schema.json"):
            if stale.name.removesuffix(".schema.json") not in names:
                stale.unlink()
        for name in names:
            path = folder / f"{name}.schema.json"
            path.write_text(render(name))
            written.append(path)
    return written
