"""Which node each rank of a group runs on, and which nodes hold copies of which (docs/design.md section 7).

RAM and disk are node-local: a multi-rank version is ``local`` when every node holds what its own
ranks need, and peer copies put each node's part on other nodes too. So every rank needs the
same picture of the nodes: :func:`tiercache.config.this_node` names the node of this process
(``TIERCACHE_NODE``, else the launcher's node, else the host name) and its failure domain, the
group view gathers them when it is made (:class:`tiercache.group.view.GroupView`), and
:meth:`Topology.of` turns them into this picture. :func:`choose_peers` is a pure function of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.errors import ConfigError

log = logging.getLogger("tiercache.group.topology")


@dataclass(frozen=True)
class Topology:
    """The nodes of a process group, as every rank of it sees them.

    Attributes:
        names: Each node's name, nodes in the order of their first rank.
        domains: Each node's failure domain (``""``: none given).
        node_of: The node index of each group rank.
    """

    names: tuple[str, ...]
    domains: tuple[str, ...]
    node_of: tuple[int, ...]
    #: Each node's ranks, lowest first (derived from ``node_of``).
    members: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.members:
            members: list[list[int]] = [[] for _ in self.names]
            for rank, node in enumerate(self.node_of):
                members[node].append(rank)
            object.__setattr__(self, "members", tuple(tuple(m) for m in members))

    @classmethod
    def of(cls, labels: Sequence[tuple[str, str]]) -> Topology:
        """The topology of ranks labelled ``(node name, failure domain)`` in rank order.

        Raises:
            ConfigError: If two ranks of one node give it different failure domains.
        """
        names: list[str] = []
        domains: list[str] = []
        node_of: list[int] = []
        index: dict[str, int] = {}
        for rank, (name, domain) in enumerate(labels):
            if name not in index:
                index[name] = len(names)
                names.append(name)
                domains.append(domain)
            i = index[name]
            if domains[i] != domain:
                raise ConfigError(f"rank {rank} puts node {name!r} in failure domain {domain!r}, an earlier rank "
                                  f"in {domains[i]!r}: give every rank of a node the same TIERCACHE_FAILURE_DOMAIN")
            node_of.append(i)
        return cls(tuple(names), tuple(domains), tuple(node_of))

    @property
    def count(self) -> int:
        """The number of nodes."""
        return len(self.names)

    def ranks(self, node: int) -> tuple[int, ...]:
        """The group ranks on node ``node``, lowest first."""
        return self.members[node]

    def leader(self, node: int) -> int:
        """The lowest group rank on node ``node``: it commits that node's manifest and ref."""
        return self.members[node][0]

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its node's leader."""
        return self.leader(self.node_of[rank]) == rank


def choose_peers(topology: Topology, copies: int) -> list[tuple[int, ...]]:
    """For each node, the ``copies`` other nodes that hold a copy of its part.

    Nodes are laid on a ring that alternates failure domains (the first node of each domain,
    then the second of each...); a node's peers are the next nodes along the ring whose domain
    is not yet among the holders', so that with balanced domains every node holds exactly
    ``copies`` other parts and no two holders of a part share a domain. A node without a domain
    is a domain of its own. Where there are not enough domains, the nearest remaining nodes are
    taken (logged).

    Every rank computes the same answer from the same topology.

    Raises:
        ConfigError: If the group has fewer than ``copies + 1`` nodes.
    """
    n = topology.count
    if copies <= 0:
        return [() for _ in range(n)]
    if copies > n - 1:
        raise ConfigError(f"peers.copies = {copies} needs at least {copies + 1} nodes; this group has {n} "
                          f"({', '.join(topology.names)}): lower [peers] copies or run on more nodes")
    domain = [d or f"\0{topology.names[i]}" for i, d in enumerate(topology.domains)]
    by_domain: dict[str, list[int]] = {}
    for i, d in enumerate(domain):
        by_domain.setdefault(d, []).append(i)
    ring: list[int] = []
    depth = max(len(v) for v in by_domain.values())
    for k in range(depth):
        ring.extend(members[k] for members in by_domain.values() if k < len(members))
    out: list[tuple[int, ...]] = [()] * n
    for pos, node in enumerate(ring):
        following = [ring[(pos + j) % n] for j in range(1, n)]
        chosen: list[int] = []
        seen = {domain[node]}
        for cand in following:
            if len(chosen) < copies and domain[cand] not in seen:
                chosen.append(cand)
                seen.add(domain[cand])
        if len(chosen) < copies:
            log.warning("node %s: not enough failure domains for %d copies in other domains; some share one",
                        topology.names[node], copies)
            chosen += [c for c in following if c not in chosen][: copies - len(chosen)]
        out[node] = tuple(chosen)
    return out


__all__ = ["Topology", "choose_peers"]
