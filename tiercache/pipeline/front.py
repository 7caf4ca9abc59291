"""The save front: the steps every save takes before a back end writes it (docs/design.md section 3).

:class:`SaveFront` is the :class:`~tiercache.saver.Saver` of the facade, for a cache that saves in
process and for one that saves through a node agent alike. ``stage()`` runs on the training
thread and does, in this order:

1. flatten the state and plan its chunks (:class:`~tiercache.pipeline.staging.PlanCache`, once
   per structure and chunk size);
2. name the version (a new id, or the group's) and make its handle's futures; the levels no
   tier of the back end can reach fail at once (:func:`~tiercache.saver.absent_levels`);
3. have the back end reserve regions of its RAM arena (:meth:`Backend.regions`; it waits for
   room, or its policy skips the version);
4. have it start the version (:meth:`Backend.launch`) and copy every tensor into the regions
   (:class:`~tiercache.pipeline.staging.Stager`); each chunk's event is set as soon as it is
   copied, so a back end that hashes in process overlaps hashing with the copy;
5. once the copy is whole, :meth:`Backend.publish` (``staged``); an optimizer's tensors may be
   copied after ``save()`` returns (:mod:`tiercache.pipeline.deferred`): the front waits for
   those copies (:meth:`wait_deferred`) and publishes each when it is done, or
   :meth:`Backend.cancel` if it failed.

It also keeps the loss ledger (:class:`LossLedger`): versions that reached no durable tier,
reported by ``save()`` (``engine.on_error = "raise"``), ``flush()`` and ``close()``.

Two back ends exist: the in-process :class:`~tiercache.pipeline.engine.Engine`, and the node
agent's (:class:`tiercache.agent.saver.AgentBackend`). A front made with an agent back end
switches to an in-process engine when the agent is lost: the agent back end hands the versions
it had not finished over to that engine, strictly in save order, and every later save first
waits until the versions still being copied were handed over (:meth:`Backend.hand_over`), then
goes to the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tiercache.config import CacheConfig, RamConfig
from tiercache.errors import AgentUnavailableError, CacheClosedError, SkippedError
from tiercache.format import Flat, flatten
from tiercache.handle import SaveHandle, level_futures
from tiercache.manifest import RefRecord, new_version_id
from tiercache.pipeline.deferred import deferrable
from tiercache.pipeline.staging import CopyPlan, PlanCache, Stager

if TYPE_CHECKING:
    import torch

    from tiercache.layout import Layout
    from tiercache.manifest import MoveReason, Version
    from tiercache.pipeline.deferred import Owned
    from tiercache.pipeline.engine import Engine
    from tiercache.pipeline.job import Committer
    from tiercache.restore import Progress
    from tiercache.saver import ObjectReader

log = logging.getLogger("tiercache.pipeline.front")


class LossLedger:
    """Versions that reached no durable tier, and the last errors, of one cache (``stats()``).

    The front and its back ends record into the same ledger; ``save()`` (``on_error = "raise"``),
    ``flush()`` and ``close()`` report what it holds, each loss once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._losses: deque[BaseException] = deque(maxlen=64)
        #: Versions lost since the cache opened.
        self.total = 0
        #: The last errors, newest last, as one line each.
        self.recent: deque[str] = deque(maxlen=16)

    def record(self, version_id: str, step: int, err: BaseException) -> None:
        """Count a version that reached no durable tier; it is reported later (and logged now)."""
        with self._lock:
            self._losses.append(err)
            self.total += 1
            self.recent.append(f"{version_id}: reached no durable tier: {type(err).__name__}: {err}")
        log.error("version %s (step %d) reached no durable tier: %s", version_id, step, err)

    def note(self, line: str) -> None:
        """Keep an error that lost no version (a tier's failure) among the recent ones."""
        with self._lock:
            self.recent.append(line)

    def first(self) -> BaseException | None:
        """The oldest loss not reported yet, reported now; ``None`` if none."""
        with self._lock:
            return self._losses.popleft() if self._losses else None

    def take(self) -> list[BaseException]:
        """Every loss not reported yet, oldest first; they are reported now."""
        with self._lock:
            out = list(self._losses)
            self._losses.clear()
        return out


