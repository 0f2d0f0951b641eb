"""Hypothesis strategies for Gym's checkpoint records (``schemas.gym_records``): shared by the tests
of the writers and readers that build their bytes (``snapformat.gym_dir``, ``gymkit.checkpoint_dir``)."""

from __future__ import annotations

from hypothesis import strategies as st

from schemas.gym_records import AgentContinuationRoot

#: Rollout ids and resources server names: safe names (a letter or digit first).
IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._]{0,20}", fullmatch=True)
REVISIONS = st.dictionaries(IDS, st.integers(0, 1000), max_size=3)


@st.composite
def continuation_roots(draw: st.DrawFn, max_attempt: int = 5) -> AgentContinuationRoot:
    """A root with the exact capture key of its attempt; revisions a map or null (from before
    dependency tracking)."""
    rid = draw(IDS)
    attempt = draw(st.integers(0, max_attempt))
    return AgentContinuationRoot(rollout_id=rid, attempt_index=attempt,
                                 capture_key=rid if attempt == 0 else f"{rid}-a{attempt}",
                                 last_committed_model_call_id=draw(st.text(min_size=1, max_size=12)),
                                 resource_state_revisions=draw(st.none() | REVISIONS))
