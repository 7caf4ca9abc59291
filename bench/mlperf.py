"""``python -m bench mlperf``: an MLPerf-Storage-style checkpoint run, against the raw disk limits.

As MLPerf Storage's checkpointing workload does, each of R ranks (processes) writes its part of
one checkpoint (``--size`` split evenly), the page cache is dropped (as root; else each file is
fadvised out of it, which needs the files synced: ``drop_page_cache`` says which it used), and
each rank reads its part back. A phase's duration is its slowest rank's; its throughput is the
checkpoint's bytes over that duration (and the smallest per-rank throughput is shown beside it).
All ranks start a phase together (a barrier), and a rank's read lands in tensors it already holds
(a resumed model), so the read is I/O, not page faults.

Like with like: the raw read lands in page-aligned memory, so the tiercache ``read`` lands in
page-aligned tensors too (allocated and touched before the clock starts), which it reads with
``O_DIRECT`` straight into them. A model's own tensors come from torch's allocator, aligned to 64
bytes only: ``O_DIRECT`` cannot read into them, and every byte passes through a bounce buffer in
1 MiB requests and is copied out. That read (``read_torch``: the same version, the page cache
dropped again, into tensors from ``torch.empty_like``) is timed after the aligned one and shown in
its own column.

Per rank count, side by side: the raw limit (each rank ``O_DIRECT``-writes its bytes to a file of
its own and fsyncs it, then ``O_DIRECT``-reads it back), tiercache in each rank (``save()`` until
``local``; the read with a disk-only cache, so no RAM copy helps), and with ``--agent`` tiercache
through one node agent for all ranks (the write until ``local``; the read as above).

The disk's own speed drifts by tens of percent within minutes on a VM, so the kinds are not run one
after the other once each: each of ``--rounds`` rounds runs every kind once, in alternating order
(raw first in even rounds, last in odd ones), and each round's tiercache time is divided by the
same round's raw time. The table gives the median of those per-round ratios and their range.

Example::

    python -m bench mlperf --size 2GB --ranks 1,2,4,8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.baselines import drop_page_cache, odirect_read, odirect_write, settle_memory
from tiercache.config import parse_size

OUT = Path(__file__).resolve().parent / "out"


def _rank(kind: str, rank: int, part: int, root: str, config: dict[str, Any] | None, barrier: Any,
          results: Any) -> None:
    """One rank: write its part when the barrier opens, then read it back when it opens again."""
    import torch

    import tiercache
    from bench.save_restore import _prefaulted_like
    from bench.state import make_state

    torch.set_num_threads(1)
    path = Path(root) / f"rank{rank}.bin"
    if kind == "raw":
        barrier.wait()
        results.put((rank, "write", odirect_write(path, part)))
        barrier.wait()  # the parent drops the page cache
        barrier.wait()
        results.put((rank, "read", odirect_read(path)))
        return
    assert config is not None
    state = make_state(part, seed=rank)
    into_torch = _prefaulted_like(state)  # a model's own tensors: 64-byte aligned
    into = _aligned_like(state)  # page-aligned, as the raw read's memory
    with tiercache.open(config) as cache:
        cache.prepare(state, wait=True)  # the arena exists before the clock starts, as in a running job
        barrier.wait()
        t0 = time.perf_counter()
        h = cache.save(state, step=1, branch=f"rank{rank}")
        h.wait("local")
        results.put((rank, "write", time.perf_counter() - t0))
        version = h.version
    disk_only = {k: v for k, v in config.items() if k in ("disk", "chunk_bytes", "pack_below")}
    for phase, target in (("read", into), ("read_torch", into_torch)):
        barrier.wait()  # the parent drops the page cache
        barrier.wait()
        with tiercache.open(disk_only) as cache:
            t0 = time.perf_counter()
            cache.restore(version, into=target, resume=False)
            results.put((rank, phase, time.perf_counter() - t0))


def _aligned_like(state: Any) -> Any:
    """A tree shaped like ``state`` of new, touched tensors that start page-aligned (as ``restore()`` makes them)."""
    import torch

    from tiercache.restore import empty_aligned

    if isinstance(state, torch.Tensor):
        return empty_aligned(state.shape, state.dtype).fill_(1)
    if isinstance(state, dict):
        return {k: _aligned_like(v) for k, v in state.items()}
    return state


def _phase_run(kind: str, ranks: int, size: int, work: Path, config: dict[str, Any] | None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks + 1)
    results = ctx.Queue()
    part = size // ranks
    root = work / f"{kind}-{ranks}"
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        config = _on_disk(config, work, kind, ranks)
    procs = [ctx.Process(target=_rank, args=(kind, r, part, str(root), config, barrier, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    phases = ["write", "read"] if kind == "raw" else ["write", "read", "read_torch"]
    got: dict[str, list[float]] = {phase: [0.0] * ranks for phase in phases}
    barrier.wait(600)  # every rank ready: write
    method = ""
    for _ in phases[1:]:
        barrier.wait(1800)  # every rank is done with the phase before
        method = drop_page_cache(root)
        settle_memory()
        barrier.wait(600)  # read
    for _ in range(len(phases) * ranks):
        rank, phase, seconds = results.get(timeout=1800)
        got[phase][rank] = seconds
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise RuntimeError(f"{kind} rank exited {p.exitcode}")
    shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"cold_read": method}
    for phase, secs in got.items():
        slowest = max(secs)
        out[phase] = {"seconds": slowest, "gbps": size / slowest / 1e9,
                      "min_rank_gbps": min(part / s / 1e9 for s in secs), "ranks": secs}
    return out


def run(size: int, rank_counts: Sequence[int], work: Path, *, agent: bool, rounds: int,
        console: Console) -> dict[str, Any]:
    """Run every rank count, ``rounds`` rounds of every kind in alternating order.

    Returns:
        By ``"<kind>/<ranks>"``: the list of each round's results.
    """
    from bench.agent import _Agent, _with_agent
    from bench.save_restore import ram_capacity

    results: dict[str, Any] = {}
    for ranks in rank_counts:
        part = size // ranks
        cfg = {"ram": {"capacity": ram_capacity(part)}, "disk": {"path": "set per run"},
               "policy": {"name": "write-through"}}
        kinds: list[tuple[str, dict[str, Any] | None]] = [("raw", None), ("tiercache", cfg)]
        if agent:
            sock_dir = Path(tempfile.mkdtemp(prefix="tcm-", dir="/tmp"))
            kinds.append(("agent", _with_agent({**cfg, "ram": {"capacity": ram_capacity(size)}}, sock_dir)))
        for r in range(rounds):
            for kind, config in kinds if r % 2 == 0 else kinds[::-1]:
                console.print(f"mlperf: {ranks} rank(s), round {r + 1}/{rounds}, {kind}")
                runner = None
                if kind == "agent":  # one agent for the node, serving the disk path every rank uses
                    assert config is not None
                    runner = _Agent(_on_disk(config, work, kind, ranks), work / f"agent-{ranks}.log")
                try:
                    results.setdefault(f"{kind}/{ranks}", []).append(_phase_run(kind, ranks, size, work, config))
                finally:
                    if runner is not None:
                        runner.stop()
    return results


def ratios(results: dict[str, Any], key: str, phase: str) -> list[float]:
    """Each round's time of ``key`` (``"<kind>/<ranks>"``) over the same round's raw time, for ``phase``.

    ``read_torch`` (a read into tensors from torch's allocator) is set against the raw read.
    """
    raw = results[f"raw/{key.split('/')[1]}"]
    base = "read" if phase == "read_torch" else phase
    return [r[phase]["seconds"] / b[base]["seconds"] for r, b in zip(results[key], raw, strict=True)]


def _on_disk(config: dict[str, Any], work: Path, kind: str, ranks: int) -> dict[str, Any]:
    """``config`` with the disk tier of the run of ``kind`` with ``ranks`` ranks."""
    return {**config, "disk": {**config["disk"], "path": str(work / f"{kind}-{ranks}" / "cache")}}


def render(results: dict[str, Any], size: int, console: Console) -> None:
    """Print one table: per rank count and kind, median write and read time and throughput, and per-round ratios."""
    rounds = len(next(iter(results.values())))
    table = Table(title=f"MLPerf-Storage-style checkpoint, {size / 1e9:.2f} GB per checkpoint, {rounds} round(s)",
                  box=None, header_style="bold")
    for name in ("ranks", "kind", "write s", "write GB/s", "read s", "read GB/s",
                 "vs raw write (range)", "vs raw read (range)", "read into torch tensors vs raw read (range)"):
        table.add_column(name, justify="left" if name == "kind" else "right")
    for key, runs in results.items():
        kind, ranks = key.split("/")
        w = statistics.median(r["write"]["seconds"] for r in runs)
        rd = statistics.median(r["read"]["seconds"] for r in runs)
        cells = []
        for phase in ("write", "read", "read_torch"):
            if kind == "raw":
                cells.append("")
                continue
            got = ratios(results, key, phase)
            cells.append(f"{statistics.median(got):.2f}x ({min(got):.2f}-{max(got):.2f})")
        table.add_row(ranks, kind, f"{w:.3f}", f"{size / w / 1e9:.2f}", f"{rd:.3f}", f"{size / rd / 1e9:.2f}", *cells)
    console.print(table)
    method = next(iter(results.values()))[0]["cold_read"]
    console.print(f"cold reads: page cache dropped with {method}; ratios are per round (kinds alternate), medians")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench mlperf [--size 2GB] [--ranks 1,2,4,8] [--rounds 3] [--agent] [--dir D]``."""
    p = argparse.ArgumentParser(prog="python -m bench mlperf", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GB", type=parse_size, help="bytes of one checkpoint, all ranks together")
    p.add_argument("--ranks", default="1,2,4,8", help="rank counts to run (comma-separated)")
    p.add_argument("--agent", action="store_true", help="also run the ranks through one node agent")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every kind, in alternating order (default 3)")
    p.add_argument("--dir", type=Path, default=None, help="directory on the filesystem to measure (bench/out)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    console = Console(width=None if sys.stdout.isatty() else 200)
    OUT.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiercache-mlperf-", dir=args.dir or OUT))
    try:
        results = run(args.size, counts, work, agent=args.agent, rounds=args.rounds, console=console)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    render(results, args.size, console)
    (OUT / "mlperf.json").write_text(json.dumps({"size": args.size, "results": results}, indent=2))
    console.print(f"wrote {OUT / 'mlperf.json'}; load average at end {os.getloadavg()[0]:.2f}")
    return 0
