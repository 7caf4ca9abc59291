"""The bench's raw disk limits write and read the bytes they claim to, from distinct memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import baselines


def test_raw_write_and_read_cover_every_byte_from_their_own_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(baselines, "_DIRECT_BLOCK", 64 << 10)  # several requests for a small file
    path = tmp_path / "raw.bin"
    pages = 74 * 4096  # 300_001 bytes rounded up to whole pages
    assert baselines.odirect_write(path, 300_001) > 0
    assert path.read_bytes() == b"\xa5" * pages
    source = baselines._aligned_source(pages)
    source[:] = b"\x00" * pages
    assert baselines.odirect_read(path) > 0
    assert source[:] == b"\xa5" * pages  # the read filled all of it, not one block over and over
