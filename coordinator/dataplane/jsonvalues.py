"""JSON values a data plane keeps exactly: row tags and the values of non-tensor fields.

A data plane keeps these as JSON (text in a snapshot, JSON copies in memory), so it accepts only
values that JSON gives back equal: ``None``, ``bool``, ``int``, ``float``, ``str``, lists and dicts
with string keys. msgspec does the common case fast; Python's ``json`` names what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from schemas.errors import InvalidRecordError

_JSON_ENCODE = msgspec.json.Encoder().encode

#: JSON text (bytes or str) to its value, msgspec's decoder (raises :class:`msgspec.MsgspecError`).
decode_json = msgspec.json.Decoder().decode


def _dumps(value: Any) -> str:
    """``value`` as compact JSON text (non-ASCII kept as is)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_copy(value: Any) -> Any:
    """A copy of ``value`` that shares nothing with it, made through its JSON text."""
    return json.loads(_dumps(value))


def check_json_value(value: Any, where: str) -> None:
    """Refuse what JSON would not give back unchanged (tuples, non-string keys, numpy scalars...)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or isinstance(v, (bool, str)):
            continue
        if type(v) is int or type(v) is float:
            continue
        if type(v) is list:
            stack.extend(v)
        elif type(v) is dict:
            for k, item in v.items():
                if type(k) is not str:
                    raise InvalidRecordError(f"{where}: dict key {k!r} is not a string (JSON would change it)")
                stack.append(item)
        else:
            raise InvalidRecordError(
                f"{where}: a {type(v).__name__} value cannot be kept exactly (expected JSON types: "
                "None, bool, int, float, str, list, dict with string keys)")


def json_texts(values: Sequence[Any], where: str) -> list[bytes]:
    """Each value as compact JSON text (UTF-8), refusing any that JSON would not give back equal.

    The common case (plain dicts, lists, strings and numbers) is one msgspec encode per value and
    one decode of them all, compared with the originals; anything else (tuples, non-string keys,
    numpy scalars, NaN) takes :func:`check_json_value`, which names what is wrong.
    """
    try:
        texts = [_JSON_ENCODE(v) for v in values]
        if decode_json(b"[" + b",".join(texts) + b"]") == list(values):
            return texts
    except (TypeError, ValueError, msgspec.MsgspecError):
        pass
    for i, v in enumerate(values):
        check_json_value(v, f"{where} (value {i})")
    return [_dumps(v).encode() for v in values]


__all__ = ["check_json_value", "decode_json", "json_copy", "json_texts"]
