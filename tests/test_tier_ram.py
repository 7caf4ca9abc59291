from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Iterator

import pytest
import torch
from tier_conformance import KEY, MIB, TierConformance, payload, run_threads

from tiercache.errors import CacheClosedError, ConflictError, TierFullError
from tiercache.tiers.base import RefValue
from tiercache.tiers.ram import Arena, RamTier, Region, buffer_address


class TestRamConformance(TierConformance):
    @pytest.fixture
    def tier(self) -> Iterator[RamTier]:
        arena = Arena(64 * MIB)
        t = RamTier(arena)
        yield t
        t.close()
        assert arena.used_bytes == 0
        arena.close()


def test_arena_is_lazy_and_page_aligned() -> None:
    arena = Arena(8 * MIB + 100)
    assert arena.capacity == 8 * MIB
    assert arena.is_allocated is False
    assert (arena.used_bytes, arena.free_bytes) == (0, 8 * MIB)
    regions = [arena.alloc(n) for n in (1, 4096, 4097, MIB + 1)]
    assert arena.is_allocated is True
    assert regions == [Region(0, 4096), Region(4096, 4096), Region(8192, 8192), Region(16384, MIB + 4096)]
    for region in regions:
        assert region is not None
        assert arena.tensor(region).data_ptr() % 4096 == 0
        assert buffer_address(arena.buffer(region)) % 4096 == 0
        assert arena.tensor(region).numel() == region.nbytes
    assert arena.used_bytes == 4096 + 4096 + 8192 + MIB + 4096
    assert arena.is_pinned is False  # no CUDA on this machine
    arena.close()


def test_buffer_and_tensor_share_memory() -> None:
    arena = Arena(MIB)
    region = arena.alloc(8192)
    assert region is not None
    arena.buffer(region)[:5] = b"hello"
    assert bytes(arena.tensor(region)[:5].tolist()) == b"hello"
    arena.tensor(region)[5:8] = torch.tensor(list(b"abc"), dtype=torch.uint8)
    assert bytes(arena.buffer(region)[:8]) == b"helloabc"
    arena.close()


def test_alloc_returns_none_when_full_and_coalesces_on_free() -> None:
    arena = Arena(16 * 4096)
    a, b, c = (arena.alloc(4 * 4096) for _ in range(3))
    d = arena.alloc(4 * 4096)
    assert None not in (a, b, c, d)
    assert arena.alloc(1) is None
    assert arena.free_bytes == 0
    arena.free(b)  # type: ignore[arg-type]
    arena.free(c)  # type: ignore[arg-type]
    assert arena.alloc(9 * 4096) is None
    assert arena.alloc(8 * 4096) == Region(4 * 4096, 8 * 4096)  # b and c merged
    arena.close()


def test_request_larger_than_the_arena_names_the_knob() -> None:
    arena = Arena(MIB)
    msg = r"cannot stage 2097152 bytes in a RAM arena of 1048576 bytes: raise ram\.capacity"
    with pytest.raises(TierFullError, match=msg):
        arena.alloc(2 * MIB)
    with pytest.raises(TierFullError):
        arena.alloc_wait(2 * MIB, timeout=0)
    assert arena.is_allocated is False


def test_bad_alloc_and_free_are_refused() -> None:
    arena = Arena(MIB)
    with pytest.raises(ValueError, match="positive"):
        arena.alloc(0)
    region = arena.alloc(4096)
    assert region is not None
    arena.free(region)
    with pytest.raises(ValueError, match="already freed"):
        arena.free(region)
    with pytest.raises(ValueError, match="not a live region"):
        arena.buffer(region)
    assert arena.free_bytes == MIB
    live = arena.alloc(4096)
    assert live is not None
    arena.close()
    with pytest.raises(CacheClosedError):
        arena.alloc(4096)
    arena.free(live)  # after close, teardown order does not matter
    assert arena.used_bytes == 0


def test_a_retained_region_goes_back_at_its_last_free() -> None:
    arena = Arena(MIB)
    region = arena.alloc(600 * 1024)
    assert region is not None
    arena.buffer(region)[:5] = b"early"
    arena.retain(region)  # an early disk write still reads it
    arena.free(region)  # its owner lets go (a duplicate, or the version was released)
    assert arena.used_bytes == 600 * 1024 and arena.alloc(600 * 1024) is None
    assert bytes(arena.buffer(region)[:5]) == b"early"
    arena.free(region)  # the reader is done
    assert arena.used_bytes == 0
    with pytest.raises(ValueError, match="already freed"):
        arena.free(region)
    with pytest.raises(ValueError, match="not a live region"):
        arena.retain(region)
    arena.close()


