"""S3 outages: training goes on, every version stays local, S3 catches up when it is back.

The S3 tier goes through a loopback relay in front of the real local S3 server, switched between
``up``, ``refuse`` (nothing listens: connections refused) and ``hang`` (connections accepted,
never answered). Timeouts are short so each outage is noticed within a second or two.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache import failpoints
from tiercache.cache import core_of
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
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, s3_config, relay)
    handles = []
    with tiercache.open(cfg) as cache:
        for step in range(1, 13):
            if step == 4:
                relay.mode = mode  # type: ignore[assignment]
            handles.append(cache.save(_state(step), step=step))  # never raises
            # Every version saved during the outage is local. (Before it, the default policy may
            # send one RAM -> S3 directly when the loaded machine measures the disk slower.)
            handles[-1].wait("local" if step >= 4 else "durable")
            cache.flush()  # each version settled before the next: the one it supersedes is known
            if step < 4:
                assert handles[-1].wait("remote") == handles[-1].version
        assert cache.stats()["errors"]["lost_versions"] == 0
        assert cache.stats()["tiers"]["s3"]["available"] is False
        for h in handles[3:]:
            assert h.wait("local") == h.wait("durable") == h.version
        # While S3 is down, the head's remote level waits (catch-up will upload it); every older
        # version saved meanwhile was superseded by the next one, which catch-up copies instead.
        head = handles[-1].version
        assert not handles[-1].done("remote")
        for older, newer in itertools.pairwise(handles[3:]):
            err = older.future("remote").exception()
            assert isinstance(err, SkippedError), err
            assert str(err).startswith(f"version {older.version} was not uploaded to s3: newer version "
                                       f"{newer.version} of branch main superseded it while s3 was unavailable")
        infos = {v.id: v for v in cache.versions()}
        assert infos[head].states["s3"].state == "pending"
        assert all(infos[h.version].states["s3"].state == "skipped" for h in handles[3:-1])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            cache.flush(timeout=30)  # does not wait for S3: it is down
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["flush"]
        assert "flush: 1 version(s) wait for s3, unavailable since " in caplog.records[0].getMessage()
        assert caplog.records[0].getMessage().endswith(
            f": {head} (step 12); they are on the other tiers, and their 'remote' level resolves when s3 "
            "answers again")
        relay.mode = "up"
        # The probe notices, and the newest version of the branch goes up without another save.
        assert handles[-1].wait("remote", timeout=60) == head
        assert "s3" in {v.id: v for v in cache.versions()}[head].tiers
    with tiercache.open(_s3_only(s3_config)) as remote:
        assert remote.resolve("main") == head
        got = remote.restore("main")
        assert torch.equal(got["w"], _state(12)["w"]) and got["step"] == 12
    with tiercache.open(cfg) as fresh:  # a fresh process still says why the others missed S3
        infos = {v.id: v for v in fresh.versions()}
        missed = [infos[h.version].states["s3"] for h in handles[3:-1]]
        assert all(s.state == "skipped" and "superseded it while s3 was unavailable" in s.reason
                   for s in missed), missed
    toml = tmp_path / "tiercache.toml"
    toml.write_text(f'[disk]\npath = "{cfg["disk"]["path"]}"\n[s3]\nurl = "{cfg["s3"]["url"]}"\n'
                    f'endpoint_url = "{cfg["s3"]["endpoint_url"]}"\nregion = "{cfg["s3"]["region"]}"\n')
    shown = CliRunner().invoke(app, ["--config", str(toml), "ls"])
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[1:13]}
    # Before the outage every version is on S3 (and on disk unless the policy sent it RAM -> S3
    # directly); each one saved during it is on disk and was skipped on S3 (disk, then s3).
    assert all(rows[h.version[:10]][-1] == "✓" for h in handles[:3]), shown.stdout
    assert all(rows[h.version[:10]][-2:] == ["✓", "skipped"] for h in handles[3:-1]), shown.stdout
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
    listed = _cli(toml, "ls").stdout
    assert v1[:10] in listed and v2[:10] in listed
    assert torch.equal(torch.load(out)["w"], _state(2)["w"])
    needs_s3 = _cli(toml, "promote", "main", "--to", "s3")
    assert needs_s3.returncode == 1
    assert needs_s3.stderr.strip().splitlines()[-1].startswith("error: cannot promote to s3: it is unavailable")


# ---------------------------------------------------------------------- the remote level tells the truth


@contextmanager
def _held_s3_claims() -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold every S3 write (catch-up's included) right after it leased its chunks, until ``go`` is set."""
    arrived, go = threading.Event(), threading.Event()

    def hold(tier: str, missing: set[str]) -> None:
        if tier == "s3":
            arrived.set()
            assert go.wait(60), "the held S3 write was never let go"

    with failpoints.hooked("repo.after_claim", hold):
        try:
            yield arrived, go
        finally:
            go.set()


