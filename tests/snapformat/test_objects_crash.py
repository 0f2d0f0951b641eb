"""SIGKILL while writing shared objects, while publishing, and while collecting garbage (SPEC §14.2).

Real processes, killed with SIGKILL at a numbered store step (``incremental_writer.py``: a fork
server forks each writer and each GC; the child kills itself at event ``k``). The writer publishes
the next snapshot of an incremental chain: it references most of its parent's row objects (one
narrowed by a row range), writes two new ones (one with the bytes of an old unreferenced object: a
re-put) and publishes with ``keep_latest=2`` (retention deletes a snapshot whose objects the newer
ones share). The GC is ``snapformat.retention.gc`` (retention, draft sweep, mark, object sweep).

Orders:

- writer killed at every step, then a GC, then a writer that publishes, then a final GC;
- GC killed at every step (over a store holding a crashed draft, its objects, a stale temporary
  object, objects nothing names and a snapshot retention must delete), then a writer, then a GC;
- a seeded walk of writers and GCs each killed at a random step (or not), one after the other.

After every step: every listed snapshot opens and verifies and every object it names exists with
its size; ``latest()`` is the newest listed; the newest committed snapshot before the step is still
listed unless a newer one is. A GC keeps whatever is younger than its grace period (a crashed
writer's fresh draft and objects). Once every leftover is older than the grace period, a GC leaves
no draft, no temporary file and exactly the objects the committed manifests name.

The stores live in ``/dev/shm`` when there is one (a SIGKILL ends a process, not the machine: the
fsyncs only cost time). ``OBJECTS_CRASH_WALK`` sets the walk's number of steps (default 60; a soak:
2000) and ``OBJECTS_CRASH_SEED`` its seed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from incremental_writer import ForkServer, age, leftovers

from snapformat import SnapshotStore, layout, verify_snapshot

GRACE_S = 60.0  # the GC's grace period (and draft min age) in these tests
OLD_S = 3600.0  # how far time passes when leftovers are made old
WALK_STEPS = int(os.environ.get("OBJECTS_CRASH_WALK", "60"))
WALK_SEED = int(os.environ.get("OBJECTS_CRASH_SEED", "2113"))
KILLED = {"signal": signal.SIGKILL}


@pytest.fixture(scope="module")
def server():
    fs = ForkServer()
    yield fs
    fs.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    """Where the stores live: in memory (``/dev/shm``) when there is one. A SIGKILL ends a process,
    not the machine, so what reached the disk does not matter here, and the fsyncs of hundreds of
    writers and GCs cost most of these tests' time on a disk shared with other jobs."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="objects-crash-", dir=shm))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("objects-crash")


def _ok(reply: dict[str, Any], what: str) -> dict[str, Any]:
    assert reply.get("exit") == 0, f"{what} failed: {reply.get('error', reply)}"
    return reply


def _check_listed(path: Path) -> list[int]:
    """Every listed snapshot verifies and its objects exist with their sizes; ``latest()`` is the
    newest. Returns the sequences, newest first."""
    store = SnapshotStore(str(path))
    commits = store.list()
    seqs = [c.sequence for c in commits]
    assert seqs, "nothing is listed"
    for commit in commits:
        snap = store.open(commit.sequence)
        for f in snap.manifest.files:
            if f.object is not None:
                key = path / layout.object_key(f.object)
                assert key.is_file(), f"sequence {commit.sequence} lost object {f.object} ({f.path})"
                assert key.stat().st_size == f.size, f"sequence {commit.sequence}: object {f.object} changed size"
        report = verify_snapshot(snap)
        assert report.ok, f"sequence {commit.sequence} does not verify: {report.problems}"
    latest = store.latest()
    assert latest is not None and latest.sequence == seqs[0]
    return seqs


def _check_newest_kept(before: list[int], after: list[int], keep: int) -> None:
    """The newest snapshot before a step is listed after it, unless ``keep`` newer ones are."""
    newest = before[0]
    assert after[0] >= newest, f"listing went back in time: {before} -> {after}"
    if newest not in after:
        assert len([s for s in after if s > newest]) >= keep, f"newest {newest} lost: {before} -> {after}"


