"""``python -m bench.control_plane``: the multi-rank control plane's cost per version, 8 to 4096 ranks.

Two parts, each through the production code (``tiercache.group``, ``tiercache.parts``,
``tiercache.repo``), never a re-implementation:

**In one process** (``--ranks``, default 8,64,512,4096; 8 ranks per node): a real
``torch.distributed`` TCPStore (server in this process) under the prefix a group view uses, a real
:class:`~tiercache.group.collective.Collective` for rank 0 (the coordinator), and the other
``N - 1`` ranks simulated: each posts its record and reads its verdict with the collective layer's
own :class:`~tiercache.group.collective.Channel` methods (``_post``, ``_verdict``), bound to a
stand-in for its rank (no heartbeat thread per simulated rank). Each rank's part is synthetic:
``--leaves`` tensors (20k) of ``--leaf-bytes`` (16 KiB), flattened (:func:`tiercache.format.flatten`)
and laid out (:func:`tiercache.layout.plan_layout`, 64 MiB chunks: 5 packed chunks per rank), in two
layouts: ``fsdp`` (every rank's chunks distinct) and ``ddp`` (every rank names the same 5 replicated
chunks, plus one of its own). A version is the exchanges of a save to a node-local disk and S3,
in the order :mod:`tiercache.group.phases` runs them, each timed on the coordinator from its call
to its return once every other rank has posted (the coordinator's work, not its wait for the
slowest rank):

- ``parts``: gather every rank's chunk list, decide with :func:`tiercache.group.owners.plan_parts`
  (disk node-local, S3 shared), send each rank its share, publish;
- ``disk``: every rank's status; then rank 0, as its node's leader, commits the group manifest
  (:func:`tiercache.parts.group_header` with every node, ``to_json``, ``Repo.commit`` of the manifest
  and the branch's ref on a real disk tier) and ``disk/commit`` gathers the leaders' statuses;
- ``s3``: every rank's status, the coordinator committing the manifest and ref inside the exchange
  (here on a second disk tier: the same commit path without S3's request latency).

The restore metadata is the five exchanges of :func:`tiercache.group.restore.restore` when every
node holds its part (``resolve`` with its decider, ``parts``, ``into``, ``missing``, ``done``) plus
one rank's read and parse of its own part manifest (what ``Catalog.part`` does). Per rank (the
same at any ``N``): building its part manifest of 20k leaves (as the engine's hasher does),
``part_of`` + ``to_json`` (the ``parts`` phase's size and the part written per tier), and parsing
it back. Bytes through the store are counted on the coordinator's connection, and on one other
rank's.

For contrast, ``--old`` (8,64) times what every rank did per tier before the split manifests:
parse every rank's 20k-leaf part and :func:`tiercache.parts.merge` them.

**End to end** (``--e2e``, 2,4,8 real gloo ranks, spawned like ``bench/multirank.py``; all ranks on
one node and one disk directory): each rank saves a state of ``--e2e-leaves`` small tensors
(20k of 64 float32, 5 MB per rank) with ``cache.save(state, step=i, group=WORLD)`` to a RAM + disk
cache, then a fresh disk-only cache restores it with ``cache.restore("main", group=WORLD)`` (bit-exact,
checked). Seconds are rank 0's, from a barrier before to a barrier after for the restore; medians of
``--e2e-versions`` after a warm-up. "part reads" counts, per rank and version (the most of any rank),
the reads of part manifests on any tier: a save reads none, a restore its own rank's one. On a
2-core machine 8 ranks share 2 cores: their figures are mostly CPU contention.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tiercache
from tiercache.cache import core_of
from tiercache.config import CacheConfig
from tiercache.format import flatten
from tiercache.group.collective import Channel, Collective, Decision
from tiercache.group.owners import plan_parts
from tiercache.group.peers import Replicator
from tiercache.group.phase_status import Status
from tiercache.group.restore import _first_known, _union, _union_missing
from tiercache.group.round import Plan
from tiercache.group.topology import Topology, choose_peers
from tiercache.group.view import GroupView
from tiercache.layout import plan_layout
from tiercache.manifest import ChunkRef, NodePart, Piece, RefRecord, TensorEntry, Version, new_version_id, utcnow
from tiercache.names import PARTS, part_key
from tiercache.parts import check_part, group_header, merge, part_of

OUT = Path(__file__).resolve().parent / "out" / "control_plane.json"
RANKS_PER_NODE = 8
CHUNK_BYTES = 64 << 20
PACK_BELOW = 1 << 20
LAYOUTS = ("fsdp", "ddp")
#: The tiers of the simulated job: each node's disk, and S3 shared by all.
TIERS = ("disk", "s3")
NODE_LOCAL = frozenset({"disk"})
#: The exchanges of one version's save, in order (``peers``: with more than one node).
SAVE_PHASES = ("begin", "parts", "disk", "disk_commit", "peers_plan", "peers", "s3")


# ---------------------------------------------------------------------------------------------- parts


def rank_state(leaves: int, leaf_bytes: int) -> dict[str, Any]:
    """A state of ``leaves`` float32 tensors of ``leaf_bytes`` each (never touched: only its metadata is used)."""
    n = leaf_bytes // 4
    return {"model": {f"layers.{i // 4}.w{i % 4}": torch.empty(n) for i in range(leaves)}}


def chunk_id(rank: int, index: int) -> str:
    """A valid content id for chunk ``index`` of ``rank`` (``rank = -1``: a replicated chunk)."""
    return f"{rank & 0xFFFFFFFFFFFFFFFF:016x}{index:016x}"


@dataclass
class Synthetic:
    """One rank's part of the synthetic state, as the engine's hasher publishes it."""

    manifest: Version
    part_json: bytes
    build_s: float
    serialize_s: float
    parse_s: float


def build_part(leaves: int, leaf_bytes: int, rank: int = 0, vid: str | None = None) -> Synthetic:
    """Build, serialize and parse one rank's part manifest, timing each (the per-rank costs)."""
    flat = flatten(rank_state(leaves, leaf_bytes))
    layout = plan_layout([m.nbytes for m in flat.metas], [4] * len(flat.metas), chunk_bytes=CHUNK_BYTES,
                         pack_below=PACK_BELOW)
    ids = [chunk_id(rank, i) for i in range(len(layout.chunks))]
    t0 = time.perf_counter()
    # As tiercache.pipeline.hasher.Hasher._publish builds a version's manifest from its layout and ids.
    tensors = []
    for i, m in enumerate(flat.metas):
        pieces = tuple(Piece(chunk=ci, chunk_offset=p.chunk_offset, offset=p.offset, nbytes=p.nbytes)
                       for ci, p in layout.tensor_pieces[i])
        tensors.append(TensorEntry(path=m.path, dtype=m.dtype, shape=tuple(m.shape), nbytes=m.nbytes, pieces=pieces))
    manifest = Version(
        id=vid or new_version_id(), parent=None, branch="main", step=1, created_at=utcnow(), meta={},
        chunks=tuple(ChunkRef(id=cid, nbytes=c.nbytes) for cid, c in zip(ids, layout.chunks, strict=True)),
        tensors=tuple(tensors), tree=flat.tree, pickled=flat.pickled, nbytes=sum(m.nbytes for m in flat.metas),
    )
    t1 = time.perf_counter()
    data = part_of(manifest, rank).to_json()
    t2 = time.perf_counter()
    Version.from_json(data, source="a part")
    t3 = time.perf_counter()
    return Synthetic(manifest, data, t1 - t0, t2 - t1, t3 - t2)


