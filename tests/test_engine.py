"""Semantics of the async save engine: snapshot isolation, futures per level, backpressure, errors."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.cache import core_of
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
        assert h.succeeded("local") and not h.succeeded("remote")
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

        def put(tier: DiskTier, key: str, data: object, **kw: bool) -> None:
            self.calls += 1
            self.gate.wait(30)
            real(tier, key, data, **kw)  # type: ignore[arg-type]

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
        arena = cache.engine.local.ramcache.arena
        assert arena is not None and arena.used_bytes <= arena.capacity
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
        assert not h3.succeeded("local")
        gated.gate.set()
        assert h1.wait("local") == h1.version and h2.wait("local") == h2.version
        assert [v.step for v in cache.versions()] == [1, 2]
        assert cache.refs()["branch/main"] == h2.version


def test_version_larger_than_the_arena_is_refused(tmp_path: Path) -> None:
    with tiercache.open({"ram": {"capacity": "1MiB"}, "disk": {"path": str(tmp_path)}}) as cache:
        with pytest.raises(TierFullError, match=r"ram\.capacity"):
            cache.save({"w": torch.zeros(1 << 20)}, step=1)
        assert cache.versions() == []


def test_a_background_failure_never_costs_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tier: DiskTier, key: str, data: object, **kw: bool) -> None:
        raise StorageError(f"injected failure writing {key}")

    cache = tiercache.open({"disk": {"path": str(tmp_path)}})
    monkeypatch.setattr(DiskTier, "put", broken)
    h1 = cache.save(_state(1), step=1)
    with pytest.raises(StorageError, match="injected"):
        h1.wait("local")
    assert h1.future("local").done() and not h1.succeeded("local") and not h1.succeeded("durable")
    h2 = cache.save(_state(1), step=2)  # on_error="warn": the loss of step 1 does not stop training
    with pytest.raises(StorageError, match="injected"):
        h2.wait("durable")  # the disk is down, but the only tier: it was tried anyway
    monkeypatch.undo()
    h3 = cache.save(_state(1, seed=3), step=3)
    assert h3.wait("local") == h3.version
    assert cache.stats()["errors"]["lost_versions"] == 2
    with pytest.raises(StorageError, match="injected"):
        cache.flush()  # the first lost version, reported once ...
    cache.flush()  # ... and only once
    cache.close()
    reopened = tiercache.open({"disk": {"path": str(tmp_path)}})
    assert [(v.step, v.parent) for v in reopened.versions()] == [(3, None)]  # no lost version is a parent


def test_on_error_raise_reports_a_lost_version_after_staging_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(tier: DiskTier, key: str, data: object, **kw: bool) -> None:
        raise StorageError("injected")

    cache = tiercache.open({"disk": {"path": str(tmp_path)}, "engine": {"on_error": "raise"}})
    monkeypatch.setattr(DiskTier, "put", broken)
    h1 = cache.save(_state(1), step=1)
    with pytest.raises(StorageError):
        h1.wait("durable")
    monkeypatch.undo()
    with pytest.raises(StorageError, match="injected") as raised:
        cache.save(_state(1, seed=2), step=2)
    h2 = raised.value.handle  # the new version was staged before the old loss was raised
    assert h2.wait("local") == h2.version
    cache.close()
    restored = tiercache.open({"disk": {"path": str(tmp_path)}}).restore("main")
    assert torch.equal(restored["w0"], _state(1, seed=2)["w0"])


def test_background_failure_surfaces_on_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tier: DiskTier, key: str, data: object, **kw: bool) -> None:
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
    def broken(flat: object, layout: object, views: list, copied: list, **kw: object) -> None:
        copied[0].set()  # the hasher may already be working on the first chunk
        raise RuntimeError("device lost mid-copy")

    cfg = {"ram": {"capacity": "64MiB", "serve_reads": False}, "disk": {"path": str(tmp_path)}}
    with tiercache.open(cfg) as cache:
        monkeypatch.setattr(cache.engine._stager, "copy_in", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            cache.save(_state(2, 1 << 20), step=1)
        monkeypatch.undo()
        cache.flush()
        assert cache.engine.local.ramcache.arena is not None and cache.engine.local.ramcache.arena.used_bytes == 0
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
        assert core_of(cache).meter.rate("disk", "write") == pytest.approx(seen)
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
        first = cache.engine.local.placement.context().versions
        again = cache.engine.local.placement.context().versions
        # Nothing moved: every view is the same object (a decision costs no rebuild per version).
        assert len(first) == 6 and all(a is b for a, b in zip(first, again, strict=True))
        oldest = first[0]
        cache.evict(oldest.id, "ram")
        after = cache.engine.local.placement.context().versions
        assert after[0] is not oldest and after[0].tiers == frozenset({"disk"})
        assert oldest.tiers == frozenset({"ram", "disk"})
        assert all(a is b for a, b in zip(first[1:], after[1:], strict=True))


def test_prepare_faults_the_arena_in_before_the_first_save(tmp_path: Path) -> None:
    state = _state(2, 1 << 18)
    with tiercache.open({"ram": {"capacity": "32MiB"}, "disk": {"path": str(tmp_path)}}) as cache:
        arena = cache.engine.local.ramcache.arena
        assert arena is None or not arena.is_allocated  # opening allocates nothing
        cache.prepare(wait=True)
        arena = cache.engine.local.ramcache.arena
        assert arena is not None and arena.is_allocated and arena.capacity == 32 << 20
        h = cache.save(state, step=1)
        assert cache.engine.local.ramcache.arena is arena and h.wait("local") == h.version
        assert torch.equal(cache.restore(h.version)["w1"], state["w1"])
        cache.prepare()  # again: nothing to do
        assert cache.engine.local.ramcache.arena is arena


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
        assert cache.engine.local.ramcache.arena is None or not cache.engine.local.ramcache.arena.is_allocated
        cache.prepare(_state(2, 1 << 20), wait=True)  # two versions of 8 MiB, at least 64 MiB
        assert cache.engine.local.ramcache.arena is not None and cache.engine.local.ramcache.arena.capacity == 64 << 20
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


def _hash_after_begun(monkeypatch: pytest.MonkeyPatch, early: list[bool] | None = None) -> list[int]:
    """Hold the hashing of each chunk until the disk writer has begun writing it early.

    Without this a small chunk is hashed before the writer gets to it and is written the plain
    way. ``early`` says which chunks (in order) are to be written early, if not all; the others
    are hashed once the early writes before them began. Returns the sizes of the early writes
    begun.
    """
    from tiercache import codecs

    sizes: list[int] = []
    begun = threading.Condition()
    hashed = [0]
    real_begin, real_id = DiskTier.begin_put, codecs.content_id

    def begin_put(self: DiskTier, nbytes: int, under: str, **kw: bool) -> object:
        with begun:
            sizes.append(nbytes)
            begun.notify_all()
        return real_begin(self, nbytes, under, **kw)

    def content_id(data: object, algo: str) -> str:
        with begun:
            need = hashed[0] + 1 if early is None else sum(early[: hashed[0] + 1])
            assert begun.wait_for(lambda: len(sizes) >= need, timeout=30), "no early write began"
            hashed[0] += 1
        return real_id(data, algo)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "begin_put", begin_put)
    monkeypatch.setattr(codecs, "content_id", content_id)
    return sizes


def test_early_disk_writes_of_stored_chunks_are_dropped_and_free_their_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(4, 1 << 20)
    state["twin"] = state["w0"].clone()  # the same bytes twice within one version
    cfg = {"ram": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path)}, "chunk_bytes": "1MiB",
           "policy": {"name": "write-through"}}  # raw chunks (an adaptive policy may compress them)
    with tiercache.open(cfg) as cache:
        begun = _hash_after_begun(monkeypatch)
        v1 = cache.save(state, step=1)
        v1.wait("local")
        assert len(begun) == 20  # every chunk, the twin's too, was written before it was hashed
        files = _chunk_files(tmp_path)
        assert len(files) == 16  # ... and the twin's four were dropped as w0's
        arena = cache.engine.local.ramcache.arena
        held = arena.capacity - arena.free_bytes
        # Identical: every chunk is in RAM already, so the hasher hands each staged copy to the
        # early write still reading it, which frees it.
        v2 = cache.save(state, step=2)
        v2.wait("local")
        cache.flush()
        assert len(begun) == 40
        assert arena.capacity - arena.free_bytes == held  # all of v2's staging went back to the arena
        assert _chunk_files(tmp_path) == files
        assert list(tmp_path.rglob(".tmp-*")) == []
        m1, m2 = cache.manifest(v1.version), cache.manifest(v2.version)
        assert [c.id for c in m2.chunks] == [c.id for c in m1.chunks]
        got = cache.restore(v2.version)
    for k, v in state.items():
        assert torch.equal(got[k], v)


def test_only_chunks_that_changed_last_time_are_written_before_their_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    state = {"frozen": torch.randn(3 << 18), "trained": torch.randn(2 << 18)}  # 3 and 2 chunks of 1 MiB
    # Raw chunks: the default policy may compress them once it measured the disk (a loaded machine's
    # disk looks slow), and an encoded chunk is never written before its hash.
    with tiercache.open({"disk": {"path": str(tmp_path)}, "chunk_bytes": "1MiB",
                         "policy": {"name": "write-through"}}) as cache:
        engine = cache.engine.local
        for step in (1, 2, 3):
            state["trained"].add_(1)
            cache.save(state, step=step).wait("local")
        disk = engine.repo.durable["disk"]
        layout = engine.hasher.last_layout
        job = SimpleNamespace(layout=layout, ready=[None] * 5, committer=None)
        assert engine.early_hint(job, disk, "raw/1") == [False, False, False, True, True]
        assert engine.early_hint(job, disk, "zstd/1") == [False] * 5  # encoded: size unknown
        other = SimpleNamespace(layout=object(), ready=[None] * 2, committer=None)
        assert engine.early_hint(other, disk, "raw/1") == [True, True]  # no history: all
        assert len(_chunk_files(tmp_path)) == 3 + 2 * 3
        # The writer follows the hint: the trained chunks go early (their hashing waits for
        # that), the frozen ones are hashed first, found stored, and never written.
        begun = _hash_after_begun(monkeypatch, early=[False, False, False, True, True])
        from tiercache import codecs

        lent: list[int] = []
        hinted = threading.Event()
        from tiercache.pipeline.writer import TierWriter

        real_lend, real_hint, gated_id = TierWriter._lend_region, type(engine).early_hint, codecs.content_id

        def lend(self: object, job: object, i: int) -> object:
            lent.append(i)
            return real_lend(self, job, i)  # type: ignore[arg-type]

        def hint(self: object, *args: object) -> list[bool]:
            out = real_hint(self, *args)  # type: ignore[arg-type]
            hinted.set()
            return out

        def content_id(data: object, algo: str) -> str:
            if not hinted.is_set():
                # A writer that lent every unhashed chunk would have lent the frozen ones by now.
                assert hinted.wait(30)
                time.sleep(0.2)
            return gated_id(data, algo)  # type: ignore[arg-type]

        monkeypatch.setattr(TierWriter, "_lend_region", lend)
        monkeypatch.setattr(type(engine), "early_hint", hint)
        monkeypatch.setattr(codecs, "content_id", content_id)
        state["trained"].add_(1)
        cache.save(state, step=4).wait("local")
        assert lent == [3, 4]
        assert begun == [4096 + (1 << 20)] * 2
        assert len(_chunk_files(tmp_path)) == 3 + 2 * 4
        assert list(tmp_path.rglob(".tmp-*")) == []
        got = cache.restore("main")
    assert torch.equal(got["trained"], state["trained"]) and torch.equal(got["frozen"], state["frozen"])


@pytest.mark.parametrize("early", [True, False])
def test_a_version_syncs_each_chunk_directory_once_after_its_chunks_and_before_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early: bool
) -> None:
    import tiercache.tiers.disk as diskmod

    events: list[tuple[str, str]] = []
    real_sync, real_put, real_store = diskmod._fsync_dir, diskmod.PendingPut.commit_path, diskmod.DiskTier.put
    # The saving process's status (stats/) is written on its own schedule, not part of the version:
    # the syncs its put makes (of stats/, and of the root when it creates stats/, which a loaded
    # machine may schedule while the chunks are written) are not counted.
    in_stats = threading.local()

    def put(self: diskmod.DiskTier, key: str, data: Any, **kw: Any) -> None:
        in_stats.on = key.startswith("stats/")
        try:
            real_store(self, key, data, **kw)
        finally:
            in_stats.on = False

    def fsync_dir(path: str) -> None:
        if not getattr(in_stats, "on", False):
            events.append(("sync", os.path.relpath(path, tmp_path)))
        real_sync(path)

    def commit_path(self: diskmod.PendingPut, path: str, key: str) -> None:
        real_put(self, path, key)
        if not key.startswith("stats/"):
            events.append(("put", key))

    monkeypatch.setattr(diskmod, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(diskmod.PendingPut, "commit_path", commit_path)
    monkeypatch.setattr(diskmod.DiskTier, "put", put)
    begun = _hash_after_begun(monkeypatch) if early else []  # every chunk goes the early way
    cfg = {"disk": {"path": str(tmp_path)}, "chunk_bytes": "1MiB", "policy": {"name": "write-through"}}
    with tiercache.open(cfg) as cache:
        cache.engine.local.early_writes = early
        v = cache.save(_state(4, 1 << 20), step=1)
        v.wait("local")
        assert len(begun) == (16 if early else 0)
        chunk_dirs = sorted({f"chunks/{c.id[:2]}" for c in cache.manifest(v.version).chunks})
    first_manifest = events.index(("put", f"versions/{v.version}.json"))
    before = events[:first_manifest]
    puts = [k for op, k in before if op == "put"]
    assert len(puts) == 16 and all(k.startswith("chunks/") for k in puts)
    last_chunk = max(i for i, e in enumerate(before) if e[0] == "put")
    synced = [p for op, p in before[last_chunk + 1 :] if op == "sync"]
    assert sorted(p for p in synced if p.startswith("chunks/")) == chunk_dirs
    assert [p for op, p in before[: last_chunk + 1] if op == "sync"] == []  # none while chunks are written


def test_a_failed_chunk_write_fails_the_level_only_after_the_other_writes_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiercache.tiers.disk as diskmod

    started = threading.Semaphore(0)
    gate = threading.Event()
    calls = [0]
    lock = threading.Lock()
    real = diskmod.PendingPut.write

    def write(self: diskmod.PendingPut, offset: int, src: object) -> None:
        if memoryview(src).nbytes >= 1 << 20:  # a chunk's payload, not a manifest
            with lock:
                calls[0] += 1
                first = calls[0] == 1
            started.release()
            if first:
                assert started.acquire(timeout=30) and started.acquire(timeout=30)  # both writes are running
                raise StorageError("injected failure of one chunk")
            gate.wait(30)
        real(self, offset, src)

    monkeypatch.setattr(diskmod.PendingPut, "write", write)
    cfg = {"disk": {"path": str(tmp_path)}, "chunk_bytes": "1MiB", "policy": {"name": "write-through"}}
    cache = tiercache.open(cfg)
    h = cache.save(_state(2, 1 << 18), step=1)
    # The other chunk is still being written from the arena: the version must not fail (and give
    # its staging back to the next save) before that write has ended.
    with pytest.raises(TimeoutError):
        h.wait("local", timeout=0.5)
    gate.set()
    with pytest.raises(StorageError, match="injected failure of one chunk"):
        h.wait("local")
    with pytest.raises(StorageError):
        cache.close()


def test_chunks_written_before_their_hash_hold_a_bounded_number_of_open_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiercache.pipeline.writer as writer_mod
    import tiercache.tiers.disk as diskmod

    monkeypatch.setattr(writer_mod, "EARLY_AHEAD", 2)
    begun = _hash_after_begun(monkeypatch)
    open_now, most = [0], [0]
    lock = threading.Lock()
    real_init, real_abort = diskmod.PendingPut.__init__, diskmod.PendingPut.abort

    def init(self: diskmod.PendingPut, *a: object, **kw: object) -> None:
        real_init(self, *a, **kw)  # type: ignore[arg-type]
        with lock:
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])

    def abort(self: diskmod.PendingPut) -> None:  # every PendingPut ends with it, committed or not
        if not getattr(self, "_counted_out", False):
            self._counted_out = True
            with lock:
                open_now[0] -= 1
        real_abort(self)

    monkeypatch.setattr(diskmod.PendingPut, "__init__", init)
    monkeypatch.setattr(diskmod.PendingPut, "abort", abort)
    cfg = {"disk": {"path": str(tmp_path), "io_threads": 2}, "chunk_bytes": "1MiB",
           "policy": {"name": "write-through"}}
    state = _state(4, 1 << 20)  # 16 chunks
    with tiercache.open(cfg) as cache:
        cache.save(state, step=1).wait("local")
        got = cache.restore("main")
    assert len(begun) == 16
    assert open_now[0] == 0
    assert most[0] <= 2 + 2  # _EARLY_AHEAD + io threads (16 open at once without the bound)
    for k, v in state.items():
        assert torch.equal(got[k], v)


def test_a_version_whose_placement_fails_settles_its_manifest_future(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever waits for a version's manifest (the node agent, a group) learns why it never came."""
    boom = StorageError("injected: the policy broke")
    asked, go = threading.Event(), threading.Event()

    def broken(*args: object) -> None:
        asked.set()
        go.wait(10)
        raise boom

    cache = tiercache.open({"ram": {"capacity": "8MiB"}, "disk": {"path": str(tmp_path / "d")},
                            "policy": {"name": "write-through"}})
    engine = cache.engine.local
    monkeypatch.setattr(engine.placement.policy, "place", broken)
    h = cache.save(_state(), step=1)
    assert asked.wait(10)
    manifest = engine.published(h.version)
    assert manifest is not None and not manifest.done()
    go.set()
    assert manifest.exception(timeout=10) is boom
    with pytest.raises(StorageError, match="injected: the policy broke"):
        h.wait("local", timeout=10)
    with pytest.raises(StorageError, match="injected: the policy broke"):  # the lost version, reported
        cache.close()


