"""Gym's files as the snapshot's Gym parts (CONTROL.md §9).

Gym's participants know nothing of snapformat: each writes plain files into the ``checkpoint_dir``
it is handed, in Gym's layout (``agent/instance-<sha>/``, ``model-ledger/<name>/``,
``resources/<name>/``). This module decides that folder and turns what was written there into
parts of the draft:

* **save, local store**: ``checkpoint_dir`` is the draft's own ``gym/`` folder, so every file is
  already at its final place; adoption hashes it in place and writes the part manifest.
* **save, any other store (S3)**, or any store when the controller stages always
  (``ControllerConfig.gym_staging``): ``checkpoint_dir`` is a local staging folder
  (``<staging>/<snapshot_id>/gym``); adoption uploads each participant's folder into the draft.
  The staging folder is removed once the draft holds the parts (or the save is abandoned).
* **restore**: a local snapshot's ``gym/`` folder is handed as it is; from S3 the Gym parts are
  downloaded (verified against their part manifests) into a staging folder first.

Adoption checks Gym's own ``manifest.json`` digests and artifact references against the bytes
before a part manifest lists the files (``snapformat.adopt``). What a crash leaves: during a save,
a draft no commit names plus, for S3, a staging folder under the staging root (removed by the next
save's cleanup of folders older than a day); during a restore, a staging folder (likewise).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from schemas.gym_files import participant_dir
from schemas.manifest import GymCommit, ParticipantCommit, PartReceipt
from snapformat import layout
from snapformat.adopt import adopt_part, check_part, materialize_part
from snapformat.draft import SnapshotDraft
from snapformat.mounts import mount_of
from snapformat.reader import Snapshot

if TYPE_CHECKING:
    from gymkit.gym_fleet import CommitResult

log = logging.getLogger("coordinator.checkpoint.gym_parts")

GYM_FOLDER = "gym"
STAGING_MAX_AGE_S = 24 * 3600

def part_prefix(component: str, name: str) -> str:
    """The part prefix of a participant's files inside the snapshot: ``gym/<its folder>``."""
    return f"{GYM_FOLDER}/{participant_dir(component, name)}"


@dataclass(frozen=True)
class CheckpointDir:
    """Where Gym writes (save) or reads (restore): ``path``, and whether it is a staging copy to
    remove afterwards (``staging``)."""

    path: str
    staging: bool

    def cleanup(self) -> None:
        if self.staging:
            shutil.rmtree(Path(self.path).parent, ignore_errors=True)


def staging_base(root: str | None) -> Path:
    """The folder staging folders are made in: ``root``, else the system's temporary folder's
    ``gym-checkpoint-staging``."""
    return Path(root) if root else Path(tempfile.gettempdir()) / "gym-checkpoint-staging"


def staged_in_memory(root: str | None) -> bool:
    """Whether staging under ``root`` keeps Gym's files in memory (a tmpfs or ramfs mount), where
    their fsyncs cost nothing; ``ControllerConfig.gym_staging="always"`` gains nothing otherwise."""
    base = staging_base(root)
    folder = next((p for p in (base, *base.parents) if p.exists()), base)  # the mount of what will hold it
    mount = mount_of(folder)
    return mount is not None and mount.in_memory


def _staging(root: str | None, name: str) -> Path:
    base = staging_base(root)
    base.mkdir(parents=True, exist_ok=True)
    _sweep(base)
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    (folder / GYM_FOLDER).mkdir()
    return folder / GYM_FOLDER


