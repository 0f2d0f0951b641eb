"""Object-store backend: ``s3://bucket/prefix`` through s3fs, without renames.

* Data objects go straight to their final keys; they are invisible until a commit record names
  them (an object store has no atomic folder rename: it is a copy plus a delete per object).
* The commit point is one create-only PUT (``If-None-Match: *``). A lost race surfaces as
  ``FileExistsError`` on AWS and moto, and as ``OSError(EINVAL)`` whose cause carries
  ``PreconditionFailed`` on SeaweedFS: both become :class:`CommitConflictError`. A 409
  (``ConditionalRequestConflict``: a concurrent conditional write in flight) is retried.
  Commit records are never empty, so s3fs's unconditional zero-byte path is never taken.
* Large objects go up as multipart uploads whose parts are sent in parallel, with at most
  ``max_inflight_parts`` parts buffered: memory is bounded by ``part_size * (max_inflight + 1)``.
* Endpoint, credentials and region come from the usual AWS variables (``AWS_ENDPOINT_URL``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``) or explicit options; how long
  to wait for the store and how often to try again from :class:`S3Timeouts` (options, or the
  ``SNAPFORMAT_S3_*`` variables). A store that stops answering fails each request within a bound.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

import msgspec

from schemas.errors import CommitConflictError, SnapshotError, StoreError
from snapformat.store.base import ObjectInfo, Store, WriteStream

try:
    import aiobotocore.session
    import botocore.exceptions
    import s3fs
except ImportError as exc:  # pragma: no cover - exercised only without the optional deps
    raise StoreError("s3:// stores need s3fs: pip install -r requirements.txt (s3fs, boto3)") from exc

PART_SIZE = 16 << 20
MAX_INFLIGHT_PARTS = 4
_CONFLICT_RETRIES = 5
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"}
#: Variables that set :class:`S3Timeouts` when no explicit option does (every process of a job,
#: Gym servers included, opens its stores from URLs: a variable reaches them all).
CONNECT_TIMEOUT_VAR = "SNAPFORMAT_S3_CONNECT_TIMEOUT_S"
READ_TIMEOUT_VAR = "SNAPFORMAT_S3_READ_TIMEOUT_S"
RETRIES_VAR = "SNAPFORMAT_S3_RETRIES"
_T = TypeVar("_T")


class S3Timeouts(msgspec.Struct, frozen=True, kw_only=True):
    """How long each S3 request waits for the store, and how often a failed one is tried again.

    botocore tries a request again ``retries`` times after a transient failure (a timeout, a lost
    connection, a 5xx, throttling), with backoff under a second or two per try. A request the store
    never answers therefore fails after at most :attr:`attempts` tries of up to
    ``connect_s + read_s`` each: about 3.3 min with the defaults, a second or two with
    ``read_s=1, retries=0``.
    """

    connect_s: float = 5.0
    read_s: float = 60.0
    retries: int = 2

    @property
    def attempts(self) -> int:
        """The most tries one request gets."""
        return self.retries + 1

    @classmethod
    def resolve(cls, connect_s: float | None = None, read_s: float | None = None,
                retries: int | None = None) -> S3Timeouts:
        """Explicit values first, then the ``SNAPFORMAT_S3_*`` variables, then the defaults; a value
        that is not a positive number of seconds (or a count of 0 or more) is a :class:`StoreError`
        naming where it came from."""
        default, seconds, count = cls(), "a positive number of seconds", "a whole number of 0 or more"
        return cls(
            connect_s=_resolve(connect_s, "connect_timeout", CONNECT_TIMEOUT_VAR, default.connect_s,
                               _positive_seconds, seconds),
            read_s=_resolve(read_s, "read_timeout", READ_TIMEOUT_VAR, default.read_s, _positive_seconds, seconds),
            retries=_resolve(retries, "retries", RETRIES_VAR, default.retries, _retry_count, count))


def _resolve(value: Any, option: str, variable: str, default: _T, parse: Callable[[Any], _T | None],
             expected: str) -> _T:
    """``value`` if given, else the variable's, else ``default``; parsed, or refused naming its source."""
    source = f"S3 option {option}"
    if value is None:
        value, source = os.environ.get(variable, "").strip() or None, variable
    if value is None:
        return default
    parsed = parse(value)
    if parsed is None:
        raise StoreError(f"{source}={value!r} is not {expected}")
    return parsed


