"""Gym's files in ``checkpoint_dir`` (CONTROL.md §6) as gymkit writes and reads them: compact JSON
lines bound by artifact references, agent archives with fixed tar headers, the three manifests with
their serializations and digests, and every mismatch refused with an error naming the file, the
field and what was expected."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymkit import checkpoint_dir as cd
from schemas.errors import CorruptSnapshotError, InvalidPathError, InvalidRecordError
from schemas.gym_files import (
    AGENT_ARCHIVE_MAX_MEMBERS,
    AGENT_INDEX_NAME,
    CONTINUATIONS_NAME,
    MANIFEST_NAME,
    AgentBoundaryRecord,
    AgentIndexEntry,
    ArtifactRef,
    AttemptEntry,
    ExternalStorageReference,
    MutationReceipt,
    PendingModel,
    ResourceSnapshot,
    agent_instance_dir,
)
from schemas.gym_records import AgentContinuationRoot
from snapformat.gym_dir import list_folder
from snapformat.tar_archive import tar_bytes
from tests.gym_record_strategies import IDS, REVISIONS, continuation_roots

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

text = st.text(max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8)


@st.composite
def boundary_records(draw, rollout_id: str, attempt: int) -> AgentBoundaryRecord:
    pending = draw(st.booleans())
    return AgentBoundaryRecord(
        rollout_id=rollout_id, attempt_index=attempt, boundary_index=draw(st.integers(0, 50)),
        turn_index=draw(st.none() | st.integers(0, 50)),
        boundary_kind="pending_model" if pending else "turn_complete",
        pending_model=PendingModel(model_call_id=draw(text), response=draw(st.dictionaries(text, json_values, max_size=2)),
                                   pending_action_cursor=draw(st.integers(0, 9))) if pending else None,
        output_items=draw(st.lists(st.dictionaries(text, json_values, max_size=2), max_size=2)),
        last_committed_model_call_id=draw(st.none() | st.text(min_size=1, max_size=8)),
        resource_state_revisions=draw(REVISIONS), agent_state=draw(st.dictionaries(text, json_values, max_size=2)),
        created_at=draw(st.floats(0, 2e9, allow_nan=False)))


@st.composite
def record_sets(draw, max_size: int = 12) -> list[AgentBoundaryRecord]:
    keys = draw(st.lists(st.tuples(IDS, st.integers(0, 4)), unique=True, max_size=max_size))
    return [draw(boundary_records(rid, n)) for rid, n in keys]


def _record(rid: str, n: int = 0, call: str | None = "call-1", **kw) -> AgentBoundaryRecord:
    return AgentBoundaryRecord(rollout_id=rid, attempt_index=n, boundary_index=1, last_committed_model_call_id=call,
                               **kw)


# -- JSON lines ----------------------------------------------------------------------------------------------
def test_a_continuation_line_is_gyms_compact_json_byte_for_byte(tmp_path: Path) -> None:
    """The reference's example line (RL test @d595189f): declaration order, no spaces, ``\\n``."""
    root = AgentContinuationRoot(rollout_id="group-7_g0", attempt_index=0, capture_key="group-7_g0",
                                 last_committed_model_call_id="call-1", resource_state_revisions={"durable-tools": 2})
    line = (b'{"schema_version":1,"rollout_id":"group-7_g0","attempt_index":0,"capture_key":"group-7_g0",'
            b'"last_committed_model_call_id":"call-1","resource_state_revisions":{"durable-tools":2}}\n')
    assert cd.jsonl_bytes([root]) == line
    ref = cd.write_jsonl(tmp_path, "agent/instance-test/continuations.jsonl", [root])
    assert (tmp_path / "agent/instance-test/continuations.jsonl").read_bytes() == line
    assert msgspec.to_builtins(ref) == {"schema_version": 1, "relative_path": "agent/instance-test/continuations.jsonl",
                                        "sha256": hashlib.sha256(line).hexdigest(), "records": 1, "bytes": len(line)}
    assert cd.jsonl_bytes([]) == b""


