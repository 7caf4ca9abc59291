"""Ranks of a multi-rank job whose node runs an agent (tests/test_agent.py): save, die, restart, restore.

Run by ``run_ranks("_agent_group_worker:<name>", ...)``; each scenario writes what its rank observed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _multirank_worker import _error, _levels, _record_chunk_puts, _restore, _restored_equal, node_state

import tiercache
from tiercache import failpoints
from tiercache.cache import core_of


def scenario_save_and_die(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                          work: Path) -> None:
    """Save two versions over the group, see node RAM take this rank's part, then SIGKILL this trainer."""
    group = dist.group.WORLD
    for step in (1, 2):
        out[f"v{step}"] = _levels(cache.save(node_state(rank, step), step=step, group=group))
    part = core_of(cache).catalog.part(core_of(cache).catalog.peek(out["v2"]["local"]), rank)
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


def _through_agent(cache: tiercache.TierCache) -> bool:
    """Whether this trainer saved only through its node's agent (it never made an engine of its own)."""
    engine = cache.engine
    return type(engine.backend).__name__ == "AgentBackend" and engine.local is None  # type: ignore[attr-defined]


def scenario_through_agents(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                            work: Path) -> None:
    """Save two versions over the group, each rank's part through its node's agent; restore both."""
    group = dist.group.WORLD
    puts: list[str] = []
    _record_chunk_puts(cache, puts)  # chunk writes this trainer makes itself (none: the agent makes them)
    handles = [cache.save(node_state(rank, s), step=s, group=group, replicated=["emb"]) for s in (1, 2)]
    out["levels"] = [_levels(h) for h in handles]
    cache.flush()
    rounds = [cache.distributed().round(h.version) for h in handles]  # type: ignore[attr-defined]
    # Chunks of "emb" (the same on every rank) this rank's agent hashed itself, per version.
    out["declared_writers"] = [sorted(set(r.declared_writers().values())) if r is not None else None for r in rounds]
    out["through_agent"] = _through_agent(cache)
    own = set()
    for h in handles:
        part = core_of(cache).catalog.part(core_of(cache).catalog.peek(h.version), rank)
        assert part is not None
        own |= {c.id for c in part.chunks}
    # What this trainer wrote itself: nothing (the agents hash, write and copy to peers).
    out["trainer_puts_s3"] = sum(p.startswith("s3:") for p in puts)
    out["trainer_puts_own"] = sum(p.rsplit("/", 1)[-1] in own for p in puts)
    out["trainer_puts_disk"] = sum(p.startswith("disk:") for p in puts)
    _restore(cache, "main", node_state(rank, 2), out, "restored")
    _restore(cache, handles[0].version, node_state(rank, 1), out, "v1")
    agent = cache.agent
    assert agent is not None
    stats = agent.request("stats")
    out["agent_levels"] = stats["levels"]
    out["agent_peer_bytes"] = stats["peer_bytes"]
    out["agent_lag"] = stats["lag"]
    out["agent_tracked"] = stats["tracked"]


def scenario_peer_copies(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                         work: Path) -> None:
    """Save two versions over the group with peer copies; the second after whatever befell the first's."""
    out["levels"], out["agent_lost"] = [], []
    for step in (1, 2):
        out["levels"].append(_levels(cache.save(node_state(rank, step), step=step, group=dist.group.WORLD)))
        out["agent_lost"].append(cache.agent is None)


def scenario_dies_at_write(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                           work: Path) -> None:
    """The last rank's trainer dies once its part is written, before the group commits it."""
    if rank == world - 1:
        failpoints.configure("group.write=kill@1")
    handle = cache.save(node_state(rank, 1), step=1, group=dist.group.WORLD)
    out["v"] = handle.version
    out["levels"] = _levels(handle)


def scenario_agent_dies(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                        work: Path) -> None:
    """The node's agent dies while it writes the parts (a failpoint in it): the ranks finish them, then save on."""
    group = dist.group.WORLD
    h1 = cache.save(node_state(rank, 1), step=1, group=group)
    out["v1"] = _levels(h1)
    h2 = cache.save(node_state(rank, 2), step=2, group=group)
    out["v2"] = _levels(h2)
    out["agent_lost"] = cache.agent is None
    out["through_agent"] = _through_agent(cache)
    _restore(cache, "main", node_state(rank, 2), out, "restored")
    _restore(cache, h1.version, node_state(rank, 1), out, "v1")
    out["head_error"] = _error(lambda: cache.resolve("main"))