def test_alloc_wait_wakes_on_free() -> None:
    arena = Arena(8 * 4096)
    held = arena.alloc(8 * 4096)
    assert held is not None
    assert arena.alloc_wait(4096, timeout=0.05) is None
    waiting = threading.Event()
    got: list[Region | None] = []

    def waiter() -> None:
        waiting.set()
        got.append(arena.alloc_wait(3 * 4096, timeout=60))

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait()
    arena.free(held)
    thread.join(timeout=60)
    assert got == [Region(0, 3 * 4096)]
    arena.close()


def test_random_alloc_free_never_exceeds_capacity_or_overlaps() -> None:
    capacity = 64 * 4096
    arena = Arena(capacity)
    rng = random.Random(7)
    live: list[Region] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            region = arena.alloc(rng.randint(1, 12 * 4096))
            if region is not None:
                live.append(region)
        spans = sorted(live)
        assert all(r.offset % 4096 == 0 and r.nbytes % 4096 == 0 for r in spans)
        assert all(a.offset + a.nbytes <= b.offset for a, b in itertools.pairwise(spans))
        assert all(r.offset + r.nbytes <= capacity for r in spans)
        assert arena.used_bytes == sum(r.nbytes for r in spans)
    for region in live:
        arena.free(region)
    assert arena.alloc(capacity) == Region(0, capacity)
    arena.close()


def test_concurrent_allocs_stay_within_capacity() -> None:
    arena = Arena(32 * 4096)

    def work(i: int) -> list[Region]:
        got = []
        for _ in range(50):
            region = arena.alloc_wait(4096 * (1 + i % 3), timeout=60)
            assert region is not None
            arena.buffer(region)[:1] = bytes([i])
            got.append(region)
            if len(got) > 2:
                arena.free(got.pop(0))
        return got

    still_held = [r for regions in run_threads(work, 6) for r in regions]  # type: ignore[union-attr]
    assert arena.used_bytes == sum(r.nbytes for r in still_held)
    assert arena.used_bytes <= arena.capacity
    arena.close()


@pytest.fixture
def ram() -> Iterator[RamTier]:
    tier = RamTier(Arena(MIB))
    yield tier
    tier.close()
    tier.arena.close()


def test_tier_identity(ram: RamTier) -> None:
    assert (ram.name, ram.durable, ram.capacity) == ("ram", False, MIB)


def test_large_objects_live_in_the_arena_small_ones_do_not(ram: RamTier) -> None:
    ram.put("versions/v.json", b"{}")
    assert ram.arena.used_bytes == 0
    ram.put(KEY, payload(5000))
    assert ram.arena.used_bytes == 8192
    with ram.borrow(KEY) as view:
        assert view is not None and view.readonly
        assert buffer_address(view) % 4096 == 0
        assert bytes(view) == payload(5000)
    ram.delete(KEY)
    assert ram.arena.used_bytes == 0
    with ram.borrow(KEY) as view:
        assert view is None


def test_a_borrowed_object_keeps_its_bytes_until_returned(ram: RamTier) -> None:
    ram.put(KEY, payload(300 * 1024, seed=1))
    with ram.borrow(KEY) as view:
        assert view is not None
        ram.delete(KEY)  # the version is released while another tier's write still reads it
        assert ram.get(KEY) is None and ram.arena.used_bytes == 300 * 1024
        assert ram.arena.alloc(800 * 1024) is None  # its region is not handed out again ...
        ram.put(KEY, payload(300 * 1024, seed=2))  # ... nor overwritten by the next save's bytes
        assert bytes(view) == payload(300 * 1024, seed=1)
    assert ram.arena.used_bytes == 300 * 1024  # returned: only the new object's region is left
    assert ram.get(KEY) == payload(300 * 1024, seed=2)


def test_put_raises_tier_full_when_the_arena_is_full(ram: RamTier) -> None:
    ram.put("chunks/aa/a", payload(600 * 1024))
    with pytest.raises(TierFullError, match=r"ram\.capacity"):
        ram.put("chunks/bb/b", payload(600 * 1024))
    assert ram.list() == ["chunks/aa/a"]
    assert ram.arena.used_bytes == 600 * 1024