@SETTINGS
@given(rows=st.lists(continuation_roots(), max_size=20))
def test_jsonl_round_trips_and_the_reference_binds_every_byte(tmp_path: Path, rows) -> None:
    ref = cd.write_jsonl(tmp_path, "agent/x/continuations.jsonl", rows)
    data = (tmp_path / ref.relative_path).read_bytes()
    assert (ref.sha256, ref.bytes, ref.records) == (hashlib.sha256(data).hexdigest(), len(data), len(rows))
    assert data.count(b"\n") == len(rows) and b", " not in data.replace(b'", "', b"").replace(b"\\", b"")
    assert [json.loads(line) for line in data.splitlines()] == [msgspec.to_builtins(r) for r in rows]
    assert cd.read_jsonl(tmp_path, ref, AgentContinuationRoot) == rows


def test_blank_lines_are_hashed_but_not_counted(tmp_path: Path) -> None:
    rows = [ExternalStorageReference(capture_key="r1", boundary_model_call_id="c1", key=f"k{i}") for i in range(3)]
    data = cd.jsonl_bytes(rows[:1]) + b"\n  \n" + cd.jsonl_bytes(rows[1:]) + b"\n"
    (tmp_path / "refs.jsonl").write_bytes(data)
    ref = ArtifactRef(relative_path="refs.jsonl", sha256=hashlib.sha256(data).hexdigest(), records=3, bytes=len(data))
    assert cd.read_jsonl(tmp_path, ref, ExternalStorageReference) == rows


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, ArtifactRef]:
    rows = [_root(f"r{i}") for i in range(4)]
    return tmp_path, cd.write_jsonl(tmp_path, "agent/a/continuations.jsonl", rows)


def _root(rid: str) -> AgentContinuationRoot:
    return AgentContinuationRoot(rollout_id=rid, attempt_index=0, capture_key=rid, last_committed_model_call_id="c",
                                 resource_state_revisions={})


def test_a_tampered_byte_is_named_with_the_file_and_sha256(written) -> None:
    root, ref = written
    path = root / ref.relative_path
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match=rf"{path}.*sha256 is [0-9a-f]{{64}}, the reference expects {ref.sha256}"):
        cd.read_jsonl(root, ref, AgentContinuationRoot)


def test_a_wrong_size_and_a_wrong_record_count_are_named(written) -> None:
    root, ref = written
    with pytest.raises(CorruptSnapshotError, match=rf"bytes is {ref.bytes}, the reference expects {ref.bytes + 1}"):
        cd.read_jsonl(root, msgspec.structs.replace(ref, bytes=ref.bytes + 1), AgentContinuationRoot)
    with pytest.raises(CorruptSnapshotError, match=r"continuations.jsonl.*has 4 non-blank lines, the reference's records expects 5"):
        cd.read_jsonl(root, msgspec.structs.replace(ref, records=5), AgentContinuationRoot)


def test_a_row_that_breaks_its_struct_is_named_by_line_and_field(tmp_path: Path) -> None:
    good = cd.jsonl_bytes([_root("r1")])
    bad = good.replace(b'"attempt_index":0', b'"attempt_index":"0"')
    extra = good.replace(b'{"schema_version":1,', b'{"schema_version":1,"surprise":true,')
    for data, field in ((good + bad, r"\$\.attempt_index"), (good + extra, "surprise")):
        (tmp_path / "c.jsonl").write_bytes(data)
        ref = ArtifactRef(relative_path="c.jsonl", sha256=hashlib.sha256(data).hexdigest(), records=2, bytes=len(data))
        with pytest.raises(InvalidRecordError, match=rf"c.jsonl.*line 2: .*{field}.*AgentContinuationRoot"):
            cd.read_jsonl(tmp_path, ref, AgentContinuationRoot)


def test_paths_that_leave_checkpoint_dir_are_refused(tmp_path: Path) -> None:
    for bad in ("/etc/passwd", "../x.jsonl", "a/../../x.jsonl", "a/./b.jsonl"):
        with pytest.raises(ValueError, match="relative"):
            ArtifactRef(relative_path=bad, sha256="0" * 64, records=0, bytes=0)
        with pytest.raises(InvalidPathError):
            cd.write_jsonl(tmp_path, bad, [])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.jsonl").write_bytes(b"")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "link").symlink_to(outside, target_is_directory=True)
    ref = ArtifactRef(relative_path="link/x.jsonl", sha256=hashlib.sha256(b"").hexdigest(), records=0, bytes=0)
    with pytest.raises(InvalidPathError, match="leads outside checkpoint_dir"):
        cd.read_jsonl(ckpt, ref, AgentContinuationRoot)
    # A reference forced past its own check is refused by the reader too.
    forged = ArtifactRef(relative_path="x.jsonl", sha256="0" * 64, records=0, bytes=0)
    msgspec.structs.force_setattr(forged, "relative_path", "../outside/x.jsonl")
    with pytest.raises(InvalidPathError):
        cd.read_jsonl(ckpt, forged, AgentContinuationRoot)


