"""How a chunk is stored on any tier: the 4096-byte chunk header, payload codecs and content ids.

A stored chunk object is ``[header | payload]``. The header is exactly :data:`HEADER_BYTES` long
so that a raw chunk's payload starts page-aligned: the engine stages ``[header | payload]`` in the
page-aligned RAM arena and writes the span with O_DIRECT in one go, and a restore reads the payload
with O_DIRECT straight into tensor memory.

Header layout (little-endian; everything after the fields is zero up to the CRC)::

    0     8s   magic b"TIERCHNK"
    8     u16  format version (1)
    10    u16  itemsize (element size for byte grouping; 1 otherwise)
    12    u64  raw_len (bytes of the chunk's content)
    20    u64  stored_len (bytes of the payload as stored)
    28    32s  codec descriptor "name/version", NUL padded
    60    32s  hash algorithm, NUL padded
    92    128s chunk id (lowercase hex), NUL padded
    4092  u32  CRC32 of bytes [0, 4092)

Codecs (descriptor ``name/version``; the version changes whenever the payload format does):

* ``raw/1``: the bytes as they are.
* ``zstd/1``: one zstd frame with content size and content checksum, so a corrupt payload is
  caught by the codec itself and not only by the content id check.
* ``bgzstd/1``: byte-grouped zstd for floating-point data, as ZipNN does it: the bytes of each
  element are split into ``itemsize`` planes (byte 0 of every element, then byte 1, ...) so the
  highly regular exponent bytes sit together, then compressed as one zstd frame of the
  concatenated planes (plus any tail shorter than one element, unchanged). Compressing the planes
  as separate frames was measured on the all-MiniLM-L6-v2 weights (fp32, bf16, fp16; zstd
  levels 1 and 3): the ratios differ by less than 0.05% either way, so the simpler single frame
  was kept.

GIL: measured with a Python thread spinning while a 64 MiB buffer is processed, xxh3-128,
blake2b (hashlib releases the GIL above 2 KiB), zstd compression and zstd decompression all let
the spinning thread run at its full rate, so chunk work on engine threads leaves the training
thread its core. The numpy copies that split and merge byte planes release it too.

Nothing here copies a big input just to hand it to zstd, xxhash or hashlib: they all take
memoryviews.
"""

from __future__ import annotations

import hashlib
import re
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import xxhash
import zstandard

from tiercache.errors import ConfigError, IntegrityError

if TYPE_CHECKING:
    import numpy as np

HEADER_BYTES: int = 4096
"""Size of the chunk header; a raw payload therefore starts page-aligned."""

RAW = "raw/1"
"""Descriptor of the identity codec."""

ZSTD = "zstd/1"
"""Descriptor of plain zstd."""

BGZSTD = "bgzstd/1"
"""Descriptor of byte-grouped zstd for floating-point data."""

HASH_ALGOS: tuple[str, ...] = ("xxh3-128", "blake2b")
"""Content hashes that may name a chunk; both give 32 hex digits."""

ITEMSIZES: tuple[int, ...] = (1, 2, 4, 8)
"""Element sizes byte grouping understands (1 means no grouping)."""

