"""What every ``tiercache`` verb shares: global options, error reporting, help text and number formats.

:mod:`tiercache.cli` (the verbs) and :mod:`tiercache.cli_agent` (``tiercache agent``) both build on
it, so neither imports the other's helpers. Library errors become one ``error: ...`` line on
stderr and an exit status (2 for bad input, 1 for runtime failures) unless ``--debug`` asks for
the traceback. Messages that would name a Python call name the CLI verb instead: the mapping goes
by error type and attributes (:class:`~tiercache.errors.RefExistsError`, ...), never by message text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tiercache.errors import (
    AmbiguousRefError,
    BranchNotFoundError,
    RefExistsError,
    StorageError,
    TierCacheError,
    UnsupportedStateError,
    VersionNotFoundError,
)

if TYPE_CHECKING:
    from tiercache.config import CacheConfig

__all__ = ["JSON_HELP", "Options", "cli_errors", "examples", "human_bytes", "human_duration", "options_config"]

#: The ``--json`` option's help, the same on every verb.
JSON_HELP = "Print the result as JSON (full ids)."

# Errors that mean the user asked for something wrong (exit 2). ValueError covers ConfigError,
# InvalidNameError, InvalidArgumentError and StateMismatchError. StorageError is checked first
# because some storage failures also subclass FileNotFoundError and friends.
_BAD_INPUT: tuple[type[BaseException], ...] = (
    ValueError,
    VersionNotFoundError,
    AmbiguousRefError,
    RefExistsError,
    UnsupportedStateError,
    FileExistsError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
)


def examples(*lines: str) -> str:
    """An ``--help`` epilog listing example command lines (a backspace line keeps click from rewrapping them)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


@dataclass(frozen=True)
class Options:
    """Global options shared by every verb (stored in ``ctx.obj``)."""

    config: Path | None
    debug: bool
    policy: str | None = None
    disk: Path | None = None


def _exit_code(exc: BaseException) -> int:
    """Exit status for an error: 2 for bad input, 1 for runtime failures."""
    if isinstance(exc, StorageError):
        return 1
    return 2 if isinstance(exc, _BAD_INPUT) else 1


def _message(exc: BaseException) -> str:
    """One-line description of an error (OS errors name the file they are about).

    Errors whose library message suggests a Python call get the matching CLI verb instead.
    """
    if isinstance(exc, RefExistsError) and exc.kind == "branch":
        text = (f"branch {exc.name!r} already exists (at {exc.version}): move it with "
                f"`tiercache rollback {exc.name} REF`, or pick another name")
    elif isinstance(exc, RefExistsError):
        text = f"{exc.kind} {exc.name!r} already points at {exc.version}: tags never move; pick another name"
    elif isinstance(exc, BranchNotFoundError):
        text = (f"branch {exc.branch!r} does not exist: create it with `tiercache branch {exc.branch} --from REF` "
                "(`tiercache ls` lists versions and refs)")
    elif isinstance(exc, OSError) and not isinstance(exc, TierCacheError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


@contextmanager
def cli_errors(debug: bool) -> Iterator[None]:
    """Turn library, OS and value errors into ``error: <message>`` and an exit status."""
    try:
        yield
    except (TierCacheError, OSError, ValueError) as exc:
        if debug:
            raise
        typer.echo(f"error: {_message(exc)}", err=True)
        raise typer.Exit(_exit_code(exc)) from None


def options_config(opts: Options) -> CacheConfig:
    """The config the global options name, with ``--disk`` and ``--policy`` applied.

    ``--disk DIR`` alone is the cache of a Quickstart (``tiercache.open({"disk": {"path": DIR}})``);
    with ``--config`` it replaces that file's disk path.
    """
    from tiercache.config import DiskConfig, PolicyConfig, load_config  # not at import: `--help` stays quick

    if opts.disk is not None and opts.config is None:
        cfg = load_config({"disk": {"path": str(opts.disk)}})
    else:
        cfg = load_config(opts.config)
        if opts.disk is not None:
            disk = cfg.disk.model_copy(update={"path": opts.disk}) if cfg.disk else DiskConfig(path=opts.disk)
            cfg = cfg.model_copy(update={"disk": disk})
    if opts.policy is not None:
        cfg = cfg.model_copy(update={"policy": PolicyConfig(name=opts.policy)})
    return cfg


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


def human_duration(seconds: float) -> str:
    """Format seconds as ``0.42 s``, ``42.0 s``, ``17m 04s``, ``3h 00m`` or ``2d 03h``."""
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    whole = round(seconds)
    for big, small, name_big, name_small in ((86400, 3600, "d", "h"), (3600, 60, "h", "m"), (60, 1, "m", "s")):
        if whole >= big:
            return f"{whole // big}{name_big} {(whole % big) // small:02d}{name_small}"
    return f"{whole} s"  # unreachable: seconds >= 60 is caught above
