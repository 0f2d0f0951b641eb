"""Identifier rules shared with NeMo Gym, and the safe-path rule.

Proves, with Hypothesis properties judged by released NeMo Gym's own ``EpisodeId`` (nemo-gym
0.7.0, a test-only dependency), that:
- a rollout id is accepted exactly when Gym accepts it (``^[A-Za-z0-9][A-Za-z0-9._-]*$`` as a
  whole-string match, not ending in the reserved ``-a[1-9][0-9]*``), up to our one extra limit of
  200 characters (a rollout id becomes a path segment);
- the capture key of an attempt is Gym's, and :func:`split_capture_key` inverts it;
- ``check_capture_key`` accepts ``<rid>-a<N>`` only with ``1 <= N <= attempt_index``;
- a relative path is accepted when every segment is a safe name, and refused (``InvalidPathError``)
  when it holds ``..``, is absolute, holds NUL or a backslash, or has an empty segment.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from schemas.errors import InvalidPathError, InvalidRecordError, SnapshotError
from nemo_gym.episode_types import EpisodeId
from pydantic import ValidationError

from schemas import identity
from schemas.identity import (
    MAX_NAME_LEN, MAX_PATH_DEPTH, capture_key, capture_keys_down, check_capture_key, check_name, check_relative_path,
    check_rollout_id, split_capture_key,
)

# Gym's suffix, only to steer generation towards valid ids; acceptance is judged by EpisodeId itself.
GYM_SUFFIX = re.compile(r"-a[1-9][0-9]*\Z")

ID_FIRST = "abcXYZ019"
ID_CHARS = "abcXYZ019._-"


def gym_accepts(rid: str) -> bool:
    """Gym's own verdict (its EpisodeId model), within our length limit."""
    try:
        EpisodeId(rollout_id=rid, attempt=0)
    except ValidationError:
        return False
    return len(rid) <= MAX_NAME_LEN


@st.composite
def rollout_ids(draw: st.DrawFn) -> str:
    """Valid rollout ids (including ones ending in ``-a`` or ``-aX`` without digits)."""
    rid = draw(st.text(ID_FIRST, min_size=1, max_size=1)) + draw(st.text(ID_CHARS, max_size=30))
    assume(not GYM_SUFFIX.search(rid))
    return rid


# Text that is often close to an id: id characters plus the troublemakers.
near_ids = st.text(ID_CHARS + "a-0/\\\x00 \n\t.é", max_size=24)


@given(rid=rollout_ids())
@example(rid="p7_g2")
@example(rid="x-a")
@example(rid="x-ab1")
@example(rid="0")
def test_valid_rollout_ids_are_accepted(rid: str) -> None:
    assert check_rollout_id(rid) == rid


@given(text=near_ids)
@example(text="")
@example(text="-x")
@example(text=".x")
@example(text="p7_g2-a1")
@example(text="p7_g2-a0")
@example(text="p7_g2-a12")
@example(text="x-a01")
@example(text="x-a00")
@example(text="x-a10")
@example(text="x\n")
@example(text="x-a1\n")
@example(text="a b")
def test_rollout_id_rule_matches_gym(text: str) -> None:
    if gym_accepts(text):
        assert check_rollout_id(text) == text
    else:
        with pytest.raises(InvalidRecordError, match="rollout_id"):
            check_rollout_id(text)


def test_rollout_id_refusal_names_the_value_and_the_rule() -> None:
    with pytest.raises(InvalidRecordError) as err:
        check_rollout_id("p7_g2-a3", where="rows[4].rollout_id")
    assert "rows[4].rollout_id" in str(err.value) and "'p7_g2-a3'" in str(err.value)
    assert "-a<N>" in str(err.value)


def test_overlong_rollout_id_is_refused() -> None:
    with pytest.raises(InvalidRecordError, match="longer than"):
        check_rollout_id("a" * (MAX_NAME_LEN + 1))