def parts_payloads(world: int, layout: str, sizes: Sequence[int], part_bytes: int) -> list[dict[str, Any]]:
    """What each rank sends at ``parts`` (its chunk ids and sizes, its bytes, its part's size).

    ``fsdp``: every rank's chunks are its own; ``ddp``: every rank holds the same chunks (a
    replicated state) plus one of its own (the data loader's position, its RNG).
    """
    out = []
    for r in range(world):
        if layout == "fsdp":
            chunks = [[chunk_id(r, i), n] for i, n in enumerate(sizes)]
        else:
            chunks = [[chunk_id(-1, i), n] for i, n in enumerate(sizes)] + [[chunk_id(r, 1 << 20), 4096]]
        out.append({"chunks": chunks, "nbytes": sum(n for _, n in chunks), "part": part_bytes})
    return out


# ---------------------------------------------------------------------------------------------- store


class CountingStore:
    """A store that forwards every request and counts the bytes of keys and values each way."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.sent = 0
        self.received = 0
        self.requests = 0

    def reset(self) -> tuple[int, int, int]:
        """Return ``(sent, received, requests)`` so far and start again from zero."""
        out = (self.sent, self.received, self.requests)
        self.sent = self.received = self.requests = 0
        return out

    def _out(self, *parts: Any) -> None:
        self.requests += 1
        self.sent += sum(len(p) for p in parts)

    def set(self, key: str, value: Any) -> None:
        self._out(key, value)
        self._store.set(key, value)

    def append(self, key: str, value: Any) -> None:
        self._out(key, value)
        self._store.append(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._out(*keys, *values)
        self._store.multi_set(keys, values)

    def get(self, key: str) -> bytes:
        self._out(key)
        data: bytes = self._store.get(key)
        self.received += len(data)
        return data

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._out(key, expected, desired)
        data: bytes = self._store.compare_set(key, expected, desired)
        self.received += len(data)
        return data

    def add(self, key: str, value: int) -> int:
        self._out(key)
        self.received += 8
        return int(self._store.add(key, value))

    def check(self, keys: list[str]) -> bool:
        self._out(*keys)
        return bool(self._store.check(keys))

    def delete_key(self, key: str) -> bool:
        self._out(key)
        return bool(self._store.delete_key(key))


@dataclass
class SimRank:
    """What :class:`~tiercache.group.collective.Channel` reads of its rank's collective, for a simulated rank.

    Its polling and liveness settings are the coordinator's (the same formulas for the same world size).
    """

    rank: int
    world: int
    store: Any
    timeout: float
    heartbeat: float
    poll: float
    dead_after: float
    broken: None = None

    @staticmethod
    def name(rank: int) -> str:
        return f"rank {rank}"

    def beat_values(self, store: Any, ranks: Sequence[int]) -> dict[int, int]:
        return Collective.beat_values(self, store, ranks)  # type: ignore[arg-type]


Traffic = tuple[int, int, int]  # bytes sent, bytes received, requests


def _plus(a: Traffic, b: Traffic) -> Traffic:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


class Simulation:
    """Rank 0's real collective and ``world - 1`` simulated ranks on one in-process store."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        self.world = world
        self.server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=timeout),
                                    wait_for_workers=False)

        def client() -> CountingStore:
            conn = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timedelta(seconds=timeout))
            return CountingStore(dist.PrefixStore("tiercache/bench/0/", conn))

        self.coord_store = client()
        self.others_store = client()
        # The heartbeat a group view gets by default (a quarter of its timeout, at most 1 s).
        self.coordinator = Collective(self.coord_store, 0, world, timeout=timeout, heartbeat=1.0)
        self.channel = self.coordinator.channel()
        c = self.coordinator
        self.others = [Channel(SimRank(r, world, self.others_store, c.timeout, c.heartbeat, c.poll,  # type: ignore[arg-type]
                                       c.dead_after)) for r in range(1, world)]
        #: The store traffic of the last exchange: the coordinator's, and the last simulated rank's.
        self.coord_traffic: Traffic = (0, 0, 0)
        self.rank_traffic: Traffic = (0, 0, 0)

    def exchange(self, tag: str, mine: Status, others: Callable[[int], Status], decide: Any = None) -> float:
        """One exchange: the other ranks post, rank 0 coordinates (timed), the other ranks read their verdicts."""
        *rest, last = self.others or [None]
        for ch in rest:
            ch._post(tag, others(ch.group.rank))
        self.others_store.reset()
        if last is not None:
            last._post(tag, others(last.group.rank))
        posted = self.others_store.reset()
        self.coord_store.reset()
        t0 = time.perf_counter()
        verdict = self.channel.exchange(tag, mine, what=tag, decide=decide)
        took = time.perf_counter() - t0
        self.coord_traffic = self.coord_store.reset()
        if not verdict.ok:
            raise RuntimeError(f"{tag}: {verdict.status.message}")
        for ch in rest:
            ch._verdict(tag)
        self.others_store.reset()
        if last is not None:
            last._verdict(tag)
        self.rank_traffic = _plus(posted, self.others_store.reset())
        return took

    def latency(self, tag: str, late: int = 4, spread: float = 0.05, head: float = 0.1) -> list[float]:
        """How long after the last rank posts each of ``late`` ranks holds the verdict (real waits on both sides).

        Every rank but the last ``late`` has posted; the coordinator starts its exchange, and
        ``head`` seconds later the late ranks call theirs, over ``spread`` seconds, as real
        ranks would: each polls for the verdict (``Channel.exchange`` on a simulated rank), and
        the coordinator polls for the last record. This is the phase's wall-clock cost beyond
        the slowest rank: the coordinator's work plus both sides' polling.
        """
        late = min(late, len(self.others))
        waiting = self.others[len(self.others) - late:]
        for ch in self.others[: len(self.others) - late]:
            ch._post(tag, Status())
        posted: list[float] = [0.0] * late
        done: list[float] = [0.0] * late

        def rank(i: int) -> None:
            time.sleep(head + spread * i / max(1, late - 1))
            posted[i] = time.perf_counter()
            waiting[i].exchange(tag, Status(), what=tag)
            done[i] = time.perf_counter()

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(late)]
        for t in threads:
            t.start()
        verdict = self.channel.exchange(tag, Status(), what=tag)
        for t in threads:
            t.join()
        for ch in self.others[: len(self.others) - late]:
            ch._verdict(tag)
        if not verdict.ok:
            raise RuntimeError(f"{tag}: {verdict.status.message}")
        return [d - max(posted) for d in done]

    def close(self) -> None:
        self.coordinator.close(linger=0.0)


