"""Which file system holds a path (``snapformat.mounts``), and the writer threads of a Gym commit
that follow from it (``snapformat.gym_dir.writer_threads``): one thread on a memory-backed file
system, where an fsync writes nothing, :data:`FSYNC_WORKERS` elsewhere or when it is unknown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapformat import gym_dir
from snapformat.gym_dir import FSYNC_WORKERS, DurableFiles, writer_threads
from snapformat.mounts import Mount, mount_of, parse_mounts

TABLE = "\n".join([
    "/dev/vda / ext4 rw,relatime 0 0",
    "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0",
    "/dev/vdb /data xfs rw 0 0",
    "tmpfs /data/scratch\\040space tmpfs rw 0 0",
    "overlay /data overlay rw 0 0",  # mounted over /data later: the later line holds it
    "short line",
])


def test_the_table_is_parsed_with_the_kernels_escapes() -> None:
    mounts = parse_mounts(TABLE)
    assert [m.mount_point for m in mounts] == ["/", "/dev/shm", "/data", "/data/scratch space", "/data"]
    assert mounts[1] == Mount(device="tmpfs", mount_point="/dev/shm", fs_type="tmpfs") and mounts[1].in_memory
    assert not mounts[0].in_memory


@pytest.mark.parametrize(("path", "fs_type"), [
    ("/dev/shm/gym-checkpoint-staging/x", "tmpfs"),
    ("/dev/shm", "tmpfs"),
    ("/dev/shmx/y", "ext4"),  # a sibling whose name starts the same is not inside
    ("/data/scratch space/a", "tmpfs"),
    ("/data/other", "overlay"),  # the later of two mounts on one point
    ("/var/tmp", "ext4"),
])
def test_the_longest_mount_point_holding_a_path_wins(path: str, fs_type: str) -> None:
    found = mount_of(path, parse_mounts(TABLE))
    assert found is not None and found.fs_type == fs_type


def test_no_table_or_no_mount_is_unknown() -> None:
    assert mount_of("/anything", []) is None
    assert mount_of("/anything", parse_mounts("tmpfs /dev/shm tmpfs rw 0 0")) is None


@given(st.text())
def test_any_text_parses_into_mounts_without_error(text: str) -> None:
    for m in parse_mounts(text):
        assert m.mount_point and m.fs_type
        mount_of("/", [m])


@pytest.mark.parametrize(("mount", "threads"), [
    (Mount(device="tmpfs", mount_point="/", fs_type="tmpfs"), 1),
    (Mount(device="none", mount_point="/", fs_type="ramfs"), 1),
    (Mount(device="/dev/vda", mount_point="/", fs_type="ext4"), FSYNC_WORKERS),
    (None, FSYNC_WORKERS),  # unknown (not Linux): the disk's default
])
def test_a_commit_writes_on_one_thread_only_in_memory(monkeypatch, tmp_path: Path, mount: Mount | None,
                                                      threads: int) -> None:
    monkeypatch.setattr(gym_dir, "mount_of", lambda _path: mount)
    assert writer_threads(tmp_path) == threads
    with DurableFiles() as out:
        for i in range(40):
            out.add(tmp_path / "part" / f"f{i}.json", b"%d" % i)
    assert out.workers == threads
    assert sorted(os.listdir(tmp_path / "part")) == sorted(f"f{i}.json" for i in range(40))  # no temp file left
    assert all((tmp_path / "part" / f"f{i}.json").read_bytes() == b"%d" % i for i in range(40))


def test_dev_shm_is_known_to_be_in_memory_on_linux() -> None:
    """The system's own table: where ``/dev/shm`` is mounted (Linux; the staging folder the scale
    benchmark and the docs advise), it is tmpfs, and a commit there writes on the calling thread."""
    if not Path("/proc/mounts").exists() or not any(m.mount_point == "/dev/shm" for m in parse_mounts(
            Path("/proc/mounts").read_text())):
        pytest.skip("no /dev/shm mount on this system (not Linux)")
    mount = mount_of("/dev/shm")
    assert mount is not None and mount.in_memory
    assert writer_threads("/dev/shm") == 1
