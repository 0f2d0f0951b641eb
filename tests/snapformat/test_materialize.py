"""Gym's parts of a published snapshot handed back to Gym: ``snapformat materialize`` (a local
``checkpoint_dir`` from any store) and ``check_part`` (a part on local disk, checked where it lies,
which a restore does before it hands Gym the snapshot's own ``gym/`` folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.checkpoint import gym_parts
from devtools.gym_procs import REPO_ROOT
from schemas.errors import CorruptSnapshotError
from snapformat import SnapshotStore
from snapformat.adopt import check_part, gym_prefixes


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapformat", *args], check=False, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_materialize_writes_every_gym_part_byte_equal(example_store: Path, tmp_path: Path) -> None:
    snap = SnapshotStore(str(example_store)).latest()
    assert snap is not None
    prefixes = gym_prefixes(snap)
    assert {p.split("/")[1] for p in prefixes} == {"agent", "model-ledger", "resources"}
    out = _cli("materialize", str(example_store), str(tmp_path / "ck"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(doc["parts"]) == sorted(prefixes)
    for prefix, names in doc["parts"].items():
        for name in names:
            got = (tmp_path / "ck" / prefix.removeprefix("gym/") / name).read_bytes()
            entry = next(f for f in snap.files() if f.path == f"{prefix}/{name}")
            assert got == snap.read_bytes(entry), f"{prefix}/{name}"
    # Only the part asked for, and a second run keeps what is already right.
    one = prefixes[0]
    again = _cli("materialize", str(example_store), str(tmp_path / "ck"), "--prefix", one, "--json")
    assert again.returncode == 0 and list(json.loads(again.stdout)["parts"]) == [one], again.stderr


def test_materialize_refuses_a_corrupt_file_naming_it(example_store: Path, tmp_path: Path) -> None:
    snap = SnapshotStore(str(example_store)).latest()
    assert snap is not None
    entry = next(f for f in snap.files() if f.path.endswith("continuations.jsonl"))
    path = example_store / "snapshots" / snap.manifest.snapshot_id / entry.path
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))
    out = _cli("materialize", str(example_store), str(tmp_path / "ck"))
    assert out.returncode != 0
    assert "continuations.jsonl" in out.stderr


def test_a_restore_checks_a_local_part_where_it_lies(example_store: Path) -> None:
    """A session file changed inside a published snapshot (valid JSON, another revision): the part
    manifest names the file, and the restore hands Gym nothing."""
    store = SnapshotStore(str(example_store))
    snap = store.latest()
    assert snap is not None
    prefixes = gym_prefixes(snap)
    assert [check_part(snap, p) for p in prefixes]  # pristine: every part checks
    assert gym_parts.restore_dir(snap, prefixes).staging is False
    resources = next(p for p in prefixes if p.startswith("gym/resources/"))
    folder = Path(check_part(snap, resources))
    session = next(p for p in sorted(folder.iterdir()) if p.name.endswith(".json") and p.name != "manifest.json")
    doc = json.loads(session.read_text())
    doc["state_revision"] += 1
    session.write_text(json.dumps(doc, indent=2))
    with pytest.raises(CorruptSnapshotError, match=session.name):
        check_part(snap, resources)
    with pytest.raises(CorruptSnapshotError, match=session.name):
        gym_parts.restore_dir(snap, prefixes)
