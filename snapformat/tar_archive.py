"""Gym's tar archives (an agent's ``agent-part-NNNNNN.tar``, CONTROL.md §6): written and read here.

Gym writes each archive with Python's ``tarfile`` (PAX format) and fixed member headers: mode 0600,
mtime 0, uid and gid 0, empty user and group names. Both directions keep ``tarfile``'s exact
behaviour and are faster on those fixed headers:

* :func:`tar_bytes` builds a fixed header as a join of bytes, byte for byte ``tarfile``'s, and
  leaves any other member (a long or non-ASCII name, a huge size) to ``tarfile`` itself.
* :func:`read_members` reads an archive whose every header is such a fixed header by slicing; at the
  first header that is not one (a PAX or GNU header, another type, mode or time, a checksum written
  otherwise, a truncated member), it gives the whole archive to ``tarfile``. So the fast path only
  returns where ``tarfile`` would return the same members, and ``tarfile`` decides the rest,
  errors included (``tests/snapformat/test_tar_archive.py`` compares the two on random archives and
  on random damage). ``tarfile``'s header parsing was 30% of a restore's check of its Gym parts
  at 10,000 rollouts (``py-spy``), and every agent restore read its archives with it again.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterable

from schemas.errors import CorruptSnapshotError
from schemas.identity import check_name

__all__ = ["read_members", "tar_bytes"]

#: tar's block and record (``tarfile.BLOCKSIZE``, ``tarfile.RECORDSIZE``: 20 blocks).
_TAR_BLOCK = 512
_TAR_RECORD = 20 * _TAR_BLOCK
#: The fields of a member's ustar header around its name, size and checksum, as ``tarfile`` writes
#: them for the fixed headers: mode 0600, uid and gid 0 (each octal, NUL-ended) ...
_USTAR_MODE_IDS = b"0000600\0" + b"0000000\0" * 2
#: ... mtime 0, and after the checksum: a regular file, no link name, the POSIX magic "ustar\0" "00",
#: empty user and group names and device numbers, no prefix, NULs to the end of the block.
_USTAR_MTIME = b"00000000000\0"
_USTAR_AFTER_CHKSUM = (b"0" + b"\0" * 100 + b"ustar\x0000"
                       + b"\0" * (32 + 32 + 8 + 8 + 155)).ljust(_TAR_BLOCK - 156, b"\0")
#: What the checksum field (as 8 spaces) and the fields after it add to every header's checksum.
_USTAR_FIXED_SUM = 8 * 32 + sum(_USTAR_AFTER_CHKSUM)
#: A size field as ``tarfile`` writes one below 8**11: 11 octal digits and a NUL.
#: What a fixed header's checksum adds up to besides its name and size fields: those fixed fields
#: (mode, ids, mtime) and :data:`_USTAR_FIXED_SUM`.
_FIXED_FIELDS_SUM = _USTAR_FIXED_SUM + sum(_USTAR_MODE_IDS) + sum(_USTAR_MTIME)
_SIZE_FIELD = re.compile(rb"[0-7]{11}\0")
_END_BLOCK = bytes(_TAR_BLOCK)


def _ustar_header(name: bytes, size: int) -> bytes:
    """One member's 512-byte ustar header, byte for byte what ``tarfile`` (PAX format) writes for a
    name of at most 100 ASCII bytes and a size below 8**11 (no PAX header then). The checksum is the
    sum of the header's bytes with its own field as 8 spaces, written as 6 octal digits, NUL, space."""
    head = name.ljust(100, b"\0") + _USTAR_MODE_IDS + b"%011o\0" % size + _USTAR_MTIME
    return head + b"%06o\0 " % (sum(head) + _USTAR_FIXED_SUM) + _USTAR_AFTER_CHKSUM


