"""The TransferQueue calls the adapter makes that transferqueue 0.1.11 does not export.

``coordinator.dataplane.tq.client.TQCalls`` uses three private members of TransferQueue's client
(listed in README.md, "TransferQueue's private calls"): the public KV API has no way to read a
partition's field schema or to drop an empty partition from the controller. An upgrade that
renames or removes one must fail here, by name, before any save or restore meets it. No Ray needed:
the members are checked on the classes.
"""

from __future__ import annotations

import inspect

import pytest
from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient

from coordinator.dataplane.tq import client as tq_client

#: (class, member, whether it is a coroutine function, the parameters the adapter passes by position)
PINNED = [
    (AsyncTransferQueueClient, "_get_partition_meta", True, ["partition_id"]),
    (AsyncTransferQueueClient, "_clear_partition_in_controller", True, ["partition_id"]),
    (TransferQueueClient, "_run_coroutine", False, ["coro"]),
]


@pytest.mark.parametrize(("cls", "name", "is_async", "params"), PINNED, ids=[p[1] for p in PINNED])
def test_a_pinned_private_call_still_exists_with_the_signature_the_adapter_uses(
        cls: type, name: str, is_async: bool, params: list[str]) -> None:
    member = getattr(cls, name, None)
    assert member is not None, (
        f"transferqueue's {cls.__name__}.{name} is gone: coordinator/dataplane/tq/client.py (TQCalls) "
        "depends on it; find its public replacement and update the adapter and README.md")
    assert inspect.iscoroutinefunction(member) == is_async, f"{cls.__name__}.{name}: sync/async changed"
    got = [p for p in inspect.signature(member).parameters if p != "self"]
    assert got[:len(params)] == params, f"{cls.__name__}.{name}{inspect.signature(member)}: expected {params} first"


def test_the_adapter_uses_exactly_the_pinned_private_calls() -> None:
    """Every private member of TransferQueue's client the adapter touches is in PINNED (and the README)."""
    import re

    source = inspect.getsource(tq_client)
    used = set(re.findall(r"\.client\.(_[a-z_]+)\(", source))
    assert used == {name for _, name, _, _ in PINNED}, used
