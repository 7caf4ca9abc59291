"""Restore over a process group: each rank reads its own part, from its own node, a peer, else S3.

Every rank calls :func:`restore` (through ``cache.restore(ref, group=g)``) at the same point;
each exchange is a phase of the group's collective layer (``restore/<n>/<phase>``):

1. ``resolve``: each rank resolves the ref; the group takes rank 0's answer (or the first rank's
   that has one: a rank whose node lost its disk knows no version). The verdict carries the few
   fields every rank needs (id, branch, parent, how many ranks saved it), never a rank's tables.
   With node agents, ``adopt`` comes first: the group commits the newest version of the branch
   its trainers left in node RAM when they died (:mod:`tiercache.group.orphans`).
2. ``parts``: each rank reads its own part manifest (its node's disk first, then S3; a version
   saved by one process is read whole by every rank). Ranks that find none (their node was lost
   and there is no S3) get it from a rank whose node holds a peer copy (``offer``), through the
   store.
3. ``into``: every rank checks its ``into=`` against its part before anything is read: a
   mismatch on one rank fails the restore on every rank, naming the rank.
4. ``missing`` (and, when some chunk is missing, ``holding`` and ``done``): each rank sorts the
   chunks it needs into those its node holds (RAM, node-local disk) and the missing ones. If none
   is missing anywhere, every rank reads from its own node and nothing else is exchanged.
   Otherwise the coordinator plans the moves (:func:`plan_moves`): a chunk some rank's node holds
   (a peer copy, or the replica of a rank on a node that survived) is sent by that rank to every
   rank that lacks it; a chunk no node holds is read by one of the ranks that need it from S3
   (or a shared disk), chosen to spread the reads, and sent from there. Each rank gets only its
   own moves; the chunks travel point to point over gloo and every one is verified against its
   id; ``done`` says whether every rank got what it needed.

Bytes are reported per source (``ram``, ``disk``, ``peer``, ``s3``) in ``cache.last_restore``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tiercache import codecs
from tiercache.errors import (
    AmbiguousRefError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    TierCacheError,
    VersionNotFoundError,
)
from tiercache.failpoints import failpoint
from tiercache.group.collective import Channel, Decision
from tiercache.group.orphans import adopt_orphans
from tiercache.group.phase_status import Status
from tiercache.group.transfer import Move, Slot, run_moves, schedule, shares
from tiercache.manifest import Version
from tiercache.names import chunk_key, part_key
from tiercache.parts import check_part, rank_view
from tiercache.restore import Progress, Targets, byte_view, chunk_targets, into_targets, match_into, scatter

if TYPE_CHECKING:
    from tiercache.group.view import GroupView

#: The source name of chunks received from another rank.
PEER = "peer"


def restore(view: GroupView, slot: int, ref: str, *, into: Any, map_location: Any, progress: Progress | None,
            strict: bool, resume: bool) -> Any:
    """Return this rank's part of the version ``ref`` resolves to (on rank 0); see the module docstring.

    Returns:
        This rank's state; the whole state on every rank if the version was saved by one process.

    Raises:
        VersionNotFoundError: If no rank resolves the ref (rank 0's error, on every rank).
        InvalidArgumentError: If the version was saved by another number of ranks (restore it
            through :mod:`tiercache.integrations.dcp` to reshard).
        StateMismatchError: If some rank's ``into=`` does not match its part (naming the rank).
        IntegrityError: If some chunk has no good copy anywhere (on every rank).
    """
    t0 = time.perf_counter()
    ch = view.channel
    core = view.core
    tag = f"restore/{slot}"
    what = f"the group's restore of {ref!r}"
    if view.agents:
        adopt_orphans(view, ch, tag, ref)  # a version the trainers left in node RAM, committed now
    version = _part(view, ch, tag, what, resolve(view, ch, tag, what, ref))
    into = into if into is None else _local(into)
    try:
        match_into(version, into_targets(into), strict=strict)
        mine = Status()
    except TierCacheError as e:
        mine = Status.of(e)
    ch.exchange(f"{tag}/into", mine, what=what).raise_failure()
    fill = GroupFill(view, ch, tag, what)
    out = core.restore_version(version, into=into, map_location=map_location, progress=progress, strict=strict,
                               fill=fill)
    if core.last_restore is not None:  # the group's exchanges took part of the time: count them too
        core.last_restore = dataclasses.replace(core.last_restore, seconds=time.perf_counter() - t0)
    if resume:
        core.note_restored(ref, version)
    return out


def _local(into: Any) -> Any:
    from tiercache.format import dtensor_class

    dtensor = dtensor_class()
    if dtensor is None:
        return into
    from torch.utils._pytree import tree_leaves, tree_map

    if not any(isinstance(x, dtensor) for x in tree_leaves(into)):
        return into
    return tree_map(lambda x: x.to_local() if isinstance(x, dtensor) else x, into)


def resolve(view: GroupView, ch: Channel, tag: str, what: str, ref: str) -> dict[str, Any]:
    """The version the group reads (a collective): rank 0's resolution of ``ref``, else the first rank's that has one.

    Returns:
        What every rank needs of it: ``id``, ``branch``, ``parent``, ``step``, ``world`` (how many
        ranks saved it), ``created`` and ``hash`` (see :func:`header_of`).

    Raises:
        VersionNotFoundError: If no rank resolves it (rank 0's error, on every rank).
    """
    try:
        failpoint("group.restore", tag)
        vid = view.cache.resolve(ref)
        rnd = view.round(vid)
        # A version this group is still saving is waited for (its outcome is near: it is staged).
        if rnd is not None and rnd.futures["durable"].exception() is not None:
            # The branch head of this process's view (moved at save time, as in a single-process
            # save) names a version the group failed to commit.
            raise VersionNotFoundError(f"{ref!r} resolves to version {vid}, which the group failed to save "
                                       f"({rnd.futures['durable'].exception()}): restore an earlier one, e.g. {ref}~1")
        v = view.core.catalog.peek(vid)
        mine = Status("ok", {"id": v.id, "branch": v.branch, "parent": v.parent, "step": v.step, "world": v.world,
                             "created": v.created_at.isoformat(), "hash": v.hash_algo})
    except (VersionNotFoundError, AmbiguousRefError, InvalidNameError) as e:
        # A rank that knows no such version is no failure of the phase: another rank's node may know it.
        mine = Status("ok", {"error": [type(e).__name__, str(e)]})
    except Exception as e:  # anything else fails the restore on every rank, naming this rank
        mine = Status.of(e)
    verdict = ch.exchange(f"{tag}/resolve", mine, what=what, decide=_first_known)
    verdict.raise_failure()
    return verdict.status.payload  # type: ignore[no-any-return]


def _first_known(statuses: list[Status]) -> Decision:
    """Rank 0's resolution, else the first rank's that has one; rank 0's error if none has."""
    for s in statuses:
        if "error" not in s.payload:
            return Decision(s.payload)
    error, message = statuses[0].payload["error"]
    raise Status("error", error=error, message=message).error_object()


def _part(view: GroupView, ch: Channel, tag: str, what: str, found: dict[str, Any]) -> Version:
    """This rank's part of the agreed version (read here, or sent by a rank whose node holds a copy)."""
    vid, world = found["id"], found["world"]
    if world > 1 and world != view.world_size:
        raise InvalidArgumentError(
            f"version {vid} was saved by {world} ranks, this group has {view.world_size}: restore it at the same "
            "world size, or save and load it with tiercache.integrations.dcp to reshard")
    cat = view.core.catalog
    if world == 1:  # saved by one process: every rank restores the whole state
        try:
            version, mine = cat.get(vid), Status("ok", [])
            if version.ranks:  # saved by a group of one rank: its part, not the list of the ranks' states
                version = rank_view(version, 0)
        except TierCacheError as e:
            version, mine = None, Status.of(e)
        ch.exchange(f"{tag}/parts", mine, what=what, decide=_union_missing).raise_failure()
        assert version is not None
        return version
    try:
        header = cat.peek(vid)
    except VersionNotFoundError:
        header = header_of(found)
    return fetch_parts(view, ch, tag, what, header, [view.rank])[view.rank]


def header_of(found: dict[str, Any]) -> Version:
    """The group manifest as far as a resolution shared by the group says (enough to read its parts)."""
    from tiercache.parts import group_header

    return group_header(id=found["id"], parent=found["parent"], branch=found["branch"], step=found["step"],
                        created_at=found["created"], meta={}, hash_algo=found["hash"], ranks=found["world"], nbytes=0)


def fetch_parts(view: GroupView, ch: Channel, tag: str, what: str, header: Version,
                wanted: Sequence[int]) -> dict[int, Version]:
    """The part manifests ``wanted`` by this rank (a collective: every rank calls it, each with its own list).

    Each rank reads what it can from its own tiers (its node's disk first, then a shared tier);
    a part no tier of a rank holds (its node was lost, and there is no S3) comes from a rank whose
    node holds a copy of it (peer copies), through the store.

    Raises:
        IntegrityError: If some wanted part is on no tier and no node (on every rank).
    """
    core = view.core
    order = [*sorted(view.node_local), *(t for t in core.repo.durable if t not in view.node_local)]
    got: dict[int, Version] = {}
    try:
        for rank in wanted:
            # Merged in memory (or written merged by an older tiercache): the part is in it already.
            part = rank_view(header, rank) if header.parts else core.catalog.part(header, rank, order)
            if part is not None:
                got[rank] = part
        missing = sorted(set(wanted) - set(got))
        mine = Status("ok", missing)
    except Exception as e:  # the others learn it in this phase, not at the timeout
        missing, mine = [], Status.of(e)
    verdict = ch.exchange(f"{tag}/parts", mine, what=what, decide=_union_missing)
    verdict.raise_failure()
    lacking: list[int] = verdict.status.payload
    if not lacking:
        return got
    # Some ranks lack parts: a rank whose node holds a copy sends each to each rank that needs it.
    try:
        mine = Status("ok", {"held": _held_parts(view, header.id, lacking), "missing": missing})
    except Exception as e:
        mine = Status.of(e)
    offer = ch.exchange(f"{tag}/offer", mine, what=what, decide=lambda statuses: _providers(statuses, header.id))
    offer.raise_failure()
    disk = core.repo.durable[min(view.node_local)] if view.node_local else None
    status = Status()
    for rank, needer in offer.mine or ():
        data = b""
        try:
            data = (disk.get(part_key(header.id, rank)) if disk is not None else None) or b""
        except Exception as e:  # the needer gets nothing to wait for; the group learns why at "delivered"
            status = Status.of(e)
        ch.send(f"{tag}/part/{rank}/{needer}", data)
    try:
        for rank in missing:
            data = ch.receive(f"{tag}/part/{rank}/{view.rank}", f"{what}: rank {rank}'s part of version {header.id}")
            got[rank] = check_part(header, rank, Version.from_json(
                data, source=f"rank {rank}'s part of version {header.id} (from a peer)"), "the part a peer sent")
            core.catalog.add_part(got[rank])
    except Exception as e:
        status = Status.of(e)
    ch.exchange(f"{tag}/delivered", status, what=what).raise_failure()
    return got


def _union_missing(statuses: list[Status]) -> Decision:
    return Decision(sorted({k for s in statuses for k in s.payload}))


def _held_parts(view: GroupView, vid: str, ranks: Sequence[int]) -> list[int]:
    """Those of ``ranks`` whose part manifests this rank's node-local disk holds (peer copies)."""
    if not view.node_local:
        return []
    tier = view.core.repo.durable[min(view.node_local)]
    out = []
    for r in ranks:
        try:
            if tier.exists(part_key(vid, r)):
                out.append(r)
        except TierCacheError:
            continue
    return out


def _providers(statuses: list[Status], vid: str) -> Decision:
    """Who sends each missing part to each rank that needs it; or which parts no rank holds."""
    send: list[list[list[int]]] = [[] for _ in statuses]
    lost: set[int] = set()
    for needer, s in enumerate(statuses):
        for rank in s.payload["missing"]:
            holder = next((r for r, h in enumerate(statuses) if rank in h.payload["held"] and r != needer), None)
            if holder is None:
                lost.add(rank)
            else:
                send[holder].append([rank, needer])
    if lost:
        raise IntegrityError(f"the parts of ranks {', '.join(map(str, sorted(lost)))} of version {vid} are on no tier "
                             "and no node that answered (their nodes were lost, with no S3 and no peer copy)")
    return Decision(None, send)


def plan_moves(version: Version, missing: Sequence[Collection[str]], holding: Sequence[Collection[str]],
               sizes: dict[str, int] | None = None) -> list[Move]:
    """Who sends each missing chunk to whom.

    Args:
        version: A version whose table orders the chunks (or ``None`` with ``sizes``).
        missing: Per rank, the ids of the chunks it needs and its node does not hold.
        holding: Per rank, the ids among all ranks' missing ones that its node holds.
        sizes: Each missing chunk's raw length, in the order to move them (default: the
            version's table).

    Returns:
        One move per missing chunk: from the least loaded rank that holds it, else from the
        least loaded rank that needs it (which reads it from a shared tier), to every other rank
        that needs it.
    """
    order = sizes if sizes is not None else {c.id: c.nbytes for c in version.chunks}
    load = [0] * len(missing)
    moves: list[Move] = []
    needing: dict[str, list[int]] = {}
    held: dict[str, list[int]] = {}
    for index, per_rank in ((needing, missing), (held, holding)):
        for rank, ids in enumerate(per_rank):
            for cid in ids:
                index.setdefault(cid, []).append(rank)
    for cid, nbytes in order.items():
        needers = needing.pop(cid, None)  # popped: a chunk named twice moves once
        if not needers:
            continue
        holders = held.get(cid, [])
        src = min(holders or needers, key=lambda r: (load[r], r))
        dsts = tuple(r for r in needers if r != src)
        load[src] += nbytes * max(1, len(dsts))
        moves.append(Move(cid, nbytes, src, dsts))
    return moves


class GroupFill:
    """One restore's :data:`~tiercache.restore.Fill` over the group (see the module docstring, step 4)."""

    def __init__(self, view: GroupView, ch: Channel, tag: str, what: str) -> None:
        self.view = view
        self.core = view.core
        self.ch = ch
        self.tag = tag
        self.what = what
        self.read: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, version: Version, dests: Sequence[torch.Tensor], progress: Progress | None) -> dict[str, int]:
        """Fill ``dests`` (one per tensor entry of ``version``); return the bytes read per source."""
        targets = chunk_targets(version, dests)
        needed = [i for i, t in enumerate(targets) if t]
        ch, tag = self.ch, self.tag
        try:
            failpoint("group.fill", tag)
            held = self._held({version.chunks[i].id for i in needed})
            missing = {version.chunks[i].id: version.chunks[i].nbytes for i in needed
                       if version.chunks[i].id not in held}
            mine = Status("ok", missing)
        except Exception as e:
            held, missing, mine = set(), {}, Status.of(e)
        wanted = ch.exchange(f"{tag}/missing", mine, what=self.what,
                             decide=lambda statuses: Decision(_union(statuses)))
        wanted.raise_failure()
        status = Status()
        if not wanted.status.payload:
            try:
                self._count(self.core.reader.read_chunks(version, needed, targets, progress))
            except Exception as e:  # the others learn it at done
                status = Status.of(e)
        else:
            sizes: dict[str, int] = wanted.status.payload
            try:
                failpoint("group.holding", tag)
                offer = Status("ok", {"missing": sorted(missing), "holding": sorted(self._held(set(sizes)))})
            except Exception as e:  # the others learn it in this phase, not at the timeout
                offer = Status.of(e)
            plan = ch.exchange(f"{tag}/holding", offer, what=self.what,
                               decide=lambda statuses: self._plan(statuses, sizes))
            plan.raise_failure()
            slots = [Slot.from_json(s) for s in plan.mine]
            own_idx = [i for i in needed if version.chunks[i].id in held]
            try:
                with ThreadPoolExecutor(1, thread_name_prefix="tiercache-restore-local") as pool:
                    local = pool.submit(self.core.reader.read_chunks, version, own_idx, targets, progress)
                    self._transfer(version, slots, set(missing), targets, progress)
                    self._count(local.result())
            except Exception as e:  # a transfer that broke (a peer died) too: the others learn it at done
                status = Status.of(e)
        ch.exchange(f"{tag}/done", status, what=self.what).raise_failure()
        return self.read

    def _plan(self, statuses: list[Status], sizes: dict[str, int]) -> Decision:
        """The coordinator's moves; each rank gets its own slots."""
        moves = plan_moves(None, [set(s.payload["missing"]) for s in statuses],  # type: ignore[arg-type]
                           [set(s.payload["holding"]) for s in statuses], sizes)
        slots = schedule(moves, self.core.config.peers.batch_bytes)
        return Decision(None, shares(slots, len(statuses)))

    def _count(self, read: dict[str, int]) -> None:
        with self._lock:
            for src, n in read.items():
                self.read[src] = self.read.get(src, 0) + n

    def _held(self, ids: set[str]) -> set[str]:
        """The chunks among ``ids`` this rank's node holds (its RAM arena or node RAM, its node-local disk).

        The node agent and the disk are asked rather than the catalog: other ranks of the node,
        an earlier trainer and peer copies put chunks there without this process's catalog
        knowing; what is found is noted so the reader tries it (node RAM first).
        """
        repo = self.core.repo
        out: set[str] = set()
        for name, tier in repo.tiers.items():
            if not tier.durable:  # the RAM arena: this process's catalog knows what it holds
                out |= ids & repo.catalog.chunks_on(name)
        agent = self.view.cache.agent
        if agent is not None and ids - out:
            try:
                _, held = agent.holds([], sorted(ids - out))
            except TierCacheError:  # an agent lost now holds nothing this restore can count on
                held = {}
            found = [c for c, yes in held.items() if yes]
            repo.stored("ram", found)
            out |= set(found)
        for name in sorted(self.view.node_local):
            if not repo.available(name):
                continue
            tier = repo.durable[name]
            try:
                found = [c for c in ids - out if tier.exists(chunk_key(c))]
            except TierCacheError:  # a failing disk holds nothing this restore can count on
                found = []
            repo.stored(name, found)
            out |= set(found)
        return out

    def _transfer(
        self, version: Version, slots: list[Slot], missing: set[str], targets: list[Targets], progress: Progress | None
    ) -> None:
        """Send the chunks this rank reads for others and receive the ones it lacks (``missing``)."""
        where: dict[str, list[Targets]] = {}  # a missing chunk -> the targets of every index it has
        for c, t in zip(version.chunks, targets, strict=True):
            if t and c.id in missing:
                where.setdefault(c.id, []).append(t)
        algo = version.hash_algo
        reader = self.core.reader
        bad: list[IntegrityError] = []

        def deliver(m: Move, raw: memoryview) -> None:
            for t in where.get(m.chunk, ()):
                scatter(t, raw)
            if progress is not None:
                progress(m.nbytes)

        def read(m: Move) -> torch.Tensor:
            buf = torch.empty(m.nbytes, dtype=torch.uint8)
            tier = reader.read_chunk(m.chunk, m.nbytes, algo, [(byte_view(buf), 0, m.nbytes)])
            if m.chunk in where:  # this rank lacked it too: it read it for the group
                deliver(m, byte_view(buf))
                self._count({tier: m.nbytes})
            return buf

        def land(m: Move, data: torch.Tensor | None) -> None:
            # Never raises: the other ranks' later batches still need this rank's sends.
            if data is None:
                bad.append(IntegrityError(f"chunk {m.chunk}: rank {m.src} could not read it for the group (no node "
                                          "holds it and no shared tier gave a good copy)"))
                return
            raw = byte_view(data)
            if codecs.content_id(raw, algo) != m.chunk:
                bad.append(IntegrityError(f"chunk {m.chunk} from rank {m.src} does not match its id"))
                return
            deliver(m, raw)
            self._count({PEER: m.nbytes})

        run_moves(self.view.transfers, self.view.rank, slots, read=read, land=land,
                  threads=self.core.config.io_threads)
        if bad:
            raise bad[0]


def _union(statuses: list[Status]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in statuses:
        out.update(s.payload)
    return out


__all__ = ["PEER", "GroupFill", "fetch_parts", "header_of", "plan_moves", "resolve", "restore"]
