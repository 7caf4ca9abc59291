"""Starting an agent detached from the trainer, and the checks an agent runs before it starts.

**Start** (:func:`start_detached`): the first process on a node that saves with ``[agent] start =
"auto"`` and finds no agent runs ``python -m tiercache agent`` as a new session
(``start_new_session``: not in the trainer's process group, so it outlives the trainer and a
signal to the trainer's group), with no file of the trainer open, its output to the agent's log
(opened without following a symlink, in a directory only this user may touch: :mod:`tiercache.agent.rundir`),
and the trainer's config on its stdin (a pipe: no file another user could swap). It never forks the trainer's
interpreter: the child execs at once. Two processes starting one at the same moment are fine: the
second agent finds the first one's lock and exits quietly.

**Checks** (:func:`check_environment`), one line each, before the agent takes any memory:

* the arena directory (``/dev/shm``) has room for ``[ram] capacity`` (Docker gives containers
  64 MB unless ``--shm-size`` says otherwise);
* the memory limit of the agent's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, the
  smallest on the way up) holds the arena and the agent (``/dev/shm`` pages count against it);
* the socket path is not another user's, and its directory is this user's alone
  (:func:`tiercache.agent.rundir.dir_problem`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tiercache.agent.arena import free_bytes, shm_too_small
from tiercache.agent.naming import AgentPlace
from tiercache.agent.protocol import Connection
from tiercache.agent.rundir import dir_problem, open_private, private_dir
from tiercache.config import CacheConfig
from tiercache.errors import AgentUnavailableError

#: Memory the agent needs besides its arena (interpreter, torch, buffers of the tier writers).
AGENT_OVERHEAD = 512 << 20
#: A cgroup limit at or above this means "no limit" (v1 reports 2**63 rounded down to a page).
_UNLIMITED = 1 << 62
_POLL_S = 0.05


def check_environment(config: CacheConfig, place: AgentPlace, *, proc_cgroup: Path = Path("/proc/self/cgroup"),
                      cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[str]:
    """What keeps this node from hosting the agent of ``config``'s cache, one line per problem.

    Args:
        config: The cache's config (its ``[ram] capacity`` is the arena's size).
        place: Where the agent lives (socket, arena directory).
        proc_cgroup: This process's cgroup membership (``/proc/self/cgroup``).
        cgroup_root: Where the cgroup filesystems are mounted.

    Returns:
        The problems found (empty: the agent may start).
    """
    problems: list[str] = []
    capacity = config.ram.capacity if config.ram is not None else "auto"
    if isinstance(capacity, int):
        st = free_bytes(place.shm_dir)
        if st is None:
            problems.append(f"arena directory {place.shm_dir} does not exist: mount a tmpfs there or set "
                            "[agent] shm_dir")
        elif st < capacity:
            problems.append(shm_too_small(place.shm_dir, capacity))
        limit = cgroup_memory_limit(proc_cgroup, cgroup_root)
        if limit is not None and limit[0] < capacity + AGENT_OVERHEAD:
            value, source = limit
            problems.append(
                f"the memory limit of this container is {value / 2**20:.0f} MiB ({source}), smaller than the "
                f"arena ({capacity / 2**20:.0f} MiB, [ram] capacity) plus the agent ({AGENT_OVERHEAD >> 20} MiB): "
                "raise it (docker run --memory; Kubernetes: the agent container's resources.limits.memory "
                "counts the arena) or lower [ram] capacity")
    problems.extend(_socket_problems(place.socket))
    return problems


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                        cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """The smallest memory limit on this process's cgroup path, and the file it was read from.

    Reads cgroup v2 (``0::/path``: ``memory.max`` at each level up to the root) and v1 (the
    ``memory`` controller's ``memory.limit_in_bytes``). ``None`` when no limit is set or the
    files cannot be read.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = cgroup_root, "memory.max"
            if not (base / "cgroup.controllers").exists():
                base = cgroup_root / "unified"
        elif "memory" in controllers.split(","):
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        for level in [rel, *rel.parents]:
            f = base / level / name
            try:
                text = f.read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < _UNLIMITED:
                found.append((int(text), str(f)))
    return min(found) if found else None


def _socket_problems(sock: Path) -> list[str]:
    uid = os.getuid()
    out = []
    try:
        st = os.lstat(sock)
    except FileNotFoundError:
        pass
    except OSError as e:
        out.append(f"agent socket {sock} cannot be checked: {e.strerror}")
    else:
        if st.st_uid != uid:
            out.append(f"agent socket {sock} is in use by another user (uid {st.st_uid}): set [agent] socket "
                       "to a path of your own")
    problem = dir_problem(sock.parent)
    if problem is not None:
        out.append(problem)
    return out


def spec_of(config: CacheConfig, place: AgentPlace) -> dict[str, object]:
    """The config an agent started detached runs with: the trainer's, with every path absolute."""
    data = config.model_dump(mode="json", exclude_none=True)
    if config.disk is not None:
        data["disk"]["path"] = str(config.disk.path.expanduser().resolve())
    agent = data.setdefault("agent", {})
    agent["socket"] = str(place.socket)
    agent["shm_dir"] = str(place.shm_dir.expanduser().absolute())
    return data


def start_detached(config: CacheConfig, place: AgentPlace, connect: Callable[[], Connection | None]) -> Connection:
    """Start the agent of ``config``'s cache detached, and connect to it once it listens.

    Args:
        config: The trainer's config (the agent runs it, every path made absolute).
        place: Where the agent will live.
        connect: Connects to it, or returns ``None`` while nothing listens.

    Returns:
        A connection to the agent (this one, or one another process started meanwhile).

    Raises:
        ConfigError: If the socket's directory or the log is not this user's alone (one line:
            the trainer then saves in process).
        AgentUnavailableError: If it exits without listening (the message is the last line of
            its log: a failed environment check, say) or does not listen within
            ``[agent] connect_timeout``.
    """
    assert config.agent is not None
    private_dir(place.socket.parent)
    log_fd = open_private(place.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        start = os.fstat(log_fd).st_size
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache", "agent", "--spec-fd", "0", "--exist-ok"],
            stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, close_fds=True, start_new_session=True,
            cwd="/", env=_same_code_env(),
        )
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError), proc.stdin:  # an agent that died at once: its log says why
            proc.stdin.write(json.dumps(spec_of(config, place)).encode())
    except BaseException:
        os.close(log_fd)
        raise
    try:
        return _wait_listening(config, place, proc, connect, log_fd, start)
    finally:
        os.close(log_fd)


