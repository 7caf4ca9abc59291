"""The RAM arena as staging area and read cache: regions, pins and least-recently-used eviction.

Every save stages its chunks in arena regions. Once hashed, a chunk's region is handed to the RAM
tier (:class:`~tiercache.tiers.ram.RamTier`, deduplicated against a chunk already there) and
*pinned* while a version in flight needs it. When the last version needing it settles, the chunk
stays as read cache if the RAM tier serves reads (evicted oldest first when a new save needs
room), else it is dropped at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from tiercache.config import AUTO_ARENA_FRACTION
from tiercache.errors import TierFullError
from tiercache.layout import Layout
from tiercache.repo import Repo
from tiercache.tiers.ram import Arena, RamTier, Region

log = logging.getLogger("tiercache.pipeline.ramcache")


def _cid(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def node_memory() -> int:
    """This node's memory as this process may use it: physical memory, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def auto_arena_limit() -> int:
    """The largest an automatically sized arena may grow (see :data:`~tiercache.config.AUTO_ARENA_FRACTION`)."""
    return int(node_memory() * AUTO_ARENA_FRACTION) // 4096 * 4096


class RamCache:
    """The arena, the RAM tier on it, and which of its chunks versions in flight still need.

    Args:
        repo: The storage layer (the RAM tier joins its tiers when the arena is made).
        lock: The pipeline's lock (see :class:`~tiercache.pipeline.job.JobTable`).
        capacity: Arena bytes (the user's ``ram.capacity``), or ``None`` to size it automatically:
            two versions of the largest state saved so far, grown when a larger one comes.
        pin: Page-lock the arena (when CUDA is available: the caller decides).
        serve_reads: Keep chunks as a read cache once no version in flight needs them.
        keep_all: Keep chunks even without ``serve_reads`` (a cache with no durable tier).
        make_arena: Makes the arena of a given capacity in place of a private one (the node
            agent's shared arena, see :mod:`tiercache.agent.arena`).
    """

    def __init__(self, repo: Repo, lock: threading.RLock, *, capacity: int | None, pin: Callable[[], bool],
                 serve_reads: bool, keep_all: bool, make_arena: Callable[[int], Arena] | None = None) -> None:
        self._make_arena = make_arena
        self._repo = repo
        self._lock = lock
        self._capacity = capacity
        self._pin = pin
        self.serve_reads = serve_reads
        self._keep_all = keep_all
        self.arena: Arena | None = None
        self.ram: RamTier | None = None
        self._pins: dict[str, int] = {}
        #: Key -> versions that keep it, unpinned, for a slower tier still to read it (see unpin).
        self._kept: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._room = threading.Condition()
        self._frees = 0  # counts notify(): a waiter sleeps only if nothing was freed since it looked

    @property
    def capacity(self) -> int | None:
        """The arena's size (``None`` until sized at the first save when configured ``auto``)."""
        return self.arena.capacity if self.arena is not None else self._capacity

    def ensure(self, staged_bytes: int = 0) -> RamTier:
        """Create the arena and RAM tier on first use (memory itself is allocated lazily)."""
        with self._lock:
            if self.ram is None:
                cap = self._capacity
                if cap is None:  # automatic: two versions, at least 64 MiB, within the bound
                    cap = min(max(2 * staged_bytes, 64 << 20), auto_arena_limit())
                self.arena = self._make_arena(cap) if self._make_arena else Arena(cap, pin=self._pin())
                self.ram = RamTier(self.arena)
                self._repo.attach_ram(self.ram)
            return self.ram

    def check_fits(self, staged_bytes: int) -> bool:
        """Whether a version of ``staged_bytes`` fits in the arena, or will once it has grown.

        Returns:
            ``True`` if it fits now, ``False`` if the arena is sized automatically and must grow
            first (:meth:`grow`).

        Raises:
            TierFullError: If it can never fit: the user's ``ram.capacity`` is smaller (the
                message names the setting and the size needed), or the version is larger than
                an automatic arena may grow.
        """
        assert self.arena is not None
        if staged_bytes <= self.arena.capacity:
            return True
        if self._capacity is not None or self._make_arena is not None:
            # The node agent's arena is sized by its own config when it starts.
            raise TierFullError(
                f"a version needs {staged_bytes} bytes of RAM arena but ram.capacity is set to "
                f"{self.arena.capacity} bytes: raise ram.capacity to at least {staged_bytes} bytes"
            )
        limit = auto_arena_limit()
        if staged_bytes > limit:
            raise TierFullError(
                f"a version needs {staged_bytes} bytes of RAM arena, more than an automatic arena may take "
                f"({limit} bytes, {AUTO_ARENA_FRACTION:.0%} of this node's memory): set ram.capacity, "
                "or save a smaller state"
            )
        return False

    def grow(self, staged_bytes: int) -> bool:
        """Move an automatic arena into one that holds two versions of ``staged_bytes`` (bounded).

        Possible only while no version in flight holds a region: the RAM tier's chunks (the read
        cache, and the only copies in a cache with no durable tier) move with it.

        Returns:
            Whether it grew (``False``: regions are in use; wait for :meth:`notify` and try again).
        """
        with self._lock:
            arena, ram = self.arena, self.ram
            assert arena is not None and ram is not None
            if staged_bytes <= arena.capacity:
                return True
            if self._pins:
                return False
            bigger = Arena(min(2 * staged_bytes, auto_arena_limit()), pin=self._pin())
            if not ram.move_to(bigger):
                bigger.close()
                return False
            self.arena = bigger
        arena.close()
        log.info("the RAM arena grew from %d to %d bytes for a version of %d bytes",
                 arena.capacity, bigger.capacity, staged_bytes)
        return True

    def try_alloc(self, layout: Layout) -> list[Region] | None:
        """Regions for every chunk of ``layout``, or ``None`` (and nothing held) if they do not fit."""
        with self._lock:  # as grow(): a region is never taken from an arena being replaced
            arena = self.arena
            assert arena is not None
            got: list[Region] = []
            for c in layout.chunks:
                r = arena.alloc(c.staged_bytes)
                if r is None:
                    for g in got:
                        arena.free(g)
                    return None
                got.append(r)
            return got

    def adopt(self, key: str, region: Region, length: int) -> None:
        """Hand a hashed chunk's region to the RAM tier and pin it for the version in flight (lock held)."""
        assert self.ram is not None
        # A chunk already in RAM (an earlier version's) is kept and this copy freed: dedup.
        self.ram.adopt(key, region, length)
        self._pins[key] = self._pins.get(key, 0) + 1
        self._lru.pop(key, None)

    def hold(self, keys: Iterable[str]) -> list[str]:
        """Pin chunks the RAM tier holds now, as a version in flight would; return the keys pinned.

        The node agent holds the chunks of a part it keeps for a restarted group this way (see
        :mod:`tiercache.agent.keep`); :meth:`unpin` lets them go.
        """
        held = []
        with self._lock:
            for key in keys:
                if self.ram is not None and self.ram.size(key) is not None:
                    self._pins[key] = self._pins.get(key, 0) + 1
                    self._lru.pop(key, None)
                    held.append(key)
        return held

    def unpin(self, keys: Iterable[str], keep: Iterable[str] = ()) -> None:
        """A version in flight no longer needs its chunks: they stay as read cache, or go.

        ``keep``: those of them a slower tier is still to read (docs/design.md section 3). They
        stay as cache a save that needs the room drops (oldest first, as the read cache) until
        :meth:`let_go` says the tier is done with them; a tier that finds one gone reads it from
        a durable tier instead.
        """
        dropped = []
        with self._lock:
            for key in keep:
                self._kept[key] = self._kept.get(key, 0) + 1
            for key in keys:
                n = self._pins.get(key, 0) - 1
                if n > 0:
                    self._pins[key] = n
                    continue
                self._pins.pop(key, None)
                if self.serve_reads or self._keep_all or key in self._kept:
                    self._lru[key] = None
                elif self.ram is not None:
                    self.ram.delete(key)
                    dropped.append(_cid(key))
        if dropped:
            self._repo.catalog.note_chunks("ram", dropped, present=False)
        self.notify()

    def let_go(self, keys: Iterable[str]) -> None:
        """A slower tier is done with chunks :meth:`unpin` kept for it: drop those nothing else holds.

        A chunk stays if a version in flight pins it, another version keeps it, or the RAM tier
        serves reads (it is read cache then, as any other).
        """
        dropped = []
        with self._lock:
            for key in keys:
                n = self._kept.get(key, 0) - 1
                if n > 0:
                    self._kept[key] = n
                    continue
                self._kept.pop(key, None)
                if self.serve_reads or self._keep_all or key not in self._lru or self.ram is None:
                    continue  # read cache, pinned again, or dropped for room already
                del self._lru[key]
                self.ram.delete(key)
                dropped.append(_cid(key))
        if dropped:
            self._repo.catalog.note_chunks("ram", dropped, present=False)
            self.notify()

    def make_room(self, needed: int) -> bool:
        """Drop cached chunks, oldest first, until ``needed`` bytes may fit; whether any was dropped."""
        if self.arena is None or self.ram is None:
            return False
        dropped = []
        with self._lock:
            while self._lru and self.arena.free_bytes < needed:
                key, _ = self._lru.popitem(last=False)
                if self._pins.get(key):
                    continue
                self.ram.delete(key)
                dropped.append(_cid(key))
            if not dropped and self._lru and self.arena.free_bytes >= needed:
                # Enough bytes but fragmented: drop one more cached chunk and retry.
                key, _ = self._lru.popitem(last=False)
                if not self._pins.get(key):
                    self.ram.delete(key)
                    dropped.append(_cid(key))
        if dropped:
            self._repo.catalog.note_chunks("ram", dropped, present=False)
        return bool(dropped)

    def evict(self, keys: Iterable[str]) -> int:
        """Drop the RAM copies of ``keys`` that no version in flight needs; return bytes freed."""
        if self.ram is None:
            return 0
        freed = 0
        dropped = []
        with self._lock:
            for key in keys:
                if self._pins.get(key):
                    continue
                size = self.ram.size(key)
                if size is None:
                    continue
                self.ram.delete(key)
                self._lru.pop(key, None)
                dropped.append(_cid(key))
                freed += size
        if dropped:
            self._repo.catalog.note_chunks("ram", dropped, present=False)
        self.notify()
        return freed

    def keep(self, key: str) -> None:
        """Register a chunk copied into the RAM tier (by promote) as evictable cache."""
        with self._lock:
            if not self._pins.get(key):
                self._lru[key] = None

    @property
    def frees(self) -> int:
        """How many times regions went back so far (read it before trying to allocate)."""
        with self._room:
            return self._frees

    def wait_for_room(self, since: int, timeout: float | None = None) -> None:
        """Block until regions go back to the arena after the :attr:`frees` count ``since`` was read."""
        with self._room:
            self._room.wait_for(lambda: self._frees != since, timeout)

    def notify(self) -> None:
        """Regions went back to the arena: wake a save waiting for room."""
        with self._room:
            self._frees += 1
            self._room.notify_all()

    def close(self) -> None:
        """Release the RAM tier and the arena's memory."""
        if self.ram is not None:
            self.ram.close()
        if self.arena is not None:
            self.arena.close()