_MAGIC = b"TIERCHNK"
_FORMAT_VERSION = 1
_FIELDS = struct.Struct("<8sHHQQ32s32s128s")
_CRC_OFFSET = HEADER_BYTES - 4
_CRC = struct.Struct("<I")
# No chunk is anywhere near this; a larger length can only come from a bug or a forged header.
_MAX_RAW_LEN = 1 << 40
_HEX_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class ChunkHeader:
    """What the header of a stored chunk object records.

    Attributes:
        chunk_id: Lowercase hex content id of the raw bytes (see :func:`content_id`).
        raw_len: Length of the chunk's content in bytes.
        stored_len: Length of the payload that follows the header, as stored.
        codec: Codec descriptor ``name/version`` of the payload, e.g. ``"zstd/1"``.
        itemsize: Element size used by byte grouping; 1 for codecs that do not group.
        hash_algo: Hash that produced ``chunk_id`` (one of :data:`HASH_ALGOS`).
    """

    chunk_id: str
    raw_len: int
    stored_len: int
    codec: str
    itemsize: int
    hash_algo: str


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """View any C-contiguous buffer as unsigned bytes, without copying."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _header_problem(header: ChunkHeader) -> str | None:
    """Say what makes a header unstorable or implausible, or return ``None`` if it is sound."""
    if header.codec not in _CODECS:
        return f"unknown codec {header.codec!r} (known: {', '.join(codec_names())})"
    if header.hash_algo not in HASH_ALGOS:
        return f"unknown hash algorithm {header.hash_algo!r} (known: {', '.join(HASH_ALGOS)})"
    if not _HEX_ID.fullmatch(header.chunk_id):
        return f"malformed chunk id {header.chunk_id!r}: expected 32 lowercase hex digits"
    if header.itemsize not in ITEMSIZES:
        return f"invalid itemsize {header.itemsize} (expected one of {ITEMSIZES})"
    if not 0 <= header.raw_len <= _MAX_RAW_LEN:
        return f"absurd raw length {header.raw_len}"
    low, high = _CODECS[header.codec].stored_len_range(header.raw_len)
    if not low <= header.stored_len <= high:
        return (
            f"absurd stored length {header.stored_len} for {header.raw_len} raw bytes "
            f"with codec {header.codec} (expected {low}..{high})"
        )
    return None


def write_header(buf: memoryview, header: ChunkHeader) -> None:
    """Write ``header`` into the first :data:`HEADER_BYTES` bytes of ``buf``, zero padded.

    Args:
        buf: A writable buffer of at least :data:`HEADER_BYTES` bytes (e.g. the start of the
            chunk's span in the RAM arena); bytes past the header are left untouched.
        header: The header to store.

    Raises:
        ConfigError: If a field cannot be stored (unknown codec or hash, malformed id,
            impossible lengths or itemsize) or ``buf`` is too small.
    """
    view = _byte_view(buf)
    if len(view) < HEADER_BYTES:
        raise ConfigError(f"a chunk header needs {HEADER_BYTES} bytes, the buffer has {len(view)}")
    problem = _header_problem(header)
    if problem is not None:
        raise ConfigError(f"cannot write chunk header: {problem}")
    _FIELDS.pack_into(
        view,
        0,
        _MAGIC,
        _FORMAT_VERSION,
        header.itemsize,
        header.raw_len,
        header.stored_len,
        header.codec.encode("ascii"),
        header.hash_algo.encode("ascii"),
        header.chunk_id.encode("ascii"),
    )
    view[_FIELDS.size : _CRC_OFFSET] = bytes(_CRC_OFFSET - _FIELDS.size)
    _CRC.pack_into(view, _CRC_OFFSET, zlib.crc32(view[:_CRC_OFFSET]))


def pack_header(header: ChunkHeader) -> bytes:
    """Return ``header`` as the :data:`HEADER_BYTES` bytes :func:`write_header` would write.

    Raises:
        ConfigError: As :func:`write_header`.
    """
    out = bytearray(HEADER_BYTES)
    write_header(memoryview(out), header)
    return bytes(out)


def seal_chunk(
    obj: bytearray | memoryview, chunk_id: str, hash_algo: str, *, codec: str = RAW, raw_len: int | None = None,
    itemsize: int = 1,
) -> None:
    """Write the header of the chunk object ``obj`` in place: the one way a chunk object gets its header.

    Args:
        obj: The whole object: :data:`HEADER_BYTES` of room for the header, then the payload as
            stored (so its stored length is ``len(obj) - HEADER_BYTES``). The payload may be
            written before or after.
        chunk_id: The content id of the raw bytes.
        hash_algo: The hash that made ``chunk_id``.
        codec: The payload's codec (raw by default).
        raw_len: The raw content's length (default: the stored length, as for a raw payload).
        itemsize: The element size byte grouping used (1: none).

    Raises:
        ConfigError: As :func:`write_header`.
    """
    view = _byte_view(obj)
    stored = len(view) - HEADER_BYTES
    header = ChunkHeader(chunk_id, stored if raw_len is None else raw_len, stored, codec, itemsize, hash_algo)
    write_header(view[:HEADER_BYTES], header)


def chunk_object(
    payload: bytes | bytearray | memoryview, chunk_id: str, hash_algo: str, *, codec: str = RAW,
    raw_len: int | None = None, itemsize: int = 1,
) -> bytearray:
    """A new chunk object: its header (see :func:`seal_chunk`, same arguments), then a copy of ``payload``."""
    data = _byte_view(payload)
    out = bytearray(HEADER_BYTES + len(data))
    out[HEADER_BYTES:] = data
    seal_chunk(out, chunk_id, hash_algo, codec=codec, raw_len=raw_len, itemsize=itemsize)
    return out


def _text_field(raw: bytes, what: str) -> str:
    """Decode a NUL-padded ASCII header field."""
    text = raw.rstrip(b"\0")
    if b"\0" in text:
        raise IntegrityError(f"chunk header field {what} holds a NUL byte")
    try:
        return text.decode("ascii")
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"chunk header field {what} is not ASCII") from exc


def read_header(buf: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and check the header at the start of a stored chunk object.

    Args:
        buf: At least the first :data:`HEADER_BYTES` bytes of the object.

    Returns:
        The header.

    Raises:
        IntegrityError: Naming what is wrong: too short, bad magic, bad header CRC, unsupported
            format version, unknown codec or hash, malformed id, invalid itemsize, absurd lengths.
    """
    view = _byte_view(buf)
    if len(view) < HEADER_BYTES:
        raise IntegrityError(
            f"chunk object has {len(view)} bytes, shorter than its {HEADER_BYTES}-byte header"
        )
    magic, version, itemsize, raw_len, stored_len, codec, algo, chunk_id = _FIELDS.unpack_from(view, 0)
    if magic != _MAGIC:
        raise IntegrityError(f"bad magic {magic!r} in chunk header (expected {_MAGIC!r})")
    (stored_crc,) = _CRC.unpack_from(view, _CRC_OFFSET)
    actual_crc = zlib.crc32(view[:_CRC_OFFSET])
    if stored_crc != actual_crc:
        raise IntegrityError(f"bad chunk header CRC: stored {stored_crc:#010x}, computed {actual_crc:#010x}")
    if version != _FORMAT_VERSION:
        raise IntegrityError(
            f"unsupported chunk format version {version} (this build reads {_FORMAT_VERSION})"
        )
    header = ChunkHeader(
        chunk_id=_text_field(chunk_id, "chunk_id"),
        raw_len=raw_len,
        stored_len=stored_len,
        codec=_text_field(codec, "codec"),
        itemsize=itemsize,
        hash_algo=_text_field(algo, "hash_algo"),
    )
    problem = _header_problem(header)
    if problem is not None:
        raise IntegrityError(f"chunk header: {problem}")
    return header


class _Codec(ABC):
    """One payload encoding, registered under its descriptor."""

    descriptor: str

    @abstractmethod
    def encode(self, data: memoryview, itemsize: int, level: int, threads: int) -> bytes:
        """Encode ``data`` (a byte view)."""

    @abstractmethod
    def decode(self, payload: memoryview, raw_len: int, out: memoryview, itemsize: int) -> None:
        """Decode ``payload`` into ``out`` (a byte view of exactly ``raw_len`` bytes)."""

    @abstractmethod
    def stored_len_range(self, raw_len: int) -> tuple[int, int]:
        """Smallest and largest payload this codec can produce for ``raw_len`` raw bytes."""


class _Raw(_Codec):
    descriptor = RAW

    def encode(self, data: memoryview, itemsize: int, level: int, threads: int) -> bytes:
        return bytes(data)

    def decode(self, payload: memoryview, raw_len: int, out: memoryview, itemsize: int) -> None:
        if len(payload) != raw_len:
            raise IntegrityError(f"raw payload has {len(payload)} bytes, expected {raw_len}")
        out[:] = payload

    def stored_len_range(self, raw_len: int) -> tuple[int, int]:
        return raw_len, raw_len


class _ZstdContexts(threading.local):
    """Per-thread zstd contexts: they are not thread-safe, and building one per call is wasteful."""

    def __init__(self) -> None:
        self.compressors: dict[tuple[int, int], zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()


_contexts = _ZstdContexts()
# ZSTD_minCLevel(), which python-zstandard does not export; negative levels are the fast modes.
_ZSTD_MIN_LEVEL = -(1 << 17)


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    """The calling thread's compressor for ``level`` and ``threads``."""
    key = (level, threads)
    comp = _contexts.compressors.get(key)
    if comp is None:
        if not _ZSTD_MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ConfigError(
                f"zstd level {level} is out of range ({_ZSTD_MIN_LEVEL}..{zstandard.MAX_COMPRESSION_LEVEL})"
            )
        if threads < 0:
            raise ConfigError(f"zstd threads must be 0 (single-threaded) or more, got {threads}")
        comp = zstandard.ZstdCompressor(
            level=level, threads=threads, write_checksum=True, write_content_size=True
        )
        _contexts.compressors[key] = comp
    return comp


# Magic, frame header, one empty block and the checksum: no frame we write is shorter.
_ZSTD_MIN_FRAME = 13


def _zstd_encode(data: memoryview, level: int, threads: int) -> bytes:
    """Compress ``data`` into one zstd frame with content size and checksum."""
    return _compressor(level, threads).compress(data)


def _zstd_decode(payload: memoryview, out: memoryview) -> None:
    """Decompress one zstd frame straight into ``out``, which must be exactly its content size."""
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"corrupt zstd payload: {exc}") from exc
    if size != len(out):
        raise IntegrityError(f"zstd payload declares {size} content bytes, expected {len(out)}")
    filled = 0
    try:
        with _contexts.decompressor.stream_reader(payload, read_across_frames=False) as reader:
            while filled < len(out):
                got = reader.readinto(out[filled:])
                if got == 0:
                    break
                filled += got
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"corrupt zstd payload: {exc}") from exc
    if filled != len(out):
        raise IntegrityError(f"zstd payload is truncated: decoded {filled} of {len(out)} bytes")
    # The stream reader stops quietly when the input ends before the frame's checksum, and ignores
    # bytes after the frame, so the checksum (low 32 bits of XXH64 of the content, the last four
    # bytes of every frame we write) is compared here; XXH64 costs far less than decoding.
    stored = int.from_bytes(payload[-4:], "little")
    if len(payload) < _ZSTD_MIN_FRAME or stored != xxhash.xxh64_intdigest(out) & 0xFFFFFFFF:
        raise IntegrityError("corrupt zstd payload: frame checksum does not match the decoded bytes")


