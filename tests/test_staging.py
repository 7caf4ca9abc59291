"""The staging copy: every thread count lays out the same bytes, chunks are announced only when complete."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tiercache
from tiercache.codecs import HEADER_BYTES
from tiercache.format import flatten
from tiercache.layout import Layout, plan_layout
from tiercache.pipeline import staging
from tiercache.pipeline.staging import Stager, plan_copy


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
    plan = plan_copy(_layout(flat))
    layout = plan.layout
    # Garbage in the regions: staging must overwrite every payload byte and zero the pack gaps.
    views = [torch.full((c.staged_bytes,), 0xAB, dtype=torch.uint8) for c in layout.chunks]
    copied = [threading.Event() for _ in layout.chunks]
    stager = Stager(threads)
    try:
        stager.copy_in(flat, plan, views, copied)
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
    plan = plan_copy(plan_layout([flat.metas[0].nbytes], [1], chunk_bytes=16 << 20, pack_below=1 << 20))
    views = [torch.zeros(c.staged_bytes, dtype=torch.uint8) for c in plan.layout.chunks]
    copied = [threading.Event()]
    seen: list[bool] = []
    real = staging._memmove

    def watched(dst: int, src: int, nbytes: int) -> object:
        seen.append(copied[0].is_set())  # before this slice, the chunk must not be announced
        return real(dst, src, nbytes)

    monkeypatch.setattr(staging, "_memmove", watched)
    stager = Stager(2)
    try:
        stager.copy_in(flat, plan, views, copied)
    finally:
        stager.close()
    assert seen == [False, False, False]
    assert copied[0].is_set()
    assert torch.equal(views[0][HEADER_BYTES:HEADER_BYTES + (12 << 20)].view(torch.float32), state["w"])


def test_a_failing_slice_is_raised_and_no_slice_starts_after(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.ones(16 << 20, dtype=torch.uint8)}  # four 4 MiB slices of one chunk
    flat = flatten(state)
    plan = plan_copy(plan_layout([16 << 20], [1], chunk_bytes=32 << 20, pack_below=1 << 20))
    views = [torch.zeros(c.staged_bytes, dtype=torch.uint8) for c in plan.layout.chunks]
    copied = [threading.Event()]
    calls: list[str] = []
    second_started = threading.Event()
    raising = threading.Event()
    real = staging._memmove

    def failing(dst: int, src: int, nbytes: int) -> object:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            second_started.wait(5)  # the other thread is inside the second slice
            raising.set()
            raise OSError("bad page")
        second_started.set()
        raising.wait(5)
        time.sleep(0.2)  # the failure is recorded before this slice returns
        return real(dst, src, nbytes)

    monkeypatch.setattr(staging, "_memmove", failing)
    stager = Stager(2)
    try:
        with pytest.raises(OSError, match="bad page"):
            stager.copy_in(flat, plan, views, copied)
        n = len(calls)
    finally:
        stager.close()
    # Two slices ran, one on each thread; the third and fourth never started, and the chunk was
    # never announced as copied.
    assert n == 2 and len(calls) == 2 and len(set(calls)) == 2
    assert not copied[0].is_set()
    payload = views[0][HEADER_BYTES : HEADER_BYTES + (16 << 20)]
    assert int(payload.sum()) == 4 << 20  # exactly the one slice that was copied


def test_copy_threads_config_is_checked() -> None:
    with pytest.raises(tiercache.ConfigError, match="copy_threads"):
        tiercache.open({"ram": {"copy_threads": 0}})
    with pytest.raises(ValueError, match="at least 1 thread"):
        Stager(0)


def test_a_deferred_copy_completes_the_chunks_it_shares_with_the_copy_before_return() -> None:
    state = _odd_state()
    flat = flatten(state)
    plan = plan_copy(_layout(flat))
    layout = plan.layout
    paths = [m.path for m in flat.metas]
    later = frozenset(i for i, p in enumerate(paths) if p in {"big", "small/3", "small/20", "step"})
    pieces = layout.tensor_pieces
    deferred_chunks = {ci for ti in later for ci, _ in pieces[ti]}
    mixed = {ci for ti, ps in enumerate(pieces) if ti not in later for ci, _ in ps} & deferred_chunks
    assert mixed  # a pack holds deferred and immediate tensors: its event waits for both parts
    views = [torch.full((c.staged_bytes,), 0xAB, dtype=torch.uint8) for c in layout.chunks]
    reference, _ = _stage(1, state)
    early: list[int] = []

    class Checked(threading.Event):
        """Records a chunk announced before its bytes are all in place."""

        def __init__(self, ci: int) -> None:
            super().__init__()
            self.ci = ci

        def set(self) -> None:
            c = layout.chunks[self.ci]
            if not torch.equal(views[self.ci][HEADER_BYTES : HEADER_BYTES + c.nbytes], reference[self.ci]):
                early.append(self.ci)
            super().set()

    copied: list[threading.Event] = [Checked(ci) for ci in range(len(layout.chunks))]
    stager = Stager(2)
    gate = threading.Event()
    try:
        stager._later.submit(gate.wait)  # hold the deferred copy until the checks below
        pending = stager.copy_in(flat, plan, views, copied, later=later)
        assert pending is not None and not pending.done()
        assert [e.is_set() for e in copied] == [ci not in deferred_chunks for ci in range(len(layout.chunks))]
        gate.set()
        pending.result(timeout=30)
    finally:
        gate.set()
        stager.close()
    assert all(e.is_set() for e in copied)
    assert early == []
    for v, c, want in zip(views, layout.chunks, reference, strict=True):
        assert torch.equal(v[HEADER_BYTES : HEADER_BYTES + c.nbytes], want)
