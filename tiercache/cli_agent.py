"""``tiercache agent``: run the node agent of a cache in the foreground, or ask a running one.

``tiercache agent [--config FILE]`` is what a systemd unit, a Kubernetes sidecar or
``srun --ntasks-per-node=1`` runs; it stops on SIGTERM or SIGINT after finishing every version it
holds. ``tiercache agent status`` and ``tiercache agent stop`` talk to the running one. Registered
on :data:`tiercache.cli.app` by that module; it shares the verbs' error handling and config options
(:mod:`tiercache.cli_support`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tiercache.cli_support import JSON_HELP, Options, cli_errors, examples, human_bytes, human_duration, options_config
from tiercache.handle import LEVELS

if TYPE_CHECKING:
    from tiercache.config import CacheConfig

agent_app = typer.Typer(
    name="agent",
    help="Run this node's agent for the cache in the foreground, or ask the running one (status, stop).\n\n"
    "The agent owns the node's RAM tier (a file in /dev/shm) and does the background work of the tiers "
    "below it for every process of the node; with [agent] start = \"auto\" (the default) the first process "
    "that saves starts one by itself.",
    epilog=examples(
        "tiercache agent --config tiercache.toml        # foreground: systemd, a sidecar, srun",
        "tiercache agent status",
        "tiercache agent stop",
    ),
    invoke_without_command=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _agent_config(opts: Options, spec_fd: int | None) -> CacheConfig:
    """The config the agent runs: from ``--spec-fd`` (a process that started it), else the global one.

    The spec comes through a descriptor the starting process holds the other end of (a pipe),
    never a file: another user could swap a file (see :mod:`tiercache.agent.rundir`). A config
    without an ``[agent]`` table gets the defaults: ``tiercache agent`` itself says to run one.
    """
    from tiercache.config import AgentConfig, load_config
    from tiercache.errors import ConfigError

    if spec_fd is not None:
        try:
            with os.fdopen(spec_fd, "rb", closefd=True) as fh:
                data = json.loads(fh.read())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the agent's spec from descriptor {spec_fd}: {e}") from None
        cfg = load_config(data, env={})  # the trainer's config, its environment applied already
    else:
        cfg = options_config(opts)
    return cfg if cfg.agent is not None else cfg.model_copy(update={"agent": AgentConfig()})


@agent_app.callback()
def agent(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", help="Cache config TOML (as the global --config).",
                                                metavar="FILE", show_default=False)] = None,
    spec_fd: Annotated[int | None, typer.Option("--spec-fd", hidden=True)] = None,
    exist_ok: Annotated[bool, typer.Option("--exist-ok", hidden=True)] = False,
) -> None:
    """Run the node agent of the cache in the foreground until SIGTERM, SIGINT or `tiercache agent stop`."""
    opts: Options = ctx.obj
    if config is not None:
        opts = ctx.obj = dataclasses.replace(opts, config=config)
    if ctx.invoked_subcommand is not None:
        return
    with cli_errors(opts.debug):
        from tiercache.agent.server import run

        cfg = _agent_config(opts, spec_fd)
        raise typer.Exit(run(cfg, exist_ok=exist_ok, echo=lambda line: typer.echo(line, err=True)))


@agent_app.command("status", epilog=examples("tiercache agent status", "tiercache agent status --json"))
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Show the running agent: pid, arena, clients, versions in flight, queues, levels reached, restores.

    Exits 1 when no agent runs for the cache.
    """
    opts: Options = ctx.obj
    with cli_errors(opts.debug):
        from tiercache.agent.client import call

        data = call(_agent_config(opts, None), "stats")
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    for line in describe(data):
        typer.echo(line)


