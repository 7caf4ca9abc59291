"""Maintenance over a cache's tiers and catalog: verify and repair, garbage collection, doctor.

These are plain functions of a :class:`~tiercache.cache.TierCache`; the cache's ``verify``,
``gc`` and ``doctor`` methods and the CLI verbs of the same names delegate here.

**Verify** reads every copy of every chunk (and every manifest) on every durable tier that should
hold it, checks it against its content id, and reports each copy that is missing or damaged. With
``repair`` it rewrites each such copy from a good copy on another tier.

**GC** decides liveness like this: every version reachable from a branch head or a tag through
``parent`` links is live (lineage is a feature: ``main~3`` and ``log`` keep working), and so is any
version still being written by this process or whose manifest is younger than the grace period.
Everything else (history orphaned by a rollback, a branch's versions after the branch ref is
gone) is collected: first its manifests on every tier, then the chunks that no remaining manifest
names, in the reverse of the write order (refs -> manifests -> chunks). A chunk younger than the
grace period is never deleted, so a save in flight in another process (chunks written, manifest or
ref not yet) survives. Refs are never deleted: every ref is a root, so a branch head or tag, and its
chunks, are never collected. Known limit: a writer in *another* process that reuses (deduplicates)
an old chunk of a version being collected is protected only if its manifest is already stored.

**Doctor** probes the S3 endpoint (conditional writes enforced? read-after-write?) and lists, and
optionally aborts, multipart uploads left unfinished under the cache's prefix.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from tiercache.errors import ConfigError, IntegrityError, InvalidArgumentError, TierCacheError, TierUnavailableError
from tiercache.failpoints import failpoint
from tiercache.manifest import RefRecord, Version
from tiercache.names import CHUNKS, REFS, VERSIONS, chunk_key, status_key, version_key
from tiercache.policy.meter import ThroughputMeter
from tiercache.restore import Reader
from tiercache.tiers.base import Tier
from tiercache.tiers.disk import DiskTier

if TYPE_CHECKING:
    from tiercache.cache import TierCache

log = logging.getLogger("tiercache.maintenance")

# ---------------------------------------------------------------------------------------------
# verify / repair


@dataclass(frozen=True)
class Damage:
    """One bad copy found by :func:`verify`.

    Attributes:
        tier: The tier holding (or missing) the copy.
        key: The object's key (``chunks/..`` or ``versions/..``).
        problem: ``missing`` (the tier should hold it and does not) or ``damaged`` (its bytes do
            not match the content id, or the manifest does not parse or differs).
        detail: What was wrong, in words.
        repaired_from: The tier whose good copy replaced it, or ``None`` if it was not repaired.
    """

    tier: str
    key: str
    problem: Literal["missing", "damaged"]
    detail: str
    repaired_from: str | None = None


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked and found.

    Attributes:
        versions: Versions checked.
        chunks: Distinct chunks checked.
        copies: Chunk and manifest copies read and checked, over all tiers.
        damage: Every missing or damaged copy, in tier and key order.
        unrepairable: Keys with no good copy on any tier (their versions cannot be restored).
    """

    versions: int
    chunks: int
    copies: int
    damage: tuple[Damage, ...]
    unrepairable: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every copy was good, or every bad one was repaired."""
        return not self.unrepairable and all(d.repaired_from is not None for d in self.damage)

    @property
    def repaired(self) -> int:
        """How many copies were rewritten from a good copy."""
        return sum(d.repaired_from is not None for d in self.damage)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data."""
        return {
            "versions": self.versions, "chunks": self.chunks, "copies": self.copies, "ok": self.ok,
            "repaired": self.repaired, "unrepairable": list(self.unrepairable),
            "damage": [d.__dict__ for d in self.damage],
        }


def _durable(cache: TierCache) -> dict[str, Tier]:
    return dict(cache.engine.tiers)


def _check_chunk(tier: Tier, chunk_id: str, nbytes: int, algo: str) -> bytes:
    """Read one tier's copy of a chunk and verify it; return it as stored.

    Raises:
        IntegrityError: If the copy is missing or does not match its id.
    """
    # A reader over this tier alone: the same decode-and-verify code as every restore. Its meter
    # is a throwaway one: read_object records nothing, and verify's reads must not steer policy.
    only = Reader(lambda: {tier.name: tier}, lambda _t, _c: True, ThroughputMeter(), 1)
    return only.read_object(chunk_id, nbytes, algo)[0]


