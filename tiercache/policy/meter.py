"""ThroughputMeter: observed bytes/s per tier and direction, and codec speed and ratio.

The engine feeds it every chunk transfer and every chunk it encodes or decodes; the policy reads
the smoothed numbers through :class:`~tiercache.policy.base.PolicyContext`.

How the smoothing works. Each series keeps two exponentially decayed sums, bytes ``B`` and
seconds ``S``; an observation first multiplies both by ``d = 2 ** (-1 / half_life)`` and then adds
its own bytes and seconds, and the rate is ``B / S``. So:

* the half-life is counted in observations (transfers), not in wall-clock time: a tier that
  suddenly changes speed moves the estimate halfway to the new speed after ``half_life``
  transfers (3 by default), three quarters after twice that, whatever the gaps between
  transfers (the engine writes in bursts, so clock-based decay would forget a tier between two
  checkpoints and trust the first transfer of the next one alone);
* within that window each transfer weighs by its duration: ``S / B`` is the byte-weighted mean of
  seconds per byte, exactly what predicts how long the next N bytes take, and a constant speed
  reads back as exactly that speed whatever the transfer sizes;
* after a step change, with equal-sized transfers, the estimate moves monotonically from the old
  speed to the new one, never overshooting.

Codec ratios are smoothed the same way (decayed raw bytes over decayed encoded bytes).

**Latency plus bandwidth.** Bytes over seconds misranks tiers when transfers are small: a disk
that fsyncs a 1 MiB version spends most of its time in the fsync, so its bytes/s look lower
than an object store's that does not, although the disk is faster for anything large. So each
series also fits ``seconds = requests * latency + bytes / bandwidth`` by least squares over the
same decayed observations (a transfer of ``requests`` round trips moving ``bytes``). The engine
records a version's bulk chunk writes and its commit (manifest and ref: small, latency-bound) as
separate observations, so both terms are seen; :meth:`ThroughputMeter.predict` then says how long
a given number of bytes would take, which is what decisions that compare tiers compare. While the
observations cannot separate the terms (all of one shape), the model falls back to no latency
and the plain rate.
The meter also keeps the last :data:`HISTORY_LEN` transfers as they were observed (wall-clock time,
tier, direction, bytes, seconds), so a viewer can draw throughput over time; that history goes
into :meth:`ThroughputMeter.snapshot` and comes back with :meth:`ThroughputMeter.seed`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

Direction = Literal["read", "write"]

DEFAULT_HALF_LIFE = 3.0
"""Observations after which an old speed weighs half as much as it did."""

_DIRECTIONS: tuple[Direction, ...] = ("read", "write")

HISTORY_LEN = 256
"""Most recent transfers the meter remembers one by one (its history; older ones only count in the EWMA)."""


@dataclass(frozen=True)
class CodecStats:
    """Observed behaviour of one codec on recent chunks.

    Attributes:
        encode_bps: Smoothed encode speed in raw bytes per second, or ``None`` if no encode has
            taken measurable time yet.
        decode_bps: Smoothed decode speed in raw bytes per second, or ``None`` if no decode time
            has been recorded yet.
        ratio: Smoothed compression ratio, raw bytes per encoded byte (2.0 halves the size), or
            ``None`` while no encoded bytes have been seen.
        chunks: Chunks recorded since the last reset.
        raw_bytes: Total raw bytes recorded.
        encoded_bytes: Total encoded bytes recorded.
    """

    encode_bps: float | None
    decode_bps: float | None
    ratio: float | None
    chunks: int
    raw_bytes: int
    encoded_bytes: int


class _Ewma:
    """A pair of exponentially decayed sums whose quotient is the smoothed value."""

    __slots__ = ("den", "num")

    def __init__(self) -> None:
        self.num = 0.0
        self.den = 0.0

    def add(self, num: float, den: float, decay: float) -> None:
        self.num = self.num * decay + num
        self.den = self.den * decay + den

    def value(self) -> float | None:
        return self.num / self.den if self.den > 0 else None


@dataclass(frozen=True)
class LinkModel:
    """A tier's speed in one direction as per-request latency plus bandwidth.

    Attributes:
        latency_s: Seconds each request costs on top of moving its bytes (>= 0).
        bps: Bytes per second once moving.
    """

    latency_s: float
    bps: float

    def seconds(self, nbytes: int, requests: int = 1) -> float:
        """Predicted seconds to move ``nbytes`` in ``requests`` round trips."""
        return requests * self.latency_s + nbytes / self.bps


#: Relative size of the 2x2 determinant below which the observations cannot tell latency from
#: bandwidth (they are all of one shape: same bytes per request).
_DEGENERATE = 1e-9
#: Fastest bandwidth a fit may report (1 TB/s): a fit whose byte term vanishes in the noise
#: means "latency-bound", not "infinitely fast".
_MAX_BPS = 1e12


class _LeastSquares:
    """Decayed least squares of ``seconds ~ requests * latency + bytes * (1 / bandwidth)``."""

    __slots__ = ("nn", "nt", "rn", "rr", "rt")

    def __init__(self) -> None:
        self.rr = self.rn = self.nn = self.rt = self.nt = 0.0

    def add(self, requests: float, nbytes: float, seconds: float, decay: float) -> None:
        self.rr = self.rr * decay + requests * requests
        self.rn = self.rn * decay + requests * nbytes
        self.nn = self.nn * decay + nbytes * nbytes
        self.rt = self.rt * decay + requests * seconds
        self.nt = self.nt * decay + nbytes * seconds

    def model(self, fallback_bps: float | None) -> LinkModel | None:
        det = self.rr * self.nn - self.rn * self.rn
        if self.nn > 0 and self.rr > 0 and det > _DEGENERATE * self.rr * self.nn:
            latency = (self.rt * self.nn - self.nt * self.rn) / det
            per_byte = (self.rr * self.nt - self.rn * self.rt) / det
            if latency >= 0 and per_byte > 0:
                return LinkModel(latency, min(1.0 / per_byte, _MAX_BPS))
            if latency < 0 and self.nt > 0:  # no measurable latency: bandwidth alone
                return LinkModel(0.0, min(self.nn / self.nt, _MAX_BPS))
            if per_byte <= 0 and self.rt > 0:  # no measurable byte cost: latency alone
                return LinkModel(self.rt / self.rr, _MAX_BPS)
        if fallback_bps is None:
            return None
        return LinkModel(0.0, fallback_bps)


class _TransferSeries:
    """One (tier, direction): the smoothed rate, the latency/bandwidth fit and the plain totals."""

    __slots__ = ("fit", "rate", "total_bytes", "total_seconds", "transfers")

    def __init__(self) -> None:
        self.rate = _Ewma()
        self.fit = _LeastSquares()
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.transfers = 0


class _CodecSeries:
    """One codec: smoothed encode speed, decode speed and ratio, and the plain totals."""

    __slots__ = ("chunks", "decode", "encode", "encoded_bytes", "ratio", "raw_bytes")

    def __init__(self) -> None:
        self.encode = _Ewma()
        self.decode = _Ewma()
        self.ratio = _Ewma()
        self.chunks = 0
        self.raw_bytes = 0
        self.encoded_bytes = 0

    def stats(self) -> CodecStats:
        return CodecStats(
            encode_bps=self.encode.value(),
            decode_bps=self.decode.value(),
            ratio=self.ratio.value(),
            chunks=self.chunks,
            raw_bytes=self.raw_bytes,
            encoded_bytes=self.encoded_bytes,
        )


def _positive(value: object) -> float | None:
    """``value`` as a positive finite float, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _history_entry(item: object) -> tuple[float, str, Direction, int, float] | None:
    """One history entry of a snapshot as the meter keeps it, or ``None`` if it is malformed."""
    if not isinstance(item, Mapping):
        return None
    t, tier, direction = _positive(item.get("t")), item.get("tier"), item.get("direction")
    nbytes, seconds = item.get("bytes"), item.get("seconds")
    if t is None or not isinstance(tier, str) or direction not in _DIRECTIONS:
        return None
    try:
        _check_count("bytes", nbytes)  # type: ignore[arg-type]
        _check_seconds("seconds", seconds)  # type: ignore[arg-type]
    except ValueError:
        return None
    return t, tier, direction, nbytes, float(seconds)  # type: ignore[arg-type]


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


