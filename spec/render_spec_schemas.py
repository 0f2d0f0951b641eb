"""Fill the generated blocks of ``spec/SPEC.md`` and ``spec/CONTROL.md`` from the code, so the
structs stay the one source.

A generated block sits between two HTML comments and is replaced whole::

    <!-- BEGIN GENERATED record:FileEntry -->
    ...
    <!-- END GENERATED record:FileEntry -->

Block names in SPEC.md: ``record:<Struct>`` (field table from ``msgspec.inspect`` plus a JSON
example built from the struct, so it always decodes), ``columns:<row kind>`` (from the Arrow
schemas and ``COLUMN_DESCRIPTIONS`` of ``schemas/rows.py``), ``kinds`` (every ``FileKind``),
``constants`` and ``vectors`` (values computed by the code). Block names in CONTROL.md (the
checkpoint control protocol): ``message:<Struct>`` (the same as ``record:`` for the structs of
``schemas/control.py``) and ``control:<what>`` (routes, phases, error codes, constants and topology
vector).

Every field's meaning is its ``msgspec.Meta(description=...)`` in ``schemas/`` (so the exported JSON
Schemas carry it too), every column's its entry in ``COLUMN_DESCRIPTIONS``; only the meanings of
phases, error codes, routes and file kinds are written here. A field, a column, a phase, an error
code or a route without a meaning fails the run, so none of them can reach the spec undocumented
(routes are also checked against the ones ``gymkit`` registers).

    python spec/render_spec_schemas.py          # rewrite spec/SPEC.md and spec/CONTROL.md in place
    python spec/render_spec_schemas.py --check  # exit 1 if either is out of date

``tests/spec/test_spec_in_sync.py`` runs the check.
"""

from __future__ import annotations

import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pyarrow as pa

from schemas import control, identity, version
from schemas.control import (
    AcknowledgeRequest,
    Capabilities,
    CommitRequest,
    CommitResponse,
    Concurrency,
    ControlError,
    ControlRequest,
    DiscardRequest,
    PhaseResponse,
    RestoreRequest,
    RestoreResponse,
    RolloutRef,
)
from schemas.controller import AckOwed, LoaderPlace, PromptGroup, ReplayIndexEntry, RolloutAttempt
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.jsonschema import CONTROL_MESSAGES
from schemas.manifest import (
    CommitRecord,
    FileEntry,
    FileKind,
    GymCommit,
    LatestHint,
    Manifest,
    ParentRef,
    ParticipantCommit,
    PartManifest,
    PartReceipt,
    StoreMarker,
)
from schemas.rows import COLUMN_DESCRIPTIONS, ROW_SCHEMAS
from schemas.topology import canonical_json, topology_fingerprint
from snapformat import jsonl, layout, reader, retention
from snapformat.checksum import checksum_bytes
from snapformat.kinds import RECORD_TYPES, storage_of

SPEC_DIR = Path(__file__).resolve().parent
_BLOCK_RE = re.compile(
    r"(<!-- BEGIN GENERATED (?P<name>[A-Za-z0-9_:]+) -->\n)(?P<body>.*?)(<!-- END GENERATED (?P=name) -->)",
    re.DOTALL,
)

# --------------------------------------------------------------------------------------------
# Meanings of what is not a struct field or a row column
# --------------------------------------------------------------------------------------------

#: What each phase means, and the admission it implies (checked against ``schemas.control.Phase``).
PHASE_MEANINGS: dict[str, tuple[str, str]] = {
    "idle": ("accepting", "No checkpoint in progress; the server does its normal work."),
    "preparing": ("draining", "Prepare was called: no new work is admitted and the server is getting to a quiet point (model: 0 calls in flight; agent: every rollout parked at a turn end; resource: sessions frozen)."),
    "prepared": ("paused", "Quiet point reached: nothing runs and nothing changes until commit, resume or abort."),
    "committing": ("paused", "Writing its part into the draft."),
    "committed_paused": ("paused", "Its part is written and closed; still paused until resume (or abort)."),
    "restoring": ("paused", "Loading its part of a published snapshot."),
    "restored_paused": ("paused", "Its part is loaded; still paused until resume (agents: discard may be called now)."),
    "failed_restore": ("paused", "A restore failed after it began changing the server's state; only abort is accepted, and it returns the server to `idle` empty."),
}

