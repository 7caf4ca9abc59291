"""The contract every storage tier (RAM arena, disk directory, S3 prefix) implements.

A tier is a flat key -> bytes store with the key layout of docs/design.md section 2
(``chunks/<id[:2]>/<id>``, ``versions/<id>.json``, ``refs/branch/<name>``, ``refs/tag/<name>``),
plus compare-and-swap on refs. The engine is the only caller; it never holds a lock across calls.

Threading: every method may be called concurrently from several engine threads, for different
keys or the same key; implementations make that safe themselves.

Call order the engine follows on a durable tier (and that tiers may rely on): ``put`` every chunk
of a version, then ``put`` its manifest, then ``write_ref``. GC runs the other way round.

Semantics every implementation must honour (checked by ``tests/tier_conformance.py``):

* ``put`` is atomic: a reader sees the whole new object or nothing (never a torn object), and on a
  durable tier the object is durable when ``put`` returns (its name too, unless put with
  ``sync_name=False``: then once ``sync_names`` returns). Re-putting a key overwrites it; for
  content-addressed chunks that is idempotent.
* ``get``/``read_into``/``size`` return ``None`` on a missing key; they never raise for a miss.
* ``delete`` of a missing key is a no-op.
* ``list(prefix)`` returns every stored key that starts with ``prefix``, sorted; temporary files
  or in-flight uploads never appear.
* ``write_ref(key, data, expect=None)`` creates the ref and raises :class:`ConflictError` if it
  exists; ``write_ref(key, data, expect=token)`` replaces it only if its current token is
  ``token``, else raises :class:`ConflictError`. A write whose response was lost and that did land
  is a success, not a conflict. It returns the new token.
* Keys are validated with :func:`tiercache.names.check_key` before any I/O; an invalid key raises
  :class:`InvalidNameError` and touches nothing.
* Errors are mapped onto :mod:`tiercache.errors` (``TierFullError`` for ENOSPC or capacity,
  ``TierUnavailableError``, ``AccessDeniedError``, ``BucketNotFoundError``, ``StorageError``) with
  the original exception as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeGuard, runtime_checkable

if TYPE_CHECKING:
    from tiercache.tiers._s3pacing import Pacer

#: Anything exposing the buffer protocol that ``put`` accepts.
Buffer = bytes | bytearray | memoryview

#: Sees the bytes :meth:`Tier.read_into` reads, piece by piece, in order.
Observer = Callable[[memoryview], None]


class RefValue(NamedTuple):
    """A ref's current content and the opaque token a compare-and-swap must present."""

    data: bytes
    token: str


