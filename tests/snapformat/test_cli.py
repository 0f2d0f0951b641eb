"""The ``snapformat`` command: every subcommand, its ``--json`` output and its exit codes.

Most cases call ``main()`` in-process (fast); a few run the installed command as a real process
to prove the entry point, ``python -m snapformat`` and the exit codes seen by a shell. With shared
objects: ``show`` says the bytes new in a snapshot and shared with its parent (all new when the
parent is gone), ``verify`` of a store hashes each object once and names every snapshot and file
that references a bad one, and ``gc`` reports what it swept and kept and why, takes ``--grace``,
refuses one shorter than ``--min-age``, and says why it swept no object.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from snapformat import SnapshotStore, layout, open_snapshot
from snapformat.cli import main
from snapformat.example import AGENT, MODEL, TOPOLOGY, gym_prefix, write_example, write_legacy_example
from tests.snapformat.chains import Chain


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "store"
    s = SnapshotStore(str(root))
    for seed in (1, 2):
        draft = s.begin()
        gym, receipts = write_example(draft, count=40, seed=seed)
        draft.publish(receipts=receipts, gym_commit=gym, topology_fingerprint=TOPOLOGY)
    return root


@pytest.fixture(scope="module")
def legacy_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot of the format 1.0/1.1 layout: Gym parts of this project's own record kinds."""
    root = tmp_path_factory.mktemp("cli-legacy") / "store"
    draft = SnapshotStore(str(root)).begin()
    gym, receipts = write_legacy_example(draft, count=40, seed=1)
    draft.publish(receipts=receipts, gym_commit=gym)
    return root


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def latest_url(store: Path) -> str:
    snap = SnapshotStore(str(store)).latest()
    assert snap is not None
    return snap.url


