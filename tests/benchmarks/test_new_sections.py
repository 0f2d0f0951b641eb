"""A tiny run of the issue-6 benchmark sections (tq, pause, restore, discovery, memory) through
``python -m benchmarks.run --quick``'s code, each with its smallest configuration (``SMALLEST`` of
its module in place of ``QUICK``), in one process so Ray and TransferQueue start once: every report,
JSON file and plot is written, every table has its rows, the checks the sections make passed, and
the scratch folder is cleaned up. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_smoke import SMALLEST_RUN

from benchmarks import controller_bench, discovery_bench, memory_bench, run, tq_bench

NEW = ("tq", "pause", "restore", "discovery", "memory")
PNG = b"\x89PNG\r\n\x1a\n"


def _png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG, path


def test_new_sections_are_registered() -> None:
    assert all(name in run.SECTIONS for name in NEW)
    assert list(run.SECTIONS)[:3] == ["format", "s3", "gym"]  # the existing sections come first, unchanged
    assert list(run.SECTIONS).index("pause") < list(run.SECTIONS).index("restore")  # restore reuses pause's snapshots
    assert tq_bench.FULL["rows"] == (10_000, 100_000) and tq_bench.QUICK["rows"][-1] <= 10_000
    assert controller_bench.FULL["bytes"][-1] == 2 << 30 and controller_bench.QUICK["bytes"][-1] == 100 << 20
    assert controller_bench.FULL["target"] == (1000, 1 << 30)
    assert discovery_bench.FULL["sizes"] == (1, 10, 100, 1000)
    assert memory_bench.FULL["sizes"] == (100 << 20, 500 << 20, 1 << 30)


@SMALLEST_RUN
def test_new_sections_smallest_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in (tq_bench, controller_bench, discovery_bench, memory_bench):
        monkeypatch.setattr(mod, "QUICK", mod.SMALLEST)
    monkeypatch.setattr(controller_bench, "_STATE", {})
    results, scratch = tmp_path / "results", tmp_path / "scratch"
    argv = ["--quick", "--scratch", str(scratch), "--results", str(results)]
    for name in NEW:
        argv += ["--section", name]
    assert run.main(argv) == 0

    data = {name: json.loads((results / f"{name}-quick.json").read_text()) for name in NEW}
    md = {name: (results / f"{name}-quick.md").read_text() for name in NEW}
    for name in NEW:
        assert data[name]["section"] == name and data[name]["machine"]["cores"] >= 1
        assert md[name].startswith("# ") and "- **machine**:" in md[name] and "--section" in md[name]
        assert "\n|---" in md[name]  # at least one Markdown table

    # tq: both layouts at the smallest row count, every operation timed, the rows checked after each load
    tq = data["tq"]["result"]
    rows = tq_bench.SMALLEST["rows"][0]
    assert [(m["rows"], m["layout"]) for m in tq["measured"]] == [(rows, "dense"), (rows, "ragged")]
    for m in tq["measured"]:
        assert set(m["median_s"]) == {"ours save", "tq save", "ours load", "tq load", tq_bench.LOADED,
                                      tq_bench.UNCAPTURED}
        assert all(v > 0 for v in m["median_s"].values()) and m["raw_bytes"] > 0
        assert m["bytes"]["ours"] > 0 and m["bytes"]["tq"] > 0 and set(m["speedup"]) == {"save", "load", tq_bench.LOADED,
                                                                                   tq_bench.UNCAPTURED}
        assert m["checks"] and "equal what was put" in m["checks"][0]
        assert m["parts_median_s"]["tq_reads"] == 0  # a save of rows the adapter put reads none back
    assert [m["put_batch"] for m in tq["sweep"]] == list(tq_bench.SMALLEST["sweep_batches"])
    assert f"| {rows} | dense |" in md["tq"] and f"| {rows} | ragged |" in md["tq"] and "target" in md["tq"]
    _png(results / "tq_vs_checkpoint-quick.png")

    # pause: one point, both write modes, the controller's own steps, every rollout parked
    pause = data["pause"]["result"]
    (point,) = pause["points"]
    n = controller_bench.SMALLEST["rollouts"][0]
    assert point["n"] == n and sorted(point["axes"]) == ["bytes", "rollouts"]
    assert set(point["saves"]) == set(controller_bench.MODES)
    for mode, s in point["saves"].items():
        assert s["pause_s"] > 0 and s["parked"] == n and s["snapshot"]["bytes"] > 0, s
        assert set(controller_bench.STEPS) <= set(s["steps_s"]), s["steps_s"]
        assert s["report_mode"] == mode and sum(s["rows"].values()) == point["tq_rows"]
    assert "| 4 | background |" in md["pause"] and "| 4 | in_pause |" in md["pause"]
    _png(results / "pause_vs_rollouts-quick.png")
    _png(results / "pause_vs_bytes-quick.png")

    # restore: the pause section's background snapshot, on fresh servers and an empty TQ
    (point,) = data["restore"]["result"]["points"]
    x = point["restore"]
    assert x["restore_s"] > 0 and x["raw_read_s"] > 0 and x["ratio"] > 0 and x["file_bytes"] > 0
    saved = {kind: rows for kind, rows in x["checks"]["saved_rows"].items() if rows}  # segments: no file for none
    assert x["checks"]["continued"] == n and x["checks"]["rows"] == saved
    assert set(controller_bench.RESTORE_STEPS) <= set(x["steps_s"])
    assert "| 4 |" in md["restore"] and "raw read" in md["restore"]
    _png(results / "restore_vs_rollouts-quick.png")
    _png(results / "restore_vs_bytes-quick.png")

    # discovery: latest() sends the same store calls whatever the number of snapshots
    disc = data["discovery"]["result"]
    assert [m["snapshots"] for m in disc["measured"]] == list(discovery_bench.SMALLEST["sizes"])
    assert len({m["latest"]["op_count"] for m in disc["measured"]}) == 1
    for m in disc["measured"]:
        assert m["latest"]["ops_same_every_call"] and m["latest"]["median_ms"] > 0
        assert m["show_inprocess"]["median_ms"] > 0 and m["show_subprocess"]["median_ms"] > 0
    assert "| 10 |" in md["discovery"]
    _png(results / "discovery_vs_snapshots-quick.png")

    # memory: every operation at every size, in a child process each
    mem = data["memory"]["result"]
    assert len(mem["measured"]) == len(memory_bench.OPS) * len(memory_bench.SMALLEST["sizes"])
    for m in mem["measured"]:
        assert m["peak"]["VmRSS"] > 0 and m["ru_maxrss"] > 0 and m["seconds"] >= 0, m
        assert m.get("rows", 0) > 0, m
    assert set(mem["verdicts"]) == set(memory_bench.OPS)
    assert all(label in md["memory"] for label in memory_bench.LABELS.values())
    _png(results / "memory_vs_bytes-quick.png")

    assert not scratch.exists() or not any(scratch.iterdir())  # scratch files removed
