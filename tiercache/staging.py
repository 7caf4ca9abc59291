"""Staging: copying a state's tensors into their chunk regions of the RAM arena.

This is the only work ``save()`` makes training wait for. Each tensor is copied once (straight
from a strided source when it fits one chunk), pack gaps are zeroed so a pack's hash depends only
on its content, and each chunk is announced as soon as its last byte is in place, so hashing and
writing start while later tensors are still being copied. CUDA sources are copied with
non-blocking copies on a side stream into the (pinned) arena and synchronised once.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from tiercache.codecs import HEADER_BYTES
from tiercache.format import Flat
from tiercache.layout import Layout


def copy_in(flat: Flat, layout: Layout, views: list[torch.Tensor], copied: list[threading.Event]) -> None:
    """Copy every tensor of ``flat`` into its chunk regions; set ``copied[i]`` once chunk ``i`` is complete.

    Args:
        flat: The flattened state (its tensors are the sources; CPU or CUDA).
        layout: The chunk layout of that state.
        views: One uint8 tensor per chunk: its arena region (header slot first).
        copied: One event per chunk, set when the chunk's payload is complete (all of them are
            set when this returns, and none is set early for CUDA sources).
    """
    hdr = HEADER_BYTES
    cuda = any(t.is_cuda for t in flat.tensors)
    # Chunk i is complete after the copy of its last piece; GPU copies are asynchronous, so
    # with CUDA every chunk is released only after the final event sync.
    last = [max(p.tensor for p in c.pieces) for c in layout.chunks]
    done_after: dict[int, list[int]] = {}
    if not cuda:
        for ci, ti in enumerate(last):
            done_after.setdefault(ti, []).append(ci)
    stream = torch.cuda.Stream() if cuda else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        # Gaps between packed tensors must be zero so a pack's hash depends only on content.
        for ci, c in enumerate(layout.chunks):
            if not c.packed:
                continue
            end = 0
            for p in c.pieces:
                if p.chunk_offset > end:
                    views[ci][hdr + end : hdr + p.chunk_offset].zero_()
                end = p.chunk_offset + p.nbytes
        for i, t in enumerate(flat.tensors):
            pieces = layout.tensor_pieces[i]
            if not pieces:
                continue
            if len(pieces) == 1:
                ci, p = pieces[0]
                dst = views[ci][hdr + p.chunk_offset : hdr + p.chunk_offset + p.nbytes]
                dst.view(t.dtype).view(t.shape).copy_(t, non_blocking=cuda)
            else:
                src = t if t.is_contiguous() else t.contiguous()
                flat_bytes = src.reshape(-1).view(torch.uint8)
                for ci, p in pieces:
                    dst = views[ci][hdr + p.chunk_offset : hdr + p.chunk_offset + p.nbytes]
                    dst.copy_(flat_bytes[p.offset : p.offset + p.nbytes], non_blocking=cuda)
                    if len(layout.chunks[ci].pieces) == 1 and not cuda:
                        copied[ci].set()  # one tensor's chunk: complete as soon as it is copied
            for ci in done_after.get(i, ()):
                copied[ci].set()
    if stream is not None:
        ev = torch.cuda.Event()
        ev.record(stream)
        ev.synchronize()
    for e in copied:
        e.set()
