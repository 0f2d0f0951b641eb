"""Which record type each file kind holds, and how it is stored."""

from __future__ import annotations

from typing import Any

from schemas.controller import LoaderPlace, RecoveryLedgerRecord, ReplayIndexEntry
from schemas.gym_records import (
    AgentContinuationRoot, AgentStateRecord, ModelLedgerEntry, SessionStateRecord, TokenIndexEntry,
)
from schemas.manifest import JSON_KINDS, JSONL_KINDS, ROW_KINDS, PartManifest

RECORD_TYPES: dict[str, Any] = {
    "continuations": AgentContinuationRoot,
    "agent_state": AgentStateRecord,
    "model_ledger": ModelLedgerEntry,
    "token_index": TokenIndexEntry,
    "session_state": SessionStateRecord,
    "replay_index": ReplayIndexEntry,
    "recovery_ledger": RecoveryLedgerRecord,
    "loader_place": LoaderPlace,
    "part_manifest": PartManifest,
}

#: Short names accepted by ``snapformat cat`` / ``export`` and ``Snapshot.records``.
ALIASES: dict[str, str] = {
    "continuations": "continuations",
    "agent": "agent_state",
    "agent_state": "agent_state",
    "ledger": "model_ledger",
    "model_ledger": "model_ledger",
    "token_index": "token_index",
    "index": "token_index",
    "sessions": "session_state",
    "session_state": "session_state",
    "loader": "loader_place",
    "loader_place": "loader_place",
    "replay": "replay_index",
    "replay_index": "replay_index",
    "recovery": "recovery_ledger",
    "recovery_ledger": "recovery_ledger",
    "training": "training_rows",
    "training_rows": "training_rows",
    "tokens": "token_capture_rows",
    "token_capture_rows": "token_capture_rows",
    "dataplane": "dataplane_rows",
    "dataplane_rows": "dataplane_rows",
}


#: A file a Gym participant wrote itself into ``checkpoint_dir`` (CONTROL.md §6) and the publisher
#: adopted as it is (``snapformat.adopt``): Gym's layout and bytes, bound by Gym's own
#: ``manifest.json``. Its ``records`` are the members of a ``.tar``, the non-blank lines of a
#: ``.jsonl``, else 1. A reader that does not know the kind ignores it; verification checks its
#: bytes and that count.
GYM_FILE_KIND = "gym_file"
GYM_KINDS = frozenset({GYM_FILE_KIND})


def storage_of(kind: str) -> str:
    """``rows``, ``jsonl``, ``json``, ``gym`` (Gym's own files) or ``unknown`` (a kind from a newer
    minor version)."""
    if kind in GYM_KINDS:
        return "gym"
    if kind in ROW_KINDS:
        return "rows"
    if kind in JSONL_KINDS:
        return "jsonl"
    if kind in JSON_KINDS:
        return "json"
    return "unknown"