def verify(cache: TierCache, ref: str | None = None, *, repair: bool = False) -> VerifyReport:
    """Check every copy of the chunks and manifests of one version (or all) on every durable tier.

    A tier should hold a chunk when it holds the manifest of a version naming it, or when it
    lists the chunk. Copies are read whole and verified against the content id.

    Args:
        cache: The open cache.
        ref: A ref string for one version, or ``None`` for every version.
        repair: Rewrite each missing or damaged copy from a good copy on another tier.

    Returns:
        The report; ``report.ok`` says whether everything is (now) good.

    Raises:
        VersionNotFoundError: If ``ref`` does not resolve.
    """
    cache.flush()
    versions = [cache.manifest(ref)] if ref is not None else cache.catalog.all()
    tiers = _durable(cache)
    listed = {name: cache.catalog.chunks_on(name) for name in tiers}
    # (tier, chunk id) -> (nbytes, hash algo) for every copy that should be there.
    wanted: dict[tuple[str, str], tuple[int, str]] = {}
    for v in versions:
        for name in tiers:
            if cache.catalog.manifest_on(name, v.id):
                for c in v.chunks:
                    wanted[(name, c.id)] = (c.nbytes, v.hash_algo)
            else:
                for c in v.chunks:
                    if c.id in listed[name]:
                        wanted[(name, c.id)] = (c.nbytes, v.hash_algo)

    def check(item: tuple[tuple[str, str], tuple[int, str]]) -> Damage | None:
        (name, cid), (nbytes, algo) = item
        key = chunk_key(cid)
        try:
            _check_chunk(tiers[name], cid, nbytes, algo)
            return None
        except IntegrityError as e:
            problem: Literal["missing", "damaged"] = "damaged" if tiers[name].exists(key) else "missing"
            return Damage(name, key, problem, str(e))
        except TierCacheError as e:
            return Damage(name, key, "damaged", f"{type(e).__name__}: {e}")

    with ThreadPoolExecutor(max(1, cache.config.io_threads), thread_name_prefix="tiercache-verify") as pool:
        found = [d for d in pool.map(check, sorted(wanted.items())) if d is not None]
    found += _check_manifests(cache, versions, tiers)
    unrepairable: list[str] = []
    if repair:
        found, unrepairable = _repair(cache, versions, tiers, found)
    else:
        unrepairable = _without_good_copy(found, wanted, tiers)
    for d in found:
        log.warning("verify: %s copy of %s on %s: %s%s", d.problem, d.key, d.tier, d.detail,
                    f" (repaired from {d.repaired_from})" if d.repaired_from else "")
    chunks = {cid for _, cid in wanted}
    copies = len(wanted) + sum(cache.catalog.manifest_on(n, v.id) for v in versions for n in tiers)
    return VerifyReport(len(versions), len(chunks), copies, tuple(sorted(found, key=lambda d: (d.tier, d.key))),
                        tuple(sorted(unrepairable)))


def _check_manifests(cache: TierCache, versions: list[Version], tiers: dict[str, Tier]) -> list[Damage]:
    out = []
    for v in versions:
        for name, tier in tiers.items():
            if not cache.catalog.manifest_on(name, v.id):
                continue
            key = version_key(v.id)
            data = tier.get(key)
            if data is None:
                out.append(Damage(name, key, "missing", "manifest listed but not readable"))
                continue
            try:
                if Version.from_json(data, source=f"{name}:{key}") != v:
                    out.append(Damage(name, key, "damaged", "manifest differs from the other tiers' copy"))
            except IntegrityError as e:
                out.append(Damage(name, key, "damaged", str(e)))
    return out


def _without_good_copy(found: list[Damage], wanted: dict[tuple[str, str], tuple[int, str]],
                       tiers: dict[str, Tier]) -> list[str]:
    bad = {(d.tier, d.key) for d in found}
    holders: dict[str, set[str]] = {}
    for name, cid in wanted:
        holders.setdefault(chunk_key(cid), set()).add(name)
    return [key for key, names in holders.items() if all((n, key) in bad for n in names)]


