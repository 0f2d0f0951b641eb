"""The dependency arrows run one way: ``schemas`` <- ``snapformat`` <- ``gymkit`` <- ``coordinator``,
with ``refgym`` (reference Gym servers) and ``devtools`` (test and demo tooling, not shipped) on top.

Every module of every product package is parsed (not imported) and each of its imports checked,
including imports inside functions, ``if TYPE_CHECKING:`` blocks and ``importlib.import_module("...")``
with a literal name: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRODUCT = ("schemas", "snapformat", "gymkit", "coordinator", "refgym")
TOOLING = ("devtools",)

#: What each product package must not import (a package may import itself and any package not listed).
FORBIDDEN: dict[str, frozenset[str]] = {
    "schemas": frozenset({"snapformat", "gymkit", "coordinator", "refgym", "devtools"}),
    "snapformat": frozenset({"gymkit", "coordinator", "refgym", "devtools"}),
    "gymkit": frozenset({"coordinator", "refgym", "devtools"}),
    "coordinator": frozenset({"refgym", "devtools"}),
    "refgym": frozenset({"coordinator", "devtools"}),
}

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(package: str) -> list[tuple[str, Path]]:
    return sorted((module_name(p), p) for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every absolute module name ``source`` imports (relative imports resolved against ``module``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                names.add(".".join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module or "")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            names.add(node.args[0].value)
    return names


def top_level_imports(path: Path) -> set[str]:
    module = module_name(path)
    names = imported_names(path.read_text(), module, path.name == "__init__.py")
    return {n.split(".")[0] for n in names if n}


def test_the_parser_sees_lazy_relative_and_dynamic_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import devtools.gym_fleet\n"
        "def f():\n    from refgym import serve\n    import importlib\n    importlib.import_module('devtools.job')\n"
        "from . import sibling\nfrom ..store import local\nfrom ...gymkit import x\n"
    )
    names = imported_names(source, "snapformat.store.s3", is_package=False)
    assert {"devtools.gym_fleet", "refgym", "devtools.job", "snapformat.store", "gymkit"} <= names


@pytest.mark.parametrize("package", PRODUCT)
def test_imports_point_one_way(package: str) -> None:
    modules = modules_of(package)
    assert modules, f"no modules found under {package}/"
    wrong = []
    for module, path in modules:
        bad = top_level_imports(path) & FORBIDDEN[package]
        if bad:
            wrong.append(f"{module} imports {', '.join(sorted(bad))}")
    assert not wrong, f"{package} must not import {', '.join(sorted(FORBIDDEN[package]))}:\n" + "\n".join(wrong)


def test_no_product_package_imports_the_tooling() -> None:
    for package in PRODUCT:
        assert set(TOOLING) <= FORBIDDEN[package]
