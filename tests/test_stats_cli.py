"""The maintenance verbs of the CLI on a disk cache: ``stats``, ``verify [--repair]``, ``gc [--dry-run]``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import tiercache
from tiercache.cli import app
from tiercache.names import chunk_key


def _cli(cfg: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["--config", str(cfg), *args])


def _stored(root: Path) -> int:
    return sum(p.stat().st_size for sub in ("chunks", "versions", "refs", "stats", "index")
               for p in (root / sub).rglob("*")
               if p.is_file() and not p.name.startswith("."))


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A disk cache with main: v1 <- v2 (w1 changed), 64 KiB chunks; returns (config, root, ids)."""
    root = tmp_path / "cache"
    cfg = tmp_path / "tiercache.toml"
    # reflog_keep = 0: what a rollback leaves behind is not kept by the reflog (see test_gc.py).
    cfg.write_text(f'chunk_bytes = "64KiB"\npack_below = "4KiB"\nreflog_keep = 0\n[disk]\npath = "{root}"\n')
    g = torch.Generator().manual_seed(0)
    s1 = {f"w{i}": torch.randn(16 * 1024, generator=g) for i in range(3)}
    with tiercache.open(cfg) as cache:
        ids = [cache.save(s1, step=1).wait("local"), cache.save(dict(s1, w1=s1["w1"] * 3), step=2).wait("local")]
    return cfg, root, ids


def test_stats_in_process_counts_what_was_written(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}, "policy": {"name": "write-through"}}) as cache:
        cache.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, step=1).wait("local")
        stats = cache.stats()
        chunks = sum(p.stat().st_size for p in (tmp_path / "chunks").rglob("*") if p.is_file())
        manifests = sum(p.stat().st_size for p in (tmp_path / "versions").rglob("*") if p.is_file())
        write = stats["meter"]["tiers"]["disk"]["write"]
        # Two observations: the chunks' bulk write, then the commit (manifest and ref).
        assert write["total_bytes"] == chunks + manifests and write["transfers"] == 2 and write["bps"] > 0
        assert write["latency_s"] >= 0 and write["bandwidth_bps"] > 0
        disk = stats["tiers"]["disk"]
        free = disk.pop("free_bytes")  # the filesystem's free space (less a reserve), as the tier's room
        assert disk == {"capacity": None, "used_bytes": _stored(tmp_path), "available": True, "unavailable": None,
                        "full": False, "state": "available", "reclaimable_bytes": 0,
                        "next_version_bytes": 1 << 18}
        assert 0 < free <= os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        assert stats["errors"] == {"lost_versions": 0, "recent": []}


def test_stats_table_and_json(setup: tuple[Path, Path, list[str]]) -> None:
    cfg, root, _ = setup
    table = _cli(cfg, "stats")
    assert table.exit_code == 0, table.output
    header, row = table.output.splitlines()[:2]
    assert header.split() == ["tier", "state", "used", "capacity", "free", "read", "write"]
    assert row.split()[:2] == ["disk", "available"]
    data = json.loads(_cli(cfg, "stats", "--json").stdout)
    assert set(data["tiers"]) == {"disk"}
    disk = data["tiers"]["disk"]
    assert disk["free_bytes"] > 0
    # The older version is not evictable: no other durable tier holds it (the keep rule).
    assert {k: v for k, v in disk.items() if k != "free_bytes"} == {
        "capacity": None, "used_bytes": _stored(root), "available": True, "unavailable": None, "full": False,
        "state": "available", "reclaimable_bytes": 0, "next_version_bytes": 3 * 16 * 1024 * 4}
    assert set(data["meter"]) == {"half_life", "tiers", "codecs", "history"}
    # A fresh process shows the speed the saving process measured (left in stats/meter.json).
    assert data["meter"]["tiers"]["disk"]["write"]["bps"] > 0
    assert data["meter"]["tiers"]["disk"]["write"]["total_bytes"] == 0


def test_verify_reports_and_repairs_nothing_on_a_single_tier(setup: tuple[Path, Path, list[str]]) -> None:
    cfg, root, ids = setup
    ok = _cli(cfg, "verify")
    assert ok.exit_code == 0, ok.output
    assert "verified 2 version(s), 4 chunk(s)" in ok.output and "0 bad" in ok.output
    with tiercache.open(cfg) as cache:
        victim = cache.manifest(ids[1]).chunks[1].id
    path = root / chunk_key(victim)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    bad = _cli(cfg, "verify", ids[1])
    assert bad.exit_code == 1
    assert f"damaged: disk:{chunk_key(victim)}" in bad.output and "1 bad, 0 repaired" in bad.output
    assert "verify --repair" in bad.output
    # One tier only: nothing to repair from.
    report = json.loads(_cli(cfg, "verify", "--repair", "--json").stdout)
    assert report["ok"] is False and report["unrepairable"] == [chunk_key(victim)]


def test_gc_dry_run_then_gc(setup: tuple[Path, Path, list[str]]) -> None:
    cfg, root, ids = setup
    assert _cli(cfg, "rollback", "main", ids[0]).exit_code == 0
    files = sorted(root.rglob("*"))
    dry = _cli(cfg, "gc", "--dry-run", "--grace", "0", "--json")
    assert dry.exit_code == 0, dry.output
    would = json.loads(dry.stdout)
    assert sorted(root.rglob("*")) == files
    assert would["versions"] == [ids[1]] and would["chunks"] == {"disk": 1} and would["manifests"] == {"disk": 1}
    done = _cli(cfg, "gc", "--grace", "0")
    assert done.exit_code == 0, done.output
    assert f"gc freed 1 version(s), {would['total_bytes']} B" in done.output or "gc freed 1 version(s)" in done.output
    assert "disk: 1 manifest(s), 1 chunk(s)" in done.output
    assert not (root / "versions" / f"{ids[1]}.json").exists()
    again = json.loads(_cli(cfg, "gc", "--grace", "0", "--json").stdout)
    assert again["total_bytes"] == 0 and again["versions"] == []
    kept = _cli(cfg, "gc")  # default grace: nothing is old enough, and it says so
    assert "gc freed 0 version(s)" in kept.output and "younger than 3600 s kept" in kept.output


def test_gc_negative_grace_is_bad_input(setup: tuple[Path, Path, list[str]]) -> None:
    cfg, _, _ = setup
    result = _cli(cfg, "gc", "--grace", "-1")
    assert result.exit_code == 2
    assert result.output.strip() == "error: gc grace must be >= 0 seconds, got -1.0"
