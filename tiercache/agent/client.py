"""The trainer side of the agent: connect (starting one if asked), map the arena, ask, follow.

:class:`AgentLink` is one process's connection to the agent of its cache. It answers requests
(:meth:`AgentLink.request`, heartbeat-aware: a busy agent says so every second, a silent one
counts as lost after ``[agent] request_timeout``), maps the shared arena on demand, and keeps
this process's catalog in step with what the agent does: manifests it publishes, tiers it
commits to, chunks node RAM drops, versions it loses. :class:`AgentRamTier` is the RAM tier as a
trainer reads it: chunks lent straight out of the mapping (pinned meanwhile), never copied
through the socket.

Nothing here imports torch: a process that only lists or reads (``tiercache ls``) attaches for
free. Staging, which needs torch, is :mod:`tiercache.agent.saver`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.agent import naming
from tiercache.agent.arena import map_shared
from tiercache.agent.protocol import PROTOCOL_VERSION, Connection, ProtocolError, error_from_wire, peer_credentials
from tiercache.agent.rundir import check_private_dir
from tiercache.config import AgentConfig, CacheConfig, RamConfig
from tiercache.errors import AgentUnavailableError, ConfigError, StorageError
from tiercache.handle import TIER_LEVEL
from tiercache.manifest import RefRecord, TierState, Version
from tiercache.names import CHUNKS, check_key
from tiercache.tiers.base import Buffer, Observer, RefValue, Tier
from tiercache.tiers.ram import copy_bytes, map_in

if TYPE_CHECKING:
    from tiercache.repo import Repo
    from tiercache.repo.catalog import Catalog

log = logging.getLogger("tiercache.agent.client")

#: Fields of the config that shape chunks: the agent and its clients must agree on them.
LAYOUT_FIELDS = ("chunk_bytes", "pack_below", "hash", "allow_pickle")
#: Tables of the config the agent acts on for every client (its arena, policy, tiers, peer copies).
_AGENT_TABLES = ("ram", "disk", "s3", "policy", "peers")
#: Fields of those tables only a trainer reads (it copies into the arena): they may differ.
_TRAINER_FIELDS = frozenset({"ram.copy_threads", "ram.pin_memory"})
_TIER_OF_LEVEL = {lvl: tier for tier, lvl in TIER_LEVEL.items()}
#: Manifests of recent versions kept to apply the agent's level events (a bounded memory).
_KEEP_MANIFESTS = 256

Event = dict[str, Any]


@dataclass
class _Waiter:
    future: Future[tuple[dict[str, Any], list[int]]] = field(default_factory=Future)
    heard: float = field(default_factory=time.monotonic)


def connect(place: naming.AgentPlace, timeout: float = 1.0) -> Connection | None:
    """A connection to the agent at ``place``, or ``None`` if none listens there.

    Raises:
        AgentUnavailableError: If the socket, or the process listening on it, is another user's.
        ConfigError: If the socket's directory is not this user's alone (:mod:`tiercache.agent.rundir`).
    """
    path = place.socket
    check_private_dir(path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if st.st_uid != os.getuid():
        raise AgentUnavailableError(f"agent socket {path} belongs to uid {st.st_uid}, not this user "
                                    f"({os.getuid()}): set [agent] socket to a path of your own")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:  # a socket file left by a dead agent, or one still starting
        sock.close()
        return None
    # Who listens, as the kernel says (the file's owner may be swapped after the check above).
    _pid, uid, _gid = peer_credentials(sock)
    if uid != os.getuid():
        sock.close()
        raise AgentUnavailableError(f"the process listening on {path} runs as uid {uid}, not this user "
                                    f"({os.getuid()}): set [agent] socket to a path of your own")
    sock.settimeout(None)
    return Connection(sock)


def shared_settings(config: CacheConfig) -> dict[str, Any]:
    """The settings every process of a cache and its agent must share, flattened (``"policy.name": ...``).

    The chunk-shaping fields, and the tables the agent acts on for every client (its arena, its
    policy, its tiers, its peer copies), as the agent runs them: no ``[ram]`` table is the default
    one, the disk path is resolved.
    """
    data = config.model_dump(mode="json", include={*LAYOUT_FIELDS, *_AGENT_TABLES})
    data["ram"] = data.get("ram") or RamConfig().model_dump(mode="json")
    if config.disk is not None:
        data["disk"]["path"] = str(config.disk.path.expanduser().resolve())
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif prefix not in _TRAINER_FIELDS:
            flat[prefix] = value

    walk("", data)
    return flat


def listening(path: os.PathLike[str] | str) -> bool:
    """Whether something accepts connections on the Unix socket at ``path`` (an agent that is up)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


