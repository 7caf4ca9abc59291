"""Refs mean what a git user expects: rollback goes back within history, NAME@STEP resolves within it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app
from tiercache.errors import AmbiguousRefError, InvalidArgumentError, VersionNotFoundError


def _save(cache: tiercache.TierCache, step: int, branch: str = "main") -> str:
    return cache.save({"w": torch.full((4,), float(step))}, step=step, branch=branch).wait("local")


def test_rollback_moves_only_back_within_the_branchs_history_unless_reset(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as cache:
        a, b, c = (_save(cache, s) for s in (1, 2, 3))
        cache.branch("ft", b)
        f = _save(cache, 10, "ft")
        with pytest.raises(InvalidArgumentError, match=(
                rf"^rollback main: 'ft' \(version {f}\) is not in main's history, so moving there is not a "
                r"rollback: give a version of `tiercache log main`, or move the branch anyway with reset "
                r"\(tiercache rollback --reset\)$")):
            cache.rollback("main", "ft")
        assert cache.resolve("main") == c
        assert cache.rollback("main", "main~2") == a
        with pytest.raises(InvalidArgumentError, match=rf"^rollback main: {c!r} \(version {c}\) is not in"):
            cache.rollback("main", c)  # "back" to a newer version is not back
        assert cache.rollback("main", c, reset=True) == c  # explicit: anywhere
        assert cache.rollback("main", "main") == c  # the head itself: a no-op move
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[disk]\npath = "{tmp_path / "d"}"\n')
    out = CliRunner().invoke(app, ["--config", str(cfg), "rollback", "main", "ft"])
    assert out.exit_code == 2 and out.output.startswith("error: rollback main: 'ft' (version ")
    out = CliRunner().invoke(app, ["--config", str(cfg), "rollback", "main", "ft", "--reset"])
    assert out.exit_code == 0, out.output
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as cache:
        assert cache.resolve("main") == f


def test_name_at_step_resolves_within_history_and_a_short_prefix_is_ambiguous(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as cache:
        a, b, c = (_save(cache, s) for s in (1, 2, 3))
        cache.rollback("main", a)
        d = _save(cache, 4)
        assert cache.resolve("main@1") == a and cache.resolve("main@4") == d
        with pytest.raises(VersionNotFoundError, match=(
                rf"^'main@2': step 2 is not in main's history \(a rollback or resume left it behind\): name the "
                rf"version by id \({b}\), see `tiercache log --reflog main`$")):
            cache.resolve("main@2")
        assert cache.resolve(b) == b  # by id it is still there
        prefix = a[:2]
        with pytest.raises(AmbiguousRefError, match=(
                rf"^'{prefix}' is ambiguous: it matches 4 version\(s\) \({a}, {b}, {c}, \.\.\.\): give at least 4 "
                "characters of the id$")):
            cache.resolve(prefix)


def test_ls_marks_a_rolled_back_version_as_log_graph_does(tmp_path: Path) -> None:
    import json

    with tiercache.open({"disk": {"path": str(tmp_path / "d")}}) as cache:
        a, b = (_save(cache, s) for s in (1, 2))
        cache.rollback("main", a)
    out = CliRunner().invoke(app, ["--disk", str(tmp_path / "d"), "ls"])
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert "(rolled back)" in rows[b[:10]] and "(rolled back)" not in rows[a[:10]]
    listed = json.loads(CliRunner().invoke(app, ["--disk", str(tmp_path / "d"), "ls", "--json"]).stdout)
    assert [(v["id"], v["rolled_back"]) for v in listed] == [(a, False), (b, True)]
    graph = CliRunner().invoke(app, ["--disk", str(tmp_path / "d"), "log", "--graph"]).stdout
    assert "[rolled back: not in main's history]" in next(line for line in graph.splitlines() if b[:10] in line)
