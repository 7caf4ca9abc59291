"""The background phases of a multi-rank version, each one exchange of the group (docs/design.md section 7).

After ``save()`` staged a rank's part (the memcpy, on the training thread), the group goes on
without it, on worker threads of each rank, every version in save order:

1. ``<v>/parts`` (one worker): every rank sends a small summary of its part once hashed (its
   chunk ids and sizes, how big its part is) or why it has none (its stage failed, the arena was
   full and the policy skipped it). The coordinator decides once, for every tier, which rank
   writes which chunk (:mod:`tiercache.group.owners`) and sends each rank its own share, and
   every rank the version's total size: with what the group agreed on before, that is all any
   rank needs to write the group manifest (:func:`tiercache.parts.group_header`). This is the
   only time per version anything is gathered about the parts, and it is O(chunks), never
   O(leaves).
2. ``<v>/<tier>`` (one worker per durable tier): every rank sends whether its chunks and its
   part manifest are durable there. On a tier every node shares (S3), the coordinator then
   commits the group manifest and moves the ref, inside the exchange (it claimed the verdict
   first, so no rank can give up on it half-way). On a node-local tier each node's leader
   commits on its node's disk, and ``<v>/<tier>/commit`` says whether every node did.
3. ``<v>/peers`` (with peer copies): see :mod:`tiercache.group.peers`.

A phase that fails (a rank's error or skip, a rank that does not answer in time or dies) fails
that level of the version on every rank with the same error; a version that failed everywhere is
never a parent (the next commit names the nearest durable ancestor) and its branch move is
taken back.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from tiercache.errors import GroupSaveError, TierCacheError
from tiercache.failpoints import failpoint
from tiercache.group.collective import Channel, Decision
from tiercache.group.hashing import trade
from tiercache.group.owners import plan_parts
from tiercache.group.phase_status import Status
from tiercache.group.round import Round
from tiercache.manifest import Version
from tiercache.parts import group_header, part_of

if TYPE_CHECKING:
    from tiercache.group.peers import Replicator
    from tiercache.group.view import GroupView

log = logging.getLogger("tiercache.group.phases")


class Worker:
    """One thread that runs one kind of phase for every version, in save order, on its own channel."""

    def __init__(self, view: GroupView, name: str, run: Callable[[Round, Channel], None]) -> None:
        self._run = run
        self._channel = view.collective.channel()
        self._queue: queue.Queue[Round | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"tiercache-group-{name}", daemon=True)
        self._thread.start()

    def submit(self, rnd: Round) -> None:
        """Run the phase for ``rnd`` after the versions submitted before it."""
        self._queue.put(rnd)

    def close(self) -> None:
        """Stop once every submitted version is through."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (rnd := self._queue.get()) is not None:
            try:
                self._run(rnd, self._channel)
            except Exception as e:  # a bug here must not leave the version's futures pending forever
                log.exception("version %s: a group phase failed", rnd.vid)
                rnd.fail_all(e)


