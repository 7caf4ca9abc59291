"""Child processes for the crash and multi-writer tests (run as a script, never imported by pytest).

Run as a script it is a fork server (:class:`ForkServer` starts it): it imports torch and
tiercache once, then reads one JSON list of child specs per line on stdin, forks one child per
spec, prints ``pid <pid>...``, waits for them and prints ``exit <code>...``. Forking from a warm
interpreter makes a child cost milliseconds instead of the seconds a fresh ``import torch`` takes,
so CI can afford 100 kills. The server itself never starts a thread or runs a torch op, so forking
it is safe. A child spec's ``mode`` picks what the child does:

``loop``
    :func:`save_loop`: save forever, acknowledging each level reached, until killed.
``commits``
    :func:`commits`: land a number of commits on a branch shared with other writers, retrying
    after each ``ConflictError``; all writers start when the ``go`` file appears.
``gc``
    :func:`collect`: run ``gc`` with the spec's failpoints armed.

The state of a step is a pure function of the step (:func:`state_for`), so the parent can check
any restored version bit-exact without the child telling it the bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

import tiercache
from tiercache import failpoints
from tiercache.errors import ConflictError
from tiercache.tiers import s3 as s3_tier


def state_for(step: int, big: int = 0) -> dict[str, Any]:
    """The deterministic state saved at ``step`` (``big`` extra float32 elements in ``"big"``)."""
    out: dict[str, Any] = {
        "w": torch.arange(4096, dtype=torch.float32) * 0.5 + step,
        "v": torch.full((2048,), float(step), dtype=torch.float64),
        "b": torch.tensor([step, -step, 7], dtype=torch.int64),
        "step": step,
    }
    if big:
        out["big"] = torch.arange(big, dtype=torch.float32) + step
    return out


def config_for(spec: dict[str, Any]) -> dict[str, Any]:
    """The cache config of a trial: a disk tier at ``root``, optionally an S3 tier."""
    cfg: dict[str, Any] = {
        "ram": {"capacity": "16MiB", "serve_reads": False},
        "disk": {"path": spec["root"]},
        "policy": {"name": "write-through"},
        "pack_below": "4KiB",
    }
    if spec.get("s3"):
        cfg["s3"] = spec["s3"]
    if spec.get("agent"):  # the node agent's crash tests (test_agent_crash.py)
        cfg["agent"] = spec["agent"]
    if "reflog_keep" in spec:
        cfg["reflog_keep"] = spec["reflog_keep"]
    return cfg


def _ack(fd: int, step: int, vid: str, level: str) -> None:
    os.write(fd, f"{step} {vid} {level}\n".encode())
    os.fsync(fd)


def save_loop(spec: dict[str, Any]) -> None:
    """Save ``state_for(first_step + i)`` for i = 0, 1, ... and acknowledge each level reached.

    An acknowledgement line (``step version level``) is appended and fsynced only after
    ``handle.wait(level)`` returned, so every line is a promise the parent may hold us to.
    """
    failpoints.configure(spec.get("failpoints"))
    os.environ.update(spec.get("env", {}))  # the S3 credentials of the test server
    levels = spec.get("levels") or (["local", "remote"] if spec.get("s3") else ["local"])
    fd = os.open(spec["ack"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with tiercache.open(config_for(spec)) as cache:
        for i in range(spec.get("max_saves", 1 << 30)):
            step = spec["first_step"] + i
            h = cache.save(state_for(step, spec.get("big", 0)), step=step)
            for level in levels:
                h.wait(level)
                _ack(fd, step, h.version, level)


def _child(spec: dict[str, Any]) -> None:
    """Body of one forked child: quiet stdout, stderr to the spec's log, run its mode, never return."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        err = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(err, 2)
        torch.set_num_threads(1)
        {"commits": commits, "gc": collect, "loop": save_loop}[spec["mode"]](spec)
    except BaseException as e:  # the parent reads the log; the status says it failed
        print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 3
    os._exit(code)


def serve() -> None:
    """Per line on stdin (a JSON list of child specs): fork them, print their pids, wait, print their exit codes."""
    # Parse botocore's S3 models once here (the S3 tier shares them across sessions): a client
    # is built without connecting or starting a thread, and each child skips ~0.7 s of JSON.
    s3_tier._new_session().create_client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")
    for line in sys.stdin:
        pids = []
        for spec in json.loads(line):
            pid = os.fork()
            if pid == 0:
                _child(spec)
            pids.append(pid)
        print("pid", *pids, flush=True)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print("exit", *codes, flush=True)


def commits(spec: dict[str, Any]) -> None:
    """Land ``count`` commits on ``branch``, retrying conflicts; write what landed and what did not to ``out``."""
    landed: list[str] = []
    conflicted: list[str] = []
    with tiercache.open({"disk": {"path": spec["root"]}, "policy": {"name": "write-through"}}) as cache:
        cache.refs()  # load the catalog before the race starts
        while not os.path.exists(spec["go"]):
            time.sleep(0.005)
        step = spec["writer"] * 100_000
        while len(landed) < spec["count"]:
            step += 1
            state = {"w": torch.full((256,), float(step)), "writer": spec["writer"]}
            h = cache.save(state, step=step, branch=spec["branch"])
            try:
                h.wait("local")
            except ConflictError:
                conflicted.append(h.version)
                continue
            landed.append(h.version)
    with open(spec["out"], "w") as fh:
        json.dump({"landed": landed, "conflicted": conflicted}, fh)


def collect(spec: dict[str, Any]) -> None:
    """Run ``gc`` (no grace period) on the cache of ``spec``, with its failpoints armed."""
    failpoints.configure(spec.get("failpoints"))
    with tiercache.open(config_for(spec)) as cache:
        cache.gc(grace=0)


class ForkServer:
    """The parent's handle on a ``serve`` process."""

    def __init__(self) -> None:
        # This checkout's tiercache first (a script's own directory, not the working directory,
        # starts sys.path: without this the children would run whatever tiercache is installed).
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def start(self, specs: list[dict[str, Any]]) -> list[int]:
        """Fork one child per spec; return their pids."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(specs) + "\n")
        self.proc.stdin.flush()
        word, *pids = self.proc.stdout.readline().split()
        assert word == "pid", word
        return [int(p) for p in pids]

    def reap(self) -> list[int]:
        """Wait until the children are gone; return their exit codes (``-9`` for SIGKILL)."""
        assert self.proc.stdout is not None
        word, *codes = self.proc.stdout.readline().split()
        assert word == "exit", word
        return [int(c) for c in codes]

    def close(self) -> None:
        """Stop the server (it exits at the end of its input)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


if __name__ == "__main__":
    serve()
