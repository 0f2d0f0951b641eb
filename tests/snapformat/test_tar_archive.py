"""Gym's tar archives (``snapformat.tar_archive``): what the writer builds by hand is ``tarfile``'s
bytes, and what the reader reads is ``tarfile``'s reading, on any archive and any damage to one.
``tarfile`` is the judge: Gym writes and reads its archives with it."""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from schemas.errors import CorruptSnapshotError, InvalidPathError
from snapformat import tar_archive
from snapformat.tar_archive import read_members, tar_bytes

#: Member names as Gym's layout makes them (``<rid>.a<n>.json``), short enough for a plain header.
GYM_NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,40}\.a[0-9]{1,3}\.json", fullmatch=True)
GYM_MEMBERS = st.lists(st.tuples(GYM_NAMES, st.binary(max_size=1_500)), max_size=6, unique_by=lambda m: m[0])
#: Any name tarfile can hold: long, non-ASCII, with a NUL or a "/".
ANY_NAMES = st.one_of(st.text(alphabet=st.characters(max_codepoint=127), min_size=1, max_size=110),
                      st.text(min_size=1, max_size=20))


def tarfile_reading(data: bytes) -> list[tuple[str, bytes | None]] | type[Exception]:
    """What ``tarfile`` itself reads from ``data``: each member's name and bytes (None for a member
    that is not a regular file), or the type of error it raises."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            out: list[tuple[str, bytes | None]] = []
            for m in tf.getmembers():
                fh = tf.extractfile(m) if m.isreg() else None
                out.append((m.name, None if fh is None else fh.read()))
            return out
    except (tarfile.TarError, OSError, EOFError) as exc:
        return type(exc)


def assert_read_as_tarfile_reads(data: bytes) -> None:
    """``read_members`` answers what ``tarfile`` read, under Gym's rules: the members if each is a
    regular file with a safe name, once; else (or if tarfile cannot read it) a typed error naming the
    archive."""
    expected = tarfile_reading(data)
    try:
        got = read_members(data, "a.tar")
    except (CorruptSnapshotError, InvalidPathError) as exc:
        assert str(exc).startswith("a.tar: ")
        names = [] if isinstance(expected, type) else [n for n, _ in expected]
        assert (isinstance(expected, type) or any(b is None for _, b in expected) or len(set(names)) < len(names)
                or isinstance(exc, InvalidPathError)), (exc, expected)
        return
    assert list(got.items()) == expected


def archive(members: list[tuple[str, bytes]], fmt: int, kinds: list[bytes] | None = None) -> bytes:
    """``members`` written by ``tarfile`` in format ``fmt``, with other header values than Gym's."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for i, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.type = (kinds or [tarfile.REGTYPE] * len(members))[i]
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            info.mode, info.mtime, info.uname = 0o644, 1_700_000_000 + i, "gym"
            tf.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return out.getvalue()


@settings(max_examples=200, deadline=None)
@given(members=st.lists(st.tuples(ANY_NAMES, st.binary(max_size=2_000)), max_size=8))
def test_tar_bytes_are_tarfiles_bytes_for_any_members(members: list[tuple[str, bytes]]) -> None:
    # Headers built by hand for short ASCII names, tarfile's own for the rest: the same bytes either way,
    # and tarfile reads every member back. A NUL ends a name in tar, and tarfile reads a name that ends in
    # "/" as a folder's (without the "/"), so such names (never a Gym member's) are only compared as bytes.
    built = tar_bytes(members)
    assert built == tar_archive._tarfile_bytes(members)
    assume(all("\x00" not in name and not name.endswith("/") for name, _ in members))
    assert tarfile_reading(built) == members


@settings(max_examples=200, deadline=None)
@given(members=GYM_MEMBERS)
def test_gym_archives_are_read_by_slicing_as_tarfile_reads_them(members: list[tuple[str, bytes]]) -> None:
    built = tar_bytes(members)
    fast = tar_archive._fixed_header_members(built)
    if members:  # the fast path reads every archive Gym's writer makes (an empty one is tarfile's)
        assert fast == members
    assert list(read_members(built, "a.tar").items()) == members == tarfile_reading(built)


