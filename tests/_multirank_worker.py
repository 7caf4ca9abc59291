"""One rank of the multi-rank tests: forked by the tests' fork server (:func:`forked`), or ``python _multirank_worker.py
SCENARIO RANK WORLD PORT DIR`` by hand.

Each rank joins a gloo group on loopback, opens its own cache from ``DIR/config.json`` (with the
variables of ``DIR/env.json``, per rank, when the test gives each simulated node its own disk;
otherwise all ranks share the disk directory) and the S3 prefix, runs the scenario and writes what it observed to
``DIR/rank<R>.json`` (and restored tensors to ``DIR/restored<R>.pt``) for the test to check.
States are built by :func:`ddp_state` and :func:`full_tensors` so the test can rebuild them.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiercache
from tiercache import failpoints
from tiercache.cache import core_of
from tiercache.errors import StorageError
from tiercache.names import CHUNKS


def ddp_state(rank: int, step: int) -> dict[str, Any]:
    """A DDP-like state: replicated weights (same on every rank) plus per-rank leaves."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)},
        "rng": torch.full((4,), rank * 1000 + step, dtype=torch.int64),
        "step": step,
    }


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    """The global tensors of the sharded scenarios (row-sharded ``w``, replicated ``emb``)."""
    g = torch.Generator().manual_seed(100 + step)
    return {"w": torch.randn(64, 512, generator=g), "emb": torch.randn(96, 256, generator=g)}


def _record_chunk_puts(cache: tiercache.TierCache, seen: list[str]) -> None:
    for tier in core_of(cache).repo.durable.values():
        put = tier.put

        def recording(
            key: str, data: Any, _put: Callable[..., None] = put, _tier: str = tier.name, **kw: bool
        ) -> None:
            if key.startswith(CHUNKS):
                seen.append(f"{_tier}:{key}")
            _put(key, data, **kw)

        tier.put = recording  # type: ignore[method-assign]


def _fail_chunk_puts(cache: tiercache.TierCache, action: Callable[[], None]) -> None:
    for tier in core_of(cache).repo.durable.values():
        put = tier.put

        def failing(key: str, data: Any, _put: Callable[..., None] = put, **kw: bool) -> None:
            if key.startswith(CHUNKS):
                action()
            _put(key, data, **kw)

        tier.put = failing  # type: ignore[method-assign]


def _error(fn: Callable[[], Any]) -> list[str] | None:
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None


