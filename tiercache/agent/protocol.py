"""The agent's wire protocol: framed JSON messages over a Unix stream socket, descriptors passed alongside.

A frame is a 4-byte little-endian length and that many bytes of UTF-8 JSON (one object). File
descriptors travel as ``SCM_RIGHTS`` ancillary data with the frame that announces them
(``"fds": n``); the receiver takes them in order. Bytes of tensors never cross the socket: they
are in the shared arena, and messages carry offsets.

A request carries ``"op"`` and an ``"id"`` unique on its connection; its answer carries the same
``"id"`` and either the result fields or ``"error": {"type", "message"}``. An answer that takes a
while (``reserve`` waiting for room, ``flush``, ``stop``) is preceded by ``{"id", "wait": true}``
frames once a second, so a client can tell a busy agent from a lost one. Messages with ``"ev"``
instead of ``"id"`` are events the agent sends on its own.

Requests (client -> agent):

========== =====================================================================================
op         fields -> answer
========== =====================================================================================
hello      ``proto``, ``pid``, ``cache`` (key) -> ``agent`` (pid), ``arena`` (or null), ``settings``
map        -> ``arena`` {``size``, ``path``}, with the arena's descriptor (``fds``: 1)
structure  ``sid``, ``metas`` [[path, dtype, shape, nbytes]...], ``chunk_bytes`` -> {} (cached)
reserve    ``sid`` -> ``rid``, ``regions`` [[offset, nbytes]...] | ``skip``: reason
cancel     ``rid`` -> {} (a copy that failed: the regions go back)
publish    ``rid``, ``version`` (see :func:`staged_to_wire`), ``base``, ``why``, ``wait_s``, and for a
           rank's part of a group version ``part`` (the rank) and ``world`` (the group's size) -> {}
release    ``v`` (a published version's key) -> {}: the trainer will not copy it back out of the arena
           (it heard ``local``, or the version settled), so the agent may reuse its regions
bye        -> {}: the client closes its cache; what it still holds goes back when it leaves (one that
           leaves without it while its process runs on keeps its versions' regions until it exits)
answer     ``n``, ``result`` | ``error``: the trainer's answer to a ``call`` event -> {}
orphans    ``rank``, ``branch``, ``head_step`` (its parts at or before it are let go), ``head`` (the
           head's version id: its kept parts are settled, not lost) -> ``orphans``: parts
           whose trainer died before its group committed them; or ``release`` [version ids],
           ``why`` -> {} (a restarted group found them incomplete: see :mod:`tiercache.agent.keep`)
peer_port  ``host``, ``key`` (the job's, optional) -> ``endpoint`` [host, port] where the agent
           takes other agents' peer copies
peer_copy  ``vid``, ``rank``, ``tier``, ``slots``, ``token``, ``key``, ``endpoints`` {rank: [host,
           port]}, ``within`` (s) -> {} once the rank's moves of the version's peer copies are done
           (:mod:`tiercache.agent.peering`)
snapshot   -> ``versions`` (manifests in node RAM or in flight), ``moves``, ``refs``, ``pending``
pin        ``key`` -> ``pin``, ``offset``, ``length`` | ``missing``: true
pins       ``keys`` -> ``pins`` {key: what ``pin`` answers for it} (a restore pins ahead)
unpin      ``pin`` -> {}
list       ``prefix`` -> ``keys`` (of the agent's RAM tier)
get        ``key`` -> ``data`` (latin-1 text of a small object's bytes) | ``missing``: true
holds      ``versions``, ``chunks`` -> which of them node RAM holds whole
ram        ``versions`` -> ``states`` {id: state}, ``reasons`` {state: why}: node RAM holds each
           version, or why not (:mod:`tiercache.agent.holdings`)
flush      ``within``, ``mine`` -> {} once this client's (or every) version settled
promote    ``version`` -> ``nbytes``
evict      ``chunks`` -> ``nbytes``
gc         ``dry_run``, ``grace`` -> ``report``
restored   ``nbytes`` {source: bytes} -> {} (counted for the metrics)
stats      -> the agent's stats (tiers, meter, queues, clients, arena, errors)
stop       ``within`` -> {} once every version settled (or ``within`` s passed); the agent then exits
========== =====================================================================================

Events (agent -> every client of the cache): ``published`` {``v``, ``manifest``}, ``level``
{``v``, ``level``, ``ok``, ``error``, ``pending`` (tiers still to write), ``manifest`` (a tier
committed a manifest other than the published one: its parent was lost), and for a ``durable``
failure ``loss``, ``record`` (the branch move to undo) and ``head`` (the agent's view of the branch)},
``settled`` {``v``} (every level of it settled: nothing pending), ``ram`` {``chunks``, ``present``}
(node RAM dropped chunks). Events about a rank's part of a group version go to its trainer only,
marked ``part``, and so does ``call`` {``n``, ``v``, ``call``, ``tier``, ``ids``}: what the
agent's engine asks the group's committer (see :mod:`tiercache.agent.committer`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tiercache.errors import TierCacheError, error_parts, rebuild_error

if TYPE_CHECKING:  # imported where used: they import torch, which reading node RAM never needs
    from tiercache.format import TensorMeta
    from tiercache.pipeline.job import StagedVersion

#: Bumped on any incompatible change; an agent refuses a client of another version.
PROTOCOL_VERSION = 3
_HEADER = struct.Struct("<I")
#: Largest frame accepted (a manifest of a very large state is the biggest message).
MAX_FRAME = 256 << 20
_RECV_BYTES = 1 << 20
_MAX_FDS = 4


class ProtocolError(TierCacheError):
    """A peer sent something that is not a frame of this protocol."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid, uid and gid of the process at the other end of a Unix socket, as the kernel says (``SO_PEERCRED``).

    Raises:
        OSError: If the socket has no peer.
    """
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid


class Connection:
    """One end of an agent connection: framed sends from any thread, receives from one thread.

    Args:
        sock: A connected ``AF_UNIX`` stream socket (owned from now on).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._closed = False

    def send(self, msg: Mapping[str, Any], fds: Iterable[int] = ()) -> None:
        """Send one message (and descriptors with it).

        Raises:
            OSError: If the peer is gone.
        """
        fds = list(fds)
        data = json.dumps({**msg, "fds": len(fds)} if fds else msg, separators=(",", ":"),
                          allow_nan=False).encode()
        frame = _HEADER.pack(len(data)) + data
        with self._send_lock:
            if fds:
                sent = socket.send_fds(self.sock, [frame], fds)
                if sent < len(frame):
                    self.sock.sendall(frame[sent:])
            else:
                self.sock.sendall(frame)

    def recv(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next message and the descriptors it carries; ``None`` once the peer closed.

        Raises:
            ProtocolError: If the peer sent a malformed frame.
            OSError: If the connection broke.
        """
        while True:
            if len(self._buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(self._buf)
                if n > MAX_FRAME:
                    raise ProtocolError(f"frame of {n} bytes is larger than {MAX_FRAME}")
                if len(self._buf) >= _HEADER.size + n:
                    raw = bytes(self._buf[_HEADER.size : _HEADER.size + n])
                    del self._buf[: _HEADER.size + n]
                    try:
                        msg = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
                    except ValueError as e:
                        raise ProtocolError(f"malformed message: {e}") from None
                    if not isinstance(msg, dict):
                        raise ProtocolError("a message must be a JSON object")
                    want = int(msg.pop("fds", 0) or 0)
                    got = [self._fds.popleft() for _ in range(min(want, len(self._fds)))]
                    return msg, got
            data, fds, _flags, _addr = socket.recv_fds(self.sock, _RECV_BYTES, _MAX_FDS)
            self._fds.extend(fds)
            if not data:
                return None
            self._buf += data

    def messages(self) -> Iterator[tuple[dict[str, Any], list[int]]]:
        """Every message until the peer closes (see :meth:`recv`)."""
        while (got := self.recv()) is not None:
            yield got

    def close(self) -> None:
        """Close the socket (and any descriptor received but not taken); idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this protocol takes")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def error_to_wire(e: BaseException) -> dict[str, str]:
    """An error as it crosses the socket: its class name and message (see :func:`~tiercache.errors.error_parts`)."""
    name, message = error_parts(e)
    return {"type": name, "message": message}


def error_from_wire(d: Mapping[str, Any]) -> TierCacheError:
    """The error an ``"error"`` field stands for: the same :mod:`tiercache.errors` class where there is one."""
    return rebuild_error(str(d.get("type", "")), str(d.get("message", "")))


def metas_to_wire(metas: Iterable[TensorMeta]) -> list[list[Any]]:
    """The tensor table of a structure as plain lists."""
    return [[m.path, m.dtype, list(m.shape), m.nbytes] for m in metas]


def metas_from_wire(rows: Iterable[Any]) -> tuple[TensorMeta, ...]:
    """The tensor table :func:`metas_to_wire` sent.

    Raises:
        ProtocolError: If a row is malformed.
    """
    from tiercache.format import TensorMeta

    try:
        return tuple(TensorMeta(str(p), str(d), tuple(int(x) for x in s), int(n)) for p, d, s, n in rows)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"malformed tensor table: {e}") from None


def staged_to_wire(v: StagedVersion) -> dict[str, Any]:
    """A staged version's descriptor without its tensor table (sent once per structure)."""
    return {"v": v.version_id, "branch": v.branch, "step": v.step, "seq": v.seq, "parent": v.parent,
            "meta": v.meta, "created_at": v.created_at, "tree": v.tree, "pickled": v.pickled}


def staged_from_wire(d: Mapping[str, Any], metas: tuple[TensorMeta, ...]) -> StagedVersion:
    """The descriptor :func:`staged_to_wire` sent, with the tensor table of its structure.

    Raises:
        ProtocolError: If a field is missing or has the wrong type.
    """
    from tiercache.pipeline.job import StagedVersion

    try:
        return StagedVersion(
            version_id=str(d["v"]), branch=str(d["branch"]), step=int(d["step"]), seq=int(d["seq"]),
            parent=None if d["parent"] is None else str(d["parent"]), meta=dict(d["meta"]),
            created_at=float(d["created_at"]), tree=d["tree"], metas=metas, pickled=bool(d["pickled"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed version descriptor: {e}") from None
