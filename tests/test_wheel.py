"""The wheel: what it ships, the extras it declares, and that an install of each extra imports cleanly.

The wheel is built from a copy of the working tree (``pip wheel --no-deps --no-build-isolation``;
setuptools builds in the source folder, so a copy keeps ``build/`` and stale files out of the
repository). Then, without downloading anything, it is installed (``--no-deps``) into a fresh venv
whose only other packages are this dev venv's site-packages, made visible by a ``.pth`` line but
behind a guard: a meta-path finder, installed by a ``.pth`` import line, that refuses to import any
top-level module whose distribution (here, ``packages_distributions()``) is not one an install of
``snapformat[<extra>]`` would bring: the wheel's requirements for that extra and, transitively,
theirs, resolved from this venv's installed metadata. Each extra must import every module of the
packages it promises, and a module of a package it does not cover must fail with
``ModuleNotFoundError`` (raised by the guard, for a module that is on the disk: the guard is real).
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DIST = "snapformat"
PRODUCT = ("schemas", "snapformat", "gymkit", "coordinator", "refgym")
NOT_SHIPPED = ("devtools", "tests", "benchmarks", "spec")
EXTRAS = ("s3", "gym", "coordinator")
S3_MODULES = ("snapformat.store.s3",)  # the modules only the s3 extra makes importable

#: An install with each extra (``""``: none) and the packages whose every module it must import.
PROMISES: dict[str, tuple[str, ...]] = {
    "": ("schemas", "snapformat"),
    "s3": ("schemas", "snapformat"),
    "gym": ("schemas", "snapformat", "gymkit", "refgym"),
    "coordinator": ("schemas", "snapformat", "gymkit", "refgym", "coordinator"),
}
#: ... and modules it must NOT import (a package, or the s3 store, that extra does not cover).
REFUSES: dict[str, tuple[str, ...]] = {
    "": ("snapformat.store.s3", "gymkit.control_plane", "refgym.serve", "coordinator.dataplane.tq.adapter"),
    "s3": ("gymkit.control_plane", "coordinator.dataplane.tq.tensors"),
    "gym": ("snapformat.store.s3", "coordinator.dataplane.tq.adapter", "coordinator.dataplane.tq.tensors"),
    "coordinator": ("snapformat.store.s3",),
}

#: Not copied: the venv, caches and outputs at the top, the benchmarks' results, and build leftovers anywhere.
_SKIP_AT_ROOT = {".venv", ".git", "build", "dist", ".pytest_cache", ".hypothesis", ".ruff_cache", ".benchmarks"}
_SKIP_IN_BENCHMARKS = {"results", ".scratch"}


def _copy_ignore(folder: str, names: list[str]) -> set[str]:
    here = Path(folder).resolve()
    skip = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}
    if here == ROOT:
        skip |= {n for n in names if n in _SKIP_AT_ROOT or n.startswith("demo-store")}
    elif here == ROOT / "benchmarks":
        skip |= _SKIP_IN_BENCHMARKS & set(names)
    return skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_copy_ignore, symlinks=True)
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src)], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
    return {"tmp": tmp, "src": src, "wheel": wheels[0], "names": names, "meta": meta}


def requirements_of(meta: Any, extra: str) -> list[Requirement]:
    """The wheel's requirements an install with ``extra`` (``""``: none) adds to the base ones."""
    found = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if extra == "":
            if req.marker is None:
                found.append(req)
        elif req.marker is not None and req.marker.evaluate({"extra": extra}):
            found.append(req)
    return found


def closure(reqs: list[Requirement]) -> tuple[dict[str, str], list[str]]:
    """Every distribution an install of ``reqs`` brings (canonical name -> installed version), resolved
    from this venv's installed metadata; and what does not fit (missing here, or the wrong version)."""
    env = default_environment()
    extras_seen: dict[str, set[str]] = {}
    found: dict[str, str] = {}
    problems: list[str] = []
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} is not installed in the dev venv")
            continue
        if not req.specifier.contains(Version(dist.version), prereleases=True):
            problems.append(f"{req}: the dev venv has {dist.version}")
        wanted = set(req.extras) | {""}
        if name in extras_seen and wanted <= extras_seen[name]:
            continue
        extras_seen[name] = extras_seen.get(name, set()) | wanted
        found[name] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate(env | {"extra": e}) for e in extras_seen[name]):
                todo.append(sub)
    return found, problems


def pinned_requirements() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_the_wheel_ships_the_product_only(built: dict[str, Any]) -> None:
    names = built["names"]
    tops = {n.split("/")[0] for n in names}
    assert tops == set(PRODUCT) | {n.split("/")[0] for n in names if ".dist-info/" in n}, sorted(tops)
    assert not [n for n in names if n.split("/")[0] in NOT_SHIPPED or "__pycache__" in n]
    for package in PRODUCT:  # every module of the product is in it
        expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts}
        assert expected and expected <= set(names), sorted(expected - set(names))


