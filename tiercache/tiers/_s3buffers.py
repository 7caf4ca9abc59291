"""Zero-copy buffer plumbing for the S3 tier: views, checksums, and a file object over a view.

botocore wants bytes or file objects; these helpers let a put send slices of the caller's buffer
(the RAM arena) and a get fill the ``bytes`` it returns, without extra copies.
"""

from __future__ import annotations

import base64
import ctypes
import sys
import zlib

from tiercache.tiers.base import Buffer


def byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``data`` (copied only if it is not C-contiguous)."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def writable_view(out: memoryview) -> memoryview:
    """A flat writable byte view of ``out``; ValueError if it is read-only or not contiguous."""
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise ValueError("read_into needs a writable, C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def crc32_b64(view: memoryview) -> str:
    """The base64 CRC32 S3 expects in ``x-amz-checksum-crc32``."""
    return base64.b64encode(zlib.crc32(view).to_bytes(4, "big")).decode("ascii")


if sys.implementation.name == "cpython":
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _BYTES_DATA_OFFSET = bytes.__basicsize__ - 1  # offsetof(PyBytesObject, ob_sval)

    def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
        """Return a new, uninitialised ``bytes`` of length ``n`` and a writable view of its storage.

        ``get`` streams the object straight into the ``bytes`` it returns, which saves zeroing a
        buffer and copying it again (two full passes over up to a chunk of memory). The object is
        private until it is filled: nothing else holds it and its hash has not been computed.
        """
        if n == 0:
            return b"", memoryview(bytearray())
        obj = _new_bytes(None, n)
        view = memoryview((ctypes.c_char * n).from_address(id(obj) + _BYTES_DATA_OFFSET)).cast("B")
        return obj, view

else:  # pragma: no cover - other interpreters fill a bytearray and copy it once

    def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
        buf = bytearray(n)
        return buf, memoryview(buf)  # type: ignore[return-value]


class ViewReader:
    """A seekable file object over a memoryview whose ``read`` returns zero-copy slices.

    botocore accepts only bytes or file objects as a body; wrapping the caller's buffer this way
    lets the checksum, the signature and the socket all read the same memory without a copy.
    """

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, size: int | None = -1) -> memoryview:
        start = self._pos
        end = len(self._view) if size is None or size < 0 else min(len(self._view), start + size)
        self._pos = end
        return self._view[start:end]

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True
