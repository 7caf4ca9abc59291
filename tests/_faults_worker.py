"""Ranks of the targeted group fault tests (tests/test_group_faults.py): one fault each, as users hit them.

Run by ``run_ranks("_faults_worker:<name>", ...)``; each scenario writes what its rank observed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _chaos_worker import equal, state

import tiercache
from tiercache import failpoints


def _error(fn: Any) -> list[str] | None:
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None


def _levels(h: tiercache.SaveHandle) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lvl in ("local", "durable"):
        try:
            out[lvl] = h.wait(lvl, timeout=60)  # type: ignore[arg-type]
        except Exception as e:
            out[lvl] = [type(e).__name__, str(e)]
    return out


def scenario_arena_skip(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Rank 1's arena is full when version 2 is saved (its disk is held) and its policy skips it.

    Every rank declares the model replicated, so the ranks trade chunk ids; the skipped version
    must fail on every rank, and the next one hold exactly its own bytes.
    """
    group = dist.group.WORLD
    hold, held = threading.Event(), threading.Event()

    def holding(tier: str, ids: object) -> None:
        if tier == "disk" and not held.is_set():
            held.set()
            hold.wait(60)

    with failpoints.hooked("repo.after_claim", holding if rank == 1 else lambda *_: None):
        h1 = cache.save(state(rank, 1), step=1, group=group, replicated=("model",))
        if rank == 1:
            held.wait(60)  # version 1 is staged and its disk write is held: the arena stays full
        h2 = cache.save(state(rank, 2), step=2, group=group, replicated=("model",))
        out["v2"] = _levels(h2)
        hold.set()
        out["v1"] = _levels(h1)
    h3 = cache.save(state(rank, 3), step=3, group=group, replicated=("model",))
    out["v3"] = _levels(h3)
    out["ids"] = [h1.version, h2.version, h3.version]
    out["v3_equal"] = equal(cache.restore(h3.version, group=group, resume=False), state(rank, 3))
    out["v1_equal"] = equal(cache.restore(h1.version, group=group, resume=False), state(rank, 1))


def scenario_bad_input(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Bad calls of save() on rank 1 only, with the default 10-minute group timeout."""
    group = dist.group.WORLD
    calls = {
        "meta": lambda: cache.save(state(rank, 1), step=1, group=group,
                                   meta={"loss": torch.ones(1)} if rank == 1 else {"loss": 1.0}),
        "step": lambda: cache.save(state(rank, 2), step=2 if rank != 1 else 3, group=group),
        "leaf": lambda: cache.save({**state(rank, 4), "lock": threading.Lock()} if rank == 1 else state(rank, 4),
                                   step=4, group=group),
        "arena": lambda: cache.save({**state(rank, 5), "big": torch.zeros(5 << 20)} if rank == 1 else state(rank, 5),
                                    step=5, group=group),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            h = call()
            out[name] = {"returned": _levels(h)}
        except Exception as e:
            out[name] = {"raised": [type(e).__name__, str(e)]}
        out[name]["seconds"] = time.monotonic() - t0
    h = cache.save(state(rank, 6), step=6, group=group)  # the group goes on
    out["after"] = _levels(h)
    out["after_equal"] = equal(cache.restore("main", group=group), state(rank, 6))


def scenario_config_differs(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                            work: Path) -> None:
    """The view was made by run(): record how it failed (see test_group_faults)."""
    out["made"] = True


def scenario_raise_after_save(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                              work: Path) -> None:
    """Rank 1's training code raises right after save() returns; its process exits with the error."""
    group = dist.group.WORLD
    h = cache.save(state(rank, 1), step=1, group=group)
    if rank == 1:
        (work / f"rank{rank}.json").write_text('{"raised": true}')
        raise RuntimeError("the training step after save() failed")
    out["v1"] = _levels(h)
    t0 = time.monotonic()
    out["next"] = _error(lambda: cache.save(state(rank, 2), step=2, group=group))
    out["next_seconds"] = time.monotonic() - t0


def scenario_out_of_step(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """A training loop that saves steps 1 to 4, but rank 1 skips its save of step 2.

    With ``run.json`` ``"collective": true`` each step ends with a collective of the trainer's
    own (a DDP gradient all-reduce): rank 1 waits there while the others wait for it in save().
    """
    group = dist.group.WORLD
    collective = json.loads((work / "run.json").read_text()).get("collective")
    out["calls"] = {}
    for step in (1, 2, 3, 4):
        if collective and step > 1:
            dist.barrier()
        if rank == 1 and step == 2:
            continue
        t0 = time.monotonic()
        try:
            h = cache.save(state(rank, step), step=step, group=group)
            out["calls"][step] = {"vid": h.version, "levels": _levels(h)}
        except Exception as e:
            out["calls"][step] = {"raised": [type(e).__name__, str(e)]}
        out["calls"][step]["seconds"] = time.monotonic() - t0
    v4 = out["calls"][4]["vid"]
    out["parent4"] = cache.manifest(v4).parent
    out["head"] = cache.resolve("main")
    out["v4_equal"] = equal(cache.restore("main", group=group, resume=False), state(rank, 4))


def scenario_small_disk(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Node b's disk holds far less than one version (its capacity); no S3.

    On rank 1, each version's pipeline ends (its only tier full) before the group asks for its part.
    """
    group = dist.group.WORLD

    def until_over(tag: str) -> None:
        vid = tag.split("/")[0]
        end = time.monotonic() + 20
        while rank == 1 and vid in cache.engine.pending_jobs() and time.monotonic() < end:
            time.sleep(0.01)

    with failpoints.hooked("group.staged", until_over):
        hs = [cache.save({**state(rank, s), "big": torch.full((256, 1024), float(rank + s))}, step=s, group=group)
              for s in (1, 2, 3)]
    out["versions"] = [h.version for h in hs]
    out["levels"] = [_levels(h) for h in hs]
    out["flush"] = _error(cache.flush)
    out["lost"] = cache.stats()["errors"]["lost_versions"]


SCENARIOS = {"arena_skip": scenario_arena_skip, "bad_input": scenario_bad_input,
             "config_differs": scenario_config_differs, "raise_after_save": scenario_raise_after_save,
             "out_of_step": scenario_out_of_step, "small_disk": scenario_small_disk}
