"""A Gym server on another host (issue 20, item 3), end to end across loopback "hosts":

* host A, 127.0.0.1: the coordinator's side (the NemoGym actor, the publisher) and the store,
  SeaweedFS;
* host B, 127.0.0.2: the Gym deployment that is saved (the reference model server and the
  plain-files agent of ``tests/gymkit/plain_participant.py``, each its own process bound to
  127.0.0.2). Its servers write Gym's plain files only where they can: a folder on B's disk. Then,
  "on B", ``python -m snapformat adopt DIR DRAFT_URL PREFIX --json`` (a subprocess with B's folder
  as its working directory) checks each participant folder against Gym's manifest, uploads it
  into A's draft and prints its receipt; A publishes with those receipts and Gym's commit.
* host C, 127.0.0.3: fresh servers restore. B's folder is gone by then; C materializes the
  snapshot's Gym parts from the store into a folder of its own, the NemoGym actor restores from
  it, resumes, and the saved rollouts continue as attempt 1.

The files come back byte-equal on C (and through the coordinator's own ``gym_parts.restore_dir``
on A), and every digest is recomputed from the bytes. Helper test ``test_adopt.py`` covers the
adopt CLI on its own; this one is the whole save and restore with real servers off host A.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgspec
import pytest

from coordinator.checkpoint import gym_parts
from devtools.gym_procs import bindable
from schemas.gym_files import participant_dir
from schemas.manifest import GymCommit, ParticipantCommit, PartReceipt
from snapformat import SnapshotStore
from snapformat.verify import verify_snapshot
from tests.gymkit import plain_flow as flow

HOST_B, HOST_C = "127.0.0.2", "127.0.0.3"


pytestmark = pytest.mark.skipif(not (bindable(HOST_B) and bindable(HOST_C)),
                                reason="127.0.0.2/127.0.0.3 are not loopback addresses on this machine")


def only_on(host: str, gym: flow.Gym) -> None:
    """Each server answers on its host's address, and not on host A's."""
    for url in gym.servers.values():
        assert url.startswith(f"http://{host}:")
        port = int(url.rsplit(":", 1)[1])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                assert json.loads(resp.read()).get("name") not in (flow.MODEL, flow.AGENT)  # someone else's port
        except OSError:
            pass  # refused: nothing of B's listens on 127.0.0.1


def on_host(host_dir: Path, argv: list[str], env: dict[str, str]) -> str:
    """Run a command "on" a host: its own working directory, the store's credentials, nothing of A's."""
    done = subprocess.run([sys.executable, *argv], cwd=host_dir, env=flow.env(env), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_gym_host_adopts_its_own_files_and_another_host_restores_them(seaweed, aws_env, new_bucket,
                                                                         tmp_path: Path) -> None:
    aws_env(seaweed)
    store = SnapshotStore(f"s3://{new_bucket(seaweed)}/cross-host")
    host_a, host_b, host_c = tmp_path / "host-a", tmp_path / "host-b", tmp_path / "host-c"

    # -- host B saves into its own folder -------------------------------------------------------------------------
    draft = store.begin()
    b_dir = host_b / "checkpoints" / draft.snapshot_id / "gym"  # where B's Gym writes (B's local disk)
    gym_b = flow.start_gym(host_b / "servers", HOST_B, "b")
    try:
        only_on(HOST_B, gym_b)
        saved = asyncio.run(asyncio.wait_for(flow.save(gym_b, b_dir, "ckpt-b1"), 90))
    finally:
        gym_b.kill()

    # "on B": each participant folder becomes its part of A's draft; only the receipt comes back
    receipts: dict[tuple[str, str], PartReceipt] = {}
    for p in saved.commit.participants:
        folder = participant_dir(p.component, p.name)
        out = on_host(host_b, ["-m", "snapformat", "adopt", str(b_dir / folder), draft.url, f"gym/{folder}",
                               "--writer", f"{p.component}:{p.name}", "--json"], seaweed.env_vars())
        receipts[(p.component, p.name)] = msgspec.json.decode(out, type=PartReceipt)
    assert {r.prefix for r in receipts.values()} == {f"gym/{flow.AGENT_DIR}", f"gym/{flow.LEDGER_DIR}"}

    # -- host A publishes with B's receipts and Gym's commit -----------------------------------------------------
    gym_commit = GymCommit(checkpoint_id=saved.checkpoint_id, participants=[
        ParticipantCommit(component=p.component, name=p.name, part_prefix=receipts[(p.component, p.name)].prefix,
                          part_manifest_checksum=receipts[(p.component, p.name)].part_manifest_checksum,
                          payload=msgspec.to_builtins(p.reply))
        for p in saved.commit.participants])
    published = draft.publish(receipts=list(receipts.values()), gym_commit=gym_commit,
                              topology_fingerprint=f"sha256:{saved.fingerprint}")
    snap = store.latest()
    assert snap is not None and snap.manifest.snapshot_id == published.manifest.snapshot_id
    assert verify_snapshot(snap).ok
    assert {f.writer for f in snap.files("gym_file")} == {
        f"{p.component}:{p.name}" for p in saved.commit.participants}
    prefixes = [p.part_prefix for p in snap.manifest.gym_commit.participants if p.part_prefix]
    a_dir = gym_parts.restore_dir(snap, prefixes, staging_root=str(host_a / "staging"))  # A's own look, from S3
    try:
        assert a_dir.staging and flow.tree(Path(a_dir.path)) == saved.files
    finally:
        a_dir.cleanup()
    shutil.rmtree(host_b)  # host B is gone

    # -- host C restores from the store -----------------------------------------------------------------------------
    c_dir = host_c / "restore" / "gym"
    host_c.mkdir()
    materialize = ("import json, sys; from snapformat.adopt import materialize_gym; "
                   "print(json.dumps(materialize_gym(sys.argv[1], sys.argv[2])))")
    out = on_host(host_c, ["-c", materialize, snap.url, str(c_dir)], seaweed.env_vars())
    assert sorted(json.loads(out)) == sorted(prefixes)
    assert flow.tree(c_dir) == saved.files  # byte-equal on the other host
    payloads = {p.name: p.payload for p in snap.manifest.gym_commit.participants}
    flow.check_agent_files(c_dir, payloads[flow.AGENT])
    flow.check_ledger_files(c_dir, payloads[flow.MODEL],
                            [json.loads(line) for line in (c_dir / flow.AGENT_DIR / "continuations.jsonl")
                             .read_bytes().splitlines()])
    gym_c = flow.start_gym(host_c / "servers", HOST_C, "c")
    try:
        only_on(HOST_C, gym_c)
        asyncio.run(asyncio.wait_for(flow.restore(gym_c, c_dir, "ckpt-c1", saved), 90))
    finally:
        gym_c.kill()
    assert flow.tree(c_dir) == saved.files