def _reopened_with_s3_down(cfg: dict[str, Any], relay: ThrottledProxy) -> tuple[str, tiercache.TierCache]:
    """Save step 1 to S3, then open the cache again with S3 refusing: the version, and the cache."""
    with tiercache.open(cfg) as cache:
        v1 = cache.save(_state(1), step=1).wait("remote")
    relay.mode = "refuse"
    cache = tiercache.open(cfg)
    assert cache.stats()["tiers"]["s3"]["available"] is False  # noticed at open: S3 is marked down
    return v1, cache


def test_a_version_saved_while_s3_is_down_waits_for_it_and_reaches_remote_when_it_is_back(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy
) -> None:
    v1, cache = _reopened_with_s3_down(_cfg(tmp_path, s3_config, relay), relay)
    try:
        h = cache.save(_state(2), step=2)
        assert h.wait("local") == h.wait("durable") == h.version
        cache.flush()  # does not wait for S3, which is down
        assert not h.done("remote")  # neither reached nor failed: catch-up will upload it
        assert cache.versions()[-1].states["s3"].state == "pending"
        with _held_s3_claims() as (arrived, go):
            relay.mode = "up"
            assert arrived.wait(60), "S3 was not caught up"  # catch-up is copying the version now
            assert not h.done("remote")
            with pytest.raises(TimeoutError) as info:
                cache.flush(timeout=0.5)
            assert str(info.value) == (f"flush: 1 version(s) still pending after 0.5s: {h.version} (step 2, "
                                       "waiting for s3 to be caught up)")
            go.set()
            assert h.wait("remote", timeout=60) == h.version
        cache.flush()
    finally:
        cache.close()
    assert h.wait("remote") == h.version
    with tiercache.open(_s3_only(s3_config)) as remote:  # S3 alone holds it whole, on the branch
        assert remote.resolve("main") == h.version
        assert {v.id: v.parent for v in remote.versions()} == {v1: None, h.version: v1}
        got = remote.restore("main")
        assert torch.equal(got["w"], _state(2)["w"]) and torch.equal(got["b"], _state(2)["b"]) and got["step"] == 2


def test_of_two_versions_saved_while_s3_is_down_the_older_fails_naming_the_newer(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy
) -> None:
    v1, cache = _reopened_with_s3_down(_cfg(tmp_path, s3_config, relay), relay)
    try:
        older = cache.save(_state(2), step=2)
        newer = cache.save(_state(3), step=3)
        assert [older.wait("local"), newer.wait("local")] == [older.version, newer.version]
        cache.flush()
        with pytest.raises(SkippedError) as info:
            older.wait("remote")  # known once the newer one settled: catch-up copies only the head
        assert str(info.value) == (f"version {older.version} was not uploaded to s3: newer version {newer.version} "
                                   "of branch main superseded it while s3 was unavailable")
        assert not newer.done("remote")
        relay.mode = "up"
        assert newer.wait("remote", timeout=60) == newer.version
        states = {v.id: v.states["s3"] for v in cache.versions()}
        assert (states[older.version].state, states[older.version].reason) == ("skipped", str(info.value))
    finally:
        cache.close()
    with tiercache.open(_s3_only(s3_config)) as remote:
        assert remote.resolve("main") == newer.version
        assert {v.id for v in remote.versions()} == {v1, newer.version}
        assert torch.equal(remote.restore("main")["w"], _state(3)["w"])


def test_flush_and_close_during_an_s3_outage_name_what_waits_for_s3(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, s3_config, relay)
    _, cache = _reopened_with_s3_down(cfg, relay)
    try:
        hs = [cache.save(_state(s), step=s, branch=b) for s, b in ((2, "main"), (3, "dev"))]
        assert [h.wait("local") for h in hs] == [h.version for h in hs]
        outage = core_of(cache).repo.health.outage("s3")
        assert outage is not None
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            cache.flush(timeout=30)  # returns: nothing it can wait for is pending
        assert [r.getMessage() for r in caplog.records] == [
            f"flush: 2 version(s) wait for s3, unavailable since {outage.clock} ({outage.reason}): "
            f"{hs[0].version} (step 2), {hs[1].version} (step 3); they are on the other tiers, and their 'remote' "
            "level resolves when s3 answers again"]
        assert not any(h.done("remote") for h in hs)
        caplog.clear()
    finally:
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            cache.close()  # S3 is still down: close does not wait for it
    why = f"s3 was still unavailable when the cache closed (since {outage.clock}: {outage.reason})"
    for h in hs:
        with pytest.raises(TierUnavailableError) as info:
            h.wait("remote")
        assert str(info.value) == f"version {h.version} was not uploaded to s3: {why}"
        assert h.wait("durable") == h.version
    assert [r.getMessage() for r in caplog.records] == [
        f"closing: 2 version(s) not uploaded to s3: {why}: {hs[0].version} (step 2), {hs[1].version} (step 3); "
        "they are on the other tiers, and the next process that saves catches s3 up with the newest version of "
        "each branch and every tag"]
    relay.mode = "up"
    with tiercache.open(cfg) as again:  # the next process that saves catches S3 up
        again.save(_state(4), step=4, branch="other").wait("remote")
        assert _until(lambda: all("s3" in {v.id: v for v in again.versions()}[h.version].tiers for h in hs))


