"""Tests of :mod:`coordinator.dataplane`, laid out as the package is (``tq/`` for
:mod:`coordinator.dataplane.tq`).

``dataplane_contract.py`` here is the contract every DataPlane implementation passes; the in-memory
data plane's tests (``test_memory.py``) and TransferQueue's (``tq/test_adapter.py``) subclass it.
pytest puts a conftest's folder on ``sys.path`` before it collects anything below it, which is what
makes the contract importable from ``tq/`` too. No fixtures: the Ray runtime's is in
``tests/coordinator/conftest.py``.
"""
