"""The group's one collective layer: tagged exchanges over the job's store, always answered.

Every step of a multi-rank save or restore is an :meth:`Channel.exchange`: each rank sends its
:class:`~tiercache.group.phase_status.Status` under a tag naming the version and the phase
(``<version id>/<phase>``, never a call count alone), the coordinator (rank 0 of the group)
gathers the statuses, derives the group's verdict and publishes it, and every rank returns that
same verdict. A rank whose local work failed still answers, with an error status, so the others
learn it in that phase; the verdict names the rank.

The exchanges run on the job's key-value store (the ``torch.distributed`` store the process group
was made with), not on a gloo collective, because a store answers the questions a collective
cannot: *which* rank has not answered (its key is missing), whether it is alive (it stops beating
its heartbeat key), and what the group decided even for a rank that comes late (the verdict stays
under its tag). It also never breaks for good: a timeout fails one phase of one version, and the
next version starts clean.

The verdict is written once: the coordinator first claims the verdict's key with a
compare-and-set and only then decides (which may commit a version: an irreversible step); a rank
that gave up waiting for a coordinator that never came sets a failure in the same key with the
same compare-and-set. Whoever is first defines the outcome for every rank, so no rank can report
a version durable that another reports failed.

Costs: a rank sends one small record and reads one verdict per exchange; the coordinator reads
every rank's record in one request (they are appended to one key), so its work grows linearly
with the ranks, and no rank ever reads another rank's per-rank payload.

Failures, each named in the verdict, the same on every rank:

* a rank's error or skip: the first in rank order (``version V failed at <phase>: rank 1: ...``);
  when every rank fails alike (the group's verdict of an earlier phase), that failure as it is;
* a rank that does not answer within the timeout (``ranks [2] did not answer within 20s``);
* a rank that stops beating its heartbeat (``rank 2 is gone``): the group is then *broken*, and
  every later exchange fails at once with that reason (:class:`GroupBrokenError`);
* the store itself stops answering (its host died): broken too, with that reason.

Each thread that exchanges uses its own :class:`Channel`; all of a rank's channels share its one
store connection, and wait by polling (see :meth:`Channel._wait`).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.errors import GroupBrokenError, GroupSaveError
from tiercache.failpoints import failpoint
from tiercache.group.phase_status import Status, first_failure

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("tiercache.group.collective")

#: Who set a phase's verdict: the coordinator, or a rank that gave up waiting for it.
_COORDINATOR = b"coordinator"
_GAVE_UP = b"gave-up"
_RECORD = struct.Struct(">II")  # rank, length of the status that follows
#: The first pause while polling for a key; it doubles up to :attr:`Collective.poll`.
_FIRST_POLL = 0.0005
#: Keys per ``multi_set`` of the ranks' own verdicts: the TCPStore server's work per request grows
#: with the square of its keys (4096 keys in one request: ~50 ms; 16 requests of 256: ~5 ms).
_SET_KEYS = 256


@dataclass(frozen=True)
class Verdict:
    """What the group decided at one phase.

    Attributes:
        status: The group's outcome: ``ok`` with the common payload, or the failure every rank
            reports (:meth:`Status.error_object` rebuilds it).
        mine: This rank's own share of the decision (``None`` unless the decider gave ranks
            payloads of their own).
    """

    status: Status
    mine: Any = None

    @property
    def ok(self) -> bool:
        """Whether the phase went well on every rank."""
        return self.status.ok

    def raise_failure(self, *, wrap: bool = False) -> None:
        """Raise the group's failure, if any (the same error on every rank; see :meth:`Status.error_object`)."""
        if not self.status.ok:
            raise self.status.error_object(wrap=wrap)


@dataclass(frozen=True)
class Decision:
    """What a decider returns: the common payload and, optionally, one payload per rank."""

    payload: Any = None
    per_rank: Sequence[Any] | None = None


