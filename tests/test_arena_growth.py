"""An automatically sized RAM arena grows with the state; only a capacity the user set can be too small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.errors import TierFullError
from tiercache.pipeline.ramcache import auto_arena_limit

MB = 10**6


def _state(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(nbytes // 4, generator=g), "b": torch.rand(1000, generator=g)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_state_that_grows_is_saved_with_the_default_config(tmp_path: Path) -> None:
    # The first save comes before the optimizer has state (small); later ones are larger than
    # the 64 MiB the arena started with.
    states = [_state(2 * MB, 0), _state(80 * MB, 1), _state(90 * MB, 2)]
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        ids = [cache.save(s, step=i).wait("local") for i, s in enumerate(states)]
        arena = cache.engine.local.ramcache.capacity
    # Two versions of the first state that did not fit (80 MB); the 90 MB one fitted in that.
    assert 2 * 80 * MB <= arena < 2 * 81 * MB
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        assert [v.id for v in cache.versions()] == ids
        assert all(_equal(cache.restore(i), s) for i, s in zip(ids, states, strict=True))


def test_an_auto_arena_is_sized_by_the_first_save_and_keeps_a_ram_only_cache_whole(tmp_path: Path) -> None:
    # [ram] capacity = "auto" was always 64 MiB: a 94 MB state failed on its first save.
    with tiercache.open({"ram": {"capacity": "auto"}}) as cache:
        small = _state(10 * MB, 3)
        first = cache.save(small, step=1).wait("staged")
        big = _state(94 * MB, 4)
        second = cache.save(big, step=2).wait("staged")
        # RAM is this cache's only tier: the first version moved into the larger arena with it.
        assert _equal(cache.restore(first), small) and _equal(cache.restore(second), big)


def test_only_a_capacity_the_user_set_can_be_too_small_and_the_error_names_it(tmp_path: Path) -> None:
    with (tiercache.open({"ram": {"capacity": "32MiB"}, "disk": {"path": str(tmp_path)}}) as cache,
          pytest.raises(TierFullError) as info):
        cache.save(_state(40 * MB, 5), step=1)
    staged = int(str(info.value).split()[3])
    assert str(info.value) == (f"a version needs {staged} bytes of RAM arena but ram.capacity is set to "
                               f"{32 << 20} bytes: raise ram.capacity to at least {staged} bytes")
    assert staged >= 40 * MB


def test_an_automatic_arena_is_bounded_by_half_the_nodes_memory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.pipeline.ramcache as ramcache

    monkeypatch.setattr(ramcache, "node_memory", lambda: 100 * MB)  # a node of 100 MB: at most 50 MB
    assert auto_arena_limit() == 50 * MB // 4096 * 4096
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        with pytest.raises(TierFullError) as info:
            cache.save(_state(60 * MB, 6), step=1)
        assert "more than an automatic arena may take (49999872 bytes, 50% of this node's memory): " \
               "set ram.capacity, or save a smaller state" in str(info.value)
        state = _state(30 * MB, 7)  # fits within the bound: grows to the bound, not to two versions
        vid = cache.save(state, step=2).wait("local")
        assert cache.engine.local.ramcache.capacity == 49999872
        assert _equal(cache.restore(vid), state)
