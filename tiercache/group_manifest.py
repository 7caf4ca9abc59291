"""One version of a group: the ranks' parts merged into one manifest, who writes which chunk, the commit.

The pure side of the multi-rank protocol (:mod:`tiercache.distributed`): every rank computes the
same manifest and the same writers from the same partial manifests, so they agree without a word
more. The commit itself goes through the cache's repo (:meth:`tiercache.repo.Repo.commit`,
:meth:`~tiercache.repo.Repo.adopt`), shared with the DCP integration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiercache.errors import InvalidArgumentError
from tiercache.manifest import NodePart, Piece, RankPart, Version
from tiercache.nodes import Topology


def _shift(node: Any, off: int) -> Any:
    """An object tree (see :mod:`tiercache.format`) with every tensor index moved by ``off``."""
    if type(node) is not list or not node:
        return node
    tag = node[0]
    if tag == "t" and len(node) == 2:
        return ["t", node[1] + off]
    if tag in ("list", "tuple"):
        return [tag, *(_shift(v, off) for v in node[1:])]
    if tag in ("dict", "odict"):
        return [tag, {k: _shift(v, off) for k, v in node[1].items()}, *(_shift(m, off) for m in node[2:])]
    if tag in ("kdict", "kodict"):
        return [tag, [[k, _shift(v, off)] for k, v in node[1]], *(_shift(m, off) for m in node[2:])]
    return node  # scalar leaves hold no tensors


def merge_parts(parts: list[Version], nodes: tuple[NodePart, ...] = ()) -> Version:
    """Merge the ranks' partial manifests (rank order) into the group's version manifest.

    Chunks are deduplicated by id in first-seen order, tensors are concatenated in rank order
    (paths prefixed with the rank, as in a list of the ranks' states), the object tree is
    the list of the ranks' trees, and ``nodes`` says which node each rank ran on.

    Raises:
        InvalidArgumentError: If the ranks hash chunks with different algorithms.
    """
    head = parts[0]
    if any(p.hash_algo != head.hash_algo for p in parts):
        raise InvalidArgumentError("the ranks' caches use different hash algorithms: configure the same `hash`")
    chunks: list = []
    index: dict[str, int] = {}
    tensors: list = []
    rank_parts: list[RankPart] = []
    trees: list[Any] = []
    for rank, part in enumerate(parts):
        remap = []
        for c in part.chunks:
            if c.id not in index:
                index[c.id] = len(chunks)
                chunks.append(c)
            remap.append(index[c.id])
        first = len(tensors)
        for t in part.tensors:
            pieces = tuple(Piece(chunk=remap[p.chunk], chunk_offset=p.chunk_offset, offset=p.offset, nbytes=p.nbytes)
                           for p in t.pieces)
            tensors.append(t.model_copy(update={"path": f"{rank}/{t.path}", "pieces": pieces}))
        rank_parts.append(RankPart(first=first, count=len(part.tensors), tree=part.tree, pickled=part.pickled))
        trees.append(_shift(part.tree, first))
    return Version(
        id=head.id, parent=head.parent, branch=head.branch, step=head.step, created_at=head.created_at,
        meta=head.meta, hash_algo=head.hash_algo, chunks=tuple(chunks), tensors=tuple(tensors),
        tree=["list", *trees], pickled=any(p.pickled for p in parts), nbytes=sum(p.nbytes for p in parts),
        parts=tuple(rank_parts), nodes=nodes,
    )


def assign_owners(parts: list[Version], preset: Mapping[str, int] | None = None) -> list[set[str]]:
    """Give each distinct chunk one writer rank; see the module docstring.

    ``preset`` names the writer of some chunks (the rank that hashed a replicated chunk, see
    :mod:`tiercache.hash_split`), where that rank holds it. Every rank computes the same answer
    from the same partial manifests.
    """
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, part in enumerate(parts):
        for c in part.chunks:
            ranks = holders.setdefault(c.id, [])
            size[c.id] = c.nbytes
            if rank not in ranks:
                ranks.append(rank)
    owned: list[set[str]] = [set() for _ in parts]
    load = [0] * len(parts)
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
    parts: list[Version], topology: Topology, preset: Mapping[str, int] | None = None
) -> list[dict[str, int]]:
    """Per node, each chunk its ranks need -> the rank of that node that writes it to the node's disk.

    The ranks of each node split that node's chunks as :func:`assign_owners` splits a group's
    (a ``preset`` writer counts where it is on the node).
    """
    out: list[dict[str, int]] = []
    for node in range(topology.count):
        ranks = topology.ranks(node)
        local = {cid: ranks.index(r) for cid, r in (preset or {}).items() if r in ranks}
        owned = assign_owners([parts[r] for r in ranks], local)
        out.append({cid: ranks[i] for i, ids in enumerate(owned) for cid in ids})
    return out


def rank_view(version: Version, rank: int) -> Version:
    """The manifest of one rank's part of a multi-rank version, as if that rank had saved alone."""
    part = version.parts[rank]
    cut = len(f"{rank}/")  # merge_parts prefixed the rank's paths; ``into=`` matches the rank's own
    tensors = tuple(t.model_copy(update={"path": t.path[cut:]})
                    for t in version.tensors[part.first : part.first + part.count])
    return version.model_copy(update={
        "tensors": tensors, "tree": part.tree, "pickled": part.pickled,
        "nbytes": sum(t.nbytes for t in tensors), "parts": (),
    })


__all__ = ["assign_owners", "merge_parts", "rank_view", "writers_by_node"]
