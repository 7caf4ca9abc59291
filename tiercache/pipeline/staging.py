"""Staging: copying a state's tensors into their chunk regions of the RAM arena.

This is the only work ``save()`` makes training wait for, so it uses every core it is given:
the calling thread and ``threads - 1`` helper threads copy slices of the state side by side
(training is blocked in ``save()`` meanwhile, so those cores are otherwise idle). Contiguous CPU
tensors are copied with a plain memcpy, which releases the GIL; anything else (strided views,
conjugate/negative bits) with ``Tensor.copy_``. Pack gaps are zeroed so a pack's hash depends
only on its content, and each chunk is announced as soon as its last byte is in place, so
hashing and writing start while later chunks are still being copied. CUDA sources are copied
with non-blocking copies on a side stream into the (pinned) arena and synchronised once.

A save may also defer part of its copy (``later``): those tensors are copied on the helper
threads after ``copy_in`` returns, while training goes on with work that does not change them
(see :mod:`tiercache.pipeline.deferred`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count

import torch

from tiercache.codecs import HEADER_BYTES
from tiercache.config import usable_cores
from tiercache.dtypes import DTYPES, GROUPED
from tiercache.format import Flat
from tiercache.layout import Layout, plan_layout

# Work is handed out in slices of at most this many bytes: small enough that the threads
# finish together, large enough that the per-slice Python work is noise next to the memcpy.
_SLICE = 4 << 20

# One run of bytes to copy: (tensor index, offset in the chunk's region, offset in the tensor, bytes).
_Slice = tuple[int, int, int, int]
# Units of copy work, each ``(chunk index, slices)`` (see CopyPlan.units).
_Units = tuple[tuple[int, tuple[_Slice, ...]], ...]

# The memcpy used for contiguous sources; ctypes releases the GIL for the call.
_memmove = ctypes.memmove


class Stager:
    """Copies states into arena regions with the calling thread plus ``threads - 1`` helpers.

    Args:
        threads: Threads that copy at once, the caller included (1 copies on the caller alone).
            A deferred copy runs on ``threads - 1`` helpers (at least one), leaving the caller's
            core to training.

    Attributes:
        saturates: Whether the copy keeps every usable core busy. Work started on copied chunks
            (hashing) would then only slow the copy that training waits for, so the engine holds
            it back until the whole version is in the arena.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"staging needs at least 1 thread, got {threads}: set ram.copy_threads")
        self.threads = threads
        self.saturates = copy_saturates(threads)
        self._pool = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="tiercache-copy")
        # Runs deferred copies one at a time; it only hands out work to the pool and waits.
        self._later = ThreadPoolExecutor(1, thread_name_prefix="tiercache-defer")

    def copy_in(
        self,
        flat: Flat,
        plan: CopyPlan,
        views: list[torch.Tensor],
        copied: list[threading.Event],
        *,
        later: frozenset[int] = frozenset(),
    ) -> Future[None] | None:
        """Copy every tensor of ``flat`` into its chunk regions; set ``copied[i]`` once chunk ``i`` is complete.

        Args:
            flat: The flattened state (its tensors are the sources; CPU or CUDA).
            plan: The copy plan of that state's layout (see :func:`plan_copy`).
            views: One uint8 tensor per chunk: its arena region (header slot first).
            copied: One event per chunk, set when the chunk's payload is complete (none is set
                early for CUDA sources).
            later: Indices of tensors to copy on the helper threads after this returns (CPU
                states only: a state with a CUDA tensor is copied whole before returning).

        Returns:
            ``None`` when everything is copied (every event is set); else the future of the
            deferred copy, which sets the events of the chunks it completes and, if it fails,
            none of the others'.

        Raises:
            BaseException: Whatever a copy before returning raised; no helper touches ``views``
                after that.
        """
        cuda = any(t.is_cuda for t in flat.tensors)
        with torch.no_grad():
            for ci, at, nbytes in plan.gaps:
                ctypes.memset(views[ci].data_ptr() + at, 0, nbytes)
            if cuda:
                _copy_cuda(flat, plan.layout, views)
            elif not later:
                everything = range(len(flat.tensors))
                self._copy_cpu(flat, plan.layout, plan.units, everything, list(plan.units_per_chunk), views, copied,
                               caller=True)
            else:
                now, deferred, counts, rest = plan.split(later)
                remaining = list(counts)  # shared: a chunk may have units in both parts
                self._copy_cpu(flat, plan.layout, now, rest, remaining, views, copied, caller=True)
                return self._later.submit(self._copy_later, flat, plan.layout, deferred, later, remaining, views,
                                          copied)
        for e in copied:
            e.set()
        return None

    def _copy_later(self, flat: Flat, layout: Layout, units: _Units, tensors: frozenset[int], remaining: list[int],
                    views: list[torch.Tensor], copied: list[threading.Event]) -> None:
        with torch.no_grad():
            self._copy_cpu(flat, layout, units, sorted(tensors), remaining, views, copied, caller=False)

    def close(self) -> None:
        """Stop the helper threads (after any deferred copy)."""
        self._later.shutdown()
        self._pool.shutdown()

    def _copy_cpu(self, flat: Flat, layout: Layout, units: _Units, tensors: Iterable[int], remaining: list[int],
                  views: list[torch.Tensor], copied: list[threading.Event], *, caller: bool) -> None:
        """Copy ``units`` (the slices of ``tensors``); ``remaining`` counts each chunk's units not yet copied.

        A chunk's event is set when its count reaches zero (here, or already at the start).
        ``caller``: whether the calling thread copies too (else only the helpers do, and this
        call waits for them).
        """
        src, fallback, keep = _sources(flat, layout, tensors)
        base = [v.data_ptr() for v in views]
        lock = threading.Lock()
        for ci, n in enumerate(remaining):
            if n == 0:
                copied[ci].set()
        ticket = count()
        failed: list[BaseException] = []

        def run(ci: int, slices: tuple[_Slice, ...]) -> None:
            b = base[ci]
            for ti, at, offset, nbytes in slices:
                t = fallback.get(ti)
                if t is None:
                    _memmove(b + at, src[ti] + offset, nbytes)
                elif offset == 0:
                    # A strided source in one piece: copy_ reads it in place (its first slice
                    # copies all of it; the others have nothing left to do).
                    whole = flat.metas[ti].nbytes
                    views[ci][at : at + whole].view(t.dtype).view(t.shape).copy_(t)

        def work() -> None:
            # Each thread takes the next unit in chunk order, so chunks complete roughly in order
            # and the hasher can start on the first while the rest is still being copied.
            while not failed:
                i = next(ticket)
                if i >= len(units):
                    return
                ci, slices = units[i]
                try:
                    run(ci, slices)
                except BaseException as e:
                    failed.append(e)
                    raise
                with lock:
                    remaining[ci] -= 1
                    done = remaining[ci] == 0
                if done:
                    copied[ci].set()

        # Helpers never wait for anything, so a deferred copy waiting for them cannot deadlock
        # the pool, whatever else is queued there.
        n = min(self.threads - 1, len(units) - 1) if caller else min(max(1, self.threads - 1), len(units))
        helpers = [self._pool.submit(work) for _ in range(max(0, n))]
        try:
            if caller:
                work()
        finally:
            for h in helpers:
                h.exception()  # wait: no helper may write into the regions after we return
            keep.clear()  # contiguous temporaries of strided sources, needed until every copy ran
        if failed:
            raise failed[0]


