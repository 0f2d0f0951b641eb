"""The golden stores must stay readable, and the writer must keep producing the newest one's bytes.

``spec/examples/`` holds one store per format version that changed what is written (SPEC §13.1):

- ``store-v1`` (format 1.0: token-capture files of version 1) and ``store-v1.1`` (format 1.1:
  version 2 token files, ``dataplane_rows``) hold Gym parts of this project's own kinds
  (``gym/<component>/<name>/``, SPEC §12.3 to §12.7) and the fingerprint of that writer's recipe.
  They are read and verified unchanged: every part kind, the continuation semantics, the token index.
- ``store-v1.2`` (format 1.2) and ``store-v1.3`` (format 1.3, the current writer) hold Gym's own
  files adopted as parts (``gym_file``, SPEC §12.11, CONTROL.md §9), ``gym_commit`` with Gym's
  component names and each commit reply verbatim, and NeMo-RL's fingerprint. Their Gym folders are
  checked with gymkit's readers (every digest and reference), resolve against each other and the
  data plane, come back byte for byte from gymkit's writers and from a download
  (``materialize_gym``), and ``snapformat verify``, ``show`` and ``cat SNAP continuations`` work on
  them.
- ``store-v1.3`` is incremental (feature ``shared_objects``, SPEC §12.12, §14.2): the data plane's
  rows are segments under ``objects/``; the second snapshot lists the first's token-capture segment
  again, its training segment again narrowed by a ``row_range``, and one new segment of each kind.
  Every object is named by the SHA-256 of its bytes and checked by them, never trusted by its name;
  a damaged one is named with each snapshot that lists it; a 1.2 reader refuses the store naming
  the feature and both versions. The writer with incremental saves off (``write_example``) still
  writes the data files of ``store-v1.2`` byte for byte.

Across versions: a 1.2 restore refuses the older stores by their topology fingerprint, and a 1.1
restore (its recipe recomputed here) refuses the 1.2 store, which is why ``gym_file`` needs no
required feature (SPEC §13.1). The generator must reproduce every data file and object of the
newest store byte for byte (only part manifests, manifests and commit records carry times and
random ids).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import typing
from pathlib import Path

import msgspec
import pytest

from schemas import AgentContinuationRoot, capture_key, version
from schemas.control import AgentCommitResponse, ModelCommitResponse, ResourcesCommitResponse
from schemas.controller import PromptGroup
from schemas.errors import CorruptSnapshotError, TopologyMismatchError, VersionError
from schemas.gym_files import agent_instance_dir, ledger_dir, resources_dir
from schemas.manifest import FileKind
from schemas.rows import DATAPLANE_SCHEMA, TOKEN_CAPTURE_SCHEMA, TOKEN_CAPTURE_SCHEMA_V1, TRAINING_SCHEMA
from schemas.version import FORMAT_VERSION, PART_LISTINGS, SHARED_OBJECTS, features_of_kinds
from snapformat import SnapshotStore, example, layout, open_snapshot, verify_snapshot
from snapformat.adopt import gym_prefixes, materialize_gym
from snapformat.checksum import checksum_bytes
from snapformat.cli import main as snapformat_main
from snapformat.kinds import GYM_FILE_KIND
from snapformat.token_rows import batch_entries

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "spec" / "examples"
#: Each golden store, with the format version its manifests carry.
STORES = {"store-v1": "1.0", "store-v1.1": "1.1", "store-v1.2": "1.2", "store-v1.3": "1.3",
          "store-v1.4": FORMAT_VERSION}
NEWEST = "store-v1.4"
#: Stores whose Gym parts are this project's own kinds (format 1.0 and 1.1 writers).
LEGACY = {"store-v1", "store-v1.1"}
#: Stores whose Gym parts are Gym's own files (format 1.2 on).
GYM_STORES = ("store-v1.2", "store-v1.3", "store-v1.4")
#: Stores whose data-plane rows are shared objects (format 1.3 on, incremental).
INCREMENTAL = {"store-v1.3", "store-v1.4"}
#: Stores whose manifests list Gym's parts by their part manifests (format 1.4 on, SPEC §10.4).
LISTED = {"store-v1.4"}
#: The loader place's ``consumed`` (prompt groups so far) of each sequence.
CONSUMED = {"store-v1.3": {1: 3, 2: 6}, "store-v1.4": {1: 3, 2: 6}}
GYM_LINE = ('{"schema_version": 1, "rollout_id": "p7_g2", "attempt_index": 0, "capture_key": "p7_g2", '
            '"last_committed_model_call_id": "call-2", "resource_state_revisions": {"tools": 3}}')
#: Files that carry times or random ids, so they differ between two runs of the generator.
VOLATILE_KINDS = {"part_manifest"}
COMMIT_REPLIES = {"responses_api_agents": AgentCommitResponse, "responses_api_models": ModelCommitResponse,
                  "resources_servers": ResourcesCommitResponse}

#: The participants' contracts of the 1.0 and 1.1 example writer, and that writer's fingerprint
#: recipe (a JSON array of the contracts sorted by (component, name), sorted keys, compact, UTF-8).
LEGACY_CONTRACTS = [
    {"component": "agent", "name": "agent0", "schema_version": 1, "checkpoint_mode": "export_restore"},
    {"component": "model", "name": "policy0", "schema_version": 1, "checkpoint_mode": "export_restore"},
    {"component": "resource", "name": "tools", "schema_version": 1, "checkpoint_mode": "export_restore"},
]


def legacy_fingerprint(contracts: list[dict]) -> str:
    items = sorted(contracts, key=lambda c: (str(c["component"]), str(c["name"])))
    text = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


LEGACY_TOPOLOGY = legacy_fingerprint(LEGACY_CONTRACTS)


def _generator():
    spec = importlib.util.spec_from_file_location("generate_examples", ROOT / "spec" / "generate_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _open_all(name: str) -> dict:
    s = SnapshotStore(str(EXAMPLES / name))
    return {c.sequence: s.open(c.sequence) for c in s.list()}


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


@pytest.fixture(scope="module")
def newest():
    return _open_all(NEWEST)


@pytest.fixture(scope="module", params=GYM_STORES)
def gym_store(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gym_snaps(gym_store):
    """The snapshots of a store whose Gym parts are Gym's own files (1.2 and 1.3)."""
    return _open_all(gym_store)