#: Each error code: the HTTP statuses it comes with, and what it means (checked against ``ControlError.error``).
ERROR_MEANINGS: dict[str, tuple[str, str]] = {
    "unauthorized": ("401", "No `Authorization: Bearer <token>` header, another scheme, or a wrong token. Checked before anything else."),
    "bad_request": ("400, 404", "400: the body is not JSON, not the route's request struct (missing or unknown field, wrong type, a value outside its limits), `wait_s` is not a number, `part_prefix` is not this server's, the snapshot cannot be opened, or it was saved under another checkpoint id, or a model commit's receipt is not an agent part. 404: an agent route called on a server that is not an agent."),
    "too_large": ("413", "The body exceeds 1 MiB; it is refused before it is decoded."),
    "wrong_phase": ("409", "The call is not allowed in the server's phase (the reason lists the phases that allow it), or a restore was sent to a server that already holds state it would replace."),
    "conflicting_checkpoint": ("409", "Another checkpoint is in progress; the reason names it."),
    "stale_checkpoint": ("409", "The checkpoint already ended (resumed or aborted), or it was aborted while its prepare was draining."),
    "deadline_passed": ("409", "The deadline had passed when the call arrived, or prepare or commit could not finish before it."),
    "unknown_rollout": ("404", "Acknowledge or discard named a rollout run the agent does not hold as a finished result (acknowledge) or as a restored continuation (discard); nothing was changed."),
    "invalid_record": ("400, 409", "A record the server read breaks the format or Gym's rules (400; a restore that refuses its part returns the server to `idle`), or a continuation a model commit was given names a model call the server never served (409)."),
    "topology_mismatch": ("409", "The snapshot was taken by another topology than the running one; the reason names both fingerprints."),
    "internal": ("500", "The server failed (writing its part, reading the agent parts a model commit was given, loading its part, or a bug). After a failed commit it is back in `prepared`; after a failed restore it is in `failed_restore`."),
}

#: Every control route: (method, path under the base path, request, success response, phases, what it does).
#: Checked against the routes ``gymkit`` registers.
ROUTES: list[tuple[str, str, str, str, str, str]] = [
    ("GET", "/capabilities", "", "Capabilities", "any", "Who the server is, what it can do, and its live phase and admission."),
    ("GET", "/status", "query `checkpoint_id`, `wait_s` (optional)", "PhaseResponse", "any", "The phase now; with both query values, a long poll that answers once that checkpoint is prepared or further (or after `min(wait_s, 60)` s)."),
    ("POST", "/prepare", "ControlRequest", "PhaseResponse", "`idle`; `preparing` (same id)", "Stop admitting work and get to a quiet point; answers when there (`prepared`)."),
    ("POST", "/commit", "CommitRequest", "CommitResponse", "`prepared`", "Write this server's part into the draft, close it, answer its receipt."),
    ("POST", "/restore", "RestoreRequest", "RestoreResponse", "`idle`", "Load this server's part of a published snapshot and stay paused."),
    ("POST", "/resume", "ControlRequest", "PhaseResponse", "`preparing`, `prepared`, `committing`, `committed_paused`, `restored_paused`", "End the checkpoint: admit work again (`idle`)."),
    ("POST", "/abort", "ControlRequest", "PhaseResponse", "as resume, and `failed_restore`", "End the checkpoint without keeping anything it was for: as resume, except that an aborted restore drops what it loaded."),
    ("POST", "/agent/acknowledge", "AcknowledgeRequest", "JSON object", "any (agents only)", "Forget finished results the controller stored (all or nothing)."),
    ("POST", "/agent/discard", "DiscardRequest", "JSON object", "`restored_paused` (agents only)", "Make restored continuations start over (all or nothing)."),
    ("POST", "/admission/pause", "ControlRequest", "PhaseResponse", "as prepare", "The model server's name for prepare: pause admission, wait for 0 calls in flight."),
    ("POST", "/admission/resume", "ControlRequest", "PhaseResponse", "as resume", "The model server's name for resume."),
    ("POST", "/admission/abort", "ControlRequest", "PhaseResponse", "as abort", "The model server's name for abort."),
]

