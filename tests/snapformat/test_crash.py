"""SIGKILL at any point of writing, publishing or retention never leaves a broken store.

A writer subprocess (``crash_writer.py``) is killed with SIGKILL, either after a random delay
while it writes and publishes snapshots in a loop, or deterministically by itself at a chosen
store step (each step of publish and of retention gets its own kill). After every kill:

- every snapshot the store lists opens and verifies (no partial snapshot is ever listed), and
  ``latest()`` is the newest listed one;
- the snapshot that was newest before the kill is still there and verifies, unless a newer one
  does; the last snapshot the writer saw published is still listed;
- a fresh writer publishes the next sequence;
- ``gc(min_age_s=0)`` removes every uncommitted folder and temporary file, and the published
  snapshots still verify.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schemas.errors import NotPublishedError
from snapformat import SnapshotStore, example, layout, open_snapshot, verify_snapshot

WRITER = Path(__file__).with_name("crash_writer.py")
ROOT = Path(__file__).resolve().parents[2]
RANDOM_RUNS = 50
# A loop iteration takes ~20-300 ms (publish ~3-50 ms of it: most of the writing is Gym's folders,
# many small files each fsynced), so kills spread over the first few iterations: while writing Gym's
# files and rows, between parts, during publish and during retention.
MAX_KILL_DELAY_S = 0.35
SUBPROCESS_TIMEOUT_S = 60


def _run_writer(*args: str) -> subprocess.CompletedProcess[str]:
    # This tree's code, not whatever checkout the interpreter has installed (an editable install of
    # another worktree would otherwise be imported: the script's folder, not the repository, is sys.path[0]).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(WRITER), *args], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, check=False, env=env)


def _publish_example(path: Path, count: int = 2, seed: int = 0) -> int:
    """Publish one example snapshot in this process (a fresh writer after a crash)."""
    store = SnapshotStore(str(path))
    draft = store.begin()
    gym, receipts = example.write_example(draft, count, seed)
    published = draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY, keep_latest=2)
    assert verify_snapshot(store.open(draft.sequence)).ok
    return published.commit.sequence


def _check_listed(path: Path) -> list[int]:
    """Every listed snapshot opens and verifies; ``latest()`` is the newest. Returns the sequences."""
    store = SnapshotStore(str(path))
    commits = store.list()
    seqs = [c.sequence for c in commits]
    assert seqs, "nothing is listed after a crash"
    assert seqs == sorted(set(seqs), reverse=True)
    for commit in commits:
        snap = store.open(commit.sequence)
        assert snap.manifest.snapshot_id == commit.snapshot_id
        report = verify_snapshot(snap)
        assert report.ok, f"listed snapshot {commit.snapshot_id} does not verify: {report.problems}"
    latest = store.latest()
    assert latest is not None and latest.sequence == seqs[0]
    assert latest.manifest.snapshot_id == commits[0].snapshot_id
    return seqs


def _leftovers(path: Path) -> tuple[set[str], list[str]]:
    """Snapshot folders no commit names, and temporary files, anywhere in the store."""
    committed = {c.snapshot_id for c in SnapshotStore(str(path)).list()}
    folders = {p.name for p in (path / layout.SNAPSHOTS).iterdir()} if (path / layout.SNAPSHOTS).exists() else set()
    temps = [str(p.relative_to(path)) for p in path.rglob(".tmp-*")]
    return folders - committed, temps


def _check_gc_cleans(path: Path) -> None:
    SnapshotStore(str(path)).gc(min_age_s=0)
    drafts, temps = _leftovers(path)
    assert drafts == set() and temps == []
    _check_listed(path)


def test_random_sigkill_while_writing_and_publishing(tmp_path: Path) -> None:
    rng = random.Random(0x5EED)
    path = tmp_path / "store"
    _publish_example(path)
    landed: collections.Counter[str] = collections.Counter()  # the writer's last step per kill
    for run in range(RANDOM_RUNS):
        previous_newest = _check_listed(path)[0]
        proc = subprocess.Popen([sys.executable, str(WRITER), "loop", str(path), str(rng.randrange(1 << 30))],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = proc.stdout.readline()  # imports done: from here on every delay kills real work
            assert ready == "ready\n", f"run {run}: writer did not start: {proc.stderr.read()}"
            time.sleep(rng.uniform(0.0, MAX_KILL_DELAY_S))
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"run {run}: writer failed on its own: {err}"

        seqs = _check_listed(path)
        if previous_newest not in seqs:  # retention may drop it only once two newer ones are durable
            assert len([s for s in seqs if s > previous_newest]) >= 2, (run, previous_newest, seqs)
        # After "ready": "<step> <seq>" lines. Only newline-terminated lines of that shape count:
        # a kill can cut the last line short, and anything else printed is not a step.
        steps = [parts for line in out.split("\n")[:-1]
                 if len(parts := line.split()) == 2 and parts[0] in ("writing", "publishing", "published")
                 and parts[1].isdigit()]
        reported = [int(seq) for step, seq in steps if step == "published"]
        if reported:  # keep_latest=2 keeps it until the writer has published two more
            assert reported[-1] in seqs, (run, reported, seqs)
        if steps:
            landed[steps[-1][0]] += 1
            if steps[-1][0] == "writing":  # killed before publish was called: never listed
                assert int(steps[-1][1]) not in seqs, (run, steps, seqs)
        assert _publish_example(path, seed=run) == seqs[0] + 1

    # Guards against the test degenerating (e.g. a much faster writer): about one kill in six lands
    # in publish, so missing either phase in 50 kills has a probability of about 1e-4.
    assert landed["writing"] and landed["publishing"], f"kills landed only in {dict(landed)}"
    drafts, _ = _leftovers(path)
    assert drafts, "no kill left a draft behind"
    _check_gc_cleans(path)


# --- deterministic kill points ---------------------------------------------------------------

NEW_COMMIT = layout.commit_key(3)  # the template holds sequences 1 and 2; the writer publishes 3
OLD_COMMIT = layout.commit_key(1)  # ... and keep_latest=2 then deletes sequence 1
DRAFT = "snapshots/<id>"

# Each point names the event at which the writer kills itself. Points that leave the same state
# as a neighbour (e.g. "before create_exclusive" and "after the manifest's close") are left out.
WRITE_POINTS = [
    # Gym's ledger folder written but for its manifest, whose temporary file is durable, not renamed.
    f"before:os.replace:{DRAFT}/{example.gym_prefix('responses_api_models', example.MODEL)}/manifest.json",
    # The agent's folder adopted as a part, the ledger's and the resources server's not yet.
    f"after:create_exclusive:{DRAFT}/{example.gym_prefix('responses_api_agents', example.AGENT)}/part-manifest.json",
    f"after:open_write:{DRAFT}/tq/token_capture.arrow",  # row file open, nothing durable
    f"after:close:{DRAFT}/tq/training.arrow",
    f"after:close:{DRAFT}/controller/part-manifest.json",  # every part closed, publish not begun
]
PUBLISH_POINTS = [
    f"before:open_write:{DRAFT}/manifest.json",
    f"after:open_write:{DRAFT}/manifest.json",
    f"after:close:{DRAFT}/manifest.json",
    f"before:os.link:{NEW_COMMIT}",  # commit's temp file written, not linked
    f"after:os.link:{NEW_COMMIT}",  # the commit point has passed
    "before:os.unlink:_commits/.tmp-<tmp>",  # committed; the commit's temp link left behind
    "before:put_bytes:_latest.json",  # committed; the hint still names sequence 2
    "before:os.replace:_latest.json",  # the new hint's temp file left behind
    f"before:delete:{OLD_COMMIT}",
    f"after:delete:{OLD_COMMIT}",  # mid-retention: the old commit is gone, its folder is whole
    f"before:delete_tree:{DRAFT}",
    "delete_tree:first",  # the old folder partly deleted
    "delete_tree:middle",
    f"before:os.rmdir:{DRAFT}",  # the old folder is empty: only the folder itself is left
    "phase:done",
]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding sequences 1 and 2, copied for each kill."""
    path = tmp_path_factory.mktemp("crash-template") / "store"
    for seed in range(2):
        _publish_example(path, seed=seed)
    return path


