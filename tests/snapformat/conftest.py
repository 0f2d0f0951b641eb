"""Fixtures for the format tests: published example snapshots, and a consistent manifest rewrite.

``example_store`` holds what the current writer writes (format 1.2: Gym's own files adopted as
``gym_file`` parts, ``tq/token_capture.arrow``); ``legacy_example_store`` what the format 1.0 and
1.1 writer wrote (Gym parts of this project's own kinds under ``gym/<component>/<name>/``), for
the tests of the readers of those kinds, which every reader keeps reading.

``rewrite_manifest`` edits ``manifest.json`` and then updates the commit record's size and
checksum, so a hand-crafted manifest is refused only by the check a test aims at, never by the
manifest checksum.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from snapformat import SnapshotStore, example, layout
from snapformat.checksum import checksum_bytes

EXAMPLE_SEED = 11
RewriteManifest = Callable[[Path, int, Callable[[dict[str, Any]], None]], None]


def _rewrite_manifest(root: Path, sequence: int, change: Callable[[dict[str, Any]], None]) -> None:
    commit_path = root / layout.commit_key(sequence)
    commit = json.loads(commit_path.read_bytes())
    manifest_path = root / layout.snapshot_dir(commit["snapshot_id"]) / layout.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_bytes())
    change(manifest)
    data = json.dumps(manifest, indent=1).encode() + b"\n"
    manifest_path.write_bytes(data)
    commit.update(manifest_size=len(data), manifest_checksum=checksum_bytes(data))
    commit_path.write_bytes(json.dumps(commit, indent=1).encode() + b"\n")


@pytest.fixture
def rewrite_manifest() -> RewriteManifest:
    """``rewrite_manifest(store_root, sequence, change)``: edit the manifest as a dict, keep the commit consistent."""
    return _rewrite_manifest


def _publish_one(root: Path, write: Callable[..., Any], **publish: Any) -> Path:
    """A store at ``root`` holding one snapshot that ``write(draft, count=60, seed=EXAMPLE_SEED)`` wrote."""
    draft = SnapshotStore(str(root)).begin()
    gym, receipts = write(draft, count=60, seed=EXAMPLE_SEED)
    draft.publish(receipts=receipts, gym_commit=gym, **publish)
    return root


def _private_copy(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


@pytest.fixture(scope="module")
def pristine_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding one published example snapshot (every part the current writer writes, 60
    rollouts). Copy before changing it."""
    return _publish_one(tmp_path_factory.mktemp("pristine") / "store", example.write_example,
                        topology_fingerprint=example.TOPOLOGY)


@pytest.fixture
def example_store(pristine_example: Path, tmp_path: Path) -> Path:
    """A private copy of the example store, free to corrupt."""
    return _private_copy(pristine_example, tmp_path)


@pytest.fixture(scope="module")
def pristine_legacy_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding one published snapshot of the 1.0/1.1 layout (``write_legacy_example``, 60
    rollouts: continuations, agent state, model ledger, token rows and index, sessions). Copy before
    changing it."""
    return _publish_one(tmp_path_factory.mktemp("pristine-legacy") / "store", example.write_legacy_example)


@pytest.fixture
def legacy_example_store(pristine_legacy_example: Path, tmp_path: Path) -> Path:
    """A private copy of the legacy example store, free to corrupt."""
    return _private_copy(pristine_legacy_example, tmp_path)
