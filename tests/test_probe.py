"""The compression probe: a fresh cache measures its codecs on a sample of its first version and
stores that version raw; the sample's numbers still lead to compression where it wins.

Everything asserted is data: the codec named in each stored chunk's header, the bytes the meter saw
each codec encode, and the restored tensors, bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache import codecs
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.names import chunk_key
from tiercache.pipeline import probe
from tiercache.testing import ThrottledProxy

MIB = 1 << 20
LINK_BPS = 2_000_000  # slow enough that compressing wins even with the encoder timed on a busy machine


def _stored_codecs(cache: tiercache.TierCache, tier: str, ref: str) -> dict[str, str]:
    """The codec of each chunk of ``ref`` as ``tier`` stores it (read from the chunk objects' headers)."""
    t = core_of(cache).repo.durable[tier]
    out = {}
    for c in cache.manifest(ref).chunks:
        data = t.get(chunk_key(c.id))
        assert data is not None, c.id
        out[c.id] = codecs.read_header(data[: codecs.HEADER_BYTES]).codec
    return out


def _random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(MIB // 2, generator=g), "m": torch.randn(MIB // 4, generator=g)}  # 3 MiB of floats


def _compressible_state(seed: int) -> dict[str, torch.Tensor]:
    # Floats of a few distinct values: bgzstd shrinks them many times over.
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randint(0, 4, (MIB // 2,), generator=g).float(), "m": torch.full((MIB // 4,), float(seed))}


def test_a_fresh_cache_stores_its_first_version_raw_and_measures_the_codecs_on_a_sample(
    tmp_path: Path, s3_config: S3Config
) -> None:
    state = _random_state(1)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    config = {"disk": {"path": str(tmp_path / "disk")}, "s3": s3_config.model_dump()}  # the default policy
    with tiercache.open(config) as cache:
        cache.save(state, step=1).wait("remote")
        assert set(_stored_codecs(cache, "s3", "main").values()) == {codecs.RAW}
        assert set(_stored_codecs(cache, "disk", "main").values()) == {codecs.RAW}
        # The policy's candidate for floats, measured on a sample: the start of the first chunks, at
        # most 1/512 of the version or 1 MiB; the other codec, which it would not choose, not at all.
        stats = core_of(cache).meter.codec_stats(codecs.BGZSTD)
        assert stats is not None and stats.encode_bps is not None
        assert 0 < stats.raw_bytes <= max(nbytes // probe.PROBE_SHARE, probe.PROBE_MIN) < nbytes
        assert stats.ratio is not None and stats.ratio < 1.5  # random floats barely shrink
        assert core_of(cache).meter.codec_stats(codecs.ZSTD) is None
    with tiercache.open(config) as cache:
        got = cache.restore("main")
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[ThrottledProxy]:
    with ThrottledProxy(s3_server.endpoint_url, limit_bps=LINK_BPS) as p:
        yield p


def test_on_a_slow_link_compressible_versions_are_compressed_once_the_link_is_measured(
    tmp_path: Path, s3_config: S3Config, proxy: ThrottledProxy
) -> None:
    config = {"disk": {"path": str(tmp_path / "disk")},
              "s3": s3_config.model_copy(update={"endpoint_url": proxy.url}).model_dump()}
    first, second = _compressible_state(1), _compressible_state(2)
    with tiercache.open(config) as cache:
        cache.save(first, step=1).wait("remote")
        assert set(_stored_codecs(cache, "s3", "main").values()) == {codecs.RAW}  # measured, not compressed
        stats = core_of(cache).meter.codec_stats(codecs.BGZSTD)
        assert stats is not None and stats.ratio is not None and stats.ratio > 4
        cache.save(second, step=2).wait("remote")
        # The link is measured now (a few MB/s): compressing wins there. (Whether it wins on the
        # disk depends on the disk's measured speed, which this test does not control.)
        assert set(_stored_codecs(cache, "s3", "main").values()) == {codecs.BGZSTD}
    with tiercache.open({"s3": s3_config.model_dump()}) as cache:
        for ref, state in (("main~1", first), ("main", second)):
            got = cache.restore(ref)
            assert all(torch.equal(got[k], v) for k, v in state.items()), ref
