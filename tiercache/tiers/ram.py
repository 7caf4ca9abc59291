"""The RAM arena (one page-aligned block of host memory) and the RAM tier built on it.

The arena is the staging area of every save: the engine allocates regions from it, copies tensors
into them and hands them to :class:`RamTier` with :meth:`RamTier.adopt` (no second copy). The same
memory then serves restores of recent versions at memcpy speed. The arena is allocated once, on
first use, pre-faulted and never grown, so a save never pays for page faults and never allocates
past its budget.

This module also holds the small raw-memory helpers the tiers share (:func:`buffer_address`,
:func:`copy_bytes`, :func:`aligned_buffer`): the disk tier needs page-aligned buffers and buffer
addresses for O_DIRECT.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tiercache.errors import CacheClosedError, ConflictError, TierFullError
from tiercache.names import check_key
from tiercache.tiers.base import Buffer, Observer, RefValue, Tier

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tiercache.tiers.ram")

#: Alignment of every region and of the arena itself (the page size O_DIRECT needs).
ALIGN = 4096

#: Objects smaller than this live in a dict instead of arena regions. Manifests and refs always
#: do, whatever their size: the arena is budgeted for chunks, and a big manifest (thousands of
#: tensors) must never fail a save that already has its chunks staged.
SMALL_OBJECT_BYTES = 4096
_ARENA_PREFIX = "chunks/"

# Linux's MADV_POPULATE_READ and _WRITE (5.14+); Python 3.11's mmap module does not name them.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` struct, to read the address of any buffer-protocol object."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None


def buffer_address(buf: Buffer) -> int:
    """Return the address of the first byte of a C-contiguous buffer (read-only ones too).

    The address stays valid only while ``buf`` (and what it views) is alive.

    Raises:
        BufferError: If ``buf`` is not C-contiguous.
    """
    view = _PyBuffer()
    # PyBUF_SIMPLE (0): the exporter must hand out one contiguous block, or fail.
    _get_buffer(buf, ctypes.byref(view), 0)
    try:
        return view.buf or 0
    finally:
        _release_buffer(ctypes.byref(view))


def copy_bytes(dst: memoryview, src: Buffer) -> None:
    """Copy ``src`` into the start of ``dst`` with the GIL released.

    A plain ``dst[:n] = src`` holds the GIL for the whole memcpy; ``ctypes.memmove`` drops it, so
    a training thread keeps running while background threads copy chunks.

    Raises:
        ValueError: If ``dst`` is shorter than ``src`` or is read-only.
    """
    n = memoryview(src).nbytes
    if n > dst.nbytes or dst.readonly:
        raise ValueError(f"cannot copy {n} bytes into a {'read-only ' if dst.readonly else ''}"
                         f"buffer of {dst.nbytes} bytes")
    if n:
        ctypes.memmove(buffer_address(dst), buffer_address(src), n)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Return a zero-filled, writable, page-aligned anonymous mapping of ``nbytes`` bytes."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def prefault(mapping: mmap.mmap) -> None:
    """Fault every page of a writable mapping in now (``MADV_POPULATE_WRITE``, else a write per page)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        # Kernels before 5.14 refuse the advice: write one zero byte per page instead (only ever
        # done to memory nothing has been written to yet).
        mapping[:: mmap.PAGESIZE] = bytes(len(range(0, len(mapping), mmap.PAGESIZE)))


def map_in(mapping: mmap.mmap) -> None:
    """Build this process's page tables for a shared mapping whose pages exist already.

    A read populate is enough and about 3x faster than :func:`prefault`'s write populate (5 GB:
    0.36 s against 1.1-1.4 s on the bench VM): the owner (the node agent) faulted the pages in, and
    a tmpfs page in a shared writable mapping is mapped writable on a read fault (tmpfs asks for no
    write notification), so later copies into it fault no more than after a write populate, which
    would dirty every page again.
    """
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except OSError:
        # Kernels before 5.14 refuse the advice: read one byte per page instead.
        mapping[:: mmap.PAGESIZE]


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Region(NamedTuple):
    """A block of the arena.

    Attributes:
        offset: Byte offset of the block in the arena (a multiple of 4096).
        nbytes: Length of the block (a multiple of 4096).
    """

    offset: int
    nbytes: int


