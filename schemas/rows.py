"""Arrow schemas of the three row tables, and the checks every row batch must pass.

Required columns MUST be present with exactly these types (so a reader can memory-map them without
conversion); a writer MAY add further columns, which readers ignore unless they know them. Columns
these schemas declare not nullable MUST hold no nulls, whatever a file's own schema declares.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import InvalidRecordError, VersionError
from schemas.token_entry import TOKEN_ENTRY_SCHEMA_VERSION

#: Token-capture rows, file version 2: one row per model call, every field of Gym's TokenEntry
#: (``schemas.token_entry`` says how a TokenEntry maps to a row and back, losslessly).
TOKEN_CAPTURE_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int32(), nullable=False),  # the TokenEntry's own (Gym's) version
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("attempt_index", pa.int32(), nullable=False),
        pa.field("capture_key", pa.string(), nullable=False),  # Gym's TokenEntry.rollout_id
        pa.field("model_call_id", pa.string(), nullable=False),
        pa.field("model", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("generation_token_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("generation_log_probs", pa.list_(pa.float64()), nullable=False),
        pa.field("routed_experts", pa.string()),  # JSON text (Gym: any JSON value or None)
        pa.field("output_items", pa.string()),  # JSON text of a list of objects
        pa.field("token_item_index", pa.int64()),
        pa.field("response_id", pa.string()),
        pa.field("created_at", pa.float64()),
        pa.field("parent_call_id", pa.string()),
        pa.field("cum_len", pa.int64()),
        pa.field("digest", pa.string()),  # Gym's digest of the cumulative token sequence
        pa.field("parent_resolution", pa.string()),  # root | resolved | unresolved
        pa.field("continuation_fingerprint", pa.string()),
        pa.field("continuation_context_len", pa.int64()),
        pa.field("continuation_context_digest", pa.string()),
        pa.field("parent_resolution_reason", pa.string()),
        pa.field("fingerprint_version", pa.int64()),
        pa.field("prompt_is_delta", pa.bool_()),
        pa.field("prefix_requested", pa.bool_()),
        pa.field("prefix_supplied", pa.bool_()),
        pa.field("extra_fields", pa.string()),  # JSON object of the TokenEntry's unknown fields
    ],
    metadata={"snapformat.kind": "token_capture_rows", "snapformat.schema_version": "2"},
)

#: Token-capture rows as file version 1 wrote them (read, never written): 32-bit ids and log
#: probs, nested-list routed experts, and none of the continuation, prefix or extra columns.
TOKEN_CAPTURE_SCHEMA_V1 = pa.schema(
    [
        pa.field("schema_version", pa.int32(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("attempt_index", pa.int32(), nullable=False),
        pa.field("capture_key", pa.string(), nullable=False),
        pa.field("model_call_id", pa.string(), nullable=False),
        pa.field("model", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("generation_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("generation_log_probs", pa.list_(pa.float32()), nullable=False),
        pa.field("routed_experts", pa.list_(pa.list_(pa.int32()))),
        pa.field("output_items", pa.string()),
        pa.field("token_item_index", pa.int32()),
        pa.field("response_id", pa.string()),
        pa.field("created_at", pa.float64()),
        pa.field("parent_call_id", pa.string()),
        pa.field("cum_len", pa.int64(), nullable=False),
        pa.field("digest", pa.string()),
        pa.field("parent_resolution", pa.string()),
        pa.field("prompt_is_delta", pa.bool_()),
    ],
    metadata={"snapformat.kind": "token_capture_rows", "snapformat.schema_version": "1"},
)

TRAINING_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),  # the TQ key of the sample
        pa.field("partition_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("attempt_index", pa.int32(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("input_lengths", pa.int32(), nullable=False),
        pa.field("generation_logprobs", pa.list_(pa.float32())),
        pa.field("prev_logprobs", pa.list_(pa.float32())),
        pa.field("reference_policy_logprobs", pa.list_(pa.float32())),
        pa.field("advantages", pa.list_(pa.float32())),
        pa.field("token_mask", pa.list_(pa.int8())),
        pa.field("sample_mask", pa.float32()),
    ],
    metadata={"snapformat.kind": "training_rows", "snapformat.schema_version": "1"},
)

#: Rows of any shape from a data-plane partition: its key, its partition and its tags (JSON text);
#: every field is a further column of its own name and type (see the data plane's layout metadata).
DATAPLANE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("partition_id", pa.string(), nullable=False),
        pa.field("row_tags", pa.string()),
    ],
    metadata={"snapformat.kind": "dataplane_rows", "snapformat.schema_version": "1"},
)

ROW_SCHEMAS: dict[str, pa.Schema] = {
    "token_capture_rows": TOKEN_CAPTURE_SCHEMA,
    "training_rows": TRAINING_SCHEMA,
    "dataplane_rows": DATAPLANE_SCHEMA,
}

#: What each column of the current row schemas means, per kind: the spec's column tables are
#: rendered from it (``spec/render_spec_schemas.py``, which refuses a column without a meaning).
#: Kept here, not as Arrow field metadata, so that the bytes of every row file stay the same.
COLUMN_DESCRIPTIONS: dict[str, dict[str, str]] = {
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
        "schema_version": "Gym's `TokenEntry.schema_version` of the record (1 for nemo-gym 0.7.0); a reader "
                          "refuses one above the version it understands, naming both.",
        "rollout_id": "The rollout that made the model call: the capture key without its `-a<N>` suffix.",
        "attempt_index": "The run that made it (>= 0): N of the capture key's `-a<N>` suffix, 0 without one.",
        "capture_key": "Gym's `TokenEntry.rollout_id` (which holds the capture key); MUST equal the capture key "
                       "of (`rollout_id`, `attempt_index`).",
        "model_call_id": "The model call; one call may span several consecutive rows of one batch.",
        "model": "Name of the model that answered; null reads as Gym's default `\"\"`.",
        "prompt_token_ids": "Prompt token ids (only those after the parent call's when `prompt_is_delta` is "
                            "true).",
        "generation_token_ids": "Generated token ids.",
        "generation_log_probs": "Log probability of each generated token (as Gym holds it, a 64-bit float); "
                                "same length as `generation_token_ids`.",
        "routed_experts": "Gym's `routed_experts` (any JSON value) as JSON text; null is None.",
        "output_items": "Gym's `output_items` (a list of objects) as JSON text; null reads as `[]`.",
        "token_item_index": "Index of the output item that carried these tokens, or null.",
        "response_id": "Id of the model response returned to the client, or null.",
        "created_at": "Unix seconds of the call; null reads as Gym's default 0.0.",
        "parent_call_id": "The parent call, present exactly when `parent_resolution` is `resolved` (or, with "
                          "no resolution recorded, as the writer gave it).",
        "cum_len": "Length of the whole cumulative token sequence up to and including this call, or null when "
                   "not stamped.",
        "digest": "Gym's digest of that cumulative sequence (§6), or null when not stamped.",
        "parent_resolution": "`root`, `resolved` or `unresolved`: the request-time parent decision; null when "
                             "not recorded.",
        "continuation_fingerprint": "Gym's fingerprint of the model-authored output, for request-time parent "
                                    "resolution; null reads as `\"\"`.",
        "continuation_context_len": "Number of request items the call saw; null reads as 0.",
        "continuation_context_digest": "Gym's digest of those request items; null reads as `\"\"`.",
        "parent_resolution_reason": "The resolver's reason for its decision; null reads as `\"\"`.",
        "fingerprint_version": "The fingerprint algorithm's version, or null.",
        "prompt_is_delta": "True when `prompt_token_ids` holds only the tokens after the parent's cumulative "
                           "sequence (needs a resolved parent); null reads as false.",
        "prefix_requested": "Gym's prefix-supply request flag; null reads as false.",
        "prefix_supplied": "True only when generation-time prompt ids prove the prefix was applied; null reads "
                           "as false.",
        "extra_fields": "The TokenEntry's fields unknown to this schema (Gym keeps them), as one JSON object; "
                        "null when there are none.",
    },
    "dataplane_rows": {
        "key": "The row's key in the data plane.",
        "partition_id": "The data-plane partition holding the row.",
        "row_tags": "The row's tag as JSON text (null reads as `{}`); carries the `dataplane.layout` metadata.",
    },
}

#: Per kind, the schema of each file version a reader accepts (the newest is the one written).
SCHEMA_VERSIONS: dict[str, dict[int, pa.Schema]] = {
    "token_capture_rows": {1: TOKEN_CAPTURE_SCHEMA_V1, 2: TOKEN_CAPTURE_SCHEMA},
    "training_rows": {1: TRAINING_SCHEMA},
    "dataplane_rows": {1: DATAPLANE_SCHEMA},
}

#: Per kind, the columns that MUST hold no nulls: taken from the canonical schemas above, never from a
#: file's own schema (which may declare a required column nullable: Arrow enforces neither flag).
NON_NULLABLE: dict[str, tuple[pa.Field, ...]] = {
    kind: tuple(field for field in schema if not field.nullable) for kind, schema in ROW_SCHEMAS.items()
}

_ROLLOUT_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_RESERVED_SUFFIX_RE = r"-a[1-9][0-9]*$"
# Both rules as one search for a breach (one regex pass over the column instead of two): empty, a
# first character that is not alphanumeric, any character outside the set, or a reserved suffix.
_ROLLOUT_ID_BREACH_RE = r"^$|^[^A-Za-z0-9]|[^A-Za-z0-9._-]|-a[1-9][0-9]*$"
_PARENT_RESOLUTIONS = pa.array(["root", "resolved", "unresolved"])


def file_version(kind: str, schema: pa.Schema, where: str) -> int:
    """The file's ``snapformat.schema_version`` (1 when absent), refused naming both versions when
    this reader does not know it."""
    known = SCHEMA_VERSIONS[kind]
    newest = max(known)
    raw = (schema.metadata or {}).get(b"snapformat.schema_version", b"1")
    # Length first: int() refuses more than 4300 digits with a bare ValueError, and no supported
    # version needs more than a few.
    if not raw.isdigit() or len(raw.lstrip(b"0")) > 9 or int(raw) not in known:
        shown = raw[:40].decode(errors="replace") + ("..." if len(raw) > 40 else "")
        raise VersionError(
            f"{where}: snapformat.schema_version {shown!r} is not supported "
            f"(this reader understands {kind} files of versions {min(known)}..{newest})")
    return int(raw)


def check_schema(kind: str, schema: pa.Schema, where: str) -> int:
    """Every required column of ``kind`` is present with its exact type for the file's version
    (extra columns allowed); returns that version (see :func:`file_version`)."""
    version = file_version(kind, schema, where)
    for field in SCHEMA_VERSIONS[kind][version]:
        idx = schema.get_field_index(field.name)
        if idx < 0:
            raise InvalidRecordError(f"{where}: column {field.name!r} is missing (expected {field.type})")
        got = schema.field(idx).type
        if got != field.type:
            raise InvalidRecordError(f"{where}: column {field.name!r} has type {got}, expected {field.type}")
    return version


def upgrade(kind: str, batch: pa.RecordBatch, where: str) -> pa.RecordBatch:
    """A batch of any version this reader accepts, in the current version's columns and types.

    Token rows of version 1 widen ids and log probs (exact), carry routed experts over as JSON
    text, and gain the newer columns as nulls (which read back as Gym's defaults).
    """
    if file_version(kind, batch.schema, where) == max(SCHEMA_VERSIONS[kind]):
        return batch
    if kind == "token_capture_rows" and batch.schema.get_field_index("routed_experts") >= 0:
        experts = batch.column("routed_experts")
        if not pa.types.is_string(experts.type):
            text = pa.array([None if v is None else json.dumps(v, separators=(",", ":"))
                             for v in experts.to_pylist()], pa.string())
            batch = batch.set_column(batch.schema.get_field_index("routed_experts"), "routed_experts", text)
    return conform(kind, batch.replace_schema_metadata(None), where)


def conform(kind: str, batch: pa.RecordBatch, where: str) -> pa.RecordBatch:
    """Cast a batch's required columns to the canonical types (int64 ids -> int32, ...).

    Columns are reordered so required ones come first in spec order; extra columns keep their
    order after them. A column that cannot be cast safely raises :class:`InvalidRecordError`.
    """
    expected = ROW_SCHEMAS[kind]
    if batch.schema.remove_metadata().equals(expected.remove_metadata()):
        return batch.replace_schema_metadata(expected.metadata)
    arrays, fields = [], []
    for field in expected:
        idx = batch.schema.get_field_index(field.name)
        if idx < 0:
            if field.nullable:
                arrays.append(pa.nulls(batch.num_rows, field.type))
                fields.append(field)
                continue
            raise InvalidRecordError(f"{where}: column {field.name!r} is missing (expected {field.type})")
        col = batch.column(idx)
        if col.type != field.type:
            try:
                col = col.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise InvalidRecordError(
                    f"{where}: column {field.name!r} of type {col.type} cannot become {field.type}: {exc}"
                ) from None
        arrays.append(col)
        own = batch.schema.field(idx).metadata  # a writer's column metadata (the data plane's layout) stays
        fields.append(field.with_metadata(own) if own else field)
    names = set(expected.names)
    for i, field in enumerate(batch.schema):
        if field.name not in names:
            arrays.append(batch.column(i))
            fields.append(field)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=expected.metadata))


def _first_bad(mask: pa.Array) -> int | None:
    """Index of the first true value of a boolean mask (nulls count as true), or None."""
    if mask.null_count:
        mask = pc.fill_null(mask, True)
    if not pc.any(mask).as_py():
        return None
    return pc.index(mask, True).as_py()


def check_no_nulls(kind: str, batch: pa.RecordBatch, where: str) -> None:
    """Every column that ``kind``'s canonical schema declares not nullable holds no null.

    Readers and writers both call it: Arrow checks a field's ``nullable`` flag neither when it
    writes nor when it reads, so a file may carry nulls in a column declared not nullable, or
    declare the column nullable. ``null_count`` is known per array (O(1) per column); the first
    offending row is searched for only once a null is known to be there.
    """
    for field in NON_NULLABLE[kind]:
        idx = batch.schema.get_field_index(field.name)
        if idx < 0:
            raise InvalidRecordError(f"{where}: column {field.name!r} is missing (expected {field.type})")
        col = batch.column(idx)
        if col.null_count:
            row = pc.index(pc.is_null(col), True).as_py()
            raise InvalidRecordError(
                f"{where}: row {row}: column {field.name!r} is null "
                f"(expected a {field.type} value: the column is not nullable)")


def validate_batch(kind: str, batch: pa.RecordBatch, where: str) -> None:
    """Row-level rules, vectorised: no nulls in required columns, Gym's id and capture-key rules,
    matching list lengths."""
    check_no_nulls(kind, batch, where)
    if kind == "dataplane_rows":
        return  # any shape: the data plane's own layout metadata describes its fields
    for name in ("rollout_id",):
        col = batch.column(name)
        i = _first_bad(pc.match_substring_regex(col, _ROLLOUT_ID_BREACH_RE))
        if i is not None:
            raise InvalidRecordError(
                f"{where}: row {i}: rollout_id {col[i].as_py()!r} breaks Gym's rule "
                f"({_ROLLOUT_ID_RE}, no '-a<N>' suffix)"
            )
    attempt = batch.column("attempt_index")
    i = _first_bad(pc.less(attempt, 0))
    if i is not None:
        raise InvalidRecordError(f"{where}: row {i}: attempt_index {attempt[i].as_py()} is negative")
    if kind != "token_capture_rows":
        return
    sv = batch.column("schema_version")
    i = _first_bad(pc.or_(pc.less(sv, 1), pc.greater(sv, TOKEN_ENTRY_SCHEMA_VERSION)))
    if i is not None:
        raise VersionError(
            f"{where}: row {i}: schema_version {sv[i].as_py()} is not supported (this reader understands "
            f"token records of versions 1..{TOKEN_ENTRY_SCHEMA_VERSION})")
    rid, key = batch.column("rollout_id"), batch.column("capture_key")
    expected_key = pc.if_else(
        pc.equal(attempt, 0), rid,
        pc.binary_join_element_wise(rid, pc.cast(attempt, pa.string()), "-a"),
    )
    i = _first_bad(pc.not_equal(key, expected_key))
    if i is not None:
        raise InvalidRecordError(
            f"{where}: row {i}: capture_key {key[i].as_py()!r} is not the key of rollout "
            f"{rid[i].as_py()!r} attempt {attempt[i].as_py()} (expected {expected_key[i].as_py()!r})"
        )
    gen_len = pc.list_value_length(batch.column("generation_token_ids"))
    lp_len = pc.list_value_length(batch.column("generation_log_probs"))
    i = _first_bad(pc.not_equal(gen_len, lp_len))
    if i is not None:  # both columns are not nullable (checked above): every length is a number
        raise InvalidRecordError(
            f"{where}: row {i}: generation_log_probs has {lp_len[i].as_py()} values for "
            f"{gen_len[i].as_py()} generation_token_ids (expected equal lengths)"
        )
    res = batch.column("parent_resolution")
    i = _first_bad(pc.and_(pc.is_valid(res), pc.invert(pc.is_in(res, value_set=_PARENT_RESOLUTIONS))))
    if i is not None:
        raise InvalidRecordError(
            f"{where}: row {i}: parent_resolution {res[i].as_py()!r} is not root, resolved or unresolved"
        )
    _check_lineage(batch, res, where)


def _check_lineage(batch: pa.RecordBatch, res: pa.Array, where: str) -> None:
    """Gym's parent rules: a resolved parent names its call, a root or unresolved one names none,
    and a delta prompt (only the suffix after its parent) needs a resolved parent."""
    parent = batch.column("parent_call_id")
    has_parent = pc.fill_null(pc.greater(pc.utf8_length(parent), 0), False)
    resolved = pc.fill_null(pc.equal(res, "resolved"), False)
    i = _first_bad(pc.and_(resolved, pc.invert(has_parent)))
    if i is not None:
        raise InvalidRecordError(f"{where}: row {i}: parent_resolution 'resolved' requires a parent_call_id")
    rootish = pc.fill_null(pc.is_in(res, value_set=pa.array(["root", "unresolved"])), False)
    i = _first_bad(pc.and_(rootish, pc.is_valid(parent)))
    if i is not None:
        raise InvalidRecordError(
            f"{where}: row {i}: parent_resolution {res[i].as_py()!r} cannot carry parent_call_id "
            f"{parent[i].as_py()!r}")
    delta = pc.fill_null(batch.column("prompt_is_delta"), False)
    i = _first_bad(pc.and_(delta, pc.invert(pc.and_(resolved, has_parent))))
    if i is not None:
        raise InvalidRecordError(f"{where}: row {i}: a delta prompt requires a resolved parent_call_id")
