"""Semantics of the async save engine: snapshot isolation, futures per level, backpressure, errors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.errors import ConfigError, SkippedError, StorageError, TierFullError
from tiercache.tiers.disk import DiskTier


def _state(n: int = 4, size: int = 256 * 1024, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(size, generator=g) for i in range(n)}


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


def test_mutating_sources_right_after_save_does_not_change_the_version(tmp_path: Path) -> None:
    state = {"w": torch.arange(1_000_000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    expected = {k: v.clone() for k, v in state.items()}
    with tiercache.open({"ram": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path)}}) as cache:
        h = cache.save(state, step=1)
        state["w"].mul_(-1)  # the next optimizer step, straight away
        state["b"].zero_()
        h.wait("local")
        got = cache.restore(h.version)
    assert torch.equal(got["w"], expected["w"])
    assert torch.equal(got["b"], expected["b"])


def test_futures_per_level_disk_only(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        h = cache.save(_state(1), step=5)
        assert h.wait("staged") == h.version
        assert h.wait("local") == h.version
        assert h.wait("durable") == h.version
        assert h.done("local") and not h.done("remote")
        with pytest.raises(ConfigError, match="no s3 tier"):
            h.wait("remote")


def test_ram_only_cache_has_no_durable_level() -> None:
    with tiercache.open({"ram": {"capacity": "32MiB"}}) as cache:
        state = _state(1)
        h = cache.save(state, step=1)
        assert h.wait("staged") == h.version
        with pytest.raises(ConfigError):
            h.wait("durable")
        got = cache.restore("main")
        assert torch.equal(got["w0"], state["w0"])
        assert cache.versions()[0].tiers == ("ram",)


class _GatedPut:
    """Makes DiskTier.put wait on an event, so versions pile up in the arena."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.calls = 0
        real = DiskTier.put

        def put(tier: DiskTier, key: str, data: object) -> None:
            self.calls += 1
            self.gate.wait(30)
            real(tier, key, data)  # type: ignore[arg-type]

        monkeypatch.setattr(DiskTier, "put", put)


def test_full_arena_makes_save_wait_for_a_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gated = _GatedPut(monkeypatch)
    state = _state(2, 1 << 20)  # 8 MiB per version
    cfg = {"ram": {"capacity": "20MiB", "serve_reads": False}, "disk": {"path": str(tmp_path)}}
    with tiercache.open(cfg) as cache:
        h1 = cache.save(state, step=1)
        h2 = cache.save({k: v + 1 for k, v in state.items()}, step=2)
        third: list[tiercache.SaveHandle] = []
        t = threading.Thread(target=lambda: third.append(cache.save({k: v + 2 for k, v in state.items()}, step=3)))
        t.start()
        t.join(0.5)
        assert t.is_alive(), "save() must wait while the arena holds two unwritten versions"
        assert cache.engine.arena is not None and cache.engine.arena.used_bytes <= cache.engine.arena.capacity
        gated.gate.set()
        t.join(30)
        assert not t.is_alive()
        for h in (h1, h2, third[0]):
            h.wait("local")
        got = cache.restore("main")
    assert torch.equal(got["w0"], state["w0"] + 2)
    assert [v.step for v in tiercache.open({"disk": {"path": str(tmp_path)}}).versions()] == [1, 2, 3]


def test_full_arena_with_skip_policy_skips_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gated = _GatedPut(monkeypatch)
    state = _state(2, 1 << 20)
    cfg = {
        "ram": {"capacity": "20MiB", "serve_reads": False},
        "disk": {"path": str(tmp_path)},
        "policy": {"name": "write-through", "params": {"on_full": "skip"}},
    }
    with tiercache.open(cfg) as cache:
        # Distinct contents: identical chunks would be deduplicated in RAM and take no room.
        h1 = cache.save(state, step=1)
        h2 = cache.save({k: v + 1 for k, v in state.items()}, step=2)
        h3 = cache.save({k: v + 2 for k, v in state.items()}, step=3)
        with pytest.raises(SkippedError):
            h3.wait("staged")
        assert not h3.done("local")
        gated.gate.set()
        assert h1.wait("local") == h1.version and h2.wait("local") == h2.version
        assert [v.step for v in cache.versions()] == [1, 2]
        assert cache.refs()["branch/main"] == h2.version


def test_version_larger_than_the_arena_is_refused(tmp_path: Path) -> None:
    with tiercache.open({"ram": {"capacity": "1MiB"}, "disk": {"path": str(tmp_path)}}) as cache:
        with pytest.raises(TierFullError, match=r"ram\.capacity"):
            cache.save({"w": torch.zeros(1 << 20)}, step=1)
        assert cache.versions() == []