def test_the_wheel_declares_its_extras_pinned_as_requirements_txt(built: dict[str, Any]) -> None:
    meta = built["meta"]
    assert set(meta.get_all("Provides-Extra") or []) == set(EXTRAS)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = pinned_requirements()
    for extra in EXTRAS:
        reqs = requirements_of(meta, extra)
        assert sorted(str(r).split(";")[0] for r in reqs) == sorted(declared[extra]), extra
        for req in reqs:
            (spec,) = req.specifier
            name = canonicalize_name(req.name)
            assert spec.operator == "==" and name in pins, f"{extra}: {req} is not pinned in requirements.txt"
            # the public version: requirements.txt's torch "+cpu" names this machine's build, not the library's
            assert Version(spec.version).public == Version(pins[name]).public, f"{extra}: {req} vs {pins[name]}"
    assert set(declared["gym"]) <= set(declared["coordinator"])  # the coordinator drives Gym servers


def test_each_extra_is_satisfied_by_the_pinned_dev_venv(built: dict[str, Any]) -> None:
    """The dev venv (installed from requirements.txt) is a consistent install of every extra: each one
    resolves, with the pins, to distributions that are all there in versions that fit."""
    for extra in ("", *EXTRAS):
        _, problems = closure(requirements_of(built["meta"], "") + requirements_of(built["meta"], extra))
        assert not problems, f"snapformat[{extra}]: {problems}"


#: Imports of a third-party package no extra brings, on purpose (each lazy, failing with a clear message).
OPTIONAL_IMPORTS = {
    "nemo_gym": "gymkit.token_store: NeMo Gym's own package, there wherever Gym runs (TokenStore.freeze)",
}


def extra_of(module: str) -> str:
    """The extra an install needs for ``module`` to work (besides the base requirements)."""
    if module in S3_MODULES:
        return "s3"
    top = module.split(".")[0]
    return {"schemas": "", "snapformat": "", "gymkit": "gym", "refgym": "gym", "coordinator": "coordinator"}[top]