class Blame(Exception):
    """Raised by a decider: the phase fails on every rank with ``error``, naming ``ranks`` as its cause.

    The coordinator decides, but the fault it found may be another rank's (one out of step
    with the others): the verdict's prefix names that rank, not the coordinator.

    Args:
        ranks: The ranks at fault.
        error: The error every rank raises (its type and message).
        extra: Small JSON-able facts the failed verdict carries to every rank (see :class:`Status`).
    """

    def __init__(self, ranks: Sequence[int], error: Exception, **extra: Any) -> None:
        super().__init__(str(error))
        self.ranks = list(ranks)
        self.error = error
        self.extra = extra


#: ``decide(statuses)`` runs on the coordinator once every rank answered ``ok``; what it raises
#: fails the phase on every rank (naming rank 0 and the error, or the ranks a :class:`Blame` names).
Decide = Callable[[list[Status]], Decision]


@dataclass
class _Beats:
    """What the watcher last saw of one rank's heartbeat."""

    value: int = -1
    since: float = field(default_factory=time.monotonic)


class Collective:
    """One rank's end of the group's control plane.

    Args:
        store: The store every rank of the group shares (already prefixed for this group view).
        rank: This rank in the group.
        world: The group's size.
        timeout: How long a phase waits for a rank that has not answered.
        heartbeat: Seconds between this rank's heartbeats (default: a quarter of the timeout, at
            most 1 s).
        dead_after: A rank whose heartbeat has not moved for this long is gone (default: three
            quarters of the timeout, at most 10 s, at least 3 heartbeats), so that a dead rank is
            told from a slow one before the timeout.
        name: How a rank is named in messages (e.g. ``rank 2 (node b)``).
    """

    def __init__(
        self, store: dist.Store, rank: int, world: int, *, timeout: float, heartbeat: float | None = None,
        dead_after: float | None = None, name: Callable[[int], str] | None = None,
    ) -> None:
        heartbeat = heartbeat if heartbeat is not None else min(1.0, timeout / 4)
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.dead_after = dead_after if dead_after is not None else max(3 * heartbeat, min(0.75 * timeout, 10.0))
        self.name = name or (lambda r: f"rank {r}")
        #: The longest pause between two polls of a key: longer in big groups, so that the ranks'
        #: polls stay a small load on the store.
        self.poll = 0.05 * max(1.0, world / 256)
        self._store = store
        self._lock = threading.Lock()
        self._broken: GroupBrokenError | None = None
        #: Ranks found gone (they never read a verdict again).
        self._dead: set[int] = set()
        self._closed = threading.Event()
        #: Verdicts this rank (the coordinator) published that some rank may not have read yet.
        self._published: list[str] = []
        self._beater = threading.Thread(target=self._beat, name="tiercache-heartbeat", daemon=True)
        self._beater.start()

    # ------------------------------------------------------------------ state

    @property
    def broken(self) -> GroupBrokenError | None:
        """Why the group can no longer save, or ``None``."""
        with self._lock:
            return self._broken

    def mark_broken(self, dead: Sequence[int] = ()) -> GroupBrokenError:
        """Record that the group is broken: ranks ``dead`` are gone, or (none given) the store is.

        The first reason stays. Its message names no phase, so every rank that learns it in
        whichever phase reports the same.
        """
        if dead:
            reason = (f"the process group is broken: {_names(self, dead)} {'is' if len(dead) == 1 else 'are'} gone "
                      f"(no heartbeat for {self.dead_after:g}s); restart the job")
        else:
            # The store carries the verdicts: a rank that lost it before reading one cannot learn
            # it, while ranks that read it first may report that version committed (it may be).
            reason = ("the process group is broken: the job's store stopped answering (its host, rank 0 or the "
                      "launcher, is gone), so a version whose verdict this rank had not read is reported failed "
                      "here though other ranks may report it durable (a restore after the restart finds it if it "
                      "was committed); the store must outlive the ranks: launch with torchrun, whose agent hosts "
                      "it, not with a store rank 0 hosts (mp.spawn, init_method='tcp://'); restart the job")
        with self._lock:
            self._dead |= set(dead)
            if self._broken is None:
                self._broken = GroupBrokenError(reason)
                log.error("%s", reason)
            return self._broken

    def broken_status(self) -> Status | None:
        """The status every phase fails with once the group is broken (``None`` while it is not)."""
        broken = self.broken
        return None if broken is None else Status("error", error="GroupBrokenError", message=str(broken))

    def channel(self) -> Channel:
        """A channel for one thread (it keeps that thread's view of the other ranks' heartbeats)."""
        return Channel(self)

    @property
    def store(self) -> dist.Store:
        """The store (one connection, shared by this rank's threads: every request is short)."""
        return self._store

    def close(self, linger: float = 5.0) -> None:
        """Stop the heartbeat (the group's other ranks will take this rank for gone).

        The coordinator first waits up to ``linger`` seconds for the ranks to read the verdicts
        it published: its process may host the store, which goes with it. Not for ranks that are
        gone (known so, or whose heartbeat stops while it waits): they will never read.
        """
        end = time.monotonic() + linger
        with self._lock:
            tags = list(self._published)
        watch = Channel(self)
        others = [r for r in range(self.world) if r != self.rank]
        gone: set[int] = set()
        looked = 0.0
        try:
            while tags and time.monotonic() < end:
                if time.monotonic() - looked >= self.heartbeat:  # heartbeats move that often, no faster
                    looked = time.monotonic()
                    gone = self._dead | set(watch._gone(others))
                tags = [t for t in tags if self._store.check([f"v/{t}"])
                        and int(self._store.add(f"v/{t}/read", 0)) < self.world - len(gone)]
                time.sleep(0.01)
        except Exception as e:  # the store is gone already: nobody is left to read
            log.debug("not waiting for verdicts to be read: %s", _first_line(e))
        self._closed.set()

    def published(self, tag: str) -> None:
        """Note a verdict this rank published (see :meth:`close`); keeps the most recent ones."""
        with self._lock:
            self._published.append(tag)
            del self._published[:-64]

    # ------------------------------------------------------------------ liveness

    def _beat(self) -> None:
        key = f"hb/{self.rank}"
        while not self._closed.is_set():
            try:
                self._store.add(key, 1)
            except Exception as e:  # the store's host is gone: every channel notices on its next request
                log.debug("heartbeat stopped: %s", _first_line(e))
                return
            self._closed.wait(self.heartbeat)

    def beat_values(self, store: dist.Store, ranks: Sequence[int]) -> dict[int, int]:
        """The current heartbeat counters of ``ranks``."""
        return {r: int(store.add(f"hb/{r}", 0)) for r in ranks}


