"""Which durable tiers answer now, and noticing when one that did not answers again.

A tier whose write or open check fails with an outage error (unreachable, timed out, refused
credentials, out of space, an I/O error) is marked *down*: the policy sees it as unavailable
(``TierStats.available``), the engine fails that tier's level for new versions at once with the
reason instead of waiting on timeouts, and reads stop trying it. While any tier is down, one
background thread probes it every ``interval`` seconds with the tier's cheap, read-only
:meth:`~tiercache.tiers.base.Tier.probe`; when the probe answers, the tier is *up* again and the
``on_up`` callback runs (the engine then catches the tier up with the newest version of each
branch and every tag).

An outage is logged once when it starts (a warning naming the tier and the error) and once when
it ends, never per version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from tiercache.errors import StorageError
from tiercache.tiers.base import Tier

log = logging.getLogger("tiercache.health")

#: Errors that mean "this tier cannot take writes now" rather than "this request was wrong"
#: (unreachable, deadline passed, credentials refused, full, I/O error: every StorageError).
OUTAGES: tuple[type[BaseException], ...] = (StorageError,)


@dataclass(frozen=True)
class Outage:
    """Why a tier is down and since when.

    Attributes:
        since: Unix time the outage was noticed.
        reason: The error that started it, as ``Type: message``.
    """

    since: float
    reason: str

    @property
    def clock(self) -> str:
        """When it was noticed, as ``HH:MM:SS UTC`` (for messages)."""
        return datetime.fromtimestamp(self.since, UTC).strftime("%H:%M:%S UTC")


def is_outage(err: BaseException) -> bool:
    """Whether ``err``, raised by a tier, means the tier is down (as opposed to a conflict or bad input)."""
    return isinstance(err, OUTAGES)


class TierHealth:
    """Up/down state of the durable tiers of one cache, with probes of the down ones.

    Thread-safe; the probe thread starts with the first outage and ends when every tier is up
    or :meth:`close` is called.

    Args:
        tiers: The durable tiers by name (each probed with its ``probe()`` while down).
        interval: Seconds between probes of a down tier.
        on_up: Called with a tier's name (on the probe thread) when it answers again.
    """

    def __init__(
        self, tiers: Mapping[str, Tier], *, interval: float = 5.0, on_up: Callable[[str], None] | None = None
    ) -> None:
        self._tiers = dict(tiers)
        self._interval = interval
        self._on_up = on_up
        self._down: dict[str, Outage] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def set_on_up(self, callback: Callable[[str], None]) -> None:
        """Set the callback run when a down tier answers again."""
        self._on_up = callback

    def available(self, name: str) -> bool:
        """Whether tier ``name`` is believed to answer now."""
        with self._cv:
            return name not in self._down

    def outage(self, name: str) -> Outage | None:
        """The current outage of tier ``name``, or ``None`` while it is up."""
        with self._cv:
            return self._down.get(name)

    def down(self) -> dict[str, Outage]:
        """Every tier that is down now, with its outage."""
        with self._cv:
            return dict(self._down)

    def mark_down(self, name: str, err: BaseException, *, note: str = "") -> None:
        """Record that tier ``name`` failed with ``err`` and start probing it (logged once per outage).

        Args:
            name: The tier.
            err: What failed.
            note: What happens meanwhile, for the log line (default: versions go to the others).
        """
        reason = f"{type(err).__name__}: {err}"
        with self._cv:
            if self._closed or name in self._down:
                return
            self._down[name] = Outage(time.time(), reason)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._probe_loop, name="tiercache-probe", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        log.warning("tier %s is unavailable (%s): %s", name, reason,
                    note or f"versions go on to the other tiers; probing it every {self._interval:g}s")

    def mark_up(self, name: str) -> bool:
        """Record that tier ``name`` answers again; return whether it was down."""
        with self._cv:
            was = self._down.pop(name, None)
            self._cv.notify_all()
        if was is None:
            return False
        log.warning("tier %s is available again after %.0fs", name, time.time() - was.since)
        return True

    def note_success(self, name: str) -> None:
        """A write to tier ``name`` succeeded: if it was down, it is up again (and ``on_up`` runs, on a thread)."""
        if name in self._down and self.mark_up(name) and self._on_up is not None:
            threading.Thread(target=self._on_up, args=(name,), name=f"tiercache-up-{name}", daemon=True).start()

    def probe_now(self, name: str) -> bool:
        """Probe tier ``name`` once now; mark it up or down accordingly and return whether it answered."""
        try:
            self._tiers[name].probe()
        except OUTAGES as e:
            self.mark_down(name, e)
            return False
        if self.mark_up(name) and self._on_up is not None:
            self._on_up(name)
        return True

    def _probe_loop(self) -> None:
        while True:
            with self._cv:
                if self._closed or not self._down:
                    self._thread = None
                    return
                self._cv.wait(self._interval)
                if self._closed:
                    self._thread = None
                    return
                names = list(self._down)
            for name in names:
                try:
                    self.probe_now(name)
                except Exception as e:  # a failing callback must not stop the probes
                    log.error("after tier %s came back: %s", name, e)

    def close(self) -> None:
        """Stop probing (the cache is closing)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, self._interval))
