"""Corrupt bytes are always caught, reported against the right file, and raised as typed errors.

Starting from a published example snapshot of the current writer (Gym's own files adopted as
parts, the data plane's and the controller's parts) and one of the format 1.0/1.1 writer (the Gym
parts of this project's own kinds, which readers keep reading), proves that:
- for every file of the manifest (Gym's many lineage and session files by one of each), flipping
  one byte (first, middle, last), truncating it (to half, to nothing) or appending a byte makes
  ``verify_snapshot`` report a problem naming that file (and no unrelated file), and makes reading
  it through the ``Snapshot`` API raise a ``SnapshotError`` subclass, never another exception and
  never a hang (each test has a timeout): its records or rows, or for a Gym part its bytes, the
  check of the part where it lies (``check_part``) and its download (``materialize_part``);
  a truncated file is refused even with ``verify=False`` (sizes are always checked);
- the same corruptions of ``manifest.json`` or of the commit record make opening fail with a
  typed error naming that file; a flip of any byte of the commit record is either refused naming
  the commit record or lies in a value no reader depends on (``committed_at``, the minor version);
- a zstd JSON-lines part decompressing to more than the manifest's ``content_size`` is refused
  (the zstd-bomb guard, even with a matching checksum), as are a larger ``content_size`` and a
  zstd part without one;
- an Arrow part whose checksum matches but whose batch or row count differs from the manifest is
  refused; a JSON-lines part whose line count differs, and a Gym file whose record count (archive
  members, non-blank lines, 1 for a document) differs, is reported by ``verify``.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zstandard

from schemas.errors import CorruptSnapshotError, SnapshotError
from schemas.gym_records import AgentStateRecord
from schemas.version import FORMAT_VERSION
from snapformat import SnapshotStore, example, layout, verify_snapshot
from snapformat.adopt import check_part, materialize_part
from snapformat.checksum import checksum_bytes
from snapformat.kinds import GYM_FILE_KIND
from snapformat.reader import Snapshot
from snapformat.verify import VerifyReport

pytestmark = pytest.mark.timeout(60)

AGENT_PART = example.gym_prefix("responses_api_agents", example.AGENT)
LEDGER_PART = example.gym_prefix("responses_api_models", example.MODEL)
RESOURCES_PART = example.gym_prefix("resources_servers", example.RESOURCE)
#: Every file of the example snapshot (``snapformat.example.write_example``), by part: each a path,
#: or a role (``<part>/*...``) whose pattern names the many files of one kind of a Gym folder, which
#: the tests stand for by the first the manifest lists.
ROLES: dict[str, str] = {
    **{f"{AGENT_PART}/{name}": re.escape(f"{AGENT_PART}/{name}") for name in (
        "agent-part-000000.tar", "agent-index.jsonl", "continuations.jsonl", "manifest.json", "part-manifest.json")},
    f"{LEDGER_PART}/*.lineage.jsonl": rf"{re.escape(LEDGER_PART)}/[^/]+\.lineage\.jsonl",
    **{f"{LEDGER_PART}/{name}": re.escape(f"{LEDGER_PART}/{name}") for name in (
        "storage-references.jsonl", "manifest.json", "part-manifest.json")},
    f"{RESOURCES_PART}/*.a<n>.json": rf"{re.escape(RESOURCES_PART)}/[^/]+\.a[0-9]+\.json",
    **{f"{RESOURCES_PART}/{name}": re.escape(f"{RESOURCES_PART}/{name}") for name in (
        "manifest.json", "part-manifest.json")},
    **{path: re.escape(path) for path in (
        "tq/training.arrow", "tq/token_capture.arrow", "tq/part-manifest.json", "controller/loader.json",
        "controller/replay_index.jsonl", "controller/recovery_ledger.jsonl", "controller/part-manifest.json")},
}
EXAMPLE_FILES = list(ROLES)
LINEAGE, SESSION = f"{LEDGER_PART}/*.lineage.jsonl", f"{RESOURCES_PART}/*.a<n>.json"
#: The files of the 1.0/1.1 layout (``write_legacy_example``) that hold the kinds only it writes;
#: its part manifests, training rows and controller part are of the kinds covered above.
LEGACY_FILES = [
    "gym/agent/agent0/continuations.jsonl",
    "gym/agent/agent0/agent_state.jsonl",
    "gym/model/policy0/tokens.arrow",
    "gym/model/policy0/ledger.jsonl",
    "gym/model/policy0/token_index.jsonl",
    "gym/resource/tools/sessions.jsonl",
]
LEGACY_OTHER_FILES = [
    "gym/agent/agent0/part-manifest.json", "gym/model/policy0/part-manifest.json",
    "gym/resource/tools/part-manifest.json", "tq/training.arrow", "tq/part-manifest.json", "controller/loader.json",
    "controller/replay_index.jsonl", "controller/recovery_ledger.jsonl", "controller/part-manifest.json",
]
#: Files whose cross-checks in ``verify`` depend on another file being sound.
DEPENDENTS = {"gym/model/policy0/tokens.arrow": {"gym/model/policy0/token_index.jsonl"}}
COMMIT = "commit record"


def resolve(snap: Snapshot, rel: str) -> str:
    """The snapshot file ``rel`` names: itself, or the first of a role's files."""
    if rel not in ROLES or "*" not in rel:
        return rel
    return next(f.path for f in snap.files() if re.fullmatch(ROLES[rel], f.path))


