"""Who writes which chunk of a multi-rank version: each distinct chunk once per tier (per node if node-local).

The coordinator decides this once per version from every rank's list of chunk ids (the
:mod:`tiercache.group.phases` ``parts`` phase) and tells each rank its own share. A chunk only one
rank holds is its own; a chunk several ranks hold (a replicated tensor: same bytes on every rank)
goes to the holder with the fewest bytes assigned so far, so a replicated tensor cut into
``world_size`` chunks is written slice ``r`` by rank ``r``, in parallel (FastPersist). A chunk
one rank hashed for the group (see :mod:`tiercache.group.hashing`) is written by that rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


__all__ = ["RankChunks", "assign_owners", "writers_by_node"]
