"""Fixtures for the format tests: published example snapshots, and a consistent manifest rewrite.

``example_store`` holds what the current writer writes (format 1.2: Gym's own files adopted as
``gym_file`` parts, ``tq/token_capture.arrow``); ``legacy_example_store`` what the format 1.0 and
1.1 writer wrote (Gym parts of this project's own kinds under ``gym/<component>/<name>/``), for
the tests of the readers of those kinds, which every reader keeps reading.

``rewrite_manifest`` edits ``manifest.json`` and then updates the commit record's size and
checksum, so a hand-crafted manifest is refused only by the check a test aims at, never by the
manifest checksum; ``rewrite_entry`` changes one file's entry the same way, in the part manifest of
a listed part (SPEC §10.4) when it lies in one.
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


def _rewrite_entry(root: Path, sequence: int, rel: str, **fields: Any) -> None:
    """Change the entry of ``rel`` where it is listed: in the manifest, or in the part manifest of a
    listed part (SPEC §10.4), which the manifest then binds again (its size, checksum and totals)."""
    commit = json.loads((root / layout.commit_key(sequence)).read_bytes())
    folder = root / layout.snapshot_dir(commit["snapshot_id"])
    listed = [p["prefix"] for p in json.loads((folder / layout.MANIFEST_NAME).read_bytes()).get("listed_parts", [])
              if rel.startswith(p["prefix"] + "/")]
    if not listed:
        def change(manifest: dict[str, Any]) -> None:
            (entry,) = [f for f in manifest["files"] if f["path"] == rel]
            entry.update(fields)

        _rewrite_manifest(root, sequence, change)
        return
    (prefix,) = listed
    part = json.loads((folder / prefix / layout.PART_MANIFEST_NAME).read_bytes())
    (entry,) = [f for f in part["files"] if f["path"] == rel]
    entry.update(fields)
    _put_part_manifest(root, sequence, prefix, json.dumps(part).encode(),
                       totals={"files": len(part["files"]), "bytes": sum(f["size"] for f in part["files"])})


def _put_part_manifest(root: Path, sequence: int, prefix: str, data: bytes,
                       totals: dict[str, int] | None = None) -> None:
    """``data`` as the part manifest of the listed part ``prefix``, bound by the manifest (its entry's
    size and checksum, and with ``totals`` the part's ``files`` and ``bytes``)."""
    commit = json.loads((root / layout.commit_key(sequence)).read_bytes())
    part_rel = f"{prefix}/{layout.PART_MANIFEST_NAME}"
    (root / layout.snapshot_dir(commit["snapshot_id"]) / part_rel).write_bytes(data)

    def bind(manifest: dict[str, Any]) -> None:
        (own,) = [f for f in manifest["files"] if f["path"] == part_rel]
        own.update(size=len(data), checksum=checksum_bytes(data))
        if totals is not None:
            (listed,) = [p for p in manifest["listed_parts"] if p["prefix"] == prefix]
            listed.update(totals)

    _rewrite_manifest(root, sequence, bind)


@pytest.fixture
def rewrite_entry() -> Callable[..., None]:
    """``rewrite_entry(store_root, sequence, rel, **fields)``: change one file's entry wherever it is
    listed, keeping every checksum that binds it consistent."""
    return _rewrite_entry


@pytest.fixture
def put_part_manifest() -> Callable[..., None]:
    """``put_part_manifest(store_root, sequence, prefix, data)``: new bytes for a listed part's part
    manifest, which the manifest binds (so only the part manifest's own checks can refuse them)."""
    return _put_part_manifest


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
