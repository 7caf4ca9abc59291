"""Restore over a process group: own node first, then a peer's copy, then S3, each chunk read once.

Every rank of the group restores its part (or the whole state of a version one process saved)
with :func:`group_fill` as the cache's reader (see :meth:`tiercache.TierCache.restore_version`):

1. Each rank sorts the chunks it needs into those its node holds (its RAM arena, its node-local
   disk) and the missing ones; the ranks exchange their missing lists. If none is missing
   anywhere, every rank reads from its own node and nothing else is exchanged.
2. Otherwise the ranks exchange which of the missing chunks they hold, and every rank computes
   the same plan (:func:`plan_moves`): a chunk some rank's node holds (a peer copy, or the
   replica of a rank on a node that survived) is sent by that rank to every rank that lacks it;
   a chunk no node holds is read by one of the ranks that need it from S3 (or a shared disk),
   chosen so that the reads are spread, and sent from there to the others. A chunk the
   data-parallel replicas all need is so read once for the whole group, whatever the world size.
3. Transfers run over point to point messages of the group (:mod:`tiercache.transfer`), while
   each rank reads its node-local chunks; every received chunk is verified against its id.
4. The ranks exchange their statuses, so a failure fails the restore on every rank with the
   same error.

Bytes are reported per source (``ram``, ``disk``, ``peer``, ``s3``) in ``cache.last_restore``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tiercache import codecs
from tiercache.agreement import Status, rebuild_error
from tiercache.errors import IntegrityError, TierCacheError
from tiercache.names import chunk_key
from tiercache.restore import Fill, Progress, Targets, byte_view, chunk_targets, scatter
from tiercache.transfer import Move, run_moves

if TYPE_CHECKING:
    from tiercache.cache import TierCache
    from tiercache.manifest import Version

#: The source name of chunks received from another rank.
PEER = "peer"


def plan_moves(version: Version, missing: Sequence[Collection], holding: Sequence[Collection]) -> list[Move]:
    """Who sends each missing chunk to whom (the same plan on every rank).

    Args:
        version: The version (chunk order and sizes).
        missing: Per rank, the ids of the chunks it needs and its node does not hold.
        holding: Per rank, the ids among all ranks' missing ones that its node holds.

    Returns:
        One move per missing chunk, in the version's chunk order: from the least loaded rank
        that holds it, else from the least loaded rank that needs it (which reads it from a
        shared tier), to every other rank that needs it.
    """
    load = [0] * len(missing)
    moves: list[Move] = []
    needing: dict[str, list[int]] = {}
    held: dict[str, list[int]] = {}
    for index, per_rank in ((needing, missing), (held, holding)):
        for rank, ids in enumerate(per_rank):
            for cid in ids:
                index.setdefault(cid, []).append(rank)
    for c in version.chunks:
        needers = needing.pop(c.id, None)  # popped: a chunk the version names twice moves once
        if not needers:
            continue
        holders = held.get(c.id, [])
        src = min(holders or needers, key=lambda r: (load[r], r))
        dsts = tuple(r for r in needers if r != src)
        load[src] += c.nbytes * max(1, len(dsts))
        moves.append(Move(c.id, c.nbytes, src, dsts))
    return moves


class _GroupFill:
    """One restore's :data:`~tiercache.restore.Fill` over ``group`` (see the module docstring)."""

    def __init__(self, cache: TierCache, group: dist.ProcessGroup, rank: int, world_size: int,
                 node_local: frozenset[str]) -> None:
        self.cache = cache
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.node_local = node_local
        self.read: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, version: Version, dests: Sequence[torch.Tensor], progress: Progress | None) -> dict[str, int]:
        targets = chunk_targets(version, dests)
        needed = [i for i, t in enumerate(targets) if t]
        held = self._held({version.chunks[i].id for i in needed})
        missing = [version.chunks[i].id for i in needed if version.chunks[i].id not in held]
        everyone = self._gather(missing)
        wanted = {c for m in everyone for c in m}
        status: Status = ("ok", None)
        try:
            if not wanted:
                self._count(self.cache.reader.read_chunks(version, needed, targets, progress))
            else:
                holding = self._gather(sorted(self._held(wanted)))
                moves = plan_moves(version, [set(m) for m in everyone], [set(h) for h in holding])
                own = [i for i in needed if version.chunks[i].id in held]
                with ThreadPoolExecutor(1, thread_name_prefix="tiercache-restore-local") as pool:
                    local = pool.submit(self.cache.reader.read_chunks, version, own, targets, progress)
                    self._transfer(version, moves, set(missing), targets, progress)
                    self._count(local.result())
        except Exception as e:
            status = ("error", (type(e).__name__, str(e)))
        statuses = self._gather(status)
        failed = next((s for s in statuses if s[0] != "ok"), None)
        if failed is not None:
            raise rebuild_error(*failed[1])
        return self.read

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _count(self, read: dict[str, int]) -> None:
        with self._lock:
            for src, n in read.items():
                self.read[src] = self.read.get(src, 0) + n

    def _held(self, ids: set[str]) -> set[str]:
        """The chunks among ``ids`` this rank's node holds (its RAM arena, its node-local disk).

        The disk is asked rather than the catalog: other ranks of the node and peer copies
        write there without this process's catalog knowing; what is found is noted so the
        reader tries it.
        """
        repo = self.cache.repo
        out: set[str] = set()
        for name, tier in repo.tiers.items():
            if not tier.durable:  # the RAM arena: this process's catalog knows what it holds
                out |= ids & repo.catalog.chunks_on(name)
        for name in sorted(self.node_local):
            if not repo.available(name):
                continue
            tier = repo.durable[name]
            try:
                found = [c for c in ids - out if tier.exists(chunk_key(c))]
            except TierCacheError:  # a failing disk holds nothing this restore can count on
                found = []
            repo.stored(name, found)
            out |= set(found)
        return out

    def _transfer(
        self, version: Version, moves: list[Move], missing: set[str], targets: list[Targets], progress: Progress | None
    ) -> None:
        """Send the chunks this rank reads for others and receive the ones it lacks (``missing``)."""
        where: dict[str, list[Targets]] = {}  # a missing chunk -> the targets of every index it has
        for c, t in zip(version.chunks, targets, strict=True):
            if t and c.id in missing:
                where.setdefault(c.id, []).append(t)
        algo = version.hash_algo
        reader = self.cache.reader
        bad: list[IntegrityError] = []

        def deliver(m: Move, raw: memoryview) -> None:
            for t in where.get(m.chunk, ()):
                scatter(t, raw)
            if progress is not None:
                progress(m.nbytes)

        def read(m: Move) -> torch.Tensor:
            buf = torch.empty(m.nbytes, dtype=torch.uint8)
            tier = reader.read_chunk(m.chunk, m.nbytes, algo, [(byte_view(buf), 0, m.nbytes)])
            if m.chunk in where:  # this rank lacked it too: it read it for the group
                deliver(m, byte_view(buf))
                self._count({tier: m.nbytes})
            return buf

        def land(m: Move, data: torch.Tensor | None) -> None:
            # Never raises: the other ranks' later batches still need this rank's sends.
            if data is None:
                bad.append(IntegrityError(f"chunk {m.chunk}: rank {m.src} could not read it for the group (no node "
                                          "holds it and no shared tier gave a good copy)"))
                return
            raw = byte_view(data)
            if codecs.content_id(raw, algo) != m.chunk:
                bad.append(IntegrityError(f"chunk {m.chunk} from rank {m.src} does not match its id"))
                return
            deliver(m, raw)
            self._count({PEER: m.nbytes})

        cfg = self.cache.config
        run_moves(self.group, self.rank, moves, read=read, land=land, budget=cfg.peers.batch_bytes,
                  threads=cfg.io_threads)
        if bad:
            raise bad[0]


def group_fill(cache: TierCache, group: dist.ProcessGroup, rank: int, world_size: int,
               node_local: frozenset[str]) -> Fill:
    """A :data:`~tiercache.restore.Fill` that restores this rank's chunks as part of ``group`` (a collective).

    Args:
        cache: This process's cache.
        group: A private gloo group of the process group, used by the calling thread only.
        rank: This process's rank in ``group``.
        world_size: The size of ``group``.
        node_local: The durable tiers of this cache that are node-local (``{"disk"}`` unless the
            disk is shared or absent).
    """
    return _GroupFill(cache, group, rank, world_size, node_local)


__all__ = ["PEER", "group_fill", "plan_moves"]
