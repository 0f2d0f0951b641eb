"""An S3 store that stalls (accepts connections, then never answers) in the middle of a save.

A :class:`~devtools.stall_proxy.StallProxy` on 127.0.0.1 stands in front of the session's
SeaweedFS; the store under test reaches SeaweedFS only through it, with short timeouts (connect 1 s,
read 1 s, 1 retry). Proves that:
- a stall before ``begin`` (a GET), before ``write_rows`` (a single PUT), once a multipart upload
  has begun (its parts, PUTs of 5 MiB, unanswered) or before ``publish`` makes that call fail with
  a ``StoreError`` saying that the S3 endpoint did not answer, with the read timeout and the tries;
  every such call runs in a thread joined with a limit, so a call the timeouts do not bound fails
  the test instead of hanging it (a PUT with ``Expect: 100-continue`` hung forever: aiohttp does not
  time out the wait for "100 Continue");
- nothing is published: seen directly (not through the proxy), the store lists only the snapshot
  from before the stall, which still verifies;
- once the proxy answers again, the same store object publishes the next sequence, both snapshots
  verify, and ``gc`` removes whatever the failed save left;
- the proxy forwards both ways, holds connections open and forwards nothing once stalled (new ones
  are still accepted), closes the stalled ones when it answers again, and ends its threads on close;
- the timeouts and retries come from the store's options, else the ``SNAPFORMAT_S3_*`` variables,
  else the defaults (5 s, 60 s, 2 retries); a value that is not a positive number of seconds (or a
  count of 0 or more) is a ``StoreError`` naming the option or variable.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest

from devtools import s3servers
from devtools.stall_proxy import StallProxy
from schemas.controller import LoaderPlace
from schemas.errors import StoreError
from snapformat import SnapshotStore, example, verify_snapshot
from snapformat.store import s3
from snapformat.store.s3 import S3Store, S3Timeouts

pytestmark = pytest.mark.timeout(180)

TIMEOUTS = {"connect_timeout": 1.0, "read_timeout": 1.0, "retries": 1}  # 1 retry: a pooled connection the
# proxy closed on answer() costs a try, not the next save
PART_SIZE = 5 << 20  # the S3 minimum: the large table below goes up as a multipart upload
CALL_LIMIT_S = 60  # far beyond what the timeouts allow (a few tries of 1 s): reaching it is a hang
NOT_ANSWERED = "did not answer (read timeout 1 s per try, at most 2 tries; SNAPFORMAT_S3_READ_TIMEOUT_S"


@pytest.fixture(scope="module")
def proxy(seaweed: s3servers.S3Server) -> Iterator[StallProxy]:
    with StallProxy(seaweed.endpoint) as p:
        yield p


@pytest.fixture
def stores(seaweed: s3servers.S3Server, proxy: StallProxy, new_bucket) -> Iterator[tuple[SnapshotStore, SnapshotStore]]:
    """(the store under test, through the proxy; the same store seen directly), one snapshot published."""
    url = f"s3://{new_bucket(seaweed)}/p"
    options: dict[str, Any] = {"key": s3servers.ACCESS_KEY, "secret": s3servers.SECRET_KEY, "part_size": PART_SIZE}
    through = SnapshotStore(S3Store(url, endpoint_url=proxy.endpoint, **options, **TIMEOUTS))
    direct = SnapshotStore(S3Store(url, endpoint_url=seaweed.endpoint, **options))
    save(through, seed=1)
    try:
        yield through, direct
    finally:
        proxy.answer()  # never leave the module's proxy stalled for the next test


def training(seed: int, large: bool = False) -> pa.RecordBatch:
    """Training rows: ~0.1 MB, or ~9 MB (more than one part: a multipart upload)."""
    rollouts = example.rollouts(400 if large else 40, seed)
    return example.training_batch(rollouts, seed, seq_len=4096 if large else 96)


def save(store: SnapshotStore, seed: int) -> int:
    draft = store.begin()
    write_parts(draft, seed)
    draft.publish()
    return draft.sequence


def write_parts(draft, seed: int) -> None:
    draft.part("tq").write_rows("training.arrow", "training_rows", training(seed))
    draft.part("controller").write_json("loader", "loader_place", LoaderPlace(epoch=0, consumed=seed, seed=seed))


def outcome_of(call: Callable[[], Any]) -> Any:
    """What ``call`` returned or raised, run in a thread joined within :data:`CALL_LIMIT_S`."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(CALL_LIMIT_S)
    assert not thread.is_alive(), f"still waiting on the stalled store after {CALL_LIMIT_S} s: nothing bounds the call"
    return box[0]


def stalled_begin(store: SnapshotStore, proxy: StallProxy) -> Any:
    proxy.stall()
    return outcome_of(store.begin)


def stalled_write(store: SnapshotStore, proxy: StallProxy) -> Any:
    draft = store.begin()
    part = draft.part("tq")
    proxy.stall()
    return outcome_of(lambda: part.write_rows("training.arrow", "training_rows", training(2)))


def stalled_upload_part(store: SnapshotStore, proxy: StallProxy) -> Any:
    """The stall comes once the multipart upload has begun: its parts (PUTs with a body) go unanswered."""
    call = s3._MultipartWriter._call

    def stall_after_start(self, method: str, **kw: Any) -> Any:
        out = call(self, method, **kw)
        if method == "create_multipart_upload":
            proxy.stall()
        return out

    draft = store.begin()
    part = draft.part("tq")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(s3._MultipartWriter, "_call", stall_after_start)
        error = outcome_of(lambda: part.write_rows("training.arrow", "training_rows", training(2, large=True)))
    assert proxy.stalled, "the upload never began: the stall point was not reached"
    return error


