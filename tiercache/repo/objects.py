"""Stored chunk objects checked against their content id: the verification every read goes through.

A chunk object is ``[header | payload]`` (see :mod:`tiercache.codecs`); its id names the hash of
the *raw* bytes, so a copy is good only if its header names that id and length and its payload
decodes to bytes that hash to the id. Restores, verify, repair, promote and catch-up all read
through here (restores also have faster paths that hash while the bytes stream in; they check the
same header with :func:`check_header`).
"""

from __future__ import annotations

from tiercache import codecs
from tiercache.errors import IntegrityError
from tiercache.names import chunk_key
from tiercache.tiers.base import Tier


def check_header(header: codecs.ChunkHeader, chunk_id: str, nbytes: int) -> None:
    """Raise :class:`IntegrityError` unless ``header`` names ``chunk_id`` of ``nbytes`` raw bytes."""
    if header.chunk_id != chunk_id or header.raw_len != nbytes:
        raise IntegrityError(
            f"chunk {chunk_id}: header names {header.chunk_id} of {header.raw_len} bytes, expected {nbytes}"
        )


def decode_verify(data: memoryview, chunk_id: str, nbytes: int, algo: str, out: memoryview) -> None:
    """Decode the stored object ``data`` into ``out`` (``nbytes`` long) and check its content id.

    Raises:
        IntegrityError: If the object is truncated, names another chunk, or its bytes do not
            hash to ``chunk_id``.
    """
    header = codecs.read_header(data[: codecs.HEADER_BYTES])
    check_header(header, chunk_id, nbytes)
    payload = data[codecs.HEADER_BYTES : codecs.HEADER_BYTES + header.stored_len]
    if len(payload) != header.stored_len:
        raise IntegrityError(f"chunk {chunk_id}: object is truncated")
    codecs.decode(header.codec, payload, nbytes, out, itemsize=header.itemsize)
    if codecs.content_id(out, algo) != chunk_id:
        raise IntegrityError(f"chunk {chunk_id}: content does not match its id")


def read_verified(tier: Tier, chunk_id: str, nbytes: int, algo: str) -> bytes:
    """Read ``tier``'s copy of a chunk and verify it; return it as stored (header and payload).

    Raises:
        IntegrityError: If the copy is missing, damaged, or names another chunk.
        StorageError: If the tier fails to read.
    """
    data = tier.get(chunk_key(chunk_id))
    if data is None:
        raise IntegrityError(f"chunk {chunk_id}: no copy on {tier.name}")
    decode_verify(memoryview(data), chunk_id, nbytes, algo, memoryview(bytearray(nbytes)))
    return bytes(data)
