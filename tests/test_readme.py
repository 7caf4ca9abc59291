"""The README is the contract: its config example and its policy presets must load as written."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tiercache.config import CacheConfig, PolicyConfig, load_config
from tiercache.policy.builtin import load_policy

ROOT = Path(__file__).resolve().parents[1]


def _toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_config_file_example_is_a_valid_config() -> None:
    example = tomllib.loads(_toml_blocks()[0])
    cfg = load_config(example, env={})
    assert isinstance(cfg, CacheConfig)
    assert cfg.ram is not None and cfg.ram.capacity == 4 << 30
    assert cfg.disk is not None and cfg.disk.capacity == 100 << 30
    assert cfg.s3 is not None and cfg.s3.bucket == "bucket" and cfg.s3.prefix == "prefix"
    assert cfg.policy.name == "throughput-adaptive" and cfg.gc_grace == 3600
    assert load_policy(cfg.policy).place is not None


def test_every_shipped_preset_loads() -> None:
    presets = sorted(p.stem for p in (ROOT / "policies").glob("*.toml"))
    assert presets == ["keep-best", "slow-s3", "throughput-adaptive", "write-through"]
    for name in presets:
        policy = load_policy(PolicyConfig(name=name))
        assert callable(policy.place) and callable(policy.evict) and callable(policy.on_full)