def test_background_failure_surfaces_on_handle_and_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tier: DiskTier, key: str, data: object) -> None:
        raise StorageError(f"injected failure writing {key}")

    cache = tiercache.open({"disk": {"path": str(tmp_path)}})
    monkeypatch.setattr(DiskTier, "put", broken)
    h = cache.save(_state(1), step=1)
    with pytest.raises(StorageError, match="injected"):
        h.wait("local")
    assert not h.done("local") and not h.done("durable")
    with pytest.raises(StorageError, match="injected"):
        cache.save(_state(1), step=2)  # reported once, on the next save ...
    monkeypatch.undo()
    h3 = cache.save(_state(1, seed=3), step=3)  # ... then training goes on
    assert h3.wait("local") == h3.version
    cache.close()
    assert [v.step for v in tiercache.open({"disk": {"path": str(tmp_path)}}).versions()] == [3]


def test_background_failure_surfaces_on_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tier: DiskTier, key: str, data: object) -> None:
        raise StorageError("injected")

    monkeypatch.setattr(DiskTier, "put", broken)
    cache = tiercache.open({"disk": {"path": str(tmp_path)}})
    cache.save(_state(1), step=1)
    with pytest.raises(StorageError, match="injected"):
        cache.close()


def test_unchanged_state_writes_no_new_chunks_and_branch_writes_only_changed(tmp_path: Path) -> None:
    state = _state(4, 1 << 20)
    with tiercache.open({"disk": {"path": str(tmp_path)}, "chunk_bytes": "1MiB"}) as cache:
        cache.save(state, step=1).wait("local")
        files = _chunk_files(tmp_path)
        assert len(files) == 16  # 4 tensors x 4 MiB in 1 MiB chunks
        cache.save(state, step=2).wait("local")
        assert _chunk_files(tmp_path) == files
        cache.branch("ft", "main")
        changed = dict(state)
        changed["w2"] = state["w2"] + 1
        cache.save(changed, step=3, branch="ft").wait("local")
        new = sorted(set(_chunk_files(tmp_path)) - set(files))
        assert len(new) == 4  # only w2's four chunks
        v3 = cache.versions(branch="ft")[-1]
        assert v3.parent == cache.resolve("main")


def test_many_small_tensors_are_packed(tmp_path: Path) -> None:
    state = {"layers": [{"bias": torch.full((16,), float(i)), "step": torch.tensor(i)} for i in range(2000)]}
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        cache.save(state, step=1).wait("local")
        assert len(_chunk_files(tmp_path)) == 1
        got = cache.restore("main")
        for i in (0, 999, 1999):
            assert torch.equal(got["layers"][i]["bias"], state["layers"][i]["bias"])
            assert got["layers"][i]["step"].item() == i
        for s in range(2, 6):
            cache.save(state, step=s)
        cache.flush()
        assert len(cache.engine._plans) == 1  # the plan is computed once per structure


def test_full_arena_with_evict_policy_drops_the_oldest_unstarted_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated = _GatedPut(monkeypatch)
    state = _state(2, 1 << 20)
    cfg = {
        "ram": {"capacity": "20MiB", "serve_reads": False},
        "disk": {"path": str(tmp_path)},
        "policy": {"name": "write-through", "params": {"on_full": "evict"}},
    }
    with tiercache.open(cfg) as cache:
        h1 = cache.save(state, step=1)  # the disk writer holds this one (gated)
        h2 = cache.save({k: v + 1 for k, v in state.items()}, step=2)  # queued behind it
        cache.engine.wait_published()
        h3 = cache.save({k: v + 2 for k, v in state.items()}, step=3)  # no room: h2 is dropped
        assert h3.wait("staged") == h3.version
        with pytest.raises(SkippedError, match="on_full=evict"):
            h2.wait("local")
        gated.gate.set()
        assert h1.wait("local") == h1.version and h3.wait("local") == h3.version
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        assert [v.step for v in cache.versions()] == [1, 3]
        assert torch.equal(cache.restore("main")["w0"], state["w0"] + 2)


