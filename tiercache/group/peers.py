"""Peer copies: each node's part of a multi-rank version also on ``peers.copies`` other nodes (level ``replicated``).

A node-local disk survives a process crash, not the loss of its node. Once a version is ``local``
(every node holds what its own ranks need), its peer copies are made on a worker thread of each
rank (Gemini; NVIDIA's local checkpointing), in two phases of the group's collective layer:

1. ``<v>/peers/plan``: the coordinator, which knows from the ``parts`` phase who wrote which
   chunk on each node, plans the moves (:func:`copy_moves`): each chunk of a node's part that a
   peer node lacks goes from the rank that wrote it to one of the peer's ranks (they take turns,
   so a node's receiving and writing are shared), and so does each rank's part manifest. Each
   rank gets only its own moves.
2. The chunks travel point to point over a private gloo group; a receiver verifies each against
   its id (a part manifest: that it is the part it should be) and writes it to its node's disk
   with the same durable write as any chunk, then syncs the names
   (:class:`~tiercache.group.copies.PeerFiles`). With ``[agent]``, where every rank's agent
   said where it takes copies (in the plan phase), the agents move, verify and write them
   instead, agent to agent over TCP (:mod:`tiercache.agent.peering`): the trainers only agree.
   The agents take only frames sealed with the job's key, which one rank draws and every rank
   reads from the job's store (:meth:`Replicator._job_key`).
3. ``<v>/peers``: ``replicated`` resolves on every rank once every move landed, or fails on every
   rank with the same error. A rank that dies mid-copy fails ``replicated`` (and breaks the
   group: see :mod:`tiercache.group.collective`); ``local`` and ``remote`` are not affected.

Chunks a peer node holds already (a DDP replica holds every replicated chunk) are not sent.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tiercache.errors import AgentUnavailableError, GroupSaveError, IntegrityError, TierCacheError
from tiercache.failpoints import failpoint
from tiercache.group.collective import Channel, Decision
from tiercache.group.copies import PART, PeerFiles
from tiercache.group.phase_status import Status
from tiercache.group.round import Round
from tiercache.group.topology import Topology
from tiercache.group.transfer import Move, Slot, run_moves, schedule, shares

if TYPE_CHECKING:
    import torch.distributed as dist

    from tiercache.group.view import GroupView

log = logging.getLogger("tiercache.group.peers")


def copy_moves(
    topology: Topology, peers: Sequence[tuple[int, ...]], writers: Sequence[Mapping[str, int]],
    sizes: Mapping[str, int], part_bytes: Sequence[int] = (),
) -> list[Move]:
    """The moves that put every node's part on its peers.

    Args:
        topology: The group's nodes.
        peers: Per node, the nodes that hold a copy of its part.
        writers: Per node, each chunk of its part -> the rank that wrote it there (it sends it).
        sizes: Each chunk's raw length, in the order to move them.
        part_bytes: Each rank's part manifest's size (sent by the rank itself); none if empty.

    Returns:
        One move per chunk (or part manifest) and sender; a chunk several peers lack from the
        same sender is read once and sent to each.
    """
    position = {cid: i for i, cid in enumerate(sizes)}
    moves: dict[tuple[str, int], list[int]] = {}
    nbytes = dict(sizes)
    sent: list[set[str]] = [set() for _ in peers]  # per peer node, the chunks on their way to it
    for node, holders in enumerate(peers):
        mine = writers[node]
        part = sorted(mine, key=position.__getitem__)  # the node's chunks, in plan order
        for peer in holders:
            receivers = topology.ranks(peer)
            held, going = writers[peer], sent[peer]
            turn = 0
            for cid in part:
                if cid in held or cid in going:
                    continue
                going.add(cid)
                key = (cid, mine[cid])
                dsts = moves.get(key)
                if dsts is None:
                    moves[key] = [receivers[turn % len(receivers)]]
                else:
                    dsts.append(receivers[turn % len(receivers)])
                turn += 1
            for rank in topology.ranks(node) if part_bytes else ():
                name = f"{PART}{rank}"
                nbytes[name] = part_bytes[rank]
                moves.setdefault((name, rank), []).append(receivers[turn % len(receivers)])
                turn += 1
    return [Move(cid, nbytes[cid], src, tuple(dsts)) for (cid, src), dsts in moves.items()]


class Replicator:
    """This rank's side of the peer copies of each version (see the module docstring).

    Args:
        view: The group view.
        group: A private gloo group of the process group, used only by the replicator's thread.
        peers: Per node, the nodes that hold a copy of its part.
        tier: The node-local durable tier the copies go to (the node's disk).
        timeout: Seconds a rank's moves may take.
        agent_host: Where this node's agent takes other agents' copies (with ``[agent]``).
    """

    def __init__(self, view: GroupView, group: dist.ProcessGroup, peers: Sequence[tuple[int, ...]],
                 tier: str, *, timeout: float, agent_host: str | None = None) -> None:
        self.view = view
        self.group = group
        self.peers = list(peers)
        self.tier = tier
        self.timeout = timeout
        self.agent_host = agent_host
        self._key: str | None = None

    def run(self, rnd: Round, ch: Channel) -> None:
        """Make the peer copies of ``rnd`` once the group settled its ``local`` level."""
        local = rnd.futures["local"].exception()  # waits: the same outcome on every rank
        result = rnd.futures["replicated"]
        if local is not None:
            result.set_exception(GroupSaveError(
                f"version {rnd.vid} failed on peers: it is not local on every node ({local})"))
            return
        what = f"version {rnd.vid} on peers"
        try:
            failpoint("group.peers", f"{rnd.vid}/peers")
            mine = Status("ok", {"agent": self._agent_endpoint()})
        except Exception as e:
            mine = Status.of(e)
        plan = ch.exchange(f"{rnd.vid}/peers/plan", mine, what=what, decide=lambda st: self.plan(rnd, st))
        status = Status()
        if plan.ok:
            try:
                share = plan.mine
                if share["via"] is None:
                    self._copy(rnd, [Slot.from_json(s) for s in share["slots"]])
                else:
                    self._through_agent(rnd, share["slots"], share["via"])
            except Exception as e:  # a peer that died shows here on some ranks only: the exchange tells all
                status = Status.of(e)
        else:
            status = plan.status
        verdict = ch.exchange(f"{rnd.vid}/peers", status, what=what)
        if verdict.ok:
            result.set_result(rnd.vid)
        else:
            result.set_exception(verdict.status.error_object(wrap=True))

    def _job_key(self) -> str:
        """The job's key for the agents' peer port (:mod:`tiercache.agent.peerwire`).

        The first rank to ask draws it and puts it in the job's store; every rank gets that one.
        Only the job's ranks (and their agents, with each ``peer_port`` and ``peer_copy``) hold it,
        and each agent has it before the first plan names it: no peer waits for a key.
        """
        if self._key is None:
            got = self.view.collective.store.compare_set("peers/key", "", secrets.token_hex(32))
            self._key = bytes(got).decode()
        return self._key

    def _agent_endpoint(self) -> list[Any] | None:
        """Where this node's agent takes peer copies, or ``None`` if this rank saves without one."""
        link = self.view.cache.agent
        if link is None or self.agent_host is None:
            return None
        key = self._job_key()
        try:
            return list(link.request("peer_port", host=self.agent_host, key=key)["endpoint"])
        except TierCacheError as e:  # an agent that is lost or cannot listen: the trainers copy
            log.warning("the peer copies go between the trainers: %s", e)
            return None

    def plan(self, rnd: Round, statuses: list[Status]) -> Decision:
        """Each rank's moves; through the agents (a token and the endpoints it needs) if every rank has one."""
        view = self.view
        moves = copy_moves(view.topology, self.peers, rnd.plan.writers, rnd.plan.sizes, rnd.plan.part_bytes)
        slots = schedule(moves, view.cache.config.peers.batch_bytes)
        per = shares(slots, view.world_size)
        endpoints = [(s.payload or {}).get("agent") for s in statuses]
        if not all(endpoints):
            return Decision(None, [{"slots": mine, "via": None} for mine in per])
        token = secrets.token_hex(16)
        partners: list[set[int]] = [set() for _ in per]  # the ranks each rank sends to or receives from
        for s in slots:
            for d in s.move.dsts:
                partners[s.move.src].add(d)
                partners[d].add(s.move.src)
        return Decision(None, [{"slots": mine, "via": {"token": token, "endpoints": {str(r): endpoints[r] for r in rs}}}
                               for mine, rs in zip(per, partners, strict=True)])

    def _through_agent(self, rnd: Round, slots: list[Any], via: dict[str, Any]) -> None:
        """This rank's moves, made by its node's agent (:mod:`tiercache.agent.peering`)."""
        link = self.view.cache.agent
        if link is None:
            raise AgentUnavailableError(f"rank {self.view.rank} lost its node agent before the peer copies of "
                                        f"version {rnd.vid}")
        link.request("peer_copy", vid=rnd.vid, rank=self.view.rank, tier=self.tier, slots=slots,
                     token=via["token"], key=self._job_key(), endpoints=via["endpoints"],
                     within=self.timeout)

    def _copy(self, rnd: Round, slots: list[Slot]) -> None:
        """This rank's moves over gloo, from and to its node's disk (:class:`PeerFiles`)."""
        cache = self.view.cache
        files = PeerFiles(self.view.core, self.tier, rnd.vid)
        disk = files.disk
        writes: list[Future[None]] = []
        failed: list[BaseException] = []
        threads = disk.write_threads or cache.config.io_threads
        with ThreadPoolExecutor(threads, thread_name_prefix="tiercache-peer-write") as pool:

            def land(m: Move, data: torch.Tensor | None) -> None:
                if data is None:
                    failed.append(IntegrityError(f"rank {m.src} could not read {m.chunk} to copy it"))
                    return
                writes.append(pool.submit(files.land, m, data))

            run_moves(self.group, self.view.rank, slots, read=files.read, land=land, threads=cache.config.io_threads)
            for w in writes:
                w.result()
        if failed:
            raise failed[0]
        files.finish()


__all__ = ["Replicator", "copy_moves"]
