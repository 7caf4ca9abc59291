"""Multi-rank save and restore on torch.distributed (DESIGN.md section 7).

Every rank of a process group calls ``cache.save(state, step=..., group=g)`` with its own part of
the state (a DDP replica, its FSDP/DTensor shards: DTensors are saved as their local shards). Each
rank's own :class:`~tiercache.cache.TierCache` (one per process) stages and writes that part; the
group commits one version for all of them.

Nodes. RAM and disk are node-local, S3 is shared. Every rank knows the node it runs on
(:mod:`tiercache.nodes`: ``TIERCACHE_NODE``, torchrun's ``GROUP_RANK``, else the host name); the
ranks of one node share its disk directory. A disk on a filesystem every node sees is declared
``disk.shared = true`` and is treated like S3.

Protocol (one version, in save order on every rank):

1. On the training thread, one collective on a private gloo group: rank 0 proposes the version
   id, the parent and the ref ``seq`` from its view of the branch; every rank checks that all
   ranks save the same step and branch, and all take the same chunk size (below). The engine then
   stages the rank's part (the memcpy) with a :class:`~tiercache.pipeline.job.Committer`, and ``save``
   returns.
2. Per durable tier, a coordinator thread with its own gloo group (collectives never run on the
   trainer's groups, nor on the training thread after step 1) gathers every rank's partial tensor
   table once its chunks are hashed, merges them into the version manifest (the tensor table in
   rank order, :class:`~tiercache.manifest.RankPart` per rank, the object tree the list of the
   ranks' states, :class:`~tiercache.manifest.NodePart` per node) and assigns each distinct chunk
   to one writer among the ranks that hold it: a chunk only one rank holds is its own; a chunk
   several ranks hold (a replicated tensor: same path, same bytes on every rank) goes to the
   holder with the fewest bytes assigned so far, so a replicated tensor cut into ``world_size``
   chunks is written slice ``r`` by rank ``r``, in parallel (FastPersist). On a shared tier (S3)
   the whole group splits each distinct chunk this way; on a node-local tier (the disk) each
   node's ranks split the chunks that node's ranks need, so every node holds its own part and a
   chunk is written once per node.
3. Each rank's writer writes the chunks it owns; the coordinators then gather every rank's
   status for that tier. Only if every rank's chunks are durable there is the version committed:
   on a shared tier rank 0 writes the merged manifest and moves the ref (compare-and-swap); on a
   node-local tier each node's lowest rank does so on its node's disk, so every node can restore
   on its own. The results are exchanged, and every rank's level future then resolves with the
   version id, or fails with the same error: the first failing rank's error as a
   :class:`GroupSaveError` (or a :class:`~tiercache.errors.SkippedError` if some rank's policy
   skipped the tier). A rank that dies or stops answering breaks the collective (gloo notices a
   closed connection; otherwise the group's timeout fires): every survivor fails the version with
   the same :class:`GroupSaveError`, and later saves through this group fail at once.
4. With ``[peers] copies = K``, once ``local``, each node's part is copied to K other nodes'
   disks (:mod:`tiercache.peers`), level ``replicated``.

Levels are settled per tier as in the single-process engine: ``local`` when the disk tier is
committed for the group (on every node), ``remote`` for S3, ``durable`` for the first of them,
and ``replicated`` by the peer copies.

Chunk size. To split replicated tensors among the ranks, big tensors are cut into chunks of
``min(chunk_bytes, max(pack_below, largest tensor / world_size))`` (page rounded, agreed by all
ranks in step 1); layouts, and so chunk ids, then match across ranks for identical tensors.

Restore is collective too: the ranks agree on the manifest (rank 0's resolution of the ref, or
the first rank's that has it when rank 0's node lost it), and each rank restores its own part at
the same world size, or the whole state when the version was saved by one process, reading each
chunk from its own node, else from a peer, else from S3, and each chunk the group needs once
(:mod:`tiercache.group_restore`). Resharding to another world size goes through the DCP
integration (:mod:`tiercache.integrations.dcp`).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map

from tiercache import errors
from tiercache.agreement import Status, broken_group, rebuild_error, status_of, verdict
from tiercache.cache import _json_meta
from tiercache.errors import ConfigError, GroupSaveError, InvalidArgumentError, StateMismatchError, TierCacheError
from tiercache.format import flatten
from tiercache.group_manifest import assign_owners, merge_parts, rank_view, writers_by_node
from tiercache.group_restore import group_fill
from tiercache.handle import LEVELS, TIER_LEVEL, SaveHandle
from tiercache.hash_split import SharedHashing, signature
from tiercache.layout import PAGE, Layout, round_up
from tiercache.manifest import NodePart, RefRecord, Version, new_version_id
from tiercache.names import check_name
from tiercache.nodes import Topology, choose_peers
from tiercache.peers import LEVEL as REPLICATED
from tiercache.peers import PeerRound, Replicator
from tiercache.restore import into_targets, match_into

if TYPE_CHECKING:
    from tiercache.cache import TierCache
    from tiercache.pipeline.job import HashSplit
    from tiercache.restore import Progress

log = logging.getLogger("tiercache.distributed")

#: How long a rank waits for the others at one step of a save or restore.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_KEEP_ROUNDS = 64


def local_state(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (a view: same storage)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed tensors holds none
        return state
    if not any(isinstance(x, DTensor) for x in tree_leaves(state)):
        return state
    return tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, state)


class _Round:
    """One multi-rank version on its way: the engine's :class:`Committer` and the group's futures."""

    def __init__(self, owner: DistributedCache, vid: str, ref: RefRecord) -> None:
        self.owner = owner
        self.vid = vid
        self.ref = ref
        tiers = list(owner.cache.repo.durable)
        self.owners: dict[str, Future[Collection[str]]] = {t: Future() for t in tiers}
        self.ready: dict[str, Future[None]] = {t: Future() for t in tiers}
        self.outcome: dict[str, Future[None]] = {t: Future() for t in tiers}
        self.futures: dict[str, Future[str]] = {lvl: Future() for lvl in LEVELS}
        self.local: SaveHandle | None = None
        self.stage_error: BaseException | None = None
        #: The peer copies of this version, when the group makes them.
        self.peer: PeerRound | None = None
        #: Key paths this rank declared the same on every rank (``None``: no rank declared any).
        self.declared: tuple[str, ...] | None = None
        #: Who hashed which chunk, when the ranks split the hashing of declared chunks.
        self.split: HashSplit | None = None
        self._partial: Future[Status] | None = None
        self._lock = threading.Lock()
        self._settled: dict[str, BaseException | None] = {}

    # -- engine side (writer threads) --

    def owned(self, tier: str) -> Collection[str]:
        """See :meth:`tiercache.pipeline.job.Committer.owned`."""
        return self.owners[tier].result()

    def commit(self, tier: str) -> None:
        """See :meth:`tiercache.pipeline.job.Committer.commit`."""
        self.ready[tier].set_result(None)
        self.outcome[tier].result()

    def split_hashing(self, layout: Layout, paths: list[str]) -> HashSplit | None:
        """See :meth:`tiercache.pipeline.job.Committer.split_hashing` and :mod:`tiercache.hash_split`."""
        if self.declared is None:
            return None
        self.split = self.owner.hashing.split(layout, paths, self.declared)
        return self.split

    def hashed_by(self) -> dict[str, int]:
        """Replicated chunk id -> the rank that hashed it (empty if the ranks did not split hashing)."""
        return self.split.hashed_by if self.split is not None else {}

    # -- coordinator side --

    def partial(self) -> Status:
        """This rank's partial manifest once hashed (computed once: a commit later replaces it in the catalog)."""
        with self._lock:
            if self._partial is None:
                self._partial = Future()
                mine = True
            else:
                mine = False
        if mine:
            self._partial.set_result(self._read_partial())
        return self._partial.result()

    def _read_partial(self) -> Status:
        if self.stage_error is not None:
            return status_of(self.stage_error)
        assert self.local is not None
        staged = self.local.future("staged")
        if staged.exception() is not None:
            return status_of(staged.exception())
        cache = self.owner.cache
        cache.engine.wait_published()
        try:
            return ("ok", cache.catalog.get(self.vid).to_json().decode())
        except TierCacheError as e:
            # Hashing failed: the engine failed every level, "durable" included, with the reason.
            durable = self.local.future("durable")
            return status_of((durable.exception() if durable.done() else None) or e)

    def status(self, tier: str) -> Status:
        """Block until this rank's chunks are durable on ``tier`` or its write there failed."""
        if self.stage_error is not None:
            return status_of(self.stage_error)
        assert self.local is not None
        level = self.local.future(TIER_LEVEL[tier])  # type: ignore[arg-type]
        wait([self.ready[tier], level], return_when=FIRST_COMPLETED)
        if self.ready[tier].done():
            return ("ok", None)
        return status_of(level.exception() or TierCacheError(f"the write to {tier} ended without a commit"))

    def settle(self, tier: str, err: BaseException | None) -> None:
        """Resolve ``tier``'s level on this rank: the version id, or ``err`` (the group's verdict)."""
        for f in (self.owners[tier], self.outcome[tier]):
            if f.done():
                continue
            if err is None:
                f.set_result(frozenset() if f is self.owners[tier] else None)
            else:
                f.set_exception(err)
        level = self.futures[TIER_LEVEL[tier]]
        if err is None:
            level.set_result(self.vid)
        else:
            level.set_exception(err)
        with self._lock:
            self._settled[tier] = err
            done = len(self._settled) == len(self.outcome)
            durable = self.futures["durable"]
            if durable.done():
                return
            if err is None:
                durable.set_result(self.vid)
            elif done:
                # The first failed tier in tier order, not in the order they settled here, so
                # every rank reports the same error.
                durable.set_exception(next(e for t in self.outcome if (e := self._settled[t]) is not None))


