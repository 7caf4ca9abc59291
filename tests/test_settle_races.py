"""Settling a version under races: the "after all" rule and the tier writers, interleaved on purpose.

A version that reached no durable tier is written after all to a tier it was skipped for (the
engine's fallback). That rule must decide only once every tier's write has its outcome, and a
version is written to a tier once, even when its writer's queue and a fallback both hold it.
Each interleaving is driven with failpoint hooks (a thread is held right after it leased a
version's chunks on a tier) and a scripted policy, so it is the one named in the test; and no
durability level is ever settled twice (checked after every test by ``conftest.py``, here too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import tiercache
from tiercache import failpoints, handle
from tiercache.config import S3Config
from tiercache.errors import SkippedError, TierCacheError
from tiercache.policy.base import Placement, PolicyContext, TierPlan, VersionView

HOLD_S = 60.0  # the longest a held thread waits: a liveness bound, never reached when the test passes


class Scripted:
    """Writes each version to every durable tier, except the tiers ``SKIPS[step]`` names (read at each ask).

    ``ORDER[step]`` orders the tiers for that step (the fallback takes the first it can).
    """

    SKIPS: ClassVar[dict[int, set[str]]] = {}
    ORDER: ClassVar[dict[int, tuple[str, ...]]] = {}

    def place(self, version: VersionView, ctx: PolicyContext) -> Placement:
        names = self.ORDER.get(version.step) or tuple(n for n, t in ctx.tiers.items() if t.durable)
        skips = self.SKIPS.get(version.step, set())
        return Placement(tuple(TierPlan(n, skip=n in skips, reason="scripted skip" if n in skips else "")
                               for n in names))

    def evict(self, tier: str, ctx: PolicyContext) -> list[str]:
        return []

    def on_full(self, needed_bytes: int, ctx: PolicyContext) -> str:
        return "wait"


@pytest.fixture
def script() -> Iterator[type[Scripted]]:
    yield Scripted
    Scripted.SKIPS.clear()
    Scripted.ORDER.clear()


class Hold:
    """Holds the first claim on ``tier`` made by a thread whose name starts with ``thread``, until :meth:`go`."""

    def __init__(self, tier: str, thread: str, action: Callable[[], None] | None = None) -> None:
        self.tier, self.thread, self.action = tier, thread, action
        self.arrived = threading.Event()
        self.released = threading.Event()
        self.hits = 0

    def matches(self, tier: str) -> bool:
        return tier == self.tier and threading.current_thread().name.startswith(self.thread)

    def hit(self) -> None:
        self.hits += 1
        if self.hits > 1:
            return
        self.arrived.set()
        if self.action is not None:
            self.action()
        assert self.released.wait(HOLD_S), f"the held {self.thread} write to {self.tier} was never let go"

    def wait(self) -> None:
        assert self.arrived.wait(HOLD_S), f"no {self.thread} write to {self.tier} arrived"

    def go(self) -> None:
        self.released.set()


class Claims:
    """Every claim of a version's chunks on a tier, as ``(tier, thread name)``, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self._cv = threading.Condition()

    def add(self, tier: str) -> None:
        with self._cv:
            self.seen.append((tier, threading.current_thread().name))
            self._cv.notify_all()

    def wait_for(self, tier: str, thread: str, count: int) -> None:
        """Wait until ``thread`` (a name prefix) made ``count`` claims on ``tier``."""
        with self._cv:
            assert self._cv.wait_for(lambda: self.count(tier, thread) >= count, HOLD_S), self.seen

    def count(self, tier: str, thread: str) -> int:
        return sum(1 for t, n in self.seen if t == tier and n.startswith(thread))


@contextmanager
def _holding(*holds: Hold) -> Iterator[Claims]:
    claims = Claims()

    def claimed(tier: str, missing: set[str]) -> None:
        claims.add(tier)
        for h in holds:
            if h.matches(tier):
                h.hit()

    with ExitStack() as stack:
        stack.enter_context(failpoints.hooked("repo.after_claim", claimed))
        stack.callback(lambda: [h.go() for h in holds])  # never leave a thread held behind a failure
        yield claims


def _until(check: Callable[[], bool]) -> None:
    """Wait until ``check()`` holds (a liveness bound of ``HOLD_S``, never reached when the test passes)."""
    deadline = time.monotonic() + HOLD_S
    while not check():
        assert time.monotonic() < deadline, "the awaited state was never reached"
        time.sleep(0.01)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "step": step}  # one chunk per version


def _open(tmp_path: Path, s3_config: S3Config) -> tiercache.TierCache:
    cfg = {"disk": {"path": str(tmp_path / "disk")}, "s3": s3_config.model_dump(),
           "policy": {"name": f"{__name__}:Scripted"}}
    cache = tiercache.open(cfg)
    cache.engine.local.early_writes = False  # every claim on the writer's own thread, where the holds look
    return cache


