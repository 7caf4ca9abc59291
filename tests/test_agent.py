"""The node agent end to end: real agent processes, real trainers, real SIGKILL, real /dev/shm.

Each test runs an agent as an operator would (``python -m tiercache agent``, see ``_agent.py``),
or lets a trainer start one (``start = "auto"``); trainers are separate processes
(``_agent_trainer.py``) that print what ``save()`` acknowledged, or this process itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache import failpoints
from tiercache.agent import naming
from tiercache.agent.client import call
from tiercache.cli import app, short_id_length
from tiercache.config import load_config
from tiercache.errors import AgentUnavailableError, ConfigError, StorageError
from tiercache.manifest import Version
from tiercache.runtime import AgentStats, CacheStats
from tiercache.ui import views

sys.path.insert(0, str(Path(__file__).parent))
from _agent import ROOT, AgentProcess, agent_config, listening, remove_dir, shm_place, short_dir, without_agent
from _crash_child import state_for

TRAINER = Path(__file__).with_name("_agent_trainer.py")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = short_dir()
    try:
        yield d
    finally:
        remove_dir(d)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with shm_place() as d:
        yield d


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Any]:
    """Starts agents (``agents(cfg, env=...)``); each one still running at the end must stop cleanly.

    ``agents.sock_dir()`` makes a short directory for an agent's socket, removed once every agent stopped.
    """
    started: list[AgentProcess] = []
    dirs: list[Path] = []

    def start(cfg: dict[str, Any], env: dict[str, str] | None = None) -> AgentProcess:
        agent = AgentProcess(cfg, tmp_path / f"agent{len(started)}.log", env=env)
        started.append(agent)
        return agent

    def sock_dir() -> Path:
        dirs.append(short_dir())
        return dirs[-1]

    start.sock_dir = sock_dir  # type: ignore[attr-defined]
    yield start
    try:
        for agent in started:
            if agent.proc.poll() is None:
                assert agent.stop() == 0
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _trainer(spec: dict[str, Any], timeout: float = 120.0) -> tuple[int, list[tuple[str, int, str]]]:
    """Run a trainer process to its end; return its exit code and the lines it acknowledged."""
    proc = subprocess.run([sys.executable, str(TRAINER), json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    acks = []
    for line in proc.stdout.splitlines():
        word, step, vid = line.split()
        acks.append((word, int(step), vid))
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode, acks


def _assert_state(got: dict[str, Any], step: int) -> None:
    want = state_for(step)
    assert got["step"] == step
    for k in ("w", "v", "b"):
        assert torch.equal(got[k], want[k]), f"{k} of step {step} is not bit-exact"


def _wait_for(predicate: Any, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ------------------------------------------------------------------------ a trainer crash


def test_a_killed_trainers_versions_restore_from_node_ram_and_reach_disk(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    # Slow fsyncs keep the versions in node RAM only when the trainer dies.
    agents(cfg, env={"TIERCACHE_FAILPOINTS": "disk.after_fsync=sleep:0.3"})
    code, acks = _trainer({"config": cfg, "steps": [1, 2, 3], "end": "kill"})
    assert code == -signal.SIGKILL
    staged = {step: vid for word, step, vid in acks if word == "staged"}
    assert sorted(staged) == [1, 2, 3]
    # A CLI process sees node RAM too: `tiercache ls` gives it a column.
    out = CliRunner().invoke(app, ["--config", str(_write(tmp_path, cfg)), "ls", "--json"])
    assert out.exit_code == 0, out.output
    listed = {v["id"]: v["tiers"] for v in json.loads(out.output)}
    assert listed.keys() == set(staged.values()) and all("ram" in t for t in listed.values())
    with tiercache.open(cfg) as cache:
        assert cache.refs()["branch/main"] == staged[3]
        newest = cache.versions()[-1]
        assert newest.id == staged[3] and "ram" in newest.tiers
        assert cache.agent is not None  # what a group restore asks each node's agent
        assert cache.agent.holds([staged[3], "01NOSUCHVERSION00000000000"], []) == (
            {staged[3]: True, "01NOSUCHVERSION00000000000": False}, {})
        link = cache.agent
        asked: list[str] = []
        request = link.request

        def counting(op: str, **fields: Any) -> dict[str, Any]:
            asked.append(op)
            return request(op, **fields)

        link.request = counting  # type: ignore[method-assign]
        got = cache.restore("main")
        link.request = request  # type: ignore[method-assign]
        _assert_state(got, 3)
        assert cache.last_restore is not None and set(cache.last_restore.nbytes) == {"ram"}
        # The version's chunks were pinned in one round trip, not one per chunk, and all went back.
        assert asked.count("pins") == 1 and "pin" not in asked, asked
        assert [c["pins"] for c in link.request("stats")["clients"]] == [0], link.request("stats")["clients"]
        for step, vid in staged.items():
            _assert_state(cache.restore(vid, resume=False), step)
        # The agent finishes them; this process sees their levels change.
        _wait_for(lambda: all("disk" in v.tiers for v in cache.versions()), what="versions on disk")
    with tiercache.open(without_agent(cfg)) as cache:
        for step, vid in staged.items():
            _assert_state(cache.restore(vid, resume=False), step)
            assert cache.last_restore is not None and set(cache.last_restore.nbytes) == {"disk"}


def test_a_copy_cut_by_a_crash_leaves_the_previous_version_whole(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agents(cfg)
    code, acks = _trainer({"config": cfg, "steps": [5], "end": "midcopy", "big": 1 << 20})
    assert code == -signal.SIGKILL
    assert [(w, s) for w, s, _ in acks] == [("staged", 5)]
    _wait_for(lambda: not any(c["reservations"] for c in call(load_config(cfg), "stats")["clients"]),
              what="the dead client's reservation to go back")
    with tiercache.open(cfg) as cache:
        assert cache.resolve("main") == acks[0][2]  # step 6 never existed
        _assert_state(cache.restore("main"), 5)
        # Its regions went back: the arena holds version 5 only, and takes a new save.
        arena = call(load_config(cfg), "stats")["arena"]
        assert arena["used_bytes"] < 6 << 20  # version 5 (4.1 MB) and nothing of the cut copy
        h = cache.save(state_for(7), step=7)
        h.wait("local")
        _assert_state(cache.restore("main"), 7)


# ------------------------------------------------------------------------ starting and stopping


def test_an_auto_started_agent_outlives_its_trainer_and_stops_on_request(
    tmp_path: Path, sock_dir: Path, shm_dir: Path
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir), start="auto", idle_exit=60)
    assert not listening(sock_dir / "a.sock")
    code, acks = _trainer({"config": cfg, "steps": [1], "wait": ["local"], "end": "close"})
    assert code == 0 and [w for w, _, _ in acks] == ["staged", "local"]
    stats = call(load_config(cfg), "stats")  # the trainer is gone, its agent is not
    pid = stats["pid"]
    assert os.getsid(pid) == pid  # a session of its own: not in the trainer's process group
    arena = Path(stats["arena"]["path"])
    assert arena.parent == shm_dir and arena.stat().st_mode & 0o777 == 0o600
    # Its config came through a pipe: no file next to the socket another user could have swapped.
    assert sorted(p.name for p in sock_dir.iterdir()) == ["a.sock", "a.sock.lock", "a.sock.log"]
    with tiercache.open(cfg) as cache:
        _assert_state(cache.restore("main"), 1)
        assert set(cache.last_restore.nbytes) == {"ram"}  # type: ignore[union-attr]
    runner = CliRunner()
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    out = runner.invoke(app, ["--config", str(spec), "agent", "status"])
    assert out.exit_code == 0, out.output
    assert f"agent {pid} up" in out.output and str(arena) in out.output
    out = runner.invoke(app, ["--config", str(spec), "agent", "status", "--json"])
    assert json.loads(out.output)["pid"] == pid
    out = runner.invoke(app, ["--config", str(spec), "agent", "stop"])
    assert out.exit_code == 0 and f"agent {pid} stopped" in out.output
    assert not _alive(pid)  # "stopped" is said once the process is gone
    assert not arena.exists() and not (sock_dir / "a.sock").exists()
    out = runner.invoke(app, ["--config", str(spec), "agent", "status"])
    assert out.exit_code == 1 and "no agent runs for this cache" in out.output


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone as far as we are concerned.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _toml(cfg: dict[str, Any]) -> str:
    lines = [f"{k} = {json.dumps(cfg[k])}" for k in ("pack_below", "chunk_bytes") if k in cfg]
    for table in ("ram", "disk", "s3", "policy", "agent"):
        if table in cfg:
            lines.append(f"[{table}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in cfg[table].items() if v is not None]
    return "\n".join(lines) + "\n"


def test_a_process_with_other_chunk_settings_saves_in_process(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agents(cfg)
    other = {**cfg, "chunk_bytes": "128KiB"}
    with caplog.at_level(logging.WARNING, "tiercache"), tiercache.open(other) as cache:
        h = cache.save(state_for(1), step=1)
        h.wait("local")
        assert type(cache.engine.backend).__name__ == "Engine"
    assert "chunk_bytes = 67108864 (here 131072)" in caplog.text
    with tiercache.open(without_agent(cfg)) as cache:
        _assert_state(cache.restore("main"), 1)


def test_a_second_job_with_other_settings_is_told_which_and_saves_in_process(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))  # job A: 32 MiB, write-through
    agents(cfg)
    # Job B: the same disk path (so the same agent), its own arena size and policy.
    other = {**cfg, "ram": {"capacity": "512MiB"}, "policy": {"name": "throughput-adaptive"},
             "agent": {**cfg["agent"], "request_timeout": 60}}  # a setting of its own process: no matter
    with caplog.at_level(logging.WARNING, "tiercache"), tiercache.open(other) as cache:
        cache.save(state_for(1), step=1).wait("local")
        assert type(cache.engine.backend).__name__ == "Engine"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        f"no node agent: the node agent at {sock_dir / 'a.sock'} runs this cache with other settings: "
        "policy.name = 'write-through' (here 'throughput-adaptive'), ram.capacity = 33554432 (here 536870912): "
        "give every process of the cache the same settings, or this one an [agent] socket of its own; "
        "saving in this process"]
    with tiercache.open(without_agent(cfg)) as cache:
        _assert_state(cache.restore("main"), 1)


def test_no_agent_and_start_never_saves_in_process(tmp_path: Path, sock_dir: Path) -> None:
    cfg = agent_config(tmp_path, sock_dir)
    with tiercache.open(cfg) as cache:
        cache.save(state_for(2), step=2).wait("local")
        assert type(cache.engine.backend).__name__ == "Engine"
        _assert_state(cache.restore("main"), 2)
    assert not (sock_dir / "a.sock").exists()


def test_a_write_the_agent_fails_reaches_the_trainer_after_the_version(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """The agent's disk refuses the first version: its trainer learns that level's error, in order."""
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agents(cfg, env={"TIERCACHE_FAILPOINTS": "disk.after_tmp_write=raise@1"})
    cache = tiercache.open(cfg)
    try:
        bad = cache.save(state_for(1), step=1)
        assert bad.wait("staged") == bad.version
        with pytest.raises(StorageError, match=r"^failpoint disk\.after_tmp_write fired"):
            bad.wait("local", timeout=60)
        good = cache.save(state_for(2), step=2)
        assert good.wait("local", timeout=60) == good.version
        # This process saw the manifest before the levels: node RAM holds both, the disk only the second.
        tiers = {v.id: v.tiers for v in cache.versions()}
        assert "ram" in tiers[bad.version] and "disk" not in tiers[bad.version]
        assert {"ram", "disk"} <= set(tiers[good.version])
    finally:
        with pytest.raises(StorageError, match=r"^failpoint disk\.after_tmp_write fired"):
            cache.close()  # the lost version is reported, as in process
    with tiercache.open(without_agent(cfg)) as cache:
        _assert_state(cache.restore(good.version, resume=False), 2)


# ------------------------------------------------------------------------ the agent crashing


def test_the_agent_killed_mid_write_training_goes_on_and_nothing_is_lost(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    # The agent dies by SIGKILL between a chunk's fsync and its rename: mid-write.
    agent = agents(cfg, env={"TIERCACHE_FAILPOINTS": "disk.after_fsync=kill@4"})
    handles = []
    with caplog.at_level(logging.WARNING, "tiercache"), tiercache.open(cfg) as cache:
        for step in range(1, 9):
            handles.append((step, cache.save(state_for(step), step=step)))
            time.sleep(0.05)
        cache.flush()
        assert agent.proc.wait(30) == -signal.SIGKILL
        for _, h in handles:
            assert h.wait("staged") == h.version
            assert h.wait("local") == h.version  # every version reached disk, by the agent or here
        assert type(cache.engine.backend).__name__ == "AgentBackend"
    assert "lost the node agent" in caplog.text
    with tiercache.open(without_agent(cfg)) as cache:
        for step, h in handles:
            _assert_state(cache.restore(h.version, resume=False), step)
        assert cache.resolve("main") == handles[-1][1].version


def _parent_taken(cache: Any, parent: Any) -> Any:
    """A hook for ``engine.after_chunk_write``: hold the in-process writes until ``parent`` was handed over.

    A child the trainer's engine took before its parent would then reach its commit with the
    parent queued behind it, as a slower hand-over would have it.
    """
    def taken() -> bool:
        local = cache.engine.local
        return local is not None and (local.published(parent.version) is not None or parent.future("local").done())

    return lambda *_: _wait_for(taken, 30, f"the hand-over of {parent.version}")


def _assert_handed_over(cfg: dict[str, Any], cache: Any, agent: Any, saved: list[tuple[int, Any]]) -> None:
    """Every level of every version settles, with the outcome a disk-only cache gives; each restores bit-exact."""
    cache.flush(timeout=60)  # raises (naming the versions) if one never settles
    assert agent.proc.poll() == -signal.SIGKILL and cache.engine.local is not None
    for _, h in saved:
        for lvl in ("staged", "local", "durable"):
            assert h.wait(lvl, timeout=0) == h.version
        with pytest.raises(ConfigError, match=r"^no s3 tier configured, so no 'remote' level$"):
            h.wait("remote", timeout=0)
    cache.close()
    with tiercache.open(without_agent(cfg)) as disk:
        parents = {v.id: v.parent for v in disk.versions()}
        assert parents == {saved[0][1].version: None, saved[1][1].version: saved[0][1].version}
        assert disk.resolve("main") == saved[1][1].version
        for step, h in saved:
            _assert_state(disk.restore(h.version, resume=False), step)


def test_a_child_published_as_the_agent_dies_goes_to_the_trainer_after_its_parent(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """The agent dies as the trainer publishes a child whose parent it has not written yet.

    The failed publish hands the versions over before the loss's own hand-over runs: the child
    must still go to the in-process engine after its parent, or its disk writer waits for the
    parent's outcome with the parent queued behind it (a hang seen under load).
    """
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    # The agent's disk stalls on the parent's first chunk: staged in node RAM, never on its disk.
    agent = agents(cfg, env={"TIERCACHE_FAILPOINTS": "disk.after_tmp_write=sleep:120"})
    saved: list[tuple[int, Any]] = []
    returned = threading.Event()

    def publish(vid: str) -> None:
        if saved and vid != saved[0][1].version:
            agent.kill()  # the child is whole in the arena: the agent dies before it is published

    def hand_over() -> None:
        if threading.current_thread().name == "tiercache-agent-handover":  # the loss's own, after the child's
            returned.wait(30)

    cache = tiercache.open(cfg)
    try:
        saved.append((1, cache.save(state_for(1), step=1)))
        with failpoints.hooked("agent.publish", publish), failpoints.hooked("agent.hand_over", hand_over), \
                failpoints.hooked("engine.after_chunk_write", _parent_taken(cache, saved[0][1])):
            saved.append((2, cache.save(state_for(2), step=2)))
            returned.set()
            _assert_handed_over(cfg, cache, agent, saved)
    finally:
        returned.set()
        cache.close()


def test_a_deferred_copy_the_agent_never_got_goes_to_the_trainer_before_the_next_save(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """The agent dies while a version's deferred copy runs; the next save is in process and names it as parent.

    That version must be handed over first (the next save waits for the copy), or the next
    one's disk writer waits for its parent queued behind it.
    """
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agent = agents(cfg)
    killed, handing = threading.Event(), threading.Event()

    def publish(vid: str) -> None:  # the deferred copy is done: the agent dies before it is published
        agent.kill()
        killed.set()
        handing.wait(30)  # until the next save takes over in process

    def hand_over() -> None:
        if threading.current_thread() is threading.main_thread():
            handing.set()

    w = torch.nn.Parameter(state_for(1)["w"].clone())
    opt = torch.optim.SGD([w], lr=0.1)
    cache = tiercache.open(cfg)
    saved: list[tuple[int, Any]] = []
    try:
        with failpoints.hooked("agent.publish", publish), failpoints.hooked("agent.hand_over", hand_over):
            first = {**state_for(1), "w": w.detach()}  # "w" is the optimizer's: its copy is deferred
            saved.append((1, cache.save(first, step=1, optimizer=opt)))
            assert killed.wait(30)
            _wait_for(lambda: cache.engine.backend.link.lost is not None, 30, "the trainer to see the agent lost")
            with failpoints.hooked("engine.after_chunk_write", _parent_taken(cache, saved[0][1])):
                saved.append((2, cache.save(state_for(2), step=2)))
                _assert_handed_over(cfg, cache, agent, saved)
    finally:
        handing.set()
        cache.close()


def test_a_version_the_agent_hashed_is_taken_over_bit_exact_though_its_regions_went_back(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """The agent dies after it hashed versions it had not written: the trainer takes over their own bytes.

    Version 1 holds two equal chunks: the agent keeps one copy (dedup) and gave the other's
    region back, where its RAM tier put version 1's manifest and version 2 took a chunk. Its disk
    stalls, so neither version is on it when the agent is SIGKILLed. The trainer copies both out
    of the arena: before, version 1's second chunk came back as whatever had taken its region,
    was hashed anew and written as version 1 (restored, it held version 2's bytes).
    """
    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agent = agents(cfg, env={"TIERCACHE_FAILPOINTS": "disk.after_tmp_write=sleep:120"})
    g = torch.Generator().manual_seed(5)
    same = torch.randn(32768, generator=g)  # 128 KiB: one chunk each
    states = [{"a": same, "b": same.clone(), "step": 1},
              {"a": torch.randn(32768, generator=g), "b": torch.randn(32768, generator=g), "step": 2}]
    with tiercache.open(cfg) as cache:
        assert cache.agent is not None
        h1 = cache.save(states[0], step=1)
        _wait_for(lambda: cache.agent.holds([h1.version])[0][h1.version], 30, "the agent to hash version 1")
        h2 = cache.save(states[1], step=2)
        _wait_for(lambda: cache.agent.holds([h2.version])[0][h2.version], 30, "the agent to hash version 2")
        assert not h1.done("local") and not h2.done("local")  # the agent's disk never got them
        agent.kill()
        cache.flush(timeout=60)
        assert [h.wait("local", timeout=0) for h in (h1, h2)] == [h1.version, h2.version]
    with tiercache.open(without_agent(cfg)) as cache:
        for h, want in zip((h1, h2), states, strict=True):
            got = cache.restore(h.version, resume=False)
            assert got["step"] == want["step"]
            for k in ("a", "b"):
                assert torch.equal(got[k], want[k]), f"{k} of step {want['step']} is not bit-exact"


def test_a_version_on_the_disk_is_not_taken_over_when_the_agent_dies_before_s3(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, s3_config: Any
) -> None:
    """The agent's S3 hangs; it wrote versions to the disk, gave their RAM to the next ones, and dies.

    The trainer heard ``local`` for them: their bytes may be gone from the arena (here they
    are: a small arena, reused), so it must not copy them out and save them again (before, it
    did, from whatever had reused their regions). Their ``remote`` fails naming the lost agent
    and the way on; ``durable`` holds; each restores bit-exact from the disk.
    """
    from tiercache.testing.throttle import ThrottledProxy

    with ThrottledProxy(s3_config.endpoint_url) as relay:
        s3 = {**s3_config.model_dump(mode="json"), "endpoint_url": relay.url}
        cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir), capacity="1MiB", s3=s3),
               "chunk_bytes": "128KiB"}
        # Down from the start (no connection of the agent's pool outlives it): each version's
        # ``remote`` waits for S3's catch-up (each is its branch's newest).
        relay.mode = "refuse"
        agent = agents(cfg)
        g = torch.Generator().manual_seed(6)
        states = [{"w": torch.randn(4 * 32768, generator=g), "step": s} for s in (1, 2, 3)]  # 4 chunks each
        cache = tiercache.open(cfg)
        try:
            handles = []
            for st in states:
                handles.append(cache.save(st, step=st["step"], branch=f"b{st['step']}"))
                assert handles[-1].wait("local", timeout=60) == handles[-1].version
            settled = [h.future("remote").exception() for h in handles if h.done("remote")]
            assert not settled, settled
            agent.kill()
            cache.flush(timeout=60)
            for h in handles:
                assert h.wait("durable", timeout=0) == h.version
                with pytest.raises(AgentUnavailableError) as e:
                    h.wait("remote", timeout=0)
                assert str(e.value) == (
                    f"the node agent was lost before version {h.version} reached its 'remote' level; it is "
                    f"on the disk: `tiercache promote {h.version} --to s3` copies it there")
        finally:
            relay.mode = "up"
            cache.close()
    with tiercache.open(without_agent(cfg)) as cache:
        for h, want in zip(handles, states, strict=True):
            got = cache.restore(h.version, resume=False)
            assert got["step"] == want["step"] and torch.equal(got["w"], want["w"]), want["step"]


def test_a_trainer_that_gives_up_on_a_live_agent_keeps_its_regions_until_it_exits(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """The agent stops answering (SIGSTOP) past ``request_timeout``: the trainer counts it lost and copies back.

    When the agent runs again it sees the trainer leave, without ``bye``, with a version it
    holds: the trainer may still be copying it out, so the agent parks its regions until that
    process exits (it logs it) instead of reusing them. A trainer that closes its cache says
    ``bye``, and nothing of it is parked. Every version restores bit-exact.
    """
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    cfg["agent"]["request_timeout"] = 1
    agent = agents(cfg, env={"TIERCACHE_FAILPOINTS": "engine.after_chunk_write=sleep:10@1", "TIERCACHE_LOG": "info"})
    with tiercache.open(cfg) as cache:
        assert cache.agent is not None
        h1 = cache.save(state_for(1), step=1)
        _wait_for(lambda: cache.agent.holds([h1.version])[0][h1.version], 30, "the agent to hash version 1")
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            h2 = cache.save(state_for(2), step=2)  # its reservation times out: saved in process
            cache.flush(timeout=60)
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        assert cache.engine.local is not None and h1.wait("local", timeout=0) == h1.version
    # Version 1, and version 2's reservation if the agent answered it before it saw the trainer leave.
    parked = re.compile(rf"client pid {os.getpid()} left [12] version\(s\) it may still copy out of the arena")
    _wait_for(lambda: parked.search(agent.log.read_text()) is not None, 30, "the park")
    with tiercache.open(cfg) as cache:  # a trainer of the live agent again, which closes its cache
        assert type(cache.engine.backend).__name__ == "AgentBackend"
        h3 = cache.save(state_for(3), step=3)
        assert h3.wait("local", timeout=60) == h3.version
    assert agent.log.read_text().count(f"client pid {os.getpid()} left") == 1
    with tiercache.open(without_agent(cfg)) as cache:
        for step, h in ((1, h1), (2, h2), (3, h3)):
            _assert_state(cache.restore(h.version, resume=False), step)


def test_a_parked_trainer_counts_as_running_until_it_exits_and_is_reaped() -> None:
    """What the agent asks before it gives a parked trainer's regions back: running, exited, or a new pid."""
    from tiercache.agent.requests import _running, _start_time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = _start_time(child.pid)
        assert start is not None and _running((child.pid, start))
        assert not _running((child.pid, str(int(start) + 1)))  # another process that took its pid
    finally:
        child.kill()
    _wait_for(lambda: _start_time(child.pid) is None, 30, "the child to die")  # a zombie counts as gone
    assert not _running((child.pid, start))
    child.wait(30)
    assert _start_time(child.pid) is None and not _running((child.pid, start))


def test_an_engine_that_takes_a_parent_after_its_child_never_waits_for_it(tmp_path: Path) -> None:
    """A trainer takes a version over that a live agent refused, then its parent once the agent dies.

    The engine got the parent after the child: it is behind the child on the disk writer, so the
    child's commit must not wait for its outcome (before: it waited for ever). Both settle, the
    child names the parent, and both restore bit-exact.
    """
    from tiercache.format import flatten
    from tiercache.manifest import new_version_id
    from tiercache.pipeline.job import StagedVersion
    from tiercache.pipeline.staging import PlanCache, Stager

    cfg = without_agent(agent_config(tmp_path, tmp_path))
    ids = [new_version_id(), new_version_id()]
    stager = Stager(1)
    with tiercache.open(cfg) as cache:
        eng = cache.engine.local
        plans = PlanCache(cache.config.pack_below)

        def adopt(step: int) -> Any:  # what the trainer's hand-over does with a version of the agent's arena
            flat = flatten(state_for(step))
            plan = plans.get(flat, cache.config.chunk_bytes)
            regions = eng.reserve(plan.layout)
            arena = eng.ramcache.arena  # (made by the reservation)
            assert regions is not None and arena is not None
            assert stager.copy_in(flat, plan, [arena.tensor(r) for r in regions],
                                  [threading.Event() for _ in regions]) is None
            parent = ids[0] if step == 2 else None
            staged = StagedVersion(ids[step - 1], "main", step, step - 1, parent, {}, time.time(),
                                   flat.tree, tuple(flat.metas), flat.pickled)
            return eng.adopt(staged, plan.layout, regions)

        child_taken = threading.Event()
        handles: dict[int, Any] = {}

        def hold(*_: Any) -> None:  # the child's chunk writes wait until the engine has its parent
            if child_taken.is_set():
                _wait_for(lambda: 1 in handles, 30, "the parent to be taken")

        with failpoints.hooked("engine.after_chunk_write", hold):
            handles[2] = adopt(2)
            child_taken.set()
            handles[1] = adopt(1)
            cache.flush(timeout=60)
        for step, h in handles.items():
            assert h.wait("local", timeout=0) == h.wait("durable", timeout=0) == ids[step - 1]
    stager.close()
    with tiercache.open(cfg) as cache:
        assert {v.id: v.parent for v in cache.versions()} == {ids[0]: None, ids[1]: ids[0]}
        for step in (1, 2):
            _assert_state(cache.restore(ids[step - 1], resume=False), step)


def test_both_killed_acknowledged_versions_survive_and_the_next_agent_sweeps_the_arena(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agent = agents(cfg)
    proc = subprocess.Popen([sys.executable, str(TRAINER), json.dumps(
        {"config": cfg, "steps": list(range(1, 10_000)), "wait": ["local"], "end": "close"})],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    acks = []
    for line in proc.stdout:
        acks.append(line.split())
        if len(acks) >= 8:
            break
    old_arena = Path(call(load_config(cfg), "stats")["arena"]["path"])
    os.kill(proc.pid, signal.SIGKILL)  # both at once
    agent.kill()
    proc.wait(30)
    acks += [line.split() for line in proc.stdout.read().splitlines()]
    local = [(int(s), v) for w, s, v in acks if w == "local"]
    assert local and old_arena.exists()  # nobody unlinked it: the agent died
    old_inode = old_arena.stat().st_ino
    with tiercache.open(without_agent(cfg)) as cache:
        for step, vid in local:
            _assert_state(cache.restore(vid, resume=False), step)
        got = cache.restore("main")
        assert got["step"] >= local[-1][0]
        _assert_state(got, got["step"])
    agent = agents(cfg)
    # Swept (its agent is dead); the new agent's arena has the same name, not the same file.
    assert not old_arena.exists() or old_arena.stat().st_ino != old_inode
    assert "removed the arena of a dead agent" in agent.log.read_text()
    with tiercache.open(cfg) as cache:
        got = cache.restore("main")
        assert got["step"] >= local[-1][0]


# ------------------------------------------------------------------------ what operators see


def test_stats_show_the_agent(tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any) -> None:
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agent = agents(cfg)
    with tiercache.open(cfg) as cache:
        cache.save(state_for(1), step=1).wait("local")
        cache.restore("main")
        stats = cache.stats()
    with tiercache.open(cfg) as cache:  # as `tiercache ui` reads it: a process that never saved
        overview = views.overview(views.Capture.of(cache, mttf=None, now=time.time()), refresh=2.0)
    # One typed model: the agent-backed stats and an in-process cache's are both a CacheStats that
    # describes every key (a round trip through the model gives the very dict back).
    with tiercache.open({**without_agent(cfg), "disk": {"path": str(tmp_path / "own")}}) as own:
        own.save(state_for(1), step=1).wait("local")
        in_process = own.stats()
    typed = {name: CacheStats.model_validate(d) for name, d in (("agent", stats), ("in_process", in_process))}
    assert {name: t.to_json() for name, t in typed.items()} == {"agent": stats, "in_process": in_process}
    assert typed["in_process"].agent is None and typed["agent"].agent is not None
    assert set(stats) - {"agent"} == set(in_process) and set(stats["tiers"]["disk"]) == set(in_process["tiers"]["disk"])
    wire = call(load_config(cfg), "stats")
    assert AgentStats.model_validate(wire).to_json() == {k: v for k, v in wire.items() if k != "id"}
    assert overview["agent"]["pid"] == agent.pid and overview["agent"]["arena_capacity"] == 32 << 20
    assert overview["tiers"] == ["ram", "disk"] and overview["versions"] == 1
    assert stats["agent"]["pid"] == agent.pid
    assert stats["meter"]["tiers"]["disk"]["write"]["transfers"] >= 1  # the agent wrote, and measured it
    assert stats["agent"]["levels"] == {"staged:ok": 1, "local:ok": 1, "durable:ok": 1}  # no S3, no peers
    assert stats["agent"]["served_bytes"]["ram"] > 0
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    out = CliRunner().invoke(app, ["--config", str(spec), "stats"])
    assert out.exit_code == 0, out.output
    assert f"agent {agent.pid} up" in out.output
    assert "levels of the versions and group parts it wrote: staged 1 ok; local 1 ok; durable 1 ok" in \
        " ".join(out.output.split())  # (rich wraps the lines of `stats` at the console's width)


def test_restores_a_client_reports_count_at_most_eight_sources(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """A client naming endless restore sources grows no counter (nor metrics label) without bound."""
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agents(cfg)
    spec = load_config(cfg)
    call(spec, "restored", nbytes={"ram": 5, "disk": -7}, seconds=-1.0, began=0.0)
    call(spec, "restored", nbytes={f"x{i}": 1 for i in range(100)}, seconds=0.5, began=0.0)
    stats = call(spec, "stats")
    assert stats["restores"] == {"ram": 1, "disk": 1, **{f"x{i}": 1 for i in range(6)}}, stats["restores"]
    assert (stats["restore_bytes"]["ram"], stats["restore_bytes"]["disk"]) == (5, 0), stats["restore_bytes"]


def _cli(spec: Path, *args: str) -> str:
    got = CliRunner().invoke(app, ["--config", str(spec), *args])
    assert got.exit_code == 0, got.output
    return got.output


def _aged(table: str) -> str:
    """A table ``ls`` printed, its age column (under ``age``; every age below 100 s) written ``AGE``."""
    lines = table.splitlines()
    at = lines[0].index("age")
    return "\n".join([lines[0], *(line[:at] + "AGE" + line[at + 3:] if line[0] == " " != line[1] else line
                                   for line in lines[1:])])


def test_ls_and_agent_status_tell_what_node_ram_holds_and_why_s3_lacks_a_group_version(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, s3_config: Any
) -> None:
    """Two ranks save four versions through their node's agent; rank 1's policy coalesces S3 at even steps.

    ``ls`` and ``ls --json`` show node RAM holding each version (or why not) and why S3 lacks
    the coalesced ones; ``agent status`` counts those as skips, and nothing of a level no tier
    provides; the agent logs the skips at INFO, summarised, never as failures. Once the agent is
    gone, the RAM column says so.
    """
    from _policies import COALESCED
    from test_multirank import rank_out

    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir), s3=s3_config.model_dump(mode="json"))
    cfg["policy"] = {"name": "tests._policies:CoalesceRankOne"}
    agent = agents(cfg, env={"TIERCACHE_LOG": "info"})
    assert run_ranks_agent("save_four", tmp_path / "run", cfg) == [0, 0]
    v1, v2, v3, v4 = rank_out(tmp_path / "run", 0)["versions"]
    for r in range(2):
        remote = [lv["remote"] for lv in rank_out(tmp_path / "run", r)["levels"]]
        assert [x if isinstance(x, str) else x[0] for x in remote] == [v1, "SkippedError", v3, "SkippedError"]
    why = {v: f"version {v} on s3 skipped: rank 1: version {v}.1 skipped for s3: {COALESCED}" for v in (v2, v4)}
    spec = _write(tmp_path, cfg)
    held = ("held", "")
    listed = {v["id"]: (v["tiers"], {t: (st["state"], st["reason"]) for t, st in v["states"].items()})
              for v in json.loads(_cli(spec, "ls", "--json"))}
    assert listed == {
        v1: (["ram", "disk", "s3"], {"ram": held, "disk": held, "s3": held}),
        v2: (["ram", "disk"], {"ram": held, "disk": held, "s3": ("skipped", why[v2])}),
        v3: (["ram", "disk", "s3"], {"ram": held, "disk": held, "s3": held}),
        v4: (["ram", "disk"], {"ram": held, "disk": held, "s3": ("skipped", why[v4])}),
    }
    # Node RAM drops version 1 (its parts' chunks): ls says so.
    with tiercache.open(without_agent(cfg)) as cache:
        chunks = sorted({c.id for c in cache.manifest(v1).chunks})
    assert call(load_config(cfg), "evict", chunks=chunks)["nbytes"] > 0
    w = short_id_length([v1, v2, v3, v4])
    dropped = "node RAM dropped it since (it is a cache there: for room, or by an evict or gc)"
    assert _aged(_cli(spec, "ls")) == "\n".join([
        f" {'id':<{w}}  step  branch       size  age  refs    ram    disk    s3    ",
        f" {v1[:w]}     1  main    768.1 KiB  AGE        evicted   ✓       ✓    ",
        f" {v2[:w]}     2  main    768.1 KiB  AGE           ✓      ✓    skipped ",
        f" {v3[:w]}     3  main    768.1 KiB  AGE           ✓      ✓       ✓    ",
        f" {v4[:w]}     4  main    768.1 KiB  AGE  main     ✓      ✓    skipped ",
        "why a tier lacks a version, newest first:",
        f"  {v4[:w]} s3 skipped: {why[v4]}",
        f"  {v2[:w]} s3 skipped: {why[v2]}",
        f"  {v1[:w]} ram evicted: {dropped}",
    ])
    status = _cli(spec, "agent", "status").splitlines()
    # Each version's two parts: a skip is counted as a skip, and no level of no tier is counted.
    assert status[3:] == [
        "levels of the versions and group parts it wrote: staged 8 ok; local 8 ok; remote 4 ok, 4 skipped; "
        "durable 8 ok"]
    assert agent.stop() == 0
    log = [line for line in agent.log.read_text().splitlines() if "skipped for s3" in line]
    assert log[0] == f"INFO tiercache.pipeline.skips: version {v2}.1 skipped for s3: {COALESCED}", log
    assert len(log) == 2 and re.fullmatch(
        rf"INFO tiercache\.pipeline\.skips: 3 more version\(s\) skipped for s3 in the last \d+ s, the newest "
        rf"{v4}\.0: {re.escape(why[v4])}", log[1]), log
    # No agent runs: the RAM column says so.
    assert _aged(_cli(spec, "ls")).splitlines()[:5] == [
        f" {'id':<{w}}  step  branch       size  age  refs    ram     disk    s3    ",
        f" {v1[:w]}     1  main    768.1 KiB  AGE        no agent   ✓       ✓    ",
        f" {v2[:w]}     2  main    768.1 KiB  AGE        no agent   ✓    skipped ",
        f" {v3[:w]}     3  main    768.1 KiB  AGE        no agent   ✓       ✓    ",
        f" {v4[:w]}     4  main    768.1 KiB  AGE  main  no agent   ✓    skipped ",
    ]
    none = ("absent", "no node agent runs for this cache: no node RAM holds its versions")
    assert [(v["tiers"], v["states"]["ram"]["state"], v["states"]["ram"]["reason"])
            for v in json.loads(_cli(spec, "ls", "--json"))] == [
        (["disk", "s3"], *none), (["disk"], *none), (["disk", "s3"], *none), (["disk"], *none)]


def test_the_agent_publishes_its_trainers_restores_and_restarts_for_the_ui_and_plan(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    # Issue 47 items 5 and 7: the agent publishes the status and outlives its trainers: the ui names
    # the trainers, not the agent; plan uses the restores and the restart it saw, not defaults.
    from tiercache.advisor import when

    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "ui": {"status_interval": 0.05}}
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    agent = agents(cfg)

    def publisher() -> dict[str, Any]:
        with tiercache.open(cfg) as viewer:  # as `tiercache ui` reads it: connected to the agent, never saving
            return views.overview(views.Capture.of(viewer, mttf=None, now=time.time()), refresh=2.0)["trainer"] or {}

    def published() -> dict[str, Any]:
        with tiercache.open(cfg) as viewer:  # what the agent published (the trainer's own status is its own)
            return viewer.status() or {}

    started = time.time()
    code, _ = _trainer({"config": cfg, "steps": [1, 2], "wait": ["local"], "end": "kill"})
    assert code == -signal.SIGKILL
    _wait_for(lambda: not any(c["saves"] for c in call(load_config(cfg), "stats")["clients"]), what="the trainer gone")
    left = time.time()
    time.sleep(0.5)
    asked = time.time()
    with tiercache.open(cfg) as cache:  # the restarted trainer
        _assert_state(cache.restore("main"), 2)
        restored = time.time()
        vid = cache.save(state_for(3), step=3).wait("local")
        _wait_for(lambda: (publisher().get("staged") or {}).get("version") == vid, what="the agent's status")
        live = publisher()
    status = published()
    assert (live["writer"], live["pid"], live["trainers"], live["closed"]) == ("agent", agent.pid, [os.getpid()], False)
    _wait_for(lambda: publisher()["trainers"] == [], what="the trainer to leave the agent")
    gone = publisher()
    assert (gone["writer"], gone["pid"], gone["closed"], gone["staged"]["version"]) == ("agent", agent.pid, False, vid)
    assert status is not None and (status["restore"]["count"], status["restart"]["count"]) == (1, 1)
    restart = status["restart"]["ewma"]
    assert asked - left <= restart <= restored - started  # from the trainer's exit to the new one's restore
    res = CliRunner().invoke(app, ["--config", str(spec), "plan", "--mttf", "3h", "--json"])
    assert res.exit_code == 0, res.output
    inputs = json.loads(res.output)["inputs"]
    assert inputs["restore"] == {"seconds": status["restore"]["ewma"], "source": "measured",
                                 "note": f"EWMA of 1 restores, newest {when(status['restore']['recent'][-1][0])}"}
    assert inputs["restart"] == {"seconds": restart, "source": "measured",
                                 "note": "EWMA of 1 restarts (the node agent saw the trainers leave and return), "
                                         f"newest {when(status['restart']['recent'][-1][0])}"}


def test_a_client_refuses_another_users_socket(tmp_path: Path, sock_dir: Path) -> None:
    cfg = agent_config(tmp_path, sock_dir)
    sock = sock_dir / "a.sock"
    sock.write_text("")
    os.chown(sock, 65534, 65534)
    with pytest.raises(AgentUnavailableError, match="belongs to uid 65534"):
        call(load_config(cfg), "stats")
    out = CliRunner().invoke(app, ["agent", "--config", str(_write(tmp_path, cfg))])
    assert out.exit_code == 2
    assert "is in use by another user (uid 65534)" in out.output


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    return spec


def test_naming_keys_a_cache_by_storage_and_node(tmp_path: Path) -> None:
    a = load_config({"disk": {"path": str(tmp_path / "a")}, "agent": {}})
    b = load_config({"disk": {"path": str(tmp_path / "b")}, "agent": {}})
    a_node = load_config({"disk": {"path": str(tmp_path / "a")}, "agent": {}, "node": "n1"})
    keys = {naming.cache_key(c) for c in (a, b, a_node)}
    assert len(keys) == 3
    assert naming.place(a).socket.name == f"agent-{naming.cache_key(a)}.sock"


def test_the_agent_serves_prometheus_metrics(tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir), metrics="127.0.0.1:0")
    agent = agents(cfg)
    with tiercache.open(cfg) as cache:
        for step in (1, 2):
            cache.save(state_for(step), step=step).wait("local")
        cache.restore("main")
        address = cache.stats()["agent"]["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("tiercache_agent_info", (("cache", naming.cache_key(load_config(cfg))), ("pid", str(agent.pid)),
                                              ("socket", str(sock_dir / "a.sock"))))] == 1
    assert samples[("tiercache_agent_arena_bytes", (("kind", "capacity"),))] == 32 << 20
    assert samples[("tiercache_agent_versions_total", (("level", "local"), ("outcome", "ok")))] == 2
    # No S3 and no peers here: no counter of a level no tier provides (no "remote failed 2").
    assert {dict(labels)["level"] for name, labels in samples if name == "tiercache_agent_versions_total"} == {
        "staged", "local", "durable"}
    assert samples[("tiercache_agent_tier_versions", (("tier", "disk"),))] == 2
    assert samples[("tiercache_agent_tier_versions", (("tier", "ram"),))] == 2
    assert samples[("tiercache_agent_tier_bytes", (("tier", "disk"),))] > 0
    assert samples[("tiercache_agent_queue_depth", (("tier", "disk"),))] == 0
    assert samples[("tiercache_agent_group_parts", (("state", "orphaned"),))] == 0  # no group saved here
    assert samples[("tiercache_agent_restores_total", (("source", "ram"),))] == 1
    assert samples[("tiercache_agent_lag_steps", (("branch", "main"), ("level", "local")))] == 0
    assert samples[("tiercache_agent_lost_versions_total", ())] == 0


