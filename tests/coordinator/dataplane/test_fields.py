"""The field model: layouts that make no sense are refused; rows are grouped by the fields they hold.

No Ray, no torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.dataplane.fields import FieldSpec, group_by_presence
from schemas.errors import InvalidRecordError


def test_group_by_presence_keeps_row_order() -> None:
    groups = group_by_presence({"a": np.array([1, 1, 0, 1], bool), "b": np.array([1, 0, 0, 1], bool)}, 4)
    assert [(g.tolist(), names) for g, names in groups] == [([0, 3], ["a", "b"]), ([1], ["a"]), ([2], [])]
    assert [(g.tolist(), n) for g, n in group_by_presence({}, 2)] == [([0, 1], [])]


def test_field_spec_rejects_nonsense() -> None:
    with pytest.raises(InvalidRecordError):
        FieldSpec("tensor", "complex64")
    with pytest.raises(InvalidRecordError):
        FieldSpec("tensor", "int32", 2, ())
    with pytest.raises(InvalidRecordError):
        FieldSpec("tensor", "int32", 0, (), nested=True)
