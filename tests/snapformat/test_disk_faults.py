"""A save that fails on a full or read-only disk fails cleanly, on a real small file system.

Each test mounts a 4 MiB tmpfs (root only: skipped with the reason otherwise) and unmounts it
afterwards whatever happens. A published snapshot is already there; the next save of Arrow rows
then meets a fault at one of three steps: while writing the rows (the disk fills after 256 KiB of
them, or the file system turned read-only before their file is created), while publish writes
the part manifests, or right at the commit. Proves that:
- the save raises ``StoreError`` whose message names the file it was writing and says the disk is
  full (or the file system read-only), with the ``OSError`` (``ENOSPC``/``EROFS``) as its cause;
- nothing is published: ``list()`` is unchanged and ``latest()`` is still the previous snapshot,
  which verifies clean; no byte of any file that was in the store before changes;
- once the fault is gone (the filler file deleted, the file system remounted read-write) a new save
  succeeds and verifies, and ``gc(min_age_s=0)`` removes the failed draft and nothing else.

Why ``mount -o remount,ro`` for the permission fault: as root, ``chmod`` stops nothing
(``CAP_DAC_OVERRIDE``), and ``chattr +i`` depends on the file system supporting the flag (tmpfs
only does on recent kernels); a read-only remount refuses every write to root too, on any kernel.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from schemas.controller import LoaderPlace
from schemas.errors import StoreError
from snapformat import SnapshotDraft, SnapshotStore, example, layout, verify_snapshot

pytestmark = pytest.mark.timeout(60)

DISK_SIZE = "4m"
FAULTS = {"full": ("the disk is full", errno.ENOSPC), "read-only": ("the file system is read-only", errno.EROFS)}
STEPS = ["rows", "publish", "commit"]
#: Space the full-disk fault leaves: enough to start the rows file, so it fails part-way through.
LEAVE = {"rows": 256 << 10, "publish": 0, "commit": 0}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A fresh 4 MiB tmpfs, unmounted after the test (lazily if something still holds it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: these tests fill and remount a real small file system")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = _run("mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(mount_point))
    if mounted.returncode != 0:
        pytest.skip(f"mount is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if _run("umount", str(mount_point)).returncode != 0:
            _run("umount", "-l", str(mount_point))


def _fill(disk: Path, leave: int) -> Path:
    """Write a filler file until only ``leave`` bytes are free (or the disk refuses more)."""
    filler = disk / "filler"
    stats = os.statvfs(disk)
    todo = stats.f_bavail * stats.f_frsize - leave
    chunk = bytes(1 << 20)
    with open(filler, "ab", buffering=0) as fh:
        while todo > 0:
            try:
                todo -= fh.write(chunk[:todo])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return filler


def _remount(disk: Path, mode: str) -> None:
    result = _run("mount", "-o", f"remount,{mode}", str(disk))
    assert result.returncode == 0, result.stderr


def _fault(disk: Path, fault: str, step: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(inject, repair)`` for ``fault`` at ``step``."""
    if fault == "full":
        return lambda: _fill(disk, LEAVE[step]), lambda: (disk / "filler").unlink()
    return lambda: _remount(disk, "ro"), lambda: _remount(disk, "rw")


def _save_example(store: SnapshotStore, count: int, seed: int) -> SnapshotDraft:
    """Publish a snapshot of every part kind (the shape the other format tests use)."""
    draft = store.begin()
    gym, receipts = example.write_example(draft, count=count, seed=seed)
    draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=example.TOPOLOGY)
    return draft


def _failing_save(store: SnapshotStore, step: str, inject: Callable[[], None],
                  monkeypatch: pytest.MonkeyPatch) -> tuple[SnapshotDraft, StoreError]:
    """Save a small JSON part, then ~2 MB of training rows, with the fault injected at ``step``."""
    draft = store.begin()
    draft.part("controller", writer="controller").write_json(
        "loader", "loader_place", LoaderPlace(epoch=0, consumed=1, seed=2))
    if step == "commit":  # the disk fails right when the commit record is written
        create_exclusive = store.store.create_exclusive

        def fault_then_create(key: str, data: bytes) -> None:
            if key.startswith(layout.COMMITS):
                inject()
            create_exclusive(key, data)

        monkeypatch.setattr(store.store, "create_exclusive", fault_then_create)
    with pytest.raises(StoreError) as err:
        if step == "rows":
            inject()
        draft.part("tq", writer="tq").write_rows(
            "training.arrow", "training_rows", example.training_batch(example.rollouts(4000, 2), 2))
        if step == "publish":
            inject()
        draft.publish()
    monkeypatch.undo()
    return draft, err.value


def _failed_file(draft: SnapshotDraft, step: str) -> str:
    """The file each step fails on: the rows, the first part manifest publish writes, the commit."""
    return {"rows": f"{draft.url}/tq/training.arrow",
            "publish": f"{draft.url}/controller/part-manifest.json",
            "commit": draft.store.display(layout.commit_key(draft.sequence))}[step]


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_still_published(store: SnapshotStore, commits: list, previous: SnapshotDraft) -> None:
    assert store.list() == commits
    latest = store.latest()
    assert latest is not None and latest.manifest.snapshot_id == previous.snapshot_id
    assert verify_snapshot(latest).ok


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failed_save_publishes_nothing_and_gc_sweeps_it(
        disk: Path, fault: str, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(str(disk / "store"))
    previous = _save_example(store, count=20, seed=1)
    commits = store.list()
    inject, repair = _fault(disk, fault, step)
    words, code = FAULTS[fault]
    try:
        draft, err = _failing_save(store, step, inject, monkeypatch)
        message = str(err)
        assert message.startswith(_failed_file(draft, step) + ":"), message
        assert words in message, message
        assert isinstance(err.__cause__, OSError) and err.__cause__.errno == code
        _assert_still_published(store, commits, previous)
    finally:
        repair()
    assert (disk / "store" / layout.snapshot_dir(draft.snapshot_id)).is_dir()  # the failed draft stays...
    fixed = _save_example(store, count=60, seed=3)
    assert store.latest().manifest.snapshot_id == fixed.snapshot_id and fixed.sequence == previous.sequence + 1
    assert verify_snapshot(store.latest()).ok
    report = store.gc(min_age_s=0)
    assert report.swept_drafts == [draft.snapshot_id]  # ...until GC sweeps it, and nothing else
    assert not (disk / "store" / layout.snapshot_dir(draft.snapshot_id)).exists()
    assert [c.snapshot_id for c in store.list()] == [fixed.snapshot_id, previous.snapshot_id]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failed_save_changes_no_published_byte(disk: Path, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit step gets closest to published data: the draft is complete, ``_commits/`` is written."""
    root = disk / "store"
    store = SnapshotStore(str(root))
    _save_example(store, count=20, seed=1)
    before = _hashes(root)
    inject, repair = _fault(disk, fault, "commit")
    try:
        draft, _ = _failing_save(store, "commit", inject, monkeypatch)
    finally:
        repair()
    after = _hashes(root)
    assert {k: after.get(k) for k in before} == before
    draft_prefix = layout.snapshot_dir(draft.snapshot_id) + "/"
    assert all(k.startswith(draft_prefix) for k in set(after) - set(before)), sorted(set(after) - set(before))