KIND_NOTES: dict[str, tuple[str, str, str]] = {
    # kind: (written by, conventional file name, section)
    "training_rows": ("TQ adapter", "`tq/training.arrow`", "Training rows"),
    "token_capture_rows": ("policy model server (or TQ)", "`gym/model/<name>/tokens.arrow`", "Token-capture rows"),
    "dataplane_rows": ("TQ adapter", "`tq/dataplane.arrow`", "Data-plane rows"),
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
    return {**record_examples(), **message_examples()}


def record_examples() -> dict[str, Any]:
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


#: The three reference servers (``refgym``), as their capabilities describe them.
REFERENCE_CAPABILITIES = [
    Capabilities(component="model", name="policy0", checkpoint_mode="export_restore"),
    Capabilities(component="agent", name="agent0", checkpoint_mode="export_restore"),
    Capabilities(component="resource", name="tools", checkpoint_mode="export_restore", restart_only_resources=["sandbox"]),
]


def message_examples() -> dict[str, Any]:
    draft = "s3://rl-snapshots/run-17/snapshots/snap-0000000002-4f1c9a7e"
    agent_part = PartReceipt(prefix="gym/agent/agent0", writer="agent:agent0", part_manifest_checksum=_ck("agent part"))
    model_part = PartReceipt(prefix="gym/model/policy0", writer="model:policy0", part_manifest_checksum=_ck("part"))
    deadline = 1796000420.0
    return {
        "Capabilities": REFERENCE_CAPABILITIES[2],
        "Concurrency": Concurrency(max_in_flight=64, multi_process="single"),
        "ControlRequest": ControlRequest(checkpoint_id="ckpt-2", deadline=deadline),
        "CommitRequest": CommitRequest(checkpoint_id="ckpt-2", deadline=deadline, draft_url=draft,
                                       part_prefix="gym/model/policy0", continuations=[agent_part]),
        "CommitResponse": CommitResponse(checkpoint_id="ckpt-2", phase="committed_paused", part=model_part,
                                         payload={"calls": 24, "rollouts": 9}),
        "RestoreRequest": RestoreRequest(
            checkpoint_id="restore-3", deadline=deadline,
            snapshot_url="s3://rl-snapshots/run-17/snapshots/snap-0000000002-4f1c9a7e", saved_checkpoint_id="ckpt-2",
            part_prefix="gym/agent/agent0", topology_fingerprint=_reference_topology()),
        "RestoreResponse": RestoreResponse(checkpoint_id="restore-3", phase="restored_paused", payload={
            "continuations": [{"rollout_id": "p7_g2", "attempt_index": 1, "capture_key": "p7_g2-a1",
                               "after_call": "call-2", "restart_only": []}],
            "finished_unacked": [{"rollout_id": "p7_g1", "attempt_index": 0}]}),
        "RolloutRef": RolloutRef(rollout_id="p7_g1", attempt_index=0),
        "AcknowledgeRequest": AcknowledgeRequest(results=[RolloutRef(rollout_id="p7_g1", attempt_index=0)]),
        "DiscardRequest": DiscardRequest(checkpoint_id="restore-3", deadline=deadline,
                                         rollouts=[RolloutRef(rollout_id="p7_g3", attempt_index=1)]),
        "PhaseResponse": PhaseResponse(checkpoint_id="ckpt-2", phase="prepared", admission="paused", in_flight=0),
        "ControlError": ControlError(error="conflicting_checkpoint",
                                     reason="checkpoint 'ckpt-2' is in progress; 'ckpt-3' refused",
                                     phase="prepared", checkpoint_id="ckpt-3"),
    }


def _reference_topology() -> str:
    return topology_fingerprint([c.contract() for c in REFERENCE_CAPABILITIES])


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

#: The control protocol's messages (``schemas.jsonschema.CONTROL_MESSAGES``) and the structs nested in them.
MESSAGES: dict[str, type] = {**CONTROL_MESSAGES, "Concurrency": Concurrency, "RolloutRef": RolloutRef}


def _struct(name: str) -> type:
    return STRUCTS[name] if name in STRUCTS else MESSAGES[name]

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
    if isinstance(t, mi.StructType):
        return f"`{t.cls.__name__}` object"
    raise TypeError(f"no rendering for {t!r}")


def _default(field: mi.Field) -> str:
    if field.default is not mi.NODEFAULT:
        return msgspec.json.encode(field.default).decode()
    if field.default_factory is not mi.NODEFAULT:
        return msgspec.json.encode(field.default_factory()).decode()
    return ""


def _unwrap(t: Any) -> Any:
    """A field's type without the ``Metadata`` wrapper its description puts around it."""
    return t.type if isinstance(t, mi.Metadata) else t


def description(t: Any) -> str | None:
    """The ``msgspec.Meta(description=...)`` of a field's type, if any."""
    return (t.extra_json_schema or {}).get("description") if isinstance(t, mi.Metadata) else None


def record_table(name: str) -> str:
    info = mi.type_info(_struct(name))
    rows = []
    if info.tag_field is not None:
        rows.append((info.tag_field, f'`"{info.tag}"`', "yes", f"Record type tag: `{info.tag}`."))
    for f in info.fields:
        required = "yes" if f.required else f"no (default `{_default(f)}`)"
        rows.append((f.encode_name, render_type(f.type), required, description(f.type)))
    missing = [r[0] for r in rows if not r[3]]
    if missing:
        raise SystemExit(f"render_spec_schemas: {name}: fields without a description (msgspec.Meta) {missing}")
    out = ["| field | type | required | meaning |", "|---|---|---|---|"]
    out += [f"| `{f}` | {_cell(t)} | {_cell(r)} | {_cell(m)} |" for f, t, r, m in rows]
    return "\n".join(out)


def record_example(name: str) -> str:
    value = examples()[name]
    assert type(value) is _struct(name)
    raw = msgspec.json.encode(value)
    msgspec.json.decode(raw, type=_struct(name))  # the example is valid by construction; keep it so
    text = raw.decode() if name in LINE_RECORDS else msgspec.json.format(raw, indent=2).decode()
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
    return _unwrap(field.type).max_length


def constants_block() -> str:
    rows = [
        ("format version written", f"`{version.FORMAT_VERSION}`", "`schemas/version.py` `FORMAT_VERSION`"),
        ("highest record `schema_version` read", str(version.RECORD_SCHEMA_VERSION), "`RECORD_SCHEMA_VERSION`"),
        ("features known to this version", ", ".join(sorted(version.KNOWN_FEATURES)) or "none", "`KNOWN_FEATURES`"),
        ("features reserved", ", ".join(f"`{f}`" for f in sorted(version.RESERVED_FEATURES)), "`RESERVED_FEATURES`"),
        ("JSON-lines zstd threshold", f"{jsonl.ZSTD_THRESHOLD:,} bytes of content (256 KiB)", "`ZSTD_THRESHOLD`"),
        ("zstd level used by the reference writer", str(jsonl.ZSTD_LEVEL), "`ZSTD_LEVEL`"),
        ("largest zstd window a reader decodes with",
         f"{jsonl.ZSTD_MAX_WINDOW:,} bytes ({jsonl.ZSTD_MAX_WINDOW >> 20} MiB, "
         f"window log {jsonl.ZSTD_MAX_WINDOW.bit_length() - 1})", "`ZSTD_MAX_WINDOW`"),
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
    from schemas.token_entry import token_digest
    from snapformat.example import CONTRACTS

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
        ("topology fingerprint of the example contracts below", f"`{topology_fingerprint(CONTRACTS)}`"),
    ]
    out = ["| input | value |", "|---|---|"]
    out += [f"| {a} | {_cell(b)} |" for a, b in rows]
    canonical = canonical_json(sorted(CONTRACTS, key=lambda c: (c["component"], c["name"])))
    out += ["", "The example contracts, in canonical form (these exact bytes are hashed):", "",
            "```json", canonical.decode(), "```"]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# The checkpoint control protocol
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
    """Every struct a control message contains has a table in the spec (as a message or a record)."""
    seen: set[type] = set()
    for typ in CONTROL_MESSAGES.values():
        _nested_structs(mi.type_info(typ), seen)
    missing = sorted(c.__name__ for c in seen if c.__name__ not in MESSAGES and c.__name__ not in STRUCTS)
    if missing:
        raise SystemExit(f"render_spec_schemas: control structs without a table: {missing}")


def registered_routes() -> set[tuple[str, str]]:
    """(method, path) of every route ``gymkit`` mounts, from a router built around a trivial participant."""
    from gymkit import ControlPlane, Participant

    class Trivial(Participant):
        def capabilities(self) -> Capabilities:
            return Capabilities(component="agent", name="trivial", checkpoint_mode="stateless")

        async def prepare(self, deadline: float) -> None: ...
        async def commit(self, part: Any, context: dict[str, Any]) -> dict[str, Any]: return {}
        async def restore(self, snapshot: Any, prefix: str) -> dict[str, Any]: return {}
        async def resume(self) -> None: ...

    out = set()
    for route in ControlPlane(Trivial(), "token").router().routes:
        for method in sorted(route.methods - {"HEAD"}):  # type: ignore[attr-defined]
            out.add((method, route.path))  # type: ignore[attr-defined]
    return out


def _literal_values(t: Any) -> list[str]:
    return list(typing.get_args(t))


def control_routes_block() -> str:
    documented = {(m, control.CONTROL_PREFIX + p) for m, p, *_ in ROUTES}
    registered = registered_routes()
    if documented != registered:
        raise SystemExit(f"render_spec_schemas: routes registered but not documented {sorted(registered - documented)}, "
                         f"documented but not registered {sorted(documented - registered)}")
    out = ["| method and path | request | answer (200) | phases allowed | what it does |", "|---|---|---|---|---|"]
    for method, path, req, resp, phases, what in ROUTES:
        for name in (req, resp):
            if name and name[0].isupper() and name not in MESSAGES and name != "JSON object":
                raise SystemExit(f"render_spec_schemas: route {path}: unknown message {name!r}")
        req_cell = f"`{req}`" if req in MESSAGES else (req or "none")
        resp_cell = f"`{resp}`" if resp in MESSAGES else resp
        out.append(f"| `{method} {control.CONTROL_PREFIX}{path}` | {_cell(req_cell)} | {_cell(resp_cell)} | "
                   f"{_cell(phases)} | {_cell(what)} |")
    return "\n".join(out)


def control_phases_block() -> str:
    phases = _literal_values(control.Phase)
    admissions = set(_literal_values(control.Admission))
    if list(PHASE_MEANINGS) != phases or any(a not in admissions for a, _ in PHASE_MEANINGS.values()):
        raise SystemExit(f"render_spec_schemas: PHASE_MEANINGS must cover exactly {phases} in order")
    out = ["| phase | admission | meaning |", "|---|---|---|"]
    out += [f"| `{p}` | `{a}` | {_cell(m)} |" for p, (a, m) in PHASE_MEANINGS.items()]
    return "\n".join(out)


def control_errors_block() -> str:
    codes = _literal_values(typing.get_type_hints(ControlError)["error"])
    if list(ERROR_MEANINGS) != codes:
        raise SystemExit(f"render_spec_schemas: ERROR_MEANINGS must cover exactly {codes} in order")
    out = ["| `error` | HTTP status | meaning |", "|---|---|---|"]
    out += [f"| `{code}` | {status} | {_cell(m)} |" for code, (status, m) in ERROR_MEANINGS.items()]
    return "\n".join(out)


def spec_pattern(pattern: str) -> str:
    """A code pattern as the spec writes it: the code ends some with ``$(?![\\s\\S])`` (Python's
    ``$`` also matches before a final newline), which the spec's whole-string convention says."""
    return pattern.removesuffix(r"(?![\s\S])")


def _checkpoint_id_pattern() -> str:
    t = next(f.type for f in mi.type_info(ControlRequest).fields if f.name == "checkpoint_id")
    return spec_pattern(_unwrap(t).pattern)


def control_constants_block() -> str:
    from gymkit import control_plane

    rows = [
        ("base path", f"`{control.CONTROL_PREFIX}`", "`CONTROL_PREFIX`"),
        ("protocol version (`Capabilities.schema_version`)", str(control.CONTROL_SCHEMA_VERSION), "`CONTROL_SCHEMA_VERSION`"),
        ("largest request body", f"{control.MAX_BODY_BYTES:,} bytes (1 MiB)", "`MAX_BODY_BYTES`"),
        ("checkpoint id", f"matches `{_checkpoint_id_pattern()}`", "`CheckpointId`"),
        ("answers and ended ids the reference remembers", f"the last {control_plane._MAX_REMEMBERED}", "`gymkit` `_MAX_REMEMBERED`"),
        ("longest status long poll", "60 s", "`ControlPlane.wait_prepared`"),
    ]
    out = ["| constant | value | in the code |", "|---|---|---|"]
    out += [f"| {a} | {_cell(b)} | {c} |" for a, b, c in rows]
    return "\n".join(out)


def control_topology_block() -> str:
    contracts = [c.contract() for c in REFERENCE_CAPABILITIES]
    ordered = sorted(contracts, key=lambda c: (c["component"], c["name"]))
    out = ["| input | value |", "|---|---|",
           f"| topology fingerprint of the reference servers (`model/policy0`, `agent/agent0`, `resource/tools` "
           f"with restart-only `sandbox`) | `{topology_fingerprint(contracts)}` |",
           "", "Their contracts, in canonical form (these exact bytes are hashed):", "",
           "```json", canonical_json(ordered).decode(), "```"]
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
    return out


def control_blocks() -> dict[str, str]:
    """The generated blocks of CONTROL.md (the checkpoint control protocol)."""
    check_messages_documented()
    out = {f"message:{name}": record_block(name) for name in MESSAGES}
    out["control:routes"] = control_routes_block()
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
