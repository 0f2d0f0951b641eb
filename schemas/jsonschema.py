"""JSON Schema for every persisted record, so that a service in another language can write its part.

``python -m schemas DIR`` writes one ``<Record>.schema.json`` per record into ``DIR`` (and one per
control message into ``DIR/control``); the files in ``spec/jsonschema/`` are generated this way
(``make schemas``) and a test keeps them equal to the structs. Every property carries its field's
``msgspec.Meta`` description, the same text as the spec's tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from schemas.control import (
    AcknowledgeRequest,
    Capabilities,
    CommitRequest,
    CommitResponse,
    ControlError,
    ControlRequest,
    DiscardRequest,
    PhaseResponse,
    RestoreRequest,
    RestoreResponse,
)
from schemas.controller import LoaderPlace, RecoveryLedgerRecord, ReplayIndexEntry
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.manifest import CommitRecord, LatestHint, Manifest, PartManifest, PartReceipt, StoreMarker

#: Every persisted record, by the name its schema file carries.
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

#: The control protocol's messages (HTTP bodies, not files), exported for servers in other languages.
CONTROL_MESSAGES: dict[str, Any] = {
    "Capabilities": Capabilities,
    "ControlRequest": ControlRequest,
    "CommitRequest": CommitRequest,
    "CommitResponse": CommitResponse,
    "RestoreRequest": RestoreRequest,
    "RestoreResponse": RestoreResponse,
    "AcknowledgeRequest": AcknowledgeRequest,
    "DiscardRequest": DiscardRequest,
    "PhaseResponse": PhaseResponse,
    "ControlError": ControlError,
}


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one record or control message."""
    if name in RECORDS:
        schema, sid = msgspec.json.schema(RECORDS[name]), f"snapformat/1/{name}.schema.json"
        comment = "Specified in spec/SPEC.md; section numbers (§) are SPEC's, 'CONTROL §' are spec/CONTROL.md's."
    else:
        schema, sid = msgspec.json.schema(CONTROL_MESSAGES[name]), f"snapformat/1/control/{name}.schema.json"
        comment = "Specified in spec/CONTROL.md; section numbers (§) are CONTROL's, 'SPEC §' are spec/SPEC.md's."
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = sid
    schema["$comment"] = comment
    return schema


def render(name: str) -> str:
    return json.dumps(json_schema(name), indent=2, sort_keys=True) + "\n"


def export(directory: str | Path) -> list[Path]:
    """Write every record's schema into ``directory``; returns the files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for names, folder in ((RECORDS, out), (CONTROL_MESSAGES, out / "control")):
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            path = folder / f"{name}.schema.json"
            path.write_text(render(name))
            written.append(path)
    return written
