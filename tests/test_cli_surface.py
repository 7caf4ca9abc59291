"""The command line's own surface: --version, --help with examples, shell completion, log levels."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cli import app

COMMANDS = ["ls", "log", "restore", "promote", "evict", "branch", "rollback", "tag", "verify", "gc", "doctor",
            "stats", "plan", "ui"]
#: Commands that serve rather than print results (no --json).
SERVING = {"ui"}


def _python_m(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(tiercache.__file__).parent.parent)}
    return subprocess.run([sys.executable, "-m", "tiercache", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, check=False)


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.stdout) == (0, f"tiercache {tiercache.__version__}\n")
    ran = _python_m("--version")
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, f"tiercache {tiercache.__version__}\n", "")


def test_no_arguments_prints_the_help() -> None:
    ran = _python_m()
    assert (ran.returncode, ran.stderr) == (0, "")
    assert ran.stdout.startswith("Usage: tiercache [OPTIONS] COMMAND [ARGS]...\n")
    assert ran.stdout == _python_m("--help").stdout


def test_every_command_registered_is_listed_here() -> None:
    assert sorted(c.name for c in app.registered_commands) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_ends_with_examples_of_itself(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    examples = [line.strip() for line in result.stdout.split("Examples:\n", 1)[1].strip().splitlines()]
    assert len(examples) >= 2
    assert all(line.startswith(f"tiercache {command}") for line in examples), examples
    # Flags are shown as flags, not as options taking a <bool>.
    assert "<bool>" not in result.stdout
    # Every command that prints results can print them as JSON.
    assert ("  --json " in result.stdout) == (command not in SERVING)


def test_top_level_help_lists_globals_completion_and_log_variable() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for option in ("--config FILE", "--policy NAME", "-v, --verbose", "-q, --quiet", "--debug", "--version",
                   "--install-completion", "--show-completion", "env var: TIERCACHE_LOG"):
        assert option in result.stdout, option
    assert "<bool>" not in result.stdout
    assert result.stdout.split("Examples:\n", 1)[1].split()[:2] == ["tiercache", "ls"]


def test_shell_completion_completes_verbs_and_options() -> None:
    verbs = _python_m(env={"_TIERCACHE_COMPLETE": "complete_bash", "COMP_WORDS": "tiercache r", "COMP_CWORD": "1"})
    assert (verbs.returncode, verbs.stdout.split()) == (0, ["restore", "rollback"])
    options = _python_m(env={"_TIERCACHE_COMPLETE": "complete_bash", "COMP_WORDS": "tiercache ls --",
                             "COMP_CWORD": "2"})
    assert options.returncode == 0
    assert {"--branch", "--json", "--help"} <= set(options.stdout.split())
    # `--show-completion` finds the shell among its parent processes, so run it from bash as a user
    # does (a test process reparented to init, as under a detached job, has no shell above it).
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(tiercache.__file__).parent.parent)}
    script = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m tiercache --show-completion; true"],
                            capture_output=True, text=True, env=base, check=False)
    assert "_TIERCACHE_COMPLETE=complete_bash" in script.stdout, script.stdout + script.stderr


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    config = tmp_path / "tiercache.toml"
    config.write_text(f'[disk]\npath = "{tmp_path / "store"}"\n')
    with tiercache.open(config) as cache:
        cache.save({"w": torch.ones(4)}, step=1).wait("local")
    return config


GC_INFO = "INFO tiercache.repo.gc: gc (dry run): 0 versions, 0 chunk objects, 0 bytes"


@pytest.mark.parametrize(
    ("args", "env", "logged"),
    [
        ([], {}, []),
        (["-v"], {}, [GC_INFO]),
        (["--log-level", "info"], {}, [GC_INFO]),
        ([], {"TIERCACHE_LOG": "info"}, [GC_INFO]),
        ([], {"TIERCACHE_LOG": "INFO"}, [GC_INFO]),
        (["-q"], {"TIERCACHE_LOG": "info"}, []),
        (["-v"], {"TIERCACHE_LOG": "error"}, []),  # one step down from error is warning
    ],
)
def test_log_levels(cfg: Path, args: list[str], env: dict[str, str], logged: list[str]) -> None:
    result = CliRunner().invoke(app, ["--config", str(cfg), *args, "gc", "--dry-run"], env=env)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == logged
    assert result.stdout.splitlines()[-1].startswith("gc would free 0 version(s)")


def test_log_level_is_restored_after_a_command(cfg: Path) -> None:
    # The CLI also runs inside other processes (tests, notebooks): it leaves their logging alone.
    logger = logging.getLogger("tiercache")
    before = (logger.level, list(logger.handlers))
    CliRunner().invoke(app, ["--config", str(cfg), "-vv", "ls"])
    assert (logger.level, list(logger.handlers)) == before


def test_bad_log_level_names_the_variable(cfg: Path) -> None:
    result = CliRunner().invoke(app, ["--config", str(cfg), "ls"], env={"TIERCACHE_LOG": "loud"})
    assert result.exit_code == 2
    assert "TIERCACHE_LOG" in result.output and "'loud'" in result.output
    ran = _python_m("--config", str(cfg), "ls", env={"TIERCACHE_LOG": "loud", "HOME": os.environ.get("HOME", "/")})
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr.startswith("error: Invalid value for '--log-level' (env var: 'TIERCACHE_LOG')")
    assert ran.stderr.count("\n") == 1


#: Modules that cost a command's start-up dearly; each is imported only by the commands that use it.
_STARTUP_HEAVY = ("torch", "boto3", "botocore", "pydantic", "pydantic_settings", "rich.console", "rich.progress",
                  "importlib.metadata", "tiercache.cache", "tiercache.advisor", "tiercache.pipeline.engine")


def _heavy_imports(cwd: Path, *args: str) -> list[str]:
    """Which of :data:`_STARTUP_HEAVY` ``tiercache ARGS`` imports, in a fresh interpreter."""
    code = ("import runpy, sys\nsys.argv = ['tiercache', *sys.argv[1:]]\ntry:\n"
            "    runpy.run_module('tiercache', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            f"print('imported:', *sorted(m for m in {_STARTUP_HEAVY!r} if m in sys.modules), file=sys.stderr)\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(tiercache.__file__).parent.parent)}
    ran = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd,
                         check=False)
    assert ran.returncode == 0, ran.stderr
    return ran.stderr.strip().splitlines()[-1].split()[1:]


def test_help_and_ls_import_only_what_they_use(tmp_path: Path) -> None:
    # Start-up time is measured in bench/ (group cli); this checks what it is spent on.
    assert _heavy_imports(tmp_path, "--help") == []
    (tmp_path / "tiercache.toml").write_text(f'[disk]\npath = "{tmp_path / "cache"}"\n')
    with tiercache.open(tmp_path / "tiercache.toml") as cache:
        cache.save({"w": torch.ones(4)}, step=1).wait("local")
    # ls needs the config and the catalog (pydantic), and rich to print; pydantic reads its plugins'
    # entry points (importlib.metadata). Nothing else heavy: no torch, no S3 client, no advisor.
    assert _heavy_imports(tmp_path, "ls") == ["importlib.metadata", "pydantic", "rich.console", "tiercache.cache"]


def test_ls_with_an_agent_table_and_no_agent_imports_no_torch(tmp_path: Path) -> None:
    # The facade asks the node agent (agent/node.py) what node RAM holds at open: that stays torch-free.
    (tmp_path / "tiercache.toml").write_text(
        f'[disk]\npath = "{tmp_path / "cache"}"\n[agent]\nsocket = "{tmp_path / "a.sock"}"\nstart = "never"\n')
    with tiercache.open(tmp_path / "tiercache.toml") as cache:
        cache.save({"w": torch.ones(4)}, step=1).wait("local")
    assert _heavy_imports(tmp_path, "ls") == ["importlib.metadata", "pydantic", "rich.console", "tiercache.cache"]
