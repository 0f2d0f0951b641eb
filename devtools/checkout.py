"""This checkout: its root, and the environment a child Python process needs to import it.

Test servers, fleets and benchmarks start child processes with ``python -m <module>`` of this
repository's packages (``refgym``, ``devtools``, ``benchmarks``...), which the wheel does not install.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env(base: Mapping[str, str] | None = None, root: Path = REPO_ROOT) -> dict[str, str]:
    """A copy of ``base`` (default: this process's environment) with ``root`` first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env
