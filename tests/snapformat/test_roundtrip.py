"""Every part kind written through a real local store reads back equal, and verifies clean.

Proves that:
- random records of every JSON-lines kind, written with compress ``none``, ``zstd`` and ``auto``,
  come back equal (per file and per kind), with the compression, file suffix, record count and
  content size the manifest promises;
- ``auto`` stays plain up to the 256 KiB threshold and switches to one zstd frame past it;
- random row batches of both row kinds (canonical or loosely typed, with or without extra
  columns, zero or more batches) come back with every column's values, through ``read_table`` and
  the memory-mapped ``open_rows``, with the manifest's batch and row counts;
- a loader place JSON comes back equal; a part written through ``attach_part`` (another process's
  way) publishes like a local one;
- ``verify_snapshot`` reports no problem on any of these, and ``token_rows`` finds each indexed call;
- the example snapshot verifies, its Gym parts pass their checks where they lie, and every row of
  Gym's model ledger holds exactly the data plane's token-capture entry of its call; the example of
  the 1.0/1.1 layout verifies and its token index finds each call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schemas.controller import AckOwed, LoaderPlace, PromptGroup, ReplayIndexEntry, RolloutAttempt
from schemas.gym_records import (
    AgentContinuationRoot,
    AgentStateRecord,
    ModelLedgerEntry,
    SessionStateRecord,
    TokenIndexEntry,
)
from schemas.identity import capture_key
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.token_entry import token_digest
from snapformat import SnapshotStore, attach_part, verify_snapshot
from snapformat.adopt import check_part, gym_prefixes
from snapformat.gym_dir import check_folder, component_of_prefix
from snapformat.jsonl import ZSTD_THRESHOLD
from snapformat.token_rows import iter_entries

pytestmark = pytest.mark.timeout(240)

# ---- strategies ----------------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
NON_NEG = st.integers(0, 2**31)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
F32 = st.floats(-100, 100, width=32, allow_nan=False)
TEXT = st.text(max_size=16)
NAMES = st.text(min_size=1, max_size=16)
ROLLOUT_IDS = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._]{0,10}\Z")  # no '-', so never '-a<N>'
JSON_VALUES = st.recursive(st.none() | st.booleans() | INT64 | FLOATS | TEXT,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                           max_leaves=8)
COMPRESS = st.sampled_from(["none", "zstd", "auto"])


@st.composite
def identities(draw: st.DrawFn) -> tuple[str, int, str]:
    rid, attempt = draw(ROLLOUT_IDS), draw(st.integers(0, 4))
    return rid, attempt, capture_key(rid, draw(st.integers(0, attempt)))


def _continuation(ident: tuple[str, int, str], call: str, revs: dict[str, int] | None) -> AgentContinuationRoot:
    rid, attempt, key = ident
    return AgentContinuationRoot(rollout_id=rid, attempt_index=attempt, capture_key=key,
                                 last_committed_model_call_id=call, resource_state_revisions=revs)


def _agent_state(ident: tuple[str, int, str], status: str, turn: int, state: Any) -> AgentStateRecord:
    rid, attempt, key = ident
    return AgentStateRecord(rollout_id=rid, attempt_index=attempt, capture_key=key, status=status,
                            turn_index=turn, state=state)


def _ledger(ident: tuple[str, int, str], call: str, parent: str | None, at: float) -> ModelLedgerEntry:
    rid, attempt, key = ident
    return ModelLedgerEntry(rollout_id=rid, attempt_index=attempt, capture_key=key, model_call_id=call,
                            parent_call_id=parent, turn_index=0, created_at=at)


def _replay(ident: tuple[str, int, str], key: str) -> ReplayIndexEntry:
    rid, attempt, _ = ident
    return ReplayIndexEntry(key=key, partition_id="train", rollout_id=rid, attempt_index=attempt, group_id="g",
                            status="ready")


def _ledger_record(ident: tuple[str, int, str], which: int, text: str) -> Any:
    rid, attempt, _ = ident
    if which == 0:
        return PromptGroup(group_id=text, prompt_index=attempt, state="finalizing", rollout_ids=[rid])
    if which == 1:
        return RolloutAttempt(rollout_id=rid, group_id=text, attempt_index=attempt, state="sealed")
    return AckOwed(rollout_id=rid, attempt_index=attempt, result_key=text)


#: Records of every JSON-lines kind except ``token_index``, which is derived from the token rows
#: (an index naming rows that do not exist is a problem ``verify`` must report).
RECORDS: dict[str, st.SearchStrategy[Any]] = {
    "continuations": st.builds(_continuation, identities(), NAMES,
                               st.none() | st.dictionaries(NAMES, INT64, max_size=3)),
    "agent_state": st.builds(_agent_state, identities(), st.sampled_from(["parked", "finished_unacked"]),
                             NON_NEG, JSON_VALUES),
    "model_ledger": st.builds(_ledger, identities(), NAMES, st.none() | NAMES, FLOATS),
    "session_state": st.builds(lambda sid, rev, rid, state: SessionStateRecord(
        session_id=sid, resource="tools", state_revision=rev, rollout_id=rid, state=state),
        TEXT, NON_NEG, st.none() | ROLLOUT_IDS, JSON_VALUES),
    "replay_index": st.builds(_replay, identities(), TEXT),
    "recovery_ledger": st.builds(_ledger_record, identities(), st.integers(0, 2), TEXT),
}
LOADER = st.builds(lambda e, c, s, n, x: LoaderPlace(epoch=e, consumed=c, seed=s, dataset_size=n, extra=x),
                   NON_NEG, NON_NEG, INT64, st.none() | NON_NEG, st.dictionaries(TEXT, JSON_VALUES, max_size=2))

TOKEN_EXTRAS = [pa.field("weight_version", pa.int64()), pa.field("note", pa.string())]
TRAINING_EXTRAS = [pa.field("reward", pa.float64())]


@st.composite
def token_rows(draw: st.DrawFn) -> dict[str, Any]:
    """Token-capture rows of the current file version (2), lineage stamped by Gym's rules, plus two
    extra columns a writer may add."""
    rid, attempt, _ = draw(identities())
    prompt = draw(st.lists(st.integers(0, 2**63 - 1), max_size=6))
    gen = draw(st.lists(st.integers(0, 2**63 - 1), max_size=6))
    stamped = draw(st.booleans())  # Gym's digest and cum_len of the whole sequence, or neither
    resolution = draw(st.none() | st.sampled_from(["root", "resolved", "unresolved"]))
    parent = draw(NAMES) if resolution == "resolved" else draw(st.none() | NAMES) if resolution is None else None
    return {
        "schema_version": 1, "rollout_id": rid, "attempt_index": attempt, "capture_key": capture_key(rid, attempt),
        "model_call_id": draw(NAMES), "model": draw(st.none() | TEXT),
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": draw(st.lists(FLOATS, min_size=len(gen), max_size=len(gen))),
        "routed_experts": draw(st.none() | st.just("[[1,2],[3]]")),
        "output_items": draw(st.none() | TEXT), "token_item_index": draw(st.none() | st.integers(0, 9)),
        "response_id": draw(st.none() | TEXT), "created_at": draw(st.none() | FLOATS),
        "parent_call_id": parent, "cum_len": len(prompt) + len(gen) if stamped else None,
        "digest": token_digest(prompt + gen) if stamped else None, "parent_resolution": resolution,
        "prompt_is_delta": draw(st.none() | st.booleans()) if resolution == "resolved" else draw(st.none() | st.just(False)),
        "continuation_fingerprint": draw(st.none() | TEXT), "fingerprint_version": draw(st.none() | st.integers(0, 9)),
        "extra_fields": draw(st.none() | st.just('{"x":1}')),
        "weight_version": draw(st.none() | INT64), "note": draw(TEXT),
    }


@st.composite
def training_rows(draw: st.DrawFn) -> dict[str, Any]:
    rid, attempt, _ = draw(identities())
    n = draw(st.integers(0, 6))
    floats = st.none() | st.lists(F32, min_size=n, max_size=n)
    return {
        "key": draw(TEXT), "partition_id": draw(TEXT), "rollout_id": rid, "attempt_index": attempt,
        "input_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), "input_lengths": n,
        "generation_logprobs": draw(floats), "prev_logprobs": draw(floats),
        "reference_policy_logprobs": draw(floats), "advantages": draw(floats),
        "token_mask": draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        "sample_mask": draw(st.none() | F32), "reward": draw(st.none() | FLOATS),
    }


def make_batches(rows: list[list[dict[str, Any]]], schema: pa.Schema, extras: list[pa.Field],
                 with_extras: bool, loose: bool) -> list[pa.RecordBatch]:
    """Row batches as a writer might hand them over: canonical or loosely typed, extras or not."""
    full = pa.schema(list(schema) + extras)
    out = []
    for chunk in rows:
        batch = pa.RecordBatch.from_pylist(chunk, schema=full)
        if not with_extras:
            batch = batch.select(schema.names)
        if loose:  # int64 where int32 is canonical: conform must cast it
            i = batch.schema.get_field_index("attempt_index")
            batch = batch.set_column(i, "attempt_index", batch.column(i).cast(pa.int64()))
        out.append(batch)
    return out


def expected_columns(rows: list[list[dict[str, Any]]], schema: pa.Schema, extras: list[pa.Field],
                     with_extras: bool) -> dict[str, list[Any]]:
    names = schema.names + ([f.name for f in extras] if with_extras else [])
    flat = [r for chunk in rows for r in chunk]
    return {name: [r.get(name) for r in flat] for name in names}  # a column a row omits is null


@st.composite
def snapshot_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "records": {kind: draw(st.lists(strategy, max_size=6)) for kind, strategy in RECORDS.items()},
        "compress": {kind: draw(COMPRESS) for kind in [*RECORDS, "token_index"]},
        "tokens": draw(st.lists(st.lists(token_rows(), max_size=5), max_size=3)),
        "training": draw(st.lists(st.lists(training_rows(), max_size=4), max_size=3)),
        "extras": draw(st.booleans()),
        "loose": draw(st.booleans()),
        "loader": draw(LOADER),
    }


# ---- the round trip ------------------------------------------------------------------------------

def token_index_of(rows: list[list[dict[str, Any]]], path: str) -> list[TokenIndexEntry]:
    return [TokenIndexEntry(capture_key=r["capture_key"], model_call_id=r["model_call_id"], file=path, batch=b,
                            row_start=i, row_count=1)
            for b, chunk in enumerate(rows) for i, r in enumerate(chunk)]


def check_jsonl_entry(entry: Any, compress: str, records: list[Any]) -> None:
    """The manifest entry says what was asked for: compression, suffix, count, content size."""
    assert entry.records == len(records)
    if compress == "auto":
        compress = "zstd" if entry.content_size is not None and entry.content_size > ZSTD_THRESHOLD else "none"
    assert entry.compression == compress
    assert entry.path.endswith(".jsonl.zst" if compress == "zstd" else ".jsonl")
    assert (entry.content_size is not None) == (compress == "zstd")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=snapshot_cases())
def test_every_part_round_trips(tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]) -> None:
    store = SnapshotStore(str(tmp_path_factory.mktemp("rt") / "store"))
    draft = store.begin()
    gym = draft.part("gym/all")
    tokens_path = "gym/all/tokens.arrow"
    gym.write_rows("tokens.arrow", "token_capture_rows",
                   make_batches(case["tokens"], TOKEN_CAPTURE_SCHEMA, TOKEN_EXTRAS, case["extras"], case["loose"]))
    records = dict(case["records"], token_index=token_index_of(case["tokens"], tokens_path))
    entries = {kind: gym.write_records(kind, kind, recs, compress=case["compress"][kind])
               for kind, recs in records.items()}
    tq = attach_part(draft.url, "tq")
    tq.write_rows("training.arrow", "training_rows",
                  make_batches(case["training"], TRAINING_SCHEMA, TRAINING_EXTRAS, case["extras"], case["loose"]))
    tq.write_json("loader", "loader_place", case["loader"])
    published = draft.publish(receipts=[tq.close()])
    event(f"extras={case['extras']} loose={case['loose']} token_batches={len(case['tokens'])}")

    snap = store.latest()
    assert snap is not None and snap.manifest == published.manifest
    for kind, recs in records.items():
        entry = next(f for f in snap.files(kind) if f.path == entries[kind].path)
        check_jsonl_entry(entry, case["compress"][kind], recs)
        assert list(snap.iter_records(entry)) == recs
        assert snap.records(kind) == recs
    assert snap.records("loader") == [case["loader"]]
    for part, rows, schema, extras in (("tokens", case["tokens"], TOKEN_CAPTURE_SCHEMA, TOKEN_EXTRAS),
                                       ("training", case["training"], TRAINING_SCHEMA, TRAINING_EXTRAS)):
        table = snap.read_table(part)
        with_extras = case["extras"] and bool(rows)
        expected = expected_columns(rows, schema, extras, with_extras)
        assert table.schema.names == list(expected)
        for name, values in expected.items():
            assert table.column(name).to_pylist() == values, name
        (entry,) = snap.select(part)
        assert entry.batches == len(rows) and entry.records == sum(map(len, rows))
        assert snap.open_rows(entry).read_all().equals(table)
    report = verify_snapshot(snap)
    assert report.ok, report.problems
    assert report.files_checked == snap.manifest.file_count


@pytest.mark.parametrize(("count", "expect"), [(10, "none"), (3000, "zstd")])
def test_auto_compression_switches_at_the_threshold(tmp_path: Path, count: int, expect: str) -> None:
    records = [AgentStateRecord(rollout_id=f"p{i}_g0", attempt_index=0, capture_key=f"p{i}_g0", status="parked",
                                turn_index=i, state={"messages": ["x" * 64] * 2}) for i in range(count)]
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    entry = draft.part("gym/agent/a").write_records("agent_state", "agent_state", records)  # compress="auto"
    content = sum(len(line) for line in _lines(records))
    assert (content > ZSTD_THRESHOLD) == (expect == "zstd")
    assert entry.compression == expect
    if expect == "zstd":
        assert entry.content_size == content and entry.size < content
        assert entry.path.endswith(".jsonl.zst")
    draft.publish()
    snap = store.open(1)
    assert snap.records("agent") == records
    assert verify_snapshot(snap).ok


def _lines(records: list[Any]) -> list[bytes]:
    return [msgspec.json.encode(r) + b"\n" for r in records]


def test_example_snapshot_round_trips_and_its_ledger_holds_the_captured_tokens(example_store: Path) -> None:
    snap = SnapshotStore(str(example_store)).latest()
    assert snap is not None
    assert verify_snapshot(snap).ok
    captured = {(e["rollout_id"], e["model_call_id"]): e for entry in snap.files("token_capture_rows")
                for e in iter_entries(snap.iter_batches(entry), snap.where(entry))}
    assert len(captured) == snap.read_table("tokens").num_rows > 0
    folders = {component_of_prefix(prefix): Path(check_part(snap, prefix)) for prefix in gym_prefixes(snap)}
    assert sorted(folders) == ["agent", "ledger", "resources"]
    ledger = check_folder(folders["ledger"], component="ledger").manifest
    rows = 0
    for key, rollout in ledger.rollouts.items():
        for name in rollout.files:
            for line in (folders["ledger"] / name).read_bytes().splitlines():
                row = json.loads(line)
                assert row["token"] == captured[(key, row["entry"]["model_call_id"])]
                rows += 1
    assert 0 < rows == sum(r.rows for r in ledger.rollouts.values()) <= len(captured)


def test_legacy_example_snapshot_round_trips_and_indexes_every_call(legacy_example_store: Path) -> None:
    snap = SnapshotStore(str(legacy_example_store)).latest()
    assert snap is not None
    assert verify_snapshot(snap).ok
    index = snap.records("token_index")
    assert len(index) == snap.read_table("tokens").num_rows > 0
    for entry in index[:: max(1, len(index) // 20)]:
        rows = snap.token_rows(entry.capture_key, entry.model_call_id)
        assert rows.num_rows == entry.row_count
        assert set(rows.column("capture_key").to_pylist()) == {entry.capture_key}
        assert set(rows.column("model_call_id").to_pylist()) == {entry.model_call_id}
