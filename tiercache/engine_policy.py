"""How the engine consults the policy and carries out its decisions.

A mixin of :class:`tiercache.engine.Engine`, split out because it is its own concept: building
the :class:`~tiercache.policy.base.PolicyContext` snapshot the policy decides on, settling
versions the policy skips for a tier (coalescing a backlog), dropping a full tier's versions the
policy names (after re-checking that none is a branch head, a tag, the newest of its branch there,
still being written, or holding a chunk another version there needs), and making room in the RAM
arena when the policy answers ``on_full="evict"``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiercache import codecs
from tiercache.catalog import Catalog
from tiercache.errors import SkippedError
from tiercache.handle import TIER_LEVEL
from tiercache.health import TierHealth
from tiercache.manifest import Version
from tiercache.names import chunk_key, version_key
from tiercache.policy.base import CodecView, Policy, PolicyContext, TierStats, VersionView
from tiercache.policy.meter import ThroughputMeter
from tiercache.tiers.base import Tier
from tiercache.tiers.ram import Arena

if TYPE_CHECKING:
    from tiercache.engine import _Job

log = logging.getLogger("tiercache.engine")

#: Dtypes whose bytes byte-grouped compression is made for.
FLOAT_DTYPE_NAMES = {"float64", "float32", "float16", "bfloat16"}

def _float_share(version: Version) -> float:
    """Share of a version's bytes that are floating-point tensors.

    Manifests never change, so the engine keeps this in the version's cached policy view rather
    than summing its tensor table again.
    """
    floats = sum(t.nbytes for t in version.tensors if t.dtype in FLOAT_DTYPE_NAMES)
    return floats / version.nbytes if version.nbytes else 0.0


class PolicyBridge:
    """The policy-facing half of the engine (see the module docstring)."""

    # Provided by Engine.
    tiers: dict[str, Tier]
    arena: Arena | None
    policy: Policy
    meter: ThroughputMeter
    catalog: Catalog
    _lock: threading.RLock
    _jobs: dict[str, _Job]
    _arena_capacity: int | None
    _last_remote: float | None
    _views_cache: dict[str, tuple[tuple[str, ...], VersionView]]
    _settle: Callable[[_Job], None]
    health: TierHealth

    def context(self) -> PolicyContext:
        """A snapshot of what the policy may look at."""
        with self._lock:
            pending: dict[str, list[str]] = {n: [] for n in self.tiers}
            backlog: dict[str, int] = {n: 0 for n in self.tiers}
            jobs = list(self._jobs.values())
            job_pending = {j.version_id: frozenset(j.pending) for j in jobs}
            for job in jobs:
                for n in job.pending:
                    pending[n].append(job.version_id)
                    backlog[n] += job.nbytes
        arena = self.arena
        stats = {"ram": TierStats("ram", False, arena.capacity if arena else self._arena_capacity,
                                  arena.used_bytes if arena else 0,
                                  self.meter.rate("ram", "read"), self.meter.rate("ram", "write"))}
        for n, t in self.tiers.items():
            # Only a tier with a budget is asked for its usage: no decision needs it otherwise, and
            # counting a bucket that has no budget could mean listing it.
            used = t.used_bytes() if t.capacity is not None else 0
            model = self.meter.model(n, "write")
            outage = self.health.outage(n)
            stats[n] = TierStats(
                n, True, t.capacity, used, self.meter.rate(n, "read"), model.bps if model else None,
                len(pending[n]), backlog[n], remote=TIER_LEVEL.get(n) == "remote",
                write_latency_s=model.latency_s if model else None,
                available=outage is None, unavailable=outage.reason if outage else "",
            )
        seen = {name: self.meter.codec_stats(name) for name in codecs.codec_names()}
        codec_views = {name: CodecView(name, c.encode_bps, c.decode_bps, c.ratio)
                       for name, c in seen.items() if c is not None}
        since = time.time() - self._last_remote if self._last_remote is not None else None
        return PolicyContext(now=time.time(), tiers=stats, codecs=codec_views,
                             versions=self._version_views(jobs, job_pending),
                             pending={k: tuple(v) for k, v in pending.items()}, seconds_since_remote=since)

    def _version_views(self, jobs: list[_Job], job_pending: dict[str, frozenset[str]]) -> tuple[VersionView, ...]:
        """Every known version as the policy sees it, oldest first, staged ones included."""
        pinned = {r.version for r in self.catalog.refs().values()}
        by_job = {j.version_id: j for j in jobs}
        views: dict[str, VersionView] = {}
        # A settled version's view is reused while its residency (the catalog hands out the same
        # tuple until it changes), pending tiers and pin stay the same: most versions are settled,
        # so a decision costs a lookup per known version, not a rebuild of every view.
        known = self._views_cache
        fresh: dict[str, tuple[tuple[str, ...], VersionView]] = {}
        for v in self.catalog.all():
            job = by_job.get(v.id)
            resid = self.catalog.residency(v)
            pending = job_pending.get(v.id, frozenset())
            # The job knows when save() was called; the manifest only when hashing finished.
            created = job.created_at if job is not None else v.created_at.timestamp()
            hit = known.get(v.id)
            if (hit is not None and hit[0] is resid and hit[1].pending == pending
                    and hit[1].pinned == (v.id in pinned) and hit[1].created_at == created):
                view = hit[1]
            else:
                view = VersionView(
                    id=v.id, branch=v.branch, step=v.step, nbytes=v.nbytes, created_at=created,
                    tiers=frozenset(resid), pending=pending, pinned=v.id in pinned, meta=v.meta,
                    float_fraction=hit[1].float_fraction if hit is not None else _float_share(v),
                )
            fresh[v.id] = (resid, view)
            views[v.id] = view
        self._views_cache = fresh
        for job in jobs:  # still hashing: not in the catalog yet
            if job.version_id not in views:
                views[job.version_id] = dataclasses.replace(job.view(), pending=job_pending[job.version_id])
        return tuple(views[k] for k in sorted(views))

    def _view(self, job: _Job) -> VersionView:
        """The policy's view of one job: where it lives now, what it waits for, whether it is pinned."""
        tiers = frozenset(self.catalog.residency(job.manifest)) if job.manifest is not None else frozenset()
        pinned = job.version_id in {r.version for r in self.catalog.refs().values()}
        with self._lock:
            return dataclasses.replace(job.view(tiers), pinned=pinned, skipped=frozenset(job.skipped))

    def _coalesce(self, newest: _Job) -> None:
        """Ask the policy again about every queued version now that ``newest`` is pending.

        Versions the policy now skips for a tier are settled at once, so their arena regions are
        released now rather than when that tier's writer reaches them (a slow tier would
        otherwise fill the arena with versions it will never write). A tier's oldest pending
        version is the one its writer holds (or takes next), so it is never touched here; nor is
        ``newest``, whose queue entries are not made yet.
        """
        ctx = self.context()
        for name in self.tiers:
            with self._lock:
                queued = [j for j in self._jobs.values() if name in j.pending and j is not newest][1:]
            for job in queued:
                plan = self.policy.place(self._view(job), ctx).plan_for(name)
                if plan.skip:
                    self._skip_tier(name, job, plan.reason or "policy decision", unless_oldest=True)

    def _skip_tier(self, name: str, job: _Job, reason: str, *, unless_oldest: bool = False) -> None:
        """Take ``job`` off tier ``name`` without writing it there.

        The level is settled (with :class:`SkippedError`) only once the version is durable on
        another tier; if it never is, the engine writes it to this tier after all.

        Args:
            name: The tier.
            job: The version.
            reason: Why (from the policy), for the error message.
            unless_oldest: Leave it alone if it is (now) the tier's oldest pending version, which
                its writer may already be writing.
        """
        with self._lock:
            # Check and claim in one critical section: the tier's writer checks the same set. A
            # fallback (forced) is never skipped again: it is where the version goes after all.
            if name not in job.pending or name in job.forced:
                return
            if unless_oldest and next(j for j in self._jobs.values() if name in j.pending) is job:
                return
            job.pending.discard(name)
            job.skipped[name] = reason
            finished = not job.pending
        log.info("version %s skipped for %s: %s", job.version_id, name, reason)
        if job.committer is not None:
            # The group settles a multi-rank version tier by tier, and waits for each rank's level
            # of this tier now; there is no fallback for it anyway.
            self._skip_level(job, name, reason)
        if finished:
            self._settle(job)

    @staticmethod
    def _skip_level(job: _Job, name: str, reason: str) -> None:
        """Fail tier ``name``'s level of ``job`` with :class:`SkippedError` (if it has one and is unsettled)."""
        lvl = TIER_LEVEL.get(name)
        if lvl and not job.futures[lvl].done():
            job.futures[lvl].set_exception(SkippedError(f"version {job.version_id} skipped for {name}: {reason}"))

    def _make_room(self, name: str, job: _Job) -> bool:
        """Evict what the policy names from tier ``name`` until ``job`` fits; False if it cannot."""
        tier = self.tiers[name]
        if tier.capacity is None:
            return True
        # Only chunks the tier lacks need room (dedup), so wait for the ids; hashing is quick.
        manifest = job.published.result()
        have = self.catalog.chunks_on(name)
        new = {c.id: c.nbytes for c in manifest.chunks if c.id not in have}
        # Raw size plus header: an upper bound, as encoding only ever stores a chunk smaller.
        need = sum(n + codecs.HEADER_BYTES for n in new.values()) + len(manifest.to_json())
        while tier.used_bytes() + need > tier.capacity:
            dropped = [vid for vid in self.policy.evict(name, self.context()) if self._drop_version(name, vid)]
            if not dropped:
                return False
        return True

    def _drop_version(self, name: str, vid: str) -> bool:
        """Drop tier ``name``'s copy of version ``vid`` if that is safe; return whether it was dropped.

        The policy's answer is checked again here: never a branch head or a tag, never the newest
        version of a branch on this tier (the tier's own ref names it), never a version still
        being written, and never a chunk that a version staying on this tier, or one pending for
        it, still names. Manifest first, then chunks, as GC does.
        """
        with self._lock:
            if vid in self._jobs:
                return False
            # Chunks of versions still to be written here, as far as they are hashed (a later
            # one's writer sees what is gone from the catalog and writes it again).
            keep = {f.result() for j in self._jobs.values() if name in j.pending
                    for f in j.ready if f.done() and f.exception() is None}
        if not self.catalog.manifest_on(name, vid) or vid in {r.version for r in self.catalog.refs().values()}:
            return False
        version = self.catalog.get(vid)
        staying = [v for v in self.catalog.all() if v.id != vid and self.catalog.manifest_on(name, v.id)]
        if not any(v.branch == version.branch and v.id > vid for v in staying):
            return False
        keep |= {c.id for v in staying for c in v.chunks}
        tier = self.tiers[name]
        tier.delete(version_key(vid))
        self.catalog.mark_on(name, vid, present=False)
        gone = {c.id for c in version.chunks} - keep
        for cid in gone:
            tier.delete(chunk_key(cid))
        self.catalog.note_chunks(name, gone, present=False)
        log.info("evicted version %s from %s (%d chunks freed)", vid, name, len(gone))
        return True

    def _cancel_oldest_pending(self) -> bool:
        """Drop the oldest staged version no writer has started on (``on_full="evict"``).

        Its durability levels fail with :class:`SkippedError` and its arena regions are freed.
        A version some writer already holds is never dropped half-way, so this may find nothing.
        """
        with self._lock:
            jobs = list(self._jobs.values())
            heads = {n: next((j for j in jobs if n in j.pending), None) for n in self.tiers}
            victim = next(
                (j for j in jobs if j.published.done() and j.pending
                 and j.committer is None and all(heads[n] is not j for n in j.pending)),
                None,
            )
        if victim is None:
            return False
        victim.dropped = True
        for name in list(victim.pending):
            self._skip_tier(name, victim, "dropped to make room in the RAM arena (on_full=evict)", unless_oldest=True)
        return not victim.pending
