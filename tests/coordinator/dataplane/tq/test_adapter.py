"""The TransferQueue adapter: the shared contract against a real TQ (SimpleStorage on Ray, loopback),
plus what only TQ has: torch dtypes such as bfloat16, TQ's dense/ragged flag, sockets, a racing cut.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import transfer_queue as tq
from dataplane_contract import (
    STAGING_PARTITION,
    TOKEN_PARTITION,
    DataPlaneContract,
    Harness,
    norm_object,
    norm_tensor,
    publish_cut,
    rows_in,
    staging_tags,
    training_fields,
    training_tags,
)
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack

from coordinator.dataplane import DATAPLANE, DataPlaneChangedError, DataPlaneError, Objects, Ragged, layout_of
from coordinator.dataplane.tq import adapter, client
from coordinator.dataplane.tq.adapter import TQDataPlane
from snapformat import SnapshotStore, verify_snapshot


def _to_torch(value: Any, n: int) -> Any:
    if isinstance(value, Ragged):
        return torch.nested.nested_tensor([torch.from_numpy(np.asarray(r)) for r in value.rows], layout=torch.jagged)
    if isinstance(value, Objects):
        return NonTensorStack(*value.values)
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.asarray(value))


def _raw(t: torch.Tensor) -> tuple:
    dtype = str(t.dtype).removeprefix("torch.")
    flat = t.contiguous()
    if t.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return norm_tensor(dtype, tuple(t.shape), flat.numpy().tobytes())


class TQHarness(Harness):
    """Puts and reads through TQ's own KV API (not through the adapter)."""

    def __init__(self, plane: TQDataPlane) -> None:
        self.plane = plane
        self.client = tq.get_client()

    def put(self, partition_id, keys, fields=None, tags=None) -> None:
        td = None
        if fields:
            td = TensorDict({k: _to_torch(v, len(keys)) for k, v in fields.items()}, batch_size=[len(keys)])
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=td, tags=tags)

    def delete(self, partition_id, keys) -> None:
        tq.kv_clear(keys=keys, partition_id=partition_id)

    def contents(self) -> dict[str, Any]:
        self.plane.wait_loaded()  # TQ itself holds every restored value once a background load ends
        out = {}
        for pid, key_tags in tq.kv_list().items():
            keys = list(key_tags)
            if not keys:
                out[pid] = {"keys": [], "tags": {}, "rows": {}, "layout": {}}
                continue
            gis = self.client.kv_retrieve_meta(keys=keys, partition_id=pid).global_indexes
            schema = self.client._run_coroutine(self.client._get_partition_meta(pid)).field_schema
            has = {}
            for name in schema:
                gi, st = self.client.get_production_status(data_fields=[name], partition_id=pid)
                status = dict(zip(gi.tolist(), st[:, 0].tolist()))
                has[name] = [status[g] == 1 for g in gis]
            rows: dict[str, dict] = {k: {} for k in keys}
            for sig in {tuple(has[n][i] for n in sorted(schema)) for i in range(len(keys))}:
                names = [n for n, on in zip(sorted(schema), sig) if on]
                sel = [k for i, k in enumerate(keys) if tuple(has[n][i] for n in sorted(schema)) == sig]
                if not names:
                    continue
                td = tq.kv_batch_get(keys=sel, partition_id=pid, select_fields=names)
                for name in names:
                    v = td.get(name)
                    if isinstance(v, torch.Tensor):
                        per_row = v.unbind() if v.is_nested else [v[i] for i in range(len(sel))]
                        for k, t in zip(sel, per_row):
                            rows[k][name] = _raw(t)
                    else:
                        for k, obj in zip(sel, v.tolist()):
                            rows[k][name] = norm_object(obj)
            held = {n for r in rows.values() for n in r}
            layout = {n: (str(s["dtype"]).removeprefix("torch.") if s["dtype"] is not None else None,
                          bool(s["is_nested"])) for n, s in schema.items() if n in held}
            out[pid] = {"keys": keys, "tags": {k: key_tags[k] for k in keys}, "rows": rows, "layout": layout}
        return out


class TestTQContract(DataPlaneContract):
    """Rows put straight into TQ by another producer: every save reads them back out of TQ."""

    @pytest.fixture
    def harness(self, tq_plane: TQDataPlane) -> TQHarness:
        return TQHarness(tq_plane)


