"""Identifier rules shared with NeMo Gym, and the safe-name rule for anything that becomes a path.

Gym's rules (``nemo_gym/episode_types.py``): a rollout id is non-empty, matches
``^[A-Za-z0-9][A-Za-z0-9._-]*$`` (a whole-string match) and does not end in the reserved suffix
``-a[1-9][0-9]*`` (so ``x-a0`` and ``x-a01`` are legal rollout ids); the capture key of attempt ``n``
is the rollout id when ``n == 0`` and ``<rollout_id>-a<n>`` otherwise. Because the suffix is
reserved, a capture key names exactly one (rollout id, attempt): :func:`split_capture_key`.
"""

from __future__ import annotations

import re

from schemas.errors import InvalidPathError, InvalidRecordError

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ATTEMPT_SUFFIX_RE = re.compile(r"-a[1-9][0-9]*$")  # Gym's EpisodeId reserves exactly this
MAX_NAME_LEN = 200
MAX_PATH_LEN = 1024
MAX_PATH_DEPTH = 16
#: A path :func:`check_relative_path` accepts, as one pattern (its length checked apart): at most
#: MAX_PATH_DEPTH segments joined by "/", each a safe name (``_ID_RE``, at most MAX_NAME_LEN
#: characters, not ending in ".").
_SAFE_SEGMENT = rf"[A-Za-z0-9](?:[A-Za-z0-9._-]{{0,{MAX_NAME_LEN - 2}}}[A-Za-z0-9_-])?"
_SAFE_PATH_RE = re.compile(rf"{_SAFE_SEGMENT}(?:/{_SAFE_SEGMENT}){{0,{MAX_PATH_DEPTH - 1}}}")


def check_rollout_id(rollout_id: str, where: str = "rollout_id") -> str:
    """Return ``rollout_id`` if it follows Gym's rule, else raise :class:`InvalidRecordError`."""
    if not isinstance(rollout_id, str) or not _ID_RE.fullmatch(rollout_id):
        raise InvalidRecordError(
            f"{where}: {rollout_id!r} is not a rollout id (expected ^[A-Za-z0-9][A-Za-z0-9._-]*$)"
        )
    if len(rollout_id) > MAX_NAME_LEN:
        raise InvalidRecordError(f"{where}: rollout id longer than {MAX_NAME_LEN} characters")
    if _ATTEMPT_SUFFIX_RE.search(rollout_id):
        raise InvalidRecordError(
            f"{where}: rollout id {rollout_id!r} ends in '-a<N>' (N >= 1, no leading zero), "
            "which is reserved for capture keys"
        )
    return rollout_id


def capture_key(rollout_id: str, attempt: int) -> str:
    """The capture key of ``attempt`` of ``rollout_id`` (``p7_g2``, ``p7_g2-a1``, ...)."""
    check_rollout_id(rollout_id)
    if attempt < 0:
        raise InvalidRecordError(f"attempt_index: {attempt} is negative (expected >= 0)")
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def capture_keys_down(rollout_id: str, attempt: int) -> list[str]:
    """The capture keys of ``attempt`` of ``rollout_id`` and of every earlier attempt, latest first
    (``capture_key`` of each, the id checked once: a lineage walk asks for them call after call)."""
    check_rollout_id(rollout_id)
    if attempt < 0:
        raise InvalidRecordError(f"attempt_index: {attempt} is negative (expected >= 0)")
    return [f"{rollout_id}-a{a}" for a in range(attempt, 0, -1)] + [rollout_id]


