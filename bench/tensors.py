"""``python -m bench tensors``: many small tensors, where per-tensor work decides, against torch and DCP.

A state of ``N`` tensors of 256 float32 each (1 KiB: the optimizer and norm parameters of a large
model are many tensors this small) is saved and restored, in one process, by:

* ``torch.save`` (to one file, fsynced) and ``torch.load`` (``weights_only=True``, new tensors);
* DCP: ``dcp.save`` with a FileSystemWriter (``io_threads`` threads, fsynced) and ``dcp.load`` into a
  state of the same shape allocated beforehand (DCP has no load into new tensors); only up to
  ``--dcp-max`` tensors (20,000): its load of 20,000 tensors already takes tens of seconds;
* tiercache on a disk-only cache (``write-through``): ``save()`` until ``local``, then, each in a
  cache opened for it (``tc.open``, timed apart), ``restore`` into new tensors and
  ``restore(into=...)`` into tensors allocated beforehand (each reads and parses the manifest);
* raw reads of the cache's chunk files, the bytes a restore must move without any per-tensor work:
  ``raw.read`` with O_DIRECT into pre-faulted aligned memory in 64 MiB requests (the disk read
  limit of the main bench, and how the disk tier reads), ``raw.read_cached`` through the page
  cache with ``readinto`` into one buffer allocated beforehand (a memcpy from the page cache);
* two ablations of the restore into existing tensors: ``tc.manifest``, parsing the version's
  manifest alone (``Version.from_json`` of its bytes), and ``into.ask``, asking each tensor of
  ``into`` for its address, dtype and shape once (the least any restore into existing tensors
  does per tensor in Python).

The files are written just before they are read (the page cache is warm; O_DIRECT bypasses it).
The tensors of ``into`` are made with ``zeros_like`` (touched, as a built model's are). Each of
``--rounds`` rounds runs the three in rotated order, and each
round's tiercache times are divided by the same round's baseline (the machine's speed drifts
between rounds); the table gives the median of the per-round ratios and their range, and the
median seconds. Writes ``bench/out/tensors.json``.

Example::

    python -m bench tensors --counts 20000,100000 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import tiercache
from bench.baselines import odirect_read, torch_load, torch_save
from tiercache.config import DiskConfig
from tiercache.manifest import Version

OUT = Path(__file__).resolve().parent / "out"
#: Floats per tensor.
ELEMENTS = 256

#: ``(key, what it is divided by, what the table calls it)``: the per-round ratios reported.
RATIOS = (
    ("tc.restore", "torch.load", "restore into new tensors / torch.load"),
    ("tc.restore", "dcp.load", "restore into new tensors / dcp.load (into existing)"),
    ("tc.restore_into", "dcp.load", "restore into existing / dcp.load"),
    ("tc.restore_into", "raw.read", "restore into existing / raw O_DIRECT read of its chunks"),
    ("tc.restore_into", "raw.read_cached", "restore into existing / read of its chunks from the page cache"),
    ("into.ask", "raw.read", "asking each tensor its address, dtype, shape / raw O_DIRECT read"),
    ("tc.save_local", "torch.save", "save() until local / torch.save + fsync"),
    ("tc.save_local", "dcp.save", "save() until local / dcp.save"),
)


def make_state(count: int) -> dict[str, torch.Tensor]:
    """``count`` tensors of :data:`ELEMENTS` random float32, keyed like a model's parameters."""
    g = torch.Generator().manual_seed(count)
    return {f"layers.{i // 4}.p{i % 4}": torch.randn(ELEMENTS, generator=g) for i in range(count)}


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _torch(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    path = work / "state.pt"
    out = {"torch.save": torch_save(state, path)}
    gc.collect()
    out["torch.load"] = torch_load(path)
    path.unlink()
    return out


def _dcp(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    directory = work / "dcp"
    threads = DiskConfig.model_fields["io_threads"].default
    out = {"dcp.save": _timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=threads),
                                               no_dist=True))}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    gc.collect()
    out["dcp.load"] = _timed(lambda: dcp.load(target, storage_reader=FileSystemReader(directory), no_dist=True))
    assert all(torch.equal(target[k], v) for k, v in state.items()), "dcp.load read other bytes"
    shutil.rmtree(directory)
    return out


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


def _raw_read_direct(root: Path) -> float:
    """Read every chunk file under ``root`` with O_DIRECT: the disk read limit."""
    return sum(odirect_read(p) for p in _chunk_files(root))


def _ask(into: dict[str, torch.Tensor]) -> float:
    """Ask every tensor of ``into`` for its address, dtype and shape once."""
    tensors = list(into.values())
    t0 = time.perf_counter()
    for attr in (torch.Tensor.data_ptr, operator.attrgetter("dtype"), operator.attrgetter("shape")):
        list(map(attr, tensors))
    return time.perf_counter() - t0