def _repair(cache: TierCache, versions: list[Version], tiers: dict[str, Tier],
            found: list[Damage]) -> tuple[list[Damage], list[str]]:
    sizes = {c.id: (c.nbytes, v.hash_algo) for v in versions for c in v.chunks}
    by_id = {v.id: v for v in versions}
    out: list[Damage] = []
    unrepairable: list[str] = []
    for d in found:
        tier = tiers[d.tier]
        if d.key.startswith(VERSIONS):
            vid = d.key[len(VERSIONS) : -len(".json")]
            # The catalog's copy parsed and was checked when it was loaded: it is the good one.
            tier.put(d.key, by_id[vid].to_json())
            out.append(Damage(d.tier, d.key, d.problem, d.detail, repaired_from="catalog"))
            continue
        cid = d.key.rsplit("/", 1)[-1]
        nbytes, algo = sizes[cid]
        good = _good_copy(tiers, d.tier, cid, nbytes, algo)
        if good is None:
            unrepairable.append(d.key)
            out.append(d)
            continue
        data, src = good
        tier.put(d.key, data)
        cache.catalog.note_chunks(d.tier, [cid])
        out.append(Damage(d.tier, d.key, d.problem, d.detail, repaired_from=src))
    return out, sorted(set(unrepairable))


def _good_copy(tiers: dict[str, Tier], bad: str, chunk_id: str, nbytes: int, algo: str) -> tuple[bytes, str] | None:
    for name, tier in tiers.items():
        if name == bad:
            continue
        try:
            return _check_chunk(tier, chunk_id, nbytes, algo), name
        except TierCacheError:
            continue
    return None


# ---------------------------------------------------------------------------------------------
# gc


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
    """

    dry_run: bool
    grace: float
    versions: tuple[str, ...]
    manifests: dict[str, int] = field(default_factory=dict)
    chunks: dict[str, int] = field(default_factory=dict)
    bytes_freed: dict[str, int] = field(default_factory=dict)
    spared: int = 0

    @property
    def total_bytes(self) -> int:
        """Bytes freed over all tiers."""
        return sum(self.bytes_freed.values())

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data."""
        return {
            "dry_run": self.dry_run, "grace": self.grace, "versions": list(self.versions),
            "manifests": self.manifests, "chunks": self.chunks, "bytes_freed": self.bytes_freed,
            "total_bytes": self.total_bytes, "spared": self.spared,
        }


def _listing(tier: Tier, prefix: str) -> dict[str, tuple[int, float]]:
    """``key -> (size, modified time)`` of every object under ``prefix``.

    Tiers that cannot tell an object's age report it as just written, so only ``grace=0``
    collects there.
    """
    if isinstance(tier, DiskTier):
        out = {}
        for key in tier.list(prefix):
            try:
                st = os.stat(os.path.join(tier.root, *key.split("/")))
            except FileNotFoundError:
                continue  # deleted since the listing
            out[key] = (st.st_size, st.st_mtime)
        return out
    dated = getattr(tier, "list_dated", None)
    if dated is not None:
        return {k: (size, mtime.timestamp()) for k, size, mtime in dated(prefix)}
    now = time.time()
    return {key: (tier.size(key) or 0, now) for key in tier.list(prefix)}


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


def _roots(cache: TierCache, tiers: dict[str, Tier]) -> set[str]:
    """Every version a ref points at, in this process's view or on any tier right now."""
    roots = {r.version for r in cache.catalog.refs().values()}
    for name, tier in tiers.items():
        for key in tier.list(REFS):
            got = tier.read_ref(key)
            if got is not None:
                try:
                    roots.add(RefRecord.from_json(got.data, source=f"{name}:{key}").version)
                except IntegrityError as e:
                    raise IntegrityError(f"gc refused: a ref cannot be read ({e}); run `tiercache verify`") from e
    return roots


def _live(versions: dict[str, Version], roots: Iterable[str], extra: Iterable[str]) -> set[str]:
    """Every version reachable through parents from ``roots`` and ``extra``.

    A version whose parent no tier holds (a hole, left by an older tiercache or a lost
    manifest) cannot say which older versions are its ancestors, so every older version of its
    branch is kept: GC never collects an ancestor of a branch head or tag.
    """
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
            log.warning("gc: version %s names parent %s, which no tier holds: keeping every older version of "
                        "branch %r", child.id, child.parent, child.branch)
            todo += [o.id for o in versions.values()
                     if o.branch == child.branch and o.created_at < child.created_at and o.id not in live]
        holes = []


