"""Fuzzing Gym's own files (kind ``gym_file``, SPEC §12.11): the folders a Gym server writes into
``checkpoint_dir`` and a publisher adopts, or a restore downloads, as they are.

Seeds are the Gym folders of the golden store ``spec/examples/store-v1.2`` (the current writer's:
an agent instance, a model ledger, a resources server). An example damages one file of one folder
(its bytes, or for JSON one line's or one document's value) and, unless it is ``manifest.json``,
may bind the damaged bytes in Gym's manifest again (``sha256`` and ``bytes``), so the checks and
decoders behind the digests are reached: archive members, index rows, lineage rows and record
counts. Proves, for every input: checking the folder against Gym's manifest (what adoption and a
restore run, ``snapformat.gym_dir.check_folder``) returns or raises a ``SnapshotError`` subclass,
never another exception, within the memory cap; and for a folder that passes, reading its
artifact references' rows and its records strictly does the same.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_mutations import mutated_bytes, mutated_json_document, mutated_json_lines
from fuzz_property import FUZZ, TIMEOUT, typed_or_result
from schemas.gym_files import MANIFEST_NAME, AgentBoundaryRecord, ExternalStorageReference, ResourceSnapshot
from schemas.gym_records import AgentContinuationRoot
from snapformat import SnapshotStore, layout
from snapformat.adopt import gym_prefixes
from snapformat.gym_dir import GymFolder, check_folder, component_of_prefix, decode_strict, read_ref_rows, read_tar_members

pytestmark = TIMEOUT

GOLDEN = Path(__file__).resolve().parents[2] / "spec" / "examples" / "store-v1.2"
COMPONENTS = ["agent", "ledger", "resources"]


@cache
def seed_folders(component: str) -> tuple[tuple[str, dict[str, bytes]], ...]:
    """Each golden snapshot's folder of ``component``: its place under ``checkpoint_dir`` and its files
    (the part manifest, the publisher's, left out)."""
    store = SnapshotStore(str(GOLDEN))
    out = []
    for commit in store.list():
        snap = store.open(commit.sequence)
        for prefix in gym_prefixes(snap):
            if component_of_prefix(prefix) != component:
                continue
            folder = GOLDEN / layout.snapshot_dir(snap.manifest.snapshot_id) / prefix
            files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != layout.PART_MANIFEST_NAME}
            out.append((prefix.split("/", 1)[1], files))
    assert out, f"no {component} folder in {GOLDEN}"
    return tuple(out)


def rebind(node: Any, name: str, data: bytes) -> None:
    """Make every promise of Gym's manifest about the file ``name`` fit ``data`` (its ``sha256`` and
    ``bytes``; a count such as ``records`` or ``members`` is left as it was)."""
    sha = hashlib.sha256(data).hexdigest()
    if isinstance(node, dict):
        if node.get("name") == name or str(node.get("relative_path", "")).rsplit("/", 1)[-1] == name:
            node.update(sha256=sha, bytes=len(data))
        files = node.get("files")
        if isinstance(files, dict) and name in files:
            files[name] = sha
            if "bytes" in node:  # a ledger rollout: its one lineage file's size
                node["bytes"] = len(data)
        for value in node.values():
            rebind(value, name, data)
    elif isinstance(node, list):
        for value in node:
            rebind(value, name, data)


def damaged(data: st.DataObject, name: str, original: bytes) -> bytes:
    if name.endswith(".jsonl"):
        return data.draw(st.one_of(mutated_bytes([original]), mutated_json_lines([original])))
    if name.endswith(".json"):
        return data.draw(st.one_of(mutated_bytes([original]), mutated_json_document([original])))
    return data.draw(mutated_bytes([original]))  # an archive


def read_back(checkpoint_dir: Path, folder: Path, checked: GymFolder) -> None:
    """What a restoring participant reads of a folder that passed: every row and record, strictly."""
    manifest = checked.manifest
    if checked.component == "agent":
        read_ref_rows(checkpoint_dir, manifest.continuation_index, AgentContinuationRoot)
        for archive in manifest.archives:
            for member, raw in read_tar_members(folder / archive.name).items():
                decode_strict(raw, AgentBoundaryRecord, f"{folder / archive.name}: member {member}")
    elif checked.component == "ledger":
        read_ref_rows(checkpoint_dir, manifest.storage_reference_index, ExternalStorageReference)
        for rollout in manifest.rollouts.values():
            for name in rollout.files:
                for n, line in enumerate((folder / name).read_bytes().splitlines(), 1):
                    if line.strip():
                        decode_strict(line, dict, f"{folder / name}: line {n}")
    else:
        for name in manifest.files:
            decode_strict((folder / name).read_bytes(), ResourceSnapshot, str(folder / name))


@pytest.mark.parametrize("component", COMPONENTS)
@FUZZ
@given(data=st.data())
def test_gym_folder(component: str, data: st.DataObject) -> None:
    base, files = data.draw(st.sampled_from(seed_folders(component)))
    name = data.draw(st.sampled_from(sorted(files)))
    changed = dict(files)
    changed[name] = damaged(data, name, files[name])
    if name != MANIFEST_NAME and data.draw(st.booleans()):  # bound again: reach what the digests guard
        manifest = json.loads(files[MANIFEST_NAME])
        rebind(manifest, name, changed[name])
        changed[MANIFEST_NAME] = json.dumps(manifest, sort_keys=True, indent=2).encode()
    with tempfile.TemporaryDirectory(prefix="fuzz-gym-") as tmp:
        checkpoint_dir = Path(tmp)
        folder = checkpoint_dir / base
        folder.mkdir(parents=True)
        for file_name, content in changed.items():
            (folder / file_name).write_bytes(content)
        checked = typed_or_result(lambda: check_folder(folder, component=component, base=base))
        if isinstance(checked, GymFolder):
            typed_or_result(lambda: read_back(checkpoint_dir, folder, checked))
