"""Write-behind: bytes arrive in order, memory in flight is bounded, a failure on the thread
reaches the caller with its own type, and an abort drops what was queued."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import StoreError
from snapformat.write_behind import COALESCE, SMALL, WriteBehind


class Sink:
    """A target that records what it got; optionally blocks until released, or fails."""

    def __init__(self, fail_after: int | None = None, gate: threading.Event | None = None) -> None:
        self.data = bytearray()
        self.writes = 0
        self.fail_after = fail_after
        self.gate = gate

    def write(self, data) -> int:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_after is not None and self.writes >= self.fail_after:
            raise StoreError("sink: cannot write: the disk is full (ENOSPC)")
        self.writes += 1
        self.data += memoryview(data).cast("B")
        return len(data)


@given(st.lists(st.binary(max_size=3 * SMALL), max_size=40))
def test_every_byte_arrives_in_order(pieces: list[bytes]) -> None:
    sink = Sink()
    w = WriteBehind(sink)
    for p in pieces:
        assert w.write(p) == len(p)
    w.finish()
    assert bytes(sink.data) == b"".join(pieces)
    assert w.tell() == w.size == len(sink.data)


def test_small_pieces_are_gathered_into_few_writes() -> None:
    sink = Sink()
    w = WriteBehind(sink)
    for _ in range(10_000):
        w.write(b"0123456789abcdef")
    w.finish()
    assert len(sink.data) == 160_000 and sink.writes <= 160_000 // COALESCE + 1


def test_arrow_buffers_are_passed_without_a_copy_and_kept_alive() -> None:
    sink = Sink()
    w = WriteBehind(sink)
    buf = pa.py_buffer(b"x" * (2 * SMALL))
    w.write(buf)
    del buf  # the queue's reference keeps the memory alive until it is written
    w.finish()
    assert bytes(sink.data) == b"x" * (2 * SMALL)


def test_memory_in_flight_is_bounded() -> None:
    gate = threading.Event()
    sink = Sink(gate=gate)
    w = WriteBehind(sink, max_pending=4 * SMALL)
    done = threading.Event()

    def writer() -> None:
        for _ in range(20):
            w.write(b"y" * SMALL)  # each is handed over on its own (not below SMALL)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    assert not done.wait(0.5)  # blocked: the target holds still and the bound is reached
    assert w._pending <= 4 * SMALL
    gate.set()
    t.join(10)
    w.finish()
    assert len(sink.data) == 20 * SMALL


def test_a_failed_write_on_the_thread_is_raised_with_its_type() -> None:
    sink = Sink(fail_after=1)
    w = WriteBehind(sink)
    w.write(b"a" * SMALL)
    w.write(b"b" * SMALL)  # fails on the thread
    with pytest.raises(StoreError, match="the disk is full"):
        for _ in range(1000):  # the next write, or finish, sees it
            w.write(b"c" * SMALL)
        w.finish()
    with pytest.raises(StoreError):
        w.finish()


def test_a_writer_waiting_for_room_when_the_thread_fails_gets_its_error_and_counts_nothing() -> None:
    gate = threading.Event()
    w = WriteBehind(Sink(fail_after=0, gate=gate), max_pending=SMALL)
    w.write(b"a" * SMALL)  # the bound is reached: the next write waits for room
    outcome: list[BaseException] = []

    def second() -> None:
        try:
            w.write(b"b" * SMALL)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    t = threading.Thread(target=second)
    t.start()
    threading.Timer(0.2, gate.set).start()  # the thread's write then fails while the second one waits
    t.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], StoreError)
    assert w._pending == 0  # the refused piece was never counted as in flight
    with pytest.raises(StoreError):
        w.finish()


@pytest.mark.parametrize("end", ["finish", "abort"])
def test_a_write_after_the_end_is_refused(end: str) -> None:
    sink = Sink()
    w = WriteBehind(sink)
    w.write(b"a" * SMALL)
    getattr(w, end)()
    with pytest.raises(ValueError, match="finished or aborted"):
        w.write(b"b")
    if end == "finish":
        assert bytes(sink.data) == b"a" * SMALL
    else:  # an abort may drop what was queued, never add to it
        assert bytes(sink.data) in (b"", b"a" * SMALL)


def test_abort_drops_what_is_queued() -> None:
    gate = threading.Event()
    sink = Sink(gate=gate)
    w = WriteBehind(sink)
    for _ in range(5):
        w.write(b"z" * SMALL)
    threading.Timer(0.2, gate.set).start()
    w.abort()
    assert len(sink.data) < 5 * SMALL  # at most the piece being written when the abort came
    assert w.closed


def test_a_refused_batch_stops_the_thread_and_publishes_nothing(tmp_path) -> None:
    from schemas.errors import InvalidRecordError
    from snapformat import SnapshotStore
    from snapformat.example import rollouts, token_batches

    batches = [b for b, _ in token_batches(rollouts(8, 1), 1, batch_rows=16)]
    bad = batches[0].set_column(batches[0].schema.get_field_index("attempt_index"), "attempt_index",
                                pa.array([-1] * batches[0].num_rows, pa.int32()))
    store = SnapshotStore(str(tmp_path / "s"))
    draft = store.begin()
    with pytest.raises(InvalidRecordError, match="attempt_index -1 is negative"):
        draft.part("gym/model/p").write_rows("tokens.arrow", "token_capture_rows", [*batches, bad])
    assert not [t for t in threading.enumerate() if t.name == "snapformat-write-behind"]
    draft.abandon()
    assert store.latest() is None
