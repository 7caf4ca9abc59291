"""Peer copies between node agents: chunks go agent to agent over TCP, never through a trainer.

With ``[agent]``, the ranks still agree on the peer copies of a version in the group's phases
(:mod:`tiercache.group.peers`): each rank says where its node's agent listens for other agents
(request ``peer_port``), the coordinator plans the moves, and each rank hands its own moves to
its agent (request ``peer_copy``). The agent reads each chunk it sends from its node's fastest
verified tier (node RAM, mostly), sends it to the agent of each receiving rank, and lands each
chunk it receives on its node's disk (:class:`~tiercache.group.copies.PeerFiles`): the trainer
moves, hashes and writes nothing.

Wire: a connection carries frames, each a header (4-byte big-endian length, then JSON: ``t`` the
version's token, ``tag`` the move's, ``dst`` the receiving rank, ``ok`` whether the payload
follows, ``n`` its length, ``w`` how long the sender waits) and, if ``ok``, the ``n`` raw bytes.
An agent takes a frame only for a copy one of its ranks asked for (token, tag, rank) and checks
each chunk against its id; the token, drawn by the coordinator for each version, keeps frames of
other versions and jobs apart. Nothing is encrypted, as with gloo: the agent listens on the
address its node uses to reach the job's store (or ``[agent] peer_host``), on a free port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.errors import DeadlineExceededError, IntegrityError, TierUnavailableError

if TYPE_CHECKING:
    import torch.distributed as dist

    from tiercache.group.copies import PeerFiles
    from tiercache.group.transfer import Move, Slot

log = logging.getLogger("tiercache.agent.peering")

_LENGTH = struct.Struct(">I")
#: Closed sender connections remembered (for receivers that ask after their sender left).
_KEEP_GONE = 1024
#: The longest frame header accepted (a header is ~100 bytes: anything longer is not a peer).
_MAX_HEADER = 4096


def advertised_host(store: dist.Store | None) -> str:
    """The address other nodes reach this one at: the local end of the route to the job's store.

    The job's store (torchrun's rendezvous, ``MASTER_ADDR``) is reachable from every node, so
    the interface this host uses to reach it is one the other nodes reach too.
    """
    host = None
    while store is not None:
        host = getattr(store, "host", None)
        if host:
            break
        store = getattr(store, "underlying_store", None)
    host = host or os.environ.get("MASTER_ADDR") or socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # a UDP "connect" sends nothing: it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1" if host in ("localhost", "127.0.0.1") else socket.gethostname()


@dataclass
class _Expect:
    """A move one of this agent's ranks receives: landed by the connection that brings it."""

    move: Move
    files: PeerFiles
    future: Future[None] = field(default_factory=Future)


class _Sender:
    """One connection to another agent; frames from several threads go out whole, one at a time.

    It opens with a hello frame (``t``, ``src``): the receiver then knows whose frames it carries,
    and once it closes, that nothing more of them can come.
    """

    def __init__(self, endpoint: tuple[str, int], deadline: float, token: str, src: int) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self.hello = json.dumps({"t": token, "src": src}).encode()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def open(self, dst: int) -> None:
        """Connect and say hello (before the first chunk is read: a sender that dies reading it is seen)."""
        self._frame(dst, self.hello)

    def send(self, token: str, tag: int, dst: int, data: memoryview | None, wait: float) -> None:
        head = json.dumps({"t": token, "tag": tag, "dst": dst, "ok": data is not None,
                           "n": 0 if data is None else len(data), "w": wait}).encode()
        self._frame(dst, head, data)

    def _frame(self, dst: int, head: bytes, data: memoryview | None = None) -> None:
        with self._lock:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(f"the agent at {_name(self.endpoint)} took no more copies in time")
            try:
                if self._sock is None:
                    self._sock = socket.create_connection(self.endpoint, timeout=left)
                    if head is not self.hello:
                        self._sock.sendall(_LENGTH.pack(len(self.hello)) + self.hello)
                self._sock.settimeout(left)
                self._sock.sendall(_LENGTH.pack(len(head)) + head)
                if data is not None:
                    self._sock.sendall(data)
            except OSError as e:
                raise TierUnavailableError(f"rank {dst}'s node agent at {_name(self.endpoint)} did not take "
                                           f"the peer copy: {e}") from e

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None


