"""The control-plane bench (bench/control_plane.py) at its smallest: what it reports, not how fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import control_plane


def test_control_plane_in_one_process_reports_every_phase_and_a_rank_traffic_independent_of_n(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cp.json"
    results = control_plane.main(["--ranks", "16,64", "--leaves", "300", "--versions", "1", "--old", "8",
                                  "--e2e", "", "--dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    part = results["per_rank"]
    assert part["chunks"] == 1  # 300 leaves of 16 KiB pack into one 64 MiB chunk
    assert part["part_bytes"] > 30_000
    rows = {(r["world"], r["layout"]): r for r in results["rows"]}
    assert set(rows) == {(16, "fsdp"), (16, "ddp"), (64, "fsdp"), (64, "ddp")}
    for (world, layout), r in rows.items():
        assert r["nodes"] == world // 8
        for name in ("parts", "disk", "commit_node", "disk_commit", "s3", "commit_shared", "local", "version",
                     "resolve", "restore", "read_part"):
            assert len(r["runs_s"][name]) == 1 and r["runs_s"][name][0] > 0, name
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
        small, big = (rows[(n, layout)]["bytes"]["rank"] for n in (16, 64))
        for what in ("version", "restore"):
            # What one rank sends and reads does not grow with the group (a digit more in a count at most).
            assert abs(small[what]["received"] - big[what]["received"]) <= 16, (layout, what)
            assert abs(small[what]["sent"] - big[what]["sent"]) <= 16, (layout, what)
    (old,) = results["old"]
    assert old["world"] == 8 and old["parse_s"] > 0 and old["merge_s"] > 0
    assert list(tmp_path.glob("tc-control-*")) == []  # the disk tiers are removed


@pytest.mark.timeout(600)
def test_control_plane_end_to_end_restores_every_rank_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    results = control_plane.main(["--ranks", "", "--old", "", "--leaves", "100", "--e2e", "2", "--e2e-leaves", "500",
                                  "--e2e-versions", "1", "--dir", str(tmp_path), "--json", str(out)])
    (row,) = results["e2e"]
    assert row["world"] == 2 and row["leaves"] == 500 and row["bytes_per_rank"] == 500 * 64 * 4
    assert row["exact"] is True
    assert set(row["runs"]) == {"0", "1"} or set(row["runs"]) == {0, 1}
    for rank_runs in row["runs"].values():
        assert all(len(v) == 1 for v in rank_runs.values())
    assert 0 < row["save_wait_s"] <= row["local_s"]
    assert row["restore_s"] > 0
