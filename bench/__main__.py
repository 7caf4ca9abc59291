"""``python -m bench``: measure tiercache and its baselines side by side in one run, print one table.

Example::

    python -m bench --size 256MB --repeat 3 --only memcpy,odirect,torch,save
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.agent import AGENT_GROUPS, run_agent
from bench.baselines import BASELINE_GROUPS, S3Endpoint, run_baselines
from bench.cli import CLI_GROUPS, run_cli
from bench.report import evaluate, machine_info, render, write_json, write_png
from bench.save_restore import TIERCACHE_GROUPS, ram_capacity, run_tiercache
from bench.state import make_state, state_nbytes, state_summary
from tiercache.config import DiskConfig, S3Config, parse_size

OUT_DIR = Path(__file__).resolve().parent / "out"
GROUPS = BASELINE_GROUPS + TIERCACHE_GROUPS + AGENT_GROUPS + CLI_GROUPS
_S3_GROUPS = frozenset({"s3", "s3torch", "save", "restore", "rss", "restart"})


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GB", type=parse_size, help="bytes of tensor data in the state (2GB)")
    p.add_argument("--repeat", default=3, type=int, help="runs per row; the table shows the median (3)")
    p.add_argument("--dir", type=Path, default=None,
                   help="directory on the filesystem to measure (default: bench/out, on the repo's fs)")
    p.add_argument("--no-s3", action="store_true", help="skip every row that needs an S3 endpoint")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups: {','.join(GROUPS)}")
    p.add_argument("--policy", default="write-through", help="tiercache policy for the tiercache rows")
    args = p.parse_args(argv)
    args.groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = sorted(set(args.groups) - set(GROUPS))
    if unknown or not args.groups:
        p.error(f"unknown group(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(GROUPS)}")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def _empty_bucket(client: Any, bucket: str) -> None:
    """Delete every object and abort every multipart upload left in ``bucket``, then the bucket."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    for u in uploads:
        client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    client.delete_bucket(Bucket=bucket)


@contextmanager
def _s3_endpoint(work: Path, console: Console) -> Iterator[S3Endpoint]:
    """A fresh bucket on ``TEST_TIERCACHE_S3_ENDPOINT``, or on a local S3 server started for the run."""
    bucket = f"tiercache-bench-{secrets.token_hex(4)}"
    with ExitStack() as stack:
        url = os.environ.get("TEST_TIERCACHE_S3_ENDPOINT")
        if url:
            console.print(f"S3: {url} (TEST_TIERCACHE_S3_ENDPOINT)")
        else:
            from tiercache.testing import LocalS3

            server = stack.enter_context(LocalS3(bucket=bucket, root=work))
            # Both boto3 and s3torchconnector's CRT client read credentials from the environment.
            os.environ.update(server.env())
            url = server.endpoint_url
            console.print(f"S3: local SeaweedFS server at {url}")
        defaults = S3Config.model_fields
        endpoint = S3Endpoint(url, bucket, part_size=defaults["part_size"].default,
                              concurrency=defaults["max_concurrency"].default)
        if os.environ.get("TEST_TIERCACHE_S3_ENDPOINT"):
            client = endpoint.client()
            client.create_bucket(Bucket=bucket)
            stack.callback(_empty_bucket, client, bucket)
        yield endpoint


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected groups, print the table, write ``bench/out/results.json`` and ``bench.png``.

    ``python -m bench mlperf ...`` runs the MLPerf-Storage-style checkpoint mode instead (see
    :mod:`bench.mlperf`), ``python -m bench tensors ...`` the many-small-tensors comparison
    (:mod:`bench.tensors`), ``python -m bench history ...`` open, ``ls`` and restore as the history
    grows (see :mod:`bench.history`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["mlperf"]:
        from bench.mlperf import main as mlperf

        return mlperf(argv[1:])
    if argv[:1] == ["tensors"]:
        from bench.tensors import main as tensors

        return tensors(argv[1:])
    if argv[:1] == ["history"]:
        from bench.history import main as history

        return history(argv[1:])
    args = _parse(argv)
    # Piped output (CI logs, files) would otherwise wrap the wide table at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    OUT_DIR.mkdir(exist_ok=True)
    parent = args.dir or OUT_DIR
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-", dir=parent))
    machine = machine_info(work)
    if machine["filesystem"].startswith("tmpfs"):
        console.print(f"[yellow]warning[/yellow]: {work} is on tmpfs: the disk rows measure RAM")
    try:
        with ExitStack() as stack:
            wants_s3 = not args.no_s3 and bool(_S3_GROUPS & set(args.groups))
            s3 = stack.enter_context(_s3_endpoint(work, console)) if wants_s3 else None
            state = make_state(args.size)
            nbytes = state_nbytes(state)
            header = (f"state: {state_summary(state)}; repeat {args.repeat}; RAM capacity "
                      f"{ram_capacity(nbytes) / 1e9:.2f} GB; policy {args.policy}; "
                      f"S3 {'off' if s3 is None else s3.endpoint_url}")
            rows = run_baselines(state, work, repeat=args.repeat, groups=args.groups, s3=s3,
                                 dcp_threads=DiskConfig.model_fields["io_threads"].default)
            rows += run_tiercache(state, work, repeat=args.repeat, groups=args.groups, s3=s3,
                                  policy=args.policy)
            rows += run_agent(state, work, repeat=args.repeat, groups=args.groups, s3=s3, policy=args.policy)
            if "cli" in args.groups:
                rows += run_cli(work, repeat=args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdicts = evaluate(rows)
    render(rows, verdicts, machine, header, console)
    console.print(f"load average (1 min) at start {machine['load_1min']}, at end {os.getloadavg()[0]:.2f}")
    settings = {"size": args.size, "repeat": args.repeat, "groups": args.groups, "policy": args.policy,
                "s3": s3.endpoint_url if s3 else None}
    write_json(OUT_DIR / "results.json", rows, verdicts, machine, settings)
    write_png(OUT_DIR / "bench.png", rows, f"tiercache bench, {nbytes / 1e9:.2f} GB state")
    console.print(f"wrote {OUT_DIR / 'results.json'} and {OUT_DIR / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
