"""Fault injection into one boto3 S3 client through botocore event hooks (seeded, counted).

:class:`S3Faults` registers a ``before-send.s3`` handler on a client. For each request it draws
from a seeded random generator and may:

* answer an error itself (the request never reaches the server): ``503 SlowDown`` as a throttled
  store does, or a permanent one such as ``403 AccessDenied`` or ``507 XMinioStorageFull``;
* raise a connection reset before sending (the request never lands);
* send the request to the real server and then replace its response with a connection error
  (the request lands, the client never learns it did): a *lost response*.

botocore's retry handler sees exactly what it would see from a misbehaving network or store, so
the tier's retries, backoff, multipart aborts and lost-response read-back are exercised for real.
Every injected fault is counted per kind and operation in :attr:`S3Faults.injected`.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.exceptions import ConnectionClosedError

from tiercache.names import CHUNKS

SLOWDOWN = (503, "SlowDown")

#: Operations never faulted unless named: an abort that keeps failing leaves an upload behind by
#: design (the tier logs it and ``tiercache doctor --abort-stale`` removes it; tested there).
SPARED = frozenset({"AbortMultipartUpload"})


class _Body:
    """The raw body of an injected response (what botocore reads an error document from)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._data

    def read(self, *_: Any) -> bytes:
        data, self._data = self._data, b""
        return data


def is_ref_write(op: str, request: AWSPreparedRequest) -> bool:
    """Whether a request is a conditional PutObject (a ref create or move)."""
    return op == "PutObject" and any(h in request.headers for h in ("If-None-Match", "If-Match"))


class S3Faults:
    """Injects faults into every request of one boto3 S3 client.

    Args:
        client: The boto3 S3 client (for a tier: ``tier._client``).
        seed: Seed of the generator that decides which requests fail.
        error_rate: Probability that a request is answered with ``error`` by the injector.
        error: The ``(HTTP status, S3 error code)`` answered (default ``503 SlowDown``).
        reset: Probability that a request fails with a connection reset before it is sent.
        lost_ref_response: Probability that a ref write lands but its response is lost.
        only: Operation names to fault (default: every operation but :data:`SPARED`).
    """

    def __init__(
        self,
        client: Any,
        *,
        seed: int,
        error_rate: float = 0.0,
        error: tuple[int, str] = SLOWDOWN,
        reset: float = 0.0,
        lost_ref_response: float = 0.0,
        only: frozenset[str] | None = None,
    ) -> None:
        self._client = client
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.error_rate = error_rate
        self.error = error
        self.reset = reset
        self.lost_ref_response = lost_ref_response
        self.only = only
        self.injected: Counter[tuple[str, str]] = Counter()
        self.requests: Counter[str] = Counter()
        self._unique = f"tiercache-test-faults-{id(self)}"
        client.meta.events.register_first("before-send.s3", self._before_send, unique_id=self._unique)

    def remove(self) -> None:
        """Stop injecting (the counts stay)."""
        self._client.meta.events.unregister("before-send.s3", unique_id=self._unique)

    def total(self, kind: str | None = None) -> int:
        """Faults injected, of one kind (an error code such as ``SlowDown``, ``reset``, ``lost``) or in all."""
        return sum(n for (k, _), n in self.injected.items() if kind is None or k == kind)

    def _draw(self) -> float:
        with self._lock:
            return self._rng.random()

    def _count(self, kind: str, op: str) -> None:
        with self._lock:
            self.injected[(kind, op)] += 1

    def _before_send(self, request: AWSPreparedRequest, event_name: str, **_: Any) -> AWSResponse | None:
        op = event_name.rsplit(".", 1)[-1]
        with self._lock:
            self.requests[op] += 1
        if (op in SPARED and (self.only is None or op not in self.only)) or (
            self.only is not None and op not in self.only
        ):
            return None
        if self.lost_ref_response and is_ref_write(op, request) and self._draw() < self.lost_ref_response:
            # Deliver the request for real, then lose the answer.
            response = self._client._endpoint.http_session.send(request)
            response.content  # noqa: B018 - read the body so the connection goes back to the pool
            self._count("lost", op)
            raise ConnectionClosedError(endpoint_url=request.url)
        draw = self._draw()
        if draw < self.error_rate:
            status, code = self.error
            self._count(code, op)
            body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))
        if draw < self.error_rate + self.reset:
            self._count("reset", op)
            raise ConnectionClosedError(endpoint_url=request.url)
        return None


class SlowDownChunks:
    """Answers ``503 SlowDown`` to the first ``n`` chunk uploads of one client, then lets them through."""

    def __init__(self, client: Any, n: int) -> None:
        self.left = n
        self.answered = 0
        self._lock = threading.Lock()
        client.meta.events.register_first("before-send.s3", self._before_send, unique_id="test-slowdown-chunks")

    def _before_send(self, request: AWSPreparedRequest, event_name: str, **_: Any) -> AWSResponse | None:
        if f"/{CHUNKS}" not in request.url or request.method != "PUT":
            return None
        with self._lock:
            if self.left <= 0:
                return None
            self.left -= 1
            self.answered += 1
        # A real server reads the request before it answers: consume the body as it would, so a
        # retry that reuses a spent stream sends nothing (and the test sees it).
        if hasattr(request.body, "read"):
            while request.body.read(1 << 20):
                pass
        body = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>injected</Message></Error>"
        return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Body(body))
