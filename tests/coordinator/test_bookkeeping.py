"""The controller's bookkeeping, workload and result rows, without Ray or servers."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.bookkeeping import Bookkeeping, ControllerRecords
from coordinator.checkpoint.cut import take_cut, write_cut_parts
from coordinator.dataplane import InMemoryDataPlane
from coordinator.samples import TOKEN_PARTITION, TRAIN_PARTITION, RolloutResult, TurnResult, put_results
from coordinator.workload import Loader, Workload
from schemas.errors import InvalidRecordError
from snapformat import SnapshotStore, verify_snapshot

WL = Workload(prompts=5, group_size=2, min_turns=1, max_turns=3, seed=9, sandbox_every=2)


def test_workload_is_a_pure_function_of_its_seed() -> None:
    again = Workload(prompts=5, group_size=2, min_turns=1, max_turns=3, seed=9, sandbox_every=2)
    assert [WL.group(i) for i in range(5)] == [again.group(i) for i in range(5)]
    assert sorted(WL.order(0)) == list(range(5))
    assert WL.order(0) != Workload(prompts=5, group_size=2, seed=10).order(0) or WL.order(1) != WL.order(0)
    assert all(1 <= s.turns <= 3 for i in range(5) for s in WL.group(i))
    assert WL.group(0)[0].tools == ("notes", "sandbox") and WL.group(1)[0].tools == ("notes",)
    with pytest.raises(IndexError):
        WL.group(5)


def test_loader_moves_only_when_a_whole_group_was_dispatched() -> None:
    books = Bookkeeping.fresh(WL)
    first = books.loader.peek()
    specs = books.reserve_next()
    assert specs is not None and books.loader.consumed == 0
    books.dispatched([specs[0].rollout_id])  # half the group: the loader must not move
    assert books.loader.consumed == 0 and books.loader.peek() == first
    assert books.reserve_next() == []  # the group is still partly reserved: nothing new
    assert books.attempts[specs[1].rollout_id].state == "reserved"
    books.dispatched([specs[1].rollout_id])
    assert books.loader.consumed == 1 and books.loader.peek() != first


def _drive(books: Bookkeeping, n_groups: int) -> None:
    for _ in range(n_groups):
        specs = books.reserve_next()
        assert specs is not None
        books.dispatched([s.rollout_id for s in specs])


def test_transitions_and_refusals() -> None:
    books = Bookkeeping.fresh(WL)
    _drive(books, 2)
    rid = next(iter(books.attempts))
    books.sealed(rid, 0, rid, TRAIN_PARTITION)
    assert books.acks_owed[rid].result_key == rid and books.replay[rid].status == "ready"
    with pytest.raises(InvalidRecordError, match="run 0 sealed"):
        books.sealed(rid, 0, rid, TRAIN_PARTITION)  # a result is stored once
    with pytest.raises(InvalidRecordError, match="nothing"):
        books.sealed("p99_g0", 0, "x", TRAIN_PARTITION)
    books.acknowledged(rid)
    assert rid not in books.acks_owed
    other = next(r for r, a in books.attempts.items() if a.state == "dispatched")
    books.next_run(other, 0, 1)
    assert books.attempts[other].attempt_index == 1 and books.abandoned[-1].state == "abandoned"
    assert books.abandoned[-1].attempt_index == 0
    with pytest.raises(InvalidRecordError, match="expected 2"):
        books.next_run(other, 1, 3)
    with pytest.raises(InvalidRecordError, match="run 0 sealed"):
        books.next_run(rid, 0, 1)  # a stored result has no run n + 1


def test_a_restored_run_is_reserved_until_the_loop_sends_it_again() -> None:
    """After a restore, run n + 1 of an unfinished rollout is ``reserved``: the loop sends it (Gym's
    ``/run`` of n + 1, which picks up the restored continuation) once Gym is resumed; only Gym's
    acceptance makes it ``dispatched``."""
    books = Bookkeeping.fresh(WL)
    _drive(books, 2)
    consumed = books.loader.consumed
    rid = next(r for r, a in books.attempts.items() if a.state == "dispatched")
    books.next_run(rid, 0, 1)
    assert (books.attempts[rid].attempt_index, books.attempts[rid].state) == (1, "reserved")
    assert rid in {a.rollout_id for a in books.open_attempts()}  # still counts against max_in_flight
    assert books.spec(rid).rollout_id == rid  # what the loop sends again
    again = Bookkeeping.from_records(WL, msgspec.json.decode(msgspec.json.encode(books.records()),
                                                             type=ControllerRecords), "test")
    assert (again.attempts[rid].attempt_index, again.attempts[rid].state) == (1, "reserved")
    assert [(a.rollout_id, a.attempt_index) for a in again.abandoned] == [(rid, 0)]
    books.dispatched([rid])
    assert (books.attempts[rid].attempt_index, books.attempts[rid].state) == (1, "dispatched")
    assert books.loader.consumed == consumed  # a re-sent run does not move the loader
    books.sealed(rid, 1, rid, TRAIN_PARTITION)
    assert books.acks_owed[rid].attempt_index == 1 and books.replay[rid].attempt_index == 1


def test_groups_finalize_train_and_finish() -> None:
    books = Bookkeeping.fresh(WL)
    _drive(books, WL.prompts)
    assert books.reserve_next() is None
    for rid, a in list(books.attempts.items()):
        books.sealed(rid, a.attempt_index, rid, TRAIN_PARTITION)
        books.acknowledged(rid)
    assert len(books.finalized_order) == WL.prompts
    batch = books.claim_batch(2)
    assert [g.state for g in batch] == ["claimed_for_training"] * 2
    books.applied(batch)
    assert not books.done()
    books.applied(books.claim_batch(3))
    assert books.done() and books.train_steps == 2
    assert {e.status for e in books.replay.values()} == {"applied_uncheckpointed"}


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(0, 5), sealed=st.integers(0, 10), restarts=st.integers(0, 3))
def test_records_round_trip_through_json(groups: int, sealed: int, restarts: int) -> None:
    books = Bookkeeping.fresh(WL)
    _drive(books, groups)
    for rid, a in list(books.attempts.items())[:sealed]:
        books.sealed(rid, a.attempt_index, rid, TRAIN_PARTITION)
    for a in [a for a in books.attempts.values() if a.state == "dispatched"][:restarts]:
        books.next_run(a.rollout_id, a.attempt_index, a.attempt_index + 1)
    recs = books.records()
    decoded = msgspec.json.decode(msgspec.json.encode(recs), type=ControllerRecords)
    again = Bookkeeping.from_records(WL, decoded, "test")
    assert again.records() == recs


def test_records_of_another_workload_are_refused() -> None:
    recs = Bookkeeping.fresh(WL).records()
    with pytest.raises(InvalidRecordError, match="another dataset"):
        Bookkeeping.from_records(Workload(prompts=6, group_size=2), recs, "snap")


def _result(rid: str, turns: int) -> RolloutResult:
    ids, lens, traj = [5, 6, 7], [], []
    for t in range(turns):
        lens.append(len(ids))
        gen = [100 + t, 200 + t]
        traj.append(TurnResult(f"call-{t}", gen, [-0.5, -0.25]))
        ids += gen + [31998, t]  # the generation, then a tool result
    keys = [rid] * (turns - 1) + [f"{rid}-a1"]
    return RolloutResult(rollout_id=rid, attempt_index=1, capture_key=f"{rid}-a1", outcome="finished",
                         trajectory=traj, turn_keys=keys, input_ids=ids, prompt_lens=lens)


def test_results_become_rows_that_pass_the_row_schemas(tmp_path: Path) -> None:
    plane = InMemoryDataPlane({TOKEN_PARTITION})
    books = Bookkeeping.fresh(WL)
    results = [_result("p1_g0", 3), _result("p1_g1", 2)]
    assert put_results(plane, results, {"p1_g0": "p1", "p1_g1": "p1"}) == ["p1_g0", "p1_g1"]
    row = plane.get(TRAIN_PARTITION, "p1_g0")
    assert row["token_mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert row["generation_logprobs"][3] == -0.5 and int(row["input_lengths"]) == 15
    tags = plane.list()[TOKEN_PARTITION]
    assert tags["p1_g0/call-2"]["attempt_index"] == 1 and tags["p1_g0/call-0"]["capture_key"] == "p1_g0"
    store = SnapshotStore(str(tmp_path / "store"))
    draft = store.begin()
    rows, _ = write_cut_parts(draft, take_cut(plane, books))
    assert rows.rows == {"training_rows": 2, "token_capture_rows": 5}
    published = draft.publish()
    report = verify_snapshot(store.open(published.manifest.sequence))
    assert report.ok, report


def test_a_result_that_does_not_line_up_is_refused() -> None:
    bad = msgspec.structs.replace(_result("p1_g0", 2), prompt_lens=[3, 4])
    with pytest.raises(ValueError, match="call-1 is not at 4"):
        put_results(InMemoryDataPlane({TOKEN_PARTITION}), [bad], {"p1_g0": "p1"})


def test_loader_epochs() -> None:
    loader = Loader(Workload(prompts=2, group_size=1), epochs=2)
    seen = []
    while (p := loader.peek()) is not None:
        seen.append((loader.epoch, p))
        loader.advance()
    assert [e for e, _ in seen] == [0, 0, 1, 1] and sorted(p for _, p in seen[:2]) == [0, 1]
