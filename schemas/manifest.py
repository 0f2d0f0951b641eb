"""The manifest, the per-participant part manifest and the commit record.

Persisted records never forbid unknown fields (a newer minor version may add some); new fields
always get defaults. Limits (``Meta``) bound what a reader of untrusted bytes will accept.

Every field of a persisted record (here and in ``gym_records``, ``controller`` and ``control``)
carries its meaning as ``msgspec.Meta(description=...)``: the spec's tables
(``spec/render_spec_schemas.py``) and the exported JSON Schemas are generated from it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Str = Annotated[str, msgspec.Meta(max_length=4096)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
RelPath = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
# ``$(?![\s\S])``, not ``$``: msgspec matches with Python's ``re.search``, whose ``$`` also matches
# before a final newline, and every pattern of the spec is a whole-string match (the lookahead reads
# the same in JSON Schema's ECMA regexes).
Checksum = Annotated[str, msgspec.Meta(pattern=r"^(xxh128:[0-9a-f]{32}|sha256:[0-9a-f]{64})$(?![\s\S])")]
Fingerprint = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}$(?![\s\S])")]
#: A shared object's name: the SHA-256 of its bytes (SPEC §14.2).
ObjectName = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}$(?![\s\S])")]
RowRange = Annotated[tuple[NonNeg, NonNeg], msgspec.Meta(
    description="`[start, stop)` of the rows of a row file, counted from 0 across its record batches.")]

#: What each file of a snapshot holds; decides how it is parsed and which struct or Arrow schema
#: it must follow. Readers ignore files of kinds they do not know (verify still checks bytes).
FileKind = Literal[
    "training_rows",
    "token_capture_rows",
    "dataplane_rows",
    "continuations",
    "agent_state",
    "model_ledger",
    "token_index",
    "session_state",
    "loader_place",
    "replay_index",
    "recovery_ledger",
    "part_manifest",
]
JSONL_KINDS = frozenset(
    {"continuations", "agent_state", "model_ledger", "token_index", "session_state",
     "replay_index", "recovery_ledger"}
)
ROW_KINDS = frozenset({"training_rows", "token_capture_rows", "dataplane_rows"})
JSON_KINDS = frozenset({"loader_place", "part_manifest"})

Compression = Literal["none", "zstd"]


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a snapshot: where it is, how big, how many records, and its checksum."""

    path: Annotated[RelPath, msgspec.Meta(
        description="Location relative to the snapshot folder: `/`-separated, every segment a safe name "
                    "(see Identifiers and paths).")]
    kind: Annotated[Str, msgspec.Meta(
        description="What the file holds (see Parts). Readers ignore kinds they do not know, except that "
                    "verification still checks their bytes.")]
    size: Annotated[NonNeg, msgspec.Meta(description="Exact size in bytes of the file as stored.")]
    checksum: Annotated[Checksum, msgspec.Meta(
        description="Checksum over the bytes as stored (after any compression).")]
    records: Annotated[NonNeg, msgspec.Meta(
        description="Rows (row parts), lines (JSON-lines parts) or 1 (JSON parts).")]
    compression: Annotated[Compression, msgspec.Meta(
        description="Whole-file compression: `none`, or `zstd` (one zstd frame over a JSON-lines file). "
                    "MUST be `none` for row and JSON parts.")] = "none"
    content_size: Annotated[NonNeg | None, msgspec.Meta(
        description="Uncompressed size in bytes; REQUIRED (non-null) when `compression` is `zstd`, "
                    "null otherwise.")] = None
    batches: Annotated[NonNeg | None, msgspec.Meta(
        description="Number of Arrow record batches in a row part; null for other parts.")] = None
    writer: Annotated[Str, msgspec.Meta(
        description="Label of the participant that wrote the file (by default its part prefix). "
                    "Informative.")] = ""
    object: Annotated[ObjectName | None, msgspec.Meta(
        description="The shared object that holds the file's bytes (`sha256:<hex>` of those bytes; format 1.3, "
                    "feature `shared_objects`): read from `objects/<first 2 hex digits>/<64 hex digits>` of the "
                    "store instead of the snapshot folder, and `checksum` MUST equal it. Null: the file lies in "
                    "the snapshot folder at `path`.")] = None
    row_range: Annotated[RowRange | None, msgspec.Meta(
        description="`[start, stop)`: the rows of the object's row file that this snapshot holds (row parts "
                    "naming an object only; `records` MUST equal `stop - start`). Null: every row of the file.")] = None


class PartManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What one writer (a Gym server, the controller, the TQ adapter) wrote under its prefix."""

    format_version: Annotated[Str, msgspec.Meta(description="Format version the participant wrote.")]
    snapshot_id: Annotated[Name, msgspec.Meta(
        description="The draft's snapshot id; MUST equal the folder the part lies in.")]
    prefix: Annotated[RelPath, msgspec.Meta(description="The part's prefix, relative to the snapshot folder.")]
    writer: Annotated[Str, msgspec.Meta(
        description="Label of the participant (e.g. `agent:agent0`); copied into each file entry's `writer`.")]
    files: Annotated[list[FileEntry], msgspec.Meta(
        description="Every file of the part except `part-manifest.json` itself; each `path` MUST lie "
                    "under `prefix`.")]
    written_at: Annotated[float, msgspec.Meta(description="Unix seconds at which the part was closed.")]


class PartReceipt(msgspec.Struct, frozen=True, kw_only=True):
    """What a writer hands back after writing its part: enough for the publisher to find and check
    the part manifest. It travels over HTTP in Gym's commit result."""

    prefix: Annotated[RelPath, msgspec.Meta(description="The part's prefix.")]
    writer: Annotated[Str, msgspec.Meta(description="The participant's label, as in its part manifest.")]
    part_manifest_checksum: Annotated[Checksum, msgspec.Meta(
        description="Checksum of the bytes of `<prefix>/part-manifest.json`; the publisher refuses a part "
                    "manifest with another checksum.")]


class ParticipantCommit(msgspec.Struct, frozen=True, kw_only=True):
    """One Gym participant's commit result, as the manifest keeps it."""

    component: Annotated[Str, msgspec.Meta(
        description="Gym's component name: `responses_api_agents`, `responses_api_models` or `resources_servers` "
                    "(format 1.0 and 1.1 writers wrote `agent`, `model` or `resource`).")]
    name: Annotated[Name, msgspec.Meta(description="The participant's name (a safe name).")]
    part_prefix: Annotated[RelPath | None, msgspec.Meta(
        description="Prefix of the part it wrote, or null for a stateless participant that wrote "
                    "nothing.")] = None
    part_manifest_checksum: Annotated[Checksum | None, msgspec.Meta(
        description="Checksum of its `part-manifest.json`, as it reported in its commit result; null when "
                    "`part_prefix` is null.")] = None
    payload: Annotated[dict[str, Any], msgspec.Meta(
        description="The participant's own commit payload (opaque JSON object, kept verbatim).")] = {}


class GymCommit(msgspec.Struct, frozen=True, kw_only=True):
    """Gym's commit result: the checkpoint id and each participant's commit."""

    checkpoint_id: Annotated[Str, msgspec.Meta(
        description="The checkpoint id Gym's control calls carried for this snapshot.")]
    participants: Annotated[list[ParticipantCommit], msgspec.Meta(
        description="Each Gym participant's commit, in commit order (agents, then models, then "
                    "resources).")] = []


class ParentRef(msgspec.Struct, frozen=True, kw_only=True):
    snapshot_id: Annotated[Name, msgspec.Meta(description="The parent snapshot's id.")]
    sequence: Annotated[NonNeg, msgspec.Meta(description="The parent snapshot's sequence number.")]


#: Most file entries a manifest may list (``Manifest.files``); a publisher refuses more (SPEC §15.5).
MAX_MANIFEST_FILES = 1_000_000
#: Most parts a manifest may list by their part manifests (``Manifest.listed_parts``).
MAX_LISTED_PARTS = 100_000


