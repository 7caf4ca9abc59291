"""The read path: every chunk from the fastest tier that holds a good copy, verified.

For each chunk the reader tries the tiers that hold it, best observed read throughput first
(RAM, then disk, then S3 before anything is measured). Every copy is checked against its content
id; a missing or damaged copy is logged and the next tier is tried, and only when no tier has a
good copy does the restore fail, naming the chunk.

Chunks are read in parallel, and every byte is hashed as it arrives, while it is still in the CPU
cache; a chunk the RAM tier lends (in process or the node agent's arena) is hashed on a thread of
its own while the reading thread copies it out, so a restore from RAM costs little more than the
copy. A raw chunk that holds one tensor's bytes is read straight into the destination tensor
(O_DIRECT where its memory is page-aligned, as new destinations are); a pack of small tensors is
streamed through a small reused window and scattered from it, so no chunk-sized buffer is ever
allocated. Bytes land in the destinations before the chunk's hash is complete: a damaged copy is
overwritten by the next tier's good one, and when no tier has a good copy the restore raises and
tensors passed as ``into`` may hold part of the chunk.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiercache import codecs
from tiercache.dtypes import DTYPES
from tiercache.errors import IntegrityError, StateMismatchError, TierCacheError, UnsupportedStateError
from tiercache.format import dtype_from_name, dtype_name, tensor_paths, unflatten
from tiercache.gcpause import gc_paused
from tiercache.manifest import Version
from tiercache.names import chunk_key
from tiercache.policy.meter import ThroughputMeter
from tiercache.repo.objects import check_header, decode_verify
from tiercache.tensor_table import TensorTable
from tiercache.tiers.base import Tier, lender
from tiercache.tiers.ram import ALIGN, aligned_buffer, buffer_address

log = logging.getLogger("tiercache.restore")

Progress = Callable[[int], None]
#: Reads a version's chunks into one new tensor per entry; returns raw bytes read per source.
Fill = Callable[["Version", Sequence[torch.Tensor], "Progress | None"], dict[str, int]]

#: New destinations at least this big are page-aligned (smaller ones are packed chunks' tensors,
#: which are copied out of a buffer anyway).
_ALIGNED_FROM_BYTES = 1 << 20

#: Window a pack of small tensors is read through: a few MiB, so it stays in the CPU cache while
#: it is hashed and scattered, and each read is still large enough for the device.
_WINDOW_BYTES = 4 << 20
_DEFAULT_ORDER = {"ram": 0, "disk": 1, "s3": 2}
#: Lent (RAM) payloads at least this big are hashed beside their copy, not before it.
_HASH_BESIDE_FROM = 4 << 20


def _content_id(payload: memoryview, algo: str) -> str:
    digest = codecs.hasher(algo)
    digest.update(payload)
    return digest.hexdigest()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy).

    The caller keeps ``t`` alive while the view is used.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def empty_aligned(shape: Sequence[int], dtype: torch.dtype, nbytes: int | None = None) -> torch.Tensor:
    """A new contiguous CPU tensor to restore into; large ones start page-aligned.

    Aligned memory lets a disk restore read straight into the tensor with O_DIRECT instead of
    through a bounce buffer. Each tensor owns its storage, which starts up to one page before the
    tensor (``storage_offset`` is not 0). ``nbytes``, where the caller knows it, saves working it out.
    """
    itemsize = dtype.itemsize
    if nbytes is None:
        nbytes = math.prod(shape) * itemsize
    if nbytes < _ALIGNED_FROM_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    pad = -raw.data_ptr() % ALIGN
    if pad % itemsize:  # torch's allocator aligns to 64 bytes, so this does not happen
        return torch.empty(tuple(shape), dtype=dtype)
    return raw[pad : pad + nbytes].view(dtype).view(tuple(shape))


def into_targets(into: object) -> dict[str, torch.Tensor]:
    """The tensors of a ``restore(into=...)`` state by key path (empty for ``None``)."""
    if into is None:
        return {}
    return tensor_paths(into)


#: Keys named in a mismatch message, per side.
_SHOWN_KEYS = 4

_get_dtype = operator.attrgetter("dtype")
_get_shape = operator.attrgetter("shape")
_get_layout = operator.attrgetter("layout")
_get_is_cpu = operator.attrgetter("is_cpu")
_is_contiguous = torch.Tensor.is_contiguous
_is_neg = torch.Tensor.is_neg


@dataclass(frozen=True)
class IntoPlan:
    """Which tensor of a ``restore(into=...)`` state receives each tensor of a version.

    Attributes:
        slots: Per tensor entry of the version, the tensor of ``into`` it fills (``None``: a new one).
        direct: Per entry, whether its slot is read into straight (a contiguous CPU tensor without
            a lazy negation or conjugation bit); the others are filled through a copy.
        unmatched: ``(key, why)`` for each tensor of ``into`` that cannot be filled.
    """

    slots: list[torch.Tensor | None]
    direct: list[bool]
    unmatched: list[tuple[str, str]]

    @property
    def all_direct(self) -> bool:
        """Every tensor of the version has a slot that is read into straight."""
        return all(self.direct)


def plan_into(version: Version, targets: dict[str, torch.Tensor], *, strict: bool) -> IntoPlan:
    """Match the tensors given as ``restore(into=...)`` with the version's, before reading anything.

    A state of many tiny tensors is matched over whole lists: each tensor is asked for its dtype,
    shape, layout, device and contiguity once, through C getters, and the lists are compared with
    the version's columns at once; only where that finds something out of the ordinary (a missing
    key, a mismatch, another device, a view, a tensor :func:`tiercache.format.flatten` would not
    store as one) is each tensor looked at on its own.

    Args:
        version: The version to restore.
        targets: The tensors of ``into`` by key path (:func:`into_targets`).
        strict: Raise on any tensor of ``into`` that cannot be filled.

    Raises:
        StateMismatchError: With ``strict``, if some tensor of ``into`` matches no tensor of the
            version or has another dtype or shape; the message names the first few keys of
            ``into`` and of the version that did not match, and the fix when the keys only differ
            by a prefix (a state saved as ``{"model": ...}`` restored into ``model.state_dict()``).
    """
    table = version.tensors
    n = len(table)
    if not targets:
        return IntoPlan([None] * n, [False] * n, [])
    plan = _plan_at_once(table, targets)
    if plan is None:
        plan = _plan_one_by_one(table, targets)
    if plan.unmatched and strict:
        _refuse(version, plan.unmatched, targets)
    return plan


def _plan_at_once(table: TensorTable, targets: dict[str, torch.Tensor]) -> IntoPlan | None:
    """The plan where every tensor of ``targets`` matches and is read into straight; else ``None``."""
    keys, tensors = list(targets), list(targets.values())
    paths = table.paths
    if keys == paths:  # into is the saved state's own shape (the usual resume): no lookups
        index: list[int] | None = None
        names, shapes = table.dtypes, table.shapes
    else:
        saved = dict(zip(paths, range(len(paths)), strict=True))
        index = [saved.get(k, -1) for k in keys]
        if -1 in index:
            return None
        names = [table.dtypes[j] for j in index]
        shapes = [table.shapes[j] for j in index]
    kinds = {name: dtype_from_name(name) for name in set(names)}
    if any(DTYPES[name].complex for name in kinds):
        return None  # a conjugation bit is possible: one by one
    try:
        if (list(map(_get_dtype, tensors)) != list(map(kinds.__getitem__, names))
                or list(map(_get_shape, tensors)) != shapes
                or not all(layout is torch.strided for layout in map(_get_layout, tensors))
                or not all(map(_get_is_cpu, tensors))
                or not all(map(_is_contiguous, tensors))
                or any(map(_is_neg, tensors))):
            return None
    except (RuntimeError, NotImplementedError):  # a tensor that has no shape or contiguity to ask for (nested, sparse)
        return None
    if index is None:
        return IntoPlan(tensors, [True] * len(tensors), [])
    slots: list[torch.Tensor | None] = [None] * len(paths)
    direct = [False] * len(paths)
    for j, t in zip(index, tensors, strict=True):
        slots[j] = t
        direct[j] = True
    return IntoPlan(slots, direct, [])


def _plan_one_by_one(table: TensorTable, targets: dict[str, torch.Tensor]) -> IntoPlan:
    saved = {p: i for i, p in enumerate(table.paths)}
    slots: list[torch.Tensor | None] = [None] * len(table)
    direct = [False] * len(table)
    out: list[tuple[str, str]] = []
    for key, t in targets.items():
        if not _storable(t.dtype) or t.layout is not torch.strided or t.is_nested or t.is_meta:
            continue  # not a tensor a save stores as one: the restored state gets a new tensor there
        i = saved.get(key)
        if i is None:
            out.append((key, "no tensor of that key in the version"))
            continue
        dtype, shape = dtype_from_name(table.dtypes[i]), table.shapes[i]
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            out.append((key, f"is {t.dtype}{list(t.shape)} but the saved tensor is {dtype}{list(shape)}"))
            continue
        slots[i] = t
        direct[i] = t.is_cpu and t.is_contiguous() and not t.is_neg() and not t.is_conj()
    return IntoPlan(slots, direct, out)


def _storable(dtype: torch.dtype) -> bool:
    try:
        dtype_name(dtype)
    except UnsupportedStateError:
        return False
    return True


def match_into(version: Version, targets: dict[str, torch.Tensor], *, strict: bool) -> list[tuple[str, str]]:
    """Check the tensors given as ``restore(into=...)`` against the version's, before reading anything.

    :func:`plan_into` without the plan.

    Returns:
        ``(key, why)`` for each tensor of ``into`` that cannot be filled (empty when all match).

    Raises:
        StateMismatchError: As :func:`plan_into`.
    """
    return plan_into(version, targets, strict=strict).unmatched


def _refuse(version: Version, unmatched: list[tuple[str, str]], targets: dict[str, torch.Tensor]) -> None:
    missing = [k for k, why in unmatched if why.startswith("no tensor")]
    if not missing:
        key, why = unmatched[0]
        more = f" (and {len(unmatched) - 1} more)" if len(unmatched) > 1 else ""
        raise StateMismatchError(f"restore into: {key!r} {why}{more}; nothing was read")
    unused = [p for p in version.tensors.paths if p not in targets]
    hint = _prefix_hint(missing, unused)
    raise StateMismatchError(
        f"restore into: {len(missing)} tensor(s) of into match nothing in version {version.id}: "
        f"{_keys(missing)}; the version's unmatched tensors are {_keys(unused)}{hint}; nothing was read "
        "(pass strict=False to fill only what matches)"
    )


def _keys(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN_KEYS])
    return shown + (f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else "") if keys else "none"


def _prefix_hint(missing: list[str], unused: list[str]) -> str:
    """``; they are the version's keys under 'model/': pass into={'model': ...}`` when that is the fix."""
    for p in unused:
        if p.endswith("/" + missing[0]):
            prefix = p[: -len(missing[0])]
            if all(prefix + k in unused for k in missing):
                outer = prefix.rstrip("/").split("/")
                shown = "".join(f"{{{part!r}: " for part in outer) + "..." + "}" * len(outer)
                return f"; they are the version's keys under {prefix!r}: pass into={shown}"
    return ""