class AdapterHarness(TQHarness):
    """Rows put through the adapter (so it keeps them); read and deleted through TQ's own API. The
    adapter is write-once, so a second put of a key goes straight to TQ, as another producer's would."""

    def put(self, partition_id, keys, fields=None, tags=None) -> None:
        if any((partition_id, k) in self.plane._written for k in keys):
            super().put(partition_id, keys, fields, tags)
        else:
            self.plane.put(partition_id, keys, fields, tags)


class TestTQCapturedContract(DataPlaneContract):
    """Rows put through the adapter: a save takes them from the adapter's capture, not from TQ."""

    @pytest.fixture
    def harness(self, tq_plane: TQDataPlane) -> AdapterHarness:
        return AdapterHarness(tq_plane)


class TestTQSynchronousLoadContract(DataPlaneContract):
    """No capture and no background load: everything goes through TQ's KV calls, as before."""

    @pytest.fixture
    def harness(self, tq_runtime) -> AdapterHarness:
        plane = TQDataPlane(token_capture_partitions={TOKEN_PARTITION}, capture_max_bytes=0, background_load=False)
        plane.clear()
        yield AdapterHarness(plane)
        plane.clear()


def test_torch_only_dtypes_and_dense_layout_round_trip(tq_plane: TQDataPlane, tmp_path: Path) -> None:
    h = TQHarness(tq_plane)
    n = 5
    g = torch.Generator().manual_seed(0)
    fields = {
        "input_ids": Ragged([np.arange(k + 1, dtype=np.int32) for k in range(n)]),
        "input_lengths": np.arange(1, n + 1, dtype=np.int32),
        "sample_mask": torch.rand(n, generator=g).to(torch.bfloat16),
        "ref_logprobs_bf16": torch.nested.nested_tensor(
            [torch.randn(k + 2, generator=g).to(torch.bfloat16) for k in range(n)], layout=torch.jagged),
        "dense_f16": torch.randn(n, 3, generator=g).to(torch.float16),
        "dense_3d": torch.arange(n * 2 * 3, dtype=torch.int64).reshape(n, 2, 3),
    }
    h.put("train", [f"k{i}" for i in range(n)], fields, training_tags(n))
    before = h.contents()
    assert before["train"]["layout"]["dense_3d"] == ("int64", False)
    assert before["train"]["layout"]["ref_logprobs_bf16"] == ("bfloat16", True)
    cut = tq_plane.cut()
    snap, _ = publish_cut(cut, tmp_path / "s")
    assert verify_snapshot(snap).ok
    table = snap.read_table("training")
    # bfloat16 is stored as its exact float32 value, so readers see numbers, not bit patterns.
    assert table.column("sample_mask").to_pylist() == fields["sample_mask"].float().tolist()
    tq_plane.clear()
    tq_plane.load(snap, "tq")
    assert h.contents() == before