def test_every_import_even_a_lazy_one_is_brought_by_the_modules_extra(built: dict[str, Any]) -> None:
    """What importing each module cannot show: an import inside a function (``import ray`` when a job
    starts) must be of a distribution that module's extra installs too. Found by parsing the source."""
    import ast

    providers = metadata.packages_distributions()
    meta = built["meta"]
    brought = {extra: set(closure(requirements_of(meta, "") + requirements_of(meta, extra))[0])
               for extra in ("", *EXTRAS)}
    wrong = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    tops = {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = {node.module.split(".")[0]}
                else:
                    continue
                for top in tops - set(PRODUCT) - {"devtools", "__future__"} - set(OPTIONAL_IMPORTS):
                    if top in sys.stdlib_module_names:
                        continue
                    dists = {canonicalize_name(d) for d in providers.get(top, [])}
                    if not dists & brought[extra_of(module)]:
                        wrong.append(f"{module}:{node.lineno} imports {top} ({', '.join(sorted(dists)) or 'not installed'}),"
                                     f" not brought by snapformat[{extra_of(module)}]")
    assert not wrong, "\n".join(wrong)


GUARD = r'''
"""tests/test_wheel.py's guard: the dev venv's site-packages stand in for an index, but only the
distributions an install of snapformat[<extra>] would bring may be imported from them.

It takes the place of the standard path finder in ``sys.meta_path``: a refused top-level module is
looked for on ``sys.path`` without the dev venv's folders, so it is missing exactly as it would be
were its distribution not installed (``importlib.util.find_spec`` answers None, ``import`` raises
``ModuleNotFoundError``); everything else is found as usual."""
import json
import os
import sys
from importlib.machinery import PathFinder


class ExtrasGuard:
    def __init__(self, refused, hidden):
        self.refused = refused  # top-level module -> the distributions providing it
        self.hidden = {os.path.realpath(p) for p in hidden}  # where they are (the dev venv's site-packages)

    def find_spec(self, fullname, path=None, target=None):
        if path is None and fullname in self.refused:
            path = [p for p in sys.path if os.path.realpath(p or ".") not in self.hidden]
        return PathFinder.find_spec(fullname, path, target)

    def invalidate_caches(self):
        PathFinder.invalidate_caches()


def install():
    config = os.environ.get("SNAPFORMAT_EXTRAS_GUARD") or os.path.join(os.path.dirname(__file__), "guard-all.json")
    with open(config) as f:
        config = json.load(f)
    guard = ExtrasGuard(config["refused"], config["hidden"])
    sys.meta_path[:] = [f for f in sys.meta_path if f is not PathFinder] + [guard]


install()
'''

CHECK = r'''
import importlib, json, os, sys
from pathlib import Path

site_dir, dev_site = Path(sys.argv[1]), Path(sys.argv[2])
promised, refused, s3_modules = json.loads(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
assert str(dev_site) in sys.path, sys.path

modules = []
for package in promised:
    for path in sorted((site_dir / package).rglob("*.py")):
        if "__pycache__" in path.parts or path.name == "__main__.py":  # __main__ runs a command
            continue
        parts = list(path.relative_to(site_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if name not in s3_modules:
            modules.append(name)

failed, outside = {}, {}
for name in modules:
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        failed[name], e = [], exc
        while e is not None:
            failed[name].append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        continue
    if not Path(module.__file__).resolve().is_relative_to(site_dir.resolve()):
        outside[name] = module.__file__

refusals = {}
for name in refused + ["devtools"]:
    try:
        importlib.import_module(name)
        refusals[name] = None
    except BaseException as exc:
        chain, e = [], exc
        while e is not None:
            chain.append([type(e).__name__, getattr(e, "name", None), str(e)])
            e = e.__cause__ or e.__context__
        refusals[name] = chain

print(json.dumps({"imported": len(modules) - len(failed), "failed": failed, "outside": outside,
                  "refusals": refusals}))
'''


def test_each_extra_imports_cleanly_and_nothing_more(built: dict[str, Any]) -> None:
    tmp: Path = built["tmp"]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(built["wheel"])], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    site_dir = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    assert {p.name for p in site_dir.iterdir()} >= set(PRODUCT) and not (site_dir / "devtools").exists()

    dev_sites = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()})
    dev_site = Path(sysconfig.get_paths()["purelib"])
    providers = metadata.packages_distributions()  # top-level module -> distributions (this venv)
    installed_here = {p.name.removesuffix(".py") for p in site_dir.iterdir()}

    def refused_for(allowed: set[str]) -> dict[str, list[str]]:
        return {top: sorted(set(dists)) for top, dists in providers.items()
                if top not in installed_here and not any(canonicalize_name(d) in allowed for d in dists)}

    (site_dir / "_snapformat_extras_guard.py").write_text(GUARD)
    (site_dir / "guard-all.json").write_text(json.dumps({"refused": refused_for(set()), "hidden": dev_sites}))
    (site_dir / "00-snapformat-extras-guard.pth").write_text("import _snapformat_extras_guard\n")
    (site_dir / "zz-dev-venv.pth").write_text("".join(f"{p}\n" for p in dev_sites))

    meta = built["meta"]
    reports = {}
    for extra in ("", *EXTRAS):
        found, problems = closure(requirements_of(meta, "") + requirements_of(meta, extra))
        assert not problems, problems
        refused = refused_for(set(found) | {canonicalize_name(DIST)})
        config = tmp / f"guard-{extra or 'base'}.json"
        config.write_text(json.dumps({"refused": refused, "hidden": dev_sites}))
        s3 = [] if extra == "s3" else list(S3_MODULES)
        run = subprocess.run([str(python), "-I", "-c", CHECK, str(site_dir), str(dev_site), json.dumps(PROMISES[extra]),
                              json.dumps(list(REFUSES[extra])), json.dumps(s3)],
                             cwd=tmp, env=dict(env, SNAPFORMAT_EXTRAS_GUARD=str(config)), capture_output=True,
                             text=True, timeout=300, check=False)
        assert run.returncode == 0, f"snapformat[{extra}]: {run.stderr[-4000:]}"
        got = json.loads(run.stdout.strip().splitlines()[-1])
        reports[extra] = got
        label = f"snapformat[{extra}]" if extra else "snapformat"
        assert not got["failed"], f"{label}: modules that did not import: {json.dumps(got['failed'], indent=1)}"
        assert not got["outside"], f"{label}: imported from outside the install: {got['outside']}"
        assert got["imported"] > 0
        for name, chain in got["refusals"].items():
            assert chain is not None, f"{label}: {name} imported, but the extra does not cover it"
            missing = [(kind, mod) for kind, mod, _ in chain if kind == "ModuleNotFoundError"]
            assert missing, f"{label}: {name} failed without a ModuleNotFoundError: {chain}"
            _, mod = missing[0]
            if name == "devtools":
                assert mod == "devtools"  # not shipped, and not reachable from the dev venv either
                continue
            top = mod.split(".")[0]
            # refused by the guard, although it is on the disk of the dev venv: the guard is doing it
            assert top in refused, f"{label}: {name} failed on {mod}, which the guard does not refuse: {chain}"
            assert any((Path(p) / top).exists() or (Path(p) / f"{top}.py").exists() or list(Path(p).glob(f"{top}.*.so"))
                       for p in dev_sites), f"{top} is not in the dev venv"
    # the bigger the extra, the more it imports
    assert reports["s3"]["imported"] == reports[""]["imported"] + len(S3_MODULES)
    assert reports[""]["imported"] < reports["gym"]["imported"] < reports["coordinator"]["imported"]
