"""Crash consistency: SIGKILL a saving process at random moments and at every named failpoint.

The guarantee checked after every kill: a restore returns the newest version the child had
acknowledged at ``local`` (or ``remote``), or the one it was saving when it died, bit-exact; never
a mix of versions and never one older than an acknowledgement. The child (``_crash_child.py``)
acknowledges a level, fsynced, only after ``handle.wait(level)`` returned.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache import failpoints
from tiercache.config import S3Config
from tiercache.errors import SkippedError, StorageError, TierFullError, VersionNotFoundError

sys.path.insert(0, str(Path(__file__).parent))
from _crash_child import ForkServer, config_for, state_for  # the child script lives next to the tests

#: Steps of trial t are t * STRIDE + i, so every step (and its state) is unique in a cache.
STRIDE = 10_000
#: A fresh cache directory every so many trials keeps the catalog small while still
#: restarting on top of earlier crashes most of the time.
TRIALS_PER_ROOT = 10
#: Failpoints a disk-only config passes through on every save (the deletion-side ones,
#: ``leases.claim_waits`` and ``repo.chunks_doomed``, only when a deletion runs; S3's and gc's
#: have tests of their own below).
DISK_POINTS = tuple(n for n in failpoints.FAILPOINTS
                    if n.split(".")[0] in ("engine", "disk", "catalog")
                    or n in ("repo.after_claim", "repo.after_manifest_write"))


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    srv = ForkServer()
    yield srv
    srv.close()


@dataclass
class Tally:
    """What a run of trials did, for the assertions and the README figures."""

    trials: int = 0
    kills: int = 0
    acked: int = 0
    restored_newer: int = 0
    #: Trials meant to kill their child after its first acknowledgement (of ``local``, or with S3
    #: every other one of ``remote``), and those whose child had made that acknowledgement when
    #: it was killed (the kill lands on a cache that holds promises, so the check after it can
    #: catch one broken); they are equal: each such trial waits for it.
    after_ack: int = 0
    killed_after_ack: int = 0
    killed_after_remote_ack: int = 0


def _acks(path: Path) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {"local": [], "remote": []}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a line torn by the kill was never a promise
                out[parts[2]].append((int(parts[0]), parts[1]))
    return out


def _check(cfg: dict[str, Any], acked: list[tuple[int, str]], floor: int | None, last_try: int) -> int | None:
    """Restore ``main`` and check the guarantee; return the restored step (``None`` if none yet).

    Args:
        cfg: The cache config to restore with.
        acked: ``(step, version)`` acknowledged at the level this config provides, this trial.
        floor: The step restored after the previous trial on this cache (already promised).
        last_try: The highest step the child may have been saving when it died.
    """
    newest = acked[-1] if acked else None
    with tiercache.open(cfg) as cache:
        try:
            vid = cache.resolve("main")
        except VersionNotFoundError:
            assert newest is None and floor is None, "an acknowledged version was lost"
            return None
        got = cache.restore("main")
        step = cache.manifest(vid).step
    if newest is not None:
        assert step >= newest[0], f"restored step {step}, older than the acknowledged {newest[0]}"
        if step == newest[0]:
            assert vid == newest[1]
    if floor is not None:
        assert step >= floor
    assert step <= last_try, f"restored step {step} that was never saved"
    want = state_for(step, 0)
    assert got["step"] == step
    for k in ("w", "v", "b"):
        assert torch.equal(got[k], want[k]), f"{k} of step {step} is not bit-exact"
    return step


def _trial_specs(base: Path, s3: dict[str, Any] | None, t: int) -> dict[str, Any]:
    root = base / f"root{t // TRIALS_PER_ROOT}"
    if s3 is not None:
        s3 = {**s3, "url": f"{s3['url']}/r{t // TRIALS_PER_ROOT}"}
    return {
        "root": str(root), "s3": s3, "ack": str(base / f"ack{t}"), "log": str(base / "child.log"),
        "first_step": t * STRIDE,
    }


def _wait_for_ack(path: Path, level: str, deadline_s: float = 60.0) -> bool:
    """Whether the child acknowledged ``level`` within ``deadline_s`` (a loaded machine is slow, not stuck)."""
    end = time.monotonic() + deadline_s
    while not _acks(path)[level]:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _run_trial(server: ForkServer, spec: dict[str, Any], floors: dict[str, int | None],
               kill_after: tuple[str | None, float] | None, tally: Tally) -> None:
    """Run one child until it is killed, by a failpoint or by us; then check the guarantee.

    Args:
        kill_after: ``None`` to let a failpoint kill the child, else ``(after_level, seconds)``:
            SIGKILL it that many seconds after it started (or, if ``after_level`` is a level, after
            its first acknowledgement of that level).
    """
    (pid,) = server.start([{"mode": "loop", **spec}])
    acked_in_time = True
    if kill_after is not None:
        after_level, seconds = kill_after
        if after_level is not None:
            acked_in_time = _wait_for_ack(Path(spec["ack"]), after_level)
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):  # it died on its own: the exit code says why
            os.kill(pid, signal.SIGKILL)
    (code,) = server.reap()
    log = Path(spec["log"]).read_text() if Path(spec["log"]).exists() else ""
    assert code in (-signal.SIGKILL, 0), f"child exited {code}: {log[-2000:]}"
    assert acked_in_time, f"the child acknowledged nothing in a minute: {log[-2000:]}"
    tally.trials += 1
    tally.kills += code == -signal.SIGKILL
    acks = _acks(Path(spec["ack"]))
    tally.acked += len(acks["local"]) + len(acks["remote"])
    if kill_after is not None and kill_after[0] is not None and acks[kill_after[0]]:
        tally.killed_after_ack += 1
        tally.killed_after_remote_ack += kill_after[0] == "remote"
    last_try = max([spec["first_step"]] + [s + 1 for s, _ in acks["local"]])
    key = spec["root"]
    step = _check(config_for(spec), acks["local"], floors.get(key), last_try)
    if spec["s3"] is not None:
        remote_cfg = {"s3": spec["s3"], "policy": {"name": "write-through"}}
        floors[key + "/s3"] = _check(remote_cfg, acks["remote"], floors.get(key + "/s3"), last_try)
    if acks["local"] and step is not None and step > acks["local"][-1][0]:
        tally.restored_newer += 1
    floors[key] = step


def _random_kills(server: ForkServer, base: Path, s3: dict[str, Any] | None, n: int, seed: int,
                  env: dict[str, str] | None = None) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    floors: dict[str, int | None] = {}
    for t in range(n):
        # Most kills land while versions are being saved; some while the cache is opening.
        level = "remote" if s3 is not None and t % 2 else "local"
        when = (level, rng.uniform(0.0, 0.2)) if rng.random() < 0.85 else (None, rng.uniform(0.0, 0.3))
        tally.after_ack += when[0] is not None
        _run_trial(server, {**_trial_specs(base, s3, t), "env": env or {}}, floors, when, tally)
    return tally


def _s3_spec(cfg: S3Config) -> dict[str, Any]:
    return {"url": cfg.url, "endpoint_url": cfg.endpoint_url, "region": cfg.region}


@pytest.fixture
def s3_env(s3_server: Any) -> dict[str, str]:
    """The test server's credentials, handed to the children (the fork server may predate them)."""
    return s3_server.env()


