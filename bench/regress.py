"""One side of a paired check of two commits: ``save()`` wait, time to local, cold restore into existing tensors.

Run it alternately against a worktree of each commit (the script from this checkout, tiercache and
the bench helpers from the worktree on ``PYTHONPATH``); it prints one JSON line of medians::

    git worktree add /tmp/before <commit>
    for i in 1 2 3 4; do for r in /tmp/before "$PWD"; do
      (cd "$r" && PYTHONPATH="$r" "$OLDPWD/.venv/bin/python" "$OLDPWD/bench/regress.py" --label "$r")
    done; done

The state changes between saves (so every save writes), and every restore starts with the version
out of RAM and the page cache dropped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import tiercache
from bench.baselines import drop_page_cache, memcpy
from bench.save_restore import _prefaulted_like
from bench.state import advance, make_state


def main() -> None:
    """Measure one side and print its medians as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="", help="printed with the figures (the commit or worktree)")
    p.add_argument("--size", type=int, default=256 << 20, help="bytes of tensor data (256 MiB)")
    p.add_argument("--saves", type=int, default=8, help="saves timed (8)")
    p.add_argument("--restores", type=int, default=6, help="cold restores timed (6)")
    p.add_argument("--dir", default=None, help="where the disk tier goes (a temporary directory)")
    args = p.parse_args()
    state = make_state(args.size)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    cfg = {"ram": {"capacity": 3 * args.size}, "disk": {"path": str(root / "disk")},
           "policy": {"name": "write-through"}}
    waits, to_local, restores, copies = [], [], [], []
    try:
        with tiercache.open(cfg) as cache:
            cache.save(state, step=0).wait("local")  # the arena is allocated outside the timings
            for i in range(args.saves):
                advance(state)
                copies.append(memcpy(state))
                t0 = time.perf_counter()
                handle = cache.save(state, step=i + 1)
                t1 = time.perf_counter()
                handle.wait("local")
                waits.append(t1 - t0)
                to_local.append(time.perf_counter() - t0)
            into = _prefaulted_like(state)
            for _ in range(args.restores):
                if "ram" in {v.id: v.tiers for v in cache.versions()}[handle.version]:
                    cache.evict(handle.version, "ram")
                drop_page_cache(root / "disk")
                t0 = time.perf_counter()
                cache.restore(handle.version, into=into)
                restores.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    print(json.dumps({"label": args.label, "save_wait_s": med(waits), "to_local_s": med(to_local),
                      "restore_into_cold_s": med(restores), "memcpy_s": med(copies)}))


if __name__ == "__main__":
    main()
