"""The few TransferQueue calls the adapter makes, in one place, each bounded by a deadline.

TransferQueue's client waits forever for a storage unit that died; every call goes through a small
pool of threads so that the caller gives up at its deadline with a clear error (a hung thread stays
behind). Three of the calls use client methods TransferQueue 0.1.11 does not export
(``_get_partition_meta`` for the field schema, ``_clear_partition_in_controller`` to remove an
empty partition, ``_run_coroutine`` to call them): they are confined to :class:`TQCalls`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import numpy as np
import transfer_queue as tq
from tensordict import TensorDict

from coordinator.dataplane.errors import DataPlaneError

DEFAULT_CALL_TIMEOUT_S = 300.0

_EMPTY_PARTITION_PROBE = "__dataplane_empty_partition_probe__"
_CALLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tq-call")


def _bounded(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: TQCalls, *args: Any) -> Any:
        future = _CALLS.submit(method, self, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FuturesTimeout:
            raise DataPlaneError(f"TransferQueue did not answer {method.__name__} within {self.timeout_s:.0f}s "
                                 "(is its controller or a storage unit dead?)") from None
    call.__name__ = method.__name__
    return call


class TQCalls:
    """The TransferQueue calls of the adapter, each bounded by ``timeout_s`` (TQ must be initialised)."""

    def __init__(self, timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        self.client = tq.get_client()
        self.timeout_s = timeout_s

    @_bounded
    def list(self) -> dict[str, dict[str, Any]]:
        return tq.kv_list()

    @_bounded
    def global_indexes(self, pid: str, keys: list[str]) -> list[int]:
        meta = self.client.kv_retrieve_meta(keys=keys, partition_id=pid, create=False)
        return list(meta.global_indexes)

    @_bounded
    def field_schema(self, pid: str) -> dict[str, dict[str, Any]]:
        meta = self.client._run_coroutine(self.client._get_partition_meta(pid))
        return {} if meta is None else dict(meta.field_schema)

    @_bounded
    def produced(self, pid: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        gi, status = self.client.get_production_status(data_fields=[name], partition_id=pid)
        if gi is None:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
        return gi.numpy().astype(np.int64), status[:, 0].numpy() == 1

    @_bounded
    def get(self, pid: str, keys: list[str], fields: list[str]) -> TensorDict:
        return tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=fields)

    @_bounded
    def put(self, pid: str, keys: list[str], fields: TensorDict | None, tags: list[dict] | None) -> None:
        tq.kv_batch_put(keys=keys, partition_id=pid, fields=fields, tags=tags)

    @_bounded
    def make_empty_partition(self, pid: str) -> None:
        self.client.kv_retrieve_meta(keys=[_EMPTY_PARTITION_PROBE], partition_id=pid, create=True)
        tq.kv_clear(keys=[_EMPTY_PARTITION_PROBE], partition_id=pid)

    @_bounded
    def drop_partition(self, pid: str, has_keys: bool) -> None:
        if has_keys:
            self.client.clear_partition(pid)
        else:  # clear_partition skips a partition with no samples; remove it from the controller directly
            self.client._run_coroutine(self.client._clear_partition_in_controller(pid))


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``(start, step)`` of each call that carries at most ``size`` of ``n`` rows (0: all at once)."""
    step = size if size and size > 0 else max(n, 1)
    return [(s, step) for s in range(0, n, step)]


__all__ = ["DEFAULT_CALL_TIMEOUT_S", "TQCalls", "chunks"]