@pytest.mark.parametrize("dense", [False, True])
def test_nemo_rl_staging_rows_with_bfloat16_log_probs_round_trip(tq_plane: TQDataPlane, tmp_path: Path,
                                                                 dense: bool) -> None:
    """NeMo-RL's token-capture staging rows as it puts them into TQ itself (torch tensors: int64 token
    ids, bool masks, bfloat16 log probs; ragged or dense), next to training rows the adapter put: one
    save (window by window, the staging rows read back out of TQ) keeps both, and a restore gives TQ
    back every key in order, tag, dtype, shape, value and dense/ragged flag."""
    h = TQHarness(tq_plane)
    n = 6
    g = torch.Generator().manual_seed(1)
    lens = [4] * n if dense else [k % 4 + 1 for k in range(n)]

    def per_row(make):
        rows = [make(k) for k in lens]
        return torch.stack(rows) if dense else torch.nested.nested_tensor(rows, layout=torch.jagged)

    prev = torch.arange(n, dtype=torch.int64) * 10
    staging = {
        "token_ids_delta": per_row(lambda k: torch.randint(0, 150_000, (k,), generator=g, dtype=torch.int64)),
        "token_mask_delta": per_row(lambda k: torch.rand(k, generator=g) < 0.5),
        "generation_logprobs_delta": per_row(lambda k: (-torch.rand(k, generator=g)).to(torch.bfloat16)),
        "prev_len": prev,
        "delta_len": torch.tensor(lens, dtype=torch.int64),
        "cum_len": prev + torch.tensor(lens, dtype=torch.int64),
        "weight_version": torch.full((n,), 2, dtype=torch.int64),
    }
    tq_plane.put("train", [f"t{i}" for i in range(3)], training_fields(np.random.default_rng(0), 3), training_tags(3))
    h.put(STAGING_PARTITION, [f"s{i}" for i in range(n)], staging, staging_tags(n))
    before = h.contents()
    assert before[STAGING_PARTITION]["layout"]["generation_logprobs_delta"] == ("bfloat16", not dense)
    store = SnapshotStore(str(tmp_path / "s"))
    draft = store.begin()
    written = tq_plane.deferred_cut().write(draft.part("tq", writer="tq"))
    draft.publish()
    snap = store.latest()
    assert dict(written.rows) == {"training_rows": 3, "token_capture_rows": 0, DATAPLANE: n}
    assert snap.manifest.required_features == [DATAPLANE]
    report = verify_snapshot(snap)
    assert report.ok, report.problems
    table = rows_in(snap, DATAPLANE)
    fields = layout_of(table.schema)["partitions"][0]["fields"]
    assert fields["generation_logprobs_delta"] == {"type": "tensor", "dtype": "bfloat16", "ndim": 1, "inner": [],
                                                   "nested": not dense}
    assert fields["token_mask_delta"]["dtype"] == "bool" and fields["token_ids_delta"]["dtype"] == "int64"
    # bfloat16 is stored as its exact float32 value: a reader of the file sees the log probs as numbers.
    lp = staging["generation_logprobs_delta"]
    expected = [r.float().tolist() for r in (lp.unbind() if lp.is_nested else lp)]
    assert table.column("generation_logprobs_delta").to_pylist() == expected
    assert [json.loads(t) for t in table.column("row_tags").to_pylist()] == staging_tags(n)
    tq_plane.clear()
    tq_plane.load(snap, "tq")
    assert h.contents() == before