class Phases:
    """The workers of one group view (see the module docstring)."""

    def __init__(self, view: GroupView, replicator: Replicator | None = None) -> None:
        self.view = view
        self._workers = [Worker(view, "parts", self._parts)]
        self._workers += [Worker(view, tier, lambda rnd, ch, tier=tier: self._tier(tier, rnd, ch))
                          for tier in view.core.repo.durable]
        if replicator is not None:
            self._workers.append(Worker(view, "peers", replicator.run))

    def submit(self, rnd: Round) -> None:
        """Start the background phases of a staged (or failed-to-stage) version."""
        for w in self._workers:
            w.submit(rnd)

    def close(self) -> None:
        """Stop once every submitted version is settled."""
        for w in self._workers:
            w.close()

    # ------------------------------------------------------------------ parts

    def _parts(self, rnd: Round, ch: Channel) -> None:
        view = self.view
        patience: float | None = None  # how long the coordinator's exchange still waits for ranks
        try:
            failpoint("group.parts", f"{rnd.vid}/parts")
            if rnd.local is None and view.rank == 0:
                own, patience = self._coordinator_part(rnd, ch)
            else:
                own = rnd.own_manifest()
        except Exception as e:
            own = Status.of(e)
        if rnd.trade and isinstance(own, Status) and (rnd.stage_error is not None or rnd.published is None):
            # This rank never hashed the version, so its hasher never traded ids: answer for it.
            with contextlib.suppress(TierCacheError):  # the parts phase below fails it with this rank's reason
                trade(ch, rnd.vid, None, None, failure=own.error_object())
        if isinstance(own, Version):
            status = Status("ok", {"chunks": [[c.id, c.nbytes] for c in own.chunks], "nbytes": own.nbytes,
                                   "part": len(part_of(own, view.rank).to_json())})
        else:
            status = own
        verdict = ch.exchange(f"{rnd.vid}/parts", status, what=f"version {rnd.vid} at staging",
                              decide=lambda statuses: self._assign(rnd, statuses), patience=patience)
        try:
            if not verdict.ok:
                rnd.fail_all(verdict.status.error_object(wrap=True))
                return
            assert isinstance(own, Version)
            mine: dict[str, Any] = verdict.mine
            rnd.plan.nbytes = verdict.status.payload
            for tier, positions in mine.items():
                rnd.owners[tier].set_result(frozenset(own.chunks[i].id for i in positions))
        finally:
            rnd.parts_done.set()  # the tier phases go on (or skip the version) from here, on every rank alike

    def _coordinator_part(self, rnd: Round, ch: Channel) -> tuple[Version | Status, float | None]:
        """Rank 0's part of a DCP checkpoint, published in ``finish()``, or why there will be none.

        DCP calls ``finish()`` on its coordinator only once every rank's ``write_data`` went
        well; after an abort it never does. So while waiting, watch what the others posted for
        the ``parts`` phase: once one failed, the checkpoint is aborted (rank 0 skips, and the
        group's verdict names that rank and its error); once all posted ``ok``, ``finish()`` is
        due within the group's timeout, or DCP aborted in its own step (a planner's error); and
        once a rank gave up on the phase (one never came), its failure is the verdict.

        A rank whose DCP step failed before its ``write_data`` never opens the version, so it
        never posts; with no other rank to give up on it (two ranks), rank 0 does: once its own
        items are written, it gives the ranks that have not posted the group's timeout, as the
        coordinator of any phase does, and its exchange then fails the version naming them.

        Returns:
            The part or status, and how long the exchange still waits for the ranks that have
            not posted (``0``: this waited for them already; ``None``: the group's timeout).
        """
        view = self.view
        published = rnd.published
        assert published is not None
        tag = f"{rnd.vid}/parts"
        ch.arrive(tag)  # a rank that gives up on the phase names the ranks that never came, not this one
        aborted = Status("skip", message=f"dcp.save was aborted: DCP never finished version {rnd.vid} here",
                         extra={"follows": True})
        since: float | None = None  # since when every other rank posted ok
        wrote: float | None = None  # since when this rank's items are written and some rank has not posted
        while True:
            with contextlib.suppress(FutureTimeout):
                published.result(timeout=max(view.collective.poll, 0.05))
            if published.done():
                return rnd.own_manifest(), None
            if view.collective.broken is not None:
                return Status.of(view.collective.broken), None
            others = ch.posted(tag)[1:]
            if ch.decided(tag) or any(s is not None and not s.ok for s in others):
                return aborted, None
            now = time.monotonic()
            if all(s is not None for s in others):
                since = since if since is not None else now
                if now - since >= view.collective.timeout:
                    return Status.of(GroupSaveError(
                        f"dcp.save did not finish version {rnd.vid} within {view.collective.timeout:g}s of the "
                        "other ranks' writes (DCP aborted it after every rank wrote its part)")), None
            elif rnd.wrote.is_set():
                wrote = wrote if wrote is not None else now
                if now - wrote >= view.collective.timeout:
                    return aborted, 0.0

    def _assign(self, rnd: Round, statuses: list[Status]) -> Decision:
        """The coordinator's decision at ``parts``: who writes what, and what the group manifest says."""
        view = self.view
        plan = plan_parts([s.payload for s in statuses], list(view.core.repo.durable), view.node_local,
                          view.topology, rnd.declared_writers())
        rnd.plan.writers, rnd.plan.part_bytes, rnd.plan.sizes = plan.writers, plan.part_bytes, plan.sizes
        return Decision(plan.nbytes, plan.per_rank)

    # ------------------------------------------------------------------ tiers

    def _tier(self, tier: str, rnd: Round, ch: Channel) -> None:
        view = self.view
        rnd.parts_done.wait()
        if rnd.failed is not None:
            return
        status = self._written(tier, rnd, ch)
        try:
            failpoint("group.write", f"{rnd.vid}/{tier}")
        except Exception as e:
            status = Status.of(e)
        pacer = view.core.repo.durable[tier].pacer
        throttled = pacer.take_throttled() if pacer is not None else 0
        if status.ok:
            status = Status("ok", throttled)
        shared = tier not in view.node_local
        verdict = ch.exchange(f"{rnd.vid}/{tier}", status, what=f"version {rnd.vid} on {tier}",
                              decide=(lambda s: self._commit_shared(tier, rnd, s)) if shared else None,
                              late=f"still writing to {tier}")
        if pacer is not None and not throttled and verdict.ok and verdict.status.payload:
            pacer.slow_down()  # the ranks share the store's key prefixes: one rank's SlowDown is the group's
        if verdict.ok and not shared:
            verdict = ch.exchange(f"{rnd.vid}/{tier}/commit", self._commit_node(tier, rnd),
                                  what=f"version {rnd.vid} on {tier}")
        if not verdict.ok:
            rnd.settle(tier, verdict.status.error_object(wrap=True))
            return
        try:
            view.adopt(rnd, tier)
        except Exception as e:  # this process's view only: the group committed the version all the same
            log.warning("version %s is committed on %s but this process could not note it: %s", rnd.vid, tier, e)
        rnd.settle(tier, None)

    def _written(self, tier: str, rnd: Round, ch: Channel) -> Status:
        """This rank's status at ``<v>/<tier>``: its write there done or failed, or given up with the group.

        A write that hangs (an S3 that accepts connections and never answers, for minutes of
        client timeouts and retries) must not hold this rank's level of the tier past the
        group's verdict: once the coordinator (or a rank that gave up on it) decided the phase
        without this rank, it was failed naming this rank, and this rank reports that verdict
        now, as the others did. Its write goes on in the engine, whose outcome is that verdict.
        """
        tag = f"{rnd.vid}/{tier}"
        collective = self.view.collective
        # Looked up as often as a heartbeat moves: a small load on the store for a long write.
        pause = max(collective.poll, min(1.0, collective.heartbeat))
        while (status := rnd.written(tier, timeout=pause)) is None:
            if ch.decided(tag) or collective.broken is not None:
                return Status.of(GroupSaveError(f"{collective.name(collective.rank)}'s write of version {rnd.vid} to "
                                                f"{tier} had not ended when the group decided"))
        return status

    def _header(self, rnd: Round) -> Version:
        view = self.view
        cfg = view.cache.config
        return group_header(id=rnd.vid, parent=view.durable_parent(rnd), branch=rnd.ref.name, step=rnd.step,
                            created_at=rnd.created_at, meta=rnd.meta, hash_algo=cfg.hash, ranks=view.world_size,
                            nbytes=rnd.plan.nbytes, nodes=rnd.nodes)

    def _commit_shared(self, tier: str, rnd: Round, statuses: list[Status]) -> Decision:
        """The coordinator commits the version on a tier every node shares (every rank's part is there)."""
        failpoint("group.commit", f"{rnd.vid}/{tier}")
        self.view.core.repo.commit(tier, self._header(rnd), rnd.ref, held=())
        return Decision(any(s.payload for s in statuses))  # whether some rank was throttled

    def _commit_node(self, tier: str, rnd: Round) -> Status:
        """A node's leader commits the version on its node's disk (its node's parts are there)."""
        view = self.view
        if not view.topology.leads(view.rank):
            return Status()
        try:
            failpoint("group.commit", f"{rnd.vid}/{tier}")
            view.core.repo.commit(tier, self._header(rnd), rnd.ref, held=(),
                                   node=view.topology.names[view.node])
        except Exception as e:
            return Status.of(e)
        return Status()


__all__ = ["Phases", "Worker"]
