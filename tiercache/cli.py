"""The ``tiercache`` command line: inspect, restore and move checkpoint versions.

Every verb is one function registered on :data:`app`; it opens the cache through
:func:`_session`, which also turns library errors into one ``error: ...`` line on stderr and an
exit status (2 for bad input, 1 for runtime failures) unless ``--debug`` asks for the traceback.
A new verb (verify, gc, stats, doctor, bench) is one more ``@app.command()`` function built the
same way; nothing existing needs to change.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import torch
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

import tiercache
from tiercache.config import CacheConfig, PolicyConfig, load_config
from tiercache.errors import (
    AmbiguousRefError,
    StorageError,
    TierCacheError,
    UnsupportedStateError,
    VersionNotFoundError,
)

if TYPE_CHECKING:
    from tiercache.cache import TierCache
    from tiercache.manifest import VersionInfo

__all__ = ["GraphRow", "app", "layout_graph", "main"]

#: Length of the version id prefix shown in tables and graphs.
SHORT_ID = 10

# Errors that mean the user asked for something wrong (exit 2). ValueError covers ConfigError,
# InvalidNameError, InvalidArgumentError and StateMismatchError. StorageError is checked first
# because some storage failures also subclass FileNotFoundError and friends.
_BAD_INPUT: tuple[type[BaseException], ...] = (
    ValueError,
    VersionNotFoundError,
    AmbiguousRefError,
    UnsupportedStateError,
    FileExistsError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
)

app = typer.Typer(
    name="tiercache",
    help="Tiered checkpoint cache for PyTorch: list, restore and move checkpoint versions.",
    no_args_is_help=True,
    add_completion=False,
    # --debug re-raises the original error; plain tracebacks never render local variables,
    # which could hold credentials.
    pretty_exceptions_enable=False,
)


@dataclass(frozen=True)
class _Options:
    """Global options shared by every verb (stored in ``ctx.obj``)."""

    config: Path | None
    debug: bool
    policy: str | None = None


# ---------------------------------------------------------------------------------------------
# Error handling and cache sessions


def _exit_code(exc: BaseException) -> int:
    """Exit status for an error: 2 for bad input, 1 for runtime failures."""
    if isinstance(exc, StorageError):
        return 1
    return 2 if isinstance(exc, _BAD_INPUT) else 1


def _message(exc: BaseException) -> str:
    """One-line description of an error (OS errors name the file they are about)."""
    if isinstance(exc, OSError) and not isinstance(exc, TierCacheError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


@contextmanager
def _cli_errors(debug: bool) -> Iterator[None]:
    """Turn library, OS and value errors into ``error: <message>`` and an exit status."""
    try:
        yield
    except (TierCacheError, OSError, ValueError) as exc:
        if debug:
            raise
        typer.echo(f"error: {_message(exc)}", err=True)
        raise typer.Exit(_exit_code(exc)) from None


@contextmanager
def _session(ctx: typer.Context) -> Iterator[TierCache]:
    """Open the cache named by the global options for one verb, mapping errors on the way out.

    The cache is closed (pending writes waited for) before the verb's process exits.
    """
    opts: _Options = ctx.obj
    with _cli_errors(opts.debug), tiercache.open(_config(opts)) as cache:
        yield cache


def _config(opts: _Options) -> CacheConfig:
    """The config the global options name, with ``--policy`` applied."""
    cfg = load_config(opts.config)
    if opts.policy is not None:
        cfg = cfg.model_copy(update={"policy": PolicyConfig(name=opts.policy)})
    return cfg


@contextmanager
def _byte_progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Show a transient byte progress bar on stderr; yields the ``progress`` callback.

    The callback may be called from the engine's worker threads; ``Progress.advance`` locks.
    Nothing is drawn when stderr is not a terminal, so piped output and logs stay clean.
    """
    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
        bar.update(task, completed=total)


# ---------------------------------------------------------------------------------------------
# Formatting helpers


