"""The agent's arena: one file of node memory per cache, node and boot, that only the agent unlinks.

Lifecycle (the agent side, :class:`SharedArena`):

1. created ``0600`` with ``O_EXCL`` in ``[agent] shm_dir`` (``/dev/shm``) under the name
   :meth:`AgentPlace.arena <tiercache.agent.naming.AgentPlace.arena>` gives it (random: another
   user cannot create it first);
2. its pages reserved with ``posix_fallocate`` (a ``/dev/shm`` too small fails here with one clear
   error, never later with a ``SIGBUS`` in a trainer), mapped shared and pre-faulted;
3. locked (``flock``, exclusive) for as long as the agent lives: the kernel drops the lock when
   the agent dies, however it dies, which is how :func:`sweep` tells a live arena from a stale one;
4. unlinked by the agent when it exits; trainers that still map it keep their mapping.

Trainers (:func:`map_shared`) get the descriptor over the agent's socket (``SCM_RIGHTS``), open
the file again through ``/proc/self/fd`` (a new open file description: their mapping must never
hold the agent's lock, or a dead agent's arena would look alive) and map it shared.

:func:`sweep` runs when an agent starts: it unlinks the user's arenas of other boots and those
whose lock nobody holds (their agent died), so node memory never leaks across crashes; a file
that only looks like one of the user's arenas (another user's) is named and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
from pathlib import Path

from tiercache.agent.naming import ARENA_PREFIX, ARENA_SUFFIX, boot_id
from tiercache.errors import ConfigError, TierFullError
from tiercache.tiers.ram import prefault

log = logging.getLogger("tiercache.agent.arena")


class SharedArena:
    """The file and the mapping of an agent's arena (the agent side; see the module docstring).

    Args:
        path: The arena file to create.
        capacity: Its size in bytes (a multiple of 4096).

    Raises:
        TierFullError: If ``shm_dir`` has no room for ``capacity`` bytes (the message says how
            to make room: ``--shm-size`` for Docker, an ``emptyDir`` size for Kubernetes).
        ConfigError: If the file exists and is held by a live agent.
    """

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not _stale(path):
                raise ConfigError(f"arena {path} belongs to a running agent: stop it first (tiercache agent stop)")
            path.unlink()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(self.fd, 0, capacity)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise TierFullError(shm_too_small(path.parent, capacity)) from e
            self.mapping = mmap.mmap(self.fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise

    def prefault(self) -> None:
        """Fault every page in now, so neither the agent nor a first save pays for it later."""
        prefault(self.mapping)

    def close(self) -> None:
        """Unlink the file and release the descriptor (and with it the lock).

        The mapping is left to whoever owns it now (the :class:`~tiercache.tiers.ram.Arena` made
        over it closes it); trainers that map the file keep their memory until they unmap it.
        """
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def shm_too_small(where: Path, capacity: int) -> str:
    """The one line that says ``where`` cannot hold an arena of ``capacity`` bytes, and what to do."""
    free = free_bytes(where)
    have = f"{free / 2**20:.0f} MiB free" if free is not None else "no room"
    need = max(capacity, 1) / 2**20
    return (f"{where} has {have} but [ram] capacity needs {need:.0f} MiB: give it room (docker run "
            f"--shm-size={int(need * 1.1) + 64}m; Kubernetes: an emptyDir {{medium: Memory, sizeLimit}} "
            f"mounted at {where}), or lower [ram] capacity")


def free_bytes(where: Path) -> int | None:
    """Bytes an unprivileged process may still write in the filesystem of ``where`` (``None``: no such path)."""
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _stale(path: Path) -> bool:
    """Whether no live agent holds ``path`` (its lock is free); raises FileNotFoundError if it is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    finally:
        os.close(fd)  # drops the lock taken just now, if any


def sweep(shm_dir: Path, *, uid: int | None = None, boot: str | None = None) -> list[Path]:
    """Unlink this user's stale arenas in ``shm_dir``: of another boot, or whose agent is gone.

    Only files named like an arena of user ``uid`` are looked at; a live agent's arena (its
    lock held) is never touched, nor a file of that name that is not this user's own regular
    file (another user may create any name in ``/dev/shm``): it is named in a warning and left.

    Returns:
        The files unlinked.
    """
    uid = os.getuid() if uid is None else uid
    boot = boot or boot_id()
    prefix = f"{ARENA_PREFIX}{uid}-"
    gone: list[Path] = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return gone
    for name in names:
        if not (name.startswith(prefix) and name.endswith(ARENA_SUFFIX)):
            continue
        path = shm_dir / name
        # <key>-<boot>[-<random>]: the random part is absent from arenas of earlier versions.
        fields = name[len(prefix) : -len(ARENA_SUFFIX)].split("-")
        other_boot = len(fields) < 2 or fields[1] != boot
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                log.warning("left %s alone: named like an arena of uid %d but %s", path, uid,
                            "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}")
                continue
            if other_boot or _stale(path):
                path.unlink()
                gone.append(path)
                log.info("swept stale arena %s (%s)", path, "another boot" if other_boot else "its agent is gone")
        except FileNotFoundError:
            continue
        except PermissionError as e:
            log.warning("left %s alone: %s", path, e.strerror)
    return gone


def map_shared(fd: int, size: int) -> mmap.mmap:
    """Map the arena whose descriptor came over the agent's socket (the trainer side); closes ``fd``.

    The file is opened again through ``/proc/self/fd``, so the mapping holds a file description
    of its own and never the agent's lock.
    """
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.close(fd)
    try:
        return mmap.mmap(own, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(own)
