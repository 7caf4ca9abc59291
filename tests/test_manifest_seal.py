"""Sealed manifests and refs: a flipped bit anywhere is detected, never restored as wrong data."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.config import S3Config
from tiercache.errors import IntegrityError, TierCacheError
from tiercache.manifest import RefRecord, Version, seal, unseal


def _state() -> dict[str, object]:
    return {"model": {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3)}, "step": 7, "lr": 0.5}


def _flips(data: bytes) -> list[bytes]:
    out = []
    for i in range(len(data) * 8):
        b = bytearray(data)
        b[i // 8] ^= 1 << (i % 8)
        out.append(bytes(b))
    return out


def test_every_single_bit_flip_of_a_manifest_and_a_ref_is_refused(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as cache:
        vid = cache.save(_state(), step=7).wait("local")
    manifest = (tmp_path / "d" / "versions" / f"{vid}.json").read_bytes()
    assert Version.from_json(manifest).id == vid
    accepted = []
    for flipped in _flips(manifest):
        try:
            Version.from_json(flipped, source="disk:versions/x.json")
        except IntegrityError:
            continue
        accepted.append(flipped)
    assert accepted == []
    ref = RefRecord(kind="branch", name="main", version=vid, seq=3).to_json()
    for flipped in _flips(ref):
        with pytest.raises(IntegrityError):
            RefRecord.from_json(flipped)
    # The seal is checked before parsing: a valid JSON body under a wrong digest names the damage.
    body = unseal(manifest, "x")
    with pytest.raises(IntegrityError, match=r"^disk:versions/x\.json is damaged: its bytes do not match their "
                       "checksum$"):
        Version.from_json(body.replace(b'"model', b'"Model') + manifest[len(body):], source="disk:versions/x.json")
    assert Version.from_json(body).id == vid  # written before seals existed: still read
    assert seal(body) == manifest


def _saved_on_disk_and_s3(tmp_path: Path, s3_config: S3Config) -> tuple[dict[str, Any], str]:
    """A config of a disk and S3 (write-through: both hold every version) and a version saved to both."""
    cfg = {"disk": {"path": str(tmp_path / "d")}, "s3": s3_config.model_dump(mode="json"),
           "policy": {"name": "write-through"}}
    with tiercache.open(cfg) as cache:
        return cfg, cache.save(_state(), step=7).wait("remote")


def test_a_flipped_manifest_on_disk_never_restores_wrong_data_and_s3s_copy_is_used(
        tmp_path: Path, s3_config: S3Config) -> None:
    cfg, vid = _saved_on_disk_and_s3(tmp_path, s3_config)
    path = tmp_path / "d" / "versions" / f"{vid}.json"
    good = path.read_bytes()
    rng = random.Random(5)
    for bit in rng.sample(range(len(good) * 8), 40):
        flipped = bytearray(good)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(flipped))
        with tiercache.open(cfg) as cache:
            got = cache.restore(vid)
            assert torch.equal(got["model"]["w"], _state()["model"]["w"]) and got["step"] == 7, bit  # type: ignore[index]
            # (the manifest is S3's; the chunks, intact, still come from the disk)
        with tiercache.open({"disk": cfg["disk"]}) as alone, pytest.raises(TierCacheError):
            alone.restore(vid)  # the disk's copy alone: refused, not restored wrong
    path.write_bytes(good)


def test_verify_reports_a_damaged_manifest_and_repair_rewrites_it_from_a_good_copy(
        tmp_path: Path, s3_config: S3Config) -> None:
    cfg, vid = _saved_on_disk_and_s3(tmp_path, s3_config)
    key = f"versions/{vid}.json"
    path = tmp_path / "d" / key
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 3] ^= 0x10
    path.write_bytes(bytes(flipped))
    damaged = f"disk:{key} is damaged: its bytes do not match their checksum"
    with tiercache.open({"disk": cfg["disk"]}) as alone:  # the only copy this cache sees
        report = alone.verify()
        assert [(d.tier, d.key, d.problem, d.detail) for d in report.damage] == [("disk", key, "damaged", damaged)]
        assert report.unrepairable == (key,) and not report.ok
    with tiercache.open(cfg) as cache:
        report = cache.verify()
        assert [(d.tier, d.key, d.detail) for d in report.damage] == [("disk", key, damaged)] and not report.ok
        report = cache.verify(repair=True)
        assert [(d.key, d.repaired_from) for d in report.damage] == [(key, "catalog")] and report.ok
    assert path.read_bytes() == good
    with tiercache.open({"disk": cfg["disk"]}) as alone:
        assert alone.verify().ok and torch.equal(alone.restore(vid)["model"]["w"], _state()["model"]["w"])  # type: ignore[index]
