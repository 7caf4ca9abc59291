"""A real agent under a flood on both its ports: it goes on serving its trainers, bit-exact.

The agent runs as an operator runs it (tests/_agent.py), with a soft limit of 256 fds, the
common limit's quarter: a stranger floods its peer port (idle connections far beyond its cap,
junk, forged and slow frames), then the node's own sockets run it out of fds. A trainer saves
and restores through it during the first and after the second, and another agent's hello still
gets through. (The cases one by one, in process: tests/test_peer_port_fuzz.py.)
"""

from __future__ import annotations

import contextlib
import random
import resource
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.agent.client import call
from tiercache.agent.peerwire import ACK, HELLO, Frame, PeerKey
from tiercache.config import load_config
from tiercache.errors import AgentUnavailableError

sys.path.insert(0, str(Path(__file__).parent))
from _agent import AgentProcess, agent_config, remove_dir, shm_place, short_dir
from _crash_child import state_for

FDS = 256
KEY = "5a" * 32


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[AgentProcess, dict[str, Any]]]:
    sock_dir = short_dir()
    try:
        with shm_place() as shm:
            cfg = agent_config(tmp_path, sock_dir, shm_dir=str(shm))
            proc = AgentProcess(cfg, tmp_path / "agent.log")
            try:
                _, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
                resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (FDS, hard))
                yield proc, cfg
                assert proc.stop() == 0
            finally:
                if proc.proc.poll() is None:
                    proc.kill()
    finally:
        remove_dir(sock_dir)


def _save_and_restore(cfg: dict[str, Any], pid: int, step: int) -> None:
    """A trainer's save and restore, through the agent (its stats say so), bit-exact."""
    with tiercache.open(cfg) as cache:
        vid = cache.save(state_for(step), step=step).wait("local")
        got = cache.restore(vid)
        stats = cache.stats()
    assert stats["agent"]["pid"] == pid, stats.get("agent")
    want = state_for(step)
    assert got["step"] == step
    for k in ("w", "v", "b"):
        assert torch.equal(got[k], want[k]), f"{k} of step {step} is not bit-exact"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def _peer_hello(endpoint: tuple[str, int]) -> bool:
    """Whether the agent's peer port answers a hello sealed with the job's key."""
    with socket.create_connection(endpoint, timeout=20) as s:
        s.sendall(PeerKey(KEY).seal(Frame(HELLO, b"\0" * 16, 0)))
        return s.recv(1) == ACK


def test_a_flooded_agent_goes_on_serving_its_trainers_and_peers(agent: Any) -> None:
    proc, cfg = agent
    config = load_config(cfg)
    # A rank of the job asks where its agent takes peer copies, and hands it the job's key.
    endpoint = tuple(call(config, "peer_port", host="127.0.0.1", key=KEY)["endpoint"])
    # Absurd numbers from a client of the node: one clear error each, nothing hangs.
    for bad, want in [({"within": -1}, "within must be seconds"), ({"rank": 1e300}, "rank must be an integer"),
                      ({"slots": [[0, 0, "c", 1 << 60, 0, [1]]]}, "nbytes must be an integer")]:
        msg = {"vid": "v", "rank": 0, "tier": "disk", "slots": [], "token": "ab" * 16, "key": KEY, "endpoints": {},
               "within": 5, **bad}
        with pytest.raises(Exception, match=want):
            call(config, "peer_copy", **msg)
    rss = _rss(proc.pid)

    # 1. A stranger on the network: idle connections far beyond the cap, junk, slow senders.
    rng = random.Random(7)
    stop = threading.Event()

    def slow() -> None:
        with contextlib.suppress(OSError), socket.create_connection(endpoint) as s:
            while not stop.wait(0.05):
                s.sendall(bytes([rng.randrange(256)]))

    slowpokes = [threading.Thread(target=slow) for _ in range(8)]
    for t in slowpokes:
        t.start()
    idle: list[socket.socket] = []
    try:
        for i in range(600):
            s = socket.create_connection(endpoint, timeout=20)
            if i % 3 == 0:  # junk of any length, or a header's worth with a forged MAC
                with contextlib.suppress(OSError):
                    s.sendall(rng.randbytes(rng.choice([1, 105, 4096])))
            idle.append(s)
        _save_and_restore(cfg, proc.pid, 1)
        assert _peer_hello(endpoint)
        assert _rss(proc.pid) - rss < 64 << 20  # no thread, no buffer per connection
    finally:
        stop.set()
        for s in idle:
            s.close()
        for t in slowpokes:
            t.join(30)

    # 2. The node's own sockets take every fd the agent has: both accept loops fail, and go on.
    local: list[socket.socket] = []
    peers: list[socket.socket] = []
    try:
        for _ in range(2 * FDS):
            s = _unix_connect(cfg["agent"]["socket"])
            if s is None:  # its backlog stays full: the agent accepts no more
                break
            local.append(s)
        for _ in range(8):
            with contextlib.suppress(OSError):
                peers.append(socket.create_connection(endpoint, timeout=0.5))
        _wait_for_log(proc, "the agent could not take a connection")
        _wait_for_log(proc, "the peer port could not take a connection")
    finally:
        for s in local + peers:
            s.close()
    _answers_again(config)
    _save_and_restore(cfg, proc.pid, 2)
    assert _peer_hello(endpoint)
    assert proc.proc.poll() is None
    assert "Traceback" not in proc.log.read_text()


def _wait_for_log(proc: AgentProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log.read_text():
        assert time.monotonic() < deadline, f"the agent never logged {text!r}: {proc.log.read_text()[-2000:]}"
        time.sleep(0.05)


def _unix_connect(path: str, within: float = 2.0) -> socket.socket | None:
    """A connection to the agent's socket, or ``None`` if its backlog stays full for ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:  # the backlog is full (a Unix socket says so at once)
            s.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
            continue
        s.setblocking(True)
        return s


def _answers_again(config: Any, within: float = 60.0) -> None:
    """Until the agent answers a request (it takes what the flood left in its backlog first)."""
    deadline = time.monotonic() + within
    while True:
        try:
            call(config, "stats", timeout=10)
            return
        except AgentUnavailableError:
            assert time.monotonic() < deadline, "the agent never took connections again"
            time.sleep(0.1)
