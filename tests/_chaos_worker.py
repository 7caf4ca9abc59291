"""One rank of the group chaos test (tests/test_group_chaos.py): many versions, each maybe with a fault.

Every rank reads the same plan (``plan.json``: trials, each a save or a restore, maybe with a
fault for one rank at one phase) and runs the trials in order, as a training loop would. The
faulty rank arms the phase's failpoint (:mod:`tiercache.failpoints`) for that trial only: it
raises, makes the version skipped, sleeps past the group's timeout, or SIGKILLs the rank; a bad
input is a bad call of ``save()`` itself. Each rank writes what it observed after every trial
(``rank<R>.json``), so the test can compare the ranks' outcomes and check every version some
rank reported durable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import _multirank_worker
import torch
import torch.distributed as dist

import tiercache
from tiercache import failpoints
from tiercache.errors import SkippedError

#: The group's levels a trial reports (``staged`` is each rank's own).
LEVELS = ("local", "replicated", "remote", "durable")


def state(rank: int, step: int) -> dict[str, Any]:
    """The state rank ``rank`` saves at ``step``: a replicated model, a shard of its own, plain leaves."""
    shared = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(10_000 * step + rank)
    return {"model": {"w": torch.randn(96, 96, generator=shared), "b": torch.randn(96, generator=shared)},
            "shard": torch.randn(48, 128, generator=own), "rng": torch.full((3,), rank * 1000 + step), "step": step}


def equal(got: Any, want: Any) -> bool:
    """Bit-exact equality of two states."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and bool(torch.equal(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(equal(got[k], want[k]) for k in want)
    return bool(got == want)


def _error(e: BaseException) -> list[str]:
    return [type(e).__name__, str(e)]


@contextlib.contextmanager
def armed(fault: dict[str, Any] | None, delay: float) -> Iterator[list[bool]]:
    """Arm this rank's fault of a trial (if any); yields ``[fired]``."""
    fired = [False]
    if fault is None or fault["kind"] in ("bad", "replica", "dcp", "s3hang"):  # faults of a call, not of a phase
        yield fired
        return
    where, kind, tier = fault["phase"], fault["kind"], fault.get("tier")

    def hook(tag: str, *_: object) -> None:
        if fired[0] or (tier is not None and not tag.endswith(f"/{tier}")):
            return
        fired[0] = True
        what = f"injected {kind} at {where} on rank {fault['rank']}"
        if kind == "raise":
            raise RuntimeError(what)
        if kind == "skip":
            raise SkippedError(what)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(delay)

    with failpoints.hooked(where, hook):
        yield fired


def _bad_call(variant: str, st: dict[str, Any], kw: dict[str, Any]) -> None:
    """Make this rank's call of ``save()`` bad in one way (each is refused on every rank)."""
    if variant == "meta":
        kw["meta"] = {"loss": object()}
    elif variant == "step":
        kw["step"] += 1000
    elif variant == "branch":
        kw["branch"] = "no/slash"
    elif variant == "leaf":
        st["handle"] = object()
    elif variant == "optimizer":
        kw["optimizer"] = object()


def _outcome(handle: tiercache.SaveHandle, level: str, bound: float) -> Any:
    try:
        return handle.future(level).result(timeout=bound)  # type: ignore[arg-type]
    except FutureTimeout:
        return ["HANG", f"{level} not settled after {bound:g}s"]
    except Exception as e:
        return _error(e)


