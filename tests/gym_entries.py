"""Hypothesis strategies for Gym's TokenEntry, built and stamped with released NeMo Gym's own
helpers (``stamp_continuation``, ``stamp_lineage``): shared by the schema and snapshot tests."""

from __future__ import annotations

from hypothesis import strategies as st
from nemo_gym.episode_types import EpisodeId
from nemo_gym.token_id_capture.lineage import stamp_continuation
from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

from schemas.token_entry import KNOWN_FIELDS

ID_FIRST = "abcXYZ019"
ID_CHARS = "abcXYZ019._-"
TOKEN_IDS = st.integers(0, 2**63 - 1)  # our column is int64 (a documented limit; Gym hashes as u64)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | FLOATS | st.text(max_size=12)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
ITEMS = st.lists(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4), max_size=3)
REQUEST = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                          "content": st.text(max_size=20)}), min_size=1, max_size=3)


@st.composite
def rollout_ids(draw: st.DrawFn) -> str:
    return draw(st.text(ID_FIRST, min_size=1, max_size=1)) + draw(st.text(ID_CHARS, max_size=20))


@st.composite
def token_entries(draw: st.DrawFn) -> TokenEntry:
    """A TokenEntry as a Gym model server would capture it, stamped with Gym's helpers."""
    rid = draw(rollout_ids().filter(_gym_accepts))
    key = EpisodeId(rollout_id=rid, attempt=draw(st.integers(0, 5))).capture_key
    gen = draw(st.lists(TOKEN_IDS, max_size=12))
    items = draw(ITEMS)
    extras = draw(st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=8).filter(lambda k: k not in KNOWN_FIELDS),
                                  JSON_VALUES, max_size=2))
    entry = TokenEntry(
        rollout_id=key, model_call_id=draw(st.text(min_size=1, max_size=16)), model=draw(st.text(max_size=10)),
        prompt_token_ids=draw(st.lists(TOKEN_IDS, max_size=20)), generation_token_ids=gen,
        generation_log_probs=draw(st.lists(FLOATS, min_size=len(gen), max_size=len(gen))),
        routed_experts=draw(st.none() | JSON_VALUES), output_items=items,
        token_item_index=draw(st.none() | st.integers(0, len(items) - 1)) if items else None,
        response_id=draw(st.none() | st.text(max_size=12)), created_at=draw(FLOATS),
        prefix_requested=draw(st.booleans()), prefix_supplied=draw(st.booleans()), **extras)
    if draw(st.booleans()):
        stamp_continuation(entry, draw(REQUEST))
    lineage = draw(st.sampled_from(["unstamped", "compat", "root", "unresolved", "resolved", "delta"]))
    if lineage == "compat":
        stamp_lineage(entry, None)
    elif lineage in ("root", "unresolved"):
        stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus(lineage))
        entry.parent_resolution_reason = draw(st.text(max_size=10))
    elif lineage == "resolved":
        stamp_lineage(entry, "call-p", parent_resolution=ParentResolutionStatus.RESOLVED)
    elif lineage == "delta":
        parent_tokens = draw(st.lists(TOKEN_IDS, max_size=10))
        entry.prompt_is_delta = True
        stamp_lineage(entry, "call-p", parent_resolution=ParentResolutionStatus.RESOLVED,
                      cumulative=parent_tokens + entry.prompt_token_ids + gen)
    return entry


def _gym_accepts(rid: str) -> bool:
    try:
        EpisodeId(rollout_id=rid)
    except ValueError:
        return False
    return True
