"""The trainer's saver with a node agent: copy into the shared arena, publish, follow the levels.

:class:`AgentSaver` is the :class:`~tiercache.saver.Saver` the facade uses with an ``[agent]``
table. ``stage()`` does what the in-process engine's does up to the copy, and nothing after it:

1. flatten the state and plan its chunks (cached per structure, as in process);
2. ask the agent for regions of its arena for that layout (it waits for room, or the policy
   skips, exactly as in process);
3. copy every tensor into the regions through this process's mapping, with the same staging code
   (:class:`~tiercache.pipeline.staging.Stager`: all cores, memcpy, GPU copies on a side stream
   into the page-locked mapping);
4. publish the version (its id, step, branch, parent, seq, meta, object tree; the tensor table
   goes once per structure) in one message, and return once the agent has it.

Hashing, encoding, writing and committing run in the agent; its events resolve the handle's
futures here. A copy interrupted by a crash is never published: its regions go back when the
connection drops, and the previous version is untouched.

**The agent lost** (it died, or stopped answering): training goes on. Versions it had not
finished are handed over to an :class:`~tiercache.pipeline.engine.Engine` in this process, their
bytes copied out of the mapping (which outlives the agent); every later save is staged in
process. Nothing acknowledged ``local`` was lost (it is on disk), and nothing half-written is
served (restores verify every chunk, and a version is only published once copied whole). The
versions go over in save order: the engine's writer of a version waits for its parent's outcome
and takes versions in the order it got them (:meth:`Engine.final_manifest`), so a child taken
before its parent would wait behind it for ever. Every level of a version handed over settles
with the engine's outcome for it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from tiercache.agent.client import AgentLink
from tiercache.agent.protocol import ProtocolError, error_from_wire, error_to_wire, metas_to_wire, staged_to_wire
from tiercache.config import CacheConfig, RamConfig
from tiercache.errors import (
    AgentUnavailableError,
    CacheClosedError,
    SkippedError,
    TierCacheError,
)
from tiercache.failpoints import failpoint
from tiercache.format import Flat, flatten
from tiercache.handle import LEVELS, SaveHandle, level_futures
from tiercache.layout import Layout
from tiercache.manifest import Version, new_version_id
from tiercache.pipeline.deferred import deferrable
from tiercache.pipeline.job import StagedVersion
from tiercache.pipeline.staging import CopyPlan, PlanCache, Stager, item_sizes
from tiercache.saver import ObjectReader, Saver, absent_levels

if TYPE_CHECKING:
    from tiercache.format import Flat
    from tiercache.pipeline.deferred import Owned
    from tiercache.pipeline.job import Committer, HashSplit
    from tiercache.repo import Repo
    from tiercache.restore import Progress

log = logging.getLogger("tiercache.agent.saver")


@dataclass
class _Job:
    """One of this process's versions handed to the agent, until every level of it is settled."""

    staged: StagedVersion
    layout: Layout
    futures: dict[str, Future[str]]
    regions: list[tuple[int, int]] = field(default_factory=list)
    #: Set once the version is whole in the arena (published or about to be); ``_cv`` is notified.
    copied: bool = False
    #: Set once its manifest is in this process's catalog (or it failed before having one).
    published: threading.Event = field(default_factory=threading.Event)
    #: Handed over to the in-process engine after the agent was lost.
    moved: bool = False
    #: For one rank's part of a group version: the group's version id (the agent knows the part
    #: by ``staged.version_id``, the id and the rank), the group's committer in this process,
    #: the part's manifest once the agent hashed it, and the group's hashing split if any.
    vid: str | None = None
    committer: Committer | None = None
    manifest: Future[Version] | None = None
    split: HashSplit | None = None

    @property
    def version(self) -> str:
        """The version's id (the group's, for a part)."""
        return self.vid or self.staged.version_id

    @property
    def key(self) -> str:
        """What the agent knows the version by."""
        return self.staged.version_id

    def settled(self) -> bool:
        return all(f.done() for f in self.futures.values())


