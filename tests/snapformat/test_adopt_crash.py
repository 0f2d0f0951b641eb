"""SIGKILL while a staged Gym folder is copied into a local draft (``adopt_part``'s step 3, in
batches of ``create_exclusive_many``) never leaves a broken store, and adopting again finishes it.

A child process adopts a staging folder of a few thousand small Gym files into a draft and is
SIGKILLed after a random delay, in the middle of copying. After every kill:

- nothing is listed (a draft is never a snapshot);
- every file the child had already created holds its staged bytes, whole;
- adopting the same folder again (this process) keeps those files, creates the rest, and the draft
  publishes a snapshot that verifies, its Gym files byte-equal to the staged ones and nothing
  else (the temporary files the kill left are removed: GC does not look inside a published
  snapshot's folder).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapformat import SnapshotStore, layout, verify_snapshot
from snapformat.adopt import adopt_gym_dir
from tests.snapformat.test_adopt import snapshot_files, write_gym_files

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS = 1000  # about 2,000 staged files: the copy takes long enough to be killed in its middle
KILLS = 5
TIMEOUT_S = 120
CHILD = ("import sys; from snapformat.adopt import adopt_gym_dir; print('ready', flush=True); "
         "adopt_gym_dir(sys.argv[1], sys.argv[2], writer='host-b'); print('done', flush=True)")


@pytest.fixture(scope="module")
def staging(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adopt-crash") / "staging"
    write_gym_files(folder, n=ROLLOUTS)
    return folder


def _adopt_in_child(draft_url: str, staging: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", CHILD, draft_url, str(staging)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _copy_seconds(tmp_path: Path, staging: Path) -> float:
    """How long an uninterrupted adoption takes in a child, from its ``ready``."""
    draft = SnapshotStore(str(tmp_path / "dry")).begin()
    proc = _adopt_in_child(draft.url, staging)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0 and out == "done\n", err
    return time.monotonic() - t0


def test_a_copy_killed_at_any_point_is_finished_by_adopting_again(tmp_path: Path, staging: Path) -> None:
    rng = random.Random(0xAD0B7)
    staged = snapshot_files(staging)
    copy_s = _copy_seconds(tmp_path, staging)
    partial = 0  # kills that left some of the files copied, not all
    temps = 0  # temporary files the kills left
    for run in range(KILLS):
        path = tmp_path / f"store-{run}"
        store = SnapshotStore(str(path))
        draft = store.begin()
        proc = _adopt_in_child(draft.url, staging)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.stderr
            time.sleep(rng.uniform(0.1, 0.9) * copy_s)  # spread over the copy (the checks come first)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert store.list() == [], f"run {run}: a draft was listed"
        gym = Path(draft.url) / layout.GYM_PREFIX
        copied = {k: v for k, v in snapshot_files(gym).items() if ".tmp-" not in k} if gym.exists() else {}
        for name, data in copied.items():  # whatever was created is whole
            if not name.endswith(layout.PART_MANIFEST_NAME):
                assert data == staged[name], f"run {run}: {name} differs from the staged file"
        partial += 0 < len(copied) < len(staged)

        temps += len(list(gym.rglob(".tmp-*"))) if gym.exists() else 0
        published = draft.publish(receipts=adopt_gym_dir(draft.url, str(staging), writer="host-b"))
        assert verify_snapshot(store.open(published.commit.sequence)).ok
        # The temporary files the kill left (written, not yet linked or not yet removed) are gone
        # too: adopting again removed them before it copied.
        theirs = {k: v for k, v in snapshot_files(Path(published.url) / layout.GYM_PREFIX).items()
                  if not k.endswith(layout.PART_MANIFEST_NAME)}
        assert theirs == staged, f"run {run}: the published Gym files differ from the staged ones"
    # Guards against the test degenerating (a much faster copy): most kills land mid-copy.
    assert partial >= KILLS // 2, f"only {partial} of {KILLS} kills landed while files were being copied"
    assert temps, "no kill left a temporary file: the sweep before copying was not exercised"
