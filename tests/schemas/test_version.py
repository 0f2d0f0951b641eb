"""Format and record versions: what this reader refuses, and that it says why.

Each snapshot-level case publishes a real snapshot, then rewrites ``manifest.json`` (or a part)
and its commit record consistently (size and checksum updated), so that only the version check
can refuse it; an unchanged rewrite is shown to open. Proves that:
- a manifest of a newer major version (``2.0``) or with an unknown required feature is refused
  with ``VersionError`` naming the file, the snapshot's version and this reader's (``1.3``);
- an older, the same or a newer minor version without unknown required features is read;
- this reader (format 1.3) knows ``dataplane_rows`` and ``shared_objects``, and no name is reserved
  any more; a reader of format 1.2 (simulated) refuses a snapshot that names shared objects,
  naming the feature and both versions, and reads a 1.3 snapshot that names none; a manifest that
  names objects without listing the feature is refused as corrupt;
- format 1.2's kind ``gym_file`` needs no feature (SPEC §13.1): a snapshot of Gym's files lists none,
  a reader that does not know the kind reads the rest of it and verifies its bytes, and an older
  restore refuses it by its topology fingerprint (the 1.1 recipe recomputed here never matches);
- a commit record or store marker of another major version is refused the same way;
- a JSON line (plain or zstd) or loader place with ``schema_version`` 2 is refused with
  ``VersionError``, and one with ``schema_version`` 0 with a typed error, each naming file and line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas.controller import LoaderPlace
from schemas.errors import CorruptSnapshotError, InvalidRecordError, SnapshotError, TopologyMismatchError, VersionError
from schemas.gym_records import AgentContinuationRoot
from schemas.manifest import FileKind
from schemas.version import (
    FORMAT_VERSION,
    KIND_FEATURES,
    KINDS_WITHOUT_FEATURE,
    KNOWN_FEATURES,
    PART_LISTINGS,
    RESERVED_FEATURES,
    SHARED_OBJECTS,
    check_readable,
    check_record_version,
    features_of_kinds,
    parse_version,
)
from snapformat import SnapshotStore, example, layout, open_snapshot, verify_snapshot
from snapformat.checksum import checksum_bytes
from snapformat.publish import Published

GOLDEN = Path(__file__).resolve().parents[2] / "spec" / "examples"

pytestmark = pytest.mark.timeout(120)


def continuation(i: int, schema_version: int = 1) -> AgentContinuationRoot:
    return AgentContinuationRoot(schema_version=schema_version, rollout_id=f"p{i}_g0", attempt_index=0,
                                 capture_key=f"p{i}_g0", last_committed_model_call_id=f"call-{i}",
                                 resource_state_revisions={"tools": i})


def publish_small(root: Path, lines: list[AgentContinuationRoot] | None = None, compress: str = "none",
                  loader: LoaderPlace | None = None) -> tuple[SnapshotStore, Published]:
    store = SnapshotStore(str(root))
    draft = store.begin()
    part = draft.part("gym/agent/agent0")
    part.write_records("continuations", "continuations", lines or [continuation(i) for i in range(3)],
                       compress=compress)
    draft.part("controller").write_json("loader", "loader_place", loader or LoaderPlace(epoch=0, consumed=4, seed=7))
    return store, draft.publish()


def rewrite_manifest(root: Path, pub: Published, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to manifest.json and update the commit record so that both agree."""
    manifest_path = root / layout.snapshot_dir(pub.manifest.snapshot_id) / layout.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_bytes())
    change(manifest)
    data = json.dumps(manifest, indent=1).encode() + b"\n"
    manifest_path.write_bytes(data)
    commit_path = root / layout.commit_key(pub.manifest.sequence)
    commit = json.loads(commit_path.read_bytes())
    commit.update(manifest_size=len(data), manifest_checksum=checksum_bytes(data))
    commit_path.write_bytes(json.dumps(commit).encode())