@pytest.fixture(scope="module")
def legacy_snaps():
    return {name: _open_all(name) for name in sorted(LEGACY)}


# -- every store --------------------------------------------------------------------------------------
def test_list_and_latest(golden, store, snaps):
    commits = store.list()
    assert [c.sequence for c in commits] == [2, 1]
    latest = store.latest()
    assert latest.sequence == 2 and latest.manifest.snapshot_id == commits[0].snapshot_id
    first, second = snaps[1].manifest, snaps[2].manifest
    assert first.parent is None
    assert second.parent is not None and (second.parent.snapshot_id, second.parent.sequence) == (first.snapshot_id, 1)
    topology = LEGACY_TOPOLOGY if golden in LEGACY else example.TOPOLOGY
    for m in (first, second):
        assert m.format_version == STORES[golden]
        assert m.topology_fingerprint == topology
        assert m.required_features == features_of_kinds((f.kind for f in m.files),
                                                        objects=any(f.object for f in m.files),
                                                        listed_parts=bool(m.listed_parts))
        assert any(f.object for f in m.files) == (golden in INCREMENTAL)
        assert [p.prefix for p in m.listed_parts] == ([p.part_prefix for p in m.gym_commit.participants]
                                                      if golden in LISTED else [])
    # 1.3's snapshots name shared objects: the format 1.3 feature; 1.4's list Gym's parts by their
    # part manifests: the format 1.4 feature.
    later = sorted(([SHARED_OBJECTS] if golden in INCREMENTAL else []) + ([PART_LISTINGS] if golden in LISTED else []))
    assert first.required_features == later
    # The second snapshot from 1.1 on holds NeMo-RL staging rows: the format 1.1 feature. Gym's
    # files (1.2) need none.
    assert second.required_features == sorted(([] if golden == "store-v1" else ["dataplane_rows"]) + later)
    assert store.latest_matching(topology).sequence == 2
    # open by location, as `ls` prints it
    assert open_snapshot(snaps[2].url).manifest == second


def test_a_restore_refuses_a_store_of_the_other_fingerprint_recipe(golden, store):
    """SPEC §13.1: a 1.2 restore refuses a 1.0 or 1.1 snapshot, and a 1.1 restore a 1.2 snapshot,
    by the topology fingerprint, naming both; the two recipes never give the same value."""
    assert LEGACY_TOPOLOGY != example.TOPOLOGY
    saved, running = (LEGACY_TOPOLOGY, example.TOPOLOGY) if golden in LEGACY else (example.TOPOLOGY, LEGACY_TOPOLOGY)
    with pytest.raises(TopologyMismatchError) as err:
        store.latest_matching(running)
    assert saved in str(err.value) and running in str(err.value)


