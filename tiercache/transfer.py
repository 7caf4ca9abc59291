"""Chunk transfers between the ranks of a private gloo group: one reader, any number of receivers.

Peer copies (:mod:`tiercache.peers`) and restores over the group (:mod:`tiercache.group_restore`)
both come down to the same step: every rank computes the same list of :class:`Move` (a chunk,
the rank that reads it, the ranks that receive it), then each rank reads the chunks it sends,
sends them point to point, and receives the chunks it gets. :func:`run_moves` does that step.

Each move is two messages from its source to each destination: a one-element header (1: the
payload follows and is good; 0: the source could not read it) and the payload, ``nbytes`` raw
bytes. Tags are the move's position in the plan, so messages never match the wrong move. Moves
run in batches, in plan order, so that no rank receives more than ``budget`` bytes at once;
every rank cuts the same batches from the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Move:
    """One chunk going from one rank to others.

    Attributes:
        chunk: The chunk's id.
        nbytes: Its raw length.
        src: The group rank that reads it and sends it.
        dsts: The group ranks that receive it.
    """

    chunk: str
    nbytes: int
    src: int
    dsts: tuple[int, ...]


#: ``read(move)``: the chunk's raw bytes (a uint8 CPU tensor of ``move.nbytes``); raise if it cannot.
Read = Callable[[Move], torch.Tensor]
#: ``land(move, data)``: a received chunk (unverified raw bytes), or ``None`` if its source failed.
Land = Callable[[Move, torch.Tensor | None], None]


def batches(moves: Sequence[Move], budget: int) -> list[list[tuple[int, Move]]]:
    """Cut ``moves`` (with their positions) into batches in which no rank receives over ``budget`` bytes.

    A batch always takes at least one move, so a chunk larger than the budget still goes.
    """
    out: list[list[tuple[int, Move]]] = []
    cur: list[tuple[int, Move]] = []
    load: dict[int, int] = {}
    for i, m in enumerate(moves):
        if cur and any(load.get(d, 0) + m.nbytes > budget for d in m.dsts):
            out.append(cur)
            cur, load = [], {}
        cur.append((i, m))
        for d in m.dsts:
            load[d] = load.get(d, 0) + m.nbytes
    if cur:
        out.append(cur)
    return out


def run_moves(
    group: dist.ProcessGroup, rank: int, moves: Sequence[Move], *, read: Read, land: Land, budget: int, threads: int
) -> None:
    """Carry out this rank's side of ``moves`` (the same list on every rank of ``group``).

    Reads run on ``threads`` threads and each chunk is sent as soon as it is read; ``land`` is
    called on the calling thread once a batch's messages are all in. An error ``read`` raises is
    sent to the receivers as a failed header and re-raised here after the batch.

    Raises:
        RuntimeError: If a peer dies or stops answering (gloo's error, after the group's timeout).
        Exception: The first error of ``read`` (after every message of its batch went out).
    """
    failed: BaseException | None = None
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="tiercache-send") as pool:
        for batch in batches(moves, budget):
            incoming: list[tuple[Move, torch.Tensor, torch.Tensor]] = []
            works: list[dist.Work] = []
            for i, m in batch:
                if rank in m.dsts:
                    head = torch.zeros(1, dtype=torch.int64)
                    data = torch.empty(m.nbytes, dtype=torch.uint8)
                    works.append(_op(dist.irecv(head, group=group, group_src=m.src, tag=2 * i)))
                    works.append(_op(dist.irecv(data, group=group, group_src=m.src, tag=2 * i + 1)))
                    incoming.append((m, head, data))
            reads: dict[Future[torch.Tensor], tuple[int, Move]] = {
                pool.submit(read, m): (i, m) for i, m in batch if m.src == rank
            }
            keep: list[torch.Tensor] = []  # sent buffers live until their sends complete
            for fut in as_completed(reads):
                i, m = reads[fut]
                try:
                    data = fut.result()
                    ok = 1
                except Exception as e:
                    failed = failed or e
                    data, ok = torch.zeros(m.nbytes, dtype=torch.uint8), 0
                head = torch.tensor([ok], dtype=torch.int64)
                keep += [head, data]
                for d in m.dsts:
                    works.append(_op(dist.isend(head, group=group, group_dst=d, tag=2 * i)))
                    works.append(_op(dist.isend(data, group=group, group_dst=d, tag=2 * i + 1)))
            for w in works:
                w.wait()
            for m, head, data in incoming:
                land(m, data if int(head.item()) == 1 else None)
    if failed is not None:
        raise failed


def _op(work: dist.Work | None) -> dist.Work:
    assert work is not None  # point-to-point calls return their work unless the rank is not in the group
    return work


__all__ = ["Land", "Move", "Read", "batches", "run_moves"]
