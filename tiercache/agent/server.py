"""The agent process: one cache, one engine over the shared arena, a socket for the node's trainers.

:class:`AgentServer` hosts the very pipeline that runs in a trainer without an agent: a
:class:`~tiercache.cache.TierCache` (without its ``[agent]`` table) whose
:class:`~tiercache.pipeline.engine.Engine` carves its RAM arena out of the shared file
(:class:`~tiercache.agent.arena.SharedArena`). Trainers reserve regions for a version
(:meth:`Engine.reserve`), copy into them and publish it; :meth:`Engine.adopt` then hashes, places,
writes and commits it like any save, and the agent tells every client of the cache what happened
(see :mod:`tiercache.agent.protocol` for the messages).

The server owns the process: the lock, the socket, the threads, the cache, the shared arena, the
status recorder and the peer port. What each request does is up to :class:`~tiercache.agent.requests.Requests`
(made once the cache is open): the server hands it each connection and each request, and it asks
back only for the arena and the metrics address (:class:`~tiercache.agent.requests.Host`).

Threads: one accepts connections; one per client reads its requests (answered in order, inline,
except those that may wait: ``reserve``, ``flush``, ``stop``, ``promote``, ``gc`` run on a thread
of their own and send a heartbeat every second meanwhile); the engine's threads send events. A
client that disconnects gives back the regions it reserved and did not publish, and the chunks
it was reading: a trainer killed in the middle of a copy never damages anything, and what it
published is finished all the same.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tiercache.agent import naming
from tiercache.agent.arena import SharedArena, sweep
from tiercache.agent.lifecycle import check_environment
from tiercache.agent.peering import PeerPort
from tiercache.agent.protocol import (
    Connection,
    ProtocolError,
    error_to_wire,
)
from tiercache.agent.requests import Client, Requests
from tiercache.agent.rundir import open_private, private_dir
from tiercache.cache import TierCache, core_of
from tiercache.config import CacheConfig, RamConfig
from tiercache.errors import (
    AgentUnavailableError,
    ConfigError,
    TierCacheError,
)
from tiercache.status import STATUS_KEY, StatusRecorder
from tiercache.tiers.ram import ALIGN, Arena

log = logging.getLogger("tiercache.agent.server")

#: Seconds between two heartbeats of a request that is still being worked on.
HEARTBEAT_S = 1.0
#: Seconds the accept loop waits when the process is out of fds (or memory) before it tries again.
_ACCEPT_BACKOFF_S = 0.2
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class AgentRunningError(AgentUnavailableError):
    """Another agent already serves this cache on this node (its lock is held)."""


class AgentServer:
    """The node agent of one cache (see the module docstring).

    Args:
        config: The cache's config, with its ``[agent]`` table.

    Raises:
        ConfigError: If the config has no ``[agent]`` table.
    """

    def __init__(self, config: CacheConfig) -> None:
        if config.agent is None:
            raise ConfigError("tiercache agent needs an [agent] table in the config (an empty one will do)")
        self.config = config
        self.settings = config.agent
        self.place = naming.place(config)
        # The cache it runs: no [agent] table (it is the agent), and a RAM tier that serves reads.
        self.inner = config.model_copy(update={"agent": None, "ram": config.ram or RamConfig()})
        self.started_at = time.time()
        self.cache: TierCache | None = None
        self.shared: SharedArena | None = None
        #: What the agent does for each request; made once the cache is open (see :meth:`start`).
        self.requests: Requests | None = None
        self._lock = threading.Lock()  # for ``_idle_since``
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._idle_since: float | None = time.monotonic()
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._recorder: StatusRecorder | None = None
        self._peers = PeerPort()
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_server: Any = None

    # ------------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Check the environment, take the lock, sweep stale arenas, open the cache, listen.

        Raises:
            ConfigError: If the environment cannot host the agent (one line per problem), or the
                socket's directory is not this user's alone.
            AgentRunningError: If another agent serves this cache on this node.
        """
        private_dir(self.place.socket.parent)  # before any file is made there: see rundir
        self._lock_fd = open_private(self.place.lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise AgentRunningError(f"an agent already serves this cache on this node (socket {self.place.socket})"
                                    ) from None
        try:
            for gone in sweep(self.settings.shm_dir):
                log.warning("removed the arena of a dead agent or another boot: %s", gone)
            problems = check_environment(self.inner, self.place)
            if problems:
                raise ConfigError("; ".join(problems))
            self.cache = TierCache(self.inner, make_arena=self._make_arena)
            core = core_of(self.cache)
            _ = core.saver  # with an explicit capacity, the arena is made and pre-faulted now
            write = partial(core.repo.put_record, STATUS_KEY) if core.repo.durable else None
            self._recorder = StatusRecorder(write,
                                            interval=self.inner.ui.status_interval, meter=core.meter.snapshot,
                                            writer="agent")
            self.requests = Requests(self.cache, self.place, self.inner, self, recorder=self._recorder,
                                     peers=self._peers, started_at=self.started_at)
            self._listen()
            if self.settings.metrics is not None:
                from tiercache.agent.metrics import serve_metrics

                self._metrics_server, self.metrics_address = serve_metrics(self.requests, self.settings.metrics)
        except BaseException:
            self._teardown()
            raise
        log.info("agent %d serving %s on %s (arena %s)", os.getpid(), self.place.key, self.place.socket,
                 self.shared.path if self.shared else "made at the first save")

    def _make_arena(self, capacity: int) -> Arena:
        capacity = max(ALIGN, capacity // ALIGN * ALIGN)
        shared = SharedArena(self.place.arena(), capacity)
        try:
            shared.prefault()
        except BaseException:
            shared.close()
            raise
        self.shared = shared
        return Arena(capacity, mapping=shared.mapping)

    def _listen(self) -> None:
        path = self.place.socket
        if len(os.fsencode(path)) > 107:
            raise ConfigError(f"agent socket path {path} is longer than 107 bytes: set [agent] socket shorter")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead agent's (we hold the lock: no live agent uses it)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(64)
        self._listener = sock

    def serve_forever(self) -> None:
        """Accept clients until :meth:`request_stop` (or ``stop``, or the idle timeout); then shut down."""
        assert self._listener is not None
        threading.Thread(target=self._accept_loop, name="tiercache-agent-accept", daemon=True).start()
        threading.Thread(target=self._idle_loop, name="tiercache-agent-idle", daemon=True).start()
        try:
            # Wake up now and then: a signal delivered to another thread runs its Python handler
            # only when the main thread gets back to Python code, never while it blocks for good.
            while not self._stop.wait(0.2):
                pass
        finally:
            self.shutdown()

    def install_signals(self) -> None:
        """Stop on SIGTERM and SIGINT (set even where the parent ignored them: a background job).

        SIGUSR1 writes every thread's stack to the agent's stderr (its log), for a hung agent.
        """
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def request_stop(self) -> None:
        """Ask the agent to finish what it holds and exit (safe from signal handlers and any thread)."""
        self._stop.set()

    def shutdown(self) -> None:
        """Finish every version, close the cache, unlink the arena and the socket; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.place.socket.unlink()
        self._peers.close()
        clients = self.requests.clients() if self.requests is not None else []
        for c in clients:
            c.conn.close()
        self._teardown()
        log.info("agent %d stopped", os.getpid())

    def _teardown(self) -> None:
        try:
            if self._recorder is not None:
                self._recorder.close()
            if self.cache is not None:
                self.cache.close()
        except TierCacheError as e:
            log.error("while stopping: %s", e)
        finally:
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
            if self.shared is not None:
                self.shared.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _idle_loop(self) -> None:
        limit = self.settings.idle_exit
        while not self._stop.wait(min(1.0, limit) if limit else 1.0):
            assert self.requests is not None
            try:
                self.requests.sweep()  # regions parked for trainers that left alive, once they exited
            except Exception:  # a bug there must not end idle exit
                log.exception("giving back the regions of trainers that exited")
            if not limit:
                continue
            with self._lock:
                busy = self.requests.busy()
                now = time.monotonic()
                if busy:
                    self._idle_since = None
                    continue
                if self._idle_since is None:
                    self._idle_since = now
                if now - self._idle_since >= limit:
                    log.info("no client for %.0f s and nothing left to write: exiting", limit)
                    self._stop.set()

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        """Take trainers' connections until the agent stops; whatever ``accept`` raises, log it and go on.

        A loop that ended here would leave every trainer of the node without its agent for good
        (out of fds, a flood of connections): it backs off a moment and tries again instead.
        """
        assert self._listener is not None and self.requests is not None
        failures = 0
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._stop.is_set() or self._listener.fileno() < 0:
                    return
                failures += 1
                if failures == 1 or failures % 100 == 0:  # a flood logs a count, not a line per try
                    log.warning("the agent could not take a connection (%s; %d times): it goes on", e, failures)
                self._stop.wait(_ACCEPT_BACKOFF_S if e.errno in _OUT_OF else 0.01)
                continue
            if failures:
                log.info("the agent takes connections again (after %d failures)", failures)
                failures = 0
            client = self.requests.connect(Connection(sock))
            with self._lock:
                self._idle_since = None
            try:
                threading.Thread(target=self._serve, args=(client,), name=f"tiercache-agent-client-{client.cid}",
                                 daemon=True).start()
            except RuntimeError as e:  # no thread to be had: this client goes, the loop stays
                log.warning("the agent could not serve a connection (%s): it goes on", e)
                self._drop(client)

    def _serve(self, client: Client) -> None:
        try:
            for msg, fds in client.conn.messages():
                for fd in fds:  # clients never send descriptors
                    os.close(fd)
                self._dispatch(client, msg)
        except (OSError, ProtocolError) as e:
            log.info("client %d (pid %d): %s", client.cid, client.pid, e)
        finally:
            self._drop(client)

    def _drop(self, client: Client) -> None:
        """A client went away: what it reserved and did not publish, and what it was reading, go back."""
        assert self.requests is not None
        client.alive = False
        client.conn.close()
        left = self.requests.disconnect(client)
        if left:
            log.info("client pid %d left %d unpublished reservation(s); their regions went back", client.pid, left)

    def _dispatch(self, client: Client, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        rid = msg.get("id")
        assert self.requests is not None
        handler = self.requests.handler(str(op))
        if handler is None:
            client.send({"id": rid, "error": error_to_wire(ProtocolError(f"unknown request {op!r}"))})
            return
        fn, slow = handler
        if slow:
            threading.Thread(target=self._answer_slowly, args=(client, rid, fn, msg), daemon=True,
                             name=f"tiercache-agent-{op}").start()
            return
        self._answer(client, rid, fn, msg)

    def _answer(self, client: Client, rid: Any, fn: Callable[..., Any], msg: dict[str, Any]) -> None:
        assert self.requests is not None
        fds: list[int] = []
        try:
            result = fn(client, msg)
            if isinstance(result, tuple):
                result, fds = result
        except (TierCacheError, ValueError, TypeError, KeyError, OSError) as e:
            self.requests.note_error(e)
            client.send({"id": rid, "error": error_to_wire(e)})
            return
        if client.alive:
            try:
                client.conn.send({"id": rid, **result}, fds)
            except OSError:
                client.alive = False
        if msg.get("op") == "stop":
            self.request_stop()  # once the answer is out: the shutdown closes every connection

    def _answer_slowly(self, client: Client, rid: Any, fn: Callable[..., Any], msg: dict[str, Any]) -> None:
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_S):
                client.send({"id": rid, "wait": True})

        threading.Thread(target=beat, daemon=True, name="tiercache-agent-heartbeat").start()
        try:
            self._answer(client, rid, fn, msg)
        finally:
            done.set()


def run(config: CacheConfig, *, exist_ok: bool = False, echo: Callable[[str], None] | None = None) -> int:
    """Run the agent of ``config``'s cache in the foreground until it is stopped (``tiercache agent``).

    Args:
        config: The cache's config (with an ``[agent]`` table).
        exist_ok: Another agent already serving the cache is no error (an agent started
            automatically by two processes at once): return 0 at once.
        echo: Where to print the one line that says the agent is ready.

    Returns:
        The exit status.

    Raises:
        ConfigError: If the config or the environment cannot host the agent.
        AgentRunningError: If another agent serves the cache (without ``exist_ok``).
    """
    server = AgentServer(config)
    try:
        server.start()
    except AgentRunningError:
        if exist_ok:
            return 0
        raise
    server.install_signals()
    if echo is not None:
        where = f"; metrics on http://{server.metrics_address[0]}:{server.metrics_address[1]}/metrics" \
            if server.metrics_address else ""
        echo(f"tiercache agent {os.getpid()} serving {_describe(config)} on {server.place.socket}{where}")
    server.serve_forever()
    return 0


def _describe(config: CacheConfig) -> str:
    parts = []
    if config.disk is not None:
        parts.append(f"disk {config.disk.path}")
    if config.s3 is not None:
        parts.append(f"s3 {config.s3.url}")
    return ", ".join(parts) or "RAM only"


__all__ = ["AgentRunningError", "AgentServer", "run"]
