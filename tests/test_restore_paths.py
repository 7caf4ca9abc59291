"""The read paths of a restore: straight into aligned tensors, through the bounce buffer into
unaligned ones, packs streamed through a window, and damage on the only tier.

Every test reads from a real disk tier (O_DIRECT on this filesystem) in a reopened cache, so the
RAM tier holds nothing unless a test says so.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
import tiercache.tiers.disk as disk_module
from tiercache import restore as restore_module
from tiercache.cache import core_of
from tiercache.codecs import HEADER_BYTES
from tiercache.config import S3Config
from tiercache.errors import IntegrityError
from tiercache.manifest import Version
from tiercache.names import CHUNKS, chunk_key
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.ram import RamTier
from tiercache.tiers.s3 import S3Tier

MIB = 1 << 20


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    # write-through stores chunks raw (the default policy may compress them), so the raw paths run.
    return {"disk": {"path": str(root / "disk")}, "policy": {"name": "write-through"}, **extra}


def _saved(root: Path, state: dict[str, torch.Tensor], **extra: Any) -> Version:
    with tiercache.open(_config(root, **extra)) as cache:
        cache.save(state, step=1).wait("local")
        return cache.manifest("main")


def _targets_per_chunk(version: Version) -> Counter[int]:
    return Counter(p.chunk for e in version.tensors for p in e.pieces)


def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "big.f32": torch.randn(600_000, generator=g),  # 2.4 MB: three 1 MiB chunks, the last one short
        "big.i64": torch.randint(-(2**62), 2**62, (300_001,), generator=g),
        "big.bf16": torch.randn(1100, 1000, generator=g).to(torch.bfloat16),
        "small.f32": torch.randn(1000, generator=g),
        "small.i8": torch.arange(777, dtype=torch.int8),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8) if v.dtype == torch.bfloat16 else got[k],
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k


def test_new_destinations_are_page_aligned_and_filled_without_bounce_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _mixed_state()
    version = _saved(tmp_path, state, chunk_bytes="1MiB", pack_below="64KiB")
    bounced: list[int] = []
    real_copy = disk_module.copy_bytes

    def counting_copy(dst: memoryview, src: Any) -> None:
        bounced.append(memoryview(src).nbytes)
        real_copy(dst, src)

    with tiercache.open(_config(tmp_path)) as cache:
        assert cache.manifest("main") == version
        monkeypatch.setattr(disk_module, "copy_bytes", counting_copy)
        out = core_of(cache).restore_version(version)
        assert core_of(cache).repo.durable["disk"].o_direct_active

    _assert_same(out, state)
    # Only each chunk's header and sub-page tail pass through the bounce buffer: the payloads
    # go with O_DIRECT straight into the new tensors (and into the pack window). A header whose
    # buffer happens to be page-aligned is read straight too (CI saw 3 of them), so the headers
    # are a bound, not a count; no bounced piece is larger than a page.
    tails = sum(c.nbytes % 4096 for c in version.chunks)
    assert tails <= sum(bounced) <= tails + HEADER_BYTES * len(version.chunks), bounced
    assert max(bounced) <= 4096, bounced
    for name in ("big.f32", "big.i64", "big.bf16"):
        assert out[name].data_ptr() % 4096 == 0, name
        assert out[name].is_contiguous()
    # Every tensor owns its memory: writing one leaves the others as they were.
    storages = {k: (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()) for k, v in out.items()}
    spans = sorted((ptr, ptr + n) for ptr, n in storages.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    out["big.f32"].fill_(7.0)
    _assert_same({k: v for k, v in out.items() if k != "big.f32"}, {k: v for k, v in state.items() if k != "big.f32"})


def test_restore_into_unaligned_tensors_is_bit_exact_and_in_place(tmp_path: Path) -> None:
    state = _mixed_state()
    _saved(tmp_path, state, chunk_bytes="1MiB", pack_below="64KiB")
    # One block holding every destination 8 bytes past a 16-byte boundary (so never page-aligned),
    # with guard bytes around each.
    block = torch.full((8 * MIB,), 0xAB, dtype=torch.uint8)
    into, spans, pos = {}, [], 8
    for k, v in state.items():
        n = v.numel() * v.element_size()
        into[k] = block[pos : pos + n].view(v.dtype).view(v.shape)
        assert into[k].data_ptr() % 4096 != 0
        spans.append((pos, pos + n))
        pos = (pos + n + 15) // 16 * 16 + 24
    ptrs = {k: v.data_ptr() for k, v in into.items()}

    with tiercache.open(_config(tmp_path)) as cache:
        out = cache.restore("main", into=into)

    _assert_same(out, state)
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs
    outside = torch.ones(block.numel(), dtype=torch.bool)
    for a, b in spans:
        outside[a:b] = False
    assert bool((block[outside] == 0xAB).all())


@pytest.mark.parametrize("source", ["disk", "ram"])
@pytest.mark.parametrize("window", [10_000, 64 * 1024])
def test_packs_are_scattered_window_by_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, window: int
) -> None:
    # Windows smaller than a pack, one of them not a multiple of the page size.
    monkeypatch.setattr(restore_module, "_WINDOW_BYTES", window)
    g = torch.Generator().manual_seed(2)
    dtypes = [torch.float32, torch.int8, torch.float64, torch.int16, torch.bfloat16]
    state = {
        f"t{i:03d}": torch.randint(-100, 100, (1 + (i * 37) % 3000,), generator=g).to(dtypes[i % len(dtypes)])
        for i in range(300)
    }
    config = _config(tmp_path, chunk_bytes="256KiB", pack_below="64KiB", ram={"capacity": "64MiB"})
    with tiercache.open(config) as cache:
        cache.save(state, step=1).wait("local")
        packs = [n for n in _targets_per_chunk(cache.manifest("main")).values() if n > 1]
        assert len(packs) >= 2 and sum(packs) == len(state)
        if source == "ram":
            fresh = cache.restore("main")
            existing = cache.restore("main", into={k: torch.zeros_like(v) for k, v in state.items()})
    if source == "disk":
        reads: list[int] = []
        real_read_into, real_get = DiskTier.read_into, DiskTier.get

        def recording_read_into(self: DiskTier, key: str, out: memoryview, offset: int = 0, **kw: Any) -> int | None:
            reads.append(memoryview(out).nbytes)
            return real_read_into(self, key, out, offset, **kw)

        def no_whole_chunks(self: DiskTier, key: str) -> bytes | None:
            assert not key.startswith("chunks/"), f"{key} read whole instead of window by window"
            return real_get(self, key)

        monkeypatch.setattr(DiskTier, "read_into", recording_read_into)
        monkeypatch.setattr(DiskTier, "get", no_whole_chunks)
        with tiercache.open(_config(tmp_path)) as cache:
            fresh = cache.restore("main")
            existing = cache.restore("main", into={k: torch.zeros_like(v) for k, v in state.items()})
        # Every read is a header or at most one window: no chunk-sized buffer.
        assert reads and max(reads) <= max(window, HEADER_BYTES) and window in reads
    _assert_same(fresh, state)
    _assert_same(existing, state)


def _damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + (len(data) - HEADER_BYTES) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _damage_truncate(path: Path) -> None:
    os.truncate(path, HEADER_BYTES + (path.stat().st_size - HEADER_BYTES) // 2)


@pytest.mark.parametrize("damage", [_damage_flip, _damage_truncate], ids=["flipped-bit", "truncated"])
@pytest.mark.parametrize("kind", ["single-tensor", "pack"])
def test_damage_on_the_only_tier_raises_integrity_error_naming_the_chunk(
    tmp_path: Path, damage: Any, kind: str
) -> None:
    state = _mixed_state()
    version = _saved(tmp_path, state, chunk_bytes="1MiB", pack_below="64KiB")
    counts = _targets_per_chunk(version)
    index = next(i for i, n in sorted(counts.items()) if (n > 1) == (kind == "pack"))
    cid = version.chunks[index].id
    damage(tmp_path / "disk" / chunk_key(cid))
    with tiercache.open(_config(tmp_path)) as cache:
        with pytest.raises(IntegrityError, match=f"chunk {cid} has no good copy on any tier") as exc:
            cache.restore("main")
        assert f"disk: damaged (chunk {cid} on disk: content does not match its id)" in str(exc.value)
        report = cache.verify("main")
    assert [(d.tier, d.key) for d in report.damage] == [("disk", chunk_key(cid))]


@pytest.mark.parametrize("into", [False, True], ids=["new-tensors", "into"])
def test_restore_from_ram_verifies_in_place_and_copies_each_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool
) -> None:
    state = _mixed_state()
    copied: list[int] = []
    real_move = restore_module._memmove

    def counting_move(dst: int, src: int, n: int) -> None:
        copied.append(n)
        real_move(dst, src, n)

    def no_chunk_reads(self: RamTier, key: str, *args: Any, **kw: Any) -> Any:
        raise AssertionError(f"{key} copied out of the RAM tier instead of lent")

    with tiercache.open(_config(tmp_path, chunk_bytes="1MiB", pack_below="64KiB", ram={"capacity": "64MiB"})) as cache:
        cache.save(state, step=1).wait("local")
        version = cache.manifest("main")
        assert core_of(cache).catalog.residency(version)[0] == "ram"
        monkeypatch.setattr(restore_module, "_memmove", counting_move)
        monkeypatch.setattr(RamTier, "read_into", no_chunk_reads)
        monkeypatch.setattr(RamTier, "get", no_chunk_reads)
        out = cache.restore("main", into={k: torch.zeros_like(v) for k, v in state.items()} if into else None)

    _assert_same(out, state)
    # Straight from the arena into the tensors: every piece once, no bounce or window copy.
    assert sorted(copied) == sorted(p.nbytes for e in version.tensors for p in e.pieces)


@pytest.mark.parametrize(("chunk_bytes", "at"), [("1MiB", 100), ("8MiB", 100), ("8MiB", (8 << 20) - 1)],
                         ids=["hashed-in-line", "hashed-beside-the-copy", "beside-last-byte"])
def test_a_damaged_ram_copy_is_skipped_for_the_disk_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         chunk_bytes: str, at: int) -> None:
    state = _mixed_state()
    state["huge.f32"] = torch.randn(3 << 20, generator=torch.Generator().manual_seed(2))  # 12 MiB: 8 + 4 MiB
    with tiercache.open(_config(tmp_path, chunk_bytes=chunk_bytes, pack_below="64KiB",
                                ram={"capacity": "64MiB"})) as cache:
        cache.save(state, step=1).wait("local")
        version = cache.manifest("main")
        cid = max(version.chunks, key=lambda c: c.nbytes).id
        ram = cache.engine.local.ram
        region = ram._entries[chunk_key(cid)].region  # flip a bit of the RAM copy only
        assert region is not None
        ram.arena.buffer(region)[HEADER_BYTES + at] ^= 0x10
        with caplog.at_level("WARNING", logger="tiercache.restore"):
            out = cache.restore("main")
    _assert_same(out, state)
    assert f"chunk {cid} restored from disk after ram: damaged (chunk {cid} on ram: content does not match its id)" \
        in caplog.text


def test_a_restore_lists_a_slower_tiers_chunks_only_for_what_the_faster_ones_lack(
    tmp_path: Path, s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh process restoring what its disk holds must not list the bucket first: on S3 with a
    # long history that listing is one request per 1000 chunks, before the first byte is copied.
    state = _mixed_state()
    config = _config(tmp_path, chunk_bytes="1MiB", pack_below="64KiB", s3=s3_config.model_dump(mode="json"))
    with tiercache.open(config) as cache:
        cache.save(state, step=1).wait("remote")
        version = cache.manifest("main")
    listed: list[str] = []
    real_list = S3Tier.list

    def listing(self: S3Tier, prefix: str = "") -> list[str]:
        listed.append(prefix)
        return real_list(self, prefix)

    monkeypatch.setattr(S3Tier, "list", listing)
    with tiercache.open(config) as cache:
        _assert_same(cache.restore("main"), state)
        assert cache.last_restore is not None and set(cache.last_restore.nbytes) == {"disk"}
    assert CHUNKS not in listed, listed

    # A chunk the disk lost is read from S3, which holds the version's manifest and so its chunks
    # (written first): no listing of the bucket is asked even then (docs/design.md, the index). Once S3 has
    # a measured read speed the reader may take further chunks from it if it measured faster than
    # the disk (loopback S3 can), so only the lost chunk is certain to come from S3.
    lost = version.chunks[0]
    (tmp_path / "disk" / chunk_key(lost.id)).unlink()
    with tiercache.open(config) as cache:
        _assert_same(cache.restore("main"), state)
        report = cache.last_restore
        assert report is not None and set(report.nbytes) <= {"disk", "s3"}
        assert sum(report.nbytes.values()) == sum(c.nbytes for c in version.chunks)
        assert report.nbytes["s3"] >= lost.nbytes
    assert CHUNKS not in listed, listed