def _gc(server: ForkServer, path: Path, kill_at: int = 0, keep_latest: int | None = None) -> dict[str, Any]:
    return server.run("gc", path, kill_at, keep_latest=keep_latest, min_age_s=GRACE_S, grace_s=GRACE_S)


def _check_collects_all(server: ForkServer, path: Path, listed: list[int]) -> None:
    """Once everything is older than the grace period, a GC (no retention) leaves no leftover of any
    kind, and the ``listed`` snapshots verify."""
    before = [c.sequence for c in SnapshotStore(str(path)).list()]
    assert before == listed
    age(path, OLD_S)
    _ok(_gc(server, path), "final gc")
    left = leftovers(path)
    assert left == {"drafts": [], "temps": [], "objects": []}, f"a GC past the grace period left {left}"
    assert _check_listed(path) == before


def _young(path: Path) -> set[str]:
    """Objects (and temporary files under ``objects/``) younger than the grace period."""
    now = time.time()
    return {p.relative_to(path).as_posix() for p in (path / layout.OBJECTS).glob("*/*")
            if now - p.stat().st_mtime < GRACE_S / 2}


@pytest.fixture(scope="module")
def template(server: ForkServer, workdir: Path) -> Path:
    """Sequences 3 and 4 of a chain (1 and 2 deleted by retention), everything old: objects that
    only the deleted snapshots named are leftovers, one of them with the bytes the next writer writes."""
    path = workdir / "template"
    for seq in range(1, 5):
        assert _ok(server.run("write", path), "template writer")["result"]["sequence"] == seq
    assert _check_listed(path) == [4, 3]
    left = leftovers(path)
    assert left["objects"] and not left["drafts"] and not left["temps"], left
    age(path, OLD_S)
    return path


@pytest.fixture(scope="module")
def writer_events(server: ForkServer, template: Path, workdir: Path) -> list[str]:
    """The numbered steps of one uninterrupted writer publishing sequence 5 over the template."""
    path = workdir / "dry-run"
    shutil.copytree(template, path)
    reply = _ok(server.run("write", path), "dry-run writer")
    assert reply["result"]["sequence"] == 5
    events = reply["events"]
    re_put = [e for e in events if e.startswith(f"before:put_bytes:{layout.OBJECTS}/")]
    assert re_put, f"the writer never put an existing object again: {events}"
    return events


def _at(events: list[str], name: str) -> int:
    assert name in events, f"{name} is not a step: {events}"
    return events.index(name) + 1


@pytest.mark.slow
def test_writer_killed_at_every_step_then_gc_then_writer(server: ForkServer, template: Path,
                                                          writer_events: list[str], workdir: Path) -> None:
    base = workdir / "writer-killed"
    commit5, commit3 = layout.commit_key(5), layout.commit_key(3)
    committed_at = _at(writer_events, f"after:os.link:{commit5}")
    old_gone_at = _at(writer_events, f"after:os.unlink:{commit3}")
    template_leftovers = set(leftovers(template)["objects"])
    left_something = 0
    for k in range(1, len(writer_events) + 1):
        where = f"writer killed at {k} ({writer_events[k - 1]})"
        path = base / f"k{k}"
        shutil.copytree(template, path)
        assert server.run("write", path, k) == KILLED, where

        seqs = _check_listed(path)
        expected = ([5] if k >= committed_at else []) + [4] + ([3] if k < old_gone_at else [])
        assert seqs == expected, where
        left = leftovers(path)
        left_something += bool(left["drafts"] or left["temps"] or set(left["objects"]) - template_leftovers)

        young = _young(path)  # what the killed writer wrote or put again: its publish was due within the grace period
        _ok(_gc(server, path, keep_latest=2), where)
        seqs_after = _check_listed(path)
        assert seqs_after == seqs[:2], where
        missing = {y for y in young if not (path / y).exists()}
        assert not missing, f"{where}: a GC swept what was younger than its grace period: {missing}"
        old_unnamed = [o for o in leftovers(path)["objects"] if f"{layout.object_key(o)}" not in young]
        assert not old_unnamed, f"{where}: a GC kept old objects nothing names: {old_unnamed}"

        published = _ok(server.run("write", path), where)["result"]["sequence"]
        assert published == seqs_after[0] + 1, where
        final = _check_listed(path)
        _check_newest_kept(seqs_after, final, keep=2)
        _check_collects_all(server, path, final)
        shutil.rmtree(path)
    assert left_something > len(writer_events) // 3, "kills did not leave leftovers: the steps are not covered"