def copy_saturates(threads: int) -> bool:
    """Whether a copy on ``threads`` threads keeps every usable core busy (see :class:`Stager`)."""
    return threads >= usable_cores()


@dataclass(frozen=True)
class CopyPlan:
    """The copy work of one layout, fixed while the state's structure is (the engine caches it).

    Attributes:
        layout: The chunk layout it copies into.
        units: ``(chunk index, slices)`` in chunk order; a unit is at most ``_SLICE`` bytes (a
            slice of a big tensor, or a batch of small packed ones) and goes to one thread.
        units_per_chunk: How many units each chunk has (it is complete when all have run).
        gaps: ``(chunk index, offset in its region, bytes)`` between packed tensors, zeroed on
            every save so a pack's hash depends only on its content.
    """

    layout: Layout
    units: _Units
    units_per_chunk: tuple[int, ...]
    gaps: tuple[tuple[int, int, int], ...]
    _splits: dict[frozenset[int], tuple[_Units, _Units, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def split(self, later: frozenset[int]) -> tuple[_Units, _Units, tuple[int, ...], tuple[int, ...]]:
        """Split the copy for a save that defers the tensors in ``later``; computed once per set.

        Returns:
            The units without those tensors, the units with them, how many units each chunk
            now has (a unit mixing both, a pack, is cut in two, so a chunk may have units in
            both parts and more than ``units_per_chunk`` says), and the other tensors' indices.
        """
        cached = self._splits.get(later)
        if cached is not None:
            return cached
        now: list[tuple[int, tuple[_Slice, ...]]] = []
        deferred: list[tuple[int, tuple[_Slice, ...]]] = []
        for ci, slices in self.units:
            a = tuple(sl for sl in slices if sl[0] not in later)
            b = tuple(sl for sl in slices if sl[0] in later)
            if a:
                now.append((ci, a))
            if b:
                deferred.append((ci, b))
        counts = [0] * len(self.units_per_chunk)
        for ci, _ in (*now, *deferred):
            counts[ci] += 1
        if len(self._splits) > 4:
            self._splits.clear()
        rest = tuple(i for i in range(len(self.layout.tensor_pieces)) if i not in later)
        result = self._splits[later] = (tuple(now), tuple(deferred), tuple(counts), rest)
        return result


class PlanCache:
    """Copy plans by state structure: a training run saves states of one structure over and over.

    Planning a layout costs a pass over every tensor; it is done once per structure and chunk
    size (a few structures are kept, then the cache starts over).

    Args:
        pack_below: Tensors smaller than this are packed together (``pack_below`` of the config).
    """

    _KEEP = 16

    def __init__(self, pack_below: int) -> None:
        self._pack_below = pack_below
        self._plans: dict[Hashable, CopyPlan] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

    def get(self, flat: Flat, chunk_bytes: int) -> CopyPlan:
        """The plan of ``flat``'s structure cut into chunks of at most ``chunk_bytes``."""
        return self.for_sizes((flat.structure_key, chunk_bytes), *item_sizes(flat), chunk_bytes)

    def for_sizes(self, key: Hashable, sizes: list[int], items: list[int], chunk_bytes: int) -> CopyPlan:
        """The plan of tensors of ``sizes`` bytes (``items``: see :func:`item_sizes`), cached under ``key``."""
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = plan_copy(plan_layout(sizes, items, chunk_bytes=chunk_bytes, pack_below=self._pack_below))
            with self._lock:
                if len(self._plans) > self._KEEP:
                    self._plans.clear()
                self._plans[key] = plan
        return plan


def item_sizes(flat: Flat) -> tuple[list[int], list[int]]:
    """Each tensor's byte size, and its element size if byte-grouped codecs apply to its dtype (else 1)."""
    return [m.nbytes for m in flat.metas], [DTYPES[m.dtype].itemsize if m.dtype in GROUPED else 1 for m in flat.metas]


def plan_copy(layout: Layout) -> CopyPlan:
    """Cut a layout's copy into units of at most ``_SLICE`` bytes, in chunk order."""
    hdr = HEADER_BYTES
    by_chunk: list[list[_Slice]] = [[] for _ in layout.chunks]
    for ti, pieces in enumerate(layout.tensor_pieces):
        for ci, p in pieces:
            for off in range(0, p.nbytes, _SLICE):
                by_chunk[ci].append((ti, hdr + p.chunk_offset + off, p.offset + off, min(_SLICE, p.nbytes - off)))
    units: list[tuple[int, tuple[_Slice, ...]]] = []
    for ci, slices in enumerate(by_chunk):
        slices.sort(key=lambda s: s[1])
        batch: list[_Slice] = []
        size = 0
        for sl in slices:
            if batch and size + sl[3] > _SLICE:
                units.append((ci, tuple(batch)))
                batch, size = [], 0
            batch.append(sl)
            size += sl[3]
        if batch:
            units.append((ci, tuple(batch)))
    per_chunk = [0] * len(layout.chunks)
    for ci, _ in units:
        per_chunk[ci] += 1
    gaps = []
    for ci, c in enumerate(layout.chunks):
        if not c.packed:
            continue
        end = 0
        for p in c.pieces:
            if p.chunk_offset > end:
                gaps.append((ci, hdr + end, p.chunk_offset - end))
            end = p.chunk_offset + p.nbytes
    return CopyPlan(layout, tuple(units), tuple(per_chunk), tuple(gaps))


def _sources(
    flat: Flat, layout: Layout, tensors: Iterable[int]
) -> tuple[list[int], dict[int, torch.Tensor], list[torch.Tensor]]:
    """Where the bytes of each of ``tensors`` (indices into ``flat``) are read from for this copy.

    Returns:
        The source address per tensor (for memcpy), the strided one-piece tensors that
        ``copy_`` reads in place instead, and the contiguous temporaries made for strided
        tensors of several pieces (kept alive until the copy is done).
    """
    src = [0] * len(flat.tensors)
    fallback: dict[int, torch.Tensor] = {}
    keep: list[torch.Tensor] = []
    for ti in tensors:
        t = flat.tensors[ti]
        # flatten() has already resolved conjugate/negative bits and refused non-strided
        # layouts, so a contiguous tensor's bytes are exactly its values, in order.
        if t.is_contiguous():
            src[ti] = t.data_ptr()
        elif len(layout.tensor_pieces[ti]) == 1:
            fallback[ti] = t
        elif layout.tensor_pieces[ti]:
            c = t.contiguous()
            keep.append(c)
            src[ti] = c.data_ptr()
    return src, fallback, keep


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