@dataclass
class Save:
    """One version on its way from the front to a back end (``ticket``: the back end's own record of it)."""

    version_id: str
    step: int
    branch: str
    meta: dict
    parent: str | None
    seq: int
    created_at: float
    flat: Flat
    plan: CopyPlan
    chunk_bytes: int
    futures: dict[str, Future[str]]
    committer: Committer | None = None
    #: The branch's head this version moves it from, in this process's view, and why (the
    #: facade worked both out: :meth:`tiercache.cache.TierCache.next_version`).
    base: RefRecord | None = None
    why: MoveReason = "save"
    ticket: Any = field(default=None, repr=False)

    @property
    def layout(self) -> Layout:
        """The version's chunk layout."""
        return self.plan.layout


class Backend(Protocol):
    """What the front asks of whatever writes its versions (the in-process engine, or the node agent).

    ``regions``, ``launch``, ``publish`` and ``cancel`` take one version through staging, in this
    order (``cancel`` in place of ``publish``); the other calls are the rest of the
    :class:`~tiercache.saver.Saver` seam, each answered for the versions this back end took.
    """

    @property
    def lost(self) -> bool:
        """Whether this back end is gone (the node agent died): the front then saves in process."""
        ...

    @property
    def has_saved(self) -> bool:
        """Whether this process wrote anything through it (its meter then saw writes)."""
        ...

    def absent_levels(self) -> dict[str, Exception]:
        """The levels no version of this back end can reach, and why (see :func:`tiercache.saver.absent_levels`)."""
        ...

    def regions(self, save: Save) -> list[torch.Tensor] | str:
        """Reserve room for ``save`` in the RAM arena; views of it to copy into, or why the policy skips it.

        Blocks while the arena is full and the policy says wait.

        Raises:
            AgentUnavailableError: The back end is lost and never took the version.
            TierFullError: If the version can never fit.
        """
        ...

    def launch(self, save: Save) -> list[threading.Event]:
        """Take ``save`` (its regions reserved); return one event per chunk, to set once it is copied."""
        ...

    def publish(self, save: Save, wait_s: float) -> None:
        """``save`` is whole in its regions (the copy took ``wait_s`` of ``save()``): it is ``staged``."""
        ...

    def cancel(self, save: Save, err: BaseException, *, seen: bool) -> None:
        """Copying ``save`` failed with ``err``; ``seen``: raised to the caller of ``save()`` (else lost)."""
        ...

    def hand_over(self, *, wait: bool) -> None:
        """A lost back end's unfinished versions go to the in-process engine, in save order (see the module)."""
        ...

    def published(self, version_id: str) -> Future[Version] | None:
        """The future of a staged version's manifest, or ``None`` if it is not in flight here."""
        ...

    def prepare_arena(self, flat: Flat | None, plan: CopyPlan | None, *, wait: bool) -> None:
        """Have the arena made and faulted in, sized for a version of ``plan`` (see :meth:`SaveFront.prepare_arena`)."""
        ...

    def wait_published(self) -> None:
        """Block until every version's manifest is in this process's catalog."""
        ...

    def wait_job(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until ``version_id`` is done; ``False`` if ``timeout`` passed first."""
        ...

    def pending_jobs(self) -> list[str]:
        """Ids of the versions still being written, oldest first."""
        ...

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers ``version_id`` is still being written to (empty if none)."""
        ...

    def promote_ram(self, version: Version, read: ObjectReader, progress: Progress | None) -> int:
        """Copy a version's chunks into the RAM tier; return bytes copied."""
        ...

    def keep_chunks(self, chunks: Sequence[tuple[str, int]], hash_algo: str, read: ObjectReader) -> int:
        """Copy chunks (id, bytes) into the RAM tier as evictable read cache; return bytes copied."""
        ...

    def evict_ram(self, chunk_ids: Iterable[str]) -> int:
        """Drop the RAM copies of chunks no version in flight needs; return bytes freed."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every version taken so far has settled (raises ``TimeoutError`` naming them)."""
        ...

    def wait_settled(self, timeout: float | None = None) -> None:
        """As :meth:`flush`, without a word about what waits for a tier that is down."""
        ...

    def close(self) -> None:
        """Finish pending writes and stop."""
        ...


class SaveFront:
    """The facade's :class:`~tiercache.saver.Saver`: the save steps once, for either back end (see the module).

    Args:
        config: The cache config.
        make_local: Makes the in-process engine (recording into the ledger it is given).
        make_remote: Makes the node agent's back end for this front, or ``None``: save in process.
    """

    def __init__(self, config: CacheConfig, *, make_local: Callable[[LossLedger], Engine],
                 make_remote: Callable[[SaveFront], Backend] | None = None) -> None:
        self.config = config
        self.losses = LossLedger()
        self._make_local = make_local
        self._local: Engine | None = None
        self._local_lock = threading.Lock()
        self._plans = PlanCache(config.pack_below)
        self._stager = Stager((config.ram or RamConfig()).resolved_copy_threads())
        #: Copies that save() deferred (see tiercache.pipeline.deferred), until each is done.
        self._deferred: set[Future[None]] = set()
        self._deferred_lock = threading.Lock()
        self._closed = False
        #: The back end saves go to unless it is lost: the node agent's, or the in-process engine.
        self.backend: Backend = make_remote(self) if make_remote is not None else self.in_process()

    # ------------------------------------------------------------------ back ends

    @property
    def local(self) -> Engine | None:
        """The in-process engine, once made (at once without an agent; with one, once it was lost)."""
        return self._local

    def in_process(self) -> Engine:
        """The in-process engine (made on first use): the back end of a cache without an agent, or after one."""
        with self._local_lock:
            if self._local is None:
                self._local = self._make_local(self.losses)
            return self._local

    def _serving(self) -> Backend:
        """The back end that takes new work: the agent's unless it was lost."""
        return self.backend if not self.backend.lost else self.in_process()

    def _switched(self) -> Backend:
        """The in-process engine, once every version the lost back end had is copied and handed over to it.

        A version saved in process next may have one of those as its parent.
        """
        self.backend.hand_over(wait=True)
        return self.in_process()

    def _backends(self) -> list[Backend]:
        """Every back end made so far, the first one first."""
        local = self._local
        return [self.backend] if local is None or local is self.backend else [self.backend, local]

    @property
    def has_saved(self) -> bool:
        """Whether this process wrote anything itself (a process that only reads writes no meter)."""
        return any(b.has_saved for b in self._backends())

    @property
    def errors_total(self) -> int:
        """Versions lost since the cache opened (``stats()``)."""
        return self.losses.total

    @property
    def recent_errors(self) -> Collection[str]:
        """The last errors, one line each (``stats()``)."""
        return self.losses.recent

    # ------------------------------------------------------------------ training thread

    def stage(self, state: object, *, step: int, branch: str, meta: dict, parent: str | None, seq: int,
              version_id: str | None = None, chunk_bytes: int | None = None, committer: Committer | None = None,
              defer: Owned | None = None, flat: Flat | None = None, base: RefRecord | None = None,
              why: MoveReason = "save") -> SaveHandle:
        """Copy ``state`` into the back end's RAM arena and have it write the version; return the handle.

        ``version_id``, ``chunk_bytes``, ``committer`` and ``flat`` serve multi-rank saves
        (:mod:`tiercache.group`): the group's agreed version id, a chunk size that splits
        replicated tensors among the ranks, the committer that has the group commit the version
        in place of the back end, and the state already flattened (``state`` is then ignored: a
        state is flattened once per save). ``defer``: the address ranges of an optimizer's
        tensors, whose copy may finish after this returns (see :mod:`tiercache.pipeline.deferred`);
        the ``staged`` future completes when it has. ``base`` and ``why``: how the branch moves
        (the facade's :meth:`~tiercache.cache.TierCache.next_version`; the node agent records it).

        Raises:
            CacheClosedError: If the cache is closed.
            TierCacheError: Only with ``engine.on_error = "raise"``: an earlier version that
                reached no durable tier (after this one is staged; its handle is on the error).
            UnsupportedStateError: If a leaf of ``state`` cannot be stored.
            TierFullError: If the version can never fit in the RAM arena.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one to save")
        backend = self._switched() if self.backend.lost else self._serving()
        t0 = time.perf_counter()
        if flat is None:
            flat = flatten(state, allow_pickle=self.config.allow_pickle)
        cb = chunk_bytes or self.config.chunk_bytes
        vid = version_id or new_version_id()
        save = Save(vid, step, branch, dict(meta), parent, seq, time.time(), flat, self._plans.get(flat, cb), cb,
                    level_futures(vid), committer, base, why)
        for lvl, err in backend.absent_levels().items():
            save.futures[lvl].set_exception(err)
        handle = SaveHandle(vid, save.futures)
        try:
            views = backend.regions(save)
        except AgentUnavailableError:  # lost before it took this version
            backend = self._switched()
            views = backend.regions(save)
        if isinstance(views, str):
            err = SkippedError(f"version at step {step} skipped: {views}")
            for f in save.futures.values():
                if not f.done():
                    f.set_exception(err)
            return self._report_earlier(handle)
        copied = backend.launch(save)
        later = deferrable(flat.tensors, defer) if defer else frozenset()
        try:
            pending = self._stager.copy_in(flat, save.plan, views, copied, later=later)
        except BaseException as e:
            backend.cancel(save, e, seen=True)
            raise
        if pending is None:
            backend.publish(save, time.perf_counter() - t0)
        else:
            with self._deferred_lock:
                self._deferred.add(pending)
            pending.add_done_callback(lambda f: self._copied_later(backend, save, f))
        return self._report_earlier(handle)

    def _copied_later(self, backend: Backend, save: Save, done: Future[None]) -> None:
        with self._deferred_lock:
            self._deferred.discard(done)
        err = done.exception()
        if err is None:
            backend.publish(save, 0.0)
            return
        # Unlike a copy in save(), nobody has seen this one fail: it counts as a lost version.
        self.losses.record(save.version_id, save.step, err)
        backend.cancel(save, err, seen=False)

    def _report_earlier(self, handle: SaveHandle) -> SaveHandle:
        """Apply ``engine.on_error`` to versions lost earlier, now that ``handle``'s version is staged.

        ``"warn"`` leaves them to ``flush()``/``close()`` (they were logged when lost);
        ``"raise"`` raises the first with ``handle`` on it, so the new version is not lost too.
        """
        if self.config.engine.on_error == "raise":
            err = self.losses.first()
            if err is not None:
                err.handle = handle  # type: ignore[attr-defined]
                raise err
        return handle

    def wait_deferred(self) -> None:
        """Block until every deferred copy started so far is done (its outcome is on its handle)."""
        with self._deferred_lock:
            pending = list(self._deferred)
        for f in pending:
            f.exception()

    def layout_of(self, flat: Flat, chunk_bytes: int | None = None) -> Layout:
        """The chunk layout a save of ``flat`` gets (planned once per structure and chunk size)."""
        return self._plans.get(flat, chunk_bytes or self.config.chunk_bytes).layout

    def prepare_arena(self, state: object | None, *, wait: bool) -> None:
        """Have the arena allocated and pre-faulted, sized for ``state`` (see :meth:`TierCache.prepare`).

        Raises:
            CacheClosedError: If the cache is closed.
            InvalidArgumentError: If the capacity is ``"auto"`` and ``state`` is ``None`` (in process).
            UnsupportedStateError: If ``state`` cannot be stored.
        """
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one")
        flat = plan = None
        if state is not None:
            flat = flatten(state, allow_pickle=self.config.allow_pickle)
            plan = self._plans.get(flat, self.config.chunk_bytes)
        try:
            self._serving().prepare_arena(flat, plan, wait=wait)
        except AgentUnavailableError:
            self.in_process().prepare_arena(flat, plan, wait=wait)

    # ------------------------------------------------------------------ the rest of the seam

    def published(self, version_id: str) -> Future[Version] | None:
        """The future of a staged version's manifest, or ``None`` if it is not in flight here."""
        for b in self._backends():
            got = b.published(version_id)
            if got is not None:
                return got
        return None

    def wait_published(self) -> None:
        """Block until every staged version's manifest is in this process's catalog."""
        for b in self._backends():
            b.wait_published()

    def wait_job(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until the back ends are done with ``version_id``; ``False`` if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for b in self._backends():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not b.wait_job(version_id, left):
                return False
        return True

    def wait_settled(self, timeout: float | None = None) -> None:
        """Wait for every version in flight (and, in process, catch-up on tiers that are up); nothing is reported."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, b in enumerate(self._backends()):
            b.wait_settled(timeout if i == 0 or deadline is None else max(0.0, deadline - time.monotonic()))

    def pending_jobs(self) -> list[str]:
        """Ids of this process's versions still being written, oldest first."""
        return [v for b in self._backends() for v in b.pending_jobs()]

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers ``version_id`` is still being written to (empty if none)."""
        out: frozenset[str] = frozenset()
        for b in self._backends():
            out |= b.pending_tiers(version_id)
        return out

    def promote_ram(self, version: Version, read: ObjectReader, progress: Progress | None) -> int:
        """Copy a version's chunks into the RAM tier (node RAM with an agent); return bytes copied."""
        return self._serving().promote_ram(version, read, progress)

    def keep_chunks(self, chunks: Sequence[tuple[str, int]], hash_algo: str, read: ObjectReader) -> int:
        """Copy chunks (id, bytes) into the RAM tier as evictable read cache; return bytes copied.

        What node RAM keeps of a multi-rank part: the first back end's (a lost agent keeps none).
        """
        return self.backend.keep_chunks(chunks, hash_algo, read)

    def evict_ram(self, chunk_ids: Iterable[str]) -> int:
        """Drop the RAM copies of chunks no version in flight needs, in every back end; return bytes freed."""
        ids = list(chunk_ids)
        return sum(b.evict_ram(ids) for b in reversed(self._backends()))

    def full_tiers(self) -> frozenset[str]:
        """Durable tiers this process's versions skip for lack of room (a node agent's placement is the agent's)."""
        local = self._local
        return local.placement.full if local is not None else frozenset()

    def record_loss(self, version_id: str, step: int, err: BaseException) -> None:
        """See :meth:`tiercache.saver.Saver.record_loss`."""
        self.losses.record(version_id, step, err)

    def take_losses(self) -> list[BaseException]:
        """Versions lost that were not reported yet, oldest first; they are reported now."""
        return self.losses.take()

    def flush(self, timeout: float | None = None, *, report: bool = True) -> None:
        """Wait until every version staged so far has settled (see :meth:`Engine.flush`).

        Raises:
            TimeoutError: If versions are still pending after ``timeout``; the message names them.
            TierCacheError: With ``report``, the first version lost since the last report.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, b in enumerate(self._backends()):
            # The first gets ``timeout`` itself: its message names the caller's figure.
            b.flush(timeout if i == 0 or deadline is None else max(0.0, deadline - time.monotonic()))
        if report:
            lost = self.losses.take()
            if lost:
                raise lost[0]

    def close(self) -> None:
        """Finish pending writes, stop every back end; raise the first lost version not yet reported.

        The caller makes sure no ``stage()`` runs concurrently (the facade holds its save lock).
        """
        if self._closed:
            return
        self._closed = True
        try:
            # Deferred copies first: they write into a back end's arena, which its close frees,
            # and each publishes its version to the back end, which must still take it.
            self.wait_deferred()
            for b in self._backends():
                b.close()
        finally:
            self._stager.close()
        lost = self.losses.take()
        if lost:
            raise lost[0]


__all__ = ["Backend", "LossLedger", "Save", "SaveFront"]