def test_atomic_write_replaces_whole_files_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "new" / "deeper" / "f.json"
    cd.atomic_write(target, b"one")
    cd.atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(os.listdir(target.parent)) == ["f.json"]
    (target.parent / ".tmp-leftover").write_bytes(b"crash")
    assert list_folder(tmp_path) == ["new/deeper/f.json"]  # a crash's leftover is never a file of the folder


# -- agent archives ----------------------------------------------------------------------------------------
@SETTINGS
@given(records=record_sets())
def test_agent_archives_round_trip(tmp_path_factory, records) -> None:
    folder = tmp_path_factory.mktemp("agent")
    archives, index = cd.write_agent_archives(folder, records)
    assert sum(a.members for a in archives) == len(index) == len(records)
    ordered = sorted(records, key=lambda r: (r.rollout_id, r.attempt_index))
    assert cd.read_agent_archives(folder, archives, index) == ordered
    for a in archives:
        data = (folder / a.name).read_bytes()
        assert (a.sha256, a.bytes) == (hashlib.sha256(data).hexdigest(), len(data))


def test_archive_members_are_indent_2_json_with_fixed_headers_and_deterministic_bytes(tmp_path: Path) -> None:
    records = [_record("b", 1, output_items=[{"type": "message", "text": "héllo"}], created_at=12.5),
               _record("a", 0, call=None, boundary_kind="pending_model",
                       pending_model=PendingModel(model_call_id="m1", response={"id": "r"}))]
    archives, index = cd.write_agent_archives(tmp_path / "one", records)
    again, _ = cd.write_agent_archives(tmp_path / "two", list(reversed(records)))
    assert archives == again
    assert (tmp_path / "one" / archives[0].name).read_bytes() == (tmp_path / "two" / archives[0].name).read_bytes()
    with tarfile.open(tmp_path / "one" / "agent-part-000000.tar") as tf:
        members = tf.getmembers()
        assert [m.name for m in members] == ["a.a0.json", "b.a1.json"]
        for m, rec, row in zip(members, sorted(records, key=lambda r: r.rollout_id), index, strict=True):
            assert (m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname) == (0o600, 0, 0, 0, "", "")
            assert m.isreg()
            data = tf.extractfile(m).read()
            assert data == json.dumps(msgspec.to_builtins(rec), indent=2).encode()
            assert row == AgentIndexEntry(rollout_id=rec.rollout_id, attempt_index=rec.attempt_index,
                                          archive="agent-part-000000.tar", member=m.name,
                                          sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    assert list(json.loads(data)) == [f.name for f in msgspec.structs.fields(AgentBoundaryRecord)]


any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30)


@given(value=any_json, sort_keys=st.booleans(), indent=st.sampled_from([1, 2, 4]))
@settings(max_examples=400, deadline=None)
def test_documents_are_json_dumps_byte_for_byte(value, sort_keys: bool, indent: int) -> None:
    """The fast build of a document (compact C encoding re-indented by msgspec) gives exactly
    ``json.dumps(..., sort_keys, indent)``: escapes, float repr, NaN and Infinity, empty containers."""
    from snapformat.gym_dir import document_bytes

    assert document_bytes(value, sort_keys=sort_keys, indent=indent) == \
        json.dumps(value, sort_keys=sort_keys, indent=indent).encode()


@given(records=record_sets(max_size=4))
@settings(max_examples=60, deadline=None)
def test_record_files_and_manifests_are_json_dumps_byte_for_byte(records) -> None:
    for rec in records:
        assert cd.record_json(rec) == json.dumps(msgspec.to_builtins(rec), indent=2).encode()
    manifest = cd.AgentManifest(checkpoint_id="c", instance_name="é", archives=[], records=0,
                                record_index=ArtifactRef(relative_path="a/b.jsonl", sha256="0" * 64, records=0, bytes=0),
                                continuation_index=ArtifactRef(relative_path="a/c.jsonl", sha256="1" * 64, records=0,
                                                               bytes=0))
    data, _ = cd.manifest_bytes(manifest)
    assert data == json.dumps(msgspec.to_builtins(manifest), sort_keys=True, indent=2).encode()


