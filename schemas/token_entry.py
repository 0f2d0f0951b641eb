"""Gym's token-capture record, ``TokenEntry`` (``nemo_gym.token_id_capture.records``, released
nemo-gym 0.7.0, record ``schema_version`` 1), as plain JSON, and how one maps to a token-capture
row (``schemas.rows.TOKEN_CAPTURE_SCHEMA``) and back without losing anything.

Gym's object is the authority; this module never imports ``nemo_gym`` (the tests judge it with
Gym's own models). A *TokenEntry JSON* here is exactly what Gym's ``entry.model_dump(mode="json")``
gives: every declared field, then the unknown fields Gym keeps (``extra="allow"``).

The row form:
- Gym's ``rollout_id`` holds the **capture key**. The row keeps it in ``capture_key`` and splits it
  into ``rollout_id`` and ``attempt_index`` (:func:`schemas.identity.split_capture_key`: the
  reserved ``-a<N>`` suffix makes that split unique).
- Fields whose Gym type admits ``None`` (``cum_len``, ``digest``, ...) are nullable columns where
  null is ``None``. Fields Gym never holds as ``None`` (``model``, ``created_at``, the continuation
  and prefix fields...) are written as their values; a null there (a file from an older writer, or
  a data plane that lacked the field) reads back as Gym's default.
- ``output_items`` (a list of objects) and ``routed_experts`` (any JSON) are JSON text columns.
- Unknown fields are kept, as one JSON object, in ``extra_fields`` (null when there are none).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from schemas.errors import InvalidRecordError, VersionError
from schemas.identity import capture_key as make_capture_key
from schemas.identity import split_capture_key

#: The ``schema_version`` of Gym's TokenEntry this code reads and writes (Gym reads older ones).
TOKEN_ENTRY_SCHEMA_VERSION = 1
#: Gym's digest: SHA-256 of the domain, then version byte 1 and the count as a big-endian u64,
#: then every token id as a big-endian u64; an empty sequence hashes the domain alone.
DIGEST_DOMAIN = b"nemo-gym-tokens"
DIGEST_VERSION = 1
_EMPTY_DIGEST = hashlib.sha256(DIGEST_DOMAIN).hexdigest()

#: Gym's declared fields in declaration order, with the default of each optional one.
REQUIRED_FIELDS = ("rollout_id", "model_call_id", "prompt_token_ids", "generation_token_ids",
                   "generation_log_probs")
DEFAULTS: dict[str, Any] = {
    "schema_version": TOKEN_ENTRY_SCHEMA_VERSION,
    "model": "",
    "routed_experts": None,
    "output_items": [],
    "token_item_index": None,
    "response_id": None,
    "created_at": 0.0,
    "parent_call_id": None,
    "cum_len": None,
    "digest": None,
    "parent_resolution": None,
    "continuation_fingerprint": "",
    "continuation_context_len": 0,
    "continuation_context_digest": "",
    "parent_resolution_reason": "",
    "fingerprint_version": None,
    "prompt_is_delta": False,
    "prefix_requested": False,
    "prefix_supplied": False,
}
FIELD_ORDER = ("schema_version", "rollout_id", "model_call_id", "model", "prompt_token_ids",
               "generation_token_ids", "generation_log_probs", "routed_experts", "output_items",
               "token_item_index", "response_id", "created_at", "parent_call_id", "cum_len", "digest",
               "parent_resolution", "continuation_fingerprint", "continuation_context_len",
               "continuation_context_digest", "parent_resolution_reason", "fingerprint_version",
               "prompt_is_delta", "prefix_requested", "prefix_supplied")
KNOWN_FIELDS = frozenset(FIELD_ORDER)
#: Columns of the row form that are not Gym fields (``rollout_id`` there is the split-off id).
ROW_ONLY_COLUMNS = ("attempt_index", "capture_key", "extra_fields")
_JSON_COLUMNS = ("routed_experts", "output_items")
_MAX_U64 = 2**64 - 1


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Gym's length-delimited big-endian encoding of a token sequence (what the digest hashes)."""
    header = DIGEST_VERSION.to_bytes(1, "big") + len(token_ids).to_bytes(8, "big")
    if len(token_ids) == 0:
        return header
    arr = np.asarray(token_ids)
    if arr.dtype.kind == "u":
        return header + arr.astype(">u8").tobytes()
    if arr.dtype.kind == "i":
        if (arr < 0).any():
            raise InvalidRecordError(f"token id {int(arr[arr < 0][0])} cannot be hashed (expected 0 <= id < 2**64)")
        return header + arr.astype(">u8").tobytes()
    # Python ints past int64 (numpy gives an object array) or anything else: one at a time.
    out = bytearray(header)
    for t in token_ids:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= int(t) <= _MAX_U64:
            raise InvalidRecordError(f"token id {t!r} cannot be hashed (expected an integer 0 <= id < 2**64)")
        out += int(t).to_bytes(8, "big")
    return bytes(out)


