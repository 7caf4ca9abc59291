"""Hash only what you own: chunks the ranks hold alike are hashed (and written) by one rank each.

A data-parallel job holds the same model and optimizer state on every rank. Naming its chunks
costs every rank a hash of its whole replica, although each rank writes only its share of them
(:func:`tiercache.distributed.assign_owners`). When the caller declares which parts of the state
are the same on every rank (``save(..., group=g, replicated=("model", "optim"))``), and the
ranks' layouts of those parts match, the chunks holding only declared tensors are given an owner
by position, each rank hashes only the chunks it owns plus its own (undeclared) ones, and the
ranks trade the ids: a rank names a chunk it did not hash by its owner's id, which is right
because the bytes are the same. The owners then write those chunks, so every byte of the replica
is hashed once in the group and written once per tier (once per node on a node-local disk).

The declaration is a promise: a tensor declared replicated that differs between ranks is saved
as the owner's bytes on every rank. Nothing is split when no rank declares anything, or when
the ranks' declared chunks do not line up (then every rank hashes all of its own, as before).

The ranks agree at ``save()`` that their states have the same structure and declare the same
key paths (:func:`signature`, exchanged with the save's first collective), so each rank derives
the same owners from its own layout without asking the others. The one collective of a version,
the trade of ids, runs on the engine's hasher thread, on a private gloo group of its own, in save
order on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tiercache.errors import GroupSaveError
from tiercache.format import Flat
from tiercache.layout import Layout


def declared_chunks(layout: Layout, paths: Sequence[str], declared: Sequence[str]) -> list[tuple[int, int]]:
    """``(position, nbytes)`` of the chunks that hold only tensors under the ``declared`` key paths."""
    def covered(path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in declared)

    return [(i, c.nbytes) for i, c in enumerate(layout.chunks)
            if c.pieces and all(covered(paths[p.tensor]) for p in c.pieces)]


def owners_by_position(chunks: Sequence[tuple[int, int]], world_size: int) -> dict[int, int]:
    """Each shared chunk position -> the rank that hashes and writes it (fewest bytes so far, then lowest rank)."""
    load = [0] * world_size
    out: dict[int, int] = {}
    for pos, nbytes in chunks:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[pos] = rank
        load[rank] += nbytes
    return out


class _Split:
    """One version's split (see :class:`tiercache.pipeline.job.HashSplit`)."""

    def __init__(self, owner: SharedHashing, owners: dict[int, int], total: int) -> None:
        self._owner = owner
        self._owners = owners
        rank = owner.rank
        self.mine = [i for i in range(total) if owners.get(i, rank) == rank]
        self.theirs = [i for i in range(total) if owners.get(i, rank) != rank]
        #: Once traded: the id of every shared chunk -> the rank that hashed (and so writes) it.
        self.hashed_by: dict[str, int] = {}

    def exchange(self, ids: dict[int, str] | None) -> dict[int, str]:
        """Trade the ids of the shared chunks; raise if some rank failed to hash its share."""
        shared = None if ids is None else {i: cid for i, cid in ids.items() if i in self._owners}
        got: list[Any] = [None] * self._owner.world_size
        dist.all_gather_object(got, shared, group=self._owner.group)
        failed = [r for r, g in enumerate(got) if g is None]
        if failed:
            raise GroupSaveError(f"rank {failed[0]} could not hash its share of the replicated chunks")
        merged: dict[int, str] = {}
        for g in got:
            merged.update(g)
        self.hashed_by = {cid: self._owners[i] for i, cid in merged.items()}
        return merged


class SharedHashing:
    """The hashing split of one process group's versions.

    Args:
        group: A private gloo group of the process group, used only by the engine's hasher thread.
        rank: This process's rank in ``group``.
        world_size: The size of ``group``.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def split(self, layout: Layout, paths: Sequence[str], declared: Sequence[str]) -> _Split | None:
        """Who hashes which chunk of this version (the same on every rank: their signatures matched).

        Returns:
            The split, or ``None`` (on every rank) when no chunk holds only declared tensors.
        """
        shared = declared_chunks(layout, paths, declared)
        if not shared:
            return None
        return _Split(self, owners_by_position(shared, self.world_size), len(layout.chunks))


def signature(flat: Flat, declared: Sequence[str]) -> str:
    """What must be equal on every rank for the ranks to split hashing: the state's structure and the declaration.

    Two states with the same structure (containers, keys, tensor dtypes and shapes) have the same
    layout for the same chunk size, so the same chunks hold only declared tensors.
    """
    return hashlib.blake2b(repr((flat.structure_key, sorted(declared))).encode(), digest_size=16).hexdigest()


__all__ = ["SharedHashing", "declared_chunks", "owners_by_position", "signature"]
