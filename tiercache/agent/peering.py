"""Peer copies between node agents: chunks go agent to agent over TCP, never through a trainer.

With ``[agent]``, the ranks still agree on the peer copies of a version in the group's phases
(:mod:`tiercache.group.peers`): each rank says where its node's agent listens for other agents
(request ``peer_port``), the coordinator plans the moves, and each rank hands its own moves to
its agent (request ``peer_copy``). The agent reads each chunk it sends from its node's fastest
verified tier (node RAM, mostly), sends it to the agent of each receiving rank, and lands each
chunk it receives on its node's disk (:class:`~tiercache.group.copies.PeerFiles`): the trainer
moves, hashes and writes nothing.

Wire (:mod:`tiercache.agent.peerwire`): a connection carries frames, each a fixed-size header
sealed with the job's key (a MAC) and, for a chunk, its raw bytes. The key is drawn once per job
by one rank and reaches the others through the job's store (:mod:`tiercache.group.peers`); an
agent knows the keys its ranks handed it (with ``peer_port``, before any plan names the agent,
and with ``peer_copy``). The first frame says who sends (the version's token, the sending rank);
the receiver answers it with one byte, or closes the connection if it does not know the key (the
sender tries again until its deadline: an agent restarted since may learn it a moment later).
An agent takes a frame only for a copy one of its ranks asked for (token, tag, rank) and checks
each chunk against its id.

The receiving side is one asyncio event loop on one thread: a connection costs a coroutine, not
a thread. A stranger is held to the header read: at most :data:`MAX_CONNECTIONS` connections
(fewer with a low fd limit; the oldest unauthenticated one makes room for a new one), each
closed if its first header is not there within :data:`HELLO_S`; payloads are read straight into
their buffer (no per-byte work), within a byte budget. The accept loop logs and goes on, whatever
``accept`` raises (out of fds: it backs off a moment). Nothing is encrypted, as with gloo: the
agent listens on the address its node uses to reach the job's store (or ``[agent] peer_host``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import os
import resource
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.agent.peerwire import (
    ACK,
    CHUNK,
    HEADER_BYTES,
    HELLO,
    KEY_BYTES,
    MAX_PAYLOAD,
    TOKEN_BYTES,
    UNREADABLE,
    Frame,
    PeerKey,
    WireError,
    key_id,
)
from tiercache.errors import DeadlineExceededError, IntegrityError, TierUnavailableError

if TYPE_CHECKING:
    import torch.distributed as dist

    from tiercache.group.copies import PeerFiles
    from tiercache.group.transfer import Move, Slot

log = logging.getLogger("tiercache.agent.peering")

#: Closed sender connections remembered (for receivers that ask after their sender left).
_KEEP_GONE = 1024
#: Job keys an agent remembers (the jobs its ranks copied for lately).
_KEEP_KEYS = 64
#: Connections the peer port holds at most (also at most a quarter of the fd soft limit).
MAX_CONNECTIONS = 256
#: Seconds a new connection has to bring its whole first header.
HELLO_S = 10.0
#: Seconds an authenticated connection may stay silent between frames.
IDLE_S = 300.0
#: Seconds a payload read may make no progress.
STALL_S = 60.0
#: Bytes of payload buffers held at once (one frame larger than this is read alone).
RECV_BUDGET = 1 << 30
#: Threads that verify and write landed chunks.
_LANDERS = 8
#: Seconds the accept loop waits when the process is out of fds (or memory) before it tries again.
_BACKOFF_S = 0.2
#: Seconds between two warnings of the same kind (a flood logs a count, not a line per connection).
_WARN_EVERY_S = 10.0


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


def copy_request(msg: Mapping[str, Any]) -> dict[str, Any]:
    """:meth:`PeerPort.copy`'s arguments (but ``files`` and ``threads``) from a ``peer_copy`` request.

    Every field is checked (types, finite numbers, ranges) before anything is done with it.

    Raises:
        ValueError: Naming the first field that is not what it should be.
    """
    from tiercache.group.transfer import Move, Slot  # not at the top: tiercache.group imports this module

    within = msg.get("within")
    if isinstance(within, bool) or not isinstance(within, int | float) or not math.isfinite(within) \
            or not 0 < within <= 1e9:
        raise ValueError(f"peer_copy: within must be seconds in (0, 1e9], not {within!r}")
    endpoints = msg.get("endpoints")
    if not isinstance(endpoints, dict):
        raise ValueError("peer_copy: endpoints must be an object of rank -> [host, port]")
    eps: dict[int, tuple[str, int]] = {}
    for r, ep in endpoints.items():
        if not (isinstance(ep, list | tuple) and len(ep) == 2 and isinstance(ep[0], str) and len(ep[0]) <= 255):
            raise ValueError(f"peer_copy: the endpoint of rank {r!r} must be [host, port], not {ep!r}")
        eps[_int(int(r) if isinstance(r, str) and r.isdigit() else r, "an endpoint's rank")] = (
            ep[0], _int(ep[1], "a port", 1, 65535))
    slots = msg.get("slots")
    if not isinstance(slots, list):
        raise ValueError("peer_copy: slots must be a list")
    parsed = []
    for s in slots:
        if not (isinstance(s, list | tuple) and len(s) == 6 and isinstance(s[2], str) and len(s[2]) <= 256
                and isinstance(s[5], list | tuple)):
            raise ValueError(f"peer_copy: a slot must be [tag, batch, chunk, nbytes, src, dsts], not {s!r:.200}")
        tag, batch, chunk, nbytes, src, dsts = s
        parsed.append(Slot(_int(tag, "a slot's tag", hi=(1 << 63) - 1), _int(batch, "a slot's batch"),
                           Move(chunk, _int(nbytes, "a slot's nbytes", hi=MAX_PAYLOAD), _int(src, "a slot's src"),
                                tuple(_int(d, "a slot's dst") for d in dsts))))
    return {"token": _hex(msg.get("token"), "token", TOKEN_BYTES),
            "key": PeerKey(_hex(msg.get("key"), "key", KEY_BYTES)), "rank": _int(msg.get("rank"), "rank"),
            "slots": parsed, "endpoints": eps, "timeout": float(within)}


def port_request(msg: Mapping[str, Any]) -> dict[str, Any]:
    """:meth:`PeerPort.endpoint`'s arguments from a ``peer_port`` request (``key`` is optional).

    Raises:
        ValueError: Naming the field that is not what it should be.
    """
    host, key = msg.get("host"), msg.get("key")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise ValueError(f"peer_port: host must be an address of this node, not {host!r:.100}")
    return {"host": host, "key": None if key is None else PeerKey(_hex(key, "key", KEY_BYTES, "peer_port"))}


def _int(v: Any, name: str, lo: int = 0, hi: int = (1 << 31) - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"peer_copy: {name} must be an integer in [{lo}, {hi}], not {v!r:.100}")
    return v


def _hex(v: Any, name: str, nbytes: int, request: str = "peer_copy") -> bytes:
    try:
        if isinstance(v, str) and len(v) == 2 * nbytes:
            return bytes.fromhex(v)
    except ValueError:
        pass
    raise ValueError(f"{request}: {name} must be {2 * nbytes} hex digits")


@dataclass
class _Expect:
    """A move one of this agent's ranks receives: landed by the connection that brings it."""

    move: Move
    files: PeerFiles
    future: Future[None] = field(default_factory=Future)


