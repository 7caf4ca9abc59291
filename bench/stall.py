"""``python -m bench.stall``: the time inside ``save()`` with S3 in the default config, paired with a ``copy_``.

The config the README suggests (a ``[disk]`` table, then an ``[s3]`` one, no ``[ram]`` table: the
default arena and policy), S3 behind a ``ThrottledProxy`` at each ``--mbps`` rate. A state of
``--size`` bytes (random floats in several tensors, so no codec helps, each changed before every
save, so no chunk is stored once for two versions) is saved ``--saves`` times with ``--pause``
seconds of "work" between; before each save the same bytes are copied with a plain
``Tensor.copy_`` into tensors allocated up front, the floor a ``save()`` can reach. Every run is a
fresh process on a fresh cache and bucket prefix, so a checkout given with ``--before`` (another
tiercache source tree, e.g. ``git archive`` of the commit before) is measured the same way, the runs
alternating. Per run: the median ``copy_``, the median and largest ``save()`` after the first (which
allocates the arena) and the first, how many times and how long ``save()`` waited for room in the RAM
arena (counted in either checkout), how long ``close()`` took, and the tiers the WARNINGs said
``save()`` waited for (``growth``: the warning of an automatic arena waiting to grow).

Example::

    python -m bench.stall --size 94MB --mbps 50,200 --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tiercache.config import parse_size

_CHILD = r"""
import json, logging, statistics, sys, time
import torch, tiercache
from tiercache.pipeline.ramcache import RamCache
spec = json.loads(sys.argv[1])
waits, warned = [], []
plain_wait = RamCache.wait_for_room
def counted_wait(self, since, timeout=None):  # save() waiting for room in the arena, in either checkout
    t0 = time.perf_counter()
    plain_wait(self, since, timeout)
    waits.append(time.perf_counter() - t0)
RamCache.wait_for_room = counted_wait
class Warned(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if "waits for room" in msg:  # "... hold it until <tiers> has them ..."
            warned.append(msg.split(" until ", 1)[1].split()[0])
        elif "so that the RAM arena can grow" in msg:
            warned.append("growth")
logging.getLogger("tiercache").addHandler(Warned(logging.WARNING))
g = torch.Generator().manual_seed(0)
per = spec["size"] // 4 // 8
state = {f"layer{i}.weight": torch.rand(per, generator=g) for i in range(8)}  # random floats: no codec helps
floor = {k: torch.empty_like(v) for k, v in state.items()}
for k, v in state.items():
    floor[k].copy_(v)  # fault the floor's pages in: a save()'s arena is faulted in by its first save
copies, stalls = [], []
t_open = time.perf_counter()
with tiercache.open(spec["config"]) as cache:
    for step in range(spec["saves"]):
        for v in state.values():
            v.add_(1.0)  # a training step changes every tensor: no chunk is the same as last time (no dedup)
        t0 = time.perf_counter()
        for k, v in state.items():
            floor[k].copy_(v)
        copies.append(time.perf_counter() - t0)
        time.sleep(spec["pause"])
        t0 = time.perf_counter()
        h = cache.save(state, step=step)
        stalls.append(time.perf_counter() - t0)
        time.sleep(spec["pause"])
    t_close = time.perf_counter()
t_end = time.perf_counter()
print(json.dumps({"tiercache": tiercache.__file__, "copy": statistics.median(copies),
                  "save": statistics.median(stalls[1:]), "first": stalls[0],
                  "max": max(stalls[1:]), "waits": len(waits), "waited": sum(waits),
                  "warned": "/".join(sorted(set(warned))) or "-", "close": t_end - t_close, "run": t_end - t_open}))
"""


def _run(code: Path, work: Path, s3: Any, proxy: Any, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    config = {"disk": {"path": str(work / prefix)}, "s3": {"url": s3.url(prefix), "endpoint_url": proxy.url}}
    spec = {"config": config, "size": args.size, "saves": args.saves, "pause": args.pause}
    env = {**os.environ, **s3.env(), "PYTHONPATH": str(code)}
    env.pop("TIERCACHE_CONFIG", None)
    # Not run from the caller's directory: ``python -c`` puts it first on sys.path, ahead of
    # PYTHONPATH, so a run from a checkout's root would import that checkout whatever ``code`` says.
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, cwd=work, capture_output=True,
                         text=True, timeout=900, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(got["tiercache"]).is_relative_to(code), f"the run imported {got['tiercache']}, not the code in {code}"
    return got


def main(argv: list[str] | None = None) -> int:
    """Run each rate on this checkout (and on ``--before``); print one row per run."""
    p = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="94MB", type=parse_size, help="bytes of tensor data in the state (94MB)")
    p.add_argument("--saves", type=int, default=10, help="saves per run (10); the first is reported apart")
    p.add_argument("--pause", type=float, default=0.1, help="seconds of work between saves (0.1)")
    p.add_argument("--mbps", default="50,200", help="S3 link speeds in MB/s, comma-separated (50,200)")
    p.add_argument("--before", type=Path, default=None, help="another tiercache checkout to compare with")
    p.add_argument("--dir", type=Path, default=None, help="where the disk tier lives (default: a temp dir)")
    args = p.parse_args(argv)
    from tiercache.testing import LocalS3, ThrottledProxy

    here = Path(__file__).resolve().parent.parent
    codes = [("this", here)] + ([("before", args.before.resolve())] if args.before else [])
    print(f"state {args.size / 1e6:.0f} MB in 8 tensors, {args.saves} saves {args.pause:g} s apart, "
          "config: [disk] + [s3], defaults otherwise")
    print(f"{'S3 MB/s':>8} {'checkout':8} {'copy_':>8} {'save()':>8} {'x copy_':>8} {'max':>8} {'first':>8} "
          f"{'waits':>5} {'waited':>7} {'close':>7}  waits for (WARNING)")
    with (tempfile.TemporaryDirectory(prefix="tiercache-stall-", dir=args.dir) as tmp,
          LocalS3(bucket="stall", root=Path(tmp)) as s3):
        for r, mbps in enumerate(float(x) for x in args.mbps.split(",")):
            with ThrottledProxy(s3.endpoint_url, limit_bps=mbps * 1e6) as proxy:
                for name, code in codes if r % 2 == 0 else codes[::-1]:
                    got = _run(code, Path(tmp), s3, proxy, f"{name}-{mbps:g}", args)
                    print(f"{mbps:8g} {name:8} {got['copy']:8.4f} {got['save']:8.4f} "
                          f"{got['save'] / got['copy']:8.1f} {got['max']:8.4f} {got['first']:8.4f} "
                          f"{got['waits']:5d} {got['waited']:7.2f} {got['close']:7.1f}  {got['warned']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
