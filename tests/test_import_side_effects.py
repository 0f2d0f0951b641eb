"""Importing the library changes nothing: every module of every product package imported, in a fresh
interpreter, leaves ``os.environ`` as it found it. Turning Ray's loopback and auth settings on is
:func:`coordinator.ray_runtime.configure`'s job, called by entry points, never an import's.

Third-party packages do set variables when imported (``ray`` sets ``RAY_CLIENT_MODE``, torch's users
``TORCHINDUCTOR_CACHE_DIR``): every third-party module the product imports (found by parsing it) is
imported first and the environment compared from there on, so what is measured is our code's doing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from coordinator.ray_runtime import RUNTIME_ENV

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import ast, importlib, json, os, sys
from pathlib import Path

root = Path(sys.argv[1])
packages = json.loads(sys.argv[2])
start = dict(os.environ)

modules = []
for package in packages:
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts or path.name == "__main__.py":  # __main__ runs a command
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append((".".join(parts), path))

third_party = set()
for _, path in modules:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            third_party.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            third_party.add(node.module)
            third_party.update(f"{node.module}.{a.name}" for a in node.names)  # submodules among them
third_party = sorted(n for n in third_party if n.split(".")[0] not in packages + ["devtools", "__future__"])
for name in third_party:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a name imported from a module (not a submodule), or an optional package
baseline = dict(os.environ)

changed, failed = {}, {}
for name, _ in modules:
    before = dict(os.environ)
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
    after = dict(os.environ)
    diff = {k: [before.get(k), after.get(k)] for k in set(before) | set(after) if before.get(k) != after.get(k)}
    if diff:
        changed[name] = diff

final = dict(os.environ)
from coordinator import ray_runtime
set_by_configure = ray_runtime.configure()
print(json.dumps({"modules": len(modules), "changed": changed, "failed": failed,
                  "third_party_changed": sorted(k for k in set(start) | set(baseline) if start.get(k) != baseline.get(k)),
                  "runtime_env_after_imports": {k: final.get(k) for k in ray_runtime.RUNTIME_ENV},
                  "set_by_configure": set_by_configure}))
"""


def test_importing_every_product_module_leaves_the_environment_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV and k != "PYTHONPATH"}
    packages = ["schemas", "snapformat", "gymkit", "coordinator", "refgym"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), json.dumps(packages)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    assert got["modules"] > 50
    assert not got["failed"], f"modules that did not import: {got['failed']}"
    assert not got["changed"], f"importing these modules changed os.environ: {got['changed']}"
    assert got["runtime_env_after_imports"] == {k: None for k in RUNTIME_ENV}
    # ... and the check can see a change: configure() sets every variable (none was set)
    assert got["set_by_configure"] == RUNTIME_ENV


def test_configure_sets_only_what_is_unset_and_is_idempotent(monkeypatch) -> None:
    from coordinator import ray_runtime

    for k in RUNTIME_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(ray_runtime.LOOPBACK_ENV, "1")  # a multi-node cluster, chosen by the caller
    assert ray_runtime.configure() == {k: v for k, v in RUNTIME_ENV.items() if k != ray_runtime.LOOPBACK_ENV}
    assert os.environ[ray_runtime.LOOPBACK_ENV] == "1"
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert ray_runtime.configure() == {}  # idempotent
