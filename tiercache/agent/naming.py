"""Where the agent of a cache lives on this node: its key, socket, lock, log and arena file names.

One agent serves one cache on one node. The cache is named by a key: a hash of what identifies
its storage (the disk tier's resolved path, the S3 url) and the node's name when one is set
(``TIERCACHE_NODE``, so tests can simulate several nodes on one machine). Every process of the node
that opens the same cache finds the same socket; two caches never share an agent.

Files next to the socket (``agent-<key>.sock`` in :func:`tiercache.config.agent_runtime_dir`, or
the configured ``[agent] socket``, in a directory of this user's alone: :mod:`tiercache.agent.rundir`):
``.lock`` (held by the running agent: only one starts) and ``.log`` (the agent's log when it was
started detached). The arena is ``tiercache-<uid>-<key>-<boot>-<random>.arena`` in ``[agent] shm_dir``:
the random part (chosen by each agent) keeps another user from taking its name first.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from tiercache.config import CacheConfig, agent_runtime_dir

#: Prefix and suffix of every arena file; :func:`tiercache.agent.arena.sweep` only touches these.
ARENA_PREFIX = "tiercache-"
ARENA_SUFFIX = ".arena"


def cache_key(config: CacheConfig) -> str:
    """16 hex digits naming the cache's storage (disk path, S3 url) and node."""
    ident = {
        "disk": str(config.disk.path.expanduser().resolve()) if config.disk is not None else None,
        "s3": config.s3.url if config.s3 is not None else None,
        "node": config.node,
    }
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=8).hexdigest()


def boot_id() -> str:
    """This boot's id (8 hex digits of ``/proc/sys/kernel/random/boot_id``; ``"0"`` where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip().replace("-", "")[:8] or "0"
    except OSError:
        return "0"


@dataclass(frozen=True)
class AgentPlace:
    """The files of one cache's agent on this node.

    Attributes:
        key: The cache's key (:func:`cache_key`).
        socket: The Unix socket it listens on.
        shm_dir: Where its arena file lives.
    """

    key: str
    socket: Path
    shm_dir: Path

    @property
    def lock(self) -> Path:
        """Held (``flock``) by the running agent for its whole life."""
        return self.socket.with_name(self.socket.name + ".lock")

    @property
    def log(self) -> Path:
        """The log of an agent started detached."""
        return self.socket.with_name(self.socket.name + ".log")

    def arena(self, boot: str | None = None) -> Path:
        """A new name for the arena file of this cache for this user on this boot (random: nobody can guess it)."""
        return (self.shm_dir
                / f"{ARENA_PREFIX}{os.getuid()}-{self.key}-{boot or boot_id()}-{secrets.token_hex(8)}{ARENA_SUFFIX}")


def place(config: CacheConfig) -> AgentPlace:
    """Where the agent of ``config``'s cache lives (``config.agent`` must be set).

    Raises:
        ValueError: If the config has no ``[agent]`` table.
    """
    agent = config.agent
    if agent is None:
        raise ValueError("no [agent] table in the config")
    key = cache_key(config)
    sock = agent.socket.expanduser() if agent.socket is not None else agent_runtime_dir() / f"agent-{key}.sock"
    return AgentPlace(key=key, socket=sock.absolute(), shm_dir=agent.shm_dir)
