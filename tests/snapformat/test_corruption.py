"""Corrupt bytes are always caught, reported against the right file, and raised as typed errors.

Starting from a published example snapshot (every part kind), proves that:
- for every file the manifest lists, flipping one byte (first, middle, last), truncating it
  (to half, to nothing) or appending a byte makes ``verify_snapshot`` report a problem naming that
  file (and no unrelated file), and makes reading that part through the ``Snapshot`` API raise a
  ``SnapshotError`` subclass, never another exception and never a hang (each test has a timeout);
  a truncated file is refused even with ``verify=False`` (sizes are always checked);
- the same corruptions of ``manifest.json`` or of the commit record make opening fail with a
  typed error naming that file; a flip of any byte of the commit record is either refused naming
  the commit record or lies in a value no reader depends on (``committed_at``, the minor version);
- a zstd JSON-lines part decompressing to more than the manifest's ``content_size`` is refused
  (the zstd-bomb guard, even with a matching checksum), as are a larger ``content_size`` and a
  zstd part without one;
- an Arrow part whose checksum matches but whose batch or row count differs from the manifest is
  refused; a JSON-lines part whose line count differs is reported by ``verify``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zstandard

from schemas.errors import CorruptSnapshotError, SnapshotError
from schemas.gym_records import AgentStateRecord
from schemas.version import FORMAT_VERSION
from snapformat import SnapshotStore, layout, verify_snapshot
from snapformat.checksum import checksum_bytes
from snapformat.reader import Snapshot
from snapformat.verify import VerifyReport

pytestmark = pytest.mark.timeout(60)

#: Every file of the example snapshot (``snapformat.example.write_example``), by kind of part.
EXAMPLE_FILES = [
    "gym/agent/agent0/continuations.jsonl",
    "gym/agent/agent0/agent_state.jsonl",
    "gym/agent/agent0/part-manifest.json",
    "gym/model/policy0/tokens.arrow",
    "gym/model/policy0/ledger.jsonl",
    "gym/model/policy0/token_index.jsonl",
    "gym/model/policy0/part-manifest.json",
    "gym/resource/tools/sessions.jsonl",
    "gym/resource/tools/part-manifest.json",
    "tq/training.arrow",
    "tq/part-manifest.json",
    "controller/loader.json",
    "controller/replay_index.jsonl",
    "controller/recovery_ledger.jsonl",
    "controller/part-manifest.json",
]
#: Files whose cross-checks in ``verify`` depend on another file being sound.
DEPENDENTS = {"gym/model/policy0/tokens.arrow": {"gym/model/policy0/token_index.jsonl"}}
COMMIT = "commit record"


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
    """Read one part through the public API the way a consumer of its kind would."""
    (entry,) = snap.select(rel)
    if entry.kind in ("token_capture_rows", "training_rows"):
        return snap.open_rows(entry, verify=verify).read_all()
    return list(snap.iter_records(entry, verify=verify))


def readers_of(snap: Snapshot, rel: str) -> list[Callable[[], Any]]:
    """Every API call that reads ``rel``; each must raise a SnapshotError once it is corrupt."""
    calls: list[Callable[[], Any]] = [lambda: read_part(snap, rel)]
    if rel.endswith(".arrow"):
        calls.append(lambda: snap.read_table(rel))
    else:
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
    assert sorted(f.path for f in snap.manifest.files) == sorted(EXAMPLE_FILES)
    report = verify_snapshot(snap)
    assert report.ok and report.files_checked == len(EXAMPLE_FILES)
    for rel in EXAMPLE_FILES:
        read_part(snap, rel)  # the pristine copy reads without error through every path used below
        for call in readers_of(snap, rel):
            call()


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("rel", EXAMPLE_FILES)
def test_a_corrupt_file_is_reported_and_refused(example_store: Path, rel: str, how: str) -> None:
    snap = open_store(example_store).open(1)  # opened before the damage, as a long-lived reader would be
    corrupt(example_store, rel, how)
    assert_reported(verify_snapshot(snap), rel, example_store)
    assert_reported(verify_snapshot(open_store(example_store).open(1)), rel, example_store)
    for call in readers_of(snap, rel):
        with pytest.raises(SnapshotError) as err:
            call()
        assert rel in str(err.value)
    if how in TRUNCATIONS:  # sizes are checked even when checksums are skipped
        with pytest.raises(CorruptSnapshotError, match="size"):
            read_part(snap, rel, verify=False)


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
    # The minor digit: "1.1" -> "1.0" (or "1.0" -> "1.1"): another minor version is still readable.
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


def _set_entry(rewrite: Callable[..., None], root: Path, rel: str, **fields: Any) -> None:
    def change(manifest: dict[str, Any]) -> None:
        (entry,) = [f for f in manifest["files"] if f["path"] == rel]
        entry.update(fields)

    rewrite(root, 1, change)


def _assert_refused(store: SnapshotStore, rel: str, match: str) -> None:
    snap = store.open(1)
    with pytest.raises(CorruptSnapshotError, match=match) as err:
        snap.records(rel)
    assert rel in str(err.value)
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [rel]


@pytest.mark.parametrize("shrink", [1, 1000, "all"])
def test_zstd_part_larger_than_its_content_size_is_refused(
        tmp_path: Path, rewrite_manifest: Callable[..., None], shrink: int | str) -> None:
    store, rel, records = _publish_zstd_part(tmp_path / "store")
    real = store.open(1).select(rel)[0].content_size
    _set_entry(rewrite_manifest, tmp_path / "store", rel, content_size=0 if shrink == "all" else real - shrink)
    _assert_refused(store, rel, "content_size")


def test_zstd_bomb_with_a_matching_checksum_is_refused(tmp_path: Path, rewrite_manifest: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\n" * (64 << 20))  # 64 MiB of newlines in ~2 KB
    assert len(bomb) < 16 << 10
    snapshot_path(tmp_path / "store", rel).write_bytes(bomb)
    _set_entry(rewrite_manifest, tmp_path / "store", rel, size=len(bomb), checksum=checksum_bytes(bomb),
               content_size=1000)
    _assert_refused(store, rel, "content_size")


def test_zstd_part_smaller_than_its_content_size_is_refused(
        tmp_path: Path, rewrite_manifest: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    real = store.open(1).select(rel)[0].content_size
    _set_entry(rewrite_manifest, tmp_path / "store", rel, content_size=real + 1)
    _assert_refused(store, rel, "content_size")


def test_zstd_part_without_content_size_is_refused(tmp_path: Path, rewrite_manifest: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    _set_entry(rewrite_manifest, tmp_path / "store", rel, content_size=None)
    _assert_refused(store, rel, "content_size")


def test_zstd_part_that_is_not_zstd_is_refused(tmp_path: Path, rewrite_manifest: Callable[..., None]) -> None:
    store, rel, _ = _publish_zstd_part(tmp_path / "store")
    junk = b'{"not": "zstd"}\n' * 10
    snapshot_path(tmp_path / "store", rel).write_bytes(junk)
    _set_entry(rewrite_manifest, tmp_path / "store", rel, size=len(junk), checksum=checksum_bytes(junk))
    _assert_refused(store, rel, "zstd")


@pytest.mark.parametrize("rel", ["gym/model/policy0/tokens.arrow", "tq/training.arrow"])
@pytest.mark.parametrize("batches", [0, 2, 7])
def test_arrow_part_whose_batch_count_differs_is_refused(
        example_store: Path, rewrite_manifest: Callable[..., None], rel: str, batches: int) -> None:
    _set_entry(rewrite_manifest, example_store, rel, batches=batches)  # the real files hold 1 batch
    snap = open_store(example_store).open(1)
    for call in (lambda: snap.read_table(rel), lambda: snap.open_rows(snap.select(rel)[0])):
        with pytest.raises(CorruptSnapshotError, match="record batches") as err:
            call()
        assert rel in str(err.value)
    assert_reported(verify_snapshot(snap), rel, example_store)


@pytest.mark.parametrize("rel", ["gym/model/policy0/tokens.arrow", "tq/training.arrow",
                                 "gym/model/policy0/ledger.jsonl", "controller/recovery_ledger.jsonl"])
def test_part_whose_record_count_differs_is_reported(
        example_store: Path, rewrite_manifest: Callable[..., None], rel: str) -> None:
    snap = open_store(example_store).open(1)
    real = snap.select(rel)[0].records
    _set_entry(rewrite_manifest, example_store, rel, records=real + 1)
    report = verify_snapshot(open_store(example_store).open(1))
    assert_reported(report, rel, example_store)
    assert str(real) in next(p.message for p in report.problems if p.file == rel)


def test_a_missing_file_is_reported_and_refused(example_store: Path) -> None:
    rel = "gym/model/policy0/ledger.jsonl"
    snapshot_path(example_store, rel).unlink()
    snap = open_store(example_store).open(1)
    assert_reported(verify_snapshot(snap), rel, example_store)
    with pytest.raises(CorruptSnapshotError, match="missing"):
        snap.records(rel)


def test_a_missing_manifest_is_refused_naming_it_and_the_commit(example_store: Path) -> None:
    snapshot_path(example_store, layout.MANIFEST_NAME).unlink()
    with pytest.raises(CorruptSnapshotError) as err:
        open_store(example_store).open(1)
    assert layout.MANIFEST_NAME in str(err.value) and layout.commit_key(1) in str(err.value)
