"""Saves through an S3 tier whose requests are faulted on the way (real local S3 server).

Faults come from :mod:`_s3faults` (botocore ``before-send`` hooks on the tier's own client, seeded).
After each run a fresh cache *without* faults opens the same prefix and checks what is durable:
every save reported successful restores bit-exact, nothing else is referenced, no multipart upload
is left behind. Larger trial counts run with ``--slow``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _s3faults import S3Faults

import tiercache
from tiercache.cache import TierCache, core_of
from tiercache.config import S3Config
from tiercache.errors import (
    AccessDeniedError,
    ConflictError,
    StorageError,
    TierCacheError,
    TierFullError,
)

pytestmark = pytest.mark.s3

#: How long one save may take before the test calls it hung (a guard, not a timing assertion).
SAVE_DEADLINE_S = 180.0


def _state(step: int, big: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {f"w{i}": torch.randn(16 * 1024, generator=g) for i in range(4)}  # 4 x 64 KiB chunks
    if big:
        out["big"] = torch.randn(3 * 512 * 1024, generator=g)  # 6 MiB: a 2-part multipart upload
    return out


def _cfg(s3_config: S3Config, **s3: Any) -> dict[str, Any]:
    return {
        "ram": {"capacity": "64MiB"},
        "s3": {**s3_config.model_dump(), "part_size": "5MiB", **s3},
        "chunk_bytes": "8MiB",
        "pack_below": "64KiB",
    }


@dataclass
class Run:
    """Outcome of a series of saves under faults."""

    ok: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    failed: dict[str, TierCacheError] = field(default_factory=dict)
    conflicts: int = 0


def _saves(cache: TierCache, n: int, *, big: bool = False, first_step: int = 0, run: Run | None = None) -> Run:
    run = Run() if run is None else run
    for step in range(first_step, first_step + n):
        state = _state(step, big)
        while True:
            try:
                h = cache.save(state, step=step)
                break
            except TierCacheError as e:
                # An earlier save's failure is reported once more, on the next save: that one.
                assert any(e is f for f in run.failed.values()), e
        try:
            assert h.wait("remote", timeout=SAVE_DEADLINE_S) == h.version
            run.ok[h.version] = state
        except ConflictError:
            run.conflicts += 1
        except TierCacheError as e:
            run.failed[h.version] = e
    return run


def _check_durable(s3_config: S3Config, run: Run) -> None:
    """A fresh cache without faults sees every successful save, bit-exact, and no upload left."""
    with tiercache.open({"s3": s3_config.model_dump()}) as fresh:
        listed = {v.id for v in fresh.versions()}
        assert set(run.ok) <= listed <= set(run.ok) | set(run.failed)
        for vid in listed:  # a failed save may have stored its manifest before its ref write failed
            got = fresh.restore(vid)
            want = run.ok.get(vid)
            if want is not None:
                assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        if run.ok:
            assert fresh.refs()["branch/main"] in listed
            last_ok = max(run.ok)
            assert fresh.resolve("main") >= last_ok
        assert core_of(fresh).repo.durable["s3"].list_multipart_uploads() == []
        assert fresh.verify().ok


@pytest.fixture
def trials(slow: bool) -> int:
    return 40 if slow else 6


def _close(cache: TierCache, run: Run) -> None:
    """Close the cache; the last failed save's error may be reported once more here, and only that."""
    try:
        cache.close()
    except TierCacheError as e:
        assert any(e is f for f in run.failed.values()), e


def _open_with_faults(s3_config: S3Config, run: Run, **kw: Any) -> Iterator[tuple[TierCache, S3Faults]]:
    cache = tiercache.open(_cfg(s3_config, **kw.pop("s3", {})))
    faults = S3Faults(core_of(cache).repo.durable["s3"]._client, **kw)
    yield cache, faults
    faults.remove()
    _close(cache, run)


