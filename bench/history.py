"""``python -m bench history``: open, ``ls`` and restore as the history grows (1, 100, 1,000 versions).

One cache grows version by version; at each count in ``--versions`` the newest version is a
state of ``--leaves`` tensors of ``--leaf-floats`` float32 (20,000 x 256 by default, 20 MB: the
issue's many-tensor state), the versions before it small states of 64 tensors (so 1,000 of them
save in seconds). At each count,
each a fresh :func:`tiercache.open` (a new catalog, as in a new process; the page cache is warm):

- ``open``: open and resolve ``main`` (the catalog's first load);
- ``ls``: ``tiercache ls`` through the CLI (open, list, render the table);
- ``restore``: open and restore ``main`` (the newest version, checked bit-exact).

Each figure is the median of ``--repeat`` runs; "parsed" counts the manifests parsed
(``Version.from_json``) in one run. The disk rows use a disk-only cache, the S3 rows an S3-only
one on a local SeaweedFS server started for the run, at the counts of ``--s3-versions`` (a
version costs S3 about 4 PUTs there, so 1,000 take a few minutes to save; ``--no-s3`` leaves S3
out).

Paired: at the largest count of each tier, a second cache holding only the newest version (the
same state, its own directory or prefix) is made, and ``--pairs`` rounds each time open + restore
of the newest version in both, in alternating order; the per-round ratio (many versions / one)
is what the "the same with 1 or 1,000 versions" target is read from (this VM's speed drifts by
more than 10% between the counts' rows).

Example::

    python -m bench history --versions 1,100,1000 --s3-versions 1,100,1000 --repeat 3 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app
from tiercache.manifest import Version

OUT_DIR = Path(__file__).resolve().parent / "out"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench history", description=__doc__.splitlines()[0])
    p.add_argument("--versions", default="1,100,1000", help="version counts to measure the disk at (1,100,1000)")
    p.add_argument("--s3-versions", default="1,100,1000", help="version counts to measure S3 at (1,100,1000)")
    p.add_argument("--repeat", default=3, type=int, help="runs per figure; the table shows the median (3)")
    p.add_argument("--leaves", default=20000, type=int, help="tensors in the newest version's state (20000)")
    p.add_argument("--leaf-floats", default=256, type=int, help="float32 elements per tensor (256)")
    p.add_argument("--pairs", default=5, type=int,
                   help="alternating rounds of restore with one version / with the most (5; 0: none)")
    p.add_argument("--dir", type=Path, default=None, help="where the caches go (default: bench/out)")
    p.add_argument("--no-s3", action="store_true", help="measure the disk only")
    args = p.parse_args(argv)
    args.counts = {"disk": sorted({int(c) for c in args.versions.split(",") if c.strip()}),
                   "s3": [] if args.no_s3 else sorted({int(c) for c in args.s3_versions.split(",") if c.strip()})}
    if not args.counts["disk"] or min(args.counts["disk"] + args.counts["s3"]) < 1 or args.repeat < 1 or args.pairs < 0:
        p.error("--versions and --s3-versions need counts >= 1, --repeat at least 1 and --pairs at least 0")
    return args


def _small(i: int) -> dict[str, Any]:
    return {f"l{j}": torch.full((16,), float(i + j)) for j in range(64)}


def _newest(i: int, leaves: int, floats: int) -> dict[str, Any]:
    return {f"layer{j}": torch.arange(floats, dtype=torch.float32) + i + j for j in range(leaves)}


@contextmanager
def _counting() -> Iterator[list[int]]:
    """Count the manifests parsed while the block runs."""
    real = Version.from_json
    seen = [0]

    def counting(data: bytes, *, source: str = "") -> Version:
        seen[0] += 1
        return real(data, source=source)

    Version.from_json = staticmethod(counting)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        Version.from_json = real  # type: ignore[method-assign]


def _timed(repeat: int, run: Callable[[], None]) -> tuple[float, int]:
    """Median seconds of ``repeat`` runs and the manifests one run parsed."""
    secs = []
    parsed = 0
    for _ in range(repeat):
        with _counting() as seen:
            t = time.perf_counter()
            run()
            secs.append(time.perf_counter() - t)
        parsed = seen[0]
    return statistics.median(secs), parsed


def _restore(cfg: dict[str, Any], expect: dict[str, Any]) -> None:
    """Open the cache and restore ``main``, checked bit-exact against ``expect``."""
    with tiercache.open(cfg) as cache:
        out = cache.restore("main")
    bad = [k for k, v in expect.items() if not torch.equal(out[k], v)]
    if bad:
        raise RuntimeError(f"restore returned other bytes for {bad[:3]}")


def _paired(one: dict[str, Any], many: dict[str, Any], expect: dict[str, Any], pairs: int) -> dict[str, Any]:
    """``pairs`` rounds of open + restore in the 1-version and the many-version cache, alternating who goes first."""
    rounds = []
    for r in range(pairs):
        secs = {}
        for name in (("one", "many") if r % 2 == 0 else ("many", "one")):
            t = time.perf_counter()
            _restore(one if name == "one" else many, expect)
            secs[name] = time.perf_counter() - t
        rounds.append(secs)
    ratios = [r["many"] / r["one"] for r in rounds]
    return {"rounds": rounds, "one": statistics.median(r["one"] for r in rounds),
            "many": statistics.median(r["many"] for r in rounds), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def _measure(cfg: dict[str, Any], config_file: Path, expect: dict[str, Any], repeat: int) -> dict[str, Any]:
    def open_resolve() -> None:
        with tiercache.open(cfg) as cache:
            cache.resolve("main")

    def ls() -> None:
        got = CliRunner().invoke(app, ["--config", str(config_file), "ls"])
        if got.exit_code != 0:
            raise RuntimeError(got.output)

    def restore() -> None:
        _restore(cfg, expect)

    row: dict[str, Any] = {}
    for name, run in (("open", open_resolve), ("ls", ls), ("restore", restore)):
        row[name], row[f"{name}_parsed"] = _timed(repeat, run)
    return row


def _toml(cfg: dict[str, Any]) -> str:
    out = []
    for table, values in cfg.items():
        out.append(f"[{table}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(out) + "\n"


def _grow(write_cfg: dict[str, Any], have: int, upto: int, args: argparse.Namespace) -> dict[str, Any]:
    """Save versions ``have`` .. ``upto - 1`` (the last one the big state); return that state."""
    newest = _newest(upto, args.leaves, args.leaf_floats)
    with tiercache.open(write_cfg) as cache:
        for i in range(have, upto - 1):
            cache.save(_small(i), step=i)
        cache.save(newest, step=upto - 1)
        cache.flush()
    return newest


def _caches(work: Path, s3: dict[str, Any] | None, name: str) -> dict[str, dict[str, Any]]:
    """The config of the cache called ``name`` per tier (its own directory, or prefix on S3)."""
    caches = {"disk": {"disk": {"path": str(work / name)}, "policy": {"name": "write-through"}}}
    if s3 is not None:
        caches["s3"] = {"s3": {**s3, "url": f"{s3['url']}/{name}"}, "policy": {"name": "write-through"}}
    return caches


def run(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Grow a cache per tier and measure at each count; one row per (tier, count), and the paired rows."""
    rows, paired = [], []
    with _s3(args, work) as s3:
        caches = _caches(work, s3, "history")
        for tier, cfg in caches.items():
            config_file = work / f"{tier}.toml"
            config_file.write_text(_toml(cfg))
            have = 0
            for count in args.counts[tier]:
                t = time.perf_counter()
                newest = _grow(cfg, have, count, args)
                have = count
                print(f"{tier}: {count} versions saved ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
                row = {"tier": tier, "versions": count, **_measure(cfg, config_file, newest, args.repeat)}
                rows.append(row)
                print(_line(row), file=sys.stderr)
            if args.pairs and have > 1:
                one = _caches(work, s3, "one")[tier]
                _grow(one, have - 1, have, args)  # the same newest state, alone
                pair = {"tier": tier, "versions": have, **_paired(one, cfg, newest, args.pairs)}
                paired.append(pair)
                print(_pair_line(pair), file=sys.stderr)
    return rows, paired


@contextmanager
def _s3(args: argparse.Namespace, work: Path) -> Iterator[dict[str, Any] | None]:
    if not args.counts["s3"]:
        yield None
        return
    from tiercache.testing import LocalS3

    with LocalS3(bucket="tiercache-history", root=work / "s3") as server:
        os.environ.update(server.env())  # the S3 tier reads its credentials from the environment
        yield {"url": "s3://tiercache-history/h", "endpoint_url": server.endpoint_url, "region": server.region}


def _line(row: dict[str, Any]) -> str:
    cells = [f"{row[k] * 1e3:.0f} ms ({row[f'{k}_parsed']})" for k in ("open", "ls", "restore")]
    return f"| {row['tier']} | {row['versions']:,} | {' | '.join(cells)} |"


def _pair_line(pair: dict[str, Any]) -> str:
    return (f"| {pair['tier']} | {pair['versions']:,} | {pair['one'] * 1e3:.0f} ms | {pair['many'] * 1e3:.0f} ms "
            f"| {pair['ratio']:.2f}x ({pair['ratio_min']:.2f}-{pair['ratio_max']:.2f}x) |")


def render(rows: list[dict[str, Any]], paired: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown tables of the rows (seconds as ms, manifests parsed in parentheses) and the pairs."""
    head = ["| tier | versions | open (parsed) | `ls` (parsed) | open + restore newest (parsed) |",
            "|---|---:|---:|---:|---:|"]
    note = (f"newest version: {args.leaves:,} tensors of {args.leaf_floats} float32; median of {args.repeat} "
            "runs, each a fresh open; (n) = manifests parsed in one run")
    out = [*head, *(_line(r) for r in rows), "", note]
    if paired:
        out += ["", "| tier | versions | open + restore, 1 version | ... with the history | ratio per round (range) |",
                "|---|---:|---:|---:|---:|", *(_pair_line(p) for p in paired), "",
                f"medians of {args.pairs} alternating rounds; the ratio is the median of the per-round ratios"]
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    """Run the history bench, print the table, write ``bench/out/history.json``."""
    args = _parse(argv)
    parent = args.dir or OUT_DIR
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiercache-history-", dir=parent))
    try:
        rows, paired = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(rows, paired, args))
    (parent / "history.json").write_text(json.dumps({"rows": rows, "paired": paired}, indent=2))
    return 0
