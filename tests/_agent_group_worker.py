"""Ranks of a multi-rank job whose node runs an agent (tests/test_agent.py): save, die, restart, restore.

Run by ``run_ranks("_agent_group_worker:<name>", ...)``; each scenario writes what its rank observed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _multirank_worker import _levels, _restore, node_state

import tiercache


def scenario_save_and_die(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                          work: Path) -> None:
    """Save two versions over the group, see node RAM take this rank's part, then SIGKILL this trainer."""
    group = dist.group.WORLD
    for step in (1, 2):
        out[f"v{step}"] = _levels(cache.save(node_state(rank, step), step=step, group=group))
    part = cache.catalog.part(cache.catalog.peek(out["v2"]["local"]), rank)
    assert part is not None
    ids = sorted({c.id for c in part.chunks})
    agent = cache.agent
    assert agent is not None
    deadline = time.monotonic() + 30
    while not all(agent.holds([], ids)[1].values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["node_ram_holds_part"] = all(agent.holds([], ids)[1].values())
    out["chunks"] = len(ids)
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing of this process is torn down


def scenario_restore(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """A restarted trainer restores the newest version over the group."""
    _restore(cache, "main", node_state(rank, 2), out, "restored")


SCENARIOS = {"save_and_die": scenario_save_and_die, "restore": scenario_restore}