def assemble(version: Version, read: Callable[[Sequence[torch.Tensor]], None], *, into: Any, map_location: Any,
             strict: bool, allow_pickle: bool) -> Any:
    """The state ``version`` describes, its tensors filled by ``read`` (a restore once the version is resolved).

    Plans where each saved tensor lands (a tensor of ``into``, or a new page-aligned one), has
    ``read`` fill those destinations (each a contiguous CPU tensor of its entry's size), copies
    into the tensors of ``into`` that could not be read into straight, and rebuilds the state.

    Args:
        version: The manifest (a rank's part, or a version with one part).
        read: Reads the version's chunks into the destinations, one per tensor entry.
        into: As ``TierCache.restore``: tensors that receive the saved bytes in place.
        map_location: Device for the tensors that are allocated.
        strict: As ``TierCache.restore``.
        allow_pickle: Whether a pickled leaf may be loaded (the config allows it).

    Returns:
        The state; with ``into`` and ``strict=False``, ``(state, unmatched)``.

    Raises:
        StateMismatchError: With ``strict``, as :func:`plan_into` (nothing is read).
    """
    table = version.tensors
    finals: list[tuple[torch.Tensor, torch.Tensor]] = []
    dests: list[torch.Tensor]
    with gc_paused():  # lists of every tensor: a large object graph (tiercache.gcpause)
        targets = into_targets(into)
        plan = plan_into(version, targets, strict=strict)
        if targets and plan.all_direct:
            # Every saved tensor goes straight into a tensor of ``into`` (the usual resume).
            dests = plan.slots  # type: ignore[assignment]  # all_direct: no slot is None
        else:
            dtypes = {name: dtype_from_name(name) for name in set(table.dtypes)}
            dests = []
            # Over the table's columns: at 100k tensors, every object made per tensor shows.
            for slot, direct, dname, shape, nbytes in zip(plan.slots, plan.direct, table.dtypes, table.shapes,
                                                          table.nbytes.tolist(), strict=True):
                if slot is None:
                    dests.append(empty_aligned(shape, dtypes[dname], nbytes))
                elif direct:
                    dests.append(slot)
                else:
                    tmp = empty_aligned(shape, dtypes[dname], nbytes)
                    dests.append(tmp)
                    finals.append((slot, tmp))
    read(dests)
    for target, tmp in finals:
        with torch.no_grad():
            target.copy_(tmp)
    tensors = dests
    with gc_paused():
        if finals or torch.device(map_location).type != "cpu":
            moved = torch.device(map_location).type != "cpu"
            tensors = [slot if slot is not None else d.to(map_location) if moved else d
                       for slot, d in zip(plan.slots, dests, strict=True)]
        state = unflatten(version.tree, tensors, allow_pickle=allow_pickle and version.pickled)
    if into is not None and not strict:
        return state, [f"{key}: {why}" for key, why in plan.unmatched]
    return state