@pytest.fixture(scope="module")
def dry_run(template: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The numbered events of one uninterrupted ``step`` run against a copy of the template."""
    path = tmp_path_factory.mktemp("crash-dry") / "store"
    shutil.copytree(template, path)
    result = _run_writer("step", str(path), "0")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["sequence"] == 3
    assert [c.sequence for c in SnapshotStore(str(path)).list()] == [3, 2]
    return out["events"]


def _index(events: list[str], point: str) -> int:
    """1-based event number of ``point`` (publish-phase events are looked up after the marker)."""
    start = events.index("phase:publish") if point not in WRITE_POINTS else 0
    if point.startswith("delete_tree:"):
        first = events.index(f"before:delete_tree:{DRAFT}", start) + 1
        last = events.index(f"after:delete_tree:{DRAFT}", start) - 1
        assert last > first + 2, "retention deleted an empty folder?"
        return first + 1 if point == "delete_tree:first" else (first + last) // 2 + 1
    assert point in events[start:], f"{point} is not a step of the writer: {events}"
    return events.index(point, start) + 1


def test_publish_steps_happen_in_crash_safe_order(dry_run: list[str]) -> None:
    order = [
        f"after:close:{DRAFT}/controller/part-manifest.json",
        f"after:close:{DRAFT}/manifest.json",  # the manifest is durable before the commit
        f"after:os.link:{NEW_COMMIT}",
        "after:put_bytes:_latest.json",  # the hint moves only once the commit exists
        f"after:delete:{OLD_COMMIT}",  # retention only after the new one is durable, commit first
        f"before:delete_tree:{DRAFT}",
    ]
    positions = [_index(dry_run, p) for p in order]
    assert positions == sorted(positions)
    assert _index(dry_run, f"before:delete:{OLD_COMMIT}") > _index(dry_run, "after:put_bytes:_latest.json")


def test_each_gym_folder_is_whole_before_its_manifest_and_adopted_after_it(dry_run: list[str]) -> None:
    """Gym's writers put ``manifest.json`` last (a folder with a manifest is whole), and the
    publisher adopts a folder (its part manifest) only after that."""
    for component, name in [(c.component, c.name) for c in example.CAPABILITIES]:
        folder = f"{DRAFT}/{example.gym_prefix(component, name)}"
        written = [e for e in dry_run if e.startswith(f"after:os.replace:{folder}/")]
        assert written and written[-1] == f"after:os.replace:{folder}/manifest.json", written
        adopted = dry_run.index(f"after:create_exclusive:{folder}/{layout.PART_MANIFEST_NAME}")
        assert adopted > dry_run.index(written[-1])


def _seq1_id(template: Path) -> str:
    return SnapshotStore(str(template)).open(1).manifest.snapshot_id


@pytest.mark.parametrize("point", WRITE_POINTS + PUBLISH_POINTS)
def test_sigkill_at_each_step(point: str, template: Path, dry_run: list[str], tmp_path: Path) -> None:
    path = tmp_path / "store"
    shutil.copytree(template, path)
    kill_at = _index(dry_run, point)
    result = _run_writer("step", str(path), str(kill_at))
    assert result.returncode == -signal.SIGKILL, f"not killed at {point}: {result.stderr}"

    committed = kill_at >= _index(dry_run, f"after:os.link:{NEW_COMMIT}")
    hint_moved = kill_at >= _index(dry_run, "after:os.replace:_latest.json")
    old_commit_gone = kill_at >= _index(dry_run, f"after:os.unlink:{OLD_COMMIT}")
    seqs = _check_listed(path)
    assert seqs == ([3] if committed else []) + ([2] if old_commit_gone else [2, 1])

    hint = json.loads((path / layout.HINT_KEY).read_bytes())
    assert hint["sequence"] == (3 if hint_moved else 2)  # a stale hint is probed past above

    old_folder = path / layout.snapshot_dir(_seq1_id(template))
    if old_commit_gone and old_folder.exists():  # crashed mid-retention: a folder no commit names
        with pytest.raises(NotPublishedError):
            open_snapshot(str(old_folder))
        assert old_folder.name in _leftovers(path)[0]

    assert _publish_example(path, seed=99) == seqs[0] + 1
    _check_gc_cleans(path)
