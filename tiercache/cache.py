"""TierCache: the facade trainers and the CLI call.

It wires the layers together and implements the user-facing verbs (save, restore, versions, refs,
branch, rollback, tag, promote, evict, verify, gc, doctor) with no storage logic of its own:

    TierCache (this facade)  ->  Engine (tiercache.pipeline)
                             ->  Repo (tiercache.repo: catalog, commits, deletion, leases, gc)
                             ->  tiers (tiercache.tiers: ram, disk, s3)

The engine (and with it torch) is made on first use: a cache opened to list, inspect or collect
versions (``tiercache ls``, ``log``, ``gc``...) imports no torch and starts no thread of it.

The facade is the public API and nothing else: what the layers above the storage need of an open
cache (the repo and catalog, the reader, the save lock and where a branch's next version starts,
the assembly of a restore) is its :class:`~tiercache.core.CacheCore`, which it owns and delegates
to (docs/design.md section 1, "The facade and the core"). Code outside this module gets a cache's
core from :func:`core_of`.

Multi-rank saves and restores (``save(..., group=g)``) are the group view's
(:mod:`tiercache.group`), which sits above this facade and is handed its core. This module never
imports it: :func:`tiercache.open` hands each cache a :data:`GroupViews` factory.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from tiercache import repo as repo_ops
from tiercache.agent.node import NodeAgent
from tiercache.config import DURABLE_TIERS, CacheConfig, parse_duration
from tiercache.core import CacheCore
from tiercache.errors import (
    BranchNotFoundError,
    ConfigError,
    InvalidArgumentError,
    RefExistsError,
    StorageError,
    TierCacheError,
    TierFullError,
    TierUnavailableError,
    VersionNotFoundError,
)
from tiercache.handle import TIER_LEVEL, SaveHandle
from tiercache.manifest import (
    MoveReason,
    RefMove,
    RefRecord,
    TierState,
    Version,
    VersionInfo,
    check_meta,
)
from tiercache.names import check_name
from tiercache.policy.builtin import load_policy
from tiercache.policy.meter import ThroughputMeter
from tiercache.repo import Repo, TierHealth
from tiercache.runtime import CacheStats, ErrorStats, TierRoom, TierStats
from tiercache.status import RECENT_SAMPLES, STATUS_KEY, StatusRecorder, read_status
from tiercache.tiers.base import Tier

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from tiercache.advisor import Advisor, PlanInputs
    from tiercache.agent.client import AgentLink
    from tiercache.pipeline.deferred import StepGuards
    from tiercache.pipeline.engine import Engine
    from tiercache.pipeline.front import LossLedger
    from tiercache.restore import Progress, RestoreReport
    from tiercache.saver import Saver
    from tiercache.tiers.ram import Arena

log = logging.getLogger("tiercache.cache")

#: Where a cache leaves its observed throughput for the next process (first durable tier).
METER_KEY = "stats/meter.json"

ConfigLike = CacheConfig | Mapping[str, Any] | str | os.PathLike[str] | None


class MultiRank(Protocol):
    """What the facade asks of a group view (:class:`tiercache.group.GroupView`)."""

    def save(self, state: Any, *, step: int, branch: str, meta: Mapping[str, Any] | None,
             replicated: Collection[str], optimizer: Any) -> SaveHandle:
        """Save this rank's part of a version of the group."""
        ...

    def restore(self, ref: str, *, into: Any, map_location: Any, progress: Progress | None, strict: bool,
                resume: bool) -> Any:
        """Restore this rank's part of a version of the group."""
        ...

    def close(self) -> None:
        """Stop once every version submitted is settled."""
        ...


#: Makes the group view of a cache (given with its core) for a process group (``None``: the world), with a timeout.
GroupViews = Callable[["TierCache", CacheCore, "ProcessGroup | None", "timedelta | None"], MultiRank]


def _probe_at_open(tiers: dict[str, Tier], health: TierHealth, *, has_ram: bool) -> None:
    """Check each durable tier once; one that is down (unreachable, hanging, full) is left out.

    The cache then opens in degraded mode: it serves what the other tiers hold, saves go to
    them, and the tier is probed until it answers again. Configuration errors (a missing
    bucket, refused credentials) still raise, as does an outage of the only tier.

    Raises:
        TierUnavailableError: If every durable tier is down and there is no RAM tier.
        BucketNotFoundError, AccessDeniedError, StorageError: If a tier is misconfigured.
    """
    durable = {n: t for n, t in tiers.items() if t.durable}
    down: dict[str, StorageError] = {}
    for name, tier in durable.items():
        try:
            tier.probe()
        except (TierUnavailableError, TierFullError) as e:
            down[name] = e
    if down and len(down) == len(durable) and not has_ram:
        raise next(iter(down.values()))
    for name, err in down.items():
        health.mark_down(name, err, note="opening without it: serving what the other tiers hold")


def _make_tiers(cfg: CacheConfig) -> dict[str, Tier]:
    tiers: dict[str, Tier] = {}
    if cfg.disk is not None:
        from tiercache.tiers.disk import DiskTier

        tiers["disk"] = DiskTier(cfg.disk)
    if cfg.s3 is not None:
        try:
            from tiercache.tiers.s3 import S3Tier
        except ImportError as e:
            raise ConfigError(f"the s3 tier needs boto3 ({e}): pip install boto3 (the s3 extra)") from None
        tiers["s3"] = S3Tier(cfg.s3)
    if not tiers and cfg.ram is None:
        raise ConfigError("no tier configured: add a [disk] path, an [s3] url, or a [ram] table")
    return tiers


