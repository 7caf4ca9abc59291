"""Tests of the ``tiercache`` command line against a real cache on a disk tier."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

import tiercache
from tiercache.cli import app, human_age, human_bytes, layout_graph, short_id_length
from tiercache.config import S3Config

# ---------------------------------------------------------------------------------------------
# The pure graph layout


def _render(nodes: list[tuple[str, str | None]]) -> list[str]:
    return [row.graph + (f" {row.node}" if row.node else "") for row in layout_graph(nodes)]


def test_graph_linear() -> None:
    assert _render([("v3", "v2"), ("v2", "v1"), ("v1", None)]) == ["* v3", "* v2", "* v1"]


def test_graph_one_branch_off_the_middle() -> None:
    # main v1 <- v2 <- v3 <- v4; ft f1 <- f2 forked from v2 after v3 was saved.
    nodes = [("f2", "f1"), ("v4", "v3"), ("f1", "v2"), ("v3", "v2"), ("v2", "v1"), ("v1", None)]
    assert _render(nodes) == [
        "* f2",
        "| * v4",
        "* | f1",
        "| * v3",
        "|/",
        "* v2",
        "* v1",
    ]


def test_graph_two_branches() -> None:
    # main m1 <- m2 <- m3; a forks from m1 (a1 <- a2), b forks from m2 (b1).
    nodes = [("a2", "a1"), ("m3", "m2"), ("b1", "m2"), ("a1", "m1"), ("m2", "m1"), ("m1", None)]
    assert _render(nodes) == [
        "* a2",
        "| * m3",
        "| | * b1",
        "| |/",
        "* | a1",
        "| * m2",
        "|/",
        "* m1",
    ]


def test_graph_rolled_back_branch() -> None:
    # main was v1 <- v2 <- v3, rolled back to v2, then v4 saved on it: v3 stays as a side line.
    nodes = [("v4", "v2"), ("v3", "v2"), ("v2", "v1"), ("v1", None)]
    assert _render(nodes) == ["* v4", "| * v3", "|/", "* v2", "* v1"]


def test_graph_join_passes_under_a_lane() -> None:
    # b's lane joins a's lane across y's lane, which continues to the root r.
    nodes = [("x", "a"), ("y", "r"), ("b", "a"), ("a", "r"), ("r", None)]
    assert _render(nodes) == ["* x", "| * y", "| | * b", "|_|/", "* | a", "|/", "* r"]


def test_graph_root_with_lanes_to_its_right_and_unknown_parent() -> None:
    # Unrelated histories, and a parent that is not shown (a root after a gap row).
    assert _render([("p2", "p1"), ("x", None), ("p1", None)]) == ["* p2", "| * x", "* p1"]
    assert _render([("x", None), ("p2", "p1"), ("p1", "gone")]) == ["* x", "* p2", "* p1", ":"]
    assert _render([("p1", "gone"), ("x", None)]) == ["* p1", ":", "* x"]
    assert _render([("a", "gone"), ("b", None), ("c", None)]) == ["* a", ":", "* b", "* c"]
    assert _render([("b", "a"), ("c", "gone"), ("a", None)]) == ["* b", "| * c", "| :", "* a"]
    assert _render([("p2", "p1"), ("y2", "y1"), ("p1", None), ("y1", None)]) == [
        "* p2",
        "| * y2",
        "* | p1",
        " /",
        "* y1",
    ]


def test_short_ids_are_ten_characters_or_as_long_as_a_listing_needs() -> None:
    assert short_id_length([]) == 10
    assert short_id_length(["01M85P4V9YAAAA", "01M85P4VBCAAAA"]) == 10
    # Saved in the same millisecond: the first 10 characters (the timestamp) are shared.
    assert short_id_length(["01M85P4VBCAAAX", "01M85P4VBCAAB0", "01M85P4VBCZZZZ"]) == 13
    assert short_id_length(["01M85P4VBCAAAX", "01M85P4VBCAAAX"]) == 10  # one id listed twice


def test_human_formats() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 512 << 20, 3 << 30, 5 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "512.0 MiB", "3.0 GiB", "5.0 TiB",
    ]
    now = datetime(2025, 1, 10, tzinfo=UTC)
    ages = [timedelta(seconds=-5), timedelta(seconds=42), timedelta(minutes=3, seconds=59),
            timedelta(hours=2, minutes=30), timedelta(days=5, hours=23)]
    assert [human_age(now - d, now) for d in ages] == ["0s", "42s", "3m", "2h", "5d"]


# ---------------------------------------------------------------------------------------------
# The command line against a real cache


@dataclass(frozen=True)
class _Repo:
    """A cache on a disk tier with main v1 <- v2 <- v3, branch ft from v2 (f1), tag best on v2."""

    config: Path
    v1: str
    v2: str
    v3: str
    f1: str
    states: dict[str, dict[str, object]]


def _state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.arange(32, dtype=torch.int64) + seed},
        "optim": {"lr": 0.1 * seed, "betas": [0.9, 0.999]},
        "step": seed,
    }


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Repo:
    monkeypatch.delenv("TIERCACHE_CONFIG", raising=False)
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[ram]\ncapacity = "64MiB"\n\n[disk]\npath = "{tmp_path / "store"}"\n')
    ids: dict[str, str] = {}
    states: dict[str, dict[str, object]] = {}
    with tiercache.open(config) as cache:
        for seed, name in enumerate(("v1", "v2", "v3"), start=1):
            states[name] = _state(seed)
            handle = cache.save(states[name], step=100 * seed, branch="main", meta={"loss": 1.0 / seed})
            handle.wait("local")
            ids[name] = handle.version
        cache.branch("ft", ids["v2"])
        states["f1"] = _state(4)
        handle = cache.save(states["f1"], step=210, branch="ft", meta={"loss": 0.25})
        handle.wait("local")
        ids["f1"] = handle.version
        cache.tag("best", ids["v2"])
    return _Repo(config=config, states=states, **ids)


def _run(repo: _Repo, *args: str) -> Result:
    return CliRunner().invoke(app, ["--config", str(repo.config), *args])


def _refs(repo: _Repo) -> dict[str, str]:
    with tiercache.open(repo.config) as cache:
        return cache.refs()


def _assert_one_line_error(result: Result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output


def _assert_state_equal(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            _assert_state_equal(got[key], want[key])
    else:
        assert got == want


def test_ls_json(repo: _Repo) -> None:
    result = _run(repo, "ls", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    with tiercache.open(repo.config) as cache:
        created = {v.id: v.created_at.isoformat() for v in cache.versions()}
    nbytes = 64 * 32 * 4 + 32 * 8
    expected = [
        (repo.v1, 100, "main", None, {"loss": 1.0}, []),
        (repo.v2, 200, "main", repo.v1, {"loss": 0.5}, ["tag/best"]),
        (repo.v3, 300, "main", repo.v2, {"loss": 1.0 / 3}, ["branch/main"]),
        (repo.f1, 210, "ft", repo.v2, {"loss": 0.25}, ["branch/ft"]),
    ]
    assert rows == [
        {
            "id": vid, "step": step, "branch": branch, "parent": parent, "created_at": created[vid],
            "nbytes": nbytes, "meta": meta, "tiers": ["disk"],
            "states": {"disk": {"state": "held", "reason": "", "at": None}}, "refs": refs, "rolled_back": False,
        }
        for vid, step, branch, parent, meta, refs in expected
    ]
    # --branch lists the branch's history (what `log ft` walks), oldest first, not the versions
    # whose branch field is ft.
    ft_history = json.loads(_run(repo, "ls", "--json", "--branch", "ft").stdout)
    assert [row["id"] for row in ft_history] == [repo.v1, repo.v2, repo.f1]
    main_history = json.loads(_run(repo, "ls", "--json", "--branch", "main").stdout)
    assert [row["id"] for row in main_history] == [repo.v1, repo.v2, repo.v3]


def test_ls_unknown_branch_is_bad_input(repo: _Repo) -> None:
    _assert_one_line_error(_run(repo, "ls", "--branch", "nope"), 2, "branch 'nope' does not exist",
                           "`tiercache branch nope --from REF`")
    # A tag is not a branch either.
    _assert_one_line_error(_run(repo, "ls", "--branch", "best"), 2, "branch 'best' does not exist")


def test_ls_table(repo: _Repo) -> None:
    result = _run(repo, "ls")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    # The config has a [ram] table, but a CLI process has no lasting RAM tier: no column for it.
    assert lines[0].split() == ["id", "step", "branch", "size", "age", "refs", "disk"]
    body = [line.split() for line in lines[1:]]
    assert [row[:3] for row in body] == [
        [repo.v1[:10], "100", "main"],
        [repo.v2[:10], "200", "main"],
        [repo.v3[:10], "300", "main"],
        [repo.f1[:10], "210", "ft"],
    ]
    assert all(row[3:5] == ["8.2", "KiB"] for row in body)
    assert [row[6:] for row in body] == [["✓"], ["tag:", "best", "✓"], ["main", "✓"], ["ft", "✓"]]
    ft = _run(repo, "ls", "--branch", "ft").stdout.splitlines()
    assert [line.split()[:3] for line in ft[1:]] == [
        [repo.v1[:10], "100", "main"], [repo.v2[:10], "200", "main"], [repo.f1[:10], "210", "ft"],
    ]


def test_log_newest_first_with_parents(repo: _Repo) -> None:
    result = _run(repo, "log")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f'{repo.f1}  ft@210  parent {repo.v2}  meta {{"loss": 0.25}} (ft)',
        f'{repo.v3}  main@300  parent {repo.v2}  meta {{"loss": {1.0 / 3}}} (main)',
        f'{repo.v2}  main@200  parent {repo.v1}  meta {{"loss": 0.5}} (tag: best)',
        f'{repo.v1}  main@100  parent -  meta {{"loss": 1.0}}',
    ]
    ancestry = _run(repo, "log", "ft")
    assert [line.split()[0] for line in ancestry.stdout.splitlines()] == [repo.f1, repo.v2, repo.v1]


def test_log_graph(repo: _Repo) -> None:
    result = _run(repo, "log", "--graph")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"* {repo.f1[:10]} ft@210 (ft)",
        f"| * {repo.v3[:10]} main@300 (main)",
        "|/",
        f"* {repo.v2[:10]} main@200 (tag: best)",
        f"* {repo.v1[:10]} main@100",
    ]
    assert _run(repo, "log", "--graph", "main~1").stdout.splitlines() == [
        f"* {repo.v2[:10]} main@200 (tag: best)",
        f"* {repo.v1[:10]} main@100",
    ]


def _gapped(tmp_path: Path) -> tuple[Path, dict[int, str]]:
    """main@1..main@8, rolled back to main@6, then main@9; the manifests of main@3-5 deleted from the only tier."""
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "store"}"\n')
    with tiercache.open(config) as cache:
        ids = {s: cache.save({"w": torch.full((4,), float(s))}, step=s).wait("local") for s in range(1, 9)}
        cache.rollback("main", ids[6])
        ids[9] = cache.save({"w": torch.full((4,), 9.0)}, step=9).wait("local")
    for s in (3, 4, 5):
        (tmp_path / "store" / "versions" / f"{ids[s]}.json").unlink()
    return config, ids


def test_log_graph_marks_rolled_back_versions_and_gaps(tmp_path: Path) -> None:
    # Issue 47 item 8: what a rollback left behind is marked, and versions held by no tier leave a visible gap.
    config, ids = _gapped(tmp_path)
    out = CliRunner().invoke(app, ["--config", str(config), "log", "--graph"])
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == [
        f"* {ids[9][:10]} main@9 (main)",
        f"| * {ids[8][:10]} main@8 [rolled back: not in main's history]",
        f"| * {ids[7][:10]} main@7 [rolled back: not in main's history]",
        "|/",
        f"* {ids[6][:10]} main@6",
        f":  gap: main@6's parent {ids[5][:10]} is held by no tier (its tier is gone, or it was pruned); "
        "main@3 to main@5 missing (3 steps)",
        f"* {ids[2][:10]} main@2",
        f"* {ids[1][:10]} main@1",
    ]
    # REF and its ancestors: the chain stops at the gap, which still counts from main@2, listed but unreachable.
    chain = CliRunner().invoke(app, ["--config", str(config), "log", "--graph", "main"]).stdout.splitlines()
    assert chain == [
        f"* {ids[9][:10]} main@9 (main)",
        f"* {ids[6][:10]} main@6",
        f":  gap: main@6's parent {ids[5][:10]} is held by no tier (its tier is gone, or it was pruned); "
        "main@3 to main@5 missing (3 steps)",
    ]
    plain = CliRunner().invoke(app, ["--config", str(config), "log"]).stdout.splitlines()
    assert plain[1] == f"{ids[8]}  main@8  parent {ids[7]}  meta {{}}  [rolled back: not in main's history]"
    assert plain[3] == f"{ids[6]}  main@6  parent {ids[5]}  meta {{}}"


def test_gc_says_when_the_reflog_keeps_what_it_would_free(tmp_path: Path) -> None:
    config, ids = _gapped(tmp_path)
    cli = ["--config", str(config), "gc", "--dry-run", "--grace", "0"]
    report = json.loads(CliRunner().invoke(app, [*cli, "--json"]).stdout)
    with tiercache.open(config) as cache:
        first = min(m.at.timestamp() for m in cache.reflog() if m.why == "rollback") + cache.config.reflog_keep
    assert (report["versions"], report["kept_by_reflog"]) == ([], [ids[7], ids[8]])
    assert (report["reflog_keep"], report["reflog_expires"]) == (7 * 86400.0, first)
    when = datetime.fromtimestamp(first, UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert CliRunner().invoke(app, cli).stdout.splitlines()[-1] == (
        "the reflog keeps 2 version(s) no ref reaches (a rollback, resume or ref move left them behind less than "
        f"reflog_keep = 604800 s ago); the first becomes collectable at {when} UTC: set reflog_keep lower to "
        "collect them sooner")


def test_restore_to_file_and_directory(repo: _Repo, tmp_path: Path) -> None:
    out = tmp_path / "ckpt.pt"
    result = _run(repo, "restore", "best", "--out", str(out))
    assert result.exit_code == 0, result.output
    # The bytes read per source follow (a fresh process: from the disk).
    want = f"restored {repo.v2} (main@200) -> {out} (8.2 KiB; read 8.2 KiB from disk)\n"
    assert (result.stdout, result.stderr) == (want, "")
    with out.open("rb") as fh:
        _assert_state_equal(torch.load(fh, weights_only=True), repo.states["v2"])

    outdir = tmp_path / "outdir"
    outdir.mkdir()
    result = _run(repo, "restore", repo.f1[:12], "--out", str(outdir))
    assert result.exit_code == 0, result.output
    with (outdir / "state.pt").open("rb") as fh:
        _assert_state_equal(torch.load(fh, weights_only=True), repo.states["f1"])
    assert sorted(p.name for p in outdir.iterdir()) == ["state.pt"]


def test_restore_into_a_directory_named_with_a_trailing_slash(repo: _Repo, tmp_path: Path) -> None:
    outdir = tmp_path / "restored"
    # DIR/ names a directory: created if its parent exists, and the file goes inside it.
    result = _run(repo, "restore", "main", "--out", f"{outdir}/", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "version": repo.v3, "branch": "main", "step": 300, "path": str(outdir / "state.pt"), "nbytes": 8448,
        "read": {"disk": 8448},
    }
    assert sorted(p.name for p in outdir.iterdir()) == ["state.pt"]
    with (outdir / "state.pt").open("rb") as fh:
        _assert_state_equal(torch.load(fh, weights_only=True), repo.states["v3"])
    # Into the existing directory again: refused without --force, like any existing file.
    _assert_one_line_error(_run(repo, "restore", "best", "--out", f"{outdir}/"), 2, "state.pt already exists")
    # A missing parent, a file named with a trailing slash, or an unknown ref: nothing is created.
    _assert_one_line_error(_run(repo, "restore", "main", "--out", f"{tmp_path}/a/b/"), 2,
                           f"directory {tmp_path}/a does not exist")
    (tmp_path / "file.pt").write_bytes(b"keep")
    _assert_one_line_error(_run(repo, "restore", "main", "--out", f"{tmp_path}/file.pt/"), 2, "is a file")
    _assert_one_line_error(_run(repo, "restore", "nope", "--out", f"{tmp_path}/new/"), 2, "nope")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.pt", "restored", "store", "tiercache.toml"]
    assert (tmp_path / "file.pt").read_bytes() == b"keep"


def test_restore_refuses_to_overwrite_without_force(repo: _Repo, tmp_path: Path) -> None:
    out = tmp_path / "existing.pt"
    out.write_bytes(b"keep me")
    result = _run(repo, "restore", "main", "--out", str(out))
    _assert_one_line_error(result, 2, str(out), "--force")
    assert out.read_bytes() == b"keep me"

    result = _run(repo, "restore", "main", "--out", str(out), "--force")
    assert result.exit_code == 0, result.output
    with out.open("rb") as fh:
        _assert_state_equal(torch.load(fh, weights_only=True), repo.states["v3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.pt", "store", "tiercache.toml"]
    nowhere = tmp_path / "missing-dir" / "x.pt"
    result = _run(repo, "restore", "main", "--out", str(nowhere))
    _assert_one_line_error(result, 2, "missing-dir", "does not exist")


def test_branch_rollback_tag(repo: _Repo) -> None:
    result = _run(repo, "branch", "ft-lr3e-5", "--from", "main@100")
    assert (result.exit_code, result.stdout) == (0, f"branch ft-lr3e-5 -> {repo.v1} (main@100)\n")
    result = _run(repo, "rollback", "main", "main~1")
    assert (result.exit_code, result.stdout) == (0, f"rollback main -> {repo.v2} (main@200)\n")
    result = _run(repo, "tag", "first", repo.v1[:12])
    assert (result.exit_code, result.stdout) == (0, f"tag first -> {repo.v1} (main@100)\n")
    assert _refs(repo) == {
        "branch/main": repo.v2,
        "branch/ft": repo.f1,
        "branch/ft-lr3e-5": repo.v1,
        "tag/best": repo.v2,
        "tag/first": repo.v1,
    }


def test_ref_verbs_print_json(repo: _Repo) -> None:
    result = _run(repo, "branch", "ft2", "--from", "main@100", "--json")
    assert (result.exit_code, json.loads(result.stdout)) == (
        0, {"ref": "branch/ft2", "version": repo.v1, "branch": "main", "step": 100})
    result = _run(repo, "tag", "first", "ft2", "--json")
    assert (result.exit_code, json.loads(result.stdout)) == (
        0, {"ref": "tag/first", "version": repo.v1, "branch": "main", "step": 100})
    result = _run(repo, "rollback", "main", "main~2", "--json")
    assert (result.exit_code, json.loads(result.stdout)) == (
        0, {"ref": "branch/main", "version": repo.v1, "branch": "main", "step": 100})
    assert _refs(repo) == {"branch/main": repo.v1, "branch/ft": repo.f1, "branch/ft2": repo.v1,
                           "tag/best": repo.v2, "tag/first": repo.v1}


def test_existing_branch_or_tag_is_bad_input_with_cli_advice(repo: _Repo) -> None:
    _assert_one_line_error(_run(repo, "branch", "ft", "--from", "main"), 2,
                           f"branch 'ft' already exists (at {repo.f1})", "`tiercache rollback ft REF`")
    _assert_one_line_error(_run(repo, "tag", "best", "main"), 2,
                           f"tag 'best' already points at {repo.v2}", "tags never move")
    # Tagging the version the tag already names is a no-op, not an error.
    assert _run(repo, "tag", "best", "main~1").stdout == f"tag best -> {repo.v2} (main@200)\n"
    _assert_one_line_error(_run(repo, "rollback", "nope", "main"), 2, "branch 'nope' does not exist",
                           "`tiercache branch nope --from REF`")
    for result in (_run(repo, "branch", "ft", "--from", "main"), _run(repo, "rollback", "nope", "main")):
        assert "()" not in result.stderr  # no Python call suggested
    assert _refs(repo) == {"branch/main": repo.v3, "branch/ft": repo.f1, "tag/best": repo.v2}


def test_log_json(repo: _Repo) -> None:
    rows = json.loads(_run(repo, "log", "ft", "--json").stdout)
    assert [(r["id"], r["parent"], r["refs"]) for r in rows] == [
        (repo.f1, repo.v2, ["branch/ft"]), (repo.v2, repo.v1, ["tag/best"]), (repo.v1, None, []),
    ]
    assert rows == [row for row in json.loads(_run(repo, "ls", "--json").stdout)[::-1] if row["id"] in
                    (repo.f1, repo.v2, repo.v1)]
    _assert_one_line_error(_run(repo, "log", "--graph", "--json"), 2, "--graph", "--json")


def test_short_ids_in_listings_tell_versions_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Versions whose ids share their first 12 characters (as ids made in one millisecond share 10).
    ids = iter(f"01M85P4VBCXY{c}{'0' * 13}" for c in "ABC")
    monkeypatch.setattr("tiercache.pipeline.front.new_version_id", lambda: next(ids))
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "store"}"\n')
    with tiercache.open(config) as cache:
        for step in (1, 2, 3):
            cache.save({"w": torch.full((4,), float(step))}, step=step).wait("local")
    listing = CliRunner().invoke(app, ["--config", str(config), "ls"]).stdout.splitlines()
    assert [line.split()[0] for line in listing[1:]] == ["01M85P4VBCXYA", "01M85P4VBCXYB", "01M85P4VBCXYC"]
    graph = CliRunner().invoke(app, ["--config", str(config), "log", "--graph"]).stdout.splitlines()
    assert graph == ["* 01M85P4VBCXYC main@3 (main)", "* 01M85P4VBCXYB main@2", "* 01M85P4VBCXYA main@1"]


def test_evict_and_promote_json_on_disk_and_s3(tmp_path: Path, s3_config: S3Config, _s3_admin: Any) -> None:
    store = tmp_path / "store"
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{store}"\n\n[s3]\nurl = "{s3_config.url}"\n'
                      f'endpoint_url = "{s3_config.endpoint_url}"\nregion = "{s3_config.region}"\n')
    with tiercache.open(config) as cache:
        vid = cache.save(_state(7), step=7).wait("remote")
    on_disk = sum(p.stat().st_size for p in (store / "chunks").rglob("*") if p.is_file())
    listing = _s3_admin.list_objects_v2(Bucket=s3_config.bucket, Prefix=f"{s3_config.prefix}/chunks/")
    in_s3 = sum(obj["Size"] for obj in listing["Contents"])
    cli = ["--config", str(config)]
    evicted = CliRunner().invoke(app, [*cli, "evict", "main", "--from", "disk", "--json"])
    assert (evicted.exit_code, json.loads(evicted.stdout)) == (
        0, {"version": vid, "branch": "main", "step": 7, "tier": "disk", "bytes_freed": on_disk})
    assert json.loads(CliRunner().invoke(app, [*cli, "ls", "--json"]).stdout)[0]["tiers"] == ["s3"]
    promoted = CliRunner().invoke(app, [*cli, "promote", "main", "--to", "disk", "--json"])
    assert (promoted.exit_code, json.loads(promoted.stdout)) == (
        0, {"version": vid, "branch": "main", "step": 7, "tier": "disk", "bytes_copied": in_s3})
    assert json.loads(CliRunner().invoke(app, [*cli, "ls", "--json"]).stdout)[0]["tiers"] == ["disk", "s3"]


def test_promote_and_evict(repo: _Repo) -> None:
    # The disk already holds every chunk: nothing to copy.
    result = _run(repo, "promote", "main", "--to", "disk")
    assert (result.exit_code, result.stdout) == (0, f"promoted {repo.v3} (main@300) to disk: 0 B copied\n")
    _assert_one_line_error(_run(repo, "promote", "main", "--to", "nvme"), 2, "nvme")
    # The disk tier holds the only durable copy: refused at runtime, and the version survives.
    _assert_one_line_error(_run(repo, "evict", "main", "--from", "disk"), 1, "last durable copy")
    assert json.loads(_run(repo, "ls", "--json").stdout)[2]["tiers"] == ["disk"]


def test_ram_tier_moves_are_refused_from_the_cli(repo: _Repo) -> None:
    # The config has a [ram] table, but whatever a CLI process puts in its arena ends with it.
    for args, option in ((("promote", "main", "--to", "ram"), "promote --to ram"),
                         (("evict", "main", "--from", "ram"), "evict --from ram")):
        _assert_one_line_error(_run(repo, *args), 2, "a CLI process has no lasting RAM tier", f"`{option}`")


def test_unknown_ref_is_bad_input(repo: _Repo, tmp_path: Path) -> None:
    for args in (["restore", "nope", "--out", str(tmp_path / "x.pt")], ["log", "nope"], ["tag", "t", "nope"]):
        _assert_one_line_error(_run(repo, *args), 2, "nope")
    assert not (tmp_path / "x.pt").exists()
    assert "tag/t" not in _refs(repo)


def test_invalid_name_is_bad_input(repo: _Repo) -> None:
    _assert_one_line_error(_run(repo, "branch", "a/b", "--from", "main"), 2, "a/b")
    _assert_one_line_error(_run(repo, "tag", "../x", "main"), 2, "../x")
    assert set(_refs(repo)) == {"branch/main", "branch/ft", "tag/best"}


def test_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCACHE_CONFIG", raising=False)
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[disk]\npath = "{tmp_path}"\nio_threads = 0\n')
    runner = CliRunner()
    _assert_one_line_error(runner.invoke(app, ["--config", str(bad), "ls"]), 2, "disk.io_threads")
    missing = tmp_path / "missing.toml"
    _assert_one_line_error(runner.invoke(app, ["--config", str(missing), "ls"]), 2, str(missing))
    # Without --config, TIERCACHE_CONFIG names the file.
    result = runner.invoke(app, ["ls"], env={"TIERCACHE_CONFIG": str(bad)})
    _assert_one_line_error(result, 2, "disk.io_threads")


def test_config_from_working_directory(repo: _Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo.config.parent)
    result = CliRunner().invoke(app, ["ls", "--json"])
    assert result.exit_code == 0, result.output
    assert [row["id"] for row in json.loads(result.stdout)] == [repo.v1, repo.v2, repo.v3, repo.f1]


def test_debug_reraises(repo: _Repo) -> None:
    result = _run(repo, "--debug", "log", "nope")
    assert result.exit_code == 1
    assert isinstance(result.exception, tiercache.errors.VersionNotFoundError)


def test_usage_error_exits_2(repo: _Repo) -> None:
    assert _run(repo, "restore", "main").exit_code == 2


def test_python_m_end_to_end(repo: _Repo, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(tiercache.__file__).parent.parent)}
    cmd = [sys.executable, "-m", "tiercache", "--config", str(repo.config)]
    ok = subprocess.run([*cmd, "log", "--graph"], capture_output=True, text=True, env=env, check=False)
    assert (ok.returncode, ok.stdout.splitlines()[0]) == (0, f"* {repo.f1[:10]} ft@210 (ft)")
    bad = subprocess.run([*cmd, "restore", "nope", "--out", str(tmp_path / "o.pt")],
                         capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


def test_the_cli_finds_a_quickstart_cache_by_its_disk_and_reading_makes_no_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("TIERCACHE_CONFIG", "TIERCACHE_DISK__PATH", "TIERCACHE_S3__URL", "TIERCACHE_RAM__CAPACITY"):
        monkeypatch.delenv(var, raising=False)
    # Read-only commands on a directory where nothing was saved: an empty answer, no directory.
    for verb in (["ls"], ["log"], ["stats"], ["verify"], ["gc", "--dry-run"], ["ls", "--json"]):
        res = CliRunner().invoke(app, ["--disk", "checkpoints", *verb])
        assert res.exit_code == 0, (verb, res.output)
    assert list(tmp_path.iterdir()) == []
    with tiercache.open({"disk": {"path": "checkpoints"}}) as cache:  # the Quickstart's dict config
        vid = cache.save({"w": torch.arange(4.0)}, step=10).wait("local")
    assert (tmp_path / "checkpoints").stat().st_mode & 0o777 == 0o700  # made by the first write
    listed = json.loads(CliRunner().invoke(app, ["--disk", "checkpoints", "ls", "--json"]).stdout)
    assert [(v["id"], v["step"]) for v in listed] == [(vid, 10)]
    # With --config, --disk stands in for the file's [disk] path (the rest of the file applies).
    config = tmp_path / "other.toml"
    config.write_text('[disk]\npath = "elsewhere"\nio_threads = 3\n')
    listed = json.loads(CliRunner().invoke(app, ["--config", str(config), "--disk", "checkpoints", "ls",
                                                 "--json"]).stdout)
    assert [v["id"] for v in listed] == [vid] and not (tmp_path / "elsewhere").exists()
