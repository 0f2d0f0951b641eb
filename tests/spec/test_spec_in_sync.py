"""``spec/`` must say what the code does: exported JSON Schemas (with every field's description),
generated blocks of SPEC.md and CONTROL.md, every file kind and row column named in the spec, every
struct, route, phase and error code of Gym's checkpoint control protocol (CONTROL.md) with the
routes gymkit registers, the reference's route table and file versions, the topology fingerprint
recomputed from the bytes shown, section references that resolve, and regular expressions that
follow the spec's convention."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas import control, gym_files
from schemas.control import COORDINATOR_ONLY_CODES, ERROR_CODES, PHASES, Capabilities, MultiProcess, Phase
from schemas.gym_files import ArtifactRef
from schemas.gym_records import AgentContinuationRoot
from schemas.jsonschema import CONTROL_MESSAGES, FIELD_MEANINGS, FOLDERS, GYM_FILES, RECORDS, render
from schemas.manifest import FileKind
from schemas.rows import TOKEN_CAPTURE_SCHEMA, TRAINING_SCHEMA
from schemas.version import FORMAT_VERSION, KNOWN_FEATURES, RESERVED_FEATURES

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
    expected.update({f"gym/{name}.schema.json": render(name) for name in GYM_FILES})
    assert set(FOLDERS) == {".", "control", "gym"}
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
    from snapformat.kinds import GYM_KINDS

    text = SPEC.read_text()
    for kind in (*typing.get_args(FileKind), *GYM_KINDS):
        assert f"| `{kind}` |" in text, kind
    for schema in (TRAINING_SCHEMA, TOKEN_CAPTURE_SCHEMA):
        for name in schema.names:
            assert f"`{name}`" in text, name


def test_versions_and_features_are_in_the_spec():
    """The title names the format version; every known or reserved feature has a row in §14's table
    saying its status, every version a row in §13.1, and each known feature its own section."""
    text = SPEC.read_text()
    assert f"version {FORMAT_VERSION}" in text.splitlines()[0]
    assert f"**Format version:** {FORMAT_VERSION}." in text
    features = text[text.index("## 14. Features"):text.index("### 14.1 ")]
    for feature in KNOWN_FEATURES | RESERVED_FEATURES:
        row = next((line for line in features.splitlines() if line.startswith(f"| `{feature}` |")), None)
        assert row is not None, feature
        assert ("reserved" in row) == (feature in RESERVED_FEATURES), row
    for feature in KNOWN_FEATURES:
        assert re.search(rf"^### 14\.\d+ `{feature}` \(format \d+\.\d+\)$", text, re.MULTILINE), feature
    changes = text[text.index("### 13.1 "):text.index("## 14. ")]
    major, minor = (int(x) for x in FORMAT_VERSION.split("."))
    for m in range(1, minor + 1):
        assert f"\n| {major}.{m} | " in changes, f"§13.1 has no row for {major}.{m}"
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


#: Every route of the reference's tables (gym-control-protocol.md §4 and §5): a fact, kept here
#: apart from the renderer's list so that the spec, the renderer and gymkit are all held to it.
REFERENCE_ROUTES = {
    ("GET", "/capabilities"),
    ("POST", "/model-admission/pause"), ("GET", "/model-admission/status"), ("POST", "/model-admission/resume"),
    ("POST", "/model-admission/abort_inflight"), ("POST", "/model-checkpoint/commit"),
    ("POST", "/model-checkpoint/restore"),
    ("POST", "/agent-checkpoint/acknowledge"), ("POST", "/agent-checkpoint/acknowledge-completed"),
    ("GET", "/agent-checkpoint/completion-receipt"), ("POST", "/agent-checkpoint/prepare"),
    ("GET", "/agent-checkpoint/status"), ("POST", "/agent-checkpoint/commit"), ("POST", "/agent-checkpoint/restore"),
    ("POST", "/agent-checkpoint/resume"), ("POST", "/agent-checkpoint/retire"),
    ("POST", "/agent-checkpoint/discard-restored-continuation"),
    ("POST", "/resources-checkpoint/prepare"), ("GET", "/resources-checkpoint/status"),
    ("POST", "/resources-checkpoint/commit"), ("POST", "/resources-checkpoint/restore"),
    ("POST", "/resources-checkpoint/resume"), ("POST", "/resources-checkpoint/retire"),
}

#: A declaration for each router's trivial participant (each router checks its component).
_DECLARATIONS = {
    "model_router": Capabilities(component="responses_api_models", name="policy_model", instance_role="policy",
                                 admission_states=["accepting", "draining", "paused"],
                                 checkpoint_mode="export_restore", multi_process=MultiProcess(mode="single_worker")),
    "agent_router": Capabilities(component="responses_api_agents", name="simple_agent",
                                 checkpoint_mode="export_restore", concurrency_contract="serialized_per_session",
                                 multi_process=MultiProcess(mode="single_worker")),
    "resources_router": Capabilities(component="resources_servers", name="tools", checkpoint_mode="export_restore",
                                     concurrency_contract="serialized_per_session",
                                     multi_process=MultiProcess(mode="single_worker")),
}


def _trivial(abstract: type, declaration: Capabilities) -> type:
    """A subclass of a participant ABC whose abstract methods do nothing (``declaration`` answers
    ``declaration``)."""

    def make(name: str) -> Any:
        if name == "declaration":
            return lambda self: declaration
        if inspect.iscoroutinefunction(getattr(abstract, name)):
            async def method(self: Any, *args: Any, **kw: Any) -> None:
                return None
            return method
        return lambda self, *args, **kw: None

    return type(f"Trivial{abstract.__name__}", (abstract,), {n: make(n) for n in abstract.__abstractmethods__})


def _build_router(factory: Any) -> Any:
    """``factory(...)`` with each required argument built from its annotation: the token a string,
    an abstract participant a trivial one, anything else constructed the same way (one object per
    class, so the participant and the router share e.g. the model's admission)."""
    built: dict[type, Any] = {}

    def resolve(cls: type) -> Any:
        if cls not in built:
            target = _trivial(cls, _DECLARATIONS[factory.__name__]) if inspect.isabstract(cls) else cls
            built[cls] = target(**arguments(target.__init__))
        return built[cls]

    def arguments(fn: Any) -> dict[str, Any]:
        if fn is object.__init__:
            return {}
        hints = typing.get_type_hints(fn)
        return {p.name: "token" if p.name == "token" else resolve(hints[p.name])
                for p in inspect.signature(fn).parameters.values()
                if p.name != "self" and p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    return factory(**arguments(factory))


def _control_routes() -> set[tuple[str, str]]:
    """(method, full path) of every route gymkit's three routers register (``model_router``,
    ``agent_router``, ``resources_router``), each built around a participant that does nothing."""
    from gymkit.agent_control import agent_router
    from gymkit.model_control import model_router
    from gymkit.resources_control import resources_router

    async def collect() -> set[tuple[str, str]]:  # some kit objects want a running event loop
        routes = set()
        for factory in (model_router, agent_router, resources_router):
            for route in _build_router(factory).routes:
                for method in route.methods - {"HEAD"}:
                    routes.add((method, route.path))
        return routes

    return asyncio.run(collect())


def _module_structs(module: Any) -> list[str]:
    return [name for name, obj in vars(module).items()
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__]


def test_every_control_struct_phase_and_code_is_in_the_spec():
    section = CONTROL.read_text()
    for name in (*_module_structs(control), *_module_structs(gym_files)):
        assert f"<!-- BEGIN GENERATED message:{name} -->" in section, f"struct {name} has no table in CONTROL.md"
    assert set(CONTROL_MESSAGES) | set(GYM_FILES) <= set(_module_structs(control)) | set(_module_structs(gym_files))
    assert PHASES == typing.get_args(Phase)
    for phase in PHASES:
        assert f"| `{phase}` |" in section, phase
    for code in {c for codes in ERROR_CODES.values() for c in codes} | set(COORDINATOR_ONLY_CODES):
        assert f"| `{code}` |" in section, code
    for name in dir(control):
        if name.startswith(("HEADER_", "FEATURE_")):
            assert f"`{getattr(control, name)}`" in section, name


def test_field_meanings_name_only_real_fields():
    """``FIELD_MEANINGS`` (the meanings of fields without a ``msgspec.Meta`` description) has no entry
    for a struct or a field that does not exist, and none that a description already gives."""
    structs = {name: getattr(control, name, None) or getattr(gym_files, name) for name in FIELD_MEANINGS}
    for name, meanings in FIELD_MEANINGS.items():
        fields = {f.name: f for f in msgspec.inspect.type_info(structs[name]).fields}
        for field in meanings:
            assert field in fields, f"FIELD_MEANINGS[{name!r}] names no field {field!r}"
            t = fields[field].type
            assert not (isinstance(t, msgspec.inspect.Metadata) and (t.extra_json_schema or {}).get("description")), (
                f"{name}.{field} has a description of its own; drop its FIELD_MEANINGS entry")


def test_documented_routes_are_the_reference_routes():
    documented = _renderer().documented_routes()
    assert documented == {(m, "/ng-control/v1" + p) for m, p in REFERENCE_ROUTES}
    section = CONTROL.read_text()
    for method, path in documented:
        assert f"`{method} {path}`" in section, f"route {method} {path} is not in CONTROL.md"


def test_gymkit_registers_exactly_the_documented_routes():
    routes = _control_routes()
    documented = _renderer().documented_routes()
    assert routes == documented, (f"registered, not documented: {sorted(routes - documented)}; "
                                  f"documented, not registered: {sorted(documented - routes)}")


def test_control_names_its_sources():
    """CONTROL.md §0 names the Gym and NeMo-RL file versions it follows, and says the design note's
    pin was not found."""
    text = CONTROL.read_text()
    sources = text[text.index("## 0. Sources"):text.index("## 1. ")]
    for commit in ("9380654ea748e53f5c3f0bed9b59ade920d7d86a", "62aca7a25f12b8ed229b9e0c81020e4e551546ae",
                   "a6bb6c51f35175f6bdc89b965d933787b621dd94", "020d836ea6d7e3f3f0e31b4c39ef29d1ddcb67dd",
                   "0830f082e23c47576289637b5e93f9bd582b3d98", "02309db6924527009828abab6d22a9aa779c1693",
                   "e8b8ccbb6c75a0a8cebc94ca235f98b34aa4eba6", "d595189f9f056b8d09fb0b8aa926881d80ab2164",
                   "498dcedbef954fc52935a4f68762b50e4d16212b"):
        assert f"`{commit}`" in sources, commit
    assert "`f4fcf8c`" in sources and "not found" in sources


def test_continuation_reference_example_binds_the_line_shown():
    """CONTROL §6.3: the artifact reference's sha256, bytes and records are those of the
    continuation line shown plus its newline (recomputed here, not by the renderer)."""
    text = CONTROL.read_text()
    part = text[text.index("### 6.3 "):text.index("### 6.4 ")]
    blocks = re.findall(r"```json\n(.*?)\n```", part, re.DOTALL)
    ref = msgspec.json.decode(blocks[0], type=ArtifactRef)
    line = next(b for b in blocks[1:] if b.startswith('{"schema_version":1,"rollout_id"'))
    data = (line + "\n").encode()
    assert (ref.sha256, ref.bytes, ref.records) == (hashlib.sha256(data).hexdigest(), len(data), 1)
    root = msgspec.json.decode(line, type=AgentContinuationRoot)
    assert msgspec.json.encode(root) == line.encode()  # compact, declaration order: Gym's bytes
    assert ref.relative_path == f"{gym_files.agent_instance_dir('simple_agent')}/continuations.jsonl"
    assert ref.relative_path.startswith(
        "agent/instance-" + hashlib.sha256(b"simple_agent").hexdigest() + "/")


def test_control_topology_vector_is_nemo_rl_recipe_over_the_contracts_shown():
    """Recomputed without ``schemas.topology``: the contracts shown, put through the recipe of CONTROL
    §5.3 (sort, drop features, wrap, canonical JSON, SHA-256), give the bytes and the hex shown; the
    manifest spelling is ``sha256:`` + that hex; each contract is what ``Capabilities.contract()``
    builds."""
    text = CONTROL.read_text()
    block = text[text.index("<!-- BEGIN GENERATED control:topology -->"):text.index("<!-- END GENERATED control:topology -->")]
    bare = re.search(r"\| `([0-9a-f]{64})` \|", block).group(1)
    assert f"`sha256:{bare}`" in block
    contracts_text, document_text = re.findall(r"```json\n(.*?)\n```", block, re.DOTALL)
    contracts = json.loads(contracts_text)
    ordered = sorted(contracts, key=lambda c: (c["participant"]["component"], c["participant"]["server_name"],
                                               c["participant"]["participant_name"]))
    document = {"schema_version": 1, "participants": [{k: v for k, v in c.items() if k != "features"}
                                                       for c in ordered]}
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert canonical == document_text
    assert hashlib.sha256(canonical.encode("utf-8")).hexdigest() == bare
    assert {c["participant"]["component"] for c in contracts} == {
        "responses_api_models", "responses_api_agents", "resources_servers"}
    for c in contracts:
        caps = Capabilities(component=c["participant"]["component"], name=c["participant"]["participant_name"],
                            schema_version=c["schema_version"], admission_states=c["admission_states"],
                            checkpoint_mode=c["checkpoint_mode"], concurrency_contract=c["concurrency_contract"],
                            multi_process=MultiProcess(**c["multi_process"]), instance_role=c["instance_role"],
                            features=c["features"])
        assert caps.contract(c["participant"]["server_name"]) == c
    spec = SPEC.read_text()
    assert f"`sha256:{bare}`" in spec and document_text in spec  # SPEC §6's vector is the same


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
    assert {str(n) for n in range(12)} <= numbers["CONTROL"]
    texts = {"SPEC.md": (spec, "SPEC"), "CONTROL.md": (control, "CONTROL")}
    for path in _code_files():
        texts[str(path.relative_to(ROOT))] = (path.read_text(), "SPEC")
    for where, (text, own) in texts.items():
        for m in _REF.finditer(text):
            doc = (m.group(1) or own).strip().removesuffix(".md")
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


def test_completion_receipt_example_follows_the_digest_rule():
    """CONTROL §7: the example receipt's digest and identity, recomputed from the result it names."""
    text = CONTROL.read_text()
    block = text[text.index("<!-- BEGIN GENERATED message:CompletionReceipt -->"):
                 text.index("<!-- END GENERATED message:CompletionReceipt -->")]
    receipt = json.loads(re.search(r"```json\n(.*?)\n```", block, re.DOTALL).group(1))
    result = {"id": "resp_0f3a", "reward": 1.0}
    assert json.dumps(result) in text[text.index("## 7. "):text.index("## 8. ")].replace("`", "")
    digest = hashlib.sha256(json.dumps(result, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
                            .encode("utf-8")).hexdigest()
    assert receipt["result_digest"] == digest and receipt["result_identity"] == str(result["id"])
