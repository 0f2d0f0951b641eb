"""``make test``'s two workers: each module is one xdist group, and every module that starts Ray
shares the one group ``ray`` (tests/worker_groups.py, applied by tests/conftest.py)."""

from __future__ import annotations

import pytest
from worker_groups import RAY_GROUP, xdist_groups


def test_each_module_is_a_group_and_a_module_starting_ray_goes_whole_to_the_ray_group() -> None:
    tests = [
        ("tests/a/test_x.py::test_1", ["tmp_path"]),
        ("tests/a/test_x.py::test_2", []),
        ("tests/b/test_ray.py::test_1", ["tmp_path"]),  # starts no Ray itself, but its module does
        ("tests/b/test_ray.py::test_2[p]", ["fleet", "tq_runtime"]),
        ("tests/c/test_nodes.py::TestC::test_1", ["cluster"]),
        ("tests/d/test_y.py::test_1", ["seaweed"]),
    ]
    assert xdist_groups(tests) == ["tests/a/test_x.py", "tests/a/test_x.py", RAY_GROUP, RAY_GROUP, RAY_GROUP,
                                   "tests/d/test_y.py"]


def test_the_session_marks_each_test_with_its_group(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None and marker.args == ("tests/test_worker_groups.py",)
