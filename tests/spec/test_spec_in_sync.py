"""``spec/`` must say what the code does: exported JSON Schemas (with every field's description),
generated blocks of SPEC.md and CONTROL.md, every file kind and row column named in the spec, every
control message and route of the checkpoint control protocol (CONTROL.md), section references that
resolve, and regular expressions that follow the spec's convention."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas.control import Capabilities, ControlError, Phase
from schemas.gym_records import AgentContinuationRoot
from schemas.jsonschema import CONTROL_MESSAGES, RECORDS, render
from schemas.manifest import FileKind
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.version import FORMAT_VERSION, RESERVED_FEATURES

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "SPEC.md"
CONTROL = ROOT / "spec" / "CONTROL.md"
SCHEMAS = ROOT / "spec" / "jsonschema"


def _renderer():
    spec = importlib.util.spec_from_file_location("render_spec_schemas", ROOT / "spec" / "render_spec_schemas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_exported_json_schemas_match_the_structs():
    expected = {f"{name}.schema.json": render(name) for name in RECORDS}
    expected.update({f"control/{name}.schema.json": render(name) for name in CONTROL_MESSAGES})
    present = {p.relative_to(SCHEMAS).as_posix() for p in SCHEMAS.rglob("*.json")}
    assert present == set(expected), "run `make schemas`"
    for file, text in expected.items():
        assert (SCHEMAS / file).read_text() == text, f"spec/jsonschema/{file} is stale: run `make schemas`"


def test_exported_json_schemas_describe_every_field():
    """Every property of every exported schema carries its field's ``msgspec.Meta`` description (a
    tagged record's tag field excepted: its value says what it is)."""
    for path in SCHEMAS.rglob("*.schema.json"):
        schema = json.loads(path.read_text())
        assert schema["$comment"].startswith("Specified in spec/"), path
        for name, definition in schema["$defs"].items():
            for field, prop in definition.get("properties", {}).items():
                if field == "record" and "enum" in prop:
                    continue
                assert prop.get("description"), f"{path.name}: {name}.{field} has no description"


def test_no_folder_shadows_a_package():
    """``spec/`` is sys.path[0] when the renderer runs as a script: no folder there may be named like a
    package it imports (the exported schemas once lived in ``spec/schemas/``)."""
    assert not (ROOT / "spec" / "schemas").exists()
    assert "sys.path" not in (ROOT / "spec" / "render_spec_schemas.py").read_text()


@pytest.mark.parametrize("document", ["SPEC.md", "CONTROL.md"])
def test_generated_blocks_match_the_code(document):
    text = (ROOT / "spec" / document).read_text()
    assert _renderer().render(text, document) == text, (
        f"spec/{document} is stale: run `python spec/render_spec_schemas.py`")


