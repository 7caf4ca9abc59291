"""One writer per durable tier: takes versions in save order and writes each there.

For each version the writer asks the policy once more (a backlog seen now can turn into a skip
for this tier only), makes room on a tier with a budget, writes the chunks the tier lacks in
parallel as soon as each is hashed (leasing every chunk the version relies on there, so no
deletion takes one meanwhile), then has the storage layer commit it (chunk names, manifest, ref)
and settles that tier's level. On a tier that can, chunk payloads that changed last time are
written before their hash is known and named once it is (``early writes``), so the disk starts
while the state is still being copied.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tiercache import codecs
from tiercache.errors import (
    ConflictError,
    DeadlineExceededError,
    TierCacheError,
    TierFullError,
    TierUnavailableError,
)
from tiercache.failpoints import failpoint
from tiercache.handle import TIER_LEVEL
from tiercache.manifest import RefRecord
from tiercache.names import CHUNKS, chunk_key
from tiercache.pipeline.job import Job, JobTable
from tiercache.policy.base import COMMIT_REQUESTS, TierPlan
from tiercache.tiers.base import PendingWrite, Tier, early_writer
from tiercache.tiers.ram import Region

if TYPE_CHECKING:
    from tiercache.manifest import Version
    from tiercache.pipeline.placement import Placement
    from tiercache.pipeline.ramcache import RamCache
    from tiercache.policy.meter import ThroughputMeter
    from tiercache.repo import Repo
    from tiercache.saver import ObjectReader

log = logging.getLogger("tiercache.pipeline.writer")

#: Most chunks of one version written ahead of being named; each holds an open tmp file until
#: then, so this bounds the file descriptors a version holds.
EARLY_AHEAD = 64


class WriterOutcomes(Protocol):
    """What a tier's writer reports to the engine it writes for, and asks of it."""

    def final_manifest(self, job: Job) -> Version:
        """The manifest to commit (waits for the parent's outcome; see :meth:`Engine.final_manifest`)."""
        ...

    def early_hint(self, job: Job, tier: Tier, codec: str) -> list[bool]:
        """Per chunk: whether to write its payload before its hash is known."""
        ...

    def chunk_read(self, job: Job, tier: str, key: str) -> None:
        """Tier ``tier`` is done reading chunk ``key`` of ``job``: RAM may let it go."""
        ...

    def tier_done(self, name: str, job: Job) -> None:
        """``job`` is committed on tier ``name``."""
        ...

    def fail_tier(self, name: str, job: Job, err: BaseException, *, quiet: bool = False, group: bool = False) -> None:
        """Writing ``job`` to tier ``name`` failed with ``err``."""
        ...


@dataclass(frozen=True)
class WriterParts:
    """What the tier writers of one engine share (the engine makes it once)."""

    repo: Repo
    jobs: JobTable
    ramcache: RamCache
    meter: ThroughputMeter
    placement: Placement
    #: Names chunks written before their hash (these tasks wait for hashes: threads of their own).
    finisher: ThreadPoolExecutor
    read_object: ObjectReader


