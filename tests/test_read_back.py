"""With S3 in the config, RAM holds a version only until the disk has it (issue 45, item 1).

S3 uploads each version from RAM at once, in parallel with the disk; once the disk has it, the
chunks S3 has not read yet stay in RAM only until a save needs the room, and S3 reads those the
arena let go back from the disk (docs/design.md section 3). So a slow S3 never keeps ``save()``
waiting for room in the default arena while the disk keeps up, and S3 never waits for the disk;
the version stays open until S3 has it, so no eviction of the disk copy it reads loses it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache import failpoints
from tiercache.config import S3Config
from tiercache.format import flatten
from tiercache.names import chunk_key
from tiercache.testing import ThrottledProxy

MB = 10**6
MIB = 1 << 20


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[ThrottledProxy]:
    with ThrottledProxy(s3_server.endpoint_url, limit_bps=1_000_000) as p:  # far slower than any disk
        yield p


def _state(seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(nbytes // 4, generator=g)}


def _waits(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waits for room in the RAM arena" in r.getMessage()]


def test_a_slow_s3_does_not_keep_save_waiting_for_room_in_the_default_arena(
    tmp_path: Path, s3_config: S3Config, proxy: ThrottledProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # The README's config: a disk, then S3; no [ram] table. Three 24 MB versions do not fit in
    # the default 64 MiB arena together: the third save used to wait for the first to reach S3
    # (24 s at 1 MB/s).
    cfg = {"disk": {"path": str(tmp_path / "disk")},
           "s3": s3_config.model_copy(update={"endpoint_url": proxy.url}).model_dump()}
    states = [_state(i, 24 * MB) for i in range(3)]
    caplog.set_level(logging.WARNING, logger="tiercache")
    with tiercache.open(cfg) as cache:
        handles = []
        for i, s in enumerate(states):
            handles.append(cache.save(s, step=i))
            handles[-1].wait("local")
            # Once the disk has it, no version in flight needs its chunks in RAM: they are only
            # read cache now, which a save that needs the room drops.
            ram = cache.engine.local.ramcache
            published = cache.engine.published(handles[-1].version)
            assert published is not None  # still in flight: S3 has not got it
            keys = [chunk_key(c.id) for c in published.result().chunks]
            ram.evict(keys)
            assert ram.ram is not None and [ram.ram.size(k) for k in keys] == [None] * len(keys)
        assert cache.engine.local.ramcache.capacity == 64 * MIB  # the default arena, never grown
        # Every save returned while S3 was still uploading the first version (from the disk).
        assert not handles[0].future("remote").done()
        proxy.limit_bps = None
        cache.flush()
    assert _waits(caplog) == []
    assert handles[0].succeeded("remote") and handles[-1].succeeded("remote")
    # The S3 copies, read back from the disk, are bit-exact: restore them from S3 alone.
    with tiercache.open({"s3": s3_config.model_dump()}) as remote:
        for h, s in [(handles[0], states[0]), (handles[-1], states[-1])]:
            assert torch.equal(remote.restore(h.version)["w"], s["w"]), h.version


def test_a_full_arena_says_once_which_tier_save_waits_for_and_what_helps(
    tmp_path: Path, s3_config: S3Config, proxy: ThrottledProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # No disk: every version waits in RAM for S3; the arena holds two of these versions, so the
    # third save waits for the first to reach S3 (at 1 MB/s, until the warning lifts the limit).
    cfg = {"ram": {"capacity": "16MiB"}, "s3": s3_config.model_copy(update={"endpoint_url": proxy.url}).model_dump()}
    states = [_state(i, 6 * MB) for i in range(4)]

    class Lift(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for room" in record.getMessage():
                proxy.limit_bps = None

    lift = Lift()
    logging.getLogger("tiercache.pipeline.engine").addHandler(lift)
    caplog.set_level(logging.WARNING, logger="tiercache")
    try:
        with tiercache.open(cfg) as cache:
            handles = [cache.save(s, step=i) for i, s in enumerate(states)]
            staged = cache.engine.layout_of(flatten(states[0], allow_pickle=False)).staged_bytes
            cache.flush()
    finally:
        logging.getLogger("tiercache.pipeline.engine").removeHandler(lift)
    assert all(h.succeeded("remote") for h in handles)
    # Said once, although the fourth save may have waited too (at most once a minute).
    assert _waits(caplog) == [
        f"save() waits for room in the RAM arena: the versions in flight hold it until s3 has them; a [disk] "
        f"tier would hold them sooner; raise ram.capacity above {16 * MIB} bytes (room for 3 versions of "
        f"{staged} bytes) or save less often (said at most once a minute)"]


def test_s3_reading_back_from_a_small_disk_with_a_retention_loses_no_acknowledged_version(
    tmp_path: Path, s3_config: S3Config, proxy: ThrottledProxy
) -> None:
    # The disk holds three versions and a retention of the user's drops all but the newest as
    # room is needed, while S3 reads versions back from it at 2 MB/s: a version S3 still reads
    # is open, so neither the capacity nor the retention takes it meanwhile.
    cfg = {"disk": {"path": str(tmp_path / "disk"), "capacity": 7 * MIB},
           "s3": s3_config.model_copy(update={"endpoint_url": proxy.url}).model_dump(),
           "chunk_bytes": "1MiB",
           "policy": {"name": "throughput-adaptive", "params": {"compression": "off", "retention": {"latest": 1}}}}
    proxy.limit_bps = 2_000_000
    states = [_state(i, 2 * MIB) for i in range(5)]
    with tiercache.open(cfg) as cache:
        handles = []
        for i, s in enumerate(states):
            handles.append(cache.save(s, step=i))
            handles[-1].future("durable").exception()  # settled on one tier at least, either way
        proxy.limit_bps = None
        cache.flush()
    acked = [h for h in handles if any(h.succeeded(lvl) for lvl in ("local", "remote", "durable"))]
    assert acked == handles
    assert any(h.succeeded("local") for h in handles) and handles[0].succeeded("remote")
    with tiercache.open(cfg) as cache:
        pruned = {v.id for v in cache.pruned()}
        for h, s in zip(handles, states, strict=True):
            if h.version in pruned:  # a rule the user set dropped it, and it says so
                assert not h.succeeded("remote")
                continue
            assert torch.equal(cache.restore(h.version)["w"], s["w"]), h.version


def test_s3_uploads_from_ram_while_the_disk_commit_is_held(
    tmp_path: Path, s3_config: S3Config, proxy: ThrottledProxy
) -> None:
    # The disk's commit of the version is held until S3 has committed it (or 10 s passed): S3
    # uploads from RAM at once, in parallel with the disk, not after it (time to durable in S3
    # was the disk's time plus S3's).
    proxy.limit_bps = 20_000_000
    cfg = {"disk": {"path": str(tmp_path / "disk")},
           "s3": s3_config.model_copy(update={"endpoint_url": proxy.url}).model_dump(), "chunk_bytes": "1MiB"}
    state = _state(7, 4 * MIB)
    handle: list[tiercache.SaveHandle] = []
    seen: dict[str, bool] = {}
    saved = threading.Event()

    def hold_the_disk() -> None:
        if threading.current_thread().name != "tiercache-writer-disk":
            return  # S3's own commit
        saved.wait(10)
        remote = handle[0].future("remote")
        futures_wait([remote], timeout=10)
        seen.update(remote=remote.done(), local=handle[0].future("local").done())

    with tiercache.open(cfg) as cache, failpoints.hooked("repo.after_manifest_write", hold_the_disk):
        handle.append(cache.save(state, step=0))
        saved.set()
        cache.flush()
    assert seen == {"remote": True, "local": False}
    assert handle[0].succeeded("remote") and handle[0].succeeded("local")
    with tiercache.open({"s3": s3_config.model_dump()}) as remote:
        assert torch.equal(remote.restore(handle[0].version)["w"], state["w"])


def test_a_save_that_needs_the_room_drops_chunks_s3_has_not_read_and_s3_reads_them_from_the_disk(
    tmp_path: Path, s3_config: S3Config, proxy: ThrottledProxy
) -> None:
    # S3 reads one 1 MiB chunk at a time at 50 kB/s: when the disk has committed the first
    # version, S3 is still on its first chunk, and RAM keeps the other three for it. The second
    # save needs their room: the arena drops them, and S3 reads them back from the disk.
    proxy.limit_bps = 50_000
    cfg = {"ram": {"capacity": "12MiB", "serve_reads": False}, "disk": {"path": str(tmp_path / "disk")},
           "s3": s3_config.model_copy(update={"endpoint_url": proxy.url}).model_dump(),
           "chunk_bytes": "1MiB", "io_threads": 1}
    first, second = _state(8, 4 * MIB), _state(9, 10 * MIB)
    with tiercache.open(cfg) as cache:
        ram = cache.engine.local.ramcache
        try:
            h1 = cache.save(first, step=0)
            h1.wait("local")
            published = cache.engine.published(h1.version)
            assert published is not None  # still in flight: S3 has not got it
            keys = [chunk_key(c.id) for c in published.result().chunks]
            assert ram.ram is not None
            # The disk has it, S3 not yet: RAM keeps the chunks S3 is still to read (the one
            # being read, and the three after it).
            assert [ram.ram.size(k) is not None for k in keys] == [True] * 4
            h2 = cache.save(second, step=1)  # needs the room of the chunks kept for S3
            gone = [k for k in keys if ram.ram.size(k) is None]
            assert len(gone) >= 3 and not h1.future("remote").done()
        finally:
            proxy.limit_bps = None
        cache.flush()
        assert h1.succeeded("remote") and h2.succeeded("remote") and h2.succeeded("local")
        # Released once S3 was done: nothing of either version is left in the arena.
        assert [ram.ram.size(k) for k in keys] == [None] * 4
        assert ram.arena is not None and ram.arena.in_use == (0, 0)
    with tiercache.open({"s3": s3_config.model_dump()}) as remote:
        for h, s in [(h1, first), (h2, second)]:
            assert torch.equal(remote.restore(h.version)["w"], s["w"]), h.version
