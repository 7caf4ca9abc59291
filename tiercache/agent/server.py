"""The agent process: one cache, one engine over the shared arena, a socket for the node's trainers.

:class:`AgentServer` hosts the very pipeline that runs in a trainer without an agent: a
:class:`~tiercache.cache.TierCache` (without its ``[agent]`` table) whose
:class:`~tiercache.pipeline.engine.Engine` carves its RAM arena out of the shared file
(:class:`~tiercache.agent.arena.SharedArena`). Trainers reserve regions for a version
(:meth:`Engine.reserve`), copy into them and publish it; :meth:`Engine.adopt` then hashes, places,
writes and commits it like any save, and the agent tells every client of the cache what happened
(see :mod:`tiercache.agent.protocol` for the messages).

Threads: one accepts connections; one per client reads its requests (answered in order, inline,
except those that may wait: ``reserve``, ``flush``, ``stop``, ``promote``, ``gc`` run on a thread
of their own and send a heartbeat every second meanwhile); the engine's threads send events. A
client that disconnects gives back the regions it reserved and did not publish, and the chunks
it was reading: a trainer killed in the middle of a copy never damages anything, and what it
published is finished all the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import fcntl
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from tiercache.agent import naming
from tiercache.agent.arena import SharedArena, sweep
from tiercache.agent.lifecycle import check_environment
from tiercache.agent.protocol import (
    PROTOCOL_VERSION,
    Connection,
    ProtocolError,
    error_to_wire,
    metas_from_wire,
    staged_from_wire,
)
from tiercache.cache import TierCache
from tiercache.config import CacheConfig, RamConfig
from tiercache.errors import (
    AgentUnavailableError,
    ConfigError,
    ConflictError,
    InvalidArgumentError,
    TierCacheError,
)
from tiercache.format import TensorMeta
from tiercache.handle import LEVELS, TIER_LEVEL, SaveHandle
from tiercache.layout import Layout
from tiercache.manifest import RefRecord, Version
from tiercache.names import chunk_key
from tiercache.pipeline.engine import Engine
from tiercache.pipeline.staging import PlanCache
from tiercache.status import STATUS_KEY, StatusRecorder
from tiercache.tiers.ram import ALIGN, Arena, Region

log = logging.getLogger("tiercache.agent.server")

#: Seconds between two heartbeats of a request that is still being worked on.
HEARTBEAT_S = 1.0
#: Fields of the config that shape chunks: a client must agree on them with the agent.
LAYOUT_FIELDS = ("chunk_bytes", "pack_below", "hash", "allow_pickle")


class AgentRunningError(AgentUnavailableError):
    """Another agent already serves this cache on this node (its lock is held)."""


@dataclasses.dataclass
class _Client:
    cid: int
    conn: Connection
    pid: int = 0
    reservations: dict[int, list[Region]] = dataclasses.field(default_factory=dict)
    pins: dict[int, Region] = dataclasses.field(default_factory=dict)
    alive: bool = True

    def send(self, msg: Mapping[str, Any]) -> None:
        if not self.alive:
            return
        try:
            self.conn.send(msg)
        except OSError:
            self.alive = False


@dataclasses.dataclass
class _Tracked:
    """A version published through the agent, until every level of it is settled."""

    version: str
    branch: str
    step: int
    record: RefRecord
    base: RefRecord | None
    owner: int
    handle: SaveHandle
    published: threading.Event = dataclasses.field(default_factory=threading.Event)


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
        self._lock = threading.RLock()
        self._clients: dict[int, _Client] = {}
        self._ids = itertools.count(1)
        self._structures: dict[str, tuple[tuple[TensorMeta, ...], Layout]] = {}
        self._plans = PlanCache(self.inner.pack_below)
        self._tracked: dict[str, _Tracked] = {}
        self._levels: Counter[str] = Counter()
        self._restores: Counter[str] = Counter()
        self._restore_bytes: Counter[str] = Counter()
        self._served: Counter[str] = Counter()  # bytes of node RAM lent to readers
        self._errors: Counter[str] = Counter()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._idle_since: float | None = time.monotonic()
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._recorder: StatusRecorder | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_server: Any = None

    # ------------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Check the environment, take the lock, sweep stale arenas, open the cache, listen.

        Raises:
            ConfigError: If the environment cannot host the agent (one line per problem).
            AgentRunningError: If another agent serves this cache on this node.
        """
        self.place.socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.place.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
            engine = self.engine  # with an explicit capacity, the arena is made and pre-faulted now
            tier = next((t for n, t in self.cache.repo.durable.items() if self.cache.health.available(n)), None)
            self._recorder = StatusRecorder(None if tier is None else lambda data: tier.put(STATUS_KEY, data),
                                            interval=self.inner.ui.status_interval, meter=self.cache.meter.snapshot)
            self._watch_ram(engine)
            self._listen()
            if self.settings.metrics is not None:
                from tiercache.agent.metrics import serve_metrics

                self._metrics_server, self.metrics_address = serve_metrics(self, self.settings.metrics)
        except BaseException:
            self._teardown()
            raise
        log.info("agent %d serving %s on %s (arena %s)", os.getpid(), self.place.key, self.place.socket,
                 self.shared.path if self.shared else "made at the first save")

    @property
    def engine(self) -> Engine:
        """The engine of the agent's cache."""
        assert self.cache is not None
        engine = self.cache.engine
        assert isinstance(engine, Engine)
        return engine

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
        with self._lock:
            clients = list(self._clients.values())
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
            if not limit:
                continue
            with self._lock:
                busy = bool(self._clients) or bool(self._tracked) or bool(self.engine.pending_jobs())
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
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            client = _Client(next(self._ids), Connection(sock))
            with self._lock:
                self._clients[client.cid] = client
                self._idle_since = None
            threading.Thread(target=self._serve, args=(client,), name=f"tiercache-agent-client-{client.cid}",
                             daemon=True).start()

    def _serve(self, client: _Client) -> None:
        try:
            for msg, fds in client.conn.messages():
                for fd in fds:  # clients never send descriptors
                    os.close(fd)
                self._dispatch(client, msg)
        except (OSError, ProtocolError) as e:
            log.info("client %d (pid %d): %s", client.cid, client.pid, e)
        finally:
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        """A client went away: what it reserved and did not publish, and what it was reading, go back."""
        client.alive = False
        client.conn.close()
        with self._lock:
            self._clients.pop(client.cid, None)
            reservations, client.reservations = list(client.reservations.values()), {}
            pins, client.pins = list(client.pins.values()), {}
        self._give_back([r for regions in reservations for r in regions] + pins)
        if reservations:
            log.info("client pid %d left %d unpublished reservation(s); their regions went back",
                     client.pid, len(reservations))

    def _dispatch(self, client: _Client, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        rid = msg.get("id")
        handler = _HANDLERS.get(str(op))
        if handler is None:
            client.send({"id": rid, "error": error_to_wire(ProtocolError(f"unknown request {op!r}"))})
            return
        fn, slow = handler
        if slow:
            threading.Thread(target=self._answer_slowly, args=(client, rid, fn, msg), daemon=True,
                             name=f"tiercache-agent-{op}").start()
            return
        self._answer(client, rid, fn, msg)

    def _answer(self, client: _Client, rid: Any, fn: Callable[..., Any], msg: dict[str, Any]) -> None:
        fds: list[int] = []
        try:
            result = fn(self, client, msg)
            if isinstance(result, tuple):
                result, fds = result
        except (TierCacheError, ValueError, TypeError, KeyError, OSError) as e:
            self._errors[type(e).__name__] += 1
            client.send({"id": rid, "error": error_to_wire(e)})
            return
        if client.alive:
            try:
                client.conn.send({"id": rid, **result}, fds)
            except OSError:
                client.alive = False
        if msg.get("op") == "stop":
            self.request_stop()  # once the answer is out: the shutdown closes every connection

    def _answer_slowly(self, client: _Client, rid: Any, fn: Callable[..., Any], msg: dict[str, Any]) -> None:
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_S):
                client.send({"id": rid, "wait": True})

        threading.Thread(target=beat, daemon=True, name="tiercache-agent-heartbeat").start()
        try:
            self._answer(client, rid, fn, msg)
        finally:
            done.set()

    def broadcast(self, msg: Mapping[str, Any]) -> None:
        """Send an event to every client."""
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
            c.send(msg)

    # ------------------------------------------------------------------ requests

    def _hello(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("proto") != PROTOCOL_VERSION:
            raise AgentUnavailableError(f"protocol {msg.get('proto')} is not this agent's ({PROTOCOL_VERSION}): "
                                        "run the same tiercache version in the trainer and the agent")
        if msg.get("cache") != self.place.key:
            raise AgentUnavailableError(f"this agent serves cache {self.place.key}, not {msg.get('cache')}")
        client.pid = int(msg.get("pid", 0))
        return {"agent": os.getpid(), "arena": self._arena_info(),
                "config": {f: getattr(self.inner, f) for f in LAYOUT_FIELDS}}

    def _arena_info(self) -> dict[str, Any] | None:
        shared = self.shared
        return None if shared is None else {"size": shared.capacity, "path": str(shared.path)}

    def _map(self, client: _Client, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if self.shared is None:
            raise InvalidArgumentError("the arena is made at the first save: reserve first")
        return {"arena": self._arena_info()}, [self.shared.fd]

    def _structure(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        sid = str(msg["sid"])
        with self._lock:
            if sid in self._structures:
                return {}
        metas = metas_from_wire(msg["metas"])
        items = [int(x) for x in msg["items"]]
        if len(items) != len(metas):
            raise ProtocolError("a structure needs one item size per tensor")
        plan = self._plans.for_sizes(sid, [m.nbytes for m in metas], items, int(msg["chunk_bytes"]))
        with self._lock:
            if len(self._structures) > 64:
                self._structures.clear()
            self._structures[sid] = (metas, plan.layout)
        return {}

    def _layout(self, sid: Any) -> tuple[tuple[TensorMeta, ...], Layout]:
        with self._lock:
            got = self._structures.get(str(sid))
        if got is None:
            raise ProtocolError(f"unknown structure {sid!r}: send it first")
        return got

    def _reserve(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        _, layout = self._layout(msg["sid"])
        regions = self.engine.reserve(layout)
        if regions is None:
            return {"skip": "the RAM arena is full and the policy said skip"}
        with self._lock:
            if client.alive:
                rid = next(self._ids)
                client.reservations[rid] = regions
                return {"rid": rid, "regions": [[r.offset, r.nbytes] for r in regions], "arena": self._arena_info()}
        self._give_back(regions)
        raise AgentUnavailableError("the client left")

    def _cancel(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            regions = client.reservations.pop(int(msg["rid"]), [])
        self._give_back(regions)
        return {}

    def _give_back(self, regions: list[Region]) -> None:
        """Return regions to the arena (reserved and never published, or pinned by a reader that left)."""
        if not regions:
            return
        engine = self.engine
        arena = engine.ramcache.arena
        with engine.jobs.lock:  # as the engine frees regions
            for r in regions:
                if arena is not None:
                    arena.free(r)
        engine.ramcache.notify()

    def _publish(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        metas, layout = self._layout(msg["sid"])
        staged = staged_from_wire(msg["version"], metas)
        with self._lock:
            regions = client.reservations.pop(int(msg["rid"]), None)
        if regions is None:
            raise ProtocolError(f"unknown reservation {msg['rid']!r}")
        base = RefRecord.model_validate(msg["base"]) if msg.get("base") else None
        record = RefRecord(kind="branch", name=staged.branch, version=staged.version_id, seq=staged.seq)
        assert self.cache is not None
        # Before the engine has it: its commit may then replace ``base`` and nothing else.
        self.cache.catalog.note_move(record, base, msg.get("why") or "save")
        handle = self.engine.adopt(staged, layout, regions)
        tracked = _Tracked(staged.version_id, staged.branch, staged.step, record, base, client.cid, handle)
        with self._lock:
            self._tracked[staged.version_id] = tracked
        self._follow(tracked, float(msg.get("wait_s", 0.0)), staged.created_at)
        return {}

    def _follow(self, t: _Tracked, wait_s: float, created_at: float) -> None:
        """Tell every client what becomes of a published version, level by level."""
        engine = self.engine
        job = engine.jobs.get(t.version)
        if job is not None:
            job.published.add_done_callback(lambda f: self._published(t, f))
        else:  # already through the pipeline
            with contextlib.suppress(TierCacheError):
                self._send_published(t, self.cache.catalog.get(t.version))  # type: ignore[union-attr]
        if self._recorder is not None:
            self._recorder.note_save(t.handle, step=t.step, branch=t.branch, started_at=created_at, wait_s=wait_s)
        for lvl in LEVELS:
            t.handle.future(lvl).add_done_callback(lambda f, lvl=lvl: self._level(t, lvl, f))  # type: ignore[misc]

    def _published(self, t: _Tracked, f: Future[Version]) -> None:
        if f.exception() is None:
            self._send_published(t, f.result())
        else:
            t.published.set()

    def _send_published(self, t: _Tracked, manifest: Version) -> None:
        self.broadcast({"ev": "published", "v": t.version, "manifest": manifest.to_json().decode()})
        t.published.set()

    def _level(self, t: _Tracked, level: str, f: Future[str]) -> None:
        err = f.exception()
        ok = err is None
        if ok:
            t.published.wait(60.0)  # the manifest goes out before the first level that names it
        self._levels[f"{level}:{'ok' if ok else 'failed'}"] += 1
        job = self.engine.jobs.get(t.version)
        event: dict[str, Any] = {"ev": "level", "v": t.version, "level": level, "ok": ok,
                                 "pending": sorted(job.pending) if job is not None else []}
        if not ok:
            event["error"] = error_to_wire(err)  # type: ignore[arg-type]
        if level == "durable" and not ok:
            # As the engine counts it: a version another writer kept off its branch, or one the
            # user's policy dropped, is no loss.
            event["loss"] = not isinstance(err, ConflictError) and not (job is not None and job.dropped)
            assert self.cache is not None
            head = self.cache.catalog.ref("branch", t.branch)
            event["head"] = head.model_dump(mode="json") if head is not None else None
            event["record"] = t.record.model_dump(mode="json")
        if ok and level in TIER_LEVEL.values() and job is not None and job.final is not None \
                and job.manifest is not None and job.final.parent != job.manifest.parent:
            event["manifest"] = job.final.to_json().decode()
        self.broadcast(event)
        if all(t.handle.done(lvl) for lvl in LEVELS):  # type: ignore[arg-type]
            with self._lock:
                self._tracked.pop(t.version, None)

    def _snapshot(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        engine = self.engine
        engine.wait_published()
        assert self.cache is not None
        cat = self.cache.catalog
        with self._lock:
            tracked = list(self._tracked.values())
        in_flight = {t.version for t in tracked}
        versions = []
        for v in cat.all():
            if v.id in in_flight or "ram" in cat.residency(v):
                versions.append(v.to_json().decode())
        moves = [[t.record.model_dump(mode="json"), t.base.model_dump(mode="json") if t.base else None]
                 for t in sorted(tracked, key=lambda t: t.record.seq)]
        pending = {t.version: sorted(engine.pending_tiers(t.version)) for t in tracked}
        refs = [r.model_dump(mode="json") for r in cat.refs().values()]
        return {"versions": versions, "moves": moves, "pending": pending, "refs": refs}

    def _pin(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        ram = self.engine.ram
        key = str(msg["key"])
        got = ram.pin(key) if ram is not None else None
        if got is None:
            return {"missing": True}
        region, length, data = got
        if data is not None:
            return {"data": data.decode("latin-1")}
        assert region is not None
        with self._lock:
            if not client.alive:
                ram.unpin(region)
                raise AgentUnavailableError("the client left")
            pin = next(self._ids)
            client.pins[pin] = region
        self._served["ram"] += length
        return {"pin": pin, "offset": region.offset, "length": length}

    def _unpin(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            region = client.pins.pop(int(msg["pin"]), None)
        ram = self.engine.ram
        if region is not None and ram is not None:
            ram.unpin(region)
        return {}

    def _list(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        ram = self.engine.ram
        return {"keys": ram.list(str(msg.get("prefix", ""))) if ram is not None else []}

    def _get(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        ram = self.engine.ram
        data = ram.get(str(msg["key"])) if ram is not None else None
        return {"missing": True} if data is None else {"data": data.decode("latin-1")}

    def _holds(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.cache is not None
        cat = self.cache.catalog
        ram = self.engine.ram
        versions = {}
        for vid in msg.get("versions", ()):
            try:
                versions[vid] = "ram" in cat.residency(cat.get(str(vid)))
            except TierCacheError:
                versions[vid] = False
        chunks = {cid: ram is not None and ram.size(chunk_key(str(cid))) is not None for cid in msg.get("chunks", ())}
        return {"versions": versions, "chunks": chunks}

    def _flush(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        timeout = msg.get("within")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        if msg.get("mine"):
            with self._lock:
                mine = [t for t in self._tracked.values() if t.owner == client.cid]
            for t in mine:
                for lvl in LEVELS:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    with contextlib.suppress(Exception):
                        t.handle.future(lvl).exception(left)  # type: ignore[arg-type]
            return {}
        self.engine.flush(None if deadline is None else max(0.0, deadline - time.monotonic()), report=False)
        return {}

    def _promote(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.cache is not None
        return {"nbytes": self.cache.promote(str(msg["version"]), to="ram")}

    def _evict(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        return {"nbytes": self.engine.evict_ram(str(c) for c in msg.get("chunks", ()))}

    def _gc(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.cache is not None
        grace = msg.get("grace")
        report = self.cache.gc(dry_run=bool(msg.get("dry_run")), grace=None if grace is None else float(grace))
        return {"report": dataclasses.asdict(report)}

    def _restored(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        for source, n in dict(msg.get("nbytes", {})).items():
            self._restores[str(source)] += 1
            self._restore_bytes[str(source)] += int(n)
        return {}

    def _stats(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """What the agent holds and does: for ``tiercache agent status``, ``stats``, the UI and the metrics."""
        assert self.cache is not None
        engine = self.engine
        arena = engine.ramcache.arena
        with self._lock:
            clients = [{"pid": c.pid, "reservations": len(c.reservations), "pins": len(c.pins)}
                       for c in self._clients.values()]
            tracked = len(self._tracked)
        queues: Counter[str] = Counter()
        for job in engine.jobs.snapshot():
            for name in job.pending:
                queues[name] += 1
        status = self._recorder.current() if self._recorder is not None else None
        return {
            "pid": os.getpid(), "started_at": self.started_at, "socket": str(self.place.socket),
            "cache": self.place.key,
            "metrics": None if self.metrics_address is None else "{}:{}".format(*self.metrics_address),
            "arena": {"path": str(self.shared.path) if self.shared else None,
                      "capacity": arena.capacity if arena is not None else None,
                      "used_bytes": arena.used_bytes if arena is not None else 0},
            "clients": clients, "in_flight": len(engine.pending_jobs()), "tracked": tracked,
            "queues": dict(queues), "levels": dict(self._levels), "restores": dict(self._restores),
            "restore_bytes": dict(self._restore_bytes), "served_bytes": dict(self._served),
            "request_errors": dict(self._errors), "lag": (status or {}).get("lag", {}),
            "cache_stats": self.cache.stats(),
        }

    def _stop_request(self, client: _Client, msg: dict[str, Any]) -> dict[str, Any]:
        timeout = msg.get("within")
        with contextlib.suppress(TimeoutError):
            self.engine.flush(None if timeout is None else float(timeout), report=False)
        return {}

    # ------------------------------------------------------------------ node RAM changes

    def _watch_ram(self, engine: Engine) -> None:
        """Tell clients when node RAM drops chunks (evicted for room), so they stop counting on them."""
        assert self.cache is not None
        catalog = self.cache.catalog
        note = catalog.note_chunks

        def noted(tier: str, ids: Iterable[str], present: bool = True) -> None:
            ids = list(ids)
            note(tier, ids, present)
            if tier == "ram" and not present and ids:
                self.broadcast({"ev": "ram", "chunks": ids, "present": False})

        catalog.note_chunks = noted  # type: ignore[method-assign]

    def ram_versions(self) -> list[Version]:
        """Versions node RAM holds whole."""
        assert self.cache is not None
        cat = self.cache.catalog
        return [v for v in cat.all() if "ram" in cat.residency(v)]


_HANDLERS: dict[str, tuple[Callable[..., Any], bool]] = {
    "hello": (AgentServer._hello, False),
    "map": (AgentServer._map, False),
    "structure": (AgentServer._structure, False),
    "reserve": (AgentServer._reserve, True),
    "cancel": (AgentServer._cancel, False),
    "publish": (AgentServer._publish, False),
    "snapshot": (AgentServer._snapshot, True),
    "pin": (AgentServer._pin, False),
    "unpin": (AgentServer._unpin, False),
    "list": (AgentServer._list, False),
    "get": (AgentServer._get, False),
    "holds": (AgentServer._holds, False),
    "flush": (AgentServer._flush, True),
    "promote": (AgentServer._promote, True),
    "evict": (AgentServer._evict, False),
    "gc": (AgentServer._gc, True),
    "restored": (AgentServer._restored, False),
    "stats": (AgentServer._stats, False),
    "stop": (AgentServer._stop_request, True),
}


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
