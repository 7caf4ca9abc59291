"""How the engine logs the policy's skips: at INFO, and summarised when they repeat.

A skip is the policy's ordinary choice, not a failure: ``throughput-adaptive`` coalesces the
uploads of a job that saves faster than S3 absorbs, so it skips S3 for most versions, and a
multi-rank version is skipped on a tier for every rank once one rank's policy skipped it there
(the group's verdict). One line per skipped version would bury the log, so per tier the first
skip is logged as it comes, and the ones after it within :data:`EVERY` seconds are counted and
logged as one line with the count and the newest reason, once a skip comes after that time (or
the engine closes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tiercache.pipeline.skips")

#: Seconds over which repeated skips of a tier are logged as one line.
EVERY = 60.0


@dataclass
class _Window:
    opened: float
    count: int = 0
    version: str = ""
    reason: str = ""


class SkipLog:
    """Logs the skips of each tier at INFO: the first at once, then one summary line per :data:`EVERY` seconds.

    Args:
        every: Seconds a summary covers.
        clock: Monotonic seconds (tests pass a fake one).
    """

    def __init__(self, every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def skipped(self, tier: str, version: str, reason: str) -> None:
        """Note that ``version`` was skipped for ``tier`` because of ``reason`` (logged or counted)."""
        now = self._clock()
        with self._lock:
            w = self._windows.get(tier)
            if w is None or (w.count == 0 and now - w.opened >= self._every):
                self._windows[tier] = _Window(now)
                line = None
            elif now - w.opened < self._every:
                w.count, w.version, w.reason = w.count + 1, version, reason
                return
            else:  # a window with skips in it is over: this skip closes it
                line = (tier, w.count + 1, now - w.opened)
                self._windows[tier] = _Window(now)
        if line is None:
            log.info("version %s skipped for %s: %s", version, tier, reason)
        else:
            self._summary(*line, version, reason)

    def flush(self) -> None:
        """Log the skips counted and not yet logged (the engine closes)."""
        now = self._clock()
        with self._lock:
            lines = [(tier, w.count, now - w.opened, w.version, w.reason) for tier, w in self._windows.items()
                     if w.count]
            self._windows.clear()
        for line in lines:
            self._summary(*line)

    @staticmethod
    def _summary(tier: str, count: int, seconds: float, version: str, reason: str) -> None:
        log.info("%d more version(s) skipped for %s in the last %.0f s, the newest %s: %s", count, tier, seconds,
                 version, reason)


__all__ = ["EVERY", "SkipLog"]
