"""The pure rules the servers share: the same inputs give the same outputs, in any process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa

from devtools.gym_procs import REPO_ROOT
from refgym import rules


def test_model_output_is_a_function_of_seed_and_prompt_only() -> None:
    prompt = rules.initial_prompt("p7_g2", 3)
    assert rules.generate(7, prompt) == rules.generate(7, list(prompt))
    assert rules.generate(7, prompt) != rules.generate(8, prompt)
    assert rules.generate(7, prompt) != rules.generate(7, prompt + [1])
    assert rules.initial_prompt("p7_g2", 3) != rules.initial_prompt("p7_g2", 4)
    # ... and the same in another process (no per-process hash seeds or global RNG state).
    code = ("import json; from refgym import rules; "
            "print(json.dumps(rules.generate(7, rules.initial_prompt('p7_g2', 3))))")
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                           timeout=60)
    assert json.loads(other.stdout) == [list(x) for x in rules.generate(7, prompt)]


def test_log_probs_survive_json_and_arrow_float32_exactly() -> None:
    tokens, log_probs = rules.generate(1, [5, 6, 7])
    assert len(tokens) == len(log_probs) and all(0 <= t < rules.VOCAB for t in tokens)
    assert json.loads(json.dumps(log_probs)) == log_probs
    assert pa.array(log_probs, pa.float32()).to_pylist() == log_probs
    assert np.all(np.asarray(log_probs) < 0)


def test_tools_are_pure_functions_of_state_and_call() -> None:
    state = rules.empty_state("notes")
    s1, r1 = rules.apply_tool("notes", state, {"value": 5})
    assert state == {"values": []}  # the input state is not changed
    assert rules.apply_tool("notes", state, {"value": 5}) == (s1, r1) == ({"values": [5]}, {"count": 1, "total": 5})
    _, r2 = rules.apply_tool("sandbox", {"acc": 2}, {"code": 3})
    assert r2 == {"acc": 65}
    assert rules.tool_tokens("notes", r1)[0] != rules.tool_tokens("sandbox", r2)[0]
