"""Gym's plain files as a snapshot's Gym parts (issue 20, item 3): a participant that knows nothing
of snapformat writes Gym's files into its ``checkpoint_dir``; ``adopt`` checks Gym's manifests
against the bytes and makes each folder a part (in place on local disk, uploaded to SeaweedFS from
another "host"); ``cat``/``show``/``verify`` see them; ``materialize`` brings them back byte-equal."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gymkit import checkpoint_dir as cd
from schemas.errors import CorruptSnapshotError, InvalidPathError, NotPublishedError
from schemas.gym_files import (
    CONTINUATIONS_NAME,
    MANIFEST_NAME,
    AgentBoundaryRecord,
    ExternalStorageReference,
    ResourceSnapshot,
    agent_instance_dir,
)
from schemas.manifest import ListedPart, PartReceipt
from schemas.version import PART_LISTINGS
from snapformat import SnapshotStore, open_store
from snapformat.adopt import adopt_gym_dir, adopt_part, check_part, gym_folders, materialize_gym, materialize_part
from snapformat.cli import main
from snapformat.verify import verify_snapshot

AGENT = agent_instance_dir("agent0")


def write_gym_files(checkpoint_dir: Path, n: int = 4) -> None:
    """What three Gym participants write at a commit (the plain-files writer of gymkit)."""
    records = [AgentBoundaryRecord(rollout_id=f"r{i}", attempt_index=i % 2, boundary_index=2,
                                   last_committed_model_call_id=f"call-{i}", resource_state_revisions={"tools": i})
               for i in range(n)]
    _, _ = cd.write_agent_dir(checkpoint_dir, "ckpt-1", "agent0", records)
    _, _, roots = cd.read_agent_dir(checkpoint_dir / AGENT)
    cd.write_ledger_dir(checkpoint_dir, "ckpt-1", "policy0",
                        lineages={r.capture_key: f'{{"call":"{r.last_committed_model_call_id}"}}\n'.encode() for r in roots},
                        storage_references=[ExternalStorageReference(capture_key=r.capture_key,
                                                                     boundary_model_call_id=r.last_committed_model_call_id,
                                                                     key=f"staging/{r.capture_key}") for r in roots],
                        roots=roots)
    cd.write_resources_dir(checkpoint_dir, "ckpt-1", "tools",
                           [ResourceSnapshot(rollout_id=f"r{i}", attempt_index=i % 2, state_revision=i, state={"i": i})
                            for i in range(n)])


def snapshot_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- local disk: the participant writes inside the draft --------------------------------------------------
def test_local_files_are_adopted_in_place_published_and_read_by_the_cli(tmp_path: Path, capsys) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    gym = Path(draft.url) / "gym"
    write_gym_files(gym)
    before = {rel: (gym / rel).stat().st_ino for rel in snapshot_files(gym)}
    assert gym_folders(str(gym)) == [AGENT, "model-ledger/policy0", "resources/tools"]
    receipts = adopt_gym_dir(draft.url, str(gym))
    assert [r.prefix for r in receipts] == [f"gym/{AGENT}", "gym/model-ledger/policy0", "gym/resources/tools"]
    after = {rel: (gym / rel).stat().st_ino for rel in snapshot_files(gym) if not rel.endswith("part-manifest.json")}
    assert after == before  # hashed where they lie: nothing copied, nothing rewritten
    published = draft.publish(receipts=receipts)
    snap = store.latest()
    assert verify_snapshot(snap).ok
    gym_entries = snap.files("gym_file")
    assert {f.path for f in gym_entries} == {f"gym/{rel}" for rel in before}
    by_name = {f.path.rsplit("/", 1)[-1]: f for f in gym_entries}
    assert by_name[CONTINUATIONS_NAME].records == 4 and by_name["agent-part-000000.tar"].records == 4
    assert by_name["agent-index.jsonl"].records == 4 and by_name[MANIFEST_NAME].records == 1

    # cat prints Gym's own continuation lines, byte for byte
    code, out, _ = run(capsys, "cat", published.url, "continuations")
    assert code == 0 and out.encode() == (gym / AGENT / CONTINUATIONS_NAME).read_bytes()
    code, out, _ = run(capsys, "cat", published.url, "continuations", "--limit", "1")
    assert code == 0 and len(out.splitlines()) == 1
    path = f"gym/{AGENT}/agent-index.jsonl"
    code, out, _ = run(capsys, "cat", published.url, path)
    assert code == 0 and out.encode() == (gym / AGENT / "agent-index.jsonl").read_bytes()
    code, _, err = run(capsys, "cat", published.url, f"gym/{AGENT}/agent-part-000000.tar")
    assert code == 2 and "archive" in err

    # show lists Gym's parts with their record counts
    code, out, _ = run(capsys, "show", published.url, "--json")
    parts = {p["prefix"]: p for p in json.loads(out)["gym_parts"]}
    assert parts[f"gym/{AGENT}"]["component"] == "agent"
    assert parts[f"gym/{AGENT}"]["records"] == {"records": 4, "archives": 1, "continuations": 4}
    assert parts["gym/model-ledger/policy0"]["records"] == {"rollouts": 4, "lineage_rows": 4, "storage_references": 4}
    assert parts["gym/resources/tools"]["records"] == {"sessions": 4}
    code, out, _ = run(capsys, "show", published.url)
    assert code == 0 and "gym parts:" in out and "4 continuations" in out


def test_adopting_again_gives_the_same_receipt_and_other_files_are_refused(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    gym = Path(draft.url) / "gym"
    write_gym_files(gym)
    first = adopt_part(draft.url, str(gym / "resources/tools"), "gym/resources/tools", "resources:tools")
    again = adopt_part(draft.url, str(gym / "resources/tools"), "gym/resources/tools", "resources:tools")
    assert first == again
    cd.write_resources_dir(gym, "ckpt-2", "tools", [ResourceSnapshot(rollout_id="z", attempt_index=0, state_revision=0)])
    with pytest.raises(InvalidPathError, match="already adopted with other files"):
        adopt_part(draft.url, str(gym / "resources/tools"), "gym/resources/tools", "resources:tools")


def test_a_staging_folder_is_copied_into_a_local_draft(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    write_gym_files(staging)
    (staging / AGENT / ".tmp-0123").write_bytes(b"left by a crash")  # never a file of the part
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    receipts = adopt_gym_dir(draft.url, str(staging), writer="host-b")
    published = draft.publish(receipts=receipts)
    copied = Path(published.url) / "gym"
    theirs = {k: v for k, v in snapshot_files(copied).items() if not k.endswith("part-manifest.json")}
    ours = {k: v for k, v in snapshot_files(staging).items() if ".tmp-" not in k}
    assert theirs == ours
    assert {f.writer for f in published.manifest.files} == {"host-b"}


def test_large_files_are_streamed_and_an_interrupted_adoption_can_be_repeated(tmp_path: Path, monkeypatch) -> None:
    from snapformat import adopt

    staging = tmp_path / "staging"
    write_gym_files(staging)
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    monkeypatch.setattr(adopt, "WHOLE_UPLOAD_MAX", 0)  # every file takes the streaming path
    folder = staging / "model-ledger/policy0"
    first = adopt_part(draft.url, str(folder), "gym/model-ledger/policy0")
    key = f"snapshots/{draft.snapshot_id}/gym/model-ledger/policy0/part-manifest.json"
    store.store.delete(key)  # as if the first run died before its part manifest
    monkeypatch.setattr(adopt, "WHOLE_UPLOAD_MAX", 16 << 20)  # now the create-only write meets the files
    again = adopt_part(draft.url, str(folder), "gym/model-ledger/policy0")
    assert again.prefix == first.prefix
    published = draft.publish(receipts=[again])
    assert {k: v for k, v in snapshot_files(Path(published.url) / "gym/model-ledger/policy0").items()
            if k != "part-manifest.json"} == snapshot_files(folder)
    # A key that holds other bytes is never overwritten.
    other = store.begin()
    (Path(other.url) / "gym/resources/tools").mkdir(parents=True)
    (Path(other.url) / "gym/resources/tools/r0.a0.json").write_bytes(b"{}")
    with pytest.raises(InvalidPathError, match="r0.a0.json: already exists with other bytes"):
        adopt_part(other.url, str(staging / "resources/tools"), "gym/resources/tools")


def test_small_files_are_created_in_bounded_batches_keeping_what_an_earlier_run_created(
        tmp_path: Path, monkeypatch) -> None:
    from snapformat import adopt
    from snapformat.store import LocalStore

    staging = tmp_path / "staging"
    write_gym_files(staging, n=20)
    folder = staging / "model-ledger/policy0"  # 20 lineage files, the references and the manifest
    names = sorted(snapshot_files(folder))
    monkeypatch.setattr(adopt, "BATCH_FILES", 3)
    monkeypatch.setattr(adopt, "BATCH_BYTES", 60)  # a lineage file is ~20 bytes: some batches end on bytes
    batches: list[list[str]] = []
    real = LocalStore.create_exclusive_many

    def recording(self: LocalStore, items):  # type: ignore[no-untyped-def]
        batches.append([k for k, _ in items])
        return real(self, items)

    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    monkeypatch.setattr(LocalStore, "create_exclusive_many", recording)
    target = Path(draft.url) / "gym/model-ledger/policy0"
    target.mkdir(parents=True)
    for name in names[:4]:  # as if an earlier adoption had died after creating these
        (target / name).write_bytes((folder / name).read_bytes())
    receipt = adopt_part(draft.url, str(folder), "gym/model-ledger/policy0")
    created = [k.rsplit("/", 1)[-1] for batch in batches for k in batch]
    assert sorted(created[:-1]) == names and created[-1] == "part-manifest.json"  # each file once, then the part's
    assert all(len(b) <= 3 for b in batches) and any(len(b) < 3 for b in batches[:-1])
    sizes = {n: (folder / n).stat().st_size for n in names}
    assert all(len(b) == 1 or sum(sizes[k.rsplit("/", 1)[-1]] for k in b) <= 60 for b in batches[:-1])
    published = draft.publish(receipts=[receipt])
    assert {k: v for k, v in snapshot_files(Path(published.url) / "gym/model-ledger/policy0").items()
            if k != "part-manifest.json"} == snapshot_files(folder)


def test_bytes_that_change_after_the_check_are_refused(tmp_path: Path) -> None:
    from snapformat import adopt
    from snapformat.gym_dir import scan_file

    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a":1}\n')
    facts = scan_file(path)
    path.write_bytes(b'{"a":2}\n')
    store = open_store(str(tmp_path / "store"))
    with pytest.raises(CorruptSnapshotError, match="changed while it was being adopted"):
        adopt._create(store, "k/f.jsonl", path, facts)
    with pytest.raises(CorruptSnapshotError, match="changed while it was being adopted"):
        adopt._create_batch(store, [("k/f.jsonl", path, facts)])
    path.write_bytes(b'{"a":1}\n' * 3000000)
    big = scan_file(path)
    with open(path, "r+b") as fh:
        fh.write(b'{"a":2}')
    with pytest.raises(CorruptSnapshotError, match="changed while it was being adopted"):
        adopt._create(store, "k/big.jsonl", path, big)
    assert not store.exists("k/f.jsonl") and not store.exists("k/big.jsonl")


# -- refusals: nothing is published ----------------------------------------------------------------------------
def _tamper_continuations(gym: Path) -> Path:
    path = gym / AGENT / CONTINUATIONS_NAME
    data = bytearray(path.read_bytes())
    data[5] ^= 0x20  # same size, another byte
    path.write_bytes(bytes(data))
    return path


def test_a_manifest_digest_mismatch_is_refused_and_nothing_is_published(tmp_path: Path, capsys) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    gym = Path(draft.url) / "gym"
    write_gym_files(gym)
    path = _tamper_continuations(gym)
    with pytest.raises(CorruptSnapshotError, match=rf"{path}: sha256 is [0-9a-f]{{64}}, .*manifest.json: "
                                                   r"continuation_index\.sha256 expects"):
        adopt_part(draft.url, str(gym / AGENT), f"gym/{AGENT}")
    assert not (gym / AGENT / "part-manifest.json").exists()
    code, _, err = run(capsys, "adopt", str(gym / AGENT), draft.url, f"gym/{AGENT}")
    assert code == 1 and "continuation_index.sha256" in err
    assert store.latest() is None


@pytest.mark.parametrize("case", ["archive", "index_bytes", "ledger_rows", "resources_missing", "no_manifest",
                                  "wrong_instance", "escaping_ref"])
def test_every_gym_promise_is_checked_before_adoption(tmp_path: Path, case: str) -> None:
    staging = tmp_path / "staging"
    write_gym_files(staging)
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    folder, prefix, error, match = staging / AGENT, f"gym/{AGENT}", CorruptSnapshotError, ""
    if case == "archive":
        tar = folder / "agent-part-000000.tar"
        tar.write_bytes(tar.read_bytes()[:-512])
        match = r"agent-part-000000.tar: sha256 is"
    elif case == "index_bytes":
        (folder / "agent-index.jsonl").write_bytes((folder / "agent-index.jsonl").read_bytes() + b"\n")
        match = r"agent-index.jsonl: bytes is \d+, .*record_index\.bytes expects"
    elif case == "ledger_rows":
        folder, prefix = staging / "model-ledger/policy0", "gym/model-ledger/policy0"
        raw = json.loads((folder / MANIFEST_NAME).read_bytes())
        raw["rollouts"]["r0"]["rows"] = 7
        (folder / MANIFEST_NAME).write_bytes(json.dumps(raw, sort_keys=True, indent=1).encode())
        match = r"rollouts\['r0'\]\.rows: its files hold 1 non-blank lines, expected 7"
    elif case == "resources_missing":
        folder, prefix = staging / "resources/tools", "gym/resources/tools"
        (folder / "r1.a1.json").unlink()
        match = r"r1.a1.json: missing, but .*files\['r1.a1.json'\] lists it"
    elif case == "no_manifest":
        (folder / MANIFEST_NAME).unlink()
        match = "manifest.json: missing, but part .* is Gym's agent folder"
    elif case == "wrong_instance":
        prefix, error = f"gym/{agent_instance_dir('agent1')}", InvalidPathError
        match = "belongs in 'agent/instance-.*but the folder is adopted as 'agent/instance-"
    elif case == "escaping_ref":
        raw = json.loads((folder / MANIFEST_NAME).read_bytes())
        raw["continuation_index"]["relative_path"] = "resources/tools/r1.a1.json"
        (folder / MANIFEST_NAME).write_bytes(json.dumps(raw, sort_keys=True, indent=2).encode())
        error, match = InvalidPathError, r"continuation_index\.relative_path: .* lies outside the participant's folder"
    with pytest.raises(error, match=match):
        adopt_part(draft.url, str(folder), prefix)
    assert not (Path(draft.url) / "gym").exists()
    assert store.latest() is None


def test_plain_files_under_another_prefix_and_a_sealed_draft(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    (folder / "deep").mkdir(parents=True)
    (folder / "a.jsonl").write_bytes(b'{"x":1}\n\n{"x":2}\n')
    (folder / "deep" / "b.txt").write_bytes(b"")
    (folder / MANIFEST_NAME).write_bytes(b'{"not": "gym"}')
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    receipt = adopt_part(draft.url, str(folder), "extra/notes")
    published = draft.publish(receipts=[receipt])
    # Listed by its part manifest (SPEC §10.4): the manifest names that and the totals, not each file.
    assert [f.path for f in published.manifest.files] == ["extra/notes/part-manifest.json"]
    assert published.manifest.listed_parts == [ListedPart(prefix="extra/notes", files=3, bytes=31)]
    assert published.manifest.required_features == [PART_LISTINGS]
    files = {f.path: f.records for f in store.open(published.manifest.sequence).files()}
    assert files == {"extra/notes/a.jsonl": 2, "extra/notes/deep/b.txt": 1, "extra/notes/manifest.json": 1,
                     "extra/notes/part-manifest.json": 1}
    with pytest.raises(InvalidPathError, match="already sealed"):
        adopt_part(published.url, str(folder), "extra/again")
    # A restore's check where it lies: a plain part with a manifest.json that is not Gym's, then one without
    snap = store.latest()
    where = Path(check_part(snap, "extra/notes"))
    (where / "a.jsonl").write_bytes(b'{"x":1}\n\n{"x":3}\n')  # same size, another byte
    corrupt = r"size (\d+), checksum xxh128:[0-9a-f]+; the part manifest lists size \1"
    with pytest.raises(CorruptSnapshotError, match=r"a\.jsonl: " + corrupt):
        check_part(snap, "extra/notes")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "c.txt").write_bytes(b"c")
    other = store.begin()
    snap = SnapshotStore(str(tmp_path / "store")).open(other.publish(
        receipts=[adopt_part(other.url, str(plain), "extra/plain")]).manifest.sequence)
    (Path(check_part(snap, "extra/plain")) / "c.txt").write_bytes(b"d")
    with pytest.raises(CorruptSnapshotError, match=r"c\.txt: " + corrupt):
        check_part(snap, "extra/plain")
    (folder / ".hidden").write_bytes(b"x")
    with pytest.raises(InvalidPathError, match="not a safe name"):
        adopt_part(store.begin().url, str(folder), "extra/notes")


# -- verify and materialize -------------------------------------------------------------------------------------
def test_verify_counts_gym_records_and_materialize_comes_back_byte_equal(tmp_path: Path, rewrite_entry) -> None:
    staging = tmp_path / "staging"
    write_gym_files(staging)
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    published = draft.publish(receipts=adopt_gym_dir(draft.url, str(staging)))
    restored = tmp_path / "restore"
    prefixes = materialize_gym(published.url, str(restored))
    assert prefixes == [f"gym/{p}" for p in gym_folders(str(staging))]
    assert snapshot_files(restored) == snapshot_files(staging)
    assert cd.read_agent_dir(restored / AGENT)[0] == cd.read_agent_dir(staging / AGENT)[0]
    assert materialize_gym(published.url, str(restored)) == prefixes  # again: files kept
    (restored / "resources/tools/stray.json").write_bytes(b"{}")
    with pytest.raises(InvalidPathError, match="does not list"):
        materialize_part(published.url, "gym/resources/tools", str(restored / "resources/tools"))
    with pytest.raises(NotPublishedError, match="has no part"):
        materialize_part(published.url, "gym/resources/other", str(tmp_path / "x"))

    # A stored byte flipped: verify names the file, materialize writes nothing of it.
    victim = Path(published.url) / "gym/model-ledger/policy0/storage-references.jsonl"
    data = bytearray(victim.read_bytes())
    data[3] ^= 0x01
    victim.write_bytes(bytes(data))
    report = verify_snapshot(store.latest())
    assert [p.file for p in report.problems] == ["gym/model-ledger/policy0/storage-references.jsonl"]
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        materialize_part(published.url, "gym/model-ledger/policy0", str(tmp_path / "again"))
    assert not (tmp_path / "again" / "storage-references.jsonl").exists()
    victim.write_bytes(bytes(data[:3]) + bytes([data[3] ^ 0x01]) + bytes(data[4:]))

    # A record count the part manifest gets wrong (bound again by the manifest) is named by verify.
    (continuations,) = [f.path for f in store.latest().files() if f.path.endswith(CONTINUATIONS_NAME)]
    rewrite_entry(tmp_path / "store", published.manifest.sequence, continuations, records=9)
    problems = verify_snapshot(store.latest()).problems
    assert len(problems) == 1 and "has 4 records, the manifest says 9" in problems[0].message


# -- another host, SeaweedFS ---------------------------------------------------------------------------------
def test_a_remote_host_adopts_its_folder_into_a_draft_on_seaweedfs(seaweed, aws_env, new_bucket, tmp_path: Path,
                                                                    capsys) -> None:
    """Host A publishes; host B (another process, its own disk, the store over loopback) writes Gym's
    files where it can and runs ``snapformat adopt ... --json``; its receipts go into A's publish."""
    aws_env(seaweed)
    url = f"s3://{new_bucket(seaweed)}/run"
    store = SnapshotStore(url)
    draft = store.begin()
    host_b = tmp_path / "host-b"
    write_gym_files(host_b / "checkpoint", n=6)
    env = {**os.environ, **seaweed.env_vars(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    receipts = []
    for rel in gym_folders(str(host_b / "checkpoint")):
        done = subprocess.run([sys.executable, "-m", "snapformat", "adopt", str(host_b / "checkpoint" / rel), draft.url,
                               f"gym/{rel}", "--writer", "host-b", "--json"],
                              check=False, cwd=host_b, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        receipts.append(msgspec.json.decode(done.stdout, type=PartReceipt))
    assert all(r.writer == "host-b" for r in receipts)
    published = draft.publish(receipts=receipts)
    snap = store.latest()
    assert verify_snapshot(snap).ok
    code, out, _ = run(capsys, "cat", published.url, "continuations")
    assert code == 0 and out.encode() == (host_b / "checkpoint" / AGENT / CONTINUATIONS_NAME).read_bytes()

    # Restoring from the object store: the Gym parts come back as a plain checkpoint_dir, byte-equal.
    restored = tmp_path / "host-c" / "checkpoint"
    materialize_gym(snap, str(restored))
    cmp = filecmp.dircmp(host_b / "checkpoint", restored)
    assert snapshot_files(restored) == snapshot_files(host_b / "checkpoint"), cmp.report()
    manifest, records, roots = cd.read_agent_dir(restored / AGENT)
    assert manifest.records == len(records) == 6 and len(roots) == 6

    # A tampered folder is refused before a byte is uploaded, and nothing is published.
    draft2 = store.begin()
    _tamper_continuations(host_b / "checkpoint")
    code, _, err = run(capsys, "adopt", str(host_b / "checkpoint" / AGENT), draft2.url, f"gym/{AGENT}")
    assert code == 1 and "CorruptSnapshotError" in err and "continuation_index.sha256" in err
    assert list(open_store(url).walk(f"snapshots/{draft2.snapshot_id}")) == []
    assert store.latest().manifest.snapshot_id == published.manifest.snapshot_id


def test_cli_adopt_prints_the_receipt(tmp_path: Path, capsys) -> None:
    staging = tmp_path / "staging"
    write_gym_files(staging)
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    code, out, _ = run(capsys, "adopt", str(staging / "resources/tools"), draft.url, "gym/resources/tools", "--json")
    assert code == 0
    receipt = msgspec.json.decode(out, type=PartReceipt)
    assert (receipt.prefix, receipt.writer) == ("gym/resources/tools", "gym/resources/tools")
    code, out, _ = run(capsys, "adopt", str(staging / "model-ledger/policy0"), draft.url, "gym/model-ledger/policy0",
                       "--writer", "model:policy0")
    assert code == 0 and "adopted" in out and "gym/model-ledger/policy0" in out and "model:policy0" in out
    assert draft.publish(receipts=[receipt]).manifest.files
