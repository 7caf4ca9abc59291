"""The bench's raw disk limits read and write what they claim to; cold rows wait for freed memory to settle."""

from __future__ import annotations

import threading
import time
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


def test_settle_memory_returns_at_once_without_a_reporting_counter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(baselines, "_REPORTED_KIB", tmp_path / "absent")
    assert baselines.settle_memory() == 0.0


def test_settle_memory_waits_until_the_counter_stays_still(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "reported_kib"
    counter.write_text("0\n")
    monkeypatch.setattr(baselines, "_REPORTED_KIB", counter)
    changes: list[float] = []

    def report() -> None:  # the host taking memory back in a few bursts
        for kib in range(1, 5):
            time.sleep(0.3)
            changes.append(time.monotonic())  # before the write: settle cannot have seen it earlier
            counter.write_text(f"{kib}\n")

    burst = threading.Thread(target=report)
    burst.start()
    baselines.settle_memory(quiet_s=0.5, cap_s=30.0)
    returned = time.monotonic()
    burst.join()
    assert len(changes) == 4
    assert returned - changes[-1] >= 0.5  # not before the last burst had been still for quiet_s


class _MovingCounter:
    """A reporting counter that changes on every read: the host never stops taking memory back."""

    def __init__(self) -> None:
        self.reads = 0

    def exists(self) -> bool:
        return True

    def read_text(self) -> str:
        self.reads += 1
        return f"{self.reads}\n"


@pytest.mark.timeout(10)  # a settle that ignores its cap would poll forever
def test_settle_memory_gives_up_at_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _MovingCounter()
    monkeypatch.setattr(baselines, "_REPORTED_KIB", counter)
    waited = baselines.settle_memory(quiet_s=0.5, cap_s=1.0)
    assert waited >= 1.0
    assert counter.reads >= 4  # it kept polling a counter that kept moving
