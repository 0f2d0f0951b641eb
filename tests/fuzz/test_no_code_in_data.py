"""Snapshot contents are data, never code: no reader or contract can execute what it reads.

Proves that no source file of ``schemas/`` or ``snapformat/`` mentions pickle, ``marshal.loads``,
``eval(`` or ``exec(`` (the spec's Security section: the format holds no executable serialisation
and readers execute nothing). A plain text search, so a comment or a string trips it too: that is
the point, no one should have to argue which mention is harmless.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "snapformat")
FORBIDDEN = ("import pickle", "pickle.", "marshal.loads", "eval(", "exec(")


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_packages_have_sources() -> None:
    assert len(_sources()) >= 20  # the search below must not pass by finding nothing


@pytest.mark.parametrize("pattern", FORBIDDEN)
def test_no_source_can_run_code_it_reads(pattern: str) -> None:
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in _sources() for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if pattern in line]
    assert not hits, f"{pattern!r} found:\n" + "\n".join(hits)