def test_gym_commit_matches_part_manifests(golden, snaps):
    expected = ([(c["component"], c["name"]) for c in LEGACY_CONTRACTS] if golden in LEGACY
                else [(c.component, c.name) for c in example.CAPABILITIES])
    for snap in snaps.values():
        parts = {f.path: f for f in snap.files("part_manifest")}
        gym = snap.manifest.gym_commit
        assert gym.checkpoint_id == f"ckpt-{snap.sequence}"
        assert [(p.component, p.name) for p in gym.participants] == expected
        for p in gym.participants:
            entry = parts[f"{p.part_prefix}/part-manifest.json"]
            assert entry.checksum == p.part_manifest_checksum


def test_verify_ok(snaps):
    for snap in snaps.values():
        report = verify_snapshot(snap)
        assert report.ok, report.problems
        assert report.files_checked == snap.manifest.file_count


def test_both_json_lines_encodings(golden, snaps):
    legacy = golden in LEGACY
    kind, plain, compressed = (("session_state", "gym/resource/tools/sessions.jsonl", "bulk/sessions.jsonl.zst")
                               if legacy else
                               ("replay_index", "controller/replay_index.jsonl", "bulk/replay_index.jsonl.zst"))
    encodings = {(f.path, f.compression) for s in snaps.values() for f in s.manifest.files if f.kind == kind}
    assert (plain, "none") in encodings
    assert (compressed, "zstd") in encodings
    (bulk,) = [f for f in snaps[2].files(kind) if f.compression == "zstd"]
    assert bulk.content_size > 256 * 1024 > bulk.size
    records = list(snaps[2].iter_records(bulk))
    assert len(records) == bulk.records == (1800 if legacy else 2400)
    assert (records[0].session_id if legacy else records[0].key) == ("bulk-00000" if legacy else "bulk-00000/sample")


def test_gym_continuation_line_semantics():
    rec = msgspec.json.decode(GYM_LINE, type=AgentContinuationRoot)
    assert (rec.rollout_id, rec.attempt_index, rec.capture_key) == ("p7_g2", 0, "p7_g2")
    assert rec.last_committed_model_call_id == "call-2"
    assert rec.resource_state_revisions == {"tools": 3}
    # reads back unchanged
    assert json.loads(msgspec.json.encode(rec)) == json.loads(GYM_LINE)
    # on restore it runs again as run 1, with the capture key Gym gives run 1
    assert capture_key(rec.rollout_id, rec.attempt_index + 1) == "p7_g2-a1"


# -- the 1.0 and 1.1 stores, read unchanged ----------------------------------------------------------
def test_every_part_kind_of_the_older_stores_reads(legacy_snaps):
    for golden, snaps in legacy_snaps.items():
        for seq, snap in snaps.items():
            kinds = {f.kind for f in snap.manifest.files}
            with_dataplane = golden == "store-v1.1" and seq == 2
            expected = set(typing.get_args(FileKind)) - (set() if with_dataplane else {"dataplane_rows"})
            assert kinds == expected, (golden, seq)
            if with_dataplane:
                staging = snap.read_table("dataplane")
                assert staging.schema.names[:len(DATAPLANE_SCHEMA)] == DATAPLANE_SCHEMA.names
            for entry in snap.files("part_manifest"):
                assert snap.read_bytes(entry)  # size and checksum checked
            training = snap.read_table("training")
            assert training.schema.names[: len(TRAINING_SCHEMA)] == TRAINING_SCHEMA.names
            assert training.num_rows == sum(f.records for f in snap.files("training_rows")) > 0
            tokens = snap.read_table("tokens")
            token_schema = TOKEN_CAPTURE_SCHEMA if golden == "store-v1.1" else TOKEN_CAPTURE_SCHEMA_V1
            assert tokens.schema.names[: len(token_schema)] == token_schema.names
            assert tokens.num_rows == sum(f.records for f in snap.files("token_capture_rows")) > 0
            for kind in ("continuations", "agent_state", "model_ledger", "token_index", "session_state",
                         "replay_index", "recovery_ledger"):
                for entry in snap.files(kind):
                    assert len(list(snap.iter_records(entry))) == entry.records > 0, (golden, seq, entry.path)
            (loader,) = snap.records("loader")
            assert loader.seed == {1: 7, 2: 8}[seq] and loader.consumed == 3
            tags = {type(r).__name__ for r in snap.records("recovery_ledger")}
            assert tags == {"PromptGroup", "RolloutAttempt", "AckOwed"}


