"""Listed parts (format 1.4, SPEC §10.4, §14.4): the manifest lists a part of Gym's files by its part
manifest and totals; the reader gives the part's files from there, checked against the manifest.

- round trip (hypothesis): plain folders adopted as parts are published as listed parts; the
  snapshot gives back every file in order, byte for byte (read, downloaded, verified, copied);
- the manifest does not grow with the part's files;
- a manifest whose ``listed_parts`` break the rules, and a part manifest that breaks them (bound
  again by the manifest, so only the rule under test refuses it), are refused with a typed error
  naming the file and what was expected, by every reader, and reported once by ``verify``;
- random bytes in a listed part's part manifest raise only typed errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from schemas.controller import LoaderPlace
from schemas.errors import InvalidRecordError, SnapshotError
from schemas.manifest import MAX_LISTED_PARTS, ListedPart
from schemas.version import PART_LISTINGS
from snapformat import SnapshotStore, layout, verify_snapshot
from snapformat.adopt import adopt_part, materialize_part
from snapformat.cli import main
from snapformat.copy import copy_snapshot
from snapformat.kinds import GYM_FILE_KIND
from snapformat.publish import _check_within_reader_bounds
from snapformat.reader import Snapshot

pytestmark = pytest.mark.timeout(120)

NAMES = st.from_regex(r"[a-j0-9][a-j0-9_-]{0,7}", fullmatch=True)  # safe names (SPEC §5)
FOLDER = st.dictionaries(
    st.lists(NAMES, min_size=1, max_size=3).map(lambda parts: "/".join(parts) + ".jsonl"),
    st.binary(max_size=200), min_size=1, max_size=12)


def _write_folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _publish(store: SnapshotStore, scratch: Path, parts: dict[str, dict[str, bytes]]) -> Snapshot:
    """One snapshot: each of ``parts`` (prefix -> files) a folder adopted as a part, and a controller
    part of another kind, which stays listed file by file."""
    draft = store.begin()
    receipts = [adopt_part(draft.url, str(_write_folder(scratch / f"f{i}", files)), prefix)
                for i, (prefix, files) in enumerate(parts.items())]
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=1, seed=2))
    return store.open(draft.publish(receipts=receipts).manifest.sequence)


def _without_clashes(folder: dict[str, bytes]) -> dict[str, bytes]:
    """Drop names that are also a folder of another name (``a`` and ``a/b``): a file system refuses them."""
    dirs = {rel.rsplit("/", 1)[0] for rel in folder if "/" in rel}
    dirs |= {d.rsplit("/", i)[0] for d in list(dirs) for i in range(1, d.count("/") + 1)}
    return {rel: data for rel, data in folder.items() if rel.removesuffix(".jsonl") not in dirs and rel not in dirs}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(folders=st.lists(FOLDER, min_size=1, max_size=3))
def test_listed_parts_round_trip(tmp_path_factory: pytest.TempPathFactory, folders: list[dict[str, bytes]]) -> None:
    root = tmp_path_factory.mktemp("listed")
    parts = {f"gym/p{i}": _without_clashes(f) for i, f in enumerate(folders)}
    parts = {prefix: files for prefix, files in parts.items() if files}
    assume(parts)
    snap = _publish(SnapshotStore(str(root / "store")), root, parts)
    m = snap.manifest
    assert m.required_features == [PART_LISTINGS]
    assert [p.prefix for p in m.listed_parts] == list(parts)
    assert not any(f.kind == GYM_FILE_KIND for f in m.files)  # only their part manifests
    for listed in m.listed_parts:
        files = parts[listed.prefix]
        assert (listed.files, listed.bytes) == (len(files), sum(len(d) for d in files.values()))
        got = {f.path.removeprefix(listed.prefix + "/"): snap.read_bytes(f) for f in snap.part_files(listed.prefix)}
        assert got == files
        out = root / "down" / listed.prefix
        assert sorted(materialize_part(snap, listed.prefix, str(out))) == sorted(files)
        assert {rel: (out / rel).read_bytes() for rel in files} == files
    # Every file of the snapshot, in manifest order: each listed part's files right after its part manifest.
    order = [f.path for f in snap.files()]
    for prefix, files in parts.items():
        at = order.index(f"{prefix}/{layout.PART_MANIFEST_NAME}")
        assert sorted(order[at + 1: at + 1 + len(files)]) == sorted(f"{prefix}/{rel}" for rel in files)
    assert len(order) == m.file_count and sum(f.size for f in snap.files()) == m.total_bytes
    assert len(snap.files(GYM_FILE_KIND)) == sum(len(f) for f in parts.values())
    report = verify_snapshot(snap)
    assert report.ok and report.files_checked == m.file_count
    copied = copy_snapshot(snap, str(root / "copy"))
    other = SnapshotStore(str(root / "copy")).open(copied.sequence)
    assert other.manifest == m and verify_snapshot(other).ok
    assert [other.read_bytes(f) for f in other.files()] == [snap.read_bytes(f) for f in snap.files()]


def test_the_manifest_does_not_grow_with_the_parts_files(tmp_path: Path) -> None:
    """What makes 1,000,000 parked rollouts fit (SPEC §10.4): 20 files or 2,000, the same manifest
    but for the digits of the totals and the ids."""
    sizes = []
    for n in (20, 2000):
        snap = _publish(SnapshotStore(str(tmp_path / f"s{n}")), tmp_path / f"w{n}",
                        {"sessions/tools": {f"r{i}.a0.json": b"{}" for i in range(n)}})
        assert snap.manifest.listed_parts == [ListedPart(prefix="sessions/tools", files=n, bytes=2 * n)]
        assert len(snap.manifest.files) == 3  # the Gym part's manifest, the controller's file and part manifest
        sizes.append(snap.commit.manifest_size)
    assert abs(sizes[1] - sizes[0]) < 64, sizes


def test_publish_refuses_more_listed_parts_than_a_reader_opens(tmp_path: Path) -> None:
    draft = SnapshotStore(str(tmp_path)).begin()
    snap_manifest = msgspec.structs.replace(
        _publish(SnapshotStore(str(tmp_path / "one")), tmp_path, {"gym/a": {"x.jsonl": b"1\n"}}).manifest,
        listed_parts=[ListedPart(prefix=f"gym/{i}", files=0, bytes=0) for i in range(MAX_LISTED_PARTS + 1)])
    with pytest.raises(InvalidRecordError, match=r"'listed_parts' would list 100,001 parts \(expected at most 100,000"):
        _check_within_reader_bounds(draft, snap_manifest, b"{}")


def test_the_command_counts_and_lists_the_files_of_listed_parts(published: Published, capsys) -> None:
    """``ls``, ``show`` and ``verify`` count a listed part's files and bytes as the snapshot's own."""
    m = published.snap.manifest
    assert main(["ls", str(published.root), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["files"], row["bytes"]) == (m.file_count, m.total_bytes) == (7, 7 + sum(f.size for f in m.files))
    assert main(["show", published.snap.url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["bytes"]["total"] == m.total_bytes and len(shown["files"]) == m.file_count
    assert shown["listed_parts"] == msgspec.to_builtins(m.listed_parts)
    assert [(g["prefix"], g["files"]) for g in shown["gym_parts"]] == [("gym/a", 2), ("gym/b", 1)]
    assert main(["verify", published.snap.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files_checked"] == m.file_count


# ---- a manifest that breaks the rules of listed_parts --------------------------------------------


class Published(msgspec.Struct, frozen=True):
    root: Path  # the store's folder
    store: SnapshotStore
    snap: Snapshot
    folder: Path  # the snapshot's folder


@pytest.fixture
def published(tmp_path: Path) -> Published:
    """Two listed parts: ``gym/a`` (two files, 6 bytes, one in a subfolder) and ``gym/b`` (one file)."""
    store = SnapshotStore(str(tmp_path / "store"))
    snap = _publish(store, tmp_path, {"gym/a": {"x.jsonl": b"1\n2\n", "d/y.json": b"{}"}, "gym/b": {"z.txt": b"z"}})
    return Published(tmp_path / "store", store, snap, tmp_path / "store" / layout.snapshot_dir(snap.manifest.snapshot_id))


def _pm(prefix: str) -> str:
    return f"{prefix}/{layout.PART_MANIFEST_NAME}"


MANIFEST_BREAKS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no feature": (lambda m: m.update(required_features=[]),
                   "does not list 'part_listings' in required_features"),
    "a prefix twice": (lambda m: m["listed_parts"].append(dict(m["listed_parts"][0])),
                       r"listed_parts\[2\]\.prefix 'gym/a' is listed twice"),
    "an unsafe prefix": (lambda m: m["listed_parts"][0].update(prefix="gym/../a"),
                         r"listed_parts\[0\]\.prefix"),
    "a prefix under another": (lambda m: m["listed_parts"][1].update(prefix="gym/a/d"),
                               r"listed_parts\[1\]\.prefix 'gym/a/d' lies under the listed part 'gym/a'"),
    "its part manifest not in files": (lambda m: m.update(files=[f for f in m["files"] if f["path"] != _pm("gym/b")]),
                                       r"listed_parts name 'gym/b/part-manifest.json', which files does not list"),
    "its part manifest of another kind": (
        lambda m: next(f for f in m["files"] if f["path"] == _pm("gym/a")).update(kind="gym_file"),
        (r"'gym/a/part-manifest.json' is the part manifest of a listed part, of kind 'gym_file' "
         r"\(expected 'part_manifest'\)")),
    "a file of the part in files too": (
        lambda m: m["files"].insert(0, {**next(f for f in m["files"] if f["path"] == _pm("gym/a")),
                                        "path": "gym/a/x.jsonl", "kind": "gym_file"}),
        r"files\[0\] 'gym/a/x.jsonl' lies under the listed part 'gym/a', whose files only its part manifest lists"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_BREAKS))
def test_a_manifest_breaking_the_listed_parts_rules_is_refused(published: Published, rewrite_manifest,
                                                               case: str) -> None:
    change, message = MANIFEST_BREAKS[case]
    rewrite_manifest(published.root, 1, change)
    with pytest.raises(SnapshotError, match=message) as err:
        published.store.open(1)
    assert f"{published.snap.manifest.snapshot_id}/{layout.MANIFEST_NAME}" in str(err.value)


# ---- a part manifest that breaks them (the manifest binds its new bytes) --------------------------


def _first(part: dict[str, Any]) -> dict[str, Any]:
    return part["files"][0]


PART_BREAKS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "one file fewer": (lambda p: p["files"].pop(), r"lists 1 files of \d+ bytes, the snapshot's manifest says 2 files"),
    "another size": (lambda p: _first(p).update(size=_first(p)["size"] + 1),
                     r"lists 2 files of 7 bytes, the snapshot's manifest says 2 files of 6 bytes"),
    "another prefix": (lambda p: p.update(prefix="gym/b"), r"prefix 'gym/b' \(expected .* prefix 'gym/a'\)"),
    "another snapshot": (lambda p: p.update(snapshot_id="snap-0000000009-00000000"),
                         r"written for snapshot 'snap-0000000009-00000000'"),
    "a file outside the prefix": (lambda p: _first(p).update(path="gym/b/x.jsonl"),
                                  r"files\[0\]\.path 'gym/b/x.jsonl' \(expected a file under 'gym/a'"),
    "itself": (lambda p: _first(p).update(path=_pm("gym/a")),
               r"files\[0\]\.path 'gym/a/part-manifest.json' \(expected a file under 'gym/a' other than"),
    "another kind": (lambda p: _first(p).update(kind="continuations"),
                     r"files\[0\]: kind 'continuations' \(expected 'gym_file'"),
    "an object": (lambda p: _first(p).update(object="sha256:" + "0" * 64, checksum="sha256:" + "0" * 64),
                  (r"files\[0\]: kind 'gym_file' naming object sha256:0+ \(expected 'gym_file' in a file of the "
                   r"snapshot folder")),
    "a file twice": (lambda p: p["files"].__setitem__(1, dict(_first(p))), r"files\[1\]\.path 'gym/a/.*' is listed twice"),
    "a newer major version": (lambda p: p.update(format_version="2.0"), r"format version 2\.0"),
    "not a part manifest": (lambda p: p.pop("files"), r"files"),
}


@pytest.mark.parametrize("case", sorted(PART_BREAKS))
def test_a_listed_part_manifest_breaking_the_rules_is_refused_by_every_reader(published: Published, put_part_manifest,
                                                                             tmp_path: Path, case: str) -> None:
    change, message = PART_BREAKS[case]
    part = json.loads((published.folder / _pm("gym/a")).read_bytes())
    change(part)
    put_part_manifest(published.root, 1, "gym/a", json.dumps(part).encode())
    snap = published.store.open(1)  # the manifest is sound: the part manifest is refused when read
    readers = [lambda: snap.files(), lambda: snap.part_files("gym/a"), lambda: snap.files(GYM_FILE_KIND),
               lambda: snap.select("gym/a/x.jsonl"), lambda: materialize_part(snap, "gym/a", str(tmp_path / "down")),
               lambda: copy_snapshot(snap, str(tmp_path / "copy"))]
    for read in readers:
        with pytest.raises(SnapshotError, match=message) as err:
            read()
        assert _pm("gym/a") in str(err.value)
    assert not (tmp_path / "down" / "x.jsonl").exists() and SnapshotStore(str(tmp_path / "copy")).list() == []
    assert snap.records("loader")  # other kinds read without the part manifest
    report = verify_snapshot(snap)
    assert [p.file for p in report.problems] == [_pm("gym/a")], report.problems
    assert snap.part_files("gym/b")  # the other listed part is intact


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=400),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                                   lambda inner: st.lists(inner, max_size=4)
                                   | st.dictionaries(st.sampled_from(["format_version", "snapshot_id", "prefix",
                                                                      "writer", "files", "written_at", "path",
                                                                      "kind", "size", "checksum"]), inner,
                                                     max_size=6), max_leaves=20).map(lambda v: json.dumps(v).encode())))
def test_untrusted_bytes_in_a_listed_part_manifest_raise_only_typed_errors(published: Published, put_part_manifest,
                                                                          data: bytes) -> None:
    put_part_manifest(published.root, 1, "gym/b", data)
    opened = published.store.open(1)
    with pytest.raises(SnapshotError):
        opened.part_files("gym/b")
    assert [p.file for p in verify_snapshot(opened).problems] == [_pm("gym/b")]
