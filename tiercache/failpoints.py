"""Named failpoints: places in the write path where a test can kill, fail or stall the process.

Production code calls :func:`failpoint` with one of the names in :data:`FAILPOINTS`; it does
nothing unless a test armed that name. Tests arm failpoints with the ``TIERCACHE_FAILPOINTS``
environment variable of a child process, or with :func:`configure` in-process::

    TIERCACHE_FAILPOINTS="disk.after_fsync=kill@3,catalog.before_ref_write=sleep:0.2"

Each entry is ``NAME=ACTION[@N]``: ``kill`` (SIGKILL this process, as a power cut would),
``raise`` (raise :class:`~tiercache.errors.StorageError`) or ``sleep:<seconds>``; with ``@N`` the
action fires on the N-th hit of that name only (1-based), without it on every hit.

In-process tests can also run their own code at a failpoint with :func:`hooked` (to hold a
thread there, or to start a racing operation at exactly that point)::

    with failpoints.hooked("repo.after_claim", lambda tier, ids: arrived.set() or go.wait()):
        ...

This module reads ``os.environ`` itself, once, at import: an exception to the rule that only
``config.py`` reads the environment, because failpoints are a test facility, not a knob of the
cache, and must reach code (tiers, the catalog) that never sees the config.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tiercache.errors import ConfigError, StorageError

#: Environment variable naming the armed failpoints (read once, at import).
ENV_VAR = "TIERCACHE_FAILPOINTS"

#: Every failpoint the code calls, in write-path order.
FAILPOINTS: tuple[str, ...] = (
    "engine.after_chunk_write",  # one chunk of a version is on the tier, the others may not be
    "repo.after_claim",  # a pending version leased chunks on a tier and checked which it holds
    "leases.claim_waits",  # a claim waits for a deletion of the chunks it asks for to finish
    "repo.chunks_doomed",  # a deletion decided its chunks (none leased or named), not yet deleted
    "repo.after_manifest_write",  # chunks and manifest are on the tier, the ref not yet
    "disk.after_tmp_write",  # tmp file written, not yet fsynced
    "disk.after_fsync",  # tmp file durable, not yet renamed
    "disk.after_rename",  # final name in place, directory not yet fsynced
    "disk.after_dir_fsync",  # the object is durable under its final name
    "s3.after_first_part",  # a multipart upload has one part uploaded, not completed
    "catalog.before_ref_write",  # about to compare-and-swap a ref
    "catalog.after_ref_write",  # the ref moved; the level is not yet reported
    "gc.after_manifest_delete",  # GC removed a manifest, its chunks not yet
    # A trainer with a node agent (tiercache.agent.saver):
    "agent.publish",  # a version is whole in the agent's arena, not yet published to it (detail: the id)
    "agent.hand_over",  # the trainer takes the versions of a lost agent over in process, in save order
    # The phases of a multi-rank version on one rank (detail: the phase's tag, e.g. "<vid>/disk"):
    "group.posted",  # a rank's status of a phase is in the store, the coordinator not yet told (detail: tag, rank)
    "group.save",  # save(group=) checks its call, before the first exchange (detail: "save/<n>")
    "group.stage",  # the group agreed on the version; this rank copies its part into the arena
    "group.staged",  # this rank's part is in the arena (its pipeline may be done with it already)
    "group.trade",  # the hasher trades the ids of chunks the ranks hold alike
    "group.parts",  # this rank's part is hashed; it tells the group about it
    "group.write",  # this rank's chunks and part are on a tier; it tells the group
    "group.commit",  # rank 0 (shared tier) or a node's leader (its disk) commits the version
    "group.peers",  # this rank makes its share of the peer copies
    "peers.send",  # a node reads a chunk of its peer copies to send it (with [agent]: its agent; detail: the id)
    "group.restore",  # restore(group=) resolves the ref (detail: "restore/<n>")
    "group.adopt",  # a restarted group reads back the part of a version it adopts (detail: "restore/<n>/adopt")
    "group.fill",  # a group restore reads its chunks (its own node's, a peer's, S3's)
    "group.holding",  # some rank misses chunks: this rank says which of them its node holds (detail: tag)
)

_ACTIONS = ("kill", "raise", "sleep")


@dataclass
class _Armed:
    action: str
    seconds: float
    nth: int | None
    hits: int = 0


_lock = threading.Lock()
_armed: dict[str, _Armed] = {}
_hooks: dict[str, Callable[..., None]] = {}


def _parse(spec: str) -> dict[str, _Armed]:
    out: dict[str, _Armed] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, rest = entry.partition("=")
        if not sep or name not in FAILPOINTS:
            raise ConfigError(
                f"{ENV_VAR}: bad entry {entry!r}: use NAME=kill|raise|sleep:<s>[@N] with NAME one of "
                f"{', '.join(FAILPOINTS)}"
            )
        action, _, nth = rest.partition("@")
        kind, _, arg = action.partition(":")
        try:
            seconds = float(arg) if kind == "sleep" else 0.0
            count = int(nth) if nth else None
        except ValueError:
            raise ConfigError(f"{ENV_VAR}: bad entry {entry!r}: sleep takes seconds, @ takes a count") from None
        if kind not in _ACTIONS or (kind != "sleep" and arg) or (count is not None and count < 1):
            raise ConfigError(f"{ENV_VAR}: bad action in {entry!r}: use kill, raise or sleep:<seconds>, then @N >= 1")
        out[name] = _Armed(kind, seconds, count)
    return out


def configure(spec: str | None) -> None:
    """Arm failpoints from a spec in the ``TIERCACHE_FAILPOINTS`` format (``None`` or ``""`` disarms all).

    Hit counts restart from zero.

    Raises:
        ConfigError: If the spec names an unknown failpoint or action.
    """
    parsed = _parse(spec or "")
    with _lock:
        _armed.clear()
        _armed.update(parsed)


@contextmanager
def hooked(name: str, hook: Callable[..., None]) -> Iterator[None]:
    """Call ``hook(*detail)`` on the hitting thread at every hit of failpoint ``name`` during the block.

    Raises:
        ConfigError: If ``name`` is not a failpoint, or already hooked.
    """
    if name not in FAILPOINTS or name in _hooks:
        raise ConfigError(f"cannot hook failpoint {name!r}: unknown or already hooked")
    _hooks[name] = hook
    try:
        yield
    finally:
        del _hooks[name]


def failpoint(name: str, *detail: object) -> None:
    """Run the hook and the action armed for ``name``, if any (a no-op otherwise).

    Args:
        name: One of :data:`FAILPOINTS`.
        detail: What a hook is told about the hit (the tier, the chunk ids...).

    Raises:
        StorageError: If ``name`` is armed with ``raise``.
    """
    if not _armed and not _hooks:
        return
    hook = _hooks.get(name)
    if hook is not None:
        hook(*detail)
    with _lock:
        armed = _armed.get(name)
        if armed is None:
            return
        armed.hits += 1
        if armed.nth is not None and armed.hits != armed.nth:
            return
    if armed.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif armed.action == "raise":
        raise StorageError(f"failpoint {name} fired (armed by {ENV_VAR})")
    else:
        time.sleep(armed.seconds)


configure(os.environ.get(ENV_VAR))