def test_archives_hold_at_most_512_members_and_64_mib_each(tmp_path: Path, monkeypatch) -> None:
    records = [_record(f"r{i:05d}") for i in range(2 * AGENT_ARCHIVE_MAX_MEMBERS + 3)]
    archives, index = cd.write_agent_archives(tmp_path / "count", records)
    assert [a.name for a in archives] == ["agent-part-000000.tar", "agent-part-000001.tar", "agent-part-000002.tar"]
    assert [a.members for a in archives] == [512, 512, 3]
    assert index[512].archive == "agent-part-000001.tar" and index[512].rollout_id == "r00512"
    # The payload bound, scaled down: members fill an archive up to it, never past it.
    size = len(cd.record_json(records[0]))
    monkeypatch.setattr(cd, "AGENT_ARCHIVE_MAX_BYTES", 3 * size)
    archives, _ = cd.write_agent_archives(tmp_path / "bytes", records[:7])
    assert [a.members for a in archives] == [3, 3, 1]
    # A folder written again with fewer records keeps no archive of the earlier commit.
    monkeypatch.setattr(cd, "AGENT_ARCHIVE_MAX_BYTES", 64 << 20)
    cd.write_agent_archives(tmp_path / "bytes", records[:2])
    assert sorted(p.name for p in (tmp_path / "bytes").iterdir()) == ["agent-part-000000.tar"]


def test_a_long_rollout_id_gets_a_deterministic_pax_name(tmp_path: Path) -> None:
    rid = "r" * 128  # the longest rollout id: its member name passes tar's 100-character field
    records = [_record(rid, 12), _record("short")]
    archives, index = cd.write_agent_archives(tmp_path / "one", records)
    cd.write_agent_archives(tmp_path / "two", records)
    assert (tmp_path / "one" / archives[0].name).read_bytes() == (tmp_path / "two" / archives[0].name).read_bytes()
    assert index[0].member == f"{rid}.a12.json"
    assert cd.read_agent_archives(tmp_path / "one", archives, index)[0].rollout_id == rid


def test_one_record_per_attempt(tmp_path: Path) -> None:
    with pytest.raises(InvalidRecordError, match=r"\('r', 0\) appears twice"):
        cd.write_agent_archives(tmp_path, [_record("r"), _record("r")])


# -- manifests and whole folders ----------------------------------------------------------------------------
def _agent_dir(checkpoint: Path, name: str = "agent0", n: int = 5) -> Path:
    records = [_record(f"r{i}", resource_state_revisions={"tools": i}) for i in range(n)]
    records.append(_record("parked", call=None))  # no last call: no continuation root
    cd.write_agent_dir(checkpoint, "ckpt-1", name, records)
    return checkpoint / agent_instance_dir(name)


def test_agent_folder_layout_manifest_bytes_and_digest(tmp_path: Path) -> None:
    folder = _agent_dir(tmp_path)
    assert folder == tmp_path / "agent" / f"instance-{hashlib.sha256(b'agent0').hexdigest()}"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["agent-part-000000.tar", AGENT_INDEX_NAME, CONTINUATIONS_NAME, MANIFEST_NAME])
    data = (folder / MANIFEST_NAME).read_bytes()
    manifest, records, roots = cd.read_agent_dir(folder)
    assert data == json.dumps(msgspec.to_builtins(manifest), sort_keys=True, indent=2).encode()
    assert cd.manifest_digest(folder) == hashlib.sha256(data).hexdigest() == cd.manifest_bytes(manifest)[1]
    assert cd.read_agent_folder(folder) == (manifest, records, roots, hashlib.sha256(data).hexdigest())
    assert (manifest.records, len(records), len(roots)) == (6, 6, 5)
    assert manifest.continuation_index.relative_path == f"{agent_instance_dir('agent0')}/{CONTINUATIONS_NAME}"
    assert [r.capture_key for r in roots] == sorted(r.capture_key for r in roots)
    assert cd.manifest_digest(tmp_path / "nowhere") is None
    unnamed, _ = cd.write_agent_dir(tmp_path / "u", "ckpt-1", None, [])
    assert (tmp_path / "u" / "agent" / MANIFEST_NAME).is_file() and unnamed.archives == []
    assert cd.read_agent_dir(tmp_path / "u" / "agent")[1:] == ([], [])


