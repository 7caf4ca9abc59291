"""The catalog: every known version, the refs, ref resolution and chunk residency.

It merges what the durable tiers hold (listing ``versions/`` and ``refs/`` on each) with what
this process has staged but not yet made durable. Listing and resolving read each tier's index
(:mod:`tiercache.repo.index`: a line per version), not the manifests: a manifest is read and
parsed only when its version is asked for (:meth:`Catalog.peek`, :meth:`Catalog.get`), so opening,
listing and restoring cost the same with one version in the cache or thousands.

When tiers disagree about a ref, the record with the highest ``seq`` wins: a ref is written to
the fast tier first, and a rollback always writes a higher ``seq`` than the move it undoes.

Several processes may share the tiers. Every ref write is a compare-and-swap that may only replace
the head the move was based on (or this process's own moves since), so a commit whose branch was
moved by another writer fails with :class:`ConflictError` instead of silently dropping that
writer's version; this process then follows the new head.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tiercache.errors import (
    AmbiguousRefError,
    ConflictError,
    IntegrityError,
    StorageError,
    TierFullError,
    VersionNotFoundError,
)
from tiercache.failpoints import failpoint
from tiercache.gcpause import gc_paused
from tiercache.manifest import (
    MoveReason,
    PrunedRecord,
    RefMove,
    RefRecord,
    TierOutcome,
    Version,
    VersionStatus,
    new_version_id,
    parse_ref,
    utcnow,
)
from tiercache.names import (
    CHUNKS,
    PRUNED,
    REFLOG,
    REFS,
    STATUS,
    VERSIONS,
    part_key,
    pruned_key,
    ref_key,
    reflog_key,
    status_key,
    version_key,
)
from tiercache.parts import check_part, merge
from tiercache.repo import index
from tiercache.repo.index import Summary
from tiercache.tiers.base import Tier

if TYPE_CHECKING:
    from tiercache.repo.health import TierHealth

log = logging.getLogger("tiercache.repo.catalog")

_MIN_PREFIX = 4
#: Locks a version's outcome writes are serialized by (see Catalog.__init__).
_OUTCOME_STRIPES = 64
#: Characters of a version id (:func:`tiercache.manifest.new_version_id`).


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)
#: Compare-and-swap attempts on one ref before giving up (each retry follows a changed token).
_CAS_ATTEMPTS = 8
#: Seconds the first load waits on a tier's read before probing whether the tier answers at all.
_LOAD_PATIENCE_S = 1.0


def _beside(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` on a daemon thread of its own; its future holds the outcome."""
    done: Future[Any] = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=run, name="tiercache-load-part", daemon=True).start()
    return done


@dataclass
class _Listing:
    """A chunk listing in progress: who waits for it, and the notes made while it runs."""

    done: threading.Event = field(default_factory=threading.Event)
    notes: list[tuple[list[str], bool]] = field(default_factory=list)