def scenario_orphan(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Version 1 is committed; version 2 is in node RAM on every rank when every trainer dies, uncommitted."""
    group = dist.group.WORLD
    out["v1"] = cache.save(node_state(rank, 1), step=1, group=group).wait("durable")
    # The group's commit of what comes next never comes (with "group.parts", the agent does not
    # even learn which chunks to write: the part is in node RAM only).
    failpoints.configure(json.loads((work / "run.json").read_text()).get("stall", "group.write") + "=sleep:60")
    h2 = cache.save(node_state(rank, 2), step=2, group=group, meta={"loss": 0.5})
    out["v2"] = h2.version
    published = cache.engine.published(h2.version)
    assert published is not None
    out["v2_part_chunks"] = len(published.result(60).chunks)  # the agent hashed this rank's part
    out["v2_committed"] = h2.done("durable")
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies, as when one of its ranks does


def scenario_adopt(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """The restarted job restores its branch: the group first commits what the dead trainers left in node RAM."""
    step = json.loads((work / "run.json").read_text()).get("step", 2)  # the step of the version left there
    _restore(cache, "main", node_state(rank, step), out, "restored")
    out["head"] = cache.resolve("main")
    _restore(cache, "main", node_state(rank, step), out, "again")  # adopted once: nothing is left to adopt
    out["head_again"] = cache.resolve("main")


def scenario_adopt_fails_once(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                              work: Path) -> None:
    """The last rank cannot read its part back the first time: nobody adopts; the next restore does."""
    if rank == world - 1:
        failpoints.configure("group.adopt=raise@1")
    _restore(cache, "main", node_state(rank, 1), out, "first")
    out["first_head"] = cache.resolve("main")
    _restore(cache, "main", node_state(rank, 2), out, "second")
    out["second_head"] = cache.resolve("main")


def scenario_adopt_fault(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                          work: Path) -> None:
    """The last rank dies or stalls past the group's timeout while it reads its part back."""
    fault = json.loads((work / "run.json").read_text())["fault"]
    if rank == world - 1:
        failpoints.configure(f"group.adopt={fault}@1")
    out["error"] = _error(lambda: _restore(cache, "main", node_state(rank, 1), out, "restored"))
    out["head"] = cache.resolve("main")


def scenario_restart_smaller(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                             work: Path) -> None:
    """A restart with fewer ranks than saved: nothing is adopted (some ranks' parts are no version)."""
    out["restore_error"] = _error(lambda: cache.restore("main", group=dist.group.WORLD))
    out["head"] = cache.resolve("main")


def scenario_chaos(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Save steps on a branch, noting each ack, until the whole job is SIGKILLed at a random moment."""
    opts = json.loads((work / "run.json").read_text())
    branch, steps, kill_after, delay = opts["branch"], opts["steps"], opts["kill_after"], opts["delay"]
    lock = threading.Lock()
    acks = (work / f"acks{rank}.txt").open("a")
    # The whole job dies at once, as when its launcher tears it down: the rank whose timer fires
    # kills every rank, its peers first. (A rank that killed only itself left its peer to fail its
    # save() on the broken group and exit on its own before its own timer fired.)
    (work / f"pid{rank}").write_text(str(os.getpid()))
    dist.barrier()
    pids = [int((work / f"pid{r}").read_text()) for r in range(world)]

    def kill_job() -> None:
        for pid in sorted(pids, key=lambda p: p == os.getpid()):
            with contextlib.suppress(ProcessLookupError):  # a peer's own timer was first
                os.kill(pid, signal.SIGKILL)

    def note(word: str, step: int, vid: str) -> None:
        with lock:
            acks.write(f"{word} {step} {vid}\n")
            acks.flush()

    def on_local(f: Any, step: int, vid: str) -> None:
        if f.exception() is None:
            note("local", step, vid)

    for step in range(1, steps + 1):
        handle = cache.save(node_state(rank, step), step=step, branch=branch, group=dist.group.WORLD)
        note("saved", step, handle.version)
        handle.future("local").add_done_callback(lambda f, s=step, v=handle.version: on_local(f, s, v))
        if step == kill_after:
            threading.Timer(delay, kill_job).start()
    time.sleep(60)  # the timer kills this trainer before


def scenario_chaos_restore(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                           work: Path) -> None:
    """The restarted job restores the branch: which step, and whether it is bit-exact."""
    branch = json.loads((work / "run.json").read_text())["branch"]
    try:
        got = cache.restore(branch, group=dist.group.WORLD)
    except tiercache.VersionNotFoundError as e:  # nothing of the branch survived (none was acknowledged local)
        out["step"], out["vid"], out["equal"], out["error"] = 0, None, True, str(e)
        return
    out["step"] = got["step"]
    out["vid"] = cache.resolve(branch)
    want = node_state(rank, got["step"])
    out["equal"] = _restored_equal(got, want)
    if not out["equal"]:  # which entries differ, and which step's (if any) each one holds
        out["differ"] = {k: [s for s in range(1, 9) if _restored_equal(got.get(k), node_state(rank, s)[k])]
                         for k in want if not _restored_equal(got.get(k), want[k])}


def scenario_one_rank_short(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                            work: Path) -> None:
    """Step 1 is committed; the last rank dies before its save() of step 2, the others' saves of it return."""
    group = dist.group.WORLD
    out["v1"] = cache.save(node_state(rank, 1), step=1, group=group).wait("durable")
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    if rank == world - 1:  # once the group agreed on step 2, before its copy: its part never reaches the agent
        failpoints.configure("group.stage=kill@1")
    handle = cache.save(node_state(rank, 2), step=2, group=group)
    out["v2"] = handle.version
    published = cache.engine.published(handle.version)
    assert published is not None
    out["v2_part_chunks"] = len(published.result(60).chunks)  # the agent hashed this rank's part
    out["v2_levels"] = _levels(handle)


def scenario_adopt_warns(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                         work: Path) -> None:
    """The restarted job restores its branch, noting what the adoption warned about."""
    import logging

    seen: list[str] = []

    class Note(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    note = Note()
    logging.getLogger("tiercache.group").addHandler(note)
    try:
        _restore(cache, "main", node_state(rank, 1), out, "restored")
        out["head"] = cache.resolve("main")
        _restore(cache, "main", node_state(rank, 1), out, "again")  # nothing is left to warn about
    finally:
        logging.getLogger("tiercache.group").removeHandler(note)
    out["warnings"] = seen


def big_state(rank: int, step: int, mib: int) -> dict[str, Any]:
    """A state of ``mib`` MiB on every rank, unique to the rank and the step (its bytes rebuilt from both)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    return {"big": torch.randn(mib * (1 << 18), generator=g),
            "rng": torch.full((4,), rank * 1000 + step, dtype=torch.int64), "step": step}


def scenario_kill_after_save(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any],
                             work: Path) -> None:
    """Restore the branch (the version the trial before died after saving), save one, die right after.

    ``run.json``: ``branch``, ``mib``, ``expect`` (the step the restore must find; 0: restore
    nothing), ``step`` (the step to save; absent: only restore), ``delay`` (seconds between
    every rank's ``save()`` having returned and this trainer's SIGKILL).
    """
    opts = json.loads((work / "run.json").read_text())
    branch, mib = opts["branch"], opts["mib"]
    state = big_state(rank, opts["step"], mib) if opts.get("step") else None
    if opts.get("expect"):
        got = cache.restore(branch, group=dist.group.WORLD)
        out["restored_step"] = got["step"]
        out["restored_equal"] = _restored_equal(got, big_state(rank, opts["expect"], mib))
        out["head"] = cache.resolve(branch)
        del got
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    if state is None:
        return
    handle = cache.save(state, step=opts["step"], branch=branch, group=dist.group.WORLD)
    out["saved"] = handle.version
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()  # every rank's save() returned
    time.sleep(opts["delay"])
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_save_four(cache: tiercache.TierCache, rank: int, world: int, out: dict[str, Any], work: Path) -> None:
    """Save steps 1 to 4 over the group, each rank's part through the node's agent, and wait for all of them."""
    handles = [cache.save(node_state(rank, s), step=s, group=dist.group.WORLD) for s in (1, 2, 3, 4)]
    cache.flush()
    out["versions"] = [h.version for h in handles]
    out["levels"] = [_levels(h) for h in handles]


SCENARIOS = {"save_and_die": scenario_save_and_die, "restore": scenario_restore,
             "through_agents": scenario_through_agents, "dies_at_write": scenario_dies_at_write,
             "agent_dies": scenario_agent_dies, "orphan": scenario_orphan, "adopt": scenario_adopt,
             "chaos": scenario_chaos, "chaos_restore": scenario_chaos_restore,
             "restart_smaller": scenario_restart_smaller, "adopt_fails_once": scenario_adopt_fails_once,
             "adopt_fault": scenario_adopt_fault, "peer_copies": scenario_peer_copies,
             "kill_after_save": scenario_kill_after_save, "one_rank_short": scenario_one_rank_short,
             "adopt_warns": scenario_adopt_warns, "save_four": scenario_save_four}
