"""Fill the generated blocks of ``spec/SPEC.md`` from the code, so the structs stay the one source.

A generated block sits between two HTML comments and is replaced whole::

    <!-- BEGIN GENERATED record:FileEntry -->
    ...
    <!-- END GENERATED record:FileEntry -->

Block names: ``record:<Struct>`` (field table from ``msgspec.inspect`` plus a JSON example built
from the struct, so it always decodes), ``columns:<row kind>`` (from the Arrow schemas in
``schemas/rows.py``), ``kinds`` (every ``FileKind``), ``constants`` and ``vectors`` (values
computed by the code). Only the "meaning" column is written here by hand; a struct field or a
column without a meaning fails the run, so a new field cannot reach the spec undocumented.

    python spec/render_spec_schemas.py          # rewrite spec/SPEC.md in place
    python spec/render_spec_schemas.py --check  # exit 1 if SPEC.md is out of date

``tests/spec/test_spec_in_sync.py`` runs the check.
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pyarrow as pa

from schemas import identity, version
from schemas.controller import AckOwed, LoaderPlace, PromptGroup, ReplayIndexEntry, RolloutAttempt
from schemas.gym_records import (
    AgentContinuationRoot, AgentStateRecord, ModelLedgerEntry, SessionStateRecord, TokenIndexEntry,
)
from schemas.manifest import (
    CommitRecord, FileEntry, FileKind, GymCommit, LatestHint, Manifest, ParentRef, PartManifest,
    ParticipantCommit, PartReceipt, StoreMarker,
)
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.topology import topology_fingerprint
from snapformat import jsonl, layout, reader, retention
from snapformat.checksum import checksum_bytes
from snapformat.kinds import RECORD_TYPES, storage_of

SPEC = Path(__file__).resolve().parent / "SPEC.md"
_BLOCK_RE = re.compile(
    r"(<!-- BEGIN GENERATED (?P<name>[A-Za-z0-9_:]+) -->\n)(?P<body>.*?)(<!-- END GENERATED (?P=name) -->)",
    re.DOTALL,
)

# --------------------------------------------------------------------------------------------
# Meanings (the only hand-written part of the generated tables)
# --------------------------------------------------------------------------------------------

_SV = "Version of this record's schema; 1 in format 1.0. Readers refuse a value above the one they understand."

MEANINGS: dict[str, dict[str, str]] = {
    "StoreMarker": {
        "format": "Always `snapformat-store`: says that this folder or prefix is a snapshot store.",
        "format_version": "Format version of the store's layout (`<major>.<minor>`).",
    },
    "CommitRecord": {
        "format_version": "Format version the publisher wrote (`<major>.<minor>`).",
        "sequence": "The snapshot's sequence number; MUST equal the sequence encoded in this file's name.",
        "snapshot_id": "Folder of the snapshot under `snapshots/`; the manifest read from there MUST carry the same id.",
        "manifest_size": "Exact size in bytes of `snapshots/<snapshot_id>/manifest.json`.",
        "manifest_checksum": "Checksum of the bytes of `manifest.json`.",
        "committed_at": "Unix seconds at which the publisher sealed the manifest (equal to the manifest's `committed_at`).",
    },
    "LatestHint": {
        "sequence": "A recently published sequence (normally the newest). Advisory only.",
        "snapshot_id": "The snapshot id of that sequence (informative).",
    },
    "Manifest": {
        "format_version": "Format version the publisher wrote. Readers refuse another major version.",
        "required_features": "Features a reader MUST implement to read this snapshot correctly (see Features). Empty in 1.0.",
        "snapshot_id": "This snapshot's id (its folder name).",
        "sequence": "This snapshot's sequence number (>= 1).",
        "created_at": "Unix seconds at which the draft was begun.",
        "committed_at": "Unix seconds at which the publisher sealed the manifest to commit it.",
        "files": "Every file of the snapshot, part manifests included. A file not listed here is not part of the snapshot.",
        "gym_commit": "Gym's commit result for this snapshot, or null when no Gym took part.",
        "topology_fingerprint": "Fingerprint of the participants that took the snapshot, or null when none was recorded.",
        "parent": "The newest committed snapshot when this draft was begun, or null for the first snapshot of a store. Informative: the parent may since have been deleted (or not copied along).",
        "timings_s": "Informative durations in seconds (e.g. of the pause, of each phase). Readers MUST NOT depend on them.",
        "producer": "Informative name and version of the software that published the snapshot.",
    },
    "FileEntry": {
        "path": "Location relative to the snapshot folder: `/`-separated, every segment a safe name (see Identifiers and paths).",
        "kind": "What the file holds (see Parts). Readers ignore kinds they do not know, except that verification still checks their bytes.",
        "size": "Exact size in bytes of the file as stored.",
        "checksum": "Checksum over the bytes as stored (after any compression).",
        "records": "Rows (row parts), lines (JSON-lines parts) or 1 (JSON parts).",
        "compression": "Whole-file compression: `none`, or `zstd` (one zstd frame over a JSON-lines file). MUST be `none` for row and JSON parts.",
        "content_size": "Uncompressed size in bytes; REQUIRED (non-null) when `compression` is `zstd`, null otherwise.",
        "batches": "Number of Arrow record batches in a row part; null for other parts.",
        "writer": "Label of the participant that wrote the file (by default its part prefix). Informative.",
    },
    "ParentRef": {
        "snapshot_id": "The parent snapshot's id.",
        "sequence": "The parent snapshot's sequence number.",
    },
    "GymCommit": {
        "checkpoint_id": "The checkpoint id Gym's control calls carried for this snapshot.",
        "participants": "Each Gym participant's commit, in commit order (agents, then models, then resources).",
    },
    "ParticipantCommit": {
        "component": "`agent`, `model` or `resource`.",
        "name": "The participant's name (a safe name).",
        "part_prefix": "Prefix of the part it wrote, or null for a stateless participant that wrote nothing.",
        "part_manifest_checksum": "Checksum of its `part-manifest.json`, as it reported in its commit result; null when `part_prefix` is null.",
        "payload": "The participant's own commit payload (opaque JSON object, kept verbatim).",
    },
    "PartManifest": {
        "format_version": "Format version the participant wrote.",
        "snapshot_id": "The draft's snapshot id; MUST equal the folder the part lies in.",
        "prefix": "The part's prefix, relative to the snapshot folder.",
        "writer": "Label of the participant (e.g. `agent:agent0`); copied into each file entry's `writer`.",
        "files": "Every file of the part except `part-manifest.json` itself; each `path` MUST lie under `prefix`.",
        "written_at": "Unix seconds at which the part was closed.",
    },
    "PartReceipt": {
        "prefix": "The part's prefix.",
        "writer": "The participant's label, as in its part manifest.",
        "part_manifest_checksum": "Checksum of the bytes of `<prefix>/part-manifest.json`; the publisher refuses a part manifest with another checksum.",
    },
    "AgentContinuationRoot": {
        "schema_version": _SV,
        "rollout_id": "The rollout (Gym's rollout id rule).",
        "attempt_index": "The run of the rollout that was parked (0 for the first run).",
        "capture_key": "Gym's capture key of that run: `rollout_id`, or `<rollout_id>-a<N>` with 1 <= N <= `attempt_index`.",
        "last_committed_model_call_id": "The model call that ended the rollout's last finished turn; on restore the rollout continues after it. Null when it was parked before its first call.",
        "resource_state_revisions": "For each resource server the rollout depends on, the state revision it saw; null when it depends on none.",
    },
    "AgentStateRecord": {
        "schema_version": _SV,
        "rollout_id": "The rollout.",
        "attempt_index": "The run this state belongs to.",
        "capture_key": "Gym's capture key of that run (same rule as in continuations).",
        "status": "`parked` (stopped at a turn end, to be continued) or `finished_unacked` (finished, its result not yet acknowledged).",
        "turn_index": "Number of turns finished, i.e. the 0-based index of the turn to run next.",
        "state": "The agent's own state of the rollout (conversation so far, counters...): opaque JSON.",
        "restart_only": "Restart-only resources the rollout used; such a rollout is discarded on restore and starts over.",
    },
    "ModelLedgerEntry": {
        "schema_version": _SV,
        "rollout_id": "The rollout that made the call.",
        "attempt_index": "The run that made the call.",
        "capture_key": "Gym's capture key of that run.",
        "model_call_id": "The call's id, unique within its capture key.",
        "parent_call_id": "The previous committed call of the same capture key; null for the first.",
        "turn_index": "0-based turn in which the call was made.",
        "model": "Name of the model that answered (empty when unknown).",
        "created_at": "Unix seconds of the call (0.0 when unknown).",
    },
    "TokenIndexEntry": {
        "schema_version": _SV,
        "capture_key": "Capture key of the call whose tokens are indexed.",
        "model_call_id": "The model call.",
        "file": "Path, relative to the snapshot folder, of a `token_capture_rows` file of this snapshot.",
        "batch": "0-based record batch of that Arrow file.",
        "row_start": "First row, 0-based within the batch.",
        "row_count": "Number of rows (>= 1); every one of them MUST carry this `capture_key` and `model_call_id`.",
    },
    "SessionStateRecord": {
        "schema_version": _SV,
        "session_id": "The resource session's id, unique within its resource server.",
        "resource": "Name of the resource server (tool) that owns the session; matches the keys of `resource_state_revisions`.",
        "state_revision": "State revision the exported state is at.",
        "rollout_id": "The rollout that owns the session, or null for a session not tied to one rollout.",
        "state": "The session's exported state: opaque JSON.",
    },
    "LoaderPlace": {
        "schema_version": _SV,
        "epoch": "Current epoch of the prompt loader (0-based).",
        "consumed": "Prompts of this epoch whose groups were dispatched; the next prompt handed out is `order[consumed]` of this epoch's order.",
        "seed": "Seed from which the loader derives each epoch's order.",
        "dataset_size": "Number of prompts in the dataset when known; a restore with another size is a different dataset.",
        "extra": "Loader-specific values (opaque JSON object).",
    },
    "ReplayIndexEntry": {
        "schema_version": _SV,
        "key": "The sample's key in the data plane (TQ); the `key` column of a training row.",
        "partition_id": "The data-plane partition holding the sample.",
        "rollout_id": "The rollout the sample came from.",
        "attempt_index": "The run of that rollout that produced it.",
        "group_id": "The prompt group of that rollout.",
        "status": "`ready` (not yet used), `claimed_for_training` (taken by a training step not yet applied) or `applied_uncheckpointed` (applied by a step whose weights are not yet checkpointed).",
    },
    "PromptGroup": {
        "record": "Record type tag: `prompt_group`.",
        "schema_version": _SV,
        "group_id": "The prompt group (one prompt, several rollouts).",
        "prompt_index": "Index of the prompt in the loader's order.",
        "state": "The group's state in the recovery ledger.",
        "rollout_ids": "The group's rollouts.",
    },
    "RolloutAttempt": {
        "record": "Record type tag: `rollout_attempt`.",
        "schema_version": _SV,
        "rollout_id": "The rollout.",
        "group_id": "Its prompt group.",
        "attempt_index": "The run number.",
        "state": "The run's state.",
    },
    "AckOwed": {
        "record": "Record type tag: `ack_owed`.",
        "schema_version": _SV,
        "rollout_id": "The rollout whose finished result is stored.",
        "attempt_index": "The run that produced it.",
        "result_key": "The result's key in the data plane. Its acknowledgement to Gym is not confirmed yet, so the controller sends it again after a restore (Gym answers a repeated acknowledgement idempotently).",
    },
}

COLUMN_MEANINGS: dict[str, dict[str, str]] = {
    "training_rows": {
        "key": "The sample's key in the data plane (TQ).",
        "partition_id": "The data-plane partition holding the sample.",
        "rollout_id": "The rollout the sample came from (Gym's rollout id rule).",
        "attempt_index": "The run of that rollout that produced it (>= 0).",
        "input_ids": "The whole token sequence of the sample (prompt and generation).",
        "input_lengths": "Number of valid tokens in `input_ids`.",
        "generation_logprobs": "Per-token log probabilities under the policy that generated the sample.",
        "prev_logprobs": "Per-token log probabilities under the previous policy.",
        "reference_policy_logprobs": "Per-token log probabilities under the reference policy.",
        "advantages": "Per-token advantages.",
        "token_mask": "Per token: 1 where the loss applies, 0 elsewhere.",
        "sample_mask": "Weight of the whole sample (0 drops it from the loss).",
    },
    "token_capture_rows": {
        "schema_version": "Gym's `TokenEntry` schema version of the row; 1 in format 1.0.",
        "rollout_id": "The rollout that made the model call.",
        "attempt_index": "The run that made it (>= 0).",
        "capture_key": "MUST equal the capture key of (`rollout_id`, `attempt_index`).",
        "model_call_id": "The model call; one call may span several consecutive rows of one batch.",
        "model": "Name of the model that answered.",
        "prompt_token_ids": "Prompt token ids (only the new ones when `prompt_is_delta` is true).",
        "generation_token_ids": "Generated token ids.",
        "generation_log_probs": "Log probability of each generated token; same length as `generation_token_ids`.",
        "routed_experts": "Mixture-of-experts routing per generated token, when captured.",
        "output_items": "The call's output items as JSON text, as Gym holds them.",
        "token_item_index": "Index of the output item these tokens belong to.",
        "response_id": "Id of the model response.",
        "created_at": "Unix seconds of the call.",
        "parent_call_id": "Previous call of the same capture key; null for the first.",
        "cum_len": "Length of the cumulative token sequence up to and including this call.",
        "digest": "Hex SHA-256 over the cumulative token sequence, as Gym computes it; opaque to this format.",
        "parent_resolution": "`root`, `resolved` or `unresolved`: how the parent call was found.",
        "prompt_is_delta": "True when `prompt_token_ids` holds only the tokens appended since the parent call.",
    },
}

KIND_NOTES: dict[str, tuple[str, str, str]] = {
    # kind: (written by, conventional file name, section)
    "training_rows": ("TQ adapter", "`tq/training.arrow`", "Training rows"),
    "token_capture_rows": ("policy model server (or TQ)", "`gym/model/<name>/tokens.arrow`", "Token-capture rows"),
    "continuations": ("agent server", "`gym/agent/<name>/continuations.jsonl[.zst]`", "Continuations"),
    "agent_state": ("agent server", "`gym/agent/<name>/agent_state.jsonl[.zst]`", "Agent state"),
    "model_ledger": ("policy model server", "`gym/model/<name>/ledger.jsonl[.zst]`", "Model ledger"),
    "token_index": ("policy model server", "`gym/model/<name>/token_index.jsonl[.zst]`", "Token-storage index"),
    "session_state": ("resource server", "`gym/resource/<name>/sessions.jsonl[.zst]`", "Session state"),
    "loader_place": ("Single Controller", "`controller/loader.json`", "Loader place"),
    "replay_index": ("Single Controller", "`controller/replay_index.jsonl[.zst]`", "Replay index"),
    "recovery_ledger": ("Single Controller", "`controller/recovery_ledger.jsonl[.zst]`", "Recovery ledger"),
    "part_manifest": ("every participant", "`<prefix>/part-manifest.json`", "Part manifest"),
}

# --------------------------------------------------------------------------------------------
# Examples: built from the structs, so they always decode
# --------------------------------------------------------------------------------------------

_X1 = "xxh128:" + "0" * 31 + "1"


def _ck(text: str) -> str:
    return checksum_bytes(text.encode())


def examples() -> dict[str, Any]:
    sid = "snap-0000000002-4f1c9a7e"
    files = [
        FileEntry(path="gym/model/policy0/tokens.arrow", kind="token_capture_rows", size=28714,
                  checksum=_ck("tokens"), records=30, batches=1, writer="model:policy0"),
        FileEntry(path="gym/model/policy0/ledger.jsonl.zst", kind="model_ledger", size=18233,
                  checksum=_ck("ledger"), records=4096, compression="zstd", content_size=801234,
                  writer="model:policy0"),
        FileEntry(path="gym/model/policy0/part-manifest.json", kind="part_manifest", size=1013,
                  checksum=_ck("part"), records=1, writer="model:policy0"),
    ]
    gym = GymCommit(checkpoint_id="ckpt-2", participants=[
        ParticipantCommit(component="model", name="policy0", part_prefix="gym/model/policy0",
                          part_manifest_checksum=_ck("part"), payload={"rollouts": 9}),
    ])
    return {
        "StoreMarker": StoreMarker(),
        "CommitRecord": CommitRecord(format_version="1.0", sequence=2, snapshot_id=sid, manifest_size=5209,
                                     manifest_checksum=_ck("manifest"), committed_at=1796000123.25),
        "LatestHint": LatestHint(sequence=2, snapshot_id=sid),
        "Manifest": Manifest(format_version="1.0", snapshot_id=sid, sequence=2, created_at=1796000120.5,
                             committed_at=1796000123.25, files=files, gym_commit=gym,
                             topology_fingerprint="sha256:" + "ab" * 32,
                             parent=ParentRef(snapshot_id="snap-0000000001-0b3d2e11", sequence=1),
                             timings_s={"pause": 2.41, "publish": 0.02}, producer="snapformat 0.1.0"),
        "FileEntry": files[1],
        "ParentRef": ParentRef(snapshot_id="snap-0000000001-0b3d2e11", sequence=1),
        "GymCommit": gym,
        "ParticipantCommit": gym.participants[0],
        "PartManifest": PartManifest(format_version="1.0", snapshot_id=sid, prefix="gym/model/policy0",
                                     writer="model:policy0", files=files[:2], written_at=1796000122.0),
        "PartReceipt": PartReceipt(prefix="gym/model/policy0", writer="model:policy0",
                                   part_manifest_checksum=_ck("part")),
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
            session_id="s-p7_g2", resource="tools", state_revision=3, rollout_id="p7_g2",
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


#: Records stored one per line: their example is shown as the exact line.
LINE_RECORDS = {
    "AgentContinuationRoot", "AgentStateRecord", "ModelLedgerEntry", "TokenIndexEntry", "SessionStateRecord",
    "ReplayIndexEntry", "PromptGroup", "RolloutAttempt", "AckOwed", "LatestHint", "PartReceipt",
}

STRUCTS: dict[str, type] = {
    "StoreMarker": StoreMarker, "CommitRecord": CommitRecord, "LatestHint": LatestHint, "Manifest": Manifest,
    "FileEntry": FileEntry, "ParentRef": ParentRef, "GymCommit": GymCommit, "ParticipantCommit": ParticipantCommit,
    "PartManifest": PartManifest, "PartReceipt": PartReceipt, "AgentContinuationRoot": AgentContinuationRoot,
    "AgentStateRecord": AgentStateRecord, "ModelLedgerEntry": ModelLedgerEntry, "TokenIndexEntry": TokenIndexEntry,
    "SessionStateRecord": SessionStateRecord, "LoaderPlace": LoaderPlace, "ReplayIndexEntry": ReplayIndexEntry,
    "PromptGroup": PromptGroup, "RolloutAttempt": RolloutAttempt, "AckOwed": AckOwed,
}

# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


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
            bits.append(f"matching `{t.pattern}`")
        return "string" + (f" ({', '.join(bits)})" if bits else "")
    if isinstance(t, mi.IntType):
        bits = [f"{op} {v}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
        return "integer" + (f" {' '.join(bits)}" if bits else "")
    if isinstance(t, mi.FloatType):
        return "number"
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
    if isinstance(t, mi.StructType):
        return f"`{t.cls.__name__}` object"
    raise TypeError(f"no rendering for {t!r}")


def _default(field: mi.Field) -> str:
    if field.default is not mi.NODEFAULT:
        return msgspec.json.encode(field.default).decode()
    if field.default_factory is not mi.NODEFAULT:
        return msgspec.json.encode(field.default_factory()).decode()
    return ""


def record_table(name: str) -> str:
    info = mi.type_info(STRUCTS[name])
    meanings = MEANINGS.get(name, {})
    rows = []
    if info.tag_field is not None:
        rows.append((info.tag_field, f'`"{info.tag}"`', "yes", meanings.get(info.tag_field)))
    for f in info.fields:
        required = "yes" if f.required else f"no (default `{_default(f)}`)"
        rows.append((f.encode_name, render_type(f.type), required, meanings.get(f.encode_name)))
    documented = {r[0] for r in rows}
    missing = [r[0] for r in rows if not r[3]]
    extra = sorted(set(meanings) - documented)
    if missing or extra:
        raise SystemExit(f"render_spec_schemas: {name}: fields without a meaning {missing}, meanings without a field {extra}")
    out = ["| field | type | required | meaning |", "|---|---|---|---|"]
    out += [f"| `{f}` | {_cell(t)} | {_cell(r)} | {_cell(m)} |" for f, t, r, m in rows]
    return "\n".join(out)


def record_example(name: str) -> str:
    value = examples()[name]
    assert type(value) is STRUCTS[name]
    raw = msgspec.json.encode(value)
    msgspec.json.decode(raw, type=STRUCTS[name])  # the example is valid by construction; keep it so
    text = raw.decode() if name in LINE_RECORDS else msgspec.json.format(raw, indent=2).decode()
    return f"```json\n{text}\n```"


def record_block(name: str) -> str:
    return f"{record_table(name)}\n\nExample:\n\n{record_example(name)}"


def _arrow_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return f"list<{_arrow_type(t.value_type)}>"
    return {"string": "utf8", "float": "float32", "double": "float64"}.get(str(t), str(t))


def columns_block(kind: str) -> str:
    schema = {"training_rows": TRAINING_SCHEMA, "token_capture_rows": TOKEN_CAPTURE_SCHEMA}[kind]
    meanings = COLUMN_MEANINGS[kind]
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
    for kind in typing.get_args(FileKind):
        storage = storage_of(kind)
        if storage == "rows":
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
    return field.type.max_length


def constants_block() -> str:
    rows = [
        ("format version written", f"`{version.FORMAT_VERSION}`", "`schemas/version.py` `FORMAT_VERSION`"),
        ("highest record `schema_version` read", str(version.RECORD_SCHEMA_VERSION), "`RECORD_SCHEMA_VERSION`"),
        ("features known to this version", ", ".join(sorted(version.KNOWN_FEATURES)) or "none", "`KNOWN_FEATURES`"),
        ("features reserved", ", ".join(f"`{f}`" for f in sorted(version.RESERVED_FEATURES)), "`RESERVED_FEATURES`"),
        ("JSON-lines zstd threshold", f"{jsonl.ZSTD_THRESHOLD:,} bytes of content (256 KiB)", "`ZSTD_THRESHOLD`"),
        ("zstd level used by the reference writer", str(jsonl.ZSTD_LEVEL), "`ZSTD_LEVEL`"),
        ("longest JSON line", f"{jsonl.MAX_LINE:,} bytes", "`MAX_LINE`"),
        ("largest manifest", f"{reader.MAX_MANIFEST_BYTES:,} bytes", "`MAX_MANIFEST_BYTES`"),
        ("most file entries in a manifest", f"{_max_files():,}", "`Manifest.files`"),
        ("largest JSON part (loader place)", f"{reader.MAX_JSON_PART_BYTES:,} bytes", "`MAX_JSON_PART_BYTES`"),
        ("largest commit record, store marker", f"{64 * 1024:,} bytes", "`discovery.read_commit`"),
        ("longest safe name, rollout id", f"{identity.MAX_NAME_LEN} characters", "`MAX_NAME_LEN`"),
        ("longest relative path", f"{identity.MAX_PATH_LEN} characters", "`MAX_PATH_LEN`"),
        ("deepest relative path", f"{identity.MAX_PATH_DEPTH} segments", "`MAX_PATH_DEPTH`"),
        ("default draft age before GC sweeps a draft", f"{retention.DEFAULT_DRAFT_MIN_AGE_S:,.0f} s (6 h)", "`DEFAULT_DRAFT_MIN_AGE_S`"),
    ]
    out = ["| constant | value | in the code |", "|---|---|---|"]
    out += [f"| {a} | {_cell(b)} | {c} |" for a, b, c in rows]
    return "\n".join(out)


def vectors_block() -> str:
    from snapformat.example import CONTRACTS

    rows = [
        ("capture key of (`p7_g2`, 0)", f"`{identity.capture_key('p7_g2', 0)}`"),
        ("capture key of (`p7_g2`, 1)", f"`{identity.capture_key('p7_g2', 1)}`"),
        ("commit file of sequence 1", f"`{layout.commit_key(1)}`"),
        ("commit file of sequence 2", f"`{layout.commit_key(2)}`"),
        ("commit file of sequence 10000000000", f"`{layout.commit_key(10_000_000_000)}`"),
        ("snapshot id of sequence 2 (random part `4f1c9a7e`)", f"`{layout.new_snapshot_id(2)[:-8]}4f1c9a7e`"),
        ("checksum of the empty file", f"`{checksum_bytes(b'')}`"),
        ("checksum of the 11 bytes `snapformat\\n`", f"`{checksum_bytes(b'snapformat' + bytes([10]))}`"),
        ("`sha256` checksum of the same 11 bytes", f"`{checksum_bytes(b'snapformat' + bytes([10]), 'sha256')}`"),
        ("topology fingerprint of the example contracts below", f"`{topology_fingerprint(CONTRACTS)}`"),
    ]
    out = ["| input | value |", "|---|---|"]
    out += [f"| {a} | {_cell(b)} |" for a, b in rows]
    from schemas.topology import canonical_json

    canonical = canonical_json(sorted(CONTRACTS, key=lambda c: (c["component"], c["name"])))
    out += ["", "The example contracts, in canonical form (these exact bytes are hashed):", "",
            "```json", canonical.decode(), "```"]
    return "\n".join(out)


def blocks() -> dict[str, str]:
    out = {f"record:{name}": record_block(name) for name in STRUCTS}
    out["columns:training_rows"] = columns_block("training_rows")
    out["columns:token_capture_rows"] = columns_block("token_capture_rows")
    out["kinds"] = kinds_block()
    out["constants"] = constants_block()
    out["vectors"] = vectors_block()
    return out


def render(text: str) -> str:
    """``text`` with every generated block refreshed; unknown or missing blocks are errors."""
    generated = blocks()
    seen: set[str] = set()

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in generated:
            raise SystemExit(f"render_spec_schemas: SPEC.md has an unknown generated block {name!r}")
        seen.add(name)
        return f"{m.group(1)}{generated[name]}\n{m.group(4)}"

    result = _BLOCK_RE.sub(fill, text)
    missing = sorted(set(generated) - seen)
    if missing:
        raise SystemExit(f"render_spec_schemas: SPEC.md lacks the generated blocks {missing}")
    return result


def main(argv: list[str]) -> int:
    text = SPEC.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{SPEC} is out of date: run python spec/render_spec_schemas.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        SPEC.write_text(new)
        print(f"updated {SPEC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
