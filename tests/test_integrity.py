"""Every chunk read is verified; damaged or missing copies fall back to another tier; verify/repair.

The cache under test has a disk tier and an S3 tier (the real local server), 64 KiB chunks and a
state of many small tensors, so a few hundred chunk objects exist on each tier. Bits are flipped
in random copies through the tiers' own ``get``/``put`` (so the damage is exactly what a bad disk
or a bad object store would hand back), then restore, ``verify`` and ``verify --repair`` are run.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.cache import TierCache, core_of
from tiercache.codecs import HEADER_BYTES
from tiercache.config import S3Config
from tiercache.errors import IntegrityError
from tiercache.names import chunk_key

pytestmark = pytest.mark.s3

N_FLIPS = 200
_FALLBACK = re.compile(r"chunk ([0-9a-f]+) restored from (\w+) after (\w+): damaged")


def _state(n_tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 48 KiB tensors: one per 64 KiB chunk (below pack_below they are packed one per chunk).
    return {f"layer{i}.w": torch.randn(12 * 1024, generator=g) for i in range(n_tensors)}


@pytest.fixture
def cache(tmp_path: Path, s3_config: S3Config) -> Iterator[TierCache]:
    cfg = {
        "disk": {"path": str(tmp_path / "disk")},
        "s3": s3_config.model_dump(),
        "chunk_bytes": "64KiB",
        "pack_below": "64KiB",
    }
    with tiercache.open(cfg) as c:
        yield c


def _flip(tier: Any, cid: str, rng: random.Random) -> int:
    """Flip one random bit of the stored object (header fields or payload); return its offset."""
    key = chunk_key(cid)
    data = bytearray(tier.get(key))
    off = rng.randrange(len(data))
    data[off] ^= 1 << rng.randrange(8)
    tier.put(key, bytes(data))
    return off


def _fallbacks(caplog: pytest.LogCaptureFixture) -> dict[str, tuple[str, str]]:
    out = {}
    for rec in caplog.records:
        m = _FALLBACK.search(rec.getMessage())
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _prefer(cache: TierCache, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """Pin the reader's tier order (it otherwise follows measured speeds, which change as it reads)."""
    reader = core_of(cache).reader
    real = type(reader).order
    rank = {first: 0}
    monkeypatch.setattr(reader, "order", lambda cid: sorted(real(reader, cid), key=lambda n: rank.get(n, 1)))


