"""The storage layer: the tiers, the catalog, the one commit path, deletion and its rules, leases.

Everything that writes a manifest or a ref, or deletes anything, on a tier goes through a
:class:`Repo`: the save engine, multi-rank saves, the DCP integration, promote, catch-up, evict and
``gc``. The rules that keep a checkpoint safe live here once:

* **Write order** (:meth:`Repo.commit`): a version's chunks are durable, then their names (a
  chunk found stored, possibly by a process that crashed before syncing its name, is synced
  once too), then the manifest, then the ref moves by compare-and-swap (its reflog entry first).
* **Chunk leases** (:mod:`tiercache.repo.leases`): a pending version leases the chunks it
  relies on on a tier from the moment it decides which to write until its commit there; nothing
  deletes a leased chunk.
* **Deletion** runs the other way (manifest, then chunks) and only drops a chunk no manifest left
  on that tier names, no pending version leases and, for an eviction, that another durable tier
  still holds (:meth:`Repo.evict`). ``gc`` (:mod:`tiercache.repo.maintenance`) uses the same
  primitives.
* **Residency** (:meth:`Repo.states`): where a version stands on each tier and why, in one place.

The repo owns the mapping of tiers: the RAM tier joins it when the engine creates its arena
(:meth:`Repo.attach_ram`), by replacing the mapping, never by mutating one others iterate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Literal

from tiercache.config import CacheConfig
from tiercache.errors import (
    IntegrityError,
    InvalidArgumentError,
    LastCopyError,
    StorageError,
    TierCacheError,
    TierUnavailableError,
)
from tiercache.failpoints import failpoint
from tiercache.manifest import MoveReason, PrunedRecord, RefRecord, TierOutcome, TierState, Version
from tiercache.names import PARTS, chunk_key, part_key, status_key, version_key
from tiercache.parts import part_of
from tiercache.repo.catalog import Catalog
from tiercache.repo.health import TierHealth
from tiercache.repo.index import Summary
from tiercache.repo.leases import Leases
from tiercache.repo.objects import read_verified
from tiercache.tiers.base import Buffer, Tier

log = logging.getLogger("tiercache.repo")

#: Where a tier's last conditional-write probe is kept for ``tiercache doctor``.
PROBE_RECORD_KEY = "stats/probe.json"
#: Which node a node-local tier belongs to, recorded by the node's commits (see :meth:`Repo.node_of`).
NODE_RECORD_KEY = "stats/node.json"

#: Reads one verified chunk object (as stored) from the best tier holding it: ``(data, tier)``.
ObjectReader = Callable[[str, int, str], tuple[bytes, str]]


class Repo:
    """The tiers of one cache and every rule about what is written to them and removed from them.

    Args:
        config: The cache config.
        tiers: The durable tiers by name, fastest first.
        health: Which of them answer now.
    """

    def __init__(self, config: CacheConfig, tiers: Mapping[str, Tier], health: TierHealth) -> None:
        self.config = config
        self.health = health
        self._durable: Mapping[str, Tier] = MappingProxyType(dict(tiers))
        self._all: Mapping[str, Tier] = self._durable
        self._ram_lock = threading.Lock()
        self.leases = Leases()
        self.catalog = Catalog(lambda: self._all, health)
        # Per tier whose names need syncing: chunks whose names this process knows are durable.
        self._synced: dict[str, set[str]] = {n: set() for n, t in tiers.items() if t.names_need_sync}
        self._probes_recorded: dict[str, datetime] = {}
        self._nodes_recorded: dict[str, str] = {}

    # ------------------------------------------------------------------ tiers

    @property
    def tiers(self) -> Mapping[str, Tier]:
        """Every tier, the RAM tier first once attached (a read-only snapshot)."""
        return self._all

    @property
    def durable(self) -> Mapping[str, Tier]:
        """The durable tiers, fastest first."""
        return self._durable

    def attach_ram(self, ram: Tier) -> None:
        """Add the RAM tier (the engine's arena) in front of the durable ones."""
        with self._ram_lock:
            self._all = MappingProxyType({ram.name: ram, **self._durable})

    def available(self, name: str) -> bool:
        """Whether tier ``name`` answers now."""
        return self.health.available(name)

    # ------------------------------------------------------------------ runtime records

    def _record_tier(self) -> Tier | None:
        # The first durable tier that answers: where a viewer on another host looks first.
        return next((t for n, t in self._durable.items() if self.health.available(n)), None)

    def put_record(self, key: str, data: bytes) -> bool:
        """Store a small runtime record (``stats/...``: the status, the meter) on the first durable tier.

        A record is an aid to viewers and to the next process, never a version's data: it is not
        leased, indexed or kept by any rule. Returns ``False`` when no durable tier answers.

        Raises:
            InvalidArgumentError: ``key`` is not under ``stats/``.
            TierCacheError: The tier refused the write.
        """
        if not key.startswith("stats/"):
            raise InvalidArgumentError(f"runtime record {key!r} must be under stats/")
        tier = self._record_tier()
        if tier is None:
            return False
        tier.put(key, data)
        return True

    def get_record(self, key: str) -> bytes | None:
        """The runtime record ``key`` from the first durable tier that answers, or ``None``.

        Raises:
            TierCacheError: The tier failed the read.
        """
        tier = self._record_tier()
        return tier.get(key) if tier is not None else None

    def _require(self, name: str) -> Tier:
        outage = self.health.outage(name)
        if outage is not None:
            raise TierUnavailableError(f"tier {name} is unavailable ({outage.reason})")
        return self._all[name]

    # ------------------------------------------------------------------ the commit path

    def claim(self, owner: str, tier: str, ids: Iterable[str]) -> set[str]:
        """Lease ``ids`` on ``tier`` for the pending version ``owner``; return those the tier lacks.

        The caller writes the returned chunks (then :meth:`stored`), relies on the others being
        there, and ends with :meth:`commit` or :meth:`release`.
        """
        self.catalog.chunks_on(tier)  # listed first, outside the leases' lock: a listing may take a while
        missing = self.leases.claim(owner, tier, ids, lambda wanted: wanted - self.catalog.chunks_on(tier))
        failpoint("repo.after_claim", tier, missing)
        return missing

    def stored(self, tier: str, ids: Iterable[str]) -> None:
        """Note chunks just written to ``tier`` (names not necessarily synced yet)."""
        self.catalog.note_chunks(tier, ids)

    def commit(self, tier: str, version: Version, ref: RefRecord | None, *, written: Iterable[str] = (),
               owner: str | None = None, held: Iterable[str] | None = None, node: str | None = None) -> None:
        """Commit ``version`` on ``tier``: chunk names, manifest, then the ref (if any).

        Every chunk of the version must be durable on ``tier``: those in ``written`` were put by
        the caller with ``sync_name=False``; the others were found there (their names are synced
        here once per process if the tier needs it, as the process that wrote them may have died
        before syncing them). ``held``: the chunks ``tier`` holds, when that is not every chunk
        of the version (a node-local tier holds its node's part of a multi-rank version), and
        ``node`` the node it belongs to, recorded on the tier for :meth:`node_of`.

        Raises:
            ConflictError: If another writer moved the ref (the version stays stored, off the branch).
            StorageError: If the tier fails.
        """
        t = self._all[tier]
        written = set(written)
        synced = self._synced.get(tier)
        if synced is not None:
            ids = {c.id for c in version.chunks} if held is None else set(held)
            unsynced = (ids - synced) | written
            if unsynced:
                t.sync_names(chunk_key(c) for c in sorted(unsynced))
                synced |= unsynced
        if node is not None:
            self._record_node(tier, t, node)
        self.catalog.add(version)
        key, data = version_key(version.id), version.to_json()
        t.put(key, data)
        if t.confirm_puts:
            # The store said 200: before a ref names the version there, it must show the manifest.
            held = t.size(key)
            if held != len(data):
                what = "no such object" if held is None else f"{held} bytes, not {len(data)}"
                raise StorageError(f"{tier} accepted the manifest of version {version.id} but does not hold it "
                                   f"({what}): the version is not committed there")
        self.catalog.mark_on(tier, version.id)
        if owner is not None:
            self.leases.release(owner, tier)  # the manifest protects its chunks from here on
        failpoint("repo.after_manifest_write")
        self.catalog.append_index(tier, version)
        if ref is not None:
            self.catalog.write_ref(tier, ref)
            self._record_probe(tier, t)

    def put_part(self, tier: str, part: Version) -> None:
        """Write a rank's part manifest of a multi-rank version to ``tier`` (durably, before the group's manifest).

        Its chunks must be there with their names synced (:meth:`sync_chunks`).
        """
        assert part.rank is not None
        self._all[tier].put(part_key(part.id, part.rank), part.to_json())
        self.catalog.add_part(part)

    def _record_node(self, name: str, tier: Tier, node: str) -> None:
        """Record on node-local ``tier`` which node it belongs to (read once per process, written on change).

        Before the manifest: a manifest that holds only a node's part is never on a tier that
        does not say whose part it is.
        """
        if self._nodes_recorded.get(name) == node:
            return
        record = json.dumps({"node": node}).encode()
        if tier.get(NODE_RECORD_KEY) != record:
            tier.put(NODE_RECORD_KEY, record)
        self._nodes_recorded[name] = node

    def node_of(self, name: str) -> str | None:
        """The node a node-local tier belongs to, as its node's commits recorded (``None``: none did).

        ``verify`` asks it, so a disk is checked for its own node's part whatever the process
        reading it is called (a CLI run on the node has no launcher variables).
        """
        try:
            data = self._durable[name].get(NODE_RECORD_KEY)
            return str(json.loads(data)["node"]) if data is not None else None
        except (ValueError, KeyError, TypeError):
            return None

    def _record_probe(self, name: str, tier: Tier) -> None:
        """Keep the tier's conditional-write probe (run before its first ref write) for ``tiercache doctor``.

        Doctor then reports it without writing anything itself.
        """
        probe = getattr(tier, "last_probe", None)
        if probe is None or self._probes_recorded.get(name) == probe[1]:
            return
        self._probes_recorded[name] = probe[1]
        record = {"probe": probe[0], "at": probe[1].isoformat()}
        with contextlib.suppress(TierCacheError):  # a note for doctor: never a reason to fail a commit
            tier.put(PROBE_RECORD_KEY, json.dumps(record).encode())

    def recorded_probe(self, name: str) -> tuple[dict[str, bool], datetime] | None:
        """The conditional-write probe a writer recorded on tier ``name``, and when (``None`` if none)."""
        data = self._durable[name].get(PROBE_RECORD_KEY)
        if data is None:
            return None
        try:
            record = json.loads(data)
            return {str(k): bool(v) for k, v in dict(record["probe"]).items()}, datetime.fromisoformat(record["at"])
        except (ValueError, KeyError, TypeError):
            return None

    def sync_chunks(self, tier: str, ids: Iterable[str]) -> None:
        """Make durable the names of chunks put on ``tier`` with ``sync_name=False``.

        A multi-rank version's ranks each sync their own chunks before the group's rank 0
        commits the manifest that names them.
        """
        synced = self._synced.get(tier)
        ids = set(ids)
        if synced is None or not ids:
            return
        self._all[tier].sync_names(chunk_key(c) for c in sorted(ids))
        synced |= ids

    def release(self, owner: str, tier: str) -> None:
        """Drop ``owner``'s leases on ``tier`` (its write there failed or was given up)."""
        self.leases.release(owner, tier)

    def store(self, owner: str, tier: str, objects: Mapping[str, Buffer]) -> list[str]:
        """Put the chunk objects ``tier`` lacks (names unsynced; commit syncs them); return their ids."""
        self._require(tier)
        missing = self.claim(owner, tier, objects)
        written = []
        for cid in sorted(missing):
            self.put_chunk(tier, cid, objects[cid])
            written.append(cid)
        return written

    def put_chunk(self, tier: str, chunk_id: str, obj: Buffer) -> None:
        """Put one chunk object on ``tier`` and note it there (its name unsynced: :meth:`sync_chunks`).

        For a chunk whose version is protected otherwise (a peer copy of a version the group is
        committing); a version's own writes lease theirs first (:meth:`store`, :meth:`claim`).
        """
        self._all[tier].put(chunk_key(chunk_id), obj, sync_name=False)
        self.stored(tier, [chunk_id])

    def copy_version(self, version: Version, to: str, read: ObjectReader,
                     progress: Callable[[int], None] | None = None, ref: RefRecord | None = None) -> int:
        """Copy a stored version onto tier ``to`` (missing chunks from the best good copy, then the manifest).

        Used by ``promote`` and to catch a tier up after an outage (then with the ``ref`` to move).

        Returns:
            Bytes copied.

        Raises:
            TierUnavailableError: If ``to`` is down.
        """
        target = self._require(to)
        owner = f"copy-{version.id}-{to}"
        self.leases.open(owner, version.parent)
        try:
            missing = self.claim(owner, to, {c.id for c in version.chunks})
            copied = 0
            written: list[str] = []
            for c in version.chunks:
                if c.id in missing and c.id not in written:
                    data, _src = read(c.id, c.nbytes, version.hash_algo)
                    target.put(chunk_key(c.id), data, sync_name=False)
                    self.stored(to, [c.id])
                    written.append(c.id)
                    copied += len(data)
                if progress:
                    progress(c.nbytes)
            if version.ranks:  # a multi-rank version: its parts, then its group manifest
                self.sync_chunks(to, written)
                for rank in range(version.ranks):
                    part = self.catalog.part(version.header(), rank)
                    if part is None:
                        raise IntegrityError(f"version {version.id}: rank {rank}'s part is on no readable tier")
                    self.put_part(to, part)
            self.commit(to, version, ref, written=written, owner=owner)
            return copied
        finally:
            self.leases.close(owner)

    def ensure_ref(self, tier: str, record: RefRecord) -> None:
        """Move ref ``record`` on ``tier``, which holds its version already, unless the tier has it so.

        Catching a tier up: a tag on a version copied there under a branch still needs its ref.
        """
        if self.catalog.ref_on(tier, record.kind, record.name) != record:
            self.catalog.write_ref(tier, record)

    def adopt(self, version: Version, tiers: Iterable[str], chunks: Iterable[str] | None = None) -> None:
        """Know ``version`` as committed on ``tiers``, with ``chunks`` there (other processes wrote parts of it).

        ``chunks`` defaults to every chunk of the version (true of a tier the whole group
        shares); a node-local tier holds only its node's part.
        """
        self.catalog.add(version)
        ids = [c.id for c in version.chunks] if chunks is None else list(chunks)
        for name in tiers:
            self.catalog.mark_on(name, version.id)
            self.catalog.note_chunks(name, ids)

    def adopt_group(self, header: Version, tier: str, own: Version, rank: int) -> None:
        """Know a multi-rank version as committed on ``tier``, with this process's part (``own``) there.

        The catalog keeps its group manifest and this rank's part: nothing of the other ranks'.
        """
        self.catalog.add_part(part_of(own, rank))
        self.catalog.add(header)
        self.catalog.mark_on(tier, header.id)
        self.catalog.note_chunks(tier, [c.id for c in own.chunks])

    def committed_on(self, version_id: str) -> list[str]:
        """Durable tiers that hold ``version_id``'s manifest (asked of the tiers where the catalog does not know).

        A tier that is down, or fails while asked, is left out: what it holds cannot be read now.
        """
        out = []
        for name, tier in self._durable.items():
            if not self.available(name):
                continue
            try:
                if self.catalog.manifest_on(name, version_id) or tier.exists(version_key(version_id)):
                    out.append(name)
            except TierCacheError as e:
                log.warning("cannot tell whether %s holds version %s: %s", name, version_id, e)
        return out

    def move_ref(self, record: RefRecord, base: RefRecord | None, why: MoveReason) -> None:
        """Move a ref (branch, rollback, tag) on every available tier that holds the version's manifest."""
        self.catalog.note_move(record, base, why)
        for name in self._durable:
            if self.catalog.manifest_on(name, record.version) and self.available(name):
                self.catalog.write_ref(name, record)

    # ------------------------------------------------------------------ deletion

    def evict(self, version_id: str, tier: str, *, by: Literal["user", "policy"],
              rule: str | None = None) -> int | None:
        """Drop ``tier``'s copy of a version: its manifest, then the chunks nothing else there needs.

        The rules, the same for the user's ``evict`` and the policy's eviction (``gc`` uses the
        same primitives): a version still being written is never dropped; a chunk that another
        version with a manifest on ``tier`` names, or that a pending version leases, stays. The
        user's evict never drops the only durable copy of a chunk (:class:`LastCopyError`: it
        moves data, it does not delete it).

        The policy's eviction (a tier's ``capacity``) keeps the keep rule (docs/design.md
        section 3): it drops only a copy another durable tier holds whole (manifest and every
        chunk), never a branch head or a tag, nor the newest version of a branch on that tier.
        Only with ``rule``, a retention the user configured (its name, e.g. ``retention
        latest = 3``), may it drop a version's last durable copy: that version is *pruned*, and
        the catalog records by which rule and when (:meth:`~tiercache.repo.catalog.Catalog.note_pruned`).

        Args:
            version_id: The version.
            tier: The tier to drop it from.
            by: ``"user"`` (the CLI's or API's ``evict``) or ``"policy"`` (capacity eviction).
            rule: The user-set retention rule the policy's eviction follows, or ``None``.

        Returns:
            Bytes freed, or ``None`` if the policy's eviction was refused.

        Raises:
            LastCopyError: (``by="user"``) If a chunk would be left with no durable copy.
            TierUnavailableError: If ``tier`` is down.
        """
        self._require(tier)
        cat = self.catalog
        version = cat.materialize(cat.peek(version_id))
        if version_id in self.leases.pending():
            if by == "policy":
                return None
            raise LastCopyError(f"version {version_id} is still being written: wait for it, then evict it")
        others = [n for n in self._durable if n != tier]
        if by == "policy":
            pinned = {r.version for r in cat.refs().values()}
            staying = [v for v in cat.all() if v.id != version_id and cat.manifest_on(tier, v.id)]
            newest = not any(v.branch == version.branch and v.id > version_id for v in staying)
            if version_id in pinned or newest or not cat.manifest_on(tier, version_id):
                return None
        keep = {c for v in cat.all() if v.id != version_id and cat.manifest_on(tier, v.id) for c in cat.chunks_of(v)}
        ids = cat.chunks_of(version) & cat.chunks_on(tier)
        lonely = [i for i in ids - keep if not any(i in cat.chunks_on(n) for n in others)]
        if lonely and by == "user":
            raise LastCopyError(
                f"evicting {version_id} from {tier} would drop the last durable copy of {len(lonely)} chunk(s): "
                f"promote it to another tier first"
            )
        elsewhere = not lonely and any(cat.manifest_on(n, version_id) for n in others)
        if by == "policy" and elsewhere:
            # The catalog says another tier holds it: that tier must show it, or nothing goes (a
            # retention would then prune a copy it meant to leave on the other tier: not that either).
            doubts = [self._unproven(n, version, ids - keep) for n in others if cat.manifest_on(n, version_id)]
            if all(doubts):
                log.warning("keeping version %s on %s: no other tier shows it holds the version (%s)",
                            version_id, tier, "; ".join(doubts))
                return None
        if by == "policy" and not elsewhere and rule is None:
            return None  # the keep rule: capacity alone never drops a last copy
        if by == "policy" and not elsewhere:
            # Pruned: the record of it (rule, time, lineage) is written before anything goes.
            cat.note_pruned(PrunedRecord(version=version_id, branch=version.branch, step=version.step,
                                         parent=version.parent, nbytes=version.nbytes,
                                         created_at=version.created_at, rule=str(rule), tier=tier))
        # Reverse write order: the manifest (and its status record) first, then the chunks.
        self.drop_manifests(tier, [version_id])
        freed = sum(self.drop_chunks(tier, ids - keep).values())
        if elsewhere or by == "user":
            cat.record_outcomes(version_id, {tier: TierOutcome(state="evicted", reason=f"evicted by the {by}")})
            log.info("evicted version %s from %s (%d bytes freed)", version_id, tier, freed)
        else:
            log.info("pruned version %s from %s by %s (%d bytes freed)", version_id, tier, rule, freed)
        return freed

    def _unproven(self, name: str, version: Version, chunk_ids: set[str]) -> str:
        """Why tier ``name`` does not show that it holds ``version`` and ``chunk_ids`` (``""``: it does).

        What a capacity eviction asks before it drops a copy on the strength of another tier's
        (a store may have answered 200 and kept nothing, or lost it since): the other tier's
        manifest is read and checked whole, every chunk to be dropped is there (a HEAD on S3),
        and one of them, drawn at random, is read and verified against its id.
        """
        tier = self._durable[name]
        try:
            data = tier.get(version_key(version.id))
            if data is None:
                return f"{name} has no manifest of it"
            if Version.from_json(data, source=f"{name}:{version_key(version.id)}").id != version.id:
                return f"{name}'s manifest names another version"
            missing = sorted(c for c in chunk_ids if tier.size(chunk_key(c)) is None)
            if missing:
                return f"{name} lacks {len(missing)} of its chunks ({missing[0]}...)"
            sizes = {c.id: c.nbytes for c in version.chunks}
            known = sorted(c for c in chunk_ids if c in sizes)
            if known:
                pick = random.choice(known)
                read_verified(tier, pick, sizes[pick], version.hash_algo)
        except TierCacheError as e:
            return f"{name}: {e}"
        return ""

    def sole_copies(self, tier: str) -> list[Version]:
        """Versions whose only durable copy is on ``tier``, oldest first (capacity eviction keeps them).

        What catch-up copies onward, oldest first, when ``tier`` is full of them (see
        :meth:`evict`); a multi-rank version (whose parts a node-local tier holds only in part)
        is left out, as no single process can copy it.
        """
        cat = self.catalog
        others = [n for n in self._durable if n != tier]
        return [v for v in cat.all(whole=False) if cat.manifest_on(tier, v.id) and not v.ranks
                and not any(cat.manifest_on(n, v.id) for n in others)]

    def drop_manifests(self, tier: str, version_ids: Iterable[str]) -> None:
        """Delete manifests (and their status records) from ``tier``; the first step of any deletion."""
        t = self._all[tier]
        vids = list(version_ids)
        for vid in vids:
            t.delete(status_key(vid))
            t.delete(version_key(vid))
            self.catalog.mark_on(tier, vid, present=False)
            if t.durable:  # a multi-rank version's parts go after its group manifest
                for key in t.list(f"{PARTS}{vid}/"):
                    t.delete(key)
        self.catalog.note_gone(tier, vids)  # the index's gone lines, after the manifests

    def drop_chunks(self, tier: str, ids: Iterable[str], sizes: Mapping[str, int] | None = None) -> dict[str, int]:
        """Delete the chunks among ``ids`` that no pending version leases on ``tier``.

        The caller has checked that no manifest left on ``tier`` names them.

        Args:
            tier: The tier.
            ids: Chunk ids.
            sizes: Their stored sizes where known (else each is asked of the tier).

        Returns:
            The ids deleted, with their stored sizes.
        """
        t = self._all[tier]
        cat = self.catalog

        def named(ids: set[str]) -> set[str]:
            # A version committed on the tier since the caller decided (its lease has ended):
            # its manifest names what it relies on.
            return {cid for cid in ids if any(cat.manifest_on(tier, vid) for vid in cat.users_of(cid))}

        def delete(free: set[str]) -> dict[str, int]:
            failpoint("repo.chunks_doomed", tier, free)
            gone = {}
            for cid in sorted(free):
                size = sizes[cid] if sizes is not None and cid in sizes else t.size(chunk_key(cid)) or 0
                t.delete(chunk_key(cid))
                gone[cid] = size
            self.catalog.note_chunks(tier, free, present=False)
            return gone

        return self.leases.deletable(tier, ids, delete, named)

    def forget(self, version_ids: Iterable[str]) -> None:
        """Drop collected versions from the catalog, so listing and resolution no longer see them."""
        self.catalog.forget(version_ids)

    # ------------------------------------------------------------------ reading

    def read_object(
        self, chunk_id: str, nbytes: int, algo: str, order: Iterable[str] | None = None
    ) -> tuple[bytes, str]:
        """A verified chunk object from the first tier (in ``order``, else fastest first) with a good copy.

        Raises:
            IntegrityError: If no tier has a good copy (the message names what each one had).
        """
        # Lazily: a tier is asked whether it holds the chunk (a listing, the first time) only
        # once those before it had no good copy.
        names = order if order is not None else (
            n for n in self._all if self.available(n) and chunk_id in self.catalog.chunks_on(n))
        tried = []
        for name in names:
            try:
                return read_verified(self._all[name], chunk_id, nbytes, algo), name
            except TierCacheError as e:
                tried.append(f"{name}: {e}")
        raise IntegrityError(f"chunk {chunk_id} has no good copy on any tier ({'; '.join(tried) or 'none holds it'})")

    def states(self, version: Version | Summary, tiers: Iterable[str],
               pending: Iterable[str] = ()) -> dict[str, TierState]:
        """Where ``version`` stands on each of ``tiers``, and why where it is not held.

        Args:
            version: The version.
            tiers: The tiers to report on.
            pending: Tiers this process is still writing it to.
        """
        resid = self.catalog.residency(version)
        pending = set(pending)
        names = list(tiers)
        outcomes = self.catalog.outcomes(version.id) if any(n not in resid for n in names) else {}
        states: dict[str, TierState] = {}
        for name in names:
            if name in resid:
                states[name] = TierState("held")
            elif name in pending:
                states[name] = TierState("pending")
            elif name in outcomes:
                o = outcomes[name]
                states[name] = TierState(o.state, o.reason, o.at)
            elif (outage := self.health.outage(name)) is not None:
                states[name] = TierState("absent", f"{name} is unavailable, so what it holds is unknown "
                                                   f"({outage.reason})")
            else:
                states[name] = TierState("absent")
        return states

    def close(self) -> None:
        """Stop the health probes and close every tier."""
        self.health.close()
        for t in self._all.values():
            t.close()
