"""The golden stores must stay readable: ``spec/examples/store-v1`` (what format 1.0 writers
produced: token-capture files of version 1) and ``spec/examples/store-v1.1`` (the current writer's).
The writer must keep producing the newest one's exact bytes: an accidental format change fails here."""

from __future__ import annotations

import importlib.util
import json
import typing
from pathlib import Path

import msgspec
import pytest

from schemas import AgentContinuationRoot, capture_key
from schemas.manifest import FileKind
from schemas.rows import DATAPLANE_SCHEMA, TOKEN_CAPTURE_SCHEMA, TOKEN_CAPTURE_SCHEMA_V1, TRAINING_SCHEMA
from schemas.version import FORMAT_VERSION
from snapformat import SnapshotStore, example, open_snapshot, verify_snapshot
from snapformat.checksum import checksum_bytes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "spec" / "examples"
#: Each golden store, with the format version its manifests carry.
STORES = {"store-v1": "1.0", "store-v1.1": FORMAT_VERSION}
NEWEST = "store-v1.1"
GYM_LINE = ('{"schema_version": 1, "rollout_id": "p7_g2", "attempt_index": 0, "capture_key": "p7_g2", '
            '"last_committed_model_call_id": "call-2", "resource_state_revisions": {"tools": 3}}')
#: Files that carry times or random ids, so they differ between two runs of the generator.
VOLATILE_KINDS = {"part_manifest"}