class Targets:
    """Where one chunk's bytes go: per piece it holds, a destination address, its offset in the chunk, its length.

    Held as int64 columns sorted by offset, so filling a chunk of 100k tiny tensors costs one
    ``memmove`` per piece and no Python object per piece (a memoryview per tensor and per piece
    cost 2.5-2.9 s of a 10.7 s restore of 100k tensors).

    Args:
        addr: Destination address per piece.
        offset: Where the piece starts in the chunk's raw bytes.
        length: Its length.
        keep: What owns the destination memory; held while the targets live.
    """

    __slots__ = ("addr", "keep", "length", "offset")

    def __init__(self, addr: np.ndarray, offset: np.ndarray, length: np.ndarray, keep: object) -> None:
        order = np.argsort(offset, kind="stable")
        self.addr, self.offset, self.length = addr[order], offset[order], length[order]
        self.keep = keep

    @classmethod
    def of(cls, pieces: Targets | Sequence[tuple[memoryview, int, int]]) -> Targets:
        """Targets from ``(dest view, offset in chunk, length)`` per piece (or as they are)."""
        if isinstance(pieces, Targets):
            return pieces
        views = [memoryview(v) for v, _, _ in pieces]
        for v, (_, _, n) in zip(views, pieces, strict=True):
            if v.readonly or v.nbytes < n:
                raise ValueError(f"a target of {n} bytes does not fit a {'read-only ' if v.readonly else ''}"
                                 f"buffer of {v.nbytes} bytes")
        addr = np.array([buffer_address(v) if v.nbytes else 0 for v in views], dtype=np.int64)
        return cls(addr, np.array([o for _, o, _ in pieces], dtype=np.int64),
                   np.array([n for _, _, n in pieces], dtype=np.int64), views)

    def __len__(self) -> int:
        return int(self.offset.size)

    def whole(self, nbytes: int) -> memoryview | None:
        """The destination as a writable view, if this chunk's bytes all go to one place (else ``None``)."""
        if len(self) != 1 or int(self.offset[0]) != 0 or int(self.length[0]) != nbytes or nbytes == 0:
            return None
        return memoryview((ctypes.c_ubyte * nbytes).from_address(int(self.addr[0]))).cast("B")


