"""Arrow row schemas: ``conform`` and ``validate_batch``.

Proves that:
- ``conform`` casts compatible types (int64 ids and list<int64> tokens to int32, float64 log-probs
  to float32), puts required columns first in spec order, keeps extra columns after them, fills a
  missing nullable column with nulls, and refuses a missing required column or an unsafe cast with
  ``InvalidRecordError`` naming the column;
- ``validate_batch`` accepts good rows and refuses, naming the offending row, a rollout id that
  breaks Gym's rule, a capture key that is not the key of its rollout and attempt, log-probs whose
  length differs from the generation tokens', a bad ``parent_resolution`` and a negative attempt;
- the row check of rollout ids agrees with ``check_rollout_id`` (Hypothesis);
- a token row or row file of an unsupported schema version is refused with ``VersionError``.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import InvalidRecordError, VersionError
from schemas.identity import MAX_NAME_LEN, capture_key, check_rollout_id
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA, check_schema, conform, validate_batch


def token_row(i: int, rollout_id: str = "p0_g0", attempt: int = 0, **over: Any) -> dict[str, Any]:
    row = {
        "schema_version": 1, "rollout_id": rollout_id, "attempt_index": attempt,
        "capture_key": capture_key(rollout_id, attempt) if "capture_key" not in over else over["capture_key"],
        "model_call_id": f"call-{i}", "model": "policy", "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5], "generation_log_probs": [-0.5, -0.25], "routed_experts": None,
        "output_items": "[]", "token_item_index": 0, "response_id": f"r{i}", "created_at": 1.0,
        "parent_call_id": None, "cum_len": 5, "digest": "00", "parent_resolution": "root",
        "prompt_is_delta": False,
    }
    row.update(over)
    return row


def training_row(i: int, rollout_id: str = "p0_g0", **over: Any) -> dict[str, Any]:
    row = {
        "key": f"k{i}", "partition_id": "train", "rollout_id": rollout_id, "attempt_index": 0,
        "input_ids": [1, 2, 3], "input_lengths": 3, "generation_logprobs": [0.0, 0.0, -1.0],
        "prev_logprobs": None, "reference_policy_logprobs": None, "advantages": [0.5, 0.5, 0.5],
        "token_mask": [0, 1, 1], "sample_mask": 1.0,
    }
    row.update(over)
    return row


def token_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows, schema=TOKEN_CAPTURE_SCHEMA)


# ---- conform -----------------------------------------------------------------------------------

def test_conform_keeps_a_canonical_batch_and_sets_the_metadata() -> None:
    batch = token_batch([token_row(0)]).replace_schema_metadata(None)
    out = conform("token_capture_rows", batch, "t.arrow")
    assert out.schema.equals(TOKEN_CAPTURE_SCHEMA, check_metadata=True)
    assert out.to_pylist() == batch.to_pylist()


def test_conform_casts_compatible_types_and_keeps_extra_columns_last() -> None:
    rows = [training_row(0), training_row(1, rollout_id="p0_g1")]
    loose = pa.RecordBatch.from_pylist([dict(r, note=f"extra{i}") for i, r in enumerate(rows)])  # inferred types
    assert loose.schema.field("attempt_index").type == pa.int64()
    assert loose.schema.field("input_ids").type == pa.list_(pa.int64())
    assert loose.schema.field("advantages").type == pa.list_(pa.float64())
    # Shuffle the columns so order has to be restored too.
    loose = loose.select(list(reversed(loose.schema.names)))
    out = conform("training_rows", loose, "tq/training.arrow")
    assert out.schema.names == TRAINING_SCHEMA.names + ["note"]
    for field in TRAINING_SCHEMA:
        assert out.schema.field(field.name).type == field.type
    assert out.column("note").to_pylist() == ["extra0", "extra1"]
    assert out.column("input_ids").to_pylist() == [[1, 2, 3], [1, 2, 3]]
    assert out.column("advantages").to_pylist() == [[0.5] * 3, [0.5] * 3]
    check_schema("training_rows", out.schema, "tq/training.arrow")


def test_conform_fills_a_missing_nullable_column_with_nulls() -> None:
    batch = token_batch([token_row(0)]).drop_columns(["routed_experts", "digest"])
    out = conform("token_capture_rows", batch, "t.arrow")
    assert out.column("routed_experts").null_count == 1
    assert out.column("digest").to_pylist() == [None]


@pytest.mark.parametrize("column", [f.name for f in TOKEN_CAPTURE_SCHEMA if not f.nullable])
def test_conform_refuses_a_missing_required_token_column(column: str) -> None:
    batch = token_batch([token_row(0)]).drop_columns([column])
    with pytest.raises(InvalidRecordError) as err:
        conform("token_capture_rows", batch, "tq/token_capture.arrow")
    assert f"column {column!r} is missing" in str(err.value)
    assert "tq/token_capture.arrow" in str(err.value)


@pytest.mark.parametrize("column", [f.name for f in TRAINING_SCHEMA if not f.nullable])
def test_conform_refuses_a_missing_required_training_column(column: str) -> None:
    batch = pa.RecordBatch.from_pylist([training_row(0)], schema=TRAINING_SCHEMA).drop_columns([column])
    with pytest.raises(InvalidRecordError, match=f"column {column!r} is missing"):
        conform("training_rows", batch, "tq/training.arrow")


@pytest.mark.parametrize(("column", "values"), [
    ("attempt_index", pa.array([2**40], pa.int64())),  # does not fit int32
    ("input_ids", pa.array([["a", "b"]])),  # strings are not token ids
    ("rollout_id", pa.array([[1]])),
])
def test_conform_refuses_an_unsafe_cast_naming_the_column(column: str, values: pa.Array) -> None:
    batch = pa.RecordBatch.from_pylist([training_row(0)], schema=TRAINING_SCHEMA)
    batch = batch.set_column(batch.schema.get_field_index(column), column, values)
    with pytest.raises(InvalidRecordError) as err:
        conform("training_rows", batch, "tq/training.arrow")
    assert repr(column) in str(err.value) and "tq/training.arrow" in str(err.value)


def test_check_schema_refuses_a_wrong_type_naming_the_column() -> None:
    i = TRAINING_SCHEMA.get_field_index("input_lengths")
    schema = TRAINING_SCHEMA.set(i, pa.field("input_lengths", pa.int64()))
    with pytest.raises(InvalidRecordError, match="'input_lengths' has type int64"):
        check_schema("training_rows", schema, "tq/training.arrow")


# ---- validate_batch ----------------------------------------------------------------------------

def test_good_rows_pass() -> None:
    rows = [token_row(0), token_row(1, "p0_g1", 2), token_row(2, parent_resolution=None),
            token_row(3, parent_resolution="unresolved"), token_row(4, generation_token_ids=[],
                                                                   generation_log_probs=[])]
    validate_batch("token_capture_rows", token_batch(rows), "t.arrow")
    validate_batch("training_rows", pa.RecordBatch.from_pylist([training_row(0)], schema=TRAINING_SCHEMA), "x")
    validate_batch("token_capture_rows", token_batch([]), "empty.arrow")


def _refused(kind: str, batch: pa.RecordBatch) -> str:
    with pytest.raises(InvalidRecordError) as err:
        validate_batch(kind, batch, "tq/token_capture.arrow: batch 0")
    assert "tq/token_capture.arrow: batch 0" in str(err.value)
    return str(err.value)


BAD_ROLLOUT_IDS = ["p7_g2-a1", "", "-p7", ".p7", "p 7", "p7/../x", "p7\n", "p7é", "p7-a10"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_bad_rollout_id_is_refused_naming_the_row(n: int, data: st.DataObject) -> None:
    bad_row = data.draw(st.integers(0, n - 1))
    bad = data.draw(st.sampled_from(BAD_ROLLOUT_IDS))
    rows = [token_row(i, f"p{i}_g0") for i in range(n)]
    rows[bad_row]["rollout_id"] = bad  # its capture key is checked later; the id must fail first
    message = _refused("token_capture_rows", token_batch(rows))
    assert f"row {bad_row}: rollout_id {bad!r}" in message
    # Training rows follow the same rule.
    train = [training_row(i, f"p{i}") for i in range(n)]
    train[bad_row]["rollout_id"] = bad
    message = _refused("training_rows", pa.RecordBatch.from_pylist(train, schema=TRAINING_SCHEMA))
    assert f"row {bad_row}: rollout_id {bad!r}" in message


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_capture_key_breaking_gyms_rule_is_refused_naming_the_row(n: int, data: st.DataObject) -> None:
    bad_row = data.draw(st.integers(0, n - 1))
    attempt = data.draw(st.integers(0, 5))
    rid = f"p{bad_row}_g1"
    wrong = data.draw(st.sampled_from([
        f"{rid}-a{attempt + 1}", f"{rid}-a0", f"{rid}x", "other", f"{rid}-a0{attempt}",
        rid if attempt else f"{rid}-a1",
    ]))
    rows = [token_row(i, f"p{i}_g1", attempt) for i in range(n)]
    rows[bad_row]["capture_key"] = wrong
    message = _refused("token_capture_rows", token_batch(rows))
    assert f"row {bad_row}: capture_key {wrong!r}" in message
    assert repr(capture_key(rid, attempt)) in message  # says what it should have been


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_log_probs_length_mismatch_is_refused_naming_the_row(n: int, data: st.DataObject) -> None:
    bad_row = data.draw(st.integers(0, n - 1))
    gen = data.draw(st.lists(st.integers(0, 1000), max_size=6))
    lps = data.draw(st.lists(st.floats(-10, 0, width=32), max_size=6).filter(lambda v: len(v) != len(gen)))
    rows = [token_row(i) for i in range(n)]
    rows[bad_row].update(generation_token_ids=gen, generation_log_probs=lps)
    message = _refused("token_capture_rows", token_batch(rows))
    assert f"row {bad_row}: generation_log_probs has {len(lps)} values for {len(gen)}" in message


@pytest.mark.parametrize("bad", ["ROOT", "", "resolved ", "orphan"])
def test_bad_parent_resolution_is_refused_naming_the_row(bad: str) -> None:
    rows = [token_row(i) for i in range(4)]
    rows[2]["parent_resolution"] = bad
    assert f"row 2: parent_resolution {bad!r}" in _refused("token_capture_rows", token_batch(rows))


def test_negative_attempt_is_refused_naming_the_row() -> None:
    rows = [training_row(i) for i in range(3)]
    rows[1]["attempt_index"] = -1
    assert "row 1: attempt_index -1 is negative" in _refused(
        "training_rows", pa.RecordBatch.from_pylist(rows, schema=TRAINING_SCHEMA))


@settings(max_examples=200, deadline=None)
@given(rid=st.text("abXY09._-a\n/é ", min_size=0, max_size=12))
def test_row_rule_for_rollout_ids_agrees_with_check_rollout_id(rid: str) -> None:
    assert len(rid) <= MAX_NAME_LEN
    batch = pa.RecordBatch.from_pylist([training_row(0, rollout_id=rid)], schema=TRAINING_SCHEMA)
    try:
        check_rollout_id(rid)
    except InvalidRecordError:
        with pytest.raises(InvalidRecordError):
            validate_batch("training_rows", batch, "x")
    else:
        validate_batch("training_rows", batch, "x")


@pytest.mark.parametrize("version", [0, 2, 99])
def test_token_row_of_an_unsupported_schema_version_is_refused_naming_the_row(version: int) -> None:
    rows = [token_row(i) for i in range(3)]
    rows[1]["schema_version"] = version
    with pytest.raises(VersionError) as err:
        validate_batch("token_capture_rows", token_batch(rows), "tokens.arrow: batch 0")
    assert f"row 1: schema_version {version}" in str(err.value) and "tokens.arrow" in str(err.value)


@pytest.mark.parametrize("version", [b"2", b"0", b"x"])
def test_row_file_of_an_unsupported_schema_version_is_refused(version: bytes) -> None:
    schema = TRAINING_SCHEMA.with_metadata({b"snapformat.kind": b"training_rows",
                                            b"snapformat.schema_version": version})
    with pytest.raises(VersionError, match="tq/training.arrow"):
        check_schema("training_rows", schema, "tq/training.arrow")
    check_schema("training_rows", TRAINING_SCHEMA.remove_metadata(), "tq/training.arrow")  # absent means 1
