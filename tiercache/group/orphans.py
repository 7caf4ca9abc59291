"""A restarted group adopts the newest version whose parts its node agents still hold (docs/design.md section 7b).

With node agents, each rank's part of a multi-rank version is in its node's RAM (and maybe
written) as soon as ``save()`` returned; the group commits it later, through the trainers. If the
trainers die in between (the common case: one rank dies and the job is restarted), each agent
keeps the parts whose trainer died before the group's commit: its *orphans*
(:meth:`tiercache.agent.requests.Requests._orphan`).

When the restarted group first restores a branch, every rank asks its agent for its own orphans
of that branch newer than its view of the branch's head, and the ranks agree, in one exchange
(``<restore tag>/adopt``), on the newest version every rank has a part of. Each rank then reads
its part back from node RAM (verifying every chunk) and the group saves it again as that
version, with its id, step, metadata and creation time, on the branch's current head: the
agent writes it (its chunks are mostly there already) and the group commits it, once. The
restore goes on from there and reads the version back from node RAM. A rank whose part cannot be
read fails the adoption on every rank (the save's own exchange), and the restore then reads the
head the group had committed before, as it would without adoption.

A newer version some rank holds no part of (its trainer died before its ``save()`` returned, or
its node's agent restarted) can never be adopted: every rank logs one WARNING naming it and
which ranks lack their part, and the agents let its parts go. Asking, a rank also tells its
agent its branch's head: parts at or before it are older than committed history, let go too
(:mod:`tiercache.agent.keep`); so are parts saved before the branch was last rolled back (or a
resume moved it back): they belong to the history the user left.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tiercache.errors import TierCacheError
from tiercache.failpoints import failpoint
from tiercache.group.collective import Channel, Decision
from tiercache.group.phase_status import Status
from tiercache.manifest import Version

if TYPE_CHECKING:
    from tiercache.group.view import GroupView
    from tiercache.repo.catalog import Catalog

log = logging.getLogger("tiercache.group.orphans")



def adopt_orphans(view: GroupView, ch: Channel, tag: str, ref: str) -> str | None:
    """Adopt the newest version of branch ``ref`` whose every part an agent still holds; return its id (a collective).

    Every rank calls it (the group restore does, when the cache has an ``[agent]`` table).
    Returns ``None`` if there is none, or the group failed to save it again (logged).
    """
    mine: dict[str, dict[str, Any]] = {}
    try:
        mine = _own_orphans(view, ref)
        status = Status("ok", {vid: o["step"] for vid, o in mine.items()})
    except Exception as e:  # this rank cannot say: nothing is adopted, nothing let go (no part is lost by it)
        log.warning("could not ask the node agent for parts to adopt: %s", e)
        status = Status("ok", None)
    verdict = ch.exchange(f"{tag}/adopt", status, what=f"adopting versions of {ref!r}", decide=_newest_common)
    verdict.raise_failure()
    vid, incomplete = verdict.status.payload["v"], verdict.status.payload["incomplete"]
    if incomplete:
        _never_adopted(view, ref, incomplete, vid, mine)
    if vid is None:
        return None
    orphan = mine.get(vid)
    state, failed = None, None
    try:
        failpoint("group.adopt", f"{tag}/adopt")
        if orphan is None:  # the coordinator chose one this rank offered: it is here
            raise TierCacheError(f"rank {view.rank} lost its part of version {vid} meanwhile")
        state = _read_part(view, orphan)
    except Exception as e:  # whatever it is, the group's save below must hear it (no rank waits in vain)
        failed = e
    step = int(orphan["step"]) if orphan is not None else 0
    meta = orphan["meta"] if orphan is not None else {}
    created = datetime.fromtimestamp(float(orphan["created_at"]), UTC) if orphan is not None else datetime.now(UTC)
    try:
        handle = view.save_as(state, step=step, branch=ref, meta=meta, version=(vid, created), failed=failed)
        handle.wait("durable")
    except TierCacheError as e:
        log.warning("the group could not adopt version %s (step %d) that its trainers left in node RAM: %s",
                    vid, step, e)
        return None
    log.info("adopted version %s (step %d): its trainers died before the group committed it", vid, step)
    return vid


def _own_orphans(view: GroupView, branch: str) -> dict[str, dict[str, Any]]:
    """This rank's parts of versions of ``branch`` its node's agent holds, newer than this rank's head.

    Only parts of versions saved by a group of this size: a restart with another world size must
    never commit some ranks' parts as a whole version.
    """
    agent = view.cache.agent
    if agent is None:
        return {}
    catalog = view.core.catalog
    head = catalog.ref("branch", branch)
    head_step = -1
    if head is not None:
        try:
            head_step = catalog.peek(head.version).step
        except TierCacheError:
            head_step = -1
    got = agent.request("orphans", rank=view.rank, branch=branch, head_step=head_step if head is not None else None,
                        head=head.version if head is not None else None)
    offered = {str(o["v"]): o for o in got.get("orphans", ())
               if o.get("branch") == branch and o.get("world") == view.world_size and int(o["step"]) > head_step}
    # A part saved before the branch was moved back belongs to the history the user left:
    # adopting it would put it back on top of the branch.
    moved = _moved_back(catalog, branch)
    if moved is not None:
        since = moved.timestamp()
        left = sorted(v for v, o in offered.items() if float(o["created_at"]) <= since)
        if left:
            log.warning("not adopting %d version(s) of %r left in node RAM (%s): %r was moved back after they "
                        "were saved; the node agent lets them go", len(left), branch, ", ".join(left), branch)
            with contextlib.suppress(TierCacheError):  # else they stay until a newer commit lets them go
                agent.request("orphans", rank=view.rank, release=left,
                              why=f"branch {branch!r} was moved back after it was saved")
            offered = {v: o for v, o in offered.items() if v not in left}
    return offered


def _moved_back(catalog: Catalog, branch: str) -> datetime | None:
    """When ``branch`` was last moved back to an older version; ``None`` if never.

    A rollback counts from when it was made. A resume (a save after restoring an older version)
    counts from when that save was made, not from its commit: the commit is asynchronous, and
    the versions saved after it, on the new history, may be older than the commit.
    """
    when: list[datetime] = []
    for m in catalog.reflog("branch", branch):
        if m.why == "rollback":
            when.append(m.at)
        elif m.why == "resume":
            try:
                when.append(catalog.peek(m.version).created_at)
            except TierCacheError:  # its manifest is gone: the move itself is the bound
                when.append(m.at)
    return max(when, default=None)


def _newest_common(statuses: list[Status]) -> Decision:
    """The coordinator's choice: the newest version every rank holds a part of, and the newer ones some rank lacks.

    The payload: ``v``, the version to adopt (``None``: none), and ``incomplete``, each newer
    version offered by some rank but not all, with its step and the ranks that hold no part of it.
    """
    if any(s.payload is None for s in statuses):  # a rank could not say what it holds
        return Decision({"v": None, "incomplete": {}})
    offered: dict[str, int] = {}
    for s in statuses:
        offered.update(s.payload)
    common = set(offered)
    for s in statuses:
        common &= set(s.payload)
    vid = max(common, key=lambda v: (offered[v], v)) if common else None
    floor = (offered[vid], vid) if vid is not None else None
    incomplete = {v: {"step": step, "missing": [r for r, s in enumerate(statuses) if v not in s.payload]}
                  for v, step in offered.items() if v not in common and (floor is None or (step, v) > floor)}
    return Decision({"v": vid, "incomplete": incomplete})


def _never_adopted(view: GroupView, ref: str, incomplete: dict[str, dict[str, Any]], vid: str | None,
                   mine: dict[str, dict[str, Any]]) -> None:
    """Say once which newer versions of ``ref`` cannot be adopted and why; have the agent let this rank's parts go."""
    shown = "; ".join(f"{v} (step {o['step']}): rank(s) {', '.join(map(str, o['missing']))} hold no part of it"
                      for v, o in sorted(incomplete.items(), key=lambda kv: kv[1]["step"], reverse=True))
    instead = f"adopting version {vid} instead" if vid is not None else "restoring the committed head instead"
    log.warning("cannot adopt %d version(s) of %r left in node RAM: %s (their trainer died before save() "
                "returned, or their node's agent restarted); %s", len(incomplete), ref, shown, instead)
    ours = [v for v in incomplete if v in mine]
    agent = view.cache.agent
    if ours and agent is not None:
        try:
            agent.request("orphans", rank=view.rank, release=ours,
                          why="a restarted group found some rank's part of its version missing")
        except TierCacheError as e:  # they stay kept until a newer commit of their branch lets them go
            log.info("could not have the node agent let go of parts that can never be adopted: %s", e)


def _read_part(view: GroupView, orphan: dict[str, Any]) -> Any:
    """This rank's state of an orphaned part, read back from node RAM (every chunk verified)."""
    part = Version.from_json(str(orphan["manifest"]).encode(), source="node agent")
    agent = view.cache.agent
    assert agent is not None
    ids = sorted({c.id for c in part.chunks})
    _, held = agent.holds([], ids)
    view.core.catalog.note_chunks("ram", [c for c, ok in held.items() if ok])
    return view.core.restore_version(part)


__all__ = ["adopt_orphans"]
