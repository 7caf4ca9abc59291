"""How the engine consults the policy and carries out its decisions.

:class:`Placement` builds the :class:`~tiercache.policy.base.PolicyContext` snapshot the policy
decides on (tiers with their measured latency and bandwidth, availability, queues; codecs; every
version with where it lives), asks where a version goes when it is staged and again right before
each tier writes it, takes a version off a tier the policy skips (coalescing a backlog: the skip
settles once the version is durable elsewhere), makes room on a full tier by dropping what the
policy names (through the storage layer's eviction rules), and frees the RAM arena when the
policy answers ``on_full="evict"``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from tiercache import codecs
from tiercache.dtypes import float_share
from tiercache.errors import SkippedError, TierCacheError
from tiercache.handle import TIER_LEVEL
from tiercache.pipeline.job import Job, JobTable
from tiercache.policy.base import CodecView, Policy, PolicyContext, TierPlan, TierStats, VersionView
from tiercache.tiers.base import Tier

if TYPE_CHECKING:
    from collections.abc import Callable

    from tiercache.pipeline.ramcache import RamCache
    from tiercache.pipeline.skips import SkipLog
    from tiercache.policy.meter import ThroughputMeter
    from tiercache.repo import Repo

log = logging.getLogger("tiercache.pipeline.placement")

#: More than a version's manifest takes on a tier, with 1 KiB per tensor on top (checked before
#: its size is known, see make_room).
_MANIFEST_BOUND = 4 << 20


class Placement:
    """The policy-facing part of the engine (see the module docstring).

    Args:
        repo: The storage layer (the tiers, their health, the catalog, evictions).
        jobs: The versions in flight.
        ramcache: The RAM tier (its stats for the policy).
        meter: The throughput meter (rates and codec figures for the policy).
        skips: Where the policy's skips are logged.
        policy: The policy.
        settle: Settles a version nothing is pending for any more (the engine's).
        drain: Has catch-up copy about this many bytes of a full local tier's sole copies onward.
    """

    def __init__(self, repo: Repo, jobs: JobTable, ramcache: RamCache, meter: ThroughputMeter, skips: SkipLog,
                 policy: Policy, *, settle: Callable[[Job], None], drain: Callable[[str, int], None]) -> None:
        self._repo = repo
        self._health = repo.health
        self._jobs = jobs
        self._ramcache = ramcache
        self._meter = meter
        self._skips = skips
        self._settle = settle
        self._drain = drain
        self.policy = policy
        self._views_cache: dict[str, tuple[tuple[str, ...], VersionView]] = {}
        self.last_remote: float | None = None
        # Remote tiers count for residency only once listed: a decision never waits on a bucket.
        self._remote = frozenset(n for n in repo.durable if TIER_LEVEL.get(n) == "remote")
        # A multi-rank version is never skipped on the first durable tier (see :meth:`must_write`).
        self._anchor = next(iter(repo.durable), None)
        # Tiers full of versions no other durable tier holds (warned about once, see tier_full).
        self._full: set[str] = set()

    # ------------------------------------------------------------------ what the policy sees

    def context(self) -> PolicyContext:
        """A snapshot of what the policy may look at."""
        tiers = self._repo.durable
        with self._jobs.lock:
            pending: dict[str, list[str]] = {n: [] for n in tiers}
            backlog: dict[str, int] = {n: 0 for n in tiers}
            jobs = self._jobs.snapshot()
            job_pending = {j.version_id: frozenset(j.pending) for j in jobs}
            for job in jobs:
                for n in job.pending:
                    pending[n].append(job.version_id)
                    backlog[n] += job.nbytes
        ram = self._ramcache
        stats = {"ram": TierStats("ram", False, ram.capacity, ram.arena.used_bytes if ram.arena else 0,
                                  self._meter.rate("ram", "read"), self._meter.rate("ram", "write"))}
        for n, t in tiers.items():
            # Only a tier with a budget is asked for its usage: no decision needs it otherwise, and
            # counting a bucket that has no budget could mean listing it.
            budget, used = self._usage(t)
            model = self._meter.model(n, "write")
            outage = self._health.outage(n)
            stats[n] = TierStats(
                n, True, budget, used, self._meter.rate(n, "read"), model.bps if model else None,
                len(pending[n]), backlog[n], remote=TIER_LEVEL.get(n) == "remote",
                write_latency_s=model.latency_s if model else None,
                available=outage is None, unavailable=outage.reason if outage else "",
            )
        seen = {name: self._meter.codec_stats(name) for name in codecs.codec_names()}
        codec_views = {name: CodecView(name, c.encode_bps, c.decode_bps, c.ratio)
                       for name, c in seen.items() if c is not None}
        since = time.time() - self.last_remote if self.last_remote is not None else None
        return PolicyContext(now=time.time(), tiers=stats, codecs=codec_views,
                             versions=self._version_views(jobs, job_pending),
                             pending={k: tuple(v) for k, v in pending.items()}, seconds_since_remote=since)

    @staticmethod
    def _usage(tier: Tier) -> tuple[int | None, int]:
        """``tier``'s budget (see :meth:`Tier.budget`) and bytes used, or ``(capacity, 0)`` if it cannot tell now.

        A disk whose root is gone fails its next write and is marked down then; a decision
        about another tier must not fail meanwhile.
        """
        try:
            budget = tier.budget()
            return budget, tier.used_bytes() if budget is not None else 0
        except TierCacheError:
            return tier.capacity, 0

    def _version_views(self, jobs: list[Job], job_pending: dict[str, frozenset[str]]) -> tuple[VersionView, ...]:
        """Every known version as the policy sees it, oldest first, staged ones included."""
        cat = self._repo.catalog
        pinned = {r.version for r in cat.refs().values()}
        by_job = {j.version_id: j for j in jobs}
        views: dict[str, VersionView] = {}
        # A settled version's view is reused while its residency (the catalog hands out the same
        # tuple until it changes), pending tiers and pin stay the same: most versions are settled,
        # so a decision costs a lookup per known version, not a rebuild of every view.
        known = self._views_cache
        fresh: dict[str, tuple[tuple[str, ...], VersionView]] = {}
        # Multi-rank versions as their group manifests: reading the other ranks' parts to place a
        # version would cost every rank a read of every part per save, from S3 too (docs/design.md
        # section 7: no rank parses another rank's tables to save a version).
        for v in cat.summaries():  # the index's lines: no manifest is read to place a version
            job = by_job.get(v.id)
            resid = cat.residency(v, self._remote)
            pending = job_pending.get(v.id, frozenset())
            # The job knows when save() was called; the manifest only when hashing finished.
            created = job.created_at if job is not None else v.created_at.timestamp()
            hit = known.get(v.id)
            if (hit is not None and hit[0] is resid and hit[1].pending == pending
                    and hit[1].pinned == (v.id in pinned) and hit[1].created_at == created):
                view = hit[1]
            else:
                share = hit[1].float_fraction if hit is not None else float_share(list(v.dtypes))
                view = VersionView(
                    id=v.id, branch=v.branch, step=v.step, nbytes=v.nbytes, created_at=created,
                    tiers=frozenset(resid), pending=pending, pinned=v.id in pinned, meta=v.meta,
                    float_fraction=share,
                )
            fresh[v.id] = (resid, view)
            views[v.id] = view
        self._views_cache = fresh
        for job in jobs:  # still hashing: not in the catalog yet
            if job.version_id not in views:
                views[job.version_id] = dataclasses.replace(job.view(), pending=job_pending[job.version_id])
        return tuple(views[k] for k in sorted(views))

    def view(self, job: Job) -> VersionView:
        """The policy's view of one job: where it lives now, what it waits for, whether it is pinned."""
        cat = self._repo.catalog
        tiers = frozenset(cat.residency(job.manifest, self._remote)) if job.manifest is not None else frozenset()
        pinned = job.version_id in {r.version for r in cat.refs().values()}
        with self._jobs.lock:
            return dataclasses.replace(job.view(tiers), pinned=pinned)

    # ------------------------------------------------------------------ decisions

    def must_write(self, job: Job, tier: str) -> bool:
        """Whether ``job`` goes to ``tier`` whatever the policy says: a multi-rank version's first durable tier.

        Each rank's policy decides on its own measurements and queue, and a tier a version skips
        on one rank fails for the whole group, with no fallback (the group settles tier by tier).
        Two ranks skipping different tiers (one coalescing the disk, the other S3) would leave
        the version on none; so no rank skips the first durable tier (the disk when there is one)
        for a group version, and every group version is durable there on every node.
        """
        return job.committer is not None and tier == self._anchor

    def place(self, job: Job) -> list[str]:
        """Ask where a just-staged version goes; record the skips; return the tiers it is queued for."""
        tiers = self._repo.durable
        placement = self.policy.place(self.view(job), self.context())
        named = [p.tier for p in placement.plans if p.tier in tiers]
        targets = [n for n in [*named, *(n for n in tiers if n not in named)]
                   if not placement.plan_for(n).skip or self.must_write(job, n)]
        with self._jobs.lock:
            job.order = tuple(named + [n for n in tiers if n not in named])
            for name in tiers:
                if name not in targets:
                    job.skipped[name] = placement.plan_for(name).reason or "policy decision"
                    if not self._health.available(name):
                        job.skipped_down.add(name)
                    if job.committer is not None:  # the group waits for this level now (no fallback)
                        skip_level(job, name, job.skipped[name])
            job.pending = set(targets)  # before coalescing, so this job counts as the newest pending one
            skipped = [(n, job.skipped[n]) for n in tiers if n not in targets]
        for name, why in skipped:
            self._skips.skipped(name, job.version_id, why)
        for name in tiers:
            # A tier the policy bypassed for being full: its versions have no other copy (or
            # eviction would have made room), so catch-up drains the oldest of them onward.
            if name not in targets and name not in self._remote:
                cap, used = self._usage(tiers[name])
                if cap is not None and used + job.nbytes > cap:
                    self.tier_full(name, used + job.nbytes - cap)
        self.coalesce(job)
        return targets

    def plan(self, job: Job, tier: str) -> TierPlan:
        """Ask again, right before ``tier`` writes ``job``, what to do there."""
        plan = self.policy.place(self.view(job), self.context()).plan_for(tier)
        return TierPlan(tier) if plan.skip and self.must_write(job, tier) else plan

    def coalesce(self, newest: Job) -> None:
        """Ask the policy again about every queued version now that ``newest`` is pending.

        Versions the policy now skips for a tier are taken off it at once, so their arena regions
        are released sooner rather than when that tier's writer reaches them (a slow tier would
        otherwise fill the arena with versions it will never write). A tier's oldest pending
        version is the one its writer holds (or takes next), so it is never touched here; nor is
        ``newest``, whose queue entries are not made yet.
        """
        ctx = self.context()
        for name in self._repo.durable:
            with self._jobs.lock:
                queued = [j for j in self._jobs.snapshot() if name in j.pending and j is not newest][1:]
            for job in queued:
                if self.must_write(job, name):
                    continue
                plan = self.policy.place(self.view(job), ctx).plan_for(name)
                if plan.skip:
                    self.skip_tier(name, job, plan.reason or "policy decision", unless_oldest=True)

    def skip_tier(self, name: str, job: Job, reason: str, *, unless_oldest: bool = False,
                  writing: bool = False) -> None:
        """Take ``job`` off tier ``name`` without writing it there.

        The level is settled (with :class:`SkippedError`) only once the version is durable on
        another tier; if it never is, the engine writes it to this tier after all. A version a
        writer has taken is left alone (only that writer may skip it, with ``writing``).

        Args:
            name: The tier.
            job: The version.
            reason: Why (from the policy), for the error message.
            unless_oldest: Leave it alone if it is (now) the tier's oldest pending version, which
                its writer takes next (the oldest pending version of a tier is always written).
            writing: The tier's writer skips the version it took.
        """
        jobs = self._jobs
        with jobs.lock:
            # Check and claim in one critical section: the tier's writer checks the same set. A
            # fallback (forced) is never skipped again: it is where the version goes after all.
            if name not in job.pending or name in job.forced or (name in job.writing) != writing:
                return
            if unless_oldest and next(j for j in jobs.snapshot() if name in j.pending) is job:
                return
            job.pending.discard(name)
            job.writing.discard(name)
            job.skipped[name] = reason
            if not self._health.available(name):
                job.skipped_down.add(name)
            finished = not job.pending
        self._skips.skipped(name, job.version_id, reason)
        if job.committer is not None:
            # The group settles a multi-rank version tier by tier, and waits for each rank's level
            # of this tier now; there is no fallback for it anyway.
            skip_level(job, name, reason)
        if finished:
            self._settle(job)

    def make_room(self, name: str, job: Job) -> bool:
        """Evict what the policy names from tier ``name`` until ``job`` fits; False if it cannot.

        The storage layer refuses to drop a version's last durable copy unless the policy follows
        a retention the user set (then that version is pruned, and one WARNING says how many, by
        which rule). When the tier is full of versions no other durable tier holds, ``job``
        skips it, catch-up copies the oldest of them onward, and one WARNING says so (see
        :meth:`tier_full`).
        """
        tier = self._repo.durable[name]
        budget = tier.budget()
        if budget is None:  # no capacity, and not on a filesystem that may fill
            return True
        # Room for every chunk of it, stored whole, and a generous manifest: no need to wait for
        # its hashes (a disk writes chunks before they are hashed, see TierWriter).
        whole = (sum(c.nbytes + codecs.HEADER_BYTES for c in job.layout.chunks) + _MANIFEST_BOUND
                 + 1024 * len(job.flat.metas))
        if tier.used_bytes() + whole <= budget:
            self.room_back(name)
            return True
        # Only chunks the tier lacks need room (dedup), so wait for the ids; hashing is quick.
        manifest = job.published.result()
        have = self._repo.catalog.chunks_on(name)
        new = {c.id: c.nbytes for c in manifest.chunks if c.id not in have}
        # Raw size plus header: an upper bound, as encoding only ever stores a chunk smaller.
        need = sum(n + codecs.HEADER_BYTES for n in new.values()) + len(manifest.to_json())
        rule = getattr(self.policy, "retention_rule", None)
        pruned: list[str] = []
        try:
            # The budget is asked again each round: a full filesystem gains what eviction frees.
            while tier.used_bytes() + need > (budget := tier.budget() or 0):
                dropped = [vid for vid in self.policy.evict(name, self.context())
                           if self._repo.evict(vid, name, by="policy", rule=rule) is not None]
                pruned += [vid for vid in dropped if not self._repo.committed_on(vid)]
                if not dropped:
                    self.tier_full(name, tier.used_bytes() + need - budget)
                    return False
        finally:
            if pruned:
                log.warning("%d version(s) pruned from %s by %s, their last durable copy: %s", len(pruned), name,
                            rule, ", ".join(pruned))
        self.room_back(name)
        return True

    @property
    def full(self) -> frozenset[str]:
        """Tiers full of versions no other durable tier holds now (see :meth:`tier_full`)."""
        return frozenset(self._full)

    def tier_full(self, name: str, short: int) -> None:
        """Tier ``name`` lacks ``short`` bytes and holds nothing it may drop: drain it onward.

        Catch-up copies the oldest versions only ``name`` holds to the remote tier until about
        ``short`` bytes of them have another copy (capacity eviction may then drop them). One
        WARNING per episode, until :meth:`room_back`.
        """
        with self._jobs.lock:
            first = name not in self._full
            self._full.add(name)
        if first:
            remotes = [n for n in self._repo.durable if n in self._remote]
            onward = (f"new versions skip it until catch-up has copied the oldest of them to {'/'.join(remotes)}"
                      if remotes else "new versions skip it (no other durable tier to copy them to): free room, "
                      "raise its capacity, or set a retention")
            tier = self._repo.durable[name]
            budget, _used = self._usage(tier)
            limit = (f"capacity {tier.capacity} bytes" if tier.capacity is not None and tier.capacity == budget
                     else f"its filesystem has room for {budget or 0} bytes of it")
            log.warning("%s is full of versions no other durable tier holds (%s): %s", name, limit, onward)
        self._drain(name, short)

    def room_back(self, name: str) -> None:
        """Tier ``name`` took a version again after :meth:`tier_full` (said once, at INFO)."""
        with self._jobs.lock:
            if name not in self._full:
                return
            self._full.discard(name)
        log.info("%s has room again: new versions are written to it", name)

    def cancel_oldest_pending(self) -> bool:
        """Drop the oldest staged version no writer has started on (``on_full="evict"``).

        Its durability levels fail with :class:`SkippedError` and its arena regions are freed.
        A version some writer already holds is never dropped half-way, so this may find nothing.
        """
        jobs = self._jobs
        with jobs.lock:
            snapshot = jobs.snapshot()
            heads = {n: next((j for j in snapshot if n in j.pending), None) for n in self._repo.durable}
            victim = next(
                (j for j in snapshot if j.published.done() and j.pending
                 and j.committer is None and all(heads[n] is not j for n in j.pending)),
                None,
            )
            if victim is None:
                return False
            victim.dropped = True
        for name in list(victim.pending):
            self.skip_tier(name, victim, "dropped to make room in the RAM arena (on_full=evict)", unless_oldest=True)
        return not victim.pending


def skip_level(job: Job, name: str, reason: str) -> None:
    """Fail tier ``name``'s level of ``job`` with :class:`SkippedError` (if it has one and is unsettled)."""
    lvl = TIER_LEVEL.get(name)
    if lvl and not job.futures[lvl].done():
        job.futures[lvl].set_exception(SkippedError(f"version {job.version_id} skipped for {name}: {reason}"))
