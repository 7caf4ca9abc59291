"""One version on its way through the pipeline, and the table of those in flight.

A :class:`Job` goes through these states (each tier independently once placed):

* **staging**: ``save()`` copies the state into arena regions (``copied`` events per chunk);
* **hashing**: the hasher names each chunk (``ready`` futures) and publishes the manifest;
* per durable tier: **pending** (queued for that tier's writer, then **writing** once the writer
  takes it: from then on only that write decides) until **committed**, **failed** or **skipped**
  (a skip settles only once the version is durable elsewhere; else the tier takes it after all,
  see :meth:`Engine.settle`); a remote tier it missed during an outage may leave its level
  waiting for the tier's catch-up (:mod:`tiercache.pipeline.catchup`);
* **settled**: every level resolved; its regions go back to the arena (or stay as read cache),
  and ``released`` is set.

The :class:`JobTable` holds the jobs in flight and the lock every part of the pipeline takes for
its short critical sections over job state, RAM pins and the arena.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from tiercache.dtypes import float_share
from tiercache.format import Flat, TensorMeta
from tiercache.layout import Layout
from tiercache.manifest import Version
from tiercache.policy.base import VersionView
from tiercache.tiers.ram import Region


class Committer(Protocol):
    """Commits one version for a group of processes in place of the engine (multi-rank saves).

    A tier's writer thread calls :meth:`owned` before writing the version's chunks and
    :meth:`commit` once the chunks it wrote are durable with their names synced; the engine
    completes that level when the future :meth:`commit` returns resolves. ``owned`` may block
    while the group agrees; ``commit`` must not wait for the group's verdict: one engine may write
    the parts of several processes (a node agent), and the group's verdict on one part waits for
    the others. The hasher thread calls :meth:`split_hashing` once per version, before naming its
    first chunk.

    Attributes:
        rank: Which part of the group's version this is (the process's rank in the group).
        world: How many parts the group's version has (the group's size).
    """

    rank: int
    world: int

    def owned(self, tier: str) -> Collection[str]:
        """Ids of the version's chunks this process writes to ``tier`` (the others write the rest)."""
        ...

    def commit(self, tier: str, manifest: Version) -> Future[None]:
        """Hand this process's part (``manifest``) to the group; the future resolves once it committed it on ``tier``.

        The future fails with the group's error (the same on every process) if the group did not.

        Raises:
            TierCacheError: If the part could not be handed over (its manifest not written).
        """
        ...

    def split_hashing(self, layout: Layout, paths: list[str]) -> HashSplit | None:
        """The chunks declared alike in the group (``None``: none); called once per version by the hasher."""
        ...

    def follow(self, published: Future[Version]) -> None:
        """The future of this process's part manifest: resolved once hashed, or failed with why it never will be.

        Called once the engine took the version (before any thread of it can finish it), so the
        group learns why a part it waits for failed even if the version's pipeline ended at once.
        """
        ...


class HashSplit(Protocol):
    """Chunks declared the same in every process of a group: their ids are compared, and one process writes each.

    The hasher hashes every chunk, then trades the ids with :meth:`exchange`, exactly once per
    version, with ``None`` if hashing failed here, so the other processes never wait in vain.
    """

    def exchange(self, ids: dict[int, str] | None) -> None:
        """Give the ids this process computed; raise if the group failed (ids of declared chunks differ included)."""
        ...


@dataclass
class VersionHead:
    """What every version carries from its ``save()`` on: id, place in its branch's history, metadata.

    Attributes:
        version_id: The version's id.
        branch: Its branch.
        step: Its step.
        seq: The branch ref's ``seq`` once it moves there.
        parent: Its parent (``None`` for the first version of a history).
        meta: The user's JSON metadata.
        created_at: When ``save()`` was called (Unix seconds).
    """

    version_id: str
    branch: str
    step: int
    seq: int
    parent: str | None
    meta: dict
    created_at: float


@dataclass
class StagedVersion(VersionHead):
    """A version whose bytes are already in arena regions, as a save hands it to the pipeline.

    Everything the pipeline needs to hash, place, write and commit the version, and nothing of
    the saving process's Python objects, so a version copied into a shared arena by one process
    can be finished by another (the node agent, docs/design.md section 7b; see :meth:`Engine.adopt`).

    Attributes:
        tree: The state's object tree (see :func:`tiercache.format.flatten`).
        metas: One entry per tensor, in tree order.
        pickled: Whether some leaf of the tree was pickled.
    """

    tree: Any
    metas: tuple[TensorMeta, ...]
    pickled: bool


