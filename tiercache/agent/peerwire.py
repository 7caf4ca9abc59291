"""The peer port's wire: fixed-size frame headers, each sealed with the job's key.

Every frame starts with a header of :data:`HEADER_BYTES` bytes: a fixed binary layout (no JSON:
no field can be a string, a NaN, an infinity or a number too large for its slot), then a keyed
BLAKE2b MAC over it. A receiver reads exactly these bytes, checks the MAC against the key the id
in the header names (compared in constant time) and only then reads anything more: a stranger
without the job's key never gets a byte past the header read, nor an allocation.

The MAC covers the header, not the payload that follows it, on purpose: a payload is a chunk of
up to 64 MiB (BLAKE2b runs at ~1 GB/s: ~60 ms of CPU per chunk and per side), and the receiver
already verifies each chunk's bytes against its id (:meth:`PeerFiles.land`), the id of the move
the sealed header names (version token, tag, receiving rank). So a payload is bound to its
header by its content hash. Nothing is encrypted (as with gloo): someone on the path can read
the copies; with a non-cryptographic chunk hash (xxh3) they could also swap a payload for a
colliding one, which the job's network is trusted not to do.

Frames on one connection are numbered: a frame replayed or spliced into another connection, or
reordered, fails its MAC check.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Final

#: The bytes of a per-job key (64 hex digits in the requests that carry it).
KEY_BYTES: Final = 32
#: The bytes of a version's token (32 hex digits).
TOKEN_BYTES: Final = 16

#: Frame kinds.
HELLO: Final = 0  # opens a connection: who sends (token, src)
CHUNK: Final = 1  # a move's payload follows (n bytes)
UNREADABLE: Final = 2  # the sender could not read the move's chunk: nothing follows
_KINDS = (HELLO, CHUNK, UNREADABLE)

#: The byte a receiver answers an authenticated hello with (a sender then knows its key is known).
ACK: Final = b"\x06"

_MAGIC = b"TCP1"
# magic, kind, key id, token, src, dst, tag, n, wait (ms), seq
_HEAD = struct.Struct(">4sB16s16sIIQQIQ")
_MAC_BYTES = 32
#: Every frame header's size: the fixed layout and its MAC.
HEADER_BYTES: Final = _HEAD.size + _MAC_BYTES
#: The longest a sender may ask a receiver to wait for the move a frame belongs to.
MAX_WAIT_S: Final = 3600.0
#: The largest payload a header may announce (far above any chunk or part manifest).
MAX_PAYLOAD: Final = 1 << 36


class WireError(ValueError):
    """A frame header that is malformed, sealed with an unknown key, or whose MAC does not match."""


@dataclass(frozen=True)
class Frame:
    """One frame header's fields (what the MAC covers).

    Attributes:
        kind: :data:`HELLO`, :data:`CHUNK` or :data:`UNREADABLE`.
        token: The version's token.
        src: The sending rank.
        dst: The receiving rank (0 in a hello).
        tag: The move's tag (0 in a hello).
        n: The payload's length (0 unless :data:`CHUNK`).
        wait: Seconds the sender waits for the receiver to take it.
        seq: The frame's number on its connection (the hello is 0).
    """

    kind: int
    token: bytes
    src: int
    dst: int = 0
    tag: int = 0
    n: int = 0
    wait: float = 0.0
    seq: int = 0


class PeerKey:
    """A job's key: seals and opens frame headers.

    Args:
        key: :data:`KEY_BYTES` random bytes, or their hex form.

    Raises:
        ValueError: If ``key`` is not a key of that length.
    """

    def __init__(self, key: bytes | str) -> None:
        raw = bytes.fromhex(key) if isinstance(key, str) else bytes(key)
        if len(raw) != KEY_BYTES:
            raise ValueError(f"a peer key is {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits), not {len(raw)}")
        self._key = raw
        #: What a header names the key by (a hash: it reveals nothing of the key).
        self.id = hashlib.blake2b(raw, digest_size=16, person=b"tiercache-peerid").digest()

    def seal(self, f: Frame) -> bytes:
        """The header of ``f``, MAC included (:data:`HEADER_BYTES` bytes).

        Raises:
            ValueError: If a field does not fit its slot.
        """
        wait_ms = int(min(max(f.wait, 0.0), MAX_WAIT_S) * 1000)
        try:
            head = _HEAD.pack(_MAGIC, f.kind, self.id, f.token, f.src, f.dst, f.tag, f.n, wait_ms, f.seq)
        except struct.error as e:
            raise ValueError(f"a peer frame field does not fit: {e}") from None
        return head + self._mac(head)

    def _mac(self, head: bytes) -> bytes:
        return hashlib.blake2b(head, key=self._key, digest_size=_MAC_BYTES).digest()

    def open(self, raw: bytes, seq: int) -> Frame:
        """The frame of header ``raw``, the ``seq``-th of its connection.

        Raises:
            WireError: If its MAC does not match, or a field is out of range.
        """
        head, mac = raw[: _HEAD.size], raw[_HEAD.size:]
        if not hmac.compare_digest(self._mac(head), mac):
            raise WireError("a peer frame whose MAC does not match (not sealed with this job's key)")
        _, kind, _, token, src, dst, tag, n, wait_ms, got_seq = _HEAD.unpack(head)
        if got_seq != seq:
            raise WireError(f"peer frame {got_seq} where frame {seq} was due (replayed or reordered)")
        if kind not in _KINDS or (kind == HELLO) != (seq == 0):
            raise WireError(f"a peer frame of kind {kind} as frame {seq}")
        if n > MAX_PAYLOAD or (n and kind != CHUNK):
            raise WireError(f"a peer frame of kind {kind} announcing {n} bytes")
        return Frame(kind, token, src, dst, tag, n, min(wait_ms / 1000, MAX_WAIT_S), got_seq)


def key_id(raw: bytes) -> bytes:
    """The key id a header names (before anything is trusted).

    Raises:
        WireError: If ``raw`` is not a frame header of this wire.
    """
    if len(raw) != HEADER_BYTES or raw[:4] != _MAGIC:
        raise WireError("not a tiercache peer frame")
    return bytes(raw[5:21])


__all__ = ["ACK", "CHUNK", "HEADER_BYTES", "HELLO", "KEY_BYTES", "MAX_PAYLOAD", "MAX_WAIT_S", "TOKEN_BYTES",
           "UNREADABLE", "Frame", "PeerKey", "WireError", "key_id"]