class _Coordinator:
    """One durable tier's side of the group protocol, on its own thread and gloo group."""

    def __init__(self, owner: DistributedCache, tier: str, group: dist.ProcessGroup) -> None:
        self.owner = owner
        self.tier = tier
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.queue: queue.Queue[_Round | None] = queue.Queue()
        self.broken: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"tiercache-group-{tier}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (rnd := self.queue.get()) is not None:
            if self.broken is not None:
                rnd.settle(self.tier, GroupSaveError(
                    f"version {rnd.vid} failed on {self.tier}: the process group broke during an earlier save"))
                continue
            try:
                self._settle(rnd)
            except Exception as e:  # a collective failed: a rank died or timed out
                log.error("version %s on %s: process group failed: %s", rnd.vid, self.tier, e)
                self.broken = e
                rnd.settle(self.tier, broken_group(rnd.vid, self.tier, e))

    def _gather(self, status: Status) -> list[Status]:
        out: list[Any] = [None] * self.owner.world_size
        dist.all_gather_object(out, status, group=self.group)
        return out

    def _settle(self, rnd: _Round) -> None:
        owner = self.owner
        tables = self._gather(rnd.partial())
        err = verdict(tables, rnd.vid, self.tier)
        if err is not None:
            rnd.settle(self.tier, err)
            return
        parts = [Version.from_json(t[1].encode(), source=f"rank {r}'s part") for r, t in enumerate(tables)]
        merged = merge_parts(parts, owner.nodes)
        by_node = self.tier in owner.node_local
        if by_node:
            writers = writers_by_node(parts, owner.topology, rnd.hashed_by())
            node_chunks: Collection[str] | None = writers[owner.node]
            rnd.owners[self.tier].set_result({c for c, r in writers[owner.node].items() if r == owner.rank})
            if rnd.peer is not None:  # the peer copies start once this tier is settled
                rnd.peer.version, rnd.peer.writers = merged, writers
        else:
            node_chunks = None
            rnd.owners[self.tier].set_result(assign_owners(parts, rnd.hashed_by())[owner.rank])
        err = verdict(self._gather_status(rnd), rnd.vid, self.tier)
        err = self._commit(rnd, merged, err, node_chunks)
        if err is None:
            owner.cache.repo.adopt(merged, [self.tier], node_chunks)
        rnd.settle(self.tier, err)

    def _gather_status(self, rnd: _Round) -> list[Status]:
        """Every rank's status for this tier; when the store throttled some rank, every rank slows down.

        The ranks share the store's key prefixes, so one rank's ``SlowDown`` is the group's (see
        :mod:`tiercache.tiers._s3pacing`); the count rides with the status.
        """
        status = rnd.status(self.tier)
        pacer = self.owner.cache.repo.durable[self.tier].pacer
        mine = pacer.take_throttled() if pacer is not None else 0
        if status[0] == "ok":
            status = ("ok", mine)
        statuses = self._gather(status)
        if pacer is not None and not mine and any(kind == "ok" and n for kind, n in statuses):
            pacer.slow_down()
        return statuses

    def _commit(
        self, rnd: _Round, merged: Version, err: BaseException | None, node_chunks: Collection[str] | None
    ) -> BaseException | None:
        """Commit the merged manifest and the ref if every rank's chunks are durable; the group's outcome.

        On a shared tier (``node_chunks`` is ``None``) rank 0 commits and broadcasts how it went;
        on a node-local tier every node's leader commits on its node (which holds
        ``node_chunks``) and the ranks exchange how it went.
        """
        owner = self.owner
        by_node = node_chunks is not None
        commits = owner.rank == 0 or (by_node and owner.topology.leads(owner.rank))
        result: Status = ("ok", None)
        if commits and err is None:
            try:
                node = owner.topology.names[owner.topology.node_of[owner.rank]] if by_node else None
                owner.cache.repo.commit(self.tier, merged, rnd.ref, held=node_chunks, node=node)
            except Exception as e:
                result = status_of(e)
        if by_node:
            results = self._gather(result)
        else:
            box: list[Any] = [result]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            results = [box[0]]
        if err is not None:
            return err
        for rank, (kind, detail) in enumerate(results):
            if kind != "ok":
                node = owner.topology.names[owner.topology.node_of[rank]]
                who = f"node {node} (rank {rank})" if by_node else "rank 0"
                return GroupSaveError(f"version {rnd.vid} failed on {self.tier}: {who} could not commit it: {detail}")
        return None


