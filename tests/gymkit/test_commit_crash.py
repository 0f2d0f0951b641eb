"""A Gym commit killed at any point leaves its folder without a manifest (refused by readers) or
whole and valid, and its calls are in an order a power loss cannot break (CONTROL §6.2).

The writers (``gymkit.checkpoint_dir``) put a commit's data files through
:class:`snapformat.gym_dir.DurableFiles`: temp -> write -> fsync -> rename on a few threads, then
one fsync of each folder touched, then the manifest (temp, fsync, rename, folder fsync). Checked
here three ways:

- **SIGKILL at every call.** ``commit_crash_writer.py`` writes the three commits (agent, model
  ledger, resources) and kills itself at event k, for every k of a full run: after each kill every
  folder either has no ``manifest.json`` (and reading it is refused) or is whole, every digest and
  reference checked (``read_*_dir`` and the publisher's ``check_folder``); the commits that
  finished are a prefix of the commit order; and a retry of the commits over what the kill left
  gives the same manifests as an uninterrupted run.
- **A power-loss model.** The same calls, traced in-process: a file's bytes count as durable only
  once it is fsynced, a name (rename, unlink, mkdir) only once its folder's fsync has started after
  it. When a manifest's rename is issued every other file of its folder (and every folder the
  commit created) must already be durable, and when a writer returns its manifest must be.
- **The cost.** Each commit fsyncs its folder twice (once for all its data files, once for the
  manifest), whatever the number of files, and every file once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gymkit import checkpoint_dir as cd
from schemas.errors import CorruptSnapshotError
from schemas.gym_files import MANIFEST_NAME
from snapformat.gym_dir import TEMP_PREFIX, check_folder, list_folder
from tests.gymkit import commit_crash_writer as writer

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["agent", "ledger", "resources"]
READERS = {"agent": cd.read_agent_dir, "ledger": cd.read_ledger_dir, "resources": cd.read_resources_dir}


@pytest.fixture(autouse=True)
def _small_archives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cd, "AGENT_ARCHIVE_MAX_MEMBERS", writer.ARCHIVE_MEMBERS)


def _run(root: Path, points: list[int]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(Path(writer.__file__)), str(root), *map(str, points)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert Path(lines[0]["gymkit"]).is_relative_to(ROOT), f"the writer ran other code: {lines[0]}"
    return lines[1:]


def _state(checkpoint_dir: Path) -> dict[str, str | None]:
    """Each folder's manifest digest when it has a manifest (checked whole), else None (and refused)."""
    out: dict[str, str | None] = {}
    for component, folder in writer.folders(checkpoint_dir).items():
        if not (folder / MANIFEST_NAME).exists():
            if folder.is_dir():
                with pytest.raises(CorruptSnapshotError, match="manifest.json: missing"):
                    READERS[component](folder)
                with pytest.raises(CorruptSnapshotError, match="manifest.json: missing"):
                    check_folder(folder)
            out[component] = None
            continue
        READERS[component](folder)  # every digest, reference and record checked
        checked = check_folder(folder, component=component)  # the publisher's check of every file
        if component == "ledger":  # every lineage file the manifest names is there, byte for byte
            _, _, lineage = cd.read_ledger_dir(folder)
            assert all(p.is_file() for p in lineage.values())
        assert all(not name.startswith(TEMP_PREFIX) for name in list_folder(folder))
        out[component] = checked.manifest_digest
    return out


def test_sigkill_at_every_call_leaves_no_manifest_or_a_whole_folder(tmp_path: Path) -> None:
    (dry,) = _run(tmp_path / "dry", [0])
    assert not dry["killed"] and dry["exit"] == 0 and dry["events"] > 100, dry
    whole = _state(tmp_path / "dry" / "0")
    assert all(whole.values()), whole
    points = list(range(1, dry["events"] + 1))
    results = _run(tmp_path / "kill", points)
    assert [r["k"] for r in results] == points
    committed = Counter()
    for r in results:
        assert r["killed"], f"the writer was not killed at event {r['k']}: {r}"
        where = tmp_path / "kill" / str(r["k"])
        state = _state(where)
        done = [c for c in ORDER if state[c] is not None]
        assert done == ORDER[:len(done)], f"kill at {r['k']}: commits {done} are not a prefix of {ORDER}"
        for c in done:
            assert state[c] == whole[c], f"kill at {r['k']}: {c}'s manifest differs from an uninterrupted run's"
        committed[len(done)] += 1
        writer.commit_all(where, skip_committed=True)  # the retry after the crash
        assert _state(where) == whole, f"kill at {r['k']}: the retried commits differ from an uninterrupted run"
    # The kills landed before the first manifest, between each two, and after the last.
    assert set(committed) == {0, 1, 2, 3}, committed


