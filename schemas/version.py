"""Format version and features: the only place that says what this code can read and write."""

from __future__ import annotations

from collections.abc import Iterable

from schemas.errors import VersionError

FORMAT_MAJOR = 1
#: 1.1 added the ``dataplane_rows`` file kind and the feature of the same name (SPEC §12.2a, §14.3).
FORMAT_MINOR = 1
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"

#: Features this implementation understands. A snapshot lists the ones a reader MUST know in
#: ``required_features``; an unknown entry there is refused, naming both format versions (a reader
#: that skipped what it does not know would misread the snapshot). 1.0 defined none; 1.1 defines
#: ``dataplane_rows``: a snapshot holding a file of that kind lists it, because a reader that
#: ignores unknown kinds would restore the data plane without those partitions.
KNOWN_FEATURES: frozenset[str] = frozenset({"dataplane_rows"})
#: Names the spec reserves for later minor versions: refused until implemented.
RESERVED_FEATURES: frozenset[str] = frozenset({"shared_objects"})

#: The feature a snapshot MUST list in ``required_features`` when it holds a file of the kind
#: (a kind an older reader would skip, losing what the file holds).
KIND_FEATURES: dict[str, str] = {"dataplane_rows": "dataplane_rows"}

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
    major, minor = parse_version(format_version, where)
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


def features_of_kinds(kinds: Iterable[str]) -> list[str]:
    """The ``required_features`` of a snapshot whose files are of ``kinds``: sorted, each once, empty
    when none of them needs one (so such a snapshot stays readable by a 1.0 reader)."""
    return sorted({KIND_FEATURES[k] for k in kinds if k in KIND_FEATURES})


def check_record_version(schema_version: int, where: str) -> None:
    """Refuse a record whose ``schema_version`` is newer than this reader's, or not positive."""
    if schema_version < 1 or schema_version > RECORD_SCHEMA_VERSION:
        raise VersionError(
            f"{where}: schema_version {schema_version} is not supported "
            f"(this reader understands 1..{RECORD_SCHEMA_VERSION})"
        )