def test_10pct_slowdown_every_save_succeeds(s3_config: S3Config, trials: int) -> None:
    run = Run()
    for cache, faults in _open_with_faults(s3_config, run, seed=10, error_rate=0.10):
        _saves(cache, trials, big=True, run=run)
        assert run.failed == {} and run.conflicts == 0 and len(run.ok) == trials
        assert faults.total("SlowDown") > 0
        assert faults.requests["UploadPart"] >= 2 * trials
        print(f"\ns3 faults 10%: {trials} saves ok, {faults.total()} faults injected "
              f"({dict(faults.injected)}) over {sum(faults.requests.values())} requests")
    _check_durable(s3_config, run)


def test_30pct_faults_each_save_succeeds_or_fails_cleanly(s3_config: S3Config, trials: int) -> None:
    run = Run()
    for cache, faults in _open_with_faults(s3_config, run, seed=30, error_rate=0.20, reset=0.10):
        _saves(cache, trials, big=True, run=run)
        assert run.conflicts == 0 and len(run.ok) + len(run.failed) == trials
        assert all(isinstance(e, StorageError) for e in run.failed.values())
        assert faults.total("SlowDown") > 0 and faults.total("reset") > 0
        print(f"\ns3 faults 30%: {len(run.ok)} saves ok, {len(run.failed)} failed cleanly, {faults.total()} faults "
              f"injected over {sum(faults.requests.values())} requests")
    _check_durable(s3_config, run)


def test_lost_ref_write_responses_are_never_conflicts(s3_config: S3Config, trials: int) -> None:
    run = Run()
    for cache, faults in _open_with_faults(s3_config, run, seed=17, lost_ref_response=0.5):
        _saves(cache, trials, run=run)
        first = min(run.ok)
        assert cache.tag("best", first) == first  # a create (If-None-Match)
        assert cache.branch("ft", first) == first
        assert cache.rollback("main", first) == first  # a move (If-Match)
        assert run.failed == {} and run.conflicts == 0 and len(run.ok) == trials
        lost = faults.total("lost")
        assert lost > 0
        print(f"\ns3 lost ref responses: {lost} of {faults.requests['PutObject']} PUTs lost, "
              f"{len(run.ok)} saves ok, 0 spurious conflicts")
    with tiercache.open({"s3": s3_config.model_dump()}) as fresh:
        assert fresh.refs() == {"branch/main": first, "branch/ft": first, "tag/best": first}
        got = fresh.restore("best")
        assert all(torch.equal(got[k], run.ok[first][k]) for k in got)


def test_a_part_that_keeps_failing_aborts_its_upload_and_fails_the_save(s3_config: S3Config) -> None:
    # Two throttle retries (default 8) still take the slowed-down path, without its 15 s of waits.
    cache = tiercache.open(_cfg(s3_config, max_attempts=2, throttle_retries=2))
    good = _saves(cache, 1, big=True)
    faults = S3Faults(core_of(cache).repo.durable["s3"]._client, seed=1, error_rate=1.0, only=frozenset({"UploadPart"}))
    bad = _saves(cache, 1, big=True, first_step=1)
    faults.remove()
    assert bad.ok == {} and len(bad.failed) == 1
    (err,) = bad.failed.values()
    assert isinstance(err, StorageError) and "SlowDown" in str(err)
    assert faults.requests["AbortMultipartUpload"] >= 1
    assert core_of(cache).repo.durable["s3"].list_multipart_uploads() == []
    _close(cache, bad)
    _check_durable(s3_config, Run(ok=good.ok, failed=bad.failed))


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [(403, "AccessDenied", AccessDeniedError), (507, "XMinioStorageFull", TierFullError)],
)
def test_permanent_errors_fail_fast(
    s3_config: S3Config, status: int, code: str, expected: type[TierCacheError]
) -> None:
    cache = tiercache.open(_cfg(s3_config))
    faults = S3Faults(core_of(cache).repo.durable["s3"]._client, seed=2, error_rate=1.0, error=(status, code),
                      only=frozenset({"PutObject"}))
    run = _saves(cache, 1)
    faults.remove()
    _close(cache, run)
    assert run.ok == {}
    (err,) = run.failed.values()
    assert isinstance(err, expected) and code in str(err)
    assert faults.total(code) == faults.requests["PutObject"]  # no retries of a permanent error
    assert faults.requests["PutObject"] <= 4  # one attempt per chunk written in parallel
