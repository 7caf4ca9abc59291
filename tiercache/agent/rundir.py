"""The agent's directory and the files in it, kept out of other users' reach.

The directory of the agent's socket (``/tmp/tiercache-<uid>`` without ``XDG_RUNTIME_DIR``, a
name anyone on the node can take first) holds the socket, the lock and the log of an agent
started detached. Another user who owns that directory, or may write to it, could swap any of
them. So (see ``docs/agent.md``, "Security"):

* the directory is created ``0700``, or, when it exists, used only if ``lstat`` says it is a real
  directory (no symlink), owned by this user, mode ``0700`` exactly (:func:`private_dir`);
  otherwise every process refuses it in one line, and a trainer saves in process;
* its files are opened with ``O_NOFOLLOW`` and checked on the descriptor: a regular file owned
  by this user (:func:`open_private`);
* nothing the agent runs with is read from a file there: its config reaches it through a pipe
  (``tiercache agent --spec-fd``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from tiercache.errors import ConfigError

_WHAT_TO_DO = "remove it, or set XDG_RUNTIME_DIR or [agent] socket to a directory of your own (mode 0700)"


def dir_problem(path: Path) -> str | None:
    """Why ``path`` is no private directory of this user (``lstat``: a symlink counts as one), or ``None``.

    A missing directory is no problem here (:func:`private_dir` creates it).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"the agent's directory {path} cannot be checked: {e.strerror}"
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        why = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif st.st_uid != uid:
        why = f"belongs to uid {st.st_uid}, not this user ({uid})"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    else:
        return None
    return f"the agent's directory {path} {why}: {_WHAT_TO_DO}"


def check_private_dir(path: Path) -> None:
    """Refuse ``path`` if it exists and is no private directory of this user (see :func:`dir_problem`).

    Raises:
        ConfigError: One line naming the directory and what to do.
    """
    problem = dir_problem(path)
    if problem is not None:
        raise ConfigError(problem)


def private_dir(path: Path) -> Path:
    """Create ``path`` ``0700`` (its parents as needed), or check the one that is there.

    Returns:
        ``path``.

    Raises:
        ConfigError: If it exists and is no private directory of this user, or cannot be made.
    """
    check_private_dir(path)  # before anything is made under a directory someone else may own
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    except OSError as e:
        raise ConfigError(f"cannot create the agent's directory {path}: {e.strerror}: {_WHAT_TO_DO}") from None
    check_private_dir(path)  # what is there now, whoever made it
    return path


def open_private(path: Path, flags: int) -> int:
    """Open (``O_CREAT`` in ``flags``: or create, ``0600``) a file of the agent's directory, never through a symlink.

    Returns:
        The descriptor (close-on-exec), of a regular file owned by this user.

    Raises:
        ConfigError: If ``path`` is a symlink, no regular file, or another user's.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        why = "is a symlink" if os.path.islink(path) else f"cannot be opened: {e.strerror}"
        raise ConfigError(f"the agent's file {path} {why}: remove it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"belongs to uid {st.st_uid}"
        raise ConfigError(f"the agent's file {path} {why}: remove it")
    return fd


__all__ = ["check_private_dir", "dir_problem", "open_private", "private_dir"]
