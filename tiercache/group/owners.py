"""Who writes which chunk of a multi-rank version: each distinct chunk once per tier (per node if node-local).

The coordinator decides this once per version from every rank's list of chunk ids (the
:mod:`tiercache.group.phases` ``parts`` phase) and tells each rank its own share. A chunk only one
rank holds is its own; a chunk several ranks hold (a replicated tensor: same bytes on every rank)
goes to the holder with the fewest bytes assigned so far, so a replicated tensor cut into
``world_size`` chunks is written slice ``r`` by rank ``r``, in parallel (FastPersist). A chunk
one rank hashed for the group (see :mod:`tiercache.group.hashing`) is written by that rank.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.group.topology import Topology

#: One rank's chunks: ``(id, raw length)`` in its layout order.
RankChunks = Sequence[tuple[str, int]]


def assign_owners(chunks: Sequence[RankChunks], preset: Mapping[str, int] | None = None) -> list[set[str]]:
    """Give each distinct chunk one writer among the ranks that hold it (the same answer from the same input).

    Args:
        chunks: Per rank, its chunks.
        preset: The writer of some chunks (the rank that hashed a replicated chunk), where that
            rank holds it.

    Returns:
        Per rank, the ids it writes.
    """
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, own in enumerate(chunks):
        for cid, nbytes in own:
            ranks = holders.setdefault(cid, [])
            size[cid] = nbytes
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    owned: list[set[str]] = [set() for _ in chunks]
    load = [0] * len(chunks)
    preset = preset or {}
    for single in (True, False):  # a rank's own chunks first: only it can write them
        for cid, ranks in holders.items():
            if (len(ranks) == 1) != single:
                continue
            rank = preset[cid] if preset.get(cid) in ranks else min(ranks, key=lambda r: (load[r], r))
            owned[rank].add(cid)
            load[rank] += size[cid]
    return owned


def writers_by_node(
    chunks: Sequence[RankChunks], topology: Topology, preset: Mapping[str, int] | None = None
) -> list[dict[str, int]]:
    """Per node, each chunk its ranks need -> the rank of that node that writes it to the node's disk.

    The ranks of each node split that node's chunks as :func:`assign_owners` splits a group's
    (a ``preset`` writer counts where it is on the node).
    """
    out: list[dict[str, int]] = []
    for node in range(topology.count):
        ranks = topology.ranks(node)
        local = {cid: ranks.index(r) for cid, r in (preset or {}).items() if r in ranks}
        owned = assign_owners([chunks[r] for r in ranks], local)
        out.append({cid: ranks[i] for i, ids in enumerate(owned) for cid in ids})
    return out


@dataclass(frozen=True)
class PartsPlan:
    """The coordinator's decision at a version's ``parts`` phase (see :func:`plan_parts`).

    Attributes:
        nbytes: The version's tensor bytes, every rank's together (the group manifest says it).
        per_rank: Per rank, per tier, the positions in that rank's own chunk list of the chunks
            it writes there (each rank is sent its own only).
        writers: Per node, each chunk of its part -> the rank that writes it to the node's disk
            (empty without a node-local tier); the peer copies are sent by these ranks.
        sizes: Every distinct chunk's raw length, in the ranks' order.
        part_bytes: The size of each rank's part manifest.
    """

    nbytes: int
    per_rank: list[dict[str, list[int]]]
    writers: list[dict[str, int]]
    sizes: dict[str, int]
    part_bytes: list[int]


def plan_parts(parts: Sequence[Mapping[str, Any]], tiers: Sequence[str], node_local: Collection[str],
               topology: Topology, preset: Mapping[str, int] | None = None) -> PartsPlan:
    """Decide who writes which chunk on each tier, from every rank's summary of its part.

    Args:
        parts: Per rank, what it sent at ``parts``: ``chunks`` (``[id, raw length]`` in its layout
            order), ``nbytes`` (its tensor bytes) and ``part`` (its part manifest's size).
        tiers: The durable tiers.
        node_local: Those of them every node holds on its own (the nodes' disks).
        topology: The group's nodes.
        preset: The writer of some chunks (the rank that hashed a replicated chunk).

    The work is linear in the ranks' chunks (never in their tensors).
    """
    chunks = [[(cid, n) for cid, n in p["chunks"]] for p in parts]
    owners: dict[str, list[set[str]]] = {}
    writers: list[dict[str, int]] = []
    for tier in tiers:
        if tier in node_local:
            writers = writers or writers_by_node(chunks, topology, preset)
            owners[tier] = [set() for _ in chunks]
            for node_writers in writers:
                for cid, r in node_writers.items():
                    owners[tier][r].add(cid)
        else:
            owners[tier] = assign_owners(chunks, preset)
    per_rank = []
    for r, own in enumerate(chunks):
        position = {cid: i for i, (cid, _) in enumerate(own)}
        per_rank.append({t: sorted(position[c] for c in owned[r]) for t, owned in owners.items()})
    return PartsPlan(nbytes=sum(p["nbytes"] for p in parts), per_rank=per_rank, writers=writers,
                     sizes={cid: n for own in chunks for cid, n in own}, part_bytes=[p["part"] for p in parts])


__all__ = ["PartsPlan", "RankChunks", "assign_owners", "plan_parts", "writers_by_node"]
