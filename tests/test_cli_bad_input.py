"""A corpus of bad CLI invocations: each exits 2 with one error line, no traceback, nothing touched.

Library-level mistakes (bad refs, names, tiers, configs) print exactly one ``error: ...`` line.
Mistakes click catches itself (unknown options, missing arguments) print its usage hint and one
error message; they exit 2 the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache with one version on main (tagged best), its config files, and a sentinel dir beside it."""
    base = tmp_path_factory.mktemp("cli-bad")
    root = base / "root"
    with tiercache.open({"disk": {"path": str(root)}}) as cache:
        cache.tag("best", cache.save({"w": torch.ones(3)}, step=1).wait("local"))
    (base / "sentinel").mkdir()
    (base / "sentinel" / "keep.txt").write_text("untouched")
    (base / "exists.pt").write_bytes(b"old")
    configs = {
        "good.toml": f'[disk]\npath = "{root}"\n',
        "bad.toml": "[disk\npath = 1",
        "field.toml": f'[disk]\npath = "{root}"\nspeed = "fast"\n',
        "size.toml": f'[disk]\npath = "{root}"\ncapacity = "lots"\n',
        "s3url.toml": '[s3]\nurl = "http://bucket/prefix"\n',
        "threads.toml": f'[disk]\npath = "{root}"\nio_threads = 0\n',
        "chunk.toml": f'chunk_bytes = 1000\n[disk]\npath = "{root}"\n',
        "policy.toml": f'[policy]\nname = "no-such-policy"\n[disk]\npath = "{root}"\n',
        "empty.toml": "",
    }
    for name, text in configs.items():
        (base / name).write_text(text)
    yield base