def token_digest(token_ids: Sequence[int]) -> str:
    """Gym's ``compute_digest``: the hex SHA-256 that a TokenEntry's ``digest`` holds for its
    cumulative tokens (prompt then generation)."""
    if len(token_ids) == 0:
        return _EMPTY_DIGEST
    return hashlib.sha256(DIGEST_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def check_entry_version(schema_version: Any, where: str) -> None:
    """Gym's rule: older records are read, a newer one is refused naming both versions."""
    if not isinstance(schema_version, int) or isinstance(schema_version, bool) or schema_version < 1:
        raise InvalidRecordError(f"{where}: schema_version {schema_version!r} is not a positive integer")
    if schema_version > TOKEN_ENTRY_SCHEMA_VERSION:
        raise VersionError(
            f"{where}: token record is schema_version {schema_version}, but this reader understands up to "
            f"{TOKEN_ENTRY_SCHEMA_VERSION}")


def _dump_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def entry_to_row(entry: Mapping[str, Any], where: str = "token entry") -> dict[str, Any]:
    """The token-capture row of one TokenEntry JSON (``model_dump(mode="json")`` or its parsed line).

    Checks only what the row form needs (the record version, the required fields, the capture
    key); the row rules (``schemas.rows.validate_batch``) check the rest when the row is written.
    """
    if not isinstance(entry, Mapping):
        raise InvalidRecordError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in entry]
    if missing:
        raise InvalidRecordError(f"{where}: field(s) {', '.join(missing)} missing (Gym's TokenEntry requires them)")
    version = entry.get("schema_version", TOKEN_ENTRY_SCHEMA_VERSION)
    check_entry_version(version, where)
    key = entry["rollout_id"]
    rollout_id, attempt = split_capture_key(key, where=f"{where}: rollout_id (the capture key)")
    row: dict[str, Any] = {"rollout_id": rollout_id, "attempt_index": attempt, "capture_key": key}
    for name in FIELD_ORDER:
        if name == "rollout_id":
            continue
        value = entry.get(name, DEFAULTS.get(name))
        if name in _JSON_COLUMNS:
            value = None if value is None and name == "routed_experts" else _json_column(value, name, where)
        row[name] = value
    extras = {k: v for k, v in entry.items() if k not in KNOWN_FIELDS}
    row["extra_fields"] = _json_column(extras, "extra_fields", where) if extras else None
    return row


def _json_column(value: Any, name: str, where: str) -> str:
    try:
        return _dump_json(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRecordError(f"{where}: {name} cannot be stored as JSON: {exc}") from None


def row_to_entry(row: Mapping[str, Any], where: str = "token row") -> dict[str, Any]:
    """The TokenEntry JSON of one token-capture row (a canonical, current-version row as a dict):
    what Gym's ``TokenEntry.model_validate`` accepts and dumps back unchanged."""
    key = row["capture_key"]
    if key is None or row["rollout_id"] is None or row["attempt_index"] is None:
        raise InvalidRecordError(f"{where}: rollout_id, attempt_index and capture_key must not be null")
    expected = make_capture_key(row["rollout_id"], row["attempt_index"])
    if key != expected:
        raise InvalidRecordError(f"{where}: capture_key {key!r} is not the key of rollout {row['rollout_id']!r} "
                                 f"attempt {row['attempt_index']} (expected {expected!r})")
    out: dict[str, Any] = {}
    for name in FIELD_ORDER:
        if name == "rollout_id":
            out[name] = key
            continue
        value = row.get(name)
        if name in _JSON_COLUMNS and value is not None:
            value = _load_json(value, name, where)
        if value is None:
            value = DEFAULTS.get(name)
            if isinstance(value, list):
                value = []
        out[name] = value
    extra = row.get("extra_fields")
    if extra is not None:
        extras = _load_json(extra, "extra_fields", where)
        if not isinstance(extras, dict):
            raise InvalidRecordError(f"{where}: extra_fields is not a JSON object")
        clash = sorted(KNOWN_FIELDS & extras.keys())
        if clash:
            raise InvalidRecordError(f"{where}: extra_fields repeats declared field(s) {', '.join(clash)}")
        out.update(extras)
    return out


def _load_json(text: str, name: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRecordError(f"{where}: {name} is not JSON text: {exc}") from None