def gc(cache: TierCache, *, dry_run: bool = False, grace: float | None = None) -> GcReport:
    """Delete versions no ref reaches and chunks no remaining manifest names, on every durable tier.

    Args:
        cache: The open cache.
        dry_run: Compute and report what would be freed; delete nothing.
        grace: Seconds during which new unreferenced objects are kept (default ``config.gc_grace``).

    Returns:
        What was (or would be) collected.

    Raises:
        InvalidArgumentError: If ``grace`` is negative.
    """
    grace = cache.config.gc_grace if grace is None else grace
    if grace < 0:
        raise InvalidArgumentError(f"gc grace must be >= 0 seconds, got {grace}")
    down = cache.health.down()
    if down:
        name, outage = next(iter(down.items()))
        raise TierUnavailableError(f"gc refused: tier {name} is unavailable ({outage.reason}); the refs it holds "
                                   "could keep versions alive: run gc once it answers")
    cache.engine.wait_published()
    tiers = _durable(cache)
    now = time.time()
    # Refs first (the reverse of the write order): anything a ref reaches now is kept, and so is
    # anything a branch or tag move left behind less than reflog_keep seconds ago.
    roots = _roots(cache, tiers)
    moves = cache.catalog.reflog()
    expired = [m for m in moves if now - m.at.timestamp() >= cache.config.reflog_keep]
    for m in moves:
        if m not in expired:
            roots |= {m.version, *([m.previous] if m.previous else [])}
    versions = {v.id: v for v in cache.catalog.all()}
    for name, tier in tiers.items():
        versions.update(_tier_manifests(tier, name, versions))
    pending = cache.engine.pending_jobs()
    young = [vid for vid, v in versions.items() if now - v.created_at.timestamp() < grace]
    live = _live(versions, roots, [*pending, *young])
    dead = sorted(vid for vid in versions if vid not in live)
    needed = {c.id for vid in live if vid in versions for c in versions[vid].chunks}

    manifests: dict[str, list[str]] = {}
    chunks: dict[str, list[str]] = {}
    freed: dict[str, int] = {}
    spared = 0
    for name, tier in tiers.items():
        listing = _listing(tier, VERSIONS)
        keys = [version_key(vid) for vid in dead if version_key(vid) in listing]
        manifests[name] = keys
        freed[name] = sum(listing[k][0] for k in keys)
    if not dry_run:
        cache.catalog.forget_reflog(expired)
        for name, keys in manifests.items():
            for key in keys:
                tiers[name].delete(status_key(key[len(VERSIONS) : -len(".json")]))
                tiers[name].delete(key)
            for vid in dead:
                cache.catalog.mark_on(name, vid, present=False)
        _forget(cache, dead)
    failpoint("gc.after_manifest_delete")
    for name, tier in tiers.items():
        listing = _listing(tier, CHUNKS)
        keys = []
        for key, (size, mtime) in listing.items():
            if key.rsplit("/", 1)[-1] in needed:
                continue
            if now - mtime < grace:
                spared += 1
                continue
            keys.append(key)
            freed[name] += size
        chunks[name] = keys
        if not dry_run:
            for key in keys:
                tier.delete(key)
            cache.catalog.note_chunks(name, [k.rsplit("/", 1)[-1] for k in keys], present=False)
    if not dry_run:
        cache.engine.evict_ram([k for keys in chunks.values() for k in keys])
    report = GcReport(dry_run, grace, tuple(dead), {n: len(k) for n, k in manifests.items()},
                      {n: len(k) for n, k in chunks.items()}, freed, spared)
    log.info("gc%s: %d versions, %d chunk objects, %d bytes", " (dry run)" if dry_run else "",
             len(dead), sum(report.chunks.values()), report.total_bytes)
    return report


def _forget(cache: TierCache, dead: list[str]) -> None:
    """Drop collected versions from the catalog so ``ls`` and ref resolution no longer see them."""
    cat = cache.catalog
    with cat._lock:  # the catalog has no public removal yet (asked of its owner)
        for vid in dead:
            cat._versions.pop(vid, None)
            cat.mark_on("ram", vid, present=False)


