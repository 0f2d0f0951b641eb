"""gymkit.collector: Python's cyclic collector held off for a block, process-wide, nesting and
overlapping across threads, and given back as it was found; what a kept block leaves alive frozen
when the last hold ends."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from gymkit.collector import HeldWhile, collector_held, hold, holds


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    gc.enable()
    gc.unfreeze()
    yield
    gc.enable()
    gc.unfreeze()


class State:
    """An object the collector tracks, standing for a restored record."""


def frozen(*objs: object) -> bool:
    """Whether every one of ``objs`` is in the permanent generation (``gc.get_objects()`` lists the
    tracked objects of the three collected generations only; one walk of the heap for all of them)."""
    collected = {id(o) for o in gc.get_objects()}
    return not any(id(obj) in collected for obj in objs)


def test_the_collector_is_off_in_the_block_and_on_after() -> None:
    with collector_held():
        assert not gc.isenabled() and holds() == 1
    assert gc.isenabled() and holds() == 0


def test_a_block_that_raises_gives_the_collector_back() -> None:
    with pytest.raises(RuntimeError, match="commit failed"), collector_held():
        raise RuntimeError("commit failed")
    assert gc.isenabled() and holds() == 0


def test_nested_blocks_enable_it_when_the_outer_one_ends() -> None:
    with collector_held():
        with collector_held():
            assert holds() == 2
        assert not gc.isenabled() and holds() == 1  # the outer block still holds it
    assert gc.isenabled()


def test_a_process_that_turned_it_off_keeps_it_off() -> None:
    gc.disable()
    with collector_held():
        assert not gc.isenabled()
    assert not gc.isenabled() and holds() == 0


def test_overlapping_holds_on_threads_end_with_the_last_one() -> None:
    # Two servers of one process commit at once, on worker threads: the first to finish must not
    # turn the collector on under the second.
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with collector_held():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with collector_held():
            second_in.set()
            first_out.wait(5)
            seen["after the first ended"] = gc.isenabled()
        seen["after both"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after the first ended": False, "after both": True} and holds() == 0


def test_a_kept_block_freezes_what_it_left_alive() -> None:
    with collector_held(keep=True):
        restored = [State() for _ in range(100)]
        assert gc.get_freeze_count() == 0  # not while the block runs
    assert gc.isenabled() and gc.get_freeze_count() >= len(restored)
    assert frozen(*restored)
    after = State()
    assert not frozen(after)  # what comes later is the collector's as before


def test_a_plain_block_freezes_nothing() -> None:
    with collector_held():
        kept = State()
    assert gc.get_freeze_count() == 0 and not frozen(kept)


def test_a_kept_block_that_raises_freezes_nothing() -> None:
    with pytest.raises(RuntimeError, match="restore failed"), collector_held(keep=True):
        partial = State()
        raise RuntimeError("restore failed")
    assert gc.get_freeze_count() == 0 and not frozen(partial) and gc.isenabled()


def test_the_freeze_waits_for_the_outer_hold() -> None:
    with collector_held():
        with collector_held(keep=True):
            restored = State()
        assert gc.get_freeze_count() == 0  # a step of another server still runs in the outer hold
        late = State()
    assert frozen(restored, late) and gc.isenabled()


def test_a_process_that_turned_it_off_still_freezes_a_kept_block() -> None:
    gc.disable()
    with collector_held(keep=True):
        restored = State()
    assert frozen(restored) and not gc.isenabled()


def test_a_hold_ends_once_however_often_it_is_released() -> None:
    first, second = hold(), hold()
    assert holds() == 2 and not gc.isenabled()
    first.release()
    first.release()  # a second release of the same hold ends nothing more
    assert holds() == 1 and not gc.isenabled()
    second.release()
    assert holds() == 0 and gc.isenabled()


def test_held_while_follows_its_owners_state() -> None:
    state = HeldWhile()
    state.set(True)
    state.set(True)  # already held: no second hold
    assert holds() == 1 and not gc.isenabled()
    with collector_held(keep=True):  # a restore inside the owner's hold
        restored = State()
    assert not frozen(restored) and not gc.isenabled()  # the freeze waits for the owner's hold
    state.set(False)
    state.set(False)
    assert holds() == 0 and gc.isenabled() and frozen(restored)