def test_an_agents_restore_reads_each_file_of_its_folder_once(tmp_path: Path, monkeypatch) -> None:
    # The check hashes every member against its index row and keeps the bytes it hashed; the records are
    # decoded from those. Each archive used to be read three times (scan, member check, decode).
    folder = _agent_dir(tmp_path, n=600)  # two archives: at most 512 members each
    opened: list[str] = []
    real_open = io.open

    def counted(file, *args, **kwargs):
        opened.append(os.path.relpath(os.fspath(file), folder))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counted)  # Path.read_bytes opens through io.open
    monkeypatch.setattr("builtins.open", counted)
    manifest, records, roots = cd.read_agent_dir(folder)
    monkeypatch.undo()
    names = ["agent-part-000000.tar", "agent-part-000001.tar", AGENT_INDEX_NAME, CONTINUATIONS_NAME]
    assert [a.name for a in manifest.archives] == names[:2]
    assert {name: opened.count(name) for name in names} == dict.fromkeys(names, 1)
    assert (len(records), len(roots)) == (601, 600)
    indexed = [json.loads(line)["rollout_id"] for line in (folder / AGENT_INDEX_NAME).read_bytes().splitlines()]
    assert [r.rollout_id for r in records] == indexed and set(indexed) == {f"r{i}" for i in range(600)} | {"parked"}
    assert {r.rollout_id: r.resource_state_revisions for r in records}["r599"] == {"tools": 599}


def test_agent_folder_tampering_is_named(tmp_path: Path) -> None:
    folder = _agent_dir(tmp_path)
    archive = folder / "agent-part-000000.tar"
    original = archive.read_bytes()
    data = bytearray(original)
    data[600] ^= 0x01  # inside the first member
    archive.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match=r"agent-part-000000.tar: sha256 is .*archives\[0\]\.sha256 expects"):
        cd.read_agent_dir(folder)
    # The same tampered member in an archive the manifest vouches for: the index row catches it.
    with tarfile.open(fileobj=io.BytesIO(original)) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    members[0] = (members[0][0], members[0][1].replace(b'"boundary_index": 1', b'"boundary_index": 2'))
    rebuilt = tar_bytes(members)
    archive.write_bytes(rebuilt)
    raw = json.loads((folder / MANIFEST_NAME).read_bytes())
    raw["archives"][0].update(sha256=hashlib.sha256(rebuilt).hexdigest(), bytes=len(rebuilt))
    (folder / MANIFEST_NAME).write_bytes(json.dumps(raw, sort_keys=True, indent=2).encode())
    with pytest.raises(CorruptSnapshotError, match=r"member 'parked.a0.json': sha256 is .*agent-index.jsonl expects"):
        cd.read_agent_dir(folder)
    # A manifest whose counts disagree.
    archive.write_bytes(original)
    raw["archives"][0].update(sha256=hashlib.sha256(original).hexdigest(), bytes=len(original), members=7)
    (folder / MANIFEST_NAME).write_bytes(json.dumps(raw, sort_keys=True, indent=2).encode())
    with pytest.raises(CorruptSnapshotError, match=r"has 6 members, .*archives\[0\]\.members expects 7"):
        cd.read_agent_dir(folder)
    # A folder that is not where its manifest says.
    raw["archives"][0]["members"] = 6
    (folder / MANIFEST_NAME).write_bytes(json.dumps(raw, sort_keys=True, indent=2).encode())
    moved = tmp_path / "agent" / "instance-elsewhere"
    folder.rename(moved)
    with pytest.raises(InvalidPathError, match="belongs in 'agent/instance-"):
        cd.read_agent_dir(moved)


def test_ledger_folder_round_trip_manifest_indent_1(tmp_path: Path) -> None:
    roots = [_root("b"), _root("a")]
    lineage = {"a": b'{"call":1}\n\n{"call":2}\n', "b-a1": b'{"call":3}\n'}
    refs = [ExternalStorageReference(capture_key="a", boundary_model_call_id="c", key="k1")]
    manifest, digest = cd.write_ledger_dir(tmp_path, "ckpt-1", "policy0", lineages=lineage, storage_references=refs,
                                           roots=roots, excluded_inactive=2,
                                           tombstones=[AttemptEntry(rollout_id="t", attempt_index=0)])
    folder = tmp_path / "model-ledger" / "policy0"
    data = (folder / MANIFEST_NAME).read_bytes()
    assert data == json.dumps(msgspec.to_builtins(manifest), sort_keys=True, indent=1).encode()
    assert data.splitlines()[1].startswith(b' "')  # indent 1
    assert digest == hashlib.sha256(data).hexdigest()
    assert manifest.rollouts["a"].rows == 2 and manifest.rollouts["a"].bytes == len(lineage["a"])
    read, storage_refs, files = cd.read_ledger_dir(folder)
    assert read == manifest and storage_refs == refs
    assert {k: p.read_bytes() for k, p in files.items()} == lineage
    cd.check_ledger_roots(manifest, list(reversed(roots)))
    with pytest.raises(CorruptSnapshotError, match="continuation_roots 2"):
        cd.check_ledger_roots(manifest, roots[:1])
    (folder / "a.lineage.jsonl").write_bytes(lineage["a"] + b'{"call":9}\n')
    with pytest.raises(CorruptSnapshotError, match=r"a.lineage.jsonl: sha256 is .*rollouts\['a'\]\.files\['a.lineage.jsonl'\] expects"):
        cd.read_ledger_dir(folder)


