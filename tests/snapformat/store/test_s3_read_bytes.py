"""``S3Store.read_bytes``: one ranged GET for small objects, parallel ranges for large ones, and
exactly the stored bytes at every size around the range boundary (empty objects included); with a
limit, exactly the first ``limit + 1`` bytes, and one GET when the limit is below the part size."""

from __future__ import annotations

from collections import Counter

import pytest

from snapformat.store.s3 import S3Store

PART = 1 << 20


@pytest.fixture(params=["seaweed", "moto_s3"])
def store(request, new_bucket, aws_env) -> S3Store:
    server = request.getfixturevalue(request.param)
    aws_env(server)
    return S3Store(f"s3://{new_bucket(server)}/prefix", part_size=PART)


def _count_gets_and_heads(store: S3Store) -> Counter:
    calls: Counter = Counter()
    store.fs.connect()
    store.fs.s3.meta.events.register("before-call.s3", lambda model, **kw: calls.update([model.name]))
    return calls


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART + 17])
def test_read_bytes_every_size(store: S3Store, size: int) -> None:
    data = bytes((i * 7 + size) % 251 for i in range(size))
    store.put_bytes("obj", data)
    assert store.read_bytes("obj") == data


@pytest.mark.parametrize("limit", [0, PART - 2, PART - 1, PART, PART + 3, 2 * PART])
def test_limited_read_stops_after_limit_plus_one_byte(store: S3Store, limit: int) -> None:
    data = bytes((i * 7) % 251 for i in range(3 * PART + 17))
    store.put_bytes("obj", data)
    assert store.read_bytes("obj", limit=limit) == data[:limit + 1]


def test_limited_read_of_a_large_object_is_one_request(store: S3Store) -> None:
    """A commit record that is really a huge object costs one small ranged GET, not the object."""
    store.put_bytes("huge.json", bytes(3 * PART))
    store.read_bytes("huge.json", limit=10)
    calls = _count_gets_and_heads(store)
    assert store.read_bytes("huge.json", limit=64 * 1024) == bytes(64 * 1024 + 1)
    assert calls == Counter({"GetObject": 1})


def test_small_read_is_one_request(store: S3Store) -> None:
    store.put_bytes("small.json", b'{"a": 1}')
    store.read_bytes("small.json")  # the bucket check happens once, before counting
    calls = _count_gets_and_heads(store)
    assert store.read_bytes("small.json") == b'{"a": 1}'
    assert calls == Counter({"GetObject": 1})


def test_missing_object(store: S3Store) -> None:
    with pytest.raises(FileNotFoundError):
        store.read_bytes("missing")
