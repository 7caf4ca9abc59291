"""Paired check of this commit against a base commit: ``save()`` wait, time to local, cold restore.

``python bench/regress.py --base 22bf048`` checks the base out in a temporary git worktree, then
runs one side after the other, alternating (base, this, this, base, ...), each a fresh process
with its own tree first on ``PYTHONPATH`` and this checkout's copy of the script, and prints a
markdown table: each side's median over its runs (min-max), and the per-pair ratio this / base.
Drift of the machine hits both sides of a pair alike, so the ratio is the figure to read.

``python bench/regress.py --label NAME`` measures one side in this process and prints one JSON
line of medians. The state changes between saves (so every save writes), and every restore starts
with the version out of RAM and the page cache dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: The figures compared, in the table's order: JSON key, row label.
FIGURES = (
    ("save_wait_s", "`save()`: training waits"),
    ("to_local_s", "save until local (disk)"),
    ("restore_into_cold_s", "restore from disk into existing tensors, cold"),
)


def main() -> None:
    """Run the paired check (``--base``), or measure one side and print its medians as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default=None, help="the commit to compare with (omit it to measure one side)")
    p.add_argument("--pairs", type=int, default=3, help="alternating runs per side with --base (3)")
    p.add_argument("--label", default="", help="printed with the figures (the commit or worktree)")
    p.add_argument("--size", type=int, default=256 << 20, help="bytes of tensor data (256 MiB)")
    p.add_argument("--saves", type=int, default=6, help="saves timed per run (6)")
    p.add_argument("--restores", type=int, default=4, help="cold restores timed per run (4)")
    p.add_argument("--dir", default=None, help="where the disk tier goes (a temporary directory)")
    args = p.parse_args()
    if args.base is None:
        print(json.dumps(measure(args.label, args.size, args.saves, args.restores, args.dir)))
        return
    side = ["--size", str(args.size), "--saves", str(args.saves), "--restores", str(args.restores)]
    if args.dir is not None:
        side += ["--dir", args.dir]
    here = Path(__file__).resolve().parent.parent
    this = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with base_worktree(here, args.base) as base:
        runs = paired_runs(args.pairs, side_runner(base, args.base, side), side_runner(here, this, side))
    print(table(args.base, this, runs))


@contextmanager
def base_worktree(repo: Path, commit: str) -> Iterator[Path]:
    """A detached git worktree of ``commit`` in a temporary directory, removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="regress-base-"))
    tree = tmp / "base"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree), commit], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def side_runner(root: Path, label: str, side: list[str]) -> Callable[[], dict[str, Any]]:
    """A function that measures the tree at ``root`` once and returns its figures.

    It runs this checkout's script in a fresh process, from ``root``, with ``root`` first on
    ``PYTHONPATH`` (tiercache and the bench helpers of that commit).
    """
    script = str(Path(__file__).resolve())
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])

    def run() -> dict[str, Any]:
        out = subprocess.run([sys.executable, script, "--label", label, *side], cwd=root,
                             env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"the {label} side failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    return run


def paired_runs(
    pairs: int, base: Callable[[], dict[str, Any]], this: Callable[[], dict[str, Any]],
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``pairs`` pairs of ``(base figures, these figures)``, which side goes first flipping every pair.

    The order base, this, this, base, ... leaves a steady drift of the machine out of the ratios.
    """
    runs = []
    for i in range(pairs):
        if i % 2 == 0:
            b = base()
            runs.append((b, this()))
        else:
            h = this()
            runs.append((base(), h))
    return runs


def table(base: str, this: str, runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """The markdown table of ``runs``: per side the median (min-max) in ms, and this / base per pair."""

    def spread(values: list[float], fmt: str) -> str:
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    lines = [f"| figure | {base} | {this} | {this} / {base} (per pair) |", "|---|---|---|---|"]
    for key, label in FIGURES:
        b = [pair[0][key] * 1e3 for pair in runs]
        h = [pair[1][key] * 1e3 for pair in runs]
        ratios = [y / x for x, y in zip(b, h, strict=True)]
        lines.append(f"| {label} | {spread(b, '{:.0f}')} ms | {spread(h, '{:.0f}')} ms | {spread(ratios, '{:.2f}x')} |")
    return "\n".join(lines)


def measure(label: str, size: int, saves: int, restores: int, where: str | None) -> dict[str, float | str]:
    """One side: the medians of ``saves`` saves and ``restores`` cold restores of a ``size``-byte state."""
    import tiercache
    from bench.baselines import drop_page_cache, memcpy
    from bench.save_restore import _prefaulted_like
    from bench.state import advance, make_state

    state = make_state(size)
    root = Path(tempfile.mkdtemp(dir=where))
    cfg = {"ram": {"capacity": 3 * size}, "disk": {"path": str(root / "disk")},
           "policy": {"name": "write-through"}}
    waits, to_local, restore_s, copies = [], [], [], []
    try:
        with tiercache.open(cfg) as cache:
            cache.save(state, step=0).wait("local")  # the arena is allocated outside the timings
            for i in range(saves):
                advance(state)
                copies.append(memcpy(state))
                t0 = time.perf_counter()
                handle = cache.save(state, step=i + 1)
                t1 = time.perf_counter()
                handle.wait("local")
                waits.append(t1 - t0)
                to_local.append(time.perf_counter() - t0)
            into = _prefaulted_like(state)
            for _ in range(restores):
                if "ram" in {v.id: v.tiers for v in cache.versions()}[handle.version]:
                    cache.evict(handle.version, "ram")
                drop_page_cache(root / "disk")
                t0 = time.perf_counter()
                cache.restore(handle.version, into=into)
                restore_s.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    return {"label": label, "save_wait_s": med(waits), "to_local_s": med(to_local),
            "restore_into_cold_s": med(restore_s), "memcpy_s": med(copies)}


if __name__ == "__main__":
    main()
