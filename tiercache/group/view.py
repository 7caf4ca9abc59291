"""The multi-rank view of a cache: save and restore as a process group (docs/design.md section 7).

Every rank of a process group calls ``cache.save(state, step=..., group=g)`` with its own part of
the state (a DDP replica, its FSDP/DTensor shards: DTensors are saved as their local shards).
Each rank's cache (one per process) stages and writes that part; the group commits one version.

Every exchange goes through the group's one collective layer (:mod:`tiercache.group.collective`),
tagged with the version and the phase, answered by every rank even when its own work failed:

* ``view`` (once, when the view is made): the ranks' nodes, and the settings that must be the
  same on every rank (chunk size, pack size, hash, peer copies, which tiers are node-local);
  differing settings fail every rank with a :class:`~tiercache.errors.ConfigError` naming the
  setting and the ranks.
* ``save/<n>`` (on the training thread, the only exchange ``save()`` waits for): each rank's
  local checks of its call (an open cache, a valid branch and step, JSON-able meta, a state it
  can store: flattened once, here) and rank 0's proposal of the version (id, parent, ref seq).
  A bad input on one rank fails the save on every rank at once, naming the rank and the input.
  Then the rank copies its part into its RAM arena and ``save()`` returns.
* the background phases of the version (:mod:`tiercache.group.phases`), then its peer copies
  (:mod:`tiercache.group.peers`).

Outcome: one per version, the same on every rank: each level (``local``, ``remote``,
``replicated``, ``durable``) resolves with the version id on every rank, or fails on every rank
with the same error. A failed version leaves the group usable: the next one starts clean. Only
a rank's death (or the store's) breaks the group, which every rank then reports once, and later
saves fail at once with that reason.

Restore is collective too (:mod:`tiercache.group.restore`): each rank reads only its own part's
manifest and chunks, from its own node, else a peer, else S3.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from tiercache.agent.peering import advertised_host
from tiercache.config import this_node
from tiercache.errors import ConfigError, InvalidArgumentError, SkippedError, TierCacheError
from tiercache.failpoints import failpoint
from tiercache.format import Flat, flatten
from tiercache.group.collective import Blame, Collective, Decision
from tiercache.group.hashing import SharedHashing, declared_chunks, signature
from tiercache.group.peers import Replicator
from tiercache.group.phase_status import Status
from tiercache.group.phases import Phases
from tiercache.group.round import Round
from tiercache.group.topology import Topology, choose_peers
from tiercache.handle import SaveHandle
from tiercache.layout import PAGE, round_up
from tiercache.manifest import NodePart, RefRecord, check_meta, new_version_id, utcnow
from tiercache.names import check_name

if TYPE_CHECKING:
    import torch

    from tiercache.cache import TierCache
    from tiercache.core import CacheCore
    from tiercache.restore import Progress

log = logging.getLogger("tiercache.group.view")

#: How long a rank waits for the others at one phase of a save or restore.
DEFAULT_TIMEOUT = timedelta(minutes=10)
#: The level peer copies provide.
REPLICATED = "replicated"
#: Recent versions a view keeps track of (restore waits for them; parents are chosen among them).
_KEEP_ROUNDS = 64
#: Views this process made per process group: the same count on every rank, so it names the
#: view's keys in the group's store the same way everywhere.
_made: dict[str, int] = {}
_made_lock = threading.Lock()


def _group_store(group: dist.ProcessGroup) -> dist.Store:
    """A store prefix of the job's store for a new view of ``group``."""
    from torch.distributed.distributed_c10d import _get_process_group_store

    name = group.group_name
    with _made_lock:
        n = _made.get(name, 0)
        _made[name] = n + 1
    # The store the group was made with: reachable by every rank, owned by the launcher (or
    # rank 0). torch has no public accessor for it.
    return dist.PrefixStore(f"tiercache/{name}/{n}/", _get_process_group_store(group))


