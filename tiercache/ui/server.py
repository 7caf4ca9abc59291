"""The ``tiercache ui`` web server: JSON endpoints and the page, over captures of a cache.

The server opens the cache the way every CLI verb does, reads it (:meth:`Capture.of`), and
closes it again; it takes a new capture at most once per ``refresh`` seconds, whatever the
number of requests, so the page sees a trainer's new versions without the server holding the
cache open. It never writes: opening, listing and reading status write nothing.

Access: a random token is printed at start (in the URL, as notebook servers do) and required on
every request (``?token=``, ``Authorization: Bearer``, or the cookie the page gets when it is opened
with ``?token=``), compared in constant time; anything else gets 401 and no data: another user of
the node cannot read the cache's versions, steps, meta or pids. On a loopback address, requests
whose ``Host`` is not a loopback name are refused as well (403: DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import threading
import time
from collections.abc import Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiercache.cache import TierCache
from tiercache.config import CacheConfig
from tiercache.errors import TierCacheError
from tiercache.ui import views

STATIC = Path(__file__).parent / "static"
COOKIE = "tiercache_token"
#: Headers on every response: no inline script, nothing loaded from elsewhere, no referrer (the
#: URL may carry the token).
SECURITY_HEADERS = (
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (``127.0.0.1``, ``::1``, ``localhost``)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _loopback_name(host_header: str) -> bool:
    name = host_header.rpartition("]")[0] + "]" if host_header.startswith("[") else host_header.partition(":")[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware: the loopback ``Host`` check or the token check, and the security headers.

    Args:
        app: The application to guard.
        token: The token every request must carry.
        loopback: Also refuse requests whose ``Host`` is not a loopback name (the server listens on one).
    """

    def __init__(self, app: ASGIApp, *, token: str, loopback: bool) -> None:
        self.app = app
        self.token = token
        self.loopback = loopback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection, or refuse it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback and not _loopback_name(headers.get("host", "")):
            await _refuse(scope, receive, send, 403, "this server answers only requests to a loopback host name")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
        bearer = headers.get("authorization", "")
        bearer = bearer[7:] if bearer.lower().startswith("bearer ") else ""
        cookie = SimpleCookie(headers.get("cookie", "")).get(COOKIE)
        given = query or bearer or (cookie.value if cookie is not None else "")
        if not secrets.compare_digest(given.encode(), self.token.encode()):
            await _refuse(scope, receive, send, 401, "a token is required: open the URL tiercache ui printed")
            return
        set_cookie = bool(query)
        token = self.token

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = list(SECURITY_HEADERS)
                if set_cookie:
                    extra.append((b"set-cookie",
                                  f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode("latin-1")))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, why: str) -> None:
    response = JSONResponse({"error": why}, status_code=status, headers={"cache-control": "no-store"})
    await response(scope, receive, send)


class Source:
    """Captures of one cache, at most one per ``refresh`` seconds, shared by every request.

    Args:
        config: The cache's config.
        refresh: Seconds a capture is served before the next one is taken.
        mttf: The MTTF the advice assumes when the saving process publishes none (``None``: the config's).
        opener: Opens the cache (tests pass a fake).
        clock: Unix time.
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        refresh: float,
        mttf: float | None,
        opener: Callable[[CacheConfig], Any] = TierCache,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.refresh = refresh
        self.mttf = mttf
        self._open = opener
        self._clock = clock
        self._lock = threading.Lock()
        self._capture: views.Capture | None = None

    def capture(self) -> views.Capture:
        """The current capture, taken anew if the last one is older than ``refresh`` seconds.

        Raises:
            TierCacheError: If the cache cannot be opened or read.
        """
        with self._lock:
            now = self._clock()
            if self._capture is None or now - self._capture.at >= self.refresh:
                cache = self._open(self.config)
                try:
                    self._capture = views.Capture.of(cache, mttf=self.mttf, now=now)
                finally:
                    cache.close()
            return self._capture


def create_app(source: Source, *, token: str, loopback: bool = True) -> ASGIApp:
    """The web application: the page, its assets and the JSON endpoints (see ``docs/ui.md``).

    Args:
        source: Where the captures come from.
        token: The token every request must carry.
        loopback: Refuse requests whose ``Host`` is not a loopback name (serving on loopback).
    """

    def endpoint(view: Callable[[views.Capture, Request], Any]) -> Callable[[Request], Response]:
        # Plain functions: Starlette runs them on its thread pool, so reading the cache never
        # blocks the event loop.
        def handle(request: Request) -> Response:
            try:
                body = view(source.capture(), request)
            except (TierCacheError, OSError) as e:
                return JSONResponse({"error": f"cannot read the cache: {e}"}, status_code=503)
            if body is None:
                return JSONResponse({"error": "no such version"}, status_code=404)
            return JSONResponse(body)

        return handle

    routes = [
        Route("/", lambda request: FileResponse(STATIC / "index.html")),
        Route("/api/overview", endpoint(lambda cap, r: views.overview(cap, refresh=source.refresh))),
        Route("/api/lineage", endpoint(lambda cap, r: views.lineage(cap))),
        Route("/api/version/{version_id}",
              endpoint(lambda cap, r: views.version_summary(cap, r.path_params["version_id"]))),
        Route("/api/lag", endpoint(lambda cap, r: views.lag(cap))),
        Route("/api/throughput", endpoint(lambda cap, r: views.throughput(cap))),
        Route("/api/advice", endpoint(lambda cap, r: views.advice(cap))),
        Route("/api/status", endpoint(lambda cap, r: {"status": cap.status.to_json() if cap.status else None})),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Guard(Starlette(routes=routes), token=token, loopback=loopback)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def serve(config: CacheConfig, *, host: str, port: int, refresh: float, mttf: float | None,
          echo: Callable[[str], None]) -> None:
    """Serve the UI until interrupted (the ``tiercache ui`` verb).

    Raises:
        TierCacheError: If the cache cannot be read (checked once before serving).
        OSError: If the address cannot be bound.
    """
    import uvicorn

    token = secrets.token_urlsafe(24)
    source = Source(config, refresh=refresh, mttf=mttf)
    source.capture()  # a config that cannot be read fails here, in one line, not on the first request
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}/?token={token}"
    echo(f"tiercache ui: serving {url} (read-only; Ctrl-C stops it)")
    echo("a token is required on every request: the URL above carries it")
    app = create_app(source, token=token, loopback=is_loopback(host))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    server.run(sockets=[sock])


__all__ = ["Guard", "Source", "bind", "create_app", "is_loopback", "serve"]
