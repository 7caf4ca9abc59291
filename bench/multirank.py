"""``python -m bench.multirank``: multi-rank saves and restores, 1, 2 and 4 ranks, side by side with DCP.

The state is a DDP replica: every rank holds the same model (``--mib`` of float32 weights in
``--tensors`` tensors). Two tables, from one run:

**Save** (all ranks on one node, one disk directory, ``--dir`` or a temp dir): a save is timed from
a barrier before it to a barrier after every rank's part is durable on the disk tier (fsynced);
throughput is the model's bytes over that time, the bytes the checkpoint holds, written once.
Every save changes every tensor first, so no run is shortened by dedup. Rows per world size:

- ``tiercache``: ``cache.save(state, group=WORLD, replicated=["model"])`` (1 rank: a plain
  ``save``), then ``wait("local")``: each rank hashes and writes its share of the replica;
- ``tiercache, not declared``: the same without ``replicated=`` (every rank hashes all of it);
- ``tiercache DCP``: ``dcp.save`` through :class:`tiercache.integrations.dcp.TierCacheStorageWriter`;
- ``DCP FileSystemWriter``: ``dcp.save`` to a directory (its default ``sync_files=True``);
- with ``--agent``, ``tiercache, node agent``: the first row through one node agent for all ranks
  (an ``[agent]`` table; the agent hashes and writes every rank's part, the ranks agree).

For the tiercache rows the table also shows the stall: how long rank 0's ``save()`` call took (the
copy into the arena and the group's first exchange), median of the runs.

**Restore** (2 and 4 ranks, each rank a node of its own with its own disk directory, the S3 tier
on the embedded SeaweedFS server behind a byte-counting relay, ``[peers] copies = 1``): a save to
S3 alone is timed until ``remote``, next to a boto3 multipart upload of the same bytes through the
same relay (16 MiB parts, 8 at a time); after one save to all tiers, fresh caches
on the same ranks (no RAM tier, so nothing is served from memory) restore the version:

- ``own disk``: every node from its own disk;
- ``lost node, from peers``: the last node's disk deleted and S3 refusing connections: that node's
  rank gets the state from a peer's copy over the group;
- ``S3 alone``: caches with only the S3 tier: each chunk read once by one rank and sent to the
  others over the group. ``S3 bytes`` is what the relay forwarded from S3 over one copy of the
  state.

Figures are the median of ``--repeat`` runs (restore rows: one run each, after a warm-up restore).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table

import tiercache
from bench.baselines import s3_upload
from tiercache.integrations.dcp import TierCacheStorageWriter

OUT = Path(__file__).resolve().parent / "out" / "multirank.json"
WRITERS = ("tiercache", "tiercache, not declared", "tiercache DCP", "DCP FileSystemWriter")
AGENT = "tiercache, node agent"
RESTORES = ("own disk", "lost node, from peers", "S3 alone")


def _state(mib: int, tensors: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = (mib << 20) // 4 // tensors
    return {"model": {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}}


def _timed(fn: Callable[[], Any], world: int) -> float:
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    if world > 1:
        dist.barrier()
    return time.perf_counter() - t0


def _init(rank: int, world: int, port: int) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _save_rank(rank: int, world: int, port: int, args: argparse.Namespace, root: Path, out: Any) -> None:
    _init(rank, world, port)
    state = _state(args.mib, args.tensors)
    group = dist.group.WORLD if world > 1 else None
    cfg = {"disk": {"path": str(root / "tc")}, "ram": {"capacity": 3 * (args.mib << 20)},
           "policy": {"name": "write-through"}}
    times: dict[str, list[float]] = {w: [] for w in (*WRITERS, AGENT)}
    stalls: dict[str, list[float]] = {w: [] for w in ("tiercache", AGENT)}

    def saved(c: tiercache.TierCache, name: str, i: int, **kw: Any) -> None:
        t0 = time.perf_counter()
        handle = c.save(state, step=i, group=group, **kw)
        stalls[name].append(time.perf_counter() - t0)
        handle.wait("local")

    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tiercache.open(cfg))
        agent_cache = stack.enter_context(tiercache.open(args.agent_config)) if args.agent_config else None
        shared = ["model"] if group is not None else []
        for i in range(args.repeat + 1):  # the first round warms up (arena, files, imports)
            runs = {
                "tiercache": lambda i=i: saved(cache, "tiercache", i, replicated=shared),
                "tiercache, not declared": lambda i=i: cache.save(state, step=i, group=group).wait("local"),
                "tiercache DCP": lambda i=i: dcp.save(state, storage_writer=TierCacheStorageWriter(cache, step=i),
                                                      no_dist=world == 1),
                "DCP FileSystemWriter": lambda i=i: dcp.save(state, checkpoint_id=str(root / f"fs{i}"),
                                                             no_dist=world == 1),
            }
            if agent_cache is not None:
                runs[AGENT] = lambda i=i: saved(agent_cache, AGENT, i, replicated=shared)
            for name, fn in runs.items():
                for t in state["model"].values():  # new bytes for every save: none dedups against the last
                    t.add_(1.0)
                took = _timed(fn, world)
                if i:
                    times[name].append(took)
    if rank == 0:
        out.put({"times": {k: v for k, v in times.items() if v}, "stalls": {k: v for k, v in stalls.items() if v}})
    if world > 1:
        dist.destroy_process_group()


def _restore_rank(rank: int, world: int, port: int, args: argparse.Namespace, root: Path, s3: dict[str, Any],
                  control: Any, out: Any) -> None:
    """One rank of the restore table; ``control`` tells the parent when to cut a node or S3 (and back)."""
    os.environ["TIERCACHE_NODE"] = f"n{rank}"
    _init(rank, world, port)
    state = _state(args.mib, args.tensors)
    disk = {"path": str(root / f"n{rank}")}
    full = {"disk": disk, "s3": s3, "ram": {"capacity": 3 * (args.mib << 20)}, "peers": {"copies": 1},
            "policy": {"name": "write-through"}}
    result: dict[str, Any] = {}
    with tiercache.open({"s3": {**s3, "url": s3["url"] + "-remote"}, "ram": full["ram"]}) as cache:
        # Time to remote alone: what the ranks' split upload takes, next to boto3's of the same bytes.
        # A first save warms up (the arena, connections, the store's conditional-write probe).
        runs = []
        for step in range(args.repeat + 1):
            for t in state["model"].values():
                t.add_(1.0)
            runs.append(_timed(lambda step=step: cache.save(state, step=step, group=dist.group.WORLD,
                                                            replicated=["model"]).wait("remote"), world))
        result["remote_s"] = statistics.median(runs[1:])
    with tiercache.open(full) as cache:
        h = cache.save(state, step=1, group=dist.group.WORLD, replicated=["model"])
        for level in ("local", "replicated", "remote"):
            h.wait(level)

    def restore(config: dict[str, Any]) -> tuple[float, dict[str, int]]:
        with tiercache.open(config) as cache:
            took = _timed(lambda: cache.restore("main", group=dist.group.WORLD), world)
            assert cache.last_restore is not None
            return took, cache.last_restore.nbytes

    local = {"disk": disk, "s3": s3, "peers": {"copies": 1}}
    restore(local)  # warm-up: imports, page cache of the manifests
    result["own disk"] = restore(local)
    _step(rank, control, "lose node")
    result["lost node, from peers"] = restore(local)
    _step(rank, control, "S3 back")
    result["S3 alone"] = restore({"s3": s3})
    _step(rank, control, "S3 counted")
    out.put((rank, result))
    dist.destroy_process_group()


def _step(rank: int, control: Any, what: str) -> None:
    """Let the parent act between two restores (rank 0 asks, every rank waits for it)."""
    dist.barrier()
    if rank == 0:
        control[0].put(what)
        control[1].get()
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target: Callable[..., None], world: int, *args: Any) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    return [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]


def measure_saves(world: int, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Run every writer ``args.repeat`` times on ``world`` ranks; rank 0's seconds per run (and ``save()`` stalls)."""
    from bench.agent import _Agent, _with_agent

    root = base / f"w{world}"
    root.mkdir(parents=True)
    agent = None
    args.agent_config = None
    if args.agent:
        sock = Path(tempfile.mkdtemp(prefix="tcb-"))  # a short path: socket names are limited to 107 bytes
        args.agent_config = _with_agent({"disk": {"path": str(root / "tca")}, "policy": {"name": "write-through"},
                                         "ram": {"capacity": 3 * world * (args.mib << 20)}}, sock)
        agent = _Agent(args.agent_config, root / "agent.log")
    try:
        out = multiprocessing.get_context("spawn").Queue()
        procs = _spawn(_save_rank, world, args, root, out)
        for p in procs:
            p.start()
        got = out.get()
        for p in procs:
            p.join()
    finally:
        if agent is not None:
            agent.stop()
    shutil.rmtree(root, ignore_errors=True)
    return got  # type: ignore[no-any-return]


