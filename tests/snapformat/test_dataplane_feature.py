"""The ``dataplane_rows`` feature (format 1.1): a snapshot that holds a file of that kind lists it in
``required_features``, exactly then, so that a reader which would skip the unknown kind (and
restore the data plane without those partitions) refuses the snapshot instead, naming the feature
and both format versions; a snapshot without such a file stays readable by a 1.0 reader. Format 1.2
keeps the feature and adds none (its kind ``gym_file`` needs none).

Pure snapformat: the ``dataplane_rows`` file is written here by hand, as any writer could.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from schemas import version
from schemas.errors import VersionError
from schemas.version import FORMAT_VERSION
from snapformat import SnapshotStore, example, open_snapshot, verify_snapshot


def staging_batch() -> pa.RecordBatch:
    """Two NeMo-RL staging rows: key, partition, tags, and fields of their own types."""
    return pa.RecordBatch.from_pydict({
        "key": ["s0", "s1"],
        "partition_id": ["staging", "staging"],
        "row_tags": [json.dumps({"turn": 0}), json.dumps({"turn": 1})],
        "token_ids_delta": pa.array([[5, 6], [7]], pa.list_(pa.int64())),
        "cum_len": pa.array([2, 3], pa.int64()),
    })


def publish(root: Path, *, with_dataplane: bool) -> SnapshotStore:
    store = SnapshotStore(str(root))
    draft = store.begin()
    part = draft.part("tq", writer="tq")
    part.write_rows("training.arrow", "training_rows", example.training_batch(example.rollouts(80, 3), 3))
    if with_dataplane:
        part.write_rows("dataplane.arrow", "dataplane_rows", staging_batch())
    draft.publish()
    return store


def as_reader_of(monkeypatch: pytest.MonkeyPatch, format_version: str, known: frozenset[str]) -> None:
    """Make this process read as an older implementation would."""
    monkeypatch.setattr(version, "FORMAT_VERSION", format_version)
    monkeypatch.setattr(version, "KNOWN_FEATURES", known)


def test_this_version_is_1_4_and_knows_the_feature() -> None:
    assert FORMAT_VERSION == "1.4" and "dataplane_rows" in version.KNOWN_FEATURES
    assert version.features_of_kinds(["training_rows", "dataplane_rows", "dataplane_rows"]) == ["dataplane_rows"]
    assert version.features_of_kinds(["training_rows", "token_capture_rows", "part_manifest", "gym_file"]) == []
    assert version.features_of_kinds(["gym_file", "dataplane_rows"]) == ["dataplane_rows"]


def test_the_feature_is_required_exactly_when_a_dataplane_rows_file_is_there(tmp_path: Path) -> None:
    with_rows = publish(tmp_path / "with", with_dataplane=True).latest()
    without = publish(tmp_path / "without", with_dataplane=False).latest()
    assert with_rows.manifest.required_features == ["dataplane_rows"]
    assert without.manifest.required_features == []
    assert with_rows.manifest.format_version == without.manifest.format_version == FORMAT_VERSION
    assert verify_snapshot(with_rows).ok and verify_snapshot(without).ok
    (entry,) = with_rows.files("dataplane_rows")
    assert with_rows.open_rows(entry).read_all().column("key").to_pylist() == ["s0", "s1"]


def test_a_reader_that_does_not_know_the_feature_refuses_naming_both_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = publish(tmp_path, with_dataplane=True)
    url = store.latest().url
    as_reader_of(monkeypatch, "1.0", frozenset())
    for opener in (store.latest, lambda: store.open(1), lambda: open_snapshot(url)):
        with pytest.raises(VersionError) as err:
            opener()
        message = str(err.value)
        assert "dataplane_rows" in message and f"format version {FORMAT_VERSION}" in message
        assert "format version 1.0" in message
        assert "manifest.json" in message


def test_a_snapshot_without_the_feature_stays_readable_by_a_1_0_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = publish(tmp_path, with_dataplane=False)
    as_reader_of(monkeypatch, "1.0", frozenset())
    snap = store.latest()
    assert snap.manifest.format_version == FORMAT_VERSION and snap.manifest.required_features == []
    assert snap.read_table("training").num_rows > 0
