"""Gym's TokenEntry <-> token-capture row, judged by released NeMo Gym (nemo-gym 0.7.0) itself.

Entries are built and stamped with Gym's own helpers (``stamp_continuation``, ``stamp_lineage``),
mapped to a row and back, and must validate with Gym's ``TokenEntry`` and dump equal, by
``model_dump(mode="json")``, to the original: None as distinct from a default, nested output
items, routed experts of any shape, delta prompts and unknown (extra) fields included.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.records import TokenEntry, compute_digest

from schemas.errors import InvalidRecordError, VersionError
from schemas.rows import TOKEN_CAPTURE_SCHEMA, validate_batch
from schemas.token_entry import entry_to_row, row_to_entry, token_digest
from tests.gym_entries import TOKEN_IDS, token_entries


def _round_trip(entry: TokenEntry) -> TokenEntry:
    row = entry_to_row(entry.model_dump(mode="json"))
    batch = pa.RecordBatch.from_pylist([row], schema=TOKEN_CAPTURE_SCHEMA)
    validate_batch("token_capture_rows", batch, "tokens.arrow")  # the row rules accept what Gym wrote
    back = row_to_entry(batch.to_pylist()[0])
    return TokenEntry.model_validate(back)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=token_entries())
def test_a_token_entry_survives_a_row_unchanged(entry: TokenEntry) -> None:
    again = _round_trip(entry)
    assert again.model_dump(mode="json") == entry.model_dump(mode="json")
    assert list(again.model_dump(mode="json")) == list(entry.model_dump(mode="json"))  # field order too


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(TOKEN_IDS | st.integers(2**63, 2**64 - 1), max_size=40))
def test_the_digest_is_gyms_compute_digest(tokens: list[int]) -> None:
    assert token_digest(tokens) == compute_digest(tokens)


def test_the_capture_key_splits_into_the_rows_identity() -> None:
    entry = TokenEntry(rollout_id="p7_g2-a3", model_call_id="c", prompt_token_ids=[1], generation_token_ids=[],
                       generation_log_probs=[])
    row = entry_to_row(entry.model_dump(mode="json"))
    assert (row["rollout_id"], row["attempt_index"], row["capture_key"]) == ("p7_g2", 3, "p7_g2-a3")
    legal = TokenEntry(rollout_id="x-a0", model_call_id="c", prompt_token_ids=[], generation_token_ids=[],
                       generation_log_probs=[])
    assert (entry_to_row(legal.model_dump(mode="json"))["rollout_id"], entry_to_row(
        legal.model_dump(mode="json"))["attempt_index"]) == ("x-a0", 0)


def test_nulls_of_an_older_row_read_back_as_gyms_defaults() -> None:
    row = {name: None for name in TOKEN_CAPTURE_SCHEMA.names}
    row |= {"schema_version": 1, "rollout_id": "r", "attempt_index": 0, "capture_key": "r", "model_call_id": "c",
            "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
    entry = TokenEntry.model_validate(row_to_entry(row))
    assert entry.model == "" and entry.output_items == [] and entry.created_at == 0.0
    assert entry.continuation_fingerprint == "" and entry.prompt_is_delta is False and entry.cum_len is None


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"schema_version": 2}, VersionError, "understands up to 1"),
    ({"rollout_id": "../x"}, InvalidRecordError, "rollout_id"),
    ({"rollout_id": "x-a01-a1"}, None, None),  # legal: attempt 1 of 'x-a01'
])
def test_entry_refusals_name_the_field(change: dict[str, Any], error: type[Exception] | None,
                                      message: str | None) -> None:
    obj = TokenEntry(rollout_id="r", model_call_id="c", prompt_token_ids=[], generation_token_ids=[],
                     generation_log_probs=[]).model_dump(mode="json") | change
    if error is None:
        assert entry_to_row(obj, "e")["attempt_index"] == 1
        return
    with pytest.raises(error, match=message):
        entry_to_row(obj, "gym/model/policy0/tokens.arrow[3]")


def test_a_row_breaking_gyms_lineage_rules_is_refused() -> None:
    base = entry_to_row(TokenEntry(rollout_id="r", model_call_id="c", prompt_token_ids=[1], generation_token_ids=[2],
                                   generation_log_probs=[-1.0]).model_dump(mode="json"))
    for change, message in [({"parent_resolution": "resolved"}, "requires a parent_call_id"),
                            ({"parent_resolution": "root", "parent_call_id": "p"}, "cannot carry parent_call_id"),
                            ({"prompt_is_delta": True}, "delta prompt")]:
        batch = pa.RecordBatch.from_pylist([base | change], schema=TOKEN_CAPTURE_SCHEMA)
        with pytest.raises(InvalidRecordError, match=message):
            validate_batch("token_capture_rows", batch, "tokens.arrow")
        with pytest.raises(ValueError):  # Gym refuses the same record
            TokenEntry.model_validate(row_to_entry(batch.to_pylist()[0]))
