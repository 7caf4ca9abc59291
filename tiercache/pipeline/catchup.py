"""Catching a remote tier up after an outage, and the levels that wait for it meanwhile.

While a remote tier (S3) is down, versions go on to the other tiers. A version that became
durable elsewhere but missed the remote tier because it was down (the policy skipped it there,
the writer refused it, or its write failed with an outage error) does not fail its ``remote``
level: the level *waits* here. When the tier answers again, catch-up copies onto it the newest
version of each branch and every tagged version it lacks (moving refs with the usual
compare-and-swap, so another writer's newer head is left alone); a waiting version it copies, or
finds there, reaches its level. A waiting version that catch-up will never copy fails with the
reason: a newer version of its branch superseded it (known once that newer version has settled,
since one that reaches no durable tier gives the branch back to its parent), its branch was
moved elsewhere, or its copy failed. ``close()`` fails what still waits, with the outage.

A local tier (the disk) is not caught up: what it lacks is on S3 already, and ``promote``
copies it when wanted; so a version that misses the disk fails its ``local`` level at once.

Catch-up also *drains* a local tier with a ``capacity`` that is full of versions no other durable
tier holds (capacity eviction keeps those, see :meth:`tiercache.repo.Repo.evict`): its next run
copies the oldest of them to the remote tier, about as many bytes as the tier lacks, so that
eviction may drop them there and room comes back (:meth:`CatchUp.drain`).

Catch-up runs on a thread per tier, when the tier comes back, on this process's first save (a
tier an earlier process could not reach lacks its newest versions), and when a version starts
waiting while the tier is up. Requests made while a run is under way start one more run after it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.errors import SkippedError, TierCacheError, TierUnavailableError, VersionNotFoundError
from tiercache.handle import TIER_LEVEL, LevelFuture
from tiercache.manifest import RefRecord, TierOutcome
from tiercache.pipeline.job import Job, JobTable
from tiercache.repo.health import is_outage

if TYPE_CHECKING:
    from tiercache.repo import Repo
    from tiercache.saver import ObjectReader

log = logging.getLogger("tiercache.pipeline.catchup")

#: Seconds between checks of a down tier while ``flush()`` waits for catch-up on the others
#: (the health probes do not notify; this only bounds how late a wait notices a new outage).
_RECHECK_S = 0.2


@dataclass(frozen=True)
class Waiting:
    """A version whose level for one remote tier waits for that tier's catch-up.

    Attributes:
        version: The version id.
        branch: Its branch.
        step: Its step.
        future: The level's future.
        cause: The error its own write to the tier failed with, if it failed (rather than was
            skipped or refused) when the tier went down.
    """

    version: str
    branch: str
    step: int
    future: LevelFuture
    cause: BaseException | None


class CatchUp:
    """The remote tiers' catch-up and the levels waiting for it (see the module docstring).

    Args:
        repo: The storage layer (its tiers' health, the catalog, the copies).
        jobs: The versions in flight (catch-up leaves each alone until the pipeline is done with it).
        read_object: Reads a verified chunk object from the best tier holding it.
    """

    def __init__(self, repo: Repo, jobs: JobTable, read_object: ObjectReader) -> None:
        self._repo = repo
        self._health = repo.health
        #: The versions in flight: one is never copied while the pipeline writes it.
        self._jobs = jobs
        self._read_object = read_object
        self._cv = threading.Condition()
        #: Per remote tier: the versions waiting for it, by id.
        self._waiting: dict[str, dict[str, Waiting]] = {
            n: {} for n in repo.durable if TIER_LEVEL.get(n) == "remote"
        }
        self._wanted: set[str] = set()
        self._running: set[str] = set()
        #: Per local tier to drain: about how many bytes of its sole copies to copy onward.
        self._drain: dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ which levels wait

    def defers(self, name: str, job: Job, err: BaseException) -> bool:
        """Whether a write of ``job`` to ``name`` that failed with ``err`` leaves the level to :meth:`settle_job`.

        An outage error on a tier catch-up covers may end in the version waiting for that tier
        rather than failing (decided once the version's other tiers are settled).
        """
        return name in self._waiting and job.committer is None and is_outage(err)

    def to_wait(self, job: Job, durable: bool, skipped: dict[str, str],
                failed: dict[str, BaseException]) -> dict[str, BaseException | None]:
        """The tiers ``job``'s level waits for instead of failing now, each with its write's error (if any).

        Only a single-process version durable on another tier waits (catch-up copies it from
        there), and only for a remote tier it missed because that tier was down: skipped while
        down, or failed with an outage error.
        """
        if not durable or job.committer is not None:
            return {}
        health = self._health
        out: dict[str, BaseException | None] = {}
        for name in self._waiting:
            if name in job.committed:
                continue
            if name in skipped and (name in job.skipped_down or not health.available(name)):
                out[name] = None
            elif name in failed and is_outage(failed[name]):
                out[name] = failed[name]
        return out

    def settle_job(self, job: Job, waits: dict[str, BaseException | None]) -> None:
        """``job`` is settled: its levels in ``waits`` wait; versions it supersedes stop waiting."""
        if waits:
            with self._cv:
                for name, cause in waits.items():
                    lvl = TIER_LEVEL[name]
                    future = job.futures[lvl]
                    assert isinstance(future, LevelFuture)
                    self._waiting[name][job.version_id] = Waiting(job.version_id, job.branch, job.step, future, cause)
            for name in waits:
                log.info("version %s waits for %s to answer again: its %r level resolves when %s is caught up",
                         job.version_id, name, TIER_LEVEL[name], name)
        for name, versions in self._waiting.items():
            with self._cv:
                concerned = bool(versions)
            if concerned:
                self.review(name)

    def waiting(self, version_id: str) -> frozenset[str]:
        """The tiers ``version_id``'s levels wait for (empty if none)."""
        with self._cv:
            return frozenset(n for n, w in self._waiting.items() if version_id in w)

    # ------------------------------------------------------------------ deciding a waiting level

    def review(self, name: str, errors: dict[str, BaseException] | None = None,
               seen: frozenset[str] | None = None) -> None:
        """Settle the levels waiting for ``name`` whose outcome is known now.

        Args:
            name: The tier.
            errors: Versions whose copy failed in the run that just ended, with the error.
            seen: After a complete run: the versions of the refs it went through. A version it
                went through that is still not on the tier fails; one it did not see (made a
                head or tagged since) asks for another run.
        """
        cat = self._repo.catalog
        with self._cv:
            waiting = list(self._waiting[name].values())
        if not waiting:
            return
        refs = cat.refs()
        tagged = {r.version for r in refs.values() if r.kind == "tag"}
        decided: list[tuple[Waiting, BaseException | None]] = []
        rerun = False
        for w in waiting:
            head = refs.get(f"branch/{w.branch}")
            if errors and w.version in errors:
                decided.append((w, errors[w.version]))
            elif cat.manifest_on(name, w.version) and name in cat.residency(cat.get(w.version)):
                decided.append((w, None))
            elif w.version in tagged or (head is not None and head.version == w.version):
                # Catch-up copies it: this run, or the next (it was not a head or tag when this one began).
                if seen is not None and w.version in seen:
                    decided.append((w, SkippedError(f"version {w.version} was not uploaded to {name}: "
                                                    f"catching {name} up did not copy it")))
                else:
                    rerun = rerun or seen is not None or self._health.available(name)
            elif head is None:
                decided.append((w, self._skipped(w, name, f"its branch {w.branch} was deleted")))
            elif self._jobs.get(head.version) is None:
                # The head has settled: it stays the head unless moved, and catch-up copies it, not this one.
                why = (f"newer version {head.version} of branch {w.branch} superseded it" if head.version > w.version
                       else f"branch {w.branch} was moved to version {head.version}")
                decided.append((w, self._skipped(w, name, why)))
        for w, err in decided:
            with self._cv:
                if self._waiting[name].pop(w.version, None) is None:
                    continue  # decided meanwhile (another review, or close())
                self._cv.notify_all()
            if err is None:
                w.future.set_result(w.version)
                continue
            if isinstance(err, SkippedError):  # recorded first: whoever sees the level fail can read why
                self._note(w.version, name, TierOutcome(state="skipped", reason=str(err)))
            w.future.set_exception(err)
        if rerun:
            self.request(name)

    def _skipped(self, w: Waiting, name: str, why: str) -> SkippedError:
        own = f" (its own write had failed: {type(w.cause).__name__}: {w.cause})" if w.cause is not None else ""
        err = SkippedError(f"version {w.version} was not uploaded to {name}: {why} while {name} was unavailable{own}")
        err.__cause__ = w.cause
        return err

    def _note(self, version_id: str, name: str, outcome: TierOutcome) -> None:
        """Record why ``name`` lacks the version, for ``ls`` and the UI (a note: never a reason to fail)."""
        try:
            self._repo.catalog.record_outcomes(version_id, {name: outcome})
        except TierCacheError as e:
            log.info("could not record why version %s is not on %s: %s", version_id, name, e)

    # ------------------------------------------------------------------ draining a full tier

    def drain(self, local: str, nbytes: int) -> None:
        """Have the remote tier copy the oldest versions only ``local`` holds, about ``nbytes`` of them.

        On the remote tier's catch-up thread, ahead of any catch-up run; nothing without a
        remote tier (then nothing can take them).
        """
        if not self._waiting:
            return
        with self._cv:
            self._drain[local] = max(self._drain.get(local, 0), nbytes)
        self.request(next(iter(self._waiting)), refs=False)

    def _drain_into(self, name: str) -> None:
        """Copy onto ``name`` the oldest sole copies of each local tier asked to drain (see :meth:`drain`)."""
        with self._cv:
            wanted, self._drain = self._drain, {}
        for local, nbytes in wanted.items():
            pinned = {r.version for r in self._repo.catalog.refs().values()}
            copied, ids = 0, []
            for v in self._repo.sole_copies(local):
                if copied >= nbytes or self._closed or not self._health.available(name):
                    break
                if v.id in pinned or self._jobs.get(v.id) is not None:
                    continue  # a head or tag is never evicted (catch-up copies it); a pending one is busy
                try:
                    self._repo.copy_version(v, name, self._read_object)
                except TierCacheError as e:
                    if is_outage(e):
                        self._health.mark_down(name, e)
                        return
                    log.warning("copying version %s from %s to %s to make room failed: %s", v.id, local, name, e)
                    continue
                self._repo.catalog.clear_outcome(v.id, name)
                copied += v.nbytes
                ids.append(v.id)
            if ids:
                log.info("copied %d version(s) only %s held to %s (%d bytes), so %s may evict them: %s", len(ids),
                         local, name, copied, local, ", ".join(ids))

    # ------------------------------------------------------------------ runs

    def request(self, name: str, *, refs: bool = True) -> None:
        """Catch tier ``name`` up on a thread of its own (one more run if one is under way).

        Args:
            name: The tier.
            refs: Run a whole catch-up (else only the drain asked for by :meth:`drain`).
        """
        if name not in self._waiting:
            return  # a local tier is never caught up
        with self._cv:
            if self._closed:
                return
            if refs:
                self._wanted.add(name)
            if name in self._running:
                return
            self._running.add(name)
        threading.Thread(target=self._loop, args=(name,), name=f"tiercache-catchup-{name}", daemon=True).start()

    def _loop(self, name: str) -> None:
        while True:
            with self._cv:
                if self._closed or (name not in self._wanted and not self._drain):
                    self._running.discard(name)
                    self._cv.notify_all()
                    return
                refs = name in self._wanted
                self._wanted.discard(name)
            try:
                self._drain_into(name)
                if refs:
                    self._run(name)
            except Exception as e:  # a run that fails unexpectedly must not stop the next
                log.error("catching %s up failed: %s", name, e)
                self._fail_all(name, e)

    def _run(self, name: str) -> None:
        """Copy onto ``name`` the newest version of each branch and every tagged one it lacks; then review."""
        cat = self._repo.catalog
        errors: dict[str, BaseException] = {}
        seen: set[str] = set()
        try:
            cat.reload(name)
            # Branch heads first (newest first), then tags: a tag on a head is copied with it.
            for rec in sorted(cat.refs().values(), key=lambda r: (r.kind != "tag", r.version), reverse=True):
                if self._closed or not self._health.available(name):
                    return
                self._jobs.wait(rec.version)
                if cat.ref(rec.kind, rec.name) != rec:
                    continue  # moved (or taken back: its version failed) meanwhile
                seen.add(rec.version)
                try:
                    left_out = self._copy(name, rec)
                    if left_out is not None:
                        errors[rec.version] = left_out
                except TierCacheError as e:
                    if is_outage(e):
                        raise
                    errors[rec.version] = e
                    log.warning("catching %s up with version %s (%s/%s) failed: %s", name, rec.version, rec.kind,
                                rec.name, e)
        except TierCacheError as e:
            if is_outage(e):
                self._health.mark_down(name, e)
                return
            log.warning("catching %s up failed: %s", name, e)
            self._fail_all(name, e)
            return
        self.review(name, errors, frozenset(seen))

    def _fail_all(self, name: str, err: BaseException) -> None:
        """A run failed with ``err`` (not an outage): what waits for ``name`` fails with it, not waits on in vain."""
        with self._cv:
            left = list(self._waiting[name].values())
        self.review(name, {w.version: err for w in left})

    def _copy(self, name: str, rec: RefRecord) -> SkippedError | None:
        """Make ``rec``'s version (and the ref) present on ``name``, copying it from this process's tiers.

        Returns:
            Why it was left out, if no tier of this process holds it whole (else ``None``).
        """
        cat = self._repo.catalog
        try:
            version = cat.peek(rec.version)
            # A version saved by a group: its parts merged if this process can read them all, but
            # only to copy it. One the group committed on the tier is there whole (see
            # Catalog.residency): reading every rank's part to learn that would cost each rank
            # of a group a read per rank after its saves, from a hanging S3 too.
            if not (version.is_header and cat.manifest_on(name, version.id)):
                version = cat.materialize(version)
        except VersionNotFoundError:
            return None  # a ref this process moved to a version it did not get to commit
        if cat.manifest_on(name, version.id) and name in cat.residency(version):
            self._repo.ensure_ref(name, rec)  # e.g. a tag on a version copied under its branch
            return None
        if version.is_header or not [t for t in cat.residency(version) if t != name]:
            # A version saved by ranks on several nodes, each node's disk holding its own part:
            # no process can copy it alone; the group's next save reaches the tier.
            log.info("not catching %s up with version %s (%s/%s): this node holds only its part of it",
                     name, version.id, rec.kind, rec.name)
            return SkippedError(f"version {version.id} was not uploaded to {name}: this node holds only its part "
                                "of it (the group's next save reaches the tier)")
        copied = self._repo.copy_version(version, name, self._read_object, ref=rec)
        log.info("caught %s up with version %s (%s/%s, %d bytes copied)", name, version.id, rec.kind, rec.name,
                 copied)
        cat.clear_outcome(version.id, name)
        return None

    # ------------------------------------------------------------------ flush and close

    def wait_for_up_tiers(self, deadline: float | None) -> list[Waiting]:
        """Wait until no version waits for a tier that is up (its catch-up is under way), or until ``deadline``.

        Versions waiting for a tier that is down are not waited for: an outage may last hours.

        Returns:
            Those still waiting for a tier that is up (only if ``deadline`` passed first).
        """
        health = self._health
        with self._cv:
            while True:
                left = [w for n, ws in self._waiting.items() if health.available(n) for w in ws.values()]
                if not left or self._closed:
                    return []
                wait = _RECHECK_S if deadline is None else min(_RECHECK_S, deadline - time.monotonic())
                if wait <= 0:
                    return left
                self._cv.wait(wait)

    def waiting_for_down_tiers(self) -> dict[str, list[Waiting]]:
        """Per tier that is down now, the versions waiting for it, oldest first."""
        health = self._health
        with self._cv:
            out = {n: sorted(ws.values(), key=lambda w: w.version) for n, ws in self._waiting.items()
                   if ws and not health.available(n)}
        return out

    def close(self) -> None:
        """Stop catching up; fail every level still waiting, with the reason, and log which."""
        health = self._health
        with self._cv:
            self._closed = True
            left = {n: sorted(ws.values(), key=lambda w: w.version) for n, ws in self._waiting.items() if ws}
            for ws in self._waiting.values():
                ws.clear()
            self._cv.notify_all()
        for name, versions in left.items():
            outage = health.outage(name)
            if outage is not None:
                why = f"{name} was still unavailable when the cache closed (since {outage.clock}: {outage.reason})"
            else:
                why = f"the cache closed before {name} was caught up"
            kind = TierUnavailableError if outage is not None else SkippedError
            log.warning("closing: %d version(s) not uploaded to %s: %s: %s; they are on the other tiers, and the "
                        "next process that saves catches %s up with the newest version of each branch and every tag",
                        len(versions), name, why, ", ".join(f"{w.version} (step {w.step})" for w in versions), name)
            for w in versions:
                err = kind(f"version {w.version} was not uploaded to {name}: {why}")
                err.__cause__ = w.cause
                w.future.set_exception(err)


__all__ = ["CatchUp", "Waiting"]