def test_gc_and_ram_eviction_run_in_the_agent(tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any) -> None:
    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "reflog_keep": 0}
    agents(cfg)
    with tiercache.open(cfg) as cache:
        a, b, c = (cache.save(state_for(s), step=s).wait("local") for s in (1, 2, 3))
        # Until every save is finished in the agent (local is one level of it), gc keeps c as in flight.
        cache.flush()
        cache.rollback("main", a)  # b and c are reachable from nothing now
        report = cache.gc(grace=0)
        assert set(report.versions) == {b, c} and report.chunks["disk"] > 0
        assert [v.id for v in cache.versions()] == [a]
        # The agent collected them itself: its view of the disk is true, and the next save builds on a.
        d = cache.save(state_for(4), step=4).wait("local")
        assert cache.manifest(d).parent == a
        cache.flush()  # a version in flight keeps its chunks in RAM
        assert cache.evict(d, "ram") > 0  # node RAM's copy goes; the disk's stays
        assert "ram" not in next(v for v in cache.versions() if v.id == d).tiers
        _assert_state(cache.restore(d, resume=False), 4)
        assert set(cache.last_restore.nbytes) == {"disk"}  # type: ignore[union-attr]
    with tiercache.open(without_agent(cfg)) as cache:
        assert [v.id for v in cache.versions()] == [a, d]
        _assert_state(cache.restore("main"), 4)