def flip_first(data: bytes) -> bytes:
    return bytes([data[0] ^ 0x01]) + data[1:]


def flip_middle(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


def flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def truncate_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def truncate_empty(data: bytes) -> bytes:
    return b""


def append_byte(data: bytes) -> bytes:
    return data + b"x"  # not whitespace: a JSON document with trailing junk is invalid


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    f.__name__: f for f in (flip_first, flip_middle, flip_last, truncate_half, truncate_empty, append_byte)
}
TRUNCATIONS = {"truncate_half", "truncate_empty"}


def open_store(root: Path) -> SnapshotStore:
    return SnapshotStore(str(root))


def snapshot_path(root: Path, rel: str) -> Path:
    """The disk path of a snapshot file, ``manifest.json`` or (for ``COMMIT``) the commit record."""
    if rel == COMMIT:
        return root / layout.commit_key(1)
    commit = json.loads((root / layout.commit_key(1)).read_bytes())
    return root / layout.snapshot_dir(commit["snapshot_id"]) / rel


def corrupt(root: Path, rel: str, how: str) -> Path:
    path = snapshot_path(root, rel)
    original = path.read_bytes()
    changed = CORRUPTIONS[how](original)
    assert changed != original
    path.write_bytes(changed)
    return path


def read_part(snap: Snapshot, rel: str, verify: bool = True) -> Any:
    """Read one file through the public API the way a consumer of its kind would (Gym's files: their
    bytes, as Gym wrote them)."""
    (entry,) = snap.select(rel)
    if entry.kind in ("token_capture_rows", "training_rows"):
        return snap.open_rows(entry, verify=verify).read_all()
    if entry.kind == GYM_FILE_KIND:
        return snap.read_bytes(entry, verify=verify)
    return list(snap.iter_records(entry, verify=verify))


def _download(snap: Snapshot, prefix: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="corrupt-") as folder:
        return materialize_part(snap, prefix, folder)


