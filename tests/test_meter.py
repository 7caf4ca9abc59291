"""ThroughputMeter on synthetic sequences: exact values where the arithmetic allows them."""

from __future__ import annotations

import json
import threading

import pytest

from tiercache.policy.meter import DEFAULT_HALF_LIFE, HISTORY_LEN, CodecStats, LinkModel, ThroughputMeter

MIB = 1 << 20


def _expected_after_step(
    old_rate: float, new_rate: float, n_old: int, k_new: int, nbytes: int, h: float
) -> float:
    """Closed form of the smoothed rate after n_old equal transfers at old_rate, then k_new at new_rate."""
    d = 2.0 ** (-1.0 / h)
    old_weight = d**k_new * sum(d**j for j in range(n_old))
    new_weight = sum(d**j for j in range(k_new))
    return (
        nbytes * (old_weight + new_weight) / (nbytes / old_rate * old_weight + nbytes / new_rate * new_weight)
    )


def test_nothing_observed_reads_as_none() -> None:
    meter = ThroughputMeter()
    assert meter.rate("disk", "write") is None
    assert meter.codec_stats("zstd/1") is None
    assert meter.snapshot() == {"half_life": DEFAULT_HALF_LIFE, "tiers": {}, "codecs": {}, "history": []}


def test_first_transfer_gives_its_own_rate() -> None:
    meter = ThroughputMeter()
    meter.record("s3", "write", 300, 0.5)
    assert meter.rate("s3", "write") == 600.0
    assert meter.rate("s3", "read") is None
    assert meter.rate("disk", "write") is None


@pytest.mark.parametrize("half_life", [0.5, 1.0, 3.0, 10.0])
def test_constant_rate_reads_back_exactly_whatever_the_sizes(half_life: float) -> None:
    meter = ThroughputMeter(half_life=half_life)
    rate = float(1 << 30)
    # Durations that are binary fractions keep bytes = rate * seconds an exact integer, and a
    # power-of-two rate keeps every step of the smoothing exact, so equality is exact too.
    for seconds in [1 / 1024, 0.25, 37 / 1024, 3.5, 1 / 4096, 1.0] * 5:
        meter.record("disk", "write", int(rate * seconds), seconds)
        assert meter.rate("disk", "write") == rate


def test_step_change_matches_the_closed_form_and_moves_monotonically() -> None:
    meter = ThroughputMeter(half_life=3.0)
    nbytes = 64 * MIB
    for _ in range(20):
        meter.record("s3", "write", nbytes, nbytes / 1e9)
    assert meter.rate("s3", "write") == pytest.approx(1e9, rel=1e-12)
    previous = meter.rate("s3", "write")
    for k in range(1, 31):
        meter.record("s3", "write", nbytes, nbytes / 1e8)
        current = meter.rate("s3", "write")
        assert current == pytest.approx(_expected_after_step(1e9, 1e8, 20, k, nbytes, 3.0), rel=1e-12)
        assert 1e8 < current < previous
        previous = current


def test_a_step_up_converges_monotonically_too() -> None:
    meter = ThroughputMeter(half_life=2.0)
    for _ in range(10):
        meter.record("disk", "read", MIB, MIB / 1e8)
    rates = []
    for _ in range(15):
        meter.record("disk", "read", MIB, MIB / 2e9)
        rates.append(meter.rate("disk", "read"))
    assert rates == sorted(rates)
    assert len(set(rates)) == len(rates)
    assert rates[-1] < 2e9


def test_a_change_shows_up_within_a_few_transfers() -> None:
    # After half_life transfers at the new speed the seconds-per-byte estimate is at least half way
    # to the new speed's, however long the old history.
    meter = ThroughputMeter()
    for _ in range(1000):
        meter.record("s3", "write", MIB, MIB / 1e9)
    for _ in range(int(DEFAULT_HALF_LIFE)):
        meter.record("s3", "write", MIB, MIB / 1e8)
    seconds_per_byte = 1 / meter.rate("s3", "write")
    assert seconds_per_byte >= (1 / 1e9 + 1 / 1e8) / 2 * (1 - 1e-12)


def test_tiers_and_directions_are_independent() -> None:
    meter = ThroughputMeter()
    meter.record("disk", "write", 1000, 1.0)
    meter.record("disk", "read", 4000, 1.0)
    meter.record("s3", "write", 10, 1.0)
    assert (meter.rate("disk", "write"), meter.rate("disk", "read"), meter.rate("s3", "write")) == (
        1000.0,
        4000.0,
        10.0,
    )
    assert meter.rate("s3", "read") is None


def test_zero_second_transfers_count_but_give_no_rate_alone() -> None:
    meter = ThroughputMeter()
    meter.record("ram", "write", 4096, 0.0)
    assert meter.rate("ram", "write") is None
    meter.record("ram", "write", 4096, 0.5)
    assert meter.rate("ram", "write") == (4096 * 2.0 ** (-1 / DEFAULT_HALF_LIFE) + 4096) / 0.5
    assert meter.snapshot()["tiers"]["ram"]["write"]["transfers"] == 2