def test_continuations_resolve_in_the_older_stores(legacy_snaps):
    for snaps in legacy_snaps.values():
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


# -- the 1.2 and 1.3 stores: Gym's files -------------------------------------------------------------
def _gym_dir(snap) -> Path:
    path = snap.store.local_path(layout.file_key(snap.manifest.snapshot_id, layout.GYM_PREFIX))
    assert path is not None
    return Path(path)


def test_every_part_kind_of_the_gym_stores_reads(gym_store, gym_snaps):
    for seq, snap in gym_snaps.items():
        kinds = {f.kind for f in snap.files()}
        expected = {"training_rows", "token_capture_rows", "loader_place", "replay_index", "recovery_ledger",
                    "part_manifest", GYM_FILE_KIND} | ({"dataplane_rows"} if seq == 2 else set())
        assert kinds == expected, seq
        for entry in snap.files(GYM_FILE_KIND):
            assert snap.read_bytes(entry)  # size and checksum checked
        tokens = snap.read_table("tokens")
        assert tokens.schema.names[: len(TOKEN_CAPTURE_SCHEMA)] == TOKEN_CAPTURE_SCHEMA.names
        assert tokens.num_rows == sum(f.records for f in snap.files("token_capture_rows")) > 0
        training = snap.read_table("training")
        assert training.num_rows == sum(f.records for f in snap.files("training_rows")) > 0
        (loader,) = snap.records("loader")
        assert loader.seed == {1: 7, 2: 8}[seq] and loader.consumed == CONSUMED.get(gym_store, {}).get(seq, 3)
        assert snap.records("continuations") == []  # no file of this project's own continuation kind


def test_gym_parts_are_gyms_layout_and_commit_replies_verbatim(gym_snaps):
    for snap in gym_snaps.values():
        prefixes = [example.gym_prefix(c.component, c.name) for c in example.CAPABILITIES]
        assert gym_prefixes(snap) == prefixes  # first in the manifest, in commit order
        assert prefixes[0] == f"gym/{agent_instance_dir(example.AGENT)}"
        files = {f.path: f for f in snap.files()}
        for p in snap.manifest.gym_commit.participants:
            assert p.part_prefix == example.gym_prefix(p.component, p.name)
            part = [f for f in files.values() if f.path.startswith(p.part_prefix + "/")]
            assert {f.kind for f in part} == {GYM_FILE_KIND, "part_manifest"}
            assert all(f.writer == f"{p.component}:{p.name}" for f in part)
            reply = msgspec.convert(p.payload, COMMIT_REPLIES[p.component])
            assert msgspec.to_builtins(reply) == p.payload  # kept verbatim: nothing added or lost
            manifest = snap.read_bytes(files[f"{p.part_prefix}/manifest.json"])
            assert reply.manifest_digest == hashlib.sha256(manifest).hexdigest()
            for ref in (getattr(reply, "continuation_index", None), getattr(reply, "storage_reference_index", None)):
                if ref is None:
                    continue
                data = snap.read_bytes(files[f"gym/{ref.relative_path}"])
                assert (hashlib.sha256(data).hexdigest(), len(data)) == (ref.sha256, ref.bytes)
                assert sum(1 for line in data.splitlines() if line.strip()) == ref.records


