"""The parts of group versions a node agent keeps for a restarted group (docs/design.md section 7b).

A rank's ``save()`` of a multi-rank version returns once its part is in the agent's arena; the
group commits it later, through the trainers. If the trainers die first, the agent keeps each
part it was handed: its *orphans*. An orphan is a part whose manifest the agent made (it hashed
every chunk; it was copied whole before ``publish``), whose durable level failed because its
trainer went away or its group broke. Its chunks stay pinned in node RAM (no save's need for
room evicts them) until one of these, and nothing else, lets them go:

* the restarted group adopts its version (:mod:`tiercache.group.orphans`): the part is saved
  again under its own id and the agent writes it as any part;
* a version of its branch at its step or later is committed through this agent, or a restarted
  rank reports its branch's head at that step or later: it is older than committed history;
* a restarted group found its version incomplete (some rank's part is nowhere) and adopted an
  older one, or none: it can never be adopted;
* a new save could never fit in the arena beside the kept parts: the oldest go first, so no
  save waits forever for room they hold (the restarted group's own save of the version it
  adopts may be that save: its bytes are then in the trainers already), logged at WARNING as
  a version a restart could have adopted is gone (raise the arena to keep it);
* more than :data:`LIMIT` are kept: the oldest goes (logged at WARNING).

Every release is logged and counted (``tiercache agent status`` shows both counts). A part
whose own version was committed after all (its trainer died between the group's commit and
telling the agent) is *settled*, not released: nothing a restart could adopt was lost, so it
is counted apart.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from tiercache.manifest import Version
from tiercache.names import chunk_key
from tiercache.pipeline.ramcache import RamCache

log = logging.getLogger("tiercache.agent.keep")

#: How many parts an agent keeps at most (a restarted group adopts the newest complete version).
LIMIT = 64


class KeptParts:
    """The orphaned parts an agent keeps, each with its chunks pinned in node RAM (see the module docstring)."""

    def __init__(self) -> None:
        self._parts: OrderedDict[str, tuple[dict[str, Any], list[str]]] = OrderedDict()
        self._lock = threading.Lock()
        self.released = 0
        #: Parts let go because their own version was committed (see the module docstring).
        self.settled = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._parts)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._parts

    def keep(self, key: str, record: dict[str, Any], manifest: Version, ram: RamCache) -> None:
        """Keep part ``key`` (``record``: what a restarted group needs to adopt it) and pin its chunks."""
        held = ram.hold(chunk_key(c.id) for c in manifest.chunks)
        with self._lock:
            if key in self._parts:
                ram.unpin(held)
                return
            self._parts[key] = ({**record, "manifest": manifest.to_json().decode()}, held)
            over = []
            while len(self._parts) > LIMIT:
                over.append(self._parts.popitem(last=False))
        log.info("keeping part %s of version %s (step %d) for a restarted group: its trainer died or its "
                 "group broke before the group committed it", key, record["v"], record["step"])
        self._let_go(over, f"more than {LIMIT} parts are kept", ram, level=logging.WARNING)

    def take(self, key: str, ram: RamCache) -> bool:
        """The restarted group saves part ``key`` again (it adopts it): stop keeping it; whether it was kept."""
        with self._lock:
            got = self._parts.pop(key, None)
        if got is not None:
            ram.unpin(got[1])
        return got is not None

    def offered(self, rank: int | None) -> list[dict[str, Any]]:
        """The kept parts of ``rank`` (every rank's if ``None``), oldest first."""
        with self._lock:
            return [o for o, _ in self._parts.values() if rank is None or o["rank"] == rank]

    def summary(self) -> list[dict[str, Any]]:
        """The versions of the kept parts, oldest first: ``v``, ``branch``, ``step``, ``world``, ``ranks`` kept."""
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for o, _ in self._parts.values():
                got = out.setdefault(str(o["v"]), {"v": o["v"], "branch": o["branch"], "step": o["step"],
                                                   "world": o["world"], "ranks": []})
                got["ranks"].append(o["rank"])
        for got in out.values():
            got["ranks"].sort()
        return list(out.values())

    def release(self, which: Callable[[dict[str, Any]], bool], why: str, ram: RamCache,
                *, committed: Iterable[str] = ()) -> int:
        """Let go of the kept parts ``which`` picks (they can never be adopted: ``why``); return how many.

        Parts of the versions in ``committed`` are settled: their group committed them.
        """
        done = set(committed)
        with self._lock:
            gone = [(k, v) for k, v in self._parts.items() if which(v[0])]
            for k, _ in gone:
                del self._parts[k]
        settled = [(k, v) for k, v in gone if v[0]["v"] in done]
        for key, (record, held) in settled:
            ram.unpin(held)
            with self._lock:
                self.settled += 1
            log.info("part %s of version %s (step %d) of branch %r is settled: its group committed the version",
                     key, record["v"], record["step"], record["branch"])
        self._let_go([g for g in gone if g[1][0]["v"] not in done], why, ram, level=logging.INFO)
        return len(gone)

    def make_room(self, nbytes: int, ram: RamCache) -> None:
        """Let go of the oldest kept parts while a save of ``nbytes`` could never fit in the arena beside them."""
        arena, tier = ram.arena, ram.ram
        if arena is None or tier is None:
            return
        while True:
            with self._lock:
                keys = {k for _, held in self._parts.values() for k in held}
                oldest = next(iter(self._parts.items()), None)
            kept = sum(tier.size(k) or 0 for k in keys)
            if oldest is None or arena.capacity - kept >= nbytes:
                return
            with self._lock:
                if self._parts.pop(oldest[0], None) is None:
                    continue
            self._let_go([oldest], f"a new save of {nbytes} bytes could never fit beside the parts kept in the "
                                   f"{arena.capacity}-byte arena", ram, level=logging.WARNING)

    def _let_go(self, parts: Iterable[tuple[str, tuple[dict[str, Any], list[str]]]], why: str, ram: RamCache,
                *, level: int) -> None:
        for key, (record, held) in parts:
            ram.unpin(held)
            with self._lock:
                self.released += 1
            log.log(level, "released part %s of version %s (step %d) of branch %r: %s", key, record["v"],
                    record["step"], record["branch"], why)


__all__ = ["LIMIT", "KeptParts"]
