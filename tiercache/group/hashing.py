"""Check what the ranks declared alike, and write it once: chunks the ranks hold alike get one writer each.

A data-parallel job holds the same model and optimizer state on every rank. When the caller
declares which parts of the state are the same on every rank (``save(..., group=g,
replicated=("model", "optim"))``), and the ranks' layouts of those parts match, the chunks holding
only declared tensors are given an owner by position (:func:`owners_by_position`), which writes
them for the group (:mod:`tiercache.group.owners` takes the owners as its preset writers), so
every byte of the replica is written once per tier (once per node on a node-local disk).

The declaration is a promise the ranks check: every rank hashes all of its chunks, declared ones
included, and the ranks trade the declared chunks' ids (phase ``<version>/trade``); the
coordinator compares them by position (:func:`compare`). A declared tensor that differs between
ranks fails the version on every rank with one error naming the tensors and the ranks, before
any of its chunks is written: otherwise some rank's bytes would be stored under another rank's
ids (unreadable) or a restore would mix the ranks' chunks. (Before issue 43 each rank hashed only
the chunks it owned and named the others by their owners' ids, which no rank could check;
docs/benchmarks.md has what that split measured.)

The ranks agree at ``save()`` that their states have the same structure and declare the same
key paths (:func:`signature`, sent with the save's first exchange), so each rank derives the same
owners from its own layout without asking the others. The trade runs on the engine's hasher
thread; a rank that could not hash its chunks (or did not stage the version at all) still
answers it, with its error.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from tiercache.errors import GroupSaveError
from tiercache.failpoints import failpoint
from tiercache.format import Flat
from tiercache.group.collective import Channel, Decision
from tiercache.group.phase_status import Status
from tiercache.layout import Layout


def declared_chunks(layout: Layout, paths: Sequence[str], declared: Sequence[str]) -> list[tuple[int, int]]:
    """``(position, nbytes)`` of the chunks that hold only tensors under the ``declared`` key paths."""
    def covered(path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in declared)

    return [(i, c.nbytes) for i, c in enumerate(layout.chunks)
            if c.pieces and all(covered(paths[p.tensor]) for p in c.pieces)]


def owners_by_position(chunks: Sequence[tuple[int, int]], world_size: int) -> dict[int, int]:
    """Each declared chunk position -> the rank that writes it (fewest bytes so far, then lowest rank)."""
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
        owners: Each declared chunk position -> the rank that writes it.
        names: Each declared chunk position -> the key paths of its tensors (for the error).
    """

    def __init__(self, channel: Channel, vid: str, owners: dict[int, int], names: dict[int, list[str]]) -> None:
        self._channel = channel
        self._vid = vid
        self._owners = owners
        self._names = names
        #: Once traded: the id of every declared chunk -> the rank that writes it (its owner).
        self.declared_writers: dict[str, int] = {}
        self._traded: Future[None] | None = None
        self._lock = threading.Lock()

    def exchange(self, ids: dict[int, str] | None) -> None:
        """Trade the ids of the declared chunks; raise the group's error if some rank failed or they differ.

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
        self._traded.result()


def trade(channel: Channel, vid: str, split: Split | None, ids: dict[int, str] | None,
          failure: BaseException | None = None) -> None:
    """This rank's side of a version's trade of ids (also for a rank that has no split: it failed before).

    Raises:
        TierCacheError: The group's failure (the same on every rank).
    """
    try:
        failpoint("group.trade", f"{vid}/trade")
        if split is None or ids is None:
            mine = Status.of(failure) if failure is not None else Status("error", error="GroupSaveError",
                                                                           message="could not hash its chunks")
        else:
            mine = Status("ok", {str(i): cid for i, cid in ids.items() if i in split._owners})
    except Exception as e:
        mine = Status.of(e)

    def merge(statuses: list[Status]) -> Decision:
        return Decision(compare(statuses, split._names if split is not None else {}))

    verdict = channel.exchange(f"{vid}/trade", mine, what=f"version {vid} at hashing", decide=merge)
    verdict.raise_failure(wrap=True)
    if verdict.status.payload["differ"]:
        raise GroupSaveError(f"version {vid} at hashing failed: {verdict.status.payload['differ']}")
    if split is not None:
        split.declared_writers = {cid: split._owners[int(i)] for i, cid in verdict.status.payload["ids"].items()}


def compare(statuses: Sequence[Status], names: dict[int, list[str]]) -> dict[str, Any]:
    """The coordinator's check of the trade: every rank named each declared chunk with the same id.

    Returns:
        ``ids`` (each declared position -> its id) and ``differ``: ``None``, or the line every rank
        raises, naming the declared tensors whose bytes differ between ranks and the ranks that
        hold other bytes than rank 0 (the state is the user's: only they can tell which
        replica is right, so the version keeps none).
    """
    ids: dict[str, str] = dict(statuses[0].payload)
    tensors: set[str] = set()
    ranks: set[int] = set()
    for rank, s in enumerate(statuses[1:], start=1):
        for pos, cid in s.payload.items():
            if ids.get(pos, cid) != cid:
                tensors.update(names.get(int(pos), [f"chunk {pos}"]))
                ranks.add(rank)
    differ = None
    if ranks:
        differ = (f"tensors {sorted(tensors)} were declared replicated but ranks {sorted(ranks)} hold other "
                  f"bytes than rank 0; declare replicated= only for state that is the same on every rank")
    return {"ids": ids, "differ": differ}


class SharedHashing:
    """Who writes the declared chunks of one group's versions, and the check of their ids.

    Args:
        rank: This process's rank in the group.
        world_size: The group's size.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def split(self, channel: Channel, vid: str, layout: Layout, paths: Sequence[str],
              declared: Sequence[str]) -> Split | None:
        """Which chunks of this version are declared alike, and who writes each.

        The same on every rank: their signatures matched.

        Returns:
            The split, or ``None`` (on every rank) when no chunk holds only declared tensors.
        """
        shared = declared_chunks(layout, paths, declared)
        if not shared:
            return None
        names = {i: sorted({paths[p.tensor] for p in layout.chunks[i].pieces}) for i, _ in shared}
        return Split(channel, vid, owners_by_position(shared, self.world_size), names)


def signature(flat: Flat, declared: Sequence[str]) -> str:
    """What must be equal on every rank for the ranks to compare declared chunks: structure and declaration.

    Two states with the same structure (containers, keys, tensor dtypes and shapes) have the same
    layout for the same chunk size, so the same chunks hold only declared tensors.
    """
    return hashlib.blake2b(repr((flat.structure_key, sorted(declared))).encode(), digest_size=16).hexdigest()


__all__ = ["SharedHashing", "Split", "compare", "declared_chunks", "owners_by_position", "signature", "trade"]
