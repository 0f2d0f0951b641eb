"""Persisted records: JSON round trips, Gym's continuation line, and forward compatibility.

Proves that:
- every persisted record type (Gym's records, the controller's records, the recovery-ledger union,
  manifests, part manifests, commit records, the hint and the store marker) survives
  msgspec JSON encode -> typed decode unchanged, for Hypothesis-generated values, both in compact
  form and in the indented form the library writes;
- the recovery-ledger union keeps each member's type through its ``record`` tag;
- Gym's own continuation line decodes, re-encodes to the same JSON value (same keys, same order),
  and reads back unchanged through a published snapshot;
- unknown fields in persisted records are ignored (a newer minor version may add some);
- a record that breaks Gym's identity rule is refused on decode with a typed error naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.controller import (
    AckOwed, LoaderPlace, PromptGroup, RecoveryLedgerRecord, ReplayIndexEntry, RolloutAttempt,
)
from schemas.errors import InvalidRecordError, VersionError
from schemas.gym_records import (
    AgentContinuationRoot, AgentStateRecord, ModelLedgerEntry, SessionStateRecord, TokenIndexEntry,
)
from schemas.identity import capture_key
from schemas.manifest import (
    CommitRecord, FileEntry, GymCommit, LatestHint, Manifest, ParentRef, PartManifest,
    ParticipantCommit, StoreMarker,
)
from snapformat import SnapshotStore, jsonl

GYM_LINE = (
    '{"schema_version": 1, "rollout_id": "p7_g2", "attempt_index": 0, "capture_key": "p7_g2", '
    '"last_committed_model_call_id": "call-2", "resource_state_revisions": {"tools": 3}}'
)

# ---- strategies --------------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
NON_NEG = st.integers(0, 2**63 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=40)
NAMES = st.text(min_size=1, max_size=40)
CALL_IDS = st.text(min_size=1, max_size=40)
ID_FIRST, ID_CHARS = "abcXYZ019", "abcXYZ019._-"
ROLLOUT_IDS = st.builds(lambda a, b: a + b, st.text(ID_FIRST, min_size=1, max_size=1),
                        st.text(ID_CHARS, max_size=20)).filter(lambda s: not _has_attempt_suffix(s))
SAFE_NAMES = st.builds(lambda a, b: a + b, st.text(ID_FIRST, min_size=1, max_size=1),
                       st.text(ID_CHARS, max_size=10)).filter(lambda s: not s.endswith("."))
REL_PATHS = st.lists(SAFE_NAMES, min_size=1, max_size=4).map("/".join)
HEX = "0123456789abcdef"
CHECKSUMS = st.one_of(st.text(HEX, min_size=32, max_size=32).map("xxh128:".__add__),
                      st.text(HEX, min_size=64, max_size=64).map("sha256:".__add__))
FINGERPRINTS = st.text(HEX, min_size=64, max_size=64).map("sha256:".__add__)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | INT64 | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def _has_attempt_suffix(s: str) -> bool:
    head, sep, tail = s.rpartition("-a")
    return bool(sep) and tail.isdigit() and tail.isascii()


@st.composite
def identities(draw: st.DrawFn) -> dict[str, Any]:
    """rollout_id, attempt_index and a capture key Gym accepts for them (not always the newest)."""
    rid = draw(ROLLOUT_IDS)
    attempt = draw(st.integers(0, 6))
    key_attempt = draw(st.integers(0, attempt))
    return {"rollout_id": rid, "attempt_index": attempt, "capture_key": capture_key(rid, key_attempt)}


def continuations() -> st.SearchStrategy[AgentContinuationRoot]:
    return st.builds(lambda ident, call, revs: AgentContinuationRoot(
        **ident, last_committed_model_call_id=call, resource_state_revisions=revs),
        identities(), CALL_IDS, st.none() | st.dictionaries(TEXT, INT64, max_size=4))


def agent_states() -> st.SearchStrategy[AgentStateRecord]:
    return st.builds(lambda ident, status, turn, state, ro: AgentStateRecord(
        **ident, status=status, turn_index=turn, state=state, restart_only=ro),
        identities(), st.sampled_from(["parked", "finished_unacked"]), NON_NEG, JSON_VALUES,
        st.lists(NAMES, max_size=3))


def ledger_entries() -> st.SearchStrategy[ModelLedgerEntry]:
    return st.builds(lambda ident, call, parent, turn, model, at: ModelLedgerEntry(
        **ident, model_call_id=call, parent_call_id=parent, turn_index=turn, model=model, created_at=at),
        identities(), CALL_IDS, st.none() | CALL_IDS, NON_NEG, TEXT, FLOATS)


def token_index_entries() -> st.SearchStrategy[TokenIndexEntry]:
    return st.builds(lambda ident, call, path, batch, start, count: TokenIndexEntry(
        capture_key=ident["capture_key"], model_call_id=call, file=path, batch=batch, row_start=start,
        row_count=count), identities(), CALL_IDS, REL_PATHS, NON_NEG, NON_NEG, st.integers(1, 2**40))


def session_states() -> st.SearchStrategy[SessionStateRecord]:
    return st.builds(lambda sid, res, rev, rid, state, tool: SessionStateRecord(
        session_id=sid, resource=res, state_revision=rev, rollout_id=rid, state=state, tool=tool),
        TEXT, NAMES, NON_NEG, st.none() | ROLLOUT_IDS, JSON_VALUES, st.none() | NAMES)


def loader_places() -> st.SearchStrategy[LoaderPlace]:
    return st.builds(lambda e, c, s, n, x: LoaderPlace(epoch=e, consumed=c, seed=s, dataset_size=n, extra=x),
                     NON_NEG, NON_NEG, INT64, st.none() | NON_NEG, st.dictionaries(TEXT, JSON_VALUES, max_size=3))


def replay_entries() -> st.SearchStrategy[ReplayIndexEntry]:
    return st.builds(lambda key, part, ident, group, status: ReplayIndexEntry(
        key=key, partition_id=part, rollout_id=ident["rollout_id"], attempt_index=ident["attempt_index"],
        group_id=group, status=status), TEXT, TEXT, identities(), TEXT,
        st.sampled_from(["ready", "claimed_for_training", "applied_uncheckpointed"]))


def ledger_records() -> st.SearchStrategy[Any]:
    groups = st.builds(lambda g, i, s, rids: PromptGroup(group_id=g, prompt_index=i, state=s, rollout_ids=rids),
                       TEXT, NON_NEG, st.sampled_from(["generating", "ready_to_finalize", "finalizing",
                                                       "finalization_unknown", "finalized",
                                                       "claimed_for_training", "applied_uncheckpointed"]),
                       st.lists(ROLLOUT_IDS, max_size=4))
    attempts = st.builds(lambda ident, g, s: RolloutAttempt(rollout_id=ident["rollout_id"], group_id=g,
                                                            attempt_index=ident["attempt_index"], state=s),
                         identities(), TEXT, st.sampled_from(["reserved", "dispatched", "sealed", "failed",
                                                              "abandoned"]))
    acks = st.builds(lambda ident, key: AckOwed(rollout_id=ident["rollout_id"], attempt_index=ident["attempt_index"],
                                                result_key=key), identities(), TEXT)
    return st.one_of(groups, attempts, acks)


def file_entries() -> st.SearchStrategy[FileEntry]:
    return st.builds(lambda path, kind, size, ck, n, comp, cs, b, w: FileEntry(
        path=path, kind=kind, size=size, checksum=ck, records=n, compression=comp, content_size=cs, batches=b,
        writer=w), REL_PATHS, TEXT, NON_NEG, CHECKSUMS, NON_NEG, st.sampled_from(["none", "zstd"]),
        st.none() | NON_NEG, st.none() | NON_NEG, TEXT)


def part_manifests() -> st.SearchStrategy[PartManifest]:
    return st.builds(lambda v, sid, prefix, w, files, at: PartManifest(
        format_version=v, snapshot_id=sid, prefix=prefix, writer=w, files=files, written_at=at),
        TEXT, NAMES, REL_PATHS, TEXT, st.lists(file_entries(), max_size=3), FLOATS)


def gym_commits() -> st.SearchStrategy[GymCommit]:
    participant = st.builds(lambda c, n, p, ck, pay: ParticipantCommit(
        component=c, name=n, part_prefix=p, part_manifest_checksum=ck, payload=pay),
        TEXT, NAMES, st.none() | REL_PATHS, st.none() | CHECKSUMS, st.dictionaries(TEXT, JSON_VALUES, max_size=3))
    return st.builds(lambda cid, ps: GymCommit(checkpoint_id=cid, participants=ps), TEXT,
                     st.lists(participant, max_size=3))


def manifests() -> st.SearchStrategy[Manifest]:
    return st.builds(lambda v, feats, sid, seq, c, cm, files, gym, fp, parent, timings, prod: Manifest(
        format_version=v, required_features=feats, snapshot_id=sid, sequence=seq, created_at=c, committed_at=cm,
        files=files, gym_commit=gym, topology_fingerprint=fp, parent=parent, timings_s=timings, producer=prod),
        TEXT, st.lists(TEXT, max_size=2), NAMES, st.integers(1, 2**63 - 1), FLOATS, FLOATS,
        st.lists(file_entries(), max_size=4), st.none() | gym_commits(), st.none() | FINGERPRINTS,
        st.none() | st.builds(lambda s, n: ParentRef(snapshot_id=s, sequence=n), NAMES, NON_NEG),
        st.dictionaries(TEXT, FLOATS, max_size=3), TEXT)


def commit_records() -> st.SearchStrategy[CommitRecord]:
    return st.builds(lambda v, seq, sid, size, ck, at: CommitRecord(
        format_version=v, sequence=seq, snapshot_id=sid, manifest_size=size, manifest_checksum=ck, committed_at=at),
        TEXT, st.integers(1, 2**63 - 1), NAMES, NON_NEG, CHECKSUMS, FLOATS)


#: (decode type, strategy) for every persisted record.
RECORD_CASES: dict[str, tuple[Any, st.SearchStrategy[Any]]] = {
    "AgentContinuationRoot": (AgentContinuationRoot, continuations()),
    "AgentStateRecord": (AgentStateRecord, agent_states()),
    "ModelLedgerEntry": (ModelLedgerEntry, ledger_entries()),
    "TokenIndexEntry": (TokenIndexEntry, token_index_entries()),
    "SessionStateRecord": (SessionStateRecord, session_states()),
    "LoaderPlace": (LoaderPlace, loader_places()),
    "ReplayIndexEntry": (ReplayIndexEntry, replay_entries()),
    "RecoveryLedgerRecord": (RecoveryLedgerRecord, ledger_records()),
    "Manifest": (Manifest, manifests()),
    "PartManifest": (PartManifest, part_manifests()),
    "CommitRecord": (CommitRecord, commit_records()),
    "LatestHint": (LatestHint, st.builds(lambda s, i: LatestHint(sequence=s, snapshot_id=i),
                                         st.integers(1, 2**63 - 1), NAMES)),
    "StoreMarker": (StoreMarker, st.just(StoreMarker())),
}


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(RECORD_CASES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_record_round_trips_through_json(name: str, data: st.DataObject) -> None:
    record_type, strategy = RECORD_CASES[name]
    record = data.draw(strategy)
    compact = msgspec.json.encode(record)
    assert msgspec.json.Decoder(record_type).decode(compact) == record
    # The indented form the library writes decodes to the same record, through its typed decoder.
    assert jsonl.decode_json(jsonl.encode_json(record), record_type, "test") == record


@settings(max_examples=60, deadline=None)
@given(record=ledger_records())
def test_recovery_ledger_union_keeps_each_member_type(record: Any) -> None:
    encoded = msgspec.json.encode(record)
    tag = json.loads(encoded)["record"]
    assert tag == {PromptGroup: "prompt_group", RolloutAttempt: "rollout_attempt", AckOwed: "ack_owed"}[type(record)]
    decoded = msgspec.json.Decoder(RecoveryLedgerRecord).decode(encoded)
    assert type(decoded) is type(record) and decoded == record


def test_recovery_ledger_union_refuses_an_unknown_tag() -> None:
    with pytest.raises(InvalidRecordError, match="record"):
        jsonl.decode_json(b'{"record": "mystery", "rollout_id": "p1"}', RecoveryLedgerRecord, "ledger.jsonl")


# Gym's AgentContinuationRoot is the one persisted record that refuses unknown fields (Gym's rule,
# tested above); every record of our own ignores them so that a newer minor version can add some.
@pytest.mark.parametrize("name", sorted(set(RECORD_CASES) - {"StoreMarker", "AgentContinuationRoot"}))
@settings(max_examples=20, deadline=None)
@given(data=st.data(), extra=JSON_VALUES)
def test_unknown_fields_are_ignored(name: str, data: st.DataObject, extra: Any) -> None:
    record_type, strategy = RECORD_CASES[name]
    record = data.draw(strategy)
    obj = json.loads(msgspec.json.encode(record))
    obj["field_from_a_newer_minor_version"] = extra
    obj["another_one"] = {"nested": [1, 2, 3]}
    assert msgspec.json.Decoder(record_type).decode(json.dumps(obj).encode()) == record


def test_store_marker_ignores_unknown_fields() -> None:
    data = b'{"format": "snapformat-store", "format_version": "1.0", "created_by": "a newer writer"}'
    assert jsonl.decode_json(data, StoreMarker, "snapformat-store.json") == StoreMarker()


# ---- Gym's continuation line -------------------------------------------------------------------

def test_gym_continuation_line_decodes_and_reencodes_to_the_same_json() -> None:
    record = jsonl.decode_json(GYM_LINE.encode(), AgentContinuationRoot, "continuations.jsonl")
    assert record == AgentContinuationRoot(rollout_id="p7_g2", attempt_index=0, capture_key="p7_g2",
                                           last_committed_model_call_id="call-2",
                                           resource_state_revisions={"tools": 3})
    again = json.loads(msgspec.json.encode(record))
    original = json.loads(GYM_LINE)
    assert again == original
    assert list(again) == list(original)  # Gym's field order, exactly


def test_gym_continuation_line_reads_back_through_a_published_snapshot(tmp_path: Path) -> None:
    record = jsonl.decode_json(GYM_LINE.encode(), AgentContinuationRoot, "continuations.jsonl")
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    part = draft.part("gym/agent/agent0")
    entry = part.write_records("continuations", "continuations", [record], compress="none")
    draft.publish()
    snap = store.latest()
    assert snap is not None
    assert snap.records("continuations") == [record]
    # The stored line is Gym's line (same JSON value), so Gym itself could read the file.
    stored = (tmp_path / "store" / "snapshots" / snap.manifest.snapshot_id / entry.path).read_bytes()
    assert [json.loads(line) for line in stored.splitlines()] == [json.loads(GYM_LINE)]


#: The design note's line as Gym writes it: compact JSON, no spaces (its sha256 covers these bytes).
GYM_COMPACT_LINE = (b'{"schema_version":1,"rollout_id":"p7_g2","attempt_index":0,"capture_key":"p7_g2",'
                    b'"last_committed_model_call_id":"call-2","resource_state_revisions":{"tools":3}}')


def test_gym_compact_continuation_line_reencodes_to_the_same_bytes() -> None:
    record = jsonl.decode_json(GYM_COMPACT_LINE, AgentContinuationRoot, "continuations.jsonl")
    assert msgspec.json.encode(record) == GYM_COMPACT_LINE


@pytest.mark.parametrize(("change", "field"), [
    ({"last_committed_model_call_id": None}, "last_committed_model_call_id"),  # Gym: a non-empty string
    ({"last_committed_model_call_id": ""}, "last_committed_model_call_id"),
    ({"surprise": 1}, "surprise"),  # Gym's AgentContinuationRoot forbids unknown fields
    ({"schema_version": 2}, "schema_version 2"),  # Gym: literal 1 (a VersionError naming both versions)
])
def test_a_continuation_gym_would_refuse_is_refused(change: dict[str, Any], field: str) -> None:
    obj = json.loads(GYM_LINE) | change
    with pytest.raises((InvalidRecordError, VersionError)) as err:
        list(jsonl.iter_records(json.dumps(obj).encode() + b"\n", AgentContinuationRoot,
                                "gym/agent/agent0/continuations.jsonl", "none", None))
    assert field in str(err.value) and "continuations.jsonl" in str(err.value)


def test_a_continuation_without_revisions_defaults_them_to_null_as_gym_does() -> None:
    obj = json.loads(GYM_LINE)
    del obj["resource_state_revisions"]
    record = jsonl.decode_json(json.dumps(obj).encode(), AgentContinuationRoot, "continuations.jsonl")
    assert record.resource_state_revisions is None
    obj = json.loads(GYM_LINE) | {"resource_state_revisions": {}}
    assert jsonl.decode_json(json.dumps(obj).encode(), AgentContinuationRoot, "c").resource_state_revisions == {}


@pytest.mark.parametrize("change", [
    {"capture_key": "p7_g2-a1"},  # attempt 0 cannot own attempt 1's key
    {"rollout_id": "p7_g2-a1", "capture_key": "p7_g2-a1"},
    {"capture_key": "p7_g3"},
    {"rollout_id": "../p7"},
])
def test_a_continuation_breaking_gyms_rule_is_refused_on_decode(change: dict[str, Any]) -> None:
    obj = json.loads(GYM_LINE) | change
    with pytest.raises(InvalidRecordError) as err:
        jsonl.decode_json(json.dumps(obj).encode(), AgentContinuationRoot, "gym/agent/agent0/continuations.jsonl")
    message = str(err.value)
    assert "gym/agent/agent0/continuations.jsonl" in message
    assert "rollout_id" in message or "capture_key" in message


@pytest.mark.parametrize(("record_type", "obj", "field"), [
    (AgentContinuationRoot, json.loads(GYM_LINE) | {"attempt_index": -1}, "attempt_index"),
    (AgentContinuationRoot, json.loads(GYM_LINE) | {"resource_state_revisions": {"tools": "3"}},
     "resource_state_revisions"),
    (TokenIndexEntry, {"capture_key": "k", "model_call_id": "c", "file": "../../etc/passwd", "batch": 0,
                       "row_start": 0, "row_count": 1}, "file"),
    (TokenIndexEntry, {"capture_key": "k", "model_call_id": "c", "file": "a/t.arrow", "batch": 0,
                       "row_start": 0, "row_count": 0}, "row_count"),
    (Manifest, {"format_version": "1.0", "snapshot_id": "s", "sequence": 0, "created_at": 0, "committed_at": 0,
                "files": []}, "sequence"),
    (CommitRecord, {"format_version": "1.0", "sequence": 1, "snapshot_id": "s", "manifest_size": 1,
                    "manifest_checksum": "md5:abc", "committed_at": 0}, "manifest_checksum"),
])
def test_invalid_fields_are_refused_naming_the_field(record_type: Any, obj: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRecordError) as err:
        jsonl.decode_json(json.dumps(obj).encode(), record_type, "some/file.json")
    assert "some/file.json" in str(err.value) and field in str(err.value)


@pytest.mark.parametrize("value", [
    "sha256:" + "a" * 64 + "\n",  # Python's `$` alone would take this: the spec's patterns are whole-string
    "xxh128:" + "0" * 32 + "\n",
    " sha256:" + "a" * 64,
])
def test_a_checksum_with_anything_around_it_is_refused(value: str) -> None:
    from schemas.manifest import Checksum

    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(value), type=Checksum)
