"""How big the RAM arena and the disk must be, and what S3's bandwidth gives, for a state size and save interval.

The formulas of docs/config.md ("Sizing"), as pure functions; ``tiercache plan`` prints them from
what the cache measured. With ``S`` the bytes of one version, ``T`` the save interval (seconds from
one save to the next), ``Wd`` and ``Ws`` the write speeds of the first durable tier (the disk,
else S3) and of S3 (bytes/s) and ``K`` the versions a retention keeps on the disk:

* the arena holds the version being copied in plus those the first durable tier has not
  written yet: ``n = ceil((S / Wd) / T)`` of them, so ``[ram] capacity >= S (1 + n)``, at least
  ``2 S``; below that, ``save()`` waits for the disk;
* the disk holds the ``K`` versions the retention keeps, one being written and, with S3, one
  waiting for S3: ``[disk] capacity >= S (K + 1 + 1)`` (without S3, ``S (K + 1)``); dedup makes
  it less where versions share chunks;
* S3 takes every version when an upload fits in an interval (``Ws >= S / T``); otherwise the
  policy coalesces and S3 gets one version in ``ceil((S / Ws) / T)``, each at most ``2 S / Ws``
  after its save (it waits for at most one upload in progress); with ``Ws >= S / T`` the remote
  lag is ``S / Ws``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sizing:
    """The advice for one state size and save interval (bytes, seconds; ``None``: not known).

    Attributes:
        state_bytes: ``S``, bytes of one version.
        interval_s: ``T``, seconds between saves.
        first_write_bps: ``Wd``, write speed of the first durable tier, or ``None``.
        s3_write_bps: ``Ws``, S3's write speed, or ``None`` (no S3, or not measured).
        keep: ``K``, versions a retention keeps on the disk, or ``None`` (no retention).
        has_s3: Whether the cache has an S3 tier.
    """

    state_bytes: int
    interval_s: float
    first_write_bps: float | None
    s3_write_bps: float | None
    keep: int | None
    has_s3: bool

    @property
    def in_flight(self) -> int:
        """Versions the arena holds besides the one being copied in (at least 1)."""
        if not self.first_write_bps or self.interval_s <= 0:
            return 1
        return max(1, math.ceil(self.state_bytes / self.first_write_bps / self.interval_s))

    @property
    def arena_bytes(self) -> int:
        """Smallest ``[ram] capacity`` at which ``save()`` does not wait for the first durable tier."""
        return self.state_bytes * (1 + self.in_flight)

    @property
    def disk_bytes(self) -> int | None:
        """Smallest ``[disk] capacity`` that holds what the retention keeps, or ``None`` without a retention."""
        if self.keep is None:
            return None
        return self.state_bytes * (self.keep + 1 + (1 if self.has_s3 else 0))

    @property
    def s3_needed_bps(self) -> float:
        """S3 write speed at which every version reaches S3 (``S / T``)."""
        return self.state_bytes / self.interval_s if self.interval_s > 0 else math.inf

    @property
    def s3_every(self) -> int | None:
        """S3 gets one version in this many saves (1: every one), or ``None`` if its speed is not known."""
        if not self.s3_write_bps or self.interval_s <= 0:
            return None
        return max(1, math.ceil(self.state_bytes / self.s3_write_bps / self.interval_s))

    @property
    def s3_lag_s(self) -> float | None:
        """Longest time from a save until S3 holds that version or a newer one, or ``None``."""
        every = self.s3_every
        if every is None or not self.s3_write_bps:
            return None
        upload = self.state_bytes / self.s3_write_bps
        return upload if every == 1 else 2 * upload


__all__ = ["Sizing"]