def test_a_failed_copy_raises_once_and_frees_its_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(flat: object, layout: object, views: list, copied: list) -> None:
        copied[0].set()  # the hasher may already be working on the first chunk
        raise RuntimeError("device lost mid-copy")

    cfg = {"ram": {"capacity": "64MiB", "serve_reads": False}, "disk": {"path": str(tmp_path)}}
    with tiercache.open(cfg) as cache:
        monkeypatch.setattr(cache.engine._stager, "copy_in", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            cache.save(_state(2, 1 << 20), step=1)
        monkeypatch.undo()
        cache.flush()
        assert cache.engine.arena is not None and cache.engine.arena.used_bytes == 0
        state = _state(2, 1 << 20, seed=7)
        h = cache.save(state, step=2)  # the copy error is not raised a second time
        assert h.wait("local") == h.version
        assert [v.step for v in cache.versions()] == [2]
        assert torch.equal(cache.restore("main")["w1"], state["w1"])


def test_observed_throughput_outlives_the_process(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        cache.save(_state(2, 1 << 20), step=1).wait("local")
        seen = cache.stats()["meter"]["tiers"]["disk"]["write"]["bps"]
        assert seen is not None and seen > 0
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        # A new process starts from the speed the last one measured (policy decisions, `stats`) ...
        assert cache.meter.rate("disk", "write") == pytest.approx(seen)
        # ... but only counts its own bytes.
        assert cache.stats()["meter"]["tiers"]["disk"]["write"]["total_bytes"] == 0
        assert [v.step for v in cache.versions()] == [1]


def test_residency_follows_evict_and_promote_of_shared_chunks(tmp_path: Path) -> None:
    shared = torch.randn(1 << 18)
    cfg = {"ram": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "d")}}
    with tiercache.open(cfg) as cache:
        a = cache.save({"w": shared, "u": torch.zeros(1 << 18)}, step=1)
        b = cache.save({"w": shared, "u": torch.ones(1 << 18)}, step=2)  # shares w's chunk with a
        cache.flush()
        both = ("ram", "disk")
        assert {v.step: v.tiers for v in cache.versions()} == {1: both, 2: both}
        # Dropping a's RAM copy keeps the chunk b needs: a is no longer resident in RAM, b still is.
        cache.evict(a.version, "ram")
        assert {v.step: v.tiers for v in cache.versions()} == {1: ("disk",), 2: both}
        cache.promote(a.version, "ram")
        assert {v.step: v.tiers for v in cache.versions()} == {1: both, 2: both}
        cache.evict(b.version, "ram")
        assert {v.step: v.tiers for v in cache.versions()} == {1: both, 2: ("disk",)}
        assert torch.equal(cache.restore(a.version)["w"], shared)


def test_policy_views_of_settled_versions_are_reused_until_they_change(tmp_path: Path) -> None:
    cfg = {"ram": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path)}}
    with tiercache.open(cfg) as cache:
        state = _state(2, 1 << 16)
        for step in range(6):
            state["w0"][0] = step
            cache.save(state, step=step)
        cache.flush()
        first = cache.engine.context().versions
        again = cache.engine.context().versions
        # Nothing moved: every view is the same object (a decision costs no rebuild per version).
        assert len(first) == 6 and all(a is b for a, b in zip(first, again, strict=True))
        oldest = first[0]
        cache.evict(oldest.id, "ram")
        after = cache.engine.context().versions
        assert after[0] is not oldest and after[0].tiers == frozenset({"disk"})
        assert oldest.tiers == frozenset({"ram", "disk"})
        assert all(a is b for a, b in zip(first[1:], after[1:], strict=True))


def test_prepare_faults_the_arena_in_before_the_first_save(tmp_path: Path) -> None:
    state = _state(2, 1 << 18)
    with tiercache.open({"ram": {"capacity": "32MiB"}, "disk": {"path": str(tmp_path)}}) as cache:
        assert cache.engine.arena is None or not cache.engine.arena.is_allocated  # opening allocates nothing
        cache.prepare(wait=True)
        arena = cache.engine.arena
        assert arena is not None and arena.is_allocated and arena.capacity == 32 << 20
        h = cache.save(state, step=1)
        assert cache.engine.arena is arena and h.wait("local") == h.version
        assert torch.equal(cache.restore(h.version)["w1"], state["w1"])
        cache.prepare()  # again: nothing to do
        assert cache.engine.arena is arena


def test_prepare_in_the_background_races_the_first_save_safely(tmp_path: Path) -> None:
    state = _state(3, 1 << 18, seed=4)
    with tiercache.open({"ram": {"capacity": "256MiB"}, "disk": {"path": str(tmp_path)}}) as cache:
        cache.prepare()
        h = cache.save(state, step=1)  # may arrive while the memory is still being faulted in
        state["w0"].zero_()
        h.wait("local")
        got = cache.restore(h.version)
        assert torch.equal(got["w2"], state["w2"]) and not torch.equal(got["w0"], state["w0"])
        assert torch.equal(got["w0"], _state(3, 1 << 18, seed=4)["w0"])


def test_prepare_with_auto_capacity_needs_a_state(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        with pytest.raises(tiercache.InvalidArgumentError, match=r"ram\.capacity is 'auto'"):
            cache.prepare()
        assert cache.engine.arena is None or not cache.engine.arena.is_allocated
        cache.prepare(_state(2, 1 << 20), wait=True)  # two versions of 8 MiB, at least 64 MiB
        assert cache.engine.arena is not None and cache.engine.arena.capacity == 64 << 20
    with pytest.raises(tiercache.CacheClosedError):
        cache.prepare()


def test_an_arena_closed_while_prefaulting_gives_its_memory_back() -> None:
    from tiercache.tiers.ram import Arena

    arena = Arena(64 << 20)
    started = threading.Event()
    real = arena._populate

    def slow() -> tuple:
        started.set()
        got = real()
        arena.close()  # the cache closes while the kernel is still faulting pages in
        return got

    arena._populate = slow  # type: ignore[method-assign]
    arena.prefault()
    assert started.is_set() and not arena.is_allocated
    with pytest.raises(tiercache.CacheClosedError):
        arena.alloc(4096)
