"""What ``tiercache ui`` shows, as JSON-able data built from a cache's public methods.

:meth:`Capture.of` reads everything once from an open cache (a :class:`~tiercache.TierCache`, or
a small fake with the same methods in tests); each other function here turns a capture into the
body of one JSON endpoint (documented in ``docs/ui.md``). Nothing here writes. Times are Unix
seconds.

Residency comes from ``VersionInfo.states`` (each tier's state and why it does not hold a
version), refined by what the saving process published (``TierCache.status()``): a viewer's own
cache cannot see another process's queues, so the saver's ``pending``/``failed`` wins over an
``absent``. Ref moves come from ``TierCache.reflog()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tiercache.advisor import PlanInputs, plan
from tiercache.errors import InvalidArgumentError
from tiercache.handle import LEVELS, TIER_LEVEL
from tiercache.manifest import RefMove, Version, VersionInfo, left_behind
from tiercache.runtime import CacheStats, LevelState, Status

#: How many versions the lineage and residency views list (newest first).
MAX_VERSIONS = 200
#: Characters of a version id shown where space is short.
SHORT_ID = 10


@dataclass(frozen=True)
class Capture:
    """Everything the UI shows, read from a cache at one moment (the cache can then be closed).

    Attributes:
        at: Unix time of the capture.
        tiers: The cache's tiers, fastest first.
        levels: The durability levels its saves can reach.
        policy: The policy's name.
        versions: Every version, oldest first.
        refs: Every ref (``{"branch/main": id, "tag/best": id}``).
        reflog: The cache's ref moves (``TierCache.reflog()``), oldest first.
        manifests: Each version's manifest by id.
        status: What the saving process published (``TierCache.status()``, typed), or ``None``.
        stats: ``TierCache.stats()``, typed.
        inputs: The advisor's inputs for the level the UI advises on.
    """

    at: float
    tiers: list[str]
    levels: list[str]
    policy: str
    versions: list[VersionInfo]
    refs: dict[str, str]
    reflog: list[RefMove]
    manifests: dict[str, Version]
    status: Status | None
    stats: CacheStats
    inputs: PlanInputs

    @classmethod
    def of(cls, cache: Any, *, mttf: float | None, now: float) -> Capture:
        """Read everything from an open cache (a :class:`~tiercache.TierCache` or a fake with its methods)."""
        versions = cache.versions()
        # Versions a rule the user set pruned stay in the lineage, marked (their states say why).
        everything = sorted([*versions, *cache.pruned()], key=lambda v: v.id)
        levels = list(cache.levels)
        status = cache.status()
        return cls(
            at=now, tiers=list(cache.tier_names), levels=levels, policy=cache.config.policy.name,
            versions=everything, refs=cache.refs(), reflog=list(cache.reflog()),
            manifests={v.id: cache.manifest(v.id) for v in versions[-MAX_VERSIONS:]},
            status=None if status is None else Status.model_validate(status),
            stats=CacheStats.model_validate(cache.stats()),
            inputs=cache.plan_inputs(advice_level(levels), mttf=mttf),
        )


def advice_level(levels: Sequence[str]) -> str:
    """The level the UI advises on: ``local`` where the cache has a disk, else its most durable one."""
    return "local" if "local" in levels else levels[-1]


def _ts(value: datetime | float | None) -> float | None:
    if value is None:
        return None
    return value.timestamp() if isinstance(value, datetime) else float(value)


def _tier_level(tier: str) -> str:
    return "staged" if tier == "ram" else TIER_LEVEL.get(tier, tier)


# ---------------------------------------------------------------------------------------------
# Residency


def tier_states(info: VersionInfo, tiers: Sequence[str], status: Status | None) -> dict[str, dict[str, Any]]:
    """Each tier's state for one version, and why a tier does not hold it.

    Args:
        info: The version (its ``states`` as this viewer's cache sees them).
        tiers: The cache's tiers.
        status: The saving process's status, or ``None``.

    Returns:
        ``{tier: {"state", "reason", "at"}}``; ``state`` is one of ``held``, ``pending``,
        ``skipped``, ``failed``, ``evicted``, ``pruned``, ``absent`` (see :class:`tiercache.TierState`).
    """
    recorded = status.versions.get(info.id) if status is not None else None
    levels = recorded.levels if recorded is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for tier in tiers:
        got = info.states.get(tier)
        seen = levels.get(_tier_level(tier))
        if tier == "ram" and (got is None or got.state == "absent"):
            out[tier] = _ram_state(seen, status)
        elif (got is None or got.state == "absent") and seen is not None and seen.state in (
                "pending", "skipped", "failed"):
            # This viewer cannot see the saving process's queues: what it published says more.
            out[tier] = {"state": seen.state, "reason": seen.reason, "at": seen.at}
        elif got is None:
            out[tier] = {"state": "absent", "reason": "", "at": None}
        else:
            out[tier] = {"state": got.state, "reason": got.reason, "at": _ts(got.at)}
    return out


def _ram_state(seen: LevelState | None, status: Status | None) -> dict[str, Any]:
    live = status is not None and not status.closed
    if seen is not None and seen.state == "held" and status is not None and live:
        return {"state": "held", "at": seen.at,
                "reason": f"staged in the RAM arena of the saving process (pid {status.pid}); it may "
                          "since have been evicted"}
    if seen is not None and seen.state in ("pending", "skipped", "failed"):
        return {"state": seen.state, "reason": seen.reason, "at": seen.at}
    why = "the saving process has closed: its RAM arena is gone" if status is not None and not live else \
        "RAM copies live only inside the saving process"
    return {"state": "absent", "reason": why, "at": None}


# ---------------------------------------------------------------------------------------------
# Lineage


def _reflog(cap: Capture) -> list[dict[str, Any]]:
    """The ref moves, newest first."""
    moves = [{"kind": m.kind, "name": m.name, "version": m.version, "previous": m.previous, "seq": m.seq,
              "at": _ts(m.at), "why": m.why} for m in cap.reflog]
    moves.sort(key=lambda m: m["at"] or 0.0, reverse=True)
    return moves


def _ancestors(head: str | None, by_id: Mapping[str, VersionInfo]) -> set[str]:
    out: set[str] = set()
    while head is not None and head in by_id and head not in out:
        out.add(head)
        head = by_id[head].parent
    return out


def lineage(cap: Capture) -> dict[str, Any]:
    """Body of ``/api/lineage``: versions newest first with refs and residency, branches, tags, reflog."""
    versions, refs = cap.versions, cap.refs
    by_id = {v.id: v for v in versions}
    labels: dict[str, list[str]] = {}
    for key in sorted(refs):
        labels.setdefault(refs[key], []).append(key)
    branches = []
    behind = left_behind(versions, refs)
    for key, vid in sorted(refs.items()):
        kind, _, name = key.partition("/")
        if kind != "branch":
            continue
        info = by_id.get(vid)
        branches.append({"name": name, "head": vid, "step": info.step if info else None,
                         "versions": sum(1 for v in versions if v.branch == name)})
    tags = [{"name": k.partition("/")[2], "version": v} for k, v in sorted(refs.items()) if k.startswith("tag/")]
    rows = []
    for v in reversed(versions[-MAX_VERSIONS:]):
        rows.append({
            "id": v.id, "short": v.id[:SHORT_ID], "step": v.step, "branch": v.branch, "parent": v.parent,
            "created_at": _ts(v.created_at), "nbytes": v.nbytes, "meta": v.meta, "refs": labels.get(v.id, []),
            "rolled_back": v.id in behind,
            "states": tier_states(v, cap.tiers, cap.status),
        })
    return {"tiers": cap.tiers, "total": len(versions), "versions": rows, "branches": branches, "tags": tags,
            "reflog": _reflog(cap)}


def version_summary(cap: Capture, version_id: str) -> dict[str, Any] | None:
    """Body of ``/api/version/{id}``: one version's manifest summary, its dedup against its parent, residency.

    Returns:
        The summary, or ``None`` if the capture has no version with that id.
    """
    m = cap.manifests.get(version_id)
    if m is None:
        return _pruned_summary(cap, version_id)
    sizes = {c.id: c.nbytes for c in m.chunks}
    parent = cap.manifests.get(m.parent) if m.parent is not None else None
    # A parent that was collected (or is past the listed ones) shares nothing that can be shown.
    parent_ids = {c.id for c in parent.chunks} if parent is not None else set()
    shared = [c for c in sizes if c in parent_ids]
    unique_bytes = sum(sizes.values())
    shared_bytes = sum(sizes[c] for c in shared)
    info = next((v for v in cap.versions if v.id == m.id), None)
    return {
        "id": m.id, "step": m.step, "branch": m.branch, "parent": m.parent, "created_at": _ts(m.created_at),
        "nbytes": m.nbytes, "meta": m.meta, "tensors": len(m.tensors), "chunks": len(m.chunks),
        "unique_chunks": len(sizes), "chunk_bytes": unique_bytes, "hash": m.hash_algo, "ranks": len(m.parts) or 1,
        "dedup": {"parent": m.parent, "parent_known": parent is not None, "shared_chunks": len(shared),
                  "shared_bytes": shared_bytes, "new_chunks": len(sizes) - len(shared),
                  "new_bytes": unique_bytes - shared_bytes,
                  "ratio": shared_bytes / unique_bytes if unique_bytes else 0.0},
        "refs": sorted(k for k, v in cap.refs.items() if v == m.id),
        "states": tier_states(info, cap.tiers, cap.status) if info is not None else {},
    }


def _pruned_summary(cap: Capture, version_id: str) -> dict[str, Any] | None:
    """What is known of a version a user-set rule pruned (its record: no manifest is left), or ``None``."""
    info = next((v for v in cap.versions if v.id == version_id), None)
    states = tier_states(info, cap.tiers, cap.status) if info is not None else {}
    why = next((s["reason"] for s in states.values() if s["state"] == "pruned"), None)
    if info is None or why is None:
        return None
    return {"id": info.id, "step": info.step, "branch": info.branch, "parent": info.parent,
            "created_at": _ts(info.created_at), "nbytes": info.nbytes, "meta": info.meta, "pruned": why,
            "refs": sorted(k for k, v in cap.refs.items() if v == info.id), "states": states}


# ---------------------------------------------------------------------------------------------
# Durability lag


def _newest_held(versions: Sequence[VersionInfo]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per branch and level, the newest version a durable tier lists (what the catalog alone tells)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for v in versions:  # oldest first: later ones overwrite
        durable = [t for t in v.tiers if t != "ram"]
        for level in {TIER_LEVEL[t] for t in durable if t in TIER_LEVEL} | ({"durable"} if durable else set()):
            out.setdefault(v.branch, {})[level] = {"version": v.id, "step": v.step,
                                                   "created_at": _ts(v.created_at), "reached_at": None}
    return out


def lag(cap: Capture) -> dict[str, Any]:
    """Body of ``/api/lag``: per branch, how far each level's newest version is behind training.

    Training is the newest step the saving process reported (its saves, its advisor), else the
    branch's newest version. Each level's newest version is the newer of what the saving process
    saw reach it and what the tiers list, among the versions a restart of the branch could resume
    from: its head and the head's ancestors (a version rolled back past is no resume point).
    """
    status = cap.status or Status()
    levels = [lvl for lvl in LEVELS if lvl in {*status.levels, *cap.levels}]
    by_id = {v.id: v for v in cap.versions}
    heads = {k.partition("/")[2]: vid for k, vid in cap.refs.items() if k.startswith("branch/")}
    listed = _newest_held([v for v in cap.versions if v.branch not in heads
                           or v.id in _ancestors(heads[v.branch], by_id)])
    published = {b: {lvl: r.model_dump() for lvl, r in per.items()} for b, per in status.newest.items()}
    training_by = {b: t.model_dump() for b, t in status.training.items()}
    branches: dict[str, Any] = {}
    for name in dict.fromkeys([*(v.branch for v in cap.versions), *training_by]):
        own = [v for v in cap.versions if v.branch == name]
        training, source = training_by.get(name), "status"
        if training is None and own:
            training, source = {"step": own[-1].step, "at": _ts(own[-1].created_at)}, "catalog"
        history = _ancestors(heads.get(name), by_id)
        row: dict[str, Any] = {}
        for level in levels:
            found = [c for c in ((published.get(name) or {}).get(level), listed.get(name, {}).get(level))
                     if c and (c["version"] in history or c["version"] not in by_id)]
            best = max(found, key=lambda c: c["version"]) if found else None
            row[level] = None if best is None or training is None else {
                **best, "steps": training["step"] - best["step"],
                "seconds": max(0.0, training["at"] - best["created_at"])}
        branches[name] = {"training": training, "training_source": source, "levels": row}
    return {"levels": levels, "branches": branches, "history": [h.to_json() for h in status.lag_history]}


# ---------------------------------------------------------------------------------------------
# Throughput, queues, codecs, errors


def throughput(cap: Capture) -> dict[str, Any]:
    """Body of ``/api/throughput``: the meter's rates and history, queues, codec ratios, recent errors, usage."""
    status = cap.status or Status()
    live = status.meter is not None
    meter = status.meter if status.meter is not None else cap.stats.meter
    history = []
    for h in meter.get("history") or []:
        secs = h.get("seconds") or 0.0
        history.append({**h, "bps": h["bytes"] / secs if secs > 0 else None})
    return {
        "source": "status" if live else "meter",
        "rates": meter.get("tiers") or {},
        "history": history,
        "codecs": meter.get("codecs") or {},
        "queues": status.queues,
        "errors": [e.to_json() for e in reversed(status.errors)],
        "tiers": {name: t.to_json() for name, t in cap.stats.tiers.items()},
        "save_wait": status.save_wait.to_json() if cap.status is not None else None,
        "time_to": {lvl: m.to_json() for lvl, m in status.time_to.items()},
    }


# ---------------------------------------------------------------------------------------------
# Advice and overview


def advice(cap: Capture) -> dict[str, Any]:
    """Body of ``/api/advice``: the advised checkpoint interval, its inputs and the goodput curve.

    The saving process's own advisor wins while it runs (it also times the steps); otherwise the
    plan is computed from the captured inputs (measured figures, the UI's ``--mttf``).
    """
    status = cap.status
    if status is not None and not status.closed and status.advice:
        return {"source": "trainer", "plan": status.advice, "reason": None, "inputs": status.advice["inputs"]}
    try:
        return {"source": "measured", "plan": plan(cap.inputs).to_json(), "reason": None,
                "inputs": cap.inputs.to_json()}
    except InvalidArgumentError as e:
        return {"source": "measured", "plan": None, "reason": str(e), "inputs": cap.inputs.to_json()}


def overview(cap: Capture, *, refresh: float) -> dict[str, Any]:
    """Body of ``/api/overview``: tiers, levels, policy, who publishes the status, the node agent, the refresh.

    ``trainer`` is ``None`` without a status. Its ``writer`` is ``"trainer"`` when the training
    process publishes (``pid`` is then the trainer's), or ``"agent"`` when a node agent does for
    the trainers of its node: ``pid`` is then the agent's, which outlives them, and ``trainers``
    lists the pids of the processes that saved through the agent and are still connected to it
    (empty when none is, or the agent that wrote the status is not the one running now).
    """
    node_agent = cap.stats.agent
    trainer = None
    status = cap.status
    if status is not None:
        updated = status.updated_at
        age = cap.at - updated if updated is not None and math.isfinite(updated) else None
        trainer = {"writer": status.writer, "pid": status.pid, "updated_at": updated, "age_s": age,
                   "closed": status.closed, "staged": status.staged.to_json() if status.staged else None}
        if trainer["writer"] == "agent":
            running = node_agent is not None and node_agent.pid == trainer["pid"]
            trainer["trainers"] = sorted({c.pid for c in node_agent.clients if c.saves}
                                         ) if node_agent is not None and running else []
    refs = cap.refs
    agent = None if node_agent is None else {
        "pid": node_agent.pid, "clients": len(node_agent.clients), "in_flight": node_agent.in_flight,
        "queues": node_agent.queues, "arena_used": node_agent.arena.used_bytes,
        "arena_capacity": node_agent.arena.capacity, "metrics": node_agent.metrics}
    return {"tiers": cap.tiers, "levels": cap.levels, "policy": cap.policy, "refresh_s": refresh,
            "generated_at": cap.at, "trainer": trainer, "agent": agent, "versions": len(cap.versions),
            "branches": sum(1 for k in refs if k.startswith("branch/")),
            "tags": sum(1 for k in refs if k.startswith("tag/"))}


__all__ = ["Capture", "advice", "advice_level", "lag", "lineage", "overview", "throughput", "tier_states",
           "version_summary"]