@dataclass
class Job(VersionHead):
    """One version on its way through the pipeline (see the module docstring for its states)."""

    flat: Flat
    layout: Layout
    regions: list[Region | None]
    futures: dict[str, Future[str]]
    manifest: Version | None = None
    chunk_keys: list[str] = field(default_factory=list)
    #: One future per chunk, resolved with its id as soon as it is hashed, so writers start on
    #: a chunk while later ones are still being hashed.
    ready: list[Future[str]] = field(default_factory=list)
    #: Resolved with the manifest once every chunk is hashed.
    published: Future[Version] = field(default_factory=Future)
    #: Set per chunk by the training thread once the chunk is fully copied into the arena.
    copied: list[threading.Event] = field(default_factory=list)
    #: The exception that interrupted the copy (the caller of save() got it too).
    copy_error: BaseException | None = None
    #: Durable tiers the version is queued for or being written to.
    pending: set[str] = field(default_factory=set)
    #: Pending tiers whose write has begun (a writer took the version): the policy can no longer
    #: take it off them, so the version settles only once those writes have their outcome.
    writing: set[str] = field(default_factory=set)
    nbytes: int = 0
    #: Set for one process's part of a multi-rank version: it picks the chunks to write and commits.
    committer: Committer | None = None
    #: Durable tiers in the order the placement ranked them (a fallback takes the first it can).
    order: tuple[str, ...] = ()
    #: Tiers skipped for this version, with why. Their levels are settled only once the version
    #: is durable on another tier; if it never is, one of them takes it after all.
    skipped: dict[str, str] = field(default_factory=dict)
    #: Tiers it was skipped for while they were down (its level may wait for their catch-up).
    skipped_down: set[str] = field(default_factory=set)
    #: Tiers whose write failed, with the error (their levels failed at once).
    failed: dict[str, BaseException] = field(default_factory=dict)
    #: Tiers where the version's manifest and ref are committed.
    committed: set[str] = field(default_factory=set)
    #: Tiers the version goes to without asking the policy: a fallback, so that it reaches one.
    forced: set[str] = field(default_factory=set)
    #: The user's policy dropped it (``on_full="evict"``): it is not written anywhere after all.
    dropped: bool = False
    #: Every level is settled and nothing of it is pending any more.
    settled: bool = False
    #: The manifest as committed: its parent is the nearest ancestor that became durable.
    final: Version | None = None
    #: Set once the pipeline is done with the version (settled and its regions released).
    released: threading.Event = field(default_factory=threading.Event)
    #: Its chunks are no longer pinned in the RAM arena: a local durable tier holds it, or it settled.
    ram_released: bool = False
    #: Per slower tier, the chunk keys it was done reading before the version's RAM was released.
    read_by: dict[str, set[str]] = field(default_factory=dict)
    #: Chunk keys the arena keeps (evictable) after the release for slower tiers not done with
    #: them yet, with those tiers (see :meth:`Engine.release_ram`).
    kept: dict[str, set[str]] = field(default_factory=dict)

    def view(self, tiers: frozenset[str] = frozenset()) -> VersionView:
        """The policy's view of this version (before its manifest exists)."""
        return VersionView(
            id=self.version_id, branch=self.branch, step=self.step, nbytes=self.nbytes,
            created_at=self.created_at, tiers=tiers, pending=frozenset(self.pending), meta=self.meta,
            float_fraction=float_share([(m.dtype, m.nbytes) for m in self.flat.metas]),
            skipped=frozenset(self.skipped),
        )


class JobTable:
    """The versions in flight, in save order, and the pipeline's lock.

    ``lock`` guards job state (``pending``, ``skipped``...), the table, RAM pins and the arena's
    regions; hold it only for short critical sections, never across I/O.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._jobs: dict[str, Job] = {}

    def add(self, job: Job) -> None:
        """Register a staged version."""
        with self.lock:
            self._jobs[job.version_id] = job

    def get(self, version_id: str | None) -> Job | None:
        """The job of ``version_id`` if it is in flight."""
        with self.lock:
            return self._jobs.get(version_id) if version_id is not None else None

    def wait(self, version_id: str, timeout: float | None = None) -> bool:
        """Block until ``version_id`` is out of the pipeline (any outcome); ``False`` if ``timeout`` passed first."""
        job = self.get(version_id)
        return job is None or job.released.wait(timeout)

    def taken_before(self, first: Job, then: Job) -> bool:
        """Whether ``first`` was added before ``then`` (both in flight): the order writers take them in."""
        with self.lock:
            for vid in self._jobs:
                if vid in (first.version_id, then.version_id):
                    return vid == first.version_id
            return False

    def remove(self, job: Job) -> None:
        """Drop a settled version and wake whoever waits for it."""
        with self.lock:
            self._jobs.pop(job.version_id, None)
            job.released.set()

    def snapshot(self) -> list[Job]:
        """The jobs in flight, oldest first."""
        with self.lock:
            return list(self._jobs.values())

    def ids(self) -> list[str]:
        """Ids of the versions in flight, oldest first."""
        with self.lock:
            return list(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        with self.lock:
            return len(self._jobs)