def _zstd_bound(raw_len: int) -> int:
    """Worst-case frame size for ``raw_len`` bytes (ZSTD_compressBound plus frame overhead)."""
    return raw_len + (raw_len >> 7) + 1024


class _Zstd(_Codec):
    descriptor = ZSTD

    def encode(self, data: memoryview, itemsize: int, level: int, threads: int) -> bytes:
        return _zstd_encode(data, level, threads)

    def decode(self, payload: memoryview, raw_len: int, out: memoryview, itemsize: int) -> None:
        _zstd_decode(payload, out)

    def stored_len_range(self, raw_len: int) -> tuple[int, int]:
        return _ZSTD_MIN_FRAME, _zstd_bound(raw_len)


def _split_planes(data: memoryview, itemsize: int) -> np.ndarray:
    """Return ``data`` regrouped as ``itemsize`` byte planes followed by the unaligned tail."""
    import numpy as np  # only byte-grouped chunks need it: reading manifests never does

    src = np.frombuffer(data, dtype=np.uint8)
    whole = len(src) - len(src) % itemsize
    grouped = np.empty(len(src), dtype=np.uint8)
    # A transposed copy is the fastest split numpy offers (about 2 GB/s on one core).
    grouped[:whole].reshape(itemsize, -1)[...] = src[:whole].reshape(-1, itemsize).T
    grouped[whole:] = src[whole:]
    return grouped