def _wait_listening(config: CacheConfig, place: AgentPlace, proc: subprocess.Popen[bytes],
                    connect: Callable[[], Connection | None], log_fd: int, start: int) -> Connection:
    assert config.agent is not None
    deadline = time.monotonic() + config.agent.connect_timeout
    while True:
        conn = connect()
        if conn is not None:
            return conn
        code = proc.poll()
        if code not in (None, 0):
            raise AgentUnavailableError(f"the node agent could not start: {_last_line(log_fd, start)} "
                                        f"(exit {code}; log {place.log})")
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                proc.terminate()
            raise AgentUnavailableError(f"the node agent did not listen on {place.socket} within "
                                        f"{config.agent.connect_timeout:g}s (log {place.log})")
        time.sleep(_POLL_S)


def _same_code_env() -> dict[str, str]:
    """This process's environment, with the directory this tiercache came from first on ``PYTHONPATH``.

    The agent then runs the very code of the process that started it (a source checkout, a
    virtual environment with another version installed), whatever its working directory.
    """
    # This file's place in the package, not an import of the package: tiercache imports the
    # agent's client, which starts the agent through this module (no import cycle).
    env = dict(os.environ)
    home = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([home, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def _last_line(log_fd: int, start: int) -> str:
    """The last line the agent wrote to its log (read through the descriptor it was given)."""
    try:
        data = os.pread(log_fd, max(0, os.fstat(log_fd).st_size - start), start)
    except OSError:
        return "(no log)"
    lines = [ln.strip() for ln in data.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "(nothing logged)"
