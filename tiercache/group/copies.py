"""One version's peer copies on one node: read what it sends, verify and land what it receives.

Whatever carries the bytes (gloo between the trainers, :mod:`tiercache.group.peers`; TCP
between the node agents, :mod:`tiercache.agent.peering`), the two ends of a peer copy do the
same: the sender reads a chunk of its node's part (from the fastest tier that holds a verified
copy) or a rank's part manifest (from the node's disk); the receiver checks a chunk against its
id (a part manifest: that it is the part it should be) and writes it to its node's disk with the
durable write of any chunk, and once every chunk landed syncs their names, then writes the part
manifests, which name only chunks that are durable by then.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from tiercache import codecs
from tiercache.errors import IntegrityError
from tiercache.failpoints import failpoint
from tiercache.group.transfer import Move
from tiercache.manifest import Version
from tiercache.names import part_key
from tiercache.restore import byte_view

if TYPE_CHECKING:
    from tiercache.core import CacheCore

#: How a part manifest is named in a move (a chunk is named by its id).
PART = "part:"


class PeerFiles:
    """This node's side of the peer copies of version ``vid`` to and from its disk ``tier``.

    :meth:`land` may be called from several threads at once; :meth:`finish` once, after the last.
    It is handed the core of a cache (a trainer's, or the node agent's; see docs/design.md
    section 1, "The facade and the core").
    """

    def __init__(self, core: CacheCore, tier: str, vid: str) -> None:
        self.core = core
        self.vid = vid
        self.tier = tier
        self.disk = self.core.repo.durable[tier]
        self.algo = self.core.config.hash
        self._lock = threading.Lock()
        self._written: list[str] = []
        self._parts: list[Version] = []  # written once the chunks they name are durable

    def read(self, m: Move) -> torch.Tensor:
        """The raw bytes ``m`` sends (a uint8 tensor of ``m.nbytes``).

        Raises:
            IntegrityError: If the chunk or part manifest is not here as written.
        """
        failpoint("peers.send", m.chunk)
        if m.chunk.startswith(PART):
            data = self.disk.get(part_key(self.vid, int(m.chunk[len(PART):])))
            if data is None or len(data) != m.nbytes:
                raise IntegrityError(f"{m.chunk} of version {self.vid} is not on this node's disk as written")
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = torch.empty(m.nbytes, dtype=torch.uint8)
        self.core.reader.read_chunk(m.chunk, m.nbytes, self.algo, [(byte_view(buf), 0, m.nbytes)])
        return buf

    def land(self, m: Move, data: torch.Tensor | memoryview) -> None:
        """Verify what ``m`` brought and write it to the disk (a part manifest: keep it for :meth:`finish`).

        Raises:
            IntegrityError: If it is not what ``m`` names.
        """
        raw = byte_view(data) if isinstance(data, torch.Tensor) else data
        if m.chunk.startswith(PART):
            rank = int(m.chunk[len(PART):])
            part = Version.from_json(bytes(raw), source=f"rank {rank}'s part of version {self.vid} from rank {m.src}")
            if part.id != self.vid or part.rank != rank:
                raise IntegrityError(f"{m.chunk} from rank {m.src} is not rank {rank}'s part of version {self.vid}")
            with self._lock:
                self._parts.append(part)
            return
        if codecs.content_id(raw, self.algo) != m.chunk:
            raise IntegrityError(f"chunk {m.chunk} from rank {m.src} does not match its id")
        self.core.repo.put_chunk(self.tier, m.chunk, codecs.chunk_object(raw, m.chunk, self.algo))
        with self._lock:
            self._written.append(m.chunk)

    def finish(self) -> None:
        """Make the landed chunks' names durable, then write the part manifests that name them."""
        repo = self.core.repo
        repo.sync_chunks(self.tier, self._written)
        for part in self._parts:
            repo.put_part(self.tier, part)


__all__ = ["PART", "PeerFiles"]
