"""``spec/`` must say what the code does: exported JSON Schemas, generated blocks of SPEC.md, and
every file kind and row column named in the spec."""

from __future__ import annotations

import importlib.util
import json
import re
import typing
from pathlib import Path

import msgspec

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
