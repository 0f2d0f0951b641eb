"""Bad input is refused with a typed error that names what is wrong, and leaves nothing behind.

Proves that:
- records breaking Gym's identity rule make ``write_records`` raise ``InvalidRecordError`` (with
  every compress mode, also after the file was opened), the partial file is removed, and the part
  still publishes; records of the wrong type are refused the same way;
- row batches with a bad rollout id or capture key are refused naming the row, and leave no file;
- part prefixes and file names that would escape (``../x``, ``/abs``, ``a/../../b``, NUL,
  backslash, empty segments) are refused, in this process and through ``attach_part``, and
  nothing is created outside the store;
- a part manifest (through a receipt) or a hand-crafted manifest with a consistent commit whose
  file path is ``../../etc/passwd`` or absolute is refused;
- ``open_snapshot`` on an uncommitted draft raises ``NotPublishedError``;
- overlapping part prefixes are refused, whether both parts are local or one arrives by receipt;
- a second write of the same file name is refused, by the same writer or by another writer of the
  same prefix (``InvalidPathError``, never a bare ``FileExistsError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from schemas.controller import AckOwed, LoaderPlace, ReplayIndexEntry
from schemas.errors import (
    CorruptSnapshotError, InvalidPathError, InvalidRecordError, NotPublishedError, SnapshotError,
)
from schemas.gym_records import AgentContinuationRoot, AgentStateRecord, ModelLedgerEntry, SessionStateRecord
from schemas.rows import TOKEN_CAPTURE_SCHEMA
from snapformat import PartReceipt, SnapshotDraft, SnapshotStore, attach_part, layout, open_snapshot, verify_snapshot
from snapformat.checksum import checksum_bytes

pytestmark = pytest.mark.timeout(120)

ESCAPING = ["../x", "/abs", "a/../../b", "a\x00b", "a\\b", "", "a//b", "a/", ".", "..", "./a", "..\\..\\x"]
# (rollout_id, attempt_index, capture_key) that break Gym's rule.
BAD_IDENTITIES = [
    ("p7_g2-a1", 1, "p7_g2-a1"),  # the id itself ends in -a<N>
    ("../p7", 0, "../p7"),
    ("", 0, ""),
    ("p 7", 0, "p 7"),
    ("p7_g2", 0, "p7_g2-a1"),  # attempt 0 cannot use attempt 1's key
    ("p7_g2", 1, "p7_g2-a2"),
    ("p7_g2", 2, "p7_g3"),
]


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(str(tmp_path / "store"))


def draft_files(draft: SnapshotDraft) -> set[str]:
    root = Path(draft.url)
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def continuation(i: int) -> AgentContinuationRoot:
    return AgentContinuationRoot(rollout_id=f"p{i}_g0", attempt_index=0, capture_key=f"p{i}_g0",
                                 last_committed_model_call_id="call-0", resource_state_revisions=None)


BAD_RECORD_MAKERS: dict[str, Callable[[str, int, str], Any]] = {
    "continuations": lambda rid, n, key: AgentContinuationRoot(
        rollout_id=rid, attempt_index=n, capture_key=key, last_committed_model_call_id="c",
        resource_state_revisions=None),
    "agent_state": lambda rid, n, key: AgentStateRecord(rollout_id=rid, attempt_index=n, capture_key=key,
                                                        status="parked", turn_index=0),
    "model_ledger": lambda rid, n, key: ModelLedgerEntry(rollout_id=rid, attempt_index=n, capture_key=key,
                                                         model_call_id="c", parent_call_id=None, turn_index=0),
}
# Kinds that carry a rollout id but no capture key: only the id rule applies.
BAD_ID_ONLY_MAKERS: dict[str, Callable[[str, int], Any]] = {
    "replay_index": lambda rid, n: ReplayIndexEntry(key="k", partition_id="p", rollout_id=rid, attempt_index=n,
                                                    group_id="g", status="ready"),
    "recovery_ledger": lambda rid, n: AckOwed(rollout_id=rid, attempt_index=n, result_key="r"),
    "session_state": lambda rid, n: SessionStateRecord(session_id="s", resource="tools", state_revision=n,
                                                       rollout_id=rid),
}


def good_then_bad(kind: str, good: int, make_bad: Callable[[], Any]) -> Iterator[Any]:
    """``good`` valid records of ``kind``, then one built lazily from bad input (as a stream would)."""
    for i in range(good):
        if kind in BAD_RECORD_MAKERS:
            yield BAD_RECORD_MAKERS[kind](f"p{i}", 0, f"p{i}")
        else:
            yield BAD_ID_ONLY_MAKERS[kind](f"p{i}", 0)
    yield make_bad()


# ---- records -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BAD_RECORD_MAKERS))
@pytest.mark.parametrize("identity", BAD_IDENTITIES, ids=repr)
def test_records_breaking_gyms_rule_are_refused(
        store: SnapshotStore, kind: str, identity: tuple[str, int, str]) -> None:
    with pytest.raises(InvalidRecordError) as err:
        BAD_RECORD_MAKERS[kind](*identity)
    assert "rollout_id" in str(err.value) or "capture_key" in str(err.value)
    draft = store.begin()
    part = draft.part("gym/agent/a")
    with pytest.raises(InvalidRecordError):
        part.write_records(kind, kind, good_then_bad(kind, 3, lambda: BAD_RECORD_MAKERS[kind](*identity)),
                           compress="none")
    assert draft_files(draft) == set()  # the partial file is gone


@pytest.mark.parametrize("kind", sorted(BAD_ID_ONLY_MAKERS))
@pytest.mark.parametrize("rid", ["p7_g2-a1", "../p7", "", "p 7", "p7\n"])
def test_records_with_a_bad_rollout_id_are_refused(store: SnapshotStore, kind: str, rid: str) -> None:
    draft = store.begin()
    part = draft.part("controller")
    with pytest.raises(InvalidRecordError, match="rollout_id"):
        part.write_records(kind, kind, good_then_bad(kind, 2, lambda: BAD_ID_ONLY_MAKERS[kind](rid, 0)))
    assert draft_files(draft) == set()


@pytest.mark.parametrize(("compress", "good"), [("none", 5), ("zstd", 5), ("auto", 5), ("auto", 6000)])
def test_a_refused_stream_leaves_no_file_and_the_part_still_publishes(
        store: SnapshotStore, compress: str, good: int) -> None:
    """With ``auto`` and 6000 records the file was opened as zstd before the bad record came."""
    draft = store.begin()
    part = draft.part("gym/agent/a")
    with pytest.raises(InvalidRecordError):
        part.write_records("continuations", "continuations",
                           good_then_bad("continuations", good,
                                         lambda: BAD_RECORD_MAKERS["continuations"](*BAD_IDENTITIES[4])),
                           compress=compress)
    assert draft_files(draft) == set()
    # The same name can be written again with good records, and the snapshot publishes.
    part.write_records("continuations", "continuations", [continuation(i) for i in range(3)], compress=compress)
    draft.publish()
    snap = store.open(1)
    assert snap.records("continuations") == [continuation(i) for i in range(3)]
    assert verify_snapshot(snap).ok


@pytest.mark.parametrize("records", [
    [{"rollout_id": "p7", "attempt_index": 0, "capture_key": "p7"}],  # a dict is not a record
    [ModelLedgerEntry(rollout_id="p7", attempt_index=0, capture_key="p7", model_call_id="c",
                      parent_call_id=None, turn_index=0)],  # a record of another kind
    [None],
])
def test_records_of_the_wrong_type_are_refused(store: SnapshotStore, records: list[Any]) -> None:
    draft = store.begin()
    part = draft.part("gym/agent/a")
    with pytest.raises(InvalidRecordError, match="record 0"):
        part.write_records("continuations", "continuations", records, compress="none")
    assert draft_files(draft) == set()


def test_wrong_kinds_and_options_are_refused(store: SnapshotStore) -> None:
    part = store.begin().part("p")
    with pytest.raises(InvalidRecordError):
        part.write_records("x", "token_capture_rows", [])
    with pytest.raises(InvalidRecordError):
        part.write_records("x", "no_such_kind", [])
    with pytest.raises(InvalidRecordError):
        part.write_records("x", "continuations", [], compress="gzip")
    with pytest.raises(InvalidRecordError):
        part.write_rows("y", "continuations", [])
    with pytest.raises(InvalidRecordError):
        part.write_rows("z", "training_rows", [], compression="snappy")
    with pytest.raises(InvalidRecordError):
        part.write_json("l", "loader_place", continuation(0))
    with pytest.raises(InvalidRecordError):
        part.write_json("l", "part_manifest", LoaderPlace(epoch=0, consumed=0, seed=0))


# ---- rows ----------------------------------------------------------------------------------------

def token_batch(rows: list[tuple[str, int, str]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{
        "schema_version": 1, "rollout_id": rid, "attempt_index": n, "capture_key": key, "model_call_id": f"c{i}",
        "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-1.0], "cum_len": 2,
    } for i, (rid, n, key) in enumerate(rows)], schema=TOKEN_CAPTURE_SCHEMA)


@pytest.mark.parametrize("identity", BAD_IDENTITIES, ids=repr)
def test_row_batches_breaking_gyms_rule_are_refused_naming_the_row(
        store: SnapshotStore, identity: tuple[str, int, str]) -> None:
    draft = store.begin()
    part = draft.part("gym/model/m")
    good = [(f"p{i}", 1, f"p{i}-a1") for i in range(4)]
    batch = token_batch(good[:2] + [identity] + good[2:])
    with pytest.raises(InvalidRecordError) as err:
        part.write_rows("tokens.arrow", "token_capture_rows", [token_batch(good), batch])
    message = str(err.value)
    assert "tokens.arrow" in message and "batch 1" in message and "row 2" in message
    assert draft_files(draft) == set()
    part.write_rows("tokens.arrow", "token_capture_rows", token_batch(good))  # the name is free again
    draft.publish()
    assert verify_snapshot(store.open(1)).ok


# ---- names and prefixes --------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ESCAPING, ids=repr)
def test_escaping_part_prefixes_are_refused(tmp_path: Path, store: SnapshotStore, prefix: str) -> None:
    draft = store.begin()
    with pytest.raises(InvalidPathError):
        draft.part(prefix)
    with pytest.raises(InvalidPathError):
        attach_part(draft.url, prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


@pytest.mark.parametrize("name", ESCAPING + ["part-manifest.json"], ids=repr)
def test_escaping_or_reserved_file_names_are_refused(tmp_path: Path, store: SnapshotStore, name: str) -> None:
    draft = store.begin()
    part = draft.part("gym/agent/a")
    with pytest.raises(InvalidPathError):
        part.rows(name, "token_capture_rows")
    with pytest.raises(InvalidPathError):
        part.write_rows(name, "training_rows", [])
    json_name = name.removesuffix(".json")
    with pytest.raises(InvalidPathError):
        part.write_json(json_name, "loader_place", LoaderPlace(epoch=0, consumed=0, seed=0))
    if name != "part-manifest.json":
        with pytest.raises(InvalidPathError):
            part.write_records(name, "continuations", [continuation(0)])
    assert draft_files(draft) == set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_attach_part_refuses_a_url_that_is_not_a_snapshot(tmp_path: Path) -> None:
    for url in [str(tmp_path / "store"), str(tmp_path / "store" / "other" / "snap-0000000001-abcdef12"),
                str(tmp_path / "store" / "snapshots" / ".."), str(tmp_path / "store" / "snapshots" / "a\x00b")]:
        with pytest.raises(InvalidPathError):
            attach_part(url, "p")


def _write_part_manifest(draft: SnapshotDraft, prefix: str, files: list[dict[str, Any]]) -> PartReceipt:
    """A part manifest written by hand (as a buggy or hostile participant might)."""
    data = json.dumps({"format_version": "1.0", "snapshot_id": draft.snapshot_id, "prefix": prefix,
                       "writer": "evil", "files": files, "written_at": 0.0}).encode()
    draft.store.put_bytes(f"{layout.snapshot_dir(draft.snapshot_id)}/{prefix}/{layout.PART_MANIFEST_NAME}", data)
    return PartReceipt(prefix=prefix, writer="evil", part_manifest_checksum=checksum_bytes(data))


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "evil/../../x", "other/x"])
def test_a_part_manifest_naming_a_file_outside_its_prefix_is_refused(store: SnapshotStore, path: str) -> None:
    draft = store.begin()
    receipt = _write_part_manifest(draft, "evil", [{"path": path, "kind": "continuations", "size": 0,
                                                    "checksum": checksum_bytes(b""), "records": 0}])
    with pytest.raises(InvalidPathError) as err:
        draft.publish(receipts=[receipt])
    assert "part-manifest.json" in str(err.value)
    assert store.latest() is None


def test_a_receipt_that_does_not_match_its_part_manifest_is_refused(store: SnapshotStore) -> None:
    draft = store.begin()
    receipt = _write_part_manifest(draft, "p", [])
    forged = PartReceipt(prefix="p", writer="p", part_manifest_checksum=checksum_bytes(b"something else"))
    with pytest.raises(CorruptSnapshotError, match="receipt"):
        draft.publish(receipts=[forged])
    with pytest.raises(InvalidPathError):
        store.begin().publish(receipts=[PartReceipt(prefix="../p", writer="p",
                                                    part_manifest_checksum=receipt.part_manifest_checksum)])


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "a/../../../x", "a\\..\\x", "a//b"])
def test_a_committed_manifest_naming_an_escaping_path_is_refused(
        example_store: Path, rewrite_manifest: Callable[..., None], path: str) -> None:
    rewrite_manifest(example_store, 1, lambda m: m["files"][3].update(path=path))
    store = SnapshotStore(str(example_store))
    with pytest.raises(InvalidPathError) as err:
        store.open(1)
    assert "files[3].path" in str(err.value) and layout.MANIFEST_NAME in str(err.value)
    with pytest.raises(InvalidPathError):
        store.latest()


def test_a_committed_manifest_listing_a_file_twice_is_refused(
        example_store: Path, rewrite_manifest: Callable[..., None]) -> None:
    rewrite_manifest(example_store, 1, lambda m: m["files"].append(dict(m["files"][0])))
    with pytest.raises(CorruptSnapshotError, match="listed twice"):
        SnapshotStore(str(example_store)).open(1)


def test_a_token_index_naming_an_escaping_file_is_refused(
        store: SnapshotStore, tmp_path: Path, rewrite_manifest: Callable[..., None]) -> None:
    draft = store.begin()
    entry = draft.part("gym/model/m").write_records("token_index", "token_index", [], compress="none")
    draft.publish()
    line = (b'{"capture_key":"p1","model_call_id":"c","file":"../../../etc/passwd",'
            b'"batch":0,"row_start":0,"row_count":1}\n')
    (Path(store.open(1).url) / entry.path).write_bytes(line)

    def change(manifest: dict[str, Any]) -> None:
        for f in manifest["files"]:
            if f["path"] == entry.path:
                f.update(size=len(line), checksum=checksum_bytes(line), records=1)

    rewrite_manifest(tmp_path / "store", 1, change)
    snap = store.open(1)
    with pytest.raises(InvalidRecordError) as err:
        snap.token_rows("p1", "c")
    assert entry.path in str(err.value) and "line 1" in str(err.value) and "file" in str(err.value)
    problems = verify_snapshot(snap).problems
    assert [p.file for p in problems] == [entry.path]


# ---- unpublished drafts --------------------------------------------------------------------------

def test_open_snapshot_on_an_uncommitted_draft_is_refused(store: SnapshotStore) -> None:
    draft = store.begin()
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=0, seed=0))
    draft.close_local_parts()
    draft.store.put_bytes(f"{layout.snapshot_dir(draft.snapshot_id)}/{layout.MANIFEST_NAME}", b"{}")
    with pytest.raises(NotPublishedError) as err:
        open_snapshot(draft.url)
    assert draft.snapshot_id in str(err.value)
    assert store.latest() is None


def test_open_snapshot_on_a_draft_that_lost_the_race_is_refused(store: SnapshotStore) -> None:
    loser, winner = store.begin(), store.begin()
    assert loser.sequence == winner.sequence
    loser.part("a").write_records("c", "continuations", [continuation(0)])
    winner.publish()
    with pytest.raises(NotPublishedError):
        open_snapshot(loser.url)  # its sequence is committed, but by another snapshot id
    assert open_snapshot(winner.url).manifest.snapshot_id == winner.snapshot_id


@pytest.mark.parametrize("name", ["snap-0000000009-abcdef12", "not-a-snapshot-id", "snap-0000000000-abcdef12"])
def test_open_snapshot_on_unknown_names_is_refused(store: SnapshotStore, name: str) -> None:
    store.begin().publish()
    with pytest.raises(NotPublishedError):
        open_snapshot(f"{store.url}/snapshots/{name}")


# ---- overlapping parts and duplicate files -------------------------------------------------------

@pytest.mark.parametrize(("first", "second"), [
    ("gym/agent", "gym/agent"), ("gym/agent", "gym/agent/a0"), ("gym/agent/a0", "gym/agent"), ("a", "a/b/c"),
])
def test_overlapping_local_parts_are_refused(store: SnapshotStore, first: str, second: str) -> None:
    draft = store.begin()
    draft.part(first)
    with pytest.raises(InvalidPathError, match="overlaps"):
        draft.part(second)


def test_prefixes_sharing_only_a_string_prefix_do_not_overlap(store: SnapshotStore) -> None:
    draft = store.begin()
    draft.part("gym/agent").write_records("c", "continuations", [continuation(0)])
    draft.part("gym/agentx").write_records("c", "continuations", [continuation(1)])
    draft.publish()
    assert store.open(1).records("continuations") == [continuation(0), continuation(1)]


@pytest.mark.parametrize(("local", "remote"), [("gym", "gym/model/m"), ("gym/model/m/sub", "gym/model/m")])
def test_overlap_between_a_local_part_and_a_receipt_is_refused(store: SnapshotStore, local: str, remote: str) -> None:
    draft = store.begin()
    draft.part(local).write_records("c", "continuations", [continuation(0)])
    other = attach_part(draft.url, remote)
    other.write_records("d", "continuations", [continuation(1)])
    with pytest.raises(InvalidPathError, match="overlaps"):
        draft.publish(receipts=[other.close()])
    assert store.latest() is None


def test_overlapping_receipts_are_refused(store: SnapshotStore) -> None:
    draft = store.begin()
    outer, inner = attach_part(draft.url, "tq"), attach_part(draft.url, "tq/shard0")
    outer.write_records("a", "continuations", [continuation(0)])
    inner.write_records("b", "continuations", [continuation(1)])
    with pytest.raises(InvalidPathError, match="overlaps"):
        draft.publish(receipts=[outer.close(), inner.close()])


def test_a_second_write_of_the_same_name_by_one_writer_is_refused(store: SnapshotStore) -> None:
    draft = store.begin()
    part = draft.part("gym/agent/a")
    part.write_records("c", "continuations", [continuation(0)], compress="none")
    with pytest.raises(InvalidPathError, match="already"):
        part.write_records("c", "continuations", [continuation(1)], compress="none")
    with pytest.raises(InvalidPathError, match="already"):
        part.write_rows("c.jsonl", "training_rows", [])
    part.write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=0, seed=0))
    with pytest.raises(InvalidPathError, match="already"):
        part.write_json("loader", "loader_place", LoaderPlace(epoch=1, consumed=0, seed=0))
    draft.publish()
    snap = store.open(1)
    assert snap.records("continuations") == [continuation(0)]  # the first write stands
    assert snap.records("loader") == [LoaderPlace(epoch=0, consumed=0, seed=0)]


def test_a_second_writer_of_the_same_file_is_refused(store: SnapshotStore) -> None:
    draft = store.begin()
    first = attach_part(draft.url, "gym/agent/a")
    first.write_records("c", "continuations", [continuation(0)], compress="none")
    second = attach_part(draft.url, "gym/agent/a")  # e.g. a participant retried after a timeout
    with pytest.raises(InvalidPathError, match="already exists"):
        second.write_records("c", "continuations", [continuation(1)], compress="none")
    with second.rows("r.arrow", "training_rows"):
        pass  # this time the second writer gets there first
    with pytest.raises(InvalidPathError, match="already exists"):
        first.write_rows("r.arrow", "training_rows", [])
    receipt = first.close()
    with pytest.raises(InvalidPathError, match="already exists"):
        second.close()  # its part manifest would replace the first writer's
    draft.publish(receipts=[receipt])
    snap = store.open(1)
    assert snap.records("continuations") == [continuation(0)]
    assert verify_snapshot(snap).ok


def test_writing_after_close_or_publishing_twice_is_refused(store: SnapshotStore) -> None:
    draft = store.begin()
    part = draft.part("p")
    part.close()
    with pytest.raises(InvalidRecordError, match="closed"):
        part.write_records("c", "continuations", [continuation(0)])
    draft.publish()
    with pytest.raises(InvalidRecordError, match="already published"):
        draft.publish()


def test_every_refusal_here_is_a_snapshot_error() -> None:
    for cls in (InvalidRecordError, InvalidPathError, NotPublishedError, CorruptSnapshotError):
        assert issubclass(cls, SnapshotError)


@pytest.mark.parametrize("bound", ["MAX_MANIFEST_FILES", "MAX_MANIFEST_BYTES"])
def test_a_manifest_past_the_readers_bounds_is_refused_before_the_commit(store: SnapshotStore, bound: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot every reader would refuse (too many entries, too many bytes) is never committed: it
    would become the newest and make ``latest()`` fail. The bounds are lowered here; at the real ones
    this takes about 400,000 parked rollouts' Gym files (``benchmarks/results/parked.md``)."""
    from snapformat import publish as publish_mod

    first = store.begin()
    first.part("p").write_records("c", "continuations", [continuation(0)])
    first.publish()
    draft = store.begin()
    part = draft.part("p")
    for i in range(6):
        part.write_records(f"c{i}", "continuations", [continuation(i)])
    monkeypatch.setattr(publish_mod, bound, 4 if bound == "MAX_MANIFEST_FILES" else 2_000)
    field = "'files' would list 7 entries" if bound == "MAX_MANIFEST_FILES" else "manifest.json would be"
    with pytest.raises(InvalidRecordError, match=field) as refused:
        draft.publish()
    assert draft.url in str(refused.value) and "nothing was published" in str(refused.value)
    assert [c.sequence for c in store.list()] == [1]  # no commit record for sequence 2
    assert store.latest().sequence == 1 and verify_snapshot(store.open(1)).ok
