"""Peer copies: each node's part of a multi-rank version also on ``peers.copies`` other nodes (level ``replicated``).

A node-local disk survives a process crash, not the loss of its node. Once a version is
``local`` (every node holds what its own ranks need, see :mod:`tiercache.distributed`), the
:class:`Replicator` of every rank sends the chunks of its node's part that a peer node lacks to
that peer, over a private gloo group, on its own thread (Gemini; NVIDIA's local checkpointing):

1. Every rank computes the same list of moves (:func:`copy_moves`) from the manifest's nodes
   (which peers hold copies of which node, chosen across failure domains by
   :func:`tiercache.nodes.choose_peers`) and from who wrote which chunk on each node: that rank
   sends it (from its RAM arena, or its node's disk once evicted), and the peer's ranks take turns
   receiving, so a node's receiving and writing are shared by its ranks.
2. A receiver verifies each chunk against its id and writes it to its node's disk, with the same
   durable write as any chunk (tmp, fsync, rename), then syncs the names.
3. The ranks exchange their statuses: ``replicated`` resolves on every rank once every move
   landed, or fails on every rank with the same error. A rank that dies mid-copy breaks the
   group's collective: every survivor fails ``replicated`` with the same
   :class:`~tiercache.errors.GroupSaveError`, while ``local`` and ``remote`` are not affected.

Chunks a peer node holds already (a DDP replica holds every replicated chunk) are not sent.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tiercache import codecs
from tiercache.agreement import Status, broken_group, status_of, verdict
from tiercache.errors import GroupSaveError, IntegrityError
from tiercache.names import chunk_key
from tiercache.nodes import Topology
from tiercache.restore import byte_view
from tiercache.transfer import Move, run_moves

if TYPE_CHECKING:
    from tiercache.cache import TierCache
    from tiercache.manifest import Version

log = logging.getLogger("tiercache.peers")

#: The level peer copies provide.
LEVEL = "replicated"


def copy_moves(
    topology: Topology, peers: Sequence[tuple[int, ...]], writers: Sequence[dict[str, int]], version: Version
) -> list[Move]:
    """The moves that put every node's part on its peers (the same list on every rank).

    Args:
        topology: The group's nodes.
        peers: Per node, the nodes that hold a copy of its part.
        writers: Per node, each chunk of its part -> the rank that wrote it there (it sends it).
        version: The version's manifest (chunk order and sizes).

    Returns:
        One move per chunk and sender; a chunk several peers lack from the same sender is read
        once and sent to each.
    """
    sizes = {c.id: c.nbytes for c in version.chunks}
    position = {cid: i for i, cid in enumerate(sizes)}
    moves: dict[tuple[str, int], list[int]] = {}
    sent: set[tuple[str, int]] = set()
    for node, holders in enumerate(peers):
        part = sorted(writers[node], key=position.__getitem__)  # the node's chunks, in manifest order
        for peer in holders:
            receivers = topology.ranks(peer)
            turn = 0
            for cid in part:
                if cid in writers[peer] or (cid, peer) in sent:
                    continue
                sent.add((cid, peer))
                moves.setdefault((cid, writers[node][cid]), []).append(receivers[turn % len(receivers)])
                turn += 1
    return [Move(cid, sizes[cid], src, tuple(dsts)) for (cid, src), dsts in moves.items()]


class PeerRound:
    """What the replicator needs of one version once it is ``local`` (set by the disk's coordinator).

    Attributes:
        vid: The version id.
        local: The version's ``local`` future on this rank (settled for the group).
        result: The ``replicated`` future to settle.
        version: The merged manifest (set with ``writers`` before ``local`` resolves).
        writers: Per node, each chunk of its part -> the rank that wrote it there.
    """

    def __init__(self, vid: str, local: Future[str], result: Future[str]) -> None:
        self.vid = vid
        self.local = local
        self.result = result
        self.version: Version | None = None
        self.writers: list[dict[str, int]] = []


class Replicator:
    """Sends this rank's share of each version's peer copies and receives its node's, on its own thread.

    Args:
        cache: This process's cache (its disk is the node's).
        group: A private gloo group of the whole process group, used only by this thread.
        rank: This process's rank in ``group``.
        topology: The group's nodes.
        peers: Per node, the nodes that hold a copy of its part.
        tier: The node-local durable tier the copies go to (the node's disk).
    """

    def __init__(
        self, cache: TierCache, group: dist.ProcessGroup, rank: int, topology: Topology,
        peers: Sequence[tuple[int, ...]], tier: str,
    ) -> None:
        self.cache = cache
        self.group = group
        self.rank = rank
        self.topology = topology
        self.peers = list(peers)
        self.broken: BaseException | None = None
        self.tier = tier
        self._queue: queue.Queue[PeerRound | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tiercache-peers", daemon=True)
        self._thread.start()

    def submit(self, rnd: PeerRound) -> None:
        """Replicate ``rnd`` once it is ``local`` (versions go in save order, as on every rank)."""
        self._queue.put(rnd)

    def _run(self) -> None:
        while (rnd := self._queue.get()) is not None:
            if self.broken is not None:
                rnd.result.set_exception(GroupSaveError(
                    f"version {rnd.vid} failed on peers: the process group broke during an earlier save"))
                continue
            try:
                err = self._replicate(rnd)
            except Exception as e:  # a collective failed: a rank died or timed out
                log.error("version %s: peer copies: process group failed: %s", rnd.vid, e)
                self.broken = e
                err = broken_group(rnd.vid, "peers", e)
            if err is None:
                rnd.result.set_result(rnd.vid)
            else:
                rnd.result.set_exception(err)

    def _replicate(self, rnd: PeerRound) -> BaseException | None:
        local = rnd.local.exception()  # blocks until the group settled ``local``, the same on every rank
        if local is not None:
            return GroupSaveError(f"version {rnd.vid} failed on peers: it is not local on every node ({local})")
        version = rnd.version
        assert version is not None
        moves = copy_moves(self.topology, self.peers, rnd.writers, version)
        status: Status = ("ok", None)
        try:
            self._copy(version, moves)
        except Exception as e:
            # A peer that died shows here on some ranks only; the exchange below then fails on
            # every survivor, which reports it the same way.
            status = status_of(e)
        out: list[Any] = [None] * len(self.topology.node_of)
        dist.all_gather_object(out, status, group=self.group)
        return verdict(out, rnd.vid, "peers")

    def _copy(self, version: Version, moves: list[Move]) -> None:
        cache = self.cache
        repo = cache.repo
        disk = repo.durable[self.tier]
        algo = version.hash_algo
        cfg = cache.config
        written: list[str] = []
        writes: list[Future[None]] = []
        failed: list[BaseException] = []

        def read(m: Move) -> torch.Tensor:
            buf = torch.empty(m.nbytes, dtype=torch.uint8)
            cache.reader.read_chunk(m.chunk, m.nbytes, algo, [(byte_view(buf), 0, m.nbytes)])
            return buf

        def store(m: Move, data: torch.Tensor) -> None:
            raw = byte_view(data)
            if codecs.content_id(raw, algo) != m.chunk:
                raise IntegrityError(f"chunk {m.chunk} from rank {m.src} does not match its id")
            obj = bytearray(codecs.HEADER_BYTES + m.nbytes)
            codecs.write_header(memoryview(obj)[: codecs.HEADER_BYTES],
                                codecs.ChunkHeader(m.chunk, m.nbytes, m.nbytes, codecs.RAW, 1, algo))
            obj[codecs.HEADER_BYTES :] = raw
            disk.put(chunk_key(m.chunk), obj, sync_name=False)

        threads = disk.write_threads or cfg.io_threads
        with ThreadPoolExecutor(threads, thread_name_prefix="tiercache-peer-write") as pool:

            def land(m: Move, data: torch.Tensor | None) -> None:
                if data is None:
                    failed.append(IntegrityError(f"rank {m.src} could not read chunk {m.chunk} to copy it"))
                    return
                written.append(m.chunk)
                writes.append(pool.submit(store, m, data))

            run_moves(self.group, self.rank, moves, read=read, land=land, budget=cfg.peers.batch_bytes,
                      threads=cfg.io_threads)
            for w in writes:
                w.result()
        if failed:
            raise failed[0]
        repo.stored(self.tier, written)
        repo.sync_chunks(self.tier, written)

    def close(self) -> None:
        """Stop once every submitted version is settled."""
        self._queue.put(None)
        self._thread.join()


__all__ = ["LEVEL", "PeerRound", "Replicator", "copy_moves"]