def test_continuation_roots_sha256_is_the_sorted_compact_json(tmp_path: Path) -> None:
    roots = [_root("b"), AgentContinuationRoot(rollout_id="a", attempt_index=1, capture_key="a-a1",
                                                last_committed_model_call_id="z"), _root("a")]
    ordered = sorted(({k: v for k, v in msgspec.to_builtins(r).items()} for r in roots),
                     key=lambda r: (r["capture_key"], r["last_committed_model_call_id"]))
    text = json.dumps(ordered, sort_keys=True, separators=(",", ":"))
    assert cd.continuation_roots_sha256(roots) == hashlib.sha256(text.encode()).hexdigest()
    assert '"resource_state_revisions":null' in text


def test_resources_folder_round_trip(tmp_path: Path) -> None:
    receipt = MutationReceipt(request_id="q1", expected_revision=1, input_digest="a" * 64, status=200,
                              headers=[("content-type", "application/json")], body_base64="e30=", resulting_revision=2)
    snaps = [ResourceSnapshot(rollout_id="r1", attempt_index=0, state_revision=2, state={"files": ["x"]},
                              mutation_receipts=[receipt], created_at=1.5),
             ResourceSnapshot(rollout_id="r2", attempt_index=3, state_revision=0)]
    manifest, digest = cd.write_resources_dir(tmp_path, "ckpt-1", "tools", snaps)
    folder = tmp_path / "resources" / "tools"
    assert sorted(manifest.files) == ["r1.a0.json", "r2.a3.json"]
    assert (folder / "r1.a0.json").read_bytes() == json.dumps(msgspec.to_builtins(snaps[0]), indent=2).encode()
    data = (folder / MANIFEST_NAME).read_bytes()
    assert data == json.dumps(msgspec.to_builtins(manifest), sort_keys=True, indent=2).encode()
    assert digest == hashlib.sha256(data).hexdigest()
    read, files = cd.read_resources_dir(folder)
    assert read == manifest and files == {"r1.a0.json": snaps[0], "r2.a3.json": snaps[1]}
    (folder / "r2.a3.json").unlink()
    with pytest.raises(CorruptSnapshotError, match=r"r2.a3.json: missing, but .*files\['r2.a3.json'\] lists it"):
        cd.read_resources_dir(folder)


def test_a_manifest_with_an_unknown_field_or_wrong_type_is_refused(tmp_path: Path) -> None:
    cd.write_resources_dir(tmp_path, "ckpt-1", "tools", [])
    path = tmp_path / "resources" / "tools" / MANIFEST_NAME
    raw = json.loads(path.read_bytes())
    path.write_bytes(json.dumps({**raw, "extra": 1}).encode())
    with pytest.raises(InvalidRecordError, match=r"manifest.json: .*extra.*ResourcesManifest"):
        cd.read_resources_dir(tmp_path / "resources" / "tools")
    path.write_bytes(json.dumps({**raw, "schema_version": 3}).encode())
    with pytest.raises(InvalidRecordError, match=r"\$\.schema_version"):
        cd.read_resources_dir(tmp_path / "resources" / "tools")


# -- streamed commits: the same bytes from an ordered iterator, in the memory of one archive ----------------
def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in list_folder(folder)}


