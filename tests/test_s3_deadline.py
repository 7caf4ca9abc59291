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
from tiercache.config import S3Config
from tiercache.errors import DeadlineExceededError
from tiercache.tiers.s3 import S3Tier


def _caught_up(cache: tiercache.TierCache, version: str, timeout: float = 60.0) -> bool:
    """Wait until S3 holds ``version`` (a liveness bound, not a speed figure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "s3" in {v.id: v for v in cache.versions()}[version].tiers:
            return True
        time.sleep(0.05)
    return False


def test_uploads_past_the_deadline_fail_remote_only(
    tmp_path: Path, s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = S3Tier.put

    def stalled(tier: S3Tier, key: str, data: object, **kw: bool) -> None:
        if key.startswith("chunks/"):
            release.wait(30)  # a store that keeps answering SlowDown, as seen from the engine
        real(tier, key, data, **kw)  # type: ignore[arg-type]

    s3 = s3_config.model_dump() | {"deadline_s": 0.5}
    cfg = {"disk": {"path": str(tmp_path)}, "s3": s3, "policy": {"name": "write-through"},
           "engine": {"probe_interval_s": 0.2}}
    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    monkeypatch.setattr(S3Tier, "put", stalled)
    cache = tiercache.open(cfg)
    try:
        h = cache.save(state, step=1)
        assert h.wait("local") == h.version
        with pytest.raises(DeadlineExceededError, match=r"s3\.deadline_s"):
            h.wait("remote", timeout=20)
        release.set()
        monkeypatch.undo()
        # Step 1 is local: only its remote level failed, which costs the next save nothing.
        h3 = cache.save({"w": state["w"] + 1}, step=3)
        assert h3.wait("local") == h3.version
        assert _caught_up(cache, h3.version)  # S3 answers a probe again: the newest version goes up
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
    real = S3Tier.put

    def stalled(tier: S3Tier, key: str, data: object, **kw: bool) -> None:
        if key.startswith("chunks/") and not release.is_set():
            release.wait(30)  # still sending when the deadline passes
        real(tier, key, data, **kw)  # type: ignore[arg-type]

    s3 = s3_config.model_dump() | {"deadline_s": 0.5}
    cfg = {"ram": {"capacity": "4MiB", "serve_reads": False}, "disk": {"path": str(tmp_path)}, "s3": s3,
           "policy": {"name": "write-through"}, "engine": {"probe_interval_s": 0.2}}
    first = {"w": torch.arange(300_000, dtype=torch.float32)}
    monkeypatch.setattr(S3Tier, "put", stalled)
    cache = tiercache.open(cfg)
    try:
        h1 = cache.save(first, step=1)
        with pytest.raises(DeadlineExceededError):
            h1.wait("remote", timeout=20)
        h3 = cache.save({"w": torch.full((300_000,), 7.0)}, step=3)
        assert h3.wait("local", timeout=20) == h3.version  # staged while step 1's upload still runs
        release.set()
        assert _caught_up(cache, h3.version)
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
