"""The per-version S3 deadline: a store that keeps a version's uploads busy fails that version cleanly."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.config import S3Config
from tiercache.errors import DeadlineExceededError
from tiercache.tiers.s3 import S3Tier


def test_uploads_past_the_deadline_fail_remote_only(
    tmp_path: Path, s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = S3Tier.put

    def stalled(tier: S3Tier, key: str, data: object) -> None:
        if key.startswith("chunks/"):
            release.wait(30)  # a store that keeps answering SlowDown, as seen from the engine
        real(tier, key, data)  # type: ignore[arg-type]

    s3 = s3_config.model_dump() | {"deadline_s": 0.5}
    cfg = {"disk": {"path": str(tmp_path)}, "s3": s3, "policy": {"name": "write-through"}}
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
        with pytest.raises(DeadlineExceededError):
            cache.save(state, step=2)  # reported once on the next save, like any background error
        h3 = cache.save({"w": state["w"] + 1}, step=3)
        assert h3.wait("remote", timeout=60) == h3.version
    finally:
        release.set()
        cache.close()
    s3_only = tiercache.open({"s3": s3})
    try:
        assert torch.equal(s3_only.restore("main")["w"], state["w"] + 1)
    finally:
        s3_only.close()