@SETTINGS
@given(records=record_sets())
def test_an_ordered_iterator_writes_the_bytes_of_a_list(tmp_path_factory, records) -> None:
    """``write_agent_dir`` of a generator in Gym's order (consumed as it comes) and of the same
    records as a list (sorted first) write identical folders."""
    base = tmp_path_factory.mktemp("stream")
    ordered = sorted(records, key=lambda r: (r.rollout_id, r.attempt_index))
    listed, digest = cd.write_agent_dir(base / "list", "ckpt-1", "agent0", list(reversed(records)))
    streamed, again = cd.write_agent_dir(base / "iter", "ckpt-1", "agent0", (r for r in ordered))
    assert (streamed, again) == (listed, digest)
    folder = agent_instance_dir("agent0")
    assert _folder_bytes(base / "iter" / folder) == _folder_bytes(base / "list" / folder)
    _, read, roots = cd.read_agent_dir(base / "iter" / folder)
    assert read == ordered and roots == cd.continuation_roots(records)
    _, lazily = cd.iter_agent_dir(base / "iter" / folder)
    assert list(lazily) == ordered


@SETTINGS
@given(records=record_sets())
def test_the_resource_dependencies_are_every_records_revisions(tmp_path_factory, records) -> None:
    """What a resources server's restore reads of an agent folder (the continuation roots, and the
    members of records without one) is each record's ``resource_state_revisions``, one per record."""
    base = tmp_path_factory.mktemp("deps")
    cd.write_agent_dir(base, "ckpt-1", "agent0", records)
    got = list(cd.iter_resource_dependencies(base / agent_instance_dir("agent0")))
    assert sorted(got, key=repr) == sorted((((r.rollout_id, r.attempt_index), r.resource_state_revisions)
                                           for r in records), key=repr)


def test_the_resource_dependencies_check_what_they_read(tmp_path: Path) -> None:
    """A record without a root is read from its member, checked against its index row; the roots are
    checked against their reference; the records with a root are not read at all."""
    folder = _agent_dir(tmp_path)
    assert dict(cd.iter_resource_dependencies(folder)) == {**{(f"r{i}", 0): {"tools": i} for i in range(5)},
                                                          ("parked", 0): {}}
    archive = folder / "agent-part-000000.tar"
    original = archive.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(original)) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]

    def rebuilt_with(name: str, old: bytes, new: bytes) -> None:
        changed = [(n, d.replace(old, new) if n == name else d) for n, d in members]
        archive.write_bytes(tar_bytes(changed))

    rebuilt_with("r1.a0.json", b'"tools": 1', b'"tools": 7')  # a rooted record: answered by its root
    assert dict(cd.iter_resource_dependencies(folder))[("r1", 0)] == {"tools": 1}
    rebuilt_with("parked.a0.json", b'"boundary_index": 1', b'"boundary_index": 2')  # the unrooted one is read
    with pytest.raises(CorruptSnapshotError, match=r"member 'parked.a0.json': \d+ bytes with sha256 .*agent-index"):
        list(cd.iter_resource_dependencies(folder))
    archive.write_bytes(original)
    continuations = folder / CONTINUATIONS_NAME
    continuations.write_bytes(continuations.read_bytes().replace(b'"tools":3', b'"tools":4'))
    with pytest.raises(CorruptSnapshotError, match=r"continuations.jsonl.*sha256 is .*the reference expects"):
        list(cd.iter_resource_dependencies(folder))


def test_an_iterator_out_of_order_or_repeated_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRecordError, match=r"\('a', 0\) comes after \('b', 0\)"):
        cd.write_agent_archives(tmp_path / "order", (r for r in [_record("b"), _record("a")]))
    with pytest.raises(InvalidRecordError, match=r"\('r', 1\) appears twice"):
        cd.write_agent_dir(tmp_path / "twice", "ckpt-1", "agent0", (r for r in [_record("r", 1), _record("r", 1)]))
    assert not (tmp_path / "twice" / agent_instance_dir("agent0") / MANIFEST_NAME).exists()


