"""S3 at scale (tiercache.tiers._s3pacing): bounded writes in flight; a throttled store slows saves down."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _s3faults import SlowDownChunks

import tiercache
from tiercache.cache import core_of
from tiercache.config import S3Config
from tiercache.errors import StorageError, TierUnavailableError
from tiercache.tiers._s3pacing import Pacer


class Throttle(Exception):
    """Stands for a 503 SlowDown answer."""


def test_pacer_halves_on_throttling_and_recovers_one_by_one() -> None:
    pacer = Pacer(8, retries=5, backoff_cap=0.0)
    answers = iter([Throttle(), Throttle(), Throttle(), "ok"])

    def call() -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert pacer.run(call, lambda e: isinstance(e, Throttle)) == "ok"
    # 8 -> 4 -> 2 -> 1, and the success that followed counts: one success at a bound of 1 makes it 2.
    assert (pacer.limit, pacer.throttled_total, pacer.take_throttled(), pacer.take_throttled()) == (2, 3, 3, 0)
    # Additive increase: the bound grows by one after `limit` successes in a row, up to the configured 8.
    for _ in range(2 + 3):
        pacer.run(lambda: None, lambda e: False)
    assert pacer.limit == 4
    pacer.slow_down()
    assert pacer.limit == 2
    with pytest.raises(ValueError):
        pacer.run(lambda: (_ for _ in ()).throw(ValueError("not a throttle")), lambda e: isinstance(e, Throttle))
    assert pacer.throttled_total == 3
    always = Pacer(4, retries=2, backoff_cap=0.0)
    with pytest.raises(Throttle):
        always.run(lambda: (_ for _ in ()).throw(Throttle()), lambda e: isinstance(e, Throttle))
    assert always.throttled_total == 2  # two retries, then the third answer is raised


def test_pacer_bounds_requests_in_flight_and_shares_a_node() -> None:
    pacer = Pacer(8, retries=0)
    pacer.share(4)
    assert pacer.limit == 2
    inside: list[int] = []
    cv = threading.Condition()
    release = threading.Event()

    def request(i: int) -> None:
        with cv:
            inside.append(i)
            cv.notify_all()
        assert release.wait(10)

    threads = [threading.Thread(target=pacer.run, args=(lambda i=i: request(i), lambda e: False)) for i in range(3)]
    for t in threads:
        t.start()
    with cv:
        assert cv.wait_for(lambda: len(inside) == 2, timeout=10)
    late = next(t for i, t in enumerate(threads) if i not in inside)
    late.join(0.2)
    assert late.is_alive() and len(inside) == 2  # the third waits for a slot
    release.set()
    for t in threads:
        t.join(10)
    assert sorted(inside) == [0, 1, 2]


def _config(tmp_path: Path, s3_config: S3Config, **s3: Any) -> dict[str, Any]:
    # One attempt per botocore call, so the pacer's own retries (short waits) do all the retrying.
    return {"disk": {"path": str(tmp_path / "disk")}, "policy": {"name": "write-through"},
            "s3": {**s3_config.model_dump(mode="json"), "max_attempts": 1, **s3}}


def test_a_throttling_store_slows_the_save_down_and_it_still_reaches_remote(
    tmp_path: Path, s3_config: S3Config
) -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32)}  # one chunk: one PutObject, so the count is exact
    with tiercache.open(_config(tmp_path, s3_config)) as cache:
        tier = core_of(cache).repo.durable["s3"]
        throttle = SlowDownChunks(tier._client, 4)
        h = cache.save(state, step=1)
        assert h.wait("remote") == h.version
        assert throttle.answered == 4 and tier.pacer.throttled_total == 4
        assert tier.pacer.limit < cache.config.s3.max_concurrency  # slowed down, not failed
    with tiercache.open({"s3": _config(tmp_path, s3_config)["s3"]}) as s3_only:
        assert torch.equal(s3_only.restore("main")["w"], state["w"])


def test_a_store_that_keeps_throttling_fails_the_upload_only_after_the_retries(
    tmp_path: Path, s3_config: S3Config
) -> None:
    # A probe a minute apart: S3 stays down for the whole test once the upload gives up.
    config = {**_config(tmp_path, s3_config, throttle_retries=2), "engine": {"probe_interval_s": 60}}
    cache = tiercache.open(config)
    try:
        throttle = SlowDownChunks(core_of(cache).repo.durable["s3"]._client, 100)
        h = cache.save({"w": torch.ones(16)}, step=1)
        assert h.wait("local") == h.version
        deadline = time.monotonic() + 60  # a liveness bound: the retries take well under a second
        while core_of(cache).repo.health.outage("s3") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        outage = core_of(cache).repo.health.outage("s3")
        assert outage is not None and "SlowDown" in outage.reason
        assert throttle.answered == 3  # the first try and two retries, then the upload gave up
        # The version is on disk: its remote level waits for S3 to be caught up, not fails.
        assert not h.done("remote")
    finally:
        cache.close()
    with pytest.raises(TierUnavailableError) as info:
        h.wait("remote")  # closed while S3 was still down
    assert str(info.value).startswith(f"version {h.version} was not uploaded to s3: s3 was still unavailable "
                                      "when the cache closed")
    assert isinstance(info.value.__cause__, StorageError) and "SlowDown" in str(info.value.__cause__)
