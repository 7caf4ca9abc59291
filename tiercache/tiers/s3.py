"""The S3 tier: a key prefix in an S3-compatible bucket (AWS, MinIO, SeaweedFS), through boto3.

Objects larger than the part size go up as multipart uploads whose parts are sent in parallel
straight from slices of the caller's buffer and carry CRC32 checksums the server verifies; an upload
that fails for any reason (KeyboardInterrupt included) is aborted. Large reads are split into
parallel ranged GETs streamed into the caller's buffer, pinned to one ETag with ``If-Match``.

Refs use real conditional writes: ``If-None-Match: *`` creates, ``If-Match: <etag>`` moves, and the
ETag is the compare-and-swap token. Each logical ref write is stamped with a unique write id in the
object's metadata, so when a response is lost (the SDK then retries, and the retry's precondition
fails against our own landed write) reading the ref back tells "our write landed" from "somebody
else's did" (icechunk design doc 017). Credentials come from the standard AWS chain and never
appear in messages or logs.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import botocore.session
import botocore.utils
from botocore import exceptions as bce
from botocore.config import Config

from tiercache.config import MIB, S3Config
from tiercache.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    ConflictError,
    StorageError,
    TierCacheError,
    TierFullError,
    TierUnavailableError,
)
from tiercache.failpoints import failpoint
from tiercache.names import check_key
from tiercache.tiers import _s3listing
from tiercache.tiers._s3buffers import ViewReader, byte_view, crc32_b64, fresh_bytes, writable_view
from tiercache.tiers._s3pacing import Pacer
from tiercache.tiers.base import Buffer, Observer, RefValue, Tier

log = logging.getLogger("tiercache.s3")

T = TypeVar("T")

#: Metadata key (``x-amz-meta-...``) holding the id of the logical write that made an object.
WRITE_ID_META = "tiercache-write-id"
_MIN_PART = 5 * MIB  # S3's smallest non-final part
_MAX_PARTS = 10_000
_READ_SLICE = 1 * MIB  # readinto granularity: bounds the HTTP library's temporary buffer
_MAX_READ_RESTARTS = 3
_PROBE_PREFIX = "tiercache-probe"
_STALE_ETAG = '"00000000000000000000000000000000"'
_CHECKSUM = "CRC32"

_ACCESS_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "AccountProblem",
})
_FULL_CODES = frozenset({"EntityTooLarge", "QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded"})
_PRECONDITION_CODES = frozenset({"PreconditionFailed"})
_CONCURRENT_CODES = frozenset({"ConditionalRequestConflict", "ConcurrentModification"})
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                             "TooManyRequests", "RequestThrottled"})
#: Failures after which a request may have been carried out although we got no answer.
_AMBIGUOUS = (bce.HTTPClientError,)  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError...
_TRANSPORT = (bce.ConnectionError, bce.HTTPClientError)  # ...plus EndpointConnectionError, ConnectTimeoutError
_STREAM_ERRORS = (bce.HTTPClientError, bce.IncompleteReadError, ConnectionError, TimeoutError)


def _code_status(err: bce.ClientError) -> tuple[str, int]:
    resp = err.response or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return code, status


def _throttled(err: BaseException) -> bool:
    """Whether ``err`` (or the boto error behind a tiercache one) is the store asking to slow down."""
    cause = err if isinstance(err, bce.ClientError) else err.__cause__
    if not isinstance(cause, bce.ClientError):
        return False
    code, status = _code_status(cause)
    return code in _THROTTLE_CODES or status in (429, 503)


def _retried(err: bce.ClientError) -> bool:
    return bool((err.response or {}).get("ResponseMetadata", {}).get("RetryAttempts"))


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:  # never echo credentials embedded in an endpoint URL
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        parts = parts._replace(netloc=netloc)
    return parts.geturl()


def _total_length(resp: dict[str, Any]) -> int | None:
    rng = resp.get("ContentRange")  # "bytes 0-99/12345"
    if rng and "/" in rng:
        tail = rng.rsplit("/", 1)[1]
        return int(tail) if tail.isdigit() else None
    return None


_LOADER_LOCK = threading.Lock()
_LOADER: Any = None


def _timestamp(value: str) -> datetime:
    """A timestamp of an S3 response, parsed without ``dateutil`` where it is ISO 8601.

    botocore parses every ``LastModified`` of a listing with ``dateutil`` (about 0.9 ms each on
    the 2-core VM of docs/benchmarks.md): listing the 1,000 manifests of a history took 0.8 s of
    an open, the one part of it that grew with the history on S3. Anything else (the HTTP dates
    of headers) goes to botocore's own parser.
    """
    try:
        out = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return botocore.utils.parse_timestamp(value)
    return out if out.tzinfo is not None else botocore.utils.parse_timestamp(value)


def _new_session() -> botocore.session.Session:
    """A fresh botocore session (fresh credential lookup) sharing the parsed service models."""
    global _LOADER
    with _LOADER_LOCK:
        session = botocore.session.Session()
        if _LOADER is None:
            _LOADER = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _LOADER)
        session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
        _s3listing.register(session.get_component("event_emitter"), _timestamp)
        return session


class _Changed(Exception):
    """The object was replaced or removed in the middle of a multi-request read."""


class _Unsatisfiable(Exception):
    """HTTP 416: the object exists but ends at or before the requested offset."""


class _Cancelled(Exception):
    """Another part of the same transfer failed; this one stops early."""


class S3Tier(Tier):
    """The ``s3`` tier: objects under ``cfg.url``'s prefix, refs with conditional writes.

    Construction sends nothing; :meth:`probe` checks the bucket with one short HEAD (the cache
    calls it when it opens), so a wrong or dead endpoint fails fast.
    All methods are thread-safe; parts and ranges run on a pool of ``cfg.max_concurrency`` threads.
    """

    name = "s3"
    durable = True
    confirm_puts = True
    capacity = None

    def __init__(self, cfg: S3Config) -> None:
        """Make the clients for the bucket of ``cfg.url``; nothing is sent yet (see :meth:`probe`)."""
        self._cfg = cfg
        self.deadline_s = cfg.deadline_s
        self._bucket = cfg.bucket
        self._root = f"{cfg.prefix}/" if cfg.prefix else ""
        self._part_size = max(cfg.part_size, _MIN_PART)
        self._endpoint = _redact(cfg.endpoint_url) if cfg.endpoint_url else "AWS S3"
        session = _new_session()
        region = cfg.region or session.get_config_variable("region")
        region = region or ("us-east-1" if cfg.endpoint_url else None)
        with _LOADER_LOCK:  # botocore sessions are not thread-safe while creating clients
            self._client = self._make_client(session, region, attempts=cfg.max_attempts)
            # One attempt with the probe's short timeouts: an open or a health probe must fail
            # fast instead of retrying (or waiting on) a dead endpoint.
            self._once = self._make_client(session, region, attempts=1, timeout=cfg.probe_timeout)
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="tiercache-s3")
        #: Bounds the puts and part uploads in flight and slows them down when the store throttles.
        self.pacer = Pacer(cfg.max_concurrency, cfg.throttle_retries)
        self._cond_delete: bool | None = None
        self._cas_ok: bool | None = None  # conditional PUTs enforced? probed before the first ref write
        #: The last conditional-write probe's result and time (the storage layer records it).
        self.last_probe: tuple[dict[str, bool], datetime] | None = None
        self._probe_lock = threading.Lock()

    def probe(self) -> None:
        """Check, with one HEAD of the bucket, that the bucket exists and answers (writes nothing).

        Raises:
            BucketNotFoundError: If the bucket does not exist.
            AccessDeniedError: If the credentials are missing or refused.
            TierUnavailableError: If the endpoint cannot be reached within ``s3.probe_timeout``.
        """
        self._check_bucket()

    # ------------------------------------------------------------------ setup

    def _make_client(
        self, session: botocore.session.Session, region: str | None, *, attempts: int, timeout: float | None = None
    ) -> Any:
        cfg = self._cfg
        style = cfg.addressing_style
        if style == "auto":
            style = "path" if cfg.endpoint_url else "auto"
        config = Config(
            region_name=region,
            retries={"mode": "standard", "total_max_attempts": attempts},
            connect_timeout=min(cfg.connect_timeout, timeout or cfg.connect_timeout),
            read_timeout=min(cfg.read_timeout, timeout or cfg.read_timeout),
            # Pool threads plus the engine's own I/O threads may all be in flight at once.
            max_pool_connections=cfg.max_concurrency + 64,
            s3={"addressing_style": style},
            tcp_keepalive=True,
            user_agent_appid="tiercache",
        )
        return session.create_client(
            # User:password in an endpoint URL is never a credential to botocore, which would
            # only echo it into its logs and errors: it gets the URL without them.
            "s3", region_name=region, endpoint_url=_redact(cfg.endpoint_url) if cfg.endpoint_url else None,
            verify=cfg.verify_tls, config=config,
        )

    def _check_bucket(self) -> None:
        where = f"bucket {self._bucket!r} at {self._endpoint}"
        for attempt in range(1, 3):
            try:
                self._once.head_bucket(Bucket=self._bucket)
                return
            except bce.ClientError as e:
                code, status = _code_status(e)
                if status in (404,) or code in ("NoSuchBucket", "NotFound"):
                    raise BucketNotFoundError(
                        f"S3 {where} does not exist: create it or fix the bucket in s3.url"
                    ) from e
                if status == 403 or code in _ACCESS_CODES:
                    raise AccessDeniedError(
                        f"S3 access to {where} denied ({code or status}): check AWS_ACCESS_KEY_ID/"
                        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket policy"
                    ) from e
                if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
                    raise StorageError(f"S3 {where} is in another region: set s3.region to its region") from e
                if (status >= 500 or status == 429) and attempt < 2:
                    time.sleep(self._backoff(attempt))
                    continue
                raise StorageError(f"S3 {where} cannot be opened: {code or 'HTTP'} {status}") from e
            except (bce.NoCredentialsError, bce.PartialCredentialsError) as e:
                raise AccessDeniedError(
                    f"no usable AWS credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                    "or AWS_PROFILE"
                ) from e
            except _TRANSPORT as e:
                raise TierUnavailableError(
                    f"S3 endpoint {self._endpoint} unreachable ({type(e).__name__}): check s3.endpoint_url "
                    "and that the server is running"
                ) from e
            except bce.ParamValidationError as e:
                raise ConfigError(f"invalid S3 bucket name {self._bucket!r} in s3.url") from e
            except bce.BotoCoreError as e:
                raise StorageError(f"S3 {where} cannot be opened: {type(e).__name__}") from e

    # ------------------------------------------------------------------ helpers

    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _where(self, key: str | None) -> str:
        return f"s3://{self._bucket}/{self._root}{key or ''} at {self._endpoint}"

    def _backoff(self, attempt: int) -> float:
        return random.uniform(0, min(2.0, 0.05 * 2**attempt))

    def _error(self, exc: BaseException, op: str, key: str | None = None) -> TierCacheError:
        """Map a boto error onto the tiercache tree, by error code and HTTP status only."""
        where = self._where(key)
        cls: type[StorageError]
        if isinstance(exc, bce.ClientError):
            code, status = _code_status(exc)
            what = f"{code or 'error'} (HTTP {status})"
            if code in _FULL_CODES or status == 507:
                cls, hint = TierFullError, "free space on the store or raise its quota"
            elif code == "NoSuchBucket":
                cls, hint = BucketNotFoundError, f"create bucket {self._bucket!r} or fix s3.url"
            elif code in _ACCESS_CODES or status == 403:
                cls, hint = AccessDeniedError, "check the credentials and the bucket policy"
            elif status >= 500 or status in (429, 503):
                cls, hint = StorageError, f"the store kept failing after {self._cfg.max_attempts} attempts"
            else:
                cls, hint = StorageError, "see the cause for details"
            msg = f"S3 {op} of {where} failed: {what}; {hint}"
        elif isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            cls = AccessDeniedError
            msg = f"S3 {op} of {where}: no usable AWS credentials; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        elif isinstance(exc, (*_TRANSPORT, ConnectionError, TimeoutError)):
            cls = TierUnavailableError
            msg = f"S3 {op} of {where} failed: endpoint unreachable ({type(exc).__name__}); is it up?"
        else:
            cls = StorageError
            msg = f"S3 {op} of {where} failed: {type(exc).__name__}"
        err = cls(msg)
        err.__cause__ = exc
        return err

    def _call(self, op: str, key: str | None, fn: Callable[..., T], **kwargs: Any) -> T:
        try:
            return fn(Bucket=self._bucket, **kwargs)
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, op, key) from e

    # ------------------------------------------------------------------ objects

    def get(self, key: str) -> bytes | None:
        """Return the whole object, or ``None``; large objects arrive as parallel ranged GETs."""
        full = self._full(key)
        got = self._read(full, key, 0, None)
        return None if got is None else bytes(got[0]) if isinstance(got[0], bytearray) else got[0]

    def read_into(
        self, key: str, out: memoryview, offset: int = 0, *, observe: Observer | None = None
    ) -> int | None:
        """Stream bytes ``[offset, offset + len(out))`` of the object into ``out``.

        Parts arrive in parallel and out of order, so ``observe`` sees the bytes once, at the end.
        """
        full = self._full(key)
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        view = writable_view(out)
        if not len(view):
            return None if self.size(key) is None else 0
        got = self._read(full, key, offset, view)
        if got is None:
            return None
        if observe is not None:
            observe(view[: got[1]])
        return got[1]

    def _read(self, full: str, key: str, offset: int, out: memoryview | None) -> tuple[Any, int] | None:
        """Read from ``offset`` into ``out`` (or a new buffer up to the end if ``out`` is None)."""
        seg = self._part_size
        for _ in range(_MAX_READ_RESTARTS):
            want = seg if out is None else min(len(out), seg)
            try:
                resp = self._get_range(full, key, offset, want, None)
            except _Unsatisfiable:
                return (b"", 0) if out is None else (out, 0)
            if resp is None:
                return None
            total = _total_length(resp)
            if total is None:  # a 200 without Content-Range: the server ignored the range
                total = int(resp["ContentLength"])
                if offset or total > want:
                    resp["Body"].close()
                    raise StorageError(f"S3 read of {self._where(key)}: the server ignored the Range header")
            end = total if out is None else min(total, offset + len(out))
            avail = max(0, end - offset)
            etag = resp.get("ETag")
            buf: Any
            buf, view = fresh_bytes(avail) if out is None else (out, out)
            first = min(avail, want)
            cancel = threading.Event()
            futures = [
                self._pool.submit(self._fetch, full, key, view[s : min(s + seg, avail)], offset + s, etag, None, cancel)
                for s in range(first, avail, seg)
            ]
            try:
                self._fetch(full, key, view[:first], offset, etag, resp, cancel)
                self._wait_all(futures)
            except _Changed:
                self._drain(futures, cancel)
                log.debug("%s changed during a read; restarting it", self._where(key))
                continue
            except BaseException:
                self._drain(futures, cancel)
                raise
            return buf, avail
        raise StorageError(f"S3 read of {self._where(key)} failed: the object kept changing during the read")

    def _get_range(self, full: str, key: str, start: int, length: int, etag: str | None) -> dict[str, Any] | None:
        kwargs: dict[str, Any] = {"Key": full, "Range": f"bytes={start}-{start + length - 1}"}
        if etag is not None:
            kwargs["IfMatch"] = etag
        try:
            return self._client.get_object(Bucket=self._bucket, **kwargs)  # type: ignore[no-any-return]
        except bce.ClientError as e:
            code, status = _code_status(e)
            if status == 416 or code == "InvalidRange":
                if etag is not None:
                    raise _Changed from e
                raise _Unsatisfiable from e
            if etag is not None and (status == 412 or code in _PRECONDITION_CODES):
                raise _Changed from e
            if code in _MISSING_KEY_CODES or (status == 404 and code != "NoSuchBucket"):
                if etag is not None:
                    raise _Changed from e
                return None
            raise self._error(e, "read", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "read", key) from e

    def _fetch(
        self, full: str, key: str, view: memoryview, start: int, etag: str | None,
        resp: dict[str, Any] | None, cancel: threading.Event,
    ) -> None:
        """Fill ``view`` with the bytes at ``start``; resume a broken stream with a new ranged GET."""
        pos = failures = 0
        try:
            while pos < len(view):
                if cancel.is_set():
                    raise _Cancelled
                if resp is None:
                    resp = self._get_range(full, key, start + pos, len(view) - pos, etag)
                    if resp is None:
                        raise _Changed
                body, resp = resp["Body"], None
                err: BaseException | None = None
                try:
                    while pos < len(view):
                        if cancel.is_set():
                            raise _Cancelled
                        n = body.readinto(view[pos : pos + _READ_SLICE])
                        if not n:
                            break
                        pos += n
                except _STREAM_ERRORS as e:
                    err = e
                finally:
                    body.close()  # after a full read the connection is already back in the pool
                if pos < len(view):
                    failures += 1
                    if failures >= self._cfg.max_attempts:
                        if err is not None:
                            raise self._error(err, "read", key) from err
                        raise StorageError(f"S3 read of {self._where(key)} kept ending early at byte {start + pos}")
                    log.debug("read of %s broke at byte %d (%s); resuming", self._where(key), start + pos, err)
                    time.sleep(self._backoff(failures))
        finally:
            if resp is not None:
                resp["Body"].close()

    def put(self, key: str, data: Buffer, *, sync_name: bool = True) -> None:
        """Store ``data``: one PutObject, or a parallel multipart upload above the part size.

        ``sync_name`` is ignored: an object is durable under its key once the store answers.
        """
        full = self._full(key)
        view = byte_view(data)
        if len(view) <= self._part_size:
            def attempt() -> Any:
                # A stream of its own per attempt: a throttled attempt has read the last one to its end.
                body = data if isinstance(data, bytes) else ViewReader(view) if len(view) else b""
                return self._call("put", key, self._client.put_object, Key=full, Body=body,
                                  ChecksumAlgorithm=_CHECKSUM)

            self.pacer.run(attempt, _throttled)
        else:
            self._put_multipart(full, key, view)

    def _put_multipart(self, full: str, key: str, view: memoryview) -> None:
        size = len(view)
        psize = max(self._part_size, -(-size // _MAX_PARTS))
        write_id = uuid.uuid4().hex
        resp = self._call(
            "put", key, self._client.create_multipart_upload, Key=full, ChecksumAlgorithm=_CHECKSUM,
            Metadata={WRITE_ID_META: write_id},
        )
        upload_id = resp["UploadId"]
        log.debug("multipart upload of %s (%d bytes, %d-byte parts) started", self._where(key), size, psize)
        cancel = threading.Event()
        futures: list[Future[dict[str, Any]]] = []
        try:
            for num, start in enumerate(range(0, size, psize), 1):
                part = view[start : start + psize]
                futures.append(self._pool.submit(self._upload_part, full, key, upload_id, num, part, cancel))
            self._wait_all(futures)
            self._complete(full, key, upload_id, [f.result() for f in futures], write_id)
        except BaseException as exc:
            try:
                self._drain(futures, cancel)
            finally:
                self._abort(full, key, upload_id)
            if isinstance(exc, (bce.BotoCoreError, bce.ClientError)):
                raise self._error(exc, "put", key) from exc
            raise

    def _upload_part(
        self, full: str, key: str, upload_id: str, num: int, part: memoryview, cancel: threading.Event
    ) -> dict[str, Any]:
        if cancel.is_set():
            raise _Cancelled
        resp = self.pacer.run(lambda: self._client.upload_part(
            Bucket=self._bucket, Key=full, UploadId=upload_id, PartNumber=num, Body=ViewReader(part),
            ChecksumAlgorithm=_CHECKSUM,
        ), _throttled)
        if num == 1:
            failpoint("s3.after_first_part")
        # The server echoes the CRC32 it verified; compute it only for a server that does not.
        return {"PartNumber": num, "ETag": resp["ETag"], "ChecksumCRC32": resp.get("ChecksumCRC32") or crc32_b64(part)}

    def _complete(self, full: str, key: str, upload_id: str, parts: list[dict[str, Any]], write_id: str) -> None:
        try:
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except bce.ClientError as e:
            code, status = _code_status(e)
            # A retried complete whose first attempt landed finds the upload gone: check the object.
            if (code == "NoSuchUpload" or status == 404) and self._written_by(full, key, write_id):
                log.info("multipart complete of %s: response lost, upload had landed", self._where(key))
                return
            raise
        log.debug("multipart upload of %s completed (%d parts)", self._where(key), len(parts))

    def _written_by(self, full: str, key: str, write_id: str) -> bool:
        try:
            head = self._client.head_object(Bucket=self._bucket, Key=full)
        except bce.ClientError as e:
            if _code_status(e)[1] == 404:
                return False
            raise
        return bool(head.get("Metadata", {}).get(WRITE_ID_META) == write_id)

    def _abort(self, full: str, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=full, UploadId=upload_id)
            log.debug("multipart upload of %s aborted", self._where(key))
        except (bce.BotoCoreError, bce.ClientError) as e:
            if isinstance(e, bce.ClientError) and _code_status(e)[0] == "NoSuchUpload":
                return
            log.warning(
                "could not abort multipart upload %s of %s (%s); `tiercache doctor` lists and aborts it",
                upload_id, self._where(key), type(e).__name__,
            )

    def _wait_all(self, futures: list[Future[Any]]) -> None:
        if not futures:
            return
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:  # raise the first real failure, not a _Cancelled it caused
            if f in done and f.exception() is not None and not isinstance(f.exception(), _Cancelled):
                raise f.exception()  # type: ignore[misc]
        for f in futures:
            f.result()

    def _drain(self, futures: list[Future[Any]], cancel: threading.Event) -> None:
        """Stop sibling transfers and wait for those in flight, so none outlives the call."""
        cancel.set()
        for f in futures:
            f.cancel()
        wait(futures, timeout=self._cfg.connect_timeout + self._cfg.read_timeout)

    def size(self, key: str) -> int | None:
        """Return the object's length (a HEAD), or ``None`` if it does not exist."""
        full = self._full(key)
        try:
            return int(self._client.head_object(Bucket=self._bucket, Key=full)["ContentLength"])
        except bce.ClientError as e:
            if _code_status(e)[1] == 404:
                return None
            raise self._error(e, "size", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "size", key) from e

    def delete(self, key: str) -> None:
        """Delete the object; deleting a missing key is a no-op."""
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self._bucket, Key=full)
        except bce.ClientError as e:
            if _code_status(e)[0] in _MISSING_KEY_CODES:
                return
            raise self._error(e, "delete", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "delete", key) from e

    def _objects(self, prefix: str) -> list[dict[str, Any]]:
        if prefix:
            check_key(prefix[:-1] if prefix.endswith("/") else prefix)
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=self._root + prefix
        )
        try:
            return [obj for page in pages for obj in page.get("Contents", ()) if not obj["Key"].endswith("/")]
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "list", prefix) from e

    def list_dated(self, prefix: str = "") -> list[tuple[str, int, datetime]]:
        """Return ``(key, size, last modified)`` of every object under ``prefix``, sorted by key.

        One listing gives what ``gc`` needs to honour its grace period without a HEAD per object.
        """
        n = len(self._root)
        return sorted((obj["Key"][n:], int(obj["Size"]), obj["LastModified"]) for obj in self._objects(prefix))

    def list(self, prefix: str = "") -> list[str]:
        """Return every key under ``prefix`` (relative to the tier's prefix), sorted."""
        n = len(self._root)
        return sorted(obj["Key"][n:] for obj in self._objects(prefix))

    def used_bytes(self) -> int:
        """Return the total size of the objects under the tier's prefix (one listing)."""
        return sum(int(obj["Size"]) for obj in self._objects(""))

    # ------------------------------------------------------------------ refs

    def _get_whole(self, full: str, key: str) -> tuple[bytes, str, dict[str, str]] | None:
        for attempt in range(1, self._cfg.max_attempts + 1):
            try:
                resp = self._client.get_object(Bucket=self._bucket, Key=full)
            except bce.ClientError as e:
                code, status = _code_status(e)
                if code in _MISSING_KEY_CODES or (status == 404 and code != "NoSuchBucket"):
                    return None
                raise self._error(e, "read", key) from e
            except bce.BotoCoreError as e:
                raise self._error(e, "read", key) from e
            try:
                data = resp["Body"].read()  # validated against the object's checksum when it has one
                return data, resp["ETag"], resp.get("Metadata") or {}
            except (*_STREAM_ERRORS, bce.FlexibleChecksumError) as e:
                if attempt == self._cfg.max_attempts:
                    raise self._error(e, "read", key) from e
                time.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    def read_ref(self, key: str) -> RefValue | None:
        """Return the ref's bytes and ETag, or ``None`` if it does not exist."""
        got = self._get_whole(self._full(key), key)
        return None if got is None else RefValue(got[0], got[1])

    def write_ref(self, key: str, data: bytes, *, expect: str | None) -> str:
        """Create (``If-None-Match: *``) or move (``If-Match: expect``) a ref; return its ETag.

        A failure that may hide a landed write (a 412 after the SDK retried a lost response, or a
        transport error after the last attempt) is resolved by reading the ref back: if it carries
        this call's write id, the write landed and its ETag is returned.

        Raises:
            ConfigError: If the store ignores conditional writes and ``s3.allow_unsafe_refs`` is off.
        """
        full = self._full(key)
        self._require_conditional_writes(key)
        data = bytes(data)
        write_id = uuid.uuid4().hex
        cond = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
        for attempt in range(1, self._cfg.max_attempts + 1):
            try:
                resp = self._client.put_object(
                    Bucket=self._bucket, Key=full, Body=data, ChecksumAlgorithm=_CHECKSUM,
                    Metadata={WRITE_ID_META: write_id}, **cond,
                )
                return str(resp["ETag"])
            except bce.ClientError as e:
                code, status = _code_status(e)
                if status == 412 or code in _PRECONDITION_CODES or (expect is not None and code == "NoSuchKey"):
                    token = self._landed(full, key, write_id, data)
                    if token is not None:
                        log.info("write of ref %s: response lost, the write had landed", self._where(key))
                        return token
                    self._conflict(key, expect, e)
                if (status == 409 or code in _CONCURRENT_CODES) and attempt < self._cfg.max_attempts:
                    time.sleep(self._backoff(attempt))  # a concurrent conditional write: try again
                    continue
                if status >= 500 or status == 429:
                    token = self._landed(full, key, write_id, data)
                    if token is not None:
                        return token
                raise self._error(e, "write_ref", key) from e
            except _AMBIGUOUS as e:
                token = self._landed(full, key, write_id, data)
                if token is not None:
                    log.info("write of ref %s: no response, the write had landed", self._where(key))
                    return token
                raise self._error(e, "write_ref", key) from e
            except bce.BotoCoreError as e:
                raise self._error(e, "write_ref", key) from e
        raise AssertionError("unreachable")

    def _landed(self, full: str, key: str, write_id: str, data: bytes) -> str | None:
        """Return the ref's ETag if it holds this write (by write id, else by bytes), else None."""
        got = self._get_whole(full, key)
        if got is None:
            return None
        body, etag, meta = got
        stamp = meta.get(WRITE_ID_META)
        ours = stamp == write_id if stamp is not None else body == data
        return etag if ours and body == data else None

    def _conflict(self, key: str, expect: str | None, cause: BaseException) -> NoReturn:
        if expect is None:
            raise ConflictError(f"ref {key!r} already exists in {self._where(None)}") from cause
        raise ConflictError(
            f"ref {key!r} in {self._where(None)} changed since token {expect} was read; re-read it and retry"
        ) from cause

    def delete_ref(self, key: str, *, expect: str) -> None:
        """Delete a ref if its ETag is still ``expect`` (``If-Match`` where the server enforces it)."""
        full = self._full(key)
        if not self._conditional_delete_supported():
            current = self.read_ref(key)
            if current is None or current.token != expect:
                self._conflict(key, expect, LookupError(key))
            # No atomic primitive on this server: a write between the read and here is lost.
            self.delete(key)
            return
        for attempt in range(1, self._cfg.max_attempts + 1):
            try:
                self._client.delete_object(Bucket=self._bucket, Key=full, IfMatch=expect)
                return
            except bce.ClientError as e:
                code, status = _code_status(e)
                if code != "NoSuchBucket" and (
                    status in (404, 412) or code in _PRECONDITION_CODES or code in _MISSING_KEY_CODES
                ):
                    # Gone after the SDK retried: our first attempt deleted it and its answer was lost.
                    if _retried(e) and self.read_ref(key) is None:
                        return
                    self._conflict(key, expect, e)
                if (status == 409 or code in _CONCURRENT_CODES) and attempt < self._cfg.max_attempts:
                    time.sleep(self._backoff(attempt))
                    continue
                raise self._error(e, "delete_ref", key) from e
            except _AMBIGUOUS as e:
                if self.read_ref(key) is None:
                    return
                raise self._error(e, "delete_ref", key) from e
            except bce.BotoCoreError as e:
                raise self._error(e, "delete_ref", key) from e

    def _require_conditional_writes(self, key: str) -> None:
        """Refuse to commit a ref on a store that ignores conditional PUTs (probed before the first ref write)."""
        if self._cfg.allow_unsafe_refs:
            return
        if self._cas_ok is None:
            with self._probe_lock:
                if self._cas_ok is None:
                    self.probe_conditional_writes()
        if not self._cas_ok:
            raise ConfigError(
                f"refusing to commit ref {key!r}: {self._endpoint} ignores conditional writes (If-None-Match/"
                "If-Match), so another writer's ref could be silently overwritten; use a store that enforces "
                "them, or set s3.allow_unsafe_refs = true if only one writer uses this prefix (see `tiercache doctor`)"
            )

    def _conditional_delete_supported(self) -> bool:
        if self._cond_delete is None:
            with self._probe_lock:
                if self._cond_delete is None:
                    self._cond_delete = self._probe(delete_only=True)["delete_if_match"]
                    if not self._cond_delete:
                        log.warning(
                            "%s ignores If-Match on DeleteObject: delete_ref falls back to read-compare-"
                            "delete, which can lose a concurrent ref update", self._endpoint,
                        )
        return self._cond_delete

    # ------------------------------------------------------------------ doctor

    def probe_conditional_writes(self) -> dict[str, bool]:
        """Check on a scratch key what the endpoint really enforces.

        Returns:
            ``if_none_match`` (a second create with ``If-None-Match: *`` gets 412), ``if_match``
            (a PUT with a stale ``If-Match`` gets 412 and one with the current ETag succeeds),
            ``delete_if_match`` (a DELETE with a stale ``If-Match`` gets 412 and deletes nothing)
            and ``read_after_write`` (a GET right after a PUT returns the new bytes).
        """
        result = self._probe(delete_only=False)
        self._cond_delete = result["delete_if_match"]
        self._cas_ok = result["if_none_match"] and result["if_match"]
        self.last_probe = (result, datetime.now(UTC))
        return result

    def upload_clock_skew(self) -> float:
        """Seconds by which the store's multipart upload start times differ from this clock.

        Starts a scratch multipart upload, reads its start time back from the listing, and aborts
        it. Some S3 emulators report a fixed date: aborting uploads by age would then abort uploads
        in flight.

        Raises:
            StorageError: If the upload cannot be started, listed or aborted.
        """
        key = f"{_PROBE_PREFIX}/upload-{uuid.uuid4().hex}"
        full = self._full(key)
        before = datetime.now(UTC)
        try:
            upload_id = self._client.create_multipart_upload(Bucket=self._bucket, Key=full)["UploadId"]
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "create_multipart_upload", key) from e
        try:
            listed = [started for k, uid, started in self.list_multipart_uploads() if uid == upload_id]
        finally:
            self.abort_multipart_upload(key, upload_id)
        if not listed:
            raise StorageError(f"S3 at {self._endpoint} does not list the multipart upload it just started")
        return (listed[0] - before).total_seconds()

    def _probe(self, *, delete_only: bool) -> dict[str, bool]:
        scratch = f"{self._root}{_PROBE_PREFIX}/{uuid.uuid4().hex}"
        bucket, c = self._bucket, self._client

        def refused(fn: Callable[..., Any], **kw: Any) -> bool | None:
            """True: the precondition failed (412); False: the request ran; None: not supported."""
            try:
                fn(Bucket=bucket, Key=scratch, **kw)
                return False
            except bce.ClientError as e:
                code, status = _code_status(e)
                if status == 412 or code in _PRECONDITION_CODES:
                    return True
                if status in (400, 501) or code in ("NotImplemented", "InvalidArgument", "InvalidRequest"):
                    return None
                raise

        def exists() -> bool:
            try:
                c.head_object(Bucket=bucket, Key=scratch)
                return True
            except bce.ClientError as e:
                if _code_status(e)[1] == 404:
                    return False
                raise

        result = dict.fromkeys(("if_none_match", "if_match", "delete_if_match", "read_after_write"), False)
        try:
            c.put_object(Bucket=bucket, Key=scratch, Body=b"probe-1")
            if not delete_only:
                got = self._get_whole(scratch, _PROBE_PREFIX)
                result["read_after_write"] = got is not None and got[0] == b"probe-1"
                result["if_none_match"] = refused(c.put_object, Body=b"probe-2", IfNoneMatch="*") is True
                etag = c.head_object(Bucket=bucket, Key=scratch)["ETag"]
                stale = refused(c.put_object, Body=b"probe-3", IfMatch=_STALE_ETAG)
                current = refused(c.put_object, Body=b"probe-4", IfMatch=etag)
                if current is True and (self._get_whole(scratch, _PROBE_PREFIX) or (b"",))[0] == b"probe-4":
                    current = False  # it landed; the 412 answered the SDK's retry after a lost response
                result["if_match"] = stale is True and current is False
            result["delete_if_match"] = refused(c.delete_object, IfMatch=_STALE_ETAG) is True and exists()
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "probe", _PROBE_PREFIX) from e
        finally:
            with contextlib.suppress(bce.BotoCoreError, bce.ClientError):
                c.delete_object(Bucket=bucket, Key=scratch)
        log.info("conditional-write probe of %s: %s", self._endpoint, result)
        return result

    def list_multipart_uploads(self) -> list[tuple[str, str, datetime]]:
        """Return ``(key, upload_id, initiated)`` of every unfinished multipart upload under the prefix."""
        pages = self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self._bucket, Prefix=self._root
        )
        n = len(self._root)
        try:
            return sorted(
                (u["Key"][n:], u["UploadId"], u["Initiated"]) for page in pages for u in page.get("Uploads", ())
            )
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "list_multipart_uploads", None) from e

    def abort_multipart_upload(self, key: str, upload_id: str) -> None:
        """Abort one unfinished multipart upload (as listed by :meth:`list_multipart_uploads`)."""
        full = self._full(key)
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=full, UploadId=upload_id)
        except bce.ClientError as e:
            if _code_status(e)[0] == "NoSuchUpload":
                return
            raise self._error(e, "abort_multipart_upload", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "abort_multipart_upload", key) from e

    def close(self) -> None:
        """Stop the transfer threads and close the HTTP connections."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for client in (self._client, self._once):
            with contextlib.suppress(Exception):
                client.close()


__all__ = ["WRITE_ID_META", "S3Tier"]