def rewrite_file(root: Path, pub: Published, rel: str, data: bytes) -> None:
    """Replace one file of the snapshot and update its manifest entry (size, checksum)."""
    (root / layout.snapshot_dir(pub.manifest.snapshot_id) / rel).write_bytes(data)

    def change(manifest: dict[str, Any]) -> None:
        for f in manifest["files"]:
            if f["path"] == rel:
                f.update(size=len(data), checksum=checksum_bytes(data))
                if f.get("compression") == "zstd":
                    raise AssertionError("rewrite_file writes plain files only")

    rewrite_manifest(root, pub, change)


def open_all_ways(store: SnapshotStore, pub: Published) -> list[Callable[[], Any]]:
    return [lambda: store.open(pub.manifest.sequence), store.latest, lambda: open_snapshot(pub.url)]


def test_an_unchanged_rewrite_still_opens(tmp_path: Path) -> None:
    store, pub = publish_small(tmp_path)
    rewrite_manifest(tmp_path, pub, lambda m: None)
    for opener in open_all_ways(store, pub):
        snap = opener()
        assert snap.manifest == pub.manifest
    assert verify_snapshot(store.open(1)).ok


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2", "1.3", "1.17"])
def test_same_major_is_read(tmp_path: Path, version: str) -> None:
    store, pub = publish_small(tmp_path)
    rewrite_manifest(tmp_path, pub, lambda m: m.update(format_version=version, a_newer_field={"x": 1}))
    snap = store.open(1)
    assert snap.manifest.format_version == version
    assert snap.records("continuations") == [continuation(i) for i in range(3)]


@pytest.mark.parametrize("version", ["2.0", "0.9", "10.0"])
def test_other_major_is_refused_naming_both_versions(tmp_path: Path, version: str) -> None:
    store, pub = publish_small(tmp_path)
    rewrite_manifest(tmp_path, pub, lambda m: m.update(format_version=version))
    for opener in open_all_ways(store, pub):
        with pytest.raises(VersionError) as err:
            opener()
        message = str(err.value)
        assert version in message and FORMAT_VERSION in message
        assert layout.MANIFEST_NAME in message and pub.manifest.snapshot_id in message


@pytest.mark.parametrize(("features", "unknown"), [(["from_the_future"], "from_the_future"),
                                                    (["shared_objects", "zz"], "zz"),
                                                    (["dataplane_rows", "zz"], "zz")])
def test_unknown_required_feature_is_refused_naming_both_versions(tmp_path: Path, features: list[str],
                                                                  unknown: str) -> None:
    store, pub = publish_small(tmp_path)
    rewrite_manifest(tmp_path, pub, lambda m: m.update(format_version="1.4", required_features=features))
    with pytest.raises(VersionError) as err:
        store.open(1)
    message = str(err.value)
    assert f"requires feature(s) {unknown} (format version 1.4)" in message
    assert f"this reader (format version {FORMAT_VERSION})" in message and layout.MANIFEST_NAME in message


@pytest.mark.parametrize("version", ["1", "v1.0", "1.0.0", "", "1.x", "١.٠"])
def test_unparseable_version_is_refused(tmp_path: Path, version: str) -> None:
    store, pub = publish_small(tmp_path)
    rewrite_manifest(tmp_path, pub, lambda m: m.update(format_version=version))
    with pytest.raises(VersionError, match="format_version"):
        store.open(1)


def test_commit_record_of_a_newer_major_is_refused(tmp_path: Path) -> None:
    store, _pub = publish_small(tmp_path)
    commit_path = tmp_path / layout.commit_key(1)
    commit = json.loads(commit_path.read_bytes()) | {"format_version": "2.0"}
    commit_path.write_bytes(json.dumps(commit).encode())
    with pytest.raises(VersionError) as err:
        store.open(1)
    assert "2.0" in str(err.value) and FORMAT_VERSION in str(err.value)
    assert layout.commit_key(1) in str(err.value)