def scenario_ddp(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    group = dist.group.WORLD
    puts: list[str] = []
    _record_chunk_puts(cache, puts)
    h1 = cache.save(ddp_state(rank, 1), step=1, group=group, meta={"loss": 1.5})
    h2 = cache.save(ddp_state(rank, 2), step=2, group=group)
    out["v1"], out["v2"] = h1.wait("local"), h2.wait("local")
    out["remote"] = [h1.wait("remote"), h2.wait("remote")]
    out["puts"] = sorted(puts)
    if rank == 1:
        def refuse() -> None:
            raise StorageError("injected: disk full on rank 1")

        _fail_chunk_puts(cache, refuse)
    h3 = cache.save(ddp_state(rank, 3), step=3, group=group)
    out["v3"] = h3.version
    out["v3_errors"] = {lvl: _error(lambda lvl=lvl: h3.wait(lvl)) for lvl in ("local", "remote", "durable")}
    out["head"] = cache.resolve("main")  # the failed version is no head: main is version 2 again
    restored = cache.restore("main", group=group)
    into = ddp_state(rank, 0)
    v1 = cache.restore(out["v1"], into=into, group=group)
    out["into_in_place"] = v1["model"]["w"] is into["model"]["w"] and v1["rng"] is into["rng"]
    torch.save({"main": restored, "v1_into": v1}, work / f"restored{rank}.pt")


def scenario_ddp_declared(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """A DDP save that declares the model replicated: count the bytes each rank's hasher hashes."""
    from tiercache import codecs

    hashed = [0]
    content_id = codecs.content_id

    def counting(data: Any, algo: str) -> str:
        if threading.current_thread().name.startswith("tiercache-hash"):
            hashed[0] += memoryview(data).nbytes
        return content_id(data, algo)

    codecs.content_id = counting  # type: ignore[assignment]
    puts: list[str] = []
    _record_chunk_puts(cache, puts)
    h = cache.save(ddp_state(rank, 1), step=1, group=dist.group.WORLD, replicated=("model",))
    out["v1"], out["remote"] = h.wait("local"), h.wait("remote")
    out["hashed"], out["puts"] = hashed[0], sorted(puts)
    got = cache.restore("main", group=dist.group.WORLD)
    out["restored_equal"] = _restored_equal(got, ddp_state(rank, 1))


def scenario_replica_differs(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                             work: Path) -> None:
    """The model is declared replicated, but rank 1's weight differs at step 2; steps 1 and 3 are alike."""
    group = dist.group.WORLD
    handles = []
    for step in (1, 2, 3):
        state = ddp_state(rank, step)
        if step == 2 and rank == 1:
            state["model"]["w"] += 1
        handles.append(cache.save(state, step=step, group=group, replicated=("model",)))
    out["versions"] = [h.version for h in handles]
    out["levels"] = [{lvl: _error(lambda h=h, lvl=lvl: h.wait(lvl)) for lvl in ("local", "durable")}
                     for h in handles]
    out["head"] = cache.resolve("main")
    out["restored_equal"] = _restored_equal(cache.restore("main", group=group), ddp_state(rank, 3))


def scenario_throttled(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """The store throttles rank 1's first chunk uploads; every rank's S3 pacing is reported."""
    from _s3faults import SlowDownChunks

    pacer = core_of(cache).repo.durable["s3"].pacer
    out["limit_before"] = pacer.limit
    throttle = SlowDownChunks(core_of(cache).repo.durable["s3"]._client, 2) if rank == 1 else None  # type: ignore[attr-defined]
    h = cache.save(ddp_state(rank, 1), step=1, group=dist.group.WORLD)
    out["remote"] = h.wait("remote") == h.version
    out["limit_after"], out["throttled"] = pacer.limit, pacer.throttled_total
    out["answered"] = throttle.answered if throttle is not None else 0
    got = cache.restore("main", group=dist.group.WORLD)
    out["restored_equal"] = _restored_equal(got, ddp_state(rank, 1))


def scenario_kill(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    group = dist.group.WORLD
    out["v1"] = cache.save(ddp_state(rank, 1), step=1, group=group).wait("durable")
    cache.flush()
    if rank == 1:
        _fail_chunk_puts(cache, lambda: os.kill(os.getpid(), signal.SIGKILL))
    h2 = cache.save(ddp_state(rank, 2), step=2, group=group)
    out["v2"] = h2.version
    out["v2_errors"] = {lvl: _error(lambda lvl=lvl: h2.wait(lvl)) for lvl in ("local", "remote", "durable")}


def scenario_sharded(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors(1)
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
             "emb": distribute_tensor(full["emb"], mesh, [Replicate()]), "step": 1}
    out["v1"] = cache.save(state, step=1, group=dist.group.WORLD).wait("durable")
    cache.flush()
    into = {"w": distribute_tensor(torch.zeros(64, 512), mesh, [Shard(0)]),
            "emb": distribute_tensor(torch.zeros(96, 256), mesh, [Replicate()])}
    cache.restore("main", into=into, group=dist.group.WORLD)
    out["restored_equal"] = {k: bool(torch.equal(into[k].full_tensor(), full[k])) for k in into}
    torch.save({k: v.to_local() for k, v in into.items()}, work / f"restored{rank}.pt")


def _dtensors(world: int, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(full["emb"], mesh, [Replicate()])}


def scenario_dcp_save(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tiercache.integrations.dcp import TierCacheStorageWriter

    w1 = TierCacheStorageWriter(cache, step=1, meta={"via": "dcp"})
    dcp.save({**_dtensors(world, full_tensors(1)), "step": 1}, storage_writer=w1)
    w2 = TierCacheStorageWriter(cache, step=2)
    dcp.async_save({**_dtensors(world, full_tensors(2)), "step": 2}, storage_writer=w2).result()
    out["versions"] = [w1.version_id, w2.version_id]


def scenario_dcp_nodes(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """dcp.save twice over nodes with their own disks and peer copies; report every level of each."""
    import torch.distributed.checkpoint as dcp

    from tiercache.integrations.dcp import TierCacheStorageWriter

    out["versions"], out["levels"] = [], []
    for step in (1, 2):
        w = TierCacheStorageWriter(cache, step=step)
        dcp.save({**_dtensors(world, full_tensors(step)), "step": step}, storage_writer=w)
        out["versions"].append(w.version_id)
        out["levels"].append(_levels(w.handle))


def scenario_dcp_load(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tiercache.integrations.dcp import TierCacheStorageReader

    out["equal"] = {}
    for ref, step in (("main", 2), ("main~1", 1)):
        state = {**_dtensors(world, {k: torch.zeros_like(v) for k, v in full_tensors(step).items()}), "step": 0}
        dcp.load(state, storage_reader=TierCacheStorageReader(cache, ref))
        full = full_tensors(step)
        out["equal"][ref] = [state["step"], *(bool(torch.equal(state[k].full_tensor(), full[k])) for k in full)]


def scenario_dcp_modes(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """One writer reused for two group saves (no checkpoint_id), a tagged save, then saves without the group.

    Each rank's node has its own disk. Loads report, per ref, the step and whether each tensor
    came back bit-exact.
    """
    import torch.distributed.checkpoint as dcp

    from tiercache.integrations.dcp import TierCacheStorageReader, TierCacheStorageWriter

    def load(ref: str, step: int, **kw: Any) -> list[Any]:
        full = full_tensors(step)
        if kw.get("no_dist"):  # this process alone: whole tensors
            state: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
        else:
            state = _dtensors(world, {k: torch.zeros_like(v) for k, v in full.items()})
        state["step"] = 0
        dcp.load(state, storage_reader=TierCacheStorageReader(cache, ref), **kw)
        got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items() if k != "step"}
        return [state["step"], *(bool(torch.equal(got[k], full[k])) for k in full)]

    writer = TierCacheStorageWriter(cache, step=1)
    out["versions"] = []
    for step in (1, 2):
        writer.step = step
        dcp.save({**_dtensors(world, full_tensors(step)), "step": step}, storage_writer=writer)
        out["versions"].append(writer.version_id)
    out["reused"] = {ref: load(ref, step) for ref, step in (("main", 2), ("main~1", 1))}
    writer.step = 3
    dcp.save({**_dtensors(world, full_tensors(3)), "step": 3}, storage_writer=writer, checkpoint_id="best")
    out["versions"].append(writer.version_id)
    out["tagged"] = load("best", 3)
    # no_dist while the group is up: rank 0 alone saves and loads its own version, whole tensors.
    if rank == 0:
        solo = TierCacheStorageWriter(cache, step=4, branch="solo")
        dcp.save({**full_tensors(4), "step": 4}, storage_writer=solo, no_dist=True)
        out["solo"] = [solo.version_id, load("solo", 4, no_dist=True)]
    dist.barrier()
    # use_collectives=False: every rank saves a version of its own, on its own branch.
    own = TierCacheStorageWriter(cache, step=5, branch=f"rank{rank}")
    dcp.save({**full_tensors(5), "step": 5}, storage_writer=own, use_collectives=False)
    out["own"] = [own.version_id, load(f"rank{rank}", 5, no_dist=True)]
    dist.barrier()
    out["group_after"] = load("best", 3)  # the group still works after the saves without it


def scenario_dcp_abort(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Rank 1's writes fail during one dcp.save; then a dcp.save, a save(group=) and a dcp.load of the first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tiercache.integrations.dcp import TierCacheStorageWriter

    armed = [rank == 1]

    def refuse() -> None:
        if armed[0]:
            raise StorageError("injected: node b refuses the write")

    _fail_chunk_puts(cache, refuse)
    w1 = TierCacheStorageWriter(cache, step=1)
    try:
        dcp.save({**_dtensors(world, full_tensors(1)), "step": 1}, storage_writer=w1)
    except CheckpointException as e:
        out["abort"] = sorted(e.failures)
    armed[0] = False
    out["aborted"] = [w1.version_id, _levels(w1.handle)]

    # Rank 1's DCP step fails before its write_data: no round there.
    w1b = TierCacheStorageWriter(cache, step=1)
    try:
        dcp.save({**_dtensors(world, full_tensors(1)), "step": 1}, storage_writer=w1b,
                 planner=_refusing_planner(rank, at=1))
    except CheckpointException as e:
        out["plan_abort"] = sorted(e.failures)
    out["plan_aborted"] = [w1b.version_id, _levels(w1b.handle) if w1b.handle is not None else None]
    _next_saves_and_load(cache, rank, world, out, step=2, levels=_levels)
    out["last_restore"] = cache.last_restore.version if cache.last_restore is not None else None


def _refusing_planner(rank: int, *, at: int) -> Any:
    """A DCP save planner whose step fails on rank ``at`` before its write_data."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Refusing(DefaultSavePlanner):
        def finish_plan(self, new_plan: Any) -> Any:
            if rank == at:
                raise ValueError(f"injected: rank {rank}'s plan is refused")
            return super().finish_plan(new_plan)

    return Refusing()


def _next_saves_and_load(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], *, step: int,
                         levels: Callable[[Any], dict[str, Any]]) -> None:
    """After an aborted save: a clean dcp.save at ``step``, a save(group=) at ``step + 1``, a dcp.load of the first."""
    import torch.distributed.checkpoint as dcp

    from tiercache.integrations.dcp import TierCacheStorageReader, TierCacheStorageWriter

    w = TierCacheStorageWriter(cache, step=step)
    dcp.save({**_dtensors(world, full_tensors(step)), "step": step}, storage_writer=w)
    out["dcp"] = [w.version_id, levels(w.handle)]
    h = cache.save(node_state(rank, step + 1), step=step + 1, group=dist.group.WORLD)
    out["group"] = [h.version, levels(h)]
    state = {**_dtensors(world, {k: torch.zeros_like(v) for k, v in full_tensors(step).items()}), "step": 0}
    dcp.load(state, storage_reader=TierCacheStorageReader(cache, "main~1"))
    full = full_tensors(step)
    out["equal"] = [state["step"], *(bool(torch.equal(state[k].full_tensor(), full[k])) for k in full)]


def scenario_dcp_plan_abort(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                            work: Path) -> None:
    """Two ranks, rank 0 DCP's coordinator: rank 1's DCP step fails before its write_data.

    No third rank is there to give up on the version for rank 0. Then rank 0's step fails there
    (after it proposed the version); then a dcp.save, a save(group=) and a dcp.load.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tiercache.integrations.dcp import TierCacheStorageWriter

    def levels(handle: Any) -> dict[str, Any]:  # bounded: a level that never settles is a finding, not a hang
        got: dict[str, Any] = {}
        for lvl in ("local", "remote", "durable"):
            try:
                got[lvl] = handle.future(lvl).result(timeout=30)
            except FutureTimeout:
                got[lvl] = "HANG"
            except Exception as e:
                got[lvl] = [type(e).__name__, str(e)]
        return got

    for at in (1, 0):  # rank 1's step fails, then the coordinator's (after it proposed the version)
        w2 = TierCacheStorageWriter(cache, step=2)
        try:
            dcp.save({**_dtensors(world, full_tensors(2)), "step": 2}, storage_writer=w2,
                     planner=_refusing_planner(rank, at=at))
        except CheckpointException as e:
            out[f"abort{at}"] = sorted(e.failures)
        out[f"aborted{at}"] = [w2.version_id, levels(w2.handle) if w2.handle is not None else None]
    _next_saves_and_load(cache, rank, world, out, step=3, levels=levels)


def scenario_nodes_disk_full(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                             work: Path) -> None:
    """Node b's disk is full (no S3): two versions are lost; flush() and stats() must say so on every rank."""
    from tiercache.errors import TierFullError

    def full() -> None:
        if rank == 1:
            raise TierFullError("injected: node b's disk is full")

    _fail_chunk_puts(cache, full)
    handles = [cache.save(node_state(rank, step), step=step, group=dist.group.WORLD) for step in (1, 2)]
    out["versions"] = [h.version for h in handles]
    out["levels"] = [_levels(h) for h in handles]
    out["flush"] = _error(cache.flush)
    out["lost"] = cache.stats()["errors"]["lost_versions"]


def scenario_restore_seconds(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                             work: Path) -> None:
    """Save, then restore with the exchange that resolves the ref held 1 s on rank 0: the report counts it."""
    cache.save(node_state(rank, 1), step=1, group=dist.group.WORLD).wait("durable")

    def slow(tag: str, posted_by: int) -> None:
        if posted_by == 0 and tag.startswith("restore/") and tag.endswith("/resolve"):
            time.sleep(1.0)

    with failpoints.hooked("group.posted", slow):
        got = cache.restore("main", group=dist.group.WORLD)
    out["equal"] = _restored_equal(got, node_state(rank, 1))
    assert cache.last_restore is not None
    out["seconds"] = cache.last_restore.seconds


def scenario_shared_disk(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Ranks of one node hammer one disk directory: the same chunk object, and one ref each moves."""
    disk = core_of(cache).repo.durable["disk"]
    blob = bytes(range(256)) * 4096
    dist.barrier()
    for _ in range(20):
        disk.put("chunks/ab/" + "ab" * 16, blob)
        assert disk.get("chunks/ab/" + "ab" * 16) == blob
    for _ in range(10):
        while True:  # a counter in one shared ref, moved by compare-and-swap: no increment may be lost
            got = disk.read_ref("refs/branch/shared")
            value = int(got.data) + 1 if got else 1
            try:
                disk.write_ref("refs/branch/shared", str(value).encode(), expect=got.token if got else None)
                break
            except tiercache.ConflictError:
                continue  # another rank moved it first: read again


def replica_state(rank: int, step: int) -> dict[str, Any]:
    """A 4 MiB DDP replica (the same on every rank) with a per-rank leaf."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(1024, 1024, generator=g)}, "rng": torch.full((4,), rank + step), "step": step}


def node_state(rank: int, step: int) -> dict[str, Any]:
    """A state with a part of its own on every rank (a shard) and a replicated part (same on every rank)."""
    own = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(step)
    return {
        "shard": torch.randn(64, 1024, generator=own),
        "emb": torch.randn(128, 256, generator=shared),
        "rng": torch.full((4,), rank * 1000 + step, dtype=torch.int64),
        "step": step,
    }


def _levels(handle: Any) -> dict[str, Any]:
    """Each durability level of a handle: the version id, or ``[error type, message]``."""
    out: dict[str, Any] = {}
    for lvl in ("local", "replicated", "remote", "durable"):
        err = _error(lambda lvl=lvl: handle.wait(lvl))
        out[lvl] = err if err is not None else handle.version
    return out


def _restored_equal(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and bool(torch.equal(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_restored_equal(got[k], want[k]) for k in want)
    return bool(got == want)


def scenario_nodes_save(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Save two versions over nodes with their own disks, restore the newest in place."""
    group = dist.group.WORLD
    h1 = cache.save(node_state(rank, 1), step=1, group=group)
    out["v1_levels"] = _levels(h1)
    h2 = cache.save(node_state(rank, 2), step=2, group=group)
    out["v2_levels"] = _levels(h2)
    cache.flush()
    into = node_state(rank, 0)
    got = _restore(cache, "main", node_state(rank, 2), out, "restored", into=into)
    out["restored_in_place"] = got["shard"] is into["shard"]
    if rank == world - 1:  # the last rank's into= has a tensor of another shape: every rank refuses
        into["shard"] = torch.zeros(2, 2)
    out["mismatch"] = _error(lambda: cache.restore("main", into=into, group=group))


def _restore(cache: tiercache.TierCache, ref: str, want: Any, out: dict[str, Any], key: str, into: Any = None) -> Any:
    """Restore ``ref`` over the world; note whether it equals ``want`` and the bytes read per source."""
    got = cache.restore(ref, into=into, group=dist.group.WORLD)
    out[f"{key}_equal"] = _restored_equal(got, want)
    assert cache.last_restore is not None
    out[f"{key}_report"] = cache.last_restore.nbytes
    return got


def scenario_nodes_restore(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                           work: Path) -> None:
    """Restore ``main`` as a restarted job would (some node may have lost its disk)."""
    got = _restore(cache, "main", node_state(rank, 2), out, "restored")
    torch.save(got, work / f"restored{rank}.pt")


def scenario_nodes_restore_fails(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                                 work: Path) -> None:
    """Restore ``main`` where it cannot succeed: note the error this rank got, and how long it took."""
    t0 = time.monotonic()
    try:
        cache.restore("main", group=dist.group.WORLD)
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)]
    out["seconds"] = time.monotonic() - t0


def scenario_nodes_restore_fault(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                                 work: Path) -> None:
    """:func:`scenario_nodes_restore_fails` with one rank's fault where the ranks say what their nodes hold.

    ``run.json``'s ``fault``: ``rank``, and ``kind``: ``raise``, ``kill`` (SIGKILL) or ``sleep``
    (for ``seconds``).
    """
    fault = json.loads((work / "run.json").read_text())["fault"]

    def hook(tag: str) -> None:
        if fault["kind"] == "raise":
            raise StorageError(f"injected at {tag}/holding")
        if fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(fault["seconds"])

    with failpoints.hooked("group.holding", hook if rank == fault["rank"] else lambda tag: None):
        scenario_nodes_restore_fails(cache, rank, world, out, work)


def scenario_ddp_restore(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                         work: Path) -> None:
    """Restore ``main`` (saved by the ranks, a DDP replica each) and ``single`` (saved by one process)."""
    _restore(cache, "main", replica_state(rank, 2), out, "main")
    _restore(cache, "single", replica_state(0, 7), out, "single")


def scenario_ddp_save(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    out["v"] = cache.save(replica_state(rank, 2), step=2, group=dist.group.WORLD).wait("remote")


def scenario_peer_dies(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """The last rank dies while it sends its node's part to a peer; the others report what they see."""
    if rank == world - 1:
        reader = core_of(cache).reader
        read = reader.read_chunk

        def dying(*args: Any, **kw: Any) -> str:
            if threading.current_thread().name.startswith("tiercache-send"):
                os.kill(os.getpid(), signal.SIGKILL)
            return read(*args, **kw)

        reader.read_chunk = dying  # type: ignore[method-assign]
    h = cache.save(node_state(rank, 1), step=1, group=dist.group.WORLD)
    out["levels"] = _levels(h)


def scenario_nodes_burst(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                         work: Path) -> None:
    """Save 8 versions back to back without waiting (the default policy decides), then read every level."""
    handles = [cache.save(node_state(rank, step), step=step, group=dist.group.WORLD) for step in range(1, 9)]
    out["versions"] = [h.version for h in handles]
    out["levels"] = [_levels(h) for h in handles]
    cache.flush()
    _restore(cache, "main", node_state(rank, 8), out, "restored")
    out["history"] = [cache.resolve(f"main~{k}") for k in range(8)]


def scenario_nodes_s3_down(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                           work: Path) -> None:
    """Save 3 versions while S3 refuses: no save may raise; then read every level and restore."""
    out["save_errors"] = []
    handles = []
    for step in range(1, 4):
        try:
            handles.append(cache.save(node_state(rank, step), step=step, group=dist.group.WORLD))
        except Exception as e:  # the requirement is that none is raised: recorded to fail the test with it
            out["save_errors"].append([type(e).__name__, str(e)])
    out["versions"] = [h.version for h in handles]
    out["levels"] = [_levels(h) for h in handles]
    out["flush"] = _error(cache.flush)
    _restore(cache, "main", node_state(rank, 3), out, "restored")


def scenario_part_reads(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Save three versions to every level and note every read of a part manifest on any tier.

    With ``run.json`` ``"hang_s3_after": true`` the test's relay hangs S3 after the first version
    (the rank waits for ``DIR/hang`` to exist): the next versions must still reach ``local``; the
    reads are those made until then (the rank then touches ``DIR/local<rank>``).
    """
    opts = json.loads((work / "run.json").read_text())
    from bench.control_plane import record_part_reads

    reads: list[str] = []
    record_part_reads(cache, reads)
    group = dist.group.WORLD
    h = cache.save(node_state(rank, 1), step=1, group=group)
    out["levels"] = [_levels(h)]
    if opts.get("hang_s3_after"):
        dist.barrier()
        (work / f"ready{rank}").touch()
        while not (work / "hang").exists():
            time.sleep(0.05)
        for step in (2, 3):
            out.setdefault("local", []).append(_error(
                lambda step=step: cache.save(node_state(rank, step), step=step, group=group).wait("local")))
        out["reads"] = list(reads)
        (work / f"local{rank}").touch()  # the test lets S3 answer again, so closing need not wait it out
        return
    for step in (2, 3):
        out["levels"].append(_levels(cache.save(node_state(rank, step), step=step, group=group)))
    cache.flush()
    out["reads"] = reads


SCENARIOS = {"shared_disk": scenario_shared_disk, "ddp": scenario_ddp, "kill": scenario_kill,
             "sharded": scenario_sharded, "dcp_save": scenario_dcp_save, "dcp_load": scenario_dcp_load,
             "dcp_nodes": scenario_dcp_nodes, "dcp_abort": scenario_dcp_abort, "dcp_modes": scenario_dcp_modes,
             "dcp_plan_abort": scenario_dcp_plan_abort,
             "nodes_disk_full": scenario_nodes_disk_full, "restore_seconds": scenario_restore_seconds,
             "ddp_declared": scenario_ddp_declared, "replica_differs": scenario_replica_differs,
             "nodes_save": scenario_nodes_save,
             "nodes_restore": scenario_nodes_restore, "nodes_restore_fails": scenario_nodes_restore_fails,
             "nodes_restore_fault": scenario_nodes_restore_fault,
             "ddp_save": scenario_ddp_save,
             "ddp_restore": scenario_ddp_restore, "peer_dies": scenario_peer_dies,
             "throttled": scenario_throttled, "nodes_burst": scenario_nodes_burst,
             "nodes_s3_down": scenario_nodes_s3_down, "part_reads": scenario_part_reads}
#: Scenarios after which a rank is gone: tearing the group down would wait for it.
_BROKEN = {"kill", "peer_dies"}


def rank_config(shared: dict[str, Any]) -> dict[str, Any]:
    """The shared config with this rank's own ``TIERCACHE_<TABLE>__<FIELD>`` settings (its node's disk...) over it.

    A config given in code wins over the environment, so the per-rank variables the test sets are
    written into the rank's dict, as a rank's own config file would hold them.
    """
    cfg = json.loads(json.dumps(shared))
    for var, value in os.environ.items():
        if not var.startswith("TIERCACHE_") or var in ("TIERCACHE_FAILPOINTS", "TIERCACHE_LOG", "TIERCACHE_CONFIG"):
            continue
        *table, field = var[len("TIERCACHE_"):].lower().split("__", 1)
        (cfg.setdefault(table[0], {}) if table else cfg)[field] = value
    return cfg


#: This rank's relay to S3 (``run.json`` ``"s3_proxy": true``), for a scenario to make S3 hang.
S3_RELAY: Any = None


def run(scenario: str, rank: int, world: int, port: int, work: Path) -> None:
    """Run ``scenario`` as ``rank`` of ``world`` (the group meets on loopback ``port``).

    ``run.json`` (if the test wrote one) may say ``store``: the port of a store the test hosts,
    as torchrun's agent hosts one (so the death of rank 0 does not take the store with it), and
    ``timeout``: the group's timeout in seconds (default 20), and ``s3_proxy``: reach S3 through
    a relay of this rank's own (:data:`S3_RELAY`), and ``view``: ``"first save"`` if the
    scenario's first ``save(group=)`` makes the group's view (no ``cache.distributed()`` first).
    """
    env = work / "env.json"
    if env.exists():  # per-rank variables: the node (TIERCACHE_NODE) and its own disk directory
        os.environ.update(json.loads(env.read_text())[rank])
    opts = json.loads((work / "run.json").read_text()) if (work / "run.json").exists() else {}
    if opts.get("store"):
        store = dist.TCPStore("127.0.0.1", opts["store"], world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, Any] = {"rank": rank}
    config = rank_config(json.loads((work / "config.json").read_text()))
    if opts.get("s3_proxy"):  # this rank reaches S3 through a relay of its own, which it can make hang
        from tiercache.testing import ThrottledProxy

        global S3_RELAY
        S3_RELAY = ThrottledProxy(config["s3"]["endpoint_url"]).start()
        config["s3"]["endpoint_url"] = S3_RELAY.url
    cache = tiercache.open(config)
    # The trainer's collectives line the ranks up before the view is made, as a training loop's
    # steps do before its first save: the ranks' opens take their own times on a loaded machine,
    # and the view's exchange waits only the group's timeout (2 s in the chaos test), after which
    # a rank still opening failed the view on every rank.
    dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)
    if opts.get("view") == "first save":  # the scenario's first save(group=) makes the view, with the default
        from tiercache import group as views  # timeout (a trainer's cannot be set there): the run's instead

        views.DEFAULT_TIMEOUT = timedelta(seconds=opts.get("timeout", 20))
    else:
        try:
            cache.distributed(timeout=timedelta(seconds=opts.get("timeout", 20)))
        except tiercache.TierCacheError as e:  # the ranks could not make the group's view: every rank says why
            out["view_error"] = [type(e).__name__, str(e)]
            (work / f"rank{rank}.json").write_text(json.dumps(out))
            cache.close()
            return
    module, _, name = scenario.rpartition(":")
    found = importlib.import_module(module).SCENARIOS if module else SCENARIOS  # "module:name" for other workers
    found[name](cache, rank, world, out, work)
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    try:
        cache.close()  # (rank 0 hosts the store: it lingers until the others read the last verdicts)
    except tiercache.TierCacheError as e:  # a version the scenario failed on purpose is raised here, as promised
        out["close_error"] = [type(e).__name__, str(e)]
        (work / f"rank{rank}.json").write_text(json.dumps(out))
    if scenario not in _BROKEN and not opts.get("broken"):  # a peer is gone: a teardown would wait for it
        dist.destroy_process_group()


def rank_err_path(work: Path, rank: int) -> Path:
    """Where rank ``rank`` of a run in ``work`` writes its stderr."""
    return work / f"rank{rank}.err"


def forked(scenario: str, rank: int, world: int, port: int, work: Path) -> None:
    """Entry point of a forked rank: run, then leave without the parent's exit handlers.

    With ``"exit": "normal"`` in ``run.json``, an error leaves the way an uncaught exception
    leaves a trainer: through the interpreter's exit (its exit hooks run).
    """
    code = 0
    opts = json.loads((work / "run.json").read_text()) if (work / "run.json").exists() else {}
    # The rank's stderr (its tracebacks, logs and watchdog dump) goes to a file the test can show
    # (the fork server's own stderr is whatever the test that started it captured).
    sys.stderr.flush()
    err = os.open(rank_err_path(work, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(err, 2)
    os.close(err)
    # A hung rank shows where, instead of hanging the test.
    faulthandler.dump_traceback_later(opts.get("watchdog", 60), exit=True)
    try:
        run(scenario, rank, world, port, work)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if opts.get("exit") != "normal":
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