# ---------------------------------------------------------------------------------------------- one N


def topology(world: int) -> Topology:
    """``world`` ranks, ``RANKS_PER_NODE`` per node."""
    return Topology.of([(f"n{r // RANKS_PER_NODE}", "") for r in range(world)])


def node_parts(topo: Topology) -> tuple[NodePart, ...]:
    """The group manifest's nodes, each with one peer copy on the next node."""
    n = topo.count
    return tuple(NodePart(name=name, ranks=topo.ranks(i), copies=(topo.names[(i + 1) % n],) if n > 1 else ())
                 for i, name in enumerate(topo.names))


class World:
    """One world size and layout: the simulation, the synthetic parts, the two disk tiers that take the commits."""

    def __init__(self, world: int, layout: str, part: Synthetic, local: Any, shared: Any) -> None:
        self.world = world
        self.part = part
        self.payloads = parts_payloads(world, layout, [c.nbytes for c in part.manifest.chunks], len(part.part_json))
        self.topo = topology(world)
        self.nodes = node_parts(self.topo)
        self.total = sum(p["nbytes"] for p in self.payloads)
        self.sim = Simulation(world)
        self.local = local  # rank 0's node's disk (rank 0 leads its node)
        self.shared = shared  # stands in for S3: the coordinator's commit without S3's request latency
        self.plan: Any = None
        # What GroupView._begin and Replicator.plan read of their view: the config, the group's shape.
        view = SimpleNamespace(cache=SimpleNamespace(config=CacheConfig()), world_size=world, topology=self.topo)
        view.chunk_bytes = partial(GroupView.chunk_bytes, view)
        self.view = view
        # One peer copy per node's part, on another node (none with a single node).
        self.replicator = (Replicator(view, None, choose_peers(self.topo, 1), "disk", timeout=600.0)  # type: ignore[arg-type]
                           if self.topo.count > 1 else None)
        self.leaf_bytes = max(t.nbytes for t in part.manifest.tensors)
        self.row: dict[str, float] = {}
        self.seen: dict[str, Traffic] = {}

    def _step(self, names: tuple[str, ...], took: float) -> None:
        sim = self.sim
        for name in names:
            self.row[name] = self.row.get(name, 0.0) + took
            for who, t in (("coordinator", sim.coord_traffic), ("rank", sim.rank_traffic)):
                self.seen[f"{who}/{name}"] = _plus(self.seen.get(f"{who}/{name}", (0, 0, 0)), t)

    def _same(self, tag: str, status: Status, decide: Any = None, names: tuple[str, ...] = ()) -> None:
        """An exchange where every rank sends ``status``."""
        self._step(names or (tag.rsplit("/", 1)[-1],), self.sim.exchange(tag, status, lambda r: status, decide))

    def version(self, k: int, parent: str | None) -> tuple[str, list[float]]:
        """Save version ``k`` and read it back (metadata only); fill :attr:`row` and :attr:`seen`."""
        self.row, self.seen = {}, {}
        vid = new_version_id()
        # As a group save's begin does on the ranks that commit: the branch moves to vid in their view.
        for cache in (self.local, self.shared):
            with core_of(cache).next_version("main") as nxt:
                nxt.version = vid
        ref = RefRecord(kind="branch", name="main", version=vid, seq=nxt.seq)

        def header() -> Version:  # as tiercache.group.phases.Phases._header
            return group_header(id=vid, parent=parent, branch="main", step=k, created_at=utcnow(), meta={},
                                hash_algo="xxh3-128", ranks=self.world, nbytes=self.total, nodes=self.nodes)

        def assign(statuses: list[Status]) -> Decision:  # as tiercache.group.phases.Phases._assign
            self.plan = plan_parts([s.payload for s in statuses], list(TIERS), NODE_LOCAL, self.topo, {})
            return Decision(self.plan.nbytes, self.plan.per_rank)

        def commit_shared(statuses: list[Status]) -> Decision:  # as tiercache.group.phases.Phases._commit_shared
            t0 = time.perf_counter()
            core_of(self.shared).repo.commit("disk", header(), ref, held=())
            self.row["commit_shared"] = time.perf_counter() - t0
            return Decision(any(s.payload for s in statuses))

        # -- save() itself (on the training thread): the ranks agree on the version (GroupView.save)
        begin = {"step": k, "branch": "main", "sig": None, "largest": self.leaf_bytes}
        proposal = {**begin, "proposal": [vid, parent, nxt.seq, utcnow().isoformat(), {}]}
        self._step(("begin",), self.sim.exchange(f"save/{k}", Status("ok", proposal), lambda r: Status("ok", begin),
                                                 partial(GroupView._begin, self.view)))
        # -- then in the background, as tiercache.group.phases runs it: parts, disk (+ the node
        # leader's commit), peers (with peer copies), s3
        payloads = self.payloads
        self._step(("parts",), self.sim.exchange(f"{vid}/parts", Status("ok", payloads[0]),
                                                 lambda r: Status("ok", payloads[r]), assign))
        self._same(f"{vid}/disk", Status("ok", 0))
        t0 = time.perf_counter()
        # as Phases._commit_node
        core_of(self.local).repo.commit("disk", header(), ref, held=(), node=self.topo.names[0])
        self.row["commit_node"] = time.perf_counter() - t0
        self._same(f"{vid}/disk/commit", Status(), names=("disk_commit",))
        if self.replicator is not None:  # as tiercache.group.peers.Replicator.run, without the copies
            plan = self.plan
            rnd = SimpleNamespace(plan=Plan(plan.nbytes, plan.sizes, plan.writers, plan.part_bytes))
            self._same(f"{vid}/peers/plan", Status(), lambda st: self.replicator.plan(rnd, st),  # type: ignore[union-attr]
                       names=("peers_plan",))
            self._same(f"{vid}/peers", Status(), names=("peers",))
        self._same(f"{vid}/s3", Status("ok", 0), commit_shared)
        # -- restore, as tiercache.group.restore.restore runs it when every node holds its part
        tag = f"restore/{k}"
        found = {"id": vid, "branch": "main", "parent": parent, "step": k, "world": self.world,
                 "created": utcnow().isoformat(), "hash": "xxh3-128"}
        self._same(f"{tag}/resolve", Status("ok", found), _first_known, names=("resolve", "restore"))
        self._same(f"{tag}/parts", Status("ok", []), _union_missing, names=("restore",))
        self._same(f"{tag}/into", Status(), names=("restore",))
        self._same(f"{tag}/missing", Status("ok", {}), lambda s: Decision(_union(s)), names=("restore",))
        self._same(f"{tag}/done", Status(), names=("restore",))
        core_of(self.local).repo.put_part("disk", part_of(self.part.manifest.model_copy(update={"id": vid}), 0))
        head = core_of(self.local).catalog.peek(vid)
        key = part_key(vid, 0)
        t0 = time.perf_counter()
        # As tiercache.repo.catalog.Catalog.part reads a part it does not hold yet.
        data = core_of(self.local).repo.durable["disk"].get(key)
        assert data is not None
        check_part(head, 0, Version.from_json(data, source=f"disk:{key}"), f"disk:{key}")
        self.row["read_part"] = time.perf_counter() - t0
        core_of(self.local).repo.durable["disk"].delete(key)
        row = self.row
        row["local"] = sum(row[x] for x in ("begin", "parts", "disk", "commit_node", "disk_commit"))
        row["replicated"] = row["local"] + row.get("peers_plan", 0.0) + row.get("peers", 0.0)
        row["remote"] = row["begin"] + row["parts"] + row["s3"]
        row["version"] = row["replicated"] + row["s3"]
        # -- one more status exchange, with real waits on both sides: the phase's wall-clock cost
        return vid, self.sim.latency(f"{vid}/latency")


