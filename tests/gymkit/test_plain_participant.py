"""A participant that knows nothing of snapformat (issue 20, "Tests"): the plain-files agent of
``plain_participant.py``, written from the reference alone, and the reference model server, both
real processes, driven by the NemoGym actor through a save into a snapshot draft
(``gym_parts.save_dir`` -> commit -> ``gym_parts.adopt_commit`` -> publish) and a restore into
fresh processes (``gym_parts.restore_dir``). Its files come back byte-equal; their digests verify
(``snapformat verify``, and recomputed here from the bytes). On local disk the participants write
inside the draft; on SeaweedFS into a staging folder that is uploaded, and downloaded again for
the restore.
"""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import pytest

from coordinator.checkpoint import gym_parts
from snapformat import SnapshotStore
from snapformat.cli import main as snapformat_main
from snapformat.verify import verify_snapshot
from tests.gymkit import plain_flow as flow

PLAIN = Path(__file__).with_name("plain_participant.py")


def test_the_plain_participant_imports_nothing_of_ours() -> None:
    """FastAPI, uvicorn and the standard library only: no gymkit, snapformat, schemas, refgym."""
    allowed = {"fastapi", "uvicorn", "__future__"} | set(sys.stdlib_module_names)
    names = set()
    for node in ast.walk(ast.parse(PLAIN.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= allowed, names - allowed


def run(coro, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.mark.parametrize("where", ["local", "local-staged", "seaweedfs"])
def test_save_and_restore_through_the_nemo_gym_actor(where: str, request, tmp_path: Path, capsys) -> None:
    """``local-staged``: a local store with Gym's files staged elsewhere (``gym_staging="always"``),
    so adoption copies them into the draft."""
    if where == "seaweedfs":
        seaweed = request.getfixturevalue("seaweed")
        request.getfixturevalue("aws_env")(seaweed)
        url = f"s3://{request.getfixturevalue('new_bucket')(seaweed)}/plain"
    else:
        url = str(tmp_path / "store")
    store = SnapshotStore(url)
    staging = tmp_path / "staging"

    # -- save ---------------------------------------------------------------------------------------------------
    gym = flow.start_gym(tmp_path / "gym-1", "127.0.0.1", "save")
    try:
        draft = store.begin()
        cdir = gym_parts.save_dir(draft, staging_root=str(staging), always_stage=where == "local-staged")
        assert cdir.staging == (where != "local")
        saved = run(flow.save(gym, Path(cdir.path), "ckpt-1"))
    finally:
        gym.kill()  # the processes that wrote the files are gone before anything is published
    parts = gym_parts.adopt_commit(draft, cdir, saved.commit)
    published = draft.publish(receipts=parts.receipts, gym_commit=parts.gym_commit,
                              topology_fingerprint=f"sha256:{saved.fingerprint}")
    cdir.cleanup()
    assert {r.prefix for r in parts.receipts} == {f"gym/{flow.AGENT_DIR}", f"gym/{flow.LEDGER_DIR}"}

    snap = store.latest()
    assert snap is not None and snap.manifest.snapshot_id == published.manifest.snapshot_id
    assert verify_snapshot(snap).ok
    assert snapformat_main(["verify", snap.url]) == 0, capsys.readouterr()
    capsys.readouterr()
    gym_files = {f.path.removeprefix("gym/"): f for f in snap.files("gym_file")}
    assert set(gym_files) == set(saved.files)  # every file the participants wrote, listed, nothing else
    for rel, data in saved.files.items():
        assert gym_files[rel].size == len(data)
    committed = snap.manifest.gym_commit
    assert committed is not None and committed.checkpoint_id == "ckpt-1"
    payloads = {p.name: p.payload for p in committed.participants}
    assert payloads[flow.AGENT]["manifest_digest"] == flow.sha(saved.files[f"{flow.AGENT_DIR}/manifest.json"])
    assert payloads[flow.MODEL]["manifest_digest"] == flow.sha(saved.files[f"{flow.LEDGER_DIR}/manifest.json"])

    # -- restore into fresh processes -----------------------------------------------------------------------------
    rdir = gym_parts.restore_dir(snap, [p.part_prefix for p in committed.participants if p.part_prefix],
                                 staging_root=str(staging))
    try:
        assert rdir.staging == (where == "seaweedfs")
        assert flow.tree(Path(rdir.path)) == saved.files  # byte-equal
        flow.check_agent_files(Path(rdir.path), payloads[flow.AGENT])  # and every digest holds again
        gym = flow.start_gym(tmp_path / "gym-2", "127.0.0.1", "restore")
        try:
            run(flow.restore(gym, Path(rdir.path), "ckpt-2", saved))
        finally:
            gym.kill()
        assert flow.tree(Path(rdir.path)) == saved.files  # a restore reads, never writes
    finally:
        rdir.cleanup()
    assert not staging.exists() or not any(staging.iterdir())
