"""A multi-rank version's manifests: one group manifest naming one part manifest per rank.

A version saved by N ranks is stored as ``versions/<id>.json``, a *group manifest* (a
:class:`~tiercache.manifest.Version` with :attr:`~tiercache.manifest.Version.ranks` = N and its
nodes, its total size, parent, step, meta...; no tensors, chunks or tree of its own), and
``parts/<id>/<rank>.json`` per rank, that rank's *part manifest* (its own chunks, tensor table
and object tree, as a single-process save would write them). Each rank writes its own part; the
group manifest says nothing per rank but which node it ran on, so every rank can build it from
what the group agreed on (no rank needs the others' parts or sizes), no rank reads, parses or
merges another rank's tables to save a version, and a restore at the same world size reads its
own part only.

Where one process needs the whole version (``tiercache restore`` of a multi-rank version,
``ls``, ``verify``, ``gc``), :func:`merge` builds it once, in O(total): the tensor table in rank
order (paths prefixed with the rank), the object tree the list of the ranks' trees, and
:attr:`~tiercache.manifest.Version.parts` the rank ranges (:func:`rank_view` undoes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiercache.errors import IntegrityError
from tiercache.manifest import NodePart, Piece, RankPart, Version


def part_of(own: Version, rank: int) -> Version:
    """Rank ``rank``'s part manifest, from the manifest of its own part as it staged it.

    The group manifest holds the version's parent, meta and the rest; the part keeps only what
    is its own (its ``parent`` is ``None`` and its ``meta`` empty).
    """
    return own.model_copy(update={"rank": rank, "parent": None, "meta": {}, "parts": (), "nodes": (), "ranks": 0})


def group_header(
    *, id: str, parent: str | None, branch: str, step: int, created_at: Any, meta: dict[str, Any], hash_algo: str,
    ranks: int, nbytes: int, nodes: tuple[NodePart, ...] = (),
) -> Version:
    """The group manifest of a multi-rank version (see the module docstring)."""
    return Version(id=id, parent=parent, branch=branch, step=step, created_at=created_at, meta=meta,
                   hash_algo=hash_algo, chunks=(), tensors=(), tree=None, nbytes=nbytes, ranks=ranks,
                   nodes=nodes)  # type: ignore[arg-type]


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


def check_part(header: Version, rank: int, part: Version, where: str) -> Version:
    """``part`` if it is rank ``rank``'s part of ``header``'s version.

    Raises:
        IntegrityError: If it is another version's or rank's part, or hashed another way.
    """
    if part.id != header.id or part.rank != rank or part.hash_algo != header.hash_algo:
        raise IntegrityError(f"{where} is not rank {rank}'s part of version {header.id} (it says version "
                             f"{part.id}, rank {part.rank}, hash {part.hash_algo})")
    return part


def merge(header: Version, parts: Sequence[Version]) -> Version:
    """The whole multi-rank version: ``header``'s fields with the ranks' parts merged (in rank order).

    Chunks are deduplicated by id in first-seen order, tensors concatenated in rank order (paths
    prefixed with the rank, as in a list of the ranks' states) and the object tree is the list
    of the ranks' trees.

    Raises:
        IntegrityError: If the parts do not add up to the version the group manifest describes.
    """
    if len(parts) != header.world or sum(p.nbytes for p in parts) != header.nbytes:
        raise IntegrityError(f"version {header.id}: {len(parts)} parts of {sum(p.nbytes for p in parts)} bytes do "
                             f"not add up to its group manifest ({header.world} ranks, {header.nbytes} bytes)")
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
    return header.model_copy(update={
        "chunks": tuple(chunks), "tensors": tuple(tensors), "tree": ["list", *trees],
        "pickled": any(p.pickled for p in parts), "parts": tuple(rank_parts),
        "ranks": header.ranks or len(parts),
    })


def rank_view(version: Version, rank: int) -> Version:
    """The manifest of one rank's part of a merged multi-rank version, as if that rank had saved alone."""
    part = version.parts[rank]
    cut = len(f"{rank}/")  # merge prefixed the rank's paths; ``into=`` matches the rank's own
    tensors = tuple(t.model_copy(update={"path": t.path[cut:]})
                    for t in version.tensors[part.first : part.first + part.count])
    return version.model_copy(update={
        "tensors": tensors, "tree": part.tree, "pickled": part.pickled,
        "nbytes": sum(t.nbytes for t in tensors), "parts": (), "ranks": 0, "nodes": (),
    })


__all__ = ["check_part", "group_header", "merge", "part_of", "rank_view"]