def test_store_marker_of_a_newer_major_is_refused(tmp_path: Path) -> None:
    store, _ = publish_small(tmp_path)
    store.check_marker()
    (tmp_path / layout.MARKER_KEY).write_text('{"format": "snapformat-store", "format_version": "2.0"}')
    with pytest.raises(VersionError) as err:
        store.check_marker()
    assert "2.0" in str(err.value) and layout.MARKER_KEY in str(err.value)


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_newer_record_line_is_refused_naming_file_and_line(tmp_path: Path, compress: str) -> None:
    lines = [continuation(0), continuation(1), continuation(2, schema_version=2), continuation(3)]
    store, _pub = publish_small(tmp_path, lines, compress=compress)
    snap = store.open(1)
    entry = snap.files("continuations")[0]
    with pytest.raises(VersionError) as err:
        snap.records("continuations")
    message = str(err.value)
    assert entry.path in message and "line 3" in message and "schema_version 2" in message
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [entry.path]
    assert "line 3" in problems[0].message


def test_record_line_of_version_zero_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    lines = [continuation(0), continuation(1, schema_version=0)]
    store, _ = publish_small(tmp_path, lines)
    snap = store.open(1)
    entry = snap.files("continuations")[0]
    with pytest.raises((VersionError, InvalidRecordError)) as err:
        snap.records("continuations")
    message = str(err.value)
    assert entry.path in message and "line 2" in message and "schema_version" in message


def test_hand_written_newer_line_is_refused(tmp_path: Path) -> None:
    store, pub = publish_small(tmp_path)
    rel = pub.manifest.files[0].path
    assert rel.endswith("continuations.jsonl")
    line = {"schema_version": 2, "rollout_id": "p7_g2", "attempt_index": 0, "capture_key": "p7_g2",
            "last_committed_model_call_id": "call-2", "resource_state_revisions": {"tools": 3},
            "field_of_version_2": True}
    rewrite_file(tmp_path, pub, rel, json.dumps(line).encode() + b"\n")
    with pytest.raises(VersionError, match="line 1"):
        store.open(1).records("continuations")


def test_newer_loader_place_is_refused_naming_the_file(tmp_path: Path) -> None:
    store, _ = publish_small(tmp_path, loader=LoaderPlace(schema_version=2, epoch=0, consumed=0, seed=0))
    snap = store.open(1)
    with pytest.raises(VersionError) as err:
        snap.records("loader")
    assert "controller/loader.json" in str(err.value)


# ---- the rules themselves ------------------------------------------------------------------------

def test_parse_version() -> None:
    assert parse_version("1.0", "x") == (1, 0)
    assert parse_version("12.34", "x") == (12, 34)
    for bad in ("1", "1.0.0", "a.b", " 1.0", None):
        with pytest.raises(VersionError, match="manifest.json"):
            parse_version(bad, "manifest.json")  # type: ignore[arg-type]


def test_check_readable() -> None:
    check_readable("1.0", [], "m")
    check_readable("1.9", (), "m")
    check_readable("1.1", ["dataplane_rows"], "m")
    with pytest.raises(VersionError):
        check_readable("2.0", [], "m")
    check_readable("1.3", ["shared_objects"], "m")
    check_readable("1.3", ["dataplane_rows", "shared_objects"], "m")
    check_readable("1.4", ["part_listings"], "m")
    with pytest.raises(VersionError, match=r"incremental \(format version 1.5\); this reader \(format version "
                                           r"1.4\) knows dataplane_rows, part_listings, shared_objects"):
        check_readable("1.5", ["incremental", "shared_objects"], "m")
    check_readable("1.2", [], "m")
    check_readable("1.2", ["dataplane_rows"], "m")


def test_format_1_1_defines_the_dataplane_rows_feature() -> None:
    assert "dataplane_rows" in KNOWN_FEATURES and not KNOWN_FEATURES & RESERVED_FEATURES
    assert features_of_kinds(["dataplane_rows", "training_rows"]) == ["dataplane_rows"]
    assert features_of_kinds(["training_rows", "token_capture_rows", "continuations"]) == []