@given(rid=rollout_ids(), attempt=st.integers(0, 10_000))
@example(rid="x-a0", attempt=0)
@example(rid="x-a01", attempt=3)
def test_capture_key_of_an_attempt(rid: str, attempt: int) -> None:
    key = capture_key(rid, attempt)
    assert key == EpisodeId(rollout_id=rid, attempt=attempt).capture_key
    assert split_capture_key(key) == (rid, attempt)
    # The key a writer derives is always one Gym's check accepts for that attempt.
    assert check_capture_key(rid, key, attempt) == key


def test_capture_key_examples_from_gym() -> None:
    assert capture_key("p7_g2", 0) == "p7_g2"
    assert capture_key("p7_g2", 1) == "p7_g2-a1"


@given(attempt=st.integers(max_value=-1))
def test_capture_key_of_a_negative_attempt_is_refused(attempt: int) -> None:
    with pytest.raises(InvalidRecordError, match="negative"):
        capture_key("p7_g2", attempt)


def test_capture_key_of_a_bad_rollout_id_is_refused() -> None:
    with pytest.raises(InvalidRecordError):
        capture_key("p7_g2-a1", 1)


@given(rid=rollout_ids(), attempt=st.integers(0, 60))
def test_capture_keys_down_are_each_earlier_attempts_key_latest_first(rid: str, attempt: int) -> None:
    assert capture_keys_down(rid, attempt) == [capture_key(rid, a) for a in range(attempt, -1, -1)]


def test_capture_keys_down_refuse_what_capture_key_refuses() -> None:
    with pytest.raises(InvalidRecordError, match="negative"):
        capture_keys_down("p7_g2", -1)
    with pytest.raises(InvalidRecordError, match="reserved for capture keys"):
        capture_keys_down("p7_g2-a1", 1)


@given(rid=rollout_ids(), n=st.integers(0, 50), attempt=st.integers(0, 50))
def test_check_capture_key_accepts_suffix_only_within_attempt(rid: str, n: int, attempt: int) -> None:
    key = f"{rid}-a{n}"
    if 1 <= n <= attempt:
        assert check_capture_key(rid, key, attempt) == key
    else:
        with pytest.raises(InvalidRecordError, match="capture_key"):
            check_capture_key(rid, key, attempt)


@given(rid=rollout_ids(), key=near_ids, attempt=st.integers(0, 20))
@example(rid="p7_g2", key="p7_g2-a01", attempt=5)  # not the canonical spelling of attempt 1
@example(rid="p7_g2", key="p7_g2-a", attempt=5)
@example(rid="p7_g2", key="p7_g2-a-1", attempt=5)
@example(rid="p7_g2", key="p7_g2-a²", attempt=5)  # a unicode digit is not an ASCII digit
@example(rid="p7", key="p7_g2", attempt=0)
def test_check_capture_key_matches_gym(rid: str, key: str, attempt: int) -> None:
    allowed = {rid} | {f"{rid}-a{n}" for n in range(1, attempt + 1)}
    if key in allowed:
        assert check_capture_key(rid, key, attempt) == key
    else:
        with pytest.raises(InvalidRecordError) as err:
            check_capture_key(rid, key, attempt)
        assert repr(key) in str(err.value)


def test_check_capture_key_refuses_a_bad_rollout_id() -> None:
    with pytest.raises(InvalidRecordError, match="rollout_id"):
        check_capture_key("bad id", "bad id", 0)


# ---- safe names and relative paths -------------------------------------------------------------

safe_names = st.builds(
    lambda first, rest: first + rest,
    st.text(ID_FIRST, min_size=1, max_size=1),
    st.text(ID_CHARS, max_size=12),
).filter(lambda s: not s.endswith("."))
safe_paths = st.lists(safe_names, min_size=1, max_size=6).map("/".join)
BAD_SEGMENTS = ["..", ".", "", "a\x00b", "a\\b", ".hidden", "x."]


@given(path=safe_paths)
def test_safe_relative_paths_are_accepted(path: str) -> None:
    assert check_relative_path(path) == path


def _accepted_by_segment(path: str) -> bool:
    try:
        identity._checked_by_segment(path, "path")
    except InvalidPathError:
        return False
    return True