def scenario_chaos(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    plan = json.loads((work / "plan.json").read_text())
    timeout = plan["timeout"]
    bound = 2 * timeout + 20  # far more than a phase's timeout: beyond it, something hangs
    group = dist.group.WORLD
    results: list[dict[str, Any]] = []
    head = 0  # the step of the newest version the group made durable
    durable: list[list[Any]] = []
    for i, trial in enumerate(plan["trials"]):
        # The training step between two saves: its collective lines the ranks up again, whatever a
        # fault of the last trial delayed (without it, a rank still stalled would time the next
        # save out too).
        if i and not plan.get("kills"):
            dist.barrier()
        fault = trial.get("fault")
        mine = fault if fault is not None and fault["rank"] == rank else None
        res: dict[str, Any] = {"i": i}
        t0 = time.monotonic()
        # Past the timeout, and past the margin the others give a coordinator that is late.
        with armed(mine, timeout + 2.5) as fired:
            if trial["kind"] == "save":
                step = trial["step"]
                st = state(rank, step)
                kw: dict[str, Any] = {"step": step, "meta": {"trial": i}, "group": group,
                                      "replicated": ("model",) if trial["replicated"] else ()}
                if mine is not None and mine["kind"] == "bad":
                    _bad_call(mine["variant"], st, kw)
                    fired[0] = True
                if mine is not None and mine["kind"] == "replica":
                    st["model"]["w"] += 1
                    fired[0] = True
                hang = mine is not None and mine["kind"] == "s3hang"
                relay = _multirank_worker.S3_RELAY if hang else None
                try:
                    if relay is not None:
                        relay.mode = "hang"
                        fired[0] = True
                    h = cache.save(st, **kw)
                    res["vid"] = h.version
                    if relay is not None:  # the disk's level must not wait for S3
                        res["local_in_hang"] = _outcome(h, "local", timeout + 5)
                        relay.mode = "up"
                    res["levels"] = {lvl: _outcome(h, lvl, bound) for lvl in LEVELS}
                    if res["levels"]["durable"] == h.version:
                        head = step
                        durable.append([h.version, step])
                except Exception as e:
                    res["raised"] = _error(e)
                finally:
                    if relay is not None:
                        relay.mode = "up"
            elif trial["kind"] == "dcp":
                fired[0] = mine is not None
                _dcp_save(cache, rank, world, trial["step"], mine, res)
            else:
                try:
                    got = cache.restore("main", group=group, resume=False)
                    res["restored"] = [got["step"], equal(got, state(rank, got["step"])), head]
                except Exception as e:
                    res["raised"] = _error(e)
        res["fired"], res["seconds"] = fired[0], round(time.monotonic() - t0, 3)
        results.append(res)
        out["results"] = results
        (work / f"rank{rank}.json").write_text(json.dumps(out))  # kept if this rank dies later
    # Every version this rank saw durable restores bit-exact on every rank (unless a rank died).
    out["restores"] = []
    if not plan.get("kills"):
        for vid, step in durable:
            try:
                got = cache.restore(vid, group=group, resume=False)
                out["restores"].append([vid, equal(got, state(rank, step))])
            except Exception as e:
                out["restores"].append([vid, _error(e)])
    else:  # the group is broken: the next save fails at once, naming the dead rank
        t0 = time.monotonic()
        try:
            cache.save(state(rank, 10_000), step=10_000, group=group)
            out["after"] = None
        except Exception as e:
            out["after"] = _error(e)
        out["after_seconds"] = round(time.monotonic() - t0, 3)


def _dcp_save(cache: tiercache.TierCache, rank: int, world: int, step: int, fault: dict[str, Any] | None,
              res: dict[str, Any]) -> None:
    """A dcp.save of this rank's state; with ``fault``, this rank aborts it (see test_group_chaos)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException

    from tiercache.integrations.dcp import TierCacheStorageWriter

    variant = fault["variant"] if fault is not None else None

    class Planner(DefaultSavePlanner):
        def finish_plan(self, new_plan: Any) -> Any:
            if variant == "plan":
                raise RuntimeError(f"injected: rank {rank}'s DCP plan is refused")
            return super().finish_plan(new_plan)

        def resolve_data(self, write_item: Any) -> Any:
            if variant == "write":
                raise RuntimeError(f"injected: rank {rank}'s DCP write fails")
            return super().resolve_data(write_item)

    st = state(rank, step)
    writer = TierCacheStorageWriter(cache, step=step)
    try:  # every rank writes an item of its own, so the faulty rank has one to fail
        dcp.save({"model": st["model"], f"shard{rank}": st["shard"]}, storage_writer=writer, planner=Planner())
        res["dcp_failures"] = []
    except CheckpointException as e:
        res["dcp_failures"] = sorted(e.failures)
    res["vid"] = writer.version_id
    handle = writer.handle
    res["levels"] = None if handle is None else {lvl: _outcome(handle, lvl, 60) for lvl in LEVELS}


def scenario_s3hang(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Rank 1's S3 hangs from before the group's first save: every level read while it still hangs, then a restore."""
    group = dist.group.WORLD
    bound = 2 * json.loads((work / "plan.json").read_text())["timeout"] + 20
    relay = _multirank_worker.S3_RELAY
    if rank == 1:
        relay.mode = "hang"
    dist.barrier()
    try:
        h = cache.save(state(rank, 1), step=1, group=group)
        out["vid"] = h.version
        out["levels"] = {lvl: _outcome(h, lvl, bound) for lvl in LEVELS}
    except Exception as e:
        out["raised"] = _error(e)
    if rank == 1:
        out["hanging"] = relay.mode == "hang"  # still, once it read every level (the others wait for it)
    dist.barrier()
    relay.mode = "up"
    if "vid" in out:
        out["restored"] = equal(cache.restore(out["vid"], group=group, resume=False), state(rank, 1))


SCENARIOS = {"chaos": scenario_chaos, "s3hang": scenario_s3hang}
