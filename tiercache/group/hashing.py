"""Hash only what you own: chunks the ranks hold alike are hashed (and written) by one rank each.

A data-parallel job holds the same model and optimizer state on every rank. Naming its chunks
costs every rank a hash of its whole replica, although each rank writes only its share of them
(:mod:`tiercache.group.owners`). When the caller declares which parts of the state
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
key paths (:func:`signature`, sent with the save's first exchange), so each rank derives the same
owners from its own layout without asking the others. The one exchange of a version, the trade
of ids (phase ``<version>/trade``), runs on the engine's hasher thread; a rank that could not
hash its share (or did not stage the version at all) still answers it, with its error.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from tiercache.failpoints import failpoint
from tiercache.format import Flat
from tiercache.group.collective import Channel, Decision
from tiercache.group.status import Status
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


class Split:
    """One version's split (see :class:`tiercache.pipeline.job.HashSplit`).

    Args:
        channel: The hasher thread's channel to the group.
        vid: The version.
        rank: This rank.
        owners: Each shared chunk position -> the rank that hashes it.
        total: The number of chunks of this rank's layout.
    """

    def __init__(self, channel: Channel, vid: str, rank: int, owners: dict[int, int], total: int) -> None:
        self._channel = channel
        self._vid = vid
        self._owners = owners
        self.mine = [i for i in range(total) if owners.get(i, rank) == rank]
        self.theirs = [i for i in range(total) if owners.get(i, rank) != rank]
        #: Once traded: the id of every shared chunk -> the rank that hashed (and so writes) it.
        self.hashed_by: dict[str, int] = {}
        self._traded: Future[dict[int, str]] | None = None
        self._lock = threading.Lock()

    def exchange(self, ids: dict[int, str] | None) -> dict[int, str]:
        """Trade the ids of the shared chunks; raise the group's error if some rank failed to hash its share.

        Traded once per version: a second call (this process hashing the version again after its
        node agent was lost) gets the first one's outcome.
        """
        with self._lock:
            first, self._traded = self._traded is None, self._traded or Future()
        if first:
            try:
                self._traded.set_result(trade(self._channel, self._vid, self, ids))
            except BaseException as e:
                self._traded.set_exception(e)
        return self._traded.result()


def trade(channel: Channel, vid: str, split: Split | None, ids: dict[int, str] | None,
          failure: BaseException | None = None) -> dict[int, str]:
    """This rank's side of a version's trade of ids (also for a rank that has no split: it failed before).

    Raises:
        TierCacheError: The group's failure (the same on every rank).
    """
    try:
        failpoint("group.trade", f"{vid}/trade")
        if split is None or ids is None:
            mine = Status.of(failure) if failure is not None else Status("error", error="GroupSaveError",
                                                                           message="could not hash its share")
        else:
            mine = Status("ok", {str(i): cid for i, cid in ids.items() if i in split._owners})
    except Exception as e:
        mine = Status.of(e)

    def merge(statuses: list[Status]) -> Decision:
        merged: dict[str, str] = {}
        for s in statuses:
            merged.update(s.payload)
        return Decision(merged)

    verdict = channel.exchange(f"{vid}/trade", mine, what=f"version {vid} at hashing", decide=merge)
    verdict.raise_failure(wrap=True)
    merged = {int(i): cid for i, cid in verdict.status.payload.items()}
    if split is not None:
        split.hashed_by = {cid: split._owners[i] for i, cid in merged.items()}
    return merged


class SharedHashing:
    """The hashing split of one group's versions.

    Args:
        rank: This process's rank in the group.
        world_size: The group's size.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def split(self, channel: Channel, vid: str, layout: Layout, paths: Sequence[str],
              declared: Sequence[str]) -> Split | None:
        """Who hashes which chunk of this version (the same on every rank: their signatures matched).

        Returns:
            The split, or ``None`` (on every rank) when no chunk holds only declared tensors.
        """
        shared = declared_chunks(layout, paths, declared)
        if not shared:
            return None
        return Split(channel, vid, self.rank, owners_by_position(shared, self.world_size), len(layout.chunks))


def signature(flat: Flat, declared: Sequence[str]) -> str:
    """What must be equal on every rank for the ranks to split hashing: the state's structure and the declaration.

    Two states with the same structure (containers, keys, tensor dtypes and shapes) have the same
    layout for the same chunk size, so the same chunks hold only declared tensors.
    """
    return hashlib.blake2b(repr((flat.structure_key, sorted(declared))).encode(), digest_size=16).hexdigest()


__all__ = ["SharedHashing", "Split", "declared_chunks", "owners_by_position", "signature", "trade"]
