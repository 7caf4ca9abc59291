"""The staging copy: every thread count lays out the same bytes, chunks are announced only when complete."""

from __future__ import annotations

import threading

import pytest
import torch

import tiercache
from tiercache import staging
from tiercache.codecs import HEADER_BYTES
from tiercache.format import flatten
from tiercache.layout import Layout, plan_layout
from tiercache.staging import Stager


def _odd_state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3000, 1000, generator=g)  # 12 MB: several chunks and several slices
    z = torch.complex(torch.randn(5000, generator=g), torch.randn(5000, generator=g))
    return {
        "big": big,
        "big_t": big.t(),  # strided, spans several chunks: copied through a contiguous temporary
        "col": big[:, 7],  # strided, one piece: copied in place with copy_
        "conj": z.conj(),  # conjugate bit: memcpy would copy the wrong values
        "neg": torch._neg_view(torch.randn(300, generator=g)),
        "bf16": torch.randn(70_000, generator=g).to(torch.bfloat16),
        "mask": torch.rand(999, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "small": [torch.full((n,), float(n)) for n in range(1, 40)],
        "step": torch.tensor(11),
    }


def _layout(flat: object, chunk_bytes: int = 4 << 20) -> Layout:
    sizes = [m.nbytes for m in flat.metas]  # type: ignore[attr-defined]
    return plan_layout(sizes, [1] * len(sizes), chunk_bytes=chunk_bytes, pack_below=64 << 10)


def _stage(threads: int, state: dict) -> tuple[list[torch.Tensor], Layout]:
    flat = flatten(state)
    layout = _layout(flat)
    # Garbage in the regions: staging must overwrite every payload byte and zero the pack gaps.
    views = [torch.full((c.staged_bytes,), 0xAB, dtype=torch.uint8) for c in layout.chunks]
    copied = [threading.Event() for _ in layout.chunks]
    stager = Stager(threads)
    try:
        stager.copy_in(flat, layout, views, copied)
    finally:
        stager.close()
    assert all(e.is_set() for e in copied)
    return [v[HEADER_BYTES : HEADER_BYTES + c.nbytes] for v, c in zip(views, layout.chunks, strict=True)], layout


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_parallel_staging_writes_exactly_the_bytes_of_one_thread(threads: int) -> None:
    state = _odd_state()
    one, layout = _stage(1, state)
    many, _ = _stage(threads, state)
    assert len(layout.chunks) > 4
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)
    # The regions started as 0xAB garbage: every byte of a pack not covered by a tensor is zero.
    packs = [(payload, c) for payload, c in zip(many, layout.chunks, strict=True) if c.packed]
    assert packs
    for payload, c in packs:
        covered = torch.zeros(c.nbytes, dtype=torch.bool)
        for p in c.pieces:
            covered[p.chunk_offset : p.chunk_offset + p.nbytes] = True
        assert (~covered).any() and not payload[~covered].any()


def test_staged_bytes_are_the_tensors_values(tmp_path: object) -> None:
    state = _odd_state()
    cfg = {"ram": {"capacity": "128MiB", "copy_threads": 3}, "chunk_bytes": "1MiB"}
    with tiercache.open(cfg) as cache:
        h = cache.save(state, step=1)
        got = cache.restore(h.version)
    for key in ("big", "big_t", "col", "conj", "neg", "bf16", "mask", "empty", "step"):
        assert got[key].dtype == state[key].dtype and torch.equal(got[key], state[key].resolve_conj().resolve_neg())
        assert not got[key].is_conj() and not got[key].is_neg()
    assert all(torch.equal(a, b) for a, b in zip(got["small"], state["small"], strict=True))


def test_a_chunk_is_announced_only_after_its_last_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: three slices per 12 MiB chunk
    flat = flatten(state)
    layout = plan_layout([flat.metas[0].nbytes], [1], chunk_bytes=16 << 20, pack_below=1 << 20)
    views = [torch.zeros(c.staged_bytes, dtype=torch.uint8) for c in layout.chunks]
    copied = [threading.Event()]
    seen: list[bool] = []
    real = staging._memmove

    def watched(dst: int, src: int, nbytes: int) -> object:
        seen.append(copied[0].is_set())  # before this slice, the chunk must not be announced
        return real(dst, src, nbytes)

    monkeypatch.setattr(staging, "_memmove", watched)
    stager = Stager(2)
    try:
        stager.copy_in(flat, layout, views, copied)
    finally:
        stager.close()
    assert seen == [False, False, False]
    assert copied[0].is_set()
    assert torch.equal(views[0][HEADER_BYTES:HEADER_BYTES + (12 << 20)].view(torch.float32), state["w"])


def test_a_failing_slice_in_a_helper_is_raised_and_no_copy_runs_after(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.ones(8 << 20, dtype=torch.uint8)}  # two slices
    flat = flatten(state)
    layout = plan_layout([8 << 20], [1], chunk_bytes=16 << 20, pack_below=1 << 20)
    views = [torch.zeros(c.staged_bytes, dtype=torch.uint8) for c in layout.chunks]
    copied = [threading.Event()]
    calls: list[str] = []
    finished = threading.Event()

    def failing(dst: int, src: int, nbytes: int) -> object:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            # Let the other thread take the second slice, then fail this one.
            finished.wait(5)
            raise OSError("bad page")
        finished.set()
        return None

    monkeypatch.setattr(staging, "_memmove", failing)
    stager = Stager(2)
    try:
        with pytest.raises(OSError, match="bad page"):
            stager.copy_in(flat, layout, views, copied)
        n = len(calls)
    finally:
        stager.close()
    assert n == 2 and len(calls) == 2
    assert len(set(calls)) == 2  # the caller and the helper each took one slice


def test_copy_threads_config_is_checked() -> None:
    with pytest.raises(tiercache.ConfigError, match="copy_threads"):
        tiercache.open({"ram": {"copy_threads": 0}})
    with pytest.raises(ValueError, match="at least 1 thread"):
        Stager(0)
