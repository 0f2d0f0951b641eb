"""Token-capture rows through a published snapshot, judged by released NeMo Gym (0.7.0).

TokenEntries stamped with Gym's own helpers go into a snapshot (local disk and SeaweedFS) and come
back, through the reader and through ``snapformat cat SNAP tokens``, as lines Gym's
``TokenEntry.model_validate_json`` accepts and dumps equal to the originals. ``verify`` recomputes
Gym's digest of every whole-prompt row, and the version-1 token files of the golden store
(``spec/examples/store-v1``) still read.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.records import TokenEntry

from schemas.rows import TOKEN_CAPTURE_SCHEMA
from snapformat import SnapshotStore, verify_snapshot
from snapformat.cli import main
from snapformat.token_rows import entries_batch, iter_entries
from tests.gym_entries import token_entries

GOLDEN_V1 = Path(__file__).resolve().parents[2] / "spec" / "examples" / "store-v1"
_prefixes = itertools.count()


def _publish(url: str, entries: list[TokenEntry]) -> SnapshotStore:
    store = SnapshotStore(url)
    draft = store.begin()
    part = draft.part("tq", writer="tq")  # the data plane's token-capture rows, as the writer puts them
    part.write_rows("token_capture.arrow", "token_capture_rows",
                    entries_batch([e.model_dump(mode="json") for e in entries]) if entries else [])
    draft.publish(receipts=[part.close()])
    return store


def _read_back(store: SnapshotStore) -> list[TokenEntry]:
    snap = store.latest()
    assert snap is not None
    (entry,) = snap.files("token_capture_rows")
    return [TokenEntry.model_validate(e) for e in iter_entries(snap.iter_batches(entry), snap.where(entry))]


def _dumps(entries: list[TokenEntry]) -> list[dict]:
    return [e.model_dump(mode="json") for e in entries]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(entries=st.lists(token_entries(), max_size=6))
def test_token_entries_round_trip_through_a_local_snapshot(tmp_path: Path, entries: list[TokenEntry]) -> None:
    store = _publish(str(tmp_path / f"s{next(_prefixes)}"), entries)
    assert _dumps(_read_back(store)) == _dumps(entries)
    report = verify_snapshot(store.latest())
    assert report.ok, report.problems


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(entries=st.lists(token_entries(), min_size=1, max_size=4))
def test_token_entries_round_trip_through_a_snapshot_on_seaweedfs(seaweed, new_bucket, aws_env,
                                                                  entries: list[TokenEntry]) -> None:
    aws_env(seaweed)
    store = _publish(f"s3://{_bucket(seaweed, new_bucket)}/t{next(_prefixes)}", entries)
    assert _dumps(_read_back(store)) == _dumps(entries)
    assert verify_snapshot(store.latest()).ok


_buckets: dict[int, str] = {}


def _bucket(server, new_bucket) -> str:
    """One bucket per server for the whole module (hypothesis runs the test body many times)."""
    if id(server) not in _buckets:
        _buckets[id(server)] = new_bucket(server)
    return _buckets[id(server)]


def _entries(n: int) -> list[TokenEntry]:
    from nemo_gym.token_id_capture.records import ParentResolutionStatus, stamp_lineage

    out = []
    for i in range(n):
        e = TokenEntry(rollout_id="p7_g2-a1", model_call_id=f"call-{i}", model="m", prompt_token_ids=[1, 2, i],
                       generation_token_ids=[3, i], generation_log_probs=[-0.1, -0.2],
                       output_items=[{"type": "message", "content": [{"text": "hé"}]}], token_item_index=0,
                       created_at=1.5, custom_field={"kept": [1, None]})
        out.append(stamp_lineage(e, None, parent_resolution=ParentResolutionStatus.ROOT))
    return out


def test_cat_tokens_prints_lines_gym_accepts_unchanged(tmp_path: Path, capsys) -> None:
    entries = _entries(3)
    store = _publish(str(tmp_path / "s"), entries)
    capsys.readouterr()
    assert main(["cat", store.latest().url, "tokens"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [TokenEntry.model_validate_json(line).model_dump(mode="json") for line in lines] == _dumps(entries)
    assert json.loads(lines[0])["custom_field"] == {"kept": [1, None]}  # Gym's extra field, kept
    assert main(["cat", store.latest().url, "tokens", "--format", "columns", "--limit", "1"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["rollout_id"], row["attempt_index"], row["capture_key"]) == ("p7_g2", 1, "p7_g2-a1")


def test_verify_names_a_row_whose_digest_is_not_gyms(tmp_path: Path) -> None:
    rows = entries_batch([e.model_dump(mode="json") for e in _entries(3)]).to_pylist()
    rows[1]["digest"] = "0" * 64
    store = SnapshotStore(str(tmp_path / "s"))
    draft = store.begin()
    part = draft.part("tq", writer="tq")
    part.write_rows("token_capture.arrow", "token_capture_rows", pa.RecordBatch.from_pylist(rows, schema=TOKEN_CAPTURE_SCHEMA))
    draft.publish(receipts=[part.close()])
    report = verify_snapshot(store.latest())
    (problem,) = report.problems
    assert problem.file == "tq/token_capture.arrow"
    assert "row 1" in problem.message and "call-1" in problem.message and "Gym's digest" in problem.message


def test_version_1_token_files_of_the_golden_store_read_as_gym_entries() -> None:
    snap = SnapshotStore(str(GOLDEN_V1)).latest()
    assert snap is not None
    for entry in snap.files("token_capture_rows"):
        reader = snap.open_rows(entry)
        assert reader.schema.metadata[b"snapformat.schema_version"] == b"1"
        got = [TokenEntry.model_validate(e) for e in iter_entries(snap.iter_batches(entry), snap.where(entry))]
        assert len(got) == entry.records > 0
        assert all(isinstance(e.generation_log_probs[0], float) for e in got if e.generation_log_probs)
    assert verify_snapshot(snap).ok


def test_a_newer_token_file_is_refused_naming_both_versions(tmp_path: Path) -> None:
    from schemas.errors import VersionError
    from schemas.rows import check_schema

    newer = TOKEN_CAPTURE_SCHEMA.with_metadata({b"snapformat.kind": b"token_capture_rows",
                                                b"snapformat.schema_version": b"3"})
    with pytest.raises(VersionError, match=r"'3' is not supported .*versions 1\.\.2"):
        check_schema("token_capture_rows", newer, "tq/token_capture.arrow")