def describe(data: dict[str, Any]) -> list[str]:
    """The lines ``tiercache agent status`` (and ``stats``) print for an agent's stats."""
    arena = data.get("arena", {})
    cap = arena.get("capacity")
    up = human_duration(max(0.0, time.time() - float(data.get("started_at", time.time()))))
    started = datetime.fromtimestamp(float(data.get("started_at", 0)), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"agent {data.get('pid')} up {up} (since {started}), socket {data.get('socket')}",
        f"arena {arena.get('path') or '(made at the first save)'}: "
        f"{human_bytes(int(arena.get('used_bytes') or 0))} used of {human_bytes(int(cap)) if cap else '-'}",
        f"clients {len(data.get('clients', []))}, versions in flight {data.get('in_flight', 0)}"
        + "".join(f", {n} queued for {t}" for t, n in sorted(data.get("queues", {}).items())),
    ]
    lines += _parts_lines(data)
    levels = data.get("levels", {})
    if levels:
        lines.append("levels of the versions and group parts it wrote: " + "; ".join(
            f"{level} " + ", ".join(f"{levels[key]} {outcome}" for outcome in _OUTCOMES
                                    if (key := f"{level}:{outcome}") in levels)
            for level in LEVELS if any(key.startswith(f"{level}:") for key in levels)))
    restores = data.get("restores", {})
    if restores:
        lines.append("restores " + ", ".join(f"{k} {v} ({human_bytes(int(data['restore_bytes'].get(k, 0)))})"
                                           for k, v in sorted(restores.items())))
    if data.get("metrics"):
        lines.append(f"metrics http://{data['metrics']}/metrics")
    return lines


#: How ``describe`` orders a level's counters (a skip is the policy's choice, not a failure).
_OUTCOMES = ("ok", "skipped", "failed")


def _parts_lines(data: dict[str, Any]) -> list[str]:
    """The lines about the parts of group versions: in flight, orphaned (and what becomes of them), released."""
    parts = data.get("parts", {})
    released = int(data.get("parts_released", 0))
    settled = int(data.get("parts_settled", 0))
    if not (parts.get("in_flight") or parts.get("orphaned") or released or settled):
        return []
    lines = [f"group parts: {parts.get('in_flight', 0)} in flight, {parts.get('orphaned', 0)} orphaned (their "
             f"trainers died before the group committed them), {released} released (could never be adopted), "
             f"{settled} settled (their group committed them as a trainer died)"]
    orphans = data.get("orphans", [])
    for o in orphans:
        ranks = ", ".join(map(str, o["ranks"]))
        lines.append(f"  orphaned: {o['branch']}@{o['step']} ({o['v']}): part(s) of rank(s) {ranks} of {o['world']}")
    if orphans:
        lines.append("  they stay in node RAM until a restarted job of the same size restores their branch by name "
                     "(it adopts the newest version every rank's part of is kept, and lets newer incomplete ones "
                     "go), a version of their branch at their step or later is committed, or a new save needs "
                     f"their room (the oldest go first; at most {data.get('orphans_limit')} are kept)")
    return lines


@agent_app.command("stop", epilog=examples("tiercache agent stop", "tiercache agent stop --timeout 60"))
def stop(
    ctx: typer.Context,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds to let it finish what it holds "
                                                  "(default: as long as it takes).", show_default=False)] = None,
) -> None:
    """Stop the running agent once every version it holds is written (or after --timeout).

    Exits 1 when no agent runs for the cache.
    """
    opts: Options = ctx.obj
    with cli_errors(opts.debug):
        from tiercache.agent.client import call
        from tiercache.agent.naming import place

        cfg = _agent_config(opts, None)
        pid = int(call(cfg, "stats").get("pid", 0))
        call(cfg, "stop", within=timeout)
        sock = place(cfg).socket
        # It answered once everything it held was written; now it closes and exits. Say
        # "stopped" only once the process is gone.
        deadline = time.monotonic() + _EXIT_WAIT_S
        while (sock.exists() or _running(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
    if _running(pid):
        typer.echo(f"agent {pid} said it stops but is still running after {_EXIT_WAIT_S:.0f} s: "
                   f"look at its log, or kill {pid}", err=True)
        raise typer.Exit(1)
    typer.echo(f"agent {pid} stopped")


#: How long `agent stop` waits for the process to exit once it said it stops.
_EXIT_WAIT_S = 30.0


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