def measure_world(world: int, layout: str, part: Synthetic, versions: int, root: Path) -> dict[str, Any]:
    """The coordinator's and a rank's control-plane costs per version at ``world`` ranks."""
    runs: dict[str, list[float]] = {}
    latency: list[float] = []
    disk_root, s3_root = root / f"{layout}-{world}-disk", root / f"{layout}-{world}-s3"
    with tiercache.open({"disk": {"path": str(disk_root)}}) as local, \
            tiercache.open({"disk": {"path": str(s3_root)}}) as shared:
        w = World(world, layout, part, local, shared)
        parent: str | None = None
        saved: list[str] = []
        try:
            for k in range(versions + 1):  # the first version warms up (the disk tiers, the store)
                parent, lat = w.version(k, parent)
                saved.append(parent)
                if k == 0:
                    continue
                for name, value in w.row.items():
                    runs.setdefault(name, []).append(value)
                latency.extend(lat)
        finally:
            w.sim.close()
    committed = {"disk": committed_versions(disk_root, saved, w), "s3": committed_versions(s3_root, saved, w)}
    shutil.rmtree(disk_root, ignore_errors=True)
    shutil.rmtree(s3_root, ignore_errors=True)
    seen = w.seen
    shares = {t: sum(len(p[t]) for p in w.plan.per_rank) for t in TIERS}
    shares["distinct"] = len(w.plan.sizes)
    return {"world": world, "layout": layout, "nodes": w.topo.count, "runs_s": runs,
            "median_s": {k: statistics.median(v) for k, v in runs.items()},
            "latency_s": {"median": statistics.median(latency), "max": max(latency), "runs": latency},
            "bytes": {who: {"version": _sum(seen, who, [x for x in SAVE_PHASES if f"{who}/{x}" in seen]),
                            "parts": _sum(seen, who, ("parts",)), "restore": _sum(seen, who, ("restore",))}
                      for who in ("coordinator", "rank")},
            "shares": shares, "saved": len(saved), "committed": committed}


