"""TransferQueue as a data plane (PyPI ``transferqueue`` 0.1.11).

- :mod:`.adapter`: :class:`~coordinator.dataplane.tq.adapter.TQDataPlane`, its cut of kept rows
  (:class:`~coordinator.dataplane.tq.adapter.PlannedCut`) and its background load;
- :mod:`.client`: the TransferQueue calls it makes, each bounded by a deadline;
- :mod:`.capture`: the rows it put, kept as they were put, so that a save never reads them back;
- :mod:`.tensors`: TransferQueue's tensors to and from the neutral form.

``adapter``, ``client`` and ``tensors`` import Ray, TransferQueue and torch (call
:func:`coordinator.ray_runtime.configure` before importing them, so that Ray stays on loopback);
``capture`` needs numpy and pyarrow only. This package itself imports none of them.
"""