# ---------------------------------------------------------------------------------------------
# doctor


@dataclass(frozen=True)
class Upload:
    """An unfinished multipart upload under the cache's prefix.

    Attributes:
        key: The object key it would create.
        upload_id: Its S3 upload id.
        age: Seconds since it was started.
        aborted: Whether doctor aborted it.
    """

    key: str
    upload_id: str
    age: float
    aborted: bool = False


@dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found about the S3 endpoint.

    Attributes:
        probe: The result of ``S3Tier.probe_conditional_writes()`` (``if_none_match``, ``if_match``,
            ``delete_if_match``, ``read_after_write``).
        allow_unsafe_refs: Whether the config lets refs be committed on a store without
            conditional writes.
        uploads: Unfinished multipart uploads under the prefix (aborted ones marked).
    """

    probe: dict[str, bool]
    allow_unsafe_refs: bool
    uploads: tuple[Upload, ...]

    @property
    def conditional_writes(self) -> bool:
        """Whether the store enforces both ``If-None-Match: *`` and ``If-Match`` on PUT."""
        return self.probe.get("if_none_match", False) and self.probe.get("if_match", False)

    @property
    def problems(self) -> list[str]:
        """One line per problem, each saying what to do."""
        out = []
        if not self.conditional_writes:
            out.append(
                "the S3 endpoint ignores conditional writes (If-None-Match/If-Match): two writers could "
                "overwrite each other's refs, so remote ref commits are refused; use a store that enforces "
                "them, or set s3.allow_unsafe_refs = true (or pass --unsafe) if only one writer uses this prefix"
            )
        if not self.probe.get("read_after_write", False):
            out.append("the S3 endpoint is not read-after-write consistent: a restore may read stale refs")
        stale = [u for u in self.uploads if not u.aborted]
        if stale:
            out.append(f"{len(stale)} unfinished multipart upload(s) under the prefix: run `tiercache doctor "
                       "--abort-stale AGE` to abort those older than AGE seconds")
        return out

    @property
    def ok(self) -> bool:
        """Whether refs can be committed safely (or the unsafe flag accepts the risk)."""
        return (self.conditional_writes or self.allow_unsafe_refs) and self.probe.get("read_after_write", False)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data."""
        return {
            "ok": self.ok, "conditional_writes": self.conditional_writes, "probe": self.probe,
            "allow_unsafe_refs": self.allow_unsafe_refs, "problems": self.problems,
            "uploads": [u.__dict__ for u in self.uploads],
        }


def doctor(cache: TierCache, *, abort_stale: float | None = None, unsafe: bool = False) -> DoctorReport:
    """Probe the S3 tier and list (and optionally abort) stale multipart uploads.

    Args:
        cache: The open cache (it must have an S3 tier).
        abort_stale: Abort unfinished multipart uploads older than this many seconds.
        unsafe: Accept a store that ignores conditional writes (as ``s3.allow_unsafe_refs``).

    Returns:
        The report.

    Raises:
        ConfigError: If the cache has no S3 tier.
        InvalidArgumentError: If ``abort_stale`` is negative.
    """
    s3 = cache.engine.tiers.get("s3")
    if s3 is None or cache.config.s3 is None:
        raise ConfigError("doctor checks the S3 tier and this cache has none: add an [s3] table to the config")
    if abort_stale is not None and abort_stale < 0:
        raise InvalidArgumentError(f"--abort-stale must be >= 0 seconds, got {abort_stale}")
    probe = s3.probe_conditional_writes()  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    uploads = []
    for key, upload_id, initiated in s3.list_multipart_uploads():  # type: ignore[attr-defined]
        age = (now - initiated).total_seconds()
        aborted = abort_stale is not None and age >= abort_stale
        if aborted:
            s3.abort_multipart_upload(key, upload_id)  # type: ignore[attr-defined]
            log.info("doctor: aborted multipart upload %s of %s (%.0f s old)", upload_id, key, age)
        uploads.append(Upload(key, upload_id, age, aborted))
    return DoctorReport(dict(probe), cache.config.s3.allow_unsafe_refs or unsafe, tuple(uploads))


__all__ = ["Damage", "DoctorReport", "GcReport", "Upload", "VerifyReport", "doctor", "gc", "verify"]