def test_s3_hanging_in_a_commit_holds_no_later_version_from_the_disk(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy
) -> None:
    # S3 hangs in version 1's commit, right after its manifest (the next request is the line of
    # S3's index): version 2 still reaches `local` meanwhile. Before, one index lock served every
    # tier, and S3's append held it for the S3 client's timeouts: the disk's commit (and so `local`,
    # and a group's `local` behind a coordinator's S3 commit) waited for S3.
    s3 = s3_config.model_copy(update={"endpoint_url": relay.url, "read_timeout": 120.0}).model_dump()
    cfg = {"disk": {"path": str(tmp_path / "disk")}, "s3": s3, "policy": {"name": "write-through"}}
    hung = threading.Event()

    def hang_s3(*_: object) -> None:
        if threading.current_thread().name == "tiercache-writer-s3" and not hung.is_set():
            relay.mode = "hang"
            hung.set()

    with tiercache.open(cfg) as cache:
        try:
            with failpoints.hooked("repo.after_manifest_write", hang_s3):
                h1 = cache.save(_state(1), step=1)
                assert hung.wait(60), "version 1 never reached S3's commit"
                h2 = cache.save(_state(2), step=2)
                assert h2.wait("local", timeout=60) == h2.version
            assert relay.mode == "hang" and not h1.done("remote")  # S3 still hangs in version 1's commit
        finally:
            relay.mode = "up"
        assert h1.wait("remote", timeout=60) == h1.version and h2.wait("remote", timeout=60) == h2.version
        got = cache.restore(h2.version)
        assert torch.equal(got["w"], _state(2)["w"]) and got["step"] == 2


def _model(step: int) -> dict[str, Any]:
    """A trainer's state of a few MiB: weights, optimizer moments, plain leaves."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g)},
            "optim": {"m": torch.randn(512, 1024, generator=g).half()}, "step": step}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    pairs = [(got["model"]["w"], want["model"]["w"]), (got["model"]["b"], want["model"]["b"]),
             (got["optim"]["m"], want["optim"]["m"])]
    return got["step"] == want["step"] and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)


def test_s3_hanging_before_a_process_first_save_holds_neither_save_nor_local(
    tmp_path: Path, s3_config: S3Config, relay: ThrottledProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # S3 answers at open (its probe), then hangs (connections accepted, never answered) before the
    # process's first save. That save loads the catalog: before, it listed S3 under the S3 client's
    # timeouts and retries (here 2 x 30 s, as the defaults' 5 x 20 s) and save() waited them out.
    # Now a tier still being read after a second is probed (0.5 s), and left out once it does not answer.
    cfg = _cfg(tmp_path, s3_config, relay)
    cfg["s3"].update(read_timeout=30.0, max_attempts=2)
    with tiercache.open(cfg) as cache:
        v1 = cache.save(_model(1), step=1).wait("remote")
    cache = tiercache.open(cfg)
    try:
        relay.mode = "hang"
        saved: list[Any] = []
        saver = threading.Thread(target=lambda: saved.append(cache.save(_model(2), step=2)), daemon=True)
        saver.start()
        saver.join(20)  # a liveness bound, below one hanging S3 request's timeout (30 s, then retried)
        assert saved, "save() waited for S3's listing"
        h = saved[0]
        assert h.wait("local", timeout=20) == h.version
        # The read left behind on S3 does not hold off the garbage collector meanwhile (it paused
        # it for its whole read, so for the trainer as long as S3 hung: 60 s here).
        assert _until(gc.isenabled, 5)
        assert cache.manifest(h.version).parent == v1  # the disk knew the head
        assert _same(cache.restore("main"), _model(2))
        assert cache.stats()["tiers"]["s3"]["available"] is False
        relay.mode = "up"
        assert h.wait("remote", timeout=60) == h.version
    finally:
        relay.mode = "up"
        cache.close()
    # A job restarted on a node whose disk is empty waits for S3's head while S3 answers, even when
    # its listing takes longer than the load's patience (it answers the probes): it is the parent.
    from tiercache.tiers.s3 import S3Tier

    listed, first = S3Tier.list, threading.Event()

    def slow(tier: S3Tier, prefix: str = "") -> list[str]:
        if not first.is_set():  # the catalog's first load lists S3 first (versions/, refs/)
            first.set()
            time.sleep(1.5)
        return listed(tier, prefix)

    monkeypatch.setattr(S3Tier, "list", slow)
    moved = {**cfg, "disk": {"path": str(tmp_path / "new-node")}}
    with tiercache.open(moved) as cache:
        h3 = cache.save(_model(3), step=3)
        assert cache.stats()["tiers"]["s3"]["available"] is True
        assert h3.wait("remote") == h3.version and cache.manifest(h3.version).parent == h.version
    monkeypatch.undo()
    with tiercache.open(_s3_only(s3_config)) as remote:
        assert {v.id: v.parent for v in remote.versions()} == {v1: None, h.version: v1, h3.version: h.version}
        assert _same(remote.restore(h.version), _model(2)) and _same(remote.restore("main"), _model(3))
