"""A tiny run of the Gym protocol benchmark (5 and 10 parked rollouts, one repeat each): every phase
is measured with a positive time, the servers report as many parked rollouts as were started, bytes
were written, and the report has every row. No timing assertions."""

from __future__ import annotations

from pathlib import Path

from bench_smoke import SMALLEST_RUN

from benchmarks import gym_bench, run

COUNTS = (5, 10)


@SMALLEST_RUN
def test_gym_bench_tiny_run(tmp_path: Path) -> None:
    res = gym_bench.run(counts=COUNTS, quick=True, log=lambda _msg: None, workdir=tmp_path / "scratch")

    assert res["counts"] == list(COUNTS) and res["quick"]
    keys = [k for k, _, _ in gym_bench.PHASES]
    assert [p["key"] for p in res["phases"]] == keys
    assert [p["n"] for p in res["per_n"]] == list(COUNTS)
    for p in res["per_n"]:
        n = p["n"]
        assert p["repeats"] == len(p["cycles"]) == 1
        assert set(p["median_s"]) == set(keys)
        assert all(t > 0 for t in p["median_s"].values()), p["median_s"]
        for c in p["cycles"]:
            assert set(c["times_s"]) == set(keys) and all(t > 0 for t in c["times_s"].values()), c["times_s"]
            assert all(c["bytes"][k] > 0 for k in ("model", "agent", "resource"))
            assert c["bytes"]["total"] == c["bytes"]["model"] + c["bytes"]["agent"] + c["bytes"]["resource"]
            counts = c["counts"]
            assert counts["requested"] == n
            # What the servers said: every started rollout was parked, committed and restored.
            assert counts["agent_commit_parked"] == n and counts["agent_commit_completed_unacknowledged"] == 0, counts
            assert counts["model_commit_rollouts"] == n and counts["model_commit_calls"] >= n, counts
            assert counts["resource_commit_sessions"] == n, counts
            assert counts["agent_restore_continuations"] == n, counts
            assert counts["model_restore_calls"] == counts["model_commit_calls"], counts
            assert counts["resource_restore_sessions"] == n, counts
            assert counts["in_flight_after_prepare"] == {"model": 0, "agent": 0}, counts
            assert counts["resource_prepare_sessions"] == n, counts

    md = gym_bench.markdown(res)
    assert md.startswith("# ") and "\n\n" in md
    assert "| phase | N = 5 (ms) | N = 10 (ms) | growth 5->10 |" in md
    for _, label, _ in gym_bench.PHASES:
        assert f"| {label} |" in md or f"| **{label}** |" in md, label
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())  # cleaned up


def test_gym_section_is_registered() -> None:
    assert "gym" in run.SECTIONS
    assert gym_bench.QUICK_COUNTS == (10, 100) and gym_bench.FULL_COUNTS == (10, 100, 1000)