class TierCache:
    """A tiered checkpoint cache (RAM arena -> disk -> S3) with versions, branches and tags.

    Create it with :func:`tiercache.open`. All methods are thread-safe; ``save`` is meant to be
    called from the training loop and returns as soon as the state is copied into RAM.

    With an ``[agent]`` table, the RAM tier and the background work live in the node agent
    (:mod:`tiercache.agent`): the cache attaches to a running one when it opens (so node RAM's
    versions are seen at once), and the first save starts one if none runs (``start = "auto"``).

    Args:
        config: The configuration.
        make_arena: Makes the engine's RAM arena (the node agent passes its shared memory).
    """

    def __init__(self, config: CacheConfig, *, group_views: GroupViews | None = None,
                 make_arena: Callable[[int], Arena] | None = None) -> None:
        self.config = config
        self._group_views = group_views
        self._make_arena = make_arena
        policy = load_policy(config.policy)  # a bad policy fails before any tier is opened
        tiers = _make_tiers(config)
        health = TierHealth(tiers, interval=config.engine.probe_interval_s)
        try:
            _probe_at_open(tiers, health, has_ram=config.ram is not None)
        except BaseException:
            for t in tiers.values():
                t.close()
            raise
        self._core = CacheCore(config, Repo(config, tiers, health), ThroughputMeter(), policy,
                               saver=lambda: self.engine, made_saver=lambda: self._engine,
                               on_restored=self._restored)
        self._seed_meter()
        self._engine: Saver | None = None
        #: What this cache asks the node agent (``[agent]``); it answers for "no agent" too.
        self._node = NodeAgent(config, self._core.repo)
        self._step_guards: StepGuards | None = None
        self._lazy_lock = threading.Lock()
        self._groups: dict[ProcessGroup, MultiRank] = {}
        # Made by the first save (or advisor): a cache that only reads publishes nothing.
        self._recorder: StatusRecorder | None = None
        self._recorder_lock = threading.Lock()
        #: Restores timed before this process saved (it publishes them once it does): (seconds, at).
        self._restored_times: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)
        # A trainer that exits without close() (or raises right after save()) must not lose the
        # versions it was told are staged: flush them at interpreter exit (a weak reference keeps
        # the cache collectable).
        ref = weakref.ref(self)
        self._atexit = lambda: _flush_at_exit(ref)
        _at_exit(self._atexit)

    # ------------------------------------------------------------------ properties

    @property
    def tier_names(self) -> list[str]:
        """Configured tiers, fastest first (``ram`` when a RAM tier or the node agent is configured)."""
        names = ["ram"] if self.config.ram is not None or self.config.agent is not None else []
        return names + [n for n in DURABLE_TIERS if n in self._core.repo.durable]

    @property
    def agent(self) -> AgentLink | None:
        """The connection to the node agent (``[agent]``), or ``None`` (none configured, running or reachable).

        Multi-rank code asks it what node RAM holds: ``cache.agent.holds(versions, chunks)``.
        """
        return self._node.link

    @property
    def last_restore(self) -> RestoreReport | None:
        """What the last restore of this process read, from where (bytes per source), or ``None``."""
        return self._core.last_restore

    @property
    def engine(self) -> Saver:
        """The save engine (see :mod:`tiercache.saver`), made on first use (torch imported then).

        The :class:`~tiercache.pipeline.front.SaveFront`, with one back end: the in-process
        :class:`~tiercache.pipeline.engine.Engine` and its RAM arena, or with an ``[agent]``
        table the :class:`~tiercache.agent.saver.AgentBackend` that hands saves to the node agent
        (starting one if none runs and ``start = "auto"``).
        """
        with self._lazy_lock:
            if self._engine is None:
                from tiercache.pipeline.deferred import StepGuards

                self.check_open()
                self._engine = self._save_front()
                self._step_guards = StepGuards(self._engine.wait_deferred)
            return self._engine

    def _local_engine(self, losses: LossLedger) -> Engine:
        from tiercache.pipeline.engine import Engine

        core = self._core
        return Engine(self.config, core.repo, policy=core.policy, meter=core.meter, read_object=core.read_object,
                      losses=losses, make_arena=self._make_arena)

    def _save_front(self) -> Saver:
        """The save front, with the node agent's back end if one is configured and answers, else in process."""
        from tiercache.pipeline.front import SaveFront

        link = self._node.link_for_saves()
        if link is None:
            return SaveFront(self.config, make_local=self._local_engine)
        from tiercache.agent.saver import AgentBackend

        agent = link
        return SaveFront(self.config, make_local=self._local_engine,
                         make_remote=lambda front: AgentBackend(self.config, agent, front))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._core.closed

    def pending(self) -> list[str]:
        """Ids of the versions this process is still writing."""
        return self._engine.pending_jobs() if self._engine is not None else []

    def check_open(self) -> None:
        """Raise :class:`CacheClosedError` if the cache is closed."""
        self._core.check_open()


    # ------------------------------------------------------------------ save

    def save(
        self,
        state: Any,
        *,
        step: int,
        branch: str = "main",
        meta: Mapping[str, Any] | None = None,
        group: ProcessGroup | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        replicated: Collection[str] = (),
    ) -> SaveHandle:
        """Snapshot ``state`` into RAM and write it to the durable tiers in the background.

        Training may change the tensors as soon as this returns: the version holds their values
        at the call. With ``optimizer``, the tensors that ``optimizer.step()`` updates are copied
        after this returns, while the next forward and backward run, and ``optimizer.step()``
        waits until they are (see :mod:`tiercache.pipeline.deferred`).

        Args:
            state: A state dict (nested dicts/lists/tuples of tensors and plain values).
            step: The training step (used by ``NAME@STEP`` refs).
            branch: Branch to save on; its head becomes the new version's parent.
            meta: JSON-able metadata (loss, metrics...).
            group: A torch.distributed process group (``dist.group.WORLD`` for all ranks): every
                rank of it calls ``save`` with its own part and the group commits one version;
                see :mod:`tiercache.group.view`. ``None`` saves this process's state alone.
            optimizer: The optimizer whose ``step()`` is the only thing that changes its
                parameters and state until its next call: their copy is deferred to overlap the
                next forward and backward. Anything else that changes them in between (in-place
                edits, EMA swaps, loading weights) must call ``handle.wait("staged")`` first.
            replicated: With ``group``, key paths of ``state`` that are the same on every rank
                (a DDP model and its optimizer state): each rank hashes and writes only its share
                of them; see :meth:`tiercache.group.GroupView.save`.

        Returns:
            A :class:`SaveHandle` with the version id and one future per durability level.

        Raises:
            UnsupportedStateError: If a leaf cannot be stored (the message names its key).
            TierCacheError: Only with ``engine.on_error = "raise"``: the error of an earlier
                version that reached no durable tier, raised after this one is staged (its
                handle is the exception's ``handle``). By default an earlier failure never
                costs this save: ``flush()`` and ``close()`` report it.
        """
        started, t0 = time.time(), time.perf_counter()
        if group is not None:
            # Every check of this call happens in the group's first exchange, so a bad input on one
            # rank fails the save on every rank instead of leaving the others waiting.
            handle = self.distributed(group).save(state, step=step, branch=branch, meta=meta, replicated=replicated,
                                                  optimizer=optimizer)
        else:
            if replicated:
                raise InvalidArgumentError("save(replicated=...) declares what the ranks of a group hold alike: "
                                           "pass group= too")
            handle = self._save_here(state, step=step, branch=branch, meta=meta, optimizer=optimizer)
        self._status_recorder().note_save(handle, step=step, branch=branch, started_at=started,
                                          wait_s=time.perf_counter() - t0)
        return handle

    def _save_here(
        self, state: Any, *, step: int, branch: str, meta: Mapping[str, Any] | None,
        optimizer: torch.optim.Optimizer | None,
    ) -> SaveHandle:
        self.check_open()
        check_name(branch, "branch")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidArgumentError(f"step must be an int, got {step!r}")
        meta = check_meta(meta)
        engine = self.engine
        owned = None
        if optimizer is not None:
            from tiercache.pipeline.deferred import owned_by

            owned = owned_by(optimizer)
            assert self._step_guards is not None
            self._step_guards.add(optimizer)
        with self._core.next_version(branch) as nxt:
            handle = engine.stage(state, step=step, branch=branch, meta=meta, parent=nxt.parent, seq=nxt.seq,
                                  defer=owned, base=nxt.base, why=nxt.why)
            staged = handle.future("staged")
            # Only a skipped version is already failed here; a deferred copy is still running.
            if not (staged.done() and staged.exception() is not None):
                nxt.version = handle.version
        return handle

    def distributed(self, group: ProcessGroup | None = None, *, timeout: timedelta | None = None) -> MultiRank:
        """The multi-rank view of this cache for ``group`` (the world by default), made once per group.

        Call it on every rank of the group. ``save(..., group=g)`` and ``restore(..., group=g)``
        go through it.

        Args:
            group: The process group.
            timeout: How long a rank waits for the others at each phase (only when the view is
                first made; default :data:`tiercache.group.DEFAULT_TIMEOUT`).

        Raises:
            ConfigError: If this cache was not opened with :func:`tiercache.open`, or the ranks'
                configs differ in a setting that must be the same.
        """
        import torch.distributed as dist

        self.check_open()
        if self._group_views is None:
            raise ConfigError("multi-rank saves need a cache opened with tiercache.open()")
        key = group if group is not None else dist.group.WORLD
        view = self._groups.get(key)
        if view is None:
            view = self._groups[key] = self._group_views(self, self._core, group, timeout)
        return view

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        ref: str = "main",
        *,
        into: Any = None,
        map_location: str | torch.device = "cpu",
        progress: Progress | None = None,
        group: ProcessGroup | None = None,
        strict: bool = True,
        resume: bool = True,
    ) -> Any:
        """Return the state saved as ``ref``, bit-exact.

        Restoring a version other than its branch's head makes this process resume from it:
        the next ``save()`` on that branch names it as parent and moves the branch there, as
        ``rollback`` then ``save`` would (the versions left behind stay in the reflog, see
        ``tiercache log --reflog``).

        Args:
            ref: A branch, a tag, a version id or unique prefix, ``NAME~N`` or ``NAME@STEP``.
            into: A state (or part of one) whose tensors receive the saved bytes in place,
                matched by key path; tensors it lacks are allocated.
            map_location: Device for the tensors that are allocated.
            progress: Called with the number of bytes of each chunk read.
            group: A process group: every rank calls ``restore`` and gets its own part of a
                multi-rank version (see :mod:`tiercache.group.restore`).
            strict: With ``into``, refuse (before reading anything) tensors of ``into`` that
                match no tensor of the version, or whose dtype or shape differ. With
                ``strict=False`` the matching ones are filled and the call returns
                ``(state, unmatched)``, ``unmatched`` listing each tensor of ``into`` that was
                not filled and why.
            resume: Whether this process continues from the restored version (the default);
                ``False`` only reads it (evaluation, inspection) and leaves the next save alone.

        Returns:
            The state; with ``into`` and ``strict=False``, ``(state, unmatched)``.

        Raises:
            VersionNotFoundError: If the ref resolves to nothing.
            IntegrityError: If a chunk has no good copy on any tier (tensors in ``into`` may then
                hold part of it; run ``tiercache verify`` to see which versions are whole).
            StateMismatchError: With ``strict``, if a tensor of ``into`` matches nothing in the
                version or has another dtype or shape (the message names the first few keys on
                each side; nothing is read).
        """
        if group is not None:
            return self.distributed(group).restore(ref, into=into, map_location=map_location, progress=progress,
                                                   strict=strict, resume=resume)
        self.check_open()
        version = self._core.catalog.get(self.resolve(ref))
        out = self._core.restore_version(version, into=into, map_location=map_location, progress=progress,
                                         strict=strict)
        if resume:
            self._core.note_restored(ref, version)
        return out

    def _restored(self, report: RestoreReport, began: float) -> None:
        """Tell who publishes this process's status that a restore read ``report`` (its reads began at ``began``)."""
        if not self._node.notify_restored(report, began):
            self._note_restore(report.seconds)

    def manifest(self, ref: str) -> Version:
        """Return the manifest of the version ``ref`` resolves to.

        A version saved by several ranks comes with its ranks' parts merged (rank ``r``'s tensors
        under ``r/``), or, where some rank's part is on no tier this process can read (the
        node-local disk of another node), as its group manifest alone
        (:attr:`~tiercache.manifest.Version.is_header`).
        """
        cat = self._core.catalog
        return cat.materialize(cat.peek(self.resolve(ref)))

    # ------------------------------------------------------------------ versions and refs

    def _wait_published(self) -> None:
        """Let the versions this process staged reach the catalog (their manifests are quick to make)."""
        if self._engine is not None:
            self._engine.wait_published()

    def resolve(self, ref: str) -> str:
        """Resolve a ref string (``main``, ``best``, ``01J..``, ``main~2``, ``main@1000``) to a version id."""
        self.check_open()
        self._wait_published()
        return self._core.catalog.resolve(ref)

    def versions(self, branch: str | None = None) -> list[VersionInfo]:
        """Every known version (durable, or staged by this process), oldest first."""
        self.check_open()
        self._wait_published()
        if branch is not None:
            check_name(branch, "branch")
        out = []
        for v in self._core.catalog.summaries():  # the index: no manifest is read to list versions
            if branch is not None and v.branch != branch:
                continue
            pending = (self._engine.pending_tiers(v.id) if self._engine is not None
                       else self._node.pending_tiers(v.id))
            out.append(VersionInfo(v.id, v.step, v.branch, v.parent, v.created_at, v.nbytes, dict(v.meta),
                                   self._core.catalog.residency(v),
                                   self._core.repo.states(v, self.tier_names, pending)))
        return self._node.node_ram(out, saves_here=self._engine is not None)

    def pruned(self) -> list[VersionInfo]:
        """Versions a rule the user set (a retention) deleted from their last durable tier, oldest first.

        They hold no tier; each tier's state is ``pruned``, its reason ``pruned by <rule> at
        <time>``. ``versions()`` leaves them out; ``restore`` of one raises
        :class:`~tiercache.errors.VersionNotFoundError` with that reason.
        """
        self.check_open()
        out = []
        for rec in self._core.catalog.pruned():
            states = {t: TierState("pruned", rec.why(), rec.at) for t in self.tier_names if t != "ram"}
            out.append(VersionInfo(rec.version, rec.step, rec.branch, rec.parent, rec.created_at, rec.nbytes, {},
                                   (), states))
        return out

    def reflog(self, branch: str | None = None) -> list[RefMove]:
        """Every move of the branches (or of ``branch``) and tags, oldest first.

        Saves that continue a branch are reported from the versions' parents (``why="save"``);
        rollbacks, resumes from an older version, new branches and tags are recorded when they
        happen, with the version they left behind (``previous``), which ``gc`` keeps for
        ``reflog_keep`` seconds.
        """
        self.check_open()
        self._wait_published()
        if branch is not None:
            check_name(branch, "branch")
        recorded = self._core.catalog.reflog("branch", branch) if branch is not None else self._core.catalog.reflog()
        # A resume, or a save that started a branch, is that version's save move already.
        targets = {(m.version, m.name) for m in recorded if m.kind == "branch" and m.why in ("resume", "branch")}
        saves = [
            RefMove(id=v.id, kind="branch", name=v.branch, version=v.id, previous=v.parent, seq=0, at=v.created_at,
                    why="save")
            for v in self._core.catalog.summaries()
            if (v.id, v.branch) not in targets and (branch is None or v.branch == branch)
        ]
        return sorted([*recorded, *saves], key=lambda m: (m.at, m.id))

    def refs(self) -> dict[str, str]:
        """Every ref: ``{"branch/main": version_id, "tag/best": version_id, ...}``."""
        self.check_open()
        return {k: r.version for k, r in self._core.catalog.refs().items()}

    def _write_ref_everywhere(self, rec: RefRecord, base: RefRecord | None, why: MoveReason) -> None:
        if self._engine is not None:
            self._engine.wait_job(rec.version)  # its manifest must be on the tiers first
        self._core.repo.move_ref(rec, base, why)

    def branch(self, name: str, from_ref: str) -> str:
        """Create branch ``name`` at the version ``from_ref`` resolves to; the next save on it has that parent.

        Raises:
            RefExistsError: If the branch exists (use :meth:`rollback` to move it).
        """
        check_name(name, "branch")
        vid = self.resolve(from_ref)
        cur = self._core.catalog.ref("branch", name)
        if cur is not None:
            raise RefExistsError(f"branch {name!r} already exists (at {cur.version}): use rollback to move it",
                                 kind="branch", name=name, version=cur.version)
        self._write_ref_everywhere(RefRecord(kind="branch", name=name, version=vid, seq=0), None, "branch")
        return vid

    def rollback(self, branch: str, ref: str, *, reset: bool = False) -> str:
        """Move the head of ``branch`` back to the version ``ref`` resolves to; history is kept.

        ``ref`` must be in the branch's history (its head or an ancestor of it); with ``reset``
        the head moves to any version (``git reset --hard``), and the reflog keeps what it left.

        Raises:
            BranchNotFoundError: If the branch does not exist.
            InvalidArgumentError: If ``ref`` is not in the branch's history and ``reset`` is not set.
        """
        check_name(branch, "branch")
        vid = self.resolve(ref)
        cur = self._core.catalog.ref("branch", branch)
        if cur is None:
            raise BranchNotFoundError(f"branch {branch!r} does not exist: create it with branch()", branch=branch)
        if not reset and vid not in self._ancestry(cur.version):
            raise InvalidArgumentError(
                f"rollback {branch}: {ref!r} (version {vid}) is not in {branch}'s history, so moving there is not "
                f"a rollback: give a version of `tiercache log {branch}`, or move the branch anyway with reset "
                "(tiercache rollback --reset)")
        self._core.follow_head(branch)  # the branch's head is where the next save continues
        self._write_ref_everywhere(RefRecord(kind="branch", name=branch, version=vid, seq=cur.seq + 1), cur,
                                   "rollback")
        return vid

    def _ancestry(self, head: str) -> set[str]:
        """``head`` and every ancestor the catalog knows (pruned versions keep their place)."""
        out: set[str] = set()
        vid: str | None = head
        while vid is not None and vid not in out:
            out.add(vid)
            vid = self._core.catalog.parent_of(vid)
        return out

    def tag(self, name: str, ref: str) -> str:
        """Tag the version ``ref`` resolves to as ``name``; a tag never moves.

        Raises:
            RefExistsError: If the tag exists and points at another version.
        """
        check_name(name, "tag")
        vid = self.resolve(ref)
        cur = self._core.catalog.ref("tag", name)
        if cur is not None:
            if cur.version == vid:
                return vid
            raise RefExistsError(f"tag {name!r} already points at {cur.version}: tags never move",
                                 kind="tag", name=name, version=cur.version)
        self._write_ref_everywhere(RefRecord(kind="tag", name=name, version=vid, seq=0), None, "tag")
        return vid

    # ------------------------------------------------------------------ tier moves

    def promote(self, ref: str, to: str = "disk", progress: Progress | None = None) -> int:
        """Copy a version's chunks into tier ``to`` ahead of a restore (e.g. S3 -> local NVMe).

        Returns:
            Bytes copied.

        Raises:
            TierUnavailableError: If tier ``to`` is down.
        """
        self.check_open()
        version = self._core.catalog.get(self.resolve(ref))
        if to != "ram" and to not in self._core.repo.durable:
            raise ConfigError(f"unknown tier {to!r}: this cache has {', '.join(self.tier_names)}")
        if (outage := self._core.repo.health.outage(to)) is not None:
            raise TierUnavailableError(f"cannot promote to {to}: it is unavailable ({outage.reason})")
        if to == "ram":
            return self.engine.promote_ram(version, self._core.read_object, progress)
        return self._core.repo.copy_version(version, to, self._core.read_object, progress)

    def evict(self, ref: str, tier: str) -> int:
        """Drop tier ``tier``'s copy of a version: its manifest, then the chunks no other version there needs.

        Returns:
            Bytes freed.

        Raises:
            LastCopyError: If a chunk would be left with no durable copy (or the version is still
                being written).
            TierUnavailableError: If ``tier`` is down.
        """
        self.check_open()
        version = self.manifest(ref)
        if tier not in self.tier_names and tier != "ram":
            raise ConfigError(f"unknown tier {tier!r}: this cache has {', '.join(self.tier_names)}")
        if tier == "ram":
            ids = {c.id for c in version.chunks}
            for other in self._core.catalog.all():  # chunks shared with other versions in RAM stay
                if other.id != version.id and "ram" in self._core.catalog.residency(other):
                    ids -= {c.id for c in other.chunks}
            # Node RAM outlives this process: its agent evicts even where this process never saved.
            engine = self.engine if self._engine is not None or self._node.link is not None else None
            return engine.evict_ram(ids) if engine is not None else 0
        if self._engine is not None:
            self._engine.wait_job(version.id)
        freed = self._core.repo.evict(version.id, tier, by="user")
        assert freed is not None  # only the policy's evictions are refused silently
        return freed

    # ------------------------------------------------------------------ maintenance

    def verify(self, ref: str | None = None, *, repair: bool = False, sample: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> repo_ops.VerifyReport:
        """Check every copy of a version's (or every version's) chunks and manifests on every durable tier.

        Args:
            ref: One version to check, or ``None`` for all.
            repair: Rewrite each missing or damaged copy from a good copy on another tier.
            sample: Read only this many chunk copies, drawn at random (every manifest is still
                checked): a quick check of a large cache.
            progress: Called with the bytes of chunk copies checked so far and the bytes to check.

        Returns:
            The report: each damaged copy, whether it was repaired, and what has no good copy.
        """
        self.check_open()
        if self._engine is not None:
            self._engine.wait_settled()  # versions in flight are checked once committed
        versions = [self.manifest(ref)] if ref is not None else self._core.catalog.all()
        return repo_ops.verify(self._core.repo, versions, repair=repair, sample=sample, progress=progress,
                               every_manifest=ref is None)

    def gc(self, *, dry_run: bool = False, grace: float | None = None) -> repo_ops.GcReport:
        """Delete versions no branch head or tag reaches (through parents) and chunks nothing names.

        Args:
            dry_run: Report what would be freed; delete nothing.
            grace: Keep unreferenced objects younger than this many seconds (default ``gc_grace``).

        Returns:
            What was (or would be) freed, per tier.
        """
        self.check_open()
        self._wait_published()
        engine = self._engine
        evicted = None if engine is None else engine.evict_ram
        report = self._node.gc(dry_run=dry_run, grace=grace)
        if report is not None:  # the agent collected: this process's catalog forgets what it deleted
            self._core.catalog.forget(report.versions if not dry_run else ())
        else:
            report = repo_ops.gc(self._core.repo, dry_run=dry_run, grace=grace, on_chunks_deleted=evicted)
        if not dry_run and report.versions:
            # A collected version is never the parent of a later save (of a new branch, or a resume).
            self._core.forget(set(report.versions))
        return report

    def doctor(self, *, abort_stale: float | None = None, unsafe: bool = False,
               probe: bool = False) -> repo_ops.DoctorReport:
        """Report on the S3 endpoint: conditional writes, read-after-write, unfinished multipart uploads.

        Writes nothing unless asked: the conditional-write probe reported is the one a saving
        process recorded before its first ref write.

        Args:
            abort_stale: Abort unfinished multipart uploads older than this many seconds (after
                checking that the store reports real upload start times).
            unsafe: Accept a store that ignores conditional writes.
            probe: Probe conditional writes now (writes and deletes a scratch object).

        Returns:
            The report; ``report.ok`` says whether refs can be committed on this store.
        """
        self.check_open()
        return repo_ops.doctor(self._core.repo, abort_stale=abort_stale, unsafe=unsafe, probe=probe)

    def reindex(self) -> dict[str, tuple[int, int]]:
        """Rebuild each durable tier's index of versions and pruned records from its manifests (``doctor --reindex``).

        Listing and resolving read the index, never every manifest; a reader repairs an index that
        misses a manifest by itself, so this is needed only to check or compact one at will. It
        reads every manifest.

        Returns:
            Per tier, ``(versions, pruned records)`` indexed.
        """
        self.check_open()
        return self._core.catalog.reindex()

    # ------------------------------------------------------------------ stats and lifetime

    def stats(self) -> dict[str, Any]:
        """Observed throughput per tier and codec, and capacity/usage per tier (JSON-able).

        Its shape is :class:`tiercache.runtime.CacheStats`. With a node agent, the throughput is
        the agent's, and ``"agent"`` holds its figures (:class:`tiercache.runtime.AgentStats`).
        """
        tiers = {}
        for name in self.tier_names:
            t = self._core.repo.durable.get(name)  # the RAM tier has no room or usage of its own here
            if t is None:
                continue
            outage = self._core.repo.health.outage(name)
            tiers[name] = TierStats(
                capacity=t.capacity, used_bytes=t.used_bytes() if outage is None else None,
                available=outage is None, unavailable=outage.reason if outage else None,
                room=self._room(name, outage is None) if name in self._core.repo.durable else None)
        engine = self._engine
        errors = ErrorStats(lost_versions=engine.errors_total if engine else 0,
                            recent=list(engine.recent_errors) if engine else [])
        out = CacheStats(meter=self._core.meter.snapshot(), tiers=tiers, errors=errors)
        agent = self._node.stats()
        return (out.with_agent(agent) if agent is not None else out).to_json()

    def _room(self, name: str, up: bool) -> TierRoom:
        """A durable tier's room for the next version, for :meth:`stats` (see :mod:`tiercache.repo.room`).

        ``state`` is ``"full"`` when the next version does not fit even after eviction, or new
        versions of this process skip the tier for lack of room; else ``"available"`` or
        ``"unavailable"`` (down: what it holds is unknown).
        """
        if not up:
            return TierRoom(state="unavailable")
        try:
            room = TierRoom.model_validate(repo_ops.room(self._core.repo, name).to_json())
        except TierCacheError:
            return TierRoom(state="unavailable")
        full = bool(room.full) or (self._engine is not None and name in self._engine.full_tiers())
        return room.model_copy(update={"full": full, "state": "full" if full else "available"})

    def status(self) -> dict[str, Any] | None:
        """What the saving process publishes for viewers: staged versions, levels reached, queues, costs.

        In the process that saves, the live status; elsewhere, the one it last wrote to the first
        durable tier (``stats/status.json``), or ``None``. Its fields are described in
        :mod:`tiercache.status` (typed by :class:`tiercache.runtime.Status`).
        """
        self.check_open()
        if self._recorder is not None:
            return self._recorder.current().to_json()
        try:
            stored = read_status(self._core.repo.get_record(STATUS_KEY))
        except TierCacheError as e:  # a viewer's aid: an unreadable status is no status
            log.debug("no usable status: %s", e)
            return None
        return None if stored is None else stored.to_json()

    def advisor(
        self,
        mttf: float | str | None = None,
        level: str = "local",
        *,
        min_interval: float | str | None = None,
        max_interval: float | str | None = None,
        restart: float | str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> Advisor:
        """An advisor that tells the training loop when to save (see :class:`tiercache.advisor.Advisor`).

        Example:
            >>> advisor = cache.advisor(mttf="3h", level="local")
            >>> for step in range(steps):
            ...     train_step()
            ...     if advisor.should_save(step):
            ...         cache.save(model.state_dict(), step=step)

        Args:
            mttf: Mean time to failure of the job (seconds or a duration such as ``"3h"``;
                default ``advisor.mttf`` of the config).
            level: The durability level a restart would resume from (``staged``, ``local``,
                ``remote``, ``durable``).
            min_interval: Never save more often (default ``advisor.min_interval``).
            max_interval: Never wait longer between saves (default ``advisor.max_interval``).
            restart: Seconds a failed job takes to run again before its restore (default
                ``advisor.restart``).
            clock: Monotonic seconds for timing the steps (tests pass a fake one).

        Raises:
            InvalidArgumentError: If no MTTF is given or configured, or ``level`` is not one of this cache's.
        """
        self.check_open()
        cfg = self.config.advisor
        levels = self.levels
        if level not in levels:
            raise InvalidArgumentError(f"unknown level {level!r}: this cache has {', '.join(levels)}")
        if mttf is None and cfg.mttf is None:
            raise InvalidArgumentError("advisor(): give the job's mean time to failure, e.g. mttf=\"3h\" "
                                       "(or set [advisor] mttf in the config)")
        from tiercache.advisor import Advisor  # only a training loop that asks for advice needs it

        recorder = self._status_recorder()
        return Advisor(
            lambda: self.plan_inputs(level, mttf=mttf, restart=restart),
            min_interval=parse_duration(min_interval) if min_interval is not None else cfg.min_interval,
            max_interval=parse_duration(max_interval) if max_interval is not None else cfg.max_interval,
            clock=clock or time.monotonic,
            publish=lambda step, advice: recorder.note_step(step, advice),
        )

    @property
    def levels(self) -> list[str]:
        """The durability levels this cache's saves can reach, fastest first."""
        durable = [TIER_LEVEL[n] for n in DURABLE_TIERS if n in self._core.repo.durable]
        return ["staged", *durable, *(["durable"] if durable else [])]

    def plan_inputs(
        self,
        level: str = "local",
        *,
        mttf: float | str | None = None,
        restart: float | str | None = None,
        given: Mapping[str, float] | None = None,
    ) -> PlanInputs:
        """The inputs of the checkpoint-interval advisor, from what this cache measured.

        In the process that saves, from its live measurements; elsewhere from the status the
        saving process published and the speeds it observed (see :func:`tiercache.advisor.measured_inputs`).

        Args:
            level: The level a restart resumes from.
            mttf: The job's mean time to failure (default: ``advisor.mttf`` of the config).
            restart: Seconds from a failure until the job runs again (default ``advisor.restart``).
            given: Figures to use instead of the measured ones (``save_wait``, ``time_to_level``, ``restore``).
        """
        from tiercache.advisor import Figure, measured_inputs, snapshot_rate

        self.check_open()
        cfg = self.config.advisor
        mttf_fig = (Figure(parse_duration(mttf), "given") if mttf is not None
                    else None if cfg.mttf is None else Figure(cfg.mttf, "given", "config advisor.mttf"))
        if restart is not None:
            restart_fig = Figure(parse_duration(restart), "given")
        elif "restart" in cfg.model_fields_set:
            restart_fig = Figure(cfg.restart, "given", "config advisor.restart")
        else:
            restart_fig = Figure(cfg.restart, "assumed", "default (advisor.restart, --restart)")
        rate: Callable[[str, str], float | None] = self._core.meter.rate
        nbytes = None
        if self._recorder is not None:
            status: Mapping[str, Any] | None = self._recorder.costs()
            newest = self._recorder.newest_version()
            if newest is not None:
                with contextlib.suppress(VersionNotFoundError):  # not hashed yet: no estimates from sizes now
                    nbytes = self._core.catalog.get(newest).nbytes
        else:
            status = self.status()
            if status is not None and isinstance(status.get("meter"), Mapping):
                rate = snapshot_rate(status["meter"])
            versions = self.versions()
            nbytes = versions[-1].nbytes if versions else None
        return measured_inputs(level=level, tiers=self.tier_names, status=status, rate=rate, nbytes=nbytes,
                               mttf=mttf_fig, restart=restart_fig, given=given)

    def _note_restore(self, seconds: float) -> None:
        """Put a restore's time in this process's status: now if it saves, else once it does (a resume)."""
        with self._recorder_lock:
            if self._recorder is None:  # a process that only reads publishes nothing
                self._restored_times.append((seconds, time.time()))
                return
            recorder = self._recorder
        recorder.note_restore(seconds, at=time.time())

    def _status_recorder(self) -> StatusRecorder:
        with self._recorder_lock:
            if self._recorder is None:
                # With a node agent, the agent publishes the status (it sees every rank's saves).
                own = self.config.agent is None and bool(self._core.repo.durable)
                write = partial(self._core.repo.put_record, STATUS_KEY) if own else None
                self._recorder = StatusRecorder(write, interval=self.config.ui.status_interval,
                                                meter=self._core.meter.snapshot)
                for seconds, at in self._restored_times:
                    self._recorder.note_restore(seconds, at=at)
                self._restored_times.clear()
            return self._recorder

    def prepare(self, state: Any = None, *, wait: bool = False) -> None:
        """Allocate and pre-fault the RAM arena now, so that the first ``save()`` does not pay for it.

        Otherwise the first save allocates it (opening a cache to list or restore versions
        allocates nothing), and faulting in gigabytes takes seconds on some machines. Call this
        right after opening, before the model is built or loaded: the memory is faulted in on a
        background thread, and a save that comes earlier waits only for the rest.

        Args:
            state: A state like the ones you will save. Needed only when ``ram.capacity`` is
                ``"auto"``: the arena is then sized for two versions of it.
            wait: Return only once the memory is in place.

        Raises:
            InvalidArgumentError: If ``ram.capacity`` is ``"auto"`` and no state is given.
            UnsupportedStateError: If ``state`` has a leaf that cannot be stored.
        """
        self.check_open()
        self.engine.prepare_arena(state, wait=wait)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pending save has finished on every tier that is up.

        A version waiting for S3 while it is down is durable on disk and is not waited for (an
        outage may last hours): a warning names it, and its ``remote`` level resolves once S3 is
        back and caught up (see :mod:`tiercache.pipeline.catchup`).

        Args:
            timeout: Seconds to wait at most (``None``: as long as it takes).

        Raises:
            TimeoutError: If versions are still pending after ``timeout``; the message names them.
            TierCacheError: The error of the first version since the last report that reached no
                durable tier (see ``engine.on_error``).
        """
        if self._engine is not None:
            self._engine.flush(timeout)

    def close(self) -> None:
        """Wait for pending writes, release the arena and connections.

        A ``save()`` running in another thread finishes staging first (its version is written
        like any other); a ``save()`` after this raises :class:`CacheClosedError`. It does not
        wait for S3 while it is down: the ``remote`` level of a version still waiting for it
        fails with :class:`TierUnavailableError` (the version is on disk; the next process that
        saves uploads the newest version of each branch).

        Raises:
            TierCacheError: The first version since the last report that reached no durable tier.
        """
        if not self._core.stop_saves():  # no save is half-staged from here on, and none starts
            return
        atexit.unregister(self._atexit)  # (a threading exit hook stays: it finds the cache closed)
        try:
            if self._engine is not None:
                self._engine.close()
        finally:
            if self._step_guards is not None:
                self._step_guards.close()
            if self._recorder is not None:
                self._recorder.close()
            self._persist_meter()
            for group_view in self._groups.values():
                group_view.close()
            self._node.close()
            self._core.close()

    def _seed_meter(self) -> None:
        """Start from the throughput the last process observed on these tiers (policy and ``stats``)."""
        try:
            data = self._core.repo.get_record(METER_KEY)
            if data is not None:
                self._core.meter.seed(json.loads(data))
        except (TierCacheError, ValueError) as e:  # a hint only: never a reason not to open
            log.debug("no usable meter snapshot: %s", e)

    def _persist_meter(self) -> None:
        """Leave what this process observed for the next one (``tiercache stats``, the policy).

        Only a process that saved writes it: opening a cache to read never writes.
        """
        snap = self._core.meter.snapshot()
        if not snap["tiers"] or self._engine is None or not self._engine.has_saved:
            return
        try:
            self._core.repo.put_record(METER_KEY, json.dumps(snap).encode())
        except TierCacheError as e:
            log.warning("could not store the throughput meter: %s", e)

    def __enter__(self) -> TierCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:
            log.error("error while closing the cache after another error: %s", e)

    def __repr__(self) -> str:
        return f"TierCache(tiers={self.tier_names}, policy={self.config.policy.name!r})"


def core_of(cache: TierCache) -> CacheCore:
    """The internal interface of ``cache``: the one way code outside this module reaches past its public API.

    For the node agent and the integrations that are handed a user's cache (the DCP storage
    writer and reader, the Hugging Face callback); users never need it. See docs/design.md
    section 1, "The facade and the core".
    """
    return cache._core


def _at_exit(flush: Callable[[], None]) -> None:
    """Run ``flush`` at interpreter exit while thread pools still take work.

    ``atexit`` handlers run after ``concurrent.futures`` has refused new work from every thread
    pool at exit ("cannot schedule new futures after interpreter shutdown"), and the engine's
    and the group's background work runs on pools: a version staged right before an uncaught
    exception would fail, on every rank of a group. Exit hooks of ``threading`` run first, in
    reverse order of registration, so one registered after ``concurrent.futures.thread``'s runs
    before it. (``threading._register_atexit`` is private; plain ``atexit`` is the fallback.)
    """
    import concurrent.futures.thread  # noqa: F401  (registers its own exit hook first)

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("threading has no exit hooks")
        register(flush)
    except RuntimeError:  # already shutting down, or another Python
        atexit.register(flush)


def _flush_at_exit(ref: weakref.ReferenceType[TierCache]) -> None:
    cache = ref()
    if cache is not None and not cache.closed:
        pending = cache.pending()
        if pending:
            log.warning("finishing %d pending version(s) at exit; call close() to do it yourself", len(pending))
        try:
            cache.close()
        except Exception as e:  # at exit there is nobody left to raise to
            log.error("tiercache: a background write failed: %s", e)