def test_codec_stats_constant_behaviour_is_exact() -> None:
    meter = ThroughputMeter()
    for _ in range(7):
        meter.record_codec("bgzstd/1", 64 * MIB, 32 * MIB, encode_seconds=0.125, decode_seconds=0.03125)
    assert meter.codec_stats("bgzstd/1") == CodecStats(
        encode_bps=512.0 * MIB,
        decode_bps=2048.0 * MIB,
        ratio=2.0,
        chunks=7,
        raw_bytes=7 * 64 * MIB,
        encoded_bytes=7 * 32 * MIB,
    )


def test_codec_decode_speed_only_from_records_that_carry_it() -> None:
    meter = ThroughputMeter(half_life=1.0)
    meter.record_codec("zstd/1", 1000, 500, 0.5)
    assert meter.codec_stats("zstd/1").decode_bps is None
    meter.record_codec("zstd/1", 1000, 250, 0.25, decode_seconds=0.1)
    stats = meter.codec_stats("zstd/1")
    # half_life 1: the older record weighs exactly half.
    assert stats.encode_bps == (500 + 1000) / (0.25 + 0.25)
    assert stats.ratio == (500 + 1000) / (250 + 250)
    assert stats.decode_bps == 1000 / 0.1
    assert (stats.chunks, stats.raw_bytes, stats.encoded_bytes) == (2, 2000, 750)


def test_codec_ratio_is_none_without_encoded_bytes() -> None:
    meter = ThroughputMeter()
    meter.record_codec("raw/1", 0, 0, 0.0)
    assert meter.codec_stats("raw/1") == CodecStats(None, None, None, 1, 0, 0)


def test_snapshot_is_json_and_complete() -> None:
    meter = ThroughputMeter(half_life=2.0)
    meter.record("s3", "write", 2048, 2.0)
    meter.record("disk", "write", 1024, 0.5)
    meter.record("disk", "write", 1024, 0.5)
    meter.record_codec("zstd/1", 4096, 1024, 0.5, 0.25)
    snap = meter.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    history = snap.pop("history")
    assert [(h["tier"], h["direction"], h["bytes"], h["seconds"]) for h in history] == [
        ("s3", "write", 2048, 2.0), ("disk", "write", 1024, 0.5), ("disk", "write", 1024, 0.5)]
    assert [h["t"] for h in history] == sorted(h["t"] for h in history)
    assert snap == {
        "half_life": 2.0,
        "tiers": {
            "disk": {"write": {"bps": 2048.0, "latency_s": 0.0, "bandwidth_bps": 2048.0, "total_bytes": 2048,
                               "total_seconds": 1.0, "transfers": 2}},
            "s3": {"write": {"bps": 1024.0, "latency_s": 0.0, "bandwidth_bps": 1024.0, "total_bytes": 2048,
                             "total_seconds": 2.0, "transfers": 1}},
        },
        "codecs": {
            "zstd/1": {
                "encode_bps": 8192.0,
                "decode_bps": 16384.0,
                "ratio": 4.0,
                "chunks": 1,
                "raw_bytes": 4096,
                "encoded_bytes": 1024,
            }
        },
    }
    assert list(snap["tiers"]) == ["disk", "s3"]


def test_reset_forgets_everything() -> None:
    meter = ThroughputMeter()
    meter.record("disk", "read", 10, 1.0)
    meter.record_codec("zstd/1", 10, 5, 1.0)
    meter.reset()
    assert meter.rate("disk", "read") is None
    assert meter.codec_stats("zstd/1") is None
    assert meter.snapshot()["tiers"] == {}
    meter.record("disk", "read", 30, 1.0)
    assert meter.rate("disk", "read") == 30.0


def test_concurrent_records_keep_exact_totals() -> None:
    meter = ThroughputMeter()
    threads_n, per_thread = 8, 2000
    barrier = threading.Barrier(threads_n)

    def worker(index: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            meter.record("disk", "write" if i % 2 else "read", index + 1, 0.5)
            meter.record_codec("zstd/1", 2 * (index + 1), index + 1, 0.25)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = meter.snapshot()
    per_direction_bytes = sum(range(1, threads_n + 1)) * per_thread // 2
    for direction in ("read", "write"):
        assert snap["tiers"]["disk"][direction]["transfers"] == threads_n * per_thread // 2
        assert snap["tiers"]["disk"][direction]["total_bytes"] == per_direction_bytes
        assert snap["tiers"]["disk"][direction]["total_seconds"] == 0.5 * threads_n * per_thread // 2
    codec = meter.codec_stats("zstd/1")
    assert (codec.chunks, codec.raw_bytes, codec.encoded_bytes) == (
        threads_n * per_thread,
        4 * per_direction_bytes,
        2 * per_direction_bytes,
    )
    assert codec.ratio == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("disk", "sideways", 1, 1.0), "direction"),
        (("disk", "read", -1, 1.0), "nbytes"),
        (("disk", "read", 1.5, 1.0), "nbytes"),
        (("disk", "read", 1, -0.1), "seconds"),
        (("disk", "read", 1, float("nan")), "seconds"),
        (("disk", "read", 1, float("inf")), "seconds"),
    ],
)
def test_record_rejects_bad_input(args: tuple, message: str) -> None:
    meter = ThroughputMeter()
    with pytest.raises(ValueError, match=message):
        meter.record(*args)
    assert meter.snapshot()["tiers"] == {}