class _Sender:
    """One connection to another agent; frames from several threads go out whole, one at a time.

    It opens with a hello frame (``token``, ``src``): the receiver then knows whose frames it
    carries, and once it closes, that nothing more of them can come.
    """

    def __init__(self, endpoint: tuple[str, int], deadline: float, key: PeerKey, token: bytes, src: int) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self.key = key
        self.token = token
        self.src = src
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._seq = 0

    def open(self, dst: int) -> None:
        """Connect and be known (before the first chunk is read: a sender that dies reading it is seen)."""
        with self._lock:
            self._connect(dst)

    def _connect(self, dst: int) -> None:
        pause = 0.05
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(f"rank {dst}'s node agent at {_name(self.endpoint)} did not take this "
                                            "job's peer copies in time (it was not handed this job's key)")
            sock = None
            try:
                sock = socket.create_connection(self.endpoint, timeout=left)
                sock.sendall(self.key.seal(Frame(HELLO, self.token, self.src)))
                with contextlib.suppress(ConnectionResetError):
                    if sock.recv(1) == ACK:
                        self._sock, self._seq, sock = sock, 1, None
                        return
                # Closed unanswered: that agent does not know the job's key yet (its rank may hand
                # over its moves, and the key with them, a moment after this rank did).
            except OSError as e:
                raise TierUnavailableError(f"rank {dst}'s node agent at {_name(self.endpoint)} did not take "
                                           f"the peer copy: {e}") from e
            finally:
                if sock is not None:
                    sock.close()
            time.sleep(min(pause, max(0.0, self.deadline - time.monotonic())))
            pause = min(2 * pause, 1.0)

    def send(self, tag: int, dst: int, data: memoryview | None, wait: float) -> None:
        """Send the frame of move ``tag`` to rank ``dst`` (``data`` ``None``: the chunk could not be read)."""
        with self._lock:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(f"the agent at {_name(self.endpoint)} took no more copies in time")
            if self._sock is None:
                self._connect(dst)
            assert self._sock is not None
            head = self.key.seal(Frame(UNREADABLE if data is None else CHUNK, self.token, self.src, dst, tag,
                                       0 if data is None else len(data), wait, self._seq))
            self._seq += 1
            try:
                self._sock.settimeout(left)
                self._sock.sendall(head)
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


