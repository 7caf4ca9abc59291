"""Verify and repair: every copy of every chunk and manifest, checked against its content id.

:func:`verify` reads every copy of each version's chunks (and its manifest) on every durable tier
that holds the version's manifest, or that lists the chunk, verifies it, and reports each copy that
is missing or damaged. A tier holds a version's chunks only where it holds its manifest: an
evicted version's chunks are not expected there. A node-local tier holds only its node's part of a
version saved on several nodes (and the parts it keeps peer copies of): the node its commits
recorded on it (:meth:`Repo.node_of`), else this process's node (:func:`tiercache.config.this_node`)
tells which; on a node the version does not name, only the
chunks the tier lists are checked. With ``repair`` each bad copy is rewritten from a
good copy on another tier (never from the bad tier itself).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tiercache.config import this_node
from tiercache.errors import IntegrityError, TierCacheError
from tiercache.handle import TIER_LEVEL
from tiercache.manifest import Version
from tiercache.names import PARTS, VERSIONS, chunk_key, part_key, version_key
from tiercache.parts import check_part
from tiercache.repo.objects import read_verified

if TYPE_CHECKING:
    from tiercache.repo.repository import Repo

log = logging.getLogger("tiercache.repo.verify")


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
        sampled: With ``sample``: how many chunk copies were read, of the ``chunk_copies`` there
            are (every manifest is still checked); ``None``: every copy was read.
        chunk_copies: Chunk copies the tiers should hold (read whole unless sampled).
    """

    versions: int
    chunks: int
    copies: int
    damage: tuple[Damage, ...]
    unrepairable: tuple[str, ...] = ()
    sampled: int | None = None
    chunk_copies: int = 0

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
            "damage": [d.__dict__ for d in self.damage], "sampled": self.sampled, "chunk_copies": self.chunk_copies,
        }


def verify(repo: Repo, versions: list[Version], *, repair: bool = False, sample: int | None = None,
           progress: Callable[[int, int], None] | None = None, every_manifest: bool = False) -> VerifyReport:
    """Check every copy of the chunks and manifests of ``versions`` on every available durable tier.

    A tier should hold a chunk when it holds the manifest of a version naming it, or when it
    lists the chunk. Copies are read whole and verified against the content id. A tier that is
    down is not checked (its copies are neither good nor bad until it answers).

    Args:
        repo: The storage layer.
        versions: The versions to check.
        repair: Rewrite each missing or damaged copy from a good copy on another tier.
        sample: Read only this many chunk copies, drawn at random (a quick check; every manifest
            and part is still read); ``None``: all.
        progress: Called with the bytes of chunk copies checked so far and the bytes to check.
        every_manifest: Also read every manifest each tier lists, so that one the catalog left
            out as unreadable (its only copy damaged, or this tier's) is reported too.

    Returns:
        The report; ``report.ok`` says whether everything is (now) good.
    """
    cat = repo.catalog
    tiers = {n: t for n, t in repo.durable.items() if repo.available(n)}
    listed = {name: cat.chunks_on(name) for name in tiers}
    # (tier, chunk id) -> (nbytes, hash algo) for every copy that should be there.
    wanted: dict[tuple[str, str], tuple[int, str]] = {}
    # Whose part a node-local tier holds: what its node's commits recorded there, else this process's node.
    node_of = {name: repo.node_of(name) or this_node(repo.config)[0] for name, t in tiers.items() if t.node_local}
    # (tier, version id, rank) -> the version: a multi-rank version's part manifests each tier should hold.
    parts: dict[tuple[str, str, int], Version] = {}
    for v in versions:
        for name, tier in tiers.items():
            on = cat.manifest_on(name, v.id)
            ranks = _held_ranks(tier, v, node_of[name]) if tier.node_local and len(v.nodes) > 1 else None
            if v.ranks and on:
                for r in ranks if ranks is not None else range(v.ranks):
                    parts[(name, v.id, r)] = v
            for cid, nbytes, held in _chunk_refs(repo, v, name, ranks):
                if (on and held) or cid in listed[name]:
                    wanted[(name, cid)] = (nbytes, v.hash_algo)

    def check(item: tuple[tuple[str, str], tuple[int, str]]) -> Damage | None:
        (name, cid), (nbytes, algo) = item
        key = chunk_key(cid)
        try:
            read_verified(tiers[name], cid, nbytes, algo)
            return None
        except IntegrityError as e:
            problem: Literal["missing", "damaged"] = "damaged" if tiers[name].exists(key) else "missing"
            return Damage(name, key, problem, str(e))
        except TierCacheError as e:
            return Damage(name, key, "damaged", f"{type(e).__name__}: {e}")

    todo = sorted(wanted.items())
    if sample is not None and sample < len(todo):
        todo = sorted(random.Random().sample(todo, sample))
    total = sum(n for _, (n, _) in todo)
    done = [0]
    lock = threading.Lock()

    def checked(item: tuple[tuple[str, str], tuple[int, str]]) -> Damage | None:
        try:
            return check(item)
        finally:
            if progress is not None:
                with lock:
                    done[0] += item[1][0]
                    progress(done[0], total)

    with ThreadPoolExecutor(max(1, repo.config.io_threads), thread_name_prefix="tiercache-verify") as pool:
        found = [d for d in pool.map(checked, todo) if d is not None]
    found += _check_manifests(repo, versions, tiers)
    known = {v.id for v in versions}
    left_out = _unreadable_manifests(repo, tiers, known) if every_manifest else []
    found += left_out
    found += _check_parts(parts, tiers)
    if repair:
        found, unrepairable = _repair(repo, versions, found, wanted)
    else:
        unrepairable = _without_good_copy(found, wanted)
        unrepairable += [d.key for d in left_out if _vid(d.key) not in known]
    holes = _holes(repo, versions, tiers)
    found += holes
    unrepairable = [*unrepairable, *(d.key for d in holes)]
    for d in found:
        log.warning("verify: %s copy of %s on %s: %s%s", d.problem, d.key, d.tier, d.detail,
                    f" (repaired from {d.repaired_from})" if d.repaired_from else "")
    chunks = {cid for (_, cid), _ in todo}
    copies = len(wanted) + len(parts) + sum(cat.manifest_on(n, v.id) for v in versions for n in tiers)
    copies -= len(wanted) - len(todo)
    return VerifyReport(len(versions), len(chunks), copies, tuple(sorted(found, key=lambda d: (d.tier, d.key))),
                        tuple(sorted(unrepairable)), len(todo) if len(todo) < len(wanted) else None, len(wanted))


