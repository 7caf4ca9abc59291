"""Shared fixtures: the ``--slow`` switch and a real S3 server for the integration tests.

The S3 server is the one named by ``TEST_TIERCACHE_S3_ENDPOINT`` (for example MinIO from
``docker compose up -d``, with ``TEST_TIERCACHE_S3_BUCKET`` and the ``AWS_*`` credentials of the
environment, minioadmin/minioadmin by default), or else an embedded SeaweedFS started on free
loopback ports the first time a test asks for it and stopped at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# Tests kill ranks and stores on purpose; torch's C++ layer then logs each broken store socket as a
# warning with a C++ stack trace on stderr, which would land among pytest's output. Errors still
# print; what a test checks is what the Python side raised. Set before torch is imported, here and
# in every process the tests start (they inherit the environment).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from tiercache.config import S3Config
from tiercache.testing import aws_env

DEFAULT_TEST_BUCKET = "tiercache-test"
#: Variables that would make the test clients pick up something other than the test server's keys.
_SHADOWING = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run the slow tests and the large trial counts (also: TEST_TIERCACHE_SLOW=1)",
    )


def _slow_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--slow")) or os.environ.get("TEST_TIERCACHE_SLOW", "") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Nothing is ever skipped: tests scale their trial counts with the ``slow`` fixture instead.
    for item in items:
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def slow(pytestconfig: pytest.Config) -> bool:
    """Whether large trial counts were asked for (``--slow`` or ``TEST_TIERCACHE_SLOW=1``)."""
    return _slow_enabled(pytestconfig)


@dataclass(frozen=True)
class ExternalS3:
    """An S3 server the developer runs (``TEST_TIERCACHE_S3_ENDPOINT``), same shape as LocalS3."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        return aws_env(self.access_key, self.secret_key, self.region)


def _boto_client(server: ExternalS3 | object):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,  # type: ignore[attr-defined]
        aws_access_key_id=server.access_key,  # type: ignore[attr-defined]
        aws_secret_access_key=server.secret_key,  # type: ignore[attr-defined]
        region_name=server.region,  # type: ignore[attr-defined]
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "total_max_attempts": 3}),
    )


@contextlib.contextmanager
def _patched_env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*values, *_SHADOWING)}
    for k in _SHADOWING:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server() -> Iterator[object]:
    """A running S3 server with the test bucket; the ``AWS_*`` variables point at it meanwhile.

    Yields an object with ``endpoint_url``, ``bucket``, ``access_key``, ``secret_key``, ``region``
    and ``env()``.
    """
    endpoint = os.environ.get("TEST_TIERCACHE_S3_ENDPOINT")
    if endpoint:
        server: object = ExternalS3(
            endpoint_url=endpoint,
            bucket=os.environ.get("TEST_TIERCACHE_S3_BUCKET", DEFAULT_TEST_BUCKET),
            access_key=os.environ.get("AWS_ACCESS_KEY_ID", "minioadmin"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "minioadmin"),
            region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        )
        client = _boto_client(server)
        try:
            client.create_bucket(Bucket=server.bucket)  # type: ignore[attr-defined]
        except client.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        finally:
            client.close()
        with _patched_env(server.env()):  # type: ignore[attr-defined]
            yield server
        return

    from tiercache.testing import LocalS3

    local = LocalS3(bucket=os.environ.get("TEST_TIERCACHE_S3_BUCKET", DEFAULT_TEST_BUCKET))
    local.start()
    try:
        with _patched_env(local.env()):
            yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def _s3_admin(s3_server: object) -> Iterator[object]:
    """One plain boto3 client on the test server, for fixtures that clean up after tests."""
    client = _boto_client(s3_server)
    yield client
    client.close()


@pytest.fixture
def s3_config(s3_server: object, _s3_admin: object) -> Iterator[S3Config]:
    """An :class:`S3Config` for a fresh, empty ``s3://<bucket>/t-<uuid>`` prefix on the test server.

    Everything under the prefix (objects and unfinished multipart uploads) is removed afterwards.
    """
    bucket: str = s3_server.bucket  # type: ignore[attr-defined]
    prefix = f"t-{uuid.uuid4().hex}"
    yield S3Config(
        url=f"s3://{bucket}/{prefix}",
        endpoint_url=s3_server.endpoint_url,  # type: ignore[attr-defined]
        region=s3_server.region,  # type: ignore[attr-defined]
    )
    client: Any = _s3_admin
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for up in page.get("Uploads", ()):
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    except Exception as e:  # cleanup is best effort: never turn a passing test into an error
        warnings.warn(f"could not clean up s3://{bucket}/{prefix}: {type(e).__name__}", stacklevel=1)


@pytest.fixture(autouse=True)
def _no_level_settled_twice() -> Iterator[None]:
    """Every test checks that no durability level was settled twice (see ``tiercache.handle.settled_twice``).

    A second outcome raises on the thread that tries, where the pipeline may turn it into a log
    line; this makes it fail the test that provoked it, whatever that test asserts itself.
    """
    from tiercache import handle

    handle.forget_settled_twice()
    yield
    twice = handle.settled_twice()
    handle.forget_settled_twice()
    assert not twice, f"durability levels settled twice: {twice}"
