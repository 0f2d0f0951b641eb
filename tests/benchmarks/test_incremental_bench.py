"""A tiny run of the ``incremental`` benchmark section (issue 21) through ``python -m benchmarks.run
--quick``'s code, with its smallest configuration (``SMALLEST`` in place of ``QUICK``): Ray + TQ and
SeaweedFS start, every snapshot is saved incrementally and fully on both stores, the incremental
ones list their parent's segments, restores give back every row, the GCs sweep exactly the garbage,
and the report, JSON and plot are written. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_smoke import SMALLEST_RUN

from benchmarks import incremental_bench as ib
from benchmarks import run

PNG = b"\x89PNG\r\n\x1a\n"


def test_section_is_registered_and_configured() -> None:
    names = list(run.SECTIONS)
    assert "incremental" in names and names[-1] == "token_store"  # token_store stays last
    assert ib.FULL["start_rows"] == 100_000 and ib.FULL["snapshots"] == 20
    assert ib.FULL["growth"] == 0.05 and ib.FULL["consume"] == 1_000 and ib.FULL["restore_repeats"] == 5
    assert ib.FULL["gc_local"] == (1_000, 100_000) and ib.FULL["gc_repeats"] == 5


def test_gc_windows_cover_every_object_once_shared_by_neighbours() -> None:
    windows = ib._windows(10, 1_000)
    assert windows[0] == (0, 100) and windows[1] == (50, 200) and windows[-1][1] == 1_000
    assert set().union(*(range(lo, hi) for lo, hi in windows)) == set(range(1_000))


@SMALLEST_RUN
def test_smallest_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ib, "QUICK", ib.SMALLEST)
    results, scratch = tmp_path / "results", tmp_path / "scratch"
    assert run.main(["--quick", "--section", "incremental", "--scratch", str(scratch), "--results", str(results)]) == 0
    data = json.loads((results / "incremental-quick.json").read_text())
    md = (results / "incremental-quick.md").read_text()
    r = data["result"]
    small = ib.SMALLEST
    assert data["section"] == "incremental" and r["quick"] and r["stores"] == ["local", "s3"]
    assert [iv["snapshot"] for iv in r["intervals"]] == list(range(1, small["snapshots"] + 1))
    assert r["intervals"][0]["total_rows"] == small["start_rows"]
    for iv in r["intervals"][1:]:
        assert iv["grew"] > 0 and iv["consumed"] == small["consume"]
    assert len(r["saves"]) == 4 * small["snapshots"] and len(r["probes"]) == small["snapshots"] - 1
    for s in r["saves"]:
        assert s["rows_saved"] == s["total_rows"] and s["bytes_written"] > 0 and s["save_s"] > 0, s
        assert s["store_calls_total"] > 0 and (s["s3_requests"] or 0) >= (1 if s["store"] == "s3" else 0), s
        if s["mode"] == ib.INC and s["snapshot"] > 1:
            assert s["shared_bytes"] > 0 and s["bytes_ratio"] > 0, s
    for p in r["probes"]:
        assert p["row_bytes_written"] == 0 and p["new_rows"] == 0, p  # nothing new: every segment listed again
    assert set(r["restore"]) == {"local", "s3"} and len(r["restore"]["local"]["times_s"]["incremental"]["loaded"]) == 1
    g = r["gc_local"]
    assert g["swept"] == g["garbage"] and g["kept"]["committed"] == g["objects"] == small["gc_local"][1]
    assert [m["swept"] == m["garbage"] for m in r["gc_s3"]["sizes"]] == [True, True]
    assert r["gc_s3"]["extrapolated"]["s3_requests"] > r["gc_s3"]["sizes"][-1]["s3_requests"]
    assert md.startswith("# Incremental snapshots benchmark") and "- **machine**:" in md and "--section" in md
    assert "## Headline (for README)" in md and "## Every snapshot, SeaweedFS" in md
    assert md.count("PASS") + md.count("FAIL") >= 5  # one verdict per target
    assert (results / "incremental_bytes-quick.png").read_bytes()[:8] == PNG
    assert not scratch.exists()
