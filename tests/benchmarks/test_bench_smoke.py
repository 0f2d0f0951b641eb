"""A tiny run of ``make bench``'s code (8 MiB of rows): every row is measured, every number is
positive, the reports are written and the scratch folder is cleaned up. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

from bench_smoke import SMALLEST_RUN

from benchmarks import format_bench, run
from snapformat.store import local as local_store

EXPECTED = [
    (format_bench.SAVE, format_bench.LIB_SAVE),
    (format_bench.SAVE, format_bench.RAW_SAVE),
    (format_bench.SAVE, format_bench.RAW_SAVE_HINTED),
    (format_bench.SAVE, format_bench.PICKLE_SAVE),
    (format_bench.LOAD_WARM, format_bench.LIB_VERIFY),
    (format_bench.LOAD_WARM, format_bench.LIB_NOVERIFY),
    (format_bench.LOAD_WARM, format_bench.LIB_OPEN),
    (format_bench.LOAD_WARM, format_bench.RAW_LOAD),
    (format_bench.LOAD_WARM, format_bench.RAW_LOAD_NEW),
    (format_bench.LOAD_WARM, format_bench.PICKLE_LOAD),
    (format_bench.LOAD_COLD, format_bench.LIB_VERIFY),
    (format_bench.LOAD_COLD, format_bench.LIB_NOVERIFY),
    (format_bench.LOAD_COLD, format_bench.RAW_LOAD),
    (format_bench.LOAD_COLD, format_bench.RAW_LOAD_SAME),
    (format_bench.LOAD_COLD, format_bench.PICKLE_LOAD),
]


@SMALLEST_RUN
def test_format_bench_tiny_run(tmp_path: Path, capsys) -> None:
    results, scratch = tmp_path / "results", tmp_path / "scratch"
    argv = ["--size-gib", str(8 / 1024), "--repeats", "1", "--section", "format",
            "--scratch", str(scratch), "--results", str(results)]
    assert run.main(argv) == 0

    data = json.loads((results / "format.json").read_text())
    res = data["result"]
    assert res["in_memory_bytes"] >= 8 << 20
    assert res["rows"] > 0 and res["batches"] > 0
    assert res["arrow_file_bytes"] > 0 and res["pickle_file_bytes"] > 0
    got = [(m["phase"], m["method"]) for m in res["measured"]]
    expected = EXPECTED if local_store._sync_file_range is not None else [
        e for e in EXPECTED if e[1] != format_bench.RAW_SAVE_HINTED]  # no writeback hints off Linux
    assert got == expected
    for m in res["measured"]:
        assert len(m["times_s"]) == 1
        assert all(t > 0 for t in m["times_s"]), m
        assert m["file_bytes"] > 0 and m["gb_per_s"] > 0 and m["library_speed_vs_this"] > 0, m
        assert len(m["cpu_s"]) == 1 and m["median_cpu_s"] >= 0, m
    assert data["machine"]["pyarrow"] and data["machine"]["cores"] >= 1
    assert any("meets" in s or "MISSES" in s for s in res["summary"])

    md = (results / "format.md").read_text()
    assert "| phase | method |" in md
    assert md.count("\n| save |") + md.count("\n| load (") == len(expected)
    assert "python -m benchmarks.run --size-gib" in md and "pyarrow" in md
    assert "| phase | method |" in capsys.readouterr().out  # the table is printed too

    assert not scratch.exists() or not any(scratch.iterdir())  # scratch files removed


def test_quick_options_and_report_names() -> None:
    opts = run.parse_args(["--quick"])
    assert opts.size_gib == run.QUICK_SIZE_GIB and opts.repeats == run.QUICK_REPEATS
    opts = run.parse_args(["--size-gib", "2"])
    assert opts.size_gib == 2 and opts.repeats == 3 and opts.cold


@SMALLEST_RUN
def test_format_section_runs_every_default_size(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(run, "FORMAT_SIZES_GIB", (0.002, 0.004))
    monkeypatch.setattr(run, "LARGE_GIB", 0.004)
    monkeypatch.setattr(run, "LARGE_REPEATS", 1)
    opts = run.parse_args(["--repeats", "2", "--no-cold", "--scratch", str(tmp_path)])
    body, data = run._format_section(opts, lambda _msg: None)
    assert "## 0.002 GiB of rows" in body and "## 0.004 GiB of rows" in body
    assert set(data["by_size_gib"]) == {"0.002", "0.004"}
    assert data["by_size_gib"]["0.002"]["repeats"] == 2 and data["by_size_gib"]["0.004"]["repeats"] == 1
    one, single = run._format_section(run.parse_args(["--size-gib", "0.002", "--repeats", "1", "--no-cold",
                                                      "--scratch", str(tmp_path)]), lambda _msg: None)
    assert "GiB of rows" not in one and single["repeats"] == 1
