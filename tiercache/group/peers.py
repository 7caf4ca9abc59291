"""Peer copies: each node's part of a multi-rank version also on ``peers.copies`` other nodes (level ``replicated``).

A node-local disk survives a process crash, not the loss of its node. Once a version is ``local``
(every node holds what its own ranks need), its peer copies are made on a worker thread of each
rank (Gemini; NVIDIA's local checkpointing), in two phases of the group's collective layer:

1. ``<v>/peers/plan``: the coordinator, which knows from the ``parts`` phase who wrote which
   chunk on each node, plans the moves (:func:`copy_moves`): each chunk of a node's part that a
   peer node lacks goes from the rank that wrote it to one of the peer's ranks (they take turns,
   so a node's receiving and writing are shared), and so does each rank's part manifest. Each
   rank gets only its own moves.
2. The chunks travel point to point over a private gloo group; a receiver verifies each against
   its id (a part manifest: that it is the part it should be) and writes it to its node's disk
   with the same durable write as any chunk, then syncs the names.
3. ``<v>/peers``: ``replicated`` resolves on every rank once every move landed, or fails on every
   rank with the same error. A rank that dies mid-copy fails ``replicated`` (and breaks the
   group: see :mod:`tiercache.group.collective`); ``local`` and ``remote`` are not affected.

Chunks a peer node holds already (a DDP replica holds every replicated chunk) are not sent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tiercache import codecs
from tiercache.errors import GroupSaveError, IntegrityError
from tiercache.failpoints import failpoint
from tiercache.group.collective import Channel, Decision
from tiercache.group.round import Round
from tiercache.group.status import Status
from tiercache.group.topology import Topology
from tiercache.group.transfer import Move, Slot, run_moves, schedule, shares
from tiercache.manifest import Version
from tiercache.names import chunk_key, part_key
from tiercache.restore import byte_view

if TYPE_CHECKING:
    import torch.distributed as dist

    from tiercache.group.view import GroupView

log = logging.getLogger("tiercache.group.peers")

#: How a part manifest is named in a move (a chunk is named by its id).
_PART = "part:"


def copy_moves(
    topology: Topology, peers: Sequence[tuple[int, ...]], writers: Sequence[Mapping[str, int]],
    sizes: Mapping[str, int], part_bytes: Sequence[int] = (),
) -> list[Move]:
    """The moves that put every node's part on its peers.

    Args:
        topology: The group's nodes.
        peers: Per node, the nodes that hold a copy of its part.
        writers: Per node, each chunk of its part -> the rank that wrote it there (it sends it).
        sizes: Each chunk's raw length, in the order to move them.
        part_bytes: Each rank's part manifest's size (sent by the rank itself); none if empty.

    Returns:
        One move per chunk (or part manifest) and sender; a chunk several peers lack from the
        same sender is read once and sent to each.
    """
    position = {cid: i for i, cid in enumerate(sizes)}
    moves: dict[tuple[str, int], list[int]] = {}
    nbytes = dict(sizes)
    sent: list[set[str]] = [set() for _ in peers]  # per peer node, the chunks on their way to it
    for node, holders in enumerate(peers):
        mine = writers[node]
        part = sorted(mine, key=position.__getitem__)  # the node's chunks, in plan order
        for peer in holders:
            receivers = topology.ranks(peer)
            held, going = writers[peer], sent[peer]
            turn = 0
            for cid in part:
                if cid in held or cid in going:
                    continue
                going.add(cid)
                key = (cid, mine[cid])
                dsts = moves.get(key)
                if dsts is None:
                    moves[key] = [receivers[turn % len(receivers)]]
                else:
                    dsts.append(receivers[turn % len(receivers)])
                turn += 1
            for rank in topology.ranks(node) if part_bytes else ():
                name = f"{_PART}{rank}"
                nbytes[name] = part_bytes[rank]
                moves.setdefault((name, rank), []).append(receivers[turn % len(receivers)])
                turn += 1
    return [Move(cid, nbytes[cid], src, tuple(dsts)) for (cid, src), dsts in moves.items()]


class Replicator:
    """This rank's side of the peer copies of each version (see the module docstring).

    Args:
        view: The group view.
        group: A private gloo group of the process group, used only by the replicator's thread.
        peers: Per node, the nodes that hold a copy of its part.
        tier: The node-local durable tier the copies go to (the node's disk).
    """

    def __init__(self, view: GroupView, group: dist.ProcessGroup, peers: Sequence[tuple[int, ...]],
                 tier: str) -> None:
        self.view = view
        self.group = group
        self.peers = list(peers)
        self.tier = tier

    def run(self, rnd: Round, ch: Channel) -> None:
        """Make the peer copies of ``rnd`` once the group settled its ``local`` level."""
        local = rnd.futures["local"].exception()  # waits: the same outcome on every rank
        result = rnd.futures["replicated"]
        if local is not None:
            result.set_exception(GroupSaveError(
                f"version {rnd.vid} failed on peers: it is not local on every node ({local})"))
            return
        what = f"version {rnd.vid} on peers"
        try:
            failpoint("group.peers", f"{rnd.vid}/peers")
            mine = Status()
        except Exception as e:
            mine = Status.of(e)
        plan = ch.exchange(f"{rnd.vid}/peers/plan", mine, what=what, decide=lambda _: self._plan(rnd))
        status = Status()
        if plan.ok:
            try:
                self._copy(rnd, [Slot.from_json(s) for s in plan.mine])
            except Exception as e:  # a peer that died shows here on some ranks only: the exchange tells all
                status = Status.of(e)
        else:
            status = plan.status
        verdict = ch.exchange(f"{rnd.vid}/peers", status, what=what)
        if verdict.ok:
            result.set_result(rnd.vid)
        else:
            result.set_exception(verdict.status.error_object(wrap=True))

    def _plan(self, rnd: Round) -> Decision:
        view = self.view
        moves = copy_moves(view.topology, self.peers, rnd.plan.writers, rnd.plan.sizes, rnd.plan.part_bytes)
        slots = schedule(moves, view.cache.config.peers.batch_bytes)
        return Decision(None, shares(slots, view.world_size))

    def _copy(self, rnd: Round, slots: list[Slot]) -> None:
        view = self.view
        cache = view.cache
        repo = cache.repo
        disk = repo.durable[self.tier]
        algo = cache.config.hash
        written: list[str] = []
        parts: list[tuple[str, bytes]] = []  # written once the chunks they name are durable
        writes: list[Future[None]] = []
        failed: list[BaseException] = []

        def read(m: Move) -> torch.Tensor:
            if m.chunk.startswith(_PART):
                data = disk.get(part_key(rnd.vid, int(m.chunk[len(_PART):])))
                if data is None or len(data) != m.nbytes:
                    raise IntegrityError(f"{m.chunk} of version {rnd.vid} is not on this node's disk as written")
                return torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buf = torch.empty(m.nbytes, dtype=torch.uint8)
            cache.reader.read_chunk(m.chunk, m.nbytes, algo, [(byte_view(buf), 0, m.nbytes)])
            return buf

        def store(m: Move, data: torch.Tensor) -> None:
            raw = byte_view(data)
            if m.chunk.startswith(_PART):
                rank = int(m.chunk[len(_PART):])
                where = f"rank {rank}'s part of version {rnd.vid} from rank {m.src}"
                part = Version.from_json(bytes(raw), source=where)
                if part.id != rnd.vid or part.rank != rank:
                    raise IntegrityError(f"{m.chunk} from rank {m.src} is not rank {rank}'s part of version {rnd.vid}")
                parts.append((part_key(rnd.vid, rank), bytes(raw)))
                return
            if codecs.content_id(raw, algo) != m.chunk:
                raise IntegrityError(f"chunk {m.chunk} from rank {m.src} does not match its id")
            obj = bytearray(codecs.HEADER_BYTES + m.nbytes)
            codecs.write_header(memoryview(obj)[: codecs.HEADER_BYTES],
                                codecs.ChunkHeader(m.chunk, m.nbytes, m.nbytes, codecs.RAW, 1, algo))
            obj[codecs.HEADER_BYTES :] = raw
            disk.put(chunk_key(m.chunk), obj, sync_name=False)
            written.append(m.chunk)

        threads = disk.write_threads or cache.config.io_threads
        with ThreadPoolExecutor(threads, thread_name_prefix="tiercache-peer-write") as pool:

            def land(m: Move, data: torch.Tensor | None) -> None:
                if data is None:
                    failed.append(IntegrityError(f"rank {m.src} could not read {m.chunk} to copy it"))
                    return
                writes.append(pool.submit(store, m, data))

            run_moves(self.group, view.rank, slots, read=read, land=land, threads=cache.config.io_threads)
            for w in writes:
                w.result()
        if failed:
            raise failed[0]
        repo.stored(self.tier, written)
        repo.sync_chunks(self.tier, written)
        for key, data in parts:
            disk.put(key, data)


__all__ = ["Replicator", "copy_moves"]