@dataclass
class _Conn:
    """A connection the peer port holds: its task, and whether its peer proved it has a job's key."""

    task: asyncio.Task[None]
    known: bool = False


class PeerPort:
    """An agent's end of the peer copies: listens for other agents, sends to them (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._listeners: dict[str, socket.socket] = {}
        self._expected: dict[tuple[bytes, int, int], _Expect] = {}
        #: Senders (token, rank) whose connection closed: a receiver that asks later fails at once.
        self._gone: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        #: The job keys this agent's ranks handed it, by id.
        self._keys: OrderedDict[bytes, PeerKey] = OrderedDict()
        self._closed = False
        #: Bytes of peer copies this agent sent and landed (``sent``, ``received``).
        self.bytes: Counter[str] = Counter()
        #: What the receiving side turned away (``unknown``, ``refused``, ``evicted``, ``failed``).
        self.turned_away: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._landers: ThreadPoolExecutor | None = None
        # The loop's own state (touched on the loop's thread only).
        self._conns: OrderedDict[int, _Conn] = OrderedDict()
        self._ids = itertools.count()
        self._news: asyncio.Event | None = None
        self._room: asyncio.Condition | None = None
        self._held = 0
        self._warned: dict[str, tuple[float, int]] = {}

    # ------------------------------------------------------------------ the port

    def endpoint(self, host: str, key: PeerKey | None = None) -> tuple[str, int]:
        """Where this agent takes peer copies on ``host`` (listening there from the first call on).

        Args:
            host: An address of this node.
            key: The key of a job whose ranks copy through this agent (it takes their frames).

        Raises:
            TierUnavailableError: If it cannot listen on ``host``.
        """
        if key is not None:
            self.learn(key)
        with self._cond:
            if self._closed:
                raise TierUnavailableError("the node agent is stopping: it takes no peer copies")
            sock = self._listeners.get(host)
            if sock is None:
                try:
                    family = socket.AF_INET6 if ":" in host else socket.AF_INET
                    sock = socket.create_server((host, 0), family=family, backlog=128)
                except OSError as e:
                    raise TierUnavailableError(f"the node agent cannot listen for peer copies on {host}: {e} "
                                               "(set [agent] peer_host to an address of this node)") from e
                sock.setblocking(False)
                self._listeners[host] = sock
                asyncio.run_coroutine_threadsafe(self._accept(sock), self._running_loop())
            return host, int(sock.getsockname()[1])

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, daemon=True, name="tiercache-peer-port")
            self._thread.start()
            self._landers = ThreadPoolExecutor(_LANDERS, thread_name_prefix="tiercache-peer-land")

            async def setup() -> None:
                self._news, self._room = asyncio.Event(), asyncio.Condition()

            asyncio.run_coroutine_threadsafe(setup(), loop).result()
            self._loop = loop
        return self._loop

    def close(self) -> None:
        """Stop listening; copies in flight fail."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            loop, listeners = self._loop, list(self._listeners.values())
            self._listeners.clear()
        if loop is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._stop_all(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            assert self._thread is not None
            self._thread.join(10)
            if not self._thread.is_alive():
                loop.close()
        for sock in listeners:
            with contextlib.suppress(OSError):
                sock.close()
        if self._landers is not None:
            self._landers.shutdown(wait=False)

    def learn(self, key: PeerKey) -> None:
        """Take frames sealed with ``key`` from now on (a job's: the :data:`_KEEP_KEYS` latest are kept)."""
        with self._cond:
            self._keys[key.id] = key
            self._keys.move_to_end(key.id)
            while len(self._keys) > _KEEP_KEYS:
                self._keys.popitem(last=False)

    async def _stop_all(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ copying

    def copy(self, *, token: bytes, key: PeerKey, rank: int, slots: Sequence[Slot],
             endpoints: Mapping[int, tuple[str, int]], files: PeerFiles, timeout: float, threads: int) -> None:
        """Carry out ``rank``'s moves of one version: send what it sends, land what it receives.

        Args:
            token: The version's token (every rank of the copy got the same from the coordinator).
            key: The job's key (every rank got the same from the coordinator).
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
        expects: dict[tuple[bytes, int, int], _Expect] = {}
        self.learn(key)
        with self._cond:
            for s in slots:
                if rank in s.move.dsts:
                    expects[(token, s.tag, rank)] = _Expect(s.move, files)
            self._expected.update(expects)
            gone = {src for t, src in self._gone if t == token}
            loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a loop that stopped: nothing waits on it
                loop.call_soon_threadsafe(self._wake)
        for e in expects.values():
            if e.move.src in gone:  # its sender came and went before this rank asked
                _settle(e.future, self._gone_error(e))
        try:
            sent = self._send(token, key, rank, [s for s in slots if s.move.src == rank], endpoints, files, deadline,
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
                for k in expects:
                    self._expected.pop(k, None)
        files.finish()

    def _send(self, token: bytes, key: PeerKey, rank: int, slots: Sequence[Slot],
              endpoints: Mapping[int, tuple[str, int]], files: PeerFiles, deadline: float,
              threads: int) -> BaseException | None:
        """Send ``slots``; the first error of reading a chunk (its receivers were told), if any."""
        senders: dict[tuple[str, int], _Sender] = {}
        failed: list[BaseException] = []
        try:
            for s in slots:
                for d in s.move.dsts:
                    ep = endpoints[d]
                    if ep not in senders:
                        senders[ep] = _Sender(ep, deadline, key, token, rank)
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
                senders[endpoints[d]].send(s.tag, d, view, max(0.0, deadline - time.monotonic()))
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

    # ------------------------------------------------------------------ receiving (the loop's thread)

    async def _accept(self, lsock: socket.socket) -> None:
        """Take connections until the port closes; whatever ``accept`` raises, log it and go on."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(lsock)
            except OSError as e:
                if self._closed or lsock.fileno() < 0:
                    return
                out = e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                self._warn("accept", "the peer port could not take a connection (%s): it goes on", e)
                await asyncio.sleep(_BACKOFF_S if out else 0.01)
                continue
            except Exception:  # never end the loop: a dead accept loop is a port disabled for good
                log.exception("the peer port's accept failed: it goes on")
                await asyncio.sleep(_BACKOFF_S)
                continue
            try:
                self._admit(conn)
            except Exception:
                log.exception("the peer port could not serve a connection: it goes on")
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        if len(self._conns) >= _cap():
            # Make room by closing the oldest connection that has not shown a key: a flood of
            # strangers then only ever pushes out strangers (a real peer shows its key at once).
            oldest = next((cid for cid, c in self._conns.items() if not c.known), None)
            if oldest is None:
                self.turned_away["refused"] += 1
                self._warn("full", "the peer port holds %d connections from peers: one more was refused",
                           len(self._conns))
                conn.close()
                return
            self.turned_away["evicted"] += 1
            self._warn("evict", "the peer port is full (%d connections): the oldest unauthenticated was closed",
                       len(self._conns))
            self._conns.pop(oldest).task.cancel()
        cid = next(self._ids)
        task = asyncio.get_running_loop().create_task(self._serve(cid, conn))
        self._conns[cid] = _Conn(task)

    async def _serve(self, cid: int, conn: socket.socket) -> None:
        """Land the frames of one connection, in order (a receiver that is not ready holds the sender).

        Once it closes, for whatever reason, a move of its sender that has not come fails at once:
        a sender sends all its moves to this agent over one connection.
        """
        loop = asyncio.get_running_loop()
        sender: tuple[bytes, int] | None = None
        try:
            async with asyncio.timeout(HELLO_S):
                raw = await _recv_exactly(loop, conn, HEADER_BYTES, eof_ok=True)
            if raw is None:
                return
            with self._cond:
                key = self._keys.get(key_id(raw))
            if key is None:
                self.turned_away["unknown"] += 1
                self._warn("unknown", "a connection to the peer port with a key no rank of this node handed it "
                           "was closed")
                return  # closed unanswered: a sender of this job tries again (module docstring)
            hello = key.open(raw, 0)
            conn_ = self._conns.get(cid)
            if conn_ is not None:
                conn_.known = True
            await loop.sock_sendall(conn, ACK)
            sender = (hello.token, hello.src)
            for seq in itertools.count(1):
                async with asyncio.timeout(IDLE_S):
                    raw = await _recv_exactly(loop, conn, HEADER_BYTES, eof_ok=True)
                if raw is None:
                    return
                if key_id(raw) != key.id:
                    raise WireError("a peer frame sealed with another key than its connection's")
                f = key.open(raw, seq)
                if (f.token, f.src) != sender:
                    raise WireError("a peer frame of another version or rank than its connection's")
                await self._take(loop, conn, f)
        except (OSError, WireError, TimeoutError) as e:  # a peer that went away, is too slow, or is no peer
            self.turned_away["failed" if sender else "stranger"] += 1
            reason = str(e) or "it sent too little for too long"
            if sender is not None:
                log.info("a peer connection ended: %s", reason)
            else:
                self._warn("stranger", "a connection to the peer port that is no peer was closed: %s", reason)
        except Exception:
            log.exception("a peer connection failed")
        finally:
            conn.close()
            self._conns.pop(cid, None)
            if sender is not None:
                self._sender_gone(*sender)

    async def _take(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, f: Frame) -> None:
        """Land one authenticated frame (or drop it: nobody here asked for it)."""
        exp = await self._wait_for((f.token, f.tag, f.dst), f.wait)
        if exp is None or exp.future.done() or exp.move.src != f.src:
            await _drain(loop, conn, f.n)  # a frame nobody here asked for (or asks for any more): dropped
            return
        m = exp.move
        if f.kind == UNREADABLE:
            _settle(exp.future, IntegrityError(f"rank {m.src} could not read {m.chunk} to copy it"))
            return
        if f.n != m.nbytes:  # never allocate what a stray header claims
            await _drain(loop, conn, f.n)
            _settle(exp.future, IntegrityError(f"rank {m.src} sent {f.n} bytes for {m.chunk}, not its {m.nbytes}"))
            return
        async with self._budget(f.n):
            data = bytearray(f.n)
            await _recv_into(loop, conn, memoryview(data))  # if the connection breaks here, the move fails
            try:
                await loop.run_in_executor(self._landers, exp.files.land, m, memoryview(data))
            except Exception as e:
                _settle(exp.future, e)
            else:
                with self._cond:
                    self.bytes["received"] += f.n
                _settle(exp.future, None)

    @contextlib.asynccontextmanager
    async def _budget(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes of :data:`RECV_BUDGET` (the kernel's buffers hold the senders meanwhile)."""
        room = self._room
        assert room is not None
        async with room:
            await room.wait_for(lambda: self._held == 0 or self._held + n <= RECV_BUDGET)
            self._held += n
        try:
            yield
        finally:
            async with room:
                self._held -= n
                room.notify_all()

    def _wake(self) -> None:
        """Wake the frames waiting for their move (a rank handed its moves over)."""
        if self._news is not None:
            self._news.set()
            self._news = asyncio.Event()

    async def _wait_for(self, key: tuple[bytes, int, int], wait: float) -> _Expect | None:
        deadline = time.monotonic() + wait
        while True:
            with self._cond:
                exp = self._expected.get(key)
                if exp is not None or self._closed:
                    return exp
            left = deadline - time.monotonic()
            news = self._news
            if left <= 0 or news is None:
                return None
            try:
                async with asyncio.timeout(left):
                    await news.wait()
            except TimeoutError:
                return None

    def _sender_gone(self, token: bytes, src: int) -> None:
        with self._cond:
            self._gone[(token, src)] = None
            while len(self._gone) > _KEEP_GONE:
                self._gone.popitem(last=False)
            left = [e for (t, _, _), e in self._expected.items() if t == token and e.move.src == src]
        for e in left:
            _settle(e.future, self._gone_error(e))

    @staticmethod
    def _gone_error(e: _Expect) -> TierUnavailableError:
        return TierUnavailableError(
            f"rank {e.move.src}'s node agent stopped before it sent {e.move.chunk} of version {e.files.vid}")

    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg`` at most every :data:`_WARN_EVERY_S` per kind, with how many were not logged."""
        now = time.monotonic()
        last, quiet = self._warned.get(kind, (-math.inf, 0))
        if now - last < _WARN_EVERY_S:
            self._warned[kind] = (last, quiet + 1)
            return
        self._warned[kind] = (now, 0)
        log.warning(msg + (f" ({quiet} more like it not logged)" if quiet else ""), *args)


def _cap() -> int:
    """The connections the peer port holds: :data:`MAX_CONNECTIONS`, fewer under a low fd limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(8, min(MAX_CONNECTIONS, soft // 4)) if soft != resource.RLIM_INFINITY else MAX_CONNECTIONS


def _settle(fut: Future[None], error: BaseException | None) -> None:
    """Resolve ``fut`` unless something else did first."""
    with contextlib.suppress(Exception):
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int, *,
                        eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    if not await _recv_into(loop, conn, memoryview(buf), eof_ok=eof_ok):
        return None
    return bytes(buf)


async def _recv_into(loop: asyncio.AbstractEventLoop, conn: socket.socket, out: memoryview, *,
                     eof_ok: bool = False) -> bool:
    """Fill ``out`` straight from the socket (a large payload comes in large reads, no copy)."""
    got = 0
    while got < len(out):
        async with asyncio.timeout(STALL_S):
            n = await loop.sock_recv_into(conn, out[got:])
        if n == 0:
            if eof_ok and got == 0:
                return False
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n
    return True


async def _drain(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes, a bounded window at a time."""
    if n <= 0:
        return
    window = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        await _recv_into(loop, conn, window[: min(n, len(window))])
        n -= min(n, len(window))


def _name(endpoint: tuple[str, int]) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["HELLO_S", "IDLE_S", "MAX_CONNECTIONS", "STALL_S", "PeerPort", "advertised_host", "copy_request",
           "port_request"]
