"""What the agent does for each request of a trainer, and what it tells every trainer it is connected to.

:class:`Requests` answers the requests of :mod:`tiercache.agent.protocol` (one method per request,
:data:`HANDLERS` maps names to them), keeps the connected clients and what they hold, and follows
each published version level by level, broadcasting events. The server
(:class:`~tiercache.agent.server.AgentServer`, see :mod:`tiercache.agent.server`) owns the
process, the socket, the threads and what lives as long as the process (the cache, the shared
arena, the status recorder, the peer port); it makes one :class:`Requests` once the cache is
open, hands it each connection (:meth:`Requests.connect`, :meth:`Requests.disconnect`) and each
request (:meth:`Requests.handler`), and tells it the little it needs to ask back through
:class:`Host`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from tiercache.agent.arena import SharedArena, free_bytes
from tiercache.agent.client import shared_settings
from tiercache.agent.committer import Calls, TrainerCommitter, trainer_left
from tiercache.agent.holdings import Holdings
from tiercache.agent.keep import LIMIT, KeptParts
from tiercache.agent.naming import AgentPlace
from tiercache.agent.peering import PeerPort, copy_request, port_request
from tiercache.agent.protocol import (
    PROTOCOL_VERSION,
    Connection,
    ProtocolError,
    error_to_wire,
    metas_from_wire,
    peer_credentials,
    staged_from_wire,
)
from tiercache.cache import TierCache, core_of
from tiercache.config import MIN_CHUNK_BYTES, CacheConfig
from tiercache.errors import (
    AgentUnavailableError,
    ConflictError,
    GroupBrokenError,
    InvalidArgumentError,
    SkippedError,
    TierCacheError,
    TierFullError,
)
from tiercache.format import TensorMeta
from tiercache.group.copies import PeerFiles
from tiercache.handle import LEVELS, TIER_LEVEL, SaveHandle
from tiercache.layout import Layout
from tiercache.manifest import RefRecord, Version
from tiercache.names import chunk_key
from tiercache.pipeline.engine import Engine
from tiercache.pipeline.staging import PlanCache
from tiercache.runtime import AgentStats, ArenaStats, ClientStats, OrphanedVersion, PartCounts, PeerBytes
from tiercache.saver import absent_levels
from tiercache.status import StatusRecorder
from tiercache.tiers.ram import Region

log = logging.getLogger("tiercache.agent.requests")

#: How long a question for orphans waits for the parts of a trainer that just died to fail.
_ORPHAN_WAIT_S = 30.0
#: How many restore sources (tier names) the agent counts; more from a client are ignored.
_MAX_RESTORE_SOURCES = 8


@dataclasses.dataclass
class Client:
    """One connected trainer process."""

    cid: int
    conn: Connection
    pid: int = 0
    #: The process at the other end, as the kernel says (``SO_PEERCRED``), and when it started.
    peer: tuple[int, str] | None = None
    #: It said ``bye``: it closes its cache and copies nothing back out of the arena any more.
    leaving: bool = False
    reservations: dict[int, list[Region]] = dataclasses.field(default_factory=dict)
    pins: dict[int, Region] = dataclasses.field(default_factory=dict)
    #: The regions of each version it published, kept as it copied them until it says it no
    #: longer needs them (see :meth:`Requests._release`).
    held: dict[str, list[Region]] = dataclasses.field(default_factory=dict)
    alive: bool = True
    #: Versions (or parts) it published: a client that saves is a trainer, one that never does a viewer.
    saves: int = 0
    #: What the engine asks this trainer about the parts of group versions it published.
    calls: Calls = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.calls = Calls(self.send)

    def send(self, msg: Mapping[str, Any]) -> None:
        """Send a message; a client that went away is marked dead, never an error."""
        if not self.alive:
            return
        try:
            self.conn.send(msg)
        except OSError:
            self.alive = False


@dataclasses.dataclass
class Tracked:
    """A version published through the agent, until every level of it is settled."""

    version: str
    branch: str
    step: int
    record: RefRecord
    base: RefRecord | None
    owner: int
    handle: SaveHandle
    #: The rank, for one rank's part of a group version (the group commits it through its
    #: trainer): only that trainer hears of it, and it is no version of node RAM's until the
    #: group commits it.
    part: int | None = None
    #: For a part: what a restarted group needs to adopt it (see :meth:`Requests._orphan`), and
    #: its manifest once hashed (``hashed``: the engine's future of it).
    adopt: dict[str, Any] | None = None
    manifest: Version | None = None
    hashed: Future[Version] | None = None
    #: Set once the manifest went out (or never will): level events wait until then, so every
    #: client hears of a version in order (the manifest, then its levels as they happened).
    published: bool = False
    #: Level events that came before the manifest, sent right after it.
    held: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Host(Protocol):
    """What the request handlers ask of the server that owns them, read when needed."""

    @property
    def shared(self) -> SharedArena | None:
        """The shared arena, once the first save (or an explicit capacity) made it."""

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where the metrics endpoint listens, if it does."""