def readers_of(snap: Snapshot, rel: str) -> list[Callable[[], Any]]:
    """Every API call that reads ``rel``; each must raise a SnapshotError once it is corrupt."""
    calls: list[Callable[[], Any]] = [lambda: read_part(snap, rel)]
    prefix = rel.rsplit("/", 1)[0]
    # A listed part is one of Gym's files (SPEC §10.4); its part manifest may be the corrupt file.
    if snap.is_listed(prefix) or any(f.kind == GYM_FILE_KIND and f.path.startswith(f"{prefix}/")
                                     for f in snap.manifest.files):
        # A file of a part of Gym's files: a restore checks the part where it lies, or downloads it.
        calls += [lambda: check_part(snap, prefix), lambda: _download(snap, prefix)]
    if rel.endswith(".arrow"):
        calls.append(lambda: snap.read_table(rel))
    elif snap.select(rel)[0].kind != GYM_FILE_KIND:
        calls.append(lambda: snap.records(rel))
    if rel.endswith("tokens.arrow"):  # the token index is intact: it leads into the corrupt rows
        first = snap.records("token_index")[0]
        calls.append(lambda: snap.token_rows(first.capture_key, first.model_call_id))
    if rel.endswith("token_index.jsonl"):
        calls.append(lambda: snap.token_rows("p0_g0", "call-0"))
    return calls


def assert_reported(report: VerifyReport, rel: str, root: Path) -> None:
    files = {p.file for p in report.problems}
    assert rel in files, report.problems
    assert files <= {rel} | DEPENDENTS.get(rel, set()), report.problems
    message = next(p.message for p in report.problems if p.file == rel)
    assert str(snapshot_path(root, rel).relative_to(root)) in message


def test_the_example_lists_exactly_the_files_covered_here(example_store: Path) -> None:
    snap = open_store(example_store).latest()
    assert snap is not None
    paths = [f.path for f in snap.files()]
    roles = {path: [role for role, pattern in ROLES.items() if re.fullmatch(pattern, path)] for path in paths}
    assert all(len(r) == 1 for r in roles.values()), roles  # every file has exactly one role ...
    assert {r[0] for r in roles.values()} == set(ROLES)  # ... and every role a file
    many = [p for p in paths if roles[p][0] in (LINEAGE, SESSION)]
    assert len(many) > 2 * len({roles[p][0] for p in many})  # the roles stand for many files each
    report = verify_snapshot(snap)
    assert report.ok and report.files_checked == len(paths)
    for rel in paths:
        read_part(snap, rel)
    for role in ROLES:  # the pristine copy reads without error through every path used below
        for call in readers_of(snap, resolve(snap, role)):
            call()


def test_the_legacy_example_lists_exactly_the_files_covered_here(legacy_example_store: Path) -> None:
    snap = open_store(legacy_example_store).latest()
    assert snap is not None
    assert sorted(f.path for f in snap.files()) == sorted(LEGACY_FILES + LEGACY_OTHER_FILES)
    report = verify_snapshot(snap)
    assert report.ok and report.files_checked == len(LEGACY_FILES + LEGACY_OTHER_FILES)
    for rel in LEGACY_FILES:
        for call in readers_of(snap, rel):
            call()


def _assert_corruption_caught(root: Path, role: str, how: str) -> None:
    snap = open_store(root).open(1)  # opened before the damage, as a long-lived reader would be
    rel = resolve(snap, role)
    corrupt(root, rel, how)
    assert_reported(verify_snapshot(snap), rel, root)
    assert_reported(verify_snapshot(open_store(root).open(1)), rel, root)
    for call in readers_of(snap, rel):
        with pytest.raises(SnapshotError) as err:
            call()
        assert rel in str(err.value)
    if how in TRUNCATIONS:  # sizes are checked even when checksums are skipped
        with pytest.raises(CorruptSnapshotError, match="size"):
            read_part(snap, rel, verify=False)


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("rel", EXAMPLE_FILES)
def test_a_corrupt_file_is_reported_and_refused(example_store: Path, rel: str, how: str) -> None:
    _assert_corruption_caught(example_store, rel, how)


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("rel", LEGACY_FILES)
def test_a_corrupt_file_of_the_legacy_kinds_is_reported_and_refused(legacy_example_store: Path, rel: str,
                                                                    how: str) -> None:
    _assert_corruption_caught(legacy_example_store, rel, how)


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("rel", [layout.MANIFEST_NAME, COMMIT])
def test_a_corrupt_manifest_or_commit_record_is_refused_naming_it(example_store: Path, rel: str, how: str) -> None:
    path = corrupt(example_store, rel, how)
    store = open_store(example_store)
    shown = str(path.relative_to(example_store))
    for opener in (lambda: store.open(1), store.latest):
        with pytest.raises(SnapshotError) as err:
            opener()
        assert shown in str(err.value)


