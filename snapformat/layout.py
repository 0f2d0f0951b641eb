"""Where everything lives inside a store (spec section "Store layout").

    <store>/snapformat-store.json          store marker (format name and version)
    <store>/_latest.json                   advisory hint: newest committed sequence
    <store>/_commits/<20 digits>.json      one commit record per published snapshot
    <store>/snapshots/<snapshot_id>/       a snapshot's files; invisible until committed
    <store>/snapshots/<snapshot_id>/manifest.json
    <store>/objects/<2 hex>/<64 hex>        shared objects (format 1.3): named by the SHA-256 of their bytes

Commit names are ``2**64 - 1 - sequence``, zero-padded to 20 digits, so that a plain sorted
listing returns the newest commit first (Lance's newest-first trick).
"""

from __future__ import annotations

import re
import secrets

from schemas.errors import InvalidPathError
from schemas.identity import check_name, check_relative_path

MARKER_KEY = "snapformat-store.json"
HINT_KEY = "_latest.json"
COMMITS = "_commits"
SNAPSHOTS = "snapshots"
MANIFEST_NAME = "manifest.json"
PART_MANIFEST_NAME = "part-manifest.json"
HEARTBEAT_NAME = "draft-heartbeat"
OBJECTS = "objects"

_MAX_SEQ = 2**64 - 1
_COMMIT_RE = re.compile(r"^([0-9]{20})\.json$")
_OBJECT_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_OBJECT_KEY_RE = re.compile(r"^objects/([0-9a-f]{2})/([0-9a-f]{64})$")
SNAPSHOT_ID_RE = re.compile(r"^snap-([0-9]{10,20})-[0-9a-f]{8}$")


GYM_PREFIX = "gym"


def gym_part_prefix(component: str, name: str) -> str:
    """The part prefix of a Gym server, ``gym/<component>/<name>`` (SPEC §3, CONTROL.md): where it
    writes in a draft, what its commit and restore calls name, its entry in the manifest's Gym commit."""
    return f"{GYM_PREFIX}/{component}/{name}"


def commit_key(sequence: int) -> str:
    return f"{COMMITS}/{_MAX_SEQ - sequence:020d}.json"


def sequence_of_commit(name: str) -> int | None:
    """The sequence a commit file name stands for, or None for anything else in ``_commits/``."""
    m = _COMMIT_RE.match(name)
    if not m:
        return None
    seq = _MAX_SEQ - int(m.group(1))
    return seq if seq >= 1 else None


def new_snapshot_id(sequence: int) -> str:
    """``snap-<sequence>-<8 random hex>``: unique even when two writers aim at one sequence."""
    return f"snap-{sequence:010d}-{secrets.token_hex(4)}"


def check_snapshot_id(snapshot_id: str, where: str = "snapshot_id") -> str:
    check_name(snapshot_id, where=where)
    return snapshot_id


def snapshot_dir(snapshot_id: str) -> str:
    return f"{SNAPSHOTS}/{check_snapshot_id(snapshot_id)}"


def file_key(snapshot_id: str, rel_path: str) -> str:
    """Store key of a snapshot's file; ``rel_path`` is validated so it cannot leave the folder."""
    return f"{snapshot_dir(snapshot_id)}/{check_relative_path(rel_path)}"


def object_key(name: str) -> str:
    """Store key of the shared object ``sha256:<hex>`` (SPEC §14.2): ``objects/<hex[:2]>/<hex>``."""
    m = _OBJECT_RE.match(name)
    if not m:
        raise InvalidPathError(f"object name {name!r} is not 'sha256:<64 hex digits>'")
    return f"{OBJECTS}/{m.group(1)[:2]}/{m.group(1)}"


def object_of_key(key: str) -> str | None:
    """The object name ``sha256:<hex>`` a store key stands for, or None for any other key
    (a temporary file, a key in the wrong fan-out folder)."""
    m = _OBJECT_KEY_RE.match(key)
    if not m or m.group(2)[:2] != m.group(1):
        return None
    return f"sha256:{m.group(2)}"


def split_snapshot_url(url: str) -> tuple[str, str]:
    """``<store>/snapshots/<id>`` -> ``(<store>, <id>)``, as ``ls`` prints snapshot locations."""
    trimmed = url.rstrip("/")
    head, _, snapshot_id = trimmed.rpartition("/")
    store, _, middle = head.rpartition("/")
    if middle != SNAPSHOTS or not snapshot_id:
        raise InvalidPathError(
            f"{url}: not a snapshot location (expected <store>/{SNAPSHOTS}/<snapshot_id>)"
        )
    if not store and head.startswith("/"):
        store = "/"
    return store or ".", check_snapshot_id(snapshot_id, where=url)