def chunk_targets(version: Version, dests: Sequence[torch.Tensor], *, checked: bool = False) -> list[Targets]:
    """Per chunk of ``version``, the pieces of ``dests`` (one contiguous CPU tensor per entry) it fills.

    ``checked``: the caller made or checked every destination (a contiguous CPU tensor of its
    entry's dtype and shape), so they are not asked for their sizes again (at 100k tensors that is
    tens of milliseconds).

    Raises:
        ValueError: If ``dests`` are not one CPU tensor of each entry's size (the copies go to raw
            addresses, so a wrong destination is refused here rather than written past).
    """
    table = version.tensors
    if len(dests) != len(table):
        raise ValueError(f"restore of {version.id}: {len(dests)} destinations for {len(table)} tensors")
    sizes = table.nbytes if checked else np.fromiter((t.nbytes if t.is_cpu else -1 for t in dests),
                                                     dtype=np.int64, count=len(dests))
    if sizes.shape != table.nbytes.shape or not np.array_equal(sizes, table.nbytes):
        raise ValueError(f"restore of {version.id}: the destinations are not one CPU tensor of each saved "
                         "tensor's size")
    owner = np.repeat(np.arange(len(table), dtype=np.int64), np.diff(table.starts))
    base = np.fromiter(map(torch.Tensor.data_ptr, dests), dtype=np.int64, count=len(dests))
    addr = base[owner] + table.offset
    order = np.argsort(table.chunk, kind="stable")
    bounds = np.searchsorted(table.chunk[order], np.arange(len(version.chunks) + 1))
    keep = list(dests)
    out = []
    for c in range(len(version.chunks)):
        sel = order[bounds[c] : bounds[c + 1]]
        out.append(Targets(addr[sel], table.chunk_offset[sel], table.piece_nbytes[sel], keep))
    return out