def _raw_read(root: Path) -> float:
    """Read every chunk file under ``root`` through the page cache into one buffer allocated beforehand."""
    files = _chunk_files(root)
    buf = bytearray(sum(p.stat().st_size for p in files))
    view = memoryview(buf)
    t0 = time.perf_counter()
    pos = 0
    for p in files:
        with p.open("rb", buffering=0) as f:
            pos += f.readinto(view[pos:])
    return time.perf_counter() - t0


def _tiercache(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    root = work / "tc"
    config = {"disk": {"path": str(root)}, "policy": {"name": "write-through"}}
    out: dict[str, float] = {}
    with tiercache.open(config) as cache:
        t0 = time.perf_counter()
        handle = cache.save(state, step=1)
        out["tc.save_wait"] = time.perf_counter() - t0
        handle.wait("local")
        out["tc.save_local"] = time.perf_counter() - t0
    out["raw.read_cached"] = _raw_read(root)
    out["raw.read"] = _raw_read_direct(root)
    manifest = next((root / "versions").glob("*.json")).read_bytes()
    gc.collect()
    t0 = time.perf_counter()
    Version.from_json(manifest)
    out["tc.manifest"] = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    with tiercache.open(config) as cache:
        out["tc.open"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        got = cache.restore("main")
        out["tc.restore"] = time.perf_counter() - t1
    assert all(torch.equal(got[k], v) for k, v in state.items()), "restore read other bytes"
    del got
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    out["into.ask"] = _ask(into)
    gc.collect()
    with tiercache.open(config) as cache:
        t0 = time.perf_counter()
        cache.restore("main", into=into)
        out["tc.restore_into"] = time.perf_counter() - t0
    assert all(torch.equal(into[k], v) for k, v in state.items()), "restore(into=) read other bytes"
    shutil.rmtree(root)
    return out


KINDS: dict[str, Callable[[dict[str, torch.Tensor], Path], dict[str, float]]] = {
    "torch": _torch, "dcp": _dcp, "tiercache": _tiercache,
}


def run(count: int, rounds: int, work: Path, console: Console, *, dcp_max: int) -> list[dict[str, float]]:
    """Every kind once per round, in rotated order (DCP only up to ``dcp_max`` tensors); each round's seconds."""
    state = make_state(count)
    names = [k for k in KINDS if k != "dcp" or count <= dcp_max]
    out = []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        seconds: dict[str, float] = {}
        for name in order:
            seconds.update(KINDS[name](state, work))
            gc.collect()
        console.print(f"{count} tensors, round {r + 1}/{rounds} ({' > '.join(order)}): "
                      + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(seconds.items())))
        out.append(seconds)
    return out


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench tensors", description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="20000,100000", help="tensor counts to measure (20000,100000)")
    p.add_argument("--rounds", default=2, type=int, help="rounds per count (2)")
    p.add_argument("--dcp-max", default=20000, type=int,
                   help="largest count DCP runs at (20000: its load takes minutes beyond)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: bench/out)")
    args = p.parse_args(argv)
    try:
        args.counts = [int(c) for c in args.counts.split(",") if c.strip()]
    except ValueError:
        p.error(f"--counts must be comma-separated integers, got {args.counts!r}")
    if not args.counts or min(args.counts) < 1 or args.rounds < 1:
        p.error("--counts must name positive counts and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds, print the table, write ``bench/out/tensors.json``."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    OUT.mkdir(exist_ok=True)
    parent = args.dir or OUT
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiercache-tensors-", dir=parent))
    load = os.getloadavg()[0]
    results: dict[int, list[dict[str, float]]] = {}
    try:
        for count in args.counts:
            results[count] = run(count, args.rounds, work, console, dcp_max=args.dcp_max)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"{ELEMENTS} float32 per tensor; medians of {args.rounds} rounds, ratios per round")
    table.add_column("tensors", justify="right")
    table.add_column("measure")
    table.add_column("median", justify="right")
    table.add_column("range", justify="right")
    for count, rounds in results.items():
        for key in sorted(rounds[0]):
            values = [r[key] for r in rounds]
            table.add_row(str(count), f"{key} (s)", f"{statistics.median(values):.3f}",
                          f"{min(values):.3f}-{max(values):.3f}")
        for key, base, what in RATIOS:
            if base not in rounds[0]:
                continue
            ratios = [r[key] / r[base] for r in rounds]
            table.add_row(str(count), what, f"{statistics.median(ratios):.2f}x",
                          f"{min(ratios):.2f}-{max(ratios):.2f}x")
    console.print(table)
    console.print(f"load average (1 min) at start {load:.2f}, at end {os.getloadavg()[0]:.2f}")
    (OUT / "tensors.json").write_text(json.dumps(
        {"elements": ELEMENTS, "rounds": args.rounds, "results": {str(c): r for c, r in results.items()}}, indent=1))
    console.print(f"wrote {OUT / 'tensors.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
