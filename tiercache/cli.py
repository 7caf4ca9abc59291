"""The ``tiercache`` command line: inspect, restore and move checkpoint versions.

Every verb is one function registered on :data:`app`; it opens the cache through
:func:`_session`, which also turns library errors into one ``error: ...`` line on stderr and an
exit status (see :mod:`tiercache.cli_support`, which ``tiercache agent`` shares; the verbs use its
helpers under the names they had here). Every verb that prints results takes ``--json``, and its
``--help`` ends with examples.
"""

import enum
import itertools
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer

from tiercache.cli_support import JSON_HELP as _JSON_HELP
from tiercache.cli_support import Options as _Options
from tiercache.cli_support import cli_errors as _cli_errors
from tiercache.cli_support import examples as _examples
from tiercache.cli_support import human_bytes, human_duration
from tiercache.cli_support import options_config as _config
from tiercache.errors import (
    BranchNotFoundError,
    ConfigError,
    InvalidArgumentError,
    VersionNotFoundError,
)
from tiercache.names import check_name

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from tiercache.cache import TierCache
    from tiercache.manifest import VersionInfo

__all__ = ["GraphRow", "app", "layout_graph", "main"]

#: Shortest version id prefix shown in tables and graphs (longer where a listing needs it).
SHORT_ID = 10

app = typer.Typer(
    name="tiercache",
    help="Tiered checkpoint cache for PyTorch: list, restore and move checkpoint versions.\n\n"
    "Exit status: 0 on success, 2 for bad input (unknown ref, bad name or config, existing output "
    "file), 1 when storage fails or verify/doctor find a problem.",
    epilog=_examples(
        "tiercache ls",
        "tiercache --config run.toml log --graph",
        "tiercache restore main --out ckpt/",
        "TIERCACHE_LOG=debug tiercache verify",
    ),
    no_args_is_help=True,
    # --install-completion / --show-completion (bash, zsh, fish, PowerShell).
    add_completion=True,
    # Plain click help: flags print as flags (typer's rich panels print `--json <bool>`), and
    # piped help stays free of box-drawing characters.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    # --debug re-raises the original error; plain tracebacks never render local variables,
    # which could hold credentials.
    pretty_exceptions_enable=False,
)


class LogLevel(enum.StrEnum):
    """Log levels the CLI accepts (``--log-level``, ``TIERCACHE_LOG``)."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


_LEVELS = [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR]


def _setup_logging(level: LogLevel, verbose: int, quiet: bool) -> Callable[[], None]:
    """Send ``tiercache.*`` log records of ``level`` (each ``-v`` one step lower, ``-q``: errors) to stderr.

    Returns:
        A function that puts the ``tiercache`` logger back as it was (the CLI runs inside other
        processes too: tests, notebooks).
    """
    index = _LEVELS.index(logging.getLevelNamesMapping()[level.value.upper()])
    index = len(_LEVELS) - 1 if quiet else max(0, index - verbose)
    logger = logging.getLogger("tiercache")
    previous = logger.level
    # Created here so it writes to this invocation's sys.stderr.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(_LEVELS[index])

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(previous)

    return restore


# ---------------------------------------------------------------------------------------------
# Error handling and cache sessions


@contextmanager
def _session(ctx: typer.Context) -> "Iterator[TierCache]":
    """Open the cache named by the global options for one verb, mapping errors on the way out.

    The cache is closed (pending writes waited for) before the verb's process exits.
    """
    opts: _Options = ctx.obj
    from tiercache import open as open_cache  # not at import: `tiercache --help` stays quick

    with _cli_errors(opts.debug), open_cache(_config(opts)) as cache:
        yield cache


def _console(**kwargs: Any) -> "Console":
    """A rich console (rich is imported on first use: ``--help`` never draws with it)."""
    from rich.console import Console

    return Console(**kwargs)


def _table() -> "Table":
    """A borderless rich table with bold headers, as every listing prints."""
    from rich.table import Table

    return Table(box=None, header_style="bold")


def _columns(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header and rows of a borderless table, laid out as :func:`_table` draws it, one string each.

    A rich table costs milliseconds per row: ``ls`` of thousands of versions would take seconds.

    Args:
        columns: Each column's header and justification (``left``, ``right`` or ``center``).
        rows: The cells, a row per entry.
    """
    from rich.cells import cell_len

    table = [[name for name, _ in columns], *rows]
    lens = [[cell_len(c) for c in row] for row in table]
    widths = [max(row[i] for row in lens) for i in range(len(columns))]
    out = []
    for row, row_lens in zip(table, lens, strict=True):
        cells = []
        for cell, n, w, (_, justify) in zip(row, row_lens, widths, columns, strict=True):
            pad = w - n
            left = 0 if justify == "left" else pad if justify == "right" else pad // 2
            cells.append(f" {' ' * left}{cell}{' ' * (pad - left)} ")
        out.append("".join(cells))
    return out


