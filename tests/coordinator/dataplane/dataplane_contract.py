"""The contract every DataPlane implementation passes, written once.

A test module subclasses :class:`DataPlaneContract` and provides a ``harness`` fixture: a
:class:`Harness` that puts rows into its data plane the way producers would (``put`` / ``delete``)
and reads back everything the data plane holds through the data plane's *own* API
(``contents``), independently of the adapter's cut/load code, so a symmetric bug in the adapter
cannot hide. ``contents`` is normalised: keys in the data plane's order, tags, and every field
value as (dtype, shape, raw bytes) or JSON text, plus each field's layout (dtype, dense/ragged).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest

from coordinator.dataplane import (
    DATAPLANE,
    FILE_NAMES,
    TOKEN_CAPTURE,
    TRAINING,
    DataPlane,
    DataPlaneNotEmptyError,
    Objects,
    Ragged,
    RowsCut,
    layout_of,
)
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from snapformat import SnapshotStore, verify_snapshot

TOKEN_PARTITION = "tokens"
STAGING_PARTITION = "token_capture_staging"


class Harness:
    """What a contract test needs besides the DataPlane interface."""

    plane: DataPlane

    def put(self, partition_id: str, keys: list[str], fields: dict[str, Any] | None = None,
            tags: list[dict[str, Any]] | None = None) -> None:
        raise NotImplementedError

    def delete(self, partition_id: str, keys: list[str]) -> None:
        raise NotImplementedError

    def contents(self) -> dict[str, Any]:
        raise NotImplementedError


def norm_tensor(dtype: str, shape: tuple[int, ...], raw: bytes) -> tuple:
    return ("tensor", dtype, tuple(int(x) for x in shape), raw)


def norm_object(value: Any) -> tuple:
    return ("object", json.dumps(value, sort_keys=True))


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two ``contents()`` differ (empty when equal), for readable failures."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only {'before' if k in a else 'after'}" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += diff(a[k], b[k], f"{path}/{k}")
        if not out and list(a) != list(b):
            out.append(f"{path}: order {list(a)[:5]}... != {list(b)[:5]}...")
        return out
    if a != b:
        return [f"{path}: {str(a)[:160]} != {str(b)[:160]}"]
    return []


def assert_same(before: Any, after: Any) -> None:
    problems = diff(before, after)
    assert not problems, "\n".join(sorted(problems)[:20])


def training_fields(rng: np.random.Generator, n: int, *, with_advantages: bool = True) -> dict[str, Any]:
    """A training row batch as a producer would put it: ragged and dense tensors of several dtypes,
    and non-tensor fields. ``input_ids`` is int64 (as torch makes it): the snapshot column is int32."""
    lens = rng.integers(3, 40, n)
    fields: dict[str, Any] = {
        "input_ids": Ragged([rng.integers(0, 150_000, k).astype(np.int64) for k in lens]),
        "input_lengths": lens.astype(np.int32),
        "generation_logprobs": Ragged([(-rng.random(k)).astype(np.float32) for k in lens]),
        "token_mask": Ragged([rng.integers(0, 2, k).astype(np.int8) for k in lens]),
        "sample_mask": rng.random(n).astype(np.float32),
        "reward": rng.standard_normal(n).astype(np.float64),
        "is_truncated": rng.random(n) < 0.3,
        "position_bucket": rng.integers(0, 9, (n, 4)).astype(np.int16),  # dense [N, 4]: not ragged
        "routed_experts": Ragged([rng.integers(0, 64, (k, 2)).astype(np.uint8) for k in lens]),  # per row [k, 2]
        "env_name": Objects([f"env-{i % 3}" for i in range(n)]),
        "extra_info": Objects([{"turns": int(i % 4), "ok": bool(i % 2)} if i % 5 else None for i in range(n)]),
    }
    if with_advantages:
        fields["advantages"] = Ragged([rng.standard_normal(k).astype(np.float16) for k in lens])
    return fields


def training_tags(n: int, start: int = 0, group: str = "p") -> list[dict[str, Any]]:
    return [{"rollout_id": f"{group}{(start + i) // 4}_g{(start + i) % 4}", "attempt_index": (start + i) % 3,
             "score": 0.5 * i, "labels": ["a", str(i)]} for i in range(n)]


def token_fields(rng: np.random.Generator, n: int) -> dict[str, Any]:
    """Token-capture rows kept in the data plane under their own partition (fields named as the schema)."""
    gen = rng.integers(1, 12, n)
    return {
        "schema_version": np.ones(n, dtype=np.int32),
        "rollout_id": Objects([f"p{i}_g0" for i in range(n)]),
        "attempt_index": np.zeros(n, dtype=np.int64),
        "capture_key": Objects([f"p{i}_g0" for i in range(n)]),
        "model_call_id": Objects([f"call-{i}" for i in range(n)]),
        "prompt_token_ids": Ragged([rng.integers(0, 1000, 5).astype(np.int32) for _ in range(n)]),
        "generation_token_ids": Ragged([rng.integers(0, 1000, k).astype(np.int32) for k in gen]),
        "generation_log_probs": Ragged([(-rng.random(k)).astype(np.float32) for k in gen]),
        "cum_len": (5 + gen).astype(np.int64),
    }


def fill(h: Harness, seed: int = 0) -> None:
    """Three partitions of training rows (one with rows lacking a field), token-capture rows, an empty partition."""
    rng = np.random.default_rng(seed)
    h.put("train", [f"t{i:03d}" for i in range(24)], training_fields(rng, 24), training_tags(24))
    h.put("train", [f"t{i:03d}" for i in range(24, 30)], training_fields(rng, 6), training_tags(6, 24))
    # Rows whose advantages are not computed yet: the field is absent (null), not empty.
    h.put("val", [f"v{i}" for i in range(5)], training_fields(rng, 5, with_advantages=False), training_tags(5, 0, "q"))
    h.put("val", ["v5", "v6"], training_fields(rng, 2), training_tags(2, 5, "q"))
    h.put(TOKEN_PARTITION, [f"c{i}" for i in range(6)], token_fields(rng, 6), [{} for _ in range(6)])
    h.put("drained", ["gone"], {"input_lengths": np.array([1], np.int32)}, [{"rollout_id": "x", "attempt_index": 0}])
    h.delete("drained", ["gone"])


def staging_fields(rng: np.random.Generator, n: int, *, dense: bool = False, mask: str = "int8",
                   ids: str = "int64") -> dict[str, Any]:
    """NeMo-RL's token-capture staging rows as it keeps them in TransferQueue: per row 1-D deltas of
    token ids, loss mask and generation log probs (ragged, or dense ``[N, L]`` when every delta has
    one length) and per-row scalars. float32 log probs here (numpy has no bfloat16: TQ's own test
    adds it)."""
    lens = np.full(n, 6) if dense else rng.integers(1, 9, n)
    prev = rng.integers(0, 50, n)

    def per_row(make):
        rows = [make(k) for k in lens]
        return np.stack(rows) if dense else Ragged(rows)

    return {
        "token_ids_delta": per_row(lambda k: rng.integers(0, 150_000, k).astype(ids)),
        "token_mask_delta": per_row(lambda k: (rng.random(k) < 0.7).astype(mask)),
        "generation_logprobs_delta": per_row(lambda k: (-rng.random(k)).astype(np.float32)),
        "prev_len": prev.astype(np.int64),
        "delta_len": lens.astype(np.int64),
        "cum_len": (prev + lens).astype(np.int64),
        "weight_version": np.full(n, 3, dtype=np.int64),
    }


def staging_tags(n: int, start: int = 0) -> list[dict[str, Any]]:
    """Tags of staging rows: they name the rollout and attempt (as training rows do) but a staging row
    has no ``input_ids``, so its partition is not training rows."""
    return [{"rollout_id": f"p{(start + i) // 2}_g0", "attempt_index": 0, "turn": (start + i) % 2,
             "done": bool(i % 2)} for i in range(n)]


def rows_in(snap, kind: str):
    """The rows of ``kind`` of a snapshot (every file of it), with its layout, or None when it has none."""
    entries = snap.files(kind)
    if not entries:
        return None
    tables = [snap.open_rows(e).read_all() for e in entries]
    return tables[0] if len(tables) == 1 else tables


def publish_cut(cut: RowsCut, root: Path, prefix: str = "tq"):
    """A snapshot holding only ``cut``'s rows (written as a save writes them), and its row files."""
    store = SnapshotStore(str(root))
    draft = store.begin()
    entries = list(cut.write(draft.part(prefix, writer="tq")).entries)
    draft.publish()
    return store.latest(), entries