def test_flipped_bits_are_detected_restored_from_the_other_tier_and_repaired(
    cache: TierCache, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(N_FLIPS + 40)
    h = cache.save(state, step=1)
    h.wait("local")
    h.wait("remote")
    chunks = [c.id for c in cache.manifest("main").chunks]
    assert len(chunks) == N_FLIPS + 40
    tiers = core_of(cache).repo.durable
    for cid in chunks:
        assert len(tiers["disk"].get(chunk_key(cid))) == HEADER_BYTES + 48 * 1024  # every flip hits checked bytes

    rng = random.Random(1234)
    victims = rng.sample(chunks, N_FLIPS)  # one copy each, so every chunk keeps a good copy
    where = {cid: rng.choice(["disk", "s3"]) for cid in victims}
    header_hits = sum(_flip(tiers[where[cid]], cid, rng) < HEADER_BYTES for cid in victims)
    on_disk = {c for c, t in where.items() if t == "disk"}
    on_s3 = {c for c, t in where.items() if t == "s3"}
    assert on_disk and on_s3

    # Disk read first: each damaged disk copy is detected and read from S3 instead.
    _prefer(cache, monkeypatch, "disk")
    with caplog.at_level(logging.WARNING, logger="tiercache.restore"):
        _assert_equal(cache.restore("main"), state)
    assert _fallbacks(caplog) == {c: ("s3", "disk") for c in on_disk}

    # S3 read first: now each damaged S3 copy is detected and read from disk.
    caplog.clear()
    _prefer(cache, monkeypatch, "s3")
    with caplog.at_level(logging.WARNING, logger="tiercache.restore"):
        _assert_equal(cache.restore("main"), state)
    assert _fallbacks(caplog) == {c: ("disk", "s3") for c in on_s3}
    monkeypatch.undo()

    report = cache.verify()
    assert not report.ok
    assert report.chunks == len(chunks) and report.versions == 1
    assert {(d.tier, d.key) for d in report.damage} == {(t, chunk_key(c)) for c, t in where.items()}
    assert all(d.problem == "damaged" and d.repaired_from is None for d in report.damage)
    assert report.unrepairable == ()

    fixed = cache.verify(repair=True)
    assert fixed.ok and fixed.repaired == N_FLIPS
    assert {(d.tier, d.repaired_from) for d in fixed.damage} == {("disk", "s3"), ("s3", "disk")}
    assert all(d.repaired_from != d.tier for d in fixed.damage)
    again = cache.verify()
    assert again.ok and again.damage == ()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiercache.restore"):
        _assert_equal(cache.restore("main"), state)
    assert _fallbacks(caplog) == {}
    print(f"\nintegrity: {N_FLIPS} flips ({header_hits} in headers), {len(on_disk)} disk / {len(on_s3)} s3, "
          f"detected {len(report.damage)}, repaired {fixed.repaired}")


def test_missing_copy_falls_back_and_is_reported_missing(cache: TierCache, caplog: pytest.LogCaptureFixture) -> None:
    state = _state(8, seed=1)
    h = cache.save(state, step=1)
    h.wait("local")
    h.wait("remote")
    cid = cache.manifest("main").chunks[3].id
    core_of(cache).repo.durable["disk"].delete(chunk_key(cid))
    with caplog.at_level(logging.WARNING, logger="tiercache.restore"):
        _assert_equal(cache.restore("main"), state)
    assert any(f"chunk {cid} restored from s3 after disk: missing" in r.getMessage() for r in caplog.records)
    report = cache.verify("main")
    assert [(d.tier, d.key, d.problem) for d in report.damage] == [("disk", chunk_key(cid), "missing")]
    fixed = cache.verify("main", repair=True)
    assert [(d.tier, d.repaired_from) for d in fixed.damage] == [("disk", "s3")]
    durable = core_of(cache).repo.durable
    assert durable["disk"].get(chunk_key(cid)) == durable["s3"].get(chunk_key(cid))
    assert cache.verify("main").ok


def test_no_good_copy_raises_integrity_error_naming_the_chunk(cache: TierCache) -> None:
    state = _state(6, seed=2)
    h = cache.save(state, step=1)
    h.wait("local")
    h.wait("remote")
    cid = cache.manifest("main").chunks[2].id
    rng = random.Random(7)
    for name in ("disk", "s3"):
        _flip(core_of(cache).repo.durable[name], cid, rng)
    with pytest.raises(IntegrityError, match=f"chunk {cid} has no good copy on any tier") as exc:
        cache.restore("main")
    assert "disk: damaged" in str(exc.value) and "s3: damaged" in str(exc.value)
    report = cache.verify(repair=True)
    assert not report.ok
    assert report.unrepairable == (chunk_key(cid),)
    assert {(d.tier, d.repaired_from) for d in report.damage} == {("disk", None), ("s3", None)}


def test_damaged_manifest_copy_is_reported_and_repaired(cache: TierCache) -> None:
    state = _state(3, seed=3)
    h = cache.save(state, step=4)
    h.wait("local")
    h.wait("remote")
    vid = h.version
    s3 = core_of(cache).repo.durable["s3"]
    key = f"versions/{vid}.json"
    s3.put(key, s3.get(key).replace(b'"step":4', b'"step":5'))
    report = cache.verify()
    assert [(d.tier, d.key, d.problem) for d in report.damage] == [("s3", key, "damaged")]
    assert cache.verify(repair=True).repaired == 1
    assert s3.get(key) == core_of(cache).repo.durable["disk"].get(key)
    assert cache.verify().ok
