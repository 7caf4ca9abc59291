"""The background save pipeline: reserving, hashing, per-tier writers, settling, back-pressure.

The engine is the in-process back end of the save front (:mod:`tiercache.pipeline.front`,
docs/design.md section 3). On the training thread, the front has it reserve page-aligned regions
of the RAM arena (:meth:`Engine.regions`, asking the policy when the arena is full) and take the
version (:meth:`Engine.launch`) before copying every tensor in. Everything else runs on engine
threads, chunk by chunk as soon as each is copied:

1. the hasher (:mod:`tiercache.pipeline.hasher`) names each staged chunk by the hash of its
   bytes, writes its header in place, hands the region to the RAM tier and publishes the manifest;
2. the placement (:mod:`tiercache.pipeline.placement`) asks the policy which tiers take it;
3. one writer per durable tier (:mod:`tiercache.pipeline.writer`) writes it in save order and
   has the storage layer (:mod:`tiercache.repo`) commit it;
4. once nothing is pending for it, the version is *settled* here: every version reaches a durable
   tier unless the user's policy dropped it (a tier it was skipped for takes it after all), a
   version that reached none is never a parent nor a branch head, and its regions go back.

A tier that fails is marked down (:mod:`tiercache.repo.health`); when it answers again, the
remote tier is caught up with the newest version of each branch and every tag, and the levels
of versions that missed it meanwhile are settled then (:mod:`tiercache.pipeline.catchup`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tiercache import codecs
from tiercache.config import CacheConfig, RamConfig
from tiercache.errors import (
    CacheClosedError,
    ConflictError,
    IntegrityError,
    InvalidArgumentError,
    SkippedError,
    TierCacheError,
)
from tiercache.format import Flat
from tiercache.handle import LEVELS, TIER_LEVEL, LevelFuture, SaveHandle, level_futures
from tiercache.layout import Layout
from tiercache.manifest import RefRecord, TierOutcome, Version
from tiercache.names import chunk_key, version_key
from tiercache.pipeline import probe
from tiercache.pipeline.catchup import CatchUp
from tiercache.pipeline.hasher import Hasher
from tiercache.pipeline.job import Committer, Job, JobTable, StagedVersion
from tiercache.pipeline.placement import Placement, skip_level
from tiercache.pipeline.ramcache import RamCache
from tiercache.pipeline.skips import SkipLog
from tiercache.pipeline.staging import CopyPlan, copy_saturates
from tiercache.pipeline.writer import TierWriter, WriterParts, lower_thread_priority
from tiercache.policy.base import Policy
from tiercache.policy.meter import ThroughputMeter
from tiercache.repo import Repo
from tiercache.repo.health import is_outage
from tiercache.saver import ObjectReader, absent_levels
from tiercache.tiers.base import Tier, early_writer
from tiercache.tiers.ram import Arena, RamTier, Region

if TYPE_CHECKING:
    from tiercache.pipeline.front import LossLedger, Save
    from tiercache.restore import Progress

log = logging.getLogger("tiercache.pipeline.engine")

#: Seconds between two WARNINGs that ``save()`` waits for room in the RAM arena.
WAIT_WARNING_INTERVAL_S = 60.0


def _lane(job: Job) -> int:
    """The lane (hashing thread and writers) of ``job``: its rank's, for a part of a multi-rank version."""
    return job.committer.rank if job.committer is not None else 0


