"""The topology fingerprint: which participants (and which contracts) took a snapshot.

Canonical form: the participants' contracts (JSON objects) sorted by ``(component, name)``,
encoded as JSON with sorted keys, no insignificant whitespace, UTF-8, non-ASCII unescaped; the
fingerprint is ``sha256:`` + the hex SHA-256 of those bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from schemas.errors import InvalidRecordError


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def topology_fingerprint(contracts: Iterable[Mapping[str, Any]]) -> str:
    """``sha256:<hex>`` over the canonical JSON of the participants' contracts."""
    items = [dict(c) for c in contracts]
    for c in items:
        if "component" not in c or "name" not in c:
            raise InvalidRecordError(f"topology contract {c!r} lacks 'component' or 'name'")
    items.sort(key=lambda c: (str(c["component"]), str(c["name"])))
    return "sha256:" + hashlib.sha256(canonical_json(items)).hexdigest()
