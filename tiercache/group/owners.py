"""Who writes which chunk of a multi-rank version: each distinct chunk once per tier (per node if node-local).

The coordinator decides this once per version from every rank's list of chunk ids (the
:mod:`tiercache.group.phases` ``parts`` phase) and tells each rank its own share. A chunk only one
rank holds is its own; a chunk several ranks hold (a replicated tensor: same bytes on every rank)
goes to the holder with the fewest bytes assigned so far, so a replicated tensor cut into
``world_size`` chunks is written slice ``r`` by rank ``r``, in parallel (FastPersist). A declared
replicated chunk (see :mod:`tiercache.group.hashing`) is written by its owner.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiercache.group.topology import Topology

#: One rank's chunks: ``(id, raw length)`` in its layout order.
RankChunks = Sequence[tuple[str, int]]


def _split(chunks: Sequence[RankChunks], ranks: Sequence[int], preset: Mapping[str, int]) -> list[list[int]]:
    """Per rank of ``ranks`` (in that order), the positions in its own chunk list of the chunks it writes.

    Each distinct chunk among those ranks' goes to one rank that holds it: a chunk one rank holds
    to that rank; a chunk several hold to its ``preset`` writer where that is one of them, else to
    the holder with the fewest bytes so far (ties: the lowest rank), the shared chunks in the
    order they are first named, after every rank's own chunks (only it can write those). One pass
    over the ranks' chunks, a dictionary look-up each: the coordinator runs this for thousands of
    ranks once per version.
    """
    first: dict[str, tuple[int, int]] = {}  # id -> (index in ranks, position) where it is first named
    more: dict[str, list[tuple[int, int]]] = {}  # id -> its other holders, for ids several ranks hold
    for i, rank in enumerate(ranks):
        for pos, (cid, _) in enumerate(chunks[rank]):
            at = first.setdefault(cid, (i, pos))
            if at[0] != i:
                others = more.setdefault(cid, [])
                if not others or others[-1][0] != i:  # a rank naming a chunk twice writes it once
                    others.append((i, pos))
    out: list[list[int]] = [[] for _ in ranks]
    load = [0] * len(ranks)
    shared: list[tuple[str, tuple[int, int]]] = []
    for cid, (i, pos) in first.items():
        if cid in more:
            shared.append((cid, (i, pos)))
        else:
            out[i].append(pos)
            load[i] += chunks[ranks[i]][pos][1]
    for cid, at in shared:
        holders = [at, *more[cid]]
        writer = preset.get(cid)
        i, pos = next((h for h in holders if ranks[h[0]] == writer), None) or min(
            holders, key=lambda h: (load[h[0]], h[0]))
        out[i].append(pos)
        load[i] += chunks[ranks[i]][pos][1]
    for positions in out:
        positions.sort()
    return out


def assign_owners(chunks: Sequence[RankChunks], preset: Mapping[str, int] | None = None) -> list[set[str]]:
    """Give each distinct chunk one writer among the ranks that hold it (the same answer from the same input).

    A chunk only one rank holds is its own; a chunk several hold goes to its ``preset`` writer
    if that rank holds it, else to the holder with the fewest bytes assigned so far.

    Args:
        chunks: Per rank, its chunks.
        preset: The writer of some chunks (the owner of a declared replicated chunk), where that
            rank holds it.

    Returns:
        Per rank, the ids it writes.
    """
    split = _split(chunks, range(len(chunks)), preset or {})
    return [{chunks[r][p][0] for p in positions} for r, positions in enumerate(split)]


def writers_by_node(
    chunks: Sequence[RankChunks], topology: Topology, preset: Mapping[str, int] | None = None
) -> list[dict[str, int]]:
    """Per node, each chunk its ranks need -> the rank of that node that writes it to the node's disk.

    The ranks of each node split that node's chunks as :func:`assign_owners` splits a group's
    (a ``preset`` writer counts where it is on the node).
    """
    return _writers(chunks, topology, _by_node(chunks, topology, preset or {}))


def _by_node(chunks: Sequence[RankChunks], topology: Topology, preset: Mapping[str, int]) -> list[list[int]]:
    """Per rank, the positions of the chunks it writes to its node's disk."""
    out: list[list[int]] = [[] for _ in chunks]
    for node in range(topology.count):
        ranks = topology.ranks(node)
        for rank, positions in zip(ranks, _split(chunks, ranks, preset), strict=True):
            out[rank] = positions
    return out


def _writers(
    chunks: Sequence[RankChunks], topology: Topology, positions: Sequence[Sequence[int]]
) -> list[dict[str, int]]:
    """Per node, each chunk its ranks write to its disk -> the rank that writes it."""
    return [{chunks[r][p][0]: r for r in topology.ranks(node) for p in positions[r]} for node in range(topology.count)]


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
        preset: The writer of some chunks (the owner of a declared replicated chunk).

    The work is linear in the ranks' chunks (never in their tensors).
    """
    chunks: list[RankChunks] = [p["chunks"] for p in parts]  # [id, raw length] pairs, as sent
    preset = preset or {}
    per_rank: list[dict[str, list[int]]] = [{} for _ in chunks]
    node: list[list[int]] | None = None
    group: list[list[int]] | None = None
    for tier in tiers:
        if tier in node_local:
            node = node if node is not None else _by_node(chunks, topology, preset)
            positions = node
        else:
            group = group if group is not None else _split(chunks, range(len(chunks)), preset)
            positions = group
        for r, own in enumerate(positions):
            per_rank[r][tier] = own
    return PartsPlan(nbytes=sum(p["nbytes"] for p in parts), per_rank=per_rank,
                     writers=_writers(chunks, topology, node) if node is not None else [],
                     sizes={cid: n for own in chunks for cid, n in own}, part_bytes=[p["part"] for p in parts])


__all__ = ["PartsPlan", "RankChunks", "assign_owners", "plan_parts", "writers_by_node"]
