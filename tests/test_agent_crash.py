"""Crash consistency with the node agent: SIGKILL the trainer, the agent, or both, at random moments.

The trainers are forked by ``_crash_child.ForkServer`` (a warm interpreter: a child costs
milliseconds) and save ``state_for(step)`` in a loop through a real agent process, acknowledging
(fsynced) ``staged`` once ``save()`` returned and ``local`` once that level was reached. The
guarantees checked after every kill:

* trainer killed: every version whose ``save()`` returned is restorable bit-exact by the next
  process (from node RAM, or from disk once written), ``main`` is never older than the newest
  of them nor a version never saved; once the agent has settled, each of them is on the disk
  tier (the policy is write-through), bit-exact;
* agent killed mid-write: the trainer never sees an error from ``save()``, and every version it
  saved (before and after the agent died) reaches disk bit-exact; the next agent sweeps the arena;
* both killed: every version acknowledged ``local`` is restorable bit-exact, ``main`` is whole;
* a two-rank group killed 0-50 ms after every rank's ``save()`` returned: the restart restores
  exactly that version (adopted from node RAM when the group had not committed it).

Trial counts: 30 + 3 + 3 + 30 per CI run; ``--slow`` (or ``TEST_TIERCACHE_SLOW=1``): 300 + 20 + 20 + 300.
One agent serves fifteen trainer trials (a restart after a crash finds the agent that outlived
it); the agent-killing trials run on one cache, each trial's new agent taking over from the dead
one of the trial before (sweeping its arena).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.agent.client import call
from tiercache.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from _agent import AgentProcess, remove_dir, shm_place, short_dir
from _crash_child import ForkServer, state_for

#: Steps of trial t are t * STRIDE + i: every step (and its state) is unique in a cache.
STRIDE = 10_000
#: Trainer trials one agent (and one cache root) serves.
TRIALS_PER_AGENT = 15


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    srv = ForkServer()
    yield srv
    srv.close()


@pytest.fixture
def places() -> Iterator[tuple[Path, Path]]:
    """A short directory for agent sockets and one in /dev/shm for their arenas."""
    sock = short_dir()
    try:
        with shm_place() as shm:
            yield sock, shm
    finally:
        remove_dir(sock)


@dataclass
class Tally:
    trials: int = 0
    kills: int = 0
    staged: int = 0
    from_ram: int = 0


def _spec(root: Path, sock: Path, shm: Path, t: int, base: Path, **extra: Any) -> dict[str, Any]:
    return {
        "mode": "loop", "root": str(root), "ack": str(base / f"ack{t}"), "log": str(base / "child.log"),
        "first_step": t * STRIDE, "levels": ["staged", "local"],
        "agent": {"socket": str(sock / f"a{root.name}.sock"), "start": "never", "shm_dir": str(shm),
                  "idle_exit": 0},
        **extra,
    }


def _config(spec: dict[str, Any], *, agent: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "ram": {"capacity": "16MiB", "serve_reads": False},
        "disk": {"path": spec["root"]},
        "policy": {"name": "write-through"},
        "pack_below": "4KiB",
    }
    if agent:
        cfg["agent"] = spec["agent"]
    return cfg


def _acks(path: Path) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {"staged": [], "local": []}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a line torn by the kill was never a promise
                out[parts[2]].append((int(parts[0]), parts[1]))
    return out


def _exact(got: dict[str, Any], step: int) -> None:
    want = state_for(step)
    assert got["step"] == step
    for k in ("w", "v", "b"):
        assert torch.equal(got[k], want[k]), f"{k} of step {step} is not bit-exact (a mixed version?)"


def _wait_for_ack(path: Path, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not (path.exists() and path.stat().st_size):
        time.sleep(0.005)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _start_agent(spec: dict[str, Any], base: Path, env: dict[str, str] | None = None) -> AgentProcess:
    return AgentProcess(_config(spec), base / f"agent-{Path(spec['root']).name}.log", env=env)


def test_trainer_killed_at_random_every_saved_version_survives(
    server: ForkServer, tmp_path: Path, places: tuple[Path, Path], slow: bool
) -> None:
    sock, shm = places
    n = 300 if slow else TRIALS_PER_AGENT  # one agent's block by default (the next ones run alike)
    rng = random.Random(33)
    tally = Tally()
    agent: AgentProcess | None = None
    staged_all: list[tuple[int, str]] = []
    for t in range(n):
        spec = _spec(tmp_path / f"r{t // TRIALS_PER_AGENT}", sock, shm, t, tmp_path)
        if t % TRIALS_PER_AGENT == 0:
            if agent is not None:
                _settle_and_check_disk(agent, staged_all)
            agent, staged_all = _start_agent(spec, tmp_path), []
        (pid,) = server.start([spec])
        _wait_for_ack(Path(spec["ack"]))
        time.sleep(rng.uniform(0.0, 0.15))
        _kill(pid)
        (code,) = server.reap()
        log = Path(spec["log"]).read_text() if Path(spec["log"]).exists() else ""
        assert code == -signal.SIGKILL, f"child exited {code}: {log[-2000:]}"
        staged = _acks(Path(spec["ack"]))["staged"]
        assert staged, "the child acknowledged nothing"
        tally.trials += 1
        tally.kills += 1
        tally.staged += len(staged)
        last_try = staged[-1][0] + 1
        with tiercache.open(_config(spec)) as cache:
            vid = cache.resolve("main")
            step = cache.manifest(vid).step
            assert staged[-1][0] <= step <= last_try, f"main is step {step}; acknowledged up to {staged[-1][0]}"
            if step == staged[-1][0]:
                assert vid == staged[-1][1]
            _exact(cache.restore("main"), step)
            tally.from_ram += set(cache.last_restore.nbytes) == {"ram"}  # type: ignore[union-attr]
            for s, v in {staged[-1], rng.choice(staged)}:  # the newest, and one at random
                _exact(cache.restore(v, resume=False), s)
        staged_all += staged
    assert agent is not None
    _settle_and_check_disk(agent, staged_all)
    assert tally.trials == n and tally.staged > n
    print(f"agent: trainer kills {tally}")


def _settle_and_check_disk(agent: AgentProcess, staged: list[tuple[int, str]]) -> None:
    """Once the agent has written everything, every acknowledged version is on disk, whole; then stop it."""
    cfg = load_config(agent.cfg)
    call(cfg, "flush")
    assert agent.stop() == 0
    disk_only = {k: v for k, v in agent.cfg.items() if k != "agent"}
    with tiercache.open(disk_only) as cache:
        on_disk = {v.id for v in cache.versions() if "disk" in v.tiers}
        missing = [(s, v) for s, v in staged if v not in on_disk]
        assert not missing, f"acknowledged versions not on disk: {missing[:5]}"
        for s, v in staged[-3:]:
            _exact(cache.restore(v, resume=False), s)


def test_agent_killed_mid_write_the_trainer_loses_nothing(
    server: ForkServer, tmp_path: Path, places: tuple[Path, Path], slow: bool
) -> None:
    sock, shm = places
    n = 20 if slow else 3
    rng = random.Random(34)
    dead: tuple[Path, int] | None = None
    for t in range(n + 1):
        spec = _spec(tmp_path / "r", sock, shm, t, tmp_path, max_saves=12)
        # Slow fsyncs: the agent always dies with versions half-written or queued.
        agent = _start_agent(spec, tmp_path, env={"TIERCACHE_FAILPOINTS": "disk.after_fsync=sleep:0.02"})
        _check_swept(dead)
        arena = Path(call(load_config(_config(spec)), "stats")["arena"]["path"])
        dead = (arena, arena.stat().st_ino)
        if t == n:
            assert agent.stop() == 0
            break
        (_pid,) = server.start([spec])
        _wait_for_ack(Path(spec["ack"]))
        time.sleep(rng.uniform(0.0, 0.3))
        agent.kill()
        (code,) = server.reap()  # the trainer finishes its saves and closes
        log = Path(spec["log"]).read_text() if Path(spec["log"]).exists() else ""
        assert code == 0, f"trainer exited {code} after its agent died: {log[-2000:]}"
        acks = _acks(Path(spec["ack"]))
        assert len(acks["staged"]) == 12 and len(acks["local"]) == 12
        with tiercache.open(_config(spec, agent=False)) as cache:
            for s, v in acks["staged"]:
                _exact(cache.restore(v, resume=False), s)
            assert cache.resolve("main") == acks["staged"][-1][1]


def _check_swept(dead: tuple[Path, int] | None) -> None:
    """The arena of the agent killed before is gone (the one at its name now is the new agent's)."""
    if dead is not None:
        arena, inode = dead
        assert not arena.exists() or arena.stat().st_ino != inode, "the dead agent's arena was not swept"


def test_trainer_and_agent_killed_together(
    server: ForkServer, tmp_path: Path, places: tuple[Path, Path], slow: bool
) -> None:
    sock, shm = places
    n = 20 if slow else 3
    rng = random.Random(35)
    dead: tuple[Path, int] | None = None
    newest = -1
    for t in range(n + 1):
        spec = _spec(tmp_path / "r", sock, shm, t, tmp_path)
        agent = _start_agent(spec, tmp_path)
        _check_swept(dead)
        # The new agent serves the cache the dead pair left: whole versions only, none older.
        with tiercache.open(_config(spec)) as cache:
            if newest >= 0:
                got = cache.restore("main")
                assert got["step"] >= newest
                _exact(got, got["step"])
        arena = Path(call(load_config(_config(spec)), "stats")["arena"]["path"])
        dead = (arena, arena.stat().st_ino)
        if t == n:
            assert agent.stop() == 0
            break
        (pid,) = server.start([spec])
        _wait_for_ack(Path(spec["ack"]))
        time.sleep(rng.uniform(0.0, 0.3))
        _kill(pid)
        agent.kill()
        (code,) = server.reap()
        assert code == -signal.SIGKILL
        acks = _acks(Path(spec["ack"]))
        with tiercache.open(_config(spec, agent=False)) as cache:
            for s, v in acks["local"]:
                _exact(cache.restore(v, resume=False), s)
            if acks["local"]:
                newest = acks["local"][-1][0]
                got = cache.restore("main")
                assert got["step"] >= newest
                _exact(got, got["step"])



#: Trials of the group kill test per CI run and with ``--slow``, and the MiB of state per rank.
GROUP_TRIALS, GROUP_TRIALS_SLOW, GROUP_MIB = 15, 300, 20


def _group_run(cfg: dict[str, Any], work: Path, opts: dict[str, Any], saved: str | None) -> list[dict[str, Any]]:
    """One run of the two-rank job (see the test below); checks its restore, returns what each rank saw."""
    from test_multirank import rank_out, run_ranks

    codes = run_ranks("_agent_group_worker:kill_after_save", 2, work, cfg, opts=opts)
    # A rank that failed (its restore raised: the traceback is in the output) wrote nothing.
    assert codes == ([-signal.SIGKILL] * 2 if "step" in opts else [0, 0]), (work.name, codes)
    outs = [rank_out(work, r) for r in range(2)]
    if opts["expect"]:
        for r, out in enumerate(outs):
            assert (out["restored_step"], out["head"]) == (opts["expect"], saved), (work.name, r, out)
            assert out["restored_equal"], f"{work.name}: rank {r} restored other bytes than step {opts['expect']}"
    return outs


def test_a_group_killed_right_after_save_returned_restores_exactly_that_version(
    tmp_path: Path, places: tuple[Path, Path], slow: bool
) -> None:
    """Two ranks through one node agent, 20 MiB each, SIGKILLed 0-50 ms after every rank's ``save()`` returned.

    Each trial is one run of the job: it restores the branch, which must be exactly the version
    the run before saved (bit-exact, its step: adopted from node RAM if the group had not
    committed it when its trainers died), then saves the next step and dies. A trial costs one
    fork of two warm ranks. One agent (and one disk) serves fifteen trials, then a run that only
    restores checks the last one, and the disk is dropped: 300 trials never hold more than
    fifteen versions. Trials: 15 per CI run (one agent), 300 with ``--slow``.
    """
    from _agent import agent_config

    sock, shm = places
    rng = random.Random(4141)
    n = GROUP_TRIALS_SLOW if slow else GROUP_TRIALS
    adopted = 0
    for block in range(0, n, TRIALS_PER_AGENT):
        root = tmp_path / f"r{block}"
        cfg = agent_config(root, sock, capacity="256MiB", shm_dir=str(shm))
        agent = AgentProcess(cfg, tmp_path / f"agent{block}.log")
        try:
            saved: str | None = None
            for t in range(block, min(n, block + TRIALS_PER_AGENT)):
                opts = {"branch": "main", "mib": GROUP_MIB, "expect": t - block, "step": t - block + 1,
                        "delay": rng.uniform(0.0, 0.05), "broken": True}
                outs = _group_run(cfg, tmp_path / f"t{t}", opts, saved)
                saved = outs[0]["saved"]
                assert outs[1]["saved"] == saved, outs
            last = {"branch": "main", "mib": GROUP_MIB, "expect": min(n, block + TRIALS_PER_AGENT) - block}
            _group_run(cfg, tmp_path / f"t{block}-last", last, saved)
            # Every part the trainers left was adopted, or settled (its group committed it as a
            # trainer died): none is kept, none let go that a restart could have adopted.
            stats = call(load_config(cfg), "stats")
            assert (stats["parts"]["orphaned"], stats["parts_released"]) == (0, 0), stats
            adopted += stats["levels"].get("durable:failed", 0) // 2  # both parts of each version not committed
        except BaseException:
            agent.kill()  # leave no agent behind
            raise
        assert agent.stop() == 0
        shutil.rmtree(root)
    print(f"group kills right after save(): {n} trials, {adopted} adopted from node RAM by the restart")
    if slow:
        assert adopted > 0  # over 300 trials some kill came before the group's commit
