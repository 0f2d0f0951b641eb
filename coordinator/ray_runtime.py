"""Start and stop Ray and TransferQueue for the coordinator, on loopback, sized for a small machine.

Ray binds the machine's non-loopback address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in
the environment *before ray is imported* (Ray reads it once, at import). Importing this module
changes nothing: an entry point (a driver's ``main``, the benchmark runner, a test conftest that
starts Ray) calls :func:`configure` before anything imports ray or transfer_queue, and
:func:`start` checks that it took effect and refuses otherwise. With it, every Ray and
TransferQueue socket listens on 127.0.0.1.

TransferQueue's default configuration wants 3 CPUs (a controller and two storage units) and hangs
on a 2-CPU Ray; :data:`TQ_SMALL_CONFIG` uses one storage unit and a polling controller.
``tq.close()`` always runs before ``ray.shutdown()``.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

#: What :func:`configure` puts in the environment, each only where the variable is unset.
RUNTIME_ENV: dict[str, str] = {
    LOOPBACK_ENV: "0",  # Ray binds 127.0.0.1 only (read once, when ray is imported)
    "RAY_AUTH_MODE": "disabled",  # a single-user loopback cluster: no token (silences Ray's token warning)
}


def configure() -> dict[str, str]:
    """Set this process's environment for a loopback, single-user Ray: :data:`RUNTIME_ENV`.

    Call it from an entry point, before anything imports ray or transfer_queue (Ray reads
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, at import). Each variable is set only if it is
    unset, so a value the caller chose wins (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` for a
    multi-node cluster; :func:`start` with ``loopback=True`` then refuses). Idempotent. Processes
    started afterwards (Ray's own, the job's) inherit the variables. Returns the variables it set
    (empty when every one was already set).
    """
    set_now = {k: v for k, v in RUNTIME_ENV.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


#: TransferQueue on a 2-core machine: controller + one SimpleStorage unit (1 CPU each).
TQ_SMALL_CONFIG: dict[str, Any] = {
    "controller": {"polling_mode": True},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": None},
    },
}


class RayRuntimeError(RuntimeError):
    """Ray or TransferQueue could not be started as asked."""


def check_loopback() -> None:
    """Raise unless Ray, as imported in this process, keeps every socket on 127.0.0.1."""
    if os.environ.get(LOOPBACK_ENV) != "0":
        raise RayRuntimeError(f"{LOOPBACK_ENV} is {os.environ.get(LOOPBACK_ENV)!r}; call "
                              "coordinator.ray_runtime.configure() (or set it to 0) before importing ray")
    if "ray" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RayRuntimeError(
                f"ray was imported before {LOOPBACK_ENV}=0 was set, so it would bind a non-loopback "
                "address: call coordinator.ray_runtime.configure() (or set the variable) before importing ray")


@dataclass
class RayRuntime:
    """A running Ray instance (started here) with TransferQueue initialised on it."""

    tq_config: Any
    num_cpus: int
    started_at: float
    seconds: dict[str, float] = field(default_factory=dict)
    _closed: bool = False

    def close(self) -> None:
        """``tq.close()``, then ``ray.shutdown()`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        import ray
        import transfer_queue as tq

        try:
            tq.close()
        finally:
            ray.shutdown()

    def __enter__(self) -> RayRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(num_cpus: int = 2, tq_config: dict[str, Any] | None = None, *, object_store_memory: int | None = None,
          log_to_driver: bool = True, loopback: bool = True, ray_kwargs: dict[str, Any] | None = None) -> RayRuntime:
    """Start a new local Ray instance (never attach to another's) and initialise TransferQueue on it.

    ``tq_config`` is merged over TransferQueue's defaults; :data:`TQ_SMALL_CONFIG` when ``None``.
    Takes roughly 5-30 s on a loaded 2-core machine (each actor imports torch).
    """
    if loopback:
        check_loopback()
    import ray

    if ray.is_initialized():
        raise RayRuntimeError("Ray is already initialised in this process")
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"address": "local", "num_cpus": num_cpus, "include_dashboard": False,
                              "log_to_driver": log_to_driver}
    if object_store_memory is not None:
        kwargs["object_store_memory"] = object_store_memory
    kwargs.update(ray_kwargs or {})
    ray.init(**kwargs)
    t1 = time.perf_counter()
    import transfer_queue as tq

    conf = copy.deepcopy(TQ_SMALL_CONFIG if tq_config is None else tq_config)
    try:
        final = tq.init(conf)
    except BaseException:
        ray.shutdown()
        raise
    t2 = time.perf_counter()
    return RayRuntime(tq_config=final, num_cpus=num_cpus, started_at=time.time(),
                      seconds={"ray_init": t1 - t0, "tq_init": t2 - t1})


__all__ = ["LOOPBACK_ENV", "RUNTIME_ENV", "TQ_SMALL_CONFIG", "RayRuntime", "RayRuntimeError", "check_loopback",
           "configure", "start"]