def test_random_kills_disk(server: ForkServer, tmp_path: Path, slow: bool) -> None:
    n = 600 if slow else 20
    tally = _random_kills(server, tmp_path, None, n, seed=1)
    assert tally.trials == n
    assert tally.kills >= n * 0.9
    # The children made progress between kills: most kills hit a cache holding acknowledged
    # versions (how many more a child acknowledged before its kill depends on the machine's load).
    assert tally.killed_after_ack == tally.after_ack >= n * 0.7
    print(f"random kills disk: {tally}")


def test_random_kills_disk_and_s3(
    server: ForkServer, tmp_path: Path, s3_config: S3Config, s3_env: dict[str, str], slow: bool
) -> None:
    n = 400 if slow else 10
    tally = _random_kills(server, tmp_path, _s3_spec(s3_config), n, seed=2, env=s3_env)
    assert tally.trials == n
    assert tally.kills >= n * 0.9
    assert tally.killed_after_ack == tally.after_ack >= n * 0.7
    assert tally.killed_after_remote_ack >= n * 0.3  # and many hit a cache holding remote promises
    print(f"random kills disk+s3: {tally}")


@pytest.mark.parametrize("name", DISK_POINTS)
def test_kill_at_each_failpoint_disk(server: ForkServer, tmp_path: Path, name: str, slow: bool) -> None:
    rng = random.Random(name)
    hits = [1, rng.randint(2, 12)] + ([rng.randint(2, 40) for _ in range(8)] if slow else [])
    floors: dict[str, int | None] = {}
    tally = Tally()
    for t, nth in enumerate(hits):
        spec = {**_trial_specs(tmp_path, None, t), "failpoints": f"{name}=kill@{nth}", "max_saves": 60}
        _run_trial(server, spec, floors, None, tally)
    assert tally.kills == len(hits)  # the failpoint fired every time: it is on the write path