class PeerPort:
    """An agent's end of the peer copies: listens for other agents, sends to them (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._listeners: dict[str, socket.socket] = {}
        self._expected: dict[tuple[str, int, int], _Expect] = {}
        #: Senders (token, rank) whose connection closed: a receiver that asks later fails at once.
        self._gone: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._closed = False
        #: Bytes of peer copies this agent sent and landed (``sent``, ``received``).
        self.bytes: Counter[str] = Counter()

    def endpoint(self, host: str) -> tuple[str, int]:
        """Where this agent takes peer copies on ``host`` (listening there from the first call on).

        Raises:
            TierUnavailableError: If it cannot listen on ``host``.
        """
        with self._cond:
            sock = self._listeners.get(host)
            if sock is None:
                try:
                    family = socket.AF_INET6 if ":" in host else socket.AF_INET
                    sock = socket.create_server((host, 0), family=family, backlog=64)
                except OSError as e:
                    raise TierUnavailableError(f"the node agent cannot listen for peer copies on {host}: {e} "
                                               "(set [agent] peer_host to an address of this node)") from e
                self._listeners[host] = sock
                threading.Thread(target=self._accept, args=(sock,), daemon=True,
                                 name="tiercache-peer-accept").start()
            return host, int(sock.getsockname()[1])

    def close(self) -> None:
        """Stop listening; copies in flight fail."""
        with self._cond:
            self._closed = True
            for sock in self._listeners.values():
                with contextlib.suppress(OSError):
                    sock.close()
            self._listeners.clear()
            self._cond.notify_all()

    def copy(self, *, token: str, rank: int, slots: Sequence[Slot], endpoints: Mapping[int, tuple[str, int]],
             files: PeerFiles, timeout: float, threads: int) -> None:
        """Carry out ``rank``'s moves of one version: send what it sends, land what it receives.

        Args:
            token: The version's token (every rank of the copy got the same from the coordinator).
            rank: The rank these moves are of.
            slots: Its moves (:func:`~tiercache.group.transfer.own`).
            endpoints: The agent endpoint of each rank it sends to or receives from.
            files: This node's side of the version's copies (read, land, finish).
            timeout: Seconds for the whole copy.
            threads: Chunks read and sent at once.

        Raises:
            IntegrityError: A chunk that did not match its id, or that its sender could not read.
            TierUnavailableError: A receiving rank's agent that could not be reached.
            DeadlineExceededError: A chunk that did not arrive within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        expects: dict[tuple[str, int, int], _Expect] = {}
        with self._cond:
            for s in slots:
                if rank in s.move.dsts:
                    expects[(token, s.tag, rank)] = _Expect(s.move, files)
            self._expected.update(expects)
            gone = {src for t, src in self._gone if t == token}
            self._cond.notify_all()
        for e in expects.values():
            if e.move.src in gone:  # its sender came and went before this rank asked
                e.future.set_exception(self._gone_error(e))
        try:
            sent = self._send(token, rank, [s for s in slots if s.move.src == rank], endpoints, files, deadline,
                              threads)
            for e in expects.values():
                try:
                    e.future.result(max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise DeadlineExceededError(
                        f"{e.move.chunk} of version {files.vid} did not come from rank {e.move.src}'s node agent "
                        f"within {timeout:g}s") from None
            if sent is not None:
                raise sent
        finally:
            with self._cond:
                for key in expects:
                    self._expected.pop(key, None)
        files.finish()

    def _send(self, token: str, rank: int, slots: Sequence[Slot], endpoints: Mapping[int, tuple[str, int]],
              files: PeerFiles, deadline: float, threads: int) -> BaseException | None:
        """Send ``slots``; the first error of reading a chunk (its receivers were told), if any."""
        senders: dict[tuple[str, int], _Sender] = {}
        failed: list[BaseException] = []
        try:
            for s in slots:
                for d in s.move.dsts:
                    ep = endpoints[d]
                    if ep not in senders:
                        senders[ep] = _Sender(ep, deadline, token, rank)
                        senders[ep].open(d)
        except BaseException:
            for sender in senders.values():
                sender.close()
            raise

        def one(s: Slot) -> None:
            m = s.move
            try:
                data = files.read(m)
            except Exception as e:
                failed.append(e)
                data = None
            view = None if data is None else memoryview(data.numpy()).cast("B")
            for d in m.dsts:
                senders[endpoints[d]].send(token, s.tag, d, view, max(0.0, deadline - time.monotonic()))
                if view is not None:
                    with self._cond:
                        self.bytes["sent"] += len(view)

        try:
            with ThreadPoolExecutor(max(1, threads), thread_name_prefix="tiercache-peer-send") as pool:
                for f in [pool.submit(one, s) for s in slots]:
                    f.result()  # a receiver that cannot be reached fails the copy here
        finally:
            for sender in senders.values():
                sender.close()
        return failed[0] if failed else None

    # ------------------------------------------------------------------ receiving

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="tiercache-peer-recv").start()

    def _serve(self, conn: socket.socket) -> None:
        """Land the frames of one connection, in order (a receiver that is not ready holds the sender).

        Once it closes, for whatever reason, a move of its sender that has not come fails at once:
        a sender sends all its moves to this agent over one connection.
        """
        sender: tuple[str, int] | None = None
        with conn:
            try:
                hello = _read_header(conn)
                if hello is None:
                    return
                sender = (str(hello["t"]), int(hello["src"]))
                while True:
                    head = _read_header(conn)
                    if head is None:
                        return
                    exp = self._wait_for((str(head["t"]), int(head["tag"]), int(head["dst"])),
                                         time.monotonic() + float(head["w"]))
                    n = int(head["n"]) if head["ok"] else 0
                    if exp is None or exp.future.done():
                        _drain(conn, n)  # a frame nobody here asked for (or asks for any more): dropped
                        continue
                    m = exp.move
                    if not head["ok"]:
                        exp.future.set_exception(IntegrityError(f"rank {m.src} could not read {m.chunk} to copy it"))
                        continue
                    if n != m.nbytes:  # never allocate what a stray header claims
                        _drain(conn, n)
                        exp.future.set_exception(IntegrityError(
                            f"rank {m.src} sent {n} bytes for {m.chunk}, not its {m.nbytes}"))
                        continue
                    data = bytearray(n)
                    _read_exactly(conn, memoryview(data))  # if the connection breaks here, the move fails below
                    try:
                        exp.files.land(m, memoryview(data))
                    except BaseException as e:
                        exp.future.set_exception(e)
                    else:
                        with self._cond:
                            self.bytes["received"] += n
                        exp.future.set_result(None)
            except (OSError, ValueError, KeyError) as e:  # a peer that went away or is no peer
                log.info("a peer connection ended: %s", e)
            finally:
                if sender is not None:
                    self._sender_gone(*sender)

    def _sender_gone(self, token: str, src: int) -> None:
        with self._cond:
            self._gone[(token, src)] = None
            while len(self._gone) > _KEEP_GONE:
                self._gone.popitem(last=False)
            left = [e for (t, _, _), e in self._expected.items() if t == token and e.move.src == src]
        for e in left:
            if not e.future.done():
                e.future.set_exception(self._gone_error(e))

    @staticmethod
    def _gone_error(e: _Expect) -> TierUnavailableError:
        return TierUnavailableError(
            f"rank {e.move.src}'s node agent stopped before it sent {e.move.chunk} of version {e.files.vid}")

    def _wait_for(self, key: tuple[str, int, int], deadline: float) -> _Expect | None:
        with self._cond:
            while (exp := self._expected.get(key)) is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return exp


def _read_header(conn: socket.socket) -> dict[str, Any] | None:
    raw = bytearray(_LENGTH.size)
    if not _read_exactly(conn, memoryview(raw), eof_ok=True):
        return None
    (n,) = _LENGTH.unpack(raw)
    if n > _MAX_HEADER:
        raise ValueError(f"a frame header of {n} bytes")
    body = bytearray(n)
    _read_exactly(conn, memoryview(body))
    head = json.loads(body)
    if not isinstance(head, dict):
        raise ValueError("a frame header that is not an object")
    return head


def _read_exactly(conn: socket.socket, out: memoryview, *, eof_ok: bool = False) -> bool:
    got = 0
    while got < len(out):
        n = conn.recv_into(out[got:])
        if n == 0:
            if eof_ok and got == 0:
                return False
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n
    return True


def _drain(conn: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes, a bounded window at a time."""
    window = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        _read_exactly(conn, window[: min(n, len(window))])
        n -= min(n, len(window))


def _name(endpoint: tuple[str, int]) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["PeerPort", "advertised_host"]
