"""Multi-rank save and restore on torch.distributed (DESIGN.md section 7).

Every rank of a process group calls ``cache.save(state, step=..., group=g)`` with its own part of
the state (a DDP replica, its FSDP/DTensor shards: DTensors are saved as their local shards). Each
rank's own :class:`~tiercache.cache.TierCache` (one per process; the ranks of a node may share one
disk directory) stages and writes that part; the group commits one version for all of them.

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
   ranks' states) and assigns each distinct chunk to one owner: a chunk only one rank holds is
   its own; a chunk several ranks hold (a replicated tensor: same path, same bytes on every
   rank) goes to the holder with the fewest bytes assigned so far, so a replicated tensor cut
   into ``world_size`` chunks is written slice ``r`` by rank ``r``, in parallel (FastPersist).
   Chunks are content-addressed, so the same chunk is never written by two ranks.
3. Each rank's writer writes the chunks it owns; the coordinators then gather every rank's
   status for that tier. Only if every rank's chunks are durable there does rank 0 write the
   merged manifest and move the ref (compare-and-swap); its result is broadcast. Every rank's
   level future then resolves with the version id, or fails with the same error: the first
   failing rank's error as a :class:`GroupSaveError` (or a :class:`~tiercache.errors.SkippedError`
   if some rank's policy skipped the tier), and nothing is committed on that tier. A rank that
   dies or stops answering breaks the collective (gloo notices a closed connection; otherwise the
   group's timeout fires): every survivor fails the version with the same :class:`GroupSaveError`,
   and later saves through this group fail at once.

Levels are settled per tier as in the single-process engine: ``local`` when the disk tier is
committed for the group, ``remote`` for S3, ``durable`` for the first of them.

Chunk size. To split replicated tensors among the ranks, big tensors are cut into chunks of
``min(chunk_bytes, max(pack_below, largest tensor / world_size))`` (page rounded, agreed by all
ranks in step 1); layouts, and so chunk ids, then match across ranks for identical tensors.

Restore is collective too: rank 0 resolves the ref and broadcasts the manifest; each rank reads
its own part (from the fastest tier holding each chunk) at the same world size, or the whole state
when the version was saved by one process. Resharding to another world size goes through the
DCP integration (:mod:`tiercache.integrations.dcp`).
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
from tiercache.cache import _json_meta
from tiercache.errors import ConfigError, GroupSaveError, InvalidArgumentError, SkippedError, TierCacheError
from tiercache.handle import LEVELS, TIER_LEVEL, SaveHandle
from tiercache.layout import PAGE, round_up
from tiercache.manifest import Piece, RankPart, RefRecord, Version, new_version_id
from tiercache.names import check_name

if TYPE_CHECKING:
    from tiercache.cache import TierCache
    from tiercache.restore import Progress

log = logging.getLogger("tiercache.distributed")

#: How long a rank waits for the others at one step of a save or restore.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_KEEP_ROUNDS = 64

# A rank's status for one step: ("ok", payload) | ("skip", message) | ("error", "Type: message").
_Status = tuple[str, Any]


def _status_of(err: BaseException) -> _Status:
    if isinstance(err, SkippedError):
        return ("skip", str(err))
    return ("error", f"{type(err).__name__}: {err}")


def _verdict(statuses: list[_Status], vid: str, tier: str) -> BaseException | None:
    """The group's outcome from every rank's status: the first error, else the first skip, else None."""
    failed = [(rank, detail) for rank, (kind, detail) in enumerate(statuses) if kind == "error"]
    if failed:
        return GroupSaveError(f"version {vid} failed on {tier}: rank {failed[0][0]}: {failed[0][1]}")
    skipped = [(rank, detail) for rank, (kind, detail) in enumerate(statuses) if kind == "skip"]
    if skipped:
        return SkippedError(f"version {vid} skipped for {tier} by rank {skipped[0][0]}: {skipped[0][1]}")
    return None


def local_state(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (a view: same storage)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed tensors holds none
        return state
    if not any(isinstance(x, DTensor) for x in tree_leaves(state)):
        return state
    return tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, state)


def _shift(node: Any, off: int) -> Any:
    """An object tree (see :mod:`tiercache.format`) with every tensor index moved by ``off``."""
    if type(node) is not list or not node:
        return node
    tag = node[0]
    if tag == "t" and len(node) == 2:
        return ["t", node[1] + off]
    if tag in ("list", "tuple"):
        return [tag, *(_shift(v, off) for v in node[1:])]
    if tag in ("dict", "odict"):
        return [tag, {k: _shift(v, off) for k, v in node[1].items()}, *(_shift(m, off) for m in node[2:])]
    if tag in ("kdict", "kodict"):
        return [tag, [[k, _shift(v, off)] for k, v in node[1]], *(_shift(m, off) for m in node[2:])]
    return node  # scalar leaves hold no tensors


def merge_parts(parts: list[Version]) -> Version:
    """Merge the ranks' partial manifests (rank order) into the group's version manifest.

    Chunks are deduplicated by id in first-seen order, tensors are concatenated in rank order
    (paths prefixed with the rank, as in a list of the ranks' states), and the object tree is
    the list of the ranks' trees.

    Raises:
        InvalidArgumentError: If the ranks hash chunks with different algorithms.
    """
    head = parts[0]
    if any(p.hash_algo != head.hash_algo for p in parts):
        raise InvalidArgumentError("the ranks' caches use different hash algorithms: configure the same `hash`")
    chunks: list = []
    index: dict[str, int] = {}
    tensors: list = []
    rank_parts: list[RankPart] = []
    trees: list[Any] = []
    for rank, part in enumerate(parts):
        remap = []
        for c in part.chunks:
            if c.id not in index:
                index[c.id] = len(chunks)
                chunks.append(c)
            remap.append(index[c.id])
        first = len(tensors)
        for t in part.tensors:
            pieces = tuple(Piece(chunk=remap[p.chunk], chunk_offset=p.chunk_offset, offset=p.offset, nbytes=p.nbytes)
                           for p in t.pieces)
            tensors.append(t.model_copy(update={"path": f"{rank}/{t.path}", "pieces": pieces}))
        rank_parts.append(RankPart(first=first, count=len(part.tensors), tree=part.tree, pickled=part.pickled))
        trees.append(_shift(part.tree, first))
    return Version(
        id=head.id, parent=head.parent, branch=head.branch, step=head.step, created_at=head.created_at,
        meta=head.meta, hash_algo=head.hash_algo, chunks=tuple(chunks), tensors=tuple(tensors),
        tree=["list", *trees], pickled=any(p.pickled for p in parts), nbytes=sum(p.nbytes for p in parts),
        parts=tuple(rank_parts),
    )


def assign_owners(parts: list[Version]) -> list[set[str]]:
    """Give each distinct chunk one writer rank; see the module docstring.

    Every rank computes the same answer from the same partial manifests.
    """
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, part in enumerate(parts):
        for c in part.chunks:
            ranks = holders.setdefault(c.id, [])
            size[c.id] = c.nbytes
            if rank not in ranks:
                ranks.append(rank)
    owned: list[set[str]] = [set() for _ in parts]
    load = [0] * len(parts)
    for single in (True, False):  # a rank's own chunks first: only it can write them
        for cid, ranks in holders.items():
            if (len(ranks) == 1) != single:
                continue
            rank = min(ranks, key=lambda r: (load[r], r))
            owned[rank].add(cid)
            load[rank] += size[cid]
    return owned


def rebuild_error(type_name: str, message: str) -> TierCacheError:
    """The tiercache error named ``type_name`` (a :class:`GroupSaveError` if it is not one)."""
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, TierCacheError):
        return cls(message)
    return GroupSaveError(f"{type_name}: {message}")


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
        self._partial: Future[_Status] | None = None
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

    # -- coordinator side --

    def partial(self) -> _Status:
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

    def _read_partial(self) -> _Status:
        if self.stage_error is not None:
            return _status_of(self.stage_error)
        assert self.local is not None
        staged = self.local.future("staged")
        if staged.exception() is not None:
            return _status_of(staged.exception())
        cache = self.owner.cache
        cache.engine.wait_published()
        try:
            return ("ok", cache.catalog.get(self.vid).to_json().decode())
        except TierCacheError as e:
            # Hashing failed: the engine failed every level, "durable" included, with the reason.
            durable = self.local.future("durable")
            return _status_of((durable.exception() if durable.done() else None) or e)

    def status(self, tier: str) -> _Status:
        """Block until this rank's chunks are durable on ``tier`` or its write there failed."""
        if self.stage_error is not None:
            return _status_of(self.stage_error)
        assert self.local is not None
        level = self.local.future(TIER_LEVEL[tier])  # type: ignore[arg-type]
        wait([self.ready[tier], level], return_when=FIRST_COMPLETED)
        if self.ready[tier].done():
            return ("ok", None)
        return _status_of(level.exception() or TierCacheError(f"the write to {tier} ended without a commit"))

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
                err = GroupSaveError(f"version {rnd.vid} failed on {self.tier}: the process group failed while "
                                     f"the ranks agreed on it (a rank died or did not answer in time)")
                err.__cause__ = e
                rnd.settle(self.tier, err)

    def _gather(self, status: _Status) -> list[_Status]:
        out: list[Any] = [None] * self.owner.world_size
        dist.all_gather_object(out, status, group=self.group)
        return out

    def _settle(self, rnd: _Round) -> None:
        tables = self._gather(rnd.partial())
        err = _verdict(tables, rnd.vid, self.tier)
        if err is not None:
            rnd.settle(self.tier, err)
            return
        parts = [Version.from_json(t[1].encode(), source=f"rank {r}'s part") for r, t in enumerate(tables)]
        merged = merge_parts(parts)
        rnd.owners[self.tier].set_result(assign_owners(parts)[self.owner.rank])
        err = _verdict(self._gather(rnd.status(self.tier)), rnd.vid, self.tier)
        result: list[Any] = [None]
        if self.owner.rank == 0:
            result[0] = ("ok", None)
            if err is None:
                try:
                    self.owner.cache.repo.commit(self.tier, merged, rnd.ref)
                except Exception as e:
                    result[0] = _status_of(e)
        dist.broadcast_object_list(result, src=self.src, group=self.group)
        if err is None and result[0][0] != "ok":
            err = GroupSaveError(f"version {rnd.vid} failed on {self.tier}: rank 0 could not commit it: "
                                 f"{result[0][1]}")
        if err is None:
            self.owner.cache.repo.adopt(merged, [self.tier])
        rnd.settle(self.tier, err)


class DistributedCache:
    """The multi-rank view of one process's cache: save and restore as a process group.

    Create it on every rank (or let ``TierCache.save(..., group=g)`` do it); all ranks must then
    call :meth:`save` and :meth:`restore` in the same order, as with any collective.

    Args:
        cache: This process's cache (each rank opens its own; the ranks of a node may share a
            disk directory, and all share the S3 prefix).
        group: The process group whose ranks save together (default: the world).
        timeout: How long a rank waits for the others at each step before the version fails.

    Raises:
        ConfigError: If torch.distributed is not initialized.
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
        self._coordinators = {name: _Coordinator(self, name, new()) for name in cache.repo.durable}
        # Recent versions saved through this view: restore waits for them and refuses failed ones.
        self._rounds: dict[str, _Round] = {}
        self._closed = False

    def _chunk_bytes(self, state: Any) -> int:
        cfg = self.cache.config
        largest = max((t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor)),
                       default=0)
        share = round_up(math.ceil(largest / self.world_size), PAGE)
        return min(cfg.chunk_bytes, max(round_up(cfg.pack_below, PAGE), share))

    def _agree(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._fg)
        return out

    def save(self, state: Any, *, step: int, branch: str = "main", meta: Mapping[str, Any] | None = None) -> SaveHandle:
        """Save this rank's part of a version of the group; call it on every rank.

        Returns as soon as this rank's part is copied into its RAM arena; see the module
        docstring for how the version is committed.

        Args:
            state: This rank's state (DTensors are saved as their local shards).
            step: The training step; the same on every rank.
            branch: The branch; the same on every rank.
            meta: JSON-able metadata; rank 0's is kept.

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
            votes = self._agree((step, branch, self._chunk_bytes(part), proposal))
            if any(v[:2] != (step, branch) for v in votes):
                seen = sorted({f"step {v[0]} on {v[1]!r}" for v in votes})
                raise InvalidArgumentError(f"the ranks save different versions ({', '.join(seen)}): "
                                           "every rank must save the same step on the same branch")
            vid, parent, seq = votes[0][3]
            ref = RefRecord(kind="branch", name=branch, version=vid, seq=seq)
            rnd = _Round(self, vid, ref)
            try:
                rnd.local = engine.stage(
                    part, step=step, branch=branch, meta=_json_meta(meta), parent=parent, seq=seq,
                    version_id=vid, chunk_bytes=max(v[2] for v in votes), committer=rnd,
                )
            except BaseException as e:
                rnd.stage_error = e
                self._submit(rnd)
                raise
            if self.rank == 0:
                nxt.version = vid
            else:
                cache.catalog.set_ref(ref)  # follow the group's head (rank 0 moves the ref)
        self._submit(rnd)
        return self._handle(rnd)

    def _submit(self, rnd: _Round) -> None:
        if len(self._rounds) >= _KEEP_ROUNDS:
            self._rounds.pop(next(iter(self._rounds)))
        self._rounds[rnd.vid] = rnd
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
        found: list[Any] = [None]
        if self.rank == 0:
            try:
                found[0] = ("ok", self._resolve(ref).to_json().decode())
            except TierCacheError as e:
                found[0] = ("error", type(e).__name__, str(e))
        dist.broadcast_object_list(found, src=self._src, group=self._fg)
        if found[0][0] != "ok":
            raise rebuild_error(found[0][1], found[0][2])
        version = Version.from_json(found[0][1].encode(), source=f"manifest of {ref!r}")
        # Another rank (or process) may have committed it since this process's catalog was loaded.
        cache.repo.adopt(version, cache.repo.committed_on(version.id))
        if version.parts:
            if len(version.parts) != self.world_size:
                raise InvalidArgumentError(
                    f"version {version.id} was saved by {len(version.parts)} ranks, this group has "
                    f"{self.world_size}: restore it at the same world size, or save and load it with "
                    "tiercache.integrations.dcp to reshard"
                )
            version = rank_view(version, self.rank)
        out = cache.restore_version(version, into=local_state(into), map_location=map_location, progress=progress,
                                    strict=strict)
        if resume:
            cache.note_restored(ref, version)
        return out

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


def rank_view(version: Version, rank: int) -> Version:
    """The manifest of one rank's part of a multi-rank version, as if that rank had saved alone."""
    part = version.parts[rank]
    cut = len(f"{rank}/")  # merge_parts prefixed the rank's paths; ``into=`` matches the rank's own
    tensors = tuple(t.model_copy(update={"path": t.path[cut:]})
                    for t in version.tensors[part.first : part.first + part.count])
    return version.model_copy(update={
        "tensors": tensors, "tree": part.tree, "pickled": part.pickled,
        "nbytes": sum(t.nbytes for t in tensors), "parts": (),
    })


__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedCache",
    "GroupSaveError",
    "assign_owners",
    "local_state",
    "merge_parts",
    "rank_view",
]