def human_bytes(n: int) -> str:
    """Format a byte count with binary units, e.g. ``512.0 MiB`` (``512 B`` below 1 KiB)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


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


def _where(info: VersionInfo) -> str:
    """``branch@step`` of a version (itself a valid ref)."""
    return f"{info.branch}@{info.step}"


def _info(cache: TierCache, version_id: str) -> VersionInfo:
    """The :class:`VersionInfo` of a resolved version id."""
    for info in cache.versions():
        if info.id == version_id:
            return info
    raise VersionNotFoundError(f"version {version_id} is not listed by the cache")


def _lineage(cache: TierCache, ref: str | None) -> list[VersionInfo]:
    """Versions newest first: all of them, or ``ref`` and its ancestors."""
    versions = cache.versions()
    if ref is None:
        return versions[::-1]
    by_id = {v.id: v for v in versions}
    chain: list[VersionInfo] = []
    current: str | None = cache.resolve(ref)
    while current is not None and current in by_id:
        chain.append(by_id[current])
        current = by_id[current].parent
    return chain


# ---------------------------------------------------------------------------------------------
# Graph layout (pure)


class GraphRow(NamedTuple):
    """One row of a version graph.

    Attributes:
        graph: The lane drawing (``*``, ``|``, ``/``, ``_``), without trailing spaces.
        node: The version drawn with ``*`` on this row, or ``None`` for a connector row.
    """

    graph: str
    node: str | None


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
            that is ``None`` or not among the nodes ends the lane (a root).

    Returns:
        The rows to print, top to bottom: one per version plus connector rows.
    """
    known = {node for node, _ in nodes}
    lanes: list[str] = []
    rows: list[GraphRow] = []
    for node, parent in nodes:
        if node not in lanes:
            lanes.append(node)
        col = lanes.index(node)
        rows.append(GraphRow(" ".join("*" if i == col else "|" for i in range(len(lanes))), node))
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


@app.callback()
def _root(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Cache config TOML (default: $TIERCACHE_CONFIG, else ./tiercache.toml).",
            show_default=False,
        ),
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")
    ] = False,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="Policy for this command: a built-in, a preset in policies/, or package.module:Class.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Tiered checkpoint cache for PyTorch: list, restore and move checkpoint versions."""
    ctx.obj = _Options(config=config, debug=debug, policy=policy)