def _merge_planes(grouped: np.ndarray, out: memoryview, itemsize: int) -> None:
    """Inverse of :func:`_split_planes`, writing the interleaved bytes into ``out``."""
    import numpy as np

    dst = np.frombuffer(out, dtype=np.uint8)
    whole = len(dst) - len(dst) % itemsize
    planes = grouped[:whole].reshape(itemsize, -1)
    elements = dst[:whole].reshape(-1, itemsize)
    # One strided column store per plane beats a single transposed copy several times over.
    for plane in range(itemsize):
        elements[:, plane] = planes[plane]
    dst[whole:] = grouped[whole:]


class _ByteGroupedZstd(_Codec):
    descriptor = BGZSTD

    def encode(self, data: memoryview, itemsize: int, level: int, threads: int) -> bytes:
        if itemsize == 1:
            return _zstd_encode(data, level, threads)
        return _zstd_encode(memoryview(_split_planes(data, itemsize)), level, threads)

    def decode(self, payload: memoryview, raw_len: int, out: memoryview, itemsize: int) -> None:
        if itemsize == 1:
            _zstd_decode(payload, out)
            return
        import numpy as np

        grouped = np.empty(raw_len, dtype=np.uint8)
        _zstd_decode(payload, memoryview(grouped))
        _merge_planes(grouped, out, itemsize)

    def stored_len_range(self, raw_len: int) -> tuple[int, int]:
        return _ZSTD_MIN_FRAME, _zstd_bound(raw_len)


_CODECS: dict[str, _Codec] = {codec.descriptor: codec for codec in (_Raw(), _Zstd(), _ByteGroupedZstd())}


