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

On a multi-node cluster started apart (``ray start``), :func:`attach` connects the driver instead and
puts TransferQueue on the node that carries a given custom resource. TransferQueue 0.1.11 has a
setting for its storage units only: ``backend.SimpleStorage.required_node_resource`` (each unit gets
a hard node-affinity strategy to a node with that resource, round-robin). Its controller is created
by ``tq.init`` with ``num_cpus=1`` and Ray's default strategy, which prefers the node of the process
that calls it, and no placement option. So :func:`attach` calls ``tq.init`` inside a small actor
pinned to that node by the resource (:class:`TQHost`), which then owns the controller and the units
(they live as long as it does: they die with the node, or with the job); afterwards it asks each of
them for its node and refuses to go on if one is elsewhere.
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
    """A running Ray instance (started here, or a cluster attached to) with TransferQueue initialised on it."""

    tq_config: Any
    num_cpus: int
    started_at: float
    seconds: dict[str, float] = field(default_factory=dict)
    _closed: bool = False
    #: When attached to a cluster (:func:`attach`): the actor that initialised TransferQueue and owns it.
    tq_host: Any = None
    #: When attached: the node id of the TQ host, TQ's controller and each storage unit (:meth:`TQHost.placement`).
    placement: dict[str, str] = field(default_factory=dict)
    attached: bool = False  # connected to a cluster started apart (:func:`attach`), not started here

    def close(self) -> None:
        """``tq.close()``, then ``ray.shutdown()`` (idempotent). Attached to a cluster: TransferQueue is
        closed by its host actor (bounded: a host on a dead node is killed instead), the host is
        killed, and the driver disconnects; the cluster stays up."""
        if self._closed:
            return
        self._closed = True
        import ray

        if self.attached and self.tq_host is None:  # no TransferQueue was started: disconnect only
            ray.shutdown()
            return
        if self.tq_host is not None:
            try:
                ray.get(self.tq_host.close.remote(), timeout=TQ_CLOSE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - its node may be gone: killing the host ends what it owns
                print(f"ray_runtime: closing TransferQueue through its host failed ({type(exc).__name__}); "
                      "killing the host", file=sys.stderr)
            finally:
                try:
                    ray.kill(self.tq_host, no_restart=True)
                finally:
                    ray.shutdown()
            return
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


TQ_CONTROLLER_NAME, TQ_NAMESPACE = "TransferQueueController", "transfer_queue"  # TransferQueue's own names
TQ_CLOSE_TIMEOUT_S = 30.0
TQ_INIT_TIMEOUT_S = 300.0  # tq.init takes 10-30 s on a loaded 2-core machine (each actor imports torch)


def _node_id(_actor: object = None) -> str:
    """The node id of the process it runs in (called in an actor through ``__ray_call__``)."""
    import ray

    return ray.get_runtime_context().get_node_id()


class TQHost:
    """Initialises TransferQueue from the node it runs on, and owns its actors (see :func:`attach`)."""

    def init(self, conf: dict[str, Any]) -> dict[str, Any]:
        """``tq.init(conf)`` here; returns the final configuration as plain data (TQ's own objects, such
        as its ZMQ addresses, as strings: the driver need not import TransferQueue to read it)."""
        import json

        import transfer_queue as tq
        from omegaconf import OmegaConf

        final = tq.init(conf)
        if final is conf:  # tq.init attached to a TransferQueue someone else had started (and ignored conf)
            raise RayRuntimeError("a TransferQueue was already running on this cluster: not starting another")
        return json.loads(json.dumps(OmegaConf.to_container(final), default=str))

    def placement(self, storage_units: int) -> dict[str, str]:
        """Node id of this host, of TransferQueue's controller and of each storage unit (by TQ's own
        actor names: ``TransferQueueController``, ``TransferQueueStorageUnit#<i>``)."""
        import ray

        actors = {TQ_CONTROLLER_NAME: ray.get_actor(TQ_CONTROLLER_NAME, namespace=TQ_NAMESPACE)}
        actors |= {f"TransferQueueStorageUnit#{i}": ray.get_actor(f"TransferQueueStorageUnit#{i}")
                   for i in range(storage_units)}
        out = {"TQHost": _node_id()}
        out |= dict(zip(actors, ray.get([a.__ray_call__.remote(_node_id) for a in actors.values()])))
        return out

    def close(self) -> None:
        import transfer_queue as tq

        tq.close()


def node_of(actor: Any, timeout: float = 60.0) -> str:
    """The node id an actor runs on (asked of the actor itself)."""
    import ray

    return ray.get(actor.__ray_call__.remote(_node_id), timeout=timeout)


def attach(address: str, tq_config: dict[str, Any] | None = None, *, tq_resource: str | None = None,
           tq: bool = True, log_to_driver: bool = True, loopback: bool = True, wait_free_s: float = 60.0,
           init_timeout_s: float = TQ_INIT_TIMEOUT_S, ray_kwargs: dict[str, Any] | None = None) -> RayRuntime:
    """Connect this driver to a running Ray cluster at ``address`` (``host:port`` of its GCS) and start
    TransferQueue on it, its controller and storage units on a node with the custom resource
    ``tq_resource`` (anywhere Ray likes when ``None``).

    ``tq_config`` is merged over TransferQueue's defaults (:data:`TQ_SMALL_CONFIG` when ``None``).
    A TransferQueue still registered on the cluster (a previous job's, being torn down) is waited for
    up to ``wait_free_s``; if it stays, this refuses (two jobs cannot share TQ's global names).
    Raises :class:`RayRuntimeError` if any TQ actor ends up off the node its host runs on, and Ray's
    ``GetTimeoutError`` if TransferQueue is not up within ``init_timeout_s`` (no node with the resource,
    say). With ``tq`` false only the driver connects (a job whose data plane is not TransferQueue).
    """
    if loopback:
        check_loopback()
    import ray

    if ray.is_initialized():
        raise RayRuntimeError("Ray is already initialised in this process")
    t0 = time.perf_counter()
    ray.init(address=address, log_to_driver=log_to_driver, **(ray_kwargs or {}))
    if not tq:
        return RayRuntime(tq_config=None, num_cpus=0, started_at=time.time(),
                          seconds={"ray_init": time.perf_counter() - t0}, attached=True)
    try:
        _wait_no_tq(wait_free_s)
        t1 = time.perf_counter()
        conf = copy.deepcopy(TQ_SMALL_CONFIG if tq_config is None else tq_config)
        options: dict[str, Any] = {"num_cpus": 0}
        if tq_resource is not None:
            conf.setdefault("backend", {}).setdefault("SimpleStorage", {})["required_node_resource"] = tq_resource
            options["resources"] = {tq_resource: 0.01}
        units = int(conf.get("backend", {}).get("SimpleStorage", {}).get("num_data_storage_units", 2))
        host = ray.remote(TQHost).options(**options).remote()
        try:
            final = ray.get(host.init.remote(conf), timeout=init_timeout_s)
            placement = ray.get(host.placement.remote(units), timeout=init_timeout_s)
        except BaseException:
            ray.kill(host, no_restart=True)
            raise
        off = {name: node for name, node in placement.items() if node != placement["TQHost"]}
        if off:
            ray.kill(host, no_restart=True)
            raise RayRuntimeError(f"TransferQueue's actors {sorted(off)} were placed off the TQ host's node "
                                  f"{placement['TQHost']}: {off}")
    except BaseException:
        ray.shutdown()
        raise
    t2 = time.perf_counter()
    return RayRuntime(tq_config=final, num_cpus=0, started_at=time.time(),
                      seconds={"ray_init": t1 - t0, "tq_init": t2 - t1}, tq_host=host, placement=placement,
                      attached=True)


def _wait_no_tq(timeout: float) -> None:
    import ray

    end = time.monotonic() + timeout
    while True:
        try:
            ray.get_actor(TQ_CONTROLLER_NAME, namespace=TQ_NAMESPACE)
        except ValueError:
            return
        if time.monotonic() > end:
            raise RayRuntimeError(f"a TransferQueue ({TQ_CONTROLLER_NAME!r} in namespace {TQ_NAMESPACE!r}) is "
                                  f"still registered on this cluster after {timeout}s: another job's, or one not yet "
                                  "torn down")
        time.sleep(0.5)


__all__ = ["LOOPBACK_ENV", "RUNTIME_ENV", "TQ_SMALL_CONFIG", "RayRuntime", "RayRuntimeError", "TQHost", "attach",
           "check_loopback", "configure", "node_of", "start"]