def _cuda_available() -> bool:
    import torch  # only an arena that should be pinned asks

    return bool(torch.cuda.is_available())


def _cudart() -> Any:
    import torch  # only a pinned arena gets here

    return torch.cuda.cudart()


class Arena:
    """A fixed block of host memory carved into 4096-aligned regions.

    The memory is allocated on the first :meth:`alloc` (opening a cache to list versions costs
    nothing), once, page-aligned, pre-faulted, and never grown; allocation is first-fit over a
    free list that coalesces neighbours on :meth:`free`. All methods are thread-safe.

    Args:
        capacity: Size of the arena in bytes (rounded down to a multiple of 4096).
        pin: Page-lock the memory (``cudaHostRegister``) when CUDA is available, so GPU copies
            into it can run asynchronously; falls back to pageable memory if registering fails.
        mapping: Memory to carve instead of a private anonymous mapping: a shared mapping of at
            least ``capacity`` bytes that its owner has allocated and pre-faulted (the node
            agent's arena, see :mod:`tiercache.agent.arena`). The arena closes it on :meth:`close`.
    """

    def __init__(self, capacity: int, *, pin: bool = False, mapping: mmap.mmap | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"arena capacity must be >= 0, got {capacity}: set ram.capacity")
        if mapping is not None and len(mapping) < capacity:
            raise ValueError(f"a mapping of {len(mapping)} bytes cannot hold an arena of {capacity} bytes")
        self._given = mapping
        self._capacity = capacity // ALIGN * ALIGN
        self._pin = pin and _cuda_available()  # asks torch only when pinning is wanted
        self._cond = threading.Condition()
        self._free: list[Region] = [Region(0, self._capacity)] if self._capacity else []
        self._allocated: dict[int, int] = {}
        #: Offset -> references taken with retain(), each dropped by one free().
        self._retained: dict[int, int] = {}
        self._used = 0
        self._closed = False
        self._mapping: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._pinned_address: int | None = None
        self._populating = False

    @property
    def capacity(self) -> int:
        """Size of the arena in bytes."""
        return self._capacity

    @property
    def is_pinned(self) -> bool:
        """Whether the arena's memory is (or, before the first alloc, will be) page-locked."""
        return self._pin

    @property
    def is_allocated(self) -> bool:
        """Whether the arena's memory has been allocated (it is, from the first alloc on)."""
        return self._view is not None

    @property
    def used_bytes(self) -> int:
        """Bytes currently handed out in regions."""
        with self._cond:
            return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out (possibly fragmented)."""
        with self._cond:
            return self._capacity - self._used

    def _check_request(self, nbytes: int) -> int:
        if self._closed:
            raise CacheClosedError("the RAM arena is closed: open a new cache")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"arena allocation size must be a positive int, got {nbytes!r}")
        need = _round_up(nbytes)
        if need > self._capacity:
            raise TierFullError(
                f"cannot stage {nbytes} bytes in a RAM arena of {self._capacity} bytes: "
                "raise ram.capacity"
            )
        return need

    def prefault(self) -> None:
        """Allocate and pre-fault the memory now, without holding the lock while the kernel works.

        Meant for a background thread started before the first save: allocations that arrive
        meanwhile wait for it to finish instead of faulting the memory a second time.
        """
        with self._cond:
            if self._view is not None or self._populating or self._closed:
                return
            self._populating = True
        try:
            mapping, pinned = self._populate()
        except BaseException:
            with self._cond:
                self._populating = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._populating = False
            self._cond.notify_all()
            if not self._closed:
                self._publish(mapping, pinned)
                return
        # Closed while populating: give the memory back at once.
        if pinned is not None:
            _cudart().cudaHostUnregister(pinned)
        mapping.close()

    def _materialize(self) -> None:
        # Called with the lock held; waits for a prefault() in progress rather than racing it.
        self._cond.wait_for(lambda: not self._populating)
        if self._view is not None:
            return
        if self._closed:
            raise CacheClosedError("the RAM arena is closed: open a new cache")
        self._publish(*self._populate())

    def _populate(self) -> tuple[mmap.mmap, int | None]:
        if self._given is not None:
            mapping = self._given  # allocated and pre-faulted by its owner
        else:
            mapping = aligned_buffer(self._capacity)
            prefault(mapping)
        pinned = None
        if self._pin:
            # Register the mapping rather than using pin_memory=True: torch's pinned allocator
            # rounds sizes up to a power of two, which could nearly double a large arena.
            address = buffer_address(mapping)
            err = int(_cudart().cudaHostRegister(address, self._capacity, 1))  # Portable
            if err:
                log.warning("cannot pin the %d-byte RAM arena (cudaError %d); using pageable memory",
                            self._capacity, err)
                self._pin = False
            else:
                pinned = address
        return mapping, pinned

    def _publish(self, mapping: mmap.mmap, pinned: int | None) -> None:
        # Called with the lock held.
        self._pinned_address = pinned
        self._mapping = mapping
        import torch  # the arena exists only for saves, which need torch anyway

        self._tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self._view = memoryview(mapping)

    def _take(self, need: int) -> Region | None:
        self._materialize()
        for i, block in enumerate(self._free):
            if block.nbytes >= need:
                if block.nbytes == need:
                    del self._free[i]
                else:
                    self._free[i] = Region(block.offset + need, block.nbytes - need)
                self._allocated[block.offset] = need
                self._used += need
                return Region(block.offset, need)
        return None

    def alloc(self, nbytes: int) -> Region | None:
        """Allocate a region of at least ``nbytes`` bytes (rounded up to 4096).

        Returns:
            The region, or ``None`` if no contiguous free block is large enough right now.

        Raises:
            TierFullError: If ``nbytes`` exceeds the whole arena (it could never fit).
            ValueError: If ``nbytes`` is not a positive int.
            CacheClosedError: If the arena was closed.
        """
        with self._cond:
            return self._take(self._check_request(nbytes))

    def alloc_wait(self, nbytes: int, timeout: float | None) -> Region | None:
        """Allocate like :meth:`alloc`, waiting for :meth:`free` to make room.

        Args:
            nbytes: Bytes wanted.
            timeout: Seconds to wait at most; ``None`` waits for ever.

        Returns:
            The region, or ``None`` if the timeout passed without room.

        Raises:
            TierFullError: If ``nbytes`` exceeds the whole arena (it could never fit).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                region = self._take(self._check_request(nbytes))
                if region is not None:
                    return region
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    @property
    def in_use(self) -> tuple[int, int]:
        """Bytes of live regions, and references taken by :meth:`retain` not yet dropped (readers)."""
        with self._cond:
            return self._used, sum(self._retained.values())

    def retain(self, region: Region) -> None:
        """Take one more reference to a live region.

        The region goes back to the arena only once :meth:`free` has been called for every
        reference (the allocation's and each retain's), so a reader (an early disk write, a read
        of the RAM tier) keeps a region's bytes while its owner frees it.

        Raises:
            ValueError: If the region is not live in this arena.
        """
        with self._cond:
            if self._allocated.get(region.offset) != region.nbytes:
                raise ValueError(f"{region} is not a live region of this arena")
            self._retained[region.offset] = self._retained.get(region.offset, 0) + 1

    def free(self, region: Region) -> None:
        """Drop a reference to a region; the last returns it and wakes :meth:`alloc_wait`.

        Freeing after :meth:`close` is a no-op, so owners can tear down in any order.

        Raises:
            ValueError: If the region was not handed out by this arena or was freed already.
        """
        with self._cond:
            if self._closed:
                return
            if self._allocated.get(region.offset) != region.nbytes:
                raise ValueError(f"{region} was not allocated from this arena or was already freed")
            extra = self._retained.pop(region.offset, 0)
            if extra:
                if extra > 1:
                    self._retained[region.offset] = extra - 1
                return
            del self._allocated[region.offset]
            self._used -= region.nbytes
            i = bisect.bisect_left(self._free, region)
            start, end = region.offset, region.offset + region.nbytes
            if i < len(self._free) and self._free[i].offset == end:
                end += self._free.pop(i).nbytes
            if i > 0 and self._free[i - 1].offset + self._free[i - 1].nbytes == start:
                i -= 1
                start = self._free.pop(i).offset
            self._free.insert(i, Region(start, end - start))
            self._cond.notify_all()

    def _check_region(self, region: Region) -> memoryview:
        view = self._view
        if view is None or self._allocated.get(region.offset) != region.nbytes:
            raise ValueError(f"{region} is not a live region of this arena")
        return view

    def buffer(self, region: Region) -> memoryview:
        """Return a writable memoryview of a live region's bytes (no copy)."""
        return self._check_region(region)[region.offset : region.offset + region.nbytes]

    def tensor(self, region: Region) -> torch.Tensor:
        """Return a 1-D ``uint8`` tensor sharing a live region's memory (no copy)."""
        self._check_region(region)
        assert self._tensor is not None
        return self._tensor[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        """Release the memory; views handed out keep it alive until they are dropped."""
        with self._cond:
            self._closed = True
            mapping, self._mapping = self._mapping, None
            pinned, self._pinned_address = self._pinned_address, None
            self._view = self._tensor = None
            self._free, self._allocated, self._retained, self._used = [], {}, {}, 0
            self._cond.notify_all()
        if pinned is not None:
            _cudart().cudaHostUnregister(pinned)
        if mapping is not None:
            # A tensor or memoryview may still export it; then the GC unmaps it after them.
            with contextlib.suppress(BufferError):
                mapping.close()


@dataclass
class _Entry:
    """One stored object: small bytes, or a region of the arena."""

    data: bytes | None
    region: Region | None
    length: int
    gen: int
    #: The arena ``region`` was taken from while the entry was made (see :meth:`RamTier.move_to`).
    made_in: Arena | None = None


class RamTier(Tier):
    """A non-durable tier holding objects in an :class:`Arena` (and small ones in a dict).

    Objects of at least 4096 bytes live in arena regions, smaller ones (manifests, refs) in a
    dict. Every write gets a fresh generation number, which is the CAS token of refs. A region
    being read by :meth:`get`/:meth:`read_into` is freed only after the read finishes, so a
    concurrent delete or overwrite never tears a read.

    Args:
        arena: The arena to hold objects in (shared with the engine's staging).
    """

    name = "ram"
    durable = False
    lends = True
    node_local = True

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.capacity = arena.capacity
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._gens = itertools.count(1)

    def _unref(self, entry: _Entry) -> None:
        # Drops one reference to the entry's region: the tier's own (with the lock held, once
        # the key no longer reaches the entry) or a reader's (see _acquire). The arena returns
        # the region at the last one, so a delete or overwrite never frees bytes being read.
        if entry.region is not None:
            self.arena.free(entry.region)

    def _install(self, key: str, entry: _Entry, check: Callable[[_Entry | None], None] | None) -> bool:
        with self._lock:
            if entry.made_in is not None and entry.made_in is not self.arena:
                # The tier moved to a larger arena while this copy was made in the old one: the
                # caller copies again (see move_to).
                assert entry.region is not None
                entry.made_in.free(entry.region)
                return False
            old = self._entries.get(key)
            try:
                if check is not None:
                    check(old)
            except BaseException:
                self._unref(entry)
                raise
            entry.gen = next(self._gens)
            self._entries[key] = entry
            if old is not None:
                self._unref(old)
            return True

    def _make_entry(self, data: Buffer, key: str) -> _Entry:
        src = memoryview(data).cast("B")
        n = src.nbytes
        if n < SMALL_OBJECT_BYTES or not key.startswith(_ARENA_PREFIX):
            return _Entry(bytes(src), None, n, 0, None)
        arena = self.arena
        region = arena.alloc(n)
        if region is None:
            raise TierFullError(
                f"RAM tier: no contiguous room for {n} bytes in the arena "
                f"({arena.used_bytes} of {arena.capacity} bytes in use): raise ram.capacity"
            )
        try:
            copy_bytes(arena.buffer(region), src)
        except BaseException:
            arena.free(region)
            raise
        return _Entry(None, region, n, 0, arena)

    def _acquire(self, key: str) -> _Entry | None:
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.region is not None:
                self.arena.retain(entry.region)  # the reader's reference, dropped by _unref
            return entry

    def _bytes_of(self, entry: _Entry) -> memoryview:
        if entry.data is not None:
            return memoryview(entry.data)
        assert entry.region is not None
        return self.arena.buffer(entry.region)[: entry.length]

    def get(self, key: str) -> bytes | None:
        """Return a copy of the object at ``key``, or ``None``."""
        entry = self._acquire(key)
        if entry is None:
            return None
        try:
            return bytes(self._bytes_of(entry))
        finally:
            self._unref(entry)

    def read_into(
        self, key: str, out: memoryview, offset: int = 0, *, observe: Observer | None = None
    ) -> int | None:
        """Copy bytes ``[offset, offset + len(out))`` of ``key`` into ``out`` (``observe`` sees them after).

        Returns:
            Bytes copied (short at the end of the object), or ``None`` if there is no object.
        """
        if offset < 0:
            raise ValueError(f"read offset must be >= 0, got {offset}")
        entry = self._acquire(key)
        if entry is None:
            return None
        try:
            dst = memoryview(out).cast("B")
            src = self._bytes_of(entry)[offset : offset + dst.nbytes]
            copy_bytes(dst, src)
            if observe is not None:
                observe(dst[: src.nbytes])
            return src.nbytes
        finally:
            self._unref(entry)

    @contextlib.contextmanager
    def borrow(self, key: str) -> Iterator[memoryview | None]:
        """Lend a read-only, zero-copy view of the object at ``key`` (``None`` if there is none).

        The object's bytes stay where they are until the block ends, even if the key is deleted
        or overwritten meanwhile: a write to another tier still reading them never sees their
        region reused by the next save. Do not keep the view past the block.
        """
        entry = self._acquire(key)
        if entry is None:
            yield None
            return
        try:
            yield self._bytes_of(entry).toreadonly()
        finally:
            self._unref(entry)

    def pin(self, key: str) -> tuple[Region | None, int, bytes | None] | None:
        """Keep the object at ``key`` where it is until :meth:`unpin`, for a reader in another process.

        The node agent lends chunks of its arena this way to trainers that map it (see
        :mod:`tiercache.agent.server`): the region is not reused while pinned, even if the key is
        deleted or overwritten meanwhile.

        Returns:
            ``(region, length, None)`` for an object in the arena (pinned: call :meth:`unpin` with
            the region), ``(None, length, bytes)`` for a small object (a copy; nothing pinned),
            or ``None`` if there is no such object.
        """
        entry = self._acquire(key)
        if entry is None:
            return None
        if entry.region is None:
            return None, entry.length, entry.data
        return entry.region, entry.length, None

    def unpin(self, region: Region) -> None:
        """Let go of a region :meth:`pin` returned."""
        self.arena.free(region)

    def put(self, key: str, data: Buffer, *, sync_name: bool = True) -> None:
        """Copy ``data`` into the tier (an arena region for 4096 bytes and more).

        ``sync_name`` is ignored: nothing here outlives the process.

        Raises:
            TierFullError: If the arena has no contiguous room for it.
        """
        check_key(key)
        while not self._install(key, self._make_entry(data, key), None):
            pass

    def adopt(self, key: str, region: Region, length: int) -> bool:
        """Register an arena region the caller already filled as the object ``key`` (no copy).

        The tier owns the region from now on. If ``key`` is already stored, its existing copy
        is kept and ``region`` is freed: chunks are content-addressed, so that is dedup.

        Args:
            key: The object's key.
            region: A live region of this tier's arena.
            length: The object's length (at most ``region.nbytes``).

        Returns:
            ``True`` if the region now holds ``key``, ``False`` if it was a duplicate.
        """
        check_key(key)
        if not 0 <= length <= region.nbytes:
            raise ValueError(f"length {length} does not fit in {region}")
        with self._lock:
            if key in self._entries:
                self.arena.free(region)
                return False
            self._entries[key] = _Entry(None, region, length, next(self._gens))
            return True

    def size(self, key: str) -> int | None:
        """Return the object's length, or ``None``."""
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.length

    def delete(self, key: str) -> None:
        """Drop the object and free its region; a missing key is a no-op."""
        check_key(key)
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._unref(entry)

    def list(self, prefix: str = "") -> list[str]:
        """Return the stored keys starting with ``prefix``, sorted."""
        with self._lock:
            return sorted(k for k in self._entries if k.startswith(prefix))

    def read_ref(self, key: str) -> RefValue | None:
        """Return the ref's content and token (its write generation), or ``None``."""
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            return RefValue(bytes(self._bytes_of(entry)), str(entry.gen))

    def write_ref(self, key: str, data: bytes, *, expect: str | None) -> str:
        """Create (``expect=None``) or compare-and-swap a ref; see :meth:`Tier.write_ref`."""
        check_key(key)

        def check(old: _Entry | None) -> None:
            if expect is None and old is not None:
                raise ConflictError(f"ref {key} already exists")
            if expect is not None and (old is None or str(old.gen) != expect):
                raise ConflictError(f"ref {key} was moved or deleted since it was read")

        entry = self._make_entry(data, key)
        while not self._install(key, entry, check):
            entry = self._make_entry(data, key)
        return str(entry.gen)

    def delete_ref(self, key: str, *, expect: str) -> None:
        """Delete a ref if its token is still ``expect``.

        Raises:
            ConflictError: If the ref was moved or deleted since ``expect`` was read.
        """
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or str(entry.gen) != expect:
                raise ConflictError(f"ref {key} was moved or deleted since it was read")
            del self._entries[key]
            self._unref(entry)

    def move_to(self, arena: Arena) -> bool:
        """Move every object into ``arena`` (a larger one the owner made), if nothing else uses the current one.

        Only when every allocated region of the current arena is an object of this tier (no
        staged version, no reader, no lent region holds one) is it safe: then the objects are
        copied over, their old regions freed, and this tier lives in ``arena`` from now on. A
        :meth:`put` that was copying into the old arena meanwhile copies again.

        Returns:
            Whether the objects moved (``False``: some region is still in use; nothing changed).
        """
        with self._lock:
            held = [e for e in self._entries.values() if e.region is not None]
            used, readers = self.arena.in_use
            if readers or used != sum(e.region.nbytes for e in held if e.region is not None):
                return False
            moved: list[tuple[_Entry, Region]] = []
            for e in held:
                assert e.region is not None
                r = arena.alloc(e.length)
                if r is None:
                    for _, got in moved:
                        arena.free(got)
                    return False
                copy_bytes(arena.buffer(r), self.arena.buffer(e.region)[: e.length])
                moved.append((e, r))
            old, self.arena, self.capacity = self.arena, arena, arena.capacity
            for e, r in moved:
                assert e.region is not None
                old.free(e.region)
                e.region = r
            return True

    def used_bytes(self) -> int:
        """Bytes held: whole regions for large objects, lengths for small ones."""
        with self._lock:
            return sum(e.region.nbytes if e.region else e.length for e in self._entries.values())

    def close(self) -> None:
        """Drop every object and free its region (the arena itself stays with its owner)."""
        with self._lock:
            entries, self._entries = self._entries, {}
            for entry in entries.values():
                self._unref(entry)
