"""The control-plane bench (bench/control_plane.py) at its smallest: what it reports, not how fast."""

from __future__ import annotations

import json
import queue
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bench import control_plane


def test_control_plane_in_one_process_commits_every_version_and_a_rank_traffic_independent_of_n(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cp.json"
    results = control_plane.main(["--ranks", "16,32", "--leaves", "300", "--versions", "1", "--old", "8",
                                  "--e2e", "", "--dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    part = results["per_rank"]
    assert part["chunks"] == 1  # 300 leaves of 16 KiB pack into one 64 MiB chunk
    assert part["part_bytes"] > 15_000  # the part names its 300 leaves (their table is columnar)
    rows = {(r["world"], r["layout"]): r for r in results["rows"]}
    assert set(rows) == {(16, "fsdp"), (16, "ddp"), (32, "fsdp"), (32, "ddp")}
    for (world, layout), r in rows.items():
        assert r["nodes"] == world // 8
        # Every version (the warm-up too) committed: a fresh process parses each one's group
        # manifest, naming every rank and node, on the node's disk and on the shared tier, and
        # main is the last one on both.
        assert r["saved"] == 2
        assert r["committed"] == {t: {"parsed": 2, "head_is_last": True} for t in ("disk", "s3")}
        for name in ("parts", "disk", "commit_node", "disk_commit", "peers_plan", "peers", "s3", "commit_shared",
                     "local", "replicated", "version", "resolve", "restore", "read_part"):
            assert len(r["runs_s"][name]) == 1 and all(x > 0 for x in r["runs_s"][name]), name
        assert len(r["latency_s"]["runs"]) == 4
        # Each distinct chunk is written once to S3 and once per node's disk; DDP's replicated chunk
        # is one chunk for the whole group (plus each rank's own one).
        shares = r["shares"]
        distinct = world if layout == "fsdp" else 1 + world
        assert shares["distinct"] == shares["s3"] == distinct
        assert shares["disk"] == (world if layout == "fsdp" else world + world // 8)
        # The coordinator gathers chunk lists, never a rank's leaves: for the whole version it
        # receives less than one rank's part manifest, let alone every rank's.
        coordinator = r["bytes"]["coordinator"]["version"]
        assert 0 < coordinator["received"] < part["part_bytes"]
    for layout in ("fsdp", "ddp"):
        small, big = (rows[(n, layout)]["bytes"]["rank"] for n in (16, 32))
        for what in ("version", "restore"):
            # What one rank sends and reads does not grow with the group (a digit more in a count at most).
            assert abs(small[what]["received"] - big[what]["received"]) <= 16, (layout, what)
            assert abs(small[what]["sent"] - big[what]["sent"]) <= 16, (layout, what)
    (old,) = results["old"]
    assert old["world"] == 8 and old["parse_s"] > 0 and old["merge_s"] > 0
    fit = results["scale_inputs"]
    assert set(fit["control_s"]) == {"begin", "local", "replicated", "remote", "restore"}
    assert all(fixed >= 0 for fixed, _ in fit["control_s"].values())
    assert list(tmp_path.glob("tc-control-*")) == []  # the disk tiers are removed


def test_control_plane_end_to_end_rank_saves_and_restores_bit_exact(tmp_path: Path) -> None:
    # The worker each spawned rank of --e2e runs, here in this process as a group of one (spawning
    # ranks costs seconds of imports; tests/test_multirank.py covers several real ranks).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out: queue.Queue[Any] = queue.Queue()
    try:
        control_plane._e2e_rank(0, 1, port, {"leaves": 200, "numel": 64, "versions": 2}, str(tmp_path), out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    rank, result, exact = out.get_nowait()
    assert rank == 0 and exact is True
    assert {k: len(v) for k, v in result.items()} == {"save_wait_s": 2, "local_s": 2, "restore_s": 2,
                                                      "save_part_reads": 2, "restore_part_reads": 2}
    # A save reads no part manifest; a restore reads its own rank's one.
    assert (result["save_part_reads"], result["restore_part_reads"]) == ([0, 0], [1, 1])
    assert all(0 < w <= t for w, t in zip(result["save_wait_s"], result["local_s"], strict=True))
