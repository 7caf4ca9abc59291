"""S3 outages: training goes on, every version stays local, S3 catches up when it is back.

The S3 tier goes through a loopback relay in front of the real local S3 server, switched between
``up``, ``refuse`` (nothing listens: connections refused) and ``hang`` (connections accepted,
never answered). Timeouts are short so each outage is noticed within a second or two.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app
from tiercache.config import S3Config
from tiercache.errors import SkippedError, TierUnavailableError
from tiercache.testing import ThrottledProxy

#: Timeouts of the tests' S3 tier: an outage costs at most a couple of seconds per request.
FAST = {"connect_timeout": 0.5, "read_timeout": 1.0, "probe_timeout": 0.5, "max_attempts": 2, "deadline_s": 10}


@pytest.fixture
def relay(s3_server: Any) -> Iterator[ThrottledProxy]:
    with ThrottledProxy(s3_server.endpoint_url) as proxy:
        yield proxy


def _cfg(tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, **extra: Any) -> dict[str, Any]:
    s3 = s3_config.model_copy(update={"endpoint_url": relay.url, **FAST}).model_dump()
    return {"disk": {"path": str(tmp_path / "disk")}, "s3": s3, "engine": {"probe_interval_s": 0.2}, **extra}


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64 * 1024, generator=g), "b": torch.arange(8) * step, "step": step}


def _until(cond: Any, timeout: float = 60.0) -> bool:
    """Wait for ``cond()`` (a liveness bound for the background catch-up, not a speed figure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _s3_only(s3_config: S3Config) -> dict[str, Any]:
    return {"s3": s3_config.model_dump()}  # straight to the server, not through the relay


@pytest.mark.parametrize("mode", ["refuse", "hang"])
def test_an_s3_outage_mid_loop_costs_no_save_and_no_local_version(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, mode: str
) -> None:
    cfg = _cfg(tmp_path, s3_config, relay)
    handles = []
    with tiercache.open(cfg) as cache:
        for step in range(1, 13):
            if step == 4:
                relay.mode = mode  # type: ignore[assignment]
            handles.append(cache.save(_state(step), step=step))  # never raises
            handles[-1].wait("local")  # every version is local: before, during and after the outage
            handles[-1].future("remote").exception()  # a slow step: S3's outcome is known before the next
        cache.flush()  # no version was lost: nothing to report
        assert cache.stats()["errors"]["lost_versions"] == 0
        assert cache.stats()["tiers"]["s3"]["available"] is False
        for h in handles:
            assert h.wait("local") == h.version
        failed = [h.future("remote").exception() for h in handles[3:]]
        failed = [e for e in failed if not isinstance(e, SkippedError)]
        assert failed and all(isinstance(e, TierUnavailableError) for e in failed), failed
        infos = {v.id: v for v in cache.versions()}
        assert all(infos[h.version].states["s3"].state in ("failed", "skipped") for h in handles[3:])
        assert any("unavailable" in infos[h.version].states["s3"].reason for h in handles[3:])
        head = handles[-1].version
        assert infos[head].states["s3"].state != "held"
        relay.mode = "up"
        # The probe notices, and the newest version of the branch goes up without another save.
        assert _until(lambda: "s3" in {v.id: v for v in cache.versions()}[head].tiers)
    with tiercache.open(_s3_only(s3_config)) as remote:
        assert remote.resolve("main") == head
        got = remote.restore("main")
        assert torch.equal(got["w"], _state(12)["w"]) and got["step"] == 12
    with tiercache.open(cfg) as fresh:  # a fresh process still says why the others missed S3
        infos = {v.id: v for v in fresh.versions()}
        missed = [infos[h.version].states["s3"] for h in handles[3:-1]]
        assert {s.state for s in missed} <= {"failed", "skipped"} and all(s.reason for s in missed)
    toml = tmp_path / "tiercache.toml"
    toml.write_text(f'[disk]\npath = "{cfg["disk"]["path"]}"\n[s3]\nurl = "{cfg["s3"]["url"]}"\n'
                    f'endpoint_url = "{cfg["s3"]["endpoint_url"]}"\nregion = "{cfg["s3"]["region"]}"\n')
    shown = CliRunner().invoke(app, ["--config", str(toml), "ls"])
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[1:13]}
    assert all(rows[h.version[:10]][-2] == "✓" for h in handles[:-1]), shown.stdout  # disk, then s3
    assert all(rows[h.version[:10]][-1] in ("failed", "skipped") for h in handles[3:-1]), shown.stdout
    assert rows[handles[-1].version[:10]][-2:] == ["✓", "✓"], shown.stdout
    reasons = shown.stdout.split("why a tier lacks a version, newest first", 1)[1]
    assert f"{handles[-2].version[:10]} s3 " in reasons and "unavailable" in reasons, shown.stdout


