"""The seam between the facade and the save pipeline: what :class:`~tiercache.cache.TierCache` asks of it.

The facade calls its saver through the small interface :class:`Saver` and nothing else (it
never imports the pipeline before the first save: that imports torch). The one implementation is
the save front, :class:`tiercache.pipeline.front.SaveFront`: it flattens, plans, names, reserves
and copies every version, and hands it to one of two back ends (docs/design.md section 5):

* :class:`tiercache.pipeline.engine.Engine`: the pipeline in this process (no ``[agent]`` table);
* :class:`tiercache.agent.saver.AgentBackend`: the trainer side of the node agent (docs/design.md
  section 7b): the front copies into the agent's shared arena and the back end hands the version
  over; the agent runs the same :class:`Engine` for every process of the node. If the agent is
  lost, the front saves through an :class:`Engine` of its own from then on.

Multi-rank saves (:mod:`tiercache.group`) stage with a ``committer`` through :meth:`Saver.stage`
like any save.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from tiercache.errors import ConfigError
from tiercache.handle import GROUP_LEVELS

if TYPE_CHECKING:
    from concurrent.futures import Future

    from tiercache.format import Flat
    from tiercache.handle import SaveHandle
    from tiercache.layout import Layout
    from tiercache.manifest import MoveReason, RefRecord, Version
    from tiercache.pipeline.deferred import Owned
    from tiercache.pipeline.engine import Engine
    from tiercache.pipeline.job import Committer
    from tiercache.restore import Progress

#: Reads one verified chunk object from the best tier holding it: ``(data, tier)``.
ObjectReader = Callable[[str, int, str], tuple[bytes, str]]


class Saver(Protocol):
    """What the facade asks of the save pipeline, in process or in the node agent.

    Threading: ``stage`` is called with the facade's save lock held, from the training thread;
    everything else may be called from any thread.
    """

    errors_total: int
    recent_errors: Collection[str]

    @property
    def local(self) -> Engine | None:
        """The in-process engine once made: at once without an agent, else once the agent was lost."""
        ...

    @property
    def has_saved(self) -> bool:
        """Whether this process has saved anything (a process that only reads writes no meter)."""
        ...

    def stage(self, state: object, *, step: int, branch: str, meta: dict, parent: str | None, seq: int,
              version_id: str | None = None, chunk_bytes: int | None = None, committer: Committer | None = None,
              defer: Owned | None = None, flat: Flat | None = None, base: RefRecord | None = None,
              why: MoveReason = "save") -> SaveHandle:
        """Copy ``state`` into the RAM arena, start writing it, return its handle (see :meth:`SaveFront.stage`)."""
        ...

    def layout_of(self, flat: Flat, chunk_bytes: int | None = None) -> Layout:
        """The chunk layout a save of ``flat`` gets (multi-rank saves plan their hashing split with it)."""
        ...

    def published(self, version_id: str) -> Future[Version] | None:
        """The future of a staged version's manifest, or ``None`` if it is not in flight here."""
        ...

    def prepare_arena(self, state: object | None, *, wait: bool) -> None:
        """Have the arena allocated and pre-faulted (see :meth:`TierCache.prepare`)."""
        ...

    def wait_deferred(self) -> None:
        """Block until every deferred copy started so far is done."""
        ...

    def wait_published(self) -> None:
        """Block until every staged version's manifest is in this process's catalog."""
        ...

    def wait_settled(self, timeout: float | None = None) -> None:
        """Block until every version staged so far has settled (nothing is reported)."""
        ...

    def wait_job(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until the pipeline is done with ``version_id``; ``False`` if ``timeout`` passed first."""
        ...

    def pending_jobs(self) -> list[str]:
        """Ids of this process's versions still being written, oldest first."""
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

    def full_tiers(self) -> frozenset[str]:
        """Durable tiers this process's versions skip for lack of room (``stats()``)."""
        ...

    def record_loss(self, version_id: str, step: int, err: BaseException) -> None:
        """Count a version that reached no durable tier (``stats()``), for ``flush()``/``close()`` to raise.

        The pipeline records its own; a multi-rank version's outcome is the group's, which records
        it here when the group failed it on every durable tier (:mod:`tiercache.group.round`).
        """
        ...

    def flush(self, timeout: float | None = None, *, report: bool = True) -> None:
        """Wait until every version staged so far has settled; raise the first unreported loss."""
        ...

    def close(self) -> None:
        """Finish pending writes and stop; raise the first unreported loss."""
        ...


def absent_levels(durable: Collection[str]) -> dict[str, Exception]:
    """The levels a single-process save cannot reach with the durable tiers ``durable``, and why.

    A handle's future for each of them fails at once with the error, instead of hanging.
    """
    out: dict[str, Exception] = {}
    for lvl, tier in (("local", "disk"), ("remote", "s3")):
        if tier not in durable:
            out[lvl] = ConfigError(f"no {tier} tier configured, so no {lvl!r} level")
    if not durable:
        out["durable"] = ConfigError("no durable tier configured (only RAM)")
    for lvl in GROUP_LEVELS:
        out[lvl] = ConfigError(
            f"no {lvl!r} level: it comes with multi-rank saves (save(group=...)) and [peers] copies >= 1")
    return out