# -- the power-loss model -------------------------------------------------------------------------------------------
class _Model:
    """Replays a trace: what is durable if the power fails after a given event."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}  # path -> inode (what a reader would see now)
        self.opened: dict[str, int] = {}  # the path a descriptor was opened by -> inode
        self.synced: dict[int, bool] = {}  # inode -> bytes durable
        self.changed: dict[str, int] = {}  # path -> event of its last name change (rename, unlink, mkdir)
        self.created: set[str] = set()  # folders made by mkdir
        self.removed: set[str] = set()
        self.fsync_start: dict[str, int] = {}
        self.dir_syncs: dict[str, list[int]] = {}  # folder -> start events of its completed fsyncs
        self.fsyncs: Counter[tuple[str, bool]] = Counter()

    def name_durable(self, path: str) -> bool:
        changed = self.changed.get(path)
        if changed is None:
            return True  # existed before the trace
        return any(start > changed for start in self.dir_syncs.get(os.path.dirname(path), []))

    def apply(self, number: int, when: str, call: str, path: str, detail) -> None:
        if when == "before":
            if call == "fsync" and detail["dir"]:
                self.fsync_start[path] = number
            return
        if call == "open" and detail["create"]:
            inode = number
            self.names[path] = self.opened[path] = inode
            self.synced[inode] = True
            self.changed[path] = number
        elif call == "open" and not detail["dir"]:
            self.opened[path] = self.names[path]
        elif call == "write":
            self.synced[self.opened[path]] = False
        elif call == "fsync" and detail["dir"]:
            self.dir_syncs.setdefault(path, []).append(self.fsync_start.pop(path))
            self.fsyncs[(path, True)] += 1
        elif call == "fsync":
            self.synced[self.opened[path]] = True
            self.fsyncs[(path, False)] += 1
        elif call == "replace":
            self.names[path] = self.names.pop(detail)
            self.changed[path] = number
            self.changed.pop(detail, None)  # a temporary name: nothing promises it
            self.removed.discard(path)
        elif call == "unlink":
            self.names.pop(path, None)
            self.changed[path] = number
            self.removed.add(path)
        elif call == "mkdir":
            self.created.add(path)
            self.changed[path] = number

    def check_manifest_rename(self, folder: str, number: int) -> None:
        """The manifest's rename is about to be issued: everything else of its folder is durable."""
        manifest = os.path.join(folder, MANIFEST_NAME)
        tmp_inode = None
        for path, inode in self.names.items():
            if os.path.dirname(path) != folder or path == manifest:
                continue
            if os.path.basename(path).startswith(TEMP_PREFIX):
                tmp_inode = inode if tmp_inode is None else tmp_inode
                continue
            assert self.synced[inode], f"event {number}: {path}'s bytes are not fsynced before the manifest's rename"
            assert self.name_durable(path), f"event {number}: {path}'s name is not durable before the manifest's rename"
        for path in self.removed:
            if os.path.dirname(path) == folder:
                assert self.name_durable(path), f"event {number}: the removal of {path} is not durable"
        for d in self.created:
            if folder == d or folder.startswith(d + os.sep):
                assert self.name_durable(d), f"event {number}: the created folder {d} is not durable"

    def check_returned(self, folder: str, number: int) -> None:
        manifest = os.path.join(folder, MANIFEST_NAME)
        assert manifest in self.names, f"event {number}: {folder} was committed without a manifest"
        assert self.synced[self.names[manifest]], f"event {number}: {manifest}'s bytes are not durable at the answer"
        assert self.name_durable(manifest), f"event {number}: {manifest}'s name is not durable at the answer"


def _traced_commits(checkpoint_dir: Path) -> list[tuple]:
    trace = writer.OsTrace(checkpoint_dir)
    trace.install()
    try:
        writer.commit_all(checkpoint_dir, trace)
    finally:
        trace.uninstall()
    return trace.events


@pytest.mark.parametrize("again", [False, True], ids=["fresh", "over-a-larger-commit"])
def test_every_file_is_durable_before_its_manifest_and_the_manifest_before_the_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, again: bool) -> None:
    if again:  # the folders hold an earlier commit with more archives: the stale one is removed, durably
        monkeypatch.setattr(cd, "AGENT_ARCHIVE_MAX_MEMBERS", 1)
        writer.commit_all(tmp_path)
        for folder in writer.folders(tmp_path).values():
            (folder / MANIFEST_NAME).unlink()
        monkeypatch.setattr(cd, "AGENT_ARCHIVE_MAX_MEMBERS", writer.ARCHIVE_MEMBERS)
    events = _traced_commits(tmp_path)
    model = _Model()
    returned = []
    for number, when, call, path, detail in events:
        if when == "before" and call == "replace" and os.path.basename(path) == MANIFEST_NAME:
            model.check_manifest_rename(os.path.dirname(path), number)
        if when == "mark":
            model.check_returned(path, number)
            returned.append(path)
            continue
        model.apply(number, when, call, path, detail)
    assert returned == [str(f.absolute()) for f in writer.folders(tmp_path).values()]
    if again:
        assert any(call == "unlink" and path.endswith(".tar") for _, _, call, path, _ in events)
    assert all(_state(tmp_path).values())


def test_one_folder_fsync_for_all_of_a_commits_files(tmp_path: Path) -> None:
    events = _traced_commits(tmp_path)
    model = _Model()
    for number, when, call, path, detail in events:
        if when != "mark":
            model.apply(number, when, call, path, detail)
    for component, folder in writer.folders(tmp_path).items():
        files = list_folder(folder)
        assert len(files) > 3, files
        assert model.fsyncs[(str(folder.absolute()), True)] == 2, component  # the data files', the manifest's
    file_fsyncs = sum(n for (_, is_dir), n in model.fsyncs.items() if not is_dir)
    assert file_fsyncs == sum(len(list_folder(f)) for f in writer.folders(tmp_path).values())