def test_format_1_2_adds_gym_file_without_a_feature() -> None:
    from snapformat.kinds import GYM_KINDS

    assert "gym_file" in KINDS_WITHOUT_FEATURE and "gym_file" not in KIND_FEATURES
    assert features_of_kinds(["gym_file", "part_manifest", "training_rows", "token_capture_rows", "replay_index",
                              "recovery_ledger", "loader_place"]) == []
    assert features_of_kinds(["gym_file", "dataplane_rows"]) == ["dataplane_rows"]
    known_kinds = set(typing.get_args(FileKind)) | GYM_KINDS
    assert set(KIND_FEATURES) <= known_kinds and set(KINDS_WITHOUT_FEATURE) <= known_kinds
    assert not set(KIND_FEATURES) & set(KINDS_WITHOUT_FEATURE)


def test_format_1_3_defines_the_shared_objects_feature() -> None:
    """1.3 makes the reserved name ``shared_objects`` a feature (SPEC §14.2): known, no longer
    reserved, listed exactly when a file entry names an object, whatever the kinds."""
    assert SHARED_OBJECTS == "shared_objects" and SHARED_OBJECTS in KNOWN_FEATURES
    assert RESERVED_FEATURES == frozenset()
    assert SHARED_OBJECTS not in KIND_FEATURES.values()  # a property of entries, not of a kind
    assert features_of_kinds(["training_rows", "token_capture_rows"], objects=True) == ["shared_objects"]
    assert features_of_kinds(["dataplane_rows", "training_rows"], objects=True) == ["dataplane_rows", "shared_objects"]
    assert features_of_kinds(["training_rows", "gym_file"], objects=False) == []


def publish_with_objects(root: Path) -> tuple[SnapshotStore, Published]:
    """A snapshot whose training rows are a shared object (format 1.3)."""
    store = SnapshotStore(str(root))
    draft = store.begin()
    rs = example.rollouts(12, seed=7)  # four of them finished: four training rows
    draft.part("tq").write_rows_object("training-000000.arrow", "training_rows", example.training_batch(rs, seed=7))
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=2, seed=5))
    return store, draft.publish()