def tar_bytes(members: Iterable[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar of ``(name, bytes)`` members whose headers are fixed (mode 0o600, mtime 0,
    uid and gid 0, empty user and group names; a long name in a PAX header), so the same members
    give the same bytes.

    Members with short ASCII names (every archive member Gym's layout names) get their headers built
    here, a join of bytes: ``tarfile`` builds each through dicts and a PAX check, a third of an agent's
    commit at 1,000 records (``py-spy``). Any other member makes the whole archive ``tarfile``'s.
    ``tests/snapformat/test_tar_archive.py`` compares the two on random members."""
    members = list(members)
    encoded = []
    for name, data in members:
        if not name.isascii() or len(name) > 100 or len(data) >= 8 ** 11:
            return _tarfile_bytes(members)
        encoded.append((name.encode("ascii"), data))
    pieces: list[bytes] = []
    offset = 0
    for raw, data in encoded:
        pad = -len(data) % _TAR_BLOCK
        pieces += (_ustar_header(raw, len(data)), data, b"\0" * pad)
        offset += _TAR_BLOCK + len(data) + pad
    offset += 2 * _TAR_BLOCK  # the end-of-archive marker, then NULs to a whole record
    pieces.append(b"\0" * (2 * _TAR_BLOCK + -offset % _TAR_RECORD))
    return b"".join(pieces)


def _tarfile_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """:func:`tar_bytes` written by ``tarfile`` (PAX format), for any member."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def read_members(data: bytes, where: str) -> dict[str, bytes]:
    """Every member of the uncompressed tar archive ``data`` (the bytes of ``where``), by name in
    archive order: what ``tarfile.open(mode="r:")`` reads, checked as Gym's layout needs, each
    member a regular file with a safe name (``check_name``), once. A damaged archive, or one that
    breaks those rules, raises :class:`CorruptSnapshotError` naming ``where`` and the member (an
    unsafe name: ``InvalidPathError``)."""
    members: list[tuple[str, bytes]] | list[tuple[str, bytes | None]] | None = _fixed_header_members(data)
    if members is None:
        members = _tarfile_members(data, where)
    out: dict[str, bytes] = {}
    for name, body in members:
        if body is None:
            raise CorruptSnapshotError(f"{where}: member {name!r} is not a regular file (expected only record files)")
        check_name(name, where=f"{where}: member name")
        if name in out:
            raise CorruptSnapshotError(f"{where}: member {name!r} appears twice")
        out[name] = body
    return out


def _fixed_header_members(data: bytes) -> list[tuple[str, bytes]] | None:
    """The members of ``data`` if every header up to the end-of-archive block is a fixed header
    (:func:`_ustar_header`'s, any name and size) whose member lies whole in ``data``, else None.

    For such headers ``tarfile`` reads exactly this: the name up to its first NUL (decoded as
    ``tarfile`` does), the octal size, a regular file, and it stops at the first all-NUL block. Its
    checksum is accepted only as ``tarfile`` writes it (6 octal digits, NUL, space)."""
    members: list[tuple[str, bytes]] = []
    offset, end = 0, len(data)
    while True:
        if offset + _TAR_BLOCK > end:
            return None  # a truncated header, or a member cut short: tarfile's rules for it
        header = data[offset:offset + _TAR_BLOCK]
        if header == _END_BLOCK:
            return members if members else None  # an empty archive: tarfile's own error or answer
        if (header[156:] != _USTAR_AFTER_CHKSUM or header[100:124] != _USTAR_MODE_IDS
                or header[136:148] != _USTAR_MTIME or not _SIZE_FIELD.fullmatch(header, 124, 136)):
            return None
        name_field, size_field = header[:100], header[124:136]
        if header[148:156] != b"%06o\0 " % (sum(name_field) + sum(size_field) + _FIXED_FIELDS_SUM):
            return None
        size = int(size_field[:11], 8)
        start = offset + _TAR_BLOCK
        name = name_field.split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
        members.append((name, data[start:start + size]))
        offset = start + size + (-size % _TAR_BLOCK)


def _tarfile_members(data: bytes, where: str) -> list[tuple[str, bytes | None]]:
    """``tarfile``'s reading of ``data``: each member's name and bytes (None for a member that is not
    a regular file)."""
    out: list[tuple[str, bytes | None]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            for m in tf.getmembers():
                if not m.isreg():
                    out.append((m.name, None))
                    continue
                fh = tf.extractfile(m)
                out.append((m.name, fh.read() if fh is not None else b""))
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CorruptSnapshotError(f"{where}: not a readable tar archive ({exc})") from None
    return out