class DistributedCache:
    """The multi-rank view of one process's cache: save and restore as a process group.

    Create it on every rank (or let ``TierCache.save(..., group=g)`` do it); all ranks must then
    call :meth:`save` and :meth:`restore` in the same order, as with any collective.

    Args:
        cache: This process's cache (each rank opens its own with the same config; the ranks of
            a node share its disk directory, and all share the S3 prefix).
        group: The process group whose ranks save together (default: the world).
        timeout: How long a rank waits for the others at each step before the version fails.

    Attributes:
        rank: This process's rank in the group.
        world_size: The group's size.
        topology: The group's nodes.
        node_local: The durable tiers each node holds on its own (``{"disk"}`` unless the disk
            is shared or absent).
        nodes: What the manifests of this group's versions say about its nodes.
        hashing: How the ranks split the hashing of chunks they declare alike.

    Raises:
        ConfigError: If torch.distributed is not initialized, or the ranks' configs disagree on
            ``peers.copies`` or ``disk.shared`` (on every rank).
    """

    def __init__(
        self, cache: TierCache, group: dist.ProcessGroup | None = None, *, timeout: timedelta = DEFAULT_TIMEOUT
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("multi-rank saves need torch.distributed: call init_process_group first")
        self.cache = cache
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.rank = ranks.index(dist.get_rank())
        self.world_size = len(ranks)
        # Private gloo groups: tiercache's collectives never interleave with the trainer's own.
        def new() -> dist.ProcessGroup:
            return dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=True)

        self._fg = new()
        self._src = dist.get_global_rank(self._fg, 0)
        cfg = cache.config
        #: The durable tiers each node has its own copy of (a node-local disk).
        self.node_local = frozenset(n for n, t in cache.repo.durable.items() if t.node_local)
        self.topology = Topology.gather(cfg, self._fg, self.world_size)
        self.node = self.topology.node_of[self.rank]
        settings = self._agree((cfg.peers.copies, sorted(self.node_local)))
        if any(s != settings[0] for s in settings):
            raise ConfigError(f"the ranks' configs differ ([peers] copies and node-local tiers per rank: {settings}): "
                              "open every rank's cache with the same config")
        peers, self._no_peers = self._choose_peers()
        self.nodes = tuple(
            NodePart(name=name, domain=self.topology.domains[i], ranks=self.topology.ranks(i),
                     copies=tuple(self.topology.names[p] for p in peers[i]))
            for i, name in enumerate(self.topology.names)
        )
        self._coordinators = {name: _Coordinator(self, name, new()) for name in cache.repo.durable}
        self._replicator = (Replicator(cache, new(), self.rank, self.topology, peers, min(self.node_local))
                            if self._no_peers is None else None)
        self.hashing = SharedHashing(new(), self.rank, self.world_size)
        for tier in cache.repo.durable.values():  # a node sends the requests one process would
            if tier.pacer is not None:
                tier.pacer.share(len(self.topology.ranks(self.node)))
        # Recent versions saved through this view: restore waits for them and refuses failed ones.
        self._rounds: dict[str, _Round] = {}
        self._closed = False

    def _choose_peers(self) -> tuple[list[tuple[int, ...]], ConfigError | None]:
        """Per node, the nodes holding copies of its part; or why this group makes no peer copies."""
        none: list[tuple[int, ...]] = [() for _ in range(self.topology.count)]
        copies = self.cache.config.peers.copies
        if copies == 0:
            return none, ConfigError(f"no {REPLICATED!r} level: [peers] copies is 0 (set it to 1 or more)")
        if not self.node_local:
            return none, ConfigError(f"no {REPLICATED!r} level: peer copies go to node-local disks, and this cache "
                                     "has no [disk] or declares it shared")
        try:
            return choose_peers(self.topology, copies), None
        except ConfigError as e:
            return none, ConfigError(f"no {REPLICATED!r} level: {e}")

    def _chunk_bytes(self, state: Any) -> int:
        cfg = self.cache.config
        largest = max((t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor)),
                       default=0)
        share = round_up(math.ceil(largest / self.world_size), PAGE)
        return min(cfg.chunk_bytes, max(round_up(cfg.pack_below, PAGE), share))

    def _signature(self, part: Any, replicated: Collection[str]) -> str | None:
        """This rank's :func:`~tiercache.hash_split.signature`, or ``None`` if it declares nothing.

        A state that cannot be flattened gets none either: the engine then refuses it (on this
        rank, and the version fails on the others) as without a declaration.
        """
        if not replicated:
            return None
        try:
            return signature(flatten(part, allow_pickle=self.cache.config.allow_pickle), list(replicated))
        except TierCacheError:
            return None

    def _agree(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._fg)
        return out

    def save(
        self, state: Any, *, step: int, branch: str = "main", meta: Mapping[str, Any] | None = None,
        replicated: Collection[str] = (),
    ) -> SaveHandle:
        """Save this rank's part of a version of the group; call it on every rank.

        Returns as soon as this rank's part is copied into its RAM arena; see the module
        docstring for how the version is committed.

        Args:
            state: This rank's state (DTensors are saved as their local shards).
            step: The training step; the same on every rank.
            branch: The branch; the same on every rank.
            meta: JSON-able metadata; rank 0's is kept.
            replicated: Key paths of ``state`` (``"model"``, ``"optim/state"``) whose tensors are
                the same on every rank, as a DDP model and its optimizer state are: each rank
                hashes and writes only its share of their chunks (:mod:`tiercache.hash_split`).
                A promise: a declared tensor that differs between ranks is saved as one rank's.

        Returns:
            A handle whose levels resolve (or fail with the same error) on every rank together.

        Raises:
            InvalidArgumentError: If the ranks disagree on the step or branch (on every rank).
            UnsupportedStateError: If a leaf of this rank's state cannot be stored (the version
                then fails on the other ranks too).
        """
        cache = self.cache
        cache.check_open()
        check_name(branch, "branch")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidArgumentError(f"step must be an int, got {step!r}")
        part = local_state(state)
        engine = cache.engine
        with cache.next_version(branch) as nxt:
            # Rank 0's view decides the parent (the head, or what it resumed from) for the group.
            proposal = (new_version_id(), nxt.parent, nxt.seq) if self.rank == 0 else None
            votes = self._agree((step, branch, self._chunk_bytes(part), proposal, self._signature(part, replicated)))
            if any(v[:2] != (step, branch) for v in votes):
                seen = sorted({f"step {v[0]} on {v[1]!r}" for v in votes})
                raise InvalidArgumentError(f"the ranks save different versions ({', '.join(seen)}): "
                                           "every rank must save the same step on the same branch")
            vid, parent, seq = votes[0][3]
            ref = RefRecord(kind="branch", name=branch, version=vid, seq=seq)
            rnd = _Round(self, vid, ref)
            if votes[0][4] is not None and all(v[4] == votes[0][4] for v in votes):
                rnd.declared = tuple(replicated)  # every rank's layout splits the same way
            elif any(v[4] is not None for v in votes):
                log.info("version %s: the ranks' states or replicated= differ; every rank hashes all of its part", vid)
            try:
                rnd.local = engine.stage(
                    part, step=step, branch=branch, meta=_json_meta(meta), parent=parent, seq=seq,
                    version_id=vid, chunk_bytes=max(v[2] for v in votes), committer=rnd,
                )
            except BaseException as e:
                rnd.stage_error = e
                self._submit(rnd)
                raise
            staged = rnd.local.future("staged")
            # Skipped here (the group then fails it everywhere): the branch does not move to it.
            if not (staged.done() and staged.exception() is not None):
                if self.rank == 0 or (self.node_local and self.topology.leads(self.rank)):
                    nxt.version = vid  # this rank commits the move on a tier
                else:
                    cache.catalog.set_ref(ref)  # follow the group's head (rank 0 or the node's leader moves it)
        self._submit(rnd)
        return self._handle(rnd)

    def _submit(self, rnd: _Round) -> None:
        if len(self._rounds) >= _KEEP_ROUNDS:
            self._rounds.pop(next(iter(self._rounds)))
        self._rounds[rnd.vid] = rnd
        if self._replicator is not None:
            rnd.peer = PeerRound(rnd.vid, rnd.futures["local"], rnd.futures[REPLICATED])
            self._replicator.submit(rnd.peer)
        else:
            rnd.futures[REPLICATED].set_exception(self._no_peers or ConfigError(f"no {REPLICATED!r} level"))
        for c in self._coordinators.values():
            c.queue.put(rnd)

    def _handle(self, rnd: _Round) -> SaveHandle:
        local = rnd.local
        assert local is not None
        tiers = self._coordinators
        # A level with no tier behind it keeps the engine's future, which failed with ConfigError.
        futures = {"staged": local.future("staged"),
                   "durable": rnd.futures["durable"] if tiers else local.future("durable")}
        for tier, lvl in TIER_LEVEL.items():
            futures[lvl] = rnd.futures[lvl] if tier in tiers else local.future(lvl)  # type: ignore[arg-type]
        futures[REPLICATED] = rnd.futures[REPLICATED]
        return SaveHandle(rnd.vid, futures)

    def restore(
        self,
        ref: str = "main",
        *,
        into: Any = None,
        map_location: str | torch.device = "cpu",
        progress: Progress | None = None,
        strict: bool = True,
        resume: bool = True,
    ) -> Any:
        """Return this rank's part of the version ``ref`` resolves to (on rank 0); call it on every rank.

        Args:
            ref: A ref string, resolved by rank 0 for the whole group.
            into: This rank's state to restore into in place (DTensors: their local shards).
            map_location: Device for tensors that are allocated.
            progress: Called with the number of bytes of each chunk read.
            strict: As in :meth:`tiercache.TierCache.restore`.
            resume: As in :meth:`tiercache.TierCache.restore`.

        Returns:
            This rank's state; the whole state on every rank if the version was saved by one process.

        Raises:
            VersionNotFoundError: If the ref resolves to nothing (on every rank).
            InvalidArgumentError: If the version was saved by another number of ranks (restore it
                through :mod:`tiercache.integrations.dcp` to reshard).
        """
        cache = self.cache
        cache.check_open()
        version = self._agree_on_manifest(ref)
        # Another rank (or process) may have committed it since this process's catalog was loaded.
        # A node-local tier holds only its node's part: its chunks are found by asking it.
        tiers = cache.repo.committed_on(version.id)
        cache.repo.adopt(version, [t for t in tiers if t not in self.node_local])
        cache.repo.adopt(version, [t for t in tiers if t in self.node_local], chunks=())
        if version.parts:
            if len(version.parts) != self.world_size:
                raise InvalidArgumentError(
                    f"version {version.id} was saved by {len(version.parts)} ranks, this group has "
                    f"{self.world_size}: restore it at the same world size, or save and load it with "
                    "tiercache.integrations.dcp to reshard"
                )
            version = rank_view(version, self.rank)
        into = local_state(into)
        self._check_into(version, into, strict)
        fill = group_fill(cache, self._fg, self.rank, self.world_size, self.node_local)
        out = cache.restore_version(version, into=into, map_location=map_location, progress=progress,
                                    strict=strict, fill=fill)
        if resume:
            cache.note_restored(ref, version)
        return out

    def _agree_on_manifest(self, ref: str) -> Version:
        """The manifest ``ref`` resolves to: rank 0's answer, else the first rank's that has one.

        A rank whose node lost its disk (and cannot reach S3) knows no version; the others'
        nodes still do.

        Raises:
            VersionNotFoundError: If no rank resolves it (rank 0's error, on every rank).
        """
        try:
            mine: Status = ("ok", self._resolve(ref).id)
        except TierCacheError as e:
            mine = ("error", (type(e).__name__, str(e)))
        answers = self._agree(mine)
        src = next((r for r, (kind, _) in enumerate(answers) if kind == "ok"), None)
        if src is None:
            raise rebuild_error(*answers[0][1])
        box: list[Any] = [self.cache.catalog.get(answers[src][1]).to_json().decode() if self.rank == src else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._fg, src), group=self._fg)
        return Version.from_json(box[0].encode(), source=f"manifest of {ref!r}")

    def _check_into(self, version: Version, into: Any, strict: bool) -> None:
        """Check ``into`` against the version on every rank before the collective read.

        Raises:
            StateMismatchError: If this rank's ``into`` does not match (its own message), or another
                rank's does not (naming that rank); nothing is read on any rank.
        """
        try:
            match_into(version, into_targets(into), strict=strict)
            mine: Status = ("ok", None)
        except TierCacheError as e:
            mine, err = ("error", str(e)), e
        answers = self._agree(mine)
        if mine[0] != "ok":
            raise err
        bad = next(((r, detail) for r, (kind, detail) in enumerate(answers) if kind != "ok"), None)
        if bad is not None:
            raise StateMismatchError(f"rank {bad[0]}'s into= does not match version {version.id}: {bad[1]}")

    def _resolve(self, ref: str) -> Version:
        """The committed manifest ``ref`` resolves to (rank 0): a version still being saved is waited for."""
        vid = self.cache.resolve(ref)
        rnd = self._rounds.get(vid)
        if rnd is not None and rnd.futures["durable"].exception() is not None:
            # The branch head of this process's view (moved at save time, as in a single-process
            # save) names a version the group failed to commit.
            raise errors.VersionNotFoundError(
                f"{ref!r} resolves to version {vid}, which the group failed to save "
                f"({rnd.futures['durable'].exception()}): restore an earlier one, e.g. {ref}~1"
            )
        return self.cache.catalog.get(vid)

    def close(self) -> None:
        """Stop the coordinator threads once every submitted version is settled (the cache calls this)."""
        if self._closed:
            return
        self._closed = True
        for c in self._coordinators.values():
            c.queue.put(None)
        for c in self._coordinators.values():
            c.thread.join()
        if self._replicator is not None:
            self._replicator.close()


__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedCache",
    "GroupSaveError",
    "assign_owners",
    "local_state",
    "merge_parts",
    "rank_view",
    "rebuild_error",
    "writers_by_node",
]