def test_a_version_a_tier_is_writing_is_not_written_elsewhere_after_all(
    tmp_path: Path, s3_config: S3Config, script: type[Scripted], caplog: pytest.LogCaptureFixture
) -> None:
    # The interleaving of issue 34 (seen on a small tmpfs): version N is being written to the
    # disk when a newer save has the policy coalesce it away from both tiers. N must settle on
    # the disk's outcome (local, and remote skipped), not be sent "after all" to S3 while the
    # disk write is still running, which also wrote N to S3 twice and settled its level twice.
    script.SKIPS.update({0: {"disk"}, 1: {"disk", "s3"}})
    script.ORDER[2] = ("s3", "disk")
    p0_on_s3 = Hold("s3", "tiercache-writer-s3")  # the S3 writer, busy: N stays queued there
    o_fallback = Hold("disk", "tiercache-fallback-disk")  # O, skipped everywhere, goes to the disk after all
    n_on_disk = Hold("disk", "tiercache-writer-disk")  # the disk writer holds N mid-write
    cache = _open(tmp_path, s3_config)
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache"), _holding(p0_on_s3, o_fallback, n_on_disk):
            p0 = cache.save(_state(0), step=0)
            p0_on_s3.wait()
            o = cache.save(_state(1), step=1)
            o_fallback.wait()
            n = cache.save(_state(2), step=2)
            n_on_disk.wait()
            script.SKIPS[2] = {"disk", "s3"}  # what the policy says of N once a newer version is pending
            m = cache.save(_state(3), step=3)
            cache.engine.wait_published()  # M is placed: the queued versions were asked about again
            for hold in (n_on_disk, o_fallback, p0_on_s3):  # each commit waits for its parent's
                hold.go()
            assert n.wait("local", timeout=HOLD_S) == n.version
            assert m.wait("remote", timeout=HOLD_S) == m.version
            cache.flush()
    finally:
        cache.close()
    with pytest.raises(SkippedError) as info:
        n.wait("remote")
    assert str(info.value) == f"version {n.version} skipped for s3: scripted skip"
    assert [o.wait("local"), p0.wait("remote"), m.wait("local")] == [o.version, p0.version, m.version]
    after_all = [r.getMessage() for r in caplog.records if "after all" in r.getMessage()]
    assert after_all == [f"version {o.version} reached no durable tier; writing it to disk after all "
                         "(skipped there: scripted skip)"]
    assert not [r for r in caplog.records if r.getMessage().startswith("writing version")]
    assert handle.settled_twice() == []
    with tiercache.open({"disk": {"path": str(tmp_path / "disk")}}) as disk:
        assert torch.equal(disk.restore(n.version)["w"], _state(2)["w"])


def test_a_version_sent_to_a_tier_after_all_is_written_there_once(
    tmp_path: Path, s3_config: S3Config, script: type[Scripted], caplog: pytest.LogCaptureFixture
) -> None:
    # X is queued for S3 behind P, taken off S3 by the policy, and its disk write fails: the
    # fallback sends it to S3 after all, on a thread of its own, while the S3 writer's queue still
    # holds it. Only one of them may write it, and its remote level is settled once.
    script.SKIPS[0] = {"disk"}
    script.ORDER[1] = ("s3", "disk")

    def fail_disk() -> None:
        raise TierCacheError("injected: the disk refused X")

    p_on_s3 = Hold("s3", "tiercache-writer-s3")
    x_on_disk = Hold("disk", "tiercache-writer-disk", action=fail_disk)
    x_fallback = Hold("s3", "tiercache-fallback-s3")
    cache = _open(tmp_path, s3_config)
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache"), \
                _holding(p_on_s3, x_on_disk, x_fallback) as claims:
            p = cache.save(_state(0), step=0)
            p_on_s3.wait()
            x = cache.save(_state(1), step=1)
            x_on_disk.wait()
            script.SKIPS[1] = {"s3"}  # coalesced once Y is pending
            y = cache.save(_state(2), step=2)
            x_fallback.wait()  # X reached no durable tier: S3 takes it after all
            p_on_s3.go()  # the S3 writer goes on: P, then X (its queue still holds it), then Y
            # It passes X and takes Y, which it reads back from the disk once the disk has it (Y's
            # disk commit waits for its parent X's outcome, so for the held fallback: its claim
            # comes after).
            y_job = cache.engine.local.jobs.get(y.version)
            assert y_job is not None
            _until(lambda: "s3" in y_job.writing)
            x_fallback.go()
            claims.wait_for("s3", "tiercache-writer-s3", 2)  # its next claim: Y's (X is left out)
            assert x.wait("remote", timeout=HOLD_S) == x.version
            assert y.wait("remote", timeout=HOLD_S) == y.version
            cache.flush()
    finally:
        cache.close()
    with pytest.raises(TierCacheError, match=r"^injected: the disk refused X$"):
        x.wait("local")
    assert [p.wait("remote"), x.wait("durable"), y.wait("local")] == [p.version, x.version, y.version]
    # One write per version on S3: P's and Y's by the S3 writer, X's by the fallback only.
    assert [n for t, n in claims.seen if t == "s3"] == ["tiercache-writer-s3", "tiercache-fallback-s3",
                                                         "tiercache-writer-s3"]
    assert not [r for r in caplog.records if r.getMessage().startswith(f"writing version {x.version} to s3")]
    assert handle.settled_twice() == []
    with tiercache.open({"s3": s3_config.model_dump()}) as remote:
        assert torch.equal(remote.restore(x.version)["w"], _state(1)["w"])
