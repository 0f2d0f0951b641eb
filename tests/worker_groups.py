"""Which xdist group each test goes to under ``make test``'s two workers (``--dist loadgroup``).

Each module is one group, so it runs whole in one worker and its module fixtures start once. Every
module that starts Ray (any of its tests uses :data:`RAY_FIXTURES`) is in the one group ``ray``, so
two Ray instances never share the machine's 2 cores."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: Fixtures that start Ray: the test session's Ray with TransferQueue, and the multi-node cluster.
RAY_FIXTURES = frozenset({"tq_runtime", "cluster"})
RAY_GROUP = "ray"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def xdist_groups(tests: Sequence[tuple[str, Iterable[str]]]) -> list[str]:
    """The group of each ``(nodeid, fixture names)``, in order."""
    ray_modules = {module_of(nodeid) for nodeid, fixtures in tests if RAY_FIXTURES.intersection(fixtures)}
    return [RAY_GROUP if module_of(nodeid) in ray_modules else module_of(nodeid) for nodeid, _ in tests]
