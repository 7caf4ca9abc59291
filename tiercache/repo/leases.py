"""Chunk leases: what a version still in flight relies on, which nothing may delete meanwhile.

A save that finds a chunk already stored on a tier writes nothing for it (deduplication) and
names it in its manifest. If an eviction or ``gc`` deleted that chunk between the check and the
commit, the committed version would name a chunk that is gone. So a pending version *leases*
every chunk it relies on for a tier (written, or found stored) in the same critical section as
the check, and deletion skips leased chunks in the same critical section as its own decision: one
of the two goes first, and the other sees it. Leases end when the version is committed there (its
manifest then protects its chunks) or fails.

A pending version is also *open* from ``save()`` until it settles, with its parent: ``gc`` keeps
the parents of open versions, so a version in flight never commits naming a collected parent.

Leases are per process; across processes ``gc_grace`` protects young objects (see
:mod:`tiercache.repo.gc`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar

from tiercache.failpoints import failpoint

T = TypeVar("T")


class Leases:
    """The chunks pending versions rely on, per tier, and the pending versions themselves. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._deleting: set[tuple[str, str]] = set()  # being deleted now: claims wait for them
        self._held: defaultdict[tuple[str, str], set[str]] = defaultdict(set)  # (tier, chunk) -> owners
        self._by_owner: defaultdict[str, set[tuple[str, str]]] = defaultdict(set)
        self._open: dict[str, str | None] = {}  # pending version -> its parent

    def open(self, owner: str, parent: str | None) -> None:
        """Register a pending version (and the parent it will name) until :meth:`close`."""
        with self._lock:
            self._open[owner] = parent

    def close(self, owner: str) -> None:
        """The version settled: drop it and every lease it holds."""
        with self._lock:
            self._open.pop(owner, None)
            for key in self._by_owner.pop(owner, set()):
                users = self._held.get(key)
                if users is not None:
                    users.discard(owner)
                    if not users:
                        del self._held[key]

    def pending(self) -> dict[str, str | None]:
        """Every pending version with the parent it will name."""
        with self._lock:
            return dict(self._open)

    def claim(self, owner: str, tier: str, ids: Iterable[str], decide: Callable[[set[str]], T]) -> T:
        """Lease ``ids`` on ``tier`` for ``owner`` and run ``decide(ids)`` in the same critical section.

        ``decide`` is where the caller checks which of them the tier already holds: no deletion
        can run between that check and the lease.
        """
        wanted = set(ids)
        with self._lock:
            # A chunk being deleted right now: wait until it is gone (then the check sees it absent).
            while any((tier, cid) in self._deleting for cid in wanted):
                failpoint("leases.claim_waits", tier, wanted)
                self._lock.wait()
            for cid in wanted:
                self._held[(tier, cid)].add(owner)
                self._by_owner[owner].add((tier, cid))
            return decide(wanted)

    def release(self, owner: str, tier: str) -> None:
        """Drop ``owner``'s leases on ``tier`` (its manifest is committed there, or the write failed)."""
        with self._lock:
            keys = {k for k in self._by_owner.get(owner, ()) if k[0] == tier}
            self._by_owner[owner] -= keys
            for key in keys:
                users = self._held.get(key)
                if users is not None:
                    users.discard(owner)
                    if not users:
                        del self._held[key]

    def deletable(self, tier: str, ids: Iterable[str], delete: Callable[[set[str]], T],
                  named: Callable[[set[str]], set[str]] = lambda ids: set()) -> T:
        """Run ``delete(free)`` with the ``ids`` no pending version leases on ``tier`` and ``named`` keeps.

        ``named(ids)`` (run under the lock) returns those of ``ids`` a committed version names
        now: a version whose lease ended since the caller decided what to delete committed
        first, so its manifest keeps them. Claims of the chunks deleted wait until ``delete``
        returns (it runs without the lock: deletes are I/O), so a save either leased a chunk
        first (and it is kept) or finds it gone (and writes it again); ``delete`` must note the
        chunks absent before it returns.
        """
        with self._lock:
            free = {cid for cid in ids if (tier, cid) not in self._held}
            free -= named(free)
            self._deleting |= {(tier, cid) for cid in free}
        try:
            return delete(free)
        finally:
            with self._lock:
                self._deleting -= {(tier, cid) for cid in free}
                self._lock.notify_all()
