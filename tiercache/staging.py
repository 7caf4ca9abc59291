"""Staging: copying a state's tensors into their chunk regions of the RAM arena.

This is the only work ``save()`` makes training wait for, so it uses every core it is given:
the calling thread and ``threads - 1`` helper threads copy slices of the state side by side
(training is blocked in ``save()`` meanwhile, so those cores are otherwise idle). Contiguous CPU
tensors are copied with a plain memcpy, which releases the GIL; anything else (strided views,
conjugate/negative bits) with ``Tensor.copy_``. Pack gaps are zeroed so a pack's hash depends
only on its content, and each chunk is announced as soon as its last byte is in place, so
hashing and writing start while later chunks are still being copied. CUDA sources are copied
with non-blocking copies on a side stream into the (pinned) arena and synchronised once.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import torch

from tiercache.codecs import HEADER_BYTES
from tiercache.config import usable_cores
from tiercache.format import Flat
from tiercache.layout import Layout

# Work is handed out in slices of at most this many bytes: small enough that the threads
# finish together, large enough that the per-slice Python work is noise next to the memcpy.
_SLICE = 4 << 20

# A unit of work: (chunk index, sort key within the chunk, copy function).
_Unit = tuple[int, int, Callable[[], object]]


class Stager:
    """Copies states into arena regions with the calling thread plus ``threads - 1`` helpers.

    Args:
        threads: Threads that copy at once, the caller included (1 copies on the caller alone).

    Attributes:
        saturates: Whether the copy keeps every usable core busy. Work started on copied chunks
            (hashing) would then only slow the copy that training waits for, so the engine holds
            it back until the whole version is in the arena.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"staging needs at least 1 thread, got {threads}: set ram.copy_threads")
        self.threads = threads
        self.saturates = threads >= usable_cores()
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="tiercache-copy") if threads > 1 else None

    def copy_in(self, flat: Flat, layout: Layout, views: list[torch.Tensor], copied: list[threading.Event]) -> None:
        """Copy every tensor of ``flat`` into its chunk regions; set ``copied[i]`` once chunk ``i`` is complete.

        Args:
            flat: The flattened state (its tensors are the sources; CPU or CUDA).
            layout: The chunk layout of that state.
            views: One uint8 tensor per chunk: its arena region (header slot first).
            copied: One event per chunk, set when the chunk's payload is complete (all of them
                are set when this returns, and none is set early for CUDA sources).

        Raises:
            BaseException: Whatever a copy raised; no helper touches ``views`` after this returns.
        """
        with torch.no_grad():
            _zero_pack_gaps(layout, views)
            if any(t.is_cuda for t in flat.tensors):
                _copy_cuda(flat, layout, views)
            else:
                self._copy_cpu(flat, layout, views, copied)
        for e in copied:
            e.set()

    def close(self) -> None:
        """Stop the helper threads."""
        if self._pool is not None:
            self._pool.shutdown()

    def _copy_cpu(self, flat: Flat, layout: Layout, views: list[torch.Tensor], copied: list[threading.Event]) -> None:
        units, keep = _cpu_units(flat, layout, views)
        remaining = [0] * len(layout.chunks)
        for ci, _, _ in units:
            remaining[ci] += 1
        for ci, n in enumerate(remaining):
            if n == 0:
                copied[ci].set()
        lock = threading.Lock()
        ticket = count()
        failed: list[BaseException] = []

        def work() -> None:
            # Each thread takes the next unit in chunk order, so chunks complete roughly in order
            # and the hasher can start on the first while the rest is still being copied.
            while not failed:
                i = next(ticket)
                if i >= len(units):
                    return
                ci, _, fn = units[i]
                try:
                    fn()
                except BaseException as e:
                    failed.append(e)
                    raise
                with lock:
                    remaining[ci] -= 1
                    done = remaining[ci] == 0
                if done:
                    copied[ci].set()

        helpers = []
        if self._pool is not None and len(units) > 1:
            helpers = [self._pool.submit(work) for _ in range(min(self.threads - 1, len(units) - 1))]
        try:
            work()
        finally:
            for h in helpers:
                h.exception()  # wait: no helper may write into the regions after we return
            keep.clear()  # contiguous temporaries of strided sources, needed until every copy ran
        if failed:
            raise failed[0]


def _raw_copyable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes in memory are exactly its values, in order (a memcpy copies it)."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not (t.is_complex() and t.is_conj())  # is_conj is slow to ask, and only complex has it
        and not t.is_neg()
    )


def _cpu_units(flat: Flat, layout: Layout, views: list[torch.Tensor]) -> tuple[list[_Unit], list[torch.Tensor]]:
    """The copy work for CPU sources, in chunk order, and the temporaries it needs kept alive."""
    hdr = HEADER_BYTES
    units: list[_Unit] = []
    keep: list[torch.Tensor] = []
    for i, t in enumerate(flat.tensors):
        pieces = layout.tensor_pieces[i]
        if not pieces:
            continue
        raw = _raw_copyable(t)
        if not raw and len(pieces) == 1:
            # One strided piece: copy_ reads it in place, no contiguous temporary.
            ci, p = pieces[0]
            dst = views[ci][hdr + p.chunk_offset : hdr + p.chunk_offset + p.nbytes].view(t.dtype).view(t.shape)
            units.append((ci, p.chunk_offset, _torch_copy(dst, t)))
            continue
        if not raw:
            t = t.resolve_conj().resolve_neg().contiguous()
            keep.append(t)
        src = t.data_ptr()
        for ci, p in pieces:
            dst = views[ci].data_ptr() + hdr + p.chunk_offset
            for off in range(0, p.nbytes, _SLICE):
                n = min(_SLICE, p.nbytes - off)
                units.append((ci, p.chunk_offset + off, _memcpy(dst + off, src + p.offset + off, n)))
    units.sort(key=lambda u: (u[0], u[1]))
    return units, keep


def _memcpy(dst: int, src: int, nbytes: int) -> Callable[[], object]:
    return lambda: ctypes.memmove(dst, src, nbytes)


def _torch_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
    return lambda: dst.copy_(src)


def _zero_pack_gaps(layout: Layout, views: list[torch.Tensor]) -> None:
    # Gaps between packed tensors must be zero so a pack's hash depends only on content.
    hdr = HEADER_BYTES
    for ci, c in enumerate(layout.chunks):
        if not c.packed:
            continue
        base = views[ci].data_ptr() + hdr
        end = 0
        for p in c.pieces:
            if p.chunk_offset > end:
                ctypes.memset(base + end, 0, p.chunk_offset - end)
            end = p.chunk_offset + p.nbytes


def _copy_cuda(flat: Flat, layout: Layout, views: list[torch.Tensor]) -> None:
    """Copy a state with CUDA tensors on a side stream; the chunks are complete only at the end."""
    hdr = HEADER_BYTES
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i, t in enumerate(flat.tensors):
            pieces = layout.tensor_pieces[i]
            if not pieces:
                continue
            if len(pieces) == 1:
                ci, p = pieces[0]
                dst = views[ci][hdr + p.chunk_offset : hdr + p.chunk_offset + p.nbytes]
                dst.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                continue
            src = t if t.is_contiguous() else t.contiguous()
            flat_bytes = src.reshape(-1).view(torch.uint8)
            for ci, p in pieces:
                dst = views[ci][hdr + p.chunk_offset : hdr + p.chunk_offset + p.nbytes]
                dst.copy_(flat_bytes[p.offset : p.offset + p.nbytes], non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(stream)
    ev.synchronize()
