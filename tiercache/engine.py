"""The background save pipeline: staging, hashing, per-tier writers, futures and backpressure.

``stage()`` runs on the training thread and is the only part training waits for: it reserves
page-aligned regions of the RAM arena (asking the policy when the arena is full), copies every
tensor into them (:mod:`tiercache.staging`) and returns a :class:`~tiercache.handle.SaveHandle`.
Everything else runs on engine threads, chunk by chunk as soon as each is copied:

1. a hasher names each staged chunk by the hash of its bytes, writes its header in place and
   hands the region to the RAM tier (a chunk already there is deduplicated on the spot);
2. one writer thread per durable tier takes versions in save order, asks the policy whether and
   how to write it there (:mod:`tiercache.engine_policy`), writes the missing chunks in parallel,
   then the manifest, then moves the ref with compare-and-swap, and completes that tier's
   durability future.

A version keeps its arena regions pinned until every tier it was placed on has finished (or
failed); regions then stay as a read cache if the RAM tier serves reads, and are evicted oldest
first when a new save needs room.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import torch

from tiercache import codecs
from tiercache.catalog import Catalog
from tiercache.config import CacheConfig, RamConfig
from tiercache.deferred import Owned, deferrable
from tiercache.engine_policy import FLOAT_DTYPE_NAMES, PolicyBridge
from tiercache.errors import (
    CacheClosedError,
    ConfigError,
    ConflictError,
    DeadlineExceededError,
    InvalidArgumentError,
    SkippedError,
    TierCacheError,
    TierFullError,
    TierUnavailableError,
)
from tiercache.failpoints import failpoint
from tiercache.format import Flat, flatten
from tiercache.handle import GROUP_LEVELS, LEVELS, TIER_LEVEL, SaveHandle
from tiercache.health import TierHealth, is_outage
from tiercache.layout import Layout, plan_layout
from tiercache.manifest import ChunkRef, Piece, RefRecord, TensorEntry, TierOutcome, Version, new_version_id
from tiercache.names import CHUNKS, chunk_key, version_key
from tiercache.policy.base import COMMIT_REQUESTS, Policy, TierPlan, VersionView
from tiercache.policy.meter import ThroughputMeter
from tiercache.staging import CopyPlan, Stager, plan_copy
from tiercache.tiers.base import Tier
from tiercache.tiers.disk import DiskTier, PendingPut
from tiercache.tiers.ram import Arena, RamTier, Region

log = logging.getLogger("tiercache.engine")

_FLOAT_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16}

#: Most chunks of one version written ahead of being named; each holds an open tmp file until
#: then, so this bounds the file descriptors a version holds.
_EARLY_AHEAD = 64




class Committer(Protocol):
    """Commits one version for a group of processes in place of the engine (multi-rank saves).

    A tier's writer thread calls :meth:`owned` before writing the version's chunks and
    :meth:`commit` once its chunks are durable; the engine then completes that level. Both may
    block while the group agrees, and raise to fail the level.
    """

    def owned(self, tier: str) -> Collection[str]:
        """Ids of the version's chunks this process writes to ``tier`` (the others write the rest)."""
        ...

    def commit(self, tier: str) -> None:
        """Return once the group's manifest and ref are committed on ``tier``; raise if they are not."""
        ...

    def split_hashing(self, layout: Layout, paths: list[str]) -> HashSplit | None:
        """Which chunks this process hashes itself (``None``: all); called once per version by the hasher."""
        ...


class HashSplit(Protocol):
    """Chunks whose bytes are the same in every process of a group are hashed by one of them only.

    The hasher hashes :attr:`mine` (in that order), then trades ids with :meth:`exchange` and
    takes the ids of :attr:`theirs` from the answer. ``exchange`` is called exactly once per
    version, with ``None`` if hashing failed here, so the other processes never wait in vain.
    """

    mine: list[int]
    theirs: list[int]

    def exchange(self, ids: dict[int, str] | None) -> dict[int, str]:
        """Give the ids this process computed, get every id of :attr:`theirs`; raise if the group failed."""
        ...


@dataclass
class _Job:
    """One version on its way through the pipeline."""

    version_id: str
    branch: str
    step: int
    seq: int
    parent: str | None
    meta: dict
    created_at: float
    flat: Flat
    layout: Layout
    regions: list[Region | None]
    futures: dict[str, Future[str]]
    manifest: Version | None = None
    chunk_keys: list[str] = field(default_factory=list)
    #: One future per chunk, resolved with its id as soon as it is hashed, so writers start on
    #: a chunk while later ones are still being hashed.
    ready: list[Future[str]] = field(default_factory=list)
    #: Resolved with the manifest once every chunk is hashed.
    published: Future[Version] = field(default_factory=Future)
    #: Set per chunk by the training thread once the chunk is fully copied into the arena.
    copied: list[threading.Event] = field(default_factory=list)
    #: The exception that interrupted the copy (the caller of save() got it too).
    copy_error: BaseException | None = None
    pending: set[str] = field(default_factory=set)
    nbytes: int = 0
    #: Set for one process's part of a multi-rank version: it picks the chunks to write and commits.
    committer: Committer | None = None
    #: Durable tiers in the order the placement ranked them (a fallback takes the first it can).
    order: tuple[str, ...] = ()
    #: Tiers skipped for this version, with why. Their levels are settled only once the version
    #: is durable on another tier; if it never is, one of them takes it after all.
    skipped: dict[str, str] = field(default_factory=dict)
    #: Tiers whose write failed, with the error (their levels failed at once).
    failed: dict[str, BaseException] = field(default_factory=dict)
    #: Tiers where the version's manifest and ref are committed.
    committed: set[str] = field(default_factory=set)
    #: Tiers the version goes to without asking the policy: a fallback, so that it reaches one.
    forced: set[str] = field(default_factory=set)
    #: The user's policy dropped it (``on_full="evict"``): it is not written anywhere after all.
    dropped: bool = False
    #: Every level is settled and nothing of it is pending any more.
    settled: bool = False
    #: The manifest as committed: its parent is the nearest ancestor that became durable.
    final: Version | None = None
    #: Set once the pipeline is done with the version (settled and its regions released).
    released: threading.Event = field(default_factory=threading.Event)

    def view(self, tiers: frozenset[str] = frozenset()) -> VersionView:
        float_bytes = sum(m.nbytes for m in self.flat.metas if m.dtype in FLOAT_DTYPE_NAMES)
        return VersionView(
            id=self.version_id, branch=self.branch, step=self.step, nbytes=self.nbytes,
            created_at=self.created_at, tiers=tiers, pending=frozenset(self.pending),
            meta=self.meta, float_fraction=float_bytes / self.nbytes if self.nbytes else 0.0,
        )


