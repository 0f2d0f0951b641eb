"""The ``parked`` benchmark section at its smallest: every step runs in its own child and does what
it claims (the counts of what was written come back, the snapshot holds exactly the bytes written
and verifies). Behaviour only: no time is asserted."""

from __future__ import annotations

import math
from pathlib import Path

from bench_smoke import SMALLEST_RUN

from benchmarks import parked_bench as pb

N, SERVERS = 300, 2


@SMALLEST_RUN
def test_the_smallest_run_writes_adopts_verifies_and_reads_back_every_record(tmp_path: Path) -> None:
    logged: list[str] = []
    result = pb.run([N], 1, SERVERS, tmp_path / "scratch", tmp_path, True, logged.append,
                    rows_log=tmp_path / "rows.jsonl")
    rows = {r["step"]: r for r in result["rows"]}
    assert set(rows) == set(pb.STEPS)
    write, adopt, verify, read = rows["write"], rows["adopt"], rows["verify"], rows["read"]

    # What the write step wrote: per server an agent folder (archives of <= 512 members, index,
    # continuations, manifest), a ledger (one lineage per rollout, storage references, manifest) and
    # a resources folder (one session per rollout, manifest).
    per = [len(pb.server_range(N, SERVERS, s)) for s in range(SERVERS)]
    expected_files = sum(math.ceil(k / 512) + 3 + (k + 2) + (k + 1) for k in per)
    assert write["files"] == expected_files and write["bytes"] > 0

    # Adopted and published: the snapshot holds exactly the files and bytes written, each folder a
    # listed part (SPEC §10.4), so the manifest itself lists one part manifest per folder and nothing
    # that grows with the rollouts; it opens within the reader's bounds.
    assert adopt["published"] is True and adopt["readable"] is True and adopt["parts"] == 3 * SERVERS
    assert adopt["gym_files"] == expected_files and adopt["manifest_files"] == 3 * SERVERS
    assert adopt["gym_file_bytes"] == write["bytes"]

    # Gym's own checks of every folder, then the snapshot's verification.
    assert verify["gym_folders"] == 3 * SERVERS and verify["snapshot_ok"] is True and verify["problems"] == []

    # What a restore parses: every record, every ledger row (3 calls per rollout), every session.
    assert (read["agent_records"], read["ledger_rows"], read["sessions"]) == (N, pb.CALLS * N, N)

    # The report and its plot; the rows were logged as they came; the scratch folder is gone.
    text = pb.markdown(result)
    assert f"| write | {N:,} | 1 |" in text and "log-log slope" in text
    assert Path(result["plots"][0]).is_file()
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == len(pb.STEPS)
    assert not any((tmp_path / "scratch").glob("parked-*"))
    assert result["slopes"]["write"]["time"] is None  # one size: no slope


def test_the_records_are_valid_for_released_gym_and_in_gyms_order() -> None:
    assert pb.validate_sample(40, 2, sample=5) == 5 * pb.CALLS
    ids = [pb.rollout_id(i) for i in pb.server_range(1000, 3, 1)]
    assert ids == sorted(ids) and len(ids) == 333
    rec = pb.agent_record(8, "tools0")
    assert (rec.attempt_index, rec.resource_state_revisions) == (1, {"tools0": pb.CALLS})
    assert pb.loglog_slope([10, 100, 1000], [1, 10, 100]) == 1.0
    assert abs(pb.loglog_slope([10, 100, 1000], [5, 5, 5])) < 1e-12