class ListedPart(msgspec.Struct, frozen=True, kw_only=True):
    """A part the manifest lists by its part manifest only (format 1.4, SPEC §10.4): its files are
    the part manifest's, and these totals let a reader count and size them without reading it."""

    prefix: Annotated[RelPath, msgspec.Meta(
        description="The part's prefix; the manifest lists `<prefix>/part-manifest.json` and no other file "
                    "under it.")]
    files: Annotated[NonNeg, msgspec.Meta(
        description="How many files the part manifest lists (itself not counted); a reader refuses a part "
                    "manifest that lists another number.")]
    bytes: Annotated[NonNeg, msgspec.Meta(
        description="The sum of their `size`s; a reader refuses a part manifest whose sizes sum to another "
                    "number.")]


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """The table of contents of one snapshot; written once by the publisher, never changed."""

    format_version: Annotated[Str, msgspec.Meta(
        description="Format version the publisher wrote. Readers refuse another major version.")]
    required_features: Annotated[list[Str], msgspec.Meta(
        description="Features a reader MUST implement to read this snapshot correctly (see Features): "
                    "`dataplane_rows` when it holds a file of that kind, `shared_objects` when an entry "
                    "names a shared object, `part_listings` when `listed_parts` is not empty, else empty "
                    "(always empty in 1.0).")] = []
    snapshot_id: Annotated[Name, msgspec.Meta(description="This snapshot's id (its folder name).")]
    sequence: Annotated[int, msgspec.Meta(ge=1), msgspec.Meta(
        description="This snapshot's sequence number (>= 1).")]
    created_at: Annotated[float, msgspec.Meta(description="Unix seconds at which the draft was begun.")]
    committed_at: Annotated[float, msgspec.Meta(
        description="Unix seconds at which the publisher sealed the manifest to commit it.")]
    files: Annotated[list[FileEntry], msgspec.Meta(max_length=MAX_MANIFEST_FILES), msgspec.Meta(
        description="Every file of the snapshot, part manifests included, except the files of the parts in "
                    "`listed_parts`, which their part manifests list. A file listed in neither is not part of "
                    "the snapshot.")]
    listed_parts: Annotated[list[ListedPart], msgspec.Meta(max_length=MAX_LISTED_PARTS), msgspec.Meta(
        description="The parts whose files only their part manifest lists (format 1.4, feature "
                    "`part_listings`), in the order the publisher added them; empty before 1.4.")] = []
    gym_commit: Annotated[GymCommit | None, msgspec.Meta(
        description="Gym's commit result for this snapshot, or null when no Gym took part.")] = None
    topology_fingerprint: Annotated[Fingerprint | None, msgspec.Meta(
        description="Fingerprint of the participants that took the snapshot, or null when none was "
                    "recorded.")] = None
    parent: Annotated[ParentRef | None, msgspec.Meta(
        description="The newest committed snapshot when this draft was begun, or null for the first "
                    "snapshot of a store. Informative: the parent may since have been deleted (or not "
                    "copied along).")] = None
    timings_s: Annotated[dict[Str, float], msgspec.Meta(
        description="Informative durations in seconds (e.g. of the pause, of each phase). Readers MUST "
                    "NOT depend on them.")] = {}
    producer: Annotated[Str, msgspec.Meta(
        description="Informative name and version of the software that published the snapshot.")] = ""

    @property
    def file_count(self) -> int:
        """Every file of the snapshot: those listed here and those of the listed parts."""
        return len(self.files) + sum(p.files for p in self.listed_parts)

    @property
    def total_bytes(self) -> int:
        """The sizes of every file of the snapshot summed (an object named twice counted twice)."""
        return sum(f.size for f in self.files) + sum(p.bytes for p in self.listed_parts)


class CommitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The commit point: created once, create-only, under ``_commits/``; names its manifest."""

    format_version: Annotated[Str, msgspec.Meta(
        description="Format version the publisher wrote (`<major>.<minor>`).")]
    sequence: Annotated[int, msgspec.Meta(ge=1), msgspec.Meta(
        description="The snapshot's sequence number; MUST equal the sequence encoded in this file's name.")]
    snapshot_id: Annotated[Name, msgspec.Meta(
        description="Folder of the snapshot under `snapshots/`; the manifest read from there MUST carry "
                    "the same id.")]
    manifest_size: Annotated[NonNeg, msgspec.Meta(
        description="Exact size in bytes of `snapshots/<snapshot_id>/manifest.json`.")]
    manifest_checksum: Annotated[Checksum, msgspec.Meta(description="Checksum of the bytes of `manifest.json`.")]
    committed_at: Annotated[float, msgspec.Meta(
        description="Unix seconds at which the publisher sealed the manifest (equal to the manifest's "
                    "`committed_at`).")]


class LatestHint(msgspec.Struct, frozen=True, kw_only=True):
    """Advisory pointer to the newest sequence; readers verify it and never trust it alone."""

    sequence: Annotated[int, msgspec.Meta(ge=1), msgspec.Meta(
        description="A recently published sequence (normally the newest). Advisory only.")]
    snapshot_id: Annotated[Name, msgspec.Meta(description="The snapshot id of that sequence (informative).")]


class StoreMarker(msgspec.Struct, frozen=True, kw_only=True):
    """``snapformat-store.json``: says that a folder or prefix is a snapshot store."""

    format: Annotated[Literal["snapformat-store"], msgspec.Meta(
        description="Always `snapformat-store`: says that this folder or prefix is a snapshot store.")] = (
        "snapformat-store")
    format_version: Annotated[Str, msgspec.Meta(
        description="Format version of the store's layout (`<major>.<minor>`).")] = "1.0"