def stalled_publish(store: SnapshotStore, proxy: StallProxy) -> Any:
    draft = store.begin()
    write_parts(draft, seed=2)
    proxy.stall()
    return outcome_of(draft.publish)


STALL_POINTS = {"begin": stalled_begin, "write_rows": stalled_write, "upload_part": stalled_upload_part,
                "publish": stalled_publish}


@pytest.mark.parametrize("point", sorted(STALL_POINTS))
def test_a_stalled_store_fails_the_save_and_publishes_nothing(point: str, stores, proxy: StallProxy,
                                                             seaweed: s3servers.S3Server) -> None:
    through, direct = stores
    [first] = [c.sequence for c in direct.list()]
    error = STALL_POINTS[point](through, proxy)
    assert isinstance(error, StoreError), f"expected StoreError, got {error!r}"
    message = str(error)
    assert message.startswith(through.url) and f"S3 endpoint {proxy.endpoint} {NOT_ANSWERED}" in message, message

    proxy.answer()
    assert [c.sequence for c in direct.list()] == [first]  # nothing new was published
    assert verify_snapshot(direct.open(first)).ok
    second = save(through, seed=3)  # the same store object saves again once the store answers
    assert second == first + 1 and [c.sequence for c in direct.list()] == [second, first]
    assert verify_snapshot(direct.open(second)).ok and verify_snapshot(direct.open(first)).ok
    direct.gc(min_age_s=0)  # whatever the failed save left (a draft, an incomplete upload) goes
    bucket, prefix = direct.url[len("s3://"):].split("/", 1)
    client = seaweed.client()
    folders = {o["Key"].split("/")[2] for o in
               client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/snapshots/").get("Contents", [])}
    assert folders == {c.snapshot_id for c in direct.list()}
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", []) == []


# ---- the proxy itself ----------------------------------------------------------------------------

def _echo_server() -> tuple[socket.socket, threading.Thread]:
    """An upstream on 127.0.0.1 that echoes each connection's bytes back (until the listener closes)."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_the_proxy_forwards_stalls_and_answers_again() -> None:
    server, serving = _echo_server()
    try:
        with StallProxy(f"http://127.0.0.1:{server.getsockname()[1]}") as p:
            port = int(p.endpoint.rsplit(":", 1)[1])
            before = socket.create_connection(("127.0.0.1", port), timeout=5)
            before.sendall(b"ping")
            assert before.recv(16) == b"ping"  # forwarded both ways
            p.stall()
            during = socket.create_connection(("127.0.0.1", port), timeout=5)  # still accepted
            for conn in (before, during):
                conn.settimeout(0.3)
                conn.sendall(b"ping")
                with pytest.raises(TimeoutError):  # held open, nothing comes back
                    conn.recv(16)
            p.answer()
            for conn in (before, during):  # the stalled connections are closed, not resumed
                conn.settimeout(5)
                assert conn.recv(16) == b""
                conn.close()
            after = socket.create_connection(("127.0.0.1", port), timeout=5)
            after.sendall(b"pong")
            assert after.recv(16) == b"pong"
            after.close()
            threads = list(p._threads)
        assert not any(t.is_alive() for t in threads)  # close() ended every thread it started
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        serving.join(5)


# ---- configuration -------------------------------------------------------------------------------

VARIABLES = (s3.CONNECT_TIMEOUT_VAR, s3.READ_TIMEOUT_VAR, s3.RETRIES_VAR)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_timeouts_come_from_options_then_variables_then_defaults(clean_env: pytest.MonkeyPatch) -> None:
    assert S3Store("s3://b/p").timeouts == S3Timeouts(connect_s=5.0, read_s=60.0, retries=2)
    assert S3Timeouts().attempts == 3
    clean_env.setenv(s3.CONNECT_TIMEOUT_VAR, "0.5")
    clean_env.setenv(s3.READ_TIMEOUT_VAR, "1.5")
    clean_env.setenv(s3.RETRIES_VAR, "0")
    store = S3Store("s3://b/p")
    assert store.timeouts == S3Timeouts(connect_s=0.5, read_s=1.5, retries=0) and store.timeouts.attempts == 1
    assert S3Store("s3://b/p", read_timeout=7, retries=4).timeouts == S3Timeouts(connect_s=0.5, read_s=7.0, retries=4)
    # what botocore is configured with, and s3fs's own loop makes one try (botocore's loop retries)
    config = store.fs.config_kwargs
    assert (config["connect_timeout"], config["read_timeout"], config["retries"]["max_attempts"]) == (0.5, 1.5, 0)
    assert store.fs.retries == 1


@pytest.mark.parametrize(("variable", "value", "says"), [
    (s3.READ_TIMEOUT_VAR, "0", "is not a positive number of seconds"),
    (s3.CONNECT_TIMEOUT_VAR, "soon", "is not a positive number of seconds"),
    (s3.READ_TIMEOUT_VAR, "nan", "is not a positive number of seconds"),
    (s3.RETRIES_VAR, "-1", "is not a whole number of 0 or more"),
    (s3.RETRIES_VAR, "1.5", "is not a whole number of 0 or more"),
])
def test_a_bad_variable_is_a_store_error_naming_it(clean_env: pytest.MonkeyPatch, variable: str, value: str,
                                                   says: str) -> None:
    clean_env.setenv(variable, value)
    with pytest.raises(StoreError) as err:
        SnapshotStore("s3://b/p")
    assert str(err.value) == f"{variable}={value!r} {says}"


def test_a_bad_option_is_a_store_error_naming_it(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreError, match=r"^S3 option read_timeout=-2 is not a positive number of seconds$"):
        S3Store("s3://b/p", read_timeout=-2)
    with pytest.raises(StoreError, match=r"^S3 option retries=-1 is not a whole number of 0 or more$"):
        S3Store("s3://b/p", retries=-1)