class AgentLink:
    """One process's connection to its cache's agent (see the module docstring).

    Args:
        conn: A connection to the agent.
        place: Where the agent lives.
        settings: The ``[agent]`` table.

    Call :meth:`hello` before anything else.
    """

    def __init__(self, conn: Connection, place: naming.AgentPlace, settings: AgentConfig) -> None:
        self._conn = conn
        self.place = place
        self.settings = settings
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiter] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Event], None]] = []
        self._on_lost: list[Callable[[BaseException], None]] = []
        self.lost: BaseException | None = None
        self.agent_pid = 0
        self.arena: dict[str, Any] | None = None
        #: The agent's :func:`shared_settings`.
        self.settings_of_agent: dict[str, Any] = {}
        self._mapping: mmap.mmap | None = None
        self._map_lock = threading.Lock()
        self._populated = threading.Event()
        self._catalog: Catalog | None = None
        self._manifests: OrderedDict[str, Version] = OrderedDict()
        #: Per version in the agent's pipeline: the tiers it is still written to.
        self._pending: dict[str, frozenset[str]] = {}
        self._reader = threading.Thread(target=self._read_loop, name="tiercache-agent-link", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ requests

    def hello(self, cache_key: str) -> None:
        """Introduce this process; learn the agent's pid, arena and chunk-shaping settings.

        Raises:
            AgentUnavailableError: If the agent refuses (another protocol version or cache).
        """
        got = self.request("hello", proto=PROTOCOL_VERSION, pid=os.getpid(), cache=cache_key)
        self.agent_pid = int(got.get("agent", 0))
        self.arena = got.get("arena")
        self.settings_of_agent = dict(got.get("settings", {}))

    def request(self, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its answer (descriptors it carried under ``"_fds"``).

        Args:
            op: The request (see :mod:`tiercache.agent.protocol`).
            timeout: Seconds to wait for the answer at most (``None``: as long as the agent
                keeps saying it is working on it).
            **fields: The request's fields.

        Raises:
            AgentUnavailableError: If the agent is lost (gone, or silent for ``request_timeout``).
            TimeoutError: If ``timeout`` passed while the agent was still working on it.
            TierCacheError: The error the agent answered with.
        """
        if self.lost is not None:
            raise AgentUnavailableError(f"the node agent was lost: {self.lost}")
        rid = next(self._ids)
        waiter = _Waiter()
        with self._lock:
            self._waiting[rid] = waiter
        try:
            try:
                self._conn.send({"op": op, "id": rid, **fields})
            except OSError as e:
                self._lose(e)
                raise AgentUnavailableError(f"the node agent was lost: {e}") from e
            msg, fds = self._await(waiter, op, timeout)
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        if "error" in msg:
            for fd in fds:
                os.close(fd)
            raise error_from_wire(msg["error"])
        if fds:
            msg["_fds"] = fds
        return msg

    def _await(self, waiter: _Waiter, op: str, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
        limit = self.settings.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = limit if deadline is None else max(0.0, min(limit, deadline - time.monotonic()))
            try:
                return waiter.future.result(step)
            except FutureTimeout:
                pass
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"the node agent is still working on {op} after {timeout:g}s")
            if now - waiter.heard >= limit:
                err = AgentUnavailableError(f"the node agent did not answer {op} within {limit:g}s")
                self._lose(err)
                raise err

    def notify(self, op: str, **fields: Any) -> None:
        """Send a request whose answer nobody waits for (``unpin``); a lost agent is no error here."""
        if self.lost is not None:
            return
        try:
            self._conn.send({"op": op, "id": 0, **fields})
        except OSError as e:
            self._lose(e)

    def on_event(self, callback: Callable[[Event], None]) -> None:
        """Call ``callback`` (on the link's thread) with every event the agent sends."""
        self._listeners.append(callback)

    def on_lost(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback`` once if the agent is lost (at once if it is already)."""
        if self.lost is not None:
            callback(self.lost)
            return
        self._on_lost.append(callback)

    def _read_loop(self) -> None:
        err: BaseException = AgentUnavailableError("the node agent closed the connection")
        try:
            for msg, fds in self._conn.messages():
                rid = msg.get("id")
                if rid is None:
                    for fd in fds:
                        os.close(fd)
                    self._event(msg)
                    continue
                with self._lock:
                    waiter = self._waiting.get(rid)
                if waiter is None:
                    for fd in fds:
                        os.close(fd)
                    continue
                if msg.get("wait"):
                    waiter.heard = time.monotonic()
                    continue
                waiter.future.set_result((msg, fds))
        except (OSError, ProtocolError) as e:
            err = e
        self._lose(err)

    def _event(self, msg: Event) -> None:
        for callback in list(self._listeners):
            try:
                callback(msg)
            except Exception:  # a listener's bug must not stop the link
                log.exception("handling agent event %s", msg.get("ev"))

    def _lose(self, err: BaseException) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = err
            waiting = list(self._waiting.values())
        for w in waiting:
            if not w.future.done():
                w.future.set_exception(AgentUnavailableError(f"the node agent was lost: {err}"))
        self._conn.close()
        for callback in self._on_lost:
            try:
                callback(err)
            except Exception:
                log.exception("handling the loss of the agent")

    def close(self) -> None:
        """Close the connection (the agent finishes what this process handed it).

        Says ``bye`` first unless the agent was lost: the agent then gives back at once what
        this process still held (it copies nothing back out of the arena any more).
        """
        self.notify("bye")
        with self._lock:
            if self.lost is None:
                self.lost = AgentUnavailableError("the connection to the agent was closed")
        self._conn.close()
        self._reader.join(5.0)

    # ------------------------------------------------------------------ the arena

    def note_arena(self, info: Mapping[str, Any] | None) -> None:
        """The arena the agent named in an answer (it makes it at the first save when sized ``auto``)."""
        if info is not None:
            self.arena = dict(info)

    def mapping(self) -> mmap.mmap | None:
        """This process's mapping of the agent's arena (made on first use), or ``None`` if there is none yet.

        A new mapping is faulted in on a background thread, so the first save or restore that
        uses it finds it in place (:meth:`wait_populated`).

        Raises:
            AgentUnavailableError: If the agent is lost before the arena is mapped.
        """
        with self._map_lock:
            if self._mapping is None and self.arena is not None:
                got = self.request("map")
                fds = got.get("_fds", [])
                if len(fds) != 1:
                    raise AgentUnavailableError("the node agent did not hand over its arena")
                self.note_arena(got.get("arena"))
                assert self.arena is not None
                self._mapping = map_shared(fds[0], int(self.arena["size"]))
                threading.Thread(target=self._populate, args=(self._mapping,), name="tiercache-agent-map",
                                 daemon=True).start()
            return self._mapping

    def _populate(self, mapping: mmap.mmap) -> None:
        try:
            map_in(mapping)  # the agent's pages, this process's page tables: no copy, no new memory
        except (OSError, ValueError) as e:
            log.debug("pre-faulting the arena mapping failed: %s", e)
        finally:
            self._populated.set()

    def wait_populated(self) -> None:
        """Block until the mapping's page tables are in place (after :meth:`mapping`)."""
        if self._mapping is not None:
            self._populated.wait()

    # ------------------------------------------------------------------ this process's catalog

    def bind(self, repo: Repo) -> None:
        """Make node RAM this process's RAM tier and keep its catalog in step with the agent.

        The catalog learns the versions node RAM holds (a crashed trainer's too) and the moves
        of the versions the agent is still writing, so ``refs()``, ``ls`` and ``restore`` see them.
        """
        self._catalog = repo.catalog
        repo.attach_ram(AgentRamTier(self))
        self.on_event(self._follow)
        snap = self.request("snapshot")
        cat = self._catalog
        for text in snap.get("versions", ()):
            v = Version.from_json(text.encode(), source="node agent")
            self._remember(v)
            cat.add(v, "ram")
        for rec, base in snap.get("moves", ()):
            cat.note_move(RefRecord.model_validate(rec), RefRecord.model_validate(base) if base else None, "save")
        with self._lock:
            for vid, tiers in dict(snap.get("pending", {})).items():
                if tiers:
                    self._pending[vid] = frozenset(tiers)

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers the agent is still writing ``version_id`` to (as its last word said)."""
        with self._lock:
            return self._pending.get(version_id, frozenset())

    def _remember(self, v: Version) -> None:
        with self._lock:
            self._manifests[v.id] = v
            while len(self._manifests) > _KEEP_MANIFESTS:
                self._manifests.popitem(last=False)

    def manifest(self, version_id: str) -> Version | None:
        """The manifest of a recent version the agent published, if this link saw it."""
        with self._lock:
            return self._manifests.get(version_id)

    def _follow(self, msg: Event) -> None:
        cat = self._catalog
        if cat is None or msg.get("part"):  # a rank's part: the group makes the version known
            return
        ev = msg.get("ev")
        vid = str(msg.get("v", ""))
        if ev == "published":
            v = Version.from_json(str(msg["manifest"]).encode(), source="node agent")
            self._remember(v)
            cat.add(v, "ram")
            cat.note_chunks("ram", [c.id for c in v.chunks])
        elif ev == "ram":
            cat.note_chunks("ram", [str(c) for c in msg.get("chunks", ())], bool(msg.get("present")))
        elif ev == "settled":
            with self._lock:
                self._pending.pop(vid, None)
        elif ev == "level":
            with self._lock:
                pending = frozenset(msg.get("pending", ()))
                if pending:
                    self._pending[vid] = pending
                else:
                    self._pending.pop(vid, None)
            tier = _TIER_OF_LEVEL.get(str(msg.get("level")))
            if msg.get("ok") and tier is not None:
                v = Version.from_json(str(msg["manifest"]).encode(), source="node agent") if msg.get("manifest") \
                    else self.manifest(vid)
                if v is not None:
                    self._remember(v)
                    cat.add(v, tier)
                    cat.note_chunks(tier, [c.id for c in v.chunks])
            elif msg.get("level") == "durable" and not msg.get("ok") and msg.get("record"):
                # The version reached no durable tier, or another writer's move kept it off its
                # branch: this process's view follows the agent's.
                cat.retract(RefRecord.model_validate(msg["record"]))
                if msg.get("head"):
                    cat.set_ref(RefRecord.model_validate(msg["head"]))

    # ------------------------------------------------------------------ what node RAM holds

    def holds(self, versions: list[str] = (), chunks: list[str] = ()) -> tuple[dict[str, bool], dict[str, bool]]:  # type: ignore[assignment]
        """Which of ``versions`` node RAM holds whole, and which of ``chunks`` it holds.

        The question a multi-rank restore asks each node's agent before it picks its sources.
        """
        got = self.request("holds", versions=list(versions), chunks=list(chunks))
        return dict(got.get("versions", {})), dict(got.get("chunks", {}))


    def ram_states(self, versions: Sequence[str]) -> dict[str, TierState]:
        """Whether node RAM holds each of ``versions`` (``held``), or why not (see :mod:`tiercache.agent.holdings`).

        What a process that lists versions asks: it has no RAM tier of its own, and a version a
        group saved is in node RAM as its ranks' parts, which no catalog outside the agent knows.
        """
        got = self.request("ram", versions=list(versions))
        reasons = dict(got.get("reasons", {}))
        return {str(vid): TierState(state, reasons.get(state, ""))  # type: ignore[arg-type]
                for vid, state in dict(got.get("states", {})).items()}


class AgentRamTier(Tier):
    """Node RAM as a trainer reads it: chunks lent out of the agent's arena, through this process's mapping.

    Read-only here: only the agent writes node RAM (its engine, promote). Every read pins the
    chunk's region in the agent for as long as it lasts, so the agent never reuses it meanwhile.

    Args:
        link: The connection to the agent.
    """

    name = "ram"
    durable = False
    lends = True
    node_local = True

    def __init__(self, link: AgentLink) -> None:
        self.link = link
        self.capacity = int(link.arena["size"]) if link.arena else None
        self._lock = threading.Lock()
        #: What the agent answered to pins asked ahead (:meth:`lend_ahead`), per key, not yet borrowed.
        self._ahead: dict[str, list[dict[str, Any]]] = {}

    @contextlib.contextmanager
    def lend_ahead(self, keys: Sequence[str]) -> Iterator[None]:
        """Pin the chunks at ``keys`` in one round trip; ``borrow`` then takes them without one.

        What the block did not borrow is unpinned at its end.
        """
        wanted = [k for k in dict.fromkeys(keys) if k.startswith(CHUNKS)]
        got: dict[str, dict[str, Any]] = {}
        if wanted:
            try:
                got = dict(self.link.request("pins", keys=wanted)["pins"])
            except AgentUnavailableError:
                got = {}  # each borrow asks (and fails) on its own
        with self._lock:
            for k, answer in got.items():
                self._ahead.setdefault(k, []).append(answer)
        try:
            yield
        finally:
            with self._lock:
                left = []
                for k, answer in got.items():
                    pending = self._ahead.get(k)
                    if pending is not None and answer in pending:
                        pending.remove(answer)
                        left.append(answer)
                        if not pending:
                            del self._ahead[k]
            for answer in left:
                if "pin" in answer:
                    self.link.notify("unpin", pin=int(answer["pin"]))

    @contextlib.contextmanager
    def borrow(self, key: str) -> Iterator[memoryview | None]:
        """Lend a read-only view of the object at ``key`` (``None`` if node RAM does not hold it)."""
        check_key(key)
        with self._lock:
            pending = self._ahead.get(key)
            got = pending.pop() if pending else None
            if pending is not None and not pending:
                del self._ahead[key]
        if got is None:
            got = self.link.request("pin", key=key)
        if got.get("missing"):
            yield None
            return
        if "data" in got:
            yield memoryview(str(got["data"]).encode("latin-1")).toreadonly()
            return
        pin = int(got["pin"])
        try:
            mapping = self.link.mapping()
            if mapping is None:
                raise AgentUnavailableError("the node agent lent a chunk of an arena it did not hand over")
            offset, length = int(got["offset"]), int(got["length"])
            view = memoryview(mapping)[offset : offset + length]
            try:
                yield view.toreadonly()
            finally:
                view.release()
        finally:
            self.link.notify("unpin", pin=pin)

    def get(self, key: str) -> bytes | None:
        """A copy of the object at ``key`` (``None`` if node RAM does not hold it)."""
        if key.startswith(CHUNKS):
            with self.borrow(key) as view:
                return None if view is None else bytes(view)
        check_key(key)
        got = self.link.request("get", key=key)
        return None if got.get("missing") else str(got["data"]).encode("latin-1")

    def read_into(self, key: str, out: memoryview, offset: int = 0, *, observe: Observer | None = None) -> int | None:
        """Copy bytes ``[offset, offset + len(out))`` of ``key`` into ``out``."""
        with self.borrow(key) as view:
            if view is None:
                return None
            dst = memoryview(out).cast("B")
            src = view[offset : offset + dst.nbytes]
            copy_bytes(dst, src)
            if observe is not None:
                observe(dst[: src.nbytes])
            return src.nbytes

    def size(self, key: str) -> int | None:
        """The object's length (``None`` if node RAM does not hold it)."""
        with self.borrow(key) as view:
            return None if view is None else view.nbytes

    def list(self, prefix: str = "") -> list[str]:
        """The keys node RAM holds that start with ``prefix``."""
        return [str(k) for k in self.link.request("list", prefix=prefix).get("keys", ())]

    def put(self, key: str, data: Buffer, *, sync_name: bool = True) -> None:
        """Refused: only the agent writes node RAM."""
        raise StorageError(f"cannot write {key} to node RAM from a trainer: the node agent writes it")

    def delete(self, key: str) -> None:
        """Refused: only the agent drops objects from node RAM (``cache.evict(ref, "ram")`` asks it)."""
        raise StorageError(f"cannot delete {key} from node RAM from a trainer: the node agent does")

    def read_ref(self, key: str) -> RefValue | None:
        """Refs are never kept in node RAM."""
        return None

    def write_ref(self, key: str, data: bytes, *, expect: str | None) -> str:
        """Refused: refs live on the durable tiers."""
        raise StorageError(f"cannot write ref {key} to node RAM")

    def delete_ref(self, key: str, *, expect: str) -> None:
        """Refused: refs live on the durable tiers."""
        raise StorageError(f"cannot delete ref {key} from node RAM")

    def used_bytes(self) -> int:
        """Bytes of the arena in use (as the agent counts them)."""
        return int(self.link.request("stats").get("arena", {}).get("used_bytes", 0))


def attach(config: CacheConfig, repo: Repo | None, *, start: bool) -> AgentLink | None:
    """Connect to the agent of ``config``'s cache (starting one if ``start`` and none runs).

    With ``repo``, node RAM becomes its RAM tier and its catalog follows the agent
    (:meth:`AgentLink.bind`).

    Returns:
        The link, or ``None`` if no agent runs and none was to be started.

    Raises:
        AgentUnavailableError: If the agent refused this process, uses other chunk settings, or
            could not be started (the message says why).
    """
    place = naming.place(config)
    settings = config.agent
    assert settings is not None
    conn = connect(place, settings.connect_timeout)
    if conn is None and start:
        from tiercache.agent.lifecycle import start_detached

        conn = start_detached(config, place, lambda: connect(place, settings.connect_timeout))
    if conn is None:
        return None
    link = AgentLink(conn, place, settings)
    try:
        link.hello(naming.cache_key(config))
        if repo is not None:
            theirs, mine = link.settings_of_agent, shared_settings(config)
            differ = [f"{k} = {theirs.get(k)!r} (here {mine.get(k)!r})" for k in sorted(theirs.keys() | mine.keys())
                      if theirs.get(k) != mine.get(k)]
            if differ:
                raise AgentUnavailableError(
                    f"the node agent at {place.socket} runs this cache with other settings: {', '.join(differ)}: "
                    "give every process of the cache the same settings, or this one an [agent] socket of its own")
            link.bind(repo)
    except BaseException:
        link.close()
        raise
    return link


def call(config: CacheConfig, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
    """Ask the running agent of ``config``'s cache one thing (``tiercache agent status``/``stop``).

    Raises:
        AgentUnavailableError: If no agent runs for the cache.
        ConfigError: If the config has no ``[agent]`` table.
    """
    if config.agent is None:
        raise ConfigError("no [agent] table in the config: add one (an empty [agent] table will do)")
    link = attach(config, None, start=False)
    if link is None:
        raise AgentUnavailableError(f"no agent runs for this cache (socket {naming.place(config).socket})")
    try:
        return link.request(op, timeout=timeout, **fields)
    finally:
        link.close()


__all__ = ["AgentLink", "AgentRamTier", "attach", "call", "connect", "listening"]
