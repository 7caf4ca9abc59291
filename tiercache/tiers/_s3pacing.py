"""Pacing of one process's S3 data requests: a bounded number in flight, fewer when the store throttles.

S3 answers ``503 SlowDown`` when a key prefix receives more requests per second than it serves
(about 3,500 writes and 5,500 reads per prefix, before it splits the prefix). botocore retries
such an answer a few times and then gives up, which would fail the version's ``remote`` level
although the store is only asking for patience. The :class:`Pacer` instead:

- bounds the requests in flight (the part uploads and puts of every version of this process),
  ``s3.max_concurrency`` by default, divided among the ranks of a node in a multi-rank job
  (:meth:`Pacer.share`), so a node sends as many requests as one process would;
- on a throttling answer that botocore's retries did not get past, halves the bound, waits (with
  jitter) and tries again, up to ``s3.throttle_retries`` times, so a throttled process slows down
  instead of failing; the version's ``s3.deadline_s`` still bounds the whole write;
- after each success, raises the bound again by one every ``limit`` successes (additive increase,
  multiplicative decrease, as TCP does), up to the configured bound.

A multi-rank job slows every rank when any of them was throttled (:meth:`Pacer.slow_down`, called
by the group's coordinator after each version), since they all share the store's prefixes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Pacer:
    """Bounds and paces the data requests of one S3 tier.

    Args:
        limit: Most requests in flight (``s3.max_concurrency``).
        retries: Extra tries of a throttled request after botocore's own (``s3.throttle_retries``).
        backoff_cap: Longest wait, in seconds, before trying a throttled request again.
    """

    def __init__(self, limit: int, retries: int, backoff_cap: float = 5.0) -> None:
        self._cv = threading.Condition()
        self._configured = limit
        self._max = limit
        self._limit = limit
        self._inflight = 0
        self._streak = 0
        self._retries = retries
        self._cap = backoff_cap
        self._throttled = 0
        self.throttled_total = 0

    def share(self, ranks: int) -> None:
        """Share the configured bound among ``ranks`` processes of one node (at least one request each)."""
        with self._cv:
            self._max = max(1, self._configured // max(1, ranks))
            self._limit = min(self._limit, self._max)
            self._cv.notify_all()

    @property
    def limit(self) -> int:
        """The current bound of requests in flight."""
        with self._cv:
            return self._limit

    def run(self, fn: Callable[[], T], throttled: Callable[[BaseException], bool]) -> T:
        """Call ``fn`` within the bound; retry it while it fails with an error ``throttled`` accepts.

        Raises:
            BaseException: ``fn``'s error when it is not a throttle, or after the last retry.
        """
        for attempt in range(self._retries + 1):
            self._acquire()
            try:
                result = fn()
            except BaseException as e:
                self._release()
                if attempt == self._retries or not throttled(e):
                    raise
                self._on_throttle()
                time.sleep(random.uniform(0.5, 1.0) * min(self._cap, 0.1 * 2**attempt))
                continue
            self._release(success=True)
            return result
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def slow_down(self) -> None:
        """Halve the bound (the group was throttled somewhere), as if this process had been."""
        with self._cv:
            self._limit = max(1, self._limit // 2)
            self._streak = 0

    def take_throttled(self) -> int:
        """Throttled answers since the last call (the group's coordinator sums them)."""
        with self._cv:
            n, self._throttled = self._throttled, 0
            return n

    def _acquire(self) -> None:
        with self._cv:
            while self._inflight >= self._limit:
                self._cv.wait()
            self._inflight += 1

    def _release(self, *, success: bool = False) -> None:
        with self._cv:
            self._inflight -= 1
            if success and self._limit < self._max:
                self._streak += 1
                if self._streak >= self._limit:
                    self._limit += 1
                    self._streak = 0
            self._cv.notify_all()

    def _on_throttle(self) -> None:
        with self._cv:
            self._throttled += 1
            self.throttled_total += 1
            self._limit = max(1, self._limit // 2)
            self._streak = 0