@pytest.fixture(scope="module")
def crashed(server: ForkServer, template: Path, writer_events: list[str], workdir: Path) -> Path:
    """The template after two writers of sequence 5 crashed, everything old: one left a draft whose
    part manifests name its objects; the other crashed putting an existing object again (a
    temporary file under ``objects/``). A GC with ``keep_latest=1`` also deletes sequence 3."""
    path = workdir / "crashed"
    shutil.copytree(template, path)
    closed = next(e for e in writer_events if e.startswith("after:close:") and e.endswith(
        f"controller/{layout.PART_MANIFEST_NAME}"))
    assert server.run("write", path, _at(writer_events, closed)) == KILLED
    re_put = next(e for e in writer_events if e.startswith(f"before:os.replace:{layout.OBJECTS}/"))
    assert server.run("write", path, _at(writer_events, re_put)) == KILLED
    left = leftovers(path)
    assert len(left["drafts"]) == 1 and any(t.startswith(layout.OBJECTS) for t in left["temps"]), left
    assert _check_listed(path) == [4, 3]
    age(path, OLD_S)
    return path


@pytest.mark.slow
def test_gc_killed_at_every_step_then_writer_then_gc(server: ForkServer, crashed: Path, workdir: Path) -> None:
    base = workdir / "gc-killed"
    dry = base / "dry"
    shutil.copytree(crashed, dry)
    events = _ok(_gc(server, dry, keep_latest=1), "dry-run gc")["events"]
    assert _check_listed(dry) == [4]
    assert leftovers(dry) == {"drafts": [], "temps": [], "objects": []}, "a GC did not sweep old leftovers"
    sweeps = [e for e in events if e.startswith(f"before:delete_if_older:{layout.OBJECTS}/")]
    assert len(sweeps) >= 3, f"the GC swept too few objects to test its sweep: {events}"
    old_gone_at = _at(events, f"after:os.unlink:{layout.commit_key(3)}")
    shutil.rmtree(dry)

    for k in range(1, len(events) + 1):
        where = f"gc killed at {k} ({events[k - 1]})"
        path = base / f"k{k}"
        shutil.copytree(crashed, path)
        assert _gc(server, path, k, keep_latest=1) == KILLED, where
        seqs = _check_listed(path)
        assert seqs == ([4, 3] if k < old_gone_at else [4]), where

        published = _ok(server.run("write", path), where)["result"]["sequence"]
        assert published == 5, where
        final = _check_listed(path)
        _check_newest_kept(seqs, final, keep=2)
        _check_collects_all(server, path, final)
        shutil.rmtree(path)


@pytest.mark.slow
def test_random_walk_of_killed_writers_and_gcs(server: ForkServer, template: Path, workdir: Path) -> None:
    """Writers and GCs one after the other, each killed at a random step or not: every order."""
    rng = random.Random(WALK_SEED)
    path = workdir / "walk"
    shutil.copytree(template, path)
    longest = {"write": 60, "gc": 60}  # the longest run of each role seen so far: kills fall within it
    outcomes: dict[str, int] = {}
    for step in range(WALK_STEPS):
        before = _check_listed(path)
        if rng.random() < 0.3:
            age(path, OLD_S)  # time passes: every leftover so far is past the grace period
        role = rng.choice(["write", "write", "gc"])
        keep = rng.choice([1, 2, 3]) if role == "write" else rng.choice([None, 1, 2])
        kill_at = 0 if rng.random() < 0.25 else rng.randint(1, longest[role])
        reply = (server.run("write", path, kill_at, keep_latest=keep) if role == "write"
                 else _gc(server, path, kill_at, keep_latest=keep))
        where = f"step {step}: {role} keep_latest={keep} kill_at={kill_at}"
        if reply != KILLED:
            _ok(reply, where)
            longest[role] = max(longest[role], len(reply["events"]))
        outcome = f"{role} {'killed' if reply == KILLED else 'done'}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        after = _check_listed(path)
        _check_newest_kept(before, after, keep=keep or 1)
    assert all(outcomes.get(o) for o in ("write killed", "write done", "gc killed", "gc done")), outcomes
    _check_collects_all(server, path, after)