def test_a_flip_of_any_commit_record_byte_is_refused_or_harmless(example_store: Path) -> None:
    path = snapshot_path(example_store, COMMIT)
    original = path.read_bytes()
    record = json.loads(original)
    committed_at = original.index(json.dumps(record["committed_at"]).encode())
    harmless = set(range(committed_at, committed_at + len(json.dumps(record["committed_at"]))))
    # The minor digit: "1.2" -> "1.3" (one bit of it): another minor version is still readable.
    harmless.add(original.index(f'"{FORMAT_VERSION}"'.encode()) + 3)
    shown = str(path.relative_to(example_store))
    for i in range(len(original)):
        path.write_bytes(original[:i] + bytes([original[i] ^ 0x01]) + original[i + 1:])
        try:
            snap = open_store(example_store).open(1)
        except SnapshotError as exc:
            assert shown in str(exc), (i, exc)
        else:
            assert i in harmless, (i, chr(original[i]))
            assert snap.manifest.snapshot_id == record["snapshot_id"]
    path.write_bytes(original)


def test_every_manifest_byte_is_covered_by_the_commit_checksum(example_store: Path) -> None:
    path = snapshot_path(example_store, layout.MANIFEST_NAME)
    original = path.read_bytes()
    for i in range(0, len(original), 97):
        path.write_bytes(original[:i] + bytes([original[i] ^ 0x20]) + original[i + 1:])
        with pytest.raises(CorruptSnapshotError, match="checksum"):
            open_store(example_store).open(1)
    path.write_bytes(original)
    open_store(example_store).open(1)


# ---- manifest claims that the bytes do not bear out ----------------------------------------------

def _publish_zstd_part(root: Path, count: int = 400) -> tuple[SnapshotStore, str, list[AgentStateRecord]]:
    records = [AgentStateRecord(rollout_id=f"p{i}_g0", attempt_index=0, capture_key=f"p{i}_g0", status="parked",
                                turn_index=i, state={"messages": ["hello"] * 4}) for i in range(count)]
    store = open_store(root)
    draft = store.begin()
    entry = draft.part("gym/agent/a").write_records("agent_state", "agent_state", records, compress="zstd")
    draft.publish()
    assert entry.compression == "zstd" and entry.content_size
    return store, entry.path, records


def _assert_refused(store: SnapshotStore, rel: str, match: str) -> None:
    snap = store.open(1)
    with pytest.raises(CorruptSnapshotError, match=match) as err:
        snap.records(rel)
    assert rel in str(err.value)
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [rel]


@pytest.mark.parametrize("shrink", [1, 1000, "all"])
def test_zstd_part_larger_than_its_content_size_is_refused(
        tmp_path: Path, rewrite_entry: Callable[..., None], shrink: int | str) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    real = store.open(1).select(rel)[0].content_size
    rewrite_entry(tmp_path / "store", 1, rel, content_size=0 if shrink == "all" else real - shrink)
    _assert_refused(store, rel, "content_size")


