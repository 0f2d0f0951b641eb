"""Many processes racing to publish the same sequence: exactly one wins, every loser is told so.

16 spawned processes run 8 rounds against one local store. In each round every process begins a
draft (so all aim at the same sequence), writes and closes a small part naming itself, waits on a
barrier, then publishes at once. Per round: exactly one publish returns; every other raises
``CommitConflictError`` whose message names the sequence; the committed snapshot is the winner's
(its own data, not a mix) and verifies; the losers' drafts are neither listed nor left on disk.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
from pathlib import Path

import pytest

from schemas.controller import LoaderPlace
from schemas.errors import CommitConflictError, NotPublishedError
from snapformat import SnapshotStore, layout, open_snapshot, verify_snapshot

WORKERS = 16
ROUNDS = 8
BARRIER_TIMEOUT_S = 120.0  # generous: 16 interpreters start on 2 shared cores
RESULT_TIMEOUT_S = 180.0


def _race_worker(store_path: str, worker: int, barrier, results) -> None:
    """One racer; reports ``(round, worker, sequence, snapshot_id, outcome, message)`` per round."""
    store = SnapshotStore(store_path)
    for rnd in range(ROUNDS):
        barrier.wait(BARRIER_TIMEOUT_S)  # every racer has finished the previous round's publish
        draft = store.begin()
        part = draft.part("controller", writer=f"racer-{worker}")
        part.write_json("loader", "loader_place", LoaderPlace(epoch=rnd, consumed=worker, seed=worker))
        part.close()  # publish's remaining work is small, so the racers meet at the commit
        barrier.wait(BARRIER_TIMEOUT_S)
        try:
            draft.publish()
            outcome, message = "won", ""
        except CommitConflictError as exc:
            outcome, message = "conflict", str(exc)
        except Exception as exc:  # reported, so the test names any other failure
            outcome, message = f"error:{type(exc).__name__}", str(exc)
        results.put((rnd, worker, draft.sequence, draft.snapshot_id, outcome, message))


def _run_race(store_path: str) -> list[tuple]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(store_path, w, barrier, results)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    collected = []
    try:
        for _ in range(WORKERS * ROUNDS):
            collected.append(results.get(timeout=RESULT_TIMEOUT_S))
    except queue.Empty:
        pass  # the assertions below name what is missing
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert len(collected) == WORKERS * ROUNDS, f"only {len(collected)} results arrived"
    return collected


def test_racing_publishers_exactly_one_wins_each_round(tmp_path: Path) -> None:
    store_path = str(tmp_path / "store")
    results = _run_race(store_path)
    store = SnapshotStore(store_path)
    winners: dict[int, tuple[int, str]] = {}
    losers: list[str] = []
    for rnd in range(ROUNDS):
        rows = [r for r in results if r[0] == rnd]
        assert sorted(r[1] for r in rows) == list(range(WORKERS))
        seqs = {r[2] for r in rows}
        assert seqs == {rnd + 1}, f"round {rnd}: racers aimed at {seqs}, not one sequence"
        won = [r for r in rows if r[4] == "won"]
        lost = [r for r in rows if r[4] != "won"]
        assert len(won) == 1, f"round {rnd}: {len(won)} winners"
        for _, worker, seq, _, outcome, message in lost:
            assert outcome == "conflict", f"round {rnd} racer {worker}: {outcome}: {message}"
            assert re.search(rf"\bsequence {seq}\b", message), message
        winners[rnd + 1] = (won[0][1], won[0][3])
        losers.extend(r[3] for r in lost)

    commits = store.list()
    assert [c.sequence for c in commits] == list(range(ROUNDS, 0, -1))
    for commit in commits:
        worker, snapshot_id = winners[commit.sequence]
        assert commit.snapshot_id == snapshot_id
        snap = store.open(commit.sequence)
        assert verify_snapshot(snap).ok
        assert snap.records("loader")[0].consumed == worker  # the winner's own part, not a mix

    assert len(losers) == ROUNDS * (WORKERS - 1)
    listed = {c.snapshot_id for c in commits}
    assert listed.isdisjoint(losers)
    on_disk = {p.name for p in (tmp_path / "store" / layout.SNAPSHOTS).iterdir()}
    assert on_disk == listed, "a losing draft was left behind"
    for loser in losers[:: WORKERS - 1]:  # one per round: a loser's location is not a snapshot
        with pytest.raises(NotPublishedError):
            open_snapshot(f"{store_path}/{layout.snapshot_dir(loser)}")