class DataPlaneContract:
    """Subclass and provide a ``harness`` fixture (a fresh, empty data plane per test)."""

    def test_round_trip_restores_exactly(self, harness: Harness, tmp_path: Path) -> None:
        fill(harness)
        before = harness.contents()
        cut = harness.plane.cut()
        assert cut.rows == {"training_rows": 37, "token_capture_rows": 6}
        assert set(cut.partitions) == {"train", "val", TOKEN_PARTITION, "drained"}
        snap, entries = publish_cut(cut, tmp_path / "store")
        assert sorted(e.path for e in entries) == sorted(f"tq/{FILE_NAMES[k]}" for k in (TRAINING, TOKEN_CAPTURE))
        assert snap.manifest.required_features == []  # no dataplane_rows: a 1.0 reader reads it
        report = verify_snapshot(snap)
        assert report.ok, report.problems

        # The part is a valid snapformat row table: canonical types for the required columns, the rest kept.
        training = snap.read_table("training")
        for f in TRAINING_SCHEMA:
            assert training.schema.field(f.name).type == f.type
        assert training.schema.field("input_ids").type.value_type.bit_width == 32  # int64 in the data plane
        assert {"reward", "routed_experts", "env_name", "extra_info", "row_tags"} <= set(training.column_names)
        tokens = snap.read_table("tokens")
        for f in TOKEN_CAPTURE_SCHEMA:
            assert tokens.schema.field(f.name).type == f.type
        assert sorted(tokens.column("capture_key").to_pylist()) == [f"p{i}_g0" for i in range(6)]
        val_adv = [r["advantages"] for r in training.to_pylist() if r["partition_id"] == "val"]
        assert [a is None for a in val_adv] == [True] * 5 + [False] * 2

        harness.plane.clear()
        assert harness.plane.is_empty()
        loaded = harness.plane.load(snap, "tq")
        assert loaded.rows == {"training_rows": 37, "token_capture_rows": 6}
        assert_same(before, harness.contents())
        again = harness.plane.cut()
        for kind, table in cut.tables.items():
            assert again.tables[kind].equals(table, check_metadata=True), kind

    def test_cut_is_immutable(self, harness: Harness, tmp_path: Path) -> None:
        rng = np.random.default_rng(1)
        harness.put("train", ["a", "b", "c"], training_fields(rng, 3), training_tags(3))
        at_cut = harness.contents()
        cut = harness.plane.cut()
        with pytest.raises(TypeError):
            cut.tables["training_rows"] = None  # type: ignore[index]
        with pytest.raises(dataclasses.FrozenInstanceError):
            cut.partitions = ()  # type: ignore[misc]
        # After the cut: new keys, a new partition, a changed tag and overwritten values of a cut row.
        harness.put("train", ["d"], training_fields(rng, 1), training_tags(1, 3))
        harness.put("later", ["x"], training_fields(rng, 1), training_tags(1, 9))
        harness.put("train", ["a"], training_fields(rng, 1), [{"rollout_id": "changed", "attempt_index": 2}])
        harness.plane.clear()  # even dropping everything does not touch the cut's copy
        snap, _ = publish_cut(cut, tmp_path / "store")
        assert snap.read_table("training").column("key").to_pylist() == ["a", "b", "c"]
        assert harness.plane.is_empty()
        harness.plane.load(snap, "tq")
        assert_same(at_cut, harness.contents())

    def test_empty_data_plane(self, harness: Harness, tmp_path: Path) -> None:
        assert harness.plane.is_empty()
        cut = harness.plane.cut()
        assert cut.partitions == () and all(n == 0 for n in cut.rows.values())
        snap, entries = publish_cut(cut, tmp_path / "store")
        assert all(e.records == 0 for e in entries)
        assert verify_snapshot(snap).ok
        assert snap.read_table("training").num_rows == 0
        harness.plane.load(snap, "tq")
        assert harness.plane.is_empty()
        assert harness.contents() == {}

    def test_empty_partition_survives(self, harness: Harness, tmp_path: Path) -> None:
        harness.put("drained", ["k"], {"input_lengths": np.array([3], np.int32)},
                    [{"rollout_id": "r", "attempt_index": 0}])
        harness.delete("drained", ["k"])
        before = harness.contents()
        assert before == {"drained": {"keys": [], "tags": {}, "rows": {}, "layout": before["drained"]["layout"]}}
        cut = harness.plane.cut()
        assert cut.partitions == ("drained",)
        snap, _ = publish_cut(cut, tmp_path / "store")
        harness.plane.clear()
        assert harness.plane.is_empty()
        harness.plane.load(snap, "tq")
        assert list(harness.contents()) == ["drained"]
        assert harness.contents()["drained"]["keys"] == []

    def test_load_needs_an_empty_data_plane(self, harness: Harness, tmp_path: Path) -> None:
        rng = np.random.default_rng(2)
        harness.put("train", ["a"], training_fields(rng, 1), training_tags(1))
        snap, _ = publish_cut(harness.plane.cut(), tmp_path / "store")
        before = harness.contents()
        with pytest.raises(DataPlaneNotEmptyError):
            harness.plane.load(snap, "tq")
        assert_same(before, harness.contents())

    def test_a_partition_with_a_row_lacking_a_training_column_is_kept_as_dataplane_rows(
            self, harness: Harness, tmp_path: Path) -> None:
        """A key with no fields yet: its partition is not training rows in this snapshot (it was an
        error before), but it is kept whole, and comes back exactly."""
        rng = np.random.default_rng(3)
        harness.put("train", ["full"], training_fields(rng, 1), training_tags(1))
        harness.put("train", ["bare"], None, [{"rollout_id": "p9_g0", "attempt_index": 0}])
        before = harness.contents()
        cut = harness.plane.cut()
        assert cut.rows == {TRAINING: 0, TOKEN_CAPTURE: 0, DATAPLANE: 2}
        snap, _ = publish_cut(cut, tmp_path / "store")
        assert snap.manifest.required_features == [DATAPLANE] and verify_snapshot(snap).ok
        assert rows_in(snap, DATAPLANE).column("key").to_pylist() == ["full", "bare"]
        harness.plane.clear()
        harness.plane.load(snap, "tq")
        assert_same(before, harness.contents())

    @pytest.mark.parametrize(("dense", "mask"), [(False, "int8"), (True, "bool"), (False, "bool"), (True, "int8")])
    def test_staging_rows_round_trip_as_dataplane_rows(self, harness: Harness, tmp_path: Path, dense: bool,
                                                       mask: str) -> None:
        rng = np.random.default_rng(11)
        harness.put(STAGING_PARTITION, [f"s{i}" for i in range(5)], staging_fields(rng, 5, dense=dense, mask=mask),
                    staging_tags(5))
        harness.put(STAGING_PARTITION, ["s5", "s6"], staging_fields(rng, 2, dense=dense, mask=mask), staging_tags(2, 5))
        before = harness.contents()
        cut = harness.plane.cut()
        assert cut.rows == {TRAINING: 0, TOKEN_CAPTURE: 0, DATAPLANE: 7}
        snap, entries = publish_cut(cut, tmp_path / "store")
        assert f"tq/{FILE_NAMES[DATAPLANE]}" in [e.path for e in entries]
        assert snap.manifest.required_features == [DATAPLANE]
        report = verify_snapshot(snap)
        assert report.ok, report.problems
        table = rows_in(snap, DATAPLANE)
        assert table.column_names[:3] == ["key", "partition_id", "row_tags"]
        assert table.column("key").to_pylist() == [f"s{i}" for i in range(7)]
        assert table.schema.field("token_ids_delta").type.value_type.bit_width == 64  # kept as int64
        layout = layout_of(table.schema)  # the layout survives snapformat's writer
        assert layout["kind"] == DATAPLANE and [p["id"] for p in layout["partitions"]] == [STAGING_PARTITION]
        assert layout["partitions"][0]["fields"]["token_mask_delta"]["dtype"] == mask
        harness.plane.clear()
        loaded = harness.plane.load(snap, "tq")
        assert loaded.rows == {TRAINING: 0, TOKEN_CAPTURE: 0, DATAPLANE: 7}
        assert_same(before, harness.contents())
        again = harness.plane.cut()
        for kind, t in cut.tables.items():
            assert again.tables[kind].equals(t, check_metadata=True), kind

    def test_training_and_staging_partitions_in_one_save(self, harness: Harness, tmp_path: Path) -> None:
        """Training, token-capture and staging partitions side by side: each goes to its table, the
        typed tables are what they were without the staging rows, and the whole data plane (partition
        order across tables included) comes back exactly. A second staging partition's token ids are
        int32: its column cannot share the first one's, so it gets a column of its own."""
        fill(harness)
        baseline = harness.plane.cut()
        rng = np.random.default_rng(12)
        harness.put(STAGING_PARTITION, [f"s{i}" for i in range(4)], staging_fields(rng, 4), staging_tags(4))
        harness.put("staging-b", ["b0", "b1", "b2"], staging_fields(rng, 3, dense=True, ids="int32"), staging_tags(3))
        harness.put("val", ["v7"], training_fields(rng, 1), training_tags(1, 7, "q"))  # after the staging puts
        before = harness.contents()
        cut = harness.plane.cut()
        assert cut.rows == {TRAINING: 38, TOKEN_CAPTURE: 6, DATAPLANE: 7}
        snap, _ = publish_cut(cut, tmp_path / "store")
        assert snap.manifest.required_features == [DATAPLANE]
        report = verify_snapshot(snap)
        assert report.ok, report.problems
        training = rows_in(snap, TRAINING)
        assert [p["id"] for p in layout_of(training.schema)["partitions"]] == ["train", "val", "drained"]
        without_v7 = cut.tables[TRAINING].filter(pc.not_equal(cut.tables[TRAINING].column("key"), "v7"))
        assert without_v7.equals(baseline.tables[TRAINING], check_metadata=True)
        assert cut.tables[TOKEN_CAPTURE].equals(baseline.tables[TOKEN_CAPTURE], check_metadata=True)
        staged = rows_in(snap, DATAPLANE)
        layout = layout_of(staged.schema)
        assert [p["id"] for p in layout["partitions"]] == [STAGING_PARTITION, "staging-b"]
        moved = layout["partitions"][1]["fields"]["token_ids_delta"]
        assert moved["column"] == "token_ids_delta@staging-b" and moved["dtype"] == "int32"
        assert "column" not in layout["partitions"][0]["fields"]["token_ids_delta"]
        harness.plane.clear()
        harness.plane.load(snap, "tq")
        assert_same(before, harness.contents())
