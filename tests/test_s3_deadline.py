"""The per-version S3 deadline: a store that keeps a version's uploads busy fails that version cleanly.

The version stays local; S3 counts as down until a probe answers, and is then caught up with the
newest version (see tests/test_outage.py for outages proper).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.errors import DeadlineExceededError, SkippedError, TierUnavailableError
from tiercache.tiers.s3 import S3Tier


def _stall_s3(monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    """Chunk uploads stall until ``release`` (a store that keeps answering SlowDown, as the engine sees it),
    and once one has, the health probe fails too, so S3 stays down until then (no catch-up starts early)."""
    put, probe = S3Tier.put, S3Tier.probe
    stalling = threading.Event()

    def stalled(tier: S3Tier, key: str, data: object, **kw: bool) -> None:
        if key.startswith("chunks/") and not release.is_set():
            stalling.set()
            release.wait(30)  # still sending when the deadline passes
        put(tier, key, data, **kw)  # type: ignore[arg-type]

    def probe_fails(tier: S3Tier) -> None:
        if stalling.is_set() and not release.is_set():
            raise TierUnavailableError("the store is still throttling")
        probe(tier)

    monkeypatch.setattr(S3Tier, "put", stalled)
    monkeypatch.setattr(S3Tier, "probe", probe_fails)


def _until_down(cache: tiercache.TierCache, timeout: float = 60.0) -> str:
    """Wait until S3 is marked down (a liveness bound); return why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outage = core_of(cache).repo.health.outage("s3")
        if outage is not None:
            return outage.reason
        time.sleep(0.05)
    raise AssertionError("S3 was never marked down")


def _superseded(older: tiercache.SaveHandle, newer: tiercache.SaveHandle) -> None:
    """``older``'s remote level failed: its upload passed the deadline, and ``newer`` superseded it."""
    with pytest.raises(SkippedError) as info:
        older.wait("remote")
    assert str(info.value).startswith(
        f"version {older.version} was not uploaded to s3: newer version {newer.version} of branch main superseded "
        f"it while s3 was unavailable (its own write had failed: DeadlineExceededError: writing version "
        f"{older.version} to s3 took longer than its deadline of 0.5s (s3.deadline_s)")
    assert isinstance(info.value.__cause__, DeadlineExceededError)


def test_an_upload_past_the_deadline_fails_that_write_only(
    tmp_path: Path, s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    s3 = s3_config.model_dump() | {"deadline_s": 0.5}
    cfg = {"disk": {"path": str(tmp_path)}, "s3": s3, "policy": {"name": "write-through"},
           "engine": {"probe_interval_s": 0.2}}
    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    _stall_s3(monkeypatch, release)
    cache = tiercache.open(cfg)
    try:
        h = cache.save(state, step=1)
        assert h.wait("local") == h.version
        assert "s3.deadline_s" in _until_down(cache)
        # Step 1 is local; S3 counts as down, and step 1's remote level waits for its catch-up.
        assert not h.done("remote")
        h3 = cache.save({"w": state["w"] + 1}, step=3)  # costs nothing: S3 is skipped while down
        assert h3.wait("local") == h3.version
        cache.flush()
        _superseded(h, h3)  # catch-up will copy the newest version, not step 1
        release.set()
        monkeypatch.undo()
        assert h3.wait("remote", timeout=60) == h3.version  # S3 answers a probe again: step 3 goes up
        cache.flush()  # no version was lost
    finally:
        release.set()
        cache.close()
    s3_only = tiercache.open({"s3": s3})
    try:
        assert torch.equal(s3_only.restore("main")["w"], state["w"] + 1)
    finally:
        s3_only.close()


def test_an_upload_past_the_deadline_keeps_reading_its_own_bytes(
    tmp_path: Path, s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk whose upload still runs when the deadline fails the version keeps its bytes.

    Freed with the version, its region could take the next save's bytes while the upload still
    read it: the store would hold them under this chunk's name, and a later save of the same
    bytes would find the chunk stored and keep only a reference to the wrong bytes.
    """
    release = threading.Event()
    s3 = s3_config.model_dump() | {"deadline_s": 0.5}
    cfg = {"ram": {"capacity": "4MiB", "serve_reads": False}, "disk": {"path": str(tmp_path)}, "s3": s3,
           "policy": {"name": "write-through"}, "engine": {"probe_interval_s": 0.2}}
    first = {"w": torch.arange(300_000, dtype=torch.float32)}
    _stall_s3(monkeypatch, release)
    cache = tiercache.open(cfg)
    try:
        h1 = cache.save(first, step=1)
        assert "s3.deadline_s" in _until_down(cache)
        h3 = cache.save({"w": torch.full((300_000,), 7.0)}, step=3)
        assert h3.wait("local", timeout=20) == h3.version  # staged while step 1's upload still runs
        cache.flush()
        _superseded(h1, h3)
        release.set()
        assert h3.wait("remote", timeout=60) == h3.version
    finally:
        release.set()
        cache.close()
    monkeypatch.undo()
    fresh = tiercache.open({"ram": {"serve_reads": False}, "s3": s3, "policy": {"name": "write-through"}})
    try:
        h = fresh.save(first, step=4)  # finds step 1's chunk on the store: a reference only
        assert h.wait("remote", timeout=60) == h.version
        assert torch.equal(fresh.restore(h.version)["w"], first["w"])
    finally:
        fresh.close()
