"""``verify --sample N`` reads N chunk copies at random; verify reports its progress."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app


def _cache(tmp_path: Path) -> dict[str, object]:
    cfg = {"disk": {"path": str(tmp_path / "disk")}, "chunk_bytes": "64KiB", "pack_below": "4KiB",
           "policy": {"name": "write-through"}}
    with tiercache.open(cfg) as cache:
        for step in range(3):  # 4 chunks of 64 KiB each, all different every step
            cache.save({"w": torch.arange(4 * 16384, dtype=torch.float32) + step * 1e6}, step=step).wait("local")
    return cfg


def test_a_sample_reads_that_many_chunk_copies_and_says_so(tmp_path: Path) -> None:
    cfg = _cache(tmp_path)
    seen: list[tuple[int, int]] = []
    with tiercache.open(cfg) as cache:
        full = cache.verify(progress=lambda done, total: seen.append((done, total)))
        assert (full.ok, full.chunks, full.chunk_copies, full.sampled) == (True, 12, 12, None)
        assert len(seen) == 12 and seen[-1] == (12 * 65536, 12 * 65536)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        quick = cache.verify(sample=5)
        assert (quick.ok, quick.sampled, quick.chunk_copies, quick.copies) == (True, 5, 12, full.copies - 7)
    (tmp_path / "t.toml").write_text(f'[disk]\npath = "{tmp_path / "disk"}"\n')
    out = CliRunner().invoke(app, ["--config", str(tmp_path / "t.toml"), "verify", "--sample", "2"])
    assert out.exit_code == 0, out.output
    assert out.output.strip() == ("verified 3 version(s), 2 chunk(s), 5 copies (a sample of 2 of 12 chunk copies): "
                                  "0 bad, 0 repaired")
    out = CliRunner().invoke(app, ["--config", str(tmp_path / "t.toml"), "verify", "--sample", "2", "--json"])
    assert json.loads(out.output)["sampled"] == 2


def test_a_sample_finds_damage_in_what_it_reads(tmp_path: Path) -> None:
    cfg = _cache(tmp_path)
    chunks = sorted((tmp_path / "disk" / "chunks").glob("*/*"))
    for path in chunks:  # every copy damaged: any sample finds it
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    with tiercache.open(cfg) as cache:
        report = cache.verify(sample=3)
    assert report.sampled == 3 and [d.problem for d in report.damage] == ["damaged"] * 3 and not report.ok