def _positive_seconds(raw: Any) -> float | None:
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None  # NaN is not > 0 either


def _retry_count(raw: Any) -> int | None:
    if isinstance(raw, float):
        return None
    try:
        count = int(raw)
    except (TypeError, ValueError):
        return None
    return count if count >= 0 else None


def _without_expect_continue(params: dict[str, Any], **_: Any) -> None:
    """Drop the ``Expect: 100-continue`` header botocore puts on every S3 request with a body.

    aiohttp waits for the server's "100 Continue" with no timeout at all (its read timeout starts
    only after): a store that accepts the connection and then stalls would hang every PutObject
    and UploadPart forever. Without the header the body is sent at once and the read timeout
    bounds the wait for the answer. (The header only saves sending a body the server would refuse;
    SigV4 does not sign it.)
    """
    params.get("headers", {}).pop("Expect", None)


def _session() -> aiobotocore.session.AioSession:
    session = aiobotocore.session.AioSession()
    # Last: botocore's own handler on the same event adds the header.
    session.get_component("event_emitter").register_last("before-call.s3", _without_expect_continue)
    return session


def _client_error(exc: BaseException) -> dict[str, Any] | None:
    """The S3 error response behind ``exc`` (s3fs wraps botocore's ClientError), if any."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return response
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


def _tries(n: int) -> str:
    return "1 try" if n == 1 else f"{n} tries"


def _caused_by(exc: BaseException, *kinds: type[BaseException]) -> bool:
    """``exc`` or an exception it was raised from is one of ``kinds`` (s3fs wraps botocore's)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, kinds):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False


def _code(exc: BaseException) -> str:
    resp = _client_error(exc)
    return str(resp["Error"].get("Code", "")) if resp else ""


def _status(exc: BaseException) -> int | None:
    resp = _client_error(exc)
    return resp.get("ResponseMetadata", {}).get("HTTPStatusCode") if resp else None


def is_precondition_failed(exc: BaseException) -> bool:
    """A lost create-only race, whichever way the server and s3fs report it."""
    if isinstance(exc, FileExistsError):
        return True
    return _code(exc) == "PreconditionFailed" or _status(exc) == 412


def is_conflict_in_flight(exc: BaseException) -> bool:
    return _code(exc) == "ConditionalRequestConflict" or _status(exc) == 409


class S3Store(Store):
    """A snapshot store under ``s3://bucket/prefix``."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, key: str | None = None,
                 secret: str | None = None, region: str | None = None, part_size: int = PART_SIZE,
                 max_inflight_parts: int = MAX_INFLIGHT_PARTS, connect_timeout: float | None = None,
                 read_timeout: float | None = None, retries: int | None = None) -> None:
        """``connect_timeout``, ``read_timeout`` (seconds) and ``retries``: see :class:`S3Timeouts`;
        each unset one comes from its ``SNAPFORMAT_S3_*`` variable, else the default (5, 60, 2)."""
        if not url.startswith("s3://"):
            raise StoreError(f"{url}: not an s3:// URL")
        path = url[len("s3://"):].rstrip("/")
        if not path or path.startswith("/"):  # s3:///prefix names no bucket (not bucket "prefix")
            raise StoreError(f"{url}: no bucket in the URL (expected s3://bucket/prefix)")
        self.url = url.rstrip("/")
        self.bucket, _, prefix = path.partition("/")
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.part_size = part_size
        self.max_inflight_parts = max_inflight_parts
        self.timeouts = S3Timeouts.resolve(connect_timeout, read_timeout, retries)
        self.fs = s3fs.S3FileSystem(
            key=key, secret=secret, session=_session(),
            use_listings_cache=False,  # discovery must see every commit, never a cached listing
            skip_instance_cache=True,
            client_kwargs={"endpoint_url": self.endpoint_url,
                           "region_name": region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"},
            config_kwargs={"request_checksum_calculation": "when_required",
                           "response_checksum_validation": "when_required",
                           "connect_timeout": self.timeouts.connect_s, "read_timeout": self.timeouts.read_s,
                           "retries": {"max_attempts": self.timeouts.retries, "mode": "standard"}},
        )
        # One try per call in s3fs's own retry loop: it wraps botocore's (and nests inside itself for
        # reads), which multiplied the tries of an unanswered request by 4 with retries=2 (12 tries
        # of a GET, 13 min, not the 3 a reader of "retries=2" expects). botocore's loop alone retries.
        self.fs.retries = 1
        self._bucket_checked = False

    # -- paths and errors --------------------------------------------------------------------
    def _key(self, key: str) -> str:
        if key.startswith("/") or "\x00" in key or ".." in key.split("/"):
            raise StoreError(f"{self.display(key)}: refusing a key that leaves the store")
        return f"{self.prefix}/{key}".strip("/") if self.prefix else key

    def _path(self, key: str) -> str:
        return f"{self.bucket}/{self._key(key)}".rstrip("/")

    def _fail(self, exc: BaseException, key: str, action: str) -> StoreError:
        code = _code(exc)
        where = self.display(key)
        if code in _CREDENTIAL_CODES or isinstance(exc, PermissionError):
            return StoreError(f"{where}: cannot {action}: the server refused the credentials ({code or exc}); "
                              "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the key/secret options")
        if code == "NoSuchBucket":
            return StoreError(f"{where}: bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}; create it or fix the URL")
        endpoint = self.endpoint_url or "AWS"
        t = self.timeouts
        if _caused_by(exc, botocore.exceptions.ConnectTimeoutError):
            return StoreError(f"{where}: cannot {action}: S3 endpoint {endpoint} did not accept a connection "
                              f"(connect timeout {t.connect_s:g} s per try, at most {_tries(t.attempts)}; "
                              f"{CONNECT_TIMEOUT_VAR}, {RETRIES_VAR}): {exc}")
        if _caused_by(exc, botocore.exceptions.ReadTimeoutError, TimeoutError):
            # Connected, then no answer: a stalled store, not a missing one.
            return StoreError(f"{where}: cannot {action}: S3 endpoint {endpoint} did not answer "
                              f"(read timeout {t.read_s:g} s per try, at most {_tries(t.attempts)}; "
                              f"{READ_TIMEOUT_VAR}, {RETRIES_VAR}): {exc}")
        unreachable = (botocore.exceptions.EndpointConnectionError, ConnectionError)
        if _caused_by(exc, *unreachable) or "connect" in str(exc).lower():
            return StoreError(f"{where}: cannot {action}: S3 endpoint {endpoint} unreachable ({exc})")
        return StoreError(f"{where}: cannot {action}: {type(exc).__name__}: {exc}")

    def _check_bucket(self) -> None:
        """Once per store object: name a missing bucket or bad credentials before anything else."""
        if self._bucket_checked:
            return
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - every failure is translated into StoreError
            if _status(exc) == 404 or isinstance(exc, FileNotFoundError):
                raise StoreError(f"{self.url}: bucket {self.bucket!r} does not exist at "
                                 f"{self.endpoint_url or 'AWS'}; create it or fix the URL") from None
            if _status(exc) in (401, 403) or isinstance(exc, PermissionError):
                raise StoreError(f"{self.url}: the server refused the credentials for bucket {self.bucket!r}; "
                                 "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the key/secret options") from None
            raise self._fail(exc, "", "reach the bucket") from None
        self._bucket_checked = True

    # -- reads -------------------------------------------------------------------------------
    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """One ranged GET for objects under ``part_size`` (commit records, hints, manifests); larger
        objects fetch the rest in ``part_size`` ranges, in parallel. A plain ``cat_file`` would HEAD
        every object first to size it: two requests for each small read. With ``limit``, no range
        past byte ``limit`` is fetched."""
        self._check_bucket()
        path = self._path(key)
        first_end = self.part_size if limit is None else min(self.part_size, limit + 1)
        try:
            try:
                first = self.fs.cat_file(path, start=0, end=first_end)
            except OSError as exc:
                if _code(exc) == "InvalidRange":  # any range of an empty object is unsatisfiable
                    return self.fs.cat_file(path, max_concurrency=1)
                raise
            if len(first) < first_end or (limit is not None and len(first) > limit):
                return first
            size = int(self.fs.info(path)["size"])
            if limit is not None:
                size = min(size, limit + 1)
            starts = list(range(len(first), size, self.part_size))
            rest = self.fs.cat_ranges([path] * len(starts), starts, [min(s + self.part_size, size) for s in starts],
                                      batch_size=max(1, self.fs.max_concurrency), on_error="raise")
            return b"".join([first, *rest])
        except FileNotFoundError:
            raise FileNotFoundError(self.display(key)) from None
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, key, "read") from None

    def open_read(self, key: str) -> BinaryIO:
        self._check_bucket()
        try:
            return self.fs.open(self._path(key), "rb", block_size=self.part_size, cache_type="readahead")
        except FileNotFoundError:
            raise FileNotFoundError(self.display(key)) from None
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, key, "open") from None

    def exists(self, key: str) -> bool:
        self._check_bucket()
        try:
            self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._key(key))
            return True
        except FileNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001
            if _status(exc) == 404:
                return False
            raise self._fail(exc, key, "look up") from None

    def info(self, key: str) -> ObjectInfo:
        self._check_bucket()
        try:
            head = self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            raise FileNotFoundError(self.display(key)) from None
        except Exception as exc:  # noqa: BLE001
            if _status(exc) == 404:
                raise FileNotFoundError(self.display(key)) from None
            raise self._fail(exc, key, "look up") from None
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp())

    def list_names(self, prefix: str) -> list[str]:
        self._check_bucket()
        base = self._key(prefix)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Delimiter": "/", "Prefix": f"{base}/" if base else ""}
        names: set[str] = set()
        try:
            while True:
                page = self.fs.call_s3("list_objects_v2", **kw)
                for obj in page.get("Contents", []):
                    names.add(obj["Key"][len(kw["Prefix"]):])
                for cp in page.get("CommonPrefixes", []):
                    names.add(cp["Prefix"][len(kw["Prefix"]):].rstrip("/"))
                if not page.get("IsTruncated"):
                    break
                kw["ContinuationToken"] = page["NextContinuationToken"]
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, prefix, "list") from None
        names.discard("")
        return sorted(names)

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        self._check_bucket()
        base = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": f"{base}/" if base else ""}
        try:
            while True:
                page = self.fs.call_s3("list_objects_v2", **kw)
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][strip:], int(obj["Size"]), obj["LastModified"].timestamp())
                if not page.get("IsTruncated"):
                    break
                kw["ContinuationToken"] = page["NextContinuationToken"]
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, prefix, "list") from None

    # -- writes ------------------------------------------------------------------------------
    def open_write(self, key: str) -> _MultipartWriter:
        self._check_bucket()
        return _MultipartWriter(self, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._check_bucket()
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, key, "write") from None

    def create_exclusive(self, key: str, data: bytes) -> None:
        if not data:
            raise StoreError(f"{self.display(key)}: refusing an empty create-only write (s3fs drops the condition)")
        self._check_bucket()
        for attempt in range(_CONFLICT_RETRIES):
            try:
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return
            except Exception as exc:  # noqa: BLE001
                if is_precondition_failed(exc):
                    raise CommitConflictError(f"{self.display(key)} already exists: another writer committed first") from None
                if is_conflict_in_flight(exc) and attempt + 1 < _CONFLICT_RETRIES:
                    time.sleep(0.05 * 2**attempt)  # another conditional write is in flight: try again
                    continue
                raise self._fail(exc, key, "commit") from None

    def delete(self, key: str) -> None:
        self._check_bucket()
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            if _status(exc) != 404:
                raise self._fail(exc, key, "delete") from None

    def delete_tree(self, prefix: str) -> None:
        keys = [o.key for o in self.walk(prefix)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            try:
                self.fs.call_s3("delete_objects", Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as exc:  # noqa: BLE001
                raise self._fail(exc, prefix, "delete") from None

    def abort_uploads(self, prefix: str, older_than: float, keep: Callable[[str], bool]) -> list[str]:
        self._check_bucket()
        base = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": f"{base}/" if base else ""}
        aborted = []
        try:
            while True:
                page = self.fs.call_s3("list_multipart_uploads", **kw)
                for up in page.get("Uploads", []):
                    key = up["Key"][strip:]
                    if up["Initiated"].timestamp() >= older_than or keep(key):
                        continue
                    try:
                        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=up["Key"],
                                        UploadId=up["UploadId"])
                    except Exception as exc:  # noqa: BLE001
                        if _code(exc) != "NoSuchUpload" and _status(exc) != 404:  # completed or aborted meanwhile
                            raise
                    aborted.append(key)
                if not page.get("IsTruncated"):
                    break
                kw.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])
        except SnapshotError:
            raise  # from keep(): already says what failed
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, prefix, "abort incomplete uploads") from None
        return aborted


class _MultipartWriter(WriteStream):
    """Buffers ``part_size`` bytes at a time; full parts upload in parallel, bounded in number.

    Small objects (under one part) go up as one PUT on close. On error or abort the multipart
    upload is aborted so no orphaned parts stay billed; a writer killed mid-upload leaves an
    incomplete upload that the bucket's lifecycle rule (or ``gc``) cleans up, and no object.
    """

    def __init__(self, store: S3Store, key: str) -> None:
        self._store = store
        self._display_key = key
        self._key = store._key(key)
        self._buf = bytearray()
        self._size = 0
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(store.max_inflight_parts)
        self.closed = False

    def write(self, data) -> int:
        # One copy per byte: fill the part buffer up to part_size and hand that buffer itself to the
        # upload (slicing a full buffer and deleting its head copied every byte twice more).
        view = memoryview(data).cast("B")
        n, off, part_size = len(view), 0, self._store.part_size
        while off < n:
            take = min(part_size - len(self._buf), n - off)
            self._buf += view[off:off + take]
            off += take
            if len(self._buf) >= part_size:
                chunk, self._buf = self._buf, bytearray()
                self._submit(chunk)
        self._size += n
        return n

    def _call(self, method: str, **kw: Any) -> Any:
        return self._store.fs.call_s3(method, Bucket=self._store.bucket, Key=self._key, **kw)

    def _submit(self, chunk: bytes | bytearray) -> None:
        if self._upload_id is None:
            try:
                self._upload_id = self._call("create_multipart_upload")["UploadId"]
            except Exception as exc:  # noqa: BLE001
                raise self._store._fail(exc, self._display_key, "start an upload") from None
            self._pool = ThreadPoolExecutor(self._store.max_inflight_parts, thread_name_prefix="snapformat-s3")
        number = len(self._parts) + 1
        self._slots.acquire()  # bounded memory: wait while max_inflight parts are in the air
        for f in self._parts:
            if f.done() and f.exception() is not None:
                self._slots.release()
                raise self._store._fail(f.exception(), self._display_key, "upload") from None  # type: ignore[arg-type]

        def upload() -> dict[str, Any]:
            try:
                out = self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=chunk)
                return {"PartNumber": number, "ETag": out["ETag"]}
            finally:
                self._slots.release()

        assert self._pool is not None
        self._parts.append(self._pool.submit(upload))

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(self._buf))
                return
            if self._buf:
                self._submit(bytes(self._buf))
                self._buf.clear()
            parts = [f.result() for f in self._parts]
            self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        except StoreError:
            self._abort_upload()
            raise
        except Exception as exc:  # noqa: BLE001
            self._abort_upload()
            raise self._store._fail(exc, self._display_key, "upload") from None
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _abort_upload(self) -> None:
        if self._upload_id is None:
            return
        for f in self._parts:
            f.cancel()
        try:
            self._call("abort_multipart_upload", UploadId=self._upload_id)
        except Exception:  # noqa: BLE001 - best effort; lifecycle rules and gc clean the rest
            pass
        self._upload_id = None

    def abort(self) -> None:
        """Drop everything written so far; nothing becomes visible."""
        if not self.closed:
            self.closed = True
            self._abort_upload()
            if self._pool is not None:
                self._pool.shutdown(wait=False)



def open_s3(url: str, **options: Any) -> S3Store:
    return S3Store(url, **options)


__all__ = ["S3Store", "S3Timeouts", "is_conflict_in_flight", "is_precondition_failed", "open_s3"]