class ThroughputMeter:
    """Thread-safe EWMA of observed throughput per tier and direction, and of codec behaviour.

    Every method may be called from any thread; each takes one short lock.

    Args:
        half_life: Observations after which an old measurement weighs half (see the module
            docstring for why it counts observations rather than seconds).

    Raises:
        ValueError: If ``half_life`` is not a positive finite number.
    """

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE) -> None:
        if not (isinstance(half_life, int | float) and math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"half_life must be a positive number of observations, got {half_life!r}")
        self._half_life = float(half_life)
        self._decay = 2.0 ** (-1.0 / self._half_life)
        self._lock = threading.Lock()
        self._transfers: dict[tuple[str, Direction], _TransferSeries] = {}
        self._codecs: dict[str, _CodecSeries] = {}
        # (wall time at the end, tier, direction, bytes, seconds) of the newest transfers
        self._history: deque[tuple[float, str, Direction, int, float]] = deque(maxlen=HISTORY_LEN)

    @property
    def half_life(self) -> float:
        """Observations after which an old measurement weighs half."""
        return self._half_life

    def record(self, tier: str, direction: Direction, nbytes: int, seconds: float, requests: int = 1) -> None:
        """Record one transfer of ``nbytes`` to or from ``tier`` that took ``seconds``.

        A transfer of zero measured seconds counts in the totals but cannot give a rate on its
        own; :meth:`rate` stays ``None`` until some transfer took measurable time.

        Args:
            tier: Tier name.
            direction: ``"read"`` or ``"write"``.
            nbytes: Bytes moved.
            seconds: Wall-clock duration of the transfer.
            requests: Round trips the transfer waited for one after another (a commit of a
                manifest and a ref is 2; many puts in parallel count as one).

        Raises:
            ValueError: If ``direction`` is unknown or a count or duration is negative or not finite.
        """
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be 'read' or 'write', got {direction!r}")
        _check_count("nbytes", nbytes)
        _check_seconds("seconds", seconds)
        _check_count("requests", requests)
        with self._lock:
            series = self._transfers.get((tier, direction))
            if series is None:
                series = self._transfers[(tier, direction)] = _TransferSeries()
            series.rate.add(nbytes, seconds, self._decay)
            series.fit.add(requests, nbytes, seconds, self._decay)
            series.total_bytes += nbytes
            series.total_seconds += seconds
            series.transfers += 1
            self._history.append((time.time(), tier, direction, nbytes, seconds))

    def record_codec(
        self,
        codec: str,
        raw_bytes: int,
        encoded_bytes: int,
        encode_seconds: float,
        decode_seconds: float | None = None,
    ) -> None:
        """Record one chunk passed through ``codec``.

        Args:
            codec: Codec descriptor (``"zstd/1"``...).
            raw_bytes: The chunk's raw length.
            encoded_bytes: Its encoded length.
            encode_seconds: Time spent encoding it.
            decode_seconds: Time spent decoding it, when measured (e.g. a restore, or a trial
                decode); leaves the decode speed untouched when ``None``.

        Raises:
            ValueError: If a count or duration is negative or not finite.
        """
        _check_count("raw_bytes", raw_bytes)
        _check_count("encoded_bytes", encoded_bytes)
        _check_seconds("encode_seconds", encode_seconds)
        if decode_seconds is not None:
            _check_seconds("decode_seconds", decode_seconds)
        with self._lock:
            series = self._codecs.get(codec)
            if series is None:
                series = self._codecs[codec] = _CodecSeries()
            series.encode.add(raw_bytes, encode_seconds, self._decay)
            series.ratio.add(raw_bytes, encoded_bytes, self._decay)
            if decode_seconds is not None:
                series.decode.add(raw_bytes, decode_seconds, self._decay)
            series.chunks += 1
            series.raw_bytes += raw_bytes
            series.encoded_bytes += encoded_bytes

    def rate(self, tier: str, direction: Direction) -> float | None:
        """Return the smoothed bytes/s of ``tier`` in ``direction``, or ``None`` until observed."""
        with self._lock:
            series = self._transfers.get((tier, direction))
            return None if series is None else series.rate.value()

    def model(self, tier: str, direction: Direction) -> LinkModel | None:
        """Return ``tier``'s fitted latency and bandwidth in ``direction``, or ``None`` until observed."""
        with self._lock:
            series = self._transfers.get((tier, direction))
            return None if series is None else series.fit.model(series.rate.value())

    def predict(self, tier: str, direction: Direction, nbytes: int, requests: int = 1) -> float | None:
        """Predicted seconds to move ``nbytes`` to or from ``tier`` in ``requests`` round trips.

        Returns:
            The estimate, or ``None`` while ``tier`` has not been observed in that direction.
        """
        m = self.model(tier, direction)
        return None if m is None else m.seconds(nbytes, requests)

    def codec_stats(self, codec: str) -> CodecStats | None:
        """Return what was observed for ``codec``, or ``None`` if it was never recorded."""
        with self._lock:
            series = self._codecs.get(codec)
            return None if series is None else series.stats()

    def snapshot(self) -> dict[str, Any]:
        """Return everything observed as plain JSON-able data.

        Returns:
            ``{"half_life": h, "tiers": {tier: {direction: {"bps", "latency_s", "bandwidth_bps",
            "total_bytes", "total_seconds", "transfers"}}}, "codecs": {codec: {"encode_bps",
            "decode_bps", "ratio", "chunks", "raw_bytes", "encoded_bytes"}}}``, sorted by name;
            ``bps`` is the plain smoothed rate, ``latency_s`` and ``bandwidth_bps`` the fitted
            model (see the module docstring); speeds and ratios are ``None`` where nothing
            measurable was seen. ``"history": [{"t", "tier", "direction", "bytes", "seconds"}]``
            holds the last transfers, oldest first (``t`` the Unix time the transfer ended).
        """
        with self._lock:
            tiers: dict[str, dict[str, dict[str, Any]]] = {}
            for (tier, direction), series in sorted(self._transfers.items()):
                rate = series.rate.value()
                fit = series.fit.model(rate)
                tiers.setdefault(tier, {})[direction] = {
                    "bps": rate,
                    "latency_s": fit.latency_s if fit else None,
                    "bandwidth_bps": fit.bps if fit else None,
                    "total_bytes": series.total_bytes,
                    "total_seconds": series.total_seconds,
                    "transfers": series.transfers,
                }
            codecs = {name: asdict(series.stats()) for name, series in sorted(self._codecs.items())}
            history = [{"t": t, "tier": tier, "direction": d, "bytes": n, "seconds": s}
                       for t, tier, d, n, s in self._history]
        return {"half_life": self._half_life, "tiers": tiers, "codecs": codecs, "history": history}

    def seed(self, snapshot: Mapping[str, Any]) -> None:
        """Start from the speeds and ratios of an earlier :meth:`snapshot` (another process's).

        Each known rate counts as one observation, so the first real transfers quickly take
        over; the totals stay at zero, as they count only what this process moved. A fitted
        latency and bandwidth are seeded as two observations that pin them (one request of no
        bytes, one second of bytes with no request). The history is taken as it was, older than
        anything this process records. Entries that are malformed are ignored: a seed is a hint,
        never a reason to fail.
        """
        with self._lock:
            seeded = [h for h in map(_history_entry, list(snapshot.get("history") or ())) if h is not None]
            room = HISTORY_LEN - len(self._history)
            if room > 0:
                self._history.extendleft(reversed(seeded[-room:]))
            for tier, directions in dict(snapshot.get("tiers") or {}).items():
                for direction, info in dict(directions or {}).items():
                    info = dict(info or {})
                    bps = _positive(info.get("bps"))
                    if direction in _DIRECTIONS and bps is not None and isinstance(tier, str):
                        series = self._transfers.setdefault((tier, direction), _TransferSeries())
                        series.rate.add(bps, 1.0, self._decay)
                        band = _positive(info.get("bandwidth_bps"))
                        latency = info.get("latency_s")
                        if band is not None and (latency == 0 or _positive(latency) is not None):
                            series.fit.add(1.0, 0.0, float(latency), self._decay)
                            series.fit.add(0.0, band, 1.0, self._decay)
            for codec, info in dict(snapshot.get("codecs") or {}).items():
                info = dict(info or {})
                enc, dec, ratio = (_positive(info.get(k)) for k in ("encode_bps", "decode_bps", "ratio"))
                if not isinstance(codec, str) or enc is None or ratio is None:
                    continue
                series = self._codecs.setdefault(codec, _CodecSeries())
                series.encode.add(enc, 1.0, self._decay)
                series.ratio.add(ratio, 1.0, self._decay)
                if dec is not None:
                    series.decode.add(dec, 1.0, self._decay)

    def reset(self) -> None:
        """Forget every observation."""
        with self._lock:
            self._transfers.clear()
            self._codecs.clear()
            self._history.clear()


__all__ = ["DEFAULT_HALF_LIFE", "HISTORY_LEN", "CodecStats", "Direction", "LinkModel", "ThroughputMeter"]