def test_ls_lists_newest_first_with_json(store: Path, capsys) -> None:
    code, out, _ = run(capsys, "ls", str(store), "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["sequence"] for r in rows] == [2, 1]
    assert rows[0]["url"] == latest_url(store)
    assert all(r["topology_fingerprint"] == TOPOLOGY and r["bytes"] > 0 for r in rows)
    code, out, _ = run(capsys, "ls", str(store))
    assert code == 0 and latest_url(store) in out.splitlines()[0]


def test_ls_of_a_folder_of_stores_lists_each_store_and_its_newest(store: Path, tmp_path: Path, capsys) -> None:
    # What `make demo` leaves: demo-store/run-<time>/ stores, and a folder of them is not a store.
    runs = tmp_path / "demo-store"
    runs.mkdir()
    (runs / "run-1").symlink_to(store, target_is_directory=True)
    SnapshotStore(str(runs / "run-2")).begin()  # a store whose first save never published
    (runs / "notes").mkdir()  # neither a store nor a problem
    code, out, _ = run(capsys, "ls", str(runs), "--json")
    assert code == 0
    rows = {Path(r["store"]).name: r for r in json.loads(out)}
    assert sorted(rows) == ["run-1", "run-2"]
    assert (rows["run-1"]["snapshots"], rows["run-1"]["newest_sequence"]) == (2, 2)
    assert rows["run-1"]["newest_url"].endswith(Path(latest_url(store)).name)
    assert (rows["run-2"]["snapshots"], rows["run-2"]["newest_sequence"]) == (0, None)
    code, out, _ = run(capsys, "ls", str(runs))
    assert code == 0 and "holds 2 store(s)" in out and "no published snapshot" in out


def test_show_by_url_and_by_store(store: Path, capsys) -> None:
    code, out, _ = run(capsys, "show", latest_url(store), "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["sequence"] == 2 and shown["parent"]["sequence"] == 1
    assert shown["kinds"]["gym_file"]["records"] > 0
    parts = {g["prefix"]: g for g in shown["gym_parts"]}
    assert parts[gym_prefix("responses_api_agents", AGENT)]["records"]["continuations"] > 0
    assert parts[gym_prefix("responses_api_models", MODEL)]["records"]["lineage_rows"] > 0
    assert {p["name"] for p in shown["gym_commit"]["participants"]} == {"agent0", "policy0", "tools"}
    code, out2, _ = run(capsys, "show", str(store), "--json")
    assert code == 0 and json.loads(out2)["snapshot_id"] == shown["snapshot_id"]
    code, text, _ = run(capsys, "show", latest_url(store))
    assert code == 0 and "token_capture_rows" in text and "sequence 2" in text
    assert "gym parts:" in text and gym_prefix("responses_api_agents", AGENT) in text


def test_show_of_the_legacy_layout_lists_its_record_kinds(legacy_store: Path, capsys) -> None:
    code, out, _ = run(capsys, "show", str(legacy_store), "--json")
    assert code == 0
    shown = json.loads(out)
    assert all(shown["kinds"][kind]["records"] > 0 for kind in (
        "continuations", "agent_state", "model_ledger", "token_index", "session_state", "token_capture_rows"))
    assert shown["gym_parts"] == []  # no file of Gym's own: nothing to summarise as a Gym folder


def test_verify_ok_then_fails_naming_the_corrupt_file(tmp_path: Path, capsys) -> None:
    s = SnapshotStore(str(tmp_path / "store"))
    draft = s.begin()
    gym, receipts = write_example(draft, count=30, seed=3)
    published = draft.publish(receipts=receipts, gym_commit=gym)
    code, out, _ = run(capsys, "verify", published.url, "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    victim = next(f for f in open_snapshot(published.url).files() if f.path.endswith(".lineage.jsonl"))  # Gym's model ledger
    path = Path(published.url) / victim.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", published.url)
    assert code == 1
    assert victim.path in err and "checksum" in err
    code, out, _ = run(capsys, "verify", published.url, "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert [p["file"] for p in report["problems"]] == [victim.path]


def test_cat_records_rows_and_csv(store: Path, capsys) -> None:
    url = latest_url(store)
    code, out, _ = run(capsys, "cat", url, "continuations")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and lines
    assert set(lines[0]) == {"schema_version", "rollout_id", "attempt_index", "capture_key",
                             "last_committed_model_call_id", "resource_state_revisions"}
    code, out, _ = run(capsys, "cat", url, "tokens", "--limit", "3")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 3
    assert len(rows[0]["generation_token_ids"]) == len(rows[0]["generation_log_probs"])
    code, out, _ = run(capsys, "cat", url, "training", "--format", "csv", "--limit", "2")
    table = list(csv.reader(io.StringIO(out)))
    assert code == 0 and table[0][:3] == ["key", "partition_id", "rollout_id"] and len(table) == 3
    assert json.loads(table[1][table[0].index("input_ids")])  # list columns are JSON text
    code, out, _ = run(capsys, "cat", url, "controller/loader.json")
    assert code == 0 and json.loads(out)["consumed"] > 0


def test_export_parquet_queryable_by_duckdb(store: Path, tmp_path: Path, capsys) -> None:
    url = latest_url(store)
    out_file = tmp_path / "training.parquet"
    code, out, _ = run(capsys, "export", url, "training", str(out_file), "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    expected = SnapshotStore(str(store)).latest().read_table("training").num_rows
    assert rows == expected
    con = duckdb.connect()
    got = con.execute(f"select count(*), min(len(input_ids)) from read_parquet('{out_file}')").fetchone()
    assert got[0] == expected and got[1] > 0
    replay = tmp_path / "replay.parquet"
    code, _, _ = run(capsys, "export", url, "replay", str(replay))
    assert code == 0
    assert con.execute(f"select count(distinct rollout_id) from read_parquet('{replay}')").fetchone()[0] > 0


def test_export_a_record_kind_of_the_legacy_layout(legacy_store: Path, tmp_path: Path, capsys) -> None:
    ledger = tmp_path / "ledger.parquet"
    code, _, _ = run(capsys, "export", str(legacy_store), "ledger", str(ledger))
    assert code == 0
    assert duckdb.connect().execute(f"select count(distinct capture_key) from read_parquet('{ledger}')").fetchone()[0] > 0


def test_gc_json_reports_swept_drafts(tmp_path: Path, capsys) -> None:
    s = SnapshotStore(str(tmp_path / "store"))
    for seed in (1, 2, 3):
        d = s.begin()
        gym, receipts = write_example(d, count=10, seed=seed)
        d.publish(receipts=receipts, gym_commit=gym)
    orphan = s.begin()
    write_example(orphan, count=5, seed=9)
    code, out, _ = run(capsys, "gc", str(tmp_path / "store"), "--keep", "2", "--min-age", "0", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["kept"] == [3, 2]
    assert len(report["deleted_snapshots"]) == 1 and report["swept_drafts"] == [orphan.snapshot_id]
    assert not Path(orphan.url).exists()


@pytest.mark.parametrize("args", [
    ["show", "{missing}"],
    ["verify", "{store}/snapshots/snap-0000000009-00000000"],
    ["ls", "{missing}"],
])
def test_missing_store_or_snapshot_exits_1(store: Path, tmp_path: Path, capsys, args: list[str]) -> None:
    args = [a.format(missing=tmp_path / "nowhere", store=store) for a in args]
    code, _, err = run(capsys, *args)
    assert code == 1 and ("not" in err)


@pytest.mark.parametrize("args", [
    [],
    ["frobnicate"],
    ["cat", "{url}", "no-such-part"],
    ["export", "{url}", "training", "out.csv"],
    ["cat", "{url}", "replay", "--format", "csv"],
    ["cat", "{url}", "continuations", "--format", "csv"],
    ["cat", "{url}"],
])
def test_bad_usage_exits_2(store: Path, capsys, args: list[str]) -> None:
    args = [a.format(url=latest_url(store)) for a in args]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(args))
    assert exc.value.code == 2


def test_real_process_entry_points_and_exit_codes(store: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("snapformat")
    for cmd in ([str(exe)], [sys.executable, "-m", "snapformat"]):
        ok = subprocess.run(cmd + ["verify", latest_url(store), "--json"], capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["ok"] is True
        missing = subprocess.run(cmd + ["show", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
        assert missing.returncode == 1 and "snapformat-store.json" in missing.stderr
        usage = subprocess.run(cmd + ["ls"], capture_output=True, text=True, timeout=120)
        assert usage.returncode == 2


# -- incremental snapshots (shared objects) -----------------------------------------------------------

def _age_objects(root: Path, seconds: float) -> None:
    then = time.time() - seconds
    for p in (root / layout.OBJECTS).rglob("*"):
        if p.is_file():
            os.utime(p, (then, then))


@pytest.fixture(scope="module")
def incremental_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sequence 1 writes two row objects; 2 lists the second again and writes one of its own."""
    root = tmp_path_factory.mktemp("cli-incremental") / "store"
    chain = Chain(SnapshotStore(str(root)))
    chain.publish(new=2)
    chain.publish(new=1, drop=1)
    return root


def test_show_says_bytes_new_and_shared_with_the_parent(incremental_store: Path, capsys) -> None:
    store = SnapshotStore(str(incremental_store))
    first, second = store.open(1).manifest, store.open(2).manifest
    parent_objects = {f.object for f in first.files if f.object}
    shared = {f.object: f.size for f in second.files if f.object in parent_objects}
    total = second.total_bytes
    code, out, _ = run(capsys, "show", str(incremental_store), "--json")
    assert code == 0
    b = json.loads(out)["bytes"]
    assert len(shared) == 1 and b["objects_shared_with_parent"] == 1 and b["objects"] == 2
    assert b["shared_with_parent"] == sum(shared.values()) > 0
    assert b["new"] == total - b["shared_with_parent"] and b["total"] == total and b["parent"] == "read"
    code, text, _ = run(capsys, "show", store.open(2).url)
    assert code == 0 and "new" in text and "shared with the parent (1 of 2 objects)" in text
    code, out, _ = run(capsys, "show", store.open(1).url, "--json")
    b = json.loads(out)["bytes"]
    assert (b["parent"], b["shared_with_parent"], b["new"]) == ("none", 0, sum(f.size for f in first.files))


def test_show_when_the_parent_is_gone_counts_every_byte_as_new(tmp_path: Path, capsys) -> None:
    chain = Chain(SnapshotStore(str(tmp_path / "store")))
    chain.publish(new=1)
    chain.publish(new=1, keep_latest=1)
    code, out, _ = run(capsys, "show", str(tmp_path / "store"), "--json")
    b = json.loads(out)["bytes"]
    assert code == 0 and b["parent"].startswith("not in this store") and b["shared_with_parent"] == 0
    assert b["new"] == b["total"] > 0
    code, text, _ = run(capsys, "show", str(tmp_path / "store"))
    assert "every byte counted as new" in text


def test_verify_of_a_store_names_every_snapshot_that_references_a_bad_object(tmp_path: Path, capsys) -> None:
    root = tmp_path / "store"
    store = SnapshotStore(str(root))
    chain = Chain(store)
    for _ in range(3):
        chain.publish(new=1)  # each lists every object before it again
    code, out, _ = run(capsys, "verify", str(root), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and len(report["snapshots"]) == 3
    assert report["objects_checked"] == 3  # each hashed once, though listed six times
    victim = next(f for f in store.open(1).manifest.files if f.object is not None)
    path = root / layout.object_key(victim.object)
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    code, _, err = run(capsys, "verify", str(root))
    assert code == 1 and layout.object_key(victim.object) in err
    fail = next(line for line in err.splitlines() if layout.object_key(victim.object) in line)
    for c in store.list():
        assert f"{store.open(c.sequence).url} (sequence {c.sequence}) as {victim.path}" in fail
    code, out, _ = run(capsys, "verify", str(root), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    [bad] = report["object_problems"]
    assert bad["object"] == victim.object and "hash to" in bad["message"]
    assert sorted(r["sequence"] for r in bad["referenced_by"]) == [1, 2, 3]
    assert all([p["file"] for p in r["problems"]] == [victim.path] for r in report["snapshots"])


def test_gc_reports_what_it_swept_and_kept_and_why(tmp_path: Path, capsys) -> None:
    root = tmp_path / "store"
    store = SnapshotStore(str(root))
    chain = Chain(store)
    for _ in range(3):
        chain.publish(new=1, drop=1)  # each snapshot lists only its own object
    code, out, _ = run(capsys, "gc", str(root), "--keep", "1", "--min-age", "3600", "--json")
    report = json.loads(out)
    assert code == 0 and report["kept"] == [3] and report["swept_objects"] == []
    assert report["kept_objects"]["committed"] == 1 and report["kept_objects"]["young"] == 2
    assert report["grace_s"] == 3600 and report["store_calls"]["walk"] >= 1
    _age_objects(root, 2 * 86400)
    code, text, _ = run(capsys, "gc", str(root), "--min-age", "3600", "--grace", "7200")
    assert code == 0 and "swept 2" in text and "1 named by committed snapshots" in text and "7200 s grace" in text
    assert [c.sequence for c in store.list()] == [3] and SnapshotStore(str(root)).latest() is not None
    code, _, err = run(capsys, "gc", str(root), "--min-age", "3600", "--grace", "60")
    assert code == 2 and "grace_s" in err
    manifest = root / layout.snapshot_dir(store.open(3).manifest.snapshot_id) / layout.MANIFEST_NAME
    manifest.write_bytes(b"{damaged")
    code, text, _ = run(capsys, "gc", str(root), "--min-age", "0")
    assert code == 0 and "objects: none swept" in text and "sequence 3" in text


GOLDEN_V1_3 = Path(__file__).resolve().parents[2] / "spec" / "examples" / "store-v1.3"


def test_cat_and_export_give_exactly_the_rows_a_row_range_holds(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    """The golden 1.3 store's second snapshot lists its parent's training segment narrowed by a
    row range: ``cat`` and ``export`` stream only those rows (the object holds more), in order."""
    snap = SnapshotStore(str(GOLDEN_V1_3)).latest()
    ranged = [e for e in snap.files("training_rows") if e.row_range is not None]
    assert ranged and all(e.row_range != (0, e.records) for e in ranged)
    held = snap.read_table("training").column("key").to_pylist()
    assert len(held) == sum(e.records for e in snap.files("training_rows"))
    code, out, _ = run(capsys, "cat", snap.url, "training")
    assert code == 0 and [json.loads(line)["key"] for line in out.splitlines()] == held
    target = tmp_path / "training.parquet"
    code, _, _ = run(capsys, "export", snap.url, "training", str(target), "--json")
    assert code == 0
    assert duckdb.sql(f"select key from '{target}'").fetchall() == [(k,) for k in held]
