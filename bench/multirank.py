"""``python -m bench.multirank``: aggregate write throughput of a multi-rank save, 1, 2 and 4 ranks.

The state is a DDP replica: every rank holds the same model (``--mib`` of float32 weights in
``--tensors`` tensors). A save is timed from a barrier before it to a barrier after every rank's
part is durable on the disk tier (fsynced); throughput is the model's bytes over that time, the
bytes the checkpoint holds, written once (replicated tensors are split among the ranks).

Rows per world size:

- ``tiercache``: ``cache.save(state, group=WORLD)`` (1 rank: a plain ``save``) then ``wait("local")``;
- ``tiercache DCP``: ``dcp.save`` through :class:`tiercache.integrations.dcp.TierCacheStorageWriter`;
- ``DCP FileSystemWriter``: ``dcp.save`` to a directory (its default ``sync_files=True``).

All ranks of a world size share one disk directory on the same filesystem (``--dir``, default a
temp dir), so the figures show how well each writer splits one node's bandwidth. Every repeat
changes every tensor first, so no run is shortened by dedup against the previous one.
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
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table

import tiercache
from tiercache.integrations.dcp import TierCacheStorageWriter

OUT = Path(__file__).resolve().parent / "out" / "multirank.json"
WRITERS = ("tiercache", "tiercache DCP", "DCP FileSystemWriter")


def _state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = (mib << 20) // 4 // tensors
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}


def _timed(fn: Any, world: int) -> float:
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    if world > 1:
        dist.barrier()
    return time.perf_counter() - t0


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: Path, out: Any) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    state = _state(args.mib, args.tensors)
    group = dist.group.WORLD if world > 1 else None
    cfg = {"disk": {"path": str(root / "tc")}, "ram": {"capacity": 3 * (args.mib << 20)},
           "policy": {"name": "write-through"}}
    times: dict[str, list[float]] = {w: [] for w in WRITERS}
    with tiercache.open(cfg) as cache:
        for i in range(args.repeat + 1):  # the first round warms up (arena, files, imports)
            for t in state.values():
                t.add_(1.0)
            runs = {
                "tiercache": lambda i=i: cache.save(state, step=i, group=group).wait("local"),
                "tiercache DCP": lambda i=i: dcp.save(state, storage_writer=TierCacheStorageWriter(cache, step=i),
                                                      no_dist=world == 1),
                "DCP FileSystemWriter": lambda i=i: dcp.save(state, checkpoint_id=str(root / f"fs{i}"),
                                                             no_dist=world == 1),
            }
            for name, fn in runs.items():
                took = _timed(fn, world)
                if i:
                    times[name].append(took)
    if rank == 0:
        out.put(times)
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, args: argparse.Namespace, base: Path) -> dict[str, list[float]]:
    """Run every writer ``args.repeat`` times on ``world`` ranks; return rank 0's seconds per run."""
    root = base / f"w{world}"
    root.mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, root, out)) for r in range(world)]
    for p in procs:
        p.start()
    times = out.get()
    for p in procs:
        p.join()
    shutil.rmtree(root, ignore_errors=True)
    return times


def main() -> None:
    """Parse arguments, measure, print the table and write ``bench/out/multirank.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="model size in MiB (every rank holds all of it)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--dir", default=None, help="where the disk tier and DCP directories go")
    args = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    base = Path(tempfile.mkdtemp(prefix="tc-multirank-", dir=args.dir))
    nbytes = args.mib << 20
    results: dict[str, Any] = {"mib": args.mib, "tensors": args.tensors, "repeat": args.repeat, "rows": []}
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            for name, runs in measure(world, args, base).items():
                med = statistics.median(runs)
                results["rows"].append({"world": world, "writer": name, "runs_s": runs, "median_s": med,
                                        "gb_per_s": nbytes / med / 1e9})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    single = {r["writer"]: r["gb_per_s"] for r in results["rows"] if r["world"] == 1}
    table = Table(title=f"multi-rank save of a {args.mib} MiB DDP model (disk tier, fsync), median of {args.repeat}")
    for col in ("ranks", "writer", "seconds", "aggregate GB/s", "vs 1 rank", "vs DCP FileSystemWriter"):
        table.add_column(col, justify="left" if col == "writer" else "right")
    fs = {r["world"]: r["gb_per_s"] for r in results["rows"] if r["writer"] == "DCP FileSystemWriter"}
    for r in results["rows"]:
        base_1 = single.get(r["writer"])
        table.add_row(str(r["world"]), r["writer"], f"{r['median_s']:.3f}", f"{r['gb_per_s']:.2f}",
                      f"{r['gb_per_s'] / base_1:.2f}x" if base_1 else "-",
                      f"{r['gb_per_s'] / fs[r['world']]:.2f}x" if r["world"] in fs else "-")
    Console().print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
