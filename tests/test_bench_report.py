"""The bench's verdicts: which limit a target is measured against, and the ratio it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.report import Row, Verdict, evaluate


def _verdict(rows: list[Row], key: str) -> Verdict:
    return next(v for v in evaluate(rows) if v.target.row == key)


def test_time_to_local_uses_the_paired_raw_write_when_measured() -> None:
    rows = [
        Row("odirect.write", "raw", "limit", runs=[0.60, 0.61, 0.62]),
        Row("odirect.write_paired", "raw paired", "limit", runs=[1.00, 0.90, 1.10]),
        Row("tc.local", "local", "tiercache", runs=[1.05, 1.00, 1.20]),
    ]
    v = _verdict(rows, "tc.local")
    assert v.limit_key == "odirect.write_paired"
    assert v.limit_ratio == pytest.approx(1.05 / 1.00)
    assert v.met is True


def test_time_to_local_falls_back_to_the_raw_write_group() -> None:
    rows = [
        Row("odirect.write", "raw", "limit", runs=[0.80]),
        Row("tc.local", "local", "tiercache", runs=[1.00]),
    ]
    v = _verdict(rows, "tc.local")
    assert v.limit_key == "odirect.write"
    assert v.limit_ratio == pytest.approx(1.25)
    assert v.met is False


def test_ram_restore_uses_the_paired_memcpy_when_measured() -> None:
    rows = [
        Row("memcpy", "memcpy", "limit", runs=[0.18, 0.19, 0.20]),
        Row("memcpy_paired", "memcpy paired", "limit", runs=[0.25, 0.24, 0.26, 0.30, 0.23]),
        Row("tc.restore_ram", "ram", "tiercache", runs=[0.27, 0.26, 0.28, 0.25, 0.30]),
    ]
    v = _verdict(rows, "tc.restore_ram")
    assert v.limit_key == "memcpy_paired"
    assert v.limit_ratio == pytest.approx(0.27 / 0.25)
    assert v.met is True
    alone = _verdict([rows[0], rows[2]], "tc.restore_ram")
    assert (alone.limit_key, alone.met) == ("memcpy", False)
    assert alone.limit_ratio == pytest.approx(0.27 / 0.19)


def test_a_target_without_its_limit_has_no_verdict() -> None:
    v = _verdict([Row("tc.save_wait", "wait", "tiercache", runs=[0.2])], "tc.save_wait")
    assert (v.limit_key, v.limit_ratio, v.met) == (None, None, None)


def test_the_paired_commit_check_prints_its_medians(tmp_path: Path) -> None:
    # bench/regress.py as docs/benchmarks.md runs it, on a tiny state: one JSON line of medians.
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "regress.py"), "--label", "here", "--size", str(1 << 20),
         "--saves", "2", "--restores", "2", "--dir", str(tmp_path)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120, check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["label"] == "here"
    assert set(figures) == {"label", "save_wait_s", "to_local_s", "restore_into_cold_s", "memcpy_s"}
    assert all(figures[k] > 0 for k in figures if k.endswith("_s"))
    assert figures["save_wait_s"] <= figures["to_local_s"]
    assert list(tmp_path.iterdir()) == []  # the disk tier is removed afterwards


def test_the_paired_check_alternates_which_side_goes_first_and_tables_the_ratios() -> None:
    from bench.regress import paired_runs, table

    order: list[str] = []

    def side(name: str, figures: list[tuple[float, float, float]]) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            order.append(name)
            wait, local, cold = figures.pop(0)
            return {"save_wait_s": wait, "to_local_s": local, "restore_into_cold_s": cold}
        return run

    runs = paired_runs(3, side("base", [(0.030, 0.150, 0.200), (0.040, 0.160, 0.300), (0.035, 0.140, 0.250)]),
                       side("this", [(0.033, 0.150, 0.220), (0.040, 0.120, 0.300), (0.035, 0.154, 0.200)]))
    assert order == ["base", "this", "this", "base", "base", "this"]
    assert table("22bf048", "c44", runs).splitlines() == [
        "| figure | 22bf048 | c44 | c44 / 22bf048 (per pair) |",
        "|---|---|---|---|",
        "| `save()`: training waits | 35 (30-40) ms | 35 (33-40) ms | 1.00x (1.00x-1.10x) |",
        "| save until local (disk) | 150 (140-160) ms | 150 (120-154) ms | 1.00x (0.75x-1.10x) |",
        "| restore from disk into existing tensors, cold | 250 (200-300) ms | 220 (200-300) ms | 1.00x (0.80x-1.10x) |",
    ]


def test_the_base_of_the_paired_check_is_a_worktree_removed_afterwards() -> None:
    from bench.regress import base_worktree

    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with base_worktree(root, "HEAD") as tree:
        assert (tree / "bench" / "regress.py").is_file()
        assert subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() == head
        listed = subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True, text=True,
                                check=True).stdout
        assert str(tree) in listed
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True, text=True,
                            check=True).stdout
    assert str(tree) not in listed
