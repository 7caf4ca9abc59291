"""``python -m bench.keep_rule``: what the keep rule costs in the capacity scenario, paired with a checkout before it.

The scenario of the keep rule (docs/policies.md, "The keep rule"): a disk with a ``capacity``
smaller than the versions saved, S3 behind a slow link (``ThrottledProxy``), the default policy
and retention, saves of growing and shrinking sizes a short pause apart, then ``close()``. Each run
is a fresh process on a fresh cache and bucket prefix; the runs of this checkout and of the one
given with ``--before`` (a directory holding another tiercache checkout, e.g. a ``git worktree``
of the commit before) alternate, so the disk's drift hits both alike. Per run it reports the
median time inside ``save()``, the median time from ``save()`` to ``local`` for the versions that
reached it, how many versions reached ``local``, and how many of those are gone after ``close()``.

Example::

    git worktree add /tmp/before <commit>
    python -m bench.keep_rule --before /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, statistics, sys, time
import torch, tiercache
spec = json.loads(sys.argv[1])
sizes = spec["sizes"]
handles, stalls = [], []
g = torch.Generator().manual_seed(0)
states = [{"w": torch.rand(mb * 250_000, generator=g)} for mb in sizes]  # random floats: no codec helps
with tiercache.open(spec["config"]) as cache:
    for step, state in enumerate(states):
        t0 = time.perf_counter()
        h = cache.save(state, step=step)
        stalls.append(time.perf_counter() - t0)
        handles.append((h, t0))
        time.sleep(spec["pause"])
    local = []
    for h, t0 in handles:
        try:
            h.wait("local", timeout=600)
            local.append(time.perf_counter() - t0)
        except Exception:
            local.append(None)
acked = [h.version for (h, _), t in zip(handles, local) if t is not None]
with tiercache.open(spec["config"]) as cache:
    listed = {v.id for v in cache.versions()}
print(json.dumps({"stall": statistics.median(stalls), "local": statistics.median([t for t in local if t is not None]),
                  "acked": len(acked), "lost": sum(v not in listed for v in acked)}))
"""


def _run(code_dir: Path, work: Path, s3: Any, proxy: Any, prefix: str, sizes: list[int],
         capacity: str) -> dict[str, Any]:
    config = {"ram": {"capacity": "1GiB"}, "disk": {"path": str(work / prefix), "capacity": capacity},
              "s3": {"url": s3.url(prefix), "endpoint_url": proxy.url}}
    env = {**os.environ, **s3.env(), "PYTHONPATH": str(code_dir)}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({"config": config, "sizes": sizes, "pause": 0.05})],
                         env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the scenario alternately on this checkout and on ``--before``; print one row per run and the medians."""
    p = argparse.ArgumentParser(prog="python -m bench.keep_rule", description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout of tiercache to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mbps", type=float, default=30.0, help="S3 link speed in MB/s (default 30)")
    p.add_argument("--capacity", default="250MB", help="the disk's capacity (default 250MB)")
    args = p.parse_args(argv)
    from tiercache.testing import LocalS3, ThrottledProxy

    here = Path(__file__).resolve().parent.parent
    sizes = [30 + (37 * i) % 61 for i in range(20)]  # 20 saves of 30-90 MB
    rows: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="tiercache-keep-") as tmp, LocalS3(bucket="keep-rule") as s3:
        proxy = ThrottledProxy(s3.endpoint_url, limit_bps=args.mbps * 1e6).start()
        try:
            for r in range(args.rounds):
                order = [("before", args.before), ("after", here)]
                for name, code in order if r % 2 == 0 else order[::-1]:
                    got = _run(code, Path(tmp), s3, proxy, f"{name}{r}", sizes, args.capacity)
                    rows[name].append(got)
                    print(f"round {r + 1} {name:6s} save() {got['stall']:.4f} s  to local {got['local']:.3f} s  "
                          f"local ok {got['acked']:2d}  lost after close {got['lost']}", flush=True)
        finally:
            proxy.close()
    for name, runs in rows.items():
        print(f"{name:6s} median save() {statistics.median(r['stall'] for r in runs):.4f} s, to local "
              f"{statistics.median(r['local'] for r in runs):.3f} s, lost {sum(r['lost'] for r in runs)} of "
              f"{sum(r['acked'] for r in runs)} acknowledged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