def test_a_1_2_reader_refuses_shared_objects_naming_both_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC §13.1, §14.2: a reader of format 1.2 knows ``dataplane_rows`` only. It refuses a 1.3
    snapshot that names shared objects (it would look for those files in the snapshot folder),
    naming the feature and both versions, every way it opens one; it reads a 1.3 snapshot that names
    none (incremental saves off) as written."""
    from schemas import version

    objects_root, plain_root = tmp_path / "objects", tmp_path / "plain"
    store, pub = publish_with_objects(objects_root)
    assert pub.manifest.format_version == FORMAT_VERSION and pub.manifest.required_features == [SHARED_OBJECTS]
    (entry,) = pub.manifest.files[:1]
    assert entry.object == entry.checksum and (objects_root / layout.object_key(entry.object)).is_file()
    plain, plain_pub = publish_small(plain_root)
    assert plain_pub.manifest.format_version == FORMAT_VERSION and plain_pub.manifest.required_features == []

    monkeypatch.setattr(version, "FORMAT_VERSION", "1.2")
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset({"dataplane_rows"}))
    for opener in open_all_ways(store, pub):
        with pytest.raises(VersionError) as err:
            opener()
        message = str(err.value)
        assert (f"requires feature(s) shared_objects (format version {FORMAT_VERSION}); this reader (format version "
                "1.2) knows dataplane_rows") in message
        assert layout.MANIFEST_NAME in message and pub.manifest.snapshot_id in message
    assert plain.open(1).records("continuations") == [continuation(i) for i in range(3)]
    assert verify_snapshot(plain.open(1)).ok


def test_objects_without_the_feature_are_refused(tmp_path: Path) -> None:
    """A manifest that names an object but does not list ``shared_objects`` would be misread by a
    1.2 reader (it would not refuse it): this reader refuses it as corrupt."""
    store, pub = publish_with_objects(tmp_path)
    assert store.open(1).read_table("training").num_rows == pub.manifest.files[0].records == 4
    rewrite_manifest(tmp_path, pub, lambda m: m.update(required_features=[]))
    with pytest.raises(CorruptSnapshotError, match="shared_objects"):
        store.open(1)


def publish_gym_example(root: Path) -> tuple[SnapshotStore, Published]:
    store = SnapshotStore(str(root))
    draft = store.begin()
    gym, receipts = example.write_example(draft, count=8, seed=5)
    return store, draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY)


def test_format_1_4_defines_the_part_listings_feature() -> None:
    """1.4 adds ``part_listings`` (SPEC §10.4, §14.4): known, listed exactly when a part is listed by
    its part manifest, whatever the kinds."""
    assert FORMAT_VERSION == "1.4"
    assert KNOWN_FEATURES == {"dataplane_rows", "shared_objects", "part_listings"}
    assert PART_LISTINGS == "part_listings" and PART_LISTINGS not in KIND_FEATURES.values()
    assert features_of_kinds(["gym_file", "part_manifest"], listed_parts=True) == ["part_listings"]
    assert features_of_kinds(["dataplane_rows"], objects=True, listed_parts=True) == [
        "dataplane_rows", "part_listings", "shared_objects"]
    assert features_of_kinds(["gym_file"]) == []


def test_a_snapshot_of_gyms_files_lists_its_gym_parts_by_their_part_manifests(tmp_path: Path) -> None:
    """The publisher lists each part of Gym's files by its part manifest and totals (SPEC §10.4), so
    the manifest lists no ``gym_file`` and requires ``part_listings`` only; the reader gives every file."""
    store, pub = publish_gym_example(tmp_path)
    snap = store.open(1)
    m = snap.manifest
    assert m.format_version == FORMAT_VERSION and m.required_features == [PART_LISTINGS] and pub.manifest == m
    assert not any(f.kind == "gym_file" for f in m.files)
    gym_prefixes = [p.part_prefix for p in m.gym_commit.participants if p.part_prefix]
    assert [p.prefix for p in m.listed_parts] == gym_prefixes
    for listed in m.listed_parts:
        files = snap.part_files(listed.prefix)
        assert files and all(f.kind == "gym_file" and f.path.startswith(listed.prefix + "/") for f in files)
        assert (listed.files, listed.bytes) == (len(files), sum(f.size for f in files))
    assert len(snap.files("gym_file")) == sum(p.files for p in m.listed_parts)
    assert m.file_count == len(m.files) + sum(p.files for p in m.listed_parts) == len(snap.files())
    assert m.total_bytes == sum(f.size for f in snap.files())


def test_a_1_3_reader_refuses_listed_parts_naming_both_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC §13.1, §14.4: a reader of format 1.3 would take the manifest's files for all of them and
    miss the Gym parts' files; it refuses the snapshot, naming the feature and both versions, every
    way it opens one."""
    from schemas import version

    store, pub = publish_gym_example(tmp_path)
    monkeypatch.setattr(version, "FORMAT_VERSION", "1.3")
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset({"dataplane_rows", "shared_objects"}))
    for opener in open_all_ways(store, pub):
        with pytest.raises(VersionError) as err:
            opener()
        assert ("requires feature(s) part_listings (format version 1.4); this reader (format version 1.3) "
                "knows dataplane_rows, shared_objects") in str(err.value)


def test_listed_parts_without_the_feature_are_refused(tmp_path: Path) -> None:
    store, pub = publish_gym_example(tmp_path)
    rewrite_manifest(tmp_path, pub, lambda m: m.update(required_features=[]))
    with pytest.raises(CorruptSnapshotError, match="does not list 'part_listings' in required_features"):
        store.open(1)