def test_kill_mid_multipart_upload(
    server: ForkServer, tmp_path: Path, s3_config: S3Config, s3_env: dict[str, str]
) -> None:
    s3 = {**_s3_spec(s3_config), "part_size": "5MiB"}
    floors: dict[str, int | None] = {}
    tally = Tally()
    for t, nth in enumerate((1, 3)):
        # A root of its own per trial: a head an earlier trial left local-only would be uploaded by
        # this one's catch-up, and its parts would count among the failpoint's hits.
        (tmp_path / f"t{t}").mkdir()
        spec = {**_trial_specs(tmp_path / f"t{t}", s3, t), "failpoints": f"s3.after_first_part=kill@{nth}",
                "max_saves": 10, "big": 1_600_000, "env": s3_env}
        _run_trial(server, spec, floors, None, tally)
    assert tally.kills == 2
    assert [len(_acks(tmp_path / f"t{t}" / f"ack{t}")["remote"]) for t in range(2)] == [0, 2]


def test_kill_mid_gc_keeps_every_live_version(server: ForkServer, tmp_path: Path) -> None:
    # reflog_keep=0: the rolled-back versions are garbage at once (the reflog keeps them otherwise).
    spec = {"root": str(tmp_path / "root"), "log": str(tmp_path / "child.log"), "reflog_keep": 0}
    with tiercache.open(config_for(spec)) as cache:
        kept = cache.save(state_for(1), step=1)
        kept.wait("local")
        for step in (2, 3):
            cache.save(state_for(step), step=step).wait("local")
        cache.rollback("main", kept.version)  # steps 2 and 3 become garbage
    server.start([{**spec, "mode": "gc", "failpoints": "gc.after_manifest_delete=kill"}])
    (code,) = server.reap()
    assert code == -signal.SIGKILL
    with tiercache.open(config_for(spec)) as cache:
        assert [v.step for v in cache.versions()] == [1]  # the manifests went first
        assert torch.equal(cache.restore("main")["w"], state_for(1)["w"])
        checked = cache.verify()  # right after the kill, before another gc: nothing is damaged
        assert checked.ok and checked.damage == (), checked.damage
        report = cache.gc(grace=0)  # the next gc finishes the job
        assert sum(report.chunks.values()) > 0
        assert torch.equal(cache.restore("main")["v"], state_for(1)["v"])