def test_gym_folders_read_back_and_resolve(gym_snaps):
    """Read with gymkit, as a restoring participant does (every digest and reference checked), each
    continuation root resolves: its parked record, its lineage up to its last call (whose tokens are
    the data plane's token-capture row of that call), its storage reference and its session."""
    from gymkit.checkpoint_dir import check_ledger_roots, read_agent_dir, read_ledger_dir, read_resources_dir

    for snap in gym_snaps.values():
        gym = _gym_dir(snap)
        agent, records, roots = read_agent_dir(gym / agent_instance_dir(example.AGENT))
        ledger, refs, lineage = read_ledger_dir(gym / ledger_dir(example.MODEL))
        check_ledger_roots(ledger, roots)
        _, sessions = read_resources_dir(gym / resources_dir(example.RESOURCE))
        assert roots and agent.records == len(records) and ledger.continuation_roots == len(roots)
        # The rollouts the model saw finish: this save's training rows (an incremental data plane
        # also still holds earlier saves' rows, of other prompt groups).
        groups = {r.group_id for r in snap.records("recovery_ledger") if isinstance(r, PromptGroup)}
        assert ledger.excluded_inactive == sum(1 for r in snap.records("replay_index")
                                               if r.partition_id == "train" and r.group_id in groups)
        tokens = {(e["rollout_id"], e["model_call_id"]): e["digest"] for e in _token_entries(snap)}
        by_attempt = {(r.rollout_id, r.attempt_index): r for r in records}
        referenced = {(ref.capture_key, ref.boundary_model_call_id) for ref in refs}
        for root in roots:
            assert capture_key(root.rollout_id, root.attempt_index) == root.capture_key
            rec = by_attempt[(root.rollout_id, root.attempt_index)]
            assert rec.last_committed_model_call_id == root.last_committed_model_call_id
            assert rec.resource_state_revisions == root.resource_state_revisions
            rows = [json.loads(line) for line in lineage[root.capture_key].read_bytes().splitlines()]
            assert rows[-1]["entry"]["model_call_id"] == root.last_committed_model_call_id
            assert [r["entry"]["parent_call_id"] for r in rows] == [None] + [r["entry"]["model_call_id"] for r in rows[:-1]]
            for row in rows:
                assert row["token"]["rollout_id"] == root.capture_key  # Gym's TokenEntry holds the capture key
                assert tokens[(root.capture_key, row["entry"]["model_call_id"])] == row["token"]["digest"]
            assert (root.capture_key, root.last_committed_model_call_id) in referenced
            session = sessions[f"{root.rollout_id}.a{root.attempt_index}.json"]
            assert session.state_revision == root.resource_state_revisions[example.RESOURCE]


def _token_entries(snap):
    """Every token-capture row the snapshot holds (a row range applied) as Gym's TokenEntry JSON."""
    for entry in snap.files("token_capture_rows"):
        for b, batch in enumerate(snap.read_rows(entry).to_batches()):
            yield from batch_entries(batch, f"{snap.where(entry)}: batch {b}")


def test_continuation_index_is_gyms_compact_lines(gym_snaps):
    for snap in gym_snaps.values():
        (entry,) = [f for f in snap.files(GYM_FILE_KIND) if f.path.endswith("/continuations.jsonl")]
        assert entry.path.startswith(f"gym/{agent_instance_dir(example.AGENT)}/")
        data = snap.read_bytes(entry)
        lines = data.splitlines()
        assert data.endswith(b"\n") and len(lines) == entry.records > 0
        for line in lines:
            root = msgspec.json.decode(line, type=AgentContinuationRoot)
            assert msgspec.json.encode(root) == line  # compact, Gym's field order, no spaces


def test_gymkit_writes_the_same_bytes(gym_snaps, tmp_path):
    """The example writes Gym's files without gymkit (snapformat lies below it): gymkit's writers,
    given the records read back, write every file byte for byte the same."""
    from gymkit import checkpoint_dir as cd

    snap = gym_snaps[2]
    gym = _gym_dir(snap)
    agent, records, roots = cd.read_agent_dir(gym / agent_instance_dir(example.AGENT))
    ledger, refs, lineage = cd.read_ledger_dir(gym / ledger_dir(example.MODEL))
    resources, sessions = cd.read_resources_dir(gym / resources_dir(example.RESOURCE))
    out = tmp_path / "gym"
    cd.write_agent_dir(out, agent.checkpoint_id, example.AGENT, records)
    cd.write_ledger_dir(out, ledger.checkpoint_id, example.MODEL,
                        lineages={key: path.read_bytes() for key, path in lineage.items()}, storage_references=refs,
                        roots=roots, excluded_inactive=ledger.excluded_inactive, tombstones=ledger.tombstones,
                        source_attempts=ledger.source_attempts)
    cd.write_resources_dir(out, resources.checkpoint_id, example.RESOURCE, sessions.values())
    golden = {p.relative_to(gym).as_posix(): p.read_bytes() for p in gym.rglob("*")
              if p.is_file() and p.name != "part-manifest.json"}
    fresh = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert sorted(fresh) == sorted(golden)
    for name, data in golden.items():
        assert fresh[name] == data, name


def test_gym_parts_download_byte_for_byte(gym_snaps, tmp_path):
    """A restore from an object store gets the same files: every Gym part downloaded (checked
    against the part manifests and Gym's manifests) into a local checkpoint_dir."""
    snap = gym_snaps[2]
    prefixes = materialize_gym(snap, str(tmp_path / "gym"))
    assert prefixes == gym_prefixes(snap)
    for entry in snap.files(GYM_FILE_KIND):
        assert (tmp_path / entry.path).read_bytes() == snap.read_bytes(entry)


