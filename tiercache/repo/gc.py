"""Garbage collection: versions no ref (or recent ref move) reaches, then chunks nothing names.

Liveness: every version reachable through ``parent`` links from a branch head or a tag is live
(lineage is a feature: ``main~3`` and ``log`` keep working), and so is every version a branch or
tag move left behind less than ``reflog_keep`` seconds ago, every version still being written by
this process and its parent, and any manifest younger than the grace period. A version that names
a parent no tier holds (a hole, left by an older tiercache) keeps every older version of its
branch. Everything else is collected in the reverse of the write order: first its manifests (and
status records) on every tier, then the chunks that no remaining manifest names and no pending
version leases. A chunk younger than the grace period is never deleted, so a save in flight in
another process (chunks written, manifest or ref not yet) survives. Refs are never deleted.

Known limit: a writer in *another* process that reuses (deduplicates) an old chunk of a version
being collected is protected only once its manifest is stored; in this process, leases protect it
(:mod:`tiercache.repo.leases`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.errors import IntegrityError, InvalidArgumentError, TierUnavailableError
from tiercache.failpoints import failpoint
from tiercache.manifest import RefRecord, Version
from tiercache.names import CHUNKS, PARTS, REFS, VERSIONS, version_key
from tiercache.tiers.base import Tier

if TYPE_CHECKING:
    from tiercache.repo.repository import Repo

log = logging.getLogger("tiercache.repo.gc")


@dataclass(frozen=True)
class GcReport:
    """What :func:`gc` collected (or, with ``dry_run``, would collect).

    Attributes:
        dry_run: Whether nothing was deleted.
        grace: The grace period used, in seconds.
        versions: Ids of the versions collected (their manifests deleted from every tier).
        manifests: Manifest objects deleted, per tier.
        chunks: Chunk objects deleted, per tier.
        bytes_freed: Bytes of the deleted objects, per tier.
        spared: Unreferenced objects left alone because they are younger than the grace period.
        kept_by_reflog: Versions no ref reaches that are kept only because a branch or tag move
            left them behind less than ``reflog_keep`` seconds ago.
        reflog_keep: The ``reflog_keep`` setting used, in seconds.
        reflog_expires: Unix time at which the first of ``kept_by_reflog`` becomes collectable, or ``None``.
    """

    dry_run: bool
    grace: float
    versions: tuple[str, ...]
    manifests: dict[str, int] = field(default_factory=dict)
    chunks: dict[str, int] = field(default_factory=dict)
    bytes_freed: dict[str, int] = field(default_factory=dict)
    spared: int = 0
    kept_by_reflog: tuple[str, ...] = ()
    reflog_keep: float = 0.0
    reflog_expires: float | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes freed over all tiers."""
        return sum(self.bytes_freed.values())

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data."""
        return {
            "dry_run": self.dry_run, "grace": self.grace, "versions": list(self.versions),
            "manifests": self.manifests, "chunks": self.chunks, "bytes_freed": self.bytes_freed,
            "total_bytes": self.total_bytes, "spared": self.spared, "kept_by_reflog": list(self.kept_by_reflog),
            "reflog_keep": self.reflog_keep, "reflog_expires": self.reflog_expires,
        }


def _listing(tier: Tier, prefix: str) -> dict[str, tuple[int, float]]:
    """``key -> (size, modified time)`` of every object under ``prefix``."""
    return {key: (size, mtime.timestamp()) for key, size, mtime in tier.list_dated(prefix)}


def _tier_manifests(tier: Tier, name: str, known: dict[str, Version]) -> dict[str, Version]:
    """Manifests on ``tier`` that the catalog has not loaded (written by another process since)."""
    out = {}
    for key in tier.list(VERSIONS):
        vid = key[len(VERSIONS) : -len(".json")]
        if not key.endswith(".json") or vid in known:
            continue
        data = tier.get(key)
        if data is None:
            continue
        try:
            out[vid] = Version.from_json(data, source=f"{name}:{key}")
        except IntegrityError as e:
            log.warning("gc: keeping unreadable manifest %s on %s: %s", key, name, e)
    return out


def _roots(repo: Repo) -> set[str]:
    """Every version a ref points at, in this process's view or on any tier right now."""
    roots = {r.version for r in repo.catalog.refs().values()}
    for name, tier in repo.durable.items():
        for key in tier.list(REFS):
            got = tier.read_ref(key)
            if got is not None:
                try:
                    roots.add(RefRecord.from_json(got.data, source=f"{name}:{key}").version)
                except IntegrityError as e:
                    raise IntegrityError(f"gc refused: a ref cannot be read ({e}); run `tiercache verify`") from e
    return roots


