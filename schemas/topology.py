"""The topology fingerprint: which Gym participants, with which contracts, took a snapshot.

NeMo-RL's formula (``gym_checkpoint.py`` at ``d595189f``; CONTROL.md §5):

1. one contract per server, ``{participant: {server_name, component, participant_name},
   schema_version, admission_states (sorted), checkpoint_mode, concurrency_contract,
   multi_process: {mode, num_workers}, instance_role, features (sorted)}``
   (:meth:`schemas.control.Capabilities.contract`);
2. contracts sorted by (component, server_name, participant_name);
3. ``{"schema_version": 1, "participants": [contract without "features", ...]}``;
4. JSON with sorted keys, separators ``(",", ":")``, ASCII escapes, UTF-8;
5. SHA-256 as 64 lowercase hex characters, no prefix.

Live state (phase, active id, deadline) and features do not change it. A snapshot manifest keeps
it as ``sha256:<hex>`` (the format's spelling of every digest): :func:`manifest_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from schemas.errors import InvalidRecordError

FINGERPRINT_SCHEMA_VERSION = 1


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no insignificant whitespace, ASCII escapes (Python's default), UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _sort_key(contract: Mapping[str, Any]) -> tuple[str, str, str]:
    try:
        p = contract["participant"]
        return str(p["component"]), str(p["server_name"]), str(p["participant_name"])
    except (KeyError, TypeError):
        raise InvalidRecordError(
            f"topology contract {dict(contract)!r} lacks participant.component/server_name/participant_name"
        ) from None


def topology_fingerprint(contracts: Iterable[Mapping[str, Any]]) -> str:
    """The bare 64-hex SHA-256 NeMo-RL computes over the participants' contracts."""
    items = sorted((dict(c) for c in contracts), key=_sort_key)
    hashed = [{k: v for k, v in c.items() if k != "features"} for c in items]
    doc = {"schema_version": FINGERPRINT_SCHEMA_VERSION, "participants": hashed}
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def manifest_fingerprint(hex_digest: str) -> str:
    """The manifest's spelling of a fingerprint: ``sha256:<hex>``."""
    return f"sha256:{hex_digest}"