@pytest.mark.parametrize("name", ["disk.after_fsync", "repo.after_manifest_write", "catalog.before_ref_write"])
def test_a_raising_failpoint_fails_the_level_and_keeps_the_previous_version(tmp_path: Path, name: str) -> None:
    with tiercache.open(config_for({"root": str(tmp_path)})) as cache:
        good = cache.save(state_for(1), step=1)
        good.wait("local")
        failpoints.configure(f"{name}=raise")
        try:
            bad = cache.save(state_for(2), step=2)
            with pytest.raises(StorageError, match=f"failpoint {name}"):
                bad.wait("local")
        finally:
            failpoints.configure(None)
        with pytest.raises(StorageError):
            cache.close()  # the background error is reported once more on close
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    with tiercache.open(config_for({"root": str(tmp_path)})) as cache:
        assert cache.resolve("main") == good.version
        assert torch.equal(cache.restore("main")["w"], state_for(1)["w"])


def test_failpoint_spec_is_validated() -> None:
    from tiercache.errors import ConfigError

    for spec in ("nope=kill", "disk.after_fsync", "disk.after_fsync=explode", "disk.after_fsync=kill@0",
                 "disk.after_fsync=sleep:x"):
        with pytest.raises(ConfigError, match="TIERCACHE_FAILPOINTS"):
            failpoints.configure(spec)
    failpoints.configure(None)


@pytest.fixture(params=["tmpfs", "enospc"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A disk tier root with about 8 MiB of room: a real 8 MiB tmpfs, or injected ENOSPC after 8 MiB.

    Where mounting is not permitted (no root), the tmpfs case falls back to the injection too.
    """
    root = tmp_path / "mnt"
    root.mkdir()
    mounted = request.param == "tmpfs" and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], capture_output=True, check=False
    ).returncode == 0
    if not mounted:
        written = [0]
        real = os.pwrite

        def pwrite(fd: int, data: Any, offset: int) -> int:
            written[0] += len(data)
            if written[0] > 8 << 20:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite)
    try:
        yield root
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(root)], check=True)


def _big(step: int) -> dict[str, Any]:
    return {**state_for(step), "big": torch.arange(3_000_000, dtype=torch.float32) + step}  # 12 MB


def test_disk_full_fails_local_with_tier_full_and_keeps_the_previous_version(small_disk: Path) -> None:
    cfg = config_for({"root": str(small_disk / "c")})
    with tiercache.open(cfg) as cache:
        good = cache.save(state_for(1), step=1)
        good.wait("local")
        full = cache.save(_big(2), step=2)
        with pytest.raises(TierFullError):
            full.wait("local")
        with pytest.raises(TierFullError):
            cache.close()
    assert not list(small_disk.rglob(".tmp-*"))
    with tiercache.open(cfg) as cache:
        assert cache.resolve("main") == good.version
        got = cache.restore("main")
    assert all(torch.equal(got[k], state_for(1)[k]) for k in ("w", "v", "b"))


def test_disk_full_with_s3_still_reaches_remote(small_disk: Path, s3_config: S3Config) -> None:
    cfg = config_for({"root": str(small_disk / "c"), "s3": _s3_spec(s3_config)})
    with tiercache.open(cfg) as cache:
        cache.save(state_for(1), step=1).wait("remote")
        full = cache.save(_big(2), step=2)
        assert full.wait("remote") == full.version
        if os.path.ismount(small_disk):
            # A real filesystem's room is known before writing (issue 45): the version skips the
            # disk, whose only version is the branch head (never evicted), instead of failing there.
            with pytest.raises(SkippedError, match="disk is full and nothing on it may be evicted"):
                full.wait("local")
        else:
            with pytest.raises(TierFullError):
                full.wait("local")
        # Durable on S3: a degraded version, not a lost one, so closing reports nothing.
        assert cache.stats()["errors"]["lost_versions"] == 0
        assert cache.versions()[-1].states["disk"].state == ("skipped" if os.path.ismount(small_disk) else "failed")
    assert not list(small_disk.rglob(".tmp-*"))
    with tiercache.open(cfg) as cache:
        assert cache.resolve("main") == full.version  # the remote head is the newest
        got = cache.restore("main")
    assert torch.equal(got["big"], _big(2)["big"])