def _holes(repo: Repo, versions: list[Version], tiers: dict[str, Any]) -> list[Damage]:
    """Parents no tier holds that no recorded rule deleted (a pruned one is explained): damage.

    ``gc`` keeps every ancestor of what it keeps and capacity eviction keeps last copies, so a
    parent missing from every tier, with no pruned record, was lost. Asked only with a local and
    a remote tier configured and every tier answering: a disk read alone (a config without the
    bucket) lacks what was evicted from it to S3, and S3 read alone lacks what the policy or an
    outage kept on the disk only. A version saved on several nodes is left out: its parent may be
    on the other nodes' disks only.
    """
    levels = {TIER_LEVEL.get(n) for n in tiers}
    if len(tiers) < len(repo.durable) or not {"local", "remote"} <= levels:
        return []
    cat = repo.catalog
    known = {v.id for v in cat.all(whole=False)}
    where = next(iter(tiers))
    out = []
    for v in versions:
        p = v.parent
        if len(v.nodes) > 1:
            continue
        if p is not None and p not in known and cat.pruned_record(p) is None:
            out.append(Damage(where, version_key(p), "missing",
                              f"version {p}, parent of {v.id}, is on no tier and no recorded rule pruned it"))
    return out


def _held_ranks(tier: Any, v: Version, node: str) -> list[int]:
    """The ranks whose parts node ``node``'s node-local ``tier`` should hold of a version saved on several nodes.

    Its own ranks' always; those of the nodes it was chosen to hold a copy of once the copy is
    complete, which its part manifest there says (a part is written after every chunk it names):
    a version whose peer copies failed is no damage. A version written merged (an older
    tiercache, with no part manifests) counts its copies as made.
    """
    own = [r for n in v.nodes if n.name == node for r in n.ranks]
    copies = [r for n in v.nodes if node in n.copies for r in n.ranks]
    if not v.ranks:
        return sorted(own + copies)
    return sorted(own + [r for r in copies if tier.exists(part_key(v.id, r))])


def _chunk_refs(repo: Repo, v: Version, tier: str, ranks: list[int] | None) -> list[tuple[str, int, bool]]:
    """``(chunk id, raw length, whether tier holds it)`` for the chunks of ``v`` a check of ``tier`` covers.

    ``ranks``: on a node-local tier of a version saved on several nodes, the ranks whose parts it
    holds (see :func:`_held_ranks`). Of a multi-rank version whose parts could not all be read,
    the parts ``tier`` holds.
    """
    if not v.is_header:
        held = v.rank_chunk_ids(ranks) if ranks is not None else None
        return [(c.id, c.nbytes, held is None or c.id in held) for c in v.chunks]
    out = []
    for r in ranks if ranks is not None else range(v.ranks):
        part = repo.catalog.part(v, r, [tier])
        out += [(c.id, c.nbytes, True) for c in part.chunks] if part is not None else []
    return out


