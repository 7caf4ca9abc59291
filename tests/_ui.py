"""Helpers for the UI tests: ``tiercache ui`` in a process of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ui_process(cfg: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``tiercache ui`` in a process; returns it and the URL it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    proc = subprocess.Popen([sys.executable, "-m", "tiercache", "--config", str(cfg), "ui", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"serving (http://\S+)", line)
    assert match, line + proc.stdout.read() if proc.poll() is not None else line
    return proc, match.group(1)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