class Tier(ABC):
    """A key -> bytes store with atomic puts and compare-and-swap refs.

    Attributes:
        name: The tier's name in configs, manifests and CLI output (``ram``, ``disk``, ``s3``).
        durable: Whether a completed ``put`` survives the process (``False`` only for RAM).
        capacity: Byte budget of the tier, or ``None`` for unbounded.
    """

    name: str
    durable: bool
    capacity: int | None = None
    #: Whether a put with ``sync_name=False`` needs :meth:`sync_names` before its name is durable
    #: (a directory-based tier); the repo then also syncs, once, names it found but did not write.
    names_need_sync: bool = False
    #: Whether a chunk's payload can be written before its name (hash) is known (the tier is an
    #: :class:`EarlyWriter`): the engine then starts writing while the rest of the state is still
    #: being copied. Reach ``begin_put`` through :func:`early_writer`.
    early_writes: bool = False
    #: Whether reads may borrow the stored bytes in place (the tier is a :class:`Lender`) instead
    #: of copying them out. Reach ``borrow`` through :func:`lender`.
    lends: bool = False
    #: Whether a put's success does not prove the object is kept (a store across a network may
    #: answer 200 and keep nothing): the repo then checks a manifest is there before a ref names it.
    confirm_puts: bool = False
    #: Threads the engine writes this tier's chunks with (``None``: the config's ``io_threads``).
    write_threads: int | None = None
    #: Seconds a version's chunk writes may take here, retries included (``None``: no limit).
    deadline_s: float | None = None
    #: Whether each node of a multi-rank job has its own copy of this tier (a node-local disk): the
    #: group writes each node's part to its node instead of splitting one copy over the group.
    node_local: bool = False
    #: Paces this tier's requests when the store throttles; a multi-rank group shares it among a
    #: node's ranks and slows every rank when one was throttled (``None``: not paced).
    pacer: Pacer | None = None

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """Return the whole object stored at ``key``, or ``None`` if there is none."""

    @abstractmethod
    def read_into(
        self, key: str, out: memoryview, offset: int = 0, *, observe: Observer | None = None
    ) -> int | None:
        """Read bytes ``[offset, offset + len(out))`` of ``key`` into ``out``.

        Args:
            key: The object's key.
            out: A writable, C-contiguous byte buffer (for example a tensor's memory).
            offset: Where in the object to start reading.
            observe: Called with consecutive runs of the bytes read, in order, covering exactly
                the bytes returned; tiers that read in pieces call it per piece while the piece
                is still in the CPU cache (a restore hashes chunks this way).

        Returns:
            The number of bytes read (short only at the end of the object), or ``None`` if the
            object does not exist.
        """

    @abstractmethod
    def put(self, key: str, data: Buffer, *, sync_name: bool = True) -> None:
        """Store ``data`` at ``key`` atomically (and durably, on a durable tier).

        Args:
            key: The object's key.
            data: Its bytes.
            sync_name: If ``False``, the tier may leave making the new name durable to a later
                :meth:`sync_names` (a tier whose names are durable as the put returns ignores it).

        Raises:
            TierFullError: If the tier has no room; nothing partial is left behind.
        """

    def lend_ahead(self, keys: Sequence[str]) -> AbstractContextManager[None]:
        """Get ready, in one go, to lend the objects at ``keys`` that reads will ``borrow`` in the block.

        A tier that lends across processes (node RAM through its agent) pins them all in one
        round trip instead of one per ``borrow``; the others have nothing to prepare.
        """
        del keys
        return contextlib.nullcontext()

    def sync_names(self, keys: Iterable[str]) -> None:
        """Make durable the names of objects put with ``sync_name=False``.

        The engine calls it once per version, after the chunks and before the manifest, so a
        directory-based tier syncs each directory once instead of once per chunk. Tiers whose
        puts name objects durably do nothing.
        """
        del keys  # nothing to do: this tier's names are durable when put returns

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Return the stored object's length in bytes, or ``None`` if it does not exist."""

    def exists(self, key: str) -> bool:
        """Return whether an object is stored at ``key``."""
        return self.size(key) is not None

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is a no-op."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Return every stored key starting with ``prefix``, sorted."""

    def list_dated(self, prefix: str = "") -> list[tuple[str, int, datetime]]:
        """``(key, size, last modified)`` of every stored key starting with ``prefix``, sorted.

        A tier that cannot tell an object's age reports it as written now, so only ``gc`` with no
        grace period collects there.
        """
        now = datetime.now(UTC)
        return [(key, self.size(key) or 0, now) for key in self.list(prefix)]

    @abstractmethod
    def read_ref(self, key: str) -> RefValue | None:
        """Return a ref's content and CAS token, or ``None`` if the ref does not exist."""

    @abstractmethod
    def write_ref(self, key: str, data: bytes, *, expect: str | None) -> str:
        """Create (``expect=None``) or compare-and-swap (``expect=token``) a ref.

        Returns:
            The ref's new token.

        Raises:
            ConflictError: If the ref exists (create) or its token is not ``expect`` (swap).
        """

    @abstractmethod
    def delete_ref(self, key: str, *, expect: str) -> None:
        """Delete a ref if its token is still ``expect``.

        Raises:
            ConflictError: If the ref changed since ``expect`` was read.
        """

    def probe(self) -> None:  # noqa: B027 - optional hook: a tier in this process's memory always answers
        """Check cheaply, without writing anything, that the tier answers now.

        Called when a cache opens and while the tier is down after an outage.

        Raises:
            StorageError: A subclass saying why not (``TierUnavailableError``, ``TierFullError``...).
        """

    @abstractmethod
    def used_bytes(self) -> int:
        """Return the bytes this tier currently holds (for capacity decisions and ``stats``)."""

    def budget(self) -> int | None:
        """The most bytes this tier may hold now (what it holds included), or ``None`` if nothing bounds it.

        Its :attr:`capacity` here; a tier on a filesystem also stops at what the filesystem has
        room for, so a full filesystem is treated like a capacity (evicted into, reported full).
        Cheap enough to call per decision; only called where :meth:`used_bytes` may be too.

        Raises:
            StorageError: If the tier cannot tell (its root is gone).
        """
        return self.capacity

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release connections, file descriptors and memory; the tier is unusable afterwards."""


# Optional capabilities. A tier that sets one of the flags above also implements the protocol it
# names; callers reach the extra methods through the narrowing functions below, which check both,
# so a tier that declares a flag without the method is treated as not having the capability.


class PendingWrite(Protocol):
    """One object being written whose key is chosen when it is committed (see :class:`EarlyWriter`)."""

    def write(self, offset: int, src: Buffer) -> None:
        """Write ``src`` at byte ``offset`` of the object."""

    def commit(self, key: str) -> None:
        """Make the object durable under ``key``."""

    def abort(self) -> None:
        """Drop the object and what it reserved; a no-op once committed, so it may always be called."""


@runtime_checkable
class EarlyWriter(Protocol):
    """A tier that can write an object before its key is known (``Tier.early_writes``)."""

    def begin_put(self, nbytes: int, under: str, *, sync_name: bool = True) -> PendingWrite:
        """Start writing an object of ``nbytes`` bytes under key prefix ``under``, named at commit."""


@runtime_checkable
class Lender(Protocol):
    """A tier that lends its stored bytes in place instead of copying them out (``Tier.lends``)."""

    def borrow(self, key: str) -> AbstractContextManager[memoryview | None]:
        """A read-only view of the object at ``key`` for the block (``None`` if there is none)."""


@runtime_checkable
class MultipartAdmin(Protocol):
    """A tier on an S3 store: the checks and the clean-up ``tiercache doctor`` runs there."""

    def probe_conditional_writes(self) -> dict[str, bool]:
        """Which conditional writes the store honours, found by trying each on scratch keys."""

    def upload_clock_skew(self) -> float:
        """Seconds the store's upload start times are off this clock."""

    def list_multipart_uploads(self) -> list[tuple[str, str, datetime]]:
        """``(key, upload id, initiated)`` of every multipart upload left open under the prefix."""

    def abort_multipart_upload(self, key: str, upload_id: str) -> None:
        """Abort one open multipart upload."""


@functools.cache
def _implements(cls: type, capability: type) -> bool:
    """Whether tier class ``cls`` has the methods of ``capability``, checked once per class.

    ``isinstance`` against a protocol looks every method up on each call (tens of microseconds),
    and :func:`lender` runs once per chunk a restore reads.
    """
    return issubclass(cls, capability)


def _is_early_writer(tier: Tier) -> TypeGuard[EarlyWriter]:
    return tier.early_writes and _implements(type(tier), EarlyWriter)


def _is_lender(tier: Tier) -> TypeGuard[Lender]:
    return tier.lends and _implements(type(tier), Lender)


def early_writer(tier: Tier) -> EarlyWriter | None:
    """``tier`` as an :class:`EarlyWriter` if it declares ``early_writes`` and implements it, else ``None``."""
    return tier if _is_early_writer(tier) else None


def lender(tier: Tier) -> Lender | None:
    """``tier`` as a :class:`Lender` if it declares ``lends`` and implements it, else ``None``."""
    return tier if _is_lender(tier) else None