def test_cli_verify_show_and_cat_continuations(gym_store, gym_snaps, capsys):
    newest = gym_snaps
    url = newest[2].url
    assert snapformat_main(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert snapformat_main(["verify", newest[2].url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [] and report["files_checked"] == newest[2].manifest.file_count

    assert snapformat_main(["show", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [g["prefix"] for g in shown["gym_parts"]] == gym_prefixes(newest[2])
    assert shown["topology_fingerprint"] == example.TOPOLOGY and shown["format_version"] == STORES[gym_store]
    assert snapformat_main(["show", url]) == 0
    text = capsys.readouterr().out
    assert "responses_api_agents/agent0" in text and "gym/model-ledger/policy0" in text

    assert snapformat_main(["cat", url, "continuations"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (entry,) = [f for f in newest[2].files(GYM_FILE_KIND) if f.path.endswith("/continuations.jsonl")]
    assert [line.encode() for line in lines] == newest[2].read_bytes(entry).splitlines()
    assert snapformat_main(["cat", url, "continuations", "--limit", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == lines[:2]


def test_cli_cat_continuations_of_the_older_stores(legacy_snaps, capsys):
    for snaps in legacy_snaps.values():
        snap = snaps[2]
        assert snapformat_main(["cat", snap.url, "continuations"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [msgspec.json.decode(line, type=AgentContinuationRoot) for line in lines] == snap.records("continuations")


# -- the writer ------------------------------------------------------------------------------------------
def test_the_legacy_writer_is_the_1_1_writer(tmp_path, legacy_snaps):
    """``write_legacy_example`` (for tests of readers of the older kinds) writes the data files of
    ``store-v1.1`` byte for byte (its ``bulk/`` and ``nemo-rl/`` parts are the generator's own)."""
    fresh = SnapshotStore(str(tmp_path / "store"))
    for seq, golden in sorted(legacy_snaps["store-v1.1"].items()):
        draft = fresh.begin()
        gym, receipts = example.write_legacy_example(draft, count=12, seed={1: 7, 2: 8}[seq])
        new = open_snapshot(draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=LEGACY_TOPOLOGY).url)
        want = {f.path: (f.kind, f.size, f.checksum, f.records) for f in golden.manifest.files
                if f.kind not in VOLATILE_KINDS and f.path.split("/")[0] not in ("bulk", "nemo-rl")}
        got = {f.path: (f.kind, f.size, f.checksum, f.records) for f in new.manifest.files
               if f.kind not in VOLATILE_KINDS}
        assert got == want, seq
        assert [(p.component, p.name, p.part_prefix, p.payload) for p in new.manifest.gym_commit.participants] == \
            [(p.component, p.name, p.part_prefix, p.payload) for p in golden.manifest.gym_commit.participants]


def _data_files(snap) -> dict:
    """Each listed file that carries no time or random id: path -> what pins its bytes and rows."""
    return {f.path: (f.kind, f.size, f.checksum, f.records, f.batches, f.object, f.row_range)
            for f in snap.files() if f.kind not in VOLATILE_KINDS}


def test_regenerated_data_files_are_byte_identical(tmp_path, newest):
    """Only the newest store: the older ones are what older writers produced."""
    gen = _generator()
    assert (gen.COUNT, gen.SEEDS, gen.CONSUMED) == (12, (7, 8), 1)
    assert gen.DEFAULT_OUT == EXAMPLES / NEWEST
    gen.write_store(tmp_path / "store")
    fresh = SnapshotStore(str(tmp_path / "store"))
    assert [c.sequence for c in fresh.list()] == sorted(newest, reverse=True)
    for seq, golden in newest.items():
        new = fresh.open(seq)
        want, got = _data_files(golden), _data_files(new)
        assert sorted(got) == sorted(want), seq
        for path, entry in want.items():
            assert got[path] == entry, f"sequence {seq}: {path} changed"
        for entry in new.files():
            if entry.kind not in VOLATILE_KINDS:
                algorithm = entry.checksum.split(":", 1)[0]
                assert checksum_bytes(new.read_bytes(entry), algorithm) == entry.checksum
        assert [f.path for f in new.manifest.files] == [f.path for f in golden.manifest.files]
        # Gym's commit result: the same participants, parts and replies (the part manifest
        # checksums carry the part manifests' times).
        assert [(p.component, p.name, p.part_prefix, p.payload) for p in new.manifest.gym_commit.participants] == \
            [(p.component, p.name, p.part_prefix, p.payload) for p in golden.manifest.gym_commit.participants]
        assert (new.manifest.format_version, new.manifest.required_features, new.manifest.topology_fingerprint) == \
            (golden.manifest.format_version, golden.manifest.required_features, golden.manifest.topology_fingerprint)
    # The same objects, byte for byte, and no other.
    assert _object_files(tmp_path / "store") == _object_files(EXAMPLES / NEWEST)


def test_the_writer_without_incremental_saves_writes_the_1_2_store(tmp_path):
    """Incremental saves off (``write_example``: every file in the snapshot folder) is what the 1.2
    writer wrote: the data files of ``store-v1.2`` byte for byte; only the manifests say 1.3."""
    gen = _generator()
    golden = _open_all("store-v1.2")
    fresh = SnapshotStore(str(tmp_path / "store"))
    for seq, seed in zip((1, 2), gen.SEEDS, strict=True):
        draft = fresh.begin()
        gym, receipts = example.write_example(draft, count=gen.COUNT, seed=seed)
        if seq == 2:
            bulk = draft.part(gen.BULK_PREFIX, writer="example:bulk")
            bulk.write_records("replay_index", "replay_index", gen.bulk_replay_index())
            staging = draft.part(gen.STAGING_PREFIX, writer="example:staging")
            staging.write_rows("dataplane.arrow", "dataplane_rows", gen.staging_rows(seed))
            receipts += [bulk.close(), staging.close()]
        new = open_snapshot(draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY).url)
        assert _data_files(new) == _data_files(golden[seq]), seq
        assert new.manifest.format_version == FORMAT_VERSION
        # no shared_objects; Gym's parts listed by their part manifests (1.4)
        assert new.manifest.required_features == sorted(golden[seq].manifest.required_features + [PART_LISTINGS])
    assert not (tmp_path / "store" / layout.OBJECTS).exists()


# -- the 1.3 store: incremental, shared objects ------------------------------------------------------------
def _object_files(root: Path) -> dict[str, bytes]:
    folder = root / layout.OBJECTS
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _tq(snap) -> dict:
    return {f.path: f for f in snap.manifest.files if f.path.startswith("tq/") and f.kind != "part_manifest"}


def test_the_second_snapshot_lists_the_firsts_segments_again(newest):
    first, second = _tq(newest[1]), _tq(newest[2])
    assert list(first) == ["tq/training-000000.arrow", "tq/token_capture-000000.arrow"]
    # Data-plane order: partition by partition, each partition's segments in key order.
    assert list(second) == ["tq/training-000000.arrow", "tq/training-000001.arrow",
                            "tq/token_capture-000000.arrow", "tq/token_capture-000001.arrow"]
    assert all(f.object == f.checksum and f.object.startswith("sha256:") for f in (*first.values(), *second.values()))
    # The token-capture segment again whole: the same entry but for the writer's own label.
    assert second["tq/token_capture-000000.arrow"] == first["tq/token_capture-000000.arrow"]
    # The training segment again, narrowed to the rows the data plane still holds (one consumed).
    old, kept = first["tq/training-000000.arrow"], second["tq/training-000000.arrow"]
    assert (kept.object, kept.size, kept.batches) == (old.object, old.size, old.batches) and old.row_range is None
    assert kept.row_range == (1, old.records) and kept.records == old.records - 1
    # New rows: new objects.
    assert {second[p].object for p in ("tq/training-000001.arrow", "tq/token_capture-000001.arrow")}.isdisjoint(
        f.object for f in first.values())
    # Every other file lies in the snapshot folder.
    for snap in newest.values():
        assert {f.path for f in snap.manifest.files if f.object} == set(_tq(snap))


def test_objects_are_named_by_their_bytes_and_stored_once(newest):
    stored = _object_files(EXAMPLES / NEWEST)
    named = {f.object: f.size for snap in newest.values() for f in snap.manifest.files if f.object}
    assert sorted(stored) == sorted(layout.object_key(name) for name in named)  # each once, nothing else
    for key, data in stored.items():
        name = layout.object_of_key(key)
        assert name == "sha256:" + hashlib.sha256(data).hexdigest() and len(data) == named[name]
    # Nothing of the data plane's rows in the snapshot folders.
    for snap in newest.values():
        folder = EXAMPLES / NEWEST / layout.snapshot_dir(snap.manifest.snapshot_id) / "tq"
        assert sorted(p.name for p in folder.iterdir()) == ["part-manifest.json"]
    # What the second snapshot wrote anew, and what it shares with its parent.
    parent = {f.object for f in newest[1].manifest.files if f.object}
    shared = {f.object: f.size for f in newest[2].manifest.files if f.object in parent}
    assert len(shared) == 2 and sum(shared.values()) > 0


def test_a_row_range_reads_those_rows_of_the_object(newest):
    first, second = newest[1], newest[2]
    old = first.read_table("training")
    new_segment = second.read_rows(_tq(second)["tq/training-000001.arrow"])
    training = second.read_table("training")
    assert training.num_rows == sum(f.records for f in second.files("training_rows")) == old.num_rows - 1 + 4
    assert training.slice(0, old.num_rows - 1).equals(old.slice(1))
    assert training.slice(old.num_rows - 1).equals(new_segment)
    # The replay index lists exactly the training rows the data plane holds, in its order.
    assert training.column("key").to_pylist() == [r.key for r in second.records("replay_index")
                                                   if r.partition_id == "train"]
    tokens = second.read_table("tokens")
    assert tokens.slice(0, first.read_table("tokens").num_rows).equals(first.read_table("tokens"))


def test_a_damaged_object_is_named_with_each_snapshot_that_lists_it(tmp_path):
    """An object whose bytes do not match its name is refused, never trusted by its name: reading
    and verifying each snapshot that lists it names the object and that snapshot's file."""
    import shutil

    root = tmp_path / "store"
    shutil.copytree(EXAMPLES / NEWEST, root)
    snaps = _open_all(NEWEST)
    entry = _tq(snaps[1])["tq/token_capture-000000.arrow"]
    path = root / layout.object_key(entry.object)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    store = SnapshotStore(str(root))
    for seq in (1, 2):
        snap = store.open(seq)
        with pytest.raises(CorruptSnapshotError) as err:
            snap.read_table("tokens")
        message = str(err.value)
        assert layout.object_key(entry.object) in message and snap.manifest.snapshot_id in message
        assert entry.path in message and "checksum" in message
        problems = verify_snapshot(snap).problems
        assert [p.file for p in problems] == [entry.path], problems
        assert snap.read_table("training").num_rows > 0  # the other objects still read


def test_a_1_2_reader_refuses_the_incremental_store_naming_both_versions(monkeypatch):
    """SPEC §13.1: a reader of format 1.2 (which knows only ``dataplane_rows``) refuses both 1.3
    snapshots, naming the feature, the snapshot's version and its own; it still reads the 1.2 store."""
    monkeypatch.setattr(version, "FORMAT_VERSION", "1.2")
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset({"dataplane_rows"}))
    for name, unknown in (("store-v1.3", SHARED_OBJECTS), ("store-v1.4", f"{PART_LISTINGS}, {SHARED_OBJECTS}")):
        store = SnapshotStore(str(EXAMPLES / name))
        for seq in (1, 2):
            with pytest.raises(VersionError) as err:
                store.open(seq)
            message = str(err.value)
            assert f"requires feature(s) {unknown} (format version {STORES[name]})" in message
            assert "this reader (format version 1.2) knows dataplane_rows" in message
            assert layout.MANIFEST_NAME in message
    assert SnapshotStore(str(EXAMPLES / "store-v1.2")).open(2).read_table("training").num_rows > 0


def test_a_1_3_reader_refuses_the_1_4_store_and_reads_the_1_3_store(monkeypatch):
    """SPEC §13.1, §14.4: a reader of format 1.3 would take the manifest's files for all of them and
    find no Gym files; it refuses both 1.4 snapshots naming ``part_listings`` and both versions, and
    still reads the 1.3 store, whose data files and objects are the 1.4 store's."""
    monkeypatch.setattr(version, "FORMAT_VERSION", "1.3")
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset({"dataplane_rows", SHARED_OBJECTS}))
    store = SnapshotStore(str(EXAMPLES / "store-v1.4"))
    for seq in (1, 2):
        with pytest.raises(VersionError) as err:
            store.open(seq)
        assert (f"requires feature(s) {PART_LISTINGS} (format version 1.4); this reader (format version 1.3) knows "
                f"dataplane_rows, {SHARED_OBJECTS}") in str(err.value)
    older = SnapshotStore(str(EXAMPLES / "store-v1.3"))
    assert older.open(2).read_table("training").num_rows > 0 and verify_snapshot(older.open(2)).ok