def codec_names() -> list[str]:
    """Return the registered codec descriptors, sorted."""
    return sorted(_CODECS)


def _check_itemsize(itemsize: int, error: type[Exception]) -> None:
    if itemsize not in ITEMSIZES:
        raise error(f"invalid itemsize {itemsize} (expected one of {ITEMSIZES})")


def encode(codec: str, data: memoryview, *, itemsize: int = 1, level: int = 3, threads: int = 0) -> bytes:
    """Encode a chunk's raw bytes with ``codec``.

    Args:
        codec: Codec descriptor (see :func:`codec_names`).
        data: The raw bytes (any C-contiguous buffer; not copied on the way into zstd).
        itemsize: Element size for byte grouping (bf16/fp16: 2, fp32: 4, fp64: 8); 1 otherwise.
        level: zstd compression level (negative levels are the fast modes).
        threads: zstd worker threads; 0 (the default) compresses on the calling thread, which is
            right when chunks are already encoded in parallel.

    Returns:
        The payload to store after the header.

    Raises:
        ConfigError: If the codec is unknown or ``itemsize``, ``level`` or ``threads`` is invalid.
    """
    impl = _CODECS.get(codec)
    if impl is None:
        raise ConfigError(f"unknown codec {codec!r} (known: {', '.join(codec_names())})")
    _check_itemsize(itemsize, ConfigError)
    return impl.encode(_byte_view(data), itemsize, level, threads)


def decode(codec: str, payload: memoryview, raw_len: int, out: memoryview, *, itemsize: int = 1) -> None:
    """Decode a stored payload straight into ``out``.

    Args:
        codec: Codec descriptor recorded in the chunk header.
        payload: The stored payload (the bytes after the header).
        raw_len: The chunk's raw length recorded in the header.
        out: A writable C-contiguous buffer of exactly ``raw_len`` bytes (e.g. tensor memory).
        itemsize: The itemsize recorded in the chunk header.

    Raises:
        IntegrityError: If the codec or itemsize is unknown, ``out`` has the wrong size, or the
            payload is corrupt or decodes to a length other than ``raw_len``.
    """
    impl = _CODECS.get(codec)
    if impl is None:
        raise IntegrityError(f"unknown codec {codec!r} (known: {', '.join(codec_names())})")
    _check_itemsize(itemsize, IntegrityError)
    dst = _byte_view(out)
    if len(dst) != raw_len:
        raise IntegrityError(f"output buffer has {len(dst)} bytes, the chunk has {raw_len}")
    impl.decode(_byte_view(payload), raw_len, dst, itemsize)


class Hasher(Protocol):
    """A streaming content-id hash: feed it bytes in order, then read the id."""

    def update(self, data: memoryview, /) -> None:
        """Add the next bytes."""

    def hexdigest(self) -> str:
        """Return the id of everything added so far, as lowercase hex."""


def hasher(algo: str = "xxh3-128") -> Hasher:
    """Return a streaming hash for ``algo``; fed a chunk's bytes in order, it ends at its :func:`content_id`.

    Lets a reader hash each piece while it is still in the CPU cache instead of reading the whole
    chunk back from memory afterwards.

    Raises:
        ConfigError: If ``algo`` is unknown.
    """
    if algo == "xxh3-128":
        return xxhash.xxh3_128()
    if algo == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise ConfigError(f"unknown hash algorithm {algo!r} (known: {', '.join(HASH_ALGOS)})")


def content_id(data: memoryview, algo: str = "xxh3-128") -> str:
    """Return the hex content id of a chunk's raw bytes.

    Args:
        data: The raw (unencoded) bytes; any C-contiguous buffer, not copied.
        algo: ``"xxh3-128"`` (xxhash XXH3 128-bit) or ``"blake2b"`` (16-byte digest).

    Returns:
        32 lowercase hex digits.

    Raises:
        ConfigError: If ``algo`` is unknown.
    """
    h = hasher(algo)
    h.update(_byte_view(data))
    return h.hexdigest()


__all__ = [
    "BGZSTD",
    "HASH_ALGOS",
    "HEADER_BYTES",
    "ITEMSIZES",
    "RAW",
    "ZSTD",
    "ChunkHeader",
    "Hasher",
    "chunk_object",
    "codec_names",
    "content_id",
    "decode",
    "encode",
    "hasher",
    "pack_header",
    "read_header",
    "seal_chunk",
    "write_header",
]
