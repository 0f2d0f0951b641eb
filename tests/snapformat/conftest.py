"""Fixtures for the format tests: a published example snapshot, and a consistent manifest rewrite.

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


@pytest.fixture(scope="module")
def pristine_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding one published example snapshot (all part kinds, 60 rollouts). Copy before changing it."""
    root = tmp_path_factory.mktemp("pristine") / "store"
    store = SnapshotStore(str(root))
    draft = store.begin()
    gym, receipts = example.write_example(draft, count=60, seed=EXAMPLE_SEED)
    draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY)
    return root


@pytest.fixture
def example_store(pristine_example: Path, tmp_path: Path) -> Path:
    """A private copy of the example store, free to corrupt."""
    root = tmp_path / "store"
    shutil.copytree(pristine_example, root)
    return root
