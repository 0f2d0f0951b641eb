"""JSON values kept exactly: what JSON would change is refused, in a put's tags and by the check
itself; what survives JSON comes back as it was put, through a cut and its table.

No Ray, no torch.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from coordinator.dataplane import DATAPLANE, InMemoryDataPlane, Objects, parse_table
from coordinator.dataplane.jsonvalues import check_json_value
from schemas.errors import InvalidRecordError


@pytest.mark.parametrize("bad", [(1, 2), {1: "a"}, np.int64(3), {"a": {"b": (1,)}}, b"x"])
def test_values_json_would_change_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidRecordError):
        check_json_value(bad, "here")
    plane = InMemoryDataPlane()
    with pytest.raises(InvalidRecordError):
        plane.put("p", ["a"], tags=[{"t": bad}])


def test_json_values_that_survive_are_kept_as_is() -> None:
    plane = InMemoryDataPlane()
    value = {"nan": float("nan"), "big": 2**70, "s": "é\n", "l": [None, True, 1.5]}
    plane.put("p", ["a"], {"obj": Objects([value])}, [{"nested": value}])
    cut = plane.cut()
    parts = parse_table(cut.tables[DATAPLANE], "t")  # not training rows: no input_ids
    got = parts[0].groups[0].fields["obj"].values[0]
    assert json.dumps(got, sort_keys=True) == json.dumps(value, sort_keys=True)
    assert parts[0].tags[0]["nested"]["big"] == 2**70