def committed_versions(root: Path, saved: Sequence[str], w: World) -> dict[str, Any]:
    """What a fresh process reads back from a tier the commits went to: how many of ``saved`` have a
    group manifest there that parses and names every rank and node, and whether ``main`` is the last."""
    good = 0
    with tiercache.open({"disk": {"path": str(root)}}) as fresh:
        for vid in saved:
            m = core_of(fresh).catalog.peek(vid)  # read from the tier and parsed
            good += int(m.id == vid and m.ranks == w.world and len(m.nodes) == w.topo.count and m.nbytes == w.total)
        head = fresh.resolve("main")
    return {"parsed": good, "head_is_last": head == saved[-1]}


def _traffic(t: Traffic) -> dict[str, int]:
    return {"sent": t[0], "received": t[1], "requests": t[2]}


def _sum(traffic: dict[str, Traffic], who: str, names: Sequence[str]) -> dict[str, int]:
    total: Traffic = (0, 0, 0)
    for name in names:
        total = _plus(total, traffic[f"{who}/{name}"])
    return _traffic(total)


def measure_old(world: int, part: Synthetic, repeat: int) -> dict[str, Any]:
    """The design before split manifests: per tier, every rank parsed every rank's part and merged them."""
    parse: list[float] = []
    merged: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        parts = [Version.from_json(part.part_json, source=f"rank {r}'s part") for r in range(world)]
        t1 = time.perf_counter()
        header = group_header(id=part.manifest.id, parent=None, branch="main", step=1, created_at=utcnow(), meta={},
                              hash_algo="xxh3-128", ranks=world, nbytes=world * part.manifest.nbytes)
        whole = merge(header, parts)
        t2 = time.perf_counter()
        assert len(whole.tensors) == world * len(part.manifest.tensors)
        parse.append(t1 - t0)
        merged.append(t2 - t1)
        del parts, whole
    return {"world": world, "parse_s": statistics.median(parse), "merge_s": statistics.median(merged),
            "runs": {"parse_s": parse, "merge_s": merged}}