def split_capture_key(key: str, where: str = "capture_key") -> tuple[str, int]:
    """The (rollout id, attempt) a capture key names: the inverse of :func:`capture_key`.

    Gym's ``TokenEntry.rollout_id`` holds the capture key; because rollout ids may not end in the
    reserved suffix, ``p7_g2-a3`` can only be attempt 3 of ``p7_g2`` and ``p7_g2`` only attempt 0.
    """
    if not isinstance(key, str):
        raise InvalidRecordError(f"{where}: {key!r} is not a string")
    match = _ATTEMPT_SUFFIX_RE.search(key)
    if match is None:
        return check_rollout_id(key, where=where), 0
    rollout_id = key[: match.start()]
    check_rollout_id(rollout_id, where=where)
    return rollout_id, int(match.group()[2:])


def check_capture_key(rollout_id: str, key: str, attempt_index: int, where: str = "capture_key") -> str:
    """Gym's check: ``key`` is ``rollout_id`` or ``<rollout_id>-a<N>`` with ``1 <= N <= attempt_index``."""
    check_rollout_id(rollout_id, where="rollout_id")
    # Structs run this in __post_init__ before any type check, so wrong types must fail typed here.
    if not isinstance(attempt_index, int) or isinstance(attempt_index, bool):
        raise InvalidRecordError(f"attempt_index: {attempt_index!r} is not an integer")
    if not isinstance(key, str):
        raise InvalidRecordError(f"{where}: {key!r} is not a string")
    if key == rollout_id:
        return key
    prefix = rollout_id + "-a"
    suffix = key[len(prefix):] if key.startswith(prefix) else ""
    if suffix.isdigit() and suffix.isascii() and not (len(suffix) > 1 and suffix[0] == "0"):
        n = int(suffix)
        if 1 <= n <= attempt_index:
            return key
    raise InvalidRecordError(
        f"{where}: {key!r} is not {rollout_id!r} or '{rollout_id}-a<N>' with 1 <= N <= {attempt_index}"
    )


def check_name(name: str, where: str = "name") -> str:
    """A single path segment that is safe on every backend (no ``/``, ``..``, NUL, or leading dot)."""
    if not isinstance(name, str) or not _ID_RE.fullmatch(name) or len(name) > MAX_NAME_LEN:
        raise InvalidPathError(
            f"{where}: {name!r} is not a safe name (expected ^[A-Za-z0-9][A-Za-z0-9._-]*$, "
            f"at most {MAX_NAME_LEN} characters)"
        )
    if name.endswith("."):
        raise InvalidPathError(f"{where}: {name!r} must not end in '.'")
    return name


def check_relative_path(path: str, where: str = "path") -> str:
    """A ``/``-separated path relative to a snapshot folder whose every segment is a safe name.

    Refuses absolute paths, ``..`` and ``.`` segments, backslashes, NUL and empty segments, so that
    nothing a manifest or a participant names can point outside the snapshot folder.
    """
    if _safe_path_at_once(path):
        return path  # one match, not one per segment: a restore checks 20,000 paths
    return _checked_by_segment(path, where)


def _safe_path_at_once(path: object) -> bool:
    """Whether ``path`` follows every rule of :func:`_checked_by_segment`, by one pattern."""
    return isinstance(path, str) and len(path) <= MAX_PATH_LEN and _SAFE_PATH_RE.fullmatch(path) is not None


def _checked_by_segment(path: str, where: str) -> str:
    """:func:`check_relative_path`'s rules one by one, each failure named."""
    if not isinstance(path, str) or not path:
        raise InvalidPathError(f"{where}: empty path")
    if len(path) > MAX_PATH_LEN:
        raise InvalidPathError(f"{where}: path longer than {MAX_PATH_LEN} characters")
    if "\x00" in path or "\\" in path or path.startswith("/"):
        raise InvalidPathError(f"{where}: {path!r} must be a relative '/'-separated path without NUL")
    segments = path.split("/")
    if len(segments) > MAX_PATH_DEPTH:
        raise InvalidPathError(f"{where}: {path!r} is deeper than {MAX_PATH_DEPTH} segments")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise InvalidPathError(f"{where}: {path!r} has an empty, '.' or '..' segment")
        check_name(seg, where=f"{where} segment {seg!r}")
    return path
