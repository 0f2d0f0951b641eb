"""Where Gym writes a save's commit (:mod:`coordinator.checkpoint.gym_parts`): the draft's own
``gym/`` folder on a local store unless the controller stages always, a staging folder otherwise,
and whether that staging folder keeps the files in memory (what ``gym_staging="always"`` is for)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from coordinator.checkpoint import gym_parts
from snapformat import SnapshotStore
from snapformat.mounts import Mount, parse_mounts


@pytest.mark.parametrize("always", [False, True])
def test_a_local_store_is_written_in_place_unless_staging_always(tmp_path: Path, always: bool) -> None:
    draft = SnapshotStore(str(tmp_path / "store")).begin()
    cdir = gym_parts.save_dir(draft, str(tmp_path / "staging"), always_stage=always)
    inside_draft = Path(cdir.path).is_relative_to(tmp_path / "store")
    assert (cdir.staging, inside_draft) == (always, not always)
    assert Path(cdir.path).is_dir() and Path(cdir.path).name == gym_parts.GYM_FOLDER
    cdir.cleanup()
    assert Path(cdir.path).exists() == (not always)  # a staging folder goes; the draft's stays
    if always:
        assert list((tmp_path / "staging").iterdir()) == []


def test_the_staging_base_defaults_to_the_temporary_folder(tmp_path: Path) -> None:
    assert gym_parts.staging_base(str(tmp_path)) == tmp_path
    assert gym_parts.staging_base(None) == Path(tempfile.gettempdir()) / "gym-checkpoint-staging"


@pytest.mark.parametrize(("mount", "in_memory"), [
    (Mount(device="tmpfs", mount_point="/", fs_type="tmpfs"), True),
    (Mount(device="/dev/vda", mount_point="/", fs_type="ext4"), False),
    (None, False),  # unknown: not claimed to be memory
])
def test_staging_in_memory_follows_the_mount(monkeypatch, tmp_path: Path, mount: Mount | None,
                                             in_memory: bool) -> None:
    asked: list[Path] = []
    monkeypatch.setattr(gym_parts, "mount_of", lambda path: asked.append(Path(path)) or mount)
    assert gym_parts.staged_in_memory(str(tmp_path / "not" / "made" / "yet")) is in_memory
    assert asked == [tmp_path]  # the nearest folder that exists: the mount that will hold it


def test_dev_shm_stages_in_memory_on_linux() -> None:
    mounts = Path("/proc/mounts")
    if not mounts.exists() or not any(m.mount_point == "/dev/shm" for m in parse_mounts(mounts.read_text())):
        pytest.skip("no /dev/shm mount on this system (not Linux)")
    assert gym_parts.staged_in_memory("/dev/shm/gym-staging")
