"""The trainer's back end with a node agent: regions of the shared arena, publish, follow the levels.

:class:`AgentBackend` is the :class:`~tiercache.pipeline.front.Backend` of the save front
(:class:`~tiercache.pipeline.front.SaveFront`) with an ``[agent]`` table. The front flattens,
plans and copies as in process; this back end:

1. asks the agent for regions of its arena for the version's layout (it waits for room, or the
   policy skips, exactly as in process; the tensor table goes once per structure), and gives
   the front views of them through this process's mapping (page-locked for GPU copies);
2. once the copy is whole, publishes the version (its id, step, branch, parent, seq, meta,
   object tree, and how the branch moves, as the facade worked it out) in one message, and
   returns once the agent has it.

Hashing, encoding, writing and committing run in the agent; its events resolve the handle's
futures here. A copy interrupted by a crash is never published: its regions go back when the
connection drops, and the previous version is untouched.

**The agent lost** (it died, or stopped answering): training goes on. Versions it had not
written to the disk are handed over to the front's in-process
:class:`~tiercache.pipeline.engine.Engine`, their bytes copied out of the mapping (which outlives
the agent); the front stages every later save in process. Those bytes are still the version's:
the agent reuses a published version's regions only once this process released them (it heard
``local``, or the version settled; see :meth:`AgentBackend._release`). A version the disk holds
stays there, its open levels failed (:meth:`AgentBackend._leave_on_disk`). Nothing acknowledged
``local`` was lost (it is on disk), and nothing half-written is served (restores verify every
chunk, and a version is only published once copied whole). The
versions go over in save order: the engine's writer of a version waits for its parent's outcome
and takes versions in the order it got them (:meth:`Engine.final_manifest`), so a child taken
before its parent would wait behind it for ever. Every level of a version handed over settles
with the engine's outcome for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
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
from tiercache.format import Flat
from tiercache.handle import LEVELS, TIER_LEVEL
from tiercache.layout import Layout
from tiercache.manifest import Version
from tiercache.pipeline.job import StagedVersion
from tiercache.pipeline.staging import CopyPlan, item_sizes
from tiercache.saver import ObjectReader, absent_levels

if TYPE_CHECKING:
    from tiercache.format import Flat
    from tiercache.pipeline.front import Save, SaveFront
    from tiercache.pipeline.job import Committer, HashSplit
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
    #: The agent was told it may reuse the version's regions (see :meth:`AgentBackend._release`).
    released: bool = False
    #: For one rank's part of a group version: the group's version id (the agent knows the part
    #: by ``staged.version_id``, the id and the rank), the group's committer in this process,
    #: the part's manifest once the agent hashed it, and the group's hashing split if any.
    vid: str | None = None
    committer: Committer | None = None
    manifest: Future[Version] | None = None
    split: HashSplit | None = None
    #: What the publish message carries besides the version: its structure, its regions, how
    #: the branch moves, and for a part its rank and the group's size.
    publish: dict[str, Any] = field(default_factory=dict)

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


class AgentBackend:
    """Saves through the node agent (see the module docstring); a back end of the save front.

    Args:
        config: The cache config (its ``[agent]`` table set).
        link: The connection to the agent (this process's catalog follows the agent through it).
        front: The save front: its in-process engine takes over if the agent is lost, and its
            ledger counts the versions lost.

    A rank's part of a multi-rank version goes to the agent as any version; the group's
    committer stays here, and this back end answers the agent's questions to it (see
    :mod:`tiercache.agent.committer`).
    """

    def __init__(self, config: CacheConfig, link: AgentLink, front: SaveFront) -> None:
        self.config = config
        self.link = link
        self._front = front
        self._pin = (config.ram or RamConfig()).pin_memory
        self._sids: dict[object, str] = {}
        self._jobs: dict[str, _Job] = {}
        self._cv = threading.Condition()
        self._handover = threading.Lock()
        self._closed = False
        self._arena: torch.Tensor | None = None
        #: Keys of versions to ``release``, sent by a thread of their own (never the link's
        #: reader: a send there could wait on the agent while it waits on this reader).
        self._releases: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._releaser: threading.Thread | None = None
        link.on_event(self._on_event)
        link.on_lost(self._on_lost)

    @property
    def lost(self) -> bool:
        """Whether the agent is gone: the front then saves in process."""
        return self.link.lost is not None

    @property
    def has_saved(self) -> bool:
        """Never: the agent wrote this process's versions (its meter is the agent's)."""
        return False

    # ------------------------------------------------------------------ staging

    def absent_levels(self) -> dict[str, Exception]:
        """The levels no version of this cache can reach with its configured tiers, and why."""
        return absent_levels(self.config.tier_names())

    def regions(self, save: Save) -> list[torch.Tensor] | str:
        """Have the agent reserve regions of its arena for ``save``; views of them, or why its policy skips it.

        Raises:
            AgentUnavailableError: If the agent is lost (the front saves the version in process).
        """
        sid = self._structure(save.flat, save.plan, save.chunk_bytes)
        got = self.link.request("reserve", sid=sid)
        views = self._views(got)
        if "skip" in got:
            return str(got["skip"])
        vid, committer = save.version_id, save.committer
        key = vid if committer is None else f"{vid}.{committer.rank}"  # each rank's part is a job of the agent
        staged = StagedVersion(key, save.branch, save.step, save.seq, save.parent, save.meta, save.created_at,
                               save.flat.tree, tuple(save.flat.metas), save.flat.pickled)
        job = _Job(staged, save.layout, save.futures)
        job.regions = [(int(o), int(n)) for o, n in got["regions"]]
        # The agent records the branch's move as the facade worked it out (a part: the group's).
        base, why = (save.base, save.why) if committer is None else (None, "save")
        job.publish = {"op_sid": sid, "rid": int(got["rid"]), "base": base.model_dump(mode="json") if base else None,
                       "why": why}
        if committer is not None:
            job.vid, job.committer, job.manifest = vid, committer, Future()
            job.publish["part"], job.publish["world"] = committer.rank, committer.world
        save.ticket = job
        return views

    def launch(self, save: Save) -> list[threading.Event]:
        """Track ``save`` until the agent settled it (the agent starts on it once published)."""
        job: _Job = save.ticket
        if job.committer is not None:
            job.committer.follow(job.manifest)  # type: ignore[arg-type]  # (set for a committer)
        with self._cv:
            self._jobs[job.key] = job
        return [threading.Event() for _ in job.regions]

    def publish(self, save: Save, wait_s: float) -> None:
        """Hand the copied version over to the agent (see the module docstring)."""
        self._publish(save.ticket, wait_s)

    def cancel(self, save: Save, err: BaseException, *, seen: bool) -> None:
        """Give the regions back; a version whose deferred copy failed fails every level (the front counted it)."""
        job: _Job = save.ticket
        self.link.notify("cancel", rid=job.publish["rid"])
        if seen:  # save() raises ``err``: every level and a group part's manifest settle with it, as in process
            self._fail(job, err)
            return
        self._fail(job, err)
        if self.link.lost is not None:
            self._handed_over()  # the versions after it waited for it

    def published(self, version_id: str) -> Future[Version] | None:
        """The manifest future of this rank's part of a multi-rank version in flight, or ``None``."""
        job = self._job(version_id)
        return job.manifest if job is not None else None

    def _job(self, version_id: str) -> _Job | None:
        with self._cv:
            return self._jobs.get(version_id) or next((j for j in self._jobs.values() if j.vid == version_id), None)

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

    def _publish(self, job: _Job, wait_s: float) -> None:
        failpoint("agent.publish", job.version)
        with self._cv:
            job.copied = True
            self._cv.notify_all()
        publish = job.publish
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

    def _fail(self, job: _Job, err: BaseException) -> None:
        """A version that cannot be saved (counted as lost by the caller): every level failed with ``err``."""
        for f in job.futures.values():
            if not f.done():
                f.set_exception(err)
        if job.manifest is not None and not job.manifest.done():
            job.manifest.set_exception(err)
        self._forget(job)

    def _forget(self, job: _Job) -> None:
        self._release(job)  # (before it is gone: a flush that returns finds every release queued)
        job.published.set()
        with self._cv:
            self._jobs.pop(job.key, None)
            self._cv.notify_all()

    def _release(self, job: _Job) -> None:
        """Let the agent reuse the version's regions: this process will never copy it back out.

        Said once ``local`` is reached (the disk holds the version, and a hand-over leaves it
        there: see :meth:`_hand_over`) or once the version is forgotten. Until then the agent
        keeps the regions as this process copied them, whatever its engine did with them (see
        :meth:`tiercache.agent.requests.Requests._release`).
        """
        with self._cv:
            if job.released or self._closed:  # (closing: ``bye`` gives everything back)
                return
            job.released = True
            if self._releaser is None:
                self._releaser = threading.Thread(target=self._send_releases, name="tiercache-agent-release",
                                                  daemon=True)
                self._releaser.start()
            self._releases.put(job.key)

    def _send_releases(self) -> None:
        while (key := self._releases.get()) is not None:
            self.link.notify("release", v=key)  # (nothing, once the agent is lost)

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
                if msg.get("level") == "local":  # (set first: a hand-over from now on leaves it on the disk)
                    self._release(job)
            else:
                err = error_from_wire(msg.get("error", {}))
                if msg.get("level") == "durable":
                    if job.manifest is not None and not job.manifest.done():
                        job.manifest.set_exception(err)
                    job.published.set()
                    if msg.get("loss"):
                        self._front.losses.record(job.version, job.staged.step, err)
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

    def hand_over(self, *, wait: bool) -> None:
        """Hand what the lost agent had not finished to the front's in-process engine (see :meth:`_handed_over`)."""
        self._handed_over(wait=wait)

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
        local = job.futures["local"]
        if local.done() and local.exception() is None:
            self._leave_on_disk(job)
            return
        try:
            self._restage(job)
        except BaseException as e:  # the version cannot be saved here either (the engine never took it)
            self._front.losses.record(job.version, job.staged.step, e)
            self._fail(job, e)

    def _leave_on_disk(self, job: _Job) -> None:
        """Settle a version the agent wrote to the disk and did not finish: nothing is copied back.

        Its regions may hold other versions' bytes by now (this process released them), and the
        disk holds it: ``durable`` is reached with ``local``; every level still open (``remote``,
        ``replicated``) fails naming the agent's loss and how to copy the version on. For a
        rank's part, the group's verdict on that tier says which rank failed it.
        """
        for lvl, f in job.futures.items():
            if f.done():
                continue
            if lvl == "durable":  # the disk is a durable tier
                _settle(f, job.version, None)
                continue
            tier = next((t for t, level in TIER_LEVEL.items() if level == lvl), None)
            how = f": `tiercache promote {job.version} --to {tier}` copies it there" if tier else ""
            _settle(f, None, AgentUnavailableError(f"the node agent was lost before version {job.version} reached "
                                                   f"its {lvl!r} level; it is on the disk{how}"))
        self._forget(job)

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
        local = self._front.in_process()
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

    def prepare_arena(self, flat: Flat | None, plan: CopyPlan | None, *, wait: bool) -> None:
        """Have the agent's arena made (sized for a version of ``plan`` when ``auto``) and mapped here.

        Raises:
            AgentUnavailableError: If the agent is lost (the front prepares the in-process arena).
        """
        if self.link.arena is None and flat is not None and plan is not None:
            got = self.link.request("reserve", sid=self._structure(flat, plan, self.config.chunk_bytes))
            if "rid" in got:
                self.link.request("cancel", rid=got["rid"])
            self.link.note_arena(got.get("arena"))
        if self.link.mapping() is not None and wait:
            self.link.wait_populated()

    def wait_published(self) -> None:
        """Block until the manifests of this process's versions are in its catalog."""
        with self._cv:
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.copied:
                job.published.wait()

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
        return True

    def pending_jobs(self) -> list[str]:
        """This process's versions the agent has not settled yet, oldest first."""
        with self._cv:
            return [j.version for j in self._jobs.values()]

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers the agent is still writing ``version_id`` to."""
        return self.link.pending_tiers(version_id)

    def promote_ram(self, version: Version, read: ObjectReader, progress: Progress | None) -> int:
        """Have the agent copy a version into node RAM; return bytes copied."""
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
        if self.link.lost is not None:
            return 0
        return int(self.link.request("evict", chunks=list(chunk_ids)).get("nbytes", 0))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every version this process handed to the agent has settled (see :meth:`Engine.flush`).

        Raises:
            TimeoutError: If versions are still pending after ``timeout``; the message names them.
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

    def wait_settled(self, timeout: float | None = None) -> None:
        """As :meth:`flush` (the agent warns about its tiers itself)."""
        self.flush(timeout)

    def close(self) -> None:
        """Wait for this process's versions and close the link (the agent goes on)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                releaser = self._releaser
                self._releases.put(None)
            if releaser is not None:  # the releases in order before the link's ``bye``
                releaser.join(5.0)
            self.link.close()


def _settle(f: Future[Any], result: Any, err: BaseException | None) -> None:
    """Settle ``f`` unless the agent's last word (an event read as it died) settled it first."""
    with contextlib.suppress(InvalidStateError):
        if err is None:
            f.set_result(result)
        else:
            f.set_exception(err)


def _copy_outcome(src: Future[Any], dst: Future[Any]) -> None:
    """Settle ``dst`` as ``src`` settled, unless the agent's word settled it first."""
    if dst.done():
        return
    err = src.exception()
    _settle(dst, None if err is not None else src.result(), err)


__all__ = ["AgentBackend", "pin_mapping"]