def test_renderer_check_passes_as_a_script():
    """``python spec/render_spec_schemas.py --check``, as ``make`` and people run it (spec/ first on sys.path)."""
    done = subprocess.run([sys.executable, str(ROOT / "spec" / "render_spec_schemas.py"), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_kind_and_column_is_in_the_spec():
    text = SPEC.read_text()
    for kind in typing.get_args(FileKind):
        assert f"`{kind}`" in text, kind
    for schema in (TRAINING_SCHEMA, TOKEN_CAPTURE_SCHEMA):
        for name in schema.names:
            assert f"`{name}`" in text, name


def test_versions_and_features_are_in_the_spec():
    text = SPEC.read_text()
    assert f"version {FORMAT_VERSION}" in text.splitlines()[0]
    for feature in RESERVED_FEATURES:
        assert f"| `{feature}` |" in text, feature
    assert "RFC 2119" in text
    control = CONTROL.read_text()
    assert "version 1" in control.splitlines()[0]
    assert "RFC 2119" in control and "## Contents" in control


def test_json_blocks_parse_and_gym_line_decodes():
    text = SPEC.read_text()
    blocks = re.findall(r"```json\n(.*?)\n```", text, re.DOTALL)
    assert len(blocks) >= 20
    control = re.findall(r"```json\n(.*?)\n```", CONTROL.read_text(), re.DOTALL)
    assert len(control) >= len(CONTROL_MESSAGES)
    for block in blocks + control:
        json.loads(block)
    gym = next(b for b in blocks if b.startswith('{"schema_version": 1, "rollout_id": "p7_g2"'))
    rec = msgspec.json.decode(gym, type=AgentContinuationRoot)
    assert json.loads(msgspec.json.encode(rec)) == json.loads(gym)


def test_every_command_is_in_the_spec():
    from snapformat.cli import build_parser

    text = SPEC.read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"`snapformat {name}" in text, name


def _control_routes() -> set[tuple[str, str]]:
    """(method, full path) of every route gymkit's router registers, for a participant that does nothing."""
    from gymkit import ControlPlane, Participant

    class Trivial(Participant):
        def capabilities(self) -> Capabilities:
            return Capabilities(component="agent", name="trivial", checkpoint_mode="stateless")

        async def prepare(self, deadline: float) -> None:
            return None

        async def commit(self, part: Any, context: dict[str, Any]) -> dict[str, Any]:
            return {}

        async def restore(self, snapshot: Any, prefix: str) -> dict[str, Any]:
            return {}

        async def resume(self) -> None:
            return None

    routes = set()
    for route in ControlPlane(Trivial(), "token").router().routes:
        for method in route.methods - {"HEAD"}:
            routes.add((method, route.path))
    return routes


def test_every_control_message_and_route_is_in_the_spec():
    section = CONTROL.read_text()
    for name in CONTROL_MESSAGES:
        assert f"<!-- BEGIN GENERATED message:{name} -->" in section, f"control message {name} has no table in CONTROL.md"
    routes = _control_routes()
    assert len(routes) >= 12
    for method, path in routes:
        assert path.startswith("/ng-control/v1/"), path
        assert f"`{method} {path}`" in section, f"route {method} {path} is not in CONTROL.md"
    for phase in typing.get_args(Phase):
        assert f"| `{phase}` |" in section, phase
    for code in typing.get_args(typing.get_type_hints(ControlError)["error"]):
        assert f"| `{code}` |" in section, code


def test_control_topology_vector_is_sha256_of_the_canonical_contracts_shown():
    """Recomputed without ``schemas.topology``: the bytes shown, hashed, give the fingerprint shown."""
    text = CONTROL.read_text()
    block = text[text.index("<!-- BEGIN GENERATED control:topology -->"):text.index("<!-- END GENERATED control:topology -->")]
    shown = re.search(r"`(sha256:[0-9a-f]{64})`", block).group(1)
    canonical = re.search(r"```json\n(.*?)\n```", block, re.DOTALL).group(1)
    assert shown == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    contracts = json.loads(canonical)
    assert [(c["component"], c["name"]) for c in contracts] == sorted((c["component"], c["name"]) for c in contracts)
    assert canonical == json.dumps(contracts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for c in contracts:  # exactly what Capabilities.contract() covers
        assert set(c) == {"component", "name", "schema_version", "checkpoint_mode", "concurrency", "restart_only_resources"}
        caps = Capabilities(component=c["component"], name=c["name"], checkpoint_mode=c["checkpoint_mode"],
                            restart_only_resources=c["restart_only_resources"])
        assert caps.contract() == c


def _sections(text: str) -> set[str]:
    """The numbers of a document's numbered headings (``## 12.`` -> ``12``, ``### 12.2a`` -> ``12.2a``)."""
    return {m.group(1) for m in re.finditer(r"^#{2,4} (\d+(?:\.\d+[a-z]?)*)\.? ", text, re.M)}


def _code_files() -> list[Path]:
    """The project's Python files (this one aside: it names the old numbers on purpose)."""
    packages = {"schemas", "snapformat", "gymkit", "coordinator", "refgym", "tests", "spec", "benchmarks"}
    return [p for p in ROOT.glob("*/**/*.py")
            if p.parts[len(ROOT.parts)] in packages and p.resolve() != Path(__file__).resolve()]


_REF = re.compile(r"(CONTROL(?:\.md)? |SPEC(?:\.md)? )?§(\d+(?:\.\d+[a-z]?)*)")


def test_section_references_resolve():
    """Every "§N" names a section of its own document (of SPEC.md in code), every "CONTROL §N" or
    "CONTROL.md §N" one of CONTROL.md and every "SPEC §N" one of SPEC.md: in both documents (the field
    descriptions included) and in the code's comments."""
    spec, control = SPEC.read_text(), CONTROL.read_text()
    numbers = {"SPEC": _sections(spec), "CONTROL": _sections(control)}
    assert {"15.4", "15.4.1", "15.4.2", "20", "21", "22"} <= numbers["SPEC"]
    assert {str(n) for n in range(1, 10)} <= numbers["CONTROL"]
    texts = {"SPEC.md": (spec, "SPEC"), "CONTROL.md": (control, "CONTROL")}
    for path in _code_files():
        texts[str(path.relative_to(ROOT))] = (path.read_text(), "SPEC")
    for where, (text, own) in texts.items():
        for m in _REF.finditer(text):
            doc = (m.group(1) or own).strip().removesuffix(".md")
            if where == "SPEC.md" and m.group(2).startswith("20."):  # the §20 stub says where they went
                continue
            assert m.group(2) in numbers[doc], f"{where}: {m.group(0)!r} names no section of {doc}.md"


def test_control_sections_are_not_cited_by_their_old_numbers():
    """The control protocol was SPEC §20.1-§20.9; it is CONTROL.md §1-§9 now."""
    for path in _code_files():
        assert not re.search(r"§ ?20\.\d", path.read_text()), (
            f"{path}: the control protocol moved out of SPEC §20: cite CONTROL.md §N instead of SPEC §20.N")


def test_every_regex_in_the_spec_follows_the_convention():
    """The conventions say every regular expression matches the whole string, except a declared
    suffix: each one is written anchored (``^...$``), or is the reserved suffix of §5."""
    spec, control = SPEC.read_text(), CONTROL.read_text()
    conventions = spec[spec.index("## Conventions"):spec.index("## Contents")]
    assert "match the whole string" in conventions and "`-a[1-9][0-9]*`" in conventions
    suffixes = {"-a[1-9][0-9]*"}
    found = []
    body = spec[:spec.index("## Conventions")] + spec[spec.index("## Contents"):]  # the rule's own examples aside
    for text in (body, control):
        for span in re.findall(r"`([^`\n]+)`", text):
            if re.search(r"\[[^\]\s]*[A-Za-z0-9]-[A-Za-z0-9][^\]\s]*\]", span):  # a character class with a range
                found.append(span)
                assert span in suffixes or (span.startswith("^") and span.endswith("$")), span
    assert len(set(found)) >= 5, found
