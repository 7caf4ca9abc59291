"""What node RAM holds of each version, for a process that lists them (``ls``, ``versions()``).

Such a process (a CLI, the UI) has no RAM tier of its own: only the node agent knows what node
RAM holds (docs/design.md section 7b), and it answers per version, ``held`` or why not. A version
saved by one process is in the agent's catalog as any version, and the catalog knows whether
node RAM holds every chunk of it. A version saved by a group is not: node RAM holds the parts of
this node's ranks, each written by the agent under an id of its own, and the group manifest
names no chunk. So :class:`Holdings` notes, for each version published through the agent, the
chunks of the parts it was handed, and a group version is held while node RAM holds all of them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from tiercache.errors import TierCacheError
from tiercache.repo.catalog import Catalog

#: Versions whose parts are remembered (node RAM holds far fewer: it is a cache of the newest).
LIMIT = 1024


class Holdings:
    """The versions published through this agent and the chunks of their parts (the newest :data:`LIMIT`).

    Args:
        started_at: When the agent started (Unix time): a version it never held is named by it.
    """

    def __init__(self, started_at: float) -> None:
        self._since = datetime.fromtimestamp(started_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        self._parts: OrderedDict[str, dict[int, frozenset[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, version: str, rank: int | None, chunks: Iterable[str] = ()) -> None:
        """Node RAM took ``version`` (or, with ``rank``, that rank's part of it, made of ``chunks``)."""
        with self._lock:
            parts = self._parts.setdefault(version, {})
            self._parts.move_to_end(version)
            if rank is not None:
                parts[rank] = frozenset(chunks)
            while len(self._parts) > LIMIT:
                self._parts.popitem(last=False)

    def states(self, versions: Iterable[str], catalog: Catalog,
               has_chunk: Callable[[str], bool]) -> tuple[dict[str, str], dict[str, str]]:
        """Whether node RAM holds each of ``versions``, and why not.

        Args:
            versions: Version ids.
            catalog: The agent's catalog (which knows where the versions of one process are).
            has_chunk: Whether node RAM holds a chunk now.

        Returns:
            Each version's state: ``held``, ``evicted`` (node RAM held it and dropped it since)
            or ``absent`` (this agent never held it), as :class:`tiercache.TierState` names them;
            and the reason of each state but ``held`` (said once, not once per version).
        """
        out: dict[str, str] = {}
        for vid in versions:
            with self._lock:
                parts = self._parts.get(vid)
            if parts:  # a group version: the parts of this node's ranks
                held = all(has_chunk(c) for ids in parts.values() for c in ids)
            else:
                try:
                    v = catalog.peek(vid)
                    held = not v.is_header and "ram" in catalog.residency(v)
                except TierCacheError:
                    held = False
            out[vid] = "held" if held else "evicted" if parts is not None else "absent"
        reasons = {"evicted": "node RAM dropped it since (it is a cache there: for room, or by an evict or gc)",
                   "absent": f"node RAM has not held it since this agent started ({self._since})"}
        return out, reasons


__all__ = ["LIMIT", "Holdings"]