class Channel:
    """One thread's way to exchange with the group (see the module docstring)."""

    def __init__(self, group: Collective) -> None:
        self.group = group
        self._beats: dict[int, _Beats] = {}

    def _client(self) -> dist.Store:
        return self.group.store

    # ------------------------------------------------------------------ the exchange

    def exchange(self, tag: str, mine: Status, *, what: str, decide: Decide | None = None,
                 about: Any = None, late: str | None = None, patience: float | None = None) -> Verdict:
        """Send this rank's status for phase ``tag`` and return the group's verdict.

        Every rank of the group calls this with the same ``tag`` (``<version>/<phase>``); it
        returns once the coordinator published the verdict (or the phase failed by timeout or a
        rank's death, which the verdict then says).

        Args:
            tag: The phase's tag, unique in the group's lifetime (it names the store keys).
            mine: This rank's status.
            what: What the phase is, for messages (``"version 01J.. at hashing"``).
            decide: Run on the coordinator when every rank answered ``ok``; its result is the
                verdict's payload (and each rank's own payload). Only rank 0's is used.
            about: What this rank's call is about (JSON-able): a failed verdict carries that of
                the rank that set it (``extra["about"]``), so a rank that comes late learns
                what the others' call was.
            late: What a rank that does not answer in time was still doing, for the message
                (``"still writing to s3"``).
            patience: On the coordinator: how long it still waits for the ranks that have not
                posted (default: the group's timeout); less when it waited for them already.

        Returns:
            The verdict (never raises for a failed phase: see :meth:`Verdict.raise_failure`).
        """
        group = self.group
        try:
            if group.broken is not None:
                # Without posting: the phase fails for the group (this rank sets the verdict unless
                # the coordinator decides it already), so a rank that does not know yet learns it.
                return self._settle_broken(tag)
            self._post(tag, mine)
            verdict = (self._coordinate(tag, what, decide, about, late, patience) if group.rank == 0
                       else self._await(tag, what, about, late))
        except Exception as e:
            if not _is_store_error(e):
                raise
            log.debug("%s: the store failed: %s", what, _first_line(e))
            group.mark_broken()
            return Verdict(group.broken_status())  # type: ignore[arg-type]
        dead = verdict.status.extra.get("dead")
        if dead:
            group.mark_broken(dead)
        return verdict

    def _settle_broken(self, tag: str) -> Verdict:
        """The verdict of ``tag`` once the group is broken: the broken status, unless a verdict is decided."""
        status = self.group.broken_status()
        assert status is not None
        store = self._client()
        if store.compare_set(f"c/{tag}", b"", _GAVE_UP) == _GAVE_UP:
            store.set(f"v/{tag}", status.encode())
            return self._read(tag, status)
        return self._verdict(tag)

    def send(self, key: str, data: bytes) -> None:
        """Leave ``data`` for the one rank that :meth:`receive` s it (a payload too big for a verdict)."""
        self._client().set(f"d/{key}", data)

    def receive(self, key: str, what: str) -> bytes:
        """Wait (up to the group's timeout) for what another rank :meth:`send` s under ``key``; take it.

        Raises:
            GroupSaveError: If nothing came in time.
        """
        if not self._wait(f"d/{key}", self.group.timeout):
            raise GroupSaveError(f"{what}: nothing came within {self.group.timeout:g}s")
        store = self._client()
        data = store.get(f"d/{key}")
        store.delete_key(f"d/{key}")
        return data

    def _post(self, tag: str, mine: Status) -> None:
        store = self._client()
        data = mine.encode()
        store.append(f"x/{tag}", _RECORD.pack(self.group.rank, len(data)) + data)
        failpoint("group.posted", tag, self.group.rank)
        if int(store.add(f"x/{tag}/n", 1)) == self.group.world:
            store.set(f"x/{tag}/all", b"1")

    def posted(self, tag: str) -> list[Status | None]:
        """The statuses the ranks posted so far for phase ``tag`` (``None``: not yet), before its verdict.

        For a rank whose own status waits on the others' (the coordinator of a DCP checkpoint
        learns there that another rank's write failed, and DCP will never call its ``finish``).
        """
        return self._records(tag)

    def arrive(self, tag: str) -> None:
        """Tell the ranks that the coordinator is at phase ``tag``, though its own status is not ready yet.

        A rank that gives up on the phase then names the ranks that never came, not the
        coordinator: a DCP checkpoint's coordinator waits for DCP's ``finish()``, which a rank
        whose DCP step failed before it wrote holds up.
        """
        self._client().set(f"a/{tag}", b"")

    def decided(self, tag: str) -> bool:
        """Whether the verdict of phase ``tag`` is claimed already (by the coordinator or a rank that gave up)."""
        return bool(self._client().check([f"c/{tag}"]))

    def _records(self, tag: str) -> list[Status | None]:
        store = self._client()
        out: list[Status | None] = [None] * self.group.world
        if not store.check([f"x/{tag}"]):
            return out
        data = store.get(f"x/{tag}")
        ranks: list[int] = []
        blobs: list[bytes] = []
        pos = 0
        while pos + _RECORD.size <= len(data):
            rank, n = _RECORD.unpack_from(data, pos)
            pos += _RECORD.size
            if 0 <= rank < len(out):
                ranks.append(rank)
                blobs.append(data[pos : pos + n])
            pos += n
        for rank, status in zip(ranks, Status.decode_all(blobs), strict=True):
            out[rank] = status
        return out

    def _wait(self, key: str, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``key``; whether it is there.

        Polls with a growing interval rather than blocking in the store: a blocking wait would
        hold the rank's one store connection (its other threads' requests would queue behind it),
        a connection whose blocking wait timed out can answer later requests with that wait's
        reply, and a new connection sometimes takes seconds to open.
        """
        store = self._client()
        end = time.monotonic() + seconds
        pause = _FIRST_POLL
        while True:
            if store.check([key]):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, self.group.poll)

    def _slice(self) -> float:
        return max(self.group.poll, min(1.0, self.group.heartbeat))

    def _gone(self, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat has not moved for the group's ``dead_after``."""
        if not ranks:
            return []
        now = time.monotonic()
        values = self.group.beat_values(self._client(), ranks)
        out = []
        for r, v in values.items():
            seen = self._beats.setdefault(r, _Beats(v, now))
            if v != seen.value:
                seen.value, seen.since = v, now
            elif now - seen.since >= self.group.dead_after:
                out.append(r)
        return out

    def _coordinate(self, tag: str, what: str, decide: Decide | None, about: Any = None,
                    late: str | None = None, patience: float | None = None) -> Verdict:
        group = self.group
        deadline = time.monotonic() + (group.timeout if patience is None else patience)
        self._client().set(f"a/{tag}", b"")  # the others give this coordinator its whole timeout from now
        self._beats.clear()
        failure: Status | None = None
        pause = 0.01  # a first look soon: a missing rank's heartbeat is watched from then on
        while not self._wait(f"x/{tag}/all", min(pause, max(0.0, deadline - time.monotonic()))):
            pause = self._slice()
            if group.broken is not None:  # another phase found a rank gone: this one cannot complete
                return self._settle_broken(tag)
            statuses = self._records(tag)
            missing = [r for r, s in enumerate(statuses) if s is None]
            if not missing:  # every rank posted: the last one between the wait and the read, or it
                break  # died between its post and its "all" signal (waiting on would never end)
            dead = self._gone(missing)
            if dead:
                failure = self._dead(what, dead)
                break
            if time.monotonic() >= deadline:
                failure = self._missing(what, missing, late=late)
                break
        statuses = self._records(tag)
        if failure is None:
            bad = first_failure(statuses)
            if bad is not None:
                rank, s = bad
                said = f"{s.error}: {s.message}" if s.kind == "error" else s.message
                # Every rank failing alike is the group's verdict of an earlier phase: pass it on
                # as it is, not as an error of the first rank.
                alike = all(r == s for r in statuses)
                verb = "skipped" if s.kind == "skip" else "failed"  # a skip is some rank's policy's choice
                failure = s if alike else s.failed(f"{what} {verb}: {group.name(rank)}: {said}")
        # Claim the verdict before deciding (deciding may commit the version): a rank that gave up
        # on this coordinator claimed it first, and then its failure is the group's outcome.
        store = self._client()
        if store.compare_set(f"c/{tag}", b"", _COORDINATOR) != _COORDINATOR:
            return self._verdict(tag)
        per_rank: Sequence[Any] | None = None
        if failure is None:
            try:
                decision = decide([s for s in statuses if s is not None]) if decide is not None else Decision()
                verdict = Status("ok", decision.payload)
                per_rank = decision.per_rank
            except Blame as b:  # another rank's fault, which the coordinator found
                err = b.error
                verdict = Status.of(err).failed(f"{what} failed: {_names(group, b.ranks)}: {type(err).__name__}: {err}",
                                                **b.extra)
            except Exception as e:  # a local error of the coordinator fails the phase, never the group
                log.error("%s: the coordinator's decision failed: %s", what, e)
                verdict = Status.of(e).failed(f"{what} failed: {group.name(0)}: {type(e).__name__}: {e}")
        else:
            verdict = failure
        if per_rank is not None:
            values = [Status("ok", p).encode() for p in per_rank]
            for at in range(0, group.world, _SET_KEYS):  # the store's multi_set is quadratic in its keys
                store.multi_set([f"v/{tag}/{r}" for r in range(at, min(at + _SET_KEYS, group.world))],
                                values[at : at + _SET_KEYS])
            verdict = Status(verdict.kind, verdict.payload, verdict.error, verdict.message,
                             {**verdict.extra, "per_rank": True})
        if about is not None and not verdict.ok:
            verdict = verdict.failed(verdict.message, about=about)
        store.set(f"v/{tag}", verdict.encode())
        group.published(tag)
        for key in (f"x/{tag}", f"x/{tag}/n", f"x/{tag}/all"):
            store.delete_key(key)
        return self._read(tag, verdict)

    def _missing(self, what: str, missing: list[int], named: list[int] | None = None, late: str | None = None
                 ) -> Status:
        """The failure of a phase some ranks did not answer in time (``named``: those to blame, default all)."""
        group = self.group
        return Status("error", error="GroupSaveError", extra={"missing": missing}, message=(
            f"{what} failed: {_names(group, named or missing)} did not answer within {group.timeout:g}s"
            + (f" ({late})" if late else "")))

    def _dead(self, what: str, dead: list[int]) -> Status:
        group = self.group
        return Status("error", error="GroupBrokenError", extra={"dead": dead}, message=(
            f"{what} failed: {_names(group, dead)} {'is' if len(dead) == 1 else 'are'} gone (no heartbeat for "
            f"{group.dead_after:g}s): the process group is broken; restart the job"))

    def _await(self, tag: str, what: str, about: Any = None, late: str | None = None) -> Verdict:
        group = self.group
        start = time.monotonic()
        # The coordinator waits up to the timeout for the slowest rank from when it arrives, then
        # decides: give it that and a margin before taking it for stuck.
        patience = group.timeout + max(1.0, group.timeout / 10)
        arrived = False
        self._beats.clear()
        self._gone([0])  # the coordinator's heartbeat is watched from now
        while not self._wait(f"v/{tag}", self._slice()):
            if group.broken is not None:
                return self._settle_broken(tag)
            gone = self._gone([0])
            store = self._client()
            claimed = store.check([f"c/{tag}"])
            if not arrived and store.check([f"a/{tag}"]):
                arrived, start = True, time.monotonic()
            if gone:
                failure = self._dead(what, [0])
            elif not claimed and time.monotonic() - start >= patience:
                statuses = self._records(tag)
                missing = [r for r, s in enumerate(statuses) if s is None] or [0]
                # A coordinator that arrived (see arrive()) waits on the ranks that never came.
                failure = self._missing(what, missing, [r for r in missing if r or not arrived] or missing, late)
            else:
                continue  # not yet; or the coordinator is deciding (maybe committing): wait while it lives
            if about is not None:
                failure = failure.failed(failure.message, about=about)
            if store.compare_set(f"c/{tag}", b"", _GAVE_UP) == _GAVE_UP:
                store.set(f"v/{tag}", failure.encode())
            elif gone:  # the coordinator claimed it and died deciding: nobody will write the verdict
                return Verdict(failure)
        return self._verdict(tag)

    def _verdict(self, tag: str) -> Verdict:
        """The verdict of ``tag`` once someone wrote it."""
        while not self._wait(f"v/{tag}", self._slice()):
            if self._gone([0]):
                self.group.mark_broken([0])
                return Verdict(self._dead(f"phase {tag}", [0]))
        return self._read(tag, Status.decode(self._client().get(f"v/{tag}")))

    def _read(self, tag: str, verdict: Status) -> Verdict:
        store = self._client()
        rank = self.group.rank
        mine = None
        if verdict.extra.get("per_rank"):
            key = f"v/{tag}/{rank}"
            mine = Status.decode(store.get(key)).payload
            store.delete_key(key)
        if rank in verdict.extra.get("missing", ()):
            for key in (f"x/{tag}", f"x/{tag}/n"):  # this rank came late and re-made them
                store.delete_key(key)
        # The last rank to read the verdict removes it (a rank that never comes leaves it behind,
        # so that it learns the outcome if it comes late).
        if int(store.add(f"v/{tag}/read", 1)) == self.group.world:
            for key in (f"v/{tag}", f"v/{tag}/read", f"c/{tag}", f"a/{tag}"):
                store.delete_key(key)
        return Verdict(verdict, mine)


def _names(group: Collective, ranks: Sequence[int]) -> str:
    return ", ".join(group.name(r) for r in ranks)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _is_timeout(e: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(e, dist.DistStoreError)


def _is_store_error(e: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(e, dist.DistError)


__all__ = ["Blame", "Channel", "Collective", "Decide", "Decision", "Verdict"]