def test_a_disk_that_fails_sends_versions_straight_to_s3(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache.errors import StorageError
    from tiercache.tiers.disk import DiskTier

    def failing(*args: object, **kwargs: object) -> None:
        raise StorageError("injected I/O error")

    cfg = _cfg(tmp_path, s3_config, relay)
    with tiercache.open(cfg) as cache:
        v1 = cache.save(_state(1), step=1).wait("local")
        monkeypatch.setattr(DiskTier, "put", failing)  # every disk write fails from now on
        monkeypatch.setattr(DiskTier, "begin_put", failing)
        hs = [cache.save(_state(s), step=s) for s in (2, 3, 4)]
        assert [h.wait("remote") for h in hs] == [h.version for h in hs]
        cache.flush()  # nothing lost: S3 took them all
    with tiercache.open(_s3_only(s3_config)) as remote:
        assert remote.resolve("main") == hs[-1].version
        parents = {v.id: v.parent for v in remote.versions()}
        assert [parents[h.version] for h in hs] == [v1, hs[0].version, hs[1].version]
        assert torch.equal(remote.restore("main")["w"], _state(4)["w"])


def test_opening_with_s3_down_serves_the_disk_and_warns_once(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, s3_config, relay)
    with tiercache.open(cfg) as cache:
        v1 = cache.save(_state(1), step=1).wait("remote")
        v2 = cache.save(_state(2), step=2).wait("remote")
    for mode in ("refuse", "hang"):
        relay.mode = mode  # type: ignore[assignment]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tiercache"), tiercache.open(cfg) as cache:
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and warnings[0].startswith("tier s3 is unavailable")
            assert [v.id for v in cache.versions()] == [v1, v2]
            assert torch.equal(cache.restore("main")["w"], _state(2)["w"])
            with pytest.raises(TierUnavailableError, match="cannot promote to s3"):
                cache.promote(v1, to="s3")
            with pytest.raises(TierUnavailableError, match="gc refused: tier s3 is unavailable"):
                cache.gc(grace=0)
        relay.mode = "up"


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "tiercache", "--config", str(config), *args], capture_output=True,
                          text=True, env=env, check=False, timeout=120)


@pytest.mark.parametrize("mode", ["refuse", "hang"])
def test_read_only_cli_commands_in_a_fresh_process_serve_the_disk_while_s3_is_down(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, mode: str
) -> None:
    cfg = _cfg(tmp_path, s3_config, relay)
    with tiercache.open(cfg) as cache:
        v1 = cache.save(_state(1), step=1).wait("remote")
        v2 = cache.save(_state(2), step=2).wait("remote")
    s3 = cfg["s3"]
    toml = tmp_path / "tiercache.toml"
    toml.write_text(
        f'[disk]\npath = "{cfg["disk"]["path"]}"\n[s3]\nurl = "{s3["url"]}"\nendpoint_url = "{s3["endpoint_url"]}"\n'
        f'region = "{s3["region"]}"\nconnect_timeout = 0.5\nread_timeout = 1.0\nprobe_timeout = 0.5\nmax_attempts = 2\n'
    )
    relay.mode = mode  # type: ignore[assignment]
    out = tmp_path / "restored.pt"
    for args in (["ls"], ["log"], ["stats"], ["verify"], ["restore", "main", "--out", str(out)]):
        got = _cli(toml, *args)
        assert got.returncode == 0, (args, got.stdout, got.stderr)
        warned = [line for line in got.stderr.splitlines() if "tier s3 is unavailable" in line]
        assert len(warned) == 1, (args, got.stderr)
    assert v1[:10] in _cli(toml, "ls").stdout and v2[:10] in _cli(toml, "ls").stdout
    assert torch.equal(torch.load(out)["w"], _state(2)["w"])
    needs_s3 = _cli(toml, "promote", "main", "--to", "s3")
    assert needs_s3.returncode == 1
    assert needs_s3.stderr.strip().splitlines()[-1].startswith("error: cannot promote to s3: it is unavailable")
