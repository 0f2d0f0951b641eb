"""A tiny run of the ``token_store`` benchmark section through ``python -m benchmarks.run``'s code, with
its smallest configuration (``SMALLEST`` in place of ``QUICK``): the report and JSON are written, the
tables have their rows, both stores froze what was put, the scratch folder is gone. No timing
assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_smoke import SMALLEST_RUN

from benchmarks import run, token_store_bench


def test_section_is_registered_last_and_configured() -> None:
    assert list(run.SECTIONS)[-1] == "token_store"
    assert token_store_bench.FULL["calls"] == token_store_bench.QUICK["calls"] == 100
    assert min(token_store_bench.FULL["repeats"], token_store_bench.QUICK["repeats"]) >= 5  # medians of 5+


def test_built_rollout_is_a_gym_chain() -> None:
    entries = token_store_bench.build_rollout("r", 3, seed=1)
    assert [e.parent_call_id for e in entries] == [None, "call-0000", "call-0001"]
    assert len(entries[1].prompt_token_ids) == len(entries[0].prompt_token_ids) + 128 + 64
    assert all(e.digest and e.continuation_fingerprint for e in entries)


@SMALLEST_RUN
def test_smallest_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_store_bench, "QUICK", token_store_bench.SMALLEST)
    results, scratch = tmp_path / "results", tmp_path / "scratch"
    assert run.main(["--quick", "--section", "token_store", "--scratch", str(scratch), "--results", str(results)]) == 0
    data = json.loads((results / "token_store-quick.json").read_text())
    md = (results / "token_store-quick.md").read_text()
    r = data["result"]
    assert data["section"] == "token_store" and r["quick"]
    small = token_store_bench.SMALLEST
    assert len(r["local"]["runs"]["ours"]) == len(r["local"]["runs"]["gym"]) == small["repeats"]
    assert r["local"]["median"]["ours"]["puts_per_s"] > 0 and r["local"]["median"]["gym"]["puts_per_s"] > 0
    assert r["local"]["puts_ratio"] > 0 and r["seaweedfs"]["put"]["p50_ms"] > 0
    assert r["seaweedfs"]["calls"] == small["s3_calls"]
    assert len(r["seaweedfs"]["freeze_ms"]["runs"]) == small["s3_repeats"]
    assert md.startswith("# Token-capture store benchmark") and "- **machine**:" in md
    assert "## Local disk" in md and "## SeaweedFS" in md and "| **ours / Gym** |" in md
    assert "Puts per second: x" in md and "Per-put latency on SeaweedFS: p50" in md
    assert not scratch.exists()  # the work folder (and the scratch folder it made) are removed