class Engine(PolicyBridge):
    """Runs the save pipeline for one cache.

    Args:
        config: The cache config.
        tiers: Every tier by name, fastest first; the engine adds ``"ram"`` to this dict when it
            creates the arena.
        arena_capacity: Arena bytes, or ``None`` to size it at the first save (two versions).
        pin_memory: Pin the arena when CUDA is available.
        serve_reads: Whether staged chunks stay in RAM as a read cache once durable.
        catalog: The catalog (versions, refs, residency).
        policy: The policy consulted for placement and a full arena.
        meter: Where every transfer's bytes and seconds are recorded.
        health: Which durable tiers answer now (a down tier fails its level at once and is
            caught up when it answers again).
        copy_version: Copies a stored version onto a tier (chunks, then manifest), reading from
            whichever tier holds each chunk; used to catch up a tier after an outage.
    """

    def __init__(
        self,
        config: CacheConfig,
        tiers: dict[str, Tier],
        *,
        arena_capacity: int | None,
        pin_memory: bool,
        serve_reads: bool,
        catalog: Catalog,
        policy: Policy,
        meter: ThroughputMeter,
        health: TierHealth,
        copy_version: Callable[[Version, str], int],
    ) -> None:
        self.config = config
        self.all_tiers = tiers
        self.tiers = {n: t for n, t in tiers.items() if t.durable}
        self._arena_capacity = arena_capacity
        self._pin = pin_memory
        self.arena: Arena | None = None
        self.ram: RamTier | None = None
        self.serve_reads = serve_reads
        self.catalog = catalog
        self.policy = policy
        self.meter = meter
        self._lock = threading.RLock()
        self._plans: dict[object, CopyPlan] = {}
        #: Copies that save() deferred (see tiercache.deferred), until each is done.
        self._deferred: set[Future[None]] = set()
        self._views_cache: dict[str, tuple[tuple[str, ...], VersionView]] = {}
        self._pins: dict[str, int] = {}
        self._ram_lru: OrderedDict[str, None] = OrderedDict()
        self._jobs: dict[str, _Job] = {}
        self.health = health
        health.set_on_up(self._tier_back)
        self._copy_version = copy_version
        #: Versions that reached no durable tier -> the parent their children name instead.
        self._effective: OrderedDict[str, str | None] = OrderedDict()
        #: Versions lost (no durable tier) that neither save() nor flush()/close() reported yet.
        self._losses: deque[BaseException] = deque(maxlen=64)
        self.errors_total = 0
        self.recent_errors: deque[str] = deque(maxlen=16)
        self._caught_up = False
        self._closed = False
        self._arena_cv = threading.Condition()
        self._last_remote: float | None = None
        #: The last hashed version's layout, chunk ids, and which chunks differed from the one
        #: before it: where a chunk changed last time, the disk writer writes it early again.
        self._last_hashed: tuple[Layout, list[str], list[bool]] | None = None
        #: Whether the disk tier writes chunk payloads before their hash is known (off only in A/Bs).
        self.early_writes = True
        self._stager = Stager((config.ram or RamConfig()).resolved_copy_threads())
        nice = config.background_nice
        self._hasher = ThreadPoolExecutor(
            1, thread_name_prefix="tiercache-hash", initializer=lower_thread_priority, initargs=(nice,)
        )
        # Names chunks written before their hash (see _finish_early): these tasks wait for hashes,
        # so they get threads of their own rather than holding up the writers.
        self._finisher = ThreadPoolExecutor(
            2, thread_name_prefix="tiercache-name", initializer=lower_thread_priority, initargs=(nice,)
        )
        self._queues: dict[str, queue.Queue[_Job | None]] = {}
        self._writers: dict[str, threading.Thread] = {}
        self._io: dict[str, ThreadPoolExecutor] = {}
        for name in self.tiers:
            self._queues[name] = queue.Queue()
            threads = config.disk.io_threads if name == "disk" and config.disk else config.io_threads
            self._io[name] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"tiercache-{name}", initializer=lower_thread_priority, initargs=(nice,)
            )
            t = threading.Thread(
                target=self._writer, args=(name, nice), name=f"tiercache-writer-{name}", daemon=True
            )
            self._writers[name] = t
            t.start()

    # ------------------------------------------------------------------ training thread

    def stage(
        self,
        state: object,
        *,
        step: int,
        branch: str,
        meta: dict,
        parent: str | None,
        seq: int,
        version_id: str | None = None,
        chunk_bytes: int | None = None,
        committer: Committer | None = None,
        defer: Owned | None = None,
    ) -> SaveHandle:
        """Copy ``state`` into the arena and start writing it; return the handle.

        ``version_id``, ``chunk_bytes`` and ``committer`` serve multi-rank saves
        (:mod:`tiercache.distributed`): the group's agreed version id, a chunk size that splits
        replicated tensors among the ranks, and the committer that writes the manifest and ref
        for the whole group in place of this engine. ``defer``: the address ranges of an
        optimizer's tensors, whose copy may finish after this returns (see
        :mod:`tiercache.deferred`); the ``staged`` future completes when it has.

        Raises:
            CacheClosedError: If the cache is closed.
            TierCacheError: The error of an earlier background write that nobody has seen yet.
            UnsupportedStateError: If a leaf of ``state`` cannot be stored.
            TierFullError: If the version can never fit in the RAM arena.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one to save")
        flat = flatten(state, allow_pickle=self.config.allow_pickle)
        plan = self._plan(flat, chunk_bytes or self.config.chunk_bytes)
        layout = plan.layout
        vid = version_id or new_version_id()
        futures: dict[str, Future[str]] = {lvl: Future() for lvl in LEVELS}
        job = _Job(vid, branch, step, seq, parent, dict(meta), time.time(), flat, layout, [], futures,
                   nbytes=sum(m.nbytes for m in flat.metas), committer=committer)
        self._start_catch_up()
        regions = self._reserve(layout, job)
        if regions is None:
            err = SkippedError(f"version at step {step} skipped: the RAM arena is full and the policy said skip")
            for f in futures.values():
                f.set_exception(err)
            return self._report_earlier(SaveHandle(vid, futures))
        job.regions = list(regions)
        job.ready = [Future() for _ in regions]
        job.copied = [threading.Event() for _ in regions]
        for lvl, tier in (("local", "disk"), ("remote", "s3")):
            if tier not in self.tiers:
                futures[lvl].set_exception(ConfigError(f"no {tier} tier configured, so no {lvl!r} level"))
        if not self.tiers:
            futures["durable"].set_exception(ConfigError("no durable tier configured (only RAM)"))
        for lvl in GROUP_LEVELS:
            futures[lvl].set_exception(ConfigError(
                f"no {lvl!r} level: it comes with multi-rank saves (save(group=...)) and [peers] copies >= 1"))
        with self._lock:
            self._jobs[vid] = job
        # The hasher and the writers start on each chunk as soon as it is copied, so the disk is
        # busy while the training thread is still copying the rest (unless the copy uses every
        # core: see Stager.saturates).
        self._hasher.submit(self._after_stage, job)
        later = deferrable(flat.tensors, defer) if defer else frozenset()
        try:
            pending = self._stager.copy_in(flat, plan, [self.arena.tensor(r) for r in regions], job.copied,
                                           later=later)
        except BaseException as e:
            job.copy_error = e
            for ev in job.copied:
                ev.set()
            raise
        if pending is None:
            futures["staged"].set_result(vid)
        else:
            with self._lock:
                self._deferred.add(pending)
            pending.add_done_callback(lambda f: self._copied_later(job, f))
        return self._report_earlier(SaveHandle(vid, futures))

    def _report_earlier(self, handle: SaveHandle) -> SaveHandle:
        """Apply ``engine.on_error`` to versions lost earlier, now that ``handle``'s version is staged.

        ``"warn"`` leaves them to ``flush()``/``close()`` (they were logged when lost);
        ``"raise"`` raises the first with ``handle`` on it, so the new version is not lost too.
        """
        if self.config.engine.on_error == "raise":
            with self._lock:
                err = self._losses.popleft() if self._losses else None
            if err is not None:
                err.handle = handle  # type: ignore[attr-defined]
                raise err
        return handle

    def _copied_later(self, job: _Job, done: Future[None]) -> None:
        with self._lock:
            self._deferred.discard(done)
        err = done.exception()
        if err is None:
            job.futures["staged"].set_result(job.version_id)
            return
        # Unlike a copy in save(), nobody has seen this one fail: it counts as a lost version.
        self._record_loss(job, err)
        job.copy_error = err  # before the events: the hasher checks it when one is set
        for ev in job.copied:
            ev.set()

    def wait_deferred(self) -> None:
        """Block until every deferred copy started so far is done (its outcome is on its handle)."""
        with self._lock:
            pending = list(self._deferred)
        for f in pending:
            f.exception()

    def _plan(self, flat: Flat, chunk_bytes: int) -> CopyPlan:
        """The chunk layout and copy plan of ``flat``'s structure, computed once per structure."""
        cache_key = (flat.structure_key, chunk_bytes)
        plan = self._plans.get(cache_key)
        if plan is None:
            sizes = [m.nbytes for m in flat.metas]
            items = [t.element_size() if t.dtype in _FLOAT_DTYPES else 1 for t in flat.tensors]
            plan = plan_copy(plan_layout(sizes, items, chunk_bytes=chunk_bytes, pack_below=self.config.pack_below))
            if len(self._plans) > 16:
                self._plans.clear()
            self._plans[cache_key] = plan
        return plan

    def ensure_arena(self, staged_bytes: int = 0) -> RamTier:
        """Create the arena and RAM tier on first use (memory itself is allocated lazily)."""
        with self._lock:
            if self.ram is None:
                cap = self._arena_capacity
                if cap is None:
                    cap = max(2 * staged_bytes, 64 << 20)
                pin = self._pin and torch.cuda.is_available()
                self.arena = Arena(cap, pin=pin)
                self.ram = RamTier(self.arena)
                self.all_tiers["ram"] = self.ram
                # Keep "ram" first: it is the fastest tier.
                for n in [n for n in self.all_tiers if n != "ram"]:
                    self.all_tiers[n] = self.all_tiers.pop(n)
            return self.ram

    def prepare_arena(self, state: object | None, *, wait: bool) -> None:
        """Create the arena and fault its memory in now (see :meth:`TierCache.prepare`).

        Raises:
            CacheClosedError: If the cache is closed.
            InvalidArgumentError: If the capacity is ``"auto"`` and ``state`` is ``None``.
            UnsupportedStateError: If ``state`` cannot be stored.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one")
        staged = 0
        if state is not None:
            flat = flatten(state, allow_pickle=self.config.allow_pickle)
            staged = self._plan(flat, self.config.chunk_bytes).layout.staged_bytes
        elif self.arena is None and self._arena_capacity is None:
            raise InvalidArgumentError(
                "ram.capacity is 'auto': pass a state to prepare() so the arena can be sized, or set ram.capacity"
            )
        self.ensure_arena(staged)
        arena = self.arena
        assert arena is not None
        if wait:
            arena.prefault()
            return

        def run() -> None:
            try:
                arena.prefault()
            except Exception as e:  # the first save then allocates (and reports) it itself
                log.warning("pre-faulting the RAM arena failed: %s", e)

        threading.Thread(target=run, name="tiercache-prefault", daemon=True).start()

    def _reserve(self, layout: Layout, job: _Job) -> list[Region] | None:
        self.ensure_arena(layout.staged_bytes)
        assert self.arena is not None
        if layout.staged_bytes > self.arena.capacity:
            raise TierFullError(
                f"a version needs {layout.staged_bytes} bytes of RAM arena but ram.capacity is "
                f"{self.arena.capacity}: raise ram.capacity"
            )
        while True:
            got = self._try_alloc(layout)
            if got is not None:
                return got
            if self._evict_ram_cache(layout.staged_bytes):
                continue
            decision = self.policy.on_full(layout.staged_bytes, self.context())
            if decision == "skip":
                return None
            if decision == "evict" and self._cancel_oldest_pending():
                continue
            # "wait": block until a writer releases regions, then try again.
            with self._arena_cv:
                self._arena_cv.wait(0.2)

    def _try_alloc(self, layout: Layout) -> list[Region] | None:
        got: list[Region] = []
        for c in layout.chunks:
            r = self.arena.alloc(c.staged_bytes)
            if r is None:
                for g in got:
                    self.arena.free(g)
                return None
            got.append(r)
        return got

    # ------------------------------------------------------------------ background

    def _after_stage(self, job: _Job) -> None:
        # Place first and hand the version to the writers right away: they write each chunk as
        # soon as it is hashed instead of waiting for the whole version.
        try:
            targets = self._placement(job)
        except BaseException as e:
            self._fail_job(job, e, list(LEVELS if job.copy_error is not None else LEVELS[1:]), staging_failed=True)
            return
        for name in targets:
            self._queues[name].put(job)
        try:
            self._hash_and_publish(job)
        except BaseException as e:
            for f in [*job.ready, job.published]:
                if not f.done():
                    f.set_exception(e)
            self._fail_job(job, e, list(LEVELS if job.copy_error is not None else LEVELS[1:]), staging_failed=True)
            return
        if not targets:
            self._settle(job)  # every tier skipped: the first that can takes it after all

    def _hash_and_publish(self, job: _Job) -> None:
        assert self.arena is not None and self.ram is not None
        algo = self.config.hash
        hdr = codecs.HEADER_BYTES
        chunks = job.layout.chunks
        ids: list[str] = [""] * len(chunks)
        # A multi-rank version may leave chunks every rank holds alike to one rank's hasher.
        split = job.committer.split_hashing(job.layout, [m.path for m in job.flat.metas]) if job.committer else None
        theirs = frozenset(split.theirs) if split is not None else frozenset()
        given: dict[int, str] = {}
        traded = split is None

        def trade(mine: dict[int, str] | None) -> dict[int, str]:
            nonlocal traded
            traded = True
            assert split is not None
            return split.exchange(mine)

        if self._stager.saturates:
            # Every core is copying for the training thread: hashing now would only slow it.
            for e in job.copied:
                e.wait()
        try:
            for i in range(len(chunks)) if split is None else [*split.mine, *split.theirs]:
                c = chunks[i]
                job.copied[i].wait()
                if job.copy_error is not None:
                    raise job.copy_error
                region = job.regions[i]
                assert region is not None
                buf = self.arena.buffer(region)
                if not traded and i in theirs:
                    given = trade({j: ids[j] for j in split.mine})  # type: ignore[union-attr]
                cid = given.get(i) or codecs.content_id(buf[hdr : hdr + c.nbytes], algo)
                self._name_chunk(job, i, cid, buf, region)
                ids[i] = cid
            if not traded:
                trade({j: ids[j] for j in split.mine})  # type: ignore[union-attr]
        except BaseException:
            if not traded:
                # The group's other hashers are waiting for this one's ids; this error is the one to report.
                with contextlib.suppress(Exception):
                    trade(None)
            raise
        self._publish(job, ids)

    def _name_chunk(self, job: _Job, i: int, cid: str, buf: memoryview, region: Region) -> None:
        """Write chunk ``i``'s header (its id ``cid``) in place and hand its region to the RAM tier."""
        c = job.layout.chunks[i]
        algo = self.config.hash
        hdr = codecs.HEADER_BYTES
        codecs.write_header(buf[:hdr], codecs.ChunkHeader(cid, c.nbytes, c.nbytes, "raw/1", c.itemsize, algo))
        key = chunk_key(cid)
        with self._lock:
            # A chunk already in RAM (an earlier version's) is kept and our copy freed: dedup.
            # (An early disk write still reading our copy retained it: it goes back after.)
            self.ram.adopt(key, region, hdr + c.nbytes)
            job.regions[i] = None
            self._pins[key] = self._pins.get(key, 0) + 1
            self._ram_lru.pop(key, None)
            job.chunk_keys.append(key)
        self.catalog.note_chunks("ram", [cid])
        job.ready[i].set_result(cid)

    def _publish(self, job: _Job, ids: list[str]) -> None:
        """Build the version's manifest from its chunk ids and make it known (RAM tier, catalog)."""
        algo = self.config.hash
        tensors = []
        for i, m in enumerate(job.flat.metas):
            pieces = tuple(Piece(chunk=ci, chunk_offset=p.chunk_offset, offset=p.offset, nbytes=p.nbytes)
                           for ci, p in job.layout.tensor_pieces[i])
            tensors.append(
                TensorEntry(path=m.path, dtype=m.dtype, shape=tuple(m.shape), nbytes=m.nbytes, pieces=pieces)
            )
        manifest = Version(
            id=job.version_id, parent=job.parent, branch=job.branch, step=job.step,
            created_at=datetime.fromtimestamp(job.created_at, UTC), meta=job.meta, hash_algo=algo,
            chunks=tuple(ChunkRef(id=cid, nbytes=c.nbytes) for cid, c in zip(ids, job.layout.chunks, strict=True)),
            tensors=tuple(tensors), tree=job.flat.tree, pickled=job.flat.pickled, nbytes=job.nbytes,
        )
        with self._lock:
            self.ram.put(version_key(job.version_id), manifest.to_json())
        job.manifest = manifest
        job.flat = dataclasses.replace(job.flat, tensors=[])  # drop references to the caller's tensors
        self.catalog.add(manifest, "ram")
        job.published.set_result(manifest)
        with self._lock:
            prev = self._last_hashed
            changed = ([a != b for a, b in zip(prev[1], ids, strict=True)] if prev and prev[0] is job.layout
                       else [True] * len(ids))
            self._last_hashed = (job.layout, ids, changed)
        self._notify_arena()

    def _placement(self, job: _Job) -> list[str]:
        placement = self.policy.place(self._view(job), self.context())
        targets = [p.tier for p in placement.plans if not p.skip and p.tier in self.tiers]
        named = [p.tier for p in placement.plans if p.tier in self.tiers]
        with self._lock:
            job.order = tuple(named + [n for n in self.tiers if n not in named])
            for name in self.tiers:
                if name not in targets:
                    job.skipped[name] = placement.plan_for(name).reason or "policy decision"
                    if job.committer is not None:  # the group waits for this level now (no fallback)
                        self._skip_level(job, name, job.skipped[name])
            job.pending = set(targets)  # before coalescing, so this job counts as the newest pending one
        self._coalesce(job)
        return targets

    def _writer(self, name: str, nice: int) -> None:
        lower_thread_priority(nice)
        q = self._queues[name]
        while True:
            job = q.get()
            if job is None:
                return
            self._write_or_fail(name, job)

    def _write_or_fail(self, name: str, job: _Job) -> None:
        try:
            self._write_version(name, job)
        except BaseException as e:
            self._fail_tier(name, job, e)

    def _write_version(self, name: str, job: _Job) -> None:
        tier = self.tiers[name]
        with self._lock:
            if name not in job.pending:
                return  # coalesced away while queued (see _coalesce), already settled there
            forced = name in job.forced
        outage = self.health.outage(name)
        if outage is not None and not forced:
            raise TierUnavailableError(f"{name} is unavailable since {_clock(outage.since)} ({outage.reason}); "
                                       "the version was not written there")
        plan = TierPlan(name) if forced else self.policy.place(self._view(job), self.context()).plan_for(name)
        lvl = TIER_LEVEL.get(name)
        if not plan.skip and not self._make_room(name, job):
            if forced:
                raise TierFullError(f"{name} is full and the policy names nothing to evict")
            plan = TierPlan(name, skip=True, reason=f"{name} is full and the policy names nothing to evict")
        if plan.skip:
            self._skip_tier(name, job, plan.reason or "policy decision")
            return
        have = self.catalog.chunks_on(name)
        # A multi-rank version: write only the chunks the group gave this rank (waits for the group).
        mine = job.committer.owned(name) if job.committer is not None else None
        written: set[str] = set()
        futs = []
        hint = self._early_hint(job, tier, plan.codec)
        # Chunks written before they are hashed and not yet named: each holds an open tmp file.
        early: deque[Future[tuple[int, float, float]]] = deque()
        try:
            for i, ready in enumerate(job.ready):
                region = self._lend_region(job, i) if hint[i] and not ready.done() else None
                if region is not None:
                    payload = self._io[name].submit(self._write_payload, tier, job, i, region)
                    named = self._finisher.submit(self._finish_early, job, i, region, payload, have, written)
                    futs.append(named)
                    early.append(named)
                    while len(early) > _EARLY_AHEAD or (early and early[0].done()):
                        futures_wait([early.popleft()])
                    continue
                cid = ready.result()  # raises the hashing error, failing this level
                if (mine is not None and cid not in mine) or not self._claim(cid, have, written):
                    continue
                futs.append(self._io[name].submit(self._put_chunk, name, tier, chunk_key(cid), plan.codec))
        except BaseException:
            futures_wait(futs)  # the early writes give their lent regions back and remove their tmp files
            raise
        spans = self._await_puts(name, job, futs)
        t_commit = time.perf_counter()
        tier.sync_names(chunk_key(c) for c in written)  # the chunks' names, before the manifest
        if spans:
            # One observation per version: bytes over the time any put was in flight. Per-chunk
            # rates would read a shared link as its speed divided by the puts in parallel.
            self.meter.record(name, "write", sum(n for n, _, _ in spans), _busy_seconds(spans))
        self.catalog.note_chunks(name, written)
        if job.committer is not None:
            job.committer.commit(name)  # the group's rank 0 writes the merged manifest and moves the ref
            self._tier_done(name, job)
            return
        manifest = self._final_manifest(job)
        body = manifest.to_json()
        tier.put(version_key(job.version_id), body)
        self.catalog.mark_on(name, job.version_id)
        failpoint("engine.after_manifest_write")
        rec = RefRecord(kind="branch", name=job.branch, version=job.version_id, seq=job.seq)
        try:
            self.catalog.write_ref(name, rec)
        except ConflictError as e:
            # Another writer moved the branch: the version stays stored but off the branch. Only
            # this level fails (the handle reports it, and the next save builds on the new head).
            log.warning("version %s not committed on %s: %s", job.version_id, name, e)
            with self._lock:
                job.failed[name] = e
            if lvl:
                job.futures[lvl].set_exception(e)
            self._done_with(job, name)
            return
        # The commit is latency-bound (a manifest and a ref, each durable before the next): with
        # the bulk write above it lets the meter tell per-request latency from bandwidth.
        self.meter.record(name, "write", len(body), time.perf_counter() - t_commit, requests=COMMIT_REQUESTS)
        self._tier_done(name, job)

    def _await_puts(
        self, name: str, job: _Job, futs: list[Future[tuple[int, float, float]]]
    ) -> list[tuple[int, float, float]]:
        """Wait for a version's chunk puts on ``name``, within the tier's per-version deadline.

        Retries of throttled or failed requests happen inside each put; the deadline bounds them
        all together, so a store that keeps answering 503 fails the version's level at the
        deadline instead of after every retry.

        Returns:
            Each put's stored size and start and end times.

        Raises:
            DeadlineExceededError: If the deadline passed: puts not yet started are cancelled,
                and running ones end on their own (each keeps its chunk's bytes borrowed from
                the RAM tier until then, see :meth:`_put_chunk`).
        """
        limit = self.config.s3.deadline_s if name == "s3" and self.config.s3 is not None else None
        if limit is None:
            # Every put ends before the first error is raised, so a failed level leaves no write
            # of this version running (each keeps its chunk's bytes anyway: borrowed or retained).
            futures_wait(futs)
            return [f.result() for f in futs]
        end = time.monotonic() + limit
        try:
            return [f.result(timeout=max(0.0, end - time.monotonic())) for f in futs]
        except FuturesTimeout:
            for f in futs:
                f.cancel()
            raise DeadlineExceededError(
                f"writing version {job.version_id} to {name} took longer than its deadline of {limit:g}s "
                "(s3.deadline_s): the store is throttling or failing"
            ) from None

    def _tier_done(self, name: str, job: _Job) -> None:
        """Complete ``job``'s level for tier ``name`` once its manifest and ref are committed there."""
        if name == "s3":
            self._last_remote = time.time()
        self.health.note_success(name)
        with self._lock:
            job.committed.add(name)
        lvl = TIER_LEVEL.get(name)
        if lvl:
            job.futures[lvl].set_result(job.version_id)
        if not job.futures["durable"].done():
            job.futures["durable"].set_result(job.version_id)
        self._done_with(job, name)

    def _final_manifest(self, job: _Job) -> Version:
        """The manifest to commit: its parent is the nearest ancestor that became durable.

        A version that reached no durable tier is never named as a parent: if the parent is
        still in the pipeline, its outcome is awaited first (it is older, so it never waits on
        this one), and a lost parent is replaced by the parent it would have had.
        """
        manifest = job.published.result()
        with self._lock:
            if job.final is not None:
                return job.final
            parent_job = self._jobs.get(manifest.parent) if manifest.parent else None
        if parent_job is not None and parent_job is not job:
            parent_job.futures["durable"].exception()  # waits; the outcome is the parent's own
        changed = False
        with self._lock:
            if job.final is None:
                parent = self._durable_ancestor(manifest.parent)
                job.final = manifest if parent == manifest.parent else manifest.model_copy(update={"parent": parent})
                changed = job.final is not manifest
            final = job.final
        if changed:
            log.warning("version %s: its parent %s reached no durable tier; it names %s instead",
                        job.version_id, manifest.parent, final.parent)
            self.catalog.add(final)
            with self._lock:
                self.ram.put(version_key(job.version_id), final.to_json())
        return final

    def _durable_ancestor(self, vid: str | None) -> str | None:
        """``vid``, or if it was lost, the nearest ancestor that was not (caller holds the lock)."""
        seen: set[str] = set()
        while vid is not None and vid in self._effective and vid not in seen:
            seen.add(vid)
            vid = self._effective[vid]
        return vid

    def _early_hint(self, job: _Job, tier: Tier, codec: str) -> list[bool]:
        """Per chunk: whether to write its payload to ``tier`` before its hash (its name) is known.

        The disk then starts on the first copied chunk instead of after the whole copy and its
        hashing. Only raw chunks of a single-process version go to the disk this way, and only
        those that changed between the last two versions: a chunk that turns out to be stored
        already was written for nothing.
        """
        if not (self.early_writes and isinstance(tier, DiskTier) and codec == "raw/1" and job.committer is None):
            return [False] * len(job.ready)
        with self._lock:
            last = self._last_hashed
        if last is not None and last[0] is job.layout:
            return last[2]
        return [True] * len(job.ready)

    def _claim(self, cid: str, have: Collection[str], written: set[str]) -> bool:
        """Claim chunk ``cid`` for this version's writes unless it is stored or claimed already.

        The version's chunk writes run in parallel, so the check and the claim are one step.
        """
        with self._lock:
            if cid in have or cid in written:
                return False
            written.add(cid)
            return True

    def _lend_region(self, job: _Job, i: int) -> Region | None:
        """Wait until chunk ``i`` is copied; return its region, retained, if not yet hashed.

        The caller frees it once done reading: whoever else frees it meanwhile (the hasher for a
        duplicate, the RAM tier on release, a failed save) leaves the bytes in place until then.
        """
        assert self.arena is not None
        job.copied[i].wait()
        with self._lock:  # the hasher adopts the region (and clears job.regions[i]) under it
            region = job.regions[i]  # None once the hasher has adopted it (or the save failed)
            if region is None or job.copy_error is not None:
                return None
            self.arena.retain(region)
            return region

    def _write_payload(
        self, tier: DiskTier, job: _Job, i: int, region: Region
    ) -> tuple[PendingPut, float, float]:
        """Write chunk ``i``'s payload from its lent region to a tmp file, before it is hashed.

        Returns the pending object and the write's start and duration.
        """
        assert self.arena is not None
        hdr = codecs.HEADER_BYTES
        n = job.layout.chunks[i].nbytes
        t0 = time.perf_counter()
        pending = tier.begin_put(hdr + n, CHUNKS.rstrip("/"), sync_name=False)
        try:
            pending.write(hdr, self.arena.buffer(region)[hdr : hdr + n])
        except BaseException:
            pending.abort()
            raise
        return pending, t0, time.perf_counter() - t0

    def _finish_early(
        self, job: _Job, i: int, region: Region, payload: Future[tuple[PendingPut, float, float]],
        have: Collection[str], written: set[str],
    ) -> tuple[int, float, float]:
        """Name chunk ``i`` once hashed: write its header and commit it, then give its region back.

        Runs on the finisher threads while the writers go on with later payloads. Returns the
        bytes written and a span as long as the disk was busy with them (the waits for the
        payload and the hash left out). A chunk that proves to be stored already is dropped: its
        tmp file is removed.
        """
        assert self.arena is not None
        hdr = codecs.HEADER_BYTES
        try:
            pending, t0, busy = payload.result()
            try:
                cid = job.ready[i].result()  # the hasher wrote the header into the region before this
                if not self._claim(cid, have, written):
                    return job.layout.chunks[i].nbytes, t0, t0 + busy
                t1 = time.perf_counter()
                pending.write(0, self.arena.buffer(region)[:hdr])
                pending.commit(chunk_key(cid))
                busy += time.perf_counter() - t1
            finally:
                pending.abort()
            failpoint("engine.after_chunk_write")
            return hdr + job.layout.chunks[i].nbytes, t0, t0 + busy
        finally:
            self.arena.free(region)  # the lent reference
            self._notify_arena()

    def _put_chunk(self, name: str, tier: Tier, key: str, codec: str) -> tuple[int, float, float]:
        """Write one chunk object; return its stored size and the put's start and end times."""
        # Borrowed, not viewed: if the version is released while this put still reads (a
        # deadline passed), the region must not take the next save's bytes, which the tier
        # would then store under this chunk's name.
        with self.ram.borrow(key) as view:
            if view is None:
                raise TierCacheError(f"chunk {key} vanished from the RAM arena before it was written to {name}")
            data: memoryview | bytes = view
            if codec != "raw/1":
                data = self._encode(view, codec)
            t0 = time.perf_counter()
            tier.put(key, data, sync_name=False)  # _write_version syncs the names once per version
            t1 = time.perf_counter()
        failpoint("engine.after_chunk_write")
        return len(data), t0, t1

    def _encode(self, view: memoryview, codec: str) -> bytes:
        hdr = codecs.read_header(view[: codecs.HEADER_BYTES])
        t0 = time.perf_counter()
        payload = codecs.encode(codec, view[codecs.HEADER_BYTES :], itemsize=hdr.itemsize)
        self.meter.record_codec(codec, hdr.raw_len, len(payload), time.perf_counter() - t0)
        if len(payload) >= hdr.raw_len:
            return bytes(view)  # incompressible: storing it raw is smaller and faster to read
        out = bytearray(codecs.HEADER_BYTES + len(payload))
        codecs.write_header(memoryview(out)[: codecs.HEADER_BYTES], codecs.ChunkHeader(
            hdr.chunk_id, hdr.raw_len, len(payload), codec, hdr.itemsize, hdr.hash_algo))
        out[codecs.HEADER_BYTES :] = payload
        return bytes(out)

    # ------------------------------------------------------------------ completion

    def _fail_job(self, job: _Job, err: BaseException, levels: list[str], *, staging_failed: bool = False) -> None:
        """Fail a version whose staging (copy or hashing) failed: nothing of it can be written."""
        log.error("saving version %s failed: %s", job.version_id, err)
        for lvl in levels:
            if lvl and not job.futures[lvl].done():
                job.futures[lvl].set_exception(err)
        # A multi-rank version's error reaches every rank through the group's handle instead.
        # A copy error was already raised to the caller of save(): not a lost version to report.
        if job.committer is None and err is not job.copy_error and not isinstance(err, SkippedError):
            self._record_loss(job, err)
        self._lost(job)
        # Only the hasher (the owner of not-yet-adopted regions) may free them.
        if staging_failed and self.arena is not None:
            with self._lock:  # as the hasher's adoptions: _lend_region sees a region or None
                job.settled = True
                for i, r in enumerate(job.regions):
                    if r is not None:
                        self.arena.free(r)  # an early write that retained it frees it last
                        job.regions[i] = None
                self._jobs.pop(job.version_id, None)
                job.released.set()
            self._notify_arena()

    def _fail_tier(self, name: str, job: _Job, err: BaseException) -> None:
        """Record that writing ``job`` to tier ``name`` failed; an outage marks the tier down."""
        with self._lock:
            job.failed[name] = err
        lvl = TIER_LEVEL.get(name)
        if lvl and not job.futures[lvl].done():
            job.futures[lvl].set_exception(err)
        if is_outage(err):
            self.health.mark_down(name, err)  # logged once per outage
        else:
            log.warning("writing version %s to %s failed: %s", job.version_id, name, err)
        with self._lock:
            self.recent_errors.append(f"{job.version_id} on {name}: {type(err).__name__}: {err}")
        self._done_with(job, name)

    def _done_with(self, job: _Job, name: str) -> None:
        with self._lock:
            job.pending.discard(name)
            finished = not job.pending
        if finished:
            self._settle(job)

    def _settle(self, job: _Job) -> None:
        """Settle a version nothing is pending for: skipped levels, the durable level, its regions.

        If it reached no durable tier although a tier it was skipped for can take it, it is
        written there now instead (every version reaches a durable tier unless the user's policy
        dropped it with ``on_full``), on a thread of its own: a tier's writer may be waiting for
        this version's outcome (see :meth:`_final_manifest`).
        """
        with self._lock:
            if job.settled or job.pending:
                return
            fallback = None
            if not job.committed and not job.dropped and job.committer is None and job.copy_error is None:
                # An available tier first; else one that is down, rather than losing the version
                # (if it answers, it is up again).
                untried = [n for n in job.order if n in job.skipped and n not in job.failed]
                fallback = next((n for n in untried if self.health.available(n)), untried[0] if untried else None)
            if fallback is not None:
                why = job.skipped.pop(fallback)
                job.pending.add(fallback)
                job.forced.add(fallback)
            else:
                job.settled = True
                skipped = dict(job.skipped)
                failed = dict(job.failed)
                durable = bool(job.committed)
        if fallback is not None:
            log.warning("version %s reached no durable tier; writing it to %s after all (skipped there: %s)",
                        job.version_id, fallback, why)
            threading.Thread(target=self._write_or_fail, args=(fallback, job), name=f"tiercache-fallback-{fallback}",
                             daemon=True).start()
            return
        for name, reason in skipped.items():
            self._skip_level(job, name, reason)
        # A version another writer's ref move kept off the branch is stored all the same: its
        # handle says so, and it is no loss (a RAM-only cache has no durable level at all).
        conflicted = bool(failed) and all(isinstance(e, ConflictError) for e in failed.values())
        if not durable and conflicted:
            if not job.futures["durable"].done():
                job.futures["durable"].set_exception(self._loss_error(job, skipped, failed))
        elif not durable and self.tiers:
            err = self._loss_error(job, skipped, failed)
            # Recorded (and the branch head retracted) before anyone waiting on the handle wakes.
            if not job.dropped and job.committer is None:
                self._record_loss(job, err)
            self._lost(job)
            if not job.futures["durable"].done():
                job.futures["durable"].set_exception(err)
        elif skipped or failed:
            outcomes = {n: TierOutcome(state="skipped", reason=r) for n, r in skipped.items()}
            outcomes.update({n: TierOutcome(state="failed", reason=f"{type(e).__name__}: {e}")
                             for n, e in failed.items()})
            self.catalog.note_outcomes(job.version_id, outcomes)  # seen by versions() at once
            self._finisher.submit(self._store_outcome, job.version_id)
        self._release(job)

    def _loss_error(self, job: _Job, skipped: dict[str, str], failed: dict[str, BaseException]) -> BaseException:
        """The error a version that reached no durable tier fails ``durable`` with."""
        for name in job.order:
            if name in failed:
                return failed[name]
        if job.dropped or skipped:
            why = "; ".join(f"{n}: {r}" for n, r in skipped.items())
            return SkippedError(f"version {job.version_id} reached no durable tier ({why})")
        return SkippedError(f"version {job.version_id} reached no durable tier")

    def _record_loss(self, job: _Job, err: BaseException) -> None:
        """Count a version that reached no durable tier; ``flush()``/``close()`` (or ``save()``) report it."""
        with self._lock:
            self._losses.append(err)
            self.errors_total += 1
            self.recent_errors.append(f"{job.version_id}: reached no durable tier: {type(err).__name__}: {err}")
        log.error("version %s (step %d) reached no durable tier: %s", job.version_id, job.step, err)

    def _lost(self, job: _Job) -> None:
        """Make a version that reached no durable tier invisible as a parent and as a branch head."""
        with self._lock:
            self._effective[job.version_id] = self._durable_ancestor(job.parent)
            while len(self._effective) > 4096:
                self._effective.popitem(last=False)
        if job.committer is None:
            self.catalog.retract(RefRecord(kind="branch", name=job.branch, version=job.version_id, seq=job.seq))

    def _store_outcome(self, version_id: str) -> None:
        """Note on the tiers that hold the version why the others do not (for ``ls`` and the UI)."""
        try:
            self.catalog.store_outcomes(version_id)
        except TierCacheError as e:  # a note for humans: never a reason to fail anything
            log.info("could not record why version %s is not on every tier: %s", version_id, e)

    def _release(self, job: _Job) -> None:
        with self._lock:
            self._jobs.pop(job.version_id, None)
            job.released.set()
            for key in job.chunk_keys:
                n = self._pins.get(key, 0) - 1
                if n > 0:
                    self._pins[key] = n
                    continue
                self._pins.pop(key, None)
                if self.serve_reads or not self.tiers:
                    self._ram_lru[key] = None
                else:
                    self.ram.delete(key)
                    self.catalog.note_chunks("ram", [key.rsplit("/", 1)[-1]], present=False)
        self._notify_arena()

    def _notify_arena(self) -> None:
        with self._arena_cv:
            self._arena_cv.notify_all()

    def _evict_ram_cache(self, needed: int) -> bool:
        """Drop RAM copies of durable chunks, oldest first, until ``needed`` may fit."""
        freed = False
        with self._lock:
            while self._ram_lru and self.arena.free_bytes < needed:
                key, _ = self._ram_lru.popitem(last=False)
                if self._pins.get(key):
                    continue
                self.ram.delete(key)
                self.catalog.note_chunks("ram", [key.rsplit("/", 1)[-1]], present=False)
                freed = True
            if not freed and self._ram_lru and self.arena.free_bytes >= needed:
                # Enough bytes but fragmented: drop one more cached chunk and retry.
                key, _ = self._ram_lru.popitem(last=False)
                if not self._pins.get(key):
                    self.ram.delete(key)
                    self.catalog.note_chunks("ram", [key.rsplit("/", 1)[-1]], present=False)
                    freed = True
        return freed

    def evict_ram(self, keys: list[str]) -> int:
        """Drop the RAM copies of ``keys`` that no pending version needs; return bytes freed."""
        freed = 0
        if self.ram is None:
            return 0
        with self._lock:
            for key in keys:
                if self._pins.get(key):
                    continue
                size = self.ram.size(key)
                if size is None:
                    continue
                self.ram.delete(key)
                self._ram_lru.pop(key, None)
                self.catalog.note_chunks("ram", [key.rsplit("/", 1)[-1]], present=False)
                freed += size
        self._notify_arena()
        return freed

    def cache_in_ram(self, key: str) -> None:
        """Register a chunk copied into the RAM tier (by promote) as evictable cache."""
        with self._lock:
            if not self._pins.get(key):
                self._ram_lru[key] = None

    @property
    def has_saved(self) -> bool:
        """Whether this process has saved anything (a process that only reads never writes)."""
        return self._caught_up

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers ``version_id`` is still being written to by this process (empty if none)."""
        with self._lock:
            job = self._jobs.get(version_id)
            return frozenset(job.pending) if job is not None else frozenset()

    def wait_published(self) -> None:
        """Block until every staged version's manifest is in the catalog (hashing is quick)."""
        if not self._closed:
            self._hasher.submit(lambda: None).result()

    def pending_jobs(self) -> list[str]:
        """Ids of versions still being written."""
        with self._lock:
            return list(self._jobs)

    def wait_job(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until the pipeline is done with ``version_id`` (whatever the outcome).

        Returns:
            Whether it is done (``False`` only if ``timeout`` passed first).
        """
        with self._lock:
            job = self._jobs.get(version_id)
        return job is None or job.released.wait(timeout)

    # ------------------------------------------------------------------ tiers coming back

    def _start_catch_up(self) -> None:
        """On this process's first save, catch up every durable tier that lacks a branch head or tag.

        A tier that was down when an earlier process saved (or that process died before its
        uploads) is missing the newest versions; saving resumes, so their upload resumes too.
        Read-only processes never save, so they never write.
        """
        with self._lock:
            if self._caught_up or not self.tiers:
                return
            self._caught_up = True
        for name in self.tiers:
            if TIER_LEVEL.get(name) == "remote" and self.health.available(name):
                threading.Thread(target=self._tier_back, args=(name,), name=f"tiercache-catchup-{name}",
                                 daemon=True).start()

    def _tier_back(self, name: str) -> None:
        """Copy onto remote tier ``name`` the newest version of each branch and every tagged one it lacks.

        Runs when a down tier answers again (and once per process, see :meth:`_start_catch_up`);
        refs are moved with the usual compare-and-swap, so another writer's newer head is left
        alone. Versions in between stay on the tiers that hold them. A local tier (the disk) is
        not caught up: what it lacks is on S3 already, and ``promote`` copies it when wanted.
        """
        if TIER_LEVEL.get(name) != "remote":
            return
        try:
            self.catalog.reload(name)
            for rec in sorted(self.catalog.refs().values(), key=lambda r: (r.kind != "tag", r.version), reverse=True):
                if self._closed or not self.health.available(name):
                    return
                self.wait_job(rec.version)
                version = self.catalog.get(rec.version)
                if self.catalog.manifest_on(name, version.id) and name in self.catalog.residency(version):
                    continue
                copied = self._copy_version(version, name)
                self.catalog.write_ref(name, rec)
                log.info("caught %s up with version %s (%s/%s, %d bytes copied)", name, version.id, rec.kind,
                         rec.name, copied)
                self.catalog.clear_outcome(version.id, name)
        except TierCacheError as e:
            if is_outage(e):
                self.health.mark_down(name, e)
            else:
                log.warning("catching %s up failed: %s", name, e)

    # ------------------------------------------------------------------ errors and shutdown

    def take_losses(self) -> list[BaseException]:
        """Versions lost (no durable tier) that were not reported yet, oldest first; they are reported now."""
        with self._lock:
            out = list(self._losses)
            self._losses.clear()
        return out

    def flush(self, timeout: float | None = None, *, report: bool = True) -> None:
        """Wait until every submitted version has finished on every tier.

        Args:
            timeout: Seconds to wait at most, or ``None`` to wait as long as it takes.
            report: Raise the first version lost since the last report.

        Raises:
            TimeoutError: If versions are still pending after ``timeout`` (the message names them
                and the tiers they wait for).
            TierCacheError: With ``report``, the error of the first version that reached no
                durable tier since the last report (its message names the version).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                jobs = list(self._jobs.values())
            if not jobs:
                break
            for job in jobs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self.wait_job(job.version_id, left)
            if deadline is not None and time.monotonic() >= deadline:
                with self._lock:
                    left_jobs = [(j.version_id, j.step, sorted(j.pending)) for j in self._jobs.values()]
                if left_jobs:
                    shown = ", ".join(f"{v} (step {st}, waiting for {'/'.join(p) or 'settling'})"
                                      for v, st, p in left_jobs[:4])
                    more = f" and {len(left_jobs) - 4} more" if len(left_jobs) > 4 else ""
                    raise TimeoutError(f"flush: {len(left_jobs)} version(s) still pending after {timeout:g}s: "
                                       f"{shown}{more}")
                break
        if report:
            lost = self.take_losses()
            if lost:
                raise lost[0]

    def close(self) -> None:
        """Finish pending writes, stop the threads; raise the first lost version not yet reported."""
        if self._closed:
            return
        self.flush(report=False)
        self._closed = True
        self.health.close()
        for q in self._queues.values():
            q.put(None)
        for t in self._writers.values():
            t.join()
        for pool in self._io.values():
            pool.shutdown()
        self._finisher.shutdown()
        self._hasher.shutdown()
        self._stager.close()
        if self.ram is not None:
            self.ram.close()
        if self.arena is not None:
            self.arena.close()
        lost = self.take_losses()
        if lost:
            raise lost[0]


def _clock(ts: float) -> str:
    """A Unix time as ``HH:MM:SS`` UTC (for messages)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S UTC")


def _busy_seconds(spans: list[tuple[int, float, float]]) -> float:
    """Length of the union of the ``(start, end)`` intervals of ``spans``."""
    total = 0.0
    end = float("-inf")
    for _, t0, t1 in sorted(spans, key=lambda s: s[1]):
        if t0 > end:
            total += t1 - t0
        elif t1 > end:
            total += t1 - end
        end = max(end, t1)
    return max(total, 1e-9)


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread a lower CPU priority (a higher nice value) than training.

    Linux schedules threads individually, so the engine's hashing and writing threads step aside
    whenever the training thread (and its intra-op threads) want the cores, and take them fully
    once training is waiting on the GPU or on data. A no-op where per-thread priorities are not
    available, or for ``nice <= 0``.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # e.g. a sandbox that forbids it: run at normal priority
        log.debug("cannot lower the priority of %s: %s", threading.current_thread().name, e)
