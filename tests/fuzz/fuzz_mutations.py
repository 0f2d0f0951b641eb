"""Mutations of seed files: byte flips, truncation, insertion, splicing, and JSON value changes.

Byte mutations find what a parser does with damaged framing (a cut line, a flipped length, a
foreign chunk); structured mutations keep the JSON well-formed and change one value, so they reach
the typed decoders and the checks behind them (limits, identifiers, paths, versions). Integers that
sit at the edges of 32- and 64-bit fields are favoured because lengths and offsets are where bombs
and overflows hide.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import strategies as st

#: Values at the edges of the integer types lengths, offsets and counts are stored in.
EDGE_INTS = [0, 1, -1, 7, 8, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, -(2**31), 2**32 - 1, 2**32,
             2**40, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
#: Bytes that mean something to JSON, JSON lines, UTF-8 or a zstd / Arrow header.
TOKENS = [b"\n", b"\r\n", b"\x00", b"\xff", b"\xef\xbb\xbf", b"\xc3", b"\xed\xa0\x80", b'"', b"\\", b"{", b"}",
          b"[", b"]", b",", b":", b"null", b"true", b"-", b"1e999", b"NaN", b"9" * 40, b"\\u0000", b"\\ud800",
          b"ARROW1", b"\xff\xff\xff\xff", b"\x28\xb5\x2f\xfd", b"[" * 4000, b"{\"a\":" * 3000]


def _pack_edge(value: int, fmt: str) -> bytes:
    size = struct.calcsize(fmt)
    return (value % (1 << (8 * size))).to_bytes(size, "little")


@st.composite
def mutated_bytes(draw: st.DrawFn, seeds: list[bytes], max_ops: int = 4) -> bytes:
    """One seed with 1..``max_ops`` byte-level mutations; other seeds donate spliced chunks."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "edge_int", "truncate", "insert", "token", "delete", "duplicate",
                                   "splice"]))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            pos = min(pos, len(data) - 1)
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "edge_int":
            packed = _pack_edge(draw(st.sampled_from(EDGE_INTS)), draw(st.sampled_from(["<i", "<q", "<h", "<B"])))
            data[pos:pos + len(packed)] = packed
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "token":
            data[pos:pos] = draw(st.sampled_from(TOKENS))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "duplicate":
            start = draw(st.integers(0, len(data)))
            data[pos:pos] = data[start:start + draw(st.integers(1, 256))]
        elif op == "splice":
            donor = draw(st.sampled_from(seeds))
            start = draw(st.integers(0, len(donor)))
            chunk = donor[start:start + draw(st.integers(1, 512))]
            if draw(st.booleans()):
                data[pos:pos + len(chunk)] = chunk
            else:
                data[pos:pos] = chunk
    return bytes(data)


class Raw:
    """JSON text to put verbatim where a value stood (what ``json.dumps`` would refuse to make)."""

    def __init__(self, text: str) -> None:
        self.text = text


_RAW_VALUES = ["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "0" + "}" * 5000, "1" * 5000, "-" + "9" * 30,
               "1e999", "-1e999", "NaN", "Infinity", "1.0e0", "-0", "0.5", '"\\ud800"', '"\\u0000"', "[]", "{}"]
_TEXTS = ["", "..", "../x", "/abs", "a/../../b", "a\\b", "a\x00b", ".hidden", "x" * 5000, "é" * 300,
          "snap-0000000002-8d98ddd9", "xxh128:" + "0" * 32, "sha256:" + "0" * 64, "1.0", "2.0", "1.999",
          "99999999999999999999.0", "zstd", "none", "lz4", "part_manifest", "training_rows", "p7_g2-a1",
          "gym/model/policy0/tokens.arrow", "gym/model/policy0/part-manifest.json", "prompt_group", "ack_owed"]


def json_values() -> st.SearchStrategy[Any]:
    """Replacement values: every JSON type, with edge numbers and strings that names and paths fear."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(),
        st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(_TEXTS), st.text(max_size=12),
        st.sampled_from(_RAW_VALUES).map(Raw),
    )
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                        max_leaves=6)


def _locations(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every value inside ``value`` (dict keys and list indexes), the root included."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _locations(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _locations(item, path + (i,))
    return found


def _parent(root: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        root = root[step]
    return root


@st.composite
def mutated_json_value(draw: st.DrawFn, value: Any) -> Any:
    """``value`` (a decoded JSON document) with one value replaced, removed, added or duplicated."""
    value = json.loads(json.dumps(value))  # a private copy
    path = draw(st.sampled_from(_locations(value)))
    op = draw(st.sampled_from(["replace", "remove", "add", "duplicate"]))
    if not path:
        return draw(json_values()) if op == "replace" else value
    parent, last = _parent(value, path), path[-1]
    if op == "replace":
        parent[last] = draw(json_values())
    elif op == "remove":
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        keys = st.text(max_size=8) | st.sampled_from(list(parent)) if parent else st.text(max_size=8)
        parent[draw(keys)] = draw(json_values())  # an existing key: a changed value under its name
    elif op == "add":
        parent.insert(last, draw(json_values()))
    elif isinstance(parent, list):
        parent.insert(last, parent[last])
    return value


def dump_json(value: Any, compact: bool) -> str:
    """JSON text of ``value`` with each :class:`Raw` spliced in verbatim."""
    raws: list[str] = []

    def placeholder(obj: Any) -> str:
        if isinstance(obj, Raw):
            raws.append(obj.text)
            return f"\x00raw{len(raws) - 1}\x00"
        raise TypeError(type(obj).__name__)

    text = json.dumps(value, default=placeholder, separators=(",", ":") if compact else None,
                      indent=None if compact else 1)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text


@st.composite
def mutated_json_document(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A seed JSON document with one structured mutation, as written by the reference writer."""
    doc = json.loads(draw(st.sampled_from(seeds)))
    return (dump_json(draw(mutated_json_value(doc)), compact=False) + "\n").encode()


@st.composite
def mutated_json_lines(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A seed JSON-lines file with one line changed structurally, or removed, duplicated or swapped."""
    lines = draw(st.sampled_from(seeds)).split(b"\n")[:-1]
    if not lines:
        return b""
    i = draw(st.integers(0, len(lines) - 1))
    op = draw(st.sampled_from(["value", "value", "drop", "duplicate", "swap_in"]))
    if op == "value":
        lines[i] = dump_json(draw(mutated_json_value(json.loads(lines[i]))), compact=True).encode()
    elif op == "drop":
        del lines[i]
    elif op == "duplicate":
        lines.insert(i, lines[i])
    else:  # a line of another kind's file in this one's place
        donor = draw(st.sampled_from(seeds)).split(b"\n")
        lines[i] = draw(st.sampled_from(donor))
    return b"".join(line + b"\n" for line in lines)