def scatter(targets: Targets, data: memoryview) -> None:
    """Copy a chunk's raw bytes ``data`` into its targets."""
    _Scatter(targets).window(data, 0)


@dataclass(frozen=True)
class RestoreReport:
    """What one restore read, from where (``TierCache.last_restore``).

    Attributes:
        version: The version restored.
        nbytes: Raw bytes of the chunks read, per source: ``ram``, ``disk`` (this node's own),
            ``s3``, and for a restore over a process group ``peer`` (received from another rank:
            from its node's copy, or read once from S3 for the whole group by that rank).
            Sources that gave nothing are left out.
        seconds: How long the reads took; for a restore over a process group (and a DCP load),
            from the call on, the group's exchanges (resolving the ref, finding the parts) included.
    """

    version: str
    nbytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


#: Copies ``n`` bytes between addresses with the GIL released (a training thread keeps running).
_memmove = ctypes.memmove


#: Pieces at least this long are copied with one ``memmove`` each (its cost per call is nothing
#: next to their bytes); shorter ones in bulk, where there are enough of them.
_BULK_BELOW = 64 << 10
#: Fewer short pieces than this are copied one by one: building the bulk copy's indices costs more.
_BULK_FROM = 32
#: The rows a bulk copy moves: the pieces' common alignment, within these bounds (pieces aligned
#: to less are copied one by one).
_BULK_ROW_MIN = 16
_BULK_ROW_MAX = 4096


class _Span:
    """``numpy`` access to ``rows`` rows of ``row`` bytes at address ``addr``, writable (no copy)."""

    def __init__(self, addr: int, rows: int, row: int) -> None:
        self.__array_interface__ = {"shape": (rows,), "typestr": f"|V{row}", "data": (addr, False), "version": 3}


def copy_pieces(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to address ``dst[i]``, for every ``i``.

    One ``memmove`` through ``ctypes`` costs 0.3-1.6 us on the 2-core VM of docs/benchmarks.md,
    more than copying a 1 KiB piece: 100k tiny tensors spent 0.16 s in the calls alone. Short
    pieces are instead copied as rows of their common alignment (64 bytes for tensors packed at
    64-byte offsets into 64-byte aligned memory) by one ``numpy`` fancy assignment per alignment:
    each side seen as one array of rows from its lowest address to its highest, of which only the
    pieces' rows are read or written. Every address must be valid for its length, as for ``memmove``.
    """
    count = int(nbytes.size)
    if not count:
        return
    bulk = np.zeros(count, dtype=bool)
    if count >= _BULK_FROM:
        bits = dst | src | nbytes
        bulk = (nbytes < _BULK_BELOW) & ((bits & -bits) >= _BULK_ROW_MIN)
        if int(np.count_nonzero(bulk)) >= _BULK_FROM:
            common = int(np.bitwise_or.reduce(bits[bulk]))
            _copy_rows(dst[bulk], src[bulk], nbytes[bulk], min(common & -common, _BULK_ROW_MAX))
        else:
            bulk[:] = False
    move = _memmove
    rest = ~bulk
    for d, s, n in zip(dst[rest].tolist(), src[rest].tolist(), nbytes[rest].tolist(), strict=True):
        move(d, s, n)


def _copy_rows(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, row: int) -> None:
    """Copy pieces whose addresses and lengths are all multiples of ``row``, as rows of ``row`` bytes."""
    rows = nbytes // row
    total = int(rows.sum())
    first = np.cumsum(rows) - rows  # each piece's first row in the list of all rows
    step = np.arange(total, dtype=np.int64)
    dlow, slow = int(dst.min()), int(src.min())
    d_idx = np.repeat((dst - dlow) // row - first, rows) + step
    s_idx = np.repeat((src - slow) // row - first, rows) + step
    d_span = np.asarray(_Span(dlow, (int((dst + nbytes).max()) - dlow) // row, row))
    s_span = np.asarray(_Span(slow, (int((src + nbytes).max()) - slow) // row, row))
    if s_span.shape[0] == total and bool((src[1:] == src[:-1] + nbytes[:-1]).all()):
        d_span[d_idx] = s_span  # one run of source bytes, in order (a pack's tensors): no gather
    else:
        d_span[d_idx] = s_span[s_idx]


class _Scatter:
    """Copies consecutive windows of a chunk's bytes into the targets that hold parts of them.

    Args:
        targets: Where the chunk's pieces go.
    """

    def __init__(self, targets: Targets | Sequence[tuple[memoryview, int, int]]) -> None:
        self._t = Targets.of(targets)
        self._first = 0  # every target before this one is complete

    def window(self, data: memoryview, pos: int) -> None:
        """Copy ``data``, the chunk's bytes from offset ``pos`` on, into the targets overlapping it."""
        t = self._t
        end = pos + data.nbytes
        stop = int(np.searchsorted(t.offset, end, side="left"))
        first = self._first
        if stop <= first or not data.nbytes:
            return
        off, length, addr = t.offset[first:stop], t.length[first:stop], t.addr[first:stop]
        lo = np.maximum(off, pos)
        hi = np.minimum(off + length, end)
        live = lo < hi
        src = buffer_address(data) - pos
        copy_pieces((addr + (lo - off))[live], (lo + src)[live], (hi - lo)[live])
        done = off + length <= end
        self._first = first + (int(np.argmin(done)) if not done.all() else done.size)


class Reader:
    """Reads versions' chunks from a set of tiers.

    Args:
        tiers: Callable returning the tiers to read from by name (the RAM tier appears once the
            arena exists).
        holds: ``holds(tier, chunk_id)`` says whether a tier is believed to hold a chunk.
        meter: Read throughput per tier is recorded here and used to order the tiers.
        threads: Chunks read in parallel.
    """

    def __init__(
        self,
        tiers: Callable[[], dict[str, Tier]],
        holds: Callable[[str, str], bool],
        meter: ThroughputMeter,
        threads: int,
    ) -> None:
        self._tiers = tiers
        self._holds = holds
        self._meter = meter
        self._threads = threads
        self._local = threading.local()
        # A chunk lent from RAM is copied out by its reading thread while a verifier thread hashes
        # it (the two stream the same bytes at once); each pair keeps two cores busy, so more
        # pairs than half the cores fight over cores and memory bandwidth. But at least two: one
        # copying thread alone does not saturate memory bandwidth (on 2 cores, restoring the bench's
        # 2 GB from RAM took 1.26x a memcpy with one pair, 1.11x with two; docs/benchmarks.md,
        # "The node agent").
        pairs = max(2, len(os.sched_getaffinity(0)) // 2)
        self._lent = threading.BoundedSemaphore(pairs)
        self._verifiers = ThreadPoolExecutor(pairs, thread_name_prefix="tiercache-verify")

    def close(self) -> None:
        """Stop the verifier threads (reads after this raise ``RuntimeError``)."""
        self._verifiers.shutdown(wait=True)

    def order(self, chunk_id: str) -> Iterator[str]:
        """Tiers believed to hold ``chunk_id``, best observed read speed first.

        Lazily: whether a tier holds the chunk is asked only once the tiers before it are
        exhausted, because the first question lists the tier's chunks. A fresh process restoring
        from node RAM or its disk must not list the bucket first (on S3 with a long history,
        one request per 1000 chunks).
        """
        names = list(self._tiers())
        rates = {n: self._meter.rate(n, "read") for n in names}
        if all(r is not None for r in rates.values()):
            names.sort(key=lambda n: -(rates[n] or 0.0))
        else:  # until every tier has been measured, the default RAM > disk > S3 order
            names.sort(key=lambda n: _DEFAULT_ORDER.get(n, 9))
        return (n for n in names if self._holds(n, chunk_id))

    def read_version(
        self, version: Version, dests: Sequence[torch.Tensor], progress: Progress | None = None, *,
        checked: bool = False,
    ) -> dict[str, int]:
        """Fill ``dests`` (contiguous CPU tensors, one per tensor entry) with the version's bytes.

        ``checked``: as for :func:`chunk_targets`.

        Returns:
            Raw chunk bytes read per tier.

        Raises:
            IntegrityError: If some chunk has no good copy on any tier.
        """
        targets = chunk_targets(version, dests, checked=checked)
        return self.read_chunks(version, [i for i, t in enumerate(targets) if t], targets, progress)

    def read_chunks(
        self, version: Version, indices: Sequence[int], targets: Sequence[Targets], progress: Progress | None = None
    ) -> dict[str, int]:
        """Read the chunks of ``version`` at ``indices`` into their ``targets`` (:func:`chunk_targets`), in parallel.

        Returns:
            Raw chunk bytes read per tier.

        Raises:
            IntegrityError: If some chunk has no good copy on any tier.
        """
        read: dict[str, int] = {}
        lock = threading.Lock()

        def one(i: int) -> None:
            c = version.chunks[i]
            tier = self.read_chunk(c.id, c.nbytes, version.hash_algo, targets[i])
            with lock:
                read[tier] = read.get(tier, 0) + c.nbytes
            if progress is not None:
                progress(c.nbytes)

        with contextlib.ExitStack() as ahead:
            keys = [chunk_key(version.chunks[i].id) for i in indices]
            for tier in self._tiers().values():
                if tier.lends:
                    ahead.enter_context(tier.lend_ahead(keys))
            if len(indices) <= 1:
                for i in indices:
                    one(i)
                return read
            with ThreadPoolExecutor(min(self._threads, len(indices)), thread_name_prefix="tiercache-read") as pool:
                for f in [pool.submit(one, i) for i in indices]:
                    f.result()
        return read

    def read_chunk(
        self, chunk_id: str, nbytes: int, algo: str, targets: Targets | Sequence[tuple[memoryview, int, int]]
    ) -> str:
        """Read one chunk into its targets (or ``(dest view, offset in chunk, length)`` per piece).

        Returns:
            The tier the good copy came from.

        Raises:
            IntegrityError: If no tier has a good copy.
        """
        targets = Targets.of(targets)
        tried = []
        for name in self.order(chunk_id):
            tier = self._tiers()[name]
            try:
                t0 = time.perf_counter()
                ok = self._read_from(tier, chunk_id, nbytes, algo, targets)
                if ok:
                    self._meter.record(name, "read", nbytes, time.perf_counter() - t0)
                    if tried:
                        log.warning("chunk %s restored from %s after %s", chunk_id, name, "; ".join(tried))
                    return name
                tried.append(f"{name}: missing")
            except IntegrityError as e:
                tried.append(f"{name}: damaged ({e})")
            except TierCacheError as e:
                tried.append(f"{name}: {type(e).__name__}: {e}")
            log.warning("chunk %s: copy on %s unusable (%s), trying the next tier", chunk_id, name, tried[-1])
        where = "; ".join(tried) or "no tier holds it"
        raise IntegrityError(f"chunk {chunk_id} has no good copy on any tier ({where}): run `tiercache verify`")

    def _read_from(
        self, tier: Tier, chunk_id: str, nbytes: int, algo: str, targets: Targets
    ) -> bool:
        key = chunk_key(chunk_id)
        lent = lender(tier)
        if lent is not None:
            # The RAM tier lends its memory: verify the payload in place and copy each piece once
            # (reading it like a file would copy it whole and then hash the copy from memory).
            with self._lent, lent.borrow(key) as obj:
                if obj is None:
                    return False
                return self._decode_scatter(obj, chunk_id, nbytes, algo, targets, tier.name)
        head = bytearray(codecs.HEADER_BYTES)
        got = tier.read_into(key, memoryview(head), 0)
        if got is None:
            return False
        header = codecs.read_header(memoryview(head)[:got])
        check_header(header, chunk_id, nbytes)
        if header.codec != codecs.RAW:
            data = tier.get(key)
            if data is None:
                return False
            return self._decode_scatter(memoryview(data), chunk_id, nbytes, algo, targets, tier.name)
        # A raw payload is hashed as it arrives, while each piece is still in the CPU cache.
        digest = codecs.hasher(algo)
        whole = targets.whole(nbytes)
        if whole is not None:
            # One tensor's bytes: straight into the tensor (O_DIRECT where its memory is aligned).
            done = tier.read_into(key, whole, codecs.HEADER_BYTES, observe=digest.update)
        else:
            done = self._stream_scatter(tier, key, nbytes, targets, digest)
        if done is None:
            return False
        if done != nbytes or digest.hexdigest() != chunk_id:
            raise IntegrityError(f"chunk {chunk_id} on {tier.name}: content does not match its id")
        return True

    def _stream_scatter(
        self, tier: Tier, key: str, nbytes: int, targets: Targets, digest: codecs.Hasher
    ) -> int | None:
        """Read a raw payload window by window, copying each window's part of every target out of it.

        A pack of small tensors never needs a buffer of its own size: the window is reused, so
        restoring costs no page faults beyond the destinations'.

        Returns:
            Payload bytes read (short if the object is truncated), or ``None`` if it vanished.
        """
        window = getattr(self._local, "window", None)
        if window is None:
            window = self._local.window = memoryview(aligned_buffer(_WINDOW_BYTES))
        scatter = _Scatter(targets)
        pos = 0
        while pos < nbytes:
            want = min(window.nbytes, nbytes - pos)
            got = tier.read_into(key, window[:want], codecs.HEADER_BYTES + pos, observe=digest.update)
            if got is None:
                return None
            scatter.window(window[:got], pos)
            pos += got
            if got < want:
                break
        return pos

    def _decode_scatter(
        self, obj: memoryview, chunk_id: str, nbytes: int, algo: str, targets: Targets,
        where: str,
    ) -> bool:
        header = codecs.read_header(obj[: codecs.HEADER_BYTES])
        check_header(header, chunk_id, nbytes)
        if header.codec == codecs.RAW:
            payload = obj[codecs.HEADER_BYTES : codecs.HEADER_BYTES + nbytes]
            if len(payload) != nbytes:
                raise IntegrityError(f"chunk {chunk_id} on {where}: content does not match its id")
            if nbytes >= _HASH_BESIDE_FROM:
                # Hashed by a verifier thread while this one copies the payload out in whole pieces:
                # a copy that big bypasses the CPU cache (streaming stores), and the two read the
                # same bytes at the same time. Hashing window by window as the copy goes took 1.5x a
                # memcpy on 2 GB of 64 MiB chunks (this: 1.1x): copies of a few MiB read each
                # destination line before writing it.
                hashed = self._verifiers.submit(_content_id, payload, algo)
                try:
                    _Scatter(targets).window(payload, 0)
                finally:
                    got = hashed.result()
            else:
                got = _content_id(payload, algo)  # small enough to stay in the CPU cache for the copy
                _Scatter(targets).window(payload, 0)
            if got != chunk_id:
                raise IntegrityError(f"chunk {chunk_id} on {where}: content does not match its id")
            return True
        raw = memoryview(bytearray(nbytes))
        decode_verify(obj, chunk_id, nbytes, algo, raw)
        _Scatter(targets).window(raw, 0)
        return True