def _check_parts(parts: dict[tuple[str, str, int], Version], tiers: dict[str, Any]) -> list[Damage]:
    """Each part manifest a tier should hold: there, and rank ``r``'s part of its version."""
    out = []
    for (name, vid, rank), v in sorted(parts.items()):
        key = part_key(vid, rank)
        data = tiers[name].get(key)
        if data is None:
            out.append(Damage(name, key, "missing", f"rank {rank}'s part of version {vid} is not there"))
            continue
        try:
            check_part(v.header(), rank, Version.from_json(data, source=f"{name}:{key}"), f"{name}:{key}")
        except IntegrityError as e:
            out.append(Damage(name, key, "damaged", str(e)))
    return out


def _check_manifests(repo: Repo, versions: list[Version], tiers: dict[str, Any]) -> list[Damage]:
    out = []
    for v in versions:
        for name, tier in tiers.items():
            if not repo.catalog.manifest_on(name, v.id):
                continue
            key = version_key(v.id)
            data = tier.get(key)
            if data is None:
                out.append(Damage(name, key, "missing", "manifest listed but not readable"))
                continue
            try:
                if Version.from_json(data, source=f"{name}:{key}") != v.header():
                    out.append(Damage(name, key, "damaged", "manifest differs from the other tiers' copy"))
            except IntegrityError as e:
                out.append(Damage(name, key, "damaged", str(e)))
    return out


def _vid(key: str) -> str:
    return key[len(VERSIONS) : -len(".json")]


def _unreadable_manifests(repo: Repo, tiers: dict[str, Any], known: set[str]) -> list[Damage]:
    """The manifests each tier lists that :func:`_check_manifests` does not read, and that do not parse or check.

    The catalog leaves out a manifest that fails its checks: of a version no tier holds a good
    copy of (it is not in ``known``), or this tier's copy of one it read elsewhere.
    """
    out = []
    for name, tier in tiers.items():
        for key in tier.list(VERSIONS):
            vid = _vid(key)
            if not key.endswith(".json") or (vid in known and repo.catalog.manifest_on(name, vid)):
                continue
            data = tier.get(key)
            if data is None:
                continue  # deleted since it was listed (a gc)
            try:
                Version.from_json(data, source=f"{name}:{key}")
            except IntegrityError as e:
                out.append(Damage(name, key, "damaged", str(e)))
    return out


def _without_good_copy(found: list[Damage], wanted: dict[tuple[str, str], tuple[int, str]]) -> list[str]:
    bad = {(d.tier, d.key) for d in found}
    holders: dict[str, set[str]] = {}
    for name, cid in wanted:
        holders.setdefault(chunk_key(cid), set()).add(name)
    return [key for key, names in holders.items() if all((n, key) in bad for n in names)]


def _repair(repo: Repo, versions: list[Version], found: list[Damage],
            wanted: dict[tuple[str, str], tuple[int, str]]) -> tuple[list[Damage], list[str]]:
    sizes = {cid: spec for (_, cid), spec in wanted.items()}
    by_id = {v.id: v for v in versions}
    out: list[Damage] = []
    unrepairable: list[str] = []
    for d in found:
        tier = repo.durable[d.tier]
        if d.key.startswith(VERSIONS):
            vid = _vid(d.key)
            if vid not in by_id:  # no tier holds a copy that checks
                unrepairable.append(d.key)
                out.append(d)
                continue
            # The catalog's copy parsed and was checked when it was loaded: it is the good one.
            tier.put(d.key, by_id[vid].to_json())
            out.append(Damage(d.tier, d.key, d.problem, d.detail, repaired_from="catalog"))
            continue
        if d.key.startswith(PARTS):
            vid, rank = d.key[len(PARTS) : -len(".json")].split("/")
            others = [n for n in repo.durable if n != d.tier and repo.available(n)]
            part = repo.catalog.part(by_id[vid].header(), int(rank), others)
            if part is None:
                unrepairable.append(d.key)
                out.append(d)
                continue
            tier.put(d.key, part.to_json())
            out.append(Damage(d.tier, d.key, d.problem, d.detail, repaired_from="another tier"))
            continue
        cid = d.key.rsplit("/", 1)[-1]
        nbytes, algo = sizes[cid]
        others = [n for n in repo.durable if n != d.tier and repo.available(n)]
        try:
            data, src = repo.read_object(cid, nbytes, algo, order=others)
        except IntegrityError:
            unrepairable.append(d.key)
            out.append(d)
            continue
        tier.put(d.key, data)
        repo.stored(d.tier, [cid])
        out.append(Damage(d.tier, d.key, d.problem, d.detail, repaired_from=src))
    return out, sorted(set(unrepairable))