@settings(max_examples=200, deadline=None)
@given(members=st.lists(st.tuples(ANY_NAMES, st.binary(max_size=700)), max_size=5),
       fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
def test_other_archives_are_read_as_tarfile_reads_them(members: list[tuple[str, bytes]], fmt: int) -> None:
    # Other header values (mode 0644, an mtime, a user name), long names, other formats: never the fast path's.
    try:
        data = archive(members, fmt)
    except ValueError:  # a name this format cannot hold
        assume(False)
    assert tar_archive._fixed_header_members(data) is None
    assert_read_as_tarfile_reads(data)


@settings(max_examples=400, deadline=None)
@given(members=GYM_MEMBERS.filter(bool), edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                                       min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 1 << 16), tail=st.binary(max_size=600))
def test_any_damage_to_a_gym_archive_is_read_as_tarfile_reads_it(members: list[tuple[str, bytes]],
                                                                  edits: list[tuple[int, int]], cut: int | None,
                                                                  tail: bytes) -> None:
    # Bytes overwritten anywhere (headers, checksums, sizes, data, padding), the archive cut short, bytes
    # added: where the fast path answers, tarfile answers the same; everything else is tarfile's own reading.
    data = bytearray(tar_bytes(members))
    for at, value in edits:
        data[at % len(data)] = value
    damaged = bytes(data[:cut]) + tail if cut is not None else bytes(data) + tail
    fast = tar_archive._fixed_header_members(damaged)
    if fast is not None:
        assert fast == tarfile_reading(damaged)
    assert_read_as_tarfile_reads(damaged)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=3_000))
def test_any_bytes_read_as_members_or_a_typed_error(data: bytes) -> None:
    assert_read_as_tarfile_reads(data)


def test_a_damaged_header_falls_back_to_tarfile_and_its_answer() -> None:
    good = tar_bytes([("r1.a0.json", b"one"), ("r2.a0.json", b"two")])
    # The second header's checksum off by one: tarfile stops there (the first member only), and so do we.
    second = 1024
    damaged = bytearray(good)
    damaged[second + 153] ^= 1
    assert tar_archive._fixed_header_members(bytes(damaged)) is None
    assert read_members(bytes(damaged), "a.tar") == {"r1.a0.json": b"one"} == dict(tarfile_reading(bytes(damaged)))
    # The first header's: tarfile cannot read the archive at all.
    damaged = bytearray(good)
    damaged[153] ^= 1
    with pytest.raises(CorruptSnapshotError, match=r"^a\.tar: not a readable tar archive \(bad checksum\)"):
        read_members(bytes(damaged), "a.tar")
    # A member cut short.
    with pytest.raises(CorruptSnapshotError, match=r"^a\.tar: not a readable tar archive \(unexpected end of data\)"):
        read_members(good[:512 + 2], "a.tar")


def test_members_gym_never_writes_are_refused_naming_the_archive_and_the_member() -> None:
    folder = archive([("r1.a0.json", b"x"), ("sub", b"")], tarfile.PAX_FORMAT, [tarfile.REGTYPE, tarfile.DIRTYPE])
    with pytest.raises(CorruptSnapshotError, match=r"^a\.tar: member 'sub' is not a regular file"):
        read_members(folder, "a.tar")
    twice = tar_bytes([("r1.a0.json", b"x"), ("r1.a0.json", b"y")])
    with pytest.raises(CorruptSnapshotError, match=r"^a\.tar: member 'r1.a0.json' appears twice"):
        read_members(twice, "a.tar")
    unsafe = tar_bytes([("../r1.a0.json", b"x")])
    with pytest.raises(InvalidPathError, match=r"^a\.tar: member name: '../r1.a0.json' is not a safe name"):
        read_members(unsafe, "a.tar")
    with pytest.raises(CorruptSnapshotError, match=r"^a\.tar: not a readable tar archive"):
        read_members(b"not a tar" * 100, "a.tar")
