"""The whole job as real processes: Ray, TransferQueue, Gym servers, the actors. It is SIGKILLed at
once mid-run (every process of its tree), started again on the same store, and must restore and end
with exactly the rows of an uninterrupted run (what ``make demo`` shows, at test size)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from coordinator.accounting import content, trained_once
from coordinator.job_process import JobProcess, _stat
from harness import CONFIG, WORKLOAD
from snapformat import SnapshotStore, verify_snapshot

IDS = [s.rollout_id for i in range(WORKLOAD.prompts) for s in WORKLOAD.group(i)]
SLOW_MS = 400  # rollouts last a few seconds: the kill lands mid-run


def test_the_whole_job_killed_at_once_restores_and_finishes(tmp_path: Path, reference_rows) -> None:
    from coordinator.demo import tables_of

    store = SnapshotStore(str(tmp_path / "store"))
    config = msgspec.structs.replace(CONFIG, snapshot_attempt_interval_s=0.3)
    first = JobProcess(store.url, tmp_path / "job", config=config, workload=WORKLOAD, model_slow_ms=SLOW_MS,
                       log_name="job-1.log")
    first.wait_for(lambda: store.list() and (tmp_path / "job" / "gym.pids.json").exists(),
                   "a published snapshot", timeout=240)
    gym_pids = json.loads((tmp_path / "job" / "gym.pids.json").read_text()).values()
    killed = first.kill()
    assert set(gym_pids) <= set(killed) and len(killed) >= 6  # driver, Ray's processes, Gym servers
    assert all(_stat(p) is None or Path(f"/proc/{p}/stat").read_text().split()[2] in "ZX" for p in killed)
    assert not any("job: done" in line for line in first.lines())  # it really was killed mid-run
    newest = store.list()[0].sequence

    second = JobProcess(store.url, tmp_path / "job", config=config, workload=WORKLOAD, model_slow_ms=SLOW_MS,
                        outcome=tmp_path / "outcome.json", log_name="job-2.log")
    assert second.wait(300) == 0, second.tail()
    doc = second.outcome()
    restored = doc["outcome"]["restored"]
    assert restored["sequence"] == newest and restored["rows"]
    assert content(tables_of(doc)) == reference_rows
    assert trained_once(doc["records"], IDS) == []
    for c in store.list():
        assert verify_snapshot(store.open(c.sequence)).ok