def test_a_reader_that_does_not_know_gym_file_reads_the_rest(tmp_path: Path) -> None:
    """What a 1.1 reader does with a 1.2 snapshot (the golden one: a 1.4 publisher lists Gym's files
    by their part manifests, which a 1.1 reader refuses by its feature instead): Gym's files are of a
    kind it does not know (here renamed so this reader does not know it either); it reads every
    other part and verifies the skipped files' bytes."""
    root = tmp_path / "store"
    shutil.copytree(GOLDEN / "store-v1.2", root)
    store = SnapshotStore(str(root))
    before = store.open(1)
    pub = Published(url=before.url, manifest=before.manifest, commit=before.commit)
    loader, replay = before.records("loader"), before.records("replay_index")
    training = before.read_table("training")
    rewrite_manifest(root, pub, lambda m: [f.update(kind="gym_file_of_a_newer_minor") for f in m["files"]
                                           if f["kind"] == "gym_file"])
    snap = store.open(1)
    assert snap.files("gym_file") == [] and len(snap.files("gym_file_of_a_newer_minor")) == len(before.files("gym_file"))
    assert snap.records("loader") == loader and snap.records("replay_index") == replay
    assert snap.read_table("training").equals(training)
    report = verify_snapshot(snap)
    assert report.ok, report.problems
    assert report.files_checked == snap.manifest.file_count
    (entry,) = [f for f in snap.manifest.files if f.path.endswith("/continuations.jsonl")]
    path = root / layout.snapshot_dir(pub.manifest.snapshot_id) / entry.path
    path.write_bytes(path.read_bytes()[:-1] + b"!")  # an unknown kind's bytes are still checked
    assert [p.file for p in verify_snapshot(store.open(1)).problems] == [entry.path]


def test_an_older_restore_refuses_a_1_2_snapshot_by_its_fingerprint(tmp_path: Path) -> None:
    """A 1.0 or 1.1 coordinator hashes a JSON array of its own contracts; NeMo-RL's recipe hashes a
    JSON object of Gym's. The two never match, so an older restore stops at the fingerprint."""
    store, _ = publish_gym_example(tmp_path)
    for contracts in (example.CONTRACTS, [{"component": c["participant"]["component"],
                                           "name": c["participant"]["participant_name"]} for c in example.CONTRACTS]):
        items = sorted(contracts, key=lambda c: (str(c.get("component", "")), str(c.get("name", ""))))
        old = "sha256:" + hashlib.sha256(json.dumps(items, sort_keys=True, separators=(",", ":"),
                                                    ensure_ascii=False).encode()).hexdigest()
        assert old != example.TOPOLOGY
        with pytest.raises(TopologyMismatchError) as err:
            store.latest_matching(old)
        assert old in str(err.value) and example.TOPOLOGY in str(err.value)
    assert store.latest_matching(example.TOPOLOGY).sequence == 1


def test_a_1_0_reader_refuses_dataplane_rows_naming_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas import version

    monkeypatch.setattr(version, "FORMAT_VERSION", "1.0")
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset())
    version.check_readable("1.1", [], "m")  # a 1.1 snapshot without the feature: readable
    with pytest.raises(VersionError, match=r"m: requires feature\(s\) dataplane_rows \(format version 1.1\); "
                                           r"this reader \(format version 1.0\) knows none"):
        version.check_readable("1.1", ["dataplane_rows"], "m")


@pytest.mark.parametrize(("version", "ok"), [(1, True), (0, False), (2, False), (-1, False)])
def test_check_record_version(version: int, ok: bool) -> None:
    if ok:
        check_record_version(version, "f: line 1")
    else:
        with pytest.raises(VersionError, match=f"f: line 1: schema_version {version}"):
            check_record_version(version, "f: line 1")


def test_version_errors_are_snapshot_errors() -> None:
    assert issubclass(VersionError, SnapshotError)