def test_adopt_is_zero_copy_and_dedups(ram: RamTier) -> None:
    first = ram.arena.alloc(10_000)
    assert first is not None
    ram.arena.buffer(first)[:10_000] = payload(10_000, seed=1)
    assert ram.adopt(KEY, first, 10_000) is True
    with ram.borrow(KEY) as view:
        assert view is not None and buffer_address(view) == buffer_address(ram.arena.buffer(first))
    second = ram.arena.alloc(10_000)
    assert second is not None
    ram.arena.buffer(second)[:10_000] = payload(10_000, seed=2)
    assert ram.adopt(KEY, second, 10_000) is False
    assert ram.arena.used_bytes == first.nbytes  # the duplicate's region went back
    assert ram.get(KEY) == payload(10_000, seed=1)
    assert ram.size(KEY) == 10_000


def test_an_adopted_region_goes_back_after_its_last_reader_of_any_kind(ram: RamTier) -> None:
    # The engine's early disk write retains a chunk's region, the hasher hands it to the tier,
    # a restore borrows it, then the version is released: one count covers all three holders.
    region = ram.arena.alloc(10_000)
    assert region is not None
    ram.arena.buffer(region)[:10_000] = payload(10_000, seed=3)
    ram.arena.retain(region)  # the early write's reference
    assert ram.adopt(KEY, region, 10_000) is True
    with ram.borrow(KEY) as view, ram.borrow(KEY) as again:
        assert view is not None and again is not None
        ram.delete(KEY)
        ram.arena.free(region)  # the early write is done
        assert ram.arena.used_bytes == region.nbytes
        assert ram.arena.alloc(ram.arena.capacity) is None  # still held by the two borrows
        assert bytes(view) == bytes(again) == payload(10_000, seed=3)
    assert ram.arena.used_bytes == 0
    with pytest.raises(ValueError, match="not allocated from this arena or was already freed"):
        ram.arena.free(region)


def test_adopt_refuses_a_length_past_the_region(ram: RamTier) -> None:
    region = ram.arena.alloc(4096)
    assert region is not None
    with pytest.raises(ValueError, match="does not fit"):
        ram.adopt(KEY, region, 4097)
    assert ram.list() == []


def test_rewriting_identical_bytes_changes_the_token(ram: RamTier) -> None:
    t1 = ram.write_ref("refs/branch/main", b"v1", expect=None)
    t2 = ram.write_ref("refs/branch/main", b"v1", expect=t1)
    assert t2 != t1
    with pytest.raises(ConflictError):
        ram.write_ref("refs/branch/main", b"v9", expect=t1)
    assert ram.read_ref("refs/branch/main") == RefValue(b"v1", t2)


def test_overwrite_while_reading_never_tears(ram: RamTier) -> None:
    versions = [bytes([i]) * (64 * 1024) for i in range(1, 5)]
    ram.put(KEY, versions[0])

    def work(i: int) -> list[bytes | None]:
        if i < 2:
            for j in range(200):
                ram.put(KEY, versions[(i + j) % 4])
            return []
        return [ram.get(KEY) for _ in range(200)]

    reads = [r for rs in run_threads(work, 4) for r in rs]  # type: ignore[union-attr]
    assert len(reads) == 400
    assert all(r in versions for r in reads)
    assert ram.arena.used_bytes == 64 * 1024


def test_objects_move_to_a_larger_arena_only_while_nothing_else_holds_a_region() -> None:

    small, big = Arena(4 * MIB), Arena(16 * MIB)
    tier = RamTier(small)
    blobs = {f"chunks/ab/{i:032x}": bytes([i]) * (MIB + i) for i in range(3)}
    for k, v in blobs.items():
        tier.put(k, v)
    tier.put("versions/v.json", b"{}")  # a small object lives outside the arena
    staged = small.alloc(4096)  # a version being staged holds a region: not now
    assert staged is not None and not tier.move_to(big) and tier.arena is small
    small.free(staged)
    with tier.borrow(next(iter(blobs))) as view:  # a reader holds one: not now either
        assert view is not None and not tier.move_to(big)
    assert big.used_bytes == 0  # nothing was left behind in the larger arena by the refusals
    assert tier.move_to(big) and tier.arena is big and tier.capacity == big.capacity
    assert small.used_bytes == 0
    assert {k: tier.get(k) for k in blobs} == blobs and tier.get("versions/v.json") == b"{}"
    tier.put("chunks/cd/" + "f" * 32, b"x" * MIB)  # new objects land in the new arena
    assert big.used_bytes >= sum(map(len, blobs.values())) + MIB