class Engine:
    """Runs the save pipeline for one cache.

    Args:
        config: The cache config.
        repo: The storage layer (tiers, catalog, commits, leases).
        policy: The policy consulted for placement and a full arena.
        meter: Where every transfer's bytes and seconds are recorded.
        read_object: Reads a verified chunk object from the best tier holding it (catch-up copies
            chunks with it).
        losses: The front's ledger, where versions that reached no durable tier are counted.
        make_arena: Makes the RAM arena of a given capacity (the node agent's shared memory, see
            :mod:`tiercache.agent.server`); ``None``: private memory of this process.

    It is one back end of the save front (:class:`~tiercache.pipeline.front.Backend`): the front
    copies each version into regions this engine reserved, and the engine does the rest.
    """

    def __init__(self, config: CacheConfig, repo: Repo, *, policy: Policy, meter: ThroughputMeter,
                 read_object: Callable[[str, int, str], tuple[bytes, str]], losses: LossLedger,
                 make_arena: Callable[[int], Arena] | None = None) -> None:
        self.config = config
        self.repo = repo
        self.health = repo.health
        self.meter = meter
        self.jobs = JobTable()
        ram = config.ram
        self.ramcache = RamCache(
            repo, self.jobs.lock, capacity=None if ram is None or ram.capacity == "auto" else int(ram.capacity),
            pin=lambda: (ram.pin_memory if ram else True) and torch.cuda.is_available(),
            serve_reads=ram.serve_reads if ram else False, keep_all=not repo.durable, make_arena=make_arena,
        )
        #: Logs the policy's skips (and the group's) at INFO, summarised when they repeat.
        self.skips = SkipLog()
        self.catchup = CatchUp(repo, self.jobs, read_object)
        self.placement = Placement(repo, self.jobs, self.ramcache, meter, self.skips, policy, settle=self.settle,
                                   drain=self.catchup.drain)
        #: Reads a verified chunk object from the best tier holding it (catch-up copies with it).
        self.read_object = read_object
        #: Versions that reached no durable tier -> the parent their children name instead.
        self._effective: OrderedDict[str, str | None] = OrderedDict()
        #: Where lost versions and tier failures are recorded (the front reports them).
        self.losses = losses
        self._saved = False
        self._closed = False
        self._said_waiting = float("-inf")  # when save() last said it waits for room (see _say_waiting)
        #: Whether tiers that can write chunk payloads before their hash do so (off only in A/Bs).
        self.early_writes = True
        self.health.set_on_up(self.catchup.request)
        #: Names each staged chunk and publishes the manifest (on a ``tiercache-hash`` thread).
        self.hasher = Hasher(config, repo, self.ramcache, self.jobs,
                             wait_for_copy=copy_saturates((config.ram or RamConfig()).resolved_copy_threads()))
        nice = config.background_nice
        # One lane per rank whose versions this engine writes: a hashing thread and a writer per
        # tier. A process's own versions (and its part of each multi-rank version) go through
        # lane 0, in save order. A node agent hashes and writes the parts of several ranks of one
        # version side by side, as their own processes would: one rank's trade of ids with the
        # others (tiercache.group.hashing), or its wait for the group's owners, waits for another
        # rank's part, which must not be queued behind it.
        self._hash_lanes: dict[int, ThreadPoolExecutor] = {}
        self._lanes_lock = threading.Lock()
        # Names chunks written before their hash (see TierWriter): these tasks wait for hashes,
        # so they get threads of their own rather than holding up the writers.
        self.finisher = ThreadPoolExecutor(
            2, thread_name_prefix="tiercache-name", initializer=lower_thread_priority, initargs=(nice,)
        )
        self._writer_parts = WriterParts(repo, self.jobs, self.ramcache, meter, self.placement, self.finisher,
                                         read_object)
        #: Each tier's writer of each lane (lane 0's made now, the others on first use).
        self._writers: dict[tuple[str, int], TierWriter] = {}
        for name in repo.durable:
            self._writer(name, 0)
        if config.ram is not None or not repo.durable:
            self.ramcache.ensure()

    @property
    def ram(self) -> RamTier | None:
        """The RAM tier once the arena exists."""
        return self.ramcache.ram

    @property
    def has_saved(self) -> bool:
        """Whether this process has saved anything (a process that only reads never writes)."""
        return self._saved

    # ------------------------------------------------------------------ the front's back end

    @property
    def lost(self) -> bool:
        """Never: the engine runs in this process (see :class:`~tiercache.pipeline.front.Backend`)."""
        return False

    def absent_levels(self) -> dict[str, Exception]:
        """The levels no version written by this engine can reach, and why."""
        return absent_levels(self.repo.durable)

    def regions(self, save: Save) -> list[torch.Tensor] | str:
        """Reserve regions of the arena for ``save``; views of them, or why the policy skips it (training thread).

        Raises:
            CacheClosedError: If the cache is closed.
            TierFullError: If the version can never fit in the RAM arena.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one to save")
        self._start_catch_up()
        regions = self._reserve(save.layout)
        if regions is None:
            return "the RAM arena is full and the policy said skip"
        save.ticket = regions
        arena = self.ramcache.arena
        assert arena is not None
        return [arena.tensor(r) for r in regions]

    def launch(self, save: Save) -> list[threading.Event]:
        """Hand ``save`` to the hasher before it is copied: it and the writers start on each chunk once copied.

        So the disk is busy while the training thread is still copying the rest (unless the copy
        uses every core: see :attr:`Stager.saturates`).
        """
        job = self._new_job(save.version_id, save.branch, save.step, save.seq, save.parent, save.meta,
                            save.created_at, save.flat, save.layout, save.committer, save.futures)
        copied = self._launch(job, save.ticket)
        save.ticket = job
        return copied

    def publish(self, save: Save, wait_s: float) -> None:
        """``save`` is whole in the arena: it is ``staged``."""
        save.futures["staged"].set_result(save.version_id)

    def cancel(self, save: Save, err: BaseException, *, seen: bool) -> None:
        """Copying ``save`` failed: the hasher fails the version (a copy error ``save()`` raised is no loss)."""
        job: Job = save.ticket
        job.copy_error = err  # before the events: the hasher checks it when one is set
        for ev in job.copied:
            ev.set()

    def hand_over(self, *, wait: bool) -> None:
        """Nothing to hand over: the engine is never lost."""

    def adopt(self, staged: StagedVersion, layout: Layout, regions: list[Region],
              committer: Committer | None = None, *,
              follow: Callable[[Future[Version]], None] | None = None) -> SaveHandle:
        """Start writing a version another process already copied into regions of this engine's arena.

        The entry point of the node agent (:mod:`tiercache.agent.server`): a trainer reserved
        ``regions`` (:meth:`reserve`), copied its state into them as the save front does, and
        handed over ``staged``; from here on the version goes through the same pipeline as one
        staged in process. The regions belong to the version from now on. ``committer``: one
        rank's part of a multi-rank version, which the group commits (see :meth:`SaveFront.stage`).
        ``follow`` is called with the version's manifest future before any thread can settle it
        (as :meth:`Committer.follow`; :meth:`published` forgets a version once it settled).

        Returns:
            The version's handle (``staged`` is reached already).

        Raises:
            CacheClosedError: If the engine is closed (the regions are left to the caller).
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one to save")
        flat = Flat(staged.tree, [], list(staged.metas), staged.pickled, structure_key=None)
        job = self._new_job(staged.version_id, staged.branch, staged.step, staged.seq, staged.parent, staged.meta,
                            staged.created_at, flat, layout, committer, level_futures(staged.version_id))
        for lvl, err in absent_levels(self.repo.durable).items():
            job.futures[lvl].set_exception(err)
        if follow is not None:
            follow(job.published)
        self._start_catch_up()
        for e in self._launch(job, regions):
            e.set()
        job.futures["staged"].set_result(job.version_id)
        return SaveHandle(job.version_id, job.futures)

    def reserve(self, layout: Layout) -> list[Region] | None:
        """Regions of the arena for one version of ``layout`` (see :meth:`adopt`), or ``None`` if the policy skips it.

        Blocks while the arena is full and the policy says wait, as :meth:`regions` does.

        Raises:
            TierFullError: If a version of ``layout`` can never fit in the arena.
        """
        return self._reserve(layout)

    def _new_job(self, vid: str, branch: str, step: int, seq: int, parent: str | None, meta: dict,
                 created_at: float, flat: Flat, layout: Layout, committer: Committer | None,
                 futures: dict[str, Future[str]]) -> Job:
        return Job(vid, branch, step, seq, parent, dict(meta), created_at, flat, layout, [], futures,
                   nbytes=sum(m.nbytes for m in flat.metas), committer=committer)

    def _launch(self, job: Job, regions: list[Region]) -> list[threading.Event]:
        """Give ``job`` its regions and hand it to the hasher; return its per-chunk ``copied`` events."""
        job.regions = list(regions)
        job.ready = [Future() for _ in regions]
        job.copied = [threading.Event() for _ in regions]
        self.repo.leases.open(job.version_id, job.parent)
        if job.committer is not None:
            job.committer.follow(job.published)
        self.jobs.add(job)
        self._hasher_of(_lane(job)).submit(self._after_stage, job)
        return job.copied

    def _writer(self, name: str, lane: int) -> TierWriter:
        """Tier ``name``'s writer of ``lane`` (made on first use)."""
        with self._lanes_lock:
            writer = self._writers.get((name, lane))
            if writer is None:
                tier = self.repo.durable[name]
                writer = self._writers[(name, lane)] = TierWriter(
                    self._writer_parts, self, name, tier, threads=tier.write_threads or self.config.io_threads,
                    nice=self.config.background_nice)
            return writer

    def _hasher_of(self, rank: int) -> ThreadPoolExecutor:
        """The hashing thread of ``rank``'s lane (made on first use)."""
        with self._lanes_lock:
            lane = self._hash_lanes.get(rank)
            if lane is None:
                lane = self._hash_lanes[rank] = ThreadPoolExecutor(
                    1, thread_name_prefix="tiercache-hash", initializer=lower_thread_priority,
                    initargs=(self.config.background_nice,))
            return lane

    def published(self, version_id: str) -> Future[Version] | None:
        """The future of a staged version's manifest (resolved once hashed), or ``None`` if it is not in flight."""
        job = self.jobs.get(version_id)
        return job.published if job is not None else None

    def promote_ram(self, version: Version, read: ObjectReader, progress: Progress | None) -> int:
        """Copy a version's chunks into the RAM tier as evictable read cache; return bytes copied."""
        self.ensure_arena(sum(c.nbytes for c in version.chunks))
        copied = self.repo.copy_version(version, "ram", read, progress)
        for c in version.chunks:
            self.ramcache.keep(chunk_key(c.id))
        return copied

    def keep_chunks(self, chunks: Sequence[tuple[str, int]], hash_algo: str, read: ObjectReader) -> int:
        """Copy chunks (id, bytes) the RAM tier lacks into it as evictable read cache; return bytes copied.

        What node RAM keeps of a multi-rank version: a rank's part, once the group committed it.
        Other processes wrote those chunks, so a chunk no tier is known to hold is looked for on
        the durable tiers before it counts as missing.
        """
        ram = self.ensure_arena(sum(n for _, n in chunks))
        copied = 0
        for cid, nbytes in chunks:
            key = chunk_key(cid)
            if ram.size(key) is None:
                try:
                    data, _src = read(cid, nbytes, hash_algo)
                except IntegrityError:
                    found = [n for n, t in self.repo.durable.items() if self.repo.available(n) and t.exists(key)]
                    if not found:
                        raise
                    for name in found:
                        self.repo.stored(name, [cid])
                    data, _src = read(cid, nbytes, hash_algo)
                ram.put(key, data, sync_name=False)
                self.repo.stored("ram", [cid])
                copied += len(data)
            self.ramcache.keep(key)
        return copied

    def evict_ram(self, chunk_ids: Iterable[str]) -> int:
        """Drop the RAM copies of chunks no version in flight needs; return bytes freed."""
        return self.ramcache.evict(chunk_key(i) for i in chunk_ids)

    def ensure_arena(self, staged_bytes: int = 0) -> RamTier:
        """Create the arena and RAM tier on first use (memory itself is allocated lazily)."""
        return self.ramcache.ensure(staged_bytes)

    def prepare_arena(self, flat: Flat | None, plan: CopyPlan | None, *, wait: bool) -> None:
        """Create the arena, sized for a version of ``plan``, and fault its memory in (see :meth:`TierCache.prepare`).

        Raises:
            CacheClosedError: If the cache is closed.
            InvalidArgumentError: If the capacity is ``"auto"`` and no ``plan`` sizes it.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one")
        staged = 0
        if plan is not None:
            staged = plan.layout.staged_bytes
        elif self.ramcache.capacity is None:
            raise InvalidArgumentError(
                "ram.capacity is 'auto': pass a state to prepare() so the arena can be sized, or set ram.capacity"
            )
        self.ramcache.ensure(staged)
        self._fit(staged)
        arena = self.ramcache.arena
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

    def _fit(self, staged_bytes: int) -> None:
        """Grow an automatic arena for a larger version, once the versions in flight let go of it.

        Raises:
            TierFullError: If the version can never fit (see :meth:`RamCache.check_fits`).
        """
        ram = self.ramcache
        said = False
        while not ram.check_fits(staged_bytes):
            frees = ram.frees
            if self.repo.durable:  # the read cache goes (less to move); a RAM-only cache's chunks move
                ram.make_room(staged_bytes + (ram.capacity or 0))
            if ram.grow(staged_bytes):
                return
            if not said:
                log.warning("save() waits for the versions in flight to reach %s so that the RAM arena can grow "
                            "from %d bytes for a version of %d bytes (once per growth; set ram.capacity to size "
                            "it up front)", self._holders() or "their tiers", ram.capacity or 0, staged_bytes)
                said = True
            ram.wait_for_room(frees, timeout=1.0)

    def _reserve(self, layout: Layout) -> list[Region] | None:
        ram = self.ramcache
        ram.ensure(layout.staged_bytes)
        self._fit(layout.staged_bytes)
        while True:
            frees = ram.frees  # read first: a region freed after this wakes the wait below
            got = ram.try_alloc(layout)
            if got is not None:
                return got
            if ram.make_room(layout.staged_bytes):
                continue
            decision = self.placement.policy.on_full(layout.staged_bytes, self.placement.context())
            if decision == "skip":
                return None
            if decision == "evict" and self.placement.cancel_oldest_pending():
                continue
            # "wait": until a version in flight gives regions back.
            self._say_waiting(layout.staged_bytes)
            ram.wait_for_room(frees)

    def _holders(self) -> str:
        """The tiers the versions holding the RAM arena wait for, as ``"disk"`` or ``"disk/s3"``.

        A version holds the arena until a local durable tier has it (see :meth:`release_ram`),
        or every tier it goes to if none does.
        """
        names: set[str] = set()
        with self.jobs.lock:
            for job in self.jobs.snapshot():
                if not job.ram_released:
                    # Not placed yet (still hashing): it goes to the durable tiers.
                    pending = set(job.pending) if job.order else set(self.repo.durable)
                    local = {n for n in pending if TIER_LEVEL.get(n) == "local"}
                    names |= local or pending
        return "/".join(sorted(names))

    def _say_waiting(self, staged_bytes: int) -> None:
        """Say at WARNING (at most once a minute) that ``save()`` waits for room, for which tier, and what helps."""
        now = time.monotonic()
        if now - self._said_waiting < WAIT_WARNING_INTERVAL_S:
            return
        self._said_waiting = now
        holders = self._holders() or "their tiers"
        cap = self.ramcache.capacity or 0
        local = [n for n in self.repo.durable if TIER_LEVEL.get(n) == "local"]
        if not local:
            why = "; a [disk] tier would hold them sooner"
        elif not set(local) & set(holders.split("/")):
            why = f"; they skipped {'/'.join(local)} (full or down: `tiercache stats` says which)"
        else:
            why = ""
        log.warning("save() waits for room in the RAM arena: the versions in flight hold it until %s has them%s; "
                    "raise ram.capacity above %d bytes (room for %d versions of %d bytes) or save less often "
                    "(said at most once a minute)", holders, why, cap, cap // max(staged_bytes, 1) + 1, staged_bytes)

    # ------------------------------------------------------------------ hashing and placement

    def _after_stage(self, job: Job) -> None:
        # Place first and hand the version to the writers right away: they write each chunk as
        # soon as it is hashed instead of waiting for the whole version.
        try:
            self._probe_codecs(job)
            targets = self.placement.place(job)
        except BaseException as e:
            self._fail_staging(job, e)
            return
        for name in targets:
            self._writer(name, _lane(job)).submit(job)
        try:
            self.hasher.run(job)
        except BaseException as e:
            for f in [*job.ready, job.published]:
                if not f.done():
                    f.set_exception(e)
            self._fail_staging(job, e)
            return
        if not targets:
            self.settle(job)  # every tier skipped: the first that can takes it after all

    def _probe_codecs(self, job: Job) -> None:
        """Measure the codecs not measured yet on a sample of ``job``'s first chunks, if the policy asks.

        See :mod:`tiercache.pipeline.probe`.
        """
        ask = getattr(self.placement.policy, "probe_codecs", None)
        if ask is None:
            return
        unmeasured = probe.unmeasured(self.meter)
        if not unmeasured:
            return
        with self.jobs.lock:
            view = job.view()
        names = [n for n in ask(view) if n in unmeasured]
        if not names:
            return
        sizes = probe.sample_sizes([c.nbytes for c in job.layout.chunks], job.nbytes)
        waits = job.copied if self.hasher.wait_for_copy else job.copied[: len(sizes)]
        for e in waits:  # (while every core copies for save(), the probe waits like the hasher)
            e.wait()
        if job.copy_error is not None:
            return  # the hasher reports it
        arena = self.ramcache.arena
        assert arena is not None
        hdr = codecs.HEADER_BYTES
        samples = []
        with self.jobs.lock:  # the regions stay this job's until the hasher (this thread, later) adopts them
            for i, n in enumerate(sizes):
                region = job.regions[i]
                if region is not None:
                    samples.append((arena.buffer(region)[hdr : hdr + n], job.layout.chunks[i].itemsize))
        probe.measure(self.meter, names, samples)

    def early_hint(self, job: Job, tier: Tier, codec: str) -> list[bool]:
        """Per chunk: whether to write its payload to ``tier`` before its hash (its name) is known.

        The disk then starts on the first copied chunk instead of after the whole copy and its
        hashing. Only raw chunks of a single-process version go to a tier that can this way, and
        only those that changed between the last two versions: a chunk that turns out to be
        stored already was written for nothing.
        """
        if not (self.early_writes and early_writer(tier) is not None and codec == codecs.RAW and job.committer is None):
            return [False] * len(job.ready)
        changed = self.hasher.changed(job.layout)
        return changed if changed is not None else [True] * len(job.ready)

    def final_manifest(self, job: Job) -> Version:
        """The manifest to commit: its parent is the nearest ancestor that became durable.

        A version that reached no durable tier is never named as a parent: if the parent is
        still in the pipeline, its outcome is awaited first (the engine took it first, so it
        never waits on this one), and a lost parent is replaced by the parent it would have had.
        A parent the engine took after this version (a node agent's trainer takes over versions
        of a lost agent, see :mod:`tiercache.agent.saver`) is queued behind it on every writer:
        it is named as it is, never waited for.
        """
        manifest = job.published.result()
        with self.jobs.lock:
            if job.final is not None:
                return job.final
        parent_job = self.jobs.get(manifest.parent)
        if parent_job is not None and parent_job is not job:
            if self.jobs.taken_before(parent_job, job):
                parent_job.futures["durable"].exception()  # waits; the outcome is the parent's own
            else:
                log.warning("version %s: its parent %s was taken after it; it names it without waiting for "
                            "its outcome", job.version_id, manifest.parent)
        changed = False
        with self.jobs.lock:
            if job.final is None:
                parent = self._durable_ancestor(manifest.parent)
                job.final = manifest if parent == manifest.parent else manifest.model_copy(update={"parent": parent})
                changed = job.final is not manifest
            final = job.final
        if changed:
            log.warning("version %s: its parent %s reached no durable tier; it names %s instead",
                        job.version_id, manifest.parent, final.parent)
            self.repo.catalog.add(final)
            ram = self.ramcache.ram
            if ram is not None:
                with self.jobs.lock:
                    ram.put(version_key(job.version_id), final.to_json())
        return final

    def _durable_ancestor(self, vid: str | None) -> str | None:
        """``vid``, or if it was lost, the nearest ancestor that was not (caller holds the lock)."""
        seen: set[str] = set()
        while vid is not None and vid in self._effective and vid not in seen:
            seen.add(vid)
            vid = self._effective[vid]
        return vid

    # ------------------------------------------------------------------ outcomes

    def tier_done(self, name: str, job: Job) -> None:
        """Complete ``job``'s level for tier ``name`` once its manifest and ref are committed there."""
        if TIER_LEVEL.get(name) == "remote":
            self.placement.last_remote = time.time()
        self.health.note_success(name)
        with self.jobs.lock:
            job.committed.add(name)
        lvl = TIER_LEVEL.get(name)
        if lvl == "local":
            # Before the level resolves: whoever sees ``local`` sees the arena given back.
            self.release_ram(job)
        if lvl:
            job.futures[lvl].set_result(job.version_id)
        self._level(job, "durable").reach()  # the first tier to commit decides it
        self._done_with(job, name)

    def fail_tier(self, name: str, job: Job, err: BaseException, *, quiet: bool = False, group: bool = False) -> None:
        """Record that writing ``job`` to tier ``name`` failed; an outage marks the tier down.

        ``group``: the error is the group's verdict on a multi-rank version (another rank's
        failure, or the trainer of a part that went away), which says nothing of this tier.

        A multi-rank version the group skipped on this tier (some rank's policy skipped its part
        there, so the group has no version there) is a skip, not a failure: recorded and logged
        as the policy's own skips are (:class:`~tiercache.pipeline.skips.SkipLog`).
        """
        if isinstance(err, SkippedError) and job.committer is not None:
            self._group_skipped(name, job, err)
            return
        with self.jobs.lock:
            job.failed[name] = err
        self.losses.note(f"{job.version_id} on {name}: {type(err).__name__}: {err}")
        lvl = TIER_LEVEL.get(name)
        # A remote tier's outage may leave the level waiting for its catch-up: settle decides.
        if lvl and not self.catchup.defers(name, job, err):
            self._level(job, lvl).fail_unless_settled(err)  # a staging failure may have failed it first
        if is_outage(err) and not group:
            self.health.mark_down(name, err)  # logged once per outage
        elif not quiet:
            log.warning("writing version %s to %s failed: %s", job.version_id, name, err)
        self._done_with(job, name)

    def _group_skipped(self, name: str, job: Job, err: SkippedError) -> None:
        with self.jobs.lock:
            job.skipped[name] = str(err)
        lvl = TIER_LEVEL.get(name)
        if lvl:
            self._level(job, lvl).fail_unless_settled(err)
        self.skips.skipped(name, job.version_id, str(err))
        self._done_with(job, name)

    def _done_with(self, job: Job, name: str) -> None:
        with self.jobs.lock:
            job.pending.discard(name)
            job.writing.discard(name)
            finished = not job.pending
        if finished:
            self.settle(job)

    def settle(self, job: Job) -> None:
        """Settle a version nothing is pending for: skipped levels, the durable level, its regions.

        If it reached no durable tier although a tier it was skipped for can take it, it is
        written there now instead (every version reaches a durable tier unless the user's policy
        dropped it with ``on_full``), on a thread of its own: a tier's writer may be waiting for
        this version's outcome (see :meth:`final_manifest`). Nothing is pending, so every write
        that began has its outcome: the rule never decides on a version a tier is still writing.

        A durable version that missed a remote tier because it was down waits for that tier's
        catch-up instead of failing its level (see :mod:`tiercache.pipeline.catchup`).
        """
        with self.jobs.lock:
            if job.settled or job.pending:
                return
            fallback = None
            if not job.committed and not job.dropped and job.committer is None and job.copy_error is None:
                # An available tier first; else one that is down, rather than losing the version
                # (if it answers, it is up again).
                untried = [n for n in job.order if n in job.skipped and n not in job.failed]
                # A tier full of versions no other tier holds takes it only if no other one can.
                untried.sort(key=lambda n: n in self.placement.full)
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
            threading.Thread(target=self._writer(fallback, 0).write_or_fail, args=(job,),
                             name=f"tiercache-fallback-{fallback}", daemon=True).start()
            return
        waits = self.catchup.to_wait(job, durable, skipped, failed)
        for name, reason in skipped.items():
            if name not in waits:
                skip_level(job, name, reason)
        for name, err in failed.items():  # an outage on a tier with catch-up was left to this point
            lvl = TIER_LEVEL.get(name)
            if lvl and name not in waits:
                self._level(job, lvl).fail_unless_settled(err)
        # A version another writer's ref move kept off the branch is stored all the same: its
        # handle says so, and it is no loss (a RAM-only cache has no durable level at all).
        conflicted = bool(failed) and all(isinstance(e, ConflictError) for e in failed.values())
        if not durable and conflicted:
            job.futures["durable"].set_exception(self._loss_error(job, skipped, failed))
        elif not durable and self.repo.durable:
            err = self._loss_error(job, skipped, failed)
            # Recorded (and the branch head retracted) before anyone waiting on the handle wakes.
            if not job.dropped and job.committer is None:
                self._record_loss(job, err)
            self._lost(job)
            job.futures["durable"].set_exception(err)
        elif skipped or failed:
            outcomes = {n: TierOutcome(state="skipped", reason=r) for n, r in skipped.items()}
            outcomes.update({n: TierOutcome(state="failed", reason=f"{type(e).__name__}: {e}")
                             for n, e in failed.items()})
            self.repo.catalog.note_outcomes(job.version_id, outcomes)  # seen by versions() at once
            self.finisher.submit(self._store_outcome, job.version_id)
        self._release(job)
        self.catchup.settle_job(job, waits)  # after the release: catch-up waits for the job to end

    @staticmethod
    def _level(job: Job, level: str) -> LevelFuture:
        future = job.futures[level]
        assert isinstance(future, LevelFuture)
        return future

    def _loss_error(self, job: Job, skipped: dict[str, str], failed: dict[str, BaseException]) -> BaseException:
        """The error a version that reached no durable tier fails ``durable`` with."""
        for name in job.order:
            if name in failed:
                return failed[name]
        if job.dropped or skipped:
            why = "; ".join(f"{n}: {r}" for n, r in skipped.items())
            return SkippedError(f"version {job.version_id} reached no durable tier ({why})")
        return SkippedError(f"version {job.version_id} reached no durable tier")

    def _record_loss(self, job: Job, err: BaseException) -> None:
        """Count a version that reached no durable tier; the front reports it (``save()``, ``flush()``, ``close()``)."""
        self.losses.record(job.version_id, job.step, err)

    def _lost(self, job: Job) -> None:
        """Make a version that reached no durable tier invisible as a parent and as a branch head."""
        with self.jobs.lock:
            self._effective[job.version_id] = self._durable_ancestor(job.parent)
            while len(self._effective) > 4096:
                self._effective.popitem(last=False)
        if job.committer is None:
            self.repo.catalog.retract(RefRecord(kind="branch", name=job.branch, version=job.version_id, seq=job.seq))

    def _store_outcome(self, version_id: str) -> None:
        """Note on the tiers that hold the version why the others do not (for ``ls`` and the UI)."""
        try:
            self.repo.catalog.store_outcomes(version_id)
        except TierCacheError as e:  # a note for humans: never a reason to fail anything
            log.info("could not record why version %s is not on every tier: %s", version_id, e)

    def _fail_staging(self, job: Job, err: BaseException) -> None:
        """Fail a version whose placement or hashing failed: nothing of it can be written."""
        log.error("saving version %s failed: %s", job.version_id, err)
        if not job.published.done():  # it never will be: whoever waits for the manifest learns why
            job.published.set_exception(err)
        for lvl in LEVELS if job.copy_error is not None else LEVELS[1:]:
            self._level(job, lvl).fail_unless_settled(err)  # some failed at once (no such tier)
        # A multi-rank version's error reaches every rank through the group's handle instead.
        # A copy error was already raised to the caller of save(): not a lost version to report.
        if job.committer is None and err is not job.copy_error and not isinstance(err, SkippedError):
            self._record_loss(job, err)
        self._lost(job)
        # Only the hasher (the owner of not-yet-adopted regions) may free them.
        arena = self.ramcache.arena
        with self.jobs.lock:  # as the hasher's adoptions: a lender sees a region or None
            job.settled = True
            for i, r in enumerate(job.regions):
                if r is not None and arena is not None:
                    arena.free(r)  # an early write that retained it frees it last
                    job.regions[i] = None
            # The chunks hashed before the failure were pinned for this version: pinned for good,
            # RAM could never drop them nor the arena grow. They stay as read cache (a write
            # still reading one holds its bytes until it ends).
            hashed = [] if job.ram_released else list(job.chunk_keys)
            job.ram_released = True
            kept = list(job.kept)  # (none unless a local tier had committed it)
            job.kept.clear()
        self.ramcache.unpin(hashed)
        self.ramcache.let_go(kept)
        self.repo.leases.close(job.version_id)
        self.jobs.remove(job)
        self.ramcache.notify()
        self.catchup.settle_job(job, {})  # a head lost: its branch is back on a version that may wait

    def _release(self, job: Job) -> None:
        self.repo.leases.close(job.version_id)
        self.jobs.remove(job)
        self.release_ram(job)
        with self.jobs.lock:  # no tier writes it any more: what was kept for one goes
            kept = list(job.kept)
            job.kept.clear()
        self.ramcache.let_go(kept)

    def release_ram(self, job: Job) -> None:
        """Unpin ``job``'s chunks in the RAM arena (once): a local durable tier holds it, or it settled.

        RAM holds a version only until its first durable tier has it (docs/design.md section 3).
        A slower tier (S3) writes it from RAM from the start, in parallel with the disk; the
        chunks it has not read yet stay in the arena after this, but only as cache that a save
        needing the room drops, each until that tier is done with it (:meth:`chunk_read`). A
        chunk gone from RAM is read back from the disk (see :meth:`TierWriter._read_back`): the
        version stays open (:meth:`Leases.open`) until it settles, so no eviction drops that
        copy meanwhile. So a slow S3 never keeps ``save()`` waiting for room while the disk
        keeps up, nor waits for the disk itself.
        """
        with self.jobs.lock:
            if job.ram_released:
                return
            job.ram_released = True
            keys = list(job.chunk_keys)
            slower = [n for n in job.pending if n not in job.committed]
            for key in set(keys):
                readers = {n for n in slower if key not in job.read_by.get(n, ())}
                if readers:
                    job.kept[key] = readers
            job.read_by.clear()
            kept = list(job.kept)
        self.ramcache.unpin(keys, keep=kept)

    def chunk_read(self, job: Job, tier: str, key: str) -> None:
        """Tier ``tier`` is done reading chunk ``key`` of ``job`` (written, or found there): RAM may let it go."""
        with self.jobs.lock:
            if not job.ram_released:
                job.read_by.setdefault(tier, set()).add(key)
                return
            readers = job.kept.get(key)
            if readers is None or tier not in readers:
                return
            readers.discard(tier)
            if readers:
                return
            del job.kept[key]
        self.ramcache.let_go([key])

    # ------------------------------------------------------------------ queries

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers ``version_id`` is still being written to by this process, or waits for (empty if none)."""
        job = self.jobs.get(version_id)
        with self.jobs.lock:
            writing = frozenset(job.pending) if job is not None else frozenset()
        return writing | self.catchup.waiting(version_id)

    def wait_published(self) -> None:
        """Block until every staged version's manifest is in the catalog (hashing is quick)."""
        if not self._closed:
            with self._lanes_lock:
                lanes = list(self._hash_lanes.values())
            for lane in lanes:
                lane.submit(lambda: None).result()

    def pending_jobs(self) -> list[str]:
        """Ids of versions still being written."""
        return self.jobs.ids()

    def wait_job(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until the pipeline is done with ``version_id`` (whatever the outcome).

        Returns:
            Whether it is done (``False`` only if ``timeout`` passed first).
        """
        return self.jobs.wait(version_id, timeout)

    # ------------------------------------------------------------------ tiers coming back

    def _start_catch_up(self) -> None:
        """On this process's first save, catch up every remote tier that lacks a branch head or tag.

        A tier that was down when an earlier process saved (or that process died before its
        uploads) is missing the newest versions; saving resumes, so their upload resumes too.
        Read-only processes never save, so they never write.
        """
        with self.jobs.lock:
            if self._saved:
                return
            self._saved = True
        for name in self.repo.durable:
            if self.health.available(name):
                self.catchup.request(name)  # remote tiers only

    # ------------------------------------------------------------------ errors and shutdown

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted version has finished on every tier that answers.

        A version waiting for a remote tier that is down (see :mod:`tiercache.pipeline.catchup`)
        is not waited for, since an outage may last hours: it is durable elsewhere, its level
        resolves when the tier is caught up, and a warning names it. One waiting for a tier that
        is up again (its catch-up under way) is waited for.

        Versions lost meanwhile are in the ledger: the front reports them.

        Args:
            timeout: Seconds to wait at most, or ``None`` to wait as long as it takes.

        Raises:
            TimeoutError: If versions are still pending after ``timeout`` (the message names them
                and the tiers they wait for).
        """
        self.wait_settled(timeout)
        for name, versions in self.catchup.waiting_for_down_tiers().items():
            outage = self.health.outage(name)
            since = f", unavailable since {outage.clock} ({outage.reason})" if outage is not None else ""
            log.warning("flush: %d version(s) wait for %s%s: %s; they are on the other tiers, and their %r level "
                        "resolves when %s answers again", len(versions), name, since,
                        ", ".join(f"{w.version} (step {w.step})" for w in versions), TIER_LEVEL[name], name)

    def wait_settled(self, timeout: float | None = None) -> None:
        """Wait for every version in flight and for catch-up on tiers that are up (see :meth:`flush`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        while True:
            jobs = self.jobs.snapshot()
            if not jobs:
                break
            for job in jobs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self.wait_job(job.version_id, left)
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                break
        shown: list[str] = []
        if timed_out:
            with self.jobs.lock:
                shown = [f"{j.version_id} (step {j.step}, waiting for {'/'.join(sorted(j.pending)) or 'settling'})"
                         for j in self.jobs.snapshot()]
        if not shown:
            for w in self.catchup.wait_for_up_tiers(deadline):
                tiers = "/".join(sorted(self.catchup.waiting(w.version)))
                shown.append(f"{w.version} (step {w.step}, waiting for {tiers} to be caught up)")
        if shown:
            more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
            raise TimeoutError(f"flush: {len(shown)} version(s) still pending after {timeout:g}s: "
                               f"{', '.join(shown[:4])}{more}")

    def close(self) -> None:
        """Finish pending writes and stop the threads (the front reports the versions lost).

        The caller makes sure no ``stage()`` runs concurrently (the facade holds its save lock):
        every version staged before is written or settled before the writers stop. Versions
        still waiting for a remote tier that is down fail that level, with the outage named
        (they are durable elsewhere; see :meth:`flush`), and a warning lists them.
        """
        if self._closed:
            return
        self.wait_settled()
        self._closed = True
        self.catchup.close()
        with self._lanes_lock:
            writers = list(self._writers.values())
        for writer in writers:
            writer.close()
        self.finisher.shutdown()
        with self._lanes_lock:
            lanes = list(self._hash_lanes.values())
        for lane in lanes:
            lane.shutdown()
        self.ramcache.close()
        self.skips.flush()
