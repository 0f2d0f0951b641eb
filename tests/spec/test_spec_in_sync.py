"""``spec/`` must say what the code does: exported JSON Schemas, generated blocks of SPEC.md, every
file kind and row column named in the spec, and every control message and route of the checkpoint
control protocol."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import typing
from pathlib import Path
from typing import Any

import msgspec

from schemas.control import Capabilities, ControlError, Phase
from schemas.gym_records import AgentContinuationRoot
from schemas.jsonschema import CONTROL_MESSAGES, RECORDS, render
from schemas.manifest import FileKind
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.version import FORMAT_VERSION, RESERVED_FEATURES

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "SPEC.md"
SCHEMAS = ROOT / "spec" / "schemas"


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
        assert (SCHEMAS / file).read_text() == text, f"spec/schemas/{file} is stale: run `make schemas`"


def test_generated_blocks_match_the_code():
    text = SPEC.read_text()
    assert _renderer().render(text) == text, "spec/SPEC.md is stale: run `python spec/render_spec_schemas.py`"


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


def test_json_blocks_parse_and_gym_line_decodes():
    text = SPEC.read_text()
    blocks = re.findall(r"```json\n(.*?)\n```", text, re.DOTALL)
    assert len(blocks) >= 20
    for block in blocks:
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
    text = SPEC.read_text()
    section = text[text.index("## 20. The checkpoint control protocol (version 1)"):text.index("## 21. Limits")]
    for name in CONTROL_MESSAGES:
        assert f"<!-- BEGIN GENERATED message:{name} -->" in section, f"control message {name} has no table in §20"
    routes = _control_routes()
    assert len(routes) >= 12
    for method, path in routes:
        assert path.startswith("/ng-control/v1/"), path
        assert f"`{method} {path}`" in section, f"route {method} {path} is not in §20"
    for phase in typing.get_args(Phase):
        assert f"| `{phase}` |" in section, phase
    for code in typing.get_args(typing.get_type_hints(ControlError)["error"]):
        assert f"| `{code}` |" in section, code


def test_control_topology_vector_is_sha256_of_the_canonical_contracts_shown():
    """Recomputed without ``schemas.topology``: the bytes shown, hashed, give the fingerprint shown."""
    text = SPEC.read_text()
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
