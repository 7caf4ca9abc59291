"""Chunk transfers between the ranks of a private gloo group: one reader, any number of receivers.

Peer copies (:mod:`tiercache.group.peers`) and restores over the group
(:mod:`tiercache.group.restore`) both come down to the same step: the coordinator plans a list of
:class:`Move` (a chunk, the rank that reads it, the ranks that receive it), :func:`schedule` gives
each a tag and a batch, and each rank is told only its own (:func:`own`); each rank then reads
the chunks it sends, sends them point to point, and receives the chunks it gets:
:func:`run_moves` does that step.

Each move is two messages from its source to each destination: a one-element header (1: the
payload follows and is good; 0: the source could not read it) and the payload, ``nbytes`` raw
bytes. Tags come from the move's position in the plan, so messages never match the wrong move.
Moves run in batches, in plan order, so that no rank receives more than ``budget`` bytes at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Move:
    """One chunk (or other object) going from one rank to others.

    Attributes:
        chunk: The chunk's id (or another object's name: a part manifest is ``part:<rank>``).
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


@dataclass(frozen=True, slots=True)
class Slot:
    """A move in a schedule: its tag (messages ``tag`` and ``tag + 1``) and its batch."""

    tag: int
    batch: int
    move: Move

    def to_json(self) -> list[Any]:
        """A compact JSON form (a rank receives its slots in a verdict)."""
        m = self.move
        return [self.tag, self.batch, m.chunk, m.nbytes, m.src, m.dsts]  # dsts: a tuple, a JSON array

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> Slot:
        """The slot :meth:`to_json` wrote."""
        tag, batch, chunk, nbytes, src, dsts = data
        return cls(int(tag), int(batch), Move(str(chunk), int(nbytes), int(src), tuple(int(d) for d in dsts)))


def schedule(moves: Sequence[Move], budget: int) -> list[Slot]:
    """Tag and batch ``moves`` (see :func:`batches`)."""
    return [Slot(2 * i, b, m) for i, (b, m) in enumerate(zip(_batch_of(moves, budget), moves, strict=True))]


def own(slots: Sequence[Slot], rank: int) -> list[Slot]:
    """The slots ``rank`` sends or receives."""
    return [s for s in slots if s.move.src == rank or rank in s.move.dsts]


def by_rank(slots: Sequence[Slot], world: int) -> list[list[Slot]]:
    """:func:`own` for every rank of a group of ``world``, in one pass over the slots.

    The coordinator sends each rank its own slots: calling :func:`own` once per rank would cost
    ranks x slots, and with thousands of ranks moving a few chunks each that is seconds.
    """
    return _by_rank(slots, slots, world)


def shares(slots: Sequence[Slot], world: int) -> list[list[list[Any]]]:
    """Each rank's slots of a group of ``world`` in their JSON form (:meth:`Slot.to_json`), each encoded once.

    What the coordinator sends every rank: :func:`by_rank`, without encoding a slot once per rank it names.
    """
    return _by_rank(slots, [s.to_json() for s in slots], world)


def _by_rank(slots: Sequence[Slot], items: Sequence[Any], world: int) -> list[list[Any]]:
    out: list[list[Any]] = [[] for _ in range(world)]
    for s, item in zip(slots, items, strict=True):
        m = s.move
        out[m.src].append(item)
        for d in m.dsts:
            if d != m.src:
                mine = out[d]
                if not mine or mine[-1] is not item:  # each rank once, in the order own() sees it
                    mine.append(item)
    return out


def batches(moves: Sequence[Move], budget: int) -> list[list[tuple[int, Move]]]:
    """Cut ``moves`` (with their positions) into batches in which no rank receives over ``budget`` bytes.

    A batch always takes at least one move, so a chunk larger than the budget still goes.
    """
    out: list[list[tuple[int, Move]]] = []
    for i, (b, m) in enumerate(zip(_batch_of(moves, budget), moves, strict=True)):
        if b == len(out):
            out.append([])
        out[b].append((i, m))
    return out


def _batch_of(moves: Sequence[Move], budget: int) -> list[int]:
    """The batch of each move (see :func:`batches`): one pass, no object per move."""
    out: list[int] = []
    batch = 0
    load: dict[int, int] = {}
    for m in moves:
        n = m.nbytes
        if out and out[-1] == batch:  # the batch holds a move already
            for d in m.dsts:
                if load.get(d, 0) + n > budget:
                    batch += 1
                    load = {}
                    break
        out.append(batch)
        for d in m.dsts:
            load[d] = load.get(d, 0) + n
    return out


def run_moves(
    group: dist.ProcessGroup, rank: int, slots: Sequence[Slot], *, read: Read, land: Land, threads: int
) -> None:
    """Carry out this rank's side of a schedule (its own slots, see :func:`own`).

    Reads run on ``threads`` threads and each chunk is sent as soon as it is read; ``land`` is
    called on the calling thread once a batch's messages are all in. An error ``read`` raises is
    sent to the receivers as a failed header and re-raised here after the batch.

    Raises:
        RuntimeError: If a peer dies or stops answering (gloo's error, after the group's timeout).
        Exception: The first error of ``read`` (after every message of its batch went out).
    """
    failed: BaseException | None = None
    by_batch: dict[int, list[Slot]] = {}
    for s in slots:
        by_batch.setdefault(s.batch, []).append(s)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="tiercache-send") as pool:
        for b in sorted(by_batch):
            batch = by_batch[b]
            incoming: list[tuple[Move, torch.Tensor, torch.Tensor]] = []
            works: list[dist.Work] = []
            for s in batch:
                m = s.move
                if rank in m.dsts:
                    head = torch.zeros(1, dtype=torch.int64)
                    data = torch.empty(m.nbytes, dtype=torch.uint8)
                    works.append(_op(dist.irecv(head, group=group, group_src=m.src, tag=s.tag)))
                    works.append(_op(dist.irecv(data, group=group, group_src=m.src, tag=s.tag + 1)))
                    incoming.append((m, head, data))
            reads: dict[Future[torch.Tensor], Slot] = {pool.submit(read, s.move): s for s in batch
                                                       if s.move.src == rank}
            keep: list[torch.Tensor] = []  # sent buffers live until their sends complete
            for fut in as_completed(reads):
                s = reads[fut]
                m = s.move
                try:
                    data = fut.result()
                    ok = 1
                except Exception as e:
                    failed = failed or e
                    data, ok = torch.zeros(m.nbytes, dtype=torch.uint8), 0
                head = torch.tensor([ok], dtype=torch.int64)
                keep += [head, data]
                for d in m.dsts:
                    works.append(_op(dist.isend(head, group=group, group_dst=d, tag=s.tag)))
                    works.append(_op(dist.isend(data, group=group, group_dst=d, tag=s.tag + 1)))
            for w in works:
                w.wait()
            for m, head, data in incoming:
                land(m, data if int(head.item()) == 1 else None)
    if failed is not None:
        raise failed


def _op(work: dist.Work | None) -> dist.Work:
    assert work is not None  # point-to-point calls return their work unless the rank is not in the group
    return work


__all__ = ["Land", "Move", "Read", "Slot", "batches", "by_rank", "own", "run_moves", "schedule", "shares"]
