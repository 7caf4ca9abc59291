"""The command line's start-up: ``tiercache --help`` and ``tiercache ls`` in fresh processes.

Both are timed as a user runs them (a new interpreter each time) next to a bare interpreter's
start (``python -c pass``). Commands that do not move tensors never import torch, so their
start-up is the interpreter, the CLI libraries (typer, rich) and, for ``ls``, pydantic and the
disk tier; the budgets are 0.3 s and 0.5 s on a disk-only cache.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

import tiercache
from bench.report import Row, measure, progress

CLI_GROUPS = ("cli",)

#: Start-up budgets, seconds (issue 25): rows the targets compare the measured ones with.
HELP_BUDGET_S = 0.3
LS_BUDGET_S = 0.5
_VERSIONS = 20


def _timed(*args: str, cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - t0


def run_cli(work: Path, *, repeat: int) -> list[Row]:
    """Time a bare interpreter, ``tiercache --help`` and ``tiercache ls`` (a disk cache of 20 versions)."""
    progress("cli")
    root = work / "cli"
    root.mkdir()
    (root / "tiercache.toml").write_text(f'[disk]\npath = "{root / "cache"}"\n')
    with tiercache.open(root / "tiercache.toml") as cache:
        for step in range(_VERSIONS):
            cache.save({"w": torch.full((1024,), float(step))}, step=step).wait("local")
    repeat = max(repeat, 5)  # a start-up is short and noisy: more runs for the median
    rows = [
        measure(Row("python.startup", "python -c pass", "limit"), repeat, lambda: _timed("-c", "pass", cwd=root)),
        Row("cli.help_budget", "budget: --help", "limit", runs=[HELP_BUDGET_S]),
        Row("cli.ls_budget", "budget: ls", "limit", runs=[LS_BUDGET_S]),
        measure(Row("tc.cli_help", "tiercache --help", "tiercache"), repeat,
                lambda: _timed("-m", "tiercache", "--help", cwd=root)),
        measure(Row("tc.cli_ls", f"tiercache ls ({_VERSIONS} versions, disk)", "tiercache"), repeat,
                lambda: _timed("-m", "tiercache", "ls", cwd=root)),
    ]
    return rows