class _Bar:
    """One task of a progress bar: ``advance`` by a chunk's bytes, or ``set`` what is done of a total."""

    def __init__(self, bar: Any, task: Any) -> None:
        self._bar, self._task = bar, task

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more as done (``Progress.advance`` locks: any thread may call it)."""
        self._bar.advance(self._task, nbytes)

    def set(self, done: int, total: int) -> None:
        """Show ``done`` bytes of ``total``."""
        self._bar.update(self._task, completed=done, total=total)


@contextmanager
def _byte_progress(description: str, total: int | None) -> Iterator[_Bar]:
    """Show a transient byte progress bar on stderr; yields its :class:`_Bar`.

    Its callbacks may be called from the engine's worker threads. Nothing is drawn when stderr is
    not a terminal, so piped output and logs stay clean.
    """
    # Imported here: only the commands that move bytes draw a bar, and it costs start-up time.
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = _console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield _Bar(bar, task)
        if total is not None:
            bar.update(task, completed=total)


# ---------------------------------------------------------------------------------------------
# Formatting helpers


def human_age(created_at: datetime, now: datetime) -> str:
    """Format the time since ``created_at`` as ``42s``, ``3m``, ``2h`` or ``5d``."""
    seconds = max(0, int((now - created_at).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _ref_labels(refs: Mapping[str, str]) -> dict[str, list[str]]:
    """Map version id -> decoration labels: branch heads as ``main``, tags as ``tag: best``."""
    labels: dict[str, list[str]] = {}
    # Branches sort before tags ("branch/" < "tag/"), as git decorates them.
    for key in sorted(refs):
        kind, _, name = key.partition("/")
        labels.setdefault(refs[key], []).append(name if kind == "branch" else f"{kind}: {name}")
    return labels


def _decoration(labels: Sequence[str]) -> str:
    """`` (main, tag: best)`` or the empty string."""
    return f" ({', '.join(labels)})" if labels else ""


def _where(info: "VersionInfo") -> str:
    """``branch@step`` of a version (itself a valid ref)."""
    return f"{info.branch}@{info.step}"


def _info(cache: "TierCache", version_id: str) -> "VersionInfo":
    """The :class:`VersionInfo` of a resolved version id."""
    for info in cache.versions():
        if info.id == version_id:
            return info
    raise VersionNotFoundError(f"version {version_id} is not listed by the cache")


def _lineage(cache: "TierCache", ref: str | None) -> "list[VersionInfo]":
    """Versions newest first: all of them, or ``ref`` and its ancestors (pruned ones included, marked)."""
    versions = _with_pruned(cache)
    if ref is None:
        return versions[::-1]
    by_id = {v.id: v for v in versions}
    chain: list[VersionInfo] = []
    current: str | None = cache.resolve(ref)
    while current is not None and current in by_id:
        chain.append(by_id[current])
        current = by_id[current].parent
    return chain


def _with_pruned(cache: "TierCache") -> "list[VersionInfo]":
    """Every version, oldest first, with those a user-set rule pruned (their states say so)."""
    return sorted([*cache.versions(), *cache.pruned()], key=lambda v: v.id)


def _pruned_why(v: "VersionInfo") -> str:
    """``pruned by <rule> at <time>`` for a pruned version, else the empty string."""
    return next((st.reason for st in v.states.values() if st.state == "pruned"), "")


def _history(cache: "TierCache", branch: str) -> "list[VersionInfo]":
    """The versions of ``branch``'s history (its head and the head's ancestors), oldest first.

    Raises:
        BranchNotFoundError: If there is no such branch.
    """
    check_name(branch, "branch")
    if f"branch/{branch}" not in cache.refs():
        raise BranchNotFoundError(f"branch {branch!r} does not exist", branch=branch)
    return _lineage(cache, branch)[::-1]


def short_id_length(ids: Iterable[str]) -> int:
    """Prefix length that tells every id of a listing apart: :data:`SHORT_ID`, or more if needed.

    Ids that sort next to each other share the longest prefixes, so comparing neighbours suffices
    (ids saved in the same millisecond share their first 10 characters, the timestamp).
    """
    width = SHORT_ID
    for a, b in itertools.pairwise(sorted(set(ids))):
        shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        width = max(width, shared + 1)
    return width


def _listed_tiers(cache: "TierCache") -> list[str]:
    """The tiers ``ls`` shows: the durable ones, and node RAM where the cache has a node agent (``[agent]``).

    A CLI process has no lasting RAM tier of its own: RAM copies live in the processes that
    saved, or in node RAM, which only the node agent can tell of (running or not).
    """
    return [t for t in cache.tier_names if t != "ram" or cache.config.agent is not None]


def _version_json(v: "VersionInfo", refs: Mapping[str, str], tiers: Sequence[str] = (),
                  behind: "Set[str]" = frozenset()) -> dict[str, Any]:
    """A version as ``ls --json`` / ``log --json`` print it (full id, refs as ``branch/main``).

    ``states`` has the durable tiers, and RAM if it is in ``tiers`` (see :func:`_listed_tiers`);
    ``rolled_back``: the version is not in its branch's history any more (``behind``).
    """
    return {
        "id": v.id,
        "step": v.step,
        "branch": v.branch,
        "parent": v.parent,
        "created_at": v.created_at.isoformat(),
        "nbytes": v.nbytes,
        "meta": v.meta,
        "tiers": list(v.tiers),
        "states": {t: {"state": st.state, "reason": st.reason, "at": st.at.isoformat() if st.at else None}
                   for t, st in v.states.items() if t != "ram" or t in tiers},
        "refs": sorted(key for key, vid in refs.items() if vid == v.id),
        "rolled_back": v.id in behind,
    }


#: How ``ls`` marks a version's state on a tier (held, or why not).
_MARKS = {"held": "✓", "pending": "…", "skipped": "skipped", "failed": "failed", "evicted": "evicted",
          "pruned": "pruned", "absent": ""}
#: Versions whose reasons ``ls`` prints under its table, newest first.
_WHY_SHOWN = 8


def _echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def _refuse_ram(cache: "TierCache", tier: str, option: str) -> None:
    """Refuse ``promote --to ram`` / ``evict --from ram`` unless a node agent holds RAM for the cache.

    Without an agent, what they would do ends with the command; with one, node RAM outlives it
    (the agent does the copy or the eviction).

    Raises:
        InvalidArgumentError: If ``tier`` is ``ram`` and no node agent serves the cache.
    """
    if tier != "ram" or cache.agent is not None:
        return
    why = ("no node agent serves this cache now: run one (`tiercache agent`) for node RAM that outlasts commands"
           if cache.config.agent is not None else "use a durable tier (disk, s3), or an [agent] for node RAM")
    raise InvalidArgumentError(
        f"a CLI process has no lasting RAM tier (its arena ends with the command), so `{option} ram` "
        f"would do nothing: {why}"
    )


# ---------------------------------------------------------------------------------------------
# Graph layout (pure)


class GraphRow(NamedTuple):
    """One row of a version graph.

    Attributes:
        graph: The lane drawing (``*``, ``|``, ``/``, ``_``, and ``:`` for a gap), without trailing spaces.
        node: The version drawn with ``*`` on this row, or ``None`` for a connector or gap row.
        gap: On a gap row, the version above it whose parent is not among the nodes (the lane
            goes on below it with ``:``: versions are missing there), else ``None``.
    """

    graph: str
    node: str | None
    gap: str | None = None


def _connector(lanes: int, drop: int, keep: int | None) -> str:
    """Draw lane ``drop`` of ``lanes`` ending: joining lane ``keep`` or vanishing (``None``).

    Lanes right of ``drop`` shift one column left (``/``); a join that passes other lanes runs
    under them with ``_`` as git does.
    """
    chars = [" "] * (2 * lanes - 1)
    for i in range(lanes):
        if i < drop:
            chars[2 * i] = "|"
        elif i > drop:
            chars[2 * i - 1] = "/"
    if keep is not None:
        chars[2 * drop - 1] = "/"
        for i in range(keep, drop - 1):
            chars[2 * i + 1] = "_"
    return "".join(chars).rstrip()


def layout_graph(nodes: Sequence[tuple[str, str | None]]) -> list[GraphRow]:
    """Lay out a version DAG as ``git log --graph`` lanes.

    Each lane waits for the next version it leads to. A version whose lane nobody waits for (a
    branch head) opens a new lane on the right; when a version's parent is already awaited by
    another lane, the two join into the leftmost one on a connector row. Versions have a single
    parent, so at most one join follows each version.

    Args:
        nodes: ``(id, parent)`` pairs newest first, every version before its parent. A parent
            that is ``None`` ends the lane (a root); one not among the nodes ends it after a gap row.

    Returns:
        The rows to print, top to bottom: one per version plus connector and gap rows.
    """
    known = {node for node, _ in nodes}
    lanes: list[str] = []
    rows: list[GraphRow] = []
    for node, parent in nodes:
        if node not in lanes:
            lanes.append(node)
        col = lanes.index(node)
        rows.append(GraphRow(" ".join("*" if i == col else "|" for i in range(len(lanes))), node))
        if parent is not None and parent not in known:
            rows.append(GraphRow(" ".join(":" if i == col else "|" for i in range(len(lanes))), None, node))
        if parent is None or parent not in known:
            if col < len(lanes) - 1:
                rows.append(GraphRow(_connector(len(lanes), col, None), None))
            del lanes[col]
        elif parent in lanes:
            other = lanes.index(parent)
            keep, drop = min(col, other), max(col, other)
            rows.append(GraphRow(_connector(len(lanes), drop, keep), None))
            lanes[keep] = parent
            del lanes[drop]
        else:
            lanes[col] = parent
    return rows


# ---------------------------------------------------------------------------------------------
# Verbs


def _version_callback(value: bool) -> None:
    if value:
        from importlib import metadata  # ~40 ms with email.*: only --version needs it

        try:
            version = metadata.version("tiercache-ckpt")
        except metadata.PackageNotFoundError:  # run from a source tree that was never installed
            from tiercache import __version__ as version
        typer.echo(f"tiercache {version}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Cache config TOML (default: $TIERCACHE_CONFIG, else ./tiercache.toml).",
            metavar="FILE",
            show_default=False,
        ),
    ] = None,
    disk: Annotated[
        Path | None,
        typer.Option(
            "--disk",
            help="The cache's disk directory: alone, the cache tiercache.open({'disk': {'path': DIR}}) makes; "
                 "with --config, in place of its [disk] path.",
            metavar="DIR",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="Policy for this command: a built-in, a preset in policies/, or package.module:Class.",
            metavar="NAME",
            show_default=False,
        ),
    ] = None,
    verbose: Annotated[
        int, typer.Option("--verbose", "-v", count=True, show_default=False,
                          help="Log more (-v: info, -vv: debug) to stderr.")
    ] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Log errors only.")] = False,
    log_level: Annotated[
        LogLevel,
        typer.Option(
            "--log-level",
            envvar="TIERCACHE_LOG",
            case_sensitive=False,
            help="Level of the tiercache log on stderr, before -v/-q.",
            metavar="debug|info|warning|error",
        ),
    ] = LogLevel.warning,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Read the global options: config, policy, log level, --debug."""
    ctx.call_on_close(_setup_logging(log_level, verbose, quiet))
    ctx.obj = _Options(config=config, debug=debug, policy=policy, disk=disk)