def test_archives_are_written_as_they_fill_in_the_memory_of_one(tmp_path: Path, monkeypatch) -> None:
    """16 archives of 512 records of ~4 KiB each (32 MiB) from a generator: the commit's peak traced
    allocation stays under half the archives' bytes (the archive being built, the writes in flight,
    bounded by ``MAX_PENDING_BYTES``, and the small index and root rows), where the members of
    every archive used to be held at once."""
    import tracemalloc

    from snapformat import gym_dir

    monkeypatch.setattr(gym_dir, "MAX_PENDING_BYTES", 2 << 20)
    blob = "x" * (4 << 10)
    n = 16 * AGENT_ARCHIVE_MAX_MEMBERS
    records = (_record(f"r{i:05d}", agent_state={"blob": blob}) for i in range(n))
    tracemalloc.start()
    try:
        manifest, _ = cd.write_agent_dir(tmp_path, "ckpt-1", "agent0", records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(a.bytes for a in manifest.archives)
    assert manifest.records == n and len(manifest.archives) == 16 and total > 32 << 20
    assert peak < total / 2, f"peak {peak} for {total} bytes of archives"


def test_ledger_lineages_as_pairs_or_a_lazy_mapping_give_the_same_folder(tmp_path: Path) -> None:
    roots = [_root("b"), _root("a")]
    lineage = {"a": b'{"call":1}\n\n{"call":2}\n', "b": b'{"call":3}\n'}
    refs = [ExternalStorageReference(capture_key="a", boundary_model_call_id="c", key="k1")]
    asked: list[str] = []

    class Lazy(dict):  # a mapping whose bytes are built when asked for
        def items(self):
            for key, data in lineage.items():
                asked.append(key)
                yield key, data

    results = [cd.write_ledger_dir(tmp_path / name, "ckpt-1", "policy0", lineages=value, storage_references=iter(refs),
                                   roots=iter(roots))
               for name, value in (("dict", lineage), ("pairs", iter(lineage.items())), ("lazy", Lazy()))]
    assert results[0] == results[1] == results[2] and asked == ["a", "b"]
    folders = [_folder_bytes(tmp_path / name / "model-ledger" / "policy0") for name in ("dict", "pairs", "lazy")]
    assert folders[0] == folders[1] == folders[2]
    with pytest.raises(InvalidRecordError, match="capture key 'a' appears twice"):
        cd.write_ledger_dir(tmp_path / "twice", "ckpt-1", "policy0", lineages=[("a", b"{}\n"), ("a", b"{}\n")],
                            storage_references=[], roots=[])


def test_a_lineage_file_with_known_facts_writes_the_same_folder_and_wrong_facts_are_refused_on_reading(
        tmp_path: Path) -> None:
    lineage = {"a": b'{"call":1}\n{"call":2}\n', "b": b'{"call":3}\n'}
    known = [cd.LineageFile(k, v, hashlib.sha256(v).hexdigest(), v.count(b"\n")) for k, v in lineage.items()]
    results = [cd.write_ledger_dir(tmp_path / name, "ckpt-1", "policy0", lineages=value, storage_references=[],
                                   roots=[_root("a"), _root("b")])
               for name, value in (("pairs", lineage), ("known", [known[0], ("b", lineage["b"])]))]
    assert results[0] == results[1]
    assert _folder_bytes(tmp_path / "pairs" / "model-ledger" / "policy0") == \
        _folder_bytes(tmp_path / "known" / "model-ledger" / "policy0")
    # The writer takes the facts as given; the folder's readers check them against the bytes.
    for name, wrong, field in (("sha", msgspec.structs.replace(known[0], sha256="0" * 64), r"files\['a.lineage.jsonl'\]"),
                               ("rows", msgspec.structs.replace(known[0], rows=3), r"rollouts\['a'\]\.rows")):
        cd.write_ledger_dir(tmp_path / name, "ckpt-1", "policy0", lineages=[wrong], storage_references=[], roots=[])
        folder = tmp_path / name / "model-ledger" / "policy0"
        with pytest.raises(CorruptSnapshotError, match=field):
            cd.read_ledger_dir(folder)


def test_records_come_back_in_index_order_whatever_the_archive_order(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cd, "AGENT_ARCHIVE_MAX_MEMBERS", 2)
    records = [_record(f"r{i}") for i in range(5)]
    archives, index = cd.write_agent_archives(tmp_path, records)
    assert len(archives) == 3
    shuffled = [index[i] for i in (4, 0, 3, 1, 2)]  # rows of different archives interleaved
    assert cd.read_agent_archives(tmp_path, archives, shuffled) == [records[i] for i in (4, 0, 3, 1, 2)]
    assert sorted(cd.iter_agent_records(tmp_path, archives, shuffled), key=lambda r: r.rollout_id) == records
    bad = [*index[:1], msgspec.structs.replace(index[1], archive="agent-part-000009.tar")]
    with pytest.raises(CorruptSnapshotError, match=r"row 2: archive 'agent-part-000009.tar' is not among"):
        cd.read_agent_archives(tmp_path, archives, bad)