def _live(versions: dict[str, Version], roots: Iterable[str], extra: Iterable[str], *, warn: bool = True) -> set[str]:
    """Every version reachable through parents from ``roots`` and ``extra`` (holes keep their branch)."""
    live: set[str] = set()
    todo = [*roots, *extra]
    holes: list[Version] = []
    while True:
        while todo:
            vid = todo.pop()
            if vid in live:
                continue
            live.add(vid)
            v = versions.get(vid)
            if v is None or v.parent is None:
                continue
            if v.parent not in versions:
                holes.append(v)
            todo.append(v.parent)
        if not holes:
            return live
        for child in holes:
            if warn:
                    log.warning("gc: version %s names parent %s, which no tier holds: keeping every older version "
                            "of branch %r", child.id, child.parent, child.branch)
            todo += [o.id for o in versions.values()
                     if o.branch == child.branch and o.created_at < child.created_at and o.id not in live]
        holes = []


def _reachable(repo: Repo, tiers: dict[str, Tier], versions: dict[str, Version], roots: set[str],
               extra: list[str], refs: set[str]) -> set[str]:
    """:func:`_live`, with every reachable manifest no listing showed read by its key on each tier.

    A listing is not trusted to be whole (an S3 that lies in listings, or one behind on its
    index): a version a ref reaches is looked up by its key before its chunks may count as
    unreferenced. A ref whose version no tier holds stops gc: its history cannot be told.

    Raises:
        IntegrityError: If a ref points at a version no tier holds a readable manifest of.
    """
    tried: set[str] = set()
    while True:
        live = _live(versions, roots, extra, warn=False)
        unseen = sorted(vid for vid in live if vid not in versions and vid not in tried)
        if not unseen:
            break
        for vid in unseen:
            tried.add(vid)
            for name, tier in tiers.items():
                data = tier.get(version_key(vid))
                if data is None:
                    continue
                try:
                    found = Version.from_json(data, source=f"{name}:{version_key(vid)}")
                except IntegrityError as e:
                    log.warning("gc: unreadable manifest of reachable version %s on %s: %s", vid, name, e)
                    continue
                versions[vid] = repo.catalog.materialize(found)
                break
    pruned = {r.version for r in repo.catalog.pruned()}
    lost = sorted(r for r in refs if r not in versions and r not in pruned)
    if lost:
        raise IntegrityError(f"gc refused: a ref points at version {lost[0]}, which no tier holds a readable "
                             "manifest of, so what it reaches cannot be told: run `tiercache verify`")
    return _live(versions, roots, extra)