def measure_restores(world: int, args: argparse.Namespace, base: Path, server: Any) -> dict[str, Any]:
    """The restore table's rows for ``world`` ranks (one node each)."""
    from tiercache.testing import ThrottledProxy

    root = base / f"r{world}"
    root.mkdir(parents=True)
    nbytes = args.mib << 20
    ctx = multiprocessing.get_context("spawn")
    out, control = ctx.Queue(), (ctx.Queue(), ctx.Queue())
    with ThrottledProxy(server.endpoint_url) as relay:
        s3 = {"url": f"s3://{server.bucket}/multirank-{world}-{time.time_ns()}", "endpoint_url": relay.url}
        procs = _spawn(_restore_rank, world, args, root, s3, control, out)
        for p in procs:
            p.start()
        assert control[0].get() == "lose node"
        shutil.rmtree(root / f"n{world - 1}")
        relay.mode = "refuse"
        control[1].put(None)
        assert control[0].get() == "S3 back"
        relay.mode = "up"
        before = relay.bytes_forwarded("down")
        control[1].put(None)
        assert control[0].get() == "S3 counted"
        s3_bytes = relay.bytes_forwarded("down") - before
        control[1].put(None)
        results = dict(out.get() for _ in procs)
        for p in procs:
            p.join()
        # Through the same relay as the ranks' S3 traffic, so both pay for it alike.
        client = _boto3(relay.url)
        payload = root / "payload.bin"
        payload.write_bytes(os.urandom(nbytes))
        boto = statistics.median(s3_upload(client, payload, server.bucket, f"bench/multirank-{world}.bin",
                                           part_size=16 << 20, concurrency=8) for _ in range(args.repeat))
    shutil.rmtree(root, ignore_errors=True)
    lost = results[world - 1]["lost node, from peers"][1]
    return {"remote_s": results[0]["remote_s"], "boto3_upload_s": boto, "s3_bytes": s3_bytes,
            "lost_node_read": lost, **{name: results[0][name][0] for name in RESTORES}}


