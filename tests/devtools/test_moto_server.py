"""The tests' moto server runs writes one at a time, so a create-only PUT is atomic as on AWS.

- The WSGI wrapper: writes never overlap, reads still do.
- Why: moto's own application, served in this process with the gap between its check and its store
  widened, lets two racing create-only PUTs both win; wrapped, one wins.
- The real server (the session's ``moto_s3``): of 16 threads putting one key create-only at once,
  one succeeds and every other one gets AWS's 412 ``PreconditionFailed``; round after round.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import botocore.exceptions
import pytest
from werkzeug.serving import make_server

from devtools import s3servers
from devtools.moto_server import WritesOneAtATime


class _Overlap:
    """A WSGI app that counts how many requests are inside it at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def __call__(self, environ: dict[str, Any], start_response) -> list[bytes]:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.05)
        with self._lock:
            self.inside -= 1
        start_response("200 OK", [])
        return [environ["REQUEST_METHOD"].encode()]


def _call_at_once(app: WritesOneAtATime, method: str, n: int) -> list[list[bytes]]:
    start = threading.Barrier(n)

    def one(_: int) -> list[bytes]:
        start.wait()
        return list(app({"REQUEST_METHOD": method}, lambda status, headers: None))

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.parametrize("method", ["PUT", "POST", "DELETE"])
def test_writes_never_overlap(method: str) -> None:
    inner = _Overlap()
    bodies = _call_at_once(WritesOneAtATime(inner), method, 8)
    assert bodies == [[method.encode()]] * 8
    assert inner.most == 1


def test_a_writes_body_is_closed_as_wsgi_asks() -> None:
    closed: list[bool] = []

    class Body(list):
        def close(self) -> None:
            closed.append(True)

    def app(environ: dict[str, Any], start_response) -> Body:
        start_response("200 OK", [])
        return Body([b"ok"])

    assert _call_at_once(WritesOneAtATime(app), "PUT", 1) == [[b"ok"]]
    assert closed == [True]


def test_reads_still_overlap() -> None:
    inner = _Overlap()
    _call_at_once(WritesOneAtATime(inner), "GET", 8)
    assert inner.most > 1


def _race(client, bucket: str, key: str, racers: int) -> collections.Counter[str]:
    """Each of ``racers`` threads puts ``key`` create-only at once; the outcomes counted."""
    start = threading.Barrier(racers)

    def put(i: int) -> str:
        start.wait()
        try:
            client.put_object(Bucket=bucket, Key=key, Body=f"racer {i}".encode(), IfNoneMatch="*")
            return "won"
        except botocore.exceptions.ClientError as exc:
            return exc.response["Error"]["Code"]

    with ThreadPoolExecutor(racers) as pool:
        return collections.Counter(pool.map(put, range(racers)))


@pytest.mark.parametrize("wrapped", [False, True])
def test_moto_alone_lets_two_create_only_puts_win(wrapped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.s3.models import S3Backend

    store = S3Backend.put_object

    def slow_store(self, *args, **kwargs):
        time.sleep(0.5)  # the gap between moto's check and its store, widened so every racer is in it
        return store(self, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", slow_store)
    app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", 0, WritesOneAtATime(app) if wrapped else app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server.port}", aws_access_key_id="k",
                              aws_secret_access_key="s", region_name="us-east-1")
        bucket = "race-wrapped" if wrapped else "race-bare"  # moto's in-process state outlives a test
        client.create_bucket(Bucket=bucket)
        outcomes = _race(client, bucket, "commit", 4)
    finally:
        server.shutdown()
    if wrapped:
        assert outcomes == {"won": 1, "PreconditionFailed": 3}
    else:
        assert outcomes["won"] > 1, outcomes  # should moto add a lock, this fails: the wrapper can go


def test_a_create_only_put_has_one_winner_on_the_tests_moto(moto_s3: s3servers.S3Server, new_bucket) -> None:
    bucket = new_bucket(moto_s3)
    client = moto_s3.client()
    for round_ in range(5):
        outcomes = _race(client, bucket, f"commit-{round_}", 16)
        assert outcomes == {"won": 1, "PreconditionFailed": 15}, f"round {round_}: {outcomes}"