class Catalog:
    """Versions, refs and chunk residency across the tiers of one cache.

    Args:
        tiers: Returns every tier by name, fastest first (the RAM tier included once it exists).
        health: Which durable tiers answer now (a down one is left out of loads and listings).
    """

    def __init__(self, tiers: Callable[[], Mapping[str, Tier]], health: TierHealth | None = None) -> None:
        self._tiers_now = tiers
        self._durable = [n for n, t in tiers().items() if t.durable]
        self._health = health
        self._lock = threading.RLock()
        # Serializes each read-merge-write of a version's outcomes (catch-up's "superseded" note and
        # a writer's own outcome for another tier may come at once): without it one record's write
        # could carry the other's old view and drop its outcome. Not _lock: the writes do I/O. Striped
        # by version: a status write stuck on a hanging tier holds up only versions of its stripe.
        self._outcome_locks = [threading.Lock() for _ in range(_OUTCOME_STRIPES)]
        # Every known version, from the tiers' indexes or this process's commits.
        self._known: dict[str, Summary] = {}
        # The manifests read so far (or made by this process): a subset of _known.
        self._versions: dict[str, Version] = {}
        # Per (tier, index kind): where that tier's index ends, to append to it.
        self._index: dict[tuple[str, str], index.Segments] = {}
        # One lock per tier: an index write to a tier that hangs (S3) never holds another's (the
        # disk's commit, and with it the `local` level).
        self._index_locks = {name: threading.Lock() for name in self._durable}
        # The part manifests read so far of multi-rank versions known by their group manifest.
        self._parts: dict[str, dict[int, Version]] = {}
        self._on_tier: defaultdict[str, set[str]] = defaultdict(set)
        #: Counts removals from ``_on_tier``; ``_removed[(tier, id)]`` is the count at the newest
        #: removal of that manifest. A listing taken before it (a reload, or a first read left
        #: behind on a hanging tier, merges without the lock held over its I/O) never puts it back.
        self._removals = 0
        self._removed: dict[tuple[str, str], int] = {}
        self._refs: dict[tuple[str, str], RefRecord] = {}
        self._chunks: dict[str, set[str]] = {}
        # residency() is asked for every version on every policy decision: cache it per version
        # (and per set of tiers not listed yet, see residency) and drop a version's entries only
        # when one of its chunks or its manifest moves, so a decision's cost does not grow with
        # the number of saves.
        self._residency: dict[str, dict[frozenset[str], tuple[str, ...]]] = {}
        self._chunk_users: defaultdict[str, set[str]] = defaultdict(set)
        self._ref_locks: dict[tuple[str, str], threading.Lock] = {}
        # Per (tier, ref key): the CAS token and record this process last saw or wrote there.
        self._tokens: dict[tuple[str, str], tuple[str | None, RefRecord | None]] = {}
        # Every ref move this process made -> the record it replaced in this process's view.
        self._moves: dict[RefRecord, RefRecord | None] = {}
        # Moves whose version reached no durable tier: never a base to build on.
        self._retracted: set[RefRecord] = set()
        # Reflog entries of moves this process made, until written to each tier (see write_ref).
        self._move_logs: dict[RefRecord, RefMove] = {}
        self._logged: set[tuple[str, str]] = set()  # (tier, entry id) written or seen
        self._reflog: dict[str, RefMove] = {}
        # A chunk listing in progress per tier: notes made meanwhile, replayed when it lands.
        self._listing: dict[str, _Listing] = {}
        # Why a version is not on some tier, per version (read lazily from status/ records).
        self._outcomes: dict[str, dict[str, TierOutcome]] = {}
        self._status_listed: set[str] | None = None
        # Per tier: the status index's last line per version listed under status/ there.
        self._status_lines: dict[str, dict[str, dict[str, Any]]] = {}
        # Versions a user-set rule deleted from their last durable tier (see note_pruned).
        self._pruned: dict[str, PrunedRecord] = {}
        self._loaded = False
        self._load_lock = threading.Lock()

    @property
    def _tiers(self) -> Mapping[str, Tier]:
        """The tiers now (the RAM tier joins once the engine has an arena)."""
        return self._tiers_now()

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        """Read every manifest and ref from the durable tiers (once; later calls are no-ops).

        A tier that is down is left out (and one that fails while being read is marked down):
        the catalog serves what the other tiers hold, and :meth:`reload` merges it in later.

        The tiers are read side by side, each on a thread of its own, without the catalog's lock.
        A tier still being read after :data:`_LOAD_PATIENCE_S` is probed (one cheap request,
        bounded by the tier's probe timeout, as at open): while it answers, the load waits for
        it, since it may hold a newer head than the others (a job restarted on a node whose disk
        is empty), which the next version must build on. Once it does not answer it is marked
        down and the load goes on without it, as if it had been down at open: the first save
        (or the group view it makes) never waits out the request timeouts and retries of a tier
        that hangs (S3). Its read goes on in the background and merges what it finds if it ever
        lands; else :meth:`reload` merges the tier in when it is back.
        """
        if self._loaded:
            return
        with self._load_lock:  # one first load; other callers wait for it (bounded as above)
            if self._loaded:
                return
            reads = {name: self._read_in_background(name) for name in self._durable if self.available(name)}
            # The collector is held off while this caller waits (the reads build one object per
            # version and chunk id: tiercache.gcpause), not by the reads: one left behind on a
            # hanging tier must not hold it off for the trainer meanwhile.
            with gc_paused():
                for name, read in reads.items():
                    self._await_read(name, read)
            with self._lock:
                self._loaded = True

    def _read_in_background(self, name: str) -> Future[None]:
        """Start reading tier ``name`` into the catalog on a thread of its own; its future says when it is done."""
        done: Future[None] = Future()

        def read() -> None:
            try:
                self._load_available(name)
            except BaseException as e:  # without a health monitor the caller of load() raises it
                done.set_exception(e)
            else:
                done.set_result(None)

        threading.Thread(target=read, name=f"tiercache-load-{name}", daemon=True).start()
        return done

    def _await_read(self, name: str, read: Future[None]) -> None:
        """Wait for the first read of tier ``name`` while the tier answers its probe."""
        while True:
            try:
                read.result(timeout=_LOAD_PATIENCE_S)
                return
            except TimeoutError:
                pass
            if self._health is None or self._answers(name, self._health):
                continue
            log.info("going on without %s's versions and refs: it does not answer (its read goes on, and what "
                     "it finds is merged in if it lands)", name)
            return

    def _answers(self, name: str, health: TierHealth) -> bool:
        """Whether tier ``name`` answers its probe now; one that does not is marked down."""
        if not self.available(name):  # a commit, or the read itself, found it down meanwhile
            return False
        try:
            self._tiers[name].probe()
        except TierFullError:
            return True  # full, yet it answers (and its read goes on)
        except StorageError as e:  # unreachable, hanging or refusing: down, as a failed read would leave it
            health.mark_down(name, e)
            return False
        return True

    def reload(self, name: str) -> None:
        """Merge in what tier ``name`` holds now (after it came back from an outage).

        The tier is read without the catalog's lock (only each merge takes it): a tier that
        hangs while it is read (S3) holds up no save, commit or placement meanwhile.
        """
        with self._lock:
            self._chunks.pop(name, None)
            self._residency.clear()
            loaded = self._loaded
        if loaded:
            # Unlike the first load, the collector is not held off: a reload runs beside training,
            # and a tier that hangs while it is read would hold it off for its request timeouts.
            self._load_available(name)

    def available(self, name: str) -> bool:
        """Whether tier ``name`` answers now (always, without a health monitor)."""
        return self._health is None or self._health.available(name)

    def _load_available(self, name: str) -> None:
        if not self.available(name):
            return
        try:
            self._load_tier(name)
        except StorageError as e:
            if self._health is None:
                raise
            self._health.mark_down(name, e)

    def _load_tier(self, name: str) -> None:
        """Read tier ``name``'s versions, refs, pruned records and reflog.

        The four are independent reads. On a tier reached over the network (S3, a shared disk)
        they run side by side: each is a listing and reads, and waiting for them one after
        another was most of an S3 open of a short history. A node-local disk answers in
        microseconds, so there threads would cost more than they save. Either way the refs are
        merged only once the tier's versions are (a head whose version the catalog does not know
        is never adopted from a tier whose listing failed), and a failed versions read fails the
        tier's read without waiting for the other parts (those end on their own, bounded by the
        tier's timeouts).
        """
        tier = self._tiers[name]
        if tier.node_local:
            self._load_versions(name, None)
            self._merge_refs(name, self._read_refs(name))
            self._load_pruned(name)
            self._load_reflog(name)
        else:
            # Daemon threads: a read left hanging on the tier never holds up the process's exit.
            refs = _beside(self._read_refs, name)
            side = [_beside(load, name) for load in (self._load_pruned, self._load_reflog)]
            self._load_versions(name, _beside)
            self._merge_refs(name, refs.result())
            for f in side:
                f.result()
        with self._lock:
            self._residency.clear()

    def _read_refs(self, name: str) -> list[tuple[str, str, RefRecord]]:
        """Tier ``name``'s branch and tag records: (key, CAS token, record) of each readable one."""
        tier = self._tiers[name]
        out = []
        for key in tier.list(REFS):
            parts = key.split("/")
            if len(parts) != 3 or parts[1] not in ("branch", "tag"):
                continue
            got = tier.read_ref(key)
            if got is None:
                continue
            try:
                out.append((key, got.token, RefRecord.from_json(got.data, source=f"{name}:{key}")))
            except IntegrityError as e:
                log.warning("ignoring damaged ref: %s", e)
        return out

    def _merge_refs(self, name: str, refs: list[tuple[str, str, RefRecord]]) -> None:
        with self._lock:
            for key, token, rec in refs:
                # A commit of this process may have moved the ref there since it was read (a
                # reload runs beside the pipeline): its token is the newer one.
                _, seen = self._tokens.get((name, key), (None, None))
                if seen is None or rec.seq >= seen.seq:
                    self._tokens[(name, key)] = (token, rec)
                cur = self._refs.get((rec.kind, rec.name))
                if cur is None or rec.seq > cur.seq:
                    self._refs[(rec.kind, rec.name)] = rec

    def _load_reflog(self, name: str) -> None:
        tier = self._tiers[name]
        for key in tier.list(REFLOG):
            entry_id = key.rsplit("/", 1)[-1][: -len(".json")]
            with self._lock:
                seen_entry = (name, entry_id) in self._logged
            if seen_entry or not key.endswith(".json"):
                continue
            data = tier.get(key)
            if data is None:
                continue
            try:
                move = RefMove.from_json(data, source=f"{name}:{key}")
            except IntegrityError as e:
                log.warning("ignoring damaged reflog entry: %s", e)
                continue
            with self._lock:
                self._logged.add((name, move.id))
                self._reflog[move.id] = move

    def _load_versions(self, name: str, beside: Callable[..., Future[Any]] | None) -> None:
        """Know tier ``name``'s versions: list its manifests' names, and take each one's summary from the index.

        Every manifest's name is listed at every open, on every tier, and the listing is the
        truth: a line is trusted only for a name so listed (a line without its manifest is dead),
        and a listed name the index misses (a crash between a manifest and its line, a line lost
        to a failed index write or to two writers racing on a segment, an index lost or older than
        the manifest) has its manifest read. The index saves parsing the manifests, not listing
        their names. S3 does not trust the index's lines without the listing either, though a
        listing there is pages of XML: indexes written by older tiercache versions (or by an older
        process still writing to the same bucket) have no gone lines for the manifests they
        deleted, so a version deleted from S3 would be shown as held there and the disk's copy
        evicted as if it were not the last one.
        """
        tier = self._tiers[name]
        with self._lock:
            began = self._removals
        read = beside(index.read, tier, "versions") if beside is not None else None  # beside the listing
        keys = tier.list(VERSIONS)
        lines, seg, _ = read.result() if read is not None else index.read(tier, "versions")
        ids = [k[len(VERSIONS) : -len(".json")] for k in keys if k.endswith(".json")]
        with self._lock:
            # Removed since this listing began (a deletion ran beside it): not held any more.
            ids = [vid for vid in ids if self._removed.get((name, vid), -1) <= began]
            good: set[str] = set()
            for vid in ids:
                self._on_tier[name].add(vid)
                d = lines.get(vid)
                if d is None or index.is_gone(d):
                    continue
                try:
                    summary = Summary.from_line(d)
                except ValueError as e:
                    log.info("index of %s: damaged line of version %s, reading its manifest (%s)", name, vid, e)
                    continue
                good.add(vid)
                if vid not in self._known:
                    self._put_summary(summary)
            # A manifest the index misses (a crash before its line, an index lost or older than it).
            missing = [vid for vid in ids if vid not in self._known]
        found: set[str] = set()
        for v in self._read_manifests(name, missing):
            found.add(v.id)
            with self._lock:
                if v.id not in self._known:
                    self._put_version(v)
        with self._lock:
            for vid in missing:
                if vid not in found and vid not in self._known:
                    self._on_tier[name].discard(vid)  # gone since it was listed, or unreadable
        self._repair_index(name, "versions", seg, [vid for vid in ids if vid not in good and vid in found],
                           dead=len(lines.keys() - set(ids)), live=[vid for vid in ids if vid in good or vid in found])

    def _read_manifests(self, name: str, ids: list[str]) -> list[Version]:
        """Read and parse manifests from tier ``name`` (a damaged or vanished one is logged and left out)."""
        tier = self._tiers[name]

        def fetch(vid: str) -> Version | None:
            data = tier.get(version_key(vid))
            if data is None:
                return None
            try:
                v = Version.from_json(data, source=f"{name}:{version_key(vid)}")
            except IntegrityError as e:
                log.warning("ignoring damaged manifest: %s", e)
                return None
            if v.id != vid:
                log.warning("ignoring manifest %s on %s: it names version %s", vid, name, v.id)
                return None
            return v

        if len(ids) <= 1:
            got = [fetch(vid) for vid in ids]
        else:
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(fetch, ids))
        return [v for v in got if v is not None]

    def _load_pruned(self, name: str) -> None:
        """Read tier ``name``'s pruned records: from its index, and those it misses from their objects."""
        tier = self._tiers[name]
        keys = [k for k in tier.list(PRUNED) if k.endswith(".json")]
        ids = [k[len(PRUNED) : -len(".json")] for k in keys]
        lines, seg, _ = index.read(tier, "pruned")
        good: set[str] = set()
        for vid, key in zip(ids, keys, strict=True):
            d = lines.get(vid)
            if d is not None:
                try:
                    rec = PrunedRecord.model_validate(d["r"])
                except (ValidationError, ValueError, KeyError, TypeError):
                    rec = None
                if rec is not None and rec.version == vid:
                    good.add(vid)
                    with self._lock:
                        self._pruned.setdefault(vid, rec)
                    continue
            if vid in self._pruned:
                continue
            data = tier.get(key)
            if data is None:
                continue
            try:
                rec = PrunedRecord.from_json(data, source=f"{name}:{key}")
            except IntegrityError as e:
                log.warning("ignoring damaged pruned record: %s", e)
                continue
            with self._lock:
                self._pruned[vid] = rec
        self._repair_index(name, "pruned", seg, [vid for vid in ids if vid not in good],
                           dead=len(lines.keys() - set(ids)), live=ids)

    def _line(self, kind: str, vid: str) -> dict[str, Any] | None:
        """The index line of a known version or pruned record (``None`` if this process does not know it)."""
        with self._lock:
            if kind == "versions":
                s = self._known.get(vid)
                return s.to_line() if s is not None else None
            rec = self._pruned.get(vid)
            return {"id": vid, "r": rec.model_dump(mode="json")} if rec is not None else None

    def _repair_index(self, name: str, kind: str, seg: index.Segments, unindexed: list[str], *, dead: int,
                      live: list[str]) -> None:
        """After reading tier ``name``'s index: add the lines it misses, or rebuild it if mostly dead lines."""
        tier = self._tiers[name]
        rebuild = dead > max(index.SEGMENT, len(live))
        # The lines first: the index lock is never held while waiting for the catalog's.
        lines = [(vid, d) for vid in sorted(live if rebuild else unindexed) if (d := self._line(kind, vid)) is not None]
        with self._index_locks[name]:
            self._index[(name, kind)] = seg
            seg.ids.difference_update(unindexed)  # a damaged line is superseded by a later one
            try:
                if rebuild:
                    index.rewrite(tier, kind, seg, lines)
                    log.info("rebuilt the %s index of %s (%d lines, %d dropped)", kind, name, len(lines), dead)
                elif lines:
                    index.append(tier, kind, seg, lines)
                    log.info("added %d missing lines to the %s index of %s", len(lines), kind, name)
            except StorageError as e:
                log.info("could not repair the %s index of %s (the next reader tries again): %s", kind, name, e)

    def _segments(self, name: str, kind: str) -> index.Segments:
        """Where tier ``name``'s index of ``kind`` ends (read once; the tier's index lock is held)."""
        seg = self._index.get((name, kind))
        if seg is None:
            _, seg, _ = index.read(self._tiers[name], kind)
            self._index[(name, kind)] = seg
        return seg

    def append_index(self, tier: str, version: Version) -> None:
        """Append the line of ``version``, whose manifest is now durable on ``tier``, to the tier's index.

        Called after the manifest write and before the ref moves (docs/design.md section 2): a
        crash in between leaves a manifest the index misses, which the next reader adds. A
        failure is logged, not raised: the manifest is the truth.
        """
        t = self._tiers[tier]
        if not t.durable:
            return
        with self._lock:
            known = self._known.get(version.id)
            line = (known if known is not None else Summary.of(version)).to_line()
        self._append_lines(tier, [(version.id, line)])

    def _append_lines(self, tier: str, lines: list[tuple[str, str]]) -> None:
        """Append ``lines`` (version id, line) to durable tier ``tier``'s versions index; a failure is logged."""
        with self._index_locks[tier]:
            try:
                seg = self._segments(tier, "versions")
            except StorageError as e:
                log.warning("could not read the index of %s (a later reader rebuilds it): %s", tier, e)
                return
            index.try_append(self._tiers[tier], "versions", seg, lines)

    def reindex(self) -> dict[str, tuple[int, int]]:
        """Rebuild every available durable tier's index from its manifests and records (``doctor --reindex``).

        Every manifest is read and parsed (the index is a cache of them; this is the one
        operation whose cost grows with the history).

        Returns:
            Per tier, the number of versions and of pruned records indexed.

        Raises:
            StorageError: If a tier fails.
        """
        out = {}
        for name in self._durable:
            if not self.available(name):
                continue
            tier = self._tiers[name]
            ids = sorted(k[len(VERSIONS) : -len(".json")] for k in tier.list(VERSIONS) if k.endswith(".json"))
            found = self._read_manifests(name, ids)
            with self._lock:
                for v in found:
                    self._on_tier[name].add(v.id)
                    if v.id not in self._known:
                        self._put_version(v)
            lines = [(v.id, Summary.of(v).to_line()) for v in found]
            pruned = sorted(k[len(PRUNED) : -len(".json")] for k in tier.list(PRUNED) if k.endswith(".json"))
            self._load_pruned(name)
            plines = [(vid, d) for vid in pruned if (d := self._line("pruned", vid)) is not None]
            slines = []
            for key in sorted(k for k in tier.list(STATUS) if k.endswith(".json")):
                data = tier.get(key)
                try:
                    record = VersionStatus.from_json(data, source=f"{name}:{key}") if data is not None else None
                except IntegrityError as e:
                    log.warning("ignoring damaged status record: %s", e)
                    continue
                if record is not None:
                    slines.append((record.version, {"id": record.version, "r": record.model_dump(mode="json")}))
            with self._lock:
                self._status_lines[name] = dict(slines)
            with self._index_locks[name]:
                for kind, got in (("versions", lines), ("pruned", plines), ("status", slines)):
                    seg = self._index.setdefault((name, kind), index.Segments())
                    index.rewrite(tier, kind, seg, got)
            out[name] = (len(lines), len(plines))
        return out

    # ------------------------------------------------------------------ versions

    def add(self, version: Version, tier: str | None = None) -> None:
        """Record a version this process created or copied (on ``tier``, if given)."""
        with self._lock:
            if self._versions.get(version.id) is not version:  # each tier's commit adds it again
                self._put_version(version)
            if tier is not None:
                self._on_tier[tier].add(version.id)
                self._residency.pop(version.id, None)

    def _put_version(self, version: Version) -> None:
        self._versions[version.id] = version
        self._put_summary(Summary.of(version), replace=True)

    def _put_summary(self, summary: Summary, *, replace: bool = False) -> None:
        """Know a version (by its index line, or its manifest's summary with ``replace``)."""
        old = self._known.get(summary.id)
        if old is not None:
            if not replace:
                return
            self._drop_users(old)
        self._known[summary.id] = summary
        for cid in self._names(summary):
            self._chunk_users[cid].add(summary.id)
        self._residency.pop(summary.id, None)

    def _names(self, version: Version | Summary) -> set[str]:
        """The chunks ``version`` names as far as known (of a group manifest: its parts read so far)."""
        if version.is_header:
            return {c.id for p in self._parts.get(version.id, {}).values() for c in p.chunks}
        if isinstance(version, Summary):
            return set(version.chunks)
        return {c.id for c in version.chunks}

    def _drop_users(self, version: Version | Summary) -> None:
        for cid in self._names(version):
            users = self._chunk_users.get(cid)
            if users is not None:
                users.discard(version.id)
                if not users:
                    del self._chunk_users[cid]

    def forget(self, version_ids: Iterable[str]) -> None:
        """Drop versions (collected by GC) from the catalog, so listing and resolution no longer see them."""
        with self._lock:
            for vid in version_ids:
                self._parts.pop(vid, None)
                self._versions.pop(vid, None)
                old = self._known.pop(vid, None)
                if old is not None:
                    self._drop_users(old)
                self._residency.pop(vid, None)
                for held in self._on_tier.values():
                    held.discard(vid)

    def note_pruned(self, record: PrunedRecord) -> None:
        """Record that a user-set rule deleted a version from its last durable tier.

        The record goes to every available durable tier first (a small object, so the lineage
        and the reason survive whichever tier is read later); then the version leaves the
        catalog (listing sees it through :meth:`pruned`, resolution names the rule).
        """
        body = record.to_json()
        for name in self._durable:
            if self.available(name):
                with contextlib.suppress(StorageError):  # the other tiers keep the record
                    self._tiers[name].put(pruned_key(record.version), body)
        with self._lock:
            self._pruned[record.version] = record
        line = self._line("pruned", record.version)
        assert line is not None
        for name in self._durable:
            if self.available(name):
                with self._index_locks[name]:
                    try:
                        seg = self._segments(name, "pruned")
                    except StorageError:
                        continue  # a reader adds the line from the record
                    index.try_append(self._tiers[name], "pruned", seg, [(record.version, line)])
        self.forget([record.version])

    def pruned(self) -> list[PrunedRecord]:
        """Versions a user-set rule deleted (and that no tier holds again), oldest first."""
        self.load()
        with self._lock:
            return sorted((r for vid, r in self._pruned.items() if vid not in self._known),
                          key=lambda r: r.version)

    def pruned_record(self, version_id: str) -> PrunedRecord | None:
        """The record of a pruned version (``None`` if it is not one)."""
        self.load()
        with self._lock:
            return self._pruned.get(version_id) if version_id not in self._known else None

    def mark_on(self, tier: str, version_id: str, present: bool = True) -> None:
        """Record that ``tier`` now holds (or no longer holds) the manifest of a version."""
        with self._lock:
            if present:
                self._on_tier[tier].add(version_id)
            else:
                self._forget_on(tier, version_id)
            self._residency.pop(version_id, None)

    def _forget_on(self, tier: str, version_id: str) -> None:
        """Drop ``version_id`` from ``tier``'s manifests, remembering when (the caller holds the lock)."""
        self._on_tier[tier].discard(version_id)
        self._removals += 1
        self._removed[(tier, version_id)] = self._removals

    def note_gone(self, tier: str, version_ids: Collection[str]) -> None:
        """Record that ``tier`` no longer holds the manifests of ``version_ids`` (deleted, or found missing).

        On a durable tier their gone lines go to its index, after the manifests went (a reader
        lists the manifests and drops a line whose manifest is not listed, so a deletion cut short
        in between loses nothing). A failed index write is logged: the manifests are the truth.
        """
        with self._lock:
            for vid in version_ids:
                self._forget_on(tier, vid)
                self._residency.pop(vid, None)
        t = self._tiers[tier]
        if not t.durable or not version_ids or tier not in self._index_locks:
            return
        self._append_lines(tier, [(vid, index.gone_line(vid)) for vid in version_ids])

    def users_of(self, chunk_id: str) -> frozenset[str]:
        """Ids of the known versions whose manifests name chunk ``chunk_id``."""
        with self._lock:
            return frozenset(self._chunk_users.get(chunk_id, ()))

    def manifest_on(self, tier: str, version_id: str) -> bool:
        """Whether ``tier`` holds the manifest of ``version_id``."""
        with self._lock:
            return version_id in self._on_tier[tier]

    def peek(self, version_id: str) -> Version:
        """A version's manifest as known, without reading anything more.

        A multi-rank version whose parts were not read is its group manifest
        (:attr:`~tiercache.manifest.Version.is_header`): step, branch, parent, meta and sizes,
        but no tensors or chunks. The save path and the policy use this: they never read
        other ranks' parts.

        Raises:
            VersionNotFoundError: If no tier has it.
        """
        self.load()
        with self._lock:
            v = self._versions.get(version_id)
            known = version_id in self._known
        if v is not None:
            return v
        if not known:
            raise VersionNotFoundError(f"version {version_id} not found on any tier")
        return self._read_manifest(version_id)

    def _read_manifest(self, version_id: str) -> Version:
        """Read and parse a known version's manifest from the first tier holding it that can give it."""
        with self._lock:
            holders = [n for n in self._durable if version_id in self._on_tier[n] and self.available(n)]
        for name in holders:
            try:
                got = self._read_manifests(name, [version_id])
                if not got and not self._tiers[name].exists(version_key(version_id)):
                    # Gone since the open listed it (deleted by another process meanwhile).
                    self.note_gone(name, [version_id])
            except StorageError as e:
                log.warning("cannot read the manifest of version %s on %s: %s", version_id, name, e)
                continue
            if got:
                with self._lock:
                    if version_id not in self._known:  # forgotten meanwhile
                        break
                    return self._versions.setdefault(version_id, got[0])
        raise VersionNotFoundError(
            f"version {version_id}: no tier this process can read holds a readable manifest of it "
            f"(tried {', '.join(holders) or 'none'}); see `tiercache verify`")

    def get(self, version_id: str) -> Version:
        """Return a version's whole manifest (a multi-rank version's parts read and merged, once).

        Raises:
            VersionNotFoundError: If no tier has it.
            IntegrityError: If it is a multi-rank version and some rank's part is on no tier this
                process can read (a node-local disk of another node): the message names the ranks.
        """
        v = self.peek(version_id)
        if not v.is_header:
            return v
        got = self.materialize(v)
        if got.is_header:
            missing = [r for r in range(v.ranks) if r not in self._parts.get(v.id, {})]
            raise IntegrityError(
                f"version {v.id} was saved by {v.ranks} ranks and the parts of ranks {_ranges(missing)} are on "
                "no tier this process can read (each node's disk holds its own ranks' parts): restore it on its "
                "nodes with restore(..., group=...), or from a tier that holds every part (S3)"
            )
        return got

    def all(self, *, whole: bool = True) -> list[Version]:
        """Every known version, oldest first.

        Args:
            whole: Read and merge the parts of multi-rank versions (those with a part on no
                readable tier stay group manifests); ``False`` returns them as known (see
                :meth:`peek`), reading nothing.
        """
        self.load()
        with self._lock:
            ids = sorted(self._known)
            unread = [vid for vid in ids if vid not in self._versions]
        if unread:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(self._try_read_manifest, unread))
        with self._lock:
            known = [self._versions[vid] for vid in ids if vid in self._versions]
        if not whole or not any(v.is_header for v in known):
            return known
        return [self.materialize(v) if v.is_header else v for v in known]

    def _try_read_manifest(self, version_id: str) -> Version | None:
        try:
            return self._read_manifest(version_id)
        except VersionNotFoundError as e:
            log.warning("leaving out version %s: %s", version_id, e)
            return None

    def summaries(self) -> list[Summary]:
        """Every known version as its index line tells it, oldest first (reading no manifest)."""
        self.load()
        with self._lock:
            return [self._known[vid] for vid in sorted(self._known)]

    # ------------------------------------------------------------------ multi-rank versions

    def add_part(self, part: Version) -> None:
        """Record a part manifest this process wrote or read (its own part of a multi-rank version)."""
        assert part.rank is not None
        with self._lock:
            self._parts.setdefault(part.id, {})[part.rank] = part
            for c in part.chunks:  # a deletion sees them named by the version
                self._chunk_users[c.id].add(part.id)

    def part(self, header: Version, rank: int, tiers: Collection[str] | None = None) -> Version | None:
        """Rank ``rank``'s part of the multi-rank version ``header``, read from the first tier that has it.

        Args:
            header: The version's group manifest.
            rank: The rank.
            tiers: The tiers to look in, in that order (default: every available durable tier).

        Returns:
            The part, or ``None`` if no tier in ``tiers`` has it (a damaged copy is logged and skipped).
        """
        with self._lock:
            got = self._parts.get(header.id, {}).get(rank)
        if got is not None:
            return got
        key = part_key(header.id, rank)
        for name in self._durable if tiers is None else tiers:
            if not self.available(name):
                continue
            try:
                data = self._tiers[name].get(key)
                if data is None:
                    continue
                part = check_part(header, rank, Version.from_json(data, source=f"{name}:{key}"), f"{name}:{key}")
            except (IntegrityError, StorageError) as e:
                log.warning("cannot read rank %d's part of version %s on %s: %s", rank, header.id, name, e)
                continue
            self.add_part(part)
            return part
        return None

    def materialize(self, header: Version) -> Version:
        """The whole multi-rank version (parts read from the tiers that hold them, merged once).

        Returns ``header`` itself if some rank's part is on no readable tier.
        """
        if not header.is_header:
            return header
        ranks = range(header.ranks)
        with ThreadPoolExecutor(8) as pool:
            parts = list(pool.map(lambda r: self.part(header, r), ranks))
        if any(p is None for p in parts):
            return header
        merged = merge(header, parts)  # type: ignore[arg-type]
        with self._lock:
            if self._versions.get(header.id) is header:
                self._put_version(merged)
            return self._versions.get(header.id, merged)

    def chunks_of(self, version: Version) -> set[str]:
        """The chunk ids ``version`` names.

        Of a multi-rank version known only by its group manifest: those of the parts read so far.
        """
        with self._lock:
            return self._names(version)

    # ------------------------------------------------------------------ chunks

    def chunks_on(self, tier: str) -> set[str]:
        """Ids of the chunks ``tier`` holds (listed once, then kept up to date by the caller).

        The listing runs without holding the catalog's lock, so saves never wait on it; notes
        made while it runs are replayed onto it. A tier that is down holds nothing as far as
        readers and writers are concerned (an empty set, not remembered).
        """
        while True:
            with self._lock:
                got = self._chunks.get(tier)
                if got is not None:
                    return got
                if not self.available(tier):
                    return set()
                listing = self._listing.get(tier)
                mine = listing is None
                if mine:
                    listing = self._listing[tier] = _Listing()
            assert listing is not None
            if not mine:
                listing.done.wait()
                continue
            try:
                keys = self._tiers[tier].list(CHUNKS)
            except BaseException:
                with self._lock:
                    del self._listing[tier]
                listing.done.set()
                raise
            with self._lock:
                got = {k.rsplit("/", 1)[-1] for k in keys}
                for ids, present in listing.notes:
                    (got.update if present else got.difference_update)(ids)
                self._chunks[tier] = got
                del self._listing[tier]
                self._residency.clear()
            listing.done.set()
            return got

    def holds(self, tier: str, chunk_id: str) -> bool:
        """Whether ``tier`` is believed to hold chunk ``chunk_id``, listing its chunks only if need be.

        Once the tier's chunks are listed, the listing answers. Before that, a durable tier holds
        the chunk if it holds the manifest of a single-process version naming it: chunks are
        written before the manifest naming them and deleted after it (docs/design.md section 2),
        so a restore need not list every chunk of the history (one request per 1000 on S3). A
        wrong belief (a chunk lost behind the catalog's back) costs the reader one failed read
        before the next tier. A multi-rank version's manifest on a node's disk covers only that
        node's parts: its chunks are looked up in the listing.
        """
        with self._lock:
            listed = self._chunks.get(tier)
            if listed is not None:
                return chunk_id in listed
            t = self._tiers.get(tier)
            if t is not None and t.durable:
                held = self._on_tier[tier]
                for vid in self._chunk_users.get(chunk_id, ()):
                    known = self._known.get(vid)
                    if known is not None and not known.ranks and vid in held:
                        return True
        return chunk_id in self.chunks_on(tier)

    def note_chunks(self, tier: str, ids: Iterable[str], present: bool = True) -> None:
        """Record chunks written to (or removed from) ``tier``."""
        ids = list(ids)
        with self._lock:
            have = self._chunks.get(tier)
            if have is not None:
                (have.update if present else have.difference_update)(ids)
            elif tier in self._listing:
                self._listing[tier].notes.append((ids, present))
            # else: never listed yet; the first listing will see these as they are
            for cid in ids:
                for vid in self._chunk_users.get(cid, ()):
                    self._residency.pop(vid, None)

    def _current(self, version: Version | Summary) -> bool:
        """Whether ``version`` is what the catalog knows of its id now (so an answer about it may be kept)."""
        return self._versions.get(version.id) is version or self._known.get(version.id) is version

    def residency(self, version: Version | Summary, listed_only: Collection[str] = ()) -> tuple[str, ...]:
        """Tiers that hold every chunk of ``version``, fastest first.

        A tier named in ``listed_only`` is counted only once its chunks have been listed: until
        then it is taken not to hold the version, and nothing is listed or waited for. The save
        path passes the remote tiers, so a slow bucket listing never holds up a write to the disk;
        not holding is the safe side (nothing is evicted or skipped on the strength of it).
        """
        with self._lock:
            unknown = frozenset(n for n in listed_only if n in self._tiers and n not in self._chunks)
            known = self._residency.get(version.id, {}) if self._current(version) else {}
            got = known.get(frozenset())  # a full answer holds for every caller
            if got is None:
                got = known.get(unknown)
            if got is not None:
                return got
            names = [n for n, t in self._tiers.items() if t.durable or t.name == "ram"]
        if version.is_header:
            # Its chunks are known only once its parts are read (see materialize), which the save
            # path never does. A group manifest is written on a tier only once every part it
            # covers there (every rank's, or on a node's disk its ranks') is durable on it, and an
            # eviction drops it first: so the tiers holding it hold the version.
            with self._lock:
                got = tuple(n for n in names if n not in unknown and self.manifest_on(n, version.id))
                if self._current(version):
                    self._residency.setdefault(version.id, {})[unknown] = got
                return got
        # Listings first, without the lock: a listing in progress on another thread needs it to land.
        held = {n: self.chunks_on(n) for n in names if n not in unknown}
        ids = self._names(version)
        with self._lock:
            got = tuple(n for n in names if n in held and ids <= held[n]
                        and (self.manifest_on(n, version.id) or not ids))
            if self._current(version):
                self._residency.setdefault(version.id, {})[unknown] = got
            return got

    # ------------------------------------------------------------------ outcomes

    def outcomes(self, version_id: str) -> dict[str, TierOutcome]:
        """Why tiers do not hold ``version_id`` (skipped, failed, evicted), as recorded.

        Read from the tiers' status indexes, so listing every version reads no status record; a
        record the index misses is read and its line added.
        """
        with self._lock:
            known = self._outcomes.get(version_id)
            if known is not None:
                return dict(known)
            listed = self._status_listed
        if listed is None:
            listed = set()
            lines: dict[str, dict[str, dict[str, Any]]] = {}
            for name in self._durable:
                if self.available(name):
                    with contextlib.suppress(StorageError):
                        tier = self._tiers[name]
                        names = {k[len(STATUS) : -len(".json")] for k in tier.list(STATUS) if k.endswith(".json")}
                        got, seg, _ = index.read(tier, "status")
                        listed |= names
                        lines[name] = {vid: d for vid, d in got.items() if vid in names}
                        with self._index_locks[name]:
                            self._index[(name, "status")] = seg
            with self._lock:
                self._status_listed = listed
                self._status_lines = lines
        found: dict[str, TierOutcome] = {}
        if version_id in listed:
            for name in self._holders(version_id):
                with self._lock:
                    line = self._status_lines.get(name, {}).get(version_id)
                if line is not None and line.get("r") is not None:
                    try:
                        found = dict(VersionStatus.model_validate(line["r"]).tiers)
                        break
                    except (ValidationError, ValueError, TypeError):
                        pass  # a damaged line: the record says
                with contextlib.suppress(StorageError):
                    data = self._tiers[name].get(status_key(version_id))
                    if data is not None:
                        try:
                            record = VersionStatus.from_json(data, source=f"{name}:{status_key(version_id)}")
                        except IntegrityError as e:
                            log.warning("ignoring damaged status record: %s", e)
                            continue
                        found = dict(record.tiers)
                        self._index_status(name, version_id, record)
                        break
        with self._lock:
            return dict(self._outcomes.setdefault(version_id, found))

    def _index_status(self, name: str, version_id: str, record: VersionStatus | None) -> None:
        """Append a status record's line (``None``: deleted) to tier ``name``'s status index."""
        line = {"id": version_id, "r": record.model_dump(mode="json") if record is not None else None}
        with self._lock:
            self._status_lines.setdefault(name, {})[version_id] = line
        with self._index_locks[name]:
            try:
                seg = self._segments(name, "status")
            except StorageError:
                return  # a reader reads the record itself
            index.try_append(self._tiers[name], "status", seg, [(version_id, line)], again=True)

    def note_outcomes(self, version_id: str, outcomes: Mapping[str, TierOutcome]) -> None:
        """Record in this process's view why tiers do not hold a version (:meth:`store_outcomes` persists it)."""
        with self._lock:
            self._outcomes[version_id] = {**self._outcomes.get(version_id, {}), **outcomes}
            if self._status_listed is not None:
                self._status_listed.add(version_id)

    def store_outcomes(self, version_id: str, on: Collection[str] | None = None) -> None:
        """Write a version's outcomes (see :meth:`note_outcomes`) to every available tier holding its manifest.

        Args:
            version_id: The version.
            on: Only these of those tiers (the ranks of a group share the work: see
                :mod:`tiercache.group.round`).
        """
        with self._outcome_lock(version_id):
            self._store_outcomes(version_id, self.outcomes(version_id), on)

    def _outcome_lock(self, version_id: str) -> threading.Lock:
        return self._outcome_locks[hash(version_id) % _OUTCOME_STRIPES]

    def record_outcomes(self, version_id: str, outcomes: Mapping[str, TierOutcome]) -> None:
        """Record why tiers do not hold a version, on every available tier that holds its manifest."""
        with self._outcome_lock(version_id):
            merged = {**self.outcomes(version_id), **outcomes}
            self._store_outcomes(version_id, merged)

    def clear_outcome(self, version_id: str, tier: str) -> None:
        """Forget why ``tier`` did not hold a version (it holds it now)."""
        with self._outcome_lock(version_id):
            current = self.outcomes(version_id)
            if tier in current:
                del current[tier]
                self._store_outcomes(version_id, current)

    def _store_outcomes(self, version_id: str, outcomes: dict[str, TierOutcome],
                        on: Collection[str] | None = None) -> None:
        with self._lock:
            self._outcomes[version_id] = dict(outcomes)
            if self._status_listed is not None:
                self._status_listed.add(version_id)
        key = status_key(version_id)
        record = VersionStatus(version=version_id, tiers=outcomes) if outcomes else None
        body = record.to_json() if record is not None else None
        for name in self._holders(version_id):
            if on is not None and name not in on:
                continue
            tier = self._tiers[name]
            if body is None:
                tier.delete(key)
            else:
                tier.put(key, body)
            self._index_status(name, version_id, record)  # after the record: the record is the truth

    def _holders(self, version_id: str) -> list[str]:
        with self._lock:
            return [n for n in self._durable if version_id in self._on_tier[n] and self.available(n)]

    # ------------------------------------------------------------------ refs

    def refs(self) -> dict[str, RefRecord]:
        """Every ref as ``{"branch/main": record, "tag/best": record}``."""
        self.load()
        with self._lock:
            return {f"{k}/{n}": r for (k, n), r in sorted(self._refs.items())}

    def ref(self, kind: str, name: str) -> RefRecord | None:
        """The current record of one ref, or ``None``."""
        self.load()
        with self._lock:
            return self._refs.get((kind, name))

    def set_ref(self, record: RefRecord) -> None:
        """Record a ref move in this process's view (before or without a durable write)."""
        with self._lock:
            cur = self._refs.get((record.kind, record.name))
            if cur is None or record.seq >= cur.seq:
                self._refs[(record.kind, record.name)] = record

    def note_move(self, record: RefRecord, base: RefRecord | None, why: MoveReason = "save") -> None:
        """Record that this process moves a ref from ``base`` (the head it saw) to ``record``.

        ``TierCache.save`` calls this when it stages a version: the later commit of ``record``
        on each tier may then replace ``base`` (or one of this process's own moves since), and
        nothing else. A move that does not simply continue the ref's history (``why`` other than
        ``save``) is written to the reflog of each tier before the ref itself.
        """
        with self._lock:
            while base is not None and base in self._retracted:
                base = self._moves.get(base)
            self._moves[record] = base
            if why != "save":
                self._move_logs[record] = RefMove(
                    id=new_version_id(), kind=record.kind, name=record.name, version=record.version,
                    previous=base.version if base is not None else None, seq=record.seq, at=utcnow(), why=why,
                )
        self.set_ref(record)

    def retract(self, record: RefRecord) -> None:
        """Undo this process's view of a move whose version reached no durable tier.

        If ``record`` is still the head in this process's view, the head it replaced (skipping
        other retracted moves) is the head again, so the next save builds on a durable version.
        """
        with self._lock:
            self._retracted.add(record)
            self._move_logs.pop(record, None)
            key = (record.kind, record.name)
            if self._refs.get(key) != record:
                return
            base = self._moves.get(record)
            while base is not None and base in self._retracted:
                base = self._moves.get(base)
            if base is None:
                del self._refs[key]
            else:
                self._refs[key] = base

    def reflog(self, kind: str | None = None, name: str | None = None) -> list[RefMove]:
        """The recorded moves (rollbacks, resumes, new branches, tags), oldest first."""
        self.load()
        with self._lock:
            moves = [*self._reflog.values(), *self._move_logs.values()]
        out = {m.id: m for m in moves if (kind is None or m.kind == kind) and (name is None or m.name == name)}
        return sorted(out.values(), key=lambda m: m.id)

    def forget_reflog(self, entries: Iterable[RefMove]) -> None:
        """Delete reflog entries (expired ones, from ``gc``) from every durable tier."""
        for move in entries:
            key = reflog_key(move.kind, move.name, move.id)
            for name in self._durable:
                if self.available(name):
                    self._tiers[name].delete(key)
            with self._lock:
                self._reflog.pop(move.id, None)

    def write_ref(self, tier: str, record: RefRecord) -> bool:
        """Commit ``record`` to ``tier`` with compare-and-swap, never losing another writer's move.

        The move may replace what the tier holds only if that is the head the move was based on
        (see :meth:`note_move`; a move not noted is based on this process's current view), one
        of this process's own earlier moves of the ref, or what this tier held when this process
        last saw it while that is older than the base (a tier lagging behind another one).

        Args:
            tier: A durable tier name.
            record: The new content.

        Returns:
            Whether the ref now holds ``record``; ``False`` if a newer move of this process
            (a rollback) already replaced it there, which is left alone.

        Raises:
            ConflictError: If another writer moved the ref (or the tag exists elsewhere); this
                process's view then follows the tier, so the next save on the branch has the
                new head as its parent.
        """
        key = ref_key(record.kind, record.name)
        lk = (tier, key)
        with self._lock:
            lock = self._ref_locks.setdefault(lk, threading.Lock())
            if record not in self._moves:
                view = self._refs.get((record.kind, record.name))
                # A head read earlier (catch-up re-asserting it after its copy) is based on this
                # process's view only while that view is not newer. Once a save or rollback of
                # this process overtook it, it is based on itself: it may still bring a lagging
                # tier forward, never replace that newer move there.
                stale = view is not None and view.seq > record.seq
                self._moves[record] = record if stale else view
        t = self._tiers[tier]
        with lock:
            token, cur = self._tokens.get(lk, (None, None))
            for _ in range(_CAS_ATTEMPTS):
                if cur == record:
                    self._tokens[lk] = (token, cur)
                    return True
                if not self._may_replace(lk, record, cur):
                    return False
                self._log_move(tier, record)
                failpoint("catalog.before_ref_write")
                try:
                    new_token = t.write_ref(key, record.to_json(), expect=token)
                except ConflictError:
                    # A stale cached token, a racing writer or a write whose response was lost:
                    # judge again on what the tier holds now.
                    token, cur = self._read_ref(tier, key)
                    continue
                self._tokens[lk] = (new_token, record)
                failpoint("catalog.after_ref_write")
                return True
            raise ConflictError(f"{key} on {tier} kept changing under {_CAS_ATTEMPTS} compare-and-swap attempts")

    def _log_move(self, tier: str, record: RefRecord) -> None:
        """Write the reflog entry of ``record``'s move to ``tier`` (once), before the ref moves there."""
        with self._lock:
            move = self._move_logs.get(record)
            if move is None or (tier, move.id) in self._logged:
                return
        self._tiers[tier].put(reflog_key(move.kind, move.name, move.id), move.to_json())
        with self._lock:
            self._logged.add((tier, move.id))
            self._reflog[move.id] = move

    def ref_on(self, tier: str, kind: str, name: str) -> RefRecord | None:
        """The ref ``kind``/``name`` as tier ``tier`` holds it now (read from the tier, ``None`` if absent)."""
        return self._read_ref(tier, ref_key(kind, name))[1]

    def _read_ref(self, tier: str, key: str) -> tuple[str | None, RefRecord | None]:
        got = self._tiers[tier].read_ref(key)
        if got is None:
            return None, None
        return got.token, RefRecord.from_json(got.data, source=f"{tier}:{key}")

    def _may_replace(self, lk: tuple[str, str], record: RefRecord, cur: RefRecord | None) -> bool:
        """Whether ``record`` may replace ``cur`` on a tier (True), must leave it (False), or conflicts.

        Raises:
            ConflictError: If ``cur`` is another writer's move.
        """
        with self._lock:
            root: RefRecord | None = None
            for root in self._base_chain(record):  # lazily: the match is nearly always the first base
                if root == cur:
                    return True
            _, seen = self._tokens.get(lk, (None, None))
            if cur == seen and root is not None and (cur is None or cur.seq < root.seq):
                return True  # this tier lags behind the head we built on, and nobody moved it since
            if cur is not None and cur in self._moves and cur.seq > record.seq:
                return False  # our own later move (a rollback) overtook this one
            self._follow(lk[0], record, cur)
        if record.kind == "tag":
            other = cur.version if cur is not None else None
            raise ConflictError(f"tag {record.name!r} already points at {other}: tags never move")
        where = f"{cur.version} (seq {cur.seq})" if cur is not None else "nothing (it was deleted)"
        raise ConflictError(
            f"branch {record.name!r} on {lk[0]} was moved by another writer to {where}: version "
            f"{record.version} is stored but not on the branch; save again to build on the new head"
        )

    def _base_chain(self, record: RefRecord) -> Iterator[RefRecord | None]:
        """The heads ``record`` may replace: its base, then the bases of this process's own moves before it."""
        base = self._moves.get(record)
        for _ in range(len(self._moves) + 1):  # bounded: a cycle of moves cannot loop forever
            yield base
            if base is None or base not in self._moves:
                return
            base = self._moves[base]

    def _follow(self, tier: str, record: RefRecord, cur: RefRecord | None) -> None:
        """After a lost compare-and-swap, make another writer's head this process's view of the ref."""
        if cur is None:
            return
        self._refs[(cur.kind, cur.name)] = cur
        vid: str | None = cur.version
        while vid is not None and vid not in self._known:
            data = self._tiers[tier].get(version_key(vid))
            if data is None:
                break
            v = Version.from_json(data, source=f"{tier}:{version_key(vid)}")
            self._put_version(v)
            self._on_tier[tier].add(vid)
            vid = v.parent
        log.info("%s: another writer moved %s/%s to %s; following it", tier, record.kind, record.name, cur.version)

    # ------------------------------------------------------------------ resolution

    def resolve(self, ref: str) -> str:
        """Resolve a user ref string to a version id.

        Forms: a branch name, a tag name, a version id or unique prefix (at least 4 characters),
        each optionally followed by ``~N`` (N parents back) or ``@STEP`` (the version of that
        step in the branch's history). Branches win over tags, tags over ids.

        Raises:
            InvalidNameError: If the string is malformed.
            VersionNotFoundError: If nothing matches.
            AmbiguousRefError: If an id prefix matches several versions.
        """
        spec = parse_ref(ref)
        self.load()
        with self._lock:
            rec = self._refs.get(("branch", spec.base)) or self._refs.get(("tag", spec.base))
            vid = rec.version if rec is not None else self._match_id(spec.base, ref)
            if spec.step is not None:
                return self._at_step(vid, spec.base, spec.step, ref)
            for i in range(spec.back):
                # A pruned version keeps its place in the lineage.
                v = self._known.get(vid) or self._pruned.get(vid)
                parent = v.parent if v is not None else None
                if parent is None:
                    raise VersionNotFoundError(f"{ref!r}: history of {spec.base!r} has only {i + 1} versions")
                vid = parent
            if vid not in self._known:
                gone = self._pruned.get(vid)
                if gone is not None:
                    raise VersionNotFoundError(f"{ref!r}: version {vid} was {gone.why()}")
                raise VersionNotFoundError(f"{ref!r} points at version {vid}, which no tier holds")
            return vid

    def parent_of(self, version_id: str) -> str | None:
        """The parent of a version this catalog knows (or pruned), ``None`` if none or unknown."""
        with self._lock:
            v = self._known.get(version_id) or self._pruned.get(version_id)
            return v.parent if v is not None else None

    def _match_id(self, prefix: str, ref: str) -> str:
        if prefix in self._known:
            return prefix
        hits = sorted(v for v in self._known if v.startswith(prefix.upper()))
        if not hits and len(prefix) >= _MIN_PREFIX:
            # A pruned version resolves (for ~N) to itself; resolve() then says why it is gone.
            hits = [v for v in self._pruned if v.startswith(prefix.upper())]
        if len(hits) == 1 and len(prefix) >= _MIN_PREFIX:
            return hits[0]
        if hits:
            some = ", ".join(hits[:3]) + (", ..." if len(hits) > 3 else "")
            more = "more characters" if len(prefix) >= _MIN_PREFIX else f"at least {_MIN_PREFIX} characters"
            raise AmbiguousRefError(f"{ref!r} is ambiguous: it matches {len(hits)} version(s) ({some}): "
                                    f"give {more} of the id")
        known = ", ".join(sorted(n for _, n in self._refs)[:8]) or "none yet"
        raise VersionNotFoundError(
            f"unknown ref {ref!r}: not a branch, tag or version id (refs: {known}); see `tiercache ls`"
        )

    def _at_step(self, head: str, base: str, step: int, ref: str) -> str:
        vid: str | None = head
        while vid is not None and vid in self._known:
            v = self._known[vid]
            if v.step == step:
                return vid
            vid = v.parent
        # Not in the current history (e.g. rolled back past it): said so, with how to reach it.
        same = sorted(v.id for v in self._known.values() if v.branch == base and v.step == step)
        if same:
            raise VersionNotFoundError(f"{ref!r}: step {step} is not in {base}'s history (a rollback or resume "
                                       f"left it behind): name the version by id ({', '.join(same[-3:])}), "
                                       f"see `tiercache log --reflog {base}`")
        raise VersionNotFoundError(f"{ref!r}: no version of step {step} on {base!r}")