@app.command("ls")
def ls(
    ctx: typer.Context,
    branch: Annotated[str | None, typer.Option("--branch", help="Only versions of this branch.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON with full ids.")] = False,
) -> None:
    """List versions, oldest first, with size, age, refs and where each one lives."""
    with _session(ctx) as cache:
        versions = cache.versions(branch=branch)
        refs = cache.refs()
        tiers = list(cache.tier_names)
    if as_json:
        ref_keys: dict[str, list[str]] = {}
        for key in sorted(refs):
            ref_keys.setdefault(refs[key], []).append(key)
        rows = [
            {
                "id": v.id,
                "step": v.step,
                "branch": v.branch,
                "parent": v.parent,
                "created_at": v.created_at.isoformat(),
                "nbytes": v.nbytes,
                "meta": v.meta,
                "tiers": list(v.tiers),
                "refs": ref_keys.get(v.id, []),
            }
            for v in versions
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    labels = _ref_labels(refs)
    now = datetime.now(UTC)
    table = Table(box=None, header_style="bold")
    for name, justify in (("id", "left"), ("step", "right"), ("branch", "left"), ("size", "right"),
                          ("age", "right"), ("refs", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for tier in tiers:
        table.add_column(tier, justify="center", no_wrap=True)
    for v in versions:
        table.add_row(
            v.id[:SHORT_ID], str(v.step), v.branch, human_bytes(v.nbytes),
            human_age(v.created_at, now), ", ".join(labels.get(v.id, [])),
            *("✓" if tier in v.tiers else "" for tier in tiers),
        )
    Console(highlight=False).print(table)


@app.command("log")
def log(
    ctx: typer.Context,
    ref: Annotated[str | None, typer.Argument(help="Show only this version and its ancestors.")] = None,
    graph: Annotated[bool, typer.Option("--graph", help="Draw the version DAG across branches.")] = False,
) -> None:
    """Show lineage, newest first (all versions, or REF and its ancestors)."""
    with _session(ctx) as cache:
        versions = _lineage(cache, ref)
        labels = _ref_labels(cache.refs())
    if graph:
        by_id = {v.id: v for v in versions}
        for row in layout_graph([(v.id, v.parent) for v in versions]):
            if row.node is None:
                typer.echo(row.graph)
            else:
                v = by_id[row.node]
                typer.echo(f"{row.graph} {v.id[:SHORT_ID]} {_where(v)}{_decoration(labels.get(v.id, []))}")
        return
    for v in versions:
        meta = json.dumps(v.meta, sort_keys=True)
        typer.echo(
            f"{v.id}  {_where(v)}  parent {v.parent or '-'}  meta {meta}"
            f"{_decoration(labels.get(v.id, []))}"
        )


def _output_path(out: Path, force: bool) -> Path:
    """Where ``restore --out`` writes: ``out``, or ``out/state.pt`` for a directory.

    Raises:
        FileExistsError: If the target exists and ``force`` is false.
        FileNotFoundError: If the target's directory does not exist.
    """
    target = out / "state.pt" if out.is_dir() else out
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists: pass --force to overwrite it")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"directory {target.parent} does not exist: create it first")
    return target


def _atomic_torch_save(state: Any, target: Path) -> None:
    """``torch.save`` to a temporary file next to ``target``, fsync, then rename over it.

    A crash or error never leaves a partial file under ``target``'s name.
    """
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
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


@app.command("restore")
def restore(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Branch, tag, version id (prefix), NAME@STEP or NAME~N.")],
    out: Annotated[Path, typer.Option("--out", help="File to write, or an existing directory (state.pt).")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Restore REF and write it as a torch.save file."""
    with _session(ctx) as cache:
        target = _output_path(out, force)
        info = _info(cache, cache.resolve(ref))
        with _byte_progress(f"restore {info.id[:SHORT_ID]}", info.nbytes) as progress:
            state = cache.restore(info.id, progress=progress)
        _atomic_torch_save(state, target)
    typer.echo(f"restored {info.id} ({_where(info)}) -> {target} ({human_bytes(info.nbytes)})")


@app.command("promote")
def promote(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Version to copy.")],
    to: Annotated[str, typer.Option("--to", help="Tier to copy it into (e.g. disk, ram).")],
) -> None:
    """Copy a version's chunks into a faster tier ahead of a restore."""
    with _session(ctx) as cache:
        info = _info(cache, cache.resolve(ref))
        with _byte_progress(f"promote {info.id[:SHORT_ID]} -> {to}", info.nbytes) as progress:
            copied = cache.promote(info.id, to=to, progress=progress)
    typer.echo(f"promoted {info.id} ({_where(info)}) to {to}: {human_bytes(copied)} copied")


@app.command("evict")
def evict(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Version to drop from the tier.")],
    tier: Annotated[str, typer.Option("--from", help="Tier to drop it from.")],
) -> None:
    """Drop a tier's copy of a version (never the last durable copy)."""
    with _session(ctx) as cache:
        info = _info(cache, cache.resolve(ref))
        freed = cache.evict(info.id, tier)
    typer.echo(f"evicted {info.id} ({_where(info)}) from {tier}: {human_bytes(freed)} freed")


def _ref_verb(ctx: typer.Context, kind: str, name: str, move: Callable[[TierCache], str]) -> None:
    """Run a ref-moving library call and print ``<kind> <name> -> <id> (<branch>@<step>)``."""
    with _session(ctx) as cache:
        info = _info(cache, move(cache))
    typer.echo(f"{kind} {name} -> {info.id} ({_where(info)})")


@app.command("branch")
def branch(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="New branch name.")],
    from_ref: Annotated[str, typer.Option("--from", help="Version the branch starts at.")],
) -> None:
    """Create branch NAME at a version; the next save on it has that version as parent."""
    _ref_verb(ctx, "branch", name, lambda cache: cache.branch(name, from_ref))


@app.command("rollback")
def rollback(
    ctx: typer.Context,
    branch: Annotated[str, typer.Argument(help="Branch to move.")],
    ref: Annotated[str, typer.Argument(help="Version to move its head back to.")],
) -> None:
    """Move BRANCH's head back to REF (history is kept)."""
    _ref_verb(ctx, "rollback", branch, lambda cache: cache.rollback(branch, ref))


@app.command("tag")
def tag(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Tag name (tags never move).")],
    ref: Annotated[str, typer.Argument(help="Version to tag.")],
) -> None:
    """Tag a version with NAME."""
    _ref_verb(ctx, "tag", name, lambda cache: cache.tag(name, ref))


@app.command("verify")
def verify(
    ctx: typer.Context,
    ref: Annotated[str | None, typer.Argument(help="Check only this version (default: every version).")] = None,
    repair: Annotated[bool, typer.Option("--repair", help="Rewrite each bad copy from a good one.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check every copy of every chunk and manifest on every durable tier (exit 1 if any is bad)."""
    with _session(ctx) as cache:
        report = cache.verify(ref, repair=repair)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        for d in report.damage:
            fix = f" -> repaired from {d.repaired_from}" if d.repaired_from else ""
            typer.echo(f"{d.problem}: {d.tier}:{d.key} ({d.detail}){fix}")
        for key in report.unrepairable:
            typer.echo(f"no good copy on any tier: {key}")
        bad = len(report.damage)
        typer.echo(f"verified {report.versions} version(s), {report.chunks} chunk(s), {report.copies} copies: "
                   f"{bad} bad, {report.repaired} repaired")
        if bad and not repair:
            typer.echo("run `tiercache verify --repair` to rewrite bad copies from good ones")
    if not report.ok:
        raise typer.Exit(1)


@app.command("gc")
def gc(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be freed; delete nothing.")] = False,
    grace: Annotated[
        float | None, typer.Option("--grace", help="Keep unreferenced objects younger than SECONDS.", metavar="SECONDS")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Delete versions no branch or tag reaches (through parents) and chunks no manifest names."""
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


@app.command("doctor")
def doctor(
    ctx: typer.Context,
    abort_stale: Annotated[
        float | None,
        typer.Option("--abort-stale", help="Abort multipart uploads older than AGE seconds.", metavar="AGE"),
    ] = None,
    unsafe: Annotated[
        bool, typer.Option("--unsafe", help="Accept a store that ignores conditional writes (single writer only).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Probe the S3 endpoint (conditional writes, read-after-write); list or abort stale multipart uploads."""
    with _session(ctx) as cache:
        report = cache.doctor(abort_stale=abort_stale, unsafe=unsafe)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        for check, passed in sorted(report.probe.items()):
            typer.echo(f"{'ok  ' if passed else 'FAIL'} {check}")
        for u in report.uploads:
            state = "aborted" if u.aborted else "left"
            typer.echo(f"multipart upload {u.upload_id} of {u.key}: {u.age:.0f} s old, {state}")
        for problem in report.problems:
            typer.echo(f"problem: {problem}")
        typer.echo("doctor: OK" if report.ok else "doctor: remote ref commits are refused on this store")
    if not report.ok:
        raise typer.Exit(1)


def _rate(entry: Mapping[str, Any] | None) -> str:
    bps = entry.get("bps") if entry else None
    return f"{human_bytes(int(bps))}/s" if bps else "-"


@app.command("stats")
def stats(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the statistics as JSON.")] = False,
) -> None:
    """Show observed throughput per tier and direction, codec ratios, and capacity/usage per tier."""
    with _session(ctx) as cache:
        data = cache.stats()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    observed = data["meter"]["tiers"]
    table = Table(box=None, header_style="bold")
    for name in ("tier", "used", "capacity", "read", "write"):
        table.add_column(name, justify="left" if name == "tier" else "right", no_wrap=True)
    for name, usage in data["tiers"].items():
        cap = usage["capacity"]
        seen = observed.get(name, {})
        table.add_row(name, human_bytes(usage["used_bytes"]), "-" if cap is None else human_bytes(cap),
                      _rate(seen.get("read")), _rate(seen.get("write")))
    console = Console(highlight=False)
    console.print(table)
    if data["meter"]["codecs"]:
        codecs = Table(box=None, header_style="bold")
        for name in ("codec", "ratio", "encode", "chunks"):
            codecs.add_column(name, justify="left" if name == "codec" else "right", no_wrap=True)
        for name, c in data["meter"]["codecs"].items():
            ratio = c.get("ratio")
            codecs.add_row(name, "-" if ratio is None else f"{ratio:.3f}", _rate({"bps": c.get("encode_bps")}),
                           str(c.get("chunks", 0)))
        console.print(codecs)


def human_duration(seconds: float) -> str:
    """Format seconds as ``0.42 s``, ``42.0 s``, ``17m 04s``, ``3h 00m`` or ``2d 03h``."""
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    whole = round(seconds)
    for big, small, name_big, name_small in ((86400, 3600, "d", "h"), (3600, 60, "h", "m"), (60, 1, "m", "s")):
        if whole >= big:
            return f"{whole // big}{name_big} {(whole % big) // small:02d}{name_small}"
    return f"{whole} s"  # unreachable: seconds >= 60 is caught above


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


@app.command("plan")
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
                                                "(default: [advisor] restart, else 0).", show_default=False)] = None,
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
                raise tiercache.InvalidArgumentError(f"unknown level {level!r}: this cache has "
                                                     f"{', '.join(cache.levels)}")
            inputs = cache.plan_inputs(level, mttf=job_mttf, restart=restart, given=given)
            bounds = cache.config.advisor
        result = advisor.plan(
            inputs,
            min_interval=parse_duration(min_interval) if min_interval is not None else bounds.min_interval,
            max_interval=parse_duration(max_interval) if max_interval is not None else bounds.max_interval,
        )
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    why = f"bounded by {result.bound.replace('_', ' ')}" if result.bound else "availability-optimal"
    typer.echo(f"advised interval: {human_duration(result.interval)} ({result.interval:.0f} s, {why}); "
               f"expected goodput {result.goodput:.1%}")
    typer.echo(f"  availability-optimal {human_duration(result.optimum):>9}   (Ts + sqrt(2 (Tf + Tr) Ts + Ts^2), "
               f"Tr = restart + restore + time to {level} = {human_duration(result.recovery)})")
    typer.echo(f"  Young                {human_duration(result.young):>9}   (sqrt(2 δ M) + δ)")
    typer.echo(f"  Daly                 {human_duration(result.daly):>9}   (higher order, + δ)")
    table = Table(box=None, header_style="bold")
    for name in ("interval", "", "goodput"):
        table.add_column(name, justify="right" if name != "" else "left", no_wrap=True)
    for label, interval, goodput in result.table():
        table.add_row(human_duration(interval), label, f"{goodput:.2%}")
    inputs_table = Table(box=None, header_style="bold")
    for name in ("input", "value", "source", "how"):
        inputs_table.add_column(name, justify="right" if name == "value" else "left", no_wrap=name != "how")
    names = {"mttf": "MTTF", "save_wait": "save wait", "time_to_level": f"time to {level}", "restore": "restore",
             "restart": "restart"}
    for key, label in names.items():
        fig = getattr(inputs, key)
        inputs_table.add_row(label, human_duration(fig.seconds), fig.source, fig.note)
    console = Console(highlight=False)
    console.print(table)
    console.print(inputs_table)


@app.command("ui")
def ui(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option("--port", help="Port (default: [ui] port, 8765; 0 picks a free one).",
                                             show_default=False)] = None,
    host: Annotated[str | None, typer.Option("--host", help="Address (default: 127.0.0.1); any other than "
                                             "loopback requires the printed token.", show_default=False)] = None,
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
            raise tiercache.ConfigError(f"tiercache ui needs the ui extra ({e}): pip install 'tiercache[ui]'") from None
        cfg = _config(opts)
        job_mttf = _mttf_option(mttf, gpu_mtbf, gpus)
        if refresh is not None and not refresh > 0:
            raise tiercache.InvalidArgumentError(f"--refresh must be positive, got {refresh}")
        with suppress(KeyboardInterrupt):  # Ctrl-C is how the server is meant to stop
            serve(cfg, host=host or cfg.ui.host, port=cfg.ui.port if port is None else port,
                  refresh=refresh or cfg.ui.refresh, mttf=job_mttf, echo=typer.echo)


def main() -> None:
    """Entry point of the ``tiercache`` console script and ``python -m tiercache``.

    Usage errors (unknown option, missing argument) print one line and exit 2, like every other
    bad input, instead of click's multi-line usage box.
    """
    try:
        rc = app(prog_name="tiercache", standalone_mode=False)
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