@app.command("ls", epilog=_examples("tiercache ls", "tiercache ls --branch ft-lr3e-5", "tiercache ls --json"))
def ls(
    ctx: typer.Context,
    branch: Annotated[
        str | None,
        typer.Option("--branch", help="Only BRANCH's history: its head and the head's ancestors.", metavar="BRANCH"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """List versions with step, size, age, refs and tiers.

    Oldest first, with one column per durable tier, and one for node RAM where the cache has a
    node agent ([agent]; a CLI process has no lasting RAM tier of its own): ✓ where the tier holds
    the version, else why not (skipped by the policy, failed, evicted; `no agent` in the RAM
    column while no agent runs), with the reasons of the newest such versions under the table.
    With --branch, only that branch's history: what `tiercache log BRANCH` walks.
    """
    from tiercache.manifest import left_behind  # not at import: `--help` stays quick

    with _session(ctx) as cache:
        everything = _with_pruned(cache)
        versions = everything if branch is None else _history(cache, branch)
        refs = cache.refs()
        tiers = _listed_tiers(cache)
        no_agent = "ram" in tiers and cache.agent is None
    behind = left_behind(everything, refs)
    if as_json:
        _echo_json([_version_json(v, refs, tiers, behind) for v in versions])
        return
    labels = _ref_labels(refs)
    width = short_id_length(v.id for v in versions)
    now = datetime.now(UTC)
    columns = [("id", "left"), ("step", "right"), ("branch", "left"), ("size", "right"), ("age", "right"),
               ("refs", "left"), *((tier, "center") for tier in tiers)]
    rows: list[list[str]] = []
    why: list[str] = []
    for v in versions:
        states = {t: v.states[t].state if t in v.states else ("held" if t in v.tiers else "absent") for t in tiers}
        rows.append([
            v.id[:width], str(v.step), v.branch, human_bytes(v.nbytes),
            human_age(v.created_at, now), ", ".join([*labels.get(v.id, []), *(["(rolled back)"] if v.id in behind
                                                                          else [])]),
            *("no agent" if t == "ram" and no_agent and states[t] == "absent" else _MARKS[states[t]]
              for t in tiers),
        ])
        why += [f"  {v.id[:width]} {t} {st.state}: {st.reason}" for t, st in v.states.items()
                if t in tiers and st.state in ("skipped", "failed", "evicted", "pruned") and st.reason]
    console = _console(highlight=False)
    header, *body = _columns(columns, rows)
    console.print(header, style="bold", markup=False, soft_wrap=True)
    if body:
        typer.echo("\n".join(body))
    if why:
        more = f" (and {len(why) - _WHY_SHOWN} more: --json has them all)" if len(why) > _WHY_SHOWN else ""
        console.print(f"why a tier lacks a version, newest first{more}:", markup=False)
        for line in why[::-1][:_WHY_SHOWN]:
            console.print(line, markup=False, soft_wrap=True)


@app.command("log", epilog=_examples("tiercache log", "tiercache log --graph", "tiercache log ft-lr3e-5 --json",
                                     "tiercache log --reflog main"))
def log(
    ctx: typer.Context,
    ref: Annotated[str | None, typer.Argument(help="Show only this version and its ancestors.", metavar="REF")] = None,
    graph: Annotated[bool, typer.Option("--graph", help="Draw the version DAG across branches.")] = False,
    reflog: Annotated[bool, typer.Option("--reflog", help="Show the moves of the branches and tags instead.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Show lineage, newest first.

    Every version, or REF and its ancestors; --graph draws the DAG across branches. --reflog lists
    the moves of every branch (or of the branch REF) and tag instead: saves, and the rollbacks,
    resumes from an older version, new branches and tags, with the version each left behind.
    """
    with _cli_errors(ctx.obj.debug):
        if graph and (as_json or reflog):
            raise InvalidArgumentError("--graph draws text: use --json or --reflog without it")
    if reflog:
        _log_reflog(ctx, ref, as_json)
        return
    from tiercache.manifest import left_behind  # not at import: `--help` stays quick

    with _session(ctx) as cache:
        versions = _lineage(cache, ref)
        refs = cache.refs()
        everything = _with_pruned(cache)
        behind = left_behind(everything, refs)
    if as_json:
        _echo_json([_version_json(v, refs, behind=behind) for v in versions])
        return
    labels = _ref_labels(refs)

    def marks(v: "VersionInfo") -> list[str]:
        out = [f"[{_pruned_why(v)}]"] if _pruned_why(v) else []  # the gap in the lineage, marked
        if v.id in behind:
            out.append(f"[rolled back: not in {v.branch}'s history]")
        return out

    if graph:
        by_id = {v.id: v for v in versions}
        width = short_id_length(by_id)
        for row in layout_graph([(v.id, v.parent) for v in versions]):
            if row.gap is not None:
                typer.echo(f"{row.graph}  {_gap_line(by_id[row.gap], everything, width)}")
            elif row.node is None:
                typer.echo(row.graph)
            else:
                v = by_id[row.node]
                typer.echo(" ".join([f"{row.graph} {v.id[:width]} {_where(v)}{_decoration(labels.get(v.id, []))}",
                                     *marks(v)]))
        return
    for v in versions:
        meta = json.dumps(v.meta, sort_keys=True)
        typer.echo(
            f"{v.id}  {_where(v)}  parent {v.parent or '-'}  meta {meta}"
            f"{_decoration(labels.get(v.id, []))}{'  ' + ' '.join(marks(v)) if marks(v) else ''}"
        )


def _gap_line(v: "VersionInfo", versions: "Sequence[VersionInfo]", width: int) -> str:
    """What a gap row of ``log --graph`` says: ``v``'s parent, and the steps before ``v``, are held by no tier.

    The steps missing run from the newest older version of ``v``'s branch that is listed (in
    ``versions``: every version, whatever ``log`` shows) up to ``v``.
    """
    assert v.parent is not None
    older = [o.step for o in versions if o.branch == v.branch and o.step < v.step and o.id < v.id]
    first = max(older) + 1 if older else 0
    lost = v.step - first
    span = f"{v.branch}@{first}" if lost == 1 else f"{v.branch}@{first} to {v.branch}@{v.step - 1}"
    steps = f"; {span} missing ({lost} step{'s' if lost != 1 else ''})" if lost > 0 else ""
    return (f"gap: {_where(v)}'s parent {v.parent[:width]} is held by no tier (its tier is gone, "
            f"or it was pruned){steps}")


def _log_reflog(ctx: typer.Context, branch: str | None, as_json: bool) -> None:
    with _session(ctx) as cache:
        moves = cache.reflog(branch)[::-1]
        width = short_id_length({*(m.version for m in moves), *(m.previous for m in moves if m.previous)})
    if as_json:
        _echo_json([{"kind": m.kind, "name": m.name, "version": m.version, "previous": m.previous,
                     "at": m.at.isoformat(), "why": m.why} for m in moves])
        return
    for m in moves:
        left = f" (was {m.previous[:width]})" if m.previous and m.why != "save" else ""
        typer.echo(f"{m.at.strftime('%Y-%m-%d %H:%M:%S')}  {m.kind}/{m.name}  {m.why:<8} {m.version[:width]}{left}")


#: File name ``restore --out DIR/`` writes inside the directory.
RESTORE_FILE = "state.pt"


def _output_path(out: str, force: bool) -> Path:
    """Where ``restore --out`` writes: ``out``, or ``out/state.pt`` for a directory.

    ``out`` names a directory when it is one or when it ends with a slash (then it is created,
    once the restore succeeded, if its parent exists): the file goes inside it, never next to it
    under the directory's name.

    Raises:
        FileExistsError: If the target exists and ``force`` is false.
        NotADirectoryError: If ``DIR/`` names a file.
        FileNotFoundError: If the directory that would hold the target (for ``DIR/``, DIR's
            parent) does not exist.
    """
    path = Path(out)
    into_dir = out.endswith(("/", os.sep)) or path.is_dir()
    if into_dir and path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a directory: drop the trailing slash to overwrite it")
    target = path / RESTORE_FILE if into_dir else path
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists: pass --force to overwrite it")
    must_exist = path.parent if into_dir else target.parent
    if not must_exist.is_dir():
        raise FileNotFoundError(f"directory {must_exist} does not exist: create it first")
    return target


def _atomic_torch_save(state: Any, target: Path) -> None:
    """``torch.save`` to a temporary file next to ``target``, fsync, then rename over it.

    A crash or error never leaves a partial file under ``target``'s name.
    """
    import torch  # only the commands that move tensors import it: `tiercache ls` starts fast

    tmp = target.with_name(f".{target.name}.{os.urandom(6).hex()}.tmp")
    # os.open with 0o666 (not mkstemp's 0o600) so the file gets the umask's usual permissions.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@app.command("restore", epilog=_examples(
    "tiercache restore main --out state.pt",
    "tiercache restore main@1000 --out ckpt/        # writes ckpt/state.pt",
    "tiercache restore best --out best.pt --force --json",
))
def restore(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Branch, tag, version id (prefix), NAME@STEP or NAME~N.", metavar="REF")],
    out: Annotated[
        str,
        typer.Option("--out", metavar="FILE|DIR",
                     help=f"File to write, or a directory for {RESTORE_FILE} (existing, or DIR/ to create it)."),
    ],
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Write a version to a torch.save file.

    torch.load(f, weights_only=True) reads it back. The file is written under a temporary name and
    renamed, so a failed restore never leaves a partial file.
    """
    with _session(ctx) as cache:
        target = _output_path(out, force)
        info = _info(cache, cache.resolve(ref))
        with _byte_progress(f"restore {info.id[:SHORT_ID]}", info.nbytes) as progress:
            state = cache.restore(info.id, progress=progress.advance)
        read = cache.last_restore.nbytes if cache.last_restore is not None else {}
        target.parent.mkdir(exist_ok=True)  # DIR/ names a directory that may not exist yet
        _atomic_torch_save(state, target)
    if as_json:
        _echo_json({"version": info.id, "branch": info.branch, "step": info.step, "path": str(target),
                    "nbytes": info.nbytes, "read": read})
    else:
        sources = ", ".join(f"{human_bytes(n)} from {src}" for src, n in sorted(read.items(), key=lambda kv: -kv[1]))
        typer.echo(f"restored {info.id} ({_where(info)}) -> {target} ({human_bytes(info.nbytes)}; read {sources})")


@app.command("promote", epilog=_examples("tiercache promote main --to disk", "tiercache promote best --to disk --json"))
def promote(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Version to copy.", metavar="REF")],
    to: Annotated[str, typer.Option("--to", help="Durable tier to copy it into (e.g. disk).", metavar="TIER")],
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Copy a version into a faster tier, such as S3 -> disk.

    Do it ahead of a restore, e.g. on a new node whose disk does not hold the version yet.
    """
    with _session(ctx) as cache:
        _refuse_ram(cache, to, "promote --to")
        info = _info(cache, cache.resolve(ref))
        with _byte_progress(f"promote {info.id[:SHORT_ID]} -> {to}", info.nbytes) as progress:
            copied = cache.promote(info.id, to=to, progress=progress.advance)
    if as_json:
        _echo_json({"version": info.id, "branch": info.branch, "step": info.step, "tier": to, "bytes_copied": copied})
    else:
        typer.echo(f"promoted {info.id} ({_where(info)}) to {to}: {human_bytes(copied)} copied")


@app.command("evict", epilog=_examples("tiercache evict main@1000 --from disk",
                                       "tiercache evict main~3 --from s3 --json"))
def evict(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Version to drop from the tier.", metavar="REF")],
    tier: Annotated[str, typer.Option("--from", help="Durable tier to drop it from.", metavar="TIER")],
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Drop a tier's copy of a version (never the last one).

    Chunks that other versions on that tier still use stay.
    """
    with _session(ctx) as cache:
        _refuse_ram(cache, tier, "evict --from")
        info = _info(cache, cache.resolve(ref))
        freed = cache.evict(info.id, tier)
    if as_json:
        _echo_json({"version": info.id, "branch": info.branch, "step": info.step, "tier": tier, "bytes_freed": freed})
    else:
        typer.echo(f"evicted {info.id} ({_where(info)}) from {tier}: {human_bytes(freed)} freed")


def _ref_verb(ctx: typer.Context, kind: str, name: str, as_json: bool, move: "Callable[[TierCache], str]") -> None:
    """Run a ref-moving library call and print ``<verb> <name> -> <id> (<branch>@<step>)`` or its JSON."""
    with _session(ctx) as cache:
        info = _info(cache, move(cache))
    if as_json:
        ref = f"{'tag' if kind == 'tag' else 'branch'}/{name}"
        _echo_json({"ref": ref, "version": info.id, "branch": info.branch, "step": info.step})
    else:
        typer.echo(f"{kind} {name} -> {info.id} ({_where(info)})")


@app.command("branch", epilog=_examples("tiercache branch ft-lr3e-5 --from main@1000",
                                        "tiercache branch try2 --from best --json"))
def branch(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="New branch name.", metavar="NAME")],
    from_ref: Annotated[str, typer.Option("--from", help="Version the branch starts at.", metavar="REF")],
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Create a branch at a version.

    The next save on branch NAME has that version as its parent.
    """
    _ref_verb(ctx, "branch", name, as_json, lambda cache: cache.branch(name, from_ref))


@app.command("rollback", epilog=_examples("tiercache rollback main main~2", "tiercache rollback main main@1000 --json"))
def rollback(
    ctx: typer.Context,
    branch: Annotated[str, typer.Argument(help="Branch to move.", metavar="BRANCH")],
    ref: Annotated[str, typer.Argument(help="Version to move its head back to.", metavar="REF")],
    reset: Annotated[bool, typer.Option("--reset", help="Move the head to REF even if it is not in BRANCH's "
                                                        "history (git reset --hard).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Move a branch's head back to a version of its history (history is kept).

    REF must be the head or one of its ancestors; --reset moves it anywhere. Versions after REF
    stay stored (and listed), and in the reflog (log --reflog), until gc collects them.
    """
    _ref_verb(ctx, "rollback", branch, as_json, lambda cache: cache.rollback(branch, ref, reset=reset))


@app.command("tag", epilog=_examples("tiercache tag best main@1000", "tiercache tag release-1 main --json"))
def tag(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Tag name (tags never move).", metavar="NAME")],
    ref: Annotated[str, typer.Argument(help="Version to tag.", metavar="REF")],
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Tag a version (tags never move).

    Tagging the same version again is a no-op; a tag of another version is refused.
    """
    _ref_verb(ctx, "tag", name, as_json, lambda cache: cache.tag(name, ref))


@app.command("verify", epilog=_examples("tiercache verify", "tiercache verify main --repair",
                                        "tiercache verify --sample 100", "tiercache verify --json"))
def verify(
    ctx: typer.Context,
    ref: Annotated[
        str | None, typer.Argument(help="Check only this version (default: every version).", metavar="REF")
    ] = None,
    repair: Annotated[bool, typer.Option("--repair", help="Rewrite each bad copy from a good one.")] = False,
    sample: Annotated[int | None, typer.Option("--sample", min=1, metavar="N", show_default=False,
                                               help="Read only N chunk copies, drawn at random (a quick check; "
                                                    "every manifest is still read).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Check every stored copy; --repair rewrites bad ones.

    Reads every copy of every chunk and manifest on every durable tier (a progress bar on a
    terminal); exit 1 if any is bad.
    """
    with _session(ctx) as cache, _byte_progress("verify", None) as progress:
        report = cache.verify(ref, repair=repair, sample=sample, progress=progress.set)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        for d in report.damage:
            fix = f" -> repaired from {d.repaired_from}" if d.repaired_from else ""
            typer.echo(f"{d.problem}: {d.tier}:{d.key} ({d.detail}){fix}")
        for key in report.unrepairable:
            typer.echo(f"no good copy on any tier: {key}")
        bad = len(report.damage)
        sampled = (f" (a sample of {report.sampled} of {report.chunk_copies} chunk copies)"
                   if report.sampled is not None else "")
        typer.echo(f"verified {report.versions} version(s), {report.chunks} chunk(s), {report.copies} copies"
                   f"{sampled}: {bad} bad, {report.repaired} repaired")
        if bad and not repair:
            typer.echo("run `tiercache verify --repair` to rewrite bad copies from good ones")
    if not report.ok:
        raise typer.Exit(1)


@app.command("gc", epilog=_examples("tiercache gc --dry-run", "tiercache gc --grace 0 --json"))
def gc(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be freed; delete nothing.")] = False,
    grace: Annotated[
        float | None, typer.Option("--grace", help="Keep unreferenced objects younger than SECONDS.", metavar="SECONDS")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Delete what no branch or tag reaches.

    Versions no branch head or tag reaches through parents, then chunks no manifest names;
    anything younger than the grace period stays.
    """
    with _session(ctx) as cache:
        report = cache.gc(dry_run=dry_run, grace=grace)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    verb = "would free" if dry_run else "freed"
    for name in report.bytes_freed:
        typer.echo(f"{name}: {report.manifests[name]} manifest(s), {report.chunks[name]} chunk(s), "
                   f"{human_bytes(report.bytes_freed[name])}")
    typer.echo(f"gc {verb} {len(report.versions)} version(s), {human_bytes(report.total_bytes)}; "
               f"{report.spared} unreferenced object(s) younger than {report.grace:g} s kept")
    if report.kept_by_reflog:
        n = len(report.kept_by_reflog)
        first = None if report.reflog_expires is None else datetime.fromtimestamp(report.reflog_expires, UTC)
        when = "" if first is None else f"; the first becomes collectable at {first:%Y-%m-%d %H:%M:%S} UTC"
        typer.echo(f"the reflog keeps {n} version(s) no ref reaches (a rollback, resume or ref move left them "
                   f"behind less than reflog_keep = {report.reflog_keep:g} s ago){when}: set reflog_keep lower "
                   "to collect them sooner")


@app.command("doctor", epilog=_examples("tiercache doctor", "tiercache doctor --probe",
                                        "tiercache doctor --abort-stale 86400 --json", "tiercache doctor --reindex"))
def doctor(
    ctx: typer.Context,
    abort_stale: Annotated[
        float | None,
        typer.Option("--abort-stale", help="Abort multipart uploads older than AGE seconds.", metavar="AGE"),
    ] = None,
    unsafe: Annotated[
        bool, typer.Option("--unsafe", help="Accept a store that ignores conditional writes (single writer only).")
    ] = False,
    probe: Annotated[
        bool, typer.Option("--probe", help="Probe conditional writes now (writes and deletes a scratch object).")
    ] = False,
    reindex: Annotated[
        bool, typer.Option("--reindex", help="Rebuild each tier's index of versions from the manifests first.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Report on the S3 endpoint (conditional writes, read-after-write, stale uploads) and full tiers.

    Writes nothing: it shows the conditional-write probe a saving process recorded before its
    first ref write (--probe runs one now on a scratch key) and lists unfinished multipart
    uploads (--abort-stale AGE aborts those older than AGE seconds, once it has checked that the
    store reports real upload start times). Exit 1 if remote ref commits would be refused, or a
    durable tier has no room for the next version even after eviction.
    --reindex first rebuilds every tier's index (what ls and restore read instead of every
    manifest) from the manifests, on any cache; without an S3 tier it does only that.
    """
    with _session(ctx) as cache:
        indexed = cache.reindex() if reindex else {}
        if reindex and "s3" not in cache.tier_names:
            if as_json:
                _echo_json({"reindexed": indexed})
            for name, (n, p) in indexed.items() if not as_json else ():
                typer.echo(f"reindexed {name}: {n} versions, {p} pruned")
            return
        report = cache.doctor(abort_stale=abort_stale, unsafe=unsafe, probe=probe)
    if as_json:
        typer.echo(json.dumps({**report.to_json(), **({"reindexed": indexed} if reindex else {})}, indent=2))
    else:
        for name, (n, p) in indexed.items():
            typer.echo(f"reindexed {name}: {n} versions, {p} pruned")
        if report.probed_at is not None:
            typer.echo(f"conditional-write probe of {report.probed_at:%Y-%m-%d %H:%M:%S} UTC:")
        for check, passed in sorted(report.probe.items()):
            typer.echo(f"{'ok  ' if passed else 'FAIL'} {check}")
        for u in report.uploads:
            state = "aborted" if u.aborted else "left"
            typer.echo(f"multipart upload {u.upload_id} of {u.key}: {u.age:.0f} s old, {state}")
        for problem in report.problems:
            typer.echo(f"problem: {problem}")
        typer.echo("doctor: OK" if report.ok else "doctor: remote ref commits are refused on this store"
                   if not report.refs_ok else f"doctor: {'/'.join(report.full)} full: new versions skip it")
    if not report.ok:
        raise typer.Exit(1)


def _rate(entry: Mapping[str, Any] | None) -> str:
    bps = entry.get("bps") if entry else None
    return f"{human_bytes(int(bps))}/s" if bps else "-"


@app.command("stats", epilog=_examples("tiercache stats", "tiercache stats --json"))
def stats(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Show observed throughput, capacity and room per tier.

    Read and write speeds the meter observed per tier, codec ratios, used bytes, capacity, the
    room left (a filesystem's free space counts) and each tier's state: "full" when the next
    version does not fit even after eviction.
    """
    from tiercache.runtime import CacheStats

    with _session(ctx) as cache:
        data = cache.stats()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    st = CacheStats.model_validate(data)
    observed = st.meter.get("tiers", {})
    table = _table()
    for name in ("tier", "state", "used", "capacity", "free", "read", "write"):
        table.add_column(name, justify="left" if name in ("tier", "state") else "right", no_wrap=True)
    for name, usage in st.tiers.items():
        cap, free = usage.capacity, usage.room.free_bytes if usage.room else None
        seen = observed.get(name, {})
        used = "unavailable" if usage.used_bytes is None else human_bytes(usage.used_bytes)
        state = usage.room.state if usage.room else ("available" if usage.available else "unavailable")
        table.add_row(name, state, used, "-" if cap is None else human_bytes(cap), "-" if free is None else
                      human_bytes(free), _rate(seen.get("read")), _rate(seen.get("write")))
    console = _console(highlight=False)
    console.print(table)
    if st.meter.get("codecs"):
        codecs = _table()
        for name in ("codec", "ratio", "encode", "chunks"):
            codecs.add_column(name, justify="left" if name == "codec" else "right", no_wrap=True)
        for name, c in st.meter["codecs"].items():
            ratio = c.get("ratio")
            codecs.add_row(name, "-" if ratio is None else f"{ratio:.3f}", _rate({"bps": c.get("encode_bps")}),
                           str(c.get("chunks", 0)))
        console.print(codecs)
    if st.agent is not None:
        from tiercache.cli_agent import describe  # the node agent's figures ([agent])

        for line in describe(data["agent"]):
            console.print(line)


def _mttf_option(mttf: str | None, gpu_mtbf: str | None, gpus: int | None) -> float | None:
    """The job's MTTF in seconds from ``--mttf`` or ``--gpu-mtbf`` and ``--gpus`` (``None``: the config's)."""
    from tiercache.config import parse_duration
    from tiercache.errors import InvalidArgumentError

    if (gpu_mtbf is None) != (gpus is None):
        raise InvalidArgumentError("--gpu-mtbf and --gpus go together: the job fails every MTBF / GPUs on average")
    if gpu_mtbf is not None and mttf is not None:
        raise InvalidArgumentError("give --mttf or --gpu-mtbf with --gpus, not both")
    if gpu_mtbf is not None and gpus is not None:
        if gpus < 1:
            raise InvalidArgumentError(f"--gpus must be at least 1, got {gpus}")
        return parse_duration(gpu_mtbf) / gpus
    return None if mttf is None else parse_duration(mttf)


_MttfOption = Annotated[str | None, typer.Option(
    "--mttf", help="Mean time to failure of the whole job, e.g. 3h (default: [advisor] mttf of the config).",
    show_default=False)]
_GpuMtbfOption = Annotated[str | None, typer.Option(
    "--gpu-mtbf", help="MTBF of one GPU, e.g. 50000h (with --gpus).", show_default=False)]
_GpusOption = Annotated[int | None, typer.Option(
    "--gpus", help="GPUs in the job (with --gpu-mtbf).", show_default=False)]


@app.command("plan", epilog=_examples("tiercache plan --mttf 3h", "tiercache plan --gpu-mtbf 50000h --gpus 16384",
                                      "tiercache plan --mttf 3h --level remote --json"))
def plan(
    ctx: typer.Context,
    mttf: _MttfOption = None,
    gpu_mtbf: _GpuMtbfOption = None,
    gpus: _GpusOption = None,
    level: Annotated[str, typer.Option("--level", help="Durability level a restart resumes from.")] = "local",
    save_wait: Annotated[float | None, typer.Option("--save-wait", help="Use SECONDS as the save wait.",
                                                     metavar="SECONDS", show_default=False)] = None,
    time_to_level: Annotated[float | None, typer.Option("--time-to-level", help="Use SECONDS as the time to LEVEL.",
                                                         metavar="SECONDS", show_default=False)] = None,
    restore: Annotated[float | None, typer.Option("--restore", help="Use SECONDS as the restore time.",
                                                   metavar="SECONDS", show_default=False)] = None,
    restart: Annotated[str | None, typer.Option("--restart", help="Time a failed job takes to run again, e.g. 2min "
                                                "(default: [advisor] restart, else what a node agent measured, "
                                                "else 0).",
                                                show_default=False)] = None,
    min_interval: Annotated[str | None, typer.Option("--min-interval", help="Never advise a shorter interval.",
                                                     show_default=False)] = None,
    max_interval: Annotated[str | None, typer.Option("--max-interval", help="Never advise a longer interval.",
                                                     show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the interval and every input as JSON.")] = False,
) -> None:
    """Advise a checkpoint interval from this cache's measured save wait, time to LEVEL and restore time."""
    from tiercache import advisor
    from tiercache.config import parse_duration

    opts: _Options = ctx.obj
    with _cli_errors(opts.debug):
        job_mttf = _mttf_option(mttf, gpu_mtbf, gpus)
        given = {k: v for k, v in (("save_wait", save_wait), ("time_to_level", time_to_level),
                                   ("restore", restore)) if v is not None}
        with _session(ctx) as cache:
            if level not in cache.levels:
                raise InvalidArgumentError(f"unknown level {level!r}: this cache has "
                                                     f"{', '.join(cache.levels)}")
            inputs = cache.plan_inputs(level, mttf=job_mttf, restart=restart, given=given)
            bounds = cache.config.advisor
            result = advisor.plan(
                inputs,
                min_interval=parse_duration(min_interval) if min_interval is not None else bounds.min_interval,
                max_interval=parse_duration(max_interval) if max_interval is not None else bounds.max_interval,
            )
            sized, sizing_lines = _sizing(cache, result.interval)
    if as_json:
        typer.echo(json.dumps({**result.to_json(), "sizing": sized}, indent=2))
        return
    why = f"bounded by {result.bound.replace('_', ' ')}" if result.bound else "availability-optimal"
    typer.echo(f"advised interval: {human_duration(result.interval)} ({result.interval:.0f} s, {why}); "
               f"expected goodput {result.goodput:.1%}")
    typer.echo(f"  availability-optimal {human_duration(result.optimum):>9}   (Ts + sqrt(2 (Tf + Tr) Ts + Ts^2), "
               f"Tr = restart + restore + time to {level} = {human_duration(result.recovery)})")
    typer.echo(f"  Young                {human_duration(result.young):>9}   (sqrt(2 δ M) + δ)")
    typer.echo(f"  Daly                 {human_duration(result.daly):>9}   (higher order, + δ)")
    table = _table()
    for name in ("interval", "", "goodput"):
        table.add_column(name, justify="right" if name != "" else "left", no_wrap=True)
    for label, interval, goodput in result.table():
        table.add_row(human_duration(interval), label, f"{goodput:.2%}")
    inputs_table = _table()
    for name in ("input", "value", "source", "how"):
        inputs_table.add_column(name, justify="right" if name == "value" else "left", no_wrap=name != "how")
    names = {"mttf": "MTTF", "save_wait": "save wait", "time_to_level": f"time to {level}", "restore": "restore",
             "restart": "restart"}
    for key, label in names.items():
        fig = getattr(inputs, key)
        inputs_table.add_row(label, human_duration(fig.seconds), fig.source, fig.note)
    console = _console(highlight=False)
    console.print(table)
    console.print(inputs_table)
    for line in sizing_lines:
        typer.echo(line)


def _sizing(cache: "TierCache", advised: float) -> tuple[dict[str, Any] | None, list[str]]:
    """The sizing advice of docs/config.md from what the cache measured: its JSON and the lines ``plan`` prints."""
    from tiercache.advisor import snapshot_rate
    from tiercache.cache import core_of
    from tiercache.sizing import Sizing

    def speed(bps: float | None) -> str:
        return _rate({"bps": bps})

    versions = cache.versions()
    if not versions:
        return None, ["sizing: no version saved yet, nothing to size"]
    newest = versions[-1]
    status = cache.status() or {}
    meter = status.get("meter")
    rate = snapshot_rate(meter) if isinstance(meter, Mapping) else core_of(cache).meter.rate
    saved = sorted(v["created_at"] for v in (status.get("versions") or {}).values()
                   if isinstance(v, Mapping) and isinstance(v.get("created_at"), int | float))
    gaps = sorted(b - a for a, b in itertools.pairwise(saved))
    if gaps:
        interval, whence = gaps[len(gaps) // 2], f"the median of {len(gaps)} intervals between saves, measured"
    else:
        interval, whence = advised, "the advised interval: no interval between saves measured"
    tiers = cache.tier_names
    first = next((t for t in ("disk", "s3") if t in tiers), None)
    # "retention latest = 5, ..." / "write-through keep = 5"
    rule = getattr(core_of(cache).policy, "retention_rule", None)
    latest = re.search(r"\b(?:latest|keep) = (\d+)", rule) if isinstance(rule, str) else None
    sz = Sizing(newest.nbytes, interval, rate(first, "write") if first else None,
                rate("s3", "write") if "s3" in tiers else None, int(latest.group(1)) if latest else None,
                "s3" in tiers)
    size = human_bytes(sz.state_bytes)
    lines = [f"sizing: versions of {size} (the newest, {_where(newest)}), saved every "
             f"{human_duration(interval)} ({whence})"]
    if first is None:
        return None, [*lines, "  no durable tier: nothing to size but the arena (2 versions)"]
    if sz.first_write_bps:
        written = (f"{first} writes one in {human_duration(sz.state_bytes / sz.first_write_bps)} at "
                   f"{speed(sz.first_write_bps)}, measured")
    else:
        written = f"{first}'s write speed not measured yet"
    lines.append(f"  [ram] capacity  >= {human_bytes(sz.arena_bytes)}: the version being copied in + "
                 f"{sz.in_flight} {first} has not written yet ({written})")
    if "disk" in tiers:
        waiting = " + 1 waiting for s3" if sz.has_s3 else ""
        if sz.disk_bytes is not None:
            lines.append(f"  [disk] capacity >= {human_bytes(sz.disk_bytes)}: {sz.keep} versions kept ({rule}) + 1 "
                         f"being written{waiting}")
        else:
            lines.append(f"  [disk] capacity: no retention keeps a number of versions, so the disk keeps them until "
                         f"its capacity evicts copies another tier holds; a retention of the latest K needs "
                         f"(K + {2 if sz.has_s3 else 1}) x {size}")
    if sz.has_s3:
        need = f"  s3: every version needs {speed(sz.s3_needed_bps)}"
        if sz.s3_write_bps is None or sz.s3_every is None or sz.s3_lag_s is None:
            lines.append(f"{need}; s3's write speed not measured yet")
        elif sz.s3_every == 1:
            lines.append(f"{need}; measured {speed(sz.s3_write_bps)}: every version reaches s3, within "
                         f"{human_duration(sz.s3_lag_s)} of its save")
        else:
            lines.append(f"{need}; measured {speed(sz.s3_write_bps)}: s3 gets 1 version in {sz.s3_every}, "
                         f"each within {human_duration(sz.s3_lag_s)} of its save")
    doc = {"state_bytes": sz.state_bytes, "interval_s": interval, "interval_source": whence,
           "first_tier": first, "first_write_bps": sz.first_write_bps, "s3_write_bps": sz.s3_write_bps,
           "keep": sz.keep, "arena_bytes": sz.arena_bytes, "disk_bytes": sz.disk_bytes,
           "s3_needed_bps": sz.s3_needed_bps if sz.has_s3 else None, "s3_every": sz.s3_every,
           "s3_lag_s": sz.s3_lag_s}
    return doc, lines


@app.command("ui", epilog=_examples("tiercache ui", "tiercache ui --port 9000 --mttf 3h",
                                    "tiercache ui --host 0.0.0.0        # the printed URL carries the token"))
def ui(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option("--port", help="Port (default: [ui] port, 8765; 0 picks a free one).",
                                             show_default=False)] = None,
    host: Annotated[str | None, typer.Option("--host", help="Address (default: 127.0.0.1). Every request "
                                             "needs the token the printed URL carries.", show_default=False)] = None,
    refresh: Annotated[float | None, typer.Option("--refresh", help="Seconds between refreshes (default: [ui] "
                                                  "refresh, 2).", show_default=False)] = None,
    mttf: _MttfOption = None,
    gpu_mtbf: _GpuMtbfOption = None,
    gpus: _GpusOption = None,
) -> None:
    """Serve a read-only web page of the cache: lineage, residency, durability lag, throughput, advice."""
    opts: _Options = ctx.obj
    with _cli_errors(opts.debug):
        try:
            from tiercache.ui.server import serve
        except ImportError as e:
            raise ConfigError(f"tiercache ui needs the ui extra ({e}): pip install starlette uvicorn") from None
        cfg = _config(opts)
        job_mttf = _mttf_option(mttf, gpu_mtbf, gpus)
        if refresh is not None and not refresh > 0:
            raise InvalidArgumentError(f"--refresh must be positive, got {refresh}")
        with suppress(KeyboardInterrupt):  # Ctrl-C is how the server is meant to stop
            serve(cfg, host=host or cfg.ui.host, port=cfg.ui.port if port is None else port,
                  refresh=refresh or cfg.ui.refresh, mttf=job_mttf, echo=typer.echo)


def main() -> None:
    """Entry point of the ``tiercache`` console script and ``python -m tiercache``.

    Usage errors (unknown option, missing argument) print one line and exit 2, like every other
    bad input, instead of click's multi-line usage box. ``tiercache`` alone prints the help.
    """
    # Without arguments click would report the help as a usage error ("error: Usage: ...", exit 2).
    args = sys.argv[1:] or ["--help"]
    try:
        rc = app(args=args, prog_name="tiercache", standalone_mode=False)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        raise SystemExit(1) from None
    except Exception as e:
        # typer vendors click and does not export its UsageError: recognise it by its interface.
        if getattr(e, "exit_code", None) != 2 or not hasattr(e, "format_message"):
            raise
        ctx = getattr(e, "ctx", None)
        where = f"tiercache {ctx.command_path.partition(' ')[2]}".strip() if ctx is not None else "tiercache"
        typer.echo(f"error: {e.format_message()} (see: {where} --help)", err=True)
        raise SystemExit(2) from None
    raise SystemExit(rc if isinstance(rc, int) else 0)


# `tiercache agent` lives in a module of its own; it shares tiercache.cli_support with the verbs.
from tiercache.cli_agent import agent_app  # noqa: E402

app.add_typer(agent_app)
