"""The cache's internal interface: what the group protocol, the node agent and the integrations use.

:class:`~tiercache.cache.TierCache` is the public API and nothing else. It owns one
:class:`CacheCore` and delegates to it; the core holds what the layers above the storage need of
an open cache and a user never calls (docs/design.md section 1, "The facade and the core"):

* the storage layer (:attr:`CacheCore.repo`, :attr:`CacheCore.catalog`, the tiers' health as
  ``repo.health``) and the read path (:attr:`CacheCore.reader`, :meth:`CacheCore.read_object`);
* what the save engine is made with: the placement policy (:attr:`CacheCore.policy`) and the
  throughput meter (:attr:`CacheCore.meter`);
* the save engine (:attr:`CacheCore.saver`), made by the facade on first use;
* where the next version of a branch starts (:meth:`CacheCore.next_version`: the save lock, the
  parent of a resume) and :meth:`CacheCore.note_restored`;
* a restore of a version already resolved (:meth:`CacheCore.restore_version`, whose assembly is
  :func:`tiercache.restore.assemble`) and :meth:`CacheCore.keep_in_ram`.

Code outside ``cache.py`` gets the core of a user's cache from :func:`tiercache.cache.core_of`;
a group view is handed it when the facade makes one. Like the facade, the core imports no torch
until a restore or a save needs it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.errors import CacheClosedError
from tiercache.manifest import MoveReason, RefRecord, Version, parse_ref

if TYPE_CHECKING:
    import torch

    from tiercache.config import CacheConfig
    from tiercache.policy.base import Policy
    from tiercache.policy.meter import ThroughputMeter
    from tiercache.repo import Repo
    from tiercache.repo.catalog import Catalog
    from tiercache.restore import Fill, Progress, Reader, RestoreReport
    from tiercache.saver import Saver


@dataclass
class NextVersion:
    """Where the next version of a branch starts (see :meth:`CacheCore.next_version`).

    Attributes:
        branch: The branch.
        parent: Its parent: the head, the version this process resumed from, or (a new branch)
            the version it last saved or restored.
        seq: The ref's ``seq`` once the branch moves to it.
        base: The ref record it moves from (``None`` for a new branch).
        why: How the branch moves (``save``, ``resume``, ``branch``).
        version: Set by the caller to the new version's id once staged or committed.
    """

    branch: str
    parent: str | None
    seq: int
    base: RefRecord | None
    why: MoveReason
    version: str | None = None


class CacheCore:
    """The internals of one open cache, for the layers above the storage (not for users).

    Args:
        config: The cache's configuration.
        repo: Its storage layer.
        meter: The throughput meter the reader ranks tiers by (and the save engine measures into).
        policy: The placement policy the save engine asks (its ``retention_rule`` for the sizing advice).
        saver: The save engine, made on first use (the facade's; with a node agent, the agent's saver).
        made_saver: The save engine if one was made already, else ``None`` (never makes one).
        on_restored: Called with each restore's report and the wall-clock time its reads began.
    """

    def __init__(self, config: CacheConfig, repo: Repo, meter: ThroughputMeter, policy: Policy, *,
                 saver: Callable[[], Saver], made_saver: Callable[[], Saver | None],
                 on_restored: Callable[[RestoreReport, float], None]) -> None:
        self.config = config
        self.repo = repo
        self.meter = meter
        self.policy = policy
        self._saver = saver
        self._made_saver = made_saver
        self._on_restored = on_restored
        self._reader: Reader | None = None
        self._lazy_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._closed = False
        #: Per branch, the version this process last restored from it: the next save there names
        #: it as parent (a resume), even if the branch's head is newer.
        self._resumed: dict[str, str] = {}
        #: The version this process last restored or saved: a save on a new branch starts there.
        self._last: str | None = None
        #: What the last restore of this process read, from where (bytes per source).
        self.last_restore: RestoreReport | None = None

    # ------------------------------------------------------------------ parts

    @property
    def catalog(self) -> Catalog:
        """The catalog of versions and refs (read it; change the tiers through :attr:`repo`)."""
        return self.repo.catalog

    @property
    def saver(self) -> Saver:
        """The save engine (see :mod:`tiercache.saver`), made on first use (torch imported then)."""
        return self._saver()

    @property
    def reader(self) -> Reader:
        """The read path (made on first use: it needs torch)."""
        with self._lazy_lock:
            if self._reader is None:
                from tiercache.restore import Reader

                self._reader = Reader(lambda: self.repo.tiers, self._holds, self.meter, self.config.io_threads)
            return self._reader

    def _holds(self, tier: str, chunk_id: str) -> bool:
        return self.catalog.holds(tier, chunk_id)

    def read_object(self, chunk_id: str, nbytes: int, algo: str) -> tuple[bytes, str]:
        """A verified chunk object from the tier the reader ranks best among those holding it."""
        return self.repo.read_object(chunk_id, nbytes, algo, order=self.reader.order(chunk_id))

    # ------------------------------------------------------------------ open, closed

    @property
    def closed(self) -> bool:
        """Whether the cache stopped taking saves (:meth:`stop_saves`)."""
        return self._closed

    def check_open(self) -> None:
        """Raise :class:`CacheClosedError` if the cache is closed."""
        if self._closed:
            raise CacheClosedError("the cache is closed: open a new one")

    def stop_saves(self) -> bool:
        """Close the cache to saves once the save running now is staged; ``False`` if it was closed already."""
        with self._save_lock:  # no save is half-staged from here on, and none starts
            if self._closed:
                return False
            self._closed = True
            return True

    def close(self) -> None:
        """Release the reader's threads and the tiers (the facade calls this last)."""
        if self._reader is not None:
            self._reader.close()
        self.repo.close()

    # ------------------------------------------------------------------ where a save starts

    @contextlib.contextmanager
    def next_version(self, branch: str) -> Iterator[NextVersion]:
        """Serialise one save on ``branch`` with every other save and with ``close()``.

        Yields where the next version of ``branch`` starts (its parent, the ref's next ``seq``);
        the caller stages or commits the version and sets ``version`` to its id, and the branch
        then moves there in this process's view (its commits move it on the tiers). Single-rank
        and multi-rank saves and the DCP writer all go through it.

        Raises:
            CacheClosedError: If the cache is closed.
        """
        with self._save_lock:
            self.check_open()
            cur = self.catalog.ref("branch", branch)
            parent, why = self._parent_for(branch, cur)
            nxt = NextVersion(branch=branch, parent=parent, seq=cur.seq + 1 if cur else 0, base=cur, why=why)
            yield nxt
            if nxt.version is not None:
                rec = RefRecord(kind="branch", name=branch, version=nxt.version, seq=nxt.seq)
                self.catalog.note_move(rec, cur, why)
                self._resumed.pop(branch, None)
                self._last = nxt.version

    def _parent_for(self, branch: str, head: RefRecord | None) -> tuple[str | None, MoveReason]:
        """The parent of the next version saved on ``branch``, and how the branch moves.

        After a restore of an older version of the branch, the new version continues from what
        was restored (a resume: the branch moves there, as rollback + save would, and the versions
        it leaves behind stay in the reflog). A new branch starts from the version this process
        last restored or saved. Otherwise the branch's head is the parent.
        """
        if head is None:
            return self._last, ("branch" if self._last is not None else "save")
        resumed = self._resumed.get(branch)
        if resumed is not None and resumed != head.version:
            return resumed, "resume"
        return head.version, "save"

    def note_restored(self, ref: str, version: Version) -> None:
        """Remember that this process resumes from ``version`` (restored as ``ref``).

        The next save on its branch names it as parent and moves the branch there; a save on a
        new branch starts from it.
        """
        base = parse_ref(ref).base
        branch = base if self.catalog.ref("branch", base) is not None else version.branch
        with self._save_lock:
            self._resumed[branch] = version.id
            self._last = version.id

    def follow_head(self, branch: str) -> None:
        """Let the next save on ``branch`` continue from its head again (a rollback moved it)."""
        with self._save_lock:
            self._resumed.pop(branch, None)

    def forget(self, gone: set[str]) -> None:
        """Never name a collected version as the parent of a later save (of a new branch, or a resume)."""
        with self._save_lock:
            if self._last in gone:
                self._last = None
            self._resumed = {b: v for b, v in self._resumed.items() if v not in gone}

    # ------------------------------------------------------------------ reads and RAM

    def restore_version(
        self,
        version: Version,
        *,
        into: Any = None,
        map_location: str | torch.device = "cpu",
        progress: Progress | None = None,
        strict: bool = True,
        fill: Fill | None = None,
    ) -> Any:
        """Return the state a manifest describes: a restore with the version already resolved.

        A version saved by several ranks restores as the list of the ranks' states. ``fill``
        reads the chunks into the new tensors in place of this cache's reader (a restore over a
        process group passes one that gets chunks from the other ranks); what it reports read is
        :attr:`last_restore`. With ``into`` and ``strict=False``, returns ``(state, unmatched)``.
        """
        from tiercache.restore import RestoreReport, assemble

        self.check_open()
        saver = self._made_saver()
        if saver is not None:
            saver.wait_deferred()  # a deferred copy may still be reading the tensors of ``into``

        def read(dests: Sequence[torch.Tensor]) -> None:
            t0, began = time.perf_counter(), time.time()
            if fill is None:
                # Every destination is a contiguous CPU tensor of its entry's size: the plan checked
                # the slots of ``into``, and the others were made here.
                got = self.reader.read_version(version, dests, progress, checked=True)
            else:
                got = fill(version, dests, progress)
            self.last_restore = RestoreReport(version.id, got, time.perf_counter() - t0)
            self._on_restored(self.last_restore, began)

        return assemble(version, read, into=into, map_location=map_location, strict=strict,
                        allow_pickle=self.config.allow_pickle)

    def keep_in_ram(self, chunks: Sequence[tuple[str, int]], hash_algo: str) -> int:
        """Copy chunks (id, bytes) into the RAM tier as evictable read cache; return bytes copied.

        What a multi-rank save asks of the node agent once the group committed a version: node
        RAM then holds this rank's part, and a restarted trainer restores it from there.
        """
        self.check_open()
        return self.saver.keep_chunks(chunks, hash_algo, self.read_object)
