"""Format version and features: the only place that says what this code can read and write."""

from __future__ import annotations

from collections.abc import Iterable

from schemas.errors import VersionError

FORMAT_MAJOR = 1
#: 1.1 added the ``dataplane_rows`` file kind and the feature of the same name (SPEC §12.2a, §14.3).
#: 1.2 adds the ``gym_file`` kind (Gym's own checkpoint files, adopted as parts: SPEC §12.11), and
#: ``gym_commit`` and ``topology_fingerprint`` hold what Gym's protocol gives (Gym's component names
#: and commit replies; NeMo-RL's fingerprint). It needs no feature (SPEC §13.1): see
#: :data:`KINDS_WITHOUT_FEATURE`.
#: 1.3 adds shared objects (feature ``shared_objects``, SPEC §14.2): immutable, content-addressed
#: files under ``objects/`` that a file entry names instead of a file of the snapshot folder, so that
#: a snapshot lists what its parent wrote without writing it again (incremental snapshots).
#: 1.4 adds listed parts (feature ``part_listings``, SPEC §10.4, §14.4): the manifest names a Gym
#: part by its part manifest and totals instead of repeating every file, so that the manifest's size
#: grows with the parts, not with the rollouts (1,000,000 parked rollouts are 2,000,000 Gym files).
FORMAT_MINOR = 4
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"

#: Features this implementation understands. A snapshot lists the ones a reader MUST know in
#: ``required_features``; an unknown entry there is refused, naming both format versions (a reader
#: that skipped what it does not know would misread the snapshot). 1.0 defined none; 1.1 defines
#: ``dataplane_rows``: a snapshot holding a file of that kind lists it, because a reader that
#: ignores unknown kinds would restore the data plane without those partitions. 1.2 adds none. 1.3
#: defines ``shared_objects``: a snapshot with a file entry naming an object lists it, because a
#: reader that looked for that file in the snapshot folder would find nothing there. 1.4 defines
#: ``part_listings``: a snapshot whose manifest lists a part by its part manifest only lists it,
#: because a reader that took the manifest's files for all of them would miss that part's files (a
#: copy would leave them behind, a restore would find Gym's folders empty).
SHARED_OBJECTS = "shared_objects"
PART_LISTINGS = "part_listings"
KNOWN_FEATURES: frozenset[str] = frozenset({"dataplane_rows", SHARED_OBJECTS, PART_LISTINGS})
#: Names the spec reserves for later minor versions: refused until implemented.
RESERVED_FEATURES: frozenset[str] = frozenset()

#: The feature a snapshot MUST list in ``required_features`` when it holds a file of the kind
#: (a kind an older reader would skip, losing what the file holds).
KIND_FEATURES: dict[str, str] = {"dataplane_rows": "dataplane_rows"}

#: Kinds added by a minor version that deliberately need no feature, each with the reason (SPEC
#: §13.1, §14). An older reader skips ``gym_file`` and so sees no Gym state in the snapshot, but
#: reads every other part as written; the one reader that would go wrong by missing it, a restore,
#: refuses the snapshot first: the manifest's ``topology_fingerprint`` is NeMo-RL's, which never
#: equals the fingerprint a 1.0 or 1.1 coordinator computes (SPEC §6, §15.4 step 3). A feature
#: would instead make every snapshot of Gym's protocol unreadable to 1.1 tools (``ls``, ``show``,
#: ``verify``, the TQ and controller parts) for no gain.
KINDS_WITHOUT_FEATURE: dict[str, str] = {
    "gym_file": "older readers skip Gym's files; an older restore refuses the snapshot by its topology fingerprint",
}

#: Highest ``schema_version`` of each record family this code reads (older ones are accepted).
RECORD_SCHEMA_VERSION = 1


def parse_version(text: str, where: str) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; anything else raises :class:`VersionError` naming ``where``."""
    parts = text.split(".") if isinstance(text, str) else []
    if len(parts) != 2 or not all(p.isdigit() and p.isascii() for p in parts):
        raise VersionError(f"{where}: format_version {text!r} is not '<major>.<minor>'")
    return int(parts[0]), int(parts[1])


def check_readable(format_version: str, required_features: list[str] | tuple[str, ...], where: str) -> None:
    """Refuse a newer major version or an unknown required feature, naming both versions."""
    major, _minor = parse_version(format_version, where)
    if major != FORMAT_MAJOR:
        raise VersionError(
            f"{where}: written with format version {format_version}, this reader understands "
            f"{FORMAT_VERSION} (major {FORMAT_MAJOR} only)"
        )
    unknown = sorted(set(required_features) - KNOWN_FEATURES)
    if unknown:
        raise VersionError(
            f"{where}: requires feature(s) {', '.join(unknown)} (format version {format_version}); "
            f"this reader (format version {FORMAT_VERSION}) knows "
            f"{', '.join(sorted(KNOWN_FEATURES)) or 'none'}"
        )


def features_of_kinds(kinds: Iterable[str], objects: bool = False, listed_parts: bool = False) -> list[str]:
    """The ``required_features`` of a snapshot whose files are of ``kinds`` (with ``objects``, one of
    which names a shared object; with ``listed_parts``, whose manifest lists a part by its part
    manifest only): sorted, each once, empty when none of them needs one (so such a snapshot stays
    readable by a 1.0 reader). ``gym_file`` needs none (:data:`KINDS_WITHOUT_FEATURE`)."""
    features = {KIND_FEATURES[k] for k in kinds if k in KIND_FEATURES}
    if objects:
        features.add(SHARED_OBJECTS)
    if listed_parts:
        features.add(PART_LISTINGS)
    return sorted(features)


def check_record_version(schema_version: int, where: str) -> None:
    """Refuse a record whose ``schema_version`` is newer than this reader's, or not positive."""
    if schema_version < 1 or schema_version > RECORD_SCHEMA_VERSION:
        raise VersionError(
            f"{where}: schema_version {schema_version} is not supported "
            f"(this reader understands 1..{RECORD_SCHEMA_VERSION})"
        )