def test_zstd_bomb_with_a_matching_checksum_is_refused(tmp_path: Path, rewrite_entry: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\n" * (64 << 20))  # 64 MiB of newlines in ~2 KB
    assert len(bomb) < 16 << 10
    snapshot_path(tmp_path / "store", rel).write_bytes(bomb)
    rewrite_entry(tmp_path / "store", 1, rel, size=len(bomb), checksum=checksum_bytes(bomb),
               content_size=1000)
    _assert_refused(store, rel, "content_size")


def test_zstd_part_smaller_than_its_content_size_is_refused(
        tmp_path: Path, rewrite_entry: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    real = store.open(1).select(rel)[0].content_size
    rewrite_entry(tmp_path / "store", 1, rel, content_size=real + 1)
    _assert_refused(store, rel, "content_size")


def test_zstd_part_without_content_size_is_refused(tmp_path: Path, rewrite_entry: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    rewrite_entry(tmp_path / "store", 1, rel, content_size=None)
    _assert_refused(store, rel, "content_size")


def test_zstd_part_that_is_not_zstd_is_refused(tmp_path: Path, rewrite_entry: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    junk = b'{"not": "zstd"}\n' * 10
    snapshot_path(tmp_path / "store", rel).write_bytes(junk)
    rewrite_entry(tmp_path / "store", 1, rel, size=len(junk), checksum=checksum_bytes(junk))
    _assert_refused(store, rel, "zstd")


@pytest.mark.parametrize("rel", ["tq/token_capture.arrow", "tq/training.arrow"])
@pytest.mark.parametrize("batches", [0, 2, 7])
def test_arrow_part_whose_batch_count_differs_is_refused(
        example_store: Path, rewrite_entry: Callable[..., None], rel: str, batches: int) -> None:
    rewrite_entry(example_store, 1, rel, batches=batches)  # the real files hold 1 batch
    snap = open_store(example_store).open(1)
    for call in (lambda: snap.read_table(rel), lambda: snap.open_rows(snap.select(rel)[0])):
        with pytest.raises(CorruptSnapshotError, match="record batches") as err:
            call()
        assert rel in str(err.value)
    assert_reported(verify_snapshot(snap), rel, example_store)


def _assert_count_reported(root: Path, rewrite_entry: Callable[..., None], role: str) -> None:
    snap = open_store(root).open(1)
    rel = resolve(snap, role)
    real = snap.select(rel)[0].records
    rewrite_entry(root, 1, rel, records=real + 1)
    report = verify_snapshot(open_store(root).open(1))
    assert_reported(report, rel, root)
    assert str(real) in next(p.message for p in report.problems if p.file == rel)


@pytest.mark.parametrize("rel", ["tq/token_capture.arrow", "tq/training.arrow", "controller/recovery_ledger.jsonl",
                                 f"{AGENT_PART}/agent-part-000000.tar", LINEAGE, SESSION])
def test_part_whose_record_count_differs_is_reported(
        example_store: Path, rewrite_entry: Callable[..., None], rel: str) -> None:
    _assert_count_reported(example_store, rewrite_entry, rel)


@pytest.mark.parametrize("rel", ["gym/model/policy0/tokens.arrow", "gym/model/policy0/ledger.jsonl"])
def test_a_legacy_part_whose_record_count_differs_is_reported(
        legacy_example_store: Path, rewrite_entry: Callable[..., None], rel: str) -> None:
    _assert_count_reported(legacy_example_store, rewrite_entry, rel)


@pytest.mark.parametrize("rel", [LINEAGE, "controller/recovery_ledger.jsonl"])
def test_a_missing_file_is_reported_and_refused(example_store: Path, rel: str) -> None:
    snap = open_store(example_store).open(1)
    rel = resolve(snap, rel)
    snapshot_path(example_store, rel).unlink()
    assert_reported(verify_snapshot(snap), rel, example_store)
    for call in readers_of(snap, rel):
        with pytest.raises(CorruptSnapshotError, match="missing") as err:
            call()
        assert rel in str(err.value)


def test_a_missing_manifest_is_refused_naming_it_and_the_commit(example_store: Path) -> None:
    snapshot_path(example_store, layout.MANIFEST_NAME).unlink()
    with pytest.raises(CorruptSnapshotError) as err:
        open_store(example_store).open(1)
    assert layout.MANIFEST_NAME in str(err.value) and layout.commit_key(1) in str(err.value)
