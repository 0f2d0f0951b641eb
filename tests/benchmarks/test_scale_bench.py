"""A tiny run of the scale benchmark (issue 22 §2): 2 agent servers hosted in one process with their
resources servers, a model in another, 40 rollouts, one pause into the draft, one staged (the
staging lever) and one staged with the resources servers committing alongside (the commit-order
lever), and one restore in each restore order (the restore-order lever). Asserts what the servers did (every rollout parked, committed,
restored; the counts agree; the report and plot are written), never how fast."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
from bench_smoke import SMALLEST_RUN

from benchmarks import run, scale_bench

POINT = (2, 40)


@SMALLEST_RUN
def test_scale_bench_tiny_run(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    res = scale_bench.run(points=(POINT,), quick=True, log=lambda _msg: None, workdir=tmp_path / "scratch",
                          staging=staging, alongside=True, restore_concurrent=True)

    assert res["failed"] == [] and len(res["per_point"]) == 1
    p = res["per_point"][0]
    servers, n = POINT
    assert (p["servers"], p["n"]) == POINT and p["repeats"] == p["restore_repeats"] == 1
    keys = [k for k, _, _ in scale_bench.PHASES]
    assert set(p["median_s"]) == set(keys) and all(p["median_s"][k] > 0 for k in keys), p["median_s"]
    c = p["counts"]
    # Every rollout was parked by its agent, committed by all three kinds of server, and restored.
    assert c["agent_servers"] == c["resources_servers"] == servers, c
    assert c["prepare_agent_parked"] == n and c["prepare_agent_running"] == 0, c
    assert c["prepare_resource_sessions"] == n == c["resource_commit_sessions"] == c["resource_restore_sessions"], c
    assert c["agent_commit_parked"] == n == c["agent_restore_continuations"], c
    assert c["model_commit_rollouts"] == n == c["model_restore_rollouts"], c
    assert c["model_commit_calls"] >= n and c["model_restore_calls"] == c["model_commit_calls"], c
    assert c["snapshot_bytes"] > 0
    t = p["pauses"][0]["times_s"]  # the pause ends at the resume; adoption and publish come after it
    # (the sum equals the total up to float rounding; adopting inside the pause would count it twice)
    assert t["until_published"] >= t["pause_total"] + t["adopt"] + t["publish"] - 1e-6, t
    assert t["adopt"] > 0 and t["publish"] > 0, t
    # the baseline counted every Gym file: per agent its archive, index, continuations and manifest; per resources
    # server a session per rollout and its manifest; the model a lineage per rollout, its references and manifest
    assert p["gym_files"] == 4 * servers + (n + servers) + (n + 2) and len(p["bare_files_s"]) == 1, p
    assert p["gym_file_bytes"] > 0

    st = p["staged"]  # the same repeat paused again with Gym's files staged, then copied into the draft
    assert st["root"] == str(staging) and len(st["pauses"]) == 1
    assert st["pauses"][0]["counts"]["agent_commit_parked"] == n == p["pauses"][0]["counts"]["agent_commit_parked"]
    assert set(scale_bench.STAGED_ROWS) <= set(st["median_s"]) and all(st["median_s"][k] > 0
                                                                       for k in scale_bench.STAGED_ROWS), st
    assert not any(staging.iterdir())  # each staging folder removed after its publish, the baseline's too
    al = p["alongside"]  # and once more through an actor committing the resources servers alongside
    assert len(al["pauses"]) == 1 and set(scale_bench.ALONGSIDE_ROWS) <= set(al["median_s"])
    ac = al["pauses"][0]["counts"]
    assert ac["agent_commit_parked"] == ac["model_commit_rollouts"] == ac["resource_commit_sessions"] == n, ac
    rc = p["restore_concurrent"]  # the same snapshot restored again on fresh servers, every participant at once
    assert len(rc["restores"]) == 1 and set(scale_bench.RESTORE_ROWS) <= set(rc["median_s"]), rc
    cc = rc["restores"][0]["counts"]
    assert cc["agent_restore_continuations"] == cc["model_restore_rollouts"] == cc["resource_restore_sessions"] == n
    assert rc["paired_ratio_restore_total"] > 0

    # The CPU of each step was counted, for both kinds of pause: the servers worked in the prepare and the commit
    # (parking, writing Gym's files), and a step's CPU is part of its pause's.
    for cpu in (p["median_cpu_s"], st["median_cpu_s"], al["median_cpu_s"]):
        assert {f"{k}_{w}" for k in scale_bench.CPU_ROWS for w in ("servers", "driver")} <= set(cpu), cpu
        assert cpu["prepare_servers"] > 0 and cpu["commit_servers"] > 0, cpu
        assert cpu["pause_total_servers"] >= cpu["commit_servers"] and cpu["pause_total_driver"] >= 0, cpu

    md = scale_bench.markdown(res, scale_bench.plot(res, tmp_path / "results"))
    assert md.startswith("# Scale benchmark") and "| step | 2 srv, 40 (ms) |" in md
    for _, label, _ in scale_bench.PHASES:
        assert label.strip() in md, label
    assert "## Lever: Gym's files staged in RAM" in md and "| 2 srv, 40: draft | staged |" in md
    assert "## Lever: the resources servers commit alongside" in md and "NeMo-RL's order | alongside |" in md
    assert "## Lever: every participant restores at once" in md and "NeMo-RL's order | concurrent |" in md
    assert "## Where the pause's CPU goes" in md and "| 2 srv, 40: wall s | servers CPU s |" in md
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())  # cleaned up


@pytest.mark.parametrize("threads", [1, scale_bench.FLOOR_THREADS])
def test_the_bare_files_baseline_writes_the_sizes_it_is_given(tmp_path: Path, threads: int) -> None:
    sizes = {"gym/agent/instance-x/a.tar": 10_000, "gym/resources/t/s.a0.json": 0, "gym/resources/t/manifest.json": 7}
    assert scale_bench.bare_files(tmp_path / "bare", sizes, threads) > 0
    written = {p.relative_to(tmp_path / "bare").as_posix(): p.stat().st_size
               for p in (tmp_path / "bare").rglob("*") if p.is_file()}
    assert written == sizes  # every file at its size under its name, no temporary file left


def test_processes_cpu_counts_the_work_of_a_live_process_and_not_a_gone_one() -> None:
    import subprocess
    import sys

    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                             "while time.process_time() < end: pass\ninput()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while scale_bench.processes_cpu_s([busy.pid]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = scale_bench.processes_cpu_s([busy.pid])
        assert 0.3 <= used < 5, used  # its 0.3 s of spinning (and its start), not nothing and not the wall time
    finally:
        busy.communicate(b"\n", timeout=30)
    assert scale_bench.processes_cpu_s([busy.pid]) == 0.0  # reaped: nothing to count


def test_the_restore_lever_restores_in_fresh_processes_and_freezes_only_the_kept_kind() -> None:
    import asyncio

    res = asyncio.run(scale_bench.model_restore_lever(30, calls=2, repeats=1))
    assert res["rollouts"] == 30 and list(res["runs"]) == list(scale_bench.RESTORE_COLLECTOR_KINDS)
    frozen = {kind: [r["frozen_objects"] for r in runs] for kind, runs in res["runs"].items()}
    # each restore ran in its own process: only the kept hold froze anything, and this process froze nothing
    assert frozen["collector_on"] == frozen["collector_held"] == [0] and frozen["held_and_frozen"][0] > 0
    assert all(r["restore_s"] > 0 and r["work_after_s"] > 0 for runs in res["runs"].values() for r in runs)
    assert gc.get_freeze_count() == 0


def test_the_parking_lever_parks_and_releases_every_rollout_each_round() -> None:
    import asyncio

    from refgym.agent_server import MAX_OPEN_CALLS

    rollouts = 3 * MAX_OPEN_CALLS
    res = asyncio.run(scale_bench.agent_park_rounds(rollouts, rounds=2))
    assert res["parked"] == [rollouts, rollouts]  # every rollout parked in each round
    assert len(res["park_cpu_s_each"]) == len(res["release_cpu_s_each"]) == 2
    assert all(x > 0 for x in res["park_s_each"] + res["park_cpu_s_each"])


def test_scale_plot_is_written(tmp_path: Path) -> None:
    fake = {"quick": True, "per_point": [
        {"servers": s, "n": n, "median_s": {k: 0.01 * n / 100 for k, _, _ in scale_bench.PHASES}}
        for s, n in ((1, 100), (2, 200))]}
    paths = scale_bench.plot(fake, tmp_path)
    assert [p.name for p in paths] == ["scale_pause-quick.png"] and paths[0].stat().st_size > 0


def test_scale_section_is_registered() -> None:
    assert "scale" in run.SECTIONS
    assert (10, 10_000) in scale_bench.FULL_POINTS and (100, 100_000) in scale_bench.FULL_POINTS
