"""A bandwidth-limited TCP proxy on loopback, for tests and benchmarks of slow links.

:class:`ThrottledProxy` listens on ``127.0.0.1`` and forwards every connection, byte for byte,
to a loopback target (an S3 server), at most ``limit_bps`` bytes per second in each direction,
shared by all connections (like one uplink). The limit can be changed or lifted while transfers
run, which is how a test shows the policy noticing a link that got faster. Being a plain TCP
relay it is transparent to HTTP and to SigV4 signatures (the Host header is the proxy's own
address, which is what the client signed).

It also stands in for an outage: :attr:`ThrottledProxy.mode` switches it between ``"up"``
(relaying), ``"refuse"`` (nothing listens on the port: connections are refused, open ones cut)
and ``"hang"`` (connections are accepted and nothing is ever answered, open ones freeze), and
back, while clients keep the same endpoint URL.

Only loopback targets are accepted: tests and benchmarks must never reach another machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

Direction = Literal["up", "down"]
Mode = Literal["up", "refuse", "hang"]

_CHUNK = 16 * 1024
# Smooths bursts: a bucket holds at most this many seconds' worth of unused allowance.
_BURST_S = 0.05


class _TokenBucket:
    """A shared allowance of bytes per second; ``take`` blocks until the bytes may pass."""

    def __init__(self, rate: float | None) -> None:
        self._cv = threading.Condition()
        self._rate = rate
        self._tokens = 0.0
        self._stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        if self._rate is not None:
            self._tokens = min(self._rate * _BURST_S, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def set_rate(self, rate: float | None) -> None:
        with self._cv:
            self._refill()
            self._rate = rate
            self._tokens = max(self._tokens, 0.0)  # a lifted or changed limit forgives the old debt
            self._cv.notify_all()

    def take(self, nbytes: int, stop: threading.Event) -> None:
        # Tokens may go negative (debt), so a chunk larger than the burst still passes, and the
        # next sender waits until the debt is paid off: the long-run rate is exactly the limit.
        with self._cv:
            while not stop.is_set():
                self._refill()
                if self._rate is None or self._tokens >= 0:
                    self._tokens -= nbytes if self._rate is not None else 0
                    return
                self._cv.wait(min(-self._tokens / self._rate, 0.05))


def _loopback_target(target: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(target, str):
        parts = urlsplit(target if "//" in target else f"//{target}")
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"proxy target {target!r}: expected http://127.0.0.1:PORT or (host, port)")
        host, port = parts.hostname, parts.port
    else:
        host, port = target
    addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    if not ipaddress.ip_address(addr).is_loopback:
        raise ValueError(f"proxy target {host}:{port} is not on loopback: only local servers may be proxied")
    return addr, port


class ThrottledProxy:
    """A TCP relay from ``127.0.0.1:<free port>`` to a loopback ``target`` at a limited rate.

    Args:
        target: ``http://127.0.0.1:PORT`` (an endpoint URL) or ``(host, port)`` on loopback.
        limit_bps: Bytes per second allowed in each direction, shared by all connections, or
            ``None`` for no limit.

    Raises:
        ValueError: If the target is not on loopback or the limit is not positive.

    Example::

        with ThrottledProxy(server.endpoint_url, limit_bps=4e6) as proxy:
            cfg = S3Config(url="s3://bucket/prefix", endpoint_url=proxy.url)
            ...
            proxy.limit_bps = None  # lift the limit mid-run
    """

    def __init__(self, target: str | tuple[str, int], limit_bps: float | None = None) -> None:
        self._target = _loopback_target(target)
        self._check(limit_bps)
        self._limit = limit_bps
        self._buckets = {"up": _TokenBucket(limit_bps), "down": _TokenBucket(limit_bps)}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._bytes = {"up": 0, "down": 0}
        self._listener: socket.socket | None = None
        self._port = 0
        self._mode: Mode = "up"
        self._flowing = threading.Event()  # clear while hanging: the pumps wait on it
        self._flowing.set()
        self._held: list[socket.socket] = []  # connections accepted while hanging
        self._connections = 0

    @staticmethod
    def _check(limit_bps: float | None) -> None:
        if limit_bps is not None and not limit_bps > 0:
            raise ValueError(f"limit_bps must be > 0 bytes/s or None for no limit, got {limit_bps!r}")

    # ------------------------------------------------------------------ lifetime

    def start(self) -> ThrottledProxy:
        """Bind a free loopback port and start accepting connections."""
        if self._listener is not None:
            return self
        self._listen()
        return self

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._port))  # the same port again after a refusal
        listener.listen(64)
        listener.settimeout(0.1)  # so the accept loop notices close() promptly
        self._port = listener.getsockname()[1]
        self._listener = listener
        t = threading.Thread(target=self._accept_loop, args=(listener,), name="tiercache-throttle-accept",
                             daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    @property
    def mode(self) -> Mode:
        """``"up"`` (relaying), ``"refuse"`` (connections refused) or ``"hang"`` (never answered); settable."""
        return self._mode

    @mode.setter
    def mode(self, value: Mode) -> None:
        if value not in ("up", "refuse", "hang"):
            raise ValueError(f"mode must be 'up', 'refuse' or 'hang', got {value!r}")
        if value == self._mode:
            return
        if self._mode == "refuse":
            self._listen()
        if value == "refuse":
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()  # the accept loop ends; new connections are refused
            self._cut_all()
        if value == "hang":
            self._flowing.clear()
        else:
            self._flowing.set()
            with self._lock:
                held, self._held = self._held, []
            for s in held:
                s.close()
        self._mode = value

    def _cut_all(self) -> None:
        with self._lock:
            socks = list(self._socks) + self._held
            self._held = []
        for s in socks:
            # Shut down only: it wakes the pumps blocked in recv, and they close the sockets.
            with contextlib.suppress(OSError):  # already shut by its peer
                s.shutdown(socket.SHUT_RDWR)

    @property
    def connections(self) -> int:
        """Connections accepted so far (relayed or held)."""
        with self._lock:
            return self._connections

    def close(self) -> None:
        """Stop accepting, cut every open connection and join the relay threads."""
        self._stop.set()
        self._flowing.set()  # wakes pumps held by a hang
        for b in self._buckets.values():
            b.set_rate(self._limit)  # wakes senders waiting on the bucket
        self._cut_all()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> ThrottledProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ what callers see

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the proxy listens on (the same port while it refuses connections)."""
        if not self._port:
            raise RuntimeError("the proxy is not started: call start() or use it as a context manager")
        return "127.0.0.1", self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the endpoint URL to give clients instead of the target's."""
        host, port = self.address
        return f"http://{host}:{port}"

    @property
    def limit_bps(self) -> float | None:
        """Bytes per second allowed in each direction (``None``: unlimited); settable at run time."""
        return self._limit

    @limit_bps.setter
    def limit_bps(self, value: float | None) -> None:
        self._check(value)
        self._limit = value
        for b in self._buckets.values():
            b.set_rate(value)

    def bytes_forwarded(self, direction: Direction) -> int:
        """Bytes relayed so far ``up`` (client to target) or ``down`` (target to client)."""
        with self._lock:
            return self._bytes[direction]

    # ------------------------------------------------------------------ relaying

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            with self._lock:
                self._connections += 1
                if not self._flowing.is_set():
                    self._held.append(client)  # accepted, never answered
                    continue
            try:
                upstream = socket.create_connection(self._target, timeout=10)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.update((client, upstream))
                # Forget finished relays so a long run does not accumulate dead threads.
                self._threads = [t for t in self._threads if t.is_alive()]
            pair = _Pair(client, upstream)
            for src, dst, direction in ((client, upstream, "up"), (upstream, client, "down")):
                t = threading.Thread(target=self._pump, args=(src, dst, direction, pair),
                                     name=f"tiercache-throttle-{direction}", daemon=True)
                with self._lock:
                    self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: Direction, pair: _Pair) -> None:
        bucket = self._buckets[direction]
        try:
            while not self._stop.is_set():
                data = src.recv(_CHUNK)
                if not data:
                    dst.shutdown(socket.SHUT_WR)  # pass the half-close on, HTTP may still answer
                    return
                self._flowing.wait()  # a hang freezes open connections too
                bucket.take(len(data), self._stop)
                dst.sendall(data)
                with self._lock:
                    self._bytes[direction] += len(data)
        except OSError:
            # One side went away: drop both so the other side sees it too.
            for s in (src, dst):
                with contextlib.suppress(OSError):  # already shut
                    s.shutdown(socket.SHUT_RDWR)
        finally:
            with self._lock:
                pair.open_pumps -= 1
                last = pair.open_pumps == 0
                if last:
                    self._socks.difference_update(pair.socks)
            if last:  # both directions are done: only now may the sockets be closed
                for s in pair.socks:
                    s.close()


class _Pair:
    """The two sockets of one relayed connection and how many of its pumps still run."""

    __slots__ = ("open_pumps", "socks")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.socks = (client, upstream)
        self.open_pumps = 2


def _parse_limit(text: str) -> float | None:
    text = text.strip().lower()
    return None if text in ("", "none") else float(text)


def main(argv: list[str] | None = None) -> None:
    """``python -m tiercache.testing.throttle TARGET [LIMIT]``: run a proxy in a process of its own.

    Relaying in another process keeps the proxy's work off the caller's GIL, as a real link
    would be. The first line printed is the proxy's URL; each line read from stdin afterwards
    sets the limit in bytes/s (``none`` lifts it); the end of stdin stops the proxy.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        raise SystemExit("usage: python -m tiercache.testing.throttle http://127.0.0.1:PORT [BYTES_PER_S|none]")
    try:
        limit = _parse_limit(args[1]) if len(args) == 2 else None
        proxy = ThrottledProxy(args[0], limit)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    with proxy:
        print(proxy.url, flush=True)
        for line in sys.stdin:
            try:
                proxy.limit_bps = _parse_limit(line)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