def gc(repo: Repo, *, dry_run: bool = False, grace: float | None = None,
       on_chunks_deleted: Callable[[list[str]], None] | None = None) -> GcReport:
    """Delete versions no ref reaches and chunks no remaining manifest names, on every durable tier.

    Args:
        repo: The storage layer.
        dry_run: Compute and report what would be freed; delete nothing.
        grace: Seconds during which new unreferenced objects are kept (default ``config.gc_grace``).
        on_chunks_deleted: Told the ids of the chunks deleted (the engine drops its RAM copies).

    Returns:
        What was (or would be) collected.

    Raises:
        InvalidArgumentError: If ``grace`` is negative.
        TierUnavailableError: If a tier is down (the refs it holds could keep versions alive).
    """
    grace = repo.config.gc_grace if grace is None else grace
    if grace < 0:
        raise InvalidArgumentError(f"gc grace must be >= 0 seconds, got {grace}")
    down = repo.health.down()
    if down:
        name, outage = next(iter(down.items()))
        raise TierUnavailableError(f"gc refused: tier {name} is unavailable ({outage.reason}); the refs it holds "
                                   "could keep versions alive: run gc once it answers")
    tiers = dict(repo.durable)
    cat = repo.catalog
    now = time.time()
    # Refs first (the reverse of the write order): anything a ref reaches now is kept, and so is
    # anything a branch or tag move left behind less than reflog_keep seconds ago.
    roots = _roots(repo)
    ref_roots = set(roots)
    moves = cat.reflog()
    keep_s = repo.config.reflog_keep
    expired = [m for m in moves if now - m.at.timestamp() >= keep_s]
    kept_moves = [m for m in moves if m not in expired]
    for m in kept_moves:
        roots |= {m.version, *([m.previous] if m.previous else [])}
    versions = {v.id: v for v in cat.all()}
    for name, tier in tiers.items():
        versions.update({vid: cat.materialize(v) for vid, v in _tier_manifests(tier, name, versions).items()})
    pending = repo.leases.pending()
    young = [vid for vid, v in versions.items() if now - v.created_at.timestamp() < grace]
    extra = [*pending, *(p for p in pending.values() if p is not None), *young]
    live = _reachable(repo, tiers, versions, roots, extra, ref_roots)
    dead = sorted(vid for vid in versions if vid not in live)
    # What only the reflog keeps: a gc that frees nothing says why (see reflog_keep).
    by_reflog = tuple(sorted(vid for vid in live - _live(versions, ref_roots, extra, warn=False) if vid in versions))
    held = set(by_reflog)
    expires = min((m.at.timestamp() + keep_s for m in kept_moves if m.version in held or m.previous in held),
                  default=None)
    needed = {c for vid in live if vid in versions for c in cat.chunks_of(versions[vid])}
    for vid in sorted(live):
        v = versions.get(vid)
        if v is not None and v.is_header:  # some rank's part is on no tier: keep what its other parts name
            log.warning("gc: version %s is live but some of its ranks' parts are on no tier; keeping what its "
                        "other parts name", vid)

    manifests: dict[str, list[str]] = {}
    chunks: dict[str, int] = {}
    freed: dict[str, int] = {}
    spared = 0
    orphans: dict[str, list[str]] = {}
    for name, tier in tiers.items():
        listing = _listing(tier, VERSIONS)
        manifests[name] = [vid for vid in dead if version_key(vid) in listing]
        freed[name] = sum(listing[version_key(vid)][0] for vid in manifests[name])
        # Parts of multi-rank versions whose group manifest was never written (the version failed).
        parts = _listing(tier, PARTS)
        orphans[name] = sorted(key for key, (_, mtime) in parts.items()
                               if key.split("/")[1] not in versions and now - mtime >= grace)
        freed[name] += sum(parts[key][0] for key in orphans[name])
    if not dry_run:
        cat.forget_reflog(expired)
        for name, vids in manifests.items():
            repo.drop_manifests(name, vids)
            for key in orphans[name]:
                tiers[name].delete(key)
        repo.forget(dead)
    failpoint("gc.after_manifest_delete")
    deleted: list[str] = []
    for name, tier in tiers.items():
        listing = _listing(tier, CHUNKS)
        doomed: dict[str, int] = {}
        for key, (size, mtime) in listing.items():
            cid = key.rsplit("/", 1)[-1]
            if cid in needed:
                continue
            if now - mtime < grace:
                spared += 1
                continue
            doomed[cid] = size
        if dry_run:
            chunks[name] = len(doomed)
            freed[name] += sum(doomed.values())
            continue
        gone = repo.drop_chunks(name, doomed, sizes=doomed)
        chunks[name] = len(gone)
        freed[name] += sum(gone.values())
        deleted += gone
    if deleted and on_chunks_deleted is not None:
        on_chunks_deleted(deleted)
    report = GcReport(dry_run, grace, tuple(dead), {n: len(v) for n, v in manifests.items()}, chunks, freed, spared,
                      by_reflog, keep_s, expires)
    log.info("gc%s: %d versions, %d chunk objects, %d bytes", " (dry run)" if dry_run else "",
             len(dead), sum(report.chunks.values()), report.total_bytes)
    return report