class GroupView:
    """The multi-rank view of one process's cache: save and restore as a process group.

    Made by ``cache.distributed(group)`` (or the first ``save(..., group=g)``) on every rank at
    the same point; all ranks must then call :meth:`save` and :meth:`restore` in the same
    order, as with any collective.

    Args:
        cache: This process's cache (each rank opens its own with the same config; the ranks of
            a node share its disk directory, and all share the S3 prefix). The view calls its
            public methods only.
        core: Its internal interface (:class:`~tiercache.core.CacheCore`): the tiers, the catalog,
            the save engine and the save lock, the reader.
        group: The process group whose ranks save together (default: the world).
        timeout: How long a rank waits for the others at each phase before the version fails.

    Attributes:
        rank: This process's rank in the group.
        world_size: The group's size.
        topology: The group's nodes.
        node: This rank's node (an index into ``topology.names``).
        node_local: The durable tiers each node holds on its own (``{"disk"}`` unless the disk
            is shared or absent).
        nodes: What the manifests of this group's versions say about its nodes.

    Raises:
        ConfigError: If torch.distributed is not initialized, or the ranks' configs differ in a
            setting that must be the same (on every rank, naming the setting and the ranks).
    """

    def __init__(self, cache: TierCache, core: CacheCore, group: dist.ProcessGroup | None = None, *,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("multi-rank saves need torch.distributed: call init_process_group first")
        self.cache = cache
        self.core = core
        pg = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        self.rank = ranks.index(dist.get_rank())
        self.world_size = len(ranks)
        store = _group_store(pg)
        self.collective = Collective(store, self.rank, self.world_size, timeout=timeout.total_seconds())
        self._channel = self.collective.channel()  # the calling (training) thread's
        cfg = cache.config
        self.node_local = frozenset(n for n, t in core.repo.durable.items() if t.node_local)
        #: Whether the ranks save through node agents (every rank alike: it is agreed below).
        self.agents = cfg.agent is not None
        name, domain = this_node(cfg)
        settings = {"chunk_bytes": cfg.chunk_bytes, "pack_below": cfg.pack_below, "hash": cfg.hash,
                    "[peers] copies": cfg.peers.copies, "durable tiers": sorted(core.repo.durable),
                    "node-local tiers": sorted(self.node_local), "[agent]": cfg.agent is not None}
        mine = Status("ok", {"node": [name, domain], "settings": settings})
        try:
            # Each rank learns its tiers' versions and refs now, while the group is being made,
            # not in its first save(): a save reads no tier (an S3 that hangs after this point
            # never holds save() or the `local` level; one down now, or that stops answering its
            # probe while it is read, is left out, as at open: see Catalog.load).
            core.catalog.load()
        except TierCacheError as e:  # the group learns it in this exchange, naming this rank
            mine = Status.of(e)
        verdict = self._channel.exchange("view", mine, what="opening the group view", decide=self._agree)
        if not verdict.ok:
            self.collective.close()
            raise verdict.status.error_object()
        labels = verdict.status.payload
        self.topology = Topology.of([tuple(label) for label in labels])  # type: ignore[misc]
        self.node = self.topology.node_of[self.rank]
        if self.topology.count > 1:
            names, node_of = self.topology.names, self.topology.node_of
            self.collective.name = lambda r: f"rank {r} (node {names[node_of[r]]})"
        peers, self._no_peers = self._choose_peers()
        self.peers = peers
        self.nodes = tuple(
            NodePart(name=n, domain=self.topology.domains[i], ranks=self.topology.ranks(i),
                     copies=tuple(self.topology.names[p] for p in peers[i]))
            for i, n in enumerate(self.topology.names)
        )
        self.hashing = SharedHashing(self.rank, self.world_size)
        self.hash_channel = self.collective.channel()  # the engine's hasher thread's
        self._timeout = timeout
        # Bulk transfers (peer copies, restores over the group) go point to point over gloo, on
        # private groups (never the trainer's): made now, while every rank is here.
        self._transfers = self._gloo(ranks)
        replicator = None
        if self._no_peers is None:
            agent_host = None if cfg.agent is None else cfg.agent.peer_host or advertised_host(store)
            replicator = Replicator(self, self._gloo(ranks), peers, min(self.node_local),
                                    timeout=timeout.total_seconds(), agent_host=agent_host)
        self.phases = Phases(self, replicator)
        for tier in core.repo.durable.values():  # a node sends the requests one process would
            if tier.pacer is not None:
                tier.pacer.share(len(self.topology.ranks(self.node)))
        self._rounds: dict[str, Round] = {}
        self._slot = 0
        #: Saves other ranks made in a call that failed for being out of step, which this rank
        #: makes later: each fails at once (see :meth:`_out_of_step`).
        self._behind: dict[tuple[str, int], Status] = {}
        self._slots: dict[str, int] = {}
        self._closed = False

    def _gloo(self, ranks: list[int]) -> dist.ProcessGroup:
        return dist.new_group(ranks, timeout=self._timeout, backend="gloo", use_local_synchronization=True)

    def _agree(self, statuses: list[Status]) -> Decision:
        """The coordinator's check of the ranks' settings at ``view``: every rank's node, or which differ."""
        first = statuses[0].payload["settings"]
        for key, want in first.items():
            differ = [r for r, s in enumerate(statuses) if s.payload["settings"].get(key) != want]
            if differ:
                theirs = statuses[differ[0]].payload["settings"].get(key)
                raise ConfigError(f"the ranks' configs differ: {key} is {want!r} on rank 0 but {theirs!r} on rank(s) "
                                  f"{', '.join(map(str, differ))}: open every rank's cache with the same config")
        labels = [s.payload["node"] for s in statuses]
        Topology.of([tuple(label) for label in labels])  # type: ignore[misc]  # raises for inconsistent domains
        return Decision(labels)

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

    def chunk_bytes(self, largest: int) -> int:
        """The chunk size of a version whose largest tensor (on any rank) has ``largest`` bytes.

        Big tensors are cut into ``min(chunk_bytes, max(pack_below, largest / world_size))``
        (page rounded), so a replicated tensor splits into one chunk per rank and chunk ids
        match across ranks for identical tensors.
        """
        cfg = self.cache.config
        share = round_up(math.ceil(largest / self.world_size), PAGE)
        return min(cfg.chunk_bytes, max(round_up(cfg.pack_below, PAGE), share))

    # ------------------------------------------------------------------ save

    def save(
        self, state: Any, *, step: int, branch: str = "main", meta: Mapping[str, Any] | None = None,
        replicated: Collection[str] = (), optimizer: Any = None,
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
                writes only its share of their chunks. Every rank hashes all of them and the
                ranks compare the ids (:mod:`tiercache.group.hashing`): a declared tensor that
                differs between ranks fails the version on every rank, naming it and the ranks.
            optimizer: Not supported with a group (refused on every rank).

        Returns:
            A handle whose levels resolve (or fail with the same error) on every rank together.

        Raises:
            InvalidArgumentError: If some rank's call is invalid (a bad step, branch or meta), or
                the ranks save different steps or branches (out of step: one skipped a save or
                made one more); on every rank, naming the rank. A rank behind then fails its own
                call of a step another rank saved in that call at once, with the same error.
            UnsupportedStateError: If a leaf of some rank's state cannot be stored (on every rank).
            CacheClosedError: If some rank's cache is closed (on every rank).
            GroupSaveError: If a rank does not answer in time.
            GroupBrokenError: If the group broke earlier (a rank died): at once.
        """
        return self.save_as(state, step=step, branch=branch, meta=meta, replicated=replicated, optimizer=optimizer)

    def save_as(
        self, state: Any, *, step: int, branch: str = "main", meta: Mapping[str, Any] | None = None,
        replicated: Collection[str] = (), optimizer: Any = None, version: tuple[str, datetime] | None = None,
        failed: BaseException | None = None,
    ) -> SaveHandle:
        """:meth:`save`, for a version that has an id already (adopted on restart: :mod:`tiercache.group.orphans`).

        Args:
            state: As :meth:`save`.
            step: As :meth:`save`.
            branch: As :meth:`save`.
            meta: As :meth:`save`.
            replicated: As :meth:`save`.
            optimizer: As :meth:`save`.
            version: The version's id and creation time (rank 0's count; ``None``: a new version).
            failed: This rank could not get its state: the group fails the save, naming it.
        """
        broken = self.collective.broken
        if broken is not None:
            raise broken
        consumed = self._behind.pop((branch, step), None) if isinstance(step, int) and isinstance(branch, str) else None
        if consumed is not None:  # the call another rank made already, which the group failed
            raise consumed.error_object()
        slot = self._slot
        self._slot += 1
        what = f"the group's save of step {step}"
        cache = self.cache
        flat: Flat | None = None
        try:
            failpoint("group.save", f"save/{slot}")
            if failed is not None:
                raise failed
            if optimizer is not None:
                raise InvalidArgumentError("save(group=..., optimizer=...): a multi-rank save copies its state "
                                           "before returning; leave optimizer out")
            cache.check_open()
            check_name(branch, "branch")
            if isinstance(step, bool) or not isinstance(step, int):
                raise InvalidArgumentError(f"step must be an int, got {step!r}")
            meta = check_meta(meta)
            flat = flatten(state, allow_pickle=cache.config.allow_pickle, shards=True)
            sig = signature(flat, list(replicated)) if replicated else None
        except Exception as e:  # this rank's call is bad: the group learns it in this exchange
            self._channel.exchange(f"save/{slot}", Status.of(e), what=what, decide=self._begin).raise_failure()
            raise  # (the verdict always fails: this rank's error is in it)
        assert flat is not None
        payload: dict[str, Any] = {"step": step, "branch": branch, "sig": sig,
                                   "largest": max((m.nbytes for m in flat.metas), default=0)}
        with contextlib.ExitStack() as stack:
            try:
                nxt = stack.enter_context(self.core.next_version(branch))  # the save lock: close() waits for this
            except TierCacheError as e:  # closed meanwhile
                self._channel.exchange(f"save/{slot}", Status.of(e), what=what, decide=self._begin).raise_failure()
                raise
            if self.rank == 0:
                vid, created = version if version is not None else (new_version_id(), utcnow())
                payload["proposal"] = [vid, nxt.parent, nxt.seq, created.isoformat(), meta]
            about = {"step": step, "branch": branch}
            verdict = self._channel.exchange(f"save/{slot}", Status("ok", payload), what=what, decide=self._begin,
                                             about=about)
            while self._came_late(verdict.status, about):
                # The others' call of an earlier step failed waiting for this rank, which skipped
                # it (held up meanwhile by the trainer's own collectives): this call is their next.
                slot = self._slot
                self._slot += 1
                verdict = self._channel.exchange(f"save/{slot}", Status("ok", payload), what=what,
                                                 decide=self._begin, about=about)
            if not verdict.ok:
                self._out_of_step(verdict.status, step, branch)
            verdict.raise_failure()
            self._behind.clear()  # the ranks are in step
            rnd = self._stage(verdict.status.payload, flat, step, branch, tuple(replicated))
            staged = rnd.local.future("staged") if rnd.local is not None else None
            # Skipped here (the group then fails it everywhere): the branch does not move to it. On
            # the ranks that commit it (rank 0, the nodes' leaders) this is the move their commits
            # make; on the others, the group's head in their view.
            if staged is not None and not (staged.done() and staged.exception() is not None):
                nxt.seq = rnd.ref.seq  # the group's (this rank's view may lag behind rank 0's)
                nxt.version = rnd.vid
        self._submit(rnd)
        if rnd.stage_error is not None and not isinstance(rnd.stage_error, SkippedError):
            raise rnd.stage_error  # this rank's copy failed: its caller learns it now, the others in `parts`
        return rnd.handle()

    def _begin(self, statuses: list[Status]) -> Decision:
        """The coordinator's decision at ``save/<n>``: the same version on every rank, or why not.

        Ranks that save different steps or branches in one call are out of step (one skipped a
        save, or made one more): the call fails on every rank, naming the ranks that differ from
        the most (on a tie: from rank 0's), and the verdict lists what each rank saved (see
        :meth:`_out_of_step`).
        """
        tags: dict[tuple[int, str], list[int]] = {}
        for r, s in enumerate(statuses):
            tags.setdefault((s.payload["step"], s.payload["branch"]), []).append(r)
        if len(tags) > 1:
            sides = "; ".join(f"rank(s) {', '.join(map(str, ranks))} step {step} on {branch!r}"
                              for (step, branch), ranks in tags.items())
            most = max(tags.values(), key=lambda ranks: (len(ranks), 0 in ranks))
            err = InvalidArgumentError(
                f"the ranks save different versions ({sides}): every rank must save the same step on the same "
                "branch (a rank skipped a save or made one more); a rank's own later call of a step another rank "
                "saved in this call fails at once with this error, and the group saves again from the first "
                "step every rank saves")
            raise Blame([r for r in range(len(statuses)) if r not in most], err,
                        saves=[[s.payload["branch"], s.payload["step"]] for s in statuses])
        vid, parent, seq, created, meta = statuses[0].payload["proposal"]
        sigs = [s.payload["sig"] for s in statuses]
        return Decision({"vid": vid, "parent": parent, "seq": seq, "created": created, "meta": meta,
                         "chunk": self.chunk_bytes(max(s.payload["largest"] for s in statuses)),
                         "split": sigs[0] is not None and all(x == sigs[0] for x in sigs)})

    def _came_late(self, verdict: Status, about: dict[str, Any]) -> bool:
        """Whether ``verdict`` failed a call of an earlier step of this branch for want of this rank's answer.

        Then this rank skipped that save, and the others failed it after the group's timeout
        (naming this rank) before this rank's call of a later step came: their next call is the
        one this rank's call meets.
        """
        theirs = verdict.extra.get("about")
        return (not verdict.ok and self.rank in verdict.extra.get("missing", ()) and isinstance(theirs, dict)
                and theirs.get("branch") == about["branch"] and isinstance(theirs.get("step"), int)
                and theirs["step"] < about["step"])

    def _out_of_step(self, verdict: Status, step: int, branch: str) -> None:
        """Note the calls a failed ``save/<n>`` consumed on other ranks, which this rank has yet to make.

        A rank that skipped a save meets the others' call with its next one: both calls fail.
        The others' own next call is of the step the skipping rank saved already; left to the
        exchange, it would meet that rank's following call, and the ranks would stay out of step
        for good. So a rank behind fails that call at once, with the same error, and no exchange:
        the ranks are in step again from the first step every rank saves (a successful
        ``save/<n>`` forgets what is left).
        """
        for other_branch, other_step in verdict.extra.get("saves", ()):
            if other_branch == branch and other_step > step:
                self._behind[(other_branch, other_step)] = verdict

    def _stage(self, agreed: dict[str, Any], flat: Flat, step: int, branch: str, declared: tuple[str, ...]) -> Round:
        """Copy this rank's part into the arena as the version the group agreed on."""
        engine = self.core.saver
        vid, chunk = agreed["vid"], agreed["chunk"]
        trade = bool(agreed["split"]) and bool(
            declared_chunks(engine.layout_of(flat, chunk), [m.path for m in flat.metas], declared))
        rnd = Round(self, vid, RefRecord(kind="branch", name=branch, version=vid, seq=agreed["seq"]), step=step,
                    parent=agreed["parent"], created_at=datetime.fromisoformat(agreed["created"]),
                    meta=agreed["meta"], trade=trade, declared=declared if agreed["split"] else ())
        if not agreed["split"] and declared:
            log.info("version %s: the ranks' states or replicated= differ; every rank hashes all of its part", vid)
        try:
            failpoint("group.stage", f"{vid}/stage")
            # The engine hands the round its part's manifest future (Round.follow) as it takes
            # the version: asked for afterwards, a version whose pipeline ended at once (its only
            # tier full) would be gone, and the group would not learn why.
            rnd.local = engine.stage(None, flat=flat, step=step, branch=branch, meta=agreed["meta"],
                                     parent=agreed["parent"], seq=agreed["seq"], version_id=vid, chunk_bytes=chunk,
                                     committer=rnd)
            failpoint("group.staged", f"{vid}/staged")
        except BaseException as e:
            rnd.stage_error = e
        return rnd

    def _submit(self, rnd: Round) -> None:
        if len(self._rounds) >= _KEEP_ROUNDS:
            self._rounds.pop(next(iter(self._rounds)))
        self._rounds[rnd.vid] = rnd
        rnd.futures["durable"].add_done_callback(lambda f: self._settled(rnd, f))
        if self._no_peers is not None:
            rnd.futures[REPLICATED].set_exception(self._no_peers)
        self.phases.submit(rnd)

    def _settled(self, rnd: Round, durable: Any) -> None:
        """A version the group made durable stays in node RAM when a node agent runs.

        The agent staged this rank's part and keeps it there for a restarted trainer (or, if
        this process saved it itself after losing the agent, copies it there from the tiers
        below). (One the group failed was taken off its branch before its level failed.)
        """
        if durable.exception() is None and self.cache.agent is not None and rnd.published is not None:
            part = rnd.published.result()
            self.core.keep_in_ram(sorted({(c.id, c.nbytes) for c in part.chunks}), part.hash_algo)

    # ------------------------------------------------------------------ what the phases ask

    def durable_parent(self, rnd: Round) -> str | None:
        """The parent the group manifest of ``rnd`` names: the nearest ancestor the group made durable.

        Every rank computes the same: the outcomes of the versions before are the same everywhere.
        """
        parent = rnd.parent
        while parent is not None:
            prev = self._rounds.get(parent)
            if prev is None or prev.futures["durable"].exception() is None:  # waits: it is older
                return parent
            parent = prev.parent
        return None

    def adopt(self, rnd: Round, tier: str) -> None:
        """Know the group's version as committed on ``tier`` (this rank's part is there)."""
        from tiercache.parts import group_header

        core = self.core
        header = group_header(id=rnd.vid, parent=self.durable_parent(rnd), branch=rnd.ref.name, step=rnd.step,
                              created_at=rnd.created_at, meta=rnd.meta, hash_algo=core.config.hash,
                              ranks=self.world_size, nbytes=rnd.plan.nbytes, nodes=rnd.nodes)
        assert rnd.published is not None
        own = rnd.published.result()
        core.repo.adopt_group(header, tier, own, self.rank)

    # ------------------------------------------------------------------ restore

    def restore(
        self, ref: str = "main", *, into: Any = None, map_location: str | torch.device = "cpu",
        progress: Progress | None = None, strict: bool = True, resume: bool = True,
    ) -> Any:
        """Return this rank's part of the version ``ref`` resolves to; call it on every rank.

        See :func:`tiercache.group.restore.restore`.
        """
        from tiercache.group.restore import restore

        broken = self.collective.broken
        if broken is not None:
            raise broken
        return restore(self, self.slot("restore"), ref, into=into, map_location=map_location, progress=progress,
                       strict=strict, resume=resume)

    def slot(self, kind: str) -> int:
        """The number of this call of a collective of ``kind`` (``restore``, ``dcp-load``...): its tags' prefix."""
        n = self._slots.get(kind, 0)
        self._slots[kind] = n + 1
        return n

    # ------------------------------------------------------------------ DCP (tiercache.integrations.dcp)

    def propose(self, branch: str, step: int, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Rank 0's proposal of a version no ``save()`` stages (a DCP checkpoint): its id, parent and ref seq.

        The branch moves to it in this process's view only once this rank opens its round, as
        on the other ranks: DCP may abort the checkpoint before (this rank's own planner fails),
        and then nothing would take the move back (the next version would name this one, which
        no tier holds, as its parent).
        """
        with self.core.next_version(branch) as nxt:
            return {"vid": new_version_id(), "parent": nxt.parent, "seq": nxt.seq, "created": utcnow().isoformat(),
                    "meta": check_meta(meta), "step": step, "branch": branch}

    def open_round(self, agreed: Mapping[str, Any]) -> Round:
        """A round for a version whose parts the caller writes itself (a DCP checkpoint); every rank calls it.

        The caller resolves ``round.published`` with this rank's part and each ``round.ready``
        future once its chunks and part are durable on that tier (or fails them); the group's
        phases commit the version as any other.
        """
        vid = agreed["vid"]
        rnd = Round(self, vid, RefRecord(kind="branch", name=agreed["branch"], version=vid, seq=agreed["seq"]),
                    step=agreed["step"], parent=agreed["parent"], created_at=datetime.fromisoformat(agreed["created"]),
                    meta=dict(agreed["meta"]), trade=False, declared=())
        rnd.published = Future()
        with self.core.next_version(rnd.ref.name) as nxt:  # back again if the group fails the version
            nxt.seq = rnd.ref.seq
            nxt.version = vid
        self._submit(rnd)
        return rnd

    def round(self, vid: str) -> Round | None:
        """The round of a recent version saved through this view (``None`` if none)."""
        return self._rounds.get(vid)

    @property
    def channel(self) -> Any:
        """The training thread's channel (restore uses it)."""
        return self._channel

    @property
    def transfers(self) -> dist.ProcessGroup:
        """The private gloo group the training thread moves chunks over (restore)."""
        return self._transfers

    def close(self) -> None:
        """Stop the workers once every submitted version is settled (the cache calls this)."""
        if self._closed:
            return
        self._closed = True
        self.phases.close()
        self.collective.close()


__all__ = ["DEFAULT_TIMEOUT", "REPLICATED", "GroupView"]
