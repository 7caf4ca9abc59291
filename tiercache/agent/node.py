"""What the facade asks the node agent about node-level state (docs/design.md sections 1 and 7b).

A cache with an ``[agent]`` table shares node RAM, the pipeline's progress and garbage collection
with the node's agent. :class:`NodeAgent` is the one object the facade asks about them; it keeps
the link (attaching, and warning once if the agent refuses) and answers for every case itself:
no agent configured or running, a live agent, or one lost mid-run.

It imports no torch (a cache opened for ``tiercache ls`` or ``gc`` asks it), and the link's module
only once an ``[agent]`` table asks for one.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import ValidationError

from tiercache.config import CacheConfig
from tiercache.errors import TierCacheError
from tiercache.manifest import TierState, VersionInfo
from tiercache.repo import GcReport, Repo
from tiercache.runtime import AgentStats

if TYPE_CHECKING:
    from tiercache.agent.client import AgentLink
    from tiercache.restore import RestoreReport

log = logging.getLogger(__name__)


class NodeAgent:
    """One open cache's questions to its node agent; each answer stands for "no agent" too.

    Args:
        config: The cache's settings (no ``[agent]`` table: there is no agent to ask).
        repo: The cache's storage, whose RAM tier and catalog the agent's link follows.

    It connects to a running agent at once (starting none): a cache opened to list versions sees
    what node RAM holds.
    """

    def __init__(self, config: CacheConfig, repo: Repo) -> None:
        self._config = config
        self._repo = repo
        #: Why the node agent refused this cache (one warning said so; it is not asked again).
        self._refusal: TierCacheError | None = None
        #: The connection to the node agent, once attached (possibly lost since).
        self._link: AgentLink | None = self._attach(start=False)

    @property
    def link(self) -> AgentLink | None:
        """The connection to the node agent, or ``None`` (none configured, running or reachable, or lost)."""
        link = self._link
        return link if link is not None and link.lost is None else None

    def link_for_saves(self) -> AgentLink | None:
        """The live link for the save front, attaching again (and starting one with ``start = "auto"``) if needed."""
        if self._config.agent is None:
            return None
        link = self.link
        if link is None:
            link = self._link = self._attach(start=self._config.agent.start == "auto")
        return link

    def _attach(self, *, start: bool) -> AgentLink | None:
        """Connect to the node agent (start one if ``start``); ``None``, with a warning, if that fails.

        A refusal (another user's directory, other settings...) is warned about once: later
        calls return ``None`` without asking again.
        """
        if self._config.agent is None or self._refusal is not None:
            return None
        from tiercache.agent.client import attach

        try:
            return attach(self._config, self._repo, start=start)
        except TierCacheError as e:
            self._refusal = e
            log.warning("no node agent: %s; saving in this process", e)
            return None

    def notify_restored(self, report: RestoreReport, began: float) -> bool:
        """Tell the agent a restore read ``report`` (its reads began at ``began``).

        Returns:
            Whether this process has an agent, which then publishes its status (a lost one takes
            nothing); ``False``: the process publishes the restore itself.
        """
        if self._link is None:
            return False
        # By source, in the agent's metrics; its time (and when it began: the end of a restart)
        # in the status the agent publishes, for `tiercache plan`.
        self._link.notify("restored", nbytes=report.nbytes, seconds=report.seconds, began=began)
        return True

    def pending_tiers(self, version_id: str) -> frozenset[str]:
        """Tiers the agent is still writing ``version_id`` to, as its last word said (none without an agent)."""
        return self._link.pending_tiers(version_id) if self._link is not None else frozenset()

    def node_ram(self, versions: list[VersionInfo], *, saves_here: bool) -> list[VersionInfo]:
        """``versions`` with node RAM's state of each, as the node agent tells it (``[agent]``).

        Only the agent knows what node RAM holds (a version a group saved is there as its ranks'
        parts, which no catalog outside the agent knows). With no agent running, node RAM holds
        nothing, unless this process saves in RAM of its own (``saves_here``: its own states say so).
        """
        if self._config.agent is None or not versions:
            return versions
        link = self.link
        if link is None:
            if saves_here:
                return versions
            none = TierState("absent", "no node agent runs for this cache: no node RAM holds its versions")
            return [replace(v, states={**v.states, "ram": none}) for v in versions]
        try:
            states = link.ram_states([v.id for v in versions])
        except TierCacheError as e:  # an agent of another tiercache version: its catalog's word stands
            log.debug("the node agent did not say what node RAM holds: %s", e)
            return versions
        out = []
        for v in versions:
            st = states.get(v.id)
            if st is None or v.states.get("ram", st).state == "pending":
                out.append(v)
                continue
            tiers = v.tiers if (st.state == "held") == ("ram" in v.tiers) else \
                ("ram", *v.tiers) if st.state == "held" else tuple(t for t in v.tiers if t != "ram")
            out.append(replace(v, tiers=tiers, states={**v.states, "ram": st}))
        return out

    def gc(self, *, dry_run: bool, grace: float | None) -> GcReport | None:
        """Have the agent collect, or ``None`` if no agent runs (this process collects then).

        The agent writes this cache: it collects too, so its view of the tiers stays true.
        """
        link = self.link
        if link is None:
            return None
        got = link.request("gc", dry_run=dry_run, grace=grace)["report"]
        return GcReport(**{**got, "versions": tuple(got["versions"]),
                           "kept_by_reflog": tuple(got.get("kept_by_reflog", ()))})

    def stats(self) -> AgentStats | None:
        """The agent's figures, or ``None`` if no agent runs or it does not answer."""
        link = self.link
        if link is None:
            return None
        try:
            return AgentStats.model_validate(link.request("stats"))
        except (TierCacheError, ValidationError) as e:  # down, or an agent of another tiercache version
            log.debug("the node agent's stats are left out: %s", e)
            return None

    def close(self) -> None:
        """Close the link (the agent runs on)."""
        if self._link is not None:
            self._link.close()


__all__ = ["NodeAgent"]