def pin_mapping(address: int, nbytes: int, cudart: Any) -> bool:
    """Page-lock a mapping of the shared arena for asynchronous GPU copies (``cudaHostRegister``).

    Done once per trainer process, on the whole mapping: a GPU state is then copied into the
    arena with non-blocking copies on a side stream, as into the in-process arena.

    Returns:
        Whether the mapping is now page-locked (``False``: CUDA refused, pageable copies are used).
    """
    err = int(cudart.cudaHostRegister(address, nbytes, 1))  # cudaHostRegisterPortable
    if err:
        log.warning("cannot page-lock the %d-byte shared arena (cudaError %d); GPU copies into it are synchronous",
                    nbytes, err)
        return False
    return True


class AgentSaver:
    """Saves through the node agent (see the module docstring); the facade's :class:`~tiercache.saver.Saver`.

    Args:
        config: The cache config (its ``[agent]`` table set).
        repo: This process's storage layer (its catalog follows the agent through ``link``).
        link: The connection to the agent.
        make_local: Makes the in-process saver that takes over if the agent is lost.

    A rank's part of a multi-rank version goes to the agent as any version; the group's
    committer stays here, and this saver answers the agent's questions to it (see
    :mod:`tiercache.agent.committer`).
    """

    def __init__(self, config: CacheConfig, repo: Repo, link: AgentLink, *, make_local: Callable[[], Saver]) -> None:
        self.config = config
        self.repo = repo
        self.link = link
        self._make_local = make_local
        self._local: Saver | None = None
        self._local_lock = threading.Lock()
        ram = config.ram or RamConfig()
        self._pin = ram.pin_memory
        self._plans = PlanCache(config.pack_below)
        self._stager = Stager(ram.resolved_copy_threads())
        self._sids: dict[object, str] = {}
        self._jobs: dict[str, _Job] = {}
        self._cv = threading.Condition()
        self._deferred: set[Future[None]] = set()
        self._handover = threading.Lock()
        self._losses: deque[BaseException] = deque(maxlen=64)
        self.errors_total = 0
        self.recent_errors: deque[str] = deque(maxlen=16)
        self._closed = False
        self._arena: torch.Tensor | None = None
        link.on_event(self._on_event)
        link.on_lost(self._on_lost)

    @property
    def has_saved(self) -> bool:
        """Whether this process wrote anything itself (after losing the agent): its meter then saw writes."""
        return self._local is not None and self._local.has_saved

    @property
    def local(self) -> Saver | None:
        """The in-process saver, once made (the agent was lost)."""
        return self._local

    def _local_saver(self) -> Saver:
        with self._local_lock:
            if self._local is None:
                self._local = self._make_local()
            return self._local

    # ------------------------------------------------------------------ staging

    def stage(self, state: object, *, step: int, branch: str, meta: dict, parent: str | None, seq: int,
              version_id: str | None = None, chunk_bytes: int | None = None, committer: Committer | None = None,
              defer: Owned | None = None, flat: Flat | None = None) -> SaveHandle:
        """Copy ``state`` into the agent's arena and hand it over (see the module docstring).

        A rank's part of a multi-rank version (``committer``: the group commits it, through this
        process) goes to the agent as any version. Every save after the agent was lost is staged
        by the in-process engine instead.

        Raises:
            CacheClosedError: If the cache is closed.
            UnsupportedStateError: If a leaf of ``state`` cannot be stored.
            TierFullError: If the version can never fit in the arena.
            TierCacheError: Only with ``engine.on_error = "raise"``: an earlier lost version.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one to save")
        kw: dict[str, Any] = {"step": step, "branch": branch, "meta": meta, "parent": parent, "seq": seq,
                              "version_id": version_id, "chunk_bytes": chunk_bytes, "committer": committer,
                              "defer": defer, "flat": flat}
        if self.link.lost is not None:
            return self._in_process(state, kw)
        t0 = time.perf_counter()
        if flat is None:
            flat = flatten(state, allow_pickle=self.config.allow_pickle)
        cb = chunk_bytes or self.config.chunk_bytes
        plan = self._plans.get(flat, cb)
        vid = version_id or new_version_id()
        key = vid if committer is None else f"{vid}.{committer.rank}"  # each rank's part is a job of the agent
        staged = StagedVersion(key, branch, step, seq, parent, dict(meta), time.time(),
                               flat.tree, tuple(flat.metas), flat.pickled)
        job = _Job(staged, plan.layout, level_futures(vid))
        if committer is not None:
            job.vid, job.committer, job.manifest = vid, committer, Future()
        for lvl, err in absent_levels(self.config.tier_names()).items():
            job.futures[lvl].set_exception(err)
        handle = SaveHandle(vid, job.futures)
        try:
            sid = self._structure(flat, plan, cb)
            got = self.link.request("reserve", sid=sid)
            views = self._views(got)
        except AgentUnavailableError:
            return self._in_process(state, kw)  # this version never reached the agent
        if "skip" in got:
            err = SkippedError(f"version at step {step} skipped: {got['skip']}")
            for f in job.futures.values():
                if not f.done():
                    f.set_exception(err)
            return self._report_earlier(handle)
        rid = int(got["rid"])
        job.regions = [(int(o), int(n)) for o, n in got["regions"]]
        if committer is not None:
            committer.follow(job.manifest)  # type: ignore[arg-type]  # (set above for a committer)
        with self._cv:
            self._jobs[key] = job
        later = deferrable(flat.tensors, defer) if defer else frozenset()
        copied = [threading.Event() for _ in views]
        base, why = self._move_of(branch, parent) if committer is None else (None, "save")
        try:
            pending = self._stager.copy_in(flat, plan, views, copied, later=later)
        except BaseException:
            self._forget(job)
            self.link.notify("cancel", rid=rid)
            raise
        publish = {"op_sid": sid, "rid": rid, "base": base, "why": why}
        if committer is not None:
            publish["part"], publish["world"] = committer.rank, committer.world
        if pending is None:
            self._publish(job, publish, time.perf_counter() - t0)
        else:
            with self._cv:
                self._deferred.add(pending)
            pending.add_done_callback(lambda f: self._copied_later(job, publish, f))
        return self._report_earlier(handle)

    def layout_of(self, flat: Flat, chunk_bytes: int | None = None) -> Layout:
        """The chunk layout a save of ``flat`` gets (the agent's is the same: it plans the same way)."""
        return self._plans.get(flat, chunk_bytes or self.config.chunk_bytes).layout

    def published(self, version_id: str) -> Future[Version] | None:
        """The manifest future of this rank's part of a multi-rank version in flight, or ``None``."""
        job = self._job(version_id)
        if job is not None and job.manifest is not None:
            return job.manifest
        return self._local.published(version_id) if self._local is not None else None

    def _job(self, version_id: str) -> _Job | None:
        with self._cv:
            return self._jobs.get(version_id) or next((j for j in self._jobs.values() if j.vid == version_id), None)

    def _in_process(self, state: object, kw: dict[str, Any]) -> SaveHandle:
        # After every version staged before it: its parent may be one whose copy is still running.
        self._handed_over(wait=True)
        return self._local_saver().stage(state, **kw)

    def _structure(self, flat: Flat, plan: CopyPlan, chunk_bytes: int) -> str:
        """The id the agent knows this state's structure by (sent once per structure)."""
        key = (flat.structure_key, chunk_bytes)
        sid = self._sids.get(key)
        if sid is not None:
            return sid
        metas = metas_to_wire(flat.metas)
        _, items = item_sizes(flat)
        sid = hashlib.blake2b(repr((metas, items, chunk_bytes)).encode(), digest_size=12).hexdigest()
        self.link.request("structure", sid=sid, metas=metas, items=items, chunk_bytes=chunk_bytes)
        if len(self._sids) > 16:
            self._sids.clear()
        self._sids[key] = sid
        return sid

    def _views(self, got: dict[str, Any]) -> list[torch.Tensor]:
        """One uint8 tensor per region the agent reserved, viewing this process's mapping of its arena."""
        if "skip" in got:
            return []
        self.link.note_arena(got.get("arena"))
        arena = self._arena_tensor()
        return [arena[int(o) : int(o) + int(n)] for o, n in got["regions"]]

    def _arena_tensor(self) -> torch.Tensor:
        if self._arena is None:
            mapping = self.link.mapping()
            if mapping is None:
                raise AgentUnavailableError("the node agent reserved regions of an arena it did not hand over")
            self.link.wait_populated()
            arena = torch.frombuffer(mapping, dtype=torch.uint8)
            if self._pin and torch.cuda.is_available():
                pin_mapping(arena.data_ptr(), arena.numel(), torch.cuda.cudart())
            self._arena = arena
        return self._arena

    def _move_of(self, branch: str, parent: str | None) -> tuple[dict[str, Any] | None, str]:
        """The head the branch moves from (this process's view) and why, as the facade records it."""
        cur = self.repo.catalog.ref("branch", branch)
        if cur is None:
            why = "branch" if parent is not None else "save"
        else:
            why = "resume" if parent != cur.version else "save"
        return (cur.model_dump(mode="json") if cur is not None else None), why

    def _publish(self, job: _Job, publish: dict[str, Any], wait_s: float) -> None:
        failpoint("agent.publish", job.version)
        with self._cv:
            job.copied = True
            self._cv.notify_all()
        extra = {k: publish[k] for k in ("part", "world") if k in publish}
        try:
            self.link.request("publish", sid=publish["op_sid"], rid=publish["rid"],
                              version=staged_to_wire(job.staged), base=publish["base"], why=publish["why"],
                              wait_s=wait_s, **extra)
        except TierCacheError as e:
            # Lost, or refusing (stopping): the bytes are whole in the mapping; finish it here.
            log.warning("the node agent did not take version %s (%s): saving it in this process", job.version, e)
            if self.link.lost is not None:
                self._handed_over()  # after the versions before it, which the agent has not finished either
            else:  # it refused this one (it is stopping), and finishes those it took
                with self._handover:
                    self._hand_over(job)
            return
        if not job.futures["staged"].done():
            job.futures["staged"].set_result(job.version)

    def _copied_later(self, job: _Job, publish: dict[str, Any], done: Future[None]) -> None:
        with self._cv:
            self._deferred.discard(done)
        err = done.exception()
        if err is None:
            self._publish(job, publish, 0.0)
            return
        self.link.notify("cancel", rid=publish["rid"])
        self._fail(job, err)
        if self.link.lost is not None:
            self._handed_over()  # the versions after it waited for it

    def _fail(self, job: _Job, err: BaseException) -> None:
        """A version that cannot be saved: counted as lost, every level failed with ``err``."""
        self._record_loss(job, err)
        for f in job.futures.values():
            if not f.done():
                f.set_exception(err)
        if job.manifest is not None and not job.manifest.done():
            job.manifest.set_exception(err)
        self._forget(job)

    def _forget(self, job: _Job) -> None:
        job.published.set()
        with self._cv:
            self._jobs.pop(job.key, None)
            self._cv.notify_all()

    def _report_earlier(self, handle: SaveHandle) -> SaveHandle:
        """``engine.on_error = "raise"``: raise an earlier lost version, now that this one is staged."""
        if self.config.engine.on_error == "raise":
            with self._cv:
                err = self._losses.popleft() if self._losses else None
            if err is not None:
                err.handle = handle  # type: ignore[attr-defined]
                raise err
        return handle

    def _record_loss(self, job: _Job, err: BaseException) -> None:
        self.record_loss(job.version, job.staged.step, err)

    def record_loss(self, version_id: str, step: int, err: BaseException) -> None:
        """See :meth:`tiercache.saver.Saver.record_loss`."""
        with self._cv:
            self._losses.append(err)
            self.errors_total += 1
            self.recent_errors.append(f"{version_id}: reached no durable tier: {type(err).__name__}: {err}")
        log.error("version %s (step %d) reached no durable tier: %s", version_id, step, err)

    # ------------------------------------------------------------------ the agent's word

    def _on_event(self, msg: dict[str, Any]) -> None:
        with self._cv:
            job = self._jobs.get(str(msg.get("v", "")))
        if job is None or job.moved:
            return
        ev = msg.get("ev")
        if ev == "call":
            threading.Thread(target=self._answer, args=(job, msg), daemon=True, name="tiercache-agent-call").start()
            return
        if ev == "published":
            if job.manifest is not None and not job.manifest.done():
                own = Version.from_json(str(msg["manifest"]).encode(), source="node agent")
                job.manifest.set_result(own.model_copy(update={"id": job.version}))
            job.published.set()
            return
        if ev == "settled":  # the agent is done with it, as the engine is when a flush returns
            self._forget(job)
            return
        if ev != "level":
            return
        f = job.futures.get(str(msg.get("level")))
        if f is not None and not f.done():
            if msg.get("ok"):
                f.set_result(job.version)
            else:
                err = error_from_wire(msg.get("error", {}))
                if msg.get("level") == "durable":
                    if job.manifest is not None and not job.manifest.done():
                        job.manifest.set_exception(err)
                    job.published.set()
                    if msg.get("loss"):
                        self._record_loss(job, err)
                f.set_exception(err)

    def _answer(self, job: _Job, msg: dict[str, Any]) -> None:
        """Answer what the agent asks of the group's committer about this rank's part (a thread each)."""
        call, tier = msg.get("call"), str(msg.get("tier", ""))
        committer = job.committer
        result: Any = None
        try:
            if committer is None or job.manifest is None:
                raise ProtocolError(f"version {job.version} is no part of a group version here")
            if call == "owned":
                result = sorted(committer.owned(tier))
            elif call == "commit":
                committer.commit(tier, job.manifest.result()).result()  # the group's verdict
            elif call == "split":
                job.split = committer.split_hashing(job.layout, [m.path for m in job.staged.metas])
                result = None if job.split is None else {}
            elif call == "exchange":
                if job.split is None:
                    raise ProtocolError(f"version {job.version}: no hashing split to trade ids for")
                ids = msg.get("ids")
                job.split.exchange(None if ids is None else {int(i): str(c) for i, c in dict(ids).items()})
            else:
                raise ProtocolError(f"unknown question {call!r}")
        except Exception as e:
            self.link.notify("answer", n=msg.get("n"), error=error_to_wire(e))
            return
        self.link.notify("answer", n=msg.get("n"), result=result)

    def _on_lost(self, err: BaseException) -> None:
        """The agent is gone: finish what it had not, in this process, off the link's thread."""
        if self._closed:
            return
        log.warning("lost the node agent (%s): saving in this process from now on", err)
        threading.Thread(target=self._handed_over, name="tiercache-agent-handover", daemon=True).start()

    def _handed_over(self, *, wait: bool = False) -> None:
        """Hand the versions the lost agent had not finished over to the in-process engine, in save order.

        Stops at the oldest version still being copied (a deferred copy, or a ``stage()`` under
        way): its publish, which fails now, goes on from there, and so does its failure. No
        version is taken before an older one (see the module docstring).

        Args:
            wait: First wait until every version is copied (or failed): the caller saves in
                process next, and that version's parent may be one of them.
        """
        failpoint("agent.hand_over")
        if wait:
            with self._cv:
                self._cv.wait_for(lambda: all(j.copied for j in self._jobs.values()))
        with self._handover:
            while True:
                with self._cv:
                    job = next((j for j in self._jobs.values() if not j.moved), None)
                if job is None or not (job.copied or job.settled()):
                    return
                self._hand_over(job)

    def _hand_over(self, job: _Job) -> None:
        """Take one version over in process, or forget it if settled (the caller holds ``_handover``)."""
        if job.settled():  # its "settled" word was lost with the agent: nothing left to do
            self._forget(job)
            return
        if job.moved:
            return
        job.moved = True
        try:
            self._restage(job)
        except BaseException as e:  # the version cannot be saved here either (the engine never took it)
            self._fail(job, e)

    def _restage(self, job: _Job) -> None:
        """Copy a version out of the (lost) agent's arena into the in-process engine's and start it there.

        Everything that can fail comes before the engine takes the version; from then on each of
        its levels (and a part's manifest) settles with the engine's outcome, and the job is
        forgotten once all have.

        Raises:
            SkippedError: If the policy skips it (the in-process arena is full).
            TierFullError: If it can never fit in the in-process arena.
            CacheClosedError: If the in-process engine is closed.
        """
        local = self._local_saver()
        from tiercache.pipeline.engine import Engine  # the in-process saver is an Engine

        if not isinstance(local, Engine):
            raise TypeError(f"version {job.version}: the in-process saver is a {type(local).__name__}, not an Engine")
        regions = local.reserve(job.layout)
        if regions is None:
            raise SkippedError(f"version {job.version} skipped: the RAM arena is full and the policy said skip")
        src = self._arena_tensor()
        arena = local.ramcache.arena
        if arena is None:
            raise CacheClosedError(f"version {job.version}: the in-process RAM arena is gone (the cache is closing)")
        for (offset, nbytes), r in zip(job.regions, regions, strict=True):
            dst = arena.tensor(r)
            n = min(nbytes, r.nbytes)
            ctypes.memmove(dst.data_ptr(), src.data_ptr() + offset, n)
        manifest = job.manifest
        follow = None
        if manifest is not None:  # a part: the group follows this future (it keeps the first it was given)
            def follow(theirs: Future[Version]) -> None:
                theirs.add_done_callback(lambda f: _copy_outcome(f, manifest))
        # A part goes on under the group's id, with the same committer: the group waits for it.
        staged = replace(job.staged, version_id=job.version)
        handle = local.adopt(staged, job.layout, regions, job.committer, follow=follow)
        job.published.set()
        for lvl in LEVELS:
            ours = job.futures[lvl]
            handle.future(lvl).add_done_callback(lambda f, ours=ours: _copy_outcome(f, ours))  # type: ignore[arg-type]
            ours.add_done_callback(lambda _: self._forget_if_settled(job))

    def _forget_if_settled(self, job: _Job) -> None:
        if job.settled():
            self._forget(job)

    # ------------------------------------------------------------------ the rest of the seam

    def prepare_arena(self, state: object | None, *, wait: bool) -> None:
        """Have the agent's arena made (sized for ``state`` when ``auto``) and mapped here.

        Raises:
            CacheClosedError: If the cache is closed.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one")
        try:
            if self.link.arena is None and state is not None:
                flat = flatten(state, allow_pickle=self.config.allow_pickle)
                plan = self._plans.get(flat, self.config.chunk_bytes)
                got = self.link.request("reserve", sid=self._structure(flat, plan, self.config.chunk_bytes))
                if "rid" in got:
                    self.link.request("cancel", rid=got["rid"])
                self.link.note_arena(got.get("arena"))
            if self.link.mapping() is not None and wait:
                self.link.wait_populated()
        except AgentUnavailableError:
            self._local_saver().prepare_arena(state, wait=wait)

    def wait_deferred(self) -> None:
        """Block until every deferred copy started so far is done."""
        with self._cv:
            pending = list(self._deferred)
        for f in pending:
            f.exception()
        if self._local is not None:
            self._local.wait_deferred()

    def wait_published(self) -> None:
        """Block until the manifests of this process's versions are in its catalog."""
        with self._cv:
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.copied:
                job.published.wait()
        if self._local is not None:
            self._local.wait_published()

    def wait_job(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until ``version_id`` is settled (this process's, or one the agent is still writing)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._job(version_id)
        if job is not None:
            for f in job.futures.values():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    f.exception(left)
                except TimeoutError:
                    return False
        while self.link.lost is None and self.link.pending_tiers(version_id):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        if self._local is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._local.wait_job(version_id, left)
        return True

    def pending_jobs(self) -> list[str]:
        """This process's versions not settled yet, oldest first."""
        with self._cv:
            mine = [j.version for j in self._jobs.values()]
        return mine + (self._local.pending_jobs() if self._local is not None else [])

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers ``version_id`` is still being written to (by the agent or here)."""
        here = self._local.pending_tiers(version_id) if self._local is not None else frozenset()
        return here | self.link.pending_tiers(version_id)

    def promote_ram(self, version: Version, read: ObjectReader, progress: Progress | None) -> int:
        """Have the agent copy a version into node RAM; return bytes copied."""
        if self.link.lost is not None:
            return self._local_saver().promote_ram(version, read, progress)
        got = self.link.request("promote", version=version.id)
        if progress is not None:
            progress(int(got.get("nbytes", 0)))
        return int(got.get("nbytes", 0))

    def keep_chunks(self, chunks: Sequence[tuple[str, int]], hash_algo: str, read: ObjectReader) -> int:
        """Have the agent copy chunks into node RAM in the background (a multi-rank part it did not stage).

        Returns 0: the agent reads them from the tiers below on its own time, so that a
        restarted trainer restores them from node RAM; nobody waits for it.
        """
        if self.link.lost is None:
            self.link.notify("keep", chunks=[[c, n] for c, n in chunks], hash_algo=hash_algo)
        return 0

    def evict_ram(self, chunk_ids: Iterable[str]) -> int:
        """Have the agent drop node RAM's copies of chunks no version in flight needs."""
        ids = list(chunk_ids)
        freed = self._local.evict_ram(ids) if self._local is not None else 0
        if self.link.lost is None:
            freed += int(self.link.request("evict", chunks=ids).get("nbytes", 0))
        return freed

    def take_losses(self) -> list[BaseException]:
        """Versions lost that were not reported yet, oldest first (they are reported now)."""
        with self._cv:
            out = list(self._losses)
            self._losses.clear()
        return out

    def flush(self, timeout: float | None = None, *, report: bool = True) -> None:
        """Wait until every version this process staged has settled (see :meth:`Engine.flush`).

        Raises:
            TimeoutError: If versions are still pending after ``timeout``; the message names them.
            TierCacheError: With ``report``, the first version lost since the last report.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    shown = ", ".join(f"{j.version} (step {j.staged.step})" for j in list(self._jobs.values())[:4])
                    raise TimeoutError(f"flush: {len(self._jobs)} version(s) still pending after {timeout:g}s: "
                                       f"{shown}")
                self._cv.wait(left if left is not None else 1.0)
        if self._local is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._local.flush(left, report=report)
        if report:
            lost = self.take_losses()
            if lost:
                raise lost[0]

    def close(self) -> None:
        """Wait for this process's versions, close the link (the agent goes on), stop the threads."""
        if self._closed:
            return
        try:
            self.flush(report=False)
        finally:
            self._closed = True
            self._stager.close()
            self.link.close()
        if self._local is not None:
            self._local.close()
        lost = self.take_losses()
        if lost:
            raise lost[0]


def _copy_outcome(src: Future[Any], dst: Future[Any]) -> None:
    """Settle ``dst`` as ``src`` settled, unless the agent's word settled it first."""
    if dst.done():
        return
    err = src.exception()
    try:
        if err is None:
            dst.set_result(src.result())
        else:
            dst.set_exception(err)
    except InvalidStateError:  # the agent's last event raced the hand-over: its outcome stays
        pass


__all__ = ["AgentSaver", "pin_mapping"]