#: Paths near every rule's edge: segment lengths around MAX_NAME_LEN, depths around MAX_PATH_DEPTH,
#: trailing dots, odd characters, and the total length around MAX_PATH_LEN.
edge_segments = st.one_of(
    safe_names, st.sampled_from(BAD_SEGMENTS + ["a.", "a-", "_", "-", "a..b", "A9", "é", "a b", "a/"]),
    st.builds(lambda n, end: "a" * n + end, st.integers(MAX_NAME_LEN - 3, MAX_NAME_LEN + 1), st.sampled_from(["", ".", "_"])),
    st.text(st.characters(max_codepoint=0x7f), max_size=6))
edge_paths = st.one_of(
    st.lists(edge_segments, min_size=0, max_size=18).map("/".join), st.text(max_size=40),
    st.builds(lambda n: "/".join(["a" * 60] * n), st.integers(15, 18)),
    st.builds(lambda parts, last: "/".join([*parts, last]), st.lists(safe_names, max_size=17),
              st.sampled_from(["x", "x.", "x..", "x-", "-x", "_x", ".x", "x/"])))


@given(path=edge_paths)
@example(path="/".join(["a"] * MAX_PATH_DEPTH)).via("the deepest path")
@example(path="/".join(["a"] * (MAX_PATH_DEPTH + 1))).via("one segment too deep")
@example(path="a/b.").via("a last segment ending in '.'")
@example(path="a" * MAX_NAME_LEN).via("the longest name")
@example(path="a" * (MAX_NAME_LEN + 1)).via("a name too long")
@example(path="a" * (MAX_NAME_LEN - 1) + ".").via("the longest name, ending in '.'")
def test_the_one_pattern_accepts_exactly_what_the_segment_rules_accept(path: str) -> None:
    # The fast path may only take what the rules one by one take; and it takes all of it, so that a
    # restore's 20,000 paths never fall to the slow one.
    assert identity._safe_path_at_once(path) == _accepted_by_segment(path), path
    if _accepted_by_segment(path):
        assert check_relative_path(path) == path
    else:
        with pytest.raises(InvalidPathError):
            check_relative_path(path)


@given(parts=st.lists(safe_names, min_size=0, max_size=4), bad=st.sampled_from(BAD_SEGMENTS),
       at=st.integers(0, 4))
def test_a_bad_segment_anywhere_is_refused(parts: list[str], bad: str, at: int) -> None:
    parts.insert(min(at, len(parts)), bad)
    path = "/".join(parts)
    with pytest.raises(InvalidPathError):
        check_relative_path(path, where="file")


@pytest.mark.parametrize("path", [
    "../x", "a/../../b", "a/..", "/abs", "/etc/passwd", "../../etc/passwd", "a//b", "a/", "/",
    "a\x00b", "a\\b", "..\\x", "C:\\x", "", "a/./b", ".", "..",
])
def test_escaping_paths_are_refused_naming_where(path: str) -> None:
    with pytest.raises(InvalidPathError) as err:
        check_relative_path(path, where="files[3].path")
    assert "files[3].path" in str(err.value)
    assert isinstance(err.value, SnapshotError)


def test_too_deep_or_too_long_paths_are_refused() -> None:
    with pytest.raises(InvalidPathError, match="deeper"):
        check_relative_path("/".join(["a"] * 17))
    with pytest.raises(InvalidPathError, match="longer"):
        check_relative_path("a" * 1025)


@pytest.mark.parametrize("name", ["", "..", ".", "a/b", "a\x00", "-x", "x.", "a" * (MAX_NAME_LEN + 1)])
def test_unsafe_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidPathError):
        check_name(name)


@pytest.mark.parametrize("value", [None, 3, b"abc"])
def test_non_strings_are_refused_with_a_typed_error(value: object) -> None:
    for check in (check_rollout_id, check_relative_path, check_name):
        with pytest.raises(InvalidRecordError):
            check(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("key", "attempt"), [(None, 1), (3, 1), ("p7-a1", None), ("p7-a1", "1")])
def test_check_capture_key_refuses_wrong_types_with_a_typed_error(key: object, attempt: object) -> None:
    with pytest.raises(InvalidRecordError):
        check_capture_key("p7", key, attempt)  # type: ignore[arg-type]
