"""The compression probe: each codec measured on a sample of a version before the policy places it.

The default policy compresses for a tier only when :func:`~tiercache.policy.builtin.compression_wins`
on the codec's measured speed and ratio and the tier's measured speed. A fresh cache has measured
neither; it used to encode its whole first version for the slowest tier to find out, which slowed
that version's write and read (1 GiB of random floats to S3: 1.61x the write-through time, its
restore 1.97x, for 868 MB stored of 1074 MB). Now, while the codec the policy would choose for a
version is unmeasured, the engine encodes the first MiB of each of the version's first few chunks
with it (at most 1/512 of the version, or 1 MiB) before placing it: the sample gives the ratio and the
encode speed, and the version itself goes out raw (docs/design.md, section 5).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tiercache import codecs
from tiercache.policy.meter import ThroughputMeter

#: Chunks sampled, from the first on (the first ones are copied first, so the probe waits least).
PROBE_CHUNKS = 4
#: Bytes sampled from the start of each.
PROBE_BYTES = 1 << 20
#: At most this share of a version is sampled (but :data:`PROBE_MIN` at least): encoding runs 10-30x
#: slower than a fast disk writes, so a larger sample would slow the version's write by more than 10%.
PROBE_SHARE = 512
#: The smallest sample: timing a smaller one on a busy machine measures the scheduler, not the codec.
PROBE_MIN = 1 << 20


def unmeasured(meter: ThroughputMeter) -> list[str]:
    """The codecs (other than raw) the meter has no ratio or encode speed for yet."""
    out = []
    for name in codecs.codec_names():
        stats = meter.codec_stats(name)
        if name != codecs.RAW and (stats is None or stats.ratio is None or stats.encode_bps is None):
            out.append(name)
    return out


def sample_sizes(chunk_nbytes: Sequence[int], version_nbytes: int) -> list[int]:
    """Bytes to sample from the start of each of the first chunks (a prefix of ``chunk_nbytes``)."""
    budget = max(version_nbytes // PROBE_SHARE, PROBE_MIN)
    out: list[int] = []
    for n in chunk_nbytes[:PROBE_CHUNKS]:
        take = min(n, PROBE_BYTES, budget)
        if take <= 0:
            break
        out.append(take)
        budget -= take
    return out


def measure(meter: ThroughputMeter, names: Sequence[str], samples: Sequence[tuple[memoryview, int]]) -> None:
    """Encode every sample ``(raw bytes, itemsize)`` with each codec of ``names``; record what it took."""
    for name in names:
        for data, itemsize in samples:
            data = data[: data.nbytes - data.nbytes % itemsize]
            if not data.nbytes:
                continue
            t0 = time.perf_counter()
            payload = codecs.encode(name, data, itemsize=itemsize)
            meter.record_codec(name, data.nbytes, len(payload), time.perf_counter() - t0)
