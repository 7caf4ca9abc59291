"""One multi-rank version on its way: what the engine asks of the group, and the group's futures.

A :class:`Round` is made by :meth:`tiercache.group.view.GroupView.save` once the ranks agreed on
the version (its id, parent, chunk size). It is the engine's
:class:`~tiercache.pipeline.job.Committer` for this rank's part: the engine's writer of each
durable tier asks it which chunks this rank writes there (:meth:`owned`, known once the group's
``parts`` phase decided), and hands it the part once its chunks are durable (:meth:`commit`:
the part manifest is written, then the writer waits for the group's verdict on that tier). The
phases themselves run on the group's worker threads (:mod:`tiercache.group.phases`), which
settle the round's futures: one per durability level, the same outcome on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.errors import ConfigError, SkippedError, TierCacheError
from tiercache.group.phase_status import Status
from tiercache.handle import LEVELS, TIER_LEVEL, LevelFuture, SaveHandle
from tiercache.manifest import NodePart, RefRecord, TierOutcome, Version
from tiercache.parts import part_of

if TYPE_CHECKING:
    from tiercache.group.hashing import Split
    from tiercache.group.view import GroupView
    from tiercache.layout import Layout

log = logging.getLogger("tiercache.group.round")


@dataclass
class Plan:
    """What the coordinator decided for a version at its ``parts`` phase (rank 0 only keeps all of it).

    Attributes:
        nbytes: The version's tensor bytes, all ranks together.
        sizes: Every chunk of the version (raw length), in the ranks' order (rank 0 only).
        writers: Per node, each chunk of its part -> the rank that wrote it to the node's disk.
        part_bytes: Each rank's part manifest's size (peer copies send them).
    """

    nbytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    writers: list[dict[str, int]] = field(default_factory=list)
    part_bytes: list[int] = field(default_factory=list)


class Round:
    """One version of the group on this rank (see the module docstring).

    Args:
        view: The group view.
        vid: The version id the group agreed on.
        ref: The branch move the group commits.
        step: The training step.
        parent: The parent rank 0 proposed (the commit names the nearest durable ancestor).
        created_at: When rank 0's save was called (the group manifest's ``created_at``).
        meta: Rank 0's metadata.
        trade: Whether the ranks trade ids of chunks they hold alike (a ``trade`` phase).
        declared: The key paths the ranks declared replicated.
    """

    def __init__(self, view: GroupView, vid: str, ref: RefRecord, *, step: int, parent: str | None,
                 created_at: Any, meta: dict[str, Any], trade: bool, declared: tuple[str, ...]) -> None:
        self.view = view
        self.vid = vid
        self.ref = ref
        self.step = step
        self.parent = parent
        self.created_at = created_at
        self.meta = meta
        self.trade = trade
        self.declared = declared
        tiers = list(view.core.repo.durable)
        #: This rank's chunk ids to write per tier (set by the ``parts`` phase).
        self.owners: dict[str, Future[frozenset[str]]] = {t: Future() for t in tiers}
        #: Set when this rank's chunks and part are durable on a tier (or its write there failed).
        self.ready: dict[str, Future[None]] = {t: Future() for t in tiers}
        #: The group's verdict per tier, which the engine's writer waits for in :meth:`commit`.
        self.outcome: dict[str, Future[None]] = {t: Future() for t in tiers}
        self.futures: dict[str, Future[str]] = {lvl: LevelFuture(vid, lvl) for lvl in LEVELS}
        self.local: SaveHandle | None = None
        #: The engine's manifest of this rank's part, once hashed (``None``: the engine skipped it,
        #: it never took the version); the engine hands it over (:meth:`follow`).
        self.published: Future[Version] | None = None
        #: A version whose parts the caller writes itself (see GroupView.open_round): set once
        #: this rank's caller wrote its items, which may be before it publishes its part (DCP's
        #: coordinator publishes in ``finish()``, which DCP skips after an abort).
        self.wrote = threading.Event()
        self.stage_error: BaseException | None = None
        self.split: Split | None = None
        #: The coordinator's plan (rank 0), and what a node leader needs to commit on its disk.
        self.plan = Plan()
        self.nodes: tuple[NodePart, ...] = view.nodes
        #: Once the ``parts`` phase failed: the group's failure (every later phase is skipped).
        self.failed: BaseException | None = None
        #: Set once the ``parts`` phase is over, whatever its outcome.
        self.parts_done = threading.Event()
        self._lock = threading.Lock()
        self._settled: dict[str, BaseException | None] = {}
        self._lost = False
        self._noted = False  # why a tier missed the version is recorded (see _note_missed)

    # -- the engine's side (hasher and writer threads) --

    def split_hashing(self, layout: Layout, paths: list[str]) -> Split | None:
        """See :meth:`tiercache.pipeline.job.Committer.split_hashing`."""
        if not self.trade:
            return None
        if self.split is None:  # asked again by this process's engine after the node agent was lost
            self.split = self.view.hashing.split(self.view.hash_channel, self.vid, layout, paths, self.declared)
        return self.split

    def follow(self, published: Future[Version]) -> None:
        """See :meth:`tiercache.pipeline.job.Committer.follow`.

        The first one stays: a part the node agent took and this process saves after all (the
        agent was lost) copies the outcome of the second into the first.
        """
        if self.published is None:
            self.published = published

    def owned(self, tier: str) -> Collection[str]:
        """See :meth:`tiercache.pipeline.job.Committer.owned` (waits for the group's ``parts`` phase)."""
        return self.owners[tier].result()

    @property
    def rank(self) -> int:
        """This rank (see :attr:`tiercache.pipeline.job.Committer.rank`)."""
        return self.view.rank

    @property
    def world(self) -> int:
        """The group's size (see :attr:`tiercache.pipeline.job.Committer.world`)."""
        return self.view.world_size

    def commit(self, tier: str, manifest: Version) -> Future[None]:
        """See :meth:`tiercache.pipeline.job.Committer.commit`: write this rank's part; the group's verdict.

        A second call for a tier (a node agent was lost after handing the part over, and this
        process wrote it again) writes the part again and reports nothing twice.
        """
        try:
            self.view.core.repo.put_part(tier, part_of(manifest, self.view.rank))
        except BaseException as e:
            with contextlib.suppress(InvalidStateError):
                self.ready[tier].set_exception(e)
            raise
        with contextlib.suppress(InvalidStateError):
            self.ready[tier].set_result(None)
        return self.outcome[tier]

    def declared_writers(self) -> dict[str, int]:
        """Declared replicated chunk id -> the rank that writes it (empty if no chunk holds only declared tensors)."""
        return self.split.declared_writers if self.split is not None else {}

    # -- what this rank tells the group --

    def own_manifest(self) -> Version | Status:
        """This rank's part once hashed, or the status it sends instead (its stage or hashing failed)."""
        if self.stage_error is not None:
            return Status.of(self.stage_error)
        if self.published is None:  # the engine never took it: the arena was full and the policy said skip
            assert self.local is not None
            staged = self.local.future("staged")
            return Status.of(staged.exception() or TierCacheError(f"version {self.vid} was not staged here"))
        try:
            return self.published.result()
        except BaseException as e:
            return Status.of(e)

    def written(self, tier: str, timeout: float | None = None) -> Status | None:
        """Wait until this rank's chunks and part are durable on ``tier`` or its write there failed.

        Returns:
            The status this rank sends for the tier; ``None`` if neither happened within
            ``timeout`` seconds (``None``: no limit).
        """
        if self.stage_error is not None:
            return Status.of(self.stage_error)
        if self.local is None:  # the caller writes the part itself (see GroupView.open_round)
            wait([self.ready[tier]], timeout=timeout)
            if not self.ready[tier].done():
                return None
            err = self.ready[tier].exception()
            return Status.of(err) if err is not None else Status()
        level = self.local.future(TIER_LEVEL[tier])  # type: ignore[arg-type]
        wait([self.ready[tier], level], timeout=timeout, return_when=FIRST_COMPLETED)
        if self.ready[tier].done():
            err = self.ready[tier].exception()
            return Status.of(err) if err is not None else Status()
        if not level.done():
            return None
        return Status.of(level.exception() or TierCacheError(f"the write to {tier} ended without a commit"))

    # -- settling --

    def fail_all(self, err: BaseException) -> None:
        """The group failed the version before any tier: every level fails with ``err``."""
        self.failed = err
        for tier in self.owners:
            self.settle(tier, err)

    def settle(self, tier: str, err: BaseException | None) -> None:
        """Resolve ``tier``'s level on this rank: the version id, or ``err`` (the group's verdict).

        A tier's verdict is given once: a later one (:meth:`fail_all` after a phase raised
        past its verdict) changes nothing, unless the first raised before it resolved the
        tier's level (then the later one resolves it, so no level is left pending).
        """
        with self._lock:
            if tier in self._settled and self.outcome[tier].done():
                return
            self._settled[tier] = err
            done = len(self._settled) == len(self.outcome)
            lost = not self._lost and done and all(e is not None for e in self._settled.values())
            self._lost = self._lost or lost
            missed = None
            if done and not self._lost and not self._noted and any(e is not None for e in self._settled.values()):
                self._noted = True
                missed = dict(self._settled)
        if missed is not None:
            self._note_missed(missed)
        try:
            self._settle(tier, err, lost)
        finally:  # the levels first: a note for humans never holds them up
            if missed is not None:
                self._store_missed(missed)

    def _settle(self, tier: str, err: BaseException | None, lost: bool) -> None:
        if lost:
            self._record_loss()
        for f in (self.owners[tier], self.outcome[tier]):
            if f.done():
                continue
            if err is None:
                f.set_result(frozenset() if f is self.owners[tier] else None)  # type: ignore[arg-type]
            else:
                f.set_exception(err)
        level = self.futures[TIER_LEVEL[tier]]
        if not level.done():
            if err is None:
                level.set_result(self.vid)
            else:
                level.set_exception(err)
        with self._lock:
            # ``durable`` fails only once every tier failed: another tier's settle may have recorded
            # its success and not yet reached here, and it resolves the level when it does.
            failed = len(self._settled) == len(self.outcome) and all(e is not None for e in self._settled.values())
            durable = self.futures["durable"]
            if durable.done():
                return
            if err is None:
                durable.set_result(self.vid)
            elif failed:
                # A version the group failed everywhere is no branch head in this process's view,
                # before anyone waiting for the level hears of it.
                self.view.core.catalog.retract(self.ref)
                durable.set_exception(self._durable_error())

    def _note_missed(self, settled: dict[str, BaseException | None]) -> None:
        """Why the tiers that missed the version did, in this process's catalog (``versions()``) at once."""
        self.view.core.catalog.note_outcomes(self.vid, {
            t: TierOutcome(state="skipped", reason=str(e)) if isinstance(e, SkippedError)
            else TierOutcome(state="failed", reason=f"{type(e).__name__}: {e}")
            for t, e in settled.items() if e is not None})

    def _store_missed(self, settled: dict[str, BaseException | None]) -> None:
        """Record, on the tiers that hold the version, why the others do not (``ls`` in any process).

        As a single process's engine records its versions' (the group manifest is the version
        others list). Each tier gets it once: a node's disk from the node's leader, a tier every
        node shares from rank 0. A note for humans: an error writing it is logged, never raised.
        """
        view = self.view
        leads = view.topology.leads(view.rank)
        on = [t for t, e in settled.items() if e is None and (view.rank == 0 if t not in view.node_local else leads)]
        if not on:
            return
        try:
            view.core.catalog.store_outcomes(self.vid, on)
        except TierCacheError as e:
            log.info("could not record why version %s is not on every tier: %s", self.vid, e)

    def _record_loss(self) -> None:
        """Count the version as lost, as the pipeline counts a single process's (``stats()``, ``flush()``).

        Before the engine's writer hears the verdict (it then ends the job, and ``flush()``
        returns): a ``flush()`` that waited for the version raises its loss. Neither a skip (the
        policy's choice) nor a DCP checkpoint (``dcp.save`` raises the error on every rank itself)
        is counted.
        """
        err = self._durable_error()
        if self.local is None or isinstance(err, SkippedError):
            return
        self.view.core.saver.record_loss(self.vid, self.step, err)

    def _durable_error(self) -> BaseException:
        # The first failed tier in tier order, not in the order they settled here, so every rank
        # reports the same error.
        return next(e for t in self.outcome if (e := self._settled.get(t)) is not None)

    def handle(self) -> SaveHandle:
        """The handle ``save()`` returns: this rank's ``staged``, the group's other levels.

        A version whose parts the caller writes itself (a DCP checkpoint) is never staged:
        its ``staged`` level fails with :class:`~tiercache.errors.SkippedError`.
        """
        local = self.local
        futures = {lvl: f for lvl, f in self.futures.items() if lvl != "staged"}
        if local is None:
            futures["staged"] = _failed(self.stage_error or SkippedError(
                f"version {self.vid} was written to the durable tiers directly (through DCP), never staged in RAM"))
            for tier, lvl in TIER_LEVEL.items():
                if tier not in self.outcome:
                    futures[lvl] = _failed(ConfigError(f"no {tier} tier configured, so no {lvl!r} level"))
            return SaveHandle(self.vid, futures)
        futures["staged"] = local.future("staged")
        for tier, lvl in TIER_LEVEL.items():
            if tier not in self.outcome:  # a level with no tier behind it keeps the engine's ConfigError
                futures[lvl] = local.future(lvl)  # type: ignore[arg-type]
        if not self.outcome:
            futures["durable"] = local.future("durable")
        return SaveHandle(self.vid, futures)


def _failed(err: BaseException) -> Future[str]:
    f: Future[str] = Future()
    f.set_exception(err)
    return f


__all__ = ["Plan", "Round"]
