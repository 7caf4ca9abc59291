"""``restore(into=...)`` of many tiny tensors: matched over whole lists, copied in bulk, bit-exact.

The bulk copy writes through one ``numpy`` view spanning the destinations' addresses, so every test
here checks the bytes around each destination as well as the destination itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercache
from tiercache import restore as restore_module
from tiercache.errors import StateMismatchError

_DTYPES = (torch.float32, torch.int8, torch.float64, torch.int16, torch.bfloat16, torch.bool, torch.uint8)


def _config(root: Path) -> dict[str, Any]:
    return {"disk": {"path": str(root)}, "policy": {"name": "write-through"}, "chunk_bytes": "256KiB",
            "pack_below": "64KiB"}


def _tiny_state(count: int) -> dict[str, torch.Tensor]:
    """``count`` tensors of 1-300 elements of mixed dtypes: sizes that are and are not multiples of 16."""
    g = torch.Generator().manual_seed(count)
    out = {}
    for i in range(count):
        n = 256 if i % 3 else 1 + (i * 37) % 300
        t = torch.randint(-100, 100, (n,), generator=g).to(_DTYPES[i % len(_DTYPES)])
        out[f"layers.{i // 4}.p{i % 4}"] = t.view(4, n // 4) if n == 256 and i % 2 else t
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _guarded_into(state: dict[str, torch.Tensor], block: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Views of ``block`` shaped like ``state``, at 64-byte aligned offsets and, every fifth, 8 bytes past one.

    Returns the views and a mask of the bytes of ``block`` no view covers (each view has guard
    bytes on both sides).
    """
    into, covered, pos = {}, torch.zeros(block.numel(), dtype=torch.bool), 64
    for i, (k, v) in enumerate(state.items()):
        start = pos + (8 if i % 5 == 0 else 0)
        start += -start % v.element_size()
        into[k] = block[start : start + v.nbytes].view(v.dtype).view(v.shape)
        covered[start : start + v.nbytes] = True
        pos = (start + v.nbytes + 64 + 63) // 64 * 64
    assert pos <= block.numel()
    return into, ~covered


def test_copy_pieces_copies_every_piece_and_nothing_else() -> None:
    g = np.random.default_rng(3)
    src = g.integers(0, 256, 2 << 20, dtype=np.uint8)
    for aligned, in_order in ((True, True), (True, False), (False, True)):
        dst = np.full(4 << 20, 0xAB, dtype=np.uint8)
        lengths = (g.integers(1, 40, 500) * (64 if aligned else 1)).astype(np.int64)
        lengths[::50] = 70_000  # long pieces go one by one
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)  # source: one run
        if not in_order:
            starts = starts + np.arange(500, dtype=np.int64) * 64  # gaps between the source pieces
        assert int((starts + lengths).max()) <= src.size
        at = np.concatenate(([128], 128 + np.cumsum(lengths + 192)[:-1])).astype(np.int64)  # destination gaps
        order = g.permutation(500)  # destinations in another order than the sources
        base_d, base_s = dst.ctypes.data, src.ctypes.data
        restore_module.copy_pieces(at[order] + base_d, starts[order] + base_s, lengths[order])
        want = np.full_like(dst, 0xAB)
        for a, s, n in zip(at.tolist(), starts.tolist(), lengths.tolist(), strict=True):
            want[a : a + n] = src[s : s + n]
        assert np.array_equal(dst, want), (aligned, in_order)


def test_many_tiny_tensors_restore_bit_exact_in_place_and_nothing_around_them_changes(tmp_path: Path) -> None:
    state = _tiny_state(3000)
    with tiercache.open(_config(tmp_path)) as cache:
        cache.save(state, step=1).wait("local")
    block = torch.full((4 << 20,), 0xAB, dtype=torch.uint8)
    into, outside = _guarded_into(state, block)
    ptrs = {k: t.data_ptr() for k, t in into.items()}
    with tiercache.open(_config(tmp_path)) as cache:
        plan = restore_module.plan_into(cache.manifest("main"), restore_module.into_targets(into), strict=True)
        assert plan.all_direct  # matched over whole lists, read straight into every tensor
        out = cache.restore("main", into=into)
    assert all(out[k] is into[k] and into[k].data_ptr() == ptrs[k] for k in state)
    assert all(torch.equal(_bits(into[k]), _bits(v)) for k, v in state.items())
    assert bool((block[outside] == 0xAB).all())


def test_tensors_with_a_negation_or_conjugation_bit_are_filled_in_place(tmp_path: Path) -> None:
    # Before: such a tensor of into was copied (its bit resolved) and the copy filled; the tensor
    # passed in kept its old values.
    saved = {"re": torch.arange(6.0), "c": torch.randn(5, dtype=torch.complex64), "neg": torch.randn(4)}
    with tiercache.open(_config(tmp_path)) as cache:
        cache.save(saved, step=1).wait("local")
        backing = torch.zeros(5, dtype=torch.complex64)
        negated = torch.zeros(4)
        into = {"re": torch.zeros(6), "c": backing.conj(), "neg": torch._neg_view(negated)}
        assert into["c"].is_conj() and into["neg"].is_neg()
        out = cache.restore("main", into=into)
    assert torch.equal(into["c"].resolve_conj(), saved["c"]) and torch.equal(backing, saved["c"].conj())
    assert torch.equal(into["neg"].resolve_neg(), saved["neg"]) and torch.equal(negated, -saved["neg"])
    assert out["c"] is into["c"] and out["neg"] is into["neg"] and torch.equal(out["re"], saved["re"])


@pytest.mark.parametrize("wrong", ["dtype", "shape"])
def test_a_mismatch_among_many_tensors_names_the_key_and_writes_nothing(tmp_path: Path, wrong: str) -> None:
    state = _tiny_state(2000)
    with tiercache.open(_config(tmp_path)) as cache:
        cache.save(state, step=1).wait("local")
    into = {k: torch.full_like(v, 7) for k, v in state.items()}
    key = "layers.400.p1"
    saved = state[key]
    into[key] = torch.full(saved.shape, 7, dtype=torch.float64) if wrong == "dtype" else torch.full((3, 5), 7.0)
    what = f"torch.float64{list(saved.shape)}" if wrong == "dtype" else "torch.float32[3, 5]"
    with tiercache.open(_config(tmp_path)) as cache, pytest.raises(StateMismatchError) as e:
        cache.restore("main", into=into)
    assert str(e.value) == (f"restore into: {key!r} is {what} but the saved tensor is "
                            f"{saved.dtype}{list(saved.shape)}; nothing was read")
    assert all(bool((_bits(t) == _bits(torch.full_like(t, 7))).all()) for t in into.values())