def _sweep(base: Path) -> None:
    """Staging folders a crashed save or restore left behind, older than a day."""
    cutoff = time.time() - STAGING_MAX_AGE_S
    for p in base.iterdir():
        try:
            if p.is_dir() and p.stat().st_mtime < cutoff:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def save_dir(draft: SnapshotDraft, staging_root: str | None = None, *, always_stage: bool = False) -> CheckpointDir:
    """The ``checkpoint_dir`` of a save: the draft's ``gym/`` folder on a local store, else a
    staging folder under ``staging_root``. ``always_stage``: a staging folder whatever the store
    (``ControllerConfig.gym_staging`` ``"always"``: a RAM-backed ``staging_root`` keeps the disk out
    of the pause)."""
    local = None if always_stage else draft.store.local_path(layout.file_key(draft.snapshot_id, GYM_FOLDER))
    if local is not None:
        Path(local).mkdir(parents=True, exist_ok=True)
        return CheckpointDir(path=local, staging=False)
    return CheckpointDir(path=str(_staging(staging_root, draft.snapshot_id)), staging=True)


def adopt(draft: SnapshotDraft, checkpoint_dir: CheckpointDir,
          participants: Iterable[tuple[str, str]]) -> list[PartReceipt]:
    """Each participant's folder (``(component, name)``, in commit order) as a part of the draft.
    A participant that wrote no folder (stateless) has no part."""
    receipts = []
    for component, name in participants:
        folder = Path(checkpoint_dir.path) / participant_dir(component, name)
        if not folder.is_dir():
            continue
        receipts.append(adopt_part(draft.url, str(folder), part_prefix(component, name), writer=f"{component}:{name}"))
    return receipts


@dataclass(frozen=True)
class GymParts:
    """Gym's commit as the publisher needs it: the receipts of the adopted parts and the manifest's
    ``gym_commit``."""

    receipts: list[PartReceipt]
    gym_commit: GymCommit


def adopt_commit(draft: SnapshotDraft, checkpoint_dir: CheckpointDir, commit: CommitResult) -> GymParts:
    """Adopt every committed participant's folder (``checkpoint_dir`` on this host) and record Gym's
    commit (:func:`gym_commit`)."""
    receipts = adopt(draft, checkpoint_dir, [(p.component, p.name) for p in commit.participants])
    return GymParts(receipts, gym_commit(commit, receipts))


def gym_commit(commit: CommitResult, receipts: Iterable[PartReceipt]) -> GymCommit:
    """The manifest's record of Gym's commit: per participant (commit order), its component and
    name, its part's prefix and part manifest checksum (from ``receipts``: adopted here, or handed
    back by ``snapformat adopt`` on the participant's host), and its commit reply verbatim as
    ``payload``."""
    by_prefix = {r.prefix: r for r in receipts}
    participants = []
    for p in commit.participants:
        receipt = by_prefix.get(part_prefix(p.component, p.name))
        participants.append(ParticipantCommit(
            component=p.component, name=p.name, part_prefix=None if receipt is None else receipt.prefix,
            part_manifest_checksum=None if receipt is None else receipt.part_manifest_checksum,
            payload=msgspec.to_builtins(p.reply)))
    return GymCommit(checkpoint_id=commit.checkpoint_id, participants=participants)


def restore_dir(snap: Snapshot, prefixes: Iterable[str], staging_root: str | None = None) -> CheckpointDir:
    """The ``checkpoint_dir`` of a restore from ``snap``: its own ``gym/`` folder on a local store
    (each part ``prefixes`` checked where it lies), else a staging folder holding those parts
    (downloaded and verified)."""
    local = snap.store.local_path(layout.file_key(snap.manifest.snapshot_id, GYM_FOLDER))
    if local is not None:
        for prefix in prefixes:  # Gym reads these bytes in place: only after they are the snapshot's own
            check_part(snap, prefix)
        return CheckpointDir(path=local, staging=False)
    target = _staging(staging_root, f"restore-{snap.manifest.snapshot_id}")
    try:
        for prefix in prefixes:
            rel = prefix.removeprefix(f"{GYM_FOLDER}/")
            materialize_part(snap, prefix, str(target / rel))
    except BaseException:
        shutil.rmtree(target.parent, ignore_errors=True)
        raise
    return CheckpointDir(path=str(target), staging=True)