def test_record_codec_rejects_bad_input() -> None:
    meter = ThroughputMeter()
    with pytest.raises(ValueError, match="encoded_bytes"):
        meter.record_codec("zstd/1", 10, -1, 1.0)
    with pytest.raises(ValueError, match="decode_seconds"):
        meter.record_codec("zstd/1", 10, 5, 1.0, decode_seconds=-1.0)
    assert meter.codec_stats("zstd/1") is None


@pytest.mark.parametrize("half_life", [0, -1.0, float("inf"), float("nan")])
def test_half_life_must_be_positive(half_life: float) -> None:
    with pytest.raises(ValueError, match="half_life"):
        ThroughputMeter(half_life=half_life)


# ---------------------------------------------------------------------- latency plus bandwidth


def test_small_fsynced_writes_fit_as_latency_not_as_a_slow_disk() -> None:
    # A disk of 5 ms per request and 2 GB/s: a 1 MiB version's bulk write (one round of puts)
    # and its commit (manifest + ref: 2 requests of a few KB).
    meter = ThroughputMeter()
    for _ in range(6):
        meter.record("disk", "write", MIB, 0.005 + MIB / 2e9)
        meter.record("disk", "write", 2000, 2 * 0.005 + 2000 / 2e9, requests=2)
    model = meter.model("disk", "write")
    assert model is not None
    assert model.latency_s == pytest.approx(0.005, rel=1e-9)
    assert model.bps == pytest.approx(2e9, rel=1e-6)
    # Its plain rate reads like a slow tier (~60 MB/s), its prediction for 1 GiB does not.
    assert meter.rate("disk", "write") < 100e6
    assert meter.predict("disk", "write", 1 << 30) == pytest.approx(0.005 + (1 << 30) / 2e9, rel=1e-6)
    assert meter.predict("disk", "write", MIB, requests=3) == pytest.approx(0.015 + MIB / 2e9, rel=1e-6)


def test_one_shape_of_transfer_falls_back_to_the_plain_rate() -> None:
    meter = ThroughputMeter()
    for _ in range(4):
        meter.record("s3", "write", 8 * MIB, 0.25)  # latency and bandwidth cannot be told apart
    assert meter.model("s3", "write") == LinkModel(0.0, 32 * MIB)
    assert meter.model("s3", "read") is None and meter.predict("s3", "read", 1) is None


def test_a_latency_bound_tier_fits_as_latency_only() -> None:
    meter = ThroughputMeter()
    for n in (100, 200, 400):
        meter.record("s3", "write", n, 0.02)  # time does not grow with bytes at all
    model = meter.model("s3", "write")
    assert model is not None and model.latency_s == pytest.approx(0.02) and model.bps == 1e12


def test_the_fit_survives_a_snapshot_and_seed() -> None:
    meter = ThroughputMeter()
    for _ in range(5):
        meter.record("disk", "write", 64 * MIB, 0.004 + 64 * MIB / 1e9)
        meter.record("disk", "write", 4096, 0.008 + 4096 / 1e9, requests=2)
    seeded = ThroughputMeter()
    seeded.seed(json.loads(json.dumps(meter.snapshot())))
    got, want = seeded.model("disk", "write"), meter.model("disk", "write")
    assert got is not None and want is not None
    assert got.latency_s == pytest.approx(want.latency_s, rel=1e-6) and got.bps == pytest.approx(want.bps, rel=1e-6)
    # An older snapshot without the fit seeds the plain rate only.
    old = ThroughputMeter()
    old.seed({"tiers": {"disk": {"write": {"bps": 1e8}}}})
    assert old.model("disk", "write") == LinkModel(0.0, 1e8)
def test_history_is_bounded_and_keeps_the_newest() -> None:
    meter = ThroughputMeter()
    for i in range(HISTORY_LEN + 10):
        meter.record("disk", "write", i, 0.5)
    history = meter.snapshot()["history"]
    assert [h["bytes"] for h in history] == list(range(10, HISTORY_LEN + 10))


def test_seed_restores_the_history_before_what_this_process_records() -> None:
    old = ThroughputMeter()
    old.record("s3", "write", 100, 1.0)
    old.record("disk", "read", 200, 2.0)
    snap = json.loads(json.dumps(old.snapshot()))
    snap["history"].insert(0, {"t": "yesterday", "tier": "s3", "direction": "write", "bytes": 1, "seconds": 1})
    snap["history"].append({"t": 5.0, "tier": "s3", "direction": "sideways", "bytes": 1, "seconds": 1})
    new = ThroughputMeter()
    new.record("ram", "write", 300, 0.1)
    new.seed(snap)
    got = [(h["tier"], h["direction"], h["bytes"]) for h in new.snapshot()["history"]]
    assert got == [("s3", "write", 100), ("disk", "read", 200), ("ram", "write", 300)]
    new.reset()
    assert new.snapshot()["history"] == []
