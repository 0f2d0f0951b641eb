"""A test's probe of Python's cyclic collector: what ``gc.isenabled()`` said each time a module's
function was called (the kits' commits run on worker threads, where no participant hook runs)."""

from __future__ import annotations

import gc
from typing import Any

import pytest


def collector_state_at_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[bool]:
    """Wrap ``module.name``; the returned list gets ``gc.isenabled()`` at each call, in order."""
    seen: list[bool] = []
    original = getattr(module, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen
