"""Chunk layout: which bytes of which tensor go into which chunk, and where it is staged.

Big tensors (at least ``pack_below`` bytes) are cut into chunks of ``chunk_bytes``; small ones are
packed together, each at a 64-byte aligned offset, into shared chunks of at most ``chunk_bytes``,
so thousands of biases and step counters become a few objects instead of thousands. A layout
depends only on the tensors' dtypes and sizes, so it is computed once per state structure and
reused for every save while the structure stays the same.

In the RAM arena every chunk is staged as ``[4096-byte header | payload | zero padding to 4096]``
in a region of its own, so the stored object is one page-aligned span that the disk tier can
write with O_DIRECT as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.codecs import HEADER_BYTES

PAGE = 4096
_PACK_ALIGN = 64


def round_up(n: int, to: int = PAGE) -> int:
    """Round ``n`` up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclass(frozen=True)
class PlannedPiece:
    """A run of one tensor's bytes inside a chunk (mirrors :class:`tiercache.manifest.Piece`)."""

    tensor: int
    chunk_offset: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk of the layout.

    Attributes:
        nbytes: Raw payload length.
        pieces: The tensor runs it holds.
        packed: Whether it packs several small tensors (packs are never byte-grouped).
        itemsize: Element size of its data when it holds a single floating-point tensor's
            bytes (for byte-grouped compression), else 1.
    """

    nbytes: int
    pieces: tuple[PlannedPiece, ...]
    packed: bool
    itemsize: int = 1

    @property
    def staged_bytes(self) -> int:
        """Arena bytes the chunk occupies when staged: header + payload, page aligned."""
        return HEADER_BYTES + round_up(self.nbytes)


@dataclass(frozen=True)
class Layout:
    """The chunk layout of one state structure.

    Attributes:
        chunks: Chunks in order.
        tensor_pieces: For each tensor, its ``(chunk index, piece)`` pairs in tensor order.
        staged_bytes: Arena bytes one version of this layout needs.
    """

    chunks: tuple[PlannedChunk, ...]
    tensor_pieces: tuple[tuple[tuple[int, PlannedPiece], ...], ...]
    staged_bytes: int


def plan_layout(
    sizes: list[int], float_itemsizes: list[int], *, chunk_bytes: int, pack_below: int
) -> Layout:
    """Compute the chunk layout for tensors of the given byte sizes.

    Args:
        sizes: Byte size of each tensor, in tree order.
        float_itemsizes: Element size of each tensor if it is floating point, else 1.
        chunk_bytes: Largest chunk payload.
        pack_below: Tensors smaller than this are packed together.

    Returns:
        The layout.
    """
    chunks: list[PlannedChunk] = []
    per_tensor: list[list[tuple[int, PlannedPiece]]] = [[] for _ in sizes]
    pack: list[PlannedPiece] = []
    pack_len = 0

    def close_pack() -> None:
        nonlocal pack, pack_len
        if pack:
            idx = len(chunks)
            chunks.append(PlannedChunk(pack_len, tuple(pack), packed=True))
            for p in pack:
                per_tensor[p.tensor].append((idx, p))
        pack, pack_len = [], 0

    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n < pack_below:
            start = round_up(pack_len, _PACK_ALIGN)
            if start + n > chunk_bytes:
                close_pack()
                start = 0
            pack.append(PlannedPiece(i, start, 0, n))
            pack_len = start + n
            continue
        for off in range(0, n, chunk_bytes):
            length = min(chunk_bytes, n - off)
            piece = PlannedPiece(i, 0, off, length)
            per_tensor[i].append((len(chunks), piece))
            chunks.append(PlannedChunk(length, (piece,), packed=False, itemsize=float_itemsizes[i]))
    close_pack()
    staged = sum(c.staged_bytes for c in chunks)
    return Layout(tuple(chunks), tuple(tuple(p) for p in per_tensor), staged)
