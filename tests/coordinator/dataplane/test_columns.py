"""One field as one Arrow column: a dense field is a list column whose layout says dense, and a
column cast to a narrower dtype than its values is refused on the way back.

No Ray, no torch.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from coordinator.dataplane import DATAPLANE, TAGS_COLUMN, FieldSpec, InMemoryDataPlane, Ragged, layout_of, parse_table
from schemas.errors import InvalidRecordError


def test_column_cast_back_must_be_exact() -> None:
    """A layout claiming a narrower dtype than the stored values is refused, not silently wrapped."""
    plane = InMemoryDataPlane()
    plane.put("p", ["a"], {"x": np.array([300], np.int32)}, [{"rollout_id": "r", "attempt_index": 0}])
    table = plane.cut().tables[DATAPLANE]
    layout = layout_of(table.schema)
    layout["partitions"][0]["fields"]["x"]["dtype"] = "int8"
    i = table.schema.get_field_index(TAGS_COLUMN)
    table = table.set_column(i, table.schema.field(i).with_metadata({b"dataplane.layout": json.dumps(layout)}),
                             table.column(i))
    with pytest.raises(InvalidRecordError, match="do not fit int8"):
        parse_table(table, "t")


def test_dense_field_keeps_its_layout_in_memory() -> None:
    plane = InMemoryDataPlane()
    plane.put("p", ["a", "b"], {"d": np.zeros((2, 3), np.float32), "r": Ragged([np.zeros(1), np.zeros(2)])})
    parts = parse_table(plane.cut().tables[DATAPLANE], "t")
    assert parts[0].specs["d"] == FieldSpec("tensor", "float32", 1, (), False)
    assert parts[0].specs["r"] == FieldSpec("tensor", "float64", 1, (), True)
    assert pa.types.is_list(plane.cut().tables[DATAPLANE].schema.field("d").type)