class Requests:
    """The request handlers of the agent, owned and called by :class:`~tiercache.agent.server.AgentServer`.

    Args:
        cache: The agent's cache (open, with its engine over the shared arena).
        place: Where the agent lives (its cache's key, socket, shm directory).
        inner: The config of ``cache`` (the agent's config without its ``[agent]`` table).
        host: The server, for what only it knows (the arena, the metrics address).
        recorder: The status the agent publishes for viewers, or ``None``.
        peers: Where this agent takes and sends the peer copies of its ranks' group versions.
        started_at: Unix time the agent started.
    """

    def __init__(self, cache: TierCache, place: AgentPlace, inner: CacheConfig, host: Host, *,
                 recorder: StatusRecorder | None, peers: PeerPort, started_at: float) -> None:
        self.cache = cache
        #: What the handlers use of the cache past its public API (docs/design.md section 1).
        self.core = core_of(cache)
        self.place = place
        self.inner = inner
        self.started_at = started_at
        self._host = host
        self._recorder = recorder
        self._peers = peers
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._clients: dict[int, Client] = {}
        self._structures: dict[str, tuple[tuple[TensorMeta, ...], Layout]] = {}
        self._plans = PlanCache(inner.pack_below)
        self._tracked: dict[str, Tracked] = {}
        #: Regions of trainers that left alive, each until its process exits (see :meth:`disconnect`).
        self._parked: list[tuple[tuple[int, str], list[Region]]] = []
        #: Parts of group versions whose trainer died before the group committed them (see :meth:`_orphan`).
        self._orphans = KeptParts()
        #: What node RAM took of each version, for ``ls`` in other processes.
        self._holdings = Holdings(started_at)
        #: Recent group versions whose first part was noted for the durability lag.
        self._group_versions: OrderedDict[str, None] = OrderedDict()
        self._levels: Counter[str] = Counter()
        self._restores: Counter[str] = Counter()
        self._restore_bytes: Counter[str] = Counter()
        self._served: Counter[str] = Counter()  # bytes of node RAM lent to readers
        self._errors: Counter[str] = Counter()
        #: Unix time the last connected trainer that saved here left (a restart may follow), or ``None``.
        self._trainer_left_at: float | None = None
        self._watch_ram()

    @property
    def shared(self) -> SharedArena | None:
        """The shared arena (the server's), or ``None`` before it is made."""
        return self._host.shared

    # ------------------------------------------------------------------ what the server calls

    def handler(self, op: str) -> tuple[Callable[[Client, dict[str, Any]], Any], bool] | None:
        """The handler of request ``op`` and whether it may take a while, or ``None`` for no such request."""
        got = HANDLERS.get(op)
        return None if got is None else (functools.partial(got[0], self), got[1])

    def note_error(self, err: BaseException) -> None:
        """Count a request answered with ``err`` (``request_errors`` in :meth:`stats`)."""
        with self._lock:
            self._errors[type(err).__name__] += 1

    def connect(self, conn: Connection) -> Client:
        """A new connection: its client, known from now on."""
        with self._lock:
            client = Client(next(self._ids), conn, peer=_peer_process(conn))
            self._clients[client.cid] = client
        return client

    def disconnect(self, client: Client) -> int:
        """A client went away: what it reserved and did not publish, and what it was reading, go back.

        Returns:
            How many unpublished reservations it left.
        """
        client.alive = False
        with self._lock:
            self._clients.pop(client.cid, None)
            if client.saves and not any(c.saves for c in self._clients.values()):
                self._trainer_left_at = time.time()  # the node's last trainer: a restart's clock starts
            reservations, client.reservations = list(client.reservations.values()), {}
            pins, client.pins = list(client.pins.values()), {}
            held, client.held = list(client.held.values()), {}
        # Its parts of group versions fail here (nothing waits for it), once it is known gone: a
        # part hashed whole is kept for the restarted group to adopt (:meth:`_orphan`).
        client.calls.close(trainer_left(client.pid))
        own = [r for regions in reservations + held for r in regions]
        if own and not client.leaving and client.peer is not None and _running(client.peer):
            # Gone without ``bye`` while its process runs on: it may count this agent lost and
            # copy those versions back out of the arena itself (or it is exiting): their regions
            # stay as they are until it exits.
            log.info("client pid %d left %d version(s) it may still copy out of the arena: their %d region(s) stay "
                     "until it exits", client.peer[0], len(reservations) + len(held), len(own))
            with self._lock:
                self._parked.append((client.peer, own))
            self._give_back(pins)
            return 0
        self._give_back(own + pins)
        return len(reservations)

    def sweep(self) -> None:
        """Give back the regions parked for trainers that left (see :meth:`disconnect`) once they exited."""
        with self._lock:
            parked = list(self._parked)
        gone = [(peer, regions) for peer, regions in parked if not _running(peer)]
        if not gone:
            return
        with self._lock:
            self._parked = [p for p in self._parked if p not in gone]
        self._give_back([r for _, regions in gone for r in regions])

    def clients(self) -> list[Client]:
        """The connected clients."""
        with self._lock:
            return list(self._clients.values())

    def busy(self) -> bool:
        """Whether a client is connected or a version is still being written (the agent must not exit idle)."""
        with self._lock:
            return bool(self._clients) or bool(self._tracked) or bool(self.engine.pending_jobs())

    # ------------------------------------------------------------------ requests

    @property
    def engine(self) -> Engine:
        """The engine of the agent's cache."""
        engine = self.core.saver.local  # the agent's cache saves in process: its engine is made with it
        assert isinstance(engine, Engine)
        return engine

    def broadcast(self, msg: Mapping[str, Any]) -> None:
        """Send an event to every client."""
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
            c.send(msg)

    def _tell(self, t: Tracked, msg: Mapping[str, Any]) -> None:
        """Send an event about a version: to every client, or about a part only to its trainer."""
        if t.part is None:
            self.broadcast(msg)
            return
        with self._lock:
            owner = self._clients.get(t.owner)
        if owner is not None:
            owner.send({**msg, "part": True})

    def _hello(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("proto") != PROTOCOL_VERSION:
            raise AgentUnavailableError(f"protocol {msg.get('proto')} is not this agent's ({PROTOCOL_VERSION}): "
                                        "run the same tiercache version in the trainer and the agent")
        if msg.get("cache") != self.place.key:
            raise AgentUnavailableError(f"this agent serves cache {self.place.key}, not {msg.get('cache')}")
        client.pid = int(msg.get("pid", 0))
        return {"agent": os.getpid(), "arena": self._arena_info(),
                "settings": shared_settings(self.inner)}

    def _arena_info(self) -> dict[str, Any] | None:
        shared = self.shared
        return None if shared is None else {"size": shared.capacity, "path": str(shared.path)}

    def _map(self, client: Client, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if self.shared is None:
            raise InvalidArgumentError("the arena is made at the first save: reserve first")
        return {"arena": self._arena_info()}, [self.shared.fd]

    def _structure(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        sid = str(msg["sid"])
        with self._lock:
            if sid in self._structures:
                return {}
        metas = metas_from_wire(msg["metas"])
        items = [int(x) for x in msg["items"]]
        if len(items) != len(metas):
            raise ProtocolError("a structure needs one item size per tensor")
        chunk_bytes = int(msg["chunk_bytes"])
        # Every size is checked before anything is planned: the plan loops over chunks and slices.
        if chunk_bytes < MIN_CHUNK_BYTES or chunk_bytes % 4096:
            raise InvalidArgumentError(f"chunk_bytes {chunk_bytes} is not a multiple of 4096 of at least "
                                       f"{MIN_CHUNK_BYTES}")
        if any(not 1 <= n <= 16 for n in items):
            raise InvalidArgumentError("an item size must be 1 to 16 bytes")
        sizes = [m.nbytes for m in metas]
        if any(n < 0 for n in sizes) or any(d < 0 for m in metas for d in m.shape):
            raise InvalidArgumentError("a tensor's size and shape cannot be negative")
        self._check_room("a version", sum(sizes))
        plan = self._plans.for_sizes(sid, sizes, items, chunk_bytes)
        with self._lock:
            if len(self._structures) > 64:
                self._structures.clear()
            self._structures[sid] = (metas, plan.layout)
        return {}

    def _check_room(self, what: str, nbytes: int) -> None:
        """Refuse a request for more bytes of the arena than it has, or could ever have.

        Raises:
            TierFullError: One line naming the bytes asked for and the arena's size.
        """
        capacity = self.engine.ramcache.capacity
        if capacity is None:  # "auto": the first save sizes it to two versions, within the room there is
            free = free_bytes(self.place.shm_dir) or 0
            if 2 * nbytes > free:
                raise TierFullError(f"{what} needs {nbytes} bytes of RAM arena but ram.capacity is 'auto' (two "
                                    f"versions) and {self.place.shm_dir} has {free} bytes free: set ram.capacity")
        elif nbytes > capacity:
            raise TierFullError(f"{what} needs {nbytes} bytes of RAM arena but ram.capacity is {capacity}: "
                                "raise ram.capacity")

    def _layout(self, sid: Any) -> tuple[tuple[TensorMeta, ...], Layout]:
        with self._lock:
            got = self._structures.get(str(sid))
        if got is None:
            raise ProtocolError(f"unknown structure {sid!r}: send it first")
        return got

    def _reserve(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        _, layout = self._layout(msg["sid"])
        self._orphans.make_room(layout.staged_bytes, self.engine.ramcache)  # never wait for room parts keep
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

    def _cancel(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            regions = client.reservations.pop(int(msg["rid"]), [])
        self._give_back(regions)
        return {}

    def _bye(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        """The client closes its cache: what it still holds goes back when it leaves (see :meth:`disconnect`)."""
        client.leaving = True
        return {}

    def _release(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        """The trainer no longer needs the bytes of a version it published as it copied them.

        From its publish on, a version's regions are the engine's: a chunk it holds already is
        freed at once (dedup), and the rest once the disk has the version; the next reservation
        may then reuse them. Yet the trainer copies a version back out of the arena and saves
        it itself if this agent dies first, so each region keeps one more reference
        (:meth:`Arena.retain`) until the trainer says ``release``: once it heard the version is
        on the disk (it then never copies it back), or once the version settled. A trainer
        that leaves gives its references back with it (:meth:`disconnect`).
        """
        with self._lock:
            regions = client.held.pop(str(msg["v"]), [])
        self._give_back(regions)
        return {}

    def _hold(self, client: Client, key: str, regions: list[Region]) -> None:
        """Keep ``regions`` as the trainer copied them until it releases version ``key`` (see :meth:`_release`)."""
        engine = self.engine
        arena = engine.ramcache.arena
        if arena is None:
            return
        with engine.jobs.lock:  # as the engine frees regions
            for r in regions:
                arena.retain(r)
        with self._lock:
            gone = not client.alive
            if not gone:
                client.held.setdefault(key, []).extend(regions)
        if gone:  # it left meanwhile: nobody will release them
            self._give_back(regions)

    def _give_back(self, regions: list[Region]) -> None:
        """Return regions to the arena (reserved and never published, pinned by a reader that left, or held)."""
        if not regions:
            return
        engine = self.engine
        arena = engine.ramcache.arena
        with engine.jobs.lock:  # as the engine frees regions
            for r in regions:
                if arena is not None:
                    arena.free(r)
        engine.ramcache.notify()

    def _publish(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        part = _rank_in_group(msg)  # before the reservation is taken: a refusal leaves it to the client
        metas, layout = self._layout(msg["sid"])
        staged = staged_from_wire(msg["version"], metas)
        with self._lock:
            regions = client.reservations.pop(int(msg["rid"]), None)
        if regions is None:
            raise ProtocolError(f"unknown reservation {msg['rid']!r}")
        client.saves += 1
        self._hold(client, staged.version_id, regions)  # before the engine may free any of them
        try:
            base = RefRecord.model_validate(msg["base"]) if msg.get("base") else None
            record = RefRecord(kind="branch", name=staged.branch, version=staged.version_id, seq=staged.seq)
            if part is None:
                # Before the engine has it: its commit may then replace ``base`` and nothing else.
                self.core.catalog.note_move(record, base, msg.get("why") or "save")
                handle = self.engine.adopt(staged, layout, regions)
            else:  # the group moves the branch, through the trainers
                committer = TrainerCommitter(client.calls, staged.version_id, part, msg["world"])
                handle = self.engine.adopt(staged, layout, regions, committer)  # (which has it follow the part)
        except BaseException:
            # The engine never took them (unless it raised once it had): the trainer saves the
            # version itself, copying it out; the hold keeps them as they are until it releases it.
            if self.engine.jobs.get(staged.version_id) is None:
                self._give_back(regions)
            raise
        if part is not None:  # saved again: adopted by the restarted group (its chunks are this part's now)
            self._orphans.take(staged.version_id, self.engine.ramcache)
        tracked = Tracked(staged.version_id, staged.branch, staged.step, record, base, client.cid, handle,
                          part=part)
        if part is not None:
            tracked.adopt = {"v": staged.version_id.rsplit(".", 1)[0], "rank": part, "world": msg["world"],
                             "branch": staged.branch, "step": staged.step, "created_at": staged.created_at,
                             "meta": staged.meta}
        with self._lock:
            self._tracked[staged.version_id] = tracked
        self._follow(tracked, float(msg.get("wait_s", 0.0)), staged.created_at)
        return {}

    def _follow(self, t: Tracked, wait_s: float, created_at: float) -> None:
        """Tell every client what becomes of a published version, level by level."""
        engine = self.engine
        job = engine.jobs.get(t.version)
        if job is not None:
            t.hashed = job.published
            job.published.add_done_callback(lambda f: self._published(t, f))
        else:  # already through the pipeline
            try:
                manifest = self.core.catalog.get(t.version)
            except TierCacheError:
                manifest = None
            self._send_published(t, manifest)
        if self._recorder is not None:
            handle: SaveHandle | None = t.handle
            if t.adopt is not None:
                # A part's levels are its group's (they follow the group's verdicts): the first
                # part of a version here stands for the version in the durability lag.
                vid = str(t.adopt["v"])
                with self._lock:
                    first = vid not in self._group_versions
                    self._group_versions[vid] = None
                    while len(self._group_versions) > LIMIT:
                        self._group_versions.popitem(last=False)
                handle = SaveHandle(vid, {lvl: t.handle.future(lvl) for lvl in LEVELS}) if first else None
            if handle is not None:
                self._recorder.note_save(handle, step=t.step, branch=t.branch, started_at=created_at, wait_s=wait_s)
        for lvl in LEVELS:
            t.handle.future(lvl).add_done_callback(lambda f, lvl=lvl: self._level(t, lvl, f))  # type: ignore[misc]

    def _published(self, t: Tracked, f: Future[Version]) -> None:
        manifest = f.result() if f.exception() is None else None
        t.manifest = manifest
        if manifest is not None and t.adopt is None:
            self._holdings.note(t.version, None)
        elif manifest is not None and t.part is not None:
            self._holdings.note(str(t.adopt["v"]), t.part, (c.id for c in manifest.chunks))
        self._send_published(t, manifest)

    def _send_published(self, t: Tracked, manifest: Version | None) -> None:
        """Send the manifest (if there is one), then the level events that waited for it, in order."""
        with t.lock:
            if manifest is not None:
                self._tell(t, {"ev": "published", "v": t.version, "manifest": manifest.to_json().decode()})
            t.published = True
            for event in t.held:
                self._tell(t, event)
            t.held.clear()

    def _level(self, t: Tracked, level: str, f: Future[str]) -> None:
        err = f.exception()
        ok = err is None
        # A level this cache has no tier for is no level of its (no counter); a skip (the
        # policy's, or the group's on a part) is not a failure.
        if level not in absent_levels(self.core.repo.durable):
            self._levels[f"{level}:{'ok' if ok else 'skipped' if isinstance(err, SkippedError) else 'failed'}"] += 1
        job = self.engine.jobs.get(t.version)
        done_tier = next((tier for tier, lvl in TIER_LEVEL.items() if lvl == level), None)
        pending = sorted(n for n in job.pending if n != done_tier) if job is not None else []
        event: dict[str, Any] = {"ev": "level", "v": t.version, "level": level, "ok": ok, "pending": pending}
        if not ok:
            event["error"] = error_to_wire(err)  # type: ignore[arg-type]
        if level == "durable" and not ok and t.part is not None:
            self._orphan(t, err)
        if level == "durable" and ok:  # kept parts of its branch up to its step can never be adopted now
            self._orphans.release(lambda o: o["branch"] == t.branch and int(o["step"]) <= t.step,
                                  f"step {t.step} of its branch was committed since", self.engine.ramcache,
                                  committed=[t.adopt["v"] if t.adopt is not None else t.version])
        if level == "durable" and not ok and t.part is None:
            # As the engine counts it: a version another writer kept off its branch, or one the
            # user's policy dropped, is no loss.
            event["loss"] = not isinstance(err, ConflictError) and not (job is not None and job.dropped)
            head = self.core.catalog.ref("branch", t.branch)
            event["head"] = head.model_dump(mode="json") if head is not None else None
            event["record"] = t.record.model_dump(mode="json")
        if ok and level in TIER_LEVEL.values() and job is not None and job.final is not None \
                and job.manifest is not None and job.final.parent != job.manifest.parent:
            event["manifest"] = job.final.to_json().decode()
        self._send_level(t, event)
        if all(t.handle.done(lvl) for lvl in LEVELS):
            with self._lock:
                last = self._tracked.pop(t.version, None) is not None
            if last:
                threading.Thread(target=self._settled, args=(t,), daemon=True,
                                 name="tiercache-agent-settle").start()

    def _orphan(self, t: Tracked, err: BaseException | None) -> None:
        """Keep a part that failed because a trainer died, for a restarted group to adopt (see :mod:`.keep`).

        Only a part that was hashed whole (its chunks are in node RAM: a trainer's death never
        stops that, see :mod:`tiercache.agent.committer`), whose own trainer is gone, or whose
        group broke (another rank died: the job is restarted, and the version is whole if every
        rank's part is somewhere). A part the group failed for any other reason stays failed:
        the group's word on it stands, and its trainer's handle said so.
        """
        with self._lock:
            gone = t.owner not in self._clients or isinstance(err, GroupBrokenError)
        manifest = t.manifest
        if manifest is None and t.hashed is not None and t.hashed.done() and t.hashed.exception() is None:
            manifest = t.hashed.result()  # (its callback that notes it on ``t`` may not have run yet)
        if t.adopt is None or manifest is None or not gone:
            return
        self._orphans.keep(t.version, t.adopt, manifest, self.engine.ramcache)

    def _orphans_request(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        rank = msg.get("rank")
        ram = self.engine.ramcache
        if msg.get("release"):  # a restarted group found these versions incomplete: never adoptable
            gone = {str(v) for v in msg["release"]}
            self._orphans.release(lambda o: o["v"] in gone, str(msg.get("why") or "its group let it go"), ram)
            return {}
        # Parts whose trainer just died may still be failing (their writers learn it one by one):
        # a restarted trainer asking right away must find them.
        with self._lock:
            settling = [t for t in self._tracked.values() if t.part is not None and t.owner not in self._clients]
        deadline = time.monotonic() + _ORPHAN_WAIT_S  # for all of them together
        for t in settling:
            err: BaseException | None = None
            with contextlib.suppress(Exception):
                err = t.handle.future("durable").exception(max(0.0, deadline - time.monotonic()))
            self._orphan(t, err)
        branch, head_step = msg.get("branch"), msg.get("head_step")
        if branch is not None and head_step is not None:  # older than the branch's committed head
            self._orphans.release(lambda o: o["branch"] == branch and int(o["step"]) <= int(head_step),
                                  f"the head of its branch is at step {int(head_step)}", ram,
                                  committed=[str(msg["head"])] if msg.get("head") else [])
        return {"orphans": self._orphans.offered(None if rank is None else int(rank))}

    def _send_level(self, t: Tracked, event: dict[str, Any]) -> None:
        """Broadcast a level event; one that comes before the manifest waits for it.

        Never blocks: ``staged`` is reached inside the publish request, long before the version
        is hashed and its manifest exists, and the trainer waits for that request's answer. The
        engine settles ``published`` on every path (the manifest, or the error that stopped it).
        """
        with t.lock:
            if not t.published:
                t.held.append(event)
                return
            self._tell(t, event)

    def _settled(self, t: Tracked) -> None:
        """Once the engine is done with a version (its regions back, its chunks unpinned), say so."""
        self.engine.wait_job(t.version)
        self._tell(t, {"ev": "settled", "v": t.version})

    def _snapshot(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        engine = self.engine
        engine.wait_published()
        cat = self.core.catalog
        with self._lock:
            tracked = [t for t in self._tracked.values() if t.part is None]
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

    def _pin(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        return self._pin_one(client, str(msg["key"]))

    def _pins(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_pin` for many keys in one round trip (a restore pins its version's chunks ahead)."""
        return {"pins": {str(k): self._pin_one(client, str(k)) for k in msg.get("keys", ())}}

    def _pin_one(self, client: Client, key: str) -> dict[str, Any]:
        ram = self.engine.ram
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

    def _unpin(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            region = client.pins.pop(int(msg["pin"]), None)
        ram = self.engine.ram
        if region is not None and ram is not None:
            ram.unpin(region)
        return {}

    def _list(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        ram = self.engine.ram
        return {"keys": ram.list(str(msg.get("prefix", ""))) if ram is not None else []}

    def _get(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        ram = self.engine.ram
        data = ram.get(str(msg["key"])) if ram is not None else None
        return {"missing": True} if data is None else {"data": data.decode("latin-1")}

    def _holds(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        cat = self.core.catalog
        ram = self.engine.ram
        versions = {}
        for vid in msg.get("versions", ()):
            try:
                versions[vid] = "ram" in cat.residency(cat.get(str(vid)))
            except TierCacheError:
                versions[vid] = False
        chunks = {cid: ram is not None and ram.size(chunk_key(str(cid))) is not None for cid in msg.get("chunks", ())}
        return {"versions": versions, "chunks": chunks}

    def _ram(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        ram = self.engine.ram
        states, reasons = self._holdings.states((str(v) for v in msg.get("versions", ())), self.core.catalog,
                                                lambda c: ram is not None and ram.size(chunk_key(c)) is not None)
        return {"states": states, "reasons": reasons}

    def _flush(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        timeout = msg.get("within")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        if msg.get("mine"):
            with self._lock:
                mine = [t for t in self._tracked.values() if t.owner == client.cid]
            for t in mine:
                for lvl in LEVELS:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    with contextlib.suppress(Exception):
                        t.handle.future(lvl).exception(left)
            return {}
        self.engine.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return {}

    def _promote(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        return {"nbytes": self.cache.promote(str(msg["version"]), to="ram")}

    def _keep(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        chunks = [(str(c), int(n)) for c, n in msg.get("chunks", ())]
        if any(n < 0 for _, n in chunks):
            raise InvalidArgumentError("a chunk's size cannot be negative")
        self._check_room("keeping these chunks", sum(n for _, n in chunks))
        return {"nbytes": self.core.keep_in_ram(chunks, str(msg["hash_algo"]))}

    def _evict(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        return {"nbytes": self.engine.evict_ram(str(c) for c in msg.get("chunks", ()))}

    def _gc(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        # Trainers move refs themselves (rollback, branch, tag): read what the tiers hold now.
        for name in self.core.repo.durable:
            self.core.catalog.reload(name)
        grace = msg.get("grace")
        report = self.cache.gc(dry_run=bool(msg.get("dry_run")), grace=None if grace is None else float(grace))
        return {"report": dataclasses.asdict(report)}

    def _answer_call(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        client.calls.answer(int(msg["n"]), msg.get("result"), msg.get("error"))
        return {}

    def _peer_port(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        return {"endpoint": list(self._peers.endpoint(**port_request(msg)))}

    def _peer_copy(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        """One rank's moves of a version's peer copies, agent to agent (:mod:`tiercache.agent.peering`)."""
        args = copy_request(msg)  # every field checked first
        files = PeerFiles(self.core, str(msg["tier"]), str(msg["vid"]))
        self._peers.copy(**args, files=files, threads=self.cache.config.io_threads)
        return {}

    def _restored(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        for source, n in dict(msg.get("nbytes", {})).items():
            # A source is a tier name: a client (a bug, or a stranger's code run as the user) must
            # not grow the counters, or the metrics' labels, without bound.
            if str(source) not in self._restores and len(self._restores) >= _MAX_RESTORE_SOURCES:
                continue
            self._restores[str(source)] += 1
            self._restore_bytes[str(source)] += max(0, int(n))
        seconds, began = msg.get("seconds"), msg.get("began")
        if (self._recorder is None or not isinstance(seconds, int | float) or not isinstance(began, int | float)
                or seconds < 0):
            return {}
        now = time.time()
        self._recorder.note_restore(float(seconds), at=now)
        with self._lock:
            left, self._trainer_left_at = self._trainer_left_at, None
            saving = any(c.saves for c in self._clients.values())
        if left is not None and not saving and began >= left:
            # Every trainer that saved here had left, and a new one restores: the job restarted.
            self._recorder.note_restart(float(began) - left, at=now)
        return {}

    def _stats(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        return self.stats().to_json()

    def stats(self) -> AgentStats:
        """What the agent holds and does: for ``tiercache agent status``, ``stats``, the UI and the metrics.

        Cheap enough for every scrape: nothing here lists a tier (``meter`` is what the agent
        observed writing and reading, ``lag`` what its status recorder computes).
        """
        engine = self.engine
        arena = engine.ramcache.arena
        with self._lock:
            clients = [ClientStats(pid=c.pid, reservations=len(c.reservations), pins=len(c.pins), saves=c.saves)
                       for c in self._clients.values()]
            tracked = len(self._tracked)
            parts = PartCounts(in_flight=sum(t.part is not None for t in self._tracked.values()),
                               orphaned=len(self._orphans))
        shared, address = self.shared, self._host.metrics_address
        queues: Counter[str] = Counter()
        for job in engine.jobs.snapshot():
            for name in job.pending:
                queues[name] += 1
        lag = self._recorder.lag() if self._recorder is not None else {}
        return AgentStats(
            pid=os.getpid(), started_at=self.started_at, socket=str(self.place.socket), cache=self.place.key,
            metrics=None if address is None else "{}:{}".format(*address),
            arena=ArenaStats(path=str(shared.path) if shared else None,
                             capacity=arena.capacity if arena is not None else None,
                             used_bytes=arena.used_bytes if arena is not None else 0),
            clients=clients, in_flight=len(engine.pending_jobs()), tracked=tracked, parts=parts,
            parts_released=self._orphans.released, parts_settled=self._orphans.settled,
            orphans=[OrphanedVersion.model_validate(o) for o in self._orphans.summary()], orphans_limit=LIMIT,
            queues=dict(queues), levels=dict(self._levels), restores=dict(self._restores),
            restore_bytes=dict(self._restore_bytes), served_bytes=dict(self._served),
            peer_bytes=PeerBytes(sent=self._peers.bytes["sent"], received=self._peers.bytes["received"]),
            request_errors=dict(self._errors), lag=lag, lost_versions=self.core.saver.errors_total,
            meter=self.core.meter.snapshot(),
        )

    def _stop_request(self, client: Client, msg: dict[str, Any]) -> dict[str, Any]:
        timeout = msg.get("within")
        with contextlib.suppress(TimeoutError):
            self.engine.flush(None if timeout is None else float(timeout))
        return {}

    # ------------------------------------------------------------------ node RAM changes

    def _watch_ram(self) -> None:
        """Tell clients when node RAM drops chunks (evicted for room), so they stop counting on them."""
        catalog = self.core.catalog
        note = catalog.note_chunks

        def noted(tier: str, ids: Iterable[str], present: bool = True) -> None:
            ids = list(ids)
            note(tier, ids, present)
            if tier == "ram" and not present and ids:
                self.broadcast({"ev": "ram", "chunks": ids, "present": False})

        catalog.note_chunks = noted  # type: ignore[method-assign]


def _peer_process(conn: Connection) -> tuple[int, str] | None:
    """The pid at the other end of ``conn`` (the kernel's word) and its start time, or ``None``."""
    try:
        pid = peer_credentials(conn.sock)[0]
    except OSError:
        return None
    start = _start_time(pid)
    return None if start is None else (pid, start)


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (field 22 of ``/proc/<pid>/stat``), or ``None`` if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold anything
    return None if not fields or fields[0] in ("Z", "X") else fields[19]


def _running(peer: tuple[int, str]) -> bool:
    """Whether the process ``peer`` names still runs (a new process with its pid is not it)."""
    return _start_time(peer[0]) == peer[1]


#: Each request: its handler, and whether it may take a while (answered from a thread of its own).
HANDLERS: dict[str, tuple[Callable[..., Any], bool]] = {
    "hello": (Requests._hello, False),
    "map": (Requests._map, False),
    "structure": (Requests._structure, False),
    "reserve": (Requests._reserve, True),
    "cancel": (Requests._cancel, False),
    "release": (Requests._release, False),
    "bye": (Requests._bye, False),
    "publish": (Requests._publish, False),
    "snapshot": (Requests._snapshot, True),
    "pin": (Requests._pin, False),
    "pins": (Requests._pins, False),
    "unpin": (Requests._unpin, False),
    "list": (Requests._list, False),
    "get": (Requests._get, False),
    "holds": (Requests._holds, False),
    "ram": (Requests._ram, False),
    "flush": (Requests._flush, True),
    "promote": (Requests._promote, True),
    "keep": (Requests._keep, True),
    "evict": (Requests._evict, False),
    "gc": (Requests._gc, True),
    "restored": (Requests._restored, False),
    "answer": (Requests._answer_call, False),
    "orphans": (Requests._orphans_request, True),
    "peer_port": (Requests._peer_port, False),
    "peer_copy": (Requests._peer_copy, True),
    "stats": (Requests._stats, False),
    "stop": (Requests._stop_request, True),
}



__all__ = ["HANDLERS", "Client", "Host", "Requests", "Tracked"]


#: The largest group a publish may name (a bound on what a client's message can make the agent keep).
MAX_WORLD = 1 << 20


def _rank_in_group(msg: dict[str, Any]) -> int | None:
    """A publish's ``part`` (the rank), checked with its ``world``; ``None`` for a version of one process.

    Raises:
        InvalidArgumentError: If they are not integers with ``0 <= part < world <= MAX_WORLD``.
    """
    part, world = msg.get("part"), msg.get("world")
    if part is None:
        return None
    if (not isinstance(part, int) or isinstance(part, bool) or not isinstance(world, int) or isinstance(world, bool)
            or not 0 <= part < world <= MAX_WORLD):
        raise InvalidArgumentError(f"publish: part {part!r} of world {world!r}: expected 0 <= part < world <= "
                                   f"{MAX_WORLD}")
    return part