# ---------------------------------------------------------------------------------------------- end to end


def e2e_state(rank: int, leaves: int, numel: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Rank ``rank``'s state: ``leaves`` views of one buffer (so one ``add_`` changes every leaf)."""
    g = torch.Generator().manual_seed(rank)
    flat = torch.randn(leaves * numel, generator=g)
    return flat, {"model": {f"layers.{i // 4}.w{i % 4}": flat[i * numel : (i + 1) * numel] for i in range(leaves)}}


def record_part_reads(cache: tiercache.TierCache, seen: list[str]) -> None:
    """Append ``"<tier>:<method>:<key>"`` to ``seen`` for every read of a part manifest on ``cache``'s durable tiers.

    Wraps each tier's ``get``, ``read_into``, ``exists`` and ``list`` (a listing of ``parts/`` or
    above counts too): a save of a group version should read no part on any tier (docs/integrations.md).
    """
    for tier in core_of(cache).repo.durable.values():
        for method in ("get", "read_into", "exists", "list"):
            real = getattr(tier, method)

            def recording(key: str, *a: Any, _real: Callable[..., Any] = real, _tier: str = tier.name,
                          _m: str = method, **kw: Any) -> Any:
                if key.startswith(PARTS) or (_m == "list" and PARTS.startswith(key)):
                    seen.append(f"{_tier}:{_m}:{key}")
                return _real(key, *a, **kw)

            setattr(tier, method, recording)


def _e2e_rank(rank: int, world: int, port: int, args: dict[str, Any], root: str, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    group = dist.group.WORLD
    flat, state = e2e_state(rank, args["leaves"], args["numel"])
    disk = {"path": str(Path(root) / "tc")}
    cfg = {"disk": disk, "ram": {"capacity": 4 * flat.nbytes + (64 << 20)}, "policy": {"name": "write-through"}}
    result: dict[str, list[float]] = {"save_wait_s": [], "local_s": [], "restore_s": [], "save_part_reads": [],
                                      "restore_part_reads": []}
    exact = True
    with tiercache.open(cfg) as cache:
        reads: list[str] = []
        record_part_reads(cache, reads)
        for i in range(args["versions"] + 1):  # the first version warms up
            flat.add_(1.0)  # new bytes in every leaf: nothing dedups against the last version
            dist.barrier()
            t0 = time.perf_counter()
            h = cache.save(state, step=i, group=group)
            t1 = time.perf_counter()
            h.wait("local")
            t2 = time.perf_counter()
            h.wait("durable")
            dist.barrier()  # the other ranks' commits (and any reads they cause here) are done
            if i:
                result["save_wait_s"].append(t1 - t0)
                result["local_s"].append(t2 - t0)
                result["save_part_reads"].append(len(reads))
            reads.clear()
    for i in range(args["versions"] + 1):
        with tiercache.open({"disk": disk}) as cache:  # a fresh process's view: no RAM, no catalog in memory
            reads = []
            record_part_reads(cache, reads)
            dist.barrier()
            t0 = time.perf_counter()
            got = cache.restore("main", group=group)
            dist.barrier()
            took = time.perf_counter() - t0
        if i:
            result["restore_s"].append(took)
            result["restore_part_reads"].append(len(reads))
        exact = exact and all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
    out.put((rank, result, exact))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_e2e(world: int, leaves: int, numel: int, versions: int, base: Path) -> dict[str, Any]:
    """Save and restore with ``world`` real gloo ranks; rank 0's medians, and whether every rank restored bit-exact."""
    root = base / f"e2e-{world}"
    root.mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    args = {"leaves": leaves, "numel": numel, "versions": versions}
    procs = [ctx.Process(target=_e2e_rank, args=(r, world, port, args, str(root), out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, result, exact = out.get(timeout=1800)
        results[rank] = (result, exact)
    for p in procs:
        p.join()
    shutil.rmtree(root, ignore_errors=True)
    r0 = results[0][0]
    return {"world": world, "leaves": leaves, "bytes_per_rank": leaves * numel * 4,
            "save_wait_s": statistics.median(r0["save_wait_s"]), "local_s": statistics.median(r0["local_s"]),
            "restore_s": statistics.median(r0["restore_s"]),
            "save_wait_max_rank_s": max(statistics.median(r["save_wait_s"]) for r, _ in results.values()),
            # Reads of part manifests (any rank's) per rank and version: the most any rank made.
            "save_part_reads": max(max(r["save_part_reads"]) for r, _ in results.values()),
            "restore_part_reads": max(max(r["restore_part_reads"]) for r, _ in results.values()),
            "exact": all(e for _, e in results.values()), "runs": {r: res for r, (res, _) in results.items()}}


# ---------------------------------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse arguments, measure, print the tables and write the JSON (``bench/out/control_plane.json``)."""
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="8,64,512,4096", help="world sizes simulated in one process")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="fsdp (distinct chunks), ddp (replicated chunks)")
    p.add_argument("--leaves", type=int, default=20_000, help="tensors per rank")
    p.add_argument("--leaf-bytes", type=int, default=16 << 10, help="bytes per tensor (16 KiB)")
    p.add_argument("--versions", type=int, default=5, help="versions per world size; medians (after a warm-up)")
    p.add_argument("--old", default="8,64", help="world sizes for the old design's parse + merge per tier")
    p.add_argument("--e2e", default="2,4,8", help="world sizes of real gloo ranks")
    p.add_argument("--e2e-leaves", type=int, default=20_000)
    p.add_argument("--e2e-numel", type=int, default=64, help="float32 elements per tensor end to end")
    p.add_argument("--e2e-versions", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the disk tiers go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=OUT)
    args = p.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    console = Console(width=None if os.isatty(1) else 160)
    base = Path(tempfile.mkdtemp(prefix="tc-control-", dir=args.dir))
    results: dict[str, Any] = {"leaves": args.leaves, "leaf_bytes": args.leaf_bytes, "versions": args.versions,
                               "ranks_per_node": RANKS_PER_NODE, "load_1min_start": os.getloadavg()[0],
                               "started": datetime.now(UTC).isoformat(), "rows": [], "old": [], "e2e": []}
    try:
        part = build_part(args.leaves, args.leaf_bytes)
        per_rank = [part]
        for _ in range(2):
            per_rank.append(build_part(args.leaves, args.leaf_bytes))
        results["per_rank"] = {
            "part_bytes": len(part.part_json), "chunks": len(part.manifest.chunks),
            "build_s": statistics.median(x.build_s for x in per_rank),
            "serialize_s": statistics.median(x.serialize_s for x in per_rank),
            "parse_s": statistics.median(x.parse_s for x in per_rank)}
        for world in _ints(args.ranks):
            for layout in (x.strip() for x in args.layouts.split(",") if x.strip()):
                _say(f"control plane: {world} ranks, {layout}")
                results["rows"].append(measure_world(world, layout, part, args.versions, base))
        for world in _ints(args.old):
            _say(f"old design: {world} ranks")
            results["old"].append(measure_old(world, part, 1 if world > 8 else 3))
        for world in _ints(args.e2e):
            _say(f"end to end: {world} gloo ranks")
            results["e2e"].append(measure_e2e(world, args.e2e_leaves, args.e2e_numel, args.e2e_versions, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["load_1min_end"] = os.getloadavg()[0]
    results["scale_inputs"] = scale_inputs(results)
    render(results, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    return results


def scale_inputs(results: dict[str, Any], layout: str = "fsdp") -> dict[str, Any]:
    """The constants of ``bench/scale_model.py`` from one run: least-squares lines over the ranks.

    Per level, the coordinator's seconds per version as ``(fixed, per rank)``; the median phase
    latency at 512 ranks and more (or the largest run); one rank's part manifest per leaf.
    """
    rows = [r for r in results["rows"] if r["layout"] == layout]
    out: dict[str, Any] = {"control_s": {}}
    names = {"begin": "begin", "local": "local", "replicated": "replicated", "remote": "remote",
             "restore": "restore"}
    for level, name in names.items():
        pts = [(r["world"], r["median_s"][name]) for r in rows if name in r["median_s"]]
        if len(pts) < 2:
            continue
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out["control_s"][level] = (max(0.0, my - slope * mx), slope)
    big = [r for r in rows if r["world"] >= 512] or rows[-1:]
    if big:
        out["phase_latency_s"] = statistics.median(r["latency_s"]["median"] for r in big)
        out["part_restore_s_per_leaf"] = statistics.median(r["median_s"]["read_part"] for r in rows) / results["leaves"]
    pr = results.get("per_rank")
    if pr:
        out["part_save_s_per_leaf"] = (pr["build_s"] + pr["serialize_s"]) / results["leaves"]
    return out


def _say(what: str) -> None:
    print(f"[control {time.strftime('%H:%M:%S')}] {what}", flush=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _kb(n: int) -> str:
    return f"{n / 1024:.1f}"


def render(results: dict[str, Any], console: Console) -> None:
    """Print the tables of one run."""
    pr = results["per_rank"]
    console.print(f"per rank, at any N: part manifest of {results['leaves']} leaves = {pr['part_bytes'] / 1e6:.2f} MB "
                  f"in {pr['chunks']} chunks; build {_ms(pr['build_s'])} ms, part_of + to_json "
                  f"{_ms(pr['serialize_s'])} ms, parse {_ms(pr['parse_s'])} ms")
    if results["rows"]:
        title = (f"the coordinator's work per version (ms, median of {results['versions']}), "
                 f"{results['ranks_per_node']} ranks per node, node-local disk (1 peer copy) + S3")
        phases = Table(title=f"{title}: each exchange")
        for col in ("ranks", "layout", "save/ (in save())", "parts", "disk", "node commit", "disk/commit",
                    "peers/plan", "peers", "s3 + commit"):
            phases.add_column(col, justify="left" if col == "layout" else "right")
        totals = Table(title=f"{title}: to each level, store bytes, restore")
        for col in ("ranks", "layout", "to local", "to replicated", "to remote", "per version",
                    "coordinator KiB in / out", "a rank: B out / in", "restore (5 exchanges)", "own part read",
                    "phase latency"):
            totals.add_column(col, justify="left" if col == "layout" else "right")
        for r in results["rows"]:
            m, c, k = r["median_s"], r["bytes"]["coordinator"]["version"], r["bytes"]["rank"]["version"]
            ms = {name: _ms(m[name]) if name in m else "-" for name in (
                "begin", "parts", "disk", "commit_node", "disk_commit", "peers_plan", "peers", "s3", "local",
                "replicated", "remote", "version", "restore", "read_part")}
            phases.add_row(str(r["world"]), r["layout"], *(ms[x] for x in (
                "begin", "parts", "disk", "commit_node", "disk_commit", "peers_plan", "peers", "s3")))
            totals.add_row(str(r["world"]), r["layout"], ms["local"], ms["replicated"] if "peers" in m else "-",
                           ms["remote"], ms["version"], f"{_kb(c['received'])} / {_kb(c['sent'])}",
                           f"{k['sent']} / {k['received']}", ms["restore"], ms["read_part"],
                           f"{_ms(r['latency_s']['median'])} (max {_ms(r['latency_s']['max'])})")
        console.print(phases)
        console.print(totals)
    if results["old"]:
        old = Table(title="before split manifests: every rank, per tier, parsed and merged every rank's part (s)")
        for col in ("ranks", "parse", "merge", "per tier", "per version, disk + S3"):
            old.add_column(col, justify="right")
        for r in results["old"]:
            tier = r["parse_s"] + r["merge_s"]
            old.add_row(str(r["world"]), f"{r['parse_s']:.2f}", f"{r['merge_s']:.2f}", f"{tier:.2f}", f"{2 * tier:.2f}")
        console.print(old)
    if results["e2e"]:
        e2e = Table(title="end to end, real gloo ranks on one node (s, rank 0, medians)")
        for col in ("ranks", "leaves/rank", "MB/rank", "save() wait", "max over ranks", "to local", "restore (disk)",
                    "part reads: save / restore", "bit-exact"):
            e2e.add_column(col, justify="right")
        for r in results["e2e"]:
            e2e.add_row(str(r["world"]), str(r["leaves"]), f"{r['bytes_per_rank'] / 1e6:.1f}",
                        f"{r['save_wait_s']:.3f}", f"{r['save_wait_max_rank_s']:.3f}", f"{r['local_s']:.3f}",
                        f"{r['restore_s']:.3f}", f"{r['save_part_reads']} / {r['restore_part_reads']}",
                        "yes" if r["exact"] else "NO")
        console.print(e2e)
    fit = scale_inputs(results)
    if fit["control_s"]:
        lines = ", ".join(f"{k}: {a * 1e3:.2f} ms + {b * 1e6:.1f} us/rank" for k, (a, b) in fit["control_s"].items())
        console.print(f"for bench/scale_model.py (fsdp, least squares over the ranks): {lines}; phase latency "
                      f"{fit['phase_latency_s'] * 1e3:.0f} ms; part manifest {fit['part_save_s_per_leaf'] * 1e6:.1f} "
                      f"us/leaf at save, {fit['part_restore_s_per_leaf'] * 1e6:.1f} us/leaf at restore")
    console.print(f"load average (1 min) at start {results['load_1min_start']:.2f}, at end "
                  f"{results['load_1min_end']:.2f}")


if __name__ == "__main__":
    main()