def _generator():
    spec = importlib.util.spec_from_file_location("generate_examples", ROOT / "spec" / "generate_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=sorted(STORES))
def golden(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def store(golden: str) -> SnapshotStore:
    s = SnapshotStore(str(EXAMPLES / golden))
    s.check_marker()
    return s


@pytest.fixture(scope="module")
def snaps(store):
    return {c.sequence: store.open(c.sequence) for c in store.list()}


def test_list_and_latest(golden, store, snaps):
    commits = store.list()
    assert [c.sequence for c in commits] == [2, 1]
    latest = store.latest()
    assert latest.sequence == 2 and latest.manifest.snapshot_id == commits[0].snapshot_id
    assert store.latest_matching(example.TOPOLOGY).sequence == 2
    first, second = snaps[1].manifest, snaps[2].manifest
    assert first.parent is None
    assert second.parent is not None and (second.parent.snapshot_id, second.parent.sequence) == (first.snapshot_id, 1)
    for m in (first, second):
        assert m.format_version == STORES[golden]
        assert m.topology_fingerprint == example.TOPOLOGY
    assert first.required_features == []
    # The newest store's second snapshot holds NeMo-RL staging rows: the format 1.1 feature.
    assert second.required_features == (["dataplane_rows"] if golden == NEWEST else [])
    # open by location, as `ls` prints it
    assert open_snapshot(snaps[2].url).manifest == second


def test_gym_commit_matches_part_manifests(snaps):
    for snap in snaps.values():
        parts = {f.path: f for f in snap.files("part_manifest")}
        gym = snap.manifest.gym_commit
        assert [(p.component, p.name) for p in gym.participants] == [(c["component"], c["name"]) for c in example.CONTRACTS]
        for p in gym.participants:
            entry = parts[f"{p.part_prefix}/part-manifest.json"]
            assert entry.checksum == p.part_manifest_checksum


def test_every_part_kind_reads(golden, snaps):
    for seq, snap in snaps.items():
        kinds = {f.kind for f in snap.manifest.files}
        with_dataplane = golden == NEWEST and seq == 2
        assert kinds == set(typing.get_args(FileKind)) - (set() if with_dataplane else {"dataplane_rows"}), seq
        if with_dataplane:
            staging = snap.read_table("dataplane")
            assert staging.schema.names[:len(DATAPLANE_SCHEMA)] == DATAPLANE_SCHEMA.names
            assert {"token_ids_delta", "prev_len", "delta_len", "cum_len", "weight_version"} <= set(staging.schema.names)
        for entry in snap.files("part_manifest"):
            assert snap.read_bytes(entry)  # size and checksum checked
        training = snap.read_table("training")
        assert training.schema.names[: len(TRAINING_SCHEMA)] == TRAINING_SCHEMA.names
        assert training.num_rows == sum(f.records for f in snap.files("training_rows")) > 0
        tokens = snap.read_table("tokens")
        token_schema = TOKEN_CAPTURE_SCHEMA if golden == NEWEST else TOKEN_CAPTURE_SCHEMA_V1
        assert tokens.schema.names[: len(token_schema)] == token_schema.names
        assert tokens.num_rows == sum(f.records for f in snap.files("token_capture_rows")) > 0
        for kind in ("continuations", "agent_state", "model_ledger", "token_index", "session_state",
                     "replay_index", "recovery_ledger"):
            for entry in snap.files(kind):
                assert len(list(snap.iter_records(entry))) == entry.records > 0, (seq, entry.path)
        (loader,) = snap.records("loader")
        assert loader.seed == {1: 7, 2: 8}[seq] and loader.consumed == 3
        tags = {type(r).__name__ for r in snap.records("recovery_ledger")}
        assert tags == {"PromptGroup", "RolloutAttempt", "AckOwed"}


def test_both_json_lines_encodings(snaps):
    encodings = {(f.path, f.compression) for s in snaps.values() for f in s.manifest.files if f.kind == "session_state"}
    assert ("gym/resource/tools/sessions.jsonl", "none") in encodings
    assert ("bulk/sessions.jsonl.zst", "zstd") in encodings
    (bulk,) = [f for f in snaps[2].files("session_state") if f.compression == "zstd"]
    assert bulk.content_size > 256 * 1024 > bulk.size
    records = list(snaps[2].iter_records(bulk))
    assert len(records) == bulk.records == 1800
    assert records[0].session_id == "bulk-00000"


def test_verify_ok(snaps):
    for snap in snaps.values():
        report = verify_snapshot(snap)
        assert report.ok, report.problems
        assert report.files_checked == len(snap.manifest.files)


def test_gym_continuation_line_semantics():
    rec = msgspec.json.decode(GYM_LINE, type=AgentContinuationRoot)
    assert (rec.rollout_id, rec.attempt_index, rec.capture_key) == ("p7_g2", 0, "p7_g2")
    assert rec.last_committed_model_call_id == "call-2"
    assert rec.resource_state_revisions == {"tools": 3}
    # reads back unchanged
    assert json.loads(msgspec.json.encode(rec)) == json.loads(GYM_LINE)
    # on restore it runs again as run 1, with the capture key Gym gives run 1
    assert capture_key(rec.rollout_id, rec.attempt_index + 1) == "p7_g2-a1"


def test_continuations_resolve_in_golden(snaps):
    for snap in snaps.values():
        conts = snap.records("continuations")
        assert conts
        state = {r.capture_key: r for r in snap.records("agent_state")}
        ledger = {(r.capture_key, r.model_call_id) for r in snap.records("model_ledger")}
        sessions = {(s.rollout_id, s.resource): s for s in snap.records("session_state") if s.resource == "tools"}
        for c in conts:
            assert capture_key(c.rollout_id, c.attempt_index) == c.capture_key
            assert state[c.capture_key].status == "parked"
            assert (c.capture_key, c.last_committed_model_call_id) in ledger
            rows = snap.token_rows(c.capture_key, c.last_committed_model_call_id)
            assert rows.num_rows == 1
            assert rows.column("model_call_id")[0].as_py() == c.last_committed_model_call_id
            assert sessions[(c.rollout_id, "tools")].state_revision == c.resource_state_revisions["tools"]


def test_regenerated_data_files_are_byte_identical(tmp_path):
    """Only the newest store: the older ones are what older writers produced."""
    newest = SnapshotStore(str(EXAMPLES / NEWEST))
    snaps = {c.sequence: newest.open(c.sequence) for c in newest.list()}
    gen = _generator()
    assert (gen.COUNT, gen.SEEDS) == (12, (7, 8))
    gen.write_store(tmp_path / "store")
    fresh = SnapshotStore(str(tmp_path / "store"))
    assert [c.sequence for c in fresh.list()] == sorted(snaps, reverse=True)
    for seq, golden in snaps.items():
        new = fresh.open(seq)
        want = {f.path: f for f in golden.manifest.files if f.kind not in VOLATILE_KINDS}
        got = {f.path: f for f in new.manifest.files if f.kind not in VOLATILE_KINDS}
        assert sorted(got) == sorted(want), seq
        for path, entry in want.items():
            fresh_entry = got[path]
            assert (fresh_entry.checksum, fresh_entry.size, fresh_entry.records) == \
                (entry.checksum, entry.size, entry.records), f"sequence {seq}: {path} changed"
            assert checksum_bytes(new.read_bytes(fresh_entry)) == entry.checksum
        assert {f.path for f in new.manifest.files} == {f.path for f in golden.manifest.files}
