"""Helpers for the node agent's tests: a real agent process, and configs that use it.

An :class:`AgentProcess` is ``python -m tiercache agent --spec-fd 0`` (the config on its stdin) run
from the repository root (so it runs this checkout's code), as an operator or a sidecar would run
it. Its socket lives in a short directory of its own (a Unix socket path has at most 107 bytes,
and pytest's tmp paths can be longer than that).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiercache.agent.client import listening

ROOT = Path(__file__).resolve().parents[1]


def short_dir() -> Path:
    """A fresh directory with a short path, for agent sockets."""
    return Path(tempfile.mkdtemp(prefix="tca-", dir="/tmp"))


def remove_dir(d: Path) -> None:
    """Remove a flat directory and its files."""
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@contextlib.contextmanager
def shm_place(prefix: str = "tca") -> Iterator[Path]:
    """A directory of its own in /dev/shm for arenas (sweeps never see the machine's others), removed after."""
    d = Path("/dev/shm") / f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    try:
        yield d
    finally:
        remove_dir(d)


def agent_config(root: Path, sock_dir: Path, *, capacity: str = "32MiB", s3: dict[str, Any] | None = None,
                 **agent: Any) -> dict[str, Any]:
    """A config with a RAM arena, a disk tier at ``root/disk`` (and S3 if given) and an ``[agent]`` table."""
    cfg: dict[str, Any] = {
        "ram": {"capacity": capacity},
        "disk": {"path": str(root / "disk")},
        "policy": {"name": "write-through"},
        "pack_below": "4KiB",
        "agent": {"socket": str(sock_dir / "a.sock"), "start": "never", "idle_exit": 0, **agent},
    }
    if s3 is not None:
        cfg["s3"] = s3
    return cfg


def without_agent(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same cache, opened without its agent (what a process that never heard of it sees)."""
    return {k: v for k, v in cfg.items() if k != "agent"}


class AgentProcess:
    """A node agent run in the foreground by the test, as an operator would run it.

    Args:
        cfg: The cache config (with its ``[agent]`` table).
        log: Where its stderr goes.
        env: Extra environment (``TIERCACHE_FAILPOINTS``...).
    """

    def __init__(self, cfg: dict[str, Any], log: Path, env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.sock = Path(cfg["agent"]["socket"])
        self.log = log
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen([sys.executable, "-m", "tiercache", "agent", "--spec-fd", "0"],
                                     cwd=ROOT, env=full_env, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=log.open("ab"))
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(json.dumps(cfg).encode())
        self.wait_listening()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not listening(self.sock):
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"agent exited {code}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent did not listen: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM it (it finishes what it holds first) and wait; return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()  # leave no agent behind, then fail
            raise

    def kill(self) -> None:
        """SIGKILL it, as a crash would, and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