class TierWriter:
    """The writer thread of one durable tier, with its I/O threads.

    Args:
        parts: What it shares with the other writers of its engine.
        outcomes: Where it reports each version's outcome on its tier (the engine).
        name: The tier's name.
        tier: The tier.
        threads: I/O threads for chunk puts.
        nice: How much lower than training its threads run (see :func:`lower_thread_priority`).
    """

    def __init__(self, parts: WriterParts, outcomes: WriterOutcomes, name: str, tier: Tier, *, threads: int,
                 nice: int) -> None:
        self._parts = parts
        self._outcomes = outcomes
        self.name = name
        self.tier = tier
        self._early = early_writer(tier)  # once: the protocol check costs ~10 us, more than the flag
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._io = ThreadPoolExecutor(threads, thread_name_prefix=f"tiercache-{name}",
                                      initializer=lower_thread_priority, initargs=(nice,))
        self._thread = threading.Thread(target=self._run, args=(nice,), name=f"tiercache-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (versions are written in the order they are queued)."""
        self._queue.put(job)

    def close(self) -> None:
        """Finish what is queued, then stop the thread and the I/O threads."""
        self._queue.put(None)
        self._thread.join()
        self._io.shutdown()

    def _run(self, nice: int) -> None:
        lower_thread_priority(nice)
        while (job := self._queue.get()) is not None:
            self.write_or_fail(job)

    def write_or_fail(self, job: Job) -> None:
        """Write ``job`` here; any error fails this tier's level (see :meth:`Engine.fail_tier`)."""
        try:
            self._write(job)
        except BaseException as e:
            self._parts.repo.release(job.version_id, self.name)
            self._outcomes.fail_tier(self.name, job, e)

    # ------------------------------------------------------------------ one version

    def _write(self, job: Job) -> None:
        eng, name = self._parts, self.name
        with eng.jobs.lock:
            # One write per version and tier: the writer's queue and a fallback thread may both
            # hold it (a version taken off this tier while queued, then sent here after all).
            if name not in job.pending or name in job.writing:
                return  # coalesced away while queued, settled here already, or being written
            job.writing.add(name)  # from here on the policy cannot take it off this tier
            forced = name in job.forced
        outage = eng.repo.health.outage(name)
        if outage is not None and not forced:
            if job.committer is None:
                # Nothing was tried: as the policy's skip of a tier that is down (the version's
                # level may then wait for the tier's catch-up, see tiercache.pipeline.catchup).
                eng.placement.skip_tier(name, job, f"{name} unavailable ({outage.reason})", writing=True)
                return
            raise TierUnavailableError(f"{name} is unavailable since {outage.clock} ({outage.reason}); "
                                       "the version was not written there")
        plan = TierPlan(name) if forced else eng.placement.plan(job, name)
        if not plan.skip and not eng.placement.make_room(name, job):
            # Capacity eviction keeps a version no other durable tier holds (the keep rule).
            full = f"{name} is full and nothing on it may be evicted: no other durable tier holds its versions yet"
            if forced or job.committer is not None:  # (a multi-rank version has no fallback: a lost write)
                raise TierFullError(full)
            plan = TierPlan(name, skip=True, reason=full)
        if plan.skip:
            eng.placement.skip_tier(name, job, plan.reason or "policy decision", writing=True)
            return
        # A multi-rank version: write only the chunks the group gave this rank (waits for the group).
        mine = None
        if job.committer is not None:
            try:
                mine = job.committer.owned(name)
            except BaseException as e:  # the group failed the version: nothing was tried here
                eng.repo.release(job.version_id, name)
                self._outcomes.fail_tier(name, job, e, group=True)
                return
        written: set[str] = set()
        spans = self._put_chunks(job, plan.codec, mine, written)
        t_commit = time.perf_counter()
        if spans:
            # One observation per version: bytes over the time any put was in flight. Per-chunk
            # rates would read a shared link as its speed divided by the puts in parallel.
            eng.meter.record(name, "write", sum(n for n, _, _ in spans), _busy_seconds(spans))
        eng.repo.stored(name, written)
        if job.committer is not None:
            eng.repo.sync_chunks(name, written)  # before the group commits a manifest naming them
            verdict = job.committer.commit(name, job.published.result())
            # The next version goes on meanwhile (in a node agent: maybe another rank's part of
            # this one, which the group's verdict waits for).
            verdict.add_done_callback(lambda f: self._group_verdict(job, f))
            return
        manifest = self._outcomes.final_manifest(job)
        rec = RefRecord(kind="branch", name=job.branch, version=job.version_id, seq=job.seq)
        try:
            eng.repo.commit(name, manifest, rec, written=written, owner=job.version_id)
        except ConflictError as e:
            # Another writer moved the branch: the version stays stored but off the branch. Only
            # this level fails (the handle reports it, and the next save builds on the new head).
            log.warning("version %s not committed on %s: %s", job.version_id, name, e)
            self._outcomes.fail_tier(name, job, e, quiet=True)
            return
        # The commit is latency-bound (a manifest and a ref, each durable before the next): with
        # the bulk write above it lets the meter tell per-request latency from bandwidth.
        eng.meter.record(name, "write", len(manifest.to_json()), time.perf_counter() - t_commit,
                         requests=COMMIT_REQUESTS)
        self._outcomes.tier_done(name, job)

    def _group_verdict(self, job: Job, verdict: Future[None]) -> None:
        """The group committed (or failed) a multi-rank version on this tier: complete its level."""
        eng = self._parts
        eng.repo.release(job.version_id, self.name)
        err = verdict.exception()
        if err is None:
            self._outcomes.tier_done(self.name, job)
        else:
            self._outcomes.fail_tier(self.name, job, err, group=True)

    def _put_chunks(
        self, job: Job, codec: str, mine: Collection[str] | None, written: set[str]
    ) -> list[tuple[int, float, float]]:
        """Write the chunks of ``job`` this tier lacks, each as soon as it is hashed (or earlier).

        Every tier starts at once, from the RAM arena: a slower tier does not wait for a faster
        one to commit the version (see :meth:`_put_chunk`).
        """
        eng = self._parts
        futs: list[Future[tuple[int, float, float]]] = []
        hint = self._outcomes.early_hint(job, self.tier, codec)
        # Chunks written before they are hashed and not yet named: each holds an open tmp file.
        early: deque[Future[tuple[int, float, float]]] = deque()
        try:
            for i, ready in enumerate(job.ready):
                region = self._lend_region(job, i) if hint[i] and not ready.done() else None
                if region is not None:
                    payload = self._io.submit(self._write_payload, job, i, region)
                    named = eng.finisher.submit(self._finish_early, job, i, region, payload, written)
                    futs.append(named)
                    early.append(named)
                    while len(early) > EARLY_AHEAD or (early and early[0].done()):
                        futures_wait([early.popleft()])
                    continue
                cid = ready.result()  # raises the hashing error, failing this level
                if (mine is not None and cid not in mine) or not self._claim(job, cid, written):
                    self._outcomes.chunk_read(job, self.name, chunk_key(cid))  # nothing to read: RAM may let it go
                    continue
                futs.append(self._io.submit(self._put_chunk, job, cid, codec))
        except BaseException:
            futures_wait(futs)  # the early writes give their lent regions back and remove their tmp files
            raise
        return self._await_puts(job, futs)

    def _claim(self, job: Job, cid: str, written: set[str]) -> bool:
        """Lease chunk ``cid`` for ``job`` here and claim its write unless the tier has it or it is claimed.

        The version's chunk writes run in parallel, so the check and the claim are one step; the
        lease keeps a chunk found here from being deleted before the version is committed.
        """
        missing = self._parts.repo.claim(job.version_id, self.name, [cid])
        with self._parts.jobs.lock:
            if cid not in missing or cid in written:
                return False
            written.add(cid)
            return True

    def _await_puts(self, job: Job, futs: list[Future[tuple[int, float, float]]]) -> list[tuple[int, float, float]]:
        """Wait for a version's chunk puts, within the tier's per-version deadline (if it has one).

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
        limit = self.tier.deadline_s
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
                f"writing version {job.version_id} to {self.name} took longer than its deadline of {limit:g}s "
                f"({self.name}.deadline_s): the store is throttling or failing"
            ) from None

    # ------------------------------------------------------------------ chunk writes

    def _lend_region(self, job: Job, i: int) -> Region | None:
        """Wait until chunk ``i`` is copied; return its region, retained, if not yet hashed.

        The caller frees it once done reading: whoever else frees it meanwhile (the hasher for a
        duplicate, the RAM tier on release, a failed save) leaves the bytes in place until then.
        """
        arena = self._parts.ramcache.arena
        assert arena is not None
        job.copied[i].wait()
        with self._parts.jobs.lock:  # the hasher adopts the region (and clears job.regions[i]) under it
            region = job.regions[i]  # None once the hasher has adopted it (or the save failed)
            if region is None or job.copy_error is not None:
                return None
            arena.retain(region)
            return region

    def _write_payload(self, job: Job, i: int, region: Region) -> tuple[PendingWrite, float, float]:
        """Write chunk ``i``'s payload from its lent region to a tmp file, before it is hashed.

        Returns the pending object and the write's start and duration.
        """
        arena = self._parts.ramcache.arena
        assert arena is not None
        early = self._early
        assert early is not None, "Engine.early_hint writes early only to a tier that can"
        hdr = codecs.HEADER_BYTES
        n = job.layout.chunks[i].nbytes
        t0 = time.perf_counter()
        pending = early.begin_put(hdr + n, CHUNKS.rstrip("/"), sync_name=False)
        try:
            pending.write(hdr, arena.buffer(region)[hdr : hdr + n])
        except BaseException:
            pending.abort()
            raise
        return pending, t0, time.perf_counter() - t0

    def _finish_early(
        self, job: Job, i: int, region: Region, payload: Future[tuple[PendingWrite, float, float]], written: set[str],
    ) -> tuple[int, float, float]:
        """Name chunk ``i`` once hashed: write its header and commit it, then give its region back.

        Runs on the finisher threads while the writers go on with later payloads. Returns the
        bytes written and a span as long as the disk was busy with them (the waits for the
        payload and the hash left out). A chunk that proves to be stored already is dropped: its
        tmp file is removed.
        """
        ram = self._parts.ramcache
        assert ram.arena is not None
        hdr = codecs.HEADER_BYTES
        try:
            pending, t0, busy = payload.result()
            try:
                cid = job.ready[i].result()  # the hasher wrote the header into the region before this
                if not self._claim(job, cid, written):
                    return job.layout.chunks[i].nbytes, t0, t0 + busy
                t1 = time.perf_counter()
                pending.write(0, ram.arena.buffer(region)[:hdr])
                pending.commit(chunk_key(cid))
                busy += time.perf_counter() - t1
            finally:
                pending.abort()
            failpoint("engine.after_chunk_write")
            return hdr + job.layout.chunks[i].nbytes, t0, t0 + busy
        finally:
            ram.arena.free(region)  # the lent reference
            ram.notify()

    def _put_chunk(self, job: Job, cid: str, codec: str) -> tuple[int, float, float]:
        """Write one chunk object; return its stored size and the put's start and end times.

        From the RAM arena while it holds the chunk (pinned until a local tier commits the
        version, then kept until a save needs the room, see :meth:`Engine.release_ram`), else
        read back from a durable tier that holds it. Either way the arena may let it go after.
        """
        eng = self._parts
        key = chunk_key(cid)
        ram = eng.ramcache.ram
        assert ram is not None
        borrowed = False
        try:
            # Borrowed, not viewed: if the chunk is dropped while this put still reads (the arena
            # needed room, or a deadline passed), the region must not take the next save's
            # bytes, which the tier would then store under this chunk's name.
            with ram.borrow(key) as view:
                if view is not None:
                    borrowed = True
                    return self._put_object(key, view, codec)
            return self._put_object(key, self._read_back(job, cid), codec)
        finally:
            self._outcomes.chunk_read(job, self.name, key)
            if borrowed:  # a region dropped while borrowed went back only as the borrow ended
                eng.ramcache.notify()

    def _read_back(self, job: Job, cid: str) -> bytes:
        """Chunk ``cid`` of ``job`` as stored on the local tier that committed it (verified), else elsewhere.

        The version is open until it settles, so no eviction drops it from that tier meanwhile
        (see :meth:`Repo.evict`); a damaged copy there is read from another tier instead.
        """
        eng = self._parts
        manifest = job.published.result()
        nbytes = next(c.nbytes for c in manifest.chunks if c.id == cid)
        with eng.jobs.lock:
            source = next((n for n in job.order if n in job.committed and TIER_LEVEL.get(n) == "local"), None)
        if source is not None:
            try:
                return eng.repo.read_object(cid, nbytes, manifest.hash_algo, order=[source])[0]
            except TierCacheError as e:
                log.warning("reading chunk %s back from %s for %s failed (%s): reading it from another tier",
                            cid, source, self.name, e)
        return eng.read_object(cid, nbytes, manifest.hash_algo)[0]

    def _put_object(self, key: str, obj: memoryview | bytes, codec: str) -> tuple[int, float, float]:
        """Put the stored chunk object ``obj`` (header and payload) at ``key``, encoded with ``codec`` if raw."""
        data: memoryview | bytes = obj
        if codec != codecs.RAW and codecs.read_header(memoryview(obj)[: codecs.HEADER_BYTES]).codec == codecs.RAW:
            data = self._encode(memoryview(obj), codec)
        t0 = time.perf_counter()
        self.tier.put(key, data, sync_name=False)  # the commit syncs the names once per version
        t1 = time.perf_counter()
        failpoint("engine.after_chunk_write")
        return len(data), t0, t1

    def _encode(self, view: memoryview, codec: str) -> bytes:
        hdr = codecs.read_header(view[: codecs.HEADER_BYTES])
        t0 = time.perf_counter()
        payload = codecs.encode(codec, view[codecs.HEADER_BYTES :], itemsize=hdr.itemsize)
        self._parts.meter.record_codec(codec, hdr.raw_len, len(payload), time.perf_counter() - t0)
        if len(payload) >= hdr.raw_len:
            return bytes(view)  # incompressible: storing it raw is smaller and faster to read
        return bytes(codecs.chunk_object(payload, hdr.chunk_id, hdr.hash_algo, codec=codec, raw_len=hdr.raw_len,
                                         itemsize=hdr.itemsize))


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


__all__ = ["EARLY_AHEAD", "TierWriter", "lower_thread_priority"]