def test_cut_refuses_rows_changing_underneath(tq_plane: TQDataPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    h = TQHarness(tq_plane)  # puts straight into TQ: the cut reads these values back, so it lists twice
    h.put("train", ["a"], {"input_lengths": np.array([1], np.int32)}, training_tags(1))
    real = client.TQCalls.list
    calls = {"n": 0}

    def racing_list(self):
        calls["n"] += 1
        if calls["n"] == 2:  # a producer ignoring the barrier, between the first listing and the check
            h.put("train", ["late"], {"input_lengths": np.array([2], np.int32)}, training_tags(1, 1))
        return real(self)

    monkeypatch.setattr(client.TQCalls, "list", racing_list)
    with pytest.raises(DataPlaneChangedError):
        tq_plane.cut()


def test_a_cut_of_kept_rows_lists_tq_once(tq_plane: TQDataPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every value kept by the adapter: one listing is the whole cut (no second one to compare)."""
    tq_plane.put("train", ["a", "b"], {"input_lengths": np.array([1, 2], np.int32)}, training_tags(2))
    real = client.TQCalls.list
    calls = {"n": 0}

    def counted(self):
        calls["n"] += 1
        return real(self)

    monkeypatch.setattr(client.TQCalls, "list", counted)
    cut = tq_plane.cut()
    assert calls["n"] == 1
    assert sum(t.num_rows for t in cut.tables.values()) == 2


def test_chunked_get_and_put_give_the_same_rows(tq_runtime, tmp_path: Path) -> None:
    plane = TQDataPlane(chunk_rows=3)
    plane.clear()
    try:
        h = TQHarness(plane)
        rng = np.random.default_rng(7)
        n = 10
        h.put("train", [f"k{i}" for i in range(n)], {
            "input_ids": Ragged([rng.integers(0, 9, rng.integers(1, 6)).astype(np.int64) for _ in range(n)]),
            "input_lengths": np.arange(n, dtype=np.int32),
            "note": Objects([{"i": i} for i in range(n)]),
        }, training_tags(n))
        before = h.contents()
        cut = plane.cut()
        snap, _ = publish_cut(cut, tmp_path / "s")
        plane.clear()
        plane.load(snap, "tq")
        assert h.contents() == before
        assert plane.cut().tables["training_rows"].equals(cut.tables["training_rows"], check_metadata=True)
    finally:
        plane.clear()


def test_ray_and_tq_listen_on_loopback_only(tq_runtime) -> None:
    ours = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} | {os.getpid()}
    out = subprocess.run(["ss", "-H", "-tlnp"], capture_output=True, text=True, check=True).stdout
    seen = 0
    for line in out.splitlines():
        pids = {int(x) for x in __import__("re").findall(r"pid=(\d+)", line)}
        if not pids & ours:
            continue
        seen += 1
        local = line.split()[3]
        host = local.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"), line
    assert seen >= 3  # gcs, raylet, TQ's controller and storage unit at least
    assert json.dumps(tq_runtime.seconds)  # timings are recorded


def _put_some(plane: TQDataPlane, pid: str, keys: list[str]) -> None:
    """Training rows (every column a training row requires: a tag or a field)."""
    plane.put(pid, keys, {"input_ids": Ragged([np.arange(i + 1, dtype=np.int32) for i in range(len(keys))]),
                          "input_lengths": np.arange(1, len(keys) + 1, dtype=np.int32)},
              [{"rollout_id": k, "attempt_index": 0} for k in keys])


def test_a_deferred_cut_keeps_only_the_listing_and_reads_the_rows_later(tq_plane: TQDataPlane) -> None:
    _put_some(tq_plane, "train", ["a", "b", "c"])
    deferred = tq_plane.deferred_cut()
    assert deferred.held_bytes == 0  # the pause copied no row
    _put_some(tq_plane, "train", ["d"])  # after the barrier: must not reach the cut
    cut = deferred.materialize()
    assert cut.tables["training_rows"].column("key").to_pylist() == ["a", "b", "c"]
    assert cut.tables["training_rows"].column("input_ids").to_pylist() == [[0], [0, 1], [0, 1, 2]]


def test_write_once_refuses_a_second_put_of_a_key(tq_plane: TQDataPlane) -> None:
    _put_some(tq_plane, "train", ["a"])
    with pytest.raises(DataPlaneError, match="write-once"):
        _put_some(tq_plane, "train", ["a"])


def test_a_deferred_cut_whose_rows_changed_underneath_is_refused(tq_plane: TQDataPlane) -> None:
    """Rows the adapter did not put are read after the pause; another producer removing one of them
    before that breaks the contract: the save must fail, not lie."""
    TQHarness(tq_plane).put("train", ["a", "b"], {"input_lengths": np.array([1, 2], np.int32)}, training_tags(2))
    deferred = tq_plane.deferred_cut()
    tq.kv_clear(keys=["b"], partition_id="train")
    with pytest.raises(DataPlaneChangedError, match="changed or removed before they were read"):
        deferred.materialize()


def test_a_transferqueue_that_stops_answering_fails_the_call_at_its_deadline(tq_plane, monkeypatch) -> None:
    """TQ's client would wait forever on a dead storage unit; the adapter gives up with a clear error."""
    import threading

    release = threading.Event()
    monkeypatch.setattr(tq, "kv_list", lambda *a, **k: release.wait(30))
    plane = TQDataPlane(call_timeout_s=0.5)
    try:  # without the bound, kv_list would answer (True) after 30 s and is_empty would not raise
        with pytest.raises(DataPlaneError, match=r"TransferQueue did not answer list within"):
            plane.is_empty()
    finally:
        release.set()


# ---------------------------------------------------------------- the capture and the background load


def _tables_equal(a, b) -> None:
    assert set(a.tables) == set(b.tables)
    for kind in a.tables:
        assert a.tables[kind].equals(b.tables[kind], check_metadata=True), kind


def _uncaptured(tq_runtime) -> TQDataPlane:
    """A second adapter on the same TQ that keeps nothing: its cuts read every row out of TQ."""
    return TQDataPlane(token_capture_partitions={TOKEN_PARTITION}, capture_max_bytes=0)


def test_a_save_of_rows_the_adapter_put_reads_nothing_back_and_equals_reading_them(
        tq_plane: TQDataPlane, tq_runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataplane_contract import fill

    fill(AdapterHarness(tq_plane))  # several puts per partition, fields missing in some, an emptied partition
    from_tq = _uncaptured(tq_runtime).cut()

    def no_reads(self, *a):
        raise AssertionError("the adapter read rows back out of TQ")

    monkeypatch.setattr(client.TQCalls, "get", no_reads)
    _tables_equal(tq_plane.deferred_cut().materialize(), from_tq)
    _tables_equal(tq_plane.cut(), from_tq)


def _mixed_producers(tq_plane: TQDataPlane, complete: bool = False) -> None:
    """Rows of the adapter and of another producer (which the capture misses) interleaved, one cleared;
    the other producer's last two rows lack ``input_ids`` (which a training row needs) unless ``complete``."""
    h, other = AdapterHarness(tq_plane), TQHarness(tq_plane)
    rng = np.random.default_rng(3)

    def batch(n):
        return {"input_ids": Ragged([rng.integers(0, 9, rng.integers(1, 6)).astype(np.int32) for _ in range(n)]),
                "input_lengths": np.arange(n, dtype=np.int32)}

    h.put("train", ["a", "b"], batch(2), training_tags(2))
    other.put("train", ["c"], batch(1), training_tags(1, 2))
    h.put("train", ["d", "e", "f"], batch(3), training_tags(3, 3))
    other.put("train", ["g", "h"], batch(2) if complete else {"input_lengths": np.arange(2, dtype=np.int32)},
              training_tags(2, 6))
    tq.kv_clear(keys=["e"], partition_id="train")  # a consumer removed one captured key


def test_keys_put_by_another_producer_are_read_from_tq_between_captured_ones(tq_plane, tq_runtime) -> None:
    _mixed_producers(tq_plane)  # g and h lack input_ids: the partition is kept as dataplane_rows
    cut = tq_plane.deferred_cut().materialize()
    assert cut.tables[DATAPLANE].column("key").to_pylist() == ["a", "b", "c", "d", "f", "g", "h"]
    _tables_equal(cut, _uncaptured(tq_runtime).cut())


def test_a_save_writes_the_rows_window_by_window_and_they_are_the_rows_read_from_tq(
        tq_plane, tq_runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import functools


    _mixed_producers(tq_plane)
    windows: list[int] = []
    small = functools.partial(adapter.plan_source, window_rows=2)  # several windows, misses among them

    def counted(*a, **kw):
        src = small(*a, **kw)

        def seen():
            for w in src.windows():
                windows.append(len(w.keys))
                yield w

        return dataclasses.replace(src, windows=seen)

    monkeypatch.setattr(adapter, "plan_source", counted)
    # g and h (the third window's second row and the fourth) lack input_ids: the partition is known
    # to be dataplane_rows before any window is built, and written as such; then complete, training rows.
    for complete, kinds in ((False, {"training_rows": 0, "token_capture_rows": 0, DATAPLANE: 7}),
                            (True, {"training_rows": 7, "token_capture_rows": 0})):
        tq_plane.clear()
        _mixed_producers(tq_plane, complete=complete)
        windows.clear()
        store = SnapshotStore(str(tmp_path / f"s-{complete}"))
        draft = store.begin()
        written = tq_plane.deferred_cut().write(draft.part("tq", writer="tq"))
        draft.publish()
        snap = store.latest()
        assert windows == [2, 2, 2, 1] and dict(written.rows) == kinds
        assert snap.manifest.required_features == ([] if complete else [DATAPLANE])
        other = SnapshotStore(str(tmp_path / f"from-tq-{complete}"))
        draft = other.begin()
        _uncaptured(tq_runtime).cut().write(draft.part("tq", writer="tq"))  # every row read out of TQ, whole
        draft.publish()
        expected = other.latest()
        for kind in kinds:
            (entry,) = [e for e in snap.files() if e.kind == kind]
            (theirs,) = [e for e in expected.files() if e.kind == kind]
            assert snap.open_rows(entry).read_all().equals(expected.open_rows(theirs).read_all(), check_metadata=True)


def test_captured_rows_removed_after_the_pause_still_reach_that_cut_and_are_dropped_by_the_next(
        tq_plane: TQDataPlane) -> None:
    _put_some(tq_plane, "train", ["a", "b"])
    _put_some(tq_plane, "train", ["c"])
    held = tq_plane.capture.nbytes
    deferred = tq_plane.deferred_cut()
    tq.kv_clear(keys=["b", "c"], partition_id="train")  # after the barrier: the cut is as of the barrier
    assert deferred.materialize().tables["training_rows"].column("key").to_pylist() == ["a", "b", "c"]
    assert tq_plane.cut().tables["training_rows"].column("key").to_pylist() == ["a"]
    assert 0 < tq_plane.capture.nbytes < held  # the segment of c (all its keys gone) was dropped, a+b's kept


def test_past_its_memory_bound_the_capture_keeps_nothing_more_and_saves_read_the_rest(tq_runtime,
                                                                                     monkeypatch) -> None:
    plane = TQDataPlane(capture_max_bytes=40)
    plane.clear()
    try:
        _put_some(plane, "train", ["a"])  # 4 + 4 bytes of values + 16 of offsets: kept
        _put_some(plane, "train", ["b", "c"])  # would pass 40 bytes: not kept
        gets: list[list[str]] = []
        real = client.TQCalls.get
        monkeypatch.setattr(client.TQCalls, "get", lambda self, pid, keys, fields: gets.append(keys) or
                            real(self, pid, keys, fields))
        cut = plane.cut()
        assert gets == [["b", "c"]]
        assert cut.tables["training_rows"].column("input_ids").to_pylist() == [[0], [0], [0, 1]]
    finally:
        plane.clear()


class _Gate:
    """Holds every value put of a background load (a put with fields and no tags) until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        import threading

        self.open = threading.Event()
        self.fail = fail
        real = client.TQCalls.put

        def put(tq_self, pid, keys, fields, tags):
            if fields is not None and tags is None:
                assert self.open.wait(60)
                if self.fail:
                    raise RuntimeError("storage unit gone")
            return real(tq_self, pid, keys, fields, tags)

        monkeypatch.setattr(client.TQCalls, "put", put)


def _saved(plane: TQDataPlane, tmp_path: Path):
    from dataplane_contract import fill

    fill(AdapterHarness(plane))
    cut = plane.cut()
    snap, _ = publish_cut(cut, tmp_path / "s")
    plane.clear()
    return cut, snap


def test_a_restore_returns_before_tq_holds_the_values_and_a_save_meanwhile_holds_every_row(
        tq_plane: TQDataPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cut, snap = _saved(tq_plane, tmp_path)
    gate = _Gate(monkeypatch)
    tq_plane.load(snap, "tq")  # returns with the values still held at the gate
    deferred = tq_plane.deferred_cut()  # waits for the keys to be registered, not for the values
    assert not tq_plane._loading.done.is_set()
    _tables_equal(deferred.materialize(), cut)
    tq_plane.put("train", ["new"], {"input_lengths": np.array([9], np.int32)}, training_tags(1, 99))
    gate.open.set()
    progress = tq_plane.wait_loaded()
    assert progress.keys == 43 and progress.loaded_s >= progress.registered_s
    listed = list(tq.kv_list()["train"])
    assert listed[-1] == "new" and listed[:-1] == [k for k in cut.tables["training_rows"].column("key").to_pylist()
                                                   if k.startswith("t")]  # restored keys first, in order


def test_a_background_load_that_fails_is_raised_by_the_next_put(tq_plane, tmp_path, monkeypatch) -> None:
    _, snap = _saved(tq_plane, tmp_path)
    gate = _Gate(monkeypatch, fail=True)
    tq_plane.load(snap, "tq")
    gate.open.set()
    with pytest.raises(DataPlaneError, match="putting the restored rows into TransferQueue failed"):
        tq_plane.wait_loaded()
    with pytest.raises(DataPlaneError, match="storage unit gone"):
        _put_some(tq_plane, "train", ["later"])


def test_clear_stops_a_background_load_and_empties_tq(tq_plane, tmp_path, monkeypatch) -> None:
    _, snap = _saved(tq_plane, tmp_path)
    gate = _Gate(monkeypatch)
    tq_plane.load(snap, "tq")
    loading = tq_plane._loading
    assert loading.registered.wait(60)
    gate.open.set()  # the load is told to stop before its next put
    tq_plane.clear()
    assert loading.done.is_set() and tq_plane.is_empty() and tq_plane.wait_loaded() is None