def test_a_version_whose_copy_fails_after_its_first_chunk_was_hashed_leaves_nothing_pinned_in_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 0 is copied and hashed into RAM (pinned for the version in flight), then the copy fails.

    The failed version must let that chunk go: a chunk pinned for good is never dropped and keeps
    the arena from growing, so a later save could wait for room that never comes.
    """
    from tiercache.pipeline import staging

    data = torch.randn(1 << 20)  # 4 MiB: 16 chunks of 256 KiB, one copy slice each
    # One copy thread: the hasher takes each chunk as it is copied (with every core copying, it
    # waits for the whole version).
    cfg = {"ram": {"capacity": "64MiB", "copy_threads": 1}, "disk": {"path": str(tmp_path / "disk")},
           "chunk_bytes": "256KiB", "policy": {"name": "write-through"}}
    with tiercache.open(cfg) as cache:
        ram = cache.engine.local.ramcache
        real = staging._memmove

        def failing(dst: int, src: int, nbytes: int) -> object:
            if src == data.data_ptr():  # chunk 0's slice
                return real(dst, src, nbytes)
            deadline = time.monotonic() + 30
            while not (ram.ram is not None and ram.ram.list("chunks/")) and time.monotonic() < deadline:
                time.sleep(0.005)  # until the hasher took chunk 0 into RAM
            raise OSError("bad page")

        monkeypatch.setattr(staging, "_memmove", failing)
        with pytest.raises(OSError, match="bad page"):
            cache.save({"w": data}, step=1)
        monkeypatch.setattr(staging, "_memmove", real)
        cache.flush()  # the hasher has failed the version (the copy's error was raised above, not again)
        assert ram.ram is not None and ram.arena is not None
        held = ram.ram.list("chunks/")
        assert len(held) == 1  # chunk 0, hashed before the copy failed
        ram.evict(held)  # nothing pins it now: it goes
        assert ram.ram.list("chunks/") == []
        # (The failed version's disk writer may still be reading it: its region returns as it ends.)
        deadline = time.monotonic() + 30
        while ram.arena.in_use != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ram.arena.in_use == (0, 0)
        again = cache.save({"w": data}, step=1)
        assert again.wait("local", timeout=30) == again.version
    with tiercache.open({"disk": cfg["disk"]}) as reader:
        assert torch.equal(reader.restore(again.version)["w"], data)
        assert [v.id for v in reader.versions()] == [again.version]
