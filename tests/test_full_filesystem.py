"""A disk tier with no capacity set, on a filesystem that fills (issue 45, item 3).

The filesystem's room is treated like a capacity: copies S3 holds are given back, oldest first,
so new versions reach the disk again; a tier with no room for the next version, even after
eviction, is reported full by ``stats``, the ui and ``doctor``. The filesystem is a real tmpfs
of a few MB, mounted for the test.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cache import core_of
from tiercache.cli import app
from tiercache.config import S3Config

MIB = 1 << 20


def _mount_tmpfs(path: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` MiB on ``path``; ``None``, or why it could not be."""
    path.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a small tmpfs needs root and mount(8)"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip()}"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 14 MiB tmpfs (skipped, with the reason, where this process may not mount one)."""
    where = tmp_path / "fs"
    why = _mount_tmpfs(where, 14)
    if why is not None:
        pytest.skip(f"no small filesystem for this test: {why}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4 * MIB // 4, generator=g)}  # 4 MiB: three fit in the 14 MiB filesystem


def _config(disk: Path, s3: S3Config) -> dict[str, Any]:
    return {"disk": {"path": str(disk)}, "s3": s3.model_dump(), "chunk_bytes": "2MiB"}


def test_a_filesystem_that_fills_gives_back_copies_s3_holds_and_keeps_taking_new_versions(
    small_fs: Path, s3_config: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(small_fs / "store", s3_config)
    states = [_state(i) for i in range(5)]
    caplog.set_level(logging.WARNING, logger="tiercache")
    with tiercache.open(cfg) as cache:
        handles = []
        for i, s in enumerate(states):
            handles.append(cache.save(s, step=i))
            handles[-1].wait("remote")  # S3 holds it before the next save needs the room
            handles[-1].future("local").exception()
        # Every version reached the disk: the oldest ones S3 holds were given back for them.
        assert [h.succeeded("local") for h in handles] == [True] * len(handles)
        on_disk = sorted(v.id for v in core_of(cache).catalog.all() if core_of(cache).catalog.manifest_on("disk", v.id))
        assert 2 <= len(on_disk) <= 3 and on_disk[-1] == handles[-1].version
        assert on_disk == [h.version for h in handles[-len(on_disk):]]  # oldest first went
        disk = cache.stats()["tiers"]["disk"]
        assert disk["state"] == "available" and disk["full"] is False
        for h, s in zip(handles, states, strict=True):  # the older ones from S3
            assert torch.equal(cache.restore(h.version)["w"], s["w"]), h.version
    # No flapping: the disk never went down for lack of room.
    assert not [r for r in caplog.records if "is unavailable" in r.getMessage()]


def test_a_full_filesystem_is_reported_full_by_stats_the_ui_and_doctor(
    small_fs: Path, s3_config: S3Config, tmp_path: Path
) -> None:
    cfg = _config(small_fs / "store", s3_config)
    config = tmp_path / "tiercache.toml"
    config.write_text(f'chunk_bytes = "2MiB"\n[disk]\npath = "{small_fs / "store"}"\n[s3]\n'
                      f'url = "{s3_config.url}"\nendpoint_url = "{s3_config.endpoint_url}"\n'
                      f'region = "{s3_config.region}"\n')
    with tiercache.open(cfg) as cache:
        vid = cache.save(_state(0), step=0).wait("durable")
    # Something else fills the filesystem: 3 MiB stay free, and the newest version has 4 MiB
    # (its only disk copy is the newest of its branch: nothing there may be given back).
    filler = small_fs / "other-data"
    with open(filler, "wb") as fh:
        fh.write(b"\0" * (os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize - 3 * MIB))
    runner = CliRunner()
    stats = json.loads(runner.invoke(app, ["--config", str(config), "stats", "--json"]).stdout)["tiers"]
    disk = stats["disk"]
    assert (disk["state"], disk["full"], disk["available"]) == ("full", True, True)
    assert disk["free_bytes"] <= 2 * MIB and disk["next_version_bytes"] == 4 * MIB
    assert disk["reclaimable_bytes"] == 0
    assert stats["s3"]["state"] == "available" and stats["s3"]["full"] is False
    table = runner.invoke(app, ["--config", str(config), "stats"]).stdout
    assert any(line.split()[:2] == ["disk", "full"] for line in table.splitlines() if line.strip())
    with tiercache.open(cfg) as cache:
        from tiercache.ui import views

        cap = views.Capture.of(cache, mttf=None, now=time.time())
        assert views.throughput(cap)["tiers"]["disk"]["state"] == "full"
        report = cache.doctor()
        assert not report.ok and list(report.full) == ["disk"]
        assert any(p.startswith("disk has no room for the next version (") for p in report.problems)
        doctor = runner.invoke(app, ["--config", str(config), "doctor"])
        assert doctor.exit_code == 1 and "disk has no room for the next version" in doctor.output
        # Room again: full no more, and the version is where it was.
        filler.unlink()
        assert cache.stats()["tiers"]["disk"]["state"] == "available"
        assert torch.equal(cache.restore(vid)["w"], _state(0)["w"])