def test_the_cli_promotes_into_and_evicts_from_node_ram_an_agent_holds(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    # Issue 47 item 6: with an agent, node RAM outlasts the command, so the CLI moves versions in and out of it.
    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    agents(cfg)
    with tiercache.open(cfg) as cache:
        a, _b = (cache.save(state_for(s), step=s).wait("local") for s in (1, 2))
        cache.flush()
        nbytes = cache.manifest(a).nbytes
    cli = CliRunner()
    out = cli.invoke(app, ["--config", str(spec), "evict", "main~1", "--from", "ram", "--json"])
    assert out.exit_code == 0, out.output
    freed = json.loads(out.output)["bytes_freed"]
    assert freed >= nbytes  # every chunk of it (stored objects: a little more than the raw bytes)
    out = cli.invoke(app, ["--config", str(spec), "promote", "main~1", "--to", "ram", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {"version": a, "branch": "main", "step": 1, "tier": "ram", "bytes_copied": freed}
    with tiercache.open(cfg) as cache:  # a new process restores it from node RAM
        _assert_state(cache.restore("main~1", resume=False), 1)
        assert cache.last_restore is not None and set(cache.last_restore.nbytes) == {"ram"}


def test_the_cli_refuses_ram_moves_when_the_agent_is_not_running(tmp_path: Path, sock_dir: Path) -> None:
    cfg = agent_config(tmp_path, sock_dir)
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    with tiercache.open(without_agent(cfg)) as cache:
        cache.save(state_for(1), step=1).wait("local")
    out = CliRunner().invoke(app, ["--config", str(spec), "promote", "main", "--to", "ram"])
    assert out.exit_code == 2
    assert out.output.splitlines()[-1] == (
        "error: a CLI process has no lasting RAM tier (its arena ends with the command), so `promote --to ram` "
        "would do nothing: no node agent serves this cache now: run one (`tiercache agent`) for node RAM that "
        "outlasts commands")


# ------------------------------------------------------------------------ a multi-rank job


def test_a_restarted_group_restores_from_node_ram(tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any) -> None:
    """Two ranks save over their group with a node agent and are SIGKILLed; the restarted ranks read node RAM only."""
    from _multirank_worker import node_state
    from test_multirank import rank_out, run_ranks

    cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir))
    agents(cfg)
    codes = run_ranks("_agent_group_worker:save_and_die", 2, tmp_path / "save", cfg, opts={"broken": True})
    assert codes == [-signal.SIGKILL] * 2
    saved = [rank_out(tmp_path / "save", r) for r in range(2)]
    vid = saved[0]["v2"]["local"]
    for out in saved:
        assert out["v2"]["local"] == out["v2"]["durable"] == vid
        assert out["node_ram_holds_part"] and out["chunks"] > 0
    assert run_ranks("_agent_group_worker:restore", 2, tmp_path / "restore", cfg) == [0, 0]
    for r in range(2):
        got = rank_out(tmp_path / "restore", r)
        assert got["restored_equal"], f"rank {r} restored other bytes than its part of step 2"
        want = sum(t.nbytes for t in node_state(r, 2).values() if hasattr(t, "nbytes"))
        assert set(got["restored_report"]) == {"ram"} and got["restored_report"]["ram"] >= want


def _node_agents(tmp_path: Path, agents: Any, base: dict[str, Any], nodes: list[str], ranks_per_node: int,
                 faults: dict[str, str] | None = None) -> tuple[list[Any], list[dict[str, str]]]:
    """One agent per simulated node (its own disk, socket and arena); each rank's variables.

    ``faults``: failpoints (``TIERCACHE_FAILPOINTS``) of a node's agent, by node.
    """
    started, per_rank = [], []
    for name in nodes:
        sock = agents.sock_dir()
        cfg = {**base, "node": name, "disk": {"path": str(tmp_path / f"disk-{name}")},
               "agent": {**base["agent"], "socket": str(sock / "a.sock")}}
        fault = (faults or {}).get(name)
        started.append(agents(cfg, env=None if fault is None else {"TIERCACHE_FAILPOINTS": fault}))
        per_rank += [{"TIERCACHE_NODE": name, "TIERCACHE_DISK__PATH": cfg["disk"]["path"],
                      "TIERCACHE_AGENT__SOCKET": cfg["agent"]["socket"]}] * ranks_per_node
    return started, per_rank


def test_a_group_saves_through_its_nodes_agents(tmp_path: Path, shm_dir: Path, agents: Any,
                                                s3_config: Any) -> None:
    """Four ranks on two nodes, an agent each: the agents hash and write every part, the ranks agree."""
    from _multirank_worker import node_state
    from test_multirank import rank_out, run_ranks

    base = {**agent_config(tmp_path, tmp_path, shm_dir=str(shm_dir), s3=s3_config.model_dump(mode="json")),
            "ram": {"capacity": "16MiB"}, "chunk_bytes": "128KiB", "peers": {"copies": 1}}
    _, env = _node_agents(tmp_path, agents, base, ["a", "b"], 2)
    assert run_ranks("_agent_group_worker:through_agents", 4, tmp_path / "run", base, env=env) == [0] * 4
    outs = [rank_out(tmp_path / "run", r) for r in range(4)]
    for v in range(2):
        vid = outs[0]["levels"][v]["durable"]
        for out in outs:
            levels = out["levels"][v]
            # Each node's part is also on the other node's disk (the agents sent the peer copies).
            assert levels["local"] == levels["replicated"] == levels["remote"] == levels["durable"] == vid
    for r, out in enumerate(outs):
        # The ranks traded the ids of the replicated "emb" (each agent hashes its ranks' parts side
        # by side) and split its writing: every version's shared chunks have several writers.
        assert all(len(ranks) > 1 for ranks in out["declared_writers"]), out["declared_writers"]
        assert out["through_agent"], f"rank {r} saved in its own process"
        # The trainer wrote no chunk at all: not its part's, not to S3, and not the peer copies of
        # the other node's part either (its agent received those from the other node's agent).
        assert out["trainer_puts_own"] == out["trainer_puts_s3"] == out["trainer_puts_disk"] == 0, out
        assert out["agent_peer_bytes"]["sent"] > 0 and out["agent_peer_bytes"]["received"] > 0, out
        assert out["restored_equal"] and out["v1_equal"], f"rank {r} restored other bytes"
        want = sum(t.nbytes for t in node_state(r, 2).values() if hasattr(t, "nbytes"))
        assert set(out["restored_report"]) == {"ram"} and out["restored_report"]["ram"] >= want
        # Two parts per agent and version, every tier reached (levels counted by the agent).
        assert out["agent_levels"]["local:ok"] >= 4 and out["agent_levels"]["remote:ok"] >= 4
        # The agent's durability lag follows the group's versions: nothing saved is behind.
        lag = out["agent_lag"]["main"]
        assert lag["local"]["steps"] == lag["remote"]["steps"] == 0, lag
    # The group's versions are committed on each node's disk, and whole on S3: a process with no
    # agent and no group reads every rank's part there.
    vids = [outs[0]["levels"][0]["durable"], outs[0]["levels"][1]["durable"]]
    for node in ("a", "b"):
        cfg = without_agent({**base, "node": node, "disk": {"path": str(tmp_path / f"disk-{node}")}})
        with tiercache.open(cfg) as cache:
            assert [v.id for v in cache.versions()] == vids
    with tiercache.open({"s3": base["s3"], "chunk_bytes": base["chunk_bytes"]}) as cache:
        parts = cache.restore("main")
    assert len(parts) == 4
    for r, part in enumerate(parts):
        want = node_state(r, 2)
        assert all(torch.equal(part[k], want[k]) for k in ("shard", "emb", "rng")) and part["step"] == 2


@pytest.mark.parametrize("fault", ["raise", "kill", "sleep:8"])
def test_an_agent_that_fails_or_dies_sending_peer_copies_fails_replicated_alike(
    tmp_path: Path, shm_dir: Path, agents: Any, fault: str
) -> None:
    """Node b's agent cannot read a chunk it sends (dies, stalls past the timeout): ``replicated`` fails alike.

    ``local`` and ``durable`` are not affected; the next version's copies go through again (for
    a dead agent: between the trainers, the rank that lost it saving in process).
    """
    from _multirank_worker import node_state
    from test_multirank import rank_out, run_ranks

    base = {**agent_config(tmp_path, tmp_path, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB",
            "peers": {"copies": 1}}
    _, env = _node_agents(tmp_path, agents, base, ["a", "b"], 1, faults={"b": f"peers.send={fault}@2"})
    timeout = 5 if fault.startswith("sleep") else 20
    assert run_ranks("_agent_group_worker:peer_copies", 2, tmp_path / "run", base, env=env,
                     opts={"timeout": timeout}) == [0, 0]
    outs = [rank_out(tmp_path / "run", r) for r in range(2)]
    first, second = [o["levels"][0] for o in outs], [o["levels"][1] for o in outs]
    vid1, vid2 = first[0]["durable"], second[0]["durable"]
    assert all(lv["local"] == lv["durable"] == vid1 for lv in first), first
    assert first[0]["replicated"] == first[1]["replicated"], first  # one outcome, the rank named
    kind, message = first[0]["replicated"]
    assert kind == "GroupSaveError" and f"version {vid1} on peers" in message and "rank 1" in message, message
    if fault == "raise":  # the receiver was told at once that the chunk will not come
        assert "rank 1 could not read" in message, message
        assert [o["agent_lost"] for o in outs] == [[False, False]] * 2
    elif fault == "kill":  # the receiving agent saw the connection close: it did not wait for the timeout
        assert "rank 1's node agent stopped before it sent" in message, message
        assert outs[0]["agent_lost"] == [False, False] and outs[1]["agent_lost"] == [True, True]
    else:  # the receiving agent gave up at the group's timeout (8 s against 5 s), the sender after its sleep
        assert f"did not come from rank 1's node agent within {timeout}s" in message, message
        assert [o["agent_lost"] for o in outs] == [[False, False]] * 2
    assert all(lv["local"] == lv["replicated"] == lv["durable"] == vid2 for lv in second), second
    # Node a's disk alone restores node b's part of the second version: the peer copy is whole.
    cfg = without_agent({**base, "node": "a", "disk": {"path": str(tmp_path / "disk-a")}})
    with tiercache.open(cfg) as cache:
        parts = cache.restore(vid2)
    for r, part in enumerate(parts):
        want = node_state(r, 2)
        assert all(torch.equal(part[k], want[k]) for k in ("shard", "emb", "rng")) and part["step"] == 2


def _wait_idle(agent_cfg: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """The agent's stats once it holds no version in flight (what it frees when its parts fail)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = call(load_config(agent_cfg), "stats")
        if (stats["tracked"] == 0 and stats["in_flight"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_a_rank_that_dies_before_the_commit_fails_the_version_and_the_restart_adopts_it(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """Rank 1 dies once its part is written: rank 0 learns it, the agent waits for nothing, the restart adopts it."""
    from _multirank_worker import node_state
    from test_multirank import rank_out, run_ranks

    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agents(cfg)
    codes = run_ranks("_agent_group_worker:dies_at_write", 2, tmp_path / "die", cfg,
                      opts={"broken": True, "timeout": 8})
    assert codes == [0, -signal.SIGKILL]
    levels = rank_out(tmp_path / "die", 0)["levels"]
    for lvl in ("local", "durable"):
        kind, message = levels[lvl]
        assert kind in ("GroupBrokenError", "GroupSaveError") and "rank 1" in message, levels
    # Both parts reached the agent; the dead trainer's failed there, the other with the group's error.
    stats = _wait_idle(cfg)
    assert (stats["tracked"], stats["in_flight"]) == (0, 0), stats
    assert stats["levels"].get("durable:failed") == 2 and not stats["levels"].get("durable:ok"), stats["levels"]
    assert stats["lost_versions"] == 0  # a part the group failed is no loss of the agent's
    # Both parts are kept for the restart: one's trainer died, the other's group broke.
    assert stats["parts"] == {"in_flight": 0, "orphaned": 2}, stats["parts"]
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    status = CliRunner().invoke(app, ["--config", str(spec), "agent", "status"])
    vid = rank_out(tmp_path / "die", 0)["v"]
    # What becomes of the orphaned parts, said with them.
    assert status.output.splitlines()[3:] == [
        "group parts: 0 in flight, 2 orphaned (their trainers died before the group committed them), 0 released "
        "(could never be adopted), 0 settled (their group committed them as a trainer died)",
        f"  orphaned: main@1 ({vid}): part(s) of rank(s) 0, 1 of 2",
        "  they stay in node RAM until a restarted job of the same size restores their branch by name (it adopts the "
        "newest version every rank's part of is kept, and lets newer incomplete ones go), a version of their branch "
        "at their step or later is committed, or a new save needs their room (the oldest go first; at most 64 are "
        "kept)",
        "levels of the versions and group parts it wrote: staged 2 ok; local 2 failed; durable 2 failed",
    ], status.output
    with tiercache.open(without_agent(cfg)) as cache:
        assert cache.versions() == []  # the group committed nothing
    # The job is restarted, as torchrun restarts it: the same agent adopts the version both parts
    # of which it holds (one rank died, the other's group broke), and the ranks restore it.
    assert run_ranks_agent("adopt", tmp_path / "again", cfg, opts={"step": 1}) == [0, 0]
    for r in range(2):
        out = rank_out(tmp_path / "again", r)
        assert out["head"] == out["head_again"] == vid and out["restored_equal"] and out["again_equal"]
    with tiercache.open(without_agent(cfg)) as cache:
        assert [v.id for v in cache.versions()] == [vid]
        got = cache.restore("main")
    assert all(torch.equal(got[r]["shard"], node_state(r, 1)["shard"]) for r in range(2))


def test_the_agent_killed_mid_write_of_a_group_version_the_ranks_finish_it(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """The agent dies while writing the ranks' parts: every rank finishes them in process, with one outcome."""
    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agent = agents(cfg, env={"TIERCACHE_FAILPOINTS": "engine.after_chunk_write=kill@3"})
    assert run_ranks_agent("agent_dies", tmp_path / "run", cfg) == [0, 0]
    assert agent.proc.wait(30) == -signal.SIGKILL  # it died at the failpoint, mid-version
    from test_multirank import rank_out

    outs = [rank_out(tmp_path / "run", r) for r in range(2)]
    for out in outs:
        # Nothing save() returned is lost: both versions are committed, the same on every rank.
        for key in ("v1", "v2"):
            assert out[key]["local"] == out[key]["durable"] == outs[0][key]["durable"], out[key]
        assert out["agent_lost"] and not out["through_agent"]
        assert out["restored_equal"] and out["v1_equal"] and out["head_error"] is None


def run_ranks_agent(scenario: str, work: Path, cfg: dict[str, Any], world: int = 2,
                    opts: dict[str, Any] | None = None) -> list[int]:
    from test_multirank import run_ranks

    return run_ranks(f"_agent_group_worker:{scenario}", world, work, cfg, opts=opts)


def test_a_restarted_group_adopts_the_version_its_dead_trainers_left_in_node_ram(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """Every trainer dies after save() returned and before the group committed: the restart commits it, once."""
    from _multirank_worker import node_state
    from test_multirank import rank_out

    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agents(cfg)
    from test_multirank import run_ranks

    codes = run_ranks("_agent_group_worker:orphan", 2, tmp_path / "die", cfg, opts={"broken": True})
    assert codes == [-signal.SIGKILL] * 2
    died = [rank_out(tmp_path / "die", r) for r in range(2)]
    v1, v2 = died[0]["v1"], died[0]["v2"]
    assert all(d["v1"] == v1 and d["v2"] == v2 and not d["v2_committed"] and d["v2_part_chunks"] > 0 for d in died)
    with tiercache.open(without_agent(cfg)) as cache:
        assert cache.resolve("main") == v1  # what the group had committed when it died
    # Restarted with one rank, the job adopts nothing: one rank's part is no version.
    assert run_ranks_agent("restart_smaller", tmp_path / "smaller", cfg, world=1) == [0]
    smaller = rank_out(tmp_path / "smaller", 0)
    assert smaller["head"] == v1 and smaller["restore_error"][0] == "InvalidArgumentError", smaller
    # Rank 1 cannot read its part back the first time: no rank adopts (every rank restores the
    # committed head, bit-exact), and the parts stay for the next try.
    assert run_ranks_agent("adopt_fails_once", tmp_path / "fails", cfg) == [0, 0]
    for r in range(2):
        out = rank_out(tmp_path / "fails", r)
        assert (out["first_head"], out["first_equal"]) == (v1, True), out
        assert (out["second_head"], out["second_equal"]) == (v2, True), out
    assert run_ranks_agent("adopt", tmp_path / "restart", cfg) == [0, 0]
    for r in range(2):
        out = rank_out(tmp_path / "restart", r)
        assert out["head"] == out["head_again"] == v2, f"rank {r} restored {out['head']}, not the adopted {v2}"
        assert out["restored_equal"] and out["again_equal"], f"rank {r} restored other bytes than its part of step 2"
        assert set(out["restored_report"]) == {"ram"}
    with tiercache.open(without_agent(cfg)) as cache:
        assert [v.id for v in cache.versions()] == [v1, v2]  # committed once, with its own id
        adopted = cache.manifest(v2)
        assert (adopted.parent, adopted.step, adopted.meta, adopted.world) == (v1, 2, {"loss": 0.5}, 2)
        parts = cache.restore(v2)
    assert all(torch.equal(parts[r]["shard"], node_state(r, 2)["shard"]) for r in range(2))


def test_a_branch_rolled_back_after_its_trainers_died_adopts_nothing_they_left_in_node_ram(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """Step 2 is left in node RAM when the job dies; the operator then rolls main back (to step 1).

    The restart must not put step 2 back on top of the rolled-back branch (it belongs to the
    history the operator left): every rank restores step 1 bit-exact, warns once, and the agent
    lets the parts go.
    """
    from test_multirank import rank_out

    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agents(cfg)
    assert run_ranks_agent("orphan", tmp_path / "die", cfg, opts={"broken": True}) == [-signal.SIGKILL] * 2
    died = rank_out(tmp_path / "die", 0)
    v1, v2 = died["v1"], died["v2"]
    assert _wait_idle(cfg)["parts"] == {"in_flight": 0, "orphaned": 2}
    with tiercache.open(without_agent(cfg)) as cache:
        assert cache.rollback("main", v1) == v1
    assert run_ranks_agent("adopt_warns", tmp_path / "again", cfg) == [0, 0]
    warned = []
    for r in range(2):
        out = rank_out(tmp_path / "again", r)
        assert (out["head"], out["restored_equal"], out["again_equal"]) == (v1, True, True), out
        warned += out["warnings"]
    # The ranks share one agent here: the first to ask has it let both parts go, so the other
    # may find none left to warn about.
    assert 1 <= len(warned) <= 2 and set(warned) == {
        f"not adopting 1 version(s) of 'main' left in node RAM ({v2}): 'main' was moved back after they were "
        "saved; the node agent lets them go"}, warned
    stats = call(load_config(cfg), "stats")
    assert (stats["parts"], stats["parts_released"]) == ({"in_flight": 0, "orphaned": 0}, 2), stats
    with tiercache.open(without_agent(cfg)) as cache:
        assert [v.id for v in cache.versions()] == [v1]  # step 2 was never committed


def test_kept_parts_stay_in_node_ram_while_saves_need_room_and_go_when_a_save_could_never_fit(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """A 4 MiB arena keeps two orphaned parts (~1 MiB), pinned: saves that evict the read cache for room leave
    them; a 3.75 MiB save, which could never fit beside them, lets them go and goes on (it waited for ever)."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = {**agent_config(tmp_path, sock_dir, capacity="4MiB", shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agents(cfg)
    opts = {"broken": True, "stall": "group.parts"}  # the agent never learns which chunks it writes
    assert run_ranks_agent("orphan", tmp_path / "die", cfg, opts=opts) == [-signal.SIGKILL] * 2
    assert _wait_idle(cfg)["parts"] == {"in_flight": 0, "orphaned": 2}
    kept = call(load_config(cfg), "orphans")["orphans"]
    ids = sorted({c.id for o in kept for c in Version.from_json(o["manifest"].encode()).chunks})

    def held() -> list[bool]:
        return list(call(load_config(cfg), "holds", chunks=ids)["chunks"].values())

    assert len(ids) >= 4 and all(held())
    with tiercache.open(cfg) as cache, ThreadPoolExecutor(1) as pool:
        for step in range(3):  # 1.5 MiB each: room comes from evicting the read cache, oldest first
            x = torch.randn(3 << 17, generator=torch.Generator().manual_seed(step))
            cache.save({"x": x}, step=step, branch="other").wait("durable")
        assert all(held()), "node RAM evicted chunks of a kept part"
        x = torch.randn(30 << 15, generator=torch.Generator().manual_seed(5))  # 30 chunks of 128 KiB
        saving = pool.submit(lambda: cache.save({"x": x}, step=3, branch="other").wait("durable"))
        vid = saving.result(60)
        assert torch.equal(cache.restore(vid)["x"], x)
    stats = call(load_config(cfg), "stats")
    assert (stats["parts"]["orphaned"], stats["parts_released"]) == (0, 2), stats


def test_a_version_a_rank_never_saved_is_not_adopted_the_restart_warns_once_and_the_agent_lets_it_go(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any
) -> None:
    """Rank 1 dies before its save() of step 2; rank 0's part of it is kept, then never adoptable.

    The restarted ranks each log one WARNING naming the version and the rank whose part is
    missing, restore step 1 bit-exact, and the agent releases rank 0's part: ``agent status``
    says so instead of counting it as orphaned forever.
    """
    from test_multirank import rank_out

    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agents(cfg)
    codes = run_ranks_agent("one_rank_short", tmp_path / "die", cfg, opts={"broken": True, "timeout": 8})
    assert codes == [0, -signal.SIGKILL]
    died = rank_out(tmp_path / "die", 0)
    v1, v2 = died["v1"], died["v2"]
    assert died["v2_part_chunks"] > 0 and died["v2_levels"]["durable"][0] in ("GroupBrokenError", "GroupSaveError")
    stats = _wait_idle(cfg)
    assert (stats["parts"], stats["parts_released"]) == ({"in_flight": 0, "orphaned": 1}, 0), stats
    assert run_ranks_agent("adopt_warns", tmp_path / "again", cfg) == [0, 0]
    for r in range(2):
        out = rank_out(tmp_path / "again", r)
        assert (out["head"], out["restored_equal"], out["again_equal"]) == (v1, True, True), out
        assert len(out["warnings"]) == 1, out["warnings"]
        assert f"cannot adopt 1 version(s) of 'main' left in node RAM: {v2} (step 2): rank(s) 1 hold no part " \
               "of it" in out["warnings"][0] and "restoring the committed head instead" in out["warnings"][0], out
    stats = call(load_config(cfg), "stats")
    assert (stats["parts"], stats["parts_released"]) == ({"in_flight": 0, "orphaned": 0}, 1), stats
    spec = tmp_path / "cfg.toml"
    spec.write_text(_toml(cfg))
    status = CliRunner().invoke(app, ["--config", str(spec), "agent", "status"])
    assert "group parts: 0 in flight, 0 orphaned" in status.output and "1 released (could never be adopted)" \
        in status.output, status.output


def _acked(work: Path, world: int, word: str) -> int:
    """The newest step every rank noted ``word`` for (0: none)."""
    per_rank = []
    for r in range(world):
        path = work / f"acks{r}.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        per_rank.append({int(step) for w, step, _ in (line.split() for line in lines) if w == word})
    common = set.intersection(*per_rank)
    return max(common, default=0)


def test_a_group_through_agents_killed_at_random_moments_loses_nothing_saved(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, slow: bool
) -> None:
    """The whole job (and in some trials its agent) SIGKILLed at random moments; the restart restores.

    Every trial: two ranks save steps on a branch of their own through the node agent and die
    together at a random moment; in every third trial the agent is SIGKILLed too, at another
    random moment (the trainers then finish in process). The restarted job restores the branch
    bit-exact on every rank, and never a step older than the newest one every rank's ``save()``
    returned for (the agent lived: it adopts what it holds) or acknowledged ``local`` (it died).
    Trials: 3 per CI run, 30 with ``--slow``.
    """
    import random

    rng = random.Random(1234)
    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agent = agents(cfg)
    trials = 30 if slow else 3
    adopted = 0
    for trial in range(trials):
        work = tmp_path / f"t{trial}"
        kill_agent = trial % 3 == 2
        opts = {"branch": f"t{trial}", "steps": 4, "kill_after": rng.randint(1, 4), "delay": rng.uniform(0, 0.3),
                "broken": True}
        timer = None
        if kill_agent:
            timer = threading.Timer(rng.uniform(0.2, 1.5), agent.kill)
            timer.start()
        codes = run_ranks_agent("chaos", work, cfg, opts=opts)
        if timer is not None:
            timer.join()
        assert codes == [-signal.SIGKILL] * 2, (trial, codes)
        saved, local = _acked(work, 2, "saved"), _acked(work, 2, "local")
        if agent.proc.poll() is not None:
            agent = agents(cfg)  # the operator's restart: it sweeps the dead agent's arena
        restart = tmp_path / f"r{trial}"
        assert run_ranks_agent("chaos_restore", restart, cfg, opts={"branch": f"t{trial}"}) == [0, 0], trial
        from test_multirank import rank_out

        outs = [rank_out(restart, r) for r in range(2)]
        assert outs[0]["vid"] == outs[1]["vid"] and outs[0]["step"] == outs[1]["step"], (trial, outs)
        assert all(o["equal"] for o in outs), (trial, outs)
        floor = local if kill_agent else saved
        assert outs[0]["step"] >= floor, (trial, opts, saved, local, outs)
        adopted += outs[0]["step"] > local
    if not slow:
        return
    assert adopted > 0  # over 30 trials some restart adopted a version the group had not committed


@pytest.mark.parametrize("fault", ["kill", "sleep:10"])
def test_a_rank_that_dies_or_stalls_while_adopting_fails_the_restore_alike(
    tmp_path: Path, sock_dir: Path, shm_dir: Path, agents: Any, fault: str
) -> None:
    """The restarted group's adoption: one rank dies (or stalls past the timeout) reading its part back."""
    from test_multirank import rank_out

    cfg = {**agent_config(tmp_path, sock_dir, shm_dir=str(shm_dir)), "chunk_bytes": "128KiB"}
    agents(cfg)
    codes = run_ranks_agent("orphan", tmp_path / "die", cfg, opts={"broken": True})
    assert codes == [-signal.SIGKILL] * 2
    v1, v2 = rank_out(tmp_path / "die", 0)["v1"], rank_out(tmp_path / "die", 0)["v2"]
    codes = run_ranks_agent("adopt_fault", tmp_path / "fault", cfg,
                            opts={"fault": fault, "timeout": 3, "broken": fault == "kill"})
    outs = [rank_out(tmp_path / "fault", r) for r in range(2) if (tmp_path / "fault" / f"rank{r}.json").exists()]
    if fault == "kill":
        assert codes == [0, -signal.SIGKILL]
        kind, message = outs[0]["error"]  # rank 0 learns it in that restore, the rank named
        assert kind in ("GroupBrokenError", "GroupSaveError") and "rank 1" in message, outs[0]
        assert outs[0]["head"] == v1  # nothing was adopted
    else:  # the group timed out on the stalled rank (10 s against 3 s, so the restore's next
        # exchange times out too): both ranks fail the restore alike, naming it
        assert codes == [0, 0]
        assert outs[0]["error"] == outs[1]["error"] and outs[0]["error"][0] == "GroupSaveError", outs
        assert "rank 1 did not answer within 3s" in outs[0]["error"][1]
        assert outs[0]["head"] == outs[1]["head"] == v1  # nothing was adopted
    # Nothing was lost: the next restart adopts the version.
    assert run_ranks_agent("adopt", tmp_path / "restart", cfg) == [0, 0]
    assert all(rank_out(tmp_path / "restart", r)["head"] == v2 for r in range(2))