def _boto3(endpoint_url: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url, config=Config(s3={"addressing_style": "path"},
                                                                        max_pool_connections=16))


def main() -> None:
    """Parse arguments, measure, print the tables and write ``bench/out/multirank.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="model size in MiB (every rank holds all of it)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--restore-worlds", default="2,4")
    parser.add_argument("--dir", default=None, help="where the disk tiers and DCP directories go")
    parser.add_argument("--agent", action="store_true", help="also save through one node agent for all ranks")
    args = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    base = Path(tempfile.mkdtemp(prefix="tc-multirank-", dir=args.dir))
    nbytes = args.mib << 20
    results: dict[str, Any] = {"mib": args.mib, "tensors": args.tensors, "repeat": args.repeat, "rows": [],
                               "restores": []}
    try:
        for world in (int(w) for w in args.worlds.split(",") if w):
            got = measure_saves(world, args, base)
            for name, runs in got["times"].items():
                med = statistics.median(runs)
                stall = got["stalls"].get(name)
                results["rows"].append({"world": world, "writer": name, "runs_s": runs, "median_s": med,
                                        "gb_per_s": nbytes / med / 1e9,
                                        "stall_s": statistics.median(stall) if stall else None})
        worlds = [int(w) for w in args.restore_worlds.split(",") if w]
        if worlds:
            from tiercache.testing import LocalS3

            server = LocalS3(bucket="tiercache-bench")
            server.start()
            os.environ.update(server.env())
            try:
                for world in worlds:
                    results["restores"].append({"world": world, **measure_restores(world, args, base, server)})
            finally:
                server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    console = Console()
    _print_saves(console, results, args)
    _print_restores(console, results, nbytes)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))


def _print_saves(console: Console, results: dict[str, Any], args: argparse.Namespace) -> None:
    rows = results["rows"]
    if not rows:
        return
    single = {r["writer"]: r["gb_per_s"] for r in rows if r["world"] == 1}
    fs = {r["world"]: r["gb_per_s"] for r in rows if r["writer"] == "DCP FileSystemWriter"}
    table = Table(title=f"multi-rank save of a {args.mib} MiB DDP model (disk tier, fsync), median of {args.repeat}")
    for col in ("ranks", "writer", "seconds", "aggregate GB/s", "vs 1 rank", "vs DCP FileSystemWriter",
                "save() stall s"):
        table.add_column(col, justify="left" if col == "writer" else "right")
    for r in rows:
        base_1 = single.get(r["writer"])
        table.add_row(str(r["world"]), r["writer"], f"{r['median_s']:.3f}", f"{r['gb_per_s']:.2f}",
                      f"{r['gb_per_s'] / base_1:.2f}x" if base_1 else "-",
                      f"{r['gb_per_s'] / fs[r['world']]:.2f}x" if r["world"] in fs else "-",
                      f"{r['stall_s']:.3f}" if r.get("stall_s") is not None else "-")
    console.print(table)


def _print_restores(console: Console, results: dict[str, Any], nbytes: int) -> None:
    if not results["restores"]:
        return
    table = Table(title="multi-rank restore, one node per rank, [peers] copies = 1 (seconds; GB/s per rank)")
    for col in ("ranks", "time to remote", "boto3 upload", "own disk", "lost node, from peers", "S3 alone",
                "S3 bytes / state", "lost node read"):
        table.add_column(col, justify="right")
    for r in results["restores"]:
        cells = [f"{r[name]:.3f} ({nbytes / r[name] / 1e9:.2f})" for name in RESTORES]
        table.add_row(str(r["world"]), f"{r['remote_s']:.3f} ({r['remote_s'] / r['boto3_upload_s']:.2f}x)",
                      f"{r['boto3_upload_s']:.3f}", *cells, f"{r['s3_bytes'] / nbytes:.3f}",
                      ", ".join(f"{k} {v / nbytes:.2f}" for k, v in r["lost_node_read"].items()))
    console.print(table)


if __name__ == "__main__":
    main()
