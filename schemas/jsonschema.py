"""JSON Schema for every persisted record, so that a service in another language can write its part.

``python -m schemas DIR`` writes one ``<Record>.schema.json`` per record into ``DIR``; the files in
``spec/schemas/`` are generated this way and a test keeps them equal to the structs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from schemas.controller import LoaderPlace, RecoveryLedgerRecord, ReplayIndexEntry
from schemas.gym_records import (
    AgentContinuationRoot, AgentStateRecord, ModelLedgerEntry, SessionStateRecord, TokenIndexEntry,
)
from schemas.manifest import CommitRecord, LatestHint, Manifest, PartManifest, StoreMarker

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
}


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one record."""
    schema = msgspec.json.schema(RECORDS[name])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"snapformat/1/{name}.schema.json"
    return schema


def render(name: str) -> str:
    return json.dumps(json_schema(name), indent=2, sort_keys=True) + "\n"


def export(directory: str | Path) -> list[Path]:
    """Write every record's schema into ``directory``; returns the files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in RECORDS:
        path = out / f"{name}.schema.json"
        path.write_text(render(name))
        written.append(path)
    return written