def _snapshot(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


GOOD = ["--config", "{base}/good.toml"]

# (args, words the error must contain). "{base}" is the fixture's directory.
LIBRARY_ERRORS: list[tuple[list[str], str]] = [
    ([*GOOD, "restore", "nosuchref", "--out", "{base}/o.pt"], "nosuchref"),
    ([*GOOD, "restore", "../x", "--out", "{base}/o.pt"], "invalid"),
    ([*GOOD, "restore", "main~5", "--out", "{base}/o.pt"], "main~5"),
    ([*GOOD, "restore", "main@999", "--out", "{base}/o.pt"], "999"),
    ([*GOOD, "restore", "a/b", "--out", "{base}/o.pt"], "invalid"),
    ([*GOOD, "restore", "", "--out", "{base}/o.pt"], "invalid"),
    ([*GOOD, "restore", "main~-1", "--out", "{base}/o.pt"], "invalid"),
    ([*GOOD, "restore", "ma in", "--out", "{base}/o.pt"], "invalid"),
    ([*GOOD, "restore", "ZZZZ", "--out", "{base}/o.pt"], "ZZZZ"),
    ([*GOOD, "restore", ".hidden", "--out", "{base}/o.pt"], "invalid"),
    ([*GOOD, "restore", "main", "--out", "{base}/exists.pt"], "already exists"),
    ([*GOOD, "restore", "main", "--out", "{base}/nodir/o.pt"], "does not exist"),
    ([*GOOD, "promote", "main", "--to", "nowhere"], "nowhere"),
    ([*GOOD, "promote", "nosuch", "--to", "disk"], "nosuch"),
    ([*GOOD, "evict", "main", "--from", "nowhere"], "nowhere"),
    ([*GOOD, "evict", "nosuch", "--from", "disk"], "nosuch"),
    ([*GOOD, "branch", "../evil", "--from", "main"], "invalid branch"),
    ([*GOOD, "branch", "x" * 200, "--from", "main"], "invalid branch"),
    ([*GOOD, "branch", "new", "--from", "nosuch"], "nosuch"),
    ([*GOOD, "branch", "a b", "--from", "main"], "invalid branch"),
    ([*GOOD, "branch", "main", "--from", "main"], "`tiercache rollback main REF`"),
    ([*GOOD, "rollback", "nosuchbranch", "main"], "`tiercache branch nosuchbranch --from REF`"),
    ([*GOOD, "rollback", "main", "nosuch"], "nosuch"),
    ([*GOOD, "rollback", "../m", "main"], "invalid branch"),
    ([*GOOD, "tag", "../t", "main"], "invalid tag"),
    ([*GOOD, "tag", "t/x", "main"], "invalid tag"),
    ([*GOOD, "tag", "new", "nosuch"], "nosuch"),
    ([*GOOD, "log", "nosuch"], "nosuch"),
    ([*GOOD, "ls", "--branch", "../x"], "invalid branch"),
    ([*GOOD, "ls", "--branch", "nosuch"], "branch 'nosuch' does not exist"),
    ([*GOOD, "restore", "main", "--out", "{base}/nodir/sub/"], "nodir does not exist"),
    ([*GOOD, "promote", "main", "--to", "ram"], "no lasting RAM tier"),
    ([*GOOD, "evict", "main", "--from", "ram"], "no lasting RAM tier"),
    ([*GOOD, "verify", "nosuch"], "nosuch"),
    ([*GOOD, "gc", "--grace", "-1"], "grace"),
    (["--config", "{base}/missing.toml", "ls"], "not found"),
    (["--config", "{base}/bad.toml", "ls"], "not valid TOML"),
    (["--config", "{base}/field.toml", "ls"], "speed"),
    (["--config", "{base}/size.toml", "ls"], "capacity"),
    (["--config", "{base}/s3url.toml", "ls"], "url"),
    (["--config", "{base}/threads.toml", "ls"], "io_threads"),
    (["--config", "{base}/chunk.toml", "ls"], "chunk_bytes"),
    (["--config", "{base}/policy.toml", "ls"], "no-such-policy"),
    (["--config", "{base}/empty.toml", "ls"], "no tier"),
    (["--config", "{base}/sentinel", "ls"], "sentinel"),
]

USAGE_ERRORS: list[tuple[list[str], str]] = [
    (["--nope"], "No such option"),
    (["nosuchverb"], "No such command"),
    ([*GOOD, "restore"], "Missing argument"),
    ([*GOOD, "restore", "main"], "Missing option"),
    ([*GOOD, "restore", "main", "--out"], "requires an argument"),
    ([*GOOD, "promote", "main"], "Missing option"),
    ([*GOOD, "ls", "extra"], "unexpected extra argument"),
    ([*GOOD, "tag", "onlyname"], "Missing argument"),
    ([*GOOD, "rollback", "main"], "Missing argument"),
    ([*GOOD, "branch"], "Missing argument"),
    (["--config"], "requires an argument"),
    ([*GOOD, "stats", "--bogus"], "No such option"),
    ([*GOOD, "doctor", "--abort-stale", "soon"], "Invalid value"),
    ([*GOOD, "gc", "--grace", "later"], "Invalid value"),
]


def _run(world: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    before = _snapshot(world / "sentinel")
    result = CliRunner().invoke(app, [a.format(base=world) for a in args], env=env)
    assert _snapshot(world / "sentinel") == before
    assert not (world / "o.pt").exists()
    assert (world / "exists.pt").read_bytes() == b"old"
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return result.exit_code, result.output


@pytest.mark.parametrize(("args", "words"), LIBRARY_ERRORS, ids=[" ".join(a[2:] or a)[:40] for a, _ in LIBRARY_ERRORS])
def test_bad_input_gets_one_error_line_and_exit_2(world: Path, args: list[str], words: str) -> None:
    code, out = _run(world, args)
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert words in lines[0]


@pytest.mark.parametrize(("args", "words"), USAGE_ERRORS, ids=[" ".join(a)[-40:] for a, _ in USAGE_ERRORS])
def test_usage_mistakes_exit_2_with_the_reason(world: Path, args: list[str], words: str) -> None:
    code, out = _run(world, args)
    assert code == 2, out
    assert words in out


@pytest.mark.parametrize(
    "env",
    [{"TIERCACHE_CHUNK_BYTES": "12"}, {"TIERCACHE_DISK__IO_THREADS": "0"}, {"TIERCACHE_HASH": "md5"},
     {"TIERCACHE_NOPE": "1"}, {"TIERCACHE_DISK__CAPACITY": "huge"}, {"TIERCACHE_S3__MAX_ATTEMPTS": "3"}],
)
def test_bad_environment_overrides_name_the_variable(world: Path, env: dict[str, str]) -> None:
    code, out = _run(world, [*GOOD, "ls"], env)
    assert code == 2, out
    lines = out.strip().splitlines()
    [variable] = env
    assert len(lines) == 1 and lines[0].startswith(f"error: invalid config from environment variable {variable}: ")
    assert "good.toml" not in lines[0]


def test_no_tier_anywhere_says_where_it_looked(world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TIERCACHE_CONFIG", raising=False)
    code, out = _run(world, ["ls"])
    assert code == 2
    assert out == (
        f"error: no tier configured: no config file named (TIERCACHE_CONFIG is not set), no tiercache.toml in "
        f"{tmp_path}, and none of TIERCACHE_DISK__PATH, TIERCACHE_S3__URL or TIERCACHE_RAM__CAPACITY set: write "
        "a tiercache.toml with a [disk] path, an [s3] url or a [ram] table (or, on the command line, name the "
        "directory: tiercache --disk DIR)\n"
    )
    code, out = _run(world, ["--config", "{base}/empty.toml", "ls"])
    assert (code, out) == (2, f"error: no tier configured in config file {world}/empty.toml (nor by "
                              "TIERCACHE_DISK__PATH, TIERCACHE_S3__URL or TIERCACHE_RAM__CAPACITY): add a [disk] "
                              "path, an [s3] url or a [ram] table\n")
    # A variable alone is a whole config.
    code, out = _run(world, ["ls", "--json"], {"TIERCACHE_DISK__PATH": str(world / "root")})
    assert code == 0
    assert [row["step"] for row in json.loads(out)] == [1]
